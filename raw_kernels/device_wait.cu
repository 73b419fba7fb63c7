// Holds the GPU for a given time. Queued ahead of a timed call, it keeps the GPU waiting while the
// host queues the call's launches, so the events around the call time the GPU's work alone.
// %globaltimer is the GPU's clock in nanoseconds.
__device__ __forceinline__ unsigned long long global_nanoseconds() {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

__global__ void wait_nanoseconds(unsigned long long nanoseconds) {
  const unsigned long long start = global_nanoseconds();
  while (global_nanoseconds() - start < nanoseconds) {
    __nanosleep(1000);
  }
}
