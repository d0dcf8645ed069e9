"""Config schemas: Hydra structured configs giving every key of configs/ its type.

The YAML files keep the values and their documentation; these dataclasses only say what each key accepts
(every field is MISSING here, so a value lives in one place). train.yaml, eval.yaml, benchmark.yaml and
bench_data.yaml start their defaults list with their schema (``/schema/train@_here_``...), and each
configs/data/ file with its dataset's (``/schema/data/imagefolder@_here_``): Hydra then merges every config
file and command-line override into a typed node, so ``train.lr=abc`` stops at start with Hydra's message
naming the key and the type, and unknown keys stay rejected. Value ranges (``train.batch_size=-4``) are
checked by swin.train.loop.check_config before anything is built.

Importing this module registers the schemas in Hydra's ConfigStore; the entry points import it before
``@hydra.main`` composes (tests before ``compose``).
"""
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

T = TypeVar("T")
FOLDER_DATASETS = ("imagefolder", "imagenet")  # data= configs of ImageFolderDataConfig


class ConfigError(ValueError):
    """A configuration that cannot work; raised before any work starts, the message names the key and the fix."""


@dataclass
class ModelConfig:
    """configs/model/*.yaml: keys map onto swin.create_model overrides."""

    name: str = MISSING
    attention: str = MISSING
    fused_mlp_act: bool = MISSING
    fused_merge_norm: bool = MISSING
    pretrained: str | None = MISSING
    num_classes: int | None = MISSING
    # an int or [height, width], as create_model takes them (OmegaConf has no int-or-list type: check_config checks)
    img_size: Any = MISSING
    patch_size: Any = MISSING
    window_size: Any = MISSING
    embed_dim: int = MISSING
    depths: list[int] = MISSING
    num_heads: list[int] = MISSING
    drop_path_rate: float = MISSING


@dataclass
class SwinV2ModelConfig(ModelConfig):
    """configs/model/swinv2_*.yaml: also the windows the weights were pretrained with, one per stage (0: the
    stage's own window)."""

    pretrained_window_sizes: list[int] = MISSING


@dataclass
class DataConfig:
    """Keys every dataset has; each configs/data/ file extends one of the subclasses."""

    name: str = MISSING
    root: str | None = MISSING
    num_workers: int = MISSING
    train_limit: int | None = MISSING
    val_limit: int | None = MISSING


@dataclass
class DigitsDataConfig(DataConfig):
    val_fraction: float = MISSING
    split_seed: int = MISSING
    classes: list[int] | None = MISSING
    shift: int = MISSING


@dataclass
class ImageFolderDataConfig(DataConfig):
    """data=imagefolder and data=imagenet."""

    train_dir: str = MISSING
    val_dir: str = MISSING
    skip_corrupt: bool = MISSING
    decode: str = MISSING
    gpu_decode_thread: bool = MISSING
    gpu_ycbcr: bool = MISSING  # data.decode=gpu training: YCbCr planes from the JPEG engines, converted in the crops
    batch_ring: str = MISSING  # data.decode=gpu workers' batches: gpu (device memory over CUDA IPC) or host
    augment: str | None = MISSING  # null: where data.decode decodes
    mean: list[float] = MISSING
    std: list[float] = MISSING
    interpolation: str = MISSING
    crop_pct: float = MISSING
    scale: list[float] = MISSING
    ratio: list[float] = MISSING
    hflip: float = MISSING
    color_jitter: Any = MISSING  # one strength, or [brightness, contrast, saturation(, hue)] as timm takes it
    auto_augment: str | None = MISSING
    reprob: float = MISSING
    remode: str = MISSING
    recount: int = MISSING


@dataclass
class SyntheticDataConfig(DataConfig):
    num_classes: int = MISSING
    train_samples: int = MISSING
    val_samples: int = MISSING


@dataclass
class TrainConfig:
    """train: in configs/train.yaml."""

    epochs: int = MISSING
    batch_size: int = MISSING
    accum_steps: int = MISSING
    eval_batch_size: int | None = MISSING
    opt: str = MISSING
    lr: float = MISSING
    lr_base_size: int | None = MISSING
    min_lr: float = MISSING
    warmup_lr: float = MISSING
    warmup_epochs: int = MISSING
    warmup_prefix: bool = MISSING
    sched: str = MISSING
    weight_decay: float = MISSING
    layer_decay: float | None = MISSING
    opt_eps: float | None = MISSING
    opt_betas: list[float] | None = MISSING
    momentum: float = MISSING
    opt_fused: Any = MISSING  # auto | true | false (OmegaConf has no str-or-bool type; check_config checks it)
    clip_grad: float | None = MISSING
    clip_mode: str = MISSING
    label_smoothing: float = MISSING
    mixup: float = MISSING
    cutmix: float = MISSING
    mixup_prob: float = MISSING
    mixup_switch_prob: float = MISSING
    mixup_mode: str = MISSING
    amp: str = MISSING
    compile: bool = MISSING
    compile_mode: str = MISSING
    grad_checkpointing: bool = MISSING
    ema: bool = MISSING
    ema_decay: float = MISSING
    eval_every: int = MISSING
    save_every_epochs: int = MISSING
    save_every_steps: int = MISSING
    require_pretrained: bool = MISSING
    resume: str | None = MISSING
    auto_resume: bool = MISSING
    max_nonfinite: int = MISSING


@dataclass
class WandbConfig:
    mode: str = MISSING
    project: str = MISSING
    entity: str | None = MISSING
    name: str | None = MISSING
    tags: list[str] = MISSING


@dataclass
class LoggerConfig:
    progress: bool = MISSING
    log_every_steps: int = MISSING
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class TrainAppConfig:
    """configs/train.yaml (train.py)."""

    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    seed: int = MISSING
    device: str = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


@dataclass
class EvalAppConfig:
    """configs/eval.yaml (eval.py)."""

    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    checkpoint: str = MISSING
    ema: bool | None = MISSING
    from_checkpoint: bool = MISSING
    transforms: str = MISSING
    seed: int = MISSING
    device: str = MISSING
    batch_size: int = MISSING
    amp: str = MISSING
    progress: bool = MISSING
    output: str | None = MISSING


@dataclass
class GridRow:
    """One row of a configs/grid/ entry: expands over compile x grid.batch_size x grid.precision."""

    impl: str = MISSING
    attention: str = MISSING
    compile: list[bool] = field(default_factory=lambda: [False])
    compile_mode: str | None = None  # None: the benchmark's compile_mode
    fused_mlp_act: bool | None = None  # ours only: fc1 + GELU as one cuBLASLt GEMM in inference; None: the model's
                                       # default (on)


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
    optimizer: BenchOptimizerConfig = field(default_factory=BenchOptimizerConfig)
    profile: BenchProfileConfig = field(default_factory=BenchProfileConfig)


@dataclass
class GenerateConfig:
    dir: str = MISSING
    classes: int = MISSING
    train_per_class: int = MISSING
    val_per_class: int = MISSING
    quality: int = MISSING


@dataclass
class LoaderBenchConfig:
    enabled: bool = MISSING
    cpu_workers: list[Any] = MISSING  # worker counts: ints, all or all-1
    gpu_workers: Any = MISSING
    gpu_thread_workers: Any = MISSING  # data.gpu_decode_thread=true rows: file-reading workers
    gpu_augment_workers: Any = MISSING  # data.augment=gpu rows: workers decoding on the CPU
    warmup_batches: int = MISSING
    seconds: float = MISSING
    min_batches: int = MISSING  # timed batches at least, whatever `seconds` says


@dataclass
class TrainBenchConfig:
    rows: list[str] = MISSING
    cpu_workers: Any = MISSING
    gpu_workers: Any = MISSING
    gpu_augment_workers: Any = MISSING
    epochs: int = MISSING
    compile: bool = MISSING
    args: list[str] = MISSING
    timeout_s: float = MISSING


@dataclass
class EvalBenchConfig:
    enabled: bool = MISSING
    workers: Any = MISSING


@dataclass
class BenchDataAppConfig:
    """configs/bench_data.yaml (scripts/bench_data.py)."""

    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    device: str = MISSING
    root: str | None = MISSING
    out_dir: str | None = MISSING
    runs_dir: str | None = MISSING
    batch_size: int = MISSING
    seed: int = MISSING
    time_budget_s: float = MISSING
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    loader: LoaderBenchConfig = field(default_factory=LoaderBenchConfig)
    train: TrainBenchConfig = field(default_factory=TrainBenchConfig)
    eval: EvalBenchConfig = field(default_factory=EvalBenchConfig)


def to_settings(cfg: DictConfig | T) -> T:
    """A composed config as its schema's dataclass objects (TrainAppConfig, ImageFolderDataConfig, ...), every
    interpolation resolved: what the package's internals take. Already converted objects pass through."""
    if isinstance(cfg, DictConfig):
        return cast(T, OmegaConf.to_object(cfg))
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    """A config (dataclass objects or a DictConfig) as plain dicts and lists: what checkpoints and wandb keep."""
    return cast(dict, OmegaConf.to_container(OmegaConf.create(cfg), resolve=True))


def as_folder(data: DataConfig) -> ImageFolderDataConfig | None:
    """``data`` when it configures a folder dataset (data=imagefolder or imagenet), else None."""
    return cast(ImageFolderDataConfig, data) if data.name in FOLDER_DATASETS else None


def register_configs() -> None:
    """Put the schemas into Hydra's ConfigStore (group schema/, referenced by the YAML defaults lists)."""
    cs = ConfigStore.instance()
    for name, node in (("train", TrainAppConfig), ("eval", EvalAppConfig), ("benchmark", BenchmarkAppConfig),
                       ("bench_data", BenchDataAppConfig)):
        cs.store(group="schema", name=name, node=node)
    for name, node in (("digits", DigitsDataConfig), ("imagefolder", ImageFolderDataConfig),
                       ("synthetic", SyntheticDataConfig)):
        cs.store(group="schema/data", name=name, node=node)
    cs.store(group="schema/model", name="swinv2", node=SwinV2ModelConfig)


register_configs()
