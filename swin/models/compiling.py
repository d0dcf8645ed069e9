"""torch.compile of the model as train.py, eval.py and scripts/benchmark.py apply it: one place for the options."""
from __future__ import annotations

import functools
import inspect
import itertools
import types
from collections.abc import Mapping

import torch
import torch._inductor
import torch.nn as nn

# Inductor options on top of every compile mode's, except where the C++ wrapper runs (below). combo_kernels fuses
# independent small kernels side by side (autocast's casts of the weights and biases and their gradients among
# them), so fewer launches: less host time where Python launches each kernel (the default mode's Python wrapper),
# fewer gaps between kernels on the GPU under CUDA graphs too (small batches gain most);
# combo_kernel_per_subkernel_blocks gives each of them its own block sizes, without which the combined kernels cost
# a large training step GPU time (docs/performance.md).
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


# The default mode launches every kernel from the host, and inductor's Python wrapper code costs a training step more
# host time than its kernels take on the GPU: the C++ wrapper launches them from C++ instead, so that the step is
# GPU-bound (docs/performance.md). Training graphs only (an inference step is GPU-bound at the batch sizes that
# matter, and compiling C++ takes longer), on CUDA, static or automatic-dynamic shapes. Without combo kernels: torch
# 2.11's C++ wrapper fails an assertion on their argument lists. Its backward is compiled with the forward
# (compile_model), since a lazily compiled backward misses the C++ wrapper's settings on torch 2.11
# ("CudaKernelParamCache not populated", pytorch/pytorch#178847).
CPP_WRAPPER_OPTIONS: Mapping[str, object] = types.MappingProxyType({"cpp_wrapper": True})


def uses_cpp_wrapper(mode: str | None, dynamic: bool | None, device_type: str, training: bool) -> bool:
    """Whether compile_model gives these graphs inductor's C++ wrapper (CPP_WRAPPER_OPTIONS): training graphs of
    the default mode on CUDA, without dynamic=True."""
    return training and (mode or "default") == "default" and device_type == "cuda" and dynamic is not True


def inductor_options(mode: str | None = "default", dynamic: bool | None = None,
                     overrides: Mapping[str, object] | None = None, device_type: str = "cpu",
                     training: bool = True) -> dict[str, object]:
    """The options compile_model passes for the training (or, ``training=False``, inference: compiled without
    gradients) graphs of a model on ``device_type``: the mode's
    (torch._inductor.list_mode_options), then ours, then `overrides` (inductor config names, e.g.
    ``{"combo_kernels": False, "triton.mix_order_reduction": False}``; nested mappings, as a Hydra override makes
    them, join their keys with dots). Ours: CPP_WRAPPER_OPTIONS where uses_cpp_wrapper says so and the overrides do
    not turn it off, else COMBO_KERNEL_OPTIONS (not for dynamic=True where this torch cannot combine dynamic
    reductions). ValueError for an unknown mode (listing the modes) or an override that is not an inductor option of
    this torch."""
    mode = mode or "default"
    try:
        options = torch._inductor.list_mode_options(mode, dynamic)
    except RuntimeError as e:  # torch's message lists the modes
        raise ValueError(f"torch.compile mode {mode!r}: {e}") from None
    overrides = flat_options(overrides or {})
    if unknown := sorted(set(overrides) - set(torch._inductor.config.get_config_copy())):
        raise ValueError(f"inductor option(s) {unknown} unknown to torch {torch.__version__}: use names of "
                         "torch._inductor.config, e.g. combo_kernels or triton.mix_order_reduction")
    if uses_cpp_wrapper(mode, dynamic, device_type, training) and overrides.get("cpp_wrapper", True):
        ours = dict(CPP_WRAPPER_OPTIONS)
    elif dynamic is not True or combo_kernels_take_dynamic_reductions():
        ours = dict(COMBO_KERNEL_OPTIONS)
    else:
        ours = {}
    return {**options, **ours, **overrides}


def check_memory_budget(budget: float | None, key: str = "memory_budget") -> None:
    """ValueError, naming ``key`` and what is allowed, unless budget is None or in (0, 1]."""
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1):
        raise ValueError(f"{key}={budget!r}: use a fraction in (0, 1] (1: torch's default), or null for the default")


class _InductorBackend(torch._TorchCompileInductorWrapper):
    """torch.compile's inductor backend with AOTAutograd settings (``torch._functorch.config``, read when a training
    graph is split into forward and backward, which happens inside the backend call) bound to this compiled model,
    not set for the whole process (the activation memory budget, compiling the backward with the forward), and
    other inductor options for graphs compiled without gradients (``inference_options``; None: the same)."""

    def __init__(self, options: dict[str, object], dynamic: bool | None, functorch_config: dict[str, object],
                 inference_options: dict[str, object] | None = None):
        super().__init__(None, options, dynamic)
        self.functorch_config = functorch_config
        self.inference = (None if inference_options is None
                          else torch._TorchCompileInductorWrapper(None, inference_options, dynamic))

    def __eq__(self, other: object) -> bool:
        return (super().__eq__(other) and getattr(other, "functorch_config", None) == self.functorch_config
                and getattr(other, "inference", None) == self.inference)

    def __call__(self, graph, example_inputs):
        # dynamo calls the backend in the grad mode of the call it compiles (as AOTAutograd reads it)
        if self.inference is not None and not torch.is_grad_enabled():
            return self.inference(graph, example_inputs)
        with torch._functorch.config.patch(self.functorch_config):
            return super().__call__(graph, example_inputs)


def _device_type(model: nn.Module) -> str:
    """The device type of the model's first parameter or buffer ("cpu" for a model without either)."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return "cpu" if first is None else first.device.type


def compile_model(model: nn.Module, mode: str | None = "default", dynamic: bool | None = None,
                  fullgraph: bool = False, overrides: Mapping[str, object] | None = None,
                  memory_budget: float | None = None) -> nn.Module:
    """``torch.compile(model, mode=mode, dynamic=dynamic, fullgraph=fullgraph)`` with :func:`inductor_options` for
    the model's device (move the model to its device first).

    torch.compile takes a mode or options, not both: the mode is expanded into its options and ours are added.
    mode: a torch.compile mode (``default``, ``reduce-overhead``, ``max-autotune``, ...; None: ``default``).
    overrides: inductor options that replace ours or the mode's (inductor_options). memory_budget: None (torch's
    default), or a fraction in (0, 1] of the activations the default partition saves for the backward: below 1
    the partitioner recomputes cheap ops in the backward instead of saving their outputs (less memory, some
    recompute); ValueError outside (0, 1]. Graphs compiled without gradients take the inference options
    (inductor_options(training=False)); with the C++ wrapper the backward is compiled with the forward."""
    device_type = _device_type(model)
    options = inductor_options(mode, dynamic, overrides, device_type)
    inference = inductor_options(mode, dynamic, overrides, device_type, training=False)
    functorch_config: dict[str, object] = {}
    if memory_budget is not None:
        check_memory_budget(memory_budget)
        functorch_config["activation_memory_budget"] = float(memory_budget)
    if options.get("cpp_wrapper"):
        functorch_config["force_non_lazy_backward_lowering"] = True
    if not functorch_config and inference == options:
        return torch.compile(model, dynamic=dynamic, fullgraph=fullgraph, options=options)
    return torch.compile(model, dynamic=dynamic, fullgraph=fullgraph, backend=_InductorBackend(
        options, dynamic, functorch_config, None if inference == options else inference))
