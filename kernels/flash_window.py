"""PyTorch ops around the flash window attention Triton kernels.

Two ops, both ``torch.library.triton_op`` with autograd, so they run inside
``torch.compile(fullgraph=True)`` without graph breaks. A triton_op's body is visible to the compiler:
inductor inlines the kernel launches (through ``wrap_triton``) and the small torch ops around them
into its generated code, instead of calling back into this Python glue on every step (which made a
compiled training step host-bound). Under the Triton interpreter (CPU) they are opaque custom ops
instead (see ``_kernel_op``), so compiled models still compute the right numbers there:

* ``flash_window_attention(q, k, v, bias_table, ...)``: window layout, q/k/v of shape
  (B * num_windows, heads, L, head_dim), windows of each image in row-major order (what
  timm's window_partition produces). The shifted-window mask is computed in the kernel from
  each window's position in its (padded, shifted) image.
* ``flash_window_attention_image(qkv, bias_table, qkv_bias, spec, scale)``: image layout, reads
  q/k/v straight from the qkv projection output (B, H, W, 3, heads, head_dim) and writes
  (B, H, W, heads, head_dim); cyclic shift, padding and window partition/reverse are index
  arithmetic in the kernel. Its backward writes one (B, H, W, 3, heads, head_dim) gradient.

The relative position bias table gets its gradient in fp32: each program sums the score gradients
of its windows on chip and writes one (L, L) tile per head; the tiles are summed and scattered into
the table here (deterministic, no atomics per window and element).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
from torch._subclasses.fake_tensor import is_fake
from torch.library import custom_op, triton_op, wrap_triton

from swin.windows import WindowSpec, relative_position_index

from .flash_window_triton import window_attn_bwd_kernel, window_attn_fwd_kernel

MAX_WINDOW_AREA = 256   # the L x L score tile must fit on chip (16 x 16 windows)
MAX_HEAD_DIM = 128
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unsupported_reason(x: torch.Tensor, spec: WindowSpec, head_dim: int | None = None) -> str | None:
    """Why the kernel cannot take this input (None if it can)."""
    head_dim = x.shape[-1] if head_dim is None else head_dim
    if not (x.is_cuda or _interpreting()):
        return (f"flash_window needs a CUDA tensor (got device {x.device}); use attention='sdpa' on the CPU "
                "(or set TRITON_INTERPRET=1 before importing triton to run the kernel in the interpreter)")
    if x.dtype not in SUPPORTED_DTYPES:
        return f"flash_window supports float16, bfloat16 and float32, not {x.dtype}"
    if spec.window_area > MAX_WINDOW_AREA:
        return (f"flash_window supports windows of at most {MAX_WINDOW_AREA} tokens, got "
                f"{spec.window_size[0]}x{spec.window_size[1]} = {spec.window_area}")
    if head_dim > MAX_HEAD_DIM:
        return f"flash_window supports head_dim up to {MAX_HEAD_DIM}, got {head_dim}"
    if spec.window_area > 128 and head_dim > 64:
        # K and V of the whole window live in shared memory: 256-token tiles of 128 channels do not fit
        return (f"flash_window supports head_dim up to 64 for windows of more than 128 tokens, got "
                f"{spec.window_size[0]}x{spec.window_size[1]} windows with head_dim {head_dim}")
    return None


def _check(x: torch.Tensor, spec: WindowSpec, head_dim: int) -> None:
    reason = unsupported_reason(x, spec, head_dim)
    if reason is not None:
        raise ValueError(reason)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tuning(name: str, default: int) -> int:
    # SWIN_FW_<NAME> overrides a launch parameter, for tuning sweeps on the GPU
    return int(os.environ.get(f"SWIN_FW_{name}", default))


def _launch_config(total_windows: int, heads: int, window_area: int, head_dim: int, device: torch.device,
                   backward: bool = False, itemsize: int = 2) -> dict:
    block_n = max(16, triton.next_power_of_2(window_area))
    # windows of more than 64 tokens take 16-row query blocks: with 32 or 64 rows the (rows, 128 or 256)
    # score tiles spill registers or overflow shared memory (H100, Swin-B 384 stage 1, bf16: forward
    # 10.5 -> 3.8 ms, forward+backward 73 -> 15 ms against 32 rows)
    block_m = block_n if block_n <= 64 else 16
    block_m = min(block_n, _tuning("BWD_BLOCK_M" if backward else "BLOCK_M", block_m))
    block_d = max(16, triton.next_power_of_2(head_dim))
    if device.type == "cuda":
        # enough programs per head to fill the chip several times over; each loops over its windows
        # (16 per SM measured best on the H100 for Swin-T stage 1, docs/benchmarks.md)
        per_sm = _tuning("BWD_PROGRAMS_PER_SM" if backward else "PROGRAMS_PER_SM", 16)
        programs = max(1, min(total_windows, _num_sms(device.index or 0) * per_sm // heads))
    else:  # interpreter: few programs, each looping over windows, keeps CPU tests quick
        programs = max(1, min(total_windows, 4))
    # 8 warps only for the 256-token backward (measured on the H100: 12x12 and 10x10 windows, bf16)
    default_warps = 8 if (block_n >= 256 and backward) else 4
    warps = _tuning("BWD_WARPS" if backward else "WARPS", default_warps)
    num_m = triton.cdiv(window_area, block_m)
    # forward PREFETCH: the next window's q/k/v are loaded before the current window is computed. Only for
    # one-block windows of 16-bit data: compiled for sm_90 it costs 7x7 bf16 4 (head_dim 32) to 25 (48)
    # registers and no spills, while fp32 or 256-key tiles (and the backward) spill. Off until timed on the
    # GPU (scripts/tune_flash_window.py sweeps it).
    prefetch = bool(_tuning("PREFETCH", 0)) and not backward and num_m == 1 and itemsize == 2
    cfg = dict(programs=programs, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, NUM_M=num_m,
               num_warps=warps, STAGES=_tuning("BWD_STAGES" if backward else "STAGES", 1))
    return cfg if backward else {**cfg, "PREFETCH": prefetch}


Strides = tuple[int, int, int, int]  # (b, y, x, head) element strides of (B, H, W, heads, head_dim) tokens


def _image_strides(t: torch.Tensor) -> Strides:
    """Strides of a (B, H, W, heads, head_dim) tensor, or of one of q/k/v in (B, H, W, 3, heads, head_dim)."""
    assert t.stride(-1) == 1
    return t.stride(0), t.stride(1), t.stride(2), t.stride(-2)


def _window_strides(t: torch.Tensor, window: list[int]) -> Strides:
    """(B * num_windows, heads, L, head_dim) tokens addressed as images of one (Wh, Ww) window each."""
    assert t.stride(-1) == 1
    s = t.stride()[-4:]
    return s[0], window[1] * s[2], s[2], s[1]


class _Geometry:
    """Launch geometry: `images` addressing images (H, W) of (AGH, AGW) windows shifted by (ASH, ASW), and
    the mask image of (MGH, MGW) windows with shift (MSH, MSW)."""

    def __init__(self, images: int, window: tuple[int, int], feat: tuple[int, int], addr_grid: tuple[int, int],
                 addr_shift: tuple[int, int], mask_grid: tuple[int, int], mask_shift: tuple[int, int]):
        self.images, self.window, self.feat = images, window, feat
        self.addr_grid, self.addr_shift = addr_grid, addr_shift
        self.mask_grid, self.mask_shift = mask_grid, mask_shift

    @property
    def total_windows(self) -> int:
        return self.images * self.addr_grid[0] * self.addr_grid[1]

    def ints(self) -> tuple[int, ...]:
        return (*self.feat, *self.addr_grid, *self.addr_shift, *self.mask_grid, *self.mask_shift)


def _launch_plan(x: torch.Tensor, heads: int, head_dim: int, geo: _Geometry, fill: torch.Tensor | None,
                 backward: bool) -> tuple[dict, dict]:
    """(launch config, the kernels' shared constexpr/launch keywords) for one call on data like x."""
    wh, ww = geo.window
    cfg = _launch_config(geo.total_windows, heads, wh * ww, head_dim, x.device, backward=backward,
                         itemsize=x.element_size())
    keywords = kernel_constants(cfg, geo.window, any(geo.mask_shift), fill is not None, x.dtype)
    return cfg, {**keywords, "num_warps": cfg["num_warps"]}


def kernel_constants(cfg: dict, window: tuple[int, int], shifted: bool, has_fill: bool, dtype: torch.dtype
                     ) -> dict:
    """The kernels' constexpr arguments for a launch config (also used by scripts/kernel_resources.py)."""
    # every config entry but the launch-only ones is a constexpr of the kernel (PREFETCH: forward only)
    tiling = {k: v for k, v in cfg.items() if k not in ("programs", "num_warps")}
    return dict(WH=window[0], WW=window[1], SHIFTED=shifted, HAS_FILL=has_fill,
                PRECISION="ieee" if dtype == torch.float32 else "tf32", **tiling)


def _launch(kernel, grid: tuple[int, int], *args, **keywords):
    """Launches a kernel through wrap_triton, so torch.compile sees (and inlines) the launch; directly
    under the Triton interpreter."""
    if _interpreting():
        # the interpreter runs the kernel as Python on real tensors; fake tensors (the ops' shape
        # functions, see _kernel_op) have no data to run it on
        if any(is_fake(a) for a in args if isinstance(a, torch.Tensor)):
            return None
        return kernel[grid](*args, **keywords)
    return wrap_triton(kernel)[grid](*args, **keywords)


def _kernel_op(name: str):
    """A ``triton_op``: torch.compile traces into its body and inlines the kernel launches.

    Under TRITON_INTERPRET a kernel is plain Python that compile cannot trace, so the op is an opaque
    ``custom_op`` there (the body, which skips launches on fake tensors, is its shape function); tracing
    into it would record the output allocation without the kernel that fills it.
    """
    if not _interpreting():
        return triton_op(name, mutates_args=())

    def register(fn):
        op = custom_op(name, fn, mutates_args=())
        op.register_fake(fn)
        return op
    return register


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s_t: int, sq: Strides, out: torch.Tensor,
             so: Strides, heads: int, head_dim: int, table, fill, geo: _Geometry, scale: float) -> None:
    """Writes out. q, k, v: the same tensor s_t elements apart (qkv) or separate tensors (s_t = 0).

    Every tensor reaches the kernel whole, never as a view: torch.compile then passes the buffers through
    untouched, where a written view (or, through wrap_triton's analysis, a read one) costs a copy."""
    cfg, keywords = _launch_plan(q, heads, head_dim, geo, fill, backward=False)
    table = table.detach().contiguous()
    kernel = _launch(window_attn_fwd_kernel, (cfg["programs"], heads), q, k, v, s_t, *sq, out, *so,
                     table, fill if fill is not None else table,
                     geo.total_windows, geo.window[0] * geo.window[1], *geo.ints(), head_dim, heads, scale, **keywords)
    _report(kernel, cfg)


def _report(kernel, cfg: dict) -> None:
    # kernel is None when traced (torch.compile); eager launches return the compiled kernel
    if os.environ.get("SWIN_FW_DEBUG") and hasattr(kernel, "n_regs"):
        print(f"[flash_window] {kernel.name}: {kernel.n_regs} registers, {kernel.n_spills} spills, {cfg}")


def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s_t: int, sq: Strides, do: torch.Tensor,
              sdo: Strides, dqkv: torch.Tensor, sd_t: int, sdq: Strides, heads: int, head_dim: int,
              table, rel_index, fill, geo: _Geometry, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Writes dq, dk, dv into dqkv (sd_t elements apart); returns (bias table gradient, fill gradient or None)."""
    area = geo.window[0] * geo.window[1]
    cfg, keywords = _launch_plan(q, heads, head_dim, geo, fill, backward=True)
    table = table.detach().contiguous()
    # one (L, L) tile per program and head; the single-block kernel writes every tile whole
    alloc = torch.empty if cfg["NUM_M"] == 1 else torch.zeros
    dbias = alloc(cfg["programs"], heads, area, area, dtype=torch.float32, device=q.device)
    dfill = torch.zeros(2, heads, head_dim, dtype=torch.float32, device=q.device) if fill is not None else None
    kernel = _launch(window_attn_bwd_kernel, (cfg["programs"], heads), q, k, v, s_t, *sq, do, *sdo, dqkv, sd_t, *sdq,
                     table, fill if fill is not None else table, dbias, dfill if dfill is not None else dbias,
                     geo.total_windows, area, *geo.ints(), head_dim, heads, scale, **keywords)
    _report(kernel, cfg)
    dtable = torch.zeros(table.shape, dtype=torch.float32, device=q.device)
    dtable.index_add_(0, rel_index.reshape(-1), dbias.sum(0).reshape(heads, area * area).t())
    return dtable.to(table.dtype), (dfill.to(fill.dtype) if dfill is not None else None)


# ---------------------------------------------------------------------------------------------
# window layout op: q, k, v (B * num_windows, heads, L, head_dim)

def _window_geometry(windows: int, window: list[int], shift: list[int], grid: list[int]) -> _Geometry:
    return _Geometry(windows, tuple(window), tuple(window), (1, 1), (0, 0), tuple(grid), tuple(shift))


@_kernel_op("swin::flash_window_attn")
def _window_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias_table: torch.Tensor,
               window: list[int], shift: list[int], grid: list[int], scale: float) -> torch.Tensor:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    bw, heads, _, head_dim = q.shape
    _forward(q, k, v, 0, _window_strides(q, window), out, _window_strides(out, window), heads, head_dim,
             bias_table, None, _window_geometry(bw, window, shift, grid), scale)
    return out


@_kernel_op("swin::flash_window_attn_bwd")
def _window_op_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   bias_table: torch.Tensor, rel_index: torch.Tensor, window: list[int], shift: list[int],
                   grid: list[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv stacked as one (3, *q.shape) tensor, bias table gradient)."""
    q, k, v, grad_out = q.contiguous(), k.contiguous(), v.contiguous(), grad_out.contiguous()
    dqkv = q.new_empty((3, *q.shape))
    bw, heads, _, head_dim = q.shape
    dtable, _ = _backward(q, k, v, 0, _window_strides(q, window), grad_out, _window_strides(grad_out, window),
                          dqkv, dqkv.stride(0), _window_strides(dqkv, window), heads, head_dim, bias_table,
                          rel_index, None, _window_geometry(bw, window, shift, grid), scale)
    return dqkv, dtable


def _window_setup(ctx, inputs, output):
    q, k, v, bias_table, window, shift, grid, scale = inputs
    ctx.save_for_backward(q, k, v, bias_table)
    ctx.geometry = (window, shift, grid, scale)


def _window_grad(ctx, grad_out):
    q, k, v, bias_table = ctx.saved_tensors
    window, shift, grid, scale = ctx.geometry
    rel_index = relative_position_index(tuple(window), device=q.device)
    dqkv, dtable = _window_op_bwd(grad_out, q, k, v, bias_table, rel_index, window, shift, grid, scale)
    dq, dk, dv = dqkv.unbind(0)
    return dq, dk, dv, dtable, None, None, None, None


_window_op.register_autograd(_window_grad, setup_context=_window_setup)


def flash_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias_table: torch.Tensor,
                           window_size: tuple[int, int], shift_size: tuple[int, int] = (0, 0),
                           grid_size: tuple[int, int] = (1, 1), scale: float | None = None) -> torch.Tensor:
    """softmax(scale q k^T + bias + shifted-window mask) v for windows in window layout.

    q, k, v: (B * num_windows, heads, L, head_dim), L = Wh * Ww, the windows of each image in
    row-major order over a grid_size = (windows along H, windows along W) padded image.
    bias_table: ((2Wh-1)(2Ww-1), heads). shift_size: the block's cyclic shift (0, 0: no mask).
    """
    wh, ww = window_size
    bw, heads, area, head_dim = q.shape
    spec = WindowSpec((grid_size[0] * wh, grid_size[1] * ww), (wh, ww), tuple(shift_size))
    _check(q, spec, head_dim)
    if area != wh * ww or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must all be (B * num_windows, heads, {wh * ww}, head_dim) for a {wh}x{ww} "
                         f"window; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if bw % (grid_size[0] * grid_size[1]):
        raise ValueError(f"{bw} windows is not a multiple of the {grid_size[0]}x{grid_size[1]} windows per image")
    if bias_table.shape != ((2 * wh - 1) * (2 * ww - 1), heads):
        raise ValueError(f"bias_table must be ({(2 * wh - 1) * (2 * ww - 1)}, {heads}), got {tuple(bias_table.shape)}")
    scale = head_dim ** -0.5 if scale is None else float(scale)
    return _window_op(q, k, v, bias_table, [wh, ww], [int(s) for s in shift_size], list(grid_size), scale)


# ---------------------------------------------------------------------------------------------
# image layout op: qkv (B, H, W, 3, heads, head_dim) -> (B, H, W, heads, head_dim)

def _image_geometry(qkv: torch.Tensor, window: list[int], shift: list[int]) -> _Geometry:
    spec = WindowSpec(tuple(qkv.shape[1:3]), tuple(window), tuple(shift))
    return _Geometry(qkv.shape[0], spec.window_size, spec.feat_size, spec.grid_size, spec.shift_size,
                     spec.grid_size, spec.shift_size)


@_kernel_op("swin::flash_window_attn_image")
def _image_op(qkv: torch.Tensor, bias_table: torch.Tensor, rel_index: torch.Tensor, kv_fill: torch.Tensor | None,
              window: list[int], shift: list[int], scale: float) -> torch.Tensor:
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    fill = kv_fill.contiguous() if kv_fill is not None else None
    b, h, w, _, heads, hd = qkv.shape
    out = qkv.new_empty((b, h, w, heads, hd))
    # q, k, v are read from the one qkv tensor, qkv.stride(3) elements apart
    _forward(qkv, qkv, qkv, qkv.stride(3), _image_strides(qkv), out, _image_strides(out), heads, hd,
             bias_table, fill, _image_geometry(qkv, window, shift), scale)
    return out


@_kernel_op("swin::flash_window_attn_image_bwd")
def _image_op_bwd(grad_out: torch.Tensor, qkv: torch.Tensor, bias_table: torch.Tensor, rel_index: torch.Tensor,
                  kv_fill: torch.Tensor | None, window: list[int], shift: list[int], scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    dqkv = qkv.new_empty(qkv.shape)
    fill = kv_fill.contiguous() if kv_fill is not None else None
    heads, hd = qkv.shape[-2:]
    dtable, dfill = _backward(qkv, qkv, qkv, qkv.stride(3), _image_strides(qkv), grad_out, _image_strides(grad_out),
                              dqkv, dqkv.stride(3), _image_strides(dqkv), heads, hd, bias_table, rel_index, fill,
                              _image_geometry(qkv, window, shift), scale)
    if dfill is None:  # ops return tensors only; an empty one stands for "no fill"
        dfill = qkv.new_empty(0)
    return dqkv, dtable, dfill


def _image_setup(ctx, inputs, output):
    qkv, bias_table, rel_index, kv_fill, window, shift, scale = inputs
    ctx.save_for_backward(qkv, bias_table, rel_index, kv_fill)
    ctx.geometry = (window, shift, scale)


def _image_grad(ctx, grad_out):
    qkv, bias_table, rel_index, kv_fill = ctx.saved_tensors
    dqkv, dtable, dfill = _image_op_bwd(grad_out, qkv, bias_table, rel_index, kv_fill, *ctx.geometry)
    return dqkv, dtable, None, (dfill if kv_fill is not None else None), None, None, None


_image_op.register_autograd(_image_grad, setup_context=_image_setup)


def flash_window_attention_image(qkv: torch.Tensor, bias_table: torch.Tensor, qkv_bias: torch.Tensor | None,
                                 spec: WindowSpec, scale: float, rel_index: torch.Tensor | None = None
                                 ) -> torch.Tensor:
    """Window attention of a Swin block straight from its qkv projection, in image layout.

    qkv: (B, H, W, 3, heads, head_dim); qkv_bias: (3, heads, head_dim) or None, the value of q/k/v at
    padded positions (timm pads before the projection). rel_index: the window's (L, L) index into
    bias_table (the model's buffer; built here if None). Returns (B, H, W, heads, head_dim).
    """
    b, h, w, three, heads, head_dim = qkv.shape
    _check(qkv, spec, head_dim)
    if three != 3 or (h, w) != spec.feat_size:
        raise ValueError(f"qkv must be (B, {spec.feat_size[0]}, {spec.feat_size[1]}, 3, heads, head_dim), "
                         f"got {tuple(qkv.shape)}")
    fill = qkv_bias[1:].to(qkv.dtype) if (qkv_bias is not None and spec.padded) else None
    if rel_index is None:
        rel_index = relative_position_index(spec.window_size, device=qkv.device)
    return _image_op(qkv, bias_table, rel_index, fill, list(spec.window_size), list(spec.shift_size), float(scale))
