"""Depthwise convolution (weights `[K, C]`, one filter per channel): `explicit` and `implicit`.

- forward: `out[i, c] = Σ_k w[k, c] · x[table[k, i], c]`
- dgrad:   `dx[j, c]  = Σ w[k, c] · dy[i, c]` over the pairs (k, j, i)
- wgrad:   `dw[k, c]  = Σ_i x[table[k, i], c] · dy[i, c]`

`explicit` runs on NumPy or CuPy in any feature dtype, offset by offset over the CSR pair lists.
`implicit` runs the raw kernels of raw_kernels/depthwise.cu (fp32, fp16, bf16 from sm_80 on).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from cupysparse.cuda.backend import array_module, cupy_module
from cupysparse.cuda.compile import KernelSource, launch_config
from cupysparse.cuda.dtypes import FEATURE_DTYPES, accumulation_dtype, cuda_type_name, short_name
from cupysparse.cuda.precision import rounded_result
from cupysparse.algorithms.base import DEPTHWISE, Algorithm, ConvProblem, register
from cupysparse.algorithms.implicit_gemm import check_same_dtype, kernel_source_for, simt_unsupported_reason


@register
class ExplicitDepthwise(Algorithm):
    """Per offset, gather the pairs' rows, multiply by the offset's weights, scatter-add.

    Within one offset every input row and every output row occurs at most once, so a plain
    fancy-indexed `+=` is exact and deterministic; inputs are cast up to the accumulation dtype
    first and the result rounded back (`precision.rounded_result`: on the CPU, an fp16 or bf16 result
    out of range is reported where it is).
    """

    name = "explicit"
    kind = DEPTHWISE
    reference = True
    tuning_namespaces: ClassVar[dict[str, str]] = {
        "forward": "depthwise_explicit_gather_scatter",
        "backward": "depthwise_explicit_gather_scatter_backward",
    }

    def unsupported_reason(self, problem: ConvProblem) -> str | None:
        if problem.dtype not in FEATURE_DTYPES:
            return f"{self.name} supports {', '.join(short_name(d) for d in FEATURE_DTYPES)}, not {problem.dtype}"
        return None

    def forward(self, features, weight, kernel_map):
        xp = array_module(features)
        accumulate = accumulation_dtype(features.dtype)
        x, w = features.astype(accumulate, copy=False), weight.astype(accumulate, copy=False)
        out = xp.zeros((kernel_map.num_out, features.shape[1]), dtype=accumulate)
        for k, in_rows, out_rows in kernel_map.offset_pairs():
            out[out_rows] += x[in_rows] * w[k]
        return rounded_result(out, features.dtype, "output")

    def dgrad(self, grad_output, weight, kernel_map):
        xp = array_module(grad_output)
        accumulate = accumulation_dtype(grad_output.dtype)
        dy, w = grad_output.astype(accumulate, copy=False), weight.astype(accumulate, copy=False)
        grad_input = xp.zeros((kernel_map.num_in, grad_output.shape[1]), dtype=accumulate)
        for k, in_rows, out_rows in kernel_map.offset_pairs():
            grad_input[in_rows] += dy[out_rows] * w[k]
        return rounded_result(grad_input, grad_output.dtype, "input gradient")

    def wgrad(self, features, grad_output, kernel_map):
        xp = array_module(features)
        accumulate = accumulation_dtype(features.dtype)
        x, dy = features.astype(accumulate, copy=False), grad_output.astype(accumulate, copy=False)
        grad_weight = xp.zeros((kernel_map.kernel_volume, features.shape[1]), dtype=accumulate)
        for k, in_rows, out_rows in kernel_map.offset_pairs():
            grad_weight[k] = (x[in_rows] * dy[out_rows]).sum(axis=0)
        return rounded_result(grad_weight, features.dtype, "weight gradient")


CHANNELS_PER_THREAD = (1, 2, 4)
ROW_CHUNKS = (128, 32, 512)

# Mirror CHANNEL_LANES and ROW_LANES in raw_kernels/depthwise.cu: the wgrad block shape.
_WGRAD_CHANNEL_LANES = 32
_WGRAD_ROW_LANES = 8


def _instantiations(type_name: str) -> tuple[str, ...]:
    return tuple(
        f"depthwise_{phase}<{type_name}, {channels}>"
        for phase in ("forward", "wgrad")
        for channels in CHANNELS_PER_THREAD
    )


_KERNELS = KernelSource("depthwise.cu", _instantiations("float") + _instantiations("__half"))
_BF16_KERNELS = KernelSource("depthwise.cu", _instantiations("__nv_bfloat16"))


def _depthwise_gather(features, weight, pair_table, channels_per_thread: int):
    """`out[i, c] = Σ_k weight[k, c] · features[table[k, i], c]`, one thread per row and channel group."""
    cupy = cupy_module()
    check_same_dtype(features, weight, "features and weight")
    kernel_volume, num_out = pair_table.shape
    num_in, channels = features.shape
    if num_out == 0 or channels == 0 or num_in == 0 or kernel_volume == 0:
        return cupy.zeros((num_out, channels), dtype=features.dtype)
    features = cupy.ascontiguousarray(features)
    weight = cupy.ascontiguousarray(weight)
    pair_table = cupy.ascontiguousarray(pair_table)
    out = cupy.empty((num_out, channels), dtype=features.dtype)  # the kernel writes every element
    name = f"depthwise_forward<{cuda_type_name(features.dtype)}, {channels_per_thread}>"
    kernel = kernel_source_for(features.dtype, _KERNELS, _BF16_KERNELS).get(name)
    grid, block = launch_config(num_out * -(-channels // channels_per_thread))
    kernel(
        grid,
        block,
        (features, weight, pair_table, np.int32(num_out), np.int32(kernel_volume), np.int32(channels), out),
    )
    return out


@register
class ImplicitDepthwise(Algorithm):
    """Raw kernels: forward and dgrad gather through the pair table, one thread per output row and
    group of `channels_per_thread` channels (more channels per thread share one pair-table read
    per offset among them; fewer give more threads to narrow layers). wgrad sums each offset's
    products over `row_chunks` chunks of the output rows into an fp32 workspace
    `[row_chunks, K, C]`, whose size does not grow with the number of rows, and adds the chunks up
    in a fixed order; a few hundred chunks give enough blocks to fill a GPU even for small K · C."""

    name = "implicit"
    kernel_sources = ("depthwise.cu",)
    kind = DEPTHWISE
    tuning_namespaces: ClassVar[dict[str, str]] = {
        "forward": "depthwise_implicit_gather",
        "backward": "depthwise_implicit_split_rows_backward",
    }
    forward_params: ClassVar[dict[str, tuple]] = {"channels_per_thread": CHANNELS_PER_THREAD}
    backward_params: ClassVar[dict[str, tuple]] = {"channels_per_thread": CHANNELS_PER_THREAD, "row_chunks": ROW_CHUNKS}

    def auto_priority(self, problem: ConvProblem) -> int:
        return 1  # one pass over the pair table, no gathered copies

    def unsupported_reason(self, problem: ConvProblem) -> str | None:
        return simt_unsupported_reason(problem, f"depthwise {self.name}")

    def kernel_modules(self, phase: str, problem: ConvProblem, params: dict) -> tuple[KernelSource, ...]:
        if self.unsupported_reason(problem):
            return ()
        return (kernel_source_for(problem.dtype, _KERNELS, _BF16_KERNELS),)

    def forward(self, features, weight, kernel_map, channels_per_thread: int = CHANNELS_PER_THREAD[0]):
        return _depthwise_gather(features, weight, kernel_map.pair_table, channels_per_thread)

    def dgrad(
        self,
        grad_output,
        weight,
        kernel_map,
        channels_per_thread: int = CHANNELS_PER_THREAD[0],
        row_chunks: int = ROW_CHUNKS[0],
    ):
        """The forward kernel over the map indexed by input row (a depthwise weight is its own
        transpose); `row_chunks` only tunes wgrad."""
        return _depthwise_gather(grad_output, weight, kernel_map.reversed().pair_table, channels_per_thread)

    def wgrad(
        self,
        features,
        grad_output,
        kernel_map,
        channels_per_thread: int = CHANNELS_PER_THREAD[0],
        row_chunks: int = ROW_CHUNKS[0],
    ):
        cupy = cupy_module()
        check_same_dtype(features, grad_output, "features and grad_output")
        pair_table = kernel_map.pair_table
        kernel_volume, num_out = pair_table.shape
        num_in, channels = features.shape
        if num_out == 0 or num_in == 0 or kernel_volume == 0 or channels == 0:
            return cupy.zeros((kernel_volume, channels), dtype=features.dtype)
        features = cupy.ascontiguousarray(features)
        grad_output = cupy.ascontiguousarray(grad_output)
        pair_table = cupy.ascontiguousarray(pair_table)
        rows_per_chunk = -(-num_out // row_chunks)
        num_chunks = -(-num_out // rows_per_chunk)  # at most row_chunks; fewer when rows are few
        # Every block writes its chunk's sums, zeros included, so the workspace needs no clearing.
        partials = cupy.empty((num_chunks, kernel_volume, channels), dtype=np.float32)
        name = f"depthwise_wgrad<{cuda_type_name(features.dtype)}, {channels_per_thread}>"
        kernel = kernel_source_for(features.dtype, _KERNELS, _BF16_KERNELS).get(name)
        channel_tiles = -(-channels // (_WGRAD_CHANNEL_LANES * channels_per_thread))
        kernel(
            (num_chunks, channel_tiles, kernel_volume),
            (_WGRAD_CHANNEL_LANES, _WGRAD_ROW_LANES),
            (
                features,
                grad_output,
                pair_table,
                np.int32(num_out),
                np.int32(kernel_volume),
                np.int32(channels),
                np.int32(rows_per_chunk),
                partials,
            ),
        )
        return partials.sum(axis=0).astype(features.dtype)
