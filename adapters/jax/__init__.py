"""JAX adapter: jittable, differentiable sparse convolutions on `SparseTensor`s of JAX arrays.

Kernel maps depend on the data (their sizes are the numbers of voxels and pairs), so they are
built outside the compiled computation: from the concrete coordinates of a `SparseTensor`, in
Python, the first time a trace needs them, and kept in the tensor's map cache. The convolutions
run inside `jit` as `jax.custom_vjp` functions (forward, input gradient, weight gradient):

    x = SparseTensor(coordinates, features)            # outside jit: coordinates are validated
    layer = SparseConv(32, 64, kernel_size=3)
    params = layer.init(jax.random.key(0))
    loss = lambda params, x: layer.apply(params, x).features.sum()
    grads = jax.jit(jax.grad(loss))(params, x)          # x is a pytree; its geometry is static

On a GPU the core's CuPy kernels (autotuned) run on XLA's own stream through
`jax.experimental.buffer_callback`, reading and writing XLA's buffers in place, with one
device-to-device copy per result; on the CPU a pure `jax.numpy` implementation runs (`ops`).

GPU memory: by default JAX preallocates 75% of the GPU at its first GPU operation
(`XLA_PYTHON_CLIENT_PREALLOCATE`, `XLA_PYTHON_CLIENT_MEM_FRACTION`), while CuPy draws the kernel
maps, the callbacks' workspaces and the tuner's trial runs from its own memory pool. To share the
GPU, set before JAX first touches it either `XLA_PYTHON_CLIENT_PREALLOCATE=false` (JAX allocates
as it goes) or a fraction that leaves CuPy room, e.g. `XLA_PYTHON_CLIENT_MEM_FRACTION=0.6`.
`cupy.get_default_memory_pool().set_limit(...)` caps CuPy's side and `.free_all_blocks()` returns
its cached blocks to the driver.
"""

from cupysparse.adapters.jax.functional import conv, depthwise_conv
from cupysparse.adapters.jax.layers import LayerNorm, SparseConv, SparseDepthwiseConv, relu
from cupysparse.adapters.jax.ops import IMPLEMENTATIONS, sparse_conv, sparse_depthwise_conv
from cupysparse.adapters.jax.tensor import Geometry, SparseTensor, cat

__all__ = [
    "IMPLEMENTATIONS",
    "Geometry",
    "LayerNorm",
    "SparseConv",
    "SparseDepthwiseConv",
    "SparseTensor",
    "cat",
    "conv",
    "depthwise_conv",
    "relu",
    "sparse_conv",
    "sparse_depthwise_conv",
]
