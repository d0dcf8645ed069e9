"""The flash window attention ops: PyTorch ops for torch.compile, autograd functions for eager calls.

Under torch.compile the calls go through ``torch.library.triton_op`` ops (``swin::flash_window_attn*``) with their
autograd registered: inductor traces into their bodies and inlines the kernel launches, so a compiled step never
calls back into this Python. Under the Triton interpreter (CPU) they are opaque custom ops instead
(``kernels.ops.kernel_op``). Eager calls skip that dispatch, which a compiled graph needs and an eager call does
not: :func:`image_attention` and :func:`window_attention` run the same bodies (kernels.flash_window.launch) through
a ``torch.autograd.Function`` when a gradient is wanted, and directly when not.
"""
from __future__ import annotations

import contextlib

import torch

from kernels.flash_window.launch import image_backward, image_forward, window_backward, window_forward
from kernels.ops import kernel_op


# --- torch.compile: triton_ops with autograd ------------------------------------------------------------------------
@kernel_op("swin::flash_window_attn")
def _window_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor | None,
               grid: list[int], window: list[int], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, the bias tiles for the backward)."""
    return window_forward(q, k, v, bias, mask, grid, window, scale)


@kernel_op("swin::flash_window_attn_bwd")
def _window_op_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: torch.Tensor,
                   bias: torch.Tensor, grid: list[int], window: list[int], scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv stacked as one (3, *q.shape) tensor, bias gradient)."""
    return window_backward(grad_out, q, k, v, tiles, bias, grid, window, scale)


def _window_setup(ctx, inputs, output):
    q, k, v, bias, mask, grid, window, scale = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(q, k, v, output[1], bias)
    ctx.geometry = (grid, window, scale)


def _window_input_grads(dqkv: torch.Tensor, dbias: torch.Tensor) -> tuple:
    """The window op's backward results as the gradients of its inputs (q, k, v, bias, mask, grid, window, scale)."""
    dq, dk, dv = dqkv.unbind(0)
    return dq, dk, dv, dbias, None, None, None, None


def _window_grad(ctx, grad_out, _grad_tiles):
    q, k, v, tiles, bias = ctx.saved_tensors
    return _window_input_grads(*_window_op_bwd(grad_out, q, k, v, tiles, bias, *ctx.geometry))


_window_op.register_autograd(_window_grad, setup_context=_window_setup)


@kernel_op("swin::flash_window_attn_image")
def _image_op(qkv: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor | None, kv_fill: torch.Tensor | None,
              q_scale: torch.Tensor | None, window: list[int], shift: list[int], scale: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, the bias tiles for the backward)."""
    return image_forward(qkv, bias, mask, kv_fill, q_scale, window, shift, scale)


@kernel_op("swin::flash_window_attn_image_bwd")
def _image_op_bwd(grad_out: torch.Tensor, qkv: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor,
                  kv_fill: torch.Tensor | None, q_scale: torch.Tensor | None, window: list[int], shift: list[int],
                  scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dqkv, bias gradient, fill gradient, cosine-scale gradient); an empty tensor for an absent one."""
    return image_backward(grad_out, qkv, tiles, bias, kv_fill, q_scale, window, shift, scale)


def _image_setup(ctx, inputs, output):
    qkv, bias, mask, kv_fill, q_scale, window, shift, scale = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(qkv, output[1], bias, kv_fill, q_scale)
    ctx.geometry = (window, shift, scale)


def _image_input_grads(grads: tuple[torch.Tensor, ...], kv_fill: torch.Tensor | None,
                       q_scale: torch.Tensor | None) -> tuple:
    """The image op's backward results (dqkv, dbias, dfill, dq_scale) as the gradients of its inputs (qkv, bias,
    mask, kv_fill, q_scale, window, shift, scale): None for an absent fill or cosine scale."""
    dqkv, dbias, dfill, dq_scale = grads
    return (dqkv, dbias, None, dfill if kv_fill is not None else None, dq_scale if q_scale is not None else None,
            None, None, None)


def _image_grad(ctx, grad_out, _grad_tiles):
    qkv, tiles, bias, kv_fill, q_scale = ctx.saved_tensors
    grads = _image_op_bwd(grad_out, qkv, tiles, bias, kv_fill, q_scale, *ctx.geometry)
    return _image_input_grads(grads, kv_fill, q_scale)


_image_op.register_autograd(_image_grad, setup_context=_image_setup)


# --- eager calls: autograd functions over the same bodies -----------------------------------------------------------
def _named(op: str) -> contextlib.AbstractContextManager:
    """A profiler range named as the op (swin::...), so that profiles of eager calls attribute their time to it as
    they do for the op; nothing when no profiler runs."""
    return torch.profiler.record_function(op) if torch._C._autograd._profiler_enabled() else contextlib.nullcontext()


class _WindowAttention(torch.autograd.Function):
    """The window op's forward and backward bodies without its dispatch. Unlike the op it returns the output alone
    and keeps the bias tiles on the context: a second, non-differentiable output costs autograd a zero gradient
    and its bookkeeping on every call. The context is set up in forward itself: a separate setup_context makes
    some torch versions bind the arguments to forward's signature (inspect.signature) on every call."""

    @staticmethod
    def forward(ctx, q, k, v, bias, mask, grid, window, scale):
        out, ctx.tiles = window_forward(q, k, v, bias, mask, grid, window, scale)
        ctx.save_for_backward(q, k, v, bias)
        ctx.geometry = (grid, window, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, bias = ctx.saved_tensors
        with _named("swin::flash_window_attn_bwd"):
            return _window_input_grads(*window_backward(grad_out, q, k, v, ctx.tiles, bias, *ctx.geometry))


class _ImageAttention(torch.autograd.Function):
    """As _WindowAttention, for the image op."""

    @staticmethod
    def forward(ctx, qkv, bias, mask, kv_fill, q_scale, window, shift, scale):
        out, ctx.tiles = image_forward(qkv, bias, mask, kv_fill, q_scale, window, shift, scale)
        ctx.save_for_backward(qkv, bias, kv_fill, q_scale)
        ctx.geometry = (window, shift, scale)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qkv, bias, kv_fill, q_scale = ctx.saved_tensors
        with _named("swin::flash_window_attn_image_bwd"):
            grads = image_backward(grad_out, qkv, ctx.tiles, bias, kv_fill, q_scale, *ctx.geometry)
        return _image_input_grads(grads, kv_fill, q_scale)


def _wants_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor | None,
                     grid: list[int], window: list[int], scale: float) -> torch.Tensor:
    """The window-layout op on checked inputs (kernels.flash_window.api): the triton_op under torch.compile, else the
    eager path."""
    if torch.compiler.is_compiling():
        return _window_op(q, k, v, bias, mask, grid, window, scale)[0]
    with _named("swin::flash_window_attn"):
        if _wants_grad(q, k, v, bias):
            return _WindowAttention.apply(q, k, v, bias, mask, grid, window, scale)
        return window_forward(q, k, v, bias, mask, grid, window, scale)[0]


def image_attention(qkv: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor | None, kv_fill: torch.Tensor | None,
                    q_scale: torch.Tensor | None, window: list[int], shift: list[int], scale: float) -> torch.Tensor:
    """The image-layout op on checked inputs (kernels.flash_window.api): the triton_op under torch.compile, else the
    eager path."""
    if torch.compiler.is_compiling():
        return _image_op(qkv, bias, mask, kv_fill, q_scale, window, shift, scale)[0]
    with _named("swin::flash_window_attn_image"):
        if _wants_grad(qkv, bias, kv_fill, q_scale):
            return _ImageAttention.apply(qkv, bias, mask, kv_fill, q_scale, window, shift, scale)
        return image_forward(qkv, bias, mask, kv_fill, q_scale, window, shift, scale)[0]
