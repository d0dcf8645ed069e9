"""``data.decode=gpu``: the loader worker processes read the JPEG files, decode whole batches with nvJPEG
(``torchvision.io.decode_jpeg(list, device="cuda")``) and augment them on the GPU (swin.data.gpu.augment); the training
process receives uint8 batches like those of CPU decoding and normalises them on the device
(swin.data.loaders.DeviceLoader).

Why: per image, PIL decoding a JPEG plus RandomResizedCrop and RandAugment costs several milliseconds of CPU time,
so the CPU cores of a GPU machine feed a Swin model fewer images than one GPU trains on. Why in the workers and not
in the training process: nvJPEG's Huffman stage runs on the calling CPU thread and the batch's crops and
augmentation launch many small kernels; in the training process that host time shares the GIL with the training
loop and slows it down, and one process decodes only so fast however many threads it uses. Each worker has its own
CUDA context (spawned, as CUDA requires); the batch goes to the training process in a slot of a ring of buffers it
made once (swin.data.gpu.batch_ring), in pinned host memory (data.batch_ring=host, the default) or in the GPU's
memory (opened by each worker over CUDA IPC when it starts; data.batch_ring=gpu), and only the slot's number
travels: a new CUDA tensor shared per batch would synchronise its receiver when freed.

Pieces, in the order a batch meets them (all in a worker process; in the training process with num_workers=0):

* :class:`EncodedImageFolder`: the file's bytes, its label and its index. A few files are not baseline or
  progressive 8-bit JPEGs with 1 or 3 components (ImageNet has CMYK JPEGs and a PNG named .JPEG); the worker sees
  that from the header (:func:`jpeg_frame`) and decodes those on the CPU, counted.
* :func:`collate_encoded`: the batch's files in ONE uint8 tensor with their lengths, the CPU-decoded images and
  the labels.
* :class:`JpegDecoder`: one batched decode on the device; if nvJPEG rejects the batch, each image is retried alone
  and the ones it still rejects are decoded on the CPU (counted, never a crash; unreadable files are dropped and
  counted with ``data.skip_corrupt``, else an error names the file).
* :class:`DeviceCollate`: the loader's ``collate_fn``: the three above, then the transform, seeded by the batch's
  sample indices (the same augmentation for the same batch after a resume mid-epoch); returns
  ``(uint8 images, targets, dropped files, CPU-decoded paths)`` for swin.data.loaders.DeviceLoader.

``data.decode=cpu data.augment=gpu`` takes the other split: the workers decode on the CPU (libjpeg-turbo:
:class:`DecodedImageFolder`) and send each batch packed in one buffer
(:func:`collate_decoded`); a thread of the training process copies it to the device and augments it there
(:class:`DecodeThread`). The training process keeps the only CUDA context, and its host work per batch is one copy
and a handful of kernel launches.

With ``device="cpu"`` everything runs on the CPU, the same code: that is what the CPU tests check.
"""
from __future__ import annotations

import contextlib
import io
import os
import queue
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from swin.data.folder import CheckedImageFolder, readable, unreadable_image
from swin.data.gpu.augment import EvalTransform, PackedImages, TrainTransform, indexed
from swin.data.gpu.batch_ring import BatchRing, RingSlot
from swin.data.gpu.crop_resize import YCbCrImage
from swin.data.gpu.nvjpeg import HardwareJpegDecoder, open_hardware_decoder

# torchvision 0.29 deprecates its image codecs in favour of TorchCodec (they still work); one warning per decode
# call would flood the log
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                        category=DeprecationWarning)

# start-of-frame markers (SOF0..SOF15 without DHT C4, JPG C8, DAC CC)
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# baseline, extended sequential and progressive Huffman frames: what nvJPEG decodes (progressive in software)
_NVJPEG_SOF = (0xC0, 0xC1, 0xC2)


def mps_running() -> bool:
    """Whether an MPS control daemon runs (the pid file in its pipe directory, CUDA_MPS_PIPE_DIRECTORY, default
    /tmp/nvidia-mps, names a live process; its sockets outlive it): CUDA processes started now share the GPU
    instead of taking turns. Without MPS, worker processes decoding on the GPU slow the training step down heavily
    (their contexts time-slice with its context); under MPS hardly at all."""
    pipe = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"))
    try:
        pid = int((pipe / "nvidia-cuda-mps-control.pid").read_text().strip())
    except (OSError, ValueError):
        return False
    return Path(f"/proc/{pid}").exists()


def _header(data: bytes | memoryview) -> tuple[int | None, int | None]:
    """(offset of a JPEG file's frame header (its SOF marker), the colour transform of an Adobe APP14 marker before
    it: 0 the components as stored, RGB for three; 1 YCbCr; None without one). The offset is None when ``data``
    does not start like a JPEG file or no frame header comes before the scan."""
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None, None
    i, adobe = 2, None
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None, adobe
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image or start of scan before any frame header
            return None, adobe
        if marker in _SOF:
            return (i if i + 10 <= n else None), adobe
        length = (data[i + 2] << 8) | data[i + 3]
        if marker == 0xEE and length >= 14 and i + 15 < n and bytes(data[i + 4:i + 9]) == b"Adobe":
            adobe = data[i + 15]
        i += 2 + length
    return None, adobe


def jpeg_frame(data: bytes | memoryview) -> tuple[int, int, int, int, int] | None:
    """(SOF marker, sample precision, height, width, components) from a JPEG header, or None when ``data`` does
    not start like a JPEG file or no frame header comes before the scan."""
    i = _header(data)[0]
    if i is None:
        return None
    return (data[i + 1], data[i + 4], (data[i + 5] << 8) | data[i + 6], (data[i + 7] << 8) | data[i + 8],
            data[i + 9])


# luma sampling factors (H << 4 | V) of the subsamplings the JPEG engines decode (4:4:4, 4:2:2, 4:2:0, 4:4:0,
# 4:1:1, 4:1:0), chroma at 1x1
_ENGINE_LUMA = frozenset((0x11, 0x21, 0x22, 0x12, 0x41, 0x42))


def engine_planes(data: bytes | memoryview) -> list[tuple[int, int]] | None:
    """(height, width) of each plane of a file the GPU's JPEG engines decode: baseline (SOF0), 8-bit, grey (one
    plane) or YCbCr with a standard subsampling (luma, then Cb and Cr as stored: what nvJPEG's YUV output holds);
    None for any other (progressive, say, or three components stored as RGB, as libjpeg tells them: component ids
    'R', 'G', 'B' or Adobe's transform 0; torchvision's nvJPEG path takes those)."""
    i, adobe = _header(data)
    if i is None or data[i + 1] != 0xC0 or data[i + 4] != 8 or data[i + 9] not in (1, 3) or i + 19 > len(data):
        return None
    if data[i + 9] == 3 and (data[i + 11] not in _ENGINE_LUMA or data[i + 14] != 0x11 or data[i + 17] != 0x11):
        return None
    height, width = (data[i + 5] << 8) | data[i + 6], (data[i + 7] << 8) | data[i + 8]
    if not height or not width:
        return None
    if data[i + 9] == 1:
        return [(height, width)]
    if (data[i + 10], data[i + 13], data[i + 16]) == (0x52, 0x47, 0x42) or adobe == 0:
        return None
    chroma = (-(-height // (data[i + 11] & 0xF)), -(-width // (data[i + 11] >> 4)))  # rounded up, as libjpeg
    return [(height, width), chroma, chroma]


def engines_take(data: bytes | memoryview) -> tuple[int, int] | None:
    """(height, width) of a file the GPU's JPEG engines decode (see engine_planes), else None."""
    planes = engine_planes(data)
    return None if planes is None else planes[0]


def nvjpeg_can_decode(data: bytes) -> bool:
    """Whether a file looks like a JPEG nvJPEG decodes: 8-bit Huffman (baseline, extended or progressive), grey or
    three components. CMYK/YCCK (4 components), 12-bit, arithmetic-coded and non-JPEG files go to the CPU."""
    frame = jpeg_frame(data)
    return frame is not None and frame[0] in _NVJPEG_SOF and frame[1] == 8 and frame[4] in (1, 3)


def decode_on_cpu(data: bytes) -> torch.Tensor:
    """A (3, H, W) uint8 RGB image from any file torchvision or PIL can read (the fallback path); raises if none."""
    from torchvision.io import ImageReadMode, decode_image
    try:
        return decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except Exception:
        from PIL import Image  # formats torchvision's decoders lack
        with Image.open(io.BytesIO(data)) as img:
            return torch.from_numpy(np.asarray(img.convert("RGB")).copy()).permute(2, 0, 1).contiguous()


# --- workers -----------------------------------------------------------------------------------------------------
class EncodedImageFolder(CheckedImageFolder):
    """An ImageFolder listing whose samples are ``(file bytes, label, path, index)``, or ``(decoded image, label,
    path, index)`` for files nvJPEG cannot decode. ``device_transform`` (swin.data.gpu.augment) is what the loader
    applies on the device after decoding. Unreadable files raise an error naming the file, or (``skip_corrupt``)
    give None."""

    def __init__(self, root: Path, device_transform: TrainTransform | EvalTransform, skip_corrupt: bool):
        super().__init__(root, None, skip_corrupt)  # lists files only; nothing is opened here
        self.device_transform = device_transform

    def read(self, path: str) -> bytes | torch.Tensor:
        data = Path(path).read_bytes()
        return data if nvjpeg_can_decode(data) else decode_on_cpu(data)

    def sample(self, image: bytes | torch.Tensor, target: int, path: str) -> tuple[bytes | torch.Tensor, int, str]:
        return image, target, path

    def __getitem__(self, i: int) -> tuple[bytes | torch.Tensor, int, str, int] | None:
        s = super().__getitem__(i)
        return None if s is None else (*s, i)  # the index seeds the batch's augmentation


class DecodedImageFolder(EncodedImageFolder):
    """data.decode=cpu with data.augment=gpu: the workers decode every file on the CPU (libjpeg-turbo through
    torchvision, PIL for other formats) and a thread of the training process augments on the device. Samples are
    ``(decoded (3, H, W) uint8 image, label, path, index)``."""

    def read(self, path: str) -> torch.Tensor:
        return decode_on_cpu(Path(path).read_bytes())


@dataclass
class EncodedBatch:
    """A batch of files: the JPEGs back to back in ``data`` (``sizes[k]`` bytes for slot k, 0 for slots decoded on
    the CPU already), the CPU-decoded images of slots ``decoded_slots`` packed in ``decoded`` (one buffer: one
    tensor to share between processes, pin and copy), labels, paths, dataset indices and dropped files.
    ``pin_memory`` lets the DataLoader pin it."""

    data: torch.Tensor
    sizes: list[int]
    decoded_slots: list[int]
    decoded: PackedImages
    targets: torch.Tensor
    paths: list[str]
    indices: list[int]
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.sizes)

    def pin_memory(self) -> EncodedBatch:
        return replace(self, data=self.data.pin_memory(), targets=self.targets.pin_memory(),
                       decoded=self.decoded.pin_memory())


def collate_encoded(samples: Sequence[tuple[bytes | torch.Tensor, int, str, int] | None]) -> EncodedBatch:
    kept = readable(samples)
    blobs = [s[0] if isinstance(s[0], bytes) else b"" for s in kept]
    joined = bytearray().join(blobs)  # one host buffer: nvJPEG reads the files from host memory
    data = torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
    slots = [k for k, s in enumerate(kept) if isinstance(s[0], torch.Tensor)]
    return EncodedBatch(data=data, sizes=[len(b) for b in blobs], decoded_slots=slots,
                        decoded=_pack_for_sending([kept[k][0] for k in slots]),
                        targets=torch.tensor([s[1] for s in kept], dtype=torch.long), paths=[s[2] for s in kept],
                        indices=[s[3] for s in kept], skipped=len(samples) - len(kept))


def _pack_for_sending(images: list[torch.Tensor]) -> PackedImages:
    """``images`` packed into one buffer, in shared memory in a worker process: every tensor sent apart costs the
    receiver a round trip to the worker for its file descriptor."""
    return PackedImages.pack(images, shared=get_worker_info() is not None)


@dataclass
class DecodedBatch:
    """A batch of images decoded by the workers (:class:`DecodedImageFolder`), packed into one buffer, with their
    labels, paths, dataset indices and dropped files. ``pin_memory`` lets the DataLoader pin it whole."""

    images: PackedImages
    targets: torch.Tensor
    paths: list[str]
    indices: list[int]
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.images)

    def pin_memory(self) -> DecodedBatch:
        return replace(self, images=self.images.pin_memory(), targets=self.targets.pin_memory())


def collate_decoded(samples: Sequence[tuple[torch.Tensor, int, str, int] | None]) -> DecodedBatch:
    """The ``collate_fn`` of data.augment=gpu with CPU decoding: the images packed into one buffer (in shared
    memory in a worker process, where sending it would otherwise copy it there)."""
    kept = readable(samples)
    return DecodedBatch(_pack_for_sending([s[0] for s in kept]),
                        torch.tensor([s[1] for s in kept], dtype=torch.long), [s[2] for s in kept],
                        [s[3] for s in kept], skipped=len(samples) - len(kept))


# --- decoding and augmenting (in a worker process) -----------------------------------------------------------
# Beside a training step that keeps the GPU busy, nvJPEG's hardware engines decode calls of a few files (no more
# than the GPU has engines) nearly as fast as alone, but calls of 8 or more files much slower. The training process
# (num_workers=0) therefore decodes in calls of this many.
FILES_PER_CALL_BESIDE_STEP = 6


def files_per_call(device: torch.device) -> int:
    """Files per decode call on ``device``: FILES_PER_CALL_BESIDE_STEP in the training process on CUDA, else 0 (the
    whole batch in one call, fastest alone; the slowdown above concerns calls from the training process, beside its
    own step)."""
    return FILES_PER_CALL_BESIDE_STEP if device.type == "cuda" and get_worker_info() is None else 0


class JpegDecoder:
    """Decodes an :class:`EncodedBatch` on ``device``: batched calls of ``files_per_call`` files (0: all in one), by
    the GPU's JPEG engines (``engines``, nvjpeg) the files they take, the others by torchvision's nvJPEG; if a
    call fails, each of its images alone, and the CPU for those nvJPEG rejects. The engines are the decoding
    thread's (DecodeThread sets them, RGB output), or with ``ycbcr`` opened on the first CUDA call (YUV output:
    training batches, whose crop kernels convert the planes to RGB; where the GPU has no engines, torchvision's RGB).

    On CUDA it decodes on a stream of its own, waited for before each call: nvJPEG's engines write their outputs
    without waiting for work queued on the stream (pytorch/vision#9606), so a block freed by kernels still queued
    could be overwritten. The caller's stream then waits for the decode, and the images are recorded on it."""

    def __init__(self, device: torch.device, skip_corrupt: bool, ycbcr: bool = False):
        self.device, self.skip_corrupt, self.ycbcr = torch.device(device), skip_corrupt, ycbcr
        self.engines: HardwareJpegDecoder | None = None  # the GPU's JPEG engines (swin.data.gpu.nvjpeg)
        self._stream: torch.cuda.Stream | None = None
        self.engines_opened = False  # (once, in the process that decodes)

    def __getstate__(self) -> dict[str, Any]:
        # sent to spawned loader workers before any decoding: no CUDA objects travel
        return {**self.__dict__, "engines": None, "_stream": None, "engines_opened": False}

    def open_engines(self, files_per_call: int) -> None:
        """Decode with the GPU's JPEG engines from now on, where it has them (YUV output with ``ycbcr``)."""
        self.engines_opened = True
        with torch.cuda.device(self.device):
            self.engines = open_hardware_decoder(self.device, files_per_call, ycbcr=self.ycbcr)

    def device_decode(self, blobs: list[torch.Tensor]) -> list[torch.Tensor]:
        """nvJPEG on CUDA (batched), libjpeg-turbo on the CPU; RGB output also for grey images."""
        from torchvision.io import ImageReadMode, decode_jpeg
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # see the class: nothing queued when it writes
        return decode_jpeg(blobs, mode=ImageReadMode.RGB, device=self.device)

    def _decode_alone(self, blob: torch.Tensor, path: str, on_cpu: list[str]) -> torch.Tensor | None:
        try:
            return self.device_decode([blob])[0]
        except RuntimeError:
            pass
        try:
            img = decode_on_cpu(blob.numpy().tobytes())
        except Exception as e:
            if self.skip_corrupt:
                return None
            raise unreadable_image(path, e) from None
        on_cpu.append(path)
        return img.to(self.device, non_blocking=True)

    def _decode_call(self, blobs: list[torch.Tensor], headers: list[memoryview]) -> list[torch.Tensor | YCbCrImage]:
        """One call's files: by the engines those they take (with YCbCr output only files of three components),
        the others by torchvision's nvJPEG, in RGB."""
        if self.engines is None:
            return self.device_decode(blobs)
        planes = [engine_planes(h) for h in headers]
        on_engines = [k for k, p in enumerate(planes) if p is not None and (len(p) == 3 or not self.engines.ycbcr)]
        images: list[torch.Tensor | YCbCrImage | None] = [None] * len(blobs)
        if on_engines:
            decoded = self.engines.decode([blobs[k] for k in on_engines], [planes[k] for k in on_engines])
            for k, img in zip(on_engines, decoded):
                images[k] = img
        rest = [k for k, img in enumerate(images) if img is None]
        if rest:
            for k, img in zip(rest, self.device_decode([blobs[k] for k in rest])):
                images[k] = img
        return images

    def __call__(self, batch: EncodedBatch, per_call: int = 0
                 ) -> tuple[list[torch.Tensor | YCbCrImage], torch.Tensor, int, list[str]]:
        """(decoded (3, H, W) uint8 images, or YCbCr planes, on the device, their labels, files dropped in this
        batch, paths of the files decoded on the CPU: here, or already by the dataset)."""
        if self.device.type != "cuda":
            return self._decode(batch, per_call)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        if self.ycbcr and not self.engines_opened:
            self.open_engines(per_call or len(batch))
        caller = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            decoded = self._decode(batch, per_call)
        caller.wait_stream(self._stream)
        for img in decoded[0]:
            img.record_stream(caller)
        return decoded

    def _decode(self, batch: EncodedBatch, per_call: int
                ) -> tuple[list[torch.Tensor | YCbCrImage], torch.Tensor, int, list[str]]:
        images: list[torch.Tensor | None] = [None] * len(batch)
        on_cpu = [batch.paths[k] for k in batch.decoded_slots]
        slots = [k for k, n in enumerate(batch.sizes) if n > 0]
        ends = np.cumsum(batch.sizes).tolist()
        whole = memoryview(batch.data.numpy())  # header reads without copies
        step = per_call or len(slots) or 1
        for start in range(0, len(slots), step):
            part = slots[start:start + step]
            spans = [(ends[k] - batch.sizes[k], ends[k]) for k in part]
            blobs = [batch.data[a:b] for a, b in spans]  # views, no copies
            try:
                decoded = self._decode_call(blobs, [whole[a:b] for a, b in spans])
            except RuntimeError:  # nvJPEG fails the whole call for one bad file: find it
                decoded = [self._decode_alone(b, batch.paths[k], on_cpu) for k, b in zip(part, blobs)]
            for k, img in zip(part, decoded):
                images[k] = img
        if batch.decoded_slots:
            for k, img in zip(batch.decoded_slots, batch.decoded.to(self.device, non_blocking=True).unpack()):
                images[k] = img
        kept = readable(images)
        keep = [k for k, img in enumerate(images) if img is not None]
        targets = batch.targets if len(keep) == len(images) else batch.targets[keep]
        return kept, targets, batch.skipped + len(images) - len(keep), on_cpu


class DeviceCollate:
    """The ``collate_fn`` of data.decode=gpu loaders: a batch of :class:`EncodedImageFolder` samples decoded on
    ``device`` and transformed there (``transform``: swin.data.gpu.augment's TrainTransform or EvalTransform), as
    ``(uint8 images, targets, dropped files, paths decoded on the CPU)``; swin.data.DeviceLoader normalises and
    counts them. In a worker process the images go to the training process in a slot of ``ring`` (batch_ring,
    in shared host or GPU memory: images and targets; the batch's first element is then its RingSlot, the second
    None), else in a new shared host tensor per batch; in the training process itself (num_workers=0) they stay on
    the device.

    Random choices come from a generator seeded by ``seed`` and the batch's sample indices, which the sampler
    draws per epoch (and rank): the same batch gets the same augmentation after a resume mid-epoch."""

    def __init__(self, device: torch.device, transform: TrainTransform | EvalTransform, skip_corrupt: bool,
                 seed: int = 0, ring: BatchRing | None = None):
        # with its index: a worker makes it its current device (set_device refuses a bare "cuda")
        self.device, self.transform, self.seed, self.ring = indexed(device), transform, seed, ring
        self.decoder = JpegDecoder(self.device, skip_corrupt, ycbcr=getattr(transform.spec, "ycbcr", False))

    def __call__(self, samples: Sequence[tuple[bytes | torch.Tensor, int, str, int] | None]
                 ) -> tuple[torch.Tensor | RingSlot, torch.Tensor | None, int, list[str]]:
        images, targets, skipped, on_cpu = self.transform_batch(collate_encoded(samples))
        if get_worker_info() is None:
            return images, targets, skipped, on_cpu
        if self.ring is not None:  # the images and targets travel in a slot of the ring (swin.data.gpu.batch_ring)
            return self.ring.put(images, targets), None, skipped, on_cpu
        if images.device.type != "cpu":
            # into shared memory directly (sending a worker's tensor moves it there otherwise: one more copy)
            images = torch.empty(images.shape, dtype=images.dtype).share_memory_().copy_(images)
        return images, targets, skipped, on_cpu

    def transform_batch(self, batch: EncodedBatch) -> tuple[torch.Tensor, torch.Tensor, int, list[str]]:
        """A collated batch of files decoded and transformed on the device (see the class)."""
        images, targets, skipped, on_cpu = self.decode(batch)
        return self.augment(images, batch.indices), targets, skipped, on_cpu

    def decode(self, batch: EncodedBatch | DecodedBatch
               ) -> tuple[list[torch.Tensor] | PackedImages, torch.Tensor, int, list[str]]:
        """(decoded images on the device, their labels, files dropped, paths nvJPEG left to the CPU). A batch the
        workers decoded already (DecodedBatch) is copied to the device (asynchronously, when pinned)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if isinstance(batch, DecodedBatch):
            return batch.images.to(self.device, non_blocking=True), batch.targets, batch.skipped, []
        return self.decoder(batch, files_per_call(self.device))

    def augment(self, images: list[torch.Tensor] | PackedImages, indices: list[int]) -> torch.Tensor:
        """The transform of a batch's decoded images, drawn from the generator of the batch's sample indices."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        with torch.no_grad():
            return self.transform(images, np.random.default_rng([self.seed % 2**32, *indices]))


class DecodeThread:
    """``data.gpu_decode_thread=true``: the loader's workers only read files (``collate_fn=collate_encoded``); two
    threads of the training process decode (DeviceCollate.decode; the GPU's JPEG engines through nvjpeg where
    it has them) and transform (DeviceCollate.augment) each batch, overlapped, each on a CUDA stream of its own
    (``data.augment=gpu`` with CPU decoding: the workers decode, ``collate_fn=collate_decoded``, and the first thread
    only copies each packed batch to the device). The transforming thread waits for its stream (that thread only,
    never the training loop) and hands the batch over through a queue of ``prefetch`` batches, in the sampler's
    order. No second CUDA context time-slices the GPU with the training step, as the workers' do; nvJPEG gets a few
    files per call (files_per_call). An error in either thread is raised in the consumer. Iterated like the
    DataLoader it wraps (``dataset``, ``batch_size``, ``len``), by swin.data.loaders.DeviceLoader."""

    def __init__(self, loader: Any, collate: DeviceCollate, prefetch: int = 2):
        self.loader, self.collate, self.prefetch = loader, collate, prefetch
        self.dataset, self.batch_size = loader.dataset, loader.batch_size

    def __len__(self) -> int:
        return len(self.loader)

    def _stream(self) -> torch.cuda.Stream | None:
        device = self.collate.device
        return torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def _decode(self, out: queue.Queue, stop: threading.Event) -> None:
        stream, decoder = self._stream(), self.collate.decoder
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if stream is not None and not decoder.engines_opened and self.loader.collate_fn is collate_encoded:
                    decoder.open_engines(files_per_call(self.collate.device))
                for batch in self.loader:
                    images, targets, skipped, on_cpu = self.collate.decode(batch)
                    done = stream.record_event() if stream is not None else None
                    if not _put(out, (images, done, targets, skipped, on_cpu, batch.indices), stop):
                        return
            _put(out, _END, stop)
        except BaseException as e:  # handed to the consumer, raised there
            _put(out, _Failure(e), stop)

    def _augment(self, decoded: queue.Queue, out: queue.Queue, stop: threading.Event) -> None:
        stream = self._stream()
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                while (item := _get(decoded, stop)) is not _END:
                    if item is None:  # the consumer stopped
                        return
                    if isinstance(item, _Failure):
                        _put(out, item, stop)
                        return
                    images, done, targets, skipped, on_cpu, indices = item
                    if stream is not None:
                        stream.wait_event(done)
                        # made on the decoding thread's stream: not reused before this one ran
                        for t in [images.pixels] if isinstance(images, PackedImages) else images:
                            t.record_stream(stream)
                    x = self.collate.augment(images, indices)
                    if stream is not None:
                        stream.synchronize()  # this thread waits for its own work; the consumer never does
                        targets = targets.pin_memory()  # copied with non_blocking: pageable memory would wait
                    if not _put(out, (x, targets, skipped, on_cpu), stop):
                        return
            _put(out, _END, stop)
        except BaseException as e:
            _put(out, _Failure(e), stop)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int, list[str]]]:
        decoded: queue.Queue = queue.Queue(maxsize=self.prefetch)
        out: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        threads = [threading.Thread(target=self._decode, args=(decoded, stop), name="gpu-decode", daemon=True),
                   threading.Thread(target=self._augment, args=(decoded, out, stop), name="gpu-augment",
                                    daemon=True)]
        for t in threads:
            t.start()
        try:
            while (item := out.get()) is not _END:
                if isinstance(item, _Failure):
                    raise item.error
                yield item
        finally:  # also when the consumer stops early: the threads end at their next hand-over
            stop.set()
            for t in threads:
                t.join(timeout=60)


_END = object()


@dataclass
class _Failure:
    error: BaseException


def _get(source: queue.Queue, stop: threading.Event) -> Any:
    """The next item, or None once the consumer has stopped."""
    while not stop.is_set():
        try:
            return source.get(timeout=0.1)
        except queue.Empty:
            pass
    return None


def _put(out: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Puts item unless the consumer has stopped (False then)."""
    while not stop.is_set():
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            pass
    return False


__all__ = ["DecodeThread", "DecodedBatch", "DecodedImageFolder", "DeviceCollate", "EncodedBatch", "EncodedImageFolder",
           "engine_planes",
           "FILES_PER_CALL_BESIDE_STEP", "JpegDecoder", "collate_decoded", "collate_encoded", "decode_on_cpu",
           "engines_take", "files_per_call", "jpeg_frame", "nvjpeg_can_decode"]
