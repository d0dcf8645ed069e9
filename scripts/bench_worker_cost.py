"""What data.decode=gpu's loader workers cost the training step on the GPU, apart from the batches they deliver.

A train.py command (give it data=synthetic: no loader of its own) runs twice: alone, then beside N spawned processes
that each do, per batch, what a decoding worker does (swin.gpu_data.DeviceCollate: nvJPEG decodes 128 ImageNet-like
JPEGs, the recipe's crop / flip / RandAugment run on the GPU, the batch is copied into a page-locked host buffer),
at a capped total rate, feeding nothing. Against data.decode=gpu's own row, this splits its gap to synthetic data into
the workers' GPU work and the training process's side (receiving batches, the copy from the ring); ``--variants``
take parts of the workers' work away (the copy to the host, the augmentation) or change them, one run each. Run it
under MPS, as data.decode=gpu runs (docs/data.md). Table: img/s and data-wait of each run's last epoch (its
summary.json).

    python scripts/bench_worker_cost.py --workers 8 --rate 5800 [--variants worker no-host-copy ...] --out /tmp/cost \
      -- python train.py <synthetic args>
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]


# what each paced process does per batch; "worker" is what a data.decode=gpu loader worker does, the others take
# one part away or change it, to tell what each part of the workers' GPU work costs the step
VARIANTS = {
    "worker": "a loader worker's batch (torchvision's nvJPEG, crop and RandAugment kernels, copy to a page-locked "
              "host buffer)",
    "ycbcr": "the same, decoded to YCbCr planes on the JPEG engines (data.gpu_ycbcr=true)",
    "pinned-files": "the same, the files' bytes page-locked before nvJPEG uploads them",
    "no-host-copy": "the same, the batch left on the GPU (waited for, not copied to the host)",
    "decode-only": "nvJPEG decoding only (waited for)",
}


def worker_batch(device: torch.device, variant: str = "worker", files: int = 128):
    """A callable doing one paced process's batch on ``device`` (see VARIANTS), waiting for it as a worker does
    before it hands the slot over."""
    from bench_decode_contention import make_jpegs, train_transform

    from swin.gpu_augment import transform_shape
    from swin.gpu_data import DeviceCollate, collate_encoded
    jpegs = make_jpegs(files)
    transform = train_transform(ycbcr=variant == "ycbcr")
    transform.kernels = device.type == "cuda"  # on the CPU (the test's) the PyTorch path: the interpreter is slow
    collate = DeviceCollate(device, transform, skip_corrupt=False)
    batch = collate_encoded([(j, k % 10, f"{k}.JPEG", k) for k, j in enumerate(jpegs)])
    if variant == "pinned-files" and device.type == "cuda":
        batch = batch.pin_memory()
    host = torch.empty((files, *transform_shape(collate.transform)), dtype=torch.uint8)
    host = host.pin_memory() if device.type == "cuda" else host
    wait = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def one() -> None:
        images, *_ = collate.decoder(batch, 0)  # the whole batch in one call, as in a worker
        if variant == "decode-only":
            wait()
        elif variant == "no-host-copy":
            collate.augment(images, batch.indices)
            wait()
        else:
            host.copy_(collate.augment(images, batch.indices))  # synchronous, as the copy into a ring slot
    return one


def paced_worker(device: str, variant: str, files: int, rate: float, stop, batches, ready) -> None:
    """A spawned process: worker batches of ``files`` at ``rate`` img/s until ``stop``, counted in ``batches``."""
    device = torch.device(device)
    if device.type == "cuda":  # "cuda" alone names no index, which set_device needs
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    one = worker_batch(device, variant, files)
    one()  # compiles the kernels before the timed run starts
    with ready.get_lock():
        ready.value += 1
    period, due = files / rate, time.perf_counter()
    while not stop.is_set():
        one()
        with batches.get_lock():
            batches.value += 1
        due += period
        pause = due - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        else:  # behind: no catching up in bursts
            due = time.perf_counter()


def run_train(command: list[str], run_dir: Path, timeout: float) -> dict:
    """``command`` with hydra.run.dir=run_dir; its last epoch's img/s and data wait (summary.json)."""
    log = run_dir.parent / f"{run_dir.name}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        rc = subprocess.call([*command, f"hydra.run.dir={run_dir}"], stdout=out, stderr=subprocess.STDOUT,
                             timeout=timeout, cwd=ROOT)
    summary = run_dir / "summary.json"
    if rc or not summary.is_file():
        return {"error": f"rc {rc}, see {log}"}
    s = json.loads(summary.read_text())
    return {"img_s": s.get("images_per_sec"), "data_wait": s.get("data_wait_fraction")}


def beside_workers(command: list[str], run_dir: Path, timeout: float, workers: int, rate: float, variant: str,
                   files: int = 128, device: str = "cuda") -> dict:
    """run_train beside ``workers`` paced worker processes (started and warmed up first); adds their img/s."""
    ctx = mp.get_context("spawn")
    stop, batches, ready = ctx.Event(), ctx.Value("l", 0), ctx.Value("l", 0)
    procs = [ctx.Process(target=paced_worker, args=(device, variant, files, rate / workers, stop, batches, ready),
                         daemon=True) for _ in range(workers)]
    for p in procs:
        p.start()
    try:
        while ready.value < workers:
            if not all(p.is_alive() for p in procs):
                raise RuntimeError("a worker process died while warming up")
            time.sleep(0.2)
        start, before = time.perf_counter(), batches.value
        row = run_train(command, run_dir, timeout)
        row["workers_img_s"] = (batches.value - before) * files / (time.perf_counter() - start)
        return row
    finally:
        stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def table(alone: dict, beside: dict[str, dict], workers: int, rate: float) -> str:
    def cells(row: dict) -> str:
        if "error" in row:
            return f"{row['error']} | - | -"
        ratio = row["img_s"] / alone["img_s"] if "error" not in alone else float("nan")
        return f"{row['img_s']:,.0f} | {row['data_wait']:.1%} | {ratio:.3f}"
    lines = ["| train.py | img/s | data-wait | x alone |", "|---|---|---|---|", f"| alone | {cells(alone)} |"]
    lines += [f"| beside {workers} processes doing {VARIANTS[name]} (capped at {rate:,.0f} img/s in all; they did "
              f"{row.get('workers_img_s', 0):,.0f}) | {cells(row)} |" for name, row in beside.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rate", type=float, default=5800, help="the workers' total img/s (the training speed)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["worker"],
                        help="what the processes do per batch, one train.py run beside them each (see VARIANTS)")
    parser.add_argument("--batch", type=int, default=128, help="files per worker batch")
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_worker_cost"))
    parser.add_argument("--timeout", type=float, default=300, help="seconds per train.py run")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: the test's
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- python train.py ...")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the train.py command after --")
    alone = run_train(command, args.out / "alone", args.timeout)
    print(table(alone, {}, args.workers, args.rate), flush=True)
    beside = {}
    for variant in args.variants:
        beside[variant] = beside_workers(command, args.out / f"beside_{variant}", args.timeout, args.workers,
                                         args.rate, variant, args.batch, args.device)
        print(f"{variant}: {beside[variant]}", flush=True)
    print(table(alone, beside, args.workers, args.rate), flush=True)


if __name__ == "__main__":
    main()
