// Implicit GEMM on tensor cores through nvcuda::wmma: 16x16x16 fragments of fp16 or bf16 inputs,
// fp32 accumulation, operands staged in shared memory.
//
// Forward (and dgrad, which is the forward over the reversed pair table with the transposed weight):
// output-stationary, each block owns BLOCK_M output rows x BLOCK_N output channels and writes every
// element of it once (no atomics, deterministic). Weight gradient: split-K over the output rows, fp32
// partials into a workspace that the host sums.
//
// Weights come zero-padded to multiples of 16 in both channel dimensions, so a 16x16 weight or
// workspace fragment is either wholly inside the padded extent or wholly outside it. Features and
// gradients are not padded: their loads check the channel bound.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

namespace wmma = nvcuda::wmma;

constexpr int FRAGMENT = 16;
constexpr int WARP_SIZE = 32;
// Every warp computes a WARP_TILE x WARP_TILE sub-tile of its block's tile: 2 x 2 fragments.
constexpr int WARP_TILE = 32;
constexpr int WARP_FRAGMENTS = WARP_TILE / FRAGMENT;
// Shared-memory rows of 16-bit values are padded by 8 elements (16 bytes): consecutive rows start in
// different banks, and every row start stays 16-byte aligned for vector stores. A fragment's base is
// 16 rows and a multiple of 16 columns away from the buffer start, which keeps it 32-byte aligned.
constexpr int HALF_ROW_PAD = 8;
constexpr int FLOAT_ROW_PAD = 4;
constexpr int VECTOR = 8;  // 16-bit elements per 16-byte load
// Output rows the weight gradient consumes per shared-memory stage.
constexpr int WGRAD_ROWS = 32;

using Fragment = wmma::fragment<wmma::accumulator, FRAGMENT, FRAGMENT, FRAGMENT, float>;

template <typename T>
__device__ __forceinline__ T from_float(float value);

template <>
__device__ __forceinline__ __half from_float<__half>(float value) {
  return __float2half_rn(value);
}

template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) {
  return __float2bfloat16_rn(value);
}

// Copies the tile [ROWS x COLS] of a row-major matrix with `num_cols` columns into shared memory
// (row stride `ld`): tile row r is matrix row `row_of(r)` (-1: zeros), tile column c is matrix column
// `col0 + c` (zero at or past `num_cols`). VECTOR_LOADS moves 8 elements at once and needs `num_cols`
// and `col0` to be multiples of 8 and `src` 16-byte aligned.
template <int ROWS, int COLS, int THREADS, bool VECTOR_LOADS, typename T, typename RowOf>
__device__ __forceinline__ void stage_tile(const T* __restrict__ src, int num_cols, int col0, RowOf row_of,
                                          T* __restrict__ dst, int ld) {
  if constexpr (VECTOR_LOADS) {
    static_assert(COLS % VECTOR == 0, "tile columns must be whole vectors");
    constexpr int VECTORS_PER_ROW = COLS / VECTOR;
    for (int v = threadIdx.x; v < ROWS * VECTORS_PER_ROW; v += THREADS) {
      const int r = v / VECTORS_PER_ROW, c = (v % VECTORS_PER_ROW) * VECTOR;
      const long long row = row_of(r);
      const int col = col0 + c;
      uint4 value = make_uint4(0, 0, 0, 0);
      if (row >= 0 && col < num_cols) value = *reinterpret_cast<const uint4*>(src + row * num_cols + col);
      *reinterpret_cast<uint4*>(dst + r * ld + c) = value;
    }
  } else {
    const T zero = from_float<T>(0.0f);
    for (int e = threadIdx.x; e < ROWS * COLS; e += THREADS) {
      const int r = e / COLS, c = e % COLS;
      const long long row = row_of(r);
      const int col = col0 + c;
      dst[r * ld + c] = (row >= 0 && col < num_cols) ? src[row * num_cols + col] : zero;
    }
  }
}

// How many of a warp's WARP_FRAGMENTS fragments along one dimension start inside `extent`
// (a multiple of 16); the rest multiply only zeros and are skipped, uniformly across the warp.
__device__ __forceinline__ int fragments_inside(int extent, int warp_start) {
  return max(0, min(WARP_FRAGMENTS, (extent - warp_start) / FRAGMENT));
}

// out[i] = sum_k W_k^T x[pair_table[k, i]] for the BLOCK_M rows and BLOCK_N channels of one tile.
// Tiles are numbered column tile fastest, so the blocks sharing a set of gathered rows run together.
// `row_order` (or nullptr for the identity) permutes the output rows, e.g. by offset mask, so that a
// tile's rows share offsets and more offsets are skipped for the whole tile.
// x [num_in, in_channels]; weight [kernel_volume, in_channels_padded, out_channels_padded];
// out [num_out, out_channels]. in_channels_padded is a multiple of BLOCK_K.
template <typename T, int BLOCK_M, int BLOCK_N, int BLOCK_K, bool VECTOR_LOADS>
__global__ void __launch_bounds__((BLOCK_M / WARP_TILE) * (BLOCK_N / WARP_TILE) * WARP_SIZE)
    wmma_conv_forward(const T* __restrict__ x, const int* __restrict__ pair_table, const int* __restrict__ row_order,
                      const T* __restrict__ weight, T* __restrict__ out, int num_out, int kernel_volume,
                      int in_channels, int in_channels_padded, int out_channels, int out_channels_padded) {
  static_assert(BLOCK_M % WARP_TILE == 0 && BLOCK_N % WARP_TILE == 0, "tiles are made of whole warp tiles");
  static_assert(BLOCK_K % FRAGMENT == 0, "BLOCK_K is a multiple of the fragment size");
  constexpr int WARPS_N = BLOCK_N / WARP_TILE;
  constexpr int THREADS = (BLOCK_M / WARP_TILE) * WARPS_N * WARP_SIZE;
  constexpr int LDA = BLOCK_K + HALF_ROW_PAD;
  constexpr int LDB = BLOCK_N + HALF_ROW_PAD;
  constexpr int LDC = BLOCK_N + FLOAT_ROW_PAD;
  constexpr int A_BYTES = BLOCK_M * LDA * (int)sizeof(T);
  constexpr int B_BYTES = BLOCK_K * LDB * (int)sizeof(T);
  constexpr int C_BYTES = BLOCK_M * LDC * (int)sizeof(float);
  // The fp32 result tile reuses the operand buffers once the main loop is over.
  constexpr int SHARED_BYTES = A_BYTES + B_BYTES > C_BYTES ? A_BYTES + B_BYTES : C_BYTES;
  static_assert(A_BYTES % 32 == 0, "the weight tile must start 32-byte aligned");

  __shared__ __align__(128) unsigned char shared[SHARED_BYTES];
  __shared__ int out_rows[BLOCK_M];
  __shared__ int in_rows[BLOCK_M];
  T* a_tile = reinterpret_cast<T*>(shared);
  T* b_tile = reinterpret_cast<T*>(shared + A_BYTES);
  float* c_tile = reinterpret_cast<float*>(shared);

  const int col_tiles = (out_channels_padded + BLOCK_N - 1) / BLOCK_N;
  const long long row_base = (long long)(blockIdx.x / col_tiles) * BLOCK_M;
  const int col_base = (blockIdx.x % col_tiles) * BLOCK_N;
  const int warp = threadIdx.x / WARP_SIZE;
  const int warp_row = (warp / WARPS_N) * WARP_TILE;
  const int warp_col = (warp % WARPS_N) * WARP_TILE;
  const int active_col_fragments = fragments_inside(out_channels_padded, col_base + warp_col);

  for (int m = threadIdx.x; m < BLOCK_M; m += THREADS) {
    const long long row = row_base + m;
    out_rows[m] = row < num_out ? (row_order ? row_order[row] : (int)row) : -1;
  }
  __syncthreads();

  Fragment acc[WARP_FRAGMENTS][WARP_FRAGMENTS];
#pragma unroll
  for (int i = 0; i < WARP_FRAGMENTS; ++i)
#pragma unroll
    for (int j = 0; j < WARP_FRAGMENTS; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  const auto gathered_row = [&](int m) -> long long { return in_rows[m]; };
  const auto weight_row = [](int r) -> long long { return r; };
  for (int k = 0; k < kernel_volume; ++k) {
    // Each thread rewrites only the entries it wrote for the previous offset, and every read of
    // them happened before the previous offset's last barrier.
    int has_pair = 0;
    for (int m = threadIdx.x; m < BLOCK_M; m += THREADS) {
      const int out_row = out_rows[m];
      const int in_row = out_row >= 0 ? pair_table[(long long)k * num_out + out_row] : -1;
      in_rows[m] = in_row;
      has_pair |= in_row >= 0;
    }
    if (!__syncthreads_or(has_pair)) continue;  // the same answer in every thread: uniform

    const T* weight_k = weight + (long long)k * in_channels_padded * out_channels_padded;
    for (int c0 = 0; c0 < in_channels_padded; c0 += BLOCK_K) {
      stage_tile<BLOCK_M, BLOCK_K, THREADS, VECTOR_LOADS>(x, in_channels, c0, gathered_row, a_tile, LDA);
      stage_tile<BLOCK_K, BLOCK_N, THREADS, true>(weight_k + (long long)c0 * out_channels_padded,
                                                  out_channels_padded, col_base, weight_row, b_tile, LDB);
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < BLOCK_K; kk += FRAGMENT) {
        wmma::fragment<wmma::matrix_a, FRAGMENT, FRAGMENT, FRAGMENT, T, wmma::row_major> a[WARP_FRAGMENTS];
#pragma unroll
        for (int i = 0; i < WARP_FRAGMENTS; ++i)
          wmma::load_matrix_sync(a[i], a_tile + (warp_row + i * FRAGMENT) * LDA + kk, LDA);
#pragma unroll
        for (int j = 0; j < WARP_FRAGMENTS; ++j) {
          if (j >= active_col_fragments) continue;
          wmma::fragment<wmma::matrix_b, FRAGMENT, FRAGMENT, FRAGMENT, T, wmma::row_major> b;
          wmma::load_matrix_sync(b, b_tile + kk * LDB + warp_col + j * FRAGMENT, LDB);
#pragma unroll
          for (int i = 0; i < WARP_FRAGMENTS; ++i) wmma::mma_sync(acc[i][j], a[i], b, acc[i][j]);
        }
      }
      __syncthreads();
    }
  }

  // The main loop ended on a barrier that followed every read of the operand tiles.
#pragma unroll
  for (int i = 0; i < WARP_FRAGMENTS; ++i)
#pragma unroll
    for (int j = 0; j < WARP_FRAGMENTS; ++j)
      wmma::store_matrix_sync(c_tile + (warp_row + i * FRAGMENT) * LDC + warp_col + j * FRAGMENT, acc[i][j], LDC,
                              wmma::mem_row_major);
  __syncthreads();
  for (int e = threadIdx.x; e < BLOCK_M * BLOCK_N; e += THREADS) {
    const int m = e / BLOCK_N, n = e % BLOCK_N;
    const int out_row = out_rows[m], col = col_base + n;
    if (out_row >= 0 && col < out_channels)
      out[(long long)out_row * out_channels + col] = from_float<T>(c_tile[m * LDC + n]);
  }
}

// Weight gradient, split-K: dW_k = sum_i x[pair_table[k, i]]^T dy[i]. Block (x, y, z) computes the
// TILE_M x TILE_N tile (blockIdx.x, blockIdx.y) of dW_k, k = z / split_k, over the output rows
// [s * rows_per_split, (s + 1) * rows_per_split), s = z % split_k, and writes it unreduced to
// workspace [split_k, kernel_volume, in_channels_padded, out_channels_padded] (fp32). Every block
// writes its whole tile (zeros where it had no pair), so the workspace needs no initialisation.
// x [num_in, in_channels]; dy [num_out, out_channels]; rows_per_split a multiple of WGRAD_ROWS.
template <typename T, int TILE_M, int TILE_N, bool VECTOR_LOADS>
__global__ void __launch_bounds__((TILE_M / WARP_TILE) * (TILE_N / WARP_TILE) * WARP_SIZE)
    wmma_conv_wgrad(const T* __restrict__ x, const T* __restrict__ dy, const int* __restrict__ pair_table,
                    int num_out, int kernel_volume, int in_channels, int in_channels_padded, int out_channels,
                    int out_channels_padded, int rows_per_split, int split_k, float* __restrict__ workspace) {
  static_assert(TILE_M % WARP_TILE == 0 && TILE_N % WARP_TILE == 0, "tiles are made of whole warp tiles");
  constexpr int WARPS_N = TILE_N / WARP_TILE;
  constexpr int THREADS = (TILE_M / WARP_TILE) * WARPS_N * WARP_SIZE;
  constexpr int LDX = TILE_M + HALF_ROW_PAD;
  constexpr int LDY = TILE_N + HALF_ROW_PAD;
  constexpr int X_BYTES = WGRAD_ROWS * LDX * (int)sizeof(T);
  static_assert(X_BYTES % 32 == 0, "the dy tile must start 32-byte aligned");

  // x rows [WGRAD_ROWS x TILE_M], read as the col-major x^T; dy rows [WGRAD_ROWS x TILE_N].
  __shared__ __align__(128) unsigned char shared[X_BYTES + WGRAD_ROWS * LDY * sizeof(T)];
  __shared__ int in_rows[WGRAD_ROWS];
  T* x_tile = reinterpret_cast<T*>(shared);
  T* dy_tile = reinterpret_cast<T*>(shared + X_BYTES);

  const int k = blockIdx.z / split_k, split = blockIdx.z % split_k;
  const int row_base = blockIdx.x * TILE_M, col_base = blockIdx.y * TILE_N;
  const int warp = threadIdx.x / WARP_SIZE;
  const int warp_row = (warp / WARPS_N) * WARP_TILE;
  const int warp_col = (warp % WARPS_N) * WARP_TILE;
  const int active_row_fragments = fragments_inside(in_channels_padded, row_base + warp_row);
  const int active_col_fragments = fragments_inside(out_channels_padded, col_base + warp_col);

  Fragment acc[WARP_FRAGMENTS][WARP_FRAGMENTS];
#pragma unroll
  for (int i = 0; i < WARP_FRAGMENTS; ++i)
#pragma unroll
    for (int j = 0; j < WARP_FRAGMENTS; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  const long long first = (long long)split * rows_per_split;
  const long long end = min((long long)num_out, first + rows_per_split);
  const int* pairs_k = pair_table + (long long)k * num_out;
  for (long long chunk = first; chunk < end; chunk += WGRAD_ROWS) {
    int has_pair = 0;
    for (int r = threadIdx.x; r < WGRAD_ROWS; r += THREADS) {
      const int in_row = chunk + r < end ? pairs_k[chunk + r] : -1;
      in_rows[r] = in_row;
      has_pair |= in_row >= 0;
    }
    if (!__syncthreads_or(has_pair)) continue;  // uniform

    const auto gathered_row = [&](int r) -> long long { return in_rows[r]; };
    // dy rows without a pair stay zero: they would only meet zero x rows, but may hold inf/NaN.
    const auto paired_row = [&](int r) -> long long { return in_rows[r] >= 0 ? chunk + r : -1; };
    stage_tile<WGRAD_ROWS, TILE_M, THREADS, VECTOR_LOADS>(x, in_channels, row_base, gathered_row, x_tile, LDX);
    stage_tile<WGRAD_ROWS, TILE_N, THREADS, VECTOR_LOADS>(dy, out_channels, col_base, paired_row, dy_tile, LDY);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < WGRAD_ROWS; kk += FRAGMENT) {
      wmma::fragment<wmma::matrix_a, FRAGMENT, FRAGMENT, FRAGMENT, T, wmma::col_major> a[WARP_FRAGMENTS];
#pragma unroll
      for (int i = 0; i < WARP_FRAGMENTS; ++i)
        if (i < active_row_fragments) wmma::load_matrix_sync(a[i], x_tile + kk * LDX + warp_row + i * FRAGMENT, LDX);
#pragma unroll
      for (int j = 0; j < WARP_FRAGMENTS; ++j) {
        if (j >= active_col_fragments) continue;
        wmma::fragment<wmma::matrix_b, FRAGMENT, FRAGMENT, FRAGMENT, T, wmma::row_major> b;
        wmma::load_matrix_sync(b, dy_tile + kk * LDY + warp_col + j * FRAGMENT, LDY);
#pragma unroll
        for (int i = 0; i < WARP_FRAGMENTS; ++i)
          if (i < active_row_fragments) wmma::mma_sync(acc[i][j], a[i], b, acc[i][j]);
      }
    }
    __syncthreads();
  }

  // Fragments are whole inside the padded extents (multiples of 16) or skipped: no partial stores.
  float* partial = workspace + ((long long)split * kernel_volume + k) * in_channels_padded * out_channels_padded;
#pragma unroll
  for (int i = 0; i < WARP_FRAGMENTS; ++i)
#pragma unroll
    for (int j = 0; j < WARP_FRAGMENTS; ++j) {
      if (i >= active_row_fragments || j >= active_col_fragments) continue;
      const long long row = row_base + warp_row + i * FRAGMENT, col = col_base + warp_col + j * FRAGMENT;
      wmma::store_matrix_sync(partial + row * out_channels_padded + col, acc[i][j], out_channels_padded,
                              wmma::mem_row_major);
    }
}
