"""Convolution weights between cupysparse's layout and those of torch.nn and spconv.

cupysparse: `[K, C_in, C_out]`, K the kernel offsets in lexicographic order over the coordinate
columns 1..D (column 1 slowest). Along an axis of size `n`, kernel index `d = 0..n-1` is offset
`o = d - (n - 1) // 2`: -r..r for odd sizes, 0..1 for size 2, -1..2 for size 4
(`coords.offset_range`). A convolution is `out[p] = Σ_k W_k^T · in[p·stride + dilation·o_k]`; a
transposed one uses the same pairs with input and output swapped,
`out[q·stride + dilation·o_k] += W_k^T · in[q]`, W_k being `[C_in (coarse), C_out (fine)]`.

torch.nn.Conv2d / Conv3d, weight `[C_out, C_in, *k]`, kernel axis i along coordinate column 1 + i,
computes the cross-correlation `out[p] = Σ_d w[:, :, d] · in[p·stride + dilation·d - pad]`.
With `pad = dilation·((n - 1) // 2)` the two agree term by term, `d - (n - 1) // 2 = o`, so
`W_k = w[:, :, d(k)]^T`: a transpose of the channel axes, no flip. That padding is torch's
symmetric `padding=dilation·r` for odd sizes; for even sizes it is asymmetric (size 2: nothing on
the left; size 4: dilation on the left, 2·dilation on the right for a same-size output).

torch.nn.ConvTranspose2d / 3d, weight `[C_in, C_out, *k]`, computes
`out[i·stride + dilation·d - pad] += w[:, :, d]^T · in[i]` (the adjoint of the convolution above).
With the same `pad`, `i·stride + dilation·d - pad = q·stride + dilation·o`, so again
`W_k = w[:, :, d(k)]`, no flip: the transposed convolution scatters through the pairs of the
strided one. (A flip appears only if one writes it as a gather on the fine grid,
`out[f] = Σ_k W_k^T · in[(f - dilation·o_k) / stride]`.) torch's `padding` crops `pad` on both
sides; the fine voxel at coordinate f is torch's output index `f + pad` with `padding=0`.

spconv 2.x SubMConv / SparseConv / SparseInverseConv, weight `[C_out, *k, C_in]` (KRSC), with
kernel axes in the order of its index columns, which must be cupysparse's coordinate columns:
`W_k = w[:, d(k), :]^T`: kernel index d pairs `in[q·stride - padding + dilation·d]` with output q, and
its inverse convolution, like ours, reuses the pairs of the forward one. Its submanifold convolution is
ours (whatever its padding, which it ignores). Its strided ("regular") convolution outputs every voxel a
kernel index reaches, inside its output spatial shape, not `unique(floor(in / stride))`: our convolutions
built with spconv's `padding` compute it (`cupysparse.geometry.padding`; `adapters.torch.from_spconv`
converts a model), our unpadded ones only where both rules give the same voxels (size = stride, padding 0,
no voxel cut off by the spatial shape).

Dilation does not change any layout. Inputs are NumPy or CuPy arrays, or anything `np.asarray`
takes (a CPU torch tensor: pass `tensor.detach()`; CUDA tensors go through the PyTorch adapter,
which hands over CuPy arrays). Results are new C-contiguous arrays on the input's backend, in its
dtype, and every round trip is exact.
"""

from __future__ import annotations

import math

import numpy as np

from cupysparse.cuda.backend import is_cupy_array
from cupysparse.geometry.coords import MAX_SPATIAL_DIMS


def _as_array(weight, name: str, ndim_range: tuple[int, int]):
    array = weight if is_cupy_array(weight) else np.asarray(weight)
    low, high = ndim_range
    if not low <= array.ndim <= high:
        raise ValueError(f"{name} must have {low}..{high} dimensions, got shape {tuple(array.shape)}")
    return array


def _dense(weight, name: str):
    """A dense weight with 2..MAX_SPATIAL_DIMS kernel axes besides its two channel axes."""
    return _as_array(weight, name, (4, 2 + MAX_SPATIAL_DIMS))


def _ours(weight):
    return _as_array(weight, "weight ([K, C_in, C_out])", (3, 3))


def _kernel_shape(kernel_size, kernel_volume: int) -> tuple[int, ...]:
    """The kernel shape `kernel_size` (a D-tuple, or an int when K determines D) for K offsets."""
    if isinstance(kernel_size, (int, np.integer)):
        dims = [d for d in range(2, MAX_SPATIAL_DIMS + 1) if int(kernel_size) ** d == kernel_volume]
        if len(dims) != 1:
            raise ValueError(
                f"kernel_size {kernel_size} does not determine the number of dimensions for K = {kernel_volume}: "
                "pass one size per dimension"
            )
        return (int(kernel_size),) * dims[0]
    shape = tuple(int(size) for size in kernel_size)
    if not 2 <= len(shape) <= MAX_SPATIAL_DIMS or min(shape) < 1 or math.prod(shape) != kernel_volume:
        raise ValueError(f"kernel_size {tuple(kernel_size)} does not give the weight's K = {kernel_volume} offsets")
    return shape


def from_torch_conv_weight(weight):
    """torch Conv2d/Conv3d `[C_out, C_in, *k]` → cupysparse `[K, C_in, C_out]`."""
    weight = _dense(weight, "weight ([C_out, C_in, *kernel_size])")
    out_channels, in_channels = weight.shape[:2]
    return weight.reshape(out_channels, in_channels, -1).transpose(2, 1, 0).copy()


def to_torch_conv_weight(weight, kernel_size):
    """cupysparse `[K, C_in, C_out]` → torch Conv2d/Conv3d `[C_out, C_in, *kernel_size]`."""
    weight = _ours(weight)
    kernel_volume, in_channels, out_channels = weight.shape
    shape = _kernel_shape(kernel_size, kernel_volume)
    return weight.transpose(2, 1, 0).reshape(out_channels, in_channels, *shape).copy()


def from_torch_conv_transpose_weight(weight):
    """torch ConvTranspose2d/3d `[C_in, C_out, *k]` → cupysparse `[K, C_in, C_out]` (no flip)."""
    weight = _dense(weight, "weight ([C_in, C_out, *kernel_size])")
    in_channels, out_channels = weight.shape[:2]
    return weight.reshape(in_channels, out_channels, -1).transpose(2, 0, 1).copy()


def to_torch_conv_transpose_weight(weight, kernel_size):
    """cupysparse `[K, C_in, C_out]` → torch ConvTranspose2d/3d `[C_in, C_out, *kernel_size]`."""
    weight = _ours(weight)
    kernel_volume, in_channels, out_channels = weight.shape
    shape = _kernel_shape(kernel_size, kernel_volume)
    return weight.transpose(1, 2, 0).reshape(in_channels, out_channels, *shape).copy()


def from_spconv_weight(weight):
    """spconv 2.x `[C_out, *k, C_in]` → cupysparse `[K, C_in, C_out]`."""
    weight = _dense(weight, "weight ([C_out, *kernel_size, C_in])")
    out_channels, in_channels = weight.shape[0], weight.shape[-1]
    return weight.reshape(out_channels, -1, in_channels).transpose(1, 2, 0).copy()


def to_spconv_weight(weight, kernel_size):
    """cupysparse `[K, C_in, C_out]` → spconv 2.x `[C_out, *kernel_size, C_in]`."""
    weight = _ours(weight)
    kernel_volume, in_channels, out_channels = weight.shape
    shape = _kernel_shape(kernel_size, kernel_volume)
    return weight.transpose(2, 0, 1).reshape(out_channels, *shape, in_channels).copy()
