"""The mixed-precision choice shared by training and evaluation: ``amp=auto|bf16|fp16|fp32``."""
from __future__ import annotations

import contextlib

import torch

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
AMP_CHOICES = ("auto", *AMP_DTYPES)


def resolve_amp(amp: str | None, device: torch.device) -> str:
    """``auto`` (or None) becomes bf16 on CUDA and fp32 elsewhere; ValueError for an unknown name."""
    if amp in (None, "auto"):
        return "bf16" if torch.device(device).type == "cuda" else "fp32"
    if amp not in AMP_DTYPES:
        raise ValueError(f"amp={amp!r}: use auto, bf16, fp16 or fp32")
    return amp


def autocast(device: torch.device, amp: str) -> contextlib.AbstractContextManager:
    """The autocast context of a resolved ``amp`` (fp32: none)."""
    device = torch.device(device)
    if amp == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AMP_DTYPES[amp])
