// Formats derived from a pair table [K, N_out] on demand: the per-row offset bitmask, the
// mask-sorted row order, the per-offset CSR lists and the inverse table. None of these kernels
// needs the host between launches; only the CSR lists' caller reads their length back.
#include "block_scan.cuh"
#include "launch_jobs.cuh"

// One thread per output row: bit (k % 32) of word (k / 32) is set when offset k has an input.
__global__ void offset_mask(const int* __restrict__ pair_table, int num_out, int kernel_volume,
                            unsigned int* __restrict__ mask) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= num_out) return;
  const int num_words = (kernel_volume + 31) / 32;
  for (int word = 0; word < num_words; ++word) {
    unsigned int bits = 0;
    const int last = min(32, kernel_volume - word * 32);
    for (int bit = 0; bit < last; ++bit) {
      const int k = word * 32 + bit;
      bits |= (unsigned int)(pair_table[(long long)k * num_out + row] >= 0) << bit;
    }
    mask[(long long)row * num_words + word] = bits;
  }
}

// Identity maps (a 1 x 1 convolution's) in one launch, map j of row_starts[j + 1] - row_starts[j] = N rows:
// row i its own only pair, so its pair table, mask-sorted order and CSR lists are all `rows[j]` = 0..N-1,
// and its CSR bounds {0, N} (`bounds[j]`, zeroed by the caller).
struct IdentityMaps {
  long long row_starts[MAX_JOBS + 1];
  int* rows[MAX_JOBS];
  long long* bounds[MAX_JOBS];
  int count;
};

__global__ void identity_pairs(IdentityMaps maps) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= maps.row_starts[maps.count]) return;
  const int j = job_of(maps.row_starts, maps.count, i);
  const long long row = i - maps.row_starts[j];
  if (row == 0) maps.bounds[j][1] = maps.row_starts[j + 1] - maps.row_starts[j];
  maps.rows[j][row] = (int)row;
}

// Pair tables inverted in one launch, each into its own [K, num_in] table (filled with -1 by the caller).
struct PairTableInversions {
  long long row_starts[MAX_JOBS + 1];  // the tables' output rows
  const int* pair_table[MAX_JOBS];
  int* inverse[MAX_JOBS];
  int kernel_volume[MAX_JOBS];
  int num_in[MAX_JOBS];
  int count;
};

// One thread per output row of a pair table: inverse[k, table[k, row]] = row for every pair. An input
// row and an offset determine at most one output row, so no two threads write the same entry.
__global__ void invert_pair_tables(PairTableInversions inversions) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= inversions.row_starts[inversions.count]) return;
  const int job = job_of(inversions.row_starts, inversions.count, i);
  const long long row = i - inversions.row_starts[job], num_out = inversions.row_starts[job + 1] -
                                                                   inversions.row_starts[job];
  const int* __restrict__ pair_table = inversions.pair_table[job];
  int* __restrict__ inverse = inversions.inverse[job];
  const long long num_in = inversions.num_in[job];
  for (int k = 0; k < inversions.kernel_volume[job]; ++k) {
    const int input = pair_table[k * num_out + row];
    if (input >= 0) inverse[k * num_in + input] = (int)row;
  }
}

// --- mask-sorted order: a stable LSD radix sort of the rows by their offset bitmask ---------------
// A pass orders the rows stably by one 8-bit digit (bits shift..shift+7 of mask word `word`); passes
// go from the lowest digit to the highest, so the rows end up ordered by the whole mask. A pass is
// three kernels over tiles of CHUNKS * RADIX rows: per-tile digit counts, their scan (digit-major,
// tiles in order within a digit), and the scatter, which places each tile's rows of a digit after
// the earlier tiles' ones, in input order.

constexpr int RADIX_BITS = 8;
constexpr int RADIX = 1 << RADIX_BITS;  // digits, and the threads of a block: thread d keeps digit d's counts
constexpr int RADIX_WARPS = RADIX / WARP_SIZE;

// Where a pass finds the row and key at each position of its input.
constexpr int ROWS_IN_ORDER = 0;  // the first pass: position i holds row i, its key word read from the mask
constexpr int CARRIED_KEYS = 1;   // single-word masks: the previous pass moved the keys along with the rows
constexpr int GATHERED_KEYS = 2;  // multi-word masks: the row's key word is read from the mask

template <int SOURCE>
__device__ __forceinline__ unsigned int load_key(const unsigned int* __restrict__ mask, int num_words, int word,
                                                 const unsigned int* __restrict__ keys_in,
                                                 const int* __restrict__ rows_in, long long i, int& row) {
  static_assert(SOURCE == ROWS_IN_ORDER || SOURCE == CARRIED_KEYS || SOURCE == GATHERED_KEYS, "a key source");
  row = SOURCE == ROWS_IN_ORDER ? (int)i : rows_in[i];
  return SOURCE == CARRIED_KEYS ? keys_in[i] : mask[(long long)row * num_words + word];
}

// Digit counts of one tile per block: tile_counts[d, tile], and digit_totals[d] += them.
template <int SOURCE, int CHUNKS>
__global__ void __launch_bounds__(RADIX)
    radix_count(const unsigned int* __restrict__ mask, int num_words, const unsigned int* __restrict__ keys_in,
                const int* __restrict__ rows_in, int num_rows, int word, int shift, int num_tiles,
                unsigned int* __restrict__ tile_counts, unsigned int* __restrict__ digit_totals) {
  __shared__ unsigned int histogram[RADIX];
  histogram[threadIdx.x] = 0;
  __syncthreads();
  const unsigned int lanes_below = (1u << (threadIdx.x % WARP_SIZE)) - 1;
  const long long tile_start = (long long)blockIdx.x * (CHUNKS * RADIX);
#pragma unroll
  for (int chunk = 0; chunk < CHUNKS; ++chunk) {
    const long long i = tile_start + chunk * RADIX + threadIdx.x;
    int row;
    // Rows past the end get a digit of their own, so that every lane takes part in the match.
    const unsigned int digit =
        i < num_rows ? (load_key<SOURCE>(mask, num_words, word, keys_in, rows_in, i, row) >> shift) & (RADIX - 1)
                     : RADIX;
    // One shared atomic per distinct digit of the warp: rows often share a few masks.
    const unsigned int peers = __match_any_sync(ALL_LANES, digit);
    if (digit < RADIX && (peers & lanes_below) == 0) atomicAdd(&histogram[digit], __popc(peers));
  }
  __syncthreads();
  const unsigned int count = histogram[threadIdx.x];
  tile_counts[(long long)threadIdx.x * num_tiles + blockIdx.x] = count;
  if (count) atomicAdd(&digit_totals[threadIdx.x], count);
}

// Moves each row of one tile per block (and its key, WRITE_KEYS) to its sorted position;
// tile_starts[d, tile] is where the tile's first row of digit d goes. Chunks of RADIX rows go in
// order, and within a chunk warps in order and lanes in order, so equal digits keep their order.
template <int SOURCE, bool WRITE_KEYS, int CHUNKS>
__global__ void __launch_bounds__(RADIX)
    radix_scatter(const unsigned int* __restrict__ mask, int num_words, const unsigned int* __restrict__ keys_in,
                  const int* __restrict__ rows_in, int num_rows, int word, int shift,
                  const unsigned int* __restrict__ tile_starts, int num_tiles, unsigned int* __restrict__ keys_out,
                  int* __restrict__ rows_out) {
  // For the current chunk: warp_counts[w][d] rows of digit d in warp w, the first going to warp_starts[w][d].
  __shared__ unsigned int warp_counts[RADIX_WARPS][RADIX];
  __shared__ unsigned int warp_starts[RADIX_WARPS][RADIX];
  const int warp = threadIdx.x / WARP_SIZE;
  const unsigned int lanes_below = (1u << (threadIdx.x % WARP_SIZE)) - 1;
  const long long tile_start = (long long)blockIdx.x * (CHUNKS * RADIX);
  // Every load of the tile is issued before the first barrier.
  int rows[CHUNKS];
  unsigned int keys[CHUNKS];
#pragma unroll
  for (int chunk = 0; chunk < CHUNKS; ++chunk) {
    const long long i = tile_start + chunk * RADIX + threadIdx.x;
    rows[chunk] = 0;
    keys[chunk] = 0;
    if (i < num_rows) keys[chunk] = load_key<SOURCE>(mask, num_words, word, keys_in, rows_in, i, rows[chunk]);
  }
  unsigned int next_start = tile_starts[(long long)threadIdx.x * num_tiles + blockIdx.x];  // of digit threadIdx.x
#pragma unroll
  for (int w = 0; w < RADIX_WARPS; ++w) warp_counts[w][threadIdx.x] = 0;
  __syncthreads();
#pragma unroll
  for (int chunk = 0; chunk < CHUNKS; ++chunk) {
    if (tile_start + chunk * RADIX >= num_rows) break;  // the same for the whole block
    const bool in_range = tile_start + chunk * RADIX + threadIdx.x < num_rows;
    const unsigned int digit = in_range ? (keys[chunk] >> shift) & (RADIX - 1) : RADIX;
    const unsigned int peers = __match_any_sync(ALL_LANES, digit);
    const unsigned int rank = __popc(peers & lanes_below);  // among the warp's rows of this digit
    if (in_range && rank == 0) warp_counts[warp][digit] = __popc(peers);
    __syncthreads();
    // Thread d lays out digit d's rows warp after warp and clears its counts for the next chunk,
    // which writes counts after the barrier below, and starts only after its own first barrier,
    // by which every thread has read these.
#pragma unroll
    for (int w = 0; w < RADIX_WARPS; ++w) {
      warp_starts[w][threadIdx.x] = next_start;
      next_start += warp_counts[w][threadIdx.x];
      warp_counts[w][threadIdx.x] = 0;
    }
    __syncthreads();
    if (in_range) {
      const unsigned int position = warp_starts[warp][digit] + rank;
      rows_out[position] = rows[chunk];
      if (WRITE_KEYS) keys_out[position] = keys[chunk];
    }
  }
}

// --- the mask sorts of several maps in one: each map's rows a segment, its index above the mask bits ---
// Segment s holds rows segment_starts[s] .. segment_starts[s + 1] - 1 of the concatenation; sorting the
// keys (s << key_shift) | mask orders the rows by segment, then by mask, so one radix sort serves every map.

// Several maps' masks sorted as one (`mask_sorted_orders`): map j's rows are rows [row_starts[j],
// row_starts[j + 1]) of the concatenation, its single-word mask at `mask[j]`.
struct SortSegments {
  long long row_starts[MAX_JOBS + 1];
  const unsigned int* mask[MAX_JOBS];
  unsigned int* keys;
  int* order;
  int key_shift;
  int count;
};

// One thread per row of the concatenation: its key is its map's index above its mask's bits.
__global__ void segment_keys(SortSegments segments) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= segments.row_starts[segments.count]) return;
  const int s = job_of(segments.row_starts, segments.count, i);
  segments.keys[i] = ((unsigned int)s << segments.key_shift) | segments.mask[s][i - segments.row_starts[s]];
}

// One thread per position of the sorted concatenation, which holds each map's rows in its own
// positions: a row of the concatenation becomes the row of its map.
__global__ void rows_within_segments(SortSegments segments) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= segments.row_starts[segments.count]) return;
  segments.order[i] -= (int)segments.row_starts[job_of(segments.row_starts, segments.count, i)];
}

// --- per-offset CSR lists ---------------------------------------------------------------------------
// The lists of several maps, each kernel one launch for all (job j is map j). A map's block b handles rows
// [chunk * BLOCK * ITEMS, +BLOCK * ITEMS) of offset k, b = k * num_chunks + chunk: the order in which the lists
// hold the pairs, so the scan of the per-block counts gives every block the position of its first pair.
// Thread t reads rows t, t + BLOCK, ... of its chunk (coalesced); a step is one such row per thread. Jobs start
// at block boundaries (`job_of_block`): the counting and filling launches give job j num_chunks[j] blocks
// per offset, the scan one block per offset.
struct PairLists {
  long long row_starts[MAX_JOBS + 1];
  const int* pair_table[MAX_JOBS];            // [K, num_out]
  unsigned long long* chunk_counts[MAX_JOBS];  // [K * num_chunks]: each block's pairs, then where they start
  unsigned long long* offset_totals[MAX_JOBS];  // [K], zeroed by the caller: each offset's pairs
  long long* offsets[MAX_JOBS];               // [K + 1]: where each offset's pairs start, then their number
  long long* total[MAX_JOBS];                 // the number of pairs again, beside the other maps' for one copy
  int* in_idx[MAX_JOBS];
  int* out_idx[MAX_JOBS];
  int num_out[MAX_JOBS];
  int num_chunks[MAX_JOBS];
  int count;
};

// This block's job and its block within the job; false for a block past every job's (a launch whose jobs
// have no blocks still has one).
__device__ __forceinline__ bool job_block(const PairLists& lists, int& job, int& block) {
  if ((long long)blockIdx.x * blockDim.x >= lists.row_starts[lists.count]) return false;
  job = job_of_block(lists.row_starts, lists.count);
  block = (int)(blockIdx.x - lists.row_starts[job] / blockDim.x);
  return true;
}

template <int BLOCK, int ITEMS>
__global__ void __launch_bounds__(BLOCK) count_pairs(PairLists lists) {
  __shared__ unsigned int warp_counts[BLOCK / WARP_SIZE];
  int job, block;
  if (!job_block(lists, job, block)) return;
  const int num_chunks = lists.num_chunks[job], num_out = lists.num_out[job];
  const int k = block / num_chunks;
  const long long chunk_start = (long long)(block - k * num_chunks) * (BLOCK * ITEMS);
  const int* row = lists.pair_table[job] + (long long)k * num_out;
  unsigned int count = 0;
#pragma unroll
  for (int step = 0; step < ITEMS; ++step) {
    const long long i = chunk_start + step * BLOCK + threadIdx.x;
    count += i < num_out && row[i] >= 0;
  }
  count = __reduce_add_sync(ALL_LANES, count);
  if (threadIdx.x % WARP_SIZE == 0) warp_counts[threadIdx.x / WARP_SIZE] = count;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long total = 0;
    for (int w = 0; w < BLOCK / WARP_SIZE; ++w) total += warp_counts[w];
    lists.chunk_counts[job][block] = total;
    if (total) atomicAdd(&lists.offset_totals[job][k], total);
  }
}

// One block per offset k of a map: its blocks' counts become, in place, where their pairs start, after the
// earlier offsets' pairs (their totals, which `count_pairs` accumulated, so no block scans everything).
template <int BLOCK>
__global__ void __launch_bounds__(BLOCK) scan_pair_counts(PairLists lists) {
  __shared__ unsigned long long warp_sums[BLOCK / WARP_SIZE];
  int job, k;
  if (!job_block(lists, job, k)) return;
  const int num_chunks = lists.num_chunks[job];
  const unsigned long long* totals = lists.offset_totals[job];
  unsigned long long earlier = 0;
  for (int r = threadIdx.x; r < k; r += BLOCK) earlier += totals[r];
  const unsigned long long start = block_exclusive_scan<unsigned long long, BLOCK>(earlier, warp_sums).total;
  unsigned long long* counts = lists.chunk_counts[job] + (long long)k * num_chunks;
  unsigned long long next = start;
  for (int base = 0; base < num_chunks; base += BLOCK) {
    const int j = base + threadIdx.x;
    const BlockScan<unsigned long long> scan =
        block_exclusive_scan<unsigned long long, BLOCK>(j < num_chunks ? counts[j] : 0ull, warp_sums);
    if (j < num_chunks) counts[j] = next + scan.before;
    next += scan.total;
  }
  if (threadIdx.x == 0) {
    lists.offsets[job][k] = (long long)start;
    const int kernel_volume = (int)((lists.row_starts[job + 1] - lists.row_starts[job]) / BLOCK);
    if (k == kernel_volume - 1) lists.offsets[job][kernel_volume] = *lists.total[job] = (long long)next;
  }
}

// Writes the pairs of one chunk per block from its start on, by ascending output row: a warp's pairs of one
// step follow its lower lanes' (ballot), and (step, warp) groups follow each other in that order (one block
// scan over their counts).
template <int BLOCK, int ITEMS>
__global__ void __launch_bounds__(BLOCK) fill_pairs(PairLists lists) {
  constexpr int WARPS = BLOCK / WARP_SIZE;
  static_assert(ITEMS * WARPS <= BLOCK, "the scan over (step, warp) groups takes one thread per group");
  __shared__ unsigned int group_starts[ITEMS * WARPS];  // pair counts, then starts, of (step, warp) groups
  __shared__ unsigned int warp_sums[WARPS];
  int job, block;
  if (!job_block(lists, job, block)) return;
  const int num_chunks = lists.num_chunks[job], num_out = lists.num_out[job];
  const int k = block / num_chunks;
  const int warp = threadIdx.x / WARP_SIZE;
  const unsigned int lanes_below = (1u << (threadIdx.x % WARP_SIZE)) - 1;
  const long long chunk_start = (long long)(block - k * num_chunks) * (BLOCK * ITEMS);
  const int* row = lists.pair_table[job] + (long long)k * num_out;
  const unsigned long long chunk_position = lists.chunk_counts[job][block];
  int* __restrict__ in_idx = lists.in_idx[job];
  int* __restrict__ out_idx = lists.out_idx[job];
  int inputs[ITEMS];
#pragma unroll
  for (int step = 0; step < ITEMS; ++step) {
    const long long i = chunk_start + step * BLOCK + threadIdx.x;
    inputs[step] = i < num_out ? row[i] : -1;
  }
#pragma unroll
  for (int step = 0; step < ITEMS; ++step) {
    const unsigned int valid = __ballot_sync(ALL_LANES, inputs[step] >= 0);
    if (threadIdx.x % WARP_SIZE == 0) group_starts[step * WARPS + warp] = __popc(valid);
  }
  __syncthreads();
  const bool has_group = threadIdx.x < ITEMS * WARPS;
  const unsigned int group_start =
      block_exclusive_scan<unsigned int, BLOCK>(has_group ? group_starts[threadIdx.x] : 0u, warp_sums).before;
  if (has_group) group_starts[threadIdx.x] = group_start;  // every count was read before the scan's barriers
  __syncthreads();
#pragma unroll
  for (int step = 0; step < ITEMS; ++step) {
    const unsigned int valid = __ballot_sync(ALL_LANES, inputs[step] >= 0);
    if (inputs[step] >= 0) {
      const unsigned long long position =
          chunk_position + group_starts[step * WARPS + warp] + __popc(valid & lanes_below);
      in_idx[position] = inputs[step];
      out_idx[position] = (int)(chunk_start + step * BLOCK + threadIdx.x);
    }
  }
}

// --- wgrad shares -----------------------------------------------------------------------------------
// The split-K wgrad kernels' blocks over the per-offset pair lists (CSR offsets `pair_offsets` [K + 1]):
// of `slots` = K x rounds blocks, offset k gets shares_k = 1 + P_k (slots - K) / P (none when it has no
// pairs; their sum is at most `slots`), so a share holds about P / (slots - K) pairs whatever its offset.
// With as many shares for every offset, the identity offset of a submanifold map (~2.7x the mean pairs)
// left its blocks running alone at the end.
__device__ __forceinline__ int offset_shares(const long long* __restrict__ pair_offsets, int k, int spare_slots,
                                             unsigned long long total_pairs) {
  const unsigned long long pairs = pair_offsets[k + 1] - pair_offsets[k];
  return pairs ? 1 + (int)(pairs * spare_slots / total_pairs) : 0;
}

// One thread per slot (and at least K + 1 threads). slot_starts[k] = the shares of the offsets before k: offset k's partials are the
// workspace slots slot_starts[k] .. slot_starts[k + 1] - 1, summed in that order. table[z] = {k, share,
// shares_k, slot} of the block z, k = -1 for the blocks past the last share. In round-major order, round t
// holds the shares s of every offset with floor(s rounds / shares_k) = t, offsets in order within it: the
// pair lists run by output row, so a round's blocks read about the same rows while they are in L2.
// Otherwise z is the slot (offset-major).
__global__ void wgrad_share_table(const long long* __restrict__ pair_offsets, int kernel_volume, int rounds,
                                  int round_major, int4* __restrict__ table, int* __restrict__ slot_starts) {
  const int slots = kernel_volume * rounds, spare_slots = slots - kernel_volume;
  const int slot = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned long long total_pairs = pair_offsets[kernel_volume] - pair_offsets[0];
  if (slot <= kernel_volume) {
    int start = 0;
    for (int j = 0; j < slot; ++j) start += offset_shares(pair_offsets, j, spare_slots, total_pairs);
    slot_starts[slot] = start;
  }
  if (slot >= slots) return;
  int k = 0, start = 0, shares = 0;
  for (; k < kernel_volume; ++k, start += shares) {
    shares = offset_shares(pair_offsets, k, spare_slots, total_pairs);
    if (slot < start + shares) break;
  }
  if (k == kernel_volume) {  // past the last share: the slots from the total on are as many blocks
    table[slot] = make_int4(-1, 0, 0, 0);
    return;
  }
  const int share = slot - start;
  int z = slot;
  if (round_major) {
    // The blocks before it: every offset's shares of the earlier rounds, the earlier offsets' of its round, and
    // its offset's earlier shares.
    const unsigned round = (unsigned)share * rounds / shares;
    z = share;
    for (int j = 0; j < kernel_volume; ++j)
      if (j != k)
        z += ((j < k ? round + 1 : round) * offset_shares(pair_offsets, j, spare_slots, total_pairs) + rounds - 1) /
             rounds;
  }
  table[z] = make_int4(k, share, shares, slot);
}
