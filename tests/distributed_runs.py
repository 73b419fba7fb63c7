"""Two-rank runs of `distributed_worker` under torch.distributed.run, and the check that a synchronised
batch norm over both ranks is one batch norm over their voxels (shared by the CPU and the two-GPU tests)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import distributed_worker

WORKER = Path(distributed_worker.__file__)


def run_two_ranks(scenario: str, out_dir: Path, **environment: str) -> None:
    """`scenario` of `distributed_worker` on two ranks, with `environment` added to this process's."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
               scenario, str(out_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **environment}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def assert_one_batch_norm_over_both_ranks(out_dir: Path, case: str, dtype_name: str, rtol: float, atol: float):
    """Each rank's results of `case` are those of one BatchNorm1d (fp64) over both ranks' rows, the
    inputs rounded to the features' dtype; `atol` is relative to each compared array's largest value."""
    ranks = [np.load(out_dir / f"{case}_{dtype_name}_rank{rank}.npz") for rank in (0, 1)]
    assert all(str(r["type"]) == "SparseSyncBatchNorm" for r in ranks)
    rounded = getattr(torch, dtype_name)
    inputs = [[t.to(rounded).double() if i < 2 else t for i, t in enumerate(distributed_worker.batch_norm_inputs(
        case, rank))] for rank in (0, 1)]
    reference = torch.nn.BatchNorm1d(distributed_worker.CHANNELS, momentum=0.1).double()
    with torch.no_grad():
        reference.weight.copy_(inputs[0][2])
        reference.bias.copy_(inputs[0][3])
    features = torch.cat([features for features, *_ in inputs]).requires_grad_(True)
    output = reference(features)
    (output * torch.cat([grad for _, grad, *_ in inputs])).sum().backward()

    def close(got, expected):
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol * float(np.abs(expected).max(initial=0)))

    rows = np.cumsum([0] + [len(features) for features, *_ in inputs])
    for rank, result in enumerate(ranks):
        part = slice(rows[rank], rows[rank + 1])
        close(result["output"], output[part].detach().numpy())
        close(result["grad_input"], features.grad[part].numpy())
        close(result["running_mean"], reference.running_mean.numpy())
        close(result["running_var"], reference.running_var.numpy())
        assert int(result["num_batches_tracked"]) == 1
    # Each rank holds the gradient of its own loss; DDP's all-reduce would add them up.
    close(sum(r["grad_weight"] for r in ranks), reference.weight.grad.numpy())
    close(sum(r["grad_bias"] for r in ranks), reference.bias.grad.numpy())
