"""spconv's geometry: convolutions with a `padding`, whose outputs are every voxel a kernel tap reaches.

With kernel size K, stride s, dilation d and padding p per axis, and tap j = 0..K-1 along it (j = o - o_0,
o the kernel offset of `coords.kernel_offsets` and o_0 the first one):
- a padded convolution (spconv's "regular" SparseConv, stride 1 included) has an output o wherever some
  input x and tap j give `x = o·s - p + d·j`; one input reaches up to ceil(K / s) outputs per axis;
- a padded transposed convolution (spconv's SparseConvTranspose) has the outputs `x·s - p + d·j`, the
  pairs of the padded convolution of the same geometry that they would be inputs of;
- the inverse of a padded convolution (spconv's SparseInverseConv) reverses its pairs, back to its input.
Where the input has a spatial shape S (spconv's `spatial_shape`: every coordinate in [0, S)), only the outputs
in [0, S') are kept, S' = floor((S + 2p - d·(K - 1) - 1) / s) + 1, or (S - 1)·s - 2p + K transposed (spconv's
formulas; its transposed one leaves the dilation out). Without one, every output reached is kept.

With c = d·((K - 1) // 2) - p, tap j of offset o_k is `x = o·s + c + d·o_k`: the pairs of output o are those
of a submanifold query at its anchor `o·s + c`; transposed, `x = (o - c - d·o_k) / s`, the generative query
at the anchor `o - c`. So the maps come from the query every other map uses (`hashing.Query`), shifted by c.
On the GPU the outputs reached come from one hash table of the candidates (`hashing.unique_reached`).
"""

from __future__ import annotations

import math

import numpy as np

from cupysparse.cuda.backend import is_cupy_array
from cupysparse.geometry.coords import (
    as_tuple,
    check_candidate_memory,
    check_row_count,
    kernel_offsets,
    key_layout,
    offset_range,
)
from cupysparse.geometry.hashing import Query, unique_coordinates, unique_reached

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def as_padding(value, spatial_dims: int) -> tuple[int, ...]:
    """An int or D ints (as `as_tuple` takes them), each non-negative: a padding per axis."""
    return as_tuple(value, spatial_dims, "padding", minimum=0)


def spconv_grid(coordinates: np.ndarray, stride) -> tuple[np.ndarray, list[int]]:
    """NumPy `[N, 1 + D]` coordinates shifted to non-negative by a multiple of `stride` (D ints: a network's
    coarsest stride, so that floor(x / s) at every level is the unshifted one, shifted), and a spatial shape, a
    multiple of `stride`, that holds them: a padded network's input as spconv's detectors place it."""
    stride = np.asarray(stride, dtype=np.int64)
    shifted = coordinates.copy()
    shifted[:, 1:] -= coordinates[:, 1:].min(axis=0) // stride * stride
    return shifted, ((shifted[:, 1:].max(axis=0) // stride + 1) * stride).tolist()


def conv_output_shape(spatial_shape, kernel_size, stride, dilation, padding) -> tuple[int, ...]:
    """The spatial shape of a padded convolution's output, spconv's `get_conv_output_size`; ValueError where
    the kernel does not fit the padded input along an axis (spconv's "out spatial shape reach zero")."""
    shape = tuple((size + 2 * p - d * (k - 1) - 1) // s + 1
                  for size, k, s, d, p in zip(spatial_shape, kernel_size, stride, dilation, padding))
    return _positive(shape, spatial_shape, kernel_size, stride, dilation, padding)


def transposed_output_shape(spatial_shape, kernel_size, stride, dilation, padding) -> tuple[int, ...]:
    """The spatial shape of a padded transposed convolution's output, spconv's `get_deconv_output_size`."""
    shape = tuple((size - 1) * s - 2 * p + k for size, k, s, p in zip(spatial_shape, kernel_size, stride, padding))
    return _positive(shape, spatial_shape, kernel_size, stride, dilation, padding)


def _positive(shape, spatial_shape, kernel_size, stride, dilation, padding) -> tuple[int, ...]:
    if min(shape) < 1:
        raise ValueError(
            f"a convolution with kernel {kernel_size}, stride {stride}, dilation {dilation} and padding {padding} "
            f"over spatial shape {tuple(spatial_shape)} has no output voxels (output spatial shape {shape})"
        )
    return shape


def anchor_shift(kernel_size, dilation, padding) -> np.ndarray:
    """c = d·((K - 1) // 2) - p per axis, int64 `[D]`: how far tap 0 of output o lies from o·s (see the module)."""
    first = np.asarray([offset_range(k).start for k in kernel_size], dtype=np.int64)
    return -np.asarray(dilation, dtype=np.int64) * first - np.asarray(padding, dtype=np.int64)


def padded_query(kernel_size, stride, dilation, padding, transposed: bool = False) -> Query:
    """The pair-table query of a padded map from its outputs (see the module): the submanifold query at the
    anchors `o·s + c`, transposed the generative one at `o - c`; ValueError when c leaves int32 (a dilation or
    padding near 2^31)."""
    shift = tuple(int(c) for c in (-1 if transposed else 1) * anchor_shift(kernel_size, dilation, padding))
    if any(not _INT32_MIN <= c <= _INT32_MAX for c in shift):
        raise ValueError(f"a padded convolution's kernel reaches past int32 coordinates (kernel {tuple(kernel_size)}, "
                         f"dilation {tuple(dilation)}, padding {tuple(padding)})")
    ones = (1,) * len(kernel_size)
    if transposed:
        return Query(kernel_size, dilation, out_scale=ones, divisor=stride, sign=-1, shift=shift)
    return Query(kernel_size, dilation, out_scale=stride, divisor=ones, shift=shift)


def reached_coordinates(coords, kernel_size, stride, dilation, padding, out_shape=None, transposed=False):
    """The outputs of a padded convolution of `coords` (transposed: of a padded transposed one), unique, in
    order of first occurrence with input rows outer and taps inner, kept in [0, out_shape) when it is given.

    Raises ValueError when one falls outside the key range, or when the candidates (input rows x taps) are
    more than `coords.MAX_ROWS`; MemoryError when the NumPy path's candidates do not fit the host memory.
    """
    kernel_volume = math.prod(kernel_size)
    spatial_dims = coords.shape[1] - 1
    kind = "padded transposed convolution" if transposed else "padded convolution"
    described = f"the candidates of a {kind} ({coords.shape[0]} input rows x {kernel_volume} taps)"
    check_row_count(coords.shape[0] * kernel_volume, described)
    layout = key_layout(spatial_dims)
    out_of_range = ValueError(
        f"a {kind} (kernel {kernel_size}, stride {stride}, dilation {dilation}, padding {padding}) would create "
        f"coordinates outside [{layout.coord_min}, {layout.coord_max}], the range of D = {spatial_dims}"
    )
    if is_cupy_array(coords):
        outputs, left_the_range = unique_reached(coords, kernel_size, stride, dilation, padding, out_shape, transposed)
        if left_the_range:
            raise out_of_range
        return outputs
    check_candidate_memory(coords.shape[0] * kernel_volume, spatial_dims, described)
    reach = kernel_offsets(kernel_size) * np.asarray(dilation, dtype=np.int64)  # d·o_k, [K, D]
    shift = anchor_shift(kernel_size, dilation, padding)
    step = np.asarray(stride, dtype=np.int64)
    spatial = coords[:, None, 1:].astype(np.int64)
    if transposed:
        spatial = spatial * step + (reach + shift)[None]
        valid = np.ones(spatial.shape[:2], dtype=bool)
    else:
        spatial = spatial - (reach + shift)[None]
        valid = np.all(spatial % step == 0, axis=2)
        spatial //= step
    if out_shape is not None:
        valid &= np.all((spatial >= 0) & (spatial < np.asarray(out_shape, dtype=np.int64)), axis=2)
    rows, taps = np.nonzero(valid)
    spatial = spatial[rows, taps]
    if spatial.size and (int(spatial.min()) < layout.coord_min or int(spatial.max()) > layout.coord_max):
        raise out_of_range
    candidates = np.empty((rows.shape[0], 1 + spatial_dims), dtype=np.int32)
    candidates[:, 0] = coords[rows, 0]
    candidates[:, 1:] = spatial
    return unique_coordinates(candidates)
