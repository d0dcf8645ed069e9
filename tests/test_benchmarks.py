"""The benchmark scripts run end to end on the CPU (tiny shapes) and write sane JSON.

Not timing assertions: only that every row ran, numbers are positive and finite, and every attention
backend agrees with the float64 reference. The Triton kernels run in the interpreter (TRITON_INTERPRET=1).
"""
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import timm
import torch

import swin

ROOT = Path(__file__).resolve().parents[1]


def run_script(args: list[str], cwd: Path, timeout: float = 80) -> str:
    """Runs a script on the CPU (kernels in the Triton interpreter); its stdout."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


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
                "profile.enabled=true", "profile.steps=1", "profile.top_kernels=3",
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
            # no GPU kernels on the CPU: the breakdown keys are written, as None
            assert r[f"{mode}_breakdown_ms"] is None and r[f"{mode}_busy_union_ms_per_step"] is None, r
        if r["impl"] == "timm":  # the intended timm attention path really ran
            assert r["timm_fused_attn"] == (r["attention"] == "sdpa")
            assert r["infer_speedup_vs_best_timm"] <= 1.0 + 1e-9
        else:
            assert r["our_attention"] == r["attention"]
            assert positive(r["train_speedup_vs_best_timm"])
    assert (out / "benchmark.png").stat().st_size > 1000
    md = (out / "benchmark.md").read_text()
    assert "| ours | flash_window | no | 2 | fp32 |" in md
    assert "| row | step | step ms | GPU busy ms | attention | GEMM |" in md
    assert "| ours flash_window b2 fp32 | train | " in md and "| timm sdpa b2 fp32 | infer | " in md
    assert result["breakdown_table"] in md
    assert (out / "profile.md").read_text().count(" by self time over 1 steps") == 2 * len(rows)  # row x step



def test_benchmark_times_eager_rows_again_in_turn(tmp_path):
    """steps.interleave (grid=eager): the eager rows of a batch size are timed again, repeat by repeat in turn; a
    row's img/s is the median of those repeats, its first figure kept as *_img_s_sequential."""
    out = tmp_path / "bench"
    rows = "[{impl:ours,attention:sdpa,compile:[false]},{impl:timm,attention:math,compile:[false]}]"
    run_script([str(ROOT / "scripts/benchmark.py"), "model=swin_micro", "device=cpu", "grid=smoke",
                f"grid.rows={rows}", "grid.batch_size=[2]", "steps.warmup=1", "steps.timed=2", "steps.repeats=3",
                "steps.interleave=true", f"out_dir={out}", f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=tmp_path)
    result = json.loads((out / "benchmark.json").read_text())
    for r in result["rows"]:
        for mode in ("infer", "train"):
            repeats = r[f"{mode}_repeats_img_s"]
            assert len(repeats) == 3 and all(positive(v) for v in repeats), r
            assert r[f"{mode}_img_s"] == statistics.median(repeats)
            assert positive(r[f"{mode}_img_s_sequential"]) and r[f"{mode}_img_s_sequential"] != r[f"{mode}_img_s"]
    ours, theirs = result["rows"]
    assert ours["train_speedup_vs_best_timm"] == ours["train_img_s"] / theirs["train_img_s"]


def test_compiled_rows_are_timed_in_turn_too(monkeypatch):
    """steps.interleave times compiled rows in turn with the others of their batch size and precision (each row
    built again, compiled as in its own run, under a raised recompile limit); rows of another batch size, and rows
    that failed or were skipped, keep their own figures."""
    from hydra import compose, initialize_config_dir

    import scripts.benchmark as bench

    rows = "[{impl:ours,attention:sdpa,compile:[true,false]},{impl:timm,attention:math,compile:[true]}]"
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("benchmark", overrides=["model=swin_micro", "device=cpu", f"grid.rows={rows}",
                                              "grid.batch_size=[2,3]", "grid.precision=[fp32]", "steps.warmup=1",
                                              "steps.timed=1", "steps.repeats=3", "steps.interleave=true"])
    specs = bench.expand_grid(cfg.grid)
    compiled = []

    def fake_compile(model, **kwargs):  # the model itself: the row is timed in eager mode, as it was compiled
        compiled.append(torch._dynamo.config.recompile_limit)
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    name, arch = bench.architecture(cfg.model)
    side = arch["img_size"]
    data = (torch.randn(3, 3, side, side), torch.randint(0, 10, (3,)))
    own = [{"infer_img_s": 1.0, "train_img_s": 1.0} for _ in specs]
    failed = next(i for i, s in enumerate(specs) if s.batch_size == 3 and s.impl == "timm")
    own[failed] = {"error": "RuntimeError: out of memory"}
    limit = torch._dynamo.config.recompile_limit
    bench.interleave_rows(specs, own, name, arch, cfg, torch.device("cpu"), data)
    for spec, row in zip(specs, own, strict=True):
        if spec.batch_size == 3 and spec.impl == "timm":
            assert row == {"error": "RuntimeError: out of memory"}
            continue
        for mode in ("infer", "train"):
            assert row[f"{mode}_img_s_sequential"] == 1.0, (spec.label, row)
            assert len(row[f"{mode}_repeats_img_s"]) == 3 and all(positive(v) for v in row[f"{mode}_repeats_img_s"])
            assert row[f"{mode}_img_s"] == statistics.median(row[f"{mode}_repeats_img_s"]) != 1.0
    # ours compiles its inference and its training step, timm one model: 2 + 1 compiled rows at each batch size but
    # the second, whose timm row failed
    assert len(compiled) == 2 * 2 + 1 and min(compiled) >= 16 * 2
    assert torch._dynamo.config.recompile_limit == limit  # restored


def test_rows_are_profiled_after_every_row_is_timed(tmp_path, monkeypatch):
    """profile.enabled: no row is timed in a process where the profiler has run (a host-bound row times slower
    there): every timed repeat, the rows' timing in turn included, comes before the first profiled step, and every
    row still gets its profile for both steps."""
    from hydra import compose, initialize_config_dir

    import scripts.benchmark as bench

    rows = "[{impl:ours,attention:sdpa,compile:[false]},{impl:timm,attention:math,compile:[false]}]"
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("benchmark", overrides=["model=swin_micro", "device=cpu", "grid=smoke", f"grid.rows={rows}",
                                              "grid.batch_size=[2]", "steps.warmup=1", "steps.timed=1",
                                              "steps.repeats=2", "steps.interleave=true", "profile.enabled=true",
                                              "profile.steps=1", f"out_dir={tmp_path}"])
    events: list[str] = []
    timed, profiled = bench._images_per_s, bench.profile_attention

    def timing(*args, **kwargs):
        events.append("timed")
        return timed(*args, **kwargs)

    def profiling(*args, **kwargs):
        events.append("profiled")
        return profiled(*args, **kwargs)

    saved = []  # what each write after the timing in turn says: ours' img/s, timm's, and ours' ratio
    write = bench.write_outputs

    def writing(out_dir, result, table):
        ours, theirs = (result["rows"] + [{}])[:2]
        if "infer_img_s_sequential" in ours:
            saved.append((ours["infer_img_s"], theirs["infer_img_s"], ours.get("infer_speedup_vs_best_timm")))
        return write(out_dir, result, table)

    monkeypatch.setattr(bench, "_images_per_s", timing)
    monkeypatch.setattr(bench, "profile_attention", profiling)
    monkeypatch.setattr(bench, "write_outputs", writing)
    result = bench.main(cfg)
    first = events.index("profiled")
    # each row: infer and train, 2 repeats on its own, then 2 more in turn
    assert events[:first] == ["timed"] * (2 * 2 * 4) and events[first:] == ["profiled"] * (2 * 2)
    # a save after each profiled row, then the final one: each compares the figures it shows
    assert len(saved) == 3 and all(ratio == ours / theirs for ours, theirs, ratio in saved), saved
    for r in result["rows"]:
        assert positive(r["infer_img_s"]) and r["infer_img_s_sequential"] != r["infer_img_s"], r
        for mode in ("infer", "train"):
            assert 0 < r[f"{mode}_attention_ms_per_step"] <= r[f"{mode}_busy_ms_per_step"], (r["attention"], mode)
    assert result["breakdown_table"] in (tmp_path / "benchmark.md").read_text()


def test_benchmark_swinv2_rows_against_timm_v2(tmp_path):
    """A Swin V2 name benchmarks ours against timm's SwinTransformerV2 (swinv2_micro: timm's class with our config);
    timm's V2 has no SDPA path, so that row is skipped with the reason, and ours is compared with timm's math row."""
    out = tmp_path / "bench"
    rows = "[{impl:ours,attention:sdpa,compile:[false]},{impl:timm,attention:math,compile:[false]}," \
           "{impl:timm,attention:sdpa,compile:[false]}]"
    run_script([str(ROOT / "scripts/benchmark.py"), "model=swinv2_micro", "device=cpu", "grid=smoke",
                f"grid.rows={rows}", "grid.batch_size=[2]", "steps.warmup=1", "steps.timed=1", "steps.repeats=1",
                f"out_dir={out}", f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=tmp_path)
    ours, timm_math, timm_sdpa = json.loads((out / "benchmark.json").read_text())["rows"]
    assert positive(ours["train_img_s"]) and positive(timm_math["train_img_s"])
    assert ours["params_m"] == timm_math["params_m"] and not timm_math["timm_fused_attn"]
    assert positive(ours["train_speedup_vs_best_timm"])
    assert timm_sdpa["skipped"] == "timm's Swin V2 has no SDPA path (explicit math only)"

    from timm.models.swin_transformer_v2 import SwinTransformerV2

    from scripts.benchmark import RowSpec, create_model
    assert isinstance(create_model(RowSpec("timm", "math", False, 2, "fp32"), "swinv2_micro", {}), SwinTransformerV2)


def test_benchmark_backbone_rows(tmp_path):
    """features_only=true benchmarks timm's features_only model of each side (grid=backbone's setting) at a
    non-square size with padded windows (every stage larger than the window: timm < 1.0.31 clamps otherwise): the
    same parameters on both sides, a finite loss, both steps timed."""
    out = tmp_path / "bench"
    rows = "[{impl:ours,attention:sdpa,compile:[false]},{impl:timm,attention:sdpa,compile:[false]}]"
    run_script([str(ROOT / "scripts/benchmark.py"), "model=swin_tiny_patch4_window7_224", "device=cpu",
                "grid=backbone", "model.embed_dim=16", "model.depths=[1,1,1,1]", "model.num_heads=[1,1,1,2]",
                "model.img_size=[128,160]", "model.window_size=3", f"grid.rows={rows}", "grid.batch_size=[2]",
                "grid.precision=[fp32]", "steps.warmup=1", "steps.timed=1", "steps.repeats=1", f"out_dir={out}",
                f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=tmp_path)
    result = json.loads((out / "benchmark.json").read_text())
    assert result["config"]["features_only"] and result["img_size"] == [128, 160]
    ours, ref = result["rows"]
    assert "error" not in ours and "error" not in ref, (ours, ref)
    # the backbone only: no norm or head, so fewer parameters than the classifier of the same architecture
    assert ours["params_m"] == ref["params_m"]
    classifier = timm.create_model("swin_tiny_patch4_window7_224", embed_dim=16, depths=(1, 1, 1, 1),
                                   num_heads=(1, 1, 1, 2), img_size=(128, 160), window_size=3)
    assert ours["params_m"] < sum(p.numel() for p in classifier.parameters()) / 1e6
    for r in (ours, ref):
        assert positive(r["infer_img_s"]) and positive(r["train_img_s"]) and math.isfinite(r["train_loss"])
        assert positive(r["fwd_bwd_img_s"])  # grid=backbone times forward+backward alone too
    assert ours["fwd_bwd_speedup_vs_best_timm"] == pytest.approx(ours["fwd_bwd_img_s"] / ref["fwd_bwd_img_s"])
    header = result["table"].splitlines()[0]
    assert "fwd+bwd img/s" in header and "fwd+bwd x best timm" in header


def test_gc_times_counts_the_collections_in_its_block():
    """GcTimes sees a full collection made inside it (generation 2, a positive duration) and none after it."""
    import gc

    import scripts.benchmark as bench

    with bench.GcTimes() as times:
        junk = [[i] for i in range(10_000)]
        del junk
        gc.collect()
    summary = times.summary()
    assert summary["gen2"]["count"] >= 1 and summary["gen2"]["ms"] > 0
    gc.collect()
    assert times.summary() == summary


def test_fwd_bwd_step_computes_gradients_and_leaves_the_weights():
    """The fwd_bwd step is the training step without opt.step(): every parameter gets a gradient (seen by a hook),
    none is changed and the gradients are released; the training step changes them."""
    from hydra import compose, initialize_config_dir

    import scripts.benchmark as bench

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("benchmark", overrides=["model=swin_micro", "device=cpu", "grid=backbone",
                                              "model.img_size=[64,96]", "grid.rows=[{impl:ours,attention:sdpa}]",
                                              "grid.batch_size=[2]", "grid.precision=[fp32]"])
    assert bench.row_modes(cfg) == ("infer", "train", "fwd_bwd")
    (spec,) = bench.expand_grid(cfg.grid)
    name, arch = bench.architecture(cfg.model)
    data = (torch.randn(2, 3, 64, 96), torch.randint(0, 10, (2,)))
    steps = bench.build_row(spec, name, arch, cfg, torch.device("cpu"), data)
    params = list(steps.model.parameters())
    before = [p.detach().clone() for p in params]
    grads: list[torch.Tensor] = []
    handles = [p.register_hook(lambda g: grads.append(g)) for p in params]
    steps.fwd_bwd()
    for handle in handles:
        handle.remove()
    assert len(grads) == len(params) and all(torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum() for g in grads) > 0
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and all(p.grad is None for p in params)
    steps.train()
    assert not all(torch.equal(p, b) for p, b in zip(params, before))


def test_benchmark_fused_gelu_rows(tmp_path):
    """fused_mlp_act in grid rows: ours takes the model's default (on) unless the row turns it off, which the
    labels say (the ordinary row carries no mark); a timm row cannot take it. On the CPU the epilogue does not run
    (fp32, no CUDA): both rows build and run, only their flag differs."""
    out = tmp_path / "bench"
    rows = "[{impl:ours,attention:standard},{impl:ours,attention:standard,fused_mlp_act:false}]"
    run_script([str(ROOT / "scripts/benchmark.py"), "model=swin_micro", "device=cpu", "grid=smoke",
                f"grid.rows={rows}", "grid.batch_size=[2]", "steps.warmup=1", "steps.timed=1", "steps.repeats=1",
                f"out_dir={out}", f"hydra.run.dir={tmp_path / 'hydra'}"], cwd=tmp_path)
    fused, plain = json.loads((out / "benchmark.json").read_text())["rows"]
    assert fused["fused_mlp_act"] is True and plain["fused_mlp_act"] is False
    assert fused["our_fused_mlp_act"] and not plain["our_fused_mlp_act"]  # what the built model does
    assert positive(plain["infer_img_s"]) and positive(plain["train_img_s"])
    table = (out / "benchmark.md").read_text()
    assert "| ours | standard | no | 2 | fp32 |" in table and "| ours -fused_gelu | standard | no | 2 | fp32 |" in table

    from omegaconf import OmegaConf

    from scripts.benchmark import RowSpec, expand_grid
    assert RowSpec("ours", "sdpa", True, 2, "bf16", None, False).label == "ours -fused_gelu sdpa +compile b2 bf16"
    assert RowSpec("ours", "sdpa", True, 2, "bf16", None, True).label == "ours sdpa +compile b2 bf16"
    grid = OmegaConf.create({"batch_size": [2], "precision": ["fp32"],
                             "rows": [{"impl": "ours", "attention": "sdpa"}, {"impl": "timm", "attention": "sdpa"}]})
    assert [s.fused_mlp_act for s in expand_grid(grid)] == [True, None]
    # rows that do not set it take the model config's model.fused_mlp_act
    assert [s.fused_mlp_act for s in expand_grid(grid, fused_mlp_act=False)] == [False, None]
    for value in (True, False):  # timm's model has no such setting, whatever the value
        bad = OmegaConf.create({**OmegaConf.to_container(grid),
                                "rows": [{"impl": "timm", "attention": "sdpa", "fused_mlp_act": value}]})
        with pytest.raises(ValueError, match="fused_mlp_act is a setting of ours"):
            expand_grid(bad)


def test_grid_rows_take_inductor_options(monkeypatch):
    """A row's inductor options (nested keys joined as inductor names them) reach swin.compile_model over ours,
    are recorded with the row and label it; the row compiles its inference step as eval.py does and its training
    step as train.py does (two compiled models, the same options); timm's rows refuse them, and an unknown name is
    one ValueError."""
    from hydra import compose, initialize_config_dir

    import scripts.benchmark as bench

    rows = ("[{impl:ours,attention:sdpa,compile:[true],compile_mode:reduce-overhead,"
            "inductor:{triton:{mix_order_reduction:false}}},{impl:ours,attention:sdpa}]")
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("benchmark", overrides=["model=swin_micro", "device=cpu", f"grid.rows={rows}",
                                              "grid.batch_size=[2]", "grid.precision=[fp32]"])
    tuned, plain = bench.expand_grid(cfg.grid)
    assert tuned.inductor == (("triton.mix_order_reduction", False),)
    assert plain.inductor == ()
    assert tuned.label == "ours sdpa +compile(reduce-overhead) +triton.mix_order_reduction=False b2 fp32"
    compiled_with = []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: compiled_with.append(kwargs) or model)
    name, arch = bench.architecture(cfg.model)
    side = arch["img_size"]  # swin_micro: one int
    data = (torch.randn(2, 3, side, side), torch.zeros(2, dtype=torch.long))
    steps = bench.build_row(tuned, name, arch, cfg, torch.device("cpu"), data)
    from swin.models.compiling import COMBO_KERNEL_OPTIONS  # ours (combo kernels)

    options = {"triton.cudagraphs": True, **COMBO_KERNEL_OPTIONS, "triton.mix_order_reduction": False}
    assert compiled_with == [{"dynamic": False, "fullgraph": False, "options": options}] * 2
    assert steps.info["inductor_options"] == steps.info["infer_inductor_options"] == options
    assert steps.info["inductor"] == tuned.inductor
    from omegaconf import OmegaConf

    timm_row = OmegaConf.create({"batch_size": [2], "precision": ["fp32"], "rows": [
        {"impl": "timm", "attention": "sdpa", "compile": [True], "inductor": {"combo_kernels": False}}]})
    with pytest.raises(ValueError, match="inductor .* is a setting of ours"):
        bench.expand_grid(timm_row)
    unknown = bench.RowSpec("ours", "sdpa", True, 2, "fp32", None, None, (("combo_kernel", False),))
    with pytest.raises(ValueError, match=r"inductor option\(s\) \['combo_kernel'\] unknown"):
        bench.build_row(unknown, name, arch, cfg, torch.device("cpu"), data)


def test_grid_rows_take_a_memory_budget(monkeypatch):
    """A row's memory_budget reaches the training compile only (swin.compile_model's backend), is recorded and
    labels the row; timm's rows refuse it and a value outside (0, 1] is one ValueError."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import scripts.benchmark as bench
    from swin.models.compiling import _InductorBackend

    grid = OmegaConf.create({"batch_size": [2], "precision": ["fp32"], "rows": [
        {"impl": "ours", "attention": "sdpa", "compile": [True], "memory_budget": 0.7}]})
    (spec,) = bench.expand_grid(grid)
    assert spec.memory_budget == 0.7 and spec.label == "ours sdpa +compile +memory_budget=0.7 b2 fp32"
    compiled_with = []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: compiled_with.append(kwargs) or model)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("benchmark", overrides=["model=swin_micro", "device=cpu"])
    name, arch = bench.architecture(cfg.model)
    side = arch["img_size"]
    data = (torch.randn(2, 3, side, side), torch.zeros(2, dtype=torch.long))
    steps = bench.build_row(spec, name, arch, cfg, torch.device("cpu"), data)
    infer, train = compiled_with
    assert "options" in infer and "backend" not in infer
    assert isinstance(train["backend"], _InductorBackend)
    assert train["backend"].functorch_config == {"activation_memory_budget": 0.7}
    assert steps.info["train_memory_budget"] == 0.7
    for row, error in (({"impl": "timm", "attention": "sdpa", "memory_budget": 0.5}, "is a setting of ours"),
                       ({"impl": "ours", "attention": "sdpa", "memory_budget": 2}, r"use a fraction in \(0, 1\]")):
        with pytest.raises(ValueError, match=error):
            bench.expand_grid(OmegaConf.create({"batch_size": [2], "precision": ["fp32"], "rows": [row]}))


@pytest.mark.parametrize("grid", sorted(p.stem for p in (ROOT / "configs/grid").glob("*.yaml")))
def test_every_grid_config_expands(grid):
    """Each configs/grid/ entry composes with configs/benchmark.yaml and expands into valid rows."""
    from hydra import compose, initialize_config_dir

    from scripts.benchmark import expand_grid  # imports swin.config: the schemas are registered

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("benchmark", overrides=[f"grid={grid}"])
    specs = expand_grid(cfg.grid)
    assert specs and all(s.batch_size > 0 for s in specs)
    from swin.train.checks import COMPILE_MODES

    assert {s.compile_mode for s in specs} <= {None, *COMPILE_MODES}
    assert cfg.steps.timed > 0 and cfg.steps.repeats > 0


# ---------------------------------------------------------------------------------------------
# GPU time breakdown: pure functions on kernel names and fabricated profiler events (no GPU needed)

KERNEL_CATEGORIES = {
    "attention": [
        "window_attn_fwd_kernel", "window_attn_bwd_kernel", "_window_attn_fwd", "_window_attn_bwd_dkdv",
        "_bias_grad_reduce",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, "
        "cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
        "fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<"
        "cutlass::arch::Sm80, cutlass::bfloat16_t, true, false, true, 64, 64, 64, false>::Params)",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
        "cutlass::bfloat16_t>, false, false>(pytorch_flash::Flash_fwd_params)",
        "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0",
        "cudnn_generated_oss_fmha_bprop_sm90_kernel",
        "void (anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
        "(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)",
        "triton_per_fused__softmax_add_view_7",
    ],
    "GEMM": [
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
        "_kernel__5x_cublas",
        "nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN",
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>("
        "cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8::Params)",
        "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn", "volta_sgemm_128x64_nn",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>(cublasLt::cublasSplitKParams)",
        "triton_tem_fused_mm_3", "triton_tem_fused_addmm_0", "triton_tem_fused_bmm_5",
        "triton_tem_fused__unsafe_view_addmm_gelu_view_2",
    ],
    "norm/elementwise": [
        "triton_per_fused_native_layer_norm_0", "triton_red_fused_native_layer_norm_native_layer_norm_backward_4",
        "triton_poi_fused_gelu_3", "triton_poi_fused_add_5", "triton_poi_fused_mul_2",
        "triton_poi_fused_add_clone_gelu_view_5",  # real work plus a view: not a copy
        "triton_poi_fused_addmm_gelu_view_3",  # the bias/GELU epilogue of an extern matmul, not a GEMM
        "triton_red_fused_sum_view_4",
        "triton_per_fused__log_softmax_nll_loss_forward_0",  # the loss, not attention
        "void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
        "at::native::GeluType)::{lambda()#2}, std::array<char*, 2ul> >(int, float, std::array<char*, 2ul>)",
        "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
        "CUDAFunctor_add<float> >(at::TensorIteratorBase&, at::native::CUDAFunctor_add<float> const&)::"
        "{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast<at::native::CUDAFunctor_add<float> >)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, "
        "at::native::sum_functor<float, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, "
        "unsigned int, float, 4, 4> >(at::native::ReduceOp<float>)",
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>(int, float, "
        "float const*, float const*, float const*, float*, float*, float*)",
        "void (anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
        "(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)",
    ],
    "copies/layout": [
        "triton_poi_fused_clone_0", "triton_poi_fused_view_3", "triton_poi_fused_unbind_2",
        "triton_poi_fused__unsafe_view_clone_1", "triton_poi_fused_cat_4", "triton_poi_fused__to_copy_0",
        "triton_poi_fused_constant_pad_nd_roll_2", "triton_poi_fused_permute_split_with_sizes_6",
        "void at::native::vectorized_elementwise_kernel<4, at::native::direct_copy_kernel_cuda("
        "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(c10::BFloat16)#1}, "
        "std::array<char*, 2ul> >(int, at::native::direct_copy_kernel_cuda)",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>"
        ", unsigned int, 4, 64, 64>(at::native::(anonymous namespace)::OpaqueType<2u>*)",
        "Memcpy DtoD (Device -> Device)", "Memcpy HtoD (Pageable -> Device)", "Memset (Device)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >"
        "(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)",
    ],
    "combined": [  # no op in the name: a combo kernel (or a copy inductor added itself)
        "triton_poi_fused_12", "triton_per_fused_3", "triton_for_fused_0",
    ],
    "optimizer": [
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
        "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
        "(at::native::ADAM_MODE)1, false>, float*, double, double, double, double, double, bool, float const*>",
        "FusedAdamWKernel", "adamw_step_kernel", "triton_poi_fused__foreach_add_0", "triton_for_fused__foreach_lerp_1",
        "void at::native::(anonymous namespace)::_amp_foreach_non_finite_check_and_unscale_cuda_kernel",
        "void at::native::amp_update_scale_cuda_kernel(float*, int*, float const*, double, double, int)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::LerpFunctor<float>, std::array<char*, 3ul> >",
    ],
    "other": [
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "my_custom_kernel",
        "triton_my_hand_written_kernel",
    ],
}


@pytest.mark.parametrize(("category", "name"), [(c, n) for c, names in KERNEL_CATEGORIES.items() for n in names])
def test_classify_kernel(category, name):
    from scripts.benchmark import CATEGORIES, classify_kernel

    assert category in CATEGORIES
    assert classify_kernel(name) == category


@pytest.mark.parametrize(("intervals", "union"), [
    ([], 0.0),
    ([(0, 1), (2, 4), (10, 13)], 6.0),                 # disjoint
    ([(0, 3), (2, 5)], 5.0),                           # overlapping
    ([(4, 7), (0, 3), (2, 5)], 7.0),                   # overlapping, unsorted
    ([(0, 10), (2, 3), (4, 6), (9, 10)], 10.0),        # nested
    ([(0, 1), (1, 2), (2, 3)], 3.0),                   # touching
    ([(0, 2), (0, 2), (5, 6), (1, 8)], 8.0),           # duplicates, one spanning the gap
])
def test_busy_union(intervals, union):
    from scripts.benchmark import busy_union_us

    assert busy_union_us(intervals) == pytest.approx(union)


def _events() -> list:
    """Profiler events of 2 steps as torch builds them: CPU ops, a GPU user annotation, kernels on 2 streams."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    def event(name, start, end, device_type=DeviceType.CUDA, **kw):
        return FunctionEvent(id=0, name=name, thread=7, start_us=start, end_us=end, device_type=device_type,
                             use_device="cuda", **kw)

    return [
        event("aten::addmm", 0, 50, DeviceType.CPU),           # host side: not GPU time
        event("ProfilerStep#1", 0, 1000, is_user_annotation=True),
        event("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN", 100, 400),        # GEMM 300
        event("window_attn_fwd_kernel", 300, 500),                            # attention 200, overlaps by 100
        event("triton_poi_fused_add_clone_gelu_view_5", 600, 650),            # elementwise 50
        event("triton_poi_fused__unsafe_view_clone_1", 650, 700),             # copies 50
        event("Memset (Device)", 700, 710),                                   # copies 10
        event("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 800, 900),   # optimizer 100
        event("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN", 1100, 1300),       # GEMM 200 (step 2)
        event("window_attn_bwd_kernel", 1150, 1250),                          # attention 100, nested in it
    ]


def test_kernel_breakdown():
    from scripts.benchmark import CATEGORIES, device_kernels, kernel_breakdown

    events = _events()
    kernels = device_kernels(events)
    assert [k.name for k in kernels] == [e.name for e in events[2:]]
    assert all(k.self_device_time_total == k.time_range.end - k.time_range.start for k in kernels)
    got = kernel_breakdown(kernels, steps=2)
    assert list(got["breakdown_ms"]) == list(CATEGORIES)
    expected_us = {"attention": 300, "GEMM": 500, "norm/elementwise": 50, "copies/layout": 60, "combined": 0,
                   "optimizer": 100, "other": 0}
    assert got["breakdown_ms"] == pytest.approx({c: us / 2e3 for c, us in expected_us.items()})
    # busy: [100, 500] + [600, 710] + [800, 900] + [1100, 1300] = 810 us over 2 steps; the plain sum is 1010 us
    assert got["busy_union_ms_per_step"] == pytest.approx(0.405)
    assert sum(got["breakdown_ms"].values()) == pytest.approx(1010 / 2e3)


def test_top_kernels_table():
    from scripts.benchmark import device_kernels, top_kernels_table

    lines = top_kernels_table(device_kernels(_events()), steps=2, limit=3).splitlines()
    assert lines[0] == "| kernel | category | calls/step | ms/step | % of kernel time |"
    assert len(lines) == 2 + 3
    assert lines[2] == "| `nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN` | GEMM | 1 | 0.250 | 49.5 |"
    assert lines[3].startswith("| `window_attn_fwd_kernel` | attention | 0.5 | 0.100 |")
    assert lines[4].startswith("| `multi_tensor_apply_kernel<FusedAdamMathFunctor>` | optimizer |")


def test_top_kernels_table_names_the_launching_op():
    """An eager op's kernels are listed with that op and its outermost ancestor; a kernel linked to no op: '-'."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from scripts.benchmark import device_kernels, kernel_launchers, top_kernels_table

    def event(name, start, end, device_type=DeviceType.CUDA):
        return FunctionEvent(id=0, name=name, thread=7, start_us=start, end_us=end, device_type=device_type,
                             use_device="cuda")

    loss = event("features_loss", 0, 100, DeviceType.CPU)
    means = [event("aten::mean", 10 + 20 * i, 20 + 20 * i, DeviceType.CPU) for i in range(3)]
    summed = event("aten::sum", 90, 95, DeviceType.CPU)  # at top level: no ancestor to name
    for op in means:
        op.set_cpu_parent(loss)
        op.append_kernel("reduce_kernel<float>", 0, 5.0)
    summed.append_kernel("reduce_kernel<float>", 0, 5.0)
    kernels = [event("reduce_kernel<float>", 200 + 10 * i, 205 + 10 * i) for i in range(4)]
    kernels.append(event("window_attn_fwd_kernel", 300, 400))  # linked to no host op
    events = [loss, *means, summed, *kernels]
    launchers = kernel_launchers(events)
    assert launchers == {"reduce_kernel<float>": {"aten::mean < features_loss": 3, "aten::sum": 1}}
    lines = top_kernels_table(device_kernels(events), steps=1, limit=2, launchers=launchers).splitlines()
    assert lines[0].endswith("| launched by |") and lines[1] == "|---" * 6 + "|"
    assert lines[2].startswith("| `window_attn_fwd_kernel` | attention |") and lines[2].endswith(" - |")
    assert lines[3].endswith("| `aten::mean < features_loss` (75%) |")


def _row(impl: str, attention: str, compile: bool, **extra) -> dict:
    return dict(impl=impl, attention=attention, compile=compile, batch_size=128, precision="bf16", compile_mode=None,
                infer_img_s=1000.0, train_img_s=300.0, **extra)


def test_breakdown_table():
    from scripts.benchmark import breakdown_table, report_tables

    gpu = dict(breakdown_ms={"attention": 3.1, "GEMM": 9.0, "norm/elementwise": 5.0, "copies/layout": 1.0,
                             "combined": 0.4, "optimizer": 2.0, "other": 0.0},
               busy_union_ms_per_step=19.5, step_ms=22.1)
    rows = [
        _row("ours", "flash_window", True, **{f"train_{k}": v for k, v in gpu.items()},
             infer_step_ms=7.0, infer_busy_union_ms_per_step=6.5,
             infer_breakdown_ms={"attention": 1.0, "GEMM": 3.0, "norm/elementwise": 2.0, "copies/layout": 0.5,
                                 "optimizer": 0.0, "other": 0.0}),  # a file of an earlier run: no "combined"
        _row("timm", "sdpa", False, error="OutOfMemoryError: CUDA out of memory"),
        _row("timm", "math", False, train_step_ms=150.0, train_breakdown_ms=None, train_busy_union_ms_per_step=None,
             infer_step_ms=40.0, infer_breakdown_ms=None, infer_busy_union_ms_per_step=None),
    ]
    lines = breakdown_table(rows).splitlines()
    assert lines[0] == ("| row | step | step ms | GPU busy ms | attention | GEMM | norm/elementwise | copies/layout "
                        "| combined | optimizer | other | largest |")
    assert lines[1] == "|" + "---|" * 12
    assert lines[2:] == [
        "| ours flash_window +compile b128 bf16 | train | 22.10 | 19.50 | 3.10 | 9.00 | 5.00 | 1.00 | 0.40 | 2.00 "
        "| 0.00 | GEMM 44% |",
        "| ours flash_window +compile b128 bf16 | infer | 7.00 | 6.50 | 1.00 | 3.00 | 2.00 | 0.50 | - | 0.00 | 0.00 "
        "| GEMM 46% |",
        "| timm math b128 bf16 | train | 150.00 | - | - | - | - | - | - | - | - | - |",  # CPU: no kernels
        "| timm math b128 bf16 | infer | 40.00 | - | - | - | - | - | - | - | - | - |",
    ]  # the error row is left out (the comparison table shows it)
    assert breakdown_table(rows) in report_tables(rows, profiled=True)
    assert "GPU busy ms" not in report_tables(rows, profiled=False)


def test_host_table():
    from scripts.benchmark import host_table, report_tables

    rows = [_row("ours", "flash_window", False, infer_step_ms=6.25, infer_host_ms=5.1234, infer_host_block_us=181.6),
            _row("timm", "math", False, infer_step_ms=7.5, infer_host_ms=6.0, infer_host_block_us=None),
            _row("ours", "flash_window", True, infer_step_ms=2.0)]  # compiled: no host figures
    assert host_table(rows).splitlines() == [
        "| row | infer step ms | host ms per forward | host µs per shifted block |", "|---|---|---|---|",
        "| ours flash_window b128 bf16 | 6.25 | 5.12 | 182 |", "| timm math b128 bf16 | 7.50 | 6.00 | - |"]
    assert host_table(rows) in report_tables(rows, profiled=False)
    assert host_table(rows[2:]) == "" and "host ms" not in report_tables(rows[2:], profiled=False)


def test_host_phases_time_each_phase_of_a_real_step():
    """profile.host_phases: a row's training step marks its phases where they happen (the forward's end inside the
    forward phase, each gradient inside the backward phase), and host_phases reports each phase's median and
    their total."""
    from hydra import compose, initialize_config_dir

    import scripts.benchmark as bench

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("benchmark", overrides=["model=swin_micro", "device=cpu"])
    name, arch = bench.architecture(cfg.model)
    side = arch["img_size"]
    data = (torch.randn(2, 3, side, side), torch.randint(0, 10, (2,)))
    steps = bench.build_row(bench.RowSpec("ours", "sdpa", False, 2, "fp32"), name, arch, cfg, torch.device("cpu"),
                            data)
    forward_ends, grads = [], []
    steps.model.register_forward_hook(lambda *_: forward_ends.append(time.process_time_ns()))
    for p in steps.model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: grads.append(time.process_time_ns()))
    marks: list[int] = []
    steps.train(marks)
    assert len(marks) == len(bench.HOST_PHASES) + 1 and marks == sorted(marks)
    assert marks[0] <= forward_ends[0] <= marks[1]
    assert len(grads) == sum(1 for _ in steps.model.parameters()) and marks[2] <= min(grads) <= max(grads) <= marks[3]
    timed = bench.host_phases(steps.train, torch.device("cpu"), reps=3)
    phases = timed["host_phases_ms"]
    assert timed["host_phases_queue_full"] is False  # no GPU, no launch queue
    assert list(phases) == [*bench.HOST_PHASES, "total"]
    assert phases["forward"] > 0 and phases["backward"] > 0 and min(phases.values()) >= 0
    assert phases["total"] == pytest.approx(sum(phases[p] for p in bench.HOST_PHASES))


def test_phases_table():
    from scripts.benchmark import phases_table, report_tables

    phases = dict(forward=2.27, loss=0.5, backward=4.118, optimizer=1.64, zero_grad=0.18, total=8.708)
    rows = [_row("ours", "flash_window", True, train_step_ms=8.1, train_busy_union_ms_per_step=7.63,
                 train_host_phases_ms=phases),
            _row("timm", "sdpa", True, train_step_ms=10.9),  # no phases: not listed
            _row("timm", "math", True, train_step_ms=12.0, train_busy_union_ms_per_step=11.8,
                 train_host_phases_ms={**phases, "total": 250.0}, train_host_phases_queue_full=True)]
    assert phases_table(rows).splitlines() == [
        "| row | train step ms | GPU busy ms | forward | loss | backward | optimizer | zero_grad | host total |",
        "|" + "---|" * 9,
        "| ours flash_window +compile b128 bf16 | 8.10 | 7.63 | 2.27 | 0.50 | 4.12 | 1.64 | 0.18 | 8.71 |",
        "| timm math +compile b128 bf16 | 12.00 | 11.80 | 2.27 | 0.50 | 4.12 | 1.64 | 0.18 | 250.00 (a launch waited: "
        "CUDA's queue was full) |"]
    assert phases_table(rows) in report_tables(rows, profiled=False)
    assert phases_table(rows[1:2]) == "" and "host total" not in report_tables(rows[1:2], profiled=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host time of CUDA launches")
@pytest.mark.parametrize("impl", ["ours", "timm"])
def test_gpu_host_times_time_the_first_shifted_block(impl):
    from scripts.benchmark import host_times

    arch = dict(embed_dim=32, depths=(2, 2), num_heads=(1, 2), img_size=(112, 112))
    name = "swin_tiny_patch4_window7_224"
    model = swin.create_model(name, attention="flash_window", **arch) if impl == "ours" else timm.create_model(
        name, **arch)
    model = model.cuda().eval()
    x = torch.randn(2, 3, 112, 112, device="cuda")
    block, seen = model.layers[0].blocks[1], []
    handle = block.register_forward_hook(lambda m, a, o: seen.append(tuple(a[0].shape)))
    with torch.no_grad():
        times = host_times(model, lambda: model(x), x, reps=5)
    handle.remove()
    assert tuple(block.shift_size) == (3, 3) and seen[:10] == [(2, 28, 28, 32)] * 10  # alone: 5 samples of 2 calls
    assert 0 < times["host_block_us"] < 1e3 * times["host_ms"]


def test_bench_data_train_args(tmp_path):
    """The train rows' train.py arguments: each decode kind's data keys and its worker count, last."""
    from hydra import compose, initialize_config_dir

    from scripts.bench_data import train_args
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("bench_data", overrides=["train.gpu_workers=3", "train.gpu_augment_workers=2",
                                               "train.cpu_workers=5"])
    expected = {"cpu": ({"data.decode=cpu", "data.augment=null", "data.gpu_decode_thread=false"}, 5),
                "gpu": ({"data.decode=gpu", "data.augment=null", "data.gpu_decode_thread=false"}, 3),
                "gpu_thread": ({"data.decode=gpu", "data.gpu_decode_thread=true"}, 3),
                "gpu_augment": ({"data.decode=cpu", "data.augment=gpu", "data.gpu_decode_thread=false"}, 2)}
    for name, (keys, count) in expected.items():
        args = train_args(cfg, tmp_path, tmp_path / name, name)
        assert keys <= set(args) and f"data.root={tmp_path}" in args, (name, args)
        assert args[-1] == f"data.num_workers={count}" and f"hydra.run.dir={tmp_path / name}" in args


@pytest.mark.slow
def test_bench_data_cpu(tmp_path):
    """scripts/bench_data.py on a tiny generated folder: loader rows for every decode path, train.py with
    data.decode=gpu and on synthetic data with the experiment's recipe, eval.py with each decode path on its
    checkpoint (equal top-1: same resize and crop). train.py with the other decode paths runs in
    tests/test_gpu_data.py (test_train_py_with_gpu_decoding_on_the_cpu); their rows' arguments are checked in
    test_bench_data_train_args."""
    out = tmp_path / "out"
    # on the CPU every ImageNet-sized file costs ~1.5 s of crop kernels in the interpreter and every loader worker
    # ~6 s of imports: 4 training files in batches of 2 (mixup's least; 2 steps, the second one timed), no warm-up
    # batches, two workers for train.py
    run_script([str(ROOT / "scripts/bench_data.py"), "device=cpu", "model=swin_micro",
                "data.auto_augment=rand-m9-mstd0.5-inc1",
                f"generate.dir={tmp_path / 'fake'}", "generate.classes=2", "generate.train_per_class=2",
                "generate.val_per_class=2", "batch_size=2", "loader.cpu_workers=[1]", "loader.gpu_workers=[1]",
                "loader.gpu_thread_workers=[1]", "loader.gpu_augment_workers=[1]", "loader.warmup_batches=0",
                "loader.seconds=0.3", "loader.min_batches=1", "train.rows=[gpu,synthetic]", "train.epochs=1",
                "train.compile=false", "train.gpu_workers=2",
                'train.args=["experiment=imagenet_swin_tiny","train.warmup_epochs=0",'
                '"logger.wandb.mode=disabled","logger.progress=false","train.save_every_epochs=0"]',
                "eval.workers=0", f"out_dir={out}"], cwd=tmp_path, timeout=480)
    result = json.loads((out / "bench_data.json").read_text())
    assert result["folder"]["train_files"] == 4 and 60 < result["folder"]["mean_kb"] < 160
    rows = {(r["kind"], r.get("decode") or r.get("name")): r for r in result["rows"]}
    kinds = ("cpu", "gpu", "gpu_thread", "gpu_augment")
    assert set(rows) == {("loader", k) for k in kinds} | {
        ("train", "gpu"), ("train", "synthetic"), ("eval", "cpu"), ("eval", "gpu")}
    for r in rows.values():
        assert "error" not in r and "skipped" not in r, r
    assert all(positive(r["img_s"]) for (kind, _), r in rows.items() if kind != "eval")
    # the synthetic run trains with the experiment's recipe (its data keys do not apply to synthetic data)
    from omegaconf import OmegaConf
    synthetic = OmegaConf.load(Path(rows[("train", "synthetic")]["run_dir"]) / ".hydra" / "config.yaml")
    assert synthetic.train.label_smoothing == 0.1 and synthetic.train.mixup == 0.8 and synthetic.train.epochs == 1
    assert synthetic.data.name == "synthetic" and synthetic.model.name == "swin_micro"
    assert rows[("loader", "gpu")]["batches"] >= 1 and rows[("train", "gpu")]["workers"] == 2
    gpu_run = OmegaConf.load(Path(rows[("train", "gpu")]["run_dir"]) / ".hydra" / "config.yaml")
    assert gpu_run.data.num_workers == 2 and gpu_run.data.decode == "gpu"  # what train.py ran with
    assert rows[("eval", "cpu")]["num_images"] == rows[("eval", "gpu")]["num_images"] == 4
    assert rows[("eval", "cpu")]["top1"] == rows[("eval", "gpu")]["top1"]
    md = (out / "bench_data.md").read_text()
    assert "| loader only, data.decode=gpu, num_workers=1 |" in md and "eval top-1 gpu - cpu" in md
    assert "| loader only, data.decode=gpu data.gpu_decode_thread=true (workers read files), num_workers=1 |" in md
    assert "| loader only, data.decode=cpu data.augment=gpu (workers decode, a thread augments), num_workers=1 |" in md




@pytest.mark.slow
def test_bench_scaling_cpu(tmp_path):
    """scripts/bench_scaling.py with 1 and 2 gloo processes: train.py's setup and step under torchrun, per-process
    batch, img/s of all processes and the factor over one process in the table, and the collectives per update."""
    out = tmp_path / "scaling"
    stdout = run_script([str(ROOT / "scripts/bench_scaling.py"), "--procs", "1", "2", "--warmup", "1", "--steps", "3",
                         "--profile-steps", "2", "--out", str(out), "--", "model=swin_micro", "train.batch_size=4",
                         "device=cpu"],
                        cwd=tmp_path, timeout=300)
    rows = json.loads((out / "scaling.json").read_text())["rows"]
    assert [r["procs"] for r in rows] == [1, 2] and all(r["batch_per_process"] == 4 for r in rows)
    assert all(positive(r["img_s"]) and positive(r["step_ms"]) for r in rows)
    # 2 processes of 4 images each: 8 images per update
    assert rows[1]["img_s"] == pytest.approx(8 * 3 / (rows[1]["step_ms"] * 3 / 1e3), rel=1e-6)
    factor = rows[1]["img_s"] / rows[0]["img_s"]
    assert f"| 2 | 4 | {rows[1]['img_s']:,.0f} | {factor:.2f}x |" in stdout
    assert (out / "scaling.md").read_text().strip() == stdout.strip().split("\n", 2)[-1].strip()
    # per update: DDP's gradient all-reduce (swin_micro's gradients fill one bucket) and the loss's for the
    # non-finite guard; no buffer broadcast (DDP's default: one before every forward), nothing on one process
    assert rows[0]["collectives_per_step"] == {}
    assert rows[1]["collectives_per_step"] == {"gloo:all_reduce": 2.0}
    assert f"| {rows[1]['img_s']:,.0f} | {factor:.2f}x |" in stdout and "| 2 all_reduce |" in stdout
