"""Tile sweep of kernels/linear_gelu (the SWIN_LG_* knobs) at the MLP fc1 shapes of a Swin model, beside cuBLAS.

    python scripts/tune_linear_gelu.py                      # Swin-T, batch 128, bf16
    python scripts/tune_linear_gelu.py --model base --batch 64

Why: in a compiled Swin-T inference step (H100, b128) the fused kernel took 2.68 ms over its 12 calls where cuBLAS's
fc1 plus inductor's GELU took ~2.0 ms (docs/benchmarks.md). Its default tile (128 x 128, 8 warps) needs 160
registers per thread (ptxas, sm_90a): one program per SM, so no other program's loads hide a tile's erf-and-store
epilogue, which is most of the work when K is 96 to 768. Smaller tiles (64 x 128, 4 warps: 117 registers) fit
several programs per SM. This times each candidate tile at each fc1 shape (GPU time, cold L2, as
scripts/bench_attention.py times), checks its result against F.gelu(F.linear(...)) and prints one table per shape,
then the step total (each shape weighted by its block count) for cuBLAS fc1 alone, cuBLAS fc1 + GELU and the best
tile, so the default can be chosen from numbers.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.linear_gelu import linear_gelu  # noqa: E402
from scripts.bench_attention import median_ms  # noqa: E402

# (tokens per image, C, blocks) per stage at 224 x 224 (patch 4, window 7): fc1 maps C -> 4C
MODELS = {"tiny": [(3136, 96, 2), (784, 192, 2), (196, 384, 6), (49, 768, 2)],
          "small": [(3136, 96, 2), (784, 192, 2), (196, 384, 18), (49, 768, 2)],
          "base": [(3136, 128, 2), (784, 256, 2), (196, 512, 18), (49, 1024, 2)]}
# (BLOCK_M, BLOCK_N, num_warps); BLOCK_K 32 and 64 where K allows, 3 and 4 stages
TILES = [(128, 128, 8), (64, 128, 4), (128, 64, 4), (64, 64, 4), (64, 256, 8), (128, 256, 8)]
KNOBS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "NUM_WARPS", "NUM_STAGES")


def candidates(k: int, tiles: list[tuple[int, int, int]], stages: list[int]) -> list[dict[str, int]]:
    block_ks = [32, 64] if k % 64 == 0 else [32]
    return [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=bk, NUM_WARPS=w, NUM_STAGES=s)
            for m, n, w in tiles for bk in block_ks for s in stages]


def parse_tile(text: str) -> tuple[int, int, int]:
    """'64x128x4': BLOCK_M x BLOCK_N x warps."""
    try:
        m, n, w = (int(v) for v in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"tile {text!r}: expected BLOCK_MxBLOCK_NxWARPS, e.g. 64x128x4") from None
    return m, n, w


def with_config(cfg: dict[str, int] | None, fn):
    """fn() with the SWIN_LG_* knobs set to cfg (None: the kernel's own default), restored afterwards."""
    saved = {key: os.environ.pop(f"SWIN_LG_{key}", None) for key in KNOBS}
    try:
        for key, value in (cfg or {}).items():
            os.environ[f"SWIN_LG_{key}"] = str(value)
        return fn()
    finally:
        for key, value in saved.items():
            os.environ.pop(f"SWIN_LG_{key}", None)
            if value is not None:
                os.environ[f"SWIN_LG_{key}"] = value


def sweep_shape(m: int, k: int, dtype: torch.dtype, device: torch.device, tiles: list[tuple[int, int, int]],
                stages: list[int], warmup: int, reps: int
                ) -> tuple[dict[str, float], list[tuple[dict[str, int], float, float]]]:
    """({cuBLAS fc1, cuBLAS fc1 + GELU: ms}, [(config, ms, max abs error against fc1 + GELU)])."""
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(4 * k, k, device=device, dtype=dtype) * k ** -0.5
    b = torch.randn(4 * k, device=device, dtype=dtype)
    with torch.no_grad():
        reference = F.gelu(F.linear(x, w, b))
        base = {"cuBLAS fc1": median_ms(lambda: F.linear(x, w, b), device, warmup, reps),
                "cuBLAS fc1 + GELU": median_ms(lambda: F.gelu(F.linear(x, w, b)), device, warmup, reps)}
        rows = []
        for cfg in candidates(k, tiles, stages):
            def run(cfg=cfg):
                err = (linear_gelu(x, w, b).float() - reference.float()).abs().max().item()
                return median_ms(lambda: linear_gelu(x, w, b), device, warmup, reps), err
            try:
                ms, err = with_config(cfg, run)
            except Exception as exc:  # a tile that does not compile or fit (shared memory) is a row, not the end
                print(f"  {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}", flush=True)
                continue
            rows.append((cfg, ms, err))
    return base, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--tiles", type=parse_tile, nargs="+", default=TILES, help="BLOCK_MxBLOCK_NxWARPS ...")
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of each shape's rows (CPU smoke runs)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"# linear_gelu tiles, Swin-{args.model} fc1 shapes, batch {args.batch}, {args.dtype}, {name}, "
          f"torch {torch.__version__}\n")
    totals: dict[str, float] = {"cuBLAS fc1": 0.0, "cuBLAS fc1 + GELU": 0.0, "linear_gelu, best tile per shape": 0.0}
    by_config: dict[str, float] = {}
    for tokens, c, blocks in MODELS[args.model]:
        m = max(1, int(args.batch * tokens * args.scale))
        base, rows = sweep_shape(m, c, dtype, device, args.tiles, args.stages, args.warmup,
                                 args.reps)
        print(f"## fc1 {m} x {c} -> {4 * c} ({blocks} blocks): cuBLAS fc1 {base['cuBLAS fc1']:.3f} ms, "
              f"+ GELU {base['cuBLAS fc1 + GELU']:.3f} ms\n")
        print("| BLOCK_M | BLOCK_N | BLOCK_K | warps | stages | ms | x (fc1 + GELU) | max abs err |")
        print("|---|---|---|---|---|---|---|---|")
        for cfg, ms, err in sorted(rows, key=lambda r: r[1]):
            print(f"| {cfg['BLOCK_M']} | {cfg['BLOCK_N']} | {cfg['BLOCK_K']} | {cfg['NUM_WARPS']} | "
                  f"{cfg['NUM_STAGES']} | {ms:.3f} | {ms / base['cuBLAS fc1 + GELU']:.2f} | {err:.1e} |")
        print(flush=True)
        for key in base:
            totals[key] += blocks * base[key]
        if rows:
            totals["linear_gelu, best tile per shape"] += blocks * min(ms for _, ms, _ in rows)
        for cfg, ms, _ in rows:  # the kernel picks BLOCK_K from K (64 where it divides K): the same here
            if cfg["BLOCK_K"] == (64 if c % 64 == 0 else 32):
                key = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}, {cfg['NUM_WARPS']} warps, {cfg['NUM_STAGES']} stages"
                by_config[key] = by_config.get(key, 0.0) + blocks * ms
    print("## per inference step (every fc1 of the model)\n\n| path | ms |\n|---|---|")
    for key, ms in totals.items():
        print(f"| {key} | {ms:.3f} |")
    print("\none tile for every shape (BLOCK_K 64 where it divides K, else 32, as the kernel picks):\n")
    print("| tile | ms |\n|---|---|")
    for key, ms in sorted(by_config.items(), key=lambda kv: kv[1])[:8]:
        print(f"| {key} | {ms:.3f} |")


if __name__ == "__main__":
    main()
