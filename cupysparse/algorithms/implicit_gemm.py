"""`implicit_gemm`: SIMT raw kernels that gather through the pair table inside the GEMM tiles.

Forward is output-stationary (raw_kernels/implicit_gemm.cu): a (B x B)-thread block owns B output
rows by B output channels, loops over the offsets and the input channels in chunks of B, and writes
each output once, so results are deterministic. dgrad is the same kernel over the reversed map with
the weight read transposed. wgrad accumulates B x B tiles of each dW_k over 1/split_k of the output
rows into an fp32 workspace `[split_k, K, C_in, C_out]`, summed here in a fixed order.

The bf16 instantiations are a separate `KernelSource` so that nothing bf16 is compiled on a GPU
older than sm_80.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from cupysparse.cuda.backend import cupy_module
from cupysparse.cuda.compile import KernelSource
from cupysparse.cuda.dtypes import BFLOAT16, FEATURE_DTYPES, FLOAT16, FLOAT32, cuda_type_name, short_name
from cupysparse.algorithms.base import MAX_GRID_Z, Algorithm, ConvProblem, gpu_only_reason, register

BLOCK_SIZES = (16, 4, 32)
SPLIT_K_FACTORS = (4, 2, 8)

SIMT_DTYPES = (FLOAT32, FLOAT16, BFLOAT16)
# Until the tuner measures, `auto` prefers these kernels to explicit_gemm only for narrow layers.
SIMT_PREFERRED_MAX_CHANNEL_PRODUCT = 96 * 96
BF16_MIN_COMPUTE_CAPABILITY = 80


def _instantiations(type_name: str) -> tuple[str, ...]:
    forward = tuple(
        f"implicit_gemm_forward<{type_name}, {block}, {transpose}>"
        for block in sorted(BLOCK_SIZES)
        for transpose in ("false", "true")
    )
    return forward + tuple(f"implicit_gemm_wgrad<{type_name}, {block}>" for block in sorted(BLOCK_SIZES))


_KERNELS = KernelSource("implicit_gemm.cu", _instantiations("float") + _instantiations("__half"))
_BF16_KERNELS = KernelSource("implicit_gemm.cu", _instantiations("__nv_bfloat16"))


def simt_unsupported_reason(problem: ConvProblem, algorithm_name: str) -> str | None:
    """Why SIMT raw kernels (fp32, fp16, and bf16 from sm_80 on) cannot run `problem`, or None."""
    reason = gpu_only_reason(problem)
    if reason:
        return reason
    if problem.dtype not in SIMT_DTYPES:
        dtype_name = short_name(problem.dtype) if problem.dtype in FEATURE_DTYPES else str(problem.dtype)
        return f"{algorithm_name} has kernels for fp32, fp16 and bf16 only, not {dtype_name}"
    if problem.dtype == BFLOAT16 and (problem.compute_capability or 0) < BF16_MIN_COMPUTE_CAPABILITY:
        return (
            f"{algorithm_name} needs compute capability 8.0 (sm_80) or newer for bf16; "
            f"this GPU is sm_{problem.compute_capability}"
        )
    return None


def kernel_source_for(dtype, source: KernelSource, bf16_source: KernelSource) -> KernelSource:
    """The source holding the instantiations of `dtype`: bf16 ones live apart (sm_80+ only)."""
    return bf16_source if np.dtype(dtype) == BFLOAT16 else source


def check_same_dtype(first, second, names: str) -> None:
    """The kernels read both arrays as one type: refuse a mismatch instead of misreading memory."""
    if first.dtype != second.dtype:
        raise TypeError(
            f"{names} must have the same dtype, got {short_name(first.dtype)} and {short_name(second.dtype)}"
        )


def _gather_gemm(features, weight, pair_table, out_channels: int, block_size: int, transpose_weight: bool):
    """`out[i] = Σ_k W_k^T · features[table[k, i]]` (W_k read transposed when `transpose_weight`)."""
    cupy = cupy_module()
    check_same_dtype(features, weight, "features and weight")
    kernel_volume, num_out = pair_table.shape
    num_in, reduce_channels = features.shape
    if num_out == 0 or out_channels == 0 or num_in == 0 or kernel_volume == 0 or reduce_channels == 0:
        return cupy.zeros((num_out, out_channels), dtype=features.dtype)
    features = cupy.ascontiguousarray(features)
    weight = cupy.ascontiguousarray(weight)
    pair_table = cupy.ascontiguousarray(pair_table)
    out = cupy.empty((num_out, out_channels), dtype=features.dtype)  # the kernel writes every element
    name = f"implicit_gemm_forward<{cuda_type_name(features.dtype)}, {block_size}, {str(transpose_weight).lower()}>"
    kernel = kernel_source_for(features.dtype, _KERNELS, _BF16_KERNELS).get(name)
    grid = (-(-num_out // block_size), -(-out_channels // block_size))
    kernel(
        grid,
        (block_size, block_size),
        (
            features,
            weight,
            pair_table,
            np.int32(num_out),
            np.int32(kernel_volume),
            np.int32(reduce_channels),
            np.int32(out_channels),
            out,
        ),
    )
    return out


@register
class ImplicitGemm(Algorithm):
    name = "implicit_gemm"
    kernel_sources = ("implicit_gemm.cu",)
    tuning_namespaces: ClassVar[dict[str, str]] = {
        "forward": "implicit_gemm_A_gather",
        "backward": "implicit_gemm_trAB_gather",
    }
    forward_params: ClassVar[dict[str, tuple]] = {"fwd_block_size": BLOCK_SIZES}
    backward_params: ClassVar[dict[str, tuple]] = {"gemm_block_size": BLOCK_SIZES, "split_k_factor": SPLIT_K_FACTORS}

    def auto_priority(self, problem: ConvProblem) -> int:
        # Measured on an H200 (fp32, 200K voxels, subm 3³): 5x faster than explicit_gemm at
        # 32 → 32 channels, 3.2x slower at 256 → 256; the crossover is near 100 → 100.
        return 1 if problem.in_channels * problem.out_channels <= SIMT_PREFERRED_MAX_CHANNEL_PRODUCT else -1

    def unsupported_reason(self, problem: ConvProblem) -> str | None:
        return simt_unsupported_reason(problem, self.name)

    def kernel_modules(self, phase: str, problem: ConvProblem, params: dict) -> tuple[KernelSource, ...]:
        if self.unsupported_reason(problem):
            return ()
        return (kernel_source_for(problem.dtype, _KERNELS, _BF16_KERNELS),)

    def transient_bytes(self, problem: ConvProblem, phase: str, params: dict, max_offset_pairs: int) -> int:
        """wgrad's fp32 split-K partials and their sum."""
        if phase in ("forward", "dgrad"):
            return 0
        split = params.get("split_k_factor", 1)
        return (split + 1) * problem.kernel_volume * problem.in_channels * problem.out_channels * 4

    def forward(self, features, weight, kernel_map, fwd_block_size: int = BLOCK_SIZES[0]):
        return _gather_gemm(features, weight, kernel_map.pair_table, weight.shape[2], fwd_block_size, False)

    def dgrad(
        self,
        grad_output,
        weight,
        kernel_map,
        gemm_block_size: int = BLOCK_SIZES[0],
        split_k_factor: int = SPLIT_K_FACTORS[0],
    ):
        """The forward kernel over the map indexed by input row, reading W_k transposed;
        `split_k_factor` only tunes wgrad (one parameter space serves both backward phases)."""
        return _gather_gemm(
            grad_output, weight, kernel_map.reversed().pair_table, weight.shape[1], gemm_block_size, True
        )

    def wgrad(
        self,
        features,
        grad_output,
        kernel_map,
        gemm_block_size: int = BLOCK_SIZES[0],
        split_k_factor: int = SPLIT_K_FACTORS[0],
    ):
        cupy = cupy_module()
        check_same_dtype(features, grad_output, "features and grad_output")
        pair_table = kernel_map.pair_table
        kernel_volume, num_out = pair_table.shape
        num_in, in_channels = features.shape
        out_channels = grad_output.shape[1]
        if num_out == 0 or num_in == 0 or kernel_volume == 0 or in_channels == 0 or out_channels == 0:
            return cupy.zeros((kernel_volume, in_channels, out_channels), dtype=features.dtype)
        features = cupy.ascontiguousarray(features)
        grad_output = cupy.ascontiguousarray(grad_output)
        pair_table = cupy.ascontiguousarray(pair_table)
        # Grid z holds an offset times a split: fewer splits for large kernels (the sum is the same).
        split_k_factor = min(split_k_factor, MAX_GRID_Z // kernel_volume)
        # Every block writes its whole tile, zeros included, so the workspace needs no clearing.
        partials = cupy.empty((split_k_factor, kernel_volume, in_channels, out_channels), dtype=np.float32)
        name = f"implicit_gemm_wgrad<{cuda_type_name(features.dtype)}, {gemm_block_size}>"
        kernel = kernel_source_for(features.dtype, _KERNELS, _BF16_KERNELS).get(name)
        block = gemm_block_size
        grid = (-(-out_channels // block), -(-in_channels // block), kernel_volume * split_k_factor)
        kernel(
            grid,
            (block, block),
            (
                features,
                grad_output,
                pair_table,
                np.int32(num_out),
                np.int32(kernel_volume),
                np.int32(in_channels),
                np.int32(out_channels),
                np.int32(split_k_factor),
                partials,
            ),
        )
        return partials.sum(axis=0).astype(features.dtype)
