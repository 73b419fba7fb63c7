"""`wmma_implicit_gemm`: the tensor-core dataflow (`common`) through `nvcuda::wmma` (fp16 and bf16
features, fp32 accumulation), kernels in raw_kernels/wmma_implicit_gemm.cu.

Every warp computes 32 x 32 of its block's tile in 16 x 16 fragments staged in static shared memory.
With channel counts that are multiples of 8 the gathers run `stages` deep through cp.async (sm_80+),
overlapping the tensor-core work; other channel counts take the synchronous kernel, element by element.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import numpy as np

from cupysparse.cuda.backend import cupy_module, current_device
from cupysparse.cuda.compile import KernelFamily, KernelSource, PreparedLaunch
from cupysparse.cuda.dtypes import BFLOAT16, FLOAT16, cuda_type_name, short_name
from cupysparse.algorithms.base import ConvProblem, gpu_only_reason, register
from cupysparse.algorithms.tensor_core.common import (
    EPILOGUE_ARGUMENTS,
    NO_EPILOGUE,
    NO_WGRAD_SUM,
    SHARED_SOURCES,
    VECTOR_BYTES,
    WARP_SIZE,
    WGRAD_SUM_ARGUMENTS,
    WGRAD_WARPS_PER_SM,
    TensorCoreImplicitGemm,
    WgradPlan,
    WgradSum,
    current_stream,
    forward_map_values,
    padded_channels,
    with_wgrad_sum,
)

WARP_TILE = 32  # every warp computes 32 x 32 of its block's tile (raw_kernels/wmma_implicit_gemm.cu)
# (rows, channels) of a forward / dgrad block's output tile.
FORWARD_TILES = ((64, 64), (128, 64), (64, 128), (128, 32))
# Depth of the forward / dgrad cp.async pipeline; 1 is the synchronous kernel for any channel count.
PIPELINE_STAGES = (3, 2)
SYNCHRONOUS_STAGES = 1
DGRAD_STAGES = PIPELINE_STAGES[0]
WGRAD_STAGES = 3
# (C_in, C_out) of a wgrad block's dW_k tile, each side the smallest of these covering the padded
# channels (or the largest), so small channel counts leave no warp idle.
WGRAD_TILE_ROWS = (32, 64)
WGRAD_TILE_COLS = (32, 64, 128)
WGRAD_TILES = tuple((rows, cols) for rows in WGRAD_TILE_ROWS for cols in WGRAD_TILE_COLS)
BLOCK_KS = (16, 32)  # input channels per forward stage: 32 when the padded count allows it

MIN_COMPUTE_CAPABILITY = {FLOAT16: 70, BFLOAT16: 80}


def _forward_kernel_name(type_name: str, tile: tuple[int, int], block_k: int, stages: int,
                         weight_transposed: bool) -> str:
    flag = "true" if weight_transposed else "false"
    return f"wmma_conv_forward<{type_name}, {tile[0]}, {tile[1]}, {block_k}, {stages}, {flag}>"


def _wgrad_kernel_name(type_name: str, tile: tuple[int, int], stages: int) -> str:
    return f"wmma_conv_wgrad<{type_name}, {tile[0]}, {tile[1]}, {stages}>"


def _block_k(in_padded: int) -> int:
    """Input channels per forward stage: the stages tile the padded input channels exactly."""
    return BLOCK_KS[1] if in_padded % BLOCK_KS[1] == 0 else BLOCK_KS[0]


def _kernel_family(dtype) -> KernelFamily:
    type_name = cuda_type_name(dtype)
    forward = tuple(
        _forward_kernel_name(type_name, tile, block_k, stages, False)
        for tile in FORWARD_TILES
        for block_k in BLOCK_KS
        for stages in (*PIPELINE_STAGES, SYNCHRONOUS_STAGES)
    )
    dgrad = tuple(
        _forward_kernel_name(type_name, tile, block_k, stages, True)
        for tile in FORWARD_TILES
        for block_k in BLOCK_KS
        for stages in (DGRAD_STAGES, SYNCHRONOUS_STAGES)
    )
    wgrad = tuple(
        _wgrad_kernel_name(type_name, tile, stages)
        for tile in WGRAD_TILES
        for stages in (WGRAD_STAGES, SYNCHRONOUS_STAGES)
    )
    # One module per kernel: a layer's tuning launches a few of them, which then compile side by side.
    return KernelFamily("wmma_implicit_gemm.cu", ((name,) for name in (*forward, *dgrad, *wgrad)))


# Sources per dtype: the bf16 fragments exist from sm_80 on, and nothing bf16 may be compiled for an
# sm_7x GPU running fp16.
_SOURCES = {dtype: _kernel_family(dtype) for dtype in (FLOAT16, BFLOAT16) if dtype is not None}


def _threads(tile: tuple[int, int]) -> int:
    return (tile[0] // WARP_TILE) * (tile[1] // WARP_TILE) * WARP_SIZE


def _wgrad_tile(in_padded: int, out_padded: int) -> tuple[int, int]:
    """The smallest wgrad tile side covering each padded channel count, or the largest side."""
    rows = next((side for side in WGRAD_TILE_ROWS if side >= in_padded), WGRAD_TILE_ROWS[-1])
    cols = next((side for side in WGRAD_TILE_COLS if side >= out_padded), WGRAD_TILE_COLS[-1])
    return rows, cols


class _LazyLaunches(dict):
    """`PreparedLaunch`es by pipeline depth, each prepared on first use: most layers only ever launch
    one of a plan's variants."""

    def __init__(self, prepare):
        super().__init__()
        self._prepare = prepare

    def __missing__(self, stages: int) -> PreparedLaunch:
        launch = self[stages] = self._prepare(stages)
        return launch


class _GemmPlan:
    """The launches of `wmma_conv_forward` for one dtype, kernel volume, channel counts, tile, pipeline
    depth, row order and weight layout, over any pair table of that kernel volume: made once per
    signature, so that a call over a new map only allocates its output and launches."""

    def __init__(self, dtype, kernel_volume: int, in_channels: int, out_channels: int, tile, stages: int,
                 sort_rows: bool, weight_transposed: bool):
        in_padded, out_padded = padded_channels(in_channels), padded_channels(out_channels)
        self.dtype = dtype
        self.out_channels = out_channels
        self.threads = _threads(tile)
        block_k = _block_k(in_padded)
        type_name = cuda_type_name(dtype)
        sizes = tuple(np.int32(size) for size in (kernel_volume, in_channels, in_padded, out_channels, out_padded))
        # features, pair table, row order, weight, out, the row count, the offset order, the wgrad sum's
        # four and the epilogue's four are per call.
        arguments = (None, None, None, None, None, None, *sizes, None, *WGRAD_SUM_ARGUMENTS, *EPILOGUE_ARGUMENTS)

        def prepared(kernel_stages: int) -> PreparedLaunch:
            name = _forward_kernel_name(type_name, tile, block_k, kernel_stages, weight_transposed)
            return PreparedLaunch(_SOURCES[dtype].get(name), (1,), (self.threads,), arguments)

        self.vector_rows = in_channels * dtype.itemsize % VECTOR_BYTES == 0
        self._launches = _LazyLaunches(prepared)
        self._stages = stages
        self._map_values = functools.partial(forward_map_values, tile[0], -(-out_padded // tile[1]), sort_rows)

    def launch(self, kernel_map, features: int, weight: int, out: int, stream: int,
               reverse_weight_offsets: int = 0, wgrad_sum: WgradSum | None = None,
               epilogue: tuple[int, int, int, int] = NO_EPILOGUE) -> None:
        """Launch over `kernel_map`'s pair table on device addresses (row-major arrays; the weight padded,
        in the layout the plan reads, its offsets taken in reverse when `reverse_weight_offsets`), on the
        raw CUDA stream handle `stream`; with `wgrad_sum`, a dgrad launch that sums wgrad's partials too;
        `epilogue` the forward's (`EPILOGUE_ARGUMENTS`)."""
        table, order, num_out, grid = kernel_map.derived(self, self._map_values)
        sum_arguments = NO_WGRAD_SUM
        if wgrad_sum is not None:
            grid, sum_arguments = with_wgrad_sum(grid, self.threads, wgrad_sum)
        # The pipelined kernel copies 16-byte vectors: rows and base address must allow them.
        pipelined = self.vector_rows and not features % VECTOR_BYTES
        self._launches[self._stages if pipelined else SYNCHRONOUS_STAGES].launch(
            stream, features, table, order, weight, out, num_out, reverse_weight_offsets, *sum_arguments, *epilogue,
            grid=grid)

    def __call__(self, kernel_map, features, padded_weight, reverse_weight_offsets: int = 0):
        out = cupy_module().empty((kernel_map.num_out, self.out_channels), dtype=self.dtype)  # all written once
        self.launch(kernel_map, features.data.ptr, padded_weight.data.ptr, out.data.ptr, current_stream(),
                    reverse_weight_offsets)
        return out


@functools.cache
def _gemm_plan(device: int, dtype, kernel_volume: int, in_channels: int, out_channels: int, tile, stages: int,
               sort_rows: bool, weight_transposed: bool) -> _GemmPlan:
    """`_GemmPlan` for this signature on `device`, made on first use."""
    return _GemmPlan(dtype, kernel_volume, in_channels, out_channels, tile, stages, sort_rows, weight_transposed)


class WmmaWgradPlan(WgradPlan):
    """wgrad with `wmma_conv_wgrad` as the GEMM: a pipelined kernel for rows that allow 16-byte copies, the
    synchronous one for the others, each prepared on first use."""

    @staticmethod
    def tile_for(in_padded: int, out_padded: int) -> tuple:
        return _wgrad_tile(in_padded, out_padded)

    def threads(self, tile) -> int:
        return _threads(tile)

    @classmethod
    def gemm_sources(cls, dtype, tile, vectors: bool) -> tuple[KernelSource, ...]:
        name = _wgrad_kernel_name(cuda_type_name(dtype), tile, WGRAD_STAGES if vectors else SYNCHRONOUS_STAGES)
        return (_SOURCES[dtype].source_of(name),)

    def prepare_gemm(self, dtype, tile, arguments) -> None:
        type_name = cuda_type_name(dtype)
        self._gemms = _LazyLaunches(lambda stages: PreparedLaunch(
            _SOURCES[dtype].get(_wgrad_kernel_name(type_name, tile, stages)), (1,), (self.threads(tile),), arguments))

    def launch_gemm(self, stream: int, grid, values: tuple, vectors: bool) -> None:
        self._gemms[WGRAD_STAGES if vectors else SYNCHRONOUS_STAGES].launch(stream, *values, grid=grid)


@register
class WmmaImplicitGemm(TensorCoreImplicitGemm):
    name = "wmma_implicit_gemm"
    kernel_sources = ("wmma_implicit_gemm.cu", *SHARED_SOURCES)
    feature_dtypes: ClassVar[tuple] = tuple(_SOURCES)
    tuning_namespaces: ClassVar[dict[str, str]] = {
        "forward": "wmma_implicit_gemm_sm80",
        "backward": "wmma_split_k_implicit_gemm_sm80",
    }
    forward_params: ClassVar[dict[str, tuple]] = {
        "tile": FORWARD_TILES,
        "sort_rows": (True, False),
        "stages": PIPELINE_STAGES,
    }
    # `tile` tunes dgrad, `wgrad_warps_per_sm` wgrad (one parameter space serves both backward phases).
    backward_params: ClassVar[dict[str, tuple]] = {"tile": FORWARD_TILES, "wgrad_warps_per_sm": WGRAD_WARPS_PER_SM}
    dgrad_stages: ClassVar[int] = DGRAD_STAGES

    def auto_tiles(self, channels: int) -> list[tuple]:
        """Measured on an H200 (fp16, 65K-1M voxels, 32-256 channels, every combination): the
        fastest forward always sorted its rows, and within 10% of it was always a tile as wide as
        the output channels allow (32 → (128, 32); 64 → (128, 64); wider → (64, 128) or (128, 64));
        the pipeline depth and the wgrad occupancy varied, so those stay tuned."""
        if channels <= 32:
            return [(128, 32)]
        return [(128, 64), (128, 32)] if channels <= 64 else [(64, 128), (128, 64)]

    def unsupported_reason(self, problem: ConvProblem) -> str | None:
        reason = gpu_only_reason(problem)
        if reason:
            return reason
        needed = MIN_COMPUTE_CAPABILITY.get(problem.dtype)
        if needed is None:
            return (
                f"{self.name} runs fp16 and bf16 on tensor cores, not {problem.dtype} "
                "(tf32 for fp32 is not implemented yet)"
            )
        if (problem.compute_capability or 0) < needed:
            return (
                f"{self.name} needs compute capability {needed // 10}.{needed % 10} or newer for "
                f"{short_name(problem.dtype)}; this GPU is sm_{problem.compute_capability}"
            )
        return None

    def forward_sources(self, dtype, in_channels: int, tile, stages: int,
                        weight_transposed: bool) -> tuple[KernelSource, ...]:
        """Pipelined when the rows allow 16-byte copies, else the synchronous kernel."""
        pipelined = in_channels * dtype.itemsize % VECTOR_BYTES == 0
        name = _forward_kernel_name(cuda_type_name(dtype), tile, _block_k(padded_channels(in_channels)),
                                    stages if pipelined else SYNCHRONOUS_STAGES, weight_transposed)
        return (_SOURCES[dtype].source_of(name),)

    def gemm_plan(self, dtype, kernel_volume: int, in_channels: int, out_channels: int, tile, stages: int,
                  sort_rows: bool, weight_transposed: bool) -> _GemmPlan:
        return _gemm_plan(current_device(), dtype, kernel_volume, in_channels, out_channels, tile, stages, sort_rows,
                          weight_transposed)

    def wgrad_plan_class_for(self, dtype, in_channels: int, out_channels: int) -> type[WgradPlan]:
        return WmmaWgradPlan
