"""Train a Swin Transformer: `python train.py` (digits on the CPU), or e.g.
`torchrun --nproc-per-node 8 train.py experiment=imagenet_swin_tiny data.root=/path/to/imagenet`.

Configuration: configs/train.yaml and its groups (model/, data/, experiment/); the loop: swin/engine.py.
"""
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    from swin.checkpoint import CheckpointError
    from swin.engine import ConfigError, NonFiniteLossError, train

    try:
        train(cfg, HydraConfig.get().runtime.output_dir)
    except (ConfigError, NonFiniteLossError, CheckpointError, FileNotFoundError) as e:  # the message, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
