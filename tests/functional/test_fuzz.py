"""Property-based fuzzing of the convolutions: either the brute-force result or a clear error.

Hypothesis draws coordinate sets (negative, at and past the edges of the key range, duplicated,
unsorted, empty, one voxel, batches with a gap), channel counts, kernel sizes, strides, dilations,
dtypes and every kind of convolution. The oracle is independent of the library: Python dicts of
coordinate tuples enumerate the pairs (`out = in·stride + dilation·offset` for gathers, the other
way for transposed scatters), from which the output, the input gradient and the weight gradient
follow as plain sums. An input the library documents as invalid (a coordinate out of range, a
missing batch, a coordinate twice, generated coordinates past the key range) must raise
ValueError; anything else must equal the oracle. CPU in CI with a fixed example count (the
Hypothesis profiles are in the tests' conftest); `pytest -m gpu` runs the same properties on CuPy
arrays and the torch modules on CUDA tensors.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the fuzz suite needs hypothesis (pip install '.[test]')")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cupysparse.functional import convolution as functional
from cupysparse.cuda.backend import to_device, to_numpy
from cupysparse.geometry.coords import key_layout
from cupysparse.cuda.dtypes import FEATURE_DTYPES, as_feature_dtype, short_name
from cupysparse.geometry.sparse_tensor import SparseTensor
from references import offsets
from tolerances import assert_close

KINDS = ("submanifold", "strided", "transposed", "generative")
DTYPES = tuple(short_name(dtype) for dtype in FEATURE_DTYPES)  # fp64, fp32, fp16 and, with ml_dtypes, bf16
ON_DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@st.composite
def convolutions(draw):
    """(kind, dims, kernel size, stride, dilation, coordinate rows, C_in, C_out, dtype)."""
    dims = draw(st.sampled_from((2, 3)))
    kind = draw(st.sampled_from(KINDS))
    kernel_size = tuple(draw(st.integers(1, 4)) for _ in range(dims))
    stride = 1 if kind == "submanifold" else draw(st.integers(1 if kind == "generative" else 2, 3))
    dilation = draw(st.integers(1, 2))
    layout = key_layout(dims)
    value = st.integers(-5, 5)  # a small box around 0, so that voxels have neighbours
    if draw(st.integers(0, 3)) == 0:  # or, in a quarter of the cases, values at the edges of the key range
        inside = (layout.coord_min, layout.coord_min + 1, layout.coord_max - 1, layout.coord_max)
        outside = (layout.coord_min - 1, layout.coord_max + 1)
        value = st.one_of(value, st.sampled_from(inside), st.sampled_from(inside + outside))
    row = st.tuples(st.integers(0, 2), *(value for _ in range(dims)))
    rows = draw(st.lists(row, max_size=24, unique=True))
    if draw(st.integers(0, 5)):  # batches 0..B-1, except in a sixth of the cases, which may have a gap
        ranks = {batch: rank for rank, batch in enumerate(sorted({r[0] for r in rows}))}
        rows = list(dict.fromkeys((ranks[r[0]], *r[1:]) for r in rows))
    if rows and draw(st.integers(0, 5)) == 0:
        rows.append(draw(st.sampled_from(rows)))  # a coordinate twice
    # Mostly narrow; sometimes around the tensor-core fragment and tile sizes, up to 513.
    channel = st.one_of(st.integers(1, 9), st.integers(1, 9), st.sampled_from((15, 16, 17, 33, 64, 65, 129, 257, 513)))
    channels = draw(channel), draw(channel)
    dtype = draw(st.sampled_from(DTYPES))
    return kind, dims, kernel_size, stride, dilation, rows, *channels, dtype


def invalid(rows, dims: int) -> bool:
    """Whether `SparseTensor` must refuse these coordinates (see `coords.validate_coordinates`)."""
    if not rows:
        return False
    layout = key_layout(dims)
    batches = {r[0] for r in rows}
    return (len(set(rows)) != len(rows) or batches != set(range(max(batches) + 1))
            or any(not layout.coord_min <= v <= layout.coord_max for r in rows for v in r[1:]))


def pairs(fine: list, coarse: list, kernel_size, stride: int, dilation: int):
    """Every (offset k, coarse row, fine row) with `fine = coarse·stride + dilation·o_k` coordinate-wise,
    the coarse rows being the outputs of a gather (submanifold, strided) and the inputs of a scatter."""
    where = {c: i for i, c in enumerate(fine)}
    found = []
    for k, offset in enumerate(offsets(kernel_size).tolist()):
        for j, c in enumerate(coarse):
            target = (c[0], *(q * stride + dilation * o for q, o in zip(c[1:], offset)))
            if target in where:
                found.append((k, j, where[target]))
    return found


def expected_coordinates(kind: str, rows: list, kernel_size, stride: int, dilation: int) -> list:
    if kind == "submanifold":
        return rows
    if kind == "strided":
        return list(dict.fromkeys((r[0], *(v // stride for v in r[1:])) for r in rows))
    shifts = offsets(kernel_size).tolist()  # generative: every site a scatter reaches
    return list(dict.fromkeys((r[0], *(v * stride + dilation * o for v, o in zip(r[1:], s)))
                              for r in rows for s in shifts))


def oracle(x, weight, grad, found, num_in: int, num_out: int, gather: bool):
    """(output, input gradient, weight gradient) as plain sums over the pairs, in float64."""
    out = np.zeros((num_out, weight.shape[2]))
    grad_in, grad_weight = np.zeros((num_in, weight.shape[1])), np.zeros(weight.shape)
    for k, coarse, fine in found:
        src, dst = (fine, coarse) if gather else (coarse, fine)
        out[dst] += x[src] @ weight[k]
        grad_in[src] += grad[dst] @ weight[k].T
        grad_weight[k] += np.outer(x[src], grad[dst])
    return out, grad_in, grad_weight


def check_gradients(actual: tuple, expected: tuple, x, weight, grad, num_pairs: int, dtype: str, what: str) -> None:
    """Output, input gradient and weight gradient against the oracle, within `tolerances`' bounds."""
    kernel_volume, c_in, c_out = weight.shape
    terms = ((kernel_volume * c_in, x, weight), (kernel_volume * c_out, grad, weight), (num_pairs, x, grad))
    for result, wanted, (num_terms, a, b), name in zip(actual, expected, terms, ("output", "input gradient",
                                                                                  "weight gradient")):
        assert_close(to_numpy(result), wanted, dtype, num_terms, a, b, f"{name} of {what}")


def run_case(case, device: str) -> None:
    kind, dims, kernel_size, stride, dilation, rows, c_in, c_out, dtype_name = case
    dtype = as_feature_dtype(dtype_name)
    rng = np.random.default_rng(len(rows) * 31 + c_in)
    coordinates = np.array(rows, dtype=np.int64).reshape(-1, 1 + dims)
    if invalid(rows, dims):  # every drawn value fits int32: the refusal is about the values
        with pytest.raises(ValueError):
            SparseTensor(to_device(coordinates.astype(np.int32), device),
                         to_device(np.zeros((len(rows), c_in), dtype), device))
        return
    # A generative transposed convolution creates coordinates at a finer tensor stride.
    fine = SparseTensor(to_device(coordinates.astype(np.int32), device),
                        to_device(rng.standard_normal((len(rows), c_in)).astype(dtype), device),
                        tensor_stride=stride if kind == "generative" else 1)
    if kind == "transposed":  # back to the coordinates a strided convolution came from
        coarse = fine.kernel_map(stride, stride)
        features = rng.standard_normal((len(coarse.out_coordinates), c_in)).astype(dtype)
        tensor = SparseTensor(coarse.out_coordinates, to_device(features, device), coarse.out_tensor_stride,
                              validate=False, map_cache=coarse.out_map_cache)
        out_rows = rows
    else:
        tensor = fine
        out_rows = expected_coordinates(kind, rows, kernel_size, stride, dilation)
    layout = key_layout(dims)
    weight = rng.standard_normal((int(np.prod(kernel_size)), c_in, c_out)).astype(dtype)
    arguments = (kernel_size, stride, dilation, kind in ("transposed", "generative"), kind == "generative")
    if kind == "generative" and any(not layout.coord_min <= v <= layout.coord_max for r in out_rows for v in r[1:]):
        with pytest.raises(ValueError, match="outside"):
            functional.spatially_sparse_conv(tensor, to_device(weight, device), *arguments)
        return
    out = functional.spatially_sparse_conv(tensor, to_device(weight, device), *arguments)
    out_coordinates = [tuple(r) for r in to_numpy(out.coordinates).tolist()]
    assert sorted(out_coordinates) == sorted(out_rows)
    in_coordinates = [tuple(r) for r in to_numpy(tensor.coordinates).tolist()]
    gather = kind in ("submanifold", "strided")
    found = (pairs(in_coordinates, out_coordinates, kernel_size, stride, dilation) if gather
             else pairs(out_coordinates, in_coordinates, kernel_size, stride, dilation))
    grad = rng.standard_normal((len(out_coordinates), c_out)).astype(dtype)
    x = to_numpy(tensor.features).astype(np.float64)
    expected = oracle(x, weight.astype(np.float64), grad.astype(np.float64), found, len(in_coordinates),
                      len(out_coordinates), gather)
    gradients = functional.spatially_sparse_conv_backward(to_device(grad, device), tensor, to_device(weight, device),
                                                          *arguments)
    check_gradients((out.features, gradients.input, gradients.weight), expected, x, weight, grad, len(found), dtype,
                    f"{kind} {kernel_size} stride {stride} dilation {dilation}")


@pytest.mark.parametrize("device", ON_DEVICES)
@given(case=convolutions())
def test_convolutions_equal_brute_force_or_raise(device, case):
    run_case(case, device)


@pytest.mark.parametrize("device", ON_DEVICES)
@given(case=convolutions())
def test_torch_modules_equal_brute_force_or_raise(device, case):
    torch = pytest.importorskip("torch")
    from cupysparse.adapters import torch as cst

    kind, dims, kernel_size, stride, dilation, rows, c_in, c_out, dtype_name = case
    if kind not in ("submanifold", "strided") or invalid(rows, dims) or not rows:
        return  # the other kinds, invalid and empty inputs are the functional test's; modules add autograd
    dtype = as_feature_dtype(dtype_name)
    torch_dtype = getattr(torch, dtype.name)
    rng = np.random.default_rng(len(rows) + c_out)
    coordinates = torch.tensor(rows, dtype=torch.int32, device=device).reshape(-1, 1 + dims)
    features = torch.tensor(rng.standard_normal((len(rows), c_in)), dtype=torch_dtype, device=device,
                            requires_grad=True)
    conv = cst.SpatiallySparseConv(c_in, c_out, kernel_size, stride, dilation, bias=False, spatial_dims=dims)
    conv = conv.to(device, torch_dtype)
    out = conv(cst.SparseTensor(coordinates, features))
    out_coordinates = [tuple(r) for r in out.coordinates.tolist()]
    assert sorted(out_coordinates) == sorted(expected_coordinates(kind, rows, kernel_size, stride, dilation))
    grad = rng.standard_normal(tuple(out.features.shape))
    out.features.backward(torch.tensor(grad, dtype=torch_dtype, device=device))
    grad = torch.tensor(grad, dtype=torch_dtype).double().numpy()  # the gradient as the layer received it
    found = pairs(rows, out_coordinates, kernel_size, stride, dilation)
    x, weight = features.detach().double().cpu().numpy(), conv.weight.detach().double().cpu().numpy()
    expected = oracle(x, weight, grad, found, len(rows), len(out_coordinates), gather=True)
    actual = tuple(t.detach().double().cpu().numpy() for t in (out.features, features.grad, conv.weight.grad))
    check_gradients(actual, expected, x, weight, grad, len(found), dtype, f"{kind} {kernel_size} stride {stride}")


def test_the_fuzzer_draws_every_kind_of_input():
    """The strategy reaches what it is meant to: each kind and dtype, invalid inputs, empty and one-voxel
    sets."""
    seen = set()

    @settings(max_examples=300, derandomize=True, deadline=None, database=None)
    @given(case=convolutions())
    def collect(case):
        kind, dims, _, _, _, rows, *_, dtype = case
        seen.update((kind, dtype))
        seen.add("invalid" if invalid(rows, dims) else "valid")
        seen.add({0: "empty", 1: "one voxel"}.get(len(set(rows)), "several"))
        if len({r[0] for r in rows}) > 1:
            seen.add("batches")

    collect()
    assert seen >= {*KINDS, *DTYPES, "invalid", "valid", "empty", "one voxel", "several", "batches"}, seen


def test_oracle_pairs_match_a_hand_computed_strided_case():
    """The oracle itself: a 2-voxel, 2x2 stride-2 gather written out by hand."""
    fine = [(0, 0, 0), (0, 1, 1)]
    coarse = [(0, 0, 0)]
    assert sorted(pairs(fine, coarse, (2, 2), 2, 1)) == [(0, 0, 0), (3, 0, 1)]
    assert list(itertools.chain.from_iterable(offsets((2, 2)).tolist())) == [0, 0, 0, 1, 1, 0, 1, 1]
