"""Loading a network's kernels before its first call, in a background thread.

Without it, a fresh process's first forward reads the tuning caches and loads kernel modules layer after
layer as it meets them (most of the 30 ms a first MinkUNet18 forward spent above the steady 13 ms on an
H100). `prefetch_kernels` starts that work as soon as a network's weights
are on its GPU (`InferenceNetwork`; the torch networks' `.to()`, `.cuda()`, `.half()`), so it runs while
the program does what comes before the first call, typically reading its data:

- for each convolution of the network, at every size the tuning caches (the user's, the shipped file of
  the GPU's architecture) rank the candidates for, the tuner's choice (`Tuner.recall`: nothing is
  measured, and `select` answers from it later);
- the modules those choices launch from (`Algorithm.kernel_modules`) and the ones no algorithm claims
  (kernel maps, pooling, the epilogue), read from the kernel cache, or compiled, side by side
  (`compile.prepare`);
- for the convolutions the caches know at no size, which the first call will tune, the modules of every
  candidate the tuner measures (`tuning_modules`), started behind those and not waited for
  (`compile.start_loading`): with empty caches, NVRTC compiles them while the program reads its data,
  and the tuner's measurements then join the compilations under way;
- the choices' launch plans (`Algorithm.forward_plan` / `backward_plan`), whose kernels and fixed
  arguments the algorithms keep per signature, so that a layer's first call only looks them up;
- given the network's call (`rehearse`), a rehearsal: the network run once on a few voxels
  (`rehearsal_tensor`), each convolution with the choice recalled for its layer (the largest size the
  caches rank; `tuner.rehearsal`), so that what a first call does once whatever the sizes happens here:
  the kernel maps' and the framework's own first kernels (CuPy's, PyTorch's), each kernel's first
  launch, derived map formats, and each layer's launch plan kept for every size the caches rank
  (`execution.layer_plan`), which the first call then finds. Nothing is measured or written, and no
  choice is kept for the few voxels' sizes; normalisation layers change no statistics
  (`tuner.rehearsing`).

Sizes the caches know nothing about are tuned at the first call, as without it. The network's first call
stops what is left (`KernelPrefetch.stop`): a prefetch started just before the call would otherwise
compete with it for the interpreter lock, and the call loads what it needs itself. A prefetch that fails
changes nothing: each launch loads, and raises, what it needs. `CUPYSPARSE_PREFETCH=0` turns it off.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from dataclasses import dataclass, replace

import numpy as np

from cupysparse import settings
from cupysparse.networks import descriptions as networks
from cupysparse.tuning.search_space import parse_algorithm_filter
from cupysparse.algorithms import CONV, ConvProblem
from cupysparse.cuda.backend import cupy_module
from cupysparse.cuda.compile import KernelSource, prepare, start_loading
from cupysparse.cuda.dtypes import short_name
from cupysparse.cuda.precision import uses_tf32
from cupysparse.tuning.search_space import Selection
from cupysparse.geometry.sparse_tensor import SparseTensor
from cupysparse.tuning.tuner import (
    NAMESPACES,
    SIZE_KEY_NAMES,
    RehearsalStopped,
    Tuner,
    default_tuner,
    rehearsal,
    rehearsal_key,
    sizeless_key,
    tuning_key,
)
from cupysparse.networks.warmup import FeatureType, layer_problems, unclaimed_sources

PHASES = ("forward", "backward")
# The rehearsal's voxels: a cube of this edge, enough for one voxel at the deepest level of a U-Net of
# four stride-2 stages.
REHEARSAL_EDGE = 8

log = logging.getLogger("cupysparse.networks.prefetch")


def prefetch_enabled() -> bool:
    return settings.prefetch()


@dataclass(frozen=True)
class CachedChoice:
    """The tuner's choice for one convolution problem and phase, as the caches hold it."""

    phase: str
    problem: ConvProblem
    selection: Selection


@dataclass(frozen=True)
class Prefetched:
    """What one prefetch did: choices recalled, modules made ready, modules started for the tuner's
    measurements, whether the network's rehearsal ran to its end, its seconds, and whether a call of the
    network stopped it before the end."""

    choices: int
    modules: int
    tuning_modules: int
    rehearsed: bool
    seconds: float
    stopped: bool


class KernelPrefetch:
    """A prefetch started by `prefetch_kernels`. A network's calls `stop()` it: what is left is done by
    the calls that need it, so a prefetch started just before a call never holds the interpreter lock
    for work the call does not need. Copies and pickles of a network carry no prefetch."""

    def __init__(self, future: concurrent.futures.Future, stop_event: threading.Event):
        self._future, self._stop_event = future, stop_event

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Prefetched:
        """What it did, once done (raises what made it fail)."""
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def stop(self) -> None:
        self._stop_event.set()


def cached_choices(network: networks.Network, dtype, capability: int, phases=("forward",), algorithms=None,
                   tuner: Tuner | None = None) -> list[CachedChoice]:
    """The tuner's choices for the convolutions of `network` in `dtype` on a GPU of `capability` (e.g.
    90), in `phases`, at every size its caches rank candidates for. `algorithms`: the search space of
    each phase, {"forward": ..., "backward": ...} as the functional API takes them (default: the
    environment variables, else `auto`)."""
    return list(_cached_choices(network, dtype, capability, phases, algorithms, tuner or default_tuner()))


def _layer_problems(network: networks.Network, dtype, capability: int) -> list[ConvProblem]:
    """A problem per distinct convolution of `network`, in its order."""
    dtype = np.dtype(dtype)
    return layer_problems(network, FeatureType(short_name(dtype), dtype, uses_tf32(dtype, on_gpu=True)), capability)


def _cached_choices(network, dtype, capability, phases, algorithms, tuner):
    """`cached_choices`, one at a time."""
    problems = _layer_problems(network, dtype, capability)
    for phase in phases:
        search_space = parse_algorithm_filter((algorithms or {}).get(phase), CONV, phase)
        buckets: dict[tuple, list[tuple[int, int]]] = {}  # by key without sizes: (input, output) size buckets
        for key in tuner.cache.keys(NAMESPACES[(CONV, phase)]):
            values = dict(key)
            buckets.setdefault(sizeless_key(key), []).append(tuple(values[name] for name in SIZE_KEY_NAMES))
        for problem in problems:
            for in_bucket, out_bucket in buckets.get(sizeless_key(tuning_key(problem)), ()):
                sized = replace(problem, num_in=1 << in_bucket, num_out=1 << out_bucket)
                selection = tuner.recall(search_space, sized)
                if selection is not None:
                    yield CachedChoice(phase, sized, selection)


def tuning_modules(network: networks.Network, dtype, capability: int, choices: list[CachedChoice],
                   phases=("forward",), algorithms=None,
                   tuner: Tuner | None = None) -> list[KernelSource]:
    """The kernel modules the tuner loads to measure the convolutions of `network` (as `cached_choices`
    takes them) for which `choices` hold no size in a phase: every candidate's, phase after phase, layer
    after layer in the network's order. Empty where the tuner would measure nothing (tuning turned off,
    a single candidate)."""
    tuner = tuner or default_tuner()
    known = {(choice.phase, sizeless_key(tuning_key(choice.problem))) for choice in choices}
    problems = _layer_problems(network, dtype, capability)
    sources = []
    for phase in phases:
        search_space = parse_algorithm_filter((algorithms or {}).get(phase), CONV, phase)
        for problem in problems:
            if (phase, sizeless_key(tuning_key(problem))) not in known:
                sources += [source for algorithm, params in tuner.candidates_to_measure(search_space, problem)
                            for source in algorithm.kernel_modules(phase, problem, params)]
    return list(dict.fromkeys(sources))


def _build_plan(choice: CachedChoice):
    algorithm, params = choice.selection.algorithm, choice.selection.params
    if choice.phase == "forward":
        return algorithm.forward_plan(choice.problem, params)
    return algorithm.backward_plan(choice.problem, params)


def rehearsal_tensor(network: networks.Network, dtype) -> SparseTensor:
    """`REHEARSAL_EDGE`^D voxels of batch 0 on the current GPU, `network.in_channels` zero features."""
    cupy = cupy_module()
    cells = np.indices((REHEARSAL_EDGE,) * networks.SPATIAL_DIMS).reshape(networks.SPATIAL_DIMS, -1).T
    coordinates = np.concatenate([np.zeros((len(cells), 1), np.int64), cells], axis=1).astype(np.int32)
    return SparseTensor(cupy.asarray(coordinates), cupy.zeros((len(cells), network.in_channels), dtype),
                        validate=False)


def _rehearse(rehearse, network: networks.Network, dtype: np.dtype, choices: list[CachedChoice],
              stop: threading.Event) -> bool:
    """Run `rehearse` on `rehearsal_tensor` inside `tuner.rehearsal` with each layer's choice for the
    largest size recalled; whether it ran to its end."""
    by_layer = {}
    for choice in sorted(choices, key=lambda choice: (choice.problem.num_in, choice.problem.num_out)):
        by_layer.setdefault(rehearsal_key(CONV, choice.phase, choice.problem), []).append(
            (choice.problem, choice.selection))
    try:
        with rehearsal(by_layer, stop):
            rehearse(rehearsal_tensor(network, dtype))
    except RehearsalStopped:
        return False
    except Exception:  # noqa: BLE001 - the first call does what the rehearsal could not, and raises itself
        log.debug("prefetch: the rehearsal of %s failed", network.name, exc_info=True)
        return False
    return True


def _prefetch(network: networks.Network, dtype: np.dtype, device_id: int, phases: tuple, algorithms,
              rehearse, stop: threading.Event) -> Prefetched:
    begin = time.perf_counter()
    device = cupy_module().cuda.Device(device_id)
    with device:
        capability = int(device.compute_capability)
        choices = []
        for choice in _cached_choices(network, dtype, capability, phases, algorithms, default_tuner()):
            if stop.is_set():
                break
            choices.append(choice)
        sources = [source for choice in choices for source in choice.selection.algorithm.kernel_modules(
            choice.phase, choice.problem, choice.selection.params)]
        sources = list(dict.fromkeys([*sources, *unclaimed_sources([dtype])]))
        to_tune = [] if stop.is_set() else [
            source for source in tuning_modules(network, dtype, capability, choices, phases, algorithms)
            if source not in sources]
        start_loading([*sources, *to_tune])  # the compile threads take them in this order
        prepare(sources)
        for choice in choices:
            if stop.is_set():
                break
            try:
                _build_plan(choice)
            except Exception:  # noqa: BLE001 - the call that needs this plan builds it, and raises, itself
                log.debug("prefetch: no plan for %s", choice, exc_info=True)
        rehearsed = (rehearse is not None and not stop.is_set()
                     and _rehearse(rehearse, network, dtype, choices, stop))
    return Prefetched(len(choices), len(sources), len(to_tune), rehearsed, time.perf_counter() - begin,
                      stop.is_set())


@functools.cache
def _worker() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cupysparse-prefetch")


def prefetch_kernels(network: networks.Network, dtype, device_id: int | None = None, phases=("forward",),
                     algorithms=None, rehearse=None) -> KernelPrefetch | None:
    """Start loading what `network`'s convolutions in `dtype` will launch on GPU `device_id` (default:
    the current one) in `phases` (see the module docstring and `cached_choices`); None when prefetching
    is off or there is no CuPy. `rehearse`: what runs the network's
    forward on a core `SparseTensor` on that GPU, without stopping this prefetch, for the rehearsal
    (None: none). Prefetches run one at a time, in the order asked."""
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        raise ValueError(f"phases must be some of {PHASES}, got {tuple(phases)}")
    cupy = cupy_module()
    if not prefetch_enabled() or cupy is None:
        return None
    device_id = cupy.cuda.Device().id if device_id is None else int(device_id)
    stop = threading.Event()
    future = _worker().submit(_prefetch, network, np.dtype(dtype), device_id, tuple(phases), algorithms, rehearse,
                              stop)
    return KernelPrefetch(future, stop)
