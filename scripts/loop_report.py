"""The table of ``bash scripts/gpu_session.sh loop``: train.py's images/s against its own model step.

    python scripts/loop_report.py OUT     # reads OUT/loop_model/benchmark.json and OUT/loop_*/summary.json

Model step: scripts/benchmark.py's training row (grid=loop: forward, loss, backward, fused AdamW on the same
batch, nothing else). train.py rows: the last epoch's images/s and the fraction of its wall time spent
blocked in next(loader) (summary.json ``images_per_sec`` and ``data_wait_fraction``), and their ratio to
the model step with the same compile setting.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

RUNS = [("synthetic_compiled", "train.py data=synthetic, compiled", True),
        ("synthetic_eager", "train.py data=synthetic, eager", False),
        ("imagenet_folder", "train.py experiment=imagenet_swin_tiny on JPEGs, compiled", True)]


def main(out: Path) -> None:
    bench = out / "loop_model" / "benchmark.json"
    model_step: float | None = None
    lines = ["| run | img/s | x compiled model step | data-wait (last epoch) | img/s per epoch |",
             "|---|---|---|---|---|"]
    if bench.is_file():
        rows = [r for r in json.loads(bench.read_text())["rows"] if "train_img_s" in r]
        if rows:
            model_step = rows[0]["train_img_s"]
            lines.append(f"| benchmark.py model step ({rows[0]['impl']} {rows[0]['attention']}, compiled, "
                         f"b{rows[0]['batch_size']} {rows[0]['precision']}) | {model_step:,.0f} | 1.00 | - | - |")
    for name, label, compiled in RUNS:
        path = out / f"loop_{name}" / "summary.json"
        if not path.is_file():
            lines.append(f"| {label} | missing ({path}) | - | - | - |")
            continue
        s = json.loads(path.read_text())
        ips, wait = s.get("images_per_sec") or 0.0, s.get("data_wait_fraction")
        ratio = f"{ips / model_step:.2f}" if model_step and compiled else "-"
        per_epoch = ", ".join(f"{h.get('images_per_sec', 0):,.0f}" for h in s.get("history", []))
        lines.append(f"| {label} | {ips:,.0f} | {ratio} | {'-' if wait is None else f'{wait:.1%}'} | {per_epoch} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
