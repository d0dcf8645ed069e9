"""train.amp=fp8: which layers torchao's float8 training takes, that the parameters stay the same ones, and the
one-line errors where FP8 cannot run (no GPU here: the FP8 runs are checked on the GPU by scripts/check_fp8.py)."""
from __future__ import annotations

import copy
import importlib.util
import re

import pytest
import torch
import torch.nn as nn
from _train_utils import make_cfg

import swin
from swin.precision import autocast, fp8_gemm_takes, fp8_linears, fp8_problem, resolve_amp

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")


@needs_torchao
@pytest.mark.parametrize("name", ["swin_base_patch4_window7_224", "swinv2_tiny_window8_256"])
def test_fp8_layers_all_takes_every_layer_fp8_gemms_take(name):
    model = swin.create_model(name, depths=(2, 2, 2, 2), attention="sdpa")
    # independently: the nn.Linear layers whose features are multiples of 16 (not the 1000-class head); V2's qkv is
    # applied through F.linear with its q/v biases, so swapping it changes nothing
    v2 = any(hasattr(m, "cpb_mlp") for m in model.modules())
    expected = sorted(fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)
                      and m.in_features % 16 == 0 and m.out_features % 16 == 0
                      and not (v2 and fqn.endswith("attn.qkv")))
    assert expected and "head.fc" not in expected
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    assert fp8_linears(copy.deepcopy(model)) == []  # "pays": no Swin layer has 4096+ features on both sides
    swapped = fp8_linears(model, "all")
    assert sorted(swapped) == expected
    from torchao.float8.float8_linear import Float8Linear
    assert sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear)) == expected
    # the same parameter objects (an optimizer built before or after sees the same ones) and checkpoint keys
    assert all(p is params[n] for n, p in model.named_parameters())
    assert list(model.state_dict()) == keys


@needs_torchao
def test_fp8_pays_only_for_layers_large_on_both_sides():
    # built on the meta device: no memory for the 4096 x 4096 weights
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 1024), nn.Linear(1024, 8192),
                              nn.Linear(8192, 4112), nn.Linear(4096, 4100))
    # 4096 x 4096 and 8192 x 4112 (both sides >= 4096, multiples of 16); not 4096 -> 1024, 1024 -> 8192 (a side
    # under 4096) nor 4096 -> 4100 (not a multiple of 16)
    assert fp8_linears(model) == ["0", "3"]
    with pytest.raises(ValueError, match=r"^fp8_layers='some': use pays \(the layers FP8 speeds up\) or all \(every "
                                         r"layer FP8 GEMMs take\)$"):
        fp8_linears(model, "some")


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


def test_fp8_linear_bench_finds_the_layers_as_they_run():
    from scripts.bench_fp8_linear import linear_shapes, main, totals

    model = swin.create_model("swin_micro", attention="sdpa")
    shapes = linear_shapes(model, model.img_size)
    # independently, from swin_micro's config (16 px, patch 2, embed 32, depths (2, 2), MLP ratio 4, 10 classes):
    # stage 1 sees 8 x 8 tokens of 32 channels, the merge 4 x 4 tokens of 4 x 32, stage 2 4 x 4 of 64, the head one
    expected = {(64, 32, 96): 2, (64, 32, 32): 2, (64, 32, 128): 2, (64, 128, 32): 2, (16, 128, 64): 1,
                (16, 64, 192): 2, (16, 64, 64): 2, (16, 64, 256): 2, (16, 256, 64): 2, (1, 64, 10): 1}
    assert {(s.tokens, s.in_features, s.out_features): len(s.layers) for s in shapes} == expected
    assert sum(len(s.layers) for s in shapes) == sum(isinstance(m, nn.Linear) for m in model.modules())
    assert next(s for s in shapes if s.out_features == 10).layers == ["head.fc"]
    # the model's time per recipe: every layer of a shape counted; FP8 where fp8_pays, or where it was faster
    results = [{"layers": ["a", "b"], "fp8_pays": True, "bf16_ms": 1.0, "rowwise_ms": 1.5},
               {"layers": ["c"], "fp8_pays": False, "bf16_ms": 2.0, "rowwise_ms": 0.5},
               {"layers": ["head"], "fp8_pays": False, "bf16_ms": 0.25, "rowwise_ms": None}]  # FP8 cannot run it
    assert totals(results, "rowwise") == {"bf16": 4.25, "fp8_pays": 5.25, "where_faster": 2.75}
    takes = [fp8_gemm_takes(s.in_features, s.out_features) for s in shapes if s.out_features in (10, 96)]
    assert takes == [True, False]  # FP8 GEMMs take 32 -> 96, not the 10-class head
    assert main(["--model", "swin_micro", "--list"]) == 0
    if fp8_problem(torch.device("cuda" if torch.cuda.is_available() else "cpu")):
        assert main(["--model", "swin_micro"]) == 2  # one line, no traceback, where FP8 cannot run
