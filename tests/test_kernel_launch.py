"""kernels.ops.launch_direct: eager launches call a cached compiled kernel, keyed on what Triton specialises on, so
a later launch with other alignments or integer values must not reuse a variant compiled for different ones; and
kernels.ops.LaunchReplay: an eager flash op call replays the launches of the first call of its signature, with the
same results as running the op's Python."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import kernels.flash_window.launch as flash_launch
import kernels.ops
from kernels.flash_window import flash_window_attention, flash_window_attention_image, plan
from kernels.ops import (
    LaunchReplay,
    Recording,
    _specialization,
    cdiv,
    launch_direct,
    next_power_of_2,
    recording_launches,
    scratch,
)
from swin.models.windows import WindowSpec, shifted_window_mask


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


def test_replay_refuses_calls_it_cannot_repeat():
    """LaunchReplay.record says None (run the call's Python every time) for a launch argument made inside the call
    that is neither an output nor a scratch buffer, an output no launch writes, an output that is a view, and one
    tensor given as two inputs."""
    x, copy, out, unwritten = torch.randn(8), torch.randn(8), torch.empty(8), torch.empty(4)

    def recording(*args) -> Recording:
        rec = Recording()
        rec.launches.append((object(), (1, 1, 1), args, ()))
        return rec

    assert LaunchReplay.record(Recording(), (x,), (out,)) is None  # nothing launched
    assert LaunchReplay.record(recording(copy, out), (x,), (out,)) is None  # copy: made inside, not an output
    assert LaunchReplay.record(recording(x, out), (x,), (out, unwritten)) is None  # unwritten: a torch op's result
    view = torch.empty(16)[4:12]
    assert LaunchReplay.record(recording(x, view), (x,), (view,)) is None  # a view: not a fresh buffer
    assert LaunchReplay.record(recording(x, out), (x, x), (out,)) is None  # one tensor, two inputs


class _HostKernel:
    """A Triton kernel's stand-in for launches on the CPU: ``kernel[grid](*args)`` (the JIT's first launch) and the
    compiled kernel's ``run`` (its launcher's signature, what launch_direct and LaunchReplay call) run ``body`` on
    the arguments."""

    params: list = []  # no constexpr arguments
    function = packed_metadata = None

    def __init__(self, body):
        self.body, self.runs = body, 0

    def __getitem__(self, grid):
        def first_launch(*args):
            self.run(*(*grid, 1, 1)[:3], None, None, None, None, None, None, *args)
            return self
        return first_launch

    def run(self, grid_x, grid_y, grid_z, stream, function, metadata, launch_metadata, enter, exit_, *args):
        self.runs += 1
        self.body(*args)


def test_replay_hands_out_scratch_outputs_allocated_as_the_call_did(monkeypatch):
    """A call whose outputs are a buffer its first kernel writes whole and a zeroed scratch accumulator its second
    kernel adds into (as the flash backward's fill gradient): the replay on new inputs runs the kernels again, with
    a new accumulator zeroed as the call's was, and equals the call's arithmetic; one tensor returned as two outputs
    is refused."""
    monkeypatch.setattr(kernels.ops, "_INTERPRET", False)  # launch_direct's own path, not the interpreter's
    monkeypatch.setattr(kernels.ops, "_COMPILED", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    double = _HostKernel(lambda x, out: out.copy_(2 * x))
    accumulate = _HostKernel(lambda x, acc, times: acc.add_(x.sum(0) * times))

    def call(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty_like(x)
        acc = scratch((x.shape[1],), x.dtype, x.device, zero=True)
        launch_direct(double, (1,), x, out)
        for _ in range(2):  # added into twice: a replay that did not zero it would be off by the call before
            launch_direct(accumulate, (1,), x, acc, 3)
        return out, acc

    first = torch.randn(5, 4, dtype=torch.float64)
    with recording_launches() as recording:
        outputs = call(first)
    replay = LaunchReplay.record(recording, (first,), outputs)
    assert replay is not None
    previous = outputs
    for _ in range(3):
        x = torch.randn(5, 4, dtype=torch.float64)
        out, acc = replay((x,))
        torch.testing.assert_close(out, 2 * x, rtol=0, atol=0)
        torch.testing.assert_close(acc, 6 * x.sum(0), rtol=1e-12, atol=1e-12)
        assert acc.data_ptr() not in {t.data_ptr() for t in previous}
        previous = out, acc
    assert (double.runs, accumulate.runs) == (4, 8)

    with recording_launches() as recording:
        out, _ = call(first)
    assert LaunchReplay.record(recording, (first,), (out, out)) is None


def _check_replay_is_exact(call: int, op_call, *args, summed_atomically: tuple[int, ...] = ()
                           ) -> tuple[torch.Tensor, ...]:
    """op_call(*args) (eager, replay on) equals bitwise the same call with replay off, except the results at the
    indices summed_atomically (added up by atomics in whatever order the programs run, then rounded to the inputs'
    dtype: equal to within one fp16 rounding); returns its results."""
    got = op_call(*args)
    plan.set_tuning(plan.Tuning(replay=False))
    expected = op_call(*args)
    plan.set_tuning(plan.Tuning())
    for i, (g, e) in enumerate(zip(got, expected)):
        if i in summed_atomically:
            torch.testing.assert_close(g, e, rtol=2e-3, atol=1e-5, msg=lambda m, i=i: f"call {call}, result {i}: {m}")
        else:
            assert torch.equal(g, e), f"call {call}: replayed result {i} differs"
    return got


def _replayed_bodies() -> dict[str, bool]:
    """Which op bodies recorded a replay (True) or were found unreplayable (False)."""
    return {key[0].__name__: bool(replay) for key, replay in flash_launch._REPLAYS.items()}


def _image_call(qkv, table, mask, qkv_bias, logit_scale, window, shift, grad_out):
    """(out, dqkv, dtable, dqkv_bias, dlogit_scale) of one eager image-op call with autograd; logit_scale None, or
    Swin V2's cosine attention with its exp as the scale."""
    qkv, table, qkv_bias = (t.detach().requires_grad_() for t in (qkv, table, qkv_bias))
    leaves = [qkv, table, qkv_bias]
    cosine_scale = None
    if logit_scale is not None:
        leaves.append(logit_scale.detach().requires_grad_())
        cosine_scale = leaves[-1].exp()
    scale = 1.0 if cosine_scale is not None else qkv.shape[-1] ** -0.5
    out = flash_window_attention_image(qkv, table, mask, qkv_bias, window, shift, scale, cosine_scale)
    out.backward(grad_out)
    grads = [t.grad if t.grad is not None else torch.zeros(0) for t in leaves]
    return out.detach(), *grads, *[torch.zeros(0)] * (4 - len(grads))  # an empty one for no logit_scale


@pytest.mark.gpu
@pytest.mark.parametrize("feat, window, shifted, dtype, offset, cosine", [
    ((56, 56), (7, 7), True, torch.bfloat16, 0, False),    # Swin-T stage 1
    ((14, 14), (7, 7), False, torch.float32, 0, False),    # unshifted
    ((20, 26), (7, 7), True, torch.float16, 0, False),     # padded: the fill's gradient (a zeroed accumulator)
    ((24, 24), (12, 12), True, torch.bfloat16, 1, False),  # 12x12 windows; qkv 2 bytes off 16-byte alignment
    ((16, 16), (8, 8), True, torch.bfloat16, 0, True),     # Swin V2: the cosine scale's per-program partial sums
    ((20, 26), (8, 8), True, torch.float32, 0, True),      # Swin V2, padded
])
def test_gpu_replayed_calls_equal_the_ops_python(feat, window, shifted, dtype, offset, cosine):
    """Eager forward+backward of the image op, first call (recorded), replayed calls on new data and the same call
    with replay off give bitwise the same outputs and gradients (the same kernels on the same inputs); forward and
    backward replay, padded maps and Swin V2 included."""
    heads, head_dim, batch = 3, 32, 2
    shift = tuple(w // 2 for w in window) if shifted else (0, 0)
    spec = WindowSpec(feat, window, shift)
    mask = shifted_window_mask(spec, "cuda") if shifted else None
    padded = spec.padded
    flash_launch._REPLAYS.clear()
    try:
        for call in range(3):
            size = batch * feat[0] * feat[1] * 3 * heads * head_dim
            qkv = torch.randn(size + offset, device="cuda", dtype=dtype)[offset:].view(batch, *feat, 3, heads, head_dim)
            table = torch.randn((2 * window[0] - 1) * (2 * window[1] - 1), heads, device="cuda")
            qkv_bias = torch.randn(3, heads, head_dim, device="cuda")  # padded tokens' k and v
            logit_scale = torch.randn(heads, device="cuda") if cosine else None
            grad_out = torch.randn(batch, *feat, heads, head_dim, device="cuda", dtype=dtype)
            got = _check_replay_is_exact(call, _image_call, qkv, table, mask, qkv_bias, logit_scale, window, shift,
                                         grad_out, summed_atomically=(3,))
            # the fill's gradient (padded maps only) and the cosine scale's were compared too
            assert (got[3].numel() > 0, got[4].numel() > 0) == (padded, cosine)
        assert _replayed_bodies() == {"_image_forward": True, "_image_backward": True}
    finally:
        plan.set_tuning(plan.Tuning.from_env())


def _window_call(q, k, v, bias, mask, grid, window, grad_out):
    """(out, dq, dk, dv, dbias) of one eager window-op call with autograd."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v, bias)]
    out = flash_window_attention(*leaves, mask, grid, q.shape[-1] ** -0.5, window_size=window)
    out.backward(grad_out)
    return (out.detach(), *(t.grad for t in leaves))


@pytest.mark.gpu
@pytest.mark.parametrize("dense", [False, True], ids=["table", "dense"])
def test_gpu_replayed_window_calls_equal_the_ops_python(dense):
    """As test_gpu_replayed_calls_equal_the_ops_python, for the window layout (q, k, v per window) of shifted
    Swin-T stage 2 windows, with a bias table and with a dense bias (whose gradient is the call's summed scratch
    buffer itself)."""
    heads, head_dim, batch, window, feat = 6, 32, 2, (7, 7), (28, 28)
    spec = WindowSpec(feat, window, (3, 3))
    windows, area = batch * spec.num_windows, window[0] * window[1]
    mask = shifted_window_mask(spec, "cuda")
    flash_launch._REPLAYS.clear()
    try:
        for call in range(3):
            q, k, v, grad_out = (torch.randn(windows, heads, area, head_dim, device="cuda", dtype=torch.bfloat16)
                                 for _ in range(4))
            bias = (torch.randn(heads, area, area, device="cuda") if dense else
                    torch.randn((2 * window[0] - 1) * (2 * window[1] - 1), heads, device="cuda"))
            _check_replay_is_exact(call, _window_call, q, k, v, bias, mask, spec.grid_size, window, grad_out)
        assert _replayed_bodies() == {"_window_forward": True, "_window_backward": True}
    finally:
        plan.set_tuning(plan.Tuning.from_env())
