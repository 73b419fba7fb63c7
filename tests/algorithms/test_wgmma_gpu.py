"""wgmma_implicit_gemm's three phases on an H100 (sm_90a) against the fp64 CPU reference
(`pytest -m gpu`).

test_conv_algorithms_gpu.py picks the algorithm up wherever it is supported (every phase, map kind,
parameter combination and the launch plans); this file adds what only the wgmma kernels have: both of
the forward's weight layouts (the forward's N-major B, dgrad's K-major one) at every tile and pipeline
depth on channel counts reaching several 64-channel stages and 64-column weight regions, offset batches
(a 5^3 kernel: 125 offsets, four batches), unsorted rows, dgrad over mirror-symmetric maps (offsets in
reverse) and reversed ones, its wgrad's MN-major operands at both tiles over several row and column
blocks (the CHANNELS below past 64 run it too, the rest mma_implicit_gemm's wgrad), and bitwise
repeatability. Everywhere but on compute capability 9.0 it skips, saying why: the sm_90a kernels must
not be launched.
"""

import numpy as np
import pytest

from cupysparse.algorithms import ConvProblem, get_algorithm
from cupysparse.algorithms.tensor_core.wgmma import STAGES, TILES, WGRAD_TILES
from cupysparse.cuda.backend import cupy_module, gpu_available
from cupysparse.cuda.dtypes import BFLOAT16, FLOAT16
from cupysparse.geometry.sparse_tensor import SparseTensor
from gpu_cases import WGRAD_CHANNELS, coordinates, gpu_map, inputs, reference_phase, run_phase
from tolerances import assert_close

NAME = "wgmma_implicit_gemm"


def _skip_reason() -> str | None:
    if not gpu_available():
        return "needs a CUDA GPU"
    problem = ConvProblem(100, 100, 64, 64, 27, np.dtype(FLOAT16), "cuda",
                          int(cupy_module().cuda.Device().compute_capability))
    return get_algorithm(NAME).unsupported_reason(problem)


_REASON = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=str(_REASON))]

DTYPES = (FLOAT16, BFLOAT16)
# Aligned (whole 16-byte rows) and unaligned input channels; outputs below, at and past a tile's width.
CHANNELS = ((64, 64), (128, 256), (96, 200), (3, 17), (33, 70), (17, 130), (256, 128))
MAP_KINDS = ("submanifold", "strided", "transposed")
PHASES = ("forward", "dgrad", "wgrad")


def _check(kernel_map, channels, dtype, params, phase="forward", seed=0):
    x, w, dy = inputs(kernel_map, *channels, dtype, seed=seed)
    actual = run_phase(get_algorithm(NAME), phase, kernel_map, x, w, dy, params)
    expected, (terms, a, b) = reference_phase(phase, kernel_map, x, w, dy)
    assert np.abs(expected).max() > 0
    assert_close(actual, expected, dtype, terms, a, b, f"{NAME} {phase} {channels} {params}")
    return actual


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channels", CHANNELS, ids=lambda c: f"{c[0]}to{c[1]}")
@pytest.mark.parametrize("map_kind", MAP_KINDS)
def test_matches_fp64_reference(map_kind, channels, dtype, phase):
    _check(gpu_map(map_kind), channels, dtype, {}, phase)


@pytest.mark.parametrize("sort_rows", [True, False])
@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_every_forward_tile_and_depth_matches_fp64_reference(tile, stages, sort_rows):
    for channels in ((128, 256), (40, 24)):
        _check(gpu_map("submanifold"), channels, FLOAT16, {"tile": tile, "stages": stages, "sort_rows": sort_rows})


@pytest.mark.parametrize("map_kind", ("submanifold", "strided"))
@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_every_dgrad_tile_matches_fp64_reference(tile, map_kind):
    for channels in ((256, 128), (24, 40), (200, 96)):
        _check(gpu_map(map_kind), channels, BFLOAT16, {"tile": tile}, "dgrad")


# Channel counts per wgrad tile (the tile follows the padded channels, past 64 on both sides): one block
# of it, and several row and column blocks with partial ones, aligned or not.


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("map_kind", ("submanifold", "strided"))
@pytest.mark.parametrize("tile", WGRAD_TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_every_wgrad_tile_matches_fp64_reference(tile, map_kind, dtype):
    algorithm = get_algorithm(NAME)
    for channels in WGRAD_CHANNELS[tile]:
        plan_class = algorithm.wgrad_plan_class_for(np.dtype(dtype), *channels)
        assert plan_class.tile_for(*(-(-c // 16) * 16 for c in channels)) == tile
        _check(gpu_map(map_kind), channels, dtype, {"wgrad_warps_per_sm": 64}, "wgrad")


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_offset_batches_of_a_large_kernel(dtype, phase):
    coords = coordinates(seed=11)
    tensor = SparseTensor(cupy_module().asarray(coords), cupy_module().zeros((len(coords), 1), np.float32))
    kernel_map = tensor.kernel_map(5).kernel_map
    assert kernel_map.kernel_volume == 125
    _check(kernel_map, (64, 128), dtype, {"tile": (128, 128)}, phase)


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_is_bitwise_repeatable(tile, phase):
    kernel_map = gpu_map("submanifold")
    first = _check(kernel_map, (96, 200), BFLOAT16, {"tile": tile}, phase, seed=3)
    again = run_phase(get_algorithm(NAME), phase, kernel_map, *inputs(kernel_map, 96, 200, BFLOAT16, seed=3),
                      {"tile": tile})
    assert np.array_equal(first.view(np.uint16), again.view(np.uint16))
