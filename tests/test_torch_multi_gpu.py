"""Nothing assumes GPU 0: sparse layers on the second GPU while the first is the current device give
the CPU reference's results (and bit for bit those of the first GPU), and load their kernels there."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cupysparse import compile as kernel_compile  # noqa: E402
from cupysparse.adapters import torch as cst  # noqa: E402
from cupysparse.backend import gpu_available  # noqa: E402
from test_torch_adapter_gpu import coordinates  # noqa: E402

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
    x = features.to(device, dtype).requires_grad_(True)
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
    reference = run(layers(algorithm), coords, features, "cpu", torch.float64)
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
