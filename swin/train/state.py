"""The state of a training run: what setup() builds, the loop advances and a checkpoint saves."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from timm.data import Mixup
from timm.utils import ModelEmaV3

from swin.config import TrainAppConfig
from swin.data.loaders import BatchLoader
from swin.train.checks import CUDAGRAPH_MODES
from swin.train.distributed import DistInfo
from swin.train.guard import EmaUpdater, StepStats
from swin.train.preemption import PreemptionFlag


@dataclass
class Run:
    """Everything a training run holds: built by setup(), advanced by train_one_epoch(), saved by
    save_checkpoint(). Counters are host values; the per-step ones live on the device in `stats`."""

    cfg: TrainAppConfig
    dist: DistInfo
    run_dir: Path
    raw_model: nn.Module  # the module whose weights are saved (not compiled, not DDP-wrapped)
    fwd_model: nn.Module  # raw_model, compiled with train.compile
    model: nn.Module  # fwd_model, DDP-wrapped when distributed: what the training step calls
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    ema: ModelEmaV3 | None
    ema_updater: EmaUpdater | None
    criterion: nn.Module
    mixup: Mixup | None
    autocast: Any
    amp: str
    train_loader: BatchLoader  # normalised batches on the device
    val_loader: BatchLoader
    steps_per_epoch: int
    n_params: int
    num_classes: int
    stats: StepStats
    skip_on_device: bool  # the optimizer skips a non-finite step in its kernel (no host sync)
    compile_mode: str | None = None  # torch.compile's mode (swin.train.checks.compile_mode), None: eager
    compiled: bool = False  # the first update (which compiles) is done
    saved_step: int = -1  # global_step that last.pt holds (-1: none written or resumed from)
    epoch: int = 0  # epochs completed
    step_in_epoch: int = 0  # updates completed in the current epoch (resuming mid-epoch)
    global_step: int = 0
    best_top1: float = -1.0
    best_epoch: int = -1
    nonfinite_total: int = 0  # as of the last read of `stats`
    skipped_total: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    wandb_id: str | None = None
    wandb_run: Any = None
    preemption: PreemptionFlag = field(default_factory=PreemptionFlag)  # the cluster's stop signal (train())

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def cudagraphs(self) -> bool:
        """The compiled model replays CUDA graphs (these torch.compile modes record them)."""
        return self.compile_mode in CUDAGRAPH_MODES

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"
