// SIMT implicit GEMM for sparse convolution: the gather through the pair table happens while
// staging shared-memory tiles, so no gathered copy of the features is ever materialised.
//
// Forward (and dgrad, over the reversed map with the weight read transposed) is
// output-stationary: each output element is written once by one thread, with no atomics, so the
// result is deterministic. wgrad writes fp32 partial sums per row split; the host sums them.
#include "float_conversion.cuh"

// out[i, o] = sum_k sum_r features[table[k, i], r] * W_k[r, o], with r over `reduce_channels`.
// W_k is weight[k] of shape [reduce_channels, out_channels] (forward), or, with
// TRANSPOSE_WEIGHT, the transpose of weight[k] of shape [out_channels, reduce_channels] (dgrad:
// the [K, C_in, C_out] weight read as [K, C_out, C_in] without a transposed copy).
//
// Block (BLOCK, BLOCK): threadIdx.x picks the output channel, threadIdx.y the output row; grid
// (row tiles, channel tiles), so the row count is bounded by gridDim.x (2^31 - 1), not 65535.
template <typename T, int BLOCK, bool TRANSPOSE_WEIGHT>
__global__ void implicit_gemm_forward(const T* __restrict__ features, const T* __restrict__ weight,
                                      const int* __restrict__ pair_table, int num_out, int kernel_volume,
                                      int reduce_channels, int out_channels, T* __restrict__ out) {
  // +1 column: the transposed weight store walks a column; padding keeps it conflict-free.
  __shared__ float input_tile[BLOCK][BLOCK + 1];   // [row in tile][reduce channel in chunk]
  __shared__ float weight_tile[BLOCK][BLOCK + 1];  // [reduce channel in chunk][output channel in tile]

  const int tx = threadIdx.x, ty = threadIdx.y;
  const int row = blockIdx.x * BLOCK + ty;
  const int first_out_channel = blockIdx.y * BLOCK;
  const int out_channel = first_out_channel + tx;
  const long long weight_per_offset = (long long)reduce_channels * out_channels;

  float accumulator = 0.0f;
  for (int k = 0; k < kernel_volume; ++k) {
    const int in_row = row < num_out ? pair_table[(long long)k * num_out + row] : -1;
    // Uniform over the block: every thread skips, or every thread goes on to the barriers below.
    if (!__syncthreads_or(in_row >= 0)) continue;
    const T* in_features = features + (long long)(in_row >= 0 ? in_row : 0) * reduce_channels;
    const T* weight_k = weight + k * weight_per_offset;
    for (int chunk = 0; chunk < reduce_channels; chunk += BLOCK) {
      const int in_channel = chunk + tx;
      input_tile[ty][tx] = in_row >= 0 && in_channel < reduce_channels ? to_float(in_features[in_channel]) : 0.0f;
      if (TRANSPOSE_WEIGHT) {
        // Element (r = chunk + tx, o = first_out_channel + ty) sits at weight_k[o * reduce + r]:
        // consecutive tx read consecutive addresses.
        const int reduce_index = chunk + tx, tile_out_channel = first_out_channel + ty;
        weight_tile[tx][ty] = reduce_index < reduce_channels && tile_out_channel < out_channels
                                  ? to_float(weight_k[(long long)tile_out_channel * reduce_channels + reduce_index])
                                  : 0.0f;
      } else {
        const int reduce_index = chunk + ty;
        weight_tile[ty][tx] = reduce_index < reduce_channels && out_channel < out_channels
                                  ? to_float(weight_k[(long long)reduce_index * out_channels + out_channel])
                                  : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int r = 0; r < BLOCK; ++r) accumulator = fmaf(input_tile[ty][r], weight_tile[r][tx], accumulator);
      __syncthreads();  // the tiles are overwritten by the next chunk
    }
  }
  if (row < num_out && out_channel < out_channels) {
    out[(long long)row * out_channels + out_channel] = from_float<T>(accumulator);
  }
}

// partials[s, k, c, o] = sum over output rows i of split s of features[table[k, i], c] * grad_output[i, o].
//
// Block (BLOCK, BLOCK) owns the BLOCK x BLOCK tile of dW_k at in-channel tile blockIdx.y and
// out-channel tile blockIdx.x; blockIdx.z = k * split_k + s. The split's rows are walked in
// chunks of BLOCK: while staging, threadIdx.y is the row in the chunk; while multiplying,
// threadIdx.y is the in-channel and threadIdx.x the out-channel of the tile element owned.
template <typename T, int BLOCK>
__global__ void implicit_gemm_wgrad(const T* __restrict__ features, const T* __restrict__ grad_output,
                                    const int* __restrict__ pair_table, int num_out, int kernel_volume,
                                    int in_channels, int out_channels, int split_k, float* __restrict__ partials) {
  __shared__ float feature_tile[BLOCK][BLOCK + 1];  // [row in chunk][in channel in tile]
  __shared__ float grad_tile[BLOCK][BLOCK + 1];     // [row in chunk][out channel in tile]

  const int tx = threadIdx.x, ty = threadIdx.y;
  const int k = blockIdx.z / split_k, split = blockIdx.z % split_k;
  const int first_in_channel = blockIdx.y * BLOCK, first_out_channel = blockIdx.x * BLOCK;
  const int num_chunks = (num_out + BLOCK - 1) / BLOCK;
  const int chunks_per_split = (num_chunks + split_k - 1) / split_k;
  const int first_chunk = split * chunks_per_split;
  const int end_chunk = min(num_chunks, first_chunk + chunks_per_split);
  const int* offset_pairs = pair_table + (long long)k * num_out;

  float accumulator = 0.0f;
  for (int chunk = first_chunk; chunk < end_chunk; ++chunk) {
    const int row = chunk * BLOCK + ty;
    const int in_row = row < num_out ? offset_pairs[row] : -1;
    // Uniform over the block: every thread skips, or every thread goes on to the barriers below.
    if (!__syncthreads_or(in_row >= 0)) continue;
    const int in_channel = first_in_channel + tx, out_channel = first_out_channel + tx;
    feature_tile[ty][tx] = in_row >= 0 && in_channel < in_channels
                               ? to_float(features[(long long)in_row * in_channels + in_channel])
                               : 0.0f;
    // A row without a pair contributes nothing: skip reading its gradient too.
    grad_tile[ty][tx] = in_row >= 0 && out_channel < out_channels
                            ? to_float(grad_output[(long long)row * out_channels + out_channel])
                            : 0.0f;
    __syncthreads();
#pragma unroll
    for (int r = 0; r < BLOCK; ++r) accumulator = fmaf(feature_tile[r][ty], grad_tile[r][tx], accumulator);
    __syncthreads();  // the tiles are overwritten by the next chunk
  }
  const int in_channel = first_in_channel + ty, out_channel = first_out_channel + tx;
  if (in_channel < in_channels && out_channel < out_channels) {
    const long long dw_row = ((long long)split * kernel_volume + k) * in_channels + in_channel;
    partials[dw_row * out_channels + out_channel] = accumulator;
  }
}
