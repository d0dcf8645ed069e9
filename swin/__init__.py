"""Swin Transformer with switchable window attention: ``swin.create_model(name, **overrides)``.

Layout: ``swin.models`` (the network, attention backends, named configs, weight loading), ``swin.data``
(datasets, loaders, GPU decoding and augmentation), ``swin.train`` (the training loop and what it needs),
``swin.evaluate`` (the evaluation loop of both train.py and eval.py); the Triton kernels of the model in
``kernels/``. docs/design.md walks through it.
"""
from swin.models.compiling import compile_model
from swin.models.registry import MODEL_CONFIGS, create_model, list_models
from swin.models.swin_transformer import SwinTransformer

__all__ = ["compile_model", "create_model", "list_models", "MODEL_CONFIGS", "SwinTransformer"]
