"""cupysparse: spatially sparse convolution for voxel data, CUDA kernels compiled at run time."""

from .algorithm_modes import (
    SPARSE_CONV_BWD_ALGO_MODE,
    SPARSE_CONV_FWD_ALGO_MODE,
    SPARSE_DEPTHWISE_CONV_BWD_ALGO_MODE,
    SPARSE_DEPTHWISE_CONV_FWD_ALGO_MODE,
)
from . import precision
from .functional import (
    spatially_sparse_conv,
    spatially_sparse_conv_backward,
    spatially_sparse_depthwise_conv,
    spatially_sparse_depthwise_conv_backward,
)
from .sparse_tensor import SparseTensor

__version__ = "0.1.0"

__all__ = [
    "SPARSE_CONV_BWD_ALGO_MODE",
    "SPARSE_CONV_FWD_ALGO_MODE",
    "SPARSE_DEPTHWISE_CONV_BWD_ALGO_MODE",
    "SPARSE_DEPTHWISE_CONV_FWD_ALGO_MODE",
    "SparseTensor",
    "precision",
    "spatially_sparse_conv",
    "spatially_sparse_conv_backward",
    "spatially_sparse_depthwise_conv",
    "spatially_sparse_depthwise_conv_backward",
]
