"""Named Swin architectures (timm's names and hyper-parameters) and ``create_model``, the one way to build one."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from swin.models.features import SwinFeatures
from swin.models.pretrained import load_pretrained
from swin.models.swin_transformer import SwinTransformer

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


def _swinv2_config(img_size: int, window_size: int, size: str, pretrained_window: int = 0) -> dict[str, Any]:
    """A Swin V2 registration of timm: tiny / small / base / large at img_size, window, pretrained window."""
    embed_dim, depths, num_heads = {
        "tiny": (96, (2, 2, 6, 2), (3, 6, 12, 24)), "small": (96, (2, 2, 18, 2), (3, 6, 12, 24)),
        "base": (128, (2, 2, 18, 2), (4, 8, 16, 32)), "large": (192, (2, 2, 18, 2), (6, 12, 24, 48))}[size]
    # timm's window12to* models were pretrained at 192 with window 12: the last stage (6x6) had window 6
    pretrained = (pretrained_window,) * 3 + (pretrained_window // 2,) if pretrained_window else (0, 0, 0, 0)
    return dict(version=2, img_size=img_size, patch_size=4, window_size=window_size, embed_dim=embed_dim,
                depths=depths, num_heads=num_heads, pretrained_window_sizes=pretrained)


# Swin V2 (timm's swinv2_* names; not the swinv2_cr_* family, another implementation)
MODEL_CONFIGS.update({
    "swinv2_tiny_window8_256": _swinv2_config(256, 8, "tiny"),
    "swinv2_tiny_window16_256": _swinv2_config(256, 16, "tiny"),
    "swinv2_small_window8_256": _swinv2_config(256, 8, "small"),
    "swinv2_small_window16_256": _swinv2_config(256, 16, "small"),
    "swinv2_base_window8_256": _swinv2_config(256, 8, "base"),
    "swinv2_base_window16_256": _swinv2_config(256, 16, "base"),
    "swinv2_base_window12_192": _swinv2_config(192, 12, "base"),
    "swinv2_base_window12to16_192to256": _swinv2_config(256, 16, "base", pretrained_window=12),
    "swinv2_base_window12to24_192to384": _swinv2_config(384, 24, "base", pretrained_window=12),
    "swinv2_large_window12_192": _swinv2_config(192, 12, "large"),
    "swinv2_large_window12to16_192to256": _swinv2_config(256, 16, "large", pretrained_window=12),
    "swinv2_large_window12to24_192to384": _swinv2_config(384, 24, "large", pretrained_window=12),
    # swin_micro's shapes with V2 blocks, for CPU demos and tests
    "swinv2_micro": dict(MODEL_CONFIGS["swin_micro"], version=2, pretrained_window_sizes=(0, 0)),
})


def list_models() -> list[str]:
    return sorted(MODEL_CONFIGS)


# keys of a model config that are not architecture overrides: create_model takes them as its own arguments
NOT_OVERRIDES = ("name", "pretrained", "num_classes")


def config_overrides(model_cfg: Any) -> dict[str, Any]:
    """A model config's typed settings (swin.config.ModelConfig) as create_model's architecture overrides: every
    key but name, pretrained and num_classes."""
    return {k: v for k, v in dataclasses.asdict(model_cfg).items() if k not in NOT_OVERRIDES}


def architecture(name: str, **overrides: Any) -> dict[str, Any]:
    """The arguments of ``name``'s SwinTransformer: the registry's, overridden by those of ``overrides`` that are
    not None (KeyError for an unknown name)."""
    return {**MODEL_CONFIGS[name], **{k: v for k, v in overrides.items() if v is not None}}


def create_model(name: str, pretrained: str | bool | None = None, features_only: bool = False,
                 out_indices: Sequence[int] | None = None, **overrides: Any) -> SwinTransformer | SwinFeatures:
    """Build a Swin model by timm name, with keyword overrides of its architecture.

    ``features_only``: the backbone as timm builds it (swin.models.features.SwinFeatures: the NHWC maps of the
    stages ``out_indices`` selects, default all; the classifier and final norm dropped, after loading
    ``pretrained`` into the whole model, so a classification checkpoint loads).

    Overrides: attention, num_classes, img_size, window_size, patch_size, embed_dim, depths,
    num_heads, drop_path_rate, drop_rate, mlp_ratio, in_chans, qkv_bias, dynamic_img_size,
    recompute_mlp_act (default True: the MLP GELU output is recomputed in backward, not saved), fused_mlp_act
    (default True: in bf16/fp16 on CUDA, fc1 and GELU as one cuBLASLt GEMM with its GELU epilogue; fc1_gelu_epilogue
    without gradients, mlp_with_gelu_epilogue in compiled training), fused_merge_norm (default True: without
    gradients on CUDA, v1, each stage's last residual add, the next patch merging and its LayerNorm as one kernel;
    kernels.merge_norm), fold_norm_affine (default True: in compiled training graphs, v1's pre-norms' scale and
    shift folded into the next Linear; norm_linear), and for Swin V2 (``swinv2_*``) pretrained_window_sizes (one
    per stage; 0: the stage's own window).
    ``pretrained``: a checkpoint file (timm, official Microsoft or ours), or ``timm:<name.tag>``.
    """
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(list_models())}")
    kwargs = architecture(name, **overrides)
    for key in ("depths", "num_heads", "pretrained_window_sizes"):
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
        load_pretrained(model, pretrained)
    if features_only:
        return SwinFeatures(model, range(model.num_layers) if out_indices is None else out_indices)
    if out_indices is not None:
        raise ValueError("out_indices selects the stages of a features_only model: pass features_only=True")
    return model
