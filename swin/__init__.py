"""Swin Transformer with switchable window attention: ``swin.create_model(name, **overrides)``."""
from __future__ import annotations

from typing import Any

from .attention import BACKENDS
from .model import SwinTransformer

# Architectures by timm's names (same hyper-parameters as timm's registrations).
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "swin_tiny_patch4_window7_224": dict(img_size=224, patch_size=4, window_size=7, embed_dim=96,
                                         depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24)),
    "swin_small_patch4_window7_224": dict(img_size=224, patch_size=4, window_size=7, embed_dim=96,
                                          depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24)),
    "swin_base_patch4_window7_224": dict(img_size=224, patch_size=4, window_size=7, embed_dim=128,
                                         depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)),
    "swin_base_patch4_window12_384": dict(img_size=384, patch_size=4, window_size=12, embed_dim=128,
                                          depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32)),
    "swin_large_patch4_window7_224": dict(img_size=224, patch_size=4, window_size=7, embed_dim=192,
                                          depths=(2, 2, 18, 2), num_heads=(6, 12, 24, 48)),
    "swin_large_patch4_window12_384": dict(img_size=384, patch_size=4, window_size=12, embed_dim=192,
                                           depths=(2, 2, 18, 2), num_heads=(6, 12, 24, 48)),
    # small model for CPU demos and tests: 16x16 input -> 8x8 then 4x4 tokens, window 4
    "swin_micro": dict(img_size=16, patch_size=2, window_size=4, embed_dim=32, depths=(2, 2),
                       num_heads=(2, 4), num_classes=10, drop_path_rate=0.0),
}


def list_models() -> list[str]:
    return sorted(MODEL_CONFIGS)


def create_model(name: str, pretrained: str | bool | None = None, **overrides: Any) -> SwinTransformer:
    """Build a Swin model by timm name, with keyword overrides of its architecture.

    Overrides: attention, num_classes, img_size, window_size, patch_size, embed_dim, depths,
    num_heads, drop_path_rate, drop_rate, mlp_ratio, in_chans, qkv_bias, dynamic_img_size,
    recompute_mlp_act (default True: the MLP GELU output is recomputed in backward, not saved).
    ``pretrained``: a checkpoint file (timm, official Microsoft or ours), or ``timm:<name.tag>``.
    """
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(list_models())}")
    kwargs = {**MODEL_CONFIGS[name], **{k: v for k, v in overrides.items() if v is not None}}
    if "attention" in kwargs and kwargs["attention"] not in BACKENDS:
        raise ValueError(f"unknown attention backend {kwargs['attention']!r}; choose one of {sorted(BACKENDS)}")
    for key in ("depths", "num_heads"):
        if key in kwargs:
            kwargs[key] = tuple(kwargs[key])
    for key in ("img_size", "window_size", "patch_size"):
        if isinstance(kwargs.get(key), (list, tuple)):
            kwargs[key] = tuple(kwargs[key])
    try:
        model = SwinTransformer(**kwargs)
    except TypeError as e:
        raise ValueError(f"bad override for {name}: {e}") from None
    if pretrained:
        from .checkpoint import load_pretrained
        load_pretrained(model, pretrained)
    return model


__all__ = ["create_model", "list_models", "MODEL_CONFIGS", "SwinTransformer"]
