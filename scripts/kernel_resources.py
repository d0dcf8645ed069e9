"""Compile the flash window kernels for an NVIDIA target *without a GPU* and report their resources.

    python scripts/kernel_resources.py                        # the Swin shapes, sm_90 (H100/H200)
    python scripts/kernel_resources.py --window 12 --head-dim 128 --dtype fp32

Triton compiles ahead of time for a GPUTarget on any machine, and the ptxas that ships with Triton
reports registers, spills and the stack; Triton's metadata gives the shared memory. Registers and
spills decide occupancy (latency hiding) and shared memory decides whether a configuration launches
at all (227 KB per block on Hopper), so kernel changes can be checked here before spending device
time. Pointers, strides and head_dim (where it is) are declared multiples of 16, as Triton specialises
them on the device; other integers stay unspecialised, and the local Triton may be newer than the
device's, so absolute register counts differ. Use it to compare variants with each other and to check shared
memory; confirm on the device.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.flash_window.plan import kernel_constants, launch_config, tile_dtype, tile_rows  # noqa: E402
from kernels.flash_window.triton_kernels import window_attn_bwd_kernel, window_attn_fwd_kernel  # noqa: E402

HOPPER_SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90
DTYPES = {"bf16": ("*bf16", 2), "fp16": ("*fp16", 2), "fp32": ("*fp32", 4)}
FP32_POINTERS = {"bias_ptr", "mask_ptr", "dbias_ptr", "dfill_ptr", "qs_ptr", "dqs_ptr"}


def _signature(fn, constants: dict, data_ptr: str) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name == "tiles_ptr":  # the bias tiles: the data's half dtype unless SWIN_FW_HALF_BIAS=0 (fp32)
            sig[name] = "*fp32" if tile_dtype(torch.bfloat16) == torch.float32 else data_ptr
        elif name.endswith("_ptr"):
            sig[name] = "*fp32" if name in FP32_POINTERS else data_ptr
        elif name == "scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _ptxas_resources(ptx: str, arch: str) -> dict:
    """Registers and spill-store bytes that ptxas reports (None where it reports nothing)."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        return dict(registers=None, spill_bytes=None)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run([str(ptxas), f"-arch={arch}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True)
    text = out.stderr + out.stdout
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    return dict(registers=int(regs.group(1)) if regs else None, spill_bytes=int(spill.group(1)) if spill else None)


def resources(window: tuple[int, int], head_dim: int, dtype: str, shifted: bool, capability: int = 90,
              cosine: bool = False) -> list[dict]:
    """Both attention kernels compiled for the device's launch configuration: tiling, registers, spills and
    shared memory (and whether it fits a block's limit on Hopper). cosine: Swin V2's variant."""
    data_ptr, itemsize = DTYPES[dtype]
    rows = []
    for fn, backward in ((window_attn_fwd_kernel, False), (window_attn_bwd_kernel, True)):
        cfg = launch_config(1024, 4, window[0] * window[1], head_dim, torch.device("cpu"), backward=backward,
                             itemsize=itemsize)
        bias_rows = tile_rows(1024, 4, window[0] * window[1], head_dim, torch.device("cpu"), itemsize)
        constants = kernel_constants(cfg, window, shifted, False, torch.float32 if dtype == "fp32" else torch.bfloat16,
                                     cosine, bias_rows)
        if not backward:
            constants["PDL"] = False  # a launch option of eager calls (kernels.flash_window.plan.forward_plan)
        # the forward both ways where its tile may stay in registers: launches with fewer windows per program load it
        # per window, which takes more shared memory
        variants = [{"RESIDENT_BIAS": False}, {"RESIDENT_BIAS": True}] if constants.get("RESIDENT_BIAS") else [{}]
        for variant in variants:
            rows.append(_compiled(fn, backward, cosine, {**constants, **variant}, cfg, window, head_dim, dtype,
                                  data_ptr, capability))
    return rows


def _compiled(fn, backward: bool, cosine: bool, constants: dict, cfg: dict, window: tuple[int, int], head_dim: int,
              dtype: str, data_ptr: str, capability: int) -> dict:
    signature = _signature(fn, constants, data_ptr)
    # as on the device for Swin shapes: pointers and strides are multiples of 16, head_dim where it is
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name in signature and signature[name] != "constexpr"
             and (name.endswith("_ptr") or re.fullmatch(r"s[a-z]*_[bxyht]", name)
                  or (name == "HD" and head_dim % 16 == 0))}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options=dict(num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"] or None))
    shared = compiled.metadata.shared
    resident = " resident" if constants.get("RESIDENT_BIAS") else ""
    kernel = ("bwd" if backward else "fwd") + (" cosine" if cosine else "") + resident
    return dict(window=list(window), head_dim=head_dim, dtype=dtype, kernel=kernel,
                BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_T=cfg["BLOCK_T"], warps=cfg["num_warps"],
                stages=cfg["STAGES"], precision=constants["PRECISION"], shared=shared,
                fits=shared <= HOPPER_SHARED_LIMIT, **_ptxas_resources(compiled.asm["ptx"], f"sm_{capability}a"))


def describe(r: dict) -> str:
    verdict = "fits" if r["fits"] else "EXCEEDS the sm_90 limit"
    return (f"{r['window'][0]}x{r['window'][1]} hd{r['head_dim']} {r['dtype']} {r['kernel']}: BLOCK_M {r['BLOCK_M']} "
            f"BLOCK_N {r['BLOCK_N']}+{r['BLOCK_T']} warps {r['warps']} stages {r['stages']} {r['precision']}; "
            f"{r['registers']} registers, {r['spill_bytes']} B spill stores; shared {r['shared']} B ({verdict})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, nargs="+", help="window side(s); default 7 8 12 16")
    parser.add_argument("--head-dim", type=int, nargs="+", default=[32])
    parser.add_argument("--dtype", choices=list(DTYPES), nargs="+", default=["bf16", "fp32"])
    parser.add_argument("--unshifted", action="store_true", help="compile without the shifted-window mask")
    parser.add_argument("--capability", type=int, default=90, help="compute capability, e.g. 90 for Hopper")
    parser.add_argument("--cosine", action="store_true", help="also Swin V2's variant (q/k normalised on chip)")
    args = parser.parse_args()
    for side in args.window or [7, 8, 12, 16]:
        for head_dim in args.head_dim:
            for dtype in args.dtype:
                for cosine in (False, True) if args.cosine else (False,):
                    for row in resources((side, side), head_dim, dtype, not args.unshifted, args.capability, cosine):
                        print(describe(row), flush=True)


if __name__ == "__main__":
    main()
