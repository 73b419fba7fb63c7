"""Speed and memory of sparse convolutions over a grid of layers, every backend, every phase.

For each configuration (voxel count, channel pair, kernel size, stride, dtype) it builds the scene
(`--scene`, `--batch-size` items), the kernel map with every derived format (timed: kernel-map
build), seeded random features, weight and output gradient, then for each backend and phase records
one row: the first call (host clock, including the tuner's choice and kernel loading; for spconv
and torch, building their layer), then the median and quartiles of `--repeats` samples, each the
mean of `--iterations` back-to-back calls queued behind one untimed call (CUDA events on the GPU,
the host clock on the CPU; `benchmarking.batch_behind_a_call_ms`), after `--warmup` calls, TFLOP/s
on the sparse work (2 · pairs · C_in · C_out per GEMM: forward, dgrad and wgrad one each, backward
two, both three), and the peak memory of one call. The backends and dtypes of one shape and phase
take their samples in turns, one each round after round, so that what drifts during a run (clocks
under the power cap, the host's load) reaches them alike and their ratios hold; under
`--max-memory-gb` only one dtype's arrays are resident at a time, so only backends take turns. A
layer's rows are written once all of its dtypes are measured.

    cupysparse-benchmark-memory-analysis --num-voxels 100K,1M --channels 32,32 64,64 --dtypes fp16
    cupysparse-benchmark-memory-analysis --backends auto,spconv,torch --phases forward,backward --max-memory-gb 40
    cupysparse-benchmark-memory-analysis --precompile --cold --output-dir cold-start
    cupysparse-benchmark-memory-analysis --dtypes fp32 tf32 --backends auto,spconv

The dtype `tf32` is fp32 features with TF32 products (`cupysparse.cuda.precision`; spconv with
SPCONV_ALLOW_TF32), `fp32` exact fp32 for both, whatever CUPYSPARSE_FP32_PRECISION says.

Backends: every registered algorithm by name (the tuner picks its parameters, as for
`algo=name`), `auto` (the tuner's choice among algorithms, as for `algo="auto"`), `spconv` (2.x,
GPU, fp16/fp32, submanifold and 2³ stride-2 layers) and `torch` (a dense convolution of the batch's
bounding box, for grids of at most `--dense-max-cells` cells). Phases: forward, dgrad, wgrad,
backward (dgrad + wgrad), both (forward + backward).

Statuses: `ok`; `not_supported` (with the backend's reason); `oom` (out of memory, or an estimated
footprint above `--max-memory-gb`, which on the GPU also caps the memory pool); `error` (with the
message); `not_tested`: at least as large in every dimension (voxels, channels, kernel size, dtype
width) as a configuration that ran out of memory for the same backend, phase, scene and stride.

Memory: the peak bytes one call allocates (torch's allocator with CuPy routed through it when torch
sees the GPU, else a CuPy allocator hook; tracemalloc on the CPU, which sees NumPy but not torch)
plus what the call reads that already lives in memory (inputs, weight, kernel map: their exact
sizes). `memory_breakdown.csv` sets the measured peak next to an estimate of features, outputs,
weights, kernel map and workspace (the temporary bytes of the chosen algorithm,
`Algorithm.transient_bytes`).

Files in `--output-dir`: `benchmark_full.csv` (a row per configuration × backend × phase),
`memory_breakdown.csv`, `heatmap_data.json` (status, time and memory per voxel count × channel
pair, for OOM frontiers, and the run's metadata: command, device, versions) and, with
`--precompile` on the GPU, `compile_times.csv` (one row per kernel module: NVRTC compiles a source
file's template instantiations together). `--cold` starts from empty kernel and tuning caches, so
`first_call_ms` (or `compile_ms` with `--precompile`) shows a fresh install's first-call latency.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import itertools
import json
import os
import shlex
import shutil
import signal
import sys
import tempfile
from dataclasses import asdict, dataclass

import numpy as np

from cupysparse.algorithms import CONV, ConvProblem, get_algorithm, registered
from cupysparse.cuda import backend
from cupysparse.cuda import compile
from cupysparse.cuda.dtypes import short_name
from cupysparse.cuda.precision import TF32, fp32_precision
from cupysparse.scripts.benchmark_first_call import host_ms, synchronize
from cupysparse.scripts.benchmarking import interleaved_samples_ms, memory_meter, torch_cuda, write_csv
from cupysparse.scripts.memory_analysis_backends import SPCONV, TORCH_DENSE, DenseTorchRunner, OursRunner, SpconvRunner
from cupysparse.scripts.memory_analysis_estimates import BREAKDOWN_PARTS, LayerShape, MemoryEstimate
from cupysparse.scripts.memory_analysis_grid import (
    Configuration,
    LayerArrays,
    MapCase,
    build_map,
    configurations,
    sampled_together,
    scene_coordinates,
)
from cupysparse.scripts import arguments
from cupysparse.scripts.populate_benchmark_cache import _comma_items, _parse_channel_pair
from cupysparse.tuning.search_space import AUTO, candidates, parse_algorithm_filter

PHASES = ("forward", "dgrad", "wgrad", "backward", "both")
GEMMS_PER_PHASE = {"forward": 1, "dgrad": 1, "wgrad": 1, "backward": 2, "both": 3}
OK, OOM, NOT_SUPPORTED, ERROR, NOT_TESTED = "ok", "oom", "not_supported", "error", "not_tested"
STATUSES = (OK, OOM, NOT_SUPPORTED, ERROR, NOT_TESTED)
KEY_COLUMNS = ("scene", "batch_size", "num_voxels", "in_channels", "out_channels", "kernel_size", "stride", "dtype")
FULL_COLUMNS = (
    "device", *KEY_COLUMNS, "backend", "phase", "status", "error", "dispatched", "num_in", "num_out", "pairs",
    "kernel_map_ms", "first_call_ms", "median_ms", "q25_ms", "q75_ms", "samples", "iterations", "tflops",
    "resident_mb", "call_peak_mb", "peak_memory_mb", "estimated_mb", "memory_source",
)
BREAKDOWN_COLUMNS = (
    *KEY_COLUMNS, "backend", "phase", "status", "dispatched", *(f"{part}_mb" for part in BREAKDOWN_PARTS),
    "estimated_mb", "peak_memory_mb",
)
COMPILE_COLUMNS = ("source", "dtype", "instantiations", "needed_by", "compiled", "compile_ms", "error")
DEFAULT_NUM_VOXELS = (30_000, 100_000, 300_000, 1_000_000)
DEFAULT_CHANNELS = ("32,32", "64,64", "128,128", "256,256")
DTYPE_CHOICES = ("fp16", "bf16", "fp32", "tf32", "fp64", "float16", "bfloat16", "float32", "float64")
DEFAULT_DENSE_MAX_CELLS = 2**24
MIB = 2**20


def _positive_ints(values, flag: str) -> tuple[int, ...]:
    numbers = tuple(dict.fromkeys(int(value) for value in _comma_items(values)))
    if not numbers or min(numbers) < 1:
        raise ValueError(f"{flag} takes positive integers, got {values}")
    return numbers


def backend_names() -> tuple[str, ...]:
    return (*registered(CONV), AUTO, SPCONV, TORCH_DENSE)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                        help="where to run: auto (the GPU if there is one), cuda or cpu")
    parser.add_argument("--num-voxels", nargs="+", type=arguments.counts, metavar="N",
                        help="voxel counts, comma list (30000,100K,1M; default 30K 100K 300K 1M)")
    parser.add_argument("--channels", nargs="+", default=DEFAULT_CHANNELS, metavar="C_in,C_out",
                        help="channel pairs, e.g. 32,32 64,128")
    parser.add_argument("--kernel-sizes", nargs="+", default=("3",), metavar="K", help="kernel sizes, e.g. 3 5")
    parser.add_argument("--strides", nargs="+", default=("1",), metavar="S", help="strides (1: submanifold)")
    parser.add_argument("--dtypes", nargs="+", default=("fp16",), choices=DTYPE_CHOICES, metavar="DTYPE",
                        help="fp16, bf16, fp32, tf32 (fp32 features, TF32 products), fp64")
    parser.add_argument("--scene", default="indoor", choices=("indoor", "outdoor"),
                        help="indoor rooms or outdoor LiDAR sweeps (cupysparse.data.scenes)")
    parser.add_argument("--batch-size", type=arguments.count, default=1, help="scenes per batch, sharing the voxel count")
    parser.add_argument("--backends", default=",".join(backend_names()),
                        help=f"comma list of {', '.join(backend_names())}")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)}")
    parser.add_argument("--repeats", type=int, default=10, help="timed samples per measurement")
    parser.add_argument("--iterations", type=int, default=5, help="calls per timed sample")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before the samples")
    parser.add_argument("--max-memory-gb", type=float, default=None,
                        help="skip (as oom) layers whose estimated footprint exceeds this; caps the GPU pool too")
    parser.add_argument("--dense-max-cells", type=arguments.count, default=DEFAULT_DENSE_MAX_CELLS,
                        help="largest dense grid (batch x bounding box) the torch baseline runs")
    parser.add_argument("--precompile", action="store_true",
                        help="compile every kernel module the grid needs before timing (compile_times.csv)")
    parser.add_argument("--kernel-cache-dir", default=None, help="the kernel cache folder (CUPY_CACHE_DIR)")
    parser.add_argument("--cold", action="store_true",
                        help="start from empty kernel and tuning caches (a temporary folder, or an empty "
                             "--kernel-cache-dir) to measure first-call latency")
    parser.add_argument("--output-dir", default="bench-results", help="folder for the CSV files and plots")
    return parser


def parse_args(argv=None, prog: str | None = None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        args.num_voxels = arguments.joined(args.num_voxels) if args.num_voxels else DEFAULT_NUM_VOXELS
        args.channels = tuple(dict.fromkeys(_parse_channel_pair(pair) for pair in args.channels))
        args.kernel_sizes = _positive_ints(args.kernel_sizes, "--kernel-sizes")
        args.strides = _positive_ints(args.strides, "--strides")
        args.dtypes = tuple(dict.fromkeys(TF32 if dtype == TF32 else short_name(dtype) for dtype in args.dtypes))
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    args.backends = tuple(dict.fromkeys(name.strip() for name in args.backends.split(",") if name.strip()))
    if unknown := [name for name in args.backends if name not in backend_names()]:
        parser.error(f"unknown backends {unknown}; valid: {', '.join(backend_names())}")
    args.phases = tuple(dict.fromkeys(phase.strip() for phase in args.phases.split(",") if phase.strip()))
    if not args.backends or not args.phases or set(args.phases) - set(PHASES):
        parser.error(f"--backends and --phases need valid names; phases: {', '.join(PHASES)}")
    for flag, value, low in (("--repeats", args.repeats, 1), ("--iterations", args.iterations, 1),
                             ("--warmup", args.warmup, 0)):
        if value < low:
            parser.error(f"{flag} must be at least {low}")
    if args.max_memory_gb is not None and args.max_memory_gb <= 0:
        parser.error("--max-memory-gb must be positive")
    if args.cold and args.kernel_cache_dir and os.path.isdir(args.kernel_cache_dir) and os.listdir(
            args.kernel_cache_dir):
        parser.error(f"--cold needs an empty --kernel-cache-dir; {args.kernel_cache_dir} has files")
    args.command = shlex.join(["cupysparse-benchmark-memory-analysis", *(sys.argv[1:] if argv is None else argv)])
    return args


@contextlib.contextmanager
def cache_folders(args):
    """Point the kernel cache (and with `--cold` the tuning cache) where asked for the duration of
    the run, before CuPy is imported; temporary folders made here are removed afterwards."""
    variables = ("CUPY_CACHE_DIR", "CUPYSPARSE_BENCHMARK_CACHE_DIR")
    saved = {name: os.environ.get(name) for name in variables}
    temporary = tempfile.mkdtemp(prefix="cupysparse-cold-") if args.cold else None
    try:
        if args.kernel_cache_dir or temporary:
            os.environ["CUPY_CACHE_DIR"] = args.kernel_cache_dir or os.path.join(temporary, "kernels")
        if temporary:
            os.environ["CUPYSPARSE_BENCHMARK_CACHE_DIR"] = os.path.join(temporary, "tuning")
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if temporary:
            shutil.rmtree(temporary, ignore_errors=True)


def is_out_of_memory(error: BaseException) -> bool:
    """MemoryError (CuPy's OutOfMemoryError is one), torch.OutOfMemoryError, or a message saying so."""
    torch = sys.modules.get("torch")
    kinds = (MemoryError, *((torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else ()))
    return isinstance(error, kinds) or "out of memory" in str(error).lower()


def significant(value: float | None, digits: int = 6) -> float | None:
    """`value` rounded to `digits` significant digits (for the CSV), None kept."""
    return None if value is None else float(f"{value:.{digits}g}")


def _mib(nbytes: int | None):
    return None if nbytes is None else round(nbytes / MIB, 3)


@dataclass
class Measurement:
    status: str
    error: str = ""
    dispatched: str = ""
    first_call_ms: float | None = None
    samples_ms: tuple[float, ...] = ()
    call_peak_bytes: int | None = None
    resident_bytes: int | None = None
    estimate: MemoryEstimate | None = None


@dataclass
class Started:
    """A measurement whose first call ran: what its samples need."""

    config: Configuration
    name: str
    runner: object
    phase: str
    fn: object
    first_call_ms: float


def not_tested(smaller: Configuration) -> Measurement:
    return Measurement(NOT_TESTED, f"at least as large as {smaller.label().strip()}, which ran out of memory")


class Harness:
    """Runs the grid: one measurement per configuration × backend × phase, rows as their layers finish."""

    def __init__(self, args, meter):
        self.args, self.meter = args, meter
        self.device = args.device
        self.max_bytes = None if args.max_memory_gb is None else int(args.max_memory_gb * 2**30)
        self.out_of_memory: dict[tuple[str, str], list[Configuration]] = {}
        self.full_rows: list[dict] = []
        self.breakdown_rows: list[dict] = []
        self.total = 0
        self.described = backend.describe_device(self.device)

    def runners(self, config: Configuration, coordinates_numpy, layer: LayerArrays, case: MapCase):
        kernel_map = case.kernel_map
        shape = LayerShape(kernel_map.num_in, kernel_map.num_out, config.in_channels, config.out_channels,
                           kernel_map.kernel_volume, config.feature_dtype)
        torch_gpu = torch_cuda() if self.device == "cuda" else None
        for name in self.args.backends:
            if name == SPCONV:
                yield name, SpconvRunner(config, coordinates_numpy, layer, shape, torch_gpu)
            elif name == TORCH_DENSE:
                yield name, DenseTorchRunner(config, coordinates_numpy, layer, shape, self.device,
                                             self.args.dense_max_cells)
            else:
                yield name, OursRunner(name, layer, case, shape)

    def skipped_by_frontier(self, name: str, phase: str, config: Configuration) -> Configuration | None:
        return next((smaller for smaller in self.out_of_memory.get((name, phase), ())
                     if config.at_least_as_large_as(smaller)), None)

    def start(self, name: str, runner, phase: str, config: Configuration):
        """Check a measurement and make its first call: a `Started` to sample, or the `Measurement`
        that ends it here (not supported, beyond a frontier, estimated too large, failed)."""
        reason = runner.unsupported_reason(phase)
        if reason:
            return Measurement(NOT_SUPPORTED, reason)
        smaller = self.skipped_by_frontier(name, phase, config)
        if smaller is not None:
            return not_tested(smaller)
        prepared = {}

        def first_call():
            prepared["fn"] = runner.prepare(phase)
            prepared["fn"]()
            synchronize(self.device)

        try:
            estimate = runner.estimate(phase)
            if self.max_bytes is not None and estimate.total > self.max_bytes:
                self.out_of_memory.setdefault((name, phase), []).append(config)
                return Measurement(OOM, f"estimated {estimate.total / 2**30:.3g} GB > --max-memory-gb "
                                        f"{self.args.max_memory_gb}", estimate=estimate)
            first_ms = host_ms(first_call)
        except Exception as error:  # noqa: BLE001 - one failing measurement must not stop the grid
            failure = self.failed(error, name, runner, phase, config)
        else:
            return Started(config, name, runner, phase, prepared["fn"], first_ms)
        self.meter.release()  # here, once the traceback and the arrays its frames held are gone
        return failure

    def failed(self, error: BaseException, name: str, runner, phase: str, config: Configuration) -> Measurement:
        """The measurement that `error` ended; an out-of-memory one becomes a frontier."""
        status = OOM if is_out_of_memory(error) else ERROR
        if status == OOM:
            self.out_of_memory.setdefault((name, phase), []).append(config)
        return Measurement(status, f"{type(error).__name__}: {error}".strip(), runner.dispatched(phase))

    def sample(self, started: list[Started]) -> list[Measurement]:
        """The samples of every started measurement, taken in turns (`interleaved_samples_ms`), then
        each one's peak memory."""
        if not started:
            return []
        calls = [(item.fn, functools.partial(fp32_precision, item.config.fp32_precision)) for item in started]
        sampled = interleaved_samples_ms(calls, self.device, self.args.warmup, self.args.repeats, self.args.iterations)
        measured = []
        for item, samples in zip(started, sampled):
            runner, phase = item.runner, item.phase
            try:
                if isinstance(samples, Exception):
                    raise samples
                with fp32_precision(item.config.fp32_precision):
                    peak = None if runner.memory_note else self.meter.peak_extra_bytes(item.fn)
                measured.append(Measurement(OK, "", runner.dispatched(phase), item.first_call_ms, tuple(samples),
                                            peak, runner.resident_bytes(phase), runner.estimate(phase)))
            except Exception as error:  # noqa: BLE001 - one failing measurement must not stop the grid
                measured.append(self.failed(error, item.name, runner, phase, item.config))
        del sampled, samples
        if any(result.status != OK for result in measured):
            self.meter.release()  # here, once the failures' tracebacks and the arrays their frames held are gone
        return measured

    def record(self, config: Configuration, name: str, phase: str, case: MapCase | None, measured: Measurement,
               runner) -> dict:
        """Add the rows of one measurement (`case` None: the layer could not be built) and return it."""
        ok = measured.status == OK
        median = q25 = q75 = tflops = None
        if ok:
            q25, median, q75 = (float(value) for value in np.percentile(measured.samples_ms, [25, 50, 75]))
            work = GEMMS_PER_PHASE[phase] * 2.0 * case.pairs * config.in_channels * config.out_channels
            tflops = work / median / 1e9
        resident = measured.resident_bytes if ok else None
        call_peak = measured.call_peak_bytes if ok else None
        peak = None if resident is None or call_peak is None else resident + call_peak
        estimate = measured.estimate
        row = {
            "device": self.described, **asdict(config), "backend": name, "phase": phase, "status": measured.status,
            "error": measured.error, "dispatched": measured.dispatched,
            "num_in": case.kernel_map.num_in if case else None, "num_out": case.kernel_map.num_out if case else None,
            "pairs": case.pairs if case else None, "kernel_map_ms": significant(case.build_ms) if case else None,
            "first_call_ms": significant(measured.first_call_ms), "median_ms": significant(median),
            "q25_ms": significant(q25), "q75_ms": significant(q75), "samples": len(measured.samples_ms) if ok else 0,
            "iterations": self.args.iterations if ok else 0, "tflops": significant(tflops, 4),
            "resident_mb": _mib(resident), "call_peak_mb": _mib(call_peak), "peak_memory_mb": _mib(peak),
            "estimated_mb": _mib(estimate.total if estimate else None),
            "memory_source": (runner.memory_note or self.meter.source) if ok else "",
        }
        self.full_rows.append(row)
        if estimate is not None:
            self.breakdown_rows.append({
                **asdict(config), "backend": name, "phase": phase, "status": measured.status,
                "dispatched": measured.dispatched,
                **{f"{part}_mb": _mib(getattr(estimate, part)) for part in BREAKDOWN_PARTS},
                "estimated_mb": _mib(estimate.total), "peak_memory_mb": _mib(peak),
            })
        return row

    def run(self, grid: list[Configuration]) -> None:
        self.total = len(grid) * len(self.args.backends) * len(self.args.phases)
        print(f"{len(grid)} configuration(s) x {len(self.args.backends)} backend(s) x {len(self.args.phases)} "
              f"phase(s) = {self.total} measurements on {self.described}; memory: {self.meter.source}", flush=True)
        count = coordinates_numpy = None
        cases = {}
        for group in sampled_together(grid, dtypes_together=self.max_bytes is None):
            if group[0].num_voxels != count:
                cases.clear()  # frees the previous voxel count's maps before building the next
                count = group[0].num_voxels
                coordinates_numpy = scene_coordinates(group[0].scene, count, group[0].batch_size)
            self.run_group(group, coordinates_numpy, cases)

    def run_group(self, group: list[Configuration], coordinates_numpy, cases: dict) -> None:
        """Every backend and phase of the layers of `group` (one shape, its dtypes), their maps taken
        from `cases` (by kernel size and stride) or built there; each phase's measurements sampled in
        turns, the rows recorded in grid order once all are done."""
        measurements = list(itertools.product(self.args.backends, self.args.phases))
        layers = []
        for config in group:
            if all(self.skipped_by_frontier(name, phase, config) for name, phase in measurements):
                self.record_failure(config, measurements, None)  # nothing left to run: not even the map
                continue
            try:
                map_key = (config.kernel_size, config.stride)
                if map_key not in cases:
                    cases[map_key] = build_map(backend.to_device(coordinates_numpy, self.device),
                                               config.kernel_size, config.stride, self.device,
                                               warmup=self.args.warmup > 0)
                case = cases[map_key]
                layer = LayerArrays(config, case, self.device)
            except Exception as error:  # noqa: BLE001 - a layer too large to build is a result as well
                failure = (OOM if is_out_of_memory(error) else ERROR,
                           f"building the layer: {type(error).__name__}: {error}")
                self.meter.release()
                self.record_failure(config, measurements, failure)
                continue
            layers.append((config, case, list(self.runners(config, coordinates_numpy, layer, case))))
        results = {}
        for phase in self.args.phases:
            started = []
            for config, _, runners in layers:
                with fp32_precision(config.fp32_precision):  # the first calls: their tuning and spconv's layer
                    for name, runner in runners:
                        outcome = self.start(name, runner, phase, config)
                        if isinstance(outcome, Started):
                            started.append(outcome)
                        else:
                            results[config, name, phase] = outcome
            for item, measured in zip(started, self.sample(started)):
                results[item.config, item.name, phase] = measured
        for config, case, runners in layers:
            for name, runner in runners:
                for phase in self.args.phases:
                    row = self.record(config, name, phase, case, results[config, name, phase], runner)
                    print_row(len(self.full_rows), self.total, config, row)

    def record_failure(self, config: Configuration, measurements, failure: tuple[str, str] | None) -> None:
        """Rows for a layer that was not built: `failure` (status, message) for each measurement not
        already beyond an out-of-memory frontier (those are `not_tested`)."""
        for name, phase in measurements:
            smaller = self.skipped_by_frontier(name, phase, config)
            if smaller is not None:
                measured = not_tested(smaller)
            else:
                measured = Measurement(*failure)
                if failure[0] == OOM:
                    self.out_of_memory.setdefault((name, phase), []).append(config)
            row = self.record(config, name, phase, None, measured, None)
            print_row(len(self.full_rows), self.total, config, row)

    def heatmaps(self) -> list[dict]:
        """Per backend, phase, dtype, kernel size and stride: status, median ms and peak MiB on a
        grid of voxel counts (rows) × channel pairs (columns)."""
        channels = [f"{c_in},{c_out}" for c_in, c_out in self.args.channels]
        counts = sorted(self.args.num_voxels)
        groups: dict[tuple, dict] = {}
        for row in self.full_rows:
            group_key = (row["backend"], row["phase"], row["dtype"], row["kernel_size"], row["stride"])
            group = groups.setdefault(group_key, {
                "backend": row["backend"], "phase": row["phase"], "dtype": row["dtype"],
                "kernel_size": row["kernel_size"], "stride": row["stride"], "num_voxels": counts,
                "channels": channels, **{field: [[None] * len(channels) for _ in counts]
                                         for field in ("status", "median_ms", "peak_memory_mb")},
            })
            i = counts.index(row["num_voxels"])
            j = channels.index(f"{row['in_channels']},{row['out_channels']}")
            for field in ("status", "median_ms", "peak_memory_mb"):
                group[field][i][j] = row[field]
        return list(groups.values())


def print_row(index: int, total: int, config: Configuration, row: dict) -> None:
    width = len(str(total))
    if row["status"] == OK:
        peak = "?" if row["peak_memory_mb"] is None else f"{row['peak_memory_mb']:.1f}"
        result = (f"{row['median_ms']:>10.4f} ms [{row['q25_ms']:.4f}, {row['q75_ms']:.4f}] "
                  f"{row['tflops']:>8.3g} TFLOP/s  peak {peak} MiB  {row['dispatched']}")
    else:
        result = row["error"]
    print(f"[{index:>{width}}/{total}] {config.label()}  {row['backend']:<18} {row['phase']:<8} {row['status']:<13} "
          f"{result}", flush=True)


def print_summary(rows: list[dict], backends, output_dir: str) -> None:
    print("\nstatus counts per backend:")
    print(f"  {'backend':<20}" + "".join(f"{status:>14}" for status in STATUSES))
    for name in backends:
        counts = [sum(1 for row in rows if row["backend"] == name and row["status"] == status) for status in STATUSES]
        print(f"  {name:<20}" + "".join(f"{count:>14}" for count in counts))
    print(f"results in {output_dir}")


def kernel_sources_needed(backends, problems) -> dict:
    """The kernel modules (`compile.KernelSource`s, each one NVRTC compilation) that running `backends`
    on `problems` (GPU `ConvProblem`s) may launch, with the backends needing each: a named algorithm's
    modules for each of its parameters, `auto`'s candidates' (forward and backward), as
    `Algorithm.kernel_modules` declares them; explicit GEMM (the tuner's reference) needs none."""
    needed: dict = {}
    for problem in problems:
        for name in backends:
            if name in (SPCONV, TORCH_DENSE):
                continue
            if name == AUTO:
                pool = [(phase, algorithm, params) for phase in ("forward", "backward")
                        for algorithm, params in candidates(parse_algorithm_filter(AUTO, CONV, phase), problem)]
            else:
                algorithm = get_algorithm(name)
                pool = [(phase, algorithm, params) for phase in ("forward", "backward")
                        for params in algorithm.param_grid(phase)]
            for phase, algorithm, params in pool:
                for source in algorithm.kernel_modules(phase, problem, params):
                    need = needed.setdefault(source, {"dtypes": set(), "needed_by": set()})
                    need["dtypes"].add(short_name(problem.dtype))
                    need["needed_by"].add(name)
    return needed


def grid_problems(grid: list[Configuration]) -> list[ConvProblem]:
    """A GPU `ConvProblem` per distinct layer of the grid (sizes as requested), for `kernel_sources_needed`."""
    capability = int(backend.cupy_module().cuda.Device().compute_capability)
    return list(dict.fromkeys(
        ConvProblem(config.num_voxels, config.num_voxels, config.in_channels, config.out_channels,
                    config.kernel_size**3, config.feature_dtype, "cuda", capability, (config.stride,) * 3,
                    tf32=config.dtype == TF32)
        for config in grid))


def precompile(grid: list[Configuration], backends, device: str) -> list[dict]:
    """Load every kernel module the grid needs before timing (from the kernel cache, or compiled by
    NVRTC), the map kernels by building a small map of each kernel size and stride; a row per module."""
    if device != "cuda":
        print("--precompile: the NumPy path compiles nothing", flush=True)
        return []
    loads_before = len(compile.module_loads())
    small = backend.to_device(scene_coordinates(grid[0].scene, 2_000, 1), device)
    for kernel_size, stride in dict.fromkeys((config.kernel_size, config.stride) for config in grid):
        build_map(small, kernel_size, stride, device, warmup=False)
    rows = [{"source": load.filename, "dtype": "", "instantiations": "", "needed_by": "kernel maps",
             "compiled": load.compiled, "compile_ms": significant(load.seconds * 1e3), "error": ""}
            for load in compile.module_loads()[loads_before:]]
    for source, need in kernel_sources_needed(backends, grid_problems(grid)).items():
        loads_before = len(compile.module_loads())
        row = {"source": source.filename, "dtype": " ".join(sorted(need["dtypes"])),
               "instantiations": len(source.name_expressions), "needed_by": " ".join(sorted(need["needed_by"])),
               "compiled": "", "compile_ms": None, "error": ""}
        try:
            source.get(source.name_expressions[0])  # loads (and if need be compiles) the whole module
            loads = compile.module_loads()[loads_before:]
            row["compiled"] = any(load.compiled for load in loads)
            row["compile_ms"] = significant(sum(load.seconds for load in loads) * 1e3)
        except Exception as error:  # noqa: BLE001 - a module that fails to compile is recorded, not fatal
            row["error"] = f"{type(error).__name__}: {error}"
        rows.append(row)
        print(f"precompile {row['source']:<26} {row['dtype'] or '':<5} {row['needed_by']:<24} "
              f"{'compiled' if row['compiled'] else 'cached'} {row['compile_ms']} ms {row['error']}", flush=True)
    return rows


def library_versions(device: str) -> dict:
    """Versions of what ran, as far as it is loaded in this process."""
    versions = {"python": sys.version.split()[0]}
    for module_name in ("cupysparse", "numpy", "cupy", "torch", "spconv"):
        module = sys.modules.get(module_name)
        if module is not None:
            versions[module_name] = str(getattr(module, "__version__", "unknown"))
    if device == "cuda":
        runtime = backend.cupy_module().cuda.runtime
        versions["cuda_runtime"] = str(runtime.runtimeGetVersion())
        versions["cuda_driver"] = str(runtime.driverGetVersion())
    return versions


def main(argv=None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    with cache_folders(args):
        if args.device == "auto":
            args.device = backend.default_device()
        elif args.device == "cuda" and not backend.gpu_available():
            print("--device cuda: no CUDA GPU is usable (see `python -m cupysparse info`)", file=sys.stderr)
            return 2
        if args.device == "cpu" and TF32 in args.dtypes:
            print("--dtypes tf32: TF32 runs on GPU tensor cores; the CPU computes fp32 exactly (use fp32)",
                  file=sys.stderr)
            return 2
        grid = configurations(args)
        meter = memory_meter(args.device)
        if args.max_memory_gb is not None:
            meter.limit(int(args.max_memory_gb * 2**30))
        compile_rows = precompile(grid, args.backends, args.device) if args.precompile else []
        harness = Harness(args, meter)
        interrupted = False
        try:
            with _terminate_as_interrupt():
                harness.run(grid)
        except KeyboardInterrupt:  # keep what was measured: the files below hold the rows so far
            interrupted = True
            print(f"interrupted after {len(harness.full_rows)} of {harness.total} measurements; writing those",
                  file=sys.stderr, flush=True)
        os.makedirs(args.output_dir, exist_ok=True)
        write_csv(harness.full_rows, os.path.join(args.output_dir, "benchmark_full.csv"), FULL_COLUMNS)
        write_csv(harness.breakdown_rows, os.path.join(args.output_dir, "memory_breakdown.csv"), BREAKDOWN_COLUMNS)
        if compile_rows:
            write_csv(compile_rows, os.path.join(args.output_dir, "compile_times.csv"), COMPILE_COLUMNS)
        metadata = {
            "command": args.command,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": harness.described,
            "versions": library_versions(args.device),
            "memory_source": meter.source,
            "settings": {"repeats": args.repeats, "iterations": args.iterations, "warmup": args.warmup,
                         "max_memory_gb": args.max_memory_gb, "dense_max_cells": args.dense_max_cells,
                         "cold": args.cold, "precompile": args.precompile,
                         "kernel_cache_dir": args.kernel_cache_dir or ("empty temporary folder" if args.cold
                                                                       else "default")},
            "precompile": compile_rows,
        }
        path = os.path.join(args.output_dir, "heatmap_data.json")
        with open(path, "w") as handle:
            json.dump({"metadata": metadata, "heatmaps": harness.heatmaps()}, handle, indent=1, default=str)
        print(f"wrote {path}")
        print_summary(harness.full_rows, args.backends, args.output_dir)
    return 130 if interrupted else 0


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM (a job's time limit, `timeout`) raises KeyboardInterrupt, as Ctrl-C does, while the grid runs."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
