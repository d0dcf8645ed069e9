"""kernels.linear_gelu (fc1 + exact GELU in one kernel) against float64 math, and the model's use of it."""
import pytest
import torch
import torch.nn.functional as F

import kernels.linear_gelu as lg
import swin
from kernels.linear_gelu import linear_gelu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-6, torch.float16: 2e-3}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("shape,out_features,bias,dtype", [
    ((2, 37, 96), 384, True, torch.float32),   # rows and columns not multiples of the tiles, K of Swin's stage 1
    ((50, 40), 33, False, torch.float16),      # K not a multiple of the K tile, no bias
    ((3, 5, 7, 24), 96, True, torch.float32),  # NHWC features, as the blocks pass them
    ((300, 24), 20, True, torch.float32),      # more row blocks than a group, fewer columns than a tile
    ((1100, 64), 40, True, torch.float16),     # on the GPU: a row block past the first (the 64-bit row base)
])
def test_matches_float64_gelu_of_linear(shape, out_features, bias, dtype):
    x = torch.randn(*shape, device=DEVICE, dtype=dtype)
    weight = torch.randn(out_features, shape[-1], device=DEVICE, dtype=dtype) / shape[-1] ** 0.5
    b = torch.randn(out_features, device=DEVICE, dtype=dtype) if bias else None
    with torch.no_grad():
        y = linear_gelu(x, weight, b)
    ref = F.gelu(F.linear(x.double(), weight.double(), None if b is None else b.double()))
    assert y.shape == ref.shape and y.dtype == dtype
    assert rel_err(y, ref) < TOL[dtype]


def test_refuses_gradients_and_mismatched_shapes():
    x, weight = torch.randn(4, 8, device=DEVICE), torch.randn(16, 8, device=DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match="forward only"):
        linear_gelu(x, weight)
    with torch.no_grad(), pytest.raises(ValueError, match=r"x \(\.\.\., 8\) does not fit weight \(16, 9\)"):
        linear_gelu(x, torch.randn(16, 9, device=DEVICE))


def test_model_uses_it_without_gradients_only(monkeypatch):
    """fused_mlp_act: inference through the kernel gives the unfused model's logits (1e-5); a training step does not
    take it (its gradients are the unfused model's exactly)."""
    calls = []
    monkeypatch.setattr(lg, "linear_gelu", lambda *a: calls.append(1) or linear_gelu(*a))
    plain = swin.create_model("swin_micro", attention="standard", img_size=(22, 26), drop_path_rate=0.0).to(DEVICE)
    with torch.no_grad():  # non-zero biases
        for p in plain.parameters():
            p.add_(0.05 * torch.randn_like(p))
    fused = swin.create_model("swin_micro", attention="standard", img_size=(22, 26), drop_path_rate=0.0,
                              fused_mlp_act=True).to(DEVICE)
    fused.load_state_dict(plain.state_dict())
    assert all(b.fused_mlp_act for s in fused.layers for b in s.blocks)
    x = torch.randn(2, 3, 22, 26, device=DEVICE)
    with torch.no_grad():
        assert rel_err(fused(x), plain(x)) < 1e-5
    blocks = sum(len(s.blocks) for s in fused.layers)
    assert len(calls) == blocks
    fused(x).sum().backward()
    plain(x).sum().backward()
    assert len(calls) == blocks
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert torch.equal(p.grad, q.grad), name
    fused.set_fused_mlp_act(False)
    with torch.no_grad():
        fused(x)
    assert len(calls) == blocks


@pytest.mark.gpu
def test_gpu_compiled_inference_runs_no_standalone_gelu():
    """bf16, compiled: the fused model's logits within bf16 tolerance of the unfused one's, and inductor's step runs
    linear_gelu_kernel where it ran a GELU kernel before (what the fusion is for)."""
    from torch.profiler import ProfilerActivity, profile
    plain = swin.create_model("swin_tiny_patch4_window7_224", attention="flash_window").cuda().eval()
    fused = swin.create_model("swin_tiny_patch4_window7_224", attention="flash_window", fused_mlp_act=True)
    fused = fused.cuda().eval()
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(8, 3, 224, 224, device="cuda")
    kernels = {}
    for name, model in (("plain", plain), ("fused", fused)):
        run = torch.compile(model, fullgraph=True)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            out = run(x)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run(x)
                torch.cuda.synchronize()
        kernels[name] = {e.key for e in prof.key_averages() if e.device_type.name == "CUDA"}
        kernels[name + "_out"] = out.float()
    assert rel_err(kernels["fused_out"], kernels["plain_out"]) < 3e-2
    assert any("gelu" in k and "linear_gelu" not in k for k in kernels["plain"])
    assert any("linear_gelu_kernel" in k for k in kernels["fused"])
    assert not any("gelu" in k and "linear_gelu" not in k for k in kernels["fused"]), kernels["fused"]
