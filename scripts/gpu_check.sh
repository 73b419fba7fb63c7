#!/usr/bin/env bash
# The GPU machine's one-call check: install offline, run the GPU tests, the benchmarks (arguments
# go to the convolution benchmark, e.g. --channels 32,64), the host-overhead benchmark, the demo and the
# network benchmark (with each library's costliest GPU operations and its host time).
# Results land in $OUT (or ./gpu-check-results). spconv is installed from .peer/ when carried
# there (see the peer-wheels tool), so the benchmark compares against it.
set -uo pipefail
out=$(mkdir -p "${OUT:-gpu-check-results}" && cd "${OUT:-gpu-check-results}" && pwd)
repo=$(pwd)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation . || exit 1
if [ -s .peer/peer.tar.xz ]; then
  mkdir -p /tmp/peer && tar -C /tmp/peer -xJf .peer/peer.tar.xz &&
    python3 -m pip install -q --no-index --no-deps --target /tmp/peer .peer/*.whl &&
    export PYTHONPATH=/tmp/peer${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
# Everything runs outside the checkout, so the installed package (with its mapped folders) is the
# one imported, not the source folder in the current directory.
cd /tmp
# Where pytest-xdist is installed the GPU tests run in up to 12 processes, a test file each, so that this whole
# check fits one call of a machine that limits a command's minutes.
workers=()
if python3 -c "import xdist" 2>/dev/null; then
  workers=(-n "$(( $(nproc) < 12 ? $(nproc) : 12 ))" --dist loadfile)
fi
python3 -m cupysparse info | tee -a "$out/device.txt"
python3 -m pytest -m "gpu and not alone" -q -p no:cacheprovider "${workers[@]}" --rootdir="$repo" -c "$repo/pyproject.toml" "$repo/tests" 2>&1 | tee "$out/pytest_gpu.txt"
tests_status=${PIPESTATUS[0]}
# The tests that measure GPU time run with the GPU to themselves.
python3 -m pytest -m "gpu and alone" -q -p no:cacheprovider --rootdir="$repo" -c "$repo/pyproject.toml" "$repo/tests" 2>&1 | tee -a "$out/pytest_gpu.txt"
tests_status=$(( tests_status || PIPESTATUS[0] ))
python3 -m cupysparse.scripts.benchmark_kernel_map 2>&1 | tee "$out/benchmark_kernel_map.txt"
bench_status=${PIPESTATUS[0]}
python3 -m cupysparse.scripts.benchmark_conv --csv "$out/benchmark_conv.csv" "$@" 2>&1 | tee "$out/benchmark_conv.txt"
bench_status=$(( bench_status || PIPESTATUS[0] ))
python3 -m cupysparse.scripts.benchmark_host_overhead --csv "$out/benchmark_host_overhead.csv" 2>&1 | tee "$out/benchmark_host_overhead.txt"
bench_status=$(( bench_status || PIPESTATUS[0] ))
python3 -m cupysparse.scripts.demo --train-steps 3 2>&1 | tee "$out/demo.txt"
bench_status=$(( bench_status || PIPESTATUS[0] ))
python3 -m cupysparse.scripts.benchmark_network --csv "$out/benchmark_network.csv" --kernels 12 --host 12 2>&1 | tee "$out/benchmark_network.txt"
bench_status=$(( bench_status || PIPESTATUS[0] ))
echo "gpu tests exit $tests_status, benchmark exit $bench_status"
exit $(( tests_status || bench_status ))
