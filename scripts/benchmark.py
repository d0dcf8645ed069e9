"""End-to-end Swin throughput: our model (attention standard | sdpa | flash_window) against timm's Swin.

``python scripts/benchmark.py`` (Hydra, configs/benchmark.yaml + configs/grid/) loops over a grid of rows
(implementation x attention x compile x batch size x precision) and prints ONE side-by-side markdown
table; it also writes benchmark.json, benchmark.md and a bar chart benchmark.png to ``out_dir``.

Per row, on the same synthetic data (random images and labels, fixed seed):

* inference: ``model.eval()``, ``torch.no_grad()``, forward only;
* training: a full step: forward and cross-entropy loss under autocast, backward (with a grad scaler for
  fp16), AdamW step (fused on CUDA), ``zero_grad(set_to_none=True)``;
* with ``steps.fwd_bwd=true`` (``grid=backbone``), also the training step without ``opt.step()``: forward,
  loss, backward, ``zero_grad`` (``fwd_bwd_img_s``; the "fwd+bwd" columns), what a backbone's own share of a
  detector's step is, measured after the training step on its compiled graphs;
* each measured as: warm-up steps (untimed; they include torch.compile), then ``repeats`` x ``timed``
  steps, synchronised before and after each repeat; images/s is the median over the repeats. Peak memory
  is ``torch.cuda.max_memory_allocated`` from the second step on (weights, optimizer state and data included;
  CUDA-graph pools, allocated while recording, too); the first step's, which includes what compiling allocates,
  is ``*_first_step_peak_gib`` in benchmark.json. Compiled rows release their inference graphs and CUDA-graph pool
  before the training steps, so a training peak holds no inference memory.

Rows: ``ours`` is ``swin.create_model(name, attention=..., fused_mlp_act=...)`` (fused_mlp_act: on, the model's
default, unless the row says ``fused_mlp_act: false``; such rows are labelled ``-fused_gelu``; likewise
``fold_norm_affine: false``, ``-fold_norm``); ``timm`` is timm's
own Swin of the same name (``timm.create_model``; for names timm does not know, e.g. swin_micro, timm's
SwinTransformer class with our architecture config), with its SDPA path off (``math``: timm's default,
TIMM_FUSED_ATTN=0, explicit softmax) or on (``sdpa``: what TIMM_FUSED_ATTN=2 selects). timm reads that switch when
an attention module is built, so it is set with ``timm.layers.set_fused_attn`` before building and then checked on
every WindowAttention module (``attn.fused_attn``). timm's Swin V2 (``swinv2_*`` names; ``swinv2_micro``: timm's
SwinTransformerV2 class with our config) has explicit attention math only: its ``math`` rows run, its ``sdpa`` /
``sdpa_no_cudnn`` rows are skipped (``grid=swinv2`` has none). Compiled rows use ``dynamic=False``:
ours ``swin.compile_model`` (inference as eval.py, training as train.py), timm ``torch.compile``. Memory and
compiled graphs are freed between rows. With ``features_only``
(``grid=backbone``: 800x1216, as a detector feeds its backbone) both sides are their features_only models, and
the training loss is every map's mean square (a dense head's stand-in).

Profiler mode (``profile.enabled=true``): after every row is timed (and timed again in turn, below), each row is
built again (compiled rows mostly from inductor's caches) and a few of its steps run under torch.profiler, so no
row is timed in a process where the profiler has run (a host-bound row has timed up to a quarter slower there,
docs/performance.md). It reports the fraction of step time spent in attention: GPU time of the kernels that
belong to attention, per step, divided by the wall time per step of the same profiled steps (also: divided by
all GPU busy time). A kernel belongs to
attention if its name matches our kernels (``window_attn_*``, ``bias_tiles_kernel``), SDPA / softmax kernels (``fmha``,
``flash_fwd``/``flash_bwd``, ``softmax`` but not ``log_softmax``; inductor names fused kernels after the ops
they contain), or if the op that launched it, or one of that op's parents, is attention:
``swin::flash_window*`` (our op, its bias gradient reduction included), ``aten::bmm`` (only attention uses
batched matmuls here: linears are ``addmm``/``mm``), ``aten::_softmax*``, ``aten::*scaled_dot_product*`` /
``*_attention*``. The elementwise bias and mask additions of eager math rows are not counted (a lower bound
for those rows); in compiled rows they are fused into the softmax kernel and counted. On the CPU the same op
rule is applied to CPU self time.

The same profiled steps also give a GPU time breakdown per row and step (``{train,infer}_breakdown_ms`` in
benchmark.json, a second table in benchmark.md): kernel self time per step (kernels, memcpy and memset) in
seven categories, attention | GEMM | norm/elementwise | copies/layout | combined | optimizer | other, by kernel name
only (``classify_kernel``; so unlike the attention fraction, the cuBLAS batched matmuls of eager ``standard`` /
``math`` attention count as GEMM). An inductor kernel (``triton_poi_fused_<ops>_<n>``) is copies/layout only
if every op in its name only moves data (``triton_poi_fused__unsafe_view_clone_1``), combined if its name has no
ops (``triton_poi_fused_12``: a combo kernel, several small kernels in one launch, or one of the few copies inductor
adds itself), else norm/elementwise
(``triton_poi_fused_add_clone_gelu_view_5``). Next to it, ``{train,infer}_busy_union_ms_per_step``: the union
of the kernel intervals on the timeline per step (concurrent kernels count once; ``busy_ms_per_step`` is
their plain sum); GPU busy time well below the step time means the step is host-bound. On the CPU there are
no kernels: both are None (``-`` in the table). With ``profile.top_kernels > 0``, profile.md lists the top
kernels with their categories and the host op each was launched from (``kernel_launchers``) too.

With ``steps.interleave=true`` (``grid=eager`` sets it) the rows of each batch size and precision, eager and
compiled, are then timed again in turn, repeat by repeat (``interleave_rows``), and their img/s is that run's; peak
memory and host cost stay the rows' own. That compares rows whose steps are bound by the host
(eager, and the default compile mode) on the same host minutes, e.g. two sets of inductor options:

    python scripts/benchmark.py grid=compiled steps.interleave=true \
      'grid.rows=[{impl:ours,attention:flash_window,compile:[true]},{impl:ours,attention:flash_window,compile:[true],inductor:{combo_kernels:false}},{impl:timm,attention:sdpa_no_cudnn,compile:[true]}]'

Eager rows on CUDA (``grid=eager``) also report their host cost (``host_times``): CPU time to enqueue one inference
forward and one call of the first stage's shifted block, with the GPU kept busy so that no wait is counted
(``infer_host_ms``, ``infer_host_block_us``; a third table in benchmark.md). An eager forward whose host time
exceeds its step's GPU time is host-bound. With ``profile.host_phases=true`` every row's training step is split on
the host too (``host_phases``): CPU time per phase (forward, loss, backward, optimizer, zero_grad) with the GPU kept
busy (``train_host_phases_ms``, a table in benchmark.md): where a compiled or CUDA-graphed step is host-bound, where
the host's time goes.

Examples:
    python scripts/benchmark.py out_dir=$OUT/bench                          # default grid (Swin-T, b128, bf16)
    python scripts/benchmark.py grid=quick                                   # eager rows only, ~1 min
    python scripts/benchmark.py grid=cudagraphs                              # compiled rows, also reduce-overhead
    python scripts/benchmark.py model=swin_base_patch4_window12_384 grid.batch_size=[64]
    python scripts/benchmark.py profile.enabled=true
    python scripts/benchmark.py -m model=swin_tiny_patch4_window7_224,swin_base_patch4_window7_224
    python scripts/benchmark.py model=swin_micro device=cpu grid=smoke      # CPU smoke test
    python scripts/benchmark.py grid=swinv2 model=swinv2_tiny_window8_256   # Swin V2 against timm's V2
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

# Without CUDA our flash_window kernels run in the Triton interpreter, which must be chosen before anything
# imports triton (timm does). An explicit TRITON_INTERPRET from the user wins.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import collections  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterable, Iterator  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import hydra  # noqa: E402
import timm  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hydra.core.config_store import ConfigStore  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import (  # noqa: E402
    MISSING,  # noqa: E402
    DictConfig,
    ListConfig,
    OmegaConf,
)

import swin  # noqa: E402
import swin.config  # noqa: E402, F401  (registers the config schemas before Hydra composes)
from scripts.bench_attention import host_us  # noqa: E402  (the same queued host timing)
from swin.config import ModelConfig  # noqa: E402
from swin.models.compiling import check_memory_budget, flat_options, inductor_options  # noqa: E402
from swin.models.swin_transformer import SwinTransformerBlock, WindowAttentionBase  # noqa: E402
from swin.precision import fp8_linears, fp8_problem  # noqa: E402
from swin.train.distributed import pick_device  # noqa: E402


# --- the config schema of configs/benchmark.yaml (Hydra structured config; the YAML keeps the values) ---
@dataclass
class GridRow:
    """One row of a configs/grid/ entry: expands over compile x grid.batch_size x grid.precision."""

    impl: str = MISSING
    attention: str = MISSING
    compile: list[bool] = field(default_factory=lambda: [False])
    compile_mode: str | None = None  # None: the benchmark's compile_mode
    fused_mlp_act: bool | None = None  # ours only: fc1 + GELU as one cuBLASLt GEMM in inference; None: the model's
    # ours, compiled: inductor options over swin.compile_model's, e.g. {combo_kernels: true} or
    # {triton: {mix_order_reduction: false}} (nested keys join with dots, as inductor names them)
    inductor: dict[str, Any] | None = None
    # ours, compiled: the training compile's activation memory budget (swin.compile_model's memory_budget)
    memory_budget: float | None = None
    # ours only: v1 pre-norms' affine folded into the next Linear while training (swin.create_model's
    # fold_norm_affine); None: the model's default (on)
    fold_norm_affine: bool | None = None


@dataclass
class GridConfig:
    batch_size: list[int] = MISSING
    precision: list[str] = MISSING
    rows: list[GridRow] = MISSING


@dataclass
class BenchStepsConfig:
    warmup: int = MISSING
    timed: int = MISSING
    repeats: int = MISSING
    # the rows of one batch size and precision timed again in turn (interleave_rows); grid=eager sets it
    interleave: bool = False
    # also time forward + loss + backward without the optimizer step (fwd_bwd_*; grid=backbone sets it)
    fwd_bwd: bool = False


@dataclass
class BenchOptimizerConfig:
    lr: float = MISSING
    weight_decay: float = MISSING
    fused: Any = MISSING  # auto | true | false


@dataclass
class BenchProfileConfig:
    enabled: bool = MISSING
    steps: int = MISSING
    trace: bool = MISSING
    top_kernels: int = MISSING
    saved_tensors: bool = MISSING
    host_phases: bool = False


@dataclass
class BenchmarkAppConfig:
    """configs/benchmark.yaml and configs/grid/ (scripts/benchmark.py)."""

    model: ModelConfig = MISSING
    grid: GridConfig = MISSING
    steps: BenchStepsConfig = MISSING
    device: str = MISSING
    seed: int = MISSING
    out_dir: str | None = MISSING
    tf32: bool = MISSING
    compile_mode: str = MISSING
    time_budget_s: float = MISSING
    features_only: bool = False
    optimizer: BenchOptimizerConfig = field(default_factory=BenchOptimizerConfig)
    profile: BenchProfileConfig = field(default_factory=BenchProfileConfig)


ConfigStore.instance().store(group="schema", name="benchmark", node=BenchmarkAppConfig)

# fp8: bf16 autocast with the linear layers where FP8 pays in FP8 (train.amp=fp8; none of Swin's), fp8_all: with
# every layer FP8 GEMMs take in FP8 (train.fp8_layers=all); swin.precision.fp8_linears, on both sides
PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.bfloat16,
              "fp8_all": torch.bfloat16}
FP8_LAYERS = {"fp8": "pays", "fp8_all": "all"}
# keys of configs/model/*.yaml that describe the architecture (the others: attention, pretrained, ...)
ARCH_KEYS = ("img_size", "patch_size", "window_size", "embed_dim", "depths", "num_heads", "mlp_ratio",
             "in_chans", "qkv_bias", "drop_path_rate", "num_classes", "pretrained_window_sizes")


@dataclass(frozen=True)
class RowSpec:
    impl: str          # ours | timm
    attention: str     # ours: standard | sdpa | flash_window; timm: math | sdpa | sdpa_no_cudnn
    compile: bool
    batch_size: int
    precision: str     # bf16 | fp16 | fp32 | fp8 | fp8_all
    compile_mode: str | None = None  # this row's torch.compile mode; None: the config's compile_mode
    # ours: fc1 + GELU as one cuBLASLt GEMM (GELU epilogue) in bf16/fp16 inference; None: the model's default (on;
    # timm rows: not theirs)
    fused_mlp_act: bool | None = None
    # ours, compiled: inductor options over swin.compile_model's, sorted (name, value) pairs (a row's inductor: dict)
    inductor: tuple[tuple[str, Any], ...] = ()
    memory_budget: float | None = None  # ours, compiled: the training compile's (swin.compile_model); None: torch's
    fold_norm_affine: bool | None = None  # ours: swin.create_model's; None: the model's default (on)

    @property
    def impl_label(self) -> str:
        """The implementation with ours' model options turned off: "ours -fused_gelu -fold_norm"."""
        off = " -fused_gelu" if self.impl == "ours" and self.fused_mlp_act is False else ""
        off += " -fold_norm" if self.impl == "ours" and self.fold_norm_affine is False else ""
        return self.impl + off

    @property
    def label(self) -> str:
        mode = f"({self.compile_mode})" if self.compile and self.compile_mode else ""
        return (f"{self.impl_label} {self.attention}{' +compile' if self.compile else ''}{mode}"
                f"{inductor_label(self.inductor) if self.compile else ''}"
                f"{f' +memory_budget={self.memory_budget}' if self.compile and self.memory_budget else ''}"
                f" b{self.batch_size} {self.precision}")


def inductor_label(inductor: Iterable[Iterable[Any]]) -> str:
    """" +name=value ..." of a row's inductor overrides ("" without)."""
    return "".join(f" +{name}={value}" for name, value in inductor)


def _as_list(value: Any) -> list:
    if isinstance(value, (list, tuple, ListConfig)):
        return list(value)
    return [value]


def expand_grid(grid: DictConfig, fused_mlp_act: bool = True) -> list[RowSpec]:
    """Rows in config order; each entry expands over compile x batch_size x precision. fused_mlp_act: ours' rows
    that do not set it (the model config's model.fused_mlp_act)."""
    specs = []
    for entry in grid.rows:
        impl, attention = str(entry.impl), str(entry.attention)
        if impl not in ("ours", "timm"):
            raise ValueError(f"grid row impl must be 'ours' or 'timm', got {impl!r}")
        valid = ("standard", "sdpa", "flash_window") if impl == "ours" else ("math", "sdpa", "sdpa_no_cudnn")
        if attention not in valid:
            raise ValueError(f"grid row attention for {impl} must be one of {valid}, got {attention!r}")
        fused = entry.get("fused_mlp_act")
        if fused is not None and impl != "ours":
            raise ValueError("grid row fused_mlp_act is a setting of ours (swin.create_model), not of timm's model")
        # ours: the row's setting, else the model config's; timm: None (not a setting of its model)
        fused = (fused_mlp_act if fused is None else bool(fused)) if impl == "ours" else None
        inductor, budget, fold = entry.get("inductor"), entry.get("memory_budget"), entry.get("fold_norm_affine")
        for key, value in (("inductor (options over swin.compile_model's)", inductor),
                           ("memory_budget (swin.compile_model's)", budget),
                           ("fold_norm_affine (swin.create_model's)", fold)):
            if value is not None and impl != "ours":
                raise ValueError(f"grid row {key} is a setting of ours; timm's rows compile with torch.compile as "
                                 "its users do")
        inductor = tuple(sorted(flat_options(OmegaConf.to_container(inductor)).items())) if inductor else ()
        check_memory_budget(budget, "grid row memory_budget")
        for compiled in _as_list(entry.get("compile", [False])):
            for batch in _as_list(grid.batch_size):
                for precision in _as_list(grid.precision):
                    if precision not in PRECISIONS:
                        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
                    mode = entry.get("compile_mode")
                    specs.append(RowSpec(impl, attention, bool(compiled), int(batch), str(precision),
                                         None if mode is None else str(mode), fused, inductor,
                                         None if budget is None else float(budget),
                                         None if fold is None else bool(fold)))
    return specs


# ---------------------------------------------------------------------------------------------
# models

def architecture(model_cfg: DictConfig) -> tuple[str, dict[str, Any]]:
    """(name, architecture overrides) from a configs/model/ entry; null values are left to the defaults."""
    cfg = OmegaConf.to_container(model_cfg, resolve=True)
    arch = {k: cfg[k] for k in ARCH_KEYS if cfg.get(k) is not None}
    for key in ("img_size", "window_size", "patch_size", "depths", "num_heads", "pretrained_window_sizes"):
        if isinstance(arch.get(key), list):
            arch[key] = tuple(arch[key])
    return cfg["name"], arch


def create_ours(name: str, arch: dict[str, Any], attention: str, fused_mlp_act: bool | None = None,
                features_only: bool = False, fold_norm_affine: bool | None = None) -> nn.Module:
    extra = {"features_only": True} if features_only else {}
    if fold_norm_affine is not None:
        extra["fold_norm_affine"] = fold_norm_affine
    model = swin.create_model(name, attention=attention, fused_mlp_act=fused_mlp_act, **arch, **extra)
    found = {m.attention for m in model.modules() if isinstance(m, WindowAttentionBase)}
    if found != {attention}:
        raise RuntimeError(f"model reports attention {sorted(found)}, wanted {attention!r}")
    return model


def is_swinv2(name: str) -> bool:
    return swin.MODEL_CONFIGS[name].get("version", 1) == 2


def timm_unavailable(spec: RowSpec, name: str) -> str | None:
    """Why timm has no such row (None if it has): its Swin V2 computes attention with explicit math only."""
    if spec.impl == "timm" and spec.attention != "math" and is_swinv2(name):
        return "timm's Swin V2 has no SDPA path (explicit math only)"
    return None


def _timm_features(name: str, arch: dict[str, Any]) -> nn.Module:
    if not timm.is_model(name):
        raise RuntimeError(f"timm has no model {name!r} to build a features_only model of")
    return timm.create_model(name, pretrained=False, features_only=True, **arch)


def create_timm_v2(name: str, arch: dict[str, Any], features_only: bool = False) -> nn.Module:
    """timm's Swin V2 (explicit attention math, its only path)."""
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    if features_only:
        return _timm_features(name, arch)
    if timm.is_model(name):
        return timm.create_model(name, pretrained=False, **arch)
    config = {k: v for k, v in swin.MODEL_CONFIGS[name].items() if k != "version"}
    return SwinTransformerV2(**{**config, **arch})  # e.g. swinv2_micro


def create_timm(name: str, arch: dict[str, Any], fused: bool, features_only: bool = False) -> nn.Module:
    """timm's Swin with its SDPA path on (TIMM_FUSED_ATTN=2 behaviour) or off; checked on every block."""
    from timm.layers import set_fused_attn
    from timm.models.swin_transformer import SwinTransformer, WindowAttention

    # timm's WindowAttention reads the switch in __init__ (use_fused_attn(experimental=True): on only at
    # level 2, which TIMM_FUSED_ATTN=2 or set_fused_attn(True, experimental=True) selects)
    set_fused_attn(fused, experimental=fused)
    try:
        if features_only:
            model = _timm_features(name, arch)
        elif timm.is_model(name):
            model = timm.create_model(name, pretrained=False, **arch)
        else:  # e.g. swin_micro: timm's class with our architecture config
            model = SwinTransformer(**{**swin.MODEL_CONFIGS[name], **arch})
    finally:
        set_fused_attn(True)  # timm's import-time default (level 1) for anything built later
    attns = [m for m in model.modules() if isinstance(m, WindowAttention)]
    flags = {bool(m.fused_attn) for m in attns}
    if not attns or flags != {fused}:
        raise RuntimeError(f"timm WindowAttention.fused_attn is {sorted(flags)}, wanted {fused} "
                           f"(timm {timm.__version__})")
    return model


def create_model(spec: RowSpec, name: str, arch: dict[str, Any], features_only: bool = False) -> nn.Module:
    """The row's model; features_only: its backbone (timm's features_only model of each side)."""
    if spec.impl == "ours":
        return create_ours(name, arch, spec.attention, spec.fused_mlp_act, features_only, spec.fold_norm_affine)
    if is_swinv2(name):
        return create_timm_v2(name, arch, features_only)
    return create_timm(name, arch, fused=spec.attention != "math", features_only=features_only)


def features_loss(maps: list[torch.Tensor]) -> torch.Tensor:
    """A dense head's stand-in for backbone rows: every map's mean square, so each map gets a gradient."""
    return sum(m.float().square().mean() for m in maps)


@contextlib.contextmanager
def sdpa_backends(spec: RowSpec) -> Iterator[None]:
    """`sdpa_no_cudnn` rows: PyTorch's cuDNN attention off, so SDPA takes its memory-efficient kernel. On Hopper
    SDPA picks cuDNN for timm's masked Swin attention, slower there than the memory-efficient kernel in training;
    the fastest timm setting is the fair peer. The flag is read when SDPA is traced or
    called, so it stays off for the whole row."""
    if spec.attention != "sdpa_no_cudnn":
        yield
        return
    before = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


# ---------------------------------------------------------------------------------------------
# measurement

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def measure(step: Callable[[], object], batch: int, device: torch.device, warmup: int, timed: int,
            repeats: int) -> dict[str, Any]:
    """Warm up (first step timed separately: it includes compilation), then median images/s over repeats.

    Peak memory (``peak_gib``) counts from the second step on: CUDA-graph rows (compile_mode=reduce-overhead)
    allocate their memory pool while recording during warm-up and reuse it afterwards, so a peak taken over the
    timed steps alone would miss it. The first step's own peak (``first_step_peak_gib``) is apart: it includes
    what compiling allocates, once per run. ``timed_gc``: Python's garbage collections during the timed steps (count
    and ms, per generation), which a host-bound step waits for.
    """
    _sync(device)
    _reset_peak(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    first_s = time.perf_counter() - t0
    first_peak = _peak_gib(device)
    _reset_peak(device)
    for _ in range(max(warmup - 1, 0)):
        step()
    _sync(device)
    with GcTimes() as collections:
        rates = [_images_per_s(step, batch, device, timed) for _ in range(repeats)]
    return dict(_rates_result(rates, batch), first_step_s=first_s, peak_gib=_peak_gib(device),
                first_step_peak_gib=first_peak, timed_gc=collections.summary())


class GcTimes:
    """Python's garbage collections while the block runs: how many of each generation, and how long they took."""

    def __enter__(self) -> GcTimes:
        self.durations: list[tuple[int, float]] = []
        self._start = 0.0
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.durations.append((info["generation"], time.perf_counter() - self._start))

    def summary(self) -> dict[str, dict[str, float]]:
        """{"gen2": {"count": 3, "ms": 41.2}, ...} for the generations that collected."""
        out: dict[str, dict[str, float]] = {}
        for generation, seconds in self.durations:
            entry = out.setdefault(f"gen{generation}", {"count": 0, "ms": 0.0})
            entry["count"] += 1
            entry["ms"] += 1e3 * seconds
        return out


def _images_per_s(step: Callable[[], object], batch: int, device: torch.device, timed: int) -> float:
    """One repeat: images/s over ``timed`` steps, the device synchronised at the end."""
    t0 = time.perf_counter()
    for _ in range(timed):
        step()
    _sync(device)
    return timed * batch / (time.perf_counter() - t0)


def _rates_result(rates: list[float], batch: int) -> dict[str, Any]:
    img_s = statistics.median(rates)
    return dict(img_s=img_s, step_ms=1e3 * batch / img_s, repeats_img_s=rates)


HOST_SLEEP_CYCLES = 200_000_000  # a GPU sleep longer than two eager forwards' enqueueing (about 0.1 s)
HOST_PHASES = ("forward", "loss", "backward", "optimizer", "zero_grad")
PHASE_SLEEP_CYCLES = 4 * HOST_SLEEP_CYCLES  # longer than a training step's enqueueing, an eager one's too


def host_phases(train: Callable[..., None], device: torch.device, reps: int = 10) -> dict[str, Any]:
    """Host CPU time (ms) per phase of a training step (HOST_PHASES, and their total), medians over ``reps``.
    On CUDA each measured step is queued alone behind a GPU sleep, so that no phase waits for the GPU: where the
    total exceeds the step's GPU busy time, the step is host-bound, and the phases say where the host's time goes
    (CUDA graphs replay the compiled forward and backward with Python around each). One step only, because a
    launch that finds CUDA's launch queue full waits there for the GPU. ``host_phases_queue_full``: the total came
    within half of the sleep's length, so a launch waited and the phases are not the host's own time. On the CPU
    the phases are the step's work itself, summed over the threads that compute it. train: RowSteps.train."""
    samples: dict[str, list[float]] = {phase: [] for phase in HOST_PHASES}
    sleep_ms = _sleep_ms(PHASE_SLEEP_CYCLES) if device.type == "cuda" else None
    for _ in range(reps):
        _sync(device)
        if device.type == "cuda":
            torch.cuda._sleep(PHASE_SLEEP_CYCLES)
        marks: list[int] = []
        train(marks)
        for phase, start, end in zip(HOST_PHASES, marks[:-1], marks[1:], strict=True):
            samples[phase].append((end - start) / 1e6)
    _sync(device)
    medians = {phase: statistics.median(values) for phase, values in samples.items()}
    total = sum(medians.values())
    return {"host_phases_ms": {**medians, "total": total},
            "host_phases_queue_full": sleep_ms is not None and total > sleep_ms / 2}


def _sleep_ms(cycles: int) -> float:
    """GPU time (ms) of ``torch.cuda._sleep(cycles)``, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def host_times(model: nn.Module, forward: Callable[[], object], images: torch.Tensor,
               reps: int = 20) -> dict[str, float]:
    """Eager host cost (CUDA): CPU ms to enqueue forward() (a whole model forward), and µs to enqueue the first
    stage's shifted block (``layers[0].blocks[1]``, ours and timm's alike) on its input from ``images``, with the
    GPU kept busy, medians. Why: an eager step whose host time exceeds its GPU time runs at the host's pace, and
    the block figure compares the two models' Python block for block."""
    with torch.no_grad():
        tokens = model.layers[0].blocks[0](model.patch_embed(images))
        block = model.layers[0].blocks[1]
        block_us = host_us(lambda: block(tokens), reps=reps, sleep_cycles=HOST_SLEEP_CYCLES)
    return dict(host_ms=host_us(forward, reps=reps, sleep_cycles=HOST_SLEEP_CYCLES) / 1e3, host_block_us=block_us)


ATTN_KERNEL_RE = re.compile(r"window_attn_|bias_tiles|bias_grad|fmha|flash_fwd|flash_bwd|pytorch_flash|sdpa"
                            r"|attention|softmax", re.IGNORECASE)
NOT_ATTN_KERNEL_RE = re.compile(r"log_?softmax", re.IGNORECASE)
ATTN_OP_RE = re.compile(r"^swin::flash_window|^aten::(bmm|_softmax|_softmax_backward_data)$"
                        r"|^aten::\w*(scaled_dot_product|_attention)\w*$")


def _ancestors(event: Any) -> Iterator[Any]:
    while event is not None:
        yield event
        event = getattr(event, "cpu_parent", None)


def _is_attention_kernel(name: str) -> bool:
    return bool(ATTN_KERNEL_RE.search(name)) and not NOT_ATTN_KERNEL_RE.search(name)


def attention_time_us(prof: torch.profiler.profile, device: torch.device) -> dict[str, float]:
    """Attention time and total time in us over the profiled steps (rule: see the module docstring).

    CUDA: total = all device activity (kernels, memcpy, memset); attention = kernels whose name marks them as
    attention, plus kernels launched by an attention op (or from inside one). CPU: ops' self CPU time.
    """
    from torch.autograd import DeviceType

    events = prof.events()
    attn = total = linked = 0.0
    if device.type == "cuda":
        for e in device_kernels(events):
            duration = _duration_us(e)
            total += duration
            if _is_attention_kernel(e.name):
                attn += duration
        for e in events:  # kernels that do not look like attention but were launched by attention ops
            if e.device_type != DeviceType.CPU or not e.kernels:
                continue
            op_is_attn = any(ATTN_OP_RE.search(a.name) for a in _ancestors(e))
            for k in e.kernels:
                linked += k.duration
                if op_is_attn and not _is_attention_kernel(k.name):
                    attn += k.duration
    else:
        for e in events:
            if e.device_type != DeviceType.CPU or e.is_async:
                continue
            total += e.self_cpu_time_total
            if any(ATTN_OP_RE.search(a.name) for a in _ancestors(e)):
                attn += e.self_cpu_time_total
        linked = total
    return dict(attention_us=attn, total_us=total, linked_us=linked)


# GPU time breakdown: kernel categories (classify_kernel), checked in this order
CATEGORIES = ("attention", "GEMM", "norm/elementwise", "copies/layout", "combined", "optimizer", "other")
OPTIMIZER_KERNEL_RE = re.compile(r"multi_tensor_apply|fused_?adam|adamw|_foreach_|unscale|amp_update_scale|lerp",
                                 re.IGNORECASE)
GEMM_KERNEL_RE = re.compile(r"gemm|nvjet|cublas|cutlass|splitkreduce|^triton_tem_", re.IGNORECASE)
# inductor names a fused kernel after the aten ops it contains: triton_<poi|per|red|...>_fused_<ops>_<n>
INDUCTOR_KERNEL_RE = re.compile(r"^triton_[a-z]+_fused(?P<ops>\w*?)(?:_\d+)?$")
# words of the aten ops that only move data (_unsafe_view, _to_copy, constant_pad_nd, split_with_sizes, ...)
DATA_MOVEMENT_TOKENS = frozenset(
    "view unsafe clone copy to permute transpose t unbind cat stack split with sizes squeeze unsqueeze expand "
    "reshape contiguous slice select scatter backward roll index gather constant pad nd flip narrow as strided "
    "alias repeat zeros fill full empty new convert element type detach lift fresh".split())
COPY_KERNEL_RE = re.compile(r"copy|memcpy|memset|FillFunctor|roll_cuda|index_elementwise|transpose|permute"
                            r"|nchwToNhwc|nhwcToNchw", re.IGNORECASE)
ELEMENTWISE_KERNEL_RE = re.compile(r"elementwise|reduce_kernel|norm|gelu|softmax|nll_loss|GammaBeta|RowwiseMoments"
                                   r"|ComputeInternalGradients|dropout", re.IGNORECASE)


def _inductor_op_tokens(name: str) -> list[str] | None:
    """Words of the op names in an inductor kernel name (None: not an inductor fused kernel)."""
    match = INDUCTOR_KERNEL_RE.match(name)
    if match is None:
        return None
    return [t for t in match["ops"].split("_") if t and not t.isdigit()]


def classify_kernel(name: str) -> str:
    """Category of a GPU kernel (or memcpy / memset) by its name; one of CATEGORIES.

    Checked in order: optimizer (fused AdamW, foreach, AMP unscale), attention (as for the attention
    fraction: ours, SDPA, softmax but not log-softmax), GEMM (cuBLAS / cutlass / inductor templates),
    inductor fused kernels (copies/layout if every op word in the name only moves data: view, clone, cat,
    permute, _to_copy, ...; combined if the name has no op words: inductor's combo kernels, several independent
    kernels in one launch, whose names list no ops, and the few copies inductor adds itself; else
    norm/elementwise), eager copies (copy kernels, memcpy, memset, fills), eager elementwise and reductions,
    other.
    """
    if OPTIMIZER_KERNEL_RE.search(name):
        return "optimizer"
    if _is_attention_kernel(name):
        return "attention"
    if GEMM_KERNEL_RE.search(name):
        return "GEMM"
    tokens = _inductor_op_tokens(name)
    if tokens is not None:
        if not tokens:
            return "combined"
        return "copies/layout" if set(tokens) <= DATA_MOVEMENT_TOKENS else "norm/elementwise"
    if COPY_KERNEL_RE.search(name):
        return "copies/layout"
    if ELEMENTWISE_KERNEL_RE.search(name):
        return "norm/elementwise"
    return "other"


def device_kernels(events: Iterable[Any]) -> list[Any]:
    """The GPU-side activities of profiler events (kernels, memcpy, memset), without user annotations."""
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]


def _duration_us(event: Any) -> float:
    """A device event's GPU time (torch's self_device_time_total of a kernel event is the same)."""
    return event.time_range.end - event.time_range.start


def busy_union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: time with at least one kernel running."""
    total = 0.0
    end = float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def category_times_us(kernels: Iterable[Any]) -> dict[str, float]:
    """GPU self time per category (every category, zeros included)."""
    times = dict.fromkeys(CATEGORIES, 0.0)
    for k in kernels:
        times[classify_kernel(k.name)] += _duration_us(k)
    return times


def kernel_breakdown(kernels: list[Any], steps: int) -> dict[str, Any]:
    """Per step: kernel time by category (ms) and the GPU busy time (union of kernel intervals, ms)."""
    per_step = {c: t / steps / 1e3 for c, t in category_times_us(kernels).items()}
    union = busy_union_us((k.time_range.start, k.time_range.end) for k in kernels)
    return dict(breakdown_ms=per_step, busy_union_ms_per_step=union / steps / 1e3)


def kernel_launchers(events: Iterable[Any]) -> dict[str, collections.Counter[str]]:
    """Per kernel name, where the host launched it: "op" or "op < outermost op" (the op's root ancestor) -> calls.

    A kernel belongs to the innermost op whose launch the profiler links it to: the eager op that launched it, or
    for a CUDA-graph replay the op that launched the graph, where the profiler links those; else it is absent."""
    from torch.autograd import DeviceType

    launchers: dict[str, collections.Counter[str]] = {}
    for e in events:
        if e.device_type != DeviceType.CPU or not e.kernels:
            continue
        *_, root = _ancestors(e)
        where = e.name if root is e else f"{e.name} < {root.name}"
        for k in e.kernels:
            launchers.setdefault(k.name, collections.Counter())[where] += 1
    return launchers


def _launched_by(counter: collections.Counter[str] | None) -> str:
    """The commonest launcher of a kernel, with the share of its launches ("-": none linked)."""
    if not counter:
        return "-"
    where, calls = counter.most_common(1)[0]
    where = where if len(where) <= 70 else where[:69] + "…"
    total = sum(counter.values())
    return f"`{where.replace('|', '/')}`" + (f" ({100 * calls // total}%)" if calls < total else "")


def top_kernels_table(kernels: list[Any], steps: int, limit: int,
                      launchers: dict[str, collections.Counter[str]] | None = None) -> str:
    """Markdown table of the `limit` kernels (grouped by name) with the most GPU self time, with categories and, where
    `launchers` (kernel_launchers) is given, the host op that launched each."""
    grouped: dict[str, list[float]] = {}
    for k in kernels:
        entry = grouped.setdefault(k.name, [0, 0.0])
        entry[0] += 1
        entry[1] += _duration_us(k)
    total = sum(us for _, us in grouped.values()) or 1.0
    head = "| kernel | category | calls/step | ms/step | % of kernel time |" + (
        " launched by |" if launchers is not None else "")
    lines = [head, "|---" * head.count(" |") + "|"]
    for name, (calls, us) in sorted(grouped.items(), key=lambda kv: -kv[1][1])[:limit]:
        short = name if len(name) <= 100 else name[:99] + "…"
        lines.append(f"| `{short.replace('|', '/')}` | {classify_kernel(name)} | {calls / steps:g} | "
                     f"{us / steps / 1e3:.3f} | {100 * us / total:.1f} |"
                     + (f" {_launched_by(launchers.get(name))} |" if launchers is not None else ""))
    return "\n".join(lines) + "\n"


def write_top_kernels(report: Path, prof: torch.profiler.profile, kernels: list[Any], device: torch.device,
                      steps: int, limit: int, title: str) -> None:
    """Append the top kernels with their categories (CUDA) and torch's op table to the profile report."""
    sort_by = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    with report.open("a") as f:
        if device.type == "cuda":
            f.write(f"\n## {title}: top {limit} GPU kernels by self time, per step ({steps} steps)\n\n")
            f.write(top_kernels_table(kernels, steps, limit, kernel_launchers(prof.events())))
        f.write(f"\n## {title}: top {limit} by self time over {steps} steps\n\n")
        f.write(prof.key_averages().table(sort_by=sort_by, row_limit=limit, max_name_column_width=70))


def profile_attention(step: Callable[[], object], steps: int, device: torch.device,
                      trace: Path | None, top_kernels: int = 0, report: Path | None = None,
                      title: str = "") -> dict[str, Any]:
    """Profile `steps` steps: attention time per step and its fraction of the (profiled) step time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    _sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    kernels = device_kernels(prof.events()) if device.type == "cuda" else []
    if top_kernels and report is not None:
        write_top_kernels(report, prof, kernels, device, steps, top_kernels, title)
    t = attention_time_us(prof, device)
    attn_ms = t["attention_us"] / steps / 1e3
    busy_ms = t["total_us"] / steps / 1e3
    # on the CPU there are no kernels: no breakdown (None), see the module docstring
    breakdown = kernel_breakdown(kernels, steps) if device.type == "cuda" else dict(
        breakdown_ms=None, busy_union_ms_per_step=None)
    return dict(attention_ms_per_step=attn_ms, busy_ms_per_step=busy_ms, profiled_step_ms=wall_ms,
                attention_frac_of_step=attn_ms / wall_ms,
                attention_frac_of_busy=attn_ms / busy_ms if busy_ms else None,
                linked_frac=t["linked_us"] / t["total_us"] if t["total_us"] else None, **breakdown)


def saved_tensor_report(step: Callable[[], object], title: str, top: int = 25) -> str:
    """Memory kept for backward by one training step, grouped by (dtype, shape): what training memory holds.

    Counted through saved_tensors_hooks, so compiled graphs are covered (their saved activations pass
    through ctx.save_for_backward). Counted per storage: views of one buffer (q, k and v of one qkv
    tensor) count once, with the shape of the first view seen; parameters are included.
    """
    storages: dict[int, tuple[str, tuple[int, ...], int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            storage = t.untyped_storage()
            storages.setdefault(storage.data_ptr(), (str(t.dtype).removeprefix("torch."), tuple(t.shape),
                                                     storage.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    groups: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for dtype, shape, nbytes in storages.values():
        entry = groups.setdefault((dtype, shape), [0, 0])
        entry[0] += 1
        entry[1] += nbytes
    total = sum(v[1] for v in groups.values())
    lines = [f"\n## {title}: memory saved for backward, {total / 2**30:.2f} GiB in {len(storages)} buffers\n",
             "| dtype | shape (first view) | buffers | MiB | % |", "|---|---|---|---|---|"]
    for (dtype, shape), (count, nbytes) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| {dtype} | {shape} | {count} | {nbytes / 2**20:,.1f} | {100 * nbytes / total:.1f} |")
    return "\n".join(lines) + "\n"


def _free(device: torch.device) -> None:
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class RowSteps:
    """A row's model and its two steps (run_row measures them; interleave_rows times several rows' in turn)."""

    model: nn.Module
    infer: Callable[[], object]
    train: Callable[..., None]  # train(marks=None): see host_phases
    fwd_bwd: Callable[[], None]  # train(update=False): forward, loss, backward, zero_grad
    amp: Callable[[], contextlib.AbstractContextManager]
    images: torch.Tensor
    info: dict[str, Any]
    last_loss: list[torch.Tensor]


def build_row(spec: RowSpec, name: str, arch: dict[str, Any], cfg: DictConfig, device: torch.device,
              data: tuple[torch.Tensor, torch.Tensor]) -> RowSteps:
    """The row's model (compiled where the row says) with its inference and training steps."""
    torch.manual_seed(cfg.seed)
    row: dict[str, Any] = asdict(spec)
    model = create_model(spec, name, arch, cfg.features_only).to(device)
    if spec.precision in FP8_LAYERS:
        if problem := fp8_problem(device):
            raise RuntimeError(problem)
        row["fp8_layers"] = len(fp8_linears(model, FP8_LAYERS[spec.precision]))
    if spec.impl == "timm":
        row["timm_fused_attn"] = any(getattr(m, "fused_attn", False) for m in model.modules())
    else:
        row["our_attention"] = spec.attention  # checked by create_ours
        row["our_fused_mlp_act"] = all(b.fused_mlp_act for b in model.modules() if isinstance(b, SwinTransformerBlock))
    row["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    mode = spec.compile_mode or cfg.compile_mode
    # ours as eval.py (inference) and train.py (training) compile it (swin.compile_model: the mode plus our inductor
    # options), one compiled model for each; timm as its users do
    infer_run = train_run = model
    if spec.compile and spec.impl == "ours":
        inductor = dict(spec.inductor)
        row["inductor_options"] = inductor_options(mode, False, inductor, device.type)  # the training step's
        row["infer_inductor_options"] = inductor_options(mode, False, inductor, device.type, training=False)
        row["train_memory_budget"] = spec.memory_budget
        infer_run = swin.compile_model(model, mode, dynamic=False, overrides=inductor)
        train_run = swin.compile_model(model, mode, dynamic=False, overrides=inductor, memory_budget=spec.memory_budget)
    elif spec.compile:
        infer_run = train_run = torch.compile(model, mode=mode, dynamic=False)
    x_all, y_all = data
    x, y = x_all[:spec.batch_size], y_all[:spec.batch_size]
    dtype = PRECISIONS[spec.precision]

    def amp() -> contextlib.AbstractContextManager:
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype)

    def infer_step() -> torch.Tensor:
        with torch.no_grad(), amp():
            return infer_run(x)

    fused = device.type == "cuda" if cfg.optimizer.fused == "auto" else bool(cfg.optimizer.fused)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay,
                            fused=fused)
    scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
    last_loss: list[torch.Tensor] = []

    def train_step(marks: list[int] | None = None, update: bool = True) -> None:
        """One step; marks: where given, the process CPU time (ns) is appended before and after each of
        HOST_PHASES. update=False: no optimizer step (forward, loss, backward, zero_grad: the fwd_bwd step)."""
        def mark() -> None:
            if marks is not None:
                marks.append(time.process_time_ns())

        mark()
        with amp():
            out = train_run(x)
            mark()
            loss = features_loss(out) if cfg.features_only else F.cross_entropy(out, y)
        mark()
        (loss if scaler is None else scaler.scale(loss)).backward()
        mark()
        if update and scaler is not None:
            scaler.step(opt)
            scaler.update()
        elif update:
            opt.step()
        mark()
        opt.zero_grad(set_to_none=True)
        last_loss[:] = [loss.detach()]
        mark()

    return RowSteps(model, infer_step, train_step, functools.partial(train_step, update=False), amp, x, row,
                    last_loss)


def run_row(spec: RowSpec, name: str, arch: dict[str, Any], cfg: DictConfig, device: torch.device,
            data: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    """Inference then training measurements of one row, then the training step's forward and backward alone where
    ``steps.fwd_bwd`` asks for them (row_modes), with the host's own times where asked (host_phases; eager rows'
    host_times); no profiler runs here (profile_row does, after every row's timing). The caller frees memory
    afterwards."""
    built = build_row(spec, name, arch, cfg, device, data)
    model, row = built.model, built.info
    steps = cfg.steps
    for mode in row_modes(cfg):
        step = getattr(built, mode)
        model.train(mode != "infer")
        if mode == "train" and spec.compile:
            # the inference graphs (and their CUDA-graph pool) go first: the training peak is the step's own
            _free(device)
        result = measure(step, spec.batch_size, device, steps.warmup, steps.timed, steps.repeats)
        if mode == "fwd_bwd":  # the training step's graphs again: its img/s, nothing more (its peak would miss the
            # CUDA-graph pool that the training step recorded)
            row.update({f"fwd_bwd_{k}": result[k] for k in ("img_s", "step_ms", "repeats_img_s")})
            continue
        if mode == "train" and cfg.profile.get("host_phases", False):
            result.update(host_phases(built.train, device))
        if mode == "infer" and not spec.compile and not cfg.features_only and device.type == "cuda":
            with built.amp():
                result.update(host_times(model, built.infer, built.images))
        row.update({f"{mode}_{k}": v for k, v in result.items()})
    row["train_loss"] = built.last_loss[0].float().item()
    return row


def profile_row(spec: RowSpec, name: str, arch: dict[str, Any], cfg: DictConfig, device: torch.device,
                data: tuple[torch.Tensor, torch.Tensor], out_dir: Path) -> dict[str, Any]:
    """The row built again (compiled rows mostly from inductor's caches), its inference and training steps warmed
    up and profiled (profile_attention; saved_tensor_report where ``profile.saved_tensors``): the ``{mode}_*``
    profile keys. main calls it after every row is timed, because a host-bound row has timed slower in a process
    where the profiler had run (docs/performance.md). The caller frees memory afterwards."""
    built = build_row(spec, name, arch, cfg, device, data)
    profile = cfg.profile
    trace_dir = out_dir / "traces" if profile.trace else None
    slug = re.sub(r"[^\w]+", "_", spec.label)
    found: dict[str, Any] = {}
    for mode in ("infer", "train"):
        step = getattr(built, mode)
        built.model.train(mode != "infer")
        if mode == "train" and spec.compile:
            _free(device)  # as run_row: the inference graphs go first
        for _ in range(max(cfg.steps.warmup, 3)):  # compiles, records CUDA graphs (by the third call): not profiled
            step()
        trace = trace_dir / f"{slug}_{mode}.json" if trace_dir else None
        result = profile_attention(step, profile.steps, device, trace, profile.get("top_kernels", 0),
                                   out_dir / "profile.md", f"{spec.label} {mode}")
        if mode == "train" and profile.get("saved_tensors", False):
            with (out_dir / "profile.md").open("a") as f:
                f.write(saved_tensor_report(step, spec.label))
        found.update({f"{mode}_{k}": v for k, v in result.items()})
    return found


def row_modes(cfg: DictConfig) -> tuple[str, ...]:
    """The steps each row times, in order (RowSteps' attribute names): the training step's forward and backward
    alone (fwd_bwd) where ``steps.fwd_bwd`` asks for it, after the training step, whose graphs it reuses."""
    return ("infer", "train", "fwd_bwd") if cfg.steps.get("fwd_bwd", False) else ("infer", "train")


def interleave_rows(specs: list[RowSpec], rows: list[dict[str, Any]], name: str, arch: dict[str, Any],
                    cfg: DictConfig, device: torch.device, data: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Times the rows of each batch size and precision again, in turn: every repeat runs each row's ``timed``
    steps, the rows in an order rotated by one per repeat, and a row's img/s becomes the median of its repeats (the
    one-row-after-another figure stays as ``*_img_s_sequential``). Why: a step bound by the host (eager, or the
    default compile mode) runs at the host's pace, and a host whose speed drifts over minutes favours whichever row
    ran in its faster minutes; in turn, every row meets the same drift. The rows are built again, all at once
    (compiled rows compile again, mostly from inductor's caches), with dynamo's recompile limit raised for them:
    their models share one forward. Peak memory and the host tables keep the rows' own runs."""
    groups: dict[tuple[int, str], list[tuple[RowSpec, dict[str, Any]]]] = {}
    for spec, row in zip(specs, rows, strict=True):  # main writes one row per spec, in order
        if "error" not in row and "skipped" not in row:
            groups.setdefault((spec.batch_size, spec.precision), []).append((spec, row))
    for (batch, _), group in groups.items():
        if len(group) < 2:
            continue
        # every row compiles its own versions of the one forward (inference and training, each maybe in parts)
        limit = max(16 * len(group), torch._dynamo.config.recompile_limit)
        with torch._dynamo.config.patch(recompile_limit=limit):
            built = [build_row(spec, name, arch, cfg, device, data) for spec, _ in group]
            for mode in row_modes(cfg):
                rates = _rates_in_turn([spec for spec, _ in group], built, mode, batch, cfg.steps, device)
                for (_, row), row_rates in zip(group, rates):
                    row[f"{mode}_img_s_sequential"] = row[f"{mode}_img_s"]
                    row.update({f"{mode}_{k}": v for k, v in _rates_result(row_rates, batch).items()})
        del built
        _free(device)


def _rates_in_turn(specs: list[RowSpec], built: list[RowSteps], mode: str, batch: int, steps: DictConfig,
                   device: torch.device) -> list[list[float]]:
    """Each row's ``mode`` step ("infer", "train" or "fwd_bwd") warmed up, then img/s per repeat, the rows in turn."""
    for spec, b in zip(specs, built):
        b.model.train(mode != "infer")
        with sdpa_backends(spec):
            for _ in range(steps.warmup):
                getattr(b, mode)()
    _sync(device)
    rates: list[list[float]] = [[] for _ in built]
    for repeat in range(steps.repeats):
        for k in range(len(built)):
            i = (k + repeat) % len(built)
            with sdpa_backends(specs[i]):
                rates[i].append(_images_per_s(getattr(built[i], mode), batch, device, steps.timed))
    return rates


def budget_spent(cfg: DictConfig, started: float) -> bool:
    """Whether ``time_budget_s`` (0: none) has passed since ``started`` (perf_counter): no new row starts then."""
    return bool(cfg.time_budget_s) and time.perf_counter() - started > cfg.time_budget_s


def error_line(e: Exception) -> str:
    """The exception's type and the first line of its message, at most 200 characters: a row's error."""
    message = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {message}"[:200]


def profile_rows(specs: list[RowSpec], rows: list[dict[str, Any]], name: str, arch: dict[str, Any],
                 cfg: DictConfig, device: torch.device, data: tuple[torch.Tensor, torch.Tensor], out_dir: Path,
                 started: float, save: Callable[[], None]) -> None:
    """profile_row for every timed row, in order, adding its profile keys to the row (``profile_error`` where
    profiling failed), then ``save()`` so that a run stopped while profiling keeps what it had. Rows not started
    within the time budget (``time_budget_s`` from ``started``, timing included) stay unprofiled."""
    for i, (spec, row) in enumerate(zip(specs, rows, strict=True)):
        if "error" in row or "skipped" in row:
            continue
        if budget_spent(cfg, started):
            print(f"[{i + 1}/{len(specs)}] {spec.label}: not profiled (time budget)", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            with sdpa_backends(spec):
                row.update(profile_row(spec, name, arch, cfg, device, data, out_dir))
            print(f"[{i + 1}/{len(specs)}] {spec.label}: profiled ({time.perf_counter() - t0:.0f} s)", flush=True)
        except Exception as e:  # e.g. out of memory: the row keeps its timing
            row["profile_error"] = error_line(e)
            print(f"[{i + 1}/{len(specs)}] {spec.label}: profiling failed: {row['profile_error']}", flush=True)
        _free(device)
        save()


# ---------------------------------------------------------------------------------------------
# report

def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def add_comparisons(rows: list[dict[str, Any]]) -> None:
    """Speedups vs the best timm row and memory vs the fastest timm training row, per (batch, precision)."""
    ok = [r for r in rows if "error" not in r and "skipped" not in r]
    for r in ok:
        peers = [p for p in ok if p["impl"] == "timm" and p["batch_size"] == r["batch_size"]
                 and p["precision"] == r["precision"]]
        if not peers:
            continue
        best_infer = max(p["infer_img_s"] for p in peers)
        fastest_train = max(peers, key=lambda p: p["train_img_s"])
        r["infer_speedup_vs_best_timm"] = r["infer_img_s"] / best_infer
        r["train_speedup_vs_best_timm"] = r["train_img_s"] / fastest_train["train_img_s"]
        if r.get("train_peak_gib") and fastest_train.get("train_peak_gib"):
            r["train_mem_vs_fastest_timm"] = r["train_peak_gib"] / fastest_train["train_peak_gib"]
        if r.get("fwd_bwd_img_s") and all(p.get("fwd_bwd_img_s") for p in peers):
            r["fwd_bwd_speedup_vs_best_timm"] = r["fwd_bwd_img_s"] / max(p["fwd_bwd_img_s"] for p in peers)


def markdown_table(rows: list[dict[str, Any]], profiled: bool) -> str:
    cols = ["implementation", "attention", "compile", "batch", "precision", "infer img/s", "train img/s",
            "infer peak GiB", "train peak GiB", "infer x best timm", "train x best timm", "train mem / fastest timm"]
    fwd_bwd = any(r.get("fwd_bwd_img_s") for r in rows)
    if fwd_bwd:  # steps.fwd_bwd: the training step without its optimizer step
        cols += ["fwd+bwd img/s", "fwd+bwd x best timm"]
    if profiled:
        cols += ["attn % infer step", "attn % train step"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        compiled = "no"
        if r["compile"]:
            compiled = (r.get("compile_mode") or "yes") + inductor_label(r.get("inductor") or ())
        head = [_row_spec(r).impl_label, r["attention"], compiled, str(r["batch_size"]), r["precision"]]
        if "error" in r or "skipped" in r:
            lines.append("| " + " | ".join(head + [r.get("error") or r["skipped"]] + ["-"] * (len(cols) - 6)) + " |")
            continue
        cells = head + [
            f"{r['infer_img_s']:,.0f}" if r["infer_img_s"] >= 100 else f"{r['infer_img_s']:.3g}",
            f"{r['train_img_s']:,.0f}" if r["train_img_s"] >= 100 else f"{r['train_img_s']:.3g}",
            _fmt(r.get("infer_peak_gib"), ".2f"), _fmt(r.get("train_peak_gib"), ".2f"),
            _fmt(r.get("infer_speedup_vs_best_timm"), ".2f"), _fmt(r.get("train_speedup_vs_best_timm"), ".2f"),
            _fmt(r.get("train_mem_vs_fastest_timm"), ".2f")]
        if fwd_bwd:
            cells += [_fmt(r.get("fwd_bwd_img_s"), ",.0f"), _fmt(r.get("fwd_bwd_speedup_vs_best_timm"), ".2f")]
        if profiled:
            cells += [_fmt(100 * r["infer_attention_frac_of_step"] if r.get("infer_attention_frac_of_step")
                           is not None else None, ".1f"),
                      _fmt(100 * r["train_attention_frac_of_step"] if r.get("train_attention_frac_of_step")
                           is not None else None, ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _row_spec(r: dict[str, Any]) -> RowSpec:
    """The spec of a result row (a row of benchmark.json)."""
    return RowSpec(r["impl"], r["attention"], r["compile"], r["batch_size"], r["precision"],
                   r.get("compile_mode"), r.get("fused_mlp_act"), tuple(map(tuple, r.get("inductor") or ())),
                   r.get("memory_budget"), r.get("fold_norm_affine"))


def _row_label(r: dict[str, Any]) -> str:
    return _row_spec(r).label


def _largest_share(breakdown: dict[str, float]) -> str:
    total = sum(breakdown.values())
    if not total:
        return "-"
    category = max(breakdown, key=breakdown.get)
    return f"{category} {100 * breakdown[category] / total:.0f}%"


BREAKDOWN_COLS = ["row", "step", "step ms", "GPU busy ms", *CATEGORIES, "largest"]


def breakdown_table(rows: list[dict[str, Any]]) -> str:
    """GPU kernel time per step by category, one line per row and step (train, infer); ms per step.

    step ms: the timed (not profiled) wall time per step; GPU busy ms: union of the kernel intervals while
    profiling; largest: the biggest category and its share of all kernel time. '-': no kernels (CPU).
    """
    lines = ["| " + " | ".join(BREAKDOWN_COLS) + " |", "|" + "---|" * len(BREAKDOWN_COLS)]
    for r in rows:
        if "error" in r or "skipped" in r:
            continue
        for mode in ("train", "infer"):
            breakdown = r.get(f"{mode}_breakdown_ms")
            cells = [_row_label(r), mode, _fmt(r.get(f"{mode}_step_ms"), ".2f"),
                     _fmt(r.get(f"{mode}_busy_union_ms_per_step"), ".2f")]
            if breakdown is None:
                cells += ["-"] * (len(CATEGORIES) + 1)
            else:
                # .get: files of earlier runs lack the newer categories ("-")
                cells += [_fmt(breakdown.get(c), ".2f") for c in CATEGORIES] + [_largest_share(breakdown)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def host_table(rows: list[dict[str, Any]]) -> str:
    """Eager rows' host cost (host_times) next to their inference step time; '' where no row has it."""
    timed = [r for r in rows if r.get("infer_host_ms") is not None]
    if not timed:
        return ""
    lines = ["| row | infer step ms | host ms per forward | host µs per shifted block |", "|---|---|---|---|"]
    for r in timed:
        lines.append(f"| {_row_label(r)} | {r['infer_step_ms']:.2f} | {r['infer_host_ms']:.2f} | "
                     f"{_fmt(r.get('infer_host_block_us'), '.0f')} |")
    return "\n".join(lines)


def phases_table(rows: list[dict[str, Any]]) -> str:
    """Rows' host time per training step phase (host_phases) beside their step and GPU busy time; '' where no row
    has it."""
    timed = [r for r in rows if r.get("train_host_phases_ms")]
    if not timed:
        return ""
    head = ["row", "train step ms", "GPU busy ms", *HOST_PHASES, "host total"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in timed:
        phases = r["train_host_phases_ms"]
        cells = [_row_label(r), _fmt(r.get("train_step_ms"), ".2f"), _fmt(r.get("train_busy_union_ms_per_step"), ".2f"),
                 *(f"{phases[p]:.2f}" for p in (*HOST_PHASES, "total"))]
        if r.get("train_host_phases_queue_full"):
            cells[-1] += " (a launch waited: CUDA's queue was full)"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_tables(rows: list[dict[str, Any]], profiled: bool) -> str:
    """The comparison table; with profiling the GPU time breakdown under it; with eager CUDA rows their host
    cost; with profile.host_phases the host time per training phase."""
    tables = [markdown_table(rows, profiled)]
    if profiled:
        tables.append(f"## GPU kernel time per step by category (ms)\n\n{breakdown_table(rows)}")
    if host := host_table(rows):
        tables.append("## Eager host time (CPU time to enqueue, the GPU kept busy)\n\n" + host)
    if phases := phases_table(rows):
        tables.append("## Host time per training step phase (ms; CPU time, the GPU kept busy)\n\n" + phases)
    return "\n\n".join(tables)


def save_chart(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r and "skipped" not in r]
    if not ok:
        return
    labels = [_row_label(r) for r in ok]
    colors = ["tab:orange" if r["impl"] == "ours" else "tab:blue" for r in ok]
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.45 * len(ok) + 1.6), sharey=True)
    for ax, key, name in zip(axes, ("infer_img_s", "train_img_s"), ("inference", "training step")):
        values = [r[key] for r in ok]
        bars = ax.barh(range(len(ok)), values, color=colors)
        ax.bar_label(bars, labels=[f"{v:,.0f}" if v >= 100 else f"{v:.3g}" for v in values], padding=3, fontsize=8)
        ax.set_title(f"{name} (images/s)")
        ax.set_xlim(0, max(values) * 1.2)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(ok)), labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(device: torch.device) -> dict[str, Any]:
    import triton
    env = dict(torch=torch.__version__, timm=timm.__version__, triton=triton.__version__,
               python=platform.python_version(), device=str(device),
               triton_interpret=os.environ.get("TRITON_INTERPRET", "0"),
               timm_fused_attn_env=os.environ.get("TIMM_FUSED_ATTN"))
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    else:
        env.update(cpu=platform.processor() or platform.machine(), threads=torch.get_num_threads())
    return env


def write_outputs(out_dir: Path, result: dict[str, Any], table: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "benchmark.json").write_text(json.dumps(result, indent=2, default=str))
    (out_dir / "benchmark.md").write_text(table + "\n")


@hydra.main(version_base="1.3", config_path="../configs", config_name="benchmark")
def main(cfg: DictConfig) -> dict[str, Any]:
    started = time.perf_counter()
    device = pick_device(cfg.device)
    if cfg.tf32:  # fp32 rows only; torch's default keeps full fp32 matmuls
        torch.set_float32_matmul_precision("high")
    out_dir = Path(cfg.out_dir) if cfg.out_dir else Path(HydraConfig.get().runtime.output_dir)
    name, arch = architecture(cfg.model)
    specs = expand_grid(cfg.grid, bool(cfg.model.get("fused_mlp_act", True)))
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(device)
    probe = swin.create_model(name, **arch)
    img_size, in_chans, num_classes = probe.img_size, probe.in_chans, probe.num_classes
    del probe
    title = (f"{name} {img_size[0]}x{img_size[1]} on {env.get('gpu', env.get('cpu'))}: torch {env['torch']}, "
             f"timm {env['timm']}, triton {env['triton']}")
    print(f"# {title}")
    print(f"{len(specs)} rows; warm-up {cfg.steps.warmup}, {cfg.steps.repeats} x {cfg.steps.timed} timed steps; "
          f"output: {out_dir}", flush=True)

    # the same synthetic data for every row: the largest batch, sliced per row
    g = torch.Generator().manual_seed(cfg.seed)
    max_batch = max(s.batch_size for s in specs)
    x = torch.randn(max_batch, in_chans, *img_size, generator=g).to(device)
    y = torch.randint(0, num_classes, (max_batch,), generator=g).to(device)

    rows: list[dict[str, Any]] = []
    result: dict[str, Any] = dict(model=name, img_size=list(img_size), env=env,
                                  config=OmegaConf.to_container(cfg, resolve=True), rows=rows)
    for i, spec in enumerate(specs):
        if budget_spent(cfg, started):
            rows.append({**asdict(spec), "skipped": f"time budget ({cfg.time_budget_s} s) spent"})
            print(f"[{i + 1}/{len(specs)}] {spec.label}: skipped (time budget)", flush=True)
            continue
        unavailable = timm_unavailable(spec, name)
        if unavailable:
            rows.append({**asdict(spec), "skipped": unavailable})
            print(f"[{i + 1}/{len(specs)}] {spec.label}: skipped ({unavailable})", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            with sdpa_backends(spec):
                row = run_row(spec, name, arch, cfg, device, (x, y))
        except Exception as e:  # OOM, unsupported backend on this device, ...: keep the other rows
            row = {**asdict(spec), "error": error_line(e)}
        _free(device)
        row["row_s"] = time.perf_counter() - t0
        rows.append(row)
        if "error" in row:
            print(f"[{i + 1}/{len(specs)}] {spec.label}: ERROR {row['error']}", flush=True)
        else:
            print(f"[{i + 1}/{len(specs)}] {spec.label}: infer {row['infer_img_s']:,.1f} img/s, "
                  f"train {row['train_img_s']:,.1f} img/s, "
                  + (f"fwd+bwd {row['fwd_bwd_img_s']:,.1f} img/s, " if "fwd_bwd_img_s" in row else "")
                  + f"peak {_fmt(row['train_peak_gib'], '.2f')} GiB "
                  f"(first step {_fmt(row['train_first_step_peak_gib'], '.2f')}) "
                  f"({row['row_s']:.0f} s, first train step {row['train_first_step_s']:.1f} s)"
                  + "".join(f", {mode} {gen} collections {v['count']} ({v['ms']:.1f} ms)"
                            for mode in ("infer", "train") for gen, v in row.get(f"{mode}_timed_gc", {}).items()
                            if gen == "gen2"), flush=True)
        add_comparisons(rows)
        write_outputs(out_dir, result, report_tables(rows, cfg.profile.enabled))  # partial results survive

    if cfg.steps.interleave and not budget_spent(cfg, started):
        print("timing the rows again, in turn", flush=True)
        try:
            interleave_rows(specs, rows, name, arch, cfg, device, (x, y))
        except Exception as e:  # e.g. out of memory with several rows' models at once: the sequential figures stay
            print(f"timing in turn failed, keeping the rows' own figures: {type(e).__name__}: {e}"[:300], flush=True)
            _free(device)
    add_comparisons(rows)  # the figures timed in turn, which the saves while profiling write too
    if cfg.profile.enabled:
        profile_rows(specs, rows, name, arch, cfg, device, (x, y), out_dir, started,
                     lambda: write_outputs(out_dir, result, report_tables(rows, profiled=True)))
    table = report_tables(rows, cfg.profile.enabled)
    result["table"] = markdown_table(rows, cfg.profile.enabled)
    if cfg.profile.enabled:
        result["breakdown_table"] = breakdown_table(rows)
    result["total_s"] = time.perf_counter() - started
    write_outputs(out_dir, result, f"# {title}\n\n{table}")
    save_chart(rows, out_dir / "benchmark.png", title)
    print()
    print(table)
    print("\ntimm math: its default path (TIMM_FUSED_ATTN=0, explicit softmax); timm sdpa: TIMM_FUSED_ATTN=2. "
          "x best timm: vs the best timm row of the same batch and precision; train mem: vs the fastest timm "
          "training row.")
    if cfg.profile.enabled:
        print("attn %: attention GPU time per step / wall time per step, both while profiling. Breakdown: GPU "
              "kernel self time per step by kernel name (classify_kernel); GPU busy: union of kernel intervals "
              "(GPU busy well below step ms: host-bound); '-': no GPU kernels (CPU run).")
    print(f"wrote {out_dir / 'benchmark.json'}, benchmark.md, benchmark.png ({result['total_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
