// Rows of `channels` values copied into rows of `width` values, zeros past `channels`: the tensor-core
// kernels read an operand whose rows are not whole 16-byte vectors element by element, outside their
// cp.async pipelines, so such an operand (a stem's 3 or 4 input channels, a classifier's 20 output
// channels) is copied into rows of whole vectors first. The values are copied as bits of their size
// (B: unsigned short for fp16 and bf16, unsigned int for fp32), whose zero is 0.0 in every dtype.
//
// A thread writes one element of the padded rows; threads of a warp write consecutive elements.

template <typename B>
__global__ void pad_rows(const B* __restrict__ source, long long num_rows, int channels, int width,
                         B* __restrict__ padded) {
  const long long elements = num_rows * width;
  for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < elements;
       e += (long long)gridDim.x * blockDim.x) {
    const long long row = e / width;
    const int col = (int)(e - row * width);
    padded[e] = col < channels ? source[row * channels + col] : B(0);
  }
}
