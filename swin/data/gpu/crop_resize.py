"""Antialiased crop-and-resize of a batch of images of different sizes in two kernel launches.

Cropping and resizing each decoded image with its own ``F.interpolate`` call costs about three kernel launches per
image, the largest host cost of GPU data loading after decoding. Here the images stay where they are (or travel as
one flat uint8 buffer), a table gives each plane's (offset, pitch, crop window, mode, mirrored, subsampling), and
two separable passes do the whole batch: rows (to the output width, into an fp32 buffer of every crop's rows), then
columns (to the output height, rounded to uint8 as PIL stores images).

Images are RGB (3, H, W) or a JPEG's YCbCr planes as the decoder left them (:class:`YCbCrImage`: chroma subsampled,
4:2:0 say). Each plane is resized from where the crop lies in it, with the filter its own scale needs, and the
column pass converts YCbCr to RGB (JFIF's full-range BT.601) before rounding: nvJPEG's own conversion to RGB is
one kernel per image, and the chroma planes of a 4:2:0 file are a quarter of the luma's pixels to read.

Weights follow PyTorch's ``antialias=True`` interpolation (which follows PIL): for an output pixel at centre
``c = scale * (i + 0.5)`` the taps are the input pixels in ``[trunc(c - support + 0.5), trunc(c + support + 0.5))``,
support = ``interp_size / 2 * max(scale, 1)``, each weighted by the filter at ``(x - c + 0.5) / max(scale, 1)``
(triangle for bilinear, Keys cubic with a = -0.5 for bicubic), normalised to sum 1; ``nearest-exact`` takes the
pixel ``floor(scale * (i + 0.5))``. Each output pixel is the weighted sum divided by the sum of the weights. In a
plane subsampled by 2**s the same holds in that plane's coordinates (the crop's edges divided by 2**s, JPEG's
centred chroma siting), the taps limited to the plane pixels the crop touches.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.ops import cdiv, interpreting, launch_direct, next_power_of_2

# per-image mode ids (swin.data.gpu.augment.MODES order)
BILINEAR, BICUBIC, NEAREST = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
# int64 per plane (image k's channel c at row 3k + c): its offset from the source pointer and row pitch (elements);
# the crop's window in the plane (first row and column, rows and columns it touches); the mode; where its rows
# start in the row buffer; mirrored (0 or 1); the crop's height and width at full resolution; the plane's
# subsampling (log2, vertical and horizontal); how far (full-resolution pixels) the crop starts after the window's
# first pixel; whether the image's planes are YCbCr (1) or RGB (0)
(OFFSET, PITCH, TOP, LEFT, ROWS, COLS, MODE, ROWS_AT, MIRRORED, CROP_H, CROP_W, SHIFT_V, SHIFT_H, REM_TOP, REM_LEFT,
 YCBCR) = (tl.constexpr(k) for k in range(16))
META = tl.constexpr(16)
# launch geometry on a GPU, rows per program and warps: the kernels are bound by instruction issue and gather
# latency, not bandwidth, and small programs of 4 rows and 2 warps are the fastest
GPU_BLOCK, GPU_WARPS = 4, 2


@dataclass(frozen=True, eq=False)  # (tensors do not compare as one bool)
class YCbCrImage:
    """A JPEG's decoded planes, as nvJPEG's YUV output leaves them: uint8 (H, W) luma and (ceil(H / 2**sv),
    ceil(W / 2**sw)) Cb and Cr, sv and sw in 0..2 (4:2:0 is 1, 1). Shaped like the (3, H, W) RGB image it becomes."""

    y: torch.Tensor
    cb: torch.Tensor
    cr: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((3, *self.y.shape))

    @property
    def device(self) -> torch.device:
        return self.y.device

    def planes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.y, self.cb, self.cr

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        for plane in self.planes():
            plane.record_stream(stream)

    def shifts(self) -> tuple[int, int]:
        """The chroma planes' subsampling, log2 (vertical, horizontal); ValueError for planes of other sizes."""
        (height, width), chroma = self.y.shape, tuple(self.cb.shape)
        for sv in range(3):
            for sh in range(3):
                if chroma == (-(-height // 2**sv), -(-width // 2**sh)):
                    if tuple(self.cr.shape) != chroma:
                        break
                    return sv, sh
        raise ValueError(f"YCbCrImage: chroma planes {tuple(self.cb.shape)} and {tuple(self.cr.shape)} are not a "
                         f"subsampling by 1, 2 or 4 of the luma's {tuple(self.y.shape)}")


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
def _taps(offs, crop, n_out, shift, rem, n_in, mode):
    """(first tap, end, centre, 1 / stretch) per output index: the input range each one reads in a window of
    ``n_in`` pixels of a plane subsampled by 2**shift, where the crop spans ``crop`` full-resolution pixels from
    ``rem`` after the window's start, and how to weigh it. Unsubsampled (shift 0, rem 0): PyTorch's arithmetic."""
    # round-to-nearest divisions (a plain fp32 `/` compiles to an approximate one on NVIDIA GPUs, and nearest-exact
    # indices at even ratios, 448 -> 224, sit exactly on integers); powers of two are exact
    scale = tl.math.div_rn(crop.to(tl.float32), (n_out << shift).to(tl.float32))
    stretch = tl.maximum(scale, 1.0)
    support = tl.where(mode == BICUBIC, 2.0, 1.0) * stretch
    start = tl.math.div_rn(rem.to(tl.float32), (1 << shift).to(tl.float32))
    centre = start + scale * (offs.to(tl.float32) + 0.5)
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


@triton.jit
def _field(meta, k):
    return tl.load(meta + k).to(tl.int32)


# Triton turns an int argument equal to 1 into a compile-time constant, a Python int without `.to` in _taps
@triton.jit(do_not_specialize=["OUT_W"])
def crop_resize_rows_kernel(src_ptr, meta_ptr, groups_ptr, rows_ptr, OUT_W, BLOCK_R: tl.constexpr,
                            BLOCK_W: tl.constexpr, CHANNELS_LAST: tl.constexpr):
    """rows[plane, window row, j]: each plane's crop window rows resized to OUT_W columns (fp32, not rounded).
    Planes are rows of pixels at their pitch, pixels next to each other or, CHANNELS_LAST, every third byte.
    Each program takes a group of 1 to 3 planes with one crop window (``groups_ptr``: first plane, count; an RGB
    image's three, a YCbCr image's luma, its two chroma planes) and computes the taps and their weights, about half
    of its instructions, once for them all."""
    group = groups_ptr + tl.program_id(0) * 2
    first_plane, count = tl.load(group), tl.load(group + 1)
    meta = meta_ptr + first_plane * META
    top, left, rows, cols = _field(meta, TOP), _field(meta, LEFT), _field(meta, ROWS), _field(meta, COLS)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    if tl.program_id(1) * BLOCK_R < rows:
        mode = _field(meta, MODE)
        j = tl.arange(0, BLOCK_W)
        live = (r < rows)[:, None] & (j < OUT_W)[None, :]
        first, end, centre, inv = _taps(j, _field(meta, CROP_W), OUT_W, _field(meta, SHIFT_H),
                                        _field(meta, REM_LEFT), cols, mode)
        step: tl.constexpr = 3 if CHANNELS_LAST else 1
        src0 = src_ptr + tl.load(meta + OFFSET) + (top + r)[:, None] * _field(meta, PITCH) + left * step
        # planes past the group's count read and write nothing (the group's last plane stands in)
        meta1, meta2 = meta + tl.minimum(count - 1, 1) * META, meta + tl.minimum(count - 1, 2) * META
        live1, live2 = live & (count > 1), live & (count > 2)
        src1 = src_ptr + tl.load(meta1 + OFFSET) + (top + r)[:, None] * _field(meta1, PITCH) + left * step
        src2 = src_ptr + tl.load(meta2 + OFFSET) + (top + r)[:, None] * _field(meta2, PITCH) + left * step
        acc0 = tl.zeros((BLOCK_R, BLOCK_W), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK_R, BLOCK_W), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK_R, BLOCK_W), dtype=tl.float32)
        total = tl.zeros((BLOCK_W,), dtype=tl.float32)
        for t in range(0, tl.max(tl.where(j < OUT_W, end - first, 0), 0)):
            x, inside, w = _tap(t, first, end, centre, inv, mode)
            column = x[None, :] * step
            acc0 += w[None, :] * tl.load(src0 + column, mask=live & inside[None, :], other=0).to(tl.float32)
            acc1 += w[None, :] * tl.load(src1 + column, mask=live1 & inside[None, :], other=0).to(tl.float32)
            acc2 += w[None, :] * tl.load(src2 + column, mask=live2 & inside[None, :], other=0).to(tl.float32)
            total += w
        norm = tl.where(total > 0, total, 1.0)[None, :]
        out = r[:, None] * OUT_W + j[None, :]
        tl.store(rows_ptr + tl.load(meta + ROWS_AT) + out, acc0 / norm, mask=live)
        tl.store(rows_ptr + tl.load(meta1 + ROWS_AT) + out, acc1 / norm, mask=live1)
        tl.store(rows_ptr + tl.load(meta2 + ROWS_AT) + out, acc2 / norm, mask=live2)


@triton.jit
def _resize_columns(rows_ptr, meta, i, j, OUT_H, OUT_W, live, BLOCK_I: tl.constexpr, BLOCK_W: tl.constexpr):
    """One plane's row buffer resized to output rows ``i`` (fp32, not rounded)."""
    mode = _field(meta, MODE)
    first, end, centre, inv = _taps(i, _field(meta, CROP_H), OUT_H, _field(meta, SHIFT_V), _field(meta, REM_TOP),
                                    _field(meta, ROWS), mode)
    src = rows_ptr + tl.load(meta + ROWS_AT) + j[None, :]
    acc = tl.zeros((BLOCK_I, BLOCK_W), dtype=tl.float32)
    total = tl.zeros((BLOCK_I,), dtype=tl.float32)
    for t in range(0, tl.max(tl.where(i < OUT_H, end - first, 0), 0)):
        y, inside, w = _tap(t, first, end, centre, inv, mode)
        values = tl.load(src + y[:, None] * OUT_W, mask=live & inside[:, None], other=0.0)
        acc += w[:, None] * values
        total += w
    return acc / tl.where(total > 0, total, 1.0)[:, None]


@triton.jit
def _store_uint8(out_ptr, plane, value, i, column, OUT_H, OUT_W, live):
    """Round half to even (as torch.round), clamp to 0..255 and store output plane ``plane``."""
    down = tl.floor(value)
    frac = value - down
    value = down + tl.where(frac > 0.5, 1.0, tl.where(frac < 0.5, 0.0, down - 2.0 * tl.floor(down * 0.5)))
    out = out_ptr + plane.to(tl.int64) * OUT_H * OUT_W + i[:, None] * OUT_W + column[None, :]
    tl.store(out, tl.minimum(tl.maximum(value, 0.0), 255.0).to(tl.uint8), mask=live)


@triton.jit(do_not_specialize=["OUT_H", "OUT_W"])
def crop_resize_cols_kernel(rows_ptr, meta_ptr, out_ptr, OUT_H, OUT_W, BLOCK_I: tl.constexpr,
                            BLOCK_W: tl.constexpr, CONVERT: tl.constexpr):
    """out[image, channel, i, j]: the row buffer resized to OUT_H rows, rounded and clamped to uint8; a mirrored
    image's columns stored right to left (the horizontal flip, which commutes with the resize). One program per
    plane, or with CONVERT per image: its three planes, converted from YCbCr to RGB where the image is YCbCr."""
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    j = tl.arange(0, BLOCK_W)
    live = (i < OUT_H)[:, None] & (j < OUT_W)[None, :]
    if CONVERT:
        image = tl.program_id(0)
        meta = meta_ptr + image * 3 * META
        column = tl.where(tl.load(meta + MIRRORED) != 0, OUT_W - 1 - j, j)
        luma = _resize_columns(rows_ptr, meta, i, j, OUT_H, OUT_W, live, BLOCK_I, BLOCK_W)
        second = _resize_columns(rows_ptr, meta + META, i, j, OUT_H, OUT_W, live, BLOCK_I, BLOCK_W)
        third = _resize_columns(rows_ptr, meta + 2 * META, i, j, OUT_H, OUT_W, live, BLOCK_I, BLOCK_W)
        ycbcr = tl.load(meta + YCBCR) != 0
        # JFIF (full-range BT.601), as libjpeg converts: Cb and Cr centred on 128
        cb, cr = second - 128.0, third - 128.0
        red = tl.where(ycbcr, luma + 1.402 * cr, luma)
        green = tl.where(ycbcr, luma - 0.344136286 * cb - 0.714136286 * cr, second)
        blue = tl.where(ycbcr, luma + 1.772 * cb, third)
        _store_uint8(out_ptr, image * 3, red, i, column, OUT_H, OUT_W, live)
        _store_uint8(out_ptr, image * 3 + 1, green, i, column, OUT_H, OUT_W, live)
        _store_uint8(out_ptr, image * 3 + 2, blue, i, column, OUT_H, OUT_W, live)
    else:
        plane = tl.program_id(0)
        meta = meta_ptr + plane * META
        column = tl.where(tl.load(meta + MIRRORED) != 0, OUT_W - 1 - j, j)
        value = _resize_columns(rows_ptr, meta, i, j, OUT_H, OUT_W, live, BLOCK_I, BLOCK_W)
        _store_uint8(out_ptr, plane, value, i, column, OUT_H, OUT_W, live)


Image = torch.Tensor | YCbCrImage


def crop_resize(images: list[Image], boxes: np.ndarray, modes: np.ndarray, size: tuple[int, int],
                flips: np.ndarray | None = None) -> torch.Tensor:
    """(B, 3, *size) uint8 RGB: box (top, left, height, width) of each (3, H_i, W_i) uint8 RGB image or
    :class:`YCbCrImage`, resized with its mode (0 bilinear, 1 bicubic: antialiased; 2 nearest-exact), and mirrored
    left to right where ``flips`` is true. The kernels read each plane where it lies, at its offset from the
    lowest-addressed one, so the batch is never packed into one buffer first (a torch.cat copy of every image)."""
    if not images:
        raise ValueError("crop_resize takes a batch of at least one image")
    buffers, planes = [], []  # planes: (buffer index, offset in it, pitch, height, width, shift_v, shift_h, ycbcr)
    for img in images:
        if isinstance(img, YCbCrImage):
            if any(plane.dim() != 2 or plane.dtype != torch.uint8 for plane in img.planes()):
                raise ValueError("crop_resize takes YCbCrImage planes of uint8 (H, W)")
            shift_v, shift_h = img.shifts()
            for c, plane in enumerate(img.planes()):
                buffers.append(plane.contiguous())
                height, width = plane.shape
                planes.append((len(buffers) - 1, 0, width, height, width, shift_v * (c > 0), shift_h * (c > 0), 1))
        elif img.dim() == 3 and img.shape[0] == 3 and img.dtype == torch.uint8:
            buffers.append(img.contiguous())
            height, width = img.shape[1:]
            planes += [(len(buffers) - 1, c * height * width, width, height, width, 0, 0, 0) for c in range(3)]
        else:
            raise ValueError("crop_resize takes (3, H, W) uint8 images or YCbCrImage planes")
    if any(b.device != buffers[0].device for b in buffers):
        raise ValueError("crop_resize takes the images of one device")
    table = np.array(planes, dtype=np.int64).reshape(len(planes), 8)
    if interpreting() and buffers[0].device.type != "cpu":
        # the interpreter copies each tensor argument to the host by itself: only one buffer can be addressed
        counts = np.array([b.numel() for b in buffers], dtype=np.int64)
        src, starts = torch.cat([b.reshape(-1) for b in buffers]), np.cumsum(counts) - counts
    else:  # (the buffers are referenced until the kernels are queued)
        src = min(buffers, key=lambda b: b.data_ptr())
        starts = np.array([b.data_ptr() - src.data_ptr() for b in buffers], dtype=np.int64)
    table[:, 1] += starts[table[:, 0]]
    return _launch(src, table[:, 1:], boxes, modes, size, False, flips)


def crop_resize_packed(pixels: torch.Tensor, shapes: np.ndarray, boxes: np.ndarray, modes: np.ndarray,
                       size: tuple[int, int], channels_last: bool = False, flips: np.ndarray | None = None
                       ) -> torch.Tensor:
    """crop_resize of RGB images stored back to back in one flat uint8 tensor, each (3, H_i, W_i) contiguous or,
    with ``channels_last``, (H_i, W_i, 3) contiguous (as libjpeg-turbo decodes), with ``shapes[i] = (H_i, W_i)``:
    what loader workers that decode on the CPU send (no per-image tensors to pack)."""
    n = len(shapes)
    heights, widths = np.asarray(shapes, dtype=np.int64).reshape(n, 2).T
    pixel_counts = 3 * heights * widths
    if pixels.dtype != torch.uint8 or pixels.dim() != 1 or pixels.numel() != int(pixel_counts.sum()):
        raise ValueError(f"crop_resize_packed: {pixels.numel()} {pixels.dtype} values for images of "
                         f"{int(pixel_counts.sum())} uint8 values in all")
    starts, channel = np.cumsum(pixel_counts) - pixel_counts, np.arange(3)[None, :]
    table = np.zeros((n, 3, 7), dtype=np.int64)  # offset, pitch, height, width; RGB, not subsampled
    if channels_last:  # channel c of a pixel at c, rows 3 W apart
        table[:, :, 0], table[:, :, 1] = starts[:, None] + channel, 3 * widths[:, None]
    else:
        table[:, :, 0], table[:, :, 1] = starts[:, None] + channel * (heights * widths)[:, None], widths[:, None]
    table[:, :, 2], table[:, :, 3] = heights[:, None], widths[:, None]
    return _launch(pixels, table.reshape(3 * n, 7), boxes, modes, size, channels_last, flips)


def _windows(start: np.ndarray, length: np.ndarray, shift: np.ndarray, limit: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A crop [start, start + length) of full-resolution pixels in a plane subsampled by 2**shift (``limit``
    pixels long): the plane pixels it touches (first, count) and how far the crop starts after the first."""
    first = start >> shift
    end = np.minimum((start + length + (1 << shift) - 1) >> shift, limit)
    return first, end - first, start - (first << shift)


def _plane_groups(ycbcr: np.ndarray) -> np.ndarray:
    """(first plane, planes) of the row pass's programs (crop_resize_rows_kernel): the groups of planes that share
    a crop window, an RGB image's three planes, a YCbCr image's luma and its two chroma planes. ycbcr: per plane
    (3 per image), whether its image is YCbCr."""
    images = np.asarray(ycbcr[0::3], dtype=bool)
    firsts = [[3 * k, 3 * k + 1] if is_ycbcr else [3 * k] for k, is_ycbcr in enumerate(images)]
    counts = [[1, 2] if is_ycbcr else [3] for is_ycbcr in images]
    return np.stack([np.concatenate(firsts), np.concatenate(counts)], axis=1).astype(np.int64)


def _launch(src: torch.Tensor, planes: np.ndarray, boxes: np.ndarray, modes: np.ndarray, size: tuple[int, int],
            channels_last: bool, flips: np.ndarray | None) -> torch.Tensor:
    """The two kernels over ``planes`` (3 per image: offset from ``src``'s first element, pitch, height, width,
    subsampling log2 vertical and horizontal, YCbCr or not)."""
    device, n = src.device, len(boxes)
    out_h, out_w = size
    offset, pitch, plane_h, plane_w, shift_v, shift_h, ycbcr = planes.reshape(3 * n, 7).T
    boxes = np.asarray(boxes, dtype=np.int64).reshape(n, 4)
    top, left, h, w = (np.repeat(v, 3) for v in boxes.T)
    heights, widths = plane_h[0::3], plane_w[0::3]  # each image's luma or first channel: its full size
    if (boxes[:, :2] < 0).any() or (boxes[:, 2:] < 1).any() or (boxes[:, 0] + boxes[:, 2] > heights).any() \
            or (boxes[:, 1] + boxes[:, 3] > widths).any():
        raise ValueError("crop_resize: every box (top, left, height, width) must lie inside its image")
    row0, rows, rem_top = _windows(top, h, shift_v, plane_h)
    col0, cols, rem_left = _windows(left, w, shift_h, plane_w)
    row_sizes = rows * out_w
    mirrored = np.zeros(n, dtype=np.int64) if flips is None else np.asarray(flips, dtype=np.int64).reshape(n)
    meta = np.stack([offset, pitch, row0, col0, rows, cols, np.repeat(np.asarray(modes, dtype=np.int64), 3),
                     np.cumsum(row_sizes) - row_sizes, np.repeat(mirrored, 3), h, w, shift_v, shift_h, rem_top,
                     rem_left, ycbcr], axis=1)
    assert meta.shape[1] == META
    groups = _plane_groups(ycbcr)
    tables = torch.from_numpy(np.concatenate([meta.reshape(-1), groups.reshape(-1)]))
    # pinned and asynchronous: a copy from pageable memory would make the caller's thread wait for its stream
    tables = tables.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tables
    meta_t, groups_t = tables[:meta.size], tables[meta.size:]
    rows_buffer = torch.empty(int(row_sizes.sum()), dtype=torch.float32, device=device)
    out = torch.empty((n, 3, out_h, out_w), dtype=torch.uint8, device=device)
    block_w = next_power_of_2(out_w)
    # the interpreter runs each program's block as one numpy operation: fewer, larger ones
    block, warps = (max(1, 4096 // block_w), 4) if interpreting() else (GPU_BLOCK, GPU_WARPS)
    launch_direct(crop_resize_rows_kernel, (len(groups), cdiv(int(rows.max()), block)), src, meta_t, groups_t,
                  rows_buffer, out_w, BLOCK_R=block, BLOCK_W=block_w, CHANNELS_LAST=channels_last, num_warps=warps)
    convert = bool(ycbcr.any())
    launch_direct(crop_resize_cols_kernel, (n if convert else n * 3, cdiv(out_h, block)), rows_buffer, meta_t,
                  out, out_h, out_w, BLOCK_I=block, BLOCK_W=block_w, CONVERT=convert, num_warps=warps)
    return out
