"""Differentiable sparse convolutions and pooling of torch `SparseTensor`s.

Convolutions go through the custom ops (`ops`); pooling is written in torch operations over the
map's pair table, so autograd, `torch.compile` and CUDA graphs handle it like any torch code.
Under autocast a convolution runs in the autocast dtype, as torch's own convolutions do.
"""

from __future__ import annotations

import functools
import math

import torch

from cupysparse.algorithms import CONV, DEPTHWISE
from cupysparse.geometry.coords import as_tuple
from cupysparse.tuning.plans import algorithm_argument

from cupysparse.adapters.torch import ops
from cupysparse.adapters.torch.tensor import SparseTensor


def _require_sparse(input) -> None:
    if not isinstance(input, SparseTensor):
        raise TypeError(f"input must be a cupysparse.adapters.torch.SparseTensor, got {type(input).__name__}")


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


def _output(result, features: torch.Tensor, input: SparseTensor) -> SparseTensor:
    return input.with_map_result(result, features)


def sparse_conv(input: SparseTensor, weight: torch.Tensor, kernel_size, stride=1, dilation=1, transposed=False,
                generative=False, bias: torch.Tensor | None = None, fwd_algo=None, bwd_algo=None) -> SparseTensor:
    """`cupysparse.spatially_sparse_conv` for torch: weight `[K, C_in, C_out]`, bias `[C_out]`.

    A 1^D kernel at stride 1 (the projections of residual blocks, classifiers) maps each voxel to
    itself. Where there is something to differentiate, on the CPU and under `torch.compile`, it runs as
    one matrix product in torch, with no kernel map and no algorithm to choose. Inference on a GPU runs
    it over its identity map on the library's kernels, as the framework-free network does: as fast in
    MinkUNet18 inference, within run-to-run noise, and a process's first call then loads no cuBLAS
    kernel, which the prefetch (`cupysparse.networks.prefetch`) could not load ahead (notes/tuner_performance.md)."""
    _require_sparse(input)
    features, weight = _autocast(input.features, weight)
    _check_like_features(weight, "weight", features)
    _check_contiguous(features)
    if (not generative and _is_pointwise(kernel_size, stride, input.spatial_dims)
            and not _runs_on_our_kernels(features, weight, bias)):
        algorithm_argument(fwd_algo, CONV, "forward")  # checked all the same: a typo is an error
        algorithm_argument(bwd_algo, CONV, "backward")
        if weight.dim() != 3 or weight.shape[0] != 1 or weight.shape[1] != features.shape[1]:
            raise ValueError(f"weight must have shape [K=1, C_in={features.shape[1]}, C_out], got "
                             f"{tuple(weight.shape)}")
        if bias is None:
            return input.replace_feature(torch.mm(features, weight[0]))
        # One launch where torch hands the bias to cuBLASLt's epilogue, not a product and then a sum.
        return input.replace_feature(torch.addmm(bias.to(features.dtype), features, weight[0]))
    result = input.kernel_map(kernel_size, stride, dilation, transposed, generative)
    kernel_map = result.kernel_map
    if weight.dim() != 3 or weight.shape[0] != kernel_map.kernel_volume or weight.shape[1] != features.shape[1]:
        raise ValueError(f"weight must have shape [K={kernel_map.kernel_volume}, C_in={features.shape[1]}, C_out], "
                         f"got {tuple(weight.shape)}")
    out = ops.map_convolution(
        features, weight.contiguous(), kernel_map,
        algorithm_argument(fwd_algo, CONV, "forward"), algorithm_argument(bwd_algo, CONV, "backward"),
    )
    if bias is not None:
        out = out + bias.to(out.dtype)
    return _output(result, out, input)


def _runs_on_our_kernels(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether a 1^D convolution runs over its map (see `sparse_conv`): inference on a GPU, not compiling."""
    if not features.is_cuda or torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and (features.requires_grad or weight.requires_grad
                                             or (bias is not None and bias.requires_grad)))


def _is_pointwise(kernel_size, stride, spatial_dims: int) -> bool:
    try:  # a layer asks with the same arguments every call
        return _is_pointwise_geometry(kernel_size, stride, spatial_dims)
    except TypeError:  # unhashable (lists): checked without the memo
        return _is_pointwise_geometry.__wrapped__(kernel_size, stride, spatial_dims)


@functools.lru_cache(maxsize=256)
def _is_pointwise_geometry(kernel_size, stride, spatial_dims: int) -> bool:
    return (all(k == 1 for k in as_tuple(kernel_size, spatial_dims, "kernel_size"))
            and all(s == 1 for s in as_tuple(stride, spatial_dims, "stride")))


def sparse_depthwise_conv(input: SparseTensor, weight: torch.Tensor, kernel_size, stride=1, dilation=1,
                          transposed=False, bias: torch.Tensor | None = None, fwd_algo=None,
                          bwd_algo=None) -> SparseTensor:
    """A per-channel convolution: weight `[K, C]`."""
    _require_sparse(input)
    features, weight = _autocast(input.features, weight)
    _check_like_features(weight, "weight", features)
    _check_contiguous(features)
    result = input.kernel_map(kernel_size, stride, dilation, transposed)
    kernel_map = result.kernel_map
    if tuple(weight.shape) != (kernel_map.kernel_volume, features.shape[1]):
        raise ValueError(f"depthwise weight must have shape [K={kernel_map.kernel_volume}, C={features.shape[1]}], "
                         f"got {tuple(weight.shape)}")
    out = ops.depthwise_forward(
        features, weight.contiguous(), ops.pair_table(kernel_map),
        algorithm_argument(fwd_algo, DEPTHWISE, "forward"), algorithm_argument(bwd_algo, DEPTHWISE, "backward"),
    )
    if bias is not None:
        out = out + bias.to(out.dtype)
    return _output(result, out, input)


def _gathered(features: torch.Tensor, table: torch.Tensor, fill: float) -> torch.Tensor:
    """`[K, N_out, C]`: the input row of each pair, `fill` where an offset has none."""
    valid = (table >= 0).unsqueeze(-1)
    return torch.where(valid, features[table.clamp(min=0).long()], fill)


def _pool_map(input: SparseTensor, kernel_size, stride, dilation):
    _require_sparse(input)
    return input.kernel_map(kernel_size, kernel_size if stride is None else stride, dilation)


def sparse_max_pool(input: SparseTensor, kernel_size, stride=None, dilation=1) -> SparseTensor:
    """Maximum over each window's voxels (`stride` defaults to `kernel_size`). Where several
    inputs tie for the maximum, the gradient is shared among them, as in `torch.amax`."""
    result = _pool_map(input, kernel_size, stride, dilation)
    table = ops.pair_table(result.kernel_map)
    return _output(result, _gathered(input.features, table, -math.inf).amax(dim=0), input)


def sparse_avg_pool(input: SparseTensor, kernel_size, stride=None, dilation=1) -> SparseTensor:
    """Mean over each window's voxels (`stride` defaults to `kernel_size`)."""
    result = _pool_map(input, kernel_size, stride, dilation)
    table = ops.pair_table(result.kernel_map)
    counts = (table >= 0).sum(dim=0).clamp(min=1).unsqueeze(-1).to(input.features.dtype)
    return _output(result, _gathered(input.features, table, 0.0).sum(dim=0) / counts, input)


def sparse_unpool(input: SparseTensor, stride) -> SparseTensor:
    """Nearest unpooling: every voxel of the finer tensor `input` was pooled from gets its coarse
    parent's features (strides 1 or 2 per axis, as `cupysparse.functional.pooling.sparse_unpool`)."""
    _require_sparse(input)
    strides = as_tuple(stride, input.spatial_dims, "stride")
    if any(s > 2 for s in strides):
        raise ValueError(f"sparse_unpool supports strides of 1 or 2 per axis, got {stride!r}; unpool in steps of 2")
    result = input.kernel_map(strides, strides, transposed=True)
    table = ops.pair_table(result.kernel_map)
    return _output(result, _gathered(input.features, table, 0.0).sum(dim=0), input)


def _batch_index(input: SparseTensor) -> torch.Tensor:
    return input.coordinates[:, 0].long()


def global_max_pool(input: SparseTensor) -> torch.Tensor:
    """Per batch item maximum: `[B, C]`."""
    _require_sparse(input)
    features = input.features
    out = features.new_full((input.batch_size, features.shape[1]), -math.inf)
    index = _batch_index(input).unsqueeze(1).expand_as(features)
    return out.scatter_reduce(0, index, features, reduce="amax", include_self=False)


def global_avg_pool(input: SparseTensor) -> torch.Tensor:
    """Per batch item mean: `[B, C]`."""
    _require_sparse(input)
    features = input.features
    out = features.new_zeros((input.batch_size, features.shape[1]))
    index = _batch_index(input).unsqueeze(1).expand_as(features)
    return out.scatter_reduce(0, index, features, reduce="mean", include_self=False)
