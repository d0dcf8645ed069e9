"""How the kernels become PyTorch ops: torch.compile sees their launches on the GPU, the interpreter runs them on
the CPU (TRITON_INTERPRET=1, for tests)."""
from __future__ import annotations

import os

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.library import custom_op, triton_op, wrap_triton


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def eager_launch(x: torch.Tensor) -> bool:
    """Whether a launch on data like x runs now, eagerly, rather than being traced by torch.compile: a triton_op's
    body is traced on fake tensors (there ``torch.compiler.is_compiling()`` can be False), and launch options such as
    ``launch_pdl`` or ``maxnreg`` do not reach the compiled code."""
    return not torch.compiler.is_compiling() and not is_fake(x)


def launch(kernel, grid: tuple[int], *args, **keywords):
    """Launches a kernel: where torch.compile traces it (fake tensors), through wrap_triton, so the compiled code
    inlines the launch; an eager call (args[0] a real tensor, not compiling) straight away, as wrap_triton outside
    a compiled graph would dispatch a higher-order op per launch; under the Triton interpreter, straight away on
    real tensors and not at all on fake ones (the ops' shape functions, see kernel_op: no data to run on)."""
    if interpreting():
        if any(is_fake(a) for a in args if isinstance(a, torch.Tensor)):
            return None
        return kernel[grid](*args, **keywords)
    if eager_launch(args[0]):
        return kernel[grid](*args, **keywords)
    return wrap_triton(kernel)[grid](*args, **keywords)


def launch_direct(kernel, grid: tuple[int], *args, **keywords):
    """Launches a kernel that torch.compile never traces (the data pipeline's) straight away. Through wrap_triton
    outside a triton_op (whose eager calls skip it), every launch would dispatch a higher-order op, which costs more
    host time than the data pipeline's kernels themselves."""
    return kernel[grid](*args, **keywords)


def kernel_op(name: str):
    """A ``triton_op``: torch.compile traces into its body and inlines the kernel launches.

    Under TRITON_INTERPRET a kernel is plain Python that compile cannot trace, so the op is an opaque
    ``custom_op`` there (the body, which skips launches on fake tensors, is its shape function); tracing
    into it would record the output allocation without the kernel that fills it.
    """
    if not interpreting():
        return triton_op(name, mutates_args=())

    def register(fn):
        op = custom_op(name, fn, mutates_args=())
        op.register_fake(fn)
        return op
    return register
