#!/usr/bin/env bash
# The GPU machine's one-call check of the autotuner and its cache: install offline, populate the
# quick preset in auto mode (tuning time per configuration), the same grid in `all` mode (only the
# algorithms auto did not sweep are measured), auto tuning at 1M voxels, the inspector and the
# analysis, then fresh processes' first calls against the steady state (quick preset, then 1M voxels).
# Results land in $OUT (or ./gpu-tuner-results), the benchmark cache with them.
set -uo pipefail
out=$(mkdir -p "${OUT:-gpu-tuner-results}" && cd "${OUT:-gpu-tuner-results}" && pwd)
export PYTHONUNBUFFERED=1
export CUPYSPARSE_BENCHMARK_CACHE_DIR=/tmp/cupysparse-tuner-check-cache
python3 -m pip install -q --no-deps --no-build-isolation . || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/populate.txt"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_steps.sh"  # step, status
cd /tmp  # import the installed package, not the checkout
step populate python3 -m cupysparse.scripts.populate_benchmark_cache --preset quick
step populate python3 -m cupysparse.scripts.populate_benchmark_cache --preset quick --algo-mode all
step populate python3 -m cupysparse.scripts.populate_benchmark_cache --num-voxels 1M \
  --channels 32,32 64,64 128,128 256,256 --dtypes float16
step inspect python3 -m cupysparse.scripts.inspect_benchmark_cache
step inspect python3 -m cupysparse.scripts.inspect_benchmark_cache namespace=sparse_conv_forward
step inspect python3 -m cupysparse.scripts.analyze_autotune_cache --markdown --output "$out/analysis.md"
step first_call python3 -m cupysparse.scripts.benchmark_first_call --preset quick \
  --csv "$out/first_call.csv" --profile "$out/first_call.prof"
step first_call python3 -m cupysparse.scripts.benchmark_first_call --num-voxels 1M \
  --channels 32,32 64,64 128,128 256,256 --dtypes float16
cp "$CUPYSPARSE_BENCHMARK_CACHE_DIR/benchmark_cache_generic.msgpack" "$out/"
echo "tuner check exit $status"
exit $status
