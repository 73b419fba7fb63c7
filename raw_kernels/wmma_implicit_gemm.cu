// Implicit GEMM on tensor cores through nvcuda::wmma: 16x16x16 fragments of fp16 or bf16 inputs,
// fp32 accumulation, operands staged in shared memory.
//
// Forward (and dgrad, which is the forward over the reversed pair table reading the weight transposed):
// output-stationary, each block owns BLOCK_M output rows x BLOCK_N output channels and writes every
// element of it once (no atomics, deterministic). Weight gradient: per offset, split-K over that
// offset's compact pair list, fp32 partials into a workspace summed in a fixed order by the dgrad launch
// or, where dgrad is not wanted, a kernel of its own (wgrad_sum.cu).
//
// STAGES >= 2 kernels move 16-byte vectors through a STAGES-deep cp.async pipeline (sm_80+; plain
// copies before, same results) and need the feature / gradient channel counts to be multiples of 8 and
// their base addresses 16-byte aligned. STAGES == 1 kernels load element by element, synchronously,
// and take any channel count.
//
// Weights come zero-padded to multiples of 16 in both channel dimensions, so a 16x16 weight or
// workspace fragment is either wholly inside the padded extent or wholly outside it. Features and
// gradients are not padded: their loads check the channel bound.
#include <mma.h>

#include "float_conversion.cuh"
#include "forward_tile.cuh"
#include "gather_tiles.cuh"

namespace wmma = nvcuda::wmma;

constexpr int FRAGMENT = 16;
// Every warp computes a WARP_TILE x WARP_TILE sub-tile of its block's tile: 2 x 2 fragments.
constexpr int WARP_TILE = 32;
constexpr int WARP_FRAGMENTS = WARP_TILE / FRAGMENT;
constexpr int FLOAT_ROW_PAD = 4;
// Kernels keep to static shared memory, at most 48 KB per block.
constexpr int STATIC_SHARED_LIMIT = 48 * 1024;

using Fragment = wmma::fragment<wmma::accumulator, FRAGMENT, FRAGMENT, FRAGMENT, float>;

// The layout of a weight tile staged as it lies in memory: row-major K x N, or N x K read as col-major.
template <bool TRANSPOSED>
struct WeightLayout {
  using type = wmma::row_major;
};
template <>
struct WeightLayout<true> {
  using type = wmma::col_major;
};


// How many of a warp's WARP_FRAGMENTS fragments along one dimension start inside `extent`
// (a multiple of 16); the rest multiply only zeros and are skipped, uniformly across the warp.
__device__ __forceinline__ int fragments_inside(int extent, int warp_start) {
  return max(0, min(WARP_FRAGMENTS, (extent - warp_start) / FRAGMENT));
}

// out[i] = sum_k W_k^T x[pair_table[k, i]] for the BLOCK_M rows and BLOCK_N channels of one tile.
// Tiles are numbered column tile fastest, so the blocks sharing a set of gathered rows run together.
// `row_order` (or nullptr for the identity) permutes the output rows, e.g. by offset mask, so that a
// tile's rows share offsets and more offsets are skipped for the whole tile.
// The tile first reads its pair-table entries for a batch of offsets into shared memory, with a mask of
// the offsets any of its rows has; the pipeline then runs over the steps (offset in the mask, chunk of
// BLOCK_K input channels) of that batch, so skipped offsets cost no step.
// x [num_in, in_channels]; weight [kernel_volume, in_channels_padded, out_channels_padded], or with
// WEIGHT_TRANSPOSED [kernel_volume, out_channels_padded, in_channels_padded] read as its transpose (dgrad
// reads the layer's weight as it is); out [num_out, out_channels]. in_channels_padded is a multiple of
// BLOCK_K. With `reverse_weight_offsets` offset k takes weight K-1-k: dgrad over a map that is its own
// reverse with the offsets flipped (a submanifold map), without a reversed table.
// The blocks past the tiles (a dgrad launch's, none in a forward) sum wgrad's partials instead
// (forward_tile_or_wgrad_sum). The epilogue_* arguments: ForwardEpilogue (all null in dgrad).
template <typename T, int BLOCK_M, int BLOCK_N, int BLOCK_K, int STAGES, bool WEIGHT_TRANSPOSED>
__global__ void __launch_bounds__((BLOCK_M / WARP_TILE) * (BLOCK_N / WARP_TILE) * WARP_SIZE)
    wmma_conv_forward(const T* __restrict__ x, const int* __restrict__ pair_table, const int* __restrict__ row_order,
                      const T* __restrict__ weight, T* __restrict__ out, int num_out, int kernel_volume,
                      int in_channels, int in_channels_padded, int out_channels, int out_channels_padded,
                      int reverse_weight_offsets, const float* __restrict__ wgrad_workspace,
                      T* __restrict__ grad_weight, const int* __restrict__ wgrad_slot_starts, int wgrad_slot_groups,
                      const float* __restrict__ epilogue_scale, const float* __restrict__ epilogue_shift,
                      const T* __restrict__ epilogue_residual, int epilogue_relu) {
  static_assert(BLOCK_M % WARP_TILE == 0 && BLOCK_N % WARP_TILE == 0, "tiles are made of whole warp tiles");
  static_assert(BLOCK_K % FRAGMENT == 0, "BLOCK_K is a multiple of the fragment size");
  static_assert(STAGES >= 1, "at least one stage");
  constexpr bool PIPELINED = STAGES > 1;
  constexpr int WARPS_N = BLOCK_N / WARP_TILE;
  constexpr int WARPS = (BLOCK_M / WARP_TILE) * WARPS_N;
  constexpr int THREADS = WARPS * WARP_SIZE;
  constexpr int LDA = BLOCK_K + HALF_ROW_PAD;
  // The weight tile is staged as it lies in memory: BLOCK_K x BLOCK_N, or BLOCK_N x BLOCK_K transposed.
  constexpr int LDB = (WEIGHT_TRANSPOSED ? BLOCK_K : BLOCK_N) + HALF_ROW_PAD;
  constexpr int B_ROWS = WEIGHT_TRANSPOSED ? BLOCK_N : BLOCK_K;
  constexpr int LDC = BLOCK_N + FLOAT_ROW_PAD;
  constexpr int A_BYTES = BLOCK_M * LDA * (int)sizeof(T);
  constexpr int STAGE_BYTES = A_BYTES + B_ROWS * LDB * (int)sizeof(T);
  constexpr int C_BYTES = BLOCK_M * LDC * (int)sizeof(float);
  // The fp32 result tile reuses the operand buffers once the main loop is over.
  constexpr int SHARED_BYTES = STAGES * STAGE_BYTES > C_BYTES ? STAGES * STAGE_BYTES : C_BYTES;
  static_assert(A_BYTES % 32 == 0 && STAGE_BYTES % 32 == 0, "every operand tile must start 32-byte aligned");
  constexpr int OTHER_BYTES = SHARED_BYTES + BLOCK_M * (int)sizeof(int) + WARPS * (int)sizeof(unsigned);
  constexpr int OFFSET_BATCH = smaller(
      MAX_OFFSET_BATCH, smaller(ROW_TABLE_LIMIT, STATIC_SHARED_LIMIT - OTHER_BYTES) / (BLOCK_M * (int)sizeof(int)));
  static_assert(OFFSET_BATCH >= 1, "the operand buffers leave no room for the pair-table entries");

  __shared__ __align__(128) unsigned char shared[SHARED_BYTES];
  __shared__ int out_rows[BLOCK_M];
  __shared__ int in_rows[OFFSET_BATCH][BLOCK_M];  // per offset of the batch and tile row: input row or -1
  __shared__ unsigned warp_offset_masks[WARPS];
  float* c_tile = reinterpret_cast<float*>(shared);

  static_assert(SHARED_BYTES >= THREADS * (int)sizeof(float), "the wgrad sum's scratch fits the operand buffers");
  long long row_base;
  int col_base;
  if (!forward_tile_or_wgrad_sum<T, BLOCK_M, BLOCK_N, THREADS>(num_out, in_channels, in_channels_padded, out_channels,
                                                               out_channels_padded, wgrad_workspace, grad_weight,
                                                               wgrad_slot_starts, wgrad_slot_groups, c_tile,
                                                               row_base, col_base))
    return;
  const int warp = threadIdx.x / WARP_SIZE;
  const int warp_row = (warp / WARPS_N) * WARP_TILE;
  const int warp_col = (warp % WARPS_N) * WARP_TILE;
  const int active_col_fragments = fragments_inside(out_channels_padded, col_base + warp_col);

  read_tile_rows<BLOCK_M, THREADS>(row_order, row_base, num_out, out_rows);

  Fragment acc[WARP_FRAGMENTS][WARP_FRAGMENTS];
#pragma unroll
  for (int i = 0; i < WARP_FRAGMENTS; ++i)
#pragma unroll
    for (int j = 0; j < WARP_FRAGMENTS; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  const auto multiply_stage = [&](int buffer) {
    const T* a_tile = reinterpret_cast<const T*>(shared + buffer * STAGE_BYTES);
    const T* b_tile = reinterpret_cast<const T*>(shared + buffer * STAGE_BYTES + A_BYTES);
#pragma unroll
    for (int kk = 0; kk < BLOCK_K; kk += FRAGMENT) {
      wmma::fragment<wmma::matrix_a, FRAGMENT, FRAGMENT, FRAGMENT, T, wmma::row_major> a[WARP_FRAGMENTS];
#pragma unroll
      for (int i = 0; i < WARP_FRAGMENTS; ++i)
        wmma::load_matrix_sync(a[i], a_tile + (warp_row + i * FRAGMENT) * LDA + kk, LDA);
#pragma unroll
      for (int j = 0; j < WARP_FRAGMENTS; ++j) {
        if (j >= active_col_fragments) continue;
        using Layout = typename WeightLayout<WEIGHT_TRANSPOSED>::type;
        wmma::fragment<wmma::matrix_b, FRAGMENT, FRAGMENT, FRAGMENT, T, Layout> b;
        const int n = warp_col + j * FRAGMENT;
        wmma::load_matrix_sync(b, b_tile + (WEIGHT_TRANSPOSED ? n * LDB + kk : kk * LDB + n), LDB);
#pragma unroll
        for (int i = 0; i < WARP_FRAGMENTS; ++i) wmma::mma_sync(acc[i][j], a[i], b, acc[i][j]);
      }
    }
  };

  const int chunks = in_channels_padded / BLOCK_K;
  for (int batch_start = 0; batch_start < kernel_volume; batch_start += OFFSET_BATCH) {
    const int batch = min(OFFSET_BATCH, kernel_volume - batch_start);
    unsigned offsets_to_stage = read_offset_batch<BLOCK_M, THREADS>(pair_table, num_out, out_rows, batch_start, batch,
                                                                   &in_rows[0][0], warp_offset_masks);
    const int steps = __popc(offsets_to_stage) * chunks;

    int offset = 0, c0 = in_channels_padded;  // of the step staged last
    const auto stage_next_step = [&](int buffer) {
      if (c0 == in_channels_padded) {
        offset = __ffs(offsets_to_stage) - 1;
        offsets_to_stage &= offsets_to_stage - 1;
        c0 = 0;
      }
      T* a_tile = reinterpret_cast<T*>(shared + buffer * STAGE_BYTES);
      T* b_tile = reinterpret_cast<T*>(shared + buffer * STAGE_BYTES + A_BYTES);
      const int* gathered = in_rows[offset];
      const auto gathered_row = [&](int m) -> long long { return gathered[m]; };
      const int weight_offset =
          reverse_weight_offsets ? kernel_volume - 1 - batch_start - offset : batch_start + offset;
      const T* weight_k = weight + (long long)weight_offset * in_channels_padded * out_channels_padded;
      stage_tile<BLOCK_M, BLOCK_K, THREADS, PIPELINED>(x, in_channels, c0, gathered_row, a_tile, LDA);
      if constexpr (WEIGHT_TRANSPOSED) {
        // The stored weight's rows col_base.. (this call's output channels), columns c0.. (its inputs).
        const auto weight_row = [&](int r) -> long long {
          return col_base + r < out_channels_padded ? col_base + r : -1;
        };
        stage_tile<BLOCK_N, BLOCK_K, THREADS, true>(weight_k, in_channels_padded, c0, weight_row, b_tile, LDB);
      } else {
        const auto weight_row = [&](int r) -> long long { return c0 + r; };
        stage_tile<BLOCK_K, BLOCK_N, THREADS, true>(weight_k, out_channels_padded, col_base, weight_row, b_tile, LDB);
      }
      c0 += BLOCK_K;
    };

    if constexpr (PIPELINED) {
      run_pipeline<STAGES>(steps, [&](int, int buffer) { stage_next_step(buffer); }, multiply_stage);
    } else {
      for (int step = 0; step < steps; ++step) {
        if (step > 0) __syncthreads();  // every warp is done with the previous step's buffer
        stage_next_step(0);
        // The weight tile still moves in 16-byte copies, asynchronous on sm_80+.
        commit_async_copies();
        wait_async_copies<0>();
        __syncthreads();
        multiply_stage(0);
      }
    }
  }
  __syncthreads();  // every read of the operand buffers is done: the result tile reuses them

#pragma unroll
  for (int i = 0; i < WARP_FRAGMENTS; ++i)
#pragma unroll
    for (int j = 0; j < WARP_FRAGMENTS; ++j)
      wmma::store_matrix_sync(c_tile + (warp_row + i * FRAGMENT) * LDC + warp_col + j * FRAGMENT, acc[i][j], LDC,
                              wmma::mem_row_major);
  __syncthreads();
  const ForwardEpilogue<T> epilogue{epilogue_scale, epilogue_shift, epilogue_residual, epilogue_relu};
  for (int e = threadIdx.x; e < BLOCK_M * BLOCK_N; e += THREADS) {
    const int m = e / BLOCK_N, n = e % BLOCK_N;
    const int out_row = out_rows[m], col = col_base + n;
    if (out_row >= 0 && col < out_channels)
      out[(long long)out_row * out_channels + col] = from_float<T>(epilogue(c_tile[m * LDC + n], out_row, col,
                                                                            out_channels));
  }
}

// Weight gradient, split-K over compact pair lists: dW_k = sum_p x[in_idx[p]]^T dy[out_idx[p]] over the
// pairs p in [pair_offsets[k], pair_offsets[k + 1]). Block (x, y, z) computes the TILE_M x TILE_N tile
// (blockIdx.x, blockIdx.y) of dW_k over share s of offset k's pairs (z names both: wgrad_share; the pairs
// split evenly, on the device, into shares of whole stages), and writes it unreduced to its slot of the
// workspace [slots, in_channels_padded, out_channels_padded] (fp32). Every block with a share writes its
// whole tile (zeros where the share is empty), so the workspace needs no initialisation.
// x [num_in, in_channels]; dy [num_out, out_channels].
template <typename T, int TILE_M, int TILE_N, int STAGES>
__global__ void __launch_bounds__((TILE_M / WARP_TILE) * (TILE_N / WARP_TILE) * WARP_SIZE)
    wmma_conv_wgrad(const T* __restrict__ x, const T* __restrict__ dy, const int* __restrict__ in_idx,
                    const int* __restrict__ out_idx, const long long* __restrict__ pair_offsets,
                    int in_channels, int in_channels_padded, int out_channels, int out_channels_padded,
                    const int4* __restrict__ share_table, float* __restrict__ workspace) {
  static_assert(TILE_M % WARP_TILE == 0 && TILE_N % WARP_TILE == 0, "tiles are made of whole warp tiles");
  static_assert(STAGES >= 1, "at least one stage");
  constexpr bool PIPELINED = STAGES > 1;
  constexpr int WARPS_N = TILE_N / WARP_TILE;
  constexpr int THREADS = (TILE_M / WARP_TILE) * WARPS_N * WARP_SIZE;
  constexpr int LDX = TILE_M + HALF_ROW_PAD;
  constexpr int LDY = TILE_N + HALF_ROW_PAD;
  // Pairs per stage: 64 where STAGES such stages fit in static shared memory, else 32.
  constexpr int PAIR_BYTES = (LDX + LDY) * (int)sizeof(T);
  constexpr int ROWS = 64 * PAIR_BYTES * STAGES <= STATIC_SHARED_LIMIT ? 64 : 32;
  constexpr int X_BYTES = ROWS * LDX * (int)sizeof(T);
  constexpr int STAGE_BYTES = ROWS * PAIR_BYTES;
  static_assert(STAGES * STAGE_BYTES <= STATIC_SHARED_LIMIT, "the stages do not fit in static shared memory");
  static_assert(X_BYTES % 32 == 0 && STAGE_BYTES % 32 == 0, "every operand tile must start 32-byte aligned");

  // Per stage: x rows [ROWS x TILE_M], read as the col-major x^T, then dy rows [ROWS x TILE_N].
  __shared__ __align__(128) unsigned char shared[STAGES * STAGE_BYTES];

  const WgradShare share = wgrad_share(share_table);
  if (share.k < 0) return;
  const int row_base = blockIdx.x * TILE_M, col_base = blockIdx.y * TILE_N;
  const int warp = threadIdx.x / WARP_SIZE;
  const int warp_row = (warp / WARPS_N) * WARP_TILE;
  const int warp_col = (warp % WARPS_N) * WARP_TILE;
  const int active_row_fragments = fragments_inside(in_channels_padded, row_base + warp_row);
  const int active_col_fragments = fragments_inside(out_channels_padded, col_base + warp_col);

  const PairShare<ROWS> pairs(pair_offsets, share.k, share.share, share.shares);
  const long long first = pairs.first, last = pairs.last;
  const int steps = pairs.steps;

  Fragment acc[WARP_FRAGMENTS][WARP_FRAGMENTS];
#pragma unroll
  for (int i = 0; i < WARP_FRAGMENTS; ++i)
#pragma unroll
    for (int j = 0; j < WARP_FRAGMENTS; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

  const auto multiply_stage = [&](int buffer) {
    const T* x_tile = reinterpret_cast<const T*>(shared + buffer * STAGE_BYTES);
    const T* dy_tile = reinterpret_cast<const T*>(shared + buffer * STAGE_BYTES + X_BYTES);
#pragma unroll
    for (int kk = 0; kk < ROWS; kk += FRAGMENT) {
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
  };

  if constexpr (PIPELINED) {
    // Each thread copies fixed vectors of every stage: vector i of the x tile is tile row
    // (threadIdx.x + i * THREADS) / X_VECTORS_PER_ROW, and likewise for dy. The pair indices of the next
    // step are loaded into registers one step ahead, so staging never waits on them.
    constexpr int X_VECTORS_PER_ROW = TILE_M / VECTOR, DY_VECTORS_PER_ROW = TILE_N / VECTOR;
    constexpr int X_VECTORS = ROWS * X_VECTORS_PER_ROW / THREADS, DY_VECTORS = ROWS * DY_VECTORS_PER_ROW / THREADS;
    static_assert(X_VECTORS * THREADS == ROWS * X_VECTORS_PER_ROW && DY_VECTORS * THREADS == ROWS * DY_VECTORS_PER_ROW,
                  "every thread copies the same number of vectors");
    int x_rows[X_VECTORS], dy_rows[DY_VECTORS];  // of the next step to stage, -1 past the share's end
    const auto load_pair_indices = [&](int step) {
      const long long pair0 = first + (long long)step * ROWS;
#pragma unroll
      for (int i = 0; i < X_VECTORS; ++i) {
        const long long pair = pair0 + (threadIdx.x + i * THREADS) / X_VECTORS_PER_ROW;
        x_rows[i] = step < steps && pair < last ? in_idx[pair] : -1;
      }
#pragma unroll
      for (int i = 0; i < DY_VECTORS; ++i) {
        const long long pair = pair0 + (threadIdx.x + i * THREADS) / DY_VECTORS_PER_ROW;
        dy_rows[i] = step < steps && pair < last ? out_idx[pair] : -1;
      }
    };
    const auto stage_step = [&](int buffer) {
      T* x_tile = reinterpret_cast<T*>(shared + buffer * STAGE_BYTES);
      T* dy_tile = reinterpret_cast<T*>(shared + buffer * STAGE_BYTES + X_BYTES);
#pragma unroll
      for (int i = 0; i < X_VECTORS; ++i) {
        const int v = threadIdx.x + i * THREADS;
        const int r = v / X_VECTORS_PER_ROW, c = (v % X_VECTORS_PER_ROW) * VECTOR;
        const int col = row_base + c;
        const bool valid = x_rows[i] >= 0 && col < in_channels;
        copy_16_bytes(x_tile + r * LDX + c, valid ? x + (long long)x_rows[i] * in_channels + col : x, valid);
      }
#pragma unroll
      for (int i = 0; i < DY_VECTORS; ++i) {
        const int v = threadIdx.x + i * THREADS;
        const int r = v / DY_VECTORS_PER_ROW, c = (v % DY_VECTORS_PER_ROW) * VECTOR;
        const int col = col_base + c;
        const bool valid = dy_rows[i] >= 0 && col < out_channels;
        copy_16_bytes(dy_tile + r * LDY + c, valid ? dy + (long long)dy_rows[i] * out_channels + col : dy, valid);
      }
    };

    load_pair_indices(0);
    const auto stage_and_look_ahead = [&](int step, int buffer) {
      stage_step(buffer);
      load_pair_indices(step + 1);
    };
    run_pipeline<STAGES>(steps, stage_and_look_ahead, multiply_stage);
  } else {
    T* x_tile = reinterpret_cast<T*>(shared);
    T* dy_tile = reinterpret_cast<T*>(shared + X_BYTES);
    for (int step = 0; step < steps; ++step) {
      const long long pair0 = first + (long long)step * ROWS;
      const auto x_row = [&](int r) -> long long { return pair0 + r < last ? in_idx[pair0 + r] : -1; };
      const auto dy_row = [&](int r) -> long long { return pair0 + r < last ? out_idx[pair0 + r] : -1; };
      if (step > 0) __syncthreads();  // every warp is done with the previous step
      stage_tile<ROWS, TILE_M, THREADS, false>(x, in_channels, row_base, x_row, x_tile, LDX);
      stage_tile<ROWS, TILE_N, THREADS, false>(dy, out_channels, col_base, dy_row, dy_tile, LDY);
      __syncthreads();
      multiply_stage(0);
    }
  }

  // Fragments are whole inside the padded extents (multiples of 16) or skipped: no partial stores.
  float* partial = workspace + (long long)share.slot * in_channels_padded * out_channels_padded;
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
