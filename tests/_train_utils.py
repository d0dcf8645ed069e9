"""Shared helpers of the training tests: composing configs, running train in-process or as a CLI."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir

import swin.config  # noqa: F401  (registers the config schemas before compose)

REPO = Path(__file__).resolve().parents[1]
# quiet and fast: no wandb, no progress bar, no periodic epoch checkpoints
FAST = ["logger.wandb.mode=disabled", "logger.progress=false", "train.save_every_epochs=0"]
# small deterministic runs: fp32, no stochastic depth, no EMA, 2 epochs of 6 steps (any dataset)
SMALL = [*FAST, "train.amp=fp32", "model.drop_path_rate=0.0", "train.ema=false", "data.train_limit=192",
         "data.val_limit=96", "train.batch_size=32", "train.warmup_epochs=0", "train.epochs=2"]
# ... on digits without augmentation, so that runs can be compared weight for weight
DET = [*SMALL, "data.shift=0"]


def make_cfg(*overrides: str) -> Any:
    """configs/train.yaml composed with the overrides (a DictConfig, as train.py's Hydra app gets it)."""
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def make_settings(*overrides: str) -> Any:
    """make_cfg's config as the typed settings the package's internals take (swin.config.to_settings)."""
    from swin.config import to_settings
    return to_settings(make_cfg(*overrides))


def train_inprocess(run_dir: Path, *overrides: str) -> dict[str, Any]:
    from swin.train.loop import train
    return train(make_cfg(*overrides), run_dir)


def model_weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def cli_env() -> dict[str, str]:
    # loopback only for gloo; one thread per process so two processes do not fight over 2 cores
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=cli_env(), capture_output=True,
                          text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(*args: str, nproc: int, nnodes: int = 1, node_rank: int = 0, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
            f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}", "train.py", *args]


def submitit_local_cmd(*args: str, tasks: int) -> list[str]:
    """train.py as a Hydra multirun through the submitit launcher's local executor (configs/hydra/launcher/local.yaml):
    one job of `tasks` processes on this machine, laid out as a SLURM job."""
    return [sys.executable, str(REPO / "train.py"), "-m", "hydra/launcher=local",
            f"hydra.launcher.gpus_per_node={tasks}", "hydra.launcher.timeout_min=10", "device=cpu", *args]


def child_pids(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(command name)": state, ppid, ...
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


class CrashOrNaN:
    """Wrap swin.create_model so that chosen training forward calls return NaN or raise (a crash)."""

    def __init__(self, nan_calls: set[int] | None = None, nan_from: int | None = None, crash_at: int | None = None):
        self.nan_calls, self.nan_from, self.crash_at = nan_calls or set(), nan_from, crash_at
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> torch.nn.Module:
        import swin
        model = swin.create_model(*args, **kwargs)
        model.register_forward_hook(self._hook)
        return model

    def _hook(self, module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        self.calls += 1
        if self.crash_at is not None and self.calls == self.crash_at:
            raise RuntimeError("simulated crash")
        if self.calls in self.nan_calls or (self.nan_from is not None and self.calls >= self.nan_from):
            return output * float("nan")
        return output


class SignalAt:
    """Wrap swin.create_model so that the process sends itself `signum` in its `call`-th training forward."""

    def __init__(self, call: int, signum: int):
        self.call, self.signum, self.calls = call, signum, 0

    def __call__(self, *args: Any, **kwargs: Any) -> torch.nn.Module:
        import swin
        model = swin.create_model(*args, **kwargs)
        model.register_forward_hook(self._hook)
        return model

    def _hook(self, module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
        if module.training:
            self.calls += 1
            if self.calls == self.call:
                os.kill(os.getpid(), self.signum)


def image_folder(root: Path, corrupt: bool = False) -> None:
    """train/ and val/ of red and blue 20x20 images (class0, class1); optionally two unreadable files."""
    from PIL import Image

    for split, n in (("train", 8), ("val", 4)):
        for c, colour in enumerate(("red", "blue")):
            d = root / split / f"class{c}"
            d.mkdir(parents=True)
            for i in range(n):
                Image.new("RGB", (20, 20), colour).save(d / f"{i}.png")
    if corrupt:
        (root / "train/class0/garbage.png").write_bytes(b"this is not an image")
        good = (root / "train/class1/0.png").read_bytes()
        (root / "train/class1/truncated.png").write_bytes(good[: len(good) // 2])
