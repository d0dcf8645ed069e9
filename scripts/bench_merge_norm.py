"""Times the fused merge (kernels.merge_norm: x + delta, 2x2 merge, LayerNorm in one kernel) against what
torch.compile makes of the unfused ops, at the merge shapes of Swin-T (b128) and Swin-B 384 (b64), bf16 autocast
layout (fp32 residual stream, bf16 MLP output, bf16 norm output), with a sweep of its launch config.

    python scripts/bench_merge_norm.py [--configs 32x4 16x8 ...]   # BLOCK_R x num_warps; default: a small sweep

Prints one table (median us, effective GB/s of the bytes each must move: x, delta, the output) and checks
every result against the unfused ops (max abs difference).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.merge_norm as mn  # noqa: E402

SHAPES = {  # (B, H, W, C) of the stream entering each merge
    "swin_t merge 1": (128, 56, 56, 96), "swin_t merge 2": (128, 28, 28, 192), "swin_t merge 3": (128, 14, 14, 384),
    "swin_b384 merge 1": (64, 96, 96, 128), "swin_b384 merge 2": (64, 48, 48, 256),
    "swin_b384 merge 3": (64, 24, 24, 512),
}


def unfused(x, delta, weight, bias):
    s = x + delta
    b, h, w, c = s.shape
    s = s.reshape(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 4, 2, 5).flatten(3)
    return F.layer_norm(s, (4 * c,), weight, bias).to(torch.bfloat16)


def bench_shape(label: str, shape: tuple[int, int, int, int], configs: list[str], compiled) -> None:
    from triton.testing import do_bench

    c = shape[-1]
    x = torch.randn(shape, device="cuda")
    delta = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    weight, bias = 1 + 0.1 * torch.randn(4 * c, device="cuda"), 0.1 * torch.randn(4 * c, device="cuda")
    gb = x.numel() * (4 + 2 + 2) / 1e9
    want = compiled(x, delta, weight, bias)
    us = do_bench(lambda: compiled(x, delta, weight, bias)) * 1e3
    print(f"| {label} {shape} | compiled unfused | {us:.1f} | {gb / us * 1e6:.0f} | - |")
    default_config = mn._launch_config
    try:
        for name in configs:
            if name != "default":
                rows, warps = (int(v) for v in name.split("x"))
                block_c = default_config(c)["BLOCK_C"]
                mn._launch_config = lambda _c: dict(BLOCK_C=block_c, BLOCK_R=rows, num_warps=warps)  # noqa: B023

            def run() -> torch.Tensor:
                return mn.merge_norm(x, delta, weight, bias, out_dtype=torch.bfloat16)
            diff = (run().float() - want.float()).abs().max().item()
            us = do_bench(run) * 1e3
            print(f"| {label} {shape} | merge_norm {name} | {us:.1f} | {gb / us * 1e6:.0f} | {diff:.3g} |")
    finally:
        mn._launch_config = default_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="*",
                   default=["default", "1x1", "2x2", "4x4", "8x4", "16x4", "32x4", "8x8", "16x8"])
    args = p.parse_args()
    compiled = torch.compile(unfused, dynamic=False)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | path | us | GB/s | max abs diff |")
    print("|---|---|---|---|---|")
    with torch.no_grad():
        for label, shape in SHAPES.items():
            bench_shape(label, shape, args.configs, compiled)


if __name__ == "__main__":
    main()
