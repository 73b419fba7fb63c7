"""Error bounds for comparing a low-precision result with its fp64 reference.

A sum of n products accumulated in fp32 (or wider) and rounded once to the output dtype is off by
at most half an output ulp relative to the value, plus the accumulation error, which for n terms
of random sign grows like sqrt(n) times their typical size. So: rtol = the dtype's epsilon
(1e-4 for fp32, per the design notes) and atol = 4 · eps · sqrt(n) · rms(a) · rms(b), the factor 4
covering the tails of the term magnitudes. The reference is computed from the inputs already
rounded to the low dtype, so input rounding is not part of the error.

Two implementations that each meet that bound differ by at most twice it (`assert_agree`): the
bound for comparing with another library, neither result being exact.
"""

from __future__ import annotations

import numpy as np

EPSILON = {"float64": 1e-12, "float32": 1e-4, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def rms(array) -> float:
    values = np.asarray(array, dtype=np.float64)
    return float(np.sqrt(np.mean(values**2))) if values.size else 0.0


def assert_close(actual, expected, dtype, num_terms: int, a, b, what: str = "") -> None:
    eps = EPSILON[np.dtype(dtype).name]
    atol = 4 * eps * np.sqrt(max(num_terms, 1)) * rms(a) * rms(b)
    np.testing.assert_allclose(
        np.asarray(actual, dtype=np.float64), expected, rtol=eps, atol=atol, err_msg=f"{what} ({np.dtype(dtype)})"
    )


def assert_agree(ours, theirs, dtype, num_terms: int, a, b, what: str = "") -> None:
    """Two results of the same sums in `dtype`, each within `assert_close`'s bound of the exact one."""
    eps = EPSILON[np.dtype(dtype).name]
    atol = 8 * eps * np.sqrt(max(num_terms, 1)) * rms(a) * rms(b)
    np.testing.assert_allclose(
        np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64), rtol=2 * eps, atol=atol,
        err_msg=f"{what} ({np.dtype(dtype)}): the two libraries disagree",
    )
