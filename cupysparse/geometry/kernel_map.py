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
- generative transposed: output = every `in·stride + dilation·o_k`, pair when that holds;
- padded (spconv's `padding`, any stride): output = every voxel a kernel tap reaches, its transposed and
  generative transposed kinds alike (`padding` has the rules).
New output coordinates come in order of first occurrence (input rows outer, offsets inner), on
both backends, so results are deterministic without sorting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from cupysparse.cuda.backend import array_module, is_cupy_array
from cupysparse.geometry.hashing import (
    Query,
    SortedKeyIndex,
    UniqueCoordinates,
    build_index,
    build_indices,
    pair_tables,
    start_unique_coordinates_by,
    unique_coordinates,
)
from cupysparse.geometry.padding import (
    as_padding,
    conv_output_shape,
    padded_query,
    reached_coordinates,
    transposed_output_shape,
)
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
# The formats derived from a pair table (`KernelMap` calls them through this module's names).
from cupysparse.geometry.map_formats import (
    CsrPairs,
    PairCounts,
    WgradShares,
    count_pairs,
    count_pairs_of,
    csr_pairs,
    identity_pairs,
    identity_pairs_of,
    invert_pair_table,
    invert_pair_tables,
    mask_sorted_order,
    mask_sorted_orders,
    offset_mask,
    wgrad_shares,
    wgrad_shares_of,
)


class KernelMap:
    """The pair table of one convolution and the formats derived from it."""

    def __init__(
        self, pair_table, num_in: int, kernel_size, stride, dilation, transposed=False, generative=False,
        offset_mask=None, mask_sorted_order=None, csr=None, derive_in=contextlib.nullcontext, padding=None,
    ):
        check_row_count(pair_table.shape[1], "a kernel map's output")
        check_row_count(num_in, "a kernel map's input")
        # The kernels and plans read int32 rows; the builders make them so, and a table given already so
        # is kept as it is.
        self.pair_table = array_module(pair_table).ascontiguousarray(pair_table, dtype=np.int32)
        # Plain attributes, not properties of the table: every convolution call reads them.
        self.kernel_volume, self.num_out = map(int, self.pair_table.shape)
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
        self.padding = None if padding is None else tuple(padding)  # None: not a padded (spconv) map
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
        if self.generative or self.padding is not None or any(s != 1 for s in self.stride):
            return None
        if self.num_in != self.num_out:
            return None
        return _zero_offset(self.kernel_size)

    def __repr__(self) -> str:
        kind = "generative transposed" if self.generative else "transposed" if self.transposed else "forward"
        padding = "" if self.padding is None else f", padding={self.padding}"
        return (
            f"KernelMap({kind}, kernel_size={self.kernel_size}, stride={self.stride}, dilation={self.dilation}"
            f"{padding}, num_in={self.num_in}, num_out={self.num_out})"
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
        return self._reverse_with(table)

    def _reverse_with(self, table) -> KernelMap:
        """The reversed map whose table is `table` (`reversed`)."""
        reverse = KernelMap(
            table,
            self.num_out,
            self.kernel_size,
            self.stride,
            self.dilation,
            transposed=not self.transposed,
            generative=self.generative,
            derive_in=self.derive_in,
            padding=self.padding,
        )
        # Weakly: a map and its reverse holding each other would live on until a garbage collection, and with
        # them their GPU memory, which the next scene's maps would then have to allocate anew.
        reverse._reverse_of = weakref.ref(self)
        return reverse

    @functools.cached_property
    def mirror_symmetric(self) -> bool:
        """A map between the same coordinates whose offsets come in mirror pairs (o_(K-1-k) = -o_k:
        odd kernel sizes), as submanifold maps are: its reverse is its table with the offsets flipped."""
        return self.identity_offset is not None and _mirrored_offsets(self.kernel_size)

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


# Every new map asks for these of its kernel size (a network's maps, each step): answered once per size.
@functools.cache
def _zero_offset(kernel_size: tuple[int, ...]) -> int:
    """The index of the zero offset among `kernel_size`'s offsets."""
    return int(np.flatnonzero((kernel_offsets(kernel_size) == 0).all(axis=1))[0])


@functools.cache
def _mirrored_offsets(kernel_size: tuple[int, ...]) -> bool:
    """Whether `kernel_size`'s offsets come in mirror pairs (o_(K-1-k) = -o_k)."""
    offsets = kernel_offsets(kernel_size)
    return bool((offsets[::-1] == -offsets).all())


def derive_mask_orders(kernel_maps) -> None:
    """Compute the mask-sorted order of each GPU map of `kernel_maps` that has none yet, sorting them together
    (`map_formats.mask_sorted_orders`): what the forward launches over them read, for a whole network at
    once. The CPU's algorithms read no order."""
    pending = [kernel_map for kernel_map in dict.fromkeys(kernel_maps)
               if is_cupy_array(kernel_map.pair_table) and "_mask_sorted_order" not in kernel_map.__dict__]
    if not pending:
        return
    masks = [kernel_map.offset_mask() for kernel_map in pending]
    with pending[0].derive_in():
        orders = mask_sorted_orders(masks, [kernel_map.kernel_volume for kernel_map in pending])
    for kernel_map, order in zip(pending, orders):
        kernel_map._mask_sorted_order = order


def derive_pair_counts(kernel_maps) -> None:
    """Count the pairs of each GPU map of `kernel_maps` that has neither CSR lists nor counts yet, together
    (`map_formats.count_pairs_of`), without waiting: the first of them whose lists are asked for (a weight
    gradient's, in the backward pass) then fills the lists of all of them in one launch. A network's maps before
    a training step; `count_pairs_ahead` would count them one by one."""
    pending = [kernel_map for kernel_map in dict.fromkeys(kernel_maps)
               if is_cupy_array(kernel_map.pair_table) and "_csr" not in kernel_map.__dict__
               and "_pair_counts" not in kernel_map.__dict__]
    if not pending:
        return
    with pending[0].derive_in():
        counts = count_pairs_of([kernel_map.pair_table for kernel_map in pending])
    for kernel_map, counted in zip(pending, counts):
        kernel_map._pair_counts = counted


def derive_wgrad_shares(requests) -> None:
    """`KernelMap.wgrad_shares` of each `(kernel_map, rounds, round_major)` of `requests` whose map is on the GPU
    and has not derived them yet, together (`map_formats.wgrad_shares_of`: one allocation), each kept with its
    map: the shares a backward pass's weight gradients would otherwise derive one map and plan at a time."""
    pending = list(dict.fromkeys(
        (kernel_map, rounds, round_major) for kernel_map, rounds, round_major in requests
        if is_cupy_array(kernel_map.pair_table)
        and (rounds, round_major) not in kernel_map.__dict__.get("_wgrad_shares", {})))
    if not pending:
        return
    with pending[0][0].derive_in():
        shares = wgrad_shares_of([(kernel_map.csr().offsets, rounds, round_major)
                                  for kernel_map, rounds, round_major in pending])
    for (kernel_map, rounds, round_major), derived in zip(pending, shares):
        kernel_map.__dict__.setdefault("_wgrad_shares", {})[rounds, round_major] = derived


def derive_reverses(kernel_maps) -> None:
    """Compute the reversed map of each GPU map of `kernel_maps` that has none yet and is not mirror-symmetric,
    inverting their tables together (`map_formats.invert_pair_tables`): a network's transposed maps, or the
    maps a backward pass runs over, in a few launches. A mirror-symmetric map's reverse is its flipped table,
    which its users read in place (`reversed` makes it on demand)."""
    pending = [kernel_map for kernel_map in dict.fromkeys(kernel_maps)
               if is_cupy_array(kernel_map.pair_table) and "_reversed" not in kernel_map.__dict__
               and kernel_map.__dict__.get("_reverse_of") is None and not kernel_map.mirror_symmetric]
    if not pending:
        return
    with pending[0].derive_in():
        tables = invert_pair_tables([(kernel_map.pair_table, kernel_map.num_in) for kernel_map in pending])
    for kernel_map, table in zip(pending, tables):
        kernel_map._reversed = kernel_map._reverse_with(table)


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


class _MapQuery(NamedTuple):
    """The pair-table query of a submanifold or strided map (the arguments of `hashing.pair_tables`), and what
    else its map is made of."""

    index: object
    out_coords: object
    query: Query
    same_coordinates: bool
    num_in: int
    geometry: tuple[tuple[int, ...], ...]  # kernel size, stride, dilation


def _answered(map_queries: list[_MapQuery]) -> list[KernelMap]:
    """The maps of `map_queries`, their tables queried together (on the GPU, one allocation and one launch)."""
    answers = pair_tables([map_query[:4] for map_query in map_queries])
    return [KernelMap(table, map_query.num_in, *map_query.geometry, offset_mask=mask)
            for map_query, (table, mask) in zip(map_queries, answers)]


def _submanifold_query(in_coords, geometry, index) -> _MapQuery:
    """The query of a submanifold map of checked `geometry` (kernel size, stride of ones, dilation)."""
    kernel_size, stride, dilation = geometry
    _check_query_memory(kernel_size, in_coords)
    query = Query(kernel_size, dilation, out_scale=stride, divisor=stride)
    return _MapQuery(index, in_coords, query, True, in_coords.shape[0], geometry)


def _strided_query(in_coords, geometry, index, out_coords) -> _MapQuery:
    """The query of a strided map of checked `geometry` from `in_coords` to `out_coords`."""
    kernel_size, stride, dilation = geometry
    _check_query_memory(kernel_size, out_coords)
    query = Query(kernel_size, dilation, out_scale=stride, divisor=(1,) * len(stride))
    return _MapQuery(index, out_coords, query, False, in_coords.shape[0], geometry)


def _identity_map(pairs: CsrPairs, geometry) -> KernelMap:
    """The map of a 1 x 1 submanifold convolution of checked `geometry`, from its `identity_pairs`. The zero
    offset alone: every row is its own only neighbour, so every row's bitmask is the same and the stable order
    by mask is the rows' own (no sort to run), and the one offset's pair list is every row with itself (nothing
    to count, so no synchronisation)."""
    num_rows = pairs.in_idx.shape[0]
    return KernelMap(pairs.in_idx[None, :], num_rows, *geometry, mask_sorted_order=pairs.in_idx, csr=pairs)


def submanifold_map(in_coords, kernel_size, dilation=1, index=None) -> KernelMap:
    """Output = input coordinates. `index` reuses a `hashing.build_index(in_coords)`."""
    geometry = _geometry(in_coords, kernel_size, 1, dilation)
    if all(k == 1 for k in geometry[0]):
        return _identity_map(identity_pairs(in_coords.shape[0], in_coords), geometry)
    return _answered([_submanifold_query(in_coords, geometry, index or build_index(in_coords))])[0]


def strided_map(in_coords, kernel_size, stride, dilation=1, index=None, out_coords=None):
    """(out_coords, map) of a strided convolution; `out_coords` defaults to the downsampled input."""
    geometry = _geometry(in_coords, kernel_size, stride, dilation)
    if out_coords is None:
        out_coords = downsample_coordinates(in_coords, geometry[1])
    index = index or build_index(in_coords)
    return out_coords, _answered([_strided_query(in_coords, geometry, index, out_coords)])[0]


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


def padded_map(in_coords, kernel_size, stride, dilation=1, padding=0, spatial_shape=None, index=None):
    """(out_coords, their spatial shape or None, map) of a padded convolution (spconv's regular one, at any
    stride): every voxel a tap reaches, kept inside the output's spatial shape when `spatial_shape` (the
    input's) is given. See `padding` for the rules."""
    return _padded_map(in_coords, kernel_size, stride, dilation, padding, spatial_shape, index, transposed=False)


def padded_generative_map(in_coords, kernel_size, stride, dilation=1, padding=0, spatial_shape=None, index=None):
    """(out_coords, their spatial shape or None, map) of a padded transposed convolution (spconv's
    SparseConvTranspose): every `in·stride - padding + dilation·tap`, kept inside the output's spatial shape
    when `spatial_shape` (the input's) is given. See `padding` for the rules."""
    return _padded_map(in_coords, kernel_size, stride, dilation, padding, spatial_shape, index, transposed=True)


def _padded_map(in_coords, kernel_size, stride, dilation, padding, spatial_shape, index, transposed: bool):
    kernel_size, stride, dilation = _geometry(in_coords, kernel_size, stride, dilation)
    padding = as_padding(padding, len(kernel_size))
    out_shape = None
    if spatial_shape is not None:
        output_shape = transposed_output_shape if transposed else conv_output_shape
        out_shape = output_shape(spatial_shape, kernel_size, stride, dilation, padding)
    out_coords = reached_coordinates(in_coords, kernel_size, stride, dilation, padding, out_shape, transposed)
    index = index or build_index(in_coords)
    _check_query_memory(kernel_size, out_coords)
    table, mask = index.pair_table(out_coords, padded_query(kernel_size, stride, dilation, padding, transposed))
    kernel_map = KernelMap(table, in_coords.shape[0], kernel_size, stride, dilation, transposed=transposed,
                           generative=transposed, offset_mask=mask, padding=padding)
    return out_coords, out_shape, kernel_map


def _memoised(by_arguments: dict, arguments: tuple) -> MapResult | None:
    """The result `KernelMapCache.kernel_map` memoised for `arguments`, else None.

    A layer asks with the same arguments every call: one look-up, no normalising. An equal float or bool
    (3.0 == 3, True == 1) finds an int's entry too and must meet the checks that reject it, so the sizes
    must be the very objects that passed them or of the same types throughout (the layers sharing a map
    each hold their own equal tuples). A padded convolution's result whose output cache is gone is no
    result: its next call builds it again.
    """
    try:
        checked, result = by_arguments[arguments]
    except (KeyError, TypeError):  # TypeError: unhashable arguments (lists), never memoised
        return None
    # Kernel size, stride, dilation and padding; the tensor stride is the library's own, the flags are no sizes.
    for index in _SIZE_ARGUMENTS:
        given, accepted = arguments[index], checked[index]
        if given is not accepted and not _same_types(given, accepted):
            return None
    return _held(result)


_SIZE_ARGUMENTS = (1, 2, 3, 6)  # of `KernelMapCache.kernel_map`'s arguments after `self`


def _same_types(given, accepted) -> bool:
    """Whether two equal sizes (an int, or a tuple of ints) have the same types element by element."""
    if type(given) is not type(accepted):
        return False
    return type(given) is not tuple or tuple(map(type, given)) == tuple(map(type, accepted))


class _OutputCacheRef(weakref.ref):
    """A cache's weak reference to the output cache of one of its padded convolutions, which holds it in
    turn (`Origin`) and is kept by the output's tensors."""

    __slots__ = ()


def _held(result: MapResult) -> MapResult | None:
    """`result` as a caller gets it: a padded convolution's with its output cache held (None when that cache is
    gone), any other as it is."""
    if type(result.output_cache) is not _OutputCacheRef:
        return result
    cache = result.output_cache()
    return None if cache is None else dataclasses.replace(result, output_cache=cache)


class MapRequest(NamedTuple):
    """The arguments of one `KernelMapCache.kernel_map` call, for `KernelMapCache.build_maps`, and `cache`, the
    map cache it runs in: 0 the one building, k the k-th new cache an earlier request's output started (a padded
    or generative convolution's), in the order of the requests."""

    tensor_stride: tuple[int, ...]
    kernel_size: int | tuple[int, ...]
    stride: int | tuple[int, ...] = 1
    dilation: int | tuple[int, ...] = 1
    transposed: bool = False
    generative: bool = False
    padding: int | tuple[int, ...] | None = None
    cache: int = 0

    def arguments(self) -> tuple:
        """The arguments of `KernelMapCache.kernel_map`."""
        return self[:-1]


class _Planned(NamedTuple):
    """A `MapRequest` as a build runs it: its sizes checked once (as `kernel_map` checks them) and what its map
    needs of the cache, so the build's steps read fields rather than normalise the request again each."""

    request: MapRequest
    reached: tuple[int, ...] | None  # the level a plain strided convolution reaches, else None
    looked_up: tuple[int, ...] | None  # the level whose index its map looks up, else None
    # A plain map's `KernelMapCache._maps` key: its own, or a transposed one's the strided map it inverts; else None.
    forward_key: tuple | None


def _planned(request: MapRequest, spatial_dims: int) -> _Planned:
    """`request` planned (`_Planned`), memoised for the very request object: a network hands every build the
    same requests, and an equal request of other types (a bool for an int) must meet the checks itself."""
    try:
        held, planned = _PLANNED[request, spatial_dims]
        if held is request:
            return planned
    except KeyError:
        pass
    except TypeError:  # unhashable sizes (lists): planned every time
        return _plan(request, spatial_dims)
    planned = _PLANNED[request, spatial_dims] = (request, _plan(request, spatial_dims))
    return planned[1]


_PLANNED: dict[tuple, tuple[MapRequest, _Planned]] = {}


def _plan(request: MapRequest, spatial_dims: int) -> _Planned:
    tensor_stride = tuple(request.tensor_stride)
    kernel_size = as_tuple(request.kernel_size, spatial_dims, "kernel_size")
    check_kernel_volume(kernel_size)
    stride = as_tuple(request.stride, spatial_dims, "stride")
    dilation = as_tuple(request.dilation, spatial_dims, "dilation")
    plain = request.padding is None and not request.generative
    strided = any(s != 1 for s in stride)
    reached = looked_up = forward_key = None
    if request.transposed and not request.generative:
        if plain:  # the strided map it inverts looks up the finer level (a padded one inverts the map that made
            # its coordinates, looking nothing up)
            looked_up = _fine_stride(tensor_stride, stride)
            forward_key = (looked_up, kernel_size, stride, dilation, False, False, None)
    else:
        if plain and strided:
            reached = tuple(t * s for t, s in zip(tensor_stride, stride))
        if not (plain and not strided and all(k == 1 for k in kernel_size)):  # the identity map looks nothing up
            looked_up = tensor_stride
        if plain:
            forward_key = (tensor_stride, kernel_size, stride, dilation, False, False, None)
    return _Planned(request, reached, looked_up, forward_key)


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


class MapsUnderway:
    """A `KernelMapCache.start_maps` build: `results()` finishes it where nothing has yet and returns what
    `build_maps` would have (each request's `MapResult`), which hold the caches that padded convolutions'
    outputs start until the layers that run in them. It holds its cache weakly: a cache whose tensors are all
    gone has nothing left to build."""

    def __init__(self, cache: KernelMapCache, planned: list[_Planned], with_reversed: bool, levels: tuple):
        self._cache = weakref.ref(cache)
        self.planned, self.with_reversed, self.levels = planned, with_reversed, levels
        self._results: list[MapResult] | None = None

    def results(self) -> list[MapResult]:
        if self._results is None:
            cache = self._cache()
            if cache is None:
                raise RuntimeError("the map cache of this build is gone: nothing to finish")
            self._results = cache._build_all(self)
            self.planned = self.levels = None
        return self._results


@dataclass(frozen=True)
class Origin:
    """How a padded convolution made the coordinates of a cache: its geometry (kernel size, stride, dilation,
    padding), its map, and its input, the coordinates at `tensor_stride` of `cache`. Its inverse returns there."""

    geometry: tuple[tuple[int, ...], ...]
    kernel_map: KernelMap
    cache: KernelMapCache
    tensor_stride: tuple[int, ...]


class KernelMapCache:
    """Coordinates per tensor stride, their indices, and the maps built between them.

    Shared by every tensor derived from one input through submanifold, strided and transposed
    convolutions, so a U-Net builds each map once and its decoder reuses the encoder's maps
    (a transposed convolution inverts the matching strided map). Generative and padded convolutions
    create new coordinates and so start a cache of their own; a padded convolution's output cache
    keeps its `origin`, where its inverse returns to (the input's cache, held: the input's cache holds its
    output cache only weakly).

    `spatial_shape` is that of the input coordinates (spconv's: each coordinate in [0, shape)), or None; the
    levels downsampled from them get ceil(shape / step), padded convolutions spconv's output shapes.
    `derive_in` (a context-manager factory, settable) is what its maps derive their formats in later:
    a framework adapter sets its stream and allocator, which the maps are built in too.
    """

    def __init__(self, coordinates, tensor_stride: tuple[int, ...], derive_in=contextlib.nullcontext, *,
                 spatial_shape: tuple[int, ...] | None = None, origin: Origin | None = None):
        self.derive_in = derive_in
        self._input_stride = tuple(tensor_stride)
        self._spatial_shape = None if spatial_shape is None else tuple(spatial_shape)
        self.origin = origin
        self._coordinates = {self._input_stride: coordinates}
        self._indices = {}
        self._maps: dict[tuple, MapResult] = {}
        # A call's arguments as given → (those arguments, their result): see `_memoised`.
        self._by_arguments: dict[tuple, tuple[tuple, MapResult]] = {}
        self._underway: MapsUnderway | None = None  # `start_maps`' second step, until it runs

    def coordinates(self, tensor_stride: tuple[int, ...]):
        try:
            return self._coordinates[tuple(tensor_stride)]
        except KeyError:
            if self._underway is not None:
                self._finish_maps()
                return self.coordinates(tensor_stride)
            known = sorted(self._coordinates)
            raise ValueError(
                f"no coordinates at tensor stride {tuple(tensor_stride)} in this map cache (known: {known}); "
                "a transposed convolution returns to the coordinates of a tensor this one was downsampled "
                "from; use generative=True to create new coordinates instead"
            ) from None

    def spatial_shape(self, tensor_stride: tuple[int, ...]) -> tuple[int, ...] | None:
        """The spatial shape of the coordinates at `tensor_stride` (see the class), or None."""
        if self._spatial_shape is None:
            return None
        return tuple(-(-size * base // step) for size, base, step in zip(self._spatial_shape, self._input_stride,
                                                                          tensor_stride))

    def downsample_to(self, tensor_strides) -> None:
        """Compute now the coordinates at each of `tensor_strides` (multiples of the input's stride),
        which strided convolutions reach later.

        One pass over the input coordinates gives every level (`unique(floor(c / 4))` has the rows of
        two steps of 2, in the same order), with one synchronisation of the GPU for all of them: a
        strided convolution reaching a level alone synchronises once per level, after the layers
        queued before it. A network calls this with its levels before its first layer.
        """
        self._finish_maps()
        self._set_levels(self._start_levels(tensor_strides))

    def _start_levels(self, tensor_strides) -> tuple[list, UniqueCoordinates]:
        """(the strides among `tensor_strides` not known yet, their coordinates under way)."""
        wanted = []
        for tensor_stride in tensor_strides:
            tensor_stride = as_tuple(tensor_stride, len(self._input_stride), "tensor_stride")
            if any(s % b for s, b in zip(tensor_stride, self._input_stride)):
                raise ValueError(f"cannot downsample coordinates at tensor stride {self._input_stride} to "
                                 f"{tensor_stride}: each axis needs a positive multiple of the input's")
            if tensor_stride not in self._coordinates and tensor_stride not in wanted:
                wanted.append(tensor_stride)
        divisors = [tuple(s // b for s, b in zip(stride, self._input_stride)) for stride in wanted]
        return wanted, start_unique_coordinates_by(self._coordinates[self._input_stride], divisors)

    def _set_levels(self, levels: tuple[list, UniqueCoordinates]) -> None:
        strides, coordinates = levels
        self._coordinates.update(zip(strides, coordinates.result()))

    def build_maps(self, requests, with_reversed: bool = False) -> list[MapResult]:
        """`kernel_map(*request.arguments())` of the cache each of `requests` (`MapRequest`s) names, built now,
        as a network's first layer would have them built one by one: in each cache, the coordinates of every
        level its strided convolutions reach in one synchronisation and the indices its maps look up, together
        (`_prepare_levels`), then the maps that query them, together (`_build_together`), then each map; last the
        mask-sorted orders of all of them in one sort (and, `with_reversed`, of the reversed maps a backward pass
        runs over: those of the maps that are not mirror-symmetric, since the GPU's dgrad reads a
        mirror-symmetric map's own table with its offsets flipped). `with_reversed` also starts counting the pairs
        of the maps' CSR lists, which their weight gradients read, together (`derive_pair_counts`)."""
        return self._underway_build(requests, with_reversed).results()

    def start_maps(self, requests, with_reversed: bool = False) -> MapsUnderway:
        """`build_maps` in two steps, as a network's inference calls it before its first layer. Now: the launches
        of this cache's levels up to their counts, then the maps between the coordinates known already (the
        input's submanifold and 1 x 1 maps) with their mask-sorted orders. The rest when this cache is first asked
        for a map it lacks or for the coordinates of a level (or at `results()`): its one synchronisation then
        waits for the counts, not for the layers queued since over the maps built now, which the GPU runs while
        the host builds the rest. Two steps cost the host more than one (two sorts, two queries): they pay where
        the GPU has layers queued to run meanwhile, not where the host lags behind it (a training step's)."""
        underway = self._underway_build(requests, with_reversed)
        if not underway.levels[0] or not is_cupy_array(self._coordinates[self._input_stride]):  # nothing to wait for
            underway.results()
            return underway
        known = [planned for planned in underway.planned
                 if planned.request.cache == 0 and planned.forward_key is not None and not planned.request.transposed
                 and planned.reached is None and planned.forward_key[0] in self._coordinates]
        self._prepare_indices(known)
        derive_mask_orders(result.kernel_map for result in self._build_together(known))
        self._underway = underway
        return underway

    def _underway_build(self, requests, with_reversed: bool) -> MapsUnderway:
        """The build of `requests` (planned: `_Planned`), its levels' launches queued up to their counts."""
        self._finish_maps()
        spatial_dims = len(self._input_stride)
        planned = [_planned(request, spatial_dims) for request in requests]
        levels = self._start_levels(
            [entry.reached for entry in planned if entry.request.cache == 0 and entry.reached is not None])
        return MapsUnderway(self, planned, with_reversed, levels)

    def _finish_maps(self) -> None:
        """`start_maps`' second step, where one is under way."""
        if self._underway is not None:
            self._underway.results()

    def _build_all(self, underway: MapsUnderway) -> list[MapResult]:
        """`underway`'s build from its levels on: all of `build_maps`, the second step of `start_maps`."""
        self._underway = None
        with self.derive_in():
            self._set_levels(underway.levels)
            by_cache: dict[int, list[_Planned]] = {}
            for planned in underway.planned:
                by_cache.setdefault(planned.request.cache, []).append(planned)
            caches, results = [self], []
            for planned in underway.planned:
                request = planned.request
                if request.cache >= len(caches):
                    raise ValueError(f"{request} runs in map cache {request.cache}, but the requests before it "
                                     f"made {len(caches) - 1} new ones")
                cache = caches[request.cache]
                if request.cache in by_cache:
                    group = by_cache.pop(request.cache)
                    cache._prepare_levels(group)
                    cache._build_together(group)
                result = cache.kernel_map(*request.arguments())
                output_cache = result.out_map_cache
                if output_cache not in caches:
                    caches.append(output_cache)
                results.append(result)
            kernel_maps = [result.kernel_map for result in results]
            if underway.with_reversed:
                derive_pair_counts(kernel_maps)
                derive_reverses(kernel_maps)
                kernel_maps += [kernel_map.reversed() for kernel_map in kernel_maps
                                if not kernel_map.mirror_symmetric]
            derive_mask_orders(kernel_maps)
        return results

    def _prepare_levels(self, planned: list[_Planned]) -> None:
        """Before this cache's `planned` requests are built: the coordinates of every level their strided
        convolutions reach (`downsample_to`), then the indices of every level their maps look up
        (`_prepare_indices`)."""
        self.downsample_to([entry.reached for entry in planned if entry.reached is not None])
        self._prepare_indices(planned)

    def _prepare_indices(self, planned: list[_Planned]) -> None:
        """The indices of every level the maps of `planned` requests look up that has none yet, which share one
        allocation (`hashing.build_indices`)."""
        missing = [stride for stride in dict.fromkeys(entry.looked_up for entry in planned)
                   if stride is not None and stride not in self._indices]
        for tensor_stride, index in zip(missing, build_indices([self.coordinates(stride) for stride in missing])):
            self._indices[tensor_stride] = index

    def _build_together(self, planned: list[_Planned]) -> list[MapResult]:
        """Before this cache's `planned` requests are built one by one: the plain submanifold, identity and strided
        maps among them (and those their transposed convolutions invert), together (`_built_forward`), then the
        reverses the transposed ones are (`derive_reverses`); the forward requests' calls are memoised as
        `kernel_map` would.
        Padded and generative maps make coordinates of their own first: those stay for the requests' own
        calls. Returns the forward maps' results it built."""
        plain = [entry for entry in planned if entry.forward_key is not None]
        pending = [key for key in dict.fromkeys(entry.forward_key for entry in plain) if key not in self._maps]
        built = self._built_forward(pending)
        self._maps.update(zip(pending, built))
        for entry in plain:
            if not entry.request.transposed:
                self._remember(entry.request.arguments(), self._maps[entry.forward_key])
        derive_reverses([self._maps[entry.forward_key].kernel_map for entry in plain if entry.request.transposed])
        return built

    def _built_forward(self, keys: list[tuple]) -> list[MapResult]:
        """The results of the plain forward maps of normalised `keys` (submanifold, identity and strided), built
        together: the pair tables in one query (`hashing.pair_tables`), the identity maps' pairs in one launch
        (`identity_pairs_of`)."""
        queries, identities = [], []
        for key in keys:
            tensor_stride, geometry, stride = key[0], key[1:4], key[2]
            coords = self.coordinates(tensor_stride)
            if all(k == 1 for k in geometry[0]) and all(s == 1 for s in stride):
                identities.append(key)
            elif all(s == 1 for s in stride):
                queries.append(_submanifold_query(coords, geometry, self._index(tensor_stride)))
            else:
                queries.append(_strided_query(coords, geometry, self._index(tensor_stride),
                                              self._level(tensor_stride, stride)))
        identity_pairs = identity_pairs_of([self.coordinates(key[0]).shape[0] for key in identities],
                                           self.coordinates(self._input_stride))
        built = dict(zip([key for key in keys if key not in identities], _answered(queries)))
        built.update((key, _identity_map(pairs, key[1:4])) for key, pairs in zip(identities, identity_pairs))
        results = []
        for key in keys:
            kernel_map, out_stride = built[key], tuple(t * s for t, s in zip(key[0], key[2]))
            kernel_map.derive_in = self.derive_in
            results.append(MapResult(kernel_map, self.coordinates(out_stride), out_stride, weakref.ref(self)))
        return results

    def _level(self, tensor_stride: tuple[int, ...], stride: tuple[int, ...]):
        """The coordinates a strided convolution of `stride` reaches from `tensor_stride`, downsampled now where
        no level reached them yet."""
        out_stride = tuple(t * s for t, s in zip(tensor_stride, stride))
        if out_stride not in self._coordinates:
            self._coordinates[out_stride] = downsample_coordinates(self.coordinates(tensor_stride), stride)
        return self._coordinates[out_stride]

    def _index(self, tensor_stride):
        if tensor_stride not in self._indices:
            self._indices[tensor_stride] = build_index(self.coordinates(tensor_stride))
        return self._indices[tensor_stride]

    def __len__(self) -> int:
        return len(self._maps)

    def kernel_map(self, tensor_stride, kernel_size, stride=1, dilation=1, transposed=False, generative=False,
                   padding=None):
        """The `MapResult` of a convolution applied to the coordinates at `tensor_stride`, cached; `padding`
        (None: none, the unpadded rules) makes it a padded one (`padding`)."""
        arguments = (tensor_stride, kernel_size, stride, dilation, transposed, generative, padding)
        result = _memoised(self._by_arguments, arguments)
        if result is None and self._underway is not None:
            self._finish_maps()
            result = _memoised(self._by_arguments, arguments)
        if result is None:
            result, kept = self._normalised_kernel_map(*arguments)
            self._remember(arguments, kept)
        return result

    def _remember(self, arguments: tuple, kept: MapResult) -> None:
        """Memoise `kernel_map(*arguments)`'s result as `_maps` keeps it (see `_memoised`)."""
        with contextlib.suppress(TypeError):  # unhashable arguments (lists): never memoised
            self._by_arguments[arguments] = (arguments, kept)

    def lookup(self, tensor_stride, kernel_size, stride=1, dilation=1, transposed=False, generative=False,
               padding=None):
        """The `MapResult` of an earlier `kernel_map` call with these same arguments, else None."""
        return _memoised(self._by_arguments,
                         (tensor_stride, kernel_size, stride, dilation, transposed, generative, padding))

    def _normalised_kernel_map(self, tensor_stride, kernel_size, stride, dilation, transposed, generative, padding):
        """(the result, as `_maps` keeps it): a padded convolution's keeps its output cache weakly."""
        coords = self.coordinates(tensor_stride)
        tensor_stride = tuple(tensor_stride)
        kernel_size, stride, dilation = _geometry(coords, kernel_size, stride, dilation)
        if padding is not None:
            padding = as_padding(padding, len(kernel_size))
            if not generative and max(kernel_size + stride) == 1 and not any(padding):
                # spconv's 1x1 convolution: a matrix product on its input's coordinates, the submanifold one's.
                padding = None
        if generative and not transposed:
            raise ValueError("generative=True needs transposed=True")
        key = (tensor_stride, kernel_size, stride, dilation, transposed, generative, padding)
        kept = self._maps.get(key)
        result = None if kept is None else _held(kept)
        if result is not None:
            return result, kept
        if kept is not None:  # a padded convolution whose output's tensors are all gone: its map is still good
            result = self._padded_output(kept.kernel_map, kept.out_coordinates, tensor_stride, key[1:4] + (padding,))
        else:
            sizes = MapSizes(int(coords.shape[0]), *key)
            with naming_map_sizes(sizes):
                if padding is None:
                    result = self._build(coords, tensor_stride, kernel_size, stride, dilation, transposed, generative)
                else:
                    result = self._build_padded(coords, *key)
            result.kernel_map.derive_in = self.derive_in
        kept = result
        if not transposed and padding is not None:  # the output cache holds this one (`Origin`): weakly
            kept = dataclasses.replace(result, output_cache=_OutputCacheRef(result.output_cache))
        self._maps[key] = kept
        return result, kept

    def _build(self, coords, tensor_stride, kernel_size, stride, dilation, transposed, generative) -> MapResult:
        if not transposed:
            return self._built_forward([(tensor_stride, kernel_size, stride, dilation, False, False, None)])[0]
        fine_stride = _fine_stride(tensor_stride, stride)
        if generative:
            out_coords, backward = generative_map(coords, kernel_size, stride, dilation, self._index(tensor_stride))
            return MapResult(backward, out_coords, fine_stride, KernelMapCache(out_coords, fine_stride, self.derive_in))
        forward = self.kernel_map(fine_stride, kernel_size, stride, dilation).kernel_map
        return MapResult(transposed_map(forward), self.coordinates(fine_stride), fine_stride, weakref.ref(self))

    def _build_padded(self, coords, tensor_stride, kernel_size, stride, dilation, transposed, generative,
                      padding) -> MapResult:
        geometry = (kernel_size, stride, dilation, padding)
        if not transposed:
            out_coords, _, forward = padded_map(coords, *geometry, self.spatial_shape(tensor_stride),
                                                self._index(tensor_stride))
            return self._padded_output(forward, out_coords, tensor_stride, geometry)
        if generative:
            # spconv's geometry counts voxels at each level: a stride that does not divide the tensor stride
            # (an upsampling below the input's voxels) leaves the quotient rounded down, at least 1.
            fine_stride = tuple(max(t // s, 1) for t, s in zip(tensor_stride, stride))
            out_coords, out_shape, backward = padded_generative_map(
                coords, *geometry, self.spatial_shape(tensor_stride), self._index(tensor_stride))
            return MapResult(backward, out_coords, fine_stride,
                             KernelMapCache(out_coords, fine_stride, self.derive_in, spatial_shape=out_shape))
        origin = self.origin
        if origin is None or tensor_stride != self._input_stride or origin.geometry != geometry:
            made_by = "no padded convolution" if origin is None else (
                "a padded convolution of kernel size {}, stride {}, dilation {}, padding {}".format(*origin.geometry)
            )
            raise ValueError(
                f"a padded transposed convolution (kernel size {kernel_size}, stride {stride}, dilation {dilation}, "
                f"padding {padding}) inverts the padded convolution that made its input's coordinates, with that "
                f"same geometry; these coordinates (tensor stride {tensor_stride}) were made by {made_by}"
            )
        return MapResult(transposed_map(origin.kernel_map), origin.cache.coordinates(origin.tensor_stride),
                         origin.tensor_stride, origin.cache)

    def _padded_output(self, forward: KernelMap, out_coords, tensor_stride, geometry) -> MapResult:
        """The result of the padded convolution `forward` of the coordinates at `tensor_stride`: its output
        coordinates in a cache of their own, with their spatial shape and this `Origin`."""
        kernel_size, stride, dilation, padding = geometry
        in_shape = self.spatial_shape(tensor_stride)
        out_shape = None if in_shape is None else conv_output_shape(in_shape, kernel_size, stride, dilation, padding)
        out_stride = tuple(t * s for t, s in zip(tensor_stride, stride))
        origin = Origin(geometry, forward, self, tensor_stride)
        return MapResult(forward, out_coords, out_stride,
                         KernelMapCache(out_coords, out_stride, self.derive_in, spatial_shape=out_shape, origin=origin))


def _fine_stride(tensor_stride: tuple[int, ...], stride: tuple[int, ...]) -> tuple[int, ...]:
    """The tensor stride a transposed convolution of `stride` returns to from `tensor_stride`."""
    if any(t % s for t, s in zip(tensor_stride, stride)):
        raise ValueError(f"a transposed convolution with stride {stride} needs a tensor stride divisible by it, "
                         f"got {tensor_stride}")
    return tuple(t // s for t, s in zip(tensor_stride, stride))
