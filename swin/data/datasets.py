"""Datasets for training and evaluation: ``digits`` (scikit-learn, embedded), ``imagefolder`` and ``imagenet``
(torchvision ImageFolder with timm's transforms) and ``synthetic`` (random images made on the device).

Folder datasets stop their transforms at a uint8 tensor (timm's ``use_prefetcher=True`` path); the loaders
normalise on the device. With ``data.augment=gpu`` or ``data.decode=gpu`` the splits describe their transforms
for the device instead (swin.data.gpu).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, Subset

from swin.config import DataConfig, DigitsDataConfig, ImageFolderDataConfig, SyntheticDataConfig, as_folder
from swin.data.folder import CheckedImageFolder


@dataclass
class Datasets:
    train: Dataset
    val: Dataset
    num_classes: int
    # Normalisation applied on the device: the datasets yield uint8 images (0-255) that become
    # (x - 255 mean) / (255 std) in float32. None: the datasets already yield normalised float images.
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    # timm's RandomErasing of training batches (swin.data.erasing: whole batches), on the device after normalisation
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


def digits_datasets(cfg: DigitsDataConfig, img_size: tuple[int, int]) -> Datasets:
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
    if cfg.classes is not None:  # a subset of the digits (e.g. pretrain / fine-tune splits), relabelled
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
    return Datasets(TensorImageDataset(x[idx_train], y[idx_train], shift=cfg.shift),
                    TensorImageDataset(x[idx_val], y[idx_val]), num_classes=num_classes)


DECODE_MODES = ("cpu", "gpu")


def decode_mode(cfg: DataConfig) -> str:
    """``data.decode`` of a folder dataset: cpu (PIL and timm's transforms in the loader workers; the default) or gpu
    (the workers decode with nvJPEG and augment on the training device: swin.data.gpu.decode); cpu for the other
    datasets. ValueError for anything else."""
    folder = as_folder(cfg)
    mode = folder.decode if folder is not None else "cpu"
    if mode not in DECODE_MODES:
        raise ValueError(f"data.decode={mode!r}: use cpu (decode and augment with PIL in the loader workers) or gpu "
                         "(the workers decode with nvJPEG and augment on the training device)")
    return mode


AUGMENT_MODES = ("cpu", "gpu")


def augment_mode(cfg: DataConfig) -> str:
    """``data.augment``: where the training and evaluation transforms run. cpu: timm's transforms in the loader
    workers; gpu: swin.data.gpu.augment on the training device. Unset (null): where data.decode decodes. data.decode=gpu
    always augments on the GPU. ValueError for anything else."""
    decode = decode_mode(cfg)
    folder = as_folder(cfg)
    mode = (folder.augment if folder is not None else None) or decode
    if mode not in AUGMENT_MODES:
        raise ValueError(f"data.augment={mode!r}: use cpu (timm's transforms in the loader workers) or gpu (on the "
                         "training device), or null (where data.decode decodes)")
    if decode == "gpu" and mode == "cpu":
        raise ValueError("data.augment=cpu with data.decode=gpu: images decoded on the GPU are augmented there; drop "
                         "data.augment or use data.decode=cpu")
    return mode


def check_decode(cfg: DataConfig, img_size: int | Sequence[int]) -> None:
    """Raise ValueError (naming the data.* key) for what data.decode=gpu or data.augment=gpu cannot do, before any
    work."""
    folder = as_folder(cfg)
    if folder is None:
        return
    if folder.gpu_decode_thread and decode_mode(cfg) != "gpu":
        raise ValueError("data.gpu_decode_thread=true decodes on the GPU in a thread of the training process: it "
                         "needs data.decode=gpu (or drop data.gpu_decode_thread)")
    if folder.gpu_ycbcr and decode_mode(cfg) != "gpu":
        raise ValueError("data.gpu_ycbcr=true decodes JPEG files to their YCbCr planes on the GPU's JPEG engines: it "
                         "needs data.decode=gpu (or drop data.gpu_ycbcr)")
    ring = folder.batch_ring
    if ring not in ("gpu", "host"):
        raise ValueError(f"data.batch_ring={ring!r}: the decoding workers' batches wait for training in the GPU's "
                         "memory (gpu) or in page-locked host memory (host); use one of those")
    if ring == "gpu" and decode_mode(cfg) != "gpu":
        raise ValueError("data.batch_ring=gpu keeps the batches of workers that decode on the GPU in its memory: it "
                         "needs data.decode=gpu (or drop data.batch_ring)")
    if augment_mode(cfg) == "gpu":
        from swin.data.gpu.augment import eval_spec, train_spec
        train_spec(folder, img_size)
        eval_spec(folder, img_size)


def folder_split(cfg: ImageFolderDataConfig, root: Path, img_size: tuple[int, int], train: bool) -> Dataset:
    """One split of a folder dataset with the data config's training or evaluation transforms: in the workers
    (CheckedImageFolder, data.decode=cpu) or, described, for the device (data.augment=gpu: EncodedImageFolder,
    whose files are decoded on the GPU, or DecodedImageFolder, decoded on the CPU by the workers)."""
    if augment_mode(cfg) == "gpu":
        from swin.data.gpu.augment import EvalTransform, TrainTransform, eval_spec, train_spec
        from swin.data.gpu.decode import DecodedImageFolder, EncodedImageFolder
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


def folder_datasets(cfg: ImageFolderDataConfig, img_size: tuple[int, int]) -> Datasets:
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
        differ = [f"only in {split}/: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}"
                  for split, names in ((cfg.train_dir, sorted(set(train.classes) - set(val.classes))),
                                       (cfg.val_dir, sorted(set(val.classes) - set(train.classes)))) if names]
        raise ValueError(f"{root / cfg.train_dir} and {root / cfg.val_dir} have different class folders "
                         f"({'; '.join(differ)}); both splits need the same set of class sub-folders")
    if len(train.classes) < 2:
        raise ValueError(f"{root / cfg.train_dir} has {len(train.classes)} class folder ({train.classes[0]}); "
                         "classification needs at least 2")
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


def synthetic_datasets(cfg: SyntheticDataConfig, img_size: tuple[int, int]) -> Datasets:
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
    return Datasets(SyntheticDataset(cfg.train_samples, img_size, cfg.num_classes, seed=0),
                    SyntheticDataset(cfg.val_samples, img_size, cfg.num_classes, seed=0), cfg.num_classes,
                    mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD)


BUILDERS = {"digits": digits_datasets, "imagefolder": folder_datasets, "imagenet": folder_datasets,
            "synthetic": synthetic_datasets}


def build_datasets(cfg: DataConfig, img_size: int | Sequence[int]) -> Datasets:
    """Datasets of `cfg.name`, optionally cut to the first train_limit / val_limit samples."""
    size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    if cfg.name not in BUILDERS:
        raise ValueError(f"unknown data.name {cfg.name!r}; use data=<{'|'.join(BUILDERS)}>")
    ds = BUILDERS[cfg.name](cfg, size)
    for split, limit in (("train", cfg.train_limit), ("val", cfg.val_limit)):
        part = getattr(ds, split)
        if not limit:
            continue
        if isinstance(part, SyntheticDataset):  # stays a SyntheticDataset: its loader works on the device
            part.num_samples = min(limit, part.num_samples)
        else:
            setattr(ds, split, Subset(part, range(min(limit, len(part)))))
    return ds
