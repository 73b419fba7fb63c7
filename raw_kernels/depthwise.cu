// Depthwise sparse convolution (weights [K, C], one filter per channel) through the pair table.
//
// The forward kernel (and dgrad, the same kernel over the reversed map: a depthwise weight is its
// own transpose) gives each output element to one thread, with no atomics. wgrad writes fp32
// partial sums per row chunk, reduced in a fixed order; the host sums the chunks. Deterministic.
#include "float_conversion.cuh"

// out[i, c] = sum_k weight[k, c] * features[table[k, i], c].
// One thread per (output row, group of CHANNELS_PER_THREAD consecutive channels): a group shares
// one pair-table read per offset; consecutive threads take consecutive groups of the same row.
template <typename T, int CHANNELS_PER_THREAD>
__global__ void depthwise_forward(const T* __restrict__ features, const T* __restrict__ weight,
                                  const int* __restrict__ pair_table, int num_out, int kernel_volume, int channels,
                                  T* __restrict__ out) {
  const int groups = (channels + CHANNELS_PER_THREAD - 1) / CHANNELS_PER_THREAD;
  const long long thread = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (thread >= (long long)num_out * groups) return;
  const int row = (int)(thread / groups);
  const int first_channel = (int)(thread % groups) * CHANNELS_PER_THREAD;

  float accumulator[CHANNELS_PER_THREAD] = {};
  for (int k = 0; k < kernel_volume; ++k) {
    const int in_row = pair_table[(long long)k * num_out + row];
    if (in_row < 0) continue;
    const T* in_features = features + (long long)in_row * channels;
    const T* weight_k = weight + (long long)k * channels;
#pragma unroll
    for (int j = 0; j < CHANNELS_PER_THREAD; ++j) {
      const int channel = first_channel + j;
      if (channel < channels) {
        accumulator[j] = fmaf(to_float(in_features[channel]), to_float(weight_k[channel]), accumulator[j]);
      }
    }
  }
  T* out_row = out + (long long)row * channels;
#pragma unroll
  for (int j = 0; j < CHANNELS_PER_THREAD; ++j) {
    const int channel = first_channel + j;
    if (channel < channels) out_row[channel] = from_float<T>(accumulator[j]);
  }
}

// Threads of one wgrad block: CHANNEL_LANES channel groups (one warp along the channels, so a
// warp reads one row's channels contiguously) by ROW_LANES rows walked in parallel.
constexpr int CHANNEL_LANES = 32;
constexpr int ROW_LANES = 8;

// partials[chunk, k, c] = sum over output rows i of the chunk of features[table[k, i], c] * grad_output[i, c].
// Block (CHANNEL_LANES, ROW_LANES); grid (row chunks, channel tiles of CHANNEL_LANES groups, K).
// Each row lane sums every ROW_LANES-th row of the chunk; the lanes are then added in lane order.
template <typename T, int CHANNELS_PER_THREAD>
__global__ void depthwise_wgrad(const T* __restrict__ features, const T* __restrict__ grad_output,
                                const int* __restrict__ pair_table, int num_out, int kernel_volume, int channels,
                                int rows_per_chunk, float* __restrict__ partials) {
  __shared__ float lane_sums[ROW_LANES][CHANNEL_LANES * CHANNELS_PER_THREAD];

  const int chunk = blockIdx.x, k = blockIdx.z;
  const int first_channel = (blockIdx.y * CHANNEL_LANES + threadIdx.x) * CHANNELS_PER_THREAD;
  const long long chunk_start = (long long)chunk * rows_per_chunk;
  const long long chunk_end = min((long long)num_out, chunk_start + rows_per_chunk);
  const int* offset_pairs = pair_table + (long long)k * num_out;

  float accumulator[CHANNELS_PER_THREAD] = {};
  for (long long row = chunk_start + threadIdx.y; row < chunk_end; row += ROW_LANES) {
    const int in_row = offset_pairs[row];
    if (in_row < 0) continue;
    const T* in_features = features + (long long)in_row * channels;
    const T* grad_row = grad_output + row * channels;
#pragma unroll
    for (int j = 0; j < CHANNELS_PER_THREAD; ++j) {
      const int channel = first_channel + j;
      if (channel < channels) {
        accumulator[j] = fmaf(to_float(in_features[channel]), to_float(grad_row[channel]), accumulator[j]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < CHANNELS_PER_THREAD; ++j) {
    lane_sums[threadIdx.y][threadIdx.x * CHANNELS_PER_THREAD + j] = accumulator[j];
  }
  __syncthreads();
  if (threadIdx.y != 0) return;
#pragma unroll
  for (int j = 0; j < CHANNELS_PER_THREAD; ++j) {
    const int channel = first_channel + j;
    if (channel >= channels) continue;
    float total = 0.0f;
    for (int lane = 0; lane < ROW_LANES; ++lane) total += lane_sums[lane][threadIdx.x * CHANNELS_PER_THREAD + j];
    partials[((long long)chunk * kernel_volume + k) * channels + channel] = total;
  }
}
