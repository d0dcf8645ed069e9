"""Launch plans of the flash window kernels: tiling, programs per SM, pipelining and warps for a call's shapes.

What a launch needs is a function of the call's static properties alone (shapes, dtype, device, window geometry,
whether it is masked, padded or cosine, and the tuning), so :func:`forward_plan` and :func:`backward_plan` compute
it once per such key and cache it: an eager call then costs a dictionary lookup here, not the arithmetic below.

Tuning knobs (``SWIN_FW_<NAME>``, for sweeps such as scripts/tune_flash_window.py) are read once, at import, into
:data:`TUNING`; :func:`set_tuning` replaces them (the cached plans are keyed by the tuning, so none goes stale).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import NamedTuple

import torch
import triton

KNOBS = ("BLOCK_M", "BWD_BLOCK_M", "PROGRAMS_PER_SM", "BWD_PROGRAMS_PER_SM", "WARPS", "BWD_WARPS", "MAXNREG",
         "BWD_MAXNREG", "STAGES", "BWD_STAGES", "HEAD_MINOR", "BWD_HEAD_MINOR", "TAIL", "HALF_BIAS", "RESIDENT_BIAS",
         "RESIDENT_MIN_WINDOWS", "PDL")


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Overrides of launch parameters by knob name (KNOBS; unset: the rules below decide), the fp32 products'
    precision (None: by tile size), whether new compilations print their registers (``SWIN_FW_DEBUG``) and whether
    eager forwards replay the launches of an earlier call of the same signature (``SWIN_FW_REPLAY=0``: never;
    kernels.ops.LaunchReplay)."""

    knobs: tuple[tuple[str, int], ...] = ()
    fp32_precision: str | None = None
    debug: bool = False
    replay: bool = True

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Tuning:
        """The SWIN_FW_* variables of ``environ`` (default: this process's); ValueError for a non-integer knob."""
        env = os.environ if environ is None else environ
        knobs = []
        for name in KNOBS:
            value = env.get(f"SWIN_FW_{name}")
            if value is not None:
                try:
                    knobs.append((name, int(value)))
                except ValueError:
                    raise ValueError(f"SWIN_FW_{name}={value!r}: give an integer") from None
        return cls(tuple(knobs), env.get("SWIN_FW_FP32_PRECISION"), bool(env.get("SWIN_FW_DEBUG")),
                   env.get("SWIN_FW_REPLAY", "1") != "0")

    def get(self, name: str, default: int) -> int:
        return dict(self.knobs).get(name, default)

    def sets(self, name: str) -> bool:
        return name in dict(self.knobs)


TUNING = Tuning.from_env()


def set_tuning(tuning: Tuning) -> None:
    """Launch with ``tuning`` from now on (tuning sweeps and tests; the plans of each tuning are cached apart)."""
    global TUNING
    TUNING = tuning


def _tuning(name: str, default: int) -> int:
    return TUNING.get(name, default)


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def major_capability(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def key_blocks(window_area: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_T): a window's keys as one power-of-two tile, or, for windows of more than 64 tokens that
    are at most 16 past a power of two, as that power of two plus a 16-key tail: 144 tokens (12x12) as 128 + 16
    keys instead of 256 (44% padding in every product, exp and bias-tile byte). Wider tails cost the backward more
    registers (and spills) than they save. SWIN_FW_TAIL=0: one tile."""
    block_n = max(16, triton.next_power_of_2(window_area))
    head = block_n // 2
    if block_n > 64 and window_area - head <= 16 and _tuning("TAIL", 1):
        return head, 16
    return block_n, 0


def resident_sets(sets: int, total_windows: int, windows_per_image: int) -> int:
    """Program sets (programs per head) for forward programs that keep their bias tile in registers for all their
    windows, else 0. A program takes every sets-th window, so its windows are all of one mask class where sets is a
    multiple of the windows per image (1 without a mask): sets rounds down to one. Only where each program then has
    4 windows or more (SWIN_FW_RESIDENT_MIN_WINDOWS): with fewer the tile's load is hardly repeated, and the
    registers it holds slow the program down."""
    sets = sets // windows_per_image * windows_per_image
    return sets if sets and total_windows >= _tuning("RESIDENT_MIN_WINDOWS", 4) * sets else 0


def resident_forward_sets(total_windows: int, heads: int, sms: int, windows_per_image: int) -> int:
    """The forward's resident program sets (resident_sets) at the most of 32, 16, 8 and 4 programs per SM that allows
    them, else 0 (then 32 per SM, each loading the tile per window: small batches, or images of more windows than a
    launch has programs per head). Fewer programs that keep their tile beat more that reload it per window."""
    for per_sm in (32, 16, 8, 4):
        sets = resident_sets(max(1, min(total_windows, sms * per_sm // heads)), total_windows, windows_per_image)
        if sets:
            return sets
    return 0


def launch_config(total_windows: int, heads: int, window_area: int, head_dim: int, device: torch.device,
                   backward: bool = False, itemsize: int = 2, windows_per_image: int = 1) -> dict:
    """Launch parameters of one kernel (the constexprs among them in capitals). windows_per_image: of the mask grid
    (1 without a mask), for the forward's resident bias tiles (resident_sets)."""
    block_n, block_t = key_blocks(window_area)
    # windows of up to 64 tokens are one query block. Larger ones take 16-row query blocks: with 32 or 64 rows the
    # (rows, 128 or 256) score tiles spill registers or overflow shared memory; except the 16-bit forward of split
    # keys, whose 64 rows are faster (the backward is not)
    block_m = block_n if window_area <= 64 else (64 if block_t and itemsize == 2 and not backward else 16)
    block_m = min(block_n, _tuning("BWD_BLOCK_M" if backward else "BLOCK_M", block_m))
    num_m = triton.cdiv(window_area, block_m)
    assert num_m > 1 or not block_t, "split keys need query blocks of their own (the one-block path reuses the keys)"
    # forward, one-block windows: programs that each loop over windows with the next windows' loads pipelined
    # (STAGES below), 32 per SM, or fewer where each then keeps its bias tile in registers (resident_forward_sets;
    # 16-bit tiles); several query blocks: one program per window and head (0). Backward: 4 programs per SM (2 for
    # split keys), each looping over windows, as each writes a bias-gradient tile that bias_grad_sum_kernel sums
    # (scripts/tune_flash_window.py sweeps these). The interpreter (CPU) runs programs one after the other: 4
    # programs per head (2 with split keys) keep tests quick.
    cuda = device.type == "cuda"
    sms = num_sms(device.index or 0) if cuda else 0
    if backward:
        per_sm = _tuning("BWD_PROGRAMS_PER_SM", 2 if block_t else 4)
    else:
        per_sm = _tuning("PROGRAMS_PER_SM", (32 if num_m == 1 else 0) if cuda else 4)
    budget = sms * per_sm // heads if cuda else per_sm
    # traced with dynamic shapes (torch.compile), the window count is a symbol: a choice that compared it with
    # anything would guard on it, and a later size would recompile; so the program count is the budget (programs
    # past the last window do nothing), and neither resident tiles nor the deeper pipeline are chosen
    symbolic = not isinstance(total_windows, int)
    if per_sm == 0:
        sets = total_windows
    else:
        sets = max(1, budget) if symbolic else max(1, min(total_windows, budget))
    resident = False  # the backward reads its tile per window (see window_attn_bwd_kernel)
    if (not backward and not symbolic and num_m == 1 and not block_t and itemsize == 2
            and _tuning("HALF_BIAS", 1) == 1 and _tuning("RESIDENT_BIAS", 1) == 1):
        # a programs-per-SM knob (or the interpreter's 4 per head) keeps its sets, rounded where that allows it
        chosen = TUNING.sets("PROGRAMS_PER_SM") or not cuda
        resident_at = (resident_sets(sets, total_windows, windows_per_image) if chosen else
                       resident_forward_sets(total_windows, heads, sms, windows_per_image))
        resident, sets = resident_at > 0, resident_at or sets
    # the next windows' loads pipelined through shared memory (one-block windows): the forward's next window for
    # tiles up to 32 KB (larger ones overflow shared memory), the next two for tiles up to 8 KB where a program has
    # 4 windows or more (with fewer the deeper pipeline is slower); the backward's next two for tiles up to 8 KB
    block_d = max(16, triton.next_power_of_2(head_dim))
    tile_bytes = block_n * block_d * itemsize
    if num_m > 1:
        stages = 1
    elif backward:
        stages = 3 if tile_bytes <= 8192 else 1
    else:
        deep = not symbolic and total_windows >= 4 * sets and tile_bytes <= 8192
        stages = 1 if tile_bytes > 32768 else (3 if deep else 2)
    # the backward of windows over 128 tokens: 8 warps for one padded tile, fp32 or wide heads, 4 for 16-bit keys
    # split in two of head_dim up to 32 (their registers then allow 2 programs per SM)
    wide = window_area > 128 and backward
    default_warps = 8 if wide and not (block_t and itemsize == 2 and block_d <= 32) else 4
    return dict(sets=sets, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_T=block_t, BLOCK_D=block_d,
                NUM_M=num_m, num_warps=_tuning("BWD_WARPS" if backward else "WARPS", default_warps),
                # a register cap per thread (0: none), for more programs per SM at the price of spills: a tuning knob
                # of eager calls (not passed where torch.compile traces the op, see kernels.ops.eager_launch)
                maxnreg=_tuning("BWD_MAXNREG" if backward else "MAXNREG", 0),
                STAGES=_tuning("BWD_STAGES" if backward else "STAGES", stages),
                HEAD_MINOR=_tuning("BWD_HEAD_MINOR" if backward else "HEAD_MINOR", 1),
                **({} if backward else {"RESIDENT_BIAS": resident}))


def kernel_constants(cfg: dict, window: tuple[int, int], masked: bool, has_fill: bool, dtype: torch.dtype,
                     cosine: bool = False, rows: int = 0) -> dict:
    """The kernels' constexpr arguments for a launch config (also used by scripts/kernel_resources.py); rows: those
    of the bias tiles (see tile_rows; default the config's own query rows)."""
    tiling = {k: v for k, v in cfg.items() if k not in ("sets", "num_warps", "maxnreg")}
    tiling["TILE_ROWS"] = rows or cfg["NUM_M"] * cfg["BLOCK_M"]
    # fp32: three tf32 products per product (about fp32 accuracy on tensor cores, faster than exact FMAs) for key
    # tiles of up to 4608 elements (64 x 64, or 12x12 windows' 128 + 16 keys of 32 channels); larger ones do not fit
    # in shared memory that way and take exact fp32 FMAs (scripts/kernel_resources.py)
    small = (cfg["BLOCK_N"] + cfg["BLOCK_T"]) * cfg["BLOCK_D"] <= 4608
    fp32 = TUNING.fp32_precision or ("tf32x3" if small else "ieee")
    return dict(WH=window[0], WW=window[1], MASKED=masked, HAS_FILL=has_fill, COSINE=cosine,
                PRECISION=fp32 if dtype == torch.float32 else "tf32", **tiling)


def tile_rows(total_windows: int, heads: int, window_area: int, head_dim: int, device: torch.device,
              itemsize: int, forward: dict | None = None) -> int:
    """Rows of the bias tiles: the forward makes them and the backward reads them (tiles.shape[2]), each with its own
    query blocks (12x12 windows: 3 x 64 rows forward, 9 x 16 backward), so the more of the two. forward: the
    forward's launch config, where the caller has it."""
    configs = [forward or launch_config(total_windows, heads, window_area, head_dim, device, itemsize=itemsize),
               launch_config(total_windows, heads, window_area, head_dim, device, backward=True, itemsize=itemsize)]
    return max(cfg["NUM_M"] * cfg["BLOCK_M"] for cfg in configs)


def tile_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The bias tiles' dtype: a half-precision input's own dtype (what timm's SDPA path adds: its bias-plus-mask
    tensor is cast to the query's dtype), fp32 for fp32 inputs or with SWIN_FW_HALF_BIAS=0. Programs read their
    head's tile once per window, except resident ones (L2 hits, but in fp32 more bytes than the window's q, k, v,
    o): half tiles halve that traffic."""
    half = x_dtype in (torch.float16, torch.bfloat16) and _tuning("HALF_BIAS", 1)
    return x_dtype if half else torch.float32


class ForwardPlan(NamedTuple):
    """A forward launch: its config (launch_config), the kernels' constexpr and launch keywords, the bias tiles'
    shape and dtype, and whether it launches as a programmatic dependent of the tile kernel (PDL)."""

    cfg: dict
    keywords: dict
    tiles_shape: tuple[int, int, int, int]
    tiles_dtype: torch.dtype
    pdl: bool


class BackwardPlan(NamedTuple):
    cfg: dict
    keywords: dict


def _keywords(cfg: dict, window: tuple[int, int], masked: bool, has_fill: bool, dtype: torch.dtype, cosine: bool,
              rows: int, eager: bool) -> dict:
    keywords = kernel_constants(cfg, window, masked, has_fill, dtype, cosine, rows)
    launch = {"num_warps": cfg["num_warps"], **({"maxnreg": cfg["maxnreg"]} if cfg["maxnreg"] and eager else {})}
    return {**keywords, **launch}


@functools.lru_cache(maxsize=4096)
def forward_plan(geometry: tuple[int, ...], window: tuple[int, int], heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, masked: bool, has_fill: bool, cosine: bool, eager: bool,
                 tuning: Tuning) -> ForwardPlan:
    """The forward's plan for a call of this geometry (the kernels' integer geometry: total windows, window area,
    feature map, window grid, shift, mask grid). eager: launched now rather than traced by torch.compile (launch
    options such as maxnreg and PDL apply to eager launches only). tuning: TUNING, part of the cache key."""
    total_windows, area, mask_grid = geometry[0], geometry[1], geometry[-2:]
    itemsize = dtype.itemsize
    cfg = launch_config(total_windows, heads, area, head_dim, device, itemsize=itemsize,
                        windows_per_image=mask_grid[0] * mask_grid[1] if masked else 1)
    rows = tile_rows(total_windows, heads, area, head_dim, device, itemsize, forward=cfg)
    pdl = (device.type == "cuda" and eager and _tuning("PDL", 1) == 1 and major_capability(device.index or 0) >= 9)
    return ForwardPlan(cfg, _keywords(cfg, window, masked, has_fill, dtype, cosine, rows, eager),
                       (4 if masked else 1, heads, rows, cfg["BLOCK_N"] + cfg["BLOCK_T"]), tile_dtype(dtype), pdl)


@functools.lru_cache(maxsize=4096)
def backward_plan(geometry: tuple[int, ...], window: tuple[int, int], heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device, masked: bool, has_fill: bool, cosine: bool, rows: int, eager: bool,
                  tuning: Tuning) -> BackwardPlan:
    """The backward's plan (as forward_plan's; rows: those of the forward's bias tiles)."""
    total_windows, area = geometry[0], geometry[1]
    cfg = launch_config(total_windows, heads, area, head_dim, device, backward=True,
                        itemsize=dtype.itemsize)
    return BackwardPlan(cfg, _keywords(cfg, window, masked, has_fill, dtype, cosine, rows, eager))
