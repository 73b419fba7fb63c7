"""`mma_implicit_gemm`: the tensor-core dataflow (`common`) through `mma.sync` and `ldmatrix` (sm_80+,
fp16 and bf16 features, and fp32 features as TF32 when `cupysparse.cuda.precision` allows it: the tensor
cores read them truncated to TF32; fp32 accumulation), kernels in raw_kernels/mma_implicit_gemm.cu.

The accumulators live in registers, warp tiles are up to 64 x 64, a 2- to 4-stage cp.async pipeline runs
in dynamic shared memory, and one kernel takes any channel count (16-byte copies where the rows allow
them, element copies elsewhere). wgrad's GEMM is its own mma.sync kernel.
"""

from __future__ import annotations

import functools
from typing import ClassVar

from cupysparse.cuda.backend import current_device
from cupysparse.cuda.compile import KernelFamily, KernelSource, PreparedLaunch
from cupysparse.cuda.dtypes import BFLOAT16, FLOAT16, FLOAT32, cuda_type_name, short_name
from cupysparse.algorithms.base import ConvProblem, gpu_only_reason, register
from cupysparse.algorithms.tensor_core.common import (
    CHANNEL_MULTIPLE,
    SHARED_SOURCES,
    WARP_SIZE,
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

STAGE_ROW_BYTES = 64  # of a feature row per pipeline stage: 32 fp16/bf16 channels, 16 fp32 (at most)
LDMATRIX_ROW_PAD_BYTES = 16  # shared-memory rows read by ldmatrix untransposed are padded by this
K_MAJOR_ROW_PAD = 8  # elements k-major rows are padded by (raw_kernels/mma_implicit_gemm.cu)
MAX_OFFSET_BATCH, ROW_TABLE_LIMIT = 32, 16 * 1024  # as in gather_tiles.cuh
# (rows, channels, warps along rows, warps along channels) of a block's output tile. The narrow ones (fewer
# than 128 x 32 outputs) serve narrow layers only (`auto_tiles`): at 16 and 32 channels on sparse LiDAR sweeps
# a small block skips more offsets that none of its rows has, as spconv's 32 x 16 tiles do.
TILES = ((128, 128, 2, 2), (128, 64, 2, 2), (64, 64, 2, 2), (128, 128, 2, 4), (256, 128, 4, 2), (128, 32, 4, 1),
         (64, 32, 2, 1), (64, 16, 4, 1), (32, 16, 2, 1))
NARROW_TILE_OUTPUTS = 128 * 32
# Pipeline depths: the default first. Two stages hold less shared memory, so more blocks share an SM: at
# 32 channels and 500K-1M voxels that hides the gathers' latency better than depth (H100, 1M x 32
# forward: 0.346 ms against 0.373 at three stages, fp16 and bf16 alike).
STAGES = (3, 4, 2)
DGRAD_STAGES = STAGES[0]
MIN_COMPUTE_CAPABILITY = 80
# Sides of a wgrad block's dW_k tile: on each side the smallest covering the padded channels, or the
# largest.
WGRAD_SIDES = (32, 64, 128)
WGRAD_STAGES = 3
FEATURE_DTYPES = tuple(dtype for dtype in (FLOAT16, BFLOAT16, FLOAT32) if dtype is not None)


def _mma_k(itemsize: int) -> int:
    """The k of one mma: 16 for fp16/bf16 (m16n8k16), 8 for TF32 (m16n8k8)."""
    return 16 if itemsize == 2 else 8


def _block_k(itemsize: int, in_padded: int) -> int:
    """Input channels per pipeline stage: `STAGE_ROW_BYTES` of them, or one mma's k where that does not divide
    the padded channels (16 or 48 fp16 channels: no stage half zeros)."""
    widest = STAGE_ROW_BYTES // itemsize
    return widest if in_padded % widest == 0 else _mma_k(itemsize)


def _block_ks(itemsize: int) -> tuple[int, ...]:
    """Every `_block_k` of some padded channel count (multiples of `CHANNEL_MULTIPLE`)."""
    return tuple(sorted({_block_k(itemsize, CHANNEL_MULTIPLE * n) for n in (1, 2)}))


def _wgrad_pairs(itemsize: int) -> int:
    """Pairs per wgrad pipeline stage: two k steps (WgradSharedLayout::PAIRS)."""
    return 2 * _mma_k(itemsize)


def _wgrad_tile(in_padded: int, out_padded: int) -> tuple[int, int, int, int]:
    rows = next((side for side in WGRAD_SIDES if side >= in_padded), WGRAD_SIDES[-1])
    cols = next((side for side in WGRAD_SIDES if side >= out_padded), WGRAD_SIDES[-1])
    return rows, cols, _wgrad_warps(rows), _wgrad_warps(cols)


def _wgrad_warps(side: int) -> int:
    """Warps along a wgrad tile side: 32-wide warp tiles up to 64, 64-wide beyond (more operand reuse)."""
    return side // 32 if side <= 64 else side // 64


def _kernel_name(dtype, tile, block_k: int, stages: int, weight_transposed: bool) -> str:
    rows, cols, warps_m, warps_n = tile
    flag = "true" if weight_transposed else "false"
    return (f"mma_conv_forward<{cuda_type_name(dtype)}, {rows}, {cols}, {block_k}, {warps_m}, {warps_n}, "
            f"{stages}, {flag}>")


def _wgrad_kernel_name(dtype, tile) -> str:
    rows, cols, warps_m, warps_n = tile
    return f"mma_conv_wgrad<{cuda_type_name(dtype)}, {rows}, {cols}, {warps_m}, {warps_n}, {WGRAD_STAGES}>"


def _kernel_family(dtype) -> KernelFamily:
    block_ks = _block_ks(dtype.itemsize)
    forward = tuple(_kernel_name(dtype, tile, block_k, stages, False)
                    for tile in TILES for block_k in block_ks for stages in STAGES)
    dgrad = tuple(_kernel_name(dtype, tile, block_k, DGRAD_STAGES, True) for tile in TILES for block_k in block_ks)
    wgrad = tuple(_wgrad_kernel_name(dtype, _wgrad_tile(rows, cols)) for rows in WGRAD_SIDES for cols in WGRAD_SIDES)
    # One module per kernel: a process compiles only the ones it launches, a layer's candidates side by side.
    return KernelFamily("mma_implicit_gemm.cu", ((name,) for name in (*forward, *dgrad, *wgrad)))


_SOURCES = {dtype: _kernel_family(dtype) for dtype in FEATURE_DTYPES}


def shared_bytes(tile, stages: int, weight_transposed: bool, itemsize: int = 2, block_k: int | None = None) -> int:
    """Dynamic shared memory of one block: `ForwardSharedLayout::BYTES` in the kernel source (`block_k`: the
    widest by default)."""
    rows, cols, warps_m, warps_n = tile
    block_k = block_k or STAGE_ROW_BYTES // itemsize
    ldmatrix_pad = LDMATRIX_ROW_PAD_BYTES // itemsize
    a_bytes = rows * (block_k + ldmatrix_pad) * itemsize
    b_elements = cols * (block_k + ldmatrix_pad) if weight_transposed else block_k * (cols + K_MAJOR_ROW_PAD)
    offset_batch = min(MAX_OFFSET_BATCH, ROW_TABLE_LIMIT // (rows * 4))
    return stages * (a_bytes + b_elements * itemsize) + offset_batch * rows * 4 + rows * 4 + warps_m * warps_n * 4


class MmaWgradPlan(DynamicSharedWgradPlan):
    """wgrad with `mma_conv_wgrad` as the GEMM: one kernel per tile for any rows."""

    @staticmethod
    def tile_for(in_padded: int, out_padded: int) -> tuple:
        return _wgrad_tile(in_padded, out_padded)

    def threads(self, tile) -> int:
        return tile[2] * tile[3] * WARP_SIZE

    @staticmethod
    def kernel_name(dtype, tile) -> str:
        return _wgrad_kernel_name(dtype, tile)

    @staticmethod
    def kernel_family(dtype) -> KernelFamily:
        return _SOURCES[dtype]

    @staticmethod
    def gemm_shared_bytes(dtype, tile) -> int:
        """`WgradSharedLayout::BYTES` in the kernel source: the stages, then the pair indices (both lists)
        of 2 (stages - 1) steps."""
        rows, cols = tile[:2]
        pairs = _wgrad_pairs(dtype.itemsize)
        indices = 2 * (WGRAD_STAGES - 1) * 2 * pairs * 4
        return WGRAD_STAGES * pairs * (rows + cols + 2 * K_MAJOR_ROW_PAD) * dtype.itemsize + indices


@functools.cache
def _plan(device: int, dtype, kernel_volume: int, in_channels: int, out_channels: int, tile, stages: int,
          sort_rows: bool, weight_transposed: bool) -> ForwardGemmPlan:
    """The plan of `mma_conv_forward` for this signature on `device`, made on first use."""
    rows, cols, warps_m, warps_n = tile
    block_k = _block_k(dtype.itemsize, padded_channels(in_channels))
    kernel = PreparedLaunch(_SOURCES[dtype].get(_kernel_name(dtype, tile, block_k, stages, weight_transposed)), (1,),
                            (warps_m * warps_n * WARP_SIZE,),
                            forward_arguments(kernel_volume, in_channels, out_channels),
                            shared_bytes(tile, stages, weight_transposed, dtype.itemsize, block_k))
    return ForwardGemmPlan(dtype, in_channels, out_channels, rows, cols, sort_rows, kernel)


@register
class MmaImplicitGemm(TensorCoreImplicitGemm):
    name = "mma_implicit_gemm"
    kernel_sources = ("mma_implicit_gemm.cu", *SHARED_SOURCES)
    tuning_namespaces: ClassVar[dict[str, str]] = {
        "forward": "mma_implicit_gemm_sm80",
        "backward": "mma_implicit_gemm_backward_sm80",
    }
    forward_params: ClassVar[dict[str, tuple]] = {"tile": TILES, "sort_rows": (True, False), "stages": STAGES}
    # `tile` tunes dgrad, `wgrad_warps_per_sm` wgrad.
    backward_params: ClassVar[dict[str, tuple]] = {"tile": TILES, "wgrad_warps_per_sm": WGRAD_WARPS_PER_SM}
    dgrad_stages: ClassVar[int] = DGRAD_STAGES
    feature_dtypes: ClassVar[tuple] = FEATURE_DTYPES

    def auto_tiles(self, channels: int) -> list[tuple]:
        """None wider than the narrowest that covers the padded output channels; the narrow ones only where
        they cover them. Between widths the covering tile can win: 96 channels on 346K voxels of the outdoor
        sweep ran 0.58 ms in 128 x 128 tiles against 0.73 in its best of 64 columns (H100, fp16)."""
        widest = max(32, covering_width(TILES, channels))
        return [tile for tile in TILES
                if tile[1] <= widest and (tile[0] * tile[1] >= NARROW_TILE_OUTPUTS or channels <= tile[1])]

    def unsupported_reason(self, problem: ConvProblem) -> str | None:
        reason = gpu_only_reason(problem) or fp32_as_tf32_unsupported_reason(self, problem)
        if reason:
            return reason
        if (problem.compute_capability or 0) < MIN_COMPUTE_CAPABILITY:
            return (f"{self.name} needs compute capability 8.0 or newer (mma.sync for {short_name(problem.dtype)}); "
                    f"this GPU is sm_{problem.compute_capability}")
        return None

    def forward_sources(self, dtype, in_channels: int, tile, stages: int,
                        weight_transposed: bool) -> tuple[KernelSource, ...]:
        block_k = _block_k(dtype.itemsize, padded_channels(in_channels))
        return (_SOURCES[dtype].source_of(_kernel_name(dtype, tile, block_k, stages, weight_transposed)),)  # any rows

    def gemm_plan(self, dtype, kernel_volume: int, in_channels: int, out_channels: int, tile, stages: int,
                  sort_rows: bool, weight_transposed: bool) -> ForwardGemmPlan:
        return _plan(current_device(), dtype, kernel_volume, in_channels, out_channels, tile, stages, sort_rows,
                     weight_transposed)

    def wgrad_plan_class_for(self, dtype, in_channels: int, out_channels: int) -> type[WgradPlan]:
        return MmaWgradPlan
