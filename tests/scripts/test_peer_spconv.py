"""The spconv network of the benchmarks, built on a stand-in for spconv.

The stand-in's convolutions record their constructor arguments (spconv 2.x's signatures) and
compute what spconv 2.x computes, with our operations: weights `[C_out, *kernel, C_in]`, a 1x1x1
convolution as `features @ weight.view(C_in, C_out)`, an inverse convolution through the pairs of
the strided one. So the spconv network must reproduce our model exactly, without spconv or a GPU.
"""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from cupysparse.networks import descriptions as networks  # noqa: E402
from cupysparse.adapters.torch import SparseTensor  # noqa: E402
from cupysparse.adapters.torch.convolution import sparse_conv  # noqa: E402
from cupysparse.adapters.torch.networks import CenterPointBackbone, MinkUNet14  # noqa: E402
from cupysparse.geometry.coords import as_tuple  # noqa: E402
from cupysparse.geometry.padding import spconv_grid  # noqa: E402
from cupysparse.scripts import benchmark_network, peer_spconv  # noqa: E402

NUM_VOXELS = 2000
BATCH_SIZE = 2


class StandInConvolution(nn.Module):
    """A spconv convolution's parameters (its layout) and recorded constructor arguments."""

    def __init__(self, arguments: dict):
        super().__init__()
        self.arguments = arguments
        kernel_size = as_tuple(arguments["kernel_size"], 3, "kernel_size")
        self.weight = nn.Parameter(torch.zeros(arguments["out_channels"], *kernel_size, arguments["in_channels"]))
        self.bias = nn.Parameter(torch.zeros(arguments["out_channels"])) if arguments["bias"] else None

    def our_weight(self) -> torch.Tensor:
        """`[K, C_in, C_out]`: the matrices spconv multiplies the features by."""
        out_channels, in_channels = self.weight.shape[0], self.weight.shape[-1]
        if self.weight[0].numel() == in_channels:  # kernel volume 1: spconv's `weight.view(C_in, C_out)`
            return self.weight.reshape(1, in_channels, out_channels)
        return self.weight.reshape(out_channels, -1, in_channels).permute(1, 2, 0)


def _arguments(frame_locals: dict) -> dict:
    return {name: value for name, value in frame_locals.items() if name not in ("self", "__class__")}


class SubMConv3d(StandInConvolution):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1, bias=True,
                 indice_key=None):
        super().__init__(_arguments(locals()))

    def forward(self, input):
        return sparse_conv(input, self.our_weight(), self.arguments["kernel_size"], bias=self.bias)


class SparseConv3d(StandInConvolution):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1, bias=True,
                 indice_key=None):
        super().__init__(_arguments(locals()))

    def forward(self, input):
        return sparse_conv(input, self.our_weight(), self.arguments["kernel_size"], self.arguments["stride"],
                           bias=self.bias)


class SparseInverseConv3d(StandInConvolution):
    def __init__(self, in_channels, out_channels, kernel_size, indice_key, bias=True):
        super().__init__(_arguments(locals()))

    def forward(self, input):
        kernel_size = self.arguments["kernel_size"]
        return sparse_conv(input, self.our_weight(), kernel_size, kernel_size, transposed=True, bias=self.bias)


STAND_IN_SPCONV = SimpleNamespace(SubMConv3d=SubMConv3d, SparseConv3d=SparseConv3d,
                                  SparseInverseConv3d=SparseInverseConv3d)
SPCONV_CLASS = {"submanifold": SubMConv3d, "strided": SparseConv3d, "transposed": SparseInverseConv3d}


def resolution_level(path: str) -> int:
    """The level (0: the input's voxels) a MinkUNet convolution at `path` outputs at."""
    stage = path.split(".")[0]
    if stage.startswith("encoder"):
        return int(stage.removeprefix("encoder"))
    if stage.startswith("decoder"):
        return 4 - int(stage.removeprefix("decoder"))
    return 0  # the stem and the classifier


def test_spconv_network_mirrors_the_description_with_shared_indice_keys():
    description = networks.minkunet(18, in_channels=3, num_classes=9, width=0.5)
    spconv_model = peer_spconv.build_spconv_network(description, STAND_IN_SPCONV)
    keys = {}
    for path, layer in networks.convolutions(description):
        module = spconv_model.get_submodule(path)
        assert type(module) is SPCONV_CLASS[layer.kind()], path
        arguments = module.arguments
        assert (arguments["in_channels"], arguments["out_channels"], arguments["kernel_size"], arguments["bias"]) == (
            layer.in_channels, layer.out_channels, layer.kernel_size, layer.bias
        ), path
        if layer.kind() == "strided":
            assert (arguments["stride"], arguments["padding"]) == (2, 0), path
        keys[path] = arguments["indice_key"]

    submanifold = {}  # (level, kernel size) → the keys of those layers
    for path, layer in networks.convolutions(description):
        if layer.kind() == "submanifold":
            submanifold.setdefault((resolution_level(path), layer.kernel_size), set()).add(keys[path])
    assert {level for level, _ in submanifold} == {0, 1, 2, 3, 4}
    assert all(len(shared) == 1 for shared in submanifold.values()), submanifold
    assert len({key for shared in submanifold.values() for key in shared}) == len(submanifold)

    strided = [keys[f"encoder{level}.down_conv"] for level in range(1, 5)]
    assert len(set(strided) | {key for shared in submanifold.values() for key in shared}) == len(submanifold) + 4
    # decoder1 returns from the coarsest level: it inverts encoder4's convolution, decoder4 encoder1's.
    assert [keys[f"decoder{level}.up_conv"] for level in range(1, 5)] == strided[::-1]


def test_spconv_network_computes_our_model_after_the_weight_copy():
    torch.manual_seed(0)
    model = MinkUNet14(in_channels=3, num_classes=9, width=0.25)
    with torch.no_grad():  # statistics away from the defaults, so that copying them matters
        for module in model.modules():
            if isinstance(module, nn.BatchNorm1d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.5, 0.5)
    spconv_model = peer_spconv.build_spconv_network(model.description, STAND_IN_SPCONV)
    peer_spconv.copy_weights_to_spconv(model, spconv_model)
    model.eval()
    spconv_model.eval()
    batch = benchmark_network.scene_batch("indoor", NUM_VOXELS, BATCH_SIZE)
    coordinates, features = torch.from_numpy(batch.coordinates), torch.from_numpy(batch.features)
    with torch.no_grad():
        expected = model(SparseTensor(coordinates, features)).features
        actual = spconv_model(SparseTensor(coordinates, features)).features
    assert expected.shape == (len(coordinates), 9) and expected.abs().max() > 0.1
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_one_by_one_weights_are_laid_out_for_spconvs_matrix_view():
    layer = networks.Conv("shortcut", 4, 6, kernel_size=1)
    weight = torch.arange(24, dtype=torch.float32).reshape(1, 4, 6)
    converted = peer_spconv.spconv_weight(weight, layer)
    assert converted.shape == (6, 1, 1, 1, 4)
    assert torch.equal(converted.view(4, 6), weight[0])  # what spconv multiplies the features by


def test_strided_convolutions_other_than_two_cubed_are_refused():
    with pytest.raises(ValueError, match="other output voxels"):
        peer_spconv.build_spconv_network(networks.centerpoint_backbone(), STAND_IN_SPCONV)


def test_padded_convolutions_are_spconvs_own_with_their_padding():
    description = networks.centerpoint_backbone(padded=True)
    spconv_model = peer_spconv.build_spconv_network(description, STAND_IN_SPCONV)
    padded = {path: layer for path, layer in networks.convolutions(description) if layer.padding is not None}
    assert sorted(padded) == ["height.conv", "stage1.down_conv", "stage2.down_conv", "stage3.down_conv"]
    for path, layer in padded.items():
        arguments = spconv_model.get_submodule(path).arguments
        assert type(spconv_model.get_submodule(path)) is SparseConv3d, path
        assert (arguments["kernel_size"], arguments["stride"], arguments["padding"]) == (
            layer.kernel_size, layer.stride, layer.padding), path
    assert networks.has_padding(description) and not networks.has_padding(networks.centerpoint_backbone())


def test_padded_centerpoint_computes_spconvs_backbone():
    """The benchmark's CenterPoint row: our padded backbone against spconv's own on the CPU (where spconv's CPU
    build is installed; on a GPU the benchmark checks the same agreement), the same weights and statistics,
    on spconv's grid for both; voxel by voxel, in float32."""
    spconv = pytest.importorskip("spconv.pytorch")
    device = "cpu"
    torch.manual_seed(0)
    model = CenterPointBackbone(in_channels=3, width=0.5, padded=True)
    with torch.no_grad():  # statistics away from the defaults, so that copying them matters
        for module in model.modules():
            if isinstance(module, nn.BatchNorm1d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    model = model.to(device).eval()
    batch = benchmark_network.scene_batch("outdoor", NUM_VOXELS, BATCH_SIZE)
    shifted, spatial_shape = spconv_grid(batch.coordinates, networks.coarsest_stride(model.description))
    features = torch.from_numpy(batch.features).to(device)
    with pytest.raises(ValueError, match="spconv's grid"):
        peer_spconv.peer_network(spconv, model, batch.coordinates - 5, features, BATCH_SIZE)
    spconv_model, make_input, output_voxels = peer_spconv.peer_network(spconv, model, shifted, features, BATCH_SIZE)
    coordinates = torch.from_numpy(shifted).to(device)
    ours = benchmark_network.Library(
        "cupysparse", model, lambda: SparseTensor(coordinates, features, spatial_shape=spatial_shape),
        lambda output: (output.coordinates, output.features))
    theirs = benchmark_network.Library("spconv", spconv_model.eval(), make_input, output_voxels)
    assert benchmark_network.output_difference(ours, theirs) < 1e-4


def test_a_transposed_convolution_needs_a_strided_one_to_invert():
    root = networks.Sequential("", (networks.Conv("up", 8, 4, kernel_size=2, stride=2, transposed=True),))
    with pytest.raises(ValueError, match="no strided convolution"):
        peer_spconv.build_spconv_network(networks.Network("up only", root, 8, 4), STAND_IN_SPCONV)
