"""Cold start: the first convolution call of a fresh process against the steady state.

Run it as a new process after populating the benchmark cache with the same configurations (it
builds them exactly as `cupysparse-populate-benchmark-cache` does: scene, map, seeded data):

    cupysparse-populate-benchmark-cache --preset quick
    cupysparse-benchmark-first-call --preset quick --csv first_call.csv

For each configuration, after its kernel map and every format derived from it are built
(`KernelMap.derive_formats`: map work, not part of a convolution call), it times the first call of
each phase (`conv_forward`, `conv_backward`) by the host clock up to the synchronised result, then
the median of --repeats further calls measured the same way. It reports the ratio, whether the
tuner had to benchmark (it should not, with a populated cache), the kernel modules loaded during
the first call with their load times (from the kernel cache, or compiled by NVRTC when that cache
is cold), and how much the first call grew CuPy's memory pool (new device allocations). The very
first call of the process also pays the process's one-time costs (reading the benchmark cache,
loading kernel modules); later configurations show what a populated configuration costs. `--profile
FILE` writes a cProfile of the very first call to FILE and of every later first call to FILE with
`-later` before its suffix, and prints the top entries of both.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time

from cupysparse.cuda import backend
from cupysparse.cuda import compile
from cupysparse.tuning.cache_file import cache_file_path
from cupysparse.functional.convolution import conv_backward, conv_forward
from cupysparse.scripts.benchmarking import write_csv
from cupysparse.scripts.populate_benchmark_cache import (
    LayerData,
    SceneMaps,
    add_grid_arguments,
    configurations,
    grid_from_arguments,
)
from cupysparse.tuning.tuner import default_tuner

PHASES = ("forward", "backward")


def synchronize(device: str) -> None:
    if device == "cuda":
        backend.cupy_module().cuda.get_current_stream().synchronize()


def call(data: LayerData, phase: str, algo_mode: str, device: str):
    """One synchronised call of `phase` through the functional API, the way users call it."""
    if phase == "forward":
        result = conv_forward(data.features, data.weight, data.kernel_map, algo_mode)
    else:
        result = conv_backward(data.grad_output, data.features, data.weight, data.kernel_map, algo_mode)
    synchronize(device)
    return result


def pool_bytes(device: str) -> int:
    """Bytes CuPy's memory pool holds: a first call that grows it paid for device allocations."""
    return backend.cupy_module().get_default_memory_pool().total_bytes() if device == "cuda" else 0


def host_ms(fn) -> float:
    begin = time.perf_counter()
    fn()
    return (time.perf_counter() - begin) * 1e3


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_grid_arguments(parser)
    parser.add_argument("--phases", default="forward,backward", help="comma-separated: forward, backward")
    parser.add_argument("--repeats", type=int, default=20, help="steady-state calls timed per phase")
    parser.add_argument("--profile", metavar="FILE", help="write a cProfile of the very first call to FILE")
    parser.add_argument("--csv", metavar="FILE", help="also write the table as CSV")
    return parser


def parse_args(argv=None, prog: str | None = None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.phases = [phase.strip() for phase in args.phases.split(",") if phase.strip()]
    unknown = sorted(set(args.phases) - set(PHASES))
    if unknown or not args.phases:
        parser.error(f"--phases takes {', '.join(PHASES)}; got {args.phases}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    grid_from_arguments(parser, args)
    return args


def main(argv=None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    grid = configurations(args.num_voxels, args.channels, args.kernel_sizes, args.dtypes)
    tuner = default_tuner()
    print(f"first call against steady state on {backend.describe_device(args.device)}, cache {cache_file_path()}")
    scenes = SceneMaps(args.batch_size, args.device)
    rows = []
    profilers = None
    if args.profile:
        profilers = {"very first call": cProfile.Profile(), "later first calls": cProfile.Profile()}
    for config in grid:
        data = LayerData(config, scenes.kernel_map(config.num_voxels, config.kernel_size).derive_formats(), args.device)
        synchronize(args.device)
        for phase in args.phases:
            measured_before, loads_before = tuner.measurements, len(compile.module_loads())
            pool_before = pool_bytes(args.device)
            if profilers:
                profiler = profilers["later first calls" if rows else "very first call"]
                first = host_ms(lambda: profiler.runcall(call, data, phase, args.algo_mode, args.device))
            else:
                first = host_ms(lambda: call(data, phase, args.algo_mode, args.device))
            loads = compile.module_loads()[loads_before:]
            pool_growth = pool_bytes(args.device) - pool_before
            steady = statistics.median(
                host_ms(lambda: call(data, phase, args.algo_mode, args.device)) for _ in range(args.repeats)
            )
            rows.append({
                "num_voxels": config.num_voxels,
                "in_channels": config.in_channels,
                "out_channels": config.out_channels,
                "dtype": config.dtype,
                "phase": phase,
                "benchmarked": tuner.measurements - measured_before,
                "first_ms": round(first, 3),
                "steady_ms": round(steady, 3),
                "ratio": round(first / steady, 2),
                "modules_loaded": " ".join(
                    f"{load.filename}({'compiled' if load.compiled else 'cached'})" for load in loads
                ),
                "module_load_ms": round(sum(load.seconds for load in loads) * 1e3, 3),
                "pool_growth_mib": round(pool_growth / 2**20, 1),
            })
            row = rows[-1]
            print(f"{config.label()}  {phase:<8}  first {first:8.3f} ms  steady {steady:8.3f} ms  "
                  f"x{row['ratio']:<5}  benchmarked {row['benchmarked']}  "
                  f"modules {row['modules_loaded'] or '-'} ({row['module_load_ms']} ms)  "
                  f"memory pool +{row['pool_growth_mib']} MiB", flush=True)
        data = None
    if profilers:
        stem, dot, suffix = args.profile.rpartition(".")
        later = f"{stem}-later{dot}{suffix}" if dot else f"{args.profile}-later"
        for (which, profiler), path in zip(profilers.items(), (args.profile, later)):
            profiler.dump_stats(path)
            print(f"\nprofile of the {which} written to {path}; top entries by cumulative time:")
            pstats.Stats(path).sort_stats("cumulative").print_stats(25)
    if args.csv:
        write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
