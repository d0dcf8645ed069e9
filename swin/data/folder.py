"""Image folders whose unreadable files raise one clear error naming the file, or are dropped and counted.

Both decoding paths build on :class:`CheckedImageFolder`: the CPU one (PIL and timm's transforms in the loader
workers) and the GPU one (swin.data.gpu.decode reads the encoded files).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class CorruptImageError(RuntimeError):
    """An image file that cannot be decoded; the message names the file and the fix."""

    @staticmethod
    def message_of(error: BaseException) -> str:
        """The error's own one-line message, also when a DataLoader worker raised it (the loader re-raises it with
        the worker's traceback in front)."""
        line = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        return line.split("CorruptImageError: ", 1)[-1]



class CheckedImageFolder(Dataset):
    """torchvision ImageFolder whose unreadable files raise an error naming the file, or (with
    skip_corrupt) come back as None for the collate function to drop and count."""

    def __init__(self, root: Path, transform: Any, skip_corrupt: bool):
        from torchvision.datasets import ImageFolder
        try:
            self.folder = ImageFolder(str(root))
        except FileNotFoundError as e:  # torchvision's: no class folders, or a class folder with no image
            raise ValueError(f"{e} ({root}: every class needs a sub-folder holding its images; remove empty ones)"
                             ) from None
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
