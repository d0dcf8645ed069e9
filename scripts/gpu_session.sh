#!/usr/bin/env bash
# One device call per stage (each fits the device tool's 10-minute limit); results go to $OUT.
#   bash scripts/gpu_session.sh tests     # GPU tests of the kernels and the compiled model (bf16 included)
#   bash scripts/gpu_session.sh kernel    # launch sweep (SWIN_FW_* knobs), then the attention benchmark
#   bash scripts/gpu_session.sh e2e       # Swin-T end to end: default grid with profiling, then CUDA graphs
#   bash scripts/gpu_session.sh e2e-base  # Swin-B 224 and Swin-B 384 end to end
# Hydra is missing on the device machine: carry .whl (../shared/device-wheels/, see its README).
set -uo pipefail
case "${1:-}" in
  tests|kernel|e2e|e2e-base) ;;
  *) echo "usage: bash scripts/gpu_session.sh tests|kernel|e2e|e2e-base" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton, timm; print('torch', torch.__version__, 'triton', triton.__version__, 'timm', timm.__version__)"
case "${1:-}" in
  tests)
    python -m pytest -q tests/test_flash_window.py 2>&1 | tee "$OUT/gpu_tests.txt" ;;
  kernel)
    python scripts/tune_flash_window.py 2>&1 | tee "$OUT/tune.txt"
    python scripts/bench_attention.py --preset all --dtype bf16 fp32 --json "$OUT/bench_attention.json" ;;
  e2e)
    python scripts/benchmark.py out_dir="$OUT/swin_t" time_budget_s=300 profile.enabled=true
    python scripts/benchmark.py grid=cudagraphs out_dir="$OUT/swin_t_cudagraphs" time_budget_s=200 ;;
  e2e-base)
    python scripts/benchmark.py model=swin_base_patch4_window7_224 out_dir="$OUT/swin_b224" time_budget_s=240
    python scripts/benchmark.py model=swin_base_patch4_window12_384 grid.batch_size=[64] \
      out_dir="$OUT/swin_b384" time_budget_s=240 ;;
esac
