"""Antialiased crop-and-resize of a batch of images of different sizes in two kernel launches.

RandomResizedCrop on the GPU cropped and resized each decoded image with its own ``F.interpolate`` call: about
three kernel launches per image, ~11 ms of host time per batch of 128 on the H100 machine, the largest host cost of
GPU data loading after decoding. Here the images stay where they are (or travel as one flat uint8 buffer), a table
gives each one's (offset, size, crop box, mode, mirrored), and two separable passes do the whole batch: rows (to
the output width, into an fp32 buffer of every crop's rows), then columns (to the output height, rounded to uint8 as
PIL stores images).

Weights follow PyTorch's ``antialias=True`` interpolation (which follows PIL): for an output pixel at centre
``c = scale * (i + 0.5)`` the taps are the input pixels in ``[trunc(c - support + 0.5), trunc(c + support + 0.5))``,
support = ``interp_size / 2 * max(scale, 1)``, each weighted by the filter at ``(x - c + 0.5) / max(scale, 1)``
(triangle for bilinear, Keys cubic with a = -0.5 for bicubic), normalised to sum 1; ``nearest-exact`` takes the
pixel ``floor(scale * (i + 0.5))``. Each output pixel is the weighted sum divided by the sum of the weights.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from .ops import interpreting, launch_direct

# per-image mode ids (swin.gpu_augment.MODES order)
BILINEAR, BICUBIC, NEAREST = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# int64 per image: offset, H, W, top, left, crop h, crop w, mode, offset in the row buffer, mirrored (0 or 1)
META = tl.constexpr(10)
# launch geometry on a GPU, rows per program and warps (scripts/bench_augment_kernels.py sweeps them): the kernels
# are bound by instruction issue and gather latency, not bandwidth, and 4 x 4 was the fastest of 4-32 rows x 2-8
# warps on the H100 (0.35 ms against 0.52 ms at 16 rows for 128 images to 224 x 224, docs/benchmarks.md)
GPU_BLOCK, GPU_WARPS = 4, 4


@triton.jit
def _filter(x, mode):
    """Triangle (bilinear) or Keys cubic with a = -0.5 (bicubic, as PIL and antialiased PyTorch)."""
    x = tl.abs(x)
    a: tl.constexpr = -0.5
    cubic = tl.where(x < 1.0, ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0,
                     tl.where(x < 2.0, (((x - 5.0) * x + 8.0) * x - 4.0) * a, 0.0))
    triangle = tl.maximum(1.0 - x, 0.0)
    return tl.where(mode == BICUBIC, cubic, triangle)


@triton.jit
def _taps(offs, n_in, n_out, mode):
    """(first tap, end, centre, 1 / stretch) per output index: the input range each one reads, and how to weigh it."""
    # round-to-nearest divisions (a plain fp32 `/` compiles to an approximate one on NVIDIA GPUs, and nearest-exact
    # indices at even ratios, 448 -> 224, sit exactly on integers)
    scale = tl.math.div_rn(n_in.to(tl.float32), n_out.to(tl.float32))
    stretch = tl.maximum(scale, 1.0)
    support = tl.where(mode == BICUBIC, 2.0, 1.0) * stretch
    centre = scale * (offs.to(tl.float32) + 0.5)
    first = tl.maximum((centre - support + 0.5).to(tl.int32), 0)  # float -> int truncates, as the C++ kernels
    end = tl.minimum((centre + support + 0.5).to(tl.int32), n_in)
    nearest = tl.minimum(centre.to(tl.int32), n_in - 1)  # nearest-exact: floor(scale * (i + 0.5))
    first = tl.where(mode == NEAREST, nearest, first)
    end = tl.where(mode == NEAREST, nearest + 1, end)
    return first, end, centre, tl.math.div_rn(1.0, stretch)


@triton.jit
def _tap(t, first, end, centre, inv, mode):
    """Tap t of each output index: (input position, whether it is a tap, its weight before normalising)."""
    pos = first + t
    inside = pos < end
    weight = tl.where(mode == NEAREST, 1.0, _filter((pos.to(tl.float32) - centre + 0.5) * inv, mode))
    return pos, inside, tl.where(inside, weight, 0.0)


# Triton turns an int argument equal to 1 into a compile-time constant, a Python int without `.to` in _taps
@triton.jit(do_not_specialize=["OUT_W"])
def crop_resize_rows_kernel(src_ptr, meta_ptr, rows_ptr, OUT_W, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
                            CHANNELS_LAST: tl.constexpr):
    """rows[image, channel, crop row, j]: the crop's rows resized to OUT_W columns (fp32, not rounded). Images are
    (3, H, W) planes or, CHANNELS_LAST, (H, W, 3) pixels."""
    image, channel = tl.program_id(0) // 3, tl.program_id(0) % 3
    meta = meta_ptr + image * META
    offset, height, width = tl.load(meta), tl.load(meta + 1).to(tl.int32), tl.load(meta + 2).to(tl.int32)
    top, left = tl.load(meta + 3).to(tl.int32), tl.load(meta + 4).to(tl.int32)
    crop_h, crop_w = tl.load(meta + 5).to(tl.int32), tl.load(meta + 6).to(tl.int32)
    mode, rows_offset = tl.load(meta + 7).to(tl.int32), tl.load(meta + 8)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    if tl.program_id(1) * BLOCK_R < crop_h:
        j = tl.arange(0, BLOCK_W)
        live = (r < crop_h)[:, None] & (j < OUT_W)[None, :]
        first, end, centre, inv = _taps(j, crop_w, OUT_W, mode)
        if CHANNELS_LAST:
            step = 3
            src = src_ptr + offset + channel + ((top + r)[:, None] * width + left) * 3
        else:
            step = 1
            src = src_ptr + offset + (channel * height).to(tl.int64) * width + (top + r)[:, None] * width + left
        acc = tl.zeros((BLOCK_R, BLOCK_W), dtype=tl.float32)
        total = tl.zeros((BLOCK_W,), dtype=tl.float32)
        for t in range(0, tl.max(tl.where(j < OUT_W, end - first, 0), 0)):
            x, inside, w = _tap(t, first, end, centre, inv, mode)
            pixels = tl.load(src + x[None, :] * step, mask=live & inside[None, :], other=0)
            acc += w[None, :] * pixels.to(tl.float32)
            total += w
        out = rows_ptr + rows_offset + (channel * crop_h + r)[:, None] * OUT_W + j[None, :]
        tl.store(out, acc / tl.where(total > 0, total, 1.0)[None, :], mask=live)


@triton.jit(do_not_specialize=["OUT_H", "OUT_W"])
def crop_resize_cols_kernel(rows_ptr, meta_ptr, out_ptr, OUT_H, OUT_W, BLOCK_I: tl.constexpr,
                            BLOCK_W: tl.constexpr):
    """out[image, channel, i, j]: the row buffer resized to OUT_H rows, rounded and clamped to uint8; a mirrored
    image's columns stored right to left (the horizontal flip, which commutes with the resize)."""
    image, channel = tl.program_id(0) // 3, tl.program_id(0) % 3
    meta = meta_ptr + image * META
    crop_h, mode, rows_offset = tl.load(meta + 5).to(tl.int32), tl.load(meta + 7).to(tl.int32), tl.load(meta + 8)
    mirrored = tl.load(meta + 9) != 0
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    j = tl.arange(0, BLOCK_W)
    live = (i < OUT_H)[:, None] & (j < OUT_W)[None, :]
    first, end, centre, inv = _taps(i, crop_h, OUT_H, mode)
    src = rows_ptr + rows_offset + channel * crop_h * OUT_W + j[None, :]
    acc = tl.zeros((BLOCK_I, BLOCK_W), dtype=tl.float32)
    total = tl.zeros((BLOCK_I,), dtype=tl.float32)
    for t in range(0, tl.max(tl.where(i < OUT_H, end - first, 0), 0)):
        y, inside, w = _tap(t, first, end, centre, inv, mode)
        values = tl.load(src + y[:, None] * OUT_W, mask=live & inside[:, None], other=0.0)
        acc += w[:, None] * values
        total += w
    value = acc / tl.where(total > 0, total, 1.0)[:, None]
    down = tl.floor(value)
    frac = value - down  # round half to even, as torch.round
    value = down + tl.where(frac > 0.5, 1.0, tl.where(frac < 0.5, 0.0, down - 2.0 * tl.floor(down * 0.5)))
    column = tl.where(mirrored, OUT_W - 1 - j, j)
    out = out_ptr + (image * 3 + channel).to(tl.int64) * OUT_H * OUT_W + i[:, None] * OUT_W + column[None, :]
    tl.store(out, tl.minimum(tl.maximum(value, 0.0), 255.0).to(tl.uint8), mask=live)


def crop_resize(images: list[torch.Tensor], boxes: np.ndarray, modes: np.ndarray, size: tuple[int, int],
                flips: np.ndarray | None = None) -> torch.Tensor:
    """(B, 3, *size) uint8: box (top, left, height, width) of each (3, H_i, W_i) uint8 image, resized with its mode
    (0 bilinear, 1 bicubic: antialiased; 2 nearest-exact), and mirrored left to right where ``flips`` is true. The
    kernels read each image where it lies, at its offset from the lowest-addressed one: packing the batch into one
    buffer first (torch.cat) took 0.15 ms of GPU time per batch of 128 decoded images on the H100."""
    if not images or any(img.dim() != 3 or img.shape[0] != 3 or img.dtype != torch.uint8 for img in images):
        raise ValueError("crop_resize takes (3, H, W) uint8 images")
    if any(img.device != images[0].device for img in images):
        raise ValueError("crop_resize takes the images of one device")
    shapes = np.array([img.shape[1:] for img in images], dtype=np.int64).reshape(len(images), 2)
    if interpreting() and images[0].device.type != "cpu":
        # the interpreter copies each tensor argument to the host by itself: only one buffer can be addressed
        return crop_resize_packed(torch.cat([img.reshape(-1) for img in images]), shapes, boxes, modes, size,
                                  flips=flips)
    images = [img.contiguous() for img in images]  # (referenced until the kernels are queued)
    base = min(images, key=lambda img: img.data_ptr())
    offsets = np.array([img.data_ptr() - base.data_ptr() for img in images], dtype=np.int64)
    return _launch(base, offsets, shapes, boxes, modes, size, False, flips)


def crop_resize_packed(pixels: torch.Tensor, shapes: np.ndarray, boxes: np.ndarray, modes: np.ndarray,
                       size: tuple[int, int], channels_last: bool = False, flips: np.ndarray | None = None
                       ) -> torch.Tensor:
    """crop_resize of images stored back to back in one flat uint8 tensor, each (3, H_i, W_i) contiguous or, with
    ``channels_last``, (H_i, W_i, 3) contiguous (as libjpeg-turbo decodes), with ``shapes[i] = (H_i, W_i)``: what
    loader workers that decode on the CPU send (no per-image tensors to pack)."""
    n = len(shapes)
    heights, widths = np.asarray(shapes, dtype=np.int64).reshape(n, 2).T
    pixel_counts = 3 * heights * widths
    if pixels.dtype != torch.uint8 or pixels.dim() != 1 or pixels.numel() != int(pixel_counts.sum()):
        raise ValueError(f"crop_resize_packed: {pixels.numel()} {pixels.dtype} values for images of "
                         f"{int(pixel_counts.sum())} uint8 values in all")
    return _launch(pixels, np.cumsum(pixel_counts) - pixel_counts, shapes, boxes, modes, size, channels_last, flips)


def _launch(src: torch.Tensor, offsets: np.ndarray, shapes: np.ndarray, boxes: np.ndarray, modes: np.ndarray,
            size: tuple[int, int], channels_last: bool, flips: np.ndarray | None) -> torch.Tensor:
    """The two kernels over the images at ``offsets`` (elements) from ``src``'s first, of ``shapes`` (H_i, W_i)."""
    device, n = src.device, len(shapes)
    out_h, out_w = size
    heights, widths = np.asarray(shapes, dtype=np.int64).reshape(n, 2).T
    boxes = np.asarray(boxes, dtype=np.int64).reshape(n, 4)
    top, left, h, w = boxes.T
    if (top < 0).any() or (left < 0).any() or (h < 1).any() or (w < 1).any() or (top + h > heights).any() \
            or (left + w > widths).any():
        raise ValueError("crop_resize: every box (top, left, height, width) must lie inside its image")
    row_sizes = 3 * boxes[:, 2] * out_w
    mirrored = np.zeros(n, dtype=np.int64) if flips is None else np.asarray(flips, dtype=np.int64).reshape(n)
    meta = np.stack([offsets, heights, widths, top, left, h, w, np.asarray(modes, dtype=np.int64),
                     np.cumsum(row_sizes) - row_sizes, mirrored], axis=1)
    assert meta.shape[1] == META
    meta_t = torch.from_numpy(meta)
    # pinned and asynchronous: a copy from pageable memory would make the caller's thread wait for its stream
    meta_t = meta_t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else meta_t
    rows = torch.empty(int(row_sizes.sum()), dtype=torch.float32, device=device)
    out = torch.empty((n, 3, out_h, out_w), dtype=torch.uint8, device=device)
    block_w = triton.next_power_of_2(out_w)
    # the interpreter runs each program's block as one numpy operation: fewer, larger ones
    block, warps = (max(1, 4096 // block_w), 4) if interpreting() else (GPU_BLOCK, GPU_WARPS)
    launch_direct(crop_resize_rows_kernel, (n * 3, triton.cdiv(int(h.max()), block)), src, meta_t, rows, out_w,
                  BLOCK_R=block, BLOCK_W=block_w, CHANNELS_LAST=channels_last, num_warps=warps)
    launch_direct(crop_resize_cols_kernel, (n * 3, triton.cdiv(out_h, block)), rows, meta_t, out, out_h, out_w,
                  BLOCK_I=block, BLOCK_W=block_w, num_warps=warps)
    return out
