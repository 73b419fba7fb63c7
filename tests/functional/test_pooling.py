"""Sparse pooling against a dense reference written here, forward and backward.

CPU: the voxels are laid into a dense box of row ids; every cell of the coarse box pools its window
(offsets written out per axis, empty cells absent rather than zero) with plain Python loops, and
the result is read at the library's output sites. Gradients are checked against analytic
references built from the reference's choices, and by finite differences in fp64. GPU
(`pytest -m gpu`): every operation and dtype equals the CPU path (exactly for max / argmax and
copies, to rounding for sums), and repeated runs are identical.
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from cupysparse.functional import pooling
from cupysparse.cuda.backend import cupy_module
from cupysparse.geometry.kernel_map import strided_map
from cupysparse.geometry.sparse_tensor import SparseTensor

# The offsets of one kernel axis, written out: odd sizes centred, even sizes lean positive.
AXIS_OFFSETS = {1: (0,), 2: (0, 1), 3: (-1, 0, 1), 4: (-1, 0, 1, 2)}
DTYPES = (np.float64, np.float32, np.float16, ml_dtypes.bfloat16)
CHANNELS = 3
BOX_SIDE = {2: 8, 3: 5}
OCCUPANCY = {2: 0.5, 3: 0.4}


def dtype_id(dtype):
    return np.dtype(dtype).name


def random_coords(spatial_dims, seed, num_batches=2):
    """About half the cells of a box straddling 0, per batch item, rows shuffled."""
    rng = np.random.default_rng(seed)
    side = BOX_SIDE[spatial_dims]
    rows = []
    for batch in range(num_batches):
        cells = np.argwhere(rng.random((side,) * spatial_dims) < OCCUPANCY[spatial_dims]) - side // 2
        rows.append(np.column_stack([np.full(len(cells), batch), cells]))
    coords = np.concatenate(rows).astype(np.int32)
    return coords[rng.permutation(len(coords))]


def random_tensor(spatial_dims, seed, dtype=np.float64, ties=False):
    coords = random_coords(spatial_dims, seed)
    rng = np.random.default_rng(seed + 100)
    values = rng.integers(-2, 3, (len(coords), CHANNELS)) if ties else rng.standard_normal((len(coords), CHANNELS))
    return SparseTensor(coords, values.astype(dtype))


def as_float64(array):
    array = array.get() if hasattr(array, "get") else array
    return np.asarray(array).astype(np.float64)


# --- the dense reference ---------------------------------------------------------------------------


class DenseRows:
    """Row ids of the voxels in a dense box per batch item (-1 where no voxel is)."""

    def __init__(self, coords):
        spatial = coords[:, 1:].astype(np.int64)
        self.low = spatial.min(axis=0)
        self.shape = spatial.max(axis=0) - self.low + 1
        self.rows = np.full((int(coords[:, 0].max()) + 1, *self.shape), -1)
        self.rows[(coords[:, 0], *(spatial - self.low).T)] = np.arange(len(coords))

    def row_at(self, batch, position) -> int:
        local = np.asarray(position) - self.low
        if (local < 0).any() or (local >= self.shape).any():
            return -1
        return int(self.rows[(batch, *local)])


class Window:
    """One coarse cell's pooling: its input rows in kernel order and, per channel, max / argmax / mean."""

    def __init__(self, rows, values):
        self.rows = rows
        channels = values.shape[1]
        self.max, self.argmax, self.mean = [0.0] * channels, [-1] * channels, [0.0] * channels
        for channel in range(channels):
            for row in rows:  # kernel order; strictly greater keeps the first of equal values
                if self.argmax[channel] < 0 or values[row, channel] > self.max[channel]:
                    self.max[channel], self.argmax[channel] = values[row, channel], row
            if rows:
                self.mean[channel] = sum(values[row, channel] for row in rows) / len(rows)


def reference_pooling(coords, values, kernel_size, stride, dilation):
    """Window of every cell of the coarse box covering the input, keyed by (batch, *q).

    Cell q pools the voxels at q·stride + dilation·o for the kernel offsets o, d0 slowest."""
    dense = DenseRows(coords)
    spatial_dims = coords.shape[1] - 1
    kernel_size, stride, dilation = (np.broadcast_to(v, spatial_dims) for v in (kernel_size, stride, dilation))
    offsets = list(itertools.product(*(AXIS_OFFSETS[int(n)] for n in kernel_size)))
    low = np.floor_divide(dense.low, stride)
    high = np.floor_divide(dense.low + dense.shape - 1, stride)
    windows = {}
    for batch in range(dense.rows.shape[0]):
        for q in itertools.product(*(range(lo, hi + 1) for lo, hi in zip(low, high))):
            rows = [dense.row_at(batch, np.asarray(q) * stride + dilation * np.asarray(o)) for o in offsets]
            windows[(batch, *q)] = Window([row for row in rows if row >= 0], values)
    return windows


def reference_at(windows, out_coords):
    return [windows[tuple(int(v) for v in row)] for row in out_coords]


def reference_max_backward(windows, grad_output, num_in):
    grad_in = np.zeros((num_in, grad_output.shape[1]))
    for i, window in enumerate(windows):
        for channel, row in enumerate(window.argmax):
            if row >= 0:
                grad_in[row, channel] += grad_output[i, channel]
    return grad_in


def reference_avg_backward(windows, grad_output, num_in):
    grad_in = np.zeros((num_in, grad_output.shape[1]))
    for i, window in enumerate(windows):
        for row in window.rows:
            grad_in[row] += grad_output[i] / len(window.rows)
    return grad_in


def finite_difference_gradient(function, features, grad_output, step=1e-6):
    """d/dx of Σ grad_output · function(x) by central differences, element by element."""
    gradient = np.zeros_like(features)
    for index in np.ndindex(features.shape):
        plus, minus = features.copy(), features.copy()
        plus[index] += step
        minus[index] -= step
        gradient[index] = np.sum(grad_output * (function(plus) - function(minus))) / (2 * step)
    return gradient


def tolerance(dtype):
    """Rounding of one output in `dtype` (sums accumulate in fp32 or fp64)."""
    dtype = np.dtype(dtype)
    if dtype == np.float64:
        return 1e-12
    return 1e-5 if dtype == np.float32 else 4 * float(ml_dtypes.finfo(dtype).eps)


# --- window pooling ---------------------------------------------------------------------------------

# (spatial_dims, kernel_size, stride, dilation)
WINDOW_CASES = [
    (2, 2, 2, 1), (2, 3, 2, 1), (2, 3, 1, 1), (2, 3, 2, 2), (2, (2, 3), (2, 1), 1),
    (3, 2, 2, 1), (3, 3, 2, 1), (3, 3, 1, 1), (3, (3, 2, 2), 2, 1),
]


def window_id(case):
    return "D{}-k{}-s{}-d{}".format(*case)


def pooled(case, seed=0, dtype=np.float64, ties=False):
    spatial_dims, kernel_size, stride, dilation = case
    tensor = random_tensor(spatial_dims, seed, dtype, ties)
    values = tensor.features.astype(np.float64)
    windows = reference_pooling(tensor.coordinates, values, kernel_size, stride, dilation)
    return tensor, windows


def check_out_coordinates(tensor, output, stride):
    stride = np.broadcast_to(stride, tensor.spatial_dims)
    expected = {(int(r[0]), *(int(v) // int(s) for v, s in zip(r[1:], stride))) for r in tensor.coordinates}
    assert {tuple(int(v) for v in row) for row in output.coordinates} == expected
    assert len(output.coordinates) == len(expected)
    assert output.tensor_stride == tuple(int(s) for s in stride)


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("case", WINDOW_CASES, ids=window_id)
def test_max_pool_matches_dense_reference(case, ties):
    _, kernel_size, stride, dilation = case
    tensor, windows = pooled(case, ties=ties)
    output, argmax = pooling.sparse_max_pool(tensor, kernel_size, stride, dilation, return_argmax=True)
    check_out_coordinates(tensor, output, stride)
    expected = reference_at(windows, output.coordinates)
    np.testing.assert_array_equal(output.features, [w.max for w in expected])
    np.testing.assert_array_equal(argmax, [w.argmax for w in expected])
    assert argmax.dtype == np.int32


@pytest.mark.parametrize("case", WINDOW_CASES, ids=window_id)
def test_avg_pool_matches_dense_reference(case):
    _, kernel_size, stride, dilation = case
    tensor, windows = pooled(case)
    output = pooling.sparse_avg_pool(tensor, kernel_size, stride, dilation)
    check_out_coordinates(tensor, output, stride)
    expected = reference_at(windows, output.coordinates)
    np.testing.assert_allclose(output.features, [w.mean for w in expected], rtol=1e-12, atol=1e-12)


def test_stride_defaults_to_kernel_size_and_empty_windows_give_zero():
    """Kernel 3, stride 3: the voxel (2, 2) creates output (0, 0), whose window 3·0 + {-1, 0, 1}
    holds no voxel; output (1, 1) pools 3 + {-1, 0, 1}, all three voxels."""
    coords = np.array([[0, 2, 2], [0, 3, 3], [0, 4, 3]], dtype=np.int32)
    tensor = SparseTensor(coords, np.array([[5.0], [-1.0], [-3.0]]))
    output, argmax = pooling.sparse_max_pool(tensor, 3, return_argmax=True)
    averaged = pooling.sparse_avg_pool(tensor, 3)
    assert output.tensor_stride == averaged.tensor_stride == (3, 3)
    np.testing.assert_array_equal(output.coordinates, [[0, 0, 0], [0, 1, 1]])
    np.testing.assert_array_equal(output.features[:, 0], [0.0, 5.0])
    np.testing.assert_array_equal(argmax[:, 0], [-1, 0])
    np.testing.assert_allclose(averaged.features[:, 0], [0.0, 1.0 / 3.0], rtol=1e-15)


@pytest.mark.parametrize("case", WINDOW_CASES, ids=window_id)
def test_window_gradients_match_analytic_reference(case):
    _, kernel_size, stride, dilation = case
    tensor, windows = pooled(case)
    output, argmax = pooling.sparse_max_pool(tensor, kernel_size, stride, dilation, return_argmax=True)
    expected = reference_at(windows, output.coordinates)
    grad_output = np.random.default_rng(7).standard_normal(output.features.shape)
    grad_max = pooling.sparse_max_pool_backward(tensor, grad_output, argmax, kernel_size, stride, dilation)
    np.testing.assert_allclose(grad_max, reference_max_backward(expected, grad_output, tensor.num_points), rtol=1e-12)
    grad_avg = pooling.sparse_avg_pool_backward(tensor, grad_output, kernel_size, stride, dilation)
    np.testing.assert_allclose(grad_avg, reference_avg_backward(expected, grad_output, tensor.num_points), rtol=1e-12)


@pytest.mark.parametrize("case", [(2, 3, 2, 1), (3, 2, 2, 1), (2, (2, 3), (2, 1), 1)], ids=window_id)
def test_window_gradients_match_finite_differences(case):
    _, kernel_size, stride, dilation = case
    tensor = random_tensor(case[0], seed=3)

    def forward(pool):
        return lambda features: pool(tensor.replace_features(features), kernel_size, stride, dilation).features

    output, argmax = pooling.sparse_max_pool(tensor, kernel_size, stride, dilation, return_argmax=True)
    grad_output = np.random.default_rng(8).standard_normal(output.features.shape)
    for pool, gradient in (
        (pooling.sparse_max_pool, pooling.sparse_max_pool_backward(tensor, grad_output, argmax, kernel_size, stride, dilation)),
        (pooling.sparse_avg_pool, pooling.sparse_avg_pool_backward(tensor, grad_output, kernel_size, stride, dilation)),
    ):
        numeric = finite_difference_gradient(forward(pool), tensor.features, grad_output)
        np.testing.assert_allclose(gradient, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spatial_dims", [2, 3])
def test_every_dtype_matches_the_reference(spatial_dims, dtype):
    case = (spatial_dims, 3, 2, 1)
    tensor, windows = pooled(case, seed=5, dtype=dtype)
    output, argmax = pooling.sparse_max_pool(tensor, 3, 2, return_argmax=True)
    expected = reference_at(windows, output.coordinates)
    assert output.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(output.features.astype(np.float64), [w.max for w in expected])
    np.testing.assert_array_equal(argmax, [w.argmax for w in expected])
    averaged = pooling.sparse_avg_pool(tensor, 3, 2)
    assert averaged.dtype == np.dtype(dtype)
    tol = tolerance(dtype)
    np.testing.assert_allclose(averaged.features.astype(np.float64), [w.mean for w in expected], rtol=tol, atol=tol)
    grad_output = np.random.default_rng(9).standard_normal(output.features.shape).astype(dtype)
    grad64 = grad_output.astype(np.float64)
    grad_max = pooling.sparse_max_pool_backward(tensor, grad_output, argmax, 3, 2)
    grad_avg = pooling.sparse_avg_pool_backward(tensor, grad_output, 3, 2)
    assert grad_max.dtype == grad_avg.dtype == np.dtype(dtype)
    np.testing.assert_allclose(
        grad_max.astype(np.float64), reference_max_backward(expected, grad64, tensor.num_points), rtol=tol, atol=tol
    )
    np.testing.assert_allclose(
        grad_avg.astype(np.float64), reference_avg_backward(expected, grad64, tensor.num_points), rtol=tol, atol=tol
    )


def test_nan_propagates_through_max_pooling():
    coords = np.array([[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1], [0, 2, 0]], dtype=np.int32)
    features = np.array([[1.0, np.nan], [np.nan, 2.0], [3.0, np.nan], [0.0, 0.0], [np.nan, 1.0]])
    output, argmax = pooling.sparse_max_pool(SparseTensor(coords, features), 2, return_argmax=True)
    # Windows: rows 0..3 (offsets (0,0), (0,1), (1,0), (1,1)) and row 4 alone.
    np.testing.assert_array_equal(argmax, [[1, 0], [4, 4]])
    assert np.isnan(output.features[:, 0]).all() and np.isnan(output.features[0, 1]) and output.features[1, 1] == 1.0
    pooled_max, global_argmax = pooling.global_max_pool(SparseTensor(coords, features), return_argmax=True)
    np.testing.assert_array_equal(global_argmax, [[1, 0]])
    assert np.isnan(pooled_max).all()


# --- global pooling ---------------------------------------------------------------------------------


def reference_global(batch_index, values, batch_size):
    """Per batch item: max, argmax (the lowest row among equal maxima), mean, rows."""
    result = []
    for batch in range(batch_size):
        rows = [r for r in range(len(batch_index)) if batch_index[r] == batch]
        result.append(Window(rows, values))  # rows ascend, so "first" is the lowest row
    return result


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("spatial_dims", [2, 3])
def test_global_pooling_matches_reference(spatial_dims, ties):
    tensor = random_tensor(spatial_dims, seed=11, ties=ties)
    expected = reference_global(tensor.coordinates[:, 0], tensor.features, tensor.batch_size)
    pooled_max, argmax = pooling.global_max_pool(tensor, return_argmax=True)
    np.testing.assert_array_equal(pooled_max, [w.max for w in expected])
    np.testing.assert_array_equal(argmax, [w.argmax for w in expected])
    np.testing.assert_allclose(pooling.global_avg_pool(tensor), [w.mean for w in expected], rtol=1e-12)

    grad_output = np.random.default_rng(12).standard_normal((tensor.batch_size, CHANNELS))
    np.testing.assert_allclose(
        pooling.global_max_pool_backward(tensor, grad_output, argmax),
        reference_max_backward(expected, grad_output, tensor.num_points),
        rtol=1e-12,
    )
    np.testing.assert_allclose(
        pooling.global_avg_pool_backward(tensor, grad_output),
        reference_avg_backward(expected, grad_output, tensor.num_points),
        rtol=1e-12,
    )


def test_global_gradients_match_finite_differences():
    tensor = random_tensor(2, seed=13)
    grad_output = np.random.default_rng(14).standard_normal((tensor.batch_size, CHANNELS))
    _, argmax = pooling.global_max_pool(tensor, return_argmax=True)
    for pool, gradient in (
        (pooling.global_max_pool, pooling.global_max_pool_backward(tensor, grad_output, argmax)),
        (pooling.global_avg_pool, pooling.global_avg_pool_backward(tensor, grad_output)),
    ):
        numeric = finite_difference_gradient(
            lambda features, pool=pool: pool(tensor.replace_features(features)), tensor.features, grad_output
        )
        np.testing.assert_allclose(gradient, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_global_pooling_every_dtype_and_empty_batch_items(dtype):
    rng = np.random.default_rng(15)
    batch_index = rng.choice(np.array([0, 1], dtype=np.int32), 80)  # batch items 2 and 3 stay empty
    features = rng.standard_normal((80, CHANNELS)).astype(dtype)
    expected = reference_global(batch_index, features.astype(np.float64), 4)
    pooled_max, argmax = pooling.global_pool_forward(features, batch_index, 4, "max")
    pooled_avg, no_argmax = pooling.global_pool_forward(features, batch_index, 4, "avg")
    assert no_argmax is None and pooled_max.dtype == pooled_avg.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(pooled_max.astype(np.float64), [w.max for w in expected])
    np.testing.assert_array_equal(argmax, [w.argmax for w in expected])
    assert (argmax[2:] == -1).all() and (pooled_max[2:].astype(np.float64) == 0).all()
    tol = tolerance(dtype)
    np.testing.assert_allclose(pooled_avg.astype(np.float64), [w.mean for w in expected], rtol=tol, atol=tol)
    grad_output = np.random.default_rng(17).standard_normal((4, CHANNELS)).astype(dtype)
    grad_max = pooling.global_pool_backward(grad_output, batch_index, "max", argmax)
    grad_avg = pooling.global_pool_backward(grad_output, batch_index, "avg")
    grad64 = grad_output.astype(np.float64)
    np.testing.assert_array_equal(grad_max.astype(np.float64), reference_max_backward(expected, grad64, 80))
    np.testing.assert_allclose(grad_avg.astype(np.float64), reference_avg_backward(expected, grad64, 80), rtol=tol, atol=tol)


# --- unpooling --------------------------------------------------------------------------------------


@pytest.mark.parametrize("stride", [2, (2, 1)], ids=str)
@pytest.mark.parametrize("seed", [20, 21])
def test_unpool_copies_the_parent_and_sums_children_gradients(stride, seed):
    tensor = random_tensor(2, seed)
    coarse = pooling.sparse_avg_pool(tensor, stride)
    fine = pooling.sparse_unpool(coarse, stride)
    assert fine.tensor_stride == (1, 1)
    np.testing.assert_array_equal(fine.coordinates, tensor.coordinates)
    steps = np.broadcast_to(stride, 2)
    parent_row = {tuple(int(v) for v in row): i for i, row in enumerate(coarse.coordinates)}
    parents = [parent_row[(int(r[0]), *(int(v) // int(s) for v, s in zip(r[1:], steps)))] for r in tensor.coordinates]
    np.testing.assert_array_equal(fine.features, coarse.features[parents])

    grad_output = np.random.default_rng(seed).standard_normal(fine.features.shape)
    expected = np.zeros(coarse.features.shape)
    for child, parent in enumerate(parents):
        expected[parent] += grad_output[child]
    np.testing.assert_allclose(pooling.sparse_unpool_backward(coarse, grad_output, stride), expected, rtol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_unpool_every_dtype_in_3d(dtype):
    tensor = random_tensor(3, seed=22, dtype=dtype)
    coarse = pooling.sparse_max_pool(tensor, 2)
    fine = pooling.sparse_unpool(coarse, 2)
    assert fine.dtype == np.dtype(dtype)
    parent_row = {tuple(int(v) for v in row): i for i, row in enumerate(coarse.coordinates)}
    parents = [parent_row[(int(r[0]), *(int(v) // 2 for v in r[1:]))] for r in tensor.coordinates]
    np.testing.assert_array_equal(fine.features.astype(np.float64), coarse.features[parents].astype(np.float64))
    # Max pooling then unpooling: every voxel sees its window's maximum, which it never exceeds.
    assert (fine.features.astype(np.float64) >= tensor.features.astype(np.float64)).all()


def test_unpool_refuses_strides_whose_map_misses_parents():
    tensor = random_tensor(2, seed=23)
    coarse = pooling.sparse_max_pool(pooling.sparse_max_pool(tensor, 2), 2)
    with pytest.raises(ValueError, match="strides of 1 or 2"):
        pooling.sparse_unpool(coarse, 4)
    _, forward = strided_map(tensor.coordinates, 2, 2)
    with pytest.raises(ValueError, match="transposed"):
        pooling.unpool_forward(np.zeros((forward.num_in, 1)), forward)


# --- empty input and argument checks ---------------------------------------------------------------


@pytest.mark.parametrize("spatial_dims", [2, 3])
def test_empty_input_gives_empty_outputs(spatial_dims):
    tensor = SparseTensor(np.empty((0, 1 + spatial_dims), np.int32), np.empty((0, CHANNELS), np.float32))
    output, argmax = pooling.sparse_max_pool(tensor, 2, return_argmax=True)
    assert output.features.shape == argmax.shape == (0, CHANNELS)
    grad = pooling.sparse_max_pool_backward(tensor, output.features, argmax, 2)
    assert grad.shape == (0, CHANNELS) and grad.dtype == np.float32
    assert pooling.sparse_avg_pool(tensor, 3, 2).features.shape == (0, CHANNELS)
    assert pooling.sparse_avg_pool_backward(tensor, output.features, 3, 2).shape == (0, CHANNELS)
    assert pooling.global_max_pool(tensor).shape == pooling.global_avg_pool(tensor).shape == (0, CHANNELS)
    assert pooling.sparse_unpool(output, 2).features.shape == (0, CHANNELS)
    features = np.empty((0, CHANNELS), np.float32)
    pooled, argmax = pooling.global_pool_forward(features, np.empty(0, np.int32), 2, "max")
    np.testing.assert_array_equal(pooled, np.zeros((2, CHANNELS)))
    np.testing.assert_array_equal(argmax, np.full((2, CHANNELS), -1))


def test_invalid_arguments_are_named():
    tensor = random_tensor(2, seed=30)
    _, kernel_map = strided_map(tensor.coordinates, 2, 2)
    with pytest.raises(TypeError, match="features must be float64"):
        pooling.max_pool_forward(tensor.features.astype(np.int32), kernel_map)
    with pytest.raises(ValueError, match="features has 3 rows"):
        pooling.avg_pool_forward(tensor.features[:3], kernel_map)
    out, argmax = pooling.max_pool_forward(tensor.features, kernel_map)
    with pytest.raises(TypeError, match="argmax must be int32"):
        pooling.max_pool_backward(out, argmax.astype(np.int64), kernel_map)
    with pytest.raises(ValueError, match="grad_output has"):
        pooling.avg_pool_backward(out[1:], kernel_map)
    with pytest.raises(TypeError, match="kernel_map must be a KernelMap"):
        pooling.max_pool_forward(tensor.features, kernel_map.pair_table)
    batch_index = np.ascontiguousarray(tensor.coordinates[:, 0])
    with pytest.raises(ValueError, match="mode must be one of"):
        pooling.global_pool_forward(tensor.features, batch_index, 2, "sum")
    with pytest.raises(ValueError, match="batch_size must be a non-negative int"):
        pooling.global_pool_forward(tensor.features, batch_index, -1, "max")
    with pytest.raises(ValueError, match=r"batch_index must lie in \[0, 1\)"):
        pooling.global_pool_forward(tensor.features, batch_index, 1, "avg")
    with pytest.raises(ValueError, match="needs the argmax"):
        pooling.global_pool_backward(np.zeros((2, CHANNELS)), batch_index, "max")
    with pytest.raises(TypeError, match="input must be a SparseTensor"):
        pooling.sparse_avg_pool(tensor.features, 2)


# --- GPU == CPU -------------------------------------------------------------------------------------


def gpu_test(test):
    return pytest.mark.gpu(test)


GPU_CASES = [(2, 2, 2, 1), (2, 3, 2, 1), (3, 2, 2, 1), (3, 3, 2, 1), (3, 3, 1, 1), (3, 3, 2, 2)]


def gpu_tensor(spatial_dims, seed, dtype):
    """The same random tensor, with a few NaN, on the CPU and on the GPU."""
    cpu = random_tensor(spatial_dims, seed, dtype)
    rng = np.random.default_rng(seed)
    cpu.features[rng.integers(0, cpu.num_points, 3), rng.integers(0, CHANNELS, 3)] = np.nan
    return cpu, cpu.to("cuda")


def assert_sums_close(gpu, cpu, dtype):
    tol = tolerance(dtype)
    np.testing.assert_allclose(as_float64(gpu), as_float64(cpu), rtol=tol, atol=tol)


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", GPU_CASES, ids=window_id)
def test_gpu_window_pooling_equals_cpu(case, dtype):
    spatial_dims, kernel_size, stride, dilation = case
    cpu, gpu = gpu_tensor(spatial_dims, 40, dtype)
    cpu_out, cpu_argmax = pooling.sparse_max_pool(cpu, kernel_size, stride, dilation, return_argmax=True)
    gpu_out, gpu_argmax = pooling.sparse_max_pool(gpu, kernel_size, stride, dilation, return_argmax=True)
    np.testing.assert_array_equal(gpu_out.coordinates.get(), cpu_out.coordinates)
    assert gpu_out.dtype == cpu_out.dtype and gpu_argmax.dtype == np.int32
    np.testing.assert_array_equal(as_float64(gpu_out.features), as_float64(cpu_out.features))
    np.testing.assert_array_equal(gpu_argmax.get(), cpu_argmax)

    grad = np.random.default_rng(41).standard_normal(cpu_out.features.shape).astype(dtype)
    grad_gpu = cupy_module().asarray(grad)
    cpu_grad_max = pooling.sparse_max_pool_backward(cpu, grad, cpu_argmax, kernel_size, stride, dilation)
    gpu_grad_max = pooling.sparse_max_pool_backward(gpu, grad_gpu, gpu_argmax, kernel_size, stride, dilation)
    assert_sums_close(gpu_grad_max, cpu_grad_max, dtype)

    cpu_avg = pooling.sparse_avg_pool(cpu, kernel_size, stride, dilation).features
    gpu_avg = pooling.sparse_avg_pool(gpu, kernel_size, stride, dilation).features
    assert_sums_close(gpu_avg, cpu_avg, dtype)
    cpu_grad_avg = pooling.sparse_avg_pool_backward(cpu, grad, kernel_size, stride, dilation)
    gpu_grad_avg = pooling.sparse_avg_pool_backward(gpu, grad_gpu, kernel_size, stride, dilation)
    assert_sums_close(gpu_grad_avg, cpu_grad_avg, dtype)
    again = pooling.sparse_avg_pool_backward(gpu, grad_gpu, kernel_size, stride, dilation)
    np.testing.assert_array_equal(as_float64(again), as_float64(gpu_grad_avg))


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spatial_dims", [2, 3])
def test_gpu_unpooling_equals_cpu(spatial_dims, dtype):
    cpu, gpu = gpu_tensor(spatial_dims, 42, dtype)
    cpu_coarse, gpu_coarse = pooling.sparse_max_pool(cpu, 2), pooling.sparse_max_pool(gpu, 2)
    cpu_fine, gpu_fine = pooling.sparse_unpool(cpu_coarse, 2), pooling.sparse_unpool(gpu_coarse, 2)
    np.testing.assert_array_equal(gpu_fine.coordinates.get(), cpu_fine.coordinates)
    np.testing.assert_array_equal(as_float64(gpu_fine.features), as_float64(cpu_fine.features))
    grad = np.random.default_rng(43).standard_normal(cpu_fine.features.shape).astype(dtype)
    assert_sums_close(
        pooling.sparse_unpool_backward(gpu_coarse, cupy_module().asarray(grad), 2),
        pooling.sparse_unpool_backward(cpu_coarse, grad, 2),
        dtype,
    )


@gpu_test
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("num_rows, channels", [(300, 3), (60000, 40)])
def test_gpu_global_pooling_equals_cpu(num_rows, channels, dtype):
    """Batch item 2 of 4 is empty; 60000 rows use several splits per batch item and two channel tiles."""
    cupy = cupy_module()
    rng = np.random.default_rng(44)
    batch_index = rng.choice(np.array([0, 1, 3], dtype=np.int32), num_rows)
    features = rng.standard_normal((num_rows, channels)).astype(dtype)
    features[rng.integers(0, num_rows, 50)] = 8.0  # equal maxima across rows: the lowest row wins
    cpu_max, cpu_argmax = pooling.global_pool_forward(features, batch_index, 4, "max")
    gpu_max, gpu_argmax = pooling.global_pool_forward(cupy.asarray(features), cupy.asarray(batch_index), 4, "max")
    np.testing.assert_array_equal(as_float64(gpu_max), as_float64(cpu_max))
    np.testing.assert_array_equal(gpu_argmax.get(), cpu_argmax)
    cpu_avg, _ = pooling.global_pool_forward(features, batch_index, 4, "avg")
    gpu_avg, _ = pooling.global_pool_forward(cupy.asarray(features), cupy.asarray(batch_index), 4, "avg")
    assert_sums_close(gpu_avg, cpu_avg, dtype)
    again, _ = pooling.global_pool_forward(cupy.asarray(features), cupy.asarray(batch_index), 4, "avg")
    np.testing.assert_array_equal(as_float64(again), as_float64(gpu_avg))

    grad = rng.standard_normal((4, channels)).astype(dtype)
    for mode, cpu_state, gpu_state in (("max", cpu_argmax, gpu_argmax), ("avg", None, None)):
        cpu_grad = pooling.global_pool_backward(grad, batch_index, mode, cpu_state)
        gpu_grad = pooling.global_pool_backward(cupy.asarray(grad), cupy.asarray(batch_index), mode, gpu_state)
        assert gpu_grad.dtype == cpu_grad.dtype
        if mode == "max":  # a copy of the chosen row's gradient
            np.testing.assert_array_equal(as_float64(gpu_grad), as_float64(cpu_grad))
        else:
            assert_sums_close(gpu_grad, cpu_grad, dtype)
