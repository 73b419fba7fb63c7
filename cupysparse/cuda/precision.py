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

fp16 and bf16 results are sums accumulated in fp32 and rounded to the feature dtype at the end: a sum
beyond the dtype's range becomes inf there (an overflow), and NaN or inf in the inputs give NaN or inf.
`find_non_finite` says where, in the words the tuner's check of its reference and the algorithms'
own report share; `rounded_result` is that last rounding, which on the host reports what is not
finite (a RuntimeWarning once per process, then a log line) in place of NumPy's generic warning.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import warnings
from dataclasses import dataclass

import numpy as np

from cupysparse import settings
from cupysparse.cuda.backend import all_true, array_module
from cupysparse.cuda.dtypes import BFLOAT16, FLOAT16, accumulation_dtype, short_name
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


# The tuner reports a non-finite reference on this logger too: one handler sees every such report.
log = logging.getLogger("cupysparse.tuning")

_HALF_DTYPES = frozenset(dtype for dtype in (FLOAT16, BFLOAT16) if dtype is not None)
_reported_non_finite: set = set()  # the `NonFinite.topic`s warned about in this process
_checked_by_caller = contextvars.ContextVar("cupysparse_non_finite_checked_by_caller", default=False)


def largest_finite(dtype) -> float:
    """The largest finite value of `dtype` (65504 for fp16)."""
    dtype = np.dtype(dtype)
    if dtype == BFLOAT16:  # NumPy's finfo does not know it; the package that defines it does
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).max)
    return float(np.finfo(dtype).max)


def result_position(flat_index: int, shape, label: str) -> str:
    """Where element `flat_index` of the result `label` of `shape` is: a row and channel of features,
    an offset and channels of a weight gradient (`[K, C_in, C_out]`, or `[K, C]` for depthwise)."""
    index = [int(i) for i in np.unravel_index(flat_index, shape)]
    if label == "weight gradient" and len(index) == 3:
        return f"offset {index[0]}, input channel {index[1]}, output channel {index[2]}"
    if label == "weight gradient" and len(index) == 2:
        return f"offset {index[0]}, channel {index[1]}"
    if len(index) == 2:
        return f"row {index[0]}, channel {index[1]}"
    return f"index {tuple(index)}"


@dataclass(frozen=True)
class NonFinite:
    """The values of a convolution's result `label` ("output", "input gradient" or "weight gradient")
    in `dtype` that are not finite: `where` the first is and how many more, and whether it is NaN
    (else inf: an overflow)."""

    dtype: np.dtype
    label: str
    where: str
    is_nan: bool

    @property
    def topic(self) -> tuple:
        """What a report is about, warned about once per process: not where, which changes from call to call."""
        return self.dtype.name, self.label, self.is_nan

    def describe(self, whose: str = "the") -> str:
        """`overflow: the fp16 output exceeds 65504 at row 3, channel 0 (and 5 more)`, or `the fp16 output
        is NaN at ...` (`whose` in place of "the")."""
        subject = f"{whose} {short_name(self.dtype)} {self.label}"
        if self.is_nan:
            return f"{subject} is NaN at {self.where}"
        return f"overflow: {subject} exceeds {largest_finite(self.dtype):g} at {self.where}"


def find_non_finite(result, dtype, label: str) -> NonFinite | None:
    """What of `result`, the convolution result `label` in `dtype`, is not finite; None when all is.
    Computed where the array lives: only a few scalars cross to the host, and only when some value
    is not finite."""
    if result.size == 0:
        return None
    xp = array_module(result)
    # NumPy tests fp16 and bf16 as they are; CuPy has no bf16 arithmetic, so there they are widened.
    values = result if xp is np else result.astype(accumulation_dtype(dtype))
    finite = xp.isfinite(values).ravel()
    if all_true(finite):
        return None
    first = int(xp.argmin(finite))  # the first False
    more = int(finite.size - int(xp.count_nonzero(finite))) - 1
    where = result_position(first, result.shape, label) + (f" (and {more:,} more)" if more else "")
    return NonFinite(np.dtype(dtype), label, where, bool(xp.isnan(values.ravel()[first])))


@contextlib.contextmanager
def results_checked_by_caller():
    """Within it, `rounded_result` reports nothing: the caller (the tuner's measurement) checks the
    results itself and words what it finds with the problem it measures."""
    token = _checked_by_caller.set(True)
    try:
        yield
    finally:
        _checked_by_caller.reset(token)


def count_as_reported(finding: NonFinite) -> None:
    """Take `finding`'s topic as warned about: its caller warns about it in its own words (the tuner,
    naming the problem), and the call's own run, which follows, would repeat it."""
    _reported_non_finite.add(finding.topic)


def rounded_result(accumulated, dtype, label: str):
    """`accumulated`, the result `label` summed in the accumulation dtype, rounded to the feature
    `dtype`. On the host, an fp16 or bf16 result that is not finite is reported where it is, once
    per process as a RuntimeWarning, then as a log line. GPU results are not checked here: that
    would wait for the GPU on every call (the tuner's measurement checks the reference's)."""
    if np.dtype(dtype) not in _HALF_DTYPES or array_module(accumulated) is not np:
        return accumulated.astype(dtype, copy=False)
    with np.errstate(over="ignore"):  # the report below says where; NumPy's own warning says only that
        result = accumulated.astype(dtype)
    finding = None if _checked_by_caller.get() else find_non_finite(result, dtype, label)
    if finding is not None:
        _report(finding)
    return result


def _report(finding: NonFinite) -> None:
    name, wide = short_name(finding.dtype), short_name(accumulation_dtype(finding.dtype))
    cause = ("the inputs hold NaN or inf" if finding.is_nan
             else f"the sum, accumulated in {wide}, is out of {name}'s range there; scale the inputs or weights "
                  "down, or compute in a wider dtype")
    message = f"cupysparse: {finding.describe()}: {cause}"
    if finding.topic in _reported_non_finite:
        log.info("%s", message)
        return
    _reported_non_finite.add(finding.topic)
    warnings.warn(message, RuntimeWarning, stacklevel=3)  # where the algorithm rounds its result
