#!/usr/bin/env bash
# The GPU machine's side-by-side comparison of two trees: this checkout and BASELINE, a folder holding
# another version of the project (e.g. `mkdir .baseline && git archive COMMIT | tar -x -C .baseline`, an
# ignored folder carried along). Each is installed offline into a folder of its own; the host-overhead
# benchmark and the network benchmark then run in turns, tree after tree, ROUNDS times, so that a drift of
# the machine's speed hits both alike. spconv is installed from .peer/ when carried (see the peer-wheels
# tool), so the network benchmark compares both trees against it.
#
#   scripts/gpu_compare_trees.sh BASELINE [ROUNDS] [NETWORK_ROUNDS]
#
# Results land in $OUT (or ./compare-results): host_<tree>_<round>.csv, network_<tree>_<round>.csv, the
# logs, and summary.txt (each host row's median over the rounds per tree, and the network ratios).
set -uo pipefail
baseline=${1:?usage: scripts/gpu_compare_trees.sh BASELINE [ROUNDS] [NETWORK_ROUNDS]}
rounds=${2:-3}
network_rounds=${3:-2}
out=$(mkdir -p "${OUT:-compare-results}" && cd "${OUT:-compare-results}" && pwd)
repo=$(pwd)
baseline=$(cd "$baseline" && pwd) || exit 2
export PYTHONUNBUFFERED=1
peer=""
if [ -s .peer/peer.tar.xz ]; then
  mkdir -p /tmp/peer && tar -C /tmp/peer -xJf .peer/peer.tar.xz &&
    python3 -m pip install -q --no-index --no-deps --target /tmp/peer .peer/*.whl && peer=/tmp/peer
fi
for tree in baseline new; do
  source=$([ "$tree" = new ] && echo "$repo" || echo "$baseline")
  if [ ! -d "/tmp/tree-$tree/cupysparse" ]; then  # an install an earlier call on this machine made is kept
    python3 -m pip install -q --no-deps --no-build-isolation --target "/tmp/tree-$tree" "$source" || exit 1
  fi
done
run() {  # run TREE LOG COMMAND...: COMMAND with TREE's package first on the path, outside the checkout,
         # with a tuning cache of the tree's own (each reads its shipped file, neither the other's entries)
  local tree=$1 log=$2
  shift 2
  (cd /tmp && PYTHONPATH="/tmp/tree-$tree${peer:+:$peer}" CUPYSPARSE_BENCHMARK_CACHE_DIR="/tmp/tuning-$tree" "$@") 2>&1 |
    tee -a "$out/$log"
  return "${PIPESTATUS[0]}"
}
status=0
for round in $(seq "$rounds"); do
  for tree in baseline new; do
    run "$tree" "host_$tree.txt" python3 -m cupysparse.scripts.benchmark_host_overhead \
      --csv "$out/host_${tree}_${round}.csv" || status=1
  done
done
for round in $(seq "$network_rounds"); do
  for tree in baseline new; do
    run "$tree" "network_$tree.txt" python3 -m cupysparse.scripts.benchmark_network \
      --csv "$out/network_${tree}_${round}.csv" || status=1
  done
done
python3 - "$out" <<'SUMMARY' | tee "$out/summary.txt"
import csv, glob, os, statistics, sys
out = sys.argv[1]
def rows(pattern):
    found = []
    for path in sorted(glob.glob(os.path.join(out, pattern))):
        tree, round_ = os.path.basename(path).rsplit(".", 1)[0].split("_")[1:3]
        with open(path) as handle:
            found += [dict(row, tree=tree, round=round_) for row in csv.DictReader(handle)]
    return found
def medians(found, key, value):
    table = {}
    for row in found:
        table.setdefault((key(row), row["tree"]), []).append(float(row[value]))
    return {entry: statistics.median(values) for entry, values in table.items()}

def report(title, found, key, value):
    table = medians(found, key, value)
    print(title)
    for entry in dict.fromkeys(key(row) for row in found):
        baseline, new = table.get((entry, "baseline")), table.get((entry, "new"))
        ratio = f"{new / baseline:.3f}" if baseline and new else "-"
        print(f"  {entry:<48} baseline {baseline or float('nan'):9.3f}  new {new or float('nan'):9.3f}  new/baseline {ratio}")

host = rows("host_*.csv")
if host:
    report("host microseconds per call, median over the rounds", host, lambda r: f"{r['channels']} ch {r['call']}",
           "host_us")
network = rows("network_*.csv")
if network:
    report("network milliseconds, median over the rounds", network, lambda r: f"{r['phase']} {r['library']}", "ms")
    # Older trees name the column time_ratio, newer ones ratio_to_spconv.
    ours = [dict(r, time_ratio=r.get("ratio_to_spconv", r.get("time_ratio"))) for r in network
            if r["library"] == "cupysparse"]
    report("network time ratio to spconv in the same run", ours, lambda r: r["phase"], "time_ratio")
SUMMARY
exit $status
