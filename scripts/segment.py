"""`python -m cupysparse segment` (also `cupysparse-segment`): one class label per point of point-cloud files.

    python -m cupysparse segment 000000.bin --voxel-size 0.05                  # writes 000000.labels.npy
    python -m cupysparse segment scans/*.bin --voxel-size 0.05 --output labels/ --weights minkunet18.safetensors
    python -m cupysparse segment room.ply --voxel-size 0.02 --output room.npy --plot room.png

Each file is read with `cupysparse.data.read_points` (.bin, .npy, .npz, .ply, .pcd, .las, .laz) and
voxelised at `--voxel-size` (in the file's units, metres for LiDAR). A voxel's input features are the
normalised x, y, z of its first point (the scan's bounding box mapped to 0..1, as `cupysparse-demo` trains
with), so the file's own feature columns are not used and any format gives the same input. The network runs
framework-free (`cupysparse.networks.inference`: CuPy on the GPU in float16, else NumPy in float32); each
point gets the argmax class of its voxel, written as int32 `[P]` in the file's order with `np.save`.

Outputs: for one file, `--output` is the `.npy` path (or a folder); for several, a folder (created if
missing). Without `--output`, each file's labels go next to it as NAME.labels.npy. The number of classes
comes from the weights file (`classifier.weight`, as `cupysparse-demo --save-weights` and
`adapters.torch.networks.save_weights` write it); without `--weights` the weights are random, fixed by
`--seed`, with 20 classes: they exercise the pipeline, their labels mean nothing (an untrained network's
classifier bias picks one class almost everywhere). `--plot` (one file; needs matplotlib,
`pip install 'cupysparse[plot]'`) draws the points seen from above, coloured by label. Any error exits with
status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

from cupysparse.cuda import backend
from cupysparse.data.point_clouds import read_points
from cupysparse.geometry.sparse_tensor import SparseTensor
from cupysparse.networks import descriptions as networks
from cupysparse.networks.inference import IGNORED_SUFFIXES, InferenceNetwork
from cupysparse.networks.weights_file import load_weights
from cupysparse.scripts.progress import Progress

NETWORKS = {f"minkunet{depth}": depth for depth in sorted(networks.MINKUNET_BLOCKS)}
IN_CHANNELS = 3  # the normalised x, y, z of each voxel
RANDOM_WEIGHTS_CLASSES = 20  # minkunet's default: SemanticKITTI's 19 classes and "unlabelled"
CLASSIFIER_WEIGHT = "classifier.weight"
LABELS_SUFFIX = ".labels.npy"
MAX_PLOTTED_POINTS = 100_000


class SegmentError(Exception):
    """A problem with the user's input, reported as one line and exit status 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="point-cloud files: .bin (KITTI), .npy, .npz, .ply, .pcd, .las, .laz")
    parser.add_argument("--voxel-size", type=float, required=True, metavar="S",
                        help="voxel edge length, in the files' units (e.g. 0.05 for 5 cm in metres)")
    parser.add_argument("--weights", metavar="W",
                        help="safetensors weights of the network (default: random, fixed by --seed)")
    parser.add_argument("--network", default="minkunet18", metavar="NAME",
                        help=f"the network: {', '.join(NETWORKS)} (default minkunet18)")
    parser.add_argument("--output", metavar="OUT",
                        help="one file: the .npy to write (or a folder); several: the folder to write them in "
                             f"(default: NAME{LABELS_SUFFIX} next to each file)")
    parser.add_argument("--plot", metavar="PNG", help="draw the labelled points of the (one) file into this picture")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights without --weights (default 0)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="where the network runs (auto: the GPU when there is one)")


def _check_arguments(args: argparse.Namespace) -> None:
    """Reject what cannot run before any file is read, so that a mistake costs no work."""
    if not (args.voxel_size > 0 and math.isfinite(args.voxel_size)):
        raise SegmentError(f"--voxel-size must be a positive number, got {args.voxel_size:g}")
    if args.network not in NETWORKS:
        raise SegmentError(f"unknown network {args.network!r}; --network takes {', '.join(NETWORKS)}")
    if args.seed < 0:
        raise SegmentError(f"--seed must be ≥ 0, got {args.seed}")
    if args.device == "cuda" and not backend.gpu_available():
        raise SegmentError("--device cuda: no usable CUDA GPU (see `python -m cupysparse info`)")
    for path in args.files:
        if not os.path.isfile(path):
            raise SegmentError(f"no such file: {path}")
    if args.weights is not None and not os.path.isfile(args.weights):
        raise SegmentError(f"--weights: no such file: {args.weights}")
    if args.plot is not None:
        if len(args.files) > 1:
            raise SegmentError(f"--plot draws one scan; {len(args.files)} files were given")
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
            raise SegmentError(f"--plot: the folder of {args.plot} does not exist")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SegmentError("--plot needs matplotlib: pip install 'cupysparse[plot]'") from None


def output_paths(files: list[str], output: str | None) -> list[Path]:
    """Where each file's labels go; two inputs never share an output and no input is overwritten."""
    inputs = [Path(file) for file in files]
    if output is None:
        paths = [file.with_name(file.stem + LABELS_SUFFIX) for file in inputs]
    elif len(inputs) == 1 and not os.path.isdir(output):
        if not output.endswith(".npy"):
            raise SegmentError(f"--output: the labels are written as .npy; {output} must end in .npy (or be a folder)")
        if not os.path.isdir(os.path.dirname(os.path.abspath(output))):
            raise SegmentError(f"--output: the folder of {output} does not exist")
        paths = [Path(output)]
    else:
        folder = Path(output)
        if folder.suffix == ".npy":
            raise SegmentError(f"--output: {len(inputs)} files write one .npy each into a folder, not into {output}")
        if folder.exists() and not folder.is_dir():
            raise SegmentError(f"--output: {output} is a file, not a folder")
        paths = [folder / (file.stem + LABELS_SUFFIX) for file in inputs]
    resolved = [path.resolve() for path in paths]
    for index, path in enumerate(resolved):
        if path in resolved[:index]:
            raise SegmentError(f"{files[resolved.index(path)]} and {files[index]} would both write {paths[index]}: "
                               "give them different names or segment them separately")
    overwritten = set(resolved) & {file.resolve() for file in inputs}
    if overwritten:
        raise SegmentError(f"the labels would overwrite the input {sorted(overwritten)[0]}")
    return paths


def _tensors(count: int) -> str:
    return f"{count} tensor{'' if count == 1 else 's'}"


def _mismatch(network: networks.Network, weights: dict) -> str | None:
    """What keeps `weights` from fitting `network`, in one line, or None when they fit."""
    expected = networks.parameter_shapes(network)
    missing = [name for name in expected if name not in weights]
    unexpected = [name for name in weights if name not in expected and not name.endswith(IGNORED_SUFFIXES)]
    problems = []
    if missing:
        problems.append(f"{_tensors(len(missing))} of its {len(expected)} missing (first {missing[0]!r})")
    if unexpected:
        problems.append(f"{_tensors(len(unexpected))} it does not have (first {unexpected[0]!r})")
    if not problems:
        wrong = [(name, tuple(weights[name].shape), shape) for name, shape in expected.items()
                 if tuple(weights[name].shape) != shape]
        if wrong:
            name, found, shape = wrong[0]
            problems.append(f"{_tensors(len(wrong))} of another shape (first {name!r}: {found}, expected {shape})")
    return "; ".join(problems) or None


def build_network(args: argparse.Namespace) -> tuple[InferenceNetwork, str]:
    """The network with its weights on the device, and where the weights came from."""
    depth = NETWORKS[args.network]
    if args.weights is None:
        description = networks.minkunet(depth, IN_CHANNELS, RANDOM_WEIGHTS_CLASSES)
        return InferenceNetwork(description, networks.random_weights(description, args.seed), args.device), \
            f"random (seed {args.seed})"
    try:
        weights = load_weights(args.weights)
    except (ValueError, OSError) as error:
        raise SegmentError(f"--weights: cannot read {args.weights}: {error}") from None
    classifier = weights.get(CLASSIFIER_WEIGHT)
    if classifier is None or classifier.ndim != 3:
        raise SegmentError(f"--weights {args.weights} does not fit {args.network}: it has no classifier "
                           f"({CLASSIFIER_WEIGHT!r} [1, C_in, classes]); is it a {args.network} state dict?")
    description = networks.minkunet(depth, IN_CHANNELS, int(classifier.shape[2]))
    problem = _mismatch(description, weights)
    if problem is not None:
        raise SegmentError(f"--weights {args.weights} does not fit {description.name} with {IN_CHANNELS} input "
                           f"channels (normalised x, y, z): {problem}")
    return InferenceNetwork(description, weights, args.device), args.weights


def voxel_features(points: np.ndarray) -> np.ndarray:
    """Each point's x, y, z with the scan's bounding box mapped to 0..1 (float32 [P, 3])."""
    if not len(points):
        return points
    low = points.min(axis=0)
    extent = np.maximum(points.max(axis=0) - low, 1e-6)  # a flat scan keeps its zero axis at 0
    return ((points - low) / extent).astype(np.float32)


def segment_points(network: InferenceNetwork, points: np.ndarray, voxel_size: float) -> tuple[np.ndarray, int]:
    """(int32 label of each point, number of voxels): the argmax class of the point's voxel."""
    device = network.device
    # "first" (not a mean) as the demo voxelises its training scenes, so the weights it saves see the same input.
    tensor, point_to_voxel = SparseTensor.from_points(
        backend.to_device(points, device), voxel_size, features=backend.to_device(voxel_features(points), device),
        reduce="first", return_index=True)
    tensor = tensor.replace_features(tensor.features.astype(network.dtype))
    voxel_labels = network(tensor).features.argmax(axis=1)
    return backend.to_numpy(voxel_labels[point_to_voxel]).astype(np.int32), len(tensor)


def plot_labels(path: str, points: np.ndarray, labels: np.ndarray, title: str) -> None:
    """The points seen from above, coloured by label, the highest drawn last; a legend of the classes present."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    chosen = np.arange(len(points))
    if len(chosen) > MAX_PLOTTED_POINTS:
        chosen = np.sort(np.random.default_rng(0).choice(chosen, MAX_PLOTTED_POINTS, replace=False))
    chosen = chosen[np.argsort(points[chosen, 2], kind="stable")]  # from above, the top surface must stay visible
    colours = plt.get_cmap("tab20")
    figure, axes = plt.subplots(figsize=(9, 9))
    axes.scatter(points[chosen, 0], points[chosen, 1], c=colours(labels[chosen] % 20), s=1.0, linewidths=0)
    axes.set_aspect("equal")
    axes.set_title(title)
    axes.set_xlabel("x")
    axes.set_ylabel("y")
    classes, counts = np.unique(labels, return_counts=True)
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=colours(label % 20),
                          label=f"class {label} ({count:,})") for label, count in zip(classes, counts)]
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, title="points")
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)


def _read(path: str) -> np.ndarray:
    try:
        points, _ = read_points(path)  # the file's features are not the network's input (see the module's doc)
    except (ValueError, ImportError, OSError) as error:
        raise SegmentError(str(error)) from None
    return points


def _segment_files(args: argparse.Namespace) -> None:
    _check_arguments(args)
    outputs = output_paths(args.files, args.output)
    network, weights_source = build_network(args)
    print(f"network     {network.network.name} on {backend.describe_device(network.device)}, "
          f"{network.network.out_channels} classes, weights {weights_source}")
    if len(args.files) > 1:
        outputs[0].parent.mkdir(parents=True, exist_ok=True)
    progress = Progress(len(args.files), quiet_steps=True)
    total_points = total_voxels = 0
    seconds = 0.0
    for index, (file, output) in enumerate(zip(args.files, outputs)):
        progress.show(index, f"segmenting {file}")
        try:
            points = _read(file)
            begin = time.perf_counter()
            labels, num_voxels = segment_points(network, points, args.voxel_size)
            seconds += time.perf_counter() - begin
        except ValueError as error:  # non-finite points, or voxel coordinates beyond the key packing
            raise SegmentError(f"{file}: {error}") from None
        finally:
            progress.clear()  # so that what is printed next, the error too, starts a clean line
        total_points += len(points)
        total_voxels += num_voxels
        np.save(output, labels)
        print(f"{file}: {len(points):,} points → {num_voxels:,} voxels, labels written to {output}")
        if args.plot is not None:
            plot_labels(args.plot, points, labels, f"{Path(file).name}: {network.network.name}, {weights_source}")
            print(f"plot        written to {args.plot}")
    progress.show(len(args.files), "done")
    progress.clear()
    seconds = max(seconds, time.get_clock_info("perf_counter").resolution)  # empty scans take no measurable time
    print(f"throughput  {total_points / seconds:,.0f} points/s, {total_voxels / seconds:,.0f} voxels/s "
          f"({total_points:,} points, {total_voxels:,} voxels in {seconds:.2f} s: voxelising, network and "
          "per-point labels; reading and writing excluded)")


def run(args: argparse.Namespace) -> int:
    try:
        _segment_files(args)
    except SegmentError as error:
        print(f"cupysparse segment: error: {error}", file=sys.stderr)
        return 2
    return 0


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog or "cupysparse-segment", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return run(build_parser(prog).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
