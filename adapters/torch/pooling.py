"""Pooling of torch `SparseTensor`s: the functions and their `torch.nn` modules.

Pooling is written in torch operations over the map's pair table, so autograd, `torch.compile` and CUDA
graphs handle it like any torch code.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cupysparse.geometry.coords import as_tuple

from cupysparse.adapters.torch.convolution import pair_table
from cupysparse.adapters.torch.tensor import SparseTensor, require_sparse


def _gathered(features: torch.Tensor, table: torch.Tensor, fill: float) -> torch.Tensor:
    """`[K, N_out, C]`: the input row of each pair, `fill` where an offset has none."""
    valid = (table >= 0).unsqueeze(-1)
    return torch.where(valid, features[table.clamp(min=0).long()], fill)


def _pool_map(input: SparseTensor, kernel_size, stride, dilation):
    require_sparse(input)
    return input.kernel_map(kernel_size, kernel_size if stride is None else stride, dilation)


def sparse_max_pool(input: SparseTensor, kernel_size, stride=None, dilation=1) -> SparseTensor:
    """Maximum over each window's voxels (`stride` defaults to `kernel_size`). Where several
    inputs tie for the maximum, the gradient is shared among them, as in `torch.amax`."""
    result = _pool_map(input, kernel_size, stride, dilation)
    table = pair_table(result.kernel_map)
    return input.with_map_result(result, _gathered(input.features, table, -math.inf).amax(dim=0))


def sparse_avg_pool(input: SparseTensor, kernel_size, stride=None, dilation=1) -> SparseTensor:
    """Mean over each window's voxels (`stride` defaults to `kernel_size`)."""
    result = _pool_map(input, kernel_size, stride, dilation)
    table = pair_table(result.kernel_map)
    counts = (table >= 0).sum(dim=0).clamp(min=1).unsqueeze(-1).to(input.features.dtype)
    return input.with_map_result(result, _gathered(input.features, table, 0.0).sum(dim=0) / counts)


def sparse_unpool(input: SparseTensor, stride) -> SparseTensor:
    """Nearest unpooling: every voxel of the finer tensor `input` was pooled from gets its coarse
    parent's features (strides 1 or 2 per axis, as `cupysparse.functional.pooling.sparse_unpool`)."""
    require_sparse(input)
    strides = as_tuple(stride, input.spatial_dims, "stride")
    if any(s > 2 for s in strides):
        raise ValueError(f"sparse_unpool supports strides of 1 or 2 per axis, got {stride!r}; unpool in steps of 2")
    result = input.kernel_map(strides, strides, transposed=True)
    table = pair_table(result.kernel_map)
    return input.with_map_result(result, _gathered(input.features, table, 0.0).sum(dim=0))


def _batch_index(input: SparseTensor) -> torch.Tensor:
    return input.coordinates[:, 0].long()


def global_max_pool(input: SparseTensor) -> torch.Tensor:
    """Per batch item maximum: `[B, C]`."""
    require_sparse(input)
    features = input.features
    out = features.new_full((input.batch_size, features.shape[1]), -math.inf)
    index = _batch_index(input).unsqueeze(1).expand_as(features)
    return out.scatter_reduce(0, index, features, reduce="amax", include_self=False)


def global_avg_pool(input: SparseTensor) -> torch.Tensor:
    """Per batch item mean: `[B, C]`."""
    require_sparse(input)
    features = input.features
    out = features.new_zeros((input.batch_size, features.shape[1]))
    index = _batch_index(input).unsqueeze(1).expand_as(features)
    return out.scatter_reduce(0, index, features, reduce="mean", include_self=False)


class SparseMaxPool(nn.Module):
    def __init__(self, kernel_size, stride=None, dilation=1):
        super().__init__()
        # Kept as given: the input's dimensions, which settle how many ints each needs, come at each call.
        as_tuple(kernel_size, None, "kernel_size")
        if stride is not None:
            as_tuple(stride, None, "stride")
        as_tuple(dilation, None, "dilation")
        self.kernel_size, self.stride, self.dilation = kernel_size, stride, dilation

    def forward(self, input: SparseTensor) -> SparseTensor:
        return sparse_max_pool(input, self.kernel_size, self.stride, self.dilation)


class SparseAvgPool(SparseMaxPool):
    def forward(self, input: SparseTensor) -> SparseTensor:
        return sparse_avg_pool(input, self.kernel_size, self.stride, self.dilation)


class SparseUnpool(nn.Module):
    def __init__(self, stride):
        super().__init__()
        as_tuple(stride, None, "stride")  # kept as given, as `SparseMaxPool`'s arguments
        self.stride = stride

    def forward(self, input: SparseTensor) -> SparseTensor:
        return sparse_unpool(input, self.stride)


class GlobalMaxPool(nn.Module):
    """`[B, C]`: the maximum of each batch item's features."""

    def forward(self, input: SparseTensor) -> torch.Tensor:
        return global_max_pool(input)


class GlobalAvgPool(nn.Module):
    """`[B, C]`: the mean of each batch item's features."""

    def forward(self, input: SparseTensor) -> torch.Tensor:
        return global_avg_pool(input)
