"""Sparse convolution speed: every registered algorithm against spconv 2.x in the same run.

On the indoor scene (default 1M voxels, one batch item), submanifold 3³, for each channel pair it
times the forward pass and the backward pass (input gradient + weight gradient) of every algorithm
that supports the problem, each at its best parameters (every combination of its search space is
timed), with CUDA events, median of --repeats after --warmup runs; forward+backward is the sum of
the two (spconv's is timed as one autograd step). Kernel maps
are built once beforehand on both sides (both libraries cache them per network pass).
When spconv is importable its SubMConv3d runs the same layer, and its output is compared with
ours. Printed and written as CSV: ms, achieved TFLOP/s (2 · pairs · C_in · C_out per GEMM phase),
speedup = spconv time / best-of-ours time (> 1: we are faster), and the peak extra GPU memory of
one forward on each side (both measured by torch's allocator, which CuPy is routed through).

    cupysparse-benchmark-conv --channels 32,64,128,256 --csv conv.csv
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from cupysparse.cuda import backend
from cupysparse.algorithms import ConvProblem, registered
from cupysparse.cuda.dtypes import as_feature_dtype, short_name
from cupysparse.data.scenes import make_scene
from cupysparse.scripts import arguments
from cupysparse.scripts.benchmarking import (
    make_timer,
    peak_extra_bytes,
    route_cupy_through_torch,
    spconv_layer,
    torch_cuda,
    write_csv,
)
from cupysparse.geometry.sparse_tensor import SparseTensor

PHASES = ("forward", "forward+backward")  # the phases compared with spconv
KERNEL_SIZE = 3


class Ours:
    """Our layer: features, weight, cached map, and the phases of one algorithm."""

    def __init__(self, tensor, weight, grad):
        self.x, self.w, self.dy = tensor.features, weight, grad
        self.kernel_map = tensor.kernel_map(KERNEL_SIZE).kernel_map

    def forward(self, algorithm, params):
        return lambda: algorithm.forward(self.x, algorithm.prepare_weight(self.w), self.kernel_map, **params)

    def dgrad(self, algorithm, params):
        return lambda: algorithm.dgrad(self.dy, algorithm.prepare_weight(self.w), self.kernel_map, **params)

    def wgrad(self, algorithm, params):
        return lambda: algorithm.wgrad(self.x, self.dy, self.kernel_map, **params)

    def backward(self, algorithm, params):
        dgrad, wgrad = self.dgrad(algorithm, params), self.wgrad(algorithm, params)
        return lambda: (dgrad(), wgrad())


def best_time(measure, candidates, warmup, repeats):
    """(params, ms) of the fastest candidate; a candidate 10x slower than the best so far after one
    run is not timed further (SIMT tiles of 4 on wide layers take seconds)."""
    best = (None, float("inf"))
    for params, fn in candidates:
        first = measure(fn, 0, 1)
        if first > 10 * best[1]:
            continue
        ms = measure(fn, warmup, repeats)
        if ms < best[1]:
            best = (params, ms)
    return best


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--num-voxels", type=arguments.count, default=1_000_000, help="voxels of the scene")
    parser.add_argument("--channels", default="32,64,128,256", help="comma-separated C (C → C layers)")
    parser.add_argument("--dtype", default="fp16", help="fp16, bf16, fp32 (spconv: fp16 and fp32 only)")
    parser.add_argument("--scene", default="indoor", choices=("indoor", "outdoor"),
                        help="indoor rooms or outdoor LiDAR sweeps (cupysparse.data.scenes)")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                        help="where to run: auto (the GPU if there is one), cuda or cpu")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before the timed ones")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs (the median is reported)")
    parser.add_argument("--algorithms", default=None, help="comma-separated algorithm names (default: every one)")
    parser.add_argument("--no-spconv", action="store_true", help="skip the spconv comparison")
    parser.add_argument("--csv", default=None, help="also write the rows to this CSV file")
    return parser


def parse_args(argv=None, prog: str | None = None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        args.channels = [int(c) for c in args.channels.split(",")]
        args.dtype = as_feature_dtype(args.dtype)
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    if args.device == "auto":
        args.device = backend.default_device()
    known = list(registered())
    args.algorithms = known if args.algorithms is None else args.algorithms.split(",")
    if unknown := [name for name in args.algorithms if name not in known]:
        parser.error(f"unknown algorithms {unknown}; valid: {known}")
    return args


def main(argv=None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    device = args.device
    torch = torch_cuda() if device == "cuda" else None
    if torch is not None:
        route_cupy_through_torch(torch)
    measure = make_timer(device)
    scene = make_scene(args.scene, args.num_voxels, seed=0)
    voxels = scene.voxel_coordinates()
    coords_numpy = np.concatenate([np.zeros((len(voxels), 1), np.int32), voxels], axis=1)
    coords = backend.to_device(coords_numpy, device)
    described = backend.describe_device(device)
    print(f"sparse conv, {args.scene} scene, {len(voxels)} voxels, submanifold {KERNEL_SIZE}^3, "
          f"{short_name(args.dtype)}, on {described}; median of {args.repeats}")
    print(TABLE_HEADER)
    rows = []
    rng = np.random.default_rng(0)
    for channels in args.channels:
        features = rng.standard_normal((len(voxels), channels)).astype(args.dtype)
        weight = rng.standard_normal((KERNEL_SIZE**3, channels, channels)) / np.sqrt(channels * KERNEL_SIZE**3)
        weight = backend.to_device(weight.astype(args.dtype), device)
        grad = rng.standard_normal((len(voxels), channels)).astype(args.dtype)
        tensor = SparseTensor(coords, backend.to_device(features, device), validate=False)
        ours = Ours(tensor, weight, backend.to_device(grad, device))
        pairs = ours.kernel_map.num_pairs
        flop = 2.0 * pairs * channels * channels
        problem = ConvProblem.of(ours.x, ours.kernel_map, channels)

        def layer_row(phase, library, algorithm, params, ms, peak, difference):
            work = 3 * flop if phase == "forward+backward" else flop  # forward, dgrad and wgrad: one GEMM each
            return {
                "device": described, "num_voxels": len(voxels), "pairs": pairs, "channels": channels,
                "dtype": short_name(args.dtype), "phase": phase, "library": library, "algorithm": algorithm,
                "params": params, "ms": round(ms, 4), "tflops": float(f"{work / ms / 1e9:.4g}"),
                "forward_peak_mb": None if peak is None else round(peak / 2**20, 1),
                "max_abs_diff_vs_spconv": difference,
            }

        theirs = None
        if not args.no_spconv and torch is not None and args.dtype.name in ("float16", "float32"):
            theirs = spconv_layer(torch, coords_numpy, features, weight, grad, KERNEL_SIZE)
        for name, algorithm in registered().items():
            if name not in args.algorithms or not algorithm.supports(problem):
                continue
            forward_params, forward_ms = best_time(
                measure, [(p, ours.forward(algorithm, p)) for p in algorithm.param_grid("forward")],
                args.warmup, args.repeats,
            )
            backward_params, backward_ms = best_time(
                measure, [(p, ours.backward(algorithm, p)) for p in algorithm.param_grid("backward")],
                args.warmup, args.repeats,
            )
            peak = peak_extra_bytes(torch, ours.forward(algorithm, forward_params))
            difference = None
            if theirs is not None:
                out = backend.to_numpy(ours.forward(algorithm, forward_params)()).astype(np.float32)
                difference = float(np.abs(out - theirs.output.float().cpu().numpy()).max())
            # The backward's parts, at the parameters that were best for the two together.
            dgrad_ms = measure(ours.dgrad(algorithm, backward_params), args.warmup, args.repeats)
            wgrad_ms = measure(ours.wgrad(algorithm, backward_params), args.warmup, args.repeats)
            for phase, ms, params in (("forward", forward_ms, forward_params),
                                      ("dgrad", dgrad_ms, backward_params),
                                      ("wgrad", wgrad_ms, backward_params),
                                      ("forward+backward", forward_ms + backward_ms, backward_params)):
                rows.append(layer_row(phase, "cupysparse", name, params, ms, peak, difference))
                print_row(rows[-1])
        if theirs is not None:
            peak = peak_extra_bytes(torch, theirs.forward)
            for phase, fn in (("forward", theirs.forward), ("forward+backward", theirs.forward_backward)):
                ms = measure(fn, args.warmup, args.repeats)
                rows.append(layer_row(phase, "spconv", "SubMConv3d", {}, ms, peak, None))
                print_row(rows[-1])
    print_summary(rows)
    if args.csv:
        write_csv(rows, args.csv)
    return 0


TABLE_HEADER = (f"{'C':>4} {'phase':<17} {'library':<11} {'algorithm':<20} {'ms':>9} {'TFLOP/s':>8} "
                f"{'fwd peak MB':>11} {'max|diff|':>9}  params")


def print_row(row) -> None:
    peak = "" if row["forward_peak_mb"] is None else f"{row['forward_peak_mb']:.1f}"
    diff = "" if row["max_abs_diff_vs_spconv"] is None else f"{row['max_abs_diff_vs_spconv']:.3g}"
    print(f"{row['channels']:>4} {row['phase']:<17} {row['library']:<11} {row['algorithm']:<20} {row['ms']:>9.3f} "
          f"{row['tflops']:>8.1f} {peak:>11} {diff:>9}  {row['params']}", flush=True)


def print_summary(rows) -> None:
    print("\nbest of ours against spconv (speedup = spconv ms / ours ms; > 1: cupysparse is faster)")
    for channels in sorted({row["channels"] for row in rows}):
        for phase in PHASES:
            same_layer = [r for r in rows if r["channels"] == channels and r["phase"] == phase]
            mine = [r for r in same_layer if r["library"] == "cupysparse"]
            theirs = [r for r in same_layer if r["library"] == "spconv"]
            if not mine:
                continue
            best = min(mine, key=lambda r: r["ms"])
            line = f"{channels:>4} {phase:<17} best {best['algorithm']:<20} {best['ms']:>9.3f} ms"
            if theirs:
                line += (f"   spconv {theirs[0]['ms']:.3f} ms   speedup {theirs[0]['ms'] / best['ms']:.2f}x"
                         f"   fwd peak MB ours {best['forward_peak_mb']} / spconv {theirs[0]['forward_peak_mb']}")
            print(line)


if __name__ == "__main__":
    sys.exit(main())
