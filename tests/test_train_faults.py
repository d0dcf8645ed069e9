"""train.py under bad conditions: non-finite losses, unreadable images, wrong configs."""
import json

import pytest
import torch
from _train_utils import DET, SMALL, CrashOrNaN, image_folder, make_cfg, model_weights, run_cli, train_inprocess

from swin.data.folder import CorruptImageError
from swin.train.loop import ConfigError, NonFiniteLossError, train


def _all_finite(state_dict):
    return all(torch.isfinite(v).all() for v in state_dict.values() if v.is_floating_point())


def test_non_finite_loss_skips_the_step_and_counts_it(tmp_path, monkeypatch):
    monkeypatch.setattr("swin.train.setup.create_model", CrashOrNaN(nan_calls={2, 5, 9}))
    summary = train_inprocess(tmp_path, *DET)
    assert summary["nonfinite_steps"] == 3 and summary["epochs"] == 2
    # had a NaN update gone through, the weights would be NaN (and the save would have refused)
    assert _all_finite(model_weights(tmp_path / "checkpoints/last.pt"))
    assert "non-finite loss" in (tmp_path / "train.log").read_text()


def test_non_finite_losses_in_a_row_stop_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr("swin.train.setup.create_model", CrashOrNaN(nan_from=4))
    with pytest.raises(NonFiniteLossError, match=r"3 updates in a row.*train.lr"):
        train_inprocess(tmp_path, *DET, "train.max_nonfinite=3", "train.save_every_steps=1")
    saved = list((tmp_path / "checkpoints").glob("*.pt"))
    assert saved and all(_all_finite(model_weights(p)) for p in saved)
    assert torch.load(tmp_path / "checkpoints/last.pt", weights_only=True)["global_step"] <= 5


FOLDER = [*SMALL, "data=imagefolder", "data.num_workers=1", "train.batch_size=4", "train.epochs=1"]


def test_corrupt_image_error_names_the_file(tmp_path):
    image_folder(tmp_path / "data", corrupt=True)
    with pytest.raises(CorruptImageError, match=r"(garbage|truncated)\.png.*data\.skip_corrupt=true"):
        train_inprocess(tmp_path / "run", *FOLDER, f"data.root={tmp_path / 'data'}")


def test_corrupt_images_skipped_and_counted(tmp_path):
    image_folder(tmp_path / "data", corrupt=True)
    summary = train_inprocess(tmp_path / "run", *FOLDER, f"data.root={tmp_path / 'data'}", "data.skip_corrupt=true",
                              "train.epochs=2")
    assert summary["skipped_images"] == 4  # 2 unreadable files x 2 epochs
    assert json.loads((tmp_path / "run/summary.json").read_text())["skipped_images"] == 4
    assert summary["final_top1"] == 100.0  # red vs blue


@pytest.mark.parametrize("override, fix", [
    ("model.window_size=16", r"model.window_size<=8"),
    ("train.accum_steps=3", r"multiple of 3"),
    ("model.attention=flash_window", r"model.attention=auto"),
    ("train.amp=fp4", r"^train.amp='fp4': use auto, bf16, fp16, fp32 or fp8$"),
    ("train.amp=fp8", r"^train.amp=fp8 needs a CUDA GPU with FP8 tensor cores, not cpu; use train.amp=bf16$"),
    ("train.fp8_layers=large", r"^train.fp8_layers='large': use pays \(the layers FP8 speeds up\) or all \(every "
                               r"layer FP8 GEMMs take\)$"),
    ("train.batch_size=-4", r"^train.batch_size=-4: set train.batch_size to 1 or more$"),
    ("train.eval_batch_size=0", r"^train.eval_batch_size=0: set train.eval_batch_size to 1 or more$"),
    ("data.num_workers=-1", r"^data.num_workers=-1: set data.num_workers to 0 or more$"),
    ("train.label_smoothing=1.5", r"^train.label_smoothing=1.5: set train.label_smoothing between 0 and 1$"),
    # architectures no Swin is built with: one line, not a ZeroDivisionError or a torch error from the model
    ("model.window_size=0", r"^model.window_size=0: set model.window_size to 1 or more$"),
    ("model.patch_size=[4,0]", r"^model.patch_size=\[4, 0\]: set model.patch_size to 1 or more$"),
    ("model.embed_dim=7", r"^model.num_heads=\[2, 4\]: stage 1 has 7 channels \(model.embed_dim=7, doubled per "
                          r"stage\), which 2 heads do not divide; change model.num_heads or model.embed_dim$"),
    ("model.depths=[2,2,2]", r"^model.depths=\[2, 2, 2\] and model.num_heads=\[2, 4\] need one entry each per "
                             r"stage: give them the same length$"),
    ("model.num_heads=[2,0]", r"^model.num_heads=\[2, 0\]: set every entry to 1 or more$"),
    ("model.drop_path_rate=1.5", r"^model.drop_path_rate=1.5: set model.drop_path_rate between 0 and 1$"),
])
def test_wrong_config_fails_before_training(tmp_path, override, fix):
    with pytest.raises(ConfigError, match=fix):
        train(make_cfg(*DET, "device=cpu", override), tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing started


def _one_line_error(r) -> str:
    """The single line of a CLI run that stopped on a user error (exit 2, no traceback)."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("overrides, says", [
    # misspelt key, option, type: composition errors, one line instead of Hydra's report
    (["train.epochz=3"], "train.epochz is not a key of train.py's config (python train.py --help lists them)"),
    (["model=swin_tny"], "model=swin_tny: no such option; choose one of swin_base_patch4_window12_384,"),
    (["train.lr=abc"], "train.lr=abc: Value 'abc' of type 'str' could not be converted to Float"),
    # values that compose but name nothing: one line instead of a traceback from torch or timm
    (["device=gpu"], "device='gpu': use auto, cpu, cuda or cuda:<index>"),
    (["train.opt=adamx"], "train.opt='adamx': Optimizer adamx not found in registry"),
    (["train.sched=cosin"], "train.sched='cosin': Unknown scheduler 'cosin'"),
    (["model.window_size=0"], "model.window_size=0: set model.window_size to 1 or more"),
])
def test_cli_typo_is_one_line(tmp_path, overrides, says):
    r = run_cli(f"hydra.run.dir={tmp_path}", "train.epochs=1", "train.warmup_epochs=0", "logger.wandb.mode=disabled",
                *overrides)
    assert says in _one_line_error(r)
    assert not (tmp_path / "checkpoints" / "last.pt").exists()


def test_wandb_online_without_a_login_is_one_line(tmp_path, monkeypatch):
    """logger.wandb.mode=online where wandb has no API key (no login, no WANDB_API_KEY): one line naming the
    fix, not wandb's traceback."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc or wandb settings of the machine's user
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / ".config" / "wandb"))
    r = run_cli(f"hydra.run.dir={tmp_path / 'run'}", "train.epochs=1", "train.warmup_epochs=0",
                "logger.wandb.mode=online")
    line = _one_line_error(r)
    assert line.startswith("error: logger.wandb.mode=online: wandb did not start (") and "No API key" in line
    assert "run `wandb login`, or log offline (logger.wandb.mode=offline, the default)" in line


def test_resuming_another_model_is_one_line(tmp_path):
    """Rerunning in a run directory whose last.pt is of another model (a changed model.* key) names the mismatch
    and the fix; the old checkpoint stays."""
    train(make_cfg(*DET, "train.epochs=1"), tmp_path)
    saved = (tmp_path / "checkpoints" / "last.pt").read_bytes()
    r = run_cli(f"hydra.run.dir={tmp_path}", *DET, "train.epochs=2", "model.window_size=2")
    line = _one_line_error(r)
    assert "cannot resume from" in line and "relative_position_bias_table" in line and "hydra.run.dir" in line
    assert (tmp_path / "checkpoints" / "last.pt").read_bytes() == saved


def test_resuming_from_a_damaged_last_pt_is_one_line(tmp_path):
    """Rerunning in a run directory whose last.pt was damaged outside the run (saves are atomic: a truncated copy,
    a full disk elsewhere) names the file and the fix, and leaves it as it is."""
    train(make_cfg(*DET, "train.epochs=1"), tmp_path)
    last = tmp_path / "checkpoints" / "last.pt"
    last.write_bytes(last.read_bytes()[:1000])
    damaged = last.read_bytes()
    line = _one_line_error(run_cli(f"hydra.run.dir={tmp_path}", *DET, "train.epochs=2"))
    assert line.startswith(f"error: could not read checkpoint {last}: the file is truncated or corrupt (")
    assert line.endswith("Move it out of the way to start the run afresh, or resume from another file with "
                         "train.resume=PATH.")
    assert last.read_bytes() == damaged


def test_cli_config_error_is_a_message_not_a_traceback(tmp_path):
    r = run_cli(f"hydra.run.dir={tmp_path}", "train.batch_size=30", "train.accum_steps=4")
    assert r.returncode == 2
    assert "error: train.batch_size=30 is not divisible" in r.stderr and "Traceback" not in r.stderr


def test_cli_bad_value_fails_at_start_naming_the_key(tmp_path):
    r = run_cli(f"hydra.run.dir={tmp_path}", "train.batch_size=-4")  # the right type out of range
    assert _one_line_error(r) == "error: train.batch_size=-4: set train.batch_size to 1 or more"
    assert not (tmp_path / "checkpoints").exists()  # nothing built
