"""TF32 on the GPU (`pytest -m gpu`): fp32 features through mma_implicit_gemm's m16n8k8 kernels.

The kernels round every operand to TF32 (to nearest, ties away from zero) and sum in fp32. So the
reference is the fp64 convolution of the inputs rounded the same way in NumPy, and the result must
match it within the fp32 bounds: what is left is fp32 accumulation. A kernel that read an operand
unrounded, truncated it, or took a wrong fragment element fails.
"""

import numpy as np
import pytest

from cupysparse.algorithms import ConvProblem, get_algorithm
from cupysparse.backend import cupy_module, gpu_available
from cupysparse.dtypes import FLOAT32
from cupysparse.precision import fp32_precision
from test_conv_algorithms_gpu import (
    CHANNELS,
    MAP_KINDS,
    PHASES,
    _coordinates,
    _gpu_map,
    _inputs,
    _planned_phases,
    gpu_map,
    reference_phase,
    run_phase,
)
from tolerances import assert_close

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")]

NAME = "mma_implicit_gemm"


def _runs_tf32() -> bool:
    if not gpu_available():
        return False
    problem = ConvProblem(100, 100, 16, 16, 27, FLOAT32, "cuda",
                          int(cupy_module().cuda.Device().compute_capability), tf32=True)
    return get_algorithm(NAME).supports(problem)


needs_tf32 = pytest.mark.skipif(not _runs_tf32(), reason="TF32 tensor cores need sm_80 or newer")


def round_to_tf32(values: np.ndarray) -> np.ndarray:
    """fp32 values rounded to TF32's 10 mantissa bits, to nearest with ties away from zero (as
    cvt.rna.tf32.f32): half a TF32 unit added to the magnitude, the 13 low bits cleared."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def tf32_reference(phase, kernel_map, x, w, dy):
    return reference_phase(phase, kernel_map, round_to_tf32(x), round_to_tf32(w), round_to_tf32(dy))


def test_rounding_helper_rounds_to_nearest_ties_away():
    one_ulp = 2.0**-10
    values = np.array([1.0, 1.0 + one_ulp / 2, 1.0 + one_ulp / 4, -(1.0 + one_ulp / 2), 1.0 + 3 * one_ulp / 4],
                      np.float32)
    expected = np.array([1.0, 1.0 + one_ulp, 1.0, -(1.0 + one_ulp), 1.0 + one_ulp], np.float32)
    np.testing.assert_array_equal(round_to_tf32(values), expected)


@needs_tf32
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("channels", CHANNELS, ids=lambda c: f"{c[0]}to{c[1]}")
@pytest.mark.parametrize("map_kind", MAP_KINDS)
def test_tf32_phases_match_the_reference_of_rounded_inputs(map_kind, channels, phase):
    algorithm = get_algorithm(NAME)
    kernel_map = gpu_map(map_kind)
    x, w, dy = _inputs(kernel_map, *channels, FLOAT32, seed=sum(channels))
    params = algorithm.default_params("forward" if phase == "forward" else "backward")
    actual = run_phase(algorithm, phase, kernel_map, x, w, dy, params)
    expected, (terms, a, b) = tf32_reference(phase, kernel_map, x, w, dy)
    assert np.abs(expected).max() > 0
    assert_close(actual, expected, FLOAT32, terms, a, b, f"tf32 {phase}")


@needs_tf32
def test_tf32_differs_from_exact_fp32_by_the_operand_rounding():
    """The rounding is really applied: against unrounded inputs the result is off by far more than
    fp32 accumulation, and by about what TF32's 2^-11 unit roundoff predicts."""
    algorithm = get_algorithm(NAME)
    kernel_map = gpu_map("submanifold")
    x, w, dy = _inputs(kernel_map, 64, 64, FLOAT32, seed=3)
    actual = run_phase(algorithm, "forward", kernel_map, x, w, dy, algorithm.default_params("forward"))
    exact, _ = reference_phase("forward", kernel_map, x, w, dy)
    relative = np.abs(actual - exact).max() / np.abs(exact).max()
    assert 1e-5 < relative < 2.0**-9


@needs_tf32
@pytest.mark.parametrize("phase", PHASES)
def test_every_tf32_parameter_combination_is_correct(phase):
    algorithm = get_algorithm(NAME)
    kernel_map = gpu_map("submanifold")
    x, w, dy = _inputs(kernel_map, 40, 24, FLOAT32, seed=5)
    expected, (terms, a, b) = tf32_reference(phase, kernel_map, x, w, dy)
    for params in algorithm.param_grid("forward" if phase == "forward" else "backward"):
        actual = run_phase(algorithm, phase, kernel_map, x, w, dy, params)
        assert_close(actual, expected, FLOAT32, terms, a, b, f"tf32 {phase} {params}")


@needs_tf32
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("channels", ((64, 64), (24, 40), (3, 17)), ids=lambda c: f"{c[0]}to{c[1]}")
def test_tf32_launch_plans_over_two_maps(channels, misaligned):
    """The plans the adapters launch, made under TF32 from the first map's problem, over two maps of
    different sizes, into NaN-filled buffers, on aligned and misaligned rows."""
    algorithm = get_algorithm(NAME)
    maps = (gpu_map("strided"), _gpu_map("strided", _coordinates(seed=8, side=20)))
    x, w, _ = _inputs(maps[0], *channels, FLOAT32, seed=11)
    with fp32_precision("tf32"):
        problem = ConvProblem.of(cupy_module().asarray(x), maps[0], w.shape[2])
    assert problem.tf32
    forward = algorithm.forward_plan(problem, algorithm.default_params("forward"))
    backward = algorithm.backward_plan(problem, algorithm.default_params("backward"))
    for seed, kernel_map in enumerate(maps):
        x, w, dy = _inputs(kernel_map, *channels, FLOAT32, seed=11 + seed)
        results = _planned_phases(forward, backward, kernel_map, x, w, dy, misaligned)
        for phase, actual in results.items():
            expected, (terms, a, b) = tf32_reference(phase, kernel_map, x, w, dy)
            assert_close(actual, expected, FLOAT32, terms, a, b, f"tf32 planned {phase} {channels} map {seed}")


@needs_tf32
@pytest.mark.parametrize("phase", PHASES)
def test_tf32_is_bitwise_deterministic(phase):
    algorithm = get_algorithm(NAME)
    kernel_map = gpu_map("submanifold")
    x, w, dy = _inputs(kernel_map, 33, 40, FLOAT32, seed=1)
    params = algorithm.default_params("forward" if phase == "forward" else "backward")
    first = run_phase(algorithm, phase, kernel_map, x, w, dy, params)
    second = run_phase(algorithm, phase, kernel_map, x, w, dy, params)
    np.testing.assert_array_equal(first.view(np.uint8), second.view(np.uint8))


@needs_tf32
def test_the_functional_api_runs_tf32_only_when_chosen(monkeypatch):
    """Under "tf32" the tuner measures mma_implicit_gemm against the fp32 reference (with TF32's
    agreement bound) and picks it; under the default "ieee" the same call stays exact fp32."""
    from cupysparse import functional
    from cupysparse.algorithm_modes import parse_algorithm_filter
    from cupysparse.sparse_tensor import SparseTensor
    from cupysparse.tuner import select_algorithm

    monkeypatch.delenv("CUPYSPARSE_FWD_ALGO_MODE", raising=False)
    monkeypatch.delenv("CUPYSPARSE_FP32_PRECISION", raising=False)
    cupy = cupy_module()
    coords = _coordinates(seed=9, side=12)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((len(coords), 48)).astype(np.float32)
    w = (rng.standard_normal((27, 48, 32)) / 7).astype(np.float32)
    gpu_in = SparseTensor(cupy.asarray(coords), cupy.asarray(x))
    kernel_map = gpu_in.kernel_map(3).kernel_map

    with fp32_precision("tf32"):
        tf32_out = functional.spatially_sparse_conv(gpu_in, cupy.asarray(w), 3).features.get()
        problem = ConvProblem.of(gpu_in.features, kernel_map, 32)
        chosen = select_algorithm(parse_algorithm_filter(None, phase="forward"), problem).algorithm
    assert chosen.name == NAME
    exact_out = functional.spatially_sparse_conv(gpu_in, cupy.asarray(w), 3).features.get()

    rounded, (terms, a, b) = tf32_reference("forward", kernel_map, x, w, np.zeros((kernel_map.num_out, 32)))
    exact, _ = reference_phase("forward", kernel_map, x, w, np.zeros((kernel_map.num_out, 32)))
    assert_close(tf32_out, rounded, FLOAT32, terms, a, b, "tf32 through the functional API")
    assert_close(exact_out, exact, FLOAT32, terms, a, b, "exact fp32 through the functional API")
    assert np.abs(tf32_out - exact).max() > 1e-5 * np.abs(exact).max()  # exact fp32 is ~1e-7 off


@needs_tf32
def test_a_torch_layer_follows_the_precision_switch():
    """The torch adapter keeps a layer's selection, but a precision change must reach it."""
    torch = pytest.importorskip("torch")
    from cupysparse.adapters import torch as cst

    coords = _coordinates(seed=4, side=12)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((len(coords), 32)).astype(np.float32)
    conv = cst.SubMConv3d(32, 48, 3, bias=False).cuda()
    w = conv.weight.detach().cpu().numpy()
    tensor = cst.SparseTensor(torch.from_numpy(coords).cuda(), torch.from_numpy(x).cuda())
    kernel_map = _gpu_map("submanifold", coords)
    dy = np.zeros((kernel_map.num_out, 48))
    rounded, (terms, a, b) = tf32_reference("forward", kernel_map, x, w, dy)
    exact, _ = reference_phase("forward", kernel_map, x, w, dy)
    with torch.no_grad():
        first_exact = conv(tensor).features.cpu().numpy()
        with fp32_precision("tf32"):
            tf32_out = conv(tensor).features.cpu().numpy()
        second_exact = conv(tensor).features.cpu().numpy()
    assert_close(first_exact, exact, FLOAT32, terms, a, b, "torch, exact fp32")
    assert_close(tf32_out, rounded, FLOAT32, terms, a, b, "torch, tf32")
    assert_close(second_exact, exact, FLOAT32, terms, a, b, "torch, exact fp32 again")
