"""Train a Swin Transformer: `python train.py` (digits on the CPU), or e.g.
`torchrun --nproc-per-node 8 train.py experiment=imagenet_swin_tiny data.root=/path/to/imagenet`.

On a SLURM cluster through Hydra's submitit launcher (one task per GPU, one DDP run over all of them):
`python train.py -m hydra/launcher=slurm hydra.launcher.nodes=2 experiment=imagenet_swin_tiny data.root=...`.

Configuration: configs/train.yaml and its groups (model/, data/, experiment/, hydra/launcher/); the loop:
swin/train/loop.py (docs/design.md).
"""
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import swin.config  # noqa: F401  (registers the config schemas before Hydra composes)

# exit status of a run stopped by the cluster's signal (time limit, preemption) after saving last.pt
EXIT_PREEMPTED = 3
EXIT_INTERRUPTED = 130  # the shell's status for a process ended by SIGINT
EXIT_PROCESS_LOST = 4  # another process of a multi-process run died or hung; last.pt is intact


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    from swin.data.folder import CorruptImageError
    from swin.models.pretrained import CheckpointError
    from swin.train.distributed import ProcessLost
    from swin.train.loop import ConfigError, NonFiniteLossError, train
    from swin.train.preemption import Interrupted, Preempted

    try:
        train(cfg, HydraConfig.get().runtime.output_dir)
    except Preempted as e:
        print(f"stopped: {e}", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)
    except Interrupted as e:  # Ctrl-C: last.pt written after the update in flight
        print(f"stopped: {e}", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except KeyboardInterrupt:  # a second Ctrl-C, or one outside the training loop
        print("stopped: interrupted (Ctrl-C) at once; rerun the same command to resume from the last checkpoint",
              file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except (ConfigError, NonFiniteLossError, CheckpointError, FileNotFoundError) as e:  # the message, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except CorruptImageError as e:  # raised in a loader worker, it comes back with the worker's traceback
        print(f"error: {CorruptImageError.message_of(e)}", file=sys.stderr)
        sys.exit(2)
    except ProcessLost as e:  # another process of the run died or hangs: this one stops instead of waiting
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_PROCESS_LOST)


if __name__ == "__main__":
    from swin.cli import preflight

    # --help with each key's description (the schema's), a bad override in one line; then Hydra's app
    status = preflight("train", sys.argv[1:])
    if status is not None:
        sys.exit(status)
    main()
