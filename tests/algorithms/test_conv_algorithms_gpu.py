"""Every registered algorithm on the GPU against the fp64 CPU reference (`pytest -m gpu`).

The reference is `explicit_gemm` in fp64 on the CPU (itself checked against a dense convolution in
test_convolution.py), run over the same pair table with the inputs already rounded to the tested
dtype. Each algorithm × dtype × phase (forward, dgrad, wgrad) runs on several map kinds and on
channel counts that are and are not multiples of 8 / 16; implicit algorithms must also be
bitwise identical across two runs, and every parameter combination of the tuner's search space is
checked once.
"""

import numpy as np
import pytest

from cupysparse.algorithms import CONV, DEPTHWISE, Algorithm, ConvProblem, get_algorithm, registered
from cupysparse.algorithms.base import MAX_GRID_Z
from cupysparse.algorithms.implicit_gemm import SPLIT_K_FACTORS
from cupysparse.cuda.backend import cupy_module, gpu_available
from cupysparse.cuda.dtypes import FLOAT16, FLOAT32
from cupysparse.geometry.kernel_map import KernelMap
from cupysparse.geometry.sparse_tensor import SparseTensor
from gpu_cases import (
    CHANNELS,
    DTYPES,
    MAP_KINDS,
    PHASES,
    build_gpu_map,
    coordinates,
    filled_with_nan,
    gpu_map,
    inputs,
    planned_phases,
    reference_phase,
    run_phase,
    supported,
)
from tolerances import assert_close

pytestmark = pytest.mark.gpu



@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("channels", CHANNELS, ids=lambda c: f"{c[0]}to{c[1]}")
@pytest.mark.parametrize("map_kind", MAP_KINDS)
@pytest.mark.parametrize(("name", "dtype"), supported(CONV))
def test_algorithm_matches_fp64_reference(name, dtype, map_kind, channels, phase):
    algorithm = get_algorithm(name)
    kernel_map = gpu_map(map_kind)
    x, w, dy = inputs(kernel_map, *channels, dtype, seed=sum(channels))
    params = algorithm.default_params("forward" if phase == "forward" else "backward")
    actual = run_phase(algorithm, phase, kernel_map, x, w, dy, params)
    expected, (terms, a, b) = reference_phase(phase, kernel_map, x, w, dy)
    assert np.abs(expected).max() > 0
    assert_close(actual, expected, dtype, terms, a, b, f"{name} {phase}")


def _param_cases():
    cases = []
    for name, dtype in ((p.values[0], p.values[1]) for p in supported(CONV, skip=("explicit_gemm",))):
        if dtype not in (FLOAT16, FLOAT32):
            continue
        algorithm = get_algorithm(name)
        for phase in PHASES:
            for params in algorithm.param_grid("forward" if phase == "forward" else "backward"):
                label = "-".join(f"{k}={v}" for k, v in params.items())
                cases.append(pytest.param(name, dtype, phase, params, id=f"{name}-{dtype}-{phase}-{label}"))
    return cases


@pytest.mark.parametrize(("name", "dtype", "phase", "params"), _param_cases() if gpu_available() else [])
def test_every_parameter_combination_is_correct(name, dtype, phase, params):
    kernel_map = gpu_map("submanifold")
    x, w, dy = inputs(kernel_map, 40, 24, dtype, seed=5)
    actual = run_phase(get_algorithm(name), phase, kernel_map, x, w, dy, params)
    expected, (terms, a, b) = reference_phase(phase, kernel_map, x, w, dy)
    assert_close(actual, expected, dtype, terms, a, b, f"{name} {phase} {params}")


def _has_launch_plans(algorithm) -> bool:
    return type(algorithm).forward_plan is not Algorithm.forward_plan




@pytest.mark.parametrize("misaligned", [False, True], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("channels", ((64, 64), (24, 40), (3, 17)), ids=lambda c: f"{c[0]}to{c[1]}")
@pytest.mark.parametrize(
    ("name", "dtype"), [case for case in supported(CONV) if _has_launch_plans(get_algorithm(case.values[0]))]
)
def test_launch_plans_match_fp64_reference(name, dtype, channels, misaligned):
    """The pointer-level plans the adapters launch, made once from the first map's problem and
    launched over two maps of different sizes (a plan serves every map of its signature), on buffers
    filled with NaN beforehand (so an element left unwritten fails), on aligned and misaligned rows."""
    algorithm = get_algorithm(name)
    maps = (gpu_map("strided"), build_gpu_map("strided", coordinates(seed=8, side=20)))
    assert maps[0].num_out != maps[1].num_out
    x, w, _ = inputs(maps[0], *channels, dtype, seed=11)
    problem = ConvProblem.of(cupy_module().asarray(x), maps[0], w.shape[2])
    forward = algorithm.forward_plan(problem, algorithm.default_params("forward"))
    backward = algorithm.backward_plan(problem, algorithm.default_params("backward"))
    assert forward is not None and backward is not None, f"{algorithm.name} plans only one direction"
    for seed, kernel_map in enumerate(maps):
        x, w, dy = inputs(kernel_map, *channels, dtype, seed=11 + seed)
        results = planned_phases(forward, backward, kernel_map, x, w, dy, misaligned)
        for phase, actual in results.items():
            expected, (terms, a, b) = reference_phase(phase, kernel_map, x, w, dy)
            assert_close(actual, expected, dtype, terms, a, b, f"{name} planned {phase} {channels} map {seed}")


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize(("name", "dtype"), supported(CONV, skip=("explicit_gemm",)))
def test_implicit_algorithms_are_bitwise_deterministic(name, dtype, phase):
    algorithm = get_algorithm(name)
    kernel_map = gpu_map("submanifold")
    x, w, dy = inputs(kernel_map, 33, 40, dtype, seed=1)
    params = algorithm.default_params("forward" if phase == "forward" else "backward")
    first = run_phase(algorithm, phase, kernel_map, x, w, dy, params)
    second = run_phase(algorithm, phase, kernel_map, x, w, dy, params)
    np.testing.assert_array_equal(first.view(np.uint8), second.view(np.uint8))


@pytest.mark.parametrize("num_points", [0, 1])
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize(("name", "dtype"), supported(CONV))
def test_empty_and_one_voxel_inputs(name, dtype, phase, num_points):
    coords = np.array([[0, 3, -2, 1]], np.int32)[:num_points]
    kernel_map = build_gpu_map("submanifold", coords)
    algorithm = get_algorithm(name)
    x, w, dy = inputs(kernel_map, 17, 8, dtype, seed=2)
    params = algorithm.default_params("forward" if phase == "forward" else "backward")
    actual = run_phase(algorithm, phase, kernel_map, x, w, dy, params)
    expected, (terms, a, b) = reference_phase(phase, kernel_map, x, w, dy)
    assert actual.shape == expected.shape
    assert_close(actual, expected, dtype, terms, a, b, f"{name} {phase}")


DEPTHWISE_CHANNELS = (3, 17, 64)


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("channels", DEPTHWISE_CHANNELS)
@pytest.mark.parametrize("map_kind", MAP_KINDS)
@pytest.mark.parametrize(("name", "dtype"), supported(DEPTHWISE))
def test_depthwise_algorithm_matches_fp64_reference(name, dtype, map_kind, channels, phase):
    algorithm = get_algorithm(name, DEPTHWISE)
    kernel_map = gpu_map(map_kind)
    rng = np.random.default_rng(channels)
    x = rng.standard_normal((kernel_map.num_in, channels)).astype(dtype)
    w = rng.standard_normal((kernel_map.kernel_volume, channels)).astype(dtype)
    dy = rng.standard_normal((kernel_map.num_out, channels)).astype(dtype)
    params = algorithm.default_params("forward" if phase == "forward" else "backward")
    actual = run_phase(algorithm, phase, kernel_map, x, w, dy, params)
    expected, (_, a, b) = reference_phase(phase, kernel_map, x, w, dy, kind=DEPTHWISE)
    terms = kernel_map.kernel_volume if phase != "wgrad" else kernel_map.num_out
    assert_close(actual, expected, dtype, terms, a, b, f"depthwise {name} {phase}")


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize(("name", "dtype"), supported(DEPTHWISE))
def test_depthwise_every_parameter_combination_and_determinism(name, dtype, phase):
    algorithm = get_algorithm(name, DEPTHWISE)
    kernel_map = gpu_map("submanifold")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((kernel_map.num_in, 20)).astype(dtype)
    w = rng.standard_normal((kernel_map.kernel_volume, 20)).astype(dtype)
    dy = rng.standard_normal((kernel_map.num_out, 20)).astype(dtype)
    expected, (_, a, b) = reference_phase(phase, kernel_map, x, w, dy, kind=DEPTHWISE)
    terms = kernel_map.kernel_volume if phase != "wgrad" else kernel_map.num_out
    for params in algorithm.param_grid("forward" if phase == "forward" else "backward"):
        first = run_phase(algorithm, phase, kernel_map, x, w, dy, params)
        assert_close(first, expected, dtype, terms, a, b, f"depthwise {name} {phase} {params}")
        if name != "explicit":
            second = run_phase(algorithm, phase, kernel_map, x, w, dy, params)
            np.testing.assert_array_equal(first.view(np.uint8), second.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
def test_functional_api_on_the_gpu_with_the_automatic_choice(dtype, monkeypatch):
    """`auto` picks a supported algorithm per dtype; output and gradients match the CPU in fp64."""
    from cupysparse.functional import convolution as functional
    from cupysparse.tuning.search_space import parse_algorithm_filter
    from cupysparse.tuning.search_space import rule_based_selection

    monkeypatch.delenv("CUPYSPARSE_FWD_ALGO_MODE", raising=False)
    monkeypatch.delenv("CUPYSPARSE_BWD_ALGO_MODE", raising=False)
    cupy = cupy_module()
    coords = coordinates(seed=9, side=10)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((len(coords), 24)).astype(dtype)
    w = (rng.standard_normal((8, 24, 16)) / 8).astype(dtype)
    bias = rng.standard_normal(16).astype(dtype)
    gpu_in = SparseTensor(cupy.asarray(coords), cupy.asarray(x))
    cpu_in = SparseTensor(coords, x.astype(np.float64))
    out = functional.spatially_sparse_conv(gpu_in, cupy.asarray(w), 2, stride=2, bias=cupy.asarray(bias))
    expected = functional.spatially_sparse_conv(cpu_in, w.astype(np.float64), 2, stride=2,
                                                bias=bias.astype(np.float64))
    problem = ConvProblem.of(gpu_in.features, gpu_in.kernel_map(2, 2).kernel_map, 16)
    chosen = rule_based_selection(parse_algorithm_filter(None), problem).algorithm
    assert chosen.supports(problem) and chosen.name == max(
        (a for a in registered().values() if a.supports(problem)), key=lambda a: a.auto_priority(problem)
    ).name
    np.testing.assert_array_equal(out.coordinates.get(), expected.coordinates)
    assert_close(out.features.get(), expected.features, dtype, 8 * 24, x, w, "forward")
    dy = rng.standard_normal(expected.features.shape).astype(dtype)
    grads = functional.spatially_sparse_conv_backward(cupy.asarray(dy), gpu_in, cupy.asarray(w), 2, stride=2,
                                                      bias=cupy.asarray(bias))
    reference = functional.spatially_sparse_conv_backward(dy.astype(np.float64), cpu_in, w.astype(np.float64), 2,
                                                          stride=2, bias=bias.astype(np.float64))
    assert_close(grads.input.get(), reference.input, dtype, 8 * 16, dy, w, "dgrad")
    assert_close(grads.weight.get(), reference.weight, dtype, len(coords), x, dy, "wgrad")
    assert_close(grads.bias.get(), reference.bias, dtype, len(coords), dy, np.ones(1), "bias")


@pytest.mark.parametrize(
    ("name", "dtype"), [p for p in supported(CONV, skip=("explicit_gemm",)) if p.values[1] in (FLOAT16, FLOAT32)]
)
def test_kernel_volumes_past_the_grid_z_share_of_the_splits_give_every_phase(name, dtype):
    """21³ = 9261 offsets: times implicit_gemm's 8 splits (or wmma's shares) more than grid z holds,
    so the splits shrink; every phase still equals the reference."""
    coords = coordinates(seed=12, side=6, density=0.3)
    tensor = SparseTensor(cupy_module().asarray(coords), cupy_module().zeros((len(coords), 1), np.float32))
    kernel_map = tensor.kernel_map(21).kernel_map
    assert kernel_map.kernel_volume * max(SPLIT_K_FACTORS) > MAX_GRID_Z
    algorithm = get_algorithm(name)
    x, w, dy = inputs(kernel_map, 8, 16, dtype, seed=6)
    backward_params = algorithm.default_params("backward")
    if "split_k_factor" in backward_params:
        backward_params["split_k_factor"] = max(SPLIT_K_FACTORS)
    for phase in PHASES:
        expected, (terms, a, b) = reference_phase(phase, kernel_map, x, w, dy)
        params = algorithm.default_params("forward") if phase == "forward" else backward_params
        actual = run_phase(algorithm, phase, kernel_map, x, w, dy, params)
        assert_close(actual, expected, dtype, terms, a, b, f"{name} {phase} {params}")


@pytest.mark.parametrize(("name", "dtype"), [p for p in supported(CONV) if p.values[1] == FLOAT16])
def test_weight_gradient_over_many_pairs_stays_accurate(name, dtype):
    """wgrad sums tens of thousands of products per offset: half-precision accumulation would be
    ~2% off here (cuBLAS's fp16 GEMMs were, for these shapes), fp32 accumulation is not."""
    from cupysparse.data.scenes import make_scene

    voxels = make_scene("indoor", 130_000, seed=0).voxel_coordinates()
    kernel_map = build_gpu_map("submanifold", np.concatenate([np.zeros((len(voxels), 1), np.int32), voxels], axis=1))
    x, w, dy = inputs(kernel_map, 64, 64, dtype, seed=4)
    algorithm = get_algorithm(name)
    actual = run_phase(algorithm, "wgrad", kernel_map, x, w, dy, algorithm.default_params("backward"))
    expected, (terms, a, b) = reference_phase("wgrad", kernel_map, x, w, dy)
    assert_close(actual, expected, dtype, terms, a, b, f"{name} wgrad")


# The fp16 algorithms whose wgrad splits each offset's pairs into shares summed by a second kernel.
SPLIT_WGRAD_ALGORITHMS = [p.values[0] for p in supported(CONV) if p.values[1] == FLOAT16
                          and "wgrad_warps_per_sm" in get_algorithm(p.values[0]).backward_params]


def _fp16_wgrad_plan(name, kernel_map, channels, warps_per_sm):
    plan_class = get_algorithm(name).wgrad_plan_class_for(np.dtype(FLOAT16), *channels)
    return plan_class(np.dtype(FLOAT16), kernel_map.kernel_volume, *channels, warps_per_sm)


@pytest.mark.parametrize("channels", ((64, 64), (128, 128)), ids=lambda c: f"{c[0]}to{c[1]}")
@pytest.mark.parametrize("name", SPLIT_WGRAD_ALGORITHMS)
def test_weight_gradient_in_more_shares_than_the_gpu_holds_at_once(name, channels):
    """The largest wgrad occupancy target asks for more shares than the SMs hold, so they run in waves,
    offset-major at 64 channels and, where one block covers dW_k, round-major at 128 (the operands pass
    twice the L2 there): the sum over the shares still equals the reference."""
    from cupysparse.algorithms.tensor_core.common import WGRAD_WARPS_PER_SM
    from cupysparse.data.scenes import make_scene

    voxels = make_scene("indoor", 260_000, seed=1).voxel_coordinates()
    kernel_map = build_gpu_map("submanifold", np.concatenate([np.zeros((len(voxels), 1), np.int32), voxels], axis=1))
    algorithm = get_algorithm(name)
    many, default = (_fp16_wgrad_plan(name, kernel_map, channels, warps)
                     for warps in (max(WGRAD_WARPS_PER_SM), WGRAD_WARPS_PER_SM[0]))
    sizes = (kernel_map.num_in, kernel_map.num_out)
    assert many.shares(*sizes) > default.shares(*sizes)
    if many.grid_xy == (1, 1):  # one block covers dW_k: the blocks' order follows the operands' size
        assert many.round_major(*sizes) == (channels == (128, 128))
    x, w, dy = inputs(kernel_map, *channels, FLOAT16, seed=5)
    params = {**algorithm.default_params("backward"), "wgrad_warps_per_sm": max(WGRAD_WARPS_PER_SM)}
    actual = run_phase(algorithm, "wgrad", kernel_map, x, w, dy, params)
    expected, (terms, a, b) = reference_phase("wgrad", kernel_map, x, w, dy)
    assert_close(actual, expected, FLOAT16, terms, a, b, f"{name} wgrad {channels} {params}")


def _plane_map() -> KernelMap:
    """A submanifold map of voxels in one plane: the offsets that leave it have no pairs."""
    coords = coordinates(seed=7)
    coords[:, 3] = 0
    return build_gpu_map("submanifold", np.unique(coords, axis=0))


@pytest.mark.parametrize("shares", (1, 3, 6, 40))
@pytest.mark.parametrize("channels", ((8, 24), (72, 136)), ids=lambda c: f"{c[0]}to{c[1]}")
@pytest.mark.parametrize("voxels", ("space", "plane"))
@pytest.mark.parametrize("name", SPLIT_WGRAD_ALGORITHMS)
def test_weight_gradient_sums_its_shares_in_every_number_of_slot_groups(name, voxels, channels, shares):
    """The sum of an offset's shares gives each weight-gradient element 1, 2, 4 or 8 threads (by the
    shares per offset, where the GPU has threads to spare), each adding every slot_groups-th share: so
    at 8 x 24 channels with 1, 3, 6 and 40 shares an offset, shares the groups split unevenly. With
    channels that leave the last tile part empty (one tile at 8 x 24, several at 72 x 136, where
    wgmma_implicit_gemm runs its own wgrad) and offsets without pairs (voxels in one plane), every share
    is summed once and an offset without pairs gets exact zeros. The sum in dgrad's launch (the backward
    of both gradients), whose blocks are the dgrad kernel's size, and a second launch of its own, each
    into a weight gradient and workspace filled with NaN again, are bitwise the same."""
    from cupysparse.algorithms.tensor_core.common import WGRAD_WARPS_PER_SM, backward_plan

    cupy = cupy_module()
    kernel_map = _plane_map() if voxels == "plane" else gpu_map("submanifold")
    plan = _fp16_wgrad_plan(name, kernel_map, channels, WGRAD_WARPS_PER_SM[0])
    plan.shares = lambda num_in, num_out: shares
    if channels == (8, 24):
        assert plan.slot_groups(shares) == {1: 1, 3: 2, 6: 4, 40: 8}[shares]
    x, w, dy = inputs(kernel_map, *channels, FLOAT16, seed=6)
    x_gpu, dy_gpu = cupy.asarray(x), cupy.asarray(dy)
    stream = cupy.cuda.get_current_stream().ptr
    algorithm = get_algorithm(name)
    problem = ConvProblem.of(x_gpu, kernel_map, channels[1])
    dgrad_tile = algorithm.default_params("backward")["tile"]
    dgrad = algorithm.gemm_plan(np.dtype(FLOAT16), kernel_map.kernel_volume, channels[1], channels[0], dgrad_tile,
                                algorithm.dgrad_stages_for(dgrad_tile), True, True)
    backward = backward_plan(problem, dgrad, plan)
    weight = cupy.zeros(backward.weight_shape, dtype=FLOAT16)
    weight[:, : channels[0], : channels[1]] = cupy.asarray(w)
    results = []
    for in_dgrad in (False, True, False):
        workspace = filled_with_nan(plan.workspace_shape(kernel_map), np.float32)
        grad_weight = filled_with_nan(w.shape, np.dtype(FLOAT16))
        if in_dgrad:
            grad_input = filled_with_nan(x.shape, np.dtype(FLOAT16))
            backward.launch(kernel_map, dy_gpu.data.ptr, x_gpu.data.ptr, weight.data.ptr, grad_input.data.ptr,
                            workspace.data.ptr, grad_weight.data.ptr, stream)
            expected, (terms, a, b) = reference_phase("dgrad", kernel_map, x, w, dy)
            assert_close(grad_input.get(), expected, FLOAT16, terms, a, b, f"{name} dgrad carrying the wgrad sum")
        else:
            plan.launch(kernel_map, x_gpu.data.ptr, dy_gpu.data.ptr, workspace.data.ptr, grad_weight.data.ptr,
                        stream)
        results.append(grad_weight.get())
    expected, (terms, a, b) = reference_phase("wgrad", kernel_map, x, w, dy)
    assert_close(results[0], expected, FLOAT16, terms, a, b, f"{name} wgrad over {shares} shares an offset")
    empty = np.diff(kernel_map.csr().offsets.get()) == 0
    assert empty.any() == (voxels == "plane")
    assert not results[0][empty].any()
    for again in results[1:]:
        assert np.array_equal(results[0].view(np.uint16), again.view(np.uint16))
