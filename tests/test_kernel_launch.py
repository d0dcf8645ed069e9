"""kernels.ops.launch_direct: eager launches call a cached compiled kernel, keyed on what Triton specialises on, so
a later launch with other alignments or integer values must not reuse a variant compiled for different ones."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels.ops import _specialization, cdiv, launch_direct, next_power_of_2


def test_specialization_key_separates_what_triton_specialises_on():
    x = torch.randn(64)
    table = torch.nn.Parameter(torch.randn(8))
    key = _specialization((x, table, 5, 0.5, True, None))
    assert key == ((torch.float32, True), (torch.float32, True), (False, False, True), float, True, None)
    # a tensor's dtype and 16-byte alignment, not its values or size
    assert _specialization((torch.randn(3),)) == _specialization((x,))
    assert _specialization((x[1:],)) != _specialization((x,))
    assert _specialization((x.half(),)) != _specialization((x,))
    # an integer's being 1, a multiple of 16, a 32-bit value; its other values are not compiled in
    assert _specialization((7,)) == _specialization((9,))
    assert len({_specialization((n,)) for n in (1, 16, 7, 2**31, 32)}) == 4  # 16 and 32 alike
    assert _specialization((0.5,)) == _specialization((2.0,))


def test_host_helpers_equal_tritons():
    assert [next_power_of_2(n) for n in range(1, 3000)] == [triton.next_power_of_2(n) for n in range(1, 3000)]
    assert all(cdiv(a, b) == triton.cdiv(a, b) for a in range(300) for b in range(1, 40))


@triton.jit
def _axpb_kernel(x_ptr, out_ptr, n, a, b, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=keep) * a + b, mask=keep)


@pytest.mark.gpu
def test_gpu_cached_launches_follow_the_arguments():
    """The first launch of each specialization goes through Triton's JIT, later ones call the cached kernel: every
    launch, with aligned and offset tensors, n of 1, of a multiple of 16 and neither, computes x * a + b."""
    base = torch.randn(4096, device="cuda")
    for n, offset, a, b in [(1000, 0, 2, 0.5), (1000, 0, 3, -1.0), (1024, 0, 2, 0.25), (1, 0, 5, 1.0),
                            (999, 1, -2, 3.0), (999, 1, 4, 0.0), (1024, 3, 1, 2.0), (1000, 0, 7, 7.0)]:
        x = base[offset:offset + n]
        out = torch.empty(n + 1, device="cuda")[1:] if offset else torch.empty(n, device="cuda")
        for _ in range(2):  # the second launch of a specialization takes the cached path
            out.zero_()
            launch_direct(_axpb_kernel, (cdiv(n, 256),), x, out, n, a, b, BLOCK=256)
            torch.testing.assert_close(out, x * a + b, rtol=1e-6, atol=1e-6)
