"""Kernel maps: which input row feeds which output row through which kernel offset.

A `KernelMap` holds the pair table `[K, N_out]` (input row, or -1 when offset k of output row i
has no input) and derives on demand the per-offset CSR lists, the per-row offset bitmask and the
mask-sorted row order. The builders below work on NumPy (CPU reference) or CuPy (GPU) coordinates
alike; only the coordinate index (`hashing`) and the bitmask differ per backend.

Conventions, with coordinates in units of each tensor's own stride and `o_k` the k-th kernel
offset (`coords.kernel_offsets`):
- submanifold: output = input coordinates, pair when `in = out + dilation·o_k`;
- strided: output = unique(floor(in / stride)), pair when `in = out·stride + dilation·o_k`;
- transposed: the strided map with input and output swapped (output = the finer coordinates);
- generative transposed: output = every `in·stride + dilation·o_k`, pair when that holds.
New output coordinates come in order of first occurrence (input rows outer, offsets inner), on
both backends, so results are deterministic without sorting.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import weakref
from dataclasses import dataclass

import numpy as np

from cupysparse.cuda.backend import array_module, is_cupy_array
from cupysparse.cuda.compile import KernelSource, launch_config
from cupysparse.geometry.hashing import Query, SortedKeyIndex, build_index, unique_coordinates, unique_coordinates_by
from cupysparse.geometry.coords import (
    as_tuple,
    check_candidate_memory,
    check_kernel_volume,
    check_pair_table_memory,
    check_row_count,
    kernel_offsets,
    key_layout,
)
from cupysparse.cuda.out_of_memory import MapSizes, naming_map_sizes

# The mask sort is a radix sort over 8-bit digits (RADIX_BITS in the kernels): blocks of _RADIX
# threads, each over a tile of _RADIX_CHUNKS chunks of _RADIX rows.
_RADIX_BITS = 8
_RADIX = 1 << _RADIX_BITS
_RADIX_CHUNKS = 8
# Where a radix pass reads its keys (ROWS_IN_ORDER, CARRIED_KEYS, GATHERED_KEYS in the kernels).
_ROWS_IN_ORDER, _CARRIED_KEYS, _GATHERED_KEYS = 0, 1, 2
# The CSR lists: blocks of _PAIR_BLOCK threads over chunks of _PAIR_BLOCK * _PAIR_ITEMS rows of one offset.
_PAIR_BLOCK, _PAIR_ITEMS = 256, 16
_SCAN_BLOCK = 1024  # threads of a block of `scan_counts_by_row`


def _radix_count(source: int) -> str:
    return f"radix_count<{source}, {_RADIX_CHUNKS}>"


def _radix_scatter(source: int, write_keys: bool) -> str:
    return f"radix_scatter<{source}, {'true' if write_keys else 'false'}, {_RADIX_CHUNKS}>"


_SCAN_32 = f"scan_counts_by_row<unsigned int, {_SCAN_BLOCK}>"
_SCAN_64 = f"scan_counts_by_row<unsigned long long, {_SCAN_BLOCK}>"
_COUNT_PAIRS = f"count_pairs<{_PAIR_BLOCK}, {_PAIR_ITEMS}>"
_FILL_PAIRS = f"fill_pairs<{_PAIR_BLOCK}, {_PAIR_ITEMS}>"
_FORMAT_KERNELS = KernelSource(
    "kernel_map_formats.cu",
    (
        "offset_mask",
        "invert_pairs",
        _SCAN_32,
        _SCAN_64,
        _COUNT_PAIRS,
        _FILL_PAIRS,
        *(_radix_count(source) for source in (_ROWS_IN_ORDER, _CARRIED_KEYS, _GATHERED_KEYS)),
        _radix_scatter(_ROWS_IN_ORDER, False),
        _radix_scatter(_ROWS_IN_ORDER, True),
        _radix_scatter(_CARRIED_KEYS, False),
        _radix_scatter(_CARRIED_KEYS, True),
        _radix_scatter(_GATHERED_KEYS, False),
        "wgrad_share_table",
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


class KernelMap:
    """The pair table of one convolution and the formats derived from it."""

    def __init__(
        self, pair_table, num_in: int, kernel_size, stride, dilation, transposed=False, generative=False,
        offset_mask=None, mask_sorted_order=None, csr=None, derive_in=contextlib.nullcontext,
    ):
        check_row_count(pair_table.shape[1], "a kernel map's output")
        check_row_count(num_in, "a kernel map's input")
        # The kernels and plans read int32 rows; the builders make them so, and a table given already so
        # is kept as it is.
        self.pair_table = array_module(pair_table).ascontiguousarray(pair_table, dtype=np.int32)
        # Plain attributes, not properties of the table: every convolution call reads them.
        self.kernel_volume, self.num_out = (int(size) for size in self.pair_table.shape)
        if offset_mask is not None:  # already computed by the query: skip the derivation
            self._offset_mask = offset_mask
        if mask_sorted_order is not None:  # known without sorting (the identity map's: every row in place)
            self._mask_sorted_order = mask_sorted_order
        if csr is not None:  # known without counting (the identity map's: every row its own pair)
            self._csr = csr
        self.num_in = num_in
        self.kernel_size = tuple(kernel_size)
        self.stride = tuple(stride)
        self.dilation = tuple(dilation)
        self.transposed = transposed
        self.generative = generative
        # What the formats derived later (and the reversed map) are computed in: e.g. a framework's
        # stream and allocator, as the map itself was.
        self.derive_in = derive_in

    @property
    def offsets(self) -> np.ndarray:
        return kernel_offsets(self.kernel_size)

    @functools.cached_property
    def identity_offset(self) -> int | None:
        """The offset whose pairs join every row to itself (the zero offset of a map between the
        same coordinates, stride 1), which needs no gather; None for other maps."""
        if self.generative or any(s != 1 for s in self.stride) or self.num_in != self.num_out:
            return None
        return int(np.flatnonzero((self.offsets == 0).all(axis=1))[0])

    def __repr__(self) -> str:
        kind = "generative transposed" if self.generative else "transposed" if self.transposed else "forward"
        return (
            f"KernelMap({kind}, kernel_size={self.kernel_size}, stride={self.stride}, dilation={self.dilation}, "
            f"num_in={self.num_in}, num_out={self.num_out})"
        )

    @functools.cached_property
    def _pair_counts(self) -> PairCounts:
        with self.derive_in():
            return count_pairs(self.pair_table)

    def count_pairs_ahead(self) -> None:
        """Start counting the pairs of the CSR lists now, on the GPU, without waiting: `csr()` then
        waits for nothing (the count has long reached the host) where it would otherwise wait for the
        GPU to catch up. Call it well before: e.g. in the forward pass of a layer whose backward needs
        the lists. Nothing to do on the CPU."""
        if "_csr" not in self.__dict__ and is_cupy_array(self.pair_table):
            self._pair_counts

    @functools.cached_property
    def _csr(self) -> CsrPairs:
        counts = self._pair_counts if is_cupy_array(self.pair_table) else None
        with self.derive_in():
            return csr_pairs(self.pair_table, counts)

    def csr(self) -> CsrPairs:
        """Per-offset pair lists (computed once; on the GPU this synchronises for the pair count)."""
        return self._csr

    def wgrad_shares(self, rounds: int, round_major: bool) -> WgradShares:
        """The split-K wgrad blocks' shares of the pair lists for `rounds` blocks per offset (see
        `wgrad_shares`), computed once per map and arguments: each is one small launch, no synchronisation."""
        key = (rounds, round_major)
        cached = self.__dict__.setdefault("_wgrad_shares", {})
        if key not in cached:
            with self.derive_in():
                cached[key] = wgrad_shares(self.csr().offsets, rounds, round_major)
        return cached[key]

    @functools.cached_property
    def _host_pair_offsets(self) -> np.ndarray:
        offsets = self.csr().offsets
        return offsets.get() if is_cupy_array(offsets) else offsets

    def offset_pairs(self, skip_identity: bool = False):
        """(k, input rows, output rows) for every offset k with pairs, from the CSR lists (the
        counts cross to the host once per map). `skip_identity` leaves out `identity_offset`."""
        csr = self.csr()
        bounds = self._host_pair_offsets
        for k in range(self.kernel_volume):
            start, end = int(bounds[k]), int(bounds[k + 1])
            if end > start and not (skip_identity and k == self.identity_offset):
                yield k, csr.in_idx[start:end], csr.out_idx[start:end]

    @property
    def num_pairs(self) -> int:
        """Number of (input, output, offset) pairs; a count, without building the CSR lists."""
        return int(array_module(self.pair_table).count_nonzero(self.pair_table >= 0))

    @functools.cached_property
    def _offset_mask(self):
        with self.derive_in():
            return offset_mask(self.pair_table)

    def offset_mask(self):
        """uint32 `[N_out, ceil(K/32)]`: bit k%32 of word k//32 set when offset k has an input."""
        return self._offset_mask

    @functools.cached_property
    def _mask_sorted_order(self):
        mask = self.offset_mask()
        with self.derive_in():
            return mask_sorted_order(mask, self.kernel_volume)

    def mask_sorted_order(self):
        """Output rows ordered by their offset bitmask (as a little-endian big integer), stable."""
        return self._mask_sorted_order

    @functools.cached_property
    def _reversed(self) -> KernelMap:
        with self.derive_in():
            if self.mirror_symmetric:
                # in = out + o_k  ⇔  out = in + o_(K-1-k): the reverse is the table with its offsets flipped.
                table = array_module(self.pair_table).ascontiguousarray(self.pair_table[::-1])
            else:
                table = invert_pair_table(self.pair_table, self.num_in)
        reverse = KernelMap(
            table,
            self.num_out,
            self.kernel_size,
            self.stride,
            self.dilation,
            transposed=not self.transposed,
            generative=self.generative,
            derive_in=self.derive_in,
        )
        # Weakly: a map and its reverse holding each other would live on until a garbage collection, and with
        # them their GPU memory, which the next scene's maps would then have to allocate anew.
        reverse._reverse_of = weakref.ref(self)
        return reverse

    @functools.cached_property
    def mirror_symmetric(self) -> bool:
        """A map between the same coordinates whose offsets come in mirror pairs (o_(K-1-k) = -o_k:
        odd kernel sizes), as submanifold maps are: its reverse is its table with the offsets flipped."""
        offsets = self.offsets
        return self.identity_offset is not None and bool((offsets[::-1] == -offsets).all())

    def reversed(self) -> KernelMap:
        """The same pairs indexed by input row (`[K, N_in]` → output row), computed once.

        The input gradient is a forward pass over this map with the weights transposed.
        """
        reverse_of = self.__dict__.get("_reverse_of")
        if reverse_of is not None:
            forward = reverse_of()
            if forward is not None:
                return forward
        return self._reversed

    def derived(self, key, compute):
        """`compute(self)`, computed on first use for the hashable `key` and kept with the map for its
        lifetime: a value its user derives from the map (e.g. a launch plan's arguments, keyed by the
        plan), read back at the cost of a dictionary lookup."""
        try:
            return self._derived[key]
        except KeyError:
            value = self._derived[key] = compute(self)
            return value

    @functools.cached_property
    def _derived(self) -> dict:
        return {}

    def derive_formats(self) -> KernelMap:
        """Compute now every format the algorithms derive, for this map and its reversed one, so
        later convolutions over it neither synchronise nor sort: before CUDA-graph capture, or to
        keep map work out of timed calls. Returns the map."""
        for kernel_map in (self, self.reversed()):
            kernel_map.offset_mask()
            kernel_map.mask_sorted_order()
            kernel_map.csr()
            kernel_map._host_pair_offsets
            kernel_map.identity_offset
        return self


@dataclass(frozen=True)
class PairCounts:
    """The counts behind a GPU pair table's CSR lists: per-offset `offsets` `[K + 1]` and the position
    of each chunk's first pair on the device, and the pair count on its way to pinned host memory
    (`total`, valid once the event `copied` has completed)."""

    offsets: object
    chunk_starts: object
    num_chunks: int
    total: np.ndarray
    copied: object


def count_pairs(pair_table) -> PairCounts:
    """Count a GPU pair table's pairs per offset and chunk of rows, and start copying the total to the
    host, without waiting for either."""
    import cupy
    import cupyx

    kernel_volume, num_out = pair_table.shape
    num_chunks = -(-num_out // (_PAIR_BLOCK * _PAIR_ITEMS))
    num_blocks = kernel_volume * num_chunks  # block k * num_chunks + c: chunk c of offset k
    # One allocation: the chunk counts (which the scan turns into the chunks' first pairs), the
    # offsets' totals and the CSR offsets, written by the scan (as unsigned: never negative).
    scratch = cupy.empty(num_blocks + 2 * kernel_volume + 1, dtype=np.uint64)
    chunk_counts, offset_totals = scratch[:num_blocks], scratch[num_blocks : num_blocks + kernel_volume]
    offsets = scratch[num_blocks + kernel_volume :].view(np.int64)
    total = cupyx.empty_pinned(1, dtype=np.int64)
    stream = cupy.cuda.get_current_stream()
    if num_blocks:
        cupy.cuda.runtime.memsetAsync(offset_totals.data.ptr, 0, offset_totals.nbytes, stream.ptr)
        _FORMAT_KERNELS.prepared(_COUNT_PAIRS, _PAIR_BLOCK, 5).launch(
            stream.ptr, pair_table.data.ptr, num_out, num_chunks, chunk_counts.data.ptr, offset_totals.data.ptr,
            grid=(num_blocks, 1, 1),
        )
        # Each block's count becomes the position of its first pair.
        _FORMAT_KERNELS.prepared(_SCAN_64, _SCAN_BLOCK, 5).launch(
            stream.ptr, chunk_counts.data.ptr, num_chunks, offset_totals.data.ptr, kernel_volume, offsets.data.ptr,
            grid=(kernel_volume, 1, 1),
        )
        cupy.cuda.runtime.memcpyAsync(total.ctypes.data, offsets.data.ptr + 8 * kernel_volume, 8,
                                      cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
    else:
        offsets.fill(0)
        total[0] = 0
    copied = cupy.cuda.Event(block=False, disable_timing=True)
    copied.record(stream)
    return PairCounts(offsets, chunk_counts, num_chunks, total, copied)


def csr_pairs(pair_table, counts: PairCounts | None = None) -> CsrPairs:
    """The per-offset pair lists of a pair table; see `KernelMap.csr`.

    On the GPU: per-chunk pair counts and their scan (`count_pairs`, or `counts` made earlier by it),
    then a fill kernel; the host waits for the pair count, which sizes the lists, and for nothing else.
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
    import cupy

    counts = counts or count_pairs(pair_table)
    counts.copied.synchronize()
    num_pairs = int(counts.total[0])
    lists = cupy.empty((2, num_pairs), dtype=np.int32)  # one allocation for both
    in_idx, out_idx = lists
    if num_pairs:
        _FORMAT_KERNELS.prepared(_FILL_PAIRS, _PAIR_BLOCK, 6).launch(
            cupy.cuda.get_current_stream().ptr, pair_table.data.ptr, num_out, counts.num_chunks,
            counts.chunk_starts.data.ptr, in_idx.data.ptr, out_idx.data.ptr,
            grid=(kernel_volume * counts.num_chunks, 1, 1),
        )
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
        import cupy

        table = cupy.empty((slots, 4), dtype=np.int32)
        slot_starts = cupy.empty(kernel_volume + 1, dtype=np.int32)
        threads = max(slots, kernel_volume + 1)
        _FORMAT_KERNELS.prepared("wgrad_share_table", _SHARE_TABLE_BLOCK, 6).launch(
            cupy.cuda.get_current_stream().ptr, pair_offsets.data.ptr, kernel_volume, rounds, int(round_major),
            table.data.ptr, slot_starts.data.ptr, grid=(-(-threads // _SHARE_TABLE_BLOCK), 1, 1))
        return WgradShares(table, slot_starts)
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
        grid, block = launch_config(num_out)
        _FORMAT_KERNELS.get("offset_mask")(grid, block, (pair_table, np.int32(num_out), np.int32(kernel_volume), mask))
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


def downsample_coordinates(coords, stride):
    """unique(floor(coords / stride)) per batch, in order of first occurrence in `coords`."""
    return unique_coordinates(coords, as_tuple(stride, coords.shape[1] - 1, "stride"))


def generative_coordinates(coords, kernel_size, stride, dilation):
    """Every coordinate `in·stride + dilation·o_k`, unique, in order of first occurrence with
    input rows outer and offsets inner.

    Raises ValueError when one falls outside the key range (it would wrap, not fail, otherwise), or
    when the candidates (input rows x offsets, deduplicated on the device) are more than `coords.MAX_ROWS`;
    MemoryError when the NumPy path's candidates do not fit the host memory available.
    """
    kernel_volume = math.prod(kernel_size)  # exact: NumPy's product of a huge kernel would wrap around
    spatial_dims = coords.shape[1] - 1
    candidates = (f"the candidates of a generative transposed convolution ({coords.shape[0]} input rows x "
                  f"{kernel_volume} offsets)")
    check_row_count(coords.shape[0] * kernel_volume, candidates)
    if not is_cupy_array(coords):
        check_candidate_memory(coords.shape[0] * kernel_volume, spatial_dims, candidates)
    xp = array_module(coords)
    shift = xp.asarray(kernel_offsets(kernel_size) * np.asarray(dilation, dtype=np.int64))  # [K, D]
    spatial = coords[:, None, 1:].astype(np.int64) * xp.asarray(stride, dtype=np.int64) + shift[None, :, :]
    layout = key_layout(spatial_dims)
    if spatial.size and (int(spatial.min()) < layout.coord_min or int(spatial.max()) > layout.coord_max):
        raise ValueError(
            f"a generative transposed convolution (kernel {kernel_size}, stride {stride}, dilation {dilation}) "
            f"would create coordinates outside [{layout.coord_min}, {layout.coord_max}], the range of D = {spatial_dims}"
        )
    candidates = xp.empty((coords.shape[0], shift.shape[0], 1 + spatial_dims), dtype=np.int32)
    candidates[:, :, 0] = coords[:, None, 0]
    candidates[:, :, 1:] = spatial
    return unique_coordinates(candidates.reshape(-1, 1 + spatial_dims))


def _geometry(coords, kernel_size, stride, dilation):
    """The checked (kernel size, stride, dilation) of a map over `coords`: ints, and offsets that can be listed."""
    spatial_dims = coords.shape[1] - 1
    kernel_size = as_tuple(kernel_size, spatial_dims, "kernel_size")
    check_kernel_volume(kernel_size)
    return kernel_size, as_tuple(stride, spatial_dims, "stride"), as_tuple(dilation, spatial_dims, "dilation")


def _check_query_memory(kernel_size: tuple[int, ...], out_coords) -> None:
    """Before a pair-table query over `out_coords`: on the CPU, whether it fits the host memory (a GPU's
    allocator raises at once by itself)."""
    if not is_cupy_array(out_coords):
        check_pair_table_memory(kernel_size, out_coords.shape[0], SortedKeyIndex._ROWS_PER_BLOCK)


def submanifold_map(in_coords, kernel_size, dilation=1, index=None) -> KernelMap:
    """Output = input coordinates. `index` reuses a `hashing.build_index(in_coords)`."""
    kernel_size, stride, dilation = _geometry(in_coords, kernel_size, 1, dilation)
    if all(k == 1 for k in kernel_size):  # the zero offset alone: every row is its own only neighbour
        xp = array_module(in_coords)
        rows = xp.arange(in_coords.shape[0], dtype=np.int32)
        # Every row's bitmask is the same, so the stable order by mask is the rows' own: no sort to run; and
        # the one offset's pair list is every row with itself: nothing to count, so no synchronisation.
        pairs = CsrPairs(in_idx=rows, out_idx=rows, offsets=xp.asarray([0, len(rows)], dtype=np.int64))
        return KernelMap(rows[None, :], in_coords.shape[0], kernel_size, stride, dilation, mask_sorted_order=rows,
                         csr=pairs)
    index = index or build_index(in_coords)
    _check_query_memory(kernel_size, in_coords)
    query = Query(kernel_size, dilation, out_scale=stride, divisor=stride)
    table, mask = index.pair_table(in_coords, query, same_coordinates=True)
    return KernelMap(table, in_coords.shape[0], kernel_size, stride, dilation, offset_mask=mask)


def strided_map(in_coords, kernel_size, stride, dilation=1, index=None, out_coords=None):
    """(out_coords, map) of a strided convolution; `out_coords` defaults to the downsampled input."""
    kernel_size, stride, dilation = _geometry(in_coords, kernel_size, stride, dilation)
    if out_coords is None:
        out_coords = downsample_coordinates(in_coords, stride)
    index = index or build_index(in_coords)
    _check_query_memory(kernel_size, out_coords)
    ones = (1,) * len(stride)
    table, mask = index.pair_table(out_coords, Query(kernel_size, dilation, out_scale=stride, divisor=ones))
    return out_coords, KernelMap(table, in_coords.shape[0], kernel_size, stride, dilation, offset_mask=mask)


def invert_pair_table(pair_table, num_in: int):
    """The pair table seen from the input side: `[K, num_in]`, the output row each input feeds
    through offset k, or -1.

    Well defined because, for every kind of map, an input row and an offset determine at most one
    output row. On the CPU, invalid entries all write -1 into one spare slot past the end, so no
    compaction is needed; on the GPU one kernel scatters the pairs into a table filled with -1.
    """
    kernel_volume, num_out = pair_table.shape
    if not is_cupy_array(pair_table):
        valid = pair_table >= 0
        spare = kernel_volume * num_in
        target = np.where(valid, np.arange(kernel_volume, dtype=np.int64)[:, None] * num_in + pair_table, spare)
        out_rows = np.broadcast_to(np.arange(num_out, dtype=np.int32), pair_table.shape)
        inverse = np.full(spare + 1, -1, dtype=np.int32)
        inverse[target.ravel()] = np.where(valid, out_rows, -1).ravel()
        return inverse[:spare].reshape(kernel_volume, num_in)
    import cupy

    table = cupy.ascontiguousarray(pair_table)
    inverse = cupy.empty((kernel_volume, num_in), dtype=np.int32)
    # -1 is every bit set: a memset, cheaper to issue than a fill kernel.
    cupy.cuda.runtime.memsetAsync(inverse.data.ptr, 0xFF, inverse.nbytes, cupy.cuda.get_current_stream().ptr)
    if kernel_volume and num_out and num_in:
        grid, block = launch_config(num_out)
        _FORMAT_KERNELS.get("invert_pairs")(
            grid, block, (table, np.int32(num_out), np.int32(kernel_volume), np.int32(num_in), inverse)
        )
    return inverse


def transposed_map(strided: KernelMap) -> KernelMap:
    """The map of the transposed convolution matching `strided`: coarse input, fine output.

    Inverts the pair table without any search: strided pair (k, coarse c, fine f) becomes
    transposed pair (k, fine f, coarse c).
    """
    if strided.transposed:
        raise ValueError("transposed_map expects the forward (strided) map")
    return strided.reversed()  # whose own reverse is `strided`: dgrad of either needs no inversion


def generative_map(in_coords, kernel_size, stride, dilation=1, index=None):
    """(out_coords, map) of a generative transposed convolution: every reachable coordinate."""
    kernel_size, stride, dilation = _geometry(in_coords, kernel_size, stride, dilation)
    out_coords = generative_coordinates(in_coords, kernel_size, stride, dilation)
    index = index or build_index(in_coords)
    _check_query_memory(kernel_size, out_coords)  # up to the input's rows times the kernel volume
    ones = (1,) * len(stride)
    query = Query(kernel_size, dilation, out_scale=ones, divisor=stride, sign=-1)
    table, mask = index.pair_table(out_coords, query)
    return out_coords, KernelMap(
        table, in_coords.shape[0], kernel_size, stride, dilation, transposed=True, generative=True, offset_mask=mask
    )


def _memoised(by_arguments: dict, arguments: tuple) -> MapResult | None:
    """The result `KernelMapCache.kernel_map` memoised for `arguments`, else None.

    A layer asks with the same arguments every call: one look-up, no normalising. An equal float or bool
    (3.0 == 3, True == 1) finds an int's entry too and must meet the checks that reject it, so the sizes
    must be the very objects that passed them or of the same types throughout (the layers sharing a map
    each hold their own equal tuples).
    """
    try:
        checked, result = by_arguments[arguments]
    except (KeyError, TypeError):  # TypeError: unhashable arguments (lists), never memoised
        return None
    # Kernel size, stride and dilation; the tensor stride is the library's own, the flags are no sizes.
    for given, accepted in zip(arguments[1:4], checked[1:4]):
        if given is not accepted and not _same_types(given, accepted):
            return None
    return result


def _same_types(given, accepted) -> bool:
    """Whether two equal sizes (an int, or a tuple of ints) have the same types element by element."""
    if type(given) is not type(accepted):
        return False
    return type(given) is not tuple or all(type(a) is type(b) for a, b in zip(given, accepted))


@dataclass(frozen=True)
class MapResult:
    """A kernel map with the coordinates, tensor stride and cache its output tensor gets.

    `output_cache` is that cache, or a weak reference to it where it is the cache that keeps this result:
    a cache holding itself would live on, with its maps' GPU memory, until a garbage collection, and the
    next scene's maps would have to allocate that memory anew.
    """

    kernel_map: KernelMap
    out_coordinates: object
    out_tensor_stride: tuple[int, ...]
    output_cache: KernelMapCache | weakref.ref

    @property
    def out_map_cache(self) -> KernelMapCache:
        cache = self.output_cache
        if isinstance(cache, weakref.ref):
            cache = cache()
            if cache is None:
                raise RuntimeError("this map's cache is gone with the tensors that held it; keep a tensor of it")
        return cache


class KernelMapCache:
    """Coordinates per tensor stride, their indices, and the maps built between them.

    Shared by every tensor derived from one input through submanifold, strided and transposed
    convolutions, so a U-Net builds each map once and its decoder reuses the encoder's maps
    (a transposed convolution inverts the matching strided map). Generative convolutions create
    new coordinates and so start a cache of their own.

    `derive_in` (a context-manager factory, settable) is what its maps derive their formats in later:
    a framework adapter sets its stream and allocator, which the maps are built in too.
    """

    def __init__(self, coordinates, tensor_stride: tuple[int, ...], derive_in=contextlib.nullcontext):
        self.derive_in = derive_in
        self._input_stride = tuple(tensor_stride)
        self._coordinates = {self._input_stride: coordinates}
        self._indices = {}
        self._maps: dict[tuple, MapResult] = {}
        # A call's arguments as given → (those arguments, their result): see `_memoised`.
        self._by_arguments: dict[tuple, tuple[tuple, MapResult]] = {}

    def coordinates(self, tensor_stride: tuple[int, ...]):
        try:
            return self._coordinates[tuple(tensor_stride)]
        except KeyError:
            known = sorted(self._coordinates)
            raise ValueError(
                f"no coordinates at tensor stride {tuple(tensor_stride)} in this map cache (known: {known}); "
                "a transposed convolution returns to the coordinates of a tensor this one was downsampled "
                "from; use generative=True to create new coordinates instead"
            ) from None

    def downsample_to(self, tensor_strides) -> None:
        """Compute now the coordinates at each of `tensor_strides` (multiples of the input's stride),
        which strided convolutions reach later.

        One pass over the input coordinates gives every level (`unique(floor(c / 4))` has the rows of
        two steps of 2, in the same order), with one synchronisation of the GPU for all of them: a
        strided convolution reaching a level alone synchronises once per level, after the layers
        queued before it. A network calls this with its levels before its first layer.
        """
        wanted = []
        for tensor_stride in tensor_strides:
            tensor_stride = tuple(int(s) for s in tensor_stride)
            if len(tensor_stride) != len(self._input_stride) or any(
                s < 1 or s % b for s, b in zip(tensor_stride, self._input_stride)
            ):
                raise ValueError(f"cannot downsample coordinates at tensor stride {self._input_stride} to "
                                 f"{tensor_stride}: each axis needs a positive multiple of the input's")
            if tensor_stride not in self._coordinates and tensor_stride not in wanted:
                wanted.append(tensor_stride)
        divisors = [tuple(s // b for s, b in zip(stride, self._input_stride)) for stride in wanted]
        for tensor_stride, coords in zip(wanted, unique_coordinates_by(self._coordinates[self._input_stride],
                                                                       divisors)):
            self._coordinates[tensor_stride] = coords

    def _index(self, tensor_stride):
        if tensor_stride not in self._indices:
            self._indices[tensor_stride] = build_index(self.coordinates(tensor_stride))
        return self._indices[tensor_stride]

    def __len__(self) -> int:
        return len(self._maps)

    def kernel_map(self, tensor_stride, kernel_size, stride=1, dilation=1, transposed=False, generative=False):
        """The `MapResult` of a convolution applied to the coordinates at `tensor_stride`, cached."""
        arguments = (tensor_stride, kernel_size, stride, dilation, transposed, generative)
        result = _memoised(self._by_arguments, arguments)
        if result is None:
            result = self._normalised_kernel_map(*arguments)
            with contextlib.suppress(TypeError):  # unhashable arguments (lists): never memoised
                self._by_arguments[arguments] = (arguments, result)
        return result

    def lookup(self, tensor_stride, kernel_size, stride=1, dilation=1, transposed=False, generative=False):
        """The `MapResult` of an earlier `kernel_map` call with these same arguments, else None."""
        return _memoised(self._by_arguments, (tensor_stride, kernel_size, stride, dilation, transposed, generative))

    def _normalised_kernel_map(self, tensor_stride, kernel_size, stride, dilation, transposed, generative):
        coords = self.coordinates(tensor_stride)
        tensor_stride = tuple(tensor_stride)
        kernel_size, stride, dilation = _geometry(coords, kernel_size, stride, dilation)
        if generative and not transposed:
            raise ValueError("generative=True needs transposed=True")
        key = (tensor_stride, kernel_size, stride, dilation, transposed, generative)
        if key not in self._maps:
            sizes = MapSizes(int(coords.shape[0]), *key)
            with naming_map_sizes(sizes):
                result = self._build(coords, tensor_stride, kernel_size, stride, dilation, transposed, generative)
            result.kernel_map.derive_in = self.derive_in
            self._maps[key] = result
        return self._maps[key]

    def _build(self, coords, tensor_stride, kernel_size, stride, dilation, transposed, generative) -> MapResult:
        index = self._index(tensor_stride)
        if not transposed:
            if all(s == 1 for s in stride):
                return MapResult(submanifold_map(coords, kernel_size, dilation, index), coords, tensor_stride,
                                 weakref.ref(self))
            out_stride = tuple(t * s for t, s in zip(tensor_stride, stride))
            if out_stride not in self._coordinates:
                self._coordinates[out_stride] = downsample_coordinates(coords, stride)
            out_coords, forward = strided_map(coords, kernel_size, stride, dilation, index, self._coordinates[out_stride])
            return MapResult(forward, out_coords, out_stride, weakref.ref(self))
        if any(t % s for t, s in zip(tensor_stride, stride)):
            raise ValueError(f"a transposed convolution with stride {stride} needs a tensor stride divisible by it, "
                             f"got {tensor_stride}")
        fine_stride = tuple(t // s for t, s in zip(tensor_stride, stride))
        if generative:
            out_coords, backward = generative_map(coords, kernel_size, stride, dilation, index)
            return MapResult(backward, out_coords, fine_stride, KernelMapCache(out_coords, fine_stride, self.derive_in))
        forward = self.kernel_map(fine_stride, kernel_size, stride, dilation).kernel_map
        return MapResult(transposed_map(forward), self.coordinates(fine_stride), fine_stride, weakref.ref(self))
