"""The training loop behind train.py, in the order it runs.

``train(cfg, run_dir)`` checks the config and joins the process group (torchrun, or a submitit / srun job
of several tasks: swin.distributed); ``setup`` builds data,
model, optimizer, scheduler, loss, AMP and EMA into a :class:`Run`; ``resume`` continues from a checkpoint
when there is one; ``train_one_epoch`` runs the updates of an epoch (``train_step``: micro-batches with
DDP no_sync; ``apply_update``: clipping and the non-finite guard); ``evaluate_epoch`` validates;
``finish_epoch`` / ``save_checkpoint`` / ``write_summary`` write checkpoints, train.log and summary.json
into the run directory (rank 0 only).

The steady-state step never waits for the device: batches arrive on the device one step ahead
(swin.data.DeviceLoader), a non-finite loss or gradient skips the update on the device (swin.guard),
and the host reads the device counters only at check points (see train_one_epoch). The cluster's stop signal
(swin.preemption) is acted upon at check points too: last.pt, then a requeue.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.nn as nn
from omegaconf import DictConfig, ListConfig, OmegaConf
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3, dispatch_clip_grad
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from . import MODEL_CONFIGS, create_model
from .data import augment_mode, build_datasets, build_loaders, check_decode, decode_mode
from .distributed import (
    DistInfo,
    all_gather_object,
    all_reduce_sum,
    barrier,
    broadcast_object,
    cleanup,
    env_world_size,
    export_job_environment,
    init_distributed,
    pick_device,
)
from .guard import (
    EmaUpdater,
    StepStats,
    nonfinite_flags,
    poison_grads_if_nonfinite,
    step_unless,
    supports_found_inf,
)
from .preemption import Preempted, PreemptionFlag
from .train_state import capture_rng, load_train_state, remove_stale_temporaries, restore_rng, save_train_state

log = logging.getLogger("swin.train")

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that record CUDA graphs
# optimizers (timm names of torch.optim classes) built with fused=True on CUDA: their kernels skip a
# non-finite step on the device (see swin.guard)
FUSED_OPTS = ("adamw", "adam")


class ConfigError(ValueError):
    """A configuration that cannot work; raised before training starts, the message names the fix."""


class NonFiniteLossError(RuntimeError):
    """Too many non-finite losses (or gradients) in a row."""


# --- configuration checks ------------------------------------------------------------------------
def _model_arch(cfg_model: DictConfig) -> dict[str, Any]:
    """The architecture create_model will build: registry defaults overridden by the config."""
    arch = dict(MODEL_CONFIGS.get(cfg_model.name, {}))
    arch.update({k: v for k, v in cfg_model.items() if v is not None})
    return arch


def _size(key: str, value: Any) -> tuple[int, int]:
    """model.<key> as (height, width): an int, or [height, width] as create_model takes it."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    if isinstance(value, (list, tuple, ListConfig)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        return int(value[0]), int(value[1])
    raise ConfigError(f"model.{key}={value!r}: use an integer or [height, width] (integers)")


# Value ranges; the types come from the schema (swin/config.py), which Hydra checks when it composes.
AT_LEAST = {  # key: lowest accepted value (null is accepted where the schema allows it)
    "train.epochs": 1, "train.batch_size": 1, "train.accum_steps": 1, "train.eval_batch_size": 1,
    "train.lr_base_size": 1, "train.eval_every": 1, "train.max_nonfinite": 1, "logger.log_every_steps": 1,
    "data.train_limit": 1, "data.val_limit": 1, "train.warmup_epochs": 0, "train.save_every_epochs": 0,
    "train.save_every_steps": 0, "train.lr": 0, "train.min_lr": 0, "train.warmup_lr": 0, "train.weight_decay": 0,
    "train.mixup": 0, "train.cutmix": 0, "data.num_workers": 0,
}
FRACTIONS = ("train.label_smoothing", "train.ema_decay", "train.mixup_prob", "train.mixup_switch_prob")


def check_ranges(cfg: DictConfig) -> None:
    """One line naming the key and what it accepts for a value of the right type but out of range."""
    for key, lowest in AT_LEAST.items():
        value = OmegaConf.select(cfg, key)
        if value is not None and value < lowest:
            raise ConfigError(f"{key}={value}: set {key} to {lowest} or more")
    for key in FRACTIONS:
        value = OmegaConf.select(cfg, key)
        if not 0 <= value <= 1:
            raise ConfigError(f"{key}={value}: set {key} between 0 and 1")


def check_config(cfg: DictConfig, world_size: int, device: torch.device) -> None:
    """Reject configurations that would fail (or silently misbehave) later, before any work is done."""
    t, m = cfg.train, cfg.model
    if m.name not in MODEL_CONFIGS:
        raise ConfigError(f"unknown model {m.name!r}; use model=<{'|'.join(sorted(MODEL_CONFIGS))}>")
    check_ranges(cfg)
    if t.get("require_pretrained") and not m.get("pretrained"):
        raise ConfigError("this experiment fine-tunes pretrained weights: pass model.pretrained=PATH (a timm, "
                          "official Microsoft or train.py checkpoint) or model.pretrained=timm:<name.tag>")
    if t.warmup_epochs >= t.epochs:
        raise ConfigError(f"train.warmup_epochs={t.warmup_epochs} leaves no epoch after warm-up "
                          f"(train.epochs={t.epochs}); lower train.warmup_epochs")
    per_update = world_size * t.accum_steps
    if t.batch_size % per_update:
        raise ConfigError(
            f"train.batch_size={t.batch_size} is not divisible by train.accum_steps ({t.accum_steps}) x processes "
            f"({world_size}) = {per_update}; set train.batch_size to a multiple of {per_update} "
            f"(e.g. {max(1, round(t.batch_size / per_update)) * per_update}) or change train.accum_steps")
    micro = t.batch_size // per_update
    if (t.mixup > 0 or t.cutmix > 0) and micro % 2:
        raise ConfigError(f"mixup/cutmix need an even micro-batch, got {micro} (train.batch_size / accum_steps / "
                          "processes); change train.batch_size or train.accum_steps")
    if t.opt_fused not in ("auto", True, False):
        raise ConfigError(f"train.opt_fused={t.opt_fused!r}: use auto, true or false")
    if t.opt_fused is True and t.opt.lower() not in FUSED_OPTS:
        raise ConfigError(f"train.opt_fused=true needs train.opt={' or '.join(FUSED_OPTS)} (torch's fused kernels); "
                          f"set train.opt_fused=auto for train.opt={t.opt}")
    if t.get("compile_mode", "default") not in COMPILE_MODES:
        raise ConfigError(f"train.compile_mode={t.compile_mode!r}: use one of {', '.join(COMPILE_MODES)}")
    if t.amp not in ("auto", *AMP_DTYPES):
        raise ConfigError(f"train.amp={t.amp!r}: use auto, bf16, fp16 or fp32")
    if m.attention == "flash_window" and device.type != "cuda":
        raise ConfigError("model.attention=flash_window needs a CUDA GPU (its Triton kernel does not run on the "
                          f"{device.type}); use model.attention=auto (flash_window on GPUs, sdpa elsewhere) "
                          "or model.attention=sdpa")
    arch = _model_arch(m)
    img, patch, window = (_size(k, arch[k]) for k in ("img_size", "patch_size", "window_size"))
    if img[0] % patch[0] or img[1] % patch[1]:
        raise ConfigError(f"model.img_size={arch['img_size']} is not a multiple of model.patch_size="
                          f"{arch['patch_size']}; change model.img_size")
    feat = (img[0] // patch[0], img[1] // patch[1])
    # Later stages may be smaller than the window (timm then uses one window of the stage's size),
    # but a window larger than the first stage's feature map is never used as configured.
    if window[0] > feat[0] or window[1] > feat[1]:
        raise ConfigError(
            f"model.window_size={arch['window_size']} is larger than the first feature map {feat[0]}x{feat[1]} "
            f"(img_size {arch['img_size']} / patch_size {arch['patch_size']}); set model.window_size<={min(feat)} "
            "or raise model.img_size")
    try:  # data.decode, and what data.decode=gpu cannot do (augmentations, interpolations it lacks)
        check_decode(cfg.data, arch["img_size"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.logger.wandb.mode not in ("online", "offline", "disabled"):
        raise ConfigError(f"logger.wandb.mode={cfg.logger.wandb.mode!r}: use online, offline or disabled")


# --- small helpers -----------------------------------------------------------------------------
class _TqdmHandler(logging.StreamHandler):
    """Console log lines that do not break the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record))


def _setup_logging(run_dir: Path, is_main: bool) -> list[logging.Handler]:
    log.setLevel(logging.INFO if is_main else logging.WARNING)
    log.propagate = False
    handlers: list[logging.Handler] = [_TqdmHandler()]
    if is_main:
        handlers.append(logging.FileHandler(run_dir / "train.log"))
    for h in handlers:
        h.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
        log.addHandler(h)
    return handlers


def seed_everything(seed: int) -> None:
    import random

    import numpy as np
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _init_wandb(cfg: DictConfig, run_dir: Path, run_id: str | None) -> Any:
    """wandb run (rank 0), or None; wandb is imported only here, only when enabled."""
    wcfg = cfg.logger.wandb
    if wcfg.mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        if wcfg.mode == "online":
            raise ConfigError("logger.wandb.mode=online but wandb is not installed; pip install wandb "
                              "or set logger.wandb.mode=disabled") from None
        log.warning("wandb is not installed: offline logging is off (pip install wandb, or set "
                    "logger.wandb.mode=disabled to silence this)")
        return None
    return wandb.init(project=wcfg.project, entity=wcfg.entity, name=wcfg.name, tags=list(wcfg.tags),
                      mode=wcfg.mode, dir=str(run_dir), id=run_id, resume="allow",
                      config=OmegaConf.to_container(cfg, resolve=True))


def evaluate(model: nn.Module, loader: Any, device: torch.device, autocast: Any) -> dict[str, float]:
    """Top-1/top-5 accuracy (percent) and mean cross-entropy over the whole (sharded) validation set."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # correct1, correct5, loss sum, count
    with torch.no_grad():
        for x, y, _ in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast:
                out = model(x)
            out = out.float()
            hits = out.topk(min(5, out.shape[1]), dim=1).indices.eq(y[:, None])  # (B, k), sorted by score
            # accumulate on the device: no host sync per batch (nor a host-to-device copy of the count)
            totals[:3] += torch.stack([hits[:, 0].sum(), hits.any(dim=1).sum(),
                                       nn.functional.cross_entropy(out, y, reduction="sum")]).double()
            totals[3] += y.shape[0]
    all_reduce_sum(totals)
    model.train(was_training)
    c1, c5, loss, n = totals.tolist()
    return {"top1": 100 * c1 / max(n, 1), "top5": 100 * c5 / max(n, 1), "loss": loss / max(n, 1), "count": int(n)}


# --- the run state -----------------------------------------------------------------------------------
@dataclass
class Run:
    """Everything a training run holds: built by setup(), advanced by train_one_epoch(), saved by
    save_checkpoint(). Counters are host values; the per-step ones live on the device in `stats`."""

    cfg: DictConfig
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
    train_loader: Any  # swin.data DeviceLoader | SyntheticLoader: normalised batches on the device
    val_loader: Any
    steps_per_epoch: int
    n_params: int
    num_classes: int
    stats: StepStats
    skip_on_device: bool  # the optimizer skips a non-finite step in its kernel (no host sync)
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
        t = self.cfg.train
        return bool(t.compile) and t.get("compile_mode", "default") in CUDAGRAPH_MODES

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / "checkpoints"


# --- set-up ------------------------------------------------------------------------------------------
def _build_optimizer(cfg: DictConfig, raw_model: nn.Module, device: torch.device,
                     steps_per_epoch: int) -> tuple[torch.optim.Optimizer, Any]:
    """timm's optimizer (fused torch AdamW/Adam where train.opt_fused says so) and per-update scheduler."""
    t = cfg.train
    scale = t.batch_size / t.lr_base_size if t.lr_base_size else 1.0  # linear scaling rule
    lr, min_lr, warmup_lr = t.lr * scale, t.min_lr * scale, t.warmup_lr * scale
    opt_kwargs: dict[str, Any] = {}
    if t.opt_eps is not None:
        opt_kwargs["eps"] = t.opt_eps
    if t.opt_betas is not None and "adam" in t.opt:
        opt_kwargs["betas"] = tuple(t.opt_betas)
    # fused kernels: one launch per step instead of a dozen foreach ones, and they skip a non-finite
    # step on the device (found_inf); on by default on CUDA only, where they are the fast path
    if t.opt_fused is True or (t.opt_fused == "auto" and device.type == "cuda" and t.opt.lower() in FUSED_OPTS):
        opt_kwargs["fused"] = True
    # timm puts norms, biases and no_weight_decay() (bias tables) in a group without weight decay,
    # and applies layer-wise lr decay through the model's group_matcher()
    optimizer = create_optimizer_v2(raw_model, opt=t.opt, lr=lr, weight_decay=t.weight_decay,
                                    momentum=t.momentum, layer_decay=t.layer_decay, **opt_kwargs)
    scheduler, _ = create_scheduler_v2(
        optimizer, sched=t.sched, num_epochs=t.epochs - t.warmup_epochs if t.warmup_prefix else t.epochs,
        warmup_epochs=t.warmup_epochs, warmup_lr=warmup_lr, min_lr=min_lr, warmup_prefix=t.warmup_prefix,
        step_on_epochs=False, updates_per_epoch=steps_per_epoch)
    return optimizer, scheduler


def _build_criterion(t: DictConfig, num_classes: int) -> tuple[nn.Module, Mixup | None]:
    if t.mixup > 0 or t.cutmix > 0:
        mixup = Mixup(mixup_alpha=t.mixup, cutmix_alpha=t.cutmix, prob=t.mixup_prob,
                      switch_prob=t.mixup_switch_prob, mode=t.mixup_mode, label_smoothing=t.label_smoothing,
                      num_classes=num_classes)
        return SoftTargetCrossEntropy(), mixup  # mixup makes (smoothed) soft targets
    if t.label_smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=t.label_smoothing), None
    return nn.CrossEntropyLoss(), None


def _build_model(cfg: DictConfig, dist: DistInfo, num_classes: int) -> nn.Module:
    """The model on its device: the same initialisation on every rank, per-rank randomness afterwards."""
    torch.manual_seed(cfg.seed)
    overrides = OmegaConf.to_container(cfg.model, resolve=True)
    for key in ("name", "pretrained", "num_classes"):
        overrides.pop(key)
    model = create_model(cfg.model.name, pretrained=cfg.model.pretrained, num_classes=num_classes, **overrides)
    model.set_grad_checkpointing(cfg.train.grad_checkpointing)
    model.to(dist.device)
    seed_everything(cfg.seed + dist.rank)
    return model


def setup(cfg: DictConfig, run_dir: Path, dist: DistInfo) -> Run:
    """Data, model, optimizer, schedule, loss, precision and EMA of a fresh run (resume() fills in the rest)."""
    t, device, world = cfg.train, dist.device, dist.world_size
    micro_batch = t.batch_size // (world * t.accum_steps)
    arch = _model_arch(cfg.model)
    data = build_datasets(cfg.data, arch["img_size"])
    train_loader, val_loader = build_loaders(data, cfg.data, device, dist.rank, world, micro_batch,
                                             t.eval_batch_size or 2 * micro_batch, cfg.seed)
    steps_per_epoch = train_loader.num_batches // t.accum_steps  # optimizer updates per epoch
    if steps_per_epoch == 0:
        raise ConfigError(f"the training set ({len(data.train)} images) is smaller than one global batch "
                          f"({t.batch_size}); lower train.batch_size")
    log.info(f"data {cfg.data.name}: {len(data.train)} train / {len(data.val)} val images, {data.num_classes} "
             f"classes; global batch {t.batch_size} = {world} x {t.accum_steps} x {micro_batch}, "
             f"{steps_per_epoch} steps/epoch")
    if decode_mode(cfg.data) == "gpu":
        how = ("read the JPEG files; a thread of this process decodes them (nvJPEG) and augments them"
               if cfg.data.get("gpu_decode_thread", False) else "decode the JPEG files (nvJPEG) and augment them")
        log.info(f"data.decode=gpu: {cfg.data.num_workers} loader worker(s) {how} on {device}")
    elif augment_mode(cfg.data) == "gpu":
        log.info(f"data.augment=gpu: {cfg.data.num_workers} loader worker(s) decode the images on the CPU; a thread "
                 f"of this process augments them on {device}")

    num_classes = cfg.model.num_classes or data.num_classes
    if num_classes < data.num_classes:
        raise ConfigError(f"model.num_classes={num_classes} but the data has {data.num_classes} classes; "
                          "set model.num_classes=null to follow the data")
    raw_model = _build_model(cfg, dist, num_classes)
    n_params = sum(p.numel() for p in raw_model.parameters())
    log.info(f"model {cfg.model.name}: {n_params / 1e6:.2f}M parameters, attention {raw_model.attention}")
    optimizer, scheduler = _build_optimizer(cfg, raw_model, device, steps_per_epoch)
    criterion, mixup = _build_criterion(t, num_classes)
    amp = t.amp if t.amp != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    ema = ModelEmaV3(raw_model, decay=t.ema_decay) if t.ema else None
    fwd_model: nn.Module = torch.compile(raw_model, mode=t.get("compile_mode", "default")) if t.compile else raw_model
    model: nn.Module = (DDP(fwd_model, device_ids=[device] if device.type == "cuda" else None)
                        if dist.enabled else fwd_model)
    skip_on_device = supports_found_inf(optimizer)
    log.info("non-finite guard: " + (
        "decided on the device (the fused optimizer skips a bad step itself), no host sync per step"
        if skip_on_device else "read on the host every update (CPU run)" if device.type == "cpu" else
        f"one host sync per update ({type(optimizer).__name__} cannot skip a step on the device; "
        "fused torch AdamW/Adam can: train.opt_fused)"))
    return Run(
        cfg=cfg, dist=dist, run_dir=run_dir, raw_model=raw_model, fwd_model=fwd_model, model=model,
        params=[p for p in raw_model.parameters() if p.requires_grad], optimizer=optimizer, scheduler=scheduler,
        scaler=torch.amp.GradScaler(device.type, enabled=amp == "fp16"),  # bf16 needs no loss scaling
        ema=ema, ema_updater=EmaUpdater(ema, raw_model) if ema is not None else None,
        criterion=criterion, mixup=mixup, amp=amp,
        autocast=torch.autocast(device.type, dtype=AMP_DTYPES[amp], enabled=amp != "fp32"),
        train_loader=train_loader, val_loader=val_loader, steps_per_epoch=steps_per_epoch,
        n_params=n_params, num_classes=num_classes, stats=StepStats(device),
        skip_on_device=skip_on_device)


def resume(run: Run) -> None:
    """Continue from this run's own last.pt, else from train.resume, if either exists."""
    t, dist = run.cfg.train, run.dist
    resume_path = None
    if dist.is_main:
        removed = remove_stale_temporaries(run.ckpt_dir)
        if removed:
            log.info(f"removed {removed} unfinished temporary checkpoint file(s) of an interrupted save")
        # this run's own last.pt wins over train.resume: rerunning a command that started from
        # train.resume=PATH must continue where it stopped, not start over from PATH
        if t.auto_resume and (run.ckpt_dir / "last.pt").is_file():
            resume_path = str(run.ckpt_dir / "last.pt")
        elif t.resume:
            resume_path = str(Path(t.resume).expanduser().resolve())
    resume_path = broadcast_object(resume_path)
    if resume_path:
        state = load_train_state(resume_path)
        run.raw_model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
        run.scheduler.load_state_dict(state["scheduler"])
        run.scaler.load_state_dict(state["scaler"])
        if run.ema is not None and state.get("ema") is not None:
            run.ema.module.load_state_dict(state["ema"])  # in place: the EmaUpdater's tensors stay valid
        run.epoch, run.step_in_epoch, run.global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
        run.best_top1, run.best_epoch = state["best_top1"], state["best_epoch"]
        run.nonfinite_total, run.skipped_total = state["nonfinite_steps"], state["skipped_images"]
        run.history, run.wandb_id = state["history"], state.get("wandb_id")
        run.stats = StepStats(run.device, nonfinite_total=run.nonfinite_total)
        if state.get("world_size") == dist.world_size and state.get("rng") is not None:
            restore_rng(state["rng"][dist.rank])
        else:  # another process count: fresh per-rank streams, still reproducible
            seed_everything(run.cfg.seed + dist.rank + 1000 * run.global_step)
        log.info(f"resumed from {resume_path}: {run.epoch} epoch(s) + {run.step_in_epoch} step(s) done")
    if run.global_step:
        run.scheduler.step_update(num_updates=run.global_step)


# --- one training step ----------------------------------------------------------------------------
def train_step(run: Run, batches: Iterator, clock: EpochClock) -> tuple[int, int]:
    """One optimizer update over train.accum_steps micro-batches; returns (images, unreadable images dropped)
    of this process. It only queues device work: nothing here waits for the device."""
    t = run.cfg.train
    loss_sum = torch.zeros((), device=run.device)
    images = skipped = 0
    for micro in range(t.accum_steps):
        x, y, dropped = clock.next_batch(batches)
        skipped += dropped
        if run.mixup is not None:
            if x.shape[0] % 2:  # mixup pairs images (a dropped corrupt image can make it odd)
                x, y = x[:-1], y[:-1]
            x, y = run.mixup(x, y)
        images += x.shape[0]
        # only the last micro-batch of an update synchronises gradients across processes
        sync = micro == t.accum_steps - 1
        with run.model.no_sync() if run.dist.enabled and not sync else nullcontext():
            if run.cudagraphs:  # a new step: outputs of the previous CUDA graph replay may be overwritten
                torch.compiler.cudagraph_mark_step_begin()
            with run.autocast:
                loss = run.criterion(run.model(x), y)
            run.scaler.scale(loss / t.accum_steps).backward()
        loss_sum += loss.detach().float()
    apply_update(run, loss_sum)
    return images, skipped


def apply_update(run: Run, loss_sum: torch.Tensor) -> None:
    """Clip and step, or skip the whole update (weights, optimizer state, EMA) when the loss on any process
    or a gradient is non-finite, decided on the device (see swin.guard)."""
    t = run.cfg.train
    # one collective per update; a NaN on any rank makes the sum NaN on all (asynchronous with NCCL)
    loss = all_reduce_sum(loss_sum) / (t.accum_steps * run.dist.world_size)
    scaling = run.scaler.is_enabled()
    if scaling:
        poison_grads_if_nonfinite(run.params, loss)  # the scaler then skips a non-finite loss too
        run.scaler.unscale_(run.optimizer)
    # gradients are identical on all ranks after DDP's all-reduce, so every rank decides the same
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in run.params if p.grad is not None])
    loss_bad, skip = nonfinite_flags(loss, grad_norm)
    if t.clip_grad:
        if t.clip_mode == "norm":  # what timm's dispatch_clip_grad does, reusing the norm computed above
            torch.nn.utils.clip_grads_with_norm_(run.params, t.clip_grad, grad_norm)
        else:
            dispatch_clip_grad(run.params, t.clip_grad, mode=t.clip_mode)
    if scaling:
        run.scaler.step(run.optimizer)  # skips on found_inf: sync-free for fused optimizers
        run.scaler.update()
    else:
        step_unless(run.optimizer, skip, run.skip_on_device)
    run.optimizer.zero_grad(set_to_none=True)
    if run.ema_updater is not None:
        run.ema_updater.update(run.global_step, skip)
    # overflowing fp16 gradients are the scaler's routine (skip, lower the scale): not counted
    run.stats.record(loss, loss_bad, counted=loss_bad if scaling else skip)


# --- one epoch ------------------------------------------------------------------------------------
@dataclass
class EpochClock:
    """Host-side timing of an epoch's updates after its first (loader start-up and compilation excluded):
    images/s and the fraction of wall time spent blocked in next(loader). Both are taken at check points,
    where the device has been synchronised, so host time there is device time."""

    t_first: float | None = None  # end of the first update (synchronised)
    t_last: float | None = None  # last check point
    images: int = 0  # images of the timed updates, all processes
    data_wait: float = 0.0  # seconds blocked in next(loader) during the timed updates (this process)

    def next_batch(self, batches: Iterator) -> Any:
        t0 = time.perf_counter()
        batch = next(batches)
        if self.t_first is not None:
            self.data_wait += time.perf_counter() - t0
        return batch

    def count(self, images: int) -> None:
        """An update of `images` images (all processes) was queued."""
        if self.t_first is not None:
            self.images += images

    def mark(self) -> None:
        """A check point: the device is synchronised, all counted updates are done."""
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        self.t_last = now

    def images_per_sec(self) -> float:
        span = (self.t_last or 0.0) - (self.t_first or 0.0)
        return self.images / span if self.images and span > 0 else 0.0

    def data_wait_fraction(self) -> float | None:
        span = (self.t_last or 0.0) - (self.t_first or 0.0)
        return min(1.0, self.data_wait / span) if span > 0 else None


@dataclass
class _Reads:
    """Host copies of StepStats at the last read and the last log line (for windowed means)."""

    nonfinite_total: int = 0
    bar: tuple[float, int] = (0.0, 0)  # (loss sum, finite updates) at the last read
    log: tuple[float, int] = (0.0, 0)  # ... at the last log line


def _window_mean(now: tuple[float, int], before: tuple[float, int]) -> float:
    n = now[1] - before[1]
    return (now[0] - before[0]) / n if n > 0 else math.nan


def check_point(run: Run, reads: _Reads, clock: EpochClock, epoch: int, step: int, bar: tqdm) -> tuple[float, int]:
    """Synchronise and read the device counters: warn about skipped updates, stop after train.max_nonfinite
    in a row, refresh the progress bar, and write the log line at log intervals. Returns the epoch's
    (finite loss sum, finite updates) so far."""
    t = run.cfg.train
    counts = run.stats.read()  # the sync
    clock.mark()
    loss_sum, n = counts.loss_sum, counts.finite
    if counts.total > reads.nonfinite_total:
        log.warning(f"non-finite loss or gradients in {counts.total - reads.nonfinite_total} update(s) up to epoch "
                    f"{epoch + 1} step {step + 1}: skipped, weights unchanged ({counts.streak} in a row now, longest "
                    f"{counts.longest_streak} since the last check, {counts.total} in total)")
    reads.nonfinite_total = run.nonfinite_total = counts.total
    if counts.longest_streak >= t.max_nonfinite:
        raise NonFiniteLossError(
            f"stopping: the loss or the gradients were non-finite for {counts.longest_streak} updates in a row "
            f"(train.max_nonfinite={t.max_nonfinite}); the last good checkpoint is {run.ckpt_dir / 'last.pt'}. "
            "Lower train.lr, keep train.clip_grad on, or use train.amp=bf16/fp32 instead of fp16")
    cur_lr = run.optimizer.param_groups[0]["lr"]
    ips, wait = clock.images_per_sec(), clock.data_wait_fraction()
    bar.set_postfix(loss=f"{_window_mean((loss_sum, n), reads.bar):.4f}", lr=f"{cur_lr:.2e}", img_s=f"{ips:.0f}",
                    data_wait="-" if wait is None else f"{wait:.0%}", refresh=False)
    reads.bar = (loss_sum, n)
    if run.global_step % run.cfg.logger.log_every_steps == 0:
        loss = _window_mean((loss_sum, n), reads.log)
        reads.log = (loss_sum, n)
        log.info(f"epoch {epoch + 1} step {step + 1}/{run.steps_per_epoch} loss {loss:.4f} lr {cur_lr:.3e} "
                 f"img/s {ips:.0f} data-wait {'-' if wait is None else f'{wait:.1%}'}")
        if run.wandb_run is not None:
            record = {"train/loss": loss, "train/lr": cur_lr, "train/images_per_sec": ips}
            if wait is not None:
                record["train/data_wait_fraction"] = wait
            run.wandb_run.log(record, step=run.global_step)
    return loss_sum, n


def train_one_epoch(run: Run, epoch: int) -> dict[str, Any]:
    """The updates of one epoch (from run.step_in_epoch on); returns the epoch's training record.

    The device is synchronised only at check points: after the epoch's first update, at log lines (every
    logger.log_every_steps updates), before mid-epoch checkpoints and at the end; each sync idles the GPU while
    the host queues the next update. The device keeps the longest run of non-finite updates since the last
    read, so a run with train.max_nonfinite of them in a row stops at the next check point; the skipped updates
    never change the weights.
    """
    t = run.cfg.train
    # resuming mid-epoch: skip what this rank already consumed, in the same order
    run.train_loader.set_epoch(epoch, start_batch=run.step_in_epoch * t.accum_steps)
    run.model.train()
    run.stats.new_epoch()
    reads, clock = _Reads(nonfinite_total=run.nonfinite_total), EpochClock()
    bar = tqdm(total=run.steps_per_epoch, initial=run.step_in_epoch, desc=f"epoch {epoch + 1}/{t.epochs}",
               disable=not (run.dist.is_main and run.cfg.logger.progress), dynamic_ncols=True, leave=False)
    batches = iter(run.train_loader)
    cpu_decoded_before = getattr(run.train_loader, "cpu_decoded", 0)  # data.decode=gpu: files nvJPEG cannot decode
    first, epoch_skipped, epoch_loss = run.step_in_epoch, 0, (0.0, 0)
    for step in range(run.step_in_epoch, run.steps_per_epoch):
        images, skipped = train_step(run, batches, clock)
        clock.count(images * run.dist.world_size)
        epoch_skipped += skipped
        run.global_step += 1
        run.scheduler.step_update(num_updates=run.global_step)
        bar.update(1)
        save_now = bool(t.save_every_steps) and run.global_step % t.save_every_steps == 0
        save_now = save_now and step + 1 < run.steps_per_epoch  # the epoch end saves anyway
        if (step == first or step + 1 == run.steps_per_epoch or save_now
                or run.global_step % run.cfg.logger.log_every_steps == 0):
            epoch_loss = check_point(run, reads, clock, epoch, step, bar)
            # the epoch's end is left to finish_epoch, which saves anyway (then _run stops)
            if step + 1 < run.steps_per_epoch and run.preemption.agreed(run.device):
                bar.close()
                stop_for_preemption(run, epoch, step + 1)
        if save_now:
            save_checkpoint(run, "last.pt", epoch, step + 1)
    bar.close()
    run.step_in_epoch = 0
    counts = torch.tensor([epoch_skipped, getattr(run.train_loader, "cpu_decoded", 0) - cpu_decoded_before],
                          device=run.device)
    epoch_skipped, cpu_decoded = (int(v) for v in all_reduce_sum(counts).tolist())
    run.skipped_total += epoch_skipped
    wait = clock.data_wait_fraction()
    return {"epoch": epoch + 1, "train_loss": epoch_loss[0] / max(epoch_loss[1], 1),
            "lr": run.optimizer.param_groups[0]["lr"], "images_per_sec": clock.images_per_sec(),
            "data_wait_fraction": wait, "skipped_images": epoch_skipped, "cpu_decoded_images": cpu_decoded}


# --- evaluation -------------------------------------------------------------------------------------
def evaluate_epoch(run: Run) -> dict[str, Any]:
    """Validation metrics of the model and, with EMA, of the EMA weights (then the ones judged and kept)."""
    metrics = evaluate(run.fwd_model, run.val_loader, run.device, run.autocast)
    out = {"top1": metrics["top1"], "top5": metrics["top5"], "val_loss": metrics["loss"]}
    if run.ema is not None:  # as timm: with EMA, the EMA weights are the ones judged and kept as best
        ema_metrics = evaluate(run.ema.module, run.val_loader, run.device, run.autocast)
        out = {"model_top1": metrics["top1"], "top1": ema_metrics["top1"], "top5": ema_metrics["top5"],
               "val_loss": ema_metrics["loss"]}
    return out


# --- checkpoints and outputs ----------------------------------------------------------------------
def save_checkpoint(run: Run, name: str, epoch: int, step: int) -> None:
    """All ranks call this (RNG states are gathered); rank 0 writes. Called after a check point, so that the
    non-finite count is current (skipped updates never reach the weights; save_train_state also refuses NaN)."""
    rngs = all_gather_object(capture_rng())
    if not run.dist.is_main:
        return
    save_train_state(run.ckpt_dir / name, {
        "model": run.raw_model.state_dict(), "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict(),
        "ema": run.ema.module.state_dict() if run.ema is not None else None,  # loadable as model weights
        "epoch": epoch, "step_in_epoch": step, "global_step": run.global_step,
        "best_top1": run.best_top1, "best_epoch": run.best_epoch, "nonfinite_steps": run.nonfinite_total,
        "skipped_images": run.skipped_total, "history": run.history, "rng": rngs,
        "world_size": run.dist.world_size, "wandb_id": run.wandb_run.id if run.wandb_run is not None else run.wandb_id,
        "config": OmegaConf.to_container(run.cfg, resolve=True),
    })


def stop_for_preemption(run: Run, epoch: int, step: int, saved: bool = False) -> NoReturn:
    """The cluster's signal arrived (on any process): write last.pt now, unless just written, and stop."""
    if not saved:
        save_checkpoint(run, "last.pt", epoch, step)
    raise Preempted(f"{run.preemption.signum.name} received (time limit or preemption): saved "
                    f"{run.ckpt_dir / 'last.pt'} after {epoch} epoch(s) + {step} step(s); the requeued job, or "
                    "the same command, continues from it")


def finish_epoch(run: Run, record: dict[str, Any]) -> None:
    """Record the epoch, log it, and write last.pt (and best.pt / epoch_XXXX.pt when due)."""
    t, epoch = run.cfg.train, record["epoch"]
    run.history.append(record)
    run.epoch = epoch
    is_best = "top1" in record and record["top1"] > run.best_top1
    if is_best:
        run.best_top1, run.best_epoch = record["top1"], epoch
    wait = record["data_wait_fraction"]
    log.info(f"epoch {epoch}/{t.epochs}: train loss {record['train_loss']:.4f}"
             + (f", val top1 {record['top1']:.2f}% top5 {record['top5']:.2f}%" if "top1" in record else "")
             + f", {record['images_per_sec']:.0f} img/s"
             + (f", {wait:.1%} of the time waiting for data" if wait is not None else "")
             + (f", {record['skipped_images']} unreadable images skipped" if record["skipped_images"] else "")
             + (f", {record['cpu_decoded_images']} images decoded on the CPU (nvJPEG cannot decode them: CMYK, "
                "non-JPEG or damaged files)" if record.get("cpu_decoded_images") else ""))
    if run.wandb_run is not None:
        run.wandb_run.log({f"epoch/{k}": v for k, v in record.items() if v is not None}, step=run.global_step)
    save_checkpoint(run, "last.pt", epoch, 0)
    if is_best:
        save_checkpoint(run, "best.pt", epoch, 0)
    if t.save_every_epochs and epoch % t.save_every_epochs == 0:
        save_checkpoint(run, f"epoch_{epoch:04d}.pt", epoch, 0)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def write_summary(run: Run, train_time: float) -> dict[str, Any]:
    """summary.json (rank 0): last-epoch (steady-state) throughput and data-wait fraction, and the history."""
    t, history = run.cfg.train, run.history
    last = history[-1] if history else {}
    rates = [r["images_per_sec"] for r in history if r.get("images_per_sec")]
    waits = [r["data_wait_fraction"] for r in history if r.get("data_wait_fraction") is not None]
    summary = {
        "model": run.cfg.model.name, "data": run.cfg.data.name, "params": run.n_params,
        "world_size": run.dist.world_size, "epochs": len(history), "global_step": run.global_step,
        "best_top1": run.best_top1 if run.best_top1 >= 0 else None,
        "best_epoch": run.best_epoch if run.best_epoch > 0 else None,
        "final_top1": last.get("top1"), "final_top5": last.get("top5"), "final_train_loss": last.get("train_loss"),
        "images_per_sec": rates[-1] if rates else None,  # last epoch: steady state
        "images_per_sec_mean": _mean(rates),
        # time blocked in next(loader) / wall time (rank 0, last epoch): near 0 when the model is the limit
        "data_wait_fraction": last.get("data_wait_fraction"),
        "data_wait_fraction_mean": _mean(waits),
        "train_time_sec_this_run": train_time,
        "nonfinite_steps": run.nonfinite_total, "skipped_images": run.skipped_total,
        # data.decode=gpu: images nvJPEG could not decode, decoded on the CPU instead (all epochs)
        "cpu_decoded_images": sum(r.get("cpu_decoded_images", 0) for r in history),
        "amp": run.amp, "ema": bool(t.ema), "compile": bool(t.compile), "history": history,
    }
    if run.dist.is_main:
        tmp = run.run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, run.run_dir / "summary.json")
        wait = summary["data_wait_fraction"]
        log.info(f"done: best top1 {summary['best_top1']}, final top1 {summary['final_top1']}, "
                 f"{summary['images_per_sec'] or 0:.0f} img/s"
                 + (f", {wait:.1%} waiting for data" if wait is not None else "")
                 + f"; {run.run_dir / 'summary.json'}")
        if run.wandb_run is not None:
            run.wandb_run.summary.update({k: v for k, v in summary.items() if k != "history"})
            run.wandb_run.finish()
    return summary


# --- the training run -----------------------------------------------------------------------------
def train(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Train as `cfg` says, writing into run_dir; returns the summary (also summary.json on rank 0)."""
    try:
        device = pick_device(cfg.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    export_job_environment()  # a submitit / srun job of several tasks: torchrun's variables from the job
    check_config(cfg, env_world_size(), device)
    dist = init_distributed(cfg.device)
    # every rank uses rank 0's run directory (timestamps in hydra.run.dir may differ between ranks)
    run_dir = Path(broadcast_object(str(Path(run_dir).resolve())))
    if dist.is_main:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    barrier()
    handlers = _setup_logging(run_dir, dist.is_main)
    preemption = PreemptionFlag()
    preemption.install()
    try:
        return _run(cfg, run_dir, dist, preemption)
    except Preempted as e:
        log.warning(str(e))
        preemption.requeue(dist.is_main)
        raise
    finally:
        preemption.uninstall()
        for h in handlers:
            log.removeHandler(h)
            h.close()
        cleanup()


def _run(cfg: DictConfig, run_dir: Path, dist: DistInfo, preemption: PreemptionFlag) -> dict[str, Any]:
    log.info(f"run dir {run_dir}, device {dist.device}, {dist.world_size} process(es)")
    run = setup(cfg, run_dir, dist)
    run.preemption = preemption
    resume(run)
    if dist.is_main:
        run.wandb_run = _init_wandb(cfg, run_dir, run.wandb_id)
    t, t_start = cfg.train, time.perf_counter()
    for epoch in range(run.epoch, t.epochs):
        record = train_one_epoch(run, epoch)
        if (epoch + 1) % t.eval_every == 0 or epoch + 1 == t.epochs:
            record.update(evaluate_epoch(run))
        finish_epoch(run, record)
        if epoch + 1 < t.epochs and preemption.agreed(dist.device):
            stop_for_preemption(run, epoch + 1, 0, saved=True)
    summary = write_summary(run, time.perf_counter() - t_start)
    barrier()
    return summary
