"""Window-attention micro-benchmark: standard vs sdpa (timm's way) vs flash_window.

Times forward and forward+backward of one Swin attention layer's core, softmax(scale q k^T + bias + mask) v,
on window-layout inputs q, k, v of shape (B * num_windows, heads, L, head_dim):

* ``standard``: explicit math as official Swin: (q * scale) @ k^T + bias, + the (num_windows, L, L) mask
  broadcast over the images, softmax, @ v;
* ``sdpa``: timm's fused path: bias and mask added into ONE materialised (B * num_windows, heads, L, L)
  tensor passed as attn_mask to F.scaled_dot_product_attention;
* ``flash_window``: our Triton kernel (kernels.flash_window.flash_window_attention) as the model calls it: the
  bias table and the (num_windows, L, L) mask, of which the kernel reads the four class windows;
* ``paper``: the Flash Window Attention paper's public kernel where it is importable (FWA_PAPER_PATH), on
  unshifted shapes only (it has no mask).

The bias table is a float32 leaf parameter that requires grad (its gradient is part of every timed
backward). By default half-precision runs under torch.autocast, as the model runs in training (float32
bias table and mask, bf16/fp16 q/k/v); ``--no-autocast`` casts bias and mask to the input dtype instead.

Reported per backend and shape:
* median GPU time in ms (CUDA events around each call; L2 flushed and the GPU kept busy with a sleep
  before each call, so launch latency is hidden and caches are cold);
* GB/s over the minimal bytes: forward q, k, v, o; forward+backward q, k, v, o, do, dq, dk, dv;
  and that bandwidth in percent of the device-to-device copy bandwidth measured in the same run;
* peak extra memory: torch.cuda.max_memory_allocated during one call minus the memory held before it
  (inputs, bias table and do allocated beforehand; forward runs under no_grad);
* correctness: max |out - ref| / max |ref| of the output and of every gradient (q, k, v, bias table) against
  a float64 reference on a slice of at most two images.

Examples (GPU):
    python scripts/bench_attention.py                                   # Swin-T stage 1, bf16
    python scripts/bench_attention.py --preset all --dtype bf16 fp32 --json $OUT/bench_attention.json
CPU smoke test (Triton interpreter, tiny shape):
    python scripts/bench_attention.py --device cpu --preset tiny
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

# Without CUDA, Triton kernels run in the interpreter; it must be chosen before anything imports triton
# (timm and our kernels do). An explicit TRITON_INTERPRET from the user wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402

import torch.nn.functional as F  # noqa: E402

from swin.models.windows import WindowSpec, relative_position_index, shifted_window_mask  # noqa: E402

BACKEND_NAMES = ("standard", "sdpa", "flash_window", "paper")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# max|x - ref| / max|ref| above this flags a row as wrong (several times the dtype's rounding of O(1) values)
ERROR_TOL = {"bfloat16": 5e-2, "float16": 5e-3, "float32": 1e-4}


@dataclass(frozen=True)
class Shape:
    """One window-attention problem: `batch` images of feat x feat tokens cut into window x window windows."""

    name: str
    batch: int
    feat: int
    window: int
    heads: int
    head_dim: int
    shifted: bool = True

    @property
    def grid(self) -> tuple[int, int]:
        g = math.ceil(self.feat / self.window)
        return (g, g)

    @property
    def num_windows(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def length(self) -> int:
        return self.window * self.window

    @property
    def spec(self) -> WindowSpec:
        g = self.grid
        shift = self.window // 2 if self.shifted else 0
        return WindowSpec((g[0] * self.window, g[1] * self.window), (self.window, self.window), (shift, shift))

    def describe(self) -> str:
        return (f"{self.name}: {self.batch}x{self.feat}x{self.feat} tokens, {self.batch * self.num_windows} windows "
                f"of {self.window}x{self.window} (L={self.length}), {self.heads} heads x {self.head_dim}, "
                f"{'shifted + mask' if self.shifted else 'unshifted'}")


def _stages(prefix: str, batch: int, feat: int, window: int, heads: int) -> dict[str, Shape]:
    """The four stages of a Swin model: the feature map halves and the heads double at each stage; a stage
    whose map is not larger than the window has one window and no shift (timm's rule)."""
    shapes = {}
    for i in range(4):
        f, h = feat >> i, heads << i
        shapes[f"{prefix}_stage{i + 1}"] = Shape(f"{prefix}_stage{i + 1}", batch, f, min(window, f), h, 32, f > window)
    return shapes


# every stage of Swin-T / Swin-B at 224 (batch 128) and Swin-B at 384 (batch 64, as scripts/benchmark.py runs it)
STAGES: dict[str, Shape] = {**_stages("swin_t", 128, 56, 7, 3), **_stages("swin_b", 128, 56, 7, 4),
                            **_stages("swin_b384", 64, 96, 12, 4)}
PRESETS: dict[str, Shape] = {
    **STAGES,
    # Swin-B at 384 stage 1 with 128 images: 8192 windows of L=144 (the shape of the earlier tables)
    "swin_b384_b128_stage1": Shape("swin_b384_b128_stage1", 128, 96, 12, 4, 32),
    # CPU smoke test (Triton interpreter): 2 images of 14x14 tokens, window 7
    "tiny": Shape("tiny", 2, 14, 7, 2, 16),
}
PRESET_GROUPS = {"all": ["swin_t_stage1", "swin_b384_stage1"], "stages": list(STAGES)}


# ---------------------------------------------------------------------------------------------
# backends on window-layout inputs

@dataclass
class Problem:
    """Inputs and constants shared by the backends for one shape."""

    shape: Shape
    scale: float
    rel_index: torch.Tensor        # (L, L) long
    mask: torch.Tensor | None      # (num_windows, L, L), float32 under autocast, else the input dtype
    cast: torch.dtype | None       # dtype bias/mask are cast to without autocast (None under autocast)


def gather_bias(table: torch.Tensor, p: Problem) -> torch.Tensor:
    """timm's _get_rel_pos_bias: (1, heads, L, L) from the table."""
    n = p.shape.length
    bias = table[p.rel_index.view(-1)].view(n, n, -1).permute(2, 0, 1).contiguous().unsqueeze(0)
    return bias if p.cast is None else bias.to(p.cast)


def standard(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, p: Problem) -> torch.Tensor:
    """Official Swin / timm's non-fused path."""
    heads, n = q.shape[1], q.shape[2]
    attn = (q * p.scale) @ k.transpose(-2, -1)
    attn = attn + gather_bias(table, p)
    if p.mask is not None:
        nw = p.mask.shape[0]
        attn = attn.view(-1, nw, heads, n, n) + p.mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, heads, n, n)
    return attn.softmax(dim=-1) @ v


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, p: Problem) -> torch.Tensor:
    """timm's fused path: bias + mask materialised per window and image, then SDPA."""
    bw, heads, n, _ = q.shape
    attn_mask = gather_bias(table, p)
    if p.mask is not None:
        nw = p.mask.shape[0]
        mask = p.mask.view(1, nw, 1, n, n).expand(bw // nw, -1, heads, -1, -1)
        attn_mask = attn_mask + mask.reshape(-1, heads, n, n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=p.scale)


def flash_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, p: Problem) -> torch.Tensor:
    """Our kernel as the model calls it: the bias table (gathered in the kernel) and the shifted-window mask."""
    from kernels.flash_window import flash_window_attention
    bias = table if p.cast is None else table.to(p.cast)
    return flash_window_attention(q, k, v, bias, p.mask, p.shape.grid, p.scale,
                                  window_size=(p.shape.window, p.shape.window))


def _paper_kernel():
    """The Flash Window Attention paper's public kernel (github.com/zzd1992/FlashWindowAttention), if importable:
    from FWA_PAPER_PATH (a checkout's directory) or installed. It has no shifted-window mask."""
    path = os.environ.get("FWA_PAPER_PATH")
    if path and path not in sys.path:
        sys.path.insert(0, path)
    try:
        from flash_swin_attn.func_flash_swin import FlashSwinFunc
    except ImportError:
        return None
    return FlashSwinFunc


def paper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, p: Problem) -> torch.Tensor:
    """The paper's kernel: window-layout q/k/v, dense (heads, L, L) bias, no mask (unshifted shapes only)."""
    func = _paper_kernel()
    if func is None:
        raise RuntimeError("the paper's kernel is not importable (set FWA_PAPER_PATH to a checkout)")
    if p.mask is not None:
        raise RuntimeError("the paper's kernel has no shifted-window mask")
    if q.shape[-1] % 16:
        raise RuntimeError("the paper's kernel needs head_dim divisible by 16")
    bias = gather_bias(table, p)[0].contiguous()
    with torch.autocast(q.device.type, enabled=False):  # it takes q, k, v of one dtype and a float bias
        return func.apply(q, k, v, bias, p.scale)


BACKENDS: dict[str, Callable[..., torch.Tensor]] = {"standard": standard, "sdpa": sdpa, "flash_window": flash_window,
                                                    "paper": paper}


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, shape: Shape,
              scale: float) -> torch.Tensor:
    """float64 math of official Swin (inputs are cast to float64)."""
    q, k, v, table = (t.double() for t in (q, k, v, table))
    n = shape.length
    rel = relative_position_index((shape.window, shape.window), q.device)
    s = scale * q @ k.transpose(-1, -2) + table[rel.view(-1)].view(n, n, -1).permute(2, 0, 1)
    mask = shifted_window_mask(shape.spec, q.device, torch.float64)
    if mask is not None:
        s = (s.view(-1, mask.shape[0], *s.shape[1:]) + mask[None, :, None]).view(s.shape)
    return s.softmax(-1) @ v


# ---------------------------------------------------------------------------------------------
# measurement

# ~4 ms of GPU spin before each timed call: the CPU enqueues the call meanwhile, so the events time the GPU's work
# (an eager call's CPU time is host_us's to measure)
SLEEP_CYCLES = 8_000_000
FLUSH_BYTES = 256 << 20    # > the 50 MB L2 of an H100


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, reps: int, flush: bool = True,
              reset: Callable[[], None] = lambda: None) -> float:
    """Median time of fn() in ms. CUDA: GPU time between events, cold L2, launch latency hidden."""
    for _ in range(warmup):
        reset()
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            reset()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    cache = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device) if flush else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        reset()
        if cache is not None:
            cache.zero_()
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(SLEEP_CYCLES)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def host_us(fn: Callable[[], object], reset: Callable[[], None] = lambda: None, reps: int = 50,
            sleep_cycles: int = 4 * SLEEP_CYCLES) -> float | None:
    """Median CPU time (µs) to enqueue fn() while the GPU is kept busy (CUDA only; sleep_cycles: a GPU sleep longer
    than two calls' enqueueing): the eager call's host overhead. Where it exceeds the GPU time, an eager loop of
    such calls runs at the host's pace. Each sample is the second of two calls queued behind a GPU sleep, as in a
    loop (the first call after a synchronisation costs the host more). Process CPU time (all threads: autograd
    runs a backward on its own), not wall time: a shared host's descheduling is not counted."""
    if not torch.cuda.is_available():
        return None
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(sleep_cycles)
        reset()
        fn()
        reset()
        t0 = time.process_time_ns()
        fn()
        times.append((time.process_time_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


HOST_CALLS = 8  # eager calls per backward() in the fwd+bwd host figure


def calls_and_one_backward(fn: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor], problem: Problem,
                           autocast: Callable[[], contextlib.AbstractContextManager]) -> Callable[[], None]:
    """HOST_CALLS eager calls of fn, each on leaves of its own, then one backward() through all of them: what a
    model's training step does (one backward() for all its attention calls), so that the autograd engine's fixed
    cost per backward() is shared as there, and no gradient is accumulated into another's."""
    leaves = [{n: inputs[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "table")}
              for _ in range(HOST_CALLS)]

    def run() -> None:
        with autocast():
            outs = [fn(t["q"], t["k"], t["v"], t["table"], problem) for t in leaves]
        torch.autograd.backward(outs, [inputs["do"]] * HOST_CALLS)
        for t in leaves:
            for leaf in t.values():
                leaf.grad = None
    return run


class _AutogradOnly(torch.autograd.Function):
    """An op that allocates its output and its inputs' gradients and launches nothing."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(q, k, v, table)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors)


def autograd_floor_us(inputs: dict[str, torch.Tensor]) -> float | None:
    """Host µs per call of _AutogradOnly, timed as the fwd+bwd host column (HOST_CALLS calls, one backward()): what
    any eager op with these leaves costs the host in autograd and allocations alone, a reference that moves with the
    host as the backends' figures do (CUDA only)."""
    run = calls_and_one_backward(lambda q, k, v, table, _: _AutogradOnly.apply(q, k, v, table), inputs, None,
                                 contextlib.nullcontext)
    us = host_us(run)
    return None if us is None else us / HOST_CALLS


def copy_bandwidth_gbs(device: torch.device, warmup: int, reps: int) -> float:
    """Device-to-device copy bandwidth: bytes read + written per second of a large tensor copy."""
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, warmup, reps, flush=False)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def peak_extra_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    """Peak memory allocated during fn() above what was allocated before it, in MiB (CUDA only)."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def max_rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max |a - ref| / max |ref| (float64)."""
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    bw = shape.batch * shape.num_windows
    dims = (bw, shape.heads, shape.length, shape.head_dim)

    def randn(*size: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*size, generator=g, device=device, dtype=torch.float32).to(dt)

    q, k, v = (randn(*dims).requires_grad_() for _ in range(3))
    table = (0.5 * randn((2 * shape.window - 1) ** 2, shape.heads, dt=torch.float32)).requires_grad_()
    return dict(q=q, k=k, v=v, table=table, do=randn(*dims))


def check_correctness(fn: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor], problem: Problem,
                      autocast: contextlib.AbstractContextManager, images: int = 2) -> dict[str, float]:
    """Errors of output and gradients vs float64 on the first `images` images (whole images: the mask
    depends on each window's position in its image)."""
    n = min(images, problem.shape.batch) * problem.shape.num_windows
    leaves = {name: inputs[name][:n].detach().clone().requires_grad_() for name in "qkv"}
    leaves["table"] = inputs["table"].detach().clone().requires_grad_()
    do = inputs["do"][:n]
    with autocast:
        out = fn(leaves["q"], leaves["k"], leaves["v"], leaves["table"], problem)
    out.backward(do)
    ref_leaves = {name: t.detach().double().requires_grad_() for name, t in leaves.items()}
    ref = reference(ref_leaves["q"], ref_leaves["k"], ref_leaves["v"], ref_leaves["table"], problem.shape,
                    problem.scale)
    ref.backward(do.double())
    errors = {"out": max_rel_err(out.detach(), ref.detach())}
    for name in ("q", "k", "v", "table"):
        errors[f"d{name}"] = max_rel_err(leaves[name].grad, ref_leaves[name].grad)
    return errors


def bench_backend(name: str, shape: Shape, dtype: torch.dtype, device: torch.device, inputs: dict[str, torch.Tensor],
                  use_autocast: bool, copy_gbs: float, warmup: int, reps: int) -> dict:
    """One row: timings, bandwidths, peak memory and errors of backend `name` on `shape`."""
    fn = BACKENDS[name]
    half = dtype in (torch.float16, torch.bfloat16)
    autocast_on = use_autocast and half
    mask = shifted_window_mask(shape.spec, device, torch.float32)
    problem = Problem(shape, shape.head_dim ** -0.5, relative_position_index((shape.window,) * 2, device),
                      mask if (autocast_on or mask is None) else mask.to(dtype), None if autocast_on else dtype)

    def autocast() -> contextlib.AbstractContextManager:
        return torch.autocast(device.type, dtype=dtype) if autocast_on else contextlib.nullcontext()

    q, k, v, table, do = (inputs[n] for n in ("q", "k", "v", "table", "do"))

    def forward() -> torch.Tensor:
        with torch.no_grad(), autocast():
            return fn(q, k, v, table, problem)

    def forward_backward() -> None:
        with autocast():
            out = fn(q, k, v, table, problem)
        out.backward(do)

    def clear_grads() -> None:
        for t in (q, k, v, table):
            t.grad = None

    row: dict = dict(shape=shape.name, dtype=str(dtype).removeprefix("torch."), backend=name,
                     autocast=autocast_on)
    elem = torch.empty((), dtype=dtype).element_size()
    tensor_bytes = q.numel() * elem
    row["bytes_fwd"] = 4 * tensor_bytes
    row["bytes_fwd_bwd"] = 8 * tensor_bytes
    try:
        row["errors"] = check_correctness(fn, inputs, problem, autocast())
        clear_grads()
        row["peak_mib_fwd"] = peak_extra_mib(forward, device)
        row["peak_mib_fwd_bwd"] = peak_extra_mib(forward_backward, device)
        clear_grads()
        row["ms_fwd"] = median_ms(forward, device, warmup, reps)
        row["ms_fwd_bwd"] = median_ms(forward_backward, device, warmup, reps, reset=clear_grads)
        if device.type == "cuda":
            row["host_us_fwd"] = host_us(forward)
            row["host_us_fwd_bwd"] = host_us(calls_and_one_backward(fn, inputs, problem, autocast)) / HOST_CALLS
    except Exception as e:  # unsupported shape, OOM, ...: keep the other rows
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        clear_grads()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return row
    clear_grads()
    for key in ("fwd", "fwd_bwd"):
        gbs = row[f"bytes_{key}"] / (row[f"ms_{key}"] * 1e-3) / 1e9
        row[f"gbs_{key}"] = gbs
        row[f"pct_copy_{key}"] = 100 * gbs / copy_gbs
    return row


# ---------------------------------------------------------------------------------------------
# report

def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown_table(rows: list[dict]) -> str:
    head = ("| shape | dtype | backend | fwd ms | fwd GB/s | fwd % copy | fwd+bwd ms | fwd+bwd GB/s | fwd+bwd % copy "
            "| fwd peak MiB | fwd+bwd peak MiB | fwd+bwd mem / sdpa | host µs fwd / fwd+bwd | err out | err grads |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    sdpa_mem = {(r["shape"], r["dtype"]): r.get("peak_mib_fwd_bwd") for r in rows if r["backend"] == "sdpa"}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['dtype']} | {r['backend']} | {r['error']} |" + " - |" * 11)
            continue
        ref_mem = sdpa_mem.get((r["shape"], r["dtype"]))
        mem_ratio = r["peak_mib_fwd_bwd"] / ref_mem if (ref_mem and r["peak_mib_fwd_bwd"] is not None) else None
        err_grads = max(v for k, v in r["errors"].items() if k != "out")
        lines.append(
            f"| {r['shape']} | {r['dtype']} | {r['backend']} | {r['ms_fwd']:.3f} | {r['gbs_fwd']:.4g} "
            f"| {r['pct_copy_fwd']:.1f} | {r['ms_fwd_bwd']:.3f} | {r['gbs_fwd_bwd']:.4g} | {r['pct_copy_fwd_bwd']:.1f} "
            f"| {_fmt(r['peak_mib_fwd'], '.1f')} | {_fmt(r['peak_mib_fwd_bwd'], '.1f')} | {_fmt(mem_ratio, '.2f')} "
            f"| {_fmt(r.get('host_us_fwd'), '.0f')} / {_fmt(r.get('host_us_fwd_bwd'), '.0f')} "
            f"| {r['errors']['out']:.1e} | {err_grads:.1e} |")
    return "\n".join(lines)


def summary_table(rows: list[dict]) -> str:
    """One line per stage shape and dtype: our forward unshifted / shifted, forward+backward against SDPA's
    (the same shift) and the paper kernel's forward (unshifted; it has no mask)."""
    ms = {(r["shape"], r["dtype"], r["backend"]): r for r in rows if "error" not in r}
    head = ("| shape | dtype | ours fwd noshift | ours fwd shifted | shift cost | paper fwd | ours / paper fwd "
            "| ours fwd+bwd | sdpa fwd+bwd | ours / sdpa fwd+bwd |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r["backend"] != "flash_window" or r["shape"].endswith(" noshift") or "error" in r:
            continue
        name, dtype = r["shape"], r["dtype"]
        plain = ms.get((name + " noshift", dtype, "flash_window"), r if not r["shape_info"]["shifted"] else None)
        paper_row = ms.get((name + " noshift", dtype, "paper")) or ms.get((name, dtype, "paper"))
        sdpa_row = ms.get((name, dtype, "sdpa"))

        def t(row: dict | None, key: str) -> str:
            return "-" if row is None else f"{row[key]:.3f}"

        def ratio(a: dict | None, b: dict | None, key: str) -> str:
            return "-" if a is None or b is None else f"{a[key] / b[key]:.2f}"
        shift_cost = "-" if plain is None or plain is r else f"{100 * (r['ms_fwd'] / plain['ms_fwd'] - 1):+.0f}%"
        lines.append(f"| {name} | {dtype} | {t(plain, 'ms_fwd')} | {t(r, 'ms_fwd') if plain is not r else '-'} "
                     f"| {shift_cost} | {t(paper_row, 'ms_fwd')} | {ratio(plain, paper_row, 'ms_fwd')} "
                     f"| {t(r, 'ms_fwd_bwd')} | {t(sdpa_row, 'ms_fwd_bwd')} | {ratio(r, sdpa_row, 'ms_fwd_bwd')} |")
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    import triton
    env = dict(torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
               device=str(device), triton_interpret=os.environ.get("TRITON_INTERPRET", "0"))
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=[*PRESETS, *PRESET_GROUPS], default=None,
                    help="shape preset; 'all' = swin_t_stage1 + swin_b384_stage1, 'stages' = every stage of Swin-T, "
                         "Swin-B 224 and Swin-B 384, shifted and unshifted "
                         "(default: swin_t_stage1 on CUDA, tiny on the CPU)")
    ap.add_argument("--batch", type=int, help="images (overrides the preset)")
    ap.add_argument("--feat", type=int, help="feature map side in tokens (overrides the preset)")
    ap.add_argument("--window", type=int, help="window side (overrides the preset)")
    ap.add_argument("--heads", type=int, help="heads (overrides the preset)")
    ap.add_argument("--head-dim", type=int, help="head dim (overrides the preset)")
    ap.add_argument("--no-shift", action="store_true", help="unshifted block (no mask)")
    ap.add_argument("--both-shifts", action="store_true",
                    help="each shifted shape also unshifted (default with --preset stages)")
    ap.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=None,
                    help="one or more of bf16 fp16 fp32 (default: bf16 on CUDA, fp32 on the CPU)")
    ap.add_argument("--backends", nargs="+", choices=BACKEND_NAMES, default=list(BACKEND_NAMES))
    ap.add_argument("--no-autocast", action="store_true",
                    help="half precision without autocast: bias and mask cast to the input dtype")
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls (default: 10 CUDA, 1 CPU)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls, median reported (default: 100 CUDA, 3 CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=Path("outputs/bench_attention.json"), help="JSON output path")
    return ap.parse_args(argv)


def resolve_shapes(args: argparse.Namespace, device: torch.device) -> list[Shape]:
    preset = args.preset or ("swin_t_stage1" if device.type == "cuda" else "tiny")
    shapes = [PRESETS[name] for name in PRESET_GROUPS.get(preset, [preset])]
    overrides = {k: getattr(args, k) for k in ("batch", "feat", "window", "heads", "head_dim")
                 if getattr(args, k) is not None}
    if args.no_shift:
        overrides["shifted"] = False
    if overrides:
        shapes = [Shape(**{**asdict(s), **overrides, "name": s.name + "*"}) for s in shapes]
    if args.both_shifts or (preset == "stages" and not args.no_shift):
        shapes = [t for s in shapes for t in ([s, Shape(**{**asdict(s), "shifted": False, "name": s.name + " noshift"})]
                                              if s.shifted else [s])]
    return shapes


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if (args.device == "auto" and torch.cuda.is_available()) else
                          ("cpu" if args.device == "auto" else args.device))
    cuda = device.type == "cuda"
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    reps = args.reps if args.reps is not None else (100 if cuda else 3)
    dtypes = args.dtype or (["bf16"] if cuda else ["fp32"])
    backends = list(args.backends)
    if not cuda and "flash_window" in backends and os.environ.get("TRITON_INTERPRET") != "1":
        print("note: no CUDA and TRITON_INTERPRET is not 1: skipping flash_window")
        backends.remove("flash_window")
    shapes = resolve_shapes(args, device)

    env = environment(device)
    copy_gbs = copy_bandwidth_gbs(device, warmup=3, reps=10 if cuda else 3)
    print(f"# window attention benchmark on {env.get('gpu', env.get('cpu'))} (torch {env['torch']}, "
          f"triton {env['triton']}{', interpreter' if env['triton_interpret'] == '1' else ''})")
    print(f"device-to-device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    rows, floors = [], {}
    for shape in shapes:
        print(f"shape {shape.describe()}")
        for dname in dtypes:
            dtype = DTYPES[dname]
            inputs = make_inputs(shape, dtype, device, args.seed)
            if cuda:
                floors[f"{shape.name} {dname}"] = floor = autograd_floor_us(inputs)
                print(f"  {dname:5s} autograd only: {floor:.0f} host µs per fwd+bwd call")
            for name in backends:
                if name == "paper" and (shape.shifted or _paper_kernel() is None):
                    continue  # no mask in the paper's kernel; absent unless FWA_PAPER_PATH points to it
                row = bench_backend(name, shape, dtype, device, inputs, not args.no_autocast, copy_gbs, warmup, reps)
                row["shape_info"] = {**asdict(shape), "num_windows": shape.num_windows,
                                     "total_windows": shape.batch * shape.num_windows, "L": shape.length}
                rows.append(row)
                summary = row.get("error") or (f"fwd {row['ms_fwd']:.3f} ms, fwd+bwd {row['ms_fwd_bwd']:.3f} ms, "
                                               f"err {max(row['errors'].values()):.1e}")
                print(f"  {dname:5s} {name:13s} {summary}", flush=True)
            del inputs
            if cuda:
                torch.cuda.empty_cache()
    table = markdown_table(rows)
    summary = summary_table(rows)
    print()
    print(table)
    print()
    print(summary)
    suspect = [r for r in rows if "errors" in r and max(r["errors"].values()) > ERROR_TOL[r["dtype"]]]
    for r in suspect:
        print(f"WARNING: {r['backend']} on {r['shape']} {r['dtype']}: error {max(r['errors'].values()):.1e} "
              f"> {ERROR_TOL[r['dtype']]:.0e}: wrong results")
    if suspect and env["triton_interpret"] == "1" and any(r["dtype"] == "bfloat16" for r in suspect):
        print("note: the Triton interpreter does not compute bf16 correctly; use fp32/fp16 on the CPU")
    print("\nms: median GPU time; host µs: CPU time to enqueue one eager call (an eager loop is host-bound where it "
          f"exceeds the GPU time; fwd+bwd: per call of {HOST_CALLS} calls with one backward(); 'autograd only' above: "
          "the same for an op that allocates its output and gradients and launches nothing); "
          "GB/s over minimal bytes (fwd: q,k,v,o; fwd+bwd: q,k,v,o,do,dq,dk,dv); "
          "% copy: of the copy bandwidth above; peak: extra allocated memory during one call; "
          "err: max|x - ref| / max|ref| vs float64 (grads: worst of dq, dk, dv, dbias_table)")
    result = dict(env=env, copy_gbs=copy_gbs, args={k: (str(v) if isinstance(v, Path) else v)
                                                     for k, v in vars(args).items()},
                  warmup=warmup, reps=reps, rows=rows, autograd_floor_us=floors, table=table, summary=summary,
                  suspect=[(r["backend"], r["shape"], r["dtype"]) for r in suspect],
                  time=time.strftime("%Y-%m-%d %H:%M:%S"))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
