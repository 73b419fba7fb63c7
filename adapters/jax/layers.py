"""A small layer API without Flax: each layer is a frozen description with `init(key) -> params`
(a dict of JAX arrays) and `apply(params, x) -> SparseTensor`, so parameters stay plain pytrees
for `jax.grad` and any optimiser.

Weights are `[K, C_in, C_out]` (depthwise `[K, C]`), drawn from a He normal distribution over the
fan-in, the number of products summed into one output: `K · C_in` for a forward convolution. A
transposed convolution scatters each input to `K` outputs, so an output receives about
`K / ∏stride` offsets of each of its `C_in` channels (a 2³ stride-2 kernel: exactly one).
Biases start at zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from cupysparse.geometry.coords import as_tuple
from cupysparse.cuda.dtypes import accumulation_dtype
from cupysparse.functional.checks import positive_int

from cupysparse.adapters.jax.functional import conv, depthwise_conv
from cupysparse.adapters.jax.tensor import SparseTensor


def _check_param(params, name: str, shape: tuple, dtype) -> None:
    if not isinstance(params, dict) or name not in params:
        raise ValueError(f"params must be a dict with {name!r}, as init returns")
    value = params[name]
    if tuple(value.shape) != shape:
        raise ValueError(f"params[{name!r}] has shape {tuple(value.shape)}, this layer expects {shape}")
    if value.dtype != dtype:
        raise TypeError(f"params[{name!r}] has dtype {value.dtype}, this layer expects {jnp.dtype(dtype)}")


def _he_normal(key, shape: tuple, fan_in: float, dtype):
    return (jax.random.normal(key, shape, jnp.float32) * math.sqrt(2.0 / fan_in)).astype(dtype)


@dataclass(frozen=True)
class SparseConv:
    """A sparse convolution layer; see `functional.conv` for the arguments."""

    in_channels: int
    out_channels: int
    kernel_size: object
    stride: object = 1
    dilation: object = 1
    transposed: bool = False
    generative: bool = False
    bias: bool = True
    spatial_dims: int = 3
    dtype: object = jnp.float32
    fwd_algo: object = None
    bwd_algo: object = None
    impl: str | None = None

    def __post_init__(self):
        positive_int(self.in_channels, "in_channels")
        positive_int(self.out_channels, "out_channels")
        as_tuple(self.kernel_size, self.spatial_dims, "kernel_size")
        as_tuple(self.stride, self.spatial_dims, "stride")
        as_tuple(self.dilation, self.spatial_dims, "dilation")

    @property
    def kernel_volume(self) -> int:
        return math.prod(as_tuple(self.kernel_size, self.spatial_dims, "kernel_size"))

    @property
    def weight_shape(self) -> tuple[int, int, int]:
        return (self.kernel_volume, self.in_channels, self.out_channels)

    @property
    def fan_in(self) -> float:
        if not self.transposed:
            return self.kernel_volume * self.in_channels
        offsets_per_output = self.kernel_volume / math.prod(as_tuple(self.stride, self.spatial_dims, "stride"))
        return max(offsets_per_output, 1.0) * self.in_channels

    def init(self, key) -> dict:
        params = {"weight": _he_normal(key, self.weight_shape, self.fan_in, self.dtype)}
        if self.bias:
            params["bias"] = jnp.zeros((self.out_channels,), self.dtype)
        return params

    def apply(self, params, x: SparseTensor) -> SparseTensor:
        _check_param(params, "weight", self.weight_shape, self.dtype)
        if self.bias:
            _check_param(params, "bias", (self.out_channels,), self.dtype)
        return conv(
            x, params["weight"], self.kernel_size, self.stride, self.dilation, self.transposed, self.generative,
            params.get("bias") if self.bias else None, fwd_algo=self.fwd_algo, bwd_algo=self.bwd_algo, impl=self.impl,
        )


@dataclass(frozen=True)
class SparseDepthwiseConv:
    """A depthwise sparse convolution layer (one `[K]` filter per channel)."""

    channels: int
    kernel_size: object
    stride: object = 1
    dilation: object = 1
    bias: bool = True
    spatial_dims: int = 3
    dtype: object = jnp.float32
    fwd_algo: object = None
    bwd_algo: object = None
    impl: str | None = None

    def __post_init__(self):
        positive_int(self.channels, "channels")
        as_tuple(self.kernel_size, self.spatial_dims, "kernel_size")
        as_tuple(self.stride, self.spatial_dims, "stride")
        as_tuple(self.dilation, self.spatial_dims, "dilation")

    @property
    def weight_shape(self) -> tuple[int, int]:
        return (math.prod(as_tuple(self.kernel_size, self.spatial_dims, "kernel_size")), self.channels)

    def init(self, key) -> dict:
        params = {"weight": _he_normal(key, self.weight_shape, self.weight_shape[0], self.dtype)}
        if self.bias:
            params["bias"] = jnp.zeros((self.channels,), self.dtype)
        return params

    def apply(self, params, x: SparseTensor) -> SparseTensor:
        _check_param(params, "weight", self.weight_shape, self.dtype)
        if self.bias:
            _check_param(params, "bias", (self.channels,), self.dtype)
        return depthwise_conv(
            x, params["weight"], self.kernel_size, self.stride, self.dilation,
            bias=params.get("bias") if self.bias else None, fwd_algo=self.fwd_algo, bwd_algo=self.bwd_algo,
            impl=self.impl,
        )


@dataclass(frozen=True)
class LayerNorm:
    """Normalises each voxel's features over its channels (no batch statistics, so nothing to
    track between training and inference), then scales and shifts per channel."""

    channels: int
    eps: float = 1e-5
    dtype: object = jnp.float32

    def __post_init__(self):
        positive_int(self.channels, "channels")

    def init(self, key=None) -> dict:
        return {"scale": jnp.ones((self.channels,), self.dtype), "bias": jnp.zeros((self.channels,), self.dtype)}

    def apply(self, params, x: SparseTensor) -> SparseTensor:
        _check_param(params, "scale", (self.channels,), self.dtype)
        _check_param(params, "bias", (self.channels,), self.dtype)
        if x.num_channels != self.channels:
            raise ValueError(f"LayerNorm over {self.channels} channels got features with {x.num_channels}")
        features = x.features.astype(accumulation_dtype(x.dtype))  # statistics in fp32 for half inputs
        mean = features.mean(axis=1, keepdims=True)
        variance = jnp.square(features - mean).mean(axis=1, keepdims=True)
        normalised = ((features - mean) * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)
        return x.replace_features(normalised * params["scale"] + params["bias"])


def relu(x: SparseTensor) -> SparseTensor:
    return x.replace_features(jax.nn.relu(x.features))


__all__ = ["LayerNorm", "SparseConv", "SparseDepthwiseConv", "relu"]
