"""Where should GPU JPEG decoding run: threads of the training process, or loader worker processes?

Both cost the training step something, and this measures which costs less (issue 15; docs/benchmarks.md):
- threads: the decode + augmentation pipeline needs ~45 ms of host time per batch of 128 (nvJPEG's Huffman stage
  runs on the CPU, the per-image crops launch ~500 kernels), under the training process's GIL;
- worker processes: no GIL shared with training, but each has its own CUDA context, and kernels of different
  contexts time-slice the GPU (no MPS) instead of running side by side.

The "training step" is a CUDA graph of GPU-bound matmuls and ~20 ms of mid-sized GEMM + GELU kernels (what a
CUDA-graph Swin-T step looks like to the GPU: host-light). Rows: the step alone, beside 2/4/8 spawned processes that
decode + augment batches in a loop (the way loader workers would, ending with the uint8 batch copied to the host),
the same processes decoding only, and beside 1/2 threads of this process decoding (+ augmenting), with the step
replayed on the legacy default stream (where torch runs it unless told otherwise) or on a side stream. The side
stream is the question: torchvision decodes on a stream of its own and nvJPEG may make synchronous CUDA calls
(cudaMemcpy, cudaFree: they wait for the legacy default stream, or the whole device), so a decoding thread may wait
for whole training steps instead of for its own work (it did not: docs/benchmarks.md). The threads rows now also vary
how the timing loop waits for its queued steps (`--waits`): a blocking device synchronisation, a blocking event
synchronisation, or polling the event from Python, which tells whether the decoding thread is held up on the host by
the other thread's blocking CUDA calls. `--trace` lists the CUDA API calls of a 1-thread row by total time (which
call blocks). Columns: the step's time and the pipeline's img/s.

    python scripts/bench_decode_contention.py [--jpegs 128] [--seconds 6]
"""
from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]


def make_jpegs(n: int) -> list[bytes]:
    from make_imagefolder import make_image
    out = []
    for k in range(n):
        buf = io.BytesIO()
        make_image(k % 64, 64, k).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


AUGMENT_KERNELS = True  # TrainTransform's kernels (crops and RandAugment layers); --torch-augment: its PyTorch path


def train_transform(ycbcr: bool = False):
    """The imagenet recipe's device transform (rand-m9-mstd0.5-inc1, random interpolation) at 224; ``ycbcr``: decoded
    to YCbCr planes on the JPEG engines (data.gpu_ycbcr)."""
    from swin import gpu_augment as ga
    spec = ga.TrainSpec(size=(224, 224), interpolation="random",
                        rand_augment=ga.parse_rand_augment("rand-m9-mstd0.5-inc1"), ycbcr=ycbcr)
    return ga.TrainTransform(spec, kernels=AUGMENT_KERNELS)


def pipeline(jpegs: list[bytes], to_host: bool, augment: bool = True, chunk: int = 0):
    """One batch: nvJPEG decode (the H100's JPEG engines), then the imagenet recipe's crop / flip / RandAugment on the
    GPU; augment=False: the decoded images only (to the host: each of them). chunk > 0: decode_jpeg calls of that
    many files (beside a busy step, calls of up to 4 files decode 20x faster than calls of 16 or more:
    docs/benchmarks.md)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    transform, rng = train_transform(), np.random.default_rng(0)
    blobs = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in jpegs]

    def one_batch() -> torch.Tensor | list[torch.Tensor]:
        step = chunk or len(blobs)
        images = [img for i in range(0, len(blobs), step)
                  for img in decode_jpeg(blobs[i:i + step], mode=ImageReadMode.RGB, device="cuda")]
        if not augment:
            return [img.cpu() for img in images] if to_host else images
        x = transform(images, rng)
        return x.cpu() if to_host else x
    return one_batch


def _worker(jpegs: list[bytes], stop, batches, augment: bool, kernels: bool) -> None:
    global AUGMENT_KERNELS
    AUGMENT_KERNELS = kernels  # a spawned process imports this module afresh
    torch.cuda.set_device(0)
    one_batch = pipeline(jpegs, to_host=True, augment=augment)
    while not stop.is_set():
        one_batch()
        with batches.get_lock():
            batches.value += 1


def step_graph(kind: str = "gemm") -> torch.cuda.CUDAGraph:
    """The "training step" as a CUDA graph: `gemm`, six 8192^3 GEMMs (~1.5 ms each, every SM busy throughout) and
    60 mid-sized GEMM + GELU; `swin`, a real one: Swin-T b128 bf16 forward + backward with flash window attention
    (eager kernels, the longest ~0.3 ms). A kernel of another stream waits for SMs to free up: for how long
    depends on how long the step's kernels hold them, so the two steps can give decoding threads very different
    rates."""
    if kind == "swin":
        return _swin_step_graph()
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    act = [torch.randn(128 * 56 * 56 // 8, 384, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    w = torch.randn(384, 384, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (cuBLAS workspaces) off the capture
        big @ big
        torch.nn.functional.gelu(act[0] @ w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(6):
            big @ big
        for _ in range(60):
            act[1].copy_(torch.nn.functional.gelu(act[0] @ w) + act[0])
    return graph


def _swin_step_graph(batch: int = 128) -> torch.cuda.CUDAGraph:
    from swin import create_model
    model = create_model("swin_tiny_patch4_window7_224", attention="flash_window").cuda().to(torch.bfloat16)
    x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, .grad tensors are allocated
        for _ in range(3):
            model(x).float().logsumexp(1).mean().backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # gradients accumulate into the existing .grad tensors
        model(x).float().logsumexp(1).mean().backward()
    return graph


def round_trips(jpeg: bytes) -> dict[str, Callable[[], Callable[[], object]]]:
    """GPU round trips to time beside the step, each a factory (run in the timing thread) of one call."""
    from torchvision.io import ImageReadMode, decode_jpeg

    def tiny_kernel():
        x = torch.zeros(1024, device="cuda")
        return lambda: x.add_(1)

    def copy(pinned: bool):
        def make():
            host = torch.empty(len(jpeg), dtype=torch.uint8, pin_memory=pinned)
            dev = torch.empty(len(jpeg), dtype=torch.uint8, device="cuda")
            return lambda: dev.copy_(host, non_blocking=True)
        return make

    def decode():
        blob = torch.frombuffer(bytearray(jpeg), dtype=torch.uint8)
        return lambda: decode_jpeg([blob], mode=ImageReadMode.RGB, device="cuda")
    return {"a tiny kernel": tiny_kernel, f"a {len(jpeg) // 1000} KB copy from pinned memory": copy(True),
            f"a {len(jpeg) // 1000} KB copy from pageable memory": copy(False),
            "torchvision decode_jpeg of one file (device=cuda)": decode}


def latency_beside(graph, seconds: float, make_call, priority: int = 0) -> tuple[float, float]:
    """Mean round trip (us) of make_call()'s call and a stream synchronisation, looped in a thread, alone and
    beside the step: what every per-image synchronisation of a decoder costs while the step keeps the GPU busy."""
    stop, trips, go = threading.Event(), [0], threading.Event()

    def loop() -> None:
        stream = torch.cuda.Stream(priority=priority)
        with torch.cuda.stream(stream):
            call = make_call()
            go.set()
            while not stop.is_set():
                call()
                stream.synchronize()
                trips[0] += 1
    worker = threading.Thread(target=loop)
    worker.start()
    go.wait()
    times = []
    for beside_step in (False, True):
        time.sleep(0.3)
        before, start = trips[0], time.perf_counter()
        if beside_step:
            step_ms(graph, seconds)
        else:
            time.sleep(seconds)
        times.append((time.perf_counter() - start) / max(trips[0] - before, 1) * 1e6)
    stop.set()
    worker.join()
    return times[0], times[1]


WAITS = {  # how the timing loop waits for the step it keeps queued: torch.cuda.synchronize, the step's event
    # (cudaEventSynchronize), or polling that event from Python (the driver never blocks the host)
    "sync": "torch.cuda.synchronize",
    "event": "event.synchronize",
    "poll": "event.query polled",
}


def _wait_for(event: torch.cuda.Event, wait: str) -> None:
    if wait == "sync":
        torch.cuda.synchronize()
    elif wait == "event":
        event.synchronize()
    else:
        while not event.query():
            time.sleep(2e-4)


def step_ms(graph: torch.cuda.CUDAGraph, seconds: float, stream: torch.cuda.Stream | None = None,
            wait: str = "sync") -> float:
    """ms per replay of the step on `stream` (None: the current stream, torch's legacy default one), keeping at most
    4 replays queued, as a training loop does, and waiting for them the `wait` way (WAITS)."""
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
        n, start, done = 0, time.perf_counter(), torch.cuda.Event()
        while time.perf_counter() - start < seconds:
            graph.replay()
            n += 1
            if n % 4 == 0:
                done.record()
                _wait_for(done, wait)
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


def beside_processes(jpegs: list[bytes], graph, processes: int, seconds: float, batch: int,
                     augment: bool = True) -> tuple[float, float]:
    """augment=False: the processes only decode (JPEG engines, few kernels of their own): does a context that
    hardly uses the SMs still cost the step its time slices?"""
    ctx = mp.get_context("spawn")  # CUDA in a child needs spawn
    stop, batches = ctx.Event(), ctx.Value("i", 0)
    procs = [ctx.Process(target=_worker, args=(jpegs, stop, batches, augment, AUGMENT_KERNELS))
             for _ in range(processes)]
    for p in procs:
        p.start()
    while batches.value < 2 * processes:  # all started (import, CUDA context, first batches)
        time.sleep(0.5)
    before, start = batches.value, time.perf_counter()
    ms = step_ms(graph, seconds)
    rate = (batches.value - before) * batch / (time.perf_counter() - start)
    stop.set()
    for p in procs:
        p.join()
    return ms, rate


def _wait_until(ready, threads: list[threading.Thread], timeout: float = 120.0) -> None:
    """Waits for the threads' first batches; a thread that died (its traceback is printed) or a timeout ends the
    run instead of hanging it."""
    deadline = time.perf_counter() + timeout
    while not ready():
        if not all(t.is_alive() for t in threads) or time.perf_counter() > deadline:
            raise RuntimeError("a decoding thread died or made no progress (see above)")
        time.sleep(0.1)


def beside_threads(jpegs: list[bytes], graph, threads: int, seconds: float, batch: int, side_stream: bool,
                   augment: bool = True, trace: bool = False, wait: str = "sync",
                   chunk: int = 0) -> tuple[float, float, str]:
    """side_stream: the step replays on a side stream (non-blocking, as torch's are) instead of the legacy default
    stream; trace: also a table of the CUDA API calls during the timed part, by total time; wait: see WAITS."""
    stop, counts = threading.Event(), [0] * threads

    def loop(i: int) -> None:
        one_batch, stream = pipeline(jpegs, to_host=False, augment=augment, chunk=chunk), torch.cuda.Stream()
        with torch.cuda.stream(stream):
            while not stop.is_set():
                one_batch()
                stream.synchronize()
                counts[i] += 1
    workers = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(threads)]
    for t in workers:
        t.start()
    _wait_until(lambda: sum(counts) >= 2 * threads, workers)
    step_stream = torch.cuda.Stream() if side_stream else None
    before, start = sum(counts), time.perf_counter()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if trace else nullcontext() as prof:
        ms = step_ms(graph, seconds, step_stream, wait)
    rate = (sum(counts) - before) * batch / (time.perf_counter() - start)
    stop.set()
    for t in workers:
        t.join()
    return ms, rate, api_calls(prof) if trace else ""


def beside_pipelined(jpegs: list[bytes], graph, seconds: float, chunk: int, decode_threads: int = 1
                     ) -> tuple[float, float]:
    """The in-process design with decoding and augmentation overlapped: `decode_threads` threads decode batches with
    nvJPEG's hardware engines through ctypes (scripts/probe_nvjpeg_hardware.py: no process-wide mutex, the GIL
    released during the call) in calls of `chunk` files, each on its own stream, and hand them to one thread that
    crops / flips / RandAugments them on its own stream. Returns (step ms, img/s through the augmentation)."""
    import queue

    from probe_nvjpeg_hardware import BACKEND_HARDWARE, BatchedDecoder, load_nvjpeg

    lib = load_nvjpeg()
    stop, done, decoded = threading.Event(), [0], queue.Queue(maxsize=2)

    def decode_loop() -> None:
        stream, decoders = torch.cuda.Stream(), {}
        with torch.cuda.stream(stream):
            while not stop.is_set():
                images = []
                for i in range(0, len(jpegs), chunk):
                    part = jpegs[i:i + chunk]
                    if len(part) not in decoders:
                        decoders[len(part)] = BatchedDecoder(lib, BACKEND_HARDWARE, len(part))
                    dec = decoders[len(part)]
                    images += dec(part, [dec.size(f)[1:] for f in part])
                    stream.synchronize()  # the measured configuration (probe_nvjpeg_hardware.py --sweep)
                while not stop.is_set():
                    try:
                        decoded.put((images, stream), timeout=0.1)
                        break
                    except queue.Full:
                        pass

    def augment_loop() -> None:
        stream, transform, rng = torch.cuda.Stream(), train_transform(), np.random.default_rng(0)
        with torch.cuda.stream(stream):
            while not stop.is_set():
                try:
                    images, _ = decoded.get(timeout=0.1)
                except queue.Empty:
                    continue
                for img in images:  # made on the decoding thread's stream (synchronised there)
                    img.record_stream(stream)
                transform(images, rng)
                stream.synchronize()
                done[0] += 1
    threads = [threading.Thread(target=decode_loop, daemon=True) for _ in range(decode_threads)]
    threads.append(threading.Thread(target=augment_loop, daemon=True))
    for t in threads:
        t.start()
    _wait_until(lambda: done[0] >= 3, threads)
    before, start = done[0], time.perf_counter()
    ms = step_ms(graph, seconds)
    rate = (done[0] - before) * len(jpegs) / (time.perf_counter() - start)
    stop.set()
    for t in threads:
        t.join()
    return ms, rate


def profile_batches(one_batch: Callable[[], object], batches: int, top: int) -> tuple[float, float, float, list[str]]:
    """3 warm-up calls of `one_batch`, then `batches` under torch.profiler: GPU ms per batch (all, and of it the
    copies), wall ms per batch, and the `top` kernels and copies by GPU time as markdown table rows."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        one_batch()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(batches):
            one_batch()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / batches * 1e3
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in kernels) / batches / 1e3
    copies = sum(e.self_device_time_total for e in kernels if e.key.startswith("Memcpy")) / batches / 1e3
    rows = [f"| {e.key[:70]} | {e.count / batches:.1f} | {e.self_device_time_total / batches / 1e3:.3f} |"
            for e in kernels[:top]]
    return total, copies, wall, rows


def augment_profile(jpegs: list[bytes], batches: int = 8, top: int = 15) -> str:
    """GPU time per batch of the crop / flip / RandAugment stage alone (decoded images in hand), by kernel, and its
    host time: what the augmentation would take from a step it runs beside."""
    from torchvision.io import ImageReadMode, decode_jpeg

    from swin.gpu_data import FILES_PER_CALL_BESIDE_STEP as per_call
    transform, rng = train_transform(), np.random.default_rng(0)
    images = [img for i in range(0, len(jpegs), per_call) for img in decode_jpeg(
        [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in jpegs[i:i + per_call]], mode=ImageReadMode.RGB,
        device="cuda")]
    total, _, host, rows = profile_batches(lambda: transform(images, rng), batches, top)
    return "\n".join([f"augmentation of a batch of {len(jpegs)} alone: {total:.2f} ms of GPU time, {host:.1f} ms "
                      "wall (profiled)\n", "| kernel | per batch | GPU ms per batch |", "|---|---|---|", *rows])


DECODERS = {"torchvision": "torchvision's nvJPEG (a train.py worker's)",
            "ycbcr": "swin.nvjpeg on the JPEG engines, YCbCr planes (a train.py worker's with data.gpu_ycbcr=true)",
            "engines": "swin.nvjpeg on the JPEG engines, RGB (the decoding thread's)"}


def worker_profile(jpegs: list[bytes], batches: int = 8, top: int = 20, decoder: str = "torchvision") -> str:
    """GPU work per batch of what one data.decode=gpu loader worker runs (swin.gpu_data.DeviceCollate: one nvJPEG
    call for the batch, the recipe's augmentation, the copy into a page-locked host buffer as into a slot of
    swin.batch_ring), by kernel and copy: what the workers put on the GPU beside the training step. decoder: see
    DECODERS (engines: the decoding thread's decoder)."""
    from swin.gpu_data import DeviceCollate, collate_encoded
    collate = DeviceCollate(torch.device("cuda"), train_transform(ycbcr=decoder == "ycbcr"), skip_corrupt=False)
    if decoder != "torchvision":
        collate.decoder.open_engines(len(jpegs))
        if collate.decoder.engines is None:
            return f"no JPEG engines on this GPU (or no libnvjpeg): nothing to profile with --decoder {decoder}"
    batch = collate_encoded([(j, k % 10, f"{k}.JPEG", k) for k, j in enumerate(jpegs)])
    host = torch.empty((len(jpegs), 3, 224, 224), dtype=torch.uint8).pin_memory()

    def one_batch() -> None:
        images, *_ = collate.decoder(batch, 0)  # a worker decodes the batch in one call (files_per_call)
        host.copy_(collate.augment(images, batch.indices))

    total, copies, wall, rows = profile_batches(one_batch, batches, top)
    kb = np.mean([len(j) for j in jpegs]) / 1e3
    head = (f"one worker's batch of {len(jpegs)} ({DECODERS[decoder]}, {kb:.0f} KB files) alone: {total:.2f} ms of "
            f"GPU time, of which copies {copies:.2f} ms; {wall:.1f} ms wall (profiled)\n")
    return "\n".join([head, "| kernel or copy | per batch | GPU ms per batch |", "|---|---|---|", *rows])


def api_calls(prof, top: int = 12) -> str:
    """The CUDA runtime/driver calls of every thread (CUPTI sees them all), by total time, as a table."""
    calls = [e for e in prof.key_averages() if e.key.startswith(("cuda", "cu")) and e.count]
    calls.sort(key=lambda e: e.cpu_time_total, reverse=True)
    rows = [f"| {e.key} | {e.count} | {e.cpu_time_total / 1e3:,.1f} | {e.cpu_time_total / e.count:,.0f} |"
            for e in calls[:top]]
    return "\n".join(["| call | count | total ms | mean us |", "|---|---|---|---|", *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jpegs", type=int, default=128, help="images per batch")
    parser.add_argument("--seconds", type=float, default=6.0, help="timed seconds per row")
    parser.add_argument("--processes", type=int, nargs="*", default=[2, 4, 8])
    parser.add_argument("--threads", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--trace", action="store_true", help="CUDA API calls of the 1-thread decode-only rows")
    parser.add_argument("--waits", nargs="+", choices=list(WAITS), default=list(WAITS),
                        help="how the timing loop waits for its queued steps in the threads rows")
    parser.add_argument("--side-stream", action="store_true", help="also the threads rows with the step on a side "
                        "stream (no change in docs/benchmarks.md, 2026-11-23)")
    parser.add_argument("--step", choices=("gemm", "swin"), default="gemm", help="the step beside which to decode "
                        "(step_graph): big GEMMs, or a Swin-T b128 bf16 forward + backward")
    parser.add_argument("--chunks", type=int, nargs="+", default=[0], help="files per decode_jpeg call in the "
                        "threads rows (0: the whole batch)")
    parser.add_argument("--no-round-trips", action="store_true", help="skip the round-trip table")
    parser.add_argument("--pipelined", type=int, nargs="*", default=[], help="files per call of the overlapped "
                        "decoding + augmenting threads rows (beside_pipelined)")
    parser.add_argument("--torch-augment", action="store_true", help="the augmentation's PyTorch path (per-image "
                        "crops, per-op slices) instead of its kernels")
    parser.add_argument("--augment-profile", action="store_true", help="only the augmentation's GPU time per batch")
    parser.add_argument("--worker-profile", action="store_true", help="only a decoding worker's GPU time per batch "
                        "(decode, augmentation, copy to the host)")
    parser.add_argument("--decoder", choices=list(DECODERS), default="torchvision", help="--worker-profile's decoder")
    args = parser.parse_args()
    global AUGMENT_KERNELS
    AUGMENT_KERNELS = not args.torch_augment
    jpegs = make_jpegs(args.jpegs)
    if args.augment_profile or args.worker_profile:
        print(augment_profile(jpegs) if args.augment_profile else worker_profile(jpegs, decoder=args.decoder))
        return
    graph = step_graph(args.step)
    alone = step_ms(graph, args.seconds)
    print(f"# {torch.cuda.get_device_name()}: torch {torch.__version__}; {args.jpegs} JPEGs of "
          f"{np.mean([len(j) for j in jpegs]) / 1e3:.0f} KB per batch; step: {args.step}\n")
    print("| round trip: call + stream sync, in a thread | stream priority | alone us | beside the step us |\n"
          "|---|---|---|---|")
    for name, make_call in ({} if args.no_round_trips else round_trips(jpegs[0])).items():
        for priority in (0, -1):
            alone_us, beside_us = latency_beside(graph, args.seconds / 2, make_call, priority)
            print(f"| {name} | {priority} | {alone_us:,.0f} | {beside_us:,.0f} |", flush=True)
    print("\n| decoding beside the step | step ms | x step alone | pipeline img/s |\n|---|---|---|---|")
    print(f"| none | {alone:.2f} | 1.00 | - |")
    for augment in (True, False):
        for n in args.processes:
            ms, rate = beside_processes(jpegs, graph, n, args.seconds, args.jpegs, augment)
            kind = "decode + augment" if augment else "decode only"
            print(f"| {n} worker processes, {kind} | {ms:.2f} | {ms / alone:.2f} | {rate:,.0f} |", flush=True)
    traces = []
    # the threads rows: the step on the default stream waited for each WAITS way, then (--side-stream) on a side one
    settings = [(False, wait) for wait in args.waits] + ([(True, "sync")] if args.side_stream else [])
    for side, wait in settings:
        where = f"step on a {'side' if side else 'default'} stream, waited by {WAITS[wait]}"
        for augment, n, chunk in [(a, k, c) for c in args.chunks for a, k in [(True, k) for k in args.threads]
                                  + [(False, 1)]]:
            ms, rate, calls = beside_threads(jpegs, graph, n, args.seconds, args.jpegs, side, augment,
                                             trace=args.trace and n == 1 and not augment, wait=wait, chunk=chunk)
            kind = ("decode + augment" if augment else "decode only") + f", {chunk or args.jpegs} files per call"
            print(f"| {n} threads of this process, {kind}, {where} | {ms:.2f} | {ms / alone:.2f} | {rate:,.0f} |",
                  flush=True)
            if calls:
                traces.append(f"\nCUDA API calls of all threads, 1 thread decoding, {where}:\n\n{calls}")
    print("\n".join(traces))
    for chunk, n in [(c, k) for c in args.pipelined for k in (1, 2)]:
        ms, rate = beside_pipelined(jpegs, graph, args.seconds, chunk, n)
        print(f"| {n} decoding thread(s) (hardware engines, {chunk} files per call) + 1 augmenting thread, overlapped"
              f"{', PyTorch augmentation' if args.torch_augment else ''} | {ms:.2f} | {ms / alone:.2f} | "
              f"{rate:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
