"""data.decode=gpu (decode, augment): the device pipeline's logic, run on the CPU and checked against
independent references (torchvision's CPU transforms, timm's PIL RandAugment ops, PIL decoding, the decode=cpu
path); GPU tests compare nvJPEG and the CUDA pipeline with CPU decoding and the CPU pipeline.

Images are ImageNet-like JPEGs from scripts/make_imagefolder.py (smooth fields, shapes and grain, quality 90),
drawn afresh on every run (TEST_SEED replays one).
"""
from __future__ import annotations

import io
import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _train_utils import DET, make_cfg, train_inprocess
from conftest import RUN_SEED
from PIL import Image, ImageFilter
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from torch.utils.data import DataLoader

from scripts.make_imagefolder import make_image
from swin.config import to_settings
from swin.data.datasets import build_datasets
from swin.data.folder import CorruptImageError
from swin.data.gpu import augment as ga
from swin.data.gpu.batch_ring import BatchRing
from swin.data.gpu.decode import (
    FILES_PER_CALL_BESIDE_STEP,
    DecodedImageFolder,
    DecodeThread,
    DeviceCollate,
    EncodedImageFolder,
    JpegDecoder,
    collate_decoded,
    collate_encoded,
    engine_planes,
    engines_take,
    files_per_call,
    jpeg_frame,
    nvjpeg_can_decode,
)
from swin.data.loaders import DeviceLoader, ResumableDistributedSampler, _Normalize, build_eval_loader
from swin.train.checks import ConfigError, check_config

STD_LEVELS = 255 * min(IMAGENET_DEFAULT_STD)  # one uint8 level is at most 1 / STD_LEVELS after normalisation


def _rng() -> np.random.Generator:
    return np.random.default_rng(int(torch.randint(0, 2**31, ()).item()))


def _jpeg(img: Image.Image, **save: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", **({"quality": 90} | save))
    return buf.getvalue()


def _pil_rgb(data: bytes) -> torch.Tensor:
    with Image.open(io.BytesIO(data)) as img:
        return torch.from_numpy(np.asarray(img.convert("RGB")).copy()).permute(2, 0, 1)


@pytest.fixture(scope="module")
def photos() -> list[Image.Image]:
    """Eight ImageNet-like RGB images (~500 x 375, both orientations), fresh per run."""
    seeds = np.random.default_rng(RUN_SEED).integers(0, 2**31, 8)
    return [make_image(int(s) % 5, 5, int(s)) for s in seeds]


def _decode_cpu(blobs: list[bytes]) -> list[torch.Tensor]:
    return JpegDecoder(torch.device("cpu"), skip_corrupt=False).device_decode(
        [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs])


def _levels(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.to(torch.int32) - b.to(torch.int32)).abs()


# --- files and headers --------------------------------------------------------------------------------------
def test_jpeg_headers_route_files_nvjpeg_cannot_decode_to_the_cpu(photos):
    img = photos[0]
    w, h = img.size
    png = io.BytesIO()
    img.save(png, format="PNG")
    cases = {"baseline": (_jpeg(img), (0xC0, 8, h, w, 3), True),
             "progressive": (_jpeg(img, progressive=True), (0xC2, 8, h, w, 3), True),
             "grey": (_jpeg(img.convert("L")), (0xC0, 8, h, w, 1), True),
             "cmyk": (_jpeg(img.convert("CMYK")), (0xC0, 8, h, w, 4), False),
             "png": (png.getvalue(), None, False),
             "garbage": (b"\xff\xd8\xff\xe0 not really a jpeg", None, False),
             "empty": (b"", None, False)}
    for name, (data, frame, gpu) in cases.items():
        assert jpeg_frame(data) == frame, name
        assert jpeg_frame(memoryview(data)) == frame, name  # the decoder reads headers from views of a batch
        assert nvjpeg_can_decode(data) is gpu, name
    # the JPEG engines (nvjpeg) take baseline grey or YCbCr files of every common subsampling, and no others
    engines = {name: (data, (h, w) if name in ("baseline", "grey") else None)
               for name, (data, _, _) in cases.items()}
    engines |= {f"baseline {s}": (_jpeg(img, subsampling=s), (h, w)) for s in (0, 1, 2)}  # 4:4:4, 4:2:2, 4:2:0
    for name, (data, size) in engines.items():
        assert engines_take(data) == size, name
        assert engines_take(memoryview(data)) == size, name
    # the planes of nvJPEG's YUV output: chroma rounded up at odd sizes (101 x 75 here), as libjpeg stores them
    odd = img.resize((101, 75))
    for subsampling, chroma in ((0, (75, 101)), (1, (75, 51)), (2, (38, 51))):  # 4:4:4, 4:2:2, 4:2:0
        assert engine_planes(_jpeg(odd, subsampling=subsampling)) == [(75, 101), chroma, chroma], subsampling
    assert engine_planes(_jpeg(odd.convert("L"))) == [(75, 101)]
    assert engine_planes(_jpeg(odd, progressive=True)) is None
    # three components stored as RGB (libjpeg's rules: component ids 'R', 'G', 'B', or Adobe's APP14 transform 0)
    # are not YCbCr planes: torchvision decodes them
    plain = _jpeg(odd)
    sof = plain.index(b"\xff\xc0")
    ids = bytearray(plain)
    ids[sof + 10], ids[sof + 13], ids[sof + 16] = b"RGB"
    assert engine_planes(bytes(ids)) is None

    def adobe(transform: int) -> bytes:  # an APP14 marker right after SOI
        return plain[:2] + b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00" + bytes([transform]) + plain[2:]
    assert engine_planes(adobe(0)) is None and engine_planes(adobe(1)) == engine_planes(plain)


# --- crop boxes ---------------------------------------------------------------------------------------------
def test_crop_boxes_follow_torchvision_get_params():
    """Valid boxes with torchvision's RandomResizedCrop.get_params distribution (area, aspect ratio, position), and
    exactly its centred fallback where no box fits."""
    from torchvision.transforms import RandomResizedCrop
    rng = _rng()
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    h, w = int(rng.integers(200, 600)), int(rng.integers(200, 600))
    n = 3000
    boxes = ga.sample_crop_boxes(np.tile([h, w], (n, 1)), scale, ratio, rng)
    top, left, bh, bw = boxes.T
    assert (top >= 0).all() and (left >= 0).all() and (top + bh <= h).all() and (left + bw <= w).all()
    assert (bh > 0).all() and (bw > 0).all()
    ref = np.array([RandomResizedCrop.get_params(torch.empty(3, h, w), list(scale), list(ratio)) for _ in range(n)])

    def stats(b: np.ndarray) -> np.ndarray:  # area fraction, log aspect, relative position of the box centre
        t, l_, bh_, bw_ = b.T.astype(float)
        return np.stack([bh_ * bw_ / (h * w), np.log(bw_ / bh_), (t + bh_ / 2) / h, (l_ + bw_ / 2) / w], axis=1)

    ours, theirs = stats(boxes), stats(ref)
    se = np.sqrt(ours.var(axis=0) / n + theirs.var(axis=0) / n)
    assert (np.abs(ours.mean(axis=0) - theirs.mean(axis=0)) < 5 * se).all(), (ours.mean(0), theirs.mean(0), se)
    assert (np.abs(ours.std(axis=0) - theirs.std(axis=0)) < 0.1 * theirs.std(axis=0) + 1e-3).all()
    # no attempt fits a 30-pixel-high strip: the centred fallback, deterministic in both
    for size in ((30, 2000), (2000, 30), (40, 45)):
        got = ga.sample_crop_boxes(np.array([size]), (0.9, 1.0), (0.99, 1.01), rng)[0].tolist()
        want = list(RandomResizedCrop.get_params(torch.empty(3, *size), [0.9, 1.0], [0.99, 1.01]))
        if size != (40, 45):
            assert got == want, size
        else:  # a box fits here: any fitting box
            assert got[2] * got[3] >= 0.9 * 40 * 45 * 0.95 and got[0] + got[2] <= 40 and got[1] + got[3] <= 45


# --- training crops, flips and normalisation ----------------------------------------------------------------
@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear"])
def test_training_crops_flips_and_normalisation_match_torchvision(photos, interpolation):
    """The device path (decode, crop + resize, flip, normalise) against torchvision's CPU transforms on the same
    crop boxes and flips: resized_crop (torchvision's uint8 resize equals PIL's, i.e. timm's path), horizontal_flip,
    to_dtype + normalize. One float resize pass instead of PIL's two fixed-point ones: bicubic within a few levels
    where it overshoots, ~0.2 levels on average; bilinear within 1 level."""
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2 import functional as TF
    blobs = [_jpeg(p) for p in photos]
    images = _decode_cpu(blobs)
    tf = ga.TrainTransform(ga.TrainSpec(size=(224, 224), hflip=0.5, interpolation=interpolation))
    plan = tf.plan([tuple(i.shape[-2:]) for i in images], _rng())
    plan.flips[:2] = [True, False]  # both kinds in every run
    norm = _Normalize(torch.device("cpu"), IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
    got = norm(tf.apply(images, plan))
    mode = InterpolationMode.BICUBIC if interpolation == "bicubic" else InterpolationMode.BILINEAR
    for k, data in enumerate(blobs):
        top, left, h, w = plan.boxes[k].tolist()
        ref = TF.resized_crop(_pil_rgb(data), top, left, h, w, [224, 224], interpolation=mode, antialias=True)
        if plan.flips[k]:
            ref = TF.horizontal_flip(ref)
        ref = TF.normalize(TF.to_dtype(ref, torch.float32, scale=True), IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
        diff = (got[k] - ref).abs() * STD_LEVELS  # in uint8 levels (at least)
        assert diff.mean() < 0.35, (k, diff.mean())
        assert diff.max() <= (8 if interpolation == "bicubic" else 1.5), (k, diff.max())
        assert (diff > 1.5).float().mean() < 0.01
        unflipped = (got[k] - ref.flip(-1)).abs().mean() * STD_LEVELS
        assert unflipped > 5 * diff.mean() + 1  # the flip is seen: the other orientation is far off


@pytest.mark.parametrize("size", [(48, 48), (20, 130)])
def test_batched_crop_resize_matches_interpolate_per_image(photos, size):
    """crop_resize (two launches for a batch of images of different sizes) against the path it replaced, one
    F.interpolate per image (antialiased bilinear / bicubic, nearest-exact), rounded to uint8: downscaling by up to
    ~8x, upscaling, a non-square output; equal but for rare 1-level rounding differences."""
    from swin.data.gpu.crop_resize import crop_resize, crop_resize_packed
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = _rng()
    sizes = rng.integers(30, 400, (len(photos), 2))
    sizes[0] = (390, 370)  # cropped whole below: ~8x downscaling
    images = [torch.from_numpy(np.asarray(p.resize((int(w), int(h)))).copy()).permute(2, 0, 1).to(device)
              for p, (h, w) in zip(photos, sizes)]
    boxes = []
    for img in images:
        height, width = img.shape[1:]
        h, w = rng.integers(8, height + 1), rng.integers(8, width + 1)
        boxes.append([rng.integers(0, height - h + 1), rng.integers(0, width - w + 1), h, w])
    boxes, modes = np.array(boxes), rng.integers(0, 3, len(images))
    boxes[0], boxes[1, 2:] = (0, 0, 390, 370), (8, 12)  # and upscaling
    modes[:3] = [0, 1, 2]
    got = crop_resize(images, boxes, modes, size)
    for k, (img, (top, left, h, w), m) in enumerate(zip(images, boxes, modes)):
        mode = ga.MODES[m]
        nearest = mode == "nearest-exact"
        want = F.interpolate(img[None, :, top:top + h, left:left + w].float(), size=size, mode=mode,
                             antialias=not nearest, align_corners=None if nearest else False)
        diff = _levels(got[k:k + 1], want.round().clamp(0, 255).to(torch.uint8))
        assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01, (k, mode, (h, w), diff.max())
    assert (boxes[:, 2] > 4 * size[0]).any() and (boxes[:, 2] < size[0]).any()  # both directions seen
    # the same images packed channels-last in one buffer, as workers decoding on the CPU send them: the same result
    packed = ga.PackedImages.pack([img.cpu() for img in images]).to(device)
    assert all(torch.equal(a, b) for a, b in zip(packed.unpack(), images))
    assert torch.equal(crop_resize_packed(packed.pixels, packed.shapes, boxes, modes, size, channels_last=True), got)
    # flips in the same launches: exactly the crops mirrored (the horizontal flip commutes with the resize)
    flips = np.arange(len(images)) % 2 == 1
    rng.shuffle(flips)
    mirrored = torch.where(torch.from_numpy(flips).to(device).view(-1, 1, 1, 1), got.flip(-1), got)
    assert torch.equal(crop_resize(images, boxes, modes, size, flips=flips), mirrored)
    assert torch.equal(crop_resize_packed(packed.pixels, packed.shapes, boxes, modes, size, channels_last=True,
                                          flips=flips), mirrored)


@pytest.mark.gpu
def test_gpu_crop_resize_matches_interpolate_at_the_pipeline_sizes(photos):
    """On CUDA, ImageNet-sized photos to 224 x 224 with each mode: the kernel against F.interpolate on the same
    device. (Its first H100 run inside the pipeline differed from the CPU by 0.49 levels on average while the
    interpreter agreed; the message gives the signed mean difference per mode to tell rounding from geometry.)"""
    from swin.data.gpu.crop_resize import crop_resize
    images = [img.cuda() for img in _decode_cpu([_jpeg(p) for p in photos])] * 3
    rng = _rng()
    boxes = []
    for img in images:
        height, width = img.shape[1:]
        h, w = rng.integers(height // 3, height + 1), rng.integers(width // 3, width + 1)
        boxes.append([rng.integers(0, height - h + 1), rng.integers(0, width - w + 1), h, w])
    boxes, modes = np.array(boxes), np.repeat(np.arange(3), len(photos))
    got = crop_resize(images, boxes, modes, (224, 224))
    want = ga.resized_crops(images, boxes, modes, (224, 224))
    signed = got.to(torch.int32) - want.to(torch.int32)
    report = {ga.MODES[m]: (signed[modes == m].float().mean().item(), signed[modes == m].abs().max().item())
              for m in range(3)}
    assert signed.abs().max() <= 1 and (signed != 0).float().mean() < 0.01, report


def test_batched_crop_resize_reads_images_where_they_lie():
    """The kernels read each image at its address (no packing copy): views into one buffer in any order, a
    non-contiguous image and a large one allocated apart give what the same images packed back to back in one
    buffer give."""
    from swin.data.gpu.crop_resize import crop_resize, crop_resize_packed
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = _rng()
    shapes = [(int(h), int(w)) for h, w in rng.integers(9, 40, (5, 2))]
    buffer = torch.from_numpy(rng.integers(0, 256, sum(3 * h * w for h, w in shapes), dtype=np.uint8)).to(device)
    views = list(buffer.split([3 * h * w for h, w in shapes]))
    views = [v.view(3, h, w) for v, (h, w) in zip(views, shapes)][::-1]  # the highest address first
    views.append(torch.from_numpy(rng.integers(0, 256, (3, 30, 20), dtype=np.uint8)).to(device).transpose(1, 2))
    # over 1 MiB: on CUDA another pool of the caching allocator, far from the others (an int64 offset)
    views.append(torch.from_numpy(rng.integers(0, 256, (3, 640, 600), dtype=np.uint8)).to(device))
    boxes = np.array([[1, 2, v.shape[1] - 1, v.shape[2] - 3] for v in views])
    boxes[-1] = (500, 300, 41, 33)
    modes = rng.integers(0, 3, len(views))
    flips = rng.random(len(views)) < 0.5
    got = crop_resize(views, boxes, modes, (12, 10), flips=flips)
    packed = torch.cat([v.contiguous().reshape(-1) for v in views])  # the same images back to back, in list order
    want = crop_resize_packed(packed, np.array([v.shape[1:] for v in views]), boxes, modes, (12, 10), flips=flips)
    assert torch.equal(got, want)
    assert torch.equal(got[:1], crop_resize(views[:1], boxes[:1], modes[:1], (12, 10), flips=flips[:1]))


def _plane_weights(n_out: int, start: float, scale: float, first: int, count: int, mode: int) -> np.ndarray:
    """float64 (n_out, count) resampling weights over a window of ``count`` plane pixels from ``first``: output i's
    centre lies at ``start + scale * (i + 0.5)`` plane pixels from the window's start; PIL's antialiased filters
    (triangle, Keys cubic a = -0.5; support stretched when shrinking) or nearest, normalised per output."""
    weights = np.zeros((n_out, count))
    stretch = max(scale, 1.0)
    for i in range(n_out):
        centre = start + scale * (i + 0.5)
        if mode == 2:
            weights[i, min(int(centre), count - 1)] = 1.0
            continue
        support = (2.0 if mode == 1 else 1.0) * stretch
        for x in range(max(int(centre - support + 0.5), 0), min(int(centre + support + 0.5), count)):
            d = abs((x - centre + 0.5) / stretch)
            if mode == 1:
                weights[i, x] = (1.5 * d - 2.5) * d * d + 1 if d < 1 else (((-0.5 * d + 2.5) * d - 4) * d + 2
                                                                           if d < 2 else 0)
            else:
                weights[i, x] = max(1.0 - d, 0.0)
        weights[i] /= weights[i].sum()
    return weights


def _ycbcr_reference(planes: list[np.ndarray], shifts: tuple[int, int], box: tuple[int, int, int, int], mode: int,
                     size: tuple[int, int]) -> np.ndarray:
    """(3, *size) uint8 RGB in float64: each plane resampled where the crop lies in it (its edges divided by the
    subsampling), then JFIF's YCbCr -> RGB, rounded half to even."""
    top, left, h, w = box
    out = []
    for c, plane in enumerate(planes):
        sv, sh = shifts if c else (0, 0)
        resampled = plane.astype(np.float64)
        for axis, (start, length, s, n_out) in enumerate([(top, h, sv, size[0]), (left, w, sh, size[1])]):
            first = start >> s
            count = min((start + length + 2**s - 1) >> s, plane.shape[axis]) - first
            weights = _plane_weights(n_out, (start - (first << s)) / 2**s, length / (n_out * 2**s), first, count, mode)
            window = np.take(resampled, np.arange(first, first + count), axis=axis)
            resampled = np.tensordot(weights, window, axes=([1], [axis]))
            resampled = np.moveaxis(resampled, 0, axis)
        out.append(resampled)
    y, cb, cr = out[0], out[1] - 128, out[2] - 128
    rgb = np.stack([y + 1.402 * cr, y - 0.344136286 * cb - 0.714136286 * cr, y + 1.772 * cb])
    return np.clip(np.round(rgb), 0, 255).astype(np.uint8)


def test_batched_crop_resize_of_ycbcr_planes_matches_float64():
    """YCbCr planes as nvJPEG's YUV output leaves them (4:2:0, 4:2:2, 4:4:0, 4:4:4, 4:1:1; odd sizes), mixed with RGB
    images in one batch, against a float64 reference that resamples each plane where the crop lies in it and then
    converts to RGB: within 1 level on under 1% of values; the RGB images exactly as in a batch of their own."""
    from swin.data.gpu.crop_resize import YCbCrImage, crop_resize
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = _rng()
    cases = [(1, 1), (0, 1), (1, 0), (0, 0), (0, 2), (1, 1), (1, 1)]
    images, planes, boxes = [], [], []
    for sv, sh in cases:
        h, w = (int(v) for v in rng.integers(17, 90, 2))
        chroma = (-(-h // 2**sv), -(-w // 2**sh))
        p = [rng.integers(0, 256, (h, w), dtype=np.uint8)] + [rng.integers(0, 256, chroma, dtype=np.uint8)
                                                               for _ in range(2)]
        planes.append(p)
        images.append(YCbCrImage(*(torch.from_numpy(q).to(device) for q in p)))
        bh, bw = int(rng.integers(5, h + 1)), int(rng.integers(5, w + 1))
        boxes.append([int(rng.integers(0, h - bh + 1)), int(rng.integers(0, w - bw + 1)), bh, bw])
    boxes[-1] = [1, 3, images[-1].shape[1] - 1, images[-1].shape[2] - 3]  # to the far edges, odd starts
    rgb = [torch.from_numpy(rng.integers(0, 256, (3, 31, 40), dtype=np.uint8)).to(device)]
    boxes = np.array(boxes + [[2, 5, 20, 33]])
    modes = rng.integers(0, 3, len(boxes))
    modes[:3] = [0, 1, 2]
    size = (24, 20)
    got = crop_resize(images + rgb, boxes, modes, size).cpu()
    for k, (p, (sv, sh)) in enumerate(zip(planes, cases)):
        want = torch.from_numpy(_ycbcr_reference(p, (sv, sh), tuple(boxes[k]), int(modes[k]), size))
        diff = _levels(got[k], want)
        assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01, (k, (sv, sh), int(modes[k]), diff.max())
    assert torch.equal(got[-1:], crop_resize(rgb, boxes[-1:], modes[-1:], size).cpu())
    flips = np.arange(len(boxes)) % 2 == 0
    mirrored = torch.where(torch.from_numpy(flips).view(-1, 1, 1, 1), got.flip(-1), got)
    assert torch.equal(crop_resize(images + rgb, boxes, modes, size, flips=flips).cpu(), mirrored)
    with pytest.raises(ValueError, match="not a subsampling"):
        crop_resize([YCbCrImage(images[0].y, images[0].cb[:-1], images[0].cr)], boxes[:1], modes[:1], size)


def test_crop_resize_row_pass_grouping_changes_no_value(monkeypatch):
    """The row pass with an image's planes per program (swin.data.gpu.crop_resize._plane_groups: RGB images' three
    planes, YCbCr images' luma and chroma pair) gives exactly what one plane per program gives: a mixed batch with
    flips, and RGB images packed channels-last."""
    from swin.data.gpu import crop_resize as cr
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = _rng()
    images = []
    for subsampling in [(1, 1), (0, 0), (0, 1), None, None, (1, 0), None]:  # None: RGB
        h, w = (int(v) for v in rng.integers(12, 70, 2))
        if subsampling is None:
            images.append(torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8)).to(device))
            continue
        chroma = (-(-h // 2**subsampling[0]), -(-w // 2**subsampling[1]))
        images.append(cr.YCbCrImage(*(torch.from_numpy(rng.integers(0, 256, shape, dtype=np.uint8)).to(device)
                                      for shape in ((h, w), chroma, chroma))))
    boxes = []
    for img in images:
        height, width = img.shape[1:]
        h, w = int(rng.integers(3, height + 1)), int(rng.integers(3, width + 1))
        boxes.append([int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w])
    boxes, modes, flips = np.array(boxes), rng.integers(0, 3, len(images)), rng.random(len(images)) < 0.5
    rgb = [k for k, img in enumerate(images) if isinstance(img, torch.Tensor)]
    packed = ga.PackedImages.pack([images[k].cpu() for k in rgb]).to(device)

    def crops() -> tuple[torch.Tensor, torch.Tensor]:
        return (cr.crop_resize(images, boxes, modes, (23, 17), flips=flips),
                cr.crop_resize_packed(packed.pixels, packed.shapes, boxes[rgb], modes[rgb], (23, 17),
                                      channels_last=True, flips=flips[rgb]))
    grouped = crops()  # first: on CUDA its row buffer cannot be one the other call left filled
    monkeypatch.setattr(cr, "_plane_groups", lambda ycbcr: np.stack([np.arange(len(ycbcr)),
                                                                      np.ones(len(ycbcr), dtype=np.int64)], axis=1))
    one_plane_each = crops()
    assert all(torch.equal(a, b) for a, b in zip(one_plane_each, grouped))
    assert torch.equal(grouped[1], grouped[0][rgb])  # and the packed images are those of the list


def test_ycbcr_crop_resize_of_a_photo_is_its_rgb_crop():
    """The meaning of the YCbCr path: a photo's 4:4:4 planes (PIL's conversion) cropped and resized give the RGB
    photo's crop within 2 levels (the conversion is linear), and its 4:2:0 planes (chroma averaged over 2 x 2) within
    JPEG-like chroma error."""
    from swin.data.gpu.crop_resize import YCbCrImage, crop_resize
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # blurred: chroma that 2 x 2 averaging keeps (a photo's grain is lost to any 4:2:0 file alike)
    photo = make_image(1, 5, int(_rng().integers(0, 2**31))).resize((160, 120)).filter(ImageFilter.GaussianBlur(2))
    ycc = np.asarray(photo.convert("YCbCr")).astype(np.float64)
    rgb = torch.from_numpy(np.asarray(photo.convert("YCbCr").convert("RGB")).copy()).permute(2, 0, 1).to(device)
    full = YCbCrImage(*(torch.from_numpy(ycc[..., c].astype(np.uint8)).to(device) for c in range(3)))
    halved = [ycc[..., c].reshape(60, 2, 80, 2).mean(axis=(1, 3)).round().astype(np.uint8) for c in (1, 2)]
    sub = YCbCrImage(full.y, *(torch.from_numpy(q).to(device) for q in halved))
    box, modes = np.array([[7, 11, 101, 131]]), np.array([1])
    want = crop_resize([rgb], box, modes, (56, 64)).cpu()
    assert _levels(crop_resize([full], box, modes, (56, 64)).cpu(), want).max() <= 2
    diff = _levels(crop_resize([sub], box, modes, (56, 64)).cpu(), want).float()
    # (the chroma planes moved by one of their pixels: 5-7 levels on average; single values up to ~15 where a colour
    # edge meets the crop's border, as 2 x 2 averaging blurs it)
    assert diff.mean() < 1 and (diff > 8).float().mean() < 0.01, (diff.mean(), (diff > 8).float().mean())


def test_ycbcr_planes_in_the_pytorch_path_and_the_kernels():
    """The PyTorch path (TrainTransform(kernels=False)) takes YCbCr planes too: ycbcr_to_rgb of 4:4:4 planes is PIL's
    YCbCr -> RGB within 1 level; crops of 4:2:0 planes in PyTorch (chroma upsampled first) and in the kernels (each
    plane resampled to the crop) stay close."""
    from swin.data.gpu.crop_resize import YCbCrImage
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = _rng()
    photo = make_image(2, 5, int(rng.integers(0, 2**31))).resize((150, 110)).filter(ImageFilter.GaussianBlur(1.5))
    ycc = np.asarray(photo.convert("YCbCr"))
    full = YCbCrImage(*(torch.from_numpy(ycc[..., c].copy()) for c in range(3)))
    rgb = torch.from_numpy(np.asarray(photo.convert("YCbCr").convert("RGB")).copy()).permute(2, 0, 1)
    assert _levels(ga.ycbcr_to_rgb(full), rgb).max() <= 1
    halved = [torch.from_numpy(ycc[..., c].astype(np.float64).reshape(55, 2, 75, 2).mean(axis=(1, 3)).round()
                               .astype(np.uint8)) for c in (1, 2)]
    images = [YCbCrImage(full.y, *halved)] * 4
    # crops and flips only: RandAugment's thresholds and tables would amplify the paths' 1-level differences
    spec = ga.TrainSpec(size=(64, 64), interpolation="random")
    plan = ga.TrainTransform(spec).plan(ga.image_sizes(images), rng)
    torch_path = ga.TrainTransform(spec, kernels=False).apply(images, plan)
    kernels = ga.TrainTransform(spec, kernels=True).apply([YCbCrImage(*(p.to(device) for p in i.planes()))
                                                           for i in images], plan).cpu()
    assert torch_path.shape == kernels.shape == (4, 3, 64, 64)
    diff = _levels(kernels, torch_path).float()
    assert diff.mean() < 1.25, diff.mean()  # (0.5-0.9 over 12 photos)


def test_batched_crop_resize_rounds_half_to_even_and_checks_boxes():
    """Two equal taps make exact halves: 1.5 -> 2, 2.5 -> 2, 3.5 -> 4 (torch.round, as the per-image path); nearest
    at an even ratio takes pixel floor(2 (i + 0.5)) = 2i + 1; a box outside its image is refused."""
    from swin.data.gpu.crop_resize import crop_resize
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pairs = [torch.tensor([a, a + 1], dtype=torch.uint8, device=device).view(1, 1, 2).expand(3, 1, 2).contiguous()
             for a in (1, 2, 3)]
    got = crop_resize(pairs, np.array([[0, 0, 1, 2]] * 3), np.zeros(3, dtype=np.int64), (1, 1))
    assert got[:, 0, 0, 0].tolist() == [2, 2, 4]
    ramp = torch.arange(8, dtype=torch.uint8, device=device).repeat(3, 8, 1)  # (3, 8, 8), value = column
    got = crop_resize([ramp], np.array([[0, 0, 8, 8]]), np.array([2]), (4, 4))
    assert got[0, 0, 0].tolist() == [1, 3, 5, 7]
    with pytest.raises(ValueError, match="must lie inside its image"):
        crop_resize([ramp], np.array([[2, 0, 8, 8]]), np.array([0]), (4, 4))


# --- RandAugment --------------------------------------------------------------------------------------------
def test_rand_augment_strings_parse_like_timm():
    assert ga.parse_rand_augment("rand-m9-mstd0.5-inc1") == ga.RandAugmentSpec(
        magnitude=9, num_layers=2, prob=0.5, magnitude_std=0.5, magnitude_max=10, increasing=True)
    spec = ga.parse_rand_augment("rand-m7-n3-p0.7-mmax12-mstd101")
    assert (spec.magnitude, spec.num_layers, spec.prob, spec.magnitude_max) == (7, 3, 0.7, 12)
    assert spec.magnitude_std == math.inf and not spec.increasing
    for bad in ("augmix-m5", "rand-m9-tweights", "original"):
        with pytest.raises(ValueError, match="data.decode=gpu"):
            ga.parse_rand_augment(bad)


_GEOMETRIC = ("Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")
_TIMM_INCREASING = {"Posterize", "Solarize", "Color", "Contrast", "Brightness", "Sharpness"}


def _timm_reference(img: Image.Image, name: str, level: float, sign: float, increasing: bool, resample: int,
                    monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """timm's own op on PIL, with timm's level -> argument rule; its random sign forced to `sign`."""
    from timm.data import auto_augment as aa
    timm_name = name + "Increasing" if increasing and name in _TIMM_INCREASING else name
    # timm negates when random.random() > 0.5
    monkeypatch.setattr(aa.random, "random", lambda: 0.9 if sign < 0 else 0.1)
    level_fn = aa.LEVEL_TO_ARG[timm_name]
    args = level_fn(level, {"translate_pct": 0.45}) if level_fn else ()
    out = aa.NAME_TO_OP[timm_name](img, *args, fillcolor=(124, 116, 104), resample=resample)
    monkeypatch.undo()
    return torch.from_numpy(np.asarray(out).copy()).permute(2, 0, 1)


@pytest.mark.parametrize("increasing", [True, False])
def test_rand_augment_ops_match_timm_pil_ops(photos, increasing, monkeypatch):
    """Every op at a random magnitude and sign against timm's PIL op with timm's argument rule: pointwise and
    enhancement ops to within 1 level (float vs PIL arithmetic), bilinear rotations/shears/translations to within
    1 level but for rare pixels on the image edge (the geometry and edge rule are PIL's), nearest ones but for
    pixels on cell edges, bicubic ones close on average (grid_sample's bicubic kernel is a = -0.75, PIL's affine
    bicubic a = -1)."""
    rng = _rng()
    crops = [p.resize((96, 80)) for p in photos[:4]] + [Image.new("RGB", (96, 80), (90, 90, 200))]  # + a flat one
    x = torch.stack([torch.from_numpy(np.asarray(c).copy()).permute(2, 0, 1) for c in crops])
    consts = ga.TrainTransform(ga.TrainSpec(size=(80, 96))).to("cpu")._consts[torch.device("cpu")]
    for name in ga.RA_OPS:
        level, sign = float(rng.uniform(0, 10)), float(rng.choice([-1.0, 1.0]))
        if name == "Posterize":  # 0 bits (inc: level 10; else level < 2.5): Pillow >= 12 refuses; ours: black
            level = min(level, 9.99) if increasing else max(level, 2.5)
        modes = [("bilinear", Image.BILINEAR), ("bicubic", Image.BICUBIC), ("nearest", Image.NEAREST)]
        for mode, resample in modes if name in _GEOMETRIC else modes[:1]:
            op, args = ga.rand_augment_args(name, np.full(len(crops), level), np.full(len(crops), sign), increasing,
                                            (80, 96))
            if name in _GEOMETRIC:
                op = {"bilinear": ga.AFFINE_BILINEAR, "bicubic": ga.AFFINE_BICUBIC, "nearest": ga.AFFINE_NEAREST}[mode]
            got = ga.apply_op(op, x.clone(), torch.tensor(args, dtype=torch.float32), consts)
            want = torch.stack([_timm_reference(c, name, level, sign, increasing, resample, monkeypatch)
                                for c in crops])
            diff = _levels(got, want).float()
            label = f"{name} level {level:.2f} sign {sign} {mode}"
            if mode == "bicubic":
                assert diff.mean() < 1.5 and torch.quantile(diff, 0.99) <= 8, (label, diff.mean())
            elif mode == "nearest":  # Pillow's nearest affine path steps in 16.16 fixed point: at cell edges a
                assert (diff > 1).float().mean() < 0.04, label  # pixel may take its neighbour (shears: up to ~2%)
            else:  # PIL tests the image edge in double, grid_sample's grid is float32: a source point within
                # ~1e-5 pixel of the edge may be fill on one side and image on the other (a few pixels at most)
                assert (diff > 1).float().mean() < 1e-3 and diff.mean() < 0.05, (label, diff.max(), diff.mean())


def test_rand_augment_draws_like_timm():
    """Per image and layer: one of the 15 ops uniformly, applied with probability p, magnitude ~ N(9, 0.5) clipped
    to [0, 10], a random sign; with interpolation=random the affine ops mix bilinear and bicubic."""
    spec = ga.TrainSpec(size=(224, 224), interpolation="random",
                        rand_augment=ga.parse_rand_augment("rand-m9-mstd0.5-inc1"))
    n = 6000
    plan = ga.plan_batch(spec, [(375, 500)] * n, _rng())
    assert len(plan.layers) == 2
    ops = np.concatenate([op for op, _ in plan.layers])
    args = np.concatenate([a for _, a in plan.layers])
    applied = ops != ga.IDENTITY
    assert abs(applied.mean() - 0.5) < 0.02
    counts = np.bincount(ops[applied], minlength=ga.NUM_OPS)
    affine = counts[ga.AFFINE_BILINEAR] + counts[ga.AFFINE_BICUBIC]
    assert abs(affine / applied.sum() - 5 / 15) < 0.02  # rotate, two shears, two translations
    assert abs(counts[ga.AFFINE_BILINEAR] / affine - 0.5) < 0.05
    for op in (ga.AUTOCONTRAST, ga.EQUALIZE, ga.INVERT, ga.POSTERIZE, ga.SOLARIZE, ga.SOLARIZE_ADD):
        assert abs(counts[op] / applied.sum() - 1 / 15) < 0.015, op
    # rotations: angle = 3 degrees per magnitude step, so |angle| ~ N(27, 1.5); both signs
    theta = args[(ops == ga.AFFINE_BILINEAR) | (ops == ga.AFFINE_BICUBIC)].reshape(-1, 2, 3)
    rot = theta[np.abs(theta[:, 0, 1]) > 0.05]
    rot = rot[np.abs(rot[:, 0, 1] + rot[:, 1, 0]) < 1e-6]  # antisymmetric: rotations, not shears
    angles = np.degrees(np.arctan2(rot[:, 0, 1], rot[:, 0, 0]))
    assert abs(np.abs(angles).mean() - 27) < 0.3 and abs(np.abs(angles).std() - 1.5) < 0.3
    assert 0.4 < (angles > 0).mean() < 0.6
    # increasing enhancements: factor 1 +- 0.9 * magnitude / 10
    factors = args[np.isin(ops, [ga.COLOR, ga.CONTRAST, ga.BRIGHTNESS, ga.SHARPNESS]), 0]
    assert abs(np.abs(factors - 1).mean() - 0.81) < 0.02 and 0.4 < (factors > 1).mean() < 0.6


def _layer_levels(got: torch.Tensor, want: torch.Tensor, ops: np.ndarray) -> torch.Tensor:
    """Per-image level differences of one layer's output; images whose op was nearest-neighbour affine (where a
    sample position one rounding step away may take the neighbouring pixel) are checked here: under 2% of their
    values may differ, by anything. Returns the differences of the other images."""
    diff = _levels(got, want)
    nearest = torch.from_numpy(ops == ga.AFFINE_NEAREST).to(diff.device)
    if nearest.any():
        assert (diff[nearest] > 0).float().mean() < 0.02
    return diff[~nearest]


@pytest.mark.parametrize("kernels", [False, True])
def test_augment_layers_apply_each_images_own_ops(photos, kernels, monkeypatch):
    """Each layer of the batch applies each image's own op (apply_op on that image alone, on the layer's input).
    PyTorch path (images grouped by op, one call per op, original order restored): within 1 level, through all the
    layers. Kernels (crops by crop_resize, flips, each layer four launches of rand_augment): the
    transform's batch is exactly that chain, and each layer is within 1 level of apply_op on its input (checked
    per layer: a 1-level difference can move a later lookup table or threshold by more)."""
    from swin.data.gpu.crop_resize import crop_resize
    from swin.data.gpu.rand_augment import augment_layer
    spec = ga.TrainSpec(size=(64, 64), interpolation="random",
                        rand_augment=ga.parse_rand_augment("rand-m9-n3-p0.9-mstd0.5-inc1"))
    device = torch.device("cuda" if kernels and torch.cuda.is_available() else "cpu")  # else the interpreter's
    tf = ga.TrainTransform(spec, kernels=kernels).to(device)
    consts = tf._consts[ga.indexed(device)]
    # the photos at a third of their size (~167 x 125): crops of ~0.6x to 2.5x the output, as ImageNet's are of 224,
    # and 5x fewer resampling taps in the interpreter than from the full photos (the layers are what is tested here)
    images = [torch.from_numpy(np.asarray(p.reduce(3)).copy()).permute(2, 0, 1).to(device)
              for p in photos] * 3  # 24 images
    plan = tf.plan([tuple(i.shape[-2:]) for i in images], _rng())
    # the transform's own launches, copies of (input, ops, args, output): the chain is checked on them instead of
    # launching every layer again (in the interpreter, a third of the test's time)
    layers = []

    def recorded(x: torch.Tensor, ops: torch.Tensor, args: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        out = augment_layer(x, ops, args, fill)
        layers.append((x.clone(), ops.clone(), args.clone(), out.clone()))
        return out
    monkeypatch.setattr(ga, "augment_layer", recorded)
    got = tf.apply(images, plan)
    assert len(layers) == (len(plan.layers) if kernels else 0)
    crops = (crop_resize if kernels else ga.resized_crops)(images, plan.boxes, plan.modes, spec.size)
    flips = torch.from_numpy(plan.flips).to(device).view(-1, 1, 1, 1)
    x = torch.where(flips, crops.flip(-1), crops)
    for layer, (ops, args) in enumerate(plan.layers):
        args_t = torch.tensor(args, dtype=torch.float32, device=device)
        want = torch.cat([ga.apply_op(int(op), x[k:k + 1], args_t[k:k + 1], consts) if op != ga.IDENTITY
                          else x[k:k + 1] for k, op in enumerate(ops)])
        if kernels:  # the launch took the previous layer's output and this layer's ops and arguments
            layer_in, layer_ops, layer_args, out = layers[layer]
            assert torch.equal(layer_in, x) and torch.equal(layer_args, args_t)
            assert torch.equal(layer_ops, torch.tensor(ops, dtype=torch.int32, device=device))
            x = out
            assert _layer_levels(x, want, ops).max() <= 1
        else:
            x = want
    assert (torch.equal(got, x) if kernels else _levels(got, x).max() <= 1)


def test_rand_augment_kernel_layer_matches_each_op(photos):
    """rand_augment: one layer over a batch whose images drew different ops (every op, random magnitudes and
    signs, a flat image for the degenerate cases of autocontrast and equalize) against apply_op per image: integer
    ops, lookup tables and autocontrast equal, enhancements within 1 level, bilinear and bicubic affine ops within 1
    level (the sample positions may differ in the last bit, which moves a value that lands on an integer, as all do
    on the flat image, by one truncated level), nearest ones on all but a few pixels (_layer_levels)."""
    from swin.data.gpu.rand_augment import augment_layer
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = _rng()
    crops = [p.resize((96, 80)) for p in photos[:4]] + [Image.new("RGB", (96, 80), (90, 90, 200))]
    base = torch.stack([torch.from_numpy(np.asarray(c).copy()).permute(2, 0, 1) for c in crops])
    consts = ga.TrainTransform(ga.TrainSpec(size=(80, 96))).to(device)._consts[ga.indexed(device)]
    ops, args = [], []
    for name in ga.RA_OPS:
        for _image in crops:
            op, a = ga.rand_augment_args(name, np.array([rng.uniform(0, 10)]), np.array([rng.choice([-1.0, 1.0])]),
                                         bool(rng.integers(2)), (80, 96))
            if op == ga.AFFINE_BILINEAR:
                op = int(rng.choice([ga.AFFINE_BILINEAR, ga.AFFINE_BICUBIC, ga.AFFINE_NEAREST]))
            ops.append(op)
            args.append(a[0])
    ops.append(ga.IDENTITY)
    args.append(np.zeros(ga.ARGS))
    x = torch.cat([base] * len(ga.RA_OPS) + [base[:1]]).to(device)
    args_t = torch.tensor(np.array(args), dtype=torch.float32, device=device)
    got = augment_layer(x, torch.tensor(ops, dtype=torch.int32, device=device), args_t, consts["fill"].view(3))
    for k, op in enumerate(ops):
        want = ga.apply_op(op, x[k:k + 1], args_t[k:k + 1], consts) if op != ga.IDENTITY else x[k:k + 1]
        diff = _layer_levels(got[k:k + 1], want, np.array([op]))
        exact = op in (ga.AUTOCONTRAST, ga.EQUALIZE, ga.INVERT, ga.POSTERIZE, ga.SOLARIZE, ga.SOLARIZE_ADD, ga.IDENTITY)
        assert diff.numel() == 0 or diff.max() <= (0 if exact else 1), (k, op, diff.max())
    with pytest.raises(ValueError, match="uint8"):
        augment_layer(x.float(), torch.tensor(ops, dtype=torch.int32, device=device), args_t, consts["fill"].view(3))


@pytest.mark.parametrize("kernels", [False, True])
def test_color_jitter_matches_torchvision_in_each_images_order(photos, kernels):
    """data.auto_augment=null: torchvision's ColorJitter(0.4, 0.4, 0.4), factors and order drawn per image, against
    torchvision's PIL adjust_* functions applied in that order with those factors (on the transform's own crops)."""
    from torchvision.transforms import functional as TF

    from swin.data.gpu.crop_resize import crop_resize
    spec = ga.TrainSpec(size=(72, 72), hflip=0.0, color_jitter=(0.4, 0.4, 0.4))
    tf = ga.TrainTransform(spec, kernels=kernels)
    device = "cuda" if kernels and torch.cuda.is_available() else "cpu"  # else the interpreter's
    # the photos at a third of their size: crops of ~0.6x to 2.3x the output, 5x fewer resampling taps in the
    # interpreter (the jitter is what is tested here; the crops are the reference's input too)
    images = [torch.from_numpy(np.asarray(p.reduce(3)).copy()).permute(2, 0, 1).to(device) for p in photos]
    plan = tf.plan([tuple(i.shape[-2:]) for i in images], _rng())
    assert len(plan.layers) == 3
    got = tf.apply(images, plan).cpu()
    crops = (crop_resize if kernels else ga.resized_crops)(images, plan.boxes, plan.modes, spec.size).cpu()
    adjust = {ga.BRIGHTNESS: TF.adjust_brightness, ga.CONTRAST: TF.adjust_contrast, ga.COLOR: TF.adjust_saturation}
    for k in range(len(images)):
        order = [int(ops[k]) for ops, _ in plan.layers]
        assert sorted(order) == sorted(adjust)  # each component once, in a random order
        pil = TF.to_pil_image(crops[k])
        for ops, args in plan.layers:
            assert 0.6 <= args[k, 0] <= 1.4
            pil = adjust[int(ops[k])](pil, float(args[k, 0]))
        want = torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1)
        assert _levels(got[k], want).max() <= 1, k


# --- evaluation ---------------------------------------------------------------------------------------------
def _write_folder(root: Path, photos: list[Image.Image], split: str, per_class: int) -> None:
    for k, photo in enumerate(photos[:2 * per_class]):
        d = root / split / f"class{k % 2}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{split}{k}.JPEG").write_bytes(_jpeg(photo))


def test_eval_batches_match_the_cpu_path(photos, tmp_path):
    """eval.py's validation data with data.decode=gpu (device pipeline on the CPU) against data.decode=cpu (PIL and
    timm's resize + centre crop in the workers), normalised: the same resize and crop. Both decoders are
    libjpeg-turbo (identical pixels); the resize is PIL's two passes in float instead of fixed point (PIL rounds
    to 8 bits between its passes), so a few pixels in 10,000 (at most ~0.2%, depending on the image) differ by one
    level, and a rare one by two (TEST_SEED=21: one in 10,000)."""
    from swin.evaluate import build_eval_dataset
    _write_folder(tmp_path, photos, "val", 4)
    batches = {}
    for decode in ("cpu", "gpu"):
        cfg = to_settings(make_cfg("data=imagenet", f"data.root={tmp_path}", "data.num_workers=0",
                                   f"data.decode={decode}").data)
        val, classes, (mean, std) = build_eval_dataset(cfg, 224)
        assert classes == 2 and len(val) == 8
        loader = build_eval_loader(val, cfg, torch.device("cpu"), 0, 1, 3, mean, std)  # batches of 3, 3, 2
        batches[decode] = [(x, y) for x, y, _ in loader]
    assert [x.shape[0] for x, _ in batches["gpu"]] == [3, 3, 2]
    for (xc, yc), (xg, yg) in zip(batches["cpu"], batches["gpu"]):
        assert torch.equal(yc, yg) and xg.shape == xc.shape == (xc.shape[0], 3, 224, 224)
        diff = (xg - xc).abs() * STD_LEVELS
        assert diff.max() <= 2.01 and (diff > 0.01).float().mean() < 5e-3, (diff.max(), (diff > 0.01).float().mean())
        assert (diff > 1.01).float().mean() < 5e-4


# --- undecodable files --------------------------------------------------------------------------------------
def _odd_files(root: Path, photos: list[Image.Image]) -> dict[str, bytes]:
    """A class folder with good JPEGs and every kind of file nvJPEG cannot decode (and two unreadable ones)."""
    small = [p.resize((120, 90)) for p in photos[:4]]
    png = io.BytesIO()
    small[3].save(png, format="PNG")
    files = {"a_good.JPEG": _jpeg(small[0]), "b_progressive.JPEG": _jpeg(small[1], progressive=True),
             "c_cmyk.JPEG": _jpeg(small[2].convert("CMYK")), "d_png.JPEG": png.getvalue(),
             "e_grey.JPEG": _jpeg(small[0].convert("L")), "f_truncated.JPEG": _jpeg(small[1])[:1500],
             "g_garbage.JPEG": b"this is not an image"}
    (root / "c0").mkdir(parents=True)
    for name, data in files.items():
        (root / "c0" / name).write_bytes(data)
    return files


class _NvjpegStandIn(JpegDecoder):
    """CPU decoding that, like nvJPEG with a file it rejects, fails the whole batched call when any file is
    progressive: exercises the retry-alone-then-CPU path."""

    calls = 0

    def device_decode(self, blobs):
        type(self).calls += 1
        if any(jpeg_frame(b.numpy().tobytes())[0] == 0xC2 for b in blobs):
            raise RuntimeError("nvJPEG stand-in: unsupported stream")
        return super().device_decode(blobs)


def test_undecodable_files_fall_back_to_the_cpu_and_are_counted(photos, tmp_path):
    files = _odd_files(tmp_path, photos)
    ds = EncodedImageFolder(tmp_path, ga.EvalTransform(ga.EvalSpec(64)), skip_corrupt=True)
    batch = collate_encoded([ds[i] for i in range(len(ds))])
    assert batch.skipped == 1  # the garbage file: not a JPEG, not decodable by anything (dropped in the worker)
    assert sorted(Path(batch.paths[k]).name for k in batch.decoded_slots) == ["c_cmyk.JPEG", "d_png.JPEG"]
    assert batch.indices == [0, 1, 2, 3, 4, 5]  # the dataset indices of the kept files (the garbage one is last)
    decoder = _NvjpegStandIn(torch.device("cpu"), skip_corrupt=True)
    images, targets, skipped, on_cpu = decoder(batch)
    kept = [n for n in sorted(files) if n not in ("f_truncated.JPEG", "g_garbage.JPEG")]
    assert skipped == 2 and len(images) == len(targets) == len(kept) == 5
    # worker-decoded CMYK and PNG, plus the progressive file the stand-in rejected: decoded on the CPU, named
    assert sorted(Path(p).name for p in on_cpu) == ["b_progressive.JPEG", "c_cmyk.JPEG", "d_png.JPEG"]
    for name, img in zip(kept, images):
        assert img.shape[0] == 3 and torch.equal(img, _pil_rgb(files[name])), name  # the pixels PIL gives
    strict = EncodedImageFolder(tmp_path, ga.EvalTransform(ga.EvalSpec(64)), skip_corrupt=False)
    with pytest.raises(CorruptImageError, match="g_garbage.JPEG"):
        strict[len(strict) - 1]
    no_garbage = collate_encoded([strict[i] for i in range(len(strict) - 1)])
    with pytest.raises(CorruptImageError, match="f_truncated.JPEG.*data.skip_corrupt"):
        _NvjpegStandIn(torch.device("cpu"), skip_corrupt=False)(no_garbage)


class _CallSizes(_NvjpegStandIn):
    """The stand-in, recording how many files each decode call gets."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sizes: list[int] = []

    def device_decode(self, blobs):
        self.sizes.append(len(blobs))
        return super().device_decode(blobs)


def test_decoding_in_calls_of_a_few_files_gives_the_same_batch(photos, tmp_path):
    """The training process decodes in calls of FILES_PER_CALL_BESIDE_STEP files (nvJPEG's engines slow down 15-35x
    beside a busy step from 8 files per call): the same images, drops and CPU fallbacks as one call, and a failing
    call retries only its own files."""
    _odd_files(tmp_path, photos)
    ds = EncodedImageFolder(tmp_path, ga.EvalTransform(ga.EvalSpec(64)), skip_corrupt=True)
    batch = collate_encoded([ds[i] for i in range(len(ds))])
    whole = _CallSizes(torch.device("cpu"), skip_corrupt=True)
    images, targets, skipped, on_cpu = whole(batch)
    chunked = _CallSizes(torch.device("cpu"), skip_corrupt=True)
    got_images, got_targets, got_skipped, got_on_cpu = chunked(batch, per_call=2)
    # four files reach the decoder (good, progressive, grey, truncated): one call of 4, or calls of 2, each failed
    # call (the progressive file in the first, the truncated one in the second) retried file by file
    assert whole.sizes == [4, 1, 1, 1, 1] and chunked.sizes == [2, 1, 1, 2, 1, 1]
    assert got_skipped == skipped == 2 and sorted(got_on_cpu) == sorted(on_cpu)
    assert torch.equal(got_targets, targets) and len(got_images) == len(images) == 5
    for a, b in zip(got_images, images):
        assert torch.equal(a, b)
    assert files_per_call(torch.device("cuda")) == FILES_PER_CALL_BESIDE_STEP <= 7
    assert files_per_call(torch.device("cpu")) == 0


# --- the loader ---------------------------------------------------------------------------------------------
def _loader(root: Path, batch: int = 3, workers: int = 0, skip_corrupt: bool = False,
            thread: bool | str = False) -> DeviceLoader:
    """data.decode=gpu's training loader on the CPU; thread: decoded in a DecodeThread, the workers reading files;
    thread="decoded": data.augment=gpu with CPU decoding (the workers decode, a DecodeThread augments)."""
    spec = ga.TrainSpec(size=(32, 32), rand_augment=ga.parse_rand_augment("rand-m9-mstd0.5-inc1"))
    if thread == "decoded":
        ds = DecodedImageFolder(root, ga.TrainTransform(spec), skip_corrupt=skip_corrupt)
    else:
        ds = EncodedImageFolder(root, ga.TrainTransform(spec), skip_corrupt)
    sampler = ResumableDistributedSampler(ds, 1, 0, shuffle=True, seed=3)
    # decoding workers send batches through a ring of shared buffers, as swin.data's loaders do
    ring = BatchRing(workers * 2 + BatchRing.in_flight_limit + 1, batch, (3, 32, 32)) if workers and not thread \
        else None
    collate = DeviceCollate(torch.device("cpu"), ds.device_transform, skip_corrupt, seed=5, ring=ring)
    read = collate_decoded if thread == "decoded" else collate_encoded
    dl = DataLoader(ds, batch_size=batch, sampler=sampler, drop_last=True, num_workers=workers,
                    collate_fn=read if thread else collate, persistent_workers=workers > 0)
    norm = _Normalize(torch.device("cpu"), IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
    return DeviceLoader(DecodeThread(dl, collate) if thread else dl, torch.device("cpu"), norm, sampler)


@pytest.mark.parametrize("workers, thread", [(0, False), (2, False), (2, True), (2, "decoded"), (0, "decoded")])
def test_gpu_decode_loader_order_resume_and_errors(photos, tmp_path, workers, thread):
    """data.decode=gpu's loader (on the CPU here): batches in the sampler's order, augmentation seeded by the batch
    (the same after a resume mid-epoch, another in another epoch), in the training process, in workers, in a
    decoding thread fed by workers, or augmented in a thread fed by workers that decode on the CPU
    (data.augment=gpu): the same batches as decoding in the workers; and an unreadable file named."""
    root = tmp_path / "train"
    for k, p in enumerate(photos):
        (root / f"c{k % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"c{k % 3}" / f"{k}.JPEG").write_bytes(_jpeg(p.resize((150, 110))))
    loader = _loader(root, workers=workers, thread=thread)
    loader.set_epoch(1)
    epoch = list(loader)
    if thread:
        in_workers = _loader(root, workers=workers)
        in_workers.set_epoch(1)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(epoch, in_workers))
    assert len(epoch) == len(loader) == 2  # 8 images, batches of 3, last one dropped
    order = list(loader.sampler)[:6]
    labels = torch.tensor([loader.loader.dataset.folder.samples[i][1] for i in order])
    assert torch.equal(torch.cat([y for _, y, _ in epoch]), labels)  # labels follow the sampler's order
    for x, _, skipped in epoch:
        assert x.shape == (3, 3, 32, 32) and x.dtype == torch.float32 and skipped == 0
    assert not torch.equal(epoch[0][0][0], epoch[0][0][1])
    loader.set_epoch(1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(epoch, loader))  # augmentation seeded per batch
    loader.set_epoch(1, start_batch=1)  # resuming mid-epoch: the same remaining batch
    rest = list(loader)
    assert len(rest) == 1 and torch.equal(rest[0][0], epoch[1][0]) and torch.equal(rest[0][1], epoch[1][1])
    loader.set_epoch(2)
    assert not torch.equal(next(iter(loader))[0], epoch[0][0])  # another epoch, other augmentation
    assert loader.cpu_decoded == 0
    (root / "c0" / "zz_garbage.JPEG").write_bytes(b"not an image")
    with pytest.raises(CorruptImageError, match="zz_garbage.JPEG"):
        list(_loader(root, batch=9, workers=workers, thread=thread))


def test_gpu_decode_workers_get_an_indexed_device_and_spawn(monkeypatch, tmp_path):
    """device=auto gives torch.device("cuda") without an index: a worker calls torch.cuda.set_device, which refuses
    that; and CUDA cannot be used in a forked worker, so GPU-decoding loaders spawn theirs (and pin nothing when
    decoding in the training process, where the batches are on the device already)."""
    from swin.data.loaders import _worker_settings
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert ga.indexed("cuda") == torch.device("cuda", 3) and ga.indexed("cuda:1") == torch.device("cuda", 1)
    assert ga.indexed("cpu") == torch.device("cpu")
    collate = DeviceCollate(torch.device("cuda"), ga.TrainTransform(ga.TrainSpec((8, 8))), skip_corrupt=False)
    assert collate.device == torch.device("cuda", 3) and collate.decoder.device == torch.device("cuda", 3)
    (tmp_path / "c0").mkdir()
    (tmp_path / "c0" / "a.JPEG").write_bytes(b"never read")
    ds = EncodedImageFolder(tmp_path, ga.TrainTransform(ga.TrainSpec((8, 8))), skip_corrupt=False)
    folder = to_settings(make_cfg("data=imagenet", "data.root=/nowhere").data)
    cfg = replace(folder, num_workers=4, batch_ring="host")  # (the default; a ring in the GPU's memory: below)
    spawned = _worker_settings(cfg, torch.device("cuda", 0), ds, batch_size=16)
    assert spawned["multiprocessing_context"] == "spawn" and not spawned["pin_memory"]  # the ring is pinned
    ring = spawned["collate_fn"].ring
    assert isinstance(spawned["collate_fn"], DeviceCollate) and isinstance(ring, BatchRing)
    # the DataLoader's batches in flight (2 per worker) and the consumer's unfinished reads
    assert ring.images.shape == (4 * 2 + BatchRing.in_flight_limit + 1, 16, 3, 8, 8) and ring.images.is_shared()
    assert not ring.on_device
    assert spawned["prefetch_factor"] == 2
    in_process = _worker_settings(replace(folder, num_workers=0), torch.device("cuda", 0), ds, batch_size=16)
    assert not in_process["pin_memory"] and "multiprocessing_context" not in in_process
    assert in_process["collate_fn"].ring is None
    assert "multiprocessing_context" not in _worker_settings(cfg, torch.device("cpu"), ds, batch_size=16)


def test_gpu_decode_workers_say_when_no_mps_daemon_runs(monkeypatch, tmp_path, caplog):
    """Without MPS the GPU time-slices the decoding workers' CUDA contexts with training (1.64x the step time beside
    8 of them on the H100, 1.01x under MPS): each such loader says so, naming the fix, and stays quiet under MPS
    (its pid file in CUDA_MPS_PIPE_DIRECTORY)."""
    from swin.data.gpu.decode import mps_running
    from swin.data.loaders import _worker_settings
    (tmp_path / "data" / "c0").mkdir(parents=True)
    (tmp_path / "data" / "c0" / "a.JPEG").write_bytes(b"never read")
    ds = EncodedImageFolder(tmp_path / "data", ga.TrainTransform(ga.TrainSpec((8, 8))), skip_corrupt=False)
    pipe = tmp_path / "mps"
    pipe.mkdir()
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe))
    assert not mps_running()
    folder = to_settings(make_cfg("data=imagenet", "data.root=/nowhere").data)
    with caplog.at_level("WARNING", logger="swin.data"):
        _worker_settings(replace(folder, num_workers=3), torch.device("cuda", 0), ds, 4)
        _worker_settings(replace(folder, num_workers=0), torch.device("cuda", 0), ds, 4)  # in this process: no contexts
    assert len(caplog.records) == 1 and "nvidia-cuda-mps-control -d" in caplog.text and "3 workers" in caplog.text
    (pipe / "control").touch()  # a daemon's sockets stay after it quits: its pid file goes
    (pipe / "nvidia-cuda-mps-control.pid").write_text("999999999")  # no such process
    assert not mps_running()
    (pipe / "nvidia-cuda-mps-control.pid").write_text(f"{os.getpid()}\n")  # a live one
    assert mps_running()
    caplog.clear()
    with caplog.at_level("WARNING", logger="swin.data"):
        _worker_settings(replace(folder, num_workers=3), torch.device("cuda", 0), ds, 4)
    assert not caplog.records


def test_workers_do_not_receive_device_constants():
    """The dataset carries the transform whose device constants the loader makes; pickled for spawn/forkserver
    workers, it leaves them behind."""
    import pickle
    tf = ga.TrainTransform(ga.TrainSpec((8, 8))).to("cpu")
    assert tf._consts and pickle.loads(pickle.dumps(tf))._consts == {}
    assert pickle.loads(pickle.dumps(tf)).spec == tf.spec


@pytest.mark.parametrize("thread", [False, True, "decoded"])
def test_train_py_with_gpu_decoding_on_the_cpu(photos, tmp_path, thread):
    """train.py with data.decode=gpu and the ImageNet recipe (RandAugment, random erasing, mixup/cutmix) on a JPEG
    folder with a CMYK file, a PNG named .JPEG and a garbage file, two loader workers (decoding, or reading files
    for a decoding thread: data.gpu_decode_thread; or decoding on the CPU for a thread that augments:
    data.decode=cpu data.augment=gpu): trains, counts and logs."""
    data = tmp_path / "data"
    files = {f"train/class{k % 2}/{k}.JPEG": _jpeg(p.resize((64, 48))) for k, p in enumerate(photos[:5])}
    files |= {f"val/class{k}/{k}.JPEG": _jpeg(photos[5 + k].resize((48, 64))) for k in range(2)}
    png = io.BytesIO()
    photos[7].resize((40, 40)).save(png, format="PNG")
    files |= {"train/class0/cmyk.JPEG": _jpeg(photos[6].resize((48, 64)).convert("CMYK")),
              "train/class1/png.JPEG": png.getvalue(), "train/class1/garbage.JPEG": b"garbage"}
    for name, blob in files.items():
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_bytes(blob)
    summary = train_inprocess(tmp_path / "run", *DET[:-1], "experiment=imagenet_swin_tiny", "model=swin_micro",
                              "model.drop_path_rate=0.0", f"data.root={data}", "data.num_workers=2",
                              "data.skip_corrupt=true", "train.batch_size=4", "train.epochs=1", "train.warmup_epochs=0",
                              *(["data.decode=cpu", "data.augment=gpu"] if thread == "decoded" else
                                ["data.decode=gpu", f"data.gpu_decode_thread={thread}"]))
    # 8 training files = 2 batches: the garbage file dropped; with nvJPEG, CMYK and PNG decoded on the CPU by the
    # workers (counted: with data.augment=gpu the workers decode every file on the CPU, none is a fallback)
    assert summary["skipped_images"] == 1 and summary["cpu_decoded_images"] == (0 if thread == "decoded" else 2)
    assert summary["final_top1"] is not None and math.isfinite(summary["final_train_loss"])
    log = (tmp_path / "run" / "train.log").read_text()
    if thread == "decoded":
        assert "data.augment=gpu: 2 loader worker(s) decode the images on the CPU" in log
    else:
        assert "data.decode=gpu" in log and "2 images decoded on the CPU" in log
        assert ("a thread of this process decodes them" in log) == thread


def test_decode_config_errors_name_the_value():
    def error(*overrides: str) -> str:
        cfg = make_cfg("data=imagenet", "data.root=/nowhere", *overrides)
        with pytest.raises(ConfigError) as e:
            check_config(cfg, 1, torch.device("cpu"))
        return str(e.value)

    msg = error("data.decode=nvjpeg")
    assert "data.decode='nvjpeg'" in msg and "cpu" in msg and "gpu" in msg and "\n" not in msg
    assert "data.auto_augment='augmix-m5'" in error("data.decode=gpu", "data.auto_augment=augmix-m5")
    assert "data.interpolation='lanczos'" in error("data.decode=gpu", "data.interpolation=lanczos")
    assert "hue" in error("data.decode=gpu", "data.auto_augment=null", "data.color_jitter=[0.4,0.4,0.4,0.1]")
    msg = error("data.gpu_decode_thread=true")
    assert "data.gpu_decode_thread=true" in msg and "data.decode=gpu" in msg and "\n" not in msg
    msg = error("data.gpu_ycbcr=true")
    assert "data.gpu_ycbcr=true" in msg and "data.decode=gpu" in msg and "\n" not in msg
    msg = error("data.decode=gpu", "data.batch_ring=pinned")
    assert "data.batch_ring='pinned'" in msg and "gpu" in msg and "host" in msg and "\n" not in msg
    msg = error("data.batch_ring=gpu")
    assert "data.batch_ring=gpu" in msg and "data.decode=gpu" in msg and "\n" not in msg
    msg = error("data.augment=tpu")
    assert "data.augment='tpu'" in msg and "cpu" in msg and "gpu" in msg and "\n" not in msg
    assert "data.augment=cpu with data.decode=gpu" in error("data.decode=gpu", "data.augment=cpu")
    assert "data.auto_augment='augmix-m5'" in error("data.augment=gpu", "data.auto_augment=augmix-m5")
    for ok in (["data.decode=gpu"], ["data.augment=gpu"], ["data.decode=gpu", "data.augment=gpu"],
               ["data.decode=gpu", "data.gpu_ycbcr=true"], ["data.decode=gpu", "data.batch_ring=host"]):
        check_config(make_cfg("data=imagenet", "data.root=/nowhere", *ok), 1, torch.device("cpu"))


# --- GPU ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_nvjpeg_matches_cpu_decoding(photos):
    """nvJPEG (batched, on the GPU) against libjpeg-turbo on the CPU: same shapes, and the same pixels up to the
    decoders' documented freedom. Without chroma subsampling (4:4:4, grey) both give (near) identical RGB: mean
    |difference| < 2 levels per channel, torchvision's own criterion. With 4:2:0 / 4:2:2 (baseline and progressive)
    they upsample chroma differently (libjpeg-turbo's "fancy" triangle filter), which on these images' per-pixel
    colour grain moves RGB by ~6-7 levels on average (H100, 2026-11-23), while luma, which no upsampling touches,
    stays within 0.45: there the criterion is luma < 1 level (a wrong IDCT or a shifted image would break it)."""
    cases = [(_jpeg(p), "4:2:0") for p in photos[:4]] + [(_jpeg(photos[4], subsampling=1), "4:2:2"),
                                                         (_jpeg(photos[5], subsampling=0), "4:4:4"),
                                                         (_jpeg(photos[6], progressive=True), "4:2:0"),
                                                         (_jpeg(photos[7].convert("L")), "grey")]
    blobs = [b for b, _ in cases]
    gpu = JpegDecoder(torch.device("cuda"), skip_corrupt=False).device_decode(
        [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs])
    luma = torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)
    for k, (g, c) in enumerate(zip(gpu, _decode_cpu(blobs))):
        kind = cases[k][1]
        assert g.is_cuda and g.dtype == torch.uint8 and g.shape == c.shape, (k, kind)
        g = g.cpu()
        if kind in ("4:4:4", "grey"):
            per_channel = _levels(g, c).float().mean(dim=(1, 2))
            assert (per_channel < 2).all(), (k, kind, per_channel)
        else:
            diff = ((g.float() * luma).sum(0) - (c.float() * luma).sum(0)).abs().mean()
            assert diff < 1, (k, kind, diff)
    # the training process decodes in calls of a few files (swin.data.gpu.decode.files_per_call): the same pixels
    for per_call in (1, FILES_PER_CALL_BESIDE_STEP):
        decoder = JpegDecoder(torch.device("cuda"), skip_corrupt=False)
        tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
        parts = [decoder.device_decode(tensors[i:i + per_call]) for i in range(0, len(blobs), per_call)]
        chunked = [img for part in parts for img in part]
        diffs = [_levels(a, b).float().mean().item() for a, b in zip(chunked, gpu)]
        assert max(diffs) == 0, (per_call, diffs)


@pytest.mark.gpu
def test_gpu_jpeg_engines_match_torchvision_and_leave_progressive_files_to_it(photos, tmp_path):
    """nvjpeg's decoder on the GPU's JPEG engines (the decoding thread's) against torchvision's nvJPEG: the
    same pixels for baseline files (4:2:0, 4:2:2, 4:4:4, grey), in calls of FILES_PER_CALL_BESIDE_STEP and of the
    rest, with the sizes engines_take reads from the headers; a progressive file is not one the engines take, and
    JpegDecoder decodes a call holding one with torchvision instead: the batch equals torchvision's, file for file."""
    from swin.data.gpu.nvjpeg import open_hardware_decoder
    engines = open_hardware_decoder(torch.device("cuda"), FILES_PER_CALL_BESIDE_STEP)
    if engines is None:
        pytest.skip("this GPU has no JPEG engines (or no libnvjpeg)")
    baseline = ([_jpeg(p) for p in photos[:4]] + [_jpeg(photos[4], subsampling=1), _jpeg(photos[5], subsampling=0),
                _jpeg(photos[7].convert("L"))]) * 2  # 14 files: calls of 6, 6 and 2
    tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in baseline]
    reference = JpegDecoder(torch.device("cuda"), skip_corrupt=False).device_decode(tensors)
    got = []
    for i in range(0, len(tensors), FILES_PER_CALL_BESIDE_STEP):
        planes = [engine_planes(b) for b in baseline[i:i + FILES_PER_CALL_BESIDE_STEP]]
        assert all(p is not None for p in planes), i
        got += engines.decode(tensors[i:i + FILES_PER_CALL_BESIDE_STEP], planes)
    for k, (a, b) in enumerate(zip(got, reference, strict=True)):
        assert a.is_cuda and a.shape == b.shape and torch.equal(a, b), (k, _levels(a, b).float().mean().item())
    assert engines_take(_jpeg(photos[6], progressive=True)) is None
    # through JpegDecoder, as the decoding thread uses it: a progressive file amid baseline ones
    root = tmp_path / "train" / "a"
    root.mkdir(parents=True)
    for k, data in enumerate(baseline[:7] + [_jpeg(photos[6], progressive=True)]):
        (root / f"{k}.JPEG").write_bytes(data)
    ds = EncodedImageFolder(tmp_path / "train", ga.EvalTransform(ga.EvalSpec(64)), skip_corrupt=False)
    batch = collate_encoded([ds[i] for i in range(len(ds))])
    plain = JpegDecoder(torch.device("cuda"), skip_corrupt=False)
    with_engines = JpegDecoder(torch.device("cuda"), skip_corrupt=False)
    with_engines.engines = engines
    want, got_batch = plain(batch, FILES_PER_CALL_BESIDE_STEP), with_engines(batch, FILES_PER_CALL_BESIDE_STEP)
    assert len(got_batch[0]) == len(want[0]) == 8 and got_batch[2:] == want[2:]
    for a, b in zip(got_batch[0], want[0]):
        assert torch.equal(a, b)


def test_device_collate_sends_no_cuda_objects_to_workers():
    """A DeviceCollate travels to spawned loader workers pickled: its decoder's engines and stream stay behind, and
    a worker opens its own."""
    import pickle
    import threading
    collate = DeviceCollate(torch.device("cpu"), ga.TrainTransform(ga.TrainSpec((8, 8), ycbcr=True)), False)
    collate.decoder.engines, collate.decoder._stream = threading.Lock(), threading.Lock()  # cannot be pickled
    collate.decoder.engines_opened = True
    copy = pickle.loads(pickle.dumps(collate))
    assert copy.decoder.engines is None and copy.decoder._stream is None and not copy.decoder.engines_opened
    assert copy.decoder.ycbcr and copy.transform.spec.ycbcr


@pytest.mark.gpu
def test_gpu_jpeg_engines_ycbcr_planes_crop_like_nvjpeg_rgb(photos, tmp_path):
    """YUV output of the JPEG engines (4:2:0, 4:2:2, 4:4:4 files, odd sizes): the planes nvJPEG reports, and crops
    of them (swin.data.gpu.crop_resize converting to RGB) close to the same crops of nvJPEG's RGB. Through DeviceCollate
    with a ycbcr TrainSpec, a batch mixing those files with grey and progressive ones (decoded in RGB by
    torchvision) comes out like the RGB pipeline's, image for image."""
    from swin.data.gpu.crop_resize import YCbCrImage, crop_resize
    from swin.data.gpu.nvjpeg import open_hardware_decoder
    engines = open_hardware_decoder(torch.device("cuda"), 6, ycbcr=True)
    if engines is None:
        pytest.skip("this GPU has no JPEG engines (or no libnvjpeg)")
    files = [_jpeg(p.resize((p.size[0] | 1, p.size[1] | 1)), subsampling=s)
             for p, s in zip(photos, (2, 2, 1, 0, 2, 2))]
    planes = [engine_planes(f) for f in files]
    assert [engines.decoders[6].plane_sizes(f) for f in files] == planes  # nvJPEG reads the headers alike
    assert engines.call_sizes(6) == [6] and engines.call_sizes(5) == [4, 1]  # few decoder sizes, whatever the split
    tensors = [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in files]
    ycbcr = engines.decode(tensors, planes)
    rgb = JpegDecoder(torch.device("cuda"), skip_corrupt=False).device_decode(tensors)
    assert all(isinstance(i, YCbCrImage) and i.y.is_cuda for i in ycbcr)
    assert all(i.y.float().std() > 10 and i.cr.float().std() > 1 for i in ycbcr)  # written, not left empty
    rng = _rng()
    plan = ga.plan_batch(ga.TrainSpec(size=(224, 224), interpolation="random"), ga.image_sizes(rgb), rng)
    got = crop_resize(ycbcr, plan.boxes, plan.modes, (224, 224), flips=plan.flips)
    want = crop_resize(rgb, plan.boxes, plan.modes, (224, 224), flips=plan.flips)
    diff = _levels(got, want).float()
    # (H100: 1.55 levels on average, 1.4% over 8: libjpeg-style chroma upsampling against resampling each plane)
    assert diff.mean() < 2.5 and (diff > 16).float().mean() < 0.01, (diff.mean(), (diff > 16).float().mean())
    # DeviceCollate in a training batch: baseline files by the engines in YCbCr, grey and progressive ones in RGB
    root = tmp_path / "train" / "a"
    root.mkdir(parents=True)
    # a grey file inside the first call of 6 (split between the engines and torchvision), a progressive one after
    mixed = files[:2] + [_jpeg(photos[6].convert("L"))] + files[2:] + [_jpeg(photos[7], progressive=True)]
    for k, data in enumerate(mixed):
        (root / f"{k}.JPEG").write_bytes(data)
    spec = ga.TrainSpec(size=(96, 96), rand_augment=ga.parse_rand_augment("rand-m9-mstd0.5-inc1"))
    batches = {}
    for flag in (True, False):
        ds = EncodedImageFolder(tmp_path / "train", ga.TrainTransform(replace(spec, ycbcr=flag)), skip_corrupt=False)
        collate = DeviceCollate(torch.device("cuda"), ds.device_transform, skip_corrupt=False, seed=3)
        batches[flag] = collate([ds[i] for i in range(len(ds))])
        assert (collate.decoder.engines is not None) is flag and batches[flag][3] == []
    (a, ya, *_), (b, yb, *_) = batches[True], batches[False]
    assert a.shape == b.shape == (len(mixed), 3, 96, 96) and torch.equal(ya, yb)
    per_image = _levels(a, b).float().flatten(1).mean(1)
    assert per_image[2] == per_image[7] == 0 and (per_image < 3).all(), per_image  # grey, progressive: RGB alike


@pytest.mark.gpu
def test_gpu_transforms_match_the_cpu_on_identical_inputs(photos):
    """The same plan on the same decoded images, on CUDA (kernels) and on the CPU (PyTorch ops): the crops within 1
    level on under 1% of values, each RandAugment layer from the same input within 1 level (nearest affine: but a
    few pixels), the whole chain close (1-level differences compound through later thresholds and tables)."""
    from swin.data.gpu.crop_resize import crop_resize
    images = _decode_cpu([_jpeg(p) for p in photos]) * 4
    spec = ga.TrainSpec(size=(224, 224), interpolation="random",
                        rand_augment=ga.parse_rand_augment("rand-m9-n3-p0.9-mstd0.5-inc1"))
    tf = ga.TrainTransform(spec)
    plan = tf.plan([tuple(i.shape[-2:]) for i in images], _rng())
    cpu = tf.apply(images, plan)
    gpu = tf.apply([i.cuda() for i in images], plan).cpu()
    # the stages apart, to tell which one differs: the crops, then the flips and layers from the same crops
    crops = ga.resized_crops(images, plan.boxes, plan.modes, spec.size)
    crop_diff = _levels(crop_resize([i.cuda() for i in images], plan.boxes, plan.modes, spec.size).cpu(), crops)
    assert crop_diff.max() <= 1 and (crop_diff > 0).float().mean() < 0.01, crop_diff.float().mean()
    # each layer from the same input (a 1-level difference can move a later lookup table or threshold by more):
    # nearest-exact from the whole image (the image itself), no flips, that layer only
    whole = np.array([[0, 0, *spec.size]] * len(images))
    x = crops
    for ops, args in plan.layers:
        one = ga.BatchPlan(whole, np.full(len(images), 2), np.zeros(len(images), dtype=bool), [(ops, args)])
        want = ga.TrainTransform(spec, kernels=False).apply(list(x), one)
        assert _layer_levels(tf.apply([i.cuda() for i in x], one).cpu(), want, ops).max() <= 1
        x = want
    diff = _levels(gpu, cpu).float()  # the whole chain: differences compound, but stay rare
    assert diff.mean() < 1 and (diff > 1).float().mean() < 0.05, (diff.mean(), (diff > 1).float().mean())
    ev = ga.EvalTransform(ga.EvalSpec(224))
    assert _levels(ev([i.cuda() for i in images]).cpu(), ev(images)).max() <= 1


def _fingerprints(loader, busy: torch.Tensor | None = None) -> torch.Tensor:
    """Per image: mean and standard deviation of the normalised image, and its label (on the device)."""
    prints = []
    for x, y, _ in loader:
        if busy is not None:  # keep the consumer's stream busy: the next batches' work overlaps it
            b = busy
            for _ in range(10):
                b = b @ busy / 64
            x = x + 0 * b[0, 0]
        prints.append(torch.stack([x.mean(dim=(1, 2, 3)), x.std(dim=(1, 2, 3)), y.float()], 1))
        del x, y  # freed while the consumer's kernels reading them may still be queued
    return torch.cat(prints)


@pytest.mark.gpu
@pytest.mark.parametrize("workers, thread, ring", [(0, False, "gpu"), (2, False, "gpu"), (2, False, "host"),
                                                   (2, True, "gpu"), (2, "decoded", "gpu")])
def test_gpu_decode_loader_batches_intact_without_syncing(photos, tmp_path, workers, thread, ring):
    """CUDA: batches decoded and augmented on the GPU by spawned workers (or by this process, or by a decoding thread
    fed by workers: data.gpu_decode_thread; or decoded on the CPU by workers and augmented on the GPU by a thread:
    data.augment=gpu), the workers' batches left in a ring in pinned host memory (data.batch_ring=host, the default)
    or in the GPU's memory, normalised (copied first from the host) on the loader's side stream one batch ahead,
    consumed on the default stream while it is kept busy and frees every batch; with decoding workers, CUDA sync
    debug mode 'error' catches a host sync torch makes in this process (in-process decoding and the decoding thread
    wait for nvJPEG by design). The batches equal the CPU pipeline's on the same files
    (same order, seeds and plans) up to nvJPEG-vs-libjpeg differences: evaluation batches' per-image mean and
    standard deviation within 2 levels, RandAugment batches within 12 (posterize and solarize thresholds amplify
    1-level decode differences)."""
    from swin.data.loaders import build_loaders
    root = tmp_path / "train"
    for k in range(48):
        d = root / f"c{k % 4}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{k}.JPEG").write_bytes(_jpeg(photos[k % len(photos)].rotate(90 * (k // 8), expand=True)))
    cfg = make_cfg("experiment=imagenet_swin_tiny", f"data.root={tmp_path}", "data.val_dir=train",
                   f"data.num_workers={workers}", "data.reprob=0", f"data.batch_ring={ring}",
                   *(["data.decode=cpu", "data.augment=gpu"] if thread == "decoded" else
                     ["data.decode=gpu", f"data.gpu_decode_thread={thread}"])).data
    cfg = to_settings(cfg)
    prints = {}
    busy = torch.randn(2048, 2048, device="cuda")
    for device in ("cpu", "cuda"):
        train, val = build_loaders(build_datasets(cfg, 224), cfg, torch.device(device), 0, 1, 8, 8, seed=0)
        if device == "cuda" and workers and not thread:
            assert train.loader.collate_fn.ring.on_device == (ring == "gpu")
        train.set_epoch(0)
        torch.cuda.synchronize()
        # (sync debug mode is process-wide: a decoding thread, which waits for nvJPEG by design, would trip it)
        torch.cuda.set_sync_debug_mode("error" if device == "cuda" and workers and not thread else "default")
        try:
            prints[device] = [_fingerprints(loader, busy if device == "cuda" else None) for loader in (train, val)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for k, tolerance in enumerate((12, 2)):
        got, want = prints["cuda"][k].cpu().double(), prints["cpu"][k].double()
        assert got.shape == want.shape == (48, 3)
        assert torch.equal(got[:, 2], want[:, 2])  # the same images in the same order
        worst = ((got[:, :2] - want[:, :2]).abs() * STD_LEVELS).max(dim=0).values  # mean, std: in levels
        assert worst.max() < tolerance, (["train", "eval"][k], worst.tolist())
