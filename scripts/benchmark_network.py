"""End to end: a whole MinkUNet, inference and a training step, cupysparse against spconv 2.x.

The network is MinkUNet18 (--depth 14 / 18 / 34, --width scales the channels) on a batch of
--batch-size indoor scenes (`cupysparse.data.scenes`, seeds 0, 1, ...) of about --num-voxels voxels
each. Each voxel's input is the xyz of its first point, normalised per scene to [0, 1] (minus
the scene's minimum, divided by its extent); its label, that point's label, is the target of the
loss. Both models are pure --dtype (float16 by default: `.half()`, parameters, batch-norm
statistics and activations alike; no autocast, no master weights) and hold the same weights.

Two phases, each on a fresh input tensor every run, so both libraries build every kernel map (the
pairs of each layer) as for a new scene; the coordinates come from voxelisation, unique and
sorted, and neither library checks them (`validate=False` on our side, spconv never does):
- inference: `model.eval()`, `torch.no_grad()`, one forward;
- training step: `model.train()`, forward, cross-entropy on the per-voxel logits (in float32),
  backward, `optimizer.step()` (SGD, lr 0.01, momentum 0.9), `zero_grad(set_to_none=True)`.
Each is timed by CUDA events (on the CPU: the host clock), median of --repeats runs after
--warmup runs; ratio = cupysparse / spconv (< 1: cupysparse is faster). Peak memory: one more
run after `torch.cuda.reset_peak_memory_stats()`, `max_memory_allocated()` minus what was
allocated before it (model, optimizer state and inputs stay resident, so they are not counted).
CuPy allocates from torch's caching allocator for the whole run: the adapter does that inside
its convolution calls, and the routing covers the rest, kernel-map building included.

The first call of each phase compiles kernels and runs the tuners (ours benchmarks candidate
algorithms per layer shape, spconv tunes its GEMMs); it is made before any timing and its wall
time is reported separately as "first call (compile + tune)". Our tuner keeps its results in the
persistent benchmark cache, so on a later run with the same shapes that call only loads them.

spconv (when `spconv.pytorch` imports, on CUDA, in float16 or float32: spconv has no bfloat16;
--no-spconv skips it) runs the same network, built from `model.description`: SubMConv3d with one
indice_key per (resolution level, kernel size), so layers reuse pairs as ours reuse maps;
SparseConv3d (2^3, stride 2, padding 0) for the strided convolutions, each with its own key, which
the SparseInverseConv3d inverting it reuses; torch BatchNorm1d and ReLU on the features. It gets
our weights, converted to its layout, and our batch-norm statistics. Its coordinates are shifted
by a multiple of the coarsest level's stride (non-negative, and every level's coordinates
floor(x / stride) stay ours). Before timing, both inference outputs of one input are compared; a
maximum difference above 1e-2 of the largest output is reported loudly.

    cupysparse-benchmark-network --depth 18 --batch-size 2 --num-voxels 200000 --csv network.csv
    cupysparse-benchmark-network --csv results/network.csv --markdown results/network.md
    cupysparse-benchmark-network --from-csv results/network.csv --markdown results/network.md

--markdown writes a results page from the --csv file and the run's metadata (command, device), which
goes to NAME.json beside NAME.csv; --from-csv measures nothing and writes the page again from such
files.

Needs PyTorch. Without a GPU it runs the cupysparse part on the CPU (NumPy kernels, torch CPU
tensors), without spconv and without peak memory.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from cupysparse.cuda import backend
from cupysparse.networks import descriptions as networks
from cupysparse.adapters.torch import SparseTensor as TorchSparseTensor
from cupysparse.adapters.torch.networks import MinkUNet14, MinkUNet18, MinkUNet34
from cupysparse.geometry.coords import as_tuple
from cupysparse.data.scenes import INDOOR_MIN_NUM_VOXELS, MAX_NUM_VOXELS, make_scene
from cupysparse.scripts.analyze_benchmarks import (
    add_results_page_arguments,
    check_results_page_arguments,
    relative,
    write_metadata,
    write_results_page,
)
from cupysparse.scripts.benchmarking import peak_extra_bytes, route_cupy_through_torch, write_csv
from cupysparse.geometry.sparse_tensor import SparseTensor
from cupysparse.networks.weight_layouts import to_spconv_weight

PROGRAM = "cupysparse-benchmark-network"
MINKUNETS = {14: MinkUNet14, 18: MinkUNet18, 34: MinkUNet34}
PHASES = ("inference", "training step")
SPATIAL_DIMS = 3
LEARNING_RATE = 0.01
MOMENTUM = 0.9
# Largest |ours - spconv| in the output, relative to max |ours|, above which the two networks are
# taken to compute different functions (a wrong pair, weight layout or layer differs by order 1).
AGREEMENT = 1e-2


# --------------------------------------------------------------------------------------------
# The input batch


@dataclass
class Batch:
    """Voxelised scenes: int32 coordinates `[N, 4]` (batch index first), float32 features `[N, 3]`,
    int64 labels `[N]`, the voxel count of each batch item and the number of classes."""

    coordinates: np.ndarray
    features: np.ndarray
    labels: np.ndarray
    voxels_per_item: list[int]
    num_classes: int


def normalised_xyz(points: np.ndarray) -> np.ndarray:
    """Each axis of `points` mapped to [0, 1] over the scene."""
    low = points.min(axis=0)
    extent = np.maximum(points.max(axis=0) - low, np.finfo(np.float32).tiny)
    return (points - low) / extent


def indoor_batch(num_voxels: int, batch_size: int) -> Batch:
    """The indoor scenes of seeds 0 .. batch_size - 1, voxelised at their (common) voxel size."""
    scenes = [make_scene("indoor", num_voxels, seed) for seed in range(batch_size)]
    points = np.concatenate([scene.points for scene in scenes])
    batch_index = np.repeat(np.arange(batch_size, dtype=np.int32), [len(scene.points) for scene in scenes])
    # The label travels as a fourth feature so that reduce="first" takes the xyz and the label of
    # the same point (float32 holds small class indices exactly).
    per_point = np.concatenate(
        [np.column_stack([normalised_xyz(scene.points), scene.labels]) for scene in scenes]
    ).astype(np.float32)
    voxels = SparseTensor.from_points(points, scenes[0].voxel_size, batch_index=batch_index, features=per_point,
                                      reduce="first")
    coordinates, features = np.asarray(voxels.coordinates), np.asarray(voxels.features)
    return Batch(
        coordinates=coordinates,
        features=np.ascontiguousarray(features[:, :SPATIAL_DIMS]),
        labels=features[:, SPATIAL_DIMS].astype(np.int64),
        voxels_per_item=np.bincount(coordinates[:, 0], minlength=batch_size).tolist(),
        num_classes=len(scenes[0].class_names),
    )


# --------------------------------------------------------------------------------------------
# The same network in spconv


class IndiceKeys:
    """spconv's indice_key of each convolution, handed out in running order: submanifold layers
    share one key per (resolution level, kernel size), as they share our maps; each strided
    convolution gets its own, which the transposed convolution inverting it reuses."""

    def __init__(self):
        self.level = 0
        self._open = []  # (key, kernel size) of the strided convolutions not inverted yet, innermost last

    def submanifold(self, kernel_size) -> str:
        return f"subm{self.level}_k{'x'.join(map(str, kernel_size))}"

    def strided(self, kernel_size) -> str:
        key = f"down{self.level}"
        self._open.append((key, kernel_size))
        self.level += 1
        return key

    def transposed(self, kernel_size) -> str:
        if not self._open:
            raise ValueError("a transposed convolution with no strided convolution before it to invert")
        key, strided_kernel = self._open.pop()
        if strided_kernel != kernel_size:  # spconv's inverse convolution reuses the pairs as they are
            raise ValueError(f"a transposed convolution of kernel {kernel_size} cannot invert {key}, whose kernel "
                             f"is {strided_kernel}")
        self.level -= 1
        return key


class SpconvSequential(nn.Module):
    """The layers of a `networks.Sequential` on spconv tensors, skip saves and concatenations included
    (mirrors the adapter's `SparseSequential`)."""

    def __init__(self, description: networks.Sequential, spconv, keys: IndiceKeys):
        super().__init__()
        self._steps = []
        for layer in description.layers:
            if isinstance(layer, (networks.SaveSkip, networks.ConcatSkip)):
                self._steps.append(layer)
            else:
                self.add_module(layer.name, spconv_module(layer, spconv, keys))
                self._steps.append(layer.name)

    def forward(self, input, skips: dict | None = None):
        skips = {} if skips is None else skips
        output = input
        for step in self._steps:
            if isinstance(step, networks.SaveSkip):
                skips[step.name] = output
            elif isinstance(step, networks.ConcatSkip):
                skip = skips.pop(step.skip)
                output = output.replace_feature(torch.cat([output.features, skip.features], 1))
            else:
                module = getattr(self, step)
                output = module(output, skips) if isinstance(module, SpconvSequential) else module(output)
        return output


class SpconvResidual(nn.Module):
    """`relu(body(x) + shortcut(x))` of a `networks.Residual` (mirrors the adapter's `ResidualBlock`)."""

    def __init__(self, description: networks.Residual, spconv, keys: IndiceKeys):
        super().__init__()
        self._body = []
        for layer in description.body:
            self.add_module(layer.name, spconv_module(layer, spconv, keys))
            self._body.append(layer.name)
        self.shortcut = None
        if description.shortcut is not None:
            self.shortcut = SpconvSequential(description.shortcut, spconv, keys)

    def forward(self, input):
        output = input
        for name in self._body:
            output = getattr(self, name)(output)
        identity = input if self.shortcut is None else self.shortcut(input)
        return output.replace_feature(torch.relu(output.features + identity.features))


class SpconvBatchNorm(nn.BatchNorm1d):
    def forward(self, input):
        return input.replace_feature(super().forward(input.features))


class SpconvReLU(nn.Module):
    def forward(self, input):
        return input.replace_feature(torch.relu(input.features))


def spconv_convolution(layer: networks.Conv, spconv, keys: IndiceKeys) -> nn.Module:
    kernel_size = as_tuple(layer.kernel_size, SPATIAL_DIMS, "kernel_size")
    kind = layer.kind()
    if kind == "submanifold":
        return spconv.SubMConv3d(layer.in_channels, layer.out_channels, layer.kernel_size, bias=layer.bias,
                                 indice_key=keys.submanifold(kernel_size))
    # spconv's strided pairs are ours only where the kernel tiles the stride, offsets 0..k-1 (a 2^3
    # kernel at stride 2): larger kernels give outputs ours do not have.
    if any(k != s or k > 2 for k, s in zip(kernel_size, as_tuple(layer.stride, SPATIAL_DIMS, "stride"))):
        raise ValueError(f"{layer.name}: spconv's {kind} convolution of kernel {layer.kernel_size}, stride "
                         f"{layer.stride} has other output voxels than ours; only kernel = stride = 2 matches")
    if kind == "strided":
        return spconv.SparseConv3d(layer.in_channels, layer.out_channels, layer.kernel_size, stride=layer.stride,
                                   padding=0, bias=layer.bias, indice_key=keys.strided(kernel_size))
    return spconv.SparseInverseConv3d(layer.in_channels, layer.out_channels, layer.kernel_size,
                                      indice_key=keys.transposed(kernel_size), bias=layer.bias)


def spconv_module(layer, spconv, keys: IndiceKeys) -> nn.Module:
    """The spconv-side module of one layer description; `spconv` is the `spconv.pytorch` namespace."""
    if isinstance(layer, networks.Conv):
        return spconv_convolution(layer, spconv, keys)
    if isinstance(layer, networks.BatchNorm):
        return SpconvBatchNorm(layer.channels, eps=layer.eps, momentum=layer.momentum)
    if isinstance(layer, networks.ReLU):
        return SpconvReLU()
    if isinstance(layer, networks.Sequential):
        return SpconvSequential(layer, spconv, keys)
    if isinstance(layer, networks.Residual):
        return SpconvResidual(layer, spconv, keys)
    raise TypeError(f"no spconv module for {type(layer).__name__}")


def build_spconv_network(description: networks.Network, spconv) -> SpconvSequential:
    """`description` with spconv modules, named as the adapter names its modules, so parameter names
    are ours: `encoder1.block0.conv1.weight`."""
    return SpconvSequential(description.root, spconv, IndiceKeys())


def spconv_weight(weight: torch.Tensor, layer: networks.Conv) -> torch.Tensor:
    """Our `[K, C_in, C_out]` weight as the spconv layer of `layer` must hold it to compute the same."""
    kernel_size = as_tuple(layer.kernel_size, SPATIAL_DIMS, "kernel_size")
    if layer.kernel_volume() == 1:
        # spconv 2.x runs a 1x1x1 convolution as `features @ weight.view(C_in, C_out)` on its
        # [C_out, 1, 1, 1, C_in] weight (its issue #450): the memory must hold our [C_in, C_out]
        # matrix as it is, not the transpose its layout would suggest.
        return weight.detach().reshape(layer.out_channels, *kernel_size, layer.in_channels).clone()
    converted = to_spconv_weight(weight.detach().float().cpu().numpy(), kernel_size)
    return torch.from_numpy(converted).to(device=weight.device, dtype=weight.dtype)


def copy_weights_to_spconv(model: nn.Module, spconv_model: nn.Module) -> None:
    """Give `spconv_model` (from `build_spconv_network(model.description, ...)`) `model`'s parameters
    and batch-norm statistics, so both compute the same function."""
    convolutions = dict(networks.convolutions(model.description))
    source = model.state_dict()
    target = spconv_model.state_dict()  # tensors sharing the parameters' memory
    if source.keys() != target.keys():
        only_ours, only_theirs = sorted(source.keys() - target.keys()), sorted(target.keys() - source.keys())
        raise ValueError(f"the spconv network's parameters differ from ours: only ours {only_ours}, only spconv's "
                         f"{only_theirs}")
    with torch.no_grad():
        for name, value in source.items():
            path, _, kind = name.rpartition(".")
            if path in convolutions and kind == "weight":
                value = spconv_weight(value, convolutions[path])
            if value.shape != target[name].shape:
                raise ValueError(f"{name}: ours converts to {tuple(value.shape)}, spconv's is "
                                 f"{tuple(target[name].shape)}")
            target[name].copy_(value)


def coarsest_stride(description: networks.Network) -> np.ndarray:
    """Per axis, the product of the strides of the strided convolutions: the stride of the coarsest level."""
    strides = [as_tuple(conv.stride, SPATIAL_DIMS, "stride")
               for _, conv in networks.convolutions(description) if conv.kind() == "strided"]
    return np.prod(np.array(strides, dtype=np.int64).reshape(-1, SPATIAL_DIMS), axis=0)


def spconv_grid(coordinates: np.ndarray, stride: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Coordinates shifted to non-negative by a multiple of `stride` (so floor(x / s) at every level
    is ours, shifted), and a spatial shape, a multiple of `stride`, that holds them."""
    shifted = coordinates.copy()
    shifted[:, 1:] -= coordinates[:, 1:].min(axis=0) // stride * stride
    return shifted, ((shifted[:, 1:].max(axis=0) // stride + 1) * stride).tolist()


def import_spconv():
    """`spconv.pytorch`, or None with the reason on stderr."""
    try:
        import spconv.pytorch as spconv
    except Exception as error:  # absent or broken: the benchmark still runs cupysparse
        print(f"spconv not importable ({type(error).__name__}: {error}); cupysparse only", file=sys.stderr)
        return None
    return spconv


# --------------------------------------------------------------------------------------------
# Running and measuring


@dataclass
class Library:
    """One library's model, optimizer and a maker of fresh input tensors (new kernel maps each time)."""

    name: str
    model: nn.Module
    make_input: Callable[[], object]

    def __post_init__(self):
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)

    def inference(self):
        with torch.no_grad():
            return self.model(self.make_input()).features

    def training_step(self, labels: torch.Tensor):
        logits = self.model(self.make_input()).features
        # The loss in float32, as mixed-precision training computes it; the network stays in its dtype.
        loss = nn.functional.cross_entropy(logits.float(), labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


@dataclass
class Measurement:
    first_call_s: float
    ms: float
    peak_bytes: int | None


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def wall_seconds(step, device: str) -> float:
    begin = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - begin


def median_ms(step, device: str, warmup: int, repeats: int) -> float:
    """Median of `repeats` runs after `warmup`: CUDA events on torch's stream, where both libraries
    and our kernel-map building run (the host clock on the CPU, where everything is synchronous)."""
    for _ in range(warmup):
        step()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            stop.record()
            stop.synchronize()
            samples.append(start.elapsed_time(stop))
        else:
            begin = time.perf_counter()
            step()
            samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples)


def peak_bytes(step) -> int:
    """Peak bytes one run of `step` allocates beyond what is allocated before it (see `peak_extra_bytes`)."""
    # Earlier runs' kernel maps sit in reference cycles until a garbage collection: collected now, they
    # cannot be freed during the run and lower its peak.
    gc.collect()
    return peak_extra_bytes(torch, step)


def lexicographic_order(rows: torch.Tensor) -> torch.Tensor:
    """The permutation that sorts integer `rows` by their first column, then their second, ..."""
    order = torch.arange(len(rows), device=rows.device)
    for column in reversed(range(rows.shape[1])):
        order = order[torch.sort(rows[order, column], stable=True).indices]
    return order


def output_difference(ours: Library, theirs: Library, our_input: TorchSparseTensor, their_input) -> float:
    """max |ours - spconv| / max |ours| of the inference outputs of one input (models in eval mode),
    each voxel's row against the same voxel's."""
    with torch.no_grad():
        our_output, their_output = ours.model(our_input), theirs.model(their_input)
    # spconv's coordinates are ours plus one shift (the two inputs have the same rows), which keeps the sort order.
    shift = their_input.indices[:1] - our_input.coordinates[:1]
    our_rows, their_rows = lexicographic_order(our_output.coordinates), lexicographic_order(their_output.indices)
    if not torch.equal(their_output.indices[their_rows], our_output.coordinates[our_rows] + shift):
        raise RuntimeError("the cupysparse and spconv networks return different voxels: they are not the same network")
    mine, other = our_output.features[our_rows].float(), their_output.features[their_rows].float()
    return float((mine - other).abs().max() / mine.abs().max().clamp_min(torch.finfo(torch.float32).tiny))


def phase_steps(libraries: list[Library], phase: str, labels: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Each library's run of `phase`, its model put in the phase's mode."""
    steps = {}
    for library in libraries:
        library.model.train(phase == "training step")
        steps[library.name] = (library.inference if phase == "inference"
                               else lambda library=library: library.training_step(labels))
    return steps


def check_agreement(ours: Library, theirs: Library) -> float:
    """`output_difference` on a fresh input, printed, and shouted when above `AGREEMENT`."""
    difference = output_difference(ours, theirs, ours.make_input(), theirs.make_input())
    print(f"inference outputs: max |cupysparse - spconv| / max |cupysparse| = {difference:.3g}")
    if not difference <= AGREEMENT:  # NaN included
        banner = "!" * 100
        print(f"\n{banner}\nWARNING: the cupysparse and spconv outputs differ by {difference:.3g} of the largest "
              f"output (> {AGREEMENT:g}):\nthe two networks do not compute the same function, so the timings compare "
              f"different work.\n{banner}\n", file=sys.stderr, flush=True)
    return difference


# --------------------------------------------------------------------------------------------
# Command line


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def scene_size(text: str) -> int:
    value = int(text)
    if not INDOOR_MIN_NUM_VOXELS <= value <= MAX_NUM_VOXELS:
        raise argparse.ArgumentTypeError(f"an indoor scene has {INDOOR_MIN_NUM_VOXELS}..{MAX_NUM_VOXELS} voxels, "
                                         f"got {value}")
    return value


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--depth", type=int, choices=sorted(MINKUNETS), default=18, help="MinkUNet14, 18 or 34")
    parser.add_argument("--width", type=positive_float, default=1.0, help="scales every channel count")
    parser.add_argument("--batch-size", type=positive_int, default=2, help="scenes per batch")
    parser.add_argument("--num-voxels", type=scene_size, default=200_000, help="voxels per scene (within 5%%)")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    parser.add_argument("--warmup", type=non_negative_int, default=3, help="untimed runs before the timed ones")
    parser.add_argument("--repeats", type=positive_int, default=10, help="timed runs (the median is reported)")
    parser.add_argument("--no-spconv", action="store_true", help="time cupysparse only")
    parser.add_argument("--csv", metavar="FILE", help="also write one row per library and phase")
    add_results_page_arguments(parser)
    args = parser.parse_args(argv)
    check_results_page_arguments(parser, args, PROGRAM, argv)
    if args.from_csv:
        return args
    gpu = torch.cuda.is_available() and backend.gpu_available()
    if args.device == "auto":
        args.device = "cuda" if gpu else "cpu"
    elif args.device == "cuda" and not gpu:
        parser.error("--device cuda needs a GPU that both PyTorch and CuPy see")
    return args


def spconv_library(spconv, model: nn.Module, batch: Batch, features: torch.Tensor, device: str) -> Library:
    """`model`'s network and weights in spconv, on `batch`'s voxels (shifted onto spconv's grid)."""
    spconv_model = build_spconv_network(model.description, spconv).to(device=device, dtype=features.dtype)
    copy_weights_to_spconv(model, spconv_model)
    shifted, spatial_shape = spconv_grid(batch.coordinates, coarsest_stride(model.description))
    indices = torch.from_numpy(shifted).to(device)
    batch_size = len(batch.voxels_per_item)
    return Library("spconv", spconv_model,
                   lambda: spconv.SparseConvTensor(features, indices, spatial_shape, batch_size))


def ratio(numerator, denominator) -> float | None:
    return None if numerator is None or denominator is None else numerator / denominator


def megabytes(size_bytes: int | None) -> float | None:
    return None if size_bytes is None else size_bytes / 2**20


def rounded(value, digits: int):
    return None if value is None else round(value, digits)


# (title, key of `phase_summary`, decimals) of the table's columns after the phase
TABLE_COLUMNS = (
    ("cupysparse ms", "cupysparse_ms", 2), ("spconv ms", "spconv_ms", 2), ("ratio", "time_ratio", 3),
    ("cupysparse peak MB", "cupysparse_peak_mb", 1), ("spconv peak MB", "spconv_peak_mb", 1),
    ("memory ratio", "memory_ratio", 3),
)


def phase_summary(results: dict[tuple[str, str], Measurement], phase: str) -> dict:
    """Both libraries' time and peak of `phase` side by side (None where spconv did not run or the
    peak is not measured) and the ratios cupysparse / spconv."""
    mine, theirs = results[phase, "cupysparse"], results.get((phase, "spconv"))
    their_ms = None if theirs is None else theirs.ms
    my_peak, their_peak = megabytes(mine.peak_bytes), None if theirs is None else megabytes(theirs.peak_bytes)
    return {"cupysparse_ms": mine.ms, "spconv_ms": their_ms, "time_ratio": ratio(mine.ms, their_ms),
            "cupysparse_peak_mb": my_peak, "spconv_peak_mb": their_peak, "memory_ratio": ratio(my_peak, their_peak)}


def print_table(summaries: dict[str, dict]) -> None:
    print(f"\n{'phase':<14}" + "".join(f" {title:>{len(title)}}" for title, _, _ in TABLE_COLUMNS))
    for phase, summary in summaries.items():
        cells = ("n/a" if summary[key] is None else f"{summary[key]:.{digits}f}" for _, key, digits in TABLE_COLUMNS)
        print(f"{phase:<14}" + "".join(f" {cell:>{len(title)}}" for (title, _, _), cell in zip(TABLE_COLUMNS, cells)))


# --------------------------------------------------------------------------------------------
# The results page: generated whole from the CSV and its metadata, so it is never edited by hand


METHOD = (
    "Each phase runs on a fresh input tensor every time, so both libraries build every kernel map, as for "
    "a new scene in training. Inference is `model.eval()` and one forward under `torch.no_grad()`; a "
    "training step is a forward, cross-entropy on the per-voxel logits, the backward and an SGD step. Both "
    "models hold the same weights in the same dtype (no autocast). Times are CUDA events (the host clock on "
    "the CPU), the median of the timed runs after the warm-up runs; ratio = cupysparse / spconv (< 1: "
    "cupysparse is faster, or needs less memory). Peak memory is what one run allocates beyond the resident "
    "model, optimizer state and inputs (torch's allocator, with CuPy routed through it). The first call of "
    "each phase, made before any timing, compiles kernels and tunes; its wall time is reported apart."
)


def number_text(text: str, unit: str = "") -> str:
    return "n/a" if text == "" else f"{text}{unit}"


def results_page(rows: list[dict], metadata: dict, csv_path: str, page_path: str) -> str:
    """The markdown results page of `rows` (a CSV of this benchmark, as strings)."""
    first = rows[0]
    by_phase: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_phase.setdefault(row["phase"], {})[row["library"]] = row
    libraries = list(dict.fromkeys(row["library"] for row in rows))
    data_link = relative(csv_path, os.path.dirname(os.path.abspath(page_path)))
    lines = [
        f"# End to end: {first['network']}" + (f", {' against '.join(libraries)}" if len(libraries) > 1 else ""), "",
        f"Measured on **{first['device']}**: {first['network']} (width {first['width']}), {first['dtype']}, a batch "
        f"of {first['batch_size']} indoor scenes, {int(first['voxels']):,} voxels in all. "
        f"Data: [{os.path.basename(csv_path)}]({data_link}).", "",
    ]
    header = ["phase", *(f"{name} ms" for name in libraries)]
    if len(libraries) > 1:
        header.append(" / ".join(libraries))
    header += [f"{name} peak MB" for name in libraries]
    if len(libraries) > 1:
        header.append("memory ratio")
    header += [f"{name} first call s" for name in libraries]
    lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for phase, by_library in by_phase.items():
        mine = by_library[libraries[0]]
        cells = [phase, *(number_text(by_library[name]["ms"]) for name in libraries)]
        if len(libraries) > 1:
            cells.append(number_text(mine["time_ratio"]))
        cells += [number_text(by_library[name]["peak_mb"]) for name in libraries]
        if len(libraries) > 1:
            cells.append(number_text(mine["memory_ratio"]))
        cells += [number_text(by_library[name]["first_call_s"]) for name in libraries]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if first["output_rel_diff"]:
        lines += [f"The two networks' outputs differ by {first['output_rel_diff']} of the largest output.", ""]
    lines += [METHOD, "", "Reproduce (the measurement, then this page from its files):", "", "```bash"]
    if metadata.get("command"):
        lines.append(metadata["command"])
    lines += [shlex.join([PROGRAM, "--from-csv", csv_path, "--markdown", page_path]), "```"]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_csv:
        write_results_page(args.from_csv, args.markdown, results_page, PROGRAM)
        return 0
    device, dtype = args.device, getattr(torch, args.dtype)
    if device == "cuda":
        route_cupy_through_torch(torch)
    batch = indoor_batch(args.num_voxels, args.batch_size)
    torch.manual_seed(0)
    model = MINKUNETS[args.depth](in_channels=SPATIAL_DIMS, num_classes=batch.num_classes, width=args.width)
    model = model.to(device=device, dtype=dtype)
    coordinates = torch.from_numpy(batch.coordinates).to(device)
    features = torch.from_numpy(batch.features).to(device=device, dtype=dtype)
    labels = torch.from_numpy(batch.labels).to(device)

    ours = Library("cupysparse", model, lambda: TorchSparseTensor(coordinates, features, validate=False))
    libraries = [ours]
    spconv = None
    if args.no_spconv:
        print("spconv: skipped (--no-spconv)")
    elif device != "cuda":
        print("spconv: skipped (it runs on CUDA only here)")
    elif args.dtype == "bfloat16":
        print("spconv: skipped (spconv 2.x has no bfloat16 kernels); cupysparse only")
    else:
        spconv = import_spconv()
    if spconv is not None:
        libraries.append(spconv_library(spconv, model, batch, features, device))

    described = backend.describe_device(device)
    total = len(batch.coordinates)
    print(f"{model.description.name} (width {args.width:g}), {args.dtype}, on {described}")
    print(f"voxels per batch item: {', '.join(f'{count:,}' for count in batch.voxels_per_item)}; total {total:,}")
    print(f"median of {args.repeats} after {args.warmup} warm-up runs, a fresh input (new kernel maps) every run")

    results, difference = {}, None
    for phase in PHASES:
        steps = phase_steps(libraries, phase, labels)
        first_calls = {name: wall_seconds(step, device) for name, step in steps.items()}
        if phase == "inference" and len(libraries) == 2:  # after the tuners' work, before any timing
            difference = check_agreement(*libraries)
        for name, step in steps.items():
            ms = median_ms(step, device, args.warmup, args.repeats)
            peak = peak_bytes(step) if device == "cuda" else None
            results[phase, name] = Measurement(first_calls[name], ms, peak)

    summaries = {phase: phase_summary(results, phase) for phase in PHASES}
    print_table(summaries)
    names = [library.name for library in libraries]
    first_call_times = "; ".join(
        f"{name} " + ", ".join(f"{phase} {results[phase, name].first_call_s:.2f} s" for phase in PHASES)
        for name in names
    )
    print(f"\nfirst call (compile + tune), wall time: {first_call_times}")
    print("ratio = cupysparse / spconv (< 1: cupysparse is faster, or needs less memory)")
    rows = [
        {"device": described, "network": model.description.name, "width": args.width, "dtype": args.dtype,
         "batch_size": args.batch_size, "voxels": total, "phase": phase, "library": name,
         "ms": round(results[phase, name].ms, 3), "peak_mb": rounded(megabytes(results[phase, name].peak_bytes), 1),
         "time_ratio": rounded(summaries[phase]["time_ratio"], 3),
         "memory_ratio": rounded(summaries[phase]["memory_ratio"], 3),
         "first_call_s": round(results[phase, name].first_call_s, 3),
         "output_rel_diff": None if difference is None else float(f"{difference:.3g}")}
        for phase in PHASES for name in names
    ]
    if args.csv:
        write_csv(rows, args.csv)
    if args.markdown:
        write_metadata(args.csv, {"command": args.command, "device": described})
        write_results_page(args.csv, args.markdown, results_page, PROGRAM)
    return 0


if __name__ == "__main__":
    sys.exit(main())
