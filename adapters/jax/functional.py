"""Sparse convolutions of JAX `SparseTensor`s, the JAX counterpart of `cupysparse.functional.convolution`.

Each call looks up (or builds, while tracing) the kernel map of the input's geometry, convolves the
features with `ops`, and returns a tensor on the output geometry, which shares the map cache: a
transposed convolution returns to the coordinates its input was downsampled from. See
`cupysparse.geometry.kernel_map` for the semantics of each kind.
"""

from __future__ import annotations

import jax

from cupysparse.adapters.jax import ops
from cupysparse.adapters.jax.tensor import SparseTensor


def _check_input(input) -> None:
    if not isinstance(input, SparseTensor):
        raise TypeError(f"input must be a cupysparse.adapters.jax.SparseTensor, got {type(input).__name__}")


def _add_bias(out, bias):
    if not isinstance(bias, jax.Array):
        raise TypeError(f"bias must be a JAX array, got {type(bias).__name__}")
    if bias.dtype != out.dtype:
        raise TypeError(f"bias has dtype {bias.dtype} but the output has {out.dtype}")
    if tuple(bias.shape) != (out.shape[1],):
        raise ValueError(f"bias must have shape [{out.shape[1]}], got {tuple(bias.shape)}")
    return out + bias


def conv(
    input: SparseTensor, weight, kernel_size, stride=1, dilation=1, transposed=False, generative=False, bias=None,
    *, fwd_algo=None, bwd_algo=None, impl=None,
) -> SparseTensor:
    """Sparse convolution with weight `[K, C_in, C_out]` (and bias `[C_out]`): submanifold (stride 1),
    strided, transposed or generative transposed. `fwd_algo`, `bwd_algo`, `impl`: see `ops`."""
    _check_input(input)
    kernel_map, out_geometry = input.kernel_map(kernel_size, stride, dilation, transposed, generative)
    out = ops.sparse_conv(input.features, weight, kernel_map, fwd_algo=fwd_algo, bwd_algo=bwd_algo, impl=impl)
    return SparseTensor.on(out_geometry, out if bias is None else _add_bias(out, bias))


def depthwise_conv(
    input: SparseTensor, weight, kernel_size, stride=1, dilation=1, transposed=False, generative=False, bias=None,
    *, fwd_algo=None, bwd_algo=None, impl=None,
) -> SparseTensor:
    """Depthwise sparse convolution with weight `[K, C]` (one filter per channel) and bias `[C]`."""
    _check_input(input)
    kernel_map, out_geometry = input.kernel_map(kernel_size, stride, dilation, transposed, generative)
    out = ops.sparse_depthwise_conv(input.features, weight, kernel_map, fwd_algo=fwd_algo, bwd_algo=bwd_algo, impl=impl)
    return SparseTensor.on(out_geometry, out if bias is None else _add_bias(out, bias))


__all__ = ["conv", "depthwise_conv"]
