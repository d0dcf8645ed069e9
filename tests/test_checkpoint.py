"""Loading timm, Microsoft and our checkpoints: same logits as timm's own model, resizing, bad input.

The reference is always timm's SwinTransformer with the same hyper-parameters, built independently
and (for a new window size) loaded through timm's own checkpoint_filter_fn.
"""
from __future__ import annotations

import re
import time

import pytest
import safetensors.torch
import torch
from timm.models.swin_transformer import SwinTransformer as TimmSwin
from timm.models.swin_transformer import checkpoint_filter_fn

import swin
from swin.models.pretrained import CheckpointError, load_checkpoint, load_pretrained, read_checkpoint

# small enough for the CPU: 32x32 input, patch 2 -> 16x16, 8x8, 4x4 tokens, window 4, 3 stages
ARCH = dict(img_size=32, patch_size=2, window_size=4, embed_dim=16, depths=(2, 2, 2), num_heads=(2, 2, 4),
            num_classes=7)


def ours(**kw) -> swin.SwinTransformer:
    return swin.create_model("swin_micro", **{**ARCH, "drop_path_rate": 0.0, **kw}).eval()


def timm_model(**kw) -> TimmSwin:
    return TimmSwin(**{**ARCH, "drop_path_rate": 0.0, **kw}).eval()


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    # timm's init leaves norms at 1/0 and biases at 0; random values make a misplaced tensor visible
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def to_microsoft(sd: dict) -> dict:
    """timm layout -> official Swin layout: merging of stage i+1 stored at the end of stage i, head.fc -> head."""
    out = {}
    for k, v in sd.items():
        k = re.sub(r"^layers\.(\d+)\.downsample", lambda m: f"layers.{int(m.group(1)) - 1}.downsample", k)
        out[k.replace("head.fc.", "head.")] = v
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A randomly initialised timm model and its weights saved in every supported format."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,))))
    ref = perturbed(timm_model())
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    ema = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in sd.items()}
    d = tmp_path_factory.mktemp("ckpt")
    files = {
        "timm.pth": sd,
        "timm.safetensors": None,
        "microsoft.pth": {"model": to_microsoft(sd)},
        "ddp_prefixed.pth": {f"module.{k}": v for k, v in sd.items()},
        "timm_train.pth": {"state_dict": {k: v + 1 for k, v in sd.items()}, "state_dict_ema": sd, "epoch": 3},
        "ours.pt": {"format_version": 1, "model": ema, "ema": sd, "optimizer": {}, "epoch": 2,
                    "config": {"model": {"name": "swin_micro"}}},
    }
    for name, obj in files.items():
        if name.endswith(".safetensors"):
            safetensors.torch.save_file(sd, str(d / name))
        else:
            torch.save(obj, d / name)
    return ref, sd, ema, {name: d / name for name in files}


FORMATS = ["timm.pth", "timm.safetensors", "microsoft.pth", "ddp_prefixed.pth", "timm_train.pth", "ours.pt"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_same_logits_as_timm(reference, fmt):
    ref, _, _, files = reference
    model = swin.create_model("swin_micro", pretrained=str(files[fmt]), **{**ARCH, "drop_path_rate": 0.0}).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)
    kind = read_checkpoint(files[fmt]).kind
    assert kind == {"microsoft.pth": "microsoft", "timm_train.pth": "timm-train", "ours.pt": "ours"}.get(fmt, "timm")


@pytest.mark.parametrize("fmt", ["timm.pth", "timm.safetensors", "microsoft.pth"])
def test_new_window_and_class_count(reference, fmt):
    """Window 4 -> 8 and 7 -> 3 classes: tables resized as timm resizes them, head re-initialised."""
    _, sd, _, files = reference
    model = ours(window_size=8, num_classes=3)
    report = load_pretrained(model, files[fmt])
    assert report.head_reset and report.checkpoint_classes == 7
    # stage 3 has a 4x4 map, so its window stays 4 and its tables are not resized
    assert len(report.resized) == 4
    # independent reference: timm's model at the new window, loaded through timm's own filter
    ref = timm_model(window_size=8, num_classes=3)
    filtered = checkpoint_filter_fn(dict(sd), ref)
    missing, unexpected = ref.load_state_dict({k: v for k, v in filtered.items() if not k.startswith("head")},
                                              strict=False)
    assert set(missing) == {"head.fc.weight", "head.fc.bias"} and not unexpected
    theirs = ref.state_dict()
    for k, v in model.state_dict().items():
        if "relative_position_bias_table" in k:
            torch.testing.assert_close(v, theirs[k], atol=0, rtol=0)
    # head: timm's init (trunc normal std .02, zero bias), fresh rather than copied
    assert model.head.fc.weight.shape == (3, 64) and torch.all(model.head.fc.bias == 0)
    assert 0.005 < model.head.fc.weight.std().item() < 0.05
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref.head.fc.load_state_dict(model.head.fc.state_dict())
        torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)


def test_224_window7_to_384_window12(tmp_path):
    """The official fine-tune change of resolution and window, on a narrow model to stay fast."""
    arch = dict(patch_size=4, embed_dim=8, depths=(2, 2, 2, 2), num_heads=(1, 1, 2, 2), drop_path_rate=0.0)
    src = perturbed(TimmSwin(img_size=224, window_size=7, num_classes=10, **arch)).eval()
    torch.save({"model": to_microsoft(src.state_dict())}, tmp_path / "ms224.pth")
    model = swin.create_model("swin_tiny_patch4_window7_224", pretrained=str(tmp_path / "ms224.pth"), img_size=384,
                              window_size=12, num_classes=10, **arch).eval()
    ref = TimmSwin(img_size=384, window_size=12, num_classes=10, **arch).eval()
    ref.load_state_dict(checkpoint_filter_fn(src.state_dict(), ref))
    assert model.layers[0].blocks[0].attn.relative_position_bias_table.shape == (23 * 23, 1)
    x = torch.randn(1, 3, 384, 384)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)


def test_ema_choice(reference):
    _, sd, ema, files = reference
    for fmt, expect_ema, expect_model in (("ours.pt", sd, ema), ("timm_train.pth", sd, None)):
        ckpt = read_checkpoint(files[fmt])
        assert ckpt.weights == "ema"
        torch.testing.assert_close(ckpt.state_dict["norm.weight"], expect_ema["norm.weight"])
        raw = read_checkpoint(files[fmt], ema=False)
        assert raw.weights == "model"
        if expect_model is not None:
            torch.testing.assert_close(raw.state_dict["norm.weight"], expect_model["norm.weight"])
    with pytest.raises(CheckpointError, match="EMA weights were requested"):
        read_checkpoint(files["timm.pth"], ema=True)
    ckpt = read_checkpoint(files["ours.pt"])
    assert ckpt.config == {"model": {"name": "swin_micro"}} and ckpt.meta["epoch"] == 2


def test_eval_load_requires_matching_head(reference):
    _, _, _, files = reference
    with pytest.raises(CheckpointError, match=r"classifier for 7 classes.*num_classes=7"):
        load_checkpoint(ours(num_classes=5), files["timm.pth"])


# --- bad input ---------------------------------------------------------------------------------------
def _unchanged(model, before):
    return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("fmt", ["timm.pth", "timm.safetensors", "microsoft.pth"])
@pytest.mark.parametrize("cut", [0.5, 0.99])
def test_truncated_file(reference, tmp_path, fmt, cut):
    data = reference[3][fmt].read_bytes()
    bad = tmp_path / f"cut_{fmt}"
    bad.write_bytes(data[: int(len(data) * cut)])
    model = ours()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_pretrained(model, bad)
    assert _unchanged(model, before)


def test_corrupt_and_empty_files(tmp_path):
    (tmp_path / "junk.pth").write_bytes(torch.randint(0, 256, (4096,), dtype=torch.uint8).numpy().tobytes())
    (tmp_path / "empty.pth").write_bytes(b"")
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_pretrained(ours(), tmp_path / "junk.pth")
    # junk whose opcodes pop an empty stack (random junk sometimes does: IndexError inside the unpickler)
    (tmp_path / "stack.pth").write_bytes(b"\x80\x02\x86.")
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_pretrained(ours(), tmp_path / "stack.pth")
    with pytest.raises(CheckpointError, match="empty"):
        load_pretrained(ours(), tmp_path / "empty.pth")
    with pytest.raises(FileNotFoundError, match="not found"):
        load_pretrained(ours(), tmp_path / "nope.pth")
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(CheckpointError, match="not a state_dict"):
        load_pretrained(ours(), tmp_path / "list.pth")


def test_other_swin_architecture_lists_shapes(reference, tmp_path):
    """Another width and head count: every mismatch listed with both shapes, nothing loaded."""
    other = timm_model(embed_dim=24, num_heads=(3, 3, 6))
    torch.save(other.state_dict(), tmp_path / "wide.pth")
    model = ours()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        load_pretrained(model, tmp_path / "wide.pth")
    msg = str(err.value)
    assert "layers.0.blocks.0.attn.qkv.weight: (72, 24) vs (48, 16)" in msg
    # bias tables with another head count are reported, not interpolated
    assert "layers.0.blocks.0.attn.relative_position_bias_table: (49, 3) vs (49, 2)" in msg
    assert "embed_dim=24" in msg and "embed_dim=16" in msg
    assert _unchanged(model, before)


def test_other_depth_and_patch_size(tmp_path):
    deeper = timm_model(depths=(2, 3, 2))
    torch.save(deeper.state_dict(), tmp_path / "deeper.pth")
    with pytest.raises(CheckpointError, match=r"unexpected in checkpoint \(\d+\):\n    layers\.1\.blocks\.2\."):
        load_pretrained(ours(), tmp_path / "deeper.pth")
    patch4 = timm_model(patch_size=4, img_size=64)
    torch.save(patch4.state_dict(), tmp_path / "patch4.pth")
    # timm would resample the patch embedding; that is another model, so it is an error here
    with pytest.raises(CheckpointError, match=r"patch_embed\.proj\.weight: \(16, 3, 4, 4\) vs \(16, 3, 2, 2\)"):
        load_pretrained(ours(), tmp_path / "patch4.pth")


def test_not_a_swin(tmp_path):
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
    torch.save(net.state_dict(), tmp_path / "cnn.pth")
    with pytest.raises(CheckpointError) as err:
        load_pretrained(ours(), tmp_path / "cnn.pth")
    msg = str(err.value)
    assert "missing in checkpoint (90):\n    patch_embed.proj.weight: (16, 3, 2, 2)" in msg
    assert "unexpected in checkpoint" in msg and "0.weight: (8, 3, 3, 3)" in msg
    assert "not a Swin Transformer state_dict" in msg


def test_missing_and_extra_keys(reference, tmp_path):
    sd = dict(reference[1])
    del sd["layers.1.downsample.norm.weight"]
    sd["layers.0.blocks.0.attn.extra"] = torch.zeros(3)
    torch.save(sd, tmp_path / "edited.pth")
    with pytest.raises(CheckpointError) as err:
        load_pretrained(ours(), tmp_path / "edited.pth")
    msg = str(err.value)
    assert "missing in checkpoint (1):\n    layers.1.downsample.norm.weight: (64,)" in msg
    assert "unexpected in checkpoint (1):\n    layers.0.blocks.0.attn.extra: (3,)" in msg


def test_timm_hub_without_network_fails_fast():
    from swin.models.pretrained import _hub_reachable
    if _hub_reachable():
        pytest.skip("the Hugging Face hub is reachable here")
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"no network.*pass the file instead: model\.pretrained=PATH"):
        swin.create_model("swin_tiny_patch4_window7_224", pretrained="timm:swin_tiny_patch4_window7_224.ms_in1k")
    assert time.perf_counter() - start < 30
    with pytest.raises(CheckpointError, match="no pretrained weights"):
        load_pretrained(ours(), "timm:swin_tiny_patch4_window7_224.no_such_tag")


def test_pickled_objects_are_not_executed(tmp_path):
    import argparse
    torch.save({"model": {}, "parser": argparse.ArgumentParser}, tmp_path / "objects.pth")
    with pytest.raises(CheckpointError, match=r"not plain weights \(argparse.ArgumentParser\)"):
        load_pretrained(ours(), tmp_path / "objects.pth")


@pytest.mark.parametrize("layout", ["timm", "microsoft"])
def test_headless_checkpoint(reference, tmp_path, layout):
    """Weights saved without a classifier (num_classes=0): the trunk loads, the head is initialised."""
    ref, sd, _, _ = reference
    trunk = {k: v for k, v in sd.items() if not k.startswith("head.")}
    torch.save(to_microsoft(trunk) if layout == "microsoft" else trunk, tmp_path / "trunk.pth")
    model = ours()
    report = load_pretrained(model, tmp_path / "trunk.pth")
    assert report.head_reset and report.checkpoint_classes == 0 and report.kind == layout
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model.forward_features(x), ref.forward_features(x), atol=1e-5, rtol=1e-5)


def test_timm_name_from_local_hub_cache(reference, tmp_path, monkeypatch):
    """timm:<name.tag> is read from the Hugging Face cache when it is there, without any network."""
    from huggingface_hub import constants
    ref, sd, _, _ = reference
    snapshot = tmp_path / "models--timm--swin_tiny_patch4_window7_224.ms_in1k" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    safetensors.torch.save_file(sd, str(snapshot / "model.safetensors"))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abc")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("swin.models.pretrained._hub_reachable", lambda timeout=3.0: pytest.fail("network was tried"))
    model = ours()
    report = load_pretrained(model, "timm:swin_tiny_patch4_window7_224.ms_in1k")
    assert report.source.endswith("model.safetensors") and not report.head_reset
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), atol=1e-5, rtol=1e-5)
