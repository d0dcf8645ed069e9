"""GPU time of the data pipeline's augmentation kernels at each launch geometry (issue 15; docs/benchmarks.md).

A decoding worker runs, per batch: the crops (kernels.crop_resize, two launches) and per RandAugment layer a
statistics, a lookup-table and an apply kernel (kernels.rand_augment). Under MPS that work shares the SMs with the
training step, so its GPU time is what matters. This times, for a recipe batch (RandomResizedCrop boxes, random
bilinear / bicubic, flips, rand-m9-mstd0.5-inc1) of random images of ImageNet-like sizes:
- the crops as shipped (each image read where it lies), and the torch.cat that packing the images would cost;
- the crop kernels at each rows-per-program x warps (kernels.crop_resize.GPU_BLOCK / GPU_WARPS);
- a RandAugment layer (its three kernels) at each pixels-per-program x warps of its apply kernel
  (kernels.rand_augment.APPLY_BLOCK / APPLY_WARPS).
GPU time per call is the kernels' own time under torch.profiler (copies excluded), the mean of --calls calls
(bench_decode_contention's profiling helper); "max diff" compares each geometry's output with the shipped one's.

    python scripts/bench_augment_kernels.py [--batch 128] [--size 224] [--calls 20]
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from kernels import crop_resize as cr  # noqa: E402
from kernels import rand_augment as ra  # noqa: E402
from swin import gpu_augment as ga  # noqa: E402


def kernel_us(fn: Callable[[], torch.Tensor], calls: int) -> float:
    """GPU time per call (us) of `fn`'s kernels, copies excluded: the mean of `calls` profiled calls after 3."""
    from bench_decode_contention import profile_batches
    total_ms, copies_ms, _, _ = profile_batches(fn, calls, top=0)
    return (total_ms - copies_ms) * 1e3


def recipe_batch(n: int, size: int, seed: int, device: str = "cuda", sides: tuple[int, int] = (330, 500)
                 ) -> tuple[list[torch.Tensor], ga.BatchPlan]:
    """`n` random uint8 images with sides in [sides), and the recipe's random choices for them at `size`."""
    rng = np.random.default_rng(seed)
    images = [torch.randint(0, 256, (3, int(h), int(w)), dtype=torch.uint8, device=device)
              for h, w in rng.integers(*sides, (n, 2))]
    tf = ga.TrainTransform(ga.TrainSpec(size=(size, size), interpolation="random",
                                        rand_augment=ga.parse_rand_augment("rand-m9-mstd0.5-inc1")))
    return images, tf.plan([tuple(i.shape[-2:]) for i in images], rng)


def sweep(module: Any, settings: tuple[str, str], blocks: tuple[int, ...], unit: str, run: Callable[[], torch.Tensor],
          calls: int) -> list[str]:
    """One row per (block, warps) of the launch settings ``module.<settings>``: `run`'s GPU time and its output's
    largest difference from the output at the shipped settings; the settings are restored after."""
    shipped_settings = tuple(getattr(module, name) for name in settings)
    shipped = run()
    rows = []
    try:
        for block in blocks:
            for warps in (2, 4, 8):
                for name, value in zip(settings, (block, warps)):
                    setattr(module, name, value)
                diff = (run().int() - shipped.int()).abs().max().item()
                rows.append(f"| {block} {unit} per program, {warps} warps | {kernel_us(run, calls):.1f} | "
                            f"{diff} |")
    finally:
        for name, value in zip(settings, shipped_settings):
            setattr(module, name, value)
    return rows


def crop_rows(images: list[torch.Tensor], plan: ga.BatchPlan, size: int, calls: int) -> list[str]:
    def crops() -> torch.Tensor:
        return cr.crop_resize(images, plan.boxes, plan.modes, (size, size), flips=plan.flips)
    return [f"| crops as shipped ({cr.GPU_BLOCK} rows of an image's planes per program, {cr.GPU_WARPS} warps), "
            f"images read in place | {kernel_us(crops, calls):.1f} | 0 |",
            f"| torch.cat of the decoded images (packing them first) | "
            f"{kernel_us(lambda: torch.cat([i.reshape(-1) for i in images]), calls):.1f} | |",
            *sweep(cr, ("GPU_BLOCK", "GPU_WARPS"), (2, 4, 8, 16, 32), "rows of an image's planes", crops, calls)]


def apply_rows(x: torch.Tensor, plan: ga.BatchPlan, calls: int) -> list[str]:
    fill = torch.tensor([124.0, 116.0, 104.0], device=x.device)
    ops_np, args_np = plan.layers[0]
    ops = torch.tensor(ops_np, dtype=torch.int32, device=x.device)
    args = torch.tensor(args_np, dtype=torch.float32, device=x.device)

    def layer() -> torch.Tensor:
        return ra.augment_layer(x, ops, args, fill)
    return [f"| a RandAugment layer as shipped, all three kernels ({ra.APPLY_BLOCK} pixels, {ra.APPLY_WARPS} warps) | "
            f"{kernel_us(layer, calls):.1f} | 0 |",
            *sweep(ra, ("APPLY_BLOCK", "APPLY_WARPS"), (256, 512, 1024), "pixels (apply kernel), the layer's kernels",
                   layer, calls)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--calls", type=int, default=20, help="profiled calls per row")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_augment_kernels.py times CUDA kernels: run it on a GPU machine")
    images, plan = recipe_batch(args.batch, args.size, args.seed)
    x = cr.crop_resize(images, plan.boxes, plan.modes, (args.size, args.size), flips=plan.flips)
    import triton
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}: "
          f"{args.batch} random images of 330-500 px to {args.size} x {args.size}, the recipe's boxes and ops; "
          f"layer 0's ops {np.bincount(plan.layers[0][0], minlength=ra.NUM_OPS).tolist()}\n")
    print("| kernels | GPU us per call | max diff vs shipped |\n|---|---|---|")
    for row in crop_rows(images, plan, args.size, args.calls) + apply_rows(x, plan, args.calls):
        print(row, flush=True)


if __name__ == "__main__":
    main()
