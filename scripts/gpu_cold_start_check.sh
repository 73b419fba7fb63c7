#!/usr/bin/env bash
# The GPU machine's one-call check of cold start on one GPU: install offline; a fresh process's first
# MinkUNet18 forward on the demo's scene with every cache empty (NVRTC and tuning included); the
# shipped tuning cache of this GPU's architecture (cupysparse-populate-shipped-cache, written into the
# installed package and copied to $OUT, to be committed as cupysparse/shipped_caches/); the warm-up
# command into a fresh kernel cache, twice (the second compiles nothing); then the first forward of a
# fresh process with those warm kernels and the shipped tuning only, for the torch module and the
# framework-free network. Results land in $OUT (or ./gpu-cold-start-results).
#   --no-populate  measure with the shipped file as installed (minutes less: populating tunes every network on every scene)
#   --runs N       fresh processes per measurement (default 3): first forwards vary between processes
set -uo pipefail
populate=1
runs=3
while [ $# -gt 0 ]; do
  case "$1" in
    --no-populate) populate=0 ;;
    --runs) runs="$2"; shift ;;
    *) echo "usage: $0 [--no-populate] [--runs N]" >&2; exit 2 ;;
  esac
  shift
done
out=$(mkdir -p "${OUT:-gpu-cold-start-results}" && cd "${OUT:-gpu-cold-start-results}" && pwd)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation . || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_steps.sh"  # step, status
cd "$(mktemp -d)"  # import the installed package, not the checkout
scratch=$(mktemp -d)
for run in $(seq "$runs"); do
  step cold_start env CUPY_CACHE_DIR="$scratch/kernels-cold-$run" CUPYSPARSE_BENCHMARK_CACHE_DIR="$scratch/tuning-cold-$run" \
    CUPYSPARSE_SHIPPED_CACHE=0 python3 -m cupysparse.scripts.benchmark_cold_start
done
if [ "$populate" = 1 ]; then
  # The kernels the first cold run compiled serve the tuning runs too.
  step populate env CUPY_CACHE_DIR="$scratch/kernels-cold-1" python3 -m cupysparse.scripts.populate_shipped_cache
  cp "$(python3 -c 'from cupysparse.tuning.shipped import SHIPPED_CACHE_DIR; print(SHIPPED_CACHE_DIR)')"/*.msgpack "$out/"
fi
step warmup env CUPY_CACHE_DIR="$scratch/kernels-warm" python3 -m cupysparse warmup
step warmup env CUPY_CACHE_DIR="$scratch/kernels-warm" python3 -m cupysparse warmup --compile-only
for framework in torch cupy; do
  for run in $(seq "$runs"); do
    step cold_start env CUPY_CACHE_DIR="$scratch/kernels-warm" \
      CUPYSPARSE_BENCHMARK_CACHE_DIR="$scratch/tuning-warm-$framework-$run" \
      python3 -m cupysparse.scripts.benchmark_cold_start --framework "$framework"
  done
done
echo "cold start check exit $status"
exit $status
