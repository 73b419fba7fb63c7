"""`wgmma_implicit_gemm`: implicit GEMM on Hopper's warpgroup tensor cores (`wgmma.mma_async`,
sm_90a only: compute capability 9.0 exactly, with an NVRTC that knows sm_90a), fp16 and bf16 features,
and fp32 ones as TF32 when `cupysparse.cuda.precision` allows it (the tensor cores read the 19 high bits of
each fp32 operand: truncated, as in mma_implicit_gemm), fp32 accumulation; forward and
dgrad kernel in raw_kernels/wgmma_implicit_gemm.cu, compiled with -arch=sm_90a.

The forward is the tensor-core dataflow (`common`: output-stationary tiles over the mask-sorted rows,
offsets a tile's rows lack skipped, each output written once), for any channel count (16-byte copies where
the rows allow them, element copies elsewhere), with one or two warpgroups per block, each multiplying 64 rows by
the block's 64, 128 or 256 output channels straight from shared memory, whose operand tiles a 3- or
4-stage cp.async pipeline fills in the wgmma descriptors' 128-byte swizzle layout. dgrad is the same
kernel over `dgrad_operands` with the weight read transposed (a K-major B operand); TF32, which takes
K-major operands only, runs its forward on the weight transposed too (`forward_weight_transposed`: a
copy per call, or the layout a launch plan asks its caller for). wgrad is the common split-K dataflow
(shares of each offset's pair list, fp32 partials, their ordered sum) with its own GEMM on layers
wider than 64 channels (`wgrad_plan_class_for`): for 16-bit operands `wgmma_conv_wgrad`, which stages the
gathered rows as they lie, pair-major, and reads them MN-major through the instruction's transpose flags;
for TF32, K-major only, `wgmma_conv_wgrad_tf32`, which transposes dy's rows on their way into shared
memory and reads x's A fragments into registers. Elsewhere wgrad is mma_implicit_gemm's.

On an H100 it ranks with the other tensor-core algorithms (`TensorCoreImplicitGemm.auto_priority`), so
`auto` measures it beside them; everywhere else it is unsupported, and its kernels are never loaded.
"""

from __future__ import annotations

import functools
from typing import ClassVar

from cupysparse.cuda.backend import current_device
from cupysparse.cuda.compile import KernelFamily, KernelSource, PreparedLaunch, nvrtc_knows, pinned_capability
from cupysparse.cuda.dtypes import BFLOAT16, FLOAT16, FLOAT32, cuda_type_name
from cupysparse.algorithms.base import ConvProblem, get_algorithm, gpu_only_reason, register
from cupysparse.algorithms.tensor_core.common import (
    SHARED_SOURCES,
    WGRAD_WARPS_PER_SM,
    DynamicSharedWgradPlan,
    ForwardGemmPlan,
    TensorCoreImplicitGemm,
    WgradPlan,
    covering_width,
    forward_arguments,
    fp32_as_tf32_unsupported_reason,
    padded_channels,
)

ARCHITECTURE = "sm_90a"
WARPGROUP_THREADS = 128
WGMMA_M = 64  # rows of one warpgroup's tile
SWIZZLE_ROW_BYTES, SWIZZLE_ATOM_BYTES = 128, 1024
ROW_TABLE_LIMIT = 16 * 1024  # as in gather_tiles.cuh
FORWARD_OFFSET_BATCH = 27  # as in wgmma_implicit_gemm.cu
# (rows, channels) of a block's output tile: rows / 64 warpgroups. 64 x 256 is left out: one warpgroup
# holding 128 accumulators a thread spills (ptxas, 255 registers).
TILES = ((128, 128), (128, 256), (128, 64), (64, 128), (64, 64))
NARROWEST_COLUMNS = min(columns for _, columns in TILES)  # `auto` tries it from this many channels up
STAGES = (4, 3)
# Tiles this wide stage each 128-byte channel chunk for every offset before the next chunk (chunk-major
# steps, the kernel's CHUNK_MAJOR); narrower ones every chunk of an offset before the next offset. Side
# by side on an H100, chunk-major took 0-5% off the 128 x 256 tile in 4 stages in each of 8 cases (1M x
# 256 TF32 forward 5.81 -> 5.67 ms, 500K x 256 2.98 -> 2.83, fp16 1.66 -> 1.60; dgrad 1M x 256 fp16 3.37
# -> 3.28) and moved 128 x 128 by -1% to +2%.
CHUNK_MAJOR_COLUMNS = 256
# An sm_90 SM's shared memory (H100, H200), and what each resident block reserves of it.
SM_SHARED_BYTES, BLOCK_RESERVED_SHARED_BYTES = 228 * 1024, 1024
FEATURE_DTYPES = (FLOAT16, BFLOAT16, FLOAT32)
# (input channels, output channels) of a wgrad block's dW_k tile: 128 input channels (two warpgroups) by the
# narrowest covering the padded output channels, or the widest.
WGRAD_TILES = ((128, 128), (128, 256))
WGRAD_STAGES = 4
WGRAD_DTYPES = (FLOAT16, BFLOAT16, FLOAT32)
TF32_X_ROW_PAD = 8  # floats after each staged x pair row of the TF32 wgrad (WgmmaTf32WgradLayout::X_LD)
# wgmma's wgrad runs where both padded channel counts pass this; mma_implicit_gemm's elsewhere (see
# WgmmaImplicitGemm.wgrad_plan_class_for).
WGRAD_MIN_CHANNELS = 65


def _kernel_name(dtype, tile, stages: int, weight_transposed: bool) -> str:
    rows, cols = tile
    flags = f"{str(weight_transposed).lower()}, {str(cols >= CHUNK_MAJOR_COLUMNS).lower()}"
    return f"wgmma_conv_forward<{cuda_type_name(dtype)}, {rows}, {cols}, {stages}, {flags}>"


def _wgrad_kernel_name(dtype, tile) -> str:
    if dtype == FLOAT32:
        return f"wgmma_conv_wgrad_tf32<{tile[0]}, {tile[1]}, {WGRAD_STAGES}>"
    return f"wgmma_conv_wgrad<{cuda_type_name(dtype)}, {tile[0]}, {tile[1]}, {WGRAD_STAGES}>"


def _wgrad_pairs(dtype) -> int:
    """Pairs per wgrad stage: one 128-byte row of the operands' values."""
    return SWIZZLE_ROW_BYTES // dtype.itemsize


def wgrad_tile(in_padded: int, out_padded: int) -> tuple[int, int]:
    rows = WGRAD_TILES[0][0]
    return rows, next((cols for _, cols in WGRAD_TILES if cols >= out_padded), WGRAD_TILES[-1][1])


def _wgrad_shared_bytes(dtype, tile) -> int:
    """`WgmmaWgradLayout::ALLOCATED` in the kernel source (16-bit: the stages of 64 pair rows of 128 bytes
    per 64 channels of either operand), or `WgmmaTf32WgradLayout::ALLOCATED` (TF32: a 128-byte row of 32
    pairs per output channel, 32 padded pair rows of the input channels); then the pair indices (both
    lists) of 2 (stages - 2) steps, plus 1024 bytes to align the stages to swizzle atoms."""
    rows, cols = tile
    pairs = _wgrad_pairs(dtype)
    stage = (cols * SWIZZLE_ROW_BYTES + pairs * (rows + TF32_X_ROW_PAD) * 4 if dtype == FLOAT32
             else (rows + cols) * SWIZZLE_ROW_BYTES)
    indices = 2 * (WGRAD_STAGES - 2) * 2 * pairs * 4
    return WGRAD_STAGES * stage + indices + SWIZZLE_ATOM_BYTES


def _forward_weight_transposed(dtype) -> bool:
    """TF32 takes K-major operands only: its forward reads the weight transposed, as dgrad does."""
    return dtype == FLOAT32


def _kernel_family(dtype) -> KernelFamily:
    # One module per kernel, as mma_implicit_gemm's; every one compiled for sm_90a only. TF32's forward
    # at dgrad's depth is dgrad's kernel.
    transposed = _forward_weight_transposed(dtype)
    forward = (_kernel_name(dtype, tile, stages, transposed) for tile in TILES for stages in STAGES)
    dgrad = (_kernel_name(dtype, tile, dgrad_stages(tile), True) for tile in TILES)
    wgrad = (_wgrad_kernel_name(dtype, tile) for tile in WGRAD_TILES if dtype in WGRAD_DTYPES)
    names = dict.fromkeys((*forward, *dgrad, *wgrad))
    return KernelFamily("wgmma_implicit_gemm.cu", ((name,) for name in names), ARCHITECTURE)


def threads(tile) -> int:
    return tile[0] // WGMMA_M * WARPGROUP_THREADS


def shared_bytes(tile, stages: int) -> int:
    """Dynamic shared memory of one block: `WgmmaSharedLayout::ALLOCATED` in the kernel source (the
    layout plus 1024 bytes to align the operand tiles to swizzle atoms); the same for every dtype and
    weight layout (a stage holds 128 bytes of channels of each of its rows and of each weight column)."""
    rows, cols = tile
    stage = (rows + cols) * SWIZZLE_ROW_BYTES
    offset_batch = min(FORWARD_OFFSET_BATCH, ROW_TABLE_LIMIT // (rows * 4))
    return stages * stage + offset_batch * rows * 4 + rows * 4 + threads(tile) // 32 * 4 + SWIZZLE_ATOM_BYTES


def dgrad_stages(tile) -> int:
    """dgrad's pipeline depth for `tile`: of STAGES, the one that keeps the most blocks on an SM, the
    deeper on a tie. (H100, TF32, 1M voxels: 128 x 128 in 3 stages, two blocks an SM, 1.71 ms against 2.12
    in 4 stages, one block; 128 x 64 in 4 stages, two blocks either way, 0.82 ms against 0.87.)"""

    def blocks_per_sm(stages: int) -> int:
        return SM_SHARED_BYTES // (shared_bytes(tile, stages) + BLOCK_RESERVED_SHARED_BYTES)

    return max(STAGES, key=lambda stages: (blocks_per_sm(stages), stages))


_SOURCES = {dtype: _kernel_family(dtype) for dtype in FEATURE_DTYPES}


class _WgmmaWgradPlan(DynamicSharedWgradPlan):
    """wgrad with `wgmma_conv_wgrad` (16-bit) or `wgmma_conv_wgrad_tf32` as the GEMM: one kernel per tile
    for any rows."""

    @staticmethod
    def tile_for(in_padded: int, out_padded: int) -> tuple:
        return wgrad_tile(in_padded, out_padded)

    @staticmethod
    def kernel_name(dtype, tile) -> str:
        return _wgrad_kernel_name(dtype, tile)

    @staticmethod
    def kernel_family(dtype) -> KernelFamily:
        return _SOURCES[dtype]

    @staticmethod
    def gemm_shared_bytes(dtype, tile) -> int:
        return _wgrad_shared_bytes(dtype, tile)

    def threads(self, tile) -> int:
        return threads(tile)


@functools.cache
def _plan(device: int, dtype, kernel_volume: int, in_channels: int, out_channels: int, tile, stages: int,
          sort_rows: bool, weight_transposed: bool) -> ForwardGemmPlan:
    """The plan of `wgmma_conv_forward` for this signature on `device`, made on first use."""
    rows, cols = tile
    kernel = PreparedLaunch(_SOURCES[dtype].get(_kernel_name(dtype, tile, stages, weight_transposed)), (1,),
                            (threads(tile),), forward_arguments(kernel_volume, in_channels, out_channels),
                            shared_bytes(tile, stages))
    return ForwardGemmPlan(dtype, in_channels, out_channels, rows, cols, sort_rows, kernel)


@register
class WgmmaImplicitGemm(TensorCoreImplicitGemm):
    name = "wgmma_implicit_gemm"
    # Its wgrad on layers of up to 64 channels is mma_implicit_gemm's (`wgrad_plan_class_for`).
    kernel_sources = ("wgmma_implicit_gemm.cu", "mma_implicit_gemm.cu", *SHARED_SOURCES)
    tuning_namespaces: ClassVar[dict[str, str]] = {
        "forward": "wgmma_implicit_gemm_sm90a",
        "backward": "wgmma_implicit_gemm_backward_sm90a",
    }
    forward_params: ClassVar[dict[str, tuple]] = {"tile": TILES, "sort_rows": (True, False), "stages": STAGES}
    # `tile` tunes dgrad, `wgrad_warps_per_sm` wgrad.
    backward_params: ClassVar[dict[str, tuple]] = {"tile": TILES, "wgrad_warps_per_sm": WGRAD_WARPS_PER_SM}
    feature_dtypes: ClassVar[tuple] = FEATURE_DTYPES

    def auto_tiles(self, channels: int) -> list[tuple]:
        """Tiles no wider than the narrowest that covers the padded output channels, and none below 64 of
        them, where its narrowest tile would multiply padding half the time: there mma_implicit_gemm's and
        wmma_implicit_gemm's 32-column tiles ran 17-27% faster in the benchmark grid (H100, 100K voxels x 32
        channels, bf16) while the tuner's single-call timings sometimes ranked wgmma first. Between widths
        the covering tile wins: on MinkUNet18's full-resolution layers (a 2 x 200K indoor batch, H100, fp16)
        128 x 128 in 3 stages ran 96 -> 96 in 0.45 ms and 128 -> 96 in 0.42, against 0.62 and 0.60 in the
        best tile of 64 columns or wmma's 64 x 128, and their dgrad in 0.45 ms against 0.52 or more."""
        if channels < NARROWEST_COLUMNS:
            return []
        widest = covering_width(TILES, channels)
        return [tile for tile in TILES if tile[1] <= widest]

    def wgrad_plan_class_for(self, dtype, in_channels: int, out_channels: int) -> type[WgradPlan]:
        """Its own wgrad past 64 padded channels on both sides, where it ran faster than
        mma_implicit_gemm's (H100, side by side, 1M voxels: fp16 x 256 4.35 ms against 7.48, x 128 1.75
        against 2.05, x 80 1.64 against 1.66; TF32 x 256 9.6 against 11.2, x 128 3.57 against 3.65, x 96
        2.78 against 2.89); mma_implicit_gemm's elsewhere (the registry's: no import of another
        algorithm's module): at 64 channels a 64 x 64 wgmma tile ran slower (1M voxels, fp16: 1.18 ms
        against 1.04)."""
        if dtype in WGRAD_DTYPES and min(padded_channels(in_channels), padded_channels(out_channels)) >= \
                WGRAD_MIN_CHANNELS:
            return _WgmmaWgradPlan
        return get_algorithm("mma_implicit_gemm").wgrad_plan_class_for(dtype, in_channels, out_channels)

    def unsupported_reason(self, problem: ConvProblem) -> str | None:
        reason = gpu_only_reason(problem) or fp32_as_tf32_unsupported_reason(self, problem)
        if reason:
            return reason
        needed = pinned_capability(ARCHITECTURE)
        if problem.compute_capability != needed:
            return (f"{self.name} needs compute capability {needed // 10}.{needed % 10} exactly (wgmma, "
                    f"{ARCHITECTURE}); this GPU is sm_{problem.compute_capability}")
        if not nvrtc_knows(ARCHITECTURE):
            return f"{self.name} needs an NVRTC that compiles for {ARCHITECTURE} (CUDA 12.0 or newer)"
        return None

    def dgrad_stages_for(self, tile) -> int:
        return dgrad_stages(tile)

    def forward_weight_transposed(self, dtype) -> bool:
        return _forward_weight_transposed(dtype)

    def forward_sources(self, dtype, in_channels: int, tile, stages: int,
                        weight_transposed: bool) -> tuple[KernelSource, ...]:
        return (_SOURCES[dtype].source_of(_kernel_name(dtype, tile, stages, weight_transposed)),)  # any rows

    def gemm_plan(self, dtype, kernel_volume: int, in_channels: int, out_channels: int, tile, stages: int,
                  sort_rows: bool, weight_transposed: bool) -> ForwardGemmPlan:
        return _plan(current_device(), dtype, kernel_volume, in_channels, out_channels, tile, stages, sort_rows,
                     weight_transposed)
