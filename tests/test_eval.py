"""eval.py / swin.evaluate: exact metrics (single process and 2 processes), timm and Microsoft
checkpoints checked against timm's own model, transforms from timm's pretrained config, errors."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from timm.models.swin_transformer import SwinTransformer as TimmSwin
from timm.utils import accuracy
from torch.utils.data import DataLoader, TensorDataset

import swin
import swin.config  # noqa: F401  (registers the config schemas before compose)
from swin.config import ConfigError, to_settings
from swin.evaluate import eval_compile_mode, evaluate, overridden_groups, run_eval

ROOT = Path(__file__).resolve().parents[1]
MICRO = dict(img_size=16, patch_size=2, window_size=4, embed_dim=32, depths=(2, 2), num_heads=(2, 4),
             num_classes=10, drop_path_rate=0.0)


def eval_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("eval", overrides=list(overrides))


def perturbed_timm(**kw) -> TimmSwin:
    model = TimmSwin(**kw).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def reference_metrics(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float]:
    top1, top5 = accuracy(logits, targets, topk=(1, 5))  # timm's own accuracy
    return top1.item(), top5.item(), torch.nn.functional.cross_entropy(logits, targets).item()


def test_evaluate_matches_reference_with_uneven_batches():
    model = swin.create_model("swin_micro", num_classes=7).eval()
    x, y = torch.randn(53, 3, 16, 16), torch.randint(0, 7, (53,))
    with torch.no_grad():
        logits = model(x)
    loader = DataLoader(TensorDataset(x, y), batch_size=10)  # last batch of 3
    res = evaluate(model, loader, progress=False)
    top1, top5, loss = reference_metrics(logits, y)
    assert res["num_images"] == 53
    assert res["top1"] == pytest.approx(top1, abs=1e-4) and res["top5"] == pytest.approx(top5, abs=1e-4)
    assert res["loss"] == pytest.approx(loss, rel=1e-5)
    assert res["images_per_sec"] > 0
    with pytest.raises(ValueError, match="do not fit a model with 7 classes"):
        evaluate(model, DataLoader(TensorDataset(x, torch.full((53,), 9)), batch_size=10), progress=False)


def test_compiled_evaluation_runs_the_tail_eagerly():
    """evaluate(compiled=...): the batches of the first batch's size run the compiled model (one graph), the last,
    partial batch the eager one; the numbers are the eager evaluation's."""
    from torch._dynamo.testing import CompileCounter

    model = swin.create_model("swin_micro", num_classes=7).eval()
    x, y = torch.randn(53, 3, 16, 16), torch.randint(0, 7, (53,))
    loader = DataLoader(TensorDataset(x, y), batch_size=10)  # last batch of 3
    grad_modes = []
    hook = model.register_forward_pre_hook(lambda *_: grad_modes.append(torch.is_grad_enabled()))
    eager = evaluate(model, loader, progress=False)
    hook.remove()
    assert grad_modes and not any(grad_modes)  # no autograd graph is recorded while evaluating
    torch._dynamo.reset()
    counter = CompileCounter()
    res = evaluate(model, loader, progress=False, compiled=torch.compile(model, backend=counter))
    assert counter.frame_count == 1  # the partial batch did not compile a second graph
    for k in ("top1", "top5", "loss", "num_images"):
        assert res[k] == pytest.approx(eager[k], rel=1e-5)
    assert eager["compile_seconds"] is None and res["compile_seconds"] > 0


def test_eval_compile_policy():
    assert eval_compile_mode("auto", "cpu", 10**7, 1000) is None  # the CPU stays eager
    assert eval_compile_mode("auto", "cuda", 999, 1000) is None  # too few images to win the compile time back
    assert eval_compile_mode("auto", "cuda", 1000, 1000) == "reduce-overhead"
    assert eval_compile_mode(True, "cpu", 1, 1000) == "default"
    assert eval_compile_mode(False, "cuda", 10**7, 0) is None
    with pytest.raises(ConfigError, match="compile='yes': use auto"):
        eval_compile_mode("yes", "cuda", 1, 0)
    with pytest.raises(ConfigError, match="compile_min_images=-1"):
        eval_compile_mode("auto", "cuda", 1, -1)


def test_overridden_groups():
    assert overridden_groups(["checkpoint=a", "model=swin_micro", "data.root=/x", "+foo.bar=1"]) == {
        "checkpoint", "model", "data", "foo"}


@pytest.fixture(scope="module")
def digits_val():
    """The digits validation split exactly as eval.py builds it, and a timm model with its logits on it."""
    from swin.data.datasets import build_datasets
    cfg = eval_cfg()
    val = build_datasets(to_settings(cfg.data), 16).val
    x = torch.stack([val[i][0] for i in range(len(val))])
    y = torch.tensor([val[i][1] for i in range(len(val))])
    ref = perturbed_timm(**MICRO)
    with torch.no_grad():
        logits = ref(x)
    return ref, x, y, logits


@pytest.mark.parametrize("layout", ["timm", "microsoft"])
def test_eval_timm_and_microsoft_checkpoints(digits_val, tmp_path, layout):
    ref, _, y, logits = digits_val
    sd = ref.state_dict()
    if layout == "microsoft":
        sd = {re.sub(r"^layers\.1\.downsample", "layers.0.downsample", k).replace("head.fc.", "head."): v
              for k, v in sd.items()}
        torch.save({"model": sd}, tmp_path / "ckpt.pth")
    else:
        torch.save(sd, tmp_path / "ckpt.pth")
    cfg = eval_cfg(f"checkpoint={tmp_path / 'ckpt.pth'}", "model=swin_micro", "data=digits", "batch_size=37",
                   f"output={tmp_path / 'res.json'}", "progress=false", "device=cpu")
    res = run_eval(cfg, tmp_path, {"model", "data"})
    top1, top5, loss = reference_metrics(logits, y)
    assert res["checkpoint_kind"] == layout and res["num_images"] == len(y)
    assert res["top1"] == pytest.approx(top1, abs=1e-4) and res["top5"] == pytest.approx(top5, abs=1e-4)
    assert res["loss"] == pytest.approx(loss, rel=1e-4)
    assert json.loads((tmp_path / "res.json").read_text())["top1"] == res["top1"]


def test_eval_compiles_for_inference(digits_val, tmp_path, monkeypatch):
    """eval.py compiles through swin.compile_model in its mode; the compiled model's metrics are the model's (the
    spy hands the model back uncompiled)."""
    import swin.evaluate

    ref, _, y, logits = digits_val
    torch.save(ref.state_dict(), tmp_path / "ckpt.pth")
    calls = []
    monkeypatch.setattr(swin.evaluate, "compile_model", lambda model, mode, **kw: calls.append((mode, kw)) or model)
    cfg = eval_cfg(f"checkpoint={tmp_path / 'ckpt.pth'}", "model=swin_micro", "data=digits", "batch_size=37",
                   "progress=false", "device=cpu", "compile=true")
    res = run_eval(cfg, tmp_path, {"model", "data"})
    assert calls == [("default", {})]
    assert res["top1"] == pytest.approx(reference_metrics(logits, y)[0], abs=1e-4)


def test_eval_transforms_follow_timm_pretrained_config(tmp_path, caplog):
    """An image folder evaluated with a timm-named model: resize/crop 0.9/bicubic/mean-std from timm's cfg."""
    from PIL import Image
    from timm.data import create_transform
    from torchvision.datasets import ImageFolder

    for c in ("a", "b", "c"):
        (tmp_path / "data" / "val" / c).mkdir(parents=True)
        for i in range(3):
            arr = torch.randint(0, 256, (41 + 3 * i, 57, 3), dtype=torch.uint8).numpy()
            Image.fromarray(arr).save(tmp_path / "data" / "val" / c / f"{i}.png")
    arch = dict(img_size=32, patch_size=4, window_size=4, embed_dim=8, depths=(2, 2), num_heads=(1, 2),
                num_classes=3, drop_path_rate=0.0)
    ref = perturbed_timm(**arch)
    torch.save(ref.state_dict(), tmp_path / "w.pth")
    cfg = eval_cfg(f"checkpoint={tmp_path / 'w.pth'}", "model=swin_tiny_patch4_window7_224", "data=imagefolder",
                   f"data.root={tmp_path / 'data'}", "data.num_workers=0", "model.img_size=32",
                   "model.window_size=4", "model.embed_dim=8", "model.depths=[2,2]", "model.num_heads=[1,2]",
                   "progress=false", "device=cpu", f"output={tmp_path / 'r.json'}")
    res = run_eval(cfg, tmp_path, {"model", "data"})
    assert res["transforms"] == {"interpolation": "bicubic", "crop_pct": 0.9, "mean": [0.485, 0.456, 0.406],
                                 "std": [0.229, 0.224, 0.225]}
    # reference: timm's transform built from the same settings, timm's model
    tf = create_transform(input_size=32, is_training=False, interpolation="bicubic", crop_pct=0.9,
                          mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    folder = ImageFolder(str(tmp_path / "data" / "val"), transform=tf)
    x = torch.stack([folder[i][0] for i in range(len(folder))])
    y = torch.tensor(folder.targets)
    with torch.no_grad():
        logits = ref(x)
    top1, _, loss = reference_metrics(logits, y)
    assert res["num_images"] == 9 and res["top1"] == pytest.approx(top1)
    assert res["loss"] == pytest.approx(loss, rel=1e-4)
    # transforms=data keeps the data config's crop (0.875): a different preprocessing
    cfg.transforms = "data"
    with caplog.at_level("INFO", logger="swin.eval"):
        assert run_eval(cfg, tmp_path, {"model", "data"})["transforms"] == {}
    said = [r.getMessage() for r in caplog.records if "transforms from" in r.getMessage()]
    assert said and said[-1].endswith("transforms from data config"), said  # no stray {} after it


def _run(args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run a command in its own process group; on timeout the whole group (torchrun's workers too) is killed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(args)}\n{err[-3000:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


@pytest.mark.slow
def test_ddp_eval_is_exact(digits_val, tmp_path):
    """torchrun with 2 CPU processes (gloo) on 101 images, batch 8: shards of 51 and 50, nothing padded;
    the same numbers as one process and as timm's model."""
    ref, _, y, logits = digits_val
    torch.save(ref.state_dict(), tmp_path / "w.pth")
    common = [f"checkpoint={tmp_path / 'w.pth'}", "model=swin_micro", "data=digits", "data.val_limit=101",
              "batch_size=8", "device=cpu", "progress=false"]
    r1 = run_eval(eval_cfg(*common, f"output={tmp_path / 'one.json'}"), tmp_path, {"model", "data"})
    two = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(ROOT / "eval.py"), *common, f"output={tmp_path / 'two.json'}", f"hydra.run.dir={tmp_path / 'two'}"],
               tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    r2 = json.loads((tmp_path / "two.json").read_text())
    assert r2["world_size"] == 2 and r1["num_images"] == r2["num_images"] == 101
    top1, top5, loss = reference_metrics(logits[:101], y[:101])
    for r in (r1, r2):
        assert r["top1"] == pytest.approx(top1, abs=1e-4) and r["top5"] == pytest.approx(top5, abs=1e-4)
        assert r["loss"] == pytest.approx(loss, rel=1e-4)


def test_cli_errors(tmp_path):
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"PK\x03\x04" + os.urandom(500))
    r = _run([sys.executable, str(ROOT / "eval.py"), f"checkpoint={bad}", f"hydra.run.dir={tmp_path / 'o'}"], tmp_path)
    assert r.returncode == 2 and "truncated or corrupt" in r.stderr and "Traceback" not in r.stderr
    r = _run([sys.executable, str(ROOT / "eval.py"), f"hydra.run.dir={tmp_path / 'o'}"], tmp_path)
    assert r.returncode == 2 and "checkpoint=PATH" in r.stderr and "Traceback" not in r.stderr
