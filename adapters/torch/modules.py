"""`torch.nn` modules over torch `SparseTensor`s: convolutions, pooling, and per-voxel layers.

Every module takes and returns a `SparseTensor`, so they chain in `nn.Sequential`. Convolution
weights are `[K, C_in, C_out]` (depthwise `[K, C]`), initialised like torch's convolutions
(uniform in ±1/sqrt(fan_in), fan_in = K · C_in). The algorithm arguments are those of the
functional API (an enum member, a name, a list of either, `auto`, `all`; None reads the
environment variables) and are checked when the module is built.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cupysparse.algorithms import CONV, DEPTHWISE
from cupysparse.geometry.coords import as_tuple
from cupysparse.tuning.search_space import algorithm_argument
from cupysparse.tuning.tuner import rehearsing
from cupysparse.networks.weight_layouts import from_spconv_weight

from cupysparse.adapters.torch import functional as F
from cupysparse.adapters.torch.functional import batch_norm_epilogue
from cupysparse.adapters.torch.tensor import SparseTensor


def _kernel_volume(kernel_size, spatial_dims: int) -> int:
    return math.prod(as_tuple(kernel_size, spatial_dims, "kernel_size"))


class SpatiallySparseConv(nn.Module):
    """A sparse convolution: submanifold (stride 1), strided, transposed (back to the coordinates
    the input was downsampled from) or generative transposed. See `cupysparse.spatially_sparse_conv`."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, dilation=1, transposed=False,
                 generative=False, bias=True, fwd_algo=None, bwd_algo=None, *, spatial_dims=3, device=None,
                 dtype=None):
        super().__init__()
        if in_channels < 1 or out_channels < 1:
            raise ValueError(f"channel counts must be positive, got in_channels={in_channels}, "
                             f"out_channels={out_channels}")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size = as_tuple(kernel_size, spatial_dims, "kernel_size")
        self.stride = as_tuple(stride, spatial_dims, "stride")
        self.dilation = as_tuple(dilation, spatial_dims, "dilation")
        self.transposed, self.generative = transposed, generative
        algorithm_argument(fwd_algo, CONV, "forward")
        algorithm_argument(bwd_algo, CONV, "backward")
        self.fwd_algo, self.bwd_algo = fwd_algo, bwd_algo
        volume = _kernel_volume(kernel_size, spatial_dims)
        self.weight = nn.Parameter(torch.empty(volume, in_channels, out_channels, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_channels, device=device, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.weight.shape[0] * self.in_channels)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: SparseTensor) -> SparseTensor:
        return F.sparse_conv(input, self.weight, self.kernel_size, self.stride, self.dilation, self.transposed,
                             self.generative, self.bias, self.fwd_algo, self.bwd_algo)

    def extra_repr(self) -> str:
        kind = "generative transposed" if self.generative else "transposed" if self.transposed else "forward"
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"dilation={self.dilation}, {kind}, bias={self.bias is not None}")


class SubMConv3d(SpatiallySparseConv):
    """Submanifold 3D convolution: the output has the input's coordinates."""

    def __init__(self, in_channels, out_channels, kernel_size, dilation=1, bias=True, **kwargs):
        super().__init__(in_channels, out_channels, kernel_size, 1, dilation, bias=bias, **kwargs)


class SparseConv3d(SpatiallySparseConv):
    """Strided 3D convolution: output coordinates floor(input / stride). Unlike spconv's
    SparseConv3d, stride 1 keeps the input coordinates (submanifold)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, dilation=1, bias=True, **kwargs):
        super().__init__(in_channels, out_channels, kernel_size, stride, dilation, bias=bias, **kwargs)


class SparseConvTranspose3d(SpatiallySparseConv):
    """Transposed 3D convolution back to the coordinates the input was downsampled from;
    `generative=True` creates every reachable coordinate instead."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, dilation=1, bias=True, generative=False,
                 **kwargs):
        super().__init__(in_channels, out_channels, kernel_size, stride, dilation, True, generative, bias, **kwargs)


class SubMConv2d(SubMConv3d):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, spatial_dims=2, **kwargs)


class SparseConv2d(SparseConv3d):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, spatial_dims=2, **kwargs)


class SparseConvTranspose2d(SparseConvTranspose3d):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, spatial_dims=2, **kwargs)


class SparseDepthwiseConv(nn.Module):
    """A per-channel sparse convolution, weight `[K, C]`."""

    def __init__(self, channels: int, kernel_size, stride=1, dilation=1, transposed=False, bias=True, fwd_algo=None,
                 bwd_algo=None, *, spatial_dims=3, device=None, dtype=None):
        super().__init__()
        self.channels = channels
        self.kernel_size = as_tuple(kernel_size, spatial_dims, "kernel_size")
        self.stride = as_tuple(stride, spatial_dims, "stride")
        self.dilation = as_tuple(dilation, spatial_dims, "dilation")
        self.transposed = transposed
        algorithm_argument(fwd_algo, DEPTHWISE, "forward")
        algorithm_argument(bwd_algo, DEPTHWISE, "backward")
        self.fwd_algo, self.bwd_algo = fwd_algo, bwd_algo
        volume = _kernel_volume(kernel_size, spatial_dims)
        self.weight = nn.Parameter(torch.empty(volume, channels, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(channels, device=device, dtype=dtype)) if bias else None
        bound = 1.0 / math.sqrt(volume)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, input: SparseTensor) -> SparseTensor:
        return F.sparse_depthwise_conv(input, self.weight, self.kernel_size, self.stride, self.dilation,
                                       self.transposed, self.bias, self.fwd_algo, self.bwd_algo)


class SparseMaxPool(nn.Module):
    def __init__(self, kernel_size, stride=None, dilation=1):
        super().__init__()
        self.kernel_size, self.stride, self.dilation = kernel_size, stride, dilation

    def forward(self, input: SparseTensor) -> SparseTensor:
        return F.sparse_max_pool(input, self.kernel_size, self.stride, self.dilation)


class SparseAvgPool(SparseMaxPool):
    def forward(self, input: SparseTensor) -> SparseTensor:
        return F.sparse_avg_pool(input, self.kernel_size, self.stride, self.dilation)


class SparseUnpool(nn.Module):
    def __init__(self, stride):
        super().__init__()
        self.stride = stride

    def forward(self, input: SparseTensor) -> SparseTensor:
        return F.sparse_unpool(input, self.stride)


class GlobalMaxPool(nn.Module):
    """`[B, C]`: the maximum of each batch item's features."""

    def forward(self, input: SparseTensor) -> torch.Tensor:
        return F.global_max_pool(input)


class GlobalAvgPool(nn.Module):
    """`[B, C]`: the mean of each batch item's features."""

    def forward(self, input: SparseTensor) -> torch.Tensor:
        return F.global_avg_pool(input)


class PerVoxel(nn.Module):
    """Applies `module` to the features `[N, C]` (each voxel a row), keeping coordinates and maps."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, input: SparseTensor) -> SparseTensor:
        return input.replace_feature(self.module(input.features))


class SparseBatchNorm(nn.BatchNorm1d):
    """`nn.BatchNorm1d` over the features `[N, C]`; its state-dict keys are BatchNorm1d's.

    In evaluation with running statistics and nothing to differentiate (inference) it is the core's
    inference epilogue (`cupysparse.functional.epilogue`): on the GPU one kernel of ours, which derives scale and
    shift from the statistics itself in fp32, where `F.batch_norm` costs three kernels and tens of
    microseconds of host time a layer. `inference_epilogue` also adds a residual and applies a ReLU in
    the same pass, which the networks use for a batch norm followed by a ReLU or by a residual sum
    (`adapters.torch.networks`); `runs_inference_epilogue` says when it may stand in. In training with
    a momentum it makes `F.batch_norm`'s own call (and counts the batch) without the module's Python
    path in between.
    """

    def forward(self, input: SparseTensor) -> SparseTensor:
        features = input.features
        if self.runs_inference_epilogue(features):
            return self.inference_epilogue(input)
        if self.running_mean is None or torch.compiler.is_compiling():
            return input.replace_feature(super().forward(features))
        if self.training:
            # The module's path for a cumulative average (momentum None) and for the error it raises
            # on one value per channel.
            if self.momentum is None or features.shape[0] < 2:
                return input.replace_feature(super().forward(features))
            self.num_batches_tracked.add_(1)
            return input.replace_feature(torch.batch_norm(
                features, self.weight, self.bias, self.running_mean, self.running_var, True, self.momentum, self.eps,
                torch.backends.cudnn.enabled,
            ))
        return input.replace_feature(super().forward(features))  # evaluation with gradients

    def runs_inference_epilogue(self, features: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
        """Whether `inference_epilogue` may stand in for this module (and a residual sum or ReLU after
        it): evaluation with running statistics, outside `torch.compile`, nothing to differentiate, a
        residual of the features' shape and dtype (torch's sum would promote another)."""
        # A rehearsal (`cupysparse.networks.prefetch`) runs an evaluation: if the module switched to training since, it
        # still uses, and changes nothing of, its running statistics.
        if (self.training and not rehearsing()) or self.running_mean is None or torch.compiler.is_compiling():
            return False
        if residual is not None and (residual.shape != features.shape or residual.dtype != features.dtype):
            return False
        if not torch.is_grad_enabled():
            return True
        return not (features.requires_grad or (residual is not None and residual.requires_grad)
                    or any(parameter.requires_grad for parameter in self.parameters()))

    def inference_epilogue(self, input: SparseTensor, residual: torch.Tensor | None = None,
                           relu: bool = False) -> SparseTensor:
        """`relu?(self(input).features (+ residual))` in one pass, for where `runs_inference_epilogue`."""
        return input.replace_feature(batch_norm_epilogue(input.features, self.running_mean, self.running_var,
                                                         self.weight, self.bias, self.eps, residual, relu))


class SparseLayerNorm(PerVoxel):
    def __init__(self, num_features: int, **kwargs):
        super().__init__(nn.LayerNorm(num_features, **kwargs))


class SparseReLU(PerVoxel):
    def __init__(self, inplace: bool = False):
        super().__init__(nn.ReLU(inplace))

    def forward(self, input: SparseTensor) -> SparseTensor:
        # The function itself: the inner module's call machinery costs more than the kernel's launch.
        return input.replace_feature(nn.functional.relu(input.features, self.module.inplace))


class SparseDropout(PerVoxel):
    def __init__(self, p: float = 0.5):
        super().__init__(nn.Dropout(p))


def load_spconv_state_dict(model: nn.Module, state_dict: dict, strict: bool = True) -> list[str]:
    """Copy the convolution weights (and biases) of an spconv 2.x checkpoint into `model`, whose
    convolution modules must have the same names as in the spconv model. spconv stores weights as
    `[C_out, *kernel_size, C_in]`; they are converted to `[K, C_in, C_out]`. Returns the names of
    the convolutions loaded; with `strict`, a convolution missing from `state_dict` raises KeyError."""
    loaded = []
    for name, module in model.named_modules():
        if not isinstance(module, SpatiallySparseConv):
            continue
        key = f"{name}.weight" if name else "weight"
        if key not in state_dict:
            if strict:
                raise KeyError(f"the spconv state dict has no {key!r} for {name or 'the model'}")
            continue
        weight = torch.as_tensor(from_spconv_weight(state_dict[key].detach().cpu().numpy()))
        if tuple(weight.shape) != tuple(module.weight.shape):
            raise ValueError(f"{key}: spconv weight converts to {tuple(weight.shape)} but {name} expects "
                             f"{tuple(module.weight.shape)}")
        with torch.no_grad():
            module.weight.copy_(weight)
            bias_key = key[: -len("weight")] + "bias"
            if module.bias is not None and bias_key in state_dict:
                module.bias.copy_(state_dict[bias_key])
        loaded.append(name)
    return loaded
