"""Coordinates, their hash tables and kernel maps, and the sparse tensor that carries them."""

from cupysparse.geometry.kernel_map import (
    KernelMap,
    KernelMapCache,
    MapRequest,
    MapResult,
    generative_map,
    padded_generative_map,
    padded_map,
    strided_map,
    submanifold_map,
    transposed_map,
)
from cupysparse.geometry.sparse_tensor import SparseTensor

__all__ = [
    "KernelMap",
    "KernelMapCache",
    "MapRequest",
    "MapResult",
    "SparseTensor",
    "generative_map",
    "padded_generative_map",
    "padded_map",
    "strided_map",
    "submanifold_map",
    "transposed_map",
]
