"""Points in and out of the PyTorch adapter: `SparseTensor.from_points` against the core and a dict
reference, gradients through the reduction and the gather-back, per-point outputs of a network, errors."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cupysparse  # noqa: E402
from cupysparse.adapters import torch as cst  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def random_points(num_points=400, spatial_dims=3, batch_size=2, seed=0):
    rng = np.random.default_rng(seed)
    points = rng.uniform(-2.0, 2.0, (num_points, spatial_dims))
    batch_index = rng.integers(0, batch_size, num_points)
    features = rng.standard_normal((num_points, 3))
    return points, batch_index, features


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduce", ["mean", "first"])
@pytest.mark.parametrize("spatial_dims, voxel_size", [(3, (0.5, 0.25, 1.0)), (2, 0.3)])
def test_from_points_agrees_with_the_core(device, reduce, spatial_dims, voxel_size):
    points, batch_index, features = random_points(spatial_dims=spatial_dims)

    tensor, point_to_voxel = cst.SparseTensor.from_points(
        torch.from_numpy(points).to(device), voxel_size, batch_index=torch.from_numpy(batch_index).to(device),
        features=torch.from_numpy(features).to(device), reduce=reduce, return_index=True,
    )
    core, core_index = cupysparse.SparseTensor.from_points(
        points, voxel_size, batch_index=batch_index, features=features, reduce=reduce, return_index=True
    )

    assert isinstance(tensor, cst.SparseTensor) and tensor.device.type == device
    assert point_to_voxel.dtype == torch.int64 and point_to_voxel.device.type == device
    assert tensor.tensor_stride == (1,) * spatial_dims and tensor.batch_size == 2
    np.testing.assert_array_equal(tensor.coordinates.cpu().numpy(), core.coordinates)
    np.testing.assert_array_equal(point_to_voxel.cpu().numpy(), core_index)
    np.testing.assert_allclose(tensor.features.detach().cpu().numpy(), core.features, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_each_point_lies_in_its_voxel(device):
    points, batch_index, _ = random_points(num_points=1_000, seed=1)
    points = torch.from_numpy(points * 25).float().to(device)
    batch_index = torch.from_numpy(batch_index).to(device)

    tensor, point_to_voxel = cst.SparseTensor.from_points(points, 0.1, batch_index=batch_index, return_index=True)

    coordinates = tensor.coordinates[point_to_voxel].cpu().numpy()
    np.testing.assert_array_equal(coordinates[:, 0], batch_index.cpu().numpy())
    expected = [[math.floor(value / 0.1) for value in point] for point in points.cpu().double().tolist()]
    np.testing.assert_array_equal(coordinates[:, 1:], expected)


def test_the_batch_index_separates_points_in_the_same_place():
    points = torch.tensor([[0.5, 0.5], [0.5, 0.5], [1.5, 0.2]])
    features = torch.tensor([[1.0], [2.0], [4.0]])

    tensor, point_to_voxel = cst.SparseTensor.from_points(points, 1.0, batch_index=torch.tensor([1, 0, 0]),
                                                          features=features, return_index=True)

    assert tensor.coordinates.tolist() == [[0, 0, 0], [0, 1, 0], [1, 0, 0]]
    assert point_to_voxel.tolist() == [2, 0, 1]
    assert tensor.features.tolist() == [[2.0], [4.0], [1.0]]


def test_the_mean_of_half_precision_features_accumulates_in_float32():
    # Their float16 sum, 80000, overflows to infinity (the largest float16 is 65504).
    points = torch.zeros((2, 3))
    features = torch.tensor([[40000.0], [40000.0]], dtype=torch.float16)

    tensor = cst.SparseTensor.from_points(points, 1.0, features=features)
    core = cupysparse.SparseTensor.from_points(points.numpy(), 1.0, features=features.numpy())

    assert tensor.dtype == torch.float16
    assert tensor.features.item() == float(core.features[0, 0]) == 40000.0


def test_default_features_are_ones():
    tensor = cst.SparseTensor.from_points(torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]), 1.0)
    assert tensor.features.dtype == torch.float32 and tensor.features.tolist() == [[1.0]]


@pytest.mark.parametrize("reduce", ["mean", "first"])
def test_gradients_flow_from_points_through_the_voxels_and_back(reduce):
    points, batch_index, features = random_points(num_points=60, seed=2)
    points, batch_index = torch.from_numpy(points), torch.from_numpy(batch_index)
    _, point_to_voxel = cst.SparseTensor.from_points(points, 0.7, batch_index=batch_index, return_index=True)
    assert len(point_to_voxel.unique()) < len(points)  # several points per voxel: the reduction is tested

    def per_point(features):
        tensor = cst.SparseTensor.from_points(points, 0.7, batch_index=batch_index, features=features, reduce=reduce)
        return tensor.point_features(point_to_voxel)

    torch.autograd.gradcheck(per_point, (torch.from_numpy(features).requires_grad_(),))


def test_point_features_round_trip_when_every_point_has_its_own_voxel():
    rng = np.random.default_rng(3)
    cells = rng.permutation(16**3)[:200]
    points = torch.from_numpy(np.stack(np.unravel_index(cells, (16, 16, 16)), axis=1) + 0.5).float()
    features = torch.randn(200, 6)

    tensor, point_to_voxel = cst.SparseTensor.from_points(points, 1.0, features=features, return_index=True)

    assert tensor.num_points == 200
    assert torch.equal(tensor.point_features(point_to_voxel), features)


def test_a_network_gives_one_output_per_point_with_gradients():
    points, batch_index, features = random_points(num_points=300, seed=4)
    tensor, point_to_voxel = cst.SparseTensor.from_points(
        torch.from_numpy(points).float(), 0.5, batch_index=torch.from_numpy(batch_index),
        features=torch.from_numpy(features).float(), return_index=True,
    )
    torch.manual_seed(0)
    net = torch.nn.Sequential(cst.SubMConv3d(3, 8, 3), cst.SparseReLU(), cst.SubMConv3d(8, 5, 3))

    logits = net(tensor).point_features(point_to_voxel)

    assert logits.shape == (300, 5)
    expected = net(tensor).features[point_to_voxel]
    assert torch.equal(logits, expected)
    logits.logsumexp(1).mean().backward()
    assert net[0].weight.grad.abs().sum() > 0


def test_no_points_give_an_empty_tensor_and_index():
    tensor, point_to_voxel = cst.SparseTensor.from_points(torch.zeros((0, 3)), 0.1, features=torch.zeros((0, 2)),
                                                          return_index=True)
    assert tensor.num_points == 0 and tuple(tensor.features.shape) == (0, 2)
    assert point_to_voxel.dtype == torch.int64 and point_to_voxel.shape == (0,)
    assert tensor.point_features(point_to_voxel).shape == (0, 2)


POINTS = torch.tensor([[0.5, 1.5, -0.5], [2.5, 0.5, 0.5]])
BAD_FROM_POINTS_INPUTS = {
    "points a NumPy array": (dict(points=POINTS.numpy()), TypeError, "points must be a torch.Tensor"),
    "int points": (dict(points=POINTS.int()), TypeError, "points must have a floating dtype"),
    "NaN point": (dict(points=torch.tensor([[0.0, float("nan"), 0.0]])), ValueError, "points must be finite"),
    "point beyond key range": (dict(points=torch.tensor([[1e6, 0.0, 0.0]])), ValueError, "points / voxel_size"),
    "features on another device": (dict(features=torch.ones((2, 1), device="meta")), ValueError,
                                   "features is on meta but points on cpu"),
    "batch_index on another device": (dict(batch_index=torch.zeros(2, dtype=torch.int64, device="meta")), ValueError,
                                      "batch_index is on meta"),
    "feature rows mismatch": (dict(features=torch.ones((3, 1))), ValueError, r"features must have shape \[2, C\]"),
    "int features": (dict(features=torch.ones((2, 1), dtype=torch.int32)), TypeError, "features.*floating"),
    "batch_index length mismatch": (dict(batch_index=torch.zeros(3, dtype=torch.int64)), ValueError,
                                    r"batch_index must have shape \(2,\)"),
    "float batch_index": (dict(batch_index=torch.zeros(2)), TypeError, "batch_index.*integer"),
    "unknown reduce": (dict(reduce="max"), ValueError, "reduce"),
    "zero voxel size": (dict(voxel_size=0.0), ValueError, "voxel_size"),
}


@pytest.mark.parametrize("case", BAD_FROM_POINTS_INPUTS.values(), ids=BAD_FROM_POINTS_INPUTS.keys())
def test_from_points_invalid_input_raises_an_error_naming_the_argument(case):
    overrides, error, message = case
    arguments = dict(points=POINTS, voxel_size=1.0) | overrides
    with pytest.raises(error, match=message):
        cst.SparseTensor.from_points(**arguments)


BAD_INDICES = {
    "past the last row": (torch.tensor([0, 2]), ValueError, r"rows 0\.\.2, outside 0\.\.1"),
    "negative": (torch.tensor([-1, 1]), ValueError, r"rows -1\.\.1, outside 0\.\.1"),
    "float": (torch.tensor([0.0, 1.0]), TypeError, "point_to_voxel must be int32 or int64"),
    "two-dimensional": (torch.zeros((2, 1), dtype=torch.int64), ValueError, r"point_to_voxel must have shape \[P\]"),
    "a NumPy array": (np.array([0, 1]), TypeError, "point_to_voxel must be a torch.Tensor"),
    "on another device": (torch.tensor([0, 1], device="meta"), ValueError, "point_to_voxel is on meta"),
}


@pytest.mark.parametrize("case", BAD_INDICES.values(), ids=BAD_INDICES.keys())
def test_point_features_rejects_an_index_that_is_not_this_tensors(case):
    index, error, message = case
    tensor = cst.SparseTensor.from_points(POINTS, 1.0)
    with pytest.raises(error, match=message):
        tensor.point_features(index)
