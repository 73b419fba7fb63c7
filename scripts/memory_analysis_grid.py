"""The layers of the memory analysis's grid (`benchmark_memory_analysis`): each configuration, its scene,
its kernel map with every derived format, and its seeded arrays."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np

from cupysparse.algorithms import ConvProblem
from cupysparse.cuda import backend
from cupysparse.cuda.dtypes import FLOAT32, as_feature_dtype
from cupysparse.cuda.precision import IEEE, TF32, fp32_precision
from cupysparse.data.scenes import make_scene
from cupysparse.geometry.kernel_map import KernelMapCache
from cupysparse.scripts.benchmark_first_call import synchronize


@dataclass(frozen=True)
class Configuration:
    """One layer of the grid; its fields are the configuration key of every output file."""

    scene: str
    batch_size: int
    num_voxels: int
    in_channels: int
    out_channels: int
    kernel_size: int
    stride: int
    dtype: str  # short name: fp16, bf16, fp32, tf32 (fp32 features, TF32 products), fp64

    @property
    def feature_dtype(self) -> np.dtype:
        return FLOAT32 if self.dtype == TF32 else as_feature_dtype(self.dtype)

    @property
    def fp32_precision(self) -> str:
        return TF32 if self.dtype == TF32 else IEEE

    def sizes(self) -> tuple[int, ...]:
        return (self.num_voxels, self.in_channels, self.out_channels, self.kernel_size, self.feature_dtype.itemsize)

    def at_least_as_large_as(self, other: Configuration) -> bool:
        """Whether this layer needs at least the memory of `other`: same scene, batch and stride,
        and no size smaller (voxels, channels, kernel size, dtype width)."""
        same_kind = (self.scene, self.batch_size, self.stride) == (other.scene, other.batch_size, other.stride)
        return same_kind and all(mine >= theirs for mine, theirs in zip(self.sizes(), other.sizes()))

    def label(self) -> str:
        return (f"{self.num_voxels:>9,} vox {self.in_channels:>3}->{self.out_channels:<3} k{self.kernel_size} "
                f"s{self.stride} {self.dtype}")


def configurations(args) -> list[Configuration]:
    """The grid in run order: voxel counts ascending and outermost (one scene at a time), then
    kernel size and stride (one kernel map at a time), channels, dtype; small before large, so an
    out-of-memory frontier is found before the layers beyond it."""
    return [
        Configuration(args.scene, args.batch_size, count, c_in, c_out, kernel_size, stride, dtype)
        for count in sorted(args.num_voxels)
        for kernel_size in args.kernel_sizes
        for stride in args.strides
        for c_in, c_out in args.channels
        for dtype in args.dtypes
    ]


def sampled_together(grid: list[Configuration], dtypes_together: bool) -> list[list[Configuration]]:
    """The grid cut into groups whose measurements take their samples in turns: the dtypes of one
    shape when `dtypes_together` (their ratios then see the same clocks), else one layer each (a
    memory cap is checked one layer at a time, so no other dtype's arrays may be resident)."""
    groups: list[list[Configuration]] = []
    for config in grid:
        previous = groups[-1][-1] if groups else None
        if dtypes_together and previous is not None and replace(previous, dtype=config.dtype) == config:
            groups[-1].append(config)
        else:
            groups.append([config])
    return groups


def scene_coordinates(kind: str, num_voxels: int, batch_size: int) -> np.ndarray:
    """int32 `[N, 4]`, N ≤ num_voxels: `batch_size` scenes of `kind` (seeds 0, 1, …), batch index first."""
    per_item = num_voxels // batch_size
    items = [make_scene(kind, per_item, seed=seed).voxel_coordinates()[:per_item] for seed in range(batch_size)]
    batch_index = np.repeat(np.arange(batch_size, dtype=np.int32), [len(voxels) for voxels in items])
    return np.concatenate([batch_index[:, None], np.concatenate(items)], axis=1)


def kernel_map_bytes(kernel_map) -> int:
    """The bytes of a map with every derived format, in both directions, as built."""
    total = 0
    for direction in (kernel_map, kernel_map.reversed()):
        csr = direction.csr()
        arrays = (direction.pair_table, direction.offset_mask(), direction.mask_sorted_order(), csr.in_idx,
                  csr.out_idx, csr.offsets)
        total += sum(int(array.nbytes) for array in arrays)
    return total


@dataclass
class MapCase:
    """The kernel map of one (voxel count, kernel size, stride), its build time and size."""

    kernel_map: object
    build_ms: float
    pairs: int
    nbytes: int
    max_offset_pairs: int  # the pairs of the busiest offset: what explicit GEMM gathers at once


def build_map(coordinates, kernel_size: int, stride: int, device: str, warmup: bool) -> MapCase:
    """Build the map (index, pairs, every derived format) from scratch, timed by the host clock up to
    the synchronised result, after one untimed build when `warmup` (kernel loading)."""

    def build():
        result = KernelMapCache(coordinates, (1, 1, 1)).kernel_map((1, 1, 1), kernel_size, stride).kernel_map
        built = result.derive_formats()
        synchronize(device)
        return built

    if warmup:
        build()
    begin = time.perf_counter()
    kernel_map = build()
    build_ms = (time.perf_counter() - begin) * 1e3
    csr_bounds = backend.to_numpy(kernel_map.csr().offsets)
    return MapCase(kernel_map, build_ms, kernel_map.num_pairs, kernel_map_bytes(kernel_map),
                   int(np.diff(csr_bounds).max(initial=0)))


class LayerArrays:
    """Seeded random features `[N_in, C_in]`, weight `[K, C_in, C_out]` and output gradient
    `[N_out, C_out]` of one configuration on `device`."""

    def __init__(self, config: Configuration, case: MapCase, device: str):
        kernel_map = case.kernel_map
        dtype = config.feature_dtype
        rng = np.random.default_rng([config.num_voxels, config.in_channels, config.out_channels, config.kernel_size])
        scale = 1.0 / math.sqrt(config.in_channels * kernel_map.kernel_volume)  # keeps fp16 outputs O(1)
        self.host = {
            "features": rng.standard_normal((kernel_map.num_in, config.in_channels), np.float32).astype(dtype),
            "weight": (rng.standard_normal((kernel_map.kernel_volume, config.in_channels, config.out_channels),
                                           np.float32) * scale).astype(dtype),
            "grad_output": rng.standard_normal((kernel_map.num_out, config.out_channels), np.float32).astype(dtype),
        }
        self.features, self.weight, self.grad_output = (
            backend.to_device(self.host[name], device) for name in ("features", "weight", "grad_output"))
        self.kernel_map = kernel_map
        with fp32_precision(config.fp32_precision):  # what the tuner is told: TF32 products or exact fp32
            self.problem = ConvProblem.of(self.features, kernel_map, config.out_channels)
