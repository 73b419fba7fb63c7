"""End to end: a whole MinkUNet, inference and a training step, cupysparse against spconv 2.x and
NVIDIA WarpConvNet, in one process.

The network is MinkUNet18 (--depth 14 / 18 / 34, --width scales the channels; --network centerpoint: the
CenterPoint backbone with spconv's padded strided convolutions, on spconv's grid for every library) on a batch of
--batch-size scenes (`cupysparse.data.scenes`, seeds 0, 1, ...): --scene indoor (rooms at 2 cm, about
200K voxels each by default) or outdoor (LiDAR sweeps of a street at 5 cm, 173K voxels each: two
accumulated sweeps). Each voxel's input is the xyz of its first point, normalised per scene to [0, 1];
its label, that point's label, is the target of the loss. All models hold the same weights: pure
--dtype by default (float16: parameters, batch-norm statistics and activations alike), or with
--autocast float32 parameters and inputs under `torch.autocast` to --dtype, as mixed-precision
training runs.

Two phases, each on a fresh input tensor every run, so every library builds every kernel map (the
pairs of each layer) as for a new scene; the coordinates come from voxelisation, unique and sorted,
and no library checks them (`validate=False` on our side; the peers never do):
- inference: `model.eval()`, `torch.no_grad()`, one forward;
- training step: `model.train()`, forward, cross-entropy on the per-voxel logits (in float32; the
  backbone: the mean square of its output features), backward, `optimizer.step()` (SGD, lr 0.01,
  momentum 0.9), `zero_grad(set_to_none=True)`.
The libraries take turns run by run (--repeats rounds after --warmup runs each), so a drift of the
machine's speed reaches all of them alike; each run is timed by CUDA events (on the CPU: the host clock)
and the median is reported, with ratios of medians (< 1: cupysparse is faster). Then, per library and
phase, `torch.profiler` over three runs gives the GPU's busy time (the sum of its kernels, copies and
fills) and the number of those GPU operations per run: wall / GPU above 1 is time the GPU waits for the
host; `--host N` also gives each library's host time until a run returns (each run started on an idle
GPU) beside its wall time, and its N Python functions with the most own time under cProfile: a host time
near the wall time is a step bound by its host. Peak memory: one more run after
`torch.cuda.reset_peak_memory_stats()`, `max_memory_allocated()` minus what was allocated before it
(model, optimizer state and inputs stay resident, so they are not counted). CuPy allocates from torch's
caching allocator for the whole run.

The first call of each phase compiles kernels and runs the tuners (ours benchmarks candidate
algorithms per layer shape; spconv and WarpConvNet tune their own); it is made before any timing and
its wall time is reported as "first call s". Our tuner keeps its results in the persistent
benchmark cache, so on a later run with the same shapes that call only loads them.

The peers (--peers, default every one that imports; `none` times cupysparse alone) run the same
network, built from `model.description` with our weights and batch-norm statistics:
`cupysparse.scripts.peer_spconv` and `cupysparse.scripts.peer_warpconvnet` say how. Before timing,
each peer's inference output of one input is compared with ours voxel by voxel; a maximum
difference above 1e-2 of the largest output is reported loudly.

    cupysparse-benchmark-network --scene indoor --csv network.csv
    cupysparse-benchmark-network --scene outdoor --autocast --csv results/network_outdoor_autocast.csv
    cupysparse-benchmark-network --csv results/network.csv --markdown results/network.md --plot results/network.png
    cupysparse-benchmark-network --from-csv results/network.csv --markdown results/network.md

--markdown writes a results page from the --csv file and the run's metadata (command, device), which
goes to NAME.json beside NAME.csv; --from-csv measures nothing and writes the page again from such
files (and --plot its chart). Several CSV files of this benchmark may be joined into one page by
`--from-csv a.csv,b.csv`.

Needs PyTorch. Without a GPU it runs the cupysparse part on the CPU (NumPy kernels, torch CPU
tensors), without peers, profiles or peak memory.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import contextlib
import csv
import dataclasses
import gc
import math
import os
import pstats
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from cupysparse.adapters.torch import SparseTensor as TorchSparseTensor
from cupysparse.adapters.torch.networks import CenterPointBackbone, MinkUNet14, MinkUNet18, MinkUNet34
from cupysparse.cuda import backend
from cupysparse.data.scenes import INDOOR_MIN_NUM_VOXELS, MAX_NUM_VOXELS, make_scene
from cupysparse.geometry.padding import spconv_grid
from cupysparse.geometry.sparse_tensor import SparseTensor
from cupysparse.networks import descriptions as networks
from cupysparse.scripts import peer_spconv, peer_warpconvnet
from cupysparse.scripts.analyze_benchmarks import (
    PLOT_INSTALL_HINT,
    add_results_page_arguments,
    pyplot,
    read_metadata,
    relative,
    write_metadata,
)
from cupysparse.scripts import arguments
from cupysparse.scripts.benchmarking import peak_extra_bytes, route_cupy_through_torch, write_csv

PROGRAM = "cupysparse-benchmark-network"
MINKUNETS = {14: MinkUNet14, 18: MinkUNet18, 34: MinkUNet34}
PHASES = ("inference", "training step")
SPATIAL_DIMS = 3
LEARNING_RATE = 0.01
MOMENTUM = 0.9
# Largest accepted difference between two libraries' inference outputs, relative to the largest
# output: fp16 rounding in a deep network stays well below it, a different network does not.
AGREEMENT = 1e-2
# Voxels per scene by default, and the fewest a scene of each kind can be built with.
DEFAULT_NUM_VOXELS = {"indoor": 200_000, "outdoor": 173_000}
MIN_NUM_VOXELS = {"indoor": INDOOR_MIN_NUM_VOXELS, "outdoor": 1}
PROFILED_RUNS = 3
OPERATION_NAME_LENGTH = 110  # characters of a GPU operation's name in the --kernels list
# The peers, each a module with `import_peer()` (the library, or None with the reason printed) and
# `peer_network(library, model, coordinates, features, batch_size)` (see `Library`), in table order.
PEERS = {"spconv": peer_spconv, "warpconvnet": peer_warpconvnet}
OURS = "cupysparse"


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


def scene_batch(kind: str, num_voxels: int, batch_size: int) -> Batch:
    """The scenes of `kind` of seeds 0 .. batch_size - 1, voxelised at their (common) voxel size."""
    scenes = [make_scene(kind, num_voxels, seed) for seed in range(batch_size)]
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
# Running and measuring


@dataclass
class Library:
    """One library's model, optimizer, a maker of fresh input tensors (new kernel maps each time), and
    `output_voxels(output)`: the output's coordinates in ours (`[N, 4]` int32, batch index first) and
    its features, row for row. `autocast`: the dtype the steps run under `torch.autocast` to, or None."""

    name: str
    model: nn.Module
    make_input: Callable[[], object]
    output_voxels: Callable[[object], tuple[torch.Tensor, torch.Tensor]]
    autocast: torch.dtype | None = None
    optimizer: torch.optim.Optimizer = field(init=False)

    def __post_init__(self):
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)

    def precision(self):
        device_type = next(self.model.parameters()).device.type
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.autocast)

    def inference(self):
        with torch.no_grad(), self.precision():
            return self.output_voxels(self.model(self.make_input()))[1]

    def training_step(self, labels: torch.Tensor | None):
        with self.precision():
            outputs = self.output_voxels(self.model(self.make_input()))[1]
        # The loss in float32, as mixed-precision training computes it; the network stays in its dtype. A
        # backbone's outputs are coarse voxels, with no labels: the mean square of its features.
        outputs = outputs.float()
        loss = outputs.square().mean() if labels is None else nn.functional.cross_entropy(outputs, labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


@dataclass(frozen=True)
class GpuOperation:
    """The kernels (or copies, or fills) of one name in a profiled run: their GPU ms and their count per run."""

    name: str
    ms: float
    count: float


def operation_name(name: str) -> str:
    """A profiler's kernel name without its return type and parameter list (the template arguments stay: they
    tell tiles and types apart), at most `OPERATION_NAME_LENGTH` characters."""
    if name.startswith("void ") and name.endswith(")"):  # a kernel's signature: its parameters are the last group
        name, depth = name.removeprefix("void "), 0
        for index in range(len(name) - 1, 0, -1):
            depth += {")": 1, "(": -1}.get(name[index], 0)
            if depth == 0:
                name = name[:index]
                break
    return name if len(name) <= OPERATION_NAME_LENGTH else name[:OPERATION_NAME_LENGTH - 1] + "…"


def gpu_operations(events, runs: int) -> list[GpuOperation]:
    """Profiler device events (`name`, `device_time` in µs) grouped by `operation_name`, per run of `runs`,
    costliest first."""
    times, counts = collections.Counter(), collections.Counter()
    for event in events:
        name = operation_name(event.name)
        times[name] += event.device_time
        counts[name] += 1
    return [GpuOperation(name, us / 1e3 / runs, counts[name] / runs) for name, us in times.most_common()]


@dataclass(frozen=True)
class HostFunction:
    """A Python function or built-in in a profiled run: its own host ms (without what it calls) and its calls
    (`count`), per run."""

    name: str
    ms: float
    count: float


def function_name(filename: str, line: int, function: str) -> str:
    """A cProfile key as `folder/file.py:line(function)`; a built-in's as cProfile names it."""
    if filename == "~":
        return function
    return f"{'/'.join(Path(filename).parts[-2:])}:{line}({function})"


def host_functions(stats: dict, runs: int) -> list[HostFunction]:
    """cProfile's `pstats.Stats(...).stats` (key: (file, line, function), value: (primitive calls, calls, own s,
    cumulative s, callers)) per run of `runs`, by own time, costliest first."""
    functions = [HostFunction(function_name(*key), own * 1e3 / runs, calls / runs)
                 for key, (_, calls, own, _, _) in stats.items()]
    return sorted(functions, key=lambda function: -function.ms)


@dataclass
class Measurement:
    """One library's phase: first call wall seconds, timed runs (ms), GPU busy ms and operations per
    run (None where not profiled) and peak bytes (None on the CPU)."""

    first_call_s: float
    samples: list[float] = field(default_factory=list)
    gpu_ms: float | None = None
    gpu_ops: float | None = None
    peak_bytes: int | None = None
    operations: list[GpuOperation] = field(default_factory=list)  # by GPU time per run, costliest first
    host_ms: float | None = None  # until a run returns, started on an idle GPU (--host)
    functions: list[HostFunction] = field(default_factory=list)  # by own host time per run, costliest first

    @property
    def ms(self) -> float:
        return statistics.median(self.samples)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def wall_seconds(step, device: str) -> float:
    begin = time.perf_counter()
    step()
    synchronize(device)
    return time.perf_counter() - begin


def run_ms(step, device: str) -> float:
    """One run of `step`: CUDA events on torch's stream, where every library and our kernel-map
    building run (the host clock on the CPU, where everything is synchronous)."""
    if device != "cuda":
        begin = time.perf_counter()
        step()
        return (time.perf_counter() - begin) * 1e3
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop)


def samples_in_turns(steps: dict[str, Callable], measurements: dict[str, Measurement], device: str, warmup: int,
                     repeats: int) -> None:
    """`warmup` untimed runs of each step, then `repeats` rounds in which each takes one timed run in turn."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    synchronize(device)
    for _ in range(repeats):
        for name, step in steps.items():
            measurements[name].samples.append(run_ms(step, device))


def gpu_profile(step) -> tuple[float, float, list[GpuOperation]]:
    """(GPU busy ms, GPU operations, those operations by name) per run of `step`, from `torch.profiler` over
    `PROFILED_RUNS` runs: every kernel, copy and fill on the device, whichever library launched it."""
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(PROFILED_RUNS):
            step()
        torch.cuda.synchronize()
    events = [event for event in profiler.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(event.device_time for event in events)
    return busy_us / 1e3 / PROFILED_RUNS, len(events) / PROFILED_RUNS, gpu_operations(events, PROFILED_RUNS)


def host_profile(step, device: str) -> tuple[float, list[HostFunction]]:
    """(host ms until a run of `step` returns, the median of `PROFILED_RUNS` runs each started on an idle GPU;
    the Python functions and built-ins by own time per run, under cProfile over as many runs). A host time near
    the wall time is a step bound by its host, whatever its GPU does."""
    returned = []
    for _ in range(PROFILED_RUNS):
        synchronize(device)
        begin = time.perf_counter()
        step()
        returned.append((time.perf_counter() - begin) * 1e3)
    synchronize(device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(PROFILED_RUNS):
        step()
    profiler.disable()
    synchronize(device)
    return statistics.median(returned), host_functions(pstats.Stats(profiler).stats, PROFILED_RUNS)


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


def output_difference(ours: Library, theirs: Library) -> float:
    """max |ours - theirs| / max |ours| of the inference outputs of one input (models in eval mode),
    each voxel's row against the same voxel's."""
    with torch.no_grad(), ours.precision():
        our_coordinates, mine = ours.output_voxels(ours.model(ours.make_input()))
    with torch.no_grad(), theirs.precision():
        their_coordinates, other = theirs.output_voxels(theirs.model(theirs.make_input()))
    our_rows, their_rows = lexicographic_order(our_coordinates), lexicographic_order(their_coordinates)
    if not torch.equal(their_coordinates[their_rows].int(), our_coordinates[our_rows].int()):
        raise RuntimeError(f"cupysparse and {theirs.name} return different voxels: they are not the same network")
    mine, other = mine[our_rows].float(), other[their_rows].float()
    return float((mine - other).abs().max() / mine.abs().max().clamp_min(torch.finfo(torch.float32).tiny))


def check_agreement(ours: Library, theirs: Library) -> float:
    """`output_difference` on a fresh input, printed, and shouted when above `AGREEMENT`."""
    difference = output_difference(ours, theirs)
    print(f"inference outputs: max |cupysparse - {theirs.name}| / max |cupysparse| = {difference:.3g}")
    if not difference <= AGREEMENT:  # NaN included
        banner = "!" * 100
        print(f"\n{banner}\nWARNING: the cupysparse and {theirs.name} outputs differ by {difference:.3g} of the "
              f"largest output (> {AGREEMENT:g}):\nthe two networks do not compute the same function, so the "
              f"timings compare different work.\n{banner}\n", file=sys.stderr, flush=True)
    return difference


def phase_steps(libraries: list[Library], phase: str, labels: torch.Tensor | None) -> dict[str, Callable[[], object]]:
    """Each library's run of `phase`, its model put in the phase's mode."""
    steps = {}
    for library in libraries:
        library.model.train(phase == "training step")
        steps[library.name] = (library.inference if phase == "inference"
                               else lambda library=library: library.training_step(labels))
    return steps


def measure_phase(libraries: list[Library], phase: str, labels: torch.Tensor | None, device: str, warmup: int,
                  repeats: int, host: bool = False) -> dict[str, Measurement]:
    """Each library's `Measurement` of `phase`; with `host`, its `host_profile` too."""
    steps = phase_steps(libraries, phase, labels)
    measurements = {name: Measurement(wall_seconds(step, device)) for name, step in steps.items()}
    samples_in_turns(steps, measurements, device, warmup, repeats)
    if host:
        for name, step in steps.items():
            measurements[name].host_ms, measurements[name].functions = host_profile(step, device)
    if device == "cuda":
        for name, step in steps.items():
            measured = measurements[name]
            measured.gpu_ms, measured.gpu_ops, measured.operations = gpu_profile(step)
            measured.peak_bytes = peak_bytes(step)
    return measurements


# --------------------------------------------------------------------------------------------
# Command line


def positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def peer_names(text: str) -> list[str]:
    if text == "none":
        return []
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in PEERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"peers are a comma-separated list of {', '.join(PEERS)} (or none), "
                                         f"got {text!r}")
    return list(dict.fromkeys(names))


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or PROGRAM, description=__doc__.split("\n\n")[0], epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--network", default="minkunet", choices=("minkunet", "centerpoint"),
                        help="MinkUNet (--depth) or the CenterPoint backbone with spconv's padded strided "
                             "convolutions (WarpConvNet has none: it is skipped)")
    parser.add_argument("--depth", type=int, choices=sorted(MINKUNETS), default=18, help="MinkUNet14, 18 or 34")
    parser.add_argument("--width", type=positive_float, default=1.0, help="scales every channel count")
    parser.add_argument("--scene", default="indoor", choices=sorted(DEFAULT_NUM_VOXELS),
                        help="indoor rooms (2 cm voxels) or outdoor LiDAR sweeps (5 cm)")
    parser.add_argument("--batch-size", type=arguments.count, default=2, help="scenes per batch")
    parser.add_argument("--num-voxels", type=arguments.count,
                        help="voxels per scene (within 5%%; default: indoor 200000, outdoor 173000)")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"),
                        help="the models' dtype, or with --autocast the dtype autocast runs in")
    parser.add_argument("--autocast", action="store_true",
                        help="float32 parameters and inputs, the steps under torch.autocast to --dtype")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                        help="where to run: auto (the GPU if there is one), cuda or cpu")
    parser.add_argument("--warmup", type=arguments.count_or_zero, default=3, help="untimed runs before the timed ones")
    parser.add_argument("--repeats", type=arguments.count, default=10, help="timed rounds (the median is reported)")
    parser.add_argument("--peers", type=peer_names, default=list(PEERS),
                        help=f"libraries to compare with, comma-separated: {', '.join(PEERS)} (default: every one "
                             "that imports), or none")
    parser.add_argument("--csv", metavar="FILE", help="also write one row per library and phase")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the times per library and phase (matplotlib)")
    parser.add_argument("--kernels", type=arguments.count_or_zero, default=0, metavar="N",
                        help="also list each library's N costliest GPU operations per phase, by name (on the GPU)")
    parser.add_argument("--host", type=arguments.count_or_zero, default=0, metavar="N",
                        help="also give each library's host time until a run returns, and its N Python functions "
                             "with the most own time per phase (cProfile)")
    add_results_page_arguments(parser)
    return parser


def parse_args(argv=None, prog: str | None = None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.command = shlex.join([PROGRAM, *(sys.argv[1:] if argv is None else argv)])
    if args.from_csv and not (args.markdown or args.plot):
        parser.error("--from-csv writes the --markdown page or the --plot chart: name one")
    if (args.markdown or args.plot) and not (args.csv or args.from_csv):
        parser.error("--markdown and --plot show the data of the --csv file: name one")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error(f"--plot: {PLOT_INSTALL_HINT}")
    if args.from_csv:
        return args
    if args.autocast and args.dtype == "float32":
        parser.error("--autocast needs --dtype float16 or bfloat16")
    if args.num_voxels is None:
        args.num_voxels = DEFAULT_NUM_VOXELS[args.scene]
    if not MIN_NUM_VOXELS[args.scene] <= args.num_voxels <= MAX_NUM_VOXELS:
        parser.error(f"--num-voxels: an {args.scene} scene has {MIN_NUM_VOXELS[args.scene]}..{MAX_NUM_VOXELS} "
                     f"voxels, got {args.num_voxels}")
    gpu = torch.cuda.is_available() and backend.gpu_available()
    if args.device == "auto":
        args.device = "cuda" if gpu else "cpu"
    elif args.device == "cuda" and not gpu:
        parser.error("--device cuda needs a GPU that both PyTorch and CuPy see")
    return args


def peer_libraries(args, model: nn.Module, batch: Batch, features: torch.Tensor, autocast) -> list[Library]:
    """The peers of `args.peers` that run here, each with `model`'s network and weights."""
    libraries = []
    for name in args.peers:
        if args.device != "cuda":
            print(f"{name}: skipped (it runs on CUDA only here)")
            continue
        if args.dtype == "bfloat16" and not args.autocast and name == "spconv":
            print("spconv: skipped (spconv 2.x has no bfloat16 kernels)")
            continue
        library = PEERS[name].import_peer()
        if library is None:
            continue
        try:
            peer_model, make_input, output_voxels = PEERS[name].peer_network(
                library, model, batch.coordinates, features, len(batch.voxels_per_item))
        except ValueError as error:  # a layer the peer has no counterpart for
            print(f"{name}: skipped ({error})")
            continue
        libraries.append(Library(name, peer_model, make_input, output_voxels, autocast))
    return libraries


def ratio(numerator, denominator) -> float | None:
    return None if numerator is None or denominator is None else numerator / denominator


def rounded(value, digits: int):
    return None if value is None else round(value, digits)


def result_rows(args, description_name: str, described: str, batch: Batch, results: dict, differences: dict):
    """One CSV row per phase and library; the ratios are the row's library against each library."""
    names = list(dict.fromkeys(name for _, name in results))
    rows = []
    for phase in PHASES:
        for name in names:
            mine = results[phase, name]
            peak_mb = None if mine.peak_bytes is None else mine.peak_bytes / 2**20
            row = {
                "device": described, "network": description_name, "width": args.width, "scene": args.scene,
                "precision": f"{args.dtype} autocast" if args.autocast else args.dtype,
                "batch_size": args.batch_size, "voxels": len(batch.coordinates), "phase": phase, "library": name,
                "ms": round(mine.ms, 3), "gpu_ms": rounded(mine.gpu_ms, 3), "gpu_ops": rounded(mine.gpu_ops, 1),
                "wall_over_gpu": rounded(ratio(mine.ms, mine.gpu_ms), 3), "peak_mb": rounded(peak_mb, 1),
                "first_call_s": round(mine.first_call_s, 3),
                "output_rel_diff": None if name not in differences else float(f"{differences[name]:.3g}"),
            }
            for other in names:
                row[f"ratio_to_{other}"] = rounded(ratio(mine.ms, results[phase, other].ms), 3)
            rows.append(row)
    return rows


def number(value, digits: int) -> str:
    return "n/a" if value in (None, "") else f"{float(value):.{digits}f}"


def table_lines(rows: list[dict], markdown: bool) -> list[str]:
    """A table of `rows`: per phase and library the times, the GPU's share and the ratios to the others."""
    libraries = list(dict.fromkeys(row["library"] for row in rows))
    header = ["phase", "library", "ms", "GPU ms", "GPU ops", "wall / GPU", "peak MB", "first call s",
              *(f"/ {name}" for name in libraries[1:])]
    cells = [[row["phase"], row["library"], number(row["ms"], 2), number(row["gpu_ms"], 2), number(row["gpu_ops"], 0),
              number(row["wall_over_gpu"], 2), number(row["peak_mb"], 0), number(row["first_call_s"], 2),
              *(number(row.get(f"ratio_to_{name}"), 3) if name != row["library"] else "-" for name in libraries[1:])]
             for row in rows]
    if markdown:
        return ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2),
                *("| " + " | ".join(line) + " |" for line in cells)]
    widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(header))]
    return ["  ".join(text.rjust(width) if i > 1 else text.ljust(width) for i, (text, width) in
                      enumerate(zip(line, widths))) for line in [header, *cells]]


# --------------------------------------------------------------------------------------------
# The results page and chart: generated whole from the CSV files and their metadata


METHOD = (
    "Each phase runs on a fresh input tensor every time, so every library builds every kernel map, as for a "
    "new scene. Inference is `model.eval()` and one forward under `torch.no_grad()`; a training step is a "
    "forward, cross-entropy on the per-voxel logits (a backbone: the mean square of its output features), the "
    "backward and an SGD step. All models hold the same "
    "weights. The libraries take turns run by run; times are CUDA events, the median of the timed runs, and "
    "`/ name` is the ratio of medians to that library (< 1: faster). GPU ms is the sum of the GPU's kernels, "
    "copies and fills per run (`torch.profiler`), GPU ops their number: wall / GPU above 1 is time the GPU "
    "waits for the host. Peak memory is what one run allocates beyond the resident model, optimizer state "
    "and inputs. The first call of each phase, made before any timing, compiles kernels and tunes."
)


def read_csv_files(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        with open(path, newline="") as handle:
            rows += list(csv.DictReader(handle))
    if not rows:
        raise SystemExit(f"{PROGRAM}: {', '.join(paths)} hold no measurement")
    return rows


def configurations(rows: list[dict]) -> dict[tuple, list[dict]]:
    """The rows of each (network, scene, precision, voxels) measured."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["network"], row["scene"], row["precision"], row["voxels"]), []).append(row)
    return groups


def results_page(paths: list[str], page_path: str, plot_path: str | None = None) -> str:
    rows = read_csv_files(paths)
    metadata = [read_metadata(path) for path in paths]
    page_folder = os.path.dirname(os.path.abspath(page_path))
    names = " and ".join(dict.fromkeys(row["network"] for row in rows))
    lines = [f"# End to end: {names}, cupysparse against its peers", "",
             f"Measured on **{rows[0]['device']}**, one process per table. Data: "
             + ", ".join(f"[{os.path.basename(path)}]({relative(path, page_folder)})" for path in paths) + ".", ""]
    if plot_path:
        lines += [f"![Milliseconds per run, the GPU's busy time darker inside]({relative(plot_path, page_folder)})", ""]
    for (network, scene, precision, voxels), group in configurations(rows).items():
        lines += [f"## {network}, {scene}, {precision}, {int(voxels):,} voxels in a batch of "
                  f"{group[0]['batch_size']}", "", *table_lines(group, markdown=True), ""]
        differences = {row["library"]: row["output_rel_diff"] for row in group if row.get("output_rel_diff")}
        if differences:
            lines += ["Inference outputs against ours, max difference / max output: "
                      + ", ".join(f"{name} {value}" for name, value in differences.items()) + ".", ""]
    lines += [METHOD, "", "Reproduce (the measurements, then this page from their files):", "", "```bash"]
    lines += [entry["command"] for entry in metadata if entry.get("command")]
    plot_arguments = ["--plot", plot_path] if plot_path else []
    lines += [shlex.join([PROGRAM, "--from-csv", ",".join(paths), "--markdown", page_path, *plot_arguments]), "```"]
    return "\n".join(lines)


def plot(paths: list[str], plot_path: str) -> None:
    """One panel per configuration: per phase, each library's wall time with its GPU busy time inside."""
    plt = pyplot()
    groups = configurations(read_csv_files(paths))
    columns = min(len(groups), 2)
    rows = -(-len(groups) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4 * rows), squeeze=False)
    for axis in axes.flat[len(groups):]:
        axis.set_visible(False)
    for axis, ((network, scene, precision, _), group) in zip(axes.flat, groups.items()):
        libraries = list(dict.fromkeys(row["library"] for row in group))
        width = 0.8 / len(libraries)
        for index, name in enumerate(libraries):
            by_phase = {row["phase"]: row for row in group if row["library"] == name}
            positions = [p + index * width for p in range(len(PHASES))]
            walls = [float(by_phase[phase]["ms"]) for phase in PHASES]
            gpus = [float(by_phase[phase]["gpu_ms"] or "nan") for phase in PHASES]
            bars = axis.bar(positions, walls, width, label=name)
            axis.bar(positions, gpus, width * 0.5, color="black", alpha=0.35,
                     label="GPU busy" if index == len(libraries) - 1 else None)
            axis.bar_label(bars, fmt="%.1f", fontsize=8)
        axis.set_xticks([p + width * (len(libraries) - 1) / 2 for p in range(len(PHASES))], PHASES)
        axis.set_ylabel("ms per run")
        axis.set_title(f"{network}, {scene}, {precision}", fontsize=10)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(plot_path, dpi=120)
    print(f"wrote {plot_path}")


def write_outputs(args, paths: list[str]) -> None:
    if args.markdown:
        page = results_page(paths, args.markdown, args.plot)
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as handle:
            handle.write(page + "\n")
        print(f"wrote {args.markdown}")
    if args.plot:
        plot(paths, args.plot)


def ranked_lines(entries: list, total_ms: float) -> list[str]:
    """A line per entry (`GpuOperation` or `HostFunction`): its ms and count per run, its share of `total_ms`."""
    return [f"  {entry.ms:8.3f} ms {entry.ms / total_ms if total_ms else 0.0:6.1%} {entry.count:6.4g}x  {entry.name}"
            for entry in entries]


def operation_lines(results: dict[tuple[str, str], Measurement], count: int) -> list[str]:
    """Each library's `count` costliest GPU operations per phase, with their share of its GPU time."""
    lines = [f"GPU operations per run by name, the {count} costliest of each (torch.profiler):"]
    for (phase, library), measured in results.items():
        lines.append(f"{phase}, {library}: {measured.gpu_ms:.2f} ms in {measured.gpu_ops:.0f} operations")
        lines += ranked_lines(measured.operations[:count], measured.gpu_ms)
    return lines


def host_lines(results: dict[tuple[str, str], Measurement], count: int) -> list[str]:
    """Each library's host time per phase against its wall time, and its `count` functions with the most own
    time, with their share of the profiled run's."""
    lines = [f"Host time per run until the step returns, and the {count} functions with the most own time of each "
             "(cProfile, which slows the host):"]
    for (phase, library), measured in results.items():
        profiled = sum(function.ms for function in measured.functions)
        lines.append(f"{phase}, {library}: {measured.host_ms:.2f} ms until a run returns, wall {measured.ms:.2f} ms; "
                     f"{profiled:.2f} ms under cProfile")
        lines += ranked_lines(measured.functions[:count], profiled)
    return lines


def main(argv=None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    if args.from_csv:
        write_outputs(args, args.from_csv.split(","))
        return 0
    device, dtype = args.device, getattr(torch, args.dtype)
    if device == "cuda":
        route_cupy_through_torch(torch)
    autocast = dtype if args.autocast else None
    model_dtype = torch.float32 if args.autocast else dtype
    batch = scene_batch(args.scene, args.num_voxels, args.batch_size)
    torch.manual_seed(0)
    if args.network == "centerpoint":
        model = CenterPointBackbone(in_channels=SPATIAL_DIMS, width=args.width, padded=True)
    else:
        model = MINKUNETS[args.depth](in_channels=SPATIAL_DIMS, num_classes=batch.num_classes, width=args.width)
    model = model.to(device=device, dtype=model_dtype)
    spatial_shape = None
    if networks.has_padding(model.description):
        # Padded convolutions' outputs depend on the spatial shape: every library gets the same grid, spconv's.
        shifted, spatial_shape = spconv_grid(batch.coordinates, networks.coarsest_stride(model.description))
        batch = dataclasses.replace(batch, coordinates=shifted)
    coordinates = torch.from_numpy(batch.coordinates).to(device)
    features = torch.from_numpy(batch.features).to(device=device, dtype=model_dtype)
    # Per-voxel labels for a segmentation network; a backbone's training step has none (`training_step`).
    labels = None if args.network == "centerpoint" else torch.from_numpy(batch.labels).to(device)

    def our_input():
        return TorchSparseTensor(coordinates, features, validate=False, spatial_shape=spatial_shape)

    ours = Library(OURS, model, our_input, lambda output: (output.coordinates, output.features), autocast)
    peers = peer_libraries(args, model, batch, features, autocast)
    libraries = [ours, *peers]

    described = backend.describe_device(device)
    precision = f"{args.dtype} under autocast (float32 parameters)" if args.autocast else f"pure {args.dtype}"
    print(f"{model.description.name} (width {args.width:g}), {precision}, {args.scene} scenes, on {described}")
    print(f"voxels per batch item: {', '.join(f'{count:,}' for count in batch.voxels_per_item)}; "
          f"total {len(batch.coordinates):,}")
    print(f"{args.repeats} rounds in turns after {args.warmup} warm-up runs; a fresh input (new kernel maps) every run")

    results, differences = {}, {}
    for phase in PHASES:
        for name, measurement in measure_phase(libraries, phase, labels, device, args.warmup, args.repeats,
                                               bool(args.host)).items():
            results[phase, name] = measurement
        if phase == "inference":  # after the tuners' work
            for peer in peers:
                differences[peer.name] = check_agreement(ours, peer)
    rows = result_rows(args, model.description.name, described, batch, results, differences)
    print()
    print("\n".join(table_lines(rows, markdown=False)))
    print("`/ name`: ratio of medians to that library (< 1: faster); wall / GPU: > 1 where the GPU waits for the host")
    if args.kernels:
        print()
        print("\n".join(operation_lines(results, args.kernels)) if device == "cuda"
              else "--kernels: skipped (the GPU's operations are profiled on CUDA only)")
    if args.host:
        print()
        print("\n".join(host_lines(results, args.host)))
    if args.csv:
        write_csv(rows, args.csv)
        write_metadata(args.csv, {"command": args.command, "device": described})
        write_outputs(args, [args.csv])
    return 0


if __name__ == "__main__":
    sys.exit(main())
