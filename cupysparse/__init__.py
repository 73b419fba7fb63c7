"""cupysparse: spatially sparse convolution for voxel data, CUDA kernels compiled at run time.

The package follows the data: `geometry` (coordinates, hash tables, kernel maps, `SparseTensor`) →
`algorithms` (one registry; explicit, implicit SIMT and tensor-core GEMMs) → `tuning` (search spaces,
the autotuner, its cache, launch plans) → `functional` (the convolution, pooling and epilogue API),
over `cuda` (array backend, NVRTC, launches) and `settings` (every environment variable); `networks`
and `data` build on them, and `adapters` bring PyTorch and JAX to the same path. This module
re-exports the public API.
"""

from cupysparse.cuda import precision
from cupysparse.cuda.precision import fp32_precision, get_fp32_precision, set_fp32_precision
from cupysparse.functional import (
    ConvGradients,
    batch_norm_epilogue,
    global_avg_pool,
    global_max_pool,
    sparse_avg_pool,
    sparse_max_pool,
    sparse_unpool,
    spatially_sparse_conv,
    spatially_sparse_conv_backward,
    spatially_sparse_depthwise_conv,
    spatially_sparse_depthwise_conv_backward,
    training_batch_norm,
    training_batch_norm_backward,
)
from cupysparse.geometry import KernelMap, SparseTensor
from cupysparse.tuning.search_space import (
    SPARSE_CONV_BWD_ALGO_MODE,
    SPARSE_CONV_FWD_ALGO_MODE,
    SPARSE_DEPTHWISE_CONV_BWD_ALGO_MODE,
    SPARSE_DEPTHWISE_CONV_FWD_ALGO_MODE,
)

__version__ = "0.1.0"

__all__ = [
    "SPARSE_CONV_BWD_ALGO_MODE",
    "SPARSE_CONV_FWD_ALGO_MODE",
    "SPARSE_DEPTHWISE_CONV_BWD_ALGO_MODE",
    "SPARSE_DEPTHWISE_CONV_FWD_ALGO_MODE",
    "ConvGradients",
    "KernelMap",
    "SparseTensor",
    "batch_norm_epilogue",
    "fp32_precision",
    "get_fp32_precision",
    "global_avg_pool",
    "global_max_pool",
    "precision",
    "set_fp32_precision",
    "sparse_avg_pool",
    "sparse_max_pool",
    "sparse_unpool",
    "spatially_sparse_conv",
    "spatially_sparse_conv_backward",
    "spatially_sparse_depthwise_conv",
    "spatially_sparse_depthwise_conv_backward",
    "training_batch_norm",
    "training_batch_norm_backward",
]
