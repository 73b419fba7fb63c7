"""Feature dtypes: which floats the library computes in, and their CUDA C++ names.

bfloat16 comes from `ml_dtypes` (NumPy has none; CuPy uses the same dtype when ml_dtypes is
installed). Half-precision inputs accumulate in fp32, fp64 in fp64.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FLOAT64 = np.dtype(np.float64)
FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

FEATURE_DTYPES = (FLOAT64, FLOAT32, FLOAT16, BFLOAT16)

_CUDA_NAMES = {FLOAT64: "double", FLOAT32: "float", FLOAT16: "__half", BFLOAT16: "__nv_bfloat16"}
_SHORT_NAMES = {FLOAT64: "fp64", FLOAT32: "fp32", FLOAT16: "fp16", BFLOAT16: "bf16"}


def as_feature_dtype(dtype) -> np.dtype:
    """`dtype` as a NumPy dtype, accepting the short names fp64/fp32/fp16/bf16 too."""
    by_short_name = {short: dtype for dtype, short in _SHORT_NAMES.items()}
    if isinstance(dtype, str) and dtype in by_short_name:
        return by_short_name[dtype]
    resolved = np.dtype(dtype)
    if resolved not in FEATURE_DTYPES:
        raise TypeError(f"features must be one of {', '.join(_SHORT_NAMES.values())}; got {resolved}")
    return resolved


def cuda_type_name(dtype) -> str:
    """The CUDA C++ type of `dtype`, as used in kernel template arguments."""
    return _CUDA_NAMES[as_feature_dtype(dtype)]


def short_name(dtype) -> str:
    return _SHORT_NAMES[as_feature_dtype(dtype)]


def accumulation_dtype(dtype) -> np.dtype:
    """fp64 for fp64 inputs, fp32 for everything else."""
    return FLOAT64 if as_feature_dtype(dtype) == FLOAT64 else FLOAT32
