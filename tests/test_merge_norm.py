"""fused_merge_norm: each stage's last residual add, the next stage's 2x2 merge and its LayerNorm as one kernel
(kernels.merge_norm), in inference.

CPU (CI, the kernel in the Triton interpreter): the op against float64 x + delta -> pad -> merge -> LayerNorm, odd
sizes included; its errors for bad input; the model with the CPU added to MERGE_NORM_DEVICES gives the
unfused logits (eager and compiled with fullgraph=True) and calls the op once per merge, while training, V2 and the
flag turned off never call it; the flag round-trips through create_model and the Hydra model config.
GPU (``-m gpu`` / ``-k gpu``): half-precision errors no larger than the unfused path's; the compiled bf16 Swin-T
runs the kernel at its three merges and gives the unfused logits.
"""
from __future__ import annotations

import pytest
import test_mlp_act as mlp_act_tests
import torch
import torch.nn as nn
import torch.nn.functional as F

import swin
import swin.models.swin_transformer as swin_model
from kernels.merge_norm import merge_norm

OP = "merge_norm"


class OpLog:
    """Counts the merge_norm kernel's launches in a region (under ``counts[OP]``): eager calls launch it without an
    op dispatch, so launches are what tells whether the model took the kernel."""

    def __enter__(self) -> OpLog:
        import kernels.merge_norm as mn
        self.counts: dict[str, int] = {}
        self._module, self._launch = mn, mn.launch

        def record(kernel, *args, **keywords):
            if kernel is mn.merge_norm_kernel:
                self.counts[OP] = self.counts.get(OP, 0) + 1
            return self._launch(kernel, *args, **keywords)

        mn.launch = record
        return self

    def __exit__(self, *exc) -> None:
        self._module.launch = self._launch
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def reference(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
              eps: float = 1e-5) -> torch.Tensor:
    """What the unfused model computes (timm's PatchMerging after the residual add), in float64."""
    s = x.double() + delta.double()
    b, h, w, c = s.shape
    s = F.pad(s, (0, 0, 0, w % 2, 0, h % 2))
    h, w = s.shape[1:3]
    s = s.reshape(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 4, 2, 5).flatten(3)
    return F.layer_norm(s, (4 * c,), weight.double(), bias.double(), eps)


def inputs(shape: tuple[int, ...], x_dtype: torch.dtype, delta_dtype: torch.dtype, device: str = "cpu"):
    c = shape[-1]
    x = torch.randn(shape, device=device).to(x_dtype)
    delta = (0.5 * torch.randn(shape, device=device) + 0.3).to(delta_dtype)
    weight = 1 + 0.3 * torch.randn(4 * c, device=device)
    bias = 0.2 * torch.randn(4 * c, device=device)
    return x, delta, weight, bias


# --- CPU ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 8, 8, 96), (3, 7, 5, 20), (1, 6, 10, 192), (2, 1, 1, 8)])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16)],
                         ids=["fp32", "fp32+bf16"])
def test_op_matches_float64(shape, dtypes):
    """fp32 residual stream (as under autocast) plus an fp32 or bf16 branch: within fp32 rounding of float64."""
    x, delta, weight, bias = inputs(shape, *dtypes)
    with torch.no_grad():
        got = merge_norm(x, delta, weight, bias, 1e-5)
    want = reference(x, delta, weight, bias)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-5)


def test_op_half_inputs_round_the_sum_and_take_out_dtype():
    """fp16 x and delta: the sum is rounded to fp16 before the norm, as PyTorch's add is; out_dtype is honoured."""
    x, delta, weight, bias = inputs((2, 6, 6, 24), torch.float16, torch.float16)
    rounded = (x + delta).float()
    with torch.no_grad():
        got = merge_norm(x, delta, weight, bias)
        as_fp32 = merge_norm(x, delta, weight, bias, out_dtype=torch.float32)
    want = reference(rounded, torch.zeros_like(rounded), weight, bias)
    assert got.dtype == torch.float16 and as_fp32.dtype == torch.float32
    torch.testing.assert_close(as_fp32.double(), want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got.double(), want, atol=4e-3, rtol=2e-3)


def test_op_reads_strided_inputs():
    """x and delta as views with other strides than contiguous ones (a channel slice, a transposed grid)."""
    x, delta, weight, bias = inputs((2, 6, 8, 16), torch.float32, torch.float32)
    wide = torch.randn(2, 6, 8, 40)
    wide[..., 3:19] = x
    x_view = wide[..., 3:19]
    delta_t = delta.transpose(1, 2).contiguous().transpose(1, 2)
    with torch.no_grad():
        got = merge_norm(x_view, delta_t, weight, bias)
    torch.testing.assert_close(got.double(), reference(x, delta, weight, bias), atol=2e-5, rtol=1e-5)


def test_op_errors_name_the_problem():
    x, delta, weight, bias = inputs((2, 4, 4, 8), torch.float32, torch.float32)
    with torch.no_grad():
        with pytest.raises(ValueError, match="one \\(B, H, W, C\\) shape"):
            merge_norm(x, delta[:, :2], weight, bias)
        with pytest.raises(ValueError, match="shape \\(32,\\)"):
            merge_norm(x, delta, weight[:8], bias)
        with pytest.raises(ValueError, match="float16, bfloat16 and float32"):
            merge_norm(x.double(), delta, weight, bias)
    with pytest.raises(ValueError, match="no backward"):
        merge_norm(x, delta, weight.requires_grad_(), bias)


def model_pair(name: str = "swin_micro", device: str = "cpu", **kwargs) -> tuple[nn.Module, nn.Module]:
    return mlp_act_tests.model_pair(name, device, flag="fused_merge_norm", **kwargs)


@pytest.mark.parametrize("kwargs", [{}, dict(img_size=(18, 22), window_size=3)], ids=["16x16", "odd-merges"])
def test_model_takes_the_kernel_at_every_merge(monkeypatch, kwargs):
    """With the CPU among its devices: one op call per merge, the unfused logits in fp32 (eager, and compiled with
    fullgraph=True for the 16x16 input: a compile takes half a minute on the CPU, and the padded merges' arithmetic
    is the eager call's) and to bf16 precision under autocast."""
    monkeypatch.setattr(swin_model, "MERGE_NORM_DEVICES", ("cuda", "cpu"))
    plain, fused = model_pair(**kwargs)
    x = torch.randn(2, 3, *plain.img_size)
    with torch.no_grad():
        want = plain(x)
        with OpLog() as log:
            got = fused(x)
        if not kwargs:
            torch._dynamo.reset()
            torch.testing.assert_close(torch.compile(fused, fullgraph=True)(x), want, atol=1e-5, rtol=1e-5)
            torch._dynamo.reset()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want_bf16, got_bf16 = plain(x), fused(x)
    assert log.counts.get(OP) == len(fused.layers) - 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_bf16.float(), want_bf16.float(), atol=0.05, rtol=0.05)


def test_model_without_the_kernel(monkeypatch):
    """Never the op: with gradients (training), for Swin V2 (norm after the reduction), with the flag off, or on a
    device the kernel does not run on; the training step's loss and gradients are the unfused model's exactly."""
    plain, fused = model_pair()
    x, y = torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,))
    with torch.no_grad(), OpLog() as log:
        fused(x)  # the CPU is not one of its devices
    assert OP not in log.counts
    monkeypatch.setattr(swin_model, "MERGE_NORM_DEVICES", ("cuda", "cpu"))
    _, v2 = model_pair("swinv2_micro")
    fused_off = swin.create_model("swin_micro", fused_merge_norm=False).eval()
    plain.train()
    fused.train()
    with OpLog() as log:
        loss_fused = F.cross_entropy(fused(x), y)
        with torch.no_grad():
            v2(x)
            fused_off(x)
    assert OP not in log.counts
    loss_plain = F.cross_entropy(plain(x), y)
    loss_plain.backward()
    loss_fused.backward()
    assert torch.equal(loss_fused, loss_plain)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_flag_round_trips():
    """On by default; create_model(fused_merge_norm=False) and model.fused_merge_norm (Hydra) turn it off."""
    from _train_utils import make_cfg  # Hydra: imported here, the GPU tests do without it

    from swin.config import to_settings
    from swin.train.distributed import DistInfo
    from swin.train.setup import _build_model

    assert swin.create_model("swin_micro").fused_merge_norm is True
    assert swin.create_model("swin_micro", fused_merge_norm=False).fused_merge_norm is False
    dist = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    assert make_cfg().model.fused_merge_norm is True
    cfg = to_settings(make_cfg("model.fused_merge_norm=false"))
    assert _build_model(cfg, dist, num_classes=10).fused_merge_norm is False


# --- GPU ------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", [(128, 56, 56, 96), (8, 28, 28, 192), (4, 13, 11, 384), (2, 12, 12, 1024)])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
                                    (torch.float16, torch.float16, torch.float16),
                                    (torch.float32, torch.float32, torch.float32)],
                         ids=["autocast-bf16", "bf16", "fp16", "fp32"])
def test_gpu_op_error_is_at_most_the_unfused_paths(shape, dtypes):
    """Against float64: max abs error within 1.05x of the unfused path's (add, pad, permute,
    LayerNorm, cast to the output dtype) plus one rounding step of the output; fp32 within 1e-5."""
    x_dtype, delta_dtype, out_dtype = dtypes
    x, delta, weight, bias = inputs(shape, x_dtype, delta_dtype, "cuda")
    if x_dtype != torch.float32:
        weight, bias = weight.to(x_dtype), bias.to(x_dtype)
    with torch.no_grad():
        got = merge_norm(x, delta, weight, bias, out_dtype=out_dtype)
        s = x + delta
        b, h, w, c = s.shape
        s = F.pad(s, (0, 0, 0, w % 2, 0, h % 2)).unflatten(1, (-1, 2)).unflatten(3, (-1, 2))
        unfused = F.layer_norm(s.permute(0, 1, 3, 4, 2, 5).flatten(3), (4 * c,), weight, bias).to(out_dtype)
    want = reference(x, delta, weight, bias)
    assert got.dtype == out_dtype and got.shape == want.shape
    err, err_unfused = (got.double() - want).abs().max().item(), (unfused.double() - want).abs().max().item()
    ulp = torch.finfo(out_dtype).eps * want.abs().max().item()
    assert err <= 1.05 * err_unfused + ulp, (err, err_unfused)
    if out_dtype == torch.float32:
        assert err < 1e-5


@pytest.mark.gpu
@needs_cuda
def test_gpu_compiled_bf16_model_runs_the_kernel():
    """Swin-T, bf16 autocast, no_grad, torch.compile(fullgraph=True): the fused model's generated code launches the
    merge kernel (three merges), the unfused one's does not, and both give logits equally close to float32."""
    (err_plain, code_plain), (err_fused, code_fused) = mlp_act_tests.compiled_bf16_pair(
        *model_pair("swin_tiny_patch4_window7_224", "cuda", attention="flash_window"))
    assert err_fused <= 1.1 * err_plain + 1e-4, (err_fused, err_plain)
    assert code_fused.count("merge_norm_kernel") >= 3 and "merge_norm_kernel" not in code_plain
