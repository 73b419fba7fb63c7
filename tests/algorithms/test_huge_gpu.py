"""Scenes of tens of millions of voxels on the GPU: kernel maps, pair lists, convolutions, depthwise
convolutions and pooling past the int32 ranges. Marked `huge`: `pytest -m gpu` skips them, run them
with `pytest -m huge -s` (estimated for an H100: 2-4 minutes, the kernels' compilation included, and
a peak near 50 GB of GPU memory; they skip on a GPU with less free memory than `REQUIRED_FREE_BYTES`).

`test_maps_and_convolutions_of_twenty_million_voxels` (NUM_VOXELS rows, 27 offsets, CHANNELS
channels in fp16) guards against:
- element offsets `row * channels` past 2^31 (20M x 128 = 2.6e9 elements per feature matrix) in the
  gathers and writes of every algorithm, forward, dgrad and wgrad, of the depthwise kernels and of
  window pooling; CuPy's own indexing where the explicit algorithms gather;
- the pair table's K x N entries (5.5e8) and a hash table of 20M keys;
- the radix sort of 20M offset masks, the inversion of a 20M-row strided table.
`test_pair_lists_longer_than_2_31` (PAIR_LIST_VOXELS rows, 27 offsets: 2.4e9 pairs) guards against
pair counts and CSR offsets past 2^31: their cumulative sums, the fill positions of the lists, and
the weight gradients that read the lists from there.

The references are independent of the library: the test's own coordinate keys (linear indices,
no key packing, no hashing), sorted with neighbours found by searchsorted; the pair tables are
compared whole, the convolutions on sampled rows (and whole weight gradients) against fp64 sums
over those neighbours.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest

from cupysparse.algorithms import CONV, DEPTHWISE, ConvProblem, registered
from cupysparse.cuda.backend import array_module, cupy_module, to_numpy
from cupysparse.functional.pooling import avg_pool_backward, max_pool_forward
from cupysparse.geometry.sparse_tensor import SparseTensor
from tolerances import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.huge]

NUM_VOXELS = 20_000_000
DENSITY = 0.75  # of the voxels in each batch item's box: most of the 27 neighbours are present
CHANNELS = 128  # NUM_VOXELS * CHANNELS > 2^31
# 90M voxels at density 0.97 have about 2.4e9 pairs under a 3x3x3 kernel.
PAIR_LIST_VOXELS = 90_000_000
PAIR_LIST_DENSITY = 0.97
PAIR_LIST_CHANNELS = 8
REQUIRED_FREE_BYTES = 60 * 2**30
# Two batch items, each a box of voxels; the second straddles 0, so coordinates are also negative.
ORIGINS = ((0, 0, 0), (-150, 40, -7))
SAMPLE_ROWS = 1000
# The explicit algorithms accumulate in fp32 and copy gathered rows: on the submanifold map (20M x 128
# on both sides) that would take ~40 GB more. They run on the strided map, whose input is as large.
SUBMANIFOLD_SKIP = ("explicit_gemm", "explicit")
FEATURE_CHUNK_ELEMENTS = 2**27  # random features are drawn in chunks of this many values
REFERENCE_CHUNK_ROWS = 2**21  # pairs per fp64 weight-gradient product
# Per-axis kernel offsets, written out: odd sizes centred, size 2 the children of a coarse voxel.
AXIS_OFFSETS = {2: (0, 1), 3: (-1, 0, 1)}
# The test's own coordinate key: per-axis fields this wide, far wider than any scene here.
FIELD = 2**20


@pytest.fixture(autouse=True)
def only_when_selected(request):
    """Minutes and tens of GB: only with `-m huge`, and with the memory free; the memory pool is
    emptied after each test."""
    if "huge" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("runs only when selected with -m huge (minutes, tens of GB of GPU memory)")
    cupy = cupy_module()
    free_bytes = cupy.cuda.Device().mem_info[0]
    if free_bytes < REQUIRED_FREE_BYTES:
        pytest.skip(f"needs {REQUIRED_FREE_BYTES / 2**30:.0f} GiB of free GPU memory, {free_bytes / 2**30:.0f} free")
    yield
    cupy.get_default_memory_pool().free_all_blocks()


def test_maps_and_convolutions_of_twenty_million_voxels():
    check_scene_at_scale(cupy_module(), NUM_VOXELS, DENSITY, CHANNELS, seed=0)


def test_pair_lists_longer_than_2_31():
    check_long_pair_lists(cupy_module(), PAIR_LIST_VOXELS, PAIR_LIST_DENSITY, PAIR_LIST_CHANNELS, seed=1,
                          min_pairs=2**31)


def progress(message: str) -> None:
    """A timestamped line (shown with `pytest -s`): where the minutes go."""
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


# --- scenes and the test's own coordinate index ---------------------------------------------------


def draw_coordinates(xp, rng, num_voxels: int, density: float):
    """At least `num_voxels` distinct voxels: per batch item, each cell of a box kept with probability
    `density` (the box 1% larger than the expectation needs), rows shuffled."""
    side = math.ceil((1.01 * num_voxels / (len(ORIGINS) * density)) ** (1 / 3))
    parts = []
    for batch, origin in enumerate(ORIGINS):
        cells = xp.flatnonzero(rng.random(side**3, dtype=np.float32) < density)
        position = xp.stack(xp.unravel_index(cells, (side,) * 3), axis=1) + xp.asarray(origin)
        parts.append(xp.concatenate([xp.full((len(cells), 1), batch), position], axis=1).astype(np.int32))
        del cells, position
    coords = xp.concatenate(parts)
    del parts
    return coords[xp.argsort(rng.random(len(coords), dtype=np.float32))]


def random_features(xp, rng, num_rows: int, channels: int, scale: float = 1.0):
    """fp16 `[num_rows, channels]` of scaled standard normals, drawn in chunks."""
    out = xp.empty((num_rows, channels), dtype=np.float16)
    step = max(1, FEATURE_CHUNK_ELEMENTS // channels)
    for start in range(0, num_rows, step):
        rows = min(step, num_rows - start)
        out[start : start + rows] = rng.standard_normal((rows, channels), dtype=np.float32) * scale
    return out


def coordinate_keys(xp, coords, scale: int = 1):
    """int64 keys of (batch, scale * position): linear in the position, so the key of a position
    shifted by o is the key plus `key_shift(o)`."""
    wide = coords.astype(np.int64)
    keys = wide[:, 0]
    for axis in range(1, 4):
        keys = keys * FIELD + wide[:, axis] * scale + FIELD // 2
    return keys


def key_shift(offset) -> int:
    return (int(offset[0]) * FIELD + int(offset[1])) * FIELD + int(offset[2])


class RowsByKey:
    """The row of each key among distinct keys: sorted keys and a binary search."""

    def __init__(self, xp, keys):
        self.xp = xp
        self.order = xp.argsort(keys)
        self.sorted_keys = keys[self.order]

    def rows(self, keys):
        """int64 rows of `keys`, -1 for keys not present."""
        xp = self.xp
        if len(self.sorted_keys) == 0:
            return xp.full(keys.shape, -1, dtype=np.int64)
        position = xp.minimum(xp.searchsorted(self.sorted_keys, keys), len(self.sorted_keys) - 1)
        return xp.where(self.sorted_keys[position] == keys, self.order[position], -1)


class ExpectedMap:
    """The pairs of a map found from the geometry alone: output row i and offset k take the input at
    `out_i * scale + o_k` (submanifold: scale 1, output = input coordinates; strided: scale 2)."""

    def __init__(self, xp, in_coords, out_coords, kernel_size: int, scale: int):
        self.xp = xp
        self.offsets = np.array(list(itertools.product(AXIS_OFFSETS[kernel_size], repeat=3)), dtype=np.int64)
        self.scale = scale
        self.in_coords = in_coords
        self.inputs = RowsByKey(xp, coordinate_keys(xp, in_coords))
        self.outputs = self.inputs if out_coords is in_coords else RowsByKey(xp, coordinate_keys(xp, out_coords))
        self.scaled_out_keys = coordinate_keys(xp, out_coords, scale)

    @property
    def kernel_volume(self) -> int:
        return len(self.offsets)

    def table_row(self, k: int):
        """The input row of every output row through offset k, or -1: row k of the pair table."""
        return self.inputs.rows(self.scaled_out_keys + key_shift(self.offsets[k]))

    def inputs_of(self, out_rows):
        """`[K, len(out_rows)]`: the input of each output row through each offset, or -1."""
        base = self.scaled_out_keys[out_rows]
        return self.xp.stack([self.inputs.rows(base + key_shift(offset)) for offset in self.offsets])

    def outputs_of(self, in_rows):
        """`[K, len(in_rows)]`: the output each input row feeds through each offset, or -1."""
        xp = self.xp
        coords = self.in_coords[in_rows].astype(np.int64)
        found = []
        for offset in self.offsets:
            shifted = coords[:, 1:] - xp.asarray(offset)
            divisible = (shifted % self.scale == 0).all(axis=1)
            parents = xp.concatenate([coords[:, :1], shifted // self.scale], axis=1)
            found.append(xp.where(divisible, self.outputs.rows(coordinate_keys(xp, parents)), -1))
        return xp.stack(found)


# --- checks ------------------------------------------------------------------------------------


def check_pair_table(kernel_map, expected: ExpectedMap) -> list[int]:
    """The whole pair table equals the expected one; the CSR offsets and the pair count equal the
    expected per-offset counts. Returns the counts."""
    xp = expected.xp
    assert kernel_map.pair_table.shape == (expected.kernel_volume, len(expected.scaled_out_keys))
    counts = []
    for k in range(expected.kernel_volume):
        row = expected.table_row(k)
        assert bool(xp.array_equal(kernel_map.pair_table[k], row)), f"pair table row {k} differs"
        counts.append(int(xp.count_nonzero(row >= 0)))
        del row
    offsets = to_numpy(kernel_map.csr().offsets)
    assert offsets.dtype == np.int64
    np.testing.assert_array_equal(np.diff(offsets), counts)
    assert offsets[0] == 0 and kernel_map.num_pairs == sum(counts)
    return counts


def check_pair_lists(kernel_map) -> None:
    """Each offset's CSR lists hold exactly its pair-table entries, by output row."""
    xp = array_module(kernel_map.pair_table)
    pairs = kernel_map.csr()
    bounds = to_numpy(pairs.offsets)
    for k in range(kernel_map.kernel_volume):
        row = kernel_map.pair_table[k]
        out_rows = xp.flatnonzero(row >= 0)
        start, end = int(bounds[k]), int(bounds[k + 1])
        assert bool(xp.array_equal(pairs.out_idx[start:end], out_rows)), f"out_idx of offset {k}"
        assert bool(xp.array_equal(pairs.in_idx[start:end], row[out_rows])), f"in_idx of offset {k}"
        del out_rows


def sample_rows(xp, num_rows: int, seed: int):
    """SAMPLE_ROWS random rows, the first and the last among them, sorted."""
    rows = np.random.default_rng(seed).choice(num_rows, size=min(SAMPLE_ROWS, num_rows), replace=False)
    return xp.asarray(np.union1d(rows, [0, num_rows - 1]))


def gathered(features, rows):
    """fp64 `features[rows]` for rows `[K, S]`, zero where a row is -1."""
    xp = array_module(features)
    values = features[xp.maximum(rows, 0)].astype(np.float64)
    return values * (rows >= 0)[..., None]


def weight_gradient_reference(expected: ExpectedMap, x, dy, depthwise: bool):
    """fp64 `Σ_i x[in(k, i)]^T dy[i]` over every pair, per offset (elementwise when `depthwise`)."""
    xp = expected.xp
    channels_in, channels_out = x.shape[1], dy.shape[1]
    shape = (expected.kernel_volume, channels_in) if depthwise else (expected.kernel_volume, channels_in, channels_out)
    grad = xp.zeros(shape, dtype=np.float64)
    for k in range(expected.kernel_volume):
        row = expected.table_row(k)
        out_rows = xp.flatnonzero(row >= 0)
        in_rows = row[out_rows]
        del row
        for start in range(0, len(out_rows), REFERENCE_CHUNK_ROWS):
            xs = x[in_rows[start : start + REFERENCE_CHUNK_ROWS]].astype(np.float64)
            ys = dy[out_rows[start : start + REFERENCE_CHUNK_ROWS]].astype(np.float64)
            grad[k] += (xs * ys).sum(axis=0) if depthwise else xs.T @ ys
            del xs, ys
    return to_numpy(grad)


def phase_params(algorithm, phase: str) -> dict:
    return algorithm.default_params("forward" if phase == "forward" else "backward")


def check_convolutions(kernel_map, expected: ExpectedMap, x, dy, rng, skip, what: str) -> None:
    """Every supported convolution algorithm (but `skip`), every phase, against fp64: forward and
    dgrad on sampled rows, wgrad whole."""
    xp = expected.xp
    kernel_volume, channels_in, channels_out = kernel_map.kernel_volume, x.shape[1], dy.shape[1]
    w = (rng.standard_normal((kernel_volume, channels_in, channels_out), dtype=np.float32)
         / math.sqrt(kernel_volume * channels_in)).astype(np.float16)
    problem = ConvProblem.of(x, kernel_map, channels_out)
    algorithms = [a for name, a in registered(CONV).items() if name not in skip and a.supports(problem)]
    out_rows, in_rows = sample_rows(xp, kernel_map.num_out, 1), sample_rows(xp, kernel_map.num_in, 2)
    w64 = w.astype(np.float64)
    x_at_inputs, dy_at_outputs = gathered(x, expected.inputs_of(out_rows)), gathered(dy, expected.outputs_of(in_rows))
    forward_reference = to_numpy(xp.einsum("ksc,kco->so", x_at_inputs, w64))
    dgrad_reference = to_numpy(xp.einsum("kso,kco->sc", dy_at_outputs, w64))
    grad_weight_reference = weight_gradient_reference(expected, x, dy, depthwise=False)
    x_sample, dy_sample, w_host = to_numpy(x[in_rows]), to_numpy(dy[out_rows]), to_numpy(w)
    for algorithm in algorithms:
        progress(f"{algorithm.name} on {what}")
        weight = algorithm.prepare_weight(w)
        out = algorithm.forward(x, weight, kernel_map, **phase_params(algorithm, "forward"))
        assert out.shape == (kernel_map.num_out, channels_out)
        assert_close(to_numpy(out[out_rows]), forward_reference, np.float16, kernel_volume * channels_in, x_sample,
                     w_host, f"{algorithm.name} forward, {what}")
        del out
        grad_input = algorithm.dgrad(dy, weight, kernel_map, **phase_params(algorithm, "dgrad"))
        assert grad_input.shape == x.shape
        assert_close(to_numpy(grad_input[in_rows]), dgrad_reference, np.float16, kernel_volume * channels_out,
                     dy_sample, w_host, f"{algorithm.name} dgrad, {what}")
        del grad_input
        grad_weight = algorithm.wgrad(x, dy, kernel_map, **phase_params(algorithm, "wgrad"))
        assert_close(to_numpy(grad_weight), grad_weight_reference, np.float16, kernel_map.num_out, x_sample,
                     dy_sample, f"{algorithm.name} wgrad, {what}")
        del grad_weight, weight
    assert algorithms, f"no convolution algorithm ran on {what}"


def check_depthwise(kernel_map, expected: ExpectedMap, x, dy, rng, skip, what: str) -> None:
    """Every supported depthwise algorithm (but `skip`), as `check_convolutions`."""
    xp = expected.xp
    kernel_volume, channels = kernel_map.kernel_volume, x.shape[1]
    w = rng.standard_normal((kernel_volume, channels), dtype=np.float32).astype(np.float16)
    problem = ConvProblem.of(x, kernel_map, channels)
    algorithms = [a for name, a in registered(DEPTHWISE).items() if name not in skip and a.supports(problem)]
    out_rows, in_rows = sample_rows(xp, kernel_map.num_out, 3), sample_rows(xp, kernel_map.num_in, 4)
    w64 = w.astype(np.float64)[:, None, :]
    forward_reference = to_numpy((gathered(x, expected.inputs_of(out_rows)) * w64).sum(axis=0))
    dgrad_reference = to_numpy((gathered(dy, expected.outputs_of(in_rows)) * w64).sum(axis=0))
    grad_weight_reference = weight_gradient_reference(expected, x, dy, depthwise=True)
    x_sample, dy_sample, w_host = to_numpy(x[in_rows]), to_numpy(dy[out_rows]), to_numpy(w)
    for algorithm in algorithms:
        progress(f"depthwise {algorithm.name} on {what}")
        out = algorithm.forward(x, w, kernel_map, **phase_params(algorithm, "forward"))
        assert_close(to_numpy(out[out_rows]), forward_reference, np.float16, kernel_volume, x_sample, w_host,
                     f"depthwise {algorithm.name} forward, {what}")
        del out
        grad_input = algorithm.dgrad(dy, w, kernel_map, **phase_params(algorithm, "dgrad"))
        assert_close(to_numpy(grad_input[in_rows]), dgrad_reference, np.float16, kernel_volume, dy_sample, w_host,
                     f"depthwise {algorithm.name} dgrad, {what}")
        del grad_input
        grad_weight = algorithm.wgrad(x, dy, kernel_map, **phase_params(algorithm, "wgrad"))
        assert_close(to_numpy(grad_weight), grad_weight_reference, np.float16, kernel_map.num_out, x_sample,
                     dy_sample, f"depthwise {algorithm.name} wgrad, {what}")
        del grad_weight
    assert algorithms, f"no depthwise algorithm ran on {what}"


def check_pooling(strided_map, expected: ExpectedMap, x, dy) -> None:
    """Max pooling (values and argmax exactly) and the average pooling gradient on sampled rows."""
    xp = expected.xp
    out_rows, in_rows = sample_rows(xp, strided_map.num_out, 5), sample_rows(xp, strided_map.num_in, 6)
    out, argmax = max_pool_forward(x, strided_map)
    inputs = expected.inputs_of(out_rows)
    values = xp.where((inputs >= 0)[..., None], x[xp.maximum(inputs, 0)].astype(np.float64), -np.inf)
    best = values.argmax(axis=0)[None]  # the first maximum in kernel order
    chosen = xp.take_along_axis(xp.broadcast_to(inputs[..., None], values.shape), best, axis=0)[0]
    np.testing.assert_array_equal(to_numpy(out[out_rows]).astype(np.float64),
                                  to_numpy(xp.take_along_axis(values, best, axis=0)[0]))
    np.testing.assert_array_equal(to_numpy(argmax[out_rows]), to_numpy(chosen))
    del out, argmax
    grad_input = avg_pool_backward(dy, strided_map)
    parents = expected.outputs_of(in_rows)
    assert bool(((parents >= 0).sum(axis=0) == 1).all()), "every fine voxel has exactly one coarse one"
    parent = parents.max(axis=0)
    window_sizes = (expected.inputs_of(parent) >= 0).sum(axis=0)
    reference = dy[parent].astype(np.float64) / window_sizes[:, None]
    assert_close(to_numpy(grad_input[in_rows]), to_numpy(reference), np.float16, 1, to_numpy(dy[parent]),
                 np.ones(1), "average pooling gradient")


def check_scene_at_scale(xp, num_voxels: int, density: float, channels: int, seed: int) -> None:
    rng = (cupy_module().random.default_rng if xp is not np else np.random.default_rng)(seed)
    coords = draw_coordinates(xp, rng, num_voxels, density)
    assert len(coords) >= num_voxels
    x = random_features(xp, rng, len(coords), channels)
    tensor = SparseTensor(coords, x)  # validated: ranges, batch indices, duplicates
    progress(f"{len(coords)} voxels x {channels} channels drawn and validated")

    submanifold = tensor.kernel_map(3).kernel_map
    expected_submanifold = ExpectedMap(xp, coords, coords, kernel_size=3, scale=1)
    counts = check_pair_table(submanifold, expected_submanifold)
    assert counts[13] == len(coords) and sum(counts) > 10 * len(coords)  # the centre, and a dense-ish scene

    strided_result = tensor.kernel_map(2, 2)
    strided, coarse = strided_result.kernel_map, strided_result.out_coordinates
    parents = xp.concatenate([coords[:, :1], xp.floor_divide(coords[:, 1:], 2)], axis=1)
    np.testing.assert_array_equal(to_numpy(xp.sort(coordinate_keys(xp, coarse))),
                                  to_numpy(xp.unique(coordinate_keys(xp, parents))))
    del parents
    expected_strided = ExpectedMap(xp, coords, coarse, kernel_size=2, scale=2)
    assert sum(check_pair_table(strided, expected_strided)) == len(coords)  # one coarse voxel per fine one
    progress(f"maps checked: {sum(counts)} submanifold pairs, {len(coarse)} coarse voxels")

    dy = random_features(xp, rng, len(coords), channels)
    dy_coarse = random_features(xp, rng, len(coarse), channels)
    for kernel_map, expected, grad_output, skip, what in (
        (submanifold, expected_submanifold, dy, SUBMANIFOLD_SKIP, "submanifold 3x3x3"),
        (strided, expected_strided, dy_coarse, (), "stride 2"),
    ):
        check_convolutions(kernel_map, expected, x, grad_output, rng, skip, what)
        check_depthwise(kernel_map, expected, x, grad_output, rng, skip, what)
    progress("pooling")
    check_pooling(strided, expected_strided, x, dy_coarse)


def check_long_pair_lists(xp, num_voxels: int, density: float, channels: int, seed: int, min_pairs: int) -> None:
    rng = (cupy_module().random.default_rng if xp is not np else np.random.default_rng)(seed)
    coords = draw_coordinates(xp, rng, num_voxels, density)
    assert len(coords) >= num_voxels
    # Sums over ~90M pairs per offset: inputs of rms 1/2 keep them far below fp16's largest value.
    x = random_features(xp, rng, len(coords), channels, scale=0.5)
    tensor = SparseTensor(coords, x)
    kernel_map = tensor.kernel_map(3).kernel_map
    expected = ExpectedMap(xp, coords, coords, kernel_size=3, scale=1)
    counts = check_pair_table(kernel_map, expected)
    assert sum(counts) > min_pairs
    check_pair_lists(kernel_map)
    progress(f"{len(coords)} voxels: {sum(counts)} pairs in the table and the lists checked")

    dy = random_features(xp, rng, len(coords), channels, scale=0.5)
    reference = weight_gradient_reference(expected, x, dy, depthwise=False)
    x_sample, dy_sample = to_numpy(x[:SAMPLE_ROWS]), to_numpy(dy[:SAMPLE_ROWS])
    problem = ConvProblem.of(x, kernel_map, channels)
    algorithms = [a for a in registered(CONV).values() if a.supports(problem)]
    for algorithm in algorithms:
        progress(f"{algorithm.name} wgrad")
        grad_weight = algorithm.wgrad(x, dy, kernel_map, **phase_params(algorithm, "wgrad"))
        assert_close(to_numpy(grad_weight), reference, np.float16, kernel_map.num_out, x_sample, dy_sample,
                     f"{algorithm.name} wgrad over {sum(counts)} pairs")
        del grad_weight
    assert algorithms
