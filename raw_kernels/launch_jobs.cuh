// Several jobs of one kind in one launch, one thread per row of all of them: job j has the launch's
// rows [row_starts[j], row_starts[j + 1]). A launch's description of its jobs travels by value as its
// one argument, so a batch needs no upload; cupysparse/cuda/compile.py mirrors MAX_JOBS.
#pragma once

constexpr int MAX_JOBS = 16;

// The job holding row `row` of the launch (`count` jobs, a handful: a scan costs less than a search).
__device__ __forceinline__ int job_of(const long long* row_starts, int count, long long row) {
  int job = 0;
  while (job + 1 < count && row >= row_starts[job + 1]) ++job;
  return job;
}
