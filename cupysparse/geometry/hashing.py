"""Find the row of a coordinate: a GPU hash table (CuPy) or sorted keys (NumPy), one interface.

`build_index(coords)` returns an index over the rows of `coords`; `index.pair_table(...)` answers,
for every output row and every kernel offset at once, which input row sits at
`(out * out_scale + shift + sign * dilation * offset) / divisor` (or -1), as the table `[K, N_out]`,
together with the offset bitmask when it comes for free (the GPU query writes it; else None).
`build_indices` and `pair_tables` do several at once: on the GPU, in one allocation and one launch.
Submanifold and strided maps use divisor 1, shift 0 and sign +1; generative transposed maps ask with
sign -1 and the stride as divisor; padded maps shift to where their taps start.
`unique_reached` lists the outputs a padded convolution reaches, from one hash table on the GPU.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import numpy as np

from cupysparse.cuda.backend import is_cupy_array
from cupysparse.cuda.compile import MAX_JOBS, ROW_BLOCK, KernelSource
from cupysparse.geometry.coords import MAX_ROWS, check_row_count, key_layout, kernel_offsets, pack_keys

_SCAN_BLOCK = 1024  # threads of a block of `scan_counts_by_row` (raw_kernels/block_scan.cuh)
_SCAN_BLOCKS = f"scan_counts_by_row<unsigned int, {_SCAN_BLOCK}>"
_KERNELS = KernelSource(
    "coordinate_hash.cu",
    tuple(
        f"{name}<{d}>"
        for name in (
            "insert_coordinate_sets",
            "insert_smallest_rows",
            "mark_first_occurrences",
            "write_first_rows",
            "query_pair_tables",
            "insert_reached",
            "mark_first_reached",
            "write_first_reached",
        )
        for d in (2, 3, 4)
    ) + (_SCAN_BLOCKS,),
)

# Slots are {key, value} pairs of uint64, both all ones when empty (see coordinate_key.cuh).
EMPTY_SLOT = np.uint64(0xFFFFFFFFFFFFFFFF)

# Mirrors `struct QueryGeometry` in raw_kernels/coordinate_hash.cu.
_GEOMETRY_DTYPE = np.dtype(
    [
        ("kernel_size", np.int32, (4,)),
        ("out_scale", np.int32, (4,)),
        ("dilation", np.int32, (4,)),
        ("divisor", np.int32, (4,)),
        ("shift", np.int32, (4,)),
        ("sign", np.int32),
    ]
)
# Mirror `struct CoordinateSets` and `struct PairTableQueries` in raw_kernels/coordinate_hash.cu.
_COORDINATE_SETS_DTYPE = np.dtype([("row_starts", np.int64, (MAX_JOBS + 1,)), ("coords", np.uint64, (MAX_JOBS,)),
                                   ("slots", np.uint64, (MAX_JOBS,)), ("capacity_mask", np.uint64, (MAX_JOBS,)),
                                   ("count", np.int32)], align=True)
_PAIR_TABLE_QUERIES_DTYPE = np.dtype(
    [("row_starts", np.int64, (MAX_JOBS + 1,)), ("num_out", np.int32, (MAX_JOBS,)), ("out_coords", np.uint64, (MAX_JOBS,)),
     ("slots", np.uint64, (MAX_JOBS,)),
     ("capacity_mask", np.uint64, (MAX_JOBS,)), ("pair_table", np.uint64, (MAX_JOBS,)),
     ("offset_mask", np.uint64, (MAX_JOBS,)), ("geometry", _GEOMETRY_DTYPE, (MAX_JOBS,)),
     ("kernel_volume", np.int32, (MAX_JOBS,)), ("same_coordinates", np.int32, (MAX_JOBS,)), ("count", np.int32)],
    align=True)


@dataclass(frozen=True)
class Query:
    """Per-axis geometry of a pair-table query; see the module docstring."""

    kernel_size: tuple[int, ...]
    dilation: tuple[int, ...]
    out_scale: tuple[int, ...]
    divisor: tuple[int, ...]
    sign: int = 1
    shift: tuple[int, ...] | None = None  # None: zeros

    def shifts(self) -> tuple[int, ...]:
        return self.shift or (0,) * len(self.kernel_size)

    @functools.cache  # one record per geometry: building it costs more than the query's launch
    def as_struct(self) -> np.void:
        pad = (1,) * (4 - len(self.kernel_size))
        record = np.zeros((), dtype=_GEOMETRY_DTYPE)
        record["kernel_size"] = self.kernel_size + pad
        record["out_scale"] = self.out_scale + pad
        record["dilation"] = self.dilation + pad
        record["divisor"] = self.divisor + pad
        record["shift"] = self.shifts() + (0,) * len(pad)
        record["sign"] = self.sign
        return record[()]


def build_index(coords):
    """An index over the rows of int32 coordinates `[N, 1 + D]` (validated by the caller)."""
    return build_indices([coords])[0]


def build_indices(coordinate_sets) -> list:
    """`build_index` of each of `coordinate_sets` (all NumPy or all CuPy): on the GPU their hash tables share
    one allocation and one memset, and one launch fills up to `MAX_JOBS` of them, where a network's levels
    would otherwise issue each one by one."""
    for coords in coordinate_sets:
        check_row_count(coords.shape[0], "the indexed coordinates")
    if not coordinate_sets or not is_cupy_array(coordinate_sets[0]):
        return [SortedKeyIndex(coords) for coords in coordinate_sets]
    import cupy

    capacities = [_capacity(coords.shape[0]) for coords in coordinate_sets]
    slots = cupy.empty((sum(capacities), 2), dtype=np.uint64)
    _mark_empty(slots.data.ptr, slots.nbytes, cupy.cuda.get_current_stream().ptr)
    starts = itertools.accumulate(capacities, initial=0)
    tables = [GpuHashTable(coords, slots[start : start + capacity])
              for coords, start, capacity in zip(coordinate_sets, starts, capacities)]
    filled = [table for table in tables if table.num_coords]
    if filled:
        _KERNELS.launch_batches(f"insert_coordinate_sets<{filled[0].spatial_dims}>", _COORDINATE_SETS_DTYPE,
                                [table.num_coords for table in filled],
                                {"coords": [table.coords.data.ptr for table in filled],
                                 "slots": [table.slots.data.ptr for table in filled],
                                 "capacity_mask": [table.capacity_mask for table in filled]})
    return tables


def pair_tables(queries) -> list:
    """`index.pair_table(out_coords, query, same_coordinates)` of each of `queries`, (index, out_coords, query,
    same_coordinates) tuples of one backend and dimension: on the GPU one allocation holds every table and mask
    (the maps of a network live and die together), and one launch answers up to `MAX_JOBS` of them."""
    if not queries or not isinstance(queries[0][0], GpuHashTable):
        return [index.pair_table(out_coords, query, same) for index, out_coords, query, same in queries]
    import cupy

    shapes = []
    for _, out_coords, query, _ in queries:
        check_row_count(out_coords.shape[0], "the output coordinates")
        kernel_volume = math.prod(query.kernel_size)
        shapes.append((kernel_volume, out_coords.shape[0], -(-kernel_volume // 32)))
    storage = cupy.empty(sum(volume * rows + rows * words for volume, rows, words in shapes), dtype=np.uint32)
    results, start = [], 0
    for volume, rows, words in shapes:
        table = storage[start : start + volume * rows].view(np.int32).reshape(volume, rows)
        mask = storage[start + volume * rows : start + volume * rows + rows * words].reshape(rows, words)
        results.append((table, mask))
        start += volume * rows + rows * words
    jobs = [(index, cupy.ascontiguousarray(out_coords), query, same, table, mask)
            for (index, out_coords, query, same), (table, mask) in zip(queries, results) if out_coords.shape[0]]
    if jobs:
        indices, outputs, geometries, same, tables, masks = zip(*jobs)
        rows = [out.shape[0] for out in outputs]
        _KERNELS.launch_batches(
            f"query_pair_tables<{indices[0].spatial_dims}>", _PAIR_TABLE_QUERIES_DTYPE, rows,
            {"num_out": rows, "out_coords": [out.data.ptr for out in outputs],
             "slots": [index.slots.data.ptr for index in indices],
             "capacity_mask": [index.capacity_mask for index in indices],
             "pair_table": [table.data.ptr for table in tables], "offset_mask": [mask.data.ptr for mask in masks],
             "geometry": [query.as_struct() for query in geometries], "kernel_volume": [t.shape[0] for t in tables],
             "same_coordinates": list(same)}, block_aligned=True)
    return results


class SortedKeyIndex:
    """CPU reference: sorted packed keys, looked up by binary search."""

    # Output rows per vectorised block, so memory stays O(block · K) on large inputs.
    _ROWS_PER_BLOCK = 1 << 15

    def __init__(self, coords: np.ndarray):
        self.num_coords = coords.shape[0]
        self.spatial_dims = coords.shape[1] - 1
        keys = pack_keys(coords)
        self._order = np.argsort(keys, kind="stable").astype(np.int32)
        self._sorted_keys = keys[self._order]

    def pair_table(self, out_coords: np.ndarray, query: Query, same_coordinates: bool = False):
        check_row_count(out_coords.shape[0], "the output coordinates")
        offsets = kernel_offsets(query.kernel_size).astype(np.int64)
        table = np.full((offsets.shape[0], out_coords.shape[0]), -1, dtype=np.int32)
        shift = query.sign * offsets * np.asarray(query.dilation, dtype=np.int64)  # [K, D]
        scale = np.asarray(query.out_scale, dtype=np.int64)
        base_shift = np.asarray(query.shifts(), dtype=np.int64)
        divisor = np.asarray(query.divisor, dtype=np.int64)
        layout = key_layout(self.spatial_dims)
        for start in range(0, out_coords.shape[0], self._ROWS_PER_BLOCK):
            block = out_coords[start : start + self._ROWS_PER_BLOCK].astype(np.int64)
            shifted = block[None, :, 1:] * scale + base_shift + shift[:, None, :]  # [K, rows, D]
            candidate = np.floor_divide(shifted, divisor)
            valid = np.all(candidate * divisor == shifted, axis=2)
            valid &= np.all((candidate >= layout.coord_min) & (candidate <= layout.coord_max), axis=2)
            ks, rows = np.nonzero(valid)
            if self.num_coords == 0 or ks.size == 0:
                continue
            wanted = np.concatenate([block[rows, :1], candidate[ks, rows]], axis=1)
            keys = pack_keys(wanted)
            position = np.minimum(np.searchsorted(self._sorted_keys, keys), self.num_coords - 1)
            hit = self._sorted_keys[position] == keys
            table[ks[hit], start + rows[hit]] = self._order[position[hit]]
        return table, None


class GpuHashTable:
    """Open addressing with linear probing over packed keys, capacity a power of two ≥ 2N (`_capacity`), in
    `slots`, that many empty ones, which `build_indices` fills with the rows of `coords`."""

    def __init__(self, coords, slots):
        import cupy

        self.coords = cupy.ascontiguousarray(coords)  # the kernels read rows of 1 + D packed ints
        self.num_coords = coords.shape[0]
        self.spatial_dims = coords.shape[1] - 1
        self.slots, self.capacity_mask = slots, np.uint64(slots.shape[0] - 1)

    def pair_table(self, out_coords, query: Query, same_coordinates: bool = False):
        """`same_coordinates`: `out_coords` are the indexed coordinates (the zero offset of each row
        is the row itself). Table and mask share one allocation: the map keeps them together."""
        return pair_tables([(self, out_coords, query, same_coordinates)])[0]


def _capacity(num_keys: int) -> int:
    """Slots of a table for `num_keys` keys: a power of two, at least twice as many."""
    return 1 << max(4, (2 * num_keys - 1).bit_length())


def _mark_empty(address: int, nbytes: int, stream: int) -> None:
    """Every slot of the tables in `nbytes` at device `address` EMPTY_SLOT (all bits set), on `stream`: one
    memset, cheaper to issue than a fill kernel."""
    import cupy

    cupy.cuda.runtime.memsetAsync(address, 0xFF, nbytes, stream)


# Mirrors `struct Downsampling` in raw_kernels/coordinate_hash.cu (a `Divisor` is 4 ints).
_DOWNSAMPLING_DTYPE = np.dtype(
    [("row_starts", np.int64, (MAX_JOBS + 1,)), ("divisor", np.int32, (MAX_JOBS, 4)), ("slots", np.uint64, (MAX_JOBS,)),
     ("coords", np.uint64), ("capacity_mask", np.uint64), ("is_first", np.uint64), ("block_counts", np.uint64),
     ("level_totals", np.uint64), ("out", np.uint64), ("num_rows", np.int64), ("count", np.int32)], align=True)


def unique_coordinates(coords, divisor=None):
    """The distinct rows of `floor(coords / divisor)` (batch column untouched; default divisor 1),
    int32 `[M, 1 + D]`, in order of first occurrence.

    On the GPU a hash table keeps the smallest row of each coordinate, so nothing is sorted; the
    CPU gives the same rows in the same order. Synchronises once on the GPU, for the count.
    """
    return unique_coordinates_by(coords, [divisor or (1,) * (coords.shape[1] - 1)])[0]


def unique_coordinates_by(coords, divisors) -> list:
    """`unique_coordinates(coords, divisor)` for each of `divisors`, synchronising the GPU once for
    all of their counts: `start_unique_coordinates_by(coords, divisors).result()`."""
    return start_unique_coordinates_by(coords, divisors).result()


class UniqueCoordinates:
    """`unique_coordinates_by` under way: `result()` waits for the counts (on the GPU, for the work queued
    before them, not for what was queued after) and returns the coordinates."""

    def __init__(self, finish):
        self._finish, self._result = finish, None

    def result(self) -> list:
        if self._result is None:
            self._result, self._finish = self._finish(), None
        return self._result


def start_unique_coordinates_by(coords, divisors) -> UniqueCoordinates:
    """`unique_coordinates_by(coords, divisors)` started: on the GPU, its launches up to the counts and their
    copy to the host are queued, and the rest waits for `result()`, so the host can queue other work first.

    On the GPU every divisor keys into a table of its own, all in one scratch allocation, and each pass (insert,
    mark, write) is one launch for up to `MAX_JOBS` divisors, each divisor's rows starting at a block boundary:
    the marking counts each block's first occurrences and each divisor's, and one scan over those counts places
    each divisor's rows after the ones before it in one allocation and gives where each divisor's rows end."""
    divisors = [tuple(divisor) for divisor in divisors]
    check_row_count(coords.shape[0], "the coordinates to deduplicate")
    if not is_cupy_array(coords):
        uniques = [_unique_on_cpu(coords, divisor) for divisor in divisors]
        return UniqueCoordinates(lambda: uniques)
    import cupy
    import cupyx

    coords = cupy.ascontiguousarray(coords)
    num_coords, spatial_dims = coords.shape[0], coords.shape[1] - 1
    if num_coords == 0 or not divisors:
        copies = [coords.copy() for _ in divisors]
        return UniqueCoordinates(lambda: copies)
    num_levels = len(divisors)
    blocks_per_level = -(-num_coords // ROW_BLOCK)
    span = blocks_per_level * ROW_BLOCK  # a divisor's rows, to its last block's end
    if num_levels * span > MAX_ROWS:  # the counts are 32-bit
        split = max(1, MAX_ROWS // span)
        parts = (start_unique_coordinates_by(coords, divisors[:split]),
                 start_unique_coordinates_by(coords, divisors[split:]))
        return UniqueCoordinates(lambda: parts[0].result() + parts[1].result())
    capacity = _capacity(num_coords)
    table_bytes = 16 * capacity
    # One scratch allocation: every divisor's table, its marks, its blocks' counts (then where their rows go),
    # every divisor's count, then where each divisor's rows start and the total.
    tables_bytes, marks_bytes = num_levels * table_bytes, num_levels * span
    counts_bytes = 4 * num_levels * blocks_per_level
    scratch = cupy.empty(tables_bytes + marks_bytes + counts_bytes + 4 * (2 * num_levels + 1), dtype=np.uint8)
    stream = cupy.cuda.get_current_stream()
    tables = scratch.data.ptr
    is_first, block_counts = tables + tables_bytes, tables + tables_bytes + marks_bytes
    level_totals = block_counts + counts_bytes
    level_starts = level_totals + 4 * num_levels
    _mark_empty(tables, tables_bytes, stream.ptr)
    cupy.cuda.runtime.memsetAsync(level_totals, 0, 4 * num_levels, stream.ptr)
    launches = []
    for first in range(0, num_levels, MAX_JOBS):
        levels = range(first, min(first + MAX_JOBS, num_levels))
        jobs = np.zeros((), dtype=_DOWNSAMPLING_DTYPE)
        jobs["count"], jobs["num_rows"] = len(levels), num_coords
        jobs["row_starts"][: len(levels) + 1] = [span * j for j in range(len(levels) + 1)]
        jobs["divisor"][: len(levels)] = [divisors[level] + (1,) * (4 - spatial_dims) for level in levels]
        jobs["slots"][: len(levels)] = [tables + table_bytes * level for level in levels]
        jobs["coords"], jobs["capacity_mask"] = coords.data.ptr, capacity - 1
        jobs["is_first"] = is_first + span * first
        jobs["block_counts"] = block_counts + 4 * blocks_per_level * first
        jobs["level_totals"] = level_totals + 4 * first
        for kernel in ("insert_smallest_rows", "mark_first_occurrences"):
            _KERNELS.launch_jobs(f"{kernel}<{spatial_dims}>", jobs[()])
        launches.append(jobs)
    _KERNELS.prepared(_SCAN_BLOCKS, _SCAN_BLOCK, 5).launch(stream.ptr, block_counts, blocks_per_level, level_totals,
                                                           num_levels, level_starts, grid=(num_levels, 1, 1))
    ends = cupyx.empty_pinned(num_levels, dtype=np.uint32)
    cupy.cuda.runtime.memcpyAsync(ends.ctypes.data, level_starts + 4, ends.nbytes,
                                  cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
    copied = cupy.cuda.Event(block=False, disable_timing=True)
    copied.record(stream)

    def finish(scratch=scratch) -> list:  # holds the scratch until the last launch over it has been queued
        copied.synchronize()  # the one synchronisation
        starts, stops = [0, *ends[:-1].tolist()], ends.tolist()
        with stream:  # the stream the launches above went to, whichever is current now
            uniques = cupy.empty((stops[-1], 1 + spatial_dims), dtype=np.int32)
            for jobs in launches:
                jobs["out"] = uniques.data.ptr
                _KERNELS.launch_jobs(f"write_first_rows<{spatial_dims}>", jobs[()])
        return [uniques[start:stop] for start, stop in zip(starts, stops)]

    return UniqueCoordinates(finish)


def _unique_on_cpu(coords: np.ndarray, divisor: tuple[int, ...]) -> np.ndarray:
    divided = coords.copy()
    divided[:, 1:] = np.floor_divide(coords[:, 1:], np.asarray(divisor, dtype=np.int32))
    keys = pack_keys(divided)
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    starts = np.ones(len(keys), dtype=bool)
    starts[1:] = sorted_keys[1:] != sorted_keys[:-1]
    return divided[np.sort(order[starts])]


# Mirrors `struct ReachGeometry` in raw_kernels/coordinate_hash.cu.
_REACH_DTYPE = np.dtype(
    [
        ("kernel_size", np.int32, (4,)),
        ("stride", np.int32, (4,)),
        ("dilation", np.int32, (4,)),
        ("padding", np.int32, (4,)),
        ("out_shape", np.int32, (4,)),
        ("transposed", np.int32),
    ]
)


@functools.cache
def _reach_struct(kernel_size, stride, dilation, padding, out_shape, transposed: bool) -> bytes:
    pad = 4 - len(kernel_size)
    record = np.zeros((), dtype=_REACH_DTYPE)
    record["kernel_size"] = kernel_size + (1,) * pad
    record["stride"] = stride + (1,) * pad
    record["dilation"] = dilation + (1,) * pad
    record["padding"] = padding + (0,) * pad
    record["out_shape"] = (out_shape or (0,) * len(kernel_size)) + (0,) * pad
    record["transposed"] = transposed
    return record.tobytes()


def unique_reached(coords, kernel_size, stride, dilation, padding, out_shape, transposed: bool):
    """(outputs, out_of_range) on the GPU: the distinct outputs int32 `[M, 1 + D]` that the candidates (input
    rows x taps, taps inner) of a padded convolution reach (`cupysparse.geometry.padding` has the rules), in
    order of first occurrence, and whether some candidate left the key range (those reach nothing).

    A hash table keeps each output's smallest candidate, sized for the most outputs an input reaches (per
    axis the multiples of the stride among its taps); the marking kernel counts each block's first candidates,
    one scan turns the counts into where each block's outputs start and their total, and the compaction places
    them: four launches into one allocation and one synchronisation, for the count and the flag."""
    import cupy
    import cupyx

    coords = cupy.ascontiguousarray(coords)
    kernel_volume = int(np.prod(kernel_size))
    num_coords, spatial_dims = coords.shape[0], coords.shape[1] - 1
    num_candidates = num_coords * kernel_volume
    reached_per_input = kernel_volume if transposed else int(np.prod(
        [min(k, -(-((k - 1) * d + 1) // s)) for k, s, d in zip(kernel_size, stride, dilation)]))
    if num_candidates == 0:
        return cupy.empty((0, 1 + spatial_dims), dtype=np.int32), False
    capacity = _capacity(num_coords * reached_per_input)
    num_blocks = -(-num_candidates // ROW_BLOCK)
    # One allocation: the table, each block's count of first candidates (then where its outputs start), three
    # words (where the outputs start, their count, the out-of-range flag), then a mark per candidate.
    table_bytes, counts_bytes = 16 * capacity, 4 * num_blocks
    scratch = cupy.empty(table_bytes + counts_bytes + 16 + num_candidates, dtype=np.uint8)
    stream = cupy.cuda.get_current_stream().ptr
    slots = scratch.data.ptr
    block_counts, words = slots + table_bytes, slots + table_bytes + counts_bytes
    is_first, flag = words + 16, words + 8
    _mark_empty(slots, table_bytes, stream)
    cupy.cuda.runtime.memsetAsync(words, 0, 16, stream)
    capacity_mask = np.uint64(capacity - 1)
    geometry = ((3, _reach_struct(tuple(kernel_size), tuple(stride), tuple(dilation), tuple(padding),
                                  None if out_shape is None else tuple(out_shape), transposed)),)
    common = (coords.data.ptr, num_candidates, kernel_volume)
    _KERNELS.launch_per_row(f"insert_reached<{spatial_dims}>", num_candidates, *common, slots, capacity_mask, flag,
                            fixed=geometry)
    _KERNELS.launch_per_row(f"mark_first_reached<{spatial_dims}>", num_candidates, *common, slots, capacity_mask,
                            flag, is_first, block_counts, fixed=geometry)
    _KERNELS.prepared(_SCAN_BLOCKS, _SCAN_BLOCK, 5).launch(stream, block_counts, num_blocks, block_counts, 1, words,
                                                           grid=(1, 1, 1))
    count_and_flag = cupyx.empty_pinned(2, dtype=np.uint32)
    cupy.cuda.runtime.memcpyAsync(count_and_flag.ctypes.data, words + 4, 8, cupy.cuda.runtime.memcpyDeviceToHost,
                                  stream)
    cupy.cuda.runtime.streamSynchronize(stream)  # the one synchronisation
    count, out_of_range = (int(value) for value in count_and_flag)
    outputs = cupy.empty((count, 1 + spatial_dims), dtype=np.int32)
    _KERNELS.launch_per_row(f"write_first_reached<{spatial_dims}>", num_candidates, *common, flag, is_first,
                            block_counts, outputs.data.ptr, fixed=geometry)
    return outputs, bool(out_of_range)
