"""`explicit_gemm`: per offset, gather the input rows of its pairs, one GEMM, add into the outputs.

The reference algorithm: every device and dtype (GEMMs through cuBLAS via CuPy on the GPU, NumPy
on the CPU). Output rows are unique within one offset, so the add needs no atomics and the result
is deterministic. The identity offset of a submanifold map multiplies the whole input, no gather.
Accumulates in `accumulation_dtype`. Forward and dgrad GEMMs (sums over the channels) run in the
input dtype on the GPU and in fp32 on the CPU, bfloat16 in fp32 everywhere; wgrad GEMMs (sums over
the pairs) run in fp32. On the CPU, an fp16 or bf16 result out of range is reported where it is
(`precision.rounded_result`).
"""

from __future__ import annotations

from typing import ClassVar

from cupysparse.cuda.backend import array_module, is_cupy_array
from cupysparse.cuda.dtypes import BFLOAT16, FEATURE_DTYPES, accumulation_dtype
from cupysparse.cuda.precision import rounded_result
from cupysparse.algorithms.base import Algorithm, ConvProblem, register


def _gemm_dtype(features):
    """The dtype the GEMMs run in: the input's on the GPU, except bfloat16; fp32 for halves on the CPU."""
    if features.dtype == BFLOAT16 or not is_cupy_array(features):
        return accumulation_dtype(features.dtype)
    return features.dtype


def gather_gemm_scatter(features, weight, kernel_map, label: str):
    """`out[i] = Σ_k weight[k]^T · features[table[k, i]]` with weight `[K, C_a, C_b]`; `label` names
    the result in a report of values out of range."""
    xp = array_module(features)
    gemm_dtype = _gemm_dtype(features)
    x = features.astype(gemm_dtype, copy=False)
    w = weight.astype(gemm_dtype, copy=False)
    out = xp.zeros((kernel_map.num_out, weight.shape[2]), dtype=accumulation_dtype(features.dtype))
    if kernel_map.identity_offset is not None:
        out += x @ w[kernel_map.identity_offset]
    for k, in_rows, out_rows in kernel_map.offset_pairs(skip_identity=True):
        out[out_rows] += x[in_rows] @ w[k]
    return rounded_result(out, features.dtype, label)


@register
class ExplicitGemm(Algorithm):
    name = "explicit_gemm"
    tuning_namespaces: ClassVar[dict[str, str]] = {
        "forward": "explicit_gemm_gather_mm_scatter",
        "backward": "explicit_gemm_trAB_gather_mm",
    }
    capturable = False  # CuPy refuses cuBLAS calls during stream capture
    reference = True

    def unsupported_reason(self, problem: ConvProblem) -> str | None:
        if problem.dtype not in FEATURE_DTYPES:
            return f"{self.name} supports fp64, fp32, fp16 and bf16, not {problem.dtype}"
        return None

    def transient_bytes(self, problem: ConvProblem, phase: str, params: dict, max_offset_pairs: int) -> int:
        """The accumulator and cast copies in the accumulation dtype, plus the busiest offset's gathered
        rows and product (GEMMs in the input dtype on the GPU, except bf16; in the accumulation dtype on
        the CPU)."""
        itemsize = problem.dtype.itemsize
        wide = accumulation_dtype(problem.dtype).itemsize
        gemm = itemsize if problem.device == "cuda" and problem.dtype != BFLOAT16 else wide
        cast = wide if gemm != itemsize else 0
        inputs = problem.num_in * problem.in_channels
        outputs = problem.num_out * problem.out_channels
        gathered = max_offset_pairs * (problem.in_channels + problem.out_channels)
        total = 0
        if phase == "forward":
            total = max(total, outputs * wide + gathered * gemm + inputs * cast)
        if phase in ("dgrad", "backward"):
            total = max(total, inputs * wide + gathered * gemm + outputs * cast)
        if phase in ("wgrad", "backward"):  # its GEMMs run in the accumulation dtype everywhere
            inputs_cast = wide if itemsize != wide else 0
            total = max(total, problem.kernel_volume * problem.in_channels * problem.out_channels * wide
                        + (inputs + outputs) * inputs_cast + gathered * wide)
        return total

    def forward(self, features, weight, kernel_map):
        return gather_gemm_scatter(features, weight, kernel_map, "output")

    def dgrad(self, grad_output, weight, kernel_map):
        return gather_gemm_scatter(grad_output, weight.transpose(0, 2, 1), kernel_map.reversed(), "input gradient")

    def wgrad(self, features, grad_output, kernel_map):
        xp = array_module(features)
        # The weight gradient sums over all pairs of an offset (tens of thousands of terms): cuBLAS's
        # half-precision GEMMs were measured 2% off there on an H200, so these run in fp32.
        gemm_dtype = accumulation_dtype(features.dtype)
        x = features.astype(gemm_dtype, copy=False)
        dy = grad_output.astype(gemm_dtype, copy=False)
        grad = xp.zeros((kernel_map.kernel_volume, x.shape[1], dy.shape[1]), dtype=accumulation_dtype(features.dtype))
        if kernel_map.identity_offset is not None:
            grad[kernel_map.identity_offset] = x.T @ dy
        for k, in_rows, out_rows in kernel_map.offset_pairs(skip_identity=True):
            grad[k] = x[in_rows].T @ dy[out_rows]
        return rounded_result(grad, features.dtype, "weight gradient")
