"""The demo (`cupysparse-demo`, the README's first command) end to end on the CPU, and its arguments."""

import re

import numpy as np
import pytest

from cupysparse.cuda import backend
from cupysparse.scripts import demo
from cupysparse.networks import descriptions as networks
from cupysparse.networks.weights_file import load_weights

SMALL = ["--device", "cpu", "--num-voxels", "3000", "--depth", "14", "--width", "0.25", "--repeats", "1"]


def _table_rows(output: str) -> list[list[str]]:
    paths = {path for path, _ in networks.convolutions(networks.minkunet(14, 3, 9, 0.25))}
    return [line.split() for line in output.splitlines() if line.split() and line.split()[0] in paths]


def test_demo_trains_with_falling_loss_and_writes_plot_and_weights(tmp_path, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    plot, weights = tmp_path / "scene.png", tmp_path / "trained.safetensors"
    arguments = SMALL + ["--train-steps", "3", "--plot", str(plot), "--save-weights", str(weights)]
    assert demo.main(arguments) == 0
    output = capsys.readouterr().out
    assert "framework torch" in output
    rows = _table_rows(output)
    assert len(rows) == len(networks.convolutions(networks.minkunet(14, 3, 9, 0.25)))
    convolutions = dict(networks.convolutions(networks.minkunet(14, 3, 9, 0.25)))
    for row in rows:  # the CPU's one algorithm, for every kernel size
        assert row[0] in convolutions and row[-2] == "explicit_gemm" and float(row[-1]) > 0, row
    losses = [float(value) for value in re.findall(r"step \d/3\s+loss (\S+)\s+[\d,]+ ms", output)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert re.search(r"accuracy\s+\S+% of voxels after training, mIoU \S+%", output)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(load_weights(weights)) >= set(networks.parameter_shapes(networks.minkunet(14, 3, 9, 0.25)))


def test_framework_free_demo_predicts_what_the_trained_torch_model_predicted(tmp_path, capsys):
    pytest.importorskip("torch")
    weights = tmp_path / "trained.safetensors"
    assert demo.main(SMALL + ["--train-steps", "2", "--save-weights", str(weights)]) == 0
    trained = re.search(r"accuracy\s+(\S+)% of voxels after training", capsys.readouterr().out).group(1)
    assert demo.main(SMALL + ["--framework", "cupy", "--weights", str(weights)]) == 0
    output = capsys.readouterr().out
    assert "framework cupy" in output
    assert re.search(r"accuracy\s+(\S+)% of voxels", output).group(1) == trained


def test_demo_runs_the_outdoor_scene_framework_free(capsys):
    assert demo.main(SMALL + ["--framework", "cupy", "--scene", "outdoor"]) == 0
    output = capsys.readouterr().out
    assert "outdoor_lidar" in output and len(_table_rows(output)) > 0


@pytest.mark.parametrize("arguments, message", [
    (["--num-voxels", "0"], "expected a count of at least 1"),
    (["--train-steps", "-1"], "--train-steps must be"),
    (["--repeats", "0"], "--repeats ≥ 1"),
    (["--width", "-1"], "--width must be a positive number"),
    (["--framework", "cupy", "--train-steps", "2"], "--train-steps needs PyTorch"),
    (["--weights", "no-such-file.safetensors"], "--weights: no such file"),
    (["--plot", "scene.txt"], "--plot: the file name must end in one of"),
    (["--plot", "no-such-folder/scene.png"], "the folder of no-such-folder/scene.png does not exist"),
    (["--save-weights", "no-such-folder/w.safetensors"], "does not exist"),
    (["--depth", "20"], "invalid choice"),
    (["--scene", "forest"], "invalid choice"),
])
def test_bad_arguments_exit_with_a_message(arguments, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args(["--device", "cpu"] + arguments)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cuda_without_a_gpu_is_refused(capsys):
    if backend.gpu_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        demo.parse_args(["--device", "cuda"])
    assert "no usable CUDA GPU" in capsys.readouterr().err


def test_defaults_pick_a_smaller_scene_and_float32_on_the_cpu():
    args = demo.parse_args(["--device", "cpu"])
    assert (args.num_voxels, args.dtype, args.depth) == (20_000, "float32", 18)
    assert args.framework in ("torch", "cupy")


def test_the_plot_shows_three_panels_the_scores_and_only_the_classes_present(tmp_path):
    pytest.importorskip("matplotlib")
    from cupysparse.data.scenes import make_scene

    scene = make_scene("indoor", 2000, seed=0)
    coordinates = np.zeros((4, 4), np.int32)
    coordinates[:, 1:] = [[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]]
    path = tmp_path / "tiny.svg"
    demo.plot_prediction(str(path), scene, coordinates, np.array([0, 1, 2, 3]), np.array([3, 2, 1, 0]),
                         "MinkUNet14", 1)
    text = path.read_text()
    assert text.count("<svg") == 1 and "prediction" in text and "labels" in text
    assert "errors: 100.0% of voxels wrong" in text
    assert "MinkUNet14, 1 training step: accuracy 0.0%, mIoU 0.0%" in text
    for present in ("floor", "wall", "ceiling", "table"):
        assert present in text
    for absent in ("chair", "cabinet", "bookshelf", "sofa", "box"):
        assert absent not in text


def test_segmentation_scores_count_as_by_hand():
    labels = np.array([0, 0, 0, 1, 1, 2, 2, 2, 4])
    predicted = np.array([0, 0, 1, 1, 2, 2, 2, 0, 4])
    accuracy, mean_iou = demo.segmentation_scores(labels, predicted, 5)
    ious = []
    for c in (0, 1, 2, 4):  # class 3 occurs in neither
        true, guess = set(np.flatnonzero(labels == c)), set(np.flatnonzero(predicted == c))
        ious.append(len(true & guess) / len(true | guess))
    assert accuracy == pytest.approx(6 / 9)
    assert mean_iou == pytest.approx(np.mean(ious))


def _room(width=40, depth=34, height=22):
    """Voxels of a box room: floor, four walls, ceiling, and a block inside; the side each lies on."""
    floor = np.mgrid[0:width + 1, 0:depth + 1, 0:1].reshape(3, -1).T
    sides = {
        "west": np.mgrid[0:1, 1:depth, 1:height].reshape(3, -1).T,
        "east": np.mgrid[width:width + 1, 1:depth, 1:height].reshape(3, -1).T,
        "south": np.mgrid[1:width, 0:1, 1:height].reshape(3, -1).T,
        "north": np.mgrid[1:width, depth:depth + 1, 1:height].reshape(3, -1).T,
        "ceiling": np.mgrid[1:width, 1:depth, height:height + 1].reshape(3, -1).T,
    }
    block = np.mgrid[15:20, 12:18, 1:6].reshape(3, -1).T
    xyz = np.concatenate([floor, *sides.values(), block])
    side = np.concatenate([np.full(len(floor), "floor"), *[np.full(len(v), k) for k, v in sides.items()],
                           np.full(len(block), "block")])
    wall, ceiling, inside = 1, 2, 3
    classes = np.select([side == "ceiling", np.isin(side, ["west", "east", "south", "north"]), side == "block"],
                        [ceiling, wall, inside], 0)
    return xyz, classes, side


@pytest.mark.parametrize("azimuth, facing", [(-60, {"east", "south"}), (120, {"west", "north"}),
                                             (30, {"east", "north"}), (-150, {"west", "south"})])
def test_the_walls_and_ceiling_between_the_camera_and_the_room_are_cut_away(azimuth, facing):
    xyz, classes, side = _room()
    for elevation, lid in ((35, {"ceiling"}), (-20, set())):
        keep = demo.cut_away(xyz, classes, np.isin(classes, [1, 2]), elevation, azimuth)
        # Away from the room's edges (where a voxel is on two surfaces) each voxel goes with its side.
        near_bounds = (xyz <= 1) | (xyz >= xyz.max(axis=0) - 1)
        away_from_edges = near_bounds.sum(axis=1) <= 1
        for name in ("floor", "block", "west", "east", "south", "north", "ceiling"):
            on_side = (side == name) & away_from_edges
            assert on_side.sum() > 20
            assert np.all(keep[on_side] == (name not in facing | lid)), (azimuth, elevation, name)


def test_the_street_facades_in_front_of_the_street_are_cut_away():
    from cupysparse.data.scenes import OUTDOOR_CLASSES

    scene, tensor, labels = demo.scene_tensor("outdoor", 150_000, 0, "cpu", np.float32)  # buildings both sides
    xyz = tensor.coordinates[:, 1:].astype(np.int64)
    building = labels == OUTDOOR_CLASSES.index("building")
    assert scene.name == "outdoor_lidar" and building.sum() > 1000
    keep = demo.cut_away(xyz, labels, building, 35, -60)
    street = xyz[~building]
    centre_y = (street[:, 1].min() + street[:, 1].max()) / 2
    near = building & (xyz[:, 1] < centre_y)  # the camera looks from -y
    far = building & (xyz[:, 1] > centre_y)
    assert near.sum() > 100 and far.sum() > 100
    assert np.mean(keep[near]) < 0.01 and np.mean(keep[far]) > 0.99
    assert np.all(keep[~building])
