"""Points in and out of the core: `from_points(..., return_index=True)`, `voxelise` and `point_features`.

Every test taking the `xp` fixture runs on NumPy and, on a GPU machine (`pytest -m gpu`), on CuPy.
References are Python dicts keyed by voxel, independent of the code under test.
"""

import math

import numpy as np
import pytest

from cupysparse.cuda.backend import cupy_module, to_numpy
from cupysparse.geometry.coords import key_layout
from cupysparse.geometry.sparse_tensor import SparseTensor, voxelise


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    return np if request.param == "numpy" else cupy_module()


def voxel_of(point, batch, voxel_size) -> tuple:
    return (batch,) + tuple(math.floor(p / v) for p, v in zip(point, voxel_size))


def reference_voxels(points, voxel_size, batch_index):
    """(sorted voxel keys, the row of each point's voxel) from a dict of voxel keys."""
    keys = [voxel_of(p, b, voxel_size) for p, b in zip(points.tolist(), batch_index.tolist())]
    voxels = sorted(set(keys))
    row_of = {voxel: row for row, voxel in enumerate(voxels)}
    return np.array(voxels, np.int32), np.array([row_of[key] for key in keys])


def random_points(num_points=500, spatial_dims=3, batch_size=3, seed=0):
    rng = np.random.default_rng(seed)
    points = rng.uniform(-2.0, 2.0, (num_points, spatial_dims))  # many points per voxel, negative ones too
    batch_index = rng.integers(0, batch_size, num_points)
    features = rng.standard_normal((num_points, 4))
    return points, batch_index, features


@pytest.mark.parametrize("reduce", ["mean", "first"])
@pytest.mark.parametrize("spatial_dims, voxel_size", [(3, (0.5, 1.0, 0.25)), (2, 0.3), (4, 0.7)])
def test_point_to_voxel_is_the_row_of_each_points_voxel(xp, reduce, spatial_dims, voxel_size):
    points, batch_index, features = random_points(spatial_dims=spatial_dims)
    sizes = voxel_size if isinstance(voxel_size, tuple) else (voxel_size,) * spatial_dims

    tensor, point_to_voxel = SparseTensor.from_points(
        xp.asarray(points), voxel_size, batch_index=xp.asarray(batch_index), features=xp.asarray(features),
        reduce=reduce, return_index=True,
    )

    expected_coordinates, expected_rows = reference_voxels(points, sizes, batch_index)
    assert len(expected_coordinates) < len(points)  # voxels are shared, so the index is not the identity
    assert type(point_to_voxel) is type(tensor.coordinates)
    assert point_to_voxel.dtype == np.int64 and point_to_voxel.shape == (len(points),)
    np.testing.assert_array_equal(to_numpy(tensor.coordinates), expected_coordinates)
    np.testing.assert_array_equal(to_numpy(point_to_voxel), expected_rows)


def test_each_point_lies_in_its_voxel(xp):
    voxel_size = np.array([0.05, 0.1, 0.2])
    points, batch_index, _ = random_points(num_points=2_000, batch_size=2, seed=1)
    points = (points * 30).astype(np.float32)  # metres, as a scan gives them

    tensor, point_to_voxel = SparseTensor.from_points(
        xp.asarray(points), voxel_size, batch_index=xp.asarray(batch_index), return_index=True
    )

    coordinates = to_numpy(tensor.coordinates)[to_numpy(point_to_voxel)]
    np.testing.assert_array_equal(coordinates[:, 0], batch_index)
    np.testing.assert_array_equal(coordinates[:, 1:], np.floor(points.astype(np.float64) / voxel_size))
    low, high = coordinates[:, 1:] * voxel_size, (coordinates[:, 1:] + 1) * voxel_size
    assert ((low <= points) & (points < high)).all()


@pytest.mark.parametrize("reduce", ["mean", "first"])
def test_return_index_leaves_the_tensor_as_it_was(xp, reduce):
    points, batch_index, features = random_points(seed=2)
    arguments = dict(batch_index=xp.asarray(batch_index), features=xp.asarray(features), reduce=reduce)

    plain = SparseTensor.from_points(xp.asarray(points), 0.4, **arguments)
    tensor, _ = SparseTensor.from_points(xp.asarray(points), 0.4, **arguments, return_index=True)

    assert isinstance(plain, SparseTensor)
    np.testing.assert_array_equal(to_numpy(tensor.coordinates), to_numpy(plain.coordinates))
    if reduce == "mean" and xp is not np:
        # The GPU sums a voxel's points with atomic adds, in an order that varies from call to call: the
        # means agree to the last bits of float64, not bit for bit.
        np.testing.assert_allclose(to_numpy(tensor.features), to_numpy(plain.features), rtol=1e-13, atol=1e-16)
    else:
        np.testing.assert_array_equal(to_numpy(tensor.features), to_numpy(plain.features))


def test_the_batch_index_separates_points_in_the_same_place():
    points = np.array([[0.5, 0.5, 0.5], [0.6, 0.4, 0.1], [0.5, 0.5, 0.5], [-0.5, 0.5, 2.5]])
    batch_index = np.array([1, 0, 0, 1])

    tensor, point_to_voxel = SparseTensor.from_points(points, 1.0, batch_index=batch_index, return_index=True)

    np.testing.assert_array_equal(tensor.coordinates, [[0, 0, 0, 0], [1, -1, 0, 2], [1, 0, 0, 0]])
    np.testing.assert_array_equal(point_to_voxel, [2, 0, 0, 1])
    np.testing.assert_array_equal(tensor.features, [[1.0], [1.0], [1.0]])


@pytest.mark.parametrize("reduce", ["mean", "first"])
def test_point_features_give_each_point_its_voxels_features(xp, reduce):
    points, batch_index, features = random_points(seed=3)
    tensor, point_to_voxel = SparseTensor.from_points(
        xp.asarray(points), 0.5, batch_index=xp.asarray(batch_index), features=xp.asarray(features),
        reduce=reduce, return_index=True,
    )

    per_point = to_numpy(tensor.point_features(point_to_voxel))

    members = {}
    for index, key in enumerate(voxel_of(p, b, (0.5,) * 3) for p, b in zip(points.tolist(), batch_index.tolist())):
        members.setdefault(key, []).append(index)
    for key, indices in members.items():
        expected = features[indices].mean(axis=0) if reduce == "mean" else features[indices[0]]
        np.testing.assert_allclose(per_point[indices], np.broadcast_to(expected, (len(indices), 4)), rtol=1e-12)


def test_point_features_round_trip_when_every_point_has_its_own_voxel(xp):
    rng = np.random.default_rng(4)
    cells = rng.permutation(20 * 20 * 20)[:300]
    centres = np.stack(np.unravel_index(cells, (20, 20, 20)), axis=1) + 0.5  # one point per unit voxel
    features = rng.standard_normal((300, 5)).astype(np.float32)

    tensor, point_to_voxel = SparseTensor.from_points(
        xp.asarray(centres), 1.0, features=xp.asarray(features), return_index=True
    )

    assert tensor.num_points == 300
    np.testing.assert_array_equal(to_numpy(tensor.point_features(point_to_voxel)), features)


def test_voxelise_gives_the_coordinates_and_index_of_from_points(xp):
    points, batch_index, _ = random_points(seed=5)

    coordinates, point_to_voxel = voxelise(xp.asarray(points), (0.3, 0.6, 0.9), xp.asarray(batch_index))
    tensor, index = SparseTensor.from_points(
        xp.asarray(points), (0.3, 0.6, 0.9), batch_index=xp.asarray(batch_index), return_index=True
    )

    assert coordinates.dtype == np.int32
    np.testing.assert_array_equal(to_numpy(coordinates), to_numpy(tensor.coordinates))
    np.testing.assert_array_equal(to_numpy(point_to_voxel), to_numpy(index))


def test_voxelise_defaults_to_batch_zero():
    coordinates, point_to_voxel = voxelise(np.array([[1.5, -0.5], [1.2, -0.1], [0.0, 0.0]]), 1.0)
    np.testing.assert_array_equal(coordinates, [[0, 0, 0], [0, 1, -1]])
    np.testing.assert_array_equal(point_to_voxel, [1, 1, 0])


def test_no_points_give_an_empty_index(xp):
    tensor, point_to_voxel = SparseTensor.from_points(xp.zeros((0, 3), np.float32), 0.1, return_index=True)
    assert len(tensor) == 0 and point_to_voxel.shape == (0,) and point_to_voxel.dtype == np.int64
    assert tensor.point_features(point_to_voxel).shape == (0, 1)


@pytest.mark.gpu
def test_the_index_moves_to_the_requested_device_with_the_tensor():
    cupy = cupy_module()
    points, batch_index, features = random_points(seed=6)

    on_gpu, gpu_index = SparseTensor.from_points(points, 0.5, batch_index=batch_index, features=features,
                                                 device="cuda", return_index=True)
    on_cpu, cpu_index = SparseTensor.from_points(points, 0.5, batch_index=batch_index, features=features,
                                                 return_index=True)

    assert isinstance(gpu_index, cupy.ndarray)
    np.testing.assert_array_equal(gpu_index.get(), cpu_index)
    np.testing.assert_allclose(on_gpu.point_features(gpu_index).get(), on_cpu.point_features(cpu_index), rtol=1e-12)


def test_return_index_is_keyword_only():
    with pytest.raises(TypeError):
        SparseTensor.from_points(np.zeros((1, 3)), 1.0, None, None, "mean", None, True)


POINTS = np.array([[0.5, 1.5, -0.5], [2.5, 0.5, 0.5]])
BAD_VOXELISE_INPUTS = {
    "NaN point": (dict(points=np.array([[0.0, 0.0, 0.0], [0.0, np.nan, 0.0]])), ValueError,
                  r"points must be finite.*point 1 is \[0.0, nan, 0.0\]"),
    "infinite point": (dict(points=np.array([[-np.inf, 0.0, 0.0]])), ValueError, "points must be finite.*point 0"),
    "point beyond key range": (dict(points=np.array([[0.0, 0.0, 0.0], [0.0, 0.0, -4e5]])), ValueError,
                               r"points / voxel_size.*point 1, \[0.0, 0.0, -400000.0\]"),
    "int points": (dict(points=POINTS.astype(np.int64)), TypeError, "points.*floating"),
    "points of one axis": (dict(points=POINTS[:, :1]), ValueError, r"points must have shape \[P, D\]"),
    "bad voxel size": (dict(voxel_size=-1.0), ValueError, "voxel_size"),
    "batch_index length mismatch": (dict(batch_index=np.zeros(3, np.int32)), ValueError,
                                    r"batch_index must have shape \(2,\) to match points"),
    "batch_index gap": (dict(batch_index=np.array([0, 2])), ValueError, "batch_index.*batch 1"),
    "batch_index a list": (dict(batch_index=[0, 0]), TypeError, "batch_index"),
}


@pytest.mark.parametrize("case", BAD_VOXELISE_INPUTS.values(), ids=BAD_VOXELISE_INPUTS.keys())
@pytest.mark.parametrize("entry", ["voxelise", "from_points"])
def test_invalid_points_raise_an_error_naming_the_argument(case, entry):
    overrides, error, message = case
    arguments = dict(points=POINTS, voxel_size=1.0) | overrides
    with pytest.raises(error, match=message):
        if entry == "voxelise":
            voxelise(**arguments)
        else:
            SparseTensor.from_points(**arguments, return_index=True)


def test_the_coordinate_range_error_says_what_to_do():
    beyond = float(key_layout(3).coord_max + 1)
    with pytest.raises(ValueError, match="use a larger voxel_size or shift the points"):
        voxelise(np.array([[beyond, 0.0, 0.0]]), 1.0)


BAD_INDICES = {
    "past the last row": (np.array([0, 2]), ValueError, r"point_to_voxel holds rows outside 0\.\.1"),
    "negative": (np.array([-1, 0]), ValueError, r"point_to_voxel holds rows outside 0\.\.1"),
    "float": (np.array([0.0, 1.0]), TypeError, "point_to_voxel must have an integer dtype"),
    "two-dimensional": (np.zeros((2, 1), np.int64), ValueError, r"point_to_voxel must have shape \[P\]"),
    "a list": ([0, 1], TypeError, "point_to_voxel must be a NumPy or CuPy array"),
}


@pytest.mark.parametrize("case", BAD_INDICES.values(), ids=BAD_INDICES.keys())
def test_point_features_rejects_an_index_that_is_not_this_tensors(case):
    index, error, message = case
    tensor = SparseTensor.from_points(POINTS, 1.0)
    with pytest.raises(error, match=message):
        tensor.point_features(index)
