"""Window-attention backends. The one place where a backend is chosen.

Every backend is a function with the same signature::

    backend(qkv, args) -> out

* ``qkv``: (B, H, W, 3, heads, head_dim), the qkv projection of the block's feature map in image
  layout (unshifted, unpadded);
* ``args``: a :class:`WindowAttentionArgs` with the window geometry and parameters;
* ``out``: (B, H, W, heads, head_dim), softmax(scale q k^T + bias + mask) v for each shifted window,
  put back in image layout (the block then applies the output projection).

Taking image layout lets a backend fold shift, padding and partition into its own addressing
(``flash_window``) while the reference backends do them with explicit tensor ops. Swin V2's scaled cosine
attention reaches the backends as the raw projection with ``args.cosine_scale`` set (exp of the clamped logit
scale per head), scale 1 and the continuous position bias as the table (``CosineWindowAttention``):
each backend normalises q and k and multiplies q by the scale, the flash kernel on chip.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from swin.models.windows import WindowSpec, merge_unpad_unshift, shift_pad_partition


class WindowAttentionArgs(NamedTuple):
    spec: WindowSpec
    scale: float
    bias_table: torch.Tensor              # ((2Wh-1)(2Ww-1), heads) relative position bias table
    rel_index: torch.Tensor               # (L, L) long, index into bias_table
    attn_mask: torch.Tensor | None        # (num_windows, L, L) 0 / -100, None when unshifted
    qkv_bias: torch.Tensor | None         # (3, heads, head_dim): q, k, v at padded positions
    cosine_scale: torch.Tensor | None = None  # (heads,): scaled cosine attention (Swin V2), else None


Backend = Callable[[torch.Tensor, WindowAttentionArgs], torch.Tensor]


def relative_position_bias(args: WindowAttentionArgs) -> torch.Tensor:
    """(heads, L, L) bias gathered from the table."""
    n = args.rel_index.shape[0]
    return args.bias_table[args.rel_index.reshape(-1)].reshape(n, n, -1).permute(2, 0, 1)


def _windows_qkv(qkv: torch.Tensor, args: WindowAttentionArgs) -> tuple[torch.Tensor, ...]:
    """Shift, pad and partition qkv; returns q, k, v of shape (B * num_windows, heads, L, head_dim)."""
    windows = shift_pad_partition(qkv, args.spec, args.qkv_bias)  # (BW, L, 3, heads, hd)
    q, k, v = windows.permute(2, 0, 3, 1, 4).unbind(0)
    if args.cosine_scale is not None:
        q, k = cosine_qk(q, k, args.cosine_scale.view(-1, 1, 1))
    return q, k, v


def cosine_qk(q: torch.Tensor, k: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Swin V2's scaled cosine attention as plain dot-product attention of scale 1: q and k at unit length, q times
    scale (broadcast over q). Returned in the inputs' dtype: under autocast the normalisation runs in fp32, and a
    fp32 result would make the attention itself fp32."""
    return (F.normalize(q, dim=-1) * scale).to(q.dtype), F.normalize(k, dim=-1).to(k.dtype)


def _windows_to_image(out: torch.Tensor, args: WindowAttentionArgs) -> torch.Tensor:
    """(B * num_windows, heads, L, head_dim) -> (B, H, W, heads, head_dim)."""
    return merge_unpad_unshift(out.transpose(1, 2), args.spec)


def standard_attention(qkv: torch.Tensor, args: WindowAttentionArgs) -> torch.Tensor:
    """Explicit math as in official Swin: (scale q) k^T + bias (+ mask), softmax, @ v."""
    q, k, v = _windows_qkv(qkv, args)
    heads, n = q.shape[1], q.shape[2]
    attn = (q * args.scale) @ k.transpose(-2, -1)
    attn = attn + relative_position_bias(args).unsqueeze(0)
    if args.attn_mask is not None:
        num_windows = args.attn_mask.shape[0]
        attn = attn.view(-1, num_windows, heads, n, n) + args.attn_mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, heads, n, n)
    attn = attn.softmax(dim=-1)
    return _windows_to_image(attn @ v, args)


def sdpa_attention(qkv: torch.Tensor, args: WindowAttentionArgs) -> torch.Tensor:
    """torch scaled_dot_product_attention with bias and mask combined into one additive tensor.

    Windows of one image are folded into the head axis, so the combined (num_windows * heads, L, L)
    mask broadcasts over the batch instead of being materialised per image as timm does.
    """
    q, k, v = _windows_qkv(qkv, args)
    bw, heads, n, hd = q.shape
    num_windows = args.spec.num_windows
    bias = relative_position_bias(args).unsqueeze(0)  # 1, heads, L, L
    if args.attn_mask is not None:
        bias = bias + args.attn_mask.unsqueeze(1)  # num_windows, heads, L, L
    else:
        bias = bias.expand(num_windows, -1, -1, -1)
    bias = bias.reshape(1, num_windows * heads, n, n).to(q.dtype)

    def fold(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(bw // num_windows, num_windows * heads, n, hd)

    out = F.scaled_dot_product_attention(fold(q), fold(k), fold(v), attn_mask=bias, scale=args.scale)
    return _windows_to_image(out.reshape(bw, heads, n, hd), args)


def flash_window_attention(qkv: torch.Tensor, args: WindowAttentionArgs) -> torch.Tensor:
    """The Triton flash window attention kernel (kernels/), shift and partition folded in. It takes the bias table
    itself and gathers it with timm's relative index (the one swin.models.windows.relative_position_index builds),
    and reads only the four windows of the shifted-window mask that stand for all the others."""
    from kernels.flash_window import flash_window_attention_image
    spec = args.spec
    return flash_window_attention_image(qkv, args.bias_table, args.attn_mask, args.qkv_bias, spec.window_size,
                                        spec.shift_size, args.scale, args.cosine_scale)


def check_flash_window(window_size: tuple[int, int], head_dim: int) -> None:
    """ValueError, naming the fix, where the flash_window kernel cannot take windows of window_size with heads of
    head_dim channels (a model is checked when it is built, not at its first forward)."""
    from kernels.flash_window import unsupported_geometry
    reason = unsupported_geometry(window_size[0] * window_size[1], head_dim)
    if reason is not None:
        raise ValueError(f"attention flash_window cannot run this model's {window_size[0]}x{window_size[1]} windows "
                         f"of head_dim {head_dim}: {reason}; use attention auto (sdpa where flash_window cannot "
                         "run) or sdpa (model.attention=auto on the command line)")


_auto_warned: set[str] = set()


def auto_attention(qkv: torch.Tensor, args: WindowAttentionArgs) -> torch.Tensor:
    """flash_window on CUDA where the kernel supports the shape, else sdpa (warning once why)."""
    if qkv.is_cuda:
        from kernels.flash_window import unsupported_reason
        reason = unsupported_reason(qkv, args.spec.window_area, qkv.shape[-1])
        if reason is None:
            return flash_window_attention(qkv, args)
        if reason not in _auto_warned:
            _auto_warned.add(reason)
            warnings.warn(f"attention='auto': using sdpa instead of flash_window: {reason}", stacklevel=2)
    return sdpa_attention(qkv, args)


BACKENDS: dict[str, Backend] = {
    "standard": standard_attention,
    "sdpa": sdpa_attention,
    "flash_window": flash_window_attention,
    "auto": auto_attention,
}


def get_backend(name: str) -> Backend:
    """The backend function for `name`, with a clear error for unknown names."""
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {sorted(BACKENDS)}") from None


def check_backend(name: str, device: torch.device | str) -> None:
    """ValueError, naming the fix, for a backend that is unknown or cannot run on ``device`` (flash_window needs
    CUDA: its Triton kernel does not run on the CPU)."""
    get_backend(name)
    device = torch.device(device)
    if name == "flash_window" and device.type != "cuda":
        raise ValueError(f"model.attention=flash_window needs a CUDA GPU (its Triton kernel does not run on the "
                         f"{device.type}); use model.attention=auto (flash_window on GPUs, sdpa elsewhere) or "
                         "model.attention=sdpa")
