// Implicit GEMM on tensor cores through mma.sync (sm_80+): fp16 or bf16 inputs (m16n8k16), or fp32
// inputs as TF32 (m16n8k8: operands go in as loaded, and the tensor cores ignore their 13 low mantissa
// bits, a truncation, as in wgmma_implicit_gemm; rounding each to nearest first cost two instructions
// per operand register, a fifth of the TF32 wgrad's), fp32 accumulation in registers, operands moved
// into shared memory by a STAGES-deep cp.async pipeline and into registers by ldmatrix (or, for TF32
// operands stored k-major, element by element: ldmatrix transposes 16-bit elements only).
//
// Forward (and dgrad: the forward over the reversed pair table, reading the weight transposed) is
// output-stationary, as in wmma_implicit_gemm.cu: a block owns BLOCK_M output rows x BLOCK_N output
// channels, visits the offsets its rows have (in batches, by mask) and the input channels in chunks of
// BLOCK_K, and writes every output element once from its registers (deterministic, no atomics).
// WARPS_M x WARPS_N warps split the tile; each warp's (BLOCK_M / WARPS_M) x (BLOCK_N / WARPS_N) sub-tile
// is a grid of 16 x 8 accumulator tiles. Larger warp tiles than wmma's 32 x 32 reuse every operand
// loaded from shared memory for more multiplications.
//
// The weight comes zero-padded to multiples of 16 in both channel dimensions; chunks past its padded
// input channels stage zeros. Feature rows are copied in 16-byte vectors when `vector_rows` (rows a
// multiple of 16 bytes, base 16-byte aligned), else element by element; either way any channel count
// works.
// Shared memory is dynamic, sized by the host with the same formula as `shared_bytes` below.
#include "float_conversion.cuh"
#include "forward_tile.cuh"
#include "gather_tiles.cuh"

constexpr int MMA_M = 16, MMA_N = 8;
// The k of one mma: 16 for 16-bit operands, 8 for TF32. An 8 x 8 matrix of ldmatrix is 8 rows of 16
// bytes, MMA_K / 2 elements.
template <typename T>
constexpr int MMA_K = 16;
template <>
constexpr int MMA_K<float> = 8;
// Shared-memory rows read k-major (the weight as [k][n] in the forward, both wgrad operands) are padded
// by 8 elements: TF32 fragments read them element by element, and lanes (k = lane % 4, n = lane / 4)
// then fall in 32 different banks.
constexpr int K_MAJOR_ROW_PAD = 8;

// d += a * b for one 16 x 8 x MMA_K<T> tile (fragments in the PTX ISA's layouts for .row.col).
__device__ __forceinline__ void mma_tile(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], __half) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma_tile(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                                         __nv_bfloat16) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma_tile(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], float) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// TF32 fragments from fp32 tiles stored k-major ([k][m] or [k][n], row stride ld), element by element
// (g = lane / 4, t = lane % 4): A 16 x 8 at (m0, k0) holds (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4);
// B 8 x 8 at (k0, n0) holds (t, g), (t + 4, g).
__device__ __forceinline__ void load_a_k_major(unsigned (&a)[4], const float* tile, int ld, int m0, int k0,
                                               int lane) {
  const float* base = tile + (k0 + lane % 4) * ld + m0 + lane / 4;
  a[0] = __float_as_uint(base[0]);
  a[1] = __float_as_uint(base[8]);
  a[2] = __float_as_uint(base[4 * ld]);
  a[3] = __float_as_uint(base[4 * ld + 8]);
}

__device__ __forceinline__ void load_b_k_major(unsigned (&b)[2], const float* tile, int ld, int k0, int n0,
                                               int lane) {
  const float* base = tile + (k0 + lane % 4) * ld + n0 + lane / 4;
  b[0] = __float_as_uint(base[0]);
  b[1] = __float_as_uint(base[4 * ld]);
}

// Four 8 x 8 matrices of 16-bit values (8 rows of 16 bytes; of fp32 values, 8 x 4) from shared memory;
// lane t gives the address of row t % 8 of matrix t / 8. TRANSPOSE hands every lane a column pair
// instead of a row pair.
template <bool TRANSPOSE>
__device__ __forceinline__ void load_matrices(unsigned (&r)[4], const void* shared_row) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared_row));
  if constexpr (TRANSPOSE) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  }
}

// Per stage: the gathered feature tile [BLOCK_M][BLOCK_K + pad], then the weight tile as it lies in
// memory, [BLOCK_K][BLOCK_N + pad] or transposed [BLOCK_N][BLOCK_K + pad]; after the stages, the pair-table
// entries [OFFSET_BATCH][BLOCK_M], the output rows [BLOCK_M] and one mask word per warp. Rows that
// ldmatrix reads untransposed are padded by 16 bytes, k-major rows by K_MAJOR_ROW_PAD.
template <typename T, int BLOCK_M, int BLOCK_N, int BLOCK_K, int STAGES, int OFFSET_BATCH, int WARPS,
          bool WEIGHT_TRANSPOSED>
struct ForwardSharedLayout {
  static constexpr int LDA = BLOCK_K + VECTOR_ELEMENTS<T>;
  static constexpr int LDB = WEIGHT_TRANSPOSED ? BLOCK_K + VECTOR_ELEMENTS<T> : BLOCK_N + K_MAJOR_ROW_PAD;
  static constexpr int A_BYTES = BLOCK_M * LDA * (int)sizeof(T);
  static constexpr int STAGE_BYTES = A_BYTES + (WEIGHT_TRANSPOSED ? BLOCK_N : BLOCK_K) * LDB * (int)sizeof(T);
  static constexpr int IN_ROWS = STAGES * STAGE_BYTES;
  static constexpr int OUT_ROWS = IN_ROWS + OFFSET_BATCH * BLOCK_M * (int)sizeof(int);
  static constexpr int MASKS = OUT_ROWS + BLOCK_M * (int)sizeof(int);
  static constexpr int BYTES = MASKS + WARPS * (int)sizeof(unsigned);
  static_assert(A_BYTES % 128 == 0 && STAGE_BYTES % 128 == 0, "operand tiles start 128-byte aligned");
};

// out[i] = sum_k W_k^T x[pair_table[k, i]] for the BLOCK_M rows and BLOCK_N channels of one tile; see
// wmma_conv_forward for the tile order, `row_order` and the offset batches. x [num_in, in_channels];
// weight [kernel_volume, in_channels_padded, out_channels_padded], or with WEIGHT_TRANSPOSED
// [kernel_volume, out_channels_padded, in_channels_padded] read as its transpose; out [num_out,
// out_channels]. With `reverse_weight_offsets` offset k takes weight K-1-k: dgrad over a map that is
// its own reverse with the offsets flipped (a submanifold map), without a reversed table.
// The blocks past the tiles (a dgrad launch's, none in a forward) sum wgrad's partials instead
// (forward_tile_or_wgrad_sum). The epilogue_* arguments: ForwardEpilogue (all null in dgrad).
template <typename T, int BLOCK_M, int BLOCK_N, int BLOCK_K, int WARPS_M, int WARPS_N, int STAGES,
          bool WEIGHT_TRANSPOSED>
__global__ void __launch_bounds__(WARPS_M* WARPS_N* WARP_SIZE)
    mma_conv_forward(const T* __restrict__ x, const int* __restrict__ pair_table, const int* __restrict__ row_order,
                     const T* __restrict__ weight, T* __restrict__ out, int num_out, int kernel_volume, int in_channels,
                     int in_channels_padded, int out_channels, int out_channels_padded, int vector_rows,
                     int reverse_weight_offsets, const float* __restrict__ wgrad_workspace,
                     T* __restrict__ grad_weight, const int* __restrict__ wgrad_slot_starts, int wgrad_slot_groups,
                     const float* __restrict__ epilogue_scale, const float* __restrict__ epilogue_shift,
                     const T* __restrict__ epilogue_residual, int epilogue_relu) {
  constexpr int WARPS = WARPS_M * WARPS_N;
  constexpr int THREADS = WARPS * WARP_SIZE;
  constexpr int WARP_M = BLOCK_M / WARPS_M, WARP_N = BLOCK_N / WARPS_N;
  constexpr int TILES_M = WARP_M / MMA_M, TILES_N = WARP_N / MMA_N;
  static_assert(WARP_M % MMA_M == 0 && WARP_N % (2 * MMA_N) == 0, "warp tiles are whole pairs of mma tiles");
  constexpr int STEP_K = MMA_K<T>, HALF_K = STEP_K / 2;
  static_assert(BLOCK_K % STEP_K == 0 && STAGES >= 2, "whole k steps, at least double buffering");
  constexpr int OFFSET_BATCH = smaller(MAX_OFFSET_BATCH, ROW_TABLE_LIMIT / (BLOCK_M * (int)sizeof(int)));
  using Layout = ForwardSharedLayout<T, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, OFFSET_BATCH, WARPS, WEIGHT_TRANSPOSED>;
  constexpr int LDA = Layout::LDA, LDB = Layout::LDB;

  extern __shared__ __align__(128) unsigned char shared[];
  if (dynamic_shared_bytes() < Layout::BYTES) __trap();  // launched with the wrong size: refuse, loudly
  int* in_rows = reinterpret_cast<int*>(shared + Layout::IN_ROWS);
  int* out_rows = reinterpret_cast<int*>(shared + Layout::OUT_ROWS);
  unsigned* warp_masks = reinterpret_cast<unsigned*>(shared + Layout::MASKS);

  static_assert(Layout::IN_ROWS >= THREADS * (int)sizeof(float), "the wgrad sum's scratch fits the stages");
  long long row_base;
  int col_base;
  if (!forward_tile_or_wgrad_sum<T, BLOCK_M, BLOCK_N, THREADS>(num_out, in_channels, in_channels_padded, out_channels,
                                                               out_channels_padded, wgrad_workspace, grad_weight,
                                                               wgrad_slot_starts, wgrad_slot_groups,
                                                               reinterpret_cast<float*>(shared), row_base, col_base))
    return;
  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  const int warp_row = (warp / WARPS_N) * WARP_M, warp_col = (warp % WARPS_N) * WARP_N;

  read_tile_rows<BLOCK_M, THREADS>(row_order, row_base, num_out, out_rows);

  float acc[TILES_M][TILES_N][4];
#pragma unroll
  for (int i = 0; i < TILES_M; ++i)
#pragma unroll
    for (int j = 0; j < TILES_N; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  const auto multiply_stage = [&](int buffer) {
    const T* a_tile = reinterpret_cast<const T*>(shared + buffer * Layout::STAGE_BYTES);
    const T* b_tile = reinterpret_cast<const T*>(shared + buffer * Layout::STAGE_BYTES + Layout::A_BYTES);
#pragma unroll
    for (int kk = 0; kk < BLOCK_K; kk += STEP_K) {
      unsigned a[TILES_M][4], b[TILES_N][2];
      // A 16 x STEP_K: matrices (rows 0-7, first k half), (rows 8-15, first), (rows 0-7, second),
      // (rows 8-15, second).
#pragma unroll
      for (int i = 0; i < TILES_M; ++i) {
        load_matrices<false>(a[i], a_tile + (warp_row + i * MMA_M + lane % 16) * LDA + kk + (lane / 16) * HALF_K);
      }
      // B STEP_K x 16 (two n8 tiles): matrices (first k half, n 0-7), (second, n 0-7), (first, n 8-15),
      // (second, n 8-15), as they are from [n][k] rows, or transposed on load from [k][n] rows (fp32
      // element by element).
#pragma unroll
      for (int j = 0; j < TILES_N; j += 2) {
        const int n0 = warp_col + j * MMA_N;
        if constexpr (!WEIGHT_TRANSPOSED && sizeof(T) == 4) {
          load_b_k_major(b[j], b_tile, LDB, kk, n0, lane);
          load_b_k_major(b[j + 1], b_tile, LDB, kk, n0 + MMA_N, lane);
        } else {
          unsigned r[4];
          if constexpr (WEIGHT_TRANSPOSED)
            load_matrices<false>(r, b_tile + (n0 + lane % 8 + (lane / 16) * 8) * LDB + kk + (lane / 8) % 2 * HALF_K);
          else
            load_matrices<true>(r, b_tile + (kk + lane % 16) * LDB + n0 + (lane / 16) * 8);
          b[j][0] = r[0], b[j][1] = r[1], b[j + 1][0] = r[2], b[j + 1][1] = r[3];
        }
      }
#pragma unroll
      for (int i = 0; i < TILES_M; ++i)
#pragma unroll
        for (int j = 0; j < TILES_N; ++j) mma_tile(acc[i][j], a[i], b[j], T());
    }
  };

  const int chunks = (in_channels_padded + BLOCK_K - 1) / BLOCK_K;
  for (int batch_start = 0; batch_start < kernel_volume; batch_start += OFFSET_BATCH) {
    const int batch = min(OFFSET_BATCH, kernel_volume - batch_start);
    unsigned offsets_to_stage =
        read_offset_batch<BLOCK_M, THREADS>(pair_table, num_out, out_rows, batch_start, batch, in_rows, warp_masks);
    const int steps = __popc(offsets_to_stage) * chunks;

    int offset = 0, c0 = chunks * BLOCK_K;  // of the step staged last
    const auto stage_next_step = [&](int buffer) {
      if (c0 == chunks * BLOCK_K) {
        offset = __ffs(offsets_to_stage) - 1;
        offsets_to_stage &= offsets_to_stage - 1;
        c0 = 0;
      }
      T* a_tile = reinterpret_cast<T*>(shared + buffer * Layout::STAGE_BYTES);
      T* b_tile = reinterpret_cast<T*>(shared + buffer * Layout::STAGE_BYTES + Layout::A_BYTES);
      const int* gathered = in_rows + offset * BLOCK_M;
      const auto gathered_row = [&](int m) -> long long { return gathered[m]; };
      if (vector_rows)
        stage_tile<BLOCK_M, BLOCK_K, THREADS, true>(x, in_channels, c0, gathered_row, a_tile, LDA);
      else
        stage_tile<BLOCK_M, BLOCK_K, THREADS, false>(x, in_channels, c0, gathered_row, a_tile, LDA);
      const int weight_offset =
          reverse_weight_offsets ? kernel_volume - 1 - batch_start - offset : batch_start + offset;
      const T* weight_k = weight + (long long)weight_offset * in_channels_padded * out_channels_padded;
      if constexpr (WEIGHT_TRANSPOSED) {
        // The stored weight's rows col_base.. (this call's output channels), columns c0.. (its inputs).
        const auto weight_row = [&](int r) -> long long {
          return col_base + r < out_channels_padded ? col_base + r : -1;
        };
        stage_tile<BLOCK_N, BLOCK_K, THREADS, true>(weight_k, in_channels_padded, c0, weight_row, b_tile, LDB);
      } else {
        const auto weight_row = [&](int r) -> long long { return c0 + r < in_channels_padded ? c0 + r : -1; };
        stage_tile<BLOCK_K, BLOCK_N, THREADS, true>(weight_k, out_channels_padded, col_base, weight_row, b_tile, LDB);
      }
      c0 += BLOCK_K;
    };

    run_pipeline<STAGES>(steps, [&](int, int buffer) { stage_next_step(buffer); }, multiply_stage);
  }

  // Accumulator element e of tile (i, j): row lane / 4 (+ 8 for e >= 2), column 2 (lane % 4) + e % 2.
  const ForwardEpilogue<T> epilogue{epilogue_scale, epilogue_shift, epilogue_residual, epilogue_relu};
  using Pair = typename PairOf<T>::type;
  const bool paired_stores = out_channels % 2 == 0 && reinterpret_cast<unsigned long long>(out) % sizeof(Pair) == 0;
#pragma unroll
  for (int i = 0; i < TILES_M; ++i)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int out_row = out_rows[warp_row + i * MMA_M + lane / 4 + half * 8];
      if (out_row < 0) continue;
      T* out_line = out + (long long)out_row * out_channels;
#pragma unroll
      for (int j = 0; j < TILES_N; ++j) {
        const int col = col_base + warp_col + j * MMA_N + (lane % 4) * 2;
        const float first = acc[i][j][half * 2], second = acc[i][j][half * 2 + 1];
        if (paired_stores) {
          if (col < out_channels) {
            Pair pair;
            pair.x = from_float<T>(epilogue(first, out_row, col, out_channels));
            pair.y = from_float<T>(epilogue(second, out_row, col + 1, out_channels));
            *reinterpret_cast<Pair*>(out_line + col) = pair;
          }
        } else {
          if (col < out_channels) out_line[col] = from_float<T>(epilogue(first, out_row, col, out_channels));
          if (col + 1 < out_channels)
            out_line[col + 1] = from_float<T>(epilogue(second, out_row, col + 1, out_channels));
        }
      }
    }
}

// Weight gradient, split-K over compact pair lists, as wmma_conv_wgrad (same workspace layout and
// shares): dW_k = sum_p x[in_idx[p]]^T dy[out_idx[p]] over share s of offset k's pairs (z names both:
// wgrad_share), for the TILE_M x TILE_N tile (blockIdx.x, blockIdx.y) of dW_k, written unreduced in fp32
// to the share's slot of the workspace [slots, in_channels_padded, out_channels_padded] (zeros where the
// share is empty: no initialisation needed). Per stage, PAIRS (two k steps) gathered
// rows of x and dy sit in shared memory as [PAIRS][channels]: both operands' fragments are read k-major
// (transposed on load, or element by element for TF32).
template <typename T, int TILE_M, int TILE_N, int STAGES>
struct WgradSharedLayout {
  static constexpr int PAIRS = 2 * MMA_K<T>;
  static constexpr int LDX = TILE_M + K_MAJOR_ROW_PAD, LDY = TILE_N + K_MAJOR_ROW_PAD;
  static constexpr int X_BYTES = PAIRS * LDX * (int)sizeof(T);
  static constexpr int STAGE_BYTES = X_BYTES + PAIRS * LDY * (int)sizeof(T);
  static constexpr int INDICES = STAGES * STAGE_BYTES;
  static constexpr int BYTES = INDICES + StagedPairIndices<PAIRS, STAGES - 1, 1>::BYTES;
  static_assert(X_BYTES % 128 == 0 && STAGE_BYTES % 128 == 0, "operand tiles start 128-byte aligned");
};

template <typename T, int TILE_M, int TILE_N, int WARPS_M, int WARPS_N, int STAGES>
__global__ void __launch_bounds__(WARPS_M* WARPS_N* WARP_SIZE)
    mma_conv_wgrad(const T* __restrict__ x, const T* __restrict__ dy, const int* __restrict__ in_idx,
                   const int* __restrict__ out_idx, const long long* __restrict__ pair_offsets,
                   int in_channels, int in_channels_padded, int out_channels, int out_channels_padded,
                   const int4* __restrict__ share_table, float* __restrict__ workspace, int vector_rows) {
  constexpr int THREADS = WARPS_M * WARPS_N * WARP_SIZE;
  constexpr int WARP_M = TILE_M / WARPS_M, WARP_N = TILE_N / WARPS_N;
  constexpr int TILES_M = WARP_M / MMA_M, TILES_N = WARP_N / MMA_N;
  static_assert(WARP_M % MMA_M == 0 && WARP_N % (2 * MMA_N) == 0, "warp tiles are whole pairs of mma tiles");
  static_assert(STAGES >= 2, "at least double buffering");
  using Layout = WgradSharedLayout<T, TILE_M, TILE_N, STAGES>;
  constexpr int PAIRS = Layout::PAIRS, LDX = Layout::LDX, LDY = Layout::LDY, STEP_K = MMA_K<T>;

  extern __shared__ __align__(128) unsigned char shared[];
  if (dynamic_shared_bytes() < Layout::BYTES) __trap();  // launched with the wrong size: refuse, loudly

  const WgradShare share = wgrad_share(share_table);
  if (share.k < 0) return;
  const int row_base = blockIdx.x * TILE_M, col_base = blockIdx.y * TILE_N;
  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  const int warp_row = (warp / WARPS_N) * WARP_M, warp_col = (warp % WARPS_N) * WARP_N;

  // run_pipeline stages a step's rows STAGES - 1 steps before multiplying it: its indices come STAGES - 1
  // steps before that.
  const StagedPairIndices<PAIRS, STAGES - 1, THREADS> indices{
      reinterpret_cast<int*>(shared + Layout::INDICES), in_idx, out_idx,
      PairShare<PAIRS>(pair_offsets, share.k, share.share, share.shares)};
  indices.copy_first();

  float acc[TILES_M][TILES_N][4];
#pragma unroll
  for (int i = 0; i < TILES_M; ++i)
#pragma unroll
    for (int j = 0; j < TILES_N; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

  const auto stage_step = [&](int step, int buffer) {
    T* x_tile = reinterpret_cast<T*>(shared + buffer * Layout::STAGE_BYTES);
    T* dy_tile = reinterpret_cast<T*>(shared + buffer * Layout::STAGE_BYTES + Layout::X_BYTES);
    if (step + STAGES - 1 < indices.share.steps) indices.copy(step + STAGES - 1);
    const auto x_row = [&](int r) { return indices.row(step, 0, r); };
    const auto dy_row = [&](int r) { return indices.row(step, 1, r); };
    if (vector_rows) {
      stage_tile<PAIRS, TILE_M, THREADS, true>(x, in_channels, row_base, x_row, x_tile, LDX);
      stage_tile<PAIRS, TILE_N, THREADS, true>(dy, out_channels, col_base, dy_row, dy_tile, LDY);
    } else {
      stage_tile<PAIRS, TILE_M, THREADS, false>(x, in_channels, row_base, x_row, x_tile, LDX);
      stage_tile<PAIRS, TILE_N, THREADS, false>(dy, out_channels, col_base, dy_row, dy_tile, LDY);
    }
  };

  const auto multiply_stage = [&](int buffer) {
    const T* x_tile = reinterpret_cast<const T*>(shared + buffer * Layout::STAGE_BYTES);
    const T* dy_tile = reinterpret_cast<const T*>(shared + buffer * Layout::STAGE_BYTES + Layout::X_BYTES);
#pragma unroll
    for (int kk = 0; kk < PAIRS; kk += STEP_K) {
      unsigned a[TILES_M][4], b[TILES_N][2];
      if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int i = 0; i < TILES_M; ++i) load_a_k_major(a[i], x_tile, LDX, warp_row + i * MMA_M, kk, lane);
#pragma unroll
        for (int j = 0; j < TILES_N; ++j) load_b_k_major(b[j], dy_tile, LDY, kk, warp_col + j * MMA_N, lane);
      } else {
        // A = x^T 16 x 16 from [pair][channel] rows, transposed on load: matrices (m 0-7, k 0-7),
        // (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15), each 8 pair rows at a channel offset.
#pragma unroll
        for (int i = 0; i < TILES_M; ++i)
          load_matrices<true>(a[i], x_tile + (kk + lane % 8 + (lane / 16) * 8) * LDX + warp_row + i * MMA_M +
                                        (lane / 8) % 2 * 8);
#pragma unroll
        for (int j = 0; j < TILES_N; j += 2) {
          unsigned r[4];
          load_matrices<true>(r, dy_tile + (kk + lane % 16) * LDY + warp_col + j * MMA_N + (lane / 16) * 8);
          b[j][0] = r[0], b[j][1] = r[1], b[j + 1][0] = r[2], b[j + 1][1] = r[3];
        }
      }
#pragma unroll
      for (int i = 0; i < TILES_M; ++i)
#pragma unroll
        for (int j = 0; j < TILES_N; ++j) mma_tile(acc[i][j], a[i], b[j], T());
    }
  };

  run_pipeline<STAGES>(indices.share.steps, stage_step, multiply_stage);

  // Accumulator element e of tile (i, j): row lane / 4 (+ 8 for e >= 2), column 2 (lane % 4) + e % 2;
  // rows and columns past the padded extents belong to no tile of dW_k.
  float* partial = workspace + (long long)share.slot * in_channels_padded * out_channels_padded;
#pragma unroll
  for (int i = 0; i < TILES_M; ++i)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row_base + warp_row + i * MMA_M + lane / 4 + half * 8;
      if (row >= in_channels_padded) continue;
#pragma unroll
      for (int j = 0; j < TILES_N; ++j) {
        const int col = col_base + warp_col + j * MMA_N + (lane % 4) * 2;
        if (col < out_channels_padded)
          *reinterpret_cast<float2*>(partial + (long long)row * out_channels_padded + col) =
              make_float2(acc[i][j][half * 2], acc[i][j][half * 2 + 1]);
      }
    }
}
