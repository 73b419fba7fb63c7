// Packing of int coordinates (batch, c1..cD) into 64-bit keys, and the hash table slot layout.
// Must match cupysparse/coords.py: batch in the high bits, each coordinate biased by
// 2^(bits-1) into a `bits`-wide field, the first spatial axis most significant.
#pragma once

typedef unsigned long long key_t64;

// A slot holds {key, value} so one 16-byte load reads both; both start as all ones.
#define CUPYSPARSE_EMPTY 0xFFFFFFFFFFFFFFFFull

template <int D> struct KeyBits;
template <> struct KeyBits<2> { static constexpr int value = 24; };
template <> struct KeyBits<3> { static constexpr int value = 18; };
template <> struct KeyBits<4> { static constexpr int value = 14; };

// Packs a batch index and D coordinates; returns false when a coordinate does not fit.
template <int D>
__device__ __forceinline__ bool pack_key(int batch, const long long* coord, key_t64* key) {
  constexpr int bits = KeyBits<D>::value;
  constexpr long long bias = 1ll << (bits - 1);
  key_t64 packed = (key_t64)batch << (D * bits);
#pragma unroll
  for (int axis = 0; axis < D; ++axis) {
    const long long biased = coord[axis] + bias;
    if (biased < 0 || biased >= 2 * bias) return false;
    packed |= (key_t64)biased << ((D - 1 - axis) * bits);
  }
  *key = packed;
  return true;
}

// The key of row `row` of int32 coordinates [N, 1 + D] (validated: always fits).
template <int D>
__device__ __forceinline__ key_t64 row_key(const int* __restrict__ coords, long long row) {
  const int* c = coords + row * (D + 1);
  long long spatial[D];
#pragma unroll
  for (int axis = 0; axis < D; ++axis) spatial[axis] = c[1 + axis];
  key_t64 key;
  pack_key<D>(c[0], spatial, &key);
  return key;
}

// MurmurHash3's 64-bit finaliser: neighbouring voxels land in unrelated slots.
__device__ __forceinline__ key_t64 mix_key(key_t64 key) {
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdull;
  key ^= key >> 33;
  key *= 0xc4ceb9fe1a85ec53ull;
  key ^= key >> 33;
  return key;
}

// Claims the slot of `key` (linear probing, power-of-two capacity) and returns it.
__device__ __forceinline__ ulonglong2* claim_slot(ulonglong2* slots, key_t64 capacity_mask, key_t64 key) {
  key_t64 slot = mix_key(key) & capacity_mask;
  while (true) {
    const key_t64 previous = atomicCAS(&slots[slot].x, CUPYSPARSE_EMPTY, key);
    if (previous == CUPYSPARSE_EMPTY || previous == key) return slots + slot;
    slot = (slot + 1) & capacity_mask;
  }
}

// The value stored with `key`, or -1 when the key is absent.
__device__ __forceinline__ int find_key(const ulonglong2* __restrict__ slots, key_t64 capacity_mask, key_t64 key) {
  key_t64 slot = mix_key(key) & capacity_mask;
  while (true) {
    const ulonglong2 stored = slots[slot];
    if (stored.x == key) return (int)stored.y;
    if (stored.x == CUPYSPARSE_EMPTY) return -1;
    slot = (slot + 1) & capacity_mask;
  }
}
