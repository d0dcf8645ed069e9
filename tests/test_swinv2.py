"""Swin V2 against timm's own SwinTransformerV2: same weights -> same logits and gradients, on every backend;
checkpoints of timm's V2 load and fine-tune at another window."""
from __future__ import annotations

import math

import pytest
import timm
import torch
from packaging.version import Version
from test_model import assert_same_logits_and_grads, rel_err, skip_if_timm_floors_odd_stages
from timm.models import swin_transformer_v2 as timm_v2

import swin
from swin.models.pretrained import load_pretrained

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = "swinv2_tiny_window8_256"

CASES = [
    # (timm name, overrides, batch)
    (TINY, {}, 1),
    # non-square input and window, another window than the name's, scaled by a pretrained window
    (TINY, {"img_size": (128, 256), "window_size": (4, 8), "pretrained_window_sizes": (8, 8, 8, 4),
            "depths": (2, 2, 2, 2)}, 2),
    # padded (16x24 -> 8x12 with window 8: the shifted stage 2 is padded along W)
    (TINY, {"img_size": (64, 96), "depths": (1, 2, 2, 2)}, 2),
]


def randomised(model: torch.nn.Module) -> torch.nn.Module:
    """timm's V2 init zeroes the post-norms (every block is the identity) and the q/v biases; random values
    make each block, bias and logit scale count. Some logit scales lie above the clamp at log(100), never a block's
    first head (the clamp's gradient is 0: a block whose every head lay above it had no logit-scale gradient)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "logit_scale" in name:
                p.copy_(math.log(10.0) + 1.5 * torch.randn_like(p))
                p[0].clamp_(max=math.log(100.0) - 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def has_padded_shifted_block(model: swin.SwinTransformer) -> bool:
    return any(b.spec_for(b.feat_size).padded and any(b.shift_size) for s in model.layers for b in s.blocks)


def twin_models(name: str, overrides: dict, attention: str):
    ours = swin.create_model(name, attention=attention, drop_path_rate=0.0, **overrides)
    try:
        ref = timm.create_model(name, pretrained=False, drop_path_rate=0.0, **overrides)
    except RuntimeError:
        # timm 1.0.29 (the GPU machine) sizes a V2 block's shifted-window mask by the unpadded feature map
        if has_padded_shifted_block(ours) and Version(timm.__version__) < Version("1.0.31"):
            pytest.skip(f"timm {timm.__version__} cannot build V2 models with padded shifted blocks")
        raise
    skip_if_timm_floors_odd_stages(ref, ours)
    ours.load_state_dict(randomised(ref).state_dict(), strict=True)
    return ours, ref


@pytest.mark.parametrize("attention", ["standard", "sdpa"])
@pytest.mark.parametrize("name,overrides,batch", CASES, ids=["256", "non-square-window", "padded"])
def test_logits_and_grads_match_timm(name, overrides, batch, attention):
    ours, ref = twin_models(name, overrides, attention)
    assert_same_logits_and_grads(ours, ref, torch.randn(batch, 3, *ours.img_size), nonzero_grads=True)


def test_registry_matches_timm(monkeypatch):
    """Every timm swinv2_* name (not the swinv2_cr_* family) with timm's hyper-parameters and input size, read
    from timm's registrations without building the models."""
    captured = {}
    monkeypatch.setattr(timm_v2, "_create_swin_transformer_v2",
                        lambda variant, pretrained=False, **kwargs: captured.setdefault(variant, kwargs))
    names = [n for n in timm.list_models("swinv2_*") if not n.startswith("swinv2_cr_")]
    assert len(names) == 12
    for name in names:
        getattr(timm_v2, name)()
        theirs = {"pretrained_window_sizes": (0, 0, 0, 0), "img_size": timm.get_pretrained_cfg(name).input_size[-1],
                  "patch_size": 4, **captured[name]}
        ours = {k: v for k, v in swin.MODEL_CONFIGS[name].items() if k != "version"}
        assert swin.MODEL_CONFIGS[name]["version"] == 2
        assert ours == {k: tuple(v) if isinstance(v, list) else v for k, v in theirs.items()}, name


@pytest.mark.parametrize("name,overrides", [(TINY, {}),
                                            ("swinv2_base_window12to16_192to256", {"depths": (2, 2, 2, 2)})])
def test_parameters_and_buffers_match_timm(name, overrides):
    ours, ref = swin.create_model(name, **overrides), timm.create_model(name, pretrained=False, **overrides)
    shapes = lambda m: sorted((n, tuple(t.shape)) for n, t in m.state_dict().items())  # noqa: E731
    assert shapes(ours) == shapes(ref)
    # the position bias MLP's coordinates (timm keeps them as (1, 2Wh-1, 2Ww-1, 2)), index and masks, bit for bit
    buffers = dict(ours.named_buffers())
    for n, b in ref.named_buffers():
        if "relative_coords_table" in n or "relative_position_index" in n or "attn_mask" in n:
            assert torch.equal(buffers[n].reshape(b.shape), b), n
    assert sum(p.numel() for p in swin.create_model(TINY).parameters()) == 28_347_154
    assert ours.no_weight_decay() == {n for n, _ in ours.named_parameters() if "cpb_mlp" in n or "logit_scale" in n}


def test_v1_and_v2_differ_where_the_architecture_does():
    """A V2 micro model: cosine attention, post-norm blocks, norm after the reduction in patch merging; timm's
    init makes every block the identity."""
    v1, v2 = swin.create_model("swin_micro"), swin.create_model("swinv2_micro")
    names1, names2 = set(v1.state_dict()), set(v2.state_dict())
    assert {n.split(".")[-1] for n in names2 - names1} == {"logit_scale", "q_bias", "v_bias", "weight", "bias"}
    assert {n.split(".")[-1] for n in names1 - names2} == {"relative_position_bias_table", "bias"}  # qkv.bias
    assert v2.layers[1].downsample.norm.normalized_shape == (64,)  # after the reduction to 2C
    assert v1.layers[1].downsample.norm.normalized_shape == (128,)  # before it, on 4C
    block = v2.layers[0].blocks[1]
    x = torch.randn(2, 8, 8, 32)
    assert torch.equal(block(x), x)  # zero post-norms
    with pytest.raises(ValueError, match="Swin V2 setting"):
        swin.create_model("swin_micro", pretrained_window_sizes=(4, 4))


def test_set_attention_and_dynamic_img_size():
    """Backends switch in place on V2 blocks; a dynamic_img_size model fed another size equals a model built for it."""
    fixed = randomised(swin.create_model("swinv2_micro", attention="standard", img_size=(32, 28))).eval()
    dynamic = swin.create_model("swinv2_micro", attention="sdpa", img_size=(24, 20), dynamic_img_size=True).eval()
    dynamic.load_state_dict(fixed.state_dict())
    x = torch.randn(2, 3, 32, 28)
    reference = fixed(x)
    assert rel_err(dynamic(x), reference) < 1e-5
    assert fixed.set_attention("sdpa").attention == "sdpa"
    assert all(b.attn.attention == "sdpa" for s in fixed.layers for b in s.blocks)
    assert rel_err(fixed(x), reference) < 1e-5


def test_flash_matches_standard():
    """The flash kernel serves V2 attention (scaled cosine scores, CPB bias, shift mask, padded tokens): the same
    logits (1e-5) and every gradient (1e-4) as the standard backend, fp32 (the Triton interpreter on the CPU)."""
    model = swin.create_model("swinv2_micro", attention="standard", img_size=(22, 26)).to(DEVICE)
    randomised(model)
    flash = swin.create_model("swinv2_micro", attention="flash_window", img_size=(22, 26)).to(DEVICE)
    flash.load_state_dict(model.state_dict())
    assert has_padded_shifted_block(flash)
    assert_same_logits_and_grads(flash, model, torch.randn(2, 3, 22, 26, device=DEVICE), nonzero_grads=True)


# small timm V2 for checkpoint files: 64x64, patch 4 -> 16x16, 8x8, 4x4 tokens
SMALL = dict(img_size=64, window_size=4, embed_dim=16, depths=(2, 2, 2), num_heads=(1, 2, 4), num_classes=7,
             drop_path_rate=0.0)


def test_cpb_table_stays_fp32_under_autocast():
    """The CPB MLP runs in fp32 under bf16 autocast (its bias gradient, summed over every window, reaches the MLP
    without bf16 roundings): the table equals the fp32 one exactly, and its gradient arrives in fp32."""
    model = randomised(swin.create_model(TINY, img_size=(64, 64), depths=(1, 1, 1, 1), window_size=4,
                                         attention="sdpa"))
    attn = model.layers[0].blocks[0].attn
    reference = attn.bias_table()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        table = attn.bias_table()
        out = model(torch.randn(2, 3, 64, 64))
    assert table.dtype == torch.float32 and torch.equal(table, reference)
    out.float().square().mean().backward()
    grad = attn.cpb_mlp[2].weight.grad
    assert grad.dtype == torch.float32 and grad.abs().sum() > 0
    # in one graph under dynamo too: a graph break fails every fullgraph compile of a V2 model (train.py's included)
    traced = torch.compile(attn.bias_table, fullgraph=True, backend="eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(traced(), reference)


def test_timm_checkpoint_loads_and_fine_tunes_at_another_window(tmp_path):
    """A state_dict of timm.create_model(swinv2_..., pretrained=False) loads into ours with timm's logits; at another
    window (and input size) it loads without resizing anything and gives what timm's own model gives there."""
    ref = randomised(timm.create_model(TINY, pretrained=False, **SMALL)).eval()
    path = tmp_path / "swinv2.pth"
    torch.save(ref.state_dict(), path)
    x = torch.randn(2, 3, 64, 64)
    model = swin.create_model(TINY, pretrained=str(path), **SMALL).eval()
    assert rel_err(model(x), ref(x)) < 1e-5

    # fine-tuning at window 8 / 128x128 from weights of window 4, as timm's window12to16 names do
    new = dict(SMALL, img_size=128, window_size=8, pretrained_window_sizes=(4, 4, 4), num_classes=5)
    ft_ref = timm.create_model(TINY, pretrained=False, **new).eval()
    # the head goes after timm's filter: timm 1.0.29's filter takes a headless dict for the official layout
    converted = timm_v2.checkpoint_filter_fn(ref.state_dict(), ft_ref)
    loaded = ft_ref.load_state_dict({k: v for k, v in converted.items() if not k.startswith("head.")}, strict=False)
    assert set(loaded.missing_keys) == {"head.fc.weight", "head.fc.bias"} and not loaded.unexpected_keys
    model = swin.create_model(TINY, pretrained=str(path), **new)
    ft_ref.head.fc.load_state_dict(model.head.fc.state_dict())  # re-initialised: 7 -> 5 classes
    assert model.layers[0].blocks[0].window_size == (8, 8)
    x = torch.randn(2, 3, 128, 128)
    assert rel_err(model.eval()(x), ft_ref(x)) < 1e-5
    model.train()
    loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 4]))
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_official_checkpoint_layout_loads(tmp_path):
    """Official Swin V2 files keep merging at stage ends, 'head.*', and the window-sized buffers
    (relative_coords_table, relative_position_index, attn_mask): converted by timm's V2 filter, buffers dropped."""
    from test_checkpoint import to_microsoft

    ref = randomised(timm.create_model(TINY, pretrained=False, **SMALL)).eval()
    sd = to_microsoft(ref.state_dict())
    for n, b in ref.named_buffers():  # as official files hold them, at the pretraining window
        if "relative_coords_table" in n or "relative_position_index" in n or n.endswith("attn_mask"):
            sd[n] = b
    torch.save({"model": sd}, tmp_path / "official.pth")
    model = swin.create_model(TINY, **dict(SMALL, window_size=2))
    report = load_pretrained(model, tmp_path / "official.pth")
    assert report.kind == "microsoft" and not report.head_reset
    same_window = swin.create_model(TINY, pretrained=str(tmp_path / "official.pth"), **SMALL).eval()
    x = torch.randn(2, 3, 64, 64)
    assert rel_err(same_window(x), ref(x)) < 1e-5


def test_v1_checkpoint_into_v2_is_an_error(tmp_path):
    torch.save(swin.create_model("swin_micro").state_dict(), tmp_path / "v1.pth")
    with pytest.raises(ValueError, match=r"(?s)unexpected in checkpoint.*relative_position_bias_table.*Swin V2"):
        swin.create_model("swinv2_micro", pretrained=str(tmp_path / "v1.pth"))


def test_finetune_experiment_from_a_timm_v2_file(tmp_path):
    """experiment=finetune model=swinv2_micro model.pretrained=<timm V2 file> at another window: runs and learns."""
    from _train_utils import SMALL as SMALL_RUN
    from _train_utils import train_inprocess

    arch = {k: v for k, v in swin.MODEL_CONFIGS["swinv2_micro"].items() if k != "version"}
    ref = randomised(timm_v2.SwinTransformerV2(**dict(arch, num_classes=6)))
    torch.save(ref.state_dict(), tmp_path / "timm_v2.pth")
    summary = train_inprocess(tmp_path / "run", *SMALL_RUN, "experiment=finetune", "model=swinv2_micro",
                              f"model.pretrained={tmp_path / 'timm_v2.pth'}", "model.window_size=2",
                              "model.pretrained_window_sizes=[4,4]", "train.epochs=2", "train.lr=1e-3",
                              "train.lr_base_size=null", "train.warmup_epochs=0")
    assert summary["epochs"] == 2 and summary["nonfinite_steps"] == 0
    assert summary["history"][-1]["train_loss"] < summary["history"][0]["train_loss"]


@pytest.mark.gpu
@pytest.mark.parametrize("name,img_size", [(TINY, (192, 256)), ("swinv2_tiny_window16_256", (256, 256))])
def test_gpu_flash_bf16_matches_fp32(name, img_size):
    """bf16 on the GPU, compiled (fullgraph): flash_window within bf16 tolerance of the fp32 standard backend, logits
    and every gradient; window 16: 256-token windows. "Within bf16 tolerance" is measured, not guessed: a parameter's
    gradient may be as far from fp32 as 5e-2 or twice as far as the standard backend's own bf16 math gets (small
    gradients such as the CPB MLP's first bias come out of long bf16 reductions in either backend), never 20%.
    Logit scales near timm's init (10): with scales near the clamp (100) a bf16 q alone moves scores by ~0.4, in
    timm's bf16 math as in ours."""
    arch = dict(img_size=img_size, depths=(2, 2, 2, 2), drop_path_rate=0.0)
    model = randomised(swin.create_model(name, attention="flash_window", **arch)).cuda()
    with torch.no_grad():
        for block in (b for stage in model.layers for b in stage.blocks):
            block.attn.logit_scale.copy_(math.log(10.0) + 0.3 * torch.randn_like(block.attn.logit_scale))
    reference, standard_bf16 = (swin.create_model(name, attention="standard", **arch).cuda() for _ in range(2))
    reference.load_state_dict(model.state_dict())
    standard_bf16.load_state_dict(model.state_dict())
    x = torch.randn(4, 3, *img_size, device="cuda")
    probe = torch.randn(4, model.num_classes, device="cuda")
    compiled = swin.compile_model(model, fullgraph=True)  # with train.py's inductor options
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, out_std = compiled(x), standard_bf16(x)
    ref = reference(x)
    assert rel_err(out.float(), ref) < max(3e-2, 2 * rel_err(out_std.float(), ref))
    for y in (out, out_std, ref):
        (y.float() * probe).sum().backward()
    grads: dict[str, list[list[torch.Tensor]]] = {}  # name -> [reference, flash, standard] gradients
    for (pname, p), q, s in zip(reference.named_parameters(), model.parameters(), standard_bf16.parameters()):
        # a logit scale's gradient sums each head's score gradients times their cosines over whole windows: rows
        # whose gradients sum to zero, so one layer's can cancel to almost nothing; the scales are compared as one
        # vector over every layer
        name = "every logit_scale" if pname.endswith("logit_scale") else pname
        for kept, g in zip(grads.setdefault(name, [[], [], []]), (p, q, s)):
            kept.append(g.grad.flatten())
    for pname, (p, q, s) in ((n, [torch.cat(g) for g in gs]) for n, gs in grads.items()):
        flash_err, standard_err = rel_err(q, p), rel_err(s, p)
        # capped: a gradient that bf16 math cannot pin down better than 20% says nothing either way
        assert flash_err < min(0.2, max(5e-2, 2 * standard_err)), (pname, flash_err, standard_err)


def test_imagenet_swinv2_tiny_is_the_v2_paper_recipe():
    from _train_utils import make_cfg

    cfg = make_cfg("experiment=imagenet_swinv2_tiny", "data.root=/nonexistent")
    t, d, m = cfg.train, cfg.data, cfg.model
    assert (m.name, m.img_size, m.window_size, m.drop_path_rate) == (TINY, 256, 8, 0.2)
    assert (t.opt, t.lr, t.lr_base_size, t.batch_size, t.weight_decay) == ("adamw", 1e-3, 1024, 1024, 0.05)
    assert (t.epochs, t.warmup_epochs, t.sched, t.min_lr, t.warmup_lr, t.clip_grad) == (300, 20, "cosine", 1e-5,
                                                                                          1e-6, 5.0)
    assert (t.label_smoothing, t.mixup, t.cutmix) == (0.1, 0.8, 1.0)
    assert (d.auto_augment, d.reprob, d.color_jitter, d.interpolation) == ("rand-m9-mstd0.5-inc1", 0.25, 0.4,
                                                                           "bicubic")
    assert math.floor(m.img_size / d.crop_pct) == 292  # official: resize int(256 / 224 * 256), center crop 256
