"""The phases of a sparse convolution in pure `jax.numpy`: the CPU path, and one XLA compiles anywhere.

For a pair table `[K, N_out]` (input row, or -1), offset by offset (`lax.scan`, so only one
gathered block `[N_out, C]` is alive at a time):
- forward `out[i] = Σ_k W_kᵀ · x[table[k, i]]`;
- dgrad: the forward over the reversed table `[K, N_in]` with each `W_k` transposed;
- wgrad `dW_k = Σ_i x[table[k, i]]ᵀ · dy[i]`.
Depthwise replaces the matrix products by per-channel ones. Missing pairs (-1) become index
N_in, one past the end, where `take(mode="fill")` reads zeros (it would wrap -1 to the last row).
Sums run in fp32 for half inputs, fp64 for fp64, at full matmul precision (no TF32 on a GPU).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from cupysparse.cuda.backend import to_numpy
from cupysparse.cuda.dtypes import accumulation_dtype

_PRECISION = lax.Precision.HIGHEST


def _rows(pair_table, num_in: int) -> np.ndarray:
    table = to_numpy(pair_table)
    return np.where(table >= 0, table, num_in).astype(np.int32)


def _gather(x, rows):
    return jnp.take(x, rows, axis=0, mode="fill", fill_value=0)


def _gather_matmul(x, weight, rows):
    """`out[i] = Σ_k weight[k]ᵀ · x[rows[k, i]]` → `[N_out, C_out]`."""
    wide = accumulation_dtype(x.dtype)

    def add_offset(total, offset):
        rows_k, weight_k = offset
        product = jnp.matmul(_gather(x, rows_k), weight_k, precision=_PRECISION, preferred_element_type=wide)
        return total + product, None

    total, _ = lax.scan(add_offset, jnp.zeros((rows.shape[1], weight.shape[2]), wide), (jnp.asarray(rows), weight))
    return total.astype(x.dtype)


def _gather_outer(x, dy, rows):
    """`dW[k] = Σ_i x[rows[k, i]]ᵀ · dy[i]` → `[K, C_in, C_out]`."""
    wide = accumulation_dtype(x.dtype)

    def offset_gradient(carry, rows_k):
        return carry, jnp.matmul(_gather(x, rows_k).T, dy, precision=_PRECISION, preferred_element_type=wide)

    _, per_offset = lax.scan(offset_gradient, None, jnp.asarray(rows))
    return per_offset.astype(x.dtype)


def _gather_scale(x, weight, rows):
    """Depthwise `out[i, c] = Σ_k weight[k, c] · x[rows[k, i], c]` → `[N_out, C]`."""
    wide = accumulation_dtype(x.dtype)

    def add_offset(total, offset):
        rows_k, weight_k = offset
        return total + _gather(x, rows_k).astype(wide) * weight_k.astype(wide), None

    total, _ = lax.scan(add_offset, jnp.zeros((rows.shape[1], x.shape[1]), wide), (jnp.asarray(rows), weight))
    return total.astype(x.dtype)


def _gather_product_sum(x, dy, rows):
    """Depthwise `dw[k, c] = Σ_i x[rows[k, i], c] · dy[i, c]` → `[K, C]`."""
    wide = accumulation_dtype(x.dtype)

    def offset_gradient(carry, rows_k):
        return carry, (_gather(x, rows_k).astype(wide) * dy.astype(wide)).sum(axis=0)

    _, per_offset = lax.scan(offset_gradient, None, jnp.asarray(rows))
    return per_offset.astype(x.dtype)


def forward(features, weight, kernel_map, depthwise: bool):
    rows = _rows(kernel_map.pair_table, kernel_map.num_in)
    return (_gather_scale if depthwise else _gather_matmul)(features, weight, rows)


def backward(grad_output, features, weight, kernel_map, depthwise: bool):
    """(input gradient, weight gradient)."""
    rows = _rows(kernel_map.pair_table, kernel_map.num_in)
    reverse_rows = _rows(kernel_map.reversed().pair_table, kernel_map.num_out)
    if depthwise:
        return _gather_scale(grad_output, weight, reverse_rows), _gather_product_sum(features, grad_output, rows)
    transposed = jnp.swapaxes(weight, 1, 2)
    return _gather_matmul(grad_output, transposed, reverse_rows), _gather_outer(features, grad_output, rows)
