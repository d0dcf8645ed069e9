"""torch.compile of the model as train.py, eval.py and scripts/benchmark.py apply it: one place for the options."""
from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Mapping

import torch
import torch._inductor
import torch.nn as nn

# Inductor options on top of the compile mode's. combo_kernels fuses independent small kernels side by side: a
# Swin step launches about a hundred tiny kernels per forward (autocast's casts of the weights and biases) and as
# many per backward (the casts of their gradients); combined, the CUDA-graph step launches a quarter fewer kernels
# and runs faster (docs/performance.md).
INDUCTOR_OPTIONS: Mapping[str, object] = types.MappingProxyType({"combo_kernels": True})


@functools.cache
def combo_kernels_take_dynamic_reductions() -> bool:
    """Whether this torch's combo kernels compile a persistent reduction over a dynamic dimension. Older inductors
    (before the fix of pytorch/pytorch#187269, June 2026: torch 2.11 among them) raise "Dynamic shape on reduction
    dimension is not supported" there instead, and a backward with dynamic shapes sums gradients over the batch."""
    from torch._inductor.codegen import triton_combo_kernel

    return "Dynamic shape on reduction dimension is not supported" not in inspect.getsource(triton_combo_kernel)


def inductor_options(mode: str | None = "default", dynamic: bool | None = None) -> dict[str, object]:
    """The options compile_model passes: the mode's (torch._inductor.list_mode_options) plus INDUCTOR_OPTIONS,
    without combo kernels for dynamic=True where this torch cannot combine dynamic reductions. ValueError, listing
    the modes, for an unknown mode."""
    mode = mode or "default"
    try:
        options = torch._inductor.list_mode_options(mode, dynamic)
    except RuntimeError as e:  # torch's message lists the modes
        raise ValueError(f"torch.compile mode {mode!r}: {e}") from None
    ours = dict(INDUCTOR_OPTIONS)
    if dynamic is True and not combo_kernels_take_dynamic_reductions():
        ours.pop("combo_kernels")
    return {**options, **ours}


def compile_model(model: nn.Module, mode: str | None = "default", dynamic: bool | None = None,
                  fullgraph: bool = False) -> nn.Module:
    """``torch.compile(model, mode=mode, dynamic=dynamic, fullgraph=fullgraph)`` with :func:`inductor_options`.

    torch.compile takes a mode or options, not both: the mode is expanded into its options and ours are added.
    mode: a torch.compile mode (``default``, ``reduce-overhead``, ``max-autotune``, ...; None: ``default``)."""
    return torch.compile(model, dynamic=dynamic, fullgraph=fullgraph, options=inductor_options(mode, dynamic))
