"""A kernel map's derived formats (CSR pair lists, offset masks and their sorted row order, the inverse
table) against NumPy references, on the CPU and the GPU, from synthetic tables and masks."""

from __future__ import annotations

import numpy as np
import pytest

from cupysparse.cuda.backend import cupy_module
from cupysparse.cuda.compile import MAX_JOBS
from cupysparse.geometry import kernel_map as kernel_map_module
from cupysparse.geometry.kernel_map import submanifold_map
from cupysparse.geometry.map_formats import mask_sorted_orders

ON_DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.gpu),
]


# --- derived formats of synthetic masks and tables, against NumPy references (CPU and GPU) --------
# Sizes around the GPU kernels' block, tile and chunk sizes; kernel volumes of one to four words'
# worth of 8-bit radix digits.

FORMAT_SIZES = (1, 2, 255, 256, 257, 4097, 100003)
FORMAT_VOLUMES = (8, 27, 125)


def on_device(array, device):
    return array if device == "cpu" else cupy_module().asarray(array)


def to_host(array):
    return array if isinstance(array, np.ndarray) else array.get()


def pack_masks(present):
    """`[N, K]` booleans → uint32 `[N, ceil(K/32)]` masks, bit k % 32 of word k // 32 for offset k."""
    num_rows, kernel_volume = present.shape
    num_words = -(-kernel_volume // 32)
    padded = np.zeros((num_rows, num_words * 32), dtype=np.uint64)
    padded[:, :kernel_volume] = present
    return (padded.reshape(num_rows, num_words, 32) << np.arange(32, dtype=np.uint64)).sum(axis=2).astype(np.uint32)


def few_masks(num_rows, kernel_volume, seed, num_patterns=5):
    """Masks drawn from a few patterns (the empty and the full one among them): most rows tie."""
    rng = np.random.default_rng(seed)
    patterns = rng.random((num_patterns, kernel_volume)) < 0.5
    patterns[0], patterns[1] = False, True
    return pack_masks(patterns[rng.integers(num_patterns, size=num_rows)])


def assert_mask_order(mask, kernel_volume, device):
    expected = np.lexsort(mask.T)  # stable; the last key (the highest word) is the primary one
    for volume in (kernel_volume, None):
        order = kernel_map_module.mask_sorted_order(on_device(mask, device), volume)
        assert order.dtype == np.int32 and order.shape == (len(mask),)
        np.testing.assert_array_equal(to_host(order), expected)


@pytest.mark.parametrize("device", ON_DEVICES)
@pytest.mark.parametrize("num_rows", FORMAT_SIZES)
@pytest.mark.parametrize("kernel_volume", FORMAT_VOLUMES)
def test_mask_sorted_order_keeps_tied_rows_in_order(kernel_volume, num_rows, device):
    assert_mask_order(few_masks(num_rows, kernel_volume, seed=num_rows + kernel_volume), kernel_volume, device)


@pytest.mark.parametrize("device", ON_DEVICES)
@pytest.mark.parametrize("num_rows", (257, 4097, 100003))
@pytest.mark.parametrize("kernel_volume", (8, 27, 32, 33, 125))
def test_mask_sorted_order_of_random_masks(kernel_volume, num_rows, device):
    """Every bit below K random: every digit value occurs in every pass."""
    present = np.random.default_rng(kernel_volume).random((num_rows, kernel_volume)) < 0.5
    assert_mask_order(pack_masks(present), kernel_volume, device)


@pytest.mark.parametrize("device", ON_DEVICES)
def test_mask_sorted_orders_of_many_maps_are_each_maps_own(device):
    """Sorted together, each map's order is the one it gets alone: a network's worth of masks and more (40 of
    27 offsets, more than one sort takes), of 8 offsets, of one, multi-word ones and empty ones sorted alone."""
    rng = np.random.default_rng(3)
    volumes = [27] * 40 + [8, 1, 125, 27, 8]
    sizes = [int(rng.integers(1, 3000)) for _ in volumes]
    sizes[-2:] = (0, 0)
    masks = [pack_masks(rng.random((size, volume)) < rng.random()) if i % 3 else few_masks(size, volume, seed=i)
             for i, (size, volume) in enumerate(zip(sizes, volumes))]
    orders = mask_sorted_orders([on_device(mask, device) for mask in masks], volumes)
    assert len(orders) == len(masks)
    for mask, order in zip(masks, orders):
        assert order.dtype == np.int32 and order.shape == (len(mask),)
        np.testing.assert_array_equal(to_host(order), np.lexsort(mask.T))


@pytest.mark.parametrize("device", ON_DEVICES)
def test_a_map_sorted_beside_others_has_its_own_order(device):
    """The segment kernels see maps of different sizes in any order, among them one of a single row."""
    masks = [few_masks(num_rows, 27, seed=num_rows) for num_rows in (1, 4097, 256, 257, 2)]
    orders = mask_sorted_orders([on_device(mask, device) for mask in masks], [27] * len(masks))
    for mask, order in zip(masks, orders):
        np.testing.assert_array_equal(to_host(order), np.lexsort(mask.T))


def pair_table_with_every_density(kernel_volume, num_out, num_in, seed):
    """`[K, num_out]`: offsets with no pair, with a pair for every row, and in between, each
    input row at most once per offset (as in every map)."""
    rng = np.random.default_rng(seed)
    table = np.full((kernel_volume, num_out), -1, dtype=np.int32)
    for k in range(kernel_volume):
        density = (0.0, 1.0, 0.3, 0.97)[k % 4]
        rows = np.flatnonzero(rng.random(num_out) < density)
        table[k, rows] = rng.permutation(num_in)[: len(rows)]
    return table


@pytest.mark.parametrize("device", ON_DEVICES)
@pytest.mark.parametrize("num_out", FORMAT_SIZES)
@pytest.mark.parametrize("kernel_volume", FORMAT_VOLUMES)
def test_csr_pairs_and_inverse_of_offsets_with_no_some_and_all_pairs(kernel_volume, num_out, device):
    num_in = num_out + 3
    table = pair_table_with_every_density(kernel_volume, num_out, num_in, seed=num_out + kernel_volume)
    in_idx, out_idx, offsets = [], [], [0]
    inverse = np.full((kernel_volume, num_in), -1, dtype=np.int32)
    for k in range(kernel_volume):
        rows = np.flatnonzero(table[k] >= 0)
        in_idx.append(table[k, rows])
        out_idx.append(rows)
        offsets.append(offsets[-1] + len(rows))
        inverse[k, table[k, rows]] = rows

    csr = kernel_map_module.csr_pairs(on_device(table, device))
    assert (csr.in_idx.dtype, csr.out_idx.dtype, csr.offsets.dtype) == (np.int32, np.int32, np.int64)
    np.testing.assert_array_equal(to_host(csr.offsets), offsets)
    np.testing.assert_array_equal(to_host(csr.in_idx), np.concatenate(in_idx))
    np.testing.assert_array_equal(to_host(csr.out_idx), np.concatenate(out_idx))
    inverted = kernel_map_module.invert_pair_table(on_device(table, device), num_in)
    assert inverted.dtype == np.int32
    np.testing.assert_array_equal(to_host(inverted), inverse, strict=True)


@pytest.mark.parametrize("device", ON_DEVICES)
def test_formats_of_empty_tables_and_masks(device):
    for kernel_volume, num_out in ((0, 5), (27, 0), (0, 0)):
        table = on_device(np.full((kernel_volume, num_out), -1, dtype=np.int32), device)
        csr = kernel_map_module.csr_pairs(table)
        assert (csr.in_idx.dtype, csr.out_idx.dtype, csr.offsets.dtype) == (np.int32, np.int32, np.int64)
        assert csr.in_idx.shape == csr.out_idx.shape == (0,)
        np.testing.assert_array_equal(to_host(csr.offsets), np.zeros(kernel_volume + 1))
        inverse = to_host(kernel_map_module.invert_pair_table(table, 4))
        np.testing.assert_array_equal(inverse, np.full((kernel_volume, 4), -1, dtype=np.int32), strict=True)
    for mask, kernel_volume in ((np.zeros((0, 1), np.uint32), 27), (np.zeros((0, 4), np.uint32), 125),
                                (np.zeros((6, 1), np.uint32), 0)):
        order = kernel_map_module.mask_sorted_order(on_device(mask, device), kernel_volume)
        assert order.dtype == np.int32
        np.testing.assert_array_equal(to_host(order), np.arange(len(mask)))
    no_pairs = on_device(np.full((27, 300), -1, dtype=np.int32), device)
    assert to_host(kernel_map_module.csr_pairs(no_pairs).offsets).tolist() == [0] * 28


@pytest.mark.parametrize("device", ON_DEVICES)
def test_a_pointwise_maps_pair_lists_are_its_rows_without_counting(device, monkeypatch):
    """A 1^D submanifold map knows its pair lists from its construction: the ones the generic
    derivation gives, with no count (on the GPU, a count waits for the device)."""
    coords = on_device(np.unique(np.random.default_rng(11).integers(-6, 6, (300, 4)) * [0, 1, 1, 1], axis=0).astype(np.int32), device)
    kernel_map = submanifold_map(coords, 1)
    expected = kernel_map_module.csr_pairs(kernel_map.pair_table)
    monkeypatch.setattr(kernel_map_module, "count_pairs", lambda *arguments: pytest.fail("counted"))
    monkeypatch.setattr(kernel_map_module, "csr_pairs", lambda *arguments: pytest.fail("derived"))
    kernel_map.count_pairs_ahead()
    csr = kernel_map.csr()
    for name in ("in_idx", "out_idx", "offsets"):
        np.testing.assert_array_equal(to_host(getattr(csr, name)), to_host(getattr(expected, name)))
    assert to_host(csr.offsets).dtype == to_host(expected.offsets).dtype


@pytest.mark.parametrize("device", ON_DEVICES)
def test_tables_inverted_together_equal_each_inverted_by_brute_force(device):
    """`invert_pair_tables` over more tables than one launch takes (`MAX_JOBS`), of every size, an empty one
    among them: each inverse is the brute-force inverse of its table, in one allocation on the GPU."""
    rng = np.random.default_rng(3)
    sizes = [(int(rng.integers(1, 28)), int(rng.integers(0, 400))) for _ in range(MAX_JOBS + 3)]
    cases = [(volume, num_out, num_out + int(rng.integers(1, 100))) for volume, num_out in sizes]  # inputs >= outputs
    cases[2] = (27, 0, 50)
    tables = [pair_table_with_every_density(volume, num_out, num_in, seed=i) for i, (volume, num_out, num_in)
              in enumerate(cases)]
    inverses = kernel_map_module.invert_pair_tables([(on_device(table, device), num_in)
                                                     for table, (_, _, num_in) in zip(tables, cases)])
    for table, (volume, num_out, num_in), inverse in zip(tables, cases, inverses):
        expected = np.full((volume, num_in), -1, dtype=np.int32)
        for k, row in zip(*np.nonzero(table >= 0)):
            expected[k, table[k, row]] = row
        np.testing.assert_array_equal(to_host(inverse), expected, strict=True)


@pytest.mark.gpu
def test_tables_counted_together_give_each_its_own_pair_lists_filled_in_one_go(monkeypatch):
    """`count_pairs_of` more tables than one launch takes (`MAX_JOBS`), of several kernel volumes and sizes (over
    several chunks of rows), an empty one, one without offsets and one without pairs among them: each table's CSR
    lists are the NumPy reference's; the first asked for fills every table's, after which none waits again."""
    rng = np.random.default_rng(5)
    cases = [(int(rng.choice([1, 8, 27, 125])), int(rng.integers(0, 9000))) for _ in range(MAX_JOBS + 4)]
    cases[1], cases[3] = (27, 0), (0, 40)
    tables = [pair_table_with_every_density(volume, num_out, num_out + 7, seed=i)
              for i, (volume, num_out) in enumerate(cases)]
    tables[6][:] = -1
    counts = kernel_map_module.count_pairs_of([on_device(table, "cuda") for table in tables])
    assert len({id(counted.together) for counted in counts}) == 1
    gpu_lists = [kernel_map_module.csr_pairs(on_device(table, "cuda"), counted) for table, counted in zip(tables, counts)]
    monkeypatch.setattr(counts[0].together, "copied", None)  # waiting again would raise
    assert kernel_map_module.csr_pairs(on_device(tables[0], "cuda"), counts[0]).in_idx is gpu_lists[0].in_idx
    for table, csr in zip(tables, gpu_lists):
        expected = kernel_map_module.csr_pairs(table)
        for name in ("in_idx", "out_idx", "offsets"):
            np.testing.assert_array_equal(to_host(getattr(csr, name)), getattr(expected, name), strict=True)


@pytest.mark.parametrize("device", ON_DEVICES)
def test_identity_maps_made_together_are_each_their_rows(device):
    """`identity_pairs_of` more maps than one launch takes (`MAX_JOBS`), an empty one among them: each map's
    pair lists are its rows 0..N-1 and its bounds {0, N}."""
    row_counts = [int(count) for count in np.random.default_rng(4).integers(1, 5000, MAX_JOBS + 2)]
    row_counts[5] = 0
    pairs = kernel_map_module.identity_pairs_of(row_counts, on_device(np.zeros((1, 4), np.int32), device))
    for num_rows, csr in zip(row_counts, pairs):
        np.testing.assert_array_equal(to_host(csr.in_idx), np.arange(num_rows, dtype=np.int32), strict=True)
        np.testing.assert_array_equal(to_host(csr.out_idx), np.arange(num_rows, dtype=np.int32), strict=True)
        np.testing.assert_array_equal(to_host(csr.offsets), np.array([0, num_rows], dtype=np.int64), strict=True)
