"""`cupysparse-demo`: voxelize a synthetic scene and build the kernel maps of a sparse U-Net.

Runs on the GPU when there is one (CuPy), on the CPU otherwise (NumPy), and prints each map it
built (inputs, outputs, pairs) with the time it took. The maps follow a MinkUNet-style pass: a
submanifold 3³ map and a strided 2³ map per encoder level, then the decoder's transposed maps,
which invert the encoder's strided maps instead of searching again.
"""

from __future__ import annotations

import argparse
import sys
import time

from . import backend
from .scenes import make_scene
from .sparse_tensor import SparseTensor


class _Stopwatch:
    """Wall-clock milliseconds of a block, with the GPU synchronised on both sides."""

    def __init__(self, device: str):
        self._synchronize = backend.cupy_module().cuda.Device().synchronize if device == "cuda" else lambda: None

    def __call__(self, fn):
        self._synchronize()
        start = time.perf_counter()
        result = fn()
        self._synchronize()
        return result, (time.perf_counter() - start) * 1e3


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="cupysparse-demo", description=__doc__.splitlines()[0].split(": ", 1)[1])
    parser.add_argument("--scene", choices=("indoor", "outdoor"), default="indoor")
    parser.add_argument("--num-voxels", type=int, default=None,
                        help="target voxel count (default 200000 on a GPU, 50000 on the CPU)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--levels", type=int, default=4, help="encoder levels (strided 2x downsamplings)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = backend.default_device()
    if args.num_voxels is None:
        args.num_voxels = 200_000 if args.device == "cuda" else 50_000
    if args.num_voxels < 1 or args.levels < 1:
        parser.error("--num-voxels and --levels must be positive")
    return args


def _warm_up_kernels(device: str, timed) -> float:
    """Compile (or load from the kernel caches) the kernels used below, on a tiny scene."""
    import numpy as np

    points = backend.to_device(np.array([[0.0, 0.0, 0.0], [0.5, 0.0, 0.0], [2.0, 0.0, 0.0]], np.float32), device)

    def run_once():
        tiny = SparseTensor.from_points(points, 1.0)
        tiny.kernel_map(3).kernel_map.mask_sorted_order()
        down = tiny.kernel_map(2, stride=2)
        down.kernel_map.csr()
        _features_of_ones(down).kernel_map(2, stride=2, transposed=True).kernel_map.mask_sorted_order()

    return timed(run_once)[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    timed = _Stopwatch(args.device)
    print(f"cupysparse demo on {backend.describe_device(args.device)}")

    scene, scene_ms = timed(lambda: make_scene(args.scene, args.num_voxels, seed=args.seed))
    print(f"scene     {scene.name}: {len(scene.points):,} points, {len(scene.class_names)} classes "
          f"({scene_ms:.0f} ms, NumPy)")
    if args.device == "cuda":
        print(f"kernels   compiled or loaded from the kernel cache in {_warm_up_kernels(args.device, timed):.0f} ms")
    points = backend.to_device(scene.points, args.device)
    tensor, voxelize_ms = timed(lambda: SparseTensor.from_points(points, scene.voxel_size))
    print(f"voxelize  {len(tensor):,} voxels of {scene.voxel_size * 100:g} cm ({voxelize_ms:.1f} ms)")

    rows = []

    def build(label, current_stride, fn):
        result, elapsed = timed(fn)
        kernel_map = result.kernel_map
        rows.append((label, current_stride[0], kernel_map.num_in, kernel_map.num_out, kernel_map.num_pairs, elapsed))
        return result

    level = tensor
    encoder = []
    for _ in range(args.levels):
        build("submanifold 3^3", level.tensor_stride, lambda t=level: t.kernel_map(3))
        down = build("strided 2^3 /2", level.tensor_stride, lambda t=level: t.kernel_map(2, stride=2))
        encoder.append(level)
        level = _features_of_ones(down)
    build("submanifold 3^3", level.tensor_stride, lambda t=level: t.kernel_map(3))
    for _ in encoder:
        up = build("transposed 2^3 x2", level.tensor_stride, lambda t=level: t.kernel_map(2, stride=2, transposed=True))
        level = _features_of_ones(up)
    _, reuse_ms = timed(lambda: [encoder[0].kernel_map(3) for _ in range(10)])

    print()
    print(f"{'map':<18} {'stride':>6} {'inputs':>10} {'outputs':>10} {'pairs':>12} {'ms':>9}")
    for label, stride, num_in, num_out, pairs, elapsed in rows:
        print(f"{label:<18} {stride:>6} {num_in:>10,} {num_out:>10,} {pairs:>12,} {elapsed:>9.2f}")
    total = sum(row[-1] for row in rows)
    print(f"{'total':<18} {'':>6} {'':>10} {'':>10} {sum(r[4] for r in rows):>12,} {total:>9.2f}")
    print(f"\n{len(rows)} maps built (times include counting the pairs); the decoder's maps invert the "
          f"encoder's; 10 cached look-ups took {reuse_ms:.3f} ms")
    return 0


def _features_of_ones(result) -> SparseTensor:
    """The output tensor of a map, with one constant feature channel."""
    coords = result.out_coordinates
    features = backend.array_module(coords).ones((coords.shape[0], 1), dtype="float32")
    return SparseTensor(coords, features, result.out_tensor_stride, validate=False, map_cache=result.out_map_cache)


if __name__ == "__main__":
    sys.exit(main())
