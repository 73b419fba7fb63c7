// Batch norm in training over row-major [num_rows, channels] features, with the ReLU and the residual sum
// that follow it in a network, in two passes forward and two backward (torch takes four and three):
//   forward:  y = relu?(xhat * weight + bias (+ residual)),  xhat = (x - mean) * invstd, over the batch's
//             mean and biased variance, invstd = 1 / sqrt(var + eps); the running statistics move by
//             `momentum` towards the mean and the unbiased variance;
//   backward: g = dy where y > 0 (dy itself without the ReLU), the residual's gradient;
//             dx = weight * invstd * (g - sum(g) / N - xhat * sum(g * xhat) / N),
//             dweight = sum(g * xhat), dbias = sum(g);
//   and the forward's y again from x and the statistics it saved, for a backward that did not keep y.
// Sums are fp32, per block in shared memory, then added up across blocks in a workspace, all in a fixed order
// (`reduce_block_sums`), so every run gives the same bits (atomic adds, in whatever order the blocks came, did
// not). The forward sums x - x[0]: a shift by each channel's first value keeps the variance from cancelling
// when the mean is large against the spread.
//
// A thread owns VECTOR consecutive channels (16 bytes where the channels and addresses allow it) of
// rows that step by the grid's rows; consecutive threads take consecutive groups, so a warp reads whole
// rows. A block of BLOCK threads holds BLOCK / groups lanes of rows (at most BLOCK groups); the threads
// past its last whole lane have no rows.
#include "float_conversion.cuh"

constexpr int BLOCK = 256;

template <typename T, int VECTOR>
struct alignas(sizeof(T) * VECTOR) Values {
  T value[VECTOR];
};

// Where a thread's rows start and how far they step: its lane's row of its block, the grid's rows.
struct RowWalk {
  long long first, step;
};

__device__ __forceinline__ RowWalk row_walk(int groups) {
  const int lanes = BLOCK / groups, lane = threadIdx.x / groups;
  const long long step = (long long)gridDim.x * lanes;
  return {lane < lanes ? (long long)blockIdx.x * lanes + lane : 1ll << 62, step};
}

// The sums of a pass, added up in a fixed order in two levels: a block's threads' sums `first` and `second`
// [VECTOR] (of each thread's channel group) lane by lane into its row of `partials` (2 x channels wide); the
// last block of each GROUP of blocks to take its group's ticket adds their rows in block order into the group's
// row (after the blocks'); the last group to take tickets[0] adds the groups' rows in order into sums[channel]
// and sums[channels + channel]. Each last block sets its ticket back to zero for the next launch. One block
// adding up every block's row read them one after another (a thousand on an H100) and took 0.1-0.3 ms.
constexpr int GROUP = 32;

// The sum of `count` rows of `partials` from `first`, in order, at column `column` of rows `width` wide; loads
// UNROLL rows ahead of the adds.
template <int UNROLL>
__device__ __forceinline__ float sum_rows(const float* partials, int first, int count, int width, int column) {
  float total = 0.0f;
  for (int start = 0; start < count; start += UNROLL) {
    float values[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k)
      values[k] = start + k < count ? __ldcg(partials + (long long)(first + start + k) * width + column) : 0.0f;
#pragma unroll
    for (int k = 0; k < UNROLL; ++k) total += values[k];
  }
  return total;
}

// Whether this block took the last of `count` turns of `ticket` (then setting it back to zero), after its writes
// reached every block; its threads' later reads see every other taker's writes.
__device__ __forceinline__ bool took_last_turn(unsigned int* ticket, unsigned int count) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(ticket, 1u) == count - 1;
    if (last) *ticket = 0u;
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

template <int VECTOR>
__device__ __forceinline__ void reduce_block_sums(const float* first, const float* second, int groups, int channels,
                                                  float* partials, unsigned int* tickets, float* __restrict__ sums) {
  __shared__ float partial[2][BLOCK][VECTOR];
#pragma unroll
  for (int j = 0; j < VECTOR; ++j) {
    partial[0][threadIdx.x][j] = first[j];
    partial[1][threadIdx.x][j] = second[j];
  }
  __syncthreads();
  // Each of the 2 x channels sums is one thread's walk over the block's lanes, the threads side by side.
  const int lanes = BLOCK / groups, width = 2 * channels;
  for (int index = threadIdx.x; index < width; index += BLOCK) {
    const int which = index / channels, channel = index % channels;
    const int owner = channel / VECTOR, j = channel % VECTOR;
    float total = 0.0f;
    for (int lane = 0; lane < lanes; ++lane) total += partial[which][lane * groups + owner][j];
    partials[(long long)blockIdx.x * width + index] = total;
  }
  const int blocks = gridDim.x, group = blockIdx.x / GROUP, group_count = (blocks + GROUP - 1) / GROUP;
  const int group_start = group * GROUP, group_blocks = min(GROUP, blocks - group_start);
  if (!took_last_turn(tickets + 1 + group, group_blocks)) return;
  for (int index = threadIdx.x; index < width; index += BLOCK)
    partials[(long long)(blocks + group) * width + index] = sum_rows<GROUP>(partials, group_start, group_blocks,
                                                                             width, index);
  if (!took_last_turn(tickets, group_count)) return;
  for (int index = threadIdx.x; index < width; index += BLOCK)
    sums[index] = sum_rows<8>(partials, blocks, group_count, width, index);
}

// Rows whose loads the statistics pass has under way at once: with one, its threads kept too few reads in flight
// (400K x 96 fp16 rows: 36 against 30 us with four, on an H200). The sums add the rows in the same order.
constexpr int STATISTICS_ROWS = 4;

template <typename T, int VECTOR>
__device__ __forceinline__ void add_centred(const Values<T, VECTOR>& v, const Values<T, VECTOR>& origin, float* sum,
                                            float* square) {
#pragma unroll
  for (int j = 0; j < VECTOR; ++j) {
    const float centred = to_float(v.value[j]) - to_float(origin.value[j]);
    sum[j] += centred;
    square[j] = fmaf(centred, centred, square[j]);
  }
}

// sums[c] = sum of (x - x[0]), sums[C + c] = sum of (x - x[0])^2 (see `reduce_block_sums`).
template <typename T, int VECTOR>
__global__ void __launch_bounds__(BLOCK) batch_norm_statistics(const T* __restrict__ x, int num_rows, int channels,
                                                              float* __restrict__ sums, float* partials,
                                                              unsigned int* tickets) {
  const int groups = channels / VECTOR, group = threadIdx.x % groups;
  const RowWalk rows = row_walk(groups);
  const T* column = x + group * VECTOR;
  const Values<T, VECTOR> origin = *reinterpret_cast<const Values<T, VECTOR>*>(column);
  float sum[VECTOR] = {}, square[VECTOR] = {};
  long long row = rows.first;
  for (; row + (STATISTICS_ROWS - 1) * rows.step < num_rows; row += STATISTICS_ROWS * rows.step) {
    Values<T, VECTOR> v[STATISTICS_ROWS];
#pragma unroll
    for (int k = 0; k < STATISTICS_ROWS; ++k)
      v[k] = *reinterpret_cast<const Values<T, VECTOR>*>(column + (row + k * rows.step) * channels);
#pragma unroll
    for (int k = 0; k < STATISTICS_ROWS; ++k) add_centred(v[k], origin, sum, square);
  }
  for (; row < num_rows; row += rows.step)
    add_centred(*reinterpret_cast<const Values<T, VECTOR>*>(column + row * channels), origin, sum, square);
  reduce_block_sums<VECTOR>(sum, square, groups, channels, partials, tickets, sums);
}

// A channel's scale = invstd * weight and shift = bias - mean * scale. The forward and the recomputation from the
// saved statistics share it and `normalised`, so they give the same bits.
template <typename P>
__device__ __forceinline__ void affine(const P* __restrict__ weight, const P* __restrict__ bias, int c, float mean,
                                       float invstd, float& scale, float& shift) {
  scale = invstd * (weight != nullptr ? to_float(weight[c]) : 1.0f);
  shift = fmaf(-mean, scale, bias != nullptr ? to_float(bias[c]) : 0.0f);
}

// relu?(x * scale + shift (+ residual)) of one element, as the forward stores it and a recomputation again.
__device__ __forceinline__ float normalised(float x, float scale, float shift, bool with_residual, float residual,
                                            int relu) {
  float value = fmaf(x, scale, shift);
  if (with_residual) value += residual;
  if (relu && value <= 0.0f) value = 0.0f;  // NaN stays NaN, as in torch.relu
  return value;
}

// y = relu?(x * scale + shift (+ residual)) over a thread's rows.
template <typename T, int VECTOR>
__device__ __forceinline__ void normalise_rows(const T* __restrict__ x, const T* __restrict__ residual,
                                               const float* scale, const float* shift, int relu, int num_rows,
                                               int channels, int group, long long first_row, long long step,
                                               T* __restrict__ y) {
  for (long long row = first_row; row < num_rows; row += step) {
    const long long offset = row * channels + group * VECTOR;
    const Values<T, VECTOR> v = *reinterpret_cast<const Values<T, VECTOR>*>(x + offset);
    Values<T, VECTOR> added, out;
    if (residual != nullptr) added = *reinterpret_cast<const Values<T, VECTOR>*>(residual + offset);
#pragma unroll
    for (int j = 0; j < VECTOR; ++j) {
      const float sum = residual != nullptr ? to_float(added.value[j]) : 0.0f;
      out.value[j] =
          from_float<T>(normalised(to_float(v.value[j]), scale[j], shift[j], residual != nullptr, sum, relu));
    }
    *reinterpret_cast<Values<T, VECTOR>*>(y + offset) = out;
  }
}

// y = relu?(xhat * weight + bias (+ residual)). The threads of the first rows also write the batch's mean
// and invstd (fp32, for the backward) and move the running statistics.
template <typename T, typename P, int VECTOR>
__global__ void __launch_bounds__(BLOCK)
    batch_norm_normalise(const T* __restrict__ x, const T* __restrict__ residual, const P* __restrict__ weight,
                         const P* __restrict__ bias, const float* __restrict__ sums, P* __restrict__ running_mean,
                         P* __restrict__ running_var, long long* __restrict__ batches_tracked, float momentum,
                         float eps, int relu, int num_rows, int channels, float* __restrict__ saved_mean,
                         float* __restrict__ saved_invstd, T* __restrict__ y) {
  // The module's count of batches: one increment here, where a framework would launch one of its own.
  if (batches_tracked != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *batches_tracked += 1;
  const int groups = channels / VECTOR, group = threadIdx.x % groups;
  const RowWalk rows = row_walk(groups);
  const long long first_row = rows.first;
  if (first_row >= num_rows) return;
  const Values<T, VECTOR> origin = *reinterpret_cast<const Values<T, VECTOR>*>(x + group * VECTOR);
  float scale[VECTOR], shift[VECTOR];
#pragma unroll
  for (int j = 0; j < VECTOR; ++j) {
    const int c = group * VECTOR + j;
    const float centred_mean = sums[c] / num_rows;
    const float var = fmaxf(sums[channels + c] / num_rows - centred_mean * centred_mean, 0.0f);
    const float mean = centred_mean + to_float(origin.value[j]), invstd = rsqrtf(var + eps);
    affine(weight, bias, c, mean, invstd, scale[j], shift[j]);
    if (first_row == 0) {
      saved_mean[c] = mean;
      saved_invstd[c] = invstd;
      const float unbiased = num_rows > 1 ? var * num_rows / (num_rows - 1) : var;
      running_mean[c] = from_float<P>((1.0f - momentum) * to_float(running_mean[c]) + momentum * mean);
      running_var[c] = from_float<P>((1.0f - momentum) * to_float(running_var[c]) + momentum * unbiased);
    }
  }
  normalise_rows<T, VECTOR>(x, residual, scale, shift, relu, num_rows, channels, group, first_row, rows.step, y);
}

// The most batch norms one recomputation runs through: a residual block's output, the output of the block before
// it (its residual), and that block's shortcut norm (the residual of that).
constexpr int CHAIN = 3;

// Outputs again, from the norms' inputs and the mean and invstd their forwards saved (the running statistics left
// alone), for a network's backward that did not keep them: norm `links - 1`'s output over `residual` (null: none),
// which is norm `links - 2`'s residual, and so on to norm 0's, written to y. Bit i of `relu_bits`: norm i's ReLU.
// Each output is rounded to T before the next norm adds it, as the forward stored it: y has the forward's bits.
template <typename T, typename P, int VECTOR>
__global__ void __launch_bounds__(BLOCK)
    batch_norm_renormalise(const T* x0, const T* x1, const T* x2, const P* weight0, const P* weight1,
                           const P* weight2, const P* bias0, const P* bias1, const P* bias2, const float* mean0,
                           const float* mean1, const float* mean2, const float* invstd0, const float* invstd1,
                           const float* invstd2, int links, int relu_bits, const T* __restrict__ residual,
                           int num_rows, int channels, T* __restrict__ y) {
  const T* const x[CHAIN] = {x0, x1, x2};
  const P* const weight[CHAIN] = {weight0, weight1, weight2};
  const P* const bias[CHAIN] = {bias0, bias1, bias2};
  const float* const mean[CHAIN] = {mean0, mean1, mean2};
  const float* const invstd[CHAIN] = {invstd0, invstd1, invstd2};
  const int groups = channels / VECTOR, group = threadIdx.x % groups;
  const RowWalk rows = row_walk(groups);
  if (rows.first >= num_rows) return;
  float scale[CHAIN][VECTOR], shift[CHAIN][VECTOR];
#pragma unroll
  for (int link = 0; link < CHAIN; ++link) {
    if (link >= links) break;
#pragma unroll
    for (int j = 0; j < VECTOR; ++j) {
      const int c = group * VECTOR + j;
      affine(weight[link], bias[link], c, mean[link][c], invstd[link][c], scale[link][j], shift[link][j]);
    }
  }
  for (long long row = rows.first; row < num_rows; row += rows.step) {
    const long long offset = row * channels + group * VECTOR;
    Values<T, VECTOR> carried;  // the deeper norm's output: the next one's residual
    bool with_residual = residual != nullptr;
    if (with_residual) carried = *reinterpret_cast<const Values<T, VECTOR>*>(residual + offset);
#pragma unroll
    for (int link = CHAIN - 1; link >= 0; --link) {
      if (link >= links) continue;
      const Values<T, VECTOR> v = *reinterpret_cast<const Values<T, VECTOR>*>(x[link] + offset);
#pragma unroll
      for (int j = 0; j < VECTOR; ++j) {
        const float sum = with_residual ? to_float(carried.value[j]) : 0.0f;
        carried.value[j] = from_float<T>(normalised(to_float(v.value[j]), scale[link][j], shift[link][j],
                                                    with_residual, sum, (relu_bits >> link) & 1));
      }
      with_residual = true;
    }
    *reinterpret_cast<Values<T, VECTOR>*>(y + offset) = carried;
  }
}

// sums[c] = sum of g, sums[C + c] = sum of g * (x - mean) (see `reduce_block_sums`); with the ReLU, g is written
// to `g_out` (the residual's gradient, and what the input gradient reads), without it g is grad_y.
template <typename T, int VECTOR>
__global__ void __launch_bounds__(BLOCK)
    batch_norm_gradient_sums(const T* __restrict__ grad_y, const T* __restrict__ x, const T* __restrict__ y,
                             const float* __restrict__ saved_mean, int relu, int num_rows, int channels,
                             float* __restrict__ sums, T* __restrict__ g_out, float* partials,
                             unsigned int* tickets) {
  const int groups = channels / VECTOR, group = threadIdx.x % groups;
  const RowWalk rows = row_walk(groups);
  float mean[VECTOR], sum[VECTOR] = {}, dot[VECTOR] = {};
#pragma unroll
  for (int j = 0; j < VECTOR; ++j) mean[j] = saved_mean[group * VECTOR + j];
  for (long long row = rows.first; row < num_rows; row += rows.step) {
    const long long offset = row * channels + group * VECTOR;
    const Values<T, VECTOR> dy = *reinterpret_cast<const Values<T, VECTOR>*>(grad_y + offset);
    const Values<T, VECTOR> v = *reinterpret_cast<const Values<T, VECTOR>*>(x + offset);
    Values<T, VECTOR> out, masked;
    if (relu) out = *reinterpret_cast<const Values<T, VECTOR>*>(y + offset);
#pragma unroll
    for (int j = 0; j < VECTOR; ++j) {
      const float g = relu && !(to_float(out.value[j]) > 0.0f) ? 0.0f : to_float(dy.value[j]);
      masked.value[j] = relu && !(to_float(out.value[j]) > 0.0f) ? from_float<T>(0.0f) : dy.value[j];
      sum[j] += g;
      dot[j] = fmaf(g, to_float(v.value[j]) - mean[j], dot[j]);
    }
    if (relu) *reinterpret_cast<Values<T, VECTOR>*>(g_out + offset) = masked;
  }
  reduce_block_sums<VECTOR>(sum, dot, groups, channels, partials, tickets, sums);
}

// dx from g (batch_norm_gradient_sums), in place where g is grad_x (each element read before it is written, so
// neither is restrict). The threads of the first rows also write dweight and dbias (where not null).
template <typename T, typename P, int VECTOR>
__global__ void __launch_bounds__(BLOCK)
    batch_norm_input_gradient(const T* g, const T* __restrict__ x, const P* __restrict__ weight,
                              const float* __restrict__ saved_mean, const float* __restrict__ saved_invstd,
                              const float* __restrict__ sums, int num_rows, int channels, T* grad_x,
                              P* __restrict__ grad_weight, P* __restrict__ grad_bias) {
  const int groups = channels / VECTOR, group = threadIdx.x % groups;
  const RowWalk rows = row_walk(groups);
  const long long first_row = rows.first;
  if (first_row >= num_rows) return;
  float mean[VECTOR], scale[VECTOR], mean_g[VECTOR], slope[VECTOR];
#pragma unroll
  for (int j = 0; j < VECTOR; ++j) {
    const int c = group * VECTOR + j;
    const float invstd = saved_invstd[c];
    mean[j] = saved_mean[c];
    scale[j] = invstd * (weight != nullptr ? to_float(weight[c]) : 1.0f);
    mean_g[j] = sums[c] / num_rows;
    slope[j] = sums[channels + c] / num_rows * invstd * invstd;  // mean of g * xhat, times invstd
    if (first_row == 0) {
      if (grad_weight != nullptr) grad_weight[c] = from_float<P>(sums[channels + c] * invstd);
      if (grad_bias != nullptr) grad_bias[c] = from_float<P>(sums[c]);
    }
  }
  for (long long row = first_row; row < num_rows; row += rows.step) {
    const long long offset = row * channels + group * VECTOR;
    const Values<T, VECTOR> gradient = *reinterpret_cast<const Values<T, VECTOR>*>(g + offset);
    const Values<T, VECTOR> v = *reinterpret_cast<const Values<T, VECTOR>*>(x + offset);
    Values<T, VECTOR> dx;
#pragma unroll
    for (int j = 0; j < VECTOR; ++j) {
      const float centred = to_float(v.value[j]) - mean[j];
      dx.value[j] = from_float<T>(scale[j] * (to_float(gradient.value[j]) - mean_g[j] - centred * slope[j]));
    }
    *reinterpret_cast<Values<T, VECTOR>*>(grad_x + offset) = dx;
  }
}
