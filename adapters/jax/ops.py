"""Sparse convolutions of JAX arrays over a kernel map: differentiable (`jax.custom_vjp`), jittable.

The kernel map is static: built in Python from concrete coordinates (`tensor.Geometry`), closed
over, never traced. Two implementations compute the three phases (forward; dgrad, the forward
over the reversed map with the weights transposed; wgrad):
- `"core"`: the core's autotuned algorithms (`cupysparse.functional`) through `callback.call`:
  CuPy raw kernels on XLA's stream when the map is on the GPU, NumPy when it is on the CPU;
- `"jnp"`: gathers and matrix products in `jax.numpy` (`jnp_ops`), compiled by XLA.
`impl=None` picks `"core"` for a map on the GPU and `"jnp"` for one on the CPU. `fwd_algo` /
`bwd_algo` are the core's algorithm search spaces (see `cupysparse.functional.convolution`); `"jnp"` has none.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax

from cupysparse.functional import checks, convolution
from cupysparse.tuning.search_space import parse_algorithm_filter
from cupysparse.algorithms import CONV, DEPTHWISE
from cupysparse.cuda.backend import is_cupy_array
from cupysparse.geometry.kernel_map import KernelMap

from cupysparse.adapters.jax import callback, jnp_ops
from cupysparse.adapters.jax.tensor import check_features

IMPLEMENTATIONS = ("core", "jnp")


@dataclass(frozen=True, eq=False)
class _Conv:
    """What is static about one convolution: the map, the kind, the implementation, the algorithms."""

    kernel_map: KernelMap
    depthwise: bool
    impl: str
    fwd_algo: object
    bwd_algo: object

    @property
    def on_gpu(self) -> bool:
        return is_cupy_array(self.kernel_map.pair_table)


def sparse_conv(features, weight, kernel_map: KernelMap, *, fwd_algo=None, bwd_algo=None, impl=None):
    """`out[i] = Σ_k W_kᵀ · features[table[k, i]]` → `[N_out, C_out]`, weight `[K, C_in, C_out]`."""
    spec = _spec(kernel_map, False, impl, fwd_algo, bwd_algo)
    check_features(features, kernel_map.num_in)
    _check_weight(weight, features, kernel_map)
    return _conv(spec, features, weight)


def sparse_depthwise_conv(features, weight, kernel_map: KernelMap, *, fwd_algo=None, bwd_algo=None, impl=None):
    """`out[i, c] = Σ_k w[k, c] · features[table[k, i], c]` → `[N_out, C]`, weight `[K, C]`."""
    spec = _spec(kernel_map, True, impl, fwd_algo, bwd_algo)
    check_features(features, kernel_map.num_in)
    _check_same_dtype(weight, features)
    expected = (kernel_map.kernel_volume, features.shape[1])
    if tuple(weight.shape) != expected:
        raise ValueError(f"weight must have shape [K={expected[0]}, C={expected[1]}], got {tuple(weight.shape)}")
    return _conv(spec, features, weight)


def _spec(kernel_map, depthwise: bool, impl, fwd_algo, bwd_algo) -> _Conv:
    if not isinstance(kernel_map, KernelMap):
        raise TypeError(f"kernel_map must be a cupysparse KernelMap, got {type(kernel_map).__name__}")
    if impl is None:
        impl = "core" if is_cupy_array(kernel_map.pair_table) else "jnp"
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {IMPLEMENTATIONS} or None, got {impl!r}")
    kind = DEPTHWISE if depthwise else CONV
    parse_algorithm_filter(fwd_algo, kind, "forward")  # a typo raises now, not inside the computation
    parse_algorithm_filter(bwd_algo, kind, "backward")
    spec = _Conv(kernel_map, depthwise, impl, fwd_algo, bwd_algo)
    if impl == "core" and spec.on_gpu:
        kernel_map.derive_formats()  # the formats' host synchronisations happen here, not in the callbacks
    return spec


def _check_same_dtype(weight, features) -> None:
    if not isinstance(weight, jax.Array):
        raise TypeError(f"weight must be a JAX array, got {type(weight).__name__}")
    if weight.dtype != features.dtype:
        raise TypeError(f"weight has dtype {weight.dtype} but features has {features.dtype}; cast one of them")


def _check_weight(weight, features, kernel_map: KernelMap) -> None:
    _check_same_dtype(weight, features)
    checks.check_weight_shape(tuple(weight.shape), features.shape[1], kernel_map, "features")


def _out_channels(spec: _Conv, weight) -> int:
    return weight.shape[1] if spec.depthwise else weight.shape[2]


def _core_forward(spec: _Conv, features, weight):
    if spec.depthwise:
        out = convolution.spatially_sparse_depthwise_conv(
            features, weight, spec.kernel_map, spec.kernel_map.num_out, spec.fwd_algo, spec.bwd_algo
        )
    else:
        out = convolution.conv_forward(features, weight, spec.kernel_map, spec.fwd_algo)
    return (out,)


def _core_backward(spec: _Conv, grad_output, features, weight):
    if spec.depthwise:
        return convolution.spatially_sparse_depthwise_conv_backward(
            grad_output, features, weight, spec.kernel_map, spec.bwd_algo
        )
    return convolution.conv_backward(grad_output, features, weight, spec.kernel_map, spec.bwd_algo)


def _forward(spec: _Conv, features, weight):
    if spec.impl == "jnp":
        return jnp_ops.forward(features, weight, spec.kernel_map, spec.depthwise)
    result = jax.ShapeDtypeStruct((spec.kernel_map.num_out, _out_channels(spec, weight)), features.dtype)
    compute = functools.partial(_core_forward, spec)
    (out,) = callback.call(compute, (result,), features, weight, map_on_gpu=spec.on_gpu)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv(spec: _Conv, features, weight):
    return _forward(spec, features, weight)


def _conv_fwd(spec: _Conv, features, weight):
    return _forward(spec, features, weight), (features, weight)


def _conv_bwd(spec: _Conv, residuals, grad_output):
    features, weight = residuals
    if spec.impl == "jnp":
        return jnp_ops.backward(grad_output, features, weight, spec.kernel_map, spec.depthwise)
    results = (jax.ShapeDtypeStruct(features.shape, features.dtype), jax.ShapeDtypeStruct(weight.shape, weight.dtype))
    compute = functools.partial(_core_backward, spec)
    return tuple(callback.call(compute, results, grad_output, features, weight, map_on_gpu=spec.on_gpu))


_conv.defvjp(_conv_fwd, _conv_bwd)


__all__ = ["IMPLEMENTATIONS", "sparse_conv", "sparse_depthwise_conv"]
