#!/usr/bin/env bash
# The GPU machine's one-call check of cold start on one GPU: install offline; a fresh process's first
# MinkUNet18 forward on the demo's scene with every cache empty (NVRTC and tuning included); the
# shipped tuning cache of this GPU's architecture (cupysparse-populate-shipped-cache, written into the
# installed package and copied to $OUT, to be committed as cupysparse/shipped_caches/); the warm-up
# command into a fresh kernel cache, twice (the second compiles nothing); then the first forward of a
# fresh process with those warm kernels and the shipped tuning only. Results land in $OUT (or
# ./gpu-cold-start-results).
set -uo pipefail
out=$(mkdir -p "${OUT:-gpu-cold-start-results}" && cd "${OUT:-gpu-cold-start-results}" && pwd)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation . || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_steps.sh"  # step, status
cd "$(mktemp -d)"  # import the installed package, not the checkout
scratch=$(mktemp -d)
step cold_start env CUPY_CACHE_DIR="$scratch/kernels-cold" CUPYSPARSE_BENCHMARK_CACHE_DIR="$scratch/tuning-cold" \
  CUPYSPARSE_SHIPPED_CACHE=0 python3 -m cupysparse.scripts.benchmark_cold_start
# The kernels the cold run compiled serve the tuning runs too.
step populate env CUPY_CACHE_DIR="$scratch/kernels-cold" python3 -m cupysparse.scripts.populate_shipped_cache
cp "$(python3 -c 'from cupysparse.shipped_cache import SHIPPED_CACHE_DIR; print(SHIPPED_CACHE_DIR)')"/*.msgpack "$out/"
step warmup env CUPY_CACHE_DIR="$scratch/kernels-warm" python3 -m cupysparse warmup
step warmup env CUPY_CACHE_DIR="$scratch/kernels-warm" python3 -m cupysparse warmup --compile-only
step cold_start env CUPY_CACHE_DIR="$scratch/kernels-warm" CUPYSPARSE_BENCHMARK_CACHE_DIR="$scratch/tuning-warm" \
  python3 -m cupysparse.scripts.benchmark_cold_start
echo "cold start check exit $status"
exit $status
