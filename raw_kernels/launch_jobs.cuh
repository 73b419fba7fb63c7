// Several jobs of one kind in one launch, one thread per row of all of them: job j has the launch's
// rows [row_starts[j], row_starts[j + 1]) (where jobs start at block boundaries, the first of them: see
// `job_of_block`). A launch's description of its jobs travels by value as its one argument, so a batch
// needs no upload; cupysparse/cuda/compile.py mirrors MAX_JOBS.
#pragma once

constexpr int MAX_JOBS = 16;

// The job holding row `row` of the launch (`count` jobs, a handful: a scan costs less than a search).
__device__ __forceinline__ int job_of(const long long* row_starts, int count, long long row) {
  int job = 0;
  while (job + 1 < count && row >= row_starts[job + 1]) ++job;
  return job;
}

// The job of this block, where the launch starts each job at a block boundary (`launch_batches`'
// `block_aligned`; the job's own row count then bounds its last block). The same for every thread of the
// block, so the compiler keeps the job's values in the block's uniform registers: indexed by a per-thread job,
// each takes a register of every thread (a pair-table query took 78 registers a thread where it takes 38-48,
// and ran about a quarter longer for it).
__device__ __forceinline__ int job_of_block(const long long* row_starts, int count) {
  return job_of(row_starts, count, (long long)blockIdx.x * blockDim.x);
}
