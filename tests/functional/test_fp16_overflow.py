"""fp16 data whose convolution exceeds fp16's range, through the functional API and the tuner's
real check: the call returns the reference's result (inf exactly where the exact sum is out of
range), warns once naming where, and caches nothing; data in range tunes as usual afterwards."""

import warnings

import numpy as np
import pytest

from cupysparse.functional import convolution as functional
from cupysparse.cuda.backend import cupy_module
from cupysparse.tuning.cache_file import default_cache
from cupysparse.geometry.sparse_tensor import SparseTensor
from cupysparse.tuning.tuner import default_tuner
from references import Grid, conv_gather

FP16_LARGEST = (2 - 2**-10) * 2**15  # 65504
VALUE = 5000.0  # exact in fp16; a voxel with n neighbours (itself included) gets n·5000


@pytest.fixture(autouse=True)
def measured_calls(tmp_path, monkeypatch):
    """A fresh cache, and the default tuner measuring even a single candidate (the CPU has one), so
    every call runs the tuner's check on its data."""
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CUPYSPARSE_AUTOTUNE", raising=False)
    monkeypatch.setattr(default_tuner(), "_measure_single", True)
    monkeypatch.setattr(default_tuner(), "_reported", set())
    default_tuner().forget_choices()
    yield
    default_tuner().forget_choices()


def block_scene() -> np.ndarray:
    """A 3x3x3 block of voxels, shuffled: corners have 8 neighbours (40000), edges 12 (60000), face
    centres 18 and the centre 27 (beyond 65504)."""
    cells = np.stack(np.meshgrid(*[np.arange(3)] * 3, indexing="ij"), axis=-1).reshape(-1, 3)
    cells = cells[np.random.default_rng(3).permutation(len(cells))]
    return np.concatenate([np.zeros((len(cells), 1), np.int64), cells], axis=1).astype(np.int32)


def exact_output(coordinates, features, weight) -> np.ndarray:
    grid = Grid.covering(1, coordinates, margin=1)
    dense = conv_gather(grid.scatter(coordinates, features.astype(np.float64)), grid, grid,
                        weight.astype(np.float64), (3, 3, 3), (1, 1, 1), (1, 1, 1))
    return grid.read(dense, coordinates)


def overflow_case():
    coordinates = block_scene()
    features = np.full((len(coordinates), 1), VALUE, np.float16)
    weight = np.ones((27, 1, 1), np.float16)
    exact = exact_output(coordinates, features, weight)
    beyond = np.abs(exact) > FP16_LARGEST
    assert 0 < beyond.sum() < beyond.size  # the case has both kinds of rows
    first_row = int(np.flatnonzero(beyond[:, 0])[0])
    return coordinates, features, weight, exact, beyond, first_row


def check_result(out_features, exact, beyond):
    out = np.asarray(out_features, dtype=np.float64)
    assert np.array_equal(np.isposinf(out), beyond)  # inf exactly where the exact sum is out of range
    np.testing.assert_array_equal(out[~beyond], exact[~beyond])  # n·5000 are exact in fp16


def run_overflowing_call(to_device, fwd_algo=None):
    coordinates, features, weight, exact, beyond, first_row = overflow_case()
    tensor = SparseTensor(to_device(coordinates), to_device(features))
    with pytest.warns(RuntimeWarning) as warned:
        out = functional.spatially_sparse_conv(tensor, to_device(weight), 3, fwd_algo=fwd_algo)
    (warning,) = [str(w.message) for w in warned if str(w.message).startswith("cupysparse")]  # NumPy warns too
    assert (f"overflow: the fp16 output exceeds {FP16_LARGEST:g} at row {first_row}, channel 0 "
            f"(and {int(beyond.sum()) - 1} more)") in warning
    assert "explicit_gemm runs" in warning
    check_result(out.features if not hasattr(out.features, "get") else out.features.get(), exact, beyond)
    assert default_cache().entries() == []

    with warnings.catch_warnings():  # the same data again: the same result, no second warning
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", "overflow encountered in cast", RuntimeWarning)  # NumPy's own
        again = functional.spatially_sparse_conv(tensor, to_device(weight), 3, fwd_algo=fwd_algo)
    check_result(again.features if not hasattr(again.features, "get") else again.features.get(), exact, beyond)
    assert default_cache().entries() == []

    in_range = SparseTensor(to_device(coordinates), to_device(np.ones_like(features)))
    functional.spatially_sparse_conv(in_range, to_device(weight), 3, fwd_algo=fwd_algo)
    assert [entry.namespace for entry in default_cache().entries("sparse_conv_forward")] == ["sparse_conv_forward"]


def test_fp16_overflow_on_the_cpu_returns_the_reference_result_and_warns_once_where():
    run_overflowing_call(lambda array: array)


@pytest.mark.gpu
@pytest.mark.gpu
def test_fp16_overflow_on_the_gpu_skips_every_candidate_and_returns_the_reference_result():
    run_overflowing_call(cupy_module().asarray, fwd_algo="all")
