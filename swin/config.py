"""Config schemas: Hydra structured configs giving every key of configs/ its type.

The YAML files keep the values; these dataclasses say what each key accepts and what it does (every field is
MISSING here, so a value lives in one place, and carries its one-line description, which ``--help`` prints:
swin.cli). train.yaml and eval.yaml start their defaults list
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


def key(description: str) -> Any:
    """A schema field: its value comes from the YAML files (MISSING here); ``description`` is its one line in
    ``--help`` (swin.cli)."""
    return field(default=MISSING, metadata={"help": description})


def section(node: type, description: str) -> Any:
    """A nested schema (train:, logger:, ...) with its line in ``--help``."""
    return field(default_factory=node, metadata={"help": description})


@dataclass
class ModelConfig:
    """configs/model/*.yaml: keys map onto swin.create_model overrides."""

    name: str = key("architecture (swin.create_model name); the model= option sets it with the keys below")
    attention: str = key("window attention backend: auto (flash_window on CUDA, sdpa on the CPU) | flash_window | "
                         "sdpa | standard")
    fused_mlp_act: bool = key("on CUDA in bf16/fp16: fc1 and GELU in one cuBLASLt GEMM (in compiled training, fc1 "
                              "is recomputed in the backward)")
    fused_merge_norm: bool = key("inference on CUDA: residual add, 2x2 patch merging and its norm in one kernel")
    pretrained: str | None = key("weights to start from: a file (timm, official Microsoft, train.py's) or "
                                 "timm:<name.tag>; the classifier is re-initialised if num_classes differs")
    num_classes: int | None = key("classifier outputs; null: the dataset's class count")
    # an int or [height, width], as create_model takes them (OmegaConf has no int-or-list type: check_config checks)
    img_size: Any = key("input resolution: an int or [height, width]")
    patch_size: Any = key("patch embedding stride: an int or [height, width]")
    window_size: Any = key("attention window: an int or [height, width]; pretrained bias tables are resized")
    embed_dim: int = key("channels of the first stage (doubled at each later stage)")
    depths: list[int] = key("blocks per stage")
    num_heads: list[int] = key("attention heads per stage")
    drop_path_rate: float = key("stochastic depth rate of the last block (linear from 0)")


@dataclass
class SwinV2ModelConfig(ModelConfig):
    """configs/model/swinv2_*.yaml."""

    pretrained_window_sizes: list[int] = key("Swin V2: the window each stage's weights were pretrained with "
                                             "(0: its own window)")


@dataclass
class DataConfig:
    """Keys every dataset has; each configs/data/ file extends one of the subclasses."""

    name: str = key("dataset kind; the data= option sets it with the keys below")
    root: str | None = key("dataset folder (folder datasets: required)")
    num_workers: int | None = key("loader worker processes per training process; null: this process's share of "
                                  "the host's cores less one (at most 8 decoding on the GPU, 32 on the CPU)")
    train_limit: int | None = key("use only the first N training images (smoke runs); null: all")
    val_limit: int | None = key("use only the first N validation images; null: all")


@dataclass
class DigitsDataConfig(DataConfig):
    """data=digits: scikit-learn's 8x8 handwritten digits, upscaled to model.img_size."""

    val_fraction: float = key("fraction of the images held out (stratified) for validation")
    split_seed: int = key("seed of the train/validation split")
    classes: list[int] | None = key("a subset of the digits, e.g. [0,1,2], relabelled 0..k-1; null: all ten")
    shift: int = key("training augmentation: random translation by up to this many pixels (0: none)")


@dataclass
class ImageFolderDataConfig(DataConfig):
    """data=imagefolder and data=imagenet: <root>/<train_dir>/<class>/*.jpg and <root>/<val_dir>/<class>/*.jpg."""

    train_dir: str = key("training split's folder under root")
    val_dir: str = key("validation split's folder under root")
    skip_corrupt: bool = key("true: drop unreadable images (counted in the log) instead of stopping")
    decode: str = key("where JPEGs are decoded: cpu (loader workers, PIL) | gpu (nvJPEG on the training device)")
    gpu_decode_thread: bool = key("decode=gpu: decode in a thread of the training process, not in the workers")
    gpu_ycbcr: bool = key("decode=gpu training: decode to YCbCr planes, converted to RGB in the crop kernels")
    batch_ring: str = key("decode=gpu workers hand batches over in host (page-locked) or gpu (CUDA IPC) memory")
    augment: str | None = key("where the training transforms run: cpu | gpu; null: where decode decodes")
    mean: list[float] = key("normalisation mean per channel")
    std: list[float] = key("normalisation standard deviation per channel")
    interpolation: str = key("resize interpolation: bicubic | bilinear | ...")
    crop_pct: float = key("evaluation: resize to img_size / crop_pct, then center-crop img_size")
    scale: list[float] = key("RandomResizedCrop area range")
    ratio: list[float] = key("RandomResizedCrop aspect-ratio range")
    hflip: float = key("horizontal flip probability")
    # one strength, or [brightness, contrast, saturation(, hue)] as timm takes it
    color_jitter: Any = key("colour jitter strength, or [brightness, contrast, saturation(, hue)]; off with "
                            "auto_augment")
    auto_augment: str | None = key("timm RandAugment/AutoAugment policy, e.g. rand-m9-mstd0.5-inc1; null: none")
    reprob: float = key("random erasing probability")
    remode: str = key("random erasing fill: pixel | rand | const")
    recount: int = key("random erasing: regions per image")


@dataclass
class SyntheticDataConfig(DataConfig):
    """data=synthetic: random images made on the training device (throughput and smoke runs)."""

    num_classes: int = key("label count (label = image index % num_classes)")
    train_samples: int = key("images per training epoch")
    val_samples: int = key("validation images")


@dataclass
class TrainConfig:
    """train: in configs/train.yaml."""

    epochs: int = key("training epochs")
    batch_size: int = key("global batch per optimizer update: processes x accum_steps x micro-batch")
    accum_steps: int = key("micro-batches per update (gradient accumulation); must divide the per-process batch")
    eval_batch_size: int | None = key("evaluation batch per process; null: twice the training micro-batch")
    opt: str = key("optimizer, any timm name: adamw | sgd | lamb | ...")
    lr: float = key("peak learning rate (of the classifier where layer_decay is set)")
    lr_base_size: int | None = key("if set, lr, min_lr and warmup_lr are for this global batch and scale "
                                   "linearly with batch_size")
    min_lr: float = key("learning rate at the end of the schedule")
    warmup_lr: float = key("learning rate at the start of warm-up")
    warmup_epochs: int = key("epochs of linear warm-up")
    warmup_prefix: bool = key("warm-up before the schedule (official Swin) rather than inside it")
    sched: str = key("learning-rate schedule, any timm name (cosine | step | ...), stepped every update")
    weight_decay: float = key("weight decay (not on norms, biases and position bias tables)")
    layer_decay: float | None = key("layer-wise lr decay: each block group from the head down gets this factor "
                                    "more, e.g. 0.75; null: off")
    opt_eps: float | None = key("optimizer epsilon; null: the optimizer's default")
    opt_betas: list[float] | None = key("Adam betas; null: the optimizer's default")
    momentum: float = key("momentum (sgd-type optimizers)")
    # auto | true | false (OmegaConf has no str-or-bool type; check_config checks it)
    opt_fused: Any = key("fused AdamW/Adam kernels: auto (on CUDA) | true | false")
    clip_grad: float | None = key("gradient clipping threshold; null: none")
    clip_mode: str = key("clipping: norm | value | agc")
    label_smoothing: float = key("label smoothing of the loss")
    mixup: float = key("mixup alpha (0: off)")
    cutmix: float = key("cutmix alpha (0: off)")
    mixup_prob: float = key("probability of mixing a batch when mixup or cutmix is on")
    mixup_switch_prob: float = key("probability of cutmix rather than mixup when both are on")
    mixup_mode: str = key("mix per batch | pair | elem")
    amp: str = key("precision: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp16 | fp32 | fp8 (bf16, and the large "
                   "linear layers in FP8: torchao)")
    fp8_layers: str = key("amp=fp8: which linear layers run in FP8: pays (both features >= 4096; none of Swin's) "
                          "| all (every layer FP8 GEMMs take)")
    # auto | true | false (OmegaConf has no str-or-bool type; check_config checks it)
    compile: Any = key("torch.compile the model: auto (on CUDA, not on the CPU) | true | false")
    compile_mode: str = key("auto (CUDA graphs, also under DDP; default with accum_steps > 1) | default | "
                            "reduce-overhead | max-autotune | max-autotune-no-cudagraphs")
    compile_options: dict[str, Any] = key("inductor options over swin.compile_model's (the mode's), by "
                                          "torch._inductor.config name, e.g. {combo_kernels: true}")
    memory_budget: float | None = key("compiled training: the fraction in (0, 1] of the activations torch.compile "
                                      "saves for the backward (below 1: cheap ops recomputed instead); null: "
                                      "torch's default (1)")
    grad_checkpointing: bool = key("recompute blocks in the backward: less memory, slower")
    ema: bool = key("keep an exponential moving average of the weights (evaluated, kept as best.pt)")
    ema_decay: float = key("EMA decay per update")
    eval_every: int = key("evaluate every N epochs (and after the last)")
    save_every_epochs: int = key("also keep checkpoints/epoch_XXXX.pt every N epochs (0: never)")
    save_every_steps: int = key("also refresh last.pt every N updates inside an epoch (0: never)")
    require_pretrained: bool = key("refuse to start without model.pretrained")
    resume: str | None = key("start from this checkpoint (full training state) unless the run dir has its own")
    auto_resume: bool = key("continue from <run dir>/checkpoints/last.pt when it exists")
    max_nonfinite: int = key("stop after this many non-finite losses or gradients in a row (each skips its update)")
    dist_timeout_s: float = key("several processes: seconds a collective waits for the others before the run stops "
                                "(a process that died or hangs)")
    ddp_bucket_mb: float = key("several processes: size of DDP's gradient all-reduce buckets (MiB); each is "
                               "reduced while the backward goes on")


@dataclass
class WandbConfig:
    mode: str = key("online | offline (kept in the run dir, `wandb sync` later) | disabled")
    project: str = key("wandb project")
    entity: str | None = key("wandb entity (team); null: your default")
    name: str | None = key("run name; null: wandb's")
    tags: list[str] = key("run tags")


@dataclass
class LoggerConfig:
    progress: bool = key("progress bar on the console")
    log_every_steps: int = key("a log line (train.log, wandb) every N updates; each waits for the GPU")
    wandb: WandbConfig = section(WandbConfig, "Weights & Biases logging")


@dataclass
class TrainAppConfig:
    """configs/train.yaml (train.py)."""

    model: ModelConfig = key("the model (model=<option> picks a configs/model file)")
    data: DataConfig = key("the dataset (data=<option> picks a configs/data file)")
    seed: int = key("random seed (initialisation, data order, augmentation)")
    device: str = key("auto (cuda if available) | cpu | cuda")
    train: TrainConfig = section(TrainConfig, "optimisation, schedule, precision, compilation, checkpoints")
    logger: LoggerConfig = section(LoggerConfig, "console, train.log and wandb")


@dataclass
class EvalAppConfig:
    """configs/eval.yaml (eval.py)."""

    model: ModelConfig = key("the model, when not taken from the checkpoint (model=<option>)")
    data: DataConfig = key("the dataset, when not taken from the checkpoint (data=<option>)")
    checkpoint: str = key("required: weights to evaluate: train.py's best.pt/last.pt, a timm or official "
                          "Microsoft file, or timm:<name.tag>")
    ema: bool | None = key("null: the EMA weights when the checkpoint has them; true: require them; false: raw")
    from_checkpoint: bool = key("our checkpoints: take model and data config from the training run, unless "
                                "model=/data= are given")
    transforms: str = key("auto (ours: the run's data config; timm/Microsoft weights: timm's pretrained config) "
                          "| data (the data config)")
    seed: int = key("random seed")
    device: str = key("auto (cuda if available) | cpu | cuda")
    batch_size: int = key("images per batch and process")
    amp: str = key("precision: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp16 | fp32")
    compile: Any = key("torch.compile the model: auto (on CUDA, for at least compile_min_images images per "
                       "process) | true | false")
    compile_min_images: int = key("compile=auto: the images per process from which compiling pays for its time")
    progress: bool = key("progress bar on the console")
    output: str | None = key("results file (JSON); null: <run dir>/eval_results.json")


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
