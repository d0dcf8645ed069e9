"""Saving and resuming the full training state (model, optimizer, scheduler, scaler, EMA, counters,
RNG states, resolved config).

Files are written atomically: a temporary file in the same directory, fsync, then ``os.replace``,
so a process killed at any moment leaves either the previous complete file or the new complete
file, never a torn one. Pretrained-weight loading lives in ``swin.checkpoint``; this module only
deals with resumable training state.
"""
from __future__ import annotations

import os
import random
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT_VERSION = 1


class NonFiniteModelError(RuntimeError):
    """Raised instead of saving a model (or EMA) with NaN/Inf parameters."""


def non_finite_tensors(state_dict: Mapping[str, Any]) -> list[str]:
    """Names of floating-point tensors in a state_dict that hold NaN or Inf."""
    return [k for k, v in state_dict.items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.isfinite(v).all()]


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """torch.save to `path` so that readers (and a crash) only ever see a complete file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # same directory as the target: os.replace is only atomic within one filesystem
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def remove_stale_temporaries(directory: str | Path) -> int:
    """Delete leftovers of saves that were killed before their rename; returns how many."""
    n = 0
    for tmp in Path(directory).glob(".*.tmp"):
        tmp.unlink(missing_ok=True)
        n += 1
    return n


def save_train_state(path: str | Path, state: dict[str, Any]) -> None:
    """Atomically write a training state; refuses (NonFiniteModelError) if model or EMA is non-finite."""
    for key in ("model", "ema"):
        if state.get(key) is not None:
            bad = non_finite_tensors(state[key])
            if bad:
                raise NonFiniteModelError(
                    f"refusing to save {path}: {key} has non-finite values in {len(bad)} tensors "
                    f"(first: {bad[0]}); the last good checkpoint is kept")
    atomic_torch_save({"format_version": FORMAT_VERSION, **state}, path)


def load_train_state(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a file written by save_train_state, with an error naming the file if it is unusable."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist; check train.resume")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated / not a torch file / foreign pickle
        raise RuntimeError(f"cannot read checkpoint {path}: {e}") from e
    if not isinstance(state, dict) or "model" not in state or "optimizer" not in state:
        raise RuntimeError(f"{path} is not a training checkpoint of train.py (no model/optimizer state); "
                           "to start from weights only, use model.pretrained=PATH instead of train.resume")
    return state


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU and CUDA) in weights_only-loadable types."""
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def restore_rng(rng: dict[str, Any]) -> None:
    """Inverse of capture_rng."""
    random.setstate(_to_tuple(rng["python"]))
    name, keys, *rest = rng["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _to_tuple(x: Any) -> Any:
    # random.setstate needs tuples; a round trip through some serialisers yields lists
    return tuple(_to_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x
