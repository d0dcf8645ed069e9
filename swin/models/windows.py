"""Window geometry of Swin attention: shift, padding, partition, masks, relative position index.

Everything here follows official Swin / timm semantics exactly, because the relative position
bias tables and the -100 mask values of pretrained checkpoints depend on them:

* a block rolls its (H, W) feature map by (-shift_h, -shift_w), *then* pads it at the bottom/right
  to a multiple of the window, then cuts it into windows;
* the shifted-window mask labels every padded-image position with a region id (3 x 3 regions per
  image, made from the padded size) and gives -100 to every query/key pair of different regions.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

MASK_VALUE = -100.0  # official Swin's and timm's value for cross-region pairs (not -inf)


@dataclass(frozen=True)
class WindowSpec:
    """Static geometry of one block's window attention on an (H, W) feature map."""

    feat_size: tuple[int, int]     # (H, W) of the feature map, before padding
    window_size: tuple[int, int]   # (Wh, Ww)
    shift_size: tuple[int, int]    # (Sh, Sw); 0 on an axis means no shift there

    @property
    def padded_size(self) -> tuple[int, int]:
        (h, w), (wh, ww) = self.feat_size, self.window_size
        return (-(-h // wh) * wh, -(-w // ww) * ww)

    @property
    def grid_size(self) -> tuple[int, int]:
        """Windows per image along (H, W)."""
        (hp, wp), (wh, ww) = self.padded_size, self.window_size
        return (hp // wh, wp // ww)

    @property
    def num_windows(self) -> int:
        gh, gw = self.grid_size
        return gh * gw

    @property
    def window_area(self) -> int:
        return self.window_size[0] * self.window_size[1]

    @property
    def shifted(self) -> bool:
        return any(self.shift_size)

    @property
    def padded(self) -> bool:
        """Whether the map is padded to whole windows. With sizes that torch.compile traces as symbols it is True
        unless they are known to divide (statically_known_true adds no guard): padding by zero rows changes
        nothing, and one graph then serves every size instead of one per pad/no-pad pattern."""
        (h, w), (wh, ww) = self.feat_size, self.window_size
        return not (statically_known_true(h % wh == 0) and statically_known_true(w % ww == 0))


def stage_windows(stages: int, grid: tuple[int, int], ref_windows: Sequence[tuple[int, int]],
                  ref_grid: tuple[int, int], window_size: Any = None, window_ratio: Any = None
                  ) -> tuple[tuple[int, int], ...]:
    """One (h, w) window per stage for a new patch grid, as timm (>= 1.0.31) resizes Swin: ``window_size`` an int
    or (h, w) for every stage, or one per stage; else ``window_ratio`` (an int, or one per stage) divides the grid;
    else each reference window scales with the grid (ref_windows were set for ref_grid). ValueError for a spec
    that does not give one positive window per stage."""
    if window_size is not None:
        spec = window_size
        if not isinstance(spec, (list, tuple)) or (len(spec) == 2 and not isinstance(spec[0], (list, tuple))):
            spec = (spec,) * stages
        windows = tuple((w, w) if isinstance(w, int) else tuple(w) for w in spec)
    elif window_ratio is not None:
        ratios = tuple(window_ratio) if isinstance(window_ratio, (list, tuple)) else (window_ratio,) * stages
        if len(ratios) != stages or any(r <= 0 for r in ratios):
            raise ValueError(f"window_ratio {window_ratio!r}: give one positive divisor, or one per stage ({stages})")
        windows = tuple((max(1, grid[0] // r), max(1, grid[1] // r)) for r in ratios)
    else:
        windows = tuple((max(1, w[0] * grid[0] // ref_grid[0]), max(1, w[1] * grid[1] // ref_grid[1]))
                        for w in ref_windows)
    if len(windows) != stages or any(len(w) != 2 or min(w) <= 0 for w in windows):
        raise ValueError(f"window_size {window_size!r}: give an int or (h, w) for every stage, or one per stage "
                         f"({stages}), all positive")
    return windows


def clamp_window_and_shift(
    feat_size: tuple[int, int], window_size: tuple[int, int], shift_size: tuple[int, int]
) -> tuple[tuple[int, int], tuple[int, int]]:
    """timm's rule: an axis whose feature size is not larger than the window uses one window of
    the feature size and no shift on that axis."""
    window = tuple(f if f <= w else w for f, w in zip(feat_size, window_size))
    shift = tuple(0 if f <= w else s for f, w, s in zip(feat_size, window, shift_size))
    return window, shift  # type: ignore[return-value]


def relative_position_index(window_size: tuple[int, int], device: torch.device | None = None) -> torch.Tensor:
    """(L, L) index into the ((2Wh-1)(2Ww-1), heads) bias table, as official Swin builds it."""
    wh, ww = window_size
    coords = torch.stack(torch.meshgrid(
        torch.arange(wh, device=device), torch.arange(ww, device=device), indexing="ij")).flatten(1)
    rel = coords[:, :, None] - coords[:, None, :]  # 2, L, L
    return (rel[0] + wh - 1) * (2 * ww - 1) + (rel[1] + ww - 1)


def log_spaced_relative_coords(window_size: tuple[int, int], pretrained_window_size: tuple[int, int] = (0, 0),
                                device: torch.device | None = None) -> torch.Tensor:
    """((2Wh-1)(2Ww-1), 2) inputs of Swin V2's continuous position bias MLP, one row per entry of the bias table.

    Relative offsets (dy, dx) are divided by (window - 1) of the window the model was pretrained with (the
    current one when 0), times 8, then log-spaced: sign(t) log2(1 + |t|) / log2(8). Dividing by the pretrained
    window keeps the MLP's inputs for offsets it has seen when fine-tuning at a larger window.
    """
    wh, ww = window_size
    ph, pw = pretrained_window_size if pretrained_window_size[0] > 0 else window_size
    dy = torch.arange(-(wh - 1), wh, device=device, dtype=torch.float32) / max(ph - 1, 1)
    dx = torch.arange(-(ww - 1), ww, device=device, dtype=torch.float32) / max(pw - 1, 1)
    coords = torch.stack(torch.meshgrid(dy, dx, indexing="ij"), dim=-1).reshape(-1, 2) * 8
    return torch.sign(coords) * torch.log2(coords.abs() + 1.0) / 3.0  # log2(8) = 3


def region_ids(length: int, window: int, shift: int, device: torch.device | None = None) -> torch.Tensor:
    """Region id (0, 1, 2) of each position along one padded axis; all 0 when the axis is unshifted.

    Matches timm's slices (0, -window), (-window, -shift), (-shift, None) of the padded image.
    """
    pos = torch.arange(length, device=device)
    if shift == 0:
        return torch.zeros_like(pos)
    return (pos >= length - window).long() + (pos >= length - shift).long()


def shifted_window_mask(
    spec: WindowSpec, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor | None:
    """(num_windows, L, L) additive mask, 0 within a region and -100 across; None when unshifted."""
    if not spec.shifted:
        return None
    (hp, wp), (wh, ww), (sh, sw) = spec.padded_size, spec.window_size, spec.shift_size
    ids = region_ids(hp, wh, sh, device)[:, None] * 3 + region_ids(wp, ww, sw, device)[None, :]
    ids = window_partition(ids[None, :, :, None], spec.window_size).reshape(-1, wh * ww)
    different = ids[:, None, :] != ids[:, :, None]
    return torch.zeros(different.shape, device=device, dtype=dtype).masked_fill_(different, MASK_VALUE)


def window_partition(x: torch.Tensor, window_size: tuple[int, int]) -> torch.Tensor:
    """(B, Hp, Wp, ...) -> (B * num_windows, Wh * Ww, ...), windows in row-major image order."""
    b, hp, wp = x.shape[:3]
    rest = x.shape[3:]
    wh, ww = window_size
    x = x.reshape(b, hp // wh, wh, wp // ww, ww, *rest).transpose(2, 3)
    return x.reshape(b * (hp // wh) * (wp // ww), wh * ww, *rest)


def window_reverse(windows: torch.Tensor, window_size: tuple[int, int], padded_size: tuple[int, int]) -> torch.Tensor:
    """Inverse of window_partition: (B * num_windows, Wh * Ww, ...) -> (B, Hp, Wp, ...)."""
    (wh, ww), (hp, wp) = window_size, padded_size
    rest = windows.shape[2:]
    x = windows.reshape(-1, hp // wh, wp // ww, wh, ww, *rest).transpose(2, 3)
    return x.reshape(-1, hp, wp, *rest)


def shift_pad_partition(x: torch.Tensor, spec: WindowSpec, fill: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, W, *rest) -> (B * num_windows, L, *rest): cyclic shift, pad, partition.

    Padded positions take `fill` (broadcast over *rest), or zero. timm pads the normalised input
    before the qkv projection, so padded q/k/v equal the projection's bias: pass it as `fill`.
    """
    (sh, sw), (h, w), (hp, wp) = spec.shift_size, spec.feat_size, spec.padded_size
    if spec.shifted:
        x = torch.roll(x, shifts=(-sh, -sw), dims=(1, 2))
    if spec.padded:
        pad = [0, 0] * (x.dim() - 3) + [0, wp - w, 0, hp - h]
        x = F.pad(x, pad)
        if fill is not None:
            inside = (torch.arange(hp, device=x.device) < h)[:, None] & (torch.arange(wp, device=x.device) < w)
            x = torch.where(inside.view(1, hp, wp, *([1] * (x.dim() - 3))), x, fill.to(x.dtype))
    return window_partition(x, spec.window_size)


def merge_unpad_unshift(windows: torch.Tensor, spec: WindowSpec) -> torch.Tensor:
    """Inverse of shift_pad_partition: (B * num_windows, L, *rest) -> (B, H, W, *rest)."""
    (sh, sw), (h, w) = spec.shift_size, spec.feat_size
    x = window_reverse(windows, spec.window_size, spec.padded_size)
    if spec.padded:
        x = x[:, :h, :w]
    if spec.shifted:
        x = torch.roll(x, shifts=(sh, sw), dims=(1, 2))  # a contiguous copy
    elif spec.padded:  # copied here, not by the caller's reshape: no view-or-copy guard per size under torch.compile
        x = x.clone(memory_format=torch.contiguous_format)
    return x
