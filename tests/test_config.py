"""The config schemas (swin/config.py, and the benchmarks' beside their scripts): every YAML key and value composes
through them unchanged, every config file of a group composes, and a wrong type, an unknown key or a key of another
dataset is refused at composition."""
import re

import pytest
import torch
from _train_utils import REPO, make_cfg
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import scripts.bench_data  # noqa: F401  (registers the schema of configs/bench_data.yaml, beside its script)
import scripts.benchmark  # noqa: F401  (likewise configs/benchmark.yaml)
from swin.config import DigitsDataConfig, ImageFolderDataConfig, SyntheticDataConfig, TrainConfig

CONFIGS = REPO / "configs"
MODELS = sorted(p.stem for p in (CONFIGS / "model").glob("*.yaml"))
DATA = sorted(p.stem for p in (CONFIGS / "data").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))


def _yaml(name: str) -> dict:
    """A config file's own keys and values, as written (no defaults list, no hydra node)."""
    cfg = OmegaConf.load(CONFIGS / name)
    for key in ("defaults", "hydra"):
        cfg.pop(key, None)
    return OmegaConf.to_container(cfg)


def _compose(config: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config, overrides=list(overrides))


@pytest.mark.parametrize("data", DATA)
@pytest.mark.parametrize("model", MODELS)
def test_train_config_through_the_schema_is_the_yaml(model, data):
    cfg = make_cfg(f"model={model}", f"data={data}")
    want = {**_yaml("train.yaml"), "model": _yaml(f"model/{model}.yaml"), "data": _yaml(f"data/{data}.yaml")}
    assert OmegaConf.to_container(cfg) == want  # same keys, same values (ints in float keys compare equal)


@pytest.mark.parametrize("config", ["eval", "bench_data"])
def test_other_app_configs_through_the_schema_are_the_yaml(config):
    cfg = _compose(config)
    want = _yaml(f"{config}.yaml")
    defaults = OmegaConf.load(CONFIGS / f"{config}.yaml").defaults
    groups = {k: v for d in defaults if isinstance(d, dict) or OmegaConf.is_dict(d) for k, v in d.items()
              if k in ("model", "data")}
    want.update({group: _yaml(f"{group}/{name}.yaml") for group, name in groups.items()})
    assert OmegaConf.to_container(cfg) == want


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_typed(experiment):
    cfg = make_cfg(f"experiment={experiment}", "model.pretrained=x.pth")
    assert OmegaConf.get_type(cfg.train) is TrainConfig and cfg.train.epochs >= 30


def test_each_dataset_has_its_own_schema():
    assert OmegaConf.get_type(make_cfg().data) is DigitsDataConfig
    assert OmegaConf.get_type(make_cfg("data=imagenet").data) is ImageFolderDataConfig
    assert OmegaConf.get_type(make_cfg("data=synthetic").data) is SyntheticDataConfig


@pytest.mark.parametrize("override, says", [
    ("train.lr=abc", "could not be converted to Float"),
    ("train.ema=maybe", "is not a valid bool"),
    ("model.depths=[2,x]", "could not be converted to Integer"),
    ("data.shift=1.5", "could not be converted to Integer"),
    ("train.epochz=3", "Could not override 'train.epochz'"),
    ("data.mean=[0.5]", "Could not override 'data.mean'"),  # an imagefolder key, not a digits one
])
def test_wrong_type_or_key_is_refused_at_composition(override, says):
    with pytest.raises(ConfigCompositionException) as e:
        make_cfg(override)
    message = f"{e.value}\n{e.value.__cause__}"
    assert says in message and override.split("=")[0] in message, message


def test_benchmark_grid_rows_are_typed():
    cfg = _compose("benchmark", "grid=best")
    assert [row.compile for row in cfg.grid.rows] == [[True]] * 3
    assert cfg.grid.rows[0].compile_mode == "reduce-overhead" and cfg.time_budget_s == 450
    with pytest.raises(ConfigCompositionException):
        _compose("benchmark", "grid.batch_size=[big]")


def test_model_sizes_take_an_int_or_height_width():
    from swin.train.checks import ConfigError, check_config

    cpu = torch.device("cpu")
    check_config(make_cfg("model.img_size=[16,24]", "model.window_size=[4,4]"), 1, cpu)  # rectangular: accepted
    for override, says in (("model.img_size=abc", "model.img_size='abc': use an integer or [height, width]"),
                           ("model.window_size=[4,4,4]", "model.window_size=[4, 4, 4]: use an integer or")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            check_config(make_cfg(override), 1, cpu)


def test_a_required_key_left_unset_stops_with_one_line():
    """data=imagenet without data.root (a ??? value in its file): a ConfigError naming the key, from the conversion
    to typed settings (swin.config.to_settings), before anything is built."""
    from swin.train.checks import ConfigError, check_config

    with pytest.raises(ConfigError, match=re.escape("data.root is required and not set: add "
                                                    "data.root=/path/to/dataset to the command line")):
        check_config(make_cfg("data=imagenet"), 1, torch.device("cpu"))
    assert check_config(make_cfg("data=imagenet", "data.root=/x"), 1, torch.device("cpu")).data.root == "/x"


def test_compile_auto_compiles_on_cuda_with_cuda_graphs():
    """train.compile=auto (the default): eager on the CPU, compiled on CUDA; train.compile_mode=auto: CUDA graphs
    (reduce-overhead), on one GPU and under DDP, the default mode with gradient accumulation; explicit values win;
    anything else is one line."""
    from swin.train.checks import ConfigError, check_config, compile_mode

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    t = check_config(make_cfg(), 1, cpu).train
    assert (t.compile, t.compile_mode) == ("auto", "auto")
    assert compile_mode("auto", "auto", cpu) is None
    assert compile_mode("auto", "auto", cuda) == "reduce-overhead"
    assert compile_mode("auto", "auto", cuda, accum_steps=2) == "default"
    assert compile_mode(True, "auto", cpu) == "default"
    assert compile_mode(True, "max-autotune", cpu) == "max-autotune"
    assert compile_mode(False, "reduce-overhead", cuda) is None
    assert compile_mode("auto", "default", cuda) == "default"
    with pytest.raises(ConfigError, match=re.escape("train.compile='sometimes': use auto (compile on CUDA), true or")):
        check_config(make_cfg("train.compile=sometimes"), 1, cpu)
