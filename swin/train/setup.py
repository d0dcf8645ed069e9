"""Building a fresh training run from its config: data, model, optimizer and schedule, loss, precision, EMA,
compilation and DDP (resume() in swin.train.checkpoint fills in a saved run's state)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3
from torch.nn.parallel import DistributedDataParallel as DDP

from swin.config import ConfigError, TrainAppConfig, TrainConfig, as_folder
from swin.data.datasets import augment_mode, build_datasets, decode_mode
from swin.data.loaders import build_loaders, worker_count
from swin.models.compiling import compile_model, inductor_options
from swin.models.pretrained import CheckpointError
from swin.models.registry import config_overrides, create_model
from swin.precision import FP8_MIN_FEATURES, TRAIN_AMP_CHOICES, autocast, fp8_linears, resolve_amp
from swin.train.checks import FUSED_OPTS, compile_mode, model_arch
from swin.train.distributed import DistInfo, seed_everything
from swin.train.guard import EmaUpdater, StepStats, supports_found_inf
from swin.train.state import Run

log = logging.getLogger("swin.train")


def _build_optimizer(cfg: TrainAppConfig, raw_model: nn.Module, device: torch.device,
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
    try:
        optimizer = create_optimizer_v2(raw_model, opt=t.opt, lr=lr, weight_decay=t.weight_decay,
                                        momentum=t.momentum, layer_decay=t.layer_decay, **opt_kwargs)
    except ValueError as e:  # timm: "Optimizer adamx not found in registry"
        raise ConfigError(f"train.opt={t.opt!r}: {e}; e.g. adamw, sgd, lamb (timm.optim.list_optimizers() has "
                          "them all)") from None
    _warn_if_lr_too_small(lr, scale, t.epochs * steps_per_epoch)
    try:
        scheduler, _ = create_scheduler_v2(
            optimizer, sched=t.sched, num_epochs=t.epochs - t.warmup_epochs if t.warmup_prefix else t.epochs,
            warmup_epochs=t.warmup_epochs, warmup_lr=warmup_lr, min_lr=min_lr, warmup_prefix=t.warmup_prefix,
            step_on_epochs=False, updates_per_epoch=steps_per_epoch)
    except ValueError as e:  # timm: "Unknown scheduler 'cosin'."
        raise ConfigError(f"train.sched={t.sched!r}: {e} Use cosine, tanh, step, multistep, plateau or "
                          "poly") from None
    return optimizer, scheduler


# a freshly initialised classifier needs its weights (init std 0.02) moved by about this much, in sum over the run
MIN_HEAD_TRAVEL = 0.01


def _warn_if_lr_too_small(lr: float, scale: float, updates: int) -> None:
    """One log line at start when the classifier's peak lr cannot train a new head in the run's updates: an
    Adam-type update moves each weight by about lr, so the whole run moves it by at most lr x updates."""
    if lr * updates >= MIN_HEAD_TRAVEL:
        return
    scaled = f" (train.lr scaled by batch_size / lr_base_size = {scale:g})" if scale != 1.0 else ""
    log.warning(f"lr {lr:.3g}{scaled} is too small to train a freshly initialised classifier: {updates} updates "
                f"move a weight by at most {lr * updates:.2g}, it needs about {MIN_HEAD_TRAVEL}. Raise train.lr"
                + (" or set train.lr_base_size=null" if scale != 1.0 else "")
                + " (experiment=finetune is the recipe for small datasets)")


def _build_criterion(t: TrainConfig, num_classes: int) -> tuple[nn.Module, Mixup | None]:
    if t.mixup > 0 or t.cutmix > 0:
        mixup = Mixup(mixup_alpha=t.mixup, cutmix_alpha=t.cutmix, prob=t.mixup_prob,
                      switch_prob=t.mixup_switch_prob, mode=t.mixup_mode, label_smoothing=t.label_smoothing,
                      num_classes=num_classes)
        return SoftTargetCrossEntropy(), mixup  # mixup makes (smoothed) soft targets
    if t.label_smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=t.label_smoothing), None
    return nn.CrossEntropyLoss(), None


def _build_model(cfg: TrainAppConfig, dist: DistInfo, num_classes: int) -> nn.Module:
    """The model on its device: the same initialisation on every rank, per-rank randomness afterwards."""
    torch.manual_seed(cfg.seed)
    try:
        model = create_model(cfg.model.name, pretrained=cfg.model.pretrained, num_classes=num_classes,
                             **config_overrides(cfg.model))
    except CheckpointError:
        raise
    except ValueError as e:  # an architecture the backend cannot run (flash_window's limits): one line
        raise ConfigError(str(e)) from None
    model.set_grad_checkpointing(cfg.train.grad_checkpointing)
    model.to(dist.device)
    seed_everything(cfg.seed + dist.rank)
    return model


def setup(cfg: TrainAppConfig, run_dir: Path, dist: DistInfo) -> Run:
    """Data, model, optimizer, schedule, loss, precision and EMA of a fresh run (resume() fills in the rest)."""
    t, device, world = cfg.train, dist.device, dist.world_size
    micro_batch = t.batch_size // (world * t.accum_steps)
    arch = model_arch(cfg.model)
    try:  # a data.* value that does not fit the files (a missing folder, mismatched splits): one line
        data = build_datasets(cfg.data, arch["img_size"])
        train_loader, val_loader = build_loaders(data, cfg.data, device, dist.rank, world, micro_batch,
                                                 t.eval_batch_size or 2 * micro_batch, cfg.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    steps_per_epoch = train_loader.num_batches // t.accum_steps  # optimizer updates per epoch
    if steps_per_epoch == 0:
        raise ConfigError(f"the training set ({len(data.train)} images) is smaller than one global batch "
                          f"({t.batch_size}); lower train.batch_size")
    log.info(f"data {cfg.data.name}: {len(data.train)} train / {len(data.val)} val images, {data.num_classes} "
             f"classes; global batch {t.batch_size} = {world} x {t.accum_steps} x {micro_batch}, "
             f"{steps_per_epoch} steps/epoch")
    if decode_mode(cfg.data) == "gpu":
        how = ("read the JPEG files; a thread of this process decodes them (nvJPEG) and augments them"
               if as_folder(cfg.data).gpu_decode_thread else "decode the JPEG files (nvJPEG) and augment them")
        log.info(f"data.decode=gpu: {worker_count(cfg.data)} loader worker(s) {how} on {device}")
    elif augment_mode(cfg.data) == "gpu":
        log.info(f"data.augment=gpu: {worker_count(cfg.data)} loader worker(s) decode the images on the CPU; a thread "
                 f"of this process augments them on {device}")

    num_classes = cfg.model.num_classes or data.num_classes
    if num_classes < data.num_classes:
        raise ConfigError(f"model.num_classes={num_classes} but the data has {data.num_classes} classes; "
                          "set model.num_classes=null to follow the data")
    raw_model = _build_model(cfg, dist, num_classes)
    amp = resolve_amp(t.amp, device, TRAIN_AMP_CHOICES)
    if amp == "fp8":  # before the optimizer, EMA and compilation see the model (the parameters stay the same)
        swapped = fp8_linears(raw_model, t.fp8_layers)
        log.info(f"train.amp=fp8: {len(swapped)} linear layers run their matmuls in FP8 (torchao float8 training, "
                 f"train.fp8_layers={t.fp8_layers}), the rest under bf16 autocast")
        if not swapped:
            log.warning("train.amp=fp8: no linear layer of this model is large enough to gain from FP8 (both "
                        f"features >= {FP8_MIN_FEATURES}: swin.precision.fp8_pays); it trains as with train.amp=bf16 "
                        "(train.fp8_layers=all puts every layer FP8 takes in FP8, slower on Swin)")
    n_params = sum(p.numel() for p in raw_model.parameters())
    log.info(f"model {cfg.model.name}: {n_params / 1e6:.2f}M parameters, attention {raw_model.attention}")
    optimizer, scheduler = _build_optimizer(cfg, raw_model, device, steps_per_epoch)
    criterion, mixup = _build_criterion(t, num_classes)
    ema = ModelEmaV3(raw_model, decay=t.ema_decay) if t.ema else None
    mode = compile_mode(t.compile, t.compile_mode, device, t.accum_steps)
    fwd_model: nn.Module = (compile_model(raw_model, mode, overrides=t.compile_options, memory_budget=t.memory_budget)
                            if mode else raw_model)
    why = " (train.compile=auto compiles on CUDA only)" if t.compile == "auto" else ""
    cpp = mode and inductor_options(mode, None, t.compile_options, device.type).get("cpp_wrapper")
    wrapper = ", inductor's C++ wrapper" if cpp else ""
    log.info(f"torch.compile: {mode} mode{wrapper} (compiles during the first update)" if mode
             else f"torch.compile: off{why}")
    # the model's buffers are constants (position indices, shift masks): broadcasting them every forward, DDP's
    # default, would be more collectives per step; .grad are views of the all-reduce buckets (no copy back, no
    # second set of gradient memory)
    model: nn.Module = (DDP(fwd_model, device_ids=[device] if device.type == "cuda" else None,
                            broadcast_buffers=False, gradient_as_bucket_view=True,
                            bucket_cap_mb=t.ddp_bucket_mb) if dist.enabled else fwd_model)
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
        autocast=autocast(device, amp),
        train_loader=train_loader, val_loader=val_loader, steps_per_epoch=steps_per_epoch,
        n_params=n_params, num_classes=num_classes, stats=StepStats(device),
        skip_on_device=skip_on_device, compile_mode=mode)
