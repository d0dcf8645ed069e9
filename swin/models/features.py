"""Swin as a backbone: timm's features_only model over ours (``swin.create_model(name, features_only=True)``).

It is timm's own FeatureListNet around our SwinTransformer, as timm builds its Swin feature models
(``flatten_sequential``): the modules up to the last stage taken, named ``patch_embed``, ``layers_0``, ...,
so its state_dict is that of timm's features_only model (either loads into the other with strict=True). It returns
the stages' (B, H, W, C) maps; ``feature_info.channels()`` and ``.reduction()`` describe them. For NCHW maps with
the final norm, use the full model's ``forward_intermediates``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from timm.models import FeatureListNet

from swin.models.swin_transformer import SwinTransformer, check_images


class SwinFeatures(FeatureListNet):
    """The stage outputs ``out_indices`` selects (negative from the end), NHWC, as timm's Swin feature model."""

    def __init__(self, model: SwinTransformer, out_indices: Sequence[int]):
        take, _ = model.take_indices(list(out_indices), "out_indices")  # ValueError naming the range
        super().__init__(model, out_indices=take, flatten_sequential=True)
        # what the input checks read (not the model itself: that would keep its dropped norm and head alive)
        self._input = (model.in_chans, model.img_size, model.patch_size, model.dynamic_img_size)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        if not torch.compiler.is_compiling():
            check_images(x, *self._input)
        return super().forward(x)
