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
    losses = [float(value) for value in re.findall(r"step \d/3\s+loss (\S+)", output)]
    assert len(losses) == 3 and losses[-1] < losses[0]
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
    (["--num-voxels", "0"], "--num-voxels must be positive"),
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


def test_the_plot_colours_each_voxel_by_its_class(tmp_path):
    pytest.importorskip("matplotlib")
    from cupysparse.data.scenes import make_scene

    scene = make_scene("indoor", 2000, seed=0)
    coordinates = np.zeros((4, 4), np.int32)
    coordinates[:, 1:] = [[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]]
    path = tmp_path / "tiny.svg"
    demo.plot_prediction(str(path), scene, coordinates, np.array([0, 1, 2, 3]), np.array([3, 2, 1, 0]))
    text = path.read_text()
    assert text.count("<svg") == 1 and "prediction" in text and "labels" in text
