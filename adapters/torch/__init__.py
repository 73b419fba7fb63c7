"""PyTorch adapter: sparse tensors, differentiable convolutions and pooling, and `torch.nn` modules.

    import torch
    from cupysparse.adapters import torch as cst

    x = cst.SparseTensor(coordinates_int32, features)          # [N, 1 + D], [N, C]
    net = torch.nn.Sequential(cst.SubMConv3d(16, 32, 3), cst.SparseBatchNorm(32), cst.SparseReLU(),
                              cst.SparseConv3d(32, 64, 2, stride=2))
    y = net(x)                                                  # a SparseTensor; y.features has grad

Data-parallel training: `convert_sync_batchnorm` (batch norm over every rank's voxels) and
`share_tuning` (the same algorithm choices on every rank), in `distributed`.

CUDA tensors run the core's CuPy kernels zero-copy on torch's current stream and allocator; CPU
tensors run the NumPy path. The convolutions are `torch.library` custom ops (`cupysparse::*`)
with fake implementations, so they compile with `torch.compile` and record into CUDA graphs.
"""

from cupysparse.adapters.torch.distributed import SparseSyncBatchNorm, convert_sync_batchnorm, share_tuning
from cupysparse.adapters.torch.convolution import (
    SparseConv2d,
    SparseConv3d,
    SparseConvTranspose2d,
    SparseConvTranspose3d,
    SparseDepthwiseConv,
    SparseInverseConv2d,
    SparseInverseConv3d,
    SpatiallySparseConv,
    SubMConv2d,
    SubMConv3d,
    sparse_conv,
    sparse_depthwise_conv,
)
from cupysparse.adapters.torch.pointwise import PerVoxel, SparseBatchNorm, SparseDropout, SparseLayerNorm, SparseReLU
from cupysparse.adapters.torch.pooling import (
    GlobalAvgPool,
    GlobalMaxPool,
    SparseAvgPool,
    SparseMaxPool,
    SparseUnpool,
    global_avg_pool,
    global_max_pool,
    sparse_avg_pool,
    sparse_max_pool,
    sparse_unpool,
)
from cupysparse.adapters.torch.spconv import from_spconv, from_spconv_tensor, load_spconv_state_dict, to_spconv_tensor
from cupysparse.adapters.torch.tensor import SparseTensor

__all__ = [
    "GlobalAvgPool",
    "GlobalMaxPool",
    "PerVoxel",
    "SparseAvgPool",
    "SparseBatchNorm",
    "SparseConv2d",
    "SparseConv3d",
    "SparseConvTranspose2d",
    "SparseConvTranspose3d",
    "SparseDepthwiseConv",
    "SparseDropout",
    "SparseInverseConv2d",
    "SparseInverseConv3d",
    "SparseLayerNorm",
    "SparseMaxPool",
    "SparseReLU",
    "SparseSyncBatchNorm",
    "SparseTensor",
    "SparseUnpool",
    "SpatiallySparseConv",
    "SubMConv2d",
    "SubMConv3d",
    "global_avg_pool",
    "global_max_pool",
    "convert_sync_batchnorm",
    "from_spconv",
    "from_spconv_tensor",
    "load_spconv_state_dict",
    "sparse_avg_pool",
    "sparse_conv",
    "sparse_depthwise_conv",
    "sparse_max_pool",
    "sparse_unpool",
    "share_tuning",
    "to_spconv_tensor",
]
