"""`python -m cupysparse segment` on the CPU: one int32 label per point, the same whatever the file format,
fixed by the seed, and a one-line error with exit status 2 for each mistake a user makes."""

import importlib.util
import sys

import numpy as np
import pytest

from cupysparse.data import make_scene
from cupysparse.networks import descriptions as networks
from cupysparse.networks.weights_file import save_weights
from cupysparse.scripts import cli

VOXEL_SIZE = "0.05"  # the outdoor scene's own, so 2,000 voxels


@pytest.fixture(scope="module")
def points():
    return make_scene("outdoor", 2000).points


def _write_bin(path, points):
    intensity = np.linspace(0, 1, len(points), dtype=np.float32)[:, None]
    np.concatenate([points, intensity], axis=1).astype("<f4").tofile(path)


def _write_ply(path, points):
    plyfile = pytest.importorskip("plyfile")
    vertex = np.empty(len(points), dtype=[("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("red", "u1")])
    for axis, column in zip("xyz", points.T):
        vertex[axis] = column
    vertex["red"] = 200
    plyfile.PlyData([plyfile.PlyElement.describe(vertex, "vertex")]).write(str(path))


def _segment(*arguments) -> int:
    return cli.main(["segment", *map(str, arguments), "--device", "cpu"])


def _fails_with(capsys, message: str, *arguments) -> str:
    """The one error line of a call that must exit 2 with `message` (a progress line may come before it)."""
    assert _segment(*arguments) == 2
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("cupysparse segment: error: ")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in stderr, stderr
    return errors[0]


@pytest.fixture(scope="module")
def varied_weights(tmp_path_factory):
    """MinkUNet18 weights whose labels vary from voxel to voxel. Random weights initialised as PyTorch does
    shrink the features layer by layer, so their classifier's bias picks one class almost everywhere: that
    would hide a wrong point order. Batch norms that amplify (running variance 0.1) and no bias keep the
    labels the features' own."""
    weights = networks.random_weights(networks.minkunet(18, 3, 20), 0)
    for name, values in weights.items():
        if name.endswith("running_var"):
            values[:] = 0.1
    weights["classifier.bias"][:] = 0
    path = tmp_path_factory.mktemp("weights") / "varied.safetensors"
    save_weights(path, weights)
    return path


@pytest.fixture(scope="module")
def labelled(tmp_path_factory, points, varied_weights):
    """The scene as .bin, .npy and .ply, segmented in one call into a folder: (inputs, output folder)."""
    folder = tmp_path_factory.mktemp("scans")
    inputs = [folder / "scan_bin.bin", folder / "scan_npy.npy", folder / "scan_ply.ply"]
    _write_bin(inputs[0], points)
    np.save(inputs[1], points)
    _write_ply(inputs[2], points)
    output = folder / "labels"
    assert _segment(*inputs, "--voxel-size", VOXEL_SIZE, "--weights", varied_weights, "--output", output) == 0
    return inputs, output


def test_several_files_write_one_labels_file_each_into_the_folder(labelled, points):
    inputs, output = labelled
    assert sorted(path.name for path in output.iterdir()) == sorted(f"{path.stem}.labels.npy" for path in inputs)
    labels = np.load(output / "scan_npy.labels.npy")
    assert labels.dtype == np.int32 and labels.shape == (len(points),)
    assert 0 <= labels.min() and labels.max() < 20  # the weights' 20 classes
    assert len(np.unique(labels)) > 5


def test_the_same_points_get_the_same_labels_whatever_the_format(labelled):
    inputs, output = labelled
    bin_labels, npy_labels, ply_labels = (np.load(output / f"{path.stem}.labels.npy") for path in inputs)
    np.testing.assert_array_equal(bin_labels, npy_labels)
    np.testing.assert_array_equal(ply_labels, npy_labels)


def test_labels_follow_the_file_order(labelled, points, varied_weights, tmp_path):
    """Shuffling the points in the file shuffles the labels the same way."""
    _, output = labelled
    # A permutation of whole voxels keeps the bounding box (the features) and the first point of each voxel.
    voxels = np.floor(points.astype(np.float64) / float(VOXEL_SIZE)).astype(np.int64)
    _, voxel_of_point = np.unique(voxels, axis=0, return_inverse=True)
    voxel_order = np.random.default_rng(3).permutation(voxel_of_point.max() + 1)
    order = np.argsort(voxel_order[voxel_of_point.ravel()], kind="stable")
    np.save(tmp_path / "shuffled.npy", points[order])
    assert _segment(tmp_path / "shuffled.npy", "--voxel-size", VOXEL_SIZE, "--weights", varied_weights) == 0
    shuffled_labels = np.load(tmp_path / "shuffled.labels.npy")  # the default output, next to the input
    np.testing.assert_array_equal(shuffled_labels, np.load(output / "scan_npy.labels.npy")[order])


def test_the_seed_fixes_the_random_weights(labelled, tmp_path, capsys):
    inputs, _ = labelled
    picture = tmp_path / "labels.png"
    plot = ["--plot", picture] if importlib.util.find_spec("matplotlib") else []
    assert _segment(inputs[1], "--voxel-size", VOXEL_SIZE, "--output", tmp_path / "seed0.npy", *plot) == 0
    captured = capsys.readouterr()
    assert "weights random (seed 0)" in captured.out and "points/s" in captured.out and "voxels/s" in captured.out
    assert "[1/1]" in captured.err  # the progress over files, one line per step into a pipe
    if plot:
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _segment(inputs[1], "--voxel-size", VOXEL_SIZE, "--seed", "1", "--output", tmp_path / "seed1.npy") == 0
    assert not np.array_equal(np.load(tmp_path / "seed1.npy"), np.load(tmp_path / "seed0.npy"))
    # The weights the seed draws, from a file: the same labels.
    weights = tmp_path / "seed1.safetensors"
    save_weights(weights, networks.random_weights(networks.minkunet(18, 3, 20), 1))
    assert _segment(inputs[1], "--voxel-size", VOXEL_SIZE, "--weights", weights, "--output", tmp_path / "file.npy") == 0
    np.testing.assert_array_equal(np.load(tmp_path / "file.npy"), np.load(tmp_path / "seed1.npy"))


def test_plot_without_matplotlib_names_the_extra(labelled, monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    inputs, _ = labelled
    _fails_with(capsys, "pip install 'cupysparse[plot]'", inputs[1], "--voxel-size", VOXEL_SIZE,
                "--plot", tmp_path / "labels.png")


def test_argument_errors_exit_2_with_one_line(labelled, capsys, tmp_path):
    inputs, _ = labelled
    _fails_with(capsys, f"no such file: {tmp_path / 'absent.bin'}", tmp_path / "absent.bin", "--voxel-size", "0.1")
    _fails_with(capsys, "--voxel-size must be a positive number, got 0", inputs[0], "--voxel-size", "0")
    _fails_with(capsys, "--voxel-size must be a positive number, got -0.1", inputs[0], "--voxel-size=-0.1")
    _fails_with(capsys, "unknown network 'pointnet'; --network takes minkunet14, minkunet18, minkunet34",
                inputs[0], "--voxel-size", "0.1", "--network", "pointnet")
    np.save(tmp_path / "scan_bin.npy", np.zeros((4, 3), np.float32))
    collision = f"{inputs[0]} and {tmp_path / 'scan_bin.npy'} would both write {tmp_path / 'scan_bin.labels.npy'}"
    _fails_with(capsys, collision,
                inputs[0], tmp_path / "scan_bin.npy", "--voxel-size", "0.1", "--output", tmp_path)
    _fails_with(capsys, f"the labels would overwrite the input {inputs[1]}", inputs[1], "--voxel-size", "0.1",
                "--output", inputs[1])
    _fails_with(capsys, "--output: the labels are written as .npy; labels.txt must end in .npy", inputs[1],
                "--voxel-size", "0.1", "--output", "labels.txt")


@pytest.mark.parametrize("name, content, message", [
    ("truncated.bin", b"\0" * 20, "20 bytes is not a multiple of 16"),
    ("table.npy", np.zeros((10, 2), np.float32), "a .npy point cloud is one array [P, 3 + C]"),
    ("scan.txt", b"1 2 3\n", "unknown point-cloud suffix '.txt'"),
    ("holes.npy", np.array([[0, 0, 0], [0, 0, np.nan]], np.float32), "point 1 is [0.0, 0.0, nan]"),
])
def test_an_unreadable_file_exits_2_naming_it(tmp_path, capsys, name, content, message):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        np.save(path, content)
    assert str(path) in _fails_with(capsys, message, path, "--voxel-size", VOXEL_SIZE)


def test_weights_that_do_not_fit_are_named_in_one_line(labelled, tmp_path, capsys):
    inputs, _ = labelled
    arguments = (inputs[1], "--voxel-size", VOXEL_SIZE)
    other_depth = tmp_path / "minkunet14.safetensors"
    save_weights(other_depth, networks.random_weights(networks.minkunet(14, 3, 20), 0))
    _fails_with(capsys, f"--weights {other_depth} does not fit MinkUNet18 with 3 input channels (normalised x, y, z): "
                        "80 tensors of its 247 missing (first 'encoder1.block1.conv1.weight')",
                *arguments, "--weights", other_depth)
    four_channels = tmp_path / "four_channels.safetensors"
    save_weights(four_channels, networks.random_weights(networks.minkunet(18, 4, 20), 0))
    _fails_with(capsys, "1 tensor of another shape (first 'stem.first_conv.weight': (27, 4, 32), expected "
                        "(27, 3, 32))", *arguments, "--weights", four_channels)
    backbone = tmp_path / "centerpoint.safetensors"
    save_weights(backbone, networks.random_weights(networks.centerpoint_backbone(), 0))
    _fails_with(capsys, "it has no classifier", *arguments, "--weights", backbone)
    not_safetensors = tmp_path / "weights.safetensors"
    not_safetensors.write_bytes(b"not a weights file")
    _fails_with(capsys, f"--weights: cannot read {not_safetensors}", *arguments, "--weights", not_safetensors)
    _fails_with(capsys, f"--weights: no such file: {tmp_path / 'absent'}", *arguments, "--weights", tmp_path / "absent")
