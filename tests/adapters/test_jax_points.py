"""Points in and out of the JAX adapter: `SparseTensor.from_points` against the core, gradients of the per-voxel
reduction (analytic and finite differences) and of the gather-back, per-point outputs of a network, errors.

CPU only: the tests pin JAX to its CPU device, so they test the same paths on a GPU machine.
"""

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import cupysparse  # noqa: E402
from cupysparse.adapters import jax as csj  # noqa: E402


@pytest.fixture(autouse=True)
def jax_cpu():
    with jax.default_device(jax.devices("cpu")[0]):
        yield


def random_points(num_points=400, spatial_dims=3, batch_size=2, seed=0):
    rng = np.random.default_rng(seed)
    points = rng.uniform(-2.0, 2.0, (num_points, spatial_dims))
    batch_index = rng.integers(0, batch_size, num_points)
    features = rng.standard_normal((num_points, 3))
    return points, batch_index, features


@pytest.mark.parametrize("reduce", ["mean", "first"])
@pytest.mark.parametrize("spatial_dims, voxel_size", [(3, (0.5, 0.25, 1.0)), (2, 0.3)])
def test_from_points_agrees_with_the_core_in_float64(x64, reduce, spatial_dims, voxel_size):
    points, batch_index, features = random_points(spatial_dims=spatial_dims)

    tensor, point_to_voxel = csj.SparseTensor.from_points(
        jnp.asarray(points), voxel_size, batch_index=jnp.asarray(batch_index), features=jnp.asarray(features),
        reduce=reduce, return_index=True,
    )
    core, core_index = cupysparse.SparseTensor.from_points(
        points, voxel_size, batch_index=batch_index, features=features, reduce=reduce, return_index=True
    )

    assert isinstance(tensor, csj.SparseTensor) and tensor.tensor_stride == (1,) * spatial_dims
    assert tensor.dtype == jnp.float64 and point_to_voxel.dtype == jnp.int64
    np.testing.assert_array_equal(tensor.coordinates, core.coordinates)
    np.testing.assert_array_equal(point_to_voxel, core_index)
    np.testing.assert_allclose(tensor.features, core.features, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reduce", ["mean", "first"])
def test_float32_numpy_inputs_agree_with_the_core(reduce):
    points, batch_index, features = random_points(seed=5)
    points, features = points.astype(np.float32), features.astype(np.float32)

    tensor, point_to_voxel = csj.SparseTensor.from_points(points, 0.4, batch_index=batch_index, features=features,
                                                          reduce=reduce, return_index=True)
    core, core_index = cupysparse.SparseTensor.from_points(points, 0.4, batch_index=batch_index, features=features,
                                                           reduce=reduce, return_index=True)

    assert isinstance(point_to_voxel, jax.Array) and point_to_voxel.dtype == jnp.int32  # JAX's default int
    assert tensor.features.devices() == {jax.devices("cpu")[0]}
    np.testing.assert_array_equal(tensor.coordinates, core.coordinates)
    np.testing.assert_array_equal(point_to_voxel, core_index)
    np.testing.assert_allclose(tensor.features, core.features, rtol=1e-6, atol=1e-6)


def test_each_point_lies_in_its_voxel():
    points, batch_index, _ = random_points(num_points=1_000, seed=1)
    points = jnp.asarray(points * 25, jnp.float32)

    tensor, point_to_voxel = csj.SparseTensor.from_points(points, 0.1, batch_index=batch_index, return_index=True)

    coordinates = tensor.coordinates[np.asarray(point_to_voxel)]
    np.testing.assert_array_equal(coordinates[:, 0], batch_index)
    expected = [[math.floor(value / 0.1) for value in point] for point in np.asarray(points, np.float64).tolist()]
    np.testing.assert_array_equal(coordinates[:, 1:], expected)


def test_the_batch_index_separates_points_in_the_same_place():
    points = jnp.array([[0.5, 0.5], [0.5, 0.5], [1.5, 0.2]])
    features = jnp.array([[1.0], [2.0], [4.0]])

    tensor, point_to_voxel = csj.SparseTensor.from_points(points, 1.0, batch_index=jnp.array([1, 0, 0]),
                                                          features=features, return_index=True)

    assert tensor.coordinates.tolist() == [[0, 0, 0], [0, 1, 0], [1, 0, 0]]
    assert point_to_voxel.tolist() == [2, 0, 1]
    assert tensor.features.tolist() == [[2.0], [4.0], [1.0]]


def test_the_mean_of_half_precision_features_accumulates_in_float32():
    # Their float16 sum, 80000, overflows to infinity (the largest float16 is 65504).
    points = np.zeros((2, 3), np.float32)
    features = np.array([[40000.0], [40000.0]], np.float16)

    tensor = csj.SparseTensor.from_points(points, 1.0, features=jnp.asarray(features))
    core = cupysparse.SparseTensor.from_points(points, 1.0, features=features)

    assert tensor.dtype == jnp.float16
    assert float(tensor.features[0, 0]) == float(core.features[0, 0]) == 40000.0


def test_default_features_are_ones():
    tensor = csj.SparseTensor.from_points(jnp.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]), 1.0)
    assert tensor.features.dtype == jnp.float32 and tensor.features.tolist() == [[1.0]]


def several_points_per_voxel(seed):
    points, batch_index, features = random_points(num_points=60, seed=seed)
    _, point_to_voxel = csj.SparseTensor.from_points(points, 0.7, batch_index=batch_index, return_index=True)
    assert len(np.unique(np.asarray(point_to_voxel))) < len(points)  # so the reduction is tested
    return points, batch_index, features, point_to_voxel


@pytest.mark.parametrize("reduce", ["mean", "first"])
def test_the_gradient_of_the_reduction_is_the_analytic_one(reduce):
    points, batch_index, features, point_to_voxel = several_points_per_voxel(seed=2)
    index = np.asarray(point_to_voxel)
    num_voxels = index.max() + 1
    cotangent = np.random.default_rng(6).standard_normal((num_voxels, 3)).astype(np.float32)

    def voxel_features(features):
        return csj.SparseTensor.from_points(points, 0.7, batch_index=batch_index, features=features,
                                            reduce=reduce).features

    _, pullback = jax.vjp(voxel_features, jnp.asarray(features, jnp.float32))
    (gradient,) = pullback(jnp.asarray(cotangent))

    if reduce == "mean":  # each point gets 1/count of its voxel's cotangent
        expected = cotangent[index] / np.bincount(index)[index, None]
    else:  # the first point of each voxel gets its cotangent, the others nothing
        first = np.array([np.flatnonzero(index == voxel)[0] for voxel in range(num_voxels)])
        expected = np.zeros_like(features, dtype=np.float32)
        expected[first] = cotangent
    np.testing.assert_allclose(gradient, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("reduce", ["mean", "first"])
def test_gradients_from_points_through_the_voxels_and_back_match_finite_differences(x64, reduce):
    points, batch_index, features, point_to_voxel = several_points_per_voxel(seed=3)

    def per_point(features):
        tensor = csj.SparseTensor.from_points(points, 0.7, batch_index=batch_index, features=features, reduce=reduce)
        return tensor.point_features(point_to_voxel)

    check_grads(per_point, (jnp.asarray(features),), order=1, modes=("fwd", "rev"))
    check_grads(jax.jit(per_point), (jnp.asarray(features),), order=1, modes=("rev",))


def test_point_features_round_trip_when_every_point_has_its_own_voxel():
    rng = np.random.default_rng(3)
    cells = rng.permutation(16**3)[:200]
    points = np.stack(np.unravel_index(cells, (16, 16, 16)), axis=1) + 0.5
    features = jnp.asarray(rng.standard_normal((200, 6)), jnp.float32)

    tensor, point_to_voxel = csj.SparseTensor.from_points(points, 1.0, features=features, return_index=True)

    assert tensor.num_points == 200
    np.testing.assert_array_equal(tensor.point_features(point_to_voxel), features)


def test_a_network_gives_one_output_per_point_with_gradients_under_jit():
    points, batch_index, features = random_points(num_points=300, seed=4)
    tensor, point_to_voxel = csj.SparseTensor.from_points(
        points.astype(np.float32), 0.5, batch_index=batch_index, features=features.astype(np.float32),
        return_index=True,
    )
    layers = (csj.SparseConv(3, 8, 3), csj.SparseConv(8, 5, 3))
    params = [layer.init(key) for layer, key in zip(layers, jax.random.split(jax.random.key(0), 2))]

    def logits(params, x):
        hidden = csj.relu(layers[0].apply(params[0], x))
        return layers[1].apply(params[1], hidden).point_features(point_to_voxel)

    per_point = jax.jit(logits)(params, tensor)
    gradients = jax.jit(jax.grad(lambda params, x: jax.nn.logsumexp(logits(params, x), axis=1).mean()))(params, tensor)

    assert per_point.shape == (300, 5)
    voxel_logits = layers[1].apply(params[1], csj.relu(layers[0].apply(params[0], tensor))).features
    np.testing.assert_allclose(per_point, np.asarray(voxel_logits)[np.asarray(point_to_voxel)], rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(gradients[0]["weight"]).sum()) > 0


def test_from_points_runs_inside_jit_on_closed_over_points():
    points, batch_index, features = random_points(num_points=100, seed=7)
    points = points.astype(np.float32)

    def voxel_features(features):
        return csj.SparseTensor.from_points(points, 0.5, batch_index=batch_index, features=features).features

    eager = voxel_features(jnp.asarray(features, jnp.float32))
    np.testing.assert_allclose(jax.jit(voxel_features)(jnp.asarray(features, jnp.float32)), eager, rtol=1e-6)


def test_no_points_give_an_empty_tensor_and_index():
    tensor, point_to_voxel = csj.SparseTensor.from_points(jnp.zeros((0, 3)), 0.1, features=jnp.zeros((0, 2)),
                                                          return_index=True)
    assert tensor.num_points == 0 and tuple(tensor.features.shape) == (0, 2)
    assert point_to_voxel.shape == (0,) and jnp.issubdtype(point_to_voxel.dtype, jnp.integer)
    assert tensor.point_features(point_to_voxel).shape == (0, 2)


POINTS = np.array([[0.5, 1.5, -0.5], [2.5, 0.5, 0.5]], np.float32)
BAD_FROM_POINTS_INPUTS = {
    "points a list": (dict(points=POINTS.tolist()), TypeError, "points must be a JAX or NumPy array"),
    "int points": (dict(points=jnp.asarray(POINTS, jnp.int32)), TypeError, "points must have a floating dtype"),
    "NaN point": (dict(points=jnp.array([[0.0, float("nan"), 0.0]])), ValueError, "points must be finite"),
    "point beyond key range": (dict(points=jnp.array([[1e6, 0.0, 0.0]])), ValueError, "points / voxel_size"),
    "feature rows mismatch": (dict(features=jnp.ones((3, 1))), ValueError, r"features must have shape \[2, C\]"),
    "no feature channels": (dict(features=jnp.ones((2, 0))), ValueError, "at least one channel"),
    "int features": (dict(features=jnp.ones((2, 1), jnp.int32)), TypeError, "features must be float"),
    "features a list": (dict(features=[[1.0], [2.0]]), TypeError, "features must be a JAX array"),
    "batch_index length mismatch": (dict(batch_index=jnp.zeros(3, jnp.int32)), ValueError,
                                    r"batch_index must have shape \(2,\)"),
    "float batch_index": (dict(batch_index=jnp.zeros(2)), TypeError, "batch_index.*integer"),
    "batch_index with a gap": (dict(batch_index=jnp.array([0, 2])), ValueError, "batch_index"),
    "unknown reduce": (dict(reduce="max"), ValueError, "reduce must be one of"),
    "zero voxel size": (dict(voxel_size=0.0), ValueError, "voxel_size"),
}


@pytest.mark.parametrize("case", BAD_FROM_POINTS_INPUTS.values(), ids=BAD_FROM_POINTS_INPUTS.keys())
def test_from_points_invalid_input_raises_an_error_naming_the_argument(case):
    overrides, error, message = case
    arguments = dict(points=POINTS, voxel_size=1.0) | overrides
    with pytest.raises(error, match=message):
        csj.SparseTensor.from_points(**arguments)


@pytest.mark.parametrize("argument", ["points", "batch_index"])
def test_traced_geometry_is_refused_with_the_argument_named(argument):
    batch_index = np.zeros(2, np.int32)

    def voxelise_inside(value):
        arguments = dict(points=POINTS, batch_index=batch_index) | {argument: value}
        return csj.SparseTensor.from_points(voxel_size=1.0, **arguments).features

    with pytest.raises(TypeError, match=f"{argument} must be concrete"):
        jax.jit(voxelise_inside)(dict(points=POINTS, batch_index=batch_index)[argument])


BAD_INDICES = {
    "past the last row": (jnp.array([0, 2]), ValueError, r"rows 0\.\.2, outside 0\.\.1"),
    "negative": (np.array([-1, 1]), ValueError, r"rows -1\.\.1, outside 0\.\.1"),
    "float": (jnp.array([0.0, 1.0]), TypeError, "point_to_voxel must have an integer dtype"),
    "two-dimensional": (jnp.zeros((2, 1), jnp.int32), ValueError, r"point_to_voxel must have shape \[P\]"),
    "a list": ([0, 1], TypeError, "point_to_voxel must be a JAX or NumPy array"),
}


@pytest.mark.parametrize("case", BAD_INDICES.values(), ids=BAD_INDICES.keys())
def test_point_features_rejects_an_index_that_is_not_this_tensors(case):
    index, error, message = case
    tensor = csj.SparseTensor.from_points(POINTS, 1.0)
    with pytest.raises(error, match=message):
        tensor.point_features(index)


def test_a_traced_index_outside_the_rows_reads_nan_not_another_voxels_features():
    tensor = csj.SparseTensor.from_points(POINTS, 1.0, features=jnp.array([[1.0], [2.0]]))

    gathered = np.asarray(jax.jit(lambda x, index: x.point_features(index))(tensor, jnp.array([-1, 0, 1, 2])))

    assert np.isnan(gathered[[0, 3]]).all() and gathered[1:3].tolist() == [[1.0], [2.0]]
