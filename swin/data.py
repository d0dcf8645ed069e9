"""Datasets and loaders for training: ``digits`` (scikit-learn, embedded), ``imagefolder`` and
``imagenet`` (torchvision ImageFolder with timm transforms) and ``synthetic`` (random tensors).

Every loader yields ``(images, targets, skipped)`` where ``skipped`` counts unreadable images that
were dropped from that batch (only with ``data.skip_corrupt=true``; otherwise they raise).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset, default_collate

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class CorruptImageError(RuntimeError):
    """An image file that cannot be decoded; the message names the file and the fix."""


@dataclass
class Datasets:
    train: Dataset
    val: Dataset
    num_classes: int


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

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int] | None:
        path, target = self.folder.samples[i]
        try:
            img = self.folder.loader(path)  # PIL open + convert("RGB"): decodes the whole file
        except Exception as e:
            if self.skip_corrupt:
                return None
            raise CorruptImageError(
                f"cannot read image {path} ({type(e).__name__}: {e}); fix or delete the file, "
                "or set data.skip_corrupt=true to skip unreadable images") from None
        return self.transform(img), target


def folder_datasets(cfg: Any, img_size: tuple[int, int]) -> Datasets:
    """`<root>/<train_dir>/<class>/*` and `<root>/<val_dir>/<class>/*` with timm's transforms."""
    from timm.data import create_transform

    if not cfg.root:
        raise ValueError(f"data={cfg.name} needs data.root=/path/to/dataset (with {cfg.train_dir}/ and "
                         f"{cfg.val_dir}/ folders of one sub-folder per class)")
    root = Path(cfg.root).expanduser()
    for split in (cfg.train_dir, cfg.val_dir):
        if not (root / split).is_dir():
            raise ValueError(f"data.root={root} has no {split}/ folder; point data.root at a folder with "
                             f"{cfg.train_dir}/ and {cfg.val_dir}/ sub-folders of one folder per class")
    mean, std = tuple(cfg.mean), tuple(cfg.std)
    train_tf = create_transform(
        input_size=img_size, is_training=True, scale=tuple(cfg.scale), ratio=tuple(cfg.ratio), hflip=cfg.hflip,
        color_jitter=cfg.color_jitter, auto_augment=cfg.auto_augment, interpolation=cfg.interpolation,
        re_prob=cfg.reprob, re_mode=cfg.remode, re_count=cfg.recount, mean=mean, std=std)
    val_tf = create_transform(input_size=img_size, is_training=False, interpolation=cfg.interpolation,
                              crop_pct=cfg.crop_pct, mean=mean, std=std)
    train = CheckedImageFolder(root / cfg.train_dir, train_tf, cfg.skip_corrupt)
    val = CheckedImageFolder(root / cfg.val_dir, val_tf, cfg.skip_corrupt)
    if train.classes != val.classes:
        raise ValueError(f"{root / cfg.train_dir} and {root / cfg.val_dir} have different class folders; "
                         "both splits need the same set of class sub-folders")
    return Datasets(train, val, num_classes=len(train.classes))


class SyntheticDataset(Dataset):
    """Random images for smoke and throughput runs: a fixed pool, label = pool index % classes."""

    def __init__(self, num_samples: int, img_size: tuple[int, int], num_classes: int, seed: int, pool: int = 64):
        g = torch.Generator().manual_seed(seed)
        self.pool = torch.randn(pool, 3, *img_size, generator=g)
        self.num_samples, self.num_classes = num_samples, num_classes

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        j = i % len(self.pool)
        return self.pool[j], j % self.num_classes


def synthetic_datasets(cfg: Any, img_size: tuple[int, int]) -> Datasets:
    return Datasets(SyntheticDataset(cfg.train_samples, img_size, cfg.num_classes, seed=0),
                    SyntheticDataset(cfg.val_samples, img_size, cfg.num_classes, seed=0), cfg.num_classes)


BUILDERS = {"digits": digits_datasets, "imagefolder": folder_datasets, "imagenet": folder_datasets,
            "synthetic": synthetic_datasets}


def build_datasets(cfg: Any, img_size: int | Sequence[int]) -> Datasets:
    """Datasets of `cfg.name`, optionally cut to the first train_limit / val_limit samples."""
    size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    if cfg.name not in BUILDERS:
        raise ValueError(f"unknown data.name {cfg.name!r}; use data=<{'|'.join(BUILDERS)}>")
    ds = BUILDERS[cfg.name](cfg, size)
    if cfg.get("train_limit"):
        ds.train = Subset(ds.train, range(min(cfg.train_limit, len(ds.train))))
    if cfg.get("val_limit"):
        ds.val = Subset(ds.val, range(min(cfg.val_limit, len(ds.val))))
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
    kept = [b for b in batch if b is not None]
    if not kept:
        # an empty batch would desynchronise the processes of a DDP step
        raise CorruptImageError(f"all {len(batch)} images of a batch were unreadable (data.skip_corrupt drops "
                                "only some images of a batch); check the image files under data.root")
    x, y = default_collate(kept)
    return x, y, len(batch) - len(kept)


def build_loaders(ds: Datasets, cfg: Any, rank: int, world_size: int, micro_batch: int, eval_batch: int,
                  seed: int, pin_memory: bool) -> tuple[DataLoader, ResumableDistributedSampler, DataLoader]:
    """Training loader (shuffled, drop_last, resumable sampler) and evaluation loader (sharded)."""
    workers = cfg.get("num_workers", 0)
    common = dict(num_workers=workers, pin_memory=pin_memory, collate_fn=collate_dropping_corrupt,
                  persistent_workers=workers > 0)
    sampler = ResumableDistributedSampler(ds.train, world_size, rank, shuffle=True, seed=seed)
    train = DataLoader(ds.train, batch_size=micro_batch, sampler=sampler, drop_last=True, **common)
    val = DataLoader(ds.val, batch_size=eval_batch, sampler=ShardSampler(len(ds.val), rank, world_size), **common)
    return train, sampler, val
