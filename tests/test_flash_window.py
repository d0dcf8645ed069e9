"""Flash window attention kernels against float64 references.

Without CUDA the kernels run through the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1): fp32 and fp16, small shapes. GPU tests (bf16 included) skip without CUDA.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import swin
from kernels.flash_window import flash_window_attention, flash_window_attention_image
from swin.attention import WindowAttentionArgs, standard_attention
from swin.windows import WindowSpec, relative_position_index, shifted_window_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def reference_window_attention(q, k, v, table, window, shift, grid, scale):
    """float64 math of official Swin on window-layout inputs."""
    q, k, v, table = (t.double() for t in (q, k, v, table))
    n = window[0] * window[1]
    bias = table[relative_position_index(window, q.device).view(-1)].view(n, n, -1).permute(2, 0, 1)
    s = scale * q @ k.transpose(-1, -2) + bias
    mask = shifted_window_mask(WindowSpec((grid[0] * window[0], grid[1] * window[1]), window, shift),
                               q.device, torch.float64)
    if mask is not None:
        s = (s.view(-1, mask.shape[0], *s.shape[1:]) + mask[None, :, None]).view(s.shape)
    return s.softmax(-1) @ v


def make_inputs(batch, grid, window, heads, head_dim, dtype, device=DEVICE):
    n = window[0] * window[1]
    bw = batch * grid[0] * grid[1]
    q, k, v = (torch.randn(bw, heads, n, head_dim, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    table = (0.5 * torch.randn((2 * window[0] - 1) * (2 * window[1] - 1), heads, device=device)).requires_grad_()
    return q, k, v, table


def check_window_op(batch, grid, window, shift, heads, head_dim, dtype, device=DEVICE):
    q, k, v, table = make_inputs(batch, grid, window, heads, head_dim, dtype, device)
    scale = head_dim ** -0.5
    out = flash_window_attention(q, k, v, table, window, shift, grid, scale)
    grad = torch.randn_like(out)
    out.backward(grad)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, table)]
    ref = reference_window_attention(*leaves, window, shift, grid, scale)
    ref.backward(grad.double())
    tol = TOL[dtype]
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, ref) < tol, "output"
    for name, ours, theirs in zip("q k v bias_table".split(), (q, k, v, table), leaves):
        assert ours.grad.dtype == ours.dtype
        assert rel_err(ours.grad, theirs.grad) < tol * (2 if name == "bias_table" else 1), name


# CPU-interpreter cases: (batch, grid, window, shift, heads, head_dim, dtype)
CPU_CASES = [
    (2, (2, 2), (4, 4), (2, 2), 2, 16, torch.float32),    # shifted, 16 tokens
    (1, (2, 3), (3, 5), (1, 2), 3, 24, torch.float32),    # non-square window, head_dim not a power of 2
    (2, (2, 2), (7, 7), (0, 0), 2, 32, torch.float16),    # 7x7 unshifted, fp16
    (1, (3, 3), (7, 7), (3, 3), 1, 48, torch.float16),    # 7x7 shifted, head_dim 48
    (1, (2, 2), (8, 8), (4, 4), 1, 16, torch.float32),    # 8x8: one 64-token block
    (1, (2, 2), (12, 12), (6, 6), 1, 32, torch.float32),  # 144 tokens: several query blocks
    (1, (1, 2), (4, 4), (0, 2), 2, 16, torch.float32),    # shift along W only (H was clamped)
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"w{c[2]}s{c[3]}d{c[5]}{str(c[6])[6:]}")
def test_window_op_matches_float64(case):
    check_window_op(*case)


@pytest.mark.parametrize("case", [
    (1, (3, 3), (7, 7), (3, 3), 2, 48, torch.float16),  # 9 windows over the interpreter's 4 programs
    (3, (1, 2), (4, 4), (2, 2), 1, 16, torch.float16),  # 6 windows: the last prefetch lies past the end
], ids=["w7d48", "w4d16"])
def test_window_op_forward_prefetch(case, monkeypatch):
    """The forward's PREFETCH variant (SWIN_FW_PREFETCH=1, a tuning knob) gives the same numbers."""
    monkeypatch.setenv("SWIN_FW_PREFETCH", "1")
    check_window_op(*case)
    if DEVICE == "cpu":
        from kernels.flash_window import _launch_config
        assert _launch_config(9, 2, 49, 48, torch.device(DEVICE))["PREFETCH"]


@pytest.mark.slow
def test_window_op_16x16_window():
    check_window_op(1, (1, 2), (16, 16), (8, 8), 1, 16, torch.float32)


@pytest.mark.parametrize("feat,window,shifted,dtype", [
    ((10, 13), (4, 5), True, torch.float32),   # padded on both axes, shifted
    ((10, 13), (4, 5), False, torch.float32),  # padded, unshifted: padded keys/values (qkv bias) are attended
    ((8, 8), (4, 4), True, torch.float16),     # exact multiple
])
def test_image_op_matches_partitioned_reference(feat, window, shifted, dtype):
    """Fused shift/pad/partition: same numbers as roll + pad + partition + attention (float64)."""
    heads, head_dim, batch = 2, 16, 2
    shift = (window[0] // 2, window[1] // 2) if shifted else (0, 0)
    spec = WindowSpec(feat, window, shift)
    qkv = torch.randn(batch, *feat, 3, heads, head_dim, device=DEVICE, dtype=dtype, requires_grad=True)
    qkv_bias = (0.5 * torch.randn(3, heads, head_dim, device=DEVICE)).requires_grad_()
    table = (0.5 * torch.randn((2 * window[0] - 1) * (2 * window[1] - 1), heads, device=DEVICE)).requires_grad_()
    scale = head_dim ** -0.5
    out = flash_window_attention_image(qkv, table, qkv_bias, spec, scale)
    grad = torch.randn_like(out)
    out.backward(grad)
    leaves = [t.detach().double().requires_grad_() for t in (qkv, table, qkv_bias)]
    args = WindowAttentionArgs(spec, scale, leaves[1], relative_position_index(window, DEVICE),
                               shifted_window_mask(spec, DEVICE, torch.float64), leaves[2])
    ref = standard_attention(leaves[0], args)
    ref.backward(grad.double())
    tol = TOL[dtype]
    assert rel_err(out, ref) < tol
    assert rel_err(qkv.grad, leaves[0].grad) < 2 * tol
    assert rel_err(table.grad, leaves[1].grad) < 2 * tol
    # in shifted blocks padded tokens lie in their own region (-100 to every real query), so the
    # qkv bias gradient is ~e^-100: compare it on the scale of the qkv gradient
    scale_ref = leaves[0].grad.norm() / leaves[0].grad.numel() ** 0.5
    bias_grad, ref_bias_grad = (torch.zeros_like(t) if t.grad is None else t.grad  # None: nothing padded
                                for t in (qkv_bias, leaves[2]))
    assert (bias_grad.double() - ref_bias_grad).abs().max() < 2 * tol * scale_ref * 10
    if not shifted:
        assert rel_err(bias_grad, ref_bias_grad) < 2 * tol


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_model_flash_matches_standard(compiled):
    """Model level: same logits (1e-5) and parameter gradients (1e-4) as the standard backend, fp32.
    compiled: torch.compile(fullgraph=True) of the flash model (no graph breaks; AOT autograd through
    the ops' registered backward). On the CPU the kernels run in the interpreter and the ops stay
    opaque; on the GPU inductor inlines the launches."""
    model = swin.create_model("swin_micro", attention="standard", img_size=(22, 26), drop_path_rate=0.0)
    model = model.to(DEVICE)
    with torch.no_grad():  # non-zero biases, so padded tokens (which hold the qkv bias) matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    flash = swin.create_model("swin_micro", attention="flash_window", img_size=(22, 26), drop_path_rate=0.0)
    flash = flash.to(DEVICE)
    flash.load_state_dict(model.state_dict())
    run = flash
    if compiled:
        torch._dynamo.reset()
        run = torch.compile(flash, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    x = torch.randn(2, 3, 22, 26, device=DEVICE)
    a, b = model(x), run(x)
    assert rel_err(b, a) < 1e-5
    probe = torch.randn_like(a)
    (a * probe).sum().backward()
    (b * probe).sum().backward()
    for (name, p), q in zip(model.named_parameters(), flash.parameters()):
        assert rel_err(q.grad, p.grad) < 1e-4, name


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("attention", ["flash_window", "standard"])
def test_flash_block_moves_no_data_around_attention(attention):
    """Issue 4: in a shifted, padded block the flash path reads qkv and writes its output in image layout:
    no roll, pad, partition permute or copy around attention, forward or backward. The standard
    backend, recorded the same way, shows those ops (so the recorder sees them)."""
    model = swin.create_model("swin_micro", attention=attention, img_size=(22, 26)).to(DEVICE)
    block = model.layers[0].blocks[1]
    assert any(block.shift_size)
    x = torch.randn(2, *block.feat_size, block.norm1.normalized_shape[0], device=DEVICE, requires_grad=True)
    assert block.spec_for(block.feat_size).padded
    with _OpRecorder() as recorder:
        block(x).sum().backward()
    moves = {"roll", "constant_pad_nd", "pad", "clone", "copy_", "_to_copy", "permute", "cat", "index",
             "_unsafe_view", "contiguous", "as_strided"} & recorder.ops
    if attention == "flash_window":
        assert {"flash_window_attn_image", "flash_window_attn_image_bwd"} <= recorder.ops
        assert not moves, moves
    else:
        assert {"roll", "constant_pad_nd", "permute"} <= moves


def test_opcheck():
    q, k, v, table = make_inputs(1, (2, 2), (4, 4), 2, 16, torch.float32)
    args = (q.detach(), k.detach(), v.detach(), table.detach(), [4, 4], [2, 2], [2, 2], 0.25)
    torch.library.opcheck(torch.ops.swin.flash_window_attn.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    spec = WindowSpec((6, 7), (4, 4), (2, 2))
    qkv = torch.randn(1, 6, 7, 3, 2, 16, device=DEVICE)
    fill = torch.randn(2, 2, 16, device=DEVICE)
    rel_index = relative_position_index((4, 4), device=DEVICE)
    torch.library.opcheck(torch.ops.swin.flash_window_attn_image.default,
                          (qkv, table.detach(), rel_index, fill, [4, 4], [2, 2], 0.25),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    assert spec.padded


def test_bad_inputs_raise_clear_errors():
    q, k, v, table = make_inputs(1, (1, 1), (4, 4), 2, 16, torch.float32)
    with pytest.raises(ValueError, match="bias_table must be"):
        flash_window_attention(q, k, v, table[:5], (4, 4))
    with pytest.raises(ValueError, match="not a multiple"):
        flash_window_attention(q, k, v, table, (4, 4), (2, 2), (1, 2))
    with pytest.raises(ValueError, match="float16, bfloat16 and float32"):
        flash_window_attention(q.double(), k.double(), v.double(), table, (4, 4))
    big = torch.randn(1, 1, 17 * 17, 16, device=DEVICE)
    with pytest.raises(ValueError, match="at most 256 tokens"):
        flash_window_attention(big, big, big, torch.randn(33 * 33, 1, device=DEVICE), (17, 17))
    big_wide = torch.randn(1, 1, 144, 96, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim up to 64 for windows of more than 128 tokens"):
        flash_window_attention(big_wide, big_wide, big_wide, torch.randn(23 * 23, 1, device=DEVICE), (12, 12))
    wide = torch.randn(1, 1, 16, 256, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim up to 128"):
        flash_window_attention(wide, wide, wide, torch.randn(49, 1, device=DEVICE), (4, 4))


def test_auto_falls_back_to_sdpa_with_one_warning(monkeypatch):
    import swin.attention as attention
    monkeypatch.setattr(attention, "_auto_warned", set())
    model = swin.create_model("swin_micro", attention="auto", img_size=(16, 16))
    x = torch.randn(1, 3, 16, 16)
    if torch.cuda.is_available():  # an unsupported dtype on CUDA: sdpa with a single warning
        model = model.cuda().double()
        x = x.cuda().double()
    reference = swin.create_model("swin_micro", attention="sdpa").to(x.device, x.dtype)
    reference.load_state_dict(model.state_dict())
    if torch.cuda.is_available():
        with pytest.warns(UserWarning, match="using sdpa instead of flash_window"):
            out = model(x)
    else:  # CPU tensors always take sdpa under auto
        out = model(x)
    assert rel_err(out, reference(x)) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("window,heads,head_dim", [((7, 7), 3, 32), ((8, 8), 4, 48), ((12, 12), 4, 32),
                                                   ((16, 16), 2, 64), ((6, 10), 2, 128), ((7, 7), 6, 16),
                                                   ((10, 10), 2, 128)])  # 128-token tile, widest head
def test_gpu_window_op(window, heads, head_dim, dtype):
    check_window_op(4, (3, 3), window, (window[0] // 2, window[1] // 2), heads, head_dim, dtype, "cuda")
    check_window_op(2, (2, 3), window, (0, 0), heads, head_dim, dtype, "cuda")


@pytest.mark.gpu
def test_gpu_many_windows():
    """More than 65,535 windows x heads: the grid loops over windows."""
    check_window_op(256, (8, 8), (7, 7), (3, 3), 6, 32, torch.bfloat16, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_model_compiled_matches_eager(dtype):
    model = swin.create_model("swin_tiny_patch4_window7_224", attention="flash_window", img_size=(120, 136),
                              drop_path_rate=0.0).cuda()
    reference = swin.create_model("swin_tiny_patch4_window7_224", attention="standard", img_size=(120, 136),
                                  drop_path_rate=0.0).cuda()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, 120, 136, device="cuda")
    compiled = torch.compile(model, fullgraph=True)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        out = compiled(x)
        ref = reference(x)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert rel_err(out.float(), ref.float()) < tol
    probe = torch.randn_like(ref)
    (out.float() * probe).sum().backward()
    (ref.float() * probe).sum().backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        assert rel_err(q.grad, p.grad) < (1e-3 if dtype == torch.float32 else 5e-2), name
