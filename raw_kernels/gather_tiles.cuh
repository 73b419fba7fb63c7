// Shared pieces of the gather-GEMM kernels (wmma_implicit_gemm.cu, mma_implicit_gemm.cu,
// wgmma_implicit_gemm.cu): asynchronous copies into shared memory, staging a tile of gathered rows, and
// reading a tile's pair-table entries for a batch of offsets.
#pragma once
#include "float_conversion.cuh"

constexpr int WARP_SIZE = 32;
// Shared-memory rows of 16-bit values are padded by 8 elements (16 bytes): consecutive rows start in
// different banks, and every row start stays 16-byte aligned for vector copies. A fragment's base is
// 16 rows and a multiple of 16 columns away from its buffer's start, which keeps it 32-byte aligned.
constexpr int HALF_ROW_PAD = 8;
constexpr int VECTOR = 8;  // 16-bit elements per 16-byte copy
template <typename T>
constexpr int VECTOR_ELEMENTS = 16 / (int)sizeof(T);  // elements of T per 16-byte copy
// A tile reads the pair-table entries of up to 32 offsets at once (one bit each in a mask), in at most
// 16 KB of shared memory.
constexpr int MAX_OFFSET_BATCH = 32;
constexpr int ROW_TABLE_LIMIT = 16 * 1024;

__host__ __device__ constexpr int smaller(int a, int b) { return a < b ? a : b; }

// The dynamic shared memory this block was launched with: kernels that size it by a layout check it.
__device__ __forceinline__ unsigned dynamic_shared_bytes() {
  unsigned bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(bytes));
  return bytes;
}

// Copies 16 bytes from global `src` to shared `dst`, or writes 16 zero bytes when !valid (`src` is then
// not read). On sm_80+ the copy is asynchronous (cp.async, L2 only): it lands after the wait_async_copies
// that retires its commit group. Both addresses must be 16-byte aligned.
__device__ __forceinline__ void copy_16_bytes(void* dst, const void* src, bool valid) {
#if __CUDA_ARCH__ >= 800
  const unsigned shared_dst = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
#else
  *reinterpret_cast<uint4*>(dst) = valid ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
#endif
}

// Copies 4 bytes from global `src` to shared `dst` as copy_16_bytes does (cp.async.ca: L1 too), or writes
// zeros when !valid; both addresses 4-byte aligned.
__device__ __forceinline__ void copy_4_bytes(void* dst, const void* src, bool valid = true) {
#if __CUDA_ARCH__ >= 800
  const unsigned shared_dst = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_dst), "l"(src), "r"(valid ? 4 : 0)
               : "memory");
#else
  *reinterpret_cast<unsigned*>(dst) = valid ? *reinterpret_cast<const unsigned*>(src) : 0u;
#endif
}

__device__ __forceinline__ void commit_async_copies() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most PENDING of this thread's most recent commit groups are still in flight.
template <int PENDING>
__device__ __forceinline__ void wait_async_copies() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
#endif
}

// `column` moved down `row` (>= 0) rows of `num_cols` elements: one wide multiply-add, which the compiler
// would otherwise widen into a 64-bit product of the element index.
template <typename T>
__device__ __forceinline__ const T* row_element(const T* column, int row, int num_cols) {
  const unsigned row_bytes = static_cast<unsigned>(num_cols) * sizeof(T);
  unsigned long long address;
  asm("mad.wide.u32 %0, %1, %2, %3;\n"
      : "=l"(address)
      : "r"(static_cast<unsigned>(row)), "r"(row_bytes), "l"(reinterpret_cast<unsigned long long>(column)));
  return reinterpret_cast<const T*>(address);
}

// Copies the tile [ROWS x COLS] of a row-major matrix with `num_cols` columns into shared memory
// (row stride `ld`): tile row r is matrix row `row_of(r)` (-1: zeros), tile column c is matrix column
// `col0 + c` (zero at or past `num_cols`). VECTOR_COPIES moves 16 bytes at once through copy_16_bytes
// and needs `num_cols` and `col0` to be whole vectors (VECTOR_ELEMENTS<T>) and `src` 16-byte aligned.
template <int ROWS, int COLS, int THREADS, bool VECTOR_COPIES, typename T, typename RowOf>
__device__ __forceinline__ void stage_tile(const T* __restrict__ src, int num_cols, int col0, RowOf row_of,
                                          T* __restrict__ dst, int ld) {
  if constexpr (VECTOR_COPIES) {
    constexpr int ELEMENTS = VECTOR_ELEMENTS<T>;
    static_assert(COLS % ELEMENTS == 0, "tile columns must be whole vectors");
    constexpr int VECTORS_PER_ROW = COLS / ELEMENTS;
    static_assert(THREADS % VECTORS_PER_ROW == 0, "every thread copies one column's vectors");
    constexpr int ROWS_PER_PASS = THREADS / VECTORS_PER_ROW;
    // The thread's column, the same in every row: its address and check come before the rows'.
    const int c = threadIdx.x % VECTORS_PER_ROW * ELEMENTS;
    const bool column_valid = col0 + c < num_cols;
    const T* column = src + (column_valid ? col0 + c : 0);
#pragma unroll
    for (int i = 0; i < (ROWS + ROWS_PER_PASS - 1) / ROWS_PER_PASS; ++i) {
      const int r = threadIdx.x / VECTORS_PER_ROW + i * ROWS_PER_PASS;
      if (ROWS % ROWS_PER_PASS != 0 && r >= ROWS) break;
      const int row = row_of(r);
      const bool valid = column_valid && row >= 0;
      copy_16_bytes(dst + r * ld + c, row_element(column, valid ? row : 0, num_cols), valid);
    }
  } else {
    const T zero = from_float<T>(0.0f);
    for (int e = threadIdx.x; e < ROWS * COLS; e += THREADS) {
      const int r = e / COLS, c = e % COLS;
      const int row = row_of(r);
      const int col = col0 + c;
      dst[r * ld + c] = (row >= 0 && col < num_cols) ? *row_element(src + col, row, num_cols) : zero;
    }
  }
}

// Share `share` of `shares` of offset k's pairs in the wgrad kernels' compact pair lists (CSR offsets
// `pair_offsets`): the pairs [first, last), the list cut into `shares` shares of whole STEP_PAIRS-pair steps (the
// last ones shorter or empty), and its steps.
template <int STEP_PAIRS>
struct PairShare {
  long long first, last;
  int steps;
  __device__ __forceinline__ PairShare(const long long* __restrict__ pair_offsets, int k, int share, int shares) {
    const long long begin = pair_offsets[k], end = pair_offsets[k + 1];
    const long long share_pairs = ((end - begin + shares - 1) / shares + STEP_PAIRS - 1) / STEP_PAIRS * STEP_PAIRS;
    first = begin + share * share_pairs;
    last = min(end, first + share_pairs);
    steps = first < last ? (int)((last - first + STEP_PAIRS - 1) / STEP_PAIRS) : 0;
  }
};

// This wgrad block's share: entry blockIdx.z of the map's wgrad share table (KernelMap.wgrad_shares, written by
// wgrad_share_table in kernel_map_formats.cu), share `share` of the `shares` of offset k's pairs, whose partial
// dW_k goes to workspace slot `slot`; k = -1: no share, nothing to do.
struct WgradShare {
  int k, share, shares, slot;
};
__device__ __forceinline__ WgradShare wgrad_share(const int4* __restrict__ share_table) {
  const int4 entry = share_table[blockIdx.z];
  return {entry.x, entry.y, entry.z, entry.w};
}

// The pair indices (input and output rows) of a wgrad share's steps, copied into shared memory AHEAD steps
// before the rows they name are staged, so that no thread waits on a dependent global load before its row
// copies. A pipeline staging step s's rows AHEAD steps before s is multiplied calls `copy(s + AHEAD)` in
// the same commit group; the first AHEAD steps' come from `copy_first`. Slot s % SLOTS holds step s's, and
// is refilled only after the barriers that follow every thread's staging of s (SLOTS = 2 AHEAD: the
// pipelines stage their first AHEAD steps back to back); a pair past the share is stored as -1, so
// a row needs no range check. `BYTES` of shared memory at `slots`.
template <int PAIRS, int AHEAD, int THREADS>
struct StagedPairIndices {
  static constexpr int SLOTS = 2 * AHEAD;
  static constexpr int BYTES = SLOTS * 2 * PAIRS * (int)sizeof(int);
  int* slots;
  const int* in_idx;
  const int* out_idx;
  PairShare<PAIRS> share;

  __device__ __forceinline__ void copy(int step) const {
    int* slot = slots + step % SLOTS * 2 * PAIRS;
    const long long pair0 = share.first + (long long)step * PAIRS;
    for (int e = threadIdx.x; e < 2 * PAIRS; e += THREADS) {
      const long long pair = pair0 + e % PAIRS;
      if (pair < share.last)
        copy_4_bytes(slot + e, (e < PAIRS ? in_idx : out_idx) + pair);
      else
        slot[e] = -1;
    }
  }

  // Copies the first AHEAD steps' and waits for them: a barrier, before the pipeline's first staging.
  __device__ __forceinline__ void copy_first() const {
    for (int step = 0; step < AHEAD && step < share.steps; ++step) copy(step);
    commit_async_copies();
    wait_async_copies<0>();
    __syncthreads();
  }

  // Step `step`'s input (0) or output (1) rows of pair r, -1 past the share (written so by `copy`).
  __device__ __forceinline__ int row(int step, int list, int r) const {
    return slots[step % SLOTS * 2 * PAIRS + list * PAIRS + r];
  }
};

// Runs `steps` steps through a STAGES-deep cp.async pipeline: stage(step, buffer) issues the copies of
// `step` into buffer step % STAGES, multiply(buffer) consumes a staged buffer. One commit group per step
// (empty past the last), so step s is group s and each wait leaves in flight only the STAGES - 2 steps
// staged after it; the barrier after it makes the step visible to every thread (element copies
// included) and means every warp is done with step - 1, whose buffer the next stage refills. Nothing is
// left in flight on return.
template <int STAGES, typename Stage, typename Multiply>
__device__ __forceinline__ void run_pipeline(int steps, Stage stage, Multiply multiply) {
  static_assert(STAGES >= 2, "a pipeline stages ahead");
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < steps) stage(s, s);
    commit_async_copies();
  }
  for (int step = 0; step < steps; ++step) {
    wait_async_copies<STAGES - 2>();
    __syncthreads();
    const int next = step + STAGES - 1;
    if (next < steps) stage(next, next % STAGES);
    commit_async_copies();
    multiply(step % STAGES);
  }
  wait_async_copies<0>();
}

// Reads the pair-table entries of a tile's BLOCK_M output rows (`out_rows`, -1 past the end) for offsets
// [batch_start, batch_start + batch) into `in_rows` [batch][BLOCK_M] (input row or -1), and returns the
// mask of the batch's offsets any row has, the same in every thread, so the loops over it are uniform.
// `warp_masks` holds one word per warp. Begins with a barrier, so the previous batch's readers of
// in_rows and of anything else the caller orders behind it are done.
template <int BLOCK_M, int THREADS>
__device__ __forceinline__ unsigned read_offset_batch(const int* __restrict__ pair_table, int num_out,
                                                      const int* out_rows, int batch_start, int batch, int* in_rows,
                                                      unsigned* warp_masks) {
  constexpr int WARPS = THREADS / WARP_SIZE;
  __syncthreads();
  unsigned mask = 0;
  for (int e = threadIdx.x; e < batch * BLOCK_M; e += THREADS) {
    const int j = e / BLOCK_M, m = e % BLOCK_M;
    const int out_row = out_rows[m];
    const int in_row = out_row >= 0 ? pair_table[(long long)(batch_start + j) * num_out + out_row] : -1;
    in_rows[j * BLOCK_M + m] = in_row;
    if (in_row >= 0) mask |= 1u << j;
  }
  for (int lanes = WARP_SIZE / 2; lanes > 0; lanes /= 2) mask |= __shfl_xor_sync(0xffffffffu, mask, lanes);
  if (threadIdx.x % WARP_SIZE == 0) warp_masks[threadIdx.x / WARP_SIZE] = mask;
  __syncthreads();
  unsigned offsets = 0;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) offsets |= warp_masks[w];
  return offsets;
}
