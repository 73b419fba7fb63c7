"""`mma_implicit_gemm`: implicit GEMM on tensor cores through `mma.sync` and `ldmatrix` (sm_80+,
fp16 and bf16 features, and fp32 features as TF32 when `cupysparse.cuda.precision` allows it: the tensor
cores read them truncated to TF32; fp32 accumulation), kernels in raw_kernels/mma_implicit_gemm.cu.

The dataflow is wmma_implicit_gemm's (output-stationary tiles over the mask-sorted rows, offsets a
tile's rows lack skipped, each output written once, dgrad as the same kernel reading the weight
transposed over `dgrad_operands`), with the accumulators in registers, warp tiles up to 64 x 64, a
2- to 4-stage cp.async pipeline in dynamic shared memory, and any channel count in the same kernel
(16-byte copies where the rows allow them, element copies elsewhere). wgrad is wmma_implicit_gemm's
split-K dataflow (shares, workspace, ordered sum) with its own mma.sync GEMM kernel.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import numpy as np

from cupysparse.cuda.backend import cupy_module, current_device
from cupysparse.cuda.compile import KernelFamily, KernelSource, PreparedLaunch
from cupysparse.cuda.dtypes import BFLOAT16, FLOAT16, FLOAT32, cuda_type_name, short_name
from cupysparse.settings import FP32_PRECISION
from cupysparse.algorithms.base import ConvProblem, gpu_only_reason, register
from cupysparse.algorithms.tensor_core.wmma import (
    AUTO_WGRAD_WARPS_PER_SM,
    LastMapValues,
    NO_WGRAD_SUM,
    VECTOR_BYTES,
    WGRAD_SUM_ARGUMENTS,
    WGRAD_WARPS_PER_SM,
    WgradPlan,
    WgradSum,
    WmmaImplicitGemm,
    check_operand,
    check_weight,
    dgrad_operands,
    forward_map_values,
    padded_channels,
    with_wgrad_sum,
)

WARP_SIZE = 32
STAGE_ROW_BYTES = 64  # of a feature row per pipeline stage: 32 fp16/bf16 channels, 16 fp32
LDMATRIX_ROW_PAD_BYTES = 16  # shared-memory rows read by ldmatrix untransposed are padded by this
K_MAJOR_ROW_PAD = 8  # elements k-major rows are padded by (raw_kernels/mma_implicit_gemm.cu)
MAX_OFFSET_BATCH, ROW_TABLE_LIMIT = 32, 16 * 1024  # as in gather_tiles.cuh
# (rows, channels, warps along rows, warps along channels) of a block's output tile.
TILES = ((128, 128, 2, 2), (128, 64, 2, 2), (64, 64, 2, 2), (128, 128, 2, 4), (256, 128, 4, 2), (128, 32, 4, 1))
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


def _block_k(itemsize: int) -> int:
    return STAGE_ROW_BYTES // itemsize


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


def _kernel_name(dtype, tile, stages: int, weight_transposed: bool) -> str:
    rows, cols, warps_m, warps_n = tile
    flag = "true" if weight_transposed else "false"
    block_k = _block_k(dtype.itemsize)
    return (f"mma_conv_forward<{cuda_type_name(dtype)}, {rows}, {cols}, {block_k}, {warps_m}, {warps_n}, "
            f"{stages}, {flag}>")


def _wgrad_kernel_name(dtype, tile) -> str:
    rows, cols, warps_m, warps_n = tile
    return f"mma_conv_wgrad<{cuda_type_name(dtype)}, {rows}, {cols}, {warps_m}, {warps_n}, {WGRAD_STAGES}>"


def _kernel_family(dtype) -> KernelFamily:
    forward = tuple(_kernel_name(dtype, tile, stages, False) for tile in TILES for stages in STAGES)
    dgrad = tuple(_kernel_name(dtype, tile, DGRAD_STAGES, True) for tile in TILES)
    wgrad = tuple(_wgrad_kernel_name(dtype, _wgrad_tile(rows, cols)) for rows in WGRAD_SIDES for cols in WGRAD_SIDES)
    # One module per kernel: a process compiles only the ones it launches, a layer's candidates side by side.
    return KernelFamily("mma_implicit_gemm.cu", ((name,) for name in (*forward, *dgrad, *wgrad)))


_SOURCES = {dtype: _kernel_family(dtype) for dtype in FEATURE_DTYPES}


def shared_bytes(tile, stages: int, weight_transposed: bool, itemsize: int = 2) -> int:
    """Dynamic shared memory of one block: `ForwardSharedLayout::BYTES` in the kernel source."""
    rows, cols, warps_m, warps_n = tile
    block_k, ldmatrix_pad = _block_k(itemsize), LDMATRIX_ROW_PAD_BYTES // itemsize
    a_bytes = rows * (block_k + ldmatrix_pad) * itemsize
    b_elements = cols * (block_k + ldmatrix_pad) if weight_transposed else block_k * (cols + K_MAJOR_ROW_PAD)
    offset_batch = min(MAX_OFFSET_BATCH, ROW_TABLE_LIMIT // (rows * 4))
    return stages * (a_bytes + b_elements * itemsize) + offset_batch * rows * 4 + rows * 4 + warps_m * warps_n * 4


def _check_tile(tile, phase: str) -> tuple[int, int, int, int]:
    tile = tuple(tile)
    if tile not in TILES:
        raise ValueError(f"mma_implicit_gemm {phase} tile must be one of {TILES}, got {tile}")
    return tile


class MmaWgradPlan(WgradPlan):
    """wmma_implicit_gemm's wgrad plan (shares, workspace, sum) with `mma_conv_wgrad` as the GEMM: one
    kernel per tile for any rows (16-byte copies or not is an argument). A subclass swaps the kernel
    (`tile_for`, `threads`, `kernel_name`, `kernel_family`, `gemm_shared_bytes`)."""

    @staticmethod
    def tile_for(in_padded: int, out_padded: int) -> tuple:
        return _wgrad_tile(in_padded, out_padded)

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

    @classmethod
    def gemm_sources(cls, dtype, tile, vectors: bool) -> tuple[KernelSource, ...]:
        return (cls.kernel_family(dtype).source_of(cls.kernel_name(dtype, tile)),)

    def threads(self, tile) -> int:
        return tile[2] * tile[3] * WARP_SIZE

    def prepare_gemm(self, dtype, tile, arguments) -> None:
        kernel = self.kernel_family(dtype).get(self.kernel_name(dtype, tile))
        self.gemm = PreparedLaunch(kernel, (1,), (self.threads(tile),), (*arguments, None),
                                   self.gemm_shared_bytes(dtype, tile))

    def launch_gemm(self, stream: int, grid, values: tuple, vectors: bool) -> None:
        self.gemm.launch(stream, *values, int(vectors), grid=grid)


def forward_arguments(kernel_volume: int, in_channels: int, out_channels: int) -> tuple:
    """The fixed arguments of an output-stationary forward kernel (`mma_conv_forward`,
    `wgmma_conv_forward`): features, pair table, row order, weight, out and the row count, then
    vector_rows, the offset order and the wgrad sum's four, are per call."""
    sizes = (kernel_volume, in_channels, padded_channels(in_channels), out_channels, padded_channels(out_channels))
    return (None, None, None, None, None, None, *(np.int32(size) for size in sizes), None, None, *WGRAD_SUM_ARGUMENTS)


class ForwardGemmPlan:
    """The launch of an output-stationary forward kernel (`forward_arguments`) for one dtype, channel
    counts, tile and row order, over any pair table of the kernel volume it was prepared for; dgrad
    launches it over `dgrad_operands` with the weight read transposed. `kernel` is the prepared launch
    of the tile's kernel (block size and shared memory set), `rows` x `cols` its output tile."""

    def __init__(self, dtype, in_channels: int, out_channels: int, rows: int, cols: int, sort_rows: bool,
                 kernel: PreparedLaunch):
        self.dtype = dtype
        self.out_channels = out_channels
        self.vector_rows = in_channels * dtype.itemsize % VECTOR_BYTES == 0
        self.kernel = kernel
        column_tiles = -(-padded_channels(out_channels) // cols)
        self._map_values = LastMapValues(functools.partial(forward_map_values, rows, column_tiles, sort_rows))

    def launch(self, kernel_map, features: int, weight: int, out: int, stream: int,
               reverse_weight_offsets: int = 0, wgrad_sum: WgradSum | None = None) -> None:
        """Launch over `kernel_map`'s pair table on device addresses (row-major; the weight padded, in
        the layout the plan reads, its offsets taken in reverse when `reverse_weight_offsets`), on the
        raw CUDA stream handle `stream`; with `wgrad_sum`, a dgrad launch that sums wgrad's partials too."""
        table, order, num_out, grid = self._map_values(kernel_map)
        sum_arguments = NO_WGRAD_SUM
        if wgrad_sum is not None:
            grid, sum_arguments = with_wgrad_sum(grid, self.kernel.block_threads, wgrad_sum)
        vector_rows = 1 if self.vector_rows and not features % VECTOR_BYTES else 0
        self.kernel.launch(stream, features, table, order, weight, out, num_out, vector_rows,
                           reverse_weight_offsets, *sum_arguments, grid=grid)

    def __call__(self, kernel_map, features, padded_weight, reverse_weight_offsets: int = 0):
        cupy = cupy_module()
        out = cupy.empty((kernel_map.num_out, self.out_channels), dtype=self.dtype)  # every element is written once
        self.launch(kernel_map, features.data.ptr, padded_weight.data.ptr, out.data.ptr,
                    cupy.cuda.get_current_stream().ptr, reverse_weight_offsets)
        return out


@functools.cache
def _plan(device: int, dtype, kernel_volume: int, in_channels: int, out_channels: int, tile, stages: int,
          sort_rows: bool, weight_transposed: bool) -> ForwardGemmPlan:
    """The plan of `mma_conv_forward` for this signature on `device`, made on first use."""
    rows, cols, warps_m, warps_n = tile
    kernel = PreparedLaunch(_SOURCES[dtype].get(_kernel_name(dtype, tile, stages, weight_transposed)), (1,),
                            (warps_m * warps_n * WARP_SIZE,),
                            forward_arguments(kernel_volume, in_channels, out_channels),
                            shared_bytes(tile, stages, weight_transposed, dtype.itemsize))
    return ForwardGemmPlan(dtype, in_channels, out_channels, rows, cols, sort_rows, kernel)


@register
class MmaImplicitGemm(WmmaImplicitGemm):
    name = "mma_implicit_gemm"
    kernel_sources = ("mma_implicit_gemm.cu", "wgrad_sum.cu")
    tuning_namespaces: ClassVar[dict[str, str]] = {
        "forward": "mma_implicit_gemm_sm80",
        "backward": "mma_implicit_gemm_backward_sm80",
    }
    forward_params: ClassVar[dict[str, tuple]] = {"tile": TILES, "sort_rows": (True, False), "stages": STAGES}
    # `tile` tunes dgrad, `wgrad_warps_per_sm` wgrad.
    backward_params: ClassVar[dict[str, tuple]] = {"tile": TILES, "wgrad_warps_per_sm": WGRAD_WARPS_PER_SM}
    dgrad_stages: ClassVar[int] = DGRAD_STAGES
    feature_dtypes: ClassVar[tuple] = FEATURE_DTYPES

    def wgrad_plan_class_for(self, dtype, in_channels: int, out_channels: int) -> type[WgradPlan]:
        return MmaWgradPlan

    def auto_priority(self, problem: ConvProblem) -> int:
        """wmma_implicit_gemm's tier, so `auto` measures both: on an H200 this one is ahead from 64
        channels up (1M voxels x 256: forward 5.4 ms against 7.4, wgrad 6.2 against 9.6), and on an
        H100 at 100K voxels x 32 and x 64 too, at 16 warps per SM each (x 64 wgrad: fp16 0.065 ms
        against 0.075, bf16 0.065 against 0.097, whose wmma fragments load element by element)."""
        return 2

    def auto_param_grid(self, phase: str, problem: ConvProblem) -> list[dict]:
        """Sorted rows, every depth, and the tiles `auto_tiles` keeps for the padded output channels
        (dgrad's are the layer's inputs); wgrad's occupancy targets AUTO_WGRAD_WARPS_PER_SM."""
        tiles = self.auto_tiles(padded_channels(problem.out_channels if phase == "forward" else problem.in_channels))
        if phase == "forward":
            stages = self.forward_params["stages"]
            return [{"tile": tile, "sort_rows": True, "stages": depth} for tile in tiles for depth in stages]
        return [{"tile": tile, "wgrad_warps_per_sm": warps} for tile in tiles for warps in AUTO_WGRAD_WARPS_PER_SM]

    def auto_tiles(self, channels: int) -> list[tuple]:
        """The tiles `auto` tries for `channels` padded output channels: none wider than they need."""
        return [tile for tile in TILES if tile[1] <= max(32, channels)]

    def unsupported_reason(self, problem: ConvProblem) -> str | None:
        reason = gpu_only_reason(problem) or self.dtype_unsupported_reason(problem)
        if reason:
            return reason
        if (problem.compute_capability or 0) < MIN_COMPUTE_CAPABILITY:
            return (f"{self.name} needs compute capability 8.0 or newer (mma.sync for {short_name(problem.dtype)}); "
                    f"this GPU is sm_{problem.compute_capability}")
        return None

    def dtype_unsupported_reason(self, problem: ConvProblem) -> str | None:
        """Why the features' dtype cannot run: fp32 unless TF32 is chosen, or no kernel for it."""
        if problem.dtype == FLOAT32 and not problem.tf32:
            return (f"{self.name} runs fp32 only in TF32, and exact fp32 is chosen (TF32: "
                    f"cupysparse.cuda.precision.set_fp32_precision('tf32') or {FP32_PRECISION.name}=tf32)")
        if problem.dtype not in self.feature_dtypes:
            return f"{self.name} runs fp16, bf16 and TF32 on tensor cores, not {short_name(problem.dtype)}"
        return None

    def forward(self, features, weight, kernel_map, tile=TILES[0], sort_rows: bool = True, stages: int = STAGES[0]):
        weight = self.prepare_weight(weight)
        tile = self.checked_tile(tile, "forward")
        check_weight(weight, kernel_map)
        check_operand(self, "features", features, "the weight", weight.dtype, kernel_map.num_in, weight.in_channels)
        if stages not in self.forward_params["stages"]:
            raise ValueError(f"{self.name} stages must be one of {self.forward_params['stages']}, got {stages!r}")
        transposed = self.forward_weight_transposed(weight.dtype)
        padded = cupy_module().ascontiguousarray(weight.padded.transpose(0, 2, 1)) if transposed else weight.padded
        return self._run(features, kernel_map, sort_rows, padded, weight.in_channels, weight.out_channels, tile,
                         stages, transposed)

    def dgrad(self, grad_output, weight, kernel_map, tile=TILES[0], wgrad_warps_per_sm: int = WGRAD_WARPS_PER_SM[0]):
        weight = self.prepare_weight(weight)
        tile = self.checked_tile(tile, "dgrad")
        check_weight(weight, kernel_map)
        check_operand(self, "grad_output", grad_output, "the weight", weight.dtype, kernel_map.num_out,
                      weight.out_channels)
        table_map, reverse_weight_offsets = dgrad_operands(kernel_map)
        return self._run(grad_output, table_map, True, weight.padded, weight.out_channels, weight.in_channels, tile,
                         self.dgrad_stages_for(tile), True, reverse_weight_offsets)

    def wgrad(self, features, grad_output, kernel_map, tile=TILES[0], wgrad_warps_per_sm: int = WGRAD_WARPS_PER_SM[0]):
        self.checked_tile(tile, "wgrad")
        return super().wgrad(features, grad_output, kernel_map, wgrad_warps_per_sm=wgrad_warps_per_sm)

    def _run(self, features, kernel_map, sort_rows: bool, padded_weight, in_channels: int, out_channels: int, tile,
             stages: int, weight_transposed: bool, reverse_weight_offsets: int = 0):
        cupy = cupy_module()
        kernel_volume, num_out = kernel_map.pair_table.shape
        if 0 in (num_out, out_channels, features.shape[0], kernel_volume, in_channels):
            return cupy.zeros((num_out, out_channels), dtype=features.dtype)
        features = cupy.ascontiguousarray(features)
        plan = self.gemm_plan(np.dtype(features.dtype), kernel_volume, in_channels, out_channels, tile, stages,
                              sort_rows, weight_transposed)
        return plan(kernel_map, features, padded_weight, reverse_weight_offsets)

    def checked_tile(self, tile, phase: str) -> tuple:
        return _check_tile(tile, phase)

    def forward_sources(self, dtype, in_channels: int, tile, stages: int,
                        weight_transposed: bool) -> tuple[KernelSource, ...]:
        return (_SOURCES[dtype].source_of(_kernel_name(dtype, tile, stages, weight_transposed)),)  # any rows

    def gemm_plan(self, dtype, kernel_volume: int, in_channels: int, out_channels: int, tile, stages: int,
                  sort_rows: bool, weight_transposed: bool) -> ForwardGemmPlan:
        return _plan(current_device(), dtype, kernel_volume, in_channels, out_channels, tile, stages, sort_rows,
                     weight_transposed)
