"""The per-voxel epilogue of inference: batch norm under running statistics, optionally followed by
a residual sum and a ReLU, in one pass over the features `[N, C]`:

    out = relu?(x · scale + shift (+ residual)),  scale = weight / sqrt(running_var + eps),
                                                 shift = bias − running_mean · scale

what a network in evaluation runs after a convolution (batch norm and ReLU; a residual block's
`relu(norm(body) + shortcut)`) as one read of the features and one write instead of a pass each.

A convolution whose launch plan fuses an epilogue (`ForwardPlan.fuses_epilogue`: the tensor-core
implicit GEMMs) applies the same formula as it stores its output (`ConvEpilogue`,
`execution.fused_forward`), with scale and shift given in fp32: no pass of its own at all.

On the GPU it is one kernel (raw_kernels/batch_norm_epilogue.cu), for fp32, fp16 and bf16 features
with statistics and parameters of the features' dtype or fp32, computing in fp32 and deriving scale
and shift from the statistics itself: nothing derived from them is kept, so a change of the
statistics is seen by the next call. Other dtypes, and NumPy arrays, take the same formula in the
accumulation dtype (fp64 for fp64 features) through the array module. `run` takes the arrays of any
framework (`execution.Arrays`): one launch on device addresses into an output the framework allocates
where the kernel takes the arrays as they are, else the checked function on the core's views.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from cupysparse.cuda.backend import array_module, cupy_module, is_cupy_array
from cupysparse.cuda.compile import KernelSource
from cupysparse.cuda.dtypes import BFLOAT16, FEATURE_DTYPES, FLOAT16, FLOAT32, accumulation_dtype, cuda_type_name, short_name

class ConvEpilogue(NamedTuple):
    """What a convolution's forward applies to each output value as it stores it, in fp32:
    `out = relu?(out · scale + shift (+ residual))`, a batch norm under running statistics folded into
    `scale` and `shift` (fp32 `[C_out]`, either None: 1 and 0), `residual` `[N_out, C_out]` of the
    output's dtype (None: nothing added), all contiguous on the convolution's device, in its framework."""

    scale: object = None
    shift: object = None
    residual: object = None
    relu: bool = False


BLOCK = 256
ROWS_PER_THREAD = 4  # rows a thread normalises with the scale and shift it derived once
VECTOR_BYTES = 16  # the widest load and store per thread
KERNEL_ARGUMENTS = 11  # every one given per launch

KERNEL_DTYPES = tuple(dtype for dtype in (FLOAT32, FLOAT16, BFLOAT16) if dtype is not None)


def _vector_widths(dtype) -> tuple[int, int]:
    """Channels per thread: a 16-byte vector, or one where the channels or addresses do not allow it."""
    return VECTOR_BYTES // np.dtype(dtype).itemsize, 1


def _name_expression(dtype, parameter_dtype, vector: int) -> str:
    return (f"batch_norm_epilogue<{cuda_type_name(dtype)}, {cuda_type_name(parameter_dtype)}, {vector}, "
            f"{ROWS_PER_THREAD}>")


def _instantiations(dtype) -> tuple[str, ...]:
    return tuple(_name_expression(dtype, parameter_dtype, vector)
                 for parameter_dtype in dict.fromkeys((dtype, FLOAT32)) for vector in _vector_widths(dtype))


_KERNELS = KernelSource("batch_norm_epilogue.cu", _instantiations(FLOAT32) + _instantiations(FLOAT16))
# bf16's instantiations are a module of their own: an fp16 or fp32 process never compiles them.
_BF16_KERNELS = KernelSource("batch_norm_epilogue.cu", _instantiations(BFLOAT16)) if BFLOAT16 is not None else None


def kernel_runs(dtype, parameter_dtype) -> bool:
    """Whether the kernel takes features of `dtype` with statistics and parameters of `parameter_dtype`."""
    return dtype in KERNEL_DTYPES and parameter_dtype in (dtype, FLOAT32)


@functools.lru_cache(maxsize=64)
def float_bits(value: float) -> int:
    """The bits of `value` as a float32: how a float argument travels in a launch's integer slot."""
    return int(np.float32(value).view(np.uint32))


@functools.lru_cache(maxsize=64)
def _kernel(dtype, parameter_dtype, vector: int) -> tuple[KernelSource, str]:
    source = _BF16_KERNELS if dtype == BFLOAT16 else _KERNELS
    return source, _name_expression(dtype, parameter_dtype, vector)


def launch(stream: int, num_rows: int, channels: int, dtype, parameter_dtype, features: int, residual: int,
           weight: int, bias: int, running_mean: int, running_var: int, eps: float, relu: bool, out: int) -> None:
    """The kernel on the current device over device addresses of row-major `[num_rows, channels]`
    features, residual (0: none) and out of `dtype`, and `[channels]` weight, bias (0: none of
    either) and statistics of `parameter_dtype` (see `kernel_runs`); `stream` a raw CUDA stream handle.
    Nothing is checked: the caller has."""
    if num_rows == 0 or channels == 0:
        return
    vector = _vector_widths(dtype)[0]
    if channels % vector or (features | residual | out) % VECTOR_BYTES:
        vector = 1
    source, name = _kernel(dtype, parameter_dtype, vector)
    threads = -(-num_rows // ROWS_PER_THREAD) * (channels // vector)
    source.prepared(name, BLOCK, KERNEL_ARGUMENTS).launch(
        stream, features, residual, weight, bias, running_mean, running_var, float_bits(eps), int(relu), num_rows,
        channels, out, grid=(-(-threads // BLOCK), 1, 1))


def run(arrays, features, running_mean, running_var, weight, bias, eps: float, residual=None, relu: bool = False):
    """`batch_norm_epilogue` of a framework's arrays (`arrays`: its `execution.Arrays`)."""
    statistics = (running_mean, running_var, weight, bias)
    parameter_dtypes = _launchable(arrays, features, residual, statistics)
    if parameter_dtypes is not None:
        features = arrays.contiguous(features)
        residual = None if residual is None else arrays.contiguous(residual)
        out = arrays.empty(features, tuple(features.shape))
        addresses = [0 if array is None else arrays.address(array) for array in (residual, weight, bias)]
        launch(arrays.stream(features), features.shape[0], features.shape[1], *parameter_dtypes,
               arrays.address(features), *addresses, arrays.address(running_mean), arrays.address(running_var), eps,
               relu, arrays.address(out))
        return out
    with arrays.device_context(features):
        core = arrays.to_core
        out = batch_norm_epilogue(core(features), *(None if array is None else core(array) for array in statistics),
                                  eps, residual=None if residual is None else core(residual), relu=relu)
        return arrays.from_core(out)


def _launchable(arrays, features, residual, statistics) -> tuple | None:
    """(core dtype of the features, of the statistics) where the kernel can take these arrays as they
    are: 2-D features on the current GPU in a dtype it takes, a residual like them, contiguous `[C]`
    statistics and parameters of one dtype it takes with them, on the same GPU; else None."""
    device = arrays.gpu(features)
    if device is None or len(features.shape) != 2 or device != arrays.current_gpu():
        return None
    if residual is not None and (residual.shape != features.shape or residual.dtype != features.dtype
                                 or arrays.gpu(residual) != device):
        return None
    parameter_dtype = statistics[0].dtype
    for array in statistics:
        if array is not None and (array.dtype != parameter_dtype or arrays.gpu(array) != device
                                  or tuple(array.shape) != (features.shape[1],) or not arrays.is_contiguous(array)):
            return None
    dtype, core_parameter_dtype = arrays.core_dtype(features.dtype), arrays.core_dtype(parameter_dtype)
    if dtype is None or core_parameter_dtype is None or not kernel_runs(dtype, core_parameter_dtype):
        return None
    return dtype, core_parameter_dtype


def _check_array(array, name: str, backend_of, ndim: int) -> None:
    if not (isinstance(array, np.ndarray) or is_cupy_array(array)):
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(array).__name__}")
    if is_cupy_array(array) != is_cupy_array(backend_of):
        raise TypeError(f"{name} must be a {'CuPy' if is_cupy_array(backend_of) else 'NumPy'} array like the "
                        "features")
    if np.dtype(array.dtype) not in FEATURE_DTYPES:
        raise TypeError(f"{name} must be float64, float32, float16 or bfloat16, got {array.dtype}")
    if array.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension{'s' if ndim > 1 else ''}, got shape {tuple(array.shape)}")


def check_norm_arguments(features, per_channel: dict, **like_features) -> None:
    """TypeError or ValueError, naming the argument, unless `features` is a 2-D NumPy or CuPy array `[N, C]` of
    a feature dtype, each of `per_channel` (name → array; None allowed but for running statistics) `[C]` on the
    same backend, and each of `like_features` (None allowed) of the features' shape and dtype."""
    _check_array(features, "features", features, 2)
    channels = features.shape[1]
    for name, array in per_channel.items():
        if array is None and name.startswith("running"):
            raise TypeError(f"{name} is required")
        if array is not None:
            _check_array(array, name, features, 1)
            if array.shape[0] != channels:
                raise ValueError(f"{name} has {array.shape[0]} channels but the features have {channels}")
    for name, array in like_features.items():
        if array is not None:
            _check_array(array, name, features, 2)
            if array.shape != features.shape or array.dtype != features.dtype:
                raise ValueError(f"{name} must be {short_name(features.dtype)} of shape {tuple(features.shape)} "
                                 f"like the features, got {short_name(array.dtype)} {tuple(array.shape)}")


def batch_norm_epilogue(features, running_mean, running_var, weight=None, bias=None, eps: float = 1e-5, *,
                        residual=None, relu: bool = False):
    """`relu?(batch_norm(features) (+ residual))` with the running statistics, as a new array of the
    features' dtype (see the module docstring). `features` and `residual` are `[N, C]` of one dtype;
    the statistics and `weight` / `bias` (None: 1 and 0) are `[C]`."""
    statistics = {"running_mean": running_mean, "running_var": running_var, "weight": weight, "bias": bias}
    check_norm_arguments(features, statistics, residual=residual)
    parameter_dtypes = {np.dtype(array.dtype) for array in statistics.values() if array is not None}
    dtype = np.dtype(features.dtype)
    if is_cupy_array(features) and len(parameter_dtypes) == 1 and kernel_runs(dtype, *parameter_dtypes):
        return _on_gpu(features, residual, statistics, parameter_dtypes.pop(), eps, relu)
    return _with_array_module(features, residual, statistics, eps, relu)


def _on_gpu(features, residual, statistics: dict, parameter_dtype, eps: float, relu: bool):
    cupy = cupy_module()
    features = cupy.ascontiguousarray(features)
    residual = None if residual is None else cupy.ascontiguousarray(residual)
    arrays = {name: None if array is None else cupy.ascontiguousarray(array) for name, array in statistics.items()}
    out = cupy.empty_like(features)

    def address(array) -> int:
        return 0 if array is None else array.data.ptr

    launch(cupy.cuda.get_current_stream().ptr, features.shape[0], features.shape[1], np.dtype(features.dtype),
           parameter_dtype, address(features), address(residual), address(arrays["weight"]), address(arrays["bias"]),
           address(arrays["running_mean"]), address(arrays["running_var"]), eps, relu, address(out))
    return out


def _with_array_module(features, residual, statistics: dict, eps: float, relu: bool):
    xp = array_module(features)
    compute = accumulation_dtype(features.dtype)
    scale = 1 / xp.sqrt(statistics["running_var"].astype(compute) + compute.type(eps))
    if statistics["weight"] is not None:
        scale = scale * statistics["weight"].astype(compute)
    shift = -statistics["running_mean"].astype(compute) * scale
    if statistics["bias"] is not None:
        shift = shift + statistics["bias"].astype(compute)
    out = features.astype(compute) * scale + shift
    if residual is not None:
        out += residual.astype(compute)
    if relu:
        out = xp.maximum(out, 0)  # NaN stays NaN, as in torch.relu and the kernel
    return out.astype(features.dtype)
