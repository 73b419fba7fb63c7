"""wgmma_implicit_gemm without a GPU: registration, its dtypes (fp32 only as TF32), where it is refused,
that `auto` measures it beside the other tensor-core algorithms on compute capability 9.0 only, its
tiles in every phase (wgrad's chosen by the channels, and where wgrad is its own), its shared-memory
sizes against the kernel's limits, and its sources pinned to sm_90a."""

from types import SimpleNamespace

import numpy as np
import pytest

from cupysparse.cuda import compile as kernel_compile
from cupysparse.tuning.search_space import AlgorithmFilter
from cupysparse.algorithms import CONV, ConvProblem, get_algorithm, registered
from cupysparse.algorithms.tensor_core import common as common_module
from cupysparse.algorithms.tensor_core import wgmma as wgmma_module
from cupysparse.algorithms.tensor_core.common import WgradPlan
from cupysparse.cuda.dtypes import BFLOAT16, FLOAT16, FLOAT32
from cupysparse.tuning.search_space import candidates

NAME = "wgmma_implicit_gemm"
H100_SHARED_LIMIT = 227 * 1024  # dynamic shared memory a block may opt into on sm_90


def _problem(dtype=FLOAT16, capability=90, in_channels=64, out_channels=64, device="cuda", tf32=False):
    return ConvProblem(10**5, 10**5, in_channels, out_channels, 27, np.dtype(dtype), device, capability, tf32=tf32)


def test_it_is_registered_and_supports_fp16_bf16_and_tf32_on_compute_capability_9_0_only(monkeypatch):
    monkeypatch.setattr(wgmma_module, "nvrtc_knows", lambda architecture: True)
    algorithm = registered(CONV)[NAME]
    for dtype, tf32 in ((FLOAT16, False), (BFLOAT16, False), (FLOAT32, True)):
        for channels in (3, 17, 64, 256):
            assert algorithm.supports(_problem(dtype, in_channels=channels, out_channels=channels, tf32=tf32))
    for capability in (80, 86, 89, 100, 120):
        assert "9.0 exactly" in algorithm.unsupported_reason(_problem(capability=capability))
        assert "9.0 exactly" in algorithm.unsupported_reason(_problem(FLOAT32, capability=capability, tf32=True))
    assert "fp32 only in TF32" in algorithm.unsupported_reason(_problem(FLOAT32))
    assert "not fp64" in algorithm.unsupported_reason(_problem(np.float64))
    assert "CUDA GPUs only" in algorithm.unsupported_reason(_problem(device="cpu", capability=None))
    monkeypatch.setattr(wgmma_module, "nvrtc_knows", lambda architecture: False)
    assert "NVRTC" in algorithm.unsupported_reason(_problem())


def test_auto_measures_it_beside_mma_implicit_gemm_on_compute_capability_9_0_only(monkeypatch):
    monkeypatch.setattr(wgmma_module, "nvrtc_knows", lambda architecture: True)
    for phase in ("forward", "backward"):
        auto = candidates(AlgorithmFilter(CONV, phase, "auto", ()), _problem(in_channels=256, out_channels=256))
        assert {"wgmma_implicit_gemm", "mma_implicit_gemm"} <= {algorithm.name for algorithm, _ in auto}
        ampere = candidates(AlgorithmFilter(CONV, phase, "auto", ()), _problem(capability=80))
        assert ampere and NAME not in {algorithm.name for algorithm, _ in ampere}
        named = candidates(AlgorithmFilter(CONV, phase, "names", (NAME,)), _problem())
        assert {algorithm.name for algorithm, _ in named} == {NAME}


def test_auto_grid_keeps_sorted_rows_and_tiles_no_wider_than_the_channels_need():
    algorithm = get_algorithm(NAME)
    narrow = algorithm.auto_param_grid("forward", _problem(in_channels=256, out_channels=64))
    assert {params["tile"] for params in narrow} == {(128, 64), (64, 64)}
    assert all(params["sort_rows"] for params in narrow)
    # Between two widths, up to the tile that covers the channels (100 pad to 112: 128 columns).
    between = algorithm.auto_param_grid("forward", _problem(in_channels=256, out_channels=100))
    assert {params["tile"] for params in between} == {(128, 64), (64, 64), (128, 128), (64, 128)}
    assert {params["tile"] for params in algorithm.auto_param_grid("forward", _problem(out_channels=160))} == set(
        wgmma_module.TILES)
    wide = algorithm.auto_param_grid("forward", _problem(in_channels=32, out_channels=256))
    assert {params["tile"] for params in wide} == set(wgmma_module.TILES)
    # dgrad's output channels are the layer's inputs.
    dgrad = algorithm.auto_param_grid("backward", _problem(in_channels=64, out_channels=256))
    assert {params["tile"] for params in dgrad} == {(128, 64), (64, 64)}
    assert {params["wgrad_warps_per_sm"] for params in dgrad} == {8, 16, 32, 64, 128, 256}


def test_auto_leaves_it_out_below_64_channels(monkeypatch):
    """Its narrowest tile is 64 channels wide: below that `auto` measures the other tensor-core
    algorithms only (in dgrad, the layer's input channels decide)."""
    monkeypatch.setattr(wgmma_module, "nvrtc_knows", lambda architecture: True)
    algorithm = get_algorithm(NAME)
    for phase, problem in (("forward", _problem(in_channels=256, out_channels=32)),
                           ("forward", _problem(in_channels=256, out_channels=48)),
                           ("backward", _problem(in_channels=32, out_channels=256))):
        assert algorithm.auto_param_grid(phase, problem) == []
        pool = candidates(AlgorithmFilter(CONV, phase, "auto", ()), problem)
        assert "mma_implicit_gemm" in {a.name for a, _ in pool} and NAME not in {a.name for a, _ in pool}
    assert algorithm.param_grid("forward")  # still there by name, every tile


def test_forward_and_dgrad_have_its_own_tiles_and_namespaces():
    algorithm, mma = get_algorithm(NAME), get_algorithm("mma_implicit_gemm")
    forward = algorithm.param_grid("forward")
    assert len(forward) == len(wgmma_module.TILES) * 2 * len(wgmma_module.STAGES)
    assert forward[0] == {"tile": (128, 128), "sort_rows": True, "stages": 4}
    assert {params["tile"] for params in algorithm.param_grid("backward")} == set(wgmma_module.TILES)
    for phase in ("forward", "dgrad", "wgrad"):
        assert algorithm.checked_tile((128, 256), phase) == (128, 256)
        with pytest.raises(ValueError, match=f"wgmma_implicit_gemm {phase} tile"):
            algorithm.checked_tile((128, 32, 4, 1), phase)
    assert algorithm.tuning_namespace("forward") != mma.tuning_namespace("forward")
    assert algorithm.tuning_namespace("backward") != mma.tuning_namespace("backward")


@pytest.mark.parametrize(("tile", "stages", "expected"), [
    # stages x (rows + cols) x 128 B + 27 offsets x rows x 4 B + rows x 4 B + warps x 4 B + 1 KB
    ((128, 128), 4, 4 * (16384 + 16384) + 13824 + 512 + 32 + 1024),
    ((128, 128), 3, 3 * (16384 + 16384) + 13824 + 512 + 32 + 1024),
    ((128, 256), 4, 4 * (16384 + 32768) + 13824 + 512 + 32 + 1024),
    ((64, 64), 3, 3 * (8192 + 8192) + 6912 + 256 + 16 + 1024),
])
def test_shared_memory_follows_the_kernel_layout(tile, stages, expected):
    assert wgmma_module.shared_bytes(tile, stages) == expected


def test_dgrad_takes_the_deepest_pipeline_of_those_that_keep_the_most_blocks_on_an_sm():
    sm_bytes = 228 * 1024

    def blocks(tile, stages):
        return sm_bytes // (wgmma_module.shared_bytes(tile, stages) + 1024)

    assert blocks((128, 128), 4) == 1 and blocks((128, 128), 3) == 2
    assert wgmma_module.dgrad_stages((128, 128)) == 3
    for tile in ((128, 64), (64, 128), (64, 64), (128, 256)):
        assert blocks(tile, 4) >= blocks(tile, 3)
        assert wgmma_module.dgrad_stages(tile) == 4


def test_its_wgrad_runs_on_layers_past_64_channels_and_mma_implicit_gemms_elsewhere():
    algorithm, mma = get_algorithm(NAME), get_algorithm("mma_implicit_gemm")
    own, borrowed = wgmma_module._WgmmaWgradPlan, mma.wgrad_plan_class_for(np.dtype(FLOAT16), 64, 64)
    assert issubclass(own, WgradPlan) and issubclass(borrowed, WgradPlan) and own is not borrowed
    for dtype in (FLOAT16, BFLOAT16, FLOAT32):
        for channels in ((65, 65), (128, 128), (96, 300), (256, 80)):
            assert algorithm.wgrad_plan_class_for(np.dtype(dtype), *channels) is own, (dtype, channels)
        for channels in ((64, 64), (64, 256), (256, 64), (3, 17), (49, 300)):
            assert algorithm.wgrad_plan_class_for(np.dtype(dtype), *channels) is borrowed, (dtype, channels)


def test_the_wgrad_kernel_follows_the_dtype():
    kernel_name = wgmma_module._WgmmaWgradPlan.kernel_name
    assert kernel_name(FLOAT16, (128, 256)) == "wgmma_conv_wgrad<__half, 128, 256, 4>"
    assert kernel_name(FLOAT32, (128, 128)) == "wgmma_conv_wgrad_tf32<128, 128, 4>"


@pytest.mark.parametrize(("padded", "tile"), [((80, 80), (128, 128)), ((256, 128), (128, 128)),
                                              ((128, 144), (128, 256)), ((512, 512), (128, 256))])
def test_wgrad_tile_is_the_narrowest_covering_the_output_channels_or_the_widest(padded, tile):
    assert wgmma_module.wgrad_tile(*padded) == tile


def test_wgrad_shared_memory_follows_the_kernel_layout_and_fits_the_h100():
    # 16-bit: 4 stages x 64 pair rows of 128 B per 64 channels of x and of dy, 4 steps' indices (2 x 64 ints),
    # + 1 KB
    assert wgmma_module._wgrad_shared_bytes(FLOAT16, (128, 256)) == 4 * (2 + 4) * 64 * 128 + 4 * 2 * 64 * 4 + 1024
    # TF32: 4 stages x (256 rows of 128 B of dy + 32 pair rows of 128 + 8 floats of x), 4 steps' indices
    # (2 x 32 ints), + 1 KB
    assert wgmma_module._wgrad_shared_bytes(FLOAT32, (128, 256)) == (4 * (256 * 128 + 32 * 136 * 4) + 4 * 2 * 32 * 4
                                                                     + 1024)
    assert all(wgmma_module._wgrad_shared_bytes(dtype, tile) <= H100_SHARED_LIMIT
               for tile in wgmma_module.WGRAD_TILES for dtype in wgmma_module.WGRAD_DTYPES)


def test_every_tile_fits_the_h100_and_keeps_the_operand_tiles_on_swizzle_atoms():
    for tile in wgmma_module.TILES:
        rows, cols = tile
        assert rows % 64 == 0 and cols % 64 == 0 and cols <= 256
        assert wgmma_module.threads(tile) == rows // 64 * 128
        assert (rows * 128) % 1024 == 0 and (cols * 128) % 1024 == 0
        for stages in wgmma_module.STAGES:
            assert wgmma_module.shared_bytes(tile, stages) <= H100_SHARED_LIMIT, (tile, stages)


def test_its_kernels_are_one_module_each_pinned_to_sm_90a():
    for dtype in (FLOAT16, BFLOAT16, FLOAT32):
        family = wgmma_module._SOURCES[dtype]
        # Forward at every depth, dgrad at one; TF32's forward reads the weight transposed, as dgrad, so
        # at dgrad's depth it is dgrad's kernel. Then wgrad's tiles.
        modules_per_tile = len(wgmma_module.STAGES) + (dtype != FLOAT32)
        assert len(family.sources) == len(wgmma_module.TILES) * modules_per_tile + len(wgmma_module.WGRAD_TILES)
        assert all(len(source.name_expressions) == 1 and source.architecture == "sm_90a" for source in family.sources)
        assert set(family.sources) <= set(kernel_compile.registered_sources())
    assert (wgmma_module._kernel_name(np.dtype(FLOAT16), (128, 256), 3, False)
            == "wgmma_conv_forward<__half, 128, 256, 3, false, true>")
    assert (wgmma_module._kernel_name(np.dtype(BFLOAT16), (64, 64), 4, True)
            == "wgmma_conv_forward<__nv_bfloat16, 64, 64, 4, true, false>")
    assert (wgmma_module._kernel_name(np.dtype(FLOAT32), (128, 128), 3, True)
            == "wgmma_conv_forward<float, 128, 128, 3, true, false>")
    assert (wgmma_module._wgrad_kernel_name(np.dtype(BFLOAT16), (128, 256))
            == "wgmma_conv_wgrad<__nv_bfloat16, 128, 256, 4>")


def test_the_tf32_forward_reads_the_weight_transposed_and_its_plan_asks_for_it(monkeypatch):
    monkeypatch.setattr(wgmma_module, "nvrtc_knows", lambda architecture: True)
    algorithm = get_algorithm(NAME)
    assert algorithm.forward_weight_transposed(np.dtype(FLOAT32))
    assert not any(algorithm.forward_weight_transposed(np.dtype(dtype)) for dtype in (FLOAT16, BFLOAT16))
    assert not get_algorithm("mma_implicit_gemm").forward_weight_transposed(np.dtype(FLOAT32))
    problem = _problem(FLOAT32, in_channels=3, out_channels=40, tf32=True)
    for params in algorithm.auto_param_grid("forward", problem):
        copy, source = algorithm.kernel_modules("forward", problem, params)  # 3 channels: the rows are copied
        assert copy.filename == "row_padding.cu" and source.name_expressions[0].endswith(", true>")
    planned = []  # the weight layouts of the kernel plans asked for: each must match its plan's

    def gemm_plan(self, *signature):
        planned.append(signature[-1])
        return SimpleNamespace(launch=None)

    monkeypatch.setattr(type(algorithm), "gemm_plan", gemm_plan)
    monkeypatch.setattr(common_module, "current_device", lambda: 0)  # the features' copy, 3 channels
    plan = algorithm.forward_plan(problem, {})
    assert plan.weight_transposed and plan.weight_shape == (27, 48, 16)
    fp16_plan = algorithm.forward_plan(_problem(FLOAT16, in_channels=3, out_channels=40), {})
    assert not fp16_plan.weight_transposed and fp16_plan.weight_shape == (27, 16, 48)
    assert planned == [True, False]
