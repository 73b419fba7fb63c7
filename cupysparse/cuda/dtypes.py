"""Feature dtypes: which floats the library computes in, and their CUDA C++ names.

bfloat16 comes from `ml_dtypes` (NumPy has none; CuPy uses the same dtype when ml_dtypes is
installed). It is a dependency, but an install without it (e.g. `--no-deps`) still runs every
other dtype. Half-precision inputs accumulate in fp32, fp64 in fp64.
"""

from __future__ import annotations

import numpy as np

try:
    import ml_dtypes
except ImportError:
    ml_dtypes = None

FLOAT64 = np.dtype(np.float64)
FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16) if ml_dtypes is not None else None

_CUDA_NAMES = {FLOAT64: "double", FLOAT32: "float", FLOAT16: "__half"}
_SHORT_NAMES = {FLOAT64: "fp64", FLOAT32: "fp32", FLOAT16: "fp16"}
if BFLOAT16 is not None:
    _CUDA_NAMES[BFLOAT16] = "__nv_bfloat16"
    _SHORT_NAMES[BFLOAT16] = "bf16"

FEATURE_DTYPES = tuple(_SHORT_NAMES)


_BY_SHORT_NAME = {short: dtype for dtype, short in _SHORT_NAMES.items()}


def as_feature_dtype(dtype) -> np.dtype:
    """`dtype` as a NumPy dtype, accepting the short names fp64/fp32/fp16/bf16 too."""
    if isinstance(dtype, str) and dtype in _BY_SHORT_NAME:
        return _BY_SHORT_NAME[dtype]
    if BFLOAT16 is None and str(dtype) in ("bf16", "bfloat16"):
        raise TypeError("bfloat16 needs the ml_dtypes package: pip install ml_dtypes")
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
