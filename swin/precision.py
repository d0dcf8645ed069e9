"""The mixed-precision choice shared by training and evaluation: ``amp=auto|bf16|fp16|fp32``, and for training
``fp8``: bf16 autocast with the large linear layers' matmuls in FP8 (torchao's float8 training)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
AMP_CHOICES = ("auto", *AMP_DTYPES)
TRAIN_AMP_CHOICES = (*AMP_CHOICES, "fp8")
FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper and later


def resolve_amp(amp: str | None, device: torch.device, choices: tuple[str, ...] = AMP_CHOICES) -> str:
    """``auto`` (or None) becomes bf16 on CUDA and fp32 elsewhere; ValueError for a name not in ``choices``
    (TRAIN_AMP_CHOICES adds fp8)."""
    if amp in (None, "auto"):
        return "bf16" if torch.device(device).type == "cuda" else "fp32"
    if amp not in choices:
        raise ValueError(f"amp={amp!r}: use {', '.join(choices[:-1])} or {choices[-1]}")
    return amp


def autocast(device: torch.device, amp: str) -> contextlib.AbstractContextManager:
    """The autocast context of a resolved ``amp`` (fp32: none; fp8: bf16, the FP8 layers cast for themselves)."""
    device = torch.device(device)
    if amp == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AMP_DTYPES["bf16" if amp == "fp8" else amp])


def fp8_problem(device: torch.device, key: str = "amp") -> str | None:
    """Why ``key``=fp8 cannot run on ``device`` (one line naming the fix), or None."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"{key}=fp8 needs a CUDA GPU with FP8 tensor cores, not {device.type}; use {key}=bf16"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return (f"{key}=fp8 needs FP8 tensor cores (compute capability {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}+: "
                f"Ada, Hopper or later); this GPU has {capability[0]}.{capability[1]}: use {key}=bf16")
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        return f"{key}=fp8 runs torchao's float8 training, which does not import ({e}): pip install torchao"
    return None


def fp8_gemm_takes(in_features: int, out_features: int) -> bool:
    """Whether FP8 GEMMs (torch._scaled_mm) run a linear layer of these features: both multiples of 16 (a
    1000-class head is refused)."""
    return in_features % 16 == 0 and out_features % 16 == 0


FP8_MIN_FEATURES = 4096
FP8_LAYER_CHOICES = ("pays", "all")


def check_fp8_layers(layers: str, key: str = "fp8_layers") -> None:
    """ValueError, naming ``key`` and the choices, unless layers is one of FP8_LAYER_CHOICES (fp8_linears)."""
    if layers not in FP8_LAYER_CHOICES:
        raise ValueError(f"{key}={layers!r}: use pays (the layers FP8 speeds up) or all (every layer FP8 GEMMs "
                         "take)")


def fp8_pays(in_features: int, out_features: int) -> bool:
    """Whether a linear layer gains from FP8 training: both features at least FP8_MIN_FEATURES, on a shape FP8
    GEMMs take (fp8_gemm_takes). Why: the dynamic scaling and casting around each GEMM cost more than its faster
    math saves unless the GEMM is large on every side; measured per layer, no Swin layer gains, and none is picked
    (docs/performance.md, FP8 training)."""
    return (fp8_gemm_takes(in_features, out_features)
            and min(in_features, out_features) >= FP8_MIN_FEATURES)


def fp8_linears(model: nn.Module, layers: str = "pays") -> list[str]:
    """Swaps, in place, nn.Linear layers for torchao's Float8Linear (the same parameters; its matmuls cast inputs,
    weights and output gradients to FP8 with dynamic per-tensor scales and accumulate in higher precision); returns
    the swapped layers' names. layers: ``pays``, those where fp8_pays; ``all``, every one FP8 GEMMs take
    (fp8_gemm_takes), to check FP8's numerics or measure it where it does not pay; ValueError otherwise. Layers
    whose weight the model reads itself (``weight_read_directly``, e.g. Swin V2's qkv, whose biases F.linear adds)
    are left alone: swapping them would change nothing. Works on any device; running the model needs
    fp8_problem(device) to be None."""
    check_fp8_layers(layers)
    from torchao.float8 import convert_to_float8_training

    rule = fp8_pays if layers == "pays" else fp8_gemm_takes
    swapped: list[str] = []

    def take(module: nn.Module, name: str) -> bool:
        chosen = (isinstance(module, nn.Linear) and not getattr(module, "weight_read_directly", False)
                  and rule(module.in_features, module.out_features))
        if chosen:
            swapped.append(name)
        return chosen

    convert_to_float8_training(model, module_filter_fn=take)
    return swapped
