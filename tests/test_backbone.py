"""Swin as a backbone, against timm's own: features_only models (state dicts, NHWC maps, feature_info),
forward_intermediates and prune_intermediate_layers, on non-square inputs with padded windows, V1 and V2, every
backend (flash_window through the Triton interpreter); and a dense head trained over the maps."""
from __future__ import annotations

import pytest
import timm
import timm.models.swin_transformer
import torch
import torch.nn as nn
import torch.nn.functional as F

import swin

# timm before 1.0.31 clamps and pads windows of non-square maps otherwise (its V2 does not pad at all) and keeps
# num_features when pruning: the comparisons hold against timm >= 1.0.31
needs_timm_1031 = pytest.mark.skipif(not hasattr(timm.models.swin_transformer, "calc_stage_window_sizes"),
                                     reason="compares with timm >= 1.0.31's Swin")

# small Swin-T-shaped models: 4 stages, padded windows at every stage, the last stage smaller than its window
V1 = ("swin_tiny_patch4_window7_224", dict(embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4)))
V2 = ("swinv2_tiny_window8_256", dict(embed_dim=16, depths=(2, 2, 2, 2), num_heads=(1, 2, 2, 4)))
SIZES = [((96, 160), 7), ((72, 104), 5), ((128, 64), 6)]


def _pair(version, img_size, window, features_only=False, out_indices=None, attention="sdpa"):
    """timm's model and ours with timm's (perturbed) weights, both in eval mode."""
    name, arch = version
    kw = dict(arch, img_size=img_size, window_size=window)
    extra = dict(features_only=True, out_indices=out_indices) if features_only else {}
    ref = timm.create_model(name, **kw, **extra).eval()
    with torch.no_grad():  # V2 starts with zero post-norms: make every block do something
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ours = swin.create_model(name, attention=attention, **kw, **extra).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


def _close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-5) -> None:
    assert ours.shape == ref.shape
    err = float((ours - ref).abs().max() / ref.abs().max())
    assert err < rtol, err


@needs_timm_1031
@pytest.mark.parametrize("version", [V1, V2], ids=["v1", "v2"])
@pytest.mark.parametrize("img_size, window", SIZES)
@pytest.mark.parametrize("out_indices", [(0, 1, 2, 3), (1, 3), (-1,)])
def test_features_only_is_timms(version, img_size, window, out_indices):
    ref, ours = _pair(version, img_size, window, features_only=True, out_indices=out_indices)
    assert sorted(ours.state_dict()) == sorted(ref.state_dict())
    ref.load_state_dict(ours.state_dict(), strict=True)  # and the reverse
    assert ours.feature_info.channels() == ref.feature_info.channels()
    assert ours.feature_info.reduction() == ref.feature_info.reduction()
    x = torch.randn(2, 3, *img_size)
    with torch.no_grad():
        maps, expected = ours(x), ref(x)
    assert len(maps) == len(out_indices)
    for m, e in zip(maps, expected):
        _close(m, e)


@needs_timm_1031
@pytest.mark.parametrize("version", [V1, V2], ids=["v1", "v2"])
@pytest.mark.parametrize("attention", ["standard", "flash_window"])
def test_features_on_every_backend(version, attention):
    img_size, window = SIZES[1]
    ref, ours = _pair(version, img_size, window, features_only=True, attention=attention)
    # flash_window: on the GPU where there is one, else in the Triton interpreter (tests/conftest.py)
    device = "cuda" if attention == "flash_window" and torch.cuda.is_available() else "cpu"
    ref, ours = ref.to(device), ours.to(device)
    x = torch.randn(1, 3, *img_size, device=device)
    with torch.no_grad():
        for m, e in zip(ours(x), ref(x)):
            _close(m, e, rtol=1e-4 if attention == "flash_window" else 1e-5)  # tf32x3 products in the kernel


@pytest.mark.parametrize("version, attention", [(V1, "sdpa"), (V2, "sdpa"), (V1, "flash_window")],
                         ids=["v1-sdpa", "v2-sdpa", "v1-flash_window"])
def test_one_graph_serves_every_input_size(version, attention):
    """torch.compile(dynamic=True): one graph for sizes whose stages pad and sizes that divide the windows (each
    stage would otherwise guard on it), forward and backward, equal to the eager SDPA model at every size."""
    from torch._dynamo.testing import CompileCounterWithBackend

    name, arch = version
    # two stages (shifted blocks, a merge, maps that pad and maps that divide: what each stage would guard on),
    # a graph that compiles in half the time of four; 2 heads and, compiled by inductor, a batch of 2: torch 2.11's
    # inductor failed (KeyError in Scheduler.compute_ancestors) on this graph at batch 1 with 1 head in the first
    # stage, size-1 dims around the kernels' outputs
    arch = dict(arch, depths=(2, 2), num_heads=(2, 2))
    device = "cuda" if attention == "flash_window" and torch.cuda.is_available() else "cpu"
    # the model's own size (its precomputed masks), then the first stage padded (V2, window 8) or not (V1, window 7),
    # then the reverse; every stage has 2 windows or more per axis (where it has one, dynamo specialises on it).
    # The flash kernel in the Triton interpreter (CPU): two smaller sizes, one whose stages divide by the window and
    # one whose stages pad
    sizes = [(288, 320), (308, 336), (320, 352)] if attention != "flash_window" else (
        [(288, 320), (308, 336)] if device == "cuda" else [(112, 128), (120, 136)])

    def create(backend):
        return swin.create_model(name, attention=backend, **arch, features_only=True, dynamic_img_size=True,
                                 img_size=sizes[0]).to(device).eval()  # no stochastic depth: one function

    model = create(attention)
    # the eager reference: the same weights through SDPA (for flash_window: an independent path, and a quick one
    # where the kernel runs in the interpreter)
    reference = model if attention == "sdpa" else create("sdpa")
    reference.load_state_dict(model.state_dict())
    counter = CompileCounterWithBackend("inductor" if device == "cuda" else "eager")  # (inductor: slow on the CPU)
    compiled = torch.compile(model, backend=counter, dynamic=True)
    frames = []
    for size in sizes:
        x = torch.randn(2 if device == "cuda" else 1, 3, *size, device=device, requires_grad=True)
        got = compiled(x)
        frames.append(counter.frame_count)
        grad_got = torch.autograd.grad(sum(m.float().square().mean() for m in got), x)[0]
        expected = reference(x)
        grad_expected = torch.autograd.grad(sum(m.float().square().mean() for m in expected), x)[0]
        for g, e in zip(got, expected):
            _close(g.detach(), e.detach(), rtol=1e-4 if attention == "flash_window" else 1e-5)
        _close(grad_got, grad_expected, rtol=1e-4)
    # no recompile after the first size; that first compile may restart its analysis once (dynamo's pass that
    # turns Python scalars into tensors, seen with inductor on CUDA), which hands the backend an empty graph
    assert frames == [frames[0]] * len(sizes), f"graphs compiled after each size: {frames}"
    graphs = [g for g in counter.graphs if any(n.op == "call_function" for n in g.graph.nodes)]
    assert len(graphs) == 1, f"{len(graphs)} graphs for {len(sizes)} sizes"


@pytest.mark.gpu
def test_gpu_compile_model_backbone_at_two_sizes():
    """swin.compile_model(dynamic=True), as a detector compiles the backbone (our inductor options), on the flash
    backend: a size whose stages divide the windows and one whose stages pad, maps and input gradient equal to the
    eager model's in fp32, and the second size without a recompile."""
    name, arch = V1
    arch = dict(arch, depths=(2, 2), num_heads=(2, 2))  # as test_one_graph_serves_every_input_size
    model = swin.create_model(name, attention="flash_window", **arch, features_only=True, dynamic_img_size=True,
                              img_size=(224, 280)).cuda().eval()
    compiled = swin.compile_model(model, dynamic=True)
    # 56x70 maps, then 75x80 (padded windows, an odd merge); not square first: duck sizing would give a square
    # input's height and width one symbol, and the guard that they are equal would recompile the second size
    for i, size in enumerate([(224, 280), (300, 320)]):
        x = torch.randn(2, 3, *size, device="cuda", requires_grad=True)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = compiled(x)
        grad_got = torch.autograd.grad(sum(m.float().square().mean() for m in got), x)[0]
        expected = model(x)
        grad_expected = torch.autograd.grad(sum(m.float().square().mean() for m in expected), x)[0]
        for g, e in zip(got, expected):
            _close(g.detach(), e.detach(), rtol=1e-4)
        _close(grad_got, grad_expected, rtol=1e-4)


@needs_timm_1031
@pytest.mark.parametrize("version", [V1, V2], ids=["v1", "v2"])
@pytest.mark.parametrize("kwargs", [
    {}, {"indices": 2, "norm": True}, {"indices": [0, -1], "norm": True, "intermediates_only": True},
    {"indices": [1], "stop_early": True}, {"indices": (0, 2), "stop_early": True, "norm": True}])
def test_forward_intermediates_is_timms(version, kwargs):
    img_size, window = SIZES[0]
    ref, ours = _pair(version, img_size, window)
    x = torch.randn(2, 3, *img_size)
    with torch.no_grad():
        got, expected = ours.forward_intermediates(x, **kwargs), ref.forward_intermediates(x, **kwargs)
    if not kwargs.get("intermediates_only"):
        _close(got[0], expected[0])
        got, expected = got[1], expected[1]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        _close(g, e)


@needs_timm_1031
@pytest.mark.parametrize("indices, prune_norm, prune_head", [(2, False, True), ([1], True, True), (4, False, False)])
def test_prune_intermediate_layers_is_timms(indices, prune_norm, prune_head):
    img_size, window = SIZES[0]
    ref, ours = _pair(V1, img_size, window)
    assert ours.prune_intermediate_layers(indices, prune_norm, prune_head) == \
        ref.prune_intermediate_layers(indices, prune_norm, prune_head)
    assert sorted(ours.state_dict()) == sorted(ref.state_dict())
    assert ours.num_features == ref.num_features
    x = torch.randn(2, 3, *img_size)
    with torch.no_grad():
        _close(ours(x), ref(x))  # the pooled features, or the logits where the head stays
        for g, e in zip(ours.forward_intermediates(x, indices, intermediates_only=True),
                        ref.forward_intermediates(x, indices, intermediates_only=True)):
            _close(g, e)


def test_stage_windows_follow_timms_rules():
    from swin.models.windows import stage_windows

    ref = ((7, 7),) * 4
    assert stage_windows(4, (96, 64), ref, (56, 56)) == ((12, 8),) * 4  # scaled with the grid
    assert stage_windows(4, (96, 64), ref, (56, 56), window_ratio=8) == ((12, 8),) * 4
    assert stage_windows(4, (96, 64), ref, (56, 56), window_ratio=[8, 8, 16, 32]) == ((12, 8),) * 2 + ((6, 4), (3, 2))
    assert stage_windows(4, (96, 64), ref, (56, 56), window_size=5) == ((5, 5),) * 4
    assert stage_windows(4, (96, 64), ref, (56, 56), window_size=(6, 4)) == ((6, 4),) * 4  # two ints: (h, w)
    assert stage_windows(4, (96, 64), ref, (56, 56), window_size=[4, (4, 2), 2, 2]) == (
        (4, 4), (4, 2), (2, 2), (2, 2))
    with pytest.raises(ValueError, match="one per stage"):
        stage_windows(4, (96, 64), ref, (56, 56), window_size=[4, 4, 2])
    with pytest.raises(ValueError, match="window_ratio"):
        stage_windows(4, (96, 64), ref, (56, 56), window_ratio=0)


@needs_timm_1031  # set_input_size's rules are timm 1.0.31's
@pytest.mark.parametrize("version", [V1, V2], ids=["v1", "v2"])
@pytest.mark.parametrize("kwargs", [
    {"img_size": (128, 96)},                                  # windows scaled with the patch grid
    {"img_size": (96, 160), "window_size": 5},                # one window for every stage
    {"window_ratio": 4},                                      # windows a quarter of the grid
    {"img_size": (64, 64), "window_size": [4, 4, 2, 2]},      # one per stage
])
def test_set_input_size_is_timms(version, kwargs):
    """set_input_size on both models: same resized bias tables, same maps and outputs at the new size."""
    ref, ours = _pair(version, (96, 160), 7)
    ref.set_input_size(**kwargs)
    ours.set_input_size(**kwargs)
    resized = ours.state_dict()
    assert sorted(resized) == sorted(ref.state_dict())
    for name, tensor in ref.state_dict().items():  # v1's bias tables resized as timm resizes them
        torch.testing.assert_close(resized[name], tensor, rtol=0, atol=0, msg=name)
    x = torch.randn(2, 3, *ours.img_size)
    with torch.no_grad():
        _close(ours(x), ref(x))
        for g, e in zip(ours.forward_intermediates(x, intermediates_only=True),
                        ref.forward_intermediates(x, intermediates_only=True)):
            _close(g, e)
    with pytest.raises(ValueError, match="always_partition=True is not supported"):
        ours.set_input_size(always_partition=True)


def test_classification_checkpoint_loads_into_a_features_model(tmp_path):
    """model.pretrained of a classifier: the features model drops norm and head, as timm's does."""
    name, arch = V1
    full = swin.create_model(name, img_size=(96, 160), num_classes=5, **arch).eval()
    torch.save(full.state_dict(), tmp_path / "classifier.pth")
    features = swin.create_model(name, pretrained=str(tmp_path / "classifier.pth"), img_size=(96, 160),
                                 num_classes=5, features_only=True, out_indices=(1, 2), **arch).eval()
    x = torch.randn(1, 3, 96, 160)
    with torch.no_grad():
        for m, e in zip(features(x), full.forward_intermediates(x, [1, 2], intermediates_only=True)):
            assert torch.equal(m, e.permute(0, 2, 3, 1))


def test_bad_indices_and_sizes_are_one_line():
    name, arch = V1
    with pytest.raises(ValueError, match=r"^out_indices=\(4,\): this model has 4 stages, indices 0 to 3"):
        swin.create_model(name, features_only=True, out_indices=(4,), **arch)
    model = swin.create_model(name, img_size=(96, 160), **arch)
    with pytest.raises(ValueError, match=r"^indices=5: an int takes the last n stages, 1 to 4"):
        model.forward_intermediates(torch.randn(1, 3, 96, 160), indices=5)
    features = swin.create_model(name, features_only=True, dynamic_img_size=True, **arch)
    with pytest.raises(ValueError, match=r"image size \(98, 160\) is not a multiple of the patch size \(4, 4\)"):
        features(torch.randn(1, 3, 98, 160))
    with pytest.raises(ValueError, match="pass features_only=True"):
        swin.create_model(name, out_indices=(1,), **arch)


def test_a_dense_head_trains_over_the_backbone():
    """torchvision's FeaturePyramidNetwork over forward_intermediates' maps and a 1x1 classifier, trained a few
    steps on a segmentation task (pixels inside a random bright square): the loss falls."""
    from torchvision.ops import FeaturePyramidNetwork

    torch.manual_seed(int(torch.randint(0, 10_000, (1,))))
    name, arch = V1
    backbone = swin.create_model(name, img_size=(64, 96), window_size=4, **arch)
    fpn = FeaturePyramidNetwork(backbone.feature_info and [f["num_chs"] for f in backbone.feature_info], 16)
    classify = nn.Conv2d(16, 2, 1)
    params = [*backbone.parameters(), *fpn.parameters(), *classify.parameters()]
    opt = torch.optim.AdamW(params, lr=2e-3)

    def batch(n=8):
        x, y = torch.randn(n, 3, 64, 96) * 0.1, torch.zeros(n, 64, 96, dtype=torch.long)
        for i in range(n):
            t, left = torch.randint(0, 32, (1,)).item(), torch.randint(0, 64, (1,)).item()
            x[i, :, t:t + 32, left:left + 32] += 1.0
            y[i, t:t + 32, left:left + 32] = 1
        return x, y

    def loss_of(x, y):
        maps = backbone.forward_intermediates(x, intermediates_only=True)
        pyramid = fpn({str(i): m for i, m in enumerate(maps)})
        logits = F.interpolate(classify(pyramid["0"]), size=y.shape[-2:], mode="bilinear", align_corners=False)
        return F.cross_entropy(logits, y)

    x_val, y_val = batch(16)
    with torch.no_grad():
        before = loss_of(x_val, y_val).item()
    for _ in range(25):
        loss = loss_of(*batch())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = loss_of(x_val, y_val).item()
    assert after < 0.5 * before, (before, after)
