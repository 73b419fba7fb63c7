// Formats derived from a pair table [K, N_out] on demand.

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
