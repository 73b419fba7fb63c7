"""One rank of the two-process checks in test_torch_distributed.py (on the CPU, Gloo) and
test_torch_multi_gpu.py (scenarios ending in _cuda: a GPU per rank, NCCL), started by torchrun:
`python -m torch.distributed.run --standalone --nproc_per_node 2 distributed_worker.py SCENARIO OUT_DIR`.
Each rank writes what it computed to OUT_DIR; the test compares it with a reference computed in one
process."""

import json
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

# Rows per rank in each batch-norm case; 0 is a rank without voxels.
BATCH_NORM_ROWS = {"uneven": (7, 12), "one_empty": (9, 0)}
CHANNELS = 5


def batch_norm_inputs(case: str, rank: int, dtype=torch.float64):
    """Rank `rank`'s features and output gradient, and the shared affine parameters (seeded)."""
    rows = BATCH_NORM_ROWS[case][rank]
    generator = torch.Generator().manual_seed(100 * rank + len(case))
    features = (3.0 + 2.0 * torch.randn(rows, CHANNELS, generator=generator, dtype=torch.float64)).to(dtype)
    grad = torch.randn(rows, CHANNELS, generator=generator, dtype=torch.float64).to(dtype)
    shared = torch.Generator().manual_seed(7)
    weight = 1.0 + torch.rand(CHANNELS, generator=shared, dtype=torch.float64)
    bias = torch.randn(CHANNELS, generator=shared, dtype=torch.float64)
    return features, grad, weight, bias


# Feature and parameter dtypes of each device's runs: on CUDA also fp16 features with fp32
# parameters, as under autocast.
BATCH_NORM_DTYPES = {"cpu": {"float64": (torch.float64, torch.float64)},
                     "cuda": {"float64": (torch.float64, torch.float64), "float16": (torch.float16, torch.float32)}}


def sync_batch_norm(rank: int, out_dir: str, device: str = "cpu") -> None:
    from cupysparse.adapters import torch as cst

    target = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    for case in BATCH_NORM_ROWS:
        for name, (feature_dtype, parameter_dtype) in BATCH_NORM_DTYPES[device].items():
            features, grad, weight, bias = batch_norm_inputs(case, rank)
            batch_norm = cst.SparseBatchNorm(CHANNELS, momentum=0.1)
            model = cst.convert_sync_batchnorm(torch.nn.Sequential(batch_norm)).to(target, parameter_dtype)
            with torch.no_grad():
                model[0].weight.copy_(weight)
                model[0].bias.copy_(bias)
            coordinates = torch.zeros(len(features), 4, dtype=torch.int32)
            coordinates[:, 1] = torch.arange(len(features), dtype=torch.int32)
            features = features.to(target, feature_dtype).requires_grad_(True)
            output = model(cst.SparseTensor(coordinates.to(target), features)).features
            (output * grad.to(target, feature_dtype)).sum().backward()
            values = {"output": output.detach(), "grad_input": features.grad, "grad_weight": model[0].weight.grad,
                      "grad_bias": model[0].bias.grad, "running_mean": model[0].running_mean,
                      "running_var": model[0].running_var, "num_batches_tracked": model[0].num_batches_tracked}
            np.savez(os.path.join(out_dir, f"{case}_{name}_rank{rank}.npz"), type=type(model[0]).__name__,
                     **{key: value.cpu().double().numpy() for key, value in values.items()})


def share_tuning(rank: int, out_dir: str) -> None:
    from cupysparse.tuning import tuner as tuner_module
    from cupysparse.adapters import torch as cst
    from cupysparse.tuning.search_space import AlgorithmFilter
    from cupysparse.algorithms import CONV, ConvProblem
    from cupysparse.tuning.cache_file import default_cache
    from cupysparse.cuda.compile import source_digest

    def must_not_run(algorithm, params):
        raise AssertionError(f"rank {rank} measured {algorithm.name}")

    # No GPU here, and no graph capture: the tuner's capture check would ask CUDA.
    tuner_module._is_capturing = lambda problem: False
    space = AlgorithmFilter(CONV, "forward", "auto")
    shared = ConvProblem(200_000, 200_000, 32, 64, 27, np.dtype(np.float16), "cuda", 90, (1, 1, 1))
    own = ConvProblem(100_000, 100_000, 64, 64, 27, np.dtype(np.float16), "cuda", 90, (1, 1, 1))
    problems = {"shared": shared, "rank 1 only": own}
    for name, problem in problems.items():
        if name == "rank 1 only" and rank == 0:
            continue
        pool = tuner_module.candidates(space, problem)
        key = tuner_module.tuning_key(problem)
        for algorithm in dict.fromkeys(a for a, _ in pool):
            # Rank 0's measurements make the last candidate fastest, rank 1's the first.
            rows = [(a.name, params, float(len(pool) - index if rank == 0 else 1 + index))
                    for index, (a, params) in enumerate(pool) if a is algorithm]
            default_cache().put(algorithm.tuning_namespace("forward"), key, rows,
                                {(f, source_digest(f)) for f in algorithm.kernel_sources})

    def choices():
        tuner = tuner_module.default_tuner()
        found = {}
        for name, problem in problems.items():
            try:
                chosen = tuner.select(space, problem, must_not_run)
            except AssertionError:
                found[name] = None  # this rank has no measurement of it
                continue
            found[name] = [chosen.algorithm.name, repr(sorted(chosen.params.items()))]
        return found

    before = choices()
    stored = cst.share_tuning()
    after = choices()
    with open(os.path.join(out_dir, f"share_tuning_rank{rank}.json"), "w") as handle:
        json.dump({"before": before, "after": after, "stored": stored}, handle)


def main() -> int:
    scenario, out_dir = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    # Each rank a cache of its own, as on two machines: only the exchange can make them agree.
    os.environ["CUPYSPARSE_BENCHMARK_CACHE_DIR"] = os.path.join(out_dir, f"cache_rank{rank}")
    if scenario.endswith("_cuda"):  # one GPU per rank, NCCL
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo")
    scenarios = {"sync_batch_norm": sync_batch_norm, "share_tuning": share_tuning,
                 "sync_batch_norm_cuda": lambda rank, out_dir: sync_batch_norm(rank, out_dir, "cuda")}
    try:
        scenarios[scenario](rank, out_dir)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
