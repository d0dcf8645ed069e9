"""torch.compile of the model as train.py, eval.py and scripts/benchmark.py apply it: one place for the options."""
from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Mapping

import torch
import torch._inductor
import torch.nn as nn

# Inductor options on top of every compile mode's. combo_kernels fuses independent small kernels side by side
# (autocast's casts of the weights and biases and their gradients among them), so fewer launches: less host time
# where the host launches each kernel (the default mode), fewer gaps between kernels on the GPU under CUDA graphs
# too (small batches gain most); combo_kernel_per_subkernel_blocks gives each of them its own block sizes, without
# which the combined kernels cost a large training step GPU time (docs/performance.md).
COMBO_KERNEL_OPTIONS: Mapping[str, object] = types.MappingProxyType(
    {"combo_kernels": True, "combo_kernel_per_subkernel_blocks": True})


@functools.cache
def combo_kernels_take_dynamic_reductions() -> bool:
    """Whether this torch's combo kernels compile a persistent reduction over a dynamic dimension. Older inductors
    (before the fix of pytorch/pytorch#187269, June 2026: torch 2.11 among them) raise "Dynamic shape on reduction
    dimension is not supported" there instead, and a backward with dynamic shapes sums gradients over the batch."""
    from torch._inductor.codegen import triton_combo_kernel

    return "Dynamic shape on reduction dimension is not supported" not in inspect.getsource(triton_combo_kernel)


def flat_options(options: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    """{"triton": {"mix_order_reduction": False}} -> {"triton.mix_order_reduction": False}: inductor's names."""
    flat: dict[str, object] = {}
    for key, value in options.items():
        if isinstance(value, Mapping):
            flat.update(flat_options(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def inductor_options(mode: str | None = "default", dynamic: bool | None = None,
                     overrides: Mapping[str, object] | None = None) -> dict[str, object]:
    """The options compile_model passes: the mode's (torch._inductor.list_mode_options), then COMBO_KERNEL_OPTIONS
    (not for dynamic=True where this torch cannot combine dynamic reductions), then `overrides`
    (inductor config names, e.g. ``{"combo_kernels": False, "triton.mix_order_reduction": False}``; nested
    mappings, as a Hydra override makes them, join their keys with dots). ValueError for an unknown mode (listing
    the modes) or an override that is not an inductor option of this torch."""
    mode = mode or "default"
    try:
        options = torch._inductor.list_mode_options(mode, dynamic)
    except RuntimeError as e:  # torch's message lists the modes
        raise ValueError(f"torch.compile mode {mode!r}: {e}") from None
    combinable = dynamic is not True or combo_kernels_take_dynamic_reductions()
    ours = dict(COMBO_KERNEL_OPTIONS) if combinable else {}
    overrides = flat_options(overrides or {})
    if unknown := sorted(set(overrides) - set(torch._inductor.config.get_config_copy())):
        raise ValueError(f"inductor option(s) {unknown} unknown to torch {torch.__version__}: use names of "
                         "torch._inductor.config, e.g. combo_kernels or triton.mix_order_reduction")
    return {**options, **ours, **overrides}


def check_memory_budget(budget: float | None, key: str = "memory_budget") -> None:
    """ValueError, naming ``key`` and what is allowed, unless budget is None or in (0, 1]."""
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1):
        raise ValueError(f"{key}={budget!r}: use a fraction in (0, 1] (1: torch's default), or null for the default")


class _InductorWithMemoryBudget(torch._TorchCompileInductorWrapper):
    """torch.compile's inductor backend whose training graphs are split into forward and backward under an
    activation memory budget (``torch._functorch.config.activation_memory_budget``, read when AOTAutograd
    partitions a graph, which happens inside the backend call): bound to this compiled model, not set for the
    whole process."""

    def __init__(self, options: dict[str, object], dynamic: bool | None, budget: float):
        super().__init__(None, options, dynamic)
        self.budget = budget

    def __eq__(self, other: object) -> bool:
        return super().__eq__(other) and getattr(other, "budget", None) == self.budget

    def __call__(self, graph, example_inputs):
        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            return super().__call__(graph, example_inputs)


def compile_model(model: nn.Module, mode: str | None = "default", dynamic: bool | None = None,
                  fullgraph: bool = False, overrides: Mapping[str, object] | None = None,
                  memory_budget: float | None = None) -> nn.Module:
    """``torch.compile(model, mode=mode, dynamic=dynamic, fullgraph=fullgraph)`` with :func:`inductor_options`.

    torch.compile takes a mode or options, not both: the mode is expanded into its options and ours are added.
    mode: a torch.compile mode (``default``, ``reduce-overhead``, ``max-autotune``, ...; None: ``default``).
    overrides: inductor options that replace ours or the mode's (inductor_options). memory_budget: None (torch's
    default), or a fraction in (0, 1] of the activations the default partition saves for the backward: below 1
    the partitioner recomputes cheap ops in the backward instead of saving their outputs (less memory, some
    recompute); ValueError outside (0, 1]."""
    options = inductor_options(mode, dynamic, overrides)
    if memory_budget is None:
        return torch.compile(model, dynamic=dynamic, fullgraph=fullgraph, options=options)
    check_memory_budget(memory_budget)
    return torch.compile(model, dynamic=dynamic, fullgraph=fullgraph,
                         backend=_InductorWithMemoryBudget(options, dynamic, float(memory_budget)))
