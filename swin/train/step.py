"""One optimizer update: micro-batches with DDP's no_sync, then clipping, the non-finite guard, the optimizer
step and EMA. It only queues device work: nothing here waits for the device."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from typing import Protocol

import torch
from timm.utils import dispatch_clip_grad

from swin.train.distributed import all_reduce_sum
from swin.train.guard import nonfinite_flags, poison_grads_if_nonfinite, step_unless
from swin.train.state import Run


class BatchTimer(Protocol):
    """Takes the next batch from the loader, timing how long the step waits for it (swin.train.loop.EpochClock)."""

    def next_batch(self, batches: Iterator) -> tuple[torch.Tensor, torch.Tensor, int]: ...


def train_step(run: Run, batches: Iterator, clock: BatchTimer) -> tuple[int, int]:
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
    or a gradient is non-finite, decided on the device (see swin.train.guard)."""
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
