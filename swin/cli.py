"""What train.py and eval.py do before Hydra takes over (:func:`preflight`): ``--help`` built from the schema's
descriptions (swin.config), with the values the given overrides compose to, and one line for overrides that do
not compose.

Hydra's own help page lists every key without a word on what it does, and config groups a user never picks
(schema/, the benchmark grids); this one lists the groups a user chooses and every key with its value and its
line from the schema. ``--hydra-help`` still shows Hydra's flags. Hydra reports a misspelt key or option in
several lines with the schema's internals; :func:`override_error` says it in one.
"""
from __future__ import annotations

import dataclasses
import sys
import textwrap
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
HELP_FLAGS = ("--help", "-h")

# per program: its summary and the config groups a user picks (with what each is for)
PROGRAMS = {
    "train": ("Train or fine-tune a Swin Transformer. `python train.py` trains swin_micro on the digits on the CPU.",
              {"model": "architecture and its size", "data": "dataset",
               "experiment": "a whole recipe (ImageNet training, fine-tuning); none by default",
               "hydra/launcher": "with -m: slurm (a SLURM job) or local"}),
    "eval": ("Evaluate a checkpoint: top-1, top-5 and loss over a validation split.",
             {"model": "architecture (default: the checkpoint's)", "data": "dataset (default: the checkpoint's)"}),
}


def wants_help(argv: list[str]) -> bool:
    return any(a in HELP_FLAGS for a in argv)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def _value(node: DictConfig, name: str) -> str:
    if OmegaConf.is_missing(node, name):
        return "???"
    value = node[name]
    if isinstance(value, DictConfig):
        return ""
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    if isinstance(value, bool):
        return str(value).lower()
    return "null" if value is None else str(value).replace("'", "")


def _key_lines(node: DictConfig, prefix: str = "") -> list[tuple[str, str]]:
    """(key=value, description) of every key under node, sections after their scalars."""
    schema = OmegaConf.get_type(node)
    helps = ({f.name: f.metadata.get("help", "") for f in dataclasses.fields(schema)}
             if dataclasses.is_dataclass(schema) else {})
    scalars, sections = [], []
    for name in node:
        if name == "hydra":  # Hydra's own config (return_hydra_config): --hydra-help describes it
            continue
        full = f"{prefix}{name}"
        child = node._get_node(name)
        if isinstance(child, DictConfig) and not OmegaConf.is_missing(node, name):
            sections.append((f"{full}:", helps.get(name, "")))
            sections.extend(_key_lines(child, f"{full}."))
        else:
            scalars.append((f"{full}={_value(node, name)}", helps.get(name, "")))
    return scalars + sections


def help_text(program: str, cfg: DictConfig, choices: dict[str, Any]) -> str:
    """The help page of train.py or eval.py (program) for a composed config and its group choices."""
    summary, groups = PROGRAMS[program]
    lines = [f"usage: python {program}.py [group=option ...] [key=value ...]", "", summary, "",
             "Config groups (group=option):"]
    for name, what in groups.items():
        chosen = choices.get(name)
        options = ", ".join(f"{o} (chosen)" if o == chosen else o for o in _options(name))
        lines.append(f"  {name}: {what}")
        lines += textwrap.wrap(options, 116, initial_indent=" " * 6, subsequent_indent=" " * 6)
    lines += ["", "Keys (key=value as this command sets them; ??? must be given):"]
    pairs = _key_lines(cfg)
    width = min(44, max(len(k) for k, _ in pairs) + 2)
    for k, description in pairs:
        pad = " " * max(2, width - len(k))
        lines.append(f"  {k}{pad}{description}".rstrip())
    lines += ["", "Hydra: -m runs a sweep or a SLURM job (hydra/launcher), --cfg job prints the composed config, "
              "--hydra-help lists Hydra's own flags."]
    return "\n".join(lines)


def _compose(program: str, argv: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    import swin.config  # noqa: F401  (registers the schemas)

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(program, overrides=_overrides(argv), return_hydra_config=True)


# Hydra's flags that take a value (the next argument)
VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir",
               "-cd", "--info", "-i", "--experimental-rerun")


def _overrides(argv: list[str]) -> list[str]:
    """The command line's config overrides: no flags (nor their values), nothing of Hydra's own config."""
    out, skip = [], False
    for a in argv:
        if skip or a.startswith("-"):
            skip = not skip and a in VALUE_FLAGS
            continue
        if not a.startswith(("hydra.", "hydra/")):
            out.append(a)
    return out


def _one_line(program: str, e: Exception) -> str:
    """Hydra's and OmegaConf's multi-line reports of a bad override as one line."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    first = str(e).splitlines()[0].strip()
    cause = e.__cause__ or e.__context__
    if isinstance(e, MissingConfigException) and e.options:  # model=swin_tny
        wanted = (e.missing_cfg_file or "").replace("/", "=", 1) if e.missing_cfg_file else first
        return f"{wanted}: no such option; choose one of {', '.join(e.options)}"
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):  # train.lrr=1
        key = getattr(cause, "full_key", None) or first
        return f"{key} is not a key of {program}.py's config (python {program}.py --help lists them)"
    reason = str(cause).splitlines()[0].strip() if cause is not None else first
    if reason != first:  # train.lr=abc
        return f"{first.removeprefix('Error merging override ')}: {reason}"
    return f"bad override: {first}"


def override_error(program: str, argv: list[str]) -> str | None:
    """One line saying why the command line's overrides do not compose (a misspelt key or option, a value of the
    wrong type), or None when they do. Hydra reports these in several lines, with the schema's internals; command
    lines with flags (-m, --cfg, ...) or extra search paths are left to it."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if any(a.startswith("-") or "hydra.searchpath" in a for a in argv):
        return None  # sweeps (-m), other flags, config groups on another search path: Hydra's own business
    try:
        _compose(program, argv)
    except (HydraException, OmegaConfBaseException) as e:
        return _one_line(program, e)
    return None


def print_help(program: str, argv: list[str]) -> int:
    """Prints the help page for the overrides in argv (flags ignored); returns the exit status: 2 with one line
    when the overrides do not compose (a typo in a key or an option)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = _compose(program, argv)
    except (HydraException, OmegaConfBaseException) as e:
        print(f"error: {_one_line(program, e)}", file=sys.stderr)
        return 2
    print(help_text(program, cfg, dict(cfg.hydra.runtime.choices)))
    return 0


def preflight(program: str, argv: list[str]) -> int | None:
    """What train.py and eval.py do before Hydra takes over: the help page, or one line for overrides that do not
    compose. Returns the exit status when the program should stop there, else None."""
    if wants_help(argv):
        return print_help(program, argv)
    error = override_error(program, argv)
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return None
