"""FP8 training against bf16 on a task that learns: train.py twice with the seeds fixed, ``train.amp=bf16`` then
``train.amp=fp8``; the FP8 run's final training loss must be within ``--tolerance`` (2%) of bf16's.

    python scripts/check_fp8.py                        # Swin-B 224 on the digits (upscaled), 15 epochs of 22 updates
    python scripts/check_fp8.py -- train.epochs=30     # more train.py overrides after --

Prints each epoch's training loss of both runs and the final ratio, writes ``<out>/check_fp8.json``, and exits 1
when the final losses differ by more than the tolerance (2 when FP8 cannot run here: no FP8 GPU or no torchao).
Swin-B because FP8 runs only layers of 1024 features or more (swin.precision.FP8_MIN_FEATURES): Swin-T has none.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swin.precision import fp8_problem  # noqa: E402

RECIPE = ["model=swin_base_patch4_window7_224", "model.img_size=224", "data=digits", "train.batch_size=64",
          "train.epochs=15", "train.warmup_epochs=2", "seed=0", "train.save_every_epochs=0",
          "logger.wandb.mode=disabled", "logger.progress=false"]


def run(amp: str, out: Path, overrides: list[str]) -> list[float]:
    """train.py with the recipe and ``train.amp=amp``; its training loss per epoch."""
    run_dir = out / amp
    cmd = [sys.executable, str(ROOT / "train.py"), *RECIPE, *overrides, f"train.amp={amp}",
           f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"train.py with train.amp={amp} failed (exit {proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return [epoch["train_loss"] for epoch in summary["history"]]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Arguments after -- are train.py overrides for both runs.")
    p.add_argument("--out", type=Path, default=Path("outputs/check_fp8"), help="run directories and the result")
    p.add_argument("--tolerance", type=float, default=0.02, help="largest relative difference of the final loss")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if problem := fp8_problem(device):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    losses = {amp: run(amp, args.out, args.overrides) for amp in ("bf16", "fp8")}
    ratio = losses["fp8"][-1] / losses["bf16"][-1]
    print("| epoch | bf16 train loss | fp8 train loss |\n|---|---|---|")
    for epoch, (a, b) in enumerate(zip(losses["bf16"], losses["fp8"]), 1):
        print(f"| {epoch} | {a:.4f} | {b:.4f} |")
    ok = abs(ratio - 1) <= args.tolerance
    print(f"final fp8 / bf16 loss: {ratio:.4f} ({'within' if ok else 'outside'} {args.tolerance:.0%})")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "check_fp8.json").write_text(json.dumps(
        {"recipe": RECIPE + args.overrides, "train_loss": losses, "ratio": ratio, "tolerance": args.tolerance,
         "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
