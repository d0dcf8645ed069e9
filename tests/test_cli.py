"""train.py and eval.py as a user meets them: --help, the console's log format, the live progress bar."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
import torch
from _train_utils import DET, REPO, cli_env, make_cfg, train_inprocess

import swin.config as schemas

KEY_LINE = re.compile(r"^  (\S+?)=(\S.*?)\s{2,}(\S.*)$")  # "  train.lr=0.004     peak learning rate ..."
LOG_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] \S")


def _cli(program: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / f"{program}.py"), *args], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=timeout)


def _schemas() -> list[type]:
    return [v for v in vars(schemas).values() if dataclasses.is_dataclass(v) and isinstance(v, type)]


def test_every_schema_key_has_a_description():
    for schema in _schemas():
        for f in dataclasses.fields(schema):
            assert f.metadata.get("help", "").strip(), f"{schema.__name__}.{f.name} has no description"


@pytest.mark.parametrize("program, groups, not_groups, keys", [
    ("train", ["model", "data", "experiment", "hydra/launcher"], ["schema", "grid"],
     {"train.lr": "4.0e-3", "data.classes": "null", "logger.wandb.mode": "offline"}),
    ("eval", ["model", "data"], ["schema", "grid", "experiment"], {"checkpoint": "???", "batch_size": "128"}),
])
def test_help_describes_every_key_and_lists_the_groups_a_user_picks(program, groups, not_groups, keys):
    r = _cli(program, "--help")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    text = r.stdout
    listed = re.findall(r"^  ([\w/]+): ", text, flags=re.M)
    assert set(groups) <= set(listed) and not set(not_groups) & set(listed), listed
    lines = [m.groups() for m in map(KEY_LINE.match, text.splitlines()) if m]
    values = {k: v for k, v, _ in lines}
    assert len(lines) > 30 and all(description.strip() for _, _, description in lines)
    for key, value in keys.items():
        assert float(values[key]) == float(value) if key == "train.lr" else values[key] == value, (key, values)
    # every leaf key of the composed config is on the page
    cfg = make_cfg() if program == "train" else None
    if cfg is not None:
        from omegaconf import OmegaConf
        flat = OmegaConf.to_container(cfg, resolve=True)

        def leaves(d, prefix=""):
            for k, v in d.items():
                yield from leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]
        assert set(leaves(flat)) <= set(values), set(leaves(flat)) - set(values)


def test_help_shows_the_values_the_command_sets():
    r = _cli("train", "experiment=finetune", "train.epochs=7", "--help")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "finetune (chosen)" in r.stdout
    values = {m.group(1): m.group(2) for m in map(KEY_LINE.match, r.stdout.splitlines()) if m}
    assert values["train.epochs"] == "7" and values["train.layer_decay"] == "0.75"
    r = _cli("train", "model=swin_tny", "--help")
    assert r.returncode == 2 and r.stderr.startswith("error: model=swin_tny: no such option"), r.stderr


@pytest.mark.slow
def test_progress_bar_shows_live_figures_between_log_lines(tmp_path):
    """Before the first log line (log_every_steps beyond the run), the bar shows images/s and a loss that moves,
    from the updates after the first, not img_s=0 and the first update's loss for the whole epoch."""
    r = _cli("train", f"hydra.run.dir={tmp_path}", "logger.wandb.mode=disabled", "logger.log_every_steps=100000",
             "train.epochs=3", "train.batch_size=16", "train.warmup_epochs=0", "train.save_every_epochs=0")
    assert r.returncode == 0, r.stderr[-3000:]
    # tqdm's refreshes: "epoch 1/3:  31%|...| 28/90 [00:01<00:02, 27.2it/s, data_wait=4%, img_s=435, loss=2.2, ...]"
    states = re.findall(r"epoch (\d+)/3:\s+\d+%\|[^|]*\| (\d+)/(\d+) \[[^,\]]*, [^,\]]*, ([^\]]*)\]", r.stderr)
    middle = [(int(e), dict(kv.split("=") for kv in post.split(", "))) for e, n, total, post in states
              if 1 < int(n) < int(total)]
    assert len(middle) >= 3, r.stderr[-2000:]
    assert all(float(p["img_s"]) > 0 for _, p in middle), middle
    losses = {e: {p["loss"] for q, p in middle if q == e} for e, _ in middle}
    assert any(len(seen) > 1 for seen in losses.values()), losses


def test_eval_logs_as_train_does(tmp_path):
    """eval.py's console lines and eval.log in train.py's format ("[time] message"), the weights' load line among
    them, with rounded figures."""
    train_inprocess(tmp_path / "run", *DET, "train.epochs=1")
    ckpt = tmp_path / "run" / "checkpoints" / "last.pt"
    r = _cli("eval", f"checkpoint={ckpt}", f"hydra.run.dir={tmp_path / 'eval'}", "progress=false")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert lines and all(LOG_LINE.match(line) for line in lines), lines
    assert any("loaded ours checkpoint" in line for line in lines)
    assert re.search(r"top1 \d+\.\d\d%, top5 \d+\.\d\d%", lines[-1]), lines[-1]
    assert (tmp_path / "eval" / "eval.log").read_text().splitlines()[-1] == lines[-1]
    assert torch.isfinite(torch.tensor(float(re.search(r"loss (\S+),", lines[-1]).group(1))))
