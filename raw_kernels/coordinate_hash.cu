// The GPU coordinate index: a hash table of input coordinates and one query kernel that, for all
// kernel offsets at once, writes the pair table [K, N_out] (input row or -1).
#include "coordinate_key.cuh"

// Per-axis geometry of a query, passed by value (D <= 4).
struct QueryGeometry {
  int kernel_size[4];
  int out_scale[4];  // input candidate = (out * out_scale + sign * dilation * offset) / divisor
  int dilation[4];
  int divisor[4];
  int sign;
};

template <int D>
__global__ void insert_coordinates(const int* __restrict__ coords, int num_coords, key_t64* __restrict__ keys,
                                   int* __restrict__ values, key_t64 capacity_mask) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= num_coords) return;
  const int* c = coords + (long long)row * (D + 1);
  long long spatial[D];
#pragma unroll
  for (int axis = 0; axis < D; ++axis) spatial[axis] = c[1 + axis];
  key_t64 key;
  pack_key<D>(c[0], spatial, &key);  // validated on the host: always fits
  key_t64 slot = mix_key(key) & capacity_mask;
  while (true) {
    const key_t64 previous = atomicCAS(keys + slot, CUPYSPARSE_EMPTY_KEY, key);
    if (previous == CUPYSPARSE_EMPTY_KEY || previous == key) {
      values[slot] = row;
      return;
    }
    slot = (slot + 1) & capacity_mask;
  }
}

// One thread per (offset, output row): pair_table[k * num_out + row] = input row or -1.
template <int D>
__global__ void query_pair_table(const int* __restrict__ out_coords, int num_out, int kernel_volume,
                                 QueryGeometry geometry, const key_t64* __restrict__ keys,
                                 const int* __restrict__ values, key_t64 capacity_mask,
                                 int* __restrict__ pair_table) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  const int k = blockIdx.y;
  if (row >= num_out) return;
  const int* c = out_coords + (long long)row * (D + 1);
  long long candidate[D];
  bool valid = true;
  int remaining = k;
#pragma unroll
  for (int axis = D - 1; axis >= 0; --axis) {  // offset k in lexicographic order, last axis fastest
    const int size = geometry.kernel_size[axis];
    const int offset = remaining % size - (size - 1) / 2;
    remaining /= size;
    const long long shifted =
        (long long)c[1 + axis] * geometry.out_scale[axis] + geometry.sign * geometry.dilation[axis] * offset;
    const int divisor = geometry.divisor[axis];
    // Floor-correct divisibility test for negative values too.
    const long long quotient = shifted >= 0 ? shifted / divisor : -((-shifted + divisor - 1) / divisor);
    valid = valid && quotient * divisor == shifted;
    candidate[axis] = quotient;
  }
  key_t64 key;
  int found = -1;
  if (valid && pack_key<D>(c[0], candidate, &key)) found = find_key(keys, values, capacity_mask, key);
  pair_table[(long long)k * num_out + row] = found;
}
