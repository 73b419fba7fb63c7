"""Kernel maps: which input row feeds which output row through which kernel offset.

A `KernelMap` holds the pair table `[K, N_out]` (input row, or -1 when offset k of output row i
has no input) and derives on demand the per-offset CSR lists, the per-row offset bitmask and the
mask-sorted row order. The builders below work on NumPy (CPU reference) or CuPy (GPU) coordinates
alike; only the coordinate index (`coordinate_index`) and the bitmask differ per backend.

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
from dataclasses import dataclass

import numpy as np

from .backend import array_module, is_cupy_array
from .compile import KernelSource, launch_config
from .coordinate_index import Query, build_index, unique_coordinates
from .coords import as_tuple, kernel_offsets, key_layout

_FORMAT_KERNELS = KernelSource("kernel_map_formats.cu", ("offset_mask",))


@dataclass(frozen=True)
class CsrPairs:
    """Pairs grouped by offset: pairs `offsets[k]:offsets[k+1]` belong to offset k, by output row."""

    in_idx: object
    out_idx: object
    offsets: object


class KernelMap:
    """The pair table of one convolution and the formats derived from it."""

    def __init__(
        self, pair_table, num_in: int, kernel_size, stride, dilation, transposed=False, generative=False,
        offset_mask=None,
    ):
        self.pair_table = pair_table
        if offset_mask is not None:  # already computed by the query: skip the derivation
            self._offset_mask = offset_mask
        self.num_in = num_in
        self.kernel_size = tuple(kernel_size)
        self.stride = tuple(stride)
        self.dilation = tuple(dilation)
        self.transposed = transposed
        self.generative = generative
        self._launch_plans = {}

    @property
    def kernel_volume(self) -> int:
        return self.pair_table.shape[0]

    @property
    def num_out(self) -> int:
        return self.pair_table.shape[1]

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
    def _csr(self) -> CsrPairs:
        return csr_pairs(self.pair_table)

    def csr(self) -> CsrPairs:
        """Per-offset pair lists (computed once; on the GPU this synchronises for the pair count)."""
        return self._csr

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
        return offset_mask(self.pair_table)

    def offset_mask(self):
        """uint32 `[N_out, ceil(K/32)]`: bit k%32 of word k//32 set when offset k has an input."""
        return self._offset_mask

    @functools.cached_property
    def _mask_sorted_order(self):
        return mask_sorted_order(self.offset_mask())

    def mask_sorted_order(self):
        """Output rows ordered by their offset bitmask (as a little-endian big integer), stable."""
        return self._mask_sorted_order

    @functools.cached_property
    def _reversed(self) -> KernelMap:
        if self._is_mirror_symmetric():
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
        )
        reverse._reversed = self
        return reverse

    def _is_mirror_symmetric(self) -> bool:
        """A map between the same coordinates whose offsets come in mirror pairs (o_(K-1-k) = -o_k:
        odd kernel sizes), as submanifold maps are."""
        offsets = self.offsets
        return self.identity_offset is not None and bool((offsets[::-1] == -offsets).all())

    def reversed(self) -> KernelMap:
        """The same pairs indexed by input row (`[K, N_in]` → output row), computed once.

        The input gradient is a forward pass over this map with the weights transposed.
        """
        return self._reversed

    def launch_plan(self, key, build):
        """What `build()` made for `key` on first use (None included), kept with the map: an
        algorithm's launch settings for one layer over this map (kernels, grid, fixed arguments), so
        that later calls only allocate and launch."""
        try:
            return self._launch_plans[key]
        except KeyError:
            plan = self._launch_plans[key] = build()
            return plan

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


def csr_pairs(pair_table) -> CsrPairs:
    """The per-offset pair lists of a pair table; see `KernelMap.csr`."""
    xp = array_module(pair_table)
    kernel_volume, num_out = pair_table.shape
    valid = pair_table >= 0
    flat = xp.flatnonzero(valid.ravel())  # k-major, then output row ascending
    offsets = xp.zeros(kernel_volume + 1, dtype=np.int64)
    xp.cumsum(valid.sum(axis=1, dtype=np.int64), out=offsets[1:])
    return CsrPairs(
        in_idx=pair_table.ravel()[flat],
        out_idx=(flat % max(num_out, 1)).astype(np.int32),
        offsets=offsets,
    )


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


def mask_sorted_order(mask):
    """Rows ordered by their offset bitmask (as a little-endian big integer), stable."""
    xp = array_module(mask)
    if mask.shape[1] == 1:
        return xp.argsort(mask[:, 0], kind="stable").astype(np.int32)
    # The last key is the primary one: the highest word is the most significant.
    return xp.lexsort(mask.T).astype(np.int32)


def downsample_coordinates(coords, stride):
    """unique(floor(coords / stride)) per batch, in order of first occurrence in `coords`."""
    return unique_coordinates(coords, as_tuple(stride, coords.shape[1] - 1, "stride"))


def generative_coordinates(coords, kernel_size, stride, dilation):
    """Every coordinate `in·stride + dilation·o_k`, unique, in order of first occurrence with
    input rows outer and offsets inner.

    Raises ValueError when one falls outside the key range (it would wrap, not fail, otherwise).
    """
    xp = array_module(coords)
    spatial_dims = coords.shape[1] - 1
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
    spatial_dims = coords.shape[1] - 1
    return (
        as_tuple(kernel_size, spatial_dims, "kernel_size"),
        as_tuple(stride, spatial_dims, "stride"),
        as_tuple(dilation, spatial_dims, "dilation"),
    )


def submanifold_map(in_coords, kernel_size, dilation=1, index=None) -> KernelMap:
    """Output = input coordinates. `index` reuses a `coordinate_index.build_index(in_coords)`."""
    kernel_size, stride, dilation = _geometry(in_coords, kernel_size, 1, dilation)
    if all(k == 1 for k in kernel_size):  # the zero offset alone: every row is its own only neighbour
        table = array_module(in_coords).arange(in_coords.shape[0], dtype=np.int32)[None, :]
        return KernelMap(table, in_coords.shape[0], kernel_size, stride, dilation)
    index = index or build_index(in_coords)
    query = Query(kernel_size, dilation, out_scale=stride, divisor=stride)
    table, mask = index.pair_table(in_coords, query, same_coordinates=True)
    return KernelMap(table, in_coords.shape[0], kernel_size, stride, dilation, offset_mask=mask)


def strided_map(in_coords, kernel_size, stride, dilation=1, index=None, out_coords=None):
    """(out_coords, map) of a strided convolution; `out_coords` defaults to the downsampled input."""
    kernel_size, stride, dilation = _geometry(in_coords, kernel_size, stride, dilation)
    if out_coords is None:
        out_coords = downsample_coordinates(in_coords, stride)
    index = index or build_index(in_coords)
    ones = (1,) * len(stride)
    table, mask = index.pair_table(out_coords, Query(kernel_size, dilation, out_scale=stride, divisor=ones))
    return out_coords, KernelMap(table, in_coords.shape[0], kernel_size, stride, dilation, offset_mask=mask)


def invert_pair_table(pair_table, num_in: int):
    """The pair table seen from the input side: `[K, num_in]`, the output row each input feeds
    through offset k, or -1.

    Well defined because, for every kind of map, an input row and an offset determine at most one
    output row. Invalid entries all write -1 into one spare slot past the end, so no compaction
    (and no device synchronisation) is needed.
    """
    xp = array_module(pair_table)
    kernel_volume, num_out = pair_table.shape
    valid = pair_table >= 0
    spare = kernel_volume * num_in
    target = xp.where(valid, xp.arange(kernel_volume, dtype=np.int64)[:, None] * num_in + pair_table, spare)
    out_rows = xp.broadcast_to(xp.arange(num_out, dtype=np.int32), pair_table.shape)
    inverse = xp.full(spare + 1, -1, dtype=np.int32)
    inverse[target.ravel()] = xp.where(valid, out_rows, -1).ravel()
    return inverse[:spare].reshape(kernel_volume, num_in)


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
    ones = (1,) * len(stride)
    query = Query(kernel_size, dilation, out_scale=ones, divisor=stride, sign=-1)
    table, mask = index.pair_table(out_coords, query)
    return out_coords, KernelMap(
        table, in_coords.shape[0], kernel_size, stride, dilation, transposed=True, generative=True, offset_mask=mask
    )


@dataclass(frozen=True)
class MapResult:
    """A kernel map with the coordinates, tensor stride and cache its output tensor gets."""

    kernel_map: KernelMap
    out_coordinates: object
    out_tensor_stride: tuple[int, ...]
    out_map_cache: KernelMapCache


class KernelMapCache:
    """Coordinates per tensor stride, their indices, and the maps built between them.

    Shared by every tensor derived from one input through submanifold, strided and transposed
    convolutions, so a U-Net builds each map once and its decoder reuses the encoder's maps
    (a transposed convolution inverts the matching strided map). Generative convolutions create
    new coordinates and so start a cache of their own.
    """

    def __init__(self, coordinates, tensor_stride: tuple[int, ...]):
        self._coordinates = {tuple(tensor_stride): coordinates}
        self._indices = {}
        self._maps: dict[tuple, MapResult] = {}
        self._by_arguments: dict[tuple, MapResult] = {}

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

    def _index(self, tensor_stride):
        if tensor_stride not in self._indices:
            self._indices[tensor_stride] = build_index(self.coordinates(tensor_stride))
        return self._indices[tensor_stride]

    def __len__(self) -> int:
        return len(self._maps)

    def kernel_map(self, tensor_stride, kernel_size, stride=1, dilation=1, transposed=False, generative=False):
        """The `MapResult` of a convolution applied to the coordinates at `tensor_stride`, cached."""
        arguments = (tensor_stride, kernel_size, stride, dilation, transposed, generative)
        try:  # a layer asks with the same arguments every call: one look-up, no normalising
            return self._by_arguments[arguments]
        except (KeyError, TypeError):  # TypeError: unhashable arguments (lists), normalised below
            pass
        result = self._normalised_kernel_map(tensor_stride, kernel_size, stride, dilation, transposed, generative)
        with contextlib.suppress(TypeError):
            self._by_arguments[arguments] = result
        return result

    def lookup(self, tensor_stride, kernel_size, stride=1, dilation=1, transposed=False, generative=False):
        """The `MapResult` of an earlier `kernel_map` call with these same arguments, else None."""
        try:
            return self._by_arguments.get((tensor_stride, kernel_size, stride, dilation, transposed, generative))
        except TypeError:  # unhashable arguments: never memoised
            return None

    def _normalised_kernel_map(self, tensor_stride, kernel_size, stride, dilation, transposed, generative):
        coords = self.coordinates(tensor_stride)
        tensor_stride = tuple(tensor_stride)
        kernel_size, stride, dilation = _geometry(coords, kernel_size, stride, dilation)
        if generative and not transposed:
            raise ValueError("generative=True needs transposed=True")
        key = (tensor_stride, kernel_size, stride, dilation, transposed, generative)
        if key not in self._maps:
            self._maps[key] = self._build(coords, tensor_stride, kernel_size, stride, dilation, transposed, generative)
        return self._maps[key]

    def _build(self, coords, tensor_stride, kernel_size, stride, dilation, transposed, generative) -> MapResult:
        index = self._index(tensor_stride)
        if not transposed:
            if all(s == 1 for s in stride):
                return MapResult(submanifold_map(coords, kernel_size, dilation, index), coords, tensor_stride, self)
            out_stride = tuple(t * s for t, s in zip(tensor_stride, stride))
            if out_stride not in self._coordinates:
                self._coordinates[out_stride] = downsample_coordinates(coords, stride)
            out_coords, forward = strided_map(coords, kernel_size, stride, dilation, index, self._coordinates[out_stride])
            return MapResult(forward, out_coords, out_stride, self)
        if any(t % s for t, s in zip(tensor_stride, stride)):
            raise ValueError(f"a transposed convolution with stride {stride} needs a tensor stride divisible by it, "
                             f"got {tensor_stride}")
        fine_stride = tuple(t // s for t, s in zip(tensor_stride, stride))
        if generative:
            out_coords, backward = generative_map(coords, kernel_size, stride, dilation, index)
            return MapResult(backward, out_coords, fine_stride, KernelMapCache(out_coords, fine_stride))
        forward = self.kernel_map(fine_stride, kernel_size, stride, dilation).kernel_map
        return MapResult(transposed_map(forward), self.coordinates(fine_stride), fine_stride, self)
