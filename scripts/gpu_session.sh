#!/usr/bin/env bash
# One device call per stage (each fits the device tool's 10-minute limit); results go to $OUT.
#   bash scripts/gpu_session.sh tests     # GPU tests of the kernels and the compiled model (bf16 included)
#   bash scripts/gpu_session.sh kernel    # launch sweep (SWIN_FW_* knobs; TUNE_ARGS: its arguments), then the attention
#                                         # benchmark of every stage shape (KERNEL_DTYPES="bf16 fp32"; the paper's
#                                         # kernel from .paper/: carry it)
#   bash scripts/gpu_session.sh e2e       # Swin-T end to end: grid=compiled (CUDA graphs and default mode) with the breakdown
#                                         # (E2E_GRID=autotune: max-autotune against reduce-overhead;
#                                         # E2E_GRID=fused_gelu: inference with and without the GELU epilogue)
#   E2E_MODEL=384 bash scripts/gpu_session.sh e2e-base  # Swin-B 384 (or 224) end to end, grid=best
#   V2_MODEL=swinv2_base_window16_256 V2_BATCH=64 bash scripts/gpu_session.sh e2e-v2  # Swin V2 against timm's V2,
#                                         # grid=swinv2 (default: swinv2_tiny_window8_256, b64 and b128)
#   bash scripts/gpu_session.sh loop      # train.py against its own model step: compiled model step (benchmark),
#                                         # train.py on synthetic data compiled and eager, and the ImageNet recipe on
#                                         # a generated JPEG folder (~7 min on an H100); table in $OUT/loop.md
#   bash scripts/gpu_session.sh data      # GPU JPEG decoding (issue 15): the data pipeline's GPU tests, then
#                                         # scripts/bench_data.py on a generated ImageNet-shaped folder: loader img/s
#                                         # (CPU workers 1/4/all, nvJPEG), train.py with each and on synthetic data,
#                                         # eval.py top-1 with each decode path; table in $OUT/data/bench_data.md
#                                         # (DATA_ARGS: more overrides, e.g. "loader.cpu_workers=[16] loader.gpu_workers=[8]")
#   MPS=1 bash scripts/gpu_session.sh profile  # train.py's own GPU work and data wait per step over batches 200-239
#                                         # (scripts/profile_train_step.py), and its host time per part of the step
#                                         # over updates 330-469 (--host): the ImageNet recipe with data.decode=gpu,
#                                         # then the same recipe on synthetic data (PROFILE_ROWS="replay synthetic":
#                                         # the decoding run's workers doing no GPU work, scripts/train_replay.py;
#                                         # gpu_check160, synthetic_check160: check points every 160 updates, i.e.
#                                         # one device sync per epoch instead of one per log line, every 50 updates);
#                                         # PROFILE_ARGS: more overrides of the decode=gpu run (e.g. data.reprob=0);
#                                         # ~3 min a row; JSON in $OUT/profile_*.json; PROFILE_SPY=1 (py-spy's
#                                         # wheel in .whl): which thread holds the GIL after the window (4 s from
#                                         # batch 240 on: it slows the host window's updates)
#   bash scripts/gpu_session.sh contention  # GPU decoding in worker processes vs threads beside a CUDA-graph step
#                                         # waited for by device sync, event sync or event polling (--waits), with
#                                         # the CUDA API calls of a decoding thread; CONTENTION_ARGS="--processes":
#                                         # threads only (~3 min; "--side-stream" adds the side-stream rows)
#   bash scripts/gpu_session.sh nvjpeg-hw # the GPU's hardware JPEG decoders through nvJPEG (ctypes): rate, host time,
#                                         # pixels, step time beside them (scripts/probe_nvjpeg_hardware.py, ~2 min;
#                                         # NVJPEG_ARGS="--processes 1 4 8 --step swin": beside decoding processes)
# MPS=1 before any stage: the stage runs under an MPS daemon of its own (started before, stopped after), so that
# the CUDA contexts of several processes (data.decode=gpu's loader workers) share the GPU instead of time-slicing
#   bash scripts/gpu_session.sh augment   # the workers' augmentation kernels at each launch geometry
#                                         # (scripts/bench_augment_kernels.py), then one worker's GPU work per batch by
#                                         # kernel (bench_decode_contention.py --worker-profile: torchvision's RGB as
#                                         # train.py's workers, then data.gpu_ycbcr's planes); ~3 min
#   MPS=1 bash scripts/gpu_session.sh worker-cost  # train.py on synthetic data alone and beside 8 processes doing the
#                                         # decoding workers' GPU work, feeding nothing (scripts/bench_worker_cost.py;
#                                         # COST_ARGS="--variants worker no-host-copy ...": one run beside each;
#                                         # ~4 min, +~2 per variant after the first)
#   MPS=1 bash scripts/gpu_session.sh train-side  # train.py on data=synthetic, then on a generated folder through
#                                         # scripts/train_replay.py (the workers read files, no decoding or
#                                         # augmentation: the training process's own side) and with data.decode=gpu;
#                                         # last epoch's img/s of each in $OUT/train_side.md; ~8 min from cold
#                                         # (SIDE_ROWS: of synthetic replay gpu_host gpu_ring, the first three by
#                                         # default; SIDE_ARGS: overrides for every row, e.g. logger.log_every_steps=10)
#   bash scripts/gpu_session.sh gelu      # cuBLAS fc1, fc1 + GELU and fc1 with cuBLASLt's GELU epilogue at Swin-T's fc1
#                                         # shapes: times, errors vs float64 (scripts/bench_fc1_gelu.py;
#                                         # GELU_ARGS="--model base --batch 64 --dtype fp16")
# Hydra is missing on the device machine: carry .whl (../shared/device-wheels/, see its README).
set -uo pipefail
case "${1:-}" in
  tests|kernel|e2e|e2e-base|e2e-v2|loop|data|profile|contention|nvjpeg-hw|gelu|augment|worker-cost|train-side) ;;
  *) echo "usage: bash scripts/gpu_session.sh tests|kernel|e2e|e2e-base|e2e-v2|loop|data|profile|contention|nvjpeg-hw|gelu|augment|worker-cost|train-side" >&2
     exit 2 ;;
esac
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH  # PATH: scripts of wheels (py-spy)
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
python -c "import torch, triton, timm; print('torch', torch.__version__, 'triton', triton.__version__, 'timm', timm.__version__)"
case "${1:-}" in
  tests)
    # pytest-xdist (carry its wheel and execnet's in .whl): Triton compiles every case's kernels, on 8 cores at once.
    # The tests that touch the GPU: the kernel files, V2's flash tests and its CPB table under autocast (torch 2.11's dynamo
    # broke the graph there), the GELU epilogue's and the fused merge's (tests/test_mlp_act.py, tests/test_merge_norm.py:
    # test_gpu_*; tests/test_model.py runs on the CPU
    # only: its timm comparisons are CI's, 200 s of CPU each)
    python -m pytest -q -n 8 --durations=10 tests/test_flash_window.py tests/test_swinv2.py tests/test_mlp_act.py \
      tests/test_merge_norm.py \
      -k "flash or gpu or autocast" 2>&1 \
      | tee "$OUT/gpu_tests.txt"
    # the training step never syncs (CUDA sync debug mode), the side-stream loader and the batch ring keep batches intact
    python -m pytest -q -m gpu tests/test_train_guard.py tests/test_data.py tests/test_batch_ring.py 2>&1 | tee "$OUT/gpu_loop_tests.txt" ;;
  kernel)
    # the paper's kernel (github.com/zzd1992/FlashWindowAttention) is a row where it is carried in .paper/
    export FWA_PAPER_PATH=$PWD/.paper
    # TUNE_ARGS: the sweep's shapes and configs (e.g. --shapes swin_t_stage1 swin_t_stage3 --config "" --config
    # BWD_STAGES=2)
    eval "python scripts/tune_flash_window.py --profile ${TUNE_ARGS:---shapes swin_t_stage1 swin_t_stage2 swin_t_stage4 swin_b384_stage1}" \
      2>&1 | tee "$OUT/tune.txt"
    python scripts/bench_attention.py --preset stages --dtype ${KERNEL_DTYPES:-bf16} --backends sdpa flash_window paper \
      --json "$OUT/bench_attention.json" 2>&1 | tee "$OUT/bench_attention.txt" ;;
  e2e)
    # compiled rows, CUDA graphs and default mode for both sides, with the per-category GPU time breakdown
    python scripts/benchmark.py grid=${E2E_GRID:-compiled} profile.enabled=true profile.top_kernels=25 out_dir="$OUT/swin_t" \
      time_budget_s=${E2E_BUDGET_S:-430} ;;
  e2e-base)
    # one model per call (E2E_MODEL=224 or 384; both when unset, about 12 minutes: two device calls)
    if [ "${E2E_MODEL:-384}" = 384 ]; then
      python scripts/benchmark.py grid=best model=swin_base_patch4_window12_384 grid.batch_size=[64] \
        profile.enabled=true out_dir="$OUT/swin_b384" time_budget_s=${E2E_BUDGET_S:-330}
    fi
    if [ "${E2E_MODEL:-224}" = 224 ]; then
      python scripts/benchmark.py grid=best model=swin_base_patch4_window7_224 profile.enabled=true \
        out_dir="$OUT/swin_b224" time_budget_s=${E2E_BUDGET_S:-330}
    fi ;;
  e2e-v2)
    # one model per call; ours (flash_window, sdpa) against timm's V2 (explicit math), compiled, bf16
    M=${V2_MODEL:-swinv2_tiny_window8_256}
    python scripts/benchmark.py grid=swinv2 model=$M grid.batch_size=[${V2_BATCH:-64,128}] profile.enabled=true \
      profile.top_kernels=25 out_dir="$OUT/$M" time_budget_s=${E2E_BUDGET_S:-480} ;;
  loop)
    # run dirs (with their ~0.4 GB checkpoints) stay in /tmp; summary.json and train.log are copied to $OUT
    R=/tmp/loop; rm -rf "$R"; mkdir -p "$R"
    Q="logger.wandb.mode=disabled logger.progress=false train.save_every_epochs=0 train.eval_every=1000"
    python scripts/benchmark.py grid=loop out_dir="$OUT/loop_model" time_budget_s=0
    # Swin-T b128 bf16 as in the benchmark row, plus train.py's defaults: EMA, clip_grad 5, label smoothing;
    # 2 epochs of 200 steps (the summary's img/s and data-wait fraction are the last epoch's)
    S="model=swin_tiny_patch4_window7_224 data=synthetic data.train_samples=25600 data.val_samples=512
       train.batch_size=128 train.amp=bf16 train.epochs=2 train.warmup_epochs=1 train.lr=1e-4 $Q"
    python train.py $S train.compile=true hydra.run.dir="$R/synthetic_compiled"
    python train.py $S train.compile=true train.compile_mode=reduce-overhead hydra.run.dir="$R/synthetic_cudagraphs"
    python train.py $S train.compile=false hydra.run.dir="$R/synthetic_eager"
    # the official recipe (RandAugment, random erasing, mixup/cutmix) on ImageNet-shaped JPEGs, cores-1 workers;
    # 64 classes: 80 steps/epoch at b128 and 512 validation images (whole eval batches: no recompilation)
    python scripts/make_imagefolder.py "$R/fakenet" --classes 64 --train-per-class 160 --val-per-class 8
    python train.py experiment=imagenet_swin_tiny data.root="$R/fakenet" data.num_workers=$(( $(nproc) - 1 )) \
      train.batch_size=128 train.epochs=3 train.warmup_epochs=1 train.compile=true $Q hydra.run.dir="$R/imagenet_folder"
    for d in synthetic_compiled synthetic_cudagraphs synthetic_eager imagenet_folder; do
      mkdir -p "$OUT/loop_$d" && cp "$R/$d/summary.json" "$R/$d/train.log" "$OUT/loop_$d/" 2>/dev/null
    done
    python scripts/loop_report.py "$OUT" | tee "$OUT/loop.md" ;;
  profile)
    # 64 classes x 320 files: 160 steps per epoch, so batches 200-239 lie inside epoch 2 (past compilation)
    R=/tmp/profile; rm -rf "$R"/{gpu,gpu_check160,replay,synthetic,synthetic_check160}; mkdir -p "$R"
    python scripts/make_imagefolder.py "$R/fakenet" --classes 64 --train-per-class 320 --val-per-class 2 --seed 0 | tail -1
    Q="experiment=imagenet_swin_tiny train.batch_size=128 train.epochs=3 train.warmup_epochs=1 train.compile=true
       train.compile_mode=reduce-overhead train.save_every_epochs=0 train.save_every_steps=0 train.eval_every=1000
       logger.wandb.mode=disabled logger.progress=false"
    profile_run() {  # NAME TIMEOUT "FLAGS" OVERRIDES...: the profiled window and the host window, then (PROFILE_SPY=1,
      # py-spy carried in .whl) 4 s from the profiled window's end of which thread holds the GIL (py-spy --gil: only
      # GIL holders are sampled), per thread
      local name=$1 limit=$2 flags=$3; shift 3
      timeout "$limit" python scripts/profile_train_step.py $flags --host 330 470 --json "$OUT/profile_$name.json" -- "$@" \
        > "$R/$name.out" 2>&1 &
      local job=$!
      if [ "${PROFILE_SPY:-0}" = 1 ] && command -v py-spy >/dev/null; then
        until [ -f "$OUT/profile_$name.json" ] || ! kill -0 $job 2>/dev/null; do sleep 1; done
        local pid; pid=$(pgrep -P $job -f profile_train_step | head -1)
        [ -n "$pid" ] && py-spy record --gil --threads --nonblocking --format raw -r 200 -d 4 -p "$pid" \
          -o "$OUT/gil_$name.txt" >/dev/null 2>&1
      fi
      wait $job
      grep -E '^\{|epoch|rror' "$R/$name.out"
      [ -f "$OUT/gil_$name.txt" ] && python -c "
import collections, sys
threads = collections.Counter()
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(' ')
    threads[next((f for f in stack.split(';') if f.startswith('thread')), '?')[:60]] += int(n or 0)
total = sum(threads.values())
if not total:
    sys.exit('py-spy recorded no sample holding the GIL')
print('GIL held (share of samples with a holder):', ', '.join(f'{t} {n / total:.0%}' for t, n in threads.most_common(6)))
# only GIL holders are sampled: the samples against 4 s x 200 Hz are the share of time some thread held it (the
# training loop near 100% would be host-bound)
print(f'GIL held {total / 800:.0%} of the 4 s ({total} of 800 samples; fewer if py-spy fell behind)')
" "$OUT/gil_$name.txt"
    }
    # the same model and training recipe on data=synthetic, as scripts/bench_data.py composes its synthetic row
    S=$(python -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; from bench_data import \
synthetic_recipe; print(' '.join(synthetic_recipe(sys.argv[1:], Path('$R/synthetic'))))" $Q hydra.run.dir="$R/synthetic")
    G="$Q data.root=$R/fakenet data.decode=gpu data.num_workers=8"
    SYN="$S data=synthetic data.train_samples=20480 data.val_samples=128 data.num_classes=64"
    SPARSE="logger.log_every_steps=160"  # check points (device syncs): one per epoch
    for row in ${PROFILE_ROWS:-gpu synthetic}; do  # replay: the workers do no GPU work (scripts/train_replay.py)
      case $row in
        gpu) profile_run gpu 360 "" $G hydra.run.dir="$R/gpu" ${PROFILE_ARGS:-} ;;
        gpu_check160) profile_run gpu_check160 360 "" $G $SPARSE hydra.run.dir="$R/gpu_check160" ${PROFILE_ARGS:-} ;;
        replay) profile_run replay 300 --replay $G hydra.run.dir="$R/replay" ${PROFILE_ARGS:-} ;;
        synthetic) profile_run synthetic 200 "" $SYN ;;
        synthetic_check160) profile_run synthetic_check160 200 "" $SYN $SPARSE hydra.run.dir="$R/synthetic_check160" ;;
        *) echo "unknown profile row $row (gpu, gpu_check160, replay, synthetic, synthetic_check160)" ;;
      esac
    done ;;
  contention)
    python scripts/bench_decode_contention.py --trace ${CONTENTION_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/contention.md" ;;
  augment)
    python scripts/bench_augment_kernels.py 2>&1 | grep -v Warning | tee "$OUT/augment_kernels.md"
    for decoder in torchvision ycbcr; do  # a train.py worker's decoder, then the YCbCr planes (data.gpu_ycbcr=true)
      python scripts/bench_decode_contention.py --worker-profile --decoder $decoder 2>&1 | grep -v Warning \
        | tee "$OUT/worker_profile_$decoder.md"
    done ;;
  worker-cost)
    # train.py on synthetic data (the ImageNet recipe, as bench_data.py's synthetic row) alone, then beside 8 processes
    # doing the decoding workers' GPU work at the training speed, feeding nothing (scripts/bench_worker_cost.py)
    R=/tmp/worker_cost; rm -rf "$R"
    Q="experiment=imagenet_swin_tiny train.batch_size=128 train.epochs=3 train.warmup_epochs=1 train.compile=true
       train.compile_mode=reduce-overhead train.save_every_epochs=0 train.save_every_steps=0 train.eval_every=1000
       logger.wandb.mode=disabled logger.progress=false"
    S=$(python -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; from bench_data import \
synthetic_recipe; print(' '.join(synthetic_recipe(sys.argv[1:], Path('$R/synthetic'))))" $Q)
    python scripts/bench_worker_cost.py --workers 8 --rate 5800 ${COST_ARGS:-} --out "$R" -- python train.py $S \
      data=synthetic data.train_samples=20480 data.val_samples=128 data.num_classes=64 2>&1 | tee "$OUT/worker_cost.md" ;;
  train-side)
    # each row's train.log goes to $OUT/train_side; the folder is written once per machine (renamed into place whole)
    R=/tmp/train_side; rm -rf "$R/runs" "$R/fakenet.part"; mkdir -p "$R/runs" "$OUT/train_side"
    if [ ! -d "$R/fakenet" ]; then
      python scripts/make_imagefolder.py "$R/fakenet.part" --classes 64 --train-per-class 320 --val-per-class 2 \
        --quality 90 --seed 0 > "$OUT/train_side/make_imagefolder.txt" 2>&1 && mv "$R/fakenet.part" "$R/fakenet" \
        || { echo "make_imagefolder.py failed: $OUT/train_side/make_imagefolder.txt"; exit 1; }
    fi
    Q="experiment=imagenet_swin_tiny train.batch_size=128 train.epochs=3 train.warmup_epochs=1 train.compile=true
       train.compile_mode=reduce-overhead train.save_every_epochs=0 train.save_every_steps=0 train.eval_every=1000
       logger.wandb.mode=disabled logger.progress=false"
    S=$(python -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; from bench_data import \
synthetic_recipe; print(' '.join(synthetic_recipe(sys.argv[1:], Path('$R/synthetic'))))" $Q)
    G="$Q data.root=$R/fakenet data.decode=gpu data.num_workers=8"
    echo "| train.py (under MPS: ${MPS:-0}) | last epoch |" > "$OUT/train_side.md"; echo "|---|---|" >> "$OUT/train_side.md"
    for row in ${SIDE_ROWS:-synthetic replay gpu_host}; do
      case $row in
        synthetic) cmd="python train.py $S data=synthetic data.train_samples=20480 data.val_samples=128 data.num_classes=64" ;;
        replay) cmd="python scripts/train_replay.py $G" ;;
        gpu_host) cmd="python train.py $G data.batch_ring=host" ;;
        gpu_ring) cmd="python train.py $G data.batch_ring=gpu" ;;
        *) echo "unknown row $row"; continue ;;
      esac
      timeout 300 $cmd ${SIDE_ARGS:-} hydra.run.dir="$R/runs/$row" > "$OUT/train_side/$row.log" 2>&1
      rc=$?
      last=$(grep -h 'epoch 3/3' "$OUT/train_side/$row.log" | sed -n 's/.*, \([0-9]* img\/s\).*/\1/p')
      echo "| $row | ${last:-no last epoch (exit $rc), see train_side/$row.log} |" | tee -a "$OUT/train_side.md"
    done ;;
  gelu)
    python scripts/bench_fc1_gelu.py ${GELU_ARGS:-} 2>&1 | tee "$OUT/bench_fc1_gelu.md" ;;
  nvjpeg-hw)
    python scripts/probe_nvjpeg_hardware.py ${NVJPEG_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/nvjpeg_hw.md" ;;
  data)
    # each part bounded so that the stage fits one 10-minute call: tests <= 90 s, the benchmark <= 470 s (rows not
    # started after DATA_BUDGET_S are skipped; a running train.py/eval.py is stopped at the budget); ~6-7 min expected
    timeout 90 python -m pytest -q -m gpu --durations=5 tests/test_gpu_data.py tests/test_data.py tests/test_batch_ring.py 2>&1 \
      | tee "$OUT/gpu_data_tests.txt"
    # the batched crop kernel on CUDA (its CPU tests run it in the interpreter; the pipeline uses it only once these pass)
    timeout 60 python -m pytest -q -k crop_resize tests/test_gpu_data.py 2>&1 | tee -a "$OUT/gpu_data_tests.txt"
    # run dirs (checkpoints) stay in /tmp; their summary.json and train.log are copied to $OUT/data/runs
    R=/tmp/bench_data; rm -rf "$R/runs"
    timeout 470 python scripts/bench_data.py out_dir="$OUT/data" runs_dir="$R/runs" generate.dir="$R/fakenet" \
      time_budget_s=${DATA_BUDGET_S:-430} ${DATA_ARGS:-} 2>&1 | tee "$OUT/bench_data.txt"
    for d in "$R"/runs/train_*; do
      [ -d "$d" ] && mkdir -p "$OUT/data/runs/${d##*/}" && cp "$d/summary.json" "$d/train.log" "$OUT/data/runs/${d##*/}/" 2>/dev/null
    done
    cp "$R"/runs/eval_*.json "$OUT/data/runs/" 2>/dev/null; true ;;
esac
