"""Batch norm in training, with the ReLU and the residual sum a network applies after it, forward and
backward over the features `[N, C]` in two passes each (raw_kernels/batch_norm_training.cu):

    forward:   out = relu?(xhat · weight + bias (+ residual)),  xhat = (x − mean) · invstd,
               mean and biased variance over the N rows, invstd = 1 / sqrt(var + eps); the running
               statistics move by `momentum` towards the mean and the unbiased variance (torch's rule);
    backward:  g = grad_out where out > 0 (grad_out itself without the ReLU), the residual's gradient;
               grad_x = weight · invstd · (g − mean(g) − xhat · mean(g · xhat)),
               grad_weight = Σ g · xhat, grad_bias = Σ g;

and `renormalise`, the forward's output again from its input and the statistics it saved, with the same bits,
for a network whose backward recomputes the outputs it did not keep (on the GPU, through up to CHAIN norms whose
outputs are one another's residuals, in one pass: `launch_renormalise`).

A torch network in training runs a batch norm, a ReLU and a residual sum as four kernels forward and
three backward, each a pass over the features; here the statistics are one pass and the normalisation
with the ReLU and the sum another, and the backward's sums one pass and the gradients another. Sums are
fp32 (the forward's over x − x[0], against cancellation), in a fixed order: each block's into a reduction
workspace (`reduction_floats`), where the last block of each group of blocks adds up the group's and the last
group's the groups', so a step gives the same bits every run.

On the GPU, fp32, fp16 and bf16 features with parameters and statistics of the features' dtype or fp32
(`kernel_runs`); `launch_forward` and `launch_backward` take device addresses (for adapters, whose
framework allocates), `training_batch_norm` and its backward CuPy or NumPy arrays, checked: where the kernels
do not take them as they are (and on NumPy arrays), the formulas run through the array module in float64 (the
reference the GPU is tested against): a sum down the rows of a row-major array adds one row at a time, whose
error in fp32 grows with the rows (at 20,000 rows of mean 5, the input gradient was 8% off).
"""

from __future__ import annotations

import functools
import operator
from typing import NamedTuple

import numpy as np

from cupysparse.cuda.backend import array_module, cupy_module, current_device, is_cupy_array
from cupysparse.cuda.compile import KernelSource, PreparedLaunch
from cupysparse.cuda.device import multiprocessors, resident_threads
from cupysparse.cuda.dtypes import BFLOAT16, FLOAT16, FLOAT32, cuda_type_name
from cupysparse.functional.epilogue import VECTOR_BYTES, check_norm_arguments, float_bits
from cupysparse.functional.execution import core_arrays

BLOCK = 256  # threads of a block, as in the kernel source: at most this many channel groups
CHAIN = 3  # the most norms one recomputation runs through, as in the kernel source
GROUP = 32  # blocks whose sums one of them adds up, as in the kernel source
KERNEL_DTYPES = tuple(dtype for dtype in (FLOAT32, FLOAT16, BFLOAT16) if dtype is not None)


def _widths(dtype) -> tuple[int, int]:
    """Channels per thread: a 16-byte vector, or one where the channels or addresses do not allow it."""
    return VECTOR_BYTES // np.dtype(dtype).itemsize, 1


def _instantiations(dtype) -> tuple[str, ...]:
    names = []
    for vector in _widths(dtype):
        names += [f"batch_norm_statistics<{cuda_type_name(dtype)}, {vector}>",
                  f"batch_norm_gradient_sums<{cuda_type_name(dtype)}, {vector}>"]
        for parameter_dtype in dict.fromkeys((dtype, FLOAT32)):
            types = f"{cuda_type_name(dtype)}, {cuda_type_name(parameter_dtype)}, {vector}"
            names += [f"batch_norm_normalise<{types}>", f"batch_norm_input_gradient<{types}>",
                      f"batch_norm_renormalise<{types}>"]
    return tuple(names)


# One module per feature dtype: a process compiles those it trains in.
_KERNELS = {dtype: KernelSource("batch_norm_training.cu", _instantiations(dtype)) for dtype in KERNEL_DTYPES}


def _vector(dtype, channels: int, addresses: int) -> int:
    """The channels per thread for rows at `addresses`, the bitwise or of their addresses (each on
    VECTOR_BYTES, a power of two, exactly where their or is)."""
    vector = _widths(dtype)[0]
    return vector if channels % vector == 0 and not addresses % VECTOR_BYTES else 1


def kernel_runs(dtype, parameter_dtype, channels: int) -> bool:
    """Whether the kernels take `[N, channels]` features of `dtype` with parameters and statistics of
    `parameter_dtype`: a block holds at least one row of channel groups."""
    if dtype not in KERNEL_DTYPES or parameter_dtype not in (dtype, FLOAT32) or channels < 1:
        return False
    vector = _widths(dtype)[0]
    return (channels // vector if channels % vector == 0 else channels) <= BLOCK


def _max_blocks(device: int) -> int:
    """The most blocks a pass launches: as many as the device holds at once, whichever kernel."""
    return resident_threads(device) // BLOCK


class _Pass(NamedTuple):
    """One kernel's prepared launch and its wave: the blocks the device holds of it at once. A grid past one
    wave ran a second, mostly idle one (8 blocks a multiprocessor where registers allow 4: a MinkUNet18
    step's norms took 3.3 ms of kernel time on an H200 against 2.8 ms in one wave)."""

    kernel: PreparedLaunch
    wave: int

    def grid(self, num_rows: int, channels: int, vector: int) -> tuple[int, int, int]:
        rows_per_block = BLOCK // (channels // vector)
        return max(1, min(-(-num_rows // rows_per_block), self.wave)), 1, 1


def _max_groups(device: int) -> int:
    return -(-_max_blocks(device) // GROUP)


@functools.cache
def _ticket_floats(device: int) -> int:
    """A reduction workspace's first words, its tickets (one for the groups, one per group), on 16 bytes."""
    return -(-(1 + _max_groups(device)) // 4) * 4


def reduction_floats(channels: int) -> int:
    """The fp32 words of the reduction workspace a pass over `channels` channels takes on the current GPU: its
    tickets, zero before the first pass (each pass leaves them zero), then 2 x `channels` sums of each block and
    of each group of blocks. The passes of one stream may share one."""
    device = current_device()
    return _ticket_floats(device) + (_max_blocks(device) + _max_groups(device)) * 2 * channels


@functools.cache
def _launches(device: int, dtype, parameter_dtype, vector: int) -> tuple[_Pass, ...]:
    """The prepared launches of the forward's two passes, the backward's two and the recomputation's one on
    `device`, with their waves, made once: a layer of a network in training would otherwise name and look up its
    kernels each step."""
    kernels, value = _KERNELS[dtype], cuda_type_name(dtype)
    types = f"{value}, {cuda_type_name(parameter_dtype)}, {vector}"
    launches = (kernels.prepared(f"batch_norm_statistics<{value}, {vector}>", BLOCK, 6),
                kernels.prepared(f"batch_norm_normalise<{types}>", BLOCK, 16),
                kernels.prepared(f"batch_norm_gradient_sums<{value}, {vector}>", BLOCK, 11),
                kernels.prepared(f"batch_norm_input_gradient<{types}>", BLOCK, 11),
                kernels.prepared(f"batch_norm_renormalise<{types}>", BLOCK, 5 * CHAIN + 6))
    return tuple(_Pass(launch, min(_max_blocks(device), multiprocessors(device) * launch.resident_blocks()))
                 for launch in launches)


def launch_forward(stream: int, num_rows: int, channels: int, dtype, parameter_dtype, features: int, residual: int,
                   weight: int, bias: int, running_mean: int, running_var: int, batches_tracked: int,
                   momentum: float, eps: float, relu: bool, sums: int, reduction: int, saved_mean: int,
                   saved_invstd: int, out: int) -> None:
    """The forward on the current device over device addresses: row-major `[num_rows, channels]` features,
    residual (0: none) and out of `dtype`; `[channels]` weight, bias (0: none of either) and running statistics
    of `parameter_dtype` (see `kernel_runs`; the statistics are updated in place); an int64 count of batches
    incremented by one (0: none); fp32 `sums` `[2, channels]`, a `reduction` workspace (`reduction_floats`), and
    `saved_mean`, `saved_invstd` `[channels]` written for the backward. Nothing is checked."""
    vector = _vector(dtype, channels, features | residual | out)
    device = current_device()
    statistics, normalise = _launches(device, dtype, parameter_dtype, vector)[:2]
    statistics.kernel.launch(stream, features, num_rows, channels, sums, reduction + 4 * _ticket_floats(device),
                             reduction, grid=statistics.grid(num_rows, channels, vector))
    normalise.kernel.launch(
        stream, features, residual, weight, bias, sums, running_mean, running_var, batches_tracked,
        float_bits(momentum), float_bits(eps), int(relu), num_rows, channels, saved_mean, saved_invstd, out,
        grid=normalise.grid(num_rows, channels, vector))


def launch_backward(stream: int, num_rows: int, channels: int, dtype, parameter_dtype, grad_out: int, features: int,
                    out: int, weight: int, saved_mean: int, saved_invstd: int, relu: bool, sums: int, reduction: int,
                    g: int, grad_features: int, grad_weight: int, grad_bias: int) -> None:
    """The backward over device addresses (see `launch_forward`): `out` the forward's output (read only with
    the ReLU), fp32 `sums` `[2, channels]`, a `reduction` workspace, `g` where g is written with the ReLU (the
    residual's gradient; without it, g is `grad_out` and this is not read); `grad_weight`, `grad_bias`: 0 where
    not wanted. Nothing is checked."""
    vector = _vector(dtype, channels, grad_out | features | grad_features | (out | g if relu else 0))
    device = current_device()
    gradient_sums, input_gradient = _launches(device, dtype, parameter_dtype, vector)[2:4]
    gradient_sums.kernel.launch(stream, grad_out, features, out, saved_mean, int(relu), num_rows, channels, sums, g,
                                reduction + 4 * _ticket_floats(device), reduction,
                                grid=gradient_sums.grid(num_rows, channels, vector))
    input_gradient.kernel.launch(
        stream, g if relu else grad_out, features, weight, saved_mean, saved_invstd, sums, num_rows, channels,
        grad_features, grad_weight, grad_bias, grid=input_gradient.grid(num_rows, channels, vector))


class NormLink(NamedTuple):
    """One norm of a recomputation (`launch_renormalise`, `run_renormalise`): its forward's input features, weight
    and bias (None or 0: none), the mean and invstd it saved (the kernels take their addresses), and its ReLU."""

    features: object
    weight: object
    bias: object
    saved_mean: object
    saved_invstd: object
    relu: bool


def launch_renormalise(stream: int, num_rows: int, channels: int, dtype, parameter_dtype, links, residual: int,
                       out: int) -> None:
    """Forward outputs again, over device addresses as `launch_forward` takes them, the running statistics left
    alone: `links` (1 to CHAIN `NormLink`s of addresses), the last one's output over `residual` (0: none), which
    is the residual of the one before it, and so on; the first one's output is written to `out`, with the bits
    its forward gave. Nothing is checked."""
    padded = [*links, *[NormLink(0, 0, 0, 0, 0, False)] * (CHAIN - len(links))]
    features, weights, biases, means, invstds, relus = zip(*padded)
    vector = _vector(dtype, channels, functools.reduce(operator.or_, features, residual | out))
    renormalise = _launches(current_device(), dtype, parameter_dtype, vector)[4]
    renormalise.kernel.launch(stream, *features, *weights, *biases, *means, *invstds, len(links),
                              sum(1 << index for index, relu in enumerate(relus) if relu), residual, num_rows,
                              channels, out, grid=renormalise.grid(num_rows, channels, vector))


FORWARD_SCRATCH_ROWS = 4  # fp32 rows of C a forward reads and writes: its two sums, then the saved mean and invstd
BACKWARD_SCRATCH_ROWS = 2  # the backward's two sums


def run_forward(arrays, features, residual, weight, bias, running_mean, running_var, momentum: float, eps: float,
                relu: bool, parameter_dtype, batches_tracked=None, scratch: int | None = None,
                reduction: int | None = None):
    """The forward's kernels on a framework's arrays (`arrays`: its `execution.Arrays`), which its caller has
    found them to take as they are (`kernel_runs`, contiguous, on the current GPU; `residual`, `weight`,
    `bias` may be None; `batches_tracked`, a module's int64 count of batches there, is incremented).
    `scratch`: the device address of fp32 `[FORWARD_SCRATCH_ROWS, C]`, where a caller running many batch norms
    places theirs in one allocation, and `reduction` that of a reduction workspace of at least
    `reduction_floats(C)` words whose tickets are zero, which the norms of one stream may share; given together, or
    None: allocated here. Returns `(out, statistics, kept)`: `statistics` the addresses of the batch's fp32 mean and
    invstd `[C]` for `run_backward`, which live in `kept`, the scratch allocated here (None where given), until
    then."""
    num_rows, channels = features.shape
    out = arrays.empty(features, (num_rows, channels))
    stream, row, kept = arrays.stream(features), 4 * channels, None
    if scratch is None:
        kept = arrays.empty_float32(features, (FORWARD_SCRATCH_ROWS, channels))
        scratch = arrays.address(kept)
        workspace = _reduction_workspace(arrays, features, 0, stream)  # freed after the launches, in stream order
        reduction = arrays.address(workspace)
    launch_forward(stream, num_rows, channels, arrays.core_dtype(features.dtype), parameter_dtype,
                   arrays.address(features), _address(arrays, residual), _address(arrays, weight),
                   _address(arrays, bias), arrays.address(running_mean), arrays.address(running_var),
                   _address(arrays, batches_tracked), momentum, eps, relu, scratch, reduction, scratch + 2 * row,
                   scratch + 3 * row, arrays.address(out))
    return out, (scratch + 2 * row, scratch + 3 * row), kept


def run_renormalise(arrays, links, residual, parameter_dtype):
    """`launch_renormalise` on a framework's arrays as `run_forward` takes them: `links` `NormLink`s of arrays
    (their statistics the addresses `run_forward` returned), all with parameters of `parameter_dtype`."""
    first = links[0].features
    num_rows, channels = first.shape
    out = arrays.empty(first, (num_rows, channels))
    launch_renormalise(arrays.stream(first), num_rows, channels, arrays.core_dtype(first.dtype), parameter_dtype,
                       [NormLink(arrays.address(link.features), _address(arrays, link.weight),
                                 _address(arrays, link.bias), link.saved_mean, link.saved_invstd, link.relu)
                        for link in links], _address(arrays, residual), arrays.address(out))
    return out


def run_backward(arrays, grad_out, features, out, statistics: tuple[int, int], weight, relu: bool,
                 with_residual: bool, parameter_dtype, parameter_grads: bool, sums: int | None = None,
                 reduction: int | None = None):
    """The backward's kernels on a framework's arrays (see `run_forward`, whose `statistics` addresses it reads;
    `out` read only with the ReLU). `sums`: the device address of fp32 `[BACKWARD_SCRATCH_ROWS, C]`, and
    `reduction` that of a reduction workspace as `run_forward` takes them; given together, or None: allocated
    here. Returns `(grad_features, grads, g)`, `grads` `[2, C]` the gradients of weight and bias in `weight`'s
    dtype (fp32 without one) where `parameter_grads`, else None, and g the masked output gradient, the residual's
    gradient."""
    num_rows, channels = features.shape
    grad_features = arrays.empty(features, (num_rows, channels))
    # g: grad_out itself without the ReLU; with it, a buffer of its own only where it is also the residual's
    # gradient, else grad_features, which the second pass overwrites element by element.
    g = grad_out if not relu else arrays.empty(features, (num_rows, channels)) if with_residual else grad_features
    stream = arrays.stream(features)
    if sums is None:
        workspace = _reduction_workspace(arrays, features, BACKWARD_SCRATCH_ROWS * channels, stream)
        reduction = arrays.address(workspace)
        sums = reduction + 4 * reduction_floats(channels)
    grads, grad_weight, grad_bias = None, 0, 0
    if parameter_grads:
        shape = (2, channels)
        grads = arrays.empty_float32(features, shape) if weight is None else arrays.empty(weight, shape)
        grad_weight = arrays.address(grads)
        grad_bias = grad_weight + channels * (4 if weight is None else arrays.core_dtype(weight.dtype).itemsize)
    launch_backward(stream, num_rows, channels, arrays.core_dtype(features.dtype), parameter_dtype,
                    arrays.address(grad_out), arrays.address(features), _address(arrays, out if relu else None),
                    _address(arrays, weight), *statistics, relu, sums, reduction, arrays.address(g),
                    arrays.address(grad_features), grad_weight, grad_bias)
    return grad_features, grads, g


def _reduction_workspace(arrays, features, extra_floats: int, stream: int):
    """A reduction workspace for `features`' channels, its tickets zeroed on `stream`, then `extra_floats` more."""
    workspace = arrays.empty_float32(features, (reduction_floats(features.shape[1]) + extra_floats,))
    cupy_module().cuda.runtime.memsetAsync(arrays.address(workspace), 0, 4 * _ticket_floats(current_device()), stream)
    return workspace


def training_batch_norm(features, running_mean, running_var, weight=None, bias=None, momentum: float = 0.1,
                        eps: float = 1e-5, *, residual=None, relu: bool = False):
    """`(out, mean, invstd)`: `relu?(batch_norm(features) (+ residual))` over the batch's statistics (the
    module docstring), the running statistics moved towards them in place by `momentum`, torch's rule.
    `features` and `residual` are `[N, C]` of one dtype, N >= 2; the statistics and `weight` / `bias` (None:
    1 and 0) are `[C]`; `mean` and `invstd` `[C]` are what `training_batch_norm_backward` takes (fp32 on the
    GPU's kernels, float64 otherwise)."""
    statistics = {"running_mean": running_mean, "running_var": running_var, "weight": weight, "bias": bias}
    check_norm_arguments(features, statistics, residual=residual)
    _check_rows(features)
    if momentum is None or not 0 <= momentum <= 1:
        raise ValueError(f"momentum must be a number in [0, 1] (torch's cumulative average, None, is not taken "
                         f"here), got {momentum!r}")
    parameter_dtype = _kernel_parameter_dtype(features, statistics.values(), (residual,))
    if parameter_dtype is None:
        return _forward_reference(features, weight, bias, running_mean, running_var, momentum, eps, residual, relu)
    out, _, scratch = run_forward(core_arrays(), features, residual, weight, bias, running_mean, running_var,
                                  momentum, eps, relu, parameter_dtype)
    return out, scratch[2], scratch[3]


def renormalise(features, mean, invstd, weight=None, bias=None, *, residual=None, relu: bool = False):
    """The `out` of the `training_batch_norm` that gave `mean` and `invstd` from `features` (with the `weight`,
    `bias`, `residual` and `relu` it had), again, with the same bits; the running statistics are not touched."""
    check_norm_arguments(features, {"weight": weight, "bias": bias, "mean": mean, "invstd": invstd},
                         residual=residual)
    parameter_dtype = _kernel_parameter_dtype(features, (weight, bias), (residual,))
    if parameter_dtype is None or any(np.dtype(array.dtype) != np.float32 or not array.flags.c_contiguous
                                      for array in (mean, invstd)):
        return _normalise_reference(features, mean, invstd, weight, bias, residual, relu)
    return run_renormalise(core_arrays(), [NormLink(features, weight, bias, mean.data.ptr, invstd.data.ptr, relu)],
                           residual, parameter_dtype)


def training_batch_norm_backward(grad_output, features, out, mean, invstd, weight=None, *, relu: bool = False,
                                 with_residual: bool = False):
    """`(grad_features, grad_weight, grad_bias, grad_residual)` of the `training_batch_norm` that gave `out`,
    `mean` and `invstd` from `features` (with `relu` as it had; `with_residual`: return the residual's
    gradient, else None). The parameters' gradients come whether or not it had them (of `weight`'s dtype, fp32
    without one, on the GPU's kernels; float64 otherwise)."""
    check_norm_arguments(features, {"weight": weight, "mean": mean, "invstd": invstd}, grad_output=grad_output,
                         out=out)
    _check_rows(features)
    parameter_dtype = _kernel_parameter_dtype(features, (weight,), (grad_output, out))
    if parameter_dtype is None or any(np.dtype(array.dtype) != np.float32 or not array.flags.c_contiguous
                                      for array in (mean, invstd)):
        return _backward_reference(grad_output, features, out, mean, invstd, weight, relu, with_residual)
    grad_features, grads, g = run_backward(core_arrays(), grad_output, features, out,
                                           (mean.data.ptr, invstd.data.ptr), weight, relu, with_residual,
                                           parameter_dtype, parameter_grads=True)
    return grad_features, grads[0], grads[1], g if with_residual else None


def _check_rows(features) -> None:
    if features.shape[0] < 2:
        raise ValueError(f"a batch norm in training needs at least 2 rows to take their variance, got "
                         f"{features.shape[0]}")


def _kernel_parameter_dtype(features, parameters, like_features):
    """The parameters' dtype where the kernels take these arrays as they are (CuPy, contiguous, dtypes of
    `kernel_runs`; fp32 where no parameter is given), else None: the reference computes them then."""
    given = [array for array in parameters if array is not None]
    arrays = [features, *given, *(array for array in like_features if array is not None)]
    if not is_cupy_array(features) or not all(array.flags.c_contiguous for array in arrays):
        return None
    dtypes = {np.dtype(array.dtype) for array in given} or {np.dtype(FLOAT32)}
    if len(dtypes) != 1:
        return None
    parameter_dtype = dtypes.pop()
    return parameter_dtype if kernel_runs(np.dtype(features.dtype), parameter_dtype, features.shape[1]) else None


def _address(arrays, array) -> int:
    return 0 if array is None else arrays.address(array)


def _forward_reference(features, weight, bias, running_mean, running_var, momentum, eps, residual, relu):
    xp = array_module(features)
    compute = np.dtype(np.float64)
    x = features.astype(compute)
    num_rows = x.shape[0]
    mean = x.mean(axis=0)
    var = ((x - mean) ** 2).mean(axis=0)
    invstd = 1 / xp.sqrt(var + compute.type(eps))
    running_mean[...] = ((1 - momentum) * running_mean.astype(compute) + momentum * mean).astype(running_mean.dtype)
    unbiased = var * num_rows / (num_rows - 1)
    running_var[...] = ((1 - momentum) * running_var.astype(compute) + momentum * unbiased).astype(running_var.dtype)
    return _normalise_reference(features, mean, invstd, weight, bias, residual, relu), mean, invstd


def _normalise_reference(features, mean, invstd, weight, bias, residual, relu):
    compute = np.dtype(np.float64)
    value = (features.astype(compute) - mean) * invstd
    if weight is not None:
        value = value * weight.astype(compute)
    if bias is not None:
        value = value + bias.astype(compute)
    if residual is not None:
        value = value + residual.astype(compute)
    if relu:
        value = array_module(features).maximum(value, 0)
    return value.astype(features.dtype)


def _backward_reference(grad_out, features, out, mean, invstd, weight, relu, with_residual):
    compute = np.dtype(np.float64)
    g = grad_out.astype(compute)
    if relu:
        g = g * (out.astype(compute) > 0)
    xhat = (features.astype(compute) - mean) * invstd
    grad_bias, grad_weight = g.sum(axis=0), (g * xhat).sum(axis=0)
    scale = invstd if weight is None else invstd * weight.astype(compute)
    grad_features = scale * (g - g.mean(axis=0) - xhat * (g * xhat).mean(axis=0))
    grad_residual = g.astype(features.dtype) if with_residual else None
    return grad_features.astype(features.dtype), grad_weight, grad_bias, grad_residual
