"""The `explicit` depthwise algorithm on the CPU against a brute-force loop over the pair table.

The reference walks every (offset, output row) entry of the pair table in plain Python, in fp64:
forward `out[i, c] = Σ_k w[k, c] · x[table[k, i], c]`, dgrad scatters `w[k, c] · dy[i, c]` back to
the input row, wgrad sums `x[table[k, i], c] · dy[i, c]` per offset. Submanifold, strided and
transposed maps, D = 2 and 3, an empty input; half-precision inputs keep their dtype.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from cupysparse.algorithms import DEPTHWISE, get_algorithm
from cupysparse.geometry.kernel_map import strided_map, submanifold_map, transposed_map

CHANNELS = 5


def random_coordinates(spatial_dims: int, seed: int) -> np.ndarray:
    """Two batch items of unique voxels in a box around 0, dense enough for most rows to have
    neighbours, in shuffled row order."""
    rng = np.random.default_rng(seed)
    side = 7 if spatial_dims == 3 else 11
    rows = []
    for batch in range(2):
        cells = np.argwhere(rng.random((side,) * spatial_dims) < 0.35) - side // 2
        rows.append(np.column_stack([np.full(len(cells), batch), cells]))
    coords = np.concatenate(rows).astype(np.int32)
    return coords[rng.permutation(len(coords))]


def build_map(kind: str, coords):
    spatial_dims = coords.shape[1] - 1
    if kind == "submanifold":
        return submanifold_map(coords, 3)
    _, strided = strided_map(coords, 3 if spatial_dims == 2 else 2, 2)
    return strided if kind == "strided" else transposed_map(strided)


def reference_forward(features, weight, pair_table):
    kernel_volume, num_out = pair_table.shape
    out = np.zeros((num_out, features.shape[1]))
    for k in range(kernel_volume):
        for i in range(num_out):
            j = pair_table[k, i]
            if j >= 0:
                out[i] += weight[k] * features[j]
    return out


def reference_dgrad(grad_output, weight, pair_table, num_in):
    kernel_volume, num_out = pair_table.shape
    grad_input = np.zeros((num_in, grad_output.shape[1]))
    for k in range(kernel_volume):
        for i in range(num_out):
            j = pair_table[k, i]
            if j >= 0:
                grad_input[j] += weight[k] * grad_output[i]
    return grad_input


def reference_wgrad(features, grad_output, pair_table):
    kernel_volume, num_out = pair_table.shape
    grad_weight = np.zeros((kernel_volume, features.shape[1]))
    for k in range(kernel_volume):
        for i in range(num_out):
            j = pair_table[k, i]
            if j >= 0:
                grad_weight[k] += features[j] * grad_output[i]
    return grad_weight


def random_operands(kernel_map, seed: int):
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((kernel_map.num_in, CHANNELS))
    weight = rng.standard_normal((kernel_map.kernel_volume, CHANNELS))
    grad_output = rng.standard_normal((kernel_map.num_out, CHANNELS))
    return features, weight, grad_output


@pytest.fixture(scope="module")
def explicit():
    return get_algorithm("explicit", DEPTHWISE)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("spatial_dims", [2, 3])
@pytest.mark.parametrize("kind", ["submanifold", "strided", "transposed"])
def test_explicit_matches_brute_force(explicit, kind, spatial_dims, seed):
    kernel_map = build_map(kind, random_coordinates(spatial_dims, seed))
    table = kernel_map.pair_table
    # Some row gathers or feeds more than one pair, so the sums are not a mere relabelling.
    assert max(np.count_nonzero(t >= 0, axis=0).max() for t in (table, kernel_map.reversed().pair_table)) > 1
    features, weight, grad_output = random_operands(kernel_map, seed)

    out = explicit.forward(features, weight, kernel_map)
    grad_input = explicit.dgrad(grad_output, weight, kernel_map)
    grad_weight = explicit.wgrad(features, grad_output, kernel_map)

    assert out.shape == (kernel_map.num_out, CHANNELS) and out.dtype == np.float64
    assert grad_input.shape == (kernel_map.num_in, CHANNELS) and grad_input.dtype == np.float64
    assert grad_weight.shape == (kernel_map.kernel_volume, CHANNELS) and grad_weight.dtype == np.float64
    np.testing.assert_allclose(out, reference_forward(features, weight, table), rtol=1e-10)
    np.testing.assert_allclose(grad_input, reference_dgrad(grad_output, weight, table, kernel_map.num_in), rtol=1e-10)
    np.testing.assert_allclose(grad_weight, reference_wgrad(features, grad_output, table), rtol=1e-10)


def test_offsets_without_pairs_get_zero_weight_gradient(explicit):
    """A strided map over a single voxel: only one offset reaches it, the other weights see nothing."""
    kernel_map = build_map("strided", np.array([[0, 3, -5, 1]], dtype=np.int32))
    features, _, grad_output = random_operands(kernel_map, 2)
    grad_weight = explicit.wgrad(features, grad_output, kernel_map)
    paired = (kernel_map.pair_table >= 0).any(axis=1)
    assert paired.sum() == 1
    np.testing.assert_array_equal(grad_weight[~paired], 0.0)
    np.testing.assert_allclose(grad_weight[paired], features * grad_output, rtol=1e-10)


@pytest.mark.parametrize("spatial_dims", [2, 3])
def test_empty_input(explicit, spatial_dims):
    kernel_map = submanifold_map(np.zeros((0, 1 + spatial_dims), dtype=np.int32), 3)
    features, weight, grad_output = random_operands(kernel_map, 3)
    assert explicit.forward(features, weight, kernel_map).shape == (0, CHANNELS)
    assert explicit.dgrad(grad_output, weight, kernel_map).shape == (0, CHANNELS)
    grad_weight = explicit.wgrad(features, grad_output, kernel_map)
    assert grad_weight.shape == (3**spatial_dims, CHANNELS) and grad_weight.dtype == np.float64
    np.testing.assert_array_equal(grad_weight, 0.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_lower_precision_keeps_dtype_and_accumulates_in_fp32(explicit, dtype):
    """Inputs are rounded to `dtype` first; each result, in `dtype`, is then the fp64 result on those
    rounded inputs up to one rounding to `dtype` plus the error bound of an fp32 sum, (n - 1)·u·Σ|terms|.
    Summing in fp16 or bf16 instead would exceed it."""
    kernel_map = build_map("submanifold", random_coordinates(3, 4))
    features, weight, grad_output = (a.astype(dtype) for a in random_operands(kernel_map, 4))
    x, w, dy = (a.astype(np.float64) for a in (features, weight, grad_output))
    table, num_in = kernel_map.pair_table, kernel_map.num_in
    phases = {
        "forward": (explicit.forward(features, weight, kernel_map), lambda x, w, dy: reference_forward(x, w, table)),
        "dgrad": (
            explicit.dgrad(grad_output, weight, kernel_map),
            lambda x, w, dy: reference_dgrad(dy, w, table, num_in),
        ),
        "wgrad": (explicit.wgrad(features, grad_output, kernel_map), lambda x, w, dy: reference_wgrad(x, dy, table)),
    }
    max_terms = max(kernel_map.kernel_volume, kernel_map.num_out)
    fp32_roundoff = float(ml_dtypes.finfo(np.float32).eps) / 2
    roundoff = float(ml_dtypes.finfo(dtype).eps) / 2
    for phase, (result, reference) in phases.items():
        assert result.dtype == np.dtype(dtype), phase
        exact = reference(x, w, dy)
        terms_magnitude = reference(np.abs(x), np.abs(w), np.abs(dy))
        bound = roundoff * np.abs(exact) + (max_terms - 1) * fp32_roundoff * terms_magnitude
        error = np.abs(result.astype(np.float64) - exact)
        assert (error <= bound).all(), f"{phase}: worst error / bound {np.max(error / np.maximum(bound, 1e-300)):.3g}"
