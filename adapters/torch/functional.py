"""The functional API of the PyTorch adapter (`from cupysparse.adapters.torch import functional as F`):
convolutions (`convolution`), pooling (`pooling`) and the batch norm inference epilogue (`pointwise`)."""

from cupysparse.adapters.torch.convolution import pair_table, sparse_conv, sparse_depthwise_conv
from cupysparse.adapters.torch.pointwise import batch_norm_epilogue
from cupysparse.adapters.torch.pooling import (
    global_avg_pool,
    global_max_pool,
    sparse_avg_pool,
    sparse_max_pool,
    sparse_unpool,
)

__all__ = [
    "batch_norm_epilogue",
    "global_avg_pool",
    "global_max_pool",
    "pair_table",
    "sparse_avg_pool",
    "sparse_conv",
    "sparse_depthwise_conv",
    "sparse_max_pool",
    "sparse_unpool",
]
