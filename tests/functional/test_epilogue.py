"""The inference epilogue `relu?(batch_norm(x) (+ residual))`: NumPy and the GPU kernel against the
formula in float64 over the same rounded inputs.

Both compute in fp32 (fp64 for fp64 features) and round once to the features' dtype, so a result is
within the dtype's epsilon of the value, plus fp32's rounding of the terms where they cancel."""

import numpy as np
import pytest

from cupysparse.functional import epilogue
from cupysparse.cuda.backend import cupy_module
from cupysparse.cuda.dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64
from tolerances import EPSILON

EPS = 1e-5
LOW_PRECISION = [FLOAT16] + ([BFLOAT16] if BFLOAT16 is not None else [])


def gpu_test(test):
    return pytest.mark.gpu(test)


def inputs(num_rows: int, channels: int, dtype, parameter_dtype, seed: int = 0) -> dict:
    """Features, residual and trained-looking statistics, rounded to their dtypes."""
    rng = np.random.default_rng(seed)
    features = (rng.standard_normal((num_rows, channels)) * 2 + 0.5).astype(dtype)
    residual = rng.standard_normal((num_rows, channels)).astype(dtype)
    statistics = {
        "running_mean": rng.uniform(-1, 1, channels), "running_var": rng.uniform(0.05, 3, channels),
        "weight": rng.uniform(-1.5, 1.5, channels), "bias": rng.uniform(-0.5, 0.5, channels),
    }
    return {"features": features, "residual": residual,
            **{name: value.astype(parameter_dtype) for name, value in statistics.items()}}


def float64_formula(features, residual, running_mean, running_var, weight, bias, relu: bool):
    """Batch norm as torch writes it, `(x − mean) / sqrt(var + eps) · weight + bias`, in float64; and
    the size of the terms an implementation adds, `|x · s| + |mean · s| + |bias| + |residual|` with
    `s = weight / sqrt(var + eps)`: where x is close to the mean, the first two cancel, and their
    rounding is what is left of the result."""
    wide = {name: None if value is None else np.asarray(value, dtype=np.float64)
            for name, value in dict(x=features, r=residual, mean=running_mean, var=running_var, w=weight,
                                    b=bias).items()}
    scale = (1.0 if wide["w"] is None else wide["w"]) / np.sqrt(wide["var"] + EPS)
    value = (wide["x"] - wide["mean"]) / np.sqrt(wide["var"] + EPS) * (1.0 if wide["w"] is None else wide["w"])
    magnitude = np.abs(wide["x"] * scale) + np.abs(wide["mean"] * scale)
    for term in (wide["b"], wide["r"]):
        if term is not None:
            value, magnitude = value + term, magnitude + np.abs(term)
    return (np.maximum(value, 0) if relu else value), magnitude


def assert_epilogue_close(got, expected, magnitude, dtype) -> None:
    eps = EPSILON[np.dtype(dtype).name]
    got = np.asarray(got, dtype=np.float64)
    np.testing.assert_array_less(np.abs(got - expected), eps * np.abs(expected) + eps * magnitude + 1e-300)


CASES = [  # (residual, relu, affine)
    (False, False, True), (False, True, True), (True, True, True), (True, False, False), (False, True, False),
]


def run_case(arrays: dict, residual: bool, relu: bool, affine: bool, xp=np):
    args = {name: xp.asarray(value) for name, value in arrays.items()}
    if not residual:
        args["residual"] = None
    if not affine:
        args["weight"] = args["bias"] = None
    got = epilogue.batch_norm_epilogue(args["features"], args["running_mean"], args["running_var"], args["weight"],
                                       args["bias"], EPS, residual=args["residual"], relu=relu)
    host = {name: None if value is None else (value.get() if xp is not np else value) for name, value in args.items()}
    expected, magnitude = float64_formula(host["features"], host["residual"], host["running_mean"],
                                          host["running_var"], host["weight"], host["bias"], relu)
    return got, expected, magnitude


@pytest.mark.parametrize("residual, relu, affine", CASES)
@pytest.mark.parametrize("dtype, parameter_dtype", [(FLOAT64, FLOAT64), (FLOAT32, FLOAT32)]
                         + [(dtype, parameter) for dtype in LOW_PRECISION for parameter in (dtype, FLOAT32)])
def test_numpy_equals_the_float64_formula(dtype, parameter_dtype, residual, relu, affine):
    arrays = inputs(300, 24, dtype, parameter_dtype)
    got, expected, magnitude = run_case(arrays, residual, relu, affine)
    assert got.dtype == dtype and got.shape == expected.shape
    assert_epilogue_close(got, expected, magnitude, dtype)
    if relu:
        assert (np.asarray(got, dtype=np.float64) >= 0).all() and (expected == 0).any()


def test_nan_stays_nan_through_the_relu_and_empty_features_give_an_empty_result():
    arrays = inputs(4, 3, FLOAT32, FLOAT32)
    arrays["features"][1, 2] = np.nan
    got = epilogue.batch_norm_epilogue(arrays["features"], arrays["running_mean"], arrays["running_var"], relu=True)
    assert np.isnan(got[1, 2]) and np.isfinite(np.delete(got.ravel(), 1 * 3 + 2)).all()
    empty = epilogue.batch_norm_epilogue(np.zeros((0, 3), np.float16), arrays["running_mean"], arrays["running_var"])
    assert empty.shape == (0, 3) and empty.dtype == np.float16


def test_bad_arguments_name_the_argument():
    arrays = inputs(5, 4, FLOAT32, FLOAT32)
    features, mean, var = arrays["features"], arrays["running_mean"], arrays["running_var"]
    with pytest.raises(ValueError, match="running_var has 3 channels but the features have 4"):
        epilogue.batch_norm_epilogue(features, mean, var[:3])
    with pytest.raises(ValueError, match="features must have 2 dimensions"):
        epilogue.batch_norm_epilogue(features[0], mean, var)
    with pytest.raises(TypeError, match="weight must be float64"):
        epilogue.batch_norm_epilogue(features, mean, var, weight=np.ones(4, np.int32))
    with pytest.raises(ValueError, match="residual must be fp32 of shape"):
        epilogue.batch_norm_epilogue(features, mean, var, residual=features[:4])
    with pytest.raises(TypeError, match="running_mean is required"):
        epilogue.batch_norm_epilogue(features, None, var)


def test_the_kernel_takes_parameters_of_the_features_dtype_or_float32():
    assert epilogue.kernel_runs(FLOAT16, FLOAT16) and epilogue.kernel_runs(FLOAT16, FLOAT32)
    assert epilogue.kernel_runs(FLOAT32, FLOAT32) and not epilogue.kernel_runs(FLOAT32, FLOAT16)
    assert not epilogue.kernel_runs(FLOAT64, FLOAT64)


# (rows, channels): 16-byte vectors of every dtype; channels no vector divides; a remainder of rows
# that leaves a thread fewer than ROWS_PER_THREAD.
GPU_SHAPES = [(1001, 32), (999, 20), (517, 3), (4096, 256)]


@gpu_test
@pytest.mark.parametrize("residual, relu, affine", CASES)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda shape: f"{shape[0]}x{shape[1]}")
@pytest.mark.parametrize("dtype, parameter_dtype", [(FLOAT32, FLOAT32)]
                         + [(dtype, parameter) for dtype in LOW_PRECISION for parameter in (dtype, FLOAT32)])
def test_gpu_kernel_equals_the_float64_formula(dtype, parameter_dtype, shape, residual, relu, affine):
    arrays = inputs(*shape, dtype, parameter_dtype, seed=shape[0])
    got, expected, magnitude = run_case(arrays, residual, relu, affine, cupy_module())
    assert got.dtype == dtype and got.shape == expected.shape
    assert_epilogue_close(got.get(), expected, magnitude, dtype)


@gpu_test
@pytest.mark.parametrize("dtype", [FLOAT32] + LOW_PRECISION)
def test_gpu_kernel_on_rows_not_aligned_for_vectors(dtype):
    """Features starting one element into a buffer (16-byte vectors would straddle, though the channel
    count allows them) and a residual view with a row stride: each element is read where it is."""
    cupy = cupy_module()
    arrays = inputs(641, 40, dtype, dtype, seed=3)
    buffer = cupy.asarray(np.concatenate([arrays["features"].ravel()[:1], arrays["features"].ravel()]))
    features = buffer[1:].reshape(arrays["features"].shape)
    assert features.data.ptr % epilogue.VECTOR_BYTES and features.flags.c_contiguous
    residual = cupy.asarray(np.concatenate([arrays["residual"], arrays["residual"]], axis=1))[:, :40]
    got = epilogue.batch_norm_epilogue(features, *(cupy.asarray(arrays[name]) for name in
                                                   ("running_mean", "running_var", "weight", "bias")),
                                       EPS, residual=residual, relu=True)
    expected, magnitude = float64_formula(arrays["features"], arrays["residual"], arrays["running_mean"],
                                          arrays["running_var"], arrays["weight"], arrays["bias"], True)
    assert_epilogue_close(got.get(), expected, magnitude, dtype)


@gpu_test
def test_gpu_kernel_sees_statistics_changed_in_place():
    """Nothing derived from the statistics is kept: an in-place update reaches the next call."""
    cupy = cupy_module()
    arrays = inputs(777, 64, FLOAT16, FLOAT32, seed=5)
    on_gpu = {name: cupy.asarray(value) for name, value in arrays.items()}
    for _ in range(2):
        got = epilogue.batch_norm_epilogue(on_gpu["features"], on_gpu["running_mean"], on_gpu["running_var"],
                                           on_gpu["weight"], on_gpu["bias"], EPS, relu=True)
        expected, magnitude = float64_formula(arrays["features"], None, arrays["running_mean"],
                                              arrays["running_var"], arrays["weight"], arrays["bias"], True)
        assert_epilogue_close(got.get(), expected, magnitude, FLOAT16)
        on_gpu["running_var"] *= 4
        arrays["running_var"] *= 4
