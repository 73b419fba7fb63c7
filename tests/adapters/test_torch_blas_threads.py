"""The PyTorch adapter holds NumPy's BLAS to one thread while the core runs on CPU tensors, and gives the
setting back afterwards, also when several Python threads run the core at once."""

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
threadpoolctl = pytest.importorskip("threadpoolctl")

from cupysparse.adapters import torch as cst
from cupysparse.adapters.torch import bridge
from cupysparse.adapters.torch.bridge import on_torch_stream, single_threaded_blas

import cupysparse
from cupysparse.algorithms.explicit_gemm import ExplicitGemm

OUTSIDE = 3  # a BLAS thread count the tests set around the adapter's calls, not 1


def blas_threads() -> list[int]:
    return [pool["num_threads"] for pool in threadpoolctl.threadpool_info() if pool["user_api"] == "blas"]


@pytest.fixture
def blas_outside():
    if not blas_threads():
        pytest.skip("NumPy has no BLAS that threadpoolctl controls")
    with threadpoolctl.threadpool_limits(limits=OUTSIDE, user_api="blas"):
        if set(blas_threads()) != {OUTSIDE}:
            pytest.skip(f"this BLAS cannot run {OUTSIDE} threads")
        yield


def test_a_cpu_convolution_and_its_gradients_run_the_gemms_on_one_blas_thread(blas_outside, monkeypatch):
    seen = []
    for phase in ("forward", "dgrad", "wgrad"):
        original = getattr(ExplicitGemm, phase)

        def recording(self, *args, _original=original, _phase=phase, **kwargs):
            seen.append((_phase, tuple(blas_threads())))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(ExplicitGemm, phase, recording)
    rng = np.random.default_rng(0)
    coordinates = np.concatenate([np.zeros((60, 1)), rng.permutation(np.mgrid[0:4, 0:5, 0:3].reshape(3, -1).T)],
                                 axis=1).astype(np.int32)
    features = torch.from_numpy(rng.standard_normal((60, 4)))
    torch.manual_seed(0)
    conv = cst.SubMConv3d(4, 5, 3, bias=False).double()
    x = cst.SparseTensor(torch.from_numpy(coordinates), features.clone().requires_grad_())
    out = conv(x).features
    out.sum().backward()

    assert [phase for phase, _ in seen] == ["forward", "dgrad", "wgrad"]
    assert all(set(threads) == {1} for _, threads in seen), seen
    assert set(blas_threads()) == {OUTSIDE}
    # The values are those of the core's own convolution, outside the adapter.
    core = cupysparse.SparseTensor(coordinates, features.numpy())
    expected = cupysparse.spatially_sparse_conv(core, conv.weight.detach().numpy(), 3)
    np.testing.assert_allclose(out.detach().numpy(), expected.features, rtol=1e-12, atol=1e-12)


class _RecordingPools:
    """Stands in for threadpoolctl's controller: the BLAS setting as a value, every change recorded.
    (OpenBLAS itself ignores a lower setting made from a thread other than the main one once the main
    thread has set it, so the interleaving below is checked on the adapter's bookkeeping.)"""

    def __init__(self, threads: int):
        self.threads, self.changes = threads, []

    def limit(self, limits: int):
        pools, original = self, self.threads

        class Limiter:
            def restore_original_limits(self):
                pools.threads = original
                pools.changes.append(original)

        self.threads = limits
        self.changes.append(limits)
        return Limiter()


def test_the_limit_is_held_until_the_last_thread_leaves_and_then_restored(monkeypatch):
    pools = _RecordingPools(OUTSIDE)
    monkeypatch.setattr(bridge, "_blas_pools", lambda: pools)
    first_inside, second_inside, first_left = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with on_torch_stream(torch.device("cpu")):
            first_inside.set()
            second_inside.wait(10)
        first_left.set()

    def second():
        first_inside.wait(10)
        with single_threaded_blas:
            second_inside.set()
            first_left.wait(10)
            seen["after the first left"] = pools.threads
        seen["after both left"] = pools.threads

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen == {"after the first left": 1, "after both left": OUTSIDE}
    assert pools.changes == [1, OUTSIDE]


def test_nested_calls_and_errors_restore_the_setting(blas_outside):
    with pytest.raises(RuntimeError, match="inside"), on_torch_stream(torch.device("cpu")):
        with on_torch_stream(torch.device("cpu")):
            assert set(blas_threads()) == {1}
        assert set(blas_threads()) == {1}
        raise RuntimeError("inside")
    assert set(blas_threads()) == {OUTSIDE}
