// Block-wide prefix sums, and the scan that turns per-block item counts into where each block's items
// start: the compactions of kernel_map_formats.cu and coordinate_hash.cu place their rows with it.
#pragma once

constexpr int WARP_SIZE = 32;
constexpr unsigned int ALL_LANES = 0xffffffffu;

template <typename T>
struct BlockScan {
  T before;  // sum over the threads before this one
  T total;   // sum over the block
};

// Exclusive prefix sum over the BLOCK threads of a block, in thread order; every thread must call.
// `warp_sums` is shared scratch of BLOCK / 32 entries, free again on return.
template <typename T, int BLOCK>
__device__ __forceinline__ BlockScan<T> block_exclusive_scan(T value, T* warp_sums) {
  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  T inclusive = value;
#pragma unroll
  for (int delta = 1; delta < WARP_SIZE; delta *= 2) {
    const T below = __shfl_up_sync(ALL_LANES, inclusive, delta);
    if (lane >= delta) inclusive += below;
  }
  if (lane == WARP_SIZE - 1) warp_sums[warp] = inclusive;
  __syncthreads();
  BlockScan<T> scan{inclusive - value, 0};
#pragma unroll
  for (int w = 0; w < BLOCK / WARP_SIZE; ++w) {
    if (w < warp) scan.before += warp_sums[w];
    scan.total += warp_sums[w];
  }
  __syncthreads();  // the next call writes warp_sums again
  return scan;
}

// Per-block item counts [num_rows, row_length] become, in place, where each block's items start in
// an output listing row 0's items, then row 1's, ..., each row's blocks in order. One block per
// row: a row starts after the totals of the earlier rows, which the counting kernels accumulated
// (so no single block has to scan everything). row_starts[r] = where row r starts,
// row_starts[num_rows] = the number of items.
template <typename Count, int BLOCK>
__global__ void __launch_bounds__(BLOCK)
    scan_counts_by_row(Count* __restrict__ counts, int row_length, const Count* __restrict__ row_totals, int num_rows,
                       Count* __restrict__ row_starts) {
  __shared__ Count warp_sums[BLOCK / WARP_SIZE];
  const int row = blockIdx.x;
  Count earlier = 0;
  for (int r = threadIdx.x; r < row; r += BLOCK) earlier += row_totals[r];
  const Count start = block_exclusive_scan<Count, BLOCK>(earlier, warp_sums).total;
  Count* row_counts = counts + (long long)row * row_length;
  Count next = start;
  for (int base = 0; base < row_length; base += BLOCK) {
    const int j = base + threadIdx.x;
    const BlockScan<Count> scan = block_exclusive_scan<Count, BLOCK>(j < row_length ? row_counts[j] : 0, warp_sums);
    if (j < row_length) row_counts[j] = next + scan.before;
    next += scan.total;
  }
  if (threadIdx.x == 0) {
    row_starts[row] = start;
    if (row == num_rows - 1) row_starts[num_rows] = next;
  }
}
