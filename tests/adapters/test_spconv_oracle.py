"""spconv 2.3.8 as a second, independent oracle: the torch modules fuzzed against spconv's.

Hypothesis draws the geometry both libraries share (submanifold convolutions; strided ones whose
kernel equals their stride, which output `unique(floor(x / s))` in both; spconv's padded ones, which
output every voxel a tap reaches inside the spatial shape, ours given `padding`; the inverse of a
strided or a padded convolution, found by its indice key), 2D and 3D, coordinates with batches, channel counts around the tensor-core
tile sizes (on the GPU multiples of 8, which spconv's CUDA matrix products need), fp32 and fp16.
The same coordinates, spatial shape, features, weights and output gradients go to both libraries; the output coordinates must be equal as sets and, row by row matched through their
coordinates, the output, the input gradient and the weight gradient must agree within the sum of
the two libraries' error bounds (`tolerances.assert_agree`). Runs wherever `spconv.pytorch`
imports: its CUDA build under `pytest -m gpu` on the GPU machine; its CPU build (single-threaded)
where it is installed, outputs only, as that build has no backward. More examples:
`--hypothesis-profile deep --hypothesis-seed N`.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the fuzz suite needs hypothesis (pip install '.[test]')")
torch = pytest.importorskip("torch")
spconv = pytest.importorskip("spconv.pytorch", reason="spconv 2.x is the oracle here")
from cupysparse.adapters import torch as cst
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tolerances import assert_agree

from cupysparse.networks.weight_layouts import from_spconv_weight, to_spconv_weight

KINDS = ("submanifold", "strided", "inverse", "padded", "padded inverse")
DTYPES = ("float32", "float16")
ON_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@st.composite
def convolutions(draw, aligned: bool = False):
    """(kind, dims, kernel size, stride, dilation, coordinate rows, C_in, C_out, dtype); `aligned`: channel
    counts that are multiples of 8, the only ones spconv's CUDA matrix products take (16-byte rows)."""
    dims = draw(st.sampled_from((2, 3)))
    kind = draw(st.sampled_from(KINDS))
    padding = None
    if kind == "submanifold":  # odd sizes: even ones centre differently in the two libraries
        kernel_size = tuple(draw(st.sampled_from((1, 3, 5))) for _ in range(dims))
        stride, dilation = (1,) * dims, draw(st.integers(1, 2))
    elif kind.startswith("padded"):  # any kernel up to 3, stride up to 2, padding below the kernel
        kernel_size = tuple(draw(st.integers(1, 3)) for _ in range(dims))
        # spconv runs the inverse of a kernel of volume 1 as a matrix product on its input, which leads nowhere
        # back (`from_spconv` refuses it): a wider kernel then.
        if kind == "padded inverse" and max(kernel_size) == 1:
            kernel_size = (2, *kernel_size[1:])
        stride = tuple(draw(st.integers(1, 2)) for _ in range(dims))
        padding, dilation = tuple(draw(st.integers(0, k - 1)) for k in kernel_size), 1
    else:  # kernel = stride along each axis, at least one axis strided
        stride = tuple(draw(st.sampled_from((1, 2))) for _ in range(dims))
        stride = stride if max(stride) > 1 else (2, *stride[1:])
        kernel_size, dilation = stride, 1
    extent = draw(st.sampled_from((4, 8, 64)))  # dense neighbourhoods, or a scattered few
    row = st.tuples(st.integers(0, 2), *(st.integers(0, extent) for _ in range(dims)))
    rows = draw(st.lists(row, min_size=1, max_size=40, unique=True))
    ranks = {batch: rank for rank, batch in enumerate(sorted({r[0] for r in rows}))}  # batches 0..B-1
    rows = list(dict.fromkeys((ranks[r[0]], *r[1:]) for r in rows))
    channel = (st.sampled_from((8, 16, 24, 32, 64, 128)) if aligned
               else st.one_of(st.integers(1, 9), st.sampled_from((15, 16, 17, 32, 33, 64, 65, 128))))
    return (kind, dims, kernel_size, stride, dilation, padding, rows, draw(channel), draw(channel),
            draw(st.sampled_from(DTYPES)))


def spatial_shape(rows) -> list[int]:
    """A box holding every coordinate, even along each axis so that spconv's stride-2 output shape
    `(S - 2) // 2 + 1` holds every `floor(x / 2)`, and at least 4, so a 3-wide kernel has outputs."""
    top = np.array(rows)[:, 1:].max(axis=0) + 1
    return np.maximum(top + top % 2, 4).tolist()


def ours_modules(kind, dims, kernel_size, stride, dilation, padding, c_in, c_out):
    """(the module under test, the strided convolution before an inverse or None)."""
    suffix = f"{dims}d"
    if kind == "submanifold":
        return getattr(cst, f"SubMConv{suffix}")(c_in, c_out, kernel_size, dilation, bias=False), None
    inverse = kind.endswith("inverse")
    key = {"indice_key": "down"} if kind.startswith("padded") else {}
    strided = getattr(cst, f"SparseConv{suffix}")(c_in, c_in if inverse else c_out, kernel_size, stride,
                                                   bias=False, padding=padding, **key)
    if not inverse:
        return strided, None
    if key:
        return getattr(cst, f"SparseInverseConv{suffix}")(c_in, c_out, kernel_size, "down", bias=False), strided
    return getattr(cst, f"SparseConvTranspose{suffix}")(c_in, c_out, kernel_size, stride, bias=False), strided


def spconv_modules(kind, dims, kernel_size, stride, dilation, padding, c_in, c_out):
    """spconv's modules with its Native algorithm (gather, matrix products, scatter): its implicit
    GEMMs tune themselves on the first call of every new shape, which the fuzz's many shapes make
    take minutes, and Native is the path its CPU build has."""
    suffix, native = f"{dims}d", {"bias": False, "algo": spconv.ConvAlgo.Native}
    if kind == "submanifold":
        return getattr(spconv, f"SubMConv{suffix}")(c_in, c_out, kernel_size, dilation=dilation, **native), None
    inverse = kind.endswith("inverse")
    strided = getattr(spconv, f"SparseConv{suffix}")(c_in, c_in if inverse else c_out, kernel_size, stride=stride,
                                                      padding=padding or 0, indice_key="down", **native)
    if not inverse:
        return strided, None
    inverse = getattr(spconv, f"SparseInverseConv{suffix}")(c_in, c_out, kernel_size, indice_key="down", **native)
    return inverse, strided


def spconv_weight(weight: np.ndarray, kernel_size, module) -> np.ndarray:
    """Our `[K, C_in, C_out]` weight as `module` reads it: KRSC, except that spconv computes a 1x1
    convolution as `features @ weight.view(C_in, C_out)` (`conv1x1`), a reshape of the KRSC tensor."""
    if module.conv1x1:
        return np.ascontiguousarray(weight).reshape(module.weight.shape)
    return to_spconv_weight(weight, kernel_size)


def from_spconv_gradient(grad: np.ndarray, module) -> np.ndarray:
    return grad.reshape(1, module.in_channels, module.out_channels) if module.conv1x1 else from_spconv_weight(grad)


def rows_of(coordinates) -> list[tuple[int, ...]]:
    return [tuple(r) for r in coordinates.tolist()]


def matching(ours: list, theirs: list) -> np.ndarray:
    """`order` with `theirs[order[i]] == ours[i]`; the two must hold the same coordinates."""
    assert sorted(ours) == sorted(theirs), "the libraries' output coordinates differ"
    where = {c: i for i, c in enumerate(theirs)}
    return np.array([where[c] for c in ours], dtype=np.int64)


def run_case(case, device: str) -> None:
    kind, dims, kernel_size, stride, dilation, padding, rows, c_in, c_out, dtype_name = case
    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(len(rows) * 131 + c_in * 7 + c_out)
    coordinates = torch.tensor(rows, dtype=torch.int32, device=device)
    x = torch.tensor(rng.standard_normal((len(rows), c_in)), dtype=dtype, device=device)
    conv, strided = ours_modules(kind, dims, kernel_size, stride, dilation, padding, c_in, c_out)
    their_conv, their_strided = spconv_modules(kind, dims, kernel_size, stride, dilation, padding, c_in, c_out)
    conv, their_conv = conv.to(device, dtype), their_conv.to(device, dtype)
    weight = rng.standard_normal(tuple(conv.weight.shape))
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(weight))
        their_conv.weight.copy_(torch.from_numpy(spconv_weight(weight, kernel_size, their_conv)))

    shape = spatial_shape(rows)
    ours_in = cst.SparseTensor(coordinates, x.clone().requires_grad_(True), spatial_shape=shape)
    theirs_in = spconv.SparseConvTensor(x.clone().requires_grad_(True), coordinates, shape, len({r[0] for r in rows}))
    leaf, their_leaf, order_in = ours_in.features, theirs_in.features, None
    if kind.endswith("inverse"):  # the inverse's input: the strided convolution's coordinates, fresh leaves
        coarse = strided.to(device, dtype)(ours_in)
        # No voxel reached: spconv's CUDA build raises ("points vanished"), its modules hand an empty input
        # back as it is, where an inverse of ours still returns its strided convolution's input coordinates
        # (with zero features).
        assume(coarse.num_points > 0)
        their_coarse = their_strided.to(device, dtype)(theirs_in)
        order_in = matching(rows_of(coarse.coordinates), rows_of(their_coarse.indices))
        values = torch.tensor(rng.standard_normal((coarse.num_points, c_in)), dtype=dtype, device=device)
        leaf = values.clone().requires_grad_(True)
        their_values = torch.empty_like(values)
        their_values[torch.from_numpy(order_in).to(device)] = values
        their_leaf = their_values.requires_grad_(True)
        ours_in, theirs_in = coarse.replace_feature(leaf), their_coarse.replace_feature(their_leaf)

    out = conv(ours_in)
    # No voxel reached (a padded convolution can drop every input): spconv's CUDA build raises ("points
    # vanished") where ours returns an empty tensor.
    assume(out.num_points > 0)
    their_out = their_conv(theirs_in)
    order = matching(rows_of(out.coordinates), rows_of(their_out.indices))
    what = (f"{kind} {dims}D kernel {kernel_size} stride {stride} dilation {dilation} padding {padding}, "
            f"C {c_in}->{c_out}")
    volume = conv.weight.shape[0]
    assert_agree(host(out.features), host(their_out.features)[order], dtype_name, volume * c_in, host(leaf), weight,
                 f"output of {what}")
    if device == "cpu":
        return  # spconv's CPU build has no backward: it asks torch for a CUDA stream
    grad = torch.tensor(rng.standard_normal(tuple(out.features.shape)), dtype=dtype, device=device)
    their_grad = torch.empty_like(grad)
    their_grad[torch.from_numpy(order).to(device)] = grad
    out.features.backward(grad)
    their_out.features.backward(their_grad)
    their_input_grad = host(their_leaf.grad) if order_in is None else host(their_leaf.grad)[order_in]
    assert_agree(host(leaf.grad), their_input_grad, dtype_name, volume * c_out, host(grad), weight,
                 f"input gradient of {what}")
    assert_agree(host(conv.weight.grad), from_spconv_gradient(host(their_conv.weight.grad), their_conv), dtype_name,
                 max(leaf.shape[0], out.num_points), host(leaf), host(grad), f"weight gradient of {what}")


def host(tensor) -> np.ndarray:
    return tensor.detach().double().cpu().numpy()


@pytest.fixture(scope="module")
def single_threaded():
    """spconv's CPU build is run single-threaded (its threads and torch's would compete)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("device", ON_DEVICES)
@given(data=st.data())
def test_torch_modules_agree_with_spconv(device, single_threaded, data):
    run_case(data.draw(convolutions(aligned=device == "cuda"), label="case"), device)


def test_the_fuzzer_draws_every_kind_of_input():
    seen = set()

    @settings(max_examples=200, derandomize=True, deadline=None, database=None)
    @given(case=convolutions())
    def collect(case):
        kind, dims, kernel_size, _, _, _, rows, c_in, c_out, dtype = case
        seen.update((kind, dims, dtype))
        seen.add("1x1" if max(kernel_size) == 1 else "wider")
        seen.add("batches" if len({r[0] for r in rows}) > 1 else "one batch")
        seen.add("tile-sized" if max(c_in, c_out) >= 32 else "narrow")

    collect()
    assert seen >= {*KINDS, 2, 3, *DTYPES, "1x1", "wider", "batches", "one batch", "tile-sized", "narrow"}, seen
