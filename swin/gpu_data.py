"""``data.decode=gpu``: loader workers only read JPEG files; the training process decodes whole batches with nvJPEG
(``torchvision.io.decode_jpeg(list, device="cuda")``) and augments them on the GPU (swin.gpu_augment).

Why: per image, PIL decoding a ~110 KB JPEG plus RandomResizedCrop and RandAugment costs several milliseconds of
CPU time, so 16 cores feed ~2,600 img/s while Swin-T trains at 5,000+ img/s on one H100.

Pieces, in the order a batch meets them:

* :class:`EncodedImageFolder` (workers): the file's bytes and its label. A few files are not baseline or
  progressive 8-bit JPEGs with 1 or 3 components (ImageNet has CMYK JPEGs and a PNG named .JPEG); the worker sees
  that from the header (:func:`jpeg_frame`) and decodes those on the CPU itself, counted.
* :func:`collate_encoded` (workers): the batch's files in ONE uint8 tensor (one shared-memory block per batch
  instead of one per image) with their lengths, the CPU-decoded images and the labels.
* :class:`JpegDecoder` (a thread of the training process): one batched decode on the device; if nvJPEG rejects
  the batch, each image is retried alone and the ones it still rejects are decoded on the CPU (counted, never a
  crash; unreadable files are dropped and counted with ``data.skip_corrupt``, else an error names the file).
* :class:`GpuDecodeLoader`: a decode thread and an augmentation thread, each one batch ahead, so that decoding
  batch k+2 (nvJPEG blocks its calling thread until done) and augmenting batch k+1 overlap step k. Both run on
  their own CUDA streams; batches are handed to the consumer with an event and ``record_stream`` (see there).

With ``device="cpu"`` everything runs on the CPU, the same code: that is what the CPU tests check.
"""
from __future__ import annotations

import contextlib
import io
import queue
import threading
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from .data import CheckedImageFolder, CorruptImageError, ResumableDistributedSampler, _Normalize
from .gpu_augment import EvalTransform, TrainTransform, indexed

# torchvision 0.29 deprecates its image codecs in favour of TorchCodec (they still work, and 0.26 on the GPU
# machine has no warning); one warning per decode call would flood the log
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                        category=DeprecationWarning)

# start-of-frame markers (SOF0..SOF15 without DHT C4, JPG C8, DAC CC)
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# baseline, extended sequential and progressive Huffman frames: what nvJPEG decodes (progressive in software)
_NVJPEG_SOF = (0xC0, 0xC1, 0xC2)


def jpeg_frame(data: bytes) -> tuple[int, int, int, int, int] | None:
    """(SOF marker, sample precision, height, width, components) from a JPEG header, or None when ``data`` does
    not start like a JPEG file or no frame header comes before the scan."""
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    i = 2
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            i += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image or start of scan before any frame header
            return None
        if marker in _SOF:
            if i + 10 > n:
                return None
            return (marker, data[i + 4], (data[i + 5] << 8) | data[i + 6], (data[i + 7] << 8) | data[i + 8],
                    data[i + 9])
        i += 2 + ((data[i + 2] << 8) | data[i + 3])
    return None


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
    """An ImageFolder listing whose samples are ``(file bytes, label, path)``, or ``(decoded image, label, path)``
    for files nvJPEG cannot decode. ``device_transform`` (swin.gpu_augment) is what the loader applies on the
    device after decoding. Unreadable files raise an error naming the file, or (``skip_corrupt``) give None."""

    def __init__(self, root: Path, device_transform: TrainTransform | EvalTransform, skip_corrupt: bool):
        super().__init__(root, None, skip_corrupt)  # lists files only; nothing is opened here
        self.device_transform = device_transform

    def read(self, path: str) -> bytes | torch.Tensor:
        data = Path(path).read_bytes()
        return data if nvjpeg_can_decode(data) else decode_on_cpu(data)

    def sample(self, image: bytes | torch.Tensor, target: int, path: str) -> tuple[bytes | torch.Tensor, int, str]:
        return image, target, path


@dataclass
class EncodedBatch:
    """A batch as the workers send it: the JPEG files back to back in ``data`` (``sizes[k]`` bytes for slot k,
    0 for slots decoded in the worker), the worker-decoded images by slot, labels, paths and dropped files."""

    data: torch.Tensor
    sizes: list[int]
    decoded: dict[int, torch.Tensor]
    targets: torch.Tensor
    paths: list[str]
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.sizes)


def collate_encoded(samples: Sequence[tuple[bytes | torch.Tensor, int, str] | None]) -> EncodedBatch:
    kept = [s for s in samples if s is not None]
    if not kept:  # an empty batch would desynchronise the processes of a DDP step
        raise CorruptImageError(f"all {len(samples)} images of a batch were unreadable (data.skip_corrupt drops "
                                "only some images of a batch); check the image files under data.root")
    blobs = [s[0] if isinstance(s[0], bytes) else b"" for s in kept]
    joined = bytearray().join(blobs)  # one copy; becomes one shared-memory block when sent to the main process
    data = torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.empty(0, dtype=torch.uint8)
    return EncodedBatch(data=data, sizes=[len(b) for b in blobs],
                        decoded={k: s[0] for k, s in enumerate(kept) if isinstance(s[0], torch.Tensor)},
                        targets=torch.tensor([s[1] for s in kept], dtype=torch.long), paths=[s[2] for s in kept],
                        skipped=len(samples) - len(kept))


# --- decoding in the training process ----------------------------------------------------------------------------
class JpegDecoder:
    """Decodes an :class:`EncodedBatch` on ``device``: one batched ``decode_jpeg`` call; if it fails, each image
    alone, and the CPU for those nvJPEG still rejects. Counts the images decoded on the CPU (here and in the
    workers) in ``cpu_decoded`` and keeps the first few paths in ``cpu_decoded_files``."""

    max_files = 20

    def __init__(self, device: torch.device, skip_corrupt: bool):
        self.device, self.skip_corrupt = torch.device(device), skip_corrupt
        self.cpu_decoded = 0
        self.cpu_decoded_files: list[str] = []

    def device_decode(self, blobs: list[torch.Tensor]) -> list[torch.Tensor]:
        """nvJPEG on CUDA (batched), libjpeg-turbo on the CPU; RGB output also for grey images."""
        from torchvision.io import ImageReadMode, decode_jpeg
        return decode_jpeg(blobs, mode=ImageReadMode.RGB, device=self.device)

    def _note_cpu(self, path: str) -> None:
        self.cpu_decoded += 1
        if len(self.cpu_decoded_files) < self.max_files:
            self.cpu_decoded_files.append(path)

    def _decode_alone(self, blob: torch.Tensor, path: str) -> torch.Tensor | None:
        try:
            return self.device_decode([blob])[0]
        except RuntimeError:
            pass
        try:
            img = decode_on_cpu(blob.numpy().tobytes())
        except Exception as e:
            if self.skip_corrupt:
                return None
            raise CorruptImageError(f"cannot read image {path} ({type(e).__name__}: {e}); fix or delete the file, "
                                    "or set data.skip_corrupt=true to skip unreadable images") from None
        self._note_cpu(path)
        return img.to(self.device, non_blocking=True)

    def __call__(self, batch: EncodedBatch) -> tuple[list[torch.Tensor], torch.Tensor, int]:
        """(decoded (3, H, W) uint8 images on the device, their labels, files dropped in this batch)."""
        images: list[torch.Tensor | None] = [None] * len(batch)
        slots = [k for k, n in enumerate(batch.sizes) if n > 0]
        ends = np.cumsum(batch.sizes).tolist()
        blobs = [batch.data[ends[k] - batch.sizes[k]:ends[k]] for k in slots]  # views, no copies
        if blobs:
            try:
                decoded = self.device_decode(blobs)
            except RuntimeError:  # nvJPEG fails the whole batch for one bad file: find it
                decoded = [self._decode_alone(b, batch.paths[k]) for k, b in zip(slots, blobs)]
            for k, img in zip(slots, decoded):
                images[k] = img
        for k, img in batch.decoded.items():
            self._note_cpu(batch.paths[k])
            images[k] = img.to(self.device, non_blocking=True)
        keep = [k for k, img in enumerate(images) if img is not None]
        if not keep:
            raise CorruptImageError(f"all {len(images)} images of a batch were unreadable; check the image files "
                                    "under data.root")
        targets = batch.targets if len(keep) == len(images) else batch.targets[keep]
        return [images[k] for k in keep], targets, batch.skipped + len(images) - len(keep)


# --- the loader ----------------------------------------------------------------------------------------------------
_END = object()


@dataclass
class _Failure:
    error: BaseException


@dataclass
class _Stages:
    """The two worker threads of one epoch and the queues between them."""

    decoded: queue.Queue = field(default_factory=lambda: queue.Queue(maxsize=1))
    ready: queue.Queue = field(default_factory=lambda: queue.Queue(maxsize=1))
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Put unless the consumer has gone (stop set); False then."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            pass
    return False


def _get(q: queue.Queue, stop: threading.Event) -> Any:
    while not stop.is_set():
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            pass
    return _END


class GpuDecodeLoader:
    """A DataLoader of :class:`EncodedImageFolder` batches as ``(images, targets, skipped)`` on ``device``:
    decoded there, transformed (``transform``: swin.gpu_augment's TrainTransform or EvalTransform), normalised and
    randomly erased (``normalize``), two batches ahead of the consumer, in the sampler's order.

    Streams and memory on CUDA: the decode thread makes its current stream ``decode_stream``, so the decoded images
    are allocated from that stream's pool. torchvision's nvJPEG call writes them on nvJPEG's own stream and waits for
    it before returning; the augmentation thread's stream waits on ``decode_stream`` (an event) and marks every
    decoded image with ``record_stream`` so that the allocator reuses its block only after the augmentation kernels
    that read it have run. The finished batch is handed over with an event the consumer's stream waits on, and
    ``record_stream`` on the consumer's stream (the consumer frees the batch while its kernels may still be queued).
    No step here waits for the device, and the consumer's stream never waits for more than its batch.

    Random choices come from a generator seeded by (seed, epoch, rank, batch index): the same batches after a
    resume mid-epoch. Random erasing (timm's, in ``normalize``) draws from Python's and torch's global generators.
    """

    def __init__(self, loader: DataLoader, device: torch.device, transform: TrainTransform | EvalTransform,
                 normalize: _Normalize, sampler: ResumableDistributedSampler | None = None, seed: int = 0,
                 rank: int = 0, skip_corrupt: bool = False):
        # with its index: the worker threads set it as their current device (set_device refuses a bare "cuda")
        self.loader, self.device, self.normalize, self.sampler = loader, indexed(device), normalize, sampler
        self.transform = transform.to(self.device)
        self.decoder = JpegDecoder(self.device, skip_corrupt)
        self.batch_size = loader.batch_size or 1
        self.num_batches = len(loader)  # a whole epoch, whatever set_epoch(start_batch=...) skips
        self.seed, self.rank, self.epoch, self.start = seed, rank, 0, 0
        self._streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None

    @property
    def cpu_decoded(self) -> int:
        """Images decoded on the CPU so far (nvJPEG cannot decode them), over all epochs."""
        return self.decoder.cpu_decoded

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Order and augmentation of `epoch`, skipping its first `start_batch` batches (resuming mid-epoch)."""
        self.epoch, self.start = epoch, start_batch
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
            self.sampler.set_start(start_batch * self.batch_size)

    def __len__(self) -> int:
        return len(self.loader)

    def _rng(self, batch: int) -> np.random.Generator:
        return np.random.default_rng([self.seed % 2**32, self.epoch, self.rank, batch])

    def _thread_setup(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread

    def _decode_stage(self, batches: Iterator[EncodedBatch], st: _Stages) -> None:
        self._thread_setup()
        cuda = self.device.type == "cuda"
        with torch.no_grad(), torch.cuda.stream(self._streams[0]) if cuda else contextlib.nullcontext():
            for b, batch in enumerate(batches, start=self.start):
                images, targets, skipped = self.decoder(batch)
                done = None
                if cuda:  # the (rare) CPU-decoded images were copied on this stream
                    done = torch.cuda.Event()
                    done.record(self._streams[0])
                if not _put(st.decoded, (b, images, targets, skipped, done), st.stop):
                    return
        _put(st.decoded, _END, st.stop)

    def _augment_stage(self, st: _Stages) -> None:
        self._thread_setup()
        cuda = self.device.type == "cuda"
        with torch.no_grad(), torch.cuda.stream(self._streams[1]) if cuda else contextlib.nullcontext():
            while True:
                item = _get(st.decoded, st.stop)
                if item is _END or isinstance(item, _Failure):
                    _put(st.ready, item, st.stop)
                    return
                b, images, targets, skipped, decoded = item
                if cuda:
                    stream = self._streams[1]
                    stream.wait_event(decoded)
                    for img in images:
                        img.record_stream(stream)
                    targets = targets.pin_memory().to(self.device, non_blocking=True)
                x = self.normalize(self.transform(images, self._rng(b)))
                del item, images  # the decoded images' blocks return to the pool once the kernels above have run
                ready = None
                if cuda:
                    ready = torch.cuda.Event()
                    ready.record(self._streams[1])
                if not _put(st.ready, (x, targets.to(self.device), skipped, ready), st.stop):
                    return

    def _start(self) -> _Stages:
        if self.device.type == "cuda" and self._streams is None:
            # one pair of streams for the loader's lifetime: the allocator caches blocks per stream
            self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
        batches = iter(self.loader)  # here, in the main thread: worker processes are forked from it
        st = _Stages()

        def run(stage: Any, out: queue.Queue, *args: Any) -> None:
            try:
                stage(*args)
            except BaseException as e:  # passed down the pipeline in order, raised by the consumer
                _put(out, _Failure(e), st.stop)

        st.threads = [threading.Thread(target=run, args=(self._decode_stage, st.decoded, batches, st), daemon=True,
                                       name="swin-decode"),
                      threading.Thread(target=run, args=(self._augment_stage, st.ready, st), daemon=True,
                                       name="swin-augment")]
        for t in st.threads:
            t.start()
        return st

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        st = self._start()
        try:
            while True:
                item = st.ready.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                x, y, skipped, ready = item
                if ready is not None:
                    consumer = torch.cuda.current_stream(self.device)
                    consumer.wait_event(ready)
                    x.record_stream(consumer)
                    y.record_stream(consumer)
                yield x, y, skipped
        finally:
            st.stop.set()
            for t in st.threads:
                t.join(timeout=60)


__all__ = ["EncodedBatch", "EncodedImageFolder", "GpuDecodeLoader", "JpegDecoder", "collate_encoded",
           "decode_on_cpu", "jpeg_frame", "nvjpeg_can_decode"]
