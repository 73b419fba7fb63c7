"""Sparse convolutions of torch `SparseTensor`s: the differentiable functions and their `torch.nn` modules.

A convolution runs the core's execution path (`cupysparse.functional.execution`) with torch's arrays
(`TorchArrays`, the adapter's side of its `Arrays` protocol): the layer's launch plan on torch
allocations and torch's stream, on device addresses, or the core's full path on zero-copy views
(`bridge`). Compilers see it through `torch.library` custom ops (`cupysparse::*`) with fake
implementations, which give the output shapes from the tensors alone, so compiled graphs need no real
data to trace; in eager mode `map_convolution` skips the op's dispatch (a hundred
microseconds or more per call, more than a 100K-voxel layer's kernels) and calls the same path
directly, through a `torch.autograd.Function` when a gradient is needed. Depthwise convolutions always
use their op. Under autocast a convolution runs in the autocast dtype, as torch's own convolutions do.

A kernel map is not a tensor, so the ops take its pair table (a torch view of the core's array) and
find the `KernelMap` it belongs to in a registry keyed by the table's memory: the map keeps its derived
formats and its layers' plans from call to call, while `torch.compile` and CUDA graphs only ever see
tensors. Algorithm choices travel as their canonical strings (`search_space.algorithm_argument`): ""
is None (the environment variables). The backward op computes only the gradients autograd needs.

The modules keep weights `[K, C_in, C_out]` (depthwise `[K, C]`), initialised like torch's
convolutions (uniform in ±1/sqrt(fan_in), fan_in = K · C_in). Their algorithm arguments are those of
the functional API (an enum member, a name, a list of either, `auto`, `all`; None reads the
environment variables) and are checked when the module is built.

spconv's arguments: `padding` gives a strided (or stride-1 "regular") convolution spconv's geometry
(`cupysparse.geometry.padding`), and a transposed one its inverse or, generative, spconv's transposed
convolution. `indice_key` names what a convolution registers on its output (`IndiceKeyEntry`, carried by
the tensors derived from it, as spconv's `indice_dict`): `SparseInverseConv3d` finds its strided convolution
by it, and submanifold convolutions sharing a key must share their kernel. The maps themselves are shared
by the map cache, key or no key.
"""

from __future__ import annotations

import math
import operator
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from cupysparse.algorithms import CONV, DEPTHWISE
from cupysparse.functional import execution
from cupysparse.functional.execution import Arrays
from cupysparse.functional.checks import positive_int
from cupysparse.functional.convolution import spatially_sparse_depthwise_conv, spatially_sparse_depthwise_conv_backward
from cupysparse.functional.epilogue import ConvEpilogue
from cupysparse.geometry.coords import as_tuple
from cupysparse.geometry.kernel_map import KernelMap
from cupysparse.tuning.search_space import algorithm_argument

from cupysparse.adapters.torch.bridge import core_dtype, from_core, on_torch_stream, to_core
from cupysparse.adapters.torch.tensor import SparseTensor, require_sparse


class TorchArrays(Arrays):
    """torch tensors for the core's execution path: CUDA tensors take plans; CPU tensors take the full
    path on their NumPy views."""

    def __init__(self):
        # Inference's padded weights, by weight: ((its version, address, padded shape), the padded copy).
        self._padded_weights = WeakIdKeyDictionary()

    def launch_device(self, features, weight, grad_output=None) -> int | None:
        # `get_device()` and torch's C getter of the current device: a `torch.device` made per read and
        # `torch.cuda.current_device()`'s initialisation checks (a CUDA tensor exists) cost microseconds a call.
        if not (features.is_cuda and features.is_contiguous() and features.dtype == weight.dtype):
            return None
        device_index = features.get_device()
        if weight.get_device() != device_index or device_index != torch._C._cuda_getDevice():
            return None
        if grad_output is not None and not (grad_output.is_contiguous() and grad_output.dtype == features.dtype
                                            and grad_output.get_device() == device_index):
            return None
        return device_index

    def core_dtype(self, dtype: torch.dtype) -> np.dtype | None:
        return core_dtype(dtype)

    def empty(self, like: torch.Tensor, shape: tuple) -> torch.Tensor:
        return like.new_empty(shape)

    def empty_float32(self, like: torch.Tensor, shape: tuple) -> torch.Tensor:
        return like.new_empty(shape, dtype=torch.float32)  # `like.device` would make a torch.device per call

    # A C-level call, not a method: it costs no Python frame on the hot path.
    address = operator.methodcaller("data_ptr")

    def stream(self, like: torch.Tensor) -> int:
        return torch._C._cuda_getCurrentRawStream(like.device.index)  # a CUDA tensor's index is never None

    def padded_weight(self, weight: torch.Tensor, shape: tuple, transposed: bool, reuse: bool) -> torch.Tensor:
        """See `Arrays.padded_weight`; with `reuse`, the padded copy is kept from call to call while `weight`
        is unchanged: an in-place update (an optimiser's step, `load_state_dict`, anything under
        `torch.no_grad()`) bumps its `_version`, a reassigned `.data` changes its address, so either pads
        again. Writes through `weight.data` are not seen (they bump no version): such a weight must be
        updated in place on the tensor itself. While a CUDA graph is captured it pads anew, so that every
        replay reads the weight as it is then."""
        if weight.shape == shape and not transposed:
            return weight.contiguous()
        if not reuse or weight.is_inference() or (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
            return _padded(weight, shape, transposed)  # an inference tensor has no version to key on
        key = (weight._version, weight.data_ptr(), shape, transposed)
        kept = self._padded_weights.get(weight)
        if kept is None or kept[0] != key:
            kept = self._padded_weights[weight] = (key, _padded(weight, shape, transposed))
        return kept[1]

    def device_context(self, like: torch.Tensor):
        return on_torch_stream(like.device)

    def gpu(self, array: torch.Tensor) -> int | None:
        return array.device.index if array.is_cuda else None

    def current_gpu(self) -> int:
        return torch.cuda.current_device()

    def is_contiguous(self, array: torch.Tensor) -> bool:
        return array.is_contiguous()

    def contiguous(self, array: torch.Tensor) -> torch.Tensor:
        return array.contiguous()

    def to_core(self, array: torch.Tensor):
        return to_core(array)

    def from_core(self, array) -> torch.Tensor:
        return from_core(array)


def _padded(weight: torch.Tensor, shape, transposed: bool = False) -> torch.Tensor:
    """`weight` `[K, A, B]` (`[K, B, A]` when `transposed`) zero-padded at the end of its last two
    dimensions to `shape`, contiguous."""
    if transposed:
        weight = weight.transpose(1, 2)
    if weight.shape == shape:
        return weight.contiguous()
    padding = (0, shape[2] - weight.shape[2], 0, shape[1] - weight.shape[1])
    return torch.nn.functional.pad(weight.detach(), padding).contiguous()


TORCH_ARRAYS = TorchArrays()


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
        raise ValueError("this pair table belongs to no live kernel map; pass tables from convolution.pair_table(kernel_map)")
    return kernel_map


def _algorithm(argument: str):
    return argument or None


def _forward(features, weight, kernel_map: KernelMap, fwd_algo: str, inference: bool = False) -> torch.Tensor:
    """The forward; `inference` (nothing to differentiate, eager mode) keeps a padded weight from call to
    call, where training, whose weight changes every step, pads per call."""
    return execution.forward(TORCH_ARRAYS, features, weight, kernel_map, fwd_algo, reuse_weight=inference)


def _backward(grad_output, features, weight, kernel_map: KernelMap, bwd_algo: str, needs_input_grad: bool,
              needs_weight_grad: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients asked for, None for the others."""
    return execution.backward(TORCH_ARRAYS, grad_output, features, weight, kernel_map, bwd_algo, needs_input_grad,
                              needs_weight_grad)


@torch.library.custom_op("cupysparse::conv_forward", mutates_args=())
def conv_forward(features: torch.Tensor, weight: torch.Tensor, table: torch.Tensor, fwd_algo: str,
                 bwd_algo: str) -> torch.Tensor:
    """`out[i] = Σ_k weight[k]^T · features[table[k, i]]` → `[N_out, C_out]`."""
    return _forward(features, weight, _kernel_map(table), fwd_algo)


@conv_forward.register_fake
def _(features, weight, table, fwd_algo, bwd_algo):
    return features.new_empty((table.shape[1], weight.shape[2]))


@torch.library.custom_op("cupysparse::conv_backward", mutates_args=())
def conv_backward(grad_output: torch.Tensor, features: torch.Tensor, weight: torch.Tensor, table: torch.Tensor,
                  bwd_algo: str, needs_input_grad: bool, needs_weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(input gradient `[N_in, C_in]`, weight gradient `[K, C_in, C_out]`); an empty tensor for one not needed."""
    grad_input, grad_weight = _backward(grad_output, features, weight, _kernel_map(table), bwd_algo,
                                        needs_input_grad, needs_weight_grad)
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
        out = spatially_sparse_depthwise_conv(
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
        grad_input, grad_weight = spatially_sparse_depthwise_conv_backward(
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
    """The eager path of `conv_forward` / `conv_backward`: the same calls, over the kernel map itself,
    without the op's dispatch."""

    @staticmethod
    def forward(ctx, features, weight, kernel_map: KernelMap, fwd_algo, bwd_algo):
        ctx.save_for_backward(features, weight)
        # Held until backward: the tensors that own the map may be gone by then.
        ctx.kernel_map, ctx.bwd_algo = kernel_map, bwd_algo
        if ctx.needs_input_grad[1]:
            # The weight gradient's pair lists are sized by a count from the GPU: counted now, it has
            # arrived by the backward pass, which then does not wait for the GPU to catch up.
            kernel_map.count_pairs_ahead()
        return _forward(features, weight, kernel_map, fwd_algo)

    @staticmethod
    def backward(ctx, grad_output):
        features, weight = ctx.saved_tensors
        grad_input, grad_weight = _backward(
            grad_output.contiguous(), features, weight, ctx.kernel_map, ctx.bwd_algo, *ctx.needs_input_grad[:2]
        )
        return grad_input, grad_weight, None, None, None


def convolution(features, weight, table, fwd_algo: str, bwd_algo: str) -> torch.Tensor:
    """`conv_forward` with autograd: the custom op while compiling, `map_convolution` in eager mode."""
    if torch.compiler.is_compiling():
        return conv_forward(features, weight, table, fwd_algo, bwd_algo)
    return _eager_convolution(features, weight, _kernel_map(table), fwd_algo, bwd_algo)


def map_convolution(features, weight, kernel_map: KernelMap, fwd_algo: str, bwd_algo: str) -> torch.Tensor:
    """A differentiable convolution over `kernel_map`, which eager mode uses without looking up its pair table."""
    if torch.compiler.is_compiling():
        return conv_forward(features, weight, pair_table(kernel_map), fwd_algo, bwd_algo)
    return _eager_convolution(features, weight, kernel_map, fwd_algo, bwd_algo)


def _eager_convolution(features, weight, kernel_map: KernelMap, fwd_algo: str, bwd_algo: str) -> torch.Tensor:
    if torch.is_grad_enabled() and (features.requires_grad or weight.requires_grad):
        return _Convolution.apply(features, weight, kernel_map, fwd_algo, bwd_algo)
    # Nothing to differentiate (inference): autograd's bookkeeping would cost more than the launch.
    return _forward(features, weight, kernel_map, fwd_algo, inference=True)


def _check_like_features(tensor: torch.Tensor, name: str, features: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device != features.device:
        raise ValueError(f"{name} is on {tensor.device} but the input features are on {features.device}")
    if tensor.dtype != features.dtype:
        raise TypeError(f"{name} has dtype {tensor.dtype} but the input features have {features.dtype}")


def _check_contiguous(features: torch.Tensor) -> None:
    if not features.is_contiguous():
        raise ValueError("the input features must be contiguous (row-major [N, C]); call .contiguous() first")


def _autocast(features: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    device_type = features.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return features.to(dtype), weight.to(dtype)
    return features, weight

def sparse_conv(input: SparseTensor, weight: torch.Tensor, kernel_size, stride=1, dilation=1, transposed=False,
                generative=False, bias: torch.Tensor | None = None, fwd_algo=None, bwd_algo=None,
                padding=None) -> SparseTensor:
    """`cupysparse.spatially_sparse_conv` for torch: weight `[K, C_in, C_out]`, bias `[C_out]`; `padding`
    (None: unpadded) as there."""
    require_sparse(input)
    features, weight = _autocast(input.features, weight)
    _check_like_features(weight, "weight", features)
    _check_contiguous(features)
    result = input.kernel_map(kernel_size, stride, dilation, transposed, generative, padding)
    kernel_map = result.kernel_map
    if weight.dim() != 3 or weight.shape[0] != kernel_map.kernel_volume or weight.shape[1] != features.shape[1]:
        raise ValueError(f"weight must have shape [K={kernel_map.kernel_volume}, C_in={features.shape[1]}, C_out], "
                         f"got {tuple(weight.shape)}")
    # A layer's algorithms are None (the environment variables) but where asked for: "" without a call.
    fwd_argument = "" if fwd_algo is None else algorithm_argument(fwd_algo, CONV, "forward")
    bwd_argument = "" if bwd_algo is None else algorithm_argument(bwd_algo, CONV, "backward")
    out = map_convolution(features, weight.contiguous(), kernel_map, fwd_argument, bwd_argument)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return input.with_map_result(result, out)


def sparse_depthwise_conv(input: SparseTensor, weight: torch.Tensor, kernel_size, stride=1, dilation=1,
                          transposed=False, bias: torch.Tensor | None = None, fwd_algo=None,
                          bwd_algo=None) -> SparseTensor:
    """A per-channel convolution: weight `[K, C]`."""
    require_sparse(input)
    features, weight = _autocast(input.features, weight)
    _check_like_features(weight, "weight", features)
    _check_contiguous(features)
    result = input.kernel_map(kernel_size, stride, dilation, transposed)
    kernel_map = result.kernel_map
    if tuple(weight.shape) != (kernel_map.kernel_volume, features.shape[1]):
        raise ValueError(f"depthwise weight must have shape [K={kernel_map.kernel_volume}, C={features.shape[1]}], "
                         f"got {tuple(weight.shape)}")
    out = depthwise_forward(
        features, weight.contiguous(), pair_table(kernel_map),
        algorithm_argument(fwd_algo, DEPTHWISE, "forward"), algorithm_argument(bwd_algo, DEPTHWISE, "backward"),
    )
    if bias is not None:
        out = out + bias.to(out.dtype)
    return input.with_map_result(result, out)


@dataclass(frozen=True)
class IndiceKeyEntry:
    """What a convolution built with an `indice_key` registers on its output: its kind ("submanifold",
    "forward" for a strided or padded one, "transposed") and geometry (padding None: unpadded)."""

    kind: str
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    padding: tuple[int, ...] | None


def _indice_key(value, name: str = "indice_key") -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {value!r} ({type(value).__name__})")
    return value


class SpatiallySparseConv(nn.Module):
    """A sparse convolution: submanifold (stride 1), strided, transposed (back to the coordinates
    the input was downsampled from) or generative transposed. See `cupysparse.spatially_sparse_conv`.
    `padding` (an int or D ints, not negative; None: unpadded) gives it spconv's geometry; `indice_key`
    registers it on its output (see the module's docstring)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, dilation=1, transposed=False,
                 generative=False, bias=True, fwd_algo=None, bwd_algo=None, *, spatial_dims=3, device=None,
                 dtype=None, padding=None, indice_key=None):
        super().__init__()
        self.in_channels = positive_int(in_channels, "in_channels")
        self.out_channels = positive_int(out_channels, "out_channels")
        self.kernel_size = as_tuple(kernel_size, spatial_dims, "kernel_size")
        self.stride = as_tuple(stride, spatial_dims, "stride")
        self.dilation = as_tuple(dilation, spatial_dims, "dilation")
        self.padding = None if padding is None else as_tuple(padding, spatial_dims, "padding", minimum=0)
        self.transposed, self.generative = transposed, generative
        self.indice_key = _indice_key(indice_key)
        algorithm_argument(fwd_algo, CONV, "forward")
        algorithm_argument(bwd_algo, CONV, "backward")
        self.fwd_algo, self.bwd_algo = fwd_algo, bwd_algo
        volume = math.prod(self.kernel_size)
        self.weight = nn.Parameter(torch.empty(volume, self.in_channels, self.out_channels, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.out_channels, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.weight.shape[0] * self.in_channels)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    @property
    def kind(self) -> str:
        """"submanifold", "forward" (strided or padded) or "transposed", as `IndiceKeyEntry` has it."""
        if self.transposed:
            return "transposed"
        return "forward" if self.padding is not None or any(s != 1 for s in self.stride) else "submanifold"

    def forward(self, input: SparseTensor) -> SparseTensor:
        entry = None if self.indice_key is None else self._entry(input)
        output = sparse_conv(input, self.weight, self.kernel_size, self.stride, self.dilation, self.transposed,
                             self.generative, self.bias, self.fwd_algo, self.bwd_algo, self.padding)
        return output if entry is None else output.with_indice_key(self.indice_key, entry)

    def fused_inference(self, input: SparseTensor, epilogue: ConvEpilogue) -> SparseTensor | None:
        """`self(input)` with `epilogue` (torch tensors) applied as the kernel stores the output: inference in
        eager mode with gradients off. None where it cannot be (a bias, an indice key, CPU tensors, a residual
        unlike the output, an algorithm without an epilogue): the caller runs its layers one by one then."""
        if self.bias is not None or self.indice_key is not None or torch.is_grad_enabled() or (
                torch.compiler.is_compiling()):
            return None
        require_sparse(input)
        features, weight = _autocast(input.features, self.weight)
        residual = epilogue.residual
        if not features.is_cuda or weight.dtype != features.dtype or not features.is_contiguous() or (
                residual is not None and residual.dtype != features.dtype):
            return None
        result = input.kernel_map(self.kernel_size, self.stride, self.dilation, self.transposed, self.generative,
                                  self.padding)
        argument = "" if self.fwd_algo is None else algorithm_argument(self.fwd_algo, CONV, "forward")
        out = execution.fused_forward(TORCH_ARRAYS, features, weight.contiguous(), result.kernel_map, argument,
                                      epilogue)
        return None if out is None else input.with_map_result(result, out)

    def _entry(self, input: SparseTensor) -> IndiceKeyEntry | None:
        """What this convolution registers under its key on `input` (None: already there, the same); a
        ValueError for a key registered otherwise (spconv's rules)."""
        require_sparse(input)
        entry = IndiceKeyEntry(self.kind, self.kernel_size, self.stride, self.dilation, self.padding)
        registered = input.indice_keys.get(self.indice_key)
        if registered is None:
            return entry
        if entry.kind == registered.kind == "submanifold":
            if (registered.kernel_size, registered.dilation) != (entry.kernel_size, entry.dilation):
                raise ValueError(
                    f"submanifold convolutions sharing indice_key {self.indice_key!r} must share kernel size and "
                    f"dilation: registered {registered.kernel_size}, {registered.dilation}; this one "
                    f"{entry.kernel_size}, {entry.dilation}")
            return None
        raise ValueError(f"indice_key {self.indice_key!r} is already registered on the input, by a {registered.kind} "
                         f"convolution; a {entry.kind} convolution needs a key of its own")

    def extra_repr(self) -> str:
        kind = "generative transposed" if self.generative else "transposed" if self.transposed else "forward"
        padding = "" if self.padding is None else f", padding={self.padding}"
        key = "" if self.indice_key is None else f", indice_key={self.indice_key!r}"
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"dilation={self.dilation}{padding}, {kind}, bias={self.bias is not None}{key}")


class SubMConv3d(SpatiallySparseConv):
    """Submanifold 3D convolution: the output has the input's coordinates. No padding: spconv's
    SubMConv3d ignores its own."""

    def __init__(self, in_channels, out_channels, kernel_size, dilation=1, bias=True, *, indice_key=None, **kwargs):
        if "padding" in kwargs:
            raise TypeError("a submanifold convolution keeps its input's coordinates and takes no padding (spconv's "
                            "SubMConv3d ignores its own): leave it out")
        super().__init__(in_channels, out_channels, kernel_size, 1, dilation, bias=bias, indice_key=indice_key,
                         **kwargs)


class SparseConv3d(SpatiallySparseConv):
    """Strided 3D convolution: output coordinates floor(input / stride), and stride 1 keeps the input
    coordinates (submanifold). With `padding`, spconv's SparseConv3d: every voxel a kernel tap reaches, inside
    the output's spatial shape when the input has one, stride 1 included (spconv's "regular" convolution)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, dilation=1, bias=True, *, padding=None,
                 indice_key=None, **kwargs):
        super().__init__(in_channels, out_channels, kernel_size, stride, dilation, bias=bias, padding=padding,
                         indice_key=indice_key, **kwargs)


class SparseConvTranspose3d(SpatiallySparseConv):
    """Transposed 3D convolution back to the coordinates the input was downsampled from;
    `generative=True` creates every reachable coordinate instead. With `padding`: the inverse of the padded
    convolution that made the input's coordinates, or, generative, spconv's SparseConvTranspose3d."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, dilation=1, bias=True, generative=False, *,
                 padding=None, indice_key=None, **kwargs):
        super().__init__(in_channels, out_channels, kernel_size, stride, dilation, True, generative, bias,
                         padding=padding, indice_key=indice_key, **kwargs)


class SparseInverseConv3d(SpatiallySparseConv):
    """spconv's SparseInverseConv3d: the transposed convolution of the strided (or padded) convolution registered
    under `indice_key` on the way to the input, back to that convolution's input coordinates; its stride,
    dilation and padding come from there, its kernel size must be that convolution's."""

    def __init__(self, in_channels, out_channels, kernel_size, indice_key, bias=True, **kwargs):
        if _indice_key(indice_key) is None:
            raise TypeError("an inverse convolution needs the indice_key of the convolution it inverts")
        super().__init__(in_channels, out_channels, kernel_size, transposed=True, bias=bias, **kwargs)
        self.inverts = indice_key

    def forward(self, input: SparseTensor) -> SparseTensor:
        require_sparse(input)
        entry = input.indice_keys.get(self.inverts)
        if entry is None:
            raise ValueError(f"no convolution registered indice_key {self.inverts!r} on the way to this input "
                             f"(registered: {sorted(input.indice_keys)})")
        if entry.kind != "forward":
            raise ValueError(f"an inverse convolution inverts a strided or padded convolution; indice_key "
                             f"{self.inverts!r} was registered by a {entry.kind} one")
        if entry.kernel_size != self.kernel_size:
            raise ValueError(f"an inverse convolution has the kernel size of the convolution it inverts, "
                             f"{entry.kernel_size} (indice_key {self.inverts!r}); this one has {self.kernel_size}")
        return sparse_conv(input, self.weight, entry.kernel_size, entry.stride, entry.dilation, True, False, self.bias,
                           self.fwd_algo, self.bwd_algo, entry.padding)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, inverts "
                f"indice_key={self.inverts!r}, bias={self.bias is not None}")


class SubMConv2d(SubMConv3d):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, spatial_dims=2, **kwargs)


class SparseConv2d(SparseConv3d):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, spatial_dims=2, **kwargs)


class SparseConvTranspose2d(SparseConvTranspose3d):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, spatial_dims=2, **kwargs)


class SparseInverseConv2d(SparseInverseConv3d):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, spatial_dims=2, **kwargs)


class SparseDepthwiseConv(nn.Module):
    """A per-channel sparse convolution, weight `[K, C]`."""

    def __init__(self, channels: int, kernel_size, stride=1, dilation=1, transposed=False, bias=True, fwd_algo=None,
                 bwd_algo=None, *, spatial_dims=3, device=None, dtype=None):
        super().__init__()
        self.channels = positive_int(channels, "channels")
        self.kernel_size = as_tuple(kernel_size, spatial_dims, "kernel_size")
        self.stride = as_tuple(stride, spatial_dims, "stride")
        self.dilation = as_tuple(dilation, spatial_dims, "dilation")
        self.transposed = transposed
        algorithm_argument(fwd_algo, DEPTHWISE, "forward")
        algorithm_argument(bwd_algo, DEPTHWISE, "backward")
        self.fwd_algo, self.bwd_algo = fwd_algo, bwd_algo
        volume = math.prod(self.kernel_size)
        self.weight = nn.Parameter(torch.empty(volume, self.channels, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(self.channels, device=device, dtype=dtype)) if bias else None
        bound = 1.0 / math.sqrt(volume)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: SparseTensor) -> SparseTensor:
        return sparse_depthwise_conv(input, self.weight, self.kernel_size, self.stride, self.dilation,
                                       self.transposed, self.bias, self.fwd_algo, self.bwd_algo)

