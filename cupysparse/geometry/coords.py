"""Integer voxel coordinates: validation, 64-bit key packing and kernel offsets.

Coordinates are int32 `[N, 1 + D]`, column 0 the batch index, columns 1..D the voxel position in
units of the tensor's own stride. A key packs the batch index into the high bits and each spatial
coordinate, two's-complement, into a fixed-width field below it. `raw_kernels/coordinate_key.cuh`
implements the same packing on the GPU; the two must change together.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from cupysparse.cuda.backend import all_true, any_true, array_module

MAX_SPATIAL_DIMS = 4
# Rows are indexed with int32 (pair tables, pair lists, kernel arguments), and a kernel's thread
# index runs up to one block (at most 1024 threads) past the last row, so an array of coordinates,
# or any set of rows a map is built over, has at most this many rows.
MAX_ROWS = 2**31 - 1024
# Kernel sizes, strides and dilations reach the kernels as int32.
MAX_GEOMETRY_VALUE = 2**31 - 1


@dataclass(frozen=True)
class KeyLayout:
    """Bit layout of a packed coordinate key for D spatial dimensions."""

    spatial_dims: int
    coord_bits: int

    @property
    def batch_bits(self) -> int:
        return 64 - self.spatial_dims * self.coord_bits

    @property
    def coord_min(self) -> int:
        return -(1 << (self.coord_bits - 1))

    @property
    def coord_max(self) -> int:
        return (1 << (self.coord_bits - 1)) - 1

    @property
    def batch_max(self) -> int:
        # The all-ones key marks an empty hash slot, so the largest batch index stays unused.
        return (1 << self.batch_bits) - 2


_COORD_BITS = {2: 24, 3: 18, 4: 14}


def key_layout(spatial_dims: int) -> KeyLayout:
    if spatial_dims not in _COORD_BITS:
        raise ValueError(f"coordinates need 2..{MAX_SPATIAL_DIMS} spatial dimensions, got {spatial_dims}")
    return KeyLayout(spatial_dims, _COORD_BITS[spatial_dims])


def pack_keys(coords):
    """Pack int coordinates `[N, 1 + D]` (NumPy or CuPy) into uint64 keys `[N]`.

    Keys order like (batch, c1, …, cD) with each coordinate biased to non-negative, so sorting
    keys sorts coordinates lexicographically.
    """
    xp = array_module(coords)
    layout = key_layout(coords.shape[1] - 1)
    mask = np.uint64((1 << layout.coord_bits) - 1)
    bias = np.int64(-layout.coord_min)
    keys = coords[:, 0].astype(np.uint64) << np.uint64(64 - layout.batch_bits)
    for axis in range(layout.spatial_dims):
        shift = np.uint64((layout.spatial_dims - 1 - axis) * layout.coord_bits)
        field = (coords[:, 1 + axis].astype(np.int64) + bias).astype(np.uint64) & mask
        keys |= field << shift
    return xp.asarray(keys, dtype=np.uint64)


def unpack_keys(keys, spatial_dims: int):
    """Inverse of `pack_keys`: uint64 keys `[N]` → int32 coordinates `[N, 1 + D]`."""
    xp = array_module(keys)
    layout = key_layout(spatial_dims)
    mask = np.uint64((1 << layout.coord_bits) - 1)
    coords = xp.empty((keys.shape[0], 1 + spatial_dims), dtype=np.int32)
    coords[:, 0] = (keys >> np.uint64(64 - layout.batch_bits)).astype(np.int32)
    for axis in range(spatial_dims):
        shift = np.uint64((spatial_dims - 1 - axis) * layout.coord_bits)
        coords[:, 1 + axis] = ((keys >> shift) & mask).astype(np.int64) + layout.coord_min
    return coords


def as_tuple(value, spatial_dims: int, name: str) -> tuple[int, ...]:
    """Broadcast an int or a length-D sequence of positive ints to a D-tuple."""
    if isinstance(value, (int, np.integer)):
        values = (int(value),) * spatial_dims
    else:
        values = tuple(int(v) for v in value)
        if len(values) != spatial_dims:
            raise ValueError(f"{name} must be an int or {spatial_dims} ints, got {value!r}")
    if any(v < 1 for v in values):
        raise ValueError(f"{name} must be positive, got {value!r}")
    if any(v > MAX_GEOMETRY_VALUE for v in values):
        raise ValueError(f"{name} must be at most {MAX_GEOMETRY_VALUE}, got {value!r}")
    return values


def check_row_count(num_rows: int, name: str) -> None:
    """ValueError unless `num_rows` rows fit the int32 row indices (`MAX_ROWS`)."""
    if num_rows > MAX_ROWS:
        raise ValueError(
            f"{name} has {num_rows} rows, more than the {MAX_ROWS} that cupysparse's int32 row indices "
            "address: split the input (e.g. by batch item)"
        )


def offset_range(size: int) -> range:
    """Offsets of one kernel axis: -r..r for odd sizes; 0..1 for 2, -1..2 for 4 (even sizes lean positive)."""
    return range(-((size - 1) // 2), size // 2 + 1)


def kernel_offsets(kernel_size: tuple[int, ...]) -> np.ndarray:
    """Kernel offsets `[K, D]` int32 in lexicographic order of (d0, d1, …), d0 slowest."""
    return np.array(list(itertools.product(*(offset_range(s) for s in kernel_size))), dtype=np.int32).reshape(
        -1, len(kernel_size)
    )


def check_coordinate_layout(coords, name: str = "coordinates") -> None:
    """The checks of `validate_coordinates` that read no values (type, dtype, shape): free on the GPU."""
    if not hasattr(coords, "dtype") or not hasattr(coords, "shape"):
        raise TypeError(f"{name} must be a NumPy or CuPy array, got {type(coords).__name__}")
    if coords.dtype != np.int32:
        raise TypeError(f"{name} must be int32, got {coords.dtype}")
    if coords.ndim != 2 or not 3 <= coords.shape[1] <= 1 + MAX_SPATIAL_DIMS:
        raise ValueError(
            f"{name} must have shape [N, 1 + D] (batch index, then D = 2..{MAX_SPATIAL_DIMS} coordinates), "
            f"got {tuple(coords.shape)}"
        )
    check_row_count(coords.shape[0], name)


def validate_coordinates(coords, name: str = "coordinates") -> None:
    """Raise TypeError/ValueError, naming `name`, unless `coords` is a valid coordinate array.

    Valid: int32 `[N, 1 + D]` with 2 ≤ D ≤ 4, every value inside the key layout's range, batch
    indices 0..B-1 with none missing, no coordinate twice. On CuPy arrays this synchronises.
    """
    check_coordinate_layout(coords, name)
    if coords.shape[0] == 0:
        return
    xp = array_module(coords)
    layout = key_layout(coords.shape[1] - 1)
    lows = coords.min(axis=0)
    highs = coords.max(axis=0)
    lows, highs = (lows.get(), highs.get()) if xp is not np else (lows, highs)
    if lows[0] < 0:
        raise ValueError(f"{name}: batch indices (column 0) must be non-negative, got {int(lows[0])}")
    if highs[0] > layout.batch_max:
        raise ValueError(f"{name}: batch index {int(highs[0])} exceeds {layout.batch_max} for D = {layout.spatial_dims}")
    if lows[1:].min() < layout.coord_min or highs[1:].max() > layout.coord_max:
        raise ValueError(
            f"{name}: spatial coordinates must lie in [{layout.coord_min}, {layout.coord_max}] for "
            f"D = {layout.spatial_dims}, got [{int(lows[1:].min())}, {int(highs[1:].max())}]"
        )
    present = xp.zeros(int(highs[0]) + 1, dtype=bool)
    present[coords[:, 0]] = True
    if not all_true(present):
        missing = int(xp.argmin(present))
        raise ValueError(f"{name}: batch indices must be 0..{int(highs[0])} with none missing; batch {missing} is empty")
    keys = xp.sort(pack_keys(coords))
    repeated = keys[1:] == keys[:-1]
    if any_true(repeated):
        first = int(xp.argmax(repeated))
        duplicate = unpack_keys(keys[first : first + 1], layout.spatial_dims)[0]
        raise ValueError(f"{name}: duplicate coordinate {[int(v) for v in duplicate]}")
