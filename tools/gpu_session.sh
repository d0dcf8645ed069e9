#!/usr/bin/env bash
# GPU measurements and GPU tests, one stage per invocation, run from a checkout on a CUDA machine; results go to $OUT
# (default /tmp/gpu_session).
#   bash tools/gpu_session.sh tests     # the GPU tests: kernels, compiled model (bf16 included), training loop, loaders
#                                       # (GPU_TESTS=kernels or GPU_TESTS=loop: one half)
#   bash tools/gpu_session.sh kernel    # launch sweep of the flash window kernel (SWIN_FW_* knobs; TUNE_ARGS: its
#                                       # arguments), then the attention benchmark at every stage shape
#                                       # (KERNEL_DTYPES="bf16 fp32"; the paper's kernel as a row where FWA_PAPER_PATH,
#                                       # default ./.paper, holds a checkout of it)
#   bash tools/gpu_session.sh e2e       # Swin-T end to end: grid=compiled (CUDA graphs and default mode) with the GPU
#                                       # time breakdown (E2E_GRID=autotune: max-autotune against reduce-overhead;
#                                       # E2E_GRID=fused_gelu: inference with and without the GELU epilogue)
#   E2E_MODEL=384 bash tools/gpu_session.sh e2e-base  # Swin-B 384 (or 224; both when unset) end to end, grid=best
#   V2_MODEL=swinv2_base_window16_256 V2_BATCH=64 bash tools/gpu_session.sh e2e-v2  # Swin V2 against timm's V2,
#                                       # grid=swinv2 (default: swinv2_tiny_window8_256, b64 and b128)
#   bash tools/gpu_session.sh eager     # eager mode, ours against timm at batch 1, 8 and 128 (grid=eager): Swin-T
#                                       # and Swin V2-T, with their host time per forward and per block; then the
#                                       # flash op's host time per call against timm's SDPA path (bench_attention)
#   bash tools/gpu_session.sh loop      # train.py against its own model step: the compiled model step
#                                       # (scripts/benchmark.py grid=loop), train.py on synthetic data compiled and
#                                       # eager, and the ImageNet recipe on a generated JPEG folder; table in
#                                       # $OUT/loop.md
#   bash tools/gpu_session.sh data      # GPU JPEG decoding: the data pipeline's GPU tests, then scripts/bench_data.py
#                                       # on a generated ImageNet-shaped folder: loader img/s (CPU workers, nvJPEG),
#                                       # train.py with each and on synthetic data, eval.py top-1 with each decode path;
#                                       # table in $OUT/data/bench_data.md (DATA_ARGS: more overrides, e.g.
#                                       # "loader.cpu_workers=[16] loader.gpu_workers=[8]")
#   bash tools/gpu_session.sh fp8       # FP8 against bf16: scripts/bench_fp8_linear.py (each layer shape),
#                                       # scripts/check_fp8.py (losses), then grid=fp8 (every layer FP8 takes) for
#                                       # Swin-T, Swin-B 224 and Swin-B 384
#   BACKBONE_MODELS=t bash tools/gpu_session.sh backbone  # features_only models at 800x1216 against timm's
#                                       # (grid=backbone): Swin-T (t), Swin-B 384 at window 12 (b384), Swin V2-T at
#                                       # 768x1280 (v2t); all three by default, more than one call's ten minutes
#                                       # (BACKBONE_ARGS: more overrides, no spaces within one, e.g. grid.batch_size=[2]
#                                       # steps.interleave=true grid.rows=[{impl:ours,...},{impl:timm,...}], no quotes)
#   SCALING_PROCS="1 2" bash tools/gpu_session.sh scaling  # scripts/bench_scaling.py: train.py's step under torchrun
#                                       # per process count, CUDA graphs and default compile (SCALING_MODEL, default
#                                       # swin_tiny_patch4_window7_224; SCALING_BATCH per process, default 128;
#                                       # SCALING_ARGS: more overrides); tables in $OUT/scaling_*.md
#   MPS=1 bash tools/gpu_session.sh train-side  # train.py on data=synthetic, then on a generated folder with
#                                       # data.decode=gpu; last epoch's img/s of each in $OUT/train_side.md (SIDE_ROWS:
#                                       # of synthetic gpu_host gpu_ring, the first two by default; SIDE_ARGS: overrides
#                                       # for every row, e.g. logger.log_every_steps=10; NPROC=4: torchrun over 4 GPUs,
#                                       # batch 128 per GPU; SIDE_PER_CLASS: training files per class, default 320)
# E2E_BUDGET_S, DATA_BUDGET_S: the benchmarks' time_budget_s (rows not started after it are skipped; default: the
# config's). MPS=1 before any stage: the stage runs under an MPS daemon of its own (started before, stopped after), so
# that the CUDA contexts of several processes (data.decode=gpu's loader workers) share the GPU instead of time-slicing.
# Offline wheels: on a machine without a package index, put the missing wheels (e.g. hydra-core, omegaconf,
# pytest-xdist, execnet) in .whl/ at the repository root (ignored by git); they are installed into /tmp/site first.
set -uo pipefail
STAGES="tests|kernel|e2e|e2e-base|e2e-v2|eager|loop|data|train-side|scaling|backbone|fp8"
case "${1:-}" in
  tests|kernel|e2e|e2e-base|e2e-v2|eager|loop|data|train-side|scaling|backbone|fp8) ;;
  *) echo "usage: bash tools/gpu_session.sh $STAGES" >&2
     exit 2 ;;
esac
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH  # PATH: the wheels' console scripts
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ "${MPS:-0}" = 1 ]; then
  # a user-level MPS daemon for this stage only (the GPU's compute mode is left as it is); every CUDA process started
  # below with these variables is its client
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/swin_mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/swin_mps/log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || exit 1
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
  echo "MPS daemon started"
fi
python -c "import torch, triton, timm
print('torch', torch.__version__, 'triton', triton.__version__, 'timm', timm.__version__)"
# the same Swin-T ImageNet recipe for the train.py rows of loop's folder run and train-side (128 images per GPU)
NPROC=${NPROC:-1}
Q="experiment=imagenet_swin_tiny train.batch_size=$(( 128 * NPROC )) train.epochs=3 train.warmup_epochs=1 train.compile=true
   train.compile_mode=reduce-overhead train.save_every_epochs=0 train.save_every_steps=0 train.eval_every=1000
   logger.wandb.mode=disabled logger.progress=false"
case "$1" in
  tests)
    # GPU_TESTS: "kernels loop" (default), or one of them where both do not fit a call
    kernel_tests=0 loop_tests=0
    if [[ " ${GPU_TESTS:-kernels loop} " == *" kernels "* ]]; then
      # The kernel files on CUDA (their flash, gpu and autocast cases; pytest-xdist's workers compile the Triton
      # kernels in parallel, TEST_WORKERS of them): flash window attention, V2's flash path and its CPB table under
      # autocast, the GELU epilogue, the fused merge, the backbone compiled (inductor) once for several input sizes,
      # the cached and replayed eager launches, the benchmark's eager host timing. tests/test_model.py is left to
      # the CPU suite (its timm comparisons).
      python -m pytest -q -n "${TEST_WORKERS:-8}" --durations=10 tests/test_flash_window.py tests/test_swinv2.py \
        tests/test_mlp_act.py tests/test_merge_norm.py tests/test_backbone.py tests/test_kernel_launch.py \
        tests/test_benchmarks.py -k "flash or gpu or autocast" 2>&1 \
        | tee "$OUT/gpu_tests.txt"
      kernel_tests=$?
    fi
    if [[ " ${GPU_TESTS:-kernels loop} " == *" loop "* ]]; then
      # the training step never syncs (CUDA sync debug mode); the side-stream loader and the batch ring keep
      # batches intact
      python -m pytest -q -m gpu tests/test_train_guard.py tests/test_data.py tests/test_batch_ring.py 2>&1 \
        | tee "$OUT/gpu_loop_tests.txt"
      loop_tests=$?
    fi
    # the stage fails where a pytest run failed (pipefail: pytest's status, not tee's)
    [ "$kernel_tests" = 0 ] && [ "$loop_tests" = 0 ] || exit 1 ;;
  kernel)
    # the paper's kernel (github.com/zzd1992/FlashWindowAttention) is a row where FWA_PAPER_PATH holds a checkout
    export FWA_PAPER_PATH=${FWA_PAPER_PATH:-$PWD/.paper}
    # TUNE_ARGS: the sweep's shapes and configs (e.g. --shapes swin_t_stage1 swin_t_stage3 --config "" --config
    # BWD_STAGES=2)
    SHAPES="swin_t_stage1 swin_t_stage2 swin_t_stage4 swin_b384_stage1"
    eval "python scripts/tune_flash_window.py --profile ${TUNE_ARGS:---shapes $SHAPES}" 2>&1 | tee "$OUT/tune.txt"
    python scripts/bench_attention.py --preset stages --dtype ${KERNEL_DTYPES:-bf16} \
      --backends sdpa flash_window paper --json "$OUT/bench_attention.json" 2>&1 | tee "$OUT/bench_attention.txt" ;;
  e2e)
    # compiled rows, CUDA graphs and default mode for both sides, with the per-category GPU time breakdown
    python scripts/benchmark.py grid=${E2E_GRID:-compiled} profile.enabled=true profile.top_kernels=25 \
      out_dir="$OUT/swin_t" ${E2E_BUDGET_S:+time_budget_s=$E2E_BUDGET_S} ;;
  e2e-base)
    # E2E_MODEL=224 or 384: that model only; unset: both
    if [ "${E2E_MODEL:-384}" = 384 ]; then
      python scripts/benchmark.py grid=best model=swin_base_patch4_window12_384 grid.batch_size=[64] \
        profile.enabled=true out_dir="$OUT/swin_b384" ${E2E_BUDGET_S:+time_budget_s=$E2E_BUDGET_S}
    fi
    if [ "${E2E_MODEL:-224}" = 224 ]; then
      python scripts/benchmark.py grid=best model=swin_base_patch4_window7_224 profile.enabled=true \
        out_dir="$OUT/swin_b224" ${E2E_BUDGET_S:+time_budget_s=$E2E_BUDGET_S}
    fi ;;
  e2e-v2)
    # ours (flash_window, sdpa) against timm's V2 (explicit math), compiled, bf16
    M=${V2_MODEL:-swinv2_tiny_window8_256}
    python scripts/benchmark.py grid=swinv2 model=$M grid.batch_size=[${V2_BATCH:-64,128}] profile.enabled=true \
      profile.top_kernels=25 out_dir="$OUT/$M" ${E2E_BUDGET_S:+time_budget_s=$E2E_BUDGET_S} ;;
  eager)
    # eager mode, no compile: ours against timm at batch 1, 8 and 128 (grid=eager), Swin-T and Swin V2-T
    python scripts/benchmark.py grid=eager out_dir="$OUT/eager_swin_t" ${E2E_BUDGET_S:+time_budget_s=$E2E_BUDGET_S}
    python scripts/benchmark.py grid=eager model=swinv2_tiny_window8_256 out_dir="$OUT/eager_swinv2_t" \
      ${E2E_BUDGET_S:+time_budget_s=$E2E_BUDGET_S}
    # the flash op's own host time per eager call against timm's SDPA path, Swin-T stage 1 at batch 1 and 128
    for batch in 1 128; do
      python scripts/bench_attention.py --preset swin_t_stage1 --dtype bf16 --batch $batch \
        --backends flash_window sdpa --json "$OUT/attention_host_b$batch.json" | grep -E "^\|"
    done ;;
  loop)
    # run dirs (with their ~0.4 GB checkpoints) stay in /tmp; summary.json and train.log are copied to $OUT
    R=/tmp/loop; rm -rf "$R"; mkdir -p "$R"
    L="logger.wandb.mode=disabled logger.progress=false train.save_every_epochs=0 train.eval_every=1000"
    python scripts/benchmark.py grid=loop out_dir="$OUT/loop_model" time_budget_s=0
    # Swin-T b128 bf16 as in the benchmark row, plus train.py's defaults: EMA, clip_grad 5, label smoothing;
    # 2 epochs of 200 steps (the summary's img/s and data-wait fraction are the last epoch's)
    S="model=swin_tiny_patch4_window7_224 data=synthetic data.train_samples=25600 data.val_samples=512
       train.batch_size=128 train.amp=bf16 train.epochs=2 train.warmup_epochs=1 train.lr=1e-4 $L"
    python train.py $S train.compile=true hydra.run.dir="$R/synthetic_compiled"
    python train.py $S train.compile=true train.compile_mode=reduce-overhead hydra.run.dir="$R/synthetic_cudagraphs"
    python train.py $S train.compile=false hydra.run.dir="$R/synthetic_eager"
    # the official recipe (RandAugment, random erasing, mixup/cutmix) on ImageNet-shaped JPEGs, cores-1 workers;
    # 64 classes: 80 steps/epoch at b128 and 512 validation images (whole eval batches: no recompilation)
    python scripts/make_imagefolder.py "$R/fakenet" --classes 64 --train-per-class 160 --val-per-class 8
    python train.py experiment=imagenet_swin_tiny data.root="$R/fakenet" data.num_workers=$(( $(nproc) - 1 )) \
      train.batch_size=128 train.epochs=3 train.warmup_epochs=1 train.compile=true $L hydra.run.dir="$R/imagenet_folder"
    for d in synthetic_compiled synthetic_cudagraphs synthetic_eager imagenet_folder; do
      mkdir -p "$OUT/loop_$d" && cp "$R/$d/summary.json" "$R/$d/train.log" "$OUT/loop_$d/" 2>/dev/null
    done
    # the model step's img/s is in $OUT/loop_model/benchmark.md; train.py's last epoch from each summary.json
    python - "$OUT" <<'EOF' | tee "$OUT/loop.md"
import json, sys
from pathlib import Path
print("| train.py run | img/s (last epoch) | data-wait (last epoch) |\n|---|---|---|")
for d in ("synthetic_compiled", "synthetic_cudagraphs", "synthetic_eager", "imagenet_folder"):
    path = Path(sys.argv[1]) / f"loop_{d}" / "summary.json"
    if not path.is_file():
        print(f"| {d} | missing ({path}) | - |")
        continue
    s = json.loads(path.read_text())
    wait = s.get("data_wait_fraction")
    print(f"| {d} | {s.get('images_per_sec') or 0:,.0f} | {'-' if wait is None else f'{wait:.1%}'} |")
EOF
    ;;
  train-side)
    # each row's train.log goes to $OUT/train_side; the folder is written once per machine (renamed into place whole);
    # ROW_TIMEOUT_S stops a row that hangs
    R=/tmp/train_side; F=$R/fakenet${SIDE_PER_CLASS:-320}; rm -rf "$R/runs" "$F.part"; mkdir -p "$R/runs" "$OUT/train_side"
    if [ ! -d "$F" ]; then
      python scripts/make_imagefolder.py "$F.part" --classes 64 --train-per-class ${SIDE_PER_CLASS:-320} --val-per-class 2 \
        --quality 90 --seed 0 > "$OUT/train_side/make_imagefolder.txt" 2>&1 && mv "$F.part" "$F" \
        || { echo "make_imagefolder.py failed: $OUT/train_side/make_imagefolder.txt"; exit 1; }
    fi
    # the same model and training recipe on data=synthetic, as scripts/bench_data.py composes its synthetic row
    S=$(python -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; from bench_data import \
synthetic_recipe; print(' '.join(synthetic_recipe(sys.argv[1:], Path('$R/synthetic'))))" $Q)
    G="$Q data.root=$F data.decode=gpu"
    T="python"; [ "$NPROC" -gt 1 ] && T="python -m torch.distributed.run --standalone --nproc-per-node $NPROC"
    printf '| train.py on %s GPU(s) (under MPS: %s) | last epoch |\n|---|---|\n' "$NPROC" "${MPS:-0}" > "$OUT/train_side.md"
    for row in ${SIDE_ROWS:-synthetic gpu_host}; do
      case $row in
        synthetic) cmd="$T train.py $S data=synthetic data.train_samples=$(( 64 * ${SIDE_PER_CLASS:-320} ))
                        data.val_samples=$(( 128 * NPROC )) data.num_classes=64" ;;
        gpu_host) cmd="$T train.py $G data.batch_ring=host" ;;
        gpu_ring) cmd="$T train.py $G data.batch_ring=gpu" ;;
        *) echo "unknown row $row (synthetic, gpu_host, gpu_ring)"; continue ;;
      esac
      timeout "${ROW_TIMEOUT_S:-900}" $cmd ${SIDE_ARGS:-} hydra.run.dir="$R/runs/$row" > "$OUT/train_side/$row.log" 2>&1
      rc=$?
      last=$(grep -h 'epoch 3/3' "$OUT/train_side/$row.log" | sed -n 's/.*, \([0-9]* img\/s[^,]*\).*/\1/p')
      echo "| $row | ${last:-no last epoch (exit $rc), see train_side/$row.log} |" | tee -a "$OUT/train_side.md"
    done ;;
  scaling)
    for mode in reduce-overhead default; do
      python scripts/bench_scaling.py --procs ${SCALING_PROCS:-1 2} --out "$OUT/scaling_$mode" -- \
        model="${SCALING_MODEL:-swin_tiny_patch4_window7_224}" train.batch_size="${SCALING_BATCH:-128}" \
        train.compile=true train.compile_mode=$mode ${SCALING_ARGS:-} 2>&1 | tee "$OUT/scaling_$mode.txt"
      cp "$OUT/scaling_$mode/scaling.md" "$OUT/scaling_$mode.md" 2>/dev/null
    done; true ;;
  fp8)
    # FP8 (torchao: carry its wheel in .whl) against bf16: each linear layer shape of Swin-B 224 and 384 in FP8
    # against bf16, the loss check on a task that learns, then the benchmark rows of Swin-T, Swin-B 224 and Swin-B
    # 384 with every layer FP8 takes in FP8 (train.fp8_layers=all: swin.precision.fp8_pays picks no Swin layer)
    python scripts/bench_fp8_linear.py --model swin_base_patch4_window7_224 --json "$OUT/fp8_linear_b224.json" 2>&1 |
      tee "$OUT/fp8_linear_b224.md"
    python scripts/bench_fp8_linear.py --model swin_base_patch4_window12_384 --batch 64 \
      --json "$OUT/fp8_linear_b384.json" 2>&1 | tee "$OUT/fp8_linear_b384.md"
    python scripts/check_fp8.py --out "$OUT/check_fp8" 2>&1 | tee "$OUT/check_fp8.txt"
    python scripts/benchmark.py grid=fp8 out_dir="$OUT/fp8_swin_t" ${E2E_BUDGET_S:+time_budget_s=$E2E_BUDGET_S}
    python scripts/benchmark.py grid=fp8 model=swin_base_patch4_window7_224 out_dir="$OUT/fp8_swin_b224" \
      ${E2E_BUDGET_S:+time_budget_s=$E2E_BUDGET_S}
    python scripts/benchmark.py grid=fp8 model=swin_base_patch4_window12_384 grid.batch_size=[64] \
      out_dir="$OUT/fp8_swin_b384" ${E2E_BUDGET_S:+time_budget_s=$E2E_BUDGET_S} ;;
  backbone)
    # features_only models at detection size, ours against timm's, CUDA graphs on both sides: Swin-T and the Swin-B
    # 384 weights (window 12) at 800x1216, Swin V2-T at 768x1280 (timm's V2 does not pad windows). Each model
    # compiles for minutes: BACKBONE_MODELS picks some of "t b384 v2t" (all by default) to fit a call.
    for m in ${BACKBONE_MODELS:-t b384 v2t}; do
      case $m in
        t) args="" ;;
        b384) args="model=swin_base_patch4_window12_384" ;;
        v2t) args="model=swinv2_tiny_window8_256 model.img_size=[768,1280]" ;;
        *) echo "BACKBONE_MODELS: unknown model '$m' (t, b384 or v2t)" >&2; exit 2 ;;
      esac
      python scripts/benchmark.py grid=backbone $args out_dir="$OUT/backbone_$m" \
        ${E2E_BUDGET_S:+time_budget_s=$E2E_BUDGET_S} ${BACKBONE_ARGS:-}
    done ;;
  data)
    # the pipeline's GPU tests, then the batched crop kernel on CUDA (its CPU tests run it in the interpreter)
    python -m pytest -q -m gpu --durations=5 tests/test_gpu_data.py tests/test_data.py tests/test_batch_ring.py 2>&1 \
      | tee "$OUT/gpu_data_tests.txt"
    python -m pytest -q -k crop_resize tests/test_gpu_data.py 2>&1 | tee -a "$OUT/gpu_data_tests.txt"
    # run dirs (checkpoints) stay in /tmp; their summary.json and train.log are copied to $OUT/data/runs
    R=/tmp/bench_data; rm -rf "$R/runs"
    python scripts/bench_data.py out_dir="$OUT/data" runs_dir="$R/runs" generate.dir="$R/fakenet" \
      ${DATA_BUDGET_S:+time_budget_s=$DATA_BUDGET_S} ${DATA_ARGS:-} 2>&1 | tee "$OUT/bench_data.txt"
    for d in "$R"/runs/train_*; do
      [ -d "$d" ] && mkdir -p "$OUT/data/runs/${d##*/}" \
        && cp "$d/summary.json" "$d/train.log" "$OUT/data/runs/${d##*/}/" 2>/dev/null
    done
    cp "$R"/runs/eval_*.json "$OUT/data/runs/" 2>/dev/null; true ;;
esac
