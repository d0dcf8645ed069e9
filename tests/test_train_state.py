"""Atomic training-state files: a crash while saving never corrupts the previous checkpoint."""
import math
import random
import re

import numpy as np
import pytest
import torch

from swin.models.pretrained import CheckpointError
from swin.train import checkpoint as ts


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((4,), value)}, "optimizer": {"state": {}}, "ema": None, "epoch": 1}


def test_crash_during_save_keeps_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    ts.save_train_state(path, _state(1.0))
    real_save = torch.save

    def torn_save(obj, f, *a, **k):  # writes half a file, then the process "dies"
        real_save(obj, f, *a, **k)
        f.truncate(f.tell() // 2)
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(KeyboardInterrupt):
        ts.save_train_state(path, _state(2.0))
    monkeypatch.undo()
    assert torch.equal(ts.load_train_state(path)["model"]["w"], torch.full((4,), 1.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]  # no temporary left behind


def test_stale_temporaries_are_removed(tmp_path):
    (tmp_path / ".last.pt.abc.tmp").write_bytes(b"partial")
    ts.save_train_state(tmp_path / "last.pt", _state(0.0))
    assert ts.remove_stale_temporaries(tmp_path) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("key", ["model", "ema"])
def test_non_finite_model_is_never_saved(tmp_path, bad, key):
    path = tmp_path / "last.pt"
    ts.save_train_state(path, _state(1.0))
    state = _state(1.0)
    state[key] = {"w": torch.tensor([1.0, bad])}
    with pytest.raises(ts.NonFiniteModelError, match="non-finite"):
        ts.save_train_state(path, state)
    assert torch.equal(ts.load_train_state(path)["model"]["w"], torch.full((4,), 1.0))


def test_truncated_checkpoint_gives_error_naming_file(tmp_path):
    path = tmp_path / "last.pt"
    ts.save_train_state(path, _state(1.0))
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=re.escape(f"could not read checkpoint {path}: the file is truncated "
                                                        "or corrupt (")) as error:
        ts.load_train_state(path)
    assert str(error.value).endswith("Move it out of the way to start the run afresh, or resume from another file "
                                     "with train.resume=PATH.")
    assert "\n" not in str(error.value)


def test_rng_states_round_trip_through_a_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    ts.save_train_state(tmp_path / "s.pt", {**_state(0.0), "rng": ts.capture_rng()})
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    ts.restore_rng(ts.load_train_state(tmp_path / "s.pt")["rng"])  # weights_only=True load
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
