"""Padded kernel maps (spconv's geometry) against a brute-force enumeration of spconv's definition.

The oracle works on coordinate tuples in plain Python: for every input voxel x and kernel tap j (a kernel
index per axis, 0..K-1, first axis slowest), a padded convolution reaches o = (x + p - d·j) / s where that
division is exact, a padded transposed one o = x·s - p + d·j, each kept inside spconv's output spatial
shape when the input has one. The library's output coordinates (in order of first occurrence, input rows
outer and taps inner), their spatial shape, every (tap, input row, output) pair and the features of a
convolution over them must be the oracle's; its inverse must return to the input with the same pairs. On
the GPU (`pytest -m gpu`) the same from CuPy coordinates.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from dataclasses import dataclass

import numpy as np
import pytest

import cupysparse
from cupysparse.cuda.backend import cupy_module
from cupysparse.functional import spatially_sparse_conv, spatially_sparse_conv_backward
from cupysparse.geometry import coords as coords_module
from cupysparse.geometry.kernel_map import (
    KernelMapCache,
    padded_generative_map,
    padded_map,
    strided_map,
)
from cupysparse.geometry.padding import spconv_grid
from cupysparse.networks import descriptions as networks

ON_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@dataclass(frozen=True)
class Case:
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    padding: tuple[int, ...]
    spatial_shape: tuple[int, ...] | None

    def __str__(self) -> str:
        shape = "no shape" if self.spatial_shape is None else f"shape{self.spatial_shape}"
        return f"k{self.kernel_size}-s{self.stride}-d{self.dilation}-p{self.padding}-{shape}"


CASES = [
    Case((3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1), (9, 8, 7)),  # SECOND's downsampling
    Case((3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1), None),
    Case((3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1), (9, 8, 7)),  # a regular convolution: dilates the set
    Case((3, 3, 3), (1, 1, 1), (1, 1, 1), (0, 0, 0), (9, 8, 7)),
    Case((2, 2, 2), (2, 2, 2), (1, 1, 1), (0, 0, 0), (9, 8, 7)),
    Case((3, 3, 3), (2, 2, 2), (2, 2, 2), (0, 0, 0), None),
    Case((3, 1, 1), (2, 1, 1), (1, 1, 1), (0, 0, 0), (9, 8, 7)),  # CenterPoint's last downsampling
    Case((2, 3, 4), (2, 1, 3), (1, 2, 1), (0, 1, 2), (9, 8, 7)),
    Case((5, 3, 3), (3, 2, 2), (1, 1, 1), (2, 1, 3), None),
    Case((3, 3), (2, 2), (1, 1), (1, 1), (12, 10)),
    Case((4, 3), (2, 1), (1, 2), (1, 0), None),
]


def random_coords(spatial_shape, seed: int, rows_per_batch: int = 45) -> np.ndarray:
    """Two batch items of distinct voxels inside `spatial_shape`, int32 `[N, 1 + D]`."""
    rng = np.random.default_rng(seed)
    items = []
    for batch in range(2):
        voxels = np.unique(np.stack([rng.integers(0, size, rows_per_batch) for size in spatial_shape], axis=1), axis=0)
        items.append(np.concatenate([np.full((len(voxels), 1), batch), rng.permutation(voxels)], axis=1))
    return np.concatenate(items).astype(np.int32)


def case_coords(case: Case) -> np.ndarray:
    return random_coords(case.spatial_shape or (9, 8, 7, 6)[: len(case.kernel_size)], seed=len(str(case)))


def oracle_shape(case: Case, transposed: bool):
    if case.spatial_shape is None:
        return None
    axes = zip(case.spatial_shape, case.kernel_size, case.stride, case.dilation, case.padding)
    if transposed:
        return tuple((size - 1) * s - 2 * p + k for size, k, s, d, p in axes)
    return tuple((size + 2 * p - d * (k - 1) - 1) // s + 1 for size, k, s, d, p in axes)


def oracle(coords: np.ndarray, case: Case, transposed: bool):
    """(outputs in order of first occurrence, output spatial shape, {(tap, input row, output)})."""
    shape = oracle_shape(case, transposed)
    outputs, pairs = {}, set()
    taps = list(itertools.product(*(range(k) for k in case.kernel_size)))
    for row, voxel in enumerate(coords.tolist()):
        for tap_index, tap in enumerate(taps):
            reached = []
            for x, j, k, s, d, p in zip(voxel[1:], tap, case.kernel_size, case.stride, case.dilation, case.padding):
                if transposed:
                    reached.append(x * s - p + d * j)
                elif (x + p - d * j) % s == 0:
                    reached.append((x + p - d * j) // s)
                else:
                    break
            else:
                if shape is None or all(0 <= o < size for o, size in zip(reached, shape)):
                    output = (voxel[0], *reached)
                    outputs.setdefault(output, len(outputs))
                    pairs.add((tap_index, row, output))
    return list(outputs), shape, pairs


def on_device(array, device: str):
    return array if device == "cpu" else cupy_module().asarray(array)


def to_host(array) -> np.ndarray:
    return array if isinstance(array, np.ndarray) else array.get()


def library_pairs(kernel_map, out_coords) -> set:
    table, outputs = to_host(kernel_map.pair_table), [tuple(row) for row in to_host(out_coords).tolist()]
    return {(int(k), int(table[k, i]), outputs[i]) for k, i in zip(*np.nonzero(table >= 0))}


@pytest.mark.parametrize("device", ON_DEVICES)
@pytest.mark.parametrize("transposed", [False, True], ids=["forward", "transposed"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_padded_maps_are_the_enumeration(case, transposed, device):
    coords = case_coords(case)
    expected_outputs, expected_shape, expected_pairs = oracle(coords, case, transposed)
    build = padded_generative_map if transposed else padded_map
    out_coords, out_shape, kernel_map = build(on_device(coords, device), case.kernel_size, case.stride,
                                              case.dilation, case.padding, case.spatial_shape)
    assert [tuple(row) for row in to_host(out_coords).tolist()] == expected_outputs
    assert out_shape == expected_shape
    assert library_pairs(kernel_map, out_coords) == expected_pairs
    assert (kernel_map.num_in, kernel_map.num_out, kernel_map.padding) == (len(coords), len(expected_outputs),
                                                                           case.padding)
    assert (kernel_map.transposed, kernel_map.generative) == (transposed, transposed)
    assert kernel_map.identity_offset is None  # no row is its own neighbour: rows of other coordinates


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True], ids=["forward", "transposed"])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[6], CASES[8], CASES[9]], ids=str)
def test_many_voxels_reach_the_same_outputs_and_pairs_on_the_gpu_as_on_the_cpu(case, transposed):
    """Tens of thousands of voxels: the GPU's hash table of candidates (probing chains, atomics) against
    the CPU's sort, output by output in the same order, and the same pair tables."""
    shape = (70, 60, 50, 40)[: len(case.kernel_size)]
    coords = random_coords(shape, seed=3, rows_per_batch=30_000)
    build = padded_generative_map if transposed else padded_map
    geometry = (case.kernel_size, case.stride, case.dilation, case.padding, shape)
    cpu_outputs, cpu_shape, cpu_map = build(coords, *geometry)
    gpu_outputs, gpu_shape, gpu_map = build(on_device(coords, "cuda"), *geometry)
    assert len(cpu_outputs) > len(coords) // 4
    np.testing.assert_array_equal(to_host(gpu_outputs), cpu_outputs)
    assert gpu_shape == cpu_shape
    np.testing.assert_array_equal(to_host(gpu_map.pair_table), cpu_map.pair_table)


@pytest.mark.parametrize("device", ON_DEVICES)
@pytest.mark.parametrize("transposed", [False, True], ids=["forward", "transposed"])
def test_outputs_past_the_key_range_are_refused(transposed, device):
    """A voxel at the edge of the key range whose taps reach past it, with no spatial shape to clip them."""
    layout = coords_module.key_layout(3)
    edge = layout.coord_max if transposed else layout.coord_min
    coords = np.array([[0, 0, 0, 0], [0, edge, 0, 0]], np.int32)
    build = padded_generative_map if transposed else padded_map
    with pytest.raises(ValueError, match=r"would create coordinates outside \[-\d+, \d+\], the range of D = 3"):
        build(on_device(coords, device), 3, 2 if transposed else 1, 1, 0)


def dense_sums(pairs: set, outputs: list, features: np.ndarray, weight: np.ndarray, num_inputs: int | None = None):
    """out[o] = Σ over the pairs (k, x, o) of weight[k]^T features[x]; with `num_inputs`, the inverse:
    out[x] = Σ weight[k]^T features[o], features by output."""
    index = {output: row for row, output in enumerate(outputs)}
    inverse = num_inputs is not None
    out = np.zeros((num_inputs if inverse else len(outputs), weight.shape[2]))
    for tap, row, output in pairs:
        if inverse:
            out[row] += weight[tap].T @ features[index[output]]
        else:
            out[index[output]] += weight[tap].T @ features[row]
    return out


@pytest.mark.parametrize("device", ON_DEVICES)
@pytest.mark.parametrize("case", [case for case in CASES if case.spatial_shape is not None], ids=str)
def test_a_padded_convolution_and_its_inverse_compute_the_enumerated_sums(case, device):
    coords = case_coords(case)
    outputs, shape, pairs = oracle(coords, case, transposed=False)
    rng = np.random.default_rng(7)
    volume = int(np.prod(case.kernel_size))
    features, weight = rng.standard_normal((len(coords), 3)), rng.standard_normal((volume, 3, 4))
    x = cupysparse.SparseTensor(on_device(coords, device), on_device(features, device),
                                spatial_shape=case.spatial_shape)
    geometry = {"kernel_size": case.kernel_size, "stride": case.stride, "dilation": case.dilation,
                "padding": case.padding}
    y = spatially_sparse_conv(x, on_device(weight, device), **geometry)
    assert y.spatial_shape == shape and y.tensor_stride == tuple(case.stride)
    np.testing.assert_allclose(to_host(y.features), dense_sums(pairs, outputs, features, weight), rtol=1e-12,
                               atol=1e-12)

    back_weight = rng.standard_normal((volume, 4, 2))
    z = spatially_sparse_conv(y, on_device(back_weight, device), transposed=True, **geometry)
    assert z.map_cache is x.map_cache and z.spatial_shape == case.spatial_shape
    np.testing.assert_array_equal(to_host(z.coordinates), coords)
    expected = dense_sums(pairs, outputs, to_host(y.features), back_weight, num_inputs=len(coords))
    np.testing.assert_allclose(to_host(z.features), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", ON_DEVICES)
def test_spconvs_transposed_convolution_computes_the_enumerated_sums(device):
    case = CASES[0]
    coords = case_coords(case)
    outputs, shape, pairs = oracle(coords, case, transposed=True)
    rng = np.random.default_rng(8)
    features, weight = rng.standard_normal((len(coords), 3)), rng.standard_normal((27, 3, 2))
    x = cupysparse.SparseTensor(on_device(coords, device), on_device(features, device), 2,
                                spatial_shape=case.spatial_shape)
    y = spatially_sparse_conv(x, on_device(weight, device), 3, 2, transposed=True, generative=True, padding=1)
    assert y.spatial_shape == shape and y.tensor_stride == (1, 1, 1)
    assert [tuple(row) for row in to_host(y.coordinates).tolist()] == outputs
    np.testing.assert_allclose(to_host(y.features), dense_sums(pairs, outputs, features, weight), rtol=1e-12,
                               atol=1e-12)


def test_the_gradients_of_a_padded_convolution_are_the_enumerated_sums():
    case = CASES[0]
    coords = case_coords(case)
    outputs, _, pairs = oracle(coords, case, transposed=False)
    rng = np.random.default_rng(9)
    features, weight = rng.standard_normal((len(coords), 3)), rng.standard_normal((27, 3, 4))
    grad_output = rng.standard_normal((len(outputs), 4))
    x = cupysparse.SparseTensor(coords, features, spatial_shape=case.spatial_shape)
    grads = spatially_sparse_conv_backward(grad_output, x, weight, 3, 2, padding=1)
    expected_weight = np.zeros_like(weight)
    index = {output: row for row, output in enumerate(outputs)}
    for tap, row, output in pairs:
        expected_weight[tap] += np.outer(features[row], grad_output[index[output]])
    expected_input = dense_sums(pairs, outputs, grad_output, weight.transpose(0, 2, 1), num_inputs=len(coords))
    np.testing.assert_allclose(grads.input, expected_input, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grads.weight, expected_weight, rtol=1e-12, atol=1e-12)


def test_without_padding_a_strided_convolution_keeps_its_floor_division():
    """No padding argument: `unique(floor(x / s))` and the unpadded map, as before padding existed."""
    coords = random_coords((9, 8, 7), seed=3)
    x = cupysparse.SparseTensor(coords, np.ones((len(coords), 1)), spatial_shape=(9, 8, 7))
    result = x.kernel_map(3, 2)
    out_coords, expected = strided_map(coords, 3, 2)
    np.testing.assert_array_equal(result.out_coordinates, out_coords)
    np.testing.assert_array_equal(result.kernel_map.pair_table, expected.pair_table)
    assert result.kernel_map.padding is None and result.out_map_cache is x.map_cache
    floors = {(row[0], *(c // 2 for c in row[1:])) for row in coords.tolist()}
    assert {tuple(row) for row in out_coords.tolist()} == floors
    assert x.kernel_map(3, 2, padding=1).out_coordinates.shape[0] > len(floors)  # the padded one differs


def test_the_spatial_shape_travels_with_the_coordinates():
    coords = random_coords((9, 8, 7), seed=4)
    x = cupysparse.SparseTensor(coords, np.ones((len(coords), 2)), spatial_shape=(9, 8, 7))
    weight = np.ones((27, 2, 2))
    assert spatially_sparse_conv(x, weight, 3).spatial_shape == (9, 8, 7)  # submanifold
    down = spatially_sparse_conv(x, weight, 3, 2)
    assert down.spatial_shape == (5, 4, 4)  # unpadded: ceil(S / 2) holds every floor(x / 2)
    assert spatially_sparse_conv(down, weight, 3, 2, transposed=True).spatial_shape == (9, 8, 7)
    padded = spatially_sparse_conv(x, weight, 3, 2, padding=1)
    assert padded.spatial_shape == (5, 4, 4)
    assert spatially_sparse_conv(padded, weight, 3, 2, padding=(0, 1, 1)).spatial_shape == (2, 2, 2)
    assert x.to("cpu").spatial_shape == (9, 8, 7)
    assert spatially_sparse_conv(down, weight, 3, 2, transposed=True, generative=True).spatial_shape is None


def test_without_a_spatial_shape_every_voxel_reached_is_kept():
    """A stride-1 padded convolution of the corner voxel reaches -1 along each axis: spconv, which always
    has a shape, drops it; without one it stays."""
    x = cupysparse.SparseTensor(np.zeros((1, 4), np.int32), np.ones((1, 1)))
    reached = {tuple(row) for row in x.kernel_map(3, 1, padding=1).out_coordinates.tolist()}
    assert reached == {(0, *offset) for offset in itertools.product((-1, 0, 1), repeat=3)}
    clipped = cupysparse.SparseTensor(np.zeros((1, 4), np.int32), np.ones((1, 1)), spatial_shape=(4, 4, 4))
    kept = {tuple(row) for row in clipped.kernel_map(3, 1, padding=1).out_coordinates.tolist()}
    assert kept == {(0, *offset) for offset in itertools.product((0, 1), repeat=3)}


def test_the_map_cache_tells_paddings_apart():
    coords = random_coords((9, 8, 7), seed=5)
    cache = KernelMapCache(coords, (1, 1, 1), spatial_shape=(9, 8, 7))
    unpadded, zero, one = (cache.kernel_map((1, 1, 1), 3, 2, padding=p) for p in (None, 0, 1))
    assert len({id(result.kernel_map) for result in (unpadded, zero, one)}) == 3
    assert (zero.kernel_map.padding, one.kernel_map.padding) == ((0, 0, 0), (1, 1, 1))
    assert cache.kernel_map((1, 1, 1), 3, 2, padding=(1, 1, 1)).kernel_map is one.kernel_map
    assert cache.lookup((1, 1, 1), 3, 2, padding=1).kernel_map is one.kernel_map
    with pytest.raises(TypeError, match=r"padding must be an int or 3 ints, got 1.0 \(float\)"):
        cache.kernel_map((1, 1, 1), 3, 2, padding=1.0)  # equal to 1, and memoised under 1: still refused


def test_a_padded_output_cache_lives_with_its_tensors_and_keeps_its_input():
    """The input's cache holds its padded outputs' caches weakly (no reference cycle: they go at once, with
    their tensors), and an output's cache holds the input's, which its inverse returns to."""
    coords = random_coords((9, 8, 7), seed=6)
    x = cupysparse.SparseTensor(coords, np.ones((len(coords), 1)), spatial_shape=(9, 8, 7))
    y = spatially_sparse_conv(x, np.ones((27, 1, 1)), 3, 2, padding=1)
    coarse, forward = weakref.ref(y.map_cache), y.map_cache.origin.kernel_map
    assert spatially_sparse_conv(x, np.ones((27, 1, 1)), 3, 2, padding=1).map_cache is coarse()
    gc.disable()
    try:
        del y
        assert coarse() is None
    finally:
        gc.enable()
    y = spatially_sparse_conv(x, np.ones((27, 1, 1)), 3, 2, padding=1)  # a new output cache, over the same map
    assert y.map_cache.origin.kernel_map is forward and y.spatial_shape == (5, 4, 4)
    fine = weakref.ref(x.map_cache)
    del x
    assert fine() is y.map_cache.origin.cache
    back = spatially_sparse_conv(y, np.ones((27, 1, 1)), 3, 2, transposed=True, padding=1)
    np.testing.assert_array_equal(back.coordinates, coords)


def test_an_inverse_needs_the_padded_convolution_that_made_its_input():
    coords = random_coords((9, 8, 7), seed=7)
    x = cupysparse.SparseTensor(coords, np.ones((len(coords), 1)), spatial_shape=(9, 8, 7))
    y = spatially_sparse_conv(x, np.ones((27, 1, 1)), 3, 2, padding=1)
    with pytest.raises(ValueError, match=r"made by a padded convolution of kernel size \(3, 3, 3\), stride "
                                         r"\(2, 2, 2\), dilation \(1, 1, 1\), padding \(1, 1, 1\)"):
        spatially_sparse_conv(y, np.ones((27, 1, 1)), 3, 2, transposed=True, padding=0)
    with pytest.raises(ValueError, match="made by no padded convolution"):
        spatially_sparse_conv(x, np.ones((27, 1, 1)), 3, 1, transposed=True, padding=1)


def test_padding_and_spatial_shape_arguments_are_checked():
    coords = random_coords((9, 8, 7), seed=8)
    x = cupysparse.SparseTensor(coords, np.ones((len(coords), 1)), spatial_shape=(9, 8, 7))
    with pytest.raises(ValueError, match=r"padding must be non-negative, got -1"):
        x.kernel_map(3, 2, padding=-1)
    with pytest.raises(ValueError, match=r"padding must be an int or 3 ints, got \(1, 1\)"):
        x.kernel_map(3, 2, padding=(1, 1))
    with pytest.raises(ValueError, match=r"no output voxels \(output spatial shape \(-1, -2, -2\)\)"):
        x.kernel_map(13, 2, padding=0)
    with pytest.raises(ValueError, match=r"axis 0 spans \[0, 8\], outside the spatial shape \(8, 8, 8\)"):
        cupysparse.SparseTensor(coords, np.ones((len(coords), 1)), spatial_shape=(8, 8, 8))
    with pytest.raises(ValueError, match="spatial_shape must be positive"):
        cupysparse.SparseTensor(coords, np.ones((len(coords), 1)), spatial_shape=(0, 8, 8))
    with pytest.raises(ValueError, match="pass spatial_shape or map_cache, not both"):
        cupysparse.SparseTensor(coords, np.ones((len(coords), 1)), spatial_shape=(9, 8, 7), map_cache=x.map_cache)


def test_padded_candidates_are_estimated_before_they_are_made(monkeypatch):
    """200,000 input rows x 27 taps: about 0.5 GiB of candidates and their deduplication on the CPU."""
    monkeypatch.setattr(coords_module, "available_host_memory", lambda: 2**28)
    line = np.zeros((200_000, 4), np.int32)
    line[:, 1] = np.arange(200_000)
    with pytest.raises(MemoryError, match=r"candidates of a padded convolution \(200000 input rows x 27 taps\): "
                                          r"about [\d.]+ GiB"):
        padded_map(line, 3, 2, 1, 1)


def test_spconv_grid_is_non_negative_and_keeps_every_levels_voxels():
    rng = np.random.default_rng(0)
    coordinates = np.concatenate(
        [rng.integers(0, 2, (500, 1)), rng.integers(-300, 300, (500, 3))], axis=1
    ).astype(np.int32)
    stride = networks.coarsest_stride(networks.minkunet(14))
    assert stride.tolist() == [16, 16, 16]
    shifted, spatial_shape = spconv_grid(coordinates, stride)
    assert np.array_equal(shifted[:, 0], coordinates[:, 0])
    spatial = shifted[:, 1:]
    assert spatial.min() >= 0 and (spatial.max(axis=0) < spatial_shape).all()
    assert all(size % 16 == 0 for size in spatial_shape)
    for level in range(1, 5):
        step = 2**level
        # floor(x / 2^level) moves by the same amount for every voxel: the same coarse voxels.
        moved = spatial // step - coordinates[:, 1:] // step
        assert (moved == moved[0]).all(), level
