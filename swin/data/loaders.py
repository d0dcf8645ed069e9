"""Loaders that yield ``(images, targets, skipped)`` on the training device.

``skipped`` counts unreadable images dropped from that batch (only with ``data.skip_corrupt=true``; otherwise
they raise). The data path is timm's ``create_loader(use_prefetcher=True)``: uint8 batches (4x less to collate,
pin and copy than float32) that :class:`DeviceLoader` copies to the GPU on a side stream one batch ahead, then
normalises and randomly erases there, so the copy and the preprocessing overlap the previous step.
With ``data.decode=gpu`` the workers decode and augment whole batches on the GPU (swin.data.gpu).
"""
from __future__ import annotations

import collections
import itertools
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset, default_collate

from swin.config import DataConfig, as_folder
from swin.data.datasets import Datasets, SyntheticDataset, decode_mode
from swin.data.folder import readable
from swin.data.gpu.batch_ring import ReceivedBatch

log = logging.getLogger(__name__)


class BatchLoader(Protocol):
    """What the training loop and the evaluation loop take: ``(images, targets, skipped)`` batches on the device.

    ``num_batches``: batches of a whole epoch on this process; ``cpu_decoded``: images that data.decode=gpu had to
    decode on the CPU so far (0 elsewhere); ``set_epoch(epoch, start_batch)``: the epoch's order, skipping its
    first ``start_batch`` batches (resuming mid-epoch).
    """

    num_batches: int
    cpu_decoded: int

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]: ...


# --- samplers and loaders ------------------------------------------------------------------------
class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can begin an epoch part-way, for resuming mid-epoch.

    The order of an epoch depends on (seed, epoch) only, so skipping this rank's first `start`
    indices continues exactly where the interrupted run stopped. Rank r takes positions r, r + W,
    ... of the epoch's permutation, so one global batch of B consecutive positions is the same set
    of samples for any world size W dividing B: runs on different process counts are equivalent.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, shuffle: bool, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=False)
        self.start = 0

    def set_start(self, start: int) -> None:
        """Skip the first `start` indices of this rank's share (set after set_epoch; one epoch only)."""
        self.start = start

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start


class ShardSampler(Sampler):
    """Every rank's own stride of the dataset, without padding (evaluation counts each image once)."""

    def __init__(self, n: int, rank: int, world_size: int):
        self.indices = list(range(rank, n, world_size))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def collate_dropping_corrupt(batch: list) -> tuple[torch.Tensor, torch.Tensor, int]:
    """default_collate of the readable samples, plus how many unreadable ones (None) were dropped."""
    kept = readable(batch)
    x, y = default_collate(kept)
    return x, y, len(batch) - len(kept)


class _Normalize:
    """uint8 -> float32 (x - 255 mean) / (255 std), then random erasing; None mean: float images pass through."""

    def __init__(self, device: torch.device, mean: Sequence[float] | None, std: Sequence[float] | None,
                 re_prob: float = 0.0, re_mode: str = "const", re_count: int = 1):
        self.mean = self.std = None
        if mean is not None and std is not None:
            self.mean = torch.tensor([255 * m for m in mean], device=device).view(1, -1, 1, 1)
            self.std = torch.tensor([255 * s for s in std], device=device).view(1, -1, 1, 1)
        self.erasing = None
        if re_prob > 0:
            from swin.data.erasing import BatchRandomErasing
            self.erasing = BatchRandomErasing(re_prob, mode=re_mode, max_count=re_count, device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean is not None:  # uint8 -> a new float32 tensor, normalised in place
            x = x.float().sub_(self.mean).div_(self.std)
        else:
            x = x.float()
        if self.erasing is not None:
            x = self.erasing(x)
        return x


class DeviceLoader:
    """A DataLoader's ``(images, targets, skipped)`` batches on `device`, normalised there, one batch ahead.

    timm's PrefetchLoader for (images, targets, skipped) batches, with its stream handling made safe on every
    timm version: on CUDA the copy (from pinned memory, non_blocking), the normalisation and random erasing of
    batch k+1 are queued on one side stream (kept for the loader's lifetime) before batch k is handed out; the
    consumer's stream waits for that work before using a batch, and the side stream waits for the consumer's
    queued work before allocating (a block the consumer freed may be handed out again by the caching allocator
    while kernels reading it are still queued). On the CPU the same steps run in order.
    Batches must be consumed on the stream that is current when the iterator is advanced.
    Batches of GPU-decoding workers (decode.DeviceCollate) come in slots of a ring of buffers in pinned host
    memory or the GPU's memory (batch_ring: copied from there, or normalised in place; the slot given back once
    that is done) and also name the files nvJPEG could not decode: counted in ``cpu_decoded`` (the first few kept
    in ``cpu_decoded_files``).
    """

    max_files = 20

    def __init__(self, loader: DataLoader, device: torch.device, normalize: _Normalize,
                 sampler: ResumableDistributedSampler | None = None):
        self.loader, self.device, self.normalize, self.sampler = loader, torch.device(device), normalize, sampler
        self.batch_size = loader.batch_size or 1
        self.num_batches = len(loader)  # a whole epoch, whatever set_epoch(start_batch=...) skips
        self._stream: torch.cuda.Stream | None = None
        # batches in ring slots (swin.data.gpu.batch_ring) whose slots are not given back yet
        self._received: collections.deque[ReceivedBatch] = collections.deque()
        self.cpu_decoded = 0
        self.cpu_decoded_files: list[str] = []

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Order of `epoch`, skipping its first `start_batch` batches on this process (resuming mid-epoch)."""
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
            self.sampler.set_start(start_batch * self.batch_size)

    def __len__(self) -> int:
        return len(self.loader)

    def _count_cpu_decoded(self, paths: list[str]) -> None:
        self.cpu_decoded += len(paths)
        self.cpu_decoded_files += paths[:self.max_files - len(self.cpu_decoded_files)]

    def _to_device(self, x: Any, y: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(x, ReceivedBatch):  # in a slot of a ring (swin.data.gpu.batch_ring): given back once read
            received, (x, y) = x, x.to(self.device, self.normalize)
            self._received.append(received)
            self._release_copied()  # (on the CPU, at once)
            return x, y
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        return self.normalize(x), y

    def _release_copied(self) -> None:
        """Give back the ring slots whose reads have finished, and wait for the oldest beyond the ring's limit."""
        while self._received and (self._received[0].done() or
                                  len(self._received) > self._received[0].ring.in_flight_limit):
            self._received.popleft().release()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        cuda = self.device.type == "cuda"
        if cuda and self._stream is None:
            # one stream for the loader's lifetime: the allocator caches blocks per stream
            self._stream = torch.cuda.Stream(device=self.device)
        pending = None
        for x, y, skipped, *on_cpu in self.loader:
            if on_cpu:
                self._count_cpu_decoded(on_cpu[0])
            if cuda:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
                if isinstance(x, torch.Tensor) and x.is_cuda:
                    # made on another stream (swin.data.gpu.decode): its memory is not reused while we read it
                    x.record_stream(self._stream)
                with torch.cuda.stream(self._stream):
                    ready = (*self._to_device(x, y), skipped)
            else:
                ready = (*self._to_device(x, y), skipped)
            if pending is not None:
                yield pending
            if cuda:  # whoever uses `ready` (handed out on the next call) waits for its copy
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
            pending = ready
        if pending is not None:
            yield pending


class SyntheticLoader:
    """Batches of a SyntheticDataset made on the device: no workers, no host work beyond a few launches.

    Training: each batch draws pool indices from a generator seeded by (seed, epoch, rank, batch), so a run is
    reproducible and resumable mid-epoch. Evaluation: this process's stride of the samples, in order.
    """

    cpu_decoded = 0  # nothing is decoded

    def __init__(self, ds: SyntheticDataset, batch_size: int, device: torch.device, normalize: _Normalize,
                 rank: int, world_size: int, seed: int, train: bool):
        self.ds, self.batch_size, self.device, self.normalize = ds, batch_size, torch.device(device), normalize
        self.rank, self.world_size, self.seed, self.train = rank, world_size, seed, train
        per_rank = -(-len(ds) // world_size) if train else len(range(rank, len(ds), world_size))
        # training drops the last partial batch (as the DataLoader of the other datasets does)
        self.num_batches = per_rank // batch_size if train else -(-per_rank // batch_size)
        self.epoch = self.start = 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start = epoch, start_batch

    def __len__(self) -> int:
        return self.num_batches - self.start

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        pool = self.ds.pool(self.device)
        g = torch.Generator(device=pool.device)  # pool.device names the index (cuda:0), as randint wants
        for b in range(self.start, self.num_batches):
            if self.train:  # seeding is host-side bookkeeping: no sync
                g.manual_seed((((self.seed * 1_000_003 + self.epoch) * 1_000_003 + self.rank) * 1_000_003 + b) % 2**63)
                idx = torch.randint(0, len(pool), (self.batch_size,), generator=g, device=pool.device)
            else:
                first = self.rank + b * self.batch_size * self.world_size
                last = min(len(self.ds), first + self.batch_size * self.world_size)
                idx = torch.arange(first, last, self.world_size, device=pool.device) % len(pool)
            yield self.normalize(pool[idx]), idx % self.ds.num_classes, 0


def build_eval_loader(val: Dataset, cfg: DataConfig, device: torch.device, rank: int, world_size: int, batch_size: int,
                      mean: Sequence[float] | None, std: Sequence[float] | None) -> BatchLoader:
    """This process's shard of `val` (every image exactly once over all processes, nothing padded), as
    normalised float32 batches on `device`. mean/std: the normalisation of uint8 images (None: float images)."""
    device = torch.device(device)
    norm = _Normalize(device, mean, std)
    if isinstance(val, SyntheticDataset):
        return SyntheticLoader(val, batch_size, device, norm, rank, world_size, seed=0, train=False)
    loader = DataLoader(val, batch_size=batch_size, sampler=ShardSampler(len(val), rank, world_size),
                        **_worker_settings(cfg, device, val, batch_size))
    return DeviceLoader(_decoding(loader, cfg, device, val), device, norm)


def _encoded_folder(ds: Dataset) -> Any:
    """The folder dataset augmented on the device (data.augment=gpu: swin.data.gpu.decode's EncodedImageFolder or
    DecodedImageFolder) under `ds` (maybe a Subset of it), else None."""
    base = ds.dataset if isinstance(ds, Subset) else ds
    # swin.data.gpu.decode is imported only when it is used
    if type(base).__name__ not in ("EncodedImageFolder", "DecodedImageFolder"):
        return None
    return base


def _decoded_in_workers(ds: Dataset) -> bool:
    """data.decode=cpu with data.augment=gpu: the workers decode, a thread of this process augments."""
    return type(_encoded_folder(ds)).__name__ == "DecodedImageFolder"


# caps of data.num_workers=null: workers that decode on the GPU each hold a CUDA context, and more did not train
# faster (docs/performance.md); CPU-decoding workers beyond 32 add processes (the evaluation loader starts as many
# again) more than speed
GPU_DECODE_WORKERS = 8
CPU_DECODE_WORKERS = 32


def _cores() -> int:
    """The cores this process may use: its CPU affinity (the whole host where there is none)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_count(cfg: DataConfig) -> int:
    """Loader workers per training process: data.num_workers, or for null this process's share of the cores less
    one (for the training process itself): under torchrun the affinity shared among the processes of the host
    (LOCAL_WORLD_SIZE), else under SLURM the task's cores, else the affinity; at most GPU_DECODE_WORKERS where the
    workers decode on the GPU, CPU_DECODE_WORKERS otherwise."""
    if cfg.num_workers is not None:
        return cfg.num_workers
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun: its processes share one affinity (a SLURM task's, too)
        cores = _cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    elif os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():  # a task srun started: its own cores
        cores = int(os.environ["SLURM_CPUS_PER_TASK"])
    else:
        cores = _cores()
    folder = as_folder(cfg)
    gpu_workers = decode_mode(cfg) == "gpu" and not (folder is not None and folder.gpu_decode_thread)
    return min(max(0, cores - 1), GPU_DECODE_WORKERS if gpu_workers else CPU_DECODE_WORKERS)


def _worker_settings(cfg: DataConfig, device: torch.device, ds: Dataset, batch_size: int, seed: int = 0
                     ) -> dict[str, Any]:
    """DataLoader settings shared by the training and evaluation loaders of folder datasets. data.decode=gpu: the
    workers decode and augment on `device` (swin.data.gpu.decode.DeviceCollate), spawned when that is a GPU (a forked
    process cannot use CUDA), and send each batch in a slot of a ring of buffers (batch_ring, made here: in
    pinned host memory, or the GPU's memory with data.batch_ring=gpu); with a decoding thread they only read files.
    data.augment=gpu with CPU decoding: the workers decode and pack each batch into one buffer, pinned here."""
    workers = worker_count(cfg)
    settings = dict(num_workers=workers, pin_memory=device.type == "cuda", collate_fn=collate_dropping_corrupt,
                    persistent_workers=workers > 0)
    encoded = _encoded_folder(ds)
    if _decoded_in_workers(ds):
        from swin.data.gpu.decode import collate_decoded
        settings["collate_fn"] = collate_decoded
    elif _decodes_in_thread(cfg, ds):  # the workers read files (pinned: nvJPEG reads them from host memory)
        from swin.data.gpu.decode import collate_encoded
        settings["collate_fn"] = collate_encoded
    elif encoded is not None:
        from swin.data.gpu.augment import transform_shape
        from swin.data.gpu.decode import DeviceCollate, mps_running
        ring = None
        if workers > 0:
            from swin.data.gpu.batch_ring import BatchRing
            if device.type == "cuda":
                settings["multiprocessing_context"] = "spawn"
                if not mps_running():
                    log.warning("data.decode=gpu: %d workers decode on the GPU, each in a CUDA context of its own, "
                                "which the GPU time-slices with training unless MPS runs (no MPS daemon found): start "
                                "`nvidia-cuda-mps-control -d` first (docs/data.md)", workers)
            # every batch the DataLoader has in flight, plus the reads the consumer may not have finished
            prefetch = settings["prefetch_factor"] = 2
            slots = workers * prefetch + BatchRing.in_flight_limit + 1
            folder = as_folder(cfg)
            on_gpu = device.type == "cuda" and folder is not None and folder.batch_ring == "gpu"
            ring = BatchRing(slots, batch_size, transform_shape(encoded.device_transform),
                             settings.get("multiprocessing_context"), device if on_gpu else None)
            if on_gpu:
                log.info("data.batch_ring=gpu: the loader's ring of %d batches takes %.0f MiB of GPU memory", slots,
                         (ring.images.nbytes + ring.targets.nbytes) / 2**20)
        # the ring is on the GPU or pinned, and nothing else in a batch is worth a pinning thread; decoded in this
        # process, the batches are on the device already
        settings["pin_memory"] = False
        settings["collate_fn"] = DeviceCollate(device, encoded.device_transform, encoded.skip_corrupt, seed, ring)
    return settings


def _decodes_in_thread(cfg: DataConfig, ds: Dataset) -> bool:
    """A thread of this process decodes and augments: data.decode=gpu with data.gpu_decode_thread (the workers
    read files), or data.augment=gpu with CPU decoding (the workers decode; the thread copies and augments)."""
    folder = as_folder(cfg)
    threaded = folder is not None and folder.gpu_decode_thread
    return _decoded_in_workers(ds) or (_encoded_folder(ds) is not None and threaded)


def _decoding(loader: DataLoader, cfg: DataConfig, device: torch.device, ds: Dataset, seed: int = 0) -> Any:
    """``loader``, or its batches decoded and augmented in a thread of this process (swin.data.gpu.decode.DecodeThread)
    where _decodes_in_thread says so."""
    if not _decodes_in_thread(cfg, ds):
        return loader
    from swin.data.gpu.decode import DecodeThread, DeviceCollate
    encoded = _encoded_folder(ds)
    return DecodeThread(loader, DeviceCollate(device, encoded.device_transform, encoded.skip_corrupt, seed))


def build_loaders(ds: Datasets, cfg: DataConfig, device: torch.device, rank: int, world_size: int, micro_batch: int,
                  eval_batch: int, seed: int) -> tuple[BatchLoader, BatchLoader]:
    """Training loader (shuffled, drop_last, resumable: ``set_epoch(epoch, start_batch)``) and evaluation
    loader (sharded, every image once), both yielding normalised float32 batches on `device`: DeviceLoader
    (folders, decoded in the workers with PIL or nvJPEG, and digits) or SyntheticLoader."""
    device = torch.device(device)
    val = build_eval_loader(ds.val, cfg, device, rank, world_size, eval_batch, ds.mean, ds.std)
    train_norm = _Normalize(device, ds.mean, ds.std, ds.re_prob, ds.re_mode, ds.re_count)
    if isinstance(ds.train, SyntheticDataset):
        return SyntheticLoader(ds.train, micro_batch, device, train_norm, rank, world_size, seed, train=True), val
    sampler = ResumableDistributedSampler(ds.train, world_size, rank, shuffle=True, seed=seed)
    train = DataLoader(ds.train, batch_size=micro_batch, sampler=sampler, drop_last=True,
                       **_worker_settings(cfg, device, ds.train, micro_batch, seed))
    return DeviceLoader(_decoding(train, cfg, device, ds.train, seed), device, train_norm, sampler), val
