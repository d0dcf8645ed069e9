"""fused_mlp_act: fc1 + GELU as one GEMM with cuBLASLt's GELU epilogue (swin.models.swin_transformer.fc1_gelu_epilogue).

CPU (CI): the epilogue never runs on the CPU, in float32 or with gradients; the model's logits and gradients are the
unfused model's exactly; the flag round-trips through create_model, set_fused_mlp_act and the Hydra model config.
With the CPU added to EPILOGUE_DEVICES (there torch._addmm_activation is addmm then exact GELU) the
path's own logic runs: which inputs take it, autocast's casts, shapes, and tracing with fullgraph=True.
GPU (``-m gpu`` / ``-k gpu``): the epilogue's error against float64 exact GELU(fc1(x)) is the unfused half path's,
at op level and for the compiled Swin-T, whose generated code calls it and runs no stand-alone GELU kernel.
Training (mlp_with_gelu_epilogue: that GEMM, fc1 recomputed in the backward): the autograd Function is gradchecked in
float64; with the CPU among the epilogue's devices the model's compiled bf16 step runs every MLP through it (eager
steps do not), keeps no 4C-wide activation and matches the unfused model; on the GPU its bf16 errors are within the
unfused path's.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from _inductor_code import triton_kernels
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.utils._python_dispatch import TorchDispatchMode

import swin
import swin.models.swin_transformer as swin_model
from swin.models.swin_transformer import _GeluEpilogueMlp, fc1_gelu_epilogue

EPILOGUE_OP = "_addmm_activation"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class OpLog(TorchDispatchMode):
    """Counts the aten ops a region dispatches (after autocast), by name without overload."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def n_blocks(model: nn.Module) -> int:
    return sum(len(stage.blocks) for stage in model.layers)


def model_pair(name: str = "swin_micro", device: str = "cpu", flag: str = "fused_mlp_act",
               **kwargs) -> tuple[nn.Module, nn.Module]:
    """(unfused, fused) models (create_model's `flag` off, on) with the same weights, perturbed so that no bias is
    zero."""
    plain = swin.create_model(name, **{flag: False}, drop_path_rate=0.0, **kwargs)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(0.02 * torch.randn_like(p))
    fused = swin.create_model(name, drop_path_rate=0.0, **kwargs)
    fused.load_state_dict(plain.state_dict())
    return plain.to(device).eval(), fused.to(device).eval()


def autocast_or_not(device: str, dtype: torch.dtype | None):
    return torch.autocast(device, dtype=dtype, enabled=dtype is not None)


# --- CPU ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "autocast-bf16"])
def test_cpu_inference_is_the_unfused_model(amp):
    """On the CPU the flag changes nothing: the same logits, bit for bit, and no epilogue op."""
    plain, fused = model_pair(attention="standard")
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad(), autocast_or_not("cpu", amp):
        want = plain(x)
        with OpLog() as log:
            got = fused(x)
    assert EPILOGUE_OP not in log.counts
    assert torch.equal(got, want)


def test_flag_round_trips():
    """On by default; create_model(fused_mlp_act=False), set_fused_mlp_act and model.fused_mlp_act (Hydra) set it on
    every block."""
    from _train_utils import make_cfg  # Hydra: imported here, the GPU tests do without it
    from omegaconf import OmegaConf

    from swin.config import to_settings
    from swin.train.distributed import DistInfo
    from swin.train.setup import _build_model

    def flags(model: nn.Module) -> set[bool]:
        return {b.fused_mlp_act for stage in model.layers for b in stage.blocks}

    assert flags(swin.create_model("swin_micro")) == {True}
    model = swin.create_model("swin_micro", fused_mlp_act=False)
    assert flags(model) == {False}
    assert model.set_fused_mlp_act(True) is model and flags(model) == {True}
    assert flags(model.set_fused_mlp_act(False)) == {False}
    dist = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    assert make_cfg().model.fused_mlp_act is True
    cfg = make_cfg("model.fused_mlp_act=false")
    assert flags(_build_model(to_settings(cfg), dist, num_classes=10)) == {False}
    assert flags(_build_model(to_settings(make_cfg()), dist, num_classes=10)) == {True}
    assert OmegaConf.to_container(cfg.model)["fused_mlp_act"] is False


@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "autocast-bf16"])
@pytest.mark.parametrize("devices", [("cuda",), ("cuda", "cpu")], ids=["cpu", "cpu-as-epilogue-device"])
def test_eager_training_step_is_the_unfused_model(monkeypatch, amp, devices):
    """An eager training step takes no epilogue, on the CPU and even with the CPU among the epilogue's devices (the
    training path is for compiled graphs): the unfused model's loss and gradients, bit for bit."""
    monkeypatch.setattr(swin_model, "EPILOGUE_DEVICES", devices)
    plain, fused = model_pair(attention="standard")
    plain.train()
    fused.train()
    x, y = torch.randn(2, 3, 16, 16), torch.randint(0, plain.num_classes, (2,))
    with autocast_or_not("cpu", amp):
        loss_plain = F.cross_entropy(plain(x), y)
        with OpLog() as log:
            loss_fused = F.cross_entropy(fused(x), y)
    loss_plain.backward()
    loss_fused.backward()
    assert EPILOGUE_OP not in log.counts
    assert torch.equal(loss_fused, loss_plain)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert torch.equal(p.grad, q.grad), name


def _fc1(k: int, dtype: torch.dtype = torch.float32, device: str = "cpu", bias: bool = True) -> nn.Linear:
    fc1 = nn.Linear(k, 4 * k, bias=bias, device=device, dtype=dtype)
    with torch.no_grad():
        fc1.weight.copy_(torch.randn_like(fc1.weight) * k ** -0.5)
        if bias:
            fc1.bias.copy_(torch.randn_like(fc1.bias))
    return fc1


def test_which_inputs_take_the_epilogue(monkeypatch):
    """With the CPU among the epilogue's devices: half precision without gradients takes it (autocast, or half
    inputs and weights), with autocast's casts and the input's leading shape; float32, float64 under autocast, mixed
    dtypes, gradients, fc1 without bias or another activation than nn.GELU fall back (None)."""
    monkeypatch.setattr(swin_model, "EPILOGUE_DEVICES", ("cuda", "cpu"))
    fc1, gelu = _fc1(24), nn.GELU()
    x = torch.randn(2, 3, 5, 24)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fc1_gelu_epilogue(x, fc1, gelu)
            want = gelu(fc1(x))
            assert fc1_gelu_epilogue(x, fc1, nn.GELU(approximate="tanh")) is not None
            assert fc1_gelu_epilogue(x.double(), fc1, gelu) is None  # autocast leaves float64 alone
        assert y.shape == (2, 3, 5, 96) and y.dtype == torch.bfloat16
        assert rel_err(y, want) < 1e-2
        half = _fc1(24, torch.bfloat16)
        assert fc1_gelu_epilogue(x.bfloat16(), half, gelu).dtype == torch.bfloat16
        assert fc1_gelu_epilogue(x, half, gelu) is None  # mixed dtypes: F.linear's error, not ours
        assert fc1_gelu_epilogue(x, fc1, gelu) is None  # float32 keeps the exact GELU
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert fc1_gelu_epilogue(x, _fc1(24, bias=False), gelu) is None
            assert fc1_gelu_epilogue(x, fc1, nn.ReLU()) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fc1_gelu_epilogue(x, fc1, gelu) is None  # gradients on
    monkeypatch.setattr(swin_model, "EPILOGUE_DEVICES", ("cuda",))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert fc1_gelu_epilogue(x, fc1, gelu) is None  # the CPU is not an epilogue device


def test_model_path_traces_with_fullgraph(monkeypatch):
    """With the CPU among the epilogue's devices, the fused model under autocast and no_grad calls the epilogue once
    per block, compiles with fullgraph=True (no graph break in the autocast queries), and gives the unfused logits
    to bf16 precision."""
    monkeypatch.setattr(swin_model, "EPILOGUE_DEVICES", ("cuda", "cpu"))
    plain, fused = model_pair(attention="standard")
    x = torch.randn(2, 3, 16, 16)
    torch._dynamo.reset()
    graphs = []

    def recording_backend(gm, example_inputs):  # keeps the traced graph, runs it as is
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(fused, fullgraph=True, backend=recording_backend)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain(x)
        with OpLog() as log:
            got = fused(x)
        got_compiled = compiled(x)
    assert log.counts.get(EPILOGUE_OP) == n_blocks(fused)
    traced = [node for gm in graphs for node in gm.graph.nodes
              if getattr(node.target, "__name__", str(node.target)) == EPILOGUE_OP]
    assert len(traced) == n_blocks(fused)  # the compiled graph takes the epilogue too, not the unfused fallback
    assert rel_err(got, want) < 1e-2 and rel_err(got_compiled, want) < 1e-2
    torch._dynamo.reset()


def test_gelu_epilogue_mlp_gradients_are_exact():
    """_GeluEpilogueMlp in float64 on the CPU (where _addmm_activation is addmm then exact GELU): values equal
    fc2(gelu(fc1(x))), and gradcheck holds for x and every weight and bias (fc1 recomputed in the backward)."""
    dt = torch.float64
    args = [torch.randn(6, 8, dtype=dt), torch.randn(32, 8, dtype=dt) / 3, torch.randn(32, dtype=dt),
            torch.randn(5, 32, dtype=dt) / 6, torch.randn(5, dtype=dt)]
    args = [a.requires_grad_() for a in args]
    want = F.linear(F.gelu(F.linear(args[0], args[1], args[2])), args[3], args[4])
    assert torch.allclose(_GeluEpilogueMlp.apply(*args), want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(_GeluEpilogueMlp.apply, args)


def hidden_shapes(model: nn.Module, batch: int) -> set[tuple[int, int]]:
    """(tokens, 4C) of each stage's MLP hidden activation for a batch of the model's img_size."""
    shapes = set()
    for stage in model.layers:
        block = stage.blocks[0]
        shapes.add((batch * block.feat_size[0] * block.feat_size[1], block.mlp.fc1.out_features))
    return shapes


def kept_hidden(shapes: list[tuple[int, ...]], hidden: set[tuple[int, int]]) -> int:
    """How many of the tensors kept for the backward (their shapes) hold an MLP hidden activation."""
    return sum((math.prod(s[:-1]), s[-1]) in hidden for s in shapes if len(s) >= 2)


def test_compiled_training_mlp_takes_the_epilogue(monkeypatch):
    """With the CPU among the epilogue's devices, a bf16 autocast training step compiled with fullgraph=True runs
    every block's MLP through _GeluEpilogueMlp (in the forward graph), keeps no 4C-wide hidden activation for the
    backward (the unfused model keeps one per block), and gives the unfused model's loss and gradients to bf16
    precision; float32 does not take it."""
    monkeypatch.setattr(swin_model, "EPILOGUE_DEVICES", ("cuda", "cpu"))
    plain, fused = model_pair(attention="standard")
    plain.train()
    fused.train()
    batch = 2
    x, y = torch.randn(batch, 3, 16, 16), torch.randint(0, plain.num_classes, (batch,))
    hidden = hidden_shapes(fused, batch)
    torch._dynamo.reset()
    forward_graphs = []

    def keep_forward(gm, example_inputs):
        forward_graphs.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=keep_forward, bw_compiler=lambda gm, _: make_boxed_func(gm.forward))
    run = torch.compile(fused, fullgraph=True, backend=backend)
    saved: list[tuple[int, ...]] = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            loss_plain = F.cross_entropy(plain(x), y)
        loss_fused = F.cross_entropy(run(x), y)
    loss_plain.backward()
    loss_fused.backward()
    assert kept_hidden(saved, hidden) >= n_blocks(plain)  # the measure sees what the unfused model keeps
    nodes = [n for gm in forward_graphs for n in gm.graph.nodes]
    assert sum(n.target is torch.ops.aten._addmm_activation.default for n in nodes) == n_blocks(fused)
    outputs = [n for n in nodes if n.op == "output"]
    kept = [tuple(a.meta["val"].shape) for o in outputs for a in torch.utils._pytree.tree_leaves(o.args)
            if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
    assert kept and kept_hidden(kept, hidden) == 0
    assert abs(loss_fused.item() - loss_plain.item()) < 1e-2 * abs(loss_plain.item())
    want = torch.cat([p.grad.flatten() for p in plain.parameters()])
    got = torch.cat([p.grad.flatten() for p in fused.parameters()])
    assert rel_err(got, want) < 2e-2
    forward_graphs.clear()
    run(x)  # float32 keeps the exact GELU
    assert not any(n.target is torch.ops.aten._addmm_activation.default for gm in forward_graphs
                   for n in gm.graph.nodes)
    torch._dynamo.reset()


# --- GPU ------------------------------------------------------------------------------------------------------------

def _errors(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative L2, max abs) error against a float64 reference."""
    diff = y.double() - ref
    return (diff.norm() / ref.norm()).item(), diff.abs().max().item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k", [96, 192, 384, 768])  # Swin-T's fc1 inputs
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("autocast", [False, True], ids=["half-weights", "autocast"])
def test_gpu_epilogue_error_is_the_unfused_half_paths(k, dtype, autocast):
    """cuBLASLt's tanh GELU on the fp32 accumulator, rounded once, against float64 exact GELU(fc1(x)): relative L2
    error within 1.1x of fc1 + exact GELU in the same precision, max abs within 1.5x."""
    param_dtype = torch.float32 if autocast else dtype
    fc1, gelu = _fc1(k, param_dtype, "cuda"), nn.GELU()
    x = torch.randn(8, 23, 29, k, device="cuda", dtype=param_dtype)
    with torch.no_grad(), autocast_or_not("cuda", dtype if autocast else None):
        y = fc1_gelu_epilogue(x, fc1, gelu)
        unfused = gelu(fc1(x))
    assert y is not None and y.dtype == dtype and y.shape == unfused.shape == (8, 23, 29, 4 * k)
    # exact math on the half-precision values both paths multiply (autocast rounds x, weight and bias alike)
    ref = F.gelu(F.linear(*(t.to(dtype).double() for t in (x, fc1.weight, fc1.bias))))
    (rel, max_abs), (rel_unfused, max_abs_unfused) = _errors(y, ref), _errors(unfused, ref)
    assert rel <= 1.1 * rel_unfused + 1e-6, (rel, rel_unfused)
    assert max_abs <= 1.5 * max_abs_unfused, (max_abs, max_abs_unfused)


def compiled_bf16_pair(plain: nn.Module, fused: nn.Module) -> list[tuple[float, str]]:
    """[(relative L2 error against plain's float32 logits, inductor's generated code)] of plain and fused Swin-T
    models (CUDA), each compiled with fullgraph=True and run under bf16 autocast without gradients."""
    from torch._inductor.utils import run_and_get_code

    x = torch.randn(4, 3, 224, 224, device="cuda")
    with torch.no_grad():
        ref = plain(x).double()
    results = []
    for model in (plain, fused):
        torch._dynamo.reset()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            # plain torch.compile: the checks read kernel names, which combo kernels (compile_model) leave out
            out, code = run_and_get_code(torch.compile(model, fullgraph=True), x)
        results.append((rel_err(out, ref), "\n".join(code)))
    torch._dynamo.reset()
    return results


@pytest.mark.gpu
@needs_cuda
def test_gpu_compiled_bf16_model_uses_the_epilogue():
    """Swin-T, bf16 autocast, no_grad, torch.compile(fullgraph=True): fused and unfused logits equally close to the
    model's float32 logits; the fused model's generated code calls _addmm_activation and has no GELU kernel left,
    the unfused one's has GELU kernels and no epilogue."""
    (err_plain, code_plain), (err_fused, code_fused) = compiled_bf16_pair(
        *model_pair("swin_tiny_patch4_window7_224", "cuda", attention="sdpa"))
    assert err_fused <= 1.25 * err_plain + 1e-3, (err_fused, err_plain)
    assert EPILOGUE_OP in code_fused and EPILOGUE_OP not in code_plain
    gelu_kernels = {name: [k for k in triton_kernels([code]) if "gelu" in k]
                    for name, code in (("plain", code_plain), ("fused", code_fused))}
    assert gelu_kernels["plain"], "the unfused model's code has no GELU kernel: the check below proves nothing"
    assert not gelu_kernels["fused"], gelu_kernels["fused"]


@pytest.mark.gpu
@needs_cuda
def test_gpu_float32_model_keeps_exact_gelu():
    """A float32 CUDA model (no autocast) with the flag on runs fc1 and the exact GELU: no epilogue op, the unfused
    model's logits."""
    plain, fused = model_pair("swin_tiny_patch4_window7_224", "cuda", attention="sdpa")
    x = torch.randn(2, 3, 224, 224, device="cuda")
    with torch.no_grad():
        want = plain(x)
        with OpLog() as log:
            got = fused(x)
    assert EPILOGUE_OP not in log.counts and log.counts.get("gelu") == n_blocks(fused)
    assert rel_err(got, want) < 1e-6


@needs_cuda
@pytest.mark.parametrize("k", [96, 384])
def test_gpu_gelu_epilogue_mlp_error_is_the_unfused_half_paths(k):
    """_GeluEpilogueMlp in bf16 (forward: cuBLASLt's tanh-GELU epilogue; backward: fc1 recomputed): output and every
    gradient within twice the error of the unfused bf16 path (F.linear, exact GELU, F.linear) against float64 exact
    GELU, or within 1e-2, at Swin-T's stage-1 and stage-3 widths."""
    g = torch.Generator(device="cuda").manual_seed(k)
    m = 3136 * 2

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.float64) * scale

    ref = [rand(m, k), rand(4 * k, k, scale=k ** -0.5), rand(4 * k), rand(k, 4 * k, scale=(4 * k) ** -0.5), rand(k)]
    grad = rand(m, k)

    def grads(fn, tensors):
        tensors = [t.detach().requires_grad_() for t in tensors]
        out = fn(*tensors)
        out.backward(grad.to(out.dtype))
        return [out.detach()] + [t.grad for t in tensors]

    def unfused(x, w1, b1, w2, b2):
        return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)

    want = grads(unfused, ref)
    half = [t.bfloat16() for t in ref]
    fused = grads(_GeluEpilogueMlp.apply, half)
    plain = grads(unfused, half)
    for name, a, b, w in zip(["out", "x", "w1", "b1", "w2", "b2"], fused, plain, want):
        assert rel_err(a, w) < max(2 * rel_err(b, w), 1e-2), (name, rel_err(a, w), rel_err(b, w))
