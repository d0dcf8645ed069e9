"""Training and evaluation transforms of whole batches on the device, for ``data.decode=gpu`` (swin.data.gpu.decode).

The CPU path (timm's ``create_transform`` in the loader workers) transforms one PIL image at a time. Here the
host draws every random choice of a batch at once (numpy, a generator seeded per batch): RandomResizedCrop boxes,
flips, and for each image its RandAugment ops and magnitudes (or colour-jitter factors). The device then

1. crops and resizes every decoded image to the model's size (the images have different sizes), antialiased as PIL
   resizes, rounded to uint8 as PIL stores it, and mirrors the images drawn for a flip: swin.data.gpu.crop_resize, two
   launches for the batch (the PyTorch path flips the uint8 batch after the crops);
2. runs each augmentation layer over the whole batch in four launches (swin.data.gpu.rand_augment: each image's op and
   arguments come from a table).

The same steps in PyTorch ops (``TrainTransform(kernels=False)``, the default on the CPU without the Triton
interpreter) are the reference the kernels are tested against: one F.interpolate per image, and per layer the batch
reordered so that the images drawing the same op are contiguous, each op run once on its slice (one grid_sample for
all rotations, shears and translations), the original order restored: a few dozen kernels per layer.

Op semantics follow timm's PIL RandAugment (``rand-m9-mstd0.5-inc1``: the same 15 ops, levels, per-op probability,
magnitude noise and random signs, uint8 between ops, PIL's truncating blends); where the result differs from PIL,
docs/data.md says how and why that is acceptable. Evaluation: resize of the shorter side to
``floor(size / crop_pct)`` and a centre crop, as timm's eval transform.
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kernels.ops import interpreting
from swin.config import ImageFolderDataConfig
from swin.data.gpu.crop_resize import YCbCrImage, crop_resize, crop_resize_packed
from swin.data.gpu.rand_augment import (
    AFFINE_BICUBIC,
    AFFINE_BILINEAR,
    AFFINE_NEAREST,
    ARGS,
    AUTOCONTRAST,
    BRIGHTNESS,
    COLOR,
    CONTRAST,
    EQUALIZE,
    IDENTITY,
    INVERT,
    NUM_OPS,
    POSTERIZE,
    SHARPNESS,
    SOLARIZE,
    SOLARIZE_ADD,
    augment_layer,
)

# resize modes by index (per image with interpolation=random); nearest-exact is PIL's nearest
MODES = ("bilinear", "bicubic", "nearest-exact")
_MODE_OF = {"bilinear": 0, "bicubic": 1, "nearest": 2}
INTERPOLATIONS = ("bilinear", "bicubic", "nearest", "random")

# Device op ids and their arguments (ARGS floats per image and layer: a factor / threshold / mask in [0], or a 2x3
# affine matrix) are the fused kernel's (rand_augment). The PyTorch path sorts a layer's images by op id, so
# every op works on one contiguous slice; the three affine ids (one per grid_sample mode) hold rotations, shears and
# translations as per-image matrices.
_AFFINE_MODES = {AFFINE_BILINEAR: "bilinear", AFFINE_BICUBIC: "bicubic", AFFINE_NEAREST: "nearest"}

# RandAugment's op set (the paper's, as timm names it); 'inc1' swaps in the variants whose severity grows
# with the magnitude for Posterize, Solarize and the four enhancements
RA_OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd", "Color",
          "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")
LEVEL_MAX = 10.0  # magnitudes are on a 0..10 scale
TRANSLATE_PCT = 0.45  # timm's default relative translation at magnitude 10


@dataclass
class PackedImages:
    """Decoded images back to back in one flat uint8 tensor, each (H_i, W_i, 3) contiguous (as libjpeg-turbo
    decodes: packing is a plain copy), ``shapes[i] = (H_i, W_i)``: what loader workers that decode on the CPU send
    (data.augment=gpu): one buffer to pin and copy to the device, read as it is by the crop kernel. The transforms
    take it wherever they take a list of (3, H, W) images."""

    pixels: torch.Tensor
    shapes: np.ndarray  # (n, 2) int64

    @classmethod
    def pack(cls, images: Sequence[torch.Tensor], shared: bool = False) -> PackedImages:
        """The (3, H, W) uint8 ``images`` copied into one new buffer, in shared memory with ``shared`` (what a loader
        worker sends: sending it would otherwise copy it there); fastest when their memory is (H, W, 3), as
        torchvision decodes."""
        shapes = np.array([img.shape[-2:] for img in images], dtype=np.int64).reshape(len(images), 2)
        counts = 3 * shapes[:, 0] * shapes[:, 1]
        pixels = torch.empty(int(counts.sum()), dtype=torch.uint8)
        if shared and len(images):
            pixels.share_memory_()
        for img, part, (h, w) in zip(images, pixels.split(counts.tolist()), shapes.tolist()):
            part.view(h, w, 3).copy_(img.permute(1, 2, 0))
        return cls(pixels, shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def sizes(self) -> list[tuple[int, int]]:
        return [(h, w) for h, w in self.shapes.tolist()]

    def unpack(self) -> list[torch.Tensor]:
        """The images as (3, H, W) views of ``pixels`` (channels-last strides)."""
        counts = (3 * self.shapes[:, 0] * self.shapes[:, 1]).tolist()
        return [part.view(h, w, 3).permute(2, 0, 1)
                for part, (h, w) in zip(self.pixels.split(counts), self.shapes.tolist())]

    def pin_memory(self) -> PackedImages:
        return PackedImages(self.pixels.pin_memory(), self.shapes)

    def to(self, device: torch.device, non_blocking: bool = False) -> PackedImages:
        return PackedImages(self.pixels.to(device, non_blocking=non_blocking), self.shapes)


def ycbcr_to_rgb(img: YCbCrImage) -> torch.Tensor:
    """(3, H, W) uint8 RGB of a JPEG's planes for the PyTorch path: chroma upsampled bilinearly (JPEG's centred
    siting), JFIF's conversion, rounded. The kernels instead resample each plane straight to the crop."""
    (height, width), (sv, sh) = img.y.shape, img.shifts()
    chroma = torch.stack([img.cb, img.cr])[None].float()
    chroma = F.interpolate(chroma, scale_factor=(2**sv, 2**sh), mode="bilinear", align_corners=False)
    cb, cr = (chroma[0, :, :height, :width] - 128).unbind()
    y = img.y.float()
    rgb = torch.stack([y + 1.402 * cr, y - 0.344136286 * cb - 0.714136286 * cr, y + 1.772 * cb])
    return rgb.round_().clamp_(0, 255).to(torch.uint8)


def image_sizes(images: Sequence[torch.Tensor | YCbCrImage] | PackedImages) -> list[tuple[int, int]]:
    """(height, width) of each image of a batch."""
    return images.sizes() if isinstance(images, PackedImages) else [tuple(i.shape[-2:]) for i in images]


# --- configuration -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RandAugmentSpec:
    """A parsed ``rand-...`` string: m (magnitude), n (layers), p (probability per layer), mstd (magnitude noise;
    > 100 means uniform in [0, m]), mmax (magnitude clip), inc (increasing-severity ops)."""

    magnitude: float = 10.0
    num_layers: int = 2
    prob: float = 0.5
    magnitude_std: float = 0.0
    magnitude_max: float = LEVEL_MAX
    increasing: bool = False


def parse_rand_augment(config: str) -> RandAugmentSpec:
    """timm's ``rand-m9-mstd0.5-inc1`` syntax; anything the device ops do not implement is a ValueError."""
    parts = config.split("-")
    if parts[0] != "rand":
        raise ValueError(f"data.auto_augment={config!r} is not supported with data.decode=gpu: only RandAugment "
                         "strings (rand-m9-mstd0.5-inc1 style) run on the device; use data.decode=cpu for it")
    values: dict[str, Any] = {}
    for part in parts[1:]:
        m = re.fullmatch(r"(mstd|mmax|inc|m|n|p)(\d[\d.]*)", part)
        if m is None:
            raise ValueError(f"data.auto_augment={config!r}: section {part!r} is not supported with data.decode=gpu "
                             "(supported: m, n, p, mstd, mmax, inc); use data.decode=cpu for it")
        key, val = m.groups()
        if key == "mstd":
            std = float(val)
            values["magnitude_std"] = math.inf if std > 100 else std
        elif key == "mmax":
            values["magnitude_max"] = float(int(val))
        elif key == "inc":
            values["increasing"] = bool(int(val))
        elif key == "m":
            values["magnitude"] = float(int(val))
        elif key == "n":
            values["num_layers"] = int(val)
        else:
            values["prob"] = float(val)
    return RandAugmentSpec(**values)


@dataclass(frozen=True)
class TrainSpec:
    """What the training transform does, from the data config (the same keys timm's create_transform reads)."""

    size: tuple[int, int]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    interpolation: str = "bicubic"
    rand_augment: RandAugmentSpec | None = None
    color_jitter: tuple[float, float, float] | None = None  # brightness, contrast, saturation
    fill: tuple[int, int, int] = (124, 116, 104)  # RandAugment's affine fill: the dataset mean in 0..255
    ycbcr: bool = False  # decode to the files' YCbCr planes on the JPEG engines; the crop kernels convert to RGB


@dataclass(frozen=True)
class EvalSpec:
    size: int
    crop_pct: float = 0.875
    interpolation: str = "bicubic"


def _pair(v: Any) -> tuple[int, int]:
    return (int(v), int(v)) if isinstance(v, (int, float)) else (int(v[0]), int(v[1]))


def transform_shape(transform: TrainTransform | EvalTransform) -> tuple[int, int, int]:
    """The (channels, height, width) of one image out of `transform` (RGB: nvJPEG and the CPU fallback decode
    every file to 3 channels)."""
    return 3, *_pair(transform.spec.size)


def _check_interpolation(name: Any) -> str:
    if name not in INTERPOLATIONS:
        raise ValueError(f"data.interpolation={name!r} is not supported with data.decode=gpu; use one of "
                         f"{', '.join(INTERPOLATIONS)}")
    return name


def _jitter(cfg: ImageFolderDataConfig) -> tuple[float, float, float] | None:
    cj = cfg.color_jitter
    if cj is None or cfg.auto_augment:  # timm turns colour jitter off when RandAugment is on
        return None
    if isinstance(cj, (int, float)):
        cj = (float(cj),) * 3
    cj = tuple(float(v) for v in cj)
    if len(cj) == 4 and cj[3] > 0 or len(cj) not in (3, 4):
        raise ValueError(f"data.color_jitter={list(cj)}: data.decode=gpu jitters brightness, contrast and saturation "
                         "(give one number or three); hue jitter needs data.decode=cpu")
    return cj[:3] if any(cj[:3]) else None


def train_spec(cfg: ImageFolderDataConfig, img_size: int | Sequence[int]) -> TrainSpec:
    """The training transform of a folder data config (ValueError naming the data.* key it cannot do)."""
    aa = cfg.auto_augment
    mean = cfg.mean
    return TrainSpec(size=_pair(img_size), scale=tuple(cfg.scale), ratio=tuple(cfg.ratio), hflip=float(cfg.hflip),
                     interpolation=_check_interpolation(cfg.interpolation),
                     rand_augment=parse_rand_augment(aa) if aa else None, color_jitter=_jitter(cfg),
                     fill=tuple(min(255, round(255 * m)) for m in mean), ycbcr=cfg.gpu_ycbcr)


def eval_spec(cfg: ImageFolderDataConfig, img_size: int | Sequence[int]) -> EvalSpec:
    size = _pair(img_size)
    if size[0] != size[1]:
        raise ValueError(f"data.decode=gpu evaluates square images only (model.img_size={list(size)}); "
                         "use data.decode=cpu")
    if not 0 < cfg.crop_pct <= 1:
        raise ValueError(f"data.crop_pct={cfg.crop_pct}: data.decode=gpu needs 0 < crop_pct <= 1 (no padding); "
                         "use data.decode=cpu")
    interpolation = _check_interpolation(cfg.interpolation)
    # 'random' is a training choice; timm's eval transform has no such mode (the CPU path raises on it)
    return EvalSpec(size[0], float(cfg.crop_pct), "bicubic" if interpolation == "random" else interpolation)


# --- host side: the random choices of a batch -----------------------------------------------------------------
def sample_crop_boxes(sizes: np.ndarray, scale: Sequence[float], ratio: Sequence[float], rng: np.random.Generator,
                      attempts: int = 10) -> np.ndarray:
    """RandomResizedCrop boxes ``(top, left, height, width)`` for images of ``sizes`` (B, 2) = (height, width).

    The Inception-style rule that torchvision's and timm's ``get_params`` implement, drawn for the whole batch at
    once: up to 10 attempts of an area fraction uniform in ``scale`` and a log-uniform aspect ratio in ``ratio``;
    the first box that fits gets a uniform position; images where none fits get the largest centred box whose
    aspect ratio is clamped into ``ratio``."""
    sizes = np.asarray(sizes, dtype=np.int64).reshape(-1, 2)
    n = len(sizes)
    height, width = sizes[:, :1], sizes[:, 1:]
    area = (height * width).astype(np.float64)
    target = area * rng.uniform(scale[0], scale[1], (n, attempts))
    aspect = np.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1]), (n, attempts)))
    w = np.round(np.sqrt(target * aspect)).astype(np.int64)
    h = np.round(np.sqrt(target / aspect)).astype(np.int64)
    fits = (w > 0) & (h > 0) & (w <= width) & (h <= height)
    first = fits.argmax(axis=1)
    rows = np.arange(n)
    bw, bh = w[rows, first], h[rows, first]
    found = fits[rows, first]
    # fallback: the whole image, its aspect ratio clamped into `ratio` (as get_params)
    H, W = sizes[:, 0], sizes[:, 1]
    in_ratio = W / H
    fw = np.where(in_ratio > max(ratio), np.round(H * max(ratio)).astype(np.int64), W)
    fh = np.where(in_ratio < min(ratio), np.round(W / min(ratio)).astype(np.int64), H)
    bw, bh = np.where(found, bw, fw), np.where(found, bh, fh)
    u = rng.random((n, 2))  # positions, uniform over every valid offset
    top = np.where(found, np.minimum((u[:, 0] * (H - bh + 1)).astype(np.int64), H - bh), (H - bh) // 2)
    left = np.where(found, np.minimum((u[:, 1] * (W - bw + 1)).astype(np.int64), W - bw), (W - bw) // 2)
    return np.stack([top, left, bh, bw], axis=1)


def _affine_theta(m: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """(n, 2, 3) pixel-space maps output -> input (pixel centres at i + 0.5, PIL's convention) as affine_grid's
    normalised thetas (align_corners=False)."""
    h, w = size
    to_pixels = np.array([[w / 2, 0, w / 2], [0, h / 2, h / 2], [0, 0, 1]])
    to_norm = np.array([[2 / w, 0, -1], [0, 2 / h, -1], [0, 0, 1]])
    full = np.concatenate([m, np.broadcast_to([[[0.0, 0.0, 1.0]]], (len(m), 1, 3))], axis=1)
    return (to_norm @ full @ to_pixels)[:, :2]


def _affine_maps(name: str, value: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """PIL's output -> input pixel maps of RandAugment's geometric ops, (n, 2, 3)."""
    h, w = size
    n = len(value)
    m = np.zeros((n, 2, 3))
    m[:, 0, 0] = m[:, 1, 1] = 1.0
    if name == "Rotate":  # Image.rotate: counter-clockwise by `value` degrees about the image centre
        t = -np.radians(value)
        cos, sin = np.cos(t), np.sin(t)
        m[:, 0, 0], m[:, 0, 1], m[:, 1, 0], m[:, 1, 1] = cos, sin, -sin, cos
        cx, cy = w / 2, h / 2
        m[:, 0, 2] = cx - (cos * cx + sin * cy)
        m[:, 1, 2] = cy - (-sin * cx + cos * cy)
    elif name == "ShearX":
        m[:, 0, 1] = value
    elif name == "ShearY":
        m[:, 1, 0] = value
    elif name == "TranslateXRel":
        m[:, 0, 2] = value * w
    elif name == "TranslateYRel":
        m[:, 1, 2] = value * h
    return m


def rand_augment_args(name: str, level: np.ndarray, sign: np.ndarray, increasing: bool,
                      size: tuple[int, int]) -> tuple[int, np.ndarray]:
    """Device op id and (n, ARGS) arguments of RandAugment op ``name`` at magnitudes ``level`` (0..10 scale)
    with random signs ``sign`` (+-1, used by the signed ops). Affine ops return the pixel-space matrix; the caller
    picks the affine op id by interpolation mode."""
    frac = level / LEVEL_MAX
    args = np.zeros((len(level), ARGS))
    if name in ("AutoContrast", "Equalize", "Invert"):
        return {"AutoContrast": AUTOCONTRAST, "Equalize": EQUALIZE, "Invert": INVERT}[name], args
    if name == "Posterize":  # bits kept: 0..4 (more with magnitude), or 4..0 with inc
        bits = (frac * 4).astype(np.int64)
        bits = np.clip(4 - bits if increasing else bits, 0, 8)
        args[:, 0] = 256 - 2.0 ** (8 - bits)  # the uint8 mask that keeps `bits` high bits
        return POSTERIZE, args
    if name == "Solarize":  # pixels >= threshold are inverted
        thresh = np.minimum(256, (frac * 256).astype(np.int64))
        args[:, 0] = 256 - thresh if increasing else thresh
        return SOLARIZE, args
    if name == "SolarizeAdd":  # pixels < 128 get + add
        args[:, 0] = np.minimum(128, (frac * 110).astype(np.int64))
        return SOLARIZE_ADD, args
    if name in ("Color", "Contrast", "Brightness", "Sharpness"):  # blend factor, 1 = unchanged
        args[:, 0] = np.maximum(0.1, 1.0 + sign * frac * 0.9) if increasing else frac * 1.8 + 0.1
        return {"Color": COLOR, "Contrast": CONTRAST, "Brightness": BRIGHTNESS, "Sharpness": SHARPNESS}[name], args
    value = sign * frac * {"Rotate": 30.0, "ShearX": 0.3, "ShearY": 0.3, "TranslateXRel": TRANSLATE_PCT,
                           "TranslateYRel": TRANSLATE_PCT}[name]
    args[:] = _affine_theta(_affine_maps(name, value, size), size).reshape(-1, ARGS)
    return AFFINE_BILINEAR, args


def _layer_rand_augment(spec: RandAugmentSpec, n: int, size: tuple[int, int], interpolation: str,
                        rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One RandAugment layer for n images: op ids (n,) and arguments (n, ARGS)."""
    choice = rng.integers(0, len(RA_OPS), n)  # uniform, independently per image (and layer)
    applied = rng.random(n) < spec.prob
    if spec.magnitude_std == math.inf:
        level = rng.uniform(0, spec.magnitude, n)
    elif spec.magnitude_std > 0:
        level = rng.normal(spec.magnitude, spec.magnitude_std, n)
    else:
        level = np.full(n, spec.magnitude)
    level = np.clip(level, 0.0, spec.magnitude_max)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    if interpolation == "random":  # timm draws bilinear or bicubic per op call
        affine = np.where(rng.random(n) < 0.5, AFFINE_BILINEAR, AFFINE_BICUBIC)
    else:
        affine = np.full(n, {"bilinear": AFFINE_BILINEAR, "bicubic": AFFINE_BICUBIC,
                             "nearest": AFFINE_NEAREST}[interpolation])
    ops = np.full(n, IDENTITY)
    args = np.zeros((n, ARGS))
    for k, name in enumerate(RA_OPS):
        sel = (choice == k) & applied
        if not sel.any():
            continue
        op, a = rand_augment_args(name, level[sel], sign[sel], spec.increasing, size)
        ops[sel] = affine[sel] if op == AFFINE_BILINEAR else op
        args[sel] = a
    return ops, args


def _layers_color_jitter(jitter: tuple[float, float, float], n: int,
                         rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """torchvision's ColorJitter(brightness, contrast, saturation): a factor uniform in [max(0, 1 - j), 1 + j] per
    component, the components applied in a random order per image: three layers, one position each."""
    comps = [(op, j) for op, j in zip((BRIGHTNESS, CONTRAST, COLOR), jitter) if j > 0]
    factors = np.stack([rng.uniform(max(0.0, 1 - j), 1 + j, n) for _, j in comps], axis=1)
    order = np.argsort(rng.random((n, len(comps))), axis=1)  # a random permutation per image
    layers = []
    for pos in range(len(comps)):
        which = order[:, pos]
        args = np.zeros((n, ARGS))
        args[:, 0] = factors[np.arange(n), which]
        layers.append((np.array([comps[c][0] for c in which]), args))
    return layers


@dataclass
class BatchPlan:
    """The random choices of one training batch, made on the host."""

    boxes: np.ndarray  # (B, 4): top, left, height, width in the decoded image
    modes: np.ndarray  # (B,): resize mode index into MODES
    flips: np.ndarray  # (B,): bool
    layers: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # per layer: op ids, args


def plan_batch(spec: TrainSpec, sizes: Sequence[tuple[int, int]], rng: np.random.Generator) -> BatchPlan:
    """Every random choice of a training batch whose decoded images have ``sizes`` (height, width)."""
    n = len(sizes)
    boxes = sample_crop_boxes(np.asarray(sizes), spec.scale, spec.ratio, rng)
    if spec.interpolation == "random":
        modes = rng.integers(0, 2, n)
    else:
        modes = np.full(n, _MODE_OF[spec.interpolation])
    flips = rng.random(n) < spec.hflip
    layers = []
    if spec.rand_augment is not None:
        layers = [_layer_rand_augment(spec.rand_augment, n, spec.size, spec.interpolation, rng)
                  for _ in range(spec.rand_augment.num_layers)]
    elif spec.color_jitter is not None:
        layers = _layers_color_jitter(spec.color_jitter, n, rng)
    return BatchPlan(boxes, modes, flips, layers)


# --- device side: ops on uint8 batches (n, 3, H, W) with per-image arguments a (n, ARGS) -------------------------
def _col(v: torch.Tensor) -> torch.Tensor:
    return v.view(-1, 1, 1, 1)


def _grey(x: torch.Tensor) -> torch.Tensor:
    """PIL's RGB -> L conversion, exactly (fixed-point ITU-R 601-2 luma, rounded): (n, 1, H, W) int32."""
    xi = x.to(torch.int32)
    return (xi[:, 0:1] * 19595 + xi[:, 1:2] * 38470 + xi[:, 2:3] * 7471 + 32768) >> 16


def _blend(degenerate: torch.Tensor, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL's ImageEnhance: degenerate + factor (image - degenerate) in float, clipped, truncated to uint8."""
    d = degenerate.float()
    return (d + _col(factor) * (x.float() - d)).clamp_(0, 255).to(torch.uint8)


def _sharpness(x: torch.Tensor, factor: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """Blend with PIL's SMOOTH filter (3x3, centre 5, /13, rounded; border pixels kept)."""
    n, c, h, w = x.shape
    smooth = x.clone()
    if h > 2 and w > 2:
        conv = F.conv2d(x.float().view(n * c, 1, h, w), kernel).view(n, c, h - 2, w - 2)
        smooth[:, :, 1:-1, 1:-1] = conv.add_(0.5).floor_().clamp_(0, 255).to(torch.uint8)
    return _blend(smooth, x, factor)


def _autocontrast(x: torch.Tensor) -> torch.Tensor:
    """PIL's autocontrast (cutoff 0): each channel's [min, max] stretched to [0, 255], truncated."""
    lo = x.amin(dim=(2, 3), keepdim=True).float()
    hi = x.amax(dim=(2, 3), keepdim=True).float()
    flat = hi <= lo  # a constant channel is left as it is
    scale = torch.where(flat, torch.ones_like(lo), 255.0 / (hi - lo).clamp_(min=1))
    lo = torch.where(flat, torch.zeros_like(lo), lo)
    return ((x.float() - lo) * scale).clamp_(0, 255).to(torch.uint8)


def _affine(x: torch.Tensor, theta: torch.Tensor, mode: str, fill: torch.Tensor) -> torch.Tensor:
    """Rotations, shears and translations of the slice in one grid_sample, with PIL's edge rule: a pixel whose
    source point lies outside the image gets ``fill``; inside, the filter clamps its taps at the border."""
    grid = F.affine_grid(theta.view(-1, 2, 3), list(x.shape), align_corners=False)
    out = F.grid_sample(x.float(), grid, mode=mode, padding_mode="border", align_corners=False)
    inside = ((grid >= -1) & (grid < 1)).all(dim=-1, keepdim=True).permute(0, 3, 1, 2)  # source in [0, size)
    return torch.where(inside, out, fill).clamp_(0, 255).to(torch.uint8)  # truncated, as PIL's 8-bit transforms


def apply_op(op: int, x: torch.Tensor, a: torch.Tensor, consts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Device op ``op`` on the uint8 slice ``x`` with per-image arguments ``a`` (n, ARGS); a new uint8 tensor."""
    if op == AUTOCONTRAST:
        return _autocontrast(x)
    if op == EQUALIZE:
        from torchvision.transforms.v2.functional import equalize
        return equalize(x)  # PIL's lookup-table rule, batched per image and channel
    if op == INVERT:
        return x.bitwise_not()
    if op == POSTERIZE:
        return x.bitwise_and(_col(a[:, 0].to(torch.uint8)))
    if op == SOLARIZE:
        return torch.where(x >= _col(a[:, 0]), x.bitwise_not(), x)
    if op == SOLARIZE_ADD:
        added = (x.to(torch.int32) + _col(a[:, 0].to(torch.int32))).clamp_(max=255).to(torch.uint8)
        return torch.where(x < 128, added, x)
    if op == COLOR:
        return _blend(_grey(x).expand_as(x), x, a[:, 0])
    if op == CONTRAST:
        mean = _grey(x).float().mean(dim=(1, 2, 3), keepdim=True).add_(0.5).floor_()
        return _blend(mean, x, a[:, 0])
    if op == BRIGHTNESS:
        return _blend(torch.zeros_like(x[:, :1, :1, :1]), x, a[:, 0])
    if op == SHARPNESS:
        return _sharpness(x, a[:, 0], consts["smooth"])
    if op in _AFFINE_MODES:
        return _affine(x, a, _AFFINE_MODES[op], consts["fill"])
    raise ValueError(f"unknown op {op}")


def resized_crops(images: Sequence[torch.Tensor], boxes: np.ndarray, modes: np.ndarray,
                  size: tuple[int, int]) -> torch.Tensor:
    """Crop ``boxes`` (top, left, height, width) out of each (3, H_i, W_i) uint8 image and resize to ``size``
    (antialiased like PIL, except nearest): a (B, 3, *size) uint8 batch, rounded. One F.interpolate per image: the
    PyTorch path and the reference of swin.data.gpu.crop_resize (TrainTransform's kernels, which do the batch in two
    launches; on CUDA within 1 level of this on under 1% of values: test_gpu_crop_resize_matches_...)."""
    out = []
    for img, (top, left, h, w), m in zip(images, boxes.tolist(), modes.tolist()):
        crop = img[None, :, top:top + h, left:left + w].float()
        mode = MODES[m]
        nearest = mode == "nearest-exact"
        out.append(F.interpolate(crop, size=size, mode=mode, antialias=not nearest,
                                 align_corners=None if nearest else False))
    return torch.cat(out).round_().clamp_(0, 255).to(torch.uint8)


def _pack(plan: BatchPlan) -> tuple[np.ndarray, list[tuple[int, int, np.ndarray]], int, int]:
    """One float32 array with everything the device needs (one host-to-device copy per batch): the flips, and per
    layer the order that groups its ops (gather indices) and the arguments in that order; then the inverse order.
    Returns the array, per layer (perm offset, args offset, op counts), the flip offset and the inverse offset."""
    n = len(plan.flips)
    rows: list[np.ndarray] = [plan.flips.astype(np.float32)]
    offset = n
    layout = []
    current = np.arange(n)  # current[k]: the image now at position k
    for ops, args in plan.layers:
        perm = np.argsort(ops[current], kind="stable")
        current = current[perm]
        layout.append((offset, offset + n, np.bincount(ops[current], minlength=NUM_OPS)))
        rows += [perm.astype(np.float32), args[current].astype(np.float32).reshape(-1)]
        offset += n + n * ARGS
    rows.append(np.argsort(current).astype(np.float32))
    return np.concatenate(rows), layout, 0, offset


def indexed(device: torch.device | str) -> torch.device:
    """``cuda`` as ``cuda:<current device>``: tensors report an index (constants cached per device must match), and
    torch.cuda.set_device refuses a device without one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(array)
    if device.type == "cuda":  # pinned (the caching host allocator keeps it until the copy is done): asynchronous
        return t.pin_memory().to(device, non_blocking=True)
    return t


class TrainTransform:
    """RandomResizedCrop, flip and RandAugment (or colour jitter) of decoded images into a uint8 batch on the
    images' device. ``plan`` draws the random choices on the host; ``apply`` runs them; ``to(device)`` makes the
    constants once (a tensor made from host values inside the loop would synchronise with the device).

    ``kernels``: the crops in crop_resize and each augmentation layer in rand_augment, a handful of
    launches per batch (CUDA, or the CPU under the Triton interpreter: the default there), instead of per-image
    F.interpolate calls and per-op slices (about a hundred launches per batch, each costing host time; the PyTorch
    path, the reference the kernels are tested against)."""

    def __init__(self, spec: TrainSpec, kernels: bool | None = None):
        self.spec, self.kernels = spec, kernels
        self._consts: dict[torch.device, dict[str, torch.Tensor]] = {}

    def to(self, device: torch.device) -> TrainTransform:
        device = indexed(device)
        if device not in self._consts:
            smooth = torch.tensor([[1.0, 1.0, 1.0], [1.0, 5.0, 1.0], [1.0, 1.0, 1.0]]) / 13
            self._consts[device] = {"smooth": smooth.view(1, 1, 3, 3).to(device),
                                    "fill": torch.tensor(self.spec.fill, dtype=torch.float32).view(1, 3, 1, 1)
                                    .to(device)}
        return self

    def __getstate__(self) -> dict[str, Any]:
        # the dataset holds this transform: loader workers started by spawn/forkserver get it pickled, and must not
        # receive (and initialise CUDA for) the device constants
        return {**self.__dict__, "_consts": {}}

    def plan(self, sizes: Sequence[tuple[int, int]], rng: np.random.Generator) -> BatchPlan:
        return plan_batch(self.spec, sizes, rng)

    def uses_kernels(self, device: torch.device) -> bool:
        return self.kernels if self.kernels is not None else (device.type == "cuda" or interpreting())

    def apply(self, images: Sequence[torch.Tensor | YCbCrImage] | PackedImages, plan: BatchPlan) -> torch.Tensor:
        device = images.pixels.device if isinstance(images, PackedImages) else images[0].device
        if self.uses_kernels(device):
            return self._apply_kernels(images, plan)
        consts = self.to(device)._consts[device]
        if isinstance(images, PackedImages):
            images = images.unpack()
        images = [ycbcr_to_rgb(img) if isinstance(img, YCbCrImage) else img for img in images]
        x = resized_crops(images, plan.boxes, plan.modes, self.spec.size)
        if not plan.flips.any() and not plan.layers:
            return x
        packed, layout, flip_at, inverse_at = _pack(plan)
        params = _to_device(packed, device)
        n = x.shape[0]
        if plan.flips.any():
            x = torch.where(_col(params[flip_at:flip_at + n] > 0.5), x.flip(-1), x)
        for perm_at, args_at, counts in layout:
            x = x[params[perm_at:perm_at + n].long()]
            args = params[args_at:args_at + n * ARGS].view(n, ARGS)
            start = 0
            for op, count in enumerate(counts.tolist()):
                if count and op != IDENTITY:
                    x[start:start + count] = apply_op(op, x[start:start + count], args[start:start + count], consts)
                start += count
        if layout:
            x = x[params[inverse_at:inverse_at + n].long()]
        return x

    def _apply_kernels(self, images: Sequence[torch.Tensor | YCbCrImage] | PackedImages, plan: BatchPlan
                       ) -> torch.Tensor:
        """apply() in kernels: crops and flips (two launches), and per layer four launches whatever its ops."""
        if any(((ops < 0) | (ops >= NUM_OPS)).any() for ops, _ in plan.layers):
            raise ValueError(f"augmentation op ids must lie in 0..{NUM_OPS - 1}")
        if isinstance(images, PackedImages):
            x = crop_resize_packed(images.pixels, images.shapes, plan.boxes, plan.modes, self.spec.size,
                                   channels_last=True, flips=plan.flips)
        else:
            x = crop_resize(list(images), plan.boxes, plan.modes, self.spec.size, flips=plan.flips)
        if not plan.layers:
            return x
        device = x.device
        fill = self.to(device)._consts[device]["fill"].view(3)
        n = x.shape[0]
        # one host-to-device copy: per layer the op ids (exact in float32) and the arguments
        params = _to_device(np.concatenate([
            np.concatenate([ops.astype(np.float32), args.astype(np.float32).reshape(-1)]) for ops, args in plan.layers
        ]), device)
        for k in range(len(plan.layers)):
            at = k * n * (1 + ARGS)
            x = augment_layer(x, params[at:at + n].to(torch.int32), params[at + n:at + n * (1 + ARGS)].view(n, ARGS),
                              fill)
        return x

    def __call__(self, images: Sequence[torch.Tensor | YCbCrImage] | PackedImages, rng: np.random.Generator
                 ) -> torch.Tensor:
        return self.apply(images, self.plan(image_sizes(images), rng))


def eval_geometry(height: int, width: int, spec: EvalSpec) -> tuple[tuple[int, int], tuple[int, int]]:
    """torchvision's Resize(shorter side = floor(size / crop_pct)) output size and CenterCrop(size)'s top-left."""
    short = math.floor(spec.size / spec.crop_pct)
    if width <= height:
        new_w, new_h = short, int(short * height / width)
    else:
        new_h, new_w = short, int(short * width / height)
    top = int(round((new_h - spec.size) / 2.0))
    left = int(round((new_w - spec.size) / 2.0))
    return (new_h, new_w), (top, left)


def resize_like_pil(img: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """Antialiased resize of a (1, 3, h, w) float image as PIL does it for 8-bit images: a horizontal pass, then a
    vertical one, each rounded and clipped to 0..255 (one float pass instead differs by up to ~5 levels at edges
    where bicubic overshoots; two passes agree with PIL but for 1-level differences on a few pixels in 10,000)."""
    if mode == "nearest-exact":
        return F.interpolate(img, size=size, mode=mode)
    if img.shape[-1] != size[1]:
        img = F.interpolate(img, size=(img.shape[-2], size[1]), mode=mode, antialias=True, align_corners=False)
        img = img.round_().clamp_(0, 255)
    if img.shape[-2] != size[0]:
        img = F.interpolate(img, size=size, mode=mode, antialias=True, align_corners=False).round_().clamp_(0, 255)
    return img


class EvalTransform:
    """timm's evaluation transform of decoded images: resize of the shorter side to floor(size / crop_pct)
    (antialiased, two passes like PIL), centre crop of size x size; a uint8 batch on the images' device."""

    def __init__(self, spec: EvalSpec):
        self.spec = spec

    def to(self, device: torch.device) -> EvalTransform:
        return self

    def __call__(self, images: Sequence[torch.Tensor] | PackedImages, rng: np.random.Generator | None = None
                 ) -> torch.Tensor:
        mode = MODES[_MODE_OF[self.spec.interpolation]]
        s = self.spec.size
        if isinstance(images, PackedImages):
            images = images.unpack()
        out = []
        for img in images:
            (h, w), (top, left) = eval_geometry(img.shape[-2], img.shape[-1], self.spec)
            out.append(resize_like_pil(img[None].float(), (h, w), mode)[:, :, top:top + s, left:left + s])
        return torch.cat(out).to(torch.uint8)


__all__ = ["BatchPlan", "EvalSpec", "EvalTransform", "PackedImages", "RandAugmentSpec", "TrainSpec", "TrainTransform",
           "apply_op", "eval_geometry", "eval_spec", "image_sizes", "indexed", "parse_rand_augment", "plan_batch",
           "rand_augment_args", "resize_like_pil", "resized_crops", "sample_crop_boxes", "train_spec",
           "transform_shape"]
