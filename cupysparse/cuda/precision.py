"""How fp32 convolutions multiply: exactly in fp32 ("ieee", the default) or on tensor cores with
the operands rounded to TF32 ("tf32": 10 mantissa bits, fp32 accumulation, the range of fp32).

TF32 runs the fp32 layers of a network through `mma_implicit_gemm` (sm_80+) or, on an H100,
`wgmma_implicit_gemm`, several times faster than fp32 arithmetic: both hand the tensor cores the fp32
operands as they are, and the tensor cores ignore their 13 low mantissa bits (truncation toward
zero), which costs about three decimal digits per product; the sums stay fp32. Like
PyTorch (whose own flags this library does not read), the choice is global: `set_fp32_precision`,
the `fp32_precision` context manager, or the environment variable CUPYSPARSE_FP32_PRECISION. fp16,
bf16 and fp64 convolutions are not affected. The tuner keeps the measurements of TF32 problems apart
from those of exact fp32 ones.
"""

from __future__ import annotations

import contextlib

import numpy as np

from cupysparse import settings
from cupysparse.settings import FP32_PRECISIONS, IEEE, TF32  # noqa: F401 (the precisions, named where they are chosen)

_chosen: str | None = None  # set_fp32_precision's value; None: the environment variable decides


def get_fp32_precision() -> str:
    """"ieee" or "tf32": set_fp32_precision's choice, else CUPYSPARSE_FP32_PRECISION, else "ieee"."""
    if _chosen is not None:
        return _chosen
    return settings.fp32_precision()


def chosen_fp32_precision() -> str | None:
    """`set_fp32_precision`'s choice, None where the environment variable decides."""
    return _chosen


def set_fp32_precision(precision: str | None) -> None:
    """Multiply fp32 convolutions exactly ("ieee") or in TF32 ("tf32"); None returns the choice to
    the environment variable."""
    global _chosen
    _chosen = None if precision is None else settings.checked_fp32_precision(precision, "fp32 precision")
    settings.changed()


@contextlib.contextmanager
def fp32_precision(precision: str):
    """`with fp32_precision("tf32"):` runs the block's fp32 convolutions in TF32."""
    previous = _chosen
    set_fp32_precision(precision)
    try:
        yield
    finally:
        set_fp32_precision(previous)


def uses_tf32(dtype, on_gpu: bool) -> bool:
    """Whether a convolution of `dtype` features may run in TF32: fp32 on a GPU with "tf32" chosen."""
    return on_gpu and np.dtype(dtype) == np.float32 and get_fp32_precision() == TF32
