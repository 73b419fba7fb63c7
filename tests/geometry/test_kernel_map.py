"""Kernel maps against a brute-force enumeration, their pair invariants and derived formats.

CPU: every map kind equals a pure-Python enumeration over coordinate tuples (dicts and sets: no
key packing, no search), satisfies the pair invariants, and derives its CSR lists, offset bitmask
and mask-sorted order exactly. GPU (`pytest -m gpu`): every map and format built from CuPy
coordinates equals the CPU one, up to 1M voxels.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np
import pytest

from cupysparse.geometry import kernel_map as kernel_map_module
from cupysparse.cuda.backend import cupy_module
from cupysparse.cuda.compile import MAX_JOBS
from cupysparse.geometry.coords import MAX_ROWS, kernel_offsets, key_layout, offset_range
from cupysparse.geometry import hashing
from cupysparse.geometry.hashing import unique_coordinates, unique_coordinates_by
from cupysparse.geometry.kernel_map import (KernelMap, KernelMapCache, MapRequest, generative_map, offset_mask, strided_map, submanifold_map,
                                   transposed_map)

# The offsets of one kernel axis, written out: odd sizes centred, even sizes lean positive.
AXIS_OFFSETS = {
    1: (0,),
    2: (0, 1),
    3: (-1, 0, 1),
    4: (-1, 0, 1, 2),
    5: (-2, -1, 0, 1, 2),
    7: (-3, -2, -1, 0, 1, 2, 3),
}


def reference_offsets(kernel_size):
    """Kernel offsets as tuples, first axis slowest."""
    return list(itertools.product(*(AXIS_OFFSETS[size] for size in kernel_size)))


def per_axis(value, spatial_dims):
    return tuple(value) if isinstance(value, tuple) else (value,) * spatial_dims


ON_DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.gpu),
]


# --- coordinate sets ------------------------------------------------------------------------------

# Box side per D for random sets: dense enough that most rows have neighbours.
BOX_SIDE = {2: 12, 3: 7}
POOL_SIZE = {2: 80, 3: 150}
NUM_BATCHES = {2: 3, 3: 2}


def random_coords(spatial_dims, seed):
    """Positions drawn once in a box straddling 0; every batch keeps a random ~70% of the *same*
    positions, so a neighbour search that ignored the batch would find rows of other batches."""
    rng = np.random.default_rng(seed)
    side = BOX_SIDE[spatial_dims]
    cells = rng.choice(side**spatial_dims, size=POOL_SIZE[spatial_dims], replace=False)
    positions = np.stack(np.unravel_index(cells, (side,) * spatial_dims), axis=1) - side // 2
    rows = []
    for batch in range(NUM_BATCHES[spatial_dims]):
        kept = positions[rng.random(len(positions)) < 0.7]
        rows.append(np.column_stack([np.full(len(kept), batch), kept]))
    coords = np.concatenate(rows).astype(np.int32)
    return coords[rng.permutation(len(coords))]


def empty_coords(spatial_dims):
    return np.empty((0, 1 + spatial_dims), dtype=np.int32)


def single_coords(spatial_dims):
    return np.array([[0] + [-5, 3, -2][:spatial_dims]], dtype=np.int32)


def limit_coords(spatial_dims, axis):
    """In two batches, the three lowest and three highest representable positions along `axis`
    (0 on the other axes): stepping past one end would, wrapped, land on the other."""
    layout = key_layout(spatial_dims)
    values = [layout.coord_min, layout.coord_min + 1, layout.coord_min + 2]
    values += [layout.coord_max - 2, layout.coord_max - 1, layout.coord_max]
    coords = np.zeros((2 * len(values), 1 + spatial_dims), dtype=np.int32)
    coords[len(values) :, 0] = 1
    coords[:, 1 + axis] = values * 2
    return coords


def blob_coords(spatial_dims, side, seed):
    """Two batches, each a box of `side` cells per axis around 0 with about half of them occupied."""
    rng = np.random.default_rng(seed)
    rows = []
    for batch in range(2):
        occupied = np.argwhere(rng.random((side,) * spatial_dims) < 0.5) - side // 2
        rows.append(np.column_stack([np.full(len(occupied), batch), occupied]))
    coords = np.concatenate(rows).astype(np.int32)
    return coords[rng.permutation(len(coords))]


COORDINATE_SETS = {
    "random": random_coords,
    "empty": empty_coords,
    "single": single_coords,
    "limits": limit_coords,
    "blob": blob_coords,
}


@dataclass(frozen=True)
class Case:
    """One map: its kind, geometry (ints or per-axis tuples, passed to the library as given) and
    coordinate set (`points`: a COORDINATE_SETS name and the arguments after `spatial_dims`)."""

    kind: str  # "submanifold", "strided", "transposed" or "generative"
    spatial_dims: int
    kernel_size: int | tuple
    stride: int | tuple
    dilation: int | tuple
    points: tuple

    def __str__(self):
        points = "-".join(str(part) for part in self.points)
        return f"{self.kind}-D{self.spatial_dims}-k{self.kernel_size}-s{self.stride}-d{self.dilation}-{points}"

    def geometry(self):
        """Per-axis (kernel_size, stride, dilation)."""
        return tuple(per_axis(value, self.spatial_dims) for value in (self.kernel_size, self.stride, self.dilation))

    def coordinates(self):
        name, *args = self.points
        return COORDINATE_SETS[name](self.spatial_dims, *args)


def random_cases():
    geometries = []
    for spatial_dims in (2, 3):
        for kernel_size, dilation in itertools.product((1, 3, 5, 7), (1, 2, 3)):
            geometries.append(("submanifold", spatial_dims, kernel_size, 1, dilation))
        for kernel_size, dilation in itertools.product((2, 4), (1, 2)):
            geometries.append(("submanifold", spatial_dims, kernel_size, 1, dilation))
        for kind in ("strided", "transposed", "generative"):
            for kernel_size, stride, dilation in itertools.product((2, 3), (2, 3), (1, 2)):
                geometries.append((kind, spatial_dims, kernel_size, stride, dilation))
    geometries += [
        ("submanifold", 2, (2, 5), 1, (3, 1)),
        ("submanifold", 3, (3, 1, 5), 1, (1, 2, 1)),
        ("submanifold", 3, (4, 3, 2), 1, (2, 1, 3)),
    ]
    for kind in ("strided", "transposed", "generative"):
        geometries += [
            (kind, 2, (3, 2), (3, 2), (2, 1)),
            (kind, 2, 4, 2, 1),
            (kind, 3, (2, 3, 1), (2, 1, 3), (1, 2, 1)),
        ]
    return [Case(*geometry, points=("random", seed)) for seed, geometry in enumerate(geometries)]


def tiny_cases():
    kinds = ("submanifold", "strided", "transposed", "generative")
    return [
        Case(kind, spatial_dims, 3, 1 if kind == "submanifold" else 2, 1, points=(points,))
        for kind, spatial_dims, points in itertools.product(kinds, (2, 3), ("empty", "single"))
    ]


def limit_cases():
    geometries = [
        ("submanifold", 3, 1, 1),
        ("submanifold", 3, 1, 3),
        ("submanifold", 4, 1, 2),
        ("strided", 3, 2, 2),
        ("strided", 3, 3, 2),
        ("transposed", 3, 2, 2),
        ("transposed", 3, 3, 2),
    ]
    return [
        Case(kind, spatial_dims, kernel_size, stride, dilation, points=("limits", axis))
        for kind, kernel_size, stride, dilation in geometries
        for spatial_dims in (2, 3)
        for axis in range(spatial_dims)
    ]


RANDOM_CASES = random_cases()
TINY_CASES = tiny_cases()
LIMIT_CASES = limit_cases()
SMALL_CASES = RANDOM_CASES + TINY_CASES + LIMIT_CASES


# --- the library's maps and the brute-force references --------------------------------------------


def library_map(case, coords):
    """(input coordinates, output coordinates, KernelMap) built by cupysparse from `coords`."""
    if case.kind == "submanifold":
        return coords, coords, submanifold_map(coords, case.kernel_size, case.dilation)
    if case.kind == "generative":
        out_coords, kernel_map = generative_map(coords, case.kernel_size, case.stride, case.dilation)
        return coords, out_coords, kernel_map
    coarse, strided = strided_map(coords, case.kernel_size, case.stride, case.dilation)
    if case.kind == "strided":
        return coords, coarse, strided
    return coarse, coords, transposed_map(strided)


def as_tuples(coords):
    return [tuple(row) for row in np.asarray(coords).tolist()]


def place(coord, offset, stride, dilation, coord_bits=None):
    """`coord·stride + dilation·offset`, batch kept; wrapped to `coord_bits`-bit fields if given."""
    values = [c * s + d * o for c, s, d, o in zip(coord[1:], stride, dilation, offset)]
    if coord_bits is not None:
        half = 1 << (coord_bits - 1)
        values = [(v + half) % (2 * half) - half for v in values]
    return (coord[0], *values)


def forward_table(in_coords, out_coords, geometry, coord_bits=None):
    """Pair (k, i, j) when in[j] == out[i]·stride + dilation·o_k, asked from every output row."""
    kernel_size, stride, dilation = geometry
    offsets = reference_offsets(kernel_size)
    rows = {coord: j for j, coord in enumerate(in_coords)}
    table = np.full((len(offsets), len(out_coords)), -1, dtype=np.int32)
    for i, coord in enumerate(out_coords):
        for k, offset in enumerate(offsets):
            table[k, i] = rows.get(place(coord, offset, stride, dilation, coord_bits), -1)
    return table


def backward_table(in_coords, out_coords, geometry, coord_bits=None):
    """Pair (k, i, j) when out[i] == in[j]·stride + dilation·o_k, enumerated from every input row."""
    kernel_size, stride, dilation = geometry
    offsets = reference_offsets(kernel_size)
    rows = {coord: i for i, coord in enumerate(out_coords)}
    table = np.full((len(offsets), len(out_coords)), -1, dtype=np.int32)
    for j, coord in enumerate(in_coords):
        for k, offset in enumerate(offsets):
            i = rows.get(place(coord, offset, stride, dilation, coord_bits))
            if i is not None:
                table[k, i] = j
    return table


def first_occurrences(coordinates):
    return list(dict.fromkeys(coordinates))  # dicts keep insertion order


def reference_map(case, coord_bits=None):
    """(input coordinates, output coordinates, pair table) of `case` by enumeration; output
    coordinates of strided/generative maps in order of first occurrence (input rows outer,
    offsets inner), as documented in `cupysparse.geometry.kernel_map`."""
    fine = as_tuples(case.coordinates())
    kernel_size, stride, dilation = geometry = case.geometry()
    if case.kind == "submanifold":
        unit = (kernel_size, (1,) * case.spatial_dims, dilation)
        return fine, fine, forward_table(fine, fine, unit, coord_bits)
    if case.kind == "generative":
        offsets = reference_offsets(kernel_size)
        generated = first_occurrences(place(coord, offset, stride, dilation) for coord in fine for offset in offsets)
        return fine, generated, backward_table(fine, generated, geometry, coord_bits)
    coarse = first_occurrences((coord[0], *(c // s for c, s in zip(coord[1:], stride))) for coord in fine)
    if case.kind == "strided":
        return fine, coarse, forward_table(fine, coarse, geometry, coord_bits)
    return coarse, fine, backward_table(coarse, fine, geometry, coord_bits)


@functools.cache
def cached_reference_map(case):
    return reference_map(case)


def reference_csr(table):
    """(in_idx, out_idx, offsets): the table's pairs offset by offset, by output row."""
    in_idx, out_idx, offsets = [], [], [0]
    for row in table.tolist():
        for out, inp in enumerate(row):
            if inp >= 0:
                in_idx.append(inp)
                out_idx.append(out)
        offsets.append(len(in_idx))
    return in_idx, out_idx, offsets


def reference_masks(table):
    """Per output row, the offsets that have an input as one Python integer (bit k = offset k)."""
    return [sum(1 << k for k, inp in enumerate(column) if inp >= 0) for column in table.T.tolist()]


def mask_words(masks, kernel_volume):
    num_words = -(-kernel_volume // 32)
    words = [[(mask >> (32 * w)) & 0xFFFFFFFF for w in range(num_words)] for mask in masks]
    return np.array(words, dtype=np.uint32).reshape(len(masks), num_words)


def stable_mask_order(masks):
    return sorted(range(len(masks)), key=masks.__getitem__)  # sorted() is stable


# --- CPU: maps equal brute force -----------------------------------------------------------------


def test_offset_axes_follow_the_documented_rule():
    for size, offsets in AXIS_OFFSETS.items():
        assert tuple(offset_range(size)) == offsets
    np.testing.assert_array_equal(kernel_offsets((2, 3, 4)), np.array(reference_offsets((2, 3, 4))))
    np.testing.assert_array_equal(kernel_offsets((2, 3))[:4], [[0, -1], [0, 0], [0, 1], [1, -1]])


@pytest.mark.parametrize("case", SMALL_CASES, ids=str)
def test_map_equals_brute_force(case):
    in_coords, out_coords, kernel_map = library_map(case, case.coordinates())
    ref_in, ref_out, ref_table = cached_reference_map(case)
    assert as_tuples(in_coords) == ref_in
    assert as_tuples(out_coords) == ref_out
    assert kernel_map.pair_table.dtype == np.int32
    np.testing.assert_array_equal(kernel_map.pair_table, ref_table)
    assert (kernel_map.num_in, kernel_map.num_out) == (len(ref_in), len(ref_out))
    assert (kernel_map.kernel_size, kernel_map.stride, kernel_map.dilation) == case.geometry()
    assert kernel_map.transposed == (case.kind in ("transposed", "generative"))
    assert kernel_map.generative == (case.kind == "generative")


@pytest.mark.parametrize("case", SMALL_CASES, ids=str)
def test_every_pair_satisfies_the_map_equation(case):
    in_coords, out_coords, kernel_map = library_map(case, case.coordinates())
    kernel_size, stride, dilation = case.geometry()
    table = kernel_map.pair_table
    assert table.shape == (len(reference_offsets(kernel_size)), len(out_coords))
    assert table.min(initial=-1) >= -1 and table.max(initial=-1) < len(in_coords)
    ks, outs = np.nonzero(table >= 0)
    ins = table[ks, outs]
    inp, out = in_coords[ins].astype(np.int64), out_coords[outs].astype(np.int64)
    step = np.array(reference_offsets(kernel_size), dtype=np.int64)[ks] * dilation
    np.testing.assert_array_equal(inp[:, 0], out[:, 0])
    if kernel_map.transposed:
        np.testing.assert_array_equal(out[:, 1:], inp[:, 1:] * stride + step)
    else:
        np.testing.assert_array_equal(inp[:, 1:], out[:, 1:] * stride + step)
    assert len(set(zip(outs.tolist(), ins.tolist()))) == len(ins), "an (out, in) pair appears under two offsets"


@pytest.mark.parametrize("case", LIMIT_CASES, ids=str)
def test_limit_coordinates_would_expose_a_wrapping_search(case):
    """The limit sets are only a test if wrapping at the field width would add pairs."""
    _, _, wrapped = reference_map(case, coord_bits=key_layout(case.spatial_dims).coord_bits)
    _, _, exact = cached_reference_map(case)
    assert (wrapped >= 0).sum() > (exact >= 0).sum()


# --- CPU: derived formats ------------------------------------------------------------------------


@pytest.mark.parametrize("case", SMALL_CASES, ids=str)
def test_csr_lists_table_pairs_by_offset_then_output_row(case):
    _, _, kernel_map = library_map(case, case.coordinates())
    in_idx, out_idx, offsets = reference_csr(cached_reference_map(case)[2])
    csr = kernel_map.csr()
    np.testing.assert_array_equal(csr.in_idx, np.array(in_idx, dtype=np.int64))
    np.testing.assert_array_equal(csr.out_idx, np.array(out_idx, dtype=np.int64))
    np.testing.assert_array_equal(csr.offsets, np.array(offsets, dtype=np.int64))
    assert kernel_map.num_pairs == offsets[-1]


@pytest.mark.parametrize("case", SMALL_CASES, ids=str)
def test_offset_mask_and_mask_sorted_order(case):
    _, _, kernel_map = library_map(case, case.coordinates())
    masks = reference_masks(cached_reference_map(case)[2])
    mask = kernel_map.offset_mask()
    assert mask.dtype == np.uint32
    np.testing.assert_array_equal(mask, mask_words(masks, kernel_map.kernel_volume), strict=True)
    np.testing.assert_array_equal(kernel_map.mask_sorted_order(), stable_mask_order(masks))


@pytest.mark.parametrize("case", SMALL_CASES[:4], ids=str)
def test_derive_formats_computes_every_format_of_the_map_and_its_reverse_up_front(case, monkeypatch):
    _, _, kernel_map = library_map(case, case.coordinates())
    assert kernel_map.derive_formats() is kernel_map

    def no_more_work(*args, **kwargs):
        raise AssertionError("a format was derived after derive_formats")

    for name in ("csr_pairs", "offset_mask", "mask_sorted_order", "invert_pair_table", "invert_pair_tables"):
        monkeypatch.setattr(kernel_map_module, name, no_more_work)
    reference_table = cached_reference_map(case)[2]
    np.testing.assert_array_equal(kernel_map.mask_sorted_order(), stable_mask_order(reference_masks(reference_table)))
    in_idx, out_idx, _ = reference_csr(reference_table)
    pairs = [(k, i, o) for k, ins, outs in kernel_map.offset_pairs() for i, o in zip(ins.tolist(), outs.tolist())]
    assert sorted((i, o) for _, i, o in pairs) == sorted(zip(in_idx, out_idx))
    reverse = kernel_map.reversed()
    reverse.offset_mask(), reverse.mask_sorted_order(), list(reverse.offset_pairs())


def test_a_derived_value_is_computed_once_per_key_and_map():
    """What a plan derives from a map is kept with that map, per key: another key, or another map (its
    reverse included), computes its own."""
    case = SMALL_CASES[0]
    _, _, kernel_map = library_map(case, case.coordinates())
    computed = []

    def rows(kind):
        def compute(derived_from):
            computed.append((kind, derived_from))
            return derived_from.num_out
        return compute

    assert kernel_map.derived("rows", rows("first")) == kernel_map.num_out
    assert kernel_map.derived("rows", rows("again")) == kernel_map.num_out
    assert kernel_map.derived(("rows", 2), rows("other key")) == kernel_map.num_out
    reverse = kernel_map.reversed()
    assert reverse.derived("rows", rows("reverse")) == reverse.num_out
    assert computed == [("first", kernel_map), ("other key", kernel_map), ("reverse", reverse)]


def test_mask_order_by_hand():
    """Offset 32 (word 1) outweighs offsets 0..31 (word 0); equal masks keep their row order."""
    present = np.zeros((33, 6), dtype=bool)
    present[32, [0, 4, 5]] = True
    present[:32, [1, 3]] = True
    present[0, 4] = True
    table = np.where(present, 7, -1).astype(np.int32)
    kernel_map = KernelMap(table, 8, (3, 11), (1, 1), (1, 1))
    expected = [[0, 1], [0xFFFFFFFF, 0], [0, 0], [0xFFFFFFFF, 0], [1, 1], [0, 1]]
    np.testing.assert_array_equal(kernel_map.offset_mask(), np.array(expected, dtype=np.uint32))
    np.testing.assert_array_equal(kernel_map.mask_sorted_order(), [2, 1, 3, 0, 5, 4])


def random_pair_table(kernel_volume, seed, num_out=120, num_patterns=6):
    """Rows drawn from a few presence patterns, so many masks tie."""
    rng = np.random.default_rng(seed)
    patterns = rng.random((kernel_volume, num_patterns)) < 0.5
    present = patterns[:, rng.integers(num_patterns, size=num_out)]
    return np.where(present, rng.integers(50, size=present.shape), -1).astype(np.int32)


WORD_BOUNDARY_VOLUMES = (1, 31, 32, 33, 63, 64, 65, 125, 343)


@pytest.mark.parametrize("kernel_volume", WORD_BOUNDARY_VOLUMES)
def test_formats_at_word_boundaries(kernel_volume):
    table = random_pair_table(kernel_volume, seed=kernel_volume)
    masks = reference_masks(table)
    kernel_map = KernelMap(table, 50, (kernel_volume, 1), (1, 1), (1, 1))
    np.testing.assert_array_equal(offset_mask(table), mask_words(masks, kernel_volume))
    np.testing.assert_array_equal(kernel_map.mask_sorted_order(), stable_mask_order(masks))
    in_idx, out_idx, offsets = reference_csr(table)
    csr = kernel_map.csr()
    np.testing.assert_array_equal(csr.in_idx, in_idx)
    np.testing.assert_array_equal(csr.out_idx, out_idx)
    np.testing.assert_array_equal(csr.offsets, offsets)


# --- GPU: the same maps from CuPy coordinates ----------------------------------------------------


def lexicographic_rank(coords):
    """Rank of each row among `coords` sorted by (batch, c1, …)."""
    order = np.lexsort(coords.T[::-1])
    rank = np.empty(len(coords), dtype=np.int64)
    rank[order] = np.arange(len(coords))
    return rank


def pair_set(in_coords, out_coords, table):
    """The (offset, input coordinate, output coordinate) triples as sorted codes: the pairs as a
    set, independent of the row order of either coordinate array."""
    ks, outs = np.nonzero(table >= 0)
    ins = table[ks, outs]
    codes = ks.astype(np.int64) * len(in_coords) + lexicographic_rank(in_coords)[ins]
    return np.sort(codes * len(out_coords) + lexicographic_rank(out_coords)[outs])


def sorted_rows(coords):
    return coords[np.lexsort(coords.T[::-1])]


def assert_gpu_map_equals_cpu(cpu, gpu):
    cpu_in, cpu_out, cpu_map = cpu
    gpu_in, gpu_out, gpu_map = gpu[0].get(), gpu[1].get(), gpu[2]
    gpu_table = gpu_map.pair_table.get()
    assert gpu_table.shape == cpu_map.pair_table.shape
    np.testing.assert_array_equal(sorted_rows(gpu_out), sorted_rows(cpu_out))
    np.testing.assert_array_equal(sorted_rows(gpu_in), sorted_rows(cpu_in))
    np.testing.assert_array_equal(
        pair_set(gpu_in, gpu_out, gpu_table), pair_set(cpu_in, cpu_out, cpu_map.pair_table)
    )
    np.testing.assert_array_equal(gpu_out, cpu_out)
    np.testing.assert_array_equal(gpu_in, cpu_in)
    np.testing.assert_array_equal(gpu_table, cpu_map.pair_table)
    assert (gpu_map.num_in, gpu_map.transposed, gpu_map.generative) == (
        cpu_map.num_in,
        cpu_map.transposed,
        cpu_map.generative,
    )
    assert_gpu_formats_equal_cpu(cpu_map, gpu_map)


def assert_gpu_formats_equal_cpu(cpu_map, gpu_map):
    gpu_csr, cpu_csr = gpu_map.csr(), cpu_map.csr()
    np.testing.assert_array_equal(gpu_csr.offsets.get(), cpu_csr.offsets)
    np.testing.assert_array_equal(gpu_csr.in_idx.get(), cpu_csr.in_idx)
    np.testing.assert_array_equal(gpu_csr.out_idx.get(), cpu_csr.out_idx)
    gpu_mask = gpu_map.offset_mask().get()
    assert gpu_mask.dtype == np.uint32
    np.testing.assert_array_equal(gpu_mask, cpu_map.offset_mask())
    np.testing.assert_array_equal(gpu_map.mask_sorted_order().get(), cpu_map.mask_sorted_order())


def large_cases():
    geometries = {
        47: [  # about 100K voxels
            ("submanifold", 3, 1, 1),
            ("submanifold", 5, 1, 1),
            ("submanifold", 3, 1, 2),
            ("strided", 2, 2, 1),
            ("strided", 3, 2, 1),
            ("transposed", 3, 2, 1),
            ("generative", 2, 2, 1),
            ("generative", 3, 2, 1),
        ],
        100: [  # about 1M voxels
            ("submanifold", 3, 1, 1),
            ("strided", 2, 2, 1),
            ("strided", 3, 2, 1),
            ("transposed", 3, 2, 1),
            ("generative", 2, 2, 1),
        ],
    }
    return [
        Case(kind, 3, kernel_size, stride, dilation, points=("blob", side, seed))
        for side, cases in geometries.items()
        for seed, (kind, kernel_size, stride, dilation) in enumerate(cases)
    ]


@pytest.mark.gpu
@pytest.mark.gpu
class TestGpuMapsEqualCpu:
    @pytest.mark.parametrize("case", SMALL_CASES, ids=str)
    def test_small_map(self, case):
        coords = case.coordinates()
        assert_gpu_map_equals_cpu(library_map(case, coords), library_map(case, cupy_module().asarray(coords)))

    @pytest.mark.parametrize("case", large_cases(), ids=str)
    def test_large_map(self, case):
        coords = case.coordinates()
        assert_gpu_map_equals_cpu(library_map(case, coords), library_map(case, cupy_module().asarray(coords)))

    @pytest.mark.parametrize("kernel_volume", WORD_BOUNDARY_VOLUMES)
    def test_formats_at_word_boundaries(self, kernel_volume):
        table = random_pair_table(kernel_volume, seed=kernel_volume)
        cpu_map = KernelMap(table, 50, (kernel_volume, 1), (1, 1), (1, 1))
        gpu_map = KernelMap(cupy_module().asarray(table), 50, (kernel_volume, 1), (1, 1), (1, 1))
        assert_gpu_formats_equal_cpu(cpu_map, gpu_map)


@pytest.mark.parametrize("stride", [1, 2])
def test_generative_map_refuses_coordinates_outside_the_key_range(stride):
    top = key_layout(3).coord_max
    coords = np.array([[0, top // stride + stride - 1, 0, 0]], np.int32)  # the +1 offset steps past the top
    with pytest.raises(ValueError, match="outside"):
        generative_map(coords, 3, stride)


@pytest.mark.parametrize("device", ON_DEVICES)
def test_unique_coordinates_keep_first_occurrence_order(device):
    rng = np.random.default_rng(7)
    coords = np.concatenate([rng.integers(0, 2, (5000, 1)), rng.integers(-4, 4, (5000, 3))], axis=1).astype(np.int32)
    unique = unique_coordinates(coords if device == "cpu" else cupy_module().asarray(coords))
    unique = unique if device == "cpu" else unique.get()
    assert as_tuples(unique) == first_occurrences(as_tuples(coords))


# More divisors than one launch takes (`MAX_JOBS`).
DIVISORS = [(2, 2, 2), (4, 4, 4), (1, 1, 3), (8, 4, 2)] + [(k, 1 + k % 3, 2) for k in range(1, MAX_JOBS - 1)]


@pytest.mark.parametrize("device", ON_DEVICES)
@pytest.mark.parametrize("counted_together", [len(DIVISORS), 2], ids=["one count", "counts of two"])
def test_unique_coordinates_by_several_divisors_keep_first_occurrence_order(device, counted_together, monkeypatch):
    """Every divisor's rows in order of first occurrence; on the GPU from one running count over all of their
    marks, or from several where that count would leave int32 (here made to, past two divisors' rows)."""
    rng = np.random.default_rng(11)
    coords = np.concatenate([rng.integers(0, 3, (6000, 1)), rng.integers(-20, 20, (6000, 3))], axis=1).astype(np.int32)
    monkeypatch.setattr(hashing, "MAX_ROWS", counted_together * len(coords))
    uniques = unique_coordinates_by(coords if device == "cpu" else cupy_module().asarray(coords), DIVISORS)
    assert len(uniques) == len(DIVISORS)
    for divisor, unique in zip(DIVISORS, uniques):
        divided = [(row[0], *(c // d for c, d in zip(row[1:], divisor))) for row in as_tuples(coords)]
        assert as_tuples(unique if device == "cpu" else unique.get()) == first_occurrences(divided)


@pytest.mark.parametrize("device", ON_DEVICES)
def test_downsampling_every_level_up_front_gives_the_maps_of_level_by_level(device):
    """`downsample_to` computes the coarse levels from the input in one pass; the strided maps and
    coordinates then equal those of a cache that reaches each level from the one before it."""
    rng = np.random.default_rng(5)
    coords = np.concatenate([rng.integers(0, 2, (4000, 1)), rng.integers(-30, 30, (4000, 3))], axis=1).astype(np.int32)
    coords = np.unique(coords, axis=0)[rng.permutation(len(np.unique(coords, axis=0)))]
    if device == "cuda":
        coords = cupy_module().asarray(coords)
    stepwise, up_front = KernelMapCache(coords, (1, 1, 1)), KernelMapCache(coords, (1, 1, 1))
    up_front.downsample_to([(4, 4, 4), (2, 2, 2), (8, 8, 8), (2, 2, 2)])
    host = (lambda array: array) if device == "cpu" else (lambda array: array.get())
    for level in (1, 2, 4):
        step, ahead = (cache.kernel_map((level,) * 3, 2, 2) for cache in (stepwise, up_front))
        np.testing.assert_array_equal(host(ahead.out_coordinates), host(step.out_coordinates))
        np.testing.assert_array_equal(host(ahead.kernel_map.pair_table), host(step.kernel_map.pair_table))
    coarsest = host(up_front.coordinates((8, 8, 8)))
    assert as_tuples(coarsest) == first_occurrences(
        [(row[0], *(c // 8 for c in row[1:])) for row in as_tuples(host(coords))]
    )


# A U-Net's maps: submanifold, strided, 1 x 1, transposed and dilated, over three levels.
UNET_REQUESTS = [MapRequest((1, 1, 1), 3), MapRequest((1, 1, 1), 2, 2), MapRequest((2, 2, 2), (3, 3, 3)),
                 MapRequest((2, 2, 2), 3, 2), MapRequest((4, 4, 4), 1), MapRequest((4, 4, 4), 3, 2, transposed=True),
                 MapRequest((2, 2, 2), 2, 2, transposed=True), MapRequest((1, 1, 1), 5, dilation=2)]


@pytest.mark.parametrize("device", ON_DEVICES)
@pytest.mark.parametrize("with_reversed", [False, True])
def test_maps_built_up_front_equal_those_built_layer_by_layer(device, with_reversed):
    """`build_maps` with a U-Net's requests gives the maps, coordinates and mask-sorted orders (on the GPU, from
    one sort) that a cache building each map as its layer meets it gives; `with_reversed`, those of the reversed
    maps too, except a mirror-symmetric map's, whose own table the GPU's dgrad reads, and the CSR pair lists (on
    the GPU, counted together)."""
    rng = np.random.default_rng(6)
    coords = np.concatenate([rng.integers(0, 2, (5000, 1)), rng.integers(-25, 25, (5000, 3))], axis=1).astype(np.int32)
    coords = np.unique(coords, axis=0)[rng.permutation(len(np.unique(coords, axis=0)))]
    if device == "cuda":
        coords = cupy_module().asarray(coords)
    requests = UNET_REQUESTS
    lazy, up_front = KernelMapCache(coords, (1, 1, 1)), KernelMapCache(coords, (1, 1, 1))
    built = up_front.build_maps(requests, with_reversed=with_reversed)
    host = (lambda array: array) if device == "cpu" else (lambda array: array.get())
    assert len(built) == len(requests)
    counted_together = set()
    for request, result in zip(requests, built):
        expected = lazy.kernel_map(*request.arguments())
        assert up_front.kernel_map(*request.arguments()) is result
        np.testing.assert_array_equal(host(result.out_coordinates), host(expected.out_coordinates))
        assert result.out_tensor_stride == expected.out_tensor_stride
        maps = [(result.kernel_map, expected.kernel_map)]
        if with_reversed and result.kernel_map.mirror_symmetric:
            assert "_reversed" not in result.kernel_map.__dict__
        elif with_reversed:
            maps.append((result.kernel_map.reversed(), expected.kernel_map.reversed()))
        for ahead, step in maps:
            np.testing.assert_array_equal(host(ahead.pair_table), host(step.pair_table))
            if device == "cuda":
                assert "_mask_sorted_order" in ahead.__dict__  # computed by the one sort, not on demand
            np.testing.assert_array_equal(host(ahead.mask_sorted_order()), host(step.mask_sorted_order()))
        if with_reversed and device == "cuda" and result.kernel_map.kernel_volume > 1:
            # Counted together with the other maps' (`derive_pair_counts`): their lists are filled together too.
            counted_together.add(id(result.kernel_map.__dict__["_pair_counts"].together))
        if with_reversed:
            for name in ("in_idx", "out_idx", "offsets"):
                np.testing.assert_array_equal(host(getattr(result.kernel_map.csr(), name)),
                                              host(getattr(expected.kernel_map.csr(), name)))
    assert len(counted_together) == (1 if with_reversed and device == "cuda" else 0)


@pytest.mark.parametrize("device", ON_DEVICES)
@pytest.mark.parametrize("with_reversed", [False, True])
def test_maps_started_are_built_in_two_steps_and_equal_those_built_at_once(device, with_reversed):
    """`start_maps` builds the input's submanifold and 1 x 1 maps now, with their orders, and on the GPU leaves
    the rest under way until a layer asks for a map it lacks: then every map is built, the same as
    `build_maps`'. On the CPU the levels are known at once, and so is everything else."""
    rng = np.random.default_rng(7)
    coords = np.unique(np.concatenate([rng.integers(0, 2, (5000, 1)), rng.integers(-25, 25, (5000, 3))], axis=1)
                       .astype(np.int32), axis=0)
    coords = on_device(coords[rng.permutation(len(coords))], device)
    at_once, started = KernelMapCache(coords, (1, 1, 1)), KernelMapCache(coords, (1, 1, 1))
    expected = at_once.build_maps(UNET_REQUESTS, with_reversed=with_reversed)
    underway = started.start_maps(UNET_REQUESTS, with_reversed=with_reversed)
    submanifold = started.lookup((1, 1, 1), 3)
    assert submanifold is not None and started.lookup((1, 1, 1), 5, dilation=2) is not None
    if device == "cuda":
        assert started._underway is underway
        assert "_mask_sorted_order" in submanifold.kernel_map.__dict__
        assert started.lookup((1, 1, 1), 2, 2) is None  # its level's count is still on its way
        first_strided = started.kernel_map((1, 1, 1), 2, 2)  # a layer asks: the rest is built
        assert started._underway is None and first_strided is underway.results()[1]
    assert started._underway is None
    for request, result, reference in zip(UNET_REQUESTS, underway.results(), expected):
        assert started.kernel_map(*request.arguments()) is result
        np.testing.assert_array_equal(to_host(result.out_coordinates), to_host(reference.out_coordinates))
        for built, wanted in [(result.kernel_map, reference.kernel_map)] + (
                [(result.kernel_map.reversed(), reference.kernel_map.reversed())] if with_reversed else []):
            np.testing.assert_array_equal(to_host(built.pair_table), to_host(wanted.pair_table))
            np.testing.assert_array_equal(to_host(built.mask_sorted_order()), to_host(wanted.mask_sorted_order()))


@pytest.mark.gpu
def test_a_level_asked_for_finishes_the_maps_under_way_and_a_cache_gone_has_none_to_finish():
    coords = on_device(np.array([[0, 0, 0, 0], [0, 1, 0, 0], [0, 4, 4, 4], [1, 2, 3, 5]], np.int32), "cuda")
    cache = KernelMapCache(coords, (1, 1, 1))
    underway = cache.start_maps(UNET_REQUESTS)
    np.testing.assert_array_equal(to_host(cache.coordinates((2, 2, 2))),
                                  [[0, 0, 0, 0], [0, 2, 2, 2], [1, 1, 1, 2]])
    assert cache._underway is None and len(underway.results()) == len(UNET_REQUESTS)
    gone = KernelMapCache(coords, (1, 1, 1)).start_maps(UNET_REQUESTS)
    with pytest.raises(RuntimeError, match="map cache of this build is gone"):
        gone.results()


@pytest.mark.parametrize("device", ON_DEVICES)
def test_maps_of_the_caches_padded_convolutions_start_are_built_up_front_too(device):
    """Requests past a padded convolution run in the cache its output starts (`MapRequest.cache`), and its
    inverse's in the cache of its input: `build_maps` gives the maps a layer-by-layer walk through those caches
    gives, each in its own cache."""
    rng = np.random.default_rng(8)
    coords = np.unique(np.concatenate([rng.integers(0, 2, (4000, 1)), rng.integers(0, 30, (4000, 3))], axis=1)
                       .astype(np.int32), axis=0)
    coords = on_device(coords[rng.permutation(len(coords))], device)
    one, two, four = (1, 1, 1), (2, 2, 2), (4, 4, 4)
    requests = [MapRequest(one, 3), MapRequest(one, 3, 2, padding=1), MapRequest(two, 3, cache=1),
                MapRequest(two, 3, 2, padding=1, cache=1), MapRequest(four, 3, cache=2), MapRequest(four, 1, cache=2),
                MapRequest(four, 3, 2, transposed=True, padding=1, cache=2), MapRequest(two, (1, 1, 3), cache=1)]
    shape = (30, 30, 30)
    lazy, up_front = (KernelMapCache(coords, one, spatial_shape=shape) for _ in range(2))
    built = up_front.build_maps(requests, with_reversed=True)
    caches = [lazy]
    for request, result in zip(requests, built):
        expected = caches[request.cache].kernel_map(*request.arguments())
        if request.padding is not None and not request.transposed:
            caches.append(expected.out_map_cache)
        np.testing.assert_array_equal(to_host(result.out_coordinates), to_host(expected.out_coordinates))
        np.testing.assert_array_equal(to_host(result.kernel_map.pair_table), to_host(expected.kernel_map.pair_table))
        assert result.out_tensor_stride == expected.out_tensor_stride
    assert built[6].out_map_cache is built[1].out_map_cache  # the inverse returns to its input's cache
    assert [len(cache) for cache in (up_front, built[1].out_map_cache, built[3].out_map_cache)] == [2, 3, 3]
    with pytest.raises(ValueError, match="runs in map cache 2, but the requests before it made 0 new ones"):
        KernelMapCache(coords, one).build_maps([MapRequest(one, 3, cache=2)])


def test_a_request_equal_to_one_built_before_but_of_other_types_meets_the_checks_itself():
    """A build checks each request once and remembers it for the next build that hands it the very same
    request, as a network does every step: an equal request of a bool (True == 1), or a float (3.0 == 3), is
    refused as the first would have been, even after the int one was built."""
    coords = np.array([[0, 0, 0, 0], [0, 1, 0, 0], [0, 2, 2, 2]], np.int32)
    checked = [MapRequest((1, 1, 1), 3), MapRequest((1, 1, 1), 2, 2)]
    for _ in range(2):
        KernelMapCache(coords, (1, 1, 1)).build_maps(checked)
    with pytest.raises(TypeError, match="stride must be an int or 3 ints, got .*bool"):
        KernelMapCache(coords, (1, 1, 1)).build_maps([MapRequest((1, 1, 1), 3, (True, 1, 1))])
    with pytest.raises(TypeError, match="kernel_size must be an int or 3 ints, got 3.0"):
        KernelMapCache(coords, (1, 1, 1)).build_maps([MapRequest((1, 1, 1), 3.0)])


def test_downsample_to_refuses_strides_that_are_not_multiples_of_the_input():
    cache = KernelMapCache(np.zeros((1, 4), np.int32), (2, 2, 2))
    with pytest.raises(ValueError, match="positive multiple"):
        cache.downsample_to([(4, 4, 3)])
    with pytest.raises(ValueError, match="tensor_stride must be an int or 3 ints"):
        cache.downsample_to([(4, 4)])


@pytest.mark.parametrize("case", SMALL_CASES, ids=str)
def test_reversed_map_indexes_the_same_pairs_by_input_row(case):
    """Checked against the brute-force table, whichever way the library reverses it (offsets
    flipped for submanifold maps, the strided map for a transposed one, a scatter otherwise)."""
    in_coords, _, kernel_map = library_map(case, case.coordinates())
    reference_table = np.asarray(cached_reference_map(case)[2])
    expected = np.full((reference_table.shape[0], len(in_coords)), -1, dtype=np.int64)
    offsets, outputs = np.nonzero(reference_table >= 0)
    expected[offsets, reference_table[offsets, outputs]] = outputs
    reverse = kernel_map.reversed()
    np.testing.assert_array_equal(reverse.pair_table, expected)
    assert reverse.pair_table.flags.c_contiguous
    assert reverse.reversed() is kernel_map


@pytest.mark.gpu
def test_indices_and_queries_batched_on_the_gpu_equal_the_cpus_sorted_keys():
    """`build_indices` and `hashing.pair_tables` over more coordinate sets and queries than one launch takes
    (`MAX_JOBS`), an empty set among them: every GPU table and mask equals the CPU's sorted-key answer."""
    rng = np.random.default_rng(12)
    coords = np.unique(np.concatenate([rng.integers(0, 2, (3000, 1)), rng.integers(-40, 40, (3000, 3))], axis=1)
                       .astype(np.int32), axis=0)
    levels = unique_coordinates_by(coords, [(2 ** level,) * 3 for level in range(MAX_JOBS + 2)])
    levels.insert(3, coords[:0])
    queries = []
    for level, (fine, coarse) in enumerate(zip(levels, levels[1:])):
        if level % 3 == 0:
            queries.append((level, fine, hashing.Query((3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1)), True))
        elif level % 3 == 1:
            queries.append((level, coarse, hashing.Query((2, 2, 2), (1, 1, 1), (2, 2, 2), (1, 1, 1)), False))
        else:
            queries.append((level, fine, hashing.Query((1, 1, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1)), False))
    answers = {}
    for backend in ("cpu", "cuda"):
        indices = hashing.build_indices([on_device(level, backend) for level in levels])
        answers[backend] = hashing.pair_tables([(indices[level], on_device(out, backend), query, same)
                                                for level, out, query, same in queries])
    for (table, _), (gpu_table, gpu_mask) in zip(answers["cpu"], answers["cuda"]):
        np.testing.assert_array_equal(gpu_table.get(), table, strict=True)
        np.testing.assert_array_equal(gpu_mask.get(), offset_mask(table), strict=True)


def on_device(array, device):
    return array if device == "cpu" else cupy_module().asarray(array)


def to_host(array):
    return array if isinstance(array, np.ndarray) else array.get()


# --- limits: int32 row indices and geometry -------------------------------------------------------


def rows_of_zeros(num_rows, columns=4):
    """`[num_rows, columns]` int32 zeros without the memory (a broadcast view): only shapes are read."""
    return np.broadcast_to(np.zeros((1, columns), np.int32), (num_rows, columns))


def test_more_rows_than_int32_indices_address_are_refused_before_any_work():
    too_many = rows_of_zeros(MAX_ROWS + 1)
    with pytest.raises(ValueError, match=f"indexed coordinates has {MAX_ROWS + 1} rows"):
        submanifold_map(too_many, 3)
    with pytest.raises(ValueError, match="coordinates to deduplicate"):
        strided_map(too_many, 2, 2)
    with pytest.raises(ValueError, match="output coordinates"):
        strided_map(single_coords(3), 2, 2, out_coords=too_many)
    with pytest.raises(ValueError, match="kernel map's output"):
        KernelMap(np.broadcast_to(np.int32(-1), (1, MAX_ROWS + 1)), 1, (1, 1, 1), (1, 1, 1), (1, 1, 1))
    with pytest.raises(ValueError, match="kernel map's input"):
        KernelMap(np.full((1, 1), -1, np.int32), MAX_ROWS + 1, (1, 1, 1), (1, 1, 1), (1, 1, 1))


def test_generative_candidates_beyond_int32_rows_are_refused_before_any_work():
    """27 offsets per input row: the candidates pass the limit long before the inputs do."""
    num_in = MAX_ROWS // 27 + 1
    with pytest.raises(ValueError, match=f"{num_in} input rows x 27 offsets"):
        generative_map(rows_of_zeros(num_in), 3, 2)
    generative_map(single_coords(3), 3, 2)  # far below the limit: built


@pytest.mark.parametrize("device", ON_DEVICES)
def test_dilations_past_2_30_do_not_wrap_into_false_pairs(device):
    """Offset ±2 times the largest int32 dilation, wrapped to 32 bits, would be ∓2: voxels 2 apart
    would pair. The true candidates lie far outside the key range, so only the centre pairs."""
    coords = np.array([[0, 0, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]], np.int32)
    kernel_map = submanifold_map(on_device(coords, device), (5, 1, 1), dilation=(2**31 - 1, 1, 1))
    expected = np.full((5, 3), -1, np.int32)
    expected[2] = [0, 1, 2]
    np.testing.assert_array_equal(to_host(kernel_map.pair_table), expected)


@pytest.mark.parametrize("argument", ["kernel_size", "stride", "dilation"])
def test_geometry_past_int32_is_refused_naming_the_argument(argument):
    geometry = {"kernel_size": 3, "stride": 2, "dilation": 1, argument: (1, 1, 2**31)}
    with pytest.raises(ValueError, match=f"{argument} must be at most {2**31 - 1}"):
        KernelMapCache(single_coords(3), (1, 1, 1)).kernel_map((1, 1, 1), **geometry)
