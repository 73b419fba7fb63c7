"""`python -m cupysparse warmup` (also `cupysparse-warmup`): compile, ahead of time, every kernel
module the reference networks need into the kernel cache, so that a fresh process runs no NVRTC.

    python -m cupysparse warmup                        # for the visible GPUs' architectures
    python -m cupysparse warmup --arch sm_90 sm_80     # no GPU needed: for GPUs that will read the cache
    python -m cupysparse warmup --dtypes float16 bfloat16 float32 --networks minkunet18 --list

Which modules is derived, not listed: for every convolution of the chosen networks
(`cupysparse.networks`) in every chosen dtype, the candidates that the forward and the backward
search spaces (`CUPYSPARSE_FWD_ALGO_MODE` / `CUPYSPARSE_BWD_ALGO_MODE`, default `auto`) try on
that architecture, each with the modules it launches from (`Algorithm.kernel_modules`, what the
tuner compiles before measuring them); and the modules no convolution algorithm claims (kernel
maps, pooling, the inference epilogue) of those dtypes. The files written are exactly the ones a GPU
process of the architecture looks up, `compile.kernel_cache_file(source,
compile.architecture_option(capability))` in `CUPY_CACHE_DIR` (default `~/.cupy/kernel_cache`);
modules already there are not compiled again. NVRTC keeps one core busy per module and releases the
interpreter lock while it compiles, so modules compile side by side in `--jobs` threads
(`compile.compile_async`, the tuner's mechanism too).

Aimed at the GPUs of this machine (no `--arch`), it then runs each network once, forward and
backward, on a small scene with every candidate algorithm (measured into a throwaway cache, the
user's is not touched), so that CuPy's own elementwise and reduction kernels are compiled into the
same kernel cache; `--compile-only` skips that.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass

from . import algorithms, backend, compile, coordinate_index, epilogue, kernel_map, networks, pooling  # noqa: F401 (sources)
from .algorithm_modes import parse_algorithm_filter
from .algorithms import CONV, KINDS, ConvProblem, registered
from .coords import as_tuple
from .dtypes import FEATURE_DTYPES, FLOAT32, as_feature_dtype, cuda_type_name, short_name
from .precision import TF32, fp32_precision, get_fp32_precision
from .tuner import candidates  # the tuner's own rule: warm-up compiles what tuning will run

NETWORKS = {
    "minkunet14": lambda: networks.minkunet(14),
    "minkunet18": lambda: networks.minkunet(18),
    "minkunet34": lambda: networks.minkunet(34),
    "centerpoint": networks.centerpoint_backbone,
}
DTYPE_CHOICES = ("float16", "bfloat16", "float32", "tf32")
DEFAULT_DTYPES = ("float16", "float32")
# The candidates depend on channels, dtype and architecture, not on sizes: any size will do.
NOMINAL_VOXELS = 100_000
UNCLAIMED_MODULES = "kernel maps, pooling, epilogue"
RUN_VOXELS = 20_000  # the scene each network runs on once, to compile CuPy's own kernels
_ARCHITECTURE = re.compile(r"^(?:sm_)?(\d{2,3})$")


@dataclass(frozen=True)
class FeatureType:
    """A dtype as the convolutions see it: fp32 may multiply in TF32 (`cupysparse.precision`)."""

    label: str
    dtype: object
    tf32: bool

    @classmethod
    def parse(cls, name: str) -> FeatureType:
        if name == "tf32":
            return cls("tf32", FLOAT32, True)
        dtype = as_feature_dtype(name)
        return cls(short_name(dtype), dtype, dtype == FLOAT32 and get_fp32_precision() == TF32)


@dataclass(frozen=True)
class PlannedModule:
    """One kernel module to have in the cache for one architecture, and what needs it."""

    source: compile.KernelSource
    capability: int
    option: str  # the NVRTC -arch option a process on that architecture compiles with
    needed_by: tuple[str, ...]

    def describe(self) -> str:
        expressions = self.source.name_expressions
        kernels = expressions[0] if len(expressions) == 1 else f"{len(expressions)} kernels"
        return f"{self.source.filename:<24} {kernels}  {', '.join(self.needed_by)}"


@dataclass(frozen=True)
class ModuleResult:
    module: PlannedModule
    seconds: float
    compiled: bool
    error: str | None = None


def parse_architecture(text: str) -> int:
    """'sm_90' or '90' → 90."""
    match = _ARCHITECTURE.match(text.strip().lower())
    if match is None:
        raise ValueError(f"an architecture is sm_XY (e.g. sm_90), got {text!r}")
    return int(match.group(1))


def _names_dtypes(dtypes) -> re.Pattern:
    """Matches a template argument list naming one of `dtypes` (CUDA or short name: `<__half, 64>`, `<fp16>`)."""
    names = {name for dtype in dtypes for name in (cuda_type_name(dtype), short_name(dtype))}
    return re.compile(rf"[<,]\s*(?:{'|'.join(map(re.escape, sorted(names)))})\s*[,>]")


def _names_any_dtype(source: compile.KernelSource, patterns) -> bool:
    return any(pattern.search(expression) for pattern in patterns for expression in source.name_expressions)


def layer_problems(network: networks.Network, feature_type: FeatureType, capability: int) -> list[ConvProblem]:
    """A GPU problem per distinct convolution of `network` in `feature_type` on `capability`."""
    problems = []
    for _, conv in networks.convolutions(network):
        stride = as_tuple(conv.stride, networks.SPATIAL_DIMS, "stride")
        problems.append(ConvProblem(NOMINAL_VOXELS, NOMINAL_VOXELS, conv.in_channels, conv.out_channels,
                                    conv.kernel_volume(), feature_type.dtype, "cuda", capability, stride,
                                    conv.transposed, tf32=feature_type.tf32))
    return list(dict.fromkeys(problems))


def needed_sources(network_names, feature_types, capability: int) -> dict[compile.KernelSource, set[str]]:
    """The kernel modules that running `network_names` in `feature_types` on `capability` may load,
    each with what needs it (see the module docstring)."""
    needed: dict[compile.KernelSource, set[str]] = {}
    for feature_type in feature_types:
        for network_name in network_names:
            network = NETWORKS[network_name]()
            for problem in layer_problems(network, feature_type, capability):
                for phase in ("forward", "backward"):
                    for algorithm, params in candidates(parse_algorithm_filter(None, CONV, phase), problem):
                        for source in algorithm.kernel_modules(phase, problem, params):
                            needed.setdefault(source, set()).add(f"{network.name} {feature_type.label}")
    for source in unclaimed_sources([feature_type.dtype for feature_type in feature_types]):
        needed.setdefault(source, set()).add(UNCLAIMED_MODULES)
    return needed


def unclaimed_sources(dtypes) -> list[compile.KernelSource]:
    """The modules no convolution algorithm claims (kernel maps, pooling, the inference epilogue) that
    name one of `dtypes` in their instantiations or name no dtype at all."""
    claimed = {filename for kind in KINDS for algorithm in registered(kind).values()
               for filename in algorithm.kernel_sources}
    patterns = [_names_dtypes(dtypes)]
    every_dtype = [_names_dtypes(FEATURE_DTYPES)]
    return [source for source in dict.fromkeys(compile.registered_sources())
            if source.filename not in claimed
            and (_names_any_dtype(source, patterns) or not _names_any_dtype(source, every_dtype))]


def plan(network_names, feature_types, capabilities) -> list[PlannedModule]:
    """Every module to have in the cache, per architecture, in a stable order."""
    modules = []
    for capability in dict.fromkeys(capabilities):
        needed = needed_sources(network_names, feature_types, capability)
        for source in sorted(needed, key=lambda s: (s.filename, s.name_expressions)):
            option = compile.source_option(source, capability)
            modules.append(PlannedModule(source, capability, option, tuple(sorted(needed[source]))))
    return modules


def compile_modules(modules: list[PlannedModule], jobs: int, report=None) -> list[ModuleResult]:
    """Have every module in the kernel cache, compiled on `jobs` threads at a time; `report(result,
    done, total)` as each finishes. A module that fails is reported, not fatal."""
    futures = {compile.compile_async(module.source, module.option, jobs): module for module in modules}
    results = []
    for future in concurrent.futures.as_completed(futures):
        module, error = futures[future], future.exception()
        if error is None:
            compilation = future.result()
            result = ModuleResult(module, compilation.seconds, compilation.compiled_now)
        else:
            result = ModuleResult(module, 0.0, False, f"{type(error).__name__}: {error}")
        results.append(result)
        if report is not None:
            report(result, len(results), len(modules))
    return results


def visible_capabilities() -> dict[int, int]:
    """Compute capability → the first visible device of it."""
    cupy = backend.cupy_module()
    found: dict[int, int] = {}
    for device in range(cupy.cuda.runtime.getDeviceCount()):
        found.setdefault(int(cupy.cuda.Device(device).compute_capability), device)
    return found


def run_networks_once(network_names, feature_types, device: int) -> float:
    """Each network forward and backward on a small scene on `device`, every candidate measured into
    a throwaway cache: CuPy compiles (and caches) the kernels of its own that these paths use."""
    from .benchmark_cache import BenchmarkCache
    from .network_tuning import tune_network
    from .scenes import make_scene
    from .sparse_tensor import SparseTensor
    from .tuner import Tuner

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
    parser.add_argument("--networks", nargs="+", choices=sorted(NETWORKS), default=sorted(NETWORKS))
    parser.add_argument("--jobs", type=int, default=compile.compile_workers(),
                        help="NVRTC compilations at a time (threads; default: the CPUs this process may use)")
    parser.add_argument("--list", action="store_true", help="list the modules and their cache files; compile nothing")
    parser.add_argument("--compile-only", action="store_true",
                        help="on a GPU, skip the networks' run that compiles CuPy's own kernels")


def _print_result(result: ModuleResult, done: int, total: int) -> None:
    status = (f"FAILED: {result.error}" if result.error else
              f"{'compiled' if result.compiled else 'cached  '} {result.seconds:6.2f} s")
    print(f"[{done:>{len(str(total))}}/{total}] sm_{result.module.capability} {result.module.describe()}  {status}",
          flush=True)


def run(args: argparse.Namespace) -> int:
    if backend.cupy_module() is None:  # also moves an unwritable kernel cache directory aside, as a GPU run would
        print("warm-up needs CuPy and NVRTC: pip install 'cupysparse[cuda]'", file=sys.stderr)
        return 2
    if os.environ.get("CUPY_CACHE_IN_MEMORY") == "1":
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cupysparse-warmup", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
