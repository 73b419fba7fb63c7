// The per-voxel epilogue of inference, in one pass over row-major [num_rows, channels] features:
// batch norm under running statistics, then optionally a residual added and a ReLU,
//   out = relu?(x * scale[c] + shift[c] (+ residual)),
//   scale[c] = weight[c] / sqrt(running_var[c] + eps),  shift[c] = bias[c] - running_mean[c] * scale[c],
// in fp32 whatever the storage types. Scale and shift are derived here from the statistics, so
// nothing computed from them is kept between calls (or goes stale when they change).
//
// A thread owns VECTOR consecutive channels of ROWS_PER_THREAD consecutive rows: it derives its
// channels' scale and shift once, then moves VECTOR values per load and store (16 bytes when the
// host found the channel count and the addresses allow it). Consecutive threads take consecutive
// channel groups, so a warp reads whole rows.
#include "float_conversion.cuh"

template <typename T, int VECTOR>
struct alignas(sizeof(T) * VECTOR) Vector {
  T values[VECTOR];
};

// T: the features' type; P: the statistics' and parameters' (T or float). residual, weight and bias
// may be null (nothing added, weight 1, bias 0). relu != 0 clamps at zero; NaN stays NaN, as in
// torch.relu. channels must be a multiple of VECTOR.
template <typename T, typename P, int VECTOR, int ROWS_PER_THREAD>
__global__ void batch_norm_epilogue(const T* __restrict__ features, const T* __restrict__ residual,
                                    const P* __restrict__ weight, const P* __restrict__ bias,
                                    const P* __restrict__ running_mean, const P* __restrict__ running_var, float eps,
                                    int relu, int num_rows, int channels, T* __restrict__ out) {
  const int groups = channels / VECTOR;
  const long long thread = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long first_row = thread / groups * ROWS_PER_THREAD;
  if (first_row >= num_rows) return;
  const int first_channel = (int)(thread % groups) * VECTOR;

  float scale[VECTOR], shift[VECTOR];
#pragma unroll
  for (int j = 0; j < VECTOR; ++j) {
    const int channel = first_channel + j;
    float channel_scale = 1.0f / sqrtf(to_float(running_var[channel]) + eps);
    if (weight != nullptr) channel_scale *= to_float(weight[channel]);
    scale[j] = channel_scale;
    shift[j] = (bias != nullptr ? to_float(bias[channel]) : 0.0f) - to_float(running_mean[channel]) * channel_scale;
  }

  using Values = Vector<T, VECTOR>;
#pragma unroll
  for (int r = 0; r < ROWS_PER_THREAD; ++r) {
    const long long row = first_row + r;
    if (row >= num_rows) break;
    const long long offset = row * channels + first_channel;
    const Values x = *reinterpret_cast<const Values*>(features + offset);
    Values added;
    if (residual != nullptr) added = *reinterpret_cast<const Values*>(residual + offset);
    Values y;
#pragma unroll
    for (int j = 0; j < VECTOR; ++j) {
      float value = fmaf(to_float(x.values[j]), scale[j], shift[j]);
      if (residual != nullptr) value += to_float(added.values[j]);
      if (relu && value <= 0.0f) value = 0.0f;
      y.values[j] = from_float<T>(value);
    }
    *reinterpret_cast<Values*>(out + offset) = y;
  }
}
