"""train.py: the out-of-the-box digits run, resuming (also after kill -9), and the training mechanics."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from _train_utils import (
    DET,
    FAST,
    REPO,
    CrashOrNaN,
    SignalAt,
    cli_env,
    image_folder,
    make_cfg,
    model_weights,
    run_cli,
    train_inprocess,
)


def test_cli_trains_digits_and_writes_run_dir(tmp_path):
    """The default command (12 epochs, no EMA) learns, and writes checkpoints, summary, log and an offline wandb run."""
    run = tmp_path / "run"
    r = run_cli(f"hydra.run.dir={run}", "train.epochs=12", "train.ema=false", "train.save_every_epochs=6",
                "logger.progress=false")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] == 12 and summary["images_per_sec"] > 0
    # the steady state: the second half of the last epoch (22 updates: after the 11th), in the log and the summary
    steady = summary["images_per_sec_steady"]
    assert steady > 0 and summary["history"][-1]["images_per_sec_steady"] == steady
    assert f"({steady:.0f} in its second half)" in (run / "train.log").read_text().splitlines()[-2]
    assert summary["final_top1"] >= 60.0, summary["history"]  # chance is 10%; the full default run reaches ~97%
    assert summary["best_top1"] >= summary["final_top1"]
    for name in ("last.pt", "best.pt"):
        state = torch.load(run / "checkpoints" / name, weights_only=True)
        assert {"model", "optimizer", "scheduler", "scaler", "ema", "epoch", "global_step", "rng",
                "config"} <= state.keys()
    assert torch.load(run / "checkpoints" / "last.pt", weights_only=True)["epoch"] == 12
    assert (run / "checkpoints" / "epoch_0006.pt").is_file() and (run / "checkpoints" / "epoch_0012.pt").is_file()
    assert "val top1" in (run / "train.log").read_text()
    assert list((run / "wandb").glob("offline-run-*")), "wandb offline run missing"
    # wandb's own banner and footer stay quiet offline; one line of ours says where the run is and how to sync it
    lines = (r.stdout + r.stderr).splitlines()
    assert not [line for line in lines if line.startswith("wandb:")], r.stdout[-2000:]
    assert len([line for line in lines if "offline wandb run in" in line and "wandb sync" in line]) == 1


def test_resume_mid_epoch_gives_the_uninterrupted_result(tmp_path, monkeypatch):
    """A crash mid-epoch, then the same run dir: it resumes from the mid-epoch checkpoint, skips the
    batches already done (same sampler order) and ends with exactly the weights of an uninterrupted run."""
    args = [*DET, "train.save_every_steps=4"]  # 6 steps/epoch: saves at global steps 4 and 8
    train_inprocess(tmp_path / "ref", *args)
    run = tmp_path / "run"
    monkeypatch.setattr("swin.train.setup.create_model", CrashOrNaN(crash_at=11))  # dies in epoch 2, step 5
    with pytest.raises(RuntimeError, match="simulated crash"):
        train_inprocess(run, *args)
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert (state["epoch"], state["step_in_epoch"], state["global_step"]) == (1, 2, 8)
    monkeypatch.undo()
    summary = train_inprocess(run, *args)
    assert summary["epochs"] == 2 and [h["epoch"] for h in summary["history"]] == [1, 2]
    assert "resumed from" in (run / "train.log").read_text()
    ref = model_weights(tmp_path / "ref" / "checkpoints" / "last.pt")
    got = model_weights(run / "checkpoints" / "last.pt")
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_stop_signal_saves_at_next_check_point_and_same_command_finishes(tmp_path, monkeypatch):
    """SIGUSR2 (SLURM's warning before the time limit) outside a cluster job: last.pt at the next check point, a
    Preempted stop, and the same command ends with exactly the weights of an uninterrupted run."""
    from swin.train.preemption import Preempted

    args = [*DET, "logger.log_every_steps=2"]  # 6 steps/epoch; check points every 2 updates and at epoch ends
    train_inprocess(tmp_path / "ref", *args)
    run = tmp_path / "run"
    monkeypatch.setattr("swin.train.setup.create_model", SignalAt(call=8, signum=signal.SIGUSR2))  # epoch 2, step 2
    with pytest.raises(Preempted, match=r"SIGUSR2 received .* after 1 epoch\(s\) \+ 2 step\(s\)"):
        train_inprocess(run, *args)
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert (state["epoch"], state["step_in_epoch"], state["global_step"]) == (1, 2, 8)  # global step 8 checks
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # the handler is gone with the run
    monkeypatch.undo()
    summary = train_inprocess(run, *args)
    assert [h["epoch"] for h in summary["history"]] == [1, 2] and summary["global_step"] == 12
    ref = model_weights(tmp_path / "ref" / "checkpoints" / "last.pt")
    got = model_weights(run / "checkpoints" / "last.pt")
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_resume_from_explicit_file_into_new_run_dir(tmp_path):
    train_inprocess(tmp_path / "a", *DET, "train.epochs=1")
    summary = train_inprocess(tmp_path / "b", *DET, f"train.resume={tmp_path / 'a' / 'checkpoints' / 'last.pt'}")
    assert [h["epoch"] for h in summary["history"]] == [1, 2] and summary["global_step"] == 12
    # the same command again continues from the run dir's own last.pt (done), not from train.resume
    again = train_inprocess(tmp_path / "b", *DET, f"train.resume={tmp_path / 'a' / 'checkpoints' / 'last.pt'}")
    assert again["global_step"] == 12 and len(again["history"]) == 2


def test_kill_9_mid_epoch_then_same_command_finishes(tmp_path):
    run = tmp_path / "run"
    args = [*FAST, f"hydra.run.dir={run}", "train.epochs=3", "data.train_limit=480", "train.batch_size=16",
            "train.save_every_steps=5", "train.warmup_epochs=1"]
    with open(tmp_path / "first.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, env=cli_env(),
                                stdout=subprocess.DEVNULL, stderr=err)
        last, deadline = run / "checkpoints" / "last.pt", time.time() + 240
        while proc.poll() is None and time.time() < deadline:
            if last.is_file():
                state = torch.load(last, weights_only=True)  # atomic saves: always a complete file
                if state["epoch"] == 1 and state["step_in_epoch"] > 0:  # in the middle of epoch 2
                    os.kill(proc.pid, signal.SIGKILL)
                    break
            time.sleep(0.05)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "first.err").read_text()[-3000:]
    assert not (run / "summary.json").exists()
    for ckpt in (run / "checkpoints").glob("*.pt"):
        torch.load(ckpt, weights_only=True)  # none is corrupt

    r = run_cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] == 3 and [h["epoch"] for h in summary["history"]] == [1, 2, 3]
    assert summary["global_step"] == 3 * 30
    assert "resumed from" in (run / "train.log").read_text()
    assert not list((run / "checkpoints").glob(".*.tmp"))


def test_ctrl_c_saves_says_how_to_resume_and_the_same_command_finishes(tmp_path):
    """A real train.py process sent SIGINT (Ctrl-C) in epoch 2: it writes last.pt after the update in flight,
    ends with one line on stderr (no traceback) and exit status 130; the same command then resumes and finishes."""
    run = tmp_path / "run"
    args = [*FAST, f"hydra.run.dir={run}", "train.epochs=3", "data.train_limit=480", "train.batch_size=16",
            "train.warmup_epochs=1", "logger.log_every_steps=1"]
    with open(tmp_path / "first.err", "w") as err:
        proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, env=cli_env(),
                                stdout=subprocess.DEVNULL, stderr=err)
        last, log, deadline = run / "checkpoints" / "last.pt", run / "train.log", time.time() + 240
        while proc.poll() is None and time.time() < deadline:
            # an update of epoch 2 logged (a step record per update): last.pt, if saved now, is past epoch 1's
            if log.is_file() and " epoch 2 step " in log.read_text():
                os.kill(proc.pid, signal.SIGINT)
                break
            time.sleep(0.05)
        proc.wait(timeout=120)
    stderr = (tmp_path / "first.err").read_text()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith("stopped: interrupted (Ctrl-C) after "), stderr[-2000:]
    assert "rerun the same command to resume" in stderr
    state = torch.load(last, weights_only=True)
    assert state["global_step"] > 30 and state["global_step"] < 90  # saved after epoch 1, before the end
    assert not (run / "summary.json").exists()

    r = run_cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert [h["epoch"] for h in summary["history"]] == [1, 2, 3] and summary["global_step"] == 3 * 30
    assert "resumed from" in (run / "train.log").read_text()


def test_gradient_accumulation_matches_full_batch(tmp_path):
    a = [*DET, "train.epochs=1"]
    train_inprocess(tmp_path / "full", *a)
    train_inprocess(tmp_path / "accum", *a, "train.accum_steps=4")
    ref = model_weights(tmp_path / "full/checkpoints/last.pt")
    got = model_weights(tmp_path / "accum/checkpoints/last.pt")
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=5e-5)  # summation order differs


def test_grad_checkpointing_matches_plain(tmp_path):
    a = [*DET, "train.epochs=1"]
    train_inprocess(tmp_path / "plain", *a)
    train_inprocess(tmp_path / "ckpt", *a, "train.grad_checkpointing=true")
    ref = model_weights(tmp_path / "plain/checkpoints/last.pt")
    got = model_weights(tmp_path / "ckpt/checkpoints/last.pt")
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)


def test_ema_is_evaluated_and_checkpointed(tmp_path):
    summary = train_inprocess(tmp_path, *DET, "train.ema=true", "train.ema_decay=0.9")
    assert "model_top1" in summary["history"][-1]
    state = torch.load(tmp_path / "checkpoints/last.pt", weights_only=True)
    ema, model = state["ema"], state["model"]
    assert ema.keys() == model.keys() and any(not torch.equal(ema[k], model[k]) for k in model)


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_mixed_precision_trains(tmp_path, amp):
    summary = train_inprocess(tmp_path, *DET, "train.epochs=1", f"train.amp={amp}")
    assert summary["amp"] == amp and summary["nonfinite_steps"] == 0
    assert summary["history"][0]["train_loss"] < 2.4  # ln(10) = 2.30 is chance; finite and learning
    scaler = torch.load(tmp_path / "checkpoints/last.pt", weights_only=True)["scaler"]
    assert ("scale" in scaler) == (amp == "fp16")


def test_runs_without_wandb_installed(tmp_path, monkeypatch):
    """The GPU machine has no wandb: disabled and offline modes still train; online fails up front."""
    from swin.config import ConfigError
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    args = [*DET, "train.epochs=1"]
    assert train_inprocess(tmp_path / "off", *args, "logger.wandb.mode=offline")["epochs"] == 1
    assert "wandb is not installed" in (tmp_path / "off/train.log").read_text()
    with pytest.raises(ConfigError, match="logger.wandb.mode=disabled"):
        train_inprocess(tmp_path / "on", *args, "logger.wandb.mode=online")


def test_imagenet_experiments_hold_the_official_recipe():
    cfg = make_cfg("experiment=imagenet_swin_tiny", "data.root=/nonexistent")
    t, d = cfg.train, cfg.data
    assert cfg.model.name == "swin_tiny_patch4_window7_224" and cfg.model.drop_path_rate == 0.2
    assert (t.opt, t.lr, t.lr_base_size, t.batch_size, t.weight_decay) == ("adamw", 1e-3, 1024, 1024, 0.05)
    assert (t.epochs, t.warmup_epochs, t.sched, t.min_lr, t.clip_grad) == (300, 20, "cosine", 1e-5, 5.0)
    assert (t.label_smoothing, t.mixup, t.cutmix) == (0.1, 0.8, 1.0)
    assert (d.auto_augment, d.reprob, d.interpolation, d.crop_pct) == ("rand-m9-mstd0.5-inc1", 0.25, "bicubic", 0.875)
    assert round(cfg.model.img_size / d.crop_pct) == 256  # resize 256 -> center crop 224
    for size, dpr in (("small", 0.3), ("base", 0.5)):
        assert make_cfg(f"experiment=imagenet_swin_{size}").model.drop_path_rate == dpr


def test_synthetic_data_smoke_run(tmp_path):
    summary = train_inprocess(tmp_path, *FAST, "data=synthetic", "data.num_classes=8", "data.train_samples=128",
                              "data.val_samples=64", "data.num_workers=0", "train.epochs=2", "train.warmup_epochs=0")
    assert summary["epochs"] == 2 and summary["final_top1"] is not None


def test_imagenet_recipe_on_an_image_folder(tmp_path):
    """The ImageNet path end to end (timm RandAugment, random erasing, mixup/cutmix, soft-target loss, bicubic
    eval crop) on a tiny folder; the label-preserving colour task is still learned."""
    image_folder(tmp_path / "data")
    summary = train_inprocess(tmp_path / "run", *FAST, "data=imagenet", f"data.root={tmp_path / 'data'}",
                              "data.num_workers=0", "train.batch_size=4", "train.epochs=3", "train.warmup_epochs=1",
                              "train.mixup=0.8", "train.cutmix=1.0", "train.lr=2e-3")
    assert summary["epochs"] == 3 and summary["nonfinite_steps"] == 0
    assert summary["history"][-1]["train_loss"] < summary["history"][0]["train_loss"]


def test_compile_mode_is_checked_before_training():
    from swin.train.checks import ConfigError, check_config
    cfg = make_cfg("train.compile=true", "train.compile_mode=fastest")
    with pytest.raises(ConfigError, match="train.compile_mode='fastest': use one of default, reduce-overhead"):
        check_config(cfg, 1, torch.device("cpu"))
    check_config(make_cfg("train.compile=true", "train.compile_mode=reduce-overhead"), 1, torch.device("cpu"))


@pytest.mark.parametrize("mistake", ["missing root", "corrupt image"])
def test_user_mistakes_end_in_one_line(tmp_path, mistake):
    """A data.root that does not exist, and an unreadable image without data.skip_corrupt (raised in a loader
    worker): train.py says what is wrong and how to fix it in one line, exit status 2, no traceback."""
    image_folder(tmp_path / "data", corrupt=True)
    root = tmp_path / "nonexistent" if mistake == "missing root" else tmp_path / "data"
    r = run_cli(*FAST, "data=imagefolder", f"data.root={root}", "model.img_size=16", "data.num_workers=1",
                "train.batch_size=4", "train.epochs=1", "train.warmup_epochs=0", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    line = r.stderr.strip().splitlines()[-1]
    if mistake == "missing root":
        assert line == f"error: data.root={root} has no train/ folder; point data.root at a folder with train/ and " \
                       "val/ sub-folders of one folder per class"
    else:
        assert line.startswith("error: cannot read image ") and "set data.skip_corrupt=true" in line, line


def test_final_log_line_rounds_the_figures(tmp_path):
    """train.log's last line gives the top-1 figures to two decimals, as percentages."""
    import re
    train_inprocess(tmp_path, *DET, "train.epochs=1", "data.train_limit=96")
    last = (tmp_path / "train.log").read_text().strip().splitlines()[-1]
    assert re.search(r"done: best top1 \d+\.\d{2}%, final top1 \d+\.\d{2}%, \d+ img/s", last), last
