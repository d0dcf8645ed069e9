"""torch.compile of the model as train.py, eval.py and scripts/benchmark.py apply it: one place for the options."""
from __future__ import annotations

import torch
import torch._inductor
import torch.nn as nn

# Inductor options on top of the compile mode's. combo_kernels fuses independent small kernels side by side: a
# Swin step launches about a hundred tiny kernels per forward (autocast's casts of the weights and biases) and as
# many per backward (the casts of their gradients); combined, the step launches a quarter fewer kernels, which
# saves GPU time in CUDA graphs (each kernel has a fixed cost) and host time without them (docs/performance.md).
INDUCTOR_OPTIONS: dict[str, object] = {"combo_kernels": True}


def compile_model(model: nn.Module, mode: str | None = "default", dynamic: bool | None = None,
                  fullgraph: bool = False) -> nn.Module:
    """``torch.compile(model, mode=mode, ...)`` with :data:`INDUCTOR_OPTIONS` added to the mode's options.

    mode: a torch.compile mode (``default``, ``reduce-overhead``, ``max-autotune``, ...; None: ``default``);
    ValueError for another. torch.compile takes a mode or options, not both: the mode is expanded into its options
    (torch._inductor.list_mode_options) and these are added to them."""
    mode = mode or "default"
    try:
        options = torch._inductor.list_mode_options(mode)
    except RuntimeError as e:  # torch's message lists the modes
        raise ValueError(f"torch.compile mode {mode!r}: {e}") from None
    return torch.compile(model, dynamic=dynamic, fullgraph=fullgraph, options={**options, **INDUCTOR_OPTIONS})
