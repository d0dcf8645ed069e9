"""Where a train.py step's time goes: train.py itself, with its own GPU work profiled over a window of batches.

Runs ``train.py`` with the given overrides, unchanged except for two measuring hooks in the training process:
batches ``--start`` to ``--stop`` (counted over the whole run, so past epoch 1's compilation) are profiled with
torch.profiler (CUDA activity only: no host-side tracing to slow the loop), and the host time spent in
``next(loader)`` is split into the training DataLoader's own ``__next__`` (a batch not ready yet, the pin-memory
queue) and the rest (swin.data.DeviceLoader's copy, normalisation and random erasing). Prints one JSON line for the
window (batches start..stop-1), per update (per micro-batch with train.accum_steps > 1): wall time, data wait,
DataLoader wait, the kernels' summed time, the time the GPU ran any of this process's work (busy) and the span from
the first kernel to the last; with ``--json PATH``, also a table of the kernels taking the most time
(scripts/benchmark.py's). Busy below span means the GPU ran none of this process's work in between: it waited for
the host, or other processes' kernels held it (those, e.g. loader workers decoding on the GPU, are not seen).

``--host START STOP`` also times the training thread's host work over updates START..STOP-1 (a window of its own,
without the profiler, whose CUPTI callbacks slow every launch): per update, the host ms of each part of the step
(next batch, mixup, the model call, the loss, backward and the rest of ``train_step``, ``apply_update``, the loop
between updates: scheduler and bookkeeping) and of the check points, whose device syncs (counter reads, preemption
votes, and the drain at the window's end) are split out. Where the host's busy time is close to the wall time the
loop is host-bound (the GPU idles whenever the host falls behind); where the syncs take the difference, the host runs
ahead of the GPU and waits for it there. (A sync elsewhere stays in its part: an optimizer that cannot skip a step
on the device reads the non-finite flag in ``apply_update`` every update.) ``crosses_epoch_end``: the window holds
an epoch's end, whose evaluation and checkpoint count in the wall time only.

    python scripts/profile_train_step.py --start 200 --stop 240 -- experiment=imagenet_swin_tiny data.root=... \
        data.decode=gpu train.compile=true train.compile_mode=reduce-overhead
"""
from __future__ import annotations

import argparse
import collections
import json
import runpy
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.benchmark import busy_union_us, device_kernels, top_kernels_table  # noqa: E402
from swin import data as swin_data  # noqa: E402
from swin import engine  # noqa: E402


class TimedLoader:
    """A DataLoader whose ``__next__`` time is added up in ``self.seconds``."""

    def __init__(self, loader: Any):
        self.loader, self.batch_size, self.seconds = loader, loader.batch_size, 0.0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        batches = iter(self.loader)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self.seconds += time.perf_counter() - t0
            yield batch


# CUDA runtime / driver calls that put work on a stream (CUPTI records them beside the kernels, on every thread)
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


def launch_calls(events: Any, steps: int) -> dict[str, Any]:
    """Per step: how many of each LAUNCH_CALLS call (cudaLaunchKernelExC counts as cudaLaunchKernel...) the host
    made, their host ms in all ("host_ms"), and the calls per thread ("by_thread", the most first: the training
    thread, the autograd engine's, a decoding or augmenting thread of this process): eager work the host launches one
    kernel at a time."""
    counts, host_us, threads = dict.fromkeys(LAUNCH_CALLS, 0), 0.0, collections.Counter()
    for e in events:
        call = next((c for c in LAUNCH_CALLS if e.name.startswith(c)), None)
        if call is not None and e.device_type == torch.autograd.DeviceType.CPU:
            counts[call] += 1
            threads[str(e.thread)] += 1
            host_us += e.time_range.end - e.time_range.start
    return {**{k: v / steps for k, v in counts.items()}, "host_ms": host_us / 1e3 / steps,
            "by_thread": {t: n / steps for t, n in threads.most_common()}}


def summary(prof: torch.profiler.profile, steps: int, wall: float, wait: float, loader_wait: float | None) -> dict:
    """Per step (ms): the window's wall time, data wait, DataLoader wait, and this process's GPU work: summed
    kernel time, busy time (union of the kernel intervals) and the span from the first kernel to the last; the
    host's launch calls (launch_calls)."""
    events = prof.events()
    kernels = device_kernels(events)
    intervals = [(k.time_range.start, k.time_range.end) for k in kernels]
    span = max(e for _, e in intervals) - min(s for s, _ in intervals) if intervals else 0.0
    ms = 1e3 / steps
    return {"steps": steps, "wall_ms": wall * ms, "data_wait_ms": wait * ms,
            "dataloader_next_ms": None if loader_wait is None else loader_wait * ms,
            "kernel_ms": sum(e - s for s, e in intervals) / 1e3 / steps,
            "busy_ms": busy_union_us(intervals) / 1e3 / steps, "span_ms": span / 1e3 / steps,
            "launches": launch_calls(events, steps), "top_kernels": top_kernels_table(kernels, steps, 30)}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _loader_seconds(state: dict[str, Any]) -> float:
    """Seconds the training DataLoader has taken to hand out batches so far (0 without one: data=synthetic)."""
    return 0.0 if state["train_loader"] is None else state["train_loader"].seconds


def install_hooks(start: int, stop: int, json_path: str | None) -> dict[str, Any]:
    """Hooks into this process's swin.engine and swin.data (train.py runs in it): the training loader's DataLoader
    is timed, and batches start..stop-1 are profiled. Returns the state, whose "done" says the window was reached."""
    state: dict[str, Any] = {"batches": 0, "wait": 0.0, "done": False, "train_loader": None}
    device_loader_init = swin_data.DeviceLoader.__init__
    next_batch = engine.EpochClock.next_batch

    def timed_init(self, loader, device, normalize, sampler=None):
        if sampler is not None:  # the training loader (the evaluation loader has none)
            loader = state["train_loader"] = TimedLoader(loader)
        device_loader_init(self, loader, device, normalize, sampler)

    def begin(clock) -> None:
        _sync()
        activity = torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available() else \
            torch.profiler.ProfilerActivity.CPU  # on the CPU: no kernels, the host split alone
        state["prof"] = torch.profiler.profile(activities=[activity])
        state["prof"].__enter__()
        state.update(clock=clock, t0=time.perf_counter(), loader0=_loader_seconds(state))

    def end(clock) -> None:
        _sync()
        wall = time.perf_counter() - state["t0"]
        state["prof"].__exit__(None, None, None)
        loader_wait = None if state["train_loader"] is None else _loader_seconds(state) - state["loader0"]
        result = summary(state["prof"], stop - start, wall, state["wait"], loader_wait)
        # swin.engine makes a new EpochClock per epoch: a window across an epoch's end also times its evaluation
        result["crosses_epoch_end"] = clock is not state["clock"]
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()
                          if k not in ("top_kernels", "launches")}), flush=True)
        print(json.dumps({"launches": result["launches"]}), flush=True)
        if json_path:
            Path(json_path).write_text(json.dumps(result, indent=1))
        state["done"] = True

    def profiled_next_batch(self, batches):
        state["batches"] += 1
        if state["batches"] == start:
            begin(self)
        elif state["batches"] == stop:
            end(self)
        t0 = time.perf_counter()
        batch = next_batch(self, batches)
        if start <= state["batches"] < stop:
            state["wait"] += time.perf_counter() - t0
        return batch

    swin_data.DeviceLoader.__init__ = timed_init
    engine.EpochClock.next_batch = profiled_next_batch
    return state


class _Timed:
    """A callable (the model, the loss, mixup) whose calls add their host time to a phase of HostPhases."""

    def __init__(self, target: Any, phases: HostPhases, name: str):
        self._target, self._phases, self._name = target, phases, name

    def __call__(self, *args, **kwargs):
        return self._phases.time(self._name, self._target, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # train(), no_sync() ... of the wrapped module
        return getattr(self._target, name)


class HostPhases:
    """Host ms per update of each part of swin.engine's training step over updates start..stop-1 (see the module)."""

    PARTS = ("next_batch", "mixup", "model", "loss", "apply_update")

    def __init__(self, start: int, stop: int):
        self.start, self.stop = start, stop
        self.update = 0  # train_step calls so far
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.syncs = 0
        self.t0 = 0.0
        self.step_end: float | None = None  # when the last train_step returned (None: none yet this epoch)
        self.crosses_epoch_end = False  # the window holds an epoch's end (its evaluation, saving): not loop time
        self.result: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        return self.start <= self.update < self.stop

    def time(self, name: str, fn: Any, *args, **kwargs) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if self.active:
                self.seconds[name] += time.perf_counter() - t0

    def step_begins(self) -> None:
        self.update += 1
        if self.update in (self.start, self.stop):
            t0 = time.perf_counter()
            _sync()  # the window's ends are device time; the last drain is the host waiting for the device too
            now = time.perf_counter()
            if self.update == self.start:
                self.t0 = now
            else:
                self.seconds["sync"] += now - t0
                self.result = self.summary(now - self.t0)
                print(json.dumps({"host": self.result}), flush=True)

    def summary(self, wall: float) -> dict[str, Any]:
        ms = {k: v * 1e3 / (self.stop - self.start) for k, v in self.seconds.items()}
        parts = {k: ms.get(k, 0.0) for k in self.PARTS}
        parts["backward_and_rest"] = ms.get("train_step", 0.0) - sum(parts.values())
        # the loop between updates holds the check points, which hold the counter reads; the preemption vote after
        # a check point is in the loop (both are device syncs)
        parts["loop"] = ms.get("loop", 0.0) - ms.get("check_points", 0.0) - ms.get("vote", 0.0)
        parts["check_points_host"] = ms.get("check_points", 0.0) - ms.get("read", 0.0)
        busy = sum(parts.values())
        sync = ms.get("read", 0.0) + ms.get("vote", 0.0) + ms.get("sync", 0.0)
        out = {"updates": self.stop - self.start, "wall_ms": wall * 1e3 / (self.stop - self.start),
               "host_busy_ms": busy, "sync_wait_ms": sync, "syncs": self.syncs,
               "crosses_epoch_end": self.crosses_epoch_end, **{f"{k}_ms": v for k, v in parts.items()}}
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}

    def install(self) -> None:
        """Wraps swin.engine's step functions, the run's model, loss and mixup, and its device reads."""
        phases, setup, train_step = self, engine.setup, engine.train_step
        apply_update, check_point, read = engine.apply_update, engine.check_point, engine.StepStats.read
        train_one_epoch = engine.train_one_epoch
        agreed = engine.PreemptionFlag.agreed

        def timed_setup(*args, **kwargs):
            run = setup(*args, **kwargs)
            run.model, run.criterion = _Timed(run.model, phases, "model"), _Timed(run.criterion, phases, "loss")
            if run.mixup is not None:
                run.mixup = _Timed(run.mixup, phases, "mixup")
            return run

        def timed_train_step(*args, **kwargs):
            if phases.step_end is not None and phases.active:  # the loop's time after the last update
                phases.seconds["loop"] += time.perf_counter() - phases.step_end
            phases.step_begins()
            try:
                return phases.time("train_step", train_step, *args, **kwargs)
            finally:
                phases.step_end = time.perf_counter()

        def timed_sync(fn, name):
            def wrapper(*args, **kwargs):
                phases.syncs += phases.active
                return phases.time(name, fn, *args, **kwargs)
            return wrapper

        def timed_epoch(*args, **kwargs):  # an epoch's end (evaluation, checkpoint) is not loop time
            phases.crosses_epoch_end |= phases.step_end is not None and phases.active
            phases.step_end = None
            return train_one_epoch(*args, **kwargs)

        engine.setup, engine.train_step, engine.train_one_epoch = timed_setup, timed_train_step, timed_epoch
        engine.apply_update = lambda *a, **k: phases.time("apply_update", apply_update, *a, **k)
        engine.check_point = lambda *a, **k: phases.time("check_points", check_point, *a, **k)
        engine.StepStats.read, engine.PreemptionFlag.agreed = timed_sync(read, "read"), timed_sync(agreed, "vote")
        next_batch = engine.EpochClock.next_batch
        engine.EpochClock.next_batch = lambda clock, batches: phases.time("next_batch", next_batch, clock, batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--start", type=int, default=200, help="first profiled batch of the run (1-based)")
    parser.add_argument("--stop", type=int, default=240, help="the window ends when this batch is fetched (keep it "
                        "inside one epoch: its end's evaluation and checkpoint would count)")
    parser.add_argument("--json", help="write the window's numbers and top kernels here")
    parser.add_argument("--replay", action="store_true", help="data.decode=gpu's workers read files but neither "
                        "decode nor augment (scripts/train_replay.py): the training process's own side of each batch")
    parser.add_argument("--host", nargs=2, type=int, metavar=("START", "STOP"), help="time the training thread's "
                        "host work per part of the step over updates START..STOP-1 (1-based; keep it inside one "
                        "epoch and away from the profiled batches)")
    parser.add_argument("overrides", nargs="*", help="train.py's Hydra overrides (after --)")
    args = parser.parse_args()
    if not 1 < args.start < args.stop:
        parser.error("--start must be above 1 and below --stop")
    if args.replay:
        sys.path.insert(0, str(ROOT / "scripts"))  # the workers unpickle train_replay's collate by that name
        from train_replay import replaying
        swin_data._worker_settings = replaying(swin_data._worker_settings)
    state = install_hooks(args.start, args.stop, args.json)
    host = HostPhases(*args.host) if args.host else None
    if host is not None:
        if not 0 < host.start < host.stop:
            parser.error("--host START STOP: 0 < START < STOP")
        host.install()
    sys.argv = [str(ROOT / "train.py"), *args.overrides]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    if host is not None and host.result is not None and args.json and state["done"]:
        # the profiled window's numbers, and the host window's beside them
        result = json.loads(Path(args.json).read_text())
        Path(args.json).write_text(json.dumps({**result, "host": host.result}, indent=1))
    if not state["done"]:
        if "prof" in state:  # started, never stopped: a profiler left running crashes the interpreter's exit
            state["prof"].__exit__(None, None, None)
        sys.exit(f"profile_train_step: the run fetched {state['batches']} training batches, fewer than --stop "
                 f"{args.stop}: nothing was profiled")
    if host is not None and host.result is None:
        sys.exit(f"profile_train_step: the run made {host.update} updates, fewer than --host's STOP {host.stop}")


if __name__ == "__main__":
    main()
