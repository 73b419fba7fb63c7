"""Cold start: a fresh process's first MinkUNet18 forward on the demo's scene against the steady state.

    cupysparse-benchmark-cold-start                                   # whatever the caches hold now
    CUPY_CACHE_DIR=$(mktemp -d) CUPYSPARSE_BENCHMARK_CACHE_DIR=$(mktemp -d) CUPYSPARSE_SHIPPED_CACHE=0 \\
        cupysparse-benchmark-cold-start                               # empty caches: compile + tune
    python -m cupysparse warmup && cupysparse-benchmark-cold-start    # warm kernels, shipped tuning

Run it as a new process: what it measures is what a process pays the first time. Before the clock
starts it builds, in the order a program does, the network (random weights, inference in --dtype,
`eval()`), whose kernels the tuning caches name start loading in the background (with the modules the
tuner will measure for the layers they do not know), followed by a rehearsal of its forward on a few
voxels (`cupysparse.networks.prefetch`; --no-prefetch: none of this), then the
demo's scene (`cupysparse.scripts.demo.scene_tensor`: the indoor room, 200K voxels on a GPU, seed 0), and with
PyTorch makes one small matrix product in the dtype: PyTorch's own first-use cost (the cuBLAS handle),
which any torch program pays, is reported apart. Then, host clock to the synchronised result, the
first forward on a fresh tensor (its kernel maps built: module loads from the kernel cache or NVRTC,
tuning where no cache has the layer's problem, CuPy's own first kernels), and the median of --repeats
later forwards, each on a fresh tensor too (maps built again, as for a new scene). It reports the
ratio, the kernel modules loaded during the first forward (and how many NVRTC compiled, with their
time, in the background or not) and how many problems the tuner measured, and the seconds from the
network's construction to the first forward's result: with empty caches, every compilation and
measurement of the cold start is in them, wherever it ran.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time

from cupysparse import settings
from cupysparse.cuda import backend
from cupysparse.cuda import compile
from cupysparse.networks import descriptions as networks
from cupysparse.tuning.cache_file import cache_file_path
from cupysparse.scripts import arguments
from cupysparse.scripts.demo import scene_tensor
from cupysparse.data.scenes import INDOOR_CLASSES
from cupysparse.tuning.shipped import shipped_cache_path, shipped_caches_enabled
from cupysparse.geometry.sparse_tensor import SparseTensor
from cupysparse.tuning.tuner import default_tuner

PROFILE_LINES = 40


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog or "cupysparse-benchmark-cold-start",
                                     description=__doc__.splitlines()[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--framework", choices=("auto", "torch", "cupy"), default="auto",
                        help="the torch module or the framework-free network (auto: torch when installed)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="where to run: auto (the GPU if there is one), cuda or cpu")
    parser.add_argument("--num-voxels", type=arguments.count, default=None, help="default: the demo's (200000; CPU 20000)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None,
                        help="default: the demo's (float16 on a GPU, float32 on the CPU)")
    parser.add_argument("--repeats", type=int, default=10, help="steady-state forwards timed")
    parser.add_argument("--no-prefetch", dest="prefetch", action="store_false",
                        help="build the network without loading its kernels in the background")
    parser.add_argument("--profile", metavar="FILE", default=None,
                        help="profile the first forward on the host (cProfile): write the statistics to FILE "
                             "(for pstats or snakeviz) and print the functions that took the longest")
    return parser


def parse_args(argv=None, prog: str | None = None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = backend.default_device()
    elif args.device == "cuda" and not backend.gpu_available():
        parser.error("--device cuda: no usable CUDA GPU (see `python -m cupysparse info`)")
    if args.framework == "auto":
        try:
            import torch  # noqa: F401
        except ImportError:
            args.framework = "cupy"
        else:
            args.framework = "torch"
    args.num_voxels = args.num_voxels or (200_000 if args.device == "cuda" else 20_000)
    args.dtype = args.dtype or ("float16" if args.device == "cuda" else "float32")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


class TorchForward:
    """MinkUNet18 as the torch module, inference in the dtype; `__call__` on a fresh core tensor."""

    def __init__(self, description, device: str, dtype: str, prefetch: bool):
        import torch

        from cupysparse.adapters.torch import SparseTensor as TorchSparseTensor
        from cupysparse.adapters.torch.networks import SparseNetwork

        self._torch, self._tensor_type = torch, TorchSparseTensor
        torch.manual_seed(0)
        with prefetch_turned(prefetch):
            self._model = SparseNetwork(description).eval().to(device, getattr(torch, dtype))
        self.prefetched = self._model.prefetched

    def torch_first_use(self, device: str, dtype: str) -> None:
        eye = self._torch.eye(16, device=device, dtype=getattr(self._torch, dtype))
        (eye @ eye).sum().item()

    def __call__(self, tensor: SparseTensor):
        with self._torch.no_grad():
            return self._model(self._tensor_type.from_core(tensor)).features


class CoreForward:
    """MinkUNet18 framework-free (`InferenceNetwork`), random weights."""

    def __init__(self, description, device: str, dtype: str, prefetch: bool):
        from cupysparse.networks.inference import InferenceNetwork

        self._network = InferenceNetwork(description, networks.random_weights(description), device, dtype,
                                         prefetch=prefetch)
        self.prefetched = self._network.prefetched

    def torch_first_use(self, device: str, dtype: str) -> None:
        pass

    def __call__(self, tensor: SparseTensor):
        return self._network(tensor).features


@contextlib.contextmanager
def prefetch_turned(on: bool):
    """`CUPYSPARSE_PREFETCH` set to `on` for what runs inside."""
    previous = os.environ.get(settings.PREFETCH.name)
    os.environ[settings.PREFETCH.name] = "1" if on else "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[settings.PREFETCH.name]
        else:
            os.environ[settings.PREFETCH.name] = previous


def describe_prefetch(prefetched) -> str:
    if prefetched is None:
        return "no prefetch"
    if not prefetched.done():
        return "prefetch still running when the first forward started (the forward stops it)"
    if prefetched.exception() is not None:
        return f"prefetch failed: {prefetched.exception()!r}"
    done = prefetched.result()
    return (f"prefetch done before the first forward: {done.choices} choices, {done.modules} modules "
            f"({done.tuning_modules} more started for the tuner), {'rehearsed' if done.rehearsed else 'no rehearsal'}, "
            f"{done.seconds * 1e3:.1f} ms in the background")


def timed_ms(forward, tensor: SparseTensor, device: str, profiler: cProfile.Profile | None = None) -> float:
    fresh = SparseTensor(tensor.coordinates, tensor.features, tensor.tensor_stride, validate=False)
    begin = time.perf_counter()
    with profiler or contextlib.nullcontext():
        forward(fresh)
        if device == "cuda":
            backend.cupy_module().cuda.runtime.deviceSynchronize()
    return (time.perf_counter() - begin) * 1e3


def describe_caches(device: str) -> str:
    shipped = "off" if device == "cuda" else "not used on the CPU"
    if shipped_caches_enabled() and device == "cuda":
        path = shipped_cache_path(f"sm_{int(backend.cupy_module().cuda.Device().compute_capability)}")
        shipped = f"{path} ({'present' if path.is_file() else 'absent'})"
    user = cache_file_path()
    return (f"kernel cache {backend.kernel_cache_dir()}; tuning cache {user} "
            f"({'present' if user.is_file() else 'absent'}); shipped tuning {shipped}")


def main(argv=None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    description = networks.minkunet(18, 3, len(INDOOR_CLASSES))
    constructed = time.perf_counter()
    forward = (TorchForward if args.framework == "torch" else CoreForward)(description, args.device, args.dtype,
                                                                         args.prefetch)
    _, tensor, _ = scene_tensor("indoor", args.num_voxels, 0, args.device, args.dtype)
    print(f"cold start on {backend.describe_device(args.device)}: {description.name} ({args.framework}), indoor scene "
          f"{len(tensor):,} voxels, {args.dtype}")
    print(describe_caches(args.device), flush=True)
    begin = time.perf_counter()
    forward.torch_first_use(args.device, args.dtype)
    if args.framework == "torch":
        print(f"PyTorch's own first use (not counted): {(time.perf_counter() - begin) * 1e3:.1f} ms")

    loads_before, measured_before = len(compile.module_loads()), default_tuner().measurements
    profiler = cProfile.Profile() if args.profile else None
    prefetched = describe_prefetch(forward.prefetched)
    first = timed_ms(forward, tensor, args.device, profiler)
    since_construction = time.perf_counter() - constructed
    loads = compile.module_loads()[loads_before:]
    compiled = [load for load in loads if load.compiled]
    measured = default_tuner().measurements - measured_before
    steady = statistics.median(timed_ms(forward, tensor, args.device) for _ in range(args.repeats))
    # Modules compile side by side (compile.prepare), so their seconds add up to more than the wall time.
    print(f"first forward   {first:10.1f} ms: {len(loads)} kernel modules loaded ({len(compiled)} compiled by "
          f"NVRTC, {sum(load.seconds for load in compiled):.1f} s of compilation summed over them, the others read "
          f"in {sum(load.seconds for load in loads if not load.compiled) * 1e3:.1f} ms); {measured} problems tuned")
    print(f"                {prefetched}")
    print(f"                {since_construction:.1f} s from the network's construction to this "
          f"result (the scene's making and the framework's first use included)")
    print(f"steady forward  {steady:10.1f} ms (median of {args.repeats}, kernel maps built each time)")
    print(f"ratio           {first / steady:10.2f}x")
    if profiler is not None:
        profiler.dump_stats(args.profile)
        print(f"\nthe first forward's profile ({args.profile}), by cumulative time:")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(PROFILE_LINES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
