"""The network benchmark on the CPU, and its spconv network built on a stand-in for spconv.

The stand-in's convolutions record their constructor arguments (spconv 2.x's signatures) and
compute what spconv 2.x computes, with our operations: weights `[C_out, *kernel, C_in]`, a 1x1x1
convolution as `features @ weight.view(C_in, C_out)`, an inverse convolution through the pairs of
the strided one. So the spconv network must reproduce our model exactly, without spconv or a GPU.
"""

import csv
import gc
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from cupysparse.networks import descriptions as networks  # noqa: E402
from cupysparse.adapters.torch import SparseTensor  # noqa: E402
from cupysparse.adapters.torch.convolution import sparse_conv  # noqa: E402
from cupysparse.adapters.torch.networks import MinkUNet14  # noqa: E402
from cupysparse.geometry.coords import as_tuple  # noqa: E402
from cupysparse.data.scenes import make_scene  # noqa: E402
from cupysparse.scripts import benchmark_network  # noqa: E402

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


def run_benchmark(tmp_path, *extra):
    output = tmp_path / "network.csv"
    status = benchmark_network.main(
        ["--device", "cpu", "--num-voxels", str(NUM_VOXELS), "--batch-size", str(BATCH_SIZE), "--repeats", "1",
         "--warmup", "0", "--depth", "14", "--width", "0.25", "--csv", str(output), *extra]
    )
    assert status == 0
    with open(output) as handle:
        return list(csv.DictReader(handle))


def test_cpu_run_times_both_phases_of_cupysparse(tmp_path, capsys):
    rows = run_benchmark(tmp_path, "--dtype", "float32")
    assert [(row["phase"], row["library"]) for row in rows] == [
        ("inference", "cupysparse"), ("training step", "cupysparse")
    ]
    for row in rows:
        assert row["network"] == "MinkUNet14" and row["dtype"] == "float32" and row["batch_size"] == str(BATCH_SIZE)
        assert abs(int(row["voxels"]) - BATCH_SIZE * NUM_VOXELS) <= 0.05 * BATCH_SIZE * NUM_VOXELS
        assert float(row["ms"]) > 0 and float(row["first_call_s"]) > 0
        # No spconv and no peak memory on the CPU: those columns stay empty.
        assert row["peak_mb"] == row["time_ratio"] == row["memory_ratio"] == row["output_rel_diff"] == ""
    inference = float(rows[0]["ms"])
    out = capsys.readouterr().out
    assert "spconv: skipped" in out and "first call (compile + tune)" in out
    table = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("inference", "training"))}
    assert abs(float(table["inference"][1]) - inference) <= 0.01  # the table's 2 decimals, the CSV's 3
    assert table["inference"][2:] == ["n/a"] * 5


def test_half_precision_is_the_default(tmp_path):
    rows = run_benchmark(tmp_path)
    assert {row["dtype"] for row in rows} == {"float16"}
    assert all(float(row["ms"]) > 0 for row in rows)


def test_batch_voxels_carry_their_first_points_xyz_and_label():
    batch = benchmark_network.indoor_batch(NUM_VOXELS, BATCH_SIZE)
    assert batch.num_classes == 9 and sum(batch.voxels_per_item) == len(batch.coordinates)
    for item in range(BATCH_SIZE):
        scene = make_scene("indoor", NUM_VOXELS, seed=item)
        rows = batch.coordinates[:, 0] == item
        assert np.array_equal(batch.coordinates[rows, 1:], scene.voxel_coordinates())
        first_point = {}
        voxels = np.floor(scene.points.astype(np.float64) / scene.voxel_size).astype(np.int64)  # as from_points
        for index, voxel in enumerate(map(tuple, voxels)):
            first_point.setdefault(voxel, index)
        firsts = [first_point[tuple(voxel)] for voxel in batch.coordinates[rows, 1:]]
        np.testing.assert_array_equal(batch.labels[rows], scene.labels[firsts])
        low, high = scene.points.min(axis=0), scene.points.max(axis=0)
        np.testing.assert_allclose(batch.features[rows], (scene.points[firsts] - low) / (high - low), atol=1e-6)


@pytest.mark.parametrize("arguments", [
    ["--batch-size", "0"], ["--num-voxels", "10"], ["--num-voxels", "many"], ["--repeats", "0"],
    ["--warmup", "-1"], ["--width", "0"], ["--width", "nan"], ["--depth", "20"], ["--dtype", "int8"],
])
def test_invalid_arguments_exit_with_usage_error(arguments):
    with pytest.raises(SystemExit) as exit_info:
        benchmark_network.main(["--device", "cpu", *arguments])
    assert exit_info.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_cuda_without_a_gpu_is_a_usage_error():
    with pytest.raises(SystemExit) as exit_info:
        benchmark_network.main(["--device", "cuda"])
    assert exit_info.value.code == 2


class CollectingGarbageInBackward(nn.Module):
    """`model`, with a garbage collection when the backward reaches its output."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input):
        output = self.model(input)
        output.features.register_hook(self._collect_garbage)
        return output

    @staticmethod
    def _collect_garbage(grad):
        gc.collect()  # returns None: the gradient passes unchanged


def test_training_step_keeps_the_kernel_maps_until_its_backward():
    torch.manual_seed(0)
    model = CollectingGarbageInBackward(MinkUNet14(in_channels=3, num_classes=9, width=0.25))
    batch = benchmark_network.indoor_batch(NUM_VOXELS, 1)
    coordinates, features = torch.from_numpy(batch.coordinates), torch.from_numpy(batch.features)
    library = benchmark_network.Library("cupysparse", model, lambda: SparseTensor(coordinates, features))
    before = model.model.classifier.weight.detach().clone()
    loss = library.training_step(torch.from_numpy(batch.labels))
    assert torch.isfinite(loss) and loss > 0
    assert not torch.equal(model.model.classifier.weight, before)  # the step updated the weights
    assert all(parameter.grad is None for parameter in model.parameters())  # zero_grad(set_to_none=True)


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
    spconv_model = benchmark_network.build_spconv_network(description, STAND_IN_SPCONV)
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
    spconv_model = benchmark_network.build_spconv_network(model.description, STAND_IN_SPCONV)
    benchmark_network.copy_weights_to_spconv(model, spconv_model)
    model.eval()
    spconv_model.eval()
    batch = benchmark_network.indoor_batch(NUM_VOXELS, BATCH_SIZE)
    coordinates, features = torch.from_numpy(batch.coordinates), torch.from_numpy(batch.features)
    with torch.no_grad():
        expected = model(SparseTensor(coordinates, features)).features
        actual = spconv_model(SparseTensor(coordinates, features)).features
    assert expected.shape == (len(coordinates), 9) and expected.abs().max() > 0.1
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


class SpconvStyleOutput(nn.Module):
    """The stand-in spconv network on spconv-style input (shifted `indices` beside our tensor), its
    output rows reversed, as spconv's own voxel order may differ from ours."""

    def __init__(self, network: nn.Module):
        super().__init__()
        self.network = network

    def forward(self, input):
        output = self.network(input.tensor)
        reversed_rows = torch.arange(len(output.features) - 1, -1, -1)
        return SimpleNamespace(indices=input.indices[reversed_rows], features=output.features[reversed_rows])


def test_output_difference_matches_rows_by_voxel():
    torch.manual_seed(0)
    model = MinkUNet14(in_channels=3, num_classes=9, width=0.25).eval()
    spconv_model = benchmark_network.build_spconv_network(model.description, STAND_IN_SPCONV).eval()
    benchmark_network.copy_weights_to_spconv(model, spconv_model)
    batch = benchmark_network.indoor_batch(NUM_VOXELS, BATCH_SIZE)
    shifted, _ = benchmark_network.spconv_grid(batch.coordinates, benchmark_network.coarsest_stride(model.description))
    coordinates, features = torch.from_numpy(batch.coordinates), torch.from_numpy(batch.features)
    ours = benchmark_network.Library("cupysparse", model, lambda: SparseTensor(coordinates, features))
    theirs = benchmark_network.Library("spconv", SpconvStyleOutput(spconv_model), lambda: SimpleNamespace(
        indices=torch.from_numpy(shifted), tensor=SparseTensor(coordinates, features)))

    assert benchmark_network.output_difference(ours, theirs, ours.make_input(), theirs.make_input()) < 1e-5
    with torch.no_grad():
        spconv_model.classifier.bias += 0.5
    assert benchmark_network.output_difference(ours, theirs, ours.make_input(), theirs.make_input()) > 1e-2


def test_one_by_one_weights_are_laid_out_for_spconvs_matrix_view():
    layer = networks.Conv("shortcut", 4, 6, kernel_size=1)
    weight = torch.arange(24, dtype=torch.float32).reshape(1, 4, 6)
    converted = benchmark_network.spconv_weight(weight, layer)
    assert converted.shape == (6, 1, 1, 1, 4)
    assert torch.equal(converted.view(4, 6), weight[0])  # what spconv multiplies the features by


def test_strided_convolutions_other_than_two_cubed_are_refused():
    with pytest.raises(ValueError, match="other output voxels"):
        benchmark_network.build_spconv_network(networks.centerpoint_backbone(), STAND_IN_SPCONV)


def test_a_transposed_convolution_needs_a_strided_one_to_invert():
    root = networks.Sequential("", (networks.Conv("up", 8, 4, kernel_size=2, stride=2, transposed=True),))
    with pytest.raises(ValueError, match="no strided convolution"):
        benchmark_network.build_spconv_network(networks.Network("up only", root, 8, 4), STAND_IN_SPCONV)


def test_spconv_grid_is_non_negative_and_keeps_every_levels_voxels():
    rng = np.random.default_rng(0)
    coordinates = np.concatenate(
        [rng.integers(0, 2, (500, 1)), rng.integers(-300, 300, (500, 3))], axis=1
    ).astype(np.int32)
    stride = benchmark_network.coarsest_stride(networks.minkunet(14))
    assert stride.tolist() == [16, 16, 16]
    shifted, spatial_shape = benchmark_network.spconv_grid(coordinates, stride)
    assert np.array_equal(shifted[:, 0], coordinates[:, 0])
    spatial = shifted[:, 1:]
    assert spatial.min() >= 0 and (spatial.max(axis=0) < spatial_shape).all()
    assert all(size % 16 == 0 for size in spatial_shape)
    for level in range(1, 5):
        step = 2**level
        # floor(x / 2^level) moves by the same amount for every voxel: the same coarse voxels.
        moved = spatial // step - coordinates[:, 1:] // step
        assert (moved == moved[0]).all(), level
