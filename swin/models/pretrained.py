"""Reading checkpoints of every supported kind and loading them into our Swin model.

Kinds (detected from the content, not the file name):

* ours: a training checkpoint from ``train.py`` (``{'model': sd, 'ema': sd | None, 'config': ..., ...}``);
* timm: a ``state_dict`` as timm saves it (``.pth``/``.pt``/``.bin`` through ``torch.save``, or
  ``.safetensors``), or a timm training checkpoint (``{'state_dict': ..., 'state_dict_ema': ...}``);
* microsoft: an official Swin checkpoint (``{'model': sd}``, patch merging stored at the *end* of
  stage i as ``layers.i.downsample``, classifier as ``head.weight``).

Conversion to timm's layout (and bias-table resizing for another window size) goes through timm's own
``swin_transformer.checkpoint_filter_fn`` (Swin V2: ``swin_transformer_v2.checkpoint_filter_fn``, which drops the
window-dependent buffers official files keep, so weights load at any window) so that we load exactly what timm
loads. Loading is strict:
the only documented partial load is re-initialising the classifier (timm's head init) when the
checkpoint's class count differs from the model's. Everything else that does not fit raises
:class:`CheckpointError` listing the keys and shapes.
"""
from __future__ import annotations

import argparse
import logging
import os
import pickle
import socket
import struct
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import torch.nn as nn

log = logging.getLogger(__name__)

HEAD_KEYS = ("head.fc.weight", "head.fc.bias")
_MAX_LISTED = 25  # keys listed per category in error messages


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or does not fit the model."""


@dataclass
class Checkpoint:
    """Weights read from a file, in the layout they were stored (cleaned of DDP/compile prefixes)."""

    state_dict: dict[str, torch.Tensor]
    kind: str                 # 'ours' | 'timm' | 'timm-train' | 'microsoft'
    weights: str              # 'model' | 'ema'
    path: str
    config: dict | None = None     # our resolved training config, when present
    meta: dict = field(default_factory=dict)  # epoch etc. when present


@dataclass
class LoadReport:
    """What :func:`load_pretrained` did."""

    source: str
    kind: str
    weights: str
    head_reset: bool
    resized: list[str]
    checkpoint_classes: int

    def summary(self) -> str:
        parts = [f"loaded {self.kind} checkpoint {self.source} ({self.weights} weights)"]
        if self.resized:
            parts.append(f"resized {len(self.resized)} relative position bias tables")
        if self.head_reset:
            parts.append(f"re-initialised the classifier (checkpoint had {self.checkpoint_classes} classes)")
        return "; ".join(parts)


# --- reading files ---------------------------------------------------------------------------------
def _is_safetensors(path: Path) -> bool:
    # safetensors: 8-byte little-endian header length, then a JSON header starting with '{'
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9:
        return path.suffix == ".safetensors"
    (n,) = struct.unpack("<Q", head[:8])
    return head[8:9] == b"{" and 0 < n < path.stat().st_size


def corrupt_checkpoint(path: Path, err: BaseException, fix: str = "Re-download or re-save it.") -> CheckpointError:
    """The one-line error for a checkpoint file torch cannot read (err: what torch.load raised), ending in ``fix``."""
    if isinstance(err, pickle.UnpicklingError):  # torch's message here is a long note about weights_only
        detail = "not a valid PyTorch checkpoint: unpickling failed"
    else:
        lines = str(err).strip().splitlines()
        detail = f"{type(err).__name__}: {lines[0][:200] if lines else ''}"
    return CheckpointError(f"could not read checkpoint {path}: the file is truncated or corrupt ({detail}). {fix}")


def _torch_load(path: Path) -> Any:
    # weights_only=True never runs code from the file; timm training checkpoints hold an argparse
    # Namespace, which is allow-listed as timm does.
    try:
        if hasattr(torch.serialization, "safe_globals"):
            with torch.serialization.safe_globals([argparse.Namespace]):
                return torch.load(path, map_location="cpu", weights_only=True)
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # weights_only refuses both garbage and genuine pickled objects; only the latter name globals
        unsafe: list[str] = []
        if zipfile.is_zipfile(path) and hasattr(torch.serialization, "get_unsafe_globals_in_checkpoint"):
            try:
                unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
            except Exception:  # unreadable: reported as corrupt below
                unsafe = []
        if unsafe:
            raise CheckpointError(
                f"checkpoint {path} holds Python objects that are not plain weights ({', '.join(unsafe)}); "
                f"they are not unpickled because that can run code. If you trust the file, re-save just the "
                f"weights: torch.save(torch.load(path, weights_only=False)['model'], 'weights.pth').") from None
        raise corrupt_checkpoint(path, e) from None
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile, struct.error,
            IndexError, KeyError, TypeError) as e:  # the last three: the unpickler's stack machine on garbage bytes
        raise corrupt_checkpoint(path, e) from None


def read_file(path: str | os.PathLike) -> Any:
    """Raw content of a checkpoint file (torch or safetensors), on the CPU."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes)")
    if _is_safetensors(path):
        import safetensors.torch
        try:
            return safetensors.torch.load_file(str(path), device="cpu")
        except Exception as e:  # safetensors raises its own error types
            raise corrupt_checkpoint(path, e) from None
    return _torch_load(path)


def _is_state_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and len(obj) > 0 and all(isinstance(v, torch.Tensor) for v in obj.values())


def _layout(sd: Mapping[str, torch.Tensor]) -> str:
    """'microsoft' when patch merging sits at stage ends or the classifier is 'head.weight', else 'timm'."""
    if "layers.0.downsample.reduction.weight" in sd:
        return "microsoft"
    if "head.weight" in sd and "head.fc.weight" not in sd:
        return "microsoft"
    return "timm"


def read_checkpoint(path: str | os.PathLike, ema: bool | None = None) -> Checkpoint:
    """Read a checkpoint file and pick its weights.

    ``ema``: None uses EMA weights when the file has them (timm's default), True requires them,
    False takes the raw model weights.
    """
    from timm.models import clean_state_dict

    obj = read_file(path)
    path = str(path)
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"checkpoint {path} holds a {type(obj).__name__}, not a state_dict or a dict of them")
    config, meta = None, {}
    if _is_state_dict(obj):
        sources, kind = {"model": obj}, "timm"
    else:
        # (key of model weights, key of EMA weights) per known wrapper; ours and Microsoft's share 'model'
        if isinstance(obj.get("state_dict"), Mapping):
            sources, kind = {"model": obj["state_dict"]}, "timm-train"
            ema_sd = obj.get("state_dict_ema", obj.get("model_ema"))
        elif isinstance(obj.get("model"), Mapping):
            ours = "config" in obj and isinstance(obj.get("config"), Mapping)
            sources, kind = {"model": obj["model"]}, "ours" if ours else "microsoft"
            ema_sd = obj.get("ema", obj.get("model_ema"))
            if ours:
                config = dict(obj["config"])
        else:
            raise CheckpointError(
                f"checkpoint {path} is not a state_dict and has no 'model' or 'state_dict' entry "
                f"(top-level keys: {sorted(map(str, obj))[:_MAX_LISTED]})")
        if isinstance(ema_sd, Mapping) and len(ema_sd):
            sources["ema"] = ema_sd
        meta = {k: obj[k] for k in ("epoch", "step", "best_top1", "arch") if isinstance(obj.get(k), (int, float, str))}
    if ema and "ema" not in sources:
        raise CheckpointError(f"EMA weights were requested but checkpoint {path} ({kind}) has none")
    weights = "ema" if "ema" in sources and ema is not False else "model"
    sd = sources[weights]
    bad = sorted(str(k) for k, v in sd.items() if not isinstance(v, torch.Tensor))
    if bad:
        raise CheckpointError(f"checkpoint {path}: '{weights}' entry has non-tensor values at {bad[:_MAX_LISTED]}")
    sd = clean_state_dict(dict(sd))  # strips 'module.' (DDP, timm EMA) and '_orig_mod.' (torch.compile)
    if kind in ("timm", "ours") and _layout(sd) == "microsoft":
        kind = "microsoft"
    return Checkpoint(sd, kind, weights, path, config, meta)


# --- architecture description for error messages -------------------------------------------------
def describe_state_dict(sd: Mapping[str, torch.Tensor]) -> str:
    """Swin hyper-parameters implied by a timm-layout state_dict, for error messages."""
    w = sd.get("patch_embed.proj.weight")
    if w is None or w.ndim != 4:
        keys = list(sd)[:5]
        return f"not a Swin Transformer state_dict (no patch_embed.proj.weight; first keys: {keys})"
    depths: dict[int, int] = {}
    heads: dict[int, int] = {}
    window = None
    version = 1
    for k, v in sd.items():
        parts = k.split(".")
        if len(parts) > 3 and parts[0] == "layers" and parts[2] == "blocks":
            i, j = int(parts[1]), int(parts[3])
            depths[i] = max(depths.get(i, 0), j + 1)
            if k.endswith("relative_position_bias_table") and v.ndim == 2:
                heads.setdefault(i, v.shape[1])
                side = round(v.shape[0] ** 0.5)
                window = (side + 1) // 2 if side * side == v.shape[0] else f"{v.shape[0]} bias rows"
            elif k.endswith("attn.logit_scale"):  # Swin V2: no window-sized tensor (continuous position bias)
                heads.setdefault(i, v.shape[0])
                version, window = 2, "any"
    head = sd.get("head.fc.weight", sd.get("head.weight"))
    return (f"Swin {'V2' if version == 2 else 'v1'}, embed_dim={w.shape[0]}, patch_size={w.shape[-1]}, "
            f"in_chans={w.shape[1]}, "
            f"depths={tuple(depths[i] for i in sorted(depths))}, num_heads={tuple(heads[i] for i in sorted(heads))}, "
            f"window_size={window}, num_classes={0 if head is None else head.shape[0]}")


def _list(title: str, items: list[str]) -> str:
    more = f"\n    ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return f"  {title} ({len(items)}):\n    " + "\n    ".join(items[:_MAX_LISTED]) + more


# --- conversion and loading ------------------------------------------------------------------------
def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def convert_state_dict(sd: Mapping[str, torch.Tensor], model: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Checkpoint weights (timm or Microsoft layout) -> our/timm layout for ``model``.

    Uses timm's ``checkpoint_filter_fn`` for the layout change and for resizing relative position bias
    tables to the model's window size. Tensors it must not adapt (a bias table with another head count,
    a patch embedding of another patch size) are passed through unchanged, so that the strict load
    reports them as mismatches rather than silently reshaping another architecture's weights.
    Returns the converted dict and the keys of the resized tables.
    """
    from timm.models import swin_transformer, swin_transformer_v2

    v2 = getattr(model, "version", 1) == 2
    checkpoint_filter_fn = (swin_transformer_v2 if v2 else swin_transformer).checkpoint_filter_fn
    target = model.state_dict()
    keep, passthrough, resized = {}, {}, []
    for k, v in sd.items():
        if k.endswith("relative_position_bias_table"):
            t = target.get(k)
            # a table of the model's shape needs nothing (timm <= 1.0.29's filter cannot even read a
            # non-square window's table); another head count is another model: left to the strict load
            if t is None or v.ndim != 2 or v.shape[1] != t.shape[1] or v.shape == t.shape:
                passthrough[k] = v
                continue
            resized.append(k)
        elif k == "patch_embed.proj.weight":
            t = target.get(k)
            if t is None or v.ndim != 4 or v.shape[-2:] != t.shape[-2:]:
                passthrough[k] = v  # timm would resample another patch size; that is another model
                continue
        keep[k] = v
    layout = _layout(keep)
    sentinel = False
    if layout == "timm" and "head.fc.weight" not in keep:
        # timm <= 1.0.29 takes any dict without 'head.fc.weight' (e.g. headless) for the Microsoft
        # layout; a placeholder keeps its detection right on every version
        keep["head.fc.weight"], sentinel = torch.empty(0), True
    try:
        out = checkpoint_filter_fn(keep, model)
    except Exception as e:  # re-raised with context
        raise CheckpointError(f"timm's Swin{' V2' if v2 else ''} checkpoint filter failed on this checkpoint: "
                              f"{type(e).__name__}: {e}\n"
                              f"  checkpoint: {describe_state_dict(sd)}") from e
    if sentinel:
        out.pop("head.fc.weight")
    if layout == "microsoft":
        # timm >= 1.0.31 detects the layout by 'layers.0.downsample' only; a single-stage official
        # model has none, so rename its classifier here if the filter did not
        for name in ("weight", "bias"):
            if f"head.{name}" in out and f"head.fc.{name}" not in out:
                out[f"head.fc.{name}"] = out.pop(f"head.{name}")
    out.update(passthrough)  # bias tables and patch embedding keep their names in both layouts
    return out, resized


def load_state_dict(model: nn.Module, sd: Mapping[str, torch.Tensor], *, reset_head: bool = True,
                    source: str = "checkpoint") -> tuple[bool, int, list[str]]:
    """Strictly load a checkpoint state_dict (any supported layout) into our Swin ``model``.

    ``reset_head``: when the checkpoint's class count differs from ``model.num_classes``, re-initialise
    the classifier with timm's head init instead of failing. Returns (head_reset, checkpoint classes,
    resized bias-table keys).
    """
    out, resized = convert_state_dict(sd, model)
    target = model.state_dict()
    num_classes = getattr(model, "num_classes", None)
    head_w = out.get("head.fc.weight")
    ckpt_classes = 0 if head_w is None else int(head_w.shape[0])
    head_differs = num_classes is not None and ckpt_classes != num_classes
    # a head of another input width is a mismatch of the whole model, not a class-count change
    head_width_ok = head_w is None or "head.fc.weight" not in target or (
        head_w.ndim == 2 and head_w.shape[1] == target["head.fc.weight"].shape[1])
    skip_head = head_differs and head_width_ok
    expected = {k for k in target if not (skip_head and k in HEAD_KEYS)}
    present = {k for k in out if not (skip_head and k in HEAD_KEYS)}
    # listed in model / checkpoint order, which reads like the architecture
    missing = [k for k in target if k in expected and k not in present]
    unexpected = [k for k in out if k in present and k not in target]
    wrong = [k for k in target if k in expected and k in present and out[k].shape != target[k].shape]
    if missing or unexpected or wrong:
        lines = [f"{source} does not fit the model:"]
        if wrong:
            lines.append(_list("shape mismatches (checkpoint vs model)",
                               [f"{k}: {_shape(out[k])} vs {_shape(target[k])}" for k in wrong]))
        if missing:
            lines.append(_list("missing in checkpoint", [f"{k}: {_shape(target[k])}" for k in missing]))
        if unexpected:
            lines.append(_list("unexpected in checkpoint", [f"{k}: {_shape(out[k])}" for k in unexpected]))
        lines.append(f"  checkpoint: {describe_state_dict(out)}")
        lines.append(f"  model:      {describe_state_dict(target)}")
        lines.append("  Create the model with the checkpoint's architecture (model=<name> and its overrides).")
        raise CheckpointError("\n".join(lines))
    if head_differs and not reset_head:
        raise CheckpointError(
            f"{source} has a classifier for {ckpt_classes} classes but the model has {num_classes}; "
            f"create the model with num_classes={ckpt_classes} (model.num_classes={ckpt_classes})")
    head_reset = skip_head
    for k in HEAD_KEYS if head_reset else ():
        out.pop(k, None)
    result = model.load_state_dict(out, strict=not head_reset)
    if head_reset:
        assert not result.unexpected_keys and set(result.missing_keys) <= set(HEAD_KEYS), result
        model.reset_classifier(num_classes)  # timm's head init, whatever the constructor did before
    return head_reset, ckpt_classes, resized


# --- timm hub --------------------------------------------------------------------------------------
def _hub_reachable(timeout: float = 3.0) -> bool:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _timm_hub_state_dict(name: str) -> tuple[dict[str, torch.Tensor], str]:
    """Weights of timm model ``name`` (``arch.tag``) from the Hugging Face cache or hub."""
    import timm
    from timm.models import get_pretrained_cfg

    try:
        cfg = get_pretrained_cfg(name)
    except Exception as e:  # unknown tag
        raise CheckpointError(f"timm has no pretrained weights {name!r}: {e}") from None
    if cfg is None or not timm.is_model(name.split(".")[0]):
        raise CheckpointError(f"unknown timm model {name!r}; see timm.list_models('swin*', pretrained=True)")
    hint = (f"Download the weights where there is a network (e.g. timm.create_model({name!r}, pretrained=True)"
            f".state_dict() saved with torch.save, or model.safetensors from "
            f"https://huggingface.co/{cfg.hf_hub_id}) and pass the file instead: model.pretrained=PATH "
            f"(train.py) or checkpoint=PATH (eval.py)")
    if cfg.hf_hub_id:
        from huggingface_hub import try_to_load_from_cache

        for filename in filter(None, (cfg.hf_hub_filename, "model.safetensors", "pytorch_model.bin")):
            cached = try_to_load_from_cache(cfg.hf_hub_id, filename)
            if isinstance(cached, str):
                return read_checkpoint(cached).state_dict, cached
    if not _hub_reachable():  # without this, the hub client retries for about a minute before failing
        raise CheckpointError(f"cannot load timm:{name}: no network to the Hugging Face hub and the weights "
                              f"are not in the local cache. {hint}")
    try:
        sd = timm.create_model(name, pretrained=True).state_dict()
    except Exception as e:  # network, auth, missing files
        raise CheckpointError(f"cannot load timm:{name} from the hub ({type(e).__name__}: {e}). {hint}") from None
    return sd, f"timm:{name}"


# --- entry points ----------------------------------------------------------------------------------
def read_source(source: str | os.PathLike, ema: bool | None = None) -> Checkpoint:
    """A checkpoint file, or ``timm:<model name with tag>`` from timm's hub (cache first)."""
    source = str(source)
    if source.startswith("timm:"):
        sd, origin = _timm_hub_state_dict(source[len("timm:"):])
        return Checkpoint(sd, "timm", "model", origin, meta={"timm_name": source[len("timm:"):]})
    return read_checkpoint(source, ema=ema)


def checkpoint_num_classes(sd: Mapping[str, torch.Tensor]) -> int:
    """Class count of a checkpoint's classifier (either layout); 0 when it has none."""
    head = sd.get("head.fc.weight", sd.get("head.weight"))
    return 0 if head is None else int(head.shape[0])


def load_pretrained(model: nn.Module, source: str | os.PathLike, *, ema: bool | None = None,
                    reset_head: bool = True) -> LoadReport:
    """Load pretrained weights into ``model`` from a file or ``timm:<model name with tag>``.

    The classifier is re-initialised when the class count differs (``reset_head``); bias tables are
    resized to the model's window size; anything else that does not fit raises :class:`CheckpointError`.
    """
    ckpt = read_source(source, ema=ema)
    return load_into(model, ckpt, reset_head=reset_head)


def load_into(model: nn.Module, ckpt: Checkpoint, *, reset_head: bool) -> LoadReport:
    """Load an already read :class:`Checkpoint` into ``model`` (see :func:`load_state_dict`)."""
    head_reset, classes, resized = load_state_dict(model, ckpt.state_dict, reset_head=reset_head,
                                                   source=f"checkpoint {ckpt.path}")
    report = LoadReport(ckpt.path, ckpt.kind, ckpt.weights, head_reset, resized, classes)
    log.info(report.summary())
    return report


def load_checkpoint(model: nn.Module, source: str | os.PathLike, *, ema: bool | None = None) -> LoadReport:
    """Load a checkpoint for evaluation: like :func:`load_pretrained` but the classifier must fit."""
    return load_into(model, read_source(source, ema=ema), reset_head=False)


__all__ = ["Checkpoint", "CheckpointError", "LoadReport", "checkpoint_num_classes", "convert_state_dict",
           "describe_state_dict", "load_checkpoint", "load_into", "load_pretrained", "load_state_dict",
           "read_checkpoint", "read_file", "read_source"]
