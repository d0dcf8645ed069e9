"""Saving and resuming the full training state (model, optimizer, scheduler, scaler, EMA, counters,
RNG states, resolved config).

Files are written atomically (swin.io): a process killed at any moment leaves either the previous complete
file or the new complete file, never a torn one. Weights to start from load through swin.models.pretrained;
this module only deals with resumable training state.
"""
from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swin.config import to_dict
from swin.io import atomic_write, remove_stale_temporaries
from swin.models.pretrained import CheckpointError, corrupt_checkpoint
from swin.train.distributed import all_gather_object, broadcast_object, seed_everything
from swin.train.guard import StepStats
from swin.train.state import Run

__all__ = ["atomic_torch_save", "remove_stale_temporaries", "save_train_state", "load_train_state",
           "capture_rng", "restore_rng", "NonFiniteModelError", "save_checkpoint", "resume"]

log = logging.getLogger("swin.train")

FORMAT_VERSION = 1


class NonFiniteModelError(RuntimeError):
    """Raised instead of saving a model (or EMA) with NaN/Inf parameters."""


def non_finite_tensors(state_dict: Mapping[str, Any]) -> list[str]:
    """Names of floating-point tensors in a state_dict that hold NaN or Inf."""
    return [k for k, v in state_dict.items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.isfinite(v).all()]


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """torch.save to `path` so that readers (and a crash) only ever see a complete file."""
    atomic_write(path, lambda f: torch.save(obj, f))


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
        raise corrupt_checkpoint(path, e, "Move it out of the way to start the run afresh, or resume from another "
                                 "file with train.resume=PATH.") from None
    if not isinstance(state, dict) or "model" not in state or "optimizer" not in state:
        raise CheckpointError(f"{path} is not a training checkpoint of train.py (no model/optimizer state); "
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


def save_checkpoint(run: Run, name: str, epoch: int, step: int) -> None:
    """All ranks call this (RNG states are gathered); rank 0 writes. Called after a sync point, so that the
    non-finite count is current (skipped updates never reach the weights; save_train_state also refuses NaN)."""
    rngs = all_gather_object(capture_rng())
    if name == "last.pt":
        run.saved_step = run.global_step
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
        "config": to_dict(run.cfg),
    })


def _load_weights_and_optimizer(run: Run, state: dict[str, Any], path: str, own: bool) -> None:
    """The model and optimizer state of a training checkpoint; CheckpointError when it belongs to another model
    or optimizer setup than this run's (a run directory reused with other model.* or train.* keys)."""
    fix = ("train in a new run directory (hydra.run.dir=...), or rerun with the keys that run had" if own else
           "set model.* and train.* as that run had them, or start from its weights with model.pretrained=PATH")
    try:
        run.raw_model.load_state_dict(state["model"])
    except RuntimeError as e:
        lines = [ln.strip() for ln in str(e).splitlines()[1:] if ln.strip()]
        raise CheckpointError(f"cannot resume from {path}: it holds another model than this run's ("
                              f"{len(lines)} mismatch(es), first: {lines[0] if lines else e}); {fix}") from None
    try:
        run.optimizer.load_state_dict(state["optimizer"])
    except ValueError as e:
        raise CheckpointError(f"cannot resume from {path}: its optimizer state does not fit this run's optimizer "
                              f"({e}; train.opt or train.layer_decay changed?); {fix}") from None


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
        _load_weights_and_optimizer(run, state, resume_path, own=resume_path == str(run.ckpt_dir / "last.pt"))
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
        run.saved_step = run.global_step
        log.info(f"resumed from {resume_path}: {run.epoch} epoch(s) + {run.step_in_epoch} step(s) done")
    if run.global_step:
        run.scheduler.step_update(num_updates=run.global_step)
