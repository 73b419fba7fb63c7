"""The tensor-core algorithms: one dataflow (output-stationary forward and dgrad over mask-sorted rows,
split-K wgrad summed in a fixed order) on three generations of instructions: `wmma` (nvcuda::wmma,
sm_70+), `mma` (mma.sync and ldmatrix, sm_80+, TF32 too) and `wgmma` (Hopper's warpgroup MMA,
sm_90a). What they share lives in `common`."""

# Imported, so registered, oldest instructions first: the order `registered` lists them in.
from cupysparse.algorithms.tensor_core import wmma, mma, wgmma  # noqa: F401 (registration)
