"""Per-voxel layers of torch `SparseTensor`s: batch norm (with the core's inference epilogue), layer
norm, ReLU and dropout, each applied to the features `[N, C]` with coordinates and maps kept."""

from __future__ import annotations

import functools

import torch
from torch import nn

from cupysparse.functional import epilogue, training_norm
from cupysparse.tuning.tuner import rehearsing

from cupysparse.adapters.torch.bridge import core_dtype
from cupysparse.adapters.torch.convolution import TORCH_ARRAYS
from cupysparse.adapters.torch.tensor import SparseTensor


def batch_norm_epilogue(features: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                        weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                        residual: torch.Tensor | None = None, relu: bool = False) -> torch.Tensor:
    """`relu?(batch_norm(features) (+ residual))` under running statistics, not differentiable: on the
    current CUDA device one launch of the core's kernel on torch's stream into an output torch
    allocates; anything else the core's function on zero-copy views (`cupysparse.functional.epilogue`)."""
    return epilogue.run(TORCH_ARRAYS, features, running_mean, running_var, weight, bias, eps, residual, relu)


class _TrainingNorm(torch.autograd.Function):
    """`relu?(batch_norm(features) (+ residual))` over the batch's statistics, the running ones moved, in the
    core's two passes forward and two backward (`training_norm.run_forward`, `run_backward`), on torch's
    stream into tensors torch allocates; the forward counts the batch in `batches_tracked` too. Its caller has
    checked `SparseBatchNorm.runs_training_norm`."""

    @staticmethod
    def forward(ctx, features, weight, bias, residual, running_mean, running_var, batches_tracked, momentum, eps,
                relu):
        parameter_dtype = core_dtype(running_mean.dtype)
        out, statistics, scratch = training_norm.run_forward(
            TORCH_ARRAYS, features, residual, weight, bias, running_mean, running_var, momentum, eps, relu,
            parameter_dtype, batches_tracked)
        ctx.save_for_backward(features, out if relu else None, scratch, weight)  # the ReLU's mask only
        ctx.statistics = statistics  # addresses in `scratch`
        ctx.relu, ctx.with_residual, ctx.has_bias = relu, residual is not None, bias is not None
        ctx.parameter_dtype = parameter_dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        features, out, _, weight = ctx.saved_tensors
        wants_parameters = weight is not None and (ctx.needs_input_grad[1] or ctx.needs_input_grad[2])
        grad_features, grads, g = training_norm.run_backward(
            TORCH_ARRAYS, grad_out.contiguous(), features, out, ctx.statistics, weight, ctx.relu, ctx.with_residual,
            ctx.parameter_dtype, wants_parameters)
        grad_weight = grad_bias = None
        if grads is not None:
            grad_weight, grad_bias = grads.unbind()
        grad_residual = g if ctx.with_residual and ctx.needs_input_grad[3] else None
        return (grad_features, grad_weight, grad_bias if ctx.has_bias else None, grad_residual, None, None, None,
                None, None, None)


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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._folded = None  # (what it was computed from, scale, shift): see `folded`

    def forward(self, input: SparseTensor) -> SparseTensor:
        features = input.features
        if self.runs_inference_epilogue(features):
            return self.inference_epilogue(input)
        if self.running_mean is None or torch.compiler.is_compiling():
            return input.replace_feature(super().forward(features))
        if self.training:
            if self.runs_training_norm(features):
                return self.training_norm(input)
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
        if not self.normalises_by_running_statistics() or torch.compiler.is_compiling():
            return False
        if residual is not None and (residual.shape != features.shape or residual.dtype != features.dtype):
            return False
        if not torch.is_grad_enabled():
            return True
        return not (features.requires_grad or (residual is not None and residual.requires_grad)
                    or any(parameter.requires_grad for parameter in self.parameters()))

    def runs_training_norm(self, features: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
        """Whether `training_norm` may stand in for this module in training (and a residual sum or ReLU after
        it): outside `torch.compile`, at least two rows of this module's channels, on the current GPU,
        contiguous features (and a residual like them), and state the kernels take with them
        (`training_norm_takes`)."""
        if (not self.training or rehearsing() or torch.compiler.is_compiling() or not features.is_cuda
                or features.dim() != 2 or features.shape[0] < 2 or features.shape[1] != self.num_features
                or not features.is_contiguous() or features.device.index != torch.cuda.current_device()):
            return False
        if residual is not None and (residual.shape != features.shape or residual.dtype != features.dtype
                                     or not residual.is_contiguous() or residual.device != features.device):
            return False
        return self.training_norm_takes(features.dtype, features.device)

    def training_norm_takes(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether this module's state takes the training norm of `dtype` features on `device`: running
        statistics with a momentum, parameters and statistics of one dtype on `device` and the count of batches
        in int64 beside them (the forward increments it); on a GPU, a dtype the kernels take with `dtype`
        (`training_norm.kernel_runs`), elsewhere `dtype` itself (the core's reference). A network's step asks
        each of its norms every call: the state is read from the module's dictionaries, not its attributes."""
        buffers, parameters = self._buffers, self._parameters
        running_mean, counter = buffers.get("running_mean"), buffers.get("num_batches_tracked")
        if running_mean is None or self.momentum is None or counter is None or counter.dtype != torch.int64 or (
                counter.device != device):
            return False
        parameter_dtype = running_mean.dtype
        for tensor in (running_mean, buffers.get("running_var"), parameters.get("weight"), parameters.get("bias")):
            if tensor is not None and (tensor.dtype != parameter_dtype or tensor.device != device):
                return False
        if device.type != "cuda":
            return parameter_dtype == dtype
        return _training_norm_kernel_runs(dtype, parameter_dtype, self.num_features)

    def training_norm(self, input: SparseTensor, residual: torch.Tensor | None = None,
                      relu: bool = False) -> SparseTensor:
        """`relu?(self(input).features (+ residual))` in training, for where `runs_training_norm`: the
        batch's statistics, the running ones moved and the batch counted, differentiable (`_TrainingNorm`)."""
        return input.replace_feature(_TrainingNorm.apply(
            input.features, self.weight, self.bias, residual, self.running_mean, self.running_var,
            self.num_batches_tracked, self.momentum, self.eps, relu))

    def folds_into_convolution(self) -> bool:
        """Whether a convolution before this module may apply it in its epilogue (`folded`): evaluation
        with running statistics (`normalises_by_running_statistics`), in eager mode, with gradients off
        (no_grad or inference_mode)."""
        return (self.normalises_by_running_statistics() and not torch.is_grad_enabled()
                and not torch.compiler.is_compiling())

    def normalises_by_running_statistics(self) -> bool:
        """Evaluation (or a rehearsal's) with running statistics: the module is an affine map of its input."""
        # A rehearsal (`cupysparse.networks.prefetch`) runs an evaluation: if the module switched to training since, it
        # still uses, and changes nothing of, its running statistics.
        return not (self.training and not rehearsing()) and self._buffers.get("running_mean") is not None

    def folded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 `(scale, shift)` with `self(x) = x · scale + shift` under the running statistics, for a
        convolution's epilogue (`ConvEpilogue`); computed again only when a parameter or statistic moved
        or changed (its address and version counter), so a layer pays a few reads of the module's dictionaries
        (not its attributes, a microsecond each) per call: a network's inference asks each of its norms."""
        parameters, buffers = self._parameters, self._buffers
        weight, bias = parameters.get("weight"), parameters.get("bias")
        running_mean, running_var = buffers["running_mean"], buffers["running_var"]
        key = (self.eps, _state(weight), _state(bias), _state(running_mean), _state(running_var))
        folded = self._folded
        if folded is None or folded[0] != key:
            with torch.no_grad():
                scale = torch.rsqrt(running_var.float() + self.eps)
                if weight is not None:
                    scale = scale * weight.float()
                shift = -running_mean.float() * scale
                if bias is not None:
                    shift = shift + bias.float()
            folded = self._folded = (key, scale.contiguous(), shift.contiguous())
        return folded[1], folded[2]

    def inference_epilogue(self, input: SparseTensor, residual: torch.Tensor | None = None,
                           relu: bool = False) -> SparseTensor:
        """`relu?(self(input).features (+ residual))` in one pass, for where `runs_inference_epilogue`."""
        return input.replace_feature(batch_norm_epilogue(input.features, self.running_mean, self.running_var,
                                                         self.weight, self.bias, self.eps, residual, relu))


@functools.cache
def _training_norm_kernel_runs(dtype: torch.dtype, parameter_dtype: torch.dtype, channels: int) -> bool:
    """`training_norm.kernel_runs` for torch's dtypes."""
    features_dtype, core_parameter_dtype = core_dtype(dtype), core_dtype(parameter_dtype)
    return (features_dtype is not None and core_parameter_dtype is not None
            and training_norm.kernel_runs(features_dtype, core_parameter_dtype, channels))


def _state(tensor: torch.Tensor | None):
    """What tells whether `tensor` moved or changed since: its address and version counter (an
    inference tensor has none: a fresh object, never equal)."""
    if tensor is None:
        return None
    return (tensor.data_ptr(), object() if tensor.is_inference() else tensor._version)


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
