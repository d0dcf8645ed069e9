"""FP8 against bf16 per linear layer of a Swin model: which layers train.amp=fp8 should take.

Collects the distinct linear-layer shapes of a model (tokens x in_features -> out_features, as its layers see them
at ``--batch``), then times each forward+backward under bf16 autocast, as ``nn.Linear`` and as torchao's
``Float8Linear`` for each ``--recipes`` entry (``tensorwise``, what train.amp=fp8 uses, ``rowwise``, ...), each
compiled (torch.compile's default mode). It prints each shape's GPU time and fp8 / bf16 speed beside what
``swin.precision.fp8_pays`` chooses, and the whole model's linear time with every layer in bf16, with the layers
fp8_pays picks in FP8, and with only the layers FP8 was faster for.

    python scripts/bench_fp8_linear.py --model swin_base_patch4_window7_224 --batch 128
    python scripts/bench_fp8_linear.py --model swin_large_patch4_window12_384 --batch 32 --json $OUT/fp8_linear.json
    python scripts/bench_fp8_linear.py --model swin_tiny_patch4_window7_224 --list    # the shapes only (any device)

Times are medians of CUDA-event timings of single calls, each queued behind a GPU sleep so that the host's launch
cost stays out. Standalone layers: in the model, inductor may fuse FP8's scaling and casting with neighbouring ops.
A shape whose features are not multiples of 16 (a 1000-class head) is not timed in FP8: FP8 GEMMs refuse it, so
it stays in bf16 in every total. Exits 2 with one line where FP8 cannot run (no FP8 GPU or no torchao).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import swin  # noqa: E402
from scripts.bench_attention import median_ms  # noqa: E402  (CUDA events, each call queued behind a GPU sleep)
from swin.precision import fp8_gemm_takes, fp8_pays, fp8_problem  # noqa: E402


@dataclass
class LinearShape:
    """The layers (names) that see ``tokens`` tokens per image with these features."""

    tokens: int
    in_features: int
    out_features: int
    bias: bool
    layers: list[str] = field(default_factory=list)


def linear_shapes(model: nn.Module, img_size: tuple[int, int]) -> list[LinearShape]:
    """The distinct nn.Linear shapes of ``model`` for one (1, 3, *img_size) image, in order of first use: one
    forward on the CPU, every linear layer's input recorded."""
    shapes: dict[tuple[int, int, int, bool], LinearShape] = {}
    names = {m: n for n, m in model.named_modules() if isinstance(m, nn.Linear)}

    def record(module: nn.Linear, args: tuple) -> None:
        key = (args[0].numel() // module.in_features, module.in_features, module.out_features,
               module.bias is not None)
        shapes.setdefault(key, LinearShape(*key)).layers.append(names[module])

    hooks = [m.register_forward_pre_hook(record) for m in names]
    try:
        with torch.no_grad():
            model.eval().cpu()(torch.randn(1, 3, *img_size))
    finally:
        for h in hooks:
            h.remove()
    return list(shapes.values())


def linear_step(shape: LinearShape, batch: int, recipe: str | None, device: torch.device) -> Callable[[], None]:
    """forward+backward of one compiled layer of ``shape`` under bf16 autocast (bf16 input and output gradient,
    fp32 parameters, as in training): nn.Linear for recipe None, else Float8Linear with that torchao recipe."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(shape.in_features, shape.out_features, bias=shape.bias)).to(device)
    if recipe is not None:
        convert_to_float8_training(layer, config=Float8LinearConfig.from_recipe_name(recipe))
    compiled = torch.compile(layer)
    rows = batch * shape.tokens
    x = torch.randn(rows, shape.in_features, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(rows, shape.out_features, device=device, dtype=torch.bfloat16)

    def step() -> None:
        x.grad = None
        layer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = compiled(x)
        y.backward(grad)

    return step


def measure(shapes: list[LinearShape], batch: int, recipes: list[str], warmup: int, reps: int,
            device: torch.device) -> list[dict]:
    """Per shape: its layers, bf16 ms, each recipe's ms and fp8 / bf16 speed (None where FP8 cannot run the shape),
    and what fp8_pays says."""
    results = []
    for shape in shapes:
        row = {**asdict(shape), "fp8_pays": fp8_pays(shape.in_features, shape.out_features)}
        row["bf16_ms"] = median_ms(linear_step(shape, batch, None, device), device, warmup, reps, flush=False)
        for recipe in recipes:
            if not fp8_gemm_takes(shape.in_features, shape.out_features):
                row[f"{recipe}_ms"] = row[f"{recipe}_speedup"] = None
                continue
            ms = median_ms(linear_step(shape, batch, recipe, device), device, warmup, reps, flush=False)
            row[f"{recipe}_ms"], row[f"{recipe}_speedup"] = ms, row["bf16_ms"] / ms
        results.append(row)
        torch._dynamo.reset()
    return results


def totals(results: list[dict], recipe: str) -> dict[str, float]:
    """The model's linear time per step (ms): all in bf16; fp8_pays's layers in FP8; FP8 only where faster. A shape
    FP8 cannot run (its ms None) counts in bf16."""
    def total(fp8: Callable[[dict], bool]) -> float:
        return sum(len(r["layers"]) * (r[f"{recipe}_ms"] if r[f"{recipe}_ms"] is not None and fp8(r)
                                       else r["bf16_ms"]) for r in results)

    return {"bf16": total(lambda r: False), "fp8_pays": total(lambda r: r["fp8_pays"]),
            "where_faster": total(lambda r: r[f"{recipe}_ms"] < r["bf16_ms"])}


def _fp8_cell(row: dict, recipe: str) -> str:
    ms = row[f"{recipe}_ms"]
    return "not a multiple of 16" if ms is None else f"{ms:.3f} ({row[f'{recipe}_speedup']:.2f})"


def _layer_names(layers: list[str]) -> str:
    return layers[0] if len(layers) == 1 else f"{layers[0]} (+{len(layers) - 1})"


def table(results: list[dict], batch: int, recipes: list[str]) -> str:
    head = ["layers", "tokens", "in", "out", "fp8_pays", "bf16 ms", *(f"{r} ms (x bf16)" for r in recipes)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [_layer_names(r["layers"]), f"{batch * r['tokens']:,}", str(r["in_features"]),
                 str(r["out_features"]), "yes" if r["fp8_pays"] else "no", f"{r['bf16_ms']:.3f}",
                 *(_fp8_cell(r, x) for x in recipes)]
        lines.append("| " + " | ".join(cells) + " |")
    for recipe in recipes:
        t = totals(results, recipe)
        lines.append(f"\n{recipe}: the model's linear layers per step {t['bf16']:.2f} ms in bf16, "
                     f"{t['fp8_pays']:.2f} ms with fp8_pays's layers in FP8, "
                     f"{t['where_faster']:.2f} ms with FP8 only where it was faster")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="swin_base_patch4_window7_224", help="a model name of swin.create_model")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise"],
                   help="torchao float8 recipes (Float8LinearConfig.from_recipe_name)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--list", action="store_true", help="print the layer shapes only (no GPU needed)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.batch < 1:
        p.error(f"--batch {args.batch}: use 1 or more")
    model = swin.create_model(args.model, attention="sdpa")
    shapes = linear_shapes(model, model.img_size)
    if args.list:
        for s in shapes:
            print(f"{_layer_names(s.layers)}: {args.batch * s.tokens:,} tokens x {s.in_features} -> "
                  f"{s.out_features}, fp8_pays {fp8_pays(s.in_features, s.out_features)}")
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if problem := fp8_problem(device, key="train.amp"):
        print(problem, file=sys.stderr)
        return 2
    print(f"# {args.model}, batch {args.batch}, bf16 autocast, forward+backward per layer, "
          f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    results = measure(shapes, args.batch, args.recipes, args.warmup, args.reps, device)
    print(table(results, args.batch, args.recipes))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "batch": args.batch, "device":
                                         torch.cuda.get_device_name(device), "torch": torch.__version__,
                                         "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
