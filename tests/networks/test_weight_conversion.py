"""Weight converters against dense references.

A torch- or spconv-layout weight drives a dense NumPy cross-correlation (or transposed convolution)
written here from the layouts' definitions; the converted cupysparse weight drives a sparse
convolution on every voxel of the same grid, computed by a plain loop over the library's pair
table (no convolution algorithm of the library). The two must agree at every voxel. When torch
is importable, torch.nn.functional's convolutions are checked against the sparse loop too.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cupysparse.geometry.coords import kernel_offsets
from cupysparse.cuda.dtypes import BFLOAT16
from cupysparse.geometry.kernel_map import strided_map, submanifold_map, transposed_map
from cupysparse.networks.weight_layouts import (
    from_spconv_weight,
    from_torch_conv_transpose_weight,
    from_torch_conv_weight,
    to_spconv_weight,
    to_torch_conv_transpose_weight,
    to_torch_conv_weight,
)

BATCH_SIZE = 2
IN_CHANNELS = 3
OUT_CHANNELS = 4
GRID_SHAPE = {2: (5, 6), 3: (4, 5, 3)}  # odd and even sides, no two equal: axis mix-ups show


def kernel_indices(kernel_size):
    """Every kernel index tuple d, the first axis slowest."""
    return list(itertools.product(*(range(n) for n in kernel_size)))


def centre(kernel_size):
    """Per axis, the kernel index of offset 0: (n - 1) // 2."""
    return tuple((n - 1) // 2 for n in kernel_size)


def grid_voxels(shape, rng):
    """Every voxel of the box [0, shape) in each batch item, rows shuffled."""
    cells = np.argwhere(np.ones(shape, dtype=bool))
    coords = np.concatenate([np.column_stack([np.full(len(cells), b), cells]) for b in range(BATCH_SIZE)])
    return coords[rng.permutation(len(coords))].astype(np.int32)


def read(dense, coords):
    """dense [B, C, *shape] at coords [N, 1 + D] → [N, C]."""
    return dense[(coords[:, 0], slice(None), *coords[:, 1:].T)]


def dense_correlation(x, tap, kernel_size, stride, dilation, out_shape):
    """out[b, :, q] = Σ_d tap(d) · x[b, :, q·stride + dilation·(d - centre)], zero outside x.
    `tap(d)` is the [C_out, C_in] matrix of kernel index d."""
    margin = stride * max(out_shape) + dilation * max(kernel_size)
    padded = np.pad(x, [(0, 0), (0, 0)] + [(margin, margin)] * len(out_shape))
    out = 0
    for d in kernel_indices(kernel_size):
        window = tuple(
            slice(start, start + stride * (size - 1) + 1, stride)
            for start, size in ((margin + dilation * (di - ci), size) for di, ci, size in zip(d, centre(kernel_size), out_shape))
        )
        out = out + np.einsum("oi,bi...->bo...", tap(d), padded[(slice(None), slice(None), *window)])
    return out


def dense_transposed(x, tap, kernel_size, stride, dilation, out_shape):
    """out[b, :, q·stride + dilation·(d - centre)] += tap(d) · x[b, :, q], cropped to [0, out_shape)."""
    in_shape = x.shape[2:]
    margin = stride * max(in_shape) + dilation * max(kernel_size)
    out = np.zeros((x.shape[0], tap(centre(kernel_size)).shape[0], *(s + 2 * margin for s in out_shape)))
    for d in kernel_indices(kernel_size):
        window = tuple(
            slice(margin + dilation * (di - ci), margin + dilation * (di - ci) + stride * (size - 1) + 1, stride)
            for di, ci, size in zip(d, centre(kernel_size), in_shape)
        )
        out[(slice(None), slice(None), *window)] += np.einsum("oi,bi...->bo...", tap(d), x)
    return out[(slice(None), slice(None), *(slice(margin, margin + s) for s in out_shape))]


def sparse_apply(features, weight, pair_table):
    """out[i] = Σ_k features[table[k, i]] · W_k over the valid pairs: a plain loop over the table."""
    out = np.zeros((pair_table.shape[1], weight.shape[2]))
    for k, rows in enumerate(pair_table):
        valid = rows >= 0
        out[valid] += features[rows[valid]] @ weight[k]
    return out


def conv_cases():
    cases = []
    for kernel_size in ((3, 3), (2, 2), (4, 4), (3, 2), (1, 4)):
        cases += [(kernel_size, 1, 1), (kernel_size, 1, 2)]
    for kernel_size in ((2, 2), (3, 3), (2, 3)):
        cases += [(kernel_size, 2, 1)]
    for kernel_size in ((3, 3, 3), (2, 2, 2), (4, 3, 2)):
        cases += [(kernel_size, 1, 1), (kernel_size, 1, 2), (kernel_size, 2, 1)]
    return cases


def transposed_cases():
    cases = [((2, 2), 2, 1), ((3, 3), 2, 1), ((4, 4), 2, 1), ((3, 2), 2, 1), ((3, 3), 2, 2)]
    return cases + [((2, 2, 2), 2, 1), ((3, 3, 3), 2, 1), ((4, 2, 3), 2, 1), ((2, 2, 2), 2, 2)]


def case_id(case):
    kernel_size, stride, dilation = case
    return f"k{'x'.join(map(str, kernel_size))}-s{stride}-d{dilation}"


class ConvProblem:
    """Dense input, every voxel of its grid, and the map of a convolution on them."""

    def __init__(self, kernel_size, stride, dilation, seed=0):
        self.rng = np.random.default_rng(seed)
        self.kernel_size, self.stride, self.dilation = kernel_size, stride, dilation
        spatial_dims = len(kernel_size)
        self.shape = GRID_SHAPE[spatial_dims]
        self.out_shape = tuple(-(-s // stride) for s in self.shape)
        self.x = self.rng.standard_normal((BATCH_SIZE, IN_CHANNELS, *self.shape))
        self.coords = grid_voxels(self.shape, self.rng)
        if stride == 1:
            self.out_coords, self.map = self.coords, submanifold_map(self.coords, kernel_size, dilation)
        else:
            self.out_coords, self.map = strided_map(self.coords, kernel_size, stride, dilation)
        # Downsampling a full box gives the full coarse box.
        assert len(self.out_coords) == BATCH_SIZE * np.prod(self.out_shape)

    def sparse(self, weight):
        return sparse_apply(read(self.x, self.coords), weight, self.map.pair_table)

    def dense(self, tap):
        out = dense_correlation(self.x, tap, self.kernel_size, self.stride, self.dilation, self.out_shape)
        return read(out, self.out_coords)


class TransposedProblem:
    """Dense coarse input, the fine grid's every voxel, and the transposed map between them."""

    def __init__(self, kernel_size, stride, dilation, seed=0):
        rng = np.random.default_rng(seed)
        self.kernel_size, self.stride, self.dilation = kernel_size, stride, dilation
        self.fine_shape = GRID_SHAPE[len(kernel_size)]
        self.fine_coords = grid_voxels(self.fine_shape, rng)
        self.coarse_coords, forward = strided_map(self.fine_coords, kernel_size, stride, dilation)
        self.map = transposed_map(forward)
        coarse_shape = tuple(-(-s // stride) for s in self.fine_shape)
        assert len(self.coarse_coords) == BATCH_SIZE * np.prod(coarse_shape)
        self.x = rng.standard_normal((BATCH_SIZE, IN_CHANNELS, *coarse_shape))

    def sparse(self, weight):
        return sparse_apply(read(self.x, self.coarse_coords), weight, self.map.pair_table)

    def dense(self, tap):
        out = dense_transposed(self.x, tap, self.kernel_size, self.stride, self.dilation, self.fine_shape)
        return read(out, self.fine_coords)


def at(d):
    """Index of kernel index tuple d in a dense weight whose kernel axes follow two channel axes."""
    return (slice(None), slice(None), *d)


# --- the layouts against dense references ------------------------------------------------------


@pytest.mark.parametrize("case", conv_cases(), ids=case_id)
def test_torch_conv_weight_matches_dense_cross_correlation(case):
    problem = ConvProblem(*case)
    torch_weight = problem.rng.standard_normal((OUT_CHANNELS, IN_CHANNELS, *problem.kernel_size))
    sparse = problem.sparse(from_torch_conv_weight(torch_weight))
    np.testing.assert_allclose(sparse, problem.dense(lambda d: torch_weight[at(d)]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", conv_cases(), ids=case_id)
def test_spconv_weight_matches_dense_cross_correlation(case):
    problem = ConvProblem(*case)
    spconv_weight = problem.rng.standard_normal((OUT_CHANNELS, *problem.kernel_size, IN_CHANNELS))
    sparse = problem.sparse(from_spconv_weight(spconv_weight))
    np.testing.assert_allclose(sparse, problem.dense(lambda d: spconv_weight[(slice(None), *d)]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", transposed_cases(), ids=case_id)
def test_torch_conv_transpose_weight_matches_dense_transposed_convolution(case):
    problem = TransposedProblem(*case)
    rng = np.random.default_rng(1)
    torch_weight = rng.standard_normal((IN_CHANNELS, OUT_CHANNELS, *problem.kernel_size))
    sparse = problem.sparse(from_torch_conv_transpose_weight(torch_weight))
    np.testing.assert_allclose(sparse, problem.dense(lambda d: torch_weight[at(d)].T), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", transposed_cases(), ids=case_id)
def test_spconv_inverse_weight_matches_dense_transposed_convolution(case):
    problem = TransposedProblem(*case)
    rng = np.random.default_rng(1)
    spconv_weight = rng.standard_normal((OUT_CHANNELS, *problem.kernel_size, IN_CHANNELS))
    sparse = problem.sparse(from_spconv_weight(spconv_weight))
    np.testing.assert_allclose(sparse, problem.dense(lambda d: spconv_weight[(slice(None), *d)]), rtol=1e-12, atol=1e-12)


def test_transposed_convolution_is_the_adjoint_of_the_strided_one():
    """<conv(x), y> = <x, conv_transpose(y)> for the same torch weight seen through both converters,
    which pins down that ConvTranspose needs no flip."""
    rng = np.random.default_rng(2)
    kernel_size = (3, 4, 2)
    weight = rng.standard_normal((OUT_CHANNELS, IN_CHANNELS, *kernel_size))  # conv: C_in → C_out
    fine = grid_voxels(GRID_SHAPE[3], rng)
    coarse, forward = strided_map(fine, kernel_size, 2)
    x = rng.standard_normal((len(fine), IN_CHANNELS))
    y = rng.standard_normal((len(coarse), OUT_CHANNELS))
    convolved = sparse_apply(x, from_torch_conv_weight(weight), forward.pair_table)
    # The same tensor as a ConvTranspose weight [C_in = OUT_CHANNELS, C_out = IN_CHANNELS, *k].
    transposed = sparse_apply(y, from_torch_conv_transpose_weight(weight), transposed_map(forward).pair_table)
    assert np.isclose(np.sum(convolved * y), np.sum(x * transposed), rtol=1e-12)


def test_layouts_index_by_index():
    """W[k, ci, co] against each layout, k enumerating kernel indices first axis slowest, with the
    library's offset of k equal to d - (n - 1) // 2 (the even-size rule included)."""
    kernel_size = (3, 2, 4)
    rng = np.random.default_rng(3)
    torch_weight = rng.standard_normal((OUT_CHANNELS, IN_CHANNELS, *kernel_size))
    transpose_weight = rng.standard_normal((IN_CHANNELS, OUT_CHANNELS, *kernel_size))
    spconv_weight = rng.standard_normal((OUT_CHANNELS, *kernel_size, IN_CHANNELS))
    ours_from_torch = from_torch_conv_weight(torch_weight)
    ours_from_transpose = from_torch_conv_transpose_weight(transpose_weight)
    ours_from_spconv = from_spconv_weight(spconv_weight)
    offsets = kernel_offsets(kernel_size)
    assert ours_from_torch.shape == ours_from_transpose.shape == ours_from_spconv.shape == (24, IN_CHANNELS, OUT_CHANNELS)
    for k, d in enumerate(kernel_indices(kernel_size)):
        assert tuple(offsets[k]) == tuple(di - ci for di, ci in zip(d, (1, 0, 1)))
        for ci, co in itertools.product(range(IN_CHANNELS), range(OUT_CHANNELS)):
            assert ours_from_torch[k, ci, co] == torch_weight[(co, ci, *d)]
            assert ours_from_transpose[k, ci, co] == transpose_weight[(ci, co, *d)]
            assert ours_from_spconv[k, ci, co] == spconv_weight[(co, *d, ci)]


# --- round trips and arguments -------------------------------------------------------------------

LAYOUTS = {
    "torch_conv": (from_torch_conv_weight, to_torch_conv_weight, lambda k: (OUT_CHANNELS, IN_CHANNELS, *k)),
    "torch_conv_transpose": (
        from_torch_conv_transpose_weight, to_torch_conv_transpose_weight, lambda k: (IN_CHANNELS, OUT_CHANNELS, *k)
    ),
    "spconv": (from_spconv_weight, to_spconv_weight, lambda k: (OUT_CHANNELS, *k, IN_CHANNELS)),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kernel_size", [(3, 3), (2, 4), (3, 3, 3), (4, 1, 2)], ids=str)
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, BFLOAT16], ids=str)
def test_round_trips_are_exact(layout, kernel_size, dtype):
    convert_from, convert_to, shape = LAYOUTS[layout]
    rng = np.random.default_rng(4)
    theirs = rng.standard_normal(shape(kernel_size)).astype(dtype)
    ours = convert_from(theirs)
    assert ours.dtype == theirs.dtype and ours.flags.c_contiguous
    assert ours.shape == (int(np.prod(kernel_size)), IN_CHANNELS, OUT_CHANNELS)
    back = convert_to(ours, kernel_size)
    assert back.shape == theirs.shape and back.dtype == theirs.dtype and back.flags.c_contiguous
    np.testing.assert_array_equal(back.astype(np.float64), theirs.astype(np.float64))
    ours_again = rng.standard_normal(ours.shape).astype(dtype)
    np.testing.assert_array_equal(
        convert_from(convert_to(ours_again, kernel_size)).astype(np.float64), ours_again.astype(np.float64)
    )


def test_results_do_not_share_memory_with_the_input():
    weight = np.zeros((1, 1, 1, 1, 1))  # every transpose of it is a no-op view
    ours = from_torch_conv_weight(weight)
    ours[0, 0, 0] = 1.0
    assert weight.sum() == 0


def test_integer_kernel_size_fixes_the_dimensions_when_it_can():
    ours = np.arange(27 * 2 * 5, dtype=np.float32).reshape(27, 2, 5)
    assert to_torch_conv_weight(ours, 3).shape == (5, 2, 3, 3, 3)
    assert to_spconv_weight(ours[:9], 3).shape == (5, 3, 3, 2)
    with pytest.raises(ValueError, match="one size per dimension"):
        to_torch_conv_weight(ours[:1], 1)  # K = 1 fits D = 2, 3 and 4


def test_invalid_arguments_are_named():
    ours = np.zeros((27, 2, 5))
    with pytest.raises(ValueError, match=r"does not give the weight's K = 27"):
        to_torch_conv_transpose_weight(ours, (3, 3))
    with pytest.raises(ValueError, match=r"\[K, C_in, C_out\]"):
        to_spconv_weight(np.zeros((27, 2)), (3, 3, 3))
    with pytest.raises(ValueError, match=r"\[C_out, C_in, \*kernel_size\]"):
        from_torch_conv_weight(np.zeros((5, 2, 3)))


def test_sequences_are_accepted_like_arrays():
    nested = np.arange(2 * 1 * 2 * 2, dtype=np.float64).reshape(2, 1, 2, 2).tolist()
    np.testing.assert_array_equal(from_torch_conv_weight(nested), from_torch_conv_weight(np.array(nested)))


# --- torch itself ---------------------------------------------------------------------------------


def torch_pad(left, right):
    """F.pad's argument: (left, right) pairs starting from the last axis."""
    return tuple(itertools.chain.from_iterable((lo, hi) for lo, hi in zip(reversed(left), reversed(right))))


@pytest.mark.parametrize("case", conv_cases(), ids=case_id)
def test_torch_conv_matches_sparse_convolution(case):
    torch = pytest.importorskip("torch")
    functional = torch.nn.functional
    problem = ConvProblem(*case)
    kernel_size, stride, dilation = case
    weight = problem.rng.standard_normal((OUT_CHANNELS, IN_CHANNELS, *kernel_size))
    left = [dilation * c for c in centre(kernel_size)]
    # Enough on the right for ceil(L / stride) outputs; torch's extra ones are cropped.
    right = [dilation * (n - 1) - lo + stride for n, lo in zip(kernel_size, left)]
    conv = functional.conv3d if len(kernel_size) == 3 else functional.conv2d
    padded = functional.pad(torch.from_numpy(problem.x), torch_pad(left, right))
    dense = conv(padded, torch.from_numpy(weight), stride=stride, dilation=dilation).numpy()
    dense = dense[(slice(None), slice(None), *(slice(0, s) for s in problem.out_shape))]
    sparse = problem.sparse(from_torch_conv_weight(weight))
    np.testing.assert_allclose(sparse, read(dense, problem.out_coords), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", transposed_cases(), ids=case_id)
def test_torch_conv_transpose_matches_sparse_transposed_convolution(case):
    torch = pytest.importorskip("torch")
    functional = torch.nn.functional
    problem = TransposedProblem(*case)
    kernel_size, stride, dilation = case
    weight = np.random.default_rng(1).standard_normal((IN_CHANNELS, OUT_CHANNELS, *kernel_size))
    conv_transpose = functional.conv_transpose3d if len(kernel_size) == 3 else functional.conv_transpose2d
    dense = conv_transpose(torch.from_numpy(problem.x), torch.from_numpy(weight), stride=stride, dilation=dilation).numpy()
    # With padding 0, torch's output index of fine coordinate f is f + dilation·centre.
    start = [dilation * c for c in centre(kernel_size)]
    dense = dense[(slice(None), slice(None), *(slice(lo, lo + s) for lo, s in zip(start, problem.fine_shape)))]
    assert dense.shape[2:] == problem.fine_shape
    sparse = problem.sparse(from_torch_conv_transpose_weight(weight))
    np.testing.assert_allclose(sparse, read(dense, problem.fine_coords), rtol=1e-10, atol=1e-10)
