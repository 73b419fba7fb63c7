#!/usr/bin/env bash
# The GPU machine's one-call check of data-parallel training (two GPUs or more): install offline,
# compile MinkUNet18's kernels once for the machine, then examples/ddp_train.py under torchrun on one
# GPU and on two (each rank its own 200K-voxel room, fp16 autocast), and the tests that need two GPUs.
# Arguments go to the example (e.g. --steps 20). Results land in $OUT (or ./gpu-ddp-results).
set -uo pipefail
out=$(mkdir -p "${OUT:-gpu-ddp-results}" && cd "${OUT:-gpu-ddp-results}" && pwd)
repo=$(pwd)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation . || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_steps.sh"  # step, status
cd "$(mktemp -d)"  # import the installed package, not the checkout
step warmup python3 -m cupysparse warmup --networks minkunet18
step ddp python3 -m torch.distributed.run --standalone --nproc_per_node 1 "$repo/examples/ddp_train.py" "$@"
step ddp python3 -m torch.distributed.run --standalone --nproc_per_node 2 "$repo/examples/ddp_train.py" "$@"
step tests python3 -m pytest -m gpu -q -p no:cacheprovider --rootdir="$repo" -c "$repo/pyproject.toml" \
  "$repo/tests/adapters/test_torch_multi_gpu.py"
echo "ddp check exit $status"
exit $status
