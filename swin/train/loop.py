"""The training loop behind train.py, in the order it runs: read it top to bottom.

``train(cfg, run_dir)`` checks the config (swin.train.checks) and joins the process group (torchrun, or a
submitit / srun job of several tasks: swin.train.distributed); ``setup`` builds the run (swin.train.setup);
``resume`` continues from a checkpoint when there is one (swin.train.checkpoint); then each epoch runs its
updates (``train_one_epoch``, one ``train_step`` each: swin.train.step), validates (swin.evaluate) and writes
its checkpoints, and the run ends with summary.json (swin.train.logs).

The steady-state step never waits for the device: batches arrive on the device one step ahead
(swin.data.loaders), a non-finite loss or gradient skips the update on the device (swin.train.guard), and the
host reads the device counters only at sync points (:func:`sync_and_log`). The cluster's stop signal
(swin.train.preemption) is acted upon at sync points too: last.pt, then a requeue.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from omegaconf import DictConfig
from tqdm import tqdm

from swin.config import ConfigError, TrainAppConfig
from swin.console import attach_logging, detach_logging
from swin.evaluate import evaluate
from swin.train.checkpoint import resume, save_checkpoint
from swin.train.checks import check_config
from swin.train.distributed import (
    DistInfo,
    all_reduce_sum,
    barrier,
    broadcast_object,
    cleanup,
    env_world_size,
    export_job_environment,
    init_distributed,
    lost_process,
    pick_device,
)
from swin.train.guard import NonFiniteLossError
from swin.train.logs import init_wandb, write_summary
from swin.train.preemption import Interrupted, Preempted, PreemptionFlag
from swin.train.setup import setup
from swin.train.state import Run
from swin.train.step import train_step

log = logging.getLogger("swin.train")

__all__ = ["ConfigError", "NonFiniteLossError", "EpochClock", "train", "train_one_epoch"]


def train(cfg: DictConfig | TrainAppConfig, run_dir: str | Path) -> dict[str, Any]:
    """Train as `cfg` (configs/train.yaml, composed) says, writing into run_dir; returns the summary (also
    summary.json on rank 0). ConfigError names a bad key before any work starts."""
    try:
        device = pick_device(cfg.device)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    export_job_environment()  # a submitit / srun job of several tasks: torchrun's variables from the job
    cfg = check_config(cfg, env_world_size(), device)  # from here on, typed settings (swin.config)
    dist = init_distributed(cfg.device, cfg.train.dist_timeout_s)
    # every rank uses rank 0's run directory (timestamps in hydra.run.dir may differ between ranks)
    run_dir = Path(broadcast_object(str(Path(run_dir).resolve())))
    if dist.is_main:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    barrier()
    handlers = attach_logging(run_dir / "train.log" if dist.is_main else None, dist.is_main)
    preemption = PreemptionFlag()
    preemption.install()
    try:
        return _run(cfg, run_dir, dist, preemption)
    except Preempted as e:
        log.warning(str(e))
        preemption.requeue(dist.is_main)
        raise
    except Interrupted as e:
        log.warning(str(e))
        raise
    except Exception as e:
        lost = lost_process(e, dist, run_dir / "checkpoints" / "last.pt")
        if lost is None:
            raise
        log.error(str(lost))
        raise lost from None
    finally:
        preemption.uninstall()
        detach_logging(handlers)
        cleanup()


def _run(cfg: TrainAppConfig, run_dir: Path, dist: DistInfo, preemption: PreemptionFlag) -> dict[str, Any]:
    log.info(f"run dir {run_dir}, device {dist.device}, {dist.world_size} process(es)")
    run = setup(cfg, run_dir, dist)
    run.preemption = preemption
    resume(run)
    if dist.is_main:
        run.wandb_run = init_wandb(cfg, run_dir, run.wandb_id)
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


@dataclass
class EpochClock:
    """Host-side timing of an epoch's updates after its first (loader start-up and compilation excluded):
    images/s and the fraction of wall time spent blocked in next(loader). Both are taken at sync points,
    where the device has been synchronised, so host time there is device time."""

    t_first: float | None = None  # end of the first update (synchronised)
    t_last: float | None = None  # last sync point
    images: int = 0  # images of the timed updates, all processes
    data_wait: float = 0.0  # seconds blocked in next(loader) during the timed updates (this process)
    half_step: int | None = None  # the step whose sync point starts the epoch's second half (half_step())
    half: tuple[float, int] | None = None  # (time, images) at that sync point

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
        """A sync point: the device is synchronised, all counted updates are done."""
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        self.t_last = now

    def images_per_sec(self, now: float | None = None) -> float:
        """Images/s of the timed updates up to the last sync point, or up to `now` (host time: an estimate between
        sync points, as the host runs at most a few updates ahead of the device)."""
        span = (now or self.t_last or 0.0) - (self.t_first or 0.0)
        return self.images / span if self.images and span > 0 else 0.0

    def mark_half(self) -> None:
        """The sync point in the middle of the epoch: the second half's rate is the steady state, after the ramp
        that follows compilation (CUDA graphs recorded, autotuning, allocator warm-up)."""
        self.mark()
        self.half = (self.t_last or 0.0, self.images)

    def steady_images_per_sec(self) -> float | None:
        """Images/s of the epoch's second half (None without a middle sync point)."""
        if self.half is None or self.t_last is None or self.t_last <= self.half[0]:
            return None
        return (self.images - self.half[1]) / (self.t_last - self.half[0])

    def data_wait_fraction(self, now: float | None = None) -> float | None:
        """Share of the timed updates' wall time spent waiting for data, up to the last sync point or `now`."""
        span = (now or self.t_last or 0.0) - (self.t_first or 0.0)
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


def sync_and_log(run: Run, reads: _Reads, clock: EpochClock, epoch: int, step: int, bar: tqdm) -> tuple[float, int]:
    """Synchronise and read the device counters: warn about skipped updates, stop after train.max_nonfinite
    in a row, refresh the progress bar, and write the log line at log intervals. Returns the epoch's
    (finite loss sum, finite updates) so far."""
    t = run.cfg.train
    counts = run.stats.read()  # the sync
    if step == clock.half_step:
        clock.mark_half()
    else:
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
    _show(bar, reads, (loss_sum, n), cur_lr, ips, wait)
    if run.global_step % run.cfg.logger.log_every_steps == 0:
        loss = _window_mean((loss_sum, n), reads.log)
        reads.log = (loss_sum, n)
        rates = f" img/s {ips:.0f} data-wait {'-' if wait is None else f'{wait:.1%}'}" if ips else ""
        log.info(f"epoch {epoch + 1} step {step + 1}/{run.steps_per_epoch} loss {loss:.4f} lr {cur_lr:.3e}{rates}")
        if run.wandb_run is not None:
            record = {"train/loss": loss, "train/lr": cur_lr, "train/images_per_sec": ips}
            if wait is not None:
                record["train/data_wait_fraction"] = wait
            run.wandb_run.log(record, step=run.global_step)
    return loss_sum, n


def _show(bar: tqdm, reads: _Reads, losses: tuple[float, int], lr: float, ips: float, wait: float | None) -> None:
    """The progress bar's figures: the mean loss since its last refresh, lr, images/s and the data-wait share."""
    loss = _window_mean(losses, reads.bar)
    if losses[1] > reads.bar[1]:
        reads.bar = losses
    bar.set_postfix(loss="-" if math.isnan(loss) else f"{loss:.4f}", lr=f"{lr:.2e}",
                    img_s=f"{ips:.0f}" if ips else "-", data_wait="-" if wait is None else f"{wait:.0%}",
                    refresh=False)


def show_live(run: Run, reads: _Reads, clock: EpochClock, bar: tqdm) -> None:
    """Progress-bar figures after an update between sync points, without waiting for the device: the loss of
    the updates whose counters have arrived (StepStats.peek), images/s and data wait by the host's clock."""
    losses = run.stats.peek()
    if losses is None or losses[1] <= reads.bar[1]:
        losses = reads.bar  # nothing new has arrived: the same loss, fresh rates
    now = time.perf_counter()
    _show(bar, reads, losses, run.optimizer.param_groups[0]["lr"], clock.images_per_sec(now),
          clock.data_wait_fraction(now))


def half_step(run: Run) -> int | None:
    """The step in the middle of the epoch's timed updates (after its first), where the clock marks the start
    of the steady-state half; None for epochs too short to have one."""
    first = run.step_in_epoch
    timed = run.steps_per_epoch - first - 1
    return first + 1 + (timed - 1) // 2 if timed >= 4 else None


def train_one_epoch(run: Run, epoch: int) -> dict[str, Any]:
    """The updates of one epoch (from run.step_in_epoch on); returns the epoch's training record.

    The device is synchronised only at sync points: after the epoch's first update, in its middle, at log lines
    (every logger.log_every_steps updates), before mid-epoch checkpoints and at the end; each sync idles the GPU while
    the host queues the next update. The device keeps the longest run of non-finite updates since the last
    read, so a run with train.max_nonfinite of them in a row stops at the next sync point; the skipped updates
    never change the weights.
    """
    t = run.cfg.train
    # resuming mid-epoch: skip what this rank already consumed, in the same order
    run.train_loader.set_epoch(epoch, start_batch=run.step_in_epoch * t.accum_steps)
    run.model.train()
    run.stats.new_epoch()
    reads, clock = _Reads(nonfinite_total=run.nonfinite_total), EpochClock(half_step=half_step(run))
    bar = tqdm(total=run.steps_per_epoch, initial=run.step_in_epoch, desc=f"epoch {epoch + 1}/{t.epochs}",
               disable=not (run.dist.is_main and run.cfg.logger.progress), dynamic_ncols=True, leave=False)
    batches = iter(run.train_loader)
    cpu_decoded_before = run.train_loader.cpu_decoded  # data.decode=gpu: files nvJPEG cannot decode
    first, half, epoch_skipped, epoch_loss = run.step_in_epoch, clock.half_step, 0, (0.0, 0)
    started = time.perf_counter()
    for step in range(run.step_in_epoch, run.steps_per_epoch):
        try:
            images, skipped = train_step(run, batches, clock)
        except Exception:
            if run.preemption.interrupted and not run.dist.enabled:  # Ctrl-C also ended the loader's workers
                stop_on_interrupt(run, reads, clock, epoch, step, bar, done=step)  # this update never applied
            raise
        clock.count(images * run.dist.world_size)
        epoch_skipped += skipped
        run.global_step += 1
        run.scheduler.step_update(num_updates=run.global_step)
        save_now = bool(t.save_every_steps) and run.global_step % t.save_every_steps == 0
        save_now = save_now and step + 1 < run.steps_per_epoch  # the epoch end saves anyway
        if (step in (first, half) or step + 1 == run.steps_per_epoch or save_now
                or run.global_step % run.cfg.logger.log_every_steps == 0):
            epoch_loss = sync_and_log(run, reads, clock, epoch, step, bar)
            if step == first and run.compile_mode and not run.compiled:
                run.compiled = True
                log.info(f"first update done in {time.perf_counter() - started:.1f} s (torch.compile's "
                         f"{run.compile_mode} mode compiles in it)")
            # the epoch's end is left to finish_epoch, which saves anyway (then _run stops)
            if step + 1 < run.steps_per_epoch and run.preemption.agreed(run.device):
                bar.close()
                stop_for_preemption(run, epoch, step + 1)
        elif not bar.disable:
            show_live(run, reads, clock, bar)
        bar.update(1)  # after the figures are set: a refresh shows this update's
        if save_now:
            save_checkpoint(run, "last.pt", epoch, step + 1)
        # Ctrl-C in one process: stop after the update in flight (the epoch's end is left to finish_epoch)
        if run.preemption.interrupted and not run.dist.enabled and step + 1 < run.steps_per_epoch:
            stop_on_interrupt(run, reads, clock, epoch, step, bar, done=step + 1)
    bar.close()
    run.step_in_epoch = 0
    counts = torch.tensor([epoch_skipped, run.train_loader.cpu_decoded - cpu_decoded_before],
                          device=run.device)
    epoch_skipped, cpu_decoded = (int(v) for v in all_reduce_sum(counts).tolist())
    run.skipped_total += epoch_skipped
    wait = clock.data_wait_fraction()
    return {"epoch": epoch + 1, "train_loss": epoch_loss[0] / max(epoch_loss[1], 1),
            "lr": run.optimizer.param_groups[0]["lr"], "images_per_sec": clock.images_per_sec(),
            "images_per_sec_steady": clock.steady_images_per_sec(),
            "data_wait_fraction": wait, "skipped_images": epoch_skipped, "cpu_decoded_images": cpu_decoded}


def evaluate_epoch(run: Run) -> dict[str, Any]:
    """Validation metrics of the model and, with EMA, of the EMA weights (then the ones judged and kept)."""
    metrics = evaluate(run.fwd_model, run.val_loader, device=run.device, amp=run.amp, progress=False)
    out = {"top1": metrics["top1"], "top5": metrics["top5"], "val_loss": metrics["loss"]}
    if run.ema is not None:  # as timm: with EMA, the EMA weights are the ones judged and kept as best
        ema_metrics = evaluate(run.ema.module, run.val_loader, device=run.device, amp=run.amp, progress=False)
        out = {"model_top1": metrics["top1"], "top1": ema_metrics["top1"], "top5": ema_metrics["top5"],
               "val_loss": ema_metrics["loss"]}
    return out


def stop_on_interrupt(run: Run, reads: _Reads, clock: EpochClock, epoch: int, step: int, bar: tqdm,
                      done: int) -> NoReturn:
    """Ctrl-C in a single process, during the epoch's update `step`: read the device counters (what a checkpoint
    holds), then save and stop with `done` updates of the epoch applied (stop_for_preemption)."""
    sync_and_log(run, reads, clock, epoch, step, bar)
    bar.close()
    stop_for_preemption(run, epoch, done)


def stop_for_preemption(run: Run, epoch: int, step: int, saved: bool = False) -> NoReturn:
    """The cluster's signal or Ctrl-C arrived (on any process): write last.pt now, unless it holds this point
    already, and stop (Preempted, or Interrupted for Ctrl-C)."""
    last = run.ckpt_dir / "last.pt"
    if not saved and run.global_step > run.saved_step:
        save_checkpoint(run, "last.pt", epoch, step)
    if run.preemption.received or not run.preemption.interrupted:
        raise Preempted(f"{run.preemption.signum.name} received (time limit or preemption): saved {last} after "
                        f"{epoch} epoch(s) + {step} step(s); the requeued job, or the same command, continues from it")
    where = f"saved {last}" if run.saved_step >= 0 else "no update to save yet"
    raise Interrupted(f"interrupted (Ctrl-C) after {epoch} epoch(s) + {step} step(s), {where}; rerun the same "
                      "command to resume")


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
             + (f" ({steady:.0f} in its second half)" if (steady := record.get("images_per_sec_steady")) else "")
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
