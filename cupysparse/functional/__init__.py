"""The functional API: sparse convolutions, pooling, the inference epilogue and batch norm in training on NumPy or
CuPy arrays."""

from cupysparse.functional.convolution import (
    ConvGradients,
    conv_backward,
    conv_forward,
    select_backward,
    select_forward,
    spatially_sparse_conv,
    spatially_sparse_conv_backward,
    spatially_sparse_depthwise_conv,
    spatially_sparse_depthwise_conv_backward,
)
from cupysparse.functional.epilogue import batch_norm_epilogue
from cupysparse.functional.pooling import (
    global_avg_pool,
    global_avg_pool_backward,
    global_max_pool,
    global_max_pool_backward,
    sparse_avg_pool,
    sparse_avg_pool_backward,
    sparse_max_pool,
    sparse_max_pool_backward,
    sparse_unpool,
    sparse_unpool_backward,
)
from cupysparse.functional.training_norm import training_batch_norm, training_batch_norm_backward

__all__ = [
    "ConvGradients",
    "batch_norm_epilogue",
    "conv_backward",
    "conv_forward",
    "global_avg_pool",
    "global_avg_pool_backward",
    "global_max_pool",
    "global_max_pool_backward",
    "select_backward",
    "select_forward",
    "sparse_avg_pool",
    "sparse_avg_pool_backward",
    "sparse_max_pool",
    "sparse_max_pool_backward",
    "sparse_unpool",
    "sparse_unpool_backward",
    "spatially_sparse_conv",
    "spatially_sparse_conv_backward",
    "spatially_sparse_depthwise_conv",
    "spatially_sparse_depthwise_conv_backward",
    "training_batch_norm",
    "training_batch_norm_backward",
]
