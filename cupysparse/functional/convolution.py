"""The functional API: sparse convolutions of `SparseTensor`s, and their gradients.

`spatially_sparse_conv` builds (or reuses) the kernel map, selects an algorithm through the
tuner (`tuner.select_algorithm`, measuring on the call's own data the first time a problem is
seen) and returns the output tensor. The gradients come from
`spatially_sparse_conv_backward` (same arguments plus the output gradient); the lower-level
`conv_forward` / `conv_backward` work on features and a `KernelMap` and are what the framework
adapters wrap. Depthwise convolutions work on features and a map directly, as in WarpConvNet.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import numpy as np

from cupysparse.tuning.search_space import parse_algorithm_filter
from cupysparse.algorithms import CONV, DEPTHWISE, ConvProblem
from cupysparse.cuda.backend import cupy_module, current_device, is_cupy_array
from cupysparse.cuda.dtypes import FEATURE_DTYPES, accumulation_dtype
from cupysparse.tuning.plans import algorithm_argument, algorithm_filter, kept_plan, map_layer_plan, map_plan_key
from cupysparse.cuda.out_of_memory import naming_sizes
from cupysparse.tuning.search_space import Selection
from cupysparse.tuning.tuner import select_algorithm
from cupysparse.geometry.sparse_tensor import SparseTensor


@dataclass(frozen=True)
class ConvGradients:
    """Gradients of a convolution; None for those not asked for."""

    input: object
    weight: object
    bias: object = None


def _require_like(array, name: str, reference, reference_name: str) -> None:
    if not hasattr(array, "shape") or not hasattr(array, "dtype"):
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(array).__name__}")
    if is_cupy_array(array) != is_cupy_array(reference):
        where = "CuPy (GPU)" if is_cupy_array(reference) else "NumPy (CPU)"
        raise TypeError(f"{name} must be a {where} array like {reference_name}")
    if is_cupy_array(array) and array.device != reference.device:
        raise ValueError(f"{name} is on GPU {array.device.id} but {reference_name} on GPU {reference.device.id}")
    if array.dtype != reference.dtype:
        raise TypeError(f"{name} has dtype {array.dtype} but {reference_name} has {reference.dtype}; cast one of them")


def _check_features(features, name: str, num_rows: int, num_channels: int | None = None) -> None:
    if not hasattr(features, "shape") or not hasattr(features, "dtype"):
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(features).__name__}")
    if features.dtype not in FEATURE_DTYPES:
        raise TypeError(f"{name} must be fp64, fp32, fp16 or bf16, got {features.dtype}")
    if features.ndim != 2 or features.shape[0] != num_rows:
        raise ValueError(f"{name} must have shape [{num_rows}, C], got {tuple(features.shape)}")
    if num_channels is not None and features.shape[1] != num_channels:
        raise ValueError(f"{name} must have {num_channels} channels, got {features.shape[1]}")


def check_weight_shape(weight_shape, in_channels: int, kernel_map, features_name: str = "the input") -> None:
    """ValueError unless a weight of `weight_shape` is `[K, C_in, C_out]` for `kernel_map` and
    `in_channels` (shared with the adapters, whose arrays are not the core's)."""
    if len(weight_shape) != 3:
        raise ValueError(f"weight must have shape [K, C_in, C_out], got {tuple(weight_shape)}")
    if weight_shape[0] != kernel_map.kernel_volume:
        raise ValueError(
            f"weight has {weight_shape[0]} kernel offsets but kernel size {kernel_map.kernel_size} has "
            f"{kernel_map.kernel_volume}"
        )
    if weight_shape[1] != in_channels:
        raise ValueError(f"weight expects {weight_shape[1]} input channels, {features_name} has {in_channels}")


def _check_weight(weight, features, kernel_map) -> None:
    _require_like(weight, "weight", features, "the input features")
    check_weight_shape(tuple(weight.shape), features.shape[1], kernel_map)


def forward_runner(features, weight, kernel_map):
    """`run(algorithm, params)`: one candidate's forward on these arrays, as the tuner times it."""

    def run(algorithm, params):
        return algorithm.forward(features, algorithm.prepare_weight(weight), kernel_map, **params)

    return run


def backward_runner(grad_output, features, weight, kernel_map):
    """`run(algorithm, params)`: one candidate's (dgrad, wgrad) on these arrays, as the tuner times it."""

    def run(algorithm, params):
        return _gradients(Selection(algorithm, params), grad_output, features, weight, kernel_map, True, True)

    return run


def select_forward(features, weight, kernel_map, algo=None) -> Selection:
    """The algorithm and parameters `conv_forward` runs on these arguments (the tuner measures the
    candidates on them the first time it meets the problem); the arguments are checked."""
    _check_features(features, "features", kernel_map.num_in)
    _check_weight(weight, features, kernel_map)
    problem = ConvProblem.of(features, kernel_map, weight.shape[2])
    run = forward_runner(features, weight, kernel_map)
    return select_algorithm(parse_algorithm_filter(algo, CONV, "forward"), problem, run)


def select_backward(grad_output, features, weight, kernel_map, algo=None) -> Selection:
    """The algorithm and parameters `conv_backward` runs on these arguments, as `select_forward`."""
    _check_features(features, "features", kernel_map.num_in)
    _check_weight(weight, features, kernel_map)
    _require_like(grad_output, "grad_output", features, "the input features")
    _check_features(grad_output, "grad_output", kernel_map.num_out, weight.shape[2])
    problem = ConvProblem.of(features, kernel_map, weight.shape[2])
    run = backward_runner(grad_output, features, weight, kernel_map)
    return select_algorithm(parse_algorithm_filter(algo, CONV, "backward"), problem, run)


def conv_forward(features, weight, kernel_map, algo=None):
    """Output features `[N_out, C_out]` of the convolution over `kernel_map` (see `algorithms.base`).
    Out of memory, it raises the allocator's error naming the sizes (`out_of_memory`).

    A layer's later calls on the GPU launch its kept plan (`layer_plans`): the selection and checks
    of its first call hold for later calls of the same signature (`_layer_plan`)."""
    argument = "" if algo is None else algorithm_argument(algo, CONV, "forward")
    plan = _layer_plan("forward", argument, features, weight, kernel_map)
    if plan is not None:
        ndarray, _, _, current_stream = _cupy_calls()
        try:
            out = ndarray((kernel_map.num_out, weight.shape[2]), features.dtype)
            padded = _plan_weight(weight, plan.weight_shape, plan.weight_transposed)
            plan.launch(kernel_map, features.data.ptr, padded.data.ptr, out.data.ptr, current_stream().ptr)
        except Exception as error:  # a `with naming_sizes` costs a microsecond on every call
            naming_sizes("forward", features, weight, kernel_map).name(error)
            raise
        return out
    selection = select_forward(features, weight, kernel_map, algo)
    with naming_sizes("forward", features, weight, kernel_map, selection.algorithm.name):
        return forward_runner(features, weight, kernel_map)(selection.algorithm, selection.params)


def conv_backward(grad_output, features, weight, kernel_map, algo=None, needs_input_grad=True, needs_weight_grad=True):
    """(input gradient `[N_in, C_in]`, weight gradient `[K, C_in, C_out]`); None where not needed. Later
    calls of a layer launch its kept plan, as `conv_forward`'s."""
    argument = "" if algo is None else algorithm_argument(algo, CONV, "backward")
    plan = _layer_plan("backward", argument, features, weight, kernel_map, grad_output)
    if plan is not None:
        try:
            return _planned_gradients(plan, grad_output, features, weight, kernel_map, needs_input_grad,
                                      needs_weight_grad)
        except Exception as error:
            naming_sizes("backward", features, weight, kernel_map).name(error)
            raise
    selection = select_backward(grad_output, features, weight, kernel_map, algo)
    with naming_sizes("backward", features, weight, kernel_map, selection.algorithm.name):
        return _gradients(selection, grad_output, features, weight, kernel_map, needs_input_grad, needs_weight_grad)


def _layer_plan(phase: str, argument: str, features, weight, kernel_map, grad_output=None):
    """The kept plan of `phase` ("forward", or "backward" with `grad_output`) for these arguments, or
    None where a plan cannot run them or the selected algorithm has none (the full path then checks,
    selects and runs). Plans take CuPy arrays in one dtype on the current device (whose kernels the plans
    hold), the features (and output gradient) contiguous: checked every call. What a call's shapes,
    dtype, device and algorithm argument decide (`_fits`, the selection) is remembered on the map."""
    ndarray, c_contiguous, get_device, _ = _cupy_calls()
    if type(features) is not ndarray or type(weight) is not ndarray or weight.dtype != features.dtype:
        return None
    device = features.data.device_id
    if not c_contiguous(features) or weight.data.device_id != device or device != get_device():
        return None
    call = (phase, argument, features.dtype, features.shape, weight.shape, device)
    if grad_output is not None:
        if (type(grad_output) is not ndarray or grad_output.dtype != features.dtype
                or not c_contiguous(grad_output) or grad_output.data.device_id != device):
            return None
        call += (grad_output.shape,)
    return map_layer_plan(kernel_map, call, _select_layer_plan, phase, argument, features, weight, kernel_map,
                          grad_output)


def _select_layer_plan(phase: str, argument: str, features, weight, kernel_map, grad_output):
    """`_layer_plan`'s selection, made when its map does not remember one: a kept plan."""
    if not _fits(features, weight, kernel_map, grad_output):
        return None
    problem = ConvProblem.of(features, kernel_map, weight.shape[2])
    if phase == "forward":
        run = forward_runner(features, weight, kernel_map)
    else:
        run = backward_runner(grad_output, features, weight, kernel_map)

    def selected_plan():
        selection = select_algorithm(algorithm_filter(argument, CONV, phase), problem, run)
        planner = selection.algorithm.forward_plan if phase == "forward" else selection.algorithm.backward_plan
        return planner(problem, selection.params)

    key = map_plan_key(phase, features.dtype, weight.shape, features.data.device_id, argument, kernel_map)
    return kept_plan(key, selected_plan)


def _fits(features, weight, kernel_map, grad_output=None) -> bool:
    """Whether arrays of these shapes and dtype fit a plan over `kernel_map` (a CuPy map on their
    device) as `select_forward` (`select_backward`) accepts them, with work to do."""
    if features.ndim != 2 or weight.ndim != 3:
        return False
    rows, channels = features.shape
    kernel_volume, in_channels, out_channels = weight.shape
    table = kernel_map.pair_table
    return (
        features.dtype in _FEATURE_DTYPES and rows == kernel_map.num_in and kernel_volume == kernel_map.kernel_volume
        and in_channels == channels and type(table) is type(features) and table.data.device_id == current_device()
        and rows > 0 and kernel_map.num_out > 0 and channels > 0 and out_channels > 0
        and (grad_output is None or grad_output.shape == (kernel_map.num_out, out_channels))
    )


@functools.cache
def _cupy_calls() -> tuple:
    """What a planned call uses of CuPy every time, looked up once: its array type (the only one plans
    take, subclasses aside; None without CuPy) and readers of an array's C-contiguity, of the current
    device's id and of the current stream. CuPy keeps the contiguity an array's `flags` report in
    `_c_contiguous`; `flags` builds an object on every read, a microsecond on the slower hosts."""
    cupy = cupy_module()
    if cupy is None:
        return None, None, None, None
    contiguity = "_c_contiguous" if hasattr(cupy.ndarray, "_c_contiguous") else "flags.c_contiguous"
    c_contiguous = operator.attrgetter(contiguity)
    return cupy.ndarray, c_contiguous, cupy.cuda.runtime.getDevice, cupy.cuda.get_current_stream


_FEATURE_DTYPES = frozenset(FEATURE_DTYPES)


def _plan_weight(weight, shape: tuple, transposed: bool = False):
    """`weight` `[K, A, B]` (read `[K, B, A]` when `transposed`: a forward plan's `weight_transposed`) in
    the plan's layout: contiguous, zero-padded at the end of its last two dimensions to `shape`."""
    if transposed:
        weight = weight.transpose(0, 2, 1)
    if weight.shape == shape and _cupy_calls()[1](weight):
        return weight
    padded = cupy_module().zeros(shape, dtype=weight.dtype)
    padded[:, : weight.shape[1], : weight.shape[2]] = weight
    return padded


def _planned_gradients(plan, grad_output, features, weight, kernel_map, needs_input_grad, needs_weight_grad):
    ndarray, _, _, current_stream = _cupy_calls()
    grad_input = grad_weight = None
    weight_address = grad_input_address = workspace_address = grad_weight_address = 0  # 0: not computed
    if needs_input_grad:
        padded = _plan_weight(weight, plan.weight_shape)
        grad_input = ndarray(features.shape, features.dtype)
        weight_address, grad_input_address = padded.data.ptr, grad_input.data.ptr
    if needs_weight_grad:
        # Every element of the workspace is written before it is read: no clearing.
        workspace = ndarray(plan.workspace_shape(kernel_map), np.float32)
        grad_weight = ndarray(weight.shape, weight.dtype)
        workspace_address, grad_weight_address = workspace.data.ptr, grad_weight.data.ptr
    plan.launch(kernel_map, grad_output.data.ptr, features.data.ptr, weight_address, grad_input_address,
                workspace_address, grad_weight_address, current_stream().ptr)
    return grad_input, grad_weight


def _gradients(selection, grad_output, features, weight, kernel_map, needs_input_grad, needs_weight_grad):
    """(dgrad, wgrad) of the selected algorithm, each None unless needed."""
    algorithm, params = selection.algorithm, selection.params
    grad_input = grad_weight = None
    if needs_input_grad:
        grad_input = algorithm.dgrad(grad_output, algorithm.prepare_weight(weight), kernel_map, **params)
    if needs_weight_grad:
        grad_weight = algorithm.wgrad(features, grad_output, kernel_map, **params)
    return grad_input, grad_weight


def _check_input(input) -> None:
    if not isinstance(input, SparseTensor):
        raise TypeError(f"input must be a cupysparse.SparseTensor, got {type(input).__name__}")


def _check_bias(bias, features, out_channels: int) -> None:
    if bias is None:
        return
    _require_like(bias, "bias", features, "the input features")
    if tuple(bias.shape) != (out_channels,):
        raise ValueError(f"bias must have shape [{out_channels}], got {tuple(bias.shape)}")


def spatially_sparse_conv(
    input: SparseTensor,
    weight,
    kernel_size,
    stride=1,
    dilation=1,
    transposed=False,
    generative=False,
    bias=None,
    fwd_algo=None,
    bwd_algo=None,
) -> SparseTensor:
    """A sparse convolution of `input` with weight `[K, C_in, C_out]`: submanifold (stride 1),
    strided, transposed (back to the coordinates `input` was downsampled from) or generative
    transposed (every reachable coordinate). See `cupysparse.geometry.kernel_map` for the exact semantics.

    `fwd_algo` / `bwd_algo`: an enum member, a name, a list of either, `auto`, `all`, or None for
    the environment variables; `bwd_algo` is only checked here and used by
    `spatially_sparse_conv_backward`.
    """
    _check_input(input)
    parse_algorithm_filter(bwd_algo, CONV, "backward")
    result = input.kernel_map(kernel_size, stride, dilation, transposed, generative)
    features = input.features
    _check_weight(weight, features, result.kernel_map)
    _check_bias(bias, features, weight.shape[2])
    out = conv_forward(features, weight, result.kernel_map, fwd_algo)
    if bias is not None:
        out += bias
    return SparseTensor(
        result.out_coordinates, out, result.out_tensor_stride, validate=False, map_cache=result.out_map_cache
    )


def spatially_sparse_conv_backward(
    grad_output,
    input: SparseTensor,
    weight,
    kernel_size,
    stride=1,
    dilation=1,
    transposed=False,
    generative=False,
    bias=None,
    bwd_algo=None,
    needs_input_grad=True,
    needs_weight_grad=True,
) -> ConvGradients:
    """Gradients of `spatially_sparse_conv` (same arguments) given `grad_output` `[N_out, C_out]`."""
    _check_input(input)
    result = input.kernel_map(kernel_size, stride, dilation, transposed, generative)
    grad_input, grad_weight = conv_backward(
        grad_output, input.features, weight, result.kernel_map, bwd_algo, needs_input_grad, needs_weight_grad
    )
    _check_bias(bias, input.features, weight.shape[2])
    grad_bias = None
    if bias is not None:
        grad_bias = grad_output.sum(axis=0, dtype=accumulation_dtype(grad_output.dtype)).astype(bias.dtype)
    return ConvGradients(grad_input, grad_weight, grad_bias)


def _check_depthwise(features, weight, kernel_map, num_out_coords=None) -> None:
    _check_features(features, "input_features", kernel_map.num_in)
    _require_like(weight, "depthwise_weight", features, "input_features")
    if weight.ndim != 2 or tuple(weight.shape) != (kernel_map.kernel_volume, features.shape[1]):
        raise ValueError(
            f"depthwise_weight must have shape [K={kernel_map.kernel_volume}, C={features.shape[1]}], "
            f"got {tuple(weight.shape)}"
        )
    if num_out_coords is not None and num_out_coords != kernel_map.num_out:
        raise ValueError(f"num_out_coords is {num_out_coords} but the kernel map has {kernel_map.num_out} outputs")


def spatially_sparse_depthwise_conv(
    input_features, depthwise_weight, kernel_map, num_out_coords, fwd_algo=None, bwd_algo=None
):
    """Depthwise convolution `out[i, c] = Σ_k w[k, c] · x[table[k, i], c]` → `[num_out_coords, C]`."""
    _check_depthwise(input_features, depthwise_weight, kernel_map, num_out_coords)
    parse_algorithm_filter(bwd_algo, DEPTHWISE, "backward")
    problem = ConvProblem.of(input_features, kernel_map, input_features.shape[1])
    run = forward_runner(input_features, depthwise_weight, kernel_map)
    selection = select_algorithm(parse_algorithm_filter(fwd_algo, DEPTHWISE, "forward"), problem, run)
    with naming_sizes("forward", input_features, depthwise_weight, kernel_map, selection.algorithm.name, True):
        return run(selection.algorithm, selection.params)


def spatially_sparse_depthwise_conv_backward(
    grad_output, input_features, depthwise_weight, kernel_map, bwd_algo=None, needs_input_grad=True,
    needs_weight_grad=True,
):
    """(input gradient `[N_in, C]`, weight gradient `[K, C]`) of a depthwise convolution."""
    _check_depthwise(input_features, depthwise_weight, kernel_map)
    _require_like(grad_output, "grad_output", input_features, "input_features")
    _check_features(grad_output, "grad_output", kernel_map.num_out, input_features.shape[1])
    problem = ConvProblem.of(input_features, kernel_map, input_features.shape[1])
    run = backward_runner(grad_output, input_features, depthwise_weight, kernel_map)
    selection = select_algorithm(parse_algorithm_filter(bwd_algo, DEPTHWISE, "backward"), problem, run)
    with naming_sizes("backward", input_features, depthwise_weight, kernel_map, selection.algorithm.name, True):
        return _gradients(
            selection, grad_output, input_features, depthwise_weight, kernel_map, needs_input_grad, needs_weight_grad
        )


__all__ = [
    "ConvGradients",
    "conv_backward",
    "conv_forward",
    "select_backward",
    "select_forward",
    "spatially_sparse_conv",
    "spatially_sparse_conv_backward",
    "spatially_sparse_depthwise_conv",
    "spatially_sparse_depthwise_conv_backward",
]
