"""Two GPUs: nothing assumes GPU 0 (sparse layers on the second GPU while the first is the current
device give the CPU reference's results, bit for bit those of the first GPU, and load their kernels
there), and synchronised batch norm over two NCCL ranks is one batch norm over both ranks' voxels."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cupysparse.cuda import compile as kernel_compile  # noqa: E402
from cupysparse.adapters import torch as cst  # noqa: E402
from cupysparse.cuda.backend import gpu_available  # noqa: E402
from distributed_runs import assert_one_batch_norm_over_both_ranks, run_two_ranks  # noqa: E402
from gpu_cases import coordinates  # noqa: E402

import distributed_worker  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (gpu_available() and torch.cuda.is_available() and torch.cuda.device_count() >= 2),
                       reason="needs two CUDA GPUs"),
]


def layers(algorithm: str) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        cst.SubMConv3d(8, 16, 3, fwd_algo=algorithm, bwd_algo=algorithm),
        cst.SparseConv3d(16, 16, 2, stride=2, fwd_algo=algorithm, bwd_algo=algorithm),
        cst.SparseConvTranspose3d(16, 8, 2, stride=2, fwd_algo=algorithm, bwd_algo=algorithm),
    )


def run(model, coords, features, device, dtype):
    model = model.to(device, dtype)
    x = features.to(device, dtype, copy=True).requires_grad_(True)  # a leaf of its own on every call
    out = model(cst.SparseTensor(coords.to(device), x))
    pooled = cst.global_avg_pool(out)  # needs the batch size, counted on the tensor's GPU
    (out.features.square().sum() + pooled.sum()).backward()
    return [t.detach().double().cpu() for t in (out.features, pooled, x.grad, *(p.grad for p in model.parameters()))]


@pytest.mark.parametrize("algorithm, dtype, rtol", [("explicit_gemm", torch.float64, 1e-12),
                                                     ("implicit_gemm", torch.float32, 1e-4)])
def test_layers_on_the_second_gpu_while_the_first_is_current(algorithm, dtype, rtol):
    torch.cuda.set_device(0)
    coords = torch.from_numpy(coordinates(side=12, density=0.35))
    features = torch.from_numpy(np.random.default_rng(1).standard_normal((len(coords), 8)))
    reference = run(layers("explicit_gemm"), coords, features, "cpu", torch.float64)  # the CPU's algorithm
    loads_before = len(kernel_compile.module_loads())
    second = run(layers(algorithm), coords, features, "cuda:1", dtype)
    assert torch.cuda.current_device() == 0
    for got, expected in zip(second, reference):
        torch.testing.assert_close(got, expected, rtol=rtol, atol=rtol * float(expected.abs().max()))
    assert 1 in {load.device_id for load in kernel_compile.module_loads()[loads_before:]}
    if algorithm == "implicit_gemm":  # writes each output once: the same bits on either GPU
        first = run(layers(algorithm), coords, features, "cuda:0", dtype)
        for index in (0, 2):  # output and input gradient (the pooled sums are scattered with atomics)
            assert torch.equal(second[index], first[index])


@pytest.fixture(scope="module")
def batch_norm_runs_on_two_gpus(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("sync_batch_norm_cuda")
    run_two_ranks("sync_batch_norm_cuda", out_dir)
    return out_dir


@pytest.mark.parametrize("dtype_name, rtol", [("float64", 1e-10), ("float16", 1e-3)])
@pytest.mark.parametrize("case", sorted(distributed_worker.BATCH_NORM_ROWS))
def test_sync_batch_norm_over_two_gpus_is_one_batch_norm_over_their_voxels(batch_norm_runs_on_two_gpus, case,
                                                                           dtype_name, rtol):
    assert_one_batch_norm_over_both_ranks(batch_norm_runs_on_two_gpus, case, dtype_name, rtol=rtol, atol=rtol)
