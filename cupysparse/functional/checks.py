"""What the functional API checks of its arguments before anything runs: a TypeError or ValueError
naming the argument. Shared by the convolutions' full path and the adapters, whose arrays are not the
core's (`check_weight_shape` takes a shape)."""

from __future__ import annotations

from cupysparse.cuda.backend import is_cupy_array
from cupysparse.cuda.dtypes import FEATURE_DTYPES
from cupysparse.geometry.coords import is_integer
from cupysparse.geometry.sparse_tensor import SparseTensor


def positive_int(value, name: str) -> int:
    """`value` as an int: a count a layer is built with (its channels). TypeError unless it is a Python or
    NumPy integer (not a bool, a float or a string), ValueError unless it is positive; both name `name`."""
    if not is_integer(value):
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def require_like(array, name: str, reference, reference_name: str) -> None:
    """`array` is an array of `reference`'s backend, device and dtype."""
    if not hasattr(array, "shape") or not hasattr(array, "dtype"):
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(array).__name__}")
    if is_cupy_array(array) != is_cupy_array(reference):
        where = "CuPy (GPU)" if is_cupy_array(reference) else "NumPy (CPU)"
        raise TypeError(f"{name} must be a {where} array like {reference_name}")
    if is_cupy_array(array) and array.device != reference.device:
        raise ValueError(f"{name} is on GPU {array.device.id} but {reference_name} on GPU {reference.device.id}")
    if array.dtype != reference.dtype:
        raise TypeError(f"{name} has dtype {array.dtype} but {reference_name} has {reference.dtype}; cast one of them")


def check_features(features, name: str, num_rows: int, num_channels: int | None = None) -> None:
    """`features` is a `[num_rows, C]` float array (`C == num_channels` when given)."""
    if not hasattr(features, "shape") or not hasattr(features, "dtype"):
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(features).__name__}")
    if features.dtype not in FEATURE_DTYPES:
        raise TypeError(f"{name} must be fp64, fp32, fp16 or bf16, got {features.dtype}")
    if features.ndim != 2 or features.shape[0] != num_rows:
        raise ValueError(f"{name} must have shape [{num_rows}, C], got {tuple(features.shape)}")
    if num_channels is not None and features.shape[1] != num_channels:
        raise ValueError(f"{name} must have {num_channels} channels, got {features.shape[1]}")


def check_weight_shape(weight_shape, in_channels: int, kernel_map, features_name: str = "the input") -> None:
    """ValueError unless a weight of `weight_shape` is `[K, C_in, C_out]` for `kernel_map` and `in_channels`."""
    if len(weight_shape) != 3:
        raise ValueError(f"weight must have shape [K, C_in, C_out], got {tuple(weight_shape)}")
    if weight_shape[0] != kernel_map.kernel_volume:
        raise ValueError(
            f"weight has {weight_shape[0]} kernel offsets but kernel size {kernel_map.kernel_size} has "
            f"{kernel_map.kernel_volume}"
        )
    if weight_shape[1] != in_channels:
        raise ValueError(f"weight expects {weight_shape[1]} input channels, {features_name} has {in_channels}")


def check_weight(weight, features, kernel_map) -> None:
    require_like(weight, "weight", features, "the input features")
    check_weight_shape(tuple(weight.shape), features.shape[1], kernel_map)


def check_input(input) -> None:
    if not isinstance(input, SparseTensor):
        raise TypeError(f"input must be a cupysparse.SparseTensor, got {type(input).__name__}")


def check_bias(bias, features, out_channels: int) -> None:
    if bias is None:
        return
    require_like(bias, "bias", features, "the input features")
    if tuple(bias.shape) != (out_channels,):
        raise ValueError(f"bias must have shape [{out_channels}], got {tuple(bias.shape)}")


def check_depthwise(features, weight, kernel_map, num_out_coords=None) -> None:
    check_features(features, "input_features", kernel_map.num_in)
    require_like(weight, "depthwise_weight", features, "input_features")
    if weight.ndim != 2 or tuple(weight.shape) != (kernel_map.kernel_volume, features.shape[1]):
        raise ValueError(
            f"depthwise_weight must have shape [K={kernel_map.kernel_volume}, C={features.shape[1]}], "
            f"got {tuple(weight.shape)}"
        )
    if num_out_coords is not None and num_out_coords != kernel_map.num_out:
        raise ValueError(f"num_out_coords is {num_out_coords} but the kernel map has {kernel_map.num_out} outputs")
