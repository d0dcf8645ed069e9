"""Launch-parameter sweep of the flash window kernels (SWIN_FW_* knobs of kernels/flash_window.py).

    python scripts/tune_flash_window.py                      # Swin-T stage-1 shape, bf16, a few configs
    python scripts/tune_flash_window.py --config PROGRAMS_PER_SM=8,WARPS=8 --config BWD_WARPS=8

For each configuration: registers and spills of both kernels (SWIN_FW_DEBUG) and median forward /
forward+backward GPU ms (timed as scripts/bench_attention.py does). For tuning on the GPU;
scripts/bench_attention.py is the benchmark to compare backends.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from kernels.flash_window import flash_window_attention  # noqa: E402
from scripts.bench_attention import median_ms  # noqa: E402

DEFAULT_CONFIGS = ["", "PREFETCH=1", "PREFETCH=1,PROGRAMS_PER_SM=8", "PREFETCH=1,PROGRAMS_PER_SM=32",
                   "PROGRAMS_PER_SM=8,BWD_PROGRAMS_PER_SM=8", "STAGES=2,BWD_STAGES=2", "BWD_WARPS=8",
                   "WARPS=8,BWD_WARPS=8"]


def time_config(batch: int, feat: int, window: int, heads: int, head_dim: int,
                dtype: torch.dtype) -> tuple[float, float]:
    grid = feat // window
    n = window * window
    q, k, v = (torch.randn(batch * grid * grid, heads, n, head_dim, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    table = torch.randn((2 * window - 1) ** 2, heads, device="cuda", requires_grad=True)
    grad = torch.randn_like(q)
    shift = (window // 2, window // 2)

    def fwd():
        return flash_window_attention(q, k, v, table, (window, window), shift, (grid, grid))

    def fwd_bwd():
        fwd().backward(grad)

    def clear_grads():
        for t in (q, k, v, table):
            t.grad = None

    # GPU time as bench_attention.py measures it: cold L2, launch latency hidden behind a GPU sleep
    device = torch.device("cuda")
    fwd_ms = median_ms(fwd, device, warmup=20, reps=100)
    fwd_bwd_ms = median_ms(fwd_bwd, device, warmup=20, reps=100, reset=clear_grads)
    return fwd_ms, fwd_bwd_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", help="comma-separated KNOB=value (SWIN_FW_ prefix implied)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--feat", type=int, default=56)
    parser.add_argument("--window", type=int, default=7)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_flash_window.py needs a CUDA GPU")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    os.environ["SWIN_FW_DEBUG"] = "1"  # the glue prints registers and spills of each new compilation
    rows = []
    for config in args.config or DEFAULT_CONFIGS:
        for key in [k for k in os.environ if k.startswith("SWIN_FW_") and k != "SWIN_FW_DEBUG"]:
            del os.environ[key]
        for item in filter(None, config.split(",")):
            key, value = item.split("=")
            os.environ[f"SWIN_FW_{key}"] = value
        try:
            fwd_ms, fwd_bwd_ms = time_config(args.batch, args.feat, args.window, args.heads, args.head_dim, dtype)
            times = f"{fwd_ms:.4f} | {fwd_bwd_ms:.4f}"
        except Exception as error:  # e.g. triton's OutOfResources: report the config, go on with the next
            times = f"failed: {type(error).__name__}: {str(error).splitlines()[0]} | -"
        rows.append((config or "default", times))
        print(f"{config or 'default'}: {times}", flush=True)
    print("\n| config | fwd ms | fwd+bwd ms |\n|---|---|---|")
    for config, times in rows:
        print(f"| {config} | {times} |")


if __name__ == "__main__":
    main()
