"""The split-K wgrad blocks' shares of the per-offset pair lists (`kernel_map.wgrad_shares`): the NumPy
table against the properties the kernels rely on (every share once, its slot, shares in proportion to
the pairs, the order), and on the GPU (`pytest -m gpu`) the device table against the NumPy one."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from cupysparse.cuda.backend import cupy_module
from cupysparse.geometry.kernel_map import wgrad_shares
from cupysparse.geometry.map_formats import wgrad_shares_of

# (pairs per offset, rounds): a submanifold 3^3 layer's skew, empty offsets, a single offset, tiny lists.
CASES = [
    ([64, 612, 64, 258, 810, 257, 64, 612, 63, 222, 774, 222, 431, 991, 431, 222, 774, 222, 63, 612, 64, 257, 810,
      258, 64, 612, 64], rounds)
    for rounds in (1, 2, 7, 40)
] + [
    ([0, 5000, 0, 0, 17, 1, 0, 9000], 5),
    ([0, 0, 0], 3),
    ([123_456], 9),
    ([1] * 27, 4),
    ([3, 0, 2_000_000, 40], 2427),
]


def _offsets(pairs) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(pairs)]).astype(np.int64)


@pytest.mark.parametrize("pairs, rounds", CASES)
def test_every_share_of_every_offset_has_one_block_and_its_own_slot(pairs, rounds):
    kernel_volume = len(pairs)
    for round_major in (False, True):
        shares = wgrad_shares(_offsets(pairs), rounds, round_major)
        table, starts = shares.table, shares.slot_starts
        assert table.shape == (kernel_volume * rounds, 4) and starts.shape == (kernel_volume + 1,)
        assert starts[0] == 0 and np.all(np.diff(starts) >= 0)
        used = int(starts[-1])
        assert used <= kernel_volume * rounds
        assert np.all(table[used:, 0] == -1)
        blocks = table[:used]
        expected = {(k, s) for k in range(kernel_volume) for s in range(starts[k + 1] - starts[k])}
        assert {(int(k), int(s)) for k, s in blocks[:, :2]} == expected and len(expected) == used
        for k, s, count, slot in blocks:
            assert count == starts[k + 1] - starts[k] and slot == starts[k] + s
        if not round_major:
            assert np.array_equal(blocks[:, 3], np.arange(used))


@pytest.mark.parametrize("pairs, rounds", CASES)
def test_offsets_get_shares_in_proportion_to_their_pairs(pairs, rounds):
    kernel_volume, total = len(pairs), sum(pairs)
    starts = wgrad_shares(_offsets(pairs), rounds, False).slot_starts
    counts = np.diff(starts)
    for pair_count, count in zip(pairs, counts):
        assert (count == 0) == (pair_count == 0)
    if rounds > 1 and total:
        # No share holds more than the mean over the slots left once each offset has one.
        bound = math.ceil(total / (kernel_volume * (rounds - 1)))
        for pair_count, count in zip(pairs, counts):
            if pair_count:
                assert math.ceil(pair_count / count) <= bound


@pytest.mark.parametrize("pairs, rounds", CASES)
def test_round_major_blocks_go_by_the_stretch_of_their_list_then_by_offset(pairs, rounds):
    blocks = wgrad_shares(_offsets(pairs), rounds, True).table
    blocks = blocks[blocks[:, 0] >= 0]
    keys = [(math.floor(Fraction(int(s) * rounds, int(count))), int(k), int(s)) for k, s, count, _ in blocks]
    assert keys == sorted(keys)


@pytest.mark.gpu
@pytest.mark.parametrize("pairs, rounds", CASES)
def test_the_gpu_table_is_the_numpy_one(pairs, rounds):
    cupy = cupy_module()
    for round_major in (False, True):
        expected = wgrad_shares(_offsets(pairs), rounds, round_major)
        got = wgrad_shares(cupy.asarray(_offsets(pairs)), rounds, round_major)
        np.testing.assert_array_equal(got.table.get(), expected.table)
        np.testing.assert_array_equal(got.slot_starts.get(), expected.slot_starts)


@pytest.mark.gpu
def test_tables_derived_together_are_each_the_numpy_one_and_start_on_16_bytes():
    cupy = cupy_module()
    requests = [(pairs, rounds, round_major) for pairs, rounds in CASES for round_major in (False, True)]
    together = wgrad_shares_of([(cupy.asarray(_offsets(pairs)), rounds, round_major)
                                for pairs, rounds, round_major in requests])
    for (pairs, rounds, round_major), got in zip(requests, together):
        expected = wgrad_shares(_offsets(pairs), rounds, round_major)
        assert got.table.data.ptr % 16 == 0  # the GEMMs read a block's row as one int4
        np.testing.assert_array_equal(got.table.get(), expected.table)
        np.testing.assert_array_equal(got.slot_starts.get(), expected.slot_starts)
