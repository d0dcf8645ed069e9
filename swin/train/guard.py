"""The non-finite guard of a training step, decided on the device (no host sync per step).

A step whose loss (on any process) or gradients are non-finite is skipped: weights, optimizer state
and EMA stay exactly as they were. AMP's GradScaler skips steps the same way: a device-side
``found_inf`` flag that torch's fused optimizers read inside their kernel. Here:

* :func:`nonfinite_flags` turns the loss (all-reduced: a NaN on any process makes the sum NaN on all)
  and the total gradient norm (which clipping computes anyway; inf or NaN iff a gradient is) into
  bool tensors on the device;
* :func:`step_unless` runs ``optimizer.step()`` with ``found_inf``: fused ``torch.optim.Adam`` /
  ``AdamW`` (``fused=True``, what train.py picks on CUDA) skip the update inside the kernel and take
  their step count back, without a sync. Every other optimizer (SGD, timm's, CPU runs without
  ``train.opt_fused=true``) reads the flag on the host: one sync per update, still exact;
* :func:`EmaUpdater` lerps the EMA weights with weight ``(1 - decay) * (not skipped)``;
* :class:`StepStats` counts non-finite updates (consecutive, the longest run in a row, total) and sums the
  losses on the device; the host reads them at sync points (log lines, epoch ends, before checkpoints).

With an fp16 GradScaler the scaler keeps its own logic (skip and back off on overflowing gradients,
which are routine and not counted); a non-finite loss is made visible to it by adding ``loss * 0``
(0, or NaN) to one gradient, so that it skips that step too.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn as nn


# torch.optim classes whose fused kernels read `found_inf` (and keep their state unchanged when it is 1).
# Fused SGD is left out: on its very first step it allocates momentum buffers with empty_like and would
# keep that garbage if the step were skipped.
class NonFiniteLossError(RuntimeError):
    """Too many non-finite losses (or gradients) in a row (train.max_nonfinite)."""


FOUND_INF_FUSED = (torch.optim.Adam, torch.optim.AdamW)


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """True if ``optimizer.step()`` skips itself on the device when ``optimizer.found_inf`` is 1 (as
    GradScaler drives it): a fused torch Adam/AdamW."""
    return (isinstance(optimizer, FOUND_INF_FUSED) and getattr(optimizer, "_step_supports_amp_scaling", False)
            and "grad_scaler" not in inspect.signature(optimizer.step).parameters)


def nonfinite_flags(loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss non-finite, loss or gradient norm non-finite) as 0-dim bool tensors on the device."""
    loss_bad = ~torch.isfinite(loss)
    return loss_bad, loss_bad | ~torch.isfinite(grad_norm)


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor, on_device: bool) -> None:
    """``optimizer.step()`` unless `skip` (0-dim bool on the device) is true; `on_device`:
    supports_found_inf(optimizer), computed once by the caller (inspecting step() every update costs time)."""
    if on_device:
        # what GradScaler.step does for these optimizers: attributes read by step(), then removed
        optimizer.found_inf = skip.to(torch.float32)  # type: ignore[attr-defined]  # exactly 0.0 or 1.0
        optimizer.grad_scale = None  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]
    elif not bool(skip):  # host sync: the price of an optimizer without a found_inf kernel
        optimizer.step()


def poison_grads_if_nonfinite(params: Sequence[nn.Parameter], loss: torch.Tensor) -> None:
    """Add ``loss * 0`` (0, or NaN when the loss is non-finite) to one gradient: a GradScaler then sees a
    non-finite gradient and skips the step, without a host sync. Adding 0 changes nothing."""
    for p in params:
        if p.grad is not None:
            p.grad.add_((loss.detach() * 0).to(p.grad.dtype))
            return


class EmaUpdater:
    """ModelEmaV3's update (decay schedule from ``ema.get_decay(step)``), skipped on the device when asked.

    The lerp weight is ``(1 - decay) * (not skip)``: a skipped step leaves the EMA unchanged without a
    sync. The tensor pairs are collected once (ema and model state_dict tensors share storage with the
    modules, and loading a checkpoint copies into them in place).
    """

    def __init__(self, ema: nn.Module, model: nn.Module):
        self.ema = ema
        self.floats: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self.others: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # integer buffers
        for e, m in zip(ema.module.state_dict().values(), model.state_dict().values()):
            es, ms = self.floats.setdefault(e.dtype, ([], [])) if e.is_floating_point() else self.others
            es.append(e)
            ms.append(m)

    @torch.no_grad()
    def update(self, step: int, skip: torch.Tensor) -> None:
        weight = (~skip).to(torch.float32) * (1.0 - self.ema.get_decay(step))
        for dtype, (es, ms) in self.floats.items():
            # ema += w (model - ema): lerp with a device-side weight (torch has no tensor-weight foreach lerp)
            diff = torch._foreach_sub(ms, es)
            torch._foreach_mul_(diff, weight.to(dtype))
            torch._foreach_add_(es, diff)
        if self.others[0]:  # integer buffers are copied, as ModelEmaV3 does (a skipped step did not change them)
            torch._foreach_copy_(*self.others)


class StepCounts(NamedTuple):
    """StepStats as read on the host."""

    longest_streak: int  # the longest run of non-finite updates in a row since the previous read
    streak: int  # non-finite updates in a row up to now
    total: int  # non-finite updates in total
    loss_sum: float  # sum of this epoch's finite step losses
    finite: int  # number of those steps


class StepStats:
    """Device-side counters of the training steps, read on the host only at sync points.

    ``values`` = [non-finite updates in a row, non-finite updates in total, sum of finite step losses this
    epoch, number of those steps, the longest run in a row since the last read]; the longest run lets the host
    read rarely (at log lines) and still see a streak that ended between two reads.
    """

    def __init__(self, device: torch.device, nonfinite_total: int = 0):
        self.values = torch.tensor([0.0, float(nonfinite_total), 0.0, 0.0, 0.0], dtype=torch.float64, device=device)
        # peek(): the values copied to page-locked memory after an update, ready once the event has passed
        self._cuda = device.type == "cuda"
        self._host = torch.empty(5, dtype=torch.float64, pin_memory=True) if self._cuda else None
        self._copied: torch.cuda.Event | None = None
        self._latest: tuple[float, int] | None = None

    def record(self, loss: torch.Tensor, loss_bad: torch.Tensor, counted: torch.Tensor) -> None:
        """One update: its mean loss, whether the loss was non-finite, whether the update counts as non-finite."""
        c = counted.to(torch.float64)
        self.values[0].add_(1).mul_(c)  # +1, or back to 0
        torch.maximum(self.values[4], self.values[0], out=self.values[4])
        ok = (~loss_bad).to(torch.float64)
        self.values[1:4].add_(torch.stack([c, torch.where(loss_bad, 0.0, loss.detach().double()), ok]))

    def new_epoch(self) -> None:
        self.values[2:4].zero_()
        self._copied, self._latest = None, None

    def peek(self) -> tuple[float, int] | None:
        """(loss sum, finite steps) of the epoch as of a recent update, without waiting for the device: on CUDA,
        the last copy that has arrived (each call starts the next copy once the previous one is done); None before
        the first has arrived. For live figures between sync points."""
        if not self._cuda:
            loss_sum, n = self.values[2:4].tolist()  # CPU values: no device to wait for
            return loss_sum, int(n)
        if self._copied is not None:
            if not self._copied.query():
                return self._latest
            loss_sum, n = self._host[2:4].tolist()
            self._latest = (loss_sum, int(n))
        self._host.copy_(self.values, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return self._latest

    def read(self) -> StepCounts:
        """The counters (one sync); the longest streak starts again from the current one."""
        streak, total, loss_sum, n, longest = self.values.tolist()
        self.values[4].copy_(self.values[0])
        return StepCounts(int(longest), int(streak), int(total), loss_sum, int(n))
