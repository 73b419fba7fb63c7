"""What the tensor-core algorithms share: one dataflow, which `wmma`, `mma` and `wgmma` run on their own
kernels, and `TensorCoreImplicitGemm`, the base class of the three.

Forward is output-stationary: a block owns a tile of output rows by output channels, loops over the
offsets (skipping an offset no row of the tile has) and the input channels, gathers the input rows
through the pair table into shared memory and writes each output once, so results are deterministic.
Forward may visit the output rows in offset-mask order (`sort_rows`) so that a tile's rows share offsets
and more offsets are skipped. dgrad is the same kernel reading the weight transposed (a template flag: no
transposed copy) over the reversed map in its mask order (computed once per map and cached, like the
forward's), or over a submanifold map itself, which is its own reverse with the offsets flipped, taking
the weight's offsets in reverse (`dgrad_operands`): no reversed table to hold. wgrad runs over the
per-offset pair lists (`KernelMap.csr`), cut into shares of about equal pairs whatever their offset
(`KernelMap.wgrad_shares`), as many blocks as put about `wgrad_warps_per_sm` warps per SM; their fp32
partial weight gradients are summed in a fixed order by the last blocks of the dgrad launch, which runs
after them (a backward of two launches), or by a kernel of their own where dgrad is not wanted
(raw_kernels/wgrad_sum.cu).

`prepare_weight` pads the weight to multiples of 16 channels on both sides when it is not already;
features stay unpadded, except an operand whose rows are not whole 16-byte vectors, which is copied into
rows that are before the kernels read it (`RowPadding`). The launches of a layer signature (dtype, kernel
volume, channel counts, parameters, device: kernels and fixed arguments) are prepared once, and take the
map's arrays and row count per call (derived once per map and kept with it, `KernelMap.derived`), so a
call, over any map, costs its allocations and one driver call per kernel.
"""

from __future__ import annotations

import functools
from typing import ClassVar, NamedTuple

import numpy as np

from cupysparse.cuda.backend import array_module, cupy_module, current_device, is_cupy_array
from cupysparse.cuda.compile import KernelFamily, KernelSource, PreparedLaunch
from cupysparse.cuda.device import WARP_SIZE, l2_bytes, multiprocessors, resident_threads
from cupysparse.cuda.dtypes import BFLOAT16, FLOAT16, FLOAT32, cuda_type_name, short_name
from cupysparse.settings import FP32_PRECISION
from cupysparse.algorithms.base import MAX_GRID_Z, Algorithm, BackwardPlan, ConvProblem, ForwardPlan

CHANNEL_MULTIPLE = 16  # weights are padded to multiples of 16 channels: a wmma fragment, a 16-bit mma's k
VECTOR_BYTES = 16  # pipelined copies move 16 bytes: 8 fp16/bf16 values, 4 fp32
MIN_PAIRS_PER_SHARE = 256  # a wgrad share smaller than this is not worth its partial tile
# Long sums in a tensor core's fp32 accumulator drift toward zero: with a million pairs per share, a
# 20M-voxel fp16 wgrad came out up to 0.3% small (H100, every error toward zero), as if each k step's
# add truncated. Shares of at most 2^17 pairs bound the drift; the sum over shares rounds to nearest.
MAX_PAIRS_PER_SHARE = 2**17
# The fp32 partials of one wgrad call are transient but come at the peak of a training step (the first
# layers of the backward pass are the widest at the finest level), so they are capped: at 128 MiB (18
# shares of a 27 x 256 x 256 layer), or an eighth of the layer's larger operand where that is more. A
# 1M-voxel 256-channel layer gets enough shares to fill the GPU (H100: 2 shares 15.6 ms, 9 shares 7.2);
# so does a 100K-voxel one, whose operands alone would allow 2. 64 MiB held such layers at 9 shares where
# the occupancy target asks for 10, and 9 ran slower (H100, 500K x 256, wgmma's wgrad, side by side:
# TF32 4.49 ms against 4.10, fp16 1.71 against 1.60; the time varies with the share count by 10%, not
# monotonically, which the tuner's occupancy targets explore).
MIN_WORKSPACE_CAP_BYTES = 128 * 2**20
WORKSPACE_OPERAND_FRACTION = 8
# wgrad's blocks go round-major past this many times the L2 cache of operands (WgradPlan.round_major).
ROUND_MAJOR_L2_MULTIPLE = 2
# Threads of a block of the wgrad sum (SUM_THREADS in raw_kernels/wgrad_sum.cu), and at most how many of
# them share an element (the sum of an offset's shares, raw_kernels/wgrad_sum.cuh). With one thread per
# element, 100K voxels x 32 channels (27,648 elements) summed their 157 shares an offset in 52 us, against
# 45 for the GEMM; 8 threads an element took 13 (H100).
SUM_THREADS = 256
MAX_SLOT_GROUPS = 8
# Resident warps per SM the wgrad shares aim at. Past the warps an SM holds, the shares run in waves,
# round-major where the operands outgrow the L2 (WgradPlan.round_major), and smaller shares then read
# more of their rows from the L2: at 1M voxels x 64 channels (TF32, H100, side by side) 40 shares an
# offset took 1.46 ms, 79 1.23, 157 1.15 and 300 1.05 (DRAM reads 3.19 GB at 79, 2.33 at 300, for
# 5.15 GB of gathered rows), while 128 channels ran fastest at 20 (2.55 ms against 2.77 at 40).
# Smaller layers often want fewer, longer shares (H100, fp16, 8 / 16 / 32 warps):
# 500K voxels x 32 channels (mma_conv_wgrad) 0.187 / 0.207 / 0.210 ms, 100K x 64 0.087 / 0.066 /
# 0.085, 500K x 128 (wgmma_conv_wgrad) 0.48 / 0.45 / 0.52. `auto` leaves out 4, which at best tied 8.
WGRAD_WARPS_PER_SM = (32, 4, 8, 16, 64, 128, 256)
AUTO_WGRAD_WARPS_PER_SM = (8, 16, 32, 64, 128, 256)
# Until the tuner measures, `auto` runs tensor cores first (TensorCoreImplicitGemm.auto_priority).
TENSOR_CORE_PRIORITY = 2


def _sum_kernel_name(type_name: str) -> str:
    return f"wgrad_sum<{type_name}>"


# The sum of wgrad's partials, one module per dtype a wgrad plan runs (bf16's compiled on sm_80+ only).
_SUM_SOURCES = {dtype: KernelSource("wgrad_sum.cu", (_sum_kernel_name(cuda_type_name(dtype)),))
                for dtype in (FLOAT16, BFLOAT16, FLOAT32) if dtype is not None}


def sum_source(dtype) -> KernelSource:
    """The module of the wgrad sum for partials of features of `dtype`."""
    return _SUM_SOURCES[dtype]


# Rows of an operand that are not whole VECTOR_BYTES vectors are copied into rows that are
# (raw_kernels/row_padding.cu), by the values' size in bits.
_PAD_SOURCES = {size: KernelSource("row_padding.cu", (f"pad_rows<{bits}>",))
                for size, bits in ((2, "unsigned short"), (4, "unsigned int"))}
PAD_THREADS = 256
MAX_PAD_BLOCKS = 4096  # the copy's blocks stride over the rows past this
# The sources every tensor-core algorithm launches from besides its GEMMs' (in this order: the shipped tuning
# file records each algorithm's sources as listed).
SHARED_SOURCES = ("wgrad_sum.cu", "row_padding.cu")


def row_width(dtype, channels: int) -> int:
    """`channels` rounded up to whole VECTOR_BYTES vectors of `dtype`: the row width the tensor-core
    kernels read an operand of `channels` in (`RowPadding`)."""
    per_vector = VECTOR_BYTES // dtype.itemsize
    return -(-channels // per_vector) * per_vector


def whole_vectors(dtype, channels: int) -> bool:
    """Whether rows of `channels` values of `dtype` are whole VECTOR_BYTES vectors, which need no copy."""
    return row_width(dtype, channels) == channels


def staging_bytes(dtype, channels: int, rows: int) -> int:
    """The bytes of `rows` rows of `channels` values of `dtype` padded to `row_width`; 0 where they need no
    padding."""
    return 0 if whole_vectors(dtype, channels) else rows * row_width(dtype, channels) * dtype.itemsize


class RowPadding:
    """The copy of row-major `[rows, channels]` values into `[rows, row_width]`, zeros past `channels`.
    The tensor-core kernels gather rows that are not whole 16-byte vectors element by element, outside
    their cp.async pipelines: on 2 x 200K indoor voxels (3^3, fp16, H100) the stem's 3 -> 32 weight
    gradient took 0.80 ms at best, 8 -> 32 on the same map 0.13 ms; the forward 0.23 against 0.14. The copy
    is one small launch (`launch`, into a plan's staging memory; or a call over an array)."""

    def __init__(self, dtype, channels: int):
        self.channels, self.width, self.itemsize = channels, row_width(dtype, channels), dtype.itemsize

    @functools.cached_property
    def _copy(self) -> PreparedLaunch:  # compiled at the first launch, not when a plan is made
        source = _PAD_SOURCES[self.itemsize]
        return PreparedLaunch(source.get(source.name_expressions[0]), (1,), (PAD_THREADS,),
                              (None, None, np.int32(self.channels), np.int32(self.width), None))

    def bytes(self, rows: int) -> int:
        return rows * self.width * self.itemsize

    def launch(self, stream: int, source: int, rows: int, padded: int) -> None:
        """Copy `rows` rows at device address `source` into `padded` (`bytes(rows)`, 16-byte aligned) on
        the raw CUDA stream handle `stream`."""
        blocks = min(MAX_PAD_BLOCKS, max(1, -(-rows * self.width // PAD_THREADS)))
        self._copy.launch(stream, source, rows, padded, grid=(blocks, 1, 1))

    def __call__(self, array):
        cupy = cupy_module()
        array = cupy.ascontiguousarray(array)
        padded = cupy.empty((array.shape[0], self.width), dtype=array.dtype)
        self.launch(current_stream(), array.data.ptr, array.shape[0], padded.data.ptr)
        return padded


@functools.cache
def _row_padding(device: int, dtype, channels: int) -> RowPadding:
    return RowPadding(dtype, channels)


def row_padding(dtype, channels: int) -> RowPadding | None:
    """The `RowPadding` of `channels` values of `dtype` on the current device, None where the rows are
    whole vectors already."""
    return None if whole_vectors(dtype, channels) else _row_padding(current_device(), dtype, channels)


def padding_sources(dtype, *channel_counts: int) -> tuple[KernelSource, ...]:
    """The module of the copies `row_padding` makes for operands of `channel_counts`, if any."""
    if all(whole_vectors(dtype, channels) for channels in channel_counts):
        return ()
    return (_PAD_SOURCES[dtype.itemsize],)


def padded_channels(channels: int) -> int:
    """`channels` rounded up to a multiple of CHANNEL_MULTIPLE."""
    return -(-channels // CHANNEL_MULTIPLE) * CHANNEL_MULTIPLE


def covering_width(tiles, channels: int) -> int:
    """The narrowest column count of `tiles` that covers `channels`, else their widest."""
    widths = sorted({tile[1] for tile in tiles})
    return next((width for width in widths if width >= channels), widths[-1])


def padded_weight_shape(problem: ConvProblem, transposed: bool = False) -> tuple[int, int, int]:
    """`[K, C_in_pad, C_out_pad]`, or `[K, C_out_pad, C_in_pad]` when `transposed`."""
    channels = padded_channels(problem.in_channels), padded_channels(problem.out_channels)
    return (problem.kernel_volume, *(channels[::-1] if transposed else channels))


class PaddedWeight:
    """A weight `[K, C_in, C_out]` zero-padded to `[K, C_in_pad, C_out_pad]` (multiples of 16), the
    form forward and dgrad read (a contiguous weight already of that shape is used as it is). Build it
    with `TensorCoreImplicitGemm.prepare_weight`."""

    def __init__(self, weight):
        if weight.ndim != 3:
            raise ValueError(f"weight must have shape [K, C_in, C_out], got {weight.shape}")
        self.kernel_volume, self.in_channels, self.out_channels = (int(size) for size in weight.shape)
        self.dtype = np.dtype(weight.dtype)
        padded_shape = (self.kernel_volume, padded_channels(self.in_channels), padded_channels(self.out_channels))
        if tuple(weight.shape) == padded_shape and weight.flags.c_contiguous:
            self.padded = weight  # already the kernel's layout: read in place, no copy per call
        else:
            self.padded = array_module(weight).zeros(padded_shape, dtype=weight.dtype)
            self.padded[:, : self.in_channels, : self.out_channels] = weight

    def __repr__(self) -> str:
        return (
            f"PaddedWeight(K={self.kernel_volume}, C_in={self.in_channels}, C_out={self.out_channels}, "
            f"{short_name(self.dtype)})"
        )


def check_operand(algorithm, name: str, array, like: str, dtype, rows: int, channels: int | None = None) -> None:
    """`algorithm`'s kernels read `array` as `[rows, channels]` of `dtype` (the dtype of `like`), one of
    its `feature_dtypes`, on the GPU: refuse anything else."""
    if not is_cupy_array(array):
        raise TypeError(f"{name} must be a CuPy array: {algorithm.name} runs on CUDA GPUs only")
    if np.dtype(array.dtype) not in algorithm.feature_dtypes:
        names = " or ".join(short_name(dtype) for dtype in algorithm.feature_dtypes)
        raise TypeError(f"{name} must be {names} for {algorithm.name}, got {array.dtype}")
    if np.dtype(array.dtype) != dtype:
        raise TypeError(f"{name} must have the dtype of {like}, {short_name(dtype)}, got {short_name(array.dtype)}")
    if array.ndim != 2 or array.shape[0] != rows or (channels is not None and array.shape[1] != channels):
        wanted = f"({rows}, {channels})" if channels is not None else f"({rows}, C)"
        raise ValueError(f"{name} must have shape {wanted} for this kernel map and weight, got {array.shape}")


def check_kernel_map(kernel_map) -> None:
    if not is_cupy_array(kernel_map.pair_table):
        raise TypeError("the kernel map must be built on the GPU (its pair table is a NumPy array)")


def check_weight(algorithm, weight: PaddedWeight, kernel_map) -> None:
    check_kernel_map(kernel_map)
    if not is_cupy_array(weight.padded):
        raise TypeError(f"weight must be a CuPy array: {algorithm.name} runs on CUDA GPUs only")
    if weight.kernel_volume != kernel_map.kernel_volume:
        raise ValueError(
            f"the weight has {weight.kernel_volume} kernel offsets but the kernel map {kernel_map.kernel_volume}"
        )


def empty_problem(problem: ConvProblem) -> bool:
    """Whether the convolution has no work (its result is zeros, which the phases return directly)."""
    sizes = (problem.num_in, problem.num_out, problem.kernel_volume, problem.in_channels, problem.out_channels)
    return 0 in sizes


def current_stream() -> int:
    return cupy_module().cuda.get_current_stream().ptr


def forward_map_values(rows: int, column_tiles: int, sort_rows: bool, kernel_map) -> tuple:
    """(pair table, row order or 0, output rows, grid) of an output-stationary forward launch over
    `kernel_map` with tiles of `rows` output rows and `column_tiles` tiles across the output channels."""
    order = kernel_map.mask_sorted_order().data.ptr if sort_rows else 0
    grid = (-(-kernel_map.num_out // rows) * column_tiles, 1, 1)
    return kernel_map.pair_table.data.ptr, order, kernel_map.num_out, grid


class WgradSum(NamedTuple):
    """What a dgrad launch takes to sum wgrad's partials in blocks past its tiles
    (raw_kernels/forward_tile.cuh): the four kernel arguments (workspace, weight gradient, the offsets'
    first slots, threads per element), then the offsets and elements per offset, which size the blocks."""

    workspace: int
    grad_weight: int
    slot_starts: int
    slot_groups: int
    kernel_volume: int
    offset_elements: int

    def blocks(self, threads: int) -> int:
        """Blocks of `threads` the sum takes (`wgrad_sum_blocks_per_offset` for each offset)."""
        return self.kernel_volume * -(-self.offset_elements * self.slot_groups // threads)


# The forward kernels' wgrad-sum arguments, per call: a forward passes NO_WGRAD_SUM, and no blocks past
# its tiles.
WGRAD_SUM_ARGUMENTS = (None, None, None, None)
NO_WGRAD_SUM = (0, 0, 0, 0)
# The forward kernels' epilogue (`ForwardEpilogue` in raw_kernels/forward_tile.cuh): scale, shift and
# residual addresses and the ReLU flag, per call; none of it in dgrad or a plain forward.
EPILOGUE_ARGUMENTS = (None, None, None, None)
NO_EPILOGUE = (0, 0, 0, 0)


def with_wgrad_sum(grid: tuple[int, int, int], threads: int, wgrad_sum: WgradSum) -> tuple[tuple, tuple]:
    """The grid of a forward kernel's launch of blocks of `threads`, with the blocks of `wgrad_sum` past
    its tiles, and the kernel's four wgrad-sum arguments (a launch without them passes `NO_WGRAD_SUM`)."""
    return (grid[0] + wgrad_sum.blocks(threads), 1, 1), wgrad_sum[:4]


def forward_arguments(kernel_volume: int, in_channels: int, out_channels: int) -> tuple:
    """The fixed arguments of an output-stationary forward kernel that takes `vector_rows`
    (`mma_conv_forward`, `wgmma_conv_forward`): features, pair table, row order, weight, out and the row
    count, then vector_rows, the offset order, the wgrad sum's four and the epilogue's four, are per call."""
    sizes = (kernel_volume, in_channels, padded_channels(in_channels), out_channels, padded_channels(out_channels))
    return (None, None, None, None, None, None, *(np.int32(size) for size in sizes), None, None, *WGRAD_SUM_ARGUMENTS,
            *EPILOGUE_ARGUMENTS)


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
        self._map_values = functools.partial(forward_map_values, rows, column_tiles, sort_rows)

    def launch(self, kernel_map, features: int, weight: int, out: int, stream: int,
               reverse_weight_offsets: int = 0, wgrad_sum: WgradSum | None = None,
               epilogue: tuple[int, int, int, int] = NO_EPILOGUE) -> None:
        """Launch over `kernel_map`'s pair table on device addresses (row-major; the weight padded, in
        the layout the plan reads, its offsets taken in reverse when `reverse_weight_offsets`), on the
        raw CUDA stream handle `stream`; with `wgrad_sum`, a dgrad launch that sums wgrad's partials too;
        `epilogue` the forward's (`EPILOGUE_ARGUMENTS`)."""
        table, order, num_out, grid = kernel_map.derived(self, self._map_values)
        sum_arguments = NO_WGRAD_SUM
        if wgrad_sum is not None:
            grid, sum_arguments = with_wgrad_sum(grid, self.kernel.block_threads, wgrad_sum)
        vector_rows = 1 if self.vector_rows and not features % VECTOR_BYTES else 0
        self.kernel.launch(stream, features, table, order, weight, out, num_out, vector_rows,
                           reverse_weight_offsets, *sum_arguments, *epilogue, grid=grid)

    def __call__(self, kernel_map, features, padded_weight, reverse_weight_offsets: int = 0):
        out = cupy_module().empty((kernel_map.num_out, self.out_channels), dtype=self.dtype)  # all written once
        self.launch(kernel_map, features.data.ptr, padded_weight.data.ptr, out.data.ptr, current_stream(),
                    reverse_weight_offsets)
        return out


class _WgradMapValues(NamedTuple):
    """What wgrad's launches take from a map: the addresses of its pair lists (in, out, offsets) and
    share table, then of the offsets' first slots, and the sizes of the shares it is cut into."""

    pair_lists: tuple[int, int, int, int]
    slot_starts: int
    gemm_grid: tuple[int, int, int]
    slot_groups: int
    sum_grid: tuple[int, int, int]
    workspace_shape: tuple[int, int, int]


class WgradPlan:
    """wgrad's launches for one dtype, kernel volume, channel counts and occupancy target, over any map
    of that kernel volume: the split-K gather-gather GEMMs over the map's per-offset pair lists into an
    fp32 workspace, then the sum of its shares into the weight gradient, in a launch of its own or in
    dgrad's (`wgrad_sum`). The GEMM reads features and gradients in rows of `row_width` (`paddings`: the
    copies of those that are not, None for those that are). A subclass names the GEMM kernel: `tile_for`,
    `threads`, `gemm_sources`, `prepare_gemm` and `launch_gemm`."""

    def __init__(self, dtype, kernel_volume: int, in_channels: int, out_channels: int, wgrad_warps_per_sm: int):
        in_padded, out_padded = padded_channels(in_channels), padded_channels(out_channels)
        tile = self.tile_for(in_padded, out_padded)
        self.kernel_volume = kernel_volume
        self.dtype = dtype
        self.padded_sizes = (in_padded, out_padded)
        self.out_shape = (kernel_volume, in_channels, out_channels)
        self.paddings = (row_padding(dtype, in_channels), row_padding(dtype, out_channels))
        self.offset_elements = in_channels * out_channels
        # Threads the GPU holds at once per element of the whole weight gradient (slot_groups).
        self.resident_threads_per_element = -(-resident_threads(current_device()) //
                                               (kernel_volume * self.offset_elements))
        self.grid_xy = (-(-in_padded // tile[0]), -(-out_padded // tile[1]))
        self.wanted_warps = wgrad_warps_per_sm * multiprocessors(current_device())
        self.warps_per_share = kernel_volume * self.grid_xy[0] * self.grid_xy[1] * self.threads(tile) // WARP_SIZE
        rows = (row_width(dtype, in_channels), in_padded, row_width(dtype, out_channels), out_padded)
        # features, grad_output, the three pair lists, the share table and the workspace are per call.
        self.prepare_gemm(dtype, tile, (None, None, None, None, None, *map(np.int32, rows), None, None))
        # workspace, grad_weight, the offsets' first slots and the slot groups are per call.
        sum_kernel = sum_source(dtype).get(_sum_kernel_name(cuda_type_name(dtype)))
        sizes = (in_channels, in_padded, out_channels, out_padded)
        self.sum = PreparedLaunch(sum_kernel, (1,), (SUM_THREADS,), (None, None, None, *map(np.int32, sizes), None))

    def shares(self, num_in: int, num_out: int) -> int:
        """Shares per offset on average (the rounds of `KernelMap.wgrad_shares`, which gives each offset
        shares in proportion to its pairs): enough blocks for the warps per SM asked for, none much smaller
        than MIN_PAIRS_PER_SHARE pairs (an offset has at most `num_out`), partials within the workspace cap
        (see MIN_WORKSPACE_CAP_BYTES); but enough for at most MAX_PAIRS_PER_SHARE pairs each, whatever the
        cap; grid z in range. Their pair ranges are computed on the device from the CSR offsets: no
        synchronisation."""
        share_bytes = self.kernel_volume * self.padded_sizes[0] * self.padded_sizes[1] * 4
        _, in_channels, out_channels = self.out_shape
        operand_bytes = max(num_in * in_channels, num_out * out_channels) * self.dtype.itemsize
        cap_bytes = max(MIN_WORKSPACE_CAP_BYTES, operand_bytes // WORKSPACE_OPERAND_FRACTION)
        for_speed = min(-(-self.wanted_warps // self.warps_per_share), -(-num_out // MIN_PAIRS_PER_SHARE),
                        cap_bytes // share_bytes)
        # A share holds at most P / (K (shares - 1)) <= num_out / (shares - 1) pairs; one per offset, at
        # most num_out.
        for_accuracy = 1 if num_out <= MAX_PAIRS_PER_SHARE else -(-num_out // MAX_PAIRS_PER_SHARE) + 1
        return max(1, min(max(for_speed, for_accuracy), MAX_GRID_Z // self.kernel_volume))

    def slot_groups(self, shares: int) -> int:
        """Threads summing each element of the weight gradient for `shares` shares per offset on
        average: the largest power of two up to MAX_SLOT_GROUPS, the shares, and the threads the GPU
        holds at once per element (beyond those, threads only wait for a slot on an SM)."""
        most = max(1, min(MAX_SLOT_GROUPS, shares, self.resident_threads_per_element))
        return 1 << (most.bit_length() - 1)

    def round_major(self, num_in: int, num_out: int) -> bool:
        """Whether the GEMM's blocks go round-major (`KernelMap.wgrad_shares`). Where one block covers
        all of dW_k, each gathered row is read once per offset that pairs it, and where the operands
        outgrow the L2 cache those reads come from DRAM, unless the offsets that pair the same rows run
        side by side: the same stretch of every offset's list side by side ran faster there (H100, 1M
        voxels, wgrad: x 128 fp16 1.67 -> 1.19 ms, TF32 3.66 -> 2.93; x 64 fp16 0.86 -> 0.76, with as many
        shares for every offset). Elsewhere offset-major did: with several tiles, a share's tiles already
        read its rows side by side (1M x 256 fp16 3.76 against 3.98 ms), and
        operands up to about twice the L2 stay in it (100K x 64 fp32, 51 MB against the H100's 50: 0.140
        against 0.156 ms)."""
        _, in_channels, out_channels = self.out_shape
        operand_bytes = (num_in * in_channels + num_out * out_channels) * self.dtype.itemsize
        return self.grid_xy == (1, 1) and operand_bytes > ROUND_MAJOR_L2_MULTIPLE * l2_bytes(current_device())

    def workspace_shape(self, kernel_map) -> tuple[int, int, int]:
        """The fp32 partials: one slot per block of the GEMM's grid z."""
        return kernel_map.derived(self, self._derive_map_values).workspace_shape

    def shares_of(self, kernel_map) -> tuple[int, bool]:
        """The `(rounds, round_major)` of the shares of `kernel_map`'s pair lists that its launches read."""
        num_in, num_out = kernel_map.num_in, kernel_map.num_out
        return self.shares(num_in, num_out), self.round_major(num_in, num_out)

    def _derive_map_values(self, kernel_map) -> _WgradMapValues:
        rounds, round_major = self.shares_of(kernel_map)
        pairs = kernel_map.csr()
        shares = kernel_map.wgrad_shares(rounds, round_major)
        slot_groups = self.slot_groups(rounds)
        return _WgradMapValues(
            (pairs.in_idx.data.ptr, pairs.out_idx.data.ptr, pairs.offsets.data.ptr, shares.table.data.ptr),
            shares.slot_starts.data.ptr, (*self.grid_xy, self.kernel_volume * rounds), slot_groups,
            (-(-self.offset_elements * slot_groups // SUM_THREADS), self.kernel_volume, 1),
            (rounds * self.kernel_volume, *self.padded_sizes))

    @staticmethod
    def tile_for(in_padded: int, out_padded: int) -> tuple:
        """The GEMM's tile of dW_k (input channels, output channels, then what else names the kernel)."""
        raise NotImplementedError

    def threads(self, tile) -> int:
        """Threads of a block of the GEMM with `tile`."""
        raise NotImplementedError

    @classmethod
    def gemm_sources(cls, dtype, tile, vectors: bool) -> tuple[KernelSource, ...]:
        """The module of the GEMM `launch_gemm` runs for `tile`, with rows that allow 16-byte copies
        (`vectors`) or not."""
        raise NotImplementedError

    def prepare_gemm(self, dtype, tile, arguments) -> None:
        """Prepare the GEMM's launch with its fixed `arguments` (None where a launch passes a value)."""
        raise NotImplementedError

    def launch_gemm(self, stream: int, grid, values: tuple, vectors: bool) -> None:
        """Launch the GEMM on `grid` with the per-call `values`, its rows in 16-byte copies when `vectors`."""
        raise NotImplementedError

    @classmethod
    def sources(cls, dtype, in_channels: int, out_channels: int) -> tuple[KernelSource, ...]:
        """The modules a plan of this signature launches from, its features' and gradients' base
        addresses aligned to 16 bytes: the row copies, the GEMM and the sum."""
        tile = cls.tile_for(padded_channels(in_channels), padded_channels(out_channels))
        return (*padding_sources(dtype, in_channels, out_channels), *cls.gemm_sources(dtype, tile, True),
                sum_source(dtype))

    def launch_partials(self, kernel_map, features: int, grad_output: int, workspace: int, stream: int) -> None:
        """Launch the GEMMs over `kernel_map`'s pair lists on device addresses (row-major arrays in rows of
        `row_width`, the fp32 workspace of `workspace_shape(kernel_map)`), on the raw CUDA stream handle
        `stream`."""
        values = kernel_map.derived(self, self._derive_map_values)
        vectors = (features | grad_output) % VECTOR_BYTES == 0
        self.launch_gemm(stream, values.gemm_grid, (features, grad_output, *values.pair_lists, workspace), vectors)

    def wgrad_sum(self, kernel_map, workspace: int, grad_weight: int) -> WgradSum:
        """The sum of `launch_partials`' workspace into `grad_weight` for a dgrad launch to carry."""
        values = kernel_map.derived(self, self._derive_map_values)
        return WgradSum(workspace, grad_weight, values.slot_starts, values.slot_groups, self.kernel_volume,
                        self.offset_elements)

    def launch(self, kernel_map, features: int, grad_output: int, workspace: int, grad_weight: int,
               stream: int) -> None:
        """`launch_partials`, then the sum of the workspace into `grad_weight` in a launch of its own."""
        self.launch_partials(kernel_map, features, grad_output, workspace, stream)
        values = kernel_map.derived(self, self._derive_map_values)
        self.sum.launch(stream, workspace, grad_weight, values.slot_starts, values.slot_groups, grid=values.sum_grid)

    def __call__(self, kernel_map, features, grad_output):
        cupy = cupy_module()
        features, grad_output = (array if padding is None else padding(array)
                                 for padding, array in zip(self.paddings, (features, grad_output)))
        # Every block writes its whole tile, zeros included, so the workspace needs no clearing.
        workspace = cupy.empty(self.workspace_shape(kernel_map), dtype=np.float32)
        grad_weight = cupy.empty(self.out_shape, dtype=self.dtype)
        self.launch(kernel_map, features.data.ptr, grad_output.data.ptr, workspace.data.ptr, grad_weight.data.ptr,
                    current_stream())
        return grad_weight


class DynamicSharedWgradPlan(WgradPlan):
    """A `WgradPlan` whose GEMM is one kernel per tile for rows of any alignment (16-byte copies or not is
    its last argument) in dynamic shared memory: a subclass names it (`kernel_name`, `kernel_family`,
    `gemm_shared_bytes`, with `tile_for` and `threads`)."""

    @staticmethod
    def kernel_name(dtype, tile) -> str:
        raise NotImplementedError

    @staticmethod
    def kernel_family(dtype) -> KernelFamily:
        raise NotImplementedError

    @staticmethod
    def gemm_shared_bytes(dtype, tile) -> int:
        """The dynamic shared memory of one block of the GEMM with `tile`."""
        raise NotImplementedError

    @classmethod
    def gemm_sources(cls, dtype, tile, vectors: bool) -> tuple[KernelSource, ...]:
        return (cls.kernel_family(dtype).source_of(cls.kernel_name(dtype, tile)),)

    def prepare_gemm(self, dtype, tile, arguments) -> None:
        kernel = self.kernel_family(dtype).get(self.kernel_name(dtype, tile))
        self.gemm = PreparedLaunch(kernel, (1,), (self.threads(tile),), (*arguments, None),
                                   self.gemm_shared_bytes(dtype, tile))

    def launch_gemm(self, stream: int, grid, values: tuple, vectors: bool) -> None:
        self.gemm.launch(stream, *values, int(vectors), grid=grid)


@functools.cache
def wgrad_plan(device: int, dtype, kernel_volume: int, in_channels: int, out_channels: int, wgrad_warps_per_sm: int,
               plan_class: type[WgradPlan]) -> WgradPlan:
    """`plan_class` for this signature on `device`, made on first use."""
    return plan_class(dtype, kernel_volume, in_channels, out_channels, wgrad_warps_per_sm)


def dgrad_operands(kernel_map):
    """(map, reverse_weight_offsets) dgrad runs the forward kernel over: a mirror-symmetric map itself
    with its weight's offsets taken in reverse (its reverse is its own table with the offsets flipped,
    so no reversed table, mask or row order is made), else the reversed map."""
    if kernel_map.mirror_symmetric:
        return kernel_map, 1
    return kernel_map.reversed(), 0


def forward_plan(problem: ConvProblem, gemm, weight_transposed: bool) -> ForwardPlan:
    """The `ForwardPlan` of a forward kernel's plan for the features' `row_width`: the features copied
    into staging memory first where their rows are not whole vectors (`RowPadding`)."""
    padding = row_padding(problem.dtype, problem.in_channels)
    if padding is None:
        return ForwardPlan(padded_weight_shape(problem, weight_transposed), gemm.launch, weight_transposed,
                           fuses_epilogue=True)

    def launch(kernel_map, features: int, weight: int, out: int, stream: int, *, staging: int, **options) -> None:
        padding.launch(stream, features, kernel_map.num_in, staging)
        gemm.launch(kernel_map, staging, weight, out, stream, **options)

    return ForwardPlan(padded_weight_shape(problem, weight_transposed), launch, weight_transposed, fuses_epilogue=True,
                       staging_shape=lambda kernel_map: (padding.bytes(kernel_map.num_in) // 4,))


def backward_plan(problem: ConvProblem, dgrad, wgrad: WgradPlan) -> BackwardPlan:
    """The `BackwardPlan` of a dgrad plan (launched over `dgrad_operands`, for the gradient's `row_width`)
    and a wgrad plan: for both gradients, wgrad's GEMMs, then dgrad summing their partials too. Operands
    whose rows are not whole vectors are first copied into staging memory, the gradient's ahead of the
    features' (`RowPadding`); dgrad's sum of the partials would crop the weight gradient to its own row
    width, so with the gradient copied the sum is a launch of its own."""
    in_padding, out_padding = wgrad.paddings

    def launch(kernel_map, grad_output: int, features: int, weight: int, grad_input: int, workspace: int,
               grad_weight: int, stream: int, *, staging: int = 0) -> None:  # 0: no staging_shape
        if out_padding is not None:
            out_padding.launch(stream, grad_output, kernel_map.num_out, staging)
            grad_output = staging
        wgrad_sum = None
        if grad_weight:
            if in_padding is not None:
                padded = staging + (0 if out_padding is None else out_padding.bytes(kernel_map.num_out))
                in_padding.launch(stream, features, kernel_map.num_in, padded)
                features = padded
            if not grad_input or out_padding is not None:
                wgrad.launch(kernel_map, features, grad_output, workspace, grad_weight, stream)
                if not grad_input:
                    return
            else:
                wgrad.launch_partials(kernel_map, features, grad_output, workspace, stream)
                wgrad_sum = wgrad.wgrad_sum(kernel_map, workspace, grad_weight)
        table_map, reverse_weight_offsets = dgrad_operands(kernel_map)
        dgrad.launch(table_map, grad_output, weight, grad_input, stream, reverse_weight_offsets, wgrad_sum)

    staging_shape = None
    if in_padding is not None or out_padding is not None:
        def staging_shape(kernel_map) -> tuple[int]:
            return (sum(padding.bytes(rows) for padding, rows in ((in_padding, kernel_map.num_in),
                                                                  (out_padding, kernel_map.num_out))
                        if padding is not None) // 4,)

    return BackwardPlan(padded_weight_shape(problem), wgrad.workspace_shape, launch, wgrad.shares_of, staging_shape)


def fp32_as_tf32_unsupported_reason(algorithm, problem: ConvProblem) -> str | None:
    """Why the features' dtype cannot run on `algorithm`, which takes fp16, bf16 and fp32 as TF32: fp32
    unless TF32 is chosen, or no kernel for it."""
    if problem.dtype == FLOAT32 and not problem.tf32:
        return (f"{algorithm.name} runs fp32 only in TF32, and exact fp32 is chosen (TF32: "
                f"cupysparse.cuda.precision.set_fp32_precision('tf32') or {FP32_PRECISION.name}=tf32)")
    if problem.dtype not in algorithm.feature_dtypes:
        return f"{algorithm.name} runs fp16, bf16 and TF32 on tensor cores, not {short_name(problem.dtype)}"
    return None


def transient_bytes(problem: ConvProblem, phase: str, params: dict) -> int:
    """What a tensor-core call allocates beyond its operands: the padded weight made per call by forward
    and by dgrad, the copies of operands whose rows are not whole vectors (`RowPadding`), and wgrad's fp32
    partials: about `wgrad_warps_per_sm` warps per SM over the offsets' 32 x 32 warp tiles, at least
    MIN_PAIRS_PER_SHARE pairs each (`Algorithm.transient_bytes`)."""
    in_padded, out_padded = padded_channels(problem.in_channels), padded_channels(problem.out_channels)
    padded_weight = problem.kernel_volume * in_padded * out_padded * problem.dtype.itemsize
    features_copy = staging_bytes(problem.dtype, problem.in_channels, problem.num_in)
    gradient_copy = staging_bytes(problem.dtype, problem.out_channels, problem.num_out)
    total = 0
    if phase == "forward":
        total += padded_weight + features_copy
    if phase in ("dgrad", "backward"):
        total += padded_weight + gradient_copy
    if phase == "wgrad":
        total += gradient_copy
    if phase in ("wgrad", "backward"):
        total += features_copy
        warp_tile = 32
        warp_tiles = problem.kernel_volume * -(-in_padded // warp_tile) * -(-out_padded // warp_tile)
        sms = multiprocessors(current_device()) if problem.device == "cuda" else 1
        wanted = params.get("wgrad_warps_per_sm", WGRAD_WARPS_PER_SM[0]) * sms
        shares = max(1, min(-(-wanted // warp_tiles), -(-problem.num_out // MIN_PAIRS_PER_SHARE)))
        total += shares * problem.kernel_volume * in_padded * out_padded * 4
    return total


class TensorCoreImplicitGemm(Algorithm):
    """The base of the tensor-core algorithms: the entry points, launch plans and declared modules of the
    dataflow above, over the kernels a subclass names. A subclass sets `name`, `kernel_sources`,
    `feature_dtypes`, `tuning_namespaces`, `forward_params` (`tile`, `sort_rows`, `stages`: the first of
    each the default), `backward_params` (`tile`, which tunes dgrad, and `wgrad_warps_per_sm`, which tunes
    wgrad) and `dgrad_stages`, and defines `unsupported_reason`, `auto_tiles`, `forward_sources`,
    `gemm_plan` and `wgrad_plan_class_for`."""

    feature_dtypes: ClassVar[tuple]
    # The pipeline depth dgrad runs the forward kernel at (`dgrad_stages_for`).
    dgrad_stages: ClassVar[int]

    def auto_priority(self, problem: ConvProblem) -> int:
        """One tier for the three, so `auto` measures them side by side: on an H200 mma_implicit_gemm is
        ahead of wmma_implicit_gemm from 64 channels up (1M voxels x 256: forward 5.4 ms against 7.4, wgrad
        6.2 against 9.6), and on an H100 at 100K voxels x 32 and x 64 too, at 16 warps per SM each (x 64
        wgrad: fp16 0.065 ms against 0.075, bf16 0.065 against 0.097, whose wmma fragments load element by
        element)."""
        return TENSOR_CORE_PRIORITY

    def auto_tiles(self, channels: int) -> list[tuple]:
        """The tiles `auto` tries for `channels` padded output channels."""
        raise NotImplementedError

    def auto_param_grid(self, phase: str, problem: ConvProblem) -> list[dict]:
        """Sorted rows, every depth, and the tiles `auto_tiles` keeps for the padded output channels
        (dgrad's are the layer's inputs); wgrad's occupancy targets AUTO_WGRAD_WARPS_PER_SM."""
        tiles = self.auto_tiles(padded_channels(problem.out_channels if phase == "forward" else problem.in_channels))
        if phase == "forward":
            stages = self.forward_params["stages"]
            return [{"tile": tile, "sort_rows": True, "stages": depth} for tile in tiles for depth in stages]
        return [{"tile": tile, "wgrad_warps_per_sm": warps} for tile in tiles for warps in AUTO_WGRAD_WARPS_PER_SM]

    def prepare_weight(self, weight) -> PaddedWeight:
        return weight if isinstance(weight, PaddedWeight) else PaddedWeight(weight)

    def transient_bytes(self, problem: ConvProblem, phase: str, params: dict, max_offset_pairs: int) -> int:
        return transient_bytes(problem, phase, params)

    def checked_tile(self, tile, phase: str) -> tuple:
        """`tile` as a tuple, one of the algorithm's tiles; ValueError naming them otherwise."""
        tile = tuple(tile)
        tiles = self.forward_params["tile"]
        if tile not in tiles:
            raise ValueError(f"{self.name} {phase} tile must be one of {tiles}, got {tile}")
        return tile

    def check_choice(self, name: str, value, choices: tuple) -> None:
        if value not in choices:
            raise ValueError(f"{self.name} {name} must be one of {choices}, got {value!r}")

    def forward(self, features, weight, kernel_map, tile=None, sort_rows: bool = True, stages: int | None = None):
        """`tile` and `stages` default to the first of `forward_params`'."""
        weight = self.prepare_weight(weight)
        defaults = self.default_params("forward")
        tile = self.checked_tile(defaults["tile"] if tile is None else tile, "forward")
        stages = defaults["stages"] if stages is None else stages
        self.check_choice("stages", stages, self.forward_params["stages"])
        check_weight(self, weight, kernel_map)
        check_operand(self, "features", features, "the weight", weight.dtype, kernel_map.num_in, weight.in_channels)
        transposed = self.forward_weight_transposed(weight.dtype)
        padded = cupy_module().ascontiguousarray(weight.padded.transpose(0, 2, 1)) if transposed else weight.padded
        return self._run(features, kernel_map, sort_rows, padded, weight.in_channels, weight.out_channels, tile,
                         stages, transposed)

    def dgrad(self, grad_output, weight, kernel_map, tile=None, wgrad_warps_per_sm: int = WGRAD_WARPS_PER_SM[0]):
        """The forward kernel over the map indexed by input row with the transposed weight, its rows in
        mask order: sorting costs one argsort per map, cached and shared by every layer and step that
        uses the map, and lets a tile skip the offsets none of its rows has, as in forward. `tile`
        defaults to the first of `backward_params`'; `wgrad_warps_per_sm` only tunes wgrad."""
        weight = self.prepare_weight(weight)
        tile = self.checked_tile(self.default_params("backward")["tile"] if tile is None else tile, "dgrad")
        self.check_choice("wgrad_warps_per_sm", wgrad_warps_per_sm, WGRAD_WARPS_PER_SM)
        check_weight(self, weight, kernel_map)
        check_operand(self, "grad_output", grad_output, "the weight", weight.dtype, kernel_map.num_out,
                      weight.out_channels)
        table_map, reverse_weight_offsets = dgrad_operands(kernel_map)
        return self._run(grad_output, table_map, True, weight.padded, weight.out_channels, weight.in_channels, tile,
                         self.dgrad_stages_for(tile), True, reverse_weight_offsets)

    def wgrad(self, features, grad_output, kernel_map, tile=None, wgrad_warps_per_sm: int = WGRAD_WARPS_PER_SM[0]):
        """Per-offset gather-gather GEMMs over `kernel_map.csr()`; `tile` only tunes dgrad."""
        if tile is not None:
            self.checked_tile(tile, "wgrad")
        self.check_choice("wgrad_warps_per_sm", wgrad_warps_per_sm, WGRAD_WARPS_PER_SM)
        check_kernel_map(kernel_map)
        check_operand(self, "features", features, "features", np.dtype(features.dtype), kernel_map.num_in)
        check_operand(self, "grad_output", grad_output, "features", np.dtype(features.dtype), kernel_map.num_out)
        in_channels, out_channels = features.shape[1], grad_output.shape[1]
        if 0 in (kernel_map.num_out, kernel_map.num_in, kernel_map.kernel_volume, in_channels, out_channels):
            return cupy_module().zeros((kernel_map.kernel_volume, in_channels, out_channels), dtype=features.dtype)
        if not features.flags.c_contiguous:
            features = cupy_module().ascontiguousarray(features)
        if not grad_output.flags.c_contiguous:
            grad_output = cupy_module().ascontiguousarray(grad_output)
        dtype = np.dtype(features.dtype)
        plan = wgrad_plan(current_device(), dtype, kernel_map.kernel_volume, in_channels, out_channels,
                          wgrad_warps_per_sm, self.wgrad_plan_class_for(dtype, in_channels, out_channels))
        return plan(kernel_map, features, grad_output)

    def _run(self, features, kernel_map, sort_rows: bool, padded_weight, in_channels: int, out_channels: int, tile,
             stages: int, weight_transposed: bool, reverse_weight_offsets: int = 0):
        """`out[i] = Σ_k W[k]^T · features[pair_table[k, i]]` → `[N_out, out_channels]` over `kernel_map`'s
        pair table, W the padded weight or, when `weight_transposed`, its transpose (W[K-1-k] for offset k
        when `reverse_weight_offsets`), the output rows in the map's mask order when `sort_rows`."""
        cupy = cupy_module()
        kernel_volume, num_out = kernel_map.pair_table.shape
        if 0 in (num_out, out_channels, features.shape[0], kernel_volume, in_channels):
            return cupy.zeros((num_out, out_channels), dtype=features.dtype)
        dtype = np.dtype(features.dtype)
        padding = row_padding(dtype, in_channels)
        features = cupy.ascontiguousarray(features) if padding is None else padding(features)
        plan = self.gemm_plan(dtype, kernel_volume, row_width(dtype, in_channels), out_channels, tile, stages,
                              sort_rows, weight_transposed)
        return plan(kernel_map, features, padded_weight, reverse_weight_offsets)

    def dgrad_stages_for(self, tile) -> int:
        """The pipeline depth dgrad runs the forward kernel at with `tile`."""
        return self.dgrad_stages

    def forward_weight_transposed(self, dtype) -> bool:
        """Whether the forward kernel reads the weight transposed, `[K, C_out_pad, C_in_pad]` (as dgrad
        does), for features of `dtype`: a tensor-core operand that must be K-major. Default: no."""
        return False

    def forward_sources(self, dtype, in_channels: int, tile, stages: int,
                        weight_transposed: bool) -> tuple[KernelSource, ...]:
        """The module a forward plan of this signature launches from, its features' base address
        aligned to 16 bytes (as CuPy and PyTorch allocate)."""
        raise NotImplementedError

    def gemm_plan(self, dtype, kernel_volume: int, in_channels: int, out_channels: int, tile, stages: int,
                  sort_rows: bool, weight_transposed: bool):
        """The forward kernel's plan for this signature on the current device: `launch` (as
        `ForwardGemmPlan.launch`) and a call over arrays."""
        raise NotImplementedError

    def wgrad_plan_class_for(self, dtype, in_channels: int, out_channels: int) -> type[WgradPlan]:
        """The wgrad plan (its GEMM kernel) for this dtype and these channel counts."""
        raise NotImplementedError

    def kernel_modules(self, phase: str, problem: ConvProblem, params: dict) -> tuple[KernelSource, ...]:
        if self.unsupported_reason(problem) or empty_problem(problem):
            return ()
        params = {**self.default_params(phase), **params}
        tile = self.checked_tile(params["tile"], "forward" if phase == "forward" else "dgrad")
        dtype = np.dtype(problem.dtype)
        in_width, out_width = row_width(dtype, problem.in_channels), row_width(dtype, problem.out_channels)
        if phase == "forward":
            transposed = self.forward_weight_transposed(dtype)
            return (*padding_sources(dtype, problem.in_channels),
                    *self.forward_sources(dtype, in_width, tile, params["stages"], transposed))
        return (*self.forward_sources(dtype, out_width, tile, self.dgrad_stages_for(tile), True),
                *self.wgrad_plan_class_for(dtype, problem.in_channels, problem.out_channels).sources(
                    dtype, problem.in_channels, problem.out_channels))

    def forward_plan(self, problem: ConvProblem, params: dict) -> ForwardPlan | None:
        if self.unsupported_reason(problem) or empty_problem(problem):
            return None
        params = {**self.default_params("forward"), **params}
        tile = self.checked_tile(params["tile"], "forward")
        transposed = self.forward_weight_transposed(problem.dtype)
        gemm = self.gemm_plan(problem.dtype, problem.kernel_volume, row_width(problem.dtype, problem.in_channels),
                              problem.out_channels, tile, params["stages"], params["sort_rows"], transposed)
        return forward_plan(problem, gemm, transposed)

    def backward_plan(self, problem: ConvProblem, params: dict) -> BackwardPlan | None:
        if self.unsupported_reason(problem) or empty_problem(problem):
            return None
        params = {**self.default_params("backward"), **params}
        tile = self.checked_tile(params["tile"], "dgrad")
        dgrad = self.gemm_plan(problem.dtype, problem.kernel_volume, row_width(problem.dtype, problem.out_channels),
                               problem.in_channels, tile, self.dgrad_stages_for(tile), True, True)
        wgrad = wgrad_plan(current_device(), problem.dtype, problem.kernel_volume, problem.in_channels,
                           problem.out_channels, params["wgrad_warps_per_sm"],
                           self.wgrad_plan_class_for(problem.dtype, problem.in_channels, problem.out_channels))
        return backward_plan(problem, dgrad, wgrad)
