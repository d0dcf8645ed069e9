"""train.amp=fp8: which layers torchao's float8 training takes, that the parameters stay the same ones, and the
one-line errors where FP8 cannot run (no GPU here: the FP8 runs are checked on the GPU by scripts/check_fp8.py)."""
from __future__ import annotations

import importlib.util
import re

import pytest
import torch
import torch.nn as nn
from _train_utils import make_cfg

import swin
from swin.precision import autocast, fp8_linears, fp8_problem, resolve_amp

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")


@needs_torchao
@pytest.mark.parametrize("name", ["swin_base_patch4_window7_224", "swinv2_tiny_window8_256"])
def test_fp8_takes_the_large_linear_layers(name):
    model = swin.create_model(name, depths=(2, 2, 2, 2), attention="sdpa")
    # independently: the nn.Linear layers torchao's rule keeps (not K <= 4096 with N <= 1024), multiples of 16 (not
    # the 1000-class head); V2's qkv is applied through F.linear with its q/v biases, so swapping it changes nothing
    v2 = any(hasattr(m, "cpb_mlp") for m in model.modules())
    expected = sorted(fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)
                      and (m.in_features > 4096 or m.out_features > 1024)
                      and m.in_features % 16 == 0 and m.out_features % 16 == 0
                      and not (v2 and fqn.endswith("attn.qkv")))
    assert expected and "head.fc" not in expected
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    swapped = fp8_linears(model)
    assert sorted(swapped) == expected
    from torchao.float8.float8_linear import Float8Linear
    assert sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear)) == expected
    # the same parameter objects (an optimizer built before or after sees the same ones) and checkpoint keys
    assert all(p is params[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys


def test_fp8_is_one_line_where_it_cannot_run():
    from swin.train.checks import ConfigError, check_config

    assert fp8_problem(torch.device("cpu")) == "amp=fp8 needs a CUDA GPU with FP8 tensor cores, not cpu; use amp=bf16"
    line = "train.amp=fp8 needs a CUDA GPU with FP8 tensor cores, not cpu; use train.amp=bf16"
    with pytest.raises(ConfigError, match="^" + re.escape(line) + "$"):
        check_config(make_cfg("train.amp=fp8"), 1, torch.device("cpu"))
    # evaluation is not an FP8 run; training's own evaluation of an FP8 model runs under bf16 autocast
    with pytest.raises(ValueError, match="amp='fp8': use auto, bf16, fp16 or fp32"):
        resolve_amp("fp8", torch.device("cpu"))
    with autocast(torch.device("cpu"), "fp8"):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
