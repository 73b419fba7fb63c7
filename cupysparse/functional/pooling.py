"""Sparse pooling: max and average over kernel-map windows, global pooling per batch item and
nearest unpooling, forward and backward, on NumPy (CPU) or CuPy (GPU) arrays.

Low level, over a `KernelMap` (pair table `[K, N_out]`: input row or -1):
- `max_pool_forward` / `max_pool_backward`, `avg_pool_forward` / `avg_pool_backward`;
- `global_pool_forward` / `global_pool_backward` over a batch index;
- `unpool_forward` / `unpool_backward` over the transposed map of a pooling with kernel_size == stride.

High level, over `SparseTensor`: `sparse_max_pool`, `sparse_avg_pool`, `global_max_pool`,
`global_avg_pool`, `sparse_unpool`. Each has a `*_backward` taking the forward's arguments plus
`grad_output` (the gradient of the forward's output features) and, for max pooling, the forward's
`argmax` (ask the forward for it with `return_argmax=True`); it returns the gradient of the input
features. The backward looks the kernel map up in the input's map cache, so it is not rebuilt.

Semantics, identical on both backends:
- max: NaN counts as the largest value (it propagates); ties go to the first offset in kernel
  order (window pooling) or to the lowest row (global pooling); an empty window gives 0 and
  argmax -1. The gradient flows to the chosen row only.
- avg: the mean over the inputs present (absent voxels are not zeros); an empty window gives 0.
- Sums accumulate in fp32 (fp64 for fp64 features). No atomics: every output element is written
  by one GPU thread; window sums run in kernel order on both backends, global sums in a fixed
  order of row ranges, so repeated runs give identical results.
bfloat16 on the GPU needs compute capability 8.0 or newer.
"""

from __future__ import annotations

import numpy as np

from cupysparse.cuda.backend import array_module, cupy_module, is_cupy_array
from cupysparse.cuda.compile import KernelSource, launch_config
from cupysparse.geometry.coords import as_tuple
from cupysparse.cuda.dtypes import BFLOAT16, FEATURE_DTYPES, accumulation_dtype, short_name
from cupysparse.geometry.kernel_map import KernelMap
from cupysparse.geometry.sparse_tensor import SparseTensor

_KERNEL_NAMES = (
    "max_pool_forward",
    "max_pool_backward",
    "sum_pool",
    "avg_pool_backward",
    "global_max_partial",
    "global_max_finish",
    "global_avg_partial",
    "global_avg_finish",
    "global_max_backward",
    "global_avg_backward",
)
# pooling.cu names its template types after dtypes.short_name; bf16 is a module of its own because
# its rounding instruction needs sm_80, so nothing bf16 compiles for older GPUs.
_KERNELS = KernelSource("pooling.cu", tuple(f"{name}<{t}>" for name in _KERNEL_NAMES for t in ("fp64", "fp32", "fp16")))
_BF16_KERNELS = KernelSource("pooling.cu", tuple(f"{name}<bf16>" for name in _KERNEL_NAMES))

# Global pooling: (channel tile, row lanes), the block shape pooling.cu's kChannelTile/kRowLanes
# assume; each block reduces about _ROWS_PER_SPLIT rows, at most _MAX_SPLITS blocks per batch item.
_GLOBAL_POOL_BLOCK = (32, 8)
_ROWS_PER_SPLIT = 2048
_MAX_SPLITS = 256

_GLOBAL_MODES = ("max", "avg")


def _kernel(name: str, dtype):
    if dtype == BFLOAT16:
        capability = int(cupy_module().cuda.Device().compute_capability)
        if capability < 80:
            raise TypeError(f"bfloat16 pooling on the GPU needs compute capability 8.0 or newer, this GPU is sm_{capability}")
        return _BF16_KERNELS.get(f"{name}<bf16>")
    return _KERNELS.get(f"{name}<{short_name(dtype)}>")


def _launch(name: str, dtype, num_threads: int, *args) -> None:
    if num_threads:
        grid, block = launch_config(num_threads)
        _kernel(name, dtype)(grid, block, args)


# --- validation ---------------------------------------------------------------------------------


def _backend_name(array) -> str:
    return "CuPy" if is_cupy_array(array) else "NumPy"


def _check_features(array, name: str, num_rows: int | None = None, rows_owner: str = "") -> None:
    """Dtype and shape only: nothing here reads values, so nothing synchronises the GPU."""
    if not (isinstance(array, np.ndarray) or is_cupy_array(array)):
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(array).__name__}")
    if np.dtype(array.dtype) not in FEATURE_DTYPES:
        raise TypeError(f"{name} must be float64, float32, float16 or bfloat16, got {array.dtype}")
    if array.ndim != 2:
        raise ValueError(f"{name} must have shape [N, C], got {tuple(array.shape)}")
    if num_rows is not None and array.shape[0] != num_rows:
        raise ValueError(f"{name} has {array.shape[0]} rows but {rows_owner} has {num_rows}")


def _check_same_backend(reference, reference_name: str, array, name: str) -> None:
    if is_cupy_array(array) != is_cupy_array(reference):
        raise TypeError(
            f"{reference_name} and {name} must both be NumPy or both be CuPy arrays, got "
            f"{_backend_name(reference)} {reference_name} and {_backend_name(array)} {name}"
        )


def _check_kernel_map(kernel_map, features, features_name: str) -> None:
    if not isinstance(kernel_map, KernelMap):
        raise TypeError(f"kernel_map must be a KernelMap, got {type(kernel_map).__name__}")
    _check_same_backend(features, features_name, kernel_map.pair_table, "kernel_map")


def _check_int32(array, name: str, shape: tuple[int, ...], reference, reference_name: str) -> None:
    if not (isinstance(array, np.ndarray) or is_cupy_array(array)):
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(array).__name__}")
    if array.dtype != np.int32:
        raise TypeError(f"{name} must be int32, got {array.dtype}")
    if tuple(array.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(array.shape)}")
    _check_same_backend(reference, reference_name, array, name)


def _check_sparse_tensor(input) -> None:
    if not isinstance(input, SparseTensor):
        raise TypeError(f"input must be a SparseTensor, got {type(input).__name__}")


# --- CPU reference implementations (vectorised over rows and channels, a loop over offsets) ------


def _valid_pairs(table_row):
    """(positions, rows) of the valid entries of one offset's row of a pair table."""
    positions = np.flatnonzero(table_row >= 0)
    return positions, table_row[positions]


def _greater(a, b):
    """a > b elementwise with NaN above every number (pooling.cu's `greater`)."""
    return np.where(np.isnan(a), ~np.isnan(b), a > b)


def _max_pool_forward_cpu(features, table):
    accumulate = accumulation_dtype(features.dtype)
    values = features.astype(accumulate)
    num_out, channels = table.shape[1], features.shape[1]
    best = np.zeros((num_out, channels), dtype=accumulate)
    argmax = np.full((num_out, channels), -1, dtype=np.int32)
    for table_row in table:
        out_rows, sources = _valid_pairs(table_row)
        candidate, current, chosen = values[sources], best[out_rows], argmax[out_rows]
        replace = (chosen < 0) | _greater(candidate, current)
        best[out_rows] = np.where(replace, candidate, current)
        argmax[out_rows] = np.where(replace, sources[:, None], chosen)
    return best.astype(features.dtype), argmax


def _max_pool_backward_cpu(grad_output, argmax, reverse_table):
    accumulate = accumulation_dtype(grad_output.dtype)
    grad = grad_output.astype(accumulate)
    grad_in = np.zeros((reverse_table.shape[1], grad.shape[1]), dtype=accumulate)
    for table_row in reverse_table:
        in_rows, out_rows = _valid_pairs(table_row)
        grad_in[in_rows] += np.where(argmax[out_rows] == in_rows[:, None], grad[out_rows], 0)
    return grad_in.astype(grad_output.dtype)


def _sum_pool_cpu(features, table, average: bool):
    accumulate = accumulation_dtype(features.dtype)
    values = features.astype(accumulate)
    sums = np.zeros((table.shape[1], features.shape[1]), dtype=accumulate)
    for table_row in table:
        out_rows, sources = _valid_pairs(table_row)
        sums[out_rows] += values[sources]
    if average:
        counts = (table >= 0).sum(axis=0)
        nonempty = counts > 0
        sums[nonempty] /= counts[nonempty, None].astype(accumulate)
    return sums.astype(features.dtype)


def _avg_pool_backward_cpu(grad_output, table, reverse_table):
    accumulate = accumulation_dtype(grad_output.dtype)
    grad = grad_output.astype(accumulate)
    counts = (table >= 0).sum(axis=0).astype(accumulate)
    grad_in = np.zeros((reverse_table.shape[1], grad.shape[1]), dtype=accumulate)
    for table_row in reverse_table:
        in_rows, out_rows = _valid_pairs(table_row)
        grad_in[in_rows] += grad[out_rows] / counts[out_rows, None]
    return grad_in.astype(grad_output.dtype)


# --- window pooling over a kernel map ------------------------------------------------------------


def _check_window_input(features, kernel_map, name: str = "features") -> None:
    _check_kernel_map(kernel_map, features, name)
    _check_features(features, name, kernel_map.num_in, "the kernel map's input")


def max_pool_forward(features, kernel_map: KernelMap):
    """Max over each output row's window: `(out [N_out, C], argmax int32 [N_out, C])`.

    `argmax[i, c]` is the input row chosen for output i, channel c (the first offset in kernel
    order on ties; NaN counts as the largest value), or -1 with `out` 0 for an empty window.
    """
    _check_window_input(features, kernel_map)
    table = kernel_map.pair_table
    if not is_cupy_array(features):
        return _max_pool_forward_cpu(features, table)
    cupy = cupy_module()
    features = cupy.ascontiguousarray(features)
    num_out, channels = kernel_map.num_out, features.shape[1]
    out = cupy.empty((num_out, channels), dtype=features.dtype)
    argmax = cupy.empty((num_out, channels), dtype=np.int32)
    _launch(
        "max_pool_forward", features.dtype, num_out * channels,
        features, cupy.ascontiguousarray(table), np.int32(num_out), np.int32(kernel_map.kernel_volume),
        np.int32(channels), out, argmax,
    )
    return out, argmax


def max_pool_backward(grad_output, argmax, kernel_map: KernelMap):
    """Gradient of `max_pool_forward` for its input features: `[num_in, C]`.

    Takes the kernel map rather than only `num_in`: the gradient is gathered per input row through
    `kernel_map.reversed()` (input j adds `grad_output[i, c]` of the outputs i whose `argmax[i, c]`
    is j, in kernel order), which needs no atomics and so is deterministic; a scatter by `argmax`
    would need float atomics on the GPU, where several outputs share an input.
    """
    _check_kernel_map(kernel_map, grad_output, "grad_output")
    _check_features(grad_output, "grad_output", kernel_map.num_out, "the kernel map's output")
    _check_int32(argmax, "argmax", tuple(grad_output.shape), grad_output, "grad_output")
    reverse_table = kernel_map.reversed().pair_table
    if not is_cupy_array(grad_output):
        return _max_pool_backward_cpu(grad_output, argmax, reverse_table)
    cupy = cupy_module()
    num_in, channels = kernel_map.num_in, grad_output.shape[1]
    grad_in = cupy.empty((num_in, channels), dtype=grad_output.dtype)
    _launch(
        "max_pool_backward", grad_output.dtype, num_in * channels,
        cupy.ascontiguousarray(grad_output), cupy.ascontiguousarray(argmax), cupy.ascontiguousarray(reverse_table),
        np.int32(num_in), np.int32(kernel_map.kernel_volume), np.int32(channels), grad_in,
    )
    return grad_in


def _sum_pool(features, table, num_out: int, average: bool):
    """`out[i] = Σ_k features[table[k, i]]` over the valid k, divided by their number when `average`."""
    if not is_cupy_array(features):
        return _sum_pool_cpu(features, table, average)
    cupy = cupy_module()
    channels = features.shape[1]
    out = cupy.empty((num_out, channels), dtype=features.dtype)
    _launch(
        "sum_pool", features.dtype, num_out * channels,
        cupy.ascontiguousarray(features), cupy.ascontiguousarray(table), np.int32(num_out), np.int32(table.shape[0]),
        np.int32(channels), np.int32(average), out,
    )
    return out


def avg_pool_forward(features, kernel_map: KernelMap):
    """Mean over each output row's window of the inputs present: `[N_out, C]`, 0 for an empty window."""
    _check_window_input(features, kernel_map)
    return _sum_pool(features, kernel_map.pair_table, kernel_map.num_out, average=True)


def avg_pool_backward(grad_output, kernel_map: KernelMap):
    """Gradient of `avg_pool_forward` for its input features: `[num_in, C]`, gathered through
    `kernel_map.reversed()` (input j adds `grad_output[i] / count_i` of every output i it feeds)."""
    _check_kernel_map(kernel_map, grad_output, "grad_output")
    _check_features(grad_output, "grad_output", kernel_map.num_out, "the kernel map's output")
    table = kernel_map.pair_table
    reverse_table = kernel_map.reversed().pair_table
    if not is_cupy_array(grad_output):
        return _avg_pool_backward_cpu(grad_output, table, reverse_table)
    cupy = cupy_module()
    num_in, channels = kernel_map.num_in, grad_output.shape[1]
    counts = (table >= 0).sum(axis=0, dtype=np.int32)
    grad_in = cupy.empty((num_in, channels), dtype=grad_output.dtype)
    _launch(
        "avg_pool_backward", grad_output.dtype, num_in * channels,
        cupy.ascontiguousarray(grad_output), cupy.ascontiguousarray(reverse_table), counts, np.int32(num_in),
        np.int32(kernel_map.kernel_volume), np.int32(channels), grad_in,
    )
    return grad_in


# --- nearest unpooling ---------------------------------------------------------------------------


def _check_unpool_map(kernel_map) -> None:
    if not kernel_map.transposed or kernel_map.generative or kernel_map.kernel_size != kernel_map.stride:
        raise ValueError(
            "unpooling needs the transposed (not generative) map of a pooling with kernel_size == stride, "
            f"got {kernel_map!r}"
        )


def unpool_forward(features, kernel_map: KernelMap):
    """Nearest unpooling, coarse → fine: `[N_fine, C]`, each fine row a copy of its coarse parent.

    `kernel_map` is the transposed map of a pooling with kernel_size == stride (coarse input, fine
    output); a fine row without a parent (possible only for strides above 2) gets 0.
    """
    _check_window_input(features, kernel_map)
    _check_unpool_map(kernel_map)
    return _sum_pool(features, kernel_map.pair_table, kernel_map.num_out, average=False)


def unpool_backward(grad_output, kernel_map: KernelMap):
    """Gradient of `unpool_forward`: `[N_coarse, C]`, the sum of the fine gradients of each coarse
    row's children, gathered through `kernel_map.reversed()` in kernel order."""
    _check_kernel_map(kernel_map, grad_output, "grad_output")
    _check_features(grad_output, "grad_output", kernel_map.num_out, "the kernel map's output")
    _check_unpool_map(kernel_map)
    return _sum_pool(grad_output, kernel_map.reversed().pair_table, kernel_map.num_in, average=False)


# --- global pooling per batch item ---------------------------------------------------------------


def _check_batch_index(batch_index, num_rows: int | None, batch_size: int, reference, reference_name: str) -> None:
    """int32 `[num_rows]` (any length when num_rows is None) with values in [0, batch_size)."""
    if num_rows is None:
        num_rows = batch_index.shape[0] if getattr(batch_index, "ndim", None) == 1 else -1
    _check_int32(batch_index, "batch_index", (num_rows,), reference, reference_name)
    # On the GPU the values stay unchecked (that would synchronise): rows outside 0..batch_size-1
    # are left out of the forward and get a zero gradient.
    if not is_cupy_array(batch_index) and num_rows:
        low, high = int(batch_index.min()), int(batch_index.max())
        if low < 0 or high >= batch_size:
            raise ValueError(f"batch_index must lie in [0, {batch_size}) (batch_size), got values in [{low}, {high}]")


def _check_mode(mode) -> None:
    if mode not in _GLOBAL_MODES:
        raise ValueError(f"mode must be one of {_GLOBAL_MODES}, got {mode!r}")


def _check_batch_size(batch_size) -> None:
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 0:
        raise ValueError(f"batch_size must be a non-negative int, got {batch_size!r}")


def _batch_segments(batch_index, batch_size: int):
    """(order, start): the rows sorted by (batch, row), and where each batch item's rows begin
    in that order (int32 `[batch_size + 1]`), without a device synchronisation."""
    xp = array_module(batch_index)
    num_rows = batch_index.shape[0]
    order = xp.argsort(batch_index.astype(np.int64) * num_rows + xp.arange(num_rows, dtype=np.int64))
    start = xp.searchsorted(batch_index[order], xp.arange(batch_size + 1, dtype=np.int32))
    return order.astype(np.int32), start.astype(np.int32)


def _global_pool_cpu(features, batch_index, batch_size: int, mode: str):
    accumulate = accumulation_dtype(features.dtype)
    values = features.astype(accumulate)
    channels = features.shape[1]
    out = np.zeros((batch_size, channels), dtype=accumulate)
    argmax = np.full((batch_size, channels), -1, dtype=np.int32)
    order, start = _batch_segments(batch_index, batch_size)
    for batch in range(batch_size):
        rows = order[start[batch] : start[batch + 1]]
        if rows.size == 0:
            continue
        if mode == "max":
            # Rows ascend, and argmax takes the first maximum with NaN above every number.
            argmax[batch] = rows[np.argmax(values[rows], axis=0)]
            out[batch] = values[argmax[batch], np.arange(channels)]
        else:
            out[batch] = values[rows].sum(axis=0) / accumulate.type(rows.size)
    return out.astype(features.dtype), argmax


def _global_pool_gpu(features, batch_index, batch_size: int, mode: str):
    cupy = cupy_module()
    features = cupy.ascontiguousarray(features)
    num_rows, channels = features.shape
    accumulate = accumulation_dtype(features.dtype)
    if num_rows == 0 or channels == 0:  # nothing to reduce: zeros (a memset) and argmax -1
        argmax = cupy.full((batch_size, channels), -1, dtype=np.int32) if mode == "max" else None
        return cupy.zeros((batch_size, channels), dtype=features.dtype), argmax
    out = cupy.empty((batch_size, channels), dtype=features.dtype)
    argmax = cupy.empty((batch_size, channels), dtype=np.int32) if mode == "max" else None
    if batch_size == 0:
        return out, argmax
    order, start = _batch_segments(batch_index, batch_size)
    num_splits = min(_MAX_SPLITS, max(1, -(-num_rows // (batch_size * _ROWS_PER_SPLIT))))
    num_tiles = -(-channels // _GLOBAL_POOL_BLOCK[0])
    partial_grid = (num_tiles * num_splits * batch_size,)
    partial_value = cupy.empty((batch_size, num_splits, channels), dtype=accumulate)
    finish_grid, finish_block = launch_config(batch_size * channels)
    sizes = (np.int32(batch_size), np.int32(num_splits), np.int32(channels))
    if mode == "max":
        partial_row = cupy.empty((batch_size, num_splits, channels), dtype=np.int32)
        _kernel("global_max_partial", features.dtype)(
            partial_grid, _GLOBAL_POOL_BLOCK,
            (features, order, start, np.int32(channels), np.int32(num_splits), partial_value, partial_row),
        )
        _kernel("global_max_finish", features.dtype)(
            finish_grid, finish_block, (features, partial_value, partial_row, *sizes, out, argmax)
        )
    else:
        _kernel("global_avg_partial", features.dtype)(
            partial_grid, _GLOBAL_POOL_BLOCK, (features, order, start, np.int32(channels), np.int32(num_splits), partial_value)
        )
        _kernel("global_avg_finish", features.dtype)(finish_grid, finish_block, (partial_value, start, *sizes, out))
    return out, argmax


def global_pool_forward(features, batch_index, batch_size: int, mode: str):
    """Max or mean over the rows of each batch item: `(out [B, C], argmax)`.

    `batch_index` int32 `[N]` gives each row's batch item, 0..batch_size-1. For "max", `argmax`
    int32 `[B, C]` is the row chosen (the lowest row on ties, NaN counting as the largest value);
    for "avg" it is None. A batch item without rows gives 0 (and argmax -1).
    """
    _check_mode(mode)
    _check_batch_size(batch_size)
    _check_features(features, "features")
    _check_batch_index(batch_index, features.shape[0], batch_size, features, "features")
    if not is_cupy_array(features):
        out, argmax = _global_pool_cpu(features, batch_index, batch_size, mode)
        return out, argmax if mode == "max" else None
    return _global_pool_gpu(features, batch_index, batch_size, mode)


def global_pool_backward(grad_output, batch_index, mode: str, argmax=None):
    """Gradient of `global_pool_forward` for its features: `[N, C]` with N = len(batch_index).

    `grad_output` is `[B, C]`; "max" needs the forward's `argmax` (the gradient goes to the chosen
    row), "avg" divides each batch item's gradient evenly over its rows.
    """
    _check_mode(mode)
    _check_features(grad_output, "grad_output")
    batch_size, channels = grad_output.shape
    _check_batch_index(batch_index, None, batch_size, grad_output, "grad_output")
    num_rows = batch_index.shape[0]
    if mode == "max":
        if argmax is None:
            raise ValueError("mode='max' needs the argmax returned by global_pool_forward")
        _check_int32(argmax, "argmax", (batch_size, channels), grad_output, "grad_output")
    xp = array_module(grad_output)
    if not is_cupy_array(grad_output):
        accumulate = accumulation_dtype(grad_output.dtype)
        grad = grad_output.astype(accumulate)[batch_index]
        if mode == "max":
            chosen = argmax[batch_index] == np.arange(num_rows, dtype=np.int32)[:, None]
            return np.where(chosen, grad, 0).astype(grad_output.dtype)
        counts = np.bincount(batch_index, minlength=batch_size).astype(accumulate)
        return (grad / counts[batch_index, None]).astype(grad_output.dtype)
    grad_output, batch_index = xp.ascontiguousarray(grad_output), xp.ascontiguousarray(batch_index)
    grad_in = xp.empty((num_rows, channels), dtype=grad_output.dtype)
    sizes = (np.int32(num_rows), np.int32(batch_size), np.int32(channels))
    if mode == "max":
        _launch("global_max_backward", grad_output.dtype, num_rows * channels,
                grad_output, xp.ascontiguousarray(argmax), batch_index, *sizes, grad_in)
    else:
        counts = xp.diff(xp.searchsorted(xp.sort(batch_index), xp.arange(batch_size + 1, dtype=np.int32)))
        _launch("global_avg_backward", grad_output.dtype, num_rows * channels,
                grad_output, counts.astype(np.int32), batch_index, *sizes, grad_in)
    return grad_in


# --- over SparseTensor ---------------------------------------------------------------------------


def _output_tensor(result, features) -> SparseTensor:
    return SparseTensor(
        result.out_coordinates, features, result.out_tensor_stride, validate=False, map_cache=result.out_map_cache
    )


def _pool_map(input, kernel_size, stride, dilation):
    _check_sparse_tensor(input)
    return input.kernel_map(kernel_size, kernel_size if stride is None else stride, dilation)


def sparse_max_pool(input: SparseTensor, kernel_size, stride=None, dilation=1, *, return_argmax=False):
    """Max pooling: a SparseTensor at the coarser stride (`stride` defaults to `kernel_size`).

    With `return_argmax=True` returns `(output, argmax)`; keep `argmax` for
    `sparse_max_pool_backward`.
    """
    result = _pool_map(input, kernel_size, stride, dilation)
    out, argmax = max_pool_forward(input.features, result.kernel_map)
    output = _output_tensor(result, out)
    return (output, argmax) if return_argmax else output


def sparse_max_pool_backward(input: SparseTensor, grad_output, argmax, kernel_size, stride=None, dilation=1):
    """Gradient of `sparse_max_pool` for `input.features`, given the gradient of the output's
    features and the forward's `argmax`."""
    result = _pool_map(input, kernel_size, stride, dilation)
    return max_pool_backward(grad_output, argmax, result.kernel_map)


def sparse_avg_pool(input: SparseTensor, kernel_size, stride=None, dilation=1) -> SparseTensor:
    """Average pooling over the voxels present: a SparseTensor at the coarser stride."""
    result = _pool_map(input, kernel_size, stride, dilation)
    return _output_tensor(result, avg_pool_forward(input.features, result.kernel_map))


def sparse_avg_pool_backward(input: SparseTensor, grad_output, kernel_size, stride=None, dilation=1):
    """Gradient of `sparse_avg_pool` for `input.features`."""
    result = _pool_map(input, kernel_size, stride, dilation)
    return avg_pool_backward(grad_output, result.kernel_map)


def _batch_index(input: SparseTensor):
    return array_module(input.coordinates).ascontiguousarray(input.coordinates[:, 0])


def global_max_pool(input: SparseTensor, *, return_argmax=False):
    """Per batch item maximum: `[B, C]`, or `([B, C], argmax)` with `return_argmax=True` (keep
    `argmax` for `global_max_pool_backward`)."""
    _check_sparse_tensor(input)
    out, argmax = global_pool_forward(input.features, _batch_index(input), input.batch_size, "max")
    return (out, argmax) if return_argmax else out


def global_max_pool_backward(input: SparseTensor, grad_output, argmax):
    """Gradient of `global_max_pool` for `input.features`, given the gradient `[B, C]` of its output."""
    _check_sparse_tensor(input)
    return global_pool_backward(grad_output, _batch_index(input), "max", argmax)


def global_avg_pool(input: SparseTensor):
    """Per batch item mean: `[B, C]`."""
    _check_sparse_tensor(input)
    return global_pool_forward(input.features, _batch_index(input), input.batch_size, "avg")[0]


def global_avg_pool_backward(input: SparseTensor, grad_output):
    """Gradient of `global_avg_pool` for `input.features`, given the gradient `[B, C]` of its output."""
    _check_sparse_tensor(input)
    return global_pool_backward(grad_output, _batch_index(input), "avg")


def _unpool_map(input, stride):
    _check_sparse_tensor(input)
    strides = as_tuple(stride, input.spatial_dims, "stride")
    if any(s > 2 for s in strides):
        # Kernel offsets are centred (-1..1 for size 3), so only for sizes 1 and 2 does the
        # kernel_size == stride map give every fine voxel its parent floor(p / stride).
        raise ValueError(f"sparse_unpool supports strides of 1 or 2 per axis, got {stride!r}; unpool in steps of 2")
    return input.kernel_map(strides, strides, transposed=True)


def sparse_unpool(input: SparseTensor, stride) -> SparseTensor:
    """Nearest unpooling: every voxel of the finer tensor `input` was pooled from (stride
    `input.tensor_stride / stride`) gets the features of its coarse parent."""
    result = _unpool_map(input, stride)
    return _output_tensor(result, unpool_forward(input.features, result.kernel_map))


def sparse_unpool_backward(input: SparseTensor, grad_output, stride):
    """Gradient of `sparse_unpool` for `input.features`: the sum over each coarse voxel's children."""
    result = _unpool_map(input, stride)
    return unpool_backward(grad_output, result.kernel_map)
