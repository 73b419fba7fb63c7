"""SparseTensor: construction and validation, replace_features, to, to_dense, from_points.

Every test taking the `xp` fixture runs on NumPy and, on a GPU machine (`pytest -m gpu`), on CuPy.
References are plain Python loops and dicts, independent of the code under test.
"""

import gc
import math
import weakref

import numpy as np
import pytest

from cupysparse.cuda.backend import cupy_module, to_numpy
from cupysparse.geometry.coords import MAX_ROWS, key_layout
from cupysparse.geometry.kernel_map import KernelMapCache
from cupysparse.geometry.sparse_tensor import SparseTensor

GPU_MARKS = [pytest.mark.gpu]


def gpu_test(test):
    for mark in GPU_MARKS:
        test = mark(test)
    return test


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=GPU_MARKS)])
def xp(request):
    return np if request.param == "numpy" else cupy_module()


def random_unique_coordinates(rng, num_points, spatial_dims, batch_size, low=-6, high=6):
    """Distinct int32 coordinates with every batch index 0..batch_size-1 present."""
    seen = set()
    rows = [[batch] + [0] * spatial_dims for batch in range(batch_size)]
    seen.update(tuple(row) for row in rows)
    while len(rows) < num_points:
        row = [int(rng.integers(batch_size))] + [int(v) for v in rng.integers(low, high + 1, spatial_dims)]
        if tuple(row) not in seen:
            seen.add(tuple(row))
            rows.append(row)
    return np.array(rows, dtype=np.int32)


# --- construction ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spatial_dims", [2, 3, 4])
def test_construction_exposes_arrays_and_derived_properties(xp, spatial_dims):
    rng = np.random.default_rng(spatial_dims)
    coords_np = random_unique_coordinates(rng, 40, spatial_dims, batch_size=3)
    feats_np = rng.standard_normal((40, 5)).astype(np.float32)
    coords, feats = xp.asarray(coords_np), xp.asarray(feats_np)

    tensor = SparseTensor(coords, feats, tensor_stride=2)

    assert tensor.coordinates is coords and tensor.features is feats
    assert tensor.tensor_stride == (2,) * spatial_dims
    assert tensor.spatial_dims == spatial_dims
    assert tensor.num_points == len(tensor) == 40
    assert tensor.num_channels == 5
    assert tensor.dtype == np.float32
    assert tensor.device == ("cpu" if xp is np else "cuda")
    assert tensor.batch_size == 3


def test_negative_coordinates_and_per_axis_stride_are_valid():
    coords = np.array([[0, -5, 3, -7], [0, 4, -2, 0], [1, -1, -1, -1]], dtype=np.int32)
    tensor = SparseTensor(coords, np.ones((3, 2), np.float64), tensor_stride=(1, 2, 4))
    assert tensor.tensor_stride == (1, 2, 4)
    assert tensor.batch_size == 2


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_floating_feature_dtypes_are_accepted(dtype):
    tensor = SparseTensor(np.zeros((1, 4), np.int32), np.ones((1, 3), dtype))
    assert tensor.dtype == dtype


def test_bfloat16_features_are_accepted():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    tensor = SparseTensor(np.zeros((1, 4), np.int32), np.ones((1, 3), ml_dtypes.bfloat16))
    assert tensor.dtype.name == "bfloat16"


def test_empty_tensor_is_valid(xp):
    tensor = SparseTensor(xp.zeros((0, 4), np.int32), xp.zeros((0, 7), np.float32))
    assert len(tensor) == 0 and tensor.batch_size == 0 and tensor.num_channels == 7


def test_map_cache_defaults_to_a_fresh_cache_and_keeps_a_given_object():
    coords, feats = np.zeros((1, 4), np.int32), np.ones((1, 1), np.float32)
    first, second = SparseTensor(coords, feats), SparseTensor(coords, feats)
    assert isinstance(first.map_cache, KernelMapCache) and len(first.map_cache) == 0
    assert first.map_cache is not second.map_cache
    shared = first.map_cache
    assert SparseTensor(coords, feats, map_cache=shared).map_cache is shared


def _cloud(seed=0, size=200):
    rng = np.random.default_rng(seed)
    coords = np.concatenate([rng.integers(0, 2, (size, 1)), rng.integers(-6, 6, (size, 3))], axis=1).astype(np.int32)
    coords = np.unique(coords, axis=0)
    coords = coords[np.isin(coords[:, 0], [0, 1])]
    return SparseTensor(coords, np.ones((len(coords), 2), np.float32))


def test_kernel_maps_are_built_once_and_shared_through_the_network():
    tensor = _cloud()
    subm = tensor.kernel_map(3)
    assert tensor.kernel_map(3) is subm and tensor.replace_features(tensor.features * 2).kernel_map(3) is subm
    assert subm.out_coordinates is tensor.coordinates and subm.out_tensor_stride == (1, 1, 1)
    down = tensor.kernel_map(2, stride=2)
    assert down.out_tensor_stride == (2, 2, 2) and down.out_map_cache is tensor.map_cache
    coarse = SparseTensor(down.out_coordinates, np.ones((len(down.out_coordinates), 1), np.float32), (2, 2, 2),
                          map_cache=down.out_map_cache)
    up = coarse.kernel_map(2, stride=2, transposed=True)
    # The decoder's map is the encoder's, inverted: same pairs, roles swapped.
    assert up.out_coordinates is tensor.coordinates and up.out_tensor_stride == (1, 1, 1)
    forward = down.kernel_map.pair_table
    for k in range(forward.shape[0]):
        coarse_rows = np.flatnonzero(forward[k] >= 0)
        assert np.array_equal(up.kernel_map.pair_table[k, forward[k, coarse_rows]], coarse_rows)
    assert (up.kernel_map.pair_table >= 0).sum() == (forward >= 0).sum()
    cached = len(tensor.map_cache)
    assert coarse.kernel_map(2, stride=2, transposed=True) is up and len(tensor.map_cache) == cached


def test_a_tensors_maps_are_freed_with_it_without_a_garbage_collection():
    """No reference cycle holds a map cache or its maps (nor their GPU memory) past the tensors using them:
    a training loop's next scene reuses that memory instead of allocating more."""
    tensor = _cloud(seed=3)
    results = [tensor.kernel_map(3), tensor.kernel_map(2, stride=2)]
    coarse = SparseTensor(results[1].out_coordinates, np.ones((len(results[1].out_coordinates), 1), np.float32),
                          (2, 2, 2), map_cache=results[1].out_map_cache)
    results.append(coarse.kernel_map(2, stride=2, transposed=True))
    assert results[2].kernel_map.reversed() is results[1].kernel_map
    # Each map's reverse too (what links a map with another): comprehensions, which leave no name bound.
    alive = [weakref.ref(tensor.map_cache)] + [weakref.ref(result.kernel_map) for result in results]
    alive += [weakref.ref(result.kernel_map.reversed()) for result in results]
    collecting = gc.isenabled()
    gc.disable()
    try:
        del tensor, coarse, results
        assert [reference() for reference in alive] == [None] * len(alive)
    finally:
        if collecting:
            gc.enable()


def test_generative_transposed_map_starts_its_own_cache():
    tensor = _cloud(seed=1)
    coarse_map = tensor.kernel_map(3, stride=2)
    coarse = SparseTensor(coarse_map.out_coordinates, np.ones((len(coarse_map.out_coordinates), 1), np.float32),
                          (2, 2, 2), map_cache=coarse_map.out_map_cache)
    generated = coarse.kernel_map(3, stride=2, transposed=True, generative=True)
    assert generated.out_map_cache is not tensor.map_cache and generated.out_tensor_stride == (1, 1, 1)
    assert len(generated.out_coordinates) > len(tensor.coordinates)


def test_transposed_without_finer_coordinates_or_generative_without_transposed_is_an_error():
    tensor = _cloud(seed=2)
    with pytest.raises(ValueError, match="no coordinates at tensor stride"):
        SparseTensor(tensor.coordinates, tensor.features, 2).kernel_map(2, stride=2, transposed=True)
    with pytest.raises(ValueError, match="divisible"):
        tensor.kernel_map(2, stride=2, transposed=True)
    with pytest.raises(ValueError, match="generative=True needs transposed=True"):
        tensor.kernel_map(3, stride=2, generative=True)


def test_repr_reports_size_stride_dtype_and_device():
    tensor = SparseTensor(np.array([[0, 0, 0], [0, 0, 1]], np.int32), np.ones((2, 6), np.float16), (1, 2))
    text = repr(tensor)
    for part in ("num_points=2", "num_channels=6", "spatial_dims=2", "(1, 2)", "float16", "'cpu'"):
        assert part in text


# --- invalid input --------------------------------------------------------------------------------

ONE_VOXEL = np.zeros((1, 4), np.int32)
ONE_FEATURE_ROW = np.ones((1, 2), np.float32)
BAD_CONSTRUCTOR_INPUTS = {
    "int64 coordinates": (ONE_VOXEL.astype(np.int64), ONE_FEATURE_ROW, TypeError, "coordinates.*int32"),
    "float coordinates": (ONE_VOXEL.astype(np.float32), ONE_FEATURE_ROW, TypeError, "coordinates.*int32"),
    "list coordinates": ([[0, 0, 0, 0]], ONE_FEATURE_ROW, TypeError, "coordinates"),
    "1-D coordinates": (np.zeros(4, np.int32), ONE_FEATURE_ROW, ValueError, "coordinates.*shape"),
    "one spatial column": (np.zeros((1, 2), np.int32), ONE_FEATURE_ROW, ValueError, "coordinates.*shape"),
    "five spatial columns": (np.zeros((1, 6), np.int32), ONE_FEATURE_ROW, ValueError, "coordinates.*shape"),
    "coordinate beyond key range": (
        np.array([[0, key_layout(3).coord_max + 1, 0, 0]], np.int32), ONE_FEATURE_ROW, ValueError, "coordinates.*spatial"
    ),
    "negative batch": (np.array([[-1, 0, 0, 0]], np.int32), ONE_FEATURE_ROW, ValueError, "coordinates.*batch"),
    "batch gap": (
        np.array([[0, 0, 0, 0], [2, 0, 0, 0]], np.int32), np.ones((2, 2), np.float32), ValueError, "coordinates.*batch 1"
    ),
    "duplicate coordinate": (
        np.array([[0, 1, 2, 3], [0, 1, 2, 3]], np.int32), np.ones((2, 2), np.float32), ValueError, "coordinates.*duplicate"
    ),
    "feature rows mismatch": (ONE_VOXEL, np.ones((2, 2), np.float32), ValueError, "features.*rows"),
    "int features": (ONE_VOXEL, np.ones((1, 2), np.int32), TypeError, "features.*floating"),
    "list features": (ONE_VOXEL, [[1.0, 2.0]], TypeError, "features"),
    "1-D features": (ONE_VOXEL, np.ones(1, np.float32), ValueError, "features.*shape"),
    "zero channels": (ONE_VOXEL, np.ones((1, 0), np.float32), ValueError, "features.*channel"),
    # Broadcast views: rows past the int32 indices without the memory (only the shape is read).
    "more rows than int32 indices": (
        np.broadcast_to(ONE_VOXEL, (MAX_ROWS + 1, 4)), np.broadcast_to(ONE_FEATURE_ROW, (MAX_ROWS + 1, 2)), ValueError,
        f"coordinates has {MAX_ROWS + 1} rows",
    ),
}


@pytest.mark.parametrize("case", BAD_CONSTRUCTOR_INPUTS.values(), ids=BAD_CONSTRUCTOR_INPUTS.keys())
def test_invalid_input_raises_an_error_naming_the_argument(case):
    coords, feats, error, message = case
    with pytest.raises(error, match=message):
        SparseTensor(coords, feats)


@pytest.mark.parametrize("name", ["int64 coordinates", "1-D coordinates", "five spatial columns",
                                  "feature rows mismatch", "int features", "more rows than int32 indices"])
def test_dtype_and_shape_checks_run_without_validation(name):
    coords, feats, error, message = BAD_CONSTRUCTOR_INPUTS[name]
    with pytest.raises(error, match=message):
        SparseTensor(coords, feats, validate=False)


def test_validate_false_skips_the_value_checks():
    coords, feats, _, _ = BAD_CONSTRUCTOR_INPUTS["duplicate coordinate"]
    assert len(SparseTensor(coords, feats, validate=False)) == 2


@pytest.mark.parametrize("stride", [0, (1, 2), (1, 1, -1), 2**31])
def test_invalid_tensor_stride_raises(stride):
    with pytest.raises(ValueError, match="tensor_stride"):
        SparseTensor(ONE_VOXEL, ONE_FEATURE_ROW, tensor_stride=stride)


@gpu_test
def test_mixing_numpy_and_cupy_names_both_arguments():
    cupy = cupy_module()
    with pytest.raises(TypeError, match="coordinates and features.*NumPy coordinates and CuPy features"):
        SparseTensor(ONE_VOXEL, cupy.asarray(ONE_FEATURE_ROW))
    with pytest.raises(TypeError, match="CuPy coordinates and NumPy features"):
        SparseTensor(cupy.asarray(ONE_VOXEL), ONE_FEATURE_ROW)


# --- replace_features and to ----------------------------------------------------------------------


def test_replace_features_shares_coordinates_stride_and_map_cache(xp):
    coords = xp.asarray(np.array([[0, 0, 0], [0, 1, 0], [1, 5, -5]], np.int32))
    cache = KernelMapCache(coords, (2, 4))
    tensor = SparseTensor(coords, xp.ones((3, 2), np.float32), tensor_stride=(2, 4), map_cache=cache)
    new_features = xp.asarray(np.arange(12, dtype=np.float64).reshape(3, 4))

    replaced = tensor.replace_features(new_features)

    assert replaced.map_cache is cache
    assert replaced.coordinates is coords and replaced.features is new_features
    assert replaced.tensor_stride == (2, 4) and replaced.num_channels == 4 and replaced.dtype == np.float64
    assert replaced.batch_size == 2


@pytest.mark.parametrize(
    "features, error, message",
    [(np.ones((2, 2), np.float32), ValueError, "features.*rows"), (np.ones((3, 2), np.int64), TypeError, "features")],
)
def test_replace_features_checks_the_new_features(features, error, message):
    tensor = SparseTensor(np.array([[0, 0, 0], [0, 1, 0], [0, 2, 0]], np.int32), np.ones((3, 1), np.float32))
    with pytest.raises(error, match=message):
        tensor.replace_features(features)


def test_replace_features_does_not_revalidate_coordinates():
    coords, feats, _, _ = BAD_CONSTRUCTOR_INPUTS["duplicate coordinate"]
    tensor = SparseTensor(coords, feats, validate=False)
    assert tensor.replace_features(np.zeros((2, 3), np.float32)).num_channels == 3


def test_to_the_current_device_returns_self():
    tensor = SparseTensor(ONE_VOXEL, ONE_FEATURE_ROW)
    assert tensor.to("cpu") is tensor
    with pytest.raises(ValueError, match="device"):
        tensor.to("gpu")


@gpu_test
def test_to_cuda_and_back_keeps_values_and_starts_a_new_map_cache():
    cupy = cupy_module()
    coords = np.array([[0, 3, -2, 1], [1, 0, 0, 0]], np.int32)
    feats = np.array([[1.5, -2.0], [0.25, 4.0]], np.float32)
    tensor = SparseTensor(coords, feats, tensor_stride=(1, 2, 2))

    on_gpu = tensor.to("cuda")

    assert isinstance(on_gpu.coordinates, cupy.ndarray) and isinstance(on_gpu.features, cupy.ndarray)
    assert on_gpu.device == "cuda" and on_gpu.tensor_stride == (1, 2, 2)
    assert on_gpu.map_cache is not tensor.map_cache
    assert on_gpu.to("cuda") is on_gpu
    back = on_gpu.to("cpu")
    np.testing.assert_array_equal(back.coordinates, coords)
    np.testing.assert_array_equal(back.features, feats)
    assert back.device == "cpu"


# --- to_dense -------------------------------------------------------------------------------------


def references(coords, feats, origin, shape, batch_size):
    dense = np.zeros((batch_size, feats.shape[1], *shape), feats.dtype)
    for row, feature in zip(coords.tolist(), feats):
        local = tuple(c - o for c, o in zip(row[1:], origin))
        dense[(row[0], slice(None)) + local] = feature
    return dense


@pytest.mark.parametrize("spatial_dims", [2, 3])
def test_to_dense_matches_a_loop_reference(xp, spatial_dims):
    rng = np.random.default_rng(10 + spatial_dims)
    coords = random_unique_coordinates(rng, 60, spatial_dims, batch_size=3, low=-4, high=5)
    feats = rng.standard_normal((60, 4)).astype(np.float32)
    tensor = SparseTensor(xp.asarray(coords), xp.asarray(feats))

    dense, origin = tensor.to_dense()

    expected_origin = tuple(int(v) for v in coords[:, 1:].min(axis=0))
    expected_shape = tuple(int(v) for v in coords[:, 1:].max(axis=0) - coords[:, 1:].min(axis=0) + 1)
    assert origin == expected_origin
    assert dense.shape == (3, 4, *expected_shape) and dense.dtype == np.float32
    assert type(dense) is type(tensor.features)  # stays on the tensor's backend
    np.testing.assert_array_equal(to_numpy(dense), references(coords, feats, expected_origin, expected_shape, 3))


def test_to_dense_with_a_given_box_pads_with_zeros(xp):
    coords = np.array([[0, 1, 2], [1, -1, 0], [1, 2, 2]], np.int32)
    feats = np.array([[1.0], [2.0], [3.0]], np.float64)
    tensor = SparseTensor(xp.asarray(coords), xp.asarray(feats))

    dense, origin = tensor.to_dense(origin=(-2, -1), shape=(6, 5))

    assert origin == (-2, -1)
    np.testing.assert_array_equal(to_numpy(dense), references(coords, feats, (-2, -1), (6, 5), 2))
    assert float(to_numpy(dense).sum()) == 6.0


@pytest.mark.parametrize(
    "origin, shape, message",
    [((0, 0), None, "origin"), ((-1, 0), (3, 3), "shape"), ((-1, 0, 0), None, "origin"), (None, (1, 0), "shape")],
)
def test_to_dense_rejects_a_box_that_cuts_off_voxels(origin, shape, message):
    tensor = SparseTensor(np.array([[0, -1, 0], [0, 2, 2]], np.int32), np.ones((2, 1), np.float32))
    with pytest.raises(ValueError, match=message):
        tensor.to_dense(origin=origin, shape=shape)


def test_to_dense_of_an_empty_tensor_has_no_batch_items(xp):
    tensor = SparseTensor(xp.zeros((0, 4), np.int32), xp.zeros((0, 2), np.float16))
    dense, origin = tensor.to_dense(shape=(2, 3, 4))
    assert dense.shape == (0, 2, 2, 3, 4) and dense.dtype == np.float16 and origin == (0, 0, 0)


# --- from_points ----------------------------------------------------------------------------------


def voxelise_reference(points, voxel_size, batch_index, features, reduce):
    """Per voxel: the mean of its points' features, or the first point's features, sorted by voxel."""
    groups = {}
    for point, batch, feature in zip(points.tolist(), batch_index.tolist(), features.tolist()):
        voxel = (batch,) + tuple(math.floor(p / v) for p, v in zip(point, voxel_size))
        groups.setdefault(voxel, []).append(feature)
    voxels = sorted(groups)
    if reduce == "mean":
        rows = [np.mean(groups[v], axis=0) for v in voxels]
    else:
        rows = [groups[v][0] for v in voxels]
    return np.array(voxels, np.int32), np.array(rows)


@pytest.mark.parametrize("reduce", ["mean", "first"])
@pytest.mark.parametrize("spatial_dims, voxel_size", [(3, (0.5, 1.0, 0.25)), (2, 0.3)])
def test_from_points_matches_a_dict_reference(xp, reduce, spatial_dims, voxel_size):
    rng = np.random.default_rng(7)
    num_points = 400
    # A small extent so many points share a voxel; negative coordinates included.
    points = rng.uniform(-2.0, 2.0, (num_points, spatial_dims))
    batch_index = rng.integers(0, 3, num_points)
    features = rng.standard_normal((num_points, 3))
    sizes = voxel_size if isinstance(voxel_size, tuple) else (voxel_size,) * spatial_dims

    tensor = SparseTensor.from_points(
        xp.asarray(points), voxel_size, batch_index=xp.asarray(batch_index), features=xp.asarray(features), reduce=reduce
    )

    expected_coords, expected_features = voxelise_reference(points, sizes, batch_index, features, reduce)
    assert len(expected_coords) < num_points  # the test exercises the reduction
    assert tensor.device == ("cpu" if xp is np else "cuda")
    assert tensor.tensor_stride == (1,) * spatial_dims and tensor.batch_size == 3
    np.testing.assert_array_equal(to_numpy(tensor.coordinates), expected_coords)
    np.testing.assert_allclose(to_numpy(tensor.features), expected_features, rtol=1e-12, atol=1e-12)


def test_from_points_keeps_the_feature_dtype_and_reduces_float32(xp):
    rng = np.random.default_rng(3)
    points = rng.uniform(-1.0, 1.0, (300, 3)).astype(np.float32)
    features = rng.standard_normal((300, 2)).astype(np.float32)

    tensor = SparseTensor.from_points(xp.asarray(points), 0.5, features=xp.asarray(features))

    expected_coords, expected_features = voxelise_reference(points, (0.5,) * 3, np.zeros(300, int), features, "mean")
    assert tensor.dtype == np.float32
    np.testing.assert_array_equal(to_numpy(tensor.coordinates), expected_coords)
    np.testing.assert_allclose(to_numpy(tensor.features), expected_features, rtol=1e-5, atol=1e-6)


def test_from_points_defaults_to_batch_zero_and_unit_features():
    points = np.array([[0.1, 0.2], [0.9, 0.3], [-0.5, 1.5], [1.2, 0.0]])
    tensor = SparseTensor.from_points(points, 1.0)
    np.testing.assert_array_equal(tensor.coordinates, [[0, -1, 1], [0, 0, 0], [0, 1, 0]])
    np.testing.assert_array_equal(tensor.features, np.ones((3, 1), np.float32))
    assert tensor.features.dtype == np.float32


def test_from_points_divides_in_float64_like_python():
    # 0.3 / 0.1 is 2.9999999999999996 in float64 (floor 2); float32 arithmetic would round it to 3.
    tensor = SparseTensor.from_points(np.array([[0.3, 0.0]], np.float64), 0.1)
    np.testing.assert_array_equal(tensor.coordinates, [[0, math.floor(0.3 / 0.1), 0]])
    assert tensor.coordinates[0, 1] == 2


def test_from_points_first_takes_the_earliest_point_in_input_order():
    points = np.array([[0.7, 0.7], [5.0, 5.0], [0.2, 0.1], [5.5, 5.9]])
    features = np.array([[1.0], [2.0], [3.0], [4.0]], np.float32)
    tensor = SparseTensor.from_points(points, 1.0, features=features, reduce="first")
    np.testing.assert_array_equal(tensor.coordinates, [[0, 0, 0], [0, 5, 5]])
    np.testing.assert_array_equal(tensor.features, [[1.0], [2.0]])


def test_from_points_of_no_points_is_empty(xp):
    tensor = SparseTensor.from_points(xp.zeros((0, 3), np.float32), 0.1, features=xp.zeros((0, 4), np.float32))
    assert len(tensor) == 0 and tensor.num_channels == 4 and tensor.spatial_dims == 3


@gpu_test
def test_from_points_moves_numpy_input_to_the_requested_device():
    cupy = cupy_module()
    rng = np.random.default_rng(5)
    points = rng.uniform(-3.0, 3.0, (200, 3))
    features = rng.standard_normal((200, 2))

    on_gpu = SparseTensor.from_points(points, 0.7, features=features, device="cuda")
    on_cpu = SparseTensor.from_points(cupy.asarray(points), 0.7, features=cupy.asarray(features), device="cpu")

    assert isinstance(on_gpu.features, cupy.ndarray) and isinstance(on_cpu.features, np.ndarray)
    np.testing.assert_array_equal(on_gpu.coordinates.get(), on_cpu.coordinates)
    np.testing.assert_allclose(on_gpu.features.get(), on_cpu.features, rtol=1e-12)


@gpu_test
def test_from_points_rejects_mixed_backends_without_a_device():
    cupy = cupy_module()
    with pytest.raises(TypeError, match="points and features"):
        SparseTensor.from_points(np.zeros((2, 3)), 1.0, features=cupy.ones((2, 1), np.float32))


POINTS = np.array([[0.5, 1.5, -0.5], [2.5, 0.5, 0.5]])
HUGE = float(key_layout(3).coord_max + 10)
BAD_FROM_POINTS_INPUTS = {
    "NaN point": (dict(points=np.array([[0.0, np.nan, 0.0]])), ValueError, "points.*finite"),
    "infinite point": (dict(points=np.array([[np.inf, 0.0, 0.0]])), ValueError, "points.*finite"),
    "point beyond key range": (dict(points=np.array([[HUGE, 0.0, 0.0]])), ValueError, "points / voxel_size"),
    "int points": (dict(points=POINTS.astype(np.int32)), TypeError, "points.*floating"),
    "list points": (dict(points=POINTS.tolist()), TypeError, "points"),
    "1-D points": (dict(points=POINTS[0]), ValueError, "points.*shape"),
    "one spatial axis": (dict(points=POINTS[:, :1]), ValueError, "points.*shape"),
    "five spatial axes": (dict(points=np.zeros((2, 5))), ValueError, "points.*shape"),
    "zero voxel size": (dict(voxel_size=0.0), ValueError, "voxel_size"),
    "negative voxel size": (dict(voxel_size=(1.0, -1.0, 1.0)), ValueError, "voxel_size"),
    "NaN voxel size": (dict(voxel_size=np.nan), ValueError, "voxel_size"),
    "voxel size of wrong length": (dict(voxel_size=(1.0, 1.0)), ValueError, "voxel_size"),
    "unknown reduce": (dict(reduce="max"), ValueError, "reduce"),
    "batch_index length mismatch": (dict(batch_index=np.zeros(3, np.int64)), ValueError, "batch_index.*shape"),
    "negative batch_index": (dict(batch_index=np.array([0, -1])), ValueError, "batch_index.*non-negative"),
    "float batch_index": (dict(batch_index=np.zeros(2)), TypeError, "batch_index.*integer"),
    "batch_index gap": (dict(batch_index=np.array([0, 2])), ValueError, "batch_index.*batch 1"),
    "batch_index beyond key range": (dict(batch_index=np.array([0, key_layout(3).batch_max + 1])), ValueError, "batch_index"),
    "feature rows mismatch": (dict(features=np.ones((3, 1), np.float32)), ValueError, "features.*rows.*points"),
    "int features": (dict(features=np.ones((2, 1), np.int32)), TypeError, "features.*floating"),
}


@pytest.mark.parametrize("case", BAD_FROM_POINTS_INPUTS.values(), ids=BAD_FROM_POINTS_INPUTS.keys())
def test_from_points_invalid_input_raises_an_error_naming_the_argument(case):
    overrides, error, message = case
    arguments = dict(points=POINTS, voxel_size=1.0) | overrides
    with pytest.raises(error, match=message):
        SparseTensor.from_points(**arguments)
