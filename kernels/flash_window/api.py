"""Flash window attention: the public functions and their input checks.

* :func:`flash_window_attention` (window layout): q, k, v of shape (B * num_windows, heads, L, head_dim), the
  windows of each image in row-major order over a grid_size window grid (what timm's window_partition produces);
* :func:`flash_window_attention_image` (image layout, what the model calls): reads q, k, v straight from the qkv
  projection output (B, H, W, 3, heads, head_dim) and writes (B, H, W, heads, head_dim); cyclic shift, padding
  and window partition/reverse are index arithmetic in the kernel. With ``cosine_scale`` (Swin V2) the kernels
  normalise q and k themselves, so the raw projection goes in and its gradient comes out.

Both take plain tensors and sizes (the window geometry and the mask are the model's, ``swin.models.windows``):
``bias`` is Swin's ((2wh-1)(2ww-1), heads) relative position table (differentiable; gathered in a kernel with
timm's relative index) or a dense (heads, L, L) additive bias, ``mask`` None or the (num_windows, L, L) additive
shifted-window mask of an image's window grid (timm's ``attn_mask``), of which the kernels read four windows:
Swin's mask depends on nothing but whether a window lies in the last row and/or column of the grid.

Every call is checked (ValueError naming the problem); the launch parameters come from cached plans
(kernels.flash_window.plan) and the calls from kernels.flash_window.ops.
"""
from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from kernels.flash_window.ops import image_attention, window_attention
from kernels.ops import interpreting as _interpreting

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
    return unsupported_geometry(window_area, head_dim)


def unsupported_geometry(window_area: int, head_dim: int) -> str | None:
    """Why the kernel cannot take windows of window_area tokens with heads of head_dim channels (None if it can),
    whatever the device and dtype."""
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
    return window_attention(q, k, v, bias, mask, list(grid_size), window, scale)


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
    # symbolic sizes (torch.compile, dynamic shapes) count as padded unless known to divide: no guard, one graph
    padded = not (statically_known_true(h % window_size[0] == 0) and statically_known_true(w % window_size[1] == 0))
    fill = qkv_bias[1:].to(qkv.dtype) if (qkv_bias is not None and padded) else None
    if cosine_scale is not None:
        if cosine_scale.numel() != heads:
            raise ValueError(f"cosine_scale must hold one value per head ({heads}), got {tuple(cosine_scale.shape)}")
        if cosine_scale.device != qkv.device:
            raise ValueError(f"cosine_scale must be on the device of qkv ({qkv.device}), got {cosine_scale.device}")
        cosine_scale = cosine_scale.reshape(heads).float()
    return image_attention(qkv, bias, mask, fill, cosine_scale, list(window_size), [int(s) for s in shift_size],
                           float(scale))
