"""examples/ddp_train.py on two CPU processes (Gloo), as torchrun starts it: ranks with different
scenes, the loss falling, and every rank ending with the same parameters and gradients."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp_train.py"


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="no Gloo backend")
def test_two_cpu_ranks_train_minkunet18_with_the_loss_falling_and_equal_parameters(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(EXAMPLE),
               "--device", "cpu", "--num-voxels", "2000", "--width", "0.25", "--steps", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUPYSPARSE_BENCHMARK_CACHE_DIR": str(tmp_path)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    counts = [int(n) for n in re.search(r"voxels per rank \[(\d+), (\d+)\]", out).groups()]
    assert counts[0] != counts[1]  # each rank its own scene
    losses = [float(loss) for loss in re.findall(r"^step \d/2  loss ([\d.]+)", out, re.MULTILINE)]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert "ranks agree: gradients yes, parameters yes" in out
