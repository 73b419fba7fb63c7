// The sum of the split-K wgrad's fp32 partials into the weight gradient: a kernel of its own
// (wgrad_sum.cu) where only the weight gradient is wanted, else the last blocks of the dgrad launch (the
// forward kernels' `sum_wgrad_in_dgrad`, from forward_tile.cuh), which runs after the wgrad GEMM: the
// backward is then two launches.
//
// grad_weight [kernel_volume, in_channels, out_channels] = for each offset k, the sum of its shares'
// partials, slots slot_starts[k] .. slot_starts[k + 1] - 1 of the wgrad workspace [slots,
// in_channels_padded, out_channels_padded], cropped to the unpadded channels and rounded once to T.
// `slot_groups` (1, 2, 4 or 8) threads share an element, so that more loads are in flight where few
// elements have many shares: group g adds slots slot_starts[k] + g, + g + slot_groups, ... and the groups'
// sums are added in group order, a fixed order for a given slot_groups whatever the block size (fp32,
// deterministic: both launches give the same bits). A block of THREADS sums THREADS / slot_groups
// consecutive elements of dW_k (32-bit index arithmetic: 64-bit divisions cost more than the loads).
#pragma once
#include "float_conversion.cuh"

struct WgradSum {
  const float* workspace;
  const int* slot_starts;
  int in_channels, in_channels_padded, out_channels, out_channels_padded, slot_groups;
};

// Blocks of THREADS that sum one offset's elements.
template <int THREADS>
__device__ __forceinline__ int wgrad_sum_blocks_per_offset(const WgradSum& sum) {
  return (sum.in_channels * sum.out_channels * sum.slot_groups + THREADS - 1) / THREADS;
}

// Block `block` (of wgrad_sum_blocks_per_offset) of offset k's sum; `group_sums` is THREADS floats of
// shared memory.
template <typename T, int THREADS>
__device__ __forceinline__ void sum_wgrad_partials(const WgradSum& sum, T* __restrict__ grad_weight, int k,
                                                   int block, float* group_sums) {
  const int elements = THREADS / sum.slot_groups;
  const int element = threadIdx.x % elements, group = threadIdx.x / elements;
  const int e = block * elements + element;
  const bool inside = e < sum.in_channels * sum.out_channels;
  float total = 0.0f;
  if (inside) {
    const int row = e / sum.out_channels, col = e - row * sum.out_channels;
    const float* partial = sum.workspace + (long long)row * sum.out_channels_padded + col;
    const long long slot_stride = (long long)sum.in_channels_padded * sum.out_channels_padded;
    for (int slot = sum.slot_starts[k] + group; slot < sum.slot_starts[k + 1]; slot += sum.slot_groups)
      total += partial[slot * slot_stride];
  }
  if (sum.slot_groups > 1) {  // the same for every thread of the block
    group_sums[threadIdx.x] = total;
    __syncthreads();
    if (group == 0)
      for (int g = 1; g < sum.slot_groups; ++g) total += group_sums[g * elements + element];
  }
  if (group == 0 && inside)
    grad_weight[(long long)k * sum.in_channels * sum.out_channels + e] = from_float<T>(total);
}

// The blocks of a dgrad launch past its tiles: block `block` of them sums its part of wgrad's partials.
// They come last: ahead of the tiles, they held the GEMM's first wave back (H100, 100K voxels, fp16
// backward 5-13% slower than with them last). dgrad is the forward kernel over dy: the layer's weight
// gradient is [K, the kernel's out_channels, its in_channels].
template <typename T, int THREADS>
__device__ __forceinline__ void sum_wgrad_in_dgrad(const float* workspace, T* __restrict__ grad_weight,
                                                   const int* slot_starts, int slot_groups, int kernel_in_channels,
                                                   int kernel_in_channels_padded, int kernel_out_channels,
                                                   int kernel_out_channels_padded, int block, float* group_sums) {
  const WgradSum sum{workspace,          slot_starts,          kernel_out_channels, kernel_out_channels_padded,
                     kernel_in_channels, kernel_in_channels_padded, slot_groups};
  const int per_offset = wgrad_sum_blocks_per_offset<THREADS>(sum);
  sum_wgrad_partials<T, THREADS>(sum, grad_weight, block / per_offset, block % per_offset, group_sums);
}
