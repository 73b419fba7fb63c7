"""The convolution algorithms. Importing this package registers every one of them."""

from . import depthwise, explicit_gemm, implicit_gemm, mma_implicit_gemm, wmma_implicit_gemm  # noqa: F401  (registration)
from .base import (
    CONV,
    DEPTHWISE,
    KINDS,
    Algorithm,
    BackwardPlan,
    ConvProblem,
    ForwardPlan,
    get_algorithm,
    register,
    registered,
)

__all__ = [
    "CONV",
    "DEPTHWISE",
    "KINDS",
    "Algorithm",
    "BackwardPlan",
    "ConvProblem",
    "ForwardPlan",
    "get_algorithm",
    "register",
    "registered",
]
