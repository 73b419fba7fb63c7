"""Launch plans kept per layer signature: a layer's selection made once, for all its later calls.

A network calls each layer again and again with the same signature: the map's geometry, its sizes as
the tuner tells them apart (`size_bucket`), the weight's shape, the dtype, the device and the
algorithm argument. The selection of its first call (the tuner measuring on the call's own data the
first time it meets the problem) therefore holds for the later ones, which need only the selected
algorithm's launch plan (`Algorithm.forward_plan` / `backward_plan`): allocate the outputs, launch on
device addresses. No argument conversion, problem description or selection per call: on a
100K-voxel layer those took as long as its kernels.

`kept_plan` selects on first use and keeps the plan (None for an algorithm without plans: such a
layer takes the full path every call) until the tuner's choices (`choices_version`) or, for no
algorithm argument, the environment variable change. The functional API and the framework adapters
keep theirs here; a new kernel map of a kept signature (the next scene) reuses the plan.

`map_layer_plan` remembers a call's plan on its kernel map too, under the call's own signature (what
the caller tells calls apart by: shapes, dtype, device, algorithm argument), so that the later calls
over that map, a network's every step, skip the signature's sizes and geometry: one dictionary lookup
and a check that no setting changed since (`_settings_generation`), without reading the settings
themselves. After a change, the call looks its plan up again under the settings' values.
"""

from __future__ import annotations

import functools

from cupysparse import settings
from cupysparse.tuning.search_space import parse_algorithm_filter
from cupysparse.algorithms import CONV
from cupysparse.tuning.tuner import choices_generation, choices_version, size_bucket

_plans: dict[tuple, object] = {}
# How many times `forget_plans` ran: the plans remembered on maps before it are stale.
_forgotten = 0


def algorithm_argument(algo, kind: str, phase: str) -> str:
    """The canonical string of an algorithm argument, checked: "" for None (the environment variable
    decides at each call), else `auto`, `all` or `[a,b]`. A typo raises here, naming the caller's value."""
    if algo is None:
        return ""
    return _algorithm_argument(tuple(algo) if isinstance(algo, list) else algo, kind, phase)


@functools.lru_cache(maxsize=256)
def _algorithm_argument(algo, kind: str, phase: str) -> str:
    search_space = parse_algorithm_filter(algo, kind, phase)
    if search_space.mode == "names":
        return "[" + ",".join(search_space.names) + "]"
    return search_space.mode


def algorithm_filter(argument: str, kind: str, phase: str):
    """The `AlgorithmFilter` of an `algorithm_argument` string."""
    return parse_algorithm_filter(argument or None, kind, phase)


def plan_key(phase: str, dtype, weight_shape: tuple, device_index: int, argument: str, kernel_volume: int,
             stride: tuple, transposed: bool, generative: bool, num_in: int, num_out: int) -> tuple:
    """The signature a kept plan serves: what the tuner keys its choices on (map geometry, sizes as
    `size_bucket`s, channels, dtype), the device, the algorithm argument (the environment variable's
    value for "") and the tuner's `choices_version`. `dtype` is the caller's own (NumPy's or a
    framework's): each keeps its plans apart."""
    return (phase, dtype, weight_shape, device_index, *_selection_settings(phase, argument), kernel_volume, stride,
            transposed, generative, size_bucket(num_in), size_bucket(num_out))


def _selection_settings(phase: str, argument: str) -> tuple[str, tuple]:
    """What a selection depends on beyond the layer: the algorithm choice (the environment variable's
    for "") and the tuner's `choices_version`."""
    return argument or (settings.algorithm_mode(CONV, phase)[1] or ""), choices_version()


def map_plan_key(phase: str, dtype, weight_shape: tuple, device_index: int, argument: str, kernel_map) -> tuple:
    """`plan_key` of a layer over `kernel_map`."""
    return plan_key(phase, dtype, weight_shape, device_index, argument, kernel_map.kernel_volume, kernel_map.stride,
                    kernel_map.transposed, kernel_map.generative, kernel_map.num_in, kernel_map.num_out)


def kept_plan(key: tuple, select):
    """The plan kept for `key`, or `select()`'s (kept for the next call; an exception keeps nothing)."""
    try:
        return _plans[key]
    except KeyError:
        plan = _plans[key] = select()
        return plan


def _settings_generation() -> tuple:
    """Differs whenever `_selection_settings` of some phase and argument may, or the plans were forgotten."""
    return _forgotten, settings.generation(), choices_generation()


def map_layer_plan(kernel_map, call: tuple, select, *arguments):
    """The plan of a layer's `call` over `kernel_map` (`call` the signature the caller tells its calls
    apart by, its algorithm argument included), remembered on the map until a setting changes; else
    `select(*arguments)`'s (a `kept_plan`, or None for a call no plan runs), remembered likewise. An
    exception remembers nothing."""
    generation = _settings_generation()
    remembered = kernel_map.layer_plans.get(call)
    if remembered is not None and remembered[0] == generation:
        return remembered[1]
    plan = select(*arguments)
    kernel_map.layer_plans[call] = (generation, plan)
    return plan


def keep_plan(key: tuple, plan) -> None:
    """Keep `plan` for `key` unless one is kept already (a choice recalled ahead of the first call)."""
    _plans.setdefault(key, plan)


def forget_plans() -> None:
    """Drop every kept plan, and those remembered on maps: the next call of each layer selects again."""
    global _forgotten
    _forgotten += 1
    _plans.clear()
