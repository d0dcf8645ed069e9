"""fc1 + GELU at the MLP shapes of a Swin model: cuBLAS fc1, fc1 + GELU, and fc1 with cuBLASLt's GELU epilogue.

    python scripts/bench_fc1_gelu.py                      # Swin-T, batch 128, bf16
    python scripts/bench_fc1_gelu.py --model base --batch 64 --dtype fp16

Why: with fused_mlp_act (the default) our model runs fc1 and GELU without gradients in half precision on CUDA as
one GEMM with cuBLASLt's GELU epilogue (``torch._addmm_activation``; swin.model.fc1_gelu_epilogue) instead of a
GEMM and a stand-alone GELU pass over the 4C-wide hidden activation. That GELU is the tanh approximation, applied to
the fp32 accumulator before the one rounding. This times each path at each fc1 shape (GPU time, cold L2, as
scripts/bench_attention.py times) and prints its error against float64 exact GELU(fc1(x)) (max abs, and relative L2
||y - ref|| / ||ref||): one table per shape, then the totals per inference step (each shape weighted by its block
count). On the CPU it is a smoke run (``--scale`` shrinks the shapes); there the op is addmm then exact GELU.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from scripts.bench_attention import median_ms  # noqa: E402

# (tokens per image, C, blocks) per stage at 224 x 224 (patch 4, window 7): fc1 maps C -> 4C
MODELS = {"tiny": [(3136, 96, 2), (784, 192, 2), (196, 384, 6), (49, 768, 2)],
          "small": [(3136, 96, 2), (784, 192, 2), (196, 384, 18), (49, 768, 2)],
          "base": [(3136, 128, 2), (784, 256, 2), (196, 512, 18), (49, 1024, 2)]}
FC1, UNFUSED, EPILOGUE = "cuBLAS fc1", "cuBLAS fc1 + GELU", "cuBLASLt fc1 + GELU epilogue"


def measure_shape(m: int, k: int, dtype: torch.dtype, device: torch.device, warmup: int, reps: int
                  ) -> dict[str, tuple[float, float | None, float | None]]:
    """{path: (ms, max abs error, relative L2 error)} at fc1 (m x k) -> (m x 4k); errors against float64 exact
    GELU(fc1(x)) (None for fc1 alone, which computes no GELU)."""
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(4 * k, k, device=device, dtype=dtype) * k ** -0.5
    b = torch.randn(4 * k, device=device, dtype=dtype)
    paths: dict[str, Callable[[], torch.Tensor]] = {
        FC1: lambda: F.linear(x, w, b),
        UNFUSED: lambda: F.gelu(F.linear(x, w, b)),
        EPILOGUE: lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True),
    }
    results = {}
    with torch.no_grad():
        reference = F.gelu(F.linear(x.double(), w.double(), b.double()))
        for name, fn in paths.items():
            ms = median_ms(fn, device, warmup, reps)
            if name == FC1:
                results[name] = (ms, None, None)
                continue
            diff = fn().double() - reference
            results[name] = (ms, diff.abs().max().item(), (diff.norm() / reference.norm()).item())
            del diff
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of each shape's rows (CPU smoke runs)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"# fc1 + GELU, Swin-{args.model} fc1 shapes, batch {args.batch}, {args.dtype}, {name}, "
          f"torch {torch.__version__}\n")
    totals = dict.fromkeys((FC1, UNFUSED, EPILOGUE), 0.0)
    for tokens, c, blocks in MODELS[args.model]:
        m = max(1, int(args.batch * tokens * args.scale))
        results = measure_shape(m, c, dtype, device, args.warmup, args.reps)
        print(f"## fc1 {m} x {c} -> {4 * c} ({blocks} blocks)\n")
        print("| path | ms | x (fc1 + GELU) | max abs err | rel L2 err |\n|---|---|---|---|---|")
        for path, (ms, max_abs, rel) in results.items():
            errors = "- | -" if max_abs is None else f"{max_abs:.2e} | {rel:.2e}"
            print(f"| {path} | {ms:.3f} | {ms / results[UNFUSED][0]:.2f} | {errors} |")
            totals[path] += blocks * ms
        print(flush=True)
    print("## per inference step (every fc1 of the model)\n\n| path | ms |\n|---|---|")
    for path, ms in totals.items():
        print(f"| {path} | {ms:.3f} |")


if __name__ == "__main__":
    main()
