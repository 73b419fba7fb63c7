"""Kernel-map build time: cupysparse against spconv 2.x in the same run, on the indoor scene.

For each voxel count it times, with CUDA events (median of --repeats after --warmup runs):
  submanifold 3³: hash build, pair-table query (which also writes the offset bitmask), then each
  derived format (CSR lists, the bitmask derived from a table as transposed maps need it,
  mask-sorted order); strided 2³ stride 2: downsampling (unique), query, the whole map.
When spconv is importable the same maps are built by spconv's implicit-GEMM pair generation
(pair table + masks + mask argsort, inference mode) and the ratio spconv / cupysparse is printed.
Then every map of a whole MinkUNet18, built from scratch for a batch of two scenes of --network-voxels each
(`KernelMapCache.build_maps`, one synchronisation included, so the time is the build's wall time): as its
inference builds them, and as its training step does, with the reversed maps and the pair counts of its
weight gradients. Without a GPU it times the NumPy reference path with the host clock.

    cupysparse-benchmark-kernel-map --num-voxels 100000,1000000 --csv kernel_map.csv
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from cupysparse.cuda import backend
from cupysparse.geometry.hashing import Query, build_index
from cupysparse.geometry.kernel_map import (
    KernelMapCache,
    csr_pairs,
    downsample_coordinates,
    mask_sorted_order,
    offset_mask,
    strided_map,
    submanifold_map,
)
from cupysparse.data.scenes import make_scene
from cupysparse.networks import descriptions as networks
from cupysparse.scripts import arguments
from cupysparse.scripts.benchmarking import make_timer, write_csv

SUBMANIFOLD = ((3, 3, 3), (1, 1, 1))
STRIDED = ((2, 2, 2), (2, 2, 2))
NETWORK_SCENES = 2  # the network benchmark's batch


def cupysparse_stages(coords):
    """(case, stage) → zero-argument callable doing that stage of the map build from scratch."""
    kernel_size, stride = SUBMANIFOLD
    index = build_index(coords)
    query = Query(kernel_size, (1, 1, 1), out_scale=stride, divisor=stride)
    built = submanifold_map(coords, kernel_size, index=index)
    table, mask = built.pair_table, built.offset_mask()
    strided_kernel, strided_stride = STRIDED
    coarse = downsample_coordinates(coords, strided_stride)
    strided_query = Query(strided_kernel, (1, 1, 1), out_scale=strided_stride, divisor=(1, 1, 1))
    return {
        ("subm 3^3", "hash build"): lambda: build_index(coords),
        ("subm 3^3", "query (table + mask)"): lambda: index.pair_table(coords, query, same_coordinates=True),
        ("subm 3^3", "map = build + query"): lambda: submanifold_map(coords, kernel_size),
        ("subm 3^3", "csr lists"): lambda: csr_pairs(table),
        ("subm 3^3", "mask from a table"): lambda: offset_mask(table),
        ("subm 3^3", "mask-sorted order"): lambda: mask_sorted_order(mask, built.kernel_volume),
        ("subm 3^3", "map + mask + order"): lambda: submanifold_map(coords, kernel_size).mask_sorted_order(),
        ("strided 2^3/2", "downsample (unique)"): lambda: downsample_coordinates(coords, strided_stride),
        ("strided 2^3/2", "query (table + mask)"): lambda: index.pair_table(coarse, strided_query),
        ("strided 2^3/2", "map + mask + order"): lambda: strided_map(coords, strided_kernel, strided_stride)[
            1
        ].mask_sorted_order(),
    }


def network_map_stages(coords):
    """(case, stage) → every map of a whole MinkUNet18 built from scratch over `coords` (a new cache each call):
    those its inference runs over, and those of its training step (with the reversed maps and pair counts)."""
    requests = networks.map_requests(networks.minkunet(18))

    def build(with_reversed: bool):
        return lambda: KernelMapCache(coords, (1, 1, 1)).build_maps(requests, with_reversed)

    return {("MinkUNet18", "inference maps"): build(False), ("MinkUNet18", "training maps"): build(True)}


def batch_coordinates(kind: str, num_voxels: int, num_scenes: int) -> np.ndarray:
    """`[N, 4]` (batch, x, y, z) coordinates of the scenes of `kind` of seeds 0 .. num_scenes - 1."""
    scenes = [make_scene(kind, num_voxels, seed=seed).voxel_coordinates() for seed in range(num_scenes)]
    return np.concatenate([np.concatenate([np.full((len(voxels), 1), seed, np.int32), voxels], axis=1)
                           for seed, voxels in enumerate(scenes)])


def spconv_stages(coords_numpy):
    """The comparable spconv work, or {} when spconv (and torch with CUDA) is not importable."""
    try:
        import torch
        from spconv.core import ConvAlgo
        from spconv.pytorch import ops
    except Exception as error:  # spconv absent or broken: the benchmark still runs without it
        print(f"spconv not importable ({type(error).__name__}: {error}); cupysparse only", file=sys.stderr)
        return {}
    # spconv wants non-negative (batch, z, y, x) inside a spatial shape.
    shifted = coords_numpy.copy()
    shifted[:, 1:] -= shifted[:, 1:].min(axis=0)
    spatial_shape = (shifted[:, 1:].max(axis=0) + 2).tolist()
    indices = torch.from_numpy(shifted).cuda()
    batch_size = int(shifted[:, 0].max()) + 1

    def pairs(kernel_size, stride, subm):
        return lambda: ops.get_indice_pairs_implicit_gemm(
            indices, batch_size, spatial_shape, ConvAlgo.MaskImplicitGemm, list(kernel_size), list(stride),
            [k // 2 if subm else 0 for k in kernel_size], [1, 1, 1], [0, 0, 0], subm=subm, is_train=False,
        )

    return {
        ("subm 3^3", "map + mask + order"): pairs(*SUBMANIFOLD, subm=True),
        ("strided 2^3/2", "map + mask + order"): pairs(*STRIDED, subm=False),
    }


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--num-voxels", type=arguments.counts, default=None,
                        help="comma-separated voxel counts (default: 100000,1000000 on a GPU, 100000 on the CPU)")
    parser.add_argument("--scene", default="indoor", choices=("indoor", "outdoor"),
                        help="indoor rooms or outdoor LiDAR sweeps (cupysparse.data.scenes)")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                        help="where to run: auto (the GPU if there is one), cuda or cpu")
    parser.add_argument("--network-voxels", type=arguments.count, default=None,
                        help="voxels per scene of the whole network's maps, two scenes (default: 200000 on a GPU, "
                             "20000 on the CPU)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before the timed ones")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs (the median is reported)")
    parser.add_argument("--no-spconv", action="store_true", help="skip the spconv comparison")
    parser.add_argument("--csv", default=None, help="write the rows to this CSV file")
    return parser


def parse_args(argv=None, prog: str | None = None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = backend.default_device()
    if args.num_voxels is None:
        args.num_voxels = (100_000, 1_000_000) if args.device == "cuda" else (100_000,)
    if args.network_voxels is None:
        args.network_voxels = 200_000 if args.device == "cuda" else 20_000
    if args.warmup < 0 or args.repeats < 1:
        parser.error("--warmup must be >= 0 and --repeats >= 1")
    return args


def main(argv=None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    measure = make_timer(args.device)
    print(f"kernel-map build, {args.scene} scene, on {backend.describe_device(args.device)}; "
          f"median of {args.repeats} after {args.warmup} warm-up runs")
    rows = []
    for num_voxels in (*args.num_voxels, None):
        if num_voxels is None:  # the whole network's maps
            coords_numpy = batch_coordinates(args.scene, args.network_voxels, NETWORK_SCENES)
            coords = backend.to_device(coords_numpy, args.device)
            ours, theirs = network_map_stages(coords), {}
        else:
            coords_numpy = batch_coordinates(args.scene, num_voxels, 1)
            coords = backend.to_device(coords_numpy, args.device)
            ours = cupysparse_stages(coords)
            theirs = {} if args.no_spconv or args.device == "cpu" else spconv_stages(coords_numpy)
        for (case, stage), fn in ours.items():
            ours_ms = measure(fn, args.warmup, args.repeats)
            theirs_ms = measure(theirs[(case, stage)], args.warmup, args.repeats) if (case, stage) in theirs else None
            rows.append({
                "device": args.device,
                "num_voxels": len(coords_numpy),
                "case": case,
                "stage": stage,
                "cupysparse_ms": round(ours_ms, 4),
                "spconv_ms": None if theirs_ms is None else round(theirs_ms, 4),
                "spconv_over_cupysparse": None if theirs_ms is None else round(theirs_ms / ours_ms, 2),
            })
    print(f"{'voxels':>9} {'case':<14} {'stage':<22} {'cupysparse ms':>14} {'spconv ms':>10} {'spconv/ours':>12}")
    for row in rows:
        theirs = "" if row["spconv_ms"] is None else f"{row['spconv_ms']:.3f}"
        ratio = "" if row["spconv_over_cupysparse"] is None else f"{row['spconv_over_cupysparse']:.2f}x"
        print(f"{row['num_voxels']:>9} {row['case']:<14} {row['stage']:<22} {row['cupysparse_ms']:>14.3f} "
              f"{theirs:>10} {ratio:>12}")
    if args.csv:
        write_csv(rows, args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
