"""Config schemas: Hydra structured configs giving every key of configs/ its type.

The YAML files keep the values and their documentation; these dataclasses only say what each key accepts
(every field is MISSING here, so a value lives in one place). train.yaml and eval.yaml start their defaults list
with their schema (``/schema/train@_here_``; benchmark.yaml and bench_data.yaml with theirs, which live beside
their scripts), and each configs/data/ file with its dataset's (``/schema/data/imagefolder@_here_``): Hydra then
merges every config file and command-line override into a typed node, so ``train.lr=abc`` stops at start with
Hydra's message naming the key and the type, and unknown keys stay rejected. Value ranges
(``train.batch_size=-4``) are checked by swin.train.checks.check_config before anything is built; the package's
internals then take the typed settings of :func:`to_settings`.

Importing this module registers the schemas in Hydra's ConfigStore; the entry points import it before
``@hydra.main`` composes (tests before ``compose``).
"""
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

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
    compile: Any = MISSING  # auto | true | false (OmegaConf has no str-or-bool type; check_config checks it)
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


                                       # default (on)


def to_settings(cfg: DictConfig | T) -> T:
    """A composed config as its schema's dataclass objects (TrainAppConfig, ImageFolderDataConfig, ...), every
    interpolation resolved: what the package's internals take. Already converted objects pass through."""
    if isinstance(cfg, DictConfig):
        try:
            return cast(T, OmegaConf.to_object(cfg))
        except MissingMandatoryValue as e:  # a ??? value: the config file says the key is required
            key = e.full_key or "a key"
            value = "/path/to/dataset" if key == "data.root" else "<value>"
            raise ConfigError(f"{key} is required and not set: add {key}={value} to the command line") from None
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
    for name, node in (("train", TrainAppConfig), ("eval", EvalAppConfig)):
        cs.store(group="schema", name=name, node=node)
    for name, node in (("digits", DigitsDataConfig), ("imagefolder", ImageFolderDataConfig),
                       ("synthetic", SyntheticDataConfig)):
        cs.store(group="schema/data", name=name, node=node)
    cs.store(group="schema/model", name="swinv2", node=SwinV2ModelConfig)


register_configs()
