"""The training loop behind train.py, readable top to bottom.

``train(cfg, run_dir)`` checks the config, joins the process group (torchrun), builds data, model,
optimizer, scheduler, loss, AMP, EMA; resumes from a checkpoint when there is one; runs the epochs
(gradient accumulation with DDP no_sync, clipping, non-finite loss guard, mid-epoch checkpoints),
evaluates, and writes checkpoints, train.log and summary.json into the run directory (rank 0 only).
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3, dispatch_clip_grad
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from . import MODEL_CONFIGS, create_model
from .data import build_datasets, build_loaders
from .distributed import (
    DistInfo,
    all_gather_object,
    all_reduce_sum,
    barrier,
    broadcast_object,
    cleanup,
    env_world_size,
    init_distributed,
    pick_device,
)
from .train_state import capture_rng, load_train_state, remove_stale_temporaries, restore_rng, save_train_state

log = logging.getLogger("swin.train")

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class ConfigError(ValueError):
    """A configuration that cannot work; raised before training starts, the message names the fix."""


class NonFiniteLossError(RuntimeError):
    """Too many non-finite losses in a row."""


# --- configuration checks ------------------------------------------------------------------------
def _model_arch(cfg_model: DictConfig) -> dict[str, Any]:
    """The architecture create_model will build: registry defaults overridden by the config."""
    arch = dict(MODEL_CONFIGS.get(cfg_model.name, {}))
    arch.update({k: v for k, v in cfg_model.items() if v is not None})
    return arch


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, (int, float)) else (int(v[0]), int(v[1]))


def check_config(cfg: DictConfig, world_size: int, device: torch.device) -> None:
    """Reject configurations that would fail (or silently misbehave) later, before any work is done."""
    t, m = cfg.train, cfg.model
    if m.name not in MODEL_CONFIGS:
        raise ConfigError(f"unknown model {m.name!r}; use model=<{'|'.join(sorted(MODEL_CONFIGS))}>")
    if t.epochs < 1:
        raise ConfigError(f"train.epochs={t.epochs}: set train.epochs to 1 or more")
    if t.get("require_pretrained") and not m.get("pretrained"):
        raise ConfigError("this experiment fine-tunes pretrained weights: pass model.pretrained=PATH (a timm, "
                          "official Microsoft or train.py checkpoint) or model.pretrained=timm:<name.tag>")
    if t.warmup_epochs >= t.epochs:
        raise ConfigError(f"train.warmup_epochs={t.warmup_epochs} leaves no epoch after warm-up "
                          f"(train.epochs={t.epochs}); lower train.warmup_epochs")
    if t.accum_steps < 1:
        raise ConfigError(f"train.accum_steps={t.accum_steps}: set it to 1 or more")
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
    if t.amp not in ("auto", *AMP_DTYPES):
        raise ConfigError(f"train.amp={t.amp!r}: use auto, bf16, fp16 or fp32")
    if m.attention == "flash_window" and device.type != "cuda":
        raise ConfigError("model.attention=flash_window needs a CUDA GPU (its Triton kernel does not run on the "
                          f"{device.type}); use model.attention=auto (flash_window on GPUs, sdpa elsewhere) "
                          "or model.attention=sdpa")
    arch = _model_arch(m)
    img, patch, window = _pair(arch["img_size"]), _pair(arch["patch_size"]), _pair(arch["window_size"])
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
            # accumulate on the device: no host sync per batch
            totals += torch.stack([hits[:, 0].sum(), hits.any(dim=1).sum(),
                                   nn.functional.cross_entropy(out, y, reduction="sum"),
                                   torch.tensor(y.shape[0], device=device)]).double()
    all_reduce_sum(totals)
    model.train(was_training)
    c1, c5, loss, n = totals.tolist()
    return {"top1": 100 * c1 / max(n, 1), "top5": 100 * c5 / max(n, 1), "loss": loss / max(n, 1), "count": int(n)}


# --- the training run --------------------------------------------------------------------------
def train(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Train as `cfg` says, writing into run_dir; returns the summary (also summary.json on rank 0)."""
    try:
        device = pick_device(cfg.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_config(cfg, env_world_size(), device)
    dist = init_distributed(cfg.device)
    # every rank uses rank 0's run directory (timestamps in hydra.run.dir may differ between ranks)
    run_dir = Path(broadcast_object(str(Path(run_dir).resolve())))
    if dist.is_main:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    barrier()
    handlers = _setup_logging(run_dir, dist.is_main)
    try:
        return _run(cfg, run_dir, dist)
    finally:
        for h in handlers:
            log.removeHandler(h)
            h.close()
        cleanup()


def _run(cfg: DictConfig, run_dir: Path, dist: DistInfo) -> dict[str, Any]:
    t, device, world = cfg.train, dist.device, dist.world_size
    ckpt_dir = run_dir / "checkpoints"
    log.info(f"run dir {run_dir}, device {device}, {world} process(es)")

    # data --------------------------------------------------------------------------------------
    micro_batch = t.batch_size // (world * t.accum_steps)
    arch = _model_arch(cfg.model)
    data = build_datasets(cfg.data, arch["img_size"])
    train_loader, sampler, val_loader = build_loaders(
        data, cfg.data, dist.rank, world, micro_batch, t.eval_batch_size or 2 * micro_batch, cfg.seed,
        pin_memory=device.type == "cuda")
    steps_per_epoch = len(train_loader) // t.accum_steps  # optimizer updates per epoch
    if steps_per_epoch == 0:
        raise ConfigError(f"the training set ({len(data.train)} images) is smaller than one global batch "
                          f"({t.batch_size}); lower train.batch_size")
    log.info(f"data {cfg.data.name}: {len(data.train)} train / {len(data.val)} val images, {data.num_classes} "
             f"classes; global batch {t.batch_size} = {world} x {t.accum_steps} x {micro_batch}, "
             f"{steps_per_epoch} steps/epoch")

    # model (same initialisation on every rank; per-rank randomness afterwards) -------------------
    num_classes = cfg.model.num_classes or data.num_classes
    if num_classes < data.num_classes:
        raise ConfigError(f"model.num_classes={num_classes} but the data has {data.num_classes} classes; "
                          "set model.num_classes=null to follow the data")
    torch.manual_seed(cfg.seed)
    overrides = OmegaConf.to_container(cfg.model, resolve=True)
    for key in ("name", "pretrained", "num_classes"):
        overrides.pop(key)
    raw_model = create_model(cfg.model.name, pretrained=cfg.model.pretrained, num_classes=num_classes, **overrides)
    raw_model.set_grad_checkpointing(t.grad_checkpointing)
    raw_model.to(device)
    seed_everything(cfg.seed + dist.rank)
    n_params = sum(p.numel() for p in raw_model.parameters())
    log.info(f"model {cfg.model.name}: {n_params / 1e6:.2f}M parameters, attention {raw_model.attention}")

    # optimizer, schedule, loss, precision, EMA --------------------------------------------------------
    scale = t.batch_size / t.lr_base_size if t.lr_base_size else 1.0  # linear scaling rule
    lr, min_lr, warmup_lr = t.lr * scale, t.min_lr * scale, t.warmup_lr * scale
    opt_kwargs: dict[str, Any] = {}
    if t.opt_eps is not None:
        opt_kwargs["eps"] = t.opt_eps
    if t.opt_betas is not None and "adam" in t.opt:
        opt_kwargs["betas"] = tuple(t.opt_betas)
    # timm puts norms, biases and no_weight_decay() (bias tables) in a group without weight decay,
    # and applies layer-wise lr decay through the model's group_matcher()
    optimizer = create_optimizer_v2(raw_model, opt=t.opt, lr=lr, weight_decay=t.weight_decay,
                                    momentum=t.momentum, layer_decay=t.layer_decay, **opt_kwargs)
    scheduler, _ = create_scheduler_v2(
        optimizer, sched=t.sched, num_epochs=t.epochs - t.warmup_epochs if t.warmup_prefix else t.epochs,
        warmup_epochs=t.warmup_epochs, warmup_lr=warmup_lr, min_lr=min_lr, warmup_prefix=t.warmup_prefix,
        step_on_epochs=False, updates_per_epoch=steps_per_epoch)

    mixup = None
    if t.mixup > 0 or t.cutmix > 0:
        mixup = Mixup(mixup_alpha=t.mixup, cutmix_alpha=t.cutmix, prob=t.mixup_prob,
                      switch_prob=t.mixup_switch_prob, mode=t.mixup_mode, label_smoothing=t.label_smoothing,
                      num_classes=num_classes)
        criterion: nn.Module = SoftTargetCrossEntropy()  # mixup makes (smoothed) soft targets
    elif t.label_smoothing > 0:
        criterion = LabelSmoothingCrossEntropy(smoothing=t.label_smoothing)
    else:
        criterion = nn.CrossEntropyLoss()

    amp = t.amp if t.amp != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    amp_dtype = AMP_DTYPES[amp]
    autocast = torch.autocast(device.type, dtype=amp_dtype, enabled=amp != "fp32")
    scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")  # bf16 needs no loss scaling
    ema = ModelEmaV3(raw_model, decay=t.ema_decay) if t.ema else None

    fwd_model: nn.Module = torch.compile(raw_model) if t.compile else raw_model
    model: nn.Module = (DDP(fwd_model, device_ids=[device] if device.type == "cuda" else None)
                        if dist.enabled else fwd_model)

    # resume ------------------------------------------------------------------------------------
    start_epoch = step_in_epoch = global_step = 0
    best_top1, best_epoch, nonfinite_total, skipped_total = -1.0, -1, 0, 0
    history: list[dict[str, Any]] = []
    wandb_id = None
    resume_path = None
    if dist.is_main:
        removed = remove_stale_temporaries(ckpt_dir)
        if removed:
            log.info(f"removed {removed} unfinished temporary checkpoint file(s) of an interrupted save")
        # this run's own last.pt wins over train.resume: rerunning a command that started from
        # train.resume=PATH must continue where it stopped, not start over from PATH
        if t.auto_resume and (ckpt_dir / "last.pt").is_file():
            resume_path = str(ckpt_dir / "last.pt")
        elif t.resume:
            resume_path = str(Path(t.resume).expanduser().resolve())
    resume_path = broadcast_object(resume_path)
    if resume_path:
        state = load_train_state(resume_path)
        raw_model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        if ema is not None and state.get("ema") is not None:
            ema.module.load_state_dict(state["ema"])
        start_epoch, step_in_epoch, global_step = state["epoch"], state["step_in_epoch"], state["global_step"]
        best_top1, best_epoch = state["best_top1"], state["best_epoch"]
        nonfinite_total, skipped_total = state["nonfinite_steps"], state["skipped_images"]
        history, wandb_id = state["history"], state.get("wandb_id")
        if state.get("world_size") == world and state.get("rng") is not None:
            restore_rng(state["rng"][dist.rank])
        else:  # another process count: fresh per-rank streams, still reproducible
            seed_everything(cfg.seed + dist.rank + 1000 * global_step)
        log.info(f"resumed from {resume_path}: {start_epoch} epoch(s) + {step_in_epoch} step(s) done")
        del state

    wandb_run = _init_wandb(cfg, run_dir, wandb_id) if dist.is_main else None

    def save(name: str, epoch: int, step: int) -> None:
        """All ranks call this (RNG states are gathered); rank 0 writes."""
        rngs = all_gather_object(capture_rng())
        if not dist.is_main:
            return
        save_train_state(ckpt_dir / name, {
            "model": raw_model.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
            "ema": ema.module.state_dict() if ema is not None else None,  # loadable as model weights
            "epoch": epoch, "step_in_epoch": step, "global_step": global_step,
            "best_top1": best_top1, "best_epoch": best_epoch, "nonfinite_steps": nonfinite_total,
            "skipped_images": skipped_total, "history": history, "rng": rngs, "world_size": world,
            "wandb_id": wandb_run.id if wandb_run is not None else wandb_id,
            "config": OmegaConf.to_container(cfg, resolve=True),
        })

    # epochs ----------------------------------------------------------------------------------------
    consecutive_nonfinite = 0
    if global_step:
        scheduler.step_update(num_updates=global_step)
    t_start = time.perf_counter()
    for epoch in range(start_epoch, t.epochs):
        sampler.set_epoch(epoch)
        # resuming mid-epoch: skip what this rank already consumed, in the same order
        sampler.set_start(step_in_epoch * t.accum_steps * micro_batch)
        model.train()
        batches = iter(train_loader)
        bar = tqdm(total=steps_per_epoch, initial=step_in_epoch, desc=f"epoch {epoch + 1}/{t.epochs}",
                   disable=not (dist.is_main and cfg.logger.progress), dynamic_ncols=True, leave=False)
        loss_sum_epoch, loss_count_epoch, epoch_skipped = 0.0, 0, 0
        t_first = t_last = None
        images_timed = 0
        for step in range(step_in_epoch, steps_per_epoch):
            loss_acc = torch.zeros((), device=device)
            images = 0
            for micro in range(t.accum_steps):
                x, y, skipped = next(batches)
                epoch_skipped += skipped
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                if mixup is not None:
                    if x.shape[0] % 2:  # mixup pairs images (a dropped corrupt image can make it odd)
                        x, y = x[:-1], y[:-1]
                    x, y = mixup(x, y)
                images += x.shape[0]
                # only the last micro-batch of an update synchronises gradients across processes
                sync = micro == t.accum_steps - 1
                with model.no_sync() if dist.enabled and not sync else nullcontext():
                    with autocast:
                        loss = criterion(model(x), y)
                    scaler.scale(loss / t.accum_steps).backward()
                loss_acc += loss.detach().float()
            # one collective + one host sync per update; a NaN on any rank makes the sum NaN on all
            loss_value = all_reduce_sum(loss_acc).item() / (t.accum_steps * world)
            if not math.isfinite(loss_value):
                optimizer.zero_grad(set_to_none=True)
                nonfinite_total += 1
                consecutive_nonfinite += 1
                log.warning(f"non-finite loss ({loss_value}) at epoch {epoch + 1} step {step + 1}: update skipped "
                            f"({consecutive_nonfinite} in a row, {nonfinite_total} in total)")
                if consecutive_nonfinite >= t.max_nonfinite:
                    raise NonFiniteLossError(
                        f"stopping: the loss was non-finite for {consecutive_nonfinite} updates in a row "
                        f"(train.max_nonfinite={t.max_nonfinite}); the last good checkpoint is {ckpt_dir / 'last.pt'}. "
                        "Lower train.lr, keep train.clip_grad on, or use train.amp=bf16/fp32 instead of fp16")
            else:
                consecutive_nonfinite = 0
                if t.clip_grad:
                    scaler.unscale_(optimizer)
                    dispatch_clip_grad(raw_model.parameters(), t.clip_grad, mode=t.clip_mode)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                if ema is not None:
                    ema.update(raw_model, step=global_step)
                loss_sum_epoch += loss_value
                loss_count_epoch += 1
            global_step += 1
            scheduler.step_update(num_updates=global_step)

            # throughput from the end of the first step on (excludes loader start-up and compilation)
            now = time.perf_counter()
            if t_first is None:
                t_first = now
            else:
                images_timed += images * world
            t_last = now
            cur_lr = optimizer.param_groups[0]["lr"]
            ips = images_timed / (t_last - t_first) if images_timed else 0.0
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{cur_lr:.2e}", img_s=f"{ips:.0f}", refresh=False)
            if global_step % cfg.logger.log_every_steps == 0:
                log.info(f"epoch {epoch + 1} step {step + 1}/{steps_per_epoch} loss {loss_value:.4f} "
                         f"lr {cur_lr:.3e} img/s {ips:.0f}")
                if wandb_run is not None:
                    wandb_run.log({"train/loss": loss_value, "train/lr": cur_lr, "train/images_per_sec": ips},
                                  step=global_step)
            if t.save_every_steps and global_step % t.save_every_steps == 0 and step + 1 < steps_per_epoch:
                save("last.pt", epoch, step + 1)
        bar.close()
        step_in_epoch = 0
        epoch_skipped = int(all_reduce_sum(torch.tensor(epoch_skipped, device=device)).item())
        skipped_total += epoch_skipped
        ips = images_timed / (t_last - t_first) if images_timed and t_first and t_last > t_first else 0.0

        # evaluate, record, checkpoint ---------------------------------------------------------------
        record: dict[str, Any] = {"epoch": epoch + 1, "train_loss": loss_sum_epoch / max(loss_count_epoch, 1),
                                  "lr": optimizer.param_groups[0]["lr"], "images_per_sec": ips,
                                  "skipped_images": epoch_skipped}
        if (epoch + 1) % t.eval_every == 0 or epoch + 1 == t.epochs:
            metrics = evaluate(fwd_model, val_loader, device, autocast)
            record.update(top1=metrics["top1"], top5=metrics["top5"], val_loss=metrics["loss"])
            if ema is not None:  # as timm: with EMA, the EMA weights are the ones judged and kept as best
                ema_metrics = evaluate(ema.module, val_loader, device, autocast)
                record.update(model_top1=metrics["top1"], top1=ema_metrics["top1"], top5=ema_metrics["top5"],
                              val_loss=ema_metrics["loss"])
        history.append(record)
        is_best = "top1" in record and record["top1"] > best_top1
        if is_best:
            best_top1, best_epoch = record["top1"], epoch + 1
        log.info(f"epoch {epoch + 1}/{t.epochs}: train loss {record['train_loss']:.4f}"
                 + (f", val top1 {record['top1']:.2f}% top5 {record['top5']:.2f}%" if "top1" in record else "")
                 + f", {ips:.0f} img/s" + (f", {epoch_skipped} unreadable images skipped" if epoch_skipped else ""))
        if wandb_run is not None:
            wandb_run.log({f"epoch/{k}": v for k, v in record.items()}, step=global_step)
        save("last.pt", epoch + 1, 0)
        if is_best:
            save("best.pt", epoch + 1, 0)
        if t.save_every_epochs and (epoch + 1) % t.save_every_epochs == 0:
            save(f"epoch_{epoch + 1:04d}.pt", epoch + 1, 0)

    # summary -------------------------------------------------------------------------------------------
    last = history[-1] if history else {}
    rates = [r["images_per_sec"] for r in history if r.get("images_per_sec")]
    summary = {
        "model": cfg.model.name, "data": cfg.data.name, "params": n_params, "world_size": world,
        "epochs": len(history), "global_step": global_step,
        "best_top1": best_top1 if best_top1 >= 0 else None, "best_epoch": best_epoch if best_epoch > 0 else None,
        "final_top1": last.get("top1"), "final_top5": last.get("top5"), "final_train_loss": last.get("train_loss"),
        "images_per_sec": rates[-1] if rates else None,  # last epoch: steady state
        "images_per_sec_mean": sum(rates) / len(rates) if rates else None,
        "train_time_sec_this_run": time.perf_counter() - t_start,
        "nonfinite_steps": nonfinite_total, "skipped_images": skipped_total,
        "amp": amp, "ema": bool(t.ema), "history": history,
    }
    if dist.is_main:
        tmp = run_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, run_dir / "summary.json")
        log.info(f"done: best top1 {summary['best_top1']}, final top1 {summary['final_top1']}, "
                 f"{summary['images_per_sec'] or 0:.0f} img/s; {run_dir / 'summary.json'}")
        if wandb_run is not None:
            wandb_run.summary.update({k: v for k, v in summary.items() if k != "history"})
            wandb_run.finish()
    barrier()
    return summary
