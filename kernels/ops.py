"""How the kernels become PyTorch ops: torch.compile sees their launches on the GPU, the interpreter runs them on
the CPU (TRITON_INTERPRET=1, for tests)."""
from __future__ import annotations

import os
from typing import Any

import torch
import triton
from torch._subclasses.fake_tensor import is_fake
from torch.library import custom_op, triton_op, wrap_triton
from triton import knobs

# Triton reads TRITON_INTERPRET once, when a kernel is defined; so do these functions
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    return _INTERPRET


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1). Host code's: triton.next_power_of_2 and triton.cdiv are constexpr
    functions whose every host call costs microseconds, paid per launch."""
    return 1 << (n - 1).bit_length() if type(n) is int else triton.next_power_of_2(n)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code (see next_power_of_2); also for symbolic sizes."""
    return -(-a // b)


def eager_launch(x: torch.Tensor) -> bool:
    """Whether a launch on data like x runs now, eagerly, rather than being traced by torch.compile: a triton_op's
    body is traced on fake tensors (there ``torch.compiler.is_compiling()`` can be False), and launch options such as
    ``launch_pdl`` or ``maxnreg`` do not reach the compiled code."""
    if torch.compiler.is_compiling():
        return False
    return type(x) is torch.Tensor or not is_fake(x)  # a plain tensor is never fake: skip the slower check


def launch(kernel, grid: tuple[int, ...], *args, **keywords):
    """Launches a kernel: where torch.compile traces it (fake tensors), through wrap_triton, so the compiled code
    inlines the launch; an eager call (args[0] a real tensor, not compiling) straight away (launch_direct), as
    wrap_triton outside a compiled graph would dispatch a higher-order op per launch; under the Triton interpreter,
    straight away on real tensors and not at all on fake ones (the ops' shape functions, see kernel_op: no data to
    run on)."""
    if _INTERPRET:
        if any(is_fake(a) for a in args if isinstance(a, torch.Tensor)):
            return None
        return kernel[grid](*args, **keywords)
    if eager_launch(args[0]):
        return launch_direct(kernel, grid, *args, **keywords)
    return wrap_triton(kernel)[grid](*args, **keywords)


# compiled kernels of eager launches: (kernel, device, the arguments' specialization, keywords) -> (compiled
# kernel, the constexpr arguments after the positional ones)
_COMPILED: dict[tuple, tuple[Any, tuple]] = {}
_I32 = (-2**31, 2**31)


def _specialization(args: tuple) -> tuple:
    """What Triton specialises a launch on, per positional argument: a tensor's dtype and 16-byte alignment, an
    integer's being 1, a multiple of 16 and 32-bit; a float's type; anything else by value. (A loop testing the
    exact type first: it runs per eager launch, and is cheaper than isinstance tests in a comprehension.)"""
    low, high = _I32
    key = []
    for a in args:
        kind = type(a)
        if kind is int:
            key.append((a == 1, not a & 15, low <= a < high))
        elif kind is torch.Tensor or isinstance(a, torch.Tensor):
            key.append((a.dtype, not a.data_ptr() & 15))
        else:
            key.append(float if kind is float else a)
    return tuple(key)


def launch_direct(kernel, grid: tuple[int, ...], *args, **keywords):
    """Launches a kernel straight away (eager calls, the data pipeline's kernels): the first launch of each
    specialization goes through Triton's JIT (which compiles or finds the kernel), later ones call the compiled
    kernel's launcher directly, skipping the JIT's argument binding and cache-key work, which costs more host time
    than the launch itself. Triton's check that the kernel's global values have not changed is skipped (the
    kernels here read none)."""
    if _INTERPRET:
        return kernel[grid](*args, **keywords)
    device = torch.cuda.current_device()
    key = (kernel, device, _specialization(args), tuple(keywords.items()))
    entry = _COMPILED.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **keywords)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled  # an asynchronous compile
        tail = tuple(keywords.get(p.name, p.default) for p in kernel.params[len(args):])
        _COMPILED[key] = (compiled, tail)
        return compiled
    compiled, tail = entry
    stream = torch._C._cuda_getCurrentRawStream(device)
    grid = (*grid, 1, 1)
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    metadata = compiled.launch_metadata(grid, stream, *args, *tail) if enter is not None else None
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, metadata, enter,
                 exit_, *args, *tail)
    return compiled


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
