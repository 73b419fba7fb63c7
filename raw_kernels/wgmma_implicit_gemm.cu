// Implicit GEMM on Hopper's warpgroup tensor cores (wgmma.mma_async, sm_90a only): fp16 or bf16 inputs, or
// fp32 ones read as TF32 (the tensor cores ignore their 13 low mantissa bits), fp32 accumulation in registers, operands read by the tensor cores straight from shared memory, where a
// STAGES-deep cp.async pipeline gathers them.
//
// The dataflow is mma_implicit_gemm.cu's forward (and its dgrad: the same kernel over the weight read
// transposed): a block owns BLOCK_M output rows (in mask-sorted order when `row_order` is given) x
// BLOCK_N output channels, reads its rows' pair-table entries for a batch of offsets at a time, visits
// only the offsets some row has, and the input channels in chunks of BLOCK_K = 64, and writes every
// output element once from registers (deterministic, no atomics).
// BLOCK_M / 64 warpgroups (4 warps each) split the rows: warpgroup g multiplies rows 64 g .. 64 g + 63 of
// the gathered tile by the whole weight tile, one m64nBLOCK_Nk16 wgmma per 32 bytes of input channels (16
// 16-bit ones; k8 for TF32's 8).
//
// Shared-memory layouts, both in the 128-byte swizzle mode of the wgmma matrix descriptors (no bank
// conflicts for the tensor cores' reads): a swizzle atom is 8 rows of 128 bytes (1024 bytes, 1024-byte
// aligned), and 16-byte chunk c of row r lies at chunk c ^ (r % 8) of its row.
// - A, the gathered feature rows, K-major: row m holds the 128 bytes of input channels c0 .. (64 16-bit
//   ones or 32 fp32 ones: one stage, one swizzle row) of its gathered row; 8-row atoms follow each other
//   (stride byte offset 1024; the leading byte offset is unused by swizzled K-major layouts). The k-th
//   wgmma starts 32 k bytes into the rows: the hardware swizzles on the address bits, so an offset start
//   inside an aligned atom works.
// - B, the weight slice W_k[c0 .. c0 + 63][col_base .. col_base + BLOCK_N - 1], N-major (as the weight
//   lies in memory, [C_in][C_out]; the instruction's transpose-B flag): one region per 64 output channels
//   (128 bytes a row), each holding the 64 input-channel rows (leading byte offset: the region size;
//   stride byte offset: 1024, from 8 input channels to the next 8). The k-th step starts 16 rows (2048
//   bytes) in, still atom-aligned.
//   dgrad reads the weight transposed (WEIGHT_TRANSPOSED): B[k][n] = W[n][k] has its rows of k in
//   memory, so it is staged K-major like A, one 128-byte swizzled row per output channel of the call.
//   TF32 operands must be K-major: the fp32 forward takes its weight transposed by the host
//   ([kernel_volume, out_channels_padded, in_channels_padded]) and stages it the same way.
// Feature rows are copied in 16-byte vectors when `vector_rows` (rows a multiple of 16 bytes, base
// 16-byte aligned), else element by element; the weight, zero-padded to multiples of 16 channels on both
// sides, always in vectors. Past the channel counts the tiles hold zeros.
//
// Shared memory is dynamic, sized by the host as `WgmmaSharedLayout::ALLOCATED`: the layout plus 1024
// bytes, so that the operand tiles can start on a 1024-byte boundary whatever the allocation's base.
//
// Everything is compiled for sm_90a only (NVRTC -arch=sm_90a); for any other target the kernel is an empty
// stub, and the host never launches it off compute capability 9.0.
#include "float_conversion.cuh"
#include "forward_tile.cuh"
#include "gather_tiles.cuh"

constexpr int WARPGROUP_THREADS = 4 * WARP_SIZE;
constexpr int WGMMA_M = 64;
constexpr int WGMMA_K_BYTES = 32;  // of an operand row per wgmma: k16 of 16-bit values, k8 of TF32
constexpr int SWIZZLE_ROW_BYTES = 128;  // one row of a 128-byte swizzle atom
constexpr int SWIZZLE_ATOM_BYTES = 8 * SWIZZLE_ROW_BYTES;
template <typename T>
constexpr int STAGE_CHANNELS = SWIZZLE_ROW_BYTES / (int)sizeof(T);  // input channels per pipeline stage
constexpr int N_MAJOR_ROWS = SWIZZLE_ROW_BYTES / 2;  // k rows of an N-major B (16-bit values only)
// Offsets whose pair-table entries a forward tile reads at once: a 3x3x3 kernel's 27 in one batch, and no more,
// so that two blocks of 128 rows x 128 channels in 3 stages, or x 64 channels in 4, fit in an H100 SM's
// shared memory: 111.5 KB each, where 32 offsets made 113.5 KB and one block an SM (H100, TF32 forward, 1M
// voxels: 128 x 128 in 3 stages 2.36 -> 1.75 ms, 128 x 64 in 4 stages 1.31 -> 0.87 ms).
constexpr int FORWARD_OFFSET_BATCH = 27;

// Per stage: A [BLOCK_M rows of 128 bytes], then B: N-major [BLOCK_N / 64 regions][64 rows of 128 bytes], or
// K-major [BLOCK_N rows of 128 bytes], the same size; after the stages, the pair-table entries [OFFSET_BATCH][BLOCK_M], the output rows [BLOCK_M], one mask word per warp.
template <int BLOCK_M, int BLOCK_N, int STAGES, int OFFSET_BATCH, int WARPS>
struct WgmmaSharedLayout {
  static constexpr int A_BYTES = BLOCK_M * SWIZZLE_ROW_BYTES;
  static constexpr int B_REGION_BYTES = N_MAJOR_ROWS * SWIZZLE_ROW_BYTES;
  static constexpr int STAGE_BYTES = A_BYTES + BLOCK_N * SWIZZLE_ROW_BYTES;
  static constexpr int IN_ROWS = STAGES * STAGE_BYTES;
  static constexpr int OUT_ROWS = IN_ROWS + OFFSET_BATCH * BLOCK_M * (int)sizeof(int);
  static constexpr int MASKS = OUT_ROWS + BLOCK_M * (int)sizeof(int);
  static constexpr int BYTES = MASKS + WARPS * (int)sizeof(unsigned);
  static constexpr int ALLOCATED = BYTES + SWIZZLE_ATOM_BYTES;
  static_assert(A_BYTES % SWIZZLE_ATOM_BYTES == 0 && STAGE_BYTES % SWIZZLE_ATOM_BYTES == 0,
                "operand tiles start on swizzle atoms");
};

// wgrad's, 16-bit operands only: per stage, 64 pairs of both operands MN-major (a region of 64 swizzled
// 128-byte pair rows per 64 channels: TILE_M / 64 regions of x, then TILE_N / 64 of dy); after the stages,
// the StagedPairIndices of STAGES - 2 steps ahead.
template <int TILE_M, int TILE_N, int STAGES>
struct WgmmaWgradLayout {
  static constexpr int PAIRS = SWIZZLE_ROW_BYTES / 2;
  static constexpr int REGION_BYTES = PAIRS * SWIZZLE_ROW_BYTES;
  static constexpr int X_BYTES = TILE_M / 64 * REGION_BYTES;
  static constexpr int STAGE_BYTES = X_BYTES + TILE_N / 64 * REGION_BYTES;
  static constexpr int INDICES = STAGES * STAGE_BYTES;
  static constexpr int ALLOCATED = INDICES + StagedPairIndices<PAIRS, STAGES - 2, 1>::BYTES + SWIZZLE_ATOM_BYTES;
};

// TF32 wgrad's: per stage, dy's PAIRS pairs K-major (TILE_N swizzled 128-byte rows, one per output channel:
// its values at the stage's 32 pairs), then x's pair rows as they lie (TILE_M channels, padded by 8 floats: the
// A fragments' reads then meet 32 banks); after the stages, the StagedPairIndices of STAGES - 2 steps ahead.
template <int TILE_M, int TILE_N, int STAGES>
struct WgmmaTf32WgradLayout {
  static constexpr int PAIRS = SWIZZLE_ROW_BYTES / 4;
  static constexpr int X_LD = TILE_M + 8;
  static constexpr int DY_BYTES = TILE_N * SWIZZLE_ROW_BYTES;
  static constexpr int STAGE_BYTES = DY_BYTES + PAIRS * X_LD * 4;
  static constexpr int INDICES = STAGES * STAGE_BYTES;
  static constexpr int ALLOCATED = INDICES + StagedPairIndices<PAIRS, STAGES - 2, 1>::BYTES + SWIZZLE_ATOM_BYTES;
  static_assert(STAGE_BYTES % SWIZZLE_ATOM_BYTES == 0, "dy's tiles start on swizzle atoms");
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The byte offset of 16-byte chunk `chunk` of row `row` in a region of 128-byte swizzled rows.
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * SWIZZLE_ROW_BYTES + ((chunk ^ (row % 8)) << 4);
}

// A wgmma shared-memory matrix descriptor in 128-byte swizzle mode: start address, leading and stride
// byte offsets, each in 16-byte units (bits 0-13, 16-29, 32-45); base offset 0 (bits 49-51: the atoms are
// 1024-byte aligned); swizzle mode 1 = 128 bytes (bits 62-63).
__device__ __forceinline__ unsigned long long matrix_descriptor(unsigned address, unsigned leading_bytes,
                                                                unsigned stride_bytes) {
  return (unsigned long long)((address & 0x3FFFF) >> 4) | (unsigned long long)((leading_bytes >> 4) & 0x3FFF) << 16 |
         (unsigned long long)((stride_bytes >> 4) & 0x3FFF) << 32 | 1ull << 62;
}

// Orders this warpgroup's earlier register accesses (the accumulators' initialisation, or their reads)
// before the wgmma.mma_async that follow.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Waits until at most PENDING of this warpgroup's wgmma groups are in flight.
template <int PENDING>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}

// Makes this thread's completed writes to shared memory through the generic proxy (cp.async, st.shared)
// visible to the async proxy, through which wgmma reads its operands; a barrier after it covers the block.
__device__ __forceinline__ void fence_shared_for_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Ties the accumulators to this point of the instruction stream, so the compiler moves no access to
// them across a wgmma wait (the asynchronous instructions write them behind its back).
template <int N>
__device__ __forceinline__ void pin_registers(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator operands of a wgmma with REGISTERS of them (the m64nN fragment: N / 2 floats a thread), and
// their names in the instruction: every one is listed.
#define WGMMA_NAMES_32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WGMMA_ACCUMULATORS_32 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WGMMA_NAMES_64 WGMMA_NAMES_32 ", " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WGMMA_ACCUMULATORS_64 WGMMA_ACCUMULATORS_32, \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define WGMMA_NAMES_128 WGMMA_NAMES_64 ", " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define WGMMA_ACCUMULATORS_128 WGMMA_ACCUMULATORS_64, \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
  "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
  "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
  "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
  "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// d (the accumulator fragment) += A * B, issued asynchronously, for the 64 x k A and k x N B the
// descriptors describe (k: 32 bytes of values): A K-major; B K-major, or N-major with TRANSPOSE_B = 1
// (16-bit types only: TF32 has no transpose immediates, its operands are K-major). One overload per N
// (the fragment's size) and type (the last argument, a tag); A_, B_ and the rest name the operands that
// follow the accumulators.
#define WITH_TRANSPOSES(immediates) immediates
#define WITHOUT_TRANSPOSES(immediates)
#define WGMMA_ASYNC(REGISTERS, SHAPE, TYPE, SHAPE_K_AND_TYPES, TRANSPOSES, A_, B_, ACCUMULATE_, TRANSPOSE_A_,         \
                    TRANSPOSE_B_)                                                                                   \
  template <int TRANSPOSE_A, int TRANSPOSE_B>                                                                       \
  __device__ __forceinline__ void wgmma_async(float(&d)[REGISTERS], unsigned long long a, unsigned long long b,     \
                                              TYPE) {                                                               \
    static_assert(TRANSPOSE_A + TRANSPOSE_B == 0 || sizeof(TYPE) == 2, "TF32 operands are K-major only");           \
    asm volatile("{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, " ACCUMULATE_ ", 0;\n"                        \
                 "wgmma.mma_async.sync.aligned." SHAPE SHAPE_K_AND_TYPES " {" WGMMA_NAMES_##REGISTERS "}, " A_ ", " B_ \
                 ", accumulate, 1, 1" TRANSPOSES(", " TRANSPOSE_A_ ", " TRANSPOSE_B_) ";\n}\n"                      \
                 : WGMMA_ACCUMULATORS_##REGISTERS                                                                    \
                 : "l"(a), "l"(b), "r"(1), "n"(TRANSPOSE_A), "n"(TRANSPOSE_B));                                      \
  }
#define WGMMA_ASYNC_EVERY_TYPE(REGISTERS, SHAPE, A_, B_, ACCUMULATE_, TRANSPOSE_A_, TRANSPOSE_B_)                      \
  WGMMA_ASYNC(REGISTERS, SHAPE, __half, "k16.f32.f16.f16", WITH_TRANSPOSES, A_, B_, ACCUMULATE_, TRANSPOSE_A_,      \
              TRANSPOSE_B_)                                                                                         \
  WGMMA_ASYNC(REGISTERS, SHAPE, __nv_bfloat16, "k16.f32.bf16.bf16", WITH_TRANSPOSES, A_, B_, ACCUMULATE_,          \
              TRANSPOSE_A_, TRANSPOSE_B_)                                                                           \
  WGMMA_ASYNC(REGISTERS, SHAPE, float, "k8.f32.tf32.tf32", WITHOUT_TRANSPOSES, A_, B_, ACCUMULATE_, TRANSPOSE_A_,   \
              TRANSPOSE_B_)
WGMMA_ASYNC_EVERY_TYPE(32, "m64n64", "%32", "%33", "%34", "%35", "%36")
WGMMA_ASYNC_EVERY_TYPE(64, "m64n128", "%64", "%65", "%66", "%67", "%68")
WGMMA_ASYNC_EVERY_TYPE(128, "m64n256", "%128", "%129", "%130", "%131", "%132")
#undef WGMMA_ASYNC_EVERY_TYPE
#undef WGMMA_ASYNC
#undef WITH_TRANSPOSES
#undef WITHOUT_TRANSPOSES

// d += A * B as wgmma_async, TF32, with A in registers: `a` holds this thread's four values of the 64 x 8 A
// (its warp's 16 rows: rows lane / 4 and lane / 4 + 8, columns lane % 4 and lane % 4 + 4, in the order
// (r, c), (r + 8, c), (r, c + 4), (r + 8, c + 4)), read by the tensor cores until the wgmma completes.
#define WGMMA_ASYNC_TF32_A_IN_REGISTERS(REGISTERS, SHAPE, A_, B_, ACCUMULATE_)                                      \
  __device__ __forceinline__ void wgmma_async_tf32(float(&d)[REGISTERS], const unsigned (&a)[4],                   \
                                                   unsigned long long b) {                                          \
    asm volatile("{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, " ACCUMULATE_ ", 0;\n"                        \
                 "wgmma.mma_async.sync.aligned." SHAPE "k8.f32.tf32.tf32 {" WGMMA_NAMES_##REGISTERS "}, {" A_ "}, " B_ \
                 ", accumulate, 1, 1;\n}\n"                                                                          \
                 : WGMMA_ACCUMULATORS_##REGISTERS                                                                    \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));                                      \
  }
WGMMA_ASYNC_TF32_A_IN_REGISTERS(64, "m64n128", "%64, %65, %66, %67", "%68", "%69")
WGMMA_ASYNC_TF32_A_IN_REGISTERS(128, "m64n256", "%128, %129, %130, %131", "%132", "%133")
#undef WGMMA_ASYNC_TF32_A_IN_REGISTERS
#undef WGMMA_NAMES_32
#undef WGMMA_NAMES_64
#undef WGMMA_NAMES_128
#undef WGMMA_ACCUMULATORS_32
#undef WGMMA_ACCUMULATORS_64
#undef WGMMA_ACCUMULATORS_128

// Copies ROWS gathered rows (row r is matrix row `row_of(r)`, -1: zeros) of 128 bytes of columns from col0
// of a row-major matrix with `num_cols` columns into 128-byte swizzled rows at `dst` (columns at or past
// `num_cols` zero). VECTOR_COPIES moves 16 bytes at once (asynchronously) and needs rows of whole 16-byte
// vectors and `src` 16-byte aligned.
template <int ROWS, int THREADS, bool VECTOR_COPIES, typename T, typename RowOf>
__device__ __forceinline__ void stage_swizzled_rows(const T* __restrict__ src, int num_cols, int col0, RowOf row_of,
                                                   unsigned char* dst) {
  constexpr int CHUNKS = SWIZZLE_ROW_BYTES / 16, ELEMENTS = VECTOR_ELEMENTS<T>, ROW_ELEMENTS = STAGE_CHANNELS<T>;
  if constexpr (VECTOR_COPIES) {
    static_assert(ROWS * CHUNKS % THREADS == 0 && THREADS % CHUNKS == 0, "whole copies, one chunk per thread");
    // The thread's chunk, the same in every row: its address and check come before the rows'.
    const int chunk = threadIdx.x % CHUNKS;
    const bool column_valid = col0 + chunk * ELEMENTS < num_cols;
    const T* column = src + (column_valid ? col0 + chunk * ELEMENTS : 0);
#pragma unroll
    for (int i = 0; i < ROWS * CHUNKS / THREADS; ++i) {
      const int r = threadIdx.x / CHUNKS + i * (THREADS / CHUNKS);
      const int row = row_of(r);
      const bool valid = column_valid && row >= 0;
      copy_16_bytes(dst + swizzled(r, chunk), row_element(column, valid ? row : 0, num_cols), valid);
    }
  } else {
    const T zero = from_float<T>(0.0f);
    for (int e = threadIdx.x; e < ROWS * ROW_ELEMENTS; e += THREADS) {
      const int r = e / ROW_ELEMENTS, c = e % ROW_ELEMENTS;
      const int row = row_of(r);
      const int col = col0 + c;
      *reinterpret_cast<T*>(dst + swizzled(r, c / ELEMENTS) + (c % ELEMENTS) * (int)sizeof(T)) =
          row >= 0 && col < num_cols ? *row_element(src + col, row, num_cols) : zero;
    }
  }
}

// Copies ROWS gathered rows (row r is matrix row `row_of(r)`: zeros if negative or at or past `num_rows`) of
// columns col0 .. col0 + COLS - 1 (zeros at or past `num_cols`) of a row-major matrix of 16-bit values into
// COLS / 64 regions of ROWS swizzled 128-byte rows, region j holding columns col0 + 64 j .. col0 + 64 j + 63:
// an MN-major operand, its rows along k (the forward's N-major B: weight rows; both wgrad operands: pair
// rows). VECTOR_COPIES as in stage_swizzled_rows.
template <int ROWS, int COLS, int THREADS, bool VECTOR_COPIES, typename T, typename RowOf>
__device__ __forceinline__ void stage_mn_major(const T* __restrict__ src, int num_rows, int num_cols, int col0,
                                               RowOf row_of, unsigned char* dst) {
  static_assert(sizeof(T) == 2, "MN-major operands are 16-bit");
  constexpr int CHUNKS = SWIZZLE_ROW_BYTES / 16, REGION_COLUMNS = SWIZZLE_ROW_BYTES / 2;
  constexpr int REGION_BYTES = ROWS * SWIZZLE_ROW_BYTES;
  if constexpr (VECTOR_COPIES) {
    constexpr int ROW_VECTORS = COLS / VECTOR, VECTORS = ROWS * ROW_VECTORS;
    static_assert(VECTORS % THREADS == 0 && THREADS % ROW_VECTORS == 0, "whole copies, one vector column per thread");
    // Consecutive threads read consecutive 16 bytes of a row; the thread's column, the same in every row,
    // has its address and check before the rows'.
    const int n_vector = threadIdx.x % ROW_VECTORS;
    const bool column_valid = col0 + n_vector * VECTOR < num_cols;
    const T* column = src + (column_valid ? col0 + n_vector * VECTOR : 0);
    unsigned char* region = dst + n_vector / CHUNKS * REGION_BYTES;
#pragma unroll
    for (int i = 0; i < VECTORS / THREADS; ++i) {
      const int r = threadIdx.x / ROW_VECTORS + i * (THREADS / ROW_VECTORS);
      const int row = row_of(r);
      const bool valid = column_valid && row >= 0 && row < num_rows;
      copy_16_bytes(region + swizzled(r, n_vector % CHUNKS), row_element(column, valid ? row : 0, num_cols), valid);
    }
  } else {
    const T zero = from_float<T>(0.0f);
    for (int e = threadIdx.x; e < ROWS * COLS; e += THREADS) {
      const int r = e / COLS, n = e % COLS;
      const int row = row_of(r);
      const int col = col0 + n, in_region = n % REGION_COLUMNS;
      *reinterpret_cast<T*>(dst + n / REGION_COLUMNS * REGION_BYTES + swizzled(r, in_region / VECTOR) +
                            in_region % VECTOR * (int)sizeof(T)) =
          row >= 0 && row < num_rows && col < num_cols ? *row_element(src + col, row, num_cols) : zero;
    }
  }
}

// Copies the gathered rows of PAIRS (32) pairs (pair r is matrix row `row_of(r)`, -1: zeros) of fp32 columns
// col0 .. col0 + COLS - 1 (zeros at or past `num_cols`) into COLS K-major 128-byte swizzled rows at `dst`, row n
// holding column col0 + n of every pair: the operand transposed on its way in, 4 bytes a copy. A warp copies 8
// columns of 4 pairs at a time: 32-byte runs of 4 rows read, each bank written once. Each thread keeps one pair
// and one column of every 8, so its copies differ by constant offsets on both sides.
template <int PAIRS, int COLS, int THREADS, typename RowOf>
__device__ __forceinline__ void stage_k_major_transposed(const float* __restrict__ src, int num_cols, int col0,
                                                         RowOf row_of, unsigned char* dst) {
  constexpr int COLUMN_GROUP = 8;
  static_assert(PAIRS * (int)sizeof(float) == SWIZZLE_ROW_BYTES && THREADS == COLUMN_GROUP * PAIRS,
                "one 128-byte row of pairs, a thread per pair and column of a group");
  const int pair = threadIdx.x / COLUMN_GROUP, column = threadIdx.x % COLUMN_GROUP;
  const int row = row_of(pair);
  const float* source = row_element(src + col0 + column, row >= 0 ? row : 0, num_cols);
  unsigned char* target = dst + swizzled(column, pair / 4) + pair % 4 * (int)sizeof(float);
#pragma unroll
  for (int i = 0; i < COLS / COLUMN_GROUP; ++i) {
    const bool valid = row >= 0 && col0 + column + i * COLUMN_GROUP < num_cols;
    copy_4_bytes(target + i * COLUMN_GROUP * SWIZZLE_ROW_BYTES, source + i * COLUMN_GROUP, valid);
  }
}

// This block's dynamic shared memory from its first 1024-byte boundary, where the operand tiles start on
// swizzle atoms; traps when the block was launched with less than ALLOCATED bytes (a wrong size: refuse,
// loudly).
template <int ALLOCATED>
__device__ __forceinline__ unsigned char* atom_aligned(unsigned char* allocation) {
  if (dynamic_shared_bytes() < ALLOCATED) __trap();
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(allocation));
  return allocation + (SWIZZLE_ATOM_BYTES - address % SWIZZLE_ATOM_BYTES) % SWIZZLE_ATOM_BYTES;
}

// Runs `steps` steps through a STAGES-deep cp.async pipeline feeding wgmma: stage(step, buffer) issues the
// copies of `step` (in order) into buffer step % STAGES, multiply(buffer) issues one wgmma commit group over
// a staged buffer. One cp.async commit group per step, STAGES - 2 steps ahead. At step s: s's copies land
// (each thread waits for its own, fences them for the async proxy, and the barrier publishes everyone's);
// the barrier also follows every warpgroup's wait for step s - 2's wgmma, so s + STAGES - 2 may refill its
// buffer; then s's wgmma are issued, and the wait for s - 1's leaves only s's in flight: two stages are
// being multiplied, the rest copied. Nothing is left in flight on return.
template <int STAGES, typename Stage, typename Multiply>
__device__ __forceinline__ void run_wgmma_pipeline(int steps, Stage stage, Multiply multiply) {
  static_assert(STAGES >= 3, "a stage in flight, one issued, at least one being copied");
  constexpr int AHEAD = STAGES - 2;
#pragma unroll
  for (int s = 0; s < AHEAD; ++s) {
    if (s < steps) stage(s, s);
    commit_async_copies();
  }
  for (int step = 0; step < steps; ++step) {
    wait_async_copies<AHEAD - 1>();
    fence_shared_for_async_proxy();
    __syncthreads();
    const int next = step + AHEAD;
    if (next < steps) stage(next, next % STAGES);
    commit_async_copies();
    multiply(step % STAGES);
    wgmma_wait<1>();
  }
  wgmma_wait<0>();
  wait_async_copies<0>();
}

// Writes a wgrad block's accumulators to its share's partial dW_k tile in the fp32 workspace: element
// 4 j + 2 h + e of a thread is input channel 16 (warp % 4) + lane / 4 + 8 h of its warpgroup's 64, output
// channel 8 j + 2 (lane % 4) + e; rows and columns past the padded extents belong to no tile of dW_k.
template <int TILE_N>
__device__ __forceinline__ void write_wgrad_partial(const float (&acc)[TILE_N / 2], float* __restrict__ workspace,
                                                    int slot, int in_channels_padded, int out_channels_padded,
                                                    int row_base, int col_base) {
  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  const int warpgroup = threadIdx.x / WARPGROUP_THREADS;
  float* partial = workspace + (long long)slot * in_channels_padded * out_channels_padded;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row_base + warpgroup * WGMMA_M + (warp % 4) * 16 + lane / 4 + h * 8;
    if (row >= in_channels_padded) continue;
#pragma unroll
    for (int j = 0; j < TILE_N / 8; ++j) {
      const int col = col_base + j * 8 + (lane % 4) * 2;
      if (col < out_channels_padded)
        *reinterpret_cast<float2*>(partial + (long long)row * out_channels_padded + col) =
            make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
  }
}

#endif  // sm_90a

// out[i] = sum_k W_k^T x[pair_table[k, i]] for the BLOCK_M rows and BLOCK_N channels of one tile, as
// mma_conv_forward, T __half, __nv_bfloat16 or float (TF32). x [num_in, in_channels]; weight
// [kernel_volume, in_channels_padded, out_channels_padded], or with WEIGHT_TRANSPOSED (dgrad, and the TF32
// forward) stored transposed, [kernel_volume, out_channels_padded, in_channels_padded]: a K-major B; out
// [num_out, out_channels];
// `row_order` (or null: rows in order) the mask-sorted output rows. With `reverse_weight_offsets` offset k
// takes weight K-1-k (dgrad over a mirror-symmetric map, see dgrad_operands). A step stages one 128-byte
// channel chunk of one offset: every chunk of an offset before the next offset, or with CHUNK_MAJOR one
// chunk of every offset of the batch before the next chunk (faster for 256-column tiles, see
// CHUNK_MAJOR_COLUMNS in cupysparse/algorithms/tensor_core/wgmma.py). The blocks past the tiles (a dgrad
// launch's, none in a forward) sum wgrad's partials instead (forward_tile_or_wgrad_sum). The epilogue_*
// arguments: ForwardEpilogue (all null in dgrad).
template <typename T, int BLOCK_M, int BLOCK_N, int STAGES, bool WEIGHT_TRANSPOSED, bool CHUNK_MAJOR>
__global__ void __launch_bounds__(BLOCK_M / WGMMA_M * WARPGROUP_THREADS)
    wgmma_conv_forward(const T* __restrict__ x, const int* __restrict__ pair_table, const int* __restrict__ row_order,
                       const T* __restrict__ weight, T* __restrict__ out, int num_out, int kernel_volume,
                       int in_channels, int in_channels_padded, int out_channels, int out_channels_padded,
                       int vector_rows, int reverse_weight_offsets, const float* __restrict__ wgrad_workspace,
                       T* __restrict__ grad_weight, const int* __restrict__ wgrad_slot_starts,
                       int wgrad_slot_groups, const float* __restrict__ epilogue_scale,
                       const float* __restrict__ epilogue_shift, const T* __restrict__ epilogue_residual,
                       int epilogue_relu) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int THREADS = BLOCK_M / WGMMA_M * WARPGROUP_THREADS, WARPS = THREADS / WARP_SIZE;
  static_assert(BLOCK_M % WGMMA_M == 0 && BLOCK_N % 64 == 0 && BLOCK_N <= 256, "wgmma tile shapes");
  constexpr int OFFSET_BATCH = smaller(FORWARD_OFFSET_BATCH, ROW_TABLE_LIMIT / (BLOCK_M * (int)sizeof(int)));
  using Layout = WgmmaSharedLayout<BLOCK_M, BLOCK_N, STAGES, OFFSET_BATCH, WARPS>;

  extern __shared__ __align__(128) unsigned char shared_allocation[];
  unsigned char* shared = atom_aligned<Layout::ALLOCATED>(shared_allocation);
  const unsigned shared_address = static_cast<unsigned>(__cvta_generic_to_shared(shared));
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
  const int warpgroup = threadIdx.x / WARPGROUP_THREADS;

  read_tile_rows<BLOCK_M, THREADS>(row_order, row_base, num_out, out_rows);

  float acc[BLOCK_N / 2];
#pragma unroll
  for (int i = 0; i < BLOCK_N / 2; ++i) acc[i] = 0.0f;

  // Issues this warpgroup's 64 rows times the stage's weight tile: 4 wgmma (of 32 bytes of channels each),
  // one commit group. K-major operands step 32 bytes along their swizzled rows, N-major B 16 of its rows.
  static_assert(sizeof(T) == 2 || WEIGHT_TRANSPOSED, "TF32 operands are K-major only: pass the weight transposed");
  constexpr int CHANNELS = STAGE_CHANNELS<T>, K_STEP = WGMMA_K_BYTES / (int)sizeof(T);
  const auto multiply_stage = [&](int buffer) {
    const unsigned a = shared_address + buffer * Layout::STAGE_BYTES + warpgroup * WGMMA_M * SWIZZLE_ROW_BYTES;
    const unsigned b = shared_address + buffer * Layout::STAGE_BYTES + Layout::A_BYTES;
    pin_registers(acc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < SWIZZLE_ROW_BYTES / WGMMA_K_BYTES; ++k) {
      const unsigned long long a_descriptor = matrix_descriptor(a + k * WGMMA_K_BYTES, 16, SWIZZLE_ATOM_BYTES);
      if constexpr (WEIGHT_TRANSPOSED) {
        wgmma_async<0, 0>(acc, a_descriptor, matrix_descriptor(b + k * WGMMA_K_BYTES, 16, SWIZZLE_ATOM_BYTES), T());
      } else {
        const unsigned long long b_descriptor =
            matrix_descriptor(b + k * K_STEP * SWIZZLE_ROW_BYTES, Layout::B_REGION_BYTES, SWIZZLE_ATOM_BYTES);
        wgmma_async<0, 1>(acc, a_descriptor, b_descriptor, T());
      }
    }
    wgmma_commit();
  };

  const int chunks = (in_channels_padded + CHANNELS - 1) / CHANNELS;
  for (int batch_start = 0; batch_start < kernel_volume; batch_start += OFFSET_BATCH) {
    const int batch = min(OFFSET_BATCH, kernel_volume - batch_start);
    unsigned offsets_to_stage =
        read_offset_batch<BLOCK_M, THREADS>(pair_table, num_out, out_rows, batch_start, batch, in_rows, warp_masks);
    const int steps = __popc(offsets_to_stage) * chunks;

    int offset = 0, c0 = CHUNK_MAJOR ? -CHANNELS : chunks * CHANNELS;  // of the step staged last
    const unsigned batch_offsets = offsets_to_stage;
    unsigned chunk_offsets = 0;  // CHUNK_MAJOR: the offsets still to stage at channels c0
    const auto stage_next_step = [&](int buffer) {
      if constexpr (CHUNK_MAJOR) {
        if (chunk_offsets == 0) {
          chunk_offsets = batch_offsets;
          c0 += CHANNELS;
        }
        offset = __ffs(chunk_offsets) - 1;
        chunk_offsets &= chunk_offsets - 1;
      } else if (c0 == chunks * CHANNELS) {
        offset = __ffs(offsets_to_stage) - 1;
        offsets_to_stage &= offsets_to_stage - 1;
        c0 = 0;
      }
      unsigned char* a_tile = shared + buffer * Layout::STAGE_BYTES;
      const int* gathered = in_rows + offset * BLOCK_M;
      const auto gathered_row = [&](int m) -> long long { return gathered[m]; };
      if (vector_rows)
        stage_swizzled_rows<BLOCK_M, THREADS, true>(x, in_channels, c0, gathered_row, a_tile);
      else
        stage_swizzled_rows<BLOCK_M, THREADS, false>(x, in_channels, c0, gathered_row, a_tile);
      const int weight_offset =
          reverse_weight_offsets ? kernel_volume - 1 - batch_start - offset : batch_start + offset;
      const T* weight_k = weight + (long long)weight_offset * in_channels_padded * out_channels_padded;
      if constexpr (WEIGHT_TRANSPOSED) {
        // The stored weight's rows col_base.. (this call's output channels), columns c0.. (its inputs).
        const auto weight_row = [&](int r) -> long long {
          return col_base + r < out_channels_padded ? col_base + r : -1;
        };
        stage_swizzled_rows<BLOCK_N, THREADS, true>(weight_k, in_channels_padded, c0, weight_row,
                                                    a_tile + Layout::A_BYTES);
      } else {
        const auto weight_row = [&](int k) -> long long { return c0 + k; };
        stage_mn_major<N_MAJOR_ROWS, BLOCK_N, THREADS, true>(weight_k, in_channels_padded, out_channels_padded,
                                                             col_base, weight_row, a_tile + Layout::A_BYTES);
      }
      if constexpr (!CHUNK_MAJOR) c0 += CHANNELS;
    };

    run_wgmma_pipeline<STAGES>(steps, [&](int, int buffer) { stage_next_step(buffer); }, multiply_stage);
    pin_registers(acc);
  }

  // Accumulator element 4 j + 2 h + e of a thread: row 16 (warp % 4) + lane / 4 + 8 h of its warpgroup's
  // 64, column 8 j + 2 (lane % 4) + e.
  const ForwardEpilogue<T> epilogue{epilogue_scale, epilogue_shift, epilogue_residual, epilogue_relu};
  using Pair = typename PairOf<T>::type;
  const bool paired_stores = out_channels % 2 == 0 && reinterpret_cast<unsigned long long>(out) % sizeof(Pair) == 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int out_row = out_rows[warpgroup * WGMMA_M + (warp % 4) * 16 + lane / 4 + h * 8];
    if (out_row < 0) continue;
    T* out_line = out + (long long)out_row * out_channels;
#pragma unroll
    for (int j = 0; j < BLOCK_N / 8; ++j) {
      const int col = col_base + j * 8 + (lane % 4) * 2;
      const float first = acc[4 * j + 2 * h], second = acc[4 * j + 2 * h + 1];
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
#endif
}

// Weight gradient of 16-bit operands, split-K over compact pair lists as mma_conv_wgrad (the same arguments,
// shares and fp32 workspace): block (x, y, z) writes share s of offset k's partial (z names both:
// wgrad_share) dW_k[row_base .., col_base ..] = sum over the share's pairs (i, o) of x[i]^T dy[o], TILE_M
// input channels (warpgroup g the 64 from row_base + 64 g) by TILE_N output channels, 64 pairs a step. Both
// operands are staged as their gathered rows lie in memory, pair-major, which the instruction reads through its
// transpose flags (MN-major: stage_mn_major), in the forward's cp.async pipeline. (TF32 operands must be
// K-major: wgmma_conv_wgrad_tf32.)
template <typename T, int TILE_M, int TILE_N, int STAGES>
__global__ void __launch_bounds__(TILE_M / WGMMA_M * WARPGROUP_THREADS)
    wgmma_conv_wgrad(const T* __restrict__ x, const T* __restrict__ dy, const int* __restrict__ in_idx,
                     const int* __restrict__ out_idx, const long long* __restrict__ pair_offsets,
                     int in_channels, int in_channels_padded, int out_channels, int out_channels_padded,
                     const int4* __restrict__ share_table, float* __restrict__ workspace, int vector_rows) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int THREADS = TILE_M / WGMMA_M * WARPGROUP_THREADS;
  static_assert(sizeof(T) == 2, "MN-major operands are 16-bit");
  static_assert(TILE_M % WGMMA_M == 0 && TILE_N % 64 == 0 && TILE_N <= 256, "wgmma tile shapes");
  using Layout = WgmmaWgradLayout<TILE_M, TILE_N, STAGES>;
  constexpr int PAIRS = Layout::PAIRS;
  constexpr int NO_ROW_LIMIT = 0x7fffffff;  // the gathered rows end at their -1 entries

  extern __shared__ __align__(128) unsigned char shared_allocation[];
  unsigned char* shared = atom_aligned<Layout::ALLOCATED>(shared_allocation);
  const unsigned shared_address = static_cast<unsigned>(__cvta_generic_to_shared(shared));

  const WgradShare share = wgrad_share(share_table);
  if (share.k < 0) return;
  const int row_base = blockIdx.x * TILE_M, col_base = blockIdx.y * TILE_N;
  const int warpgroup = threadIdx.x / WARPGROUP_THREADS;
  const PairShare<PAIRS> pairs(pair_offsets, share.k, share.share, share.shares);

  float acc[TILE_N / 2];
#pragma unroll
  for (int i = 0; i < TILE_N / 2; ++i) acc[i] = 0.0f;
  // Each accumulator in its own register from here: a share without pairs would otherwise join the loop's
  // exit with copies of one zero register, which ptxas counts against the wgmma pipeline and serialises.
  pin_registers(acc);

  const StagedPairIndices<PAIRS, STAGES - 2, THREADS> indices{reinterpret_cast<int*>(shared + Layout::INDICES), in_idx,
                                                              out_idx, pairs};
  indices.copy_first();

  // The step's gathered rows: x's channels row_base.. and dy's col_base.. of its pairs (-1 past the share).
  const auto stage_step = [&](int step, int buffer) {
    if (step + STAGES - 2 < pairs.steps) indices.copy(step + STAGES - 2);
    const auto x_row = [&](int r) { return indices.row(step, 0, r); };
    const auto dy_row = [&](int r) { return indices.row(step, 1, r); };
    unsigned char* x_tile = shared + buffer * Layout::STAGE_BYTES;
    unsigned char* dy_tile = x_tile + Layout::X_BYTES;
    if (vector_rows) {
      stage_mn_major<PAIRS, TILE_M, THREADS, true>(x, NO_ROW_LIMIT, in_channels, row_base, x_row, x_tile);
      stage_mn_major<PAIRS, TILE_N, THREADS, true>(dy, NO_ROW_LIMIT, out_channels, col_base, dy_row, dy_tile);
    } else {
      stage_mn_major<PAIRS, TILE_M, THREADS, false>(x, NO_ROW_LIMIT, in_channels, row_base, x_row, x_tile);
      stage_mn_major<PAIRS, TILE_N, THREADS, false>(dy, NO_ROW_LIMIT, out_channels, col_base, dy_row, dy_tile);
    }
  };

  // Issues this warpgroup's 64 input channels (its region of x) times the stage's output channels: 4 wgmma
  // of K_ROWS pair rows each, one commit group.
  constexpr int K_ROWS = WGMMA_K_BYTES / (int)sizeof(T);
  const auto multiply_stage = [&](int buffer) {
    const unsigned x_tile = shared_address + buffer * Layout::STAGE_BYTES;
    pin_registers(acc);
    wgmma_fence();
#pragma unroll
    for (int step = 0; step < PAIRS / K_ROWS; ++step) {
      const unsigned a = x_tile + warpgroup * Layout::REGION_BYTES + step * K_ROWS * SWIZZLE_ROW_BYTES;
      const unsigned b = x_tile + Layout::X_BYTES + step * K_ROWS * SWIZZLE_ROW_BYTES;
      wgmma_async<1, 1>(acc, matrix_descriptor(a, Layout::REGION_BYTES, SWIZZLE_ATOM_BYTES),
                        matrix_descriptor(b, Layout::REGION_BYTES, SWIZZLE_ATOM_BYTES), T());
    }
    wgmma_commit();
  };

  run_wgmma_pipeline<STAGES>(pairs.steps, stage_step, multiply_stage);
  pin_registers(acc);

  write_wgrad_partial<TILE_N>(acc, workspace, share.slot, in_channels_padded, out_channels_padded, row_base,
                              col_base);
#endif
}

// Weight gradient of fp32 operands as TF32, the same arguments, shares and dataflow as wgmma_conv_wgrad, 32
// pairs a step (k8 wgmma: 4 a step). TF32 operands are K-major only, which pair rows are not: dy is
// transposed on its way into shared memory (stage_k_major_transposed) and read by descriptor as B; x's pair
// rows are staged as they lie and each thread reads its A fragments from them into registers. The fragments
// of consecutive steps take two register sets in turn: a step's set stays untouched until two steps later,
// when its wgmma has completed (STAGES even, so a buffer's parity is its step's).
template <int TILE_M, int TILE_N, int STAGES>
__global__ void __launch_bounds__(TILE_M / WGMMA_M * WARPGROUP_THREADS)
    wgmma_conv_wgrad_tf32(const float* __restrict__ x, const float* __restrict__ dy, const int* __restrict__ in_idx,
                          const int* __restrict__ out_idx, const long long* __restrict__ pair_offsets,
                          int in_channels, int in_channels_padded, int out_channels,
                          int out_channels_padded, const int4* __restrict__ share_table,
                          float* __restrict__ workspace, int vector_rows) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int THREADS = TILE_M / WGMMA_M * WARPGROUP_THREADS;
  static_assert(TILE_M % WGMMA_M == 0 && (TILE_N == 128 || TILE_N == 256), "wgmma tile shapes");
  static_assert(STAGES % 2 == 0, "a buffer's parity is its step's");
  using Layout = WgmmaTf32WgradLayout<TILE_M, TILE_N, STAGES>;
  constexpr int PAIRS = Layout::PAIRS, K_STEP = WGMMA_K_BYTES / (int)sizeof(float);

  extern __shared__ __align__(128) unsigned char shared_allocation[];
  unsigned char* shared = atom_aligned<Layout::ALLOCATED>(shared_allocation);
  const unsigned shared_address = static_cast<unsigned>(__cvta_generic_to_shared(shared));

  const WgradShare share = wgrad_share(share_table);
  if (share.k < 0) return;
  const int row_base = blockIdx.x * TILE_M, col_base = blockIdx.y * TILE_N;
  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  const int warpgroup = threadIdx.x / WARPGROUP_THREADS;
  const PairShare<PAIRS> pairs(pair_offsets, share.k, share.share, share.shares);

  float acc[TILE_N / 2];
#pragma unroll
  for (int i = 0; i < TILE_N / 2; ++i) acc[i] = 0.0f;
  pin_registers(acc);  // as in wgmma_conv_wgrad: each accumulator in its own register

  const StagedPairIndices<PAIRS, STAGES - 2, THREADS> indices{reinterpret_cast<int*>(shared + Layout::INDICES), in_idx,
                                                              out_idx, pairs};
  indices.copy_first();

  const auto stage_step = [&](int step, int buffer) {
    if (step + STAGES - 2 < pairs.steps) indices.copy(step + STAGES - 2);
    const auto x_row = [&](int r) { return indices.row(step, 0, r); };
    const auto dy_row = [&](int r) { return indices.row(step, 1, r); };
    unsigned char* dy_tile = shared + buffer * Layout::STAGE_BYTES;
    float* x_tile = reinterpret_cast<float*>(dy_tile + Layout::DY_BYTES);
    stage_k_major_transposed<PAIRS, TILE_N, THREADS>(dy, out_channels, col_base, dy_row, dy_tile);
    if (vector_rows)
      stage_tile<PAIRS, TILE_M, THREADS, true>(x, in_channels, row_base, x_row, x_tile, Layout::X_LD);
    else
      stage_tile<PAIRS, TILE_M, THREADS, false>(x, in_channels, row_base, x_row, x_tile, Layout::X_LD);
  };

  // The thread's A fragment elements: input channels `channel` and channel + 8 (of the tile's x columns) at
  // pairs `pair` and pair + 4 of each k8 step.
  constexpr int FRAGMENT = 4;
  const int channel = warpgroup * WGMMA_M + warp % 4 * 16 + lane / 4, pair = lane % 4;
  unsigned a_even[PAIRS / K_STEP][FRAGMENT] = {}, a_odd[PAIRS / K_STEP][FRAGMENT] = {};
  const auto multiply_stage = [&](int buffer) {
    const unsigned dy_tile = shared_address + buffer * Layout::STAGE_BYTES;
    const unsigned* x_tile =
        reinterpret_cast<const unsigned*>(shared + buffer * Layout::STAGE_BYTES + Layout::DY_BYTES);
    const auto issue = [&](unsigned (&a)[PAIRS / K_STEP][FRAGMENT]) {
      // This set's last wgmma (two steps ago) has completed: its registers are free from here, not before.
#pragma unroll
      for (int k8 = 0; k8 < PAIRS / K_STEP; ++k8)
#pragma unroll
        for (int e = 0; e < FRAGMENT; ++e) asm volatile("" : "+r"(a[k8][e])::"memory");
#pragma unroll
      for (int k8 = 0; k8 < PAIRS / K_STEP; ++k8) {
        const unsigned* at = x_tile + (k8 * K_STEP + pair) * Layout::X_LD + channel;
        a[k8][0] = at[0];
        a[k8][1] = at[8];
        a[k8][2] = at[4 * Layout::X_LD];
        a[k8][3] = at[4 * Layout::X_LD + 8];
      }
      pin_registers(acc);
      wgmma_fence();
#pragma unroll
      for (int k8 = 0; k8 < PAIRS / K_STEP; ++k8)
        wgmma_async_tf32(acc, a[k8], matrix_descriptor(dy_tile + k8 * WGMMA_K_BYTES, 16, SWIZZLE_ATOM_BYTES));
      wgmma_commit();
    };
    if (buffer % 2)
      issue(a_odd);
    else
      issue(a_even);
  };

  run_wgmma_pipeline<STAGES>(pairs.steps, stage_step, multiply_stage);
  pin_registers(acc);
#pragma unroll
  for (int k8 = 0; k8 < PAIRS / K_STEP; ++k8)
#pragma unroll
    for (int e = 0; e < FRAGMENT; ++e) asm volatile("" : "+r"(a_even[k8][e]), "+r"(a_odd[k8][e])::"memory");
  write_wgrad_partial<TILE_N>(acc, workspace, share.slot, in_channels_padded, out_channels_padded, row_base,
                              col_base);
#endif
}
