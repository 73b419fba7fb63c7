"""The convolution algorithms. Importing this package registers every one of them."""

from . import (  # noqa: F401  (registration)
    depthwise,
    explicit_gemm,
    implicit_gemm,
    mma_implicit_gemm,
    wgmma_implicit_gemm,
    wmma_implicit_gemm,
)
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
