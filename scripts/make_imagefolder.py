"""Generate an ImageNet-shaped JPEG folder to measure the training input path without ImageNet.

    python scripts/make_imagefolder.py /tmp/fakenet                          # 100 classes x (100 train + 10 val)
    python scripts/make_imagefolder.py /tmp/fakenet --classes 64 --train-per-class 200 --val-per-class 8
    python train.py experiment=imagenet_swin_tiny data.root=/tmp/fakenet train.batch_size=128 ...

Writes ``<out>/train/<class>/*.JPEG`` and ``<out>/val/<class>/*.JPEG`` (the layout ``data=imagenet`` /
``data=imagefolder`` read). The files cost the loader what ImageNet's do: sizes and aspect ratios like
ImageNet's (mostly 500 pixels on the long side: 500x375, 375x500, 500x333, ... and smaller ones), JPEG
quality 90, and content that does not compress to nothing (smooth colour fields, shapes and sensor-like
noise), about 100 KB per file on average (ImageNet: ~110 KB). Each class has its own palette and
shape kind, so a model can learn the task and the loss goes down. Deterministic for a given --seed.
"""
from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

# (long side, short side) pairs and how often ImageNet-like collections have them; orientation is drawn
# separately (about 3 in 4 landscape)
SHAPES = [((500, 375), 0.45), ((500, 333), 0.15), ((500, 400), 0.08), ((500, 500), 0.07), ((400, 300), 0.08),
          ((450, 350), 0.07), ((375, 250), 0.05), ((640, 480), 0.05)]


def _size(rng: np.random.Generator) -> tuple[int, int]:
    long, short = SHAPES[rng.choice(len(SHAPES), p=[p for _, p in SHAPES])][0]
    jitter = rng.integers(-12, 13)  # not every file of a kind has exactly the same size
    long, short = long + jitter, short + jitter
    return (long, short) if rng.random() < 0.75 else (short, long)


def make_image(cls: int, num_classes: int, seed: int) -> Image.Image:
    """One RGB image of class `cls`: a random colour field around the class hue (smooth at two scales, texture at
    two finer ones), shapes of the class's kind with soft edges, then grain (sigma 18): together what keeps
    quality-90 JPEG files at ImageNet-like sizes (~100 KB at ~500x375)."""
    rng = np.random.default_rng(seed)
    w, h = _size(rng)
    hue = cls / num_classes
    base = np.array([0.5 + 0.4 * np.cos(2 * np.pi * (hue + k / 3)) for k in range(3)]) * 255
    # smooth field: coarse random grids upsampled (bicubic), four scales (the finer two are texture)
    field = np.zeros((h, w, 3), np.float32)
    for cells, amp in ((4, 60.0), (16, 30.0), (96, 25.0), (200, 18.0)):
        coarse = rng.normal(0, amp, (cells, cells, 3)).astype(np.float32)
        for c in range(3):
            field[..., c] += np.asarray(Image.fromarray(coarse[..., c], mode="F").resize((w, h), Image.BICUBIC))
    img = Image.fromarray(np.clip(base + field, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    kind = cls % 3
    for _ in range(int(rng.integers(3, 9))):
        cx, cy = rng.integers(0, w), rng.integers(0, h)
        r = int(rng.integers(min(w, h) // 12, min(w, h) // 3))
        colour = tuple(int(v) for v in np.clip(255 - base + rng.normal(0, 40, 3), 0, 255))
        if kind == 0:
            draw.ellipse([cx - r, cy - r // 2, cx + r, cy + r // 2], fill=colour)
        elif kind == 1:
            draw.rectangle([cx - r, cy - r, cx + r // 2, cy + r // 3], fill=colour)
        else:
            pts = [(int(cx + r * np.cos(a)), int(cy + r * np.sin(a))) for a in np.sort(rng.uniform(0, 2 * np.pi, 5))]
            draw.polygon(pts, fill=colour)
    img = img.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0.3, 0.8))))  # soft edges, as photos
    arr = np.asarray(img, dtype=np.float32) + 18.0 * rng.standard_normal((h, w, 3), dtype=np.float32)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))


def _write(job: tuple[str, int, int, int, int]) -> int:
    path, cls, num_classes, seed, quality = job
    make_image(cls, num_classes, seed).save(path, format="JPEG", quality=quality)
    return os.path.getsize(path)


def jobs(out: Path, classes: int, per_split: dict[str, int], seed: int, quality: int) -> list[tuple]:
    """(path, class, classes, image seed, quality) of every file; creates the class folders."""
    todo = []
    for s, (split, count) in enumerate(per_split.items()):
        for c in range(classes):
            d = out / split / f"class{c:04d}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                image_seed = ((seed * 7 + s) * 100_003 + c) * 100_003 + i
                todo.append((str(d / f"{split}_{c:04d}_{i:05d}.JPEG"), c, classes, image_seed, quality))
    return todo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="output folder (train/ and val/ are created in it)")
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--train-per-class", type=int, default=100)
    parser.add_argument("--val-per-class", type=int, default=10)
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes (default: all cores)")
    args = parser.parse_args()
    start = time.perf_counter()
    todo = jobs(args.out, args.classes, {"train": args.train_per_class, "val": args.val_per_class}, args.seed,
                args.quality)
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers) as pool:
            sizes = list(pool.map(_write, todo, chunksize=32))
    else:
        sizes = [_write(j) for j in todo]
    total, mean_kb = sum(sizes), sum(sizes) / max(len(sizes), 1) / 1e3
    print(f"wrote {len(sizes)} JPEG files ({args.classes} classes x {args.train_per_class} train + "
          f"{args.val_per_class} val) to {args.out}: {total / 2**20:.0f} MiB, {mean_kb:.0f} KB per file on average, "
          f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
