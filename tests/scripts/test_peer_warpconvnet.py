"""The WarpConvNet network of the network benchmark, built on a stand-in for WarpConvNet.

The stand-in's `Voxels` wraps our torch `SparseTensor` behind WarpConvNet's attribute names, and its
`SparseConv3d` computes what WarpConvNet's computes, with our operations: weights `[K, C_in, C_out]` in
our offset order, a strided convolution onto unique(floor(x / s)), a transposed one onto the
coordinates of the tensor it is handed. So the WarpConvNet network must reproduce our model exactly,
without WarpConvNet or a GPU.
"""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from cupysparse.adapters.torch import SparseTensor  # noqa: E402
from cupysparse.adapters.torch.convolution import sparse_conv  # noqa: E402
from cupysparse.adapters.torch.networks import MinkUNet14  # noqa: E402
from cupysparse.networks import descriptions as networks  # noqa: E402
from cupysparse.scripts import benchmark_network, peer_warpconvnet  # noqa: E402


class StandInVoxels:
    """WarpConvNet's `Voxels` interface over one of our tensors."""

    def __init__(self, tensor: SparseTensor, offsets: torch.Tensor):
        self.tensor, self.offsets = tensor, offsets

    @property
    def feature_tensor(self) -> torch.Tensor:
        return self.tensor.features

    features = feature_tensor

    @property
    def batch_indexed_coordinates(self) -> torch.Tensor:
        return self.tensor.coordinates

    def replace(self, batched_features: torch.Tensor) -> "StandInVoxels":
        return StandInVoxels(self.tensor.replace_feature(batched_features), self.offsets)


class StandInSparseConv3d(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, bias=True, transposed=False):
        super().__init__()
        self.kernel_size, self.stride, self.transposed = kernel_size, stride, transposed
        self.weight = nn.Parameter(torch.zeros(int(np.prod(kernel_size)), in_channels, out_channels))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None

    def forward(self, input: StandInVoxels, output_spatially_sparse_tensor: StandInVoxels | None = None):
        if self.transposed and output_spatially_sparse_tensor is None:
            raise ValueError("WarpConvNet's transposed convolution is handed the tensor to write into")
        output = sparse_conv(input.tensor, self.weight, self.kernel_size, self.stride, transposed=self.transposed,
                             bias=self.bias)
        if self.transposed:
            assert torch.equal(output.coordinates, output_spatially_sparse_tensor.batch_indexed_coordinates)
        counts = torch.bincount(output.coordinates[:, 0].long(), minlength=len(input.offsets) - 1)
        return StandInVoxels(output, torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).int())


STAND_IN_WARPCONVNET = SimpleNamespace(SparseConv3d=StandInSparseConv3d, Voxels=None)


def test_warpconvnet_network_computes_our_model_after_the_weight_copy():
    torch.manual_seed(0)
    model = MinkUNet14(in_channels=3, num_classes=9, width=0.25)
    with torch.no_grad():  # statistics away from the defaults, so that copying them matters
        for module in model.modules():
            if isinstance(module, nn.BatchNorm1d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    warp_model = peer_warpconvnet.build_warpconvnet_network(model.description, STAND_IN_WARPCONVNET)
    assert warp_model.state_dict().keys() == model.state_dict().keys()
    peer_warpconvnet.copy_weights_to_warpconvnet(model, warp_model)
    model.eval()
    warp_model.eval()
    batch = benchmark_network.scene_batch("indoor", 2000, 2)
    coordinates, features = torch.from_numpy(batch.coordinates), torch.from_numpy(batch.features)
    offsets = peer_warpconvnet.batch_offsets(coordinates, 2)
    assert offsets.tolist() == [0, batch.voxels_per_item[0], sum(batch.voxels_per_item)]
    with torch.no_grad():
        expected = model(SparseTensor(coordinates, features)).features
        actual = warp_model(StandInVoxels(SparseTensor(coordinates, features), offsets)).features
    assert expected.shape == (len(coordinates), 9) and expected.abs().max() > 0.1
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_a_transposed_convolution_must_invert_a_strided_one_of_its_stride():
    root = networks.Sequential("", (networks.Conv("up", 8, 4, kernel_size=2, stride=2, transposed=True),))
    with pytest.raises(ValueError, match="no strided convolution"):
        peer_warpconvnet.build_warpconvnet_network(networks.Network("up only", root, 8, 4), STAND_IN_WARPCONVNET)


def test_even_kernels_past_two_are_refused_for_their_offsets():
    root = networks.Sequential("", (networks.Conv("conv", 8, 4, kernel_size=4),))
    with pytest.raises(ValueError, match="even size"):
        peer_warpconvnet.build_warpconvnet_network(networks.Network("even", root, 8, 4), STAND_IN_WARPCONVNET)


def test_padded_convolutions_are_refused():
    with pytest.raises(ValueError, match="no padded convolution"):
        peer_warpconvnet.build_warpconvnet_network(networks.centerpoint_backbone(padded=True), STAND_IN_WARPCONVNET)


def test_batch_offsets_refuse_rows_out_of_batch_order():
    coordinates = torch.tensor([[1, 0, 0, 0], [0, 1, 1, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="grouped by batch index"):
        peer_warpconvnet.batch_offsets(coordinates)
