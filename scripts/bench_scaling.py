"""Training throughput over 1, 2, 4 ... processes on one host (torchrun), with where each step's time goes.

    python scripts/bench_scaling.py --procs 1 2 4 -- model=swin_tiny_patch4_window7_224 train.batch_size=128
    python scripts/bench_scaling.py --procs 1 2 -- model=swin_base_patch4_window12_384 train.batch_size=32

For each process count the script starts ``torchrun --nproc-per-node N`` on itself as a worker. Each worker builds
the run as train.py does (swin.train.setup: model, DDP, torch.compile as ``train.compile`` says, optimizer, EMA,
the non-finite guard) from configs/train.yaml with the given overrides, on ``data=synthetic`` unless the overrides
pick another dataset, and runs train.py's own training step (swin.train.step.train_step):

* warm-up updates (compilation, CUDA graph recording), then timed updates: img/s of all processes;
* profiled updates: per step, the collectives by kind (DDP's bucket all-reduces and any other, as the profiler
  names them), and on CUDA the GPU busy time (union of kernel intervals) and the communication that is not
  overlapped: time when an NCCL kernel runs and no other kernel does (the union of all kernels minus the union of
  the compute kernels); each the largest over the ranks. ``--trace`` also writes each rank's Chrome trace.

``train.batch_size`` is per process here (the global batch grows with the processes: weak scaling, as the scaling
targets are stated); the table gives img/s, the factor over the 1-process row, and the per-step times. Results:
``<out>/scaling.json`` and ``scaling.md``. On the CPU (gloo) it runs the same way, without the GPU columns.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchmark import busy_union_us, device_kernels  # noqa: E402

# the profiler's names of collectives (c10d records each as <backend>:<collective>)
COLLECTIVE_PREFIXES = ("nccl:", "gloo:")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- are train.py overrides (train.batch_size: per process).")
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4], help="process counts (default 1 2 4)")
    p.add_argument("--warmup", type=int, default=15, help="untimed updates first (compilation included)")
    p.add_argument("--steps", type=int, default=40, help="timed updates")
    p.add_argument("--profile-steps", type=int, default=5, help="profiled updates (0: none)")
    p.add_argument("--trace", action="store_true", help="also write each rank's profile as a Chrome trace "
                   "(<out>/procsN/trace_rankR.json)")
    p.add_argument("--out", type=Path, default=Path("outputs/bench_scaling"), help="results folder")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per process count")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set by the driver for torchrun
    p.add_argument("overrides", nargs="*")
    return p.parse_args(argv)


def _compose(overrides: list[str], world: int) -> Any:
    """configs/train.yaml with the overrides, for `world` processes: synthetic data unless another dataset is
    picked, train.batch_size per process, enough samples for every update, no checkpoints or logging."""
    from hydra import compose, initialize_config_dir

    import swin.config  # noqa: F401  (registers the schemas)

    given = {o.split("=", 1)[0].lstrip("+"): o.split("=", 1)[1] for o in overrides if "=" in o}
    per_process = int(given.get("train.batch_size", 128))
    extra = ["data=synthetic"] if "data" not in given else []
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[*extra, *overrides, f"train.batch_size={per_process * world}",
                                          "logger.wandb.mode=disabled", "logger.progress=false",
                                          "train.warmup_epochs=0", "train.epochs=1"])
    if cfg.data.name == "synthetic" and "data.train_samples" not in given:
        cfg.data.train_samples = per_process * world * 10_000  # never runs out inside one epoch
    return cfg


def _step_profile(run: Any, batches: Any, clock: Any, steps: int, cuda: bool, trace: Path | None
                  ) -> dict[str, Any]:
    """Over `steps` profiled updates: the collectives per step by kind (as the profiler names them, e.g.
    nccl:all_reduce; DDP's bucket all-reduces included), and on CUDA the GPU busy and exposed communication per
    step (ms). trace: also write the profile there (a Chrome trace)."""
    from swin.train.step import train_step

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            train_step(run, batches, clock)
        if cuda:
            torch.cuda.synchronize()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    events = prof.events()
    # the CPU-side record of each collective (on CUDA the profiler also lists a GPU-side one under the same name)
    names = Counter(e.name for e in events
                    if e.device_type == DeviceType.CPU and e.name.startswith(COLLECTIVE_PREFIXES))
    result: dict[str, Any] = {"collectives_per_step": {k: v / steps for k, v in sorted(names.items())}}
    if not cuda:
        return result
    kernels = device_kernels(events)
    spans = [(k.time_range.start, k.time_range.end) for k in kernels]
    compute = [(k.time_range.start, k.time_range.end) for k in kernels if "nccl" not in k.name.lower()]
    busy = busy_union_us(spans)
    comm = sum(k.time_range.end - k.time_range.start for k in kernels if "nccl" in k.name.lower())
    return {**result, "busy_ms": busy / steps / 1e3, "comm_ms": comm / steps / 1e3,
            "comm_exposed_ms": (busy - busy_union_us(compute)) / steps / 1e3}


def worker(args: argparse.Namespace) -> None:
    """One process of a torchrun job: the run as train.py sets it up, timed and profiled updates; rank 0 writes
    the result to $SCALING_RESULT."""
    from swin.train.checks import check_config
    from swin.train.distributed import all_gather_object, cleanup, env_world_size, init_distributed, pick_device
    from swin.train.loop import EpochClock
    from swin.train.setup import setup
    from swin.train.step import train_step

    world = env_world_size()
    cfg = _compose(args.overrides, world)
    cfg = check_config(cfg, world, pick_device(cfg.device))
    info = init_distributed(cfg.device, cfg.train.dist_timeout_s)
    run = setup(cfg, Path(os.environ["SCALING_RUN_DIR"]), info)
    run.train_loader.set_epoch(0)
    run.model.train()
    batches, clock = iter(run.train_loader), EpochClock()
    cuda = info.device.type == "cuda"

    def sync() -> None:
        run.stats.read()  # waits for the device, as train.py's sync points do

    for _ in range(args.warmup):
        train_step(run, batches, clock)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        train_step(run, batches, clock)
    sync()
    seconds = time.perf_counter() - t0
    trace = Path(os.environ["SCALING_RUN_DIR"]) / f"trace_rank{info.rank}.json" if args.trace else None
    profile = _step_profile(run, batches, clock, args.profile_steps, cuda, trace) if args.profile_steps else {}
    per_rank = all_gather_object({"seconds": seconds, **profile})
    if info.is_main:
        row = {"procs": world, "batch_per_process": cfg.train.batch_size // world, "steps": args.steps,
               "img_s": cfg.train.batch_size * args.steps / max(r["seconds"] for r in per_rank),
               "step_ms": 1e3 * max(r["seconds"] for r in per_rank) / args.steps,
               "compile": run.compile_mode or False, "model": cfg.model.name, "device": str(info.device)}
        for key in ("busy_ms", "comm_ms", "comm_exposed_ms"):
            if key in profile:
                row[key] = max(r[key] for r in per_rank)
        if "comm_exposed_ms" in profile:  # far apart: the ranks wait for each other (skew), not for the network
            row["comm_exposed_ms_min"] = min(r["comm_exposed_ms"] for r in per_rank)
        if profile:
            row["collectives_per_step"] = profile["collectives_per_step"]
        Path(os.environ["SCALING_RESULT"]).write_text(json.dumps(row))
    cleanup()


def _launch(args: argparse.Namespace, procs: int) -> dict[str, Any]:
    out = args.out / f"procs{procs}"
    out.mkdir(parents=True, exist_ok=True)
    result = out / "result.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
           str(Path(__file__).resolve()), "--worker", "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--profile-steps", str(args.profile_steps), *(["--trace"] if args.trace else []), "--", *args.overrides]
    env = {**os.environ, "SCALING_RESULT": str(result), "SCALING_RUN_DIR": str(out)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode or not result.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"procs": procs, "error": f"exit {proc.returncode}: {tail[0]} (log: {out / 'log.txt'})"}
    return json.loads(result.read_text())


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _exposed(row: dict[str, Any]) -> str:
    """The largest exposed NCCL time over the ranks, with the smallest in parentheses where there are several."""
    if row.get("comm_exposed_ms") is None:
        return "-"
    low = row.get("comm_exposed_ms_min")
    return f"{row['comm_exposed_ms']:.2f}" + (f" ({low:.2f})" if low is not None and row["procs"] > 1 else "")


def _collectives(per_step: dict[str, float] | None) -> str:
    if per_step is None:
        return "-"
    return ", ".join(f"{count:g} {name.split(':', 1)[1]}" for name, count in per_step.items()) or "none"


def table(rows: list[dict[str, Any]]) -> str:
    base = next((r["img_s"] for r in rows if r.get("procs") == 1 and "img_s" in r), None)
    lines = ["| processes | batch / process | img/s | scaling | step ms | GPU busy ms | NCCL ms | exposed NCCL ms, "
             "most (least) over ranks | collectives / step |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['procs']} | {r['error']} |")
            continue
        scale = r["img_s"] / base if base else None
        lines.append(f"| {r['procs']} | {r['batch_per_process']} | {r['img_s']:,.0f} | {_fmt(scale, '.2f')}x "
                     f"| {r['step_ms']:.1f} | {_fmt(r.get('busy_ms'), '.1f')} | {_fmt(r.get('comm_ms'), '.1f')} "
                     f"| {_exposed(r)} | {_collectives(r.get('collectives_per_step'))} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.worker:
        worker(args)
        return 0
    if torch.cuda.is_available() and max(args.procs) > torch.cuda.device_count():
        print(f"error: --procs {max(args.procs)} needs that many GPUs; this host has {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    rows = []
    for procs in args.procs:
        rows.append(_launch(args, procs))
        print(json.dumps(rows[-1]), flush=True)
    report = table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps({"overrides": args.overrides, "rows": rows}, indent=2))
    (args.out / "scaling.md").write_text(report + "\n")
    print(report)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
