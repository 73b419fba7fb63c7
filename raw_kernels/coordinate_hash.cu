// The GPU coordinate index: hash tables of coordinates, one query kernel that writes pair tables
// [K, N_out] (input row or -1) for all kernel offsets at once, several tables a launch, the first-occurrence
// marking behind `unique_coordinates`, and the outputs a padded convolution reaches.
#include "block_scan.cuh"
#include "coordinate_key.cuh"
#include "launch_jobs.cuh"

// Per-axis geometry of a query, passed by value (D <= 4).
struct QueryGeometry {
  int kernel_size[4];
  int out_scale[4];  // input candidate = (out * out_scale + sign * dilation * offset) / divisor
  int dilation[4];
  int divisor[4];
  int shift[4];  // added to out * out_scale: where a padded map's taps start
  int sign;
};

// Hash tables of several coordinate sets, filled in one launch: each set's rows keyed into its own slots.
struct CoordinateSets {
  long long row_starts[MAX_JOBS + 1];
  const int* coords[MAX_JOBS];
  ulonglong2* slots[MAX_JOBS];
  key_t64 capacity_mask[MAX_JOBS];
  int count;
};

template <int D>
__global__ void insert_coordinate_sets(CoordinateSets sets) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= sets.row_starts[sets.count]) return;
  const int set = job_of(sets.row_starts, sets.count, i);
  const long long row = i - sets.row_starts[set];
  claim_slot(sets.slots[set], sets.capacity_mask[set], row_key<D>(sets.coords[set], row))->y = row;
}

// Per-axis divisor of `unique_coordinates`: rows are floor(coordinate / divisor) (1: unchanged).
struct Divisor {
  int value[4];
};

// Row `row` of coordinates [N, 1 + D] divided (floor) by `divisor`, and its key.
template <int D>
__device__ __forceinline__ key_t64 divided_row(const int* __restrict__ coords, long long row, const Divisor& divisor,
                                               int* divided) {
  const int* c = coords + row * (D + 1);
  divided[0] = c[0];
  long long spatial[D];
#pragma unroll
  for (int axis = 0; axis < D; ++axis) {
    const int value = c[1 + axis], by = divisor.value[axis];
    divided[1 + axis] = value >= 0 ? value / by : -((-value + by - 1) / by);
    spatial[axis] = divided[1 + axis];
  }
  key_t64 key;
  pack_key<D>(divided[0], spatial, &key);  // dividing never leaves the key range
  return key;
}

// The distinct rows of floor(coords / divisor) for several divisors in one pass each: job j divides the N rows
// of `coords` by divisor[j], keys into its own slots, and marks its rows at is_first[row_starts[j] + row]. Jobs
// start at block boundaries (row_starts), so each block belongs to one job: it counts its marks into
// block_counts[block] and adds them to level_totals[job], which `scan_counts_by_row` turns into where each
// block's rows go in `out`, job after job.
struct Downsampling {
  long long row_starts[MAX_JOBS + 1];
  Divisor divisor[MAX_JOBS];
  ulonglong2* slots[MAX_JOBS];
  const int* coords;
  key_t64 capacity_mask;
  bool* is_first;
  unsigned int* block_counts;
  unsigned int* level_totals;
  int* out;
  long long num_rows;
  int count;
};

// Rows may repeat: each key keeps the smallest row that has it, so the result is deterministic.
template <int D>
__global__ void insert_smallest_rows(Downsampling jobs) {
  const int job = job_of_block(jobs.row_starts, jobs.count);
  const long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x - jobs.row_starts[job];
  if (row >= jobs.num_rows) return;
  int divided[D + 1];
  const key_t64 key = divided_row<D>(jobs.coords, row, jobs.divisor[job], divided);
  atomicMin(&claim_slot(jobs.slots[job], jobs.capacity_mask, key)->y, (key_t64)row);
}

template <int D>
__global__ void mark_first_occurrences(Downsampling jobs) {
  const int job = job_of_block(jobs.row_starts, jobs.count);
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x, row = i - jobs.row_starts[job];
  bool first = false;
  if (row < jobs.num_rows) {
    int divided[D + 1];
    const key_t64 key = divided_row<D>(jobs.coords, row, jobs.divisor[job], divided);
    first = find_key(jobs.slots[job], jobs.capacity_mask, key) == row;
  }
  jobs.is_first[i] = first;
  const int marked = __syncthreads_count(first);
  if (threadIdx.x == 0) {
    jobs.block_counts[blockIdx.x] = (unsigned int)marked;
    atomicAdd(jobs.level_totals + job, (unsigned int)marked);
  }
}

// Compaction of the first occurrences, in row order: block b's go from block_counts[b] on (scanned by
// `scan_counts_by_row`), in thread order within the block. Blocks of whole warps, at most 32 of them.
template <int D>
__global__ void write_first_rows(Downsampling jobs) {
  __shared__ unsigned int warp_marks[WARP_SIZE];
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const bool first = jobs.is_first[i];
  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  const unsigned int marks = __ballot_sync(ALL_LANES, first);
  if (lane == 0) warp_marks[warp] = __popc(marks);
  __syncthreads();
  if (!first) return;
  long long position = jobs.block_counts[blockIdx.x] + __popc(marks & ((1u << lane) - 1u));
  for (int w = 0; w < warp; ++w) position += warp_marks[w];
  const int job = job_of_block(jobs.row_starts, jobs.count);
  int divided[D + 1];
  divided_row<D>(jobs.coords, i - jobs.row_starts[job], jobs.divisor[job], divided);
#pragma unroll
  for (int column = 0; column <= D; ++column) jobs.out[position * (D + 1) + column] = divided[column];
}

// Pair-table queries answered in one launch, each over its own output coordinates and hash table, each
// starting at a block boundary (`job_of_block`).
struct PairTableQueries {
  long long row_starts[MAX_JOBS + 1];
  int num_out[MAX_JOBS];
  const int* out_coords[MAX_JOBS];
  const ulonglong2* slots[MAX_JOBS];
  key_t64 capacity_mask[MAX_JOBS];
  int* pair_table[MAX_JOBS];
  unsigned int* offset_mask[MAX_JOBS];
  QueryGeometry geometry[MAX_JOBS];
  int kernel_volume[MAX_JOBS];
  int same_coordinates[MAX_JOBS];
  int count;
};

// One thread per output row, looping over the offsets: the row's coordinates are read once and
// each offset's writes are coalesced across the warp. The row's offset bitmask (bit k % 32 of
// word k / 32 set when offset k has an input) costs nothing extra here, so it is written too.
// When the output coordinates are the indexed ones (`same_coordinates`), the zero offset is the
// row itself and needs no probe.
template <int D>
__global__ void query_pair_tables(PairTableQueries queries) {
  const int q = job_of_block(queries.row_starts, queries.count);
  const int row = (int)((long long)blockIdx.x * blockDim.x - queries.row_starts[q]) + threadIdx.x;
  const int num_out = queries.num_out[q];
  if (row >= num_out) return;
  const int kernel_volume = queries.kernel_volume[q];
  const QueryGeometry& geometry = queries.geometry[q];
  const ulonglong2* __restrict__ slots = queries.slots[q];
  const key_t64 capacity_mask = queries.capacity_mask[q];
  const bool same_coordinates = queries.same_coordinates[q] != 0;
  int* __restrict__ pair_table = queries.pair_table[q];
  unsigned int* __restrict__ offset_mask = queries.offset_mask[q];
  const int* c = queries.out_coords[q] + (long long)row * (D + 1);
  const int batch = c[0];
  long long base[D];
  int index[D];  // per-axis position inside the kernel; the last axis runs fastest
#pragma unroll
  for (int axis = 0; axis < D; ++axis) {
    base[axis] = (long long)c[1 + axis] * geometry.out_scale[axis] + geometry.shift[axis];
    index[axis] = 0;
  }
  const int num_words = (kernel_volume + 31) / 32;
  unsigned int mask_word = 0;
  for (int k = 0; k < kernel_volume; ++k) {
    long long candidate[D];
    bool valid = true;
    bool zero_offset = true;
#pragma unroll
    for (int axis = 0; axis < D; ++axis) {
      const int offset = index[axis] - (geometry.kernel_size[axis] - 1) / 2;
      zero_offset = zero_offset && offset == 0;
      // In 64 bits: dilation * offset overflows int32 for dilations past 2^30 (any int32 is allowed).
      const long long shifted = base[axis] + (long long)geometry.sign * geometry.dilation[axis] * offset;
      const int divisor = geometry.divisor[axis];
      candidate[axis] = shifted;
      if (divisor != 1) {  // transposed queries only: 64-bit division is costly
        // Floor division, so the divisibility test also holds for negative values.
        const long long quotient = shifted >= 0 ? shifted / divisor : -((-shifted + divisor - 1) / divisor);
        valid = valid && quotient * divisor == shifted;
        candidate[axis] = quotient;
      }
    }
    key_t64 key;
    int found = -1;
    if (same_coordinates && zero_offset) {
      found = row;
    } else if (valid && pack_key<D>(batch, candidate, &key)) {
      found = find_key(slots, capacity_mask, key);
    }
    pair_table[(long long)k * num_out + row] = found;
    mask_word |= (unsigned int)(found >= 0) << (k % 32);
    if (k % 32 == 31 || k == kernel_volume - 1) {
      offset_mask[(long long)row * num_words + k / 32] = mask_word;
      mask_word = 0;
    }
#pragma unroll
    for (int axis = D - 1; axis >= 0; --axis) {
      if (++index[axis] < geometry.kernel_size[axis]) break;
      index[axis] = 0;
    }
  }
}

// A padded convolution's reach (`cupysparse.geometry.padding`): input x and tap j (per axis, 0..K-1)
// reach o = (x + padding - dilation * j) / stride where the division is exact, or, transposed,
// o = x * stride - padding + dilation * j; only o in [0, out_shape) is kept where out_shape > 0.
struct ReachGeometry {
  int kernel_size[4];
  int stride[4];
  int dilation[4];
  int padding[4];
  int out_shape[4];  // 0: no spatial shape, every output reached is kept
  int transposed;
};

// Candidate `candidate` = input row * kernel_volume + tap (the last axis' tap fastest): whether it reaches
// an output, that output's row (batch, o) and key. An output past the key range reaches nothing and
// sets *out_of_range.
template <int D>
__device__ __forceinline__ bool reached_output(const int* __restrict__ coords, long long candidate, int kernel_volume,
                                               const ReachGeometry& geometry, int* reached, key_t64* key,
                                               unsigned int* __restrict__ out_of_range) {
  const long long row = candidate / kernel_volume;
  int tap = (int)(candidate - row * kernel_volume);
  const int* c = coords + row * (D + 1);
  long long output[D];
#pragma unroll
  for (int axis = D - 1; axis >= 0; --axis) {
    const int size = geometry.kernel_size[axis];
    const long long j = tap % size;
    tap /= size;
    const long long x = c[1 + axis];
    const long long stride = geometry.stride[axis], reach = geometry.dilation[axis] * j - geometry.padding[axis];
    long long o;
    if (geometry.transposed) {
      o = x * stride + reach;
    } else {
      const long long shifted = x - reach;
      o = shifted >= 0 ? shifted / stride : -((-shifted + stride - 1) / stride);  // floor division
      if (o * stride != shifted) return false;
    }
    const int bound = geometry.out_shape[axis];
    if (bound > 0 && (o < 0 || o >= bound)) return false;
    output[axis] = o;
  }
  if (!pack_key<D>(c[0], output, key)) {
    atomicOr(out_of_range, 1u);
    return false;
  }
  reached[0] = c[0];
#pragma unroll
  for (int axis = 0; axis < D; ++axis) reached[1 + axis] = (int)output[axis];  // inside the key range
  return true;
}

// Each output reached keeps its smallest candidate: the order of first occurrence, deterministic.
template <int D>
__global__ void insert_reached(const int* __restrict__ coords, long long num_candidates, int kernel_volume,
                               ReachGeometry geometry, ulonglong2* __restrict__ slots, key_t64 capacity_mask,
                               unsigned int* __restrict__ out_of_range) {
  const long long candidate = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (candidate >= num_candidates) return;
  int reached[D + 1];
  key_t64 key;
  if (reached_output<D>(coords, candidate, kernel_volume, geometry, reached, &key, out_of_range))
    atomicMin(&claim_slot(slots, capacity_mask, key)->y, (key_t64)candidate);
}

// Marks each output's smallest candidate, and counts each block's marks into block_counts[block] for the
// compaction's scan (`scan_counts_by_row`).
template <int D>
__global__ void mark_first_reached(const int* __restrict__ coords, long long num_candidates, int kernel_volume,
                                   ReachGeometry geometry, const ulonglong2* __restrict__ slots,
                                   key_t64 capacity_mask, unsigned int* __restrict__ out_of_range,
                                   bool* __restrict__ is_first, unsigned int* __restrict__ block_counts) {
  const long long candidate = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  bool first = false;
  if (candidate < num_candidates) {
    int reached[D + 1];
    key_t64 key;
    first = reached_output<D>(coords, candidate, kernel_volume, geometry, reached, &key, out_of_range) &&
            find_key(slots, capacity_mask, key) == candidate;
    is_first[candidate] = first;
  }
  const int marked = __syncthreads_count(first);
  if (threadIdx.x == 0) block_counts[blockIdx.x] = (unsigned int)marked;
}

// Compaction in candidate order: block b's marked candidates go from block_starts[b] on (its count scanned by
// `scan_counts_by_row`), in thread order within the block. Blocks of whole warps, at most 32 of them.
template <int D>
__global__ void write_first_reached(const int* __restrict__ coords, long long num_candidates, int kernel_volume,
                                    ReachGeometry geometry, unsigned int* __restrict__ out_of_range,
                                    const bool* __restrict__ is_first, const unsigned int* __restrict__ block_starts,
                                    int* __restrict__ out) {
  __shared__ unsigned int warp_marks[WARP_SIZE];
  const long long candidate = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const bool first = candidate < num_candidates && is_first[candidate];
  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  const unsigned int marks = __ballot_sync(ALL_LANES, first);
  if (lane == 0) warp_marks[warp] = __popc(marks);
  __syncthreads();
  if (!first) return;
  long long i = block_starts[blockIdx.x] + __popc(marks & ((1u << lane) - 1u));
  for (int w = 0; w < warp; ++w) i += warp_marks[w];
  int reached[D + 1];
  key_t64 key;
  reached_output<D>(coords, candidate, kernel_volume, geometry, reached, &key, out_of_range);
#pragma unroll
  for (int column = 0; column <= D; ++column) out[i * (D + 1) + column] = reached[column];
}
