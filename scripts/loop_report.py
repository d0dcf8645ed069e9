"""The table of ``bash scripts/gpu_session.sh loop``: train.py's images/s against its own model step.

    python scripts/loop_report.py OUT     # reads OUT/loop_model/benchmark.json and OUT/loop_*/summary.json

Model step: scripts/benchmark.py's training row (grid=loop: forward, loss, backward, fused AdamW on the same
batch, nothing else). train.py rows: the last epoch's images/s and the fraction of its wall time spent
blocked in next(loader) (summary.json ``images_per_sec`` and ``data_wait_fraction``), and their ratio to
the model step with the same torch.compile mode (default, or reduce-overhead: CUDA graphs).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

# (run directory, label, the torch.compile mode of the model step it is compared with; None: eager)
RUNS = [("synthetic_compiled", "train.py data=synthetic, compiled", "default"),
        ("synthetic_cudagraphs", "train.py data=synthetic, compiled, compile_mode=reduce-overhead",
         "reduce-overhead"),
        ("synthetic_eager", "train.py data=synthetic, eager", None),
        ("imagenet_folder", "train.py experiment=imagenet_swin_tiny on JPEGs, compiled", "default")]


def model_steps(bench: Path) -> tuple[dict[str, float], list[str]]:
    """{compile mode: model-step img/s} from benchmark.json's compiled training rows, and their table lines."""
    steps: dict[str, float] = {}
    lines = []
    rows = json.loads(bench.read_text())["rows"] if bench.is_file() else []
    for r in rows:
        if "train_img_s" not in r or not r.get("compile"):
            continue
        mode = r.get("compile_mode") or "default"
        steps[mode] = r["train_img_s"]
        lines.append(f"| benchmark.py model step ({r['impl']} {r['attention']}, compiled {mode}, "
                     f"b{r['batch_size']} {r['precision']}) | {r['train_img_s']:,.0f} | 1.00 | - | - |")
    return steps, lines


def main(out: Path) -> None:
    steps, model_lines = model_steps(out / "loop_model" / "benchmark.json")
    lines = ["| run | img/s | x model step, same compile mode | data-wait (last epoch) | img/s per epoch |",
             "|---|---|---|---|---|", *model_lines]
    for name, label, mode in RUNS:
        path = out / f"loop_{name}" / "summary.json"
        if not path.is_file():
            lines.append(f"| {label} | missing ({path}) | - | - | - |")
            continue
        s = json.loads(path.read_text())
        ips, wait = s.get("images_per_sec") or 0.0, s.get("data_wait_fraction")
        ratio = f"{ips / steps[mode]:.2f}" if mode in steps else "-"
        per_epoch = ", ".join(f"{h.get('images_per_sec', 0):,.0f}" for h in s.get("history", []))
        lines.append(f"| {label} | {ips:,.0f} | {ratio} | {'-' if wait is None else f'{wait:.1%}'} | {per_epoch} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
