"""`cupysparse-demo`: MinkUNet inference (and training) on a synthetic scene, layer by layer.

Builds an indoor room (or, with --scene outdoor, a street seen by a LiDAR), voxelises it, and runs
MinkUNet18 on it: on the GPU in fp16 when there is one (CuPy kernels), else on the CPU in fp32
(NumPy). The first pass compiles the kernels and tunes each layer's algorithm, with a progress
bar; the choices are cached on disk, so the next run skips that. Then it prints each
convolution with the algorithm chosen and its time, and the whole forward pass.

With PyTorch installed the network is the `torch.nn` module (`--framework torch`, the default
then); without it, or with `--framework cupy`, the same network runs framework-free
(`cupysparse.networks.inference`). `--train-steps N` trains for N steps on the scene's labels (PyTorch)
and prints the loss; `--plot FILE` draws the scene, with the walls between the viewer and the inside
cut away, coloured by true class, by predicted class and by where the prediction is wrong, with the
accuracy and mIoU in the title; `--weights` and `--save-weights` read and write safetensors files that
both frameworks share.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import numpy as np

from cupysparse.cuda import backend
from cupysparse.networks import descriptions as networks
from cupysparse.cuda.dtypes import as_feature_dtype, short_name
from cupysparse.functional.convolution import select_forward
from cupysparse.networks.inference import InferenceNetwork, LayerObserver
from cupysparse.scripts import arguments
from cupysparse.scripts.progress import Progress
from cupysparse.data.scenes import make_scene
from cupysparse.geometry.sparse_tensor import SparseTensor
from cupysparse.tuning.tuner import default_tuner
from cupysparse.networks.weights_file import load_weights, save_weights as save_arrays

FRAMEWORKS = ("auto", "torch", "cupy")
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg")
MAX_PLOTTED_VOXELS = 60_000
VIEW_ELEVATION_DEG, VIEW_AZIMUTH_DEG = 35.0, -60.0
# The surfaces that enclose a scene: where they stand between the camera and the inside, the picture cuts them away.
ENCLOSING_CLASSES = ("wall", "ceiling", "building")
# Surface normals are estimated per cube of this many voxels a side: enough for a few of a far LiDAR's scan lines.
NORMAL_CELL_VOXELS = 16
LEARNING_RATE = 1e-2


def _torch_or_none():
    try:
        import torch
    except ImportError:
        return None
    return torch


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or "cupysparse-demo", description=__doc__.split("\n\n")[0].split(": ", 1)[1], epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--scene", choices=("indoor", "outdoor"), default="indoor",
                        help="indoor rooms or outdoor LiDAR sweeps (cupysparse.data.scenes)")
    parser.add_argument("--num-voxels", type=arguments.count, default=None,
                        help="target voxel count, e.g. 200000 or 200K (default 200K on a GPU, 20K on the CPU)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="where to run: auto (the GPU if there is one), cuda or cpu")
    parser.add_argument("--framework", choices=FRAMEWORKS, default="auto",
                        help="torch (needs PyTorch) or cupy (framework-free: CuPy or NumPy); auto: torch when "
                             "installed")
    parser.add_argument("--dtype", choices=("auto", "float16", "bfloat16", "float32"), default="auto",
                        help="inference dtype (auto: float16 on the GPU, float32 on the CPU)")
    parser.add_argument("--depth", type=int, choices=sorted(networks.MINKUNET_BLOCKS), default=18,
                        help="MinkUNet14, 18 or 34")
    parser.add_argument("--width", type=float, default=1.0, help="channel width multiplier")
    parser.add_argument("--weights", metavar="FILE", help="safetensors weights to load (default: random)")
    parser.add_argument("--save-weights", metavar="FILE", help="write the weights (after training) to FILE")
    parser.add_argument("--train-steps", type=int, default=0, help="training steps on the scene (PyTorch)")
    parser.add_argument("--plot", metavar="FILE",
                        help=f"picture of the true and predicted classes and the errors ({', '.join(PLOT_SUFFIXES)})")
    parser.add_argument("--repeats", type=int, default=5, help="timed forward passes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the scene and of the random weights")
    return parser


def parse_args(argv=None, prog: str | None = None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    _resolve(parser, args)
    return args


def _resolve(parser, args) -> None:
    """Fill in the automatic choices and reject what cannot run, before any work starts."""
    if args.train_steps < 0 or args.repeats < 1:
        parser.error("--train-steps must be ≥ 0 and --repeats ≥ 1")
    if not (args.width > 0 and np.isfinite(args.width)):
        parser.error(f"--width must be a positive number, got {args.width}")
    if args.device == "auto":
        args.device = backend.default_device()
    elif args.device == "cuda" and not backend.gpu_available():
        parser.error("--device cuda: no usable CUDA GPU (see `python -m cupysparse info`)")
    torch = _torch_or_none()
    if args.framework == "auto":
        args.framework = "torch" if torch is not None else "cupy"
    if args.framework == "torch":
        if torch is None:
            parser.error("--framework torch needs PyTorch (pip install torch); --framework cupy runs without it")
        if args.device == "cuda" and not torch.cuda.is_available():
            parser.error("this PyTorch has no CUDA; use --framework cupy or --device cpu")
    if args.train_steps and args.framework != "torch":
        parser.error("--train-steps needs PyTorch's autograd: install torch or pass --framework torch")
    if args.dtype == "auto":
        args.dtype = "float16" if args.device == "cuda" else "float32"
    if args.num_voxels is None:
        args.num_voxels = 200_000 if args.device == "cuda" else 20_000
    if args.weights is not None and not os.path.isfile(args.weights):
        parser.error(f"--weights: no such file: {args.weights}")
    for option, path in (("--save-weights", args.save_weights), ("--plot", args.plot)):
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"{option}: the folder of {path} does not exist")
    if args.plot is not None:
        if not args.plot.lower().endswith(PLOT_SUFFIXES):
            parser.error(f"--plot: the file name must end in one of {', '.join(PLOT_SUFFIXES)}, got {args.plot}")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'cupysparse[plot]'")


class _Clock:
    """Elapsed milliseconds: CUDA events on the GPU (no synchronisation until read), else perf_counter."""

    def __init__(self, device: str):
        self._cupy = backend.cupy_module() if device == "cuda" else None

    def mark(self):
        if self._cupy is None:
            return time.perf_counter()
        event = self._cupy.cuda.Event()
        event.record()
        return event

    def elapsed_ms(self, start, end) -> float:
        if self._cupy is None:
            return (end - start) * 1e3
        end.synchronize()
        return self._cupy.cuda.get_elapsed_time(start, end)

    def time_ms(self, fn):
        start = self.mark()
        result = fn()
        return result, self.elapsed_ms(start, self.mark())


class _TuningProgress(LayerObserver):
    """Advances a progress bar as each convolution of the first pass finishes (compiling and tuning)."""

    def __init__(self, total: int, doing: str):
        self._progress = Progress(total, quiet_steps=True)
        self._doing = doing
        self._done = 0

    def before(self, path, layer, input):
        self._progress.show(self._done, f"{self._doing} {path}")

    def after(self, path, layer, input, output, weight):
        self._done += 1
        self._progress.show(self._done, f"{self._doing} {path}")

    def finish(self) -> None:
        self._progress.clear()


class _LayerTable(LayerObserver):
    """One row per convolution: its shape, the algorithm the tuner chose, and its time."""

    def __init__(self, clock: _Clock):
        self._clock = clock
        self._starts = {}
        self.rows = []

    def before(self, path, layer, input):
        self._starts[path] = self._clock.mark()

    def after(self, path, layer, input, output, weight):
        kernel_map = input.kernel_map(layer.kernel_size, layer.stride, 1, layer.transposed).kernel_map
        algorithm = select_forward(input.features, weight, kernel_map).algorithm.name
        self.rows.append((path, layer, len(input), len(output), algorithm, self._starts.pop(path), self._clock.mark()))

    def print(self) -> float:
        print(f"{'layer':<32} {'kind':<15} {'voxels in → out':>21} {'channels':>10}  {'algorithm':<20} {'ms':>8}")
        total = 0.0
        for path, layer, num_in, num_out, algorithm, start, end in self.rows:
            elapsed = self._clock.elapsed_ms(start, end)
            total += elapsed
            kind = f"{layer.kind()} {'x'.join(map(str, np.broadcast_to(layer.kernel_size, 3)))}"
            channels = f"{layer.in_channels}→{layer.out_channels}"
            print(f"{path:<32} {kind:<15} {f'{num_in:,} → {num_out:,}':>21} {channels:>10}  {algorithm:<20} "
                  f"{elapsed:>8.3f}")
        print(f"{f'all {len(self.rows)} convolutions':<82} {total:>8.3f}")
        return total


class _Runner:
    """The demo's network in one framework: forward passes on core tensors, training where supported.

    With PyTorch the trained model keeps float32 weights; inference runs a copy in the inference
    dtype, made again after training."""

    def __init__(self, args, description: networks.Network):
        self.args = args
        self.torch = _torch_or_none() if args.framework == "torch" else None
        if self.torch is None:
            self._weights = networks.random_weights(description, args.seed) if args.weights is None else args.weights
            self._network = InferenceNetwork(description, self._weights, args.device, args.dtype)
            return
        from cupysparse.adapters.torch.networks import SparseNetwork, load_weights_into

        self.torch.manual_seed(args.seed)
        self._model = SparseNetwork(description).to(self._torch_device())
        if args.weights is not None:
            load_weights_into(self._model, args.weights)
        self._inference_model = None

    def _torch_device(self):
        return self.torch.device("cuda" if self.args.device == "cuda" else "cpu")

    @staticmethod
    def _torch_input(tensor: SparseTensor, dtype: str):
        """A torch view of `tensor` in `dtype`, sharing its kernel maps."""
        from cupysparse.adapters.torch import SparseTensor as TorchSparseTensor

        if tensor.dtype != as_feature_dtype(dtype):
            tensor = tensor.replace_features(tensor.features.astype(dtype))
        return TorchSparseTensor.from_core(tensor)

    def _eval_model(self):
        if self._inference_model is None:
            dtype = getattr(self.torch, self.args.dtype)
            model = self._model if dtype == self.torch.float32 else copy.deepcopy(self._model).to(dtype)
            self._inference_model = model.eval()
        return self._inference_model

    def forward(self, tensor: SparseTensor, observer: LayerObserver | None = None):
        """Logits `[N, classes]` (core array) of `tensor` (a core tensor in the inference dtype)."""
        if self.torch is None:
            return self._network(tensor, observer).features
        from cupysparse.adapters.torch.bridge import to_core
        from cupysparse.adapters.torch.networks import observe_convolutions

        model = self._eval_model()
        handles = observe_convolutions(model, observer) if observer is not None else []
        try:
            with self.torch.no_grad():
                return to_core(model(self._torch_input(tensor, self.args.dtype)).features)
        finally:
            for handle in handles:
                handle.remove()

    def train(self, tensor: SparseTensor, labels: np.ndarray, steps: int) -> list[float]:
        """Losses of `steps` Adam steps on the per-voxel cross-entropy; on the GPU in mixed precision
        (float32 weights, convolutions in the inference dtype under autocast)."""
        torch = self.torch
        model = self._model.train()
        self._inference_model = None
        optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
        target = torch.as_tensor(labels, dtype=torch.long, device=self._torch_device())
        inputs = self._torch_input(tensor, "float32")
        autocast = self.args.device == "cuda" and self.args.dtype != "float32"
        scaler = torch.amp.GradScaler("cuda", enabled=autocast and self.args.dtype == "float16")
        losses = []
        for step in range(steps):
            begin = time.perf_counter()
            with torch.autocast("cuda", dtype=getattr(torch, self.args.dtype), enabled=autocast):
                logits = model(inputs).features
            loss = torch.nn.functional.cross_entropy(logits.float(), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())  # waits for the step: the time below is the whole step's
            print(f"  step {step + 1}/{steps}  loss {losses[-1]:.4f}  {(time.perf_counter() - begin) * 1e3:,.0f} ms")
        return losses

    def save_weights(self, path: str) -> None:
        if self.torch is None:
            save_arrays(path, load_weights(self._weights) if isinstance(self._weights, str) else self._weights)
            return
        from cupysparse.adapters.torch.networks import save_weights

        save_weights(self._model, path)


def scene_tensor(kind: str, num_voxels: int, seed: int, device: str, dtype):
    """The demo's input: (scene, core tensor of its voxels on `device` with the normalised xyz
    coordinates as `dtype` features, per-voxel labels as NumPy int64)."""
    scene = make_scene(kind, num_voxels, seed=seed)
    low = scene.points.min(axis=0)
    extent = np.maximum(scene.points.max(axis=0) - low, 1e-6)
    # The label rides along as a fourth feature column: "first" keeps it exact (a mean would blend classes).
    per_point = np.concatenate([(scene.points - low) / extent, scene.labels[:, None]], axis=1).astype(np.float32)
    voxels = SparseTensor.from_points(backend.to_device(scene.points, device), scene.voxel_size,
                                      features=backend.to_device(per_point, device), reduce="first")
    labels = backend.to_numpy(voxels.features[:, 3]).astype(np.int64)
    features = voxels.features[:, :3].astype(dtype)
    return scene, voxels.replace_features(backend.array_module(features).ascontiguousarray(features)), labels


def _fresh(tensor: SparseTensor) -> SparseTensor:
    """The same voxels with an empty kernel-map cache: a forward on it builds its maps again."""
    return SparseTensor(tensor.coordinates, tensor.features, tensor.tensor_stride, validate=False)


def _median_ms(clock: _Clock, fn, repeats: int) -> float:
    return float(np.median([clock.time_ms(fn)[1] for _ in range(repeats)]))


def segmentation_scores(labels: np.ndarray, predicted: np.ndarray, num_classes: int) -> tuple[float, float]:
    """(accuracy, mean IoU over the classes present in the labels or the prediction) of per-voxel classes."""
    confusion = np.bincount(labels * num_classes + predicted, minlength=num_classes**2).reshape(num_classes, -1)
    hits = np.diag(confusion)
    union = confusion.sum(axis=0) + confusion.sum(axis=1) - hits
    present = union > 0
    return float(hits.sum() / max(confusion.sum(), 1)), float(np.mean(hits[present] / union[present]))


def _normal_axes(xyz: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """The axis each voxel's surface is normal to, for voxels `xyz` `[M, 3]` of classes `classes` on
    axis-aligned surfaces: of the three axis-aligned slabs three voxels thick centred on the voxel (a
    LiDAR's range noise thickens a facade), the one whose voxels of its class in its cube of
    `NORMAL_CELL_VOXELS` cover the largest area of the slab's plane. Ties go to x, then y, then z."""
    offset = xyz - xyz.min(axis=0)
    # The last cube along each axis takes the remainder, so none is thinner than NORMAL_CELL_VOXELS: in a
    # thin one, a wall meeting the voxel's surface could cover more of a slab than the surface itself.
    cells = np.minimum(offset // NORMAL_CELL_VOXELS, np.maximum(offset.max(axis=0) // NORMAL_CELL_VOXELS - 1, 0))
    local = offset - cells * NORMAL_CELL_VOXELS
    side = int(local.max()) + 1
    _, patch = np.unique(np.column_stack([classes, cells]), axis=0, return_inverse=True)
    patch = patch.ravel().astype(np.int64)
    area = np.zeros((len(xyz), 3), np.int64)
    for axis in range(3):
        u, v = np.delete(local, axis, axis=1).T
        slab = patch * (side + 2) + local[:, axis] + 1  # one below and one above stay in the patch's range
        # A voxel covers its pixel (u, v) of the slabs centred one below it, on it and one above it.
        covered = np.unique(np.concatenate([((slab + step) * side + u) * side + v for step in (-1, 0, 1)]))
        slabs, areas = np.unique(covered // (side * side), return_counts=True)
        area[:, axis] = areas[np.searchsorted(slabs, slab)]
    return area.argmax(axis=1)


def cut_away(xyz: np.ndarray, classes: np.ndarray, enclosing: np.ndarray, elevation_deg: float,
             azimuth_deg: float) -> np.ndarray:
    """Which voxels `xyz` `[N, 3]` of classes `classes` to draw for a camera at matplotlib's `elevation_deg`
    and `azimuth_deg`: all but the enclosing ones (mask `enclosing`: walls, ceilings, buildings) that
    stand between the camera and the scene's inside, i.e. whose surface's outward normal faces the
    camera. The normal is along the surface's axis (`_normal_axes`) and points away from the centre of
    the bounding box of what the surfaces enclose (all voxels when they enclose nothing)."""
    keep = np.ones(len(xyz), bool)
    surface = np.flatnonzero(enclosing)
    if len(surface) == 0:
        return keep
    inside = xyz[~enclosing] if np.any(~enclosing) else xyz
    centre = (inside.min(axis=0) + inside.max(axis=0)) / 2
    elevation, azimuth = np.radians(elevation_deg), np.radians(azimuth_deg)
    towards_camera = np.array([np.cos(elevation) * np.cos(azimuth), np.cos(elevation) * np.sin(azimuth),
                               np.sin(elevation)])
    axes = _normal_axes(xyz[surface], classes[surface])
    outward = np.sign(xyz[surface, axes] - centre[axes])
    keep[surface[outward * towards_camera[axes] > 0]] = False
    return keep


def plot_prediction(path: str, scene, coordinates: np.ndarray, labels: np.ndarray, predicted: np.ndarray,
                    model: str = "", train_steps: int = 0) -> None:
    """The voxels coloured by true class, by predicted class, and by whether the prediction is right,
    side by side, looking into the scene (`cut_away`); accuracy, mIoU and training steps in the title,
    a legend of the classes present (in the labels or the prediction). `model` names the network."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    xyz = coordinates[:, 1:].astype(np.int64)
    enclosing = np.isin(labels, [i for i, name in enumerate(scene.class_names) if name in ENCLOSING_CLASSES])
    chosen = np.flatnonzero(cut_away(xyz, labels, enclosing, VIEW_ELEVATION_DEG, VIEW_AZIMUTH_DEG))
    if len(chosen) > MAX_PLOTTED_VOXELS:
        chosen = np.random.default_rng(0).choice(chosen, MAX_PLOTTED_VOXELS, replace=False)
    xyz = xyz[chosen].astype(np.float32)
    accuracy, mean_iou = segmentation_scores(labels, predicted, len(scene.class_names))
    wrong = labels[chosen] != predicted[chosen]
    colours = plt.get_cmap("tab10")
    marker_size = float(np.clip(MAX_PLOTTED_VOXELS / max(len(chosen), 1), 1.0, 6.0))
    panels = (("labels", colours(labels[chosen] % 10)), ("prediction", colours(predicted[chosen] % 10)),
              (f"errors: {np.mean(labels != predicted):.1%} of voxels wrong",
               np.where(wrong[:, None], matplotlib.colors.to_rgba_array("tab:red"),
                        matplotlib.colors.to_rgba_array("0.8"))))
    marker = {"marker": "o", "linestyle": ""}
    figure = plt.figure(figsize=(19, 6.8))
    for index, (title, colour) in enumerate(panels):
        axes = figure.add_subplot(1, len(panels), index + 1, projection="3d")
        axes.scatter(xyz[:, 0], xyz[:, 1], xyz[:, 2], c=colour, s=marker_size, linewidths=0, depthshade=False)
        axes.set_title(title)
        axes.view_init(elev=VIEW_ELEVATION_DEG, azim=VIEW_AZIMUTH_DEG)
        axes.set_box_aspect(np.ptp(xyz, axis=0) + 1 if len(xyz) else None)
        axes.set_axis_off()
    # The errors' own legend, apart from the classes': red is also a class's colour.
    axes.legend(handles=[plt.Line2D([], [], color="0.8", label="right", **marker),
                         plt.Line2D([], [], color="tab:red", label="wrong", **marker)],
                loc="lower center", ncol=2, frameon=False, fontsize=11)
    steps = f"{train_steps} training step{'' if train_steps == 1 else 's'}"
    figure.suptitle(f"{scene.name}, {len(labels):,} voxels{f' — {model}' if model else ''}, {steps}: "
                    f"accuracy {accuracy:.1%}, mIoU {mean_iou:.1%}", fontsize=14)
    present = np.union1d(labels, predicted)
    handles = [plt.Line2D([], [], color=colours(i % 10), label=scene.class_names[i], **marker) for i in present]
    figure.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False, fontsize=11)
    figure.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(figure)


def main(argv=None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    clock = _Clock(args.device)
    print(f"cupysparse demo on {backend.describe_device(args.device)}, framework {args.framework}, "
          f"{short_name(as_feature_dtype(args.dtype))}")

    begin = time.perf_counter()
    scene, tensor, labels = scene_tensor(args.scene, args.num_voxels, args.seed, args.device, args.dtype)
    print(f"scene     {scene.name}: {len(scene.points):,} points → {len(tensor):,} voxels of "
          f"{scene.voxel_size * 100:g} cm, {len(scene.class_names)} classes ({(time.perf_counter() - begin):.1f} s)")
    description = networks.minkunet(args.depth, 3, len(scene.class_names), args.width)
    shapes = networks.parameter_shapes(description)
    num_parameters = sum(int(np.prod(shape)) for name, shape in shapes.items() if "running" not in name)
    runner = _Runner(args, description)
    print(f"network   {description.name}: {len(networks.convolutions(description))} convolutions, "
          f"{num_parameters / 1e6:.1f}M parameters, weights {args.weights or 'random'}")

    measured = default_tuner().measurements
    doing = "compiling and tuning" if args.device == "cuda" else "building kernel maps for"
    progress = _TuningProgress(len(networks.convolutions(description)), doing)
    begin = time.perf_counter()
    runner.forward(tensor, progress)
    progress.finish()
    tuned = default_tuner().measurements - measured
    work = "kernel maps" if args.device == "cpu" else (
        f"kernel maps, compiling, {f'{tuned} problems tuned' if tuned else 'choices from the tuning cache'}")
    print(f"first     pass {time.perf_counter() - begin:.1f} s ({work})")

    table = _LayerTable(clock)
    logits = runner.forward(tensor, table)
    print()
    table.print()
    cached = _median_ms(clock, lambda: runner.forward(tensor), args.repeats)
    built = _median_ms(clock, lambda: runner.forward(_fresh(tensor)), args.repeats)
    print(f"\nforward   {cached:.2f} ms with the kernel maps cached, {built:.2f} ms building them "
          f"(median of {args.repeats})")
    predicted = backend.to_numpy(logits.argmax(axis=1))
    num_classes = len(scene.class_names)
    accuracy, mean_iou = segmentation_scores(labels, predicted, num_classes)
    print(f"accuracy  {accuracy:.1%} of voxels, mIoU {mean_iou:.1%} ({args.weights or 'random weights'})")

    if args.train_steps:
        print(f"\ntraining  {args.train_steps} steps, Adam lr {LEARNING_RATE:g}, cross-entropy on the voxel labels")
        losses = runner.train(tensor, labels, args.train_steps)
        trend = "falling" if losses[-1] < losses[0] else "NOT falling"
        print(f"loss      {losses[0]:.4f} → {losses[-1]:.4f} ({trend})")
        predicted = backend.to_numpy(runner.forward(tensor).argmax(axis=1))
        accuracy, mean_iou = segmentation_scores(labels, predicted, num_classes)
        print(f"accuracy  {accuracy:.1%} of voxels after training, mIoU {mean_iou:.1%}")
    if args.save_weights:
        runner.save_weights(args.save_weights)
        print(f"weights   written to {args.save_weights}")
    if args.plot:
        weights = f"weights {os.path.basename(args.weights)}" if args.weights else "random weights"
        model = f"{description.name}, {weights}"
        plot_prediction(args.plot, scene, backend.to_numpy(tensor.coordinates), labels, predicted, model,
                        args.train_steps)
        print(f"plot      written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
