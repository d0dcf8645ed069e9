"""Datasets and loaders for training: ``digits`` (scikit-learn, embedded), ``imagefolder`` and
``imagenet`` (torchvision ImageFolder with timm transforms) and ``synthetic`` (random images made on the device).

Every loader yields ``(images, targets, skipped)`` on the training device, where ``skipped`` counts
unreadable images that were dropped from that batch (only with ``data.skip_corrupt=true``; otherwise they raise).

The data path is timm's ``create_loader(use_prefetcher=True)``: folder datasets stop their transforms at a
uint8 tensor (4x less to collate, pin and copy than float32), and :class:`DeviceLoader` copies each batch
to the GPU on a side stream one batch ahead (pinned memory, non_blocking), then normalises it and applies
random erasing there, so the copy and the preprocessing overlap the previous step instead of delaying it.

With ``data.decode=gpu`` (folder datasets) the workers decode and augment whole batches on the GPU instead of
with PIL (swin.gpu_data; :func:`folder_split` and :func:`_worker_settings` choose); the batches they return are
uint8 like the others.
"""
from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset, default_collate

from .batch_ring import ReceivedBatch

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class CorruptImageError(RuntimeError):
    """An image file that cannot be decoded; the message names the file and the fix."""


@dataclass
class Datasets:
    train: Dataset
    val: Dataset
    num_classes: int
    # Normalisation applied on the device: the datasets yield uint8 images (0-255) that become
    # (x - 255 mean) / (255 std) in float32. None: the datasets already yield normalised float images.
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    # timm's RandomErasing of training batches (swin.erasing: whole batches), on the device after normalisation
    re_prob: float = 0.0
    re_mode: str = "const"
    re_count: int = 1


# --- datasets --------------------------------------------------------------------------------
class TensorImageDataset(Dataset):
    """In-memory (N, C, H, W) images with optional random translation (pad + random crop)."""

    def __init__(self, images: torch.Tensor, targets: torch.Tensor, shift: int = 0):
        self.images, self.targets, self.shift = images, targets, shift

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self.images[i]
        if self.shift:
            s = self.shift
            dy, dx = torch.randint(0, 2 * s + 1, (2,)).tolist()
            x = F.pad(x, (s, s, s, s), mode="replicate")[:, dy:dy + x.shape[1], dx:dx + x.shape[2]]
        return x, int(self.targets[i])


def digits_datasets(cfg: Any, img_size: tuple[int, int]) -> Datasets:
    """scikit-learn's 8x8 handwritten digits (1797 images, shipped with the package), upscaled to
    img_size, grey replicated to 3 channels; a stratified hold-out split is the validation set."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0  # (N, 1, 8, 8) in [0, 1]
    y = torch.tensor(digits.target, dtype=torch.long)
    x = F.interpolate(x, size=img_size, mode="bilinear", align_corners=False)
    x = ((x - x.mean()) / x.std()).expand(-1, 3, -1, -1).contiguous()
    num_classes = 10
    if cfg.get("classes") is not None:  # a subset of the digits (e.g. pretrain / fine-tune splits), relabelled
        classes = [int(c) for c in cfg.classes]
        if not classes or len(set(classes)) != len(classes) or not set(classes) <= set(range(10)):
            raise ValueError(f"data.classes={list(cfg.classes)}: give distinct digits 0-9, e.g. data.classes=[0,1,2]")
        keep = torch.isin(y, torch.tensor(classes))
        relabel = torch.full((10,), -1, dtype=torch.long)
        relabel[torch.tensor(classes)] = torch.arange(len(classes))  # label i = the i-th digit listed
        x, y, num_classes = x[keep], relabel[y[keep]], len(classes)
    idx_train, idx_val = train_test_split(torch.arange(len(y)).numpy(), test_size=cfg.val_fraction,
                                          random_state=cfg.split_seed, stratify=y.numpy())
    idx_train, idx_val = torch.from_numpy(idx_train), torch.from_numpy(idx_val)
    return Datasets(TensorImageDataset(x[idx_train], y[idx_train], shift=cfg.get("shift", 0)),
                    TensorImageDataset(x[idx_val], y[idx_val]), num_classes=num_classes)


class CheckedImageFolder(Dataset):
    """torchvision ImageFolder whose unreadable files raise an error naming the file, or (with
    skip_corrupt) come back as None for the collate function to drop and count."""

    def __init__(self, root: Path, transform: Any, skip_corrupt: bool):
        from torchvision.datasets import ImageFolder
        self.folder = ImageFolder(str(root))
        self.transform, self.skip_corrupt = transform, skip_corrupt

    @property
    def classes(self) -> list[str]:
        return self.folder.classes

    def __len__(self) -> int:
        return len(self.folder.samples)

    def read(self, path: str) -> Any:
        """The file's image; any exception means the file is unreadable."""
        return self.folder.loader(path)  # PIL open + convert("RGB"): decodes the whole file

    def sample(self, image: Any, target: int, path: str) -> tuple:
        return self.transform(image), target

    def __getitem__(self, i: int) -> tuple | None:
        path, target = self.folder.samples[i]
        try:
            image = self.read(path)
        except Exception as e:
            if self.skip_corrupt:
                return None
            raise unreadable_image(path, e) from None
        return self.sample(image, target, path)


def unreadable_image(path: str, error: Exception) -> CorruptImageError:
    """The error for a file nothing can decode, naming it and the two fixes."""
    return CorruptImageError(f"cannot read image {path} ({type(error).__name__}: {error}); fix or delete the file, "
                             "or set data.skip_corrupt=true to skip unreadable images")


def readable(samples: Sequence[Any]) -> list[Any]:
    """The samples of a batch that are not None (unreadable files dropped with data.skip_corrupt); an error when
    none is left, as an empty batch would desynchronise the processes of a DDP step."""
    kept = [s for s in samples if s is not None]
    if not kept:
        raise CorruptImageError(f"all {len(samples)} images of a batch were unreadable (data.skip_corrupt drops "
                                "only some images of a batch); check the image files under data.root")
    return kept


DECODE_MODES = ("cpu", "gpu")


def decode_mode(cfg: Any) -> str:
    """``data.decode``: cpu (PIL and timm's transforms in the loader workers; the default) or gpu (the workers
    decode with nvJPEG and augment on the training device: swin.gpu_data). ValueError for anything else."""
    mode = cfg.get("decode", "cpu")
    if mode not in DECODE_MODES:
        raise ValueError(f"data.decode={mode!r}: use cpu (decode and augment with PIL in the loader workers) or gpu "
                         "(the workers decode with nvJPEG and augment on the training device)")
    if mode == "gpu" and cfg.name not in ("imagefolder", "imagenet"):
        raise ValueError(f"data.decode=gpu decodes JPEG folders (data=imagenet or data=imagefolder), not "
                         f"data={cfg.name}; drop data.decode")
    return mode


AUGMENT_MODES = ("cpu", "gpu")


def augment_mode(cfg: Any) -> str:
    """``data.augment``: where the training and evaluation transforms run. cpu: timm's transforms in the loader
    workers; gpu: swin.gpu_augment on the training device. Unset (null): where data.decode decodes. data.decode=gpu
    always augments on the GPU. ValueError for anything else."""
    decode = decode_mode(cfg)
    mode = cfg.get("augment") or decode
    if mode not in AUGMENT_MODES:
        raise ValueError(f"data.augment={mode!r}: use cpu (timm's transforms in the loader workers) or gpu (on the "
                         "training device), or null (where data.decode decodes)")
    if decode == "gpu" and mode == "cpu":
        raise ValueError("data.augment=cpu with data.decode=gpu: images decoded on the GPU are augmented there; drop "
                         "data.augment or use data.decode=cpu")
    if mode == "gpu" and cfg.name not in ("imagefolder", "imagenet"):
        raise ValueError(f"data.augment=gpu augments JPEG folders (data=imagenet or data=imagefolder), not "
                         f"data={cfg.name}; drop data.augment")
    return mode


def check_decode(cfg: Any, img_size: Any) -> None:
    """Raise ValueError (naming the data.* key) for what data.decode=gpu or data.augment=gpu cannot do, before any
    work."""
    if cfg.get("gpu_decode_thread", False) and decode_mode(cfg) != "gpu":
        raise ValueError("data.gpu_decode_thread=true decodes on the GPU in a thread of the training process: it "
                         "needs data.decode=gpu (or drop data.gpu_decode_thread)")
    if cfg.get("gpu_ycbcr", False) and decode_mode(cfg) != "gpu":
        raise ValueError("data.gpu_ycbcr=true decodes JPEG files to their YCbCr planes on the GPU's JPEG engines: it "
                         "needs data.decode=gpu (or drop data.gpu_ycbcr)")
    ring = cfg.get("batch_ring", "host")
    if ring not in ("gpu", "host"):
        raise ValueError(f"data.batch_ring={ring!r}: the decoding workers' batches wait for training in the GPU's "
                         "memory (gpu) or in page-locked host memory (host); use one of those")
    if ring == "gpu" and decode_mode(cfg) != "gpu":
        raise ValueError("data.batch_ring=gpu keeps the batches of workers that decode on the GPU in its memory: it "
                         "needs data.decode=gpu (or drop data.batch_ring)")
    if augment_mode(cfg) == "gpu":
        from .gpu_augment import eval_spec, train_spec
        train_spec(cfg, img_size)
        eval_spec(cfg, img_size)


def folder_split(cfg: Any, root: Path, img_size: tuple[int, int], train: bool) -> Dataset:
    """One split of a folder dataset with the data config's training or evaluation transforms: in the workers
    (CheckedImageFolder, data.decode=cpu) or, described, for the device (data.augment=gpu: EncodedImageFolder,
    whose files are decoded on the GPU, or DecodedImageFolder, decoded on the CPU by the workers)."""
    if augment_mode(cfg) == "gpu":
        from .gpu_augment import EvalTransform, TrainTransform, eval_spec, train_spec
        from .gpu_data import DecodedImageFolder, EncodedImageFolder
        tf = TrainTransform(train_spec(cfg, img_size)) if train else EvalTransform(eval_spec(cfg, img_size))
        if decode_mode(cfg) == "cpu":
            return DecodedImageFolder(root, tf, cfg.skip_corrupt)
        return EncodedImageFolder(root, tf, cfg.skip_corrupt)
    mean, std = tuple(cfg.mean), tuple(cfg.std)
    if not train:
        return CheckedImageFolder(root, eval_transform(img_size, cfg.interpolation, cfg.crop_pct, mean, std),
                                  cfg.skip_corrupt)
    from timm.data import create_transform

    # use_prefetcher=True: the transforms end in a uint8 CHW tensor; normalisation and random erasing
    # (re_prob) run on the device in DeviceLoader, as with timm's create_loader(use_prefetcher=True)
    train_tf = create_transform(
        input_size=img_size, is_training=True, scale=tuple(cfg.scale), ratio=tuple(cfg.ratio), hflip=cfg.hflip,
        color_jitter=cfg.color_jitter, auto_augment=cfg.auto_augment, interpolation=cfg.interpolation,
        mean=mean, std=std, use_prefetcher=True)
    return CheckedImageFolder(root, train_tf, cfg.skip_corrupt)


def folder_datasets(cfg: Any, img_size: tuple[int, int]) -> Datasets:
    """`<root>/<train_dir>/<class>/*` and `<root>/<val_dir>/<class>/*` with timm's transforms."""
    if not cfg.root:
        raise ValueError(f"data={cfg.name} needs data.root=/path/to/dataset (with {cfg.train_dir}/ and "
                         f"{cfg.val_dir}/ folders of one sub-folder per class)")
    root = Path(cfg.root).expanduser()
    for split in (cfg.train_dir, cfg.val_dir):
        if not (root / split).is_dir():
            raise ValueError(f"data.root={root} has no {split}/ folder; point data.root at a folder with "
                             f"{cfg.train_dir}/ and {cfg.val_dir}/ sub-folders of one folder per class")
    mean, std = tuple(cfg.mean), tuple(cfg.std)
    train = folder_split(cfg, root / cfg.train_dir, img_size, train=True)
    val = folder_split(cfg, root / cfg.val_dir, img_size, train=False)
    if train.classes != val.classes:
        raise ValueError(f"{root / cfg.train_dir} and {root / cfg.val_dir} have different class folders; "
                         "both splits need the same set of class sub-folders")
    return Datasets(train, val, num_classes=len(train.classes), mean=mean, std=std,
                    re_prob=cfg.reprob, re_mode=cfg.remode, re_count=cfg.recount)


def eval_transform(img_size: int | Sequence[int], interpolation: str, crop_pct: float,
                   mean: Sequence[float], std: Sequence[float]) -> Any:
    """timm's evaluation resize + center crop, ending in a uint8 tensor (normalised on the device)."""
    from timm.data import create_transform
    return create_transform(input_size=img_size, is_training=False, interpolation=interpolation, crop_pct=crop_pct,
                            mean=tuple(mean), std=tuple(std), use_prefetcher=True)


class SyntheticDataset(Dataset):
    """Random uint8 images for smoke and throughput runs: a fixed pool, sample i is pool image i % pool
    with label (i % pool) % num_classes (learnable, so a run can be checked to train).

    Loaders build the pool on the training device (:class:`SyntheticLoader`: no workers, no copies);
    indexing gives the same images on the CPU, for code that wants a plain Dataset.
    """

    def __init__(self, num_samples: int, img_size: tuple[int, int], num_classes: int, seed: int, pool: int = 64):
        self.num_samples, self.img_size, self.num_classes, self.seed = num_samples, img_size, num_classes, seed
        self.pool_size = pool
        self._pools: dict[torch.device, torch.Tensor] = {}

    def pool(self, device: torch.device) -> torch.Tensor:
        """The (pool, 3, H, W) uint8 images, generated on `device` from the seed (once per device)."""
        device = torch.device(device)
        if device not in self._pools:
            g = torch.Generator(device=device).manual_seed(self.seed)
            self._pools[device] = torch.randint(0, 256, (self.pool_size, 3, *self.img_size), generator=g,
                                                device=device, dtype=torch.uint8)
        return self._pools[device]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        j = i % self.pool_size
        return self.pool(torch.device("cpu"))[j], j % self.num_classes


def synthetic_datasets(cfg: Any, img_size: tuple[int, int]) -> Datasets:
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    return Datasets(SyntheticDataset(cfg.train_samples, img_size, cfg.num_classes, seed=0),
                    SyntheticDataset(cfg.val_samples, img_size, cfg.num_classes, seed=0), cfg.num_classes,
                    mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD)


BUILDERS = {"digits": digits_datasets, "imagefolder": folder_datasets, "imagenet": folder_datasets,
            "synthetic": synthetic_datasets}


def build_datasets(cfg: Any, img_size: int | Sequence[int]) -> Datasets:
    """Datasets of `cfg.name`, optionally cut to the first train_limit / val_limit samples."""
    size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    if cfg.name not in BUILDERS:
        raise ValueError(f"unknown data.name {cfg.name!r}; use data=<{'|'.join(BUILDERS)}>")
    ds = BUILDERS[cfg.name](cfg, size)
    for split, limit in (("train", cfg.get("train_limit")), ("val", cfg.get("val_limit"))):
        part = getattr(ds, split)
        if not limit:
            continue
        if isinstance(part, SyntheticDataset):  # stays a SyntheticDataset: its loader works on the device
            part.num_samples = min(limit, part.num_samples)
        else:
            setattr(ds, split, Subset(part, range(min(limit, len(part)))))
    return ds


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
            from .erasing import BatchRandomErasing
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

    timm's PrefetchLoader, for (images, targets, skipped) batches and the same on every timm version: timm
    1.0.29's (the GPU machine's) lacks the consumer-stream wait below and makes a new stream every epoch;
    1.0.31's has both fixes. On CUDA the copy (from pinned memory, non_blocking), the normalisation and random
    erasing of batch k+1 are queued on a side stream before batch k is handed out; the consumer's stream waits
    for that work before using a batch, and the side stream waits for the consumer's queued work before
    allocating (a block the consumer freed may be handed out again by the caching allocator while kernels
    reading it are still queued). On the CPU the same steps run in order.
    Batches must be consumed on the stream that is current when the iterator is advanced.
    Batches of GPU-decoding workers (swin.gpu_data.DeviceCollate) come in slots of a ring of buffers in pinned host
    memory or the GPU's memory (swin.batch_ring: copied from there, or normalised in place; the slot given back once
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
        # batches in ring slots (swin.batch_ring) whose slots are not given back yet
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
        if isinstance(x, ReceivedBatch):  # in a slot of a ring (swin.batch_ring): given back once read
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
                    # made on another stream (swin.gpu_data): its memory is not reused while we read it
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


def build_eval_loader(val: Dataset, cfg: Any, device: torch.device, rank: int, world_size: int, batch_size: int,
                      mean: Sequence[float] | None, std: Sequence[float] | None) -> Any:
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
    """The folder dataset augmented on the device (data.augment=gpu: swin.gpu_data's EncodedImageFolder or
    DecodedImageFolder) under `ds` (maybe a Subset of it), else None."""
    base = ds.dataset if isinstance(ds, Subset) else ds
    # swin.gpu_data is imported only when it is used
    if type(base).__name__ not in ("EncodedImageFolder", "DecodedImageFolder"):
        return None
    return base


def _decoded_in_workers(ds: Dataset) -> bool:
    """data.decode=cpu with data.augment=gpu: the workers decode, a thread of this process augments."""
    return type(_encoded_folder(ds)).__name__ == "DecodedImageFolder"


def _worker_settings(cfg: Any, device: torch.device, ds: Dataset, batch_size: int, seed: int = 0) -> dict[str, Any]:
    """DataLoader settings shared by the training and evaluation loaders of folder datasets. data.decode=gpu: the
    workers decode and augment on `device` (swin.gpu_data.DeviceCollate), spawned when that is a GPU (a forked
    process cannot use CUDA), and send each batch in a slot of a ring of buffers (swin.batch_ring, made here: in
    pinned host memory, or the GPU's memory with data.batch_ring=gpu); with a decoding thread they only read files.
    data.augment=gpu with CPU decoding: the workers decode and pack each batch into one buffer, pinned here."""
    workers = cfg.get("num_workers", 0)
    settings = dict(num_workers=workers, pin_memory=device.type == "cuda", collate_fn=collate_dropping_corrupt,
                    persistent_workers=workers > 0)
    encoded = _encoded_folder(ds)
    if _decoded_in_workers(ds):
        from .gpu_data import collate_decoded
        settings["collate_fn"] = collate_decoded
    elif _decodes_in_thread(cfg, ds):  # the workers read files (pinned: nvJPEG reads them from host memory)
        from .gpu_data import collate_encoded
        settings["collate_fn"] = collate_encoded
    elif encoded is not None:
        from .gpu_augment import transform_shape
        from .gpu_data import DeviceCollate, mps_running
        ring = None
        if workers > 0:
            from .batch_ring import BatchRing
            if device.type == "cuda":
                settings["multiprocessing_context"] = "spawn"
                if not mps_running():
                    log.warning("data.decode=gpu: %d workers decode on the GPU, each in a CUDA context of its own, "
                                "which the GPU time-slices with training unless MPS runs (no MPS daemon found): start "
                                "`nvidia-cuda-mps-control -d` first (docs/data.md)", workers)
            # every batch the DataLoader has in flight, plus the reads the consumer may not have finished
            prefetch = settings["prefetch_factor"] = 2
            slots = workers * prefetch + BatchRing.in_flight_limit + 1
            on_gpu = device.type == "cuda" and cfg.get("batch_ring", "host") == "gpu"
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


def _decodes_in_thread(cfg: Any, ds: Dataset) -> bool:
    """A thread of this process decodes and augments: data.decode=gpu with data.gpu_decode_thread (the workers
    read files), or data.augment=gpu with CPU decoding (the workers decode; the thread copies and augments)."""
    return _decoded_in_workers(ds) or (_encoded_folder(ds) is not None and bool(cfg.get("gpu_decode_thread", False)))


def _decoding(loader: DataLoader, cfg: Any, device: torch.device, ds: Dataset, seed: int = 0) -> Any:
    """``loader``, or its batches decoded and augmented in a thread of this process (swin.gpu_data.DecodeThread)
    where _decodes_in_thread says so."""
    if not _decodes_in_thread(cfg, ds):
        return loader
    from .gpu_data import DecodeThread, DeviceCollate
    encoded = _encoded_folder(ds)
    return DecodeThread(loader, DeviceCollate(device, encoded.device_transform, encoded.skip_corrupt, seed))


def build_loaders(ds: Datasets, cfg: Any, device: torch.device, rank: int, world_size: int, micro_batch: int,
                  eval_batch: int, seed: int) -> tuple[Any, Any]:
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
