"""Evaluation over a whole validation set: top-1, top-5, loss and images/s, exact under DDP.

Exactness: each process takes every world_size-th sample (``swin.data.loaders.ShardSampler``, no padding, so
no sample is seen twice), counts only what it saw, and the sums are all-reduced. torch's
``DistributedSampler`` would instead pad the last shard with duplicates, which changes the numbers.

:func:`run_eval` is what ``eval.py`` runs: read the checkpoint, build the model and the validation
data with the transforms of the pretrained config, evaluate, write a JSON results file.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from timm.data import resolve_data_config
from timm.models import get_pretrained_cfg
from torch.utils.data import Dataset, Subset

from swin.config import (
    ConfigError,
    DataConfig,
    DigitsDataConfig,
    EvalAppConfig,
    ImageFolderDataConfig,
    ModelConfig,
    SwinV2ModelConfig,
    SyntheticDataConfig,
    as_folder,
    to_settings,
)
from swin.console import attach_logging, detach_logging
from swin.data.datasets import build_datasets, decode_mode, folder_split
from swin.data.loaders import build_eval_loader
from swin.io import write_json
from swin.models.attention import check_backend
from swin.models.compiling import compile_model
from swin.models.pretrained import Checkpoint, checkpoint_num_classes, load_into, read_source
from swin.models.registry import MODEL_CONFIGS, config_overrides, create_model
from swin.precision import TRAIN_AMP_CHOICES, autocast, resolve_amp
from swin.train.checks import check_arch, compile_mode, model_arch
from swin.train.distributed import all_reduce_sum, barrier, cleanup, init_distributed

log = logging.getLogger("swin.eval")
T = TypeVar("T")
TRANSFORM_KEYS = ("interpolation", "crop_pct", "mean", "std")  # what transforms=auto may take from timm
DATA_SCHEMAS = {"digits": DigitsDataConfig, "imagefolder": ImageFolderDataConfig, "imagenet": ImageFolderDataConfig,
                "synthetic": SyntheticDataConfig}


def _progress(total: int | None, enabled: bool, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="img", disable=not enabled, dynamic_ncols=True, leave=True)


def _raise_targets(lo: int, hi: int, num_classes: int) -> None:
    raise ValueError(f"targets in [{lo}, {hi}] do not fit a model with {num_classes} classes; "
                     "set model.num_classes to the dataset's class count")


def eval_compile_mode(setting: Any, device: torch.device | str, images: int, min_images: int) -> str | None:
    """The torch.compile mode eval.compile asks for, or None (eager): as train.compile with compile_mode=auto
    (CUDA graphs on CUDA, the default mode elsewhere; auto: on CUDA only), and auto only where this process
    evaluates at least ``min_images`` images, the run size on which compiling pays for the time it takes
    (docs/performance.md). ConfigError for another value."""
    if setting not in ("auto", True, False):
        raise ConfigError(f"compile={setting!r}: use auto (compile on CUDA for runs of at least compile_min_images "
                          "images), true or false")
    if min_images < 0:
        raise ConfigError(f"compile_min_images={min_images}: use a number of images >= 0")
    if setting == "auto" and images < min_images:
        return None
    return compile_mode(setting, "auto", torch.device(device))


@torch.no_grad()
def evaluate(model: nn.Module, loader: Iterable, *, device: torch.device | str = "cpu", amp: str | None = None,
             progress: bool = True, total: int | None = None, desc: str = "eval",
             channels_last: bool = False, compiled: nn.Module | None = None) -> dict[str, Any]:
    """Top-1 / top-5 accuracy (percent), mean cross-entropy loss and images/s of ``model`` on ``loader``.

    ``loader`` yields (images, integer targets[, skipped unreadable images]), on the host or already on
    ``device`` (``swin.data.build_eval_loader``); under DDP give each process a ``swin.data.ShardSampler``
    shard: every sum is all-reduced, so all processes get the whole set's numbers.
    ``total``: number of images on this process, for the progress bar.
    ``amp``: None/'fp32', 'bf16' or 'fp16' autocast ('fp8': bf16); logits are upcast to fp32 for loss and ranking.
    ``compiled``: the compiled model (``swin.compile_model(model, mode)``), run on the batches of
    the first batch's size; another size (the last, partial batch) runs ``model`` eagerly rather than compiling a
    second graph. The result's compile_seconds is the first batch's time with it (compiling included).
    """
    device = torch.device(device)
    was_training = model.training
    model.eval()
    # sums are float64 so that loss sums over millions of images stay exact enough
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # correct1, correct5, loss, count, skipped
    num_classes = None
    bounds: torch.Tensor | None = None  # (min, max) of targets that arrived on the device
    bar = _progress(total, progress, desc)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    # reused by every batch; fp8: a model training with train.amp=fp8 (its FP8 layers cast for themselves)
    amp_context = autocast(device, resolve_amp(amp or "fp32", device, TRAIN_AMP_CHOICES))
    start = time.perf_counter()
    compiled_size, compile_seconds = None, None  # the batch size the compiled model runs; its first batch's time
    try:
        for i, batch in enumerate(loader):
            images, targets = batch[0], batch[1]
            if len(batch) > 2:  # swin.data loaders also say how many unreadable images were dropped
                sums[4] += batch[2]
            on_host = targets.device.type == "cpu"
            if on_host:  # checked before use; targets already on the device are checked at the end (no sync)
                lo, hi = int(targets.min()), int(targets.max())
            images = images.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            if channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            compiling = compiled is not None and compiled_size is None
            if compiling:
                compiled_size, first = images.shape[0], time.perf_counter()
            with amp_context:
                logits = (compiled if images.shape[0] == compiled_size else model)(images)
            if compiling:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                compile_seconds = time.perf_counter() - first
            logits = logits.float()
            num_classes = logits.shape[-1]
            if on_host and (lo < 0 or hi >= num_classes):
                _raise_targets(lo, hi, num_classes)
            if not on_host:
                bounds = torch.stack([targets.min(), targets.max()]) if bounds is None else torch.stack(
                    [torch.minimum(bounds[0], targets.min()), torch.maximum(bounds[1], targets.max())])
                targets = targets.clamp(0, num_classes - 1)  # an out-of-range index would be a device assert
            k = min(5, num_classes)
            hit = logits.topk(k, dim=-1).indices.eq(targets[:, None])
            sums[0] += hit[:, 0].sum()
            sums[1] += hit.any(dim=-1).sum()
            sums[2] += F.cross_entropy(logits, targets, reduction="sum").double()
            sums[3] += targets.numel()
            bar.update(targets.numel())
            if not bar.disable and i % 10 == 0:  # reading the sums syncs the device: not every batch
                c = max(sums[3].item(), 1)
                bar.set_postfix(top1=f"{100 * sums[0].item() / c:.2f}", loss=f"{sums[2].item() / c:.4f}",
                                refresh=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
    finally:
        bar.close()
        model.train(was_training)
    if bounds is not None:
        lo, hi = bounds.tolist()
        if lo < 0 or hi >= num_classes:
            _raise_targets(lo, hi, num_classes)
    local = sums[3].item()
    all_reduce_sum(sums)
    # throughput of the whole job: every process works in parallel, so total images / slowest time
    times = torch.tensor([elapsed], dtype=torch.float64, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX)
    count = int(sums[3].item())
    if count == 0:
        raise ValueError("the evaluation set is empty")
    return {
        "top1": 100.0 * sums[0].item() / count,
        "top5": 100.0 * sums[1].item() / count,
        "top5_k": min(5, num_classes or 5),
        "loss": sums[2].item() / count,
        "num_images": count,
        "num_images_this_process": int(local),
        "skipped_images": int(sums[4].item()),
        "seconds": times.item(),
        "images_per_sec": count / times.item() if times.item() > 0 else math.inf,
        "compile_seconds": compile_seconds,
    }


# --- eval.py -----------------------------------------------------------------------------------------
def overridden_groups(overrides: Iterable[str]) -> set[str]:
    """Top-level config keys set on the command line (``model=x``, ``data.root=y``, ``+a.b=c`` ...)."""
    keys = set()
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        keys.add(key.split(".", 1)[0].split("@", 1)[0])
    return keys


def eval_transform_settings(model_name: str, ckpt: Checkpoint, data_cfg: DataConfig) -> tuple[dict[str, Any], str]:
    """Evaluation resize/crop/interpolation/mean/std and where they came from.

    Our checkpoints were trained with the data config's transforms, so those are kept; timm and
    Microsoft weights follow timm's pretrained config of the weights (``timm:<name.tag>``) or of the
    architecture name (e.g. crop 0.9 bicubic for ``swin_tiny_patch4_window7_224``, 1.0 at 384).
    """
    folder = as_folder(data_cfg)
    from_data = {k: getattr(folder, k) for k in TRANSFORM_KEYS} if folder is not None else {}
    if ckpt.kind == "ours":
        return from_data, "data config of the checkpoint's training run"
    name = ckpt.meta.get("timm_name") or model_name
    try:
        pretrained = get_pretrained_cfg(name)
    except Exception:  # not a timm name (swin_micro) or an unknown tag
        pretrained = None
    if pretrained is None:
        return from_data, f"data config ({name} has no timm pretrained config)"
    resolved = resolve_data_config({}, pretrained_cfg=pretrained.to_dict())
    settings = {"interpolation": resolved["interpolation"], "crop_pct": resolved["crop_pct"],
                "mean": list(resolved["mean"]), "std": list(resolved["std"])}
    return settings, f"timm pretrained config of {name}"


def build_eval_dataset(data_cfg: DataConfig, img_size: int | Sequence[int]) -> tuple[Dataset, int, tuple[Any, Any]]:
    """Validation split only (an ImageNet train/ folder takes long to list and is not needed), its class
    count and (mean, std): folder images come as uint8 and are normalised on the device (swin.data.loaders);
    with data.decode=gpu they are decoded and resized there too (swin.data.gpu.decode)."""
    folder = as_folder(data_cfg)
    if folder is None:
        ds = build_datasets(data_cfg, img_size)
        return ds.val, ds.num_classes, (ds.mean, ds.std)
    if not folder.root:
        raise ValueError(f"data={folder.name} needs data.root=/path/to/dataset (with a {folder.val_dir}/ "
                         "folder of one sub-folder per class)")
    val_dir = Path(folder.root).expanduser() / folder.val_dir
    if not val_dir.is_dir():
        raise ValueError(f"data.root={folder.root} has no {folder.val_dir}/ folder of class sub-folders")
    size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    val = folder_split(folder, val_dir, size, train=False)  # decoded in the workers or on the device
    num_classes = len(val.classes)
    if folder.val_limit:
        val = Subset(val, range(min(folder.val_limit, len(val))))
    return val, num_classes, (tuple(folder.mean), tuple(folder.std))


def saved_settings(saved: dict[str, Any], schema: type[T], fallback: T, key: str) -> T:
    """A checkpoint's ``model`` or ``data`` config as typed settings of ``schema``; keys it lacks (a checkpoint of
    an older version) come from ``fallback`` when that is of the same schema, else ValueError naming them."""
    node = OmegaConf.structured(schema)
    if type(fallback) is schema:
        node = OmegaConf.merge(node, OmegaConf.structured(fallback))
    known = {k: v for k, v in saved.items() if k in node}
    node = OmegaConf.merge(node, known)
    missing = sorted(k for k in node if OmegaConf.is_missing(node, k))
    if missing:
        raise ValueError(f"the checkpoint's {key} config lacks {', '.join(missing)}; give {key}=<name> (and those "
                         f"{key}.* keys) on the command line, or from_checkpoint=false")
    return to_settings(node)


def _model_and_data(cfg: EvalAppConfig, ckpt: Checkpoint, cli_keys: set[str]) -> tuple[ModelConfig, DataConfig]:
    """The architecture and data to evaluate: our checkpoints carry their run's config, used unless the command line
    gives model= or data= (or from_checkpoint=false); the attention backend and fused paths stay this run's."""
    model_cfg, data_cfg = cfg.model, cfg.data
    saved = ckpt.config or {}
    if cfg.from_checkpoint and "model" in saved and "model" not in cli_keys:
        schema = SwinV2ModelConfig if "pretrained_window_sizes" in saved["model"] else ModelConfig
        model_cfg = saved_settings(saved["model"], schema, cfg.model, "model")
        # the backend and the fused paths are properties of this machine, not of the architecture
        model_cfg = dataclasses.replace(model_cfg, attention=cfg.model.attention, fused_mlp_act=cfg.model.fused_mlp_act,
                                        fused_merge_norm=cfg.model.fused_merge_norm)
    if cfg.from_checkpoint and "data" in saved and "data" not in cli_keys:
        schema = DATA_SCHEMAS.get(saved["data"].get("name"))
        if schema is None:
            raise ValueError(f"the checkpoint's data config names an unknown dataset {saved['data'].get('name')!r}; "
                             "give data=<name> on the command line")
        data_cfg = saved_settings(saved["data"], schema, cfg.data, "data")
    return model_cfg, data_cfg


def _with_transforms(cfg: EvalAppConfig, model_name: str, ckpt: Checkpoint,
                     data_cfg: DataConfig) -> tuple[DataConfig, dict[str, Any], str]:
    """``data_cfg`` with the evaluation transforms ``cfg.transforms`` asks for, the transforms and their source."""
    if cfg.transforms == "data":
        return data_cfg, {}, "data config"
    if cfg.transforms != "auto":
        raise ValueError(f"transforms={cfg.transforms!r}: use auto or data")
    transforms, source = eval_transform_settings(model_name, ckpt, data_cfg)
    if as_folder(data_cfg) is not None:  # the other datasets have no transforms to set
        data_cfg = dataclasses.replace(data_cfg, **transforms)
    return data_cfg, transforms, source


def run_eval(cfg: EvalAppConfig | DictConfig, run_dir: str | os.PathLike,
             cli_keys: set[str] | None = None) -> dict[str, Any]:
    """Evaluate ``cfg.checkpoint`` as configs/eval.yaml describes; returns (and writes) the results.
    ``cli_keys``: the top-level keys given on the command line (:func:`overridden_groups`)."""
    cfg = to_settings(cfg)
    dist = init_distributed(cfg.device)
    check_backend(cfg.model.attention, dist.device)
    if dist.is_main:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    handlers = attach_logging(Path(run_dir) / "eval.log" if dist.is_main else None, dist.is_main)
    try:
        ckpt = read_source(cfg.checkpoint, ema=cfg.ema)
        model_cfg, data_cfg = _model_and_data(cfg, ckpt, cli_keys or set())
        data_cfg, transforms, transforms_from = _with_transforms(cfg, model_cfg.name, ckpt, data_cfg)
        num_classes = model_cfg.num_classes or checkpoint_num_classes(ckpt.state_dict)
        if not num_classes:
            raise ValueError(f"checkpoint {cfg.checkpoint} has no classifier; it cannot be evaluated as is")
        if model_cfg.name in MODEL_CONFIGS:  # else create_model names the unknown model
            check_arch(model_arch(model_cfg))
        model = create_model(model_cfg.name, num_classes=num_classes, **config_overrides(model_cfg))
        report = load_into(model, ckpt, reset_head=False)
        model.to(dist.device)

        val, data_classes, (mean, std) = build_eval_dataset(data_cfg, model.img_size)
        if data_classes > num_classes:
            raise ValueError(f"the data has {data_classes} classes but the checkpoint's classifier {num_classes}")
        # uint8 batches copied one ahead on a side stream and normalised on the device, as in training (or, with
        # data.decode=gpu, JPEG files decoded and resized on the device)
        loader = build_eval_loader(val, data_cfg, dist.device, dist.rank, dist.world_size, cfg.batch_size, mean, std)
        amp = resolve_amp(cfg.amp, dist.device)
        shard = len(range(dist.rank, len(val), dist.world_size))
        mode = eval_compile_mode(cfg.compile, dist.device, shard, cfg.compile_min_images)
        if dist.is_main:
            log.info(f"model {model_cfg.name} ({num_classes} classes, img_size {model.img_size}, window "
                     f"{model.window_size}, attention {model.attention}); data {data_cfg.name}: {len(val)} images, "
                     f"{dist.world_size} process(es), {amp}; transforms from {transforms_from}"
                     + (f" {transforms}" if transforms else ""))
            why = (f" (compile=auto: compiles on CUDA for at least {cfg.compile_min_images} images per process)"
                   if cfg.compile == "auto" and mode is None else "")
            log.info(f"torch.compile: {mode} mode (compiles during the first batch)" if mode
                     else f"torch.compile: off{why}")
        metrics = evaluate(model, loader, device=dist.device, amp=amp, progress=cfg.progress and dist.is_main,
                           total=shard, compiled=compile_model(model, mode) if mode else None)
        if dist.is_main and metrics["compile_seconds"] is not None:
            log.info(f"torch.compile: the first batch took {metrics['compile_seconds']:.1f} s, compiling included")
        folder = as_folder(data_cfg)
        results = {
            **{k: metrics[k] for k in ("top1", "top5", "loss", "images_per_sec", "num_images", "skipped_images",
                                       "seconds", "top5_k", "compile_seconds")},
            "compile_mode": mode,
            "decode": decode_mode(data_cfg), "cpu_decoded_images": loader.cpu_decoded,
            "checkpoint": str(cfg.checkpoint), "checkpoint_kind": ckpt.kind, "weights": ckpt.weights,
            "checkpoint_meta": ckpt.meta, "resized_bias_tables": len(report.resized),
            "model": model_cfg.name, "num_classes": num_classes, "img_size": list(model.img_size),
            "window_size": list(model.window_size), "attention": model.attention,
            "data": data_cfg.name, "data_root": folder.root if folder is not None else None,
            "transforms": transforms, "transforms_from": transforms_from, "batch_size_per_process": cfg.batch_size,
            "amp": amp, "world_size": dist.world_size, "device": str(dist.device),
            "device_name": torch.cuda.get_device_name(dist.device) if dist.device.type == "cuda" else "cpu",
            "torch": torch.__version__, "timm": timm.__version__,
        }
        if dist.is_main:
            out = write_json(cfg.output or Path(run_dir) / "eval_results.json", results)
            log.info(f"top1 {results['top1']:.2f}%, top5 {results['top5']:.2f}%, loss {results['loss']:.4f}, "
                     f"{results['images_per_sec']:.0f} img/s over {results['num_images']} images; {out}")
        barrier()
        return results
    finally:
        detach_logging(handlers)
        cleanup()


__all__ = [
    "build_eval_dataset", "eval_compile_mode", "eval_transform_settings", "evaluate", "overridden_groups", "run_eval",
]
