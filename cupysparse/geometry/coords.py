"""Integer voxel coordinates: validation, 64-bit key packing and kernel offsets.

Coordinates are int32 `[N, 1 + D]`, column 0 the batch index, columns 1..D the voxel position in
units of the tensor's own stride. A key packs the batch index into the high bits and each spatial
coordinate, two's-complement, into a fixed-width field below it. `raw_kernels/coordinate_key.cuh`
implements the same packing on the GPU; the two must change together.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import numpy as np

from cupysparse.cuda.backend import all_true, any_true, array_module

MAX_SPATIAL_DIMS = 4
# Rows are indexed with int32 (pair tables, pair lists, kernel arguments), and a kernel's thread
# index runs up to one block (at most 1024 threads) past the last row, so an array of coordinates,
# or any set of rows a map is built over, has at most this many rows.
MAX_ROWS = 2**31 - 1024
# Kernel sizes, strides and dilations reach the kernels as int32, and so does a kernel's volume.
MAX_GEOMETRY_VALUE = 2**31 - 1

# What a kernel map's build holds on the host at its peak, per kernel offset (and row), measured with
# tracemalloc on the NumPy path and rounded up; the checks below sum them before anything is allocated.
# The offsets `[K, D]` as int32 and int64 arrays, a few at once (`kernel_offsets`, a query's shifts), on
# either backend:
_OFFSET_BYTES_PER_AXIS = 32
# On the CPU, the pair table `[K, rows]` (int32), and the query's int64 positions over a block of rows,
# about eight arrays of `[K, block rows, D]` at once:
_PAIR_TABLE_BYTES = 4
_QUERY_BYTES_PER_AXIS = 64
# On the CPU, a generative convolution's candidates (input rows x offsets): their int64 positions, their
# int32 coordinates and the keys, order and copies that deduplicate them, about 4 + 3·D int64 values each.
_CANDIDATE_BYTES, _CANDIDATE_BYTES_PER_AXIS = 32, 24
# An estimate at most this large is taken to fit: asking the OS costs more than building a small map.
_SURELY_FITS_BYTES = 256 * 2**20


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


def is_integer(value) -> bool:
    """A Python or NumPy integer, and not a bool (`True` is an int to Python, never a size or a count)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_sequence(value) -> bool:
    """A tuple, a list or a 1-D NumPy array: what may hold one int per axis."""
    return isinstance(value, (tuple, list)) or (isinstance(value, np.ndarray) and value.ndim == 1)


def _describe(value) -> str:
    """`value` and its type (or that of the first item that is no int), as an error message names what it got."""
    wrong = next((v for v in value if not is_integer(v)), None) if _is_sequence(value) else None
    if wrong is not None:
        return f"{value!r} (a {type(value).__name__} holding a {type(wrong).__name__})"
    return f"{value!r} ({type(value).__name__})"


def as_tuple(value, spatial_dims: int | None, name: str, minimum: int = 1) -> tuple[int, ...]:
    """Broadcast an int or D ints (a tuple, a list or a 1-D NumPy array) to a D-tuple of positive ints
    (`minimum=0`: non-negative ints, as paddings are).

    The one check of every integer geometry argument (kernel sizes, strides, dilations, tensor strides):
    ints are Python or NumPy integers; a bool, a float (even 3.0), a string or None raises TypeError
    naming `name` and what it got, rather than being read as digits or truncated. `spatial_dims` None
    takes any number of ints (one for a single int): a module whose input settles D at each call checks
    the rest when it is built.
    """
    if (type(value) is tuple and value and len(value) == spatial_dims and all(type(v) is int for v in value)
            and minimum <= min(value) and max(value) <= MAX_GEOMETRY_VALUE):
        return value  # already checked, as every map a layer asks for is: the hot path, no copy
    wanted = "an int or ints" if spatial_dims is None else f"an int or {spatial_dims} ints"
    if is_integer(value):
        values = (int(value),) * (1 if spatial_dims is None else spatial_dims)
    elif _is_sequence(value) and all(is_integer(v) for v in value):
        values = tuple(int(v) for v in value)
        if not values or (spatial_dims is not None and len(values) != spatial_dims):
            raise ValueError(f"{name} must be {wanted}, got {value!r}")
    else:
        raise TypeError(f"{name} must be {wanted}, got {_describe(value)}")
    if any(v < minimum for v in values):
        raise ValueError(f"{name} must be {'positive' if minimum == 1 else 'non-negative'}, got {value!r}")
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
    """Kernel offsets `[K, D]` int32 in lexicographic order of (d0, d1, …), d0 slowest (read-only)."""
    if math.prod(kernel_size) <= _CACHED_OFFSETS_VOLUME:
        return _small_kernel_offsets(tuple(kernel_size))
    return _listed_offsets(kernel_size)


# Kernels up to this volume keep their offsets listed (every layer's map asks for them); larger ones are rare.
_CACHED_OFFSETS_VOLUME = 4096


@functools.cache
def _small_kernel_offsets(kernel_size: tuple[int, ...]) -> np.ndarray:
    offsets = _listed_offsets(kernel_size)
    offsets.flags.writeable = False
    return offsets


def _listed_offsets(kernel_size: tuple[int, ...]) -> np.ndarray:
    axes = [np.arange(axis.start, axis.stop, dtype=np.int32) for axis in map(offset_range, kernel_size)]
    return np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, len(kernel_size))


def available_host_memory() -> int:
    """Bytes of host memory new arrays can take now: Linux's MemAvailable (the free memory and the caches
    the kernel can drop), else the free physical pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host_memory(needed_bytes: int, what: str) -> None:
    """MemoryError, before anything is allocated, when `what` (an operation and its sizes) needs an
    estimated `needed_bytes` of host memory and less is available: NumPy would otherwise fill the memory,
    and swap, for minutes before failing, or not fail at all."""
    if needed_bytes <= _SURELY_FITS_BYTES:
        return
    available = available_host_memory()
    if needed_bytes > available:
        raise MemoryError(
            f"{what}: about {needed_bytes / 2**30:,.1f} GiB of host memory needed ({needed_bytes:,} bytes), more "
            f"than the {available / 2**30:,.1f} GiB available; use a smaller kernel or split the input (e.g. by "
            "batch item)"
        )


def check_kernel_volume(kernel_size: tuple[int, ...]) -> None:
    """Raise, naming the kernel size, unless its offsets can be listed: ValueError past `MAX_GEOMETRY_VALUE`
    of them, MemoryError when they do not fit the host memory available (either backend lists them there)."""
    kernel_volume = math.prod(kernel_size)
    if kernel_volume > MAX_GEOMETRY_VALUE:
        raise ValueError(
            f"kernel size {kernel_size} has {kernel_volume:,} offsets, more than the {MAX_GEOMETRY_VALUE:,} "
            "that cupysparse's int32 kernel volume counts"
        )
    check_host_memory(kernel_volume * len(kernel_size) * _OFFSET_BYTES_PER_AXIS,
                      f"the {kernel_volume:,} offsets of kernel size {kernel_size}")


def check_pair_table_memory(kernel_size: tuple[int, ...], num_rows: int, query_block_rows: int) -> None:
    """Before the NumPy path queries a pair table of `kernel_size` over `num_rows` output rows: ValueError
    past `MAX_ROWS` rows (as the query itself refuses them), MemoryError when its offsets, its table and its
    positions over `query_block_rows` rows at a time do not fit the host memory available. A GPU's table
    is left to its allocator, whose error comes at once and names the map's sizes
    (`out_of_memory.naming_map_sizes`)."""
    check_row_count(num_rows, "the output coordinates")
    kernel_volume, spatial_dims = math.prod(kernel_size), len(kernel_size)
    needed = kernel_volume * spatial_dims * _OFFSET_BYTES_PER_AXIS + kernel_volume * num_rows * _PAIR_TABLE_BYTES
    needed += kernel_volume * min(num_rows, query_block_rows) * spatial_dims * _QUERY_BYTES_PER_AXIS
    check_host_memory(needed, f"a kernel map of kernel size {kernel_size} ({kernel_volume:,} offsets) over "
                              f"{num_rows:,} output rows")


def check_candidate_memory(num_candidates: int, spatial_dims: int, what: str) -> None:
    """MemoryError unless the NumPy path's `num_candidates` candidate coordinates of a generative
    convolution, and their deduplication, fit the host memory available (`check_host_memory`)."""
    bytes_per_candidate = _CANDIDATE_BYTES + _CANDIDATE_BYTES_PER_AXIS * spatial_dims
    check_host_memory(num_candidates * bytes_per_candidate, what)


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
