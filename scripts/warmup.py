"""`python -m cupysparse warmup` (also `cupysparse-warmup`): compile, ahead of time, every kernel
module the reference networks need into the kernel cache, so that a fresh process runs no NVRTC.

    python -m cupysparse warmup                        # for the visible GPUs' architectures
    python -m cupysparse warmup --arch sm_90 sm_80     # no GPU needed: for GPUs that will read the cache
    python -m cupysparse warmup --dtypes float16 bfloat16 float32 --networks minkunet18 --list
    python -m cupysparse warmup --arch sm_90 --dtypes float16 --resources   # registers, spills, warps per kernel

Which modules: see `cupysparse.networks.warmup`. Aimed at the GPUs of this machine (no `--arch`), it
then runs each network once, forward and backward, on a small scene with every candidate algorithm
(measured into a throwaway cache, the user's is not touched), so that CuPy's own elementwise and
reduction kernels are compiled into the same kernel cache; `--compile-only` skips that. `--resources` compiles
the same modules into no cache, with ptxas's report, and prints what each kernel takes of a multiprocessor
(`cupysparse.cuda.resources`): its registers a thread and the warps a multiprocessor holds at them, its static
shared memory, stack and spilled bytes. No GPU is needed for either with `--arch`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import time

from cupysparse import settings
from cupysparse.cuda import backend, compile
from cupysparse.cuda.precision import TF32, fp32_precision, get_fp32_precision
from cupysparse.cuda.resources import kernel_resources, max_resident_warps
from cupysparse.data.scenes import make_scene
from cupysparse.geometry.sparse_tensor import SparseTensor
from cupysparse.networks.tuning import tune_network
from cupysparse.networks.warmup import (
    DEFAULT_DTYPES,
    DTYPE_CHOICES,
    NETWORKS,
    FeatureType,
    ModuleResult,
    PlannedModule,
    compile_modules,
    parse_architecture,
    plan,
    visible_capabilities,
)
from cupysparse.tuning.cache_file import BenchmarkCache
from cupysparse.tuning.tuner import Tuner

RUN_VOXELS = 20_000  # the scene each network runs on once, to compile CuPy's own kernels


def run_networks_once(network_names, feature_types, device: int) -> float:
    """Each network forward and backward on a small scene on `device`, every candidate measured into
    a throwaway cache: CuPy compiles (and caches) the kernels of its own that these paths use."""
    cupy = backend.cupy_module()
    begin = time.perf_counter()
    with cupy.cuda.Device(device), tempfile.TemporaryDirectory() as directory:
        tuner = Tuner(BenchmarkCache(os.path.join(directory, "throwaway.msgpack"), autosave=False))
        scene = make_scene("indoor", RUN_VOXELS)
        voxels = SparseTensor.from_points(cupy.asarray(scene.points), scene.voxel_size)
        for network_name in network_names:
            network = NETWORKS[network_name]()
            for feature_type in feature_types:
                features = cupy.random.default_rng(0).standard_normal((len(voxels), network.in_channels),
                                                                      dtype=cupy.float32)
                tensor = SparseTensor(voxels.coordinates, features.astype(feature_type.dtype), validate=False)
                with fp32_precision(TF32 if feature_type.tf32 else get_fp32_precision()):
                    tune_network(network, tensor, tuner)
        cupy.cuda.get_current_stream().synchronize()
    return time.perf_counter() - begin


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", nargs="+", metavar="sm_XY",
                        help="architectures to compile for, without a GPU (default: the visible GPUs')")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPE_CHOICES, default=list(DEFAULT_DTYPES),
                        help="feature dtypes the networks run in (tf32: fp32 multiplied in TF32)")
    parser.add_argument("--networks", nargs="+", choices=sorted(NETWORKS), default=sorted(NETWORKS),
                        help="the reference networks to compile for (default: all)")
    parser.add_argument("--jobs", type=int, default=compile.compile_workers(),
                        help="NVRTC compilations at a time (threads; default: the CPUs this process may use)")
    parser.add_argument("--list", action="store_true", help="list the modules and their cache files; compile nothing")
    parser.add_argument("--compile-only", action="store_true",
                        help="on a GPU, skip the networks' run that compiles CuPy's own kernels")
    parser.add_argument("--resources", action="store_true",
                        help="print each kernel's registers, the warps a multiprocessor holds at them, its shared "
                             "memory and spilled bytes (ptxas through NVRTC); fill no cache")


def _print_result(result: ModuleResult, done: int, total: int) -> None:
    status = (f"FAILED: {result.error}" if result.error else
              f"{'compiled' if result.compiled else 'cached  '} {result.seconds:6.2f} s")
    print(f"[{done:>{len(str(total))}}/{total}] sm_{result.module.capability} {result.module.describe()}  {status}",
          flush=True)


def _module_resources(module: PlannedModule):
    if not module.option.startswith("-arch=sm_"):
        return None  # PTX: the driver assigns registers when it loads the module
    return kernel_resources(module.source, module.option)


def print_resources(modules: list[PlannedModule], jobs: int) -> int:
    """Each module's kernels as ptxas reports them, module by module in the plan's order, compiled on `jobs` threads
    (NVRTC releases the interpreter lock); a kernel that spills is marked. 1 where a module failed to compile."""
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(_module_resources, module) for module in modules]
        for module, future in zip(modules, futures):
            print(f"sm_{module.capability} {module.describe()}", flush=True)
            try:
                resources = future.result()
            except RuntimeError as error:
                failed += 1
                print(f"    FAILED: {error}", flush=True)
                continue
            if resources is None:
                print(f"    PTX ({module.option}): the driver assigns its registers when it loads it")
                continue
            most = max_resident_warps(module.capability)
            for expression, used in resources.items():
                spills = (f"  SPILLS {used.spill_stores} B stored, {used.spill_loads} B loaded"
                          if used.spill_stores or used.spill_loads else "")
                print(f"    {used.registers:>3} registers  {used.resident_warps(module.capability):>2}/{most} warps  "
                      f"{used.shared_bytes:>6} B static shared  {used.stack_bytes:>4} B stack  {expression}{spills}")
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    if backend.cupy_module() is None:  # also moves an unwritable kernel cache directory aside, as a GPU run would
        print("warm-up needs CuPy and NVRTC: pip install 'cupysparse[cuda]'", file=sys.stderr)
        return 2
    if settings.cupy_cache_in_memory():
        print("CUPY_CACHE_IN_MEMORY=1 keeps kernels in memory only: there is no kernel cache to fill", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print("--jobs must be at least 1", file=sys.stderr)
        return 2
    try:
        feature_types = [FeatureType.parse(name) for name in dict.fromkeys(args.dtypes)]
        if args.arch:
            devices = {parse_architecture(text): None for text in args.arch}
        elif backend.gpu_available():
            devices = visible_capabilities()
        else:
            print("no GPU is visible: name the architectures to compile for, e.g. --arch sm_90", file=sys.stderr)
            return 2
        modules = plan(args.networks, feature_types, devices)
    except (ValueError, TypeError, RuntimeError) as error:
        print(f"warm-up: {error}", file=sys.stderr)
        return 2
    print(f"kernel cache {backend.kernel_cache_dir()}; networks {', '.join(args.networks)}; dtypes "
          f"{', '.join(t.label for t in feature_types)}", flush=True)
    for capability in devices:
        count = sum(module.capability == capability for module in modules)
        print(f"sm_{capability}: {count} modules, compiled with {compile.architecture_option(capability)}")
    if args.list:
        for module in modules:
            path = compile.kernel_cache_file(module.source, module.option)
            print(f"sm_{module.capability} {module.describe()}\n    {path}")
        return 0
    if args.resources:
        return print_resources(modules, args.jobs)
    begin = time.perf_counter()
    results = compile_modules(modules, args.jobs, _print_result)
    compiled = [r for r in results if r.compiled]
    failed = [r for r in results if r.error]
    print(f"compiled {len(compiled)} of {len(results)} modules ({len(results) - len(compiled) - len(failed)} were "
          f"cached, {len(failed)} failed) in {time.perf_counter() - begin:.1f} s wall, "
          f"{sum(r.seconds for r in compiled):.1f} s of NVRTC", flush=True)
    if not args.arch and not args.compile_only and not failed:
        for capability, device in devices.items():
            seconds = run_networks_once(args.networks, feature_types, device)
            print(f"sm_{capability}: ran the networks once on GPU {device} (CuPy's own kernels): {seconds:.1f} s",
                  flush=True)
    return 1 if failed else 0


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog or "cupysparse-warmup", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return run(build_parser(prog).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
