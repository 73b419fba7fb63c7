"""Which kernel modules the reference networks need, and compiling them ahead of time into the kernel
cache, so that a fresh process runs no NVRTC (the command line is `cupysparse-warmup`).

Which modules is derived, not listed: for every convolution of the chosen networks
(`cupysparse.networks.descriptions`) in every chosen dtype, the candidates that the forward and the
backward search spaces (`CUPYSPARSE_FWD_ALGO_MODE` / `CUPYSPARSE_BWD_ALGO_MODE`, default `auto`)
try on that architecture, each with the modules it launches from (`Algorithm.kernel_modules`, what
the tuner compiles before measuring them); and the modules no convolution algorithm claims (kernel
maps, pooling, the inference epilogue) of those dtypes. The files written are exactly the ones a GPU
process of the architecture looks up, `compile.kernel_cache_file(source,
compile.architecture_option(capability))` in the kernel cache directory; modules already there are
not compiled again. NVRTC keeps one core busy per module and releases the interpreter lock while it
compiles, so modules compile side by side (`compile.compile_async`, the tuner's mechanism too).
"""

from __future__ import annotations

import concurrent.futures
import re
from dataclasses import dataclass

from cupysparse import algorithms  # noqa: F401 (registers the algorithms' kernel sources)
from cupysparse.algorithms import CONV, KINDS, ConvProblem, registered
from cupysparse.cuda import backend, compile
from cupysparse.cuda.dtypes import FEATURE_DTYPES, FLOAT32, as_feature_dtype, cuda_type_name, short_name
from cupysparse.cuda.precision import TF32, get_fp32_precision
from cupysparse.functional import epilogue, pooling  # noqa: F401 (register their kernel sources)
from cupysparse.geometry import hashing, kernel_map  # noqa: F401 (register their kernel sources)
from cupysparse.geometry.coords import as_tuple
from cupysparse.networks import descriptions as networks
from cupysparse.tuning.search_space import candidates, parse_algorithm_filter

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
_ARCHITECTURE = re.compile(r"^(?:sm_)?(\d{2,3})$")


@dataclass(frozen=True)
class FeatureType:
    """A dtype as the convolutions see it: fp32 may multiply in TF32 (`cupysparse.cuda.precision`)."""

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
