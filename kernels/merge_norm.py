"""Residual add, 2x2 patch merging and LayerNorm in one pass: the start of every Swin v1 stage after the first.

Unfused, the last block of a stage writes x + mlp(...) and the next stage's patch merging reads it back in a
permuted (2x2-neighbourhood) order to normalise it; under torch.compile the sum and the permuted copy run as
stand-alone kernels, far slower than the bytes they move. Here each program reads its merged pixels' four
neighbours from x and from the last MLP's output once, adds them, normalises the 4C channels and writes the
LayerNorm's output, ready for the reduction.

Channel order as timm's PatchMerging: (x0, x1, x2, x3) = neighbours (0, 0), (1, 0), (0, 1), (1, 1) in (row, column),
so quadrant q = 2 * column offset + row offset. Odd sizes are padded with zeros after the sum, as timm pads.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.ops import cdiv, interpreting, kernel_op, launch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _neighbour(x_ptr, d_ptr, b, oh, ow, cols, rows_ok, cols_ok, H, W, sxb, sxh, sxw, sdb, sdh, sdw,
               DH: tl.constexpr, DW: tl.constexpr, ROUND_SUM: tl.constexpr):
    """(rows, BLOCK_C) fp32 tile of x + delta at pixel (2 oh + DH, 2 ow + DW); 0 where that pixel is padding."""
    h = 2 * oh + DH
    w = 2 * ow + DW
    ok = (rows_ok & (h < H) & (w < W))[:, None] & cols_ok[None, :]
    x = tl.load(x_ptr + (b * sxb + h * sxh + w * sxw)[:, None] + cols[None, :], mask=ok, other=0.0)
    d = tl.load(d_ptr + (b * sdb + h * sdh + w * sdw)[:, None] + cols[None, :], mask=ok, other=0.0)
    s = x.to(tl.float32) + d.to(tl.float32)
    if ROUND_SUM:  # x and delta of one half dtype: PyTorch's sum is rounded to it before the norm
        s = s.to(x_ptr.dtype.element_ty).to(tl.float32)
    return s


@triton.jit
def _store(out_ptr, w_ptr, b_ptr, s, mean, rstd, rows, cols, rows_ok, cols_ok, Q: tl.constexpr, C: tl.constexpr):
    """Normalised quadrant Q of the merged rows: channels Q * C + cols of each 4C output row."""
    ch = Q * C + cols
    weight = tl.load(w_ptr + ch, mask=cols_ok, other=0.0).to(tl.float32)
    bias = tl.load(b_ptr + ch, mask=cols_ok, other=0.0).to(tl.float32)
    y = (s - mean[:, None]) * rstd[:, None] * weight[None, :] + bias[None, :]
    ok = rows_ok[:, None] & cols_ok[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * (4 * C) + ch[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def merge_norm_kernel(x_ptr, d_ptr, w_ptr, b_ptr, out_ptr, n_rows, H, W, OH, OW, eps,
                      sxb, sxh, sxw, sdb, sdh, sdw,
                      C: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, ROUND_SUM: tl.constexpr):
    """One program: BLOCK_R merged pixels (rows of the (B * OH * OW, 4C) output), all 4C channels."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    rows_ok = rows < n_rows
    cols_ok = cols < C
    ow = rows % OW
    t = rows // OW
    oh = t % OH
    b = (t // OH).to(tl.int64)
    s0 = _neighbour(x_ptr, d_ptr, b, oh, ow, cols, rows_ok, cols_ok, H, W, sxb, sxh, sxw, sdb, sdh, sdw,
                    0, 0, ROUND_SUM)
    s1 = _neighbour(x_ptr, d_ptr, b, oh, ow, cols, rows_ok, cols_ok, H, W, sxb, sxh, sxw, sdb, sdh, sdw,
                    1, 0, ROUND_SUM)
    s2 = _neighbour(x_ptr, d_ptr, b, oh, ow, cols, rows_ok, cols_ok, H, W, sxb, sxh, sxw, sdb, sdh, sdw,
                    0, 1, ROUND_SUM)
    s3 = _neighbour(x_ptr, d_ptr, b, oh, ow, cols, rows_ok, cols_ok, H, W, sxb, sxh, sxw, sdb, sdh, sdw,
                    1, 1, ROUND_SUM)
    # one reduction per statistic: the quadrants are summed element-wise first
    mean = tl.sum(s0 + s1 + s2 + s3, 1) / (4 * C)
    # two-pass variance over the tiles on chip; padded channels (cols >= C) are masked out of it
    c0 = tl.where(cols_ok[None, :], s0 - mean[:, None], 0.0)
    c1 = tl.where(cols_ok[None, :], s1 - mean[:, None], 0.0)
    c2 = tl.where(cols_ok[None, :], s2 - mean[:, None], 0.0)
    c3 = tl.where(cols_ok[None, :], s3 - mean[:, None], 0.0)
    var = tl.sum(c0 * c0 + c1 * c1 + c2 * c2 + c3 * c3, 1) / (4 * C)
    rstd = 1.0 / tl.sqrt(var + eps)
    _store(out_ptr, w_ptr, b_ptr, s0, mean, rstd, rows, cols, rows_ok, cols_ok, 0, C)
    _store(out_ptr, w_ptr, b_ptr, s1, mean, rstd, rows, cols, rows_ok, cols_ok, 1, C)
    _store(out_ptr, w_ptr, b_ptr, s2, mean, rstd, rows, cols, rows_ok, cols_ok, 2, C)
    _store(out_ptr, w_ptr, b_ptr, s3, mean, rstd, rows, cols, rows_ok, cols_ok, 3, C)


@functools.cache
def _launch_config(channels: int) -> dict:
    block_c = triton.next_power_of_2(channels)
    # four (rows, BLOCK_C) fp32 tiles live at once: 2048 elements each, 16 values per thread and tile with 4 warps,
    # which keeps the op near its bandwidth floor (larger tiles with a reduction per quadrant are slower)
    return dict(BLOCK_C=block_c, BLOCK_R=max(1, 2048 // block_c), num_warps=4)


def _merge_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                out_dtype: torch.dtype) -> torch.Tensor:
    b, h, w, c = x.shape
    oh, ow = (h + 1) // 2, (w + 1) // 2
    out = x.new_empty((b, oh, ow, 4 * c), dtype=out_dtype)
    cfg = _launch_config(c) if isinstance(c, int) else _launch_config.__wrapped__(c)  # traced: maybe symbolic
    rows = b * oh * ow
    round_sum = x.dtype == delta.dtype and x.dtype != torch.float32
    launch(merge_norm_kernel, (cdiv(rows, cfg["BLOCK_R"]),), x, delta, weight, bias, out, rows, h, w, oh, ow,
           eps, *x.stride()[:3], *delta.stride()[:3], C=c, ROUND_SUM=round_sum, **cfg)
    return out


# torch.compile traces into this op and inlines the launch; eager calls run _merge_norm without the op's dispatch
_merge_norm_op = kernel_op("swin::merge_norm")(_merge_norm)


def merge_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``layer_norm(merge2x2(pad(x + delta)), (4C,), weight, bias, eps)`` in one kernel, without gradients.

    x, delta: (B, H, W, C), the residual stream and a stage's last residual branch (its last MLP's output), not yet
    added. weight, bias: (4C,). Returns (B, ceil(H/2), ceil(W/2), 4C) in out_dtype (default: the dtype of x + delta;
    under autocast the caller passes the autocast dtype its next Linear would cast the norm's fp32 output to).
    Statistics and the affine map in fp32, as PyTorch's LayerNorm kernels compute them.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, delta, weight, bias)):
        raise ValueError("merge_norm has no backward: call it without gradients (torch.no_grad, inference)")
    if x.dim() != 4 or delta.shape != x.shape:
        raise ValueError(f"merge_norm needs x and delta of one (B, H, W, C) shape, got {tuple(x.shape)} and "
                         f"{tuple(delta.shape)}")
    c = x.shape[-1]
    if weight.shape != (4 * c,) or bias.shape != (4 * c,):
        raise ValueError(f"merge_norm needs a LayerNorm weight and bias of shape ({4 * c},), got "
                         f"{tuple(weight.shape)} and {tuple(bias.shape)}")
    if not (x.is_cuda or interpreting()):
        raise ValueError(f"merge_norm needs CUDA tensors (got device {x.device}), or TRITON_INTERPRET=1 on the CPU")
    if any(t.dtype not in SUPPORTED_DTYPES for t in (x, delta, weight, bias)):
        raise ValueError(f"merge_norm supports float16, bfloat16 and float32, got {x.dtype}, {delta.dtype}, "
                         f"{weight.dtype}, {bias.dtype}")
    if any(t.device != x.device for t in (delta, weight, bias)):
        raise ValueError(f"merge_norm needs every tensor on the device of x ({x.device})")
    out_dtype = torch.promote_types(x.dtype, delta.dtype) if out_dtype is None else out_dtype
    x, delta = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, delta))
    op = _merge_norm_op if torch.compiler.is_compiling() else _merge_norm
    return op(x, delta, weight.contiguous(), bias.contiguous(), float(eps), out_dtype)
