"""The device-side non-finite guard (swin.train.guard) through the real training step: a non-finite gradient or
loss skips the update (weights, optimizer state, EMA unchanged) and is counted; and on a GPU the
steady-state step never synchronises with the host."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from _train_utils import DET, FAST, make_cfg, model_weights, train_inprocess

from swin.config import to_settings
from swin.train.distributed import DistInfo
from swin.train.loop import EpochClock, NonFiniteLossError
from swin.train.setup import setup
from swin.train.step import train_step


def _setup(tmp_path, *overrides: str, device: str = "cpu", base: tuple[str, ...] = tuple(DET)):
    cfg = make_cfg(*base, f"device={device}", *overrides)
    run = setup(to_settings(cfg), tmp_path, DistInfo(0, 0, 1, torch.device(device)))
    run.train_loader.set_epoch(0)
    run.model.train()
    return run


def _step(run, batches) -> None:
    train_step(run, batches, EpochClock())
    run.global_step += 1
    run.scheduler.step_update(num_updates=run.global_step)


def _snapshot(run) -> dict:
    return copy.deepcopy({"model": run.raw_model.state_dict(), "opt": run.optimizer.state_dict()["state"],
                          "ema": run.ema.module.state_dict() if run.ema is not None else None,
                          "scaler": run.scaler.state_dict()})


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


class _PoisonGrad:
    """Make one parameter's gradient NaN while `on` (the loss stays finite)."""

    def __init__(self, param: torch.nn.Parameter):
        self.on = False
        param.register_hook(lambda g: g * math.nan if self.on else g)


class _PoisonLoss:
    """Make the model's output (hence the loss) NaN while `on`."""

    def __init__(self, model: torch.nn.Module):
        self.on = False
        model.register_forward_hook(lambda m, i, out: out * math.nan if self.on else out)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-adamw", "foreach-adamw"])
def test_nan_gradient_leaves_weights_and_optimizer_state_unchanged(tmp_path, fused):
    """Finite loss, one NaN gradient: the update is skipped on the device (fused AdamW's found_inf) or on the
    host (foreach AdamW), clipping and EMA included, and the step is counted as non-finite."""
    run = _setup(tmp_path, f"train.opt_fused={str(fused).lower()}", "train.ema=true", "train.ema_decay=0.9")
    assert run.skip_on_device == fused  # fused: the kernel's found_inf; foreach: read on the host
    poison = _PoisonGrad(run.raw_model.head.fc.weight)
    batches = iter(run.train_loader)
    for _ in range(2):  # optimizer state and EMA exist and move
        _step(run, batches)
    assert run.stats.read()[:3] == (0, 0, 0)  # (longest in a row since the last read, in a row, in total)
    before = _snapshot(run)
    poison.on = True
    _step(run, batches)
    assert _equal(_snapshot(run), before), "a step with a NaN gradient changed the training state"
    assert run.stats.read()[:3] == (1, 1, 1)
    _step(run, batches)
    assert run.stats.read()[:3] == (2, 2, 2)
    poison.on = False
    _step(run, batches)
    after = _snapshot(run)
    assert not _equal(after["model"], before["model"]) and not _equal(after["ema"], before["ema"])
    longest, streak, total, loss_sum, finite_losses = run.stats.read()
    # the streak ended (0 now), the longest since the last read was 2, and the next read starts from 0
    assert (longest, streak, total, finite_losses) == (2, 0, 2, 5) and math.isfinite(loss_sum)  # finite losses count
    assert run.stats.read().longest_streak == 0


def test_fp16_non_finite_loss_is_skipped_by_the_scaler_and_counted(tmp_path):
    """With a GradScaler (fp16), a NaN loss reaches the scaler as a NaN gradient: it skips the step (and backs
    off its scale, as for an overflow); the step is counted. Overflowing gradients alone are the scaler's
    routine and are not counted."""
    run = _setup(tmp_path, "train.amp=fp16", "train.ema=true")
    loss_poison, grad_poison = _PoisonLoss(run.raw_model), _PoisonGrad(run.raw_model.head.fc.weight)
    batches = iter(run.train_loader)
    _step(run, batches)
    before = _snapshot(run)
    loss_poison.on = True
    _step(run, batches)
    after = _snapshot(run)
    assert _equal(after["model"], before["model"]) and _equal(after["opt"], before["opt"])
    assert _equal(after["ema"], before["ema"])
    assert after["scaler"]["scale"] < before["scaler"]["scale"]
    assert run.stats.read()[1:3] == (1, 1)  # (in a row, in total)
    loss_poison.on, grad_poison.on = False, True
    before = _snapshot(run)
    _step(run, batches)
    after = _snapshot(run)
    assert _equal(after["model"], before["model"]) and _equal(after["ema"], before["ema"])
    assert run.stats.read()[1:3] == (0, 1)  # skipped by the scaler, not counted


class NaNGradModel:
    """Wrap swin.create_model: the head's weight gradient is NaN in the chosen backward calls (1-based)."""

    def __init__(self, nan_calls: set[int] | None = None, nan_from: int | None = None):
        self.nan_calls, self.nan_from, self.calls = nan_calls or set(), nan_from, 0

    def __call__(self, *args, **kwargs):
        import swin
        model = swin.create_model(*args, **kwargs)
        model.head.fc.weight.register_hook(self._hook)
        return model

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls in self.nan_calls or (self.nan_from is not None and self.calls >= self.nan_from):
            return grad * math.nan
        return grad


def test_nan_gradients_in_a_run_are_skipped_counted_and_logged(tmp_path, monkeypatch):
    monkeypatch.setattr("swin.train.setup.create_model", NaNGradModel(nan_calls={3, 7}))
    summary = train_inprocess(tmp_path, *DET)
    assert summary["nonfinite_steps"] == 2 and summary["epochs"] == 2
    assert all(torch.isfinite(v).all() for v in model_weights(tmp_path / "checkpoints/last.pt").values())
    # read at sync points (here: an epoch's first update, its middle (the 4th of 6) and its last): update 3 is
    # reported at step 4
    text = (tmp_path / "train.log").read_text()
    assert "non-finite loss or gradients in 1 update(s) up to epoch 1 step 4: skipped, weights unchanged (0 in a " \
           "row now, longest 1 since the last check, 1 in total)" in text
    assert "in 1 update(s) up to epoch 2 step 1: skipped, weights unchanged (1 in a row now, longest 1 since the " \
           "last check, 2 in total)" in text


def test_nan_gradients_in_a_row_stop_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr("swin.train.setup.create_model", NaNGradModel(nan_from=1))
    with pytest.raises(NonFiniteLossError, match=r"non-finite for 3 updates in a row"):
        train_inprocess(tmp_path, *DET, "train.max_nonfinite=2", "logger.log_every_steps=3")
    # counters are read after an epoch's first update and at log lines (every 3 updates): the run stops at
    # update 3, before the end of the epoch, so nothing was saved
    assert not (tmp_path / "checkpoints/last.pt").exists()
    text = (tmp_path / "train.log").read_text()
    assert "(1 in a row now, longest 1 since the last check, 1 in total)" in text  # the read after update 1


def test_a_streak_that_ended_between_two_reads_still_stops_the_run(tmp_path, monkeypatch):
    """Updates 2-5 non-finite, 6 fine: the read at the epoch's end (update 6) sees no streak now, but the device
    kept the longest one since the previous read (update 1), 4 >= train.max_nonfinite."""
    monkeypatch.setattr("swin.train.setup.create_model", NaNGradModel(nan_calls={2, 3, 4, 5}))
    with pytest.raises(NonFiniteLossError, match=r"non-finite for 4 updates in a row \(train.max_nonfinite=4\)"):
        train_inprocess(tmp_path, *DET, "train.max_nonfinite=4", "logger.log_every_steps=50")
    text = (tmp_path / "train.log").read_text()
    assert "up to epoch 1 step 6: skipped, weights unchanged (0 in a row now, longest 4 since the last check, 4 in " \
           "total)" in text


def test_log_loss_is_the_mean_since_the_last_log_line(tmp_path):
    """Losses are summed on the device and read at check points; each log line shows the mean of its window,
    and the epoch's train_loss is the mean of all its updates."""
    summary = train_inprocess(tmp_path, *DET, "train.epochs=1", "logger.log_every_steps=2", "train.max_nonfinite=10")
    lines = [ln for ln in (tmp_path / "train.log").read_text().splitlines() if " loss " in ln and "step" in ln]
    losses = [float(ln.split(" loss ")[1].split()[0]) for ln in lines]
    assert len(losses) == 3  # steps 2, 4, 6 of 6
    assert summary["history"][0]["train_loss"] == pytest.approx(sum(losses) / 3, rel=1e-4)


GPU_CASES = {
    "synthetic-bf16": ("data=synthetic", "train.amp=bf16"),
    "synthetic-fp16": ("data=synthetic", "train.amp=fp16"),
    "synthetic-mixup-accum": ("data=synthetic", "train.amp=bf16", "train.mixup=0.8", "train.cutmix=1.0",
                              "train.accum_steps=2"),
    "digits-loader": ("data=digits", "train.amp=bf16"),  # a DataLoader through DeviceLoader (pinned, side stream)
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_steady_state_step_never_syncs(tmp_path, case):
    """CUDA's sync debug mode raises on any host-device synchronisation (item, nonzero, blocking copies):
    training steps (batches to the device, forward, backward, clipping, guard, fused AdamW, EMA, counters)
    run under it without error."""
    run = _setup(tmp_path, *GPU_CASES[case], "data.train_limit=512", "train.batch_size=32", "train.ema=true",
                 "model.drop_path_rate=0.0", device="cuda", base=tuple(FAST))
    assert run.optimizer.defaults.get("fused") and run.skip_on_device
    batches = iter(run.train_loader)
    _step(run, batches)  # first step: lazy initialisation (optimizer state, kernels, cuBLAS handles...)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            _step(run, batches)
            run.stats.peek()  # the progress bar's live figures: an asynchronous copy, no sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    run.stats.peek()  # collects the last copy, starts one of the final counters
    torch.cuda.synchronize()
    live = run.stats.peek()
    counts = run.stats.read()
    assert (counts.longest_streak, counts.streak, counts.total, counts.finite) == (0, 0, 0, 5)
    assert live == (pytest.approx(counts.loss_sum), 5)


def test_ema_updater_matches_timm_model_ema_and_skips_on_the_device():
    """EmaUpdater = timm's ModelEmaV3.update (decay schedule, buffers) for kept steps, no change for skipped ones."""
    from timm.utils import ModelEmaV3

    from swin.train.guard import EmaUpdater
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    ours, ref = ModelEmaV3(model, decay=0.9), ModelEmaV3(model, decay=0.9)
    updater = EmaUpdater(ours, model)
    for step in range(6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        model(torch.randn(8, 3))  # moves the BatchNorm running stats (float and integer buffers)
        skip = step in (2, 3)
        before = copy.deepcopy(ours.module.state_dict())
        updater.update(step, torch.tensor(skip))
        if skip:
            floats = {k: v for k, v in before.items() if v.is_floating_point()}
            assert all(torch.equal(ours.module.state_dict()[k], v) for k, v in floats.items())
        else:
            ref.update(model, step=step)
            for k, v in ref.module.state_dict().items():
                torch.testing.assert_close(ours.module.state_dict()[k], v, rtol=1e-6, atol=1e-6)
