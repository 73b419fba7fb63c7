"""The one path from a convolution call to its kernels, for the core's arrays and a framework's alike.

`forward` and `backward` take a layer's arrays, its kernel map and its algorithm argument (the
canonical string of `search_space.algorithm_argument`), and an `Arrays`: how the arrays of one
framework are allocated, addressed and viewed as the core's. `CORE` serves NumPy and CuPy; the
adapters bring theirs (`cupysparse.adapters.torch.bridge`). A call then:

1. finds the layer's launch plan: what the call's signature (its dtype, weight shape, device and
   algorithm argument, and its map's kernel, kind and sizes as the tuner tells them apart) selected the
   first time, kept until a setting a selection depends on changes (`settings.selection_state()`), so a
   new map of a known signature (the next scene) costs a lookup. A selection asks the tuner (which
   measures the candidates on the call's own data the first time it meets the problem) and the selected
   algorithm for its launch plan (`Algorithm.forward_plan` / `backward_plan`);
2. with a plan, allocates the outputs through `Arrays` and launches on device addresses: no argument
   conversion, no problem description, no selection. On a 100K-voxel layer those took as long as its
   kernels;
3. without one (NumPy arrays, an algorithm without plans, arrays a plan cannot take: not contiguous,
   of two dtypes, on another device), takes the full path on the core's views of the arrays, which
   checks the arguments (errors name them), selects and runs the algorithm's entry points.

Out of memory, either path raises the allocator's error naming the convolution's sizes.
"""

from __future__ import annotations

import contextlib
import functools
import operator

import numpy as np

from cupysparse import settings
from cupysparse.algorithms import CONV, ConvProblem
from cupysparse.cuda.backend import cupy_module
from cupysparse.cuda.dtypes import FEATURE_DTYPES
from cupysparse.cuda.out_of_memory import naming_sizes
from cupysparse.functional import checks
from cupysparse.functional.epilogue import ConvEpilogue
from cupysparse.geometry.kernel_map import derive_wgrad_shares
from cupysparse.tuning.search_space import Selection, algorithm_filter, candidates, parse_algorithm_filter
from cupysparse.tuning.tuner import rehearsed_sizes, rehearsing, rehearsing_sizes, select_algorithm, size_bucket

PHASES = ("forward", "backward")
_FEATURE_DTYPES = frozenset(FEATURE_DTYPES)


class Arrays:
    """What the execution path needs of one framework's arrays; an adapter implements it and nothing
    else of the path. Every method is called on the hot path of a planned call, so each is one or two
    attribute reads or calls of the framework."""

    def launch_device(self, features, weight, grad_output=None) -> int | None:
        """The GPU a plan can take these arrays on, else None: arrays of this framework on the current
        GPU, of one dtype, the features (and output gradient) contiguous."""
        raise NotImplementedError

    def core_dtype(self, dtype) -> np.dtype | None:
        """The core's dtype for arrays of the framework's `dtype`, None when the core has none."""
        raise NotImplementedError

    def empty(self, like, shape: tuple):
        """An uninitialised contiguous array of `shape` in `like`'s dtype, on its device."""
        raise NotImplementedError

    def empty_float32(self, like, shape: tuple):
        """An uninitialised contiguous fp32 array of `shape` on `like`'s device."""
        raise NotImplementedError

    def address(self, array) -> int:
        """The device address of `array`'s first element."""
        raise NotImplementedError

    def stream(self, like) -> int:
        """The raw handle of the CUDA stream launches for `like`'s device go on."""
        raise NotImplementedError

    def padded_weight(self, weight, shape: tuple, transposed: bool, reuse: bool):
        """`weight` `[K, A, B]` (read as `[K, B, A]` when `transposed`) contiguous and zero-padded at the
        end of its last two dimensions to `shape`, the layout a plan's kernels read. `reuse`: the
        weight does not change between calls (inference), so a padded copy may be kept."""
        raise NotImplementedError

    def device_context(self, like):
        """A context in which the core runs on `like`'s device, stream and allocator."""
        raise NotImplementedError

    def gpu(self, array) -> int | None:
        """The GPU `array` lives on, None for a host array."""
        raise NotImplementedError

    def current_gpu(self) -> int:
        raise NotImplementedError

    def is_contiguous(self, array) -> bool:
        raise NotImplementedError

    def contiguous(self, array):
        """`array`, or a contiguous copy of it."""
        raise NotImplementedError

    def to_core(self, array):
        """The core's (NumPy or CuPy) view of `array`."""
        raise NotImplementedError

    def from_core(self, array):
        """The framework's view of a core array."""
        raise NotImplementedError


class CoreArrays(Arrays):
    """NumPy and CuPy arrays: plans take CuPy arrays; NumPy arrays always take the full path."""

    def __init__(self):
        cupy = cupy_module()
        self._ndarray = None if cupy is None else cupy.ndarray
        if cupy is not None:
            # CuPy keeps the contiguity its `flags` report in `_c_contiguous`; `flags` builds an object
            # on every read, a microsecond on the slower hosts.
            self._c_contiguous = operator.attrgetter(
                "_c_contiguous" if hasattr(cupy.ndarray, "_c_contiguous") else "flags.c_contiguous")
            self._current_device = cupy.cuda.runtime.getDevice
            self._current_stream = cupy.cuda.get_current_stream
            self._zeros = cupy.zeros

    def launch_device(self, features, weight, grad_output=None) -> int | None:
        ndarray = self._ndarray
        if type(features) is not ndarray or type(weight) is not ndarray or weight.dtype != features.dtype:
            return None
        device = features.data.device_id
        if not self._c_contiguous(features) or weight.data.device_id != device or device != self._current_device():
            return None
        if grad_output is not None and (type(grad_output) is not ndarray or grad_output.dtype != features.dtype
                                        or not self._c_contiguous(grad_output)
                                        or grad_output.data.device_id != device):
            return None
        return device

    def core_dtype(self, dtype) -> np.dtype:
        return np.dtype(dtype)

    def empty(self, like, shape: tuple):
        return self._ndarray(shape, like.dtype)

    def empty_float32(self, like, shape: tuple):
        return self._ndarray(shape, np.float32)

    # A C-level getter, not a method: it costs no Python frame on the hot path.
    address = operator.attrgetter("data.ptr")

    def stream(self, like) -> int:
        return self._current_stream().ptr

    def padded_weight(self, weight, shape: tuple, transposed: bool, reuse: bool):
        if transposed:
            weight = weight.transpose(0, 2, 1)
        if weight.shape == shape and self._c_contiguous(weight):
            return weight
        padded = self._zeros(shape, dtype=weight.dtype)
        padded[:, : weight.shape[1], : weight.shape[2]] = weight
        return padded

    def device_context(self, like):
        return contextlib.nullcontext()

    def gpu(self, array) -> int | None:
        return array.data.device_id if type(array) is self._ndarray else None

    def current_gpu(self) -> int:
        return self._current_device()

    def is_contiguous(self, array) -> bool:
        return array.flags.c_contiguous

    def contiguous(self, array):
        return array if array.flags.c_contiguous else array.copy()

    def to_core(self, array):
        return array

    def from_core(self, array):
        return array


@functools.cache
def core_arrays() -> CoreArrays:
    """The `Arrays` of NumPy and CuPy, made when first asked for (CuPy loads only then)."""
    return CoreArrays()


def forward(arrays: Arrays, features, weight, kernel_map, argument: str, reuse_weight: bool = False):
    """`out[i] = Σ_k weight[k]^T · features[table[k, i]]` over `kernel_map`, `[N_out, C_out]`, in the
    framework of `arrays`: the layer's plan when it has one, else the full path on the core's views.
    `reuse_weight`: the weight does not change between calls (inference)."""
    plan = layer_plan(arrays, "forward", argument, features, weight, kernel_map)
    if plan is None:
        with arrays.device_context(features):
            core = arrays.to_core
            return arrays.from_core(unplanned_forward(core(features), core(weight), kernel_map, argument))
    return _launch_forward(plan, arrays, features, weight, kernel_map, reuse_weight)


def fused_forward(arrays: Arrays, features, weight, kernel_map, argument: str, epilogue: ConvEpilogue):
    """`forward` with `epilogue` applied as the output is stored, in the one launch, for inference (the
    padded weight is kept from call to call); None where the layer's plan cannot fuse it (no plan, or an
    algorithm without an epilogue), for the caller to apply it after a plain `forward`."""
    plan = layer_plan(arrays, "forward", argument, features, weight, kernel_map)
    if plan is None or not plan.fuses_epilogue:
        return None
    _check_epilogue(arrays, epilogue, features, kernel_map.num_out, weight.shape[2])
    addresses = (*(0 if array is None else arrays.address(array) for array in epilogue[:3]), int(epilogue.relu))
    return _launch_forward(plan, arrays, features, weight, kernel_map, True, epilogue=addresses)


def _launch_forward(plan, arrays: Arrays, features, weight, kernel_map, reuse_weight: bool, **launch_options):
    try:
        out = arrays.empty(features, (kernel_map.num_out, weight.shape[2]))
        padded = arrays.padded_weight(weight, plan.weight_shape, plan.weight_transposed, reuse_weight)
        if plan.staging_shape is not None:
            staging = arrays.empty_float32(features, plan.staging_shape(kernel_map))
            launch_options["staging"] = arrays.address(staging)
        plan.launch(kernel_map, arrays.address(features), arrays.address(padded), arrays.address(out),
                    arrays.stream(features), **launch_options)
    except Exception as error:  # a `with naming_sizes` costs a microsecond on every call
        naming_sizes("forward", features, weight, kernel_map).name(error)
        raise
    return out


_FLOAT32 = np.dtype(np.float32)


def _check_epilogue(arrays: Arrays, epilogue: ConvEpilogue, features, num_out: int, out_channels: int) -> None:
    """What the kernel reads without looking: fp32 `[C_out]` scale and shift, a residual like the output,
    each contiguous on the features' GPU."""
    device, channels, like_output = arrays.gpu(features), (out_channels,), arrays.core_dtype(features.dtype)
    for name, array, shape, wanted in (("scale", epilogue.scale, channels, _FLOAT32),
                                       ("shift", epilogue.shift, channels, _FLOAT32),
                                       ("residual", epilogue.residual, (num_out, out_channels), like_output)):
        if array is not None and (array.shape != shape or arrays.gpu(array) != device
                                  or arrays.core_dtype(array.dtype) != wanted or not arrays.is_contiguous(array)):
            raise ValueError(f"the epilogue's {name} must be a contiguous {np.dtype(wanted).name} array of shape "
                             f"{shape} on the features' GPU, got {array.dtype} of shape {tuple(array.shape)}")


def backward(arrays: Arrays, grad_output, features, weight, kernel_map, argument: str, needs_input_grad: bool = True,
             needs_weight_grad: bool = True):
    """(input gradient `[N_in, C_in]`, weight gradient `[K, C_in, C_out]`) of `forward`, None where not
    needed: the layer's plan when it has one, else the full path on the core's views."""
    plan = layer_plan(arrays, "backward", argument, features, weight, kernel_map, grad_output)
    if plan is None:
        with arrays.device_context(features):
            core = arrays.to_core
            results = unplanned_backward(core(grad_output), core(features), core(weight), kernel_map, argument,
                                         needs_input_grad, needs_weight_grad)
            return tuple(None if result is None else arrays.from_core(result) for result in results)
    try:
        grad_input = grad_weight = None
        weight_address = grad_input_address = workspace_address = grad_weight_address = 0  # 0: not computed
        if needs_input_grad:
            padded = arrays.padded_weight(weight, plan.weight_shape, False, False)
            grad_input = arrays.empty(features, features.shape)
            weight_address, grad_input_address = arrays.address(padded), arrays.address(grad_input)
        if needs_weight_grad:
            # Every element of the workspace is written before it is read: no clearing.
            workspace = arrays.empty_float32(features, plan.workspace_shape(kernel_map))
            grad_weight = arrays.empty(weight, weight.shape)
            workspace_address, grad_weight_address = arrays.address(workspace), arrays.address(grad_weight)
        staging = {}
        if plan.staging_shape is not None and (needs_input_grad or needs_weight_grad):
            staging_array = arrays.empty_float32(features, plan.staging_shape(kernel_map))
            staging["staging"] = arrays.address(staging_array)
        plan.launch(kernel_map, arrays.address(grad_output), arrays.address(features), weight_address,
                    grad_input_address, workspace_address, grad_weight_address, arrays.stream(features), **staging)
    except Exception as error:
        naming_sizes("backward", features, weight, kernel_map).name(error)
        raise
    return grad_input, grad_weight


def layer_plan(arrays: Arrays, phase: str, argument: str, features, weight, kernel_map, grad_output=None):
    """The launch plan of `phase` ("forward", or "backward" with `grad_output`) for this call, or None
    where a plan cannot take its arrays or the selected algorithm has none. Every call checks what can
    change between calls of one signature (`Arrays.launch_device`, the shapes against the map); the plan
    is kept for the signature (`_plans`) until a setting a selection depends on changes."""
    key = _plan_key(arrays, phase, argument, features, weight, kernel_map, grad_output)
    if key is None:
        return None
    state = (settings.changes, *settings.selection_values())  # `settings.selection_state()`, without a call
    kept = _plans.get(key)
    if kept is not None and kept[0] == state:
        return kept[1]
    plan = _selected_plan(arrays, phase, argument, features, weight, kernel_map, grad_output)
    if not rehearsing():
        _plans[key] = (state, plan)
    elif rehearsing_sizes():  # the few voxels' plan stays the rehearsal's; the real sizes' plans are kept
        _plan_ranked_sizes(arrays, phase, argument, features, weight, kernel_map, key, state)
    return plan


def _plan_key(arrays: Arrays, phase: str, argument: str, features, weight, kernel_map, grad_output=None):
    """The key of this call's plan in `_plans`, None where a plan cannot take its arrays (`layer_plan`)."""
    device = arrays.launch_device(features, weight, grad_output)
    if device is None or not _shapes_fit(features.shape, weight.shape, kernel_map, grad_output):
        return None
    return phase, argument, features.dtype, weight.shape, device, kernel_map.derived(map_signature, map_signature)


def derive_backward_formats(arrays: Arrays, calls) -> None:
    """Derive together what the backward calls to come, `(features, weight, kernel_map, argument)` each, would
    derive from their fresh maps one by one on first use: the wgrad shares of those whose layer signature has a
    kept plan (every step of a network but its first), in one allocation (`kernel_map.derive_wgrad_shares`).
    Nothing is selected: a call without a kept plan derives its own."""
    state = (settings.changes, *settings.selection_values())
    requests, seen = [], set()
    for features, weight, kernel_map, argument in calls:
        signature = (kernel_map, argument, features.dtype, tuple(weight.shape))  # layers sharing a map and plan
        if signature in seen:
            continue
        seen.add(signature)
        kept = _plans.get(_plan_key(arrays, "backward", argument, features, weight, kernel_map))
        if kept is not None and kept[0] == state and kept[1] is not None and kept[1].wgrad_shares is not None:
            requests.append((kernel_map, *kept[1].wgrad_shares(kernel_map)))
    derive_wgrad_shares(requests)


# The plan of each layer signature: by phase, algorithm argument, dtype, weight shape, device and
# `map_signature`, with the `settings.selection_state()` it was selected under. The sizes enter as the
# tuner's size buckets, so a new map of a known signature (the next scene) finds its plan here.
_plans: dict[tuple, tuple] = {}


def _plan_ranked_sizes(arrays: Arrays, phase: str, argument: str, features, weight, kernel_map, key: tuple,
                       state: tuple) -> None:
    """In a rehearsal (`cupysparse.networks.prefetch`): keep this layer's plans for the sizes the tuning caches
    rank it at (`tuner.rehearsed_sizes`), each the plan of the choice recalled there, under the key a call of
    those sizes looks up, so that the network's first call selects and plans nothing. Only capturable choices
    in the layer's own search space: a call during a CUDA-graph capture would select another."""
    dtype = arrays.core_dtype(features.dtype)
    if dtype not in _FEATURE_DTYPES or features.shape[1] == 0 or weight.shape[2] == 0:
        return
    search_space = algorithm_filter(argument, CONV, phase)
    problem = ConvProblem.over(kernel_map, features.shape[1], weight.shape[2], dtype, on_gpu=True)
    for sized, selection in rehearsed_sizes(CONV, phase, problem):
        sized_key = (*key[:5], (*key[5][:4], size_bucket(sized.num_in), size_bucket(sized.num_out)))
        if sized_key in _plans or not selection.algorithm.capturable or not any(
                algorithm is selection.algorithm for algorithm, _ in candidates(search_space, sized)):
            continue
        algorithm = selection.algorithm
        planner = algorithm.forward_plan if phase == "forward" else algorithm.backward_plan
        _plans[sized_key] = (state, planner(sized, selection.params))


def map_signature(kernel_map) -> tuple:
    """What the plans of a map's layers depend on: its kernel volume, stride and kind, and its sizes as
    the tuner tells them apart (`size_bucket`). Kept with the map (`KernelMap.derived`)."""
    return (kernel_map.kernel_volume, kernel_map.stride, kernel_map.transposed, kernel_map.generative,
            size_bucket(kernel_map.num_in), size_bucket(kernel_map.num_out))


def _shapes_fit(features_shape, weight_shape, kernel_map, grad_output) -> bool:
    """Whether a plan over `kernel_map` takes arrays of these shapes as the full path's checks accept
    them, with rows to compute (the channels and dtype are the signature's, checked when it is selected)."""
    return (len(features_shape) == 2 and len(weight_shape) == 3 and features_shape[0] == kernel_map.num_in
            and weight_shape[0] == kernel_map.kernel_volume and features_shape[1] == weight_shape[1]
            and features_shape[0] > 0 and kernel_map.num_out > 0
            and (grad_output is None or tuple(grad_output.shape) == (kernel_map.num_out, weight_shape[2])))


def _selected_plan(arrays: Arrays, phase: str, argument: str, features, weight, kernel_map, grad_output):
    """The plan of the algorithm the tuner selects for this call, None where its dtype or channels leave a
    plan nothing to do (the full path then explains what is wrong, or returns zeros)."""
    dtype = arrays.core_dtype(features.dtype)
    if dtype not in _FEATURE_DTYPES or features.shape[1] == 0 or weight.shape[2] == 0:
        return None
    problem = ConvProblem.over(kernel_map, features.shape[1], weight.shape[2], dtype, on_gpu=True)
    with arrays.device_context(features):
        views = _CoreViews(arrays, features, weight, grad_output)
        run = views.forward_runner(kernel_map) if phase == "forward" else views.backward_runner(kernel_map)
        selection = select_algorithm(algorithm_filter(argument, CONV, phase), problem, run)
        planner = selection.algorithm.forward_plan if phase == "forward" else selection.algorithm.backward_plan
        return planner(problem, selection.params)


def select_forward(features, weight, kernel_map, algo=None) -> Selection:
    """The algorithm and parameters the full path runs forward on these core arrays (the tuner
    measures the candidates on them the first time it meets the problem); the arguments are checked."""
    checks.check_features(features, "features", kernel_map.num_in)
    checks.check_weight(weight, features, kernel_map)
    problem = ConvProblem.of(features, kernel_map, weight.shape[2])
    search_space = parse_algorithm_filter(algo, CONV, "forward")
    return select_algorithm(search_space, problem, forward_runner(features, weight, kernel_map))


def select_backward(grad_output, features, weight, kernel_map, algo=None) -> Selection:
    """The algorithm and parameters the full path runs backward on these core arrays, as `select_forward`."""
    checks.check_features(features, "features", kernel_map.num_in)
    checks.check_weight(weight, features, kernel_map)
    checks.require_like(grad_output, "grad_output", features, "the input features")
    checks.check_features(grad_output, "grad_output", kernel_map.num_out, weight.shape[2])
    problem = ConvProblem.of(features, kernel_map, weight.shape[2])
    search_space = parse_algorithm_filter(algo, CONV, "backward")
    return select_algorithm(search_space, problem, backward_runner(grad_output, features, weight, kernel_map))


def unplanned_forward(features, weight, kernel_map, algo=None):
    """The full path of `forward` on core arrays: checked, selected, run by the algorithm's entry point."""
    selection = select_forward(features, weight, kernel_map, None if algo == "" else algo)
    with naming_sizes("forward", features, weight, kernel_map, selection.algorithm.name):
        return forward_runner(features, weight, kernel_map)(selection.algorithm, selection.params)


def unplanned_backward(grad_output, features, weight, kernel_map, algo=None, needs_input_grad: bool = True,
                       needs_weight_grad: bool = True):
    """The full path of `backward` on core arrays, as `unplanned_forward`."""
    selection = select_backward(grad_output, features, weight, kernel_map, None if algo == "" else algo)
    with naming_sizes("backward", features, weight, kernel_map, selection.algorithm.name):
        return gradients(selection, grad_output, features, weight, kernel_map, needs_input_grad, needs_weight_grad)


class _CoreViews:
    """The core's views of a call's arrays, made when the tuner first runs a candidate on them: a layer
    whose choice the tuner already has (a new scene's, or one the prefetch recalled) views nothing."""

    def __init__(self, arrays: Arrays, features, weight, grad_output):
        self._arrays, self._arguments = arrays, (features, weight, grad_output)

    @functools.cached_property
    def _views(self):
        return tuple(None if array is None else self._arrays.to_core(array) for array in self._arguments)

    def forward_runner(self, kernel_map):
        def run(algorithm, params):
            features, weight, _ = self._views
            return forward_runner(features, weight, kernel_map)(algorithm, params)

        return run

    def backward_runner(self, kernel_map):
        def run(algorithm, params):
            features, weight, grad_output = self._views
            return backward_runner(grad_output, features, weight, kernel_map)(algorithm, params)

        return run


def forward_runner(features, weight, kernel_map):
    """`run(algorithm, params)`: one candidate's forward on these core arrays, as the tuner times it."""

    def run(algorithm, params):
        return algorithm.forward(features, algorithm.prepare_weight(weight), kernel_map, **params)

    return run


def backward_runner(grad_output, features, weight, kernel_map):
    """`run(algorithm, params)`: one candidate's (dgrad, wgrad) on these core arrays, as the tuner times it."""

    def run(algorithm, params):
        return gradients(Selection(algorithm, params), grad_output, features, weight, kernel_map, True, True)

    return run


def gradients(selection: Selection, grad_output, features, weight, kernel_map, needs_input_grad: bool,
              needs_weight_grad: bool):
    """(dgrad, wgrad) of the selected algorithm on core arrays, each None unless needed."""
    algorithm, params = selection.algorithm, selection.params
    grad_input = grad_weight = None
    if needs_input_grad:
        grad_input = algorithm.dgrad(grad_output, algorithm.prepare_weight(weight), kernel_map, **params)
    if needs_weight_grad:
        grad_weight = algorithm.wgrad(features, grad_output, kernel_map, **params)
    return grad_input, grad_weight
