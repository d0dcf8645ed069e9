"""Evaluate a checkpoint: `python eval.py checkpoint=PATH [model=<name>] [data=...]`, or under
`torchrun --nproc-per-node N eval.py ...`. Configuration: configs/eval.yaml; the loop: swin/evaluate.py.
"""
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import swin.config  # noqa: F401  (registers the config schemas before Hydra composes)


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def main(cfg: DictConfig) -> None:
    import torch

    from swin.data.folder import CorruptImageError
    from swin.evaluate import overridden_groups, run_eval
    from swin.models.pretrained import CheckpointError

    if OmegaConf.is_missing(cfg, "checkpoint"):
        print("error: give the weights to evaluate: checkpoint=PATH (ours, timm .pth/.safetensors, official "
              "Microsoft .pth) or checkpoint=timm:<model name with tag>", file=sys.stderr)
        sys.exit(2)
    hc = HydraConfig.get()
    torch.manual_seed(cfg.seed)
    try:
        run_eval(cfg, hc.runtime.output_dir, overridden_groups(hc.overrides.task))
    except (CheckpointError, FileNotFoundError, ValueError) as e:  # expected failures: the message, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except CorruptImageError as e:  # raised in a loader worker, it comes back with the worker's traceback
        print(f"error: {CorruptImageError.message_of(e)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    from swin.cli import preflight

    # --help with each key's description (the schema's), a bad override in one line; then Hydra's app
    status = preflight("eval", sys.argv[1:])
    if status is not None:
        sys.exit(status)
    main()
