"""The convolution algorithms. Importing this package registers every one of them."""

from cupysparse.algorithms import depthwise, explicit_gemm, implicit_gemm, tensor_core  # noqa: F401 (registration)
from cupysparse.algorithms.base import (
    CONV,
    DEPTHWISE,
    KINDS,
    Algorithm,
    BackwardPlan,
    ConvProblem,
    ForwardPlan,
    get_algorithm,
    reference_algorithm,
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
    "reference_algorithm",
    "register",
    "registered",
]
