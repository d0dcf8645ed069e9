"""The model against timm's own Swin: same weights -> same logits and gradients."""
import pytest
import timm
import torch

import swin
from swin.models.windows import WindowSpec, merge_unpad_unshift, shift_pad_partition, shifted_window_mask

CASES = [
    # (timm name, overrides, batch)
    ("swin_tiny_patch4_window7_224", {}, 2),
    ("swin_base_patch4_window12_384", {}, 1),
    ("swin_tiny_patch4_window7_224", {"img_size": (200, 296)}, 2),  # non-square, not window multiples
]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_same_logits_and_grads(ours: torch.nn.Module, ref: torch.nn.Module, x: torch.Tensor,
                                 nonzero_grads: bool = False) -> None:
    """Logits within 1e-5 and the gradient of every parameter (by name) within 1e-4, relative, through a random
    projection of the logits (every logit gets a gradient). A gradient that is a sum whose terms cancel (a logit
    scale's: most heads near zero) can differ more between two float32 summation orders: there the reference is
    timm's model in float64, and ours must be within 4x as far from it as timm's float32 gradient (or within 1e-4)."""
    out_ours, out_ref = ours(x), ref(x)
    assert rel_err(out_ours, out_ref) < 1e-5
    probe = torch.randn_like(out_ref)
    (out_ours * probe).sum().backward()
    (out_ref * probe).sum().backward()
    ref_params = dict(ref.named_parameters())
    exact: dict[str, torch.Tensor] | None = None
    for name, p in ours.named_parameters():
        assert p.grad is not None and (not nonzero_grads or p.grad.abs().max() > 0), name
        theirs = ref_params[name].grad
        if rel_err(p.grad, theirs) < 1e-4:
            continue
        exact = exact or _float64_grads(ref, x, probe)
        assert rel_err(p.grad, exact[name]) < max(1e-4, 4 * rel_err(theirs, exact[name])), name


def _float64_grads(ref: torch.nn.Module, x: torch.Tensor, probe: torch.Tensor) -> dict[str, torch.Tensor]:
    """The parameter gradients of a float64 copy of ``ref`` for the same input and logit projection."""
    import copy
    exact = copy.deepcopy(ref).double()
    exact.zero_grad()
    (exact(x.double()) * probe.double()).sum().backward()
    return {n: p.grad for n, p in exact.named_parameters()}


def skip_if_timm_floors_odd_stages(ref: torch.nn.Module, ours: torch.nn.Module) -> None:
    """Older timm (1.0.29 on the GPU machine) sizes a stage after an odd feature map by floor (e.g. 25 -> 12),
    though PatchMerging pads it to the ceiling (13) at run time; newer timm and this model use the ceiling.
    The two then build different windows and bias tables, so there is no common state_dict to compare."""
    for theirs, mine in zip(ref.layers, ours.layers):
        if tuple(theirs.output_resolution) != tuple(mine.out_size):
            pytest.skip(f"timm {timm.__version__} sizes a stage {tuple(theirs.output_resolution)} where the padded "
                        f"feature map (and this model) is {tuple(mine.out_size)}; compared on newer timm")


def twin_models(name: str, overrides: dict, attention: str):
    ref = timm.create_model(name, pretrained=False, drop_path_rate=0.0, **overrides)
    ours = swin.create_model(name, attention=attention, drop_path_rate=0.0, **overrides)
    skip_if_timm_floors_odd_stages(ref, ours)
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ours, ref


@pytest.mark.parametrize("attention", ["standard", "sdpa"])
@pytest.mark.parametrize("name,overrides,batch", CASES)
def test_logits_and_grads_match_timm(name, overrides, batch, attention):
    ours, ref = twin_models(name, overrides, attention)
    assert_same_logits_and_grads(ours, ref, torch.randn(batch, 3, *ours.img_size))


def test_param_count_and_names_match_timm():
    counts = {}
    for name in swin.list_models():
        if name == "swin_micro" or swin.MODEL_CONFIGS[name].get("version") == 2:  # V2: tests/test_swinv2.py
            continue
        ours = swin.create_model(name)
        with torch.device("meta"):  # timm's names and shapes without allocating and initialising its weights
            ref = timm.create_model(name, pretrained=False)
        assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()], name
        counts[name] = sum(p.numel() for p in ours.parameters())
        assert counts[name] == sum(p.numel() for p in ref.parameters()), name
        del ours, ref
    assert counts["swin_tiny_patch4_window7_224"] == 28_288_354


def test_set_attention_switches_in_place():
    model = swin.create_model("swin_micro", attention="standard").eval()
    x = torch.randn(3, 3, 16, 16)
    a = model(x)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    model.set_attention("sdpa")
    assert model.attention == "sdpa"
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
    assert rel_err(model(x), a) < 1e-5


def test_micro_model_shapes_and_buffers():
    model = swin.create_model("swin_micro")
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 10)
    keys = model.state_dict().keys()
    assert not any("relative_position_index" in k or "attn_mask" in k for k in keys)  # non-persistent


def test_overrides():
    model = swin.create_model("swin_tiny_patch4_window7_224", num_classes=7, img_size=(64, 96), window_size=(4, 6),
                              embed_dim=48, depths=(1, 2), num_heads=(2, 4), patch_size=2, drop_path_rate=0.3)
    assert model(torch.randn(1, 3, 64, 96)).shape == (1, 7)
    assert model.layers[1].blocks[1].shift_size == (2, 3)
    assert model.layers[0].blocks[0].attn.relative_position_bias_table.shape == (7 * 11, 2)


def test_dynamic_img_size_matches_fixed_model():
    # built for 24x20, fed 32x28: same windows and shifts as a model built for 32x28
    fixed = swin.create_model("swin_micro", img_size=(32, 28)).eval()
    dynamic = swin.create_model("swin_micro", img_size=(24, 20), dynamic_img_size=True).eval()
    dynamic.load_state_dict(fixed.state_dict())
    x = torch.randn(2, 3, 32, 28)
    assert rel_err(dynamic(x), fixed(x)) < 1e-6


def test_window_clamped_when_feature_map_is_small():
    # 32x32 input, patch 4 -> stage sizes 8, 4, 2, 1 with window 7: timm clamps window and drops the shift
    ours, ref = twin_models("swin_tiny_patch4_window7_224", {"img_size": 32}, "sdpa")
    assert ours.layers[1].blocks[1].window_size == (4, 4) and ours.layers[1].blocks[1].shift_size == (0, 0)
    x = torch.randn(2, 3, 32, 32)
    assert rel_err(ours(x), ref(x)) < 1e-5


def test_shift_pad_partition_round_trip_and_mask():
    spec = WindowSpec((10, 13), (4, 5), (2, 2))
    x = torch.randn(2, 10, 13, 3)
    windows = shift_pad_partition(x, spec, torch.full((3,), 7.0))
    assert windows.shape == (2 * 3 * 3, 20, 3)
    assert (windows == 7.0).sum() == 2 * (12 * 15 - 10 * 13) * 3  # every padded position, no other
    assert torch.equal(merge_unpad_unshift(windows, spec), x)
    mask = shifted_window_mask(spec)
    assert mask.shape == (9, 20, 20) and set(mask.unique().tolist()) == {0.0, -100.0}
    assert (mask[0] == 0).all()  # top-left window lies in one region


@pytest.mark.parametrize("bad,match", [
    (dict(name="swin_huge"), "unknown model"),
    (dict(name="swin_micro", attention="fast"), "unknown attention backend"),
    (dict(name="swin_micro", img_size=15), "not divisible by patch_size"),
    (dict(name="swin_micro", embed_dim=30, num_heads=(4, 4)), "not divisible by num_heads"),
    (dict(name="swin_micro", depths=(2, 2, 2)), "one entry per stage"),
])
def test_bad_config_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        swin.create_model(**bad)


def test_flash_window_refuses_blocks_it_cannot_run_when_the_model_is_built():
    """attention=flash_window with windows or heads beyond the kernel's limits fails when the model is built or
    switched, naming the fix, not at the first forward; set_attention then switches no block (attention=auto builds
    the same model and runs sdpa for those blocks)."""
    with pytest.raises(ValueError, match=r"17x17 windows of head_dim 16: flash_window supports windows of at most "
                                         r"256 tokens, got 289; use attention auto"):
        swin.create_model("swin_micro", attention="flash_window", window_size=17, img_size=36)
    # stage 1: 72 channels in one head (fits); stage 2: 144 channels in one head (head_dim > 128 does not)
    model = swin.create_model("swin_micro", attention="auto", embed_dim=72, num_heads=(1, 1))
    x = torch.randn(2, 3, 16, 16)
    before = model.eval()(x)
    with pytest.raises(ValueError, match="head_dim 144: flash_window supports head_dim up to 128, got 144"):
        model.set_attention("flash_window")
    assert {block.attn.attention for stage in model.layers for block in stage.blocks} == {"auto"}
    assert torch.equal(model(x), before)


def test_bad_input_errors():
    model = swin.create_model("swin_micro")
    with pytest.raises(ValueError, match="input channels"):
        model(torch.randn(1, 1, 16, 16))
    with pytest.raises(ValueError, match="does not match the model's img_size"):
        model(torch.randn(1, 3, 32, 16))
    with pytest.raises(ValueError, match=r"\(B, C, H, W\)"):
        model(torch.randn(3, 16, 16))
    with pytest.raises(ValueError, match="unknown attention backend"):
        model.set_attention("flash")


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor, probe: torch.Tensor) -> int:
    """Bytes of the activations one forward keeps for backward (parameters, which exist anyway, left out)."""
    storages: dict[int, int] = {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    (out * probe).sum().backward()
    return sum(storages.values())


def test_recomputed_mlp_activation_keeps_less_and_matches_timm():
    """recompute_mlp_act (the default) keeps fc1's output only: less memory, the same gradients as timm."""
    # 128: even feature maps at every stage, so every timm version builds the same model
    ref = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=128, drop_path_rate=0.0)
    kept = swin.create_model("swin_tiny_patch4_window7_224", attention="sdpa", img_size=128, drop_path_rate=0.0,
                             recompute_mlp_act=False)
    recomputed = swin.create_model("swin_tiny_patch4_window7_224", attention="sdpa", img_size=128,
                                   drop_path_rate=0.0)
    assert all(b.recompute_mlp_act for s in recomputed.layers for b in s.blocks)
    for m in (kept, recomputed):
        m.load_state_dict(ref.state_dict())
    x, probe = torch.randn(2, 3, 128, 128), torch.randn(2, 1000)
    bytes_kept, bytes_recomputed = _saved_bytes(kept, x, probe), _saved_bytes(recomputed, x, probe)
    (ref(x) * probe).sum().backward()
    # per block, GELU's output (4C per token) is no longer kept: at this size about a quarter of all saved memory
    assert bytes_recomputed < 0.85 * bytes_kept, (bytes_recomputed, bytes_kept)
    ref_params = dict(ref.named_parameters())
    for name, p in recomputed.named_parameters():
        assert rel_err(p.grad, ref_params[name].grad) < 1e-4, name


@pytest.mark.parametrize("frozen", [False, True])
def test_eager_mlp_recompute_matches_the_checkpointed_one(monkeypatch, frozen):
    """Eager training runs GELU and fc2 as _GeluLinear (GELU recomputed for fc2's weight gradient, fc2 not re-run):
    under bfloat16 autocast, and with fc2 frozen (fine-tuning part of a model), its gradients are the checkpointed
    path's, which recomputes both."""
    import swin.models.swin_transformer as st

    model = swin.create_model("swin_micro", attention="sdpa", img_size=32)  # 16x16 then 8x8 maps, shifted windows
    if frozen:
        for block in (b for s in model.layers for b in s.blocks):
            block.mlp.fc2.requires_grad_(False)
    x, probe = torch.randn(2, 3, 32, 32), torch.randn(2, 10)
    calls = []
    real = st._GeluLinear.apply
    monkeypatch.setattr(st._GeluLinear, "apply", lambda *a: calls.append(1) or real(*a))

    def grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        (out.float() * probe).sum().backward()
        return out.float(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    out_fn, grads_fn = grads()
    assert len(calls) == sum(len(s.blocks) for s in model.layers)
    monkeypatch.setattr(st, "mlp_tail_recomputing_gelu", lambda *a: None)  # the checkpoint around GELU and fc2
    out_ckpt, grads_ckpt = grads()
    assert torch.equal(out_fn, out_ckpt)
    assert grads_fn.keys() == grads_ckpt.keys() and grads_fn
    assert not frozen or not any("mlp.fc2" in n for n in grads_fn)
    for name, g in grads_fn.items():
        assert g.dtype == torch.float32, name
        assert rel_err(g, grads_ckpt[name]) < 1e-2, (name, rel_err(g, grads_ckpt[name]))


def test_normalize_for_linear_keeps_its_rounded_output_not_x():
    """The folded norm keeps only its output in the Linear's dtype and the inverse std for the backward (not the
    float32 input); its gradient is LayerNorm's: exact in float64, within bf16 rounding from the bf16 output."""
    from swin.models.swin_transformer import _NormalizeForLinear

    x = (torch.randn(4, 7, 32, dtype=torch.float64) * 3 + 1).requires_grad_()
    probe = torch.randn(4, 7, 32, dtype=torch.float64)
    ref = torch.nn.functional.layer_norm(x, (32,), eps=1e-5)
    ref_grad, = torch.autograd.grad((ref * probe).sum(), x)
    out = _NormalizeForLinear.apply(x, (32,), 1e-5, torch.float64)
    grad, = torch.autograd.grad((out * probe).sum(), x)
    assert rel_err(out, ref) < 1e-12 and rel_err(grad, ref_grad) < 1e-12

    x32 = x.detach().float().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = _NormalizeForLinear.apply(x32, (32,), 1e-5, torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert sorted((str(t.dtype), t.shape[-1]) for t in saved) == [("torch.bfloat16", 32), ("torch.float32", 1)]
    grad, = torch.autograd.grad((out.float() * probe.float()).sum(), x32)
    assert grad.dtype == torch.float32
    assert rel_err(grad, ref_grad) < 2e-2


def test_compiled_norm_linear_under_autocast_normalizes_for_the_linear():
    """Under bf16 autocast a compiled training graph's norm_linear on float32 x runs the folded norm through
    _NormalizeForLinear (a bf16 output for the Linear), with output and gradients equal to norm-then-Linear's within
    bf16 rounding."""
    from swin.models.swin_transformer import norm_linear

    norm, linear = torch.nn.LayerNorm(32), torch.nn.Linear(32, 48)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.5)
        norm.bias.normal_(0.0, 0.5)
    x = (torch.randn(2, 9, 32) * 2 + 0.5).requires_grad_()
    probe = torch.randn(2, 9, 48)
    params = [x, *norm.parameters(), *linear.parameters()]
    functions = []

    def backend(gm, example_inputs):
        functions.extend(n for n in gm.graph.nodes if "autograd_function_apply" in str(n.target))
        return gm.forward

    def run(fn) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x)
        assert out.dtype == torch.bfloat16
        return out.float(), torch.autograd.grad((out.float() * probe).sum(), params)

    torch._dynamo.reset()
    out, grads = run(torch.compile(lambda t: norm_linear(t, norm, linear), backend=backend, fullgraph=True))
    assert functions
    ref_out, ref_grads = run(lambda t: linear(norm(t)))
    assert rel_err(out, ref_out) < 2e-2
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.dtype == r.dtype and rel_err(g, r) < 3e-2


@pytest.mark.parametrize("linear_bias", [True, False], ids=["bias", "no_bias"])
def test_folded_norm_linear_matches_norm_then_linear(linear_bias):
    """norm_linear in a compiled training graph folds the LayerNorm's scale and shift into the Linear (the graph's
    layer norm has no weight or bias); output and every gradient equal norm-then-Linear's in float64. Eager mode
    and fold_affine=False run norm then Linear as written."""
    from swin.models.swin_transformer import norm_linear

    norm = torch.nn.LayerNorm(24).double()
    linear = torch.nn.Linear(24, 40, bias=linear_bias).double()
    with torch.no_grad():  # away from the identity init, so that a dropped scale or shift would show
        norm.weight.normal_(1.0, 0.5)
        norm.bias.normal_(0.0, 0.5)
    x = torch.randn(3, 5, 24, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(3, 5, 40, dtype=torch.float64)
    params = [x, *norm.parameters(), *linear.parameters()]

    def grads(fn) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = fn(x)
        return out.detach(), list(torch.autograd.grad((out * probe).sum(), params))

    layer_norms = []  # each traced layer_norm's weight argument (None: no scale)

    def backend(gm, example_inputs):
        for n in gm.graph.nodes:
            if n.target is torch.nn.functional.layer_norm:
                layer_norms.append(n.args[2] if len(n.args) > 2 else n.kwargs.get("weight"))
        return gm.forward

    torch._dynamo.reset()
    folded = torch.compile(lambda t: norm_linear(t, norm, linear), backend=backend, fullgraph=True)
    ref_out, ref_grads = grads(lambda t: linear(norm(t)))
    out, got = grads(folded)
    assert layer_norms and all(weight is None for weight in layer_norms)
    assert rel_err(out, ref_out) < 1e-12
    for g, r in zip(got, ref_grads, strict=True):
        assert rel_err(g, r) < 1e-12
    # eager, and fold_affine=False: the modules as written (same numbers, no fold)
    eager_out, _ = grads(lambda t: norm_linear(t, norm, linear))
    assert torch.equal(eager_out, ref_out)
    layer_norms.clear()
    torch._dynamo.reset()
    unfolded = torch.compile(lambda t: norm_linear(t, norm, linear, fold_affine=False), backend=backend,
                             fullgraph=True)
    unfolded(x)
    assert layer_norms and all(weight is not None for weight in layer_norms)
