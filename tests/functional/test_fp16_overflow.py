"""fp16 data whose convolution exceeds fp16's range, through the functional API and the tuner's
real check: the call returns the reference's result (inf exactly where the exact sum is out of
range), warns once naming where, and caches nothing; data in range tunes as usual afterwards.
A CPU call the tuner does not measure reports it in the same words, in place of NumPy's warning."""

import logging
import warnings

import numpy as np
import pytest

from cupysparse.functional import convolution as functional
from cupysparse.cuda import precision
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
    monkeypatch.setattr(precision, "_reported_non_finite", set())
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
    # One warning, the tuner's: the algorithm's run of the reference does not report it again, nor NumPy.
    (warning,) = [str(w.message) for w in warned if str(w.message).startswith("cupysparse")]
    assert not [w for w in warned if "overflow encountered" in str(w.message)]
    assert (f"overflow: the fp16 output exceeds {FP16_LARGEST:g} at row {first_row}, channel 0 "
            f"(and {int(beyond.sum()) - 1} more)") in warning
    assert "explicit_gemm runs" in warning
    check_result(out.features if not hasattr(out.features, "get") else out.features.get(), exact, beyond)
    assert default_cache().entries() == []

    with warnings.catch_warnings():  # the same data again: the same result, no second warning
        warnings.simplefilter("error")
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


def recorded_warnings(call):
    """`call()`'s result and every warning it gave, NumPy's included."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        result = call()
    return result, [(w.category, str(w.message)) for w in warned]


def cpu_report(dtype: str, label: str, where: str) -> str:
    """What the CPU path warns: the words of the tuner's check (see `run_overflowing_call`), then why."""
    largest = {"fp16": FP16_LARGEST, "bf16": (2 - 2**-7) * 2**127}[dtype]
    return (f"cupysparse: overflow: the {dtype} {label} exceeds {largest:g} at {where}: the sum, accumulated in "
            f"fp32, is out of {dtype}'s range there; scale the inputs or weights down, or compute in a wider dtype")


def test_fp16_overflow_of_a_cpu_call_the_tuner_does_not_measure_is_reported_where_instead_of_by_numpy(
        monkeypatch, caplog):
    monkeypatch.setattr(default_tuner(), "_measure_single", False)  # as normal calls: one candidate, unmeasured
    coordinates, features, weight, exact, beyond, first_row = overflow_case()
    tensor = SparseTensor(coordinates, features)
    out, warned = recorded_warnings(lambda: functional.spatially_sparse_conv(tensor, weight, 3))
    where = f"row {first_row}, channel 0 (and {int(beyond.sum()) - 1} more)"
    assert warned == [(RuntimeWarning, cpu_report("fp16", "output", where))]
    check_result(out.features, exact, beyond)
    assert default_cache().entries() == []  # nothing was measured: the report is the algorithm's own

    with caplog.at_level(logging.INFO, logger="cupysparse.tuning"):  # again: the same result, a log line
        again, warned = recorded_warnings(lambda: functional.spatially_sparse_conv(tensor, weight, 3))
    assert warned == []
    assert caplog.messages == [cpu_report("fp16", "output", where)]
    check_result(again.features, exact, beyond)


def test_fp16_overflow_of_both_cpu_gradients_is_reported_where_instead_of_by_numpy(monkeypatch):
    monkeypatch.setattr(default_tuner(), "_measure_single", False)
    coordinates, features, weight, exact, beyond, first_row = overflow_case()
    tensor = SparseTensor(coordinates, features)
    # The map is symmetric and the weights ones: the input gradient sums what the output does, and each
    # offset's weight gradient (its pairs · 5000²) is beyond 65504 everywhere.
    gradients, warned = recorded_warnings(
        lambda: functional.spatially_sparse_conv_backward(features, tensor, weight, 3))
    assert warned == [
        (RuntimeWarning, cpu_report("fp16", "input gradient", f"row {first_row}, channel 0 "
                                                              f"(and {int(beyond.sum()) - 1} more)")),
        (RuntimeWarning, cpu_report("fp16", "weight gradient", "offset 0, input channel 0, output channel 0 "
                                                               "(and 26 more)")),
    ]
    check_result(gradients.input, exact, beyond)
    assert np.isposinf(gradients.weight).all() and gradients.weight.shape == (27, 1, 1)


def test_fp16_overflow_of_a_cpu_depthwise_call_is_reported_where_instead_of_by_numpy(monkeypatch):
    monkeypatch.setattr(default_tuner(), "_measure_single", False)
    coordinates, features, weight, exact, beyond, first_row = overflow_case()
    kernel_map = SparseTensor(coordinates, features).kernel_map(3).kernel_map
    out, warned = recorded_warnings(lambda: functional.spatially_sparse_depthwise_conv(
        features, weight[:, :, 0], kernel_map, kernel_map.num_out))
    assert warned == [(RuntimeWarning, cpu_report("fp16", "output", f"row {first_row}, channel 0 "
                                                                    f"(and {int(beyond.sum()) - 1} more)"))]
    check_result(out, exact, beyond)


def test_a_bf16_result_rounded_past_its_largest_value_and_an_fp16_nan_are_reported_where():
    bfloat16 = pytest.importorskip("ml_dtypes").bfloat16
    # 3.3999e38 is finite in fp32 but past the midpoint between bf16's largest value and 2^128: it rounds to inf.
    summed = np.array([[1.0, 2.0], [3.0, 3.3999e38]], np.float32)
    rounded, warned = recorded_warnings(lambda: precision.rounded_result(summed, bfloat16, "output"))
    assert warned == [(RuntimeWarning, cpu_report("bf16", "output", "row 1, channel 1"))]
    assert rounded.dtype == bfloat16 and rounded[0].tolist() == [1.0, 2.0] and np.isposinf(rounded[1, 1])

    summed = np.array([[np.nan, 1.0], [np.nan, 2.0]], np.float32)  # NaN in the inputs reach the result
    rounded, warned = recorded_warnings(lambda: precision.rounded_result(summed, np.float16, "input gradient"))
    assert warned == [(RuntimeWarning, "cupysparse: the fp16 input gradient is NaN at row 0, channel 0 "
                                       "(and 1 more): the inputs hold NaN or inf")]
    assert np.isnan(rounded[:, 0]).all() and rounded[:, 1].tolist() == [1.0, 2.0]
