"""The formats derived from a kernel map's pair table: per-offset CSR pair lists (and the split-K wgrad
blocks' shares of them), the per-row offset bitmask, the mask-sorted row order, and the table seen
from the input side.

Each works on a NumPy (CPU reference) or CuPy (GPU) table; on the GPU they are the kernels of
`raw_kernels/kernel_map_formats.cu`, which synchronise only where a size must reach the host (the
pair count of the CSR lists). `kernel_map.KernelMap` derives them on demand and keeps them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from cupysparse.cuda.backend import is_cupy_array
from cupysparse.cuda.compile import MAX_JOBS, ROW_BLOCK, KernelSource

# The mask sort is a radix sort over 8-bit digits (RADIX_BITS in the kernels): blocks of _RADIX
# threads, each over a tile of _RADIX_CHUNKS chunks of _RADIX rows.
_RADIX_BITS = 8
_RADIX = 1 << _RADIX_BITS
_RADIX_CHUNKS = 8
# Where a radix pass reads its keys (ROWS_IN_ORDER, CARRIED_KEYS, GATHERED_KEYS in the kernels).
_ROWS_IN_ORDER, _CARRIED_KEYS, _GATHERED_KEYS = 0, 1, 2
# The CSR lists: blocks of _PAIR_BLOCK threads over chunks of _PAIR_BLOCK * _PAIR_ITEMS rows of one offset, launched
# as jobs (`KernelSource.launch_batches`, whose blocks have ROW_BLOCK threads).
_PAIR_BLOCK, _PAIR_ITEMS = ROW_BLOCK, 16
_SCAN_BLOCK = 1024  # threads of a block of `scan_counts_by_row`
# Mirror `struct IdentityMaps`, `struct SortSegments`, `struct PairLists` and `struct PairTableInversions` in
# raw_kernels/kernel_map_formats.cu.
_IDENTITY_MAPS_DTYPE = np.dtype([("row_starts", np.int64, (MAX_JOBS + 1,)), ("rows", np.uint64, (MAX_JOBS,)),
                                 ("bounds", np.uint64, (MAX_JOBS,)), ("count", np.int32)], align=True)
_SORT_SEGMENTS_DTYPE = np.dtype([("row_starts", np.int64, (MAX_JOBS + 1,)), ("mask", np.uint64, (MAX_JOBS,)),
                                 ("keys", np.uint64), ("order", np.uint64), ("key_shift", np.int32),
                                 ("count", np.int32)], align=True)
_PAIR_LISTS_DTYPE = np.dtype(
    [("row_starts", np.int64, (MAX_JOBS + 1,)),
     *((name, np.uint64, (MAX_JOBS,)) for name in ("pair_table", "chunk_counts", "offset_totals", "offsets", "total",
                                                    "in_idx", "out_idx")),
     ("num_out", np.int32, (MAX_JOBS,)), ("num_chunks", np.int32, (MAX_JOBS,)), ("count", np.int32)], align=True)
_PAIR_TABLE_INVERSIONS_DTYPE = np.dtype(
    [("row_starts", np.int64, (MAX_JOBS + 1,)), ("pair_table", np.uint64, (MAX_JOBS,)), ("inverse", np.uint64, (MAX_JOBS,)),
     ("kernel_volume", np.int32, (MAX_JOBS,)), ("num_in", np.int32, (MAX_JOBS,)), ("count", np.int32)], align=True)


def _radix_count(source: int) -> str:
    return f"radix_count<{source}, {_RADIX_CHUNKS}>"


def _radix_scatter(source: int, write_keys: bool) -> str:
    return f"radix_scatter<{source}, {'true' if write_keys else 'false'}, {_RADIX_CHUNKS}>"


_SCAN_32 = f"scan_counts_by_row<unsigned int, {_SCAN_BLOCK}>"
_COUNT_PAIRS = f"count_pairs<{_PAIR_BLOCK}, {_PAIR_ITEMS}>"
_SCAN_PAIRS = f"scan_pair_counts<{_PAIR_BLOCK}>"
_FILL_PAIRS = f"fill_pairs<{_PAIR_BLOCK}, {_PAIR_ITEMS}>"
_FORMAT_KERNELS = KernelSource(
    "kernel_map_formats.cu",
    (
        "offset_mask",
        "identity_pairs",
        "invert_pair_tables",
        _SCAN_32,
        _COUNT_PAIRS,
        _SCAN_PAIRS,
        _FILL_PAIRS,
        *(_radix_count(source) for source in (_ROWS_IN_ORDER, _CARRIED_KEYS, _GATHERED_KEYS)),
        _radix_scatter(_ROWS_IN_ORDER, False),
        _radix_scatter(_ROWS_IN_ORDER, True),
        _radix_scatter(_CARRIED_KEYS, False),
        _radix_scatter(_CARRIED_KEYS, True),
        _radix_scatter(_GATHERED_KEYS, False),
        "wgrad_share_table",
        "segment_keys",
        "rows_within_segments",
    ),
)
_SHARE_TABLE_BLOCK = 256  # threads of a block of `wgrad_share_table`


@dataclass(frozen=True)
class CsrPairs:
    """Pairs grouped by offset: pairs `offsets[k]:offsets[k+1]` belong to offset k, by output row."""

    in_idx: object
    out_idx: object
    offsets: object


@dataclass(frozen=True)
class WgradShares:
    """How the split-K wgrad kernels cut the per-offset pair lists among `kernel_volume x rounds` blocks
    (`wgrad_shares`): `table` `[blocks, 4]` int32 holds block z's (offset, share, the offset's shares,
    workspace slot), offset -1 for a block without a share; offset k's partials are the workspace slots
    `slot_starts[k]:slot_starts[k + 1]`."""

    table: object
    slot_starts: object


@dataclass(frozen=True)
class PairCounts:
    """The counts behind a GPU pair table's CSR lists: per-offset `offsets` `[K + 1]` on the device, and `index`,
    the table's place among those counted with it (`together`, which knows the rest and fills their lists)."""

    offsets: object
    index: int
    together: CountedTogether


def count_pairs(pair_table) -> PairCounts:
    """Count a GPU pair table's pairs per offset and chunk of rows, and start copying the total to the
    host, without waiting for either."""
    return count_pairs_of([pair_table])[0]


def count_pairs_of(pair_tables) -> list[PairCounts]:
    """`count_pairs` of each of several GPU pair tables: one allocation, one memset, one launch of each kernel
    for up to `MAX_JOBS` tables, one copy of the totals to the host and one event for all of them."""
    import cupy
    import cupyx

    shapes = [pair_table.shape for pair_table in pair_tables]
    chunks = [-(-num_out // (_PAIR_BLOCK * _PAIR_ITEMS)) for _, num_out in shapes]
    # One allocation, zeroed for the offsets' totals: per table its chunk counts (which the scan turns into the
    # chunks' first pairs), its offsets' totals and its CSR offsets; then the tables' pair counts.
    sizes = [kernel_volume * num_chunks + 2 * kernel_volume + 1 for (kernel_volume, _), num_chunks in zip(shapes, chunks)]
    scratch = cupy.empty(sum(sizes) + len(shapes), dtype=np.uint64)
    stream = cupy.cuda.get_current_stream()
    cupy.cuda.runtime.memsetAsync(scratch.data.ptr, 0, scratch.nbytes, stream.ptr)
    totals = scratch[sum(sizes) :]
    # The kernels read the chunk counts and offset totals by address alone: no arrays made for them.
    base, item = scratch.data.ptr, scratch.itemsize
    chunk_counts, offset_totals, offsets = [], [], []
    for start, (kernel_volume, _), num_chunks in zip(itertools.accumulate(sizes, initial=0), shapes, chunks):
        blocks = kernel_volume * num_chunks
        chunk_counts.append(base + item * start)
        offset_totals.append(base + item * (start + blocks))
        offsets.append(scratch[start + blocks + kernel_volume : start + blocks + 2 * kernel_volume + 1].view(np.int64))
    jobs = {"pair_table": [pair_table.data.ptr for pair_table in pair_tables],
            "chunk_counts": chunk_counts, "offset_totals": offset_totals,
            "offsets": [array.data.ptr for array in offsets],
            "total": [totals.data.ptr + totals.itemsize * j for j in range(len(shapes))],
            "num_out": [num_out for _, num_out in shapes], "num_chunks": chunks}
    _FORMAT_KERNELS.launch_batches(
        _COUNT_PAIRS, _PAIR_LISTS_DTYPE,
        [kernel_volume * num_chunks * _PAIR_BLOCK for (kernel_volume, _), num_chunks in zip(shapes, chunks)], jobs,
        block_aligned=True)
    # Each block's count becomes the position of its first pair; the offsets and the totals are written.
    _FORMAT_KERNELS.launch_batches(_SCAN_PAIRS, _PAIR_LISTS_DTYPE,
                                   [kernel_volume * _PAIR_BLOCK for kernel_volume, _ in shapes], jobs, block_aligned=True)
    host_totals = cupyx.empty_pinned(len(shapes), dtype=np.int64)
    cupy.cuda.runtime.memcpyAsync(host_totals.ctypes.data, totals.data.ptr, totals.nbytes,
                                  cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
    copied = cupy.cuda.Event(block=False, disable_timing=True)
    copied.record(stream)
    together = CountedTogether(pair_tables, jobs, host_totals, copied)
    return [PairCounts(offsets[j], j, together) for j in range(len(shapes))]


class CountedTogether:
    """Pair tables counted together (`count_pairs_of`), their fields of the kernels' `PairLists` (`jobs`, on
    device addresses: the tables are held until their lists are filled), and `totals`, their pair counts on their
    way to pinned host memory (valid once the event `copied` has completed). The first table whose lists are
    asked for fills them all (`lists`)."""

    def __init__(self, pair_tables, jobs: dict, totals: np.ndarray, copied):
        self._pair_tables, self.jobs, self.totals, self.copied = list(pair_tables), jobs, totals, copied
        self._lists: list[tuple] | None = None

    def lists(self) -> list[tuple]:
        """Each table's (in_idx, out_idx): the first call waits for the totals, which size them, then fills them
        in one allocation and one launch for up to `MAX_JOBS` tables."""
        if self._lists is None:
            import cupy

            self.copied.synchronize()
            pair_counts = [int(count) for count in self.totals]
            storage = cupy.empty(2 * sum(pair_counts), dtype=np.int32)
            starts = list(itertools.accumulate((2 * count for count in pair_counts), initial=0))
            self._lists = [(storage[start : start + count], storage[start + count : start + 2 * count])
                           for start, count in zip(starts, pair_counts)]
            filled = [j for j, count in enumerate(pair_counts) if count]
            jobs = {name: [values[j] for j in filled] for name, values in self.jobs.items()}
            jobs["in_idx"] = [self._lists[j][0].data.ptr for j in filled]
            jobs["out_idx"] = [self._lists[j][1].data.ptr for j in filled]
            rows = [self.jobs["num_chunks"][j] * _PAIR_BLOCK * self._pair_tables[j].shape[0] for j in filled]
            _FORMAT_KERNELS.launch_batches(_FILL_PAIRS, _PAIR_LISTS_DTYPE, rows, jobs, block_aligned=True)
            self._pair_tables = self.jobs = None
        return self._lists


def identity_pairs(num_rows: int, like) -> CsrPairs:
    """The CSR lists of the identity map of `num_rows` rows (a 1 x 1 convolution's), on `like`'s backend: its one
    offset pairs every row with itself, so `in_idx` and `out_idx` are both the rows 0..N-1, which are also its
    pair table's one row and its mask-sorted order."""
    return identity_pairs_of([num_rows], like)[0]


def identity_pairs_of(row_counts, like) -> list[CsrPairs]:
    """`identity_pairs` of each of `row_counts`: on the GPU one allocation, one memset and one launch for up to
    `MAX_JOBS` maps (a network's 1 x 1 convolutions at each of its levels)."""
    if not is_cupy_array(like):
        return [CsrPairs(in_idx=rows, out_idx=rows, offsets=np.array([0, len(rows)], dtype=np.int64))
                for rows in (np.arange(num_rows, dtype=np.int32) for num_rows in row_counts)]
    import cupy

    # The bounds of every map (zeroed: the lower bounds, and an empty map's upper one), then each map's rows as
    # int32, in int64 words.
    num_maps = len(row_counts)
    row_words = [-(-num_rows // 2) for num_rows in row_counts]
    storage = cupy.empty(2 * num_maps + sum(row_words), dtype=np.int64)
    cupy.cuda.runtime.memsetAsync(storage.data.ptr, 0, 16 * num_maps, cupy.cuda.get_current_stream().ptr)
    bounds = [storage[2 * j : 2 * j + 2] for j in range(num_maps)]
    starts = itertools.accumulate(row_words, initial=2 * num_maps)
    rows = [storage[start : start + size].view(np.int32)[:num_rows]
            for start, size, num_rows in zip(starts, row_words, row_counts)]
    jobs = [(num_rows, row, bound) for num_rows, row, bound in zip(row_counts, rows, bounds) if num_rows]
    _FORMAT_KERNELS.launch_batches("identity_pairs", _IDENTITY_MAPS_DTYPE, [num_rows for num_rows, _, _ in jobs],
                                   {"rows": [row.data.ptr for _, row, _ in jobs],
                                    "bounds": [bound.data.ptr for _, _, bound in jobs]})
    return [CsrPairs(in_idx=row, out_idx=row, offsets=bound) for row, bound in zip(rows, bounds)]


def csr_pairs(pair_table, counts: PairCounts | None = None) -> CsrPairs:
    """The per-offset pair lists of a pair table; see `KernelMap.csr`.

    On the GPU: per-chunk pair counts and their scan (`count_pairs`, or `counts` made earlier by it or by
    `count_pairs_of`), then a fill kernel (the lists of every table counted with it); the host waits for the
    pair counts, which size the lists, and for nothing else.
    """
    kernel_volume, num_out = pair_table.shape
    if not is_cupy_array(pair_table):
        valid = pair_table >= 0
        flat = np.flatnonzero(valid.ravel())  # k-major, then output row ascending
        offsets = np.zeros(kernel_volume + 1, dtype=np.int64)
        np.cumsum(valid.sum(axis=1, dtype=np.int64), out=offsets[1:])
        return CsrPairs(
            in_idx=pair_table.ravel()[flat],
            out_idx=(flat % max(num_out, 1)).astype(np.int32),
            offsets=offsets,
        )
    counts = counts or count_pairs(pair_table)
    in_idx, out_idx = counts.together.lists()[counts.index]
    return CsrPairs(in_idx=in_idx, out_idx=out_idx, offsets=counts.offsets)


def wgrad_shares(pair_offsets, rounds: int, round_major: bool) -> WgradShares:
    """The shares of the per-offset pair lists (CSR offsets `pair_offsets` `[K + 1]`) among the
    `K x rounds` blocks of a split-K wgrad launch. Offset k gets `1 + P_k (K rounds - K) // P` shares (P_k
    its pairs, P all of them; none without pairs), so that every share holds about as many pairs whatever
    its offset; the last blocks may get none. Offset-major, block z is workspace slot z; round-major, round
    t holds the shares s of every offset with `s rounds // shares_k = t` (the same stretch of each pair
    list, which runs by output row), offsets in order within it. As `wgrad_share_table` in
    raw_kernels/kernel_map_formats.cu computes on the GPU."""
    kernel_volume = len(pair_offsets) - 1
    slots = kernel_volume * rounds
    if is_cupy_array(pair_offsets):
        return wgrad_shares_of([(pair_offsets, rounds, round_major)])[0]
    pairs = np.diff(np.asarray(pair_offsets, dtype=np.int64))
    shares = np.where(pairs > 0, 1 + pairs * (slots - kernel_volume) // max(int(pairs.sum()), 1), 0)
    slot_starts = np.zeros(kernel_volume + 1, dtype=np.int32)
    np.cumsum(shares, out=slot_starts[1:])
    used = int(slot_starts[-1])
    offset = np.repeat(np.arange(kernel_volume), shares)
    share = np.arange(used) - slot_starts[offset]
    entries = np.stack([offset, share, shares[offset], np.arange(used)], axis=1)
    if round_major:
        entries = entries[np.lexsort((share, offset, share * rounds // shares[offset]))]
    table = np.zeros((slots, 4), dtype=np.int32)
    table[:, 0] = -1
    table[:used] = entries
    return WgradShares(table, slot_starts)


def wgrad_shares_of(requests) -> list[WgradShares]:
    """`wgrad_shares` of each `(pair_offsets, rounds, round_major)` of `requests`, GPU CSR offsets: one allocation
    for every table (each starting on 16 bytes, as the GEMMs read its rows) and a launch each."""
    import cupy

    shapes = [(len(pair_offsets) - 1, rounds) for pair_offsets, rounds, _ in requests]
    # Per request its table, then its slot starts, padded to whole rows of 4.
    sizes = [4 * kernel_volume * rounds + -(-(kernel_volume + 1) // 4) * 4 for kernel_volume, rounds in shapes]
    storage = cupy.empty(sum(sizes), dtype=np.int32)
    stream = cupy.cuda.get_current_stream().ptr
    kernel = _FORMAT_KERNELS.prepared("wgrad_share_table", _SHARE_TABLE_BLOCK, 6)
    shares = []
    for (pair_offsets, rounds, round_major), (kernel_volume, _), start in zip(
            requests, shapes, itertools.accumulate(sizes, initial=0)):
        slots = kernel_volume * rounds
        table = storage[start : start + 4 * slots].reshape(slots, 4)
        slot_starts = storage[start + 4 * slots : start + 4 * slots + kernel_volume + 1]
        threads = max(slots, kernel_volume + 1)
        kernel.launch(stream, pair_offsets.data.ptr, kernel_volume, rounds, int(round_major), table.data.ptr,
                      slot_starts.data.ptr, grid=(-(-threads // _SHARE_TABLE_BLOCK), 1, 1))
        shares.append(WgradShares(table, slot_starts))
    return shares


def offset_mask(pair_table):
    """The offset bitmask of a pair table; see `KernelMap.offset_mask`."""
    kernel_volume, num_out = pair_table.shape
    num_words = -(-kernel_volume // 32)
    if not is_cupy_array(pair_table):
        present = np.zeros((num_words * 32, num_out), dtype=np.uint8)
        present[:kernel_volume] = pair_table >= 0
        packed = np.packbits(present.T.reshape(num_out, num_words, 32), axis=2, bitorder="little")
        return np.ascontiguousarray(packed).view("<u4").reshape(num_out, num_words).astype(np.uint32)
    import cupy

    mask = cupy.empty((num_out, num_words), dtype=np.uint32)
    if num_out:
        table = cupy.ascontiguousarray(pair_table)
        _FORMAT_KERNELS.launch_per_row("offset_mask", num_out, table.data.ptr, num_out, kernel_volume, mask.data.ptr)
    return mask


def mask_sorted_order(mask, kernel_volume: int | None = None):
    """Rows ordered by their offset bitmask (as a little-endian big integer), stable.

    `kernel_volume` (K), when given, says that bits K and above are zero. The GPU sorts with a
    stable LSD radix sort over the 8-bit digits below bit K (one pass for K <= 8, four for K = 27),
    three kernels a pass and no synchronisation.
    """
    if not is_cupy_array(mask):
        if mask.shape[1] == 1:
            return np.argsort(mask[:, 0], kind="stable").astype(np.int32)
        # The last key is the primary one: the highest word is the most significant.
        return np.lexsort(mask.T).astype(np.int32)
    import cupy

    mask = cupy.ascontiguousarray(mask)
    num_rows, num_words = mask.shape
    key_bits = 32 * num_words if kernel_volume is None else min(kernel_volume, 32 * num_words)
    num_passes = -(-key_bits // _RADIX_BITS)
    if num_rows == 0 or num_passes == 0:  # no rows, or every mask empty: the rows stay in order
        return cupy.arange(num_rows, dtype=np.int32)
    num_tiles = -(-num_rows // (_RADIX_CHUNKS * _RADIX))
    # Single-word keys move with their rows from pass to pass; a longer mask is read again by row.
    carry_keys = num_words == 1 and num_passes > 1
    num_key_buffers = min(num_passes - 1, 2) if carry_keys else 0
    # One scratch allocation: the digit totals of every pass (zeroed once), the tile counts (reused
    # by every pass), the digit starts (a by-product of the scan), rows and keys between passes.
    # The launches are prepared and take device addresses: a sort is a dozen small kernels, each
    # shorter than a CuPy launch's argument conversions.
    sizes = (num_passes * _RADIX, _RADIX * num_tiles, _RADIX + 1, num_rows if num_passes > 1 else 0,
             num_key_buffers * num_rows)
    scratch = cupy.empty(sum(sizes), dtype=np.uint32)
    digit_totals, tile_counts, digit_starts, rows_between, keys_between = (
        scratch.data.ptr + 4 * start for start in itertools.accumulate(sizes[:-1], initial=0)
    )
    key_buffers = (keys_between, keys_between + 4 * num_rows)
    order = cupy.empty(num_rows, dtype=np.int32)
    stream = cupy.cuda.get_current_stream().ptr
    cupy.cuda.runtime.memsetAsync(digit_totals, 0, 4 * sizes[0], stream)
    grid = (num_tiles, 1, 1)
    # Placeholders: the first pass takes the rows in order, keys from the mask.
    rows_in, keys_in = order.data.ptr, mask.data.ptr
    for step in range(num_passes):
        word, shift = divmod(step * _RADIX_BITS, 32)
        source = _ROWS_IN_ORDER if step == 0 else _CARRIED_KEYS if carry_keys else _GATHERED_KEYS
        write_keys = carry_keys and step < num_passes - 1
        # The last pass writes `order`.
        rows_out = order.data.ptr if (num_passes - 1 - step) % 2 == 0 else rows_between
        keys_out = key_buffers[step % 2] if write_keys else mask.data.ptr  # mask: a placeholder, not written
        totals = digit_totals + 4 * step * _RADIX
        reads = (mask.data.ptr, num_words, keys_in, rows_in, num_rows, word, shift)
        _FORMAT_KERNELS.prepared(_radix_count(source), _RADIX, 10).launch(
            stream, *reads, num_tiles, tile_counts, totals, grid=grid
        )
        # Tile counts become where each tile's rows of each digit go.
        _FORMAT_KERNELS.prepared(_SCAN_32, _SCAN_BLOCK, 5).launch(
            stream, tile_counts, num_tiles, totals, _RADIX, digit_starts, grid=(_RADIX, 1, 1)
        )
        _FORMAT_KERNELS.prepared(_radix_scatter(source, write_keys), _RADIX, 11).launch(
            stream, *reads, tile_counts, num_tiles, keys_out, rows_out, grid=grid
        )
        rows_in, keys_in = rows_out, keys_out
    return order


# Maps sorted together share a 32-bit key: the map's index above the widest mask's bits.
_KEY_BITS = 32


def mask_sorted_orders(masks, kernel_volumes) -> list:
    """`mask_sorted_order(mask, K)` of each of several masks, the GPU's single-word masks sorted together.

    One radix sort over the rows of all of them, each row's key its map's index above the widest mask's
    bits, orders the rows by map, then by mask, stably: every map's order at the cost of one sort's launches,
    where a network's maps sorted one by one cost a dozen launches each. As many maps share a sort as the key
    has bits for and a launch takes (`MAX_JOBS`); the others (multi-word masks, the CPU's, empty ones) are
    sorted on their own.
    """
    orders: list = [None] * len(masks)
    together = [i for i, mask in enumerate(masks) if is_cupy_array(mask) and mask.shape[1] == 1 and mask.shape[0]]
    key_shift = max((kernel_volumes[i] for i in together), default=_KEY_BITS)
    per_sort = min(1 << (_KEY_BITS - key_shift), MAX_JOBS) if key_shift < _KEY_BITS else 1
    for start in range(0, len(together) if per_sort > 1 else 0, per_sort):
        group = together[start : start + per_sort]
        if len(group) > 1:
            for i, order in zip(group, _sorted_together([masks[i] for i in group], key_shift)):
                orders[i] = order
    for i, mask in enumerate(masks):
        if orders[i] is None:
            orders[i] = mask_sorted_order(mask, kernel_volumes[i])
    return orders


def _sorted_together(masks: list, key_shift: int) -> list:
    """The mask-sorted orders of several non-empty single-word GPU masks whose bits lie below `key_shift`,
    from one sort of their concatenated rows (`mask_sorted_orders`); each order is a view of one array."""
    import cupy

    starts = list(itertools.accumulate((mask.shape[0] for mask in masks), initial=0))
    masks = [cupy.ascontiguousarray(mask) for mask in masks]
    keys = cupy.empty((starts[-1], 1), dtype=np.uint32)
    segments = np.zeros((), dtype=_SORT_SEGMENTS_DTYPE)
    segments["count"], segments["key_shift"], segments["keys"] = len(masks), key_shift, keys.data.ptr
    segments["row_starts"][: len(masks) + 1] = starts
    segments["mask"][: len(masks)] = [mask.data.ptr for mask in masks]
    _FORMAT_KERNELS.launch_jobs("segment_keys", segments[()])
    order = mask_sorted_order(keys, key_shift + (len(masks) - 1).bit_length())
    segments["order"] = order.data.ptr
    _FORMAT_KERNELS.launch_jobs("rows_within_segments", segments[()])
    return [order[start:end] for start, end in zip(starts[:-1], starts[1:])]


def invert_pair_table(pair_table, num_in: int):
    """The pair table seen from the input side: `[K, num_in]`, the output row each input feeds
    through offset k, or -1.

    Well defined because, for every kind of map, an input row and an offset determine at most one
    output row. On the CPU, invalid entries all write -1 into one spare slot past the end, so no
    compaction is needed; on the GPU one kernel scatters the pairs into a table filled with -1.
    """
    return invert_pair_tables([(pair_table, num_in)])[0]


def invert_pair_tables(tables) -> list:
    """`invert_pair_table(pair_table, num_in)` of each of `tables`, (pair table, num_in) pairs of one backend:
    on the GPU one allocation and one memset hold and clear every inverse, and one launch fills up to
    `MAX_JOBS` of them."""
    if not tables or not is_cupy_array(tables[0][0]):
        return [_inverted_on_cpu(pair_table, num_in) for pair_table, num_in in tables]
    import cupy

    sizes = [pair_table.shape[0] * num_in for pair_table, num_in in tables]
    storage = cupy.empty(sum(sizes), dtype=np.int32)
    # -1 is every bit set: a memset, cheaper to issue than a fill kernel.
    cupy.cuda.runtime.memsetAsync(storage.data.ptr, 0xFF, storage.nbytes, cupy.cuda.get_current_stream().ptr)
    inverses = [storage[start : start + size].reshape(pair_table.shape[0], num_in)
                for (pair_table, num_in), start, size in zip(tables, itertools.accumulate(sizes, initial=0), sizes)]
    jobs = [(cupy.ascontiguousarray(pair_table), inverse) for (pair_table, _), inverse in zip(tables, inverses)
            if pair_table.size and inverse.size]
    _FORMAT_KERNELS.launch_batches("invert_pair_tables", _PAIR_TABLE_INVERSIONS_DTYPE,
                                   [table.shape[1] for table, _ in jobs],
                                   {"pair_table": [table.data.ptr for table, _ in jobs],
                                    "inverse": [inverse.data.ptr for _, inverse in jobs],
                                    "kernel_volume": [inverse.shape[0] for _, inverse in jobs],
                                    "num_in": [inverse.shape[1] for _, inverse in jobs]})
    return inverses


def _inverted_on_cpu(pair_table: np.ndarray, num_in: int) -> np.ndarray:
    kernel_volume, num_out = pair_table.shape
    valid = pair_table >= 0
    spare = kernel_volume * num_in
    target = np.where(valid, np.arange(kernel_volume, dtype=np.int64)[:, None] * num_in + pair_table, spare)
    out_rows = np.broadcast_to(np.arange(num_out, dtype=np.int32), pair_table.shape)
    inverse = np.full(spare + 1, -1, dtype=np.int32)
    inverse[target.ravel()] = np.where(valid, out_rows, -1).ravel()
    return inverse[:spare].reshape(kernel_volume, num_in)
