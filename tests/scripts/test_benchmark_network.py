"""The network benchmark on the CPU: its runs, its arguments, its page and chart, and how it compares
two libraries' outputs (the spconv network itself: test_peer_spconv.py)."""

import csv
import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from cupysparse.adapters.torch import SparseTensor  # noqa: E402
from cupysparse.adapters.torch.networks import MinkUNet14  # noqa: E402
from cupysparse.data.scenes import make_scene  # noqa: E402
from cupysparse.geometry.padding import spconv_grid  # noqa: E402
from cupysparse.networks import descriptions as networks  # noqa: E402
from cupysparse.scripts import benchmark_network  # noqa: E402

NUM_VOXELS = 2000
BATCH_SIZE = 2


def run_benchmark(tmp_path, *extra):
    output = tmp_path / "network.csv"
    status = benchmark_network.main(
        ["--device", "cpu", "--num-voxels", str(NUM_VOXELS), "--batch-size", str(BATCH_SIZE), "--repeats", "1",
         "--warmup", "0", "--depth", "14", "--width", "0.25", "--peers", "spconv,warpconvnet", "--csv", str(output),
         *extra]
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
        assert row["network"] == "MinkUNet14" and row["precision"] == "float32" and row["scene"] == "indoor"
        assert row["batch_size"] == str(BATCH_SIZE)
        assert abs(int(row["voxels"]) - BATCH_SIZE * NUM_VOXELS) <= 0.05 * BATCH_SIZE * NUM_VOXELS
        assert float(row["ms"]) > 0 and float(row["first_call_s"]) > 0
        assert float(row["ratio_to_cupysparse"]) == 1.0
        # No peers, no profile and no peak memory on the CPU: those columns stay empty.
        assert row["peak_mb"] == row["gpu_ms"] == row["gpu_ops"] == row["output_rel_diff"] == ""
    inference = float(rows[0]["ms"])
    out = capsys.readouterr().out
    assert "spconv: skipped" in out and "warpconvnet: skipped" in out
    table = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("inference", "training"))}
    assert table["inference"][1] == "cupysparse"
    assert abs(float(table["inference"][2]) - inference) <= 0.01  # the table's 2 decimals, the CSV's 3
    assert table["inference"][3:7] == ["n/a"] * 4


def test_kernels_on_the_cpu_say_they_are_skipped(tmp_path, capsys):
    run_benchmark(tmp_path, "--dtype", "float32", "--kernels", "5")
    assert "--kernels: skipped (the GPU's operations are profiled on CUDA only)" in capsys.readouterr().out


def test_gpu_operations_are_named_without_parameters_and_summed_per_run_costliest_first():
    name = benchmark_network.operation_name
    assert name("void wgmma_conv_forward<__half, 128, 128, 3, true, false>(__half const*, int)") == (
        "wgmma_conv_forward<__half, 128, 128, 3, true, false>")
    # Anonymous namespaces and casts in template arguments are not parameter lists; a copy's direction stays.
    assert name("void at::native::(anonymous namespace)::softmax<(int)4, float>(float*, int)") == (
        "at::native::(anonymous namespace)::softmax<(int)4, float>")
    assert name("Memcpy DtoH (Device -> Pinned)") == "Memcpy DtoH (Device -> Pinned)"
    assert name("void " + "k" * 200 + "(int)") == "k" * (benchmark_network.OPERATION_NAME_LENGTH - 1) + "…"

    def event(kernel, microseconds):
        return type("Event", (), {"name": kernel, "device_time": microseconds})()

    events = [event("void norm<8>(float*)", 30.0), event("void conv<1>(float*)", 100.0),
              event("void norm<8>(float*)", 50.0), event("Memset (Device)", 2.0)]
    assert benchmark_network.gpu_operations(events, runs=2) == [
        benchmark_network.GpuOperation("conv<1>", 0.05, 0.5), benchmark_network.GpuOperation("norm<8>", 0.04, 1.0),
        benchmark_network.GpuOperation("Memset (Device)", 0.001, 0.5)]


def test_operation_lines_give_each_phase_and_library_its_costliest_operations_and_their_share():
    measured = benchmark_network.Measurement(0.1, [1.0], gpu_ms=2.0, gpu_ops=3.0, operations=[
        benchmark_network.GpuOperation("conv<1>", 1.5, 2.0), benchmark_network.GpuOperation("norm<8>", 0.5, 1.0)])
    lines = benchmark_network.operation_lines({("inference", "cupysparse"): measured}, count=1)
    assert lines[1] == "inference, cupysparse: 2.00 ms in 3 operations"
    assert lines[2].split() == ["1.500", "ms", "75.0%", "2x", "conv<1>"]
    assert len(lines) == 3


def test_host_time_is_given_per_phase_with_the_functions_that_spend_it(tmp_path, capsys):
    """--host on the CPU: each phase's time until a run returns beside its wall time, and the functions with the
    most own time under cProfile; the convolutions' NumPy GEMM is among them."""
    run_benchmark(tmp_path, "--dtype", "float32", "--host", "4")
    lines = capsys.readouterr().out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("Host time per run")))
    for phase, at in (("inference", start + 1), ("training step", start + 6)):
        heading = lines[at]
        assert heading.startswith(f"{phase}, cupysparse: ") and "ms until a run returns, wall" in heading
        functions = lines[at + 1 : at + 5]
        assert len(functions) == 4 and all(line.split()[1] == "ms" for line in functions)
        times = [float(line.split()[0]) for line in functions]
        assert times == sorted(times, reverse=True) and times[-1] > 0
    assert any("explicit_gemm.py" in line for line in lines[start:])


def test_host_functions_are_named_by_file_and_line_and_taken_per_run_costliest_first():
    stats = {("/somewhere/cupysparse/geometry/hashing.py", 385, "unique_reached"): (4, 4, 0.002, 0.02, {}),
             ("~", 0, "<method 'get' of 'dict' objects>"): (40, 40, 0.004, 0.004, {}),
             ("/lib/python3/recursive.py", 7, "walk"): (2, 6, 0.0005, 0.001, {})}
    assert benchmark_network.host_functions(stats, runs=2) == [
        benchmark_network.HostFunction("<method 'get' of 'dict' objects>", 2.0, 20.0),
        benchmark_network.HostFunction("geometry/hashing.py:385(unique_reached)", 1.0, 2.0),
        benchmark_network.HostFunction("python3/recursive.py:7(walk)", 0.25, 3.0)]  # every call, recursive ones too


def test_host_lines_give_each_phase_its_host_time_and_the_functions_shares():
    measured = benchmark_network.Measurement(0.1, [8.0], host_ms=6.0, functions=[
        benchmark_network.HostFunction("a.py:1(f)", 3.0, 2.0), benchmark_network.HostFunction("b.py:2(g)", 1.0, 1.0)])
    lines = benchmark_network.host_lines({("training step", "cupysparse"): measured}, count=1)
    assert lines[1] == "training step, cupysparse: 6.00 ms until a run returns, wall 8.00 ms; 4.00 ms under cProfile"
    assert lines[2].split() == ["3.000", "ms", "75.0%", "2x", "a.py:1(f)"]
    assert len(lines) == 3


def test_the_centerpoint_backbone_trains_on_the_mean_square_of_its_features(tmp_path, monkeypatch):
    """--network centerpoint: the padded backbone on spconv's grid (a spatial shape for our input too); its
    training step has no labels and takes the mean square of the output features as its loss."""
    losses = []
    original_step = benchmark_network.Library.training_step

    def training_step(library, labels):
        losses.append(labels)
        return original_step(library, labels)

    monkeypatch.setattr(benchmark_network.Library, "training_step", training_step)
    rows = run_benchmark(tmp_path, "--dtype", "float32", "--network", "centerpoint", "--scene", "outdoor")
    assert [row["network"] for row in rows] == ["CenterPointBackbone"] * 2
    assert losses and all(labels is None for labels in losses)
    model = benchmark_network.CenterPointBackbone(in_channels=3, width=0.25, padded=True)
    batch = benchmark_network.scene_batch("outdoor", NUM_VOXELS, BATCH_SIZE)
    shifted, spatial_shape = spconv_grid(batch.coordinates, networks.coarsest_stride(model.description))
    assert shifted.min() >= 0
    features = torch.from_numpy(batch.features)
    output = model(SparseTensor(torch.from_numpy(shifted), features, spatial_shape=spatial_shape)).features
    step = benchmark_network.Library("cupysparse", model, lambda: SparseTensor(
        torch.from_numpy(shifted), features, spatial_shape=spatial_shape), lambda out: (out.coordinates, out.features))
    loss = original_step(step, None)
    torch.testing.assert_close(loss, output.detach().float().square().mean())


def test_results_page_and_chart_from_the_csv(tmp_path):
    pytest.importorskip("matplotlib")
    run_benchmark(tmp_path, "--dtype", "float32", "--scene", "outdoor", "--markdown", str(tmp_path / "page.md"),
                  "--plot", str(tmp_path / "chart.png"))
    page = (tmp_path / "page.md").read_text()
    assert "## MinkUNet14, outdoor, float32" in page and "| inference | cupysparse |" in page
    assert "cupysparse-benchmark-network --from-csv" in page
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_autocast_keeps_float32_parameters(tmp_path):
    rows = run_benchmark(tmp_path, "--autocast")
    assert {row["precision"] for row in rows} == {"float16 autocast"}


def test_half_precision_is_the_default(tmp_path):
    rows = run_benchmark(tmp_path)
    assert {row["precision"] for row in rows} == {"float16"}
    assert all(float(row["ms"]) > 0 for row in rows)


def test_batch_voxels_carry_their_first_points_xyz_and_label():
    batch = benchmark_network.scene_batch("indoor", NUM_VOXELS, BATCH_SIZE)
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
    ["--scene", "forest"], ["--peers", "minkowski"], ["--autocast", "--dtype", "float32"], ["--plot", "chart.png"],
    ["--from-csv", "network.csv"], ["--kernels", "-1"], ["--host", "-1"],
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
    batch = benchmark_network.scene_batch("indoor", NUM_VOXELS, 1)
    coordinates, features = torch.from_numpy(batch.coordinates), torch.from_numpy(batch.features)
    library = benchmark_network.Library("cupysparse", model, lambda: SparseTensor(coordinates, features),
                                        lambda output: (output.coordinates, output.features))
    before = model.model.classifier.weight.detach().clone()
    loss = library.training_step(torch.from_numpy(batch.labels))
    assert torch.isfinite(loss) and loss > 0
    assert not torch.equal(model.model.classifier.weight, before)  # the step updated the weights
    assert all(parameter.grad is None for parameter in model.parameters())  # zero_grad(set_to_none=True)


def test_output_difference_matches_rows_by_voxel():
    torch.manual_seed(0)
    model = MinkUNet14(in_channels=3, num_classes=9, width=0.25).eval()
    other = MinkUNet14(in_channels=3, num_classes=9, width=0.25).eval()
    other.load_state_dict(model.state_dict())
    batch = benchmark_network.scene_batch("indoor", NUM_VOXELS, BATCH_SIZE)
    coordinates, features = torch.from_numpy(batch.coordinates), torch.from_numpy(batch.features)
    shift = torch.tensor([[0, 32, -16, 48]], dtype=torch.int32)  # a multiple of the coarsest stride
    reversed_rows = torch.arange(len(coordinates) - 1, -1, -1)
    ours = benchmark_network.Library("cupysparse", model, lambda: SparseTensor(coordinates, features),
                                     lambda output: (output.coordinates, output.features))
    # A peer on shifted coordinates that returns its rows in another order.
    theirs = benchmark_network.Library(
        "peer", other, lambda: SparseTensor(coordinates + shift, features),
        lambda output: ((output.coordinates - shift)[reversed_rows], output.features[reversed_rows]))

    assert benchmark_network.output_difference(ours, theirs) < 1e-5
    with torch.no_grad():
        other.classifier.bias += 0.5
    assert benchmark_network.output_difference(ours, theirs) > 1e-2
