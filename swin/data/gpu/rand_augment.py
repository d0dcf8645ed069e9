"""One RandAugment layer of a uint8 image batch in a few kernel launches, whatever ops its images drew.

Grouping a layer's images by op and running each op on its slice costs about a hundred small kernels and copies
per batch, in Python and launch time under the GIL that a training loop in the same process needs. Here each
image's op id and arguments are read from a table by the kernel:

1. ``layer_stats_kernel``, programs of BLOCK pixels of one image: what the image's op needs from the whole image
   (each channel's min and max for AutoContrast, the grey sum for Contrast, each channel's histogram for Equalize),
   added up with integer atomics; then ``layer_lut_kernel`` turns the histograms into Equalize's lookup tables (one
   program per image; one program per image for the whole statistics would be serial over the pixels);
2. ``layer_apply_kernel``, programs of APPLY_BLOCK pixels of one image (BLOCK in the interpreter): the op,
   pointwise or (Sharpness, the affine ops) from neighbouring / sampled source pixels, all three channels.

The arithmetic follows the per-op PyTorch reference (swin.data.gpu.augment.apply_op, which follows timm's PIL ops):
integer ops and lookup tables exactly; enhancements as fp32 blends truncated to uint8; rotations, shears and
translations as ``F.affine_grid`` + ``F.grid_sample`` (align_corners=False, border padding, bicubic a = -0.75,
nearest rounds half to even) with sources outside the image taking the fill colour. The affine sample positions
may differ from PyTorch's in the last bit (another order of the same fp32 operations), which can move a truncated
value by one level.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.ops import cdiv, interpreting, launch_direct

# op ids (the table's values); the three affine ids differ in their resampling filter
(AUTOCONTRAST, EQUALIZE, INVERT, POSTERIZE, SOLARIZE, SOLARIZE_ADD, COLOR, CONTRAST, BRIGHTNESS, SHARPNESS,
 AFFINE_BILINEAR, AFFINE_BICUBIC, AFFINE_NEAREST, IDENTITY) = range(14)
NUM_OPS = 14
# the same ids as the kernels see them (a jit function reads module globals only as constexpr)
_AUTOCONTRAST, _EQUALIZE, _INVERT, _POSTERIZE, _SOLARIZE, _SOLARIZE_ADD, _COLOR, _CONTRAST, _BRIGHTNESS, _SHARPNESS, \
    _AFFINE_BILINEAR, _AFFINE_BICUBIC, _AFFINE_NEAREST, _IDENTITY = (tl.constexpr(op) for op in range(NUM_OPS))
ARGS = 6  # fp32 arguments per image: a factor / threshold / mask in [0], or a 2x3 affine matrix (affine_grid's theta)
# an image's int32 statistics row: three 256-bin histograms, 255 - min and max per channel, the grey sum
HISTOGRAMS = 3 * 256
ACC = HISTOGRAMS + 3 + 3 + 2  # padded to an even row
_MIN, _MAX, _GREY = tl.constexpr(HISTOGRAMS), tl.constexpr(HISTOGRAMS + 3), tl.constexpr(HISTOGRAMS + 6)
_ACC, _ARGS = tl.constexpr(ACC), tl.constexpr(ARGS)
BLOCK = 1024
# layer_apply_kernel's launch on a GPU, pixels per program and warps: the ops are bound by instruction issue and
# gather latency (the affine ones' taps), not bandwidth, so smaller programs than BLOCK's are faster
APPLY_BLOCK, APPLY_WARPS = 256, 4


@triton.jit
def _grey(r, g, b):
    """PIL's RGB -> L (fixed-point ITU-R 601-2 luma, rounded), int32."""
    return (r * 19595 + g * 38470 + b * 7471 + 32768) >> 16


@triton.jit
def _blend(d, v, f):
    """PIL's ImageEnhance: d + f (v - d) in fp32, clipped to 0..255, truncated (int32)."""
    d = d.to(tl.float32)
    return tl.minimum(tl.maximum(d + f * (v.to(tl.float32) - d), 0.0), 255.0).to(tl.int32)


@triton.jit
def layer_stats_kernel(x_ptr, ops_ptr, acc_ptr, HW, BLOCK: tl.constexpr):
    """Programs of BLOCK pixels of one image add what its op needs into the image's zeroed int32 row of acc:
    256-bin histograms per channel (Equalize), 255 - min and max per channel (AutoContrast), the grey sum
    (Contrast). Integer atomics: exact, in any order."""
    img = tl.program_id(0)
    op = tl.load(ops_ptr + img)
    at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = at < HW
    base = x_ptr + img.to(tl.int64) * 3 * HW
    acc = acc_ptr + img * _ACC
    if op == _AUTOCONTRAST:
        for c in tl.static_range(3):
            v = tl.load(base + c * HW + at, mask=live, other=0).to(tl.int32)
            tl.atomic_max(acc + _MIN + c, tl.max(tl.where(live, 255 - v, 0), 0))
            tl.atomic_max(acc + _MAX + c, tl.max(v, 0))
    if op == _CONTRAST:
        r = tl.load(base + at, mask=live, other=0).to(tl.int32)
        g = tl.load(base + HW + at, mask=live, other=0).to(tl.int32)
        b = tl.load(base + 2 * HW + at, mask=live, other=0).to(tl.int32)
        tl.atomic_add(acc + _GREY, tl.sum(tl.where(live, _grey(r, g, b), 0), 0))  # < 2^31 below 8M pixels
    if op == _EQUALIZE:
        bins = tl.arange(0, 256)
        padding = tl.sum((at >= HW).to(tl.int32), 0)
        for c in tl.static_range(3):
            # masked lanes read 0 and are taken off bin 0 (tl.histogram's mask is not in every Triton)
            v = tl.load(base + c * HW + at, mask=live, other=0).to(tl.int32)
            hist = tl.histogram(v, 256) - tl.where(bins == 0, padding, 0)
            tl.atomic_add(acc + c * 256 + bins, hist)


@triton.jit
def layer_lut_kernel(ops_ptr, acc_ptr, lut_ptr, HW):
    """Equalize's lookup tables from the histograms, one program per image (PIL's rule: lut[k] = (pixels below k +
    step // 2) // step, step = the pixels not of the largest value present, // 255; an image of one value, step 0,
    is left as it is)."""
    img = tl.program_id(0)
    if tl.load(ops_ptr + img) == _EQUALIZE:
        bins = tl.arange(0, 256)
        for c in tl.static_range(3):
            hist = tl.load(acc_ptr + img * _ACC + c * 256 + bins)
            last = tl.max(tl.where(hist > 0, bins, 0), 0)
            step = (HW - tl.sum(tl.where(bins == last, hist, 0), 0)) // 255
            below = tl.cumsum(hist, 0) - hist
            lut = tl.minimum((below + step // 2) // tl.maximum(step, 1), 255)
            lut = tl.where(step == 0, bins, lut)
            tl.store(lut_ptr + (img * 3 + c) * 256 + bins, lut.to(tl.uint8))


@triton.jit
def _tap(base, HW, W, yy, xx, live):
    """The three channels at (yy, xx), int32 coordinates inside the image, as fp32."""
    at = yy * W + xx
    r = tl.load(base + at, mask=live, other=0).to(tl.float32)
    g = tl.load(base + HW + at, mask=live, other=0).to(tl.float32)
    b = tl.load(base + 2 * HW + at, mask=live, other=0).to(tl.float32)
    return r, g, b


@triton.jit
def _round_half_even(v):
    f = tl.floor(v)
    d = v - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def _cubic_weights(t):
    """grid_sample's bicubic weights of the taps at -1, 0, 1, 2 for fraction t (cubic convolution, A = -0.75)."""
    A: tl.constexpr = -0.75
    x1 = t + 1.0
    w0 = ((A * x1 - 5.0 * A) * x1 + 8.0 * A) * x1 - 4.0 * A
    w1 = ((A + 2.0) * t - (A + 3.0)) * t * t + 1.0
    x2 = 1.0 - t
    w2 = ((A + 2.0) * x2 - (A + 3.0)) * x2 * x2 + 1.0
    x3 = x2 + 1.0
    w3 = ((A * x3 - 5.0 * A) * x3 + 8.0 * A) * x3 - 4.0 * A
    return w0, w1, w2, w3


@triton.jit
def _cubic_row(base, HW, W, yy, x0, w0, w1, w2, w3, live):
    """One row of bicubic taps (columns x0 - 1 .. x0 + 2, clamped to the image), weighted, per channel."""
    r0, g0, b0 = _tap(base, HW, W, yy, tl.minimum(tl.maximum(x0 - 1, 0), W - 1), live)
    r1, g1, b1 = _tap(base, HW, W, yy, tl.minimum(tl.maximum(x0, 0), W - 1), live)
    r2, g2, b2 = _tap(base, HW, W, yy, tl.minimum(tl.maximum(x0 + 1, 0), W - 1), live)
    r3, g3, b3 = _tap(base, HW, W, yy, tl.minimum(tl.maximum(x0 + 2, 0), W - 1), live)
    return (r0 * w0 + r1 * w1 + r2 * w2 + r3 * w3, g0 * w0 + g1 * w1 + g2 * w2 + g3 * w3,
            b0 * w0 + b1 * w1 + b2 * w2 + b3 * w3)


@triton.jit
def _affine(base, args, fill_ptr, op, y, x, H, W, live):
    """Output pixels (y, x) of an affine op: (r, g, b) int32. affine_grid's normalised output coordinates mapped by
    theta, sampled as grid_sample (align_corners=False, border padding) or the fill colour where the source point
    lies outside the image, clipped and truncated."""
    HW = H * W
    t00, t01, t02 = tl.load(args), tl.load(args + 1), tl.load(args + 2)
    t10, t11, t12 = tl.load(args + 3), tl.load(args + 4), tl.load(args + 5)
    # affine_grid's pixel centres (2x + 1) / W - 1, divided exactly (div_rn wants tensors of one shape: W broadcast)
    xn = tl.math.div_rn(2.0 * x.to(tl.float32) + 1.0, (x * 0 + W).to(tl.float32)) - 1.0
    yn = tl.math.div_rn(2.0 * y.to(tl.float32) + 1.0, (y * 0 + H).to(tl.float32)) - 1.0
    gx = t00 * xn + t01 * yn + t02
    gy = t10 * xn + t11 * yn + t12
    inside = (gx >= -1.0) & (gx < 1.0) & (gy >= -1.0) & (gy < 1.0)
    ix = ((gx + 1.0) * W - 1.0) / 2.0  # unnormalised source coordinates
    iy = ((gy + 1.0) * H - 1.0) / 2.0
    if op == _AFFINE_BICUBIC:
        x0f = tl.floor(ix)
        y0f = tl.floor(iy)
        wx0, wx1, wx2, wx3 = _cubic_weights(ix - x0f)
        wy0, wy1, wy2, wy3 = _cubic_weights(iy - y0f)
        x0 = x0f.to(tl.int32)
        y0 = y0f.to(tl.int32)
        r0, g0, b0 = _cubic_row(base, HW, W, tl.minimum(tl.maximum(y0 - 1, 0), H - 1), x0, wx0, wx1, wx2, wx3, live)
        r1, g1, b1 = _cubic_row(base, HW, W, tl.minimum(tl.maximum(y0, 0), H - 1), x0, wx0, wx1, wx2, wx3, live)
        r2, g2, b2 = _cubic_row(base, HW, W, tl.minimum(tl.maximum(y0 + 1, 0), H - 1), x0, wx0, wx1, wx2, wx3, live)
        r3, g3, b3 = _cubic_row(base, HW, W, tl.minimum(tl.maximum(y0 + 2, 0), H - 1), x0, wx0, wx1, wx2, wx3, live)
        r = r0 * wy0 + r1 * wy1 + r2 * wy2 + r3 * wy3
        g = g0 * wy0 + g1 * wy1 + g2 * wy2 + g3 * wy3
        b = b0 * wy0 + b1 * wy1 + b2 * wy2 + b3 * wy3
    else:
        ix = tl.minimum(tl.maximum(ix, 0.0), W - 1.0)  # border padding clips the source point
        iy = tl.minimum(tl.maximum(iy, 0.0), H - 1.0)
        if op == _AFFINE_NEAREST:
            r, g, b = _tap(base, HW, W, _round_half_even(iy).to(tl.int32), _round_half_even(ix).to(tl.int32), live)
        else:
            x0f = tl.floor(ix)
            y0f = tl.floor(iy)
            x0 = x0f.to(tl.int32)
            y0 = y0f.to(tl.int32)
            x1 = tl.minimum(x0 + 1, W - 1)  # past the edge the weight is 0
            y1 = tl.minimum(y0 + 1, H - 1)
            nw = (x0f + 1.0 - ix) * (y0f + 1.0 - iy)
            ne = (ix - x0f) * (y0f + 1.0 - iy)
            sw = (x0f + 1.0 - ix) * (iy - y0f)
            se = (ix - x0f) * (iy - y0f)
            rn, gn, bn = _tap(base, HW, W, y0, x0, live)
            re, ge, be = _tap(base, HW, W, y0, x1, live)
            rs, gs, bs = _tap(base, HW, W, y1, x0, live)
            rt, gt, bt = _tap(base, HW, W, y1, x1, live)
            r = rn * nw + re * ne + rs * sw + rt * se
            g = gn * nw + ge * ne + gs * sw + gt * se
            b = bn * nw + be * ne + bs * sw + bt * se
    r = tl.where(inside, r, tl.load(fill_ptr))
    g = tl.where(inside, g, tl.load(fill_ptr + 1))
    b = tl.where(inside, b, tl.load(fill_ptr + 2))
    return (tl.minimum(tl.maximum(r, 0.0), 255.0).to(tl.int32), tl.minimum(tl.maximum(g, 0.0), 255.0).to(tl.int32),
            tl.minimum(tl.maximum(b, 0.0), 255.0).to(tl.int32))


@triton.jit
def _smooth(base, HW, W, at, v, interior):
    """PIL's SMOOTH filter (3x3, centre 5, / 13, rounded: exactly (2 s + 13) // 26 of the integer sum s) inside the
    image's border ring; the ring keeps its pixels."""
    s = 5 * v
    for dy in tl.static_range(-1, 2):
        for dx in tl.static_range(-1, 2):
            if dy != 0 or dx != 0:
                s += tl.load(base + at + dy * W + dx, mask=interior, other=0).to(tl.int32)
    return tl.where(interior, (2 * s + 13) // 26, v)


@triton.jit
def layer_apply_kernel(x_ptr, out_ptr, ops_ptr, args_ptr, acc_ptr, lut_ptr, fill_ptr, H, W,
                       BLOCK: tl.constexpr):
    img = tl.program_id(0)
    HW = H * W
    at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = at < HW
    op = tl.load(ops_ptr + img)
    base = x_ptr + img.to(tl.int64) * 3 * HW
    args = args_ptr + img * _ARGS
    a0 = tl.load(args)
    r = tl.load(base + at, mask=live, other=0).to(tl.int32)
    g = tl.load(base + HW + at, mask=live, other=0).to(tl.int32)
    b = tl.load(base + 2 * HW + at, mask=live, other=0).to(tl.int32)
    if op == _INVERT:
        r, g, b = 255 - r, 255 - g, 255 - b
    elif op == _POSTERIZE:
        keep = a0.to(tl.int32)
        r, g, b = r & keep, g & keep, b & keep
    elif op == _SOLARIZE:
        r = tl.where(r.to(tl.float32) >= a0, 255 - r, r)
        g = tl.where(g.to(tl.float32) >= a0, 255 - g, g)
        b = tl.where(b.to(tl.float32) >= a0, 255 - b, b)
    elif op == _SOLARIZE_ADD:
        add = a0.to(tl.int32)
        r = tl.where(r < 128, tl.minimum(r + add, 255), r)
        g = tl.where(g < 128, tl.minimum(g + add, 255), g)
        b = tl.where(b < 128, tl.minimum(b + add, 255), b)
    elif op == _BRIGHTNESS:
        zero = tl.zeros_like(r)
        r, g, b = _blend(zero, r, a0), _blend(zero, g, a0), _blend(zero, b, a0)
    elif op == _COLOR:
        d = _grey(r, g, b)
        r, g, b = _blend(d, r, a0), _blend(d, g, a0), _blend(d, b, a0)
    elif op == _CONTRAST:
        # the grey mean divided exactly, as the reference's mean (HW + 0 * img: a tensor, as div_rn needs)
        mean = tl.math.div_rn(tl.load(acc_ptr + img * _ACC + _GREY).to(tl.float32), (HW + 0 * img).to(tl.float32))
        d = tl.floor(mean + 0.5)
        r, g, b = _blend(d, r, a0), _blend(d, g, a0), _blend(d, b, a0)
    elif op == _SHARPNESS:
        y = at // W
        x = at - y * W
        interior = live & (y > 0) & (y < H - 1) & (x > 0) & (x < W - 1)
        r = _blend(_smooth(base, HW, W, at, r, interior), r, a0)
        g = _blend(_smooth(base + HW, HW, W, at, g, interior), g, a0)
        b = _blend(_smooth(base + 2 * HW, HW, W, at, b, interior), b, a0)
    elif op == _AUTOCONTRAST:
        r = _stretch(r, acc_ptr + img * _ACC)
        g = _stretch(g, acc_ptr + img * _ACC + 1)
        b = _stretch(b, acc_ptr + img * _ACC + 2)
    elif op == _EQUALIZE:
        lut = lut_ptr + img * 3 * 256
        r = tl.load(lut + r, mask=live, other=0).to(tl.int32)
        g = tl.load(lut + 256 + g, mask=live, other=0).to(tl.int32)
        b = tl.load(lut + 512 + b, mask=live, other=0).to(tl.int32)
    elif op != _IDENTITY:
        y = at // W
        r, g, b = _affine(base, args, fill_ptr, op, y, at - y * W, H, W, live)
    out = out_ptr + img.to(tl.int64) * 3 * HW
    tl.store(out + at, r.to(tl.uint8), mask=live)
    tl.store(out + HW + at, g.to(tl.uint8), mask=live)
    tl.store(out + 2 * HW + at, b.to(tl.uint8), mask=live)


@triton.jit
def _stretch(v, acc):
    """PIL's autocontrast of one channel (acc: its image's statistics row, offset by the channel): [min, max] to
    [0, 255], truncated; a constant channel is kept."""
    lo = (255 - tl.load(acc + _MIN)).to(tl.float32)
    hi = tl.load(acc + _MAX).to(tl.float32)
    flat = hi <= lo
    # PyTorch evaluates the reference's 255.0 / d as reciprocal(d) * 255: the same two roundings here
    scale = tl.where(flat, 1.0, tl.math.div_rn(hi * 0.0 + 1.0, tl.maximum(hi - lo, 1.0)) * 255.0)
    lo = tl.where(flat, 0.0, lo)
    return tl.minimum(tl.maximum((v.to(tl.float32) - lo) * scale, 0.0), 255.0).to(tl.int32)


def augment_layer(x: torch.Tensor, ops: torch.Tensor, args: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """One layer: image k of the (n, 3, H, W) uint8 batch x gets op ``ops[k]`` (int32, the ids above) with arguments
    ``args[k]`` ((n, ARGS) fp32); ``fill`` (3,) fp32 is the colour of affine sources outside the image. A new
    uint8 batch; all tensors on x's device."""
    if x.dim() != 4 or x.shape[1] != 3 or x.dtype != torch.uint8:
        raise ValueError(f"augment_layer takes (n, 3, H, W) uint8 batches, got {tuple(x.shape)} {x.dtype}")
    n, _, h, w = x.shape
    if h * w * 255 >= 2**31:
        raise ValueError(f"augment_layer takes images of under 8.4M pixels (int32 sums), got {h}x{w}")
    if any(t.device != x.device for t in (ops, args, fill)) or fill.shape != (3,) or fill.dtype != torch.float32:
        raise ValueError(f"augment_layer needs ops, args and a (3,) float32 fill on the batch's device ({x.device})")
    if ops.shape != (n,) or ops.dtype != torch.int32 or args.shape != (n, ARGS) or args.dtype != torch.float32:
        raise ValueError(f"augment_layer needs ops ({n},) int32 and args ({n}, {ARGS}) float32, got "
                         f"{tuple(ops.shape)} {ops.dtype} and {tuple(args.shape)} {args.dtype}")
    x = x.contiguous()
    blocks = cdiv(h * w, BLOCK)
    acc = torch.zeros((n, ACC), dtype=torch.int32, device=x.device)
    lut = torch.empty((n, 3, 256), dtype=torch.uint8, device=x.device)
    launch_direct(layer_stats_kernel, (n, blocks), x, ops, acc, h * w, BLOCK=BLOCK)
    launch_direct(layer_lut_kernel, (n,), ops, acc, lut, h * w)
    out = torch.empty_like(x)
    # the interpreter runs a program's block as one numpy operation: few large ones
    block, warps = (BLOCK, 4) if interpreting() else (APPLY_BLOCK, APPLY_WARPS)
    launch_direct(layer_apply_kernel, (n, cdiv(h * w, block)), x, out, ops, args.contiguous(), acc, lut, fill,
                  h, w, BLOCK=block, num_warps=warps)
    return out
