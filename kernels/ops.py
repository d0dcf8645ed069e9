"""How the kernels become PyTorch ops: torch.compile sees their launches on the GPU, the interpreter runs them on
the CPU (TRITON_INTERPRET=1, for tests)."""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
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
    grid3 = (*grid, 1, 1)[:3]
    if entry is None:
        compiled = kernel[grid](*args, **keywords)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled  # an asynchronous compile
        tail = tuple(keywords.get(p.name, p.default) for p in kernel.params[len(args):])
        _COMPILED[key] = (compiled, tail)
    else:
        compiled, tail = entry
        stream = torch._C._cuda_getCurrentRawStream(device)
        enter, exit_ = launch_hooks()
        metadata = compiled.launch_metadata(grid3, stream, *args, *tail) if enter is not None else None
        compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata, metadata, enter, exit_, *args,
                     *tail)
    if _ACTIVE.recording is not None:
        _ACTIVE.recording.launches.append((compiled, grid3, args, tail))
    return compiled


def launch_hooks() -> tuple[Any, Any]:
    """Triton's launch enter and exit hooks (profilers such as proton set them), each None where none is set: newer
    Triton keeps them as a hook chain that is never None, and a launch given even an empty one builds its launch
    metadata and calls back into Python."""
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return (enter if getattr(enter, "calls", enter) else None), (exit_ if getattr(exit_, "calls", exit_) else None)


# --- replaying an eager call's launches -----------------------------------------------------------------------------
class Recording:
    """What launch_direct launched inside recording_launches(): per launch (compiled kernel, 3-D grid, positional
    arguments, constexpr tail), and the scratch buffers (:func:`scratch`) the call allocated for its kernels."""

    def __init__(self) -> None:
        self.launches: list[tuple] = []
        self.scratch: list[tuple[torch.Tensor, bool]] = []


class _Active(threading.local):
    recording: Recording | None = None


_ACTIVE = _Active()


@contextmanager
def recording_launches() -> Iterator[Recording]:
    """Records the direct launches (launch_direct) and scratch buffers this thread makes inside the block."""
    previous, _ACTIVE.recording = _ACTIVE.recording, Recording()
    try:
        yield _ACTIVE.recording
    finally:
        _ACTIVE.recording = previous


def _allocate(shape: Sequence[int], dtype: torch.dtype, device: torch.device, zero: bool) -> torch.Tensor:
    return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)


def scratch(shape: Sequence[int], dtype: torch.dtype, device: torch.device, zero: bool = False) -> torch.Tensor:
    """A buffer a call's kernels use that is not one of its outputs (zeroed with ``zero``); a replay of the call
    allocates it anew."""
    buffer = _allocate(shape, dtype, device, zero)
    if _ACTIVE.recording is not None:
        _ACTIVE.recording.scratch.append((buffer, zero))
    return buffer


def _aligned(tensors: Sequence[torch.Tensor | None]) -> tuple[bool, ...]:
    return tuple(t is None or not t.data_ptr() & 15 for t in tensors)


def _fresh(t: torch.Tensor) -> bool:
    """A whole, contiguous buffer of its own (what torch.empty returns)."""
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t.is_contiguous() and t.storage_offset() == 0 and whole


class LaunchReplay:
    """The kernel launches of one eager call, replayed for a later call with the same signature: the same compiled
    kernels, grids and non-tensor arguments, with the later call's tensors in their places and its outputs and
    scratch buffers freshly allocated. Why: an eager op's Python (checks, plans, argument lists, Triton's
    specialisation keys) costs the host more than its launches; a replay is the allocations and the launches.

    The caller keys replays by everything the launches depend on besides the tensors' data: shapes, strides, dtypes,
    device, scalars and tuning. :meth:`record` returns None where a call cannot be replayed: a tensor argument that
    is neither an input, an output nor a scratch buffer (a copy made inside the call), an output that no launch
    writes (made by a torch op) or that is not a fresh buffer, one tensor passed as two inputs, a first input that is
    not a tensor on the outputs' device (a replay allocates like it), or a launch hook (profilers such as proton)
    that wants every launch. The recorded kernels must write the outputs whole (a replay allocates them
    uninitialised), except an output that is one of the call's scratch buffers (a zeroed accumulator the kernels add
    into, say): a replay allocates it as the call did."""

    def __init__(self, recording: Recording, inputs: Sequence[torch.Tensor | None],
                 outputs: Sequence[torch.Tensor]):
        buffers = [b for b, _ in recording.scratch]
        slots = {id(t): i for i, t in enumerate((*inputs, *outputs, *buffers)) if t is not None}
        self.launches = []
        for compiled, grid, args, tail in recording.launches:
            tensor_slots = tuple((i, slots[id(a)]) for i, a in enumerate(args) if isinstance(a, torch.Tensor))
            fixed = [None if isinstance(a, torch.Tensor) else a for a in args]
            self.launches.append((compiled, grid, fixed, tensor_slots, tail))
        # per output: the index of the scratch buffer it is, or None for a buffer of its own
        scratch_index = {id(b): i for i, b in enumerate(buffers)}
        self.outputs = tuple((o.shape, o.dtype, scratch_index.get(id(o))) for o in outputs)
        self.scratch = tuple((b.shape, b.dtype, zero) for b, zero in recording.scratch)
        self.current_device = torch.cuda.current_device()  # whose context the kernels were loaded in
        self.aligned = _aligned(inputs)

    @classmethod
    def record(cls, recording: Recording, inputs: Sequence[torch.Tensor | None],
               outputs: Sequence[torch.Tensor]) -> LaunchReplay | None:
        """A replay of the call on ``inputs`` that returned ``outputs``, made in ``recording``
        (recording_launches), or None where the call cannot be replayed."""
        given = [id(t) for t in inputs if t is not None]
        inputs_, outputs_ = set(given), {id(o) for o in outputs}
        buffers = {id(b) for b, _ in recording.scratch}
        launched = {id(a) for _, _, args, _ in recording.launches for a in args if isinstance(a, torch.Tensor)}
        if (not recording.launches or launch_hooks() != (None, None) or len(inputs_) < len(given)
                or not isinstance(inputs[0], torch.Tensor) or inputs[0].device != outputs[0].device
                or len(outputs_) < len(outputs) or inputs_ & (outputs_ | buffers)
                or not launched <= inputs_ | outputs_ | buffers
                or not all(_fresh(o) and (id(o) in launched or o.numel() == 0) for o in outputs)):
            return None
        return cls(recording, inputs, outputs)

    def __call__(self, inputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor] | None:
        """The outputs of the call on ``inputs``, or None where these inputs' 16-byte alignment differs from the
        recorded call's (Triton compiled the kernels for it), another device is current or a launch hook is set:
        then run the call itself."""
        device = torch.cuda.current_device()
        if _aligned(inputs) != self.aligned or device != self.current_device or launch_hooks() != (None, None):
            return None
        like = inputs[0]  # Tensor.new_empty costs the host less than torch.empty(..., device=...)
        buffers = [(like.new_zeros if zero else like.new_empty)(shape, dtype=dtype)
                   for shape, dtype, zero in self.scratch]
        outputs = [like.new_empty(shape, dtype=dtype) if index is None else buffers[index]
                   for shape, dtype, index in self.outputs]
        slots = (*inputs, *outputs, *buffers)
        stream = torch._C._cuda_getCurrentRawStream(device)
        for compiled, grid, fixed, tensor_slots, tail in self.launches:
            args = fixed.copy()
            for i, slot in tensor_slots:
                args[i] = slots[slot]
            compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)
        return outputs


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
