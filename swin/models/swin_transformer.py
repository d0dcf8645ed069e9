"""Swin Transformer v1 (Liu et al., 2021) and V2 (Liu et al., 2022) with a switchable window-attention backend.

Parameter names, initialisation and numerics follow timm's ``swin_transformer.py`` (v1) and
``swin_transformer_v2.py`` (V2) so that a timm state_dict loads with ``strict=True`` and gives the same logits.
Features are NHWC inside. V2 differs from v1 in three places only: its attention module (scaled cosine
attention, continuous position bias; :class:`CosineWindowAttention`), residual post-norm in the blocks, and
patch merging that normalises after the reduction.
"""
from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import ClassifierHead, DropPath, Mlp, PatchEmbed, resize_rel_pos_bias_table, to_2tuple, trunc_normal_
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils.checkpoint import checkpoint

from kernels.merge_norm import merge_norm
from swin.models.attention import WindowAttentionArgs, check_flash_window, get_backend
from swin.models.windows import (
    WindowSpec,
    clamp_window_and_shift,
    log_spaced_relative_coords,
    relative_position_index,
    shifted_window_mask,
    stage_windows,
)

VERSIONS = (1, 2)
MAX_LOGIT_SCALE = math.log(100.0)  # Swin V2 clamps the learnt logit scale at 100 (temperature 0.01)
# Devices whose torch._addmm_activation is a GEMM with its GELU epilogue (cuBLASLt); tests add "cpu", where the op
# is addmm then exact GELU, to run fc1_gelu_epilogue's and mlp_with_gelu_epilogue's logic without a GPU.
EPILOGUE_DEVICES: tuple[str, ...] = ("cuda",)
HALF_DTYPES = (torch.float16, torch.bfloat16)
AUTOCAST_CASTABLE = (torch.float32, *HALF_DTYPES)  # what autocast casts for F.linear (it leaves float64)
# Devices where the stages' merges run as one kernel with the preceding residual add (fused_merge_norm); tests add
# "cpu", where the kernel runs in the Triton interpreter (TRITON_INTERPRET=1).
MERGE_NORM_DEVICES: tuple[str, ...] = ("cuda",)


def _half_operands(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The tensors cast as autocast casts F.linear's arguments (as given without autocast), or None unless they then
    share one half dtype: the precision in which cuBLASLt's tanh-GELU epilogue is as accurate as the unfused path.

    Why: ``torch._addmm_activation`` is not on autocast's cast list. (is_autocast_enabled and get_autocast_dtype are
    constants to dynamo: no graph break.)"""
    device = tensors[0].device.type
    if torch.is_autocast_enabled(device):
        if not all(t.dtype in AUTOCAST_CASTABLE for t in tensors):
            return None
        dtype = torch.get_autocast_dtype(device)
        tensors = tuple(t.to(dtype) for t in tensors)
    elif len({t.dtype for t in tensors}) != 1:
        return None  # F.linear refuses mixed dtypes: let it say so
    return tensors if tensors[0].dtype in HALF_DTYPES else None  # float32 keeps the exact erf GELU


def _plain_gelu_tail(mlp: nn.Module) -> bool:
    """Whether timm Mlp's layers after fc1 are exactly ``fc2(GELU(.))``: nn.GELU, a plain nn.Linear fc2 (not FP8),
    and drop1 and norm that do nothing."""
    drop1_is_identity = isinstance(mlp.drop1, nn.Identity) or (isinstance(mlp.drop1, nn.Dropout) and not mlp.drop1.p)
    return (isinstance(mlp.act, nn.GELU) and type(mlp.fc2) is nn.Linear and drop1_is_identity
            and isinstance(mlp.norm, nn.Identity))


def fc1_gelu_epilogue(x: torch.Tensor, fc1: nn.Linear, act: nn.Module) -> torch.Tensor | None:
    """act(fc1(x)) as one GEMM with cuBLASLt's GELU epilogue (``torch._addmm_activation``), or None where that would
    not compute what fc1 followed by ``act`` computes (the caller then runs them unfused).

    Why: unfused, a compiled inference step runs fc1 as a GEMM and GELU as a stand-alone kernel that reads and writes
    the 4C-wide hidden activation once more; the epilogue applies GELU to the GEMM's fp32 accumulator before its one
    rounding. cuBLASLt's GELU is the tanh approximation (within 4.7e-4 of the exact erf GELU), below half precision's
    rounding of the output: against float64 exact GELU(fc1(x)) the epilogue's error is that of the unfused half
    path. So it runs only where the output is rounded to half precision anyway: on CUDA, in float16/bfloat16
    (autocast, or half inputs and weights), without gradients (the op has no backward: compiled training steps
    take :func:`mlp_with_gelu_epilogue`), for ``nn.GELU`` after a biased fc1 (the epilogue adds the bias).
    Elsewhere (CPU, float32, eager training) fc1 and the exact GELU run as written.
    """
    if (torch.is_grad_enabled() or x.device.type not in EPILOGUE_DEVICES or fc1.bias is None
            or type(fc1) is not nn.Linear  # e.g. FP8 (train.amp=fp8): its own forward computes something else
            or not isinstance(act, nn.GELU) or act.approximate not in ("none", "tanh")):
        return None
    operands = _half_operands(x, fc1.weight, fc1.bias)
    if operands is None:
        return None
    x, weight, bias = operands
    y = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class _NormalizeForLinear(torch.autograd.Function):
    """``layer_norm(x)`` without scale or shift, returned in ``dtype`` (the Linear's compute dtype), keeping that
    output and the inverse standard deviations for the backward instead of x.

    Why: the Linear after it keeps the same rounded output for its weight gradient, so the backward needs nothing
    else, where autograd's LayerNorm keeps x as well: under bf16 autocast x is the float32 residual stream, twice the
    bytes. The backward, ``rstd (g - mean(g) - xhat mean(g xhat))``, runs in float32 on the rounded xhat; in float32
    and float64 it is LayerNorm's own gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, normalized_shape: tuple[int, ...], eps: float,
                dtype: torch.dtype) -> torch.Tensor:
        xhat, _, rstd = torch.native_layer_norm(x, normalized_shape, None, None, eps)
        xhat = xhat.to(dtype)
        ctx.save_for_backward(xhat, rstd)
        ctx.x_dtype, ctx.dims = x.dtype, tuple(range(-len(normalized_shape), 0))
        return xhat

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        xhat, rstd = ctx.saved_tensors
        compute = torch.promote_types(ctx.x_dtype, torch.float32)
        xhat, grad = xhat.to(compute), grad.to(compute)
        mean_grad = grad.mean(ctx.dims, keepdim=True)
        mean_grad_xhat = (grad * xhat).mean(ctx.dims, keepdim=True)
        grad_x = (grad - mean_grad - xhat * mean_grad_xhat) * rstd
        return grad_x.to(ctx.x_dtype), None, None, None


def norm_linear(x: torch.Tensor, norm: nn.LayerNorm, linear: nn.Linear, fold_affine: bool = True) -> torch.Tensor:
    """``linear(norm(x))`` for x (..., C). With ``fold_affine``, in a training graph under torch.compile, the
    norm's scale g and shift b move into the Linear: ``linear(xhat * g + b) = xhat (W g)^T + (W b + bias)``, xhat
    the plain normalised x.

    Why: the backward then gets g's and b's gradients from the Linear's (parameter-sized sums over W's rows)
    instead of summing over every token, the column sums that cost a compiled LayerNorm backward extra passes.
    Same parameters and state_dict; equal to the unfolded form up to float rounding. Unfolded in eager mode (each
    extra small op costs the host a launch, and fp32 weights would keep a scaled copy for the backward), without
    gradients, for a norm without affine parameters, and for a Linear that is not a plain ``nn.Linear`` (FP8
    layers compute their own forward)."""
    if not _folds(norm, linear, fold_affine):
        return linear(norm(x))
    return F.linear(*_folded_operands(x, norm, linear))


def norm_linear_operands(x: torch.Tensor, norm: nn.LayerNorm, linear: nn.Linear, fold_affine: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(input, weight, bias) with ``F.linear(input, weight, bias)`` equal to :func:`norm_linear` for a plain
    ``nn.Linear``: the normalised x and the folded weight and bias where it folds, else ``norm(x)`` and the Linear's
    own."""
    if not _folds(norm, linear, fold_affine):
        return norm(x), linear.weight, linear.bias
    return _folded_operands(x, norm, linear)


def _folds(norm: nn.Module, linear: nn.Module, fold_affine: bool) -> bool:
    return (fold_affine and torch.compiler.is_compiling() and torch.is_grad_enabled() and type(linear) is nn.Linear
            and type(norm) is nn.LayerNorm and norm.weight is not None and norm.bias is not None)


def _folded_operands(x: torch.Tensor, norm: nn.LayerNorm, linear: nn.Linear
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    dtype = x.dtype  # the dtype F.linear computes in: autocast's for float32 and half x
    if torch.is_autocast_enabled(x.device.type) and x.dtype in AUTOCAST_CASTABLE:
        dtype = torch.get_autocast_dtype(x.device.type)
    # keep the narrower rounded output for the backward, not x; at equal widths nothing is saved by it (and on torch
    # 2.11's CUDA inductor, float32, the function returning its own layer_norm output lost the gradient upstream)
    if dtype.itemsize < x.dtype.itemsize:
        xhat = _NormalizeForLinear.apply(x, tuple(norm.normalized_shape), norm.eps, dtype)
    else:
        xhat = F.layer_norm(x, norm.normalized_shape, None, None, norm.eps)
    weight = linear.weight * norm.weight
    bias = (linear.weight * norm.bias).sum(1)  # W b: elementwise and a row sum, in the parameters' dtype
    if linear.bias is not None:
        bias = bias + linear.bias
    return xhat, weight, bias


class _GeluEpilogueMlp(torch.autograd.Function):
    """``fc2(GELU(fc1(x)))`` on 2-D operands of one dtype, fc1 and GELU as one GEMM with cuBLASLt's GELU epilogue
    (``torch._addmm_activation``), keeping only x and the weights: the backward recomputes fc1's output, from which
    it gets GELU's derivative and output (fc2's weight gradient).

    Why: the forward writes no fc1 output and runs no GELU pass (one 4C-wide write instead of three), and no 4C-wide
    activation is kept for the backward; recomputing fc1 costs one GEMM there. The epilogue's GELU is the tanh
    approximation on CUDA (exact on the CPU, where the op is addmm then GELU); the backward differentiates that."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                b2: torch.Tensor) -> torch.Tensor:
        hidden = torch._addmm_activation(b1, x, w1.t(), use_gelu=True)
        ctx.save_for_backward(x, w1, b1, w2)
        return torch.addmm(b2, hidden, w2.t())

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, w1, b1, w2 = ctx.saved_tensors
        approximate = "tanh" if x.device.type == "cuda" else "none"  # the GELU _addmm_activation computes there
        pre = torch.addmm(b1, x, w1.t())
        grad_pre = torch.ops.aten.gelu_backward(grad @ w2, pre, approximate=approximate)
        hidden = F.gelu(pre, approximate=approximate)
        return grad_pre @ w1, grad_pre.t() @ x, grad_pre.sum(0), grad.t() @ hidden, grad.sum(0)


def mlp_with_gelu_epilogue(x: torch.Tensor, mlp: Mlp, norm: nn.LayerNorm | None, fold_affine: bool
                           ) -> torch.Tensor | None:
    """``mlp(norm(x))`` (norm optional) for a training step through :class:`_GeluEpilogueMlp` (fc1 and GELU as one
    GEMM, fc1 recomputed in the backward), or None where that would not compute what the MLP computes (the caller
    then runs it as written). The model calls it in compiled training graphs only, where inductor fuses the
    backward's GELU and its derivative into one pass (eager mode keeps :func:`mlp_tail_recomputing_gelu`).

    Like :func:`fc1_gelu_epilogue` its GELU is the tanh approximation, so it runs in half precision only (autocast
    or half weights), on CUDA, for timm's ``Mlp`` with ``nn.GELU``, biased plain ``nn.Linear`` layers (not FP8) and
    no dropout or norm between them."""
    fc1, fc2 = mlp.fc1, mlp.fc2
    if (x.device.type not in EPILOGUE_DEVICES or not _plain_gelu_tail(mlp)
            or mlp.act.approximate not in ("none", "tanh") or type(fc1) is not nn.Linear
            or fc1.bias is None or fc2.bias is None):
        return None
    x, w1, b1 = (x, fc1.weight, fc1.bias) if norm is None else norm_linear_operands(x, norm, fc1, fold_affine)
    operands = _half_operands(x, w1, b1, fc2.weight, fc2.bias)
    if operands is None:
        return None
    x, w1, b1, w2, b2 = operands
    out = _GeluEpilogueMlp.apply(x.reshape(-1, x.shape[-1]), w1, b1, w2, b2)
    return mlp.drop2(out.view(*x.shape[:-1], out.shape[-1]))


class _GeluLinear(torch.autograd.Function):
    """fc2(GELU(hidden)) keeping only ``hidden`` (fc1's output) and fc2's weight for the backward, which recomputes
    GELU for fc2's weight gradient. An eager-mode stand-in for a checkpoint around GELU and fc2: that one re-runs
    fc2's GEMM too, and its Python costs the host more than the two ops it saves."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                approximate: str) -> torch.Tensor:
        out = F.linear(F.gelu(hidden, approximate=approximate), weight, bias)  # autocast casts as for F.linear
        ctx.save_for_backward(hidden, weight)
        ctx.approximate, ctx.bias_dtype = approximate, None if bias is None else bias.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight = ctx.saved_tensors
        grad2d = grad.reshape(-1, grad.shape[-1])
        grad_hidden = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_act = (grad2d @ weight.to(grad.dtype)).view(hidden.shape).to(hidden.dtype)
            grad_hidden = torch.ops.aten.gelu_backward(grad_act, hidden, approximate=ctx.approximate)
        if ctx.needs_input_grad[1]:
            act = F.gelu(hidden, approximate=ctx.approximate).reshape(-1, hidden.shape[-1]).to(grad.dtype)
            grad_weight = (grad2d.t() @ act).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = grad2d.sum(0).to(ctx.bias_dtype)
        return grad_hidden, grad_weight, grad_bias, None


def mlp_tail_recomputing_gelu(mlp: nn.Module, hidden: torch.Tensor) -> torch.Tensor | None:
    """timm Mlp's layers after fc1, drop2(fc2(GELU(hidden))), through :class:`_GeluLinear` (GELU recomputed in the
    backward, fc2 not), or None where it does not apply: under torch.compile (whose partitioner recomputes just the
    GELU of the caller's checkpoint), for an ``act`` other than ``nn.GELU``, an fc2 other than ``nn.Linear`` (FP8),
    or a drop1 or norm that is not the identity."""
    if torch.compiler.is_compiling() or not _plain_gelu_tail(mlp):
        return None
    return mlp.drop2(_GeluLinear.apply(hidden, mlp.fc2.weight, mlp.fc2.bias, mlp.act.approximate))


def check_images(x: torch.Tensor, in_chans: int, img_size: tuple[int, int], patch_size: tuple[int, int],
                 dynamic_img_size: bool) -> None:
    """ValueError, naming the fix, unless x is a (B, in_chans, H, W) batch of img_size images (with
    dynamic_img_size, of any multiple of patch_size)."""
    if x.dim() != 4:
        raise ValueError(f"expected an image batch (B, C, H, W), got a tensor of shape {tuple(x.shape)}")
    if x.shape[1] != in_chans:
        raise ValueError(f"expected {in_chans} input channels, got {x.shape[1]} "
                         f"(input shape {tuple(x.shape)}); set in_chans or convert the images")
    size = tuple(x.shape[-2:])
    if dynamic_img_size:
        if size[0] % patch_size[0] or size[1] % patch_size[1]:
            raise ValueError(f"image size {size} is not a multiple of the patch size {patch_size}")
    elif size != img_size:
        raise ValueError(f"image size {size} does not match the model's img_size {img_size}; "
                         f"create the model with img_size={size} (or dynamic_img_size=True)")


class WindowAttentionBase(nn.Module, abc.ABC):
    """Multi-head self attention inside (shifted) windows through a switchable backend (swin.models.attention).

    Subclasses say what the backend computes: :meth:`backend_inputs` returns the qkv projection in image
    layout and the :class:`WindowAttentionArgs` for softmax(scale q k^T + bias + mask) v."""

    num_heads: int
    head_dim: int
    proj: nn.Linear
    fold_norm_affine: bool = True  # SwinTransformer.set_fold_norm_affine

    def set_attention(self, name: str) -> None:
        """Backend ``name`` for this module; ValueError, naming the fix, where flash_window cannot take its windows
        or heads."""
        backend = get_backend(name)
        if name == "flash_window":
            check_flash_window(self.window_size, self.head_dim)
        self.attention, self.backend = name, backend

    @abc.abstractmethod
    def backend_inputs(self, x: torch.Tensor, spec: WindowSpec, attn_mask: torch.Tensor | None,
                       norm: nn.LayerNorm | None = None) -> tuple[torch.Tensor, WindowAttentionArgs]:
        """(qkv (B, H, W, 3, heads, head_dim), backend arguments) for features x (B, H, W, C), normalised by
        ``norm`` first where given."""

    def forward(self, x: torch.Tensor, spec: WindowSpec, attn_mask: torch.Tensor | None,
                norm: nn.LayerNorm | None = None) -> torch.Tensor:
        """x: (B, H, W, C) features -> (B, H, W, C). norm: v1's pre-norm, applied to x before the qkv projection
        (and folded into it: :func:`norm_linear`)."""
        b, h, w, c = x.shape
        qkv, args = self.backend_inputs(x, spec, attn_mask, norm)
        out = self.backend(qkv, args)
        return self.proj(out.reshape(b, h, w, c))


class WindowAttention(WindowAttentionBase):
    """Swin v1: scaled dot-product attention with a learnt relative position bias table."""

    def __init__(self, dim: int, num_heads: int, window_size: tuple[int, int], qkv_bias: bool = True,
                 attention: str = "sdpa"):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.window_size = window_size
        wh, ww = window_size
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * wh - 1) * (2 * ww - 1), num_heads))
        self.register_buffer("relative_position_index", relative_position_index(window_size), persistent=False)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.set_attention(attention)

    def set_window_size(self, window_size: tuple[int, int]) -> None:
        """Another window: the bias table resized as timm resizes it (timm.layers.resize_rel_pos_bias_table)."""
        if window_size == self.window_size:
            return
        (wh, ww), table = window_size, self.relative_position_bias_table
        with torch.no_grad():
            resized = resize_rel_pos_bias_table(table, new_window_size=window_size, old_window_size=self.window_size,
                                                new_bias_shape=((2 * wh - 1) * (2 * ww - 1), self.num_heads))
        self.relative_position_bias_table = nn.Parameter(resized, requires_grad=table.requires_grad)
        self.register_buffer("relative_position_index", relative_position_index(window_size, table.device),
                             persistent=False)
        self.window_size = window_size

    def backend_inputs(self, x: torch.Tensor, spec: WindowSpec, attn_mask: torch.Tensor | None,
                       norm: nn.LayerNorm | None = None) -> tuple[torch.Tensor, WindowAttentionArgs]:
        b, h, w, c = x.shape
        qkv = self.qkv(x) if norm is None else norm_linear(x, norm, self.qkv, self.fold_norm_affine)
        qkv = qkv.view(b, h, w, 3, self.num_heads, self.head_dim)
        # padded positions (timm pads the normalised block input with zeros) hold the projection's bias
        qkv_bias = None if self.qkv.bias is None else self.qkv.bias.view(3, self.num_heads, self.head_dim)
        return qkv, WindowAttentionArgs(spec, self.scale, self.relative_position_bias_table,
                                        self.relative_position_index, attn_mask, qkv_bias)


class CosineWindowAttention(WindowAttentionBase):
    """Swin V2: scaled cosine attention (a learnt logit scale per head, clamped at 100) with a continuous
    relative position bias, 16 sigmoid(cpb_mlp(log-spaced offsets)), instead of a table of free parameters.

    Parameters as timm's: q_bias and v_bias (k has none: a zero buffer k_bias), cpb_mlp, logit_scale. The MLP
    makes the bias independent of the window size, so weights move between windows without resizing anything.
    """

    def __init__(self, dim: int, num_heads: int, window_size: tuple[int, int], qkv_bias: bool = True,
                 attention: str = "sdpa", pretrained_window_size: tuple[int, int] = (0, 0)):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.window_size = window_size
        self.pretrained_window_size = pretrained_window_size
        self.logit_scale = nn.Parameter(torch.full((num_heads, 1, 1), math.log(10.0)))
        self.cpb_mlp = nn.Sequential(nn.Linear(2, 512), nn.ReLU(inplace=True), nn.Linear(512, num_heads, bias=False))
        self.qkv = nn.Linear(dim, dim * 3, bias=False)
        self.qkv.weight_read_directly = True  # backend_inputs adds q/v biases in F.linear: see precision.fp8_linears
        if qkv_bias:
            self.q_bias = nn.Parameter(torch.zeros(dim))
            self.register_buffer("k_bias", torch.zeros(dim), persistent=False)
            self.v_bias = nn.Parameter(torch.zeros(dim))
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("relative_coords_table", log_spaced_relative_coords(window_size, pretrained_window_size),
                             persistent=False)
        self.register_buffer("relative_position_index", relative_position_index(window_size), persistent=False)
        self.set_attention(attention)

    def set_window_size(self, window_size: tuple[int, int]) -> None:
        """Another window: new coordinates for the bias MLP (its weights fit any window)."""
        if window_size == self.window_size:
            return
        device = self.relative_coords_table.device
        self.register_buffer("relative_coords_table", log_spaced_relative_coords(
            window_size, self.pretrained_window_size).to(device), persistent=False)
        self.register_buffer("relative_position_index", relative_position_index(window_size, device),
                             persistent=False)
        self.window_size = window_size

    def bias_table(self) -> torch.Tensor:
        """((2Wh-1)(2Ww-1), heads) relative position bias, 16 sigmoid(MLP(coordinates)), gathered by the backends.

        In the parameters' dtype (fp32) under autocast too, where timm's runs in bf16: the MLP is tiny, and the bias
        gradient summed over every window reaches it without bf16 roundings (a bf16 table also makes the compiled
        step scatter its gradient through slow extra kernels)."""
        weight = self.cpb_mlp[0].weight
        device = weight.device.type
        # autocast refuses the meta device (no dtype for it); a plain string test, because dynamo cannot trace
        # torch.amp.is_autocast_available and a graph break fails the fullgraph compile
        no_autocast = torch.autocast(device, enabled=False) if device != "meta" else contextlib.nullcontext()
        with no_autocast:
            return 16 * torch.sigmoid(self.cpb_mlp(self.relative_coords_table.to(weight.dtype)))

    def backend_inputs(self, x: torch.Tensor, spec: WindowSpec, attn_mask: torch.Tensor | None,
                       norm: nn.LayerNorm | None = None) -> tuple[torch.Tensor, WindowAttentionArgs]:
        b, h, w, c = x.shape
        x = x if norm is None else norm(x)  # V2 normalises after the attention: its blocks pass no norm
        bias = None if self.q_bias is None else torch.cat((self.q_bias, self.k_bias, self.v_bias))
        qkv = F.linear(x, self.qkv.weight, bias).view(b, h, w, 3, self.num_heads, self.head_dim)
        # padded positions (timm pads the block input with zeros) hold the projection's bias, normalised by the
        # backend like every other token
        fill = None if bias is None else bias.view(3, self.num_heads, self.head_dim)
        cosine_scale = self.logit_scale.clamp(max=MAX_LOGIT_SCALE).exp().view(-1)
        return qkv, WindowAttentionArgs(spec, 1.0, self.bias_table(), self.relative_position_index, attn_mask, fill,
                                        cosine_scale)


class SwinTransformerBlock(nn.Module):
    """v1: pre-norm, x + attn(norm(x)), then x + mlp(norm(x)). V2: residual post-norm, x + norm(attn(x)), then
    x + norm(mlp(x)). Both with stochastic depth."""

    def __init__(self, dim: int, feat_size: tuple[int, int], num_heads: int, window_size: tuple[int, int],
                 shift: bool, mlp_ratio: float = 4.0, qkv_bias: bool = True, drop_path: float = 0.0,
                 attention: str = "sdpa", recompute_mlp_act: bool = True, version: int = 1,
                 pretrained_window_size: tuple[int, int] = (0, 0)):
        super().__init__()
        self.recompute_mlp_act = recompute_mlp_act
        self.fused_mlp_act = True  # SwinTransformer.set_fused_mlp_act
        self.fold_norm_affine = True  # SwinTransformer.set_fold_norm_affine
        self.post_norm = version == 2
        self.shifts = shift  # every other block: by half a window, where the window is smaller than the map
        self._set_geometry(feat_size, window_size)
        self.norm1 = nn.LayerNorm(dim)
        if version == 2:
            self.attn = CosineWindowAttention(dim, num_heads, self.window_size, qkv_bias, attention,
                                              pretrained_window_size)
        else:
            self.attn = WindowAttention(dim, num_heads, self.window_size, qkv_bias, attention)
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU)
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        spec = self.spec_for(feat_size)
        self.register_buffer("attn_mask", shifted_window_mask(spec), persistent=False)

    def _set_geometry(self, feat_size: tuple[int, int], window_size: tuple[int, int]) -> None:
        """The nominal feature size, and the window and shift clamped to it: fixed until set_input_size, whatever
        size an input has (timm semantics)."""
        self.feat_size = feat_size
        target_shift = tuple(w // 2 for w in window_size) if self.shifts else (0, 0)
        self.window_size, self.shift_size = clamp_window_and_shift(feat_size, window_size, target_shift)

    def set_input_size(self, feat_size: tuple[int, int], window_size: tuple[int, int]) -> None:
        """Another nominal feature size and window (SwinTransformer.set_input_size): window and shift clamped as
        at construction, the attention's position bias and the shifted-window mask made for them."""
        self._set_geometry(feat_size, window_size)
        self.attn.set_window_size(self.window_size)
        device = self.norm1.weight.device
        self.register_buffer("attn_mask", shifted_window_mask(self.spec_for(feat_size), device), persistent=False)

    def spec_for(self, feat_size: tuple[int, int]) -> WindowSpec:
        return WindowSpec(feat_size, self.window_size, self.shift_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, mlp = self.forward_unsummed(x)
        return x + mlp

    def forward_unsummed(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + attn, mlp): the block's output is their sum, added here or by the next stage's fused merge
        (SwinTransformer.forward_layers)."""
        b, h, w, c = x.shape
        spec = self.spec_for((h, w))
        same_size = all(statically_known_true(now == built) for now, built in zip(spec.feat_size, self.feat_size))
        if same_size or self.attn_mask is None:  # (no guard on the size under torch.compile's dynamic shapes)
            mask = self.attn_mask
        else:  # another input size (dynamic_img_size): same window and shift, new regions
            mask = shifted_window_mask(spec, x.device)
        if self.post_norm:
            x = x + self.drop_path1(self.norm1(self.attn(x, spec, mask)))
            return x, self.drop_path2(self.norm2(self._mlp(x)))
        x = x + self.drop_path1(self.attn(x, spec, mask, norm=self.norm1))
        return x, self.drop_path2(self._mlp(x, norm=self.norm2))

    def _mlp(self, x: torch.Tensor, norm: nn.LayerNorm | None = None) -> torch.Tensor:
        """The MLP branch of x, normalised by ``norm`` first where given (v1's pre-norm)."""
        if self.fused_mlp_act and not torch.is_grad_enabled():
            if norm is not None:
                x, norm = norm(x), None
            activation = fc1_gelu_epilogue(x, self.mlp.fc1, self.mlp.act)
            if activation is not None:
                return self._mlp_out(activation)
        elif self.fused_mlp_act and torch.compiler.is_compiling():
            out = mlp_with_gelu_epilogue(x, self.mlp, norm, self.fold_norm_affine)
            if out is not None:
                return out
        hidden = self.mlp.fc1(x) if norm is None else norm_linear(x, norm, self.mlp.fc1, self.fold_norm_affine)
        if self.recompute_mlp_act and torch.is_grad_enabled() and hidden.requires_grad:
            # Keep only fc1's output for backward and recompute GELU from it, instead of keeping both: the
            # GELU output (4C per token, fc2's input) is the largest activation a block holds, and
            # recomputing it is one pointwise op (fused into GELU's backward under torch.compile).
            out = mlp_tail_recomputing_gelu(self.mlp, hidden)  # eager mode
            return checkpoint(self._mlp_tail, hidden, use_reentrant=False) if out is None else out
        return self._mlp_tail(hidden)

    def _mlp_tail(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._mlp_out(self.mlp.act(hidden))

    def _mlp_out(self, activation: torch.Tensor) -> torch.Tensor:
        mlp = self.mlp  # timm's Mlp after its activation
        return mlp.drop2(mlp.fc2(mlp.norm(mlp.drop1(activation))))


class PatchMerging(nn.Module):
    """2x2 neighbourhood -> LayerNorm -> Linear(4C, 2C) (v1), or -> Linear(4C, 2C) -> LayerNorm (V2), padding odd
    sizes like timm."""

    def __init__(self, dim: int, out_dim: int, norm_after: bool = False):
        super().__init__()
        self.norm_after = norm_after
        self.norm = nn.LayerNorm(out_dim if norm_after else 4 * dim)
        self.reduction = nn.Linear(4 * dim, out_dim, bias=False)
        self.fold_norm_affine = True  # SwinTransformer.set_fold_norm_affine

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, H, W, C) -> (B, ceil(H/2), ceil(W/2), out_dim). delta: the previous block's MLP branch, not yet
        added to x; then the sum, merge and norm run as one kernel (v1, without gradients: fused_merge_norm)."""
        if delta is not None:
            return self.reduction(self._fused_merge_norm(x, delta))
        b, h, w, c = x.shape
        x = nn.functional.pad(x, (0, 0, 0, w % 2, 0, h % 2))
        h, w = x.shape[1:3]
        # timm's channel order (x0, x1, x2, x3) = [(0,0), (1,0), (0,1), (1,1)], needed for its weights
        x = x.reshape(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 4, 2, 5).flatten(3)
        if self.norm_after:
            return self.norm(self.reduction(x))
        return norm_linear(x, self.norm, self.reduction, self.fold_norm_affine)

    def _fused_merge_norm(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        if self.norm_after:
            raise ValueError("a V2 patch merging normalises after its reduction: it cannot fuse the norm")
        # the norm's output goes to the reduction only: under autocast write it in the dtype that Linear casts to
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        return merge_norm(x, delta, self.norm.weight, self.norm.bias, self.norm.eps, out_dtype)


class LinearPatchEmbed(PatchEmbed):
    """timm's PatchEmbed (same parameters, output NHWC), computed as a matmul over non-overlapping patches.

    A convolution whose kernel equals its stride is a linear map of each patch; as one GEMM it avoids
    cuDNN's slow weight gradient for stride-4 convolutions.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        ph, pw = self.patch_size
        if self.strict_img_size and self.img_size is not None and (h, w) != tuple(self.img_size):
            return super().forward(x)  # timm's error message for the wrong size
        if (h % ph or w % pw or getattr(self, "dynamic_img_pad", False)
                or tuple(self.proj.stride) != (ph, pw) or tuple(self.proj.kernel_size) != (ph, pw)):
            return super().forward(x)
        patches = x.reshape(b, c, h // ph, ph, w // pw, pw).permute(0, 2, 4, 1, 3, 5).flatten(3)
        x = F.linear(patches, self.proj.weight.flatten(1), self.proj.bias)  # (B, H/ph, W/pw, embed_dim)
        return self.norm(x)


class SwinTransformerStage(nn.Module):
    """Optional patch merging (timm places it at the start of stages 1..n), then the blocks."""

    def __init__(self, dim: int, out_dim: int, in_size: tuple[int, int], depth: int, downsample: bool,
                 num_heads: int, window_size: tuple[int, int], mlp_ratio: float, qkv_bias: bool,
                 drop_path: Sequence[float], attention: str, recompute_mlp_act: bool = True, version: int = 1,
                 pretrained_window_size: tuple[int, int] = (0, 0)):
        super().__init__()
        self.downsample = PatchMerging(dim, out_dim, norm_after=version == 2) if downsample else nn.Identity()
        self.out_size = self._out_size(in_size)
        self.grad_checkpointing = False
        self.blocks = nn.Sequential(*[
            SwinTransformerBlock(out_dim, self.out_size, num_heads, window_size, shift=i % 2 == 1,
                                 mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, drop_path=drop_path[i],
                                 attention=attention, recompute_mlp_act=recompute_mlp_act, version=version,
                                 pretrained_window_size=pretrained_window_size)
            for i in range(depth)])

    def _out_size(self, in_size: tuple[int, int]) -> tuple[int, int]:
        """The blocks' feature size: the input's, halved (rounded up) where the stage starts with a merge."""
        return in_size if isinstance(self.downsample, nn.Identity) else tuple((s + 1) // 2 for s in in_size)

    def set_input_size(self, in_size: tuple[int, int], window_size: tuple[int, int]) -> tuple[int, int]:
        """Another input size and window for the stage's blocks; returns the stage's output size."""
        self.out_size = self._out_size(in_size)
        for block in self.blocks:
            block.set_input_size(self.out_size, window_size)
        return self.out_size

    def _merge(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        return self.downsample(x) if delta is None else self.downsample(x, delta)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """delta: the previous stage's last MLP branch, not yet added to x (the fused merge adds it)."""
        x = self._merge(x, delta)
        if self.grad_checkpointing and self.training and torch.is_grad_enabled():
            for block in self.blocks:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            return x
        return self.blocks(x)

    def forward_unsummed(self, x: torch.Tensor, delta: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, delta), the stage's output being x + delta: its last block's MLP branch is left unadded."""
        x = self._merge(x, delta)
        for block in self.blocks[:-1]:
            x = block(x)
        return self.blocks[-1].forward_unsummed(x)


class SwinTransformer(nn.Module):
    """Swin Transformer image classifier, v1 or V2 (``version``).

    ``pretrained_window_sizes`` (V2 only, one per stage, 0: the stage's own window): the windows the weights were
    pretrained with, which scale the continuous position bias coordinates (timm's ``window12to16`` models).
    """

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 96,
        depths: Sequence[int] = (2, 2, 6, 2),
        num_heads: Sequence[int] = (3, 6, 12, 24),
        window_size: int | tuple[int, int] = 7,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.1,
        attention: str = "sdpa",
        dynamic_img_size: bool = False,
        recompute_mlp_act: bool = True,
        version: int = 1,
        pretrained_window_sizes: Sequence[int | tuple[int, int]] | None = None,
        fused_mlp_act: bool = True,
        fused_merge_norm: bool = True,
        fold_norm_affine: bool = True,
    ):
        super().__init__()
        if len(depths) != len(num_heads):
            raise ValueError(f"depths {tuple(depths)} and num_heads {tuple(num_heads)} need one entry per stage")
        if version not in VERSIONS:
            raise ValueError(f"version {version!r}: Swin Transformer versions are {VERSIONS}")
        if pretrained_window_sizes is None or not any(pretrained_window_sizes):  # all 0: every stage's own window
            pretrained_window_sizes = (0,) * len(depths)
        if len(pretrained_window_sizes) != len(depths):
            raise ValueError(f"pretrained_window_sizes {tuple(pretrained_window_sizes)} needs one entry per stage "
                             f"(depths {tuple(depths)})")
        if version == 1 and any(pretrained_window_sizes):
            raise ValueError("pretrained_window_sizes is a Swin V2 setting (continuous position bias); v1 models "
                             "resize their bias tables when loading weights instead")
        self.version = version
        get_backend(attention)  # fail early on an unknown name
        self.img_size = to_2tuple(img_size)
        self.patch_size = to_2tuple(patch_size)
        for axis, (i, p) in enumerate(zip(self.img_size, self.patch_size)):
            if i % p:
                raise ValueError(f"img_size {self.img_size} is not divisible by patch_size {self.patch_size} "
                                 f"along axis {axis}; pick an image size that is a multiple of the patch size")
        self.in_chans = in_chans
        self.num_classes = num_classes
        self.dynamic_img_size = dynamic_img_size
        self.window_size = to_2tuple(window_size)
        self.num_layers = len(depths)
        dims = [int(embed_dim * 2 ** i) for i in range(self.num_layers)]
        self.num_features = dims[-1]

        self.patch_embed = LinearPatchEmbed(img_size=self.img_size, patch_size=self.patch_size, in_chans=in_chans,
                                      embed_dim=embed_dim, norm_layer=nn.LayerNorm, output_fmt="NHWC",
                                      strict_img_size=not dynamic_img_size)
        size = self.patch_embed.grid_size
        rates = torch.linspace(0, drop_path_rate, sum(depths)).split(list(depths))
        stages = []
        for i in range(self.num_layers):
            stage = SwinTransformerStage(dims[max(i - 1, 0)], dims[i], size, depths[i], downsample=i > 0,
                                         num_heads=num_heads[i], window_size=self.window_size,
                                         mlp_ratio=mlp_ratio, qkv_bias=qkv_bias,
                                         drop_path=rates[i].tolist(), attention=attention,
                                         recompute_mlp_act=recompute_mlp_act, version=version,
                                         pretrained_window_size=to_2tuple(pretrained_window_sizes[i]))
            stages.append(stage)
            size = stage.out_size
        self.layers = nn.Sequential(*stages)
        # the windows set_input_size scales with the patch grid (timm's reference windows and grid)
        self._ref_window_sizes = (self.window_size,) * self.num_layers
        self._ref_grid_size = tuple(self.patch_embed.grid_size)
        # what each stage hands a dense head (timm's feature_info: features_only, forward_intermediates)
        self.feature_info = [dict(num_chs=dims[i], reduction=self._reduction(i), module=f"layers.{i}")
                             for i in range(self.num_layers)]
        self.norm = nn.LayerNorm(self.num_features)
        self.head = ClassifierHead(self.num_features, num_classes, pool_type="avg", drop_rate=drop_rate,
                                   input_fmt="NHWC")
        self.apply(_init_weights)
        self.set_fused_mlp_act(fused_mlp_act)
        self.set_fold_norm_affine(fold_norm_affine)
        # forward_layers: without gradients, each stage's last residual add runs in the next stage's merge kernel
        self.fused_merge_norm = bool(fused_merge_norm)
        if version == 2:  # timm's res-post-norm init: every block starts as the identity
            for block in (b for stage in self.layers for b in stage.blocks):
                for norm in (block.norm1, block.norm2):
                    nn.init.zeros_(norm.weight)
                    nn.init.zeros_(norm.bias)

    # --- attention backend -------------------------------------------------------------------
    @property
    def attention(self) -> str:
        return self.layers[0].blocks[0].attn.attention

    def set_attention(self, name: str) -> SwinTransformer:
        """Switch every block to backend `name` in place; weights are untouched. ValueError, with no block switched,
        where flash_window cannot take some block's windows or heads."""
        get_backend(name)
        attentions = [module for module in self.modules() if isinstance(module, WindowAttentionBase)]
        if name == "flash_window":
            for module in attentions:
                check_flash_window(module.window_size, module.head_dim)
        for module in attentions:
            module.set_attention(name)
        return self

    def set_fused_mlp_act(self, enabled: bool) -> SwinTransformer:
        """On (the default): without gradients, in half precision on CUDA (bf16/fp16 evaluation and inference), each
        MLP's fc1 and GELU run as one cuBLASLt GEMM with its GELU epilogue (:func:`fc1_gelu_epilogue`: no
        stand-alone GELU pass over the hidden activation; tanh GELU on the fp32 accumulator, as accurate as the
        unfused half path); in compiled training graphs, likewise, with fc1 recomputed in the backward instead of its
        output kept (:func:`mlp_with_gelu_epilogue`). Off: fc1 and the exact GELU always. Float32 and the CPU are
        unaffected."""
        for module in self.modules():
            if isinstance(module, SwinTransformerBlock):
                module.fused_mlp_act = bool(enabled)
        return self

    def set_fold_norm_affine(self, enabled: bool) -> SwinTransformer:
        """On (the default): in training graphs under torch.compile, each v1 pre-norm's scale and shift are folded
        into the Linear after it (qkv, fc1, the patch merging's reduction; :func:`norm_linear`), so that the
        backward takes the norm's parameter gradients from the Linear's instead of summing over every token. Off:
        norm then Linear as written. Eager mode, inference and Swin V2's post-norms are unaffected."""
        for module in self.modules():
            if isinstance(module, (SwinTransformerBlock, WindowAttentionBase, PatchMerging)):
                module.fold_norm_affine = bool(enabled)
        return self

    # --- timm-style helpers used by training and fine-tuning ----------------------------------
    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        # v1: the bias tables; V2: the position bias MLP and the logit scales (as timm >= 1.0.31 names them)
        words = ("relative_position_bias_table",) if self.version == 1 else ("cpb_mlp", "logit_scale")
        return {n for n, _ in self.named_parameters() if any(w in n for w in words)}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        return dict(stem=r"^patch_embed", blocks=r"^layers\.(\d+)" if coarse else [
            (r"^layers\.(\d+).downsample", (0,)), (r"^layers\.(\d+)\.\w+\.(\d+)", None), (r"^norm", (99999,))])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for stage in self.layers:
            stage.grad_checkpointing = enable

    def _reduction(self, stage: int) -> int:
        """How many input pixels a step of the stage's map spans (timm's feature_info reduction)."""
        return self.patch_size[0] * 2 ** stage

    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new classifier for num_classes (0: none, the pooled features); global_pool: timm's pool type ('' for
        none), None keeps it."""
        self.num_classes = num_classes
        self.head.reset(num_classes, pool_type=global_pool)
        if isinstance(self.head.fc, nn.Linear):
            _init_weights(self.head.fc)

    def set_input_size(self, img_size: int | tuple[int, int] | None = None,
                       patch_size: int | tuple[int, int] | None = None,
                       window_size: int | tuple[int, int] | Sequence[int | tuple[int, int]] | None = None,
                       window_ratio: int | Sequence[int] | None = None, always_partition: bool | None = None) -> None:
        """Another input resolution (and patch size, windows), in place, with timm's (>= 1.0.31) semantics
        (swin.models.windows.stage_windows): windows given (one for all stages or one per stage) or as a divisor of
        the patch grid (window_ratio), else each stage's window scaled with the grid; bias tables resized, masks
        remade. always_partition=True (windows larger than the feature map) is not supported."""
        if always_partition:
            raise ValueError("always_partition=True is not supported: windows are clamped to the feature map, as "
                             "timm does by default")
        # the new patch grid (PatchEmbed's), so that a bad window spec fails before anything changes
        new_img = to_2tuple(img_size) if img_size is not None else self.img_size
        new_patch = to_2tuple(patch_size) if patch_size is not None else self.patch_size
        grid = (new_img[0] // new_patch[0], new_img[1] // new_patch[1])
        windows = stage_windows(len(self.layers), grid, self._ref_window_sizes, self._ref_grid_size, window_size,
                                window_ratio)
        if img_size is not None or patch_size is not None:
            self.patch_embed.set_input_size(img_size=img_size, patch_size=patch_size)
            self.img_size, self.patch_size = tuple(self.patch_embed.img_size), tuple(self.patch_embed.patch_size)
        if patch_size is not None:
            for i, info in enumerate(self.feature_info):
                info["reduction"] = self._reduction(i)
        if window_size is not None or window_ratio is not None:
            self._ref_window_sizes, self._ref_grid_size = windows, grid
        size = grid
        for stage, window in zip(self.layers, windows):
            size = stage.set_input_size(size, to_2tuple(window))
        self.window_size = to_2tuple(windows[0])

    # --- backbone (timm's API: features_only models, forward_intermediates) -------------------
    def take_indices(self, indices: int | Sequence[int] | None, what: str = "indices") -> tuple[list[int], int]:
        """(stage indices, the largest) for ``indices``: None all stages, an int the last n, a sequence those
        stages (negative from the end). ValueError naming the range for an index out of it."""
        n = len(self.layers)
        if indices is None:
            indices = n
        if isinstance(indices, int):
            if not 0 < indices <= n:
                raise ValueError(f"{what}={indices}: an int takes the last n stages, 1 to {n} for this model")
            take = list(range(n - indices, n))
        else:
            take = [i + n if i < 0 else i for i in indices]
            if not take or any(not 0 <= i < n for i in take):
                raise ValueError(f"{what}={tuple(indices)}: this model has {n} stages, indices 0 to {n - 1} (or "
                                 f"-{n} to -1)")
        return take, max(take)

    def forward_intermediates(self, x: torch.Tensor, indices: int | Sequence[int] | None = None, norm: bool = False,
                              stop_early: bool = False, output_fmt: str = "NCHW", intermediates_only: bool = False
                              ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """The stage outputs ``indices`` selects (take_indices) as (B, C, H, W) maps, as timm's: with ``norm`` the
        last stage's map goes through the final norm; ``stop_early`` skips the stages after the last one taken;
        returns the maps, or (final features (B, H, W, C), maps) unless ``intermediates_only``."""
        if output_fmt != "NCHW":
            raise ValueError(f"output_fmt={output_fmt!r}: the intermediates are NCHW maps (output_fmt='NCHW')")
        take, last = self.take_indices(indices)
        if not torch.compiler.is_compiling():
            self._check_input(x)
        x = self.patch_embed(x)
        stages = self.layers[:last + 1] if stop_early else self.layers
        intermediates, i = [], 0
        for i, stage in enumerate(stages):
            x = stage(x)
            if i in take:
                taken = self.norm(x) if norm and i == len(self.layers) - 1 else x
                intermediates.append(taken.permute(0, 3, 1, 2).contiguous())
        if intermediates_only:
            return intermediates
        return (self.norm(x) if i == len(self.layers) - 1 else x), intermediates

    def prune_intermediate_layers(self, indices: int | Sequence[int] = 1, prune_norm: bool = False,
                                  prune_head: bool = True) -> list[int]:
        """Drops the stages after the last one ``indices`` takes (and then the final norm, which fits the last
        stage only), the norm where ``prune_norm``, the classifier where ``prune_head``; returns the indices."""
        take, last = self.take_indices(indices)
        prune_end = last < len(self.layers) - 1
        if prune_norm or prune_end:
            self.norm = nn.Identity()
        self.layers = self.layers[:last + 1]
        self.feature_info = self.feature_info[:last + 1]
        if prune_end:
            self.num_features = self.feature_info[last]["num_chs"]
        if prune_head or prune_end:
            self.reset_classifier(0, "")
        return take

    # --- forward ------------------------------------------------------------------------------
    def _check_input(self, x: torch.Tensor) -> None:
        check_images(x, self.in_chans, self.img_size, self.patch_size, self.dynamic_img_size)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            self._check_input(x)
        x = self.patch_embed(x)
        x = self.forward_layers(x)
        return self.norm(x)

    def forward_layers(self, x: torch.Tensor) -> torch.Tensor:
        """The stages. With fused_merge_norm (v1, without gradients, on CUDA) each stage hands its last residual
        add to the next stage's patch merging, which adds, merges and normalises in one kernel (kernels.merge_norm):
        unfused, the sum and the merge's permuted copy are separate passes over the stage's output."""
        if not self._fuses_merges(x):
            return self.layers(x)
        delta = None
        for stage in self.layers[:-1]:
            x, delta = stage.forward_unsummed(x, delta)
        return self.layers[-1](x, delta)

    def _fuses_merges(self, x: torch.Tensor) -> bool:
        return (self.fused_merge_norm and self.version == 1 and len(self.layers) > 1 and not torch.is_grad_enabled()
                and x.device.type in MERGE_NORM_DEVICES and x.dtype in (torch.float32, *HALF_DTYPES))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return self.head(x, pre_logits=True) if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def _init_weights(module: nn.Module) -> None:
    # timm's default for Swin: truncated normal (std 0.02) for linear weights, zero biases
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


__all__ = ["CosineWindowAttention", "SwinTransformer", "SwinTransformerBlock", "WindowAttention",
           "WindowAttentionBase"]
