"""Checks of a training config, run once at start: a value that cannot work stops the run with one line
naming the key and the fix, before any data or model is built. Types come from the schema (swin.config),
which Hydra checks when it composes; this module checks ranges and combinations."""
from __future__ import annotations

import operator
from typing import Any

import torch
from omegaconf import DictConfig

from swin.config import ConfigError, ModelConfig, TrainAppConfig, to_settings
from swin.data.datasets import check_decode
from swin.models.attention import check_backend
from swin.models.compiling import check_memory_budget, inductor_options
from swin.models.registry import MODEL_CONFIGS, architecture, config_overrides
from swin.precision import TRAIN_AMP_CHOICES, check_fp8_layers, fp8_problem

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that record CUDA graphs
# optimizers (timm names of torch.optim classes) built with fused=True on CUDA: their kernels skip a
# non-finite step on the device (see swin.train.guard)
FUSED_OPTS = ("adamw", "adam")


def model_arch(cfg_model: ModelConfig) -> dict[str, Any]:
    """The architecture create_model will build for a model config of a registered name."""
    return architecture(cfg_model.name, **config_overrides(cfg_model))


def _size(key: str, value: Any) -> tuple[int, int]:
    """model.<key> as (height, width): an int, or [height, width] as create_model takes it."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        return int(value[0]), int(value[1])
    raise ConfigError(f"model.{key}={value!r}: use an integer or [height, width] (integers)")


def check_arch(arch: dict[str, Any]) -> None:
    """One line naming the model.<key> of an architecture (model_arch's) no Swin can be built with: sizes below 1,
    stages without one depth and one head count each, a stage whose channels the heads do not divide, a stochastic
    depth rate outside [0, 1]. (The model names what else it refuses, e.g. Swin V2 pretrained windows not one per
    stage; train.py and eval.py print that as one line too.)"""
    for key in ("img_size", "patch_size", "window_size"):
        if min(_size(key, arch[key])) < 1:
            raise ConfigError(f"model.{key}={arch[key]!r}: set model.{key} to 1 or more")
    depths, heads, dim = list(arch["depths"]), list(arch["num_heads"]), arch["embed_dim"]
    if not depths or len(depths) != len(heads):
        raise ConfigError(f"model.depths={depths} and model.num_heads={heads} need one entry each per stage: give "
                          "them the same length")
    if dim < 1:
        raise ConfigError(f"model.embed_dim={dim}: set model.embed_dim to 1 or more")
    for key, values in (("model.depths", depths), ("model.num_heads", heads)):
        if min(values) < 1:
            raise ConfigError(f"{key}={values}: set every entry to 1 or more")
    for stage, stage_heads in enumerate(heads):
        if (dim << stage) % stage_heads:
            raise ConfigError(f"model.num_heads={heads}: stage {stage + 1} has {dim << stage} channels "
                              f"(model.embed_dim={dim}, doubled per stage), which {stage_heads} heads do not divide; "
                              "change model.num_heads or model.embed_dim")
    rate = arch.get("drop_path_rate", 0.0)
    if not 0 <= rate <= 1:
        raise ConfigError(f"model.drop_path_rate={rate}: set model.drop_path_rate between 0 and 1")


AT_LEAST = {  # key: lowest accepted value (null is accepted where the schema allows it)
    "train.epochs": 1, "train.batch_size": 1, "train.accum_steps": 1, "train.eval_batch_size": 1,
    "train.lr_base_size": 1, "train.eval_every": 1, "train.max_nonfinite": 1, "train.dist_timeout_s": 1,
    "train.ddp_bucket_mb": 1,
    "logger.log_every_steps": 1,
    "data.train_limit": 1, "data.val_limit": 1, "train.warmup_epochs": 0, "train.save_every_epochs": 0,
    "train.save_every_steps": 0, "train.lr": 0, "train.min_lr": 0, "train.warmup_lr": 0, "train.weight_decay": 0,
    "train.mixup": 0, "train.cutmix": 0, "data.num_workers": 0,
}


FRACTIONS = ("train.label_smoothing", "train.ema_decay", "train.mixup_prob", "train.mixup_switch_prob")


def check_ranges(cfg: TrainAppConfig) -> None:
    """One line naming the key and what it accepts for a value of the right type but out of range."""
    for key, lowest in AT_LEAST.items():
        value = operator.attrgetter(key)(cfg)
        if value is not None and value < lowest:
            raise ConfigError(f"{key}={value}: set {key} to {lowest} or more")
    for key in FRACTIONS:
        value = operator.attrgetter(key)(cfg)
        if not 0 <= value <= 1:
            raise ConfigError(f"{key}={value}: set {key} between 0 and 1")


def check_config(cfg: TrainAppConfig | DictConfig, world_size: int, device: torch.device) -> TrainAppConfig:
    """Reject configurations that would fail (or silently misbehave) later, before any work is done; returns the
    config as its typed settings (swin.config.to_settings)."""
    cfg = to_settings(cfg)
    t, m = cfg.train, cfg.model
    if m.name not in MODEL_CONFIGS:
        raise ConfigError(f"unknown model {m.name!r}; use model=<{'|'.join(sorted(MODEL_CONFIGS))}>")
    check_ranges(cfg)
    if t.require_pretrained and not m.pretrained:
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
    if t.compile not in ("auto", True, False):
        raise ConfigError(f"train.compile={t.compile!r}: use auto (compile on CUDA), true or false")
    if t.compile_mode not in ("auto", *COMPILE_MODES):
        raise ConfigError(f"train.compile_mode={t.compile_mode!r}: use one of {', '.join(COMPILE_MODES)}, or auto")
    try:
        inductor_options(overrides=t.compile_options)
    except ValueError as e:
        raise ConfigError(f"train.compile_options: {e}") from None
    try:
        check_memory_budget(t.memory_budget, "train.memory_budget")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if t.amp not in TRAIN_AMP_CHOICES:
        raise ConfigError(f"train.amp={t.amp!r}: use auto, bf16, fp16, fp32 or fp8")
    if t.amp == "fp8" and (problem := fp8_problem(device, "train.amp")):
        raise ConfigError(problem)
    try:
        check_fp8_layers(t.fp8_layers, "train.fp8_layers")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        check_backend(m.attention, device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    arch = model_arch(m)
    check_arch(arch)
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
    return cfg


def compile_mode(compile: Any, mode: str, device: torch.device, accum_steps: int = 1) -> str | None:
    """The torch.compile mode train.compile and train.compile_mode ask for on ``device``, or None (eager).
    compile=auto compiles on CUDA only (on the CPU compiling costs more than it saves); mode=auto takes CUDA graphs
    (reduce-overhead), on one GPU and under DDP, where they are the fastest (no launches from the host), and the default
    mode with gradient accumulation (a micro-batch's backward would overwrite the previous replay's outputs)."""
    if compile is False or (compile == "auto" and torch.device(device).type != "cuda"):
        return None
    if mode != "auto":
        return mode
    return "reduce-overhead" if torch.device(device).type == "cuda" and accum_steps == 1 else "default"
