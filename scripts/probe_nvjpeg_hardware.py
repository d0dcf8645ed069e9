"""Can the H100's JPEG engines (NVJPG) feed training without slowing it? (issue 15)

torchvision's `decode_jpeg(device="cuda")` runs nvJPEG's hybrid backend: Huffman decoding on the CPU (~20 ms of
host time per 128 ImageNet-sized files, under the training process's GIL) and the rest in CUDA kernels on the SMs
the training step needs (docs/benchmarks.md, "Worker processes or threads"). A100/H100-class GPUs also have
hardware JPEG decoders, which nvJPEG exposes as NVJPEG_BACKEND_HARDWARE: no SMs, little host time. torchvision does
not use them, but it ships libnvjpeg, and nvJPEG's C API is small enough to call through ctypes (which releases the
GIL for the call). This probe answers, on the device:

1. does the hardware backend open (engines, cores per engine), and which files does it take (baseline 4:2:0 /
   4:4:4 / grey; progressive goes to the fallback);
2. its batched decode rate and host time per batch of 128, beside torchvision's hybrid decoder;
3. the pixels against torchvision's decode of the same files;
4. the step time of a CUDA-graph "training step" (scripts/bench_decode_contention.py) beside a thread decoding
   with the engines, against the step alone, for each way the timing loop waits for the step (device sync, event
   sync, event polling: whether the decoding threads are held on the host by its blocking calls).

    python scripts/probe_nvjpeg_hardware.py [--jpegs 128] [--seconds 6]
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import io
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from swin.nvjpeg import BACKEND_DEFAULT, BACKEND_HARDWARE, BatchedDecoder, load_nvjpeg  # noqa: E402


def make_files(n: int) -> dict[str, list[bytes]]:
    """n ImageNet-like files (~100 KB, ~500x375) as 4:2:0 baseline (PIL's default), 4:4:4, grey, progressive."""
    from make_imagefolder import make_image
    kinds: dict[str, list[bytes]] = {"4:2:0": [], "4:4:4": [], "grey": [], "progressive": []}
    for k in range(n):
        img = make_image(k % 64, 64, k)
        for kind, args in (("4:2:0", {}), ("4:4:4", {"subsampling": 0}), ("grey", {}),
                           ("progressive", {"progressive": True})):
            buf = io.BytesIO()
            (img.convert("L") if kind == "grey" else img).save(buf, "JPEG", quality=90, **args)
            kinds[kind].append(buf.getvalue())
    return kinds


def rate(fn, seconds: float, batch: int) -> tuple[float, float]:
    """(img/s, host ms per call) of fn() in a loop, synchronising every 4 calls."""
    fn()
    torch.cuda.synchronize()
    calls, host, start = 0, 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        fn()
        host += time.perf_counter() - t
        calls += 1
        if calls % 4 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return calls * batch / (time.perf_counter() - start), host / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jpegs", type=int, default=128, help="files per batch")
    parser.add_argument("--seconds", type=float, default=5.0, help="timed seconds per row")
    parser.add_argument("--sweep", action="store_true", help="only the kernels of a batched hardware decode and the "
                        "decode rate beside the step per batch size and thread count (--batches, --threads)")
    parser.add_argument("--step", choices=("gemm", "swin"), default="gemm",
                        help="the step beside which to decode (bench_decode_contention.step_graph)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 128])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--processes", type=int, nargs="*", default=[],
                        help="only the step beside this many decoding processes (each row of --rates)")
    parser.add_argument("--rates", type=int, nargs="+", default=[6000, 0],
                        help="--processes: their total img/s cap (0: flat out)")
    args = parser.parse_args()
    from torchvision.io import ImageReadMode, decode_jpeg

    torch.cuda.init()
    lib = load_nvjpeg()
    print(f"# {torch.cuda.get_device_name()}: torch {torch.__version__}, libnvjpeg {lib._name}")
    files = make_files(args.jpegs)
    if args.processes:
        process_table(files["4:2:0"], args)
        return
    if args.sweep:
        sweep(lib, files["4:2:0"], args)
        return
    print(f"# {args.jpegs} files per batch; mean sizes: " + ", ".join(
        f"{k} {np.mean([len(f) for f in v]) / 1e3:.0f} KB" for k, v in files.items()))
    try:
        hw = BatchedDecoder(lib, BACKEND_HARDWARE, args.jpegs)
    except RuntimeError as e:
        print(f"hardware backend: unavailable ({e})")
        return
    print(f"hardware backend: open; engines, cores per engine: {hw.engines()}")
    for kind, fs in files.items():
        print(f"  {kind}: hardware batched decode takes {sum(hw.supported(f) for f in fs)} of {len(fs)} files")
    hybrid = BatchedDecoder(lib, BACKEND_DEFAULT, args.jpegs)

    main_files = files["4:2:0"]
    sizes = [hw.size(f)[1:] for f in main_files]
    blobs = [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in main_files]
    print(f"\n| decoder (batch of {args.jpegs}, 4:2:0) | img/s | host ms per batch |\n|---|---|---|")
    rows = {"nvJPEG hardware (ctypes)": lambda: hw(main_files, sizes),
            "nvJPEG default backend (ctypes)": lambda: hybrid(main_files, sizes),
            "torchvision decode_jpeg(device=cuda)": lambda: decode_jpeg(blobs, mode=ImageReadMode.RGB,
                                                                        device="cuda")}
    for name, fn in rows.items():
        r, host = rate(fn, args.seconds, args.jpegs)
        print(f"| {name} | {r:,.0f} | {host:.1f} |", flush=True)

    for kind in ("4:2:0", "4:4:4", "grey"):
        fs = files[kind]
        try:
            got = hw(fs, [hw.size(f)[1:] for f in fs])
        except RuntimeError as e:
            print(f"pixels, {kind}: hardware batch failed ({e})")
            continue
        ref = decode_jpeg([torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in fs], mode=ImageReadMode.RGB,
                          device="cuda")
        diff = [(a.float() - b.float()).abs().mean().item() for a, b in zip(got, ref)]
        luma = [(_luma(a) - _luma(b)).abs().mean().item() for a, b in zip(got, ref)]
        print(f"pixels, {kind}: mean |hardware - torchvision| RGB {np.mean(diff):.2f} (max per image "
              f"{np.max(diff):.2f}), luma {np.mean(luma):.2f}")

    from bench_decode_contention import WAITS, step_graph, step_ms
    graph = step_graph()
    alone = step_ms(graph, args.seconds)
    print("\n| beside the step | step ms | x step alone | decode img/s |\n|---|---|---|---|")
    print(f"| nothing | {alone:.2f} | 1.00 | - |")
    # high-priority streams changed nothing (docs/benchmarks.md, 2026-11-23): the rows now vary how the step's
    # timing loop waits for it, i.e. whether the decoding threads are held on the host by its blocking calls
    for wait in WAITS:
        for threads in (1, 2):
            ms, r = beside(graph, lambda: BatchedDecoder(lib, BACKEND_HARDWARE, args.jpegs), main_files, sizes,
                           threads, args.seconds, wait=wait)
            print(f"| {threads} thread(s) decoding with the engines, step waited by {WAITS[wait]} | {ms:.2f} | "
                  f"{ms / alone:.2f} | {r:,.0f} |", flush=True)


def kernel_table(fn, calls: int = 3) -> str:
    """The CUDA kernels and copies of `calls` calls of fn: name, count, mean us, grid, block, shared memory,
    registers (from the profiler's trace): which of them could wait long for room on SMs a step keeps busy."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    rows: dict[str, list] = {}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        a = e.get("args", {})
        key = (e["name"][:60], str(a.get("grid")), str(a.get("block")), a.get("shared memory"),
               a.get("registers per thread"))
        rows.setdefault(key, []).append(e.get("dur", 0))
    lines = ["| kernel or copy | count | mean us | grid | block | shared memory | registers |",
             "|---|---|---|---|---|---|---|"]
    for (name, grid, block, smem, regs), durs in sorted(rows.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"| {name} | {len(durs)} | {np.mean(durs):.1f} | {grid} | {block} | {smem} | {regs} |")
    return "\n".join(lines)


def sweep(lib: ctypes.CDLL, files: list[bytes], args) -> None:
    """Kernels of one batched hardware decode, then decode img/s beside the step per batch size and thread count
    (each thread its own decoder and stream), against the step alone."""
    from bench_decode_contention import step_graph, step_ms
    hw = BatchedDecoder(lib, BACKEND_HARDWARE, len(files))
    sizes = [hw.size(f)[1:] for f in files]
    print(f"\nkernels of {len(files)}-file hardware decodes (x3):\n")
    print(kernel_table(lambda: hw(files, sizes)))
    graph = step_graph(args.step)
    alone = step_ms(graph, args.seconds)
    print(f"\nstep: {args.step}, {alone:.2f} ms alone\n")
    print("| files per decode call | threads | decode img/s alone | beside the step: step ms | x step alone | "
          "decode img/s |\n|---|---|---|---|---|---|")
    for batch in args.batches:
        part, part_sizes = files[:batch], sizes[:batch]
        for threads in args.threads:
            make = functools.partial(BatchedDecoder, lib, BACKEND_HARDWARE, batch)
            _, r_alone = beside(None, make, part, part_sizes, threads, args.seconds / 2)
            ms, r = beside(graph, make, part, part_sizes, threads, args.seconds)
            print(f"| {batch} | {threads} | {r_alone:,.0f} | {ms:.2f} | {ms / alone:.2f} | {r:,.0f} |", flush=True)
        # torchvision's decode_jpeg on the same files (one process-wide decoder under a mutex: one thread)
        make = functools.partial(TorchvisionDecoder, batch)
        _, r_alone = beside(None, make, part, part_sizes, 1, args.seconds / 2)
        ms, r = beside(graph, make, part, part_sizes, 1, args.seconds)
        print(f"| {batch}, torchvision decode_jpeg | 1 | {r_alone:,.0f} | {ms:.2f} | {ms / alone:.2f} | {r:,.0f} |",
              flush=True)


def _decoding_process(files: list[bytes], per_call: int, rate: float, stop, count) -> None:
    """Decodes `files` in a loop with the engines, `per_call` files per call, at most `rate` img/s (0: no cap),
    adding the files decoded to `count`: a loader worker's GPU work (spawned: a CUDA context of its own)."""
    torch.cuda.set_device(0)
    decoder = BatchedDecoder(load_nvjpeg(), BACKEND_HARDWARE, per_call)
    calls = [files[i:i + per_call] for i in range(0, len(files) - per_call + 1, per_call)]
    sizes = [[decoder.size(f)[1:] for f in call] for call in calls]
    stream, start, done = torch.cuda.Stream(), time.perf_counter(), 0
    with torch.cuda.stream(stream):
        while not stop.is_set():
            for call, call_sizes in zip(calls, sizes):
                decoder(call, call_sizes)
                stream.synchronize()
                done += len(call)
                with count.get_lock():
                    count.value += len(call)
                ahead = done / rate - (time.perf_counter() - start) if rate else 0.0
                if ahead > 0:
                    time.sleep(ahead)


def beside_processes(graph, files: list[bytes], processes: int, seconds: float, rate: float,
                     per_call: int = 6) -> tuple[float, float]:
    """(step ms, decode img/s) with `processes` decoding processes (_decoding_process) sharing a total `rate`."""
    from bench_decode_contention import step_ms
    ctx = mp.get_context("spawn")  # CUDA in a child needs spawn
    stop, count = ctx.Event(), ctx.Value("l", 0)
    procs = [ctx.Process(target=_decoding_process, args=(files, per_call, rate / processes, stop, count))
             for _ in range(processes)]
    for p in procs:
        p.start()
    deadline = time.time() + 120
    while count.value < 10 * per_call * processes and time.time() < deadline:  # all started
        time.sleep(0.2)
    before, start = count.value, time.perf_counter()
    ms = step_ms(graph, seconds)
    decoded = (count.value - before) / (time.perf_counter() - start)
    stop.set()
    for p in procs:
        p.join(timeout=30)
    return ms, decoded


def process_table(files: list[bytes], args) -> None:
    """The step beside decoding processes, per process count and total rate cap, against the step alone."""
    from bench_decode_contention import step_graph, step_ms
    graph = step_graph(args.step)
    alone = step_ms(graph, args.seconds)
    from swin.gpu_data import mps_running
    mps = "an MPS daemon runs" if mps_running() else "no MPS daemon"
    print(f"\nstep: {args.step}, {alone:.2f} ms alone; {mps}; {len(files)} files of "
          f"{np.mean([len(f) for f in files]) / 1e3:.0f} KB, 6 per call\n")
    print("| decoding processes | total img/s cap | step ms | x step alone | decode img/s |\n|---|---|---|---|---|")
    for processes in args.processes:
        for rate in args.rates:
            ms, decoded = beside_processes(graph, files, processes, args.seconds, rate)
            print(f"| {processes} | {rate or 'none'} | {ms:.2f} | {ms / alone:.2f} | {decoded:,.0f} |", flush=True)


class TorchvisionDecoder:
    """torchvision's decode_jpeg(list, device="cuda") with BatchedDecoder's call signature."""

    def __init__(self, batch: int):
        self.batch = batch

    def __call__(self, files: list[bytes], sizes) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg
        return decode_jpeg([torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in files],
                           mode=ImageReadMode.RGB, device="cuda")


def _luma(x: torch.Tensor) -> torch.Tensor:
    r, g, b = x.float()
    return 0.299 * r + 0.587 * g + 0.114 * b


def beside(graph, make_decoder, files: list[bytes], sizes, threads: int, seconds: float,
           priority: int = 0, wait: str = "sync") -> tuple[float, float]:
    """Step time with `threads` threads decoding in a loop (each its own decoder and stream of `priority`: -1
    outranks the step's kernels), and their img/s; wait: how the step's loop waits (bench_decode_contention.WAITS)."""
    from bench_decode_contention import step_ms
    stop, counts = threading.Event(), [0] * threads

    def loop(i: int) -> None:
        decoder, stream = make_decoder(), torch.cuda.Stream(priority=priority)
        with torch.cuda.stream(stream):
            while not stop.is_set():
                decoder(files, sizes)
                stream.synchronize()
                counts[i] += 1
    workers = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(threads)]
    for t in workers:
        t.start()
    deadline = time.perf_counter() + 60
    while sum(counts) < 2 * threads and time.perf_counter() < deadline:
        time.sleep(0.1)
    before, start = sum(counts), time.perf_counter()
    if graph is None:  # the decoders alone
        time.sleep(seconds)
        ms = 0.0
    else:
        ms = step_ms(graph, seconds, wait=wait)
    r = (sum(counts) - before) * len(files) / (time.perf_counter() - start)
    stop.set()
    for t in workers:
        t.join(timeout=30)
    return ms, r


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
