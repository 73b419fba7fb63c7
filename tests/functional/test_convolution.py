"""Sparse convolutions on the CPU against a dense NumPy convolution read at the active sites.

Every kind (submanifold, strided, transposed, generative), output and both gradients, in fp64,
with batch > 1, negative coordinates, D = 2 and 3, kernel sizes 1/2/3/5 and dilation 2; depthwise
likewise. Also the functional API's argument handling and errors.
"""

from dataclasses import dataclass

import numpy as np
import pytest

from cupysparse.functional import convolution as functional
from cupysparse.tuning.search_space import (
    SPARSE_CONV_BWD_ALGO_MODE,
    SPARSE_CONV_FWD_ALGO_MODE,
    SPARSE_DEPTHWISE_CONV_FWD_ALGO_MODE,
    parse_algorithm_filter,
)
from cupysparse.algorithms import CONV, DEPTHWISE, registered
from cupysparse.geometry.sparse_tensor import SparseTensor
from references import (
    Grid,
    conv_gather,
    conv_scatter,
    conv_weight_grad,
    depthwise_gather,
    depthwise_scatter,
    depthwise_weight_grad,
    offsets,
)
from tolerances import assert_close


def random_coordinates(dims: int, side: int, batch_size: int, density: float, seed: int) -> np.ndarray:
    """Unique voxels in a box [-side/2, side/2)^D per batch item, every batch item non-empty."""
    rng = np.random.default_rng(seed)
    rows = []
    for batch in range(batch_size):
        cells = np.argwhere(rng.random((side,) * dims) < density) - side // 2
        cells = cells if len(cells) else np.zeros((1, dims), dtype=np.int64)
        rows.append(np.concatenate([np.full((len(cells), 1), batch), cells], axis=1))
    return np.concatenate(rows).astype(np.int32)


def tuples(coords) -> set:
    return {tuple(int(v) for v in row) for row in coords}


@dataclass(frozen=True)
class Case:
    kind: str  # submanifold | strided | transposed | generative
    dims: int
    kernel_size: tuple
    stride: int = 1
    dilation: int = 1

    def __str__(self):
        size = "x".join(map(str, self.kernel_size))
        return f"{self.kind}-D{self.dims}-k{size}-s{self.stride}-d{self.dilation}"


def cube(size, dims):
    return (size,) * dims


CASES = [
    *(Case("submanifold", 3, cube(k, 3)) for k in (1, 2, 3, 5)),
    Case("submanifold", 2, cube(3, 2)),
    Case("submanifold", 2, cube(5, 2), dilation=2),
    Case("submanifold", 3, cube(3, 3), dilation=2),
    Case("submanifold", 3, (3, 1, 2)),
    Case("strided", 3, cube(2, 3), stride=2),
    Case("strided", 3, cube(3, 3), stride=2),
    Case("strided", 3, cube(1, 3), stride=2),
    Case("strided", 2, cube(3, 2), stride=2),
    Case("strided", 2, cube(5, 2), stride=3, dilation=2),
    Case("transposed", 3, cube(2, 3), stride=2),
    Case("transposed", 3, cube(3, 3), stride=2),
    Case("transposed", 2, cube(3, 2), stride=2, dilation=2),
    Case("generative", 3, cube(2, 3), stride=2),
    Case("generative", 3, cube(3, 3), stride=2),
    Case("generative", 2, cube(3, 2), stride=1),
]


def sparse_input(case: Case, channels: int, seed: int) -> SparseTensor:
    side = 7 if case.dims == 3 else 12
    coords = random_coordinates(case.dims, side, batch_size=2, density=0.3, seed=seed)
    features = np.random.default_rng(seed + 1).standard_normal((len(coords), channels))
    # A generative transposed convolution creates coordinates at the finer tensor stride.
    tensor = SparseTensor(coords, features, tensor_stride=case.stride if case.kind == "generative" else 1)
    if case.kind == "transposed":
        # A transposed convolution returns to coordinates the input was downsampled from.
        coarse = tensor.kernel_map(case.stride, case.stride)
        features = np.random.default_rng(seed + 2).standard_normal((len(coarse.out_coordinates), channels))
        return SparseTensor(
            coarse.out_coordinates, features, coarse.out_tensor_stride, validate=False, map_cache=coarse.out_map_cache
        )
    return tensor


def expected_out_coordinates(case: Case, tensor: SparseTensor) -> set:
    coords = tensor.coordinates.astype(np.int64)
    if case.kind == "submanifold":
        return tuples(coords)
    if case.kind == "strided":
        return tuples(np.concatenate([coords[:, :1], np.floor_divide(coords[:, 1:], case.stride)], axis=1))
    if case.kind == "transposed":
        return tuples(tensor.map_cache.coordinates(tuple(t // case.stride for t in tensor.tensor_stride)))
    shifts = offsets(case.kernel_size) * case.dilation
    reachable = coords[:, None, 1:] * case.stride + shifts[None]
    batch = np.broadcast_to(coords[:, None, :1], reachable.shape[:2] + (1,))
    return tuples(np.concatenate([batch, reachable], axis=2).reshape(-1, 1 + case.dims))


def conv(case: Case, tensor, weight, **kwargs):
    return functional.spatially_sparse_conv(
        tensor, weight, case.kernel_size, case.stride, case.dilation,
        transposed=case.kind in ("transposed", "generative"), generative=case.kind == "generative", **kwargs,
    )


def conv_backward(case: Case, grad, tensor, weight, **kwargs):
    return functional.spatially_sparse_conv_backward(
        grad, tensor, weight, case.kernel_size, case.stride, case.dilation,
        transposed=case.kind in ("transposed", "generative"), generative=case.kind == "generative", **kwargs,
    )


def references(case: Case, tensor, out_coords, weight, grad):
    """(output, input gradient, weight gradient) from the dense convolution, read at active sites."""
    batch_size = tensor.batch_size
    stride, dilation = (case.stride,) * case.dims, (case.dilation,) * case.dims
    if case.kind in ("submanifold", "strided"):
        fine_coords, coarse_coords = tensor.coordinates, out_coords
    else:
        fine_coords, coarse_coords = out_coords, tensor.coordinates
    fine = Grid.covering(batch_size, fine_coords)
    coarse = Grid.covering(batch_size, coarse_coords)
    if case.kind in ("submanifold", "strided"):
        x = fine.scatter(fine_coords, tensor.features)
        g = coarse.scatter(coarse_coords, grad)
        out = coarse.read(conv_gather(x, fine, coarse, weight, case.kernel_size, stride, dilation), coarse_coords)
        grad_in = fine.read(conv_scatter(g, fine, coarse, weight, case.kernel_size, stride, dilation), fine_coords)
        grad_weight = conv_weight_grad(x, g, fine, coarse, case.kernel_size, stride, dilation)
        return out, grad_in, grad_weight
    # Transposed: the coarse input scatters to the fine output, i.e. the adjoint of a strided gather.
    x = coarse.scatter(coarse_coords, tensor.features)
    g = fine.scatter(fine_coords, grad)
    flipped = weight.transpose(0, 2, 1)
    out = fine.read(conv_scatter(x, fine, coarse, flipped, case.kernel_size, stride, dilation), fine_coords)
    grad_in = coarse.read(conv_gather(g, fine, coarse, flipped, case.kernel_size, stride, dilation), coarse_coords)
    grad_weight = conv_weight_grad(g, x, fine, coarse, case.kernel_size, stride, dilation).transpose(0, 2, 1)
    return out, grad_in, grad_weight


@pytest.mark.parametrize("case", CASES, ids=str)
def test_convolution_equals_dense_reference(case):
    tensor = sparse_input(case, channels=3, seed=len(str(case)))
    volume = int(np.prod(case.kernel_size))
    rng = np.random.default_rng(11)
    weight = rng.standard_normal((volume, 3, 4))
    out = conv(case, tensor, weight)
    assert tuples(out.coordinates) == expected_out_coordinates(case, tensor)
    assert len(tuples(out.coordinates)) == len(out.coordinates)
    grad = rng.standard_normal(out.features.shape)
    gradients = conv_backward(case, grad, tensor, weight)
    expected_out, expected_grad_in, expected_grad_weight = references(case, tensor, out.coordinates, weight, grad)
    assert np.abs(expected_out).max() > 0
    np.testing.assert_allclose(out.features, expected_out, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(gradients.input, expected_grad_in, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(gradients.weight, expected_grad_weight, rtol=1e-10, atol=1e-10)
    assert gradients.bias is None


def test_bias_is_added_and_its_gradient_is_the_column_sum():
    case = Case("submanifold", 3, cube(3, 3))
    tensor = sparse_input(case, channels=3, seed=1)
    weight = np.random.default_rng(2).standard_normal((27, 3, 5))
    bias = np.arange(5, dtype=np.float64)
    plain = conv(case, tensor, weight)
    biased = conv(case, tensor, weight, bias=bias)
    np.testing.assert_allclose(biased.features, plain.features + bias)
    grad = np.random.default_rng(3).standard_normal(plain.features.shape)
    gradients = conv_backward(case, grad, tensor, weight, bias=bias)
    np.testing.assert_allclose(gradients.bias, grad.sum(axis=0))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"])
def test_lower_precisions_match_fp64_on_the_cpu(dtype):
    dtype = np.dtype(dtype)
    case = Case("submanifold", 3, cube(3, 3))
    tensor = sparse_input(case, channels=8, seed=4)
    weight = np.random.default_rng(5).standard_normal((27, 8, 6))
    x_low, w_low = tensor.features.astype(dtype), weight.astype(dtype)
    low = conv(case, tensor.replace_features(x_low), w_low)
    exact = conv(case, tensor.replace_features(x_low.astype(np.float64)), w_low.astype(np.float64))
    assert low.features.dtype == dtype
    assert_close(low.features, exact.features, dtype, 27 * 8, x_low, w_low, "forward")


@pytest.mark.parametrize("kind", ["submanifold", "strided", "transposed"])
def test_empty_input_gives_empty_output_and_gradients(kind):
    case = Case(kind, 3, cube(3, 3), stride=1 if kind == "submanifold" else 2)
    coords = np.zeros((0, 4), dtype=np.int32)
    tensor = SparseTensor(coords, np.zeros((0, 3)))
    if kind == "transposed":
        coarse = tensor.kernel_map(2, 2)
        tensor = SparseTensor(coarse.out_coordinates, np.zeros((0, 3)), coarse.out_tensor_stride,
                              validate=False, map_cache=coarse.out_map_cache)
    weight = np.ones((27, 3, 2))
    out = conv(case, tensor, weight)
    assert out.features.shape == (0, 2)
    gradients = conv_backward(case, np.zeros((0, 2)), tensor, weight)
    assert gradients.input.shape == (0, 3)
    np.testing.assert_array_equal(gradients.weight, np.zeros((27, 3, 2)))


def test_one_voxel_submanifold_uses_only_the_centre_weight():
    tensor = SparseTensor(np.array([[0, 5, -3, 2]], np.int32), np.array([[1.0, 2.0]]))
    weight = np.random.default_rng(0).standard_normal((27, 2, 3))
    out = functional.spatially_sparse_conv(tensor, weight, 3)
    np.testing.assert_allclose(out.features, tensor.features @ weight[13])


def test_adjoint_identity_holds_for_a_strided_convolution():
    case = Case("strided", 3, cube(3, 3), stride=2)
    tensor = sparse_input(case, channels=4, seed=9)
    weight = np.random.default_rng(1).standard_normal((27, 4, 2))
    out = conv(case, tensor, weight)
    grad = np.random.default_rng(2).standard_normal(out.features.shape)
    gradients = conv_backward(case, grad, tensor, weight)
    np.testing.assert_allclose(np.vdot(grad, out.features), np.vdot(gradients.input, tensor.features))
    np.testing.assert_allclose(np.vdot(grad, out.features), np.vdot(gradients.weight, weight))


DEPTHWISE_CASES = [
    Case("submanifold", 3, cube(3, 3)),
    Case("submanifold", 2, cube(5, 2), dilation=2),
    Case("strided", 3, cube(2, 3), stride=2),
    Case("strided", 2, cube(3, 2), stride=2),
]


@pytest.mark.parametrize("case", DEPTHWISE_CASES, ids=str)
def test_depthwise_equals_dense_reference(case):
    tensor = sparse_input(case, channels=5, seed=3)
    result = tensor.kernel_map(case.kernel_size, case.stride, case.dilation)
    rng = np.random.default_rng(4)
    weight = rng.standard_normal((result.kernel_map.kernel_volume, 5))
    out = functional.spatially_sparse_depthwise_conv(
        tensor.features, weight, result.kernel_map, len(result.out_coordinates)
    )
    grad = rng.standard_normal(out.shape)
    grad_in, grad_weight = functional.spatially_sparse_depthwise_conv_backward(
        grad, tensor.features, weight, result.kernel_map
    )
    stride, dilation = (case.stride,) * case.dims, (case.dilation,) * case.dims
    fine = Grid.covering(tensor.batch_size, tensor.coordinates)
    coarse = Grid.covering(tensor.batch_size, result.out_coordinates)
    x = fine.scatter(tensor.coordinates, tensor.features)
    g = coarse.scatter(result.out_coordinates, grad)
    expected = coarse.read(depthwise_gather(x, fine, coarse, weight, case.kernel_size, stride, dilation),
                           result.out_coordinates)
    expected_grad_in = fine.read(depthwise_scatter(g, fine, coarse, weight, case.kernel_size, stride, dilation),
                                 tensor.coordinates)
    expected_grad_weight = depthwise_weight_grad(x, g, fine, coarse, case.kernel_size, stride, dilation)
    np.testing.assert_allclose(out, expected, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(grad_in, expected_grad_in, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(grad_weight, expected_grad_weight, rtol=1e-10, atol=1e-10)


# --- algorithm arguments ---------------------------------------------------------------------


def test_enums_name_registered_algorithms():
    for enum_type, kind in ((SPARSE_CONV_FWD_ALGO_MODE, CONV), (SPARSE_CONV_BWD_ALGO_MODE, CONV),
                            (SPARSE_DEPTHWISE_CONV_FWD_ALGO_MODE, DEPTHWISE)):
        names = {member.value for member in enum_type} - {"auto"}
        assert names == set(registered(kind))


@pytest.mark.parametrize(
    ("value", "mode", "names"),
    [
        (None, "auto", ()),
        ("auto", "auto", ()),
        ("ALL", "all", ()),
        ("explicit_gemm", "names", ("explicit_gemm",)),
        (SPARSE_CONV_FWD_ALGO_MODE.IMPLICIT_GEMM, "names", ("implicit_gemm",)),
        ("[implicit_gemm, explicit_gemm]", "names", ("implicit_gemm", "explicit_gemm")),
        ([SPARSE_CONV_FWD_ALGO_MODE.WMMA_IMPLICIT_GEMM, "explicit_gemm"], "names",
         ("wmma_implicit_gemm", "explicit_gemm")),
    ],
)
def test_algorithm_arguments_parse(value, mode, names, monkeypatch):
    monkeypatch.delenv("CUPYSPARSE_FWD_ALGO_MODE", raising=False)
    parsed = parse_algorithm_filter(value, CONV, "forward")
    assert (parsed.mode, parsed.names) == (mode, names)


def test_environment_variable_is_read_when_the_argument_is_none(monkeypatch):
    monkeypatch.setenv("CUPYSPARSE_BWD_ALGO_MODE", "[explicit_gemm,implicit_gemm]")
    parsed = parse_algorithm_filter(None, CONV, "backward")
    assert parsed.names == ("explicit_gemm", "implicit_gemm")
    monkeypatch.setenv("CUPYSPARSE_DEPTHWISE_CONV_FWD_ALGO_MODE", "implicit")
    assert parse_algorithm_filter(None, DEPTHWISE, "forward").names == ("implicit",)


@pytest.mark.parametrize("value", ["explicit_gem", ["explicit_gemm", "wmma"], "[]", 3])
def test_bad_algorithm_arguments_raise_and_list_the_choices(value):
    with pytest.raises((ValueError, TypeError)) as error:
        parse_algorithm_filter(value, CONV, "forward")
    if isinstance(error.value, ValueError):
        assert "explicit_gemm" in str(error.value) and "auto" in str(error.value)


def test_a_typo_in_the_environment_variable_names_the_variable(monkeypatch):
    monkeypatch.setenv("CUPYSPARSE_FWD_ALGO_MODE", "implicit_gemmm")
    with pytest.raises(ValueError, match="CUPYSPARSE_FWD_ALGO_MODE"):
        parse_algorithm_filter(None, CONV, "forward")


def test_a_gpu_algorithm_on_cpu_data_is_a_clear_error():
    tensor = sparse_input(Case("submanifold", 3, cube(3, 3)), channels=3, seed=0)
    weight = np.ones((27, 3, 2))
    with pytest.raises(ValueError, match=r"implicit_gemm.*Valid choices here: \['explicit_gemm'\]"):
        functional.spatially_sparse_conv(tensor, weight, 3, fwd_algo="implicit_gemm")
    out = functional.spatially_sparse_conv(tensor, weight, 3, fwd_algo=["implicit_gemm", "explicit_gemm"])
    assert out.features.shape == (tensor.num_points, 2)


@pytest.mark.parametrize("kind", [CONV, DEPTHWISE])
def test_raw_kernels_refuse_more_offsets_than_grid_z_holds_and_the_explicit_ones_take_them(kind):
    """The raw kernels' weight gradients put offsets on grid z (at most 65535 slices)."""
    from cupysparse.algorithms import ConvProblem

    for kernel_volume, refused in ((65535, False), (65536, True)):
        problem = ConvProblem(10, 10, 8, 8, kernel_volume, np.dtype(np.float16), "cuda", 90)
        for name, algorithm in registered(kind).items():
            reason = algorithm.unsupported_reason(problem)
            if name.startswith("explicit"):
                assert reason is None
            elif refused:
                assert "at most 65535 kernel offsets" in reason, name
            else:
                assert reason is None, name


@pytest.mark.parametrize(
    ("weight_shape", "dtype", "error", "match"),
    [
        ((26, 3, 2), np.float64, ValueError, "kernel offsets"),
        ((27, 4, 2), np.float64, ValueError, "input channels"),
        ((27, 3), np.float64, ValueError, r"\[K, C_in, C_out\]"),
        ((27, 3, 2), np.float32, TypeError, "dtype"),
    ],
)
def test_bad_weights_raise(weight_shape, dtype, error, match):
    tensor = sparse_input(Case("submanifold", 3, cube(3, 3)), channels=3, seed=0)
    with pytest.raises(error, match=match):
        functional.spatially_sparse_conv(tensor, np.ones(weight_shape, dtype), 3)


def test_bad_bias_and_input_raise():
    tensor = sparse_input(Case("submanifold", 3, cube(3, 3)), channels=3, seed=0)
    weight = np.ones((27, 3, 2))
    with pytest.raises(ValueError, match="bias"):
        functional.spatially_sparse_conv(tensor, weight, 3, bias=np.ones(3))
    with pytest.raises(TypeError, match="SparseTensor"):
        functional.spatially_sparse_conv(tensor.features, weight, 3)
    with pytest.raises(ValueError, match="generative"):
        functional.spatially_sparse_conv(tensor, weight, 3, stride=2, generative=True)


def test_wmma_weight_is_padded_only_when_its_channels_are_not_multiples_of_16():
    from cupysparse.algorithms.tensor_core.common import PaddedWeight

    aligned = np.random.default_rng(0).standard_normal((27, 32, 48)).astype(np.float16)
    assert PaddedWeight(aligned).padded is aligned
    assert PaddedWeight(np.asfortranarray(aligned)).padded.flags.c_contiguous
    ragged = aligned[:, :19, :33]
    padded = PaddedWeight(ragged).padded
    assert padded.shape == (27, 32, 48)
    np.testing.assert_array_equal(padded[:, :19, :33], ragged)
    assert not padded[:, 19:, :].any() and not padded[:, :, 33:].any()
