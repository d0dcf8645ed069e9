"""Random erasing of whole batches on the device: timm's RandomErasing, with its draws, in a few launches per batch.

timm's ``RandomErasing`` erases a batch image by image: per erased box it allocates the patch, fills it with
normal noise and copies it into the image (~4 launches and ~0.1 ms of host time). With the ImageNet recipe
(p = 0.25, batch 128) that is ~32 boxes and ~130 launches per batch, all in the training process, between two
training steps. :class:`BatchRandomErasing` draws the same boxes from Python's ``random`` in the same order (for the
same seed, the same boxes as timm's), copies them to the device in one transfer, and erases every image's k-th box
with one mask and one ``torch.where`` over the batch.
"""
from __future__ import annotations

import math
import random

import torch
from timm.data.random_erasing import RandomErasing

Box = tuple[int, int, int, int]  # top, left, height, width


class BatchRandomErasing(RandomErasing):
    """timm's RandomErasing (same arguments, same random draws) for (B, C, H, W) batches, returned as a new tensor
    (timm erases in place); a single (C, H, W) image goes to timm's own code, in place. The fill follows timm's
    modes: ``pixel`` normal noise per pixel (drawn for the whole batch, once per box rank), ``rand`` one normal
    colour per box, ``const`` zeros."""

    def boxes(self, batch: int, height: int, width: int) -> list[list[Box]]:
        """Each image's boxes, drawn from ``random`` exactly as timm's ``_erase`` draws them, image after image
        (images before ``batch // num_splits`` draw nothing, as in timm)."""
        start = batch // self.num_splits if self.num_splits > 1 else 0
        area = height * width
        drawn: list[list[Box]] = [[] for _ in range(batch)]
        for i in range(start, batch):
            if random.random() > self.probability:
                continue
            count = self.min_count if self.min_count == self.max_count else \
                random.randint(self.min_count, self.max_count)
            for _ in range(count):
                for _attempt in range(10):
                    target_area = random.uniform(self.min_area, self.max_area) * area / count
                    aspect = math.exp(random.uniform(*self.log_aspect_ratio))
                    h = int(round(math.sqrt(target_area * aspect)))
                    w = int(round(math.sqrt(target_area / aspect)))
                    if w < width and h < height:
                        drawn[i].append((random.randint(0, height - h), random.randint(0, width - w), h, w))
                        break
        return drawn

    def _fill(self, x: torch.Tensor) -> torch.Tensor:
        if self.per_pixel:
            return torch.randn_like(x)
        if self.rand_color:
            return torch.randn(x.shape[0], x.shape[1], 1, 1, dtype=x.dtype, device=x.device)
        return x.new_zeros(())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            return super().__call__(x)
        b, _, height, width = x.shape
        drawn = self.boxes(b, height, width)
        ranks = max(map(len, drawn), default=0)
        if ranks == 0:
            return x
        # (rank, image, [top, left, h, w]); an image without a k-th box gets an empty one
        table = torch.tensor([[found[k] if k < len(found) else (0, 0, 0, 0) for found in drawn]
                              for k in range(ranks)], dtype=torch.int32)
        if x.is_cuda:  # pinned: the copy is queued on the current stream, the host does not wait
            table = table.pin_memory()
        table = table.to(x.device, non_blocking=True).view(ranks, b, 4, 1, 1)
        rows = torch.arange(height, device=x.device).view(1, height, 1)
        cols = torch.arange(width, device=x.device).view(1, 1, width)
        for k in range(ranks):  # in timm's order: a later box of an image is drawn over an earlier one
            top, left, h, w = table[k].unbind(1)
            inside = (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w)
            x = torch.where(inside.unsqueeze(1), self._fill(x), x)
        return x
