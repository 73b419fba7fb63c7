"""The convolutions as `torch.library` custom ops, with fake implementations and autograd.

In eager mode a convolution runs the same core calls over the kernel map itself, through a
`torch.autograd.Function` when a gradient is needed and directly otherwise (`convolution` and
`map_convolution` pick the path): the custom-op machinery costs a hundred microseconds or more per
call, more than a 100K-voxel layer's kernels, while compilers need the op. Depthwise convolutions always
use their op. A kernel map is not a tensor, so the ops take its pair table (a torch view of the
core's array) and find the `KernelMap` it belongs to in a registry keyed by the table's memory: the
map keeps its derived formats (CSR lists, masks, sorted rows, the reversed map) from call to call,
while `torch.compile` and CUDA graphs only ever see tensors. The fake implementations give the
output shapes from the tensors alone, so compiled graphs need no real data to trace.

Algorithm choices travel as strings (`algorithm_argument`): "" is None (the environment
variables), otherwise a name, `auto`, `all` or `[a,b]`. The backward op computes only the
gradients autograd needs, in one call.

Where the selected algorithm has launch plans (`Algorithm.forward_plan` / `backward_plan`), the
first call of a layer signature selects and keeps them; later calls, over this map or the next
scene's, allocate their outputs with torch and launch on device addresses, skipping the core's
checks, views and selection: a 100K-voxel layer's kernels take about as long as the Python around a
full core call.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from cupysparse.functional import convolution as functional
from cupysparse.tuning.search_space import parse_algorithm_filter
from cupysparse.algorithms import CONV, ConvProblem
from cupysparse.geometry.kernel_map import KernelMap
from cupysparse.tuning.plans import keep_plan, kept_plan, map_layer_plan, map_plan_key, plan_key
from cupysparse.cuda.out_of_memory import naming_sizes
from cupysparse.tuning.tuner import select_algorithm

from cupysparse.adapters.torch.bridge import core_dtype, from_core, on_torch_stream, stream_handle, to_core

_maps_by_table: weakref.WeakValueDictionary[tuple[str, int], KernelMap] = weakref.WeakValueDictionary()
_tables_by_map: weakref.WeakKeyDictionary[KernelMap, torch.Tensor] = weakref.WeakKeyDictionary()


def pair_table(kernel_map: KernelMap) -> torch.Tensor:
    """The torch view of `kernel_map`'s pair table, through which the ops find the map."""
    table = _tables_by_map.get(kernel_map)
    if table is None:
        table = _tables_by_map[kernel_map] = from_core(kernel_map.pair_table)
        _maps_by_table[_table_key(table)] = kernel_map
    return table


def _table_key(table: torch.Tensor) -> tuple[str, int]:
    return str(table.device), table.data_ptr()


def _kernel_map(table: torch.Tensor) -> KernelMap:
    kernel_map = _maps_by_table.get(_table_key(table))
    if kernel_map is None:
        raise ValueError("this pair table belongs to no live kernel map; pass tables from ops.pair_table(kernel_map)")
    return kernel_map


def _algorithm(argument: str):
    return argument or None


@torch.library.custom_op("cupysparse::conv_forward", mutates_args=())
def conv_forward(features: torch.Tensor, weight: torch.Tensor, table: torch.Tensor, fwd_algo: str,
                 bwd_algo: str) -> torch.Tensor:
    """`out[i] = Σ_k weight[k]^T · features[table[k, i]]` → `[N_out, C_out]`."""
    return _core_forward(features, weight, table, fwd_algo)


def _layer_plan(phase: str, features, weight, kernel_map: KernelMap, algo: str, grad_output=None):
    """The launch plan of `phase` ("forward", or "backward" with `grad_output`) for this layer's
    signature (`layer_plans.map_plan_key`), or None where plans cannot run these tensors (the core's
    path then explains what is wrong, or returns the zeros of an empty problem): selected on first use
    and kept, and remembered on the map for the layer's later calls over it. What a call's shapes decide
    (`_fits`) is remembered with it; every call checks what can change between calls of one signature:
    CUDA tensors, contiguous, of one dtype, on the current device (whose kernels the plans hold)."""
    if not (features.is_cuda and features.is_contiguous() and features.dtype == weight.dtype
            and features.device == weight.device):
        return None
    device_index = features.device.index
    if device_index != torch.cuda.current_device():
        return None
    call = (phase, algo, features.dtype, features.shape, weight.shape, device_index)
    if grad_output is not None:
        if not (grad_output.is_contiguous() and grad_output.dtype == features.dtype
                and grad_output.device == features.device):
            return None
        call += (grad_output.shape,)
    return map_layer_plan(kernel_map, call, _select_layer_plan, phase, features, weight, kernel_map, algo,
                          grad_output)


def _fits(features: torch.Tensor, weight: torch.Tensor, kernel_map: KernelMap, grad_output) -> bool:
    """Whether tensors of these shapes fit a plan: floating features of the map's rows and the
    weight's input channels, a weight of the map's kernel volume, an output gradient of the output's
    shape, with work to do."""
    return (
        features.is_floating_point() and features.dim() == 2 and weight.dim() == 3
        and features.shape[0] == kernel_map.num_in and weight.shape[0] == kernel_map.kernel_volume
        and features.shape[1] == weight.shape[1] and kernel_map.num_in > 0 and kernel_map.num_out > 0
        and weight.shape[1] > 0 and weight.shape[2] > 0
        and (grad_output is None or grad_output.shape == (kernel_map.num_out, weight.shape[2]))
    )


def _select_layer_plan(phase: str, features, weight, kernel_map: KernelMap, algo: str, grad_output):
    """`_layer_plan`'s selection, made when its map does not remember one: a kept plan, or None."""
    if not _fits(features, weight, kernel_map, grad_output):
        return None

    def select():
        with on_torch_stream(features.device):
            problem = _plannable_problem(features, weight, kernel_map)
            if phase == "forward":
                run = _run_on_core(functional.forward_runner, features, weight, kernel_map)
            else:
                run = _run_on_core(functional.backward_runner, grad_output, features, weight, kernel_map)
            selection = select_algorithm(parse_algorithm_filter(_algorithm(algo), CONV, phase), problem, run)
            planner = selection.algorithm.forward_plan if phase == "forward" else selection.algorithm.backward_plan
            return planner(problem, selection.params)

    key = map_plan_key(phase, features.dtype, weight.shape, features.device.index, algo, kernel_map)
    return kept_plan(key, select)


def keep_recalled_plan(choice, plan, dtype: torch.dtype, device_index: int, algo: str) -> None:
    """Keep `plan`, the launch plan of a choice the prefetch recalled (`cupysparse.networks.prefetch.CachedChoice`),
    for the layers of its problem in `dtype` on GPU `device_index` with the algorithm argument `algo` (as
    `algorithm_argument` gives it): their first call at the problem's sizes then selects nothing."""
    problem = choice.problem
    weight_shape = (problem.kernel_volume, problem.in_channels, problem.out_channels)
    keep_plan(plan_key(choice.phase, dtype, weight_shape, device_index, algo, problem.kernel_volume,
                       tuple(problem.stride), problem.transposed, problem.generative, problem.num_in,
                       problem.num_out), plan)


def _padded(weight: torch.Tensor, shape, transposed: bool = False) -> torch.Tensor:
    """`weight` `[K, A, B]` (`[K, B, A]` when `transposed`: a forward plan's `weight_transposed`)
    zero-padded at the end of its last two dimensions to `shape`, contiguous: the layout a plan's
    kernels read (tensor-core kernels take channels in whole fragments, e.g. a 3-channel input layer's
    weight as 16)."""
    if transposed:
        weight = weight.transpose(1, 2)
    if weight.shape == shape:
        return weight.contiguous()
    padding = (0, shape[2] - weight.shape[2], 0, shape[1] - weight.shape[1])
    return torch.nn.functional.pad(weight.detach(), padding).contiguous()


# Inference's padded weights, by weight: ((its version, address, padded shape), the padded copy).
_padded_weights = WeakIdKeyDictionary()


def _kept_padded(weight: torch.Tensor, shape, transposed: bool = False) -> torch.Tensor:
    """`_padded`, kept from call to call while `weight` is unchanged: an in-place update (an
    optimiser's step, `load_state_dict`, anything under `torch.no_grad()`) bumps its `_version`, a
    reassigned `.data` changes its address, so either pads again. Writes through `weight.data` are
    not seen (they bump no version): such a weight must be updated in place on the tensor itself.
    While a CUDA graph is captured it pads anew, so that every replay reads the weight as it is then."""
    if weight.shape == shape and not transposed:
        return weight.contiguous()
    if weight.is_inference() or (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
        return _padded(weight, shape, transposed)  # an inference tensor has no version to key on
    key = (weight._version, weight.data_ptr(), shape, transposed)
    kept = _padded_weights.get(weight)
    if kept is None or kept[0] != key:
        kept = _padded_weights[weight] = (key, _padded(weight, shape, transposed))
    return kept[1]


def _plannable_problem(features: torch.Tensor, weight: torch.Tensor, kernel_map: KernelMap) -> ConvProblem:
    """The `ConvProblem` of tensors `_fits` accepted, from their shapes and dtype alone."""
    return ConvProblem.over(kernel_map, features.shape[1], weight.shape[2], core_dtype(features.dtype), on_gpu=True)


def _run_on_core(runner, *tensors_then_map):
    """`runner(*tensors, kernel_map)` (a `functional` runner, which the tuner measures candidates with)
    over the core's views of the tensors, made at its first call: a layer whose choice the tuner already
    has (a new scene's, or one the prefetch recalled) views nothing."""
    *tensors, kernel_map = tensors_then_map

    @functools.cache
    def on_core():
        return runner(*(to_core(tensor) for tensor in tensors), kernel_map)

    return lambda algorithm, params: on_core()(algorithm, params)


def _core_forward(features, weight, table, fwd_algo: str) -> torch.Tensor:
    return _map_forward(features, weight, _kernel_map(table), fwd_algo)


def _map_forward(features, weight, kernel_map: KernelMap, fwd_algo: str, inference: bool = False) -> torch.Tensor:
    """The forward; `inference` (nothing to differentiate, eager mode) keeps a padded weight from call
    to call (`_kept_padded`), where training, whose weight changes every step, pads per call."""
    plan = _layer_plan("forward", features, weight, kernel_map, fwd_algo)
    if plan is not None:
        try:
            out = features.new_empty((kernel_map.num_out, weight.shape[2]))
            padded = (_kept_padded if inference else _padded)(weight, plan.weight_shape, plan.weight_transposed)
            plan.launch(kernel_map, features.data_ptr(), padded.data_ptr(), out.data_ptr(),
                        stream_handle(features.device))
        except Exception as error:  # a `with naming_sizes` costs a microsecond on every call
            naming_sizes("forward", features, weight, kernel_map).name(error)
            raise
        return out
    with on_torch_stream(features.device):
        out = functional.conv_forward(to_core(features), to_core(weight), kernel_map, _algorithm(fwd_algo))
        return from_core(out)


def _core_backward(grad_output, features, weight, table, bwd_algo: str, needs_input_grad: bool,
                   needs_weight_grad: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return _map_backward(grad_output, features, weight, _kernel_map(table), bwd_algo, needs_input_grad,
                         needs_weight_grad)


def _map_backward(grad_output, features, weight, kernel_map: KernelMap, bwd_algo: str, needs_input_grad: bool,
                  needs_weight_grad: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients asked for, None for the others."""
    plan = _layer_plan("backward", features, weight, kernel_map, bwd_algo, grad_output)
    if plan is not None:
        try:
            return _planned_backward(plan, kernel_map, grad_output, features, weight, needs_input_grad,
                                     needs_weight_grad)
        except Exception as error:
            naming_sizes("backward", features, weight, kernel_map).name(error)
            raise
    with on_torch_stream(features.device):
        grad_input, grad_weight = functional.conv_backward(
            to_core(grad_output), to_core(features), to_core(weight), kernel_map, _algorithm(bwd_algo),
            needs_input_grad, needs_weight_grad,
        )
        return (from_core(grad_input) if needs_input_grad else None,
                from_core(grad_weight) if needs_weight_grad else None)


def _planned_backward(plan, kernel_map, grad_output, features, weight, needs_input_grad: bool,
                      needs_weight_grad: bool):
    grad_input = grad_weight = None
    weight_address = grad_input_address = workspace_address = grad_weight_address = 0  # 0: not computed
    if needs_input_grad:
        padded = _padded(weight, plan.weight_shape)
        grad_input = torch.empty_like(features)
        weight_address, grad_input_address = padded.data_ptr(), grad_input.data_ptr()
    if needs_weight_grad:
        # Every element of the workspace is written before it is read: no clearing.
        workspace = torch.empty(plan.workspace_shape(kernel_map), dtype=torch.float32, device=features.device)
        grad_weight = torch.empty_like(weight, memory_format=torch.contiguous_format)
        workspace_address, grad_weight_address = workspace.data_ptr(), grad_weight.data_ptr()
    plan.launch(kernel_map, grad_output.data_ptr(), features.data_ptr(), weight_address, grad_input_address,
                workspace_address, grad_weight_address, stream_handle(features.device))
    return grad_input, grad_weight


@conv_forward.register_fake
def _(features, weight, table, fwd_algo, bwd_algo):
    return features.new_empty((table.shape[1], weight.shape[2]))


@torch.library.custom_op("cupysparse::conv_backward", mutates_args=())
def conv_backward(grad_output: torch.Tensor, features: torch.Tensor, weight: torch.Tensor, table: torch.Tensor,
                  bwd_algo: str, needs_input_grad: bool, needs_weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(input gradient `[N_in, C_in]`, weight gradient `[K, C_in, C_out]`); an empty tensor for one not needed."""
    grad_input, grad_weight = _core_backward(grad_output, features, weight, table, bwd_algo, needs_input_grad,
                                             needs_weight_grad)
    return (features.new_empty(0) if grad_input is None else grad_input,
            weight.new_empty(0) if grad_weight is None else grad_weight)


@conv_backward.register_fake
def _(grad_output, features, weight, table, bwd_algo, needs_input_grad, needs_weight_grad):
    return (torch.empty_like(features) if needs_input_grad else features.new_empty(0),
            torch.empty_like(weight) if needs_weight_grad else weight.new_empty(0))


def _save_inputs(ctx, inputs, output):
    features, weight, table, _, bwd_algo = inputs
    ctx.save_for_backward(features, weight, table)
    ctx.bwd_algo = bwd_algo
    _keep_map_alive(ctx, table)


def _keep_map_alive(ctx, table: torch.Tensor) -> None:
    """Hold the kernel map until backward: the tensors that own it may be gone by then, and the map,
    in reference cycles, would go with the next garbage collection."""
    try:
        key = _table_key(table)
    except RuntimeError:  # a fake tensor while torch.compile traces: it has no memory and no map
        return
    ctx.kernel_map = _maps_by_table.get(key)


def _conv_backward(ctx, grad_output):
    features, weight, table = ctx.saved_tensors
    needs_input_grad, needs_weight_grad = ctx.needs_input_grad[:2]
    grad_input, grad_weight = conv_backward(
        grad_output.contiguous(), features, weight, table, ctx.bwd_algo, needs_input_grad, needs_weight_grad
    )
    return (grad_input if needs_input_grad else None), (grad_weight if needs_weight_grad else None), None, None, None


conv_forward.register_autograd(_conv_backward, setup_context=_save_inputs)


@torch.library.custom_op("cupysparse::depthwise_forward", mutates_args=())
def depthwise_forward(features: torch.Tensor, weight: torch.Tensor, table: torch.Tensor, fwd_algo: str,
                      bwd_algo: str) -> torch.Tensor:
    """`out[i, c] = Σ_k weight[k, c] · features[table[k, i], c]` → `[N_out, C]`."""
    kernel_map = _kernel_map(table)
    with on_torch_stream(features.device):
        out = functional.spatially_sparse_depthwise_conv(
            to_core(features), to_core(weight), kernel_map, kernel_map.num_out, _algorithm(fwd_algo)
        )
        return from_core(out)


@depthwise_forward.register_fake
def _(features, weight, table, fwd_algo, bwd_algo):
    return features.new_empty((table.shape[1], features.shape[1]))


@torch.library.custom_op("cupysparse::depthwise_backward", mutates_args=())
def depthwise_backward(grad_output: torch.Tensor, features: torch.Tensor, weight: torch.Tensor,
                       table: torch.Tensor, bwd_algo: str) -> tuple[torch.Tensor, torch.Tensor]:
    with on_torch_stream(features.device):
        grad_input, grad_weight = functional.spatially_sparse_depthwise_conv_backward(
            to_core(grad_output), to_core(features), to_core(weight), _kernel_map(table), _algorithm(bwd_algo)
        )
        return from_core(grad_input), from_core(grad_weight)


@depthwise_backward.register_fake
def _(grad_output, features, weight, table, bwd_algo):
    return torch.empty_like(features), torch.empty_like(weight)


def _depthwise_backward(ctx, grad_output):
    features, weight, table = ctx.saved_tensors
    grad_input, grad_weight = depthwise_backward(grad_output.contiguous(), features, weight, table, ctx.bwd_algo)
    return grad_input, grad_weight, None, None, None


depthwise_forward.register_autograd(_depthwise_backward, setup_context=_save_inputs)


class _Convolution(torch.autograd.Function):
    """The eager path of `conv_forward` / `conv_backward`: the same core calls, over the kernel map
    itself, without the op's dispatch."""

    @staticmethod
    def forward(ctx, features, weight, kernel_map: KernelMap, fwd_algo, bwd_algo):
        ctx.save_for_backward(features, weight)
        # Held until backward: the tensors that own the map may be gone by then.
        ctx.kernel_map, ctx.bwd_algo = kernel_map, bwd_algo
        if ctx.needs_input_grad[1]:
            # The weight gradient's pair lists are sized by a count from the GPU: counted now, it has
            # arrived by the backward pass, which then does not wait for the GPU to catch up.
            kernel_map.count_pairs_ahead()
        return _map_forward(features, weight, kernel_map, fwd_algo)

    @staticmethod
    def backward(ctx, grad_output):
        features, weight = ctx.saved_tensors
        grad_input, grad_weight = _map_backward(
            grad_output.contiguous(), features, weight, ctx.kernel_map, ctx.bwd_algo, *ctx.needs_input_grad[:2]
        )
        return grad_input, grad_weight, None, None, None


def convolution(features, weight, table, fwd_algo: str, bwd_algo: str) -> torch.Tensor:
    """`conv_forward` with autograd: the custom op while compiling, `map_convolution` in eager mode."""
    if torch.compiler.is_compiling():
        return conv_forward(features, weight, table, fwd_algo, bwd_algo)
    return _eager_convolution(features, weight, _kernel_map(table), fwd_algo, bwd_algo)


def map_convolution(features, weight, kernel_map: KernelMap, fwd_algo: str, bwd_algo: str) -> torch.Tensor:
    """`convolution` over `kernel_map`, which eager mode uses without looking up its pair table."""
    if torch.compiler.is_compiling():
        return conv_forward(features, weight, pair_table(kernel_map), fwd_algo, bwd_algo)
    return _eager_convolution(features, weight, kernel_map, fwd_algo, bwd_algo)


def _eager_convolution(features, weight, kernel_map: KernelMap, fwd_algo: str, bwd_algo: str) -> torch.Tensor:
    if torch.is_grad_enabled() and (features.requires_grad or weight.requires_grad):
        return _Convolution.apply(features, weight, kernel_map, fwd_algo, bwd_algo)
    # Nothing to differentiate (inference): autograd's bookkeeping would cost more than the launch.
    return _map_forward(features, weight, kernel_map, fwd_algo, inference=True)
