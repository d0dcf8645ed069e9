"""Launch-parameter sweep of the flash window kernels (SWIN_FW_* knobs of kernels/flash_window/plan.py).

    python scripts/tune_flash_window.py                       # Swin-T stage 1 and 2, shifted, bf16, a few configs
    python scripts/tune_flash_window.py --shapes swin_b384_stage1 --config BWD_WARPS=4 --config BWD_PROGRAMS_PER_SM=8

For each configuration and shape (scripts/bench_attention.py presets): registers and spills of both kernels
(SWIN_FW_DEBUG), median forward / forward+backward GPU ms of the window op as the model calls it (timed as
bench_attention.py does), and the GPU time of the attention kernels themselves per call (profiler): the eager op's
forward+backward is host-bound at small shapes (docs/performance.md), so the kernel columns are the ones to compare
backward configurations by. For tuning on the GPU; bench_attention.py is the benchmark to compare backends.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kernels.flash_window import plan  # noqa: E402
from scripts.bench_attention import DTYPES, PRESETS, Problem, flash_window, host_us, make_inputs, median_ms  # noqa: E402
from swin.models.windows import relative_position_index, shifted_window_mask  # noqa: E402

# BWD_BLOCK_M=16 / 32: 49-token windows in several query blocks, the backward's register budget against the
# multi-block bias-gradient accumulation
# HALF_BIAS=0: fp32 bias tiles instead of the input's half dtype (the default is faster; docs/performance.md)
DEFAULT_CONFIGS = ["", "HALF_BIAS=0", "PROGRAMS_PER_SM=16", "PROGRAMS_PER_SM=64", "BWD_PROGRAMS_PER_SM=2",
                   "BWD_PROGRAMS_PER_SM=8", "BWD_BLOCK_M=16", "BWD_BLOCK_M=32", "BWD_BLOCK_M=16,BWD_PROGRAMS_PER_SM=8"]


def time_config(shape_name: str, dtype: torch.dtype, profile: bool = False) -> tuple[float, float, float, float]:
    """(forward ms, forward+backward ms, forward kernel us, backward kernel us) of one shape."""
    shape = PRESETS[shape_name]
    device = torch.device("cuda")
    inputs = make_inputs(shape, dtype, device)
    q, k, v, table, grad = (inputs[n] for n in ("q", "k", "v", "table", "do"))
    problem = Problem(shape, shape.head_dim ** -0.5, relative_position_index((shape.window,) * 2, device),
                      shifted_window_mask(shape.spec, device), None)

    def fwd():
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            return flash_window(q, k, v, table, problem)

    def fwd_no_grad():
        with torch.no_grad():
            return fwd()

    def fwd_bwd():
        fwd().backward(grad)

    def clear_grads():
        for t in (q, k, v, table):
            t.grad = None

    # GPU time as bench_attention.py measures it: cold L2, launch latency hidden behind a GPU sleep
    fwd_ms = median_ms(fwd_no_grad, device, warmup=10, reps=50)
    fwd_bwd_ms = median_ms(fwd_bwd, device, warmup=10, reps=50, reset=clear_grads)
    if profile:
        print_kernels(fwd_bwd, clear_grads, shape_name)
        print(f"host time per call, {shape_name}: forward {host_us(fwd_no_grad):.0f} us, "
              f"forward+backward {host_us(fwd_bwd, clear_grads):.0f} us")
        print_host_profile(fwd_bwd, clear_grads)
    kernels = kernel_us(fwd_bwd, clear_grads)
    return (fwd_ms, fwd_bwd_ms, sum(us for name, (us, _) in kernels.items() if "window_attn_fwd" in name),
            sum(us for name, (us, _) in kernels.items() if "window_attn_bwd" in name))


def kernel_us(fn, reset, reps: int = 10) -> dict[str, tuple[float, float]]:
    """{kernel: (GPU us, launches)} per call of fn (profiler, mean over reps calls)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            reset()
            fn()
        torch.cuda.synchronize()
    # kernels only (device events): an op named like its kernel (swin::flash_window_attn_bwd) is not counted twice
    return {e.key: (e.self_device_time_total / reps, e.count / reps) for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.self_device_time_total > 0}


def print_host_profile(fn, reset, reps: int = 20) -> None:
    """Python functions by their own CPU time over reps calls of fn: where the host time of an eager call goes."""
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(reps):
        reset()
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def print_kernels(fn, reset, label: str) -> None:
    """GPU time per kernel of fn (kernel_us): where a forward+backward spends its time."""
    kernels = sorted(kernel_us(fn, reset).items(), key=lambda kv: -kv[1][0])[:12]
    print(f"kernels of one forward+backward, {label} (us per call):")
    for name, (us, launches) in kernels:
        print(f"  {us:9.1f}  {launches:5.1f}x  {name[:110]}")


def _set_knobs(config: str) -> None:
    """The kernels' tuning for one configuration: SWIN_FW_<KNOB> values over the defaults (plan.set_tuning)."""
    env = {"SWIN_FW_DEBUG": "1"}  # the glue prints registers and spills of each new compilation
    for item in filter(None, config.split(",")):
        key, value = item.split("=")
        env[f"SWIN_FW_{key}"] = value
    plan.set_tuning(plan.Tuning.from_env(env))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", help="comma-separated KNOB=value (SWIN_FW_ prefix implied)")
    parser.add_argument("--shapes", nargs="+", default=["swin_t_stage1", "swin_t_stage2"], choices=list(PRESETS))
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--profile", action="store_true", help="print the kernels of one forward+backward per shape")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_flash_window.py needs a CUDA GPU")
    rows = []
    configs = args.config or DEFAULT_CONFIGS
    for config in configs:
        _set_knobs(config)
        for shape in args.shapes:
            try:
                fwd_ms, fwd_bwd_ms, fwd_us, bwd_us = time_config(shape, DTYPES[args.dtype],
                                                                 args.profile and config == configs[0])
                times = f"{fwd_ms:.4f} | {fwd_bwd_ms:.4f} | {fwd_us:.1f} | {bwd_us:.1f}"
            except Exception as error:  # e.g. triton's OutOfResources: report the config, go on with the next
                times = f"failed: {type(error).__name__}: {str(error).splitlines()[0]} | - | - | -"
            rows.append((config or "default", shape, times))
            print(f"{config or 'default'} {shape}: {times}", flush=True)
    print(f"\n{args.dtype}\n| config | shape | fwd ms | fwd+bwd ms | fwd kernel us | bwd kernel us |\n"
          "|---|---|---|---|---|---|")
    for config, shape, times in rows:
        print(f"| {config} | {shape} | {times} |")


if __name__ == "__main__":
    main()
