"""Launching the flash window kernels for one call: the bias tiles, the forward, the backward and the bias gradient.

The functions here take plain tensors and sizes and return tensors; kernels.flash_window.ops makes them PyTorch ops
(for torch.compile) and autograd functions (for eager calls). Each launch's parameters come from the cached plans of
kernels.flash_window.plan.

The forward makes the bias-plus-mask tiles once and hands them to the backward. The bias gets its gradient in fp32:
each backward program sums the score gradients of its windows on chip and writes one tile per head; two small
kernels sum the tiles and then each table entry's token pairs (deterministic, no atomics per window and element).
"""
from __future__ import annotations

import torch

from kernels.flash_window import plan
from kernels.flash_window.triton_kernels import (
    SPARE_PAD_ROWS,
    bias_grad_sum_kernel,
    bias_table_grad_kernel,
    bias_tiles_kernel,
    window_attn_bwd_kernel,
    window_attn_fwd_kernel,
)
from kernels.ops import LaunchReplay, interpreting, next_power_of_2, recording_launches, scratch
from kernels.ops import eager_launch as _eager_launch
from kernels.ops import launch as _launch

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


def _bias_tiles(bias: torch.Tensor, mask: torch.Tensor | None, window: tuple[int, int], geo: _Geometry,
                fwd: plan.ForwardPlan) -> torch.Tensor:
    """(classes, heads, TILE_ROWS, BLOCK_N + BLOCK_T) tiles (tile_dtype) the attention kernels load: bias (dense, or
    gathered from the relative position table of `window`) plus the mask of each class's window (4 classes: interior,
    last column, last row, last window; 1 without a mask), padded; one small kernel. With fwd.pdl the forward
    launches as its programmatic dependent (Hopper and later): it overlaps this kernel instead of waiting for it."""
    area = window[0] * window[1]
    classes, heads, rows, cols = fwd.tiles_shape
    row_block = min(16, rows & -rows)  # a power of two dividing rows; 16-row blocks: 4x the programs of 64
    col_block = fwd.cfg["BLOCK_T"] or fwd.cfg["BLOCK_N"]  # both powers of two: tail-wide blocks tile the columns
    tiles = bias.new_empty(fwd.tiles_shape, dtype=fwd.tiles_dtype)
    table = bias.dim() == 2
    strides = (bias.stride(1), bias.stride(0), 0) if table else bias.stride()
    mask_arg = mask.contiguous() if mask is not None else bias  # not read without a mask
    _launch(bias_tiles_kernel, (classes * heads, rows // row_block, cols // col_block), bias, *strides, mask_arg,
            tiles, area, heads, *window, *geo.mask_grid, BLOCK_M=row_block, BLOCK_N=col_block, ROWS=rows, COLS=cols,
            MASKED=mask is not None, TABLE=table, PDL=fwd.pdl)
    return tiles


def _bias_grad(partial: torch.Tensor, bias: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """The bias gradient (bias's shape and dtype) from the backward programs' (programs, heads, rows, cols) fp32
    tiles: summed over programs in a fixed order, then, for a relative position table, over each entry's token
    pairs (two small kernels, deterministic, no atomics)."""
    sets, heads, rows, cols = partial.shape
    area = window[0] * window[1]
    dense = scratch((heads, area, area), partial.dtype, partial.device)
    block_n, block_s, block_x = _grad_blocks(sets, area, window[1])
    _launch(bias_grad_sum_kernel, (heads * area,), partial, dense, sets, heads, area, ROWS=rows, COLS=cols,
            BLOCK_S=block_s, BLOCK_N=block_n, num_warps=8)
    if bias.dim() == 3:
        return dense.to(bias.dtype)
    grad = torch.empty_like(bias, memory_format=torch.contiguous_format)
    _launch(bias_table_grad_kernel, (heads, 2 * window[0] - 1), dense, grad, grad.stride(0), grad.stride(1), area,
            *window, BLOCK_P=block_n, BLOCK_X=block_x)
    return grad


def _grad_blocks(sets: int, area: int, window_width: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_S, BLOCK_X) of the bias-gradient kernels."""
    block_n = next_power_of_2(area)
    block_s = min(next_power_of_2(sets), max(1, 8192 // block_n))
    return block_n, block_s, next_power_of_2(2 * window_width - 1)


def _report(kernel, cfg: dict) -> None:
    # kernel is None when traced (torch.compile); eager launches return the compiled kernel
    if plan.TUNING.debug and hasattr(kernel, "n_regs"):
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
    ints, eager = geo.ints(), _eager_launch(q)
    # traced by torch.compile, sizes may be symbolic (unhashable): the plan is computed, not looked up
    forward_plan = plan.forward_plan if eager else plan.forward_plan.__wrapped__
    fwd = forward_plan(ints, geo.window, heads, head_dim, q.dtype, q.device, mask is not None, fill is not None,
                       q_scale is not None, eager, plan.TUNING)
    tiles = _bias_tiles(bias, mask, table_window, geo, fwd)
    kernel = _launch(window_attn_fwd_kernel, (fwd.cfg["sets"] * heads,), q, k, v, s_t, *sq, out, *so,
                     tiles, fill if fill is not None else tiles, q_scale if q_scale is not None else tiles,
                     *ints, head_dim, heads, scale, **fwd.keywords, PDL=fwd.pdl,
                     **({"launch_pdl": True} if fwd.pdl else {}))
    _report(kernel, fwd.cfg)
    return tiles


def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s_t: int, sq: Strides, do: torch.Tensor,
              sdo: Strides, dqkv: torch.Tensor, sd_t: int, sdq: Strides, heads: int, head_dim: int,
              tiles: torch.Tensor, bias: torch.Tensor, fill: torch.Tensor | None, geo: _Geometry,
              table_window: tuple[int, int], scale: float, q_scale: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Writes dq, dk, dv into dqkv (sd_t elements apart) (of the raw q and k with q_scale); returns (bias
    gradient, the padded tokens' dk and dv rows (2, heads, padded tokens + SPARE_PAD_ROWS, head_dim) in dqkv's
    dtype, whose sum is the fill gradient, or None, the q_scale gradient's (programs, heads) fp32 partial sums or
    None): what the kernels write, so that an eager call replays whole; :func:`_finish_image_grads` makes them the
    gradients. tiles: the forward's bias tiles (4 classes when shifted); bias: the forward's bias (dense or a
    table), for its gradient's shape and dtype."""
    ints, eager = geo.ints(), _eager_launch(q)
    backward_plan = plan.backward_plan if eager else plan.backward_plan.__wrapped__  # as in _forward
    cfg, keywords = backward_plan(ints, geo.window, heads, head_dim, q.dtype, q.device, tiles.shape[0] > 1,
                                  fill is not None, q_scale is not None, tiles.shape[2], eager, plan.TUNING)
    # one (rows, cols) tile per program and head; the single-block kernel writes its tile whole at the end, the
    # multi-block one adds into it window after window
    partial = scratch((cfg["sets"], heads, cfg["NUM_M"] * cfg["BLOCK_M"], tiles.shape[-1]), torch.float32, q.device,
                      zero=cfg["NUM_M"] > 1)
    # a row per padded token of the padded window grid, each written once (see triton_kernels._padded_slots), and
    # SPARE_PAD_ROWS zero rows, which the kernel writes: no size 0 or 1, where a map divides by the window
    grid_tokens = geo.addr_grid[0] * geo.window[0] * geo.addr_grid[1] * geo.window[1]
    padded_tokens = geo.images * (grid_tokens - geo.feat[0] * geo.feat[1])
    pad_rows = (scratch((2, heads, padded_tokens + SPARE_PAD_ROWS.value, head_dim), dqkv.dtype, q.device)
                if fill is not None else None)
    # one value per program, written by the program: summed here
    dq_scale = scratch((cfg["sets"], heads), torch.float32, q.device) if q_scale is not None else None
    kernel = _launch(window_attn_bwd_kernel, (cfg["sets"] * heads,), q, k, v, s_t, *sq, do, *sdo, dqkv, sd_t, *sdq,
                     tiles, fill if fill is not None else tiles, partial, pad_rows if pad_rows is not None else dqkv,
                     q_scale if q_scale is not None else tiles, dq_scale if dq_scale is not None else partial,
                     *ints, head_dim, heads, scale, **keywords)
    _report(kernel, cfg)
    return _bias_grad(partial, bias, table_window), pad_rows, dq_scale


# eager calls' launches by signature (kernels.ops.LaunchReplay), replayed by later calls of it; False: a signature
# whose calls cannot be replayed
_REPLAYS: dict[tuple, LaunchReplay | bool] = {}


def _signature(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype)


def _replayed(body, inputs: tuple, first: list[int], second: list[int], scale: float) -> tuple:
    """body(*inputs, first, second, scale) (the geometry: window and shift, or window grid and window); an eager
    call on the GPU replays the launches of the first call of its signature (inputs' shapes, strides and dtypes,
    device, geometry, scale, tuning) where it can."""
    if not plan.TUNING.replay or interpreting() or not _eager_launch(inputs[0]):
        return body(*inputs, first, second, scale)
    key = (body, inputs[0].device, *map(_signature, inputs), *first, *second, scale, plan.TUNING)
    replay = _REPLAYS.get(key)
    if replay:
        outputs = replay(inputs)
        if outputs is not None:
            return tuple(outputs)
    elif replay is None:
        with recording_launches() as recording:
            outputs = body(*inputs, first, second, scale)
        _REPLAYS[key] = LaunchReplay.record(recording, inputs, outputs) or False
        return outputs
    return body(*inputs, first, second, scale)


# ---------------------------------------------------------------------------------------------
# the ops' bodies (kernels.flash_window.ops): window layout, q, k, v (B * num_windows, heads, L, head_dim); image
# layout, qkv (B, H, W, 3, heads, head_dim) -> (B, H, W, heads, head_dim)

def _window_geometry(windows: int, area: int, grid: list[int]) -> _Geometry:
    # each window is an image of one 1 x L window (its tokens are contiguous), shifted by nothing
    return _Geometry(windows, (1, area), (1, area), (1, 1), (0, 0), tuple(grid))


def window_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor | None,
                   grid: list[int], window: list[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, the bias tiles for the backward); eager calls replay (_replayed)."""
    return _replayed(_window_forward, (q, k, v, bias, mask), grid, window, scale)


def _window_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor | None,
                    grid: list[int], window: list[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    bw, heads, area, head_dim = q.shape
    tiles = _forward(q, k, v, 0, _window_strides(q), out, _window_strides(out), heads, head_dim, bias, mask, None,
                     _window_geometry(bw, area, grid), tuple(window), scale)
    return out, tiles


def window_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: torch.Tensor,
                    bias: torch.Tensor, grid: list[int], window: list[int], scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv stacked as one (3, *q.shape) tensor, bias gradient); eager calls replay (_replayed)."""
    return _replayed(_window_backward, (grad_out, q, k, v, tiles, bias), grid, window, scale)


def _window_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: torch.Tensor,
                     bias: torch.Tensor, grid: list[int], window: list[int], scale: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v, grad_out = q.contiguous(), k.contiguous(), v.contiguous(), grad_out.contiguous()
    dqkv = q.new_empty((3, *q.shape))
    bw, heads, area, head_dim = q.shape
    dbias, _, _ = _backward(q, k, v, 0, _window_strides(q), grad_out, _window_strides(grad_out), dqkv,
                            dqkv.stride(0), _window_strides(dqkv), heads, head_dim, tiles, bias, None,
                            _window_geometry(bw, area, grid), tuple(window), scale)
    return dqkv, dbias


def _image_geometry(qkv: torch.Tensor, window: list[int], shift: list[int]) -> _Geometry:
    (h, w), (wh, ww) = qkv.shape[1:3], window
    grid = (-(-h // wh), -(-w // ww))
    return _Geometry(qkv.shape[0], tuple(window), (h, w), grid, tuple(shift), grid)


def image_forward(qkv: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor | None, kv_fill: torch.Tensor | None,
                  q_scale: torch.Tensor | None, window: list[int], shift: list[int], scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, the bias tiles for the backward); eager calls replay (_replayed)."""
    return _replayed(_image_forward, (qkv, bias, mask, kv_fill, q_scale), window, shift, scale)


def _image_forward(qkv: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor | None, kv_fill: torch.Tensor | None,
                   q_scale: torch.Tensor | None, window: list[int], shift: list[int], scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    fill = kv_fill.contiguous() if kv_fill is not None else None
    b, h, w, _, heads, hd = qkv.shape
    out = qkv.new_empty((b, h, w, heads, hd))
    # q, k, v are read from the one qkv tensor, qkv.stride(3) elements apart
    tiles = _forward(qkv, qkv, qkv, qkv.stride(3), _image_strides(qkv), out, _image_strides(out), heads, hd,
                     bias, mask, fill, _image_geometry(qkv, window, shift), tuple(window), scale, q_scale)
    return out, tiles


def image_backward(grad_out: torch.Tensor, qkv: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor,
                   kv_fill: torch.Tensor | None, q_scale: torch.Tensor | None, window: list[int], shift: list[int],
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dqkv, bias gradient, fill gradient, cosine-scale gradient; an empty tensor for an absent one); eager
    calls replay (_replayed)."""
    dqkv, dbias, dfill, dq_scale = _replayed(_image_backward, (grad_out, qkv, tiles, bias, kv_fill, q_scale), window,
                                             shift, scale)
    return dqkv, dbias, *_finish_image_grads(dfill, dq_scale, kv_fill, q_scale)


def _finish_image_grads(dfill: torch.Tensor, dq_scale: torch.Tensor, kv_fill: torch.Tensor | None,
                       q_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fill and cosine-scale gradients from what the backward kernel writes (_backward): the padded tokens'
    dk and dv rows summed in fp32, in the fill's dtype; the programs' partial sums summed; empty tensors stay empty.
    Torch ops, so they run after the replayable launches."""
    if kv_fill is not None:
        dfill = dfill.sum(2, dtype=torch.float32).to(kv_fill.dtype)
    if q_scale is not None:
        dq_scale = dq_scale.sum(0).to(q_scale.dtype)
    return dfill, dq_scale


def _image_backward(grad_out: torch.Tensor, qkv: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor,
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
    # ops return tensors only; an empty one stands for "no fill" / "no q_scale"; image_backward finishes the two
    return dqkv, dbias, qkv.new_empty(0) if dfill is None else dfill, qkv.new_empty(0) if dq_scale is None else dq_scale
