"""The CUDA layer: the array backend (NumPy or CuPy), NVRTC compilation and prepared launches, device
queries and timing, feature dtypes, fp32 precision and out-of-memory errors. Everything above it
launches kernels through `compile`; nothing else compiles CUDA."""
