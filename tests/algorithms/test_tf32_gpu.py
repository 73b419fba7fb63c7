"""TF32 on the GPU (`pytest -m gpu`): fp32 features through mma_implicit_gemm's m16n8k8 kernels and,
on an H100, wgmma_implicit_gemm's m64nNk8 ones.

Both hand the tensor cores the fp32 values as they are, and the tensor cores ignore their 13 low
mantissa bits (truncation toward zero); the sums stay fp32. So the reference is the fp64 convolution of
the inputs truncated in NumPy, and the result must match it within the fp32 bounds: what is left is fp32
accumulation. A kernel that read an operand at full precision, rounded it to nearest, or took a wrong
fragment element fails (rounding to nearest moves a product by up to 2^-10 of itself, far more than the
bounds).
"""

import numpy as np
import pytest

from cupysparse.algorithms import ConvProblem, get_algorithm
from cupysparse.algorithms.tensor_core.wgmma import WGRAD_TILES
from cupysparse.cuda.backend import cupy_module, gpu_available
from cupysparse.cuda.dtypes import FLOAT32
from cupysparse.cuda.precision import fp32_precision
from gpu_cases import (
    CHANNELS,
    MAP_KINDS,
    PHASES,
    WGRAD_CHANNELS,
    build_gpu_map,
    coordinates,
    gpu_map,
    inputs,
    planned_phases,
    reference_phase,
    run_phase,
)
from tolerances import assert_close

pytestmark = pytest.mark.gpu

NAME = "mma_implicit_gemm"


def _tf32_problem() -> ConvProblem:
    return ConvProblem(100, 100, 16, 16, 27, FLOAT32, "cuda", int(cupy_module().cuda.Device().compute_capability),
                       tf32=True)


def _runs_tf32(name: str = NAME) -> bool:
    return gpu_available() and get_algorithm(name).supports(_tf32_problem())


needs_tf32 = pytest.mark.skipif(not _runs_tf32(), reason="TF32 tensor cores need sm_80 or newer")


def truncate_to_tf32(values: np.ndarray) -> np.ndarray:
    """fp32 values with their 13 low mantissa bits cleared: TF32 truncated toward zero."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return (bits & np.uint32(0xFFFFE000)).view(np.float32)


TF32_UNIT_ROUNDOFF = 2.0**-10  # the largest relative error of a truncated operand
TF32_ALGORITHMS = [pytest.param(name, marks=pytest.mark.skipif(not _runs_tf32(name), reason=f"{name} cannot run "
                                                               "TF32 on this GPU"))
                   for name in ("mma_implicit_gemm", "wgmma_implicit_gemm")]


def tf32_reference(phase, kernel_map, x, w, dy):
    return reference_phase(phase, kernel_map, truncate_to_tf32(x), truncate_to_tf32(w), truncate_to_tf32(dy))


def assert_tf32_forward(actual, kernel_map, x, w, dy, message):
    expected, (terms, a, b) = tf32_reference("forward", kernel_map, x, w, dy)
    assert_close(actual, expected, FLOAT32, terms, a, b, message)


def test_truncation_clears_the_low_mantissa_bits_toward_zero():
    one_ulp = 2.0**-10
    values = np.array([1.0, 1.0 + one_ulp / 2, 1.0 + one_ulp, -(1.0 + 3 * one_ulp / 4), 1.0 + 7 * one_ulp / 4],
                      np.float32)
    np.testing.assert_array_equal(truncate_to_tf32(values),
                                  np.array([1.0, 1.0, 1.0 + one_ulp, -1.0, 1.0 + one_ulp], np.float32))


@pytest.mark.parametrize("name", TF32_ALGORITHMS)
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("channels", CHANNELS, ids=lambda c: f"{c[0]}to{c[1]}")
@pytest.mark.parametrize("map_kind", MAP_KINDS)
def test_tf32_phases_match_the_reference_of_rounded_inputs(map_kind, channels, phase, name):
    algorithm = get_algorithm(name)
    kernel_map = gpu_map(map_kind)
    x, w, dy = inputs(kernel_map, *channels, FLOAT32, seed=sum(channels))
    params = algorithm.default_params("forward" if phase == "forward" else "backward")
    actual = run_phase(algorithm, phase, kernel_map, x, w, dy, params)
    expected, (terms, a, b) = tf32_reference(phase, kernel_map, x, w, dy)
    assert np.abs(expected).max() > 0
    assert_close(actual, expected, FLOAT32, terms, a, b, f"{name} tf32 {phase}")


@pytest.mark.parametrize("name", TF32_ALGORITHMS)
def test_tf32_differs_from_exact_fp32_by_the_operand_rounding(name):
    """The rounding is really applied: against unrounded inputs the result is off by far more than
    fp32 accumulation, and by about what the algorithm's TF32 unit roundoff predicts."""
    algorithm = get_algorithm(name)
    kernel_map = gpu_map("submanifold")
    x, w, dy = inputs(kernel_map, 64, 64, FLOAT32, seed=3)
    actual = run_phase(algorithm, "forward", kernel_map, x, w, dy, algorithm.default_params("forward"))
    exact, _ = reference_phase("forward", kernel_map, x, w, dy)
    relative = np.abs(actual - exact).max() / np.abs(exact).max()
    assert 1e-5 < relative < 4 * TF32_UNIT_ROUNDOFF


@pytest.mark.parametrize("name", TF32_ALGORITHMS)
@pytest.mark.parametrize("phase", PHASES)
def test_every_tf32_parameter_combination_is_correct(phase, name):
    algorithm = get_algorithm(name)
    kernel_map = gpu_map("submanifold")
    x, w, dy = inputs(kernel_map, 40, 24, FLOAT32, seed=5)
    expected, (terms, a, b) = tf32_reference(phase, kernel_map, x, w, dy)
    for params in algorithm.param_grid("forward" if phase == "forward" else "backward"):
        actual = run_phase(algorithm, phase, kernel_map, x, w, dy, params)
        assert_close(actual, expected, FLOAT32, terms, a, b, f"{name} tf32 {phase} {params}")


@pytest.mark.parametrize("name", TF32_ALGORITHMS)
@pytest.mark.parametrize("phase", ("forward", "dgrad"))
def test_every_tf32_tile_over_several_channel_stages_and_column_tiles(phase, name):
    """Channel counts that take several pipeline stages (32 fp32 channels each) and several or partial
    column tiles, at every tile and depth: the wgmma forward's transposed weight staging and both
    weight layouts across stages."""
    algorithm = get_algorithm(name)
    kernel_map = gpu_map("strided")
    grid = algorithm.param_grid("forward" if phase == "forward" else "backward")
    for channels in ((128, 256), (96, 200), (200, 96)):
        x, w, dy = inputs(kernel_map, *channels, FLOAT32, seed=channels[1])
        expected, (terms, a, b) = tf32_reference(phase, kernel_map, x, w, dy)
        for params in grid:
            if params.get("sort_rows", True) and params.get("wgrad_warps_per_sm", 32) == 32:
                actual = run_phase(algorithm, phase, kernel_map, x, w, dy, params)
                assert_close(actual, expected, FLOAT32, terms, a, b, f"{name} tf32 {phase} {channels} {params}")


@pytest.mark.skipif(not _runs_tf32("wgmma_implicit_gemm"), reason="wgmma_implicit_gemm cannot run TF32 on this GPU")
@pytest.mark.parametrize("map_kind", ("submanifold", "strided"))
@pytest.mark.parametrize("tile", WGRAD_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_every_tf32_wgmma_wgrad_tile_over_several_row_and_column_blocks(tile, map_kind):
    """wgmma_conv_wgrad_tf32 (dy transposed on its way into shared memory, x's A fragments read from its
    pair rows) at both tiles: one block of it, and several row and column blocks with partial ones,
    rows of whole 16-byte vectors or not."""
    algorithm = get_algorithm("wgmma_implicit_gemm")
    kernel_map = gpu_map(map_kind)
    for channels in WGRAD_CHANNELS[tile]:
        plan_class = algorithm.wgrad_plan_class_for(np.dtype(FLOAT32), *channels)
        assert plan_class.kernel_name(FLOAT32, tile).startswith("wgmma_conv_wgrad_tf32")
        assert plan_class.tile_for(*(-(-c // 16) * 16 for c in channels)) == tile
        x, w, dy = inputs(kernel_map, *channels, FLOAT32, seed=channels[0])
        actual = run_phase(algorithm, "wgrad", kernel_map, x, w, dy, {"wgrad_warps_per_sm": 64})
        expected, (terms, a, b) = tf32_reference("wgrad", kernel_map, x, w, dy)
        assert_close(actual, expected, FLOAT32, terms, a, b, f"wgmma tf32 wgrad {tile} {channels}")


@pytest.mark.parametrize("name", TF32_ALGORITHMS)
@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("channels", ((64, 64), (24, 40), (3, 17)), ids=lambda c: f"{c[0]}to{c[1]}")
def test_tf32_launch_plans_over_two_maps(channels, misaligned, name):
    """The plans the adapters launch, made under TF32 from the first map's problem, over two maps of
    different sizes, into NaN-filled buffers, on aligned and misaligned rows."""
    algorithm = get_algorithm(name)
    maps = (gpu_map("strided"), build_gpu_map("strided", coordinates(seed=8, side=20)))
    x, w, _ = inputs(maps[0], *channels, FLOAT32, seed=11)
    with fp32_precision("tf32"):
        problem = ConvProblem.of(cupy_module().asarray(x), maps[0], w.shape[2])
    assert problem.tf32
    forward = algorithm.forward_plan(problem, algorithm.default_params("forward"))
    backward = algorithm.backward_plan(problem, algorithm.default_params("backward"))
    for seed, kernel_map in enumerate(maps):
        x, w, dy = inputs(kernel_map, *channels, FLOAT32, seed=11 + seed)
        results = planned_phases(forward, backward, kernel_map, x, w, dy, misaligned)
        for phase, actual in results.items():
            expected, (terms, a, b) = tf32_reference(phase, kernel_map, x, w, dy)
            assert_close(actual, expected, FLOAT32, terms, a, b,
                         f"{name} tf32 planned {phase} {channels} map {seed}")


@pytest.mark.parametrize("name", TF32_ALGORITHMS)
@pytest.mark.parametrize("phase", PHASES)
def test_tf32_is_bitwise_deterministic(phase, name):
    algorithm = get_algorithm(name)
    kernel_map = gpu_map("submanifold")
    x, w, dy = inputs(kernel_map, 33, 40, FLOAT32, seed=1)
    params = algorithm.default_params("forward" if phase == "forward" else "backward")
    first = run_phase(algorithm, phase, kernel_map, x, w, dy, params)
    second = run_phase(algorithm, phase, kernel_map, x, w, dy, params)
    np.testing.assert_array_equal(first.view(np.uint8), second.view(np.uint8))


@needs_tf32
def test_the_functional_api_runs_tf32_only_when_chosen(monkeypatch):
    """Under "tf32" the tuner measures the TF32 algorithms against the fp32 reference (with TF32's
    agreement bound) and picks one; under the default "ieee" the same call stays exact fp32."""
    from cupysparse.functional import convolution as functional
    from cupysparse.geometry.sparse_tensor import SparseTensor

    monkeypatch.delenv("CUPYSPARSE_FWD_ALGO_MODE", raising=False)
    monkeypatch.delenv("CUPYSPARSE_FP32_PRECISION", raising=False)
    cupy = cupy_module()
    coords = coordinates(seed=9, side=12)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((len(coords), 48)).astype(np.float32)
    w = (rng.standard_normal((27, 48, 32)) / 7).astype(np.float32)
    gpu_in = SparseTensor(cupy.asarray(coords), cupy.asarray(x))
    kernel_map = gpu_in.kernel_map(3).kernel_map

    with fp32_precision("tf32"):
        tf32_out = functional.spatially_sparse_conv(gpu_in, cupy.asarray(w), 3).features.get()
    exact_out = functional.spatially_sparse_conv(gpu_in, cupy.asarray(w), 3).features.get()

    dy = np.zeros((kernel_map.num_out, 32))
    assert_tf32_forward(tf32_out, kernel_map, x, w, dy, "tf32 through the functional API")
    exact, (terms, a, b) = reference_phase("forward", kernel_map, x, w, dy)
    assert_close(exact_out, exact, FLOAT32, terms, a, b, "exact fp32 through the functional API")
    assert np.abs(tf32_out - exact).max() > 1e-5 * np.abs(exact).max()  # exact fp32 is ~1e-7 off


@needs_tf32
def test_a_torch_layer_follows_the_precision_switch():
    """The torch adapter keeps a layer's selection, but a precision change must reach it."""
    torch = pytest.importorskip("torch")
    from cupysparse.adapters import torch as cst

    coords = coordinates(seed=4, side=12)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((len(coords), 32)).astype(np.float32)
    conv = cst.SubMConv3d(32, 48, 3, bias=False).cuda()
    w = conv.weight.detach().cpu().numpy()
    tensor = cst.SparseTensor(torch.from_numpy(coords).cuda(), torch.from_numpy(x).cuda())
    kernel_map = build_gpu_map("submanifold", coords)
    dy = np.zeros((kernel_map.num_out, 48))
    exact, (terms, a, b) = reference_phase("forward", kernel_map, x, w, dy)
    with torch.no_grad():
        first_exact = conv(tensor).features.cpu().numpy()
        with fp32_precision("tf32"):
            tf32_out = conv(tensor).features.cpu().numpy()
        second_exact = conv(tensor).features.cpu().numpy()
    assert_close(first_exact, exact, FLOAT32, terms, a, b, "torch, exact fp32")
    assert_tf32_forward(tf32_out, kernel_map, x, w, dy, "torch, tf32")
    assert_close(second_exact, exact, FLOAT32, terms, a, b, "torch, exact fp32 again")


def test_the_benchmark_tunes_its_tf32_layers_as_tf32_problems():
    from cupysparse.scripts import benchmark_memory_analysis as harness

    coordinates = harness.scene_coordinates("indoor", 2_000, 1)
    case = harness.build_map(cupy_module().asarray(coordinates), 3, 1, "cuda", warmup=False)
    problems = {dtype: harness.LayerArrays(harness.Configuration("indoor", 1, 2_000, 8, 8, 3, 1, dtype), case,
                                           "cuda").problem for dtype in ("tf32", "fp32")}
    assert (problems["tf32"].tf32, problems["fp32"].tf32) == (True, False)
    assert problems["tf32"].dtype == problems["fp32"].dtype == FLOAT32
