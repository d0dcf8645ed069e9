"""The benchmark scripts run end to end on the CPU (tiny shapes) and write sane JSON.

Not timing assertions: only that every row ran, numbers are positive and finite, and every attention
backend agrees with the float64 reference. The Triton kernels run in the interpreter (TRITON_INTERPRET=1).
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(args: list[str], cwd: Path, timeout: float = 80) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_bench_attention_cpu(tmp_path):
    out = tmp_path / "attn.json"
    run_script([str(ROOT / "scripts/bench_attention.py"), "--device", "cpu", "--preset", "tiny", "--dtype", "fp32",
                "--warmup", "0", "--reps", "1", "--json", str(out)], cwd=tmp_path)
    result = json.loads(out.read_text())
    assert positive(result["copy_gbs"])
    rows = result["rows"]
    assert [r["backend"] for r in rows] == ["standard", "sdpa", "flash_window"]
    for r in rows:
        assert "error" not in r, r
        for key in ("ms_fwd", "ms_fwd_bwd", "gbs_fwd", "gbs_fwd_bwd", "pct_copy_fwd", "pct_copy_fwd_bwd"):
            assert positive(r[key]), (r["backend"], key, r[key])
        assert r["bytes_fwd_bwd"] == 2 * r["bytes_fwd"]
        assert set(r["errors"]) == {"out", "dq", "dk", "dv", "dtable"}
        assert max(r["errors"].values()) < 1e-4, (r["backend"], r["errors"])
    assert "| tiny | float32 | flash_window |" in result["table"]


@pytest.mark.slow
def test_benchmark_cpu(tmp_path):
    out = tmp_path / "bench"
    run_script([str(ROOT / "scripts/benchmark.py"), "model=swin_micro", "device=cpu", "grid=smoke",
                "grid.batch_size=[2]", "steps.warmup=1", "steps.timed=1", "steps.repeats=1",
                "profile.enabled=true", "profile.steps=1",
                f"out_dir={out}", f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=tmp_path)
    result = json.loads((out / "benchmark.json").read_text())
    rows = result["rows"]
    got = [(r["impl"], r["attention"]) for r in rows]
    assert got == [("ours", "flash_window"), ("ours", "sdpa"), ("ours", "standard"), ("timm", "math"),
                   ("timm", "sdpa")]
    for r in rows:
        assert "error" not in r and "skipped" not in r, r
        assert positive(r["infer_img_s"]) and positive(r["train_img_s"]), r
        assert math.isfinite(r["train_loss"])
        for mode in ("infer", "train"):
            assert 0 < r[f"{mode}_attention_ms_per_step"] <= r[f"{mode}_busy_ms_per_step"], (r["attention"], mode)
        if r["impl"] == "timm":  # the intended timm attention path really ran
            assert r["timm_fused_attn"] == (r["attention"] == "sdpa")
            assert r["infer_speedup_vs_best_timm"] <= 1.0 + 1e-9
        else:
            assert r["our_attention"] == r["attention"]
            assert positive(r["train_speedup_vs_best_timm"])
    assert (out / "benchmark.png").stat().st_size > 1000
    assert "| ours | flash_window | no | 2 | fp32 |" in (out / "benchmark.md").read_text()


@pytest.mark.parametrize("grid", sorted(p.stem for p in (ROOT / "configs/grid").glob("*.yaml")))
def test_every_grid_config_expands(grid):
    """Each configs/grid/ entry composes with configs/benchmark.yaml and expands into valid rows."""
    from hydra import compose, initialize_config_dir

    from scripts.benchmark import expand_grid

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("benchmark", overrides=[f"grid={grid}"])
    specs = expand_grid(cfg.grid)
    assert specs and all(s.batch_size > 0 for s in specs)
    assert {s.compile_mode for s in specs} <= {None, "default", "reduce-overhead", "max-autotune",
                                               "max-autotune-no-cudagraphs"}
    assert cfg.steps.timed > 0 and cfg.steps.repeats > 0
