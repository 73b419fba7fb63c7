"""The functional API: sparse convolutions of `SparseTensor`s and of core arrays over a `KernelMap`,
and their gradients.

`spatially_sparse_conv` builds (or reuses) the kernel map and returns the output tensor; its gradients
come from `spatially_sparse_conv_backward` (the same arguments and the output gradient). `conv_forward`
and `conv_backward` work on NumPy or CuPy features and a `KernelMap`; they and the adapters run through
the one path of `execution`. Depthwise convolutions work on features and a map directly, as in
WarpConvNet: they have no launch plans and always take the full path.
"""

from __future__ import annotations

from dataclasses import dataclass

from cupysparse.algorithms import CONV, DEPTHWISE, ConvProblem
from cupysparse.cuda.dtypes import accumulation_dtype
from cupysparse.cuda.out_of_memory import naming_sizes
from cupysparse.functional import checks, execution
from cupysparse.functional.execution import select_backward, select_forward
from cupysparse.geometry.sparse_tensor import SparseTensor
from cupysparse.tuning.search_space import algorithm_argument, parse_algorithm_filter
from cupysparse.tuning.tuner import select_algorithm


@dataclass(frozen=True)
class ConvGradients:
    """Gradients of a convolution; None for those not asked for."""

    input: object
    weight: object
    bias: object = None


def conv_forward(features, weight, kernel_map, algo=None):
    """Output features `[N_out, C_out]` of the convolution over `kernel_map` (see `algorithms.base`) on
    NumPy or CuPy arrays. A layer's later calls on the GPU launch the plan its first call selected
    (`execution`). Out of memory, it raises the allocator's error naming the sizes."""
    argument = "" if algo is None else algorithm_argument(algo, CONV, "forward")
    return execution.forward(execution.core_arrays(), features, weight, kernel_map, argument)


def conv_backward(grad_output, features, weight, kernel_map, algo=None, needs_input_grad=True, needs_weight_grad=True):
    """(input gradient `[N_in, C_in]`, weight gradient `[K, C_in, C_out]`); None where not needed."""
    argument = "" if algo is None else algorithm_argument(algo, CONV, "backward")
    return execution.backward(execution.core_arrays(), grad_output, features, weight, kernel_map, argument,
                              needs_input_grad, needs_weight_grad)


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
    padding=None,
) -> SparseTensor:
    """A sparse convolution of `input` with weight `[K, C_in, C_out]`: submanifold (stride 1),
    strided, transposed (back to the coordinates `input` was downsampled from) or generative
    transposed (every reachable coordinate). See `cupysparse.geometry.kernel_map` for the exact semantics.

    `padding` (an int or D ints, not negative; None: unpadded) gives spconv's geometry instead
    (`cupysparse.geometry.padding`): every voxel a kernel tap reaches, at any stride, kept inside the
    output's spatial shape when `input` has one; transposed, the inverse of the padded convolution that made
    `input`'s coordinates; generative transposed, spconv's transposed convolution.

    `fwd_algo` / `bwd_algo`: an enum member, a name, a list of either, `auto`, `all`, or None for
    the environment variables; `bwd_algo` is only checked here and used by
    `spatially_sparse_conv_backward`.
    """
    checks.check_input(input)
    parse_algorithm_filter(bwd_algo, CONV, "backward")
    result = input.kernel_map(kernel_size, stride, dilation, transposed, generative, padding)
    features = input.features
    checks.check_weight(weight, features, result.kernel_map)
    checks.check_bias(bias, features, weight.shape[2])
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
    padding=None,
) -> ConvGradients:
    """Gradients of `spatially_sparse_conv` (same arguments) given `grad_output` `[N_out, C_out]`."""
    checks.check_input(input)
    result = input.kernel_map(kernel_size, stride, dilation, transposed, generative, padding)
    grad_input, grad_weight = conv_backward(
        grad_output, input.features, weight, result.kernel_map, bwd_algo, needs_input_grad, needs_weight_grad
    )
    checks.check_bias(bias, input.features, weight.shape[2])
    grad_bias = None
    if bias is not None:
        grad_bias = grad_output.sum(axis=0, dtype=accumulation_dtype(grad_output.dtype)).astype(bias.dtype)
    return ConvGradients(grad_input, grad_weight, grad_bias)


def spatially_sparse_depthwise_conv(
    input_features, depthwise_weight, kernel_map, num_out_coords, fwd_algo=None, bwd_algo=None
):
    """Depthwise convolution `out[i, c] = Σ_k w[k, c] · x[table[k, i], c]` → `[num_out_coords, C]`."""
    checks.check_depthwise(input_features, depthwise_weight, kernel_map, num_out_coords)
    parse_algorithm_filter(bwd_algo, DEPTHWISE, "backward")
    problem = ConvProblem.of(input_features, kernel_map, input_features.shape[1])
    run = execution.forward_runner(input_features, depthwise_weight, kernel_map)
    selection = select_algorithm(parse_algorithm_filter(fwd_algo, DEPTHWISE, "forward"), problem, run)
    with naming_sizes("forward", input_features, depthwise_weight, kernel_map, selection.algorithm.name, True):
        return run(selection.algorithm, selection.params)


def spatially_sparse_depthwise_conv_backward(
    grad_output, input_features, depthwise_weight, kernel_map, bwd_algo=None, needs_input_grad=True,
    needs_weight_grad=True,
):
    """(input gradient `[N_in, C]`, weight gradient `[K, C]`) of a depthwise convolution."""
    checks.check_depthwise(input_features, depthwise_weight, kernel_map)
    checks.require_like(grad_output, "grad_output", input_features, "input_features")
    checks.check_features(grad_output, "grad_output", kernel_map.num_out, input_features.shape[1])
    problem = ConvProblem.of(input_features, kernel_map, input_features.shape[1])
    run = execution.backward_runner(grad_output, input_features, depthwise_weight, kernel_map)
    selection = select_algorithm(parse_algorithm_filter(bwd_algo, DEPTHWISE, "backward"), problem, run)
    with naming_sizes("backward", input_features, depthwise_weight, kernel_map, selection.algorithm.name, True):
        return execution.gradients(
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
