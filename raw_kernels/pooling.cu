// Sparse pooling: max / sum / average over the windows of a kernel map, global pooling per batch
// item, and their gradients. Every output element is written by exactly one thread and every sum
// runs in a fixed order, so results are deterministic without atomics.
//
// Pair tables are int32 [K, num_rows] (source row, or -1); features are row-major [rows, C].
// The feature types are named after the dtypes' short names, as the host instantiates them; fp16 and bf16
// convert through float_conversion.cuh. Their narrowing rounds to nearest even, as NumPy / ml_dtypes do
// on the CPU. The bf16 instantiations are compiled as a module of their own, so that nothing bf16 is
// compiled for a GPU older than sm_80.
#include "float_conversion.cuh"

using fp16 = __half;
using bf16 = __nv_bfloat16;
using fp32 = float;
using fp64 = double;

// fp64 accumulates in fp64, everything else in fp32.
template <typename T>
struct Accumulator {
  using type = float;
};
template <>
struct Accumulator<double> {
  using type = double;
};
template <typename T>
using acc_t = typename Accumulator<T>::type;

__device__ __forceinline__ double to_acc(double value) { return value; }
template <typename T>
__device__ __forceinline__ float to_acc(T value) {
  return to_float(value);
}

__device__ __forceinline__ void store(double* target, double value) { *target = value; }
template <typename T>
__device__ __forceinline__ void store(T* target, float value) {
  *target = from_float<T>(value);
}

// a > b with NaN above every number, so a NaN in a window propagates (as in torch max pooling).
template <typename A>
__device__ __forceinline__ bool greater(A a, A b) {
  return a != a ? b == b : a > b;
}

// Whether (value, row) is a better first maximum than (best, best_row): the larger value, on a tie
// the lower row. A total order, so the result does not depend on the reduction order.
template <typename A>
__device__ __forceinline__ bool beats(A value, int row, A best, int best_row) {
  if (row < 0) return false;
  if (best_row < 0 || greater(value, best)) return true;
  return !greater(best, value) && row < best_row;
}

// One thread per element (row, channel) of a [num_rows, channels] output.
__device__ __forceinline__ bool element_of_thread(int num_rows, int channels, int& row, int& channel, long long& index) {
  index = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= static_cast<long long>(num_rows) * channels) return false;
  row = static_cast<int>(index / channels);
  channel = static_cast<int>(index % channels);
  return true;
}

// out[i, c] = max over the valid k of x[table[k, i], c]; argmax[i, c] = the row chosen, the first
// offset in kernel order on ties; an empty window gives 0 and -1.
template <typename T>
__global__ void max_pool_forward(const T* __restrict__ x, const int* __restrict__ table, int num_out, int kernel_volume,
                                 int channels, T* __restrict__ out, int* __restrict__ argmax) {
  int row, channel;
  long long index;
  if (!element_of_thread(num_out, channels, row, channel, index)) return;
  int best_row = -1;
  acc_t<T> best = 0;
  for (int k = 0; k < kernel_volume; ++k) {
    const int source = table[static_cast<long long>(k) * num_out + row];
    if (source < 0) continue;
    const acc_t<T> value = to_acc(x[static_cast<long long>(source) * channels + channel]);
    if (best_row < 0 || greater(value, best)) {
      best = value;
      best_row = source;
    }
  }
  if (best_row < 0) {
    store(out + index, acc_t<T>(0));
  } else {
    out[index] = x[static_cast<long long>(best_row) * channels + channel];  // a copy: exact in every dtype
  }
  argmax[index] = best_row;
}

// grad_in[j, c] = sum of grad[i, c] over the outputs i whose maximum was row j (argmax[i, c] == j),
// gathered through the reversed table [K, num_in] (the output row each input feeds through k).
// An input and an output share at most one offset, so each contribution is counted once.
template <typename T>
__global__ void max_pool_backward(const T* __restrict__ grad, const int* __restrict__ argmax,
                                  const int* __restrict__ reverse_table, int num_in, int kernel_volume, int channels,
                                  T* __restrict__ grad_in) {
  int row, channel;
  long long index;
  if (!element_of_thread(num_in, channels, row, channel, index)) return;
  acc_t<T> sum = 0;
  for (int k = 0; k < kernel_volume; ++k) {
    const int out_row = reverse_table[static_cast<long long>(k) * num_in + row];
    if (out_row < 0) continue;
    const long long element = static_cast<long long>(out_row) * channels + channel;
    if (argmax[element] == row) sum += to_acc(grad[element]);
  }
  store(grad_in + index, sum);
}

// out[i, c] = sum over the valid k of x[table[k, i], c], divided by their number when `average`
// (0 for an empty window). Average pooling, and both directions of nearest unpooling.
template <typename T>
__global__ void sum_pool(const T* __restrict__ x, const int* __restrict__ table, int num_out, int kernel_volume,
                         int channels, int average, T* __restrict__ out) {
  int row, channel;
  long long index;
  if (!element_of_thread(num_out, channels, row, channel, index)) return;
  acc_t<T> sum = 0;
  int count = 0;
  for (int k = 0; k < kernel_volume; ++k) {
    const int source = table[static_cast<long long>(k) * num_out + row];
    if (source < 0) continue;
    sum += to_acc(x[static_cast<long long>(source) * channels + channel]);
    ++count;
  }
  store(out + index, average && count > 0 ? sum / static_cast<acc_t<T>>(count) : sum);
}

// grad_in[j, c] = sum over the pairs (k, j, i) of grad[i, c] / counts[i], through the reversed table;
// counts[i] = the number of inputs averaged into output i.
template <typename T>
__global__ void avg_pool_backward(const T* __restrict__ grad, const int* __restrict__ reverse_table,
                                  const int* __restrict__ counts, int num_in, int kernel_volume, int channels,
                                  T* __restrict__ grad_in) {
  int row, channel;
  long long index;
  if (!element_of_thread(num_in, channels, row, channel, index)) return;
  acc_t<T> sum = 0;
  for (int k = 0; k < kernel_volume; ++k) {
    const int out_row = reverse_table[static_cast<long long>(k) * num_in + row];
    if (out_row < 0) continue;
    sum += to_acc(grad[static_cast<long long>(out_row) * channels + channel]) / static_cast<acc_t<T>>(counts[out_row]);
  }
  store(grad_in + index, sum);
}

// Global pooling runs in two passes. The rows of batch b are order[start[b] : start[b + 1]]; each is
// cut into num_splits equal ranges, one block per (channel tile, split, batch). A block's threadIdx.x
// is the channel within the tile (coalesced row reads), threadIdx.y one of the row lanes striding the
// range; the lanes are combined in lane order, then the finish kernel combines the splits in order.
// The block shape must match _GLOBAL_POOL_BLOCK in cupysparse/functional/pooling.py.
constexpr int kChannelTile = 32;
constexpr int kRowLanes = 8;

struct SplitBlock {
  int batch, split, channel, begin, end;
};

__device__ __forceinline__ SplitBlock split_block(const int* start, int channels, int num_splits) {
  const int num_tiles = (channels + kChannelTile - 1) / kChannelTile;
  SplitBlock block;
  block.channel = static_cast<int>(blockIdx.x % num_tiles) * kChannelTile + threadIdx.x;
  block.split = static_cast<int>((blockIdx.x / num_tiles) % num_splits);
  block.batch = static_cast<int>(blockIdx.x / num_tiles / num_splits);
  const long long first = start[block.batch];
  const long long length = start[block.batch + 1] - first;
  block.begin = static_cast<int>(first + length * block.split / num_splits);
  block.end = static_cast<int>(first + length * (block.split + 1) / num_splits);
  return block;
}

// partial_value / partial_row [B, S, C]: the first maximum of each split (row -1 when empty).
template <typename T>
__global__ void global_max_partial(const T* __restrict__ x, const int* __restrict__ order, const int* __restrict__ start,
                                   int channels, int num_splits, acc_t<T>* __restrict__ partial_value,
                                   int* __restrict__ partial_row) {
  const SplitBlock block = split_block(start, channels, num_splits);
  const bool active = block.channel < channels;
  acc_t<T> best = 0;
  int best_row = -1;
  if (active) {
    for (int position = block.begin + threadIdx.y; position < block.end; position += kRowLanes) {
      const int row = order[position];
      const acc_t<T> value = to_acc(x[static_cast<long long>(row) * channels + block.channel]);
      if (beats(value, row, best, best_row)) {
        best = value;
        best_row = row;
      }
    }
  }
  __shared__ acc_t<T> lane_value[kRowLanes][kChannelTile];
  __shared__ int lane_row[kRowLanes][kChannelTile];
  lane_value[threadIdx.y][threadIdx.x] = best;
  lane_row[threadIdx.y][threadIdx.x] = best_row;
  __syncthreads();
  if (threadIdx.y != 0 || !active) return;
  for (int lane = 1; lane < kRowLanes; ++lane) {
    if (beats(lane_value[lane][threadIdx.x], lane_row[lane][threadIdx.x], best, best_row)) {
      best = lane_value[lane][threadIdx.x];
      best_row = lane_row[lane][threadIdx.x];
    }
  }
  const long long slot = (static_cast<long long>(block.batch) * num_splits + block.split) * channels + block.channel;
  partial_value[slot] = best;
  partial_row[slot] = best_row;
}

// out / argmax [B, C]: the first maximum over the splits; an empty batch item gives 0 and -1.
template <typename T>
__global__ void global_max_finish(const T* __restrict__ x, const acc_t<T>* __restrict__ partial_value,
                                  const int* __restrict__ partial_row, int num_batches, int num_splits, int channels,
                                  T* __restrict__ out, int* __restrict__ argmax) {
  int batch, channel;
  long long index;
  if (!element_of_thread(num_batches, channels, batch, channel, index)) return;
  acc_t<T> best = 0;
  int best_row = -1;
  for (int split = 0; split < num_splits; ++split) {
    const long long slot = (static_cast<long long>(batch) * num_splits + split) * channels + channel;
    if (beats(partial_value[slot], partial_row[slot], best, best_row)) {
      best = partial_value[slot];
      best_row = partial_row[slot];
    }
  }
  if (best_row < 0) {
    store(out + index, acc_t<T>(0));
  } else {
    out[index] = x[static_cast<long long>(best_row) * channels + channel];
  }
  argmax[index] = best_row;
}

// partial_sum [B, S, C]: the sum of each split.
template <typename T>
__global__ void global_avg_partial(const T* __restrict__ x, const int* __restrict__ order, const int* __restrict__ start,
                                   int channels, int num_splits, acc_t<T>* __restrict__ partial_sum) {
  const SplitBlock block = split_block(start, channels, num_splits);
  const bool active = block.channel < channels;
  acc_t<T> sum = 0;
  if (active) {
    for (int position = block.begin + threadIdx.y; position < block.end; position += kRowLanes) {
      sum += to_acc(x[static_cast<long long>(order[position]) * channels + block.channel]);
    }
  }
  __shared__ acc_t<T> lane_sum[kRowLanes][kChannelTile];
  lane_sum[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || !active) return;
  for (int lane = 1; lane < kRowLanes; ++lane) sum += lane_sum[lane][threadIdx.x];
  partial_sum[(static_cast<long long>(block.batch) * num_splits + block.split) * channels + block.channel] = sum;
}

// out [B, C]: the splits' sums over the batch item's row count; an empty batch item gives 0.
template <typename T>
__global__ void global_avg_finish(const acc_t<T>* __restrict__ partial_sum, const int* __restrict__ start,
                                  int num_batches, int num_splits, int channels, T* __restrict__ out) {
  int batch, channel;
  long long index;
  if (!element_of_thread(num_batches, channels, batch, channel, index)) return;
  acc_t<T> sum = 0;
  for (int split = 0; split < num_splits; ++split) {
    sum += partial_sum[(static_cast<long long>(batch) * num_splits + split) * channels + channel];
  }
  const int count = start[batch + 1] - start[batch];
  store(out + index, count > 0 ? sum / static_cast<acc_t<T>>(count) : sum);
}

// grad_in[j, c] = grad[b, c] when row j (of batch item b) was the maximum of channel c, else 0.
template <typename T>
__global__ void global_max_backward(const T* __restrict__ grad, const int* __restrict__ argmax,
                                    const int* __restrict__ batch_index, int num_rows, int num_batches, int channels,
                                    T* __restrict__ grad_in) {
  int row, channel;
  long long index;
  if (!element_of_thread(num_rows, channels, row, channel, index)) return;
  const int batch = batch_index[row];
  const long long element = static_cast<long long>(batch) * channels + channel;
  if (batch >= 0 && batch < num_batches && argmax[element] == row) {
    grad_in[index] = grad[element];
  } else {
    store(grad_in + index, acc_t<T>(0));
  }
}

// grad_in[j, c] = grad[b, c] / counts[b] for row j of batch item b.
template <typename T>
__global__ void global_avg_backward(const T* __restrict__ grad, const int* __restrict__ counts,
                                    const int* __restrict__ batch_index, int num_rows, int num_batches, int channels,
                                    T* __restrict__ grad_in) {
  int row, channel;
  long long index;
  if (!element_of_thread(num_rows, channels, row, channel, index)) return;
  const int batch = batch_index[row];
  if (batch >= 0 && batch < num_batches) {
    const long long element = static_cast<long long>(batch) * channels + channel;
    store(grad_in + index, to_acc(grad[element]) / static_cast<acc_t<T>>(counts[batch]));
  } else {
    store(grad_in + index, acc_t<T>(0));
  }
}
