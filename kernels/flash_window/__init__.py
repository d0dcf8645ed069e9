"""Flash window attention for Swin: the whole L x L score tile of a window on chip, shift, padding, bias and mask
fused. Laid out as flash-attn and NATTEN keep a thin API apart from their kernels: ``api`` (the public functions and
their checks), ``ops`` (op registration and autograd), ``plan`` (launch plans and the tuning object), ``launch``
(the calls of the kernels) and ``triton_kernels`` (the Triton kernels)."""
from kernels.flash_window.api import (
    MAX_HEAD_DIM,
    MAX_WINDOW_AREA,
    SUPPORTED_DTYPES,
    flash_window_attention,
    flash_window_attention_image,
    unsupported_geometry,
    unsupported_reason,
)

__all__ = ["MAX_HEAD_DIM", "MAX_WINDOW_AREA", "SUPPORTED_DTYPES", "flash_window_attention",
           "flash_window_attention_image", "unsupported_geometry", "unsupported_reason"]
