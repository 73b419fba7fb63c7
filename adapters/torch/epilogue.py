"""The core's inference epilogue (`cupysparse.functional.epilogue`) for torch tensors, with nothing to
differentiate: `relu?(batch_norm(x) (+ residual))` under running statistics.

On the current CUDA device, with dtypes the kernel takes, it is one launch of our kernel on torch's
stream into an output torch allocates, on device addresses (no core arrays built per call). Anything
else (CPU tensors, float64, statistics of mixed dtypes) runs the core's function on zero-copy views.
"""

from __future__ import annotations

import torch

from cupysparse.functional import epilogue
from cupysparse.cuda.dtypes import BFLOAT16, FLOAT16, FLOAT32

from cupysparse.adapters.torch.bridge import from_core, on_torch_stream, stream_handle, to_core

_CORE_DTYPES = {torch.float32: FLOAT32, torch.float16: FLOAT16}
if BFLOAT16 is not None:
    _CORE_DTYPES[torch.bfloat16] = BFLOAT16


def batch_norm_epilogue(features: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                        weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                        residual: torch.Tensor | None = None, relu: bool = False) -> torch.Tensor:
    """`cupysparse.functional.epilogue.batch_norm_epilogue` of torch tensors; the result is not differentiable."""
    statistics = (running_mean, running_var, weight, bias)
    if _launchable(features, residual, statistics):
        features = features.contiguous()
        residual = None if residual is None else residual.contiguous()
        out = torch.empty_like(features)
        addresses = [0 if tensor is None else tensor.data_ptr() for tensor in (residual, weight, bias)]
        epilogue.launch(stream_handle(features.device), features.shape[0], features.shape[1],
                        _CORE_DTYPES[features.dtype], _CORE_DTYPES[running_mean.dtype], features.data_ptr(),
                        *addresses, running_mean.data_ptr(), running_var.data_ptr(), eps, relu, out.data_ptr())
        return out
    with on_torch_stream(features.device):
        out = epilogue.batch_norm_epilogue(
            to_core(features), *(None if tensor is None else to_core(tensor) for tensor in statistics), eps,
            residual=None if residual is None else to_core(residual), relu=relu,
        )
        return from_core(out)


def _launchable(features: torch.Tensor, residual: torch.Tensor | None, statistics) -> bool:
    """Whether the kernel can run these tensors as they are: 2-D features on the current CUDA device
    in a dtype it takes, a residual like them, contiguous `[C]` statistics and parameters of one dtype
    it takes with them, on the same device."""
    if not (features.is_cuda and features.dim() == 2 and features.device.index == torch.cuda.current_device()):
        return False
    if residual is not None and (residual.shape != features.shape or residual.dtype != features.dtype
                                 or residual.device != features.device):
        return False
    parameter_dtype = statistics[0].dtype
    for tensor in statistics:
        if tensor is not None and (tensor.dtype != parameter_dtype or tensor.device != features.device
                                   or tensor.shape != (features.shape[1],) or not tensor.is_contiguous()):
            return False
    dtype, core_parameter_dtype = _CORE_DTYPES.get(features.dtype), _CORE_DTYPES.get(parameter_dtype)
    return dtype is not None and core_parameter_dtype is not None and epilogue.kernel_runs(dtype,
                                                                                          core_parameter_dtype)
