"""GELU(x W^T + b) in one Triton kernel: the MLP's fc1 with its activation as the GEMM's epilogue.

In a compiled Swin inference step inductor runs fc1 on cuBLAS and GELU as a separate kernel that reads and writes
the 4C-wide hidden activation once more (about 1.2 ms of a 6.9 ms Swin-T b128 step on an H100; cuBLAS has no exact
erf-GELU epilogue, and max-autotune keeps cuBLAS for these shapes). Here the exact GELU (as ``nn.GELU()``) is applied
to the fp32 accumulator before the one store. Forward only: training keeps fc1's output for the backward anyway
(swin.model recomputes GELU from it), so the block uses this kernel when no gradient is recorded.

The tiling follows the Triton matmul tutorial (grouped program order for L2 reuse of the weight tiles).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .ops import interpreting, kernel_op, launch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supported(x: torch.Tensor) -> bool:
    """Whether linear_gelu takes x: on CUDA (or the CPU under the Triton interpreter), of a supported dtype."""
    return (x.is_cuda or interpreting()) and x.dtype in SUPPORTED_DTYPES


@triton.jit
def linear_gelu_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, sx_m, sx_k, sw_n, sw_k, sy_m, sy_n,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M row blocks take the column blocks in turn, so a weight tile serves several row blocks from L2
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    # the row block's base as a 64-bit scalar, 32-bit offsets within it (fewer registers than 64-bit tiles)
    row0 = (pid_m * BLOCK_M).to(tl.int64)
    x_ptr += row0 * sx_m
    y_ptr += row0 * sy_m
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_m < M - row0
    cols = offs_n < N
    x_tile = x_ptr + offs_m[:, None] * sx_m + offs_k[None, :] * sx_k
    w_tile = w_ptr + offs_n[None, :] * sw_n + offs_k[:, None] * sw_k  # (BLOCK_K, BLOCK_N) of W^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        inside = offs_k < K - k * BLOCK_K
        x = tl.load(x_tile, mask=rows[:, None] & inside[None, :], other=0.0)
        w = tl.load(w_tile, mask=inside[:, None] & cols[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        x_tile += BLOCK_K * sx_k
        w_tile += BLOCK_K * sw_k
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=cols, other=0.0).to(tl.float32)[None, :]
    y = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))  # exact GELU, as nn.GELU()
    y_ptrs = y_ptr + offs_m[:, None] * sy_m + offs_n[None, :] * sy_n
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=rows[:, None] & cols[None, :])


def _config(k: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Tiles for an inner dimension k; SWIN_LG_<NAME> overrides one, for tuning sweeps on the GPU."""
    if device.type != "cuda":  # the interpreter: small tiles keep the tests quick
        cfg = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, GROUP_M=4, num_warps=4, num_stages=1)
    else:
        cfg = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64 if k % 64 == 0 else 32, GROUP_M=8, num_warps=8,
                   num_stages=3 if dtype != torch.float32 else 2)
    cfg = {key: int(os.environ.get(f"SWIN_LG_{key.upper()}", v)) for key, v in cfg.items()}
    # fp32 inputs: three tf32 products per product, about fp32 accuracy on tensor cores
    cfg["PRECISION"] = "tf32x3" if dtype == torch.float32 and device.type == "cuda" else (
        "ieee" if dtype == torch.float32 else "tf32")
    return cfg


@kernel_op("swin::linear_gelu")
def _linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    y = x.new_empty((rows.shape[0], weight.shape[0]))
    m, k = rows.shape
    n = weight.shape[0]
    cfg = _config(k, x.device, x.dtype)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    args = (rows, weight, bias if bias is not None else weight, y, m, n, k, *rows.stride(), *weight.stride(),
            *y.stride())
    launch(linear_gelu_kernel, grid, *args, HAS_BIAS=bias is not None, **cfg)
    return y.view(*x.shape[:-1], n)


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """GELU(F.linear(x, weight, bias)) (exact erf GELU) in one kernel, forward only. Under autocast the inputs are
    cast to the autocast dtype first, as F.linear would; the result has that dtype."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        raise RuntimeError("linear_gelu is forward only; call it without gradients (torch.no_grad / inference_mode)")
    if not supported(x):
        raise ValueError(f"linear_gelu needs a CUDA tensor (got device {x.device}) or TRITON_INTERPRET=1")
    if x.shape[-1] != weight.shape[1] or (bias is not None and bias.shape != weight.shape[:1]):
        raise ValueError(f"linear_gelu: x (..., {x.shape[-1]}) does not fit weight {tuple(weight.shape)}"
                         + ("" if bias is None else f" and bias {tuple(bias.shape)}"))
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"linear_gelu supports float16, bfloat16 and float32, not {dtype}")
    x, weight = x.to(dtype), weight.to(dtype).contiguous()
    bias = bias.to(dtype) if bias is not None else None
    with torch.autocast(x.device.type, enabled=False):
        return _linear_gelu(x.contiguous(), weight, bias)
