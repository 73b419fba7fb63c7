#!/usr/bin/env bash
# Memory safety of the GPU tests in one call on the GPU machine: install offline, then run pytest under
# compute-sanitizer, memcheck over a selection of the GPU tests and racecheck over the tests of the
# kernels that use shared memory (implicit, WMMA and mma.sync GEMMs, depthwise wgrad, global pooling,
# the map formats' scans, radix sort and pair lists; the explicit algorithms' tests are left out: they
# launch CuPy's and cuBLAS's kernels, not ours).
#
#   scripts/sanitizer_check.sh [--tool memcheck|racecheck|synccheck|initcheck|both] [--select kernels|frameworks|all]
#                              [--shard I/N] [--skip-first K] [--budget SECONDS] [--pooled] [--no-install]
#                              [-k EXPRESSION]
#
# --select kernels (default): tests/algorithms/test_conv_algorithms_gpu.py, test_tf32_gpu.py, test_kernel_map.py,
#   test_pooling.py: every algorithm x dtype x phase (TF32 included) and every template instantiation of
#   the tuner's space, the maps in 2-4 D with their formats, depthwise and pooling, all on small inputs.
#   frameworks: every other GPU test (PyTorch and JAX adapters, networks, the fuzz suite, out of memory,
#   fp16 overflow, ...), with CUPYSPARSE_AUTOTUNE=0 (auto follows its rules and measures nothing: the
#   kernels selection covers the whole tuning space, and a sweep over every candidate per new shape made
#   these tests take minutes each under memcheck), and without the JAX tests of the `jnp` implementation:
#   it runs XLA's kernels only (its maps come from the kernels the `core` tests run), and XLA's
#   half-precision scatter-adds ran for many minutes under memcheck without finishing. all: both.
# --shard I/N takes every N-th test from the I-th; --skip-first K resumes a run that its budget stopped
#   (the summary prints the command). --budget (default 360) is the seconds in which tests may start,
#   split 60/40 between memcheck and racecheck under --tool both; a test started in time may finish
#   within a grace of 90 s more, then the tool is stopped.
# --pooled keeps CuPy's, PyTorch's and JAX's memory pools. By default they are off, so memcheck sees
#   every array's own bounds (a pool hands out blocks cut from larger allocations, where a read past an
#   array stays inside valid memory); tests marked pooled_memory (CUDA-graph capture, pool statistics,
#   pool and memory-fraction limits) need the pools and are deselected then.
# --no-install runs the package already installed: for shards started side by side after one install.
# Kernels are compiled with -lineinfo (CUPYSPARSE_NVRTC_LINEINFO=1, its own kernel-cache entries), so
# reports name source lines. Results land in $OUT (or ./sanitizer-results): <tool>.<pid>.log (the
# sanitizer's reports), <tool>_pytest.txt, <tool>_run.txt (counts) and summary.txt, one line per tool
# ("memcheck: ERROR SUMMARY: 0 errors; ..."). Exit status 0 only when every tool ran its whole selection
# with no sanitizer error and no failed test.
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

tool=both select=kernels shard=1/1 skip_first=0 budget=360 pooled=0 install=1 keyword=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tool) tool=${2:-}; shift 2 ;;
    --select) select=${2:-}; shift 2 ;;
    --shard) shard=${2:-}; shift 2 ;;
    --skip-first) skip_first=${2:-}; shift 2 ;;
    --budget) budget=${2:-}; shift 2 ;;
    --pooled) pooled=1; shift ;;
    --no-install) install=0; shift ;;
    -k) keyword=${2:-}; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
done
case "$tool" in memcheck|racecheck|synccheck|initcheck) tools=("$tool") ;; both) tools=(memcheck racecheck) ;;
  *) echo "--tool must be memcheck, racecheck, synccheck, initcheck or both, got '$tool'" >&2; exit 2 ;; esac
left_out_of_selection=""  # words of test names -k leaves out (racecheck adds "explicit")
case "$select" in
  kernels) files=(algorithms/test_conv_algorithms_gpu.py algorithms/test_tf32_gpu.py geometry/test_kernel_map.py geometry/test_map_formats.py
                  functional/test_pooling.py) ;;
  # New files go last: a shard keeps its tests' order, so a --skip-first from an older run still holds.
  frameworks) files=(adapters/test_torch_adapter_gpu.py adapters/test_jax_adapter.py networks/test_networks_gpu.py
                     functional/test_fuzz.py geometry/test_sparse_tensor.py cuda/test_compile.py scripts/test_info.py
                     cuda/test_out_of_memory.py functional/test_fp16_overflow.py adapters/test_torch_multi_gpu.py)
              left_out_of_selection=jnp
              export CUPYSPARSE_AUTOTUNE=0 ;;
  all) files=(.) ;;
  *) echo "--select must be kernels, frameworks or all, got '$select'" >&2; exit 2 ;;
esac
[[ "$shard" =~ ^[0-9]+/[0-9]+$ && "$skip_first" =~ ^[0-9]+$ && "$budget" =~ ^[0-9]+$ ]] ||
  { echo "--shard takes I/N, --skip-first and --budget whole numbers" >&2; exit 2; }

repo=$(pwd)
out=$(mkdir -p "${OUT:-sanitizer-results}" && cd "${OUT:-sanitizer-results}" && pwd)
sanitizer=${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer
[ -x "$sanitizer" ] || sanitizer=$(command -v compute-sanitizer) ||
  { echo "compute-sanitizer not found in ${CUDA_HOME:-/usr/local/cuda}/bin or on PATH" >&2; exit 1; }
export PYTHONUNBUFFERED=1
if [ "$install" = 1 ]; then python3 -m pip install -q --no-deps --no-build-isolation . || exit 1; fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; "$sanitizer" --version | tail -n 2; } |
  tee "$out/device.txt"

export CUPYSPARSE_NVRTC_LINEINFO=1
# Tuning under the sanitizer measures nothing worth keeping: a cache of its own.
CUPYSPARSE_BENCHMARK_CACHE_DIR=$(mktemp -d) && export CUPYSPARSE_BENCHMARK_CACHE_DIR
export PYTHONPATH="$repo/tests${PYTHONPATH:+:$PYTHONPATH}"  # the sanitizer_session plugin
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX leaves the memory to whoever allocates it
# XLA times candidate GEMM kernels of its own when it compiles; under the sanitizer every one of them
# is instrumented, which is slow and checks nothing of ours.
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_autotune_level=0"
marks="gpu and not huge"
plugin_flags=()
if [ "$pooled" = 0 ]; then
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1 XLA_PYTHON_CLIENT_ALLOCATOR=platform
  marks="$marks and not pooled_memory"
  plugin_flags+=(--raw-allocations)
fi

# Options this compute-sanitizer knows (older versions lack some): reports are kept short and about
# kernels (CUDA API errors, e.g. an out-of-memory a test provokes on purpose, are not memory errors).
help_text=$("$sanitizer" --help 2>&1)
optional() {  # optional OPTION VALUE: print both when the sanitizer knows OPTION
  if grep -q -- "$1" <<<"$help_text"; then printf '%s\n%s\n' "$1" "$2"; fi
}
mapfile -t common_options < <(optional --report-api-errors no; optional --show-backtrace device;
                              optional --target-processes all)
mapfile -t memcheck_options < <(optional --padding 1024)

cd /tmp  # import the installed package, not the checkout
paths=()
for file in "${files[@]}"; do paths+=("$repo/tests/$file"); done
grace=90
summary="$out/summary.txt"
: >"$summary"
status=0

run_tool() {  # run_tool TOOL SECONDS
  local name=$1 seconds=$2 keyword_expression=$keyword left_out=$left_out_of_selection
  [ "$name" = racecheck ] && left_out="$left_out explicit"
  for word in $left_out; do
    keyword_expression="not $word${keyword_expression:+ and ($keyword_expression)}"
  done
  local options=(--tool "$name" --error-exitcode 90 --print-limit 50 --log-file "$out/$name.%p.log"
                 "${common_options[@]}")
  [ "$name" = memcheck ] && options+=("${memcheck_options[@]}")
  rm -f "$out/$name".*.log "$out/${name}_run.txt"
  echo "== $name: --select $select --shard $shard --skip-first $skip_first, tests may start for $seconds s"
  local begin=$SECONDS
  timeout --kill-after=15 $((seconds + grace)) "$sanitizer" "${options[@]}" \
    python3 -m pytest -p sanitizer_session -p no:cacheprovider --rootdir="$repo" -c "$repo/pyproject.toml" \
    -m "$marks" ${keyword_expression:+-k "$keyword_expression"} -v -rfE --durations=20 \
    --shard "$shard" --skip-first "$skip_first" --time-budget "$seconds" --run-report "$out/${name}_run.txt" \
    "${plugin_flags[@]}" "${paths[@]}" 2>&1 | tee "$out/${name}_pytest.txt"
  local exit_code=${PIPESTATUS[0]} wall=$((SECONDS - begin))
  describe "$name" "$exit_code" "$wall"
}

total_of() {  # total_of SED_EXPRESSION FILES...: the sum of the numbers the expression prints
  local expression=$1
  shift
  cat "$@" 2>/dev/null | sed -nE "$expression" | awk '{ s += $1 } END { print s + 0 }'
}

describe() {  # describe TOOL EXIT_CODE WALL: append the tool's summary line, remember a failure
  local name=$1 exit_code=$2 wall=$3 line ok=1 errors hazards=0 race_warnings=0 summaries
  local logs=("$out/$name".*.log) report="$out/${name}_run.txt" run="?" selected="?" failed="?" not_run="?" resume=""
  summaries=$(cat "${logs[@]}" 2>/dev/null | grep -cE "(ERROR|RACECHECK) SUMMARY")
  errors=$(total_of 's/.*ERROR SUMMARY: ([0-9]+) error.*/\1/p' "${logs[@]}")
  if [ "$name" = racecheck ]; then
    hazards=$(total_of 's/.*RACECHECK SUMMARY: ([0-9]+) hazard.*/\1/p' "${logs[@]}")
    race_warnings=$(total_of 's/.*RACECHECK SUMMARY: .*[ (]([0-9]+) warnings?\).*/\1/p' "${logs[@]}")
    if ! cat "${logs[@]}" 2>/dev/null | grep -q "ERROR SUMMARY"; then  # this version sums up hazards only
      errors=$(total_of 's/.*RACECHECK SUMMARY: .*\(([0-9]+) errors?,.*/\1/p' "${logs[@]}")
    fi
  fi
  if [ -s "$report" ]; then
    run=$(sed -n 's/^run=//p' "$report")
    selected=$(sed -n 's/^selected=//p' "$report")
    failed=$(sed -n 's/^failed=//p' "$report")
    not_run=$(sed -n 's/^not_run=//p' "$report")
    resume=$(sed -n 's/^resume_skip_first=//p' "$report")
  fi
  if [ "$summaries" -gt 0 ]; then
    line="$name: ERROR SUMMARY: $errors errors"
  else
    # Stopped before the sanitizer summed up: count the reports written so far.
    errors=$(cat "${logs[@]}" 2>/dev/null |
      grep -cE '^========= (Invalid|Misaligned|Out-of-range|Error|Warning|Race|Barrier|Hardware|Address|Malloc)')
    line="$name: no ERROR SUMMARY (stopped), $errors error reports in the log"
    ok=0
  fi
  [ "$name" = racecheck ] && line="$line ($hazards hazards, of which $race_warnings warnings)"
  line="$line; tests run $run of $selected (shard $shard, first $skip_first skipped), failed $failed, not run $not_run"
  line="$line; exit $exit_code; $wall s"
  [ "$errors" = 0 ] && [ "$hazards" = 0 ] && [ "$failed" = 0 ] && [ "$not_run" = 0 ] && [ "$exit_code" = 0 ] || ok=0
  if [ -n "$resume" ]; then
    line="$line; resume: scripts/sanitizer_check.sh --tool $name --select $select --shard $shard --skip-first $resume"
    [ "$pooled" = 1 ] && line="$line --pooled"
    [ "$install" = 0 ] && line="$line --no-install"
    [ -n "$keyword" ] && line="$line -k '$keyword'"
  fi
  echo "$line" >>"$summary"
  if [ "$errors" != 0 ] || [ "$hazards" != 0 ]; then
    echo "  reports by kernel (first frame):" >>"$summary"
    cat "${logs[@]}" 2>/dev/null | sed -nE 's/^=========     at ([^ (]+).*/\1/p' | sort | uniq -c |
      sort -rn | head -n 20 | sed 's/^/    /' >>"$summary"
  fi
  [ "$ok" = 1 ] || status=1
}

if [ "${#tools[@]}" = 2 ]; then
  run_tool memcheck $((budget * 6 / 10))
  run_tool racecheck $((budget - budget * 6 / 10))
else
  run_tool "$tool" "$budget"
fi
echo "== summary ($summary)"
cat "$summary"
exit $status
