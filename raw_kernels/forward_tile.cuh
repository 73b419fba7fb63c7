// The start and the end of the output-stationary forward kernels (wmma_conv_forward, mma_conv_forward,
// wgmma_conv_forward; dgrad is the same kernel): which tile of the output a block owns and that tile's
// output rows, or, for the blocks a dgrad launch has past its tiles, their part of wgrad's sum; and what
// happens to an output value before it is stored.
#pragma once
#include "wgrad_sum.cuh"

// The tile block blockIdx.x of a forward launch owns, of BLOCK_M output rows (of num_out) by BLOCK_N output
// channels (of out_channels_padded), numbered column tile fastest, so the blocks sharing a set of gathered
// rows run together: its first row `row_base` and channel `col_base`, and true. A block past the tiles (a
// dgrad launch's, none in a forward) sums its part of wgrad's partials instead (wgrad_sum.cuh), with
// THREADS floats of `scratch`, and returns false: it has nothing else to do.
template <typename T, int BLOCK_M, int BLOCK_N, int THREADS>
__device__ __forceinline__ bool forward_tile_or_wgrad_sum(int num_out, int in_channels, int in_channels_padded,
                                                          int out_channels, int out_channels_padded,
                                                          const float* __restrict__ wgrad_workspace,
                                                          T* __restrict__ grad_weight,
                                                          const int* __restrict__ wgrad_slot_starts,
                                                          int wgrad_slot_groups, float* scratch, long long& row_base,
                                                          int& col_base) {
  const int col_tiles = (out_channels_padded + BLOCK_N - 1) / BLOCK_N;
  const int tiles = (num_out + BLOCK_M - 1) / BLOCK_M * col_tiles;
  if ((int)blockIdx.x >= tiles) {
    sum_wgrad_in_dgrad<T, THREADS>(wgrad_workspace, grad_weight, wgrad_slot_starts, wgrad_slot_groups, in_channels,
                                   in_channels_padded, out_channels, out_channels_padded, blockIdx.x - tiles, scratch);
    return false;
  }
  row_base = (long long)(blockIdx.x / col_tiles) * BLOCK_M;
  col_base = (blockIdx.x % col_tiles) * BLOCK_N;
  return true;
}

// The output rows of the tile from `row_base` into `out_rows` [BLOCK_M]: row_order[row] (the rows
// reordered, e.g. by offset mask, so that a tile's rows share offsets), or the row itself when `row_order`
// is null; -1 past num_out.
template <int BLOCK_M, int THREADS>
__device__ __forceinline__ void read_tile_rows(const int* __restrict__ row_order, long long row_base, int num_out,
                                               int* out_rows) {
  for (int m = threadIdx.x; m < BLOCK_M; m += THREADS) {
    const long long row = row_base + m;
    out_rows[m] = row < num_out ? (row_order ? row_order[row] : (int)row) : -1;
  }
}

// The epilogue of a forward launch, applied to each accumulated output value before it is stored:
//   out = relu?(acc * scale[col] + shift[col] (+ residual[row, col]))
// in fp32: in inference, the batch norm after a convolution (its running statistics folded into scale and
// shift), the residual sum and the ReLU of the layer, without a pass of their own. scale and shift are fp32
// [channels], residual is laid out as the output; a null pointer leaves its term out, so a dgrad launch
// (all null, relu 0) stores the accumulator as it is. relu clamps at zero; NaN stays NaN, as in torch.relu.
template <typename T>
struct ForwardEpilogue {
  const float* __restrict__ scale;
  const float* __restrict__ shift;
  const T* __restrict__ residual;
  int relu;

  __device__ __forceinline__ float operator()(float value, long long row, int col, int channels) const {
    if (scale != nullptr) value *= scale[col];
    if (shift != nullptr) value += shift[col];
    if (residual != nullptr) value += to_float(residual[row * channels + col]);
    if (relu && value <= 0.0f) value = 0.0f;
    return value;
  }
};
