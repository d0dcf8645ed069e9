"""PyTorch ops around the flash window attention Triton kernels.

Two ops, both ``torch.library.triton_op`` with autograd, so they run inside
``torch.compile(fullgraph=True)`` without graph breaks. A triton_op's body is visible to the compiler:
inductor inlines the kernel launches (through ``wrap_triton``) and the small torch ops around them
into its generated code, instead of calling back into this Python glue on every step (which made a
compiled training step host-bound). Under the Triton interpreter (CPU) they are opaque custom ops
instead (see ``kernels.ops.kernel_op``), so compiled models still compute the right numbers there:

* ``flash_window_attention(q, k, v, bias, mask, grid_size, scale, window_size)``: window layout, q/k/v of shape
  (B * num_windows, heads, L, head_dim), windows of each image in row-major order over a grid_size
  window grid (what timm's window_partition produces);
* ``flash_window_attention_image(qkv, bias, mask, qkv_bias, window_size, shift_size, scale, cosine_scale)``:
  image layout, reads q/k/v straight from the qkv projection output (B, H, W, 3, heads, head_dim) and writes
  (B, H, W, heads, head_dim); cyclic shift, padding and window partition/reverse are index arithmetic
  in the kernel. Its backward writes one (B, H, W, 3, heads, head_dim) gradient. With ``cosine_scale``
  (Swin V2) the kernels normalise q and k themselves, so the raw projection goes in and its gradient comes out.

Both take plain tensors and sizes (the window geometry and the mask are the model's, ``swin.models.windows``):
``bias`` is Swin's ((2wh-1)(2ww-1), heads) relative position table (differentiable; the kernel that makes the
bias tiles gathers it with timm's relative index) or a dense (heads, L, L) additive bias, ``mask`` None or the
(num_windows, L, L) additive shifted-window mask of an image's window grid (timm's ``attn_mask``). The kernels
read only four of its windows: Swin's shifted-window mask depends on nothing but whether a window lies in the last
row and/or column of the grid. The forward makes the bias-plus-mask tiles once and hands them to the backward.

The bias gets its gradient in fp32: each backward program sums the score gradients of its windows on chip and
writes one tile per head; two small kernels sum the tiles and then each table entry's token pairs (deterministic,
no atomics per window and element).
"""
from __future__ import annotations

import functools
import os

import torch
import triton

from kernels.flash_window_triton import (
    bias_grad_sum_kernel,
    bias_table_grad_kernel,
    bias_tiles_kernel,
    window_attn_bwd_kernel,
    window_attn_fwd_kernel,
)
from kernels.ops import eager_launch as _eager_launch
from kernels.ops import interpreting as _interpreting
from kernels.ops import kernel_op as _kernel_op
from kernels.ops import launch as _launch

MAX_WINDOW_AREA = 256   # the L x L score tile must fit on chip (16 x 16 windows)
MAX_HEAD_DIM = 128
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def unsupported_reason(x: torch.Tensor, window_area: int, head_dim: int) -> str | None:
    """Why the kernel cannot take this input (None if it can); window_area = L, the tokens of a window."""
    if not (x.is_cuda or _interpreting()):
        return (f"flash_window needs a CUDA tensor (got device {x.device}); use attention='sdpa' on the CPU "
                "(or set TRITON_INTERPRET=1 before importing triton to run the kernel in the interpreter)")
    if x.dtype not in SUPPORTED_DTYPES:
        return f"flash_window supports float16, bfloat16 and float32, not {x.dtype}"
    if window_area > MAX_WINDOW_AREA:
        return f"flash_window supports windows of at most {MAX_WINDOW_AREA} tokens, got {window_area}"
    if head_dim > MAX_HEAD_DIM:
        return f"flash_window supports head_dim up to {MAX_HEAD_DIM}, got {head_dim}"
    if window_area > 128 and head_dim > 64:
        # K and V of the whole window live on chip: 256-token tiles of 128 channels do not fit
        return (f"flash_window supports head_dim up to 64 for windows of more than 128 tokens, got "
                f"{window_area}-token windows with head_dim {head_dim}")
    return None


def _check(x: torch.Tensor, area: int, head_dim: int, heads: int, bias: torch.Tensor, mask: torch.Tensor | None,
           window: tuple[int, int] | None, grid: tuple[int, int]) -> None:
    reason = unsupported_reason(x, area, head_dim)
    if reason is not None:
        raise ValueError(reason)
    if window is not None and window[0] * window[1] != area:
        raise ValueError(f"window_size {window[0]}x{window[1]} does not hold the L = {area} tokens of a window")
    if bias.dim() == 2:
        if window is None:
            raise ValueError(f"a 2-D bias is the relative position table of a window: give window_size (wh, ww) with "
                             f"wh * ww = L = {area}, or pass the dense (heads, L, L) bias")
        entries = (2 * window[0] - 1) * (2 * window[1] - 1)
        if bias.shape != (entries, heads):
            raise ValueError(f"the relative position table of a {window[0]}x{window[1]} window must be "
                             f"((2wh-1)(2ww-1), heads) = ({entries}, {heads}), got {tuple(bias.shape)}")
    elif bias.shape != (heads, area, area):
        raise ValueError(f"bias must be the dense (heads, L, L) = ({heads}, {area}, {area}) bias or a relative "
                         f"position table, got {tuple(bias.shape)}")
    if mask is not None and mask.shape != (grid[0] * grid[1], area, area):
        raise ValueError(f"mask must be None or the (windows per image, L, L) = ({grid[0] * grid[1]}, {area}, {area}) "
                         f"shifted-window mask of the {grid[0]}x{grid[1]} window grid, got {tuple(mask.shape)}")
    if any(t is not None and t.device != x.device for t in (bias, mask)):
        raise ValueError(f"bias and mask must be on the device of the inputs ({x.device})")
    if mask is not None and mask.requires_grad:
        raise ValueError("mask must not require grad (it is a constant of the window geometry)")


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _major_capability(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def _tuning(name: str, default: int) -> int:
    # SWIN_FW_<NAME> overrides a launch parameter, for tuning sweeps on the GPU
    return int(os.environ.get(f"SWIN_FW_{name}", default))


def _key_blocks(window_area: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_T): a window's keys as one power-of-two tile, or, for windows of more than 64 tokens that
    are at most 16 past a power of two, as that power of two plus a 16-key tail: 144 tokens (12x12) as 128 + 16
    keys instead of 256 (44% padding in every product, exp and bias-tile byte). Wider tails cost the backward more
    registers (and spills) than they save. SWIN_FW_TAIL=0: one tile."""
    block_n = max(16, triton.next_power_of_2(window_area))
    head = block_n // 2
    if block_n > 64 and window_area - head <= 16 and _tuning("TAIL", 1):
        return head, 16
    return block_n, 0


def resident_sets(sets: int, total_windows: int, windows_per_image: int) -> int:
    """Program sets (programs per head) for forward programs that keep their bias tile in registers for all their
    windows, else 0. A program takes every sets-th window, so its windows are all of one mask class where sets is a
    multiple of the windows per image (1 without a mask): sets rounds down to one. Only where each program then has
    4 windows or more (SWIN_FW_RESIDENT_MIN_WINDOWS): with fewer the tile's load is hardly repeated, and the
    registers it holds slow the program down."""
    sets = sets // windows_per_image * windows_per_image
    return sets if sets and total_windows >= _tuning("RESIDENT_MIN_WINDOWS", 4) * sets else 0


def resident_forward_sets(total_windows: int, heads: int, sms: int, windows_per_image: int) -> int:
    """The forward's resident program sets (resident_sets) at the most of 32, 16, 8 and 4 programs per SM that allows
    them, else 0 (then 32 per SM, each loading the tile per window: small batches, or images of more windows than a
    launch has programs per head). Fewer programs that keep their tile beat more that reload it per window."""
    for per_sm in (32, 16, 8, 4):
        sets = resident_sets(max(1, min(total_windows, sms * per_sm // heads)), total_windows, windows_per_image)
        if sets:
            return sets
    return 0


def _launch_config(total_windows: int, heads: int, window_area: int, head_dim: int, device: torch.device,
                   backward: bool = False, itemsize: int = 2, windows_per_image: int = 1) -> dict:
    """Launch parameters of one kernel (the constexprs among them in capitals). windows_per_image: of the mask grid
    (1 without a mask), for the forward's resident bias tiles (resident_sets)."""
    block_n, block_t = _key_blocks(window_area)
    # windows of up to 64 tokens are one query block. Larger ones take 16-row query blocks: with 32 or 64 rows the
    # (rows, 128 or 256) score tiles spill registers or overflow shared memory; except the 16-bit forward of split
    # keys, whose 64 rows are faster (the backward is not)
    block_m = block_n if window_area <= 64 else (64 if block_t and itemsize == 2 and not backward else 16)
    block_m = min(block_n, _tuning("BWD_BLOCK_M" if backward else "BLOCK_M", block_m))
    num_m = triton.cdiv(window_area, block_m)
    assert num_m > 1 or not block_t, "split keys need query blocks of their own (the one-block path reuses the keys)"
    # forward, one-block windows: programs that each loop over windows with the next windows' loads pipelined
    # (STAGES below), 32 per SM, or fewer where each then keeps its bias tile in registers (resident_forward_sets;
    # 16-bit tiles); several query blocks: one program per window and head (0). Backward: 4 programs per SM (2 for
    # split keys), each looping over windows, as each writes a bias-gradient tile that bias_grad_sum_kernel sums
    # (scripts/tune_flash_window.py sweeps these). The interpreter (CPU) runs programs one after the other: 4
    # programs per head (2 with split keys) keep tests quick.
    cuda = device.type == "cuda"
    sms = _num_sms(device.index or 0) if cuda else 0
    if backward:
        per_sm = _tuning("BWD_PROGRAMS_PER_SM", 2 if block_t else 4)
    else:
        per_sm = _tuning("PROGRAMS_PER_SM", (32 if num_m == 1 else 0) if cuda else 4)
    budget = sms * per_sm // heads if cuda else per_sm
    sets = total_windows if per_sm == 0 else max(1, min(total_windows, budget))
    resident = False  # the backward reads its tile per window (see window_attn_bwd_kernel)
    if (not backward and num_m == 1 and not block_t and itemsize == 2 and _tuning("HALF_BIAS", 1) == 1
            and _tuning("RESIDENT_BIAS", 1) == 1):
        # a programs-per-SM knob (or the interpreter's 4 per head) keeps its sets, rounded where that allows it
        chosen = "SWIN_FW_PROGRAMS_PER_SM" in os.environ or not cuda
        resident_at = (resident_sets(sets, total_windows, windows_per_image) if chosen else
                       resident_forward_sets(total_windows, heads, sms, windows_per_image))
        resident, sets = resident_at > 0, resident_at or sets
    # the next windows' loads pipelined through shared memory (one-block windows): the forward's next window for
    # tiles up to 32 KB (larger ones overflow shared memory), the next two for tiles up to 8 KB where a program has
    # 4 windows or more (with fewer the deeper pipeline is slower); the backward's next two for tiles up to 8 KB
    block_d = max(16, triton.next_power_of_2(head_dim))
    tile_bytes = block_n * block_d * itemsize
    if num_m > 1:
        stages = 1
    elif backward:
        stages = 3 if tile_bytes <= 8192 else 1
    else:
        stages = 1 if tile_bytes > 32768 else (3 if total_windows >= 4 * sets and tile_bytes <= 8192 else 2)
    # the backward of windows over 128 tokens: 8 warps for one padded tile, fp32 or wide heads, 4 for 16-bit keys
    # split in two of head_dim up to 32 (their registers then allow 2 programs per SM)
    wide = window_area > 128 and backward
    default_warps = 8 if wide and not (block_t and itemsize == 2 and block_d <= 32) else 4
    return dict(sets=sets, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_T=block_t, BLOCK_D=block_d,
                NUM_M=num_m, num_warps=_tuning("BWD_WARPS" if backward else "WARPS", default_warps),
                # a register cap per thread (0: none), for more programs per SM at the price of spills: a tuning knob
                # of eager calls (not passed where torch.compile traces the op, see kernels.ops.eager_launch)
                maxnreg=_tuning("BWD_MAXNREG" if backward else "MAXNREG", 0),
                STAGES=_tuning("BWD_STAGES" if backward else "STAGES", stages),
                HEAD_MINOR=_tuning("BWD_HEAD_MINOR" if backward else "HEAD_MINOR", 1),
                **({} if backward else {"RESIDENT_BIAS": resident}))


def kernel_constants(cfg: dict, window: tuple[int, int], masked: bool, has_fill: bool, dtype: torch.dtype,
                     cosine: bool = False, rows: int = 0) -> dict:
    """The kernels' constexpr arguments for a launch config (also used by scripts/kernel_resources.py); rows: those
    of the bias tiles (see tile_rows; default the config's own query rows)."""
    tiling = {k: v for k, v in cfg.items() if k not in ("sets", "num_warps", "maxnreg")}
    tiling["TILE_ROWS"] = rows or cfg["NUM_M"] * cfg["BLOCK_M"]
    # fp32: three tf32 products per product (about fp32 accuracy on tensor cores, faster than exact FMAs) for key
    # tiles of up to 4608 elements (64 x 64, or 12x12 windows' 128 + 16 keys of 32 channels); larger ones do not fit
    # in shared memory that way and take exact fp32 FMAs (scripts/kernel_resources.py)
    small = (cfg["BLOCK_N"] + cfg["BLOCK_T"]) * cfg["BLOCK_D"] <= 4608
    fp32 = os.environ.get("SWIN_FW_FP32_PRECISION", "tf32x3" if small else "ieee")
    return dict(WH=window[0], WW=window[1], MASKED=masked, HAS_FILL=has_fill, COSINE=cosine,
                PRECISION=fp32 if dtype == torch.float32 else "tf32", **tiling)


Strides = tuple[int, int, int, int]  # (b, y, x, head) element strides of (B, H, W, heads, head_dim) tokens


def _image_strides(t: torch.Tensor) -> Strides:
    """Strides of a (B, H, W, heads, head_dim) tensor, or of one of q/k/v in (B, H, W, 3, heads, head_dim)."""
    assert t.stride(-1) == 1
    return t.stride(0), t.stride(1), t.stride(2), t.stride(-2)


def _window_strides(t: torch.Tensor) -> Strides:
    """(B * num_windows, heads, L, head_dim) tokens addressed as images of one 1 x L window each."""
    assert t.stride(-1) == 1
    s = t.stride()[-4:]
    return s[0], 0, s[2], s[1]


class _Geometry:
    """Launch geometry: `images` addressing images (H, W) of (AGH, AGW) windows shifted by (ASH, ASW); the
    mask class of a window comes from its position in a (MGH, MGW) grid of windows per image."""

    def __init__(self, images: int, window: tuple[int, int], feat: tuple[int, int], addr_grid: tuple[int, int],
                 addr_shift: tuple[int, int], mask_grid: tuple[int, int]):
        self.images, self.window, self.feat = images, window, feat
        self.addr_grid, self.addr_shift, self.mask_grid = addr_grid, addr_shift, mask_grid

    @property
    def total_windows(self) -> int:
        return self.images * self.addr_grid[0] * self.addr_grid[1]

    @property
    def area(self) -> int:
        return self.window[0] * self.window[1]

    def ints(self) -> tuple[int, ...]:
        return (self.total_windows, self.area, *self.feat, *self.addr_grid, *self.addr_shift, *self.mask_grid)


def _launch_plan(x: torch.Tensor, heads: int, head_dim: int, geo: _Geometry, masked: bool,
                 fill: torch.Tensor | None, q_scale: torch.Tensor | None, backward: bool,
                 rows: int | None) -> tuple[dict, dict]:
    """(launch config, the kernels' constexpr and launch keywords) for one call on data like x, whose bias tiles
    have `rows` rows (None: the forward, which makes them, sizes them with tile_rows)."""
    cfg = _launch_config(geo.total_windows, heads, geo.area, head_dim, x.device, backward=backward,
                         itemsize=x.element_size(),
                         windows_per_image=geo.mask_grid[0] * geo.mask_grid[1] if masked else 1)
    if rows is None:
        rows = tile_rows(geo.total_windows, heads, geo.area, head_dim, x.device, x.element_size(), forward=cfg)
    keywords = kernel_constants(cfg, geo.window, masked, fill is not None, x.dtype, q_scale is not None, rows)
    capped = cfg["maxnreg"] and _eager_launch(x)
    launch = {"num_warps": cfg["num_warps"], **({"maxnreg": cfg["maxnreg"]} if capped else {})}
    return cfg, {**keywords, **launch}


def tile_rows(total_windows: int, heads: int, window_area: int, head_dim: int, device: torch.device,
              itemsize: int, forward: dict | None = None) -> int:
    """Rows of the bias tiles: the forward makes them and the backward reads them (tiles.shape[2]), each with its own
    query blocks (12x12 windows: 3 x 64 rows forward, 9 x 16 backward), so the more of the two. forward: the
    forward's launch config, where the caller has it."""
    configs = [forward or _launch_config(total_windows, heads, window_area, head_dim, device, itemsize=itemsize),
               _launch_config(total_windows, heads, window_area, head_dim, device, backward=True, itemsize=itemsize)]
    return max(cfg["NUM_M"] * cfg["BLOCK_M"] for cfg in configs)


def tile_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The bias tiles' dtype: a half-precision input's own dtype (what timm's SDPA path adds: its bias-plus-mask
    tensor is cast to the query's dtype), fp32 for fp32 inputs or with SWIN_FW_HALF_BIAS=0. Programs read their
    head's tile once per window, except resident ones (L2 hits, but in fp32 more bytes than the window's q, k, v,
    o): half tiles halve that traffic."""
    half = x_dtype in (torch.float16, torch.bfloat16) and _tuning("HALF_BIAS", 1)
    return x_dtype if half else torch.float32


def _dependent_launch(x: torch.Tensor) -> bool:
    """Whether the forward launches as a programmatic dependent of the tile kernel (PDL, Hopper and later): its
    launch then overlaps the tile kernel instead of waiting for it to finish. Eager calls only: where torch.compile
    traces the op, wrap_triton's analysis of what a kernel writes cannot read the wait instruction (and would copy
    the kernel's inputs). SWIN_FW_PDL=0: off."""
    return (x.is_cuda and not _interpreting() and _eager_launch(x) and _tuning("PDL", 1) == 1
            and _major_capability(x.device.index or 0) >= 9)


def _bias_tiles(bias: torch.Tensor, mask: torch.Tensor | None, window: tuple[int, int], geo: _Geometry, heads: int,
                cfg: dict, keywords: dict, dtype: torch.dtype, pdl: bool) -> torch.Tensor:
    """(classes, heads, TILE_ROWS, BLOCK_N + BLOCK_T) tiles (tile_dtype) the attention kernels load: bias (dense, or
    gathered from the relative position table of `window`) plus the mask of each class's window (4 classes: interior,
    last column, last row, last window; 1 without a mask), padded; one small kernel. pdl: the next launch is its
    programmatic dependent (_dependent_launch)."""
    area = window[0] * window[1]
    classes = 4 if mask is not None else 1
    rows, cols = keywords["TILE_ROWS"], cfg["BLOCK_N"] + cfg["BLOCK_T"]
    row_block = min(16, rows & -rows)  # a power of two dividing rows; 16-row blocks: 4x the programs of 64
    col_block = cfg["BLOCK_T"] or cfg["BLOCK_N"]  # both powers of two: tail-wide blocks tile the columns
    tiles = bias.new_empty((classes, heads, rows, cols), dtype=tile_dtype(dtype))
    table = bias.dim() == 2
    strides = (bias.stride(1), bias.stride(0), 0) if table else bias.stride()
    mask_arg = mask.contiguous() if mask is not None else bias  # not read without a mask
    _launch(bias_tiles_kernel, (classes * heads, rows // row_block, cols // col_block), bias, *strides, mask_arg,
            tiles, area, heads, *window, *geo.mask_grid, BLOCK_M=row_block, BLOCK_N=col_block, ROWS=rows, COLS=cols,
            MASKED=mask is not None, TABLE=table, PDL=pdl)
    return tiles


def _bias_grad(partial: torch.Tensor, bias: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """The bias gradient (bias's shape and dtype) from the backward programs' (programs, heads, rows, cols) fp32
    tiles: summed over programs in a fixed order, then, for a relative position table, over each entry's token
    pairs (two small kernels, deterministic, no atomics)."""
    sets, heads, rows, cols = partial.shape
    area = window[0] * window[1]
    dense = partial.new_empty((heads, area, area))
    block_n = triton.next_power_of_2(area)
    block_s = min(triton.next_power_of_2(sets), max(1, 8192 // block_n))
    _launch(bias_grad_sum_kernel, (heads * area,), partial, dense, sets, heads, area, ROWS=rows, COLS=cols,
            BLOCK_S=block_s, BLOCK_N=block_n, num_warps=8)
    if bias.dim() == 3:
        return dense.to(bias.dtype)
    grad = torch.empty_like(bias, memory_format=torch.contiguous_format)
    _launch(bias_table_grad_kernel, (heads, 2 * window[0] - 1), dense, grad, grad.stride(0), grad.stride(1), area,
            *window, BLOCK_P=block_n, BLOCK_X=triton.next_power_of_2(2 * window[1] - 1))
    return grad


def _report(kernel, cfg: dict) -> None:
    # kernel is None when traced (torch.compile); eager launches return the compiled kernel
    if os.environ.get("SWIN_FW_DEBUG") and hasattr(kernel, "n_regs"):
        print(f"[flash_window] {kernel.name}: {kernel.n_regs} registers, {kernel.n_spills} spills, {cfg}")


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s_t: int, sq: Strides, out: torch.Tensor,
             so: Strides, heads: int, head_dim: int, bias: torch.Tensor, mask: torch.Tensor | None,
             fill: torch.Tensor | None, geo: _Geometry, table_window: tuple[int, int], scale: float,
             q_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Writes out and returns the bias tiles (for the backward). q, k, v: the same tensor s_t elements apart (qkv)
    or separate tensors (s_t = 0). q_scale: None, or (heads,) fp32 for scaled cosine attention (q and k normalised,
    q times q_scale). table_window: the window whose relative position table a 2-D bias is.

    Every tensor reaches the kernel whole, never as a view: torch.compile then passes the buffers through
    untouched, where a written view (or, through wrap_triton's analysis, a read one) costs a copy."""
    cfg, keywords = _launch_plan(q, heads, head_dim, geo, mask is not None, fill, q_scale, False, None)
    pdl = _dependent_launch(q)
    tiles = _bias_tiles(bias, mask, table_window, geo, heads, cfg, keywords, q.dtype, pdl)
    kernel = _launch(window_attn_fwd_kernel, (cfg["sets"] * heads,), q, k, v, s_t, *sq, out, *so,
                     tiles, fill if fill is not None else tiles, q_scale if q_scale is not None else tiles,
                     *geo.ints(), head_dim, heads, scale, **keywords, PDL=pdl, **({"launch_pdl": True} if pdl else {}))
    _report(kernel, cfg)
    return tiles


def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s_t: int, sq: Strides, do: torch.Tensor,
              sdo: Strides, dqkv: torch.Tensor, sd_t: int, sdq: Strides, heads: int, head_dim: int,
              tiles: torch.Tensor, bias: torch.Tensor, fill: torch.Tensor | None, geo: _Geometry,
              table_window: tuple[int, int], scale: float, q_scale: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Writes dq, dk, dv into dqkv (sd_t elements apart) (of the raw q and k with q_scale); returns (bias
    gradient, fill gradient or None, q_scale gradient or None). tiles: the forward's bias tiles (4 classes when
    shifted); bias: the forward's bias (dense or a table), for its gradient's shape and dtype."""
    cfg, keywords = _launch_plan(q, heads, head_dim, geo, tiles.shape[0] > 1, fill, q_scale, True, tiles.shape[2])
    # one (rows, cols) tile per program and head; the single-block kernel writes its tile whole at the end, the
    # multi-block one adds into it window after window
    alloc = torch.empty if cfg["NUM_M"] == 1 else torch.zeros
    partial = alloc((cfg["sets"], heads, cfg["NUM_M"] * cfg["BLOCK_M"], tiles.shape[-1]), dtype=torch.float32,
                    device=q.device)
    dfill = torch.zeros(2, heads, head_dim, dtype=torch.float32, device=q.device) if fill is not None else None
    # one value per program, written by the program: summed here
    dq_scale = torch.empty(cfg["sets"], heads, dtype=torch.float32, device=q.device) if q_scale is not None else None
    kernel = _launch(window_attn_bwd_kernel, (cfg["sets"] * heads,), q, k, v, s_t, *sq, do, *sdo, dqkv, sd_t, *sdq,
                     tiles, fill if fill is not None else tiles, partial, dfill if dfill is not None else partial,
                     q_scale if q_scale is not None else tiles, dq_scale if dq_scale is not None else partial,
                     *geo.ints(), head_dim, heads, scale, **keywords)
    _report(kernel, cfg)
    return (_bias_grad(partial, bias, table_window), dfill.to(fill.dtype) if dfill is not None else None,
            dq_scale.sum(0).to(q_scale.dtype) if dq_scale is not None else None)


# ---------------------------------------------------------------------------------------------
# window layout op: q, k, v (B * num_windows, heads, L, head_dim)

def _window_geometry(windows: int, area: int, grid: list[int]) -> _Geometry:
    # each window is an image of one 1 x L window (its tokens are contiguous), shifted by nothing
    return _Geometry(windows, (1, area), (1, area), (1, 1), (0, 0), tuple(grid))


@_kernel_op("swin::flash_window_attn")
def _window_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor | None,
               grid: list[int], window: list[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, the bias tiles for the backward)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    bw, heads, area, head_dim = q.shape
    tiles = _forward(q, k, v, 0, _window_strides(q), out, _window_strides(out), heads, head_dim, bias, mask, None,
                     _window_geometry(bw, area, grid), tuple(window), scale)
    return out, tiles


@_kernel_op("swin::flash_window_attn_bwd")
def _window_op_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: torch.Tensor,
                   bias: torch.Tensor, grid: list[int], window: list[int], scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv stacked as one (3, *q.shape) tensor, bias gradient)."""
    q, k, v, grad_out = q.contiguous(), k.contiguous(), v.contiguous(), grad_out.contiguous()
    dqkv = q.new_empty((3, *q.shape))
    bw, heads, area, head_dim = q.shape
    dbias, _, _ = _backward(q, k, v, 0, _window_strides(q), grad_out, _window_strides(grad_out), dqkv,
                            dqkv.stride(0), _window_strides(dqkv), heads, head_dim, tiles, bias, None,
                            _window_geometry(bw, area, grid), tuple(window), scale)
    return dqkv, dbias


def _window_setup(ctx, inputs, output):
    q, k, v, bias, mask, grid, window, scale = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(q, k, v, output[1], bias)
    ctx.geometry = (grid, window, scale)


def _window_grad(ctx, grad_out, _grad_tiles):
    q, k, v, tiles, bias = ctx.saved_tensors
    dqkv, dbias = _window_op_bwd(grad_out, q, k, v, tiles, bias, *ctx.geometry)
    dq, dk, dv = dqkv.unbind(0)
    return dq, dk, dv, dbias, None, None, None, None


_window_op.register_autograd(_window_grad, setup_context=_window_setup)


def flash_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                           mask: torch.Tensor | None = None, grid_size: tuple[int, int] = (1, 1),
                           scale: float | None = None, window_size: tuple[int, int] | None = None) -> torch.Tensor:
    """softmax(scale q k^T + bias + mask) v for windows in window layout.

    q, k, v: (B * num_windows, heads, L, head_dim), the windows of each image in row-major order over a
    grid_size = (windows along H, windows along W) grid. bias: the dense (heads, L, L) bias, or Swin's
    ((2wh-1)(2ww-1), heads) relative position table of a window_size = (wh, ww) window, gathered in the kernel;
    differentiable. mask: None or the (num_windows, L, L) shifted-window mask of that grid (timm's attn_mask).
    """
    bw, heads, area, head_dim = q.shape
    _check(q, area, head_dim, heads, bias, mask, window_size, tuple(grid_size))
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must have one shape (B * num_windows, heads, L, head_dim); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if bw % (grid_size[0] * grid_size[1]):
        raise ValueError(f"{bw} windows is not a multiple of the {grid_size[0]}x{grid_size[1]} windows per image")
    scale = head_dim ** -0.5 if scale is None else float(scale)
    window = list(window_size) if window_size is not None else [1, area]
    return _window_op(q, k, v, bias, mask, list(grid_size), window, scale)[0]


# ---------------------------------------------------------------------------------------------
# image layout op: qkv (B, H, W, 3, heads, head_dim) -> (B, H, W, heads, head_dim)

def _image_geometry(qkv: torch.Tensor, window: list[int], shift: list[int]) -> _Geometry:
    (h, w), (wh, ww) = qkv.shape[1:3], window
    grid = (-(-h // wh), -(-w // ww))
    return _Geometry(qkv.shape[0], tuple(window), (h, w), grid, tuple(shift), grid)


@_kernel_op("swin::flash_window_attn_image")
def _image_op(qkv: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor | None, kv_fill: torch.Tensor | None,
              q_scale: torch.Tensor | None, window: list[int], shift: list[int], scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, the bias tiles for the backward)."""
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    fill = kv_fill.contiguous() if kv_fill is not None else None
    b, h, w, _, heads, hd = qkv.shape
    out = qkv.new_empty((b, h, w, heads, hd))
    # q, k, v are read from the one qkv tensor, qkv.stride(3) elements apart
    tiles = _forward(qkv, qkv, qkv, qkv.stride(3), _image_strides(qkv), out, _image_strides(out), heads, hd,
                     bias, mask, fill, _image_geometry(qkv, window, shift), tuple(window), scale, q_scale)
    return out, tiles


@_kernel_op("swin::flash_window_attn_image_bwd")
def _image_op_bwd(grad_out: torch.Tensor, qkv: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor,
                  kv_fill: torch.Tensor | None, q_scale: torch.Tensor | None, window: list[int], shift: list[int],
                  scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    dqkv = qkv.new_empty(qkv.shape)
    fill = kv_fill.contiguous() if kv_fill is not None else None
    heads, hd = qkv.shape[-2:]
    dbias, dfill, dq_scale = _backward(qkv, qkv, qkv, qkv.stride(3), _image_strides(qkv), grad_out,
                                       _image_strides(grad_out), dqkv, dqkv.stride(3), _image_strides(dqkv), heads,
                                       hd, tiles, bias, fill, _image_geometry(qkv, window, shift), tuple(window),
                                       scale, q_scale)
    # ops return tensors only; an empty one stands for "no fill" / "no q_scale"
    return dqkv, dbias, qkv.new_empty(0) if dfill is None else dfill, qkv.new_empty(0) if dq_scale is None else dq_scale


def _image_setup(ctx, inputs, output):
    qkv, bias, mask, kv_fill, q_scale, window, shift, scale = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(qkv, output[1], bias, kv_fill, q_scale)
    ctx.geometry = (window, shift, scale)


def _image_grad(ctx, grad_out, _grad_tiles):
    qkv, tiles, bias, kv_fill, q_scale = ctx.saved_tensors
    dqkv, dbias, dfill, dq_scale = _image_op_bwd(grad_out, qkv, tiles, bias, kv_fill, q_scale, *ctx.geometry)
    return (dqkv, dbias, None, dfill if kv_fill is not None else None, dq_scale if q_scale is not None else None,
            None, None, None)


_image_op.register_autograd(_image_grad, setup_context=_image_setup)


def flash_window_attention_image(qkv: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor | None,
                                 qkv_bias: torch.Tensor | None, window_size: tuple[int, int],
                                 shift_size: tuple[int, int], scale: float,
                                 cosine_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Window attention of a Swin block straight from its qkv projection, in image layout.

    qkv: (B, H, W, 3, heads, head_dim), the unshifted, unpadded feature map's projection. bias: Swin's
    ((2wh-1)(2ww-1), heads) relative position table (gathered in the kernel: its index is timm's), or the dense
    (heads, L, L) bias; differentiable. mask: None (unshifted) or the (num_windows, L, L) shifted-window mask of the
    block's padded window grid (timm's attn_mask). qkv_bias: (3, heads, head_dim) or None, the value
    of q/k/v at padded positions (timm pads before the projection). The window grid is the padded (ceil) one; a
    cyclic shift of shift_size is undone in the addressing. cosine_scale: None, or (heads,) for Swin V2's scaled
    cosine attention: q and k (raw, as is qkv_bias) are normalised to unit length in the kernel and q multiplied by
    cosine_scale (differentiable), usually with scale 1. Returns (B, H, W, heads, head_dim).
    """
    b, h, w, three, heads, head_dim = qkv.shape
    grid = (-(-h // window_size[0]), -(-w // window_size[1]))
    _check(qkv, window_size[0] * window_size[1], head_dim, heads, bias, mask, tuple(window_size), grid)
    if three != 3:
        raise ValueError(f"qkv must be (B, H, W, 3, heads, head_dim), got {tuple(qkv.shape)}")
    padded = h % window_size[0] != 0 or w % window_size[1] != 0
    fill = qkv_bias[1:].to(qkv.dtype) if (qkv_bias is not None and padded) else None
    if cosine_scale is not None:
        if cosine_scale.numel() != heads:
            raise ValueError(f"cosine_scale must hold one value per head ({heads}), got {tuple(cosine_scale.shape)}")
        if cosine_scale.device != qkv.device:
            raise ValueError(f"cosine_scale must be on the device of qkv ({qkv.device}), got {cosine_scale.device}")
        cosine_scale = cosine_scale.reshape(heads).float()
    return _image_op(qkv, bias, mask, fill, cosine_scale, list(window_size), [int(s) for s in shift_size],
                     float(scale))[0]
