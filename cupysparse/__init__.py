"""cupysparse: spatially sparse convolution for voxel data, CUDA kernels compiled at run time."""

__version__ = "0.1.0"
