// The sum of the split-K wgrad's fp32 partials into the weight gradient in a launch of its own, where only
// the weight gradient is wanted (a backward of both gradients sums them in the dgrad launch instead:
// forward_tile_or_wgrad_sum). Every tensor-core wgrad's partials (wmma_, mma_ and wgmma_implicit_gemm.cu)
// take this kernel: block (x, k) sums block x of offset k's elements (wgrad_sum.cuh).
#include "wgrad_sum.cuh"

constexpr int SUM_THREADS = 256;

template <typename T>
__global__ void __launch_bounds__(SUM_THREADS)
    wgrad_sum(const float* __restrict__ workspace, T* __restrict__ grad_weight, const int* __restrict__ slot_starts,
              int in_channels, int in_channels_padded, int out_channels, int out_channels_padded, int slot_groups) {
  __shared__ float group_sums[SUM_THREADS];
  const WgradSum sum{workspace,    slot_starts,         in_channels, in_channels_padded,
                     out_channels, out_channels_padded, slot_groups};
  sum_wgrad_partials<T, SUM_THREADS>(sum, grad_weight, blockIdx.y, blockIdx.x, group_sums);
}
