"""Fill the autotuner's benchmark cache ahead of time, so training never stops to benchmark.

For each configuration (voxel count, channel pair, kernel size, dtype) it builds the indoor scene,
random features and weights and a submanifold map, then has the tuner measure the `--algo-mode`
candidates of the forward and the backward on them, exactly as the functional API's first call
would, and store the results under its key (namespaces `sparse_conv_forward` /
`sparse_conv_backward`, and each algorithm's own for its parameter sweep); the kernels that ran
stay compiled in CuPy's kernel cache. The cache file follows `CUPYSPARSE_BENCHMARK_CACHE_DIR`.

    cupysparse-populate-benchmark-cache                     # the default grid: 364 configurations
    cupysparse-populate-benchmark-cache --preset quick      # 6 configurations, about a minute on a GPU
    cupysparse-populate-benchmark-cache --dry-run           # list them, run nothing
    cupysparse-populate-benchmark-cache --resume            # skip configurations already cached
    cupysparse-populate-benchmark-cache --num-voxels 65K,1M --channels 3,32 32,64 --dtypes float16

Configurations are deduplicated by the tuning key's size bucket, ceil(log2(voxels)): two voxel
counts in one bucket would measure the same key. Each scene is cut to at most the requested
voxel count (the builder lands within ±5% of it), so the measured key is the listed bucket.
A problem with a single candidate (on the CPU: `explicit_gemm` only), which normal calls do not
measure, is measured too, so every configuration gets an entry.

Each phase's results are saved before the next one is measured, so an interrupted run (Ctrl-C,
exit status 130; a killed process) loses at most the phase it was measuring: run it again with
`--resume` to measure only what is missing.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import numpy as np

from cupysparse.cuda import backend
from cupysparse.tuning.search_space import parse_algorithm_filter
from cupysparse.algorithms import CONV, ConvProblem
from cupysparse.tuning.cache_file import default_cache
from cupysparse.cuda.dtypes import as_feature_dtype
from cupysparse.functional.execution import backward_runner, forward_runner
from cupysparse.geometry.kernel_map import KernelMapCache
from cupysparse.scripts import arguments
from cupysparse.scripts.progress import Progress
from cupysparse.data.scenes import INDOOR_MIN_NUM_VOXELS, make_scene
from cupysparse.tuning.tuner import NAMESPACES, Tuner, tuning_enabled, tuning_key

# The (C_in, C_out) of the spatial convolutions (submanifold, strided and transposed) of each
# network, in network order; 1x1 projections and classifier heads are left out (plain matrix products).
ARCHITECTURE_CHANNEL_PAIRS: dict[str, tuple[tuple[int, int], ...]] = {
    # MinkowskiEngine's MinkUNet18/34 (INIT_DIM 32, PLANES 32-64-128-256 | 256-128-96-96; the two
    # differ only in blocks per stage). Stem 3→32; each encoder stage a stride-2 conv at the
    # previous width, then blocks widening to the stage's; each decoder stage a transposed conv,
    # then blocks on [up, skip] concatenated: 256+128=384, 128+64=192, 96+32=128, 96+32(stem)=128.
    "MinkUNet18/34": (
        (3, 32), (32, 32),
        (32, 64), (64, 64),
        (64, 128), (128, 128),
        (128, 256), (256, 256),
        (384, 256),
        (256, 128), (192, 128),
        (128, 96), (96, 96),
    ),
    # A sparse U-Net on MaxViT-T's widths (stem 64, stages 64-128-256-512): stem 3→64→64, a stride-2
    # conv into each stage and the MBConv's k³ conv at the stage width; the mirrored decoder has a
    # transposed conv per stage and a fuse conv on [up, skip]: 256+256=512, 128+128=256, 64+64=128.
    "MaxViT-UNet": (
        (3, 64), (64, 64),
        (64, 128), (128, 128),
        (128, 256), (256, 256),
        (256, 512), (512, 512),
        (512, 256),
        (256, 128),
        (128, 64),
    ),
    # SparseConvNet's U-Net (ScanNet example) with m = 32 and five levels, planes m·(1..5) =
    # 32-64-96-128-160: blocks at each level's width, stride-2 convs down, transposed convs up, and
    # on the way up blocks on [up, skip] concatenated, 2a → a: 256→128, 192→96, 128→64, 64→32.
    "SparseConvUNet": (
        (3, 32), (32, 32),
        (32, 64), (64, 64),
        (64, 96), (96, 96),
        (96, 128), (128, 128),
        (128, 160), (160, 160),
        (160, 128), (256, 128),
        (128, 96), (192, 96),
        (96, 64), (128, 64),
        (64, 32),
    ),
}
DEFAULT_CHANNEL_PAIRS = tuple(
    dict.fromkeys(pair for pairs in ARCHITECTURE_CHANNEL_PAIRS.values() for pair in pairs)
)  # 26 pairs, first appearance order
DEFAULT_NUM_VOXELS = (30_000, 65_000, 130_000, 260_000, 500_000, 1_000_000, 2_000_000)
PRESETS = {
    "default": {
        "num_voxels": DEFAULT_NUM_VOXELS,
        "channels": DEFAULT_CHANNEL_PAIRS,
        "kernel_sizes": (3,),
        "dtypes": ("float16", "bfloat16"),
    },
    "quick": {
        "num_voxels": (65_000, 130_000),
        "channels": ((32, 32), (64, 64), (128, 128)),
        "kernel_sizes": (3,),
        "dtypes": ("float16",),
    },
}
DTYPE_CHOICES = ("float16", "bfloat16", "float32")
SCENE_SEED = 0


@dataclass(frozen=True)
class Configuration:
    num_voxels: int
    in_channels: int
    out_channels: int
    kernel_size: int
    dtype: str

    def label(self) -> str:
        return (f"{self.num_voxels:>9,} voxels  {self.in_channels:>3}->{self.out_channels:<3}  "
                f"k={self.kernel_size}  {self.dtype}")


def size_bucket(num_voxels: int) -> int:
    """The tuning key's `log_num_in_coords` of a layer with `num_voxels` inputs."""
    return math.ceil(math.log2(max(num_voxels, 1)))


def configurations(num_voxels, channel_pairs, kernel_sizes, dtypes) -> list[Configuration]:
    """The grid, voxel counts outermost (one scene in memory at a time), one per tuning key bucket."""
    seen, grid = set(), []
    for count in num_voxels:
        for kernel_size in kernel_sizes:
            for dtype in dtypes:
                for in_channels, out_channels in channel_pairs:
                    bucket = (size_bucket(count), in_channels, out_channels, kernel_size, dtype)
                    if bucket not in seen:
                        seen.add(bucket)
                        grid.append(Configuration(count, in_channels, out_channels, kernel_size, dtype))
    return grid


def _parse_channel_pair(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2 or not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        raise ValueError(f"a channel pair is C_in,C_out (positive integers), got {text!r}")
    return int(parts[0]), int(parts[1])


def _comma_items(values: list[str]) -> list[str]:
    return [item for value in values for item in value.split(",") if item.strip()]


def add_grid_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that choose the configurations and how they run (shared with the first-call benchmark)."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default",
                        help="the grid; the flags below replace one of its dimensions")
    parser.add_argument("--num-voxels", nargs="+", type=arguments.counts, metavar="N",
                        help="voxel counts, comma list (30000,65K,1M)")
    parser.add_argument("--channels", nargs="+", metavar="C_in,C_out", help="channel pairs, e.g. 3,32 32,64")
    parser.add_argument("--kernel-sizes", nargs="+", metavar="K", help="kernel sizes, e.g. 3 5")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPE_CHOICES, metavar="DTYPE",
                        help=f"feature dtypes among {', '.join(DTYPE_CHOICES)}")
    parser.add_argument("--algo-mode", default="auto", help="auto, all, an algorithm name or [a,b] (fwd and bwd)")
    parser.add_argument("--batch-size", type=arguments.count, default=1, help="batch items sharing each voxel count")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                        help="where to run: auto (the GPU if there is one), cuda or cpu")


def grid_from_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the grid dimensions of `args` from its preset and flags, or exit through `parser.error`."""
    preset = PRESETS[args.preset]
    try:
        args.num_voxels = arguments.joined(args.num_voxels) if args.num_voxels else preset["num_voxels"]
        args.channels = tuple(_parse_channel_pair(p) for p in args.channels) if args.channels else preset["channels"]
        args.kernel_sizes = (tuple(int(k) for k in _comma_items(args.kernel_sizes))
                             if args.kernel_sizes else preset["kernel_sizes"])
        args.dtypes = tuple(dict.fromkeys(args.dtypes)) if args.dtypes else preset["dtypes"]
        for dtype in args.dtypes:
            as_feature_dtype(dtype)  # bfloat16 needs ml_dtypes
        for phase in ("forward", "backward"):
            parse_algorithm_filter(args.algo_mode, CONV, phase)
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    if any(k <= 0 for k in args.kernel_sizes):
        parser.error(f"kernel sizes must be positive, got {args.kernel_sizes}")
    if smallest := [n for n in args.num_voxels if n // args.batch_size < INDOOR_MIN_NUM_VOXELS]:
        parser.error(f"each batch item needs at least {INDOOR_MIN_NUM_VOXELS} voxels; too few in {smallest}")
    if args.device == "auto":
        args.device = backend.default_device()
    elif args.device == "cuda" and not backend.gpu_available():
        parser.error("--device cuda: no CUDA GPU is usable (see `python -m cupysparse info`)")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    add_grid_arguments(parser)
    phases = parser.add_mutually_exclusive_group()
    phases.add_argument("--forward-only", action="store_true", help="measure the forward pass only")
    phases.add_argument("--backward-only", action="store_true", help="measure the backward passes only")
    parser.add_argument("--dry-run", action="store_true", help="list the configurations; run nothing")
    parser.add_argument(
        "--resume", action="store_true", help="skip configurations already in the cache (measured in any algo mode)"
    )
    return parser


def parse_args(argv=None, prog: str | None = None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    grid_from_arguments(parser, args)
    args.phases = ("forward", "backward")
    if args.forward_only or args.backward_only:
        args.phases = ("forward",) if args.forward_only else ("backward",)
    return args


def scene_coordinates(num_voxels: int, batch_size: int) -> np.ndarray:
    """int32 `[N, 4]`, N ≤ num_voxels: `batch_size` indoor scenes (seeds 0, 1, …) in column 0."""
    per_item = num_voxels // batch_size
    items = []
    for item in range(batch_size):
        voxels = make_scene("indoor", per_item, seed=SCENE_SEED + item).voxel_coordinates()[:per_item]
        items.append(np.concatenate([np.full((len(voxels), 1), item, np.int32), voxels], axis=1))
    return np.concatenate(items)


class SceneMaps:
    """The coordinates and submanifold maps of the current voxel count; building the scene is the
    slow part on the CPU, and configurations come grouped by voxel count."""

    def __init__(self, batch_size: int, device: str):
        self._batch_size, self._device = batch_size, device
        self._num_voxels = None
        self._maps = None

    def kernel_map(self, num_voxels: int, kernel_size: int):
        if num_voxels != self._num_voxels:
            self._maps = None  # frees the previous scene's maps before building the next
            coordinates = backend.to_device(scene_coordinates(num_voxels, self._batch_size), self._device)
            self._maps, self._num_voxels = KernelMapCache(coordinates, (1, 1, 1)), num_voxels
        return self._maps.kernel_map((1, 1, 1), kernel_size).kernel_map


@dataclass
class PhaseOutcome:
    phase: str
    winner: tuple[str, dict, float]
    tuning_s: float
    source: str  # "measured", or "cached" when the tuner had every candidate's results already

    def describe(self) -> str:
        name, params, ms = self.winner
        settings = " ".join(f"{key}={value}" for key, value in params.items())
        return (f"{self.phase}: {name}{' ' + settings if settings else ''} {ms:.3f} ms "
                f"({self.source}, tuning {self.tuning_s:.2f} s)")


class LayerData:
    """Seeded random features, weight and output gradient of one configuration on `device`."""

    def __init__(self, config: Configuration, kernel_map, device: str):
        xp = backend.cupy_module() if device == "cuda" else np
        dtype = as_feature_dtype(config.dtype)
        rng = xp.random.default_rng([config.num_voxels, config.in_channels, config.out_channels, config.kernel_size])
        volume = kernel_map.kernel_volume
        scale = 1.0 / math.sqrt(config.in_channels * volume)  # keeps outputs O(1) in half precision

        def normal(*shape, factor=1.0):
            return (rng.standard_normal(shape, dtype=np.float32) * factor).astype(dtype)

        self.kernel_map = kernel_map
        self.features = normal(kernel_map.num_in, config.in_channels)
        self.weight = normal(volume, config.in_channels, config.out_channels, factor=scale)
        self.grad_output = normal(kernel_map.num_out, config.out_channels)
        self.problem = ConvProblem.of(self.features, kernel_map, config.out_channels)

    def runner(self, phase: str):
        """`run(algorithm, params)` for the tuner, exactly as the functional API builds it."""
        if phase == "forward":
            return forward_runner(self.features, self.weight, self.kernel_map)
        return backward_runner(self.grad_output, self.features, self.weight, self.kernel_map)


def _synchronize(device: str) -> None:
    if device == "cuda":
        backend.cupy_module().cuda.get_current_stream().synchronize()


def tune_phase(data: LayerData, phase: str, algo_mode: str, device: str, tuner: Tuner) -> PhaseOutcome:
    namespace = NAMESPACES[(CONV, phase)]
    key = tuning_key(data.problem)
    measured_before = tuner.measurements
    begin = time.perf_counter()
    chosen = tuner.select(parse_algorithm_filter(algo_mode, CONV, phase), data.problem, data.runner(phase))
    _synchronize(device)
    entry = tuner.cache.get(namespace, key)
    if entry is None:
        raise RuntimeError(f"the tuner stored no {namespace} result: its warning says why (memory ran short, no "
                           "candidate could run, or the reference overflowed); --resume measures it again")
    winner = next(r for r in entry.results if (r[0], r[1]) == (chosen.algorithm.name, chosen.params))
    source = "measured" if tuner.measurements > measured_before else "cached"
    return PhaseOutcome(phase, winner, time.perf_counter() - begin, source)


def is_cached(data: LayerData, phase: str, cache) -> bool:
    return cache.get(NAMESPACES[(CONV, phase)], tuning_key(data.problem)) is not None


def print_dry_run(grid: list[Configuration]) -> None:
    width = len(str(len(grid)))
    for index, config in enumerate(grid, 1):
        print(f"{index:>{width}}. {config.label()}")
    print(f"{len(grid)} configurations")


def main(argv=None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    grid = configurations(args.num_voxels, args.channels, args.kernel_sizes, args.dtypes)
    if args.dry_run:
        print_dry_run(grid)
        return 0
    if not tuning_enabled():
        print("CUPYSPARSE_AUTOTUNE turns measuring off; unset it to populate the cache", file=sys.stderr)
        return 2
    cache = default_cache()
    tuner = Tuner(cache, measure_single_candidates=True)
    print(f"populating {cache.path} on {backend.describe_device(args.device)}: {len(grid)} configuration(s), "
          f"{'+'.join(args.phases)}, algo mode {args.algo_mode}", flush=True)
    scenes = SceneMaps(args.batch_size, args.device)
    progress = Progress(len(grid))
    done = skipped = failed = 0
    index = 0
    try:
        for index, config in enumerate(grid, 1):
            progress.show(index, config.label())
            prefix = f"{progress.tag(index)} {config.label()}"
            try:
                data = LayerData(config, scenes.kernel_map(config.num_voxels, config.kernel_size), args.device)
                phases = [p for p in args.phases if not (args.resume and is_cached(data, p, cache))]
                if not phases:
                    skipped += 1
                    progress.clear()
                    print(f"{prefix}  skipped: already cached", flush=True)
                    continue
                outcomes = []
                for phase in phases:
                    outcomes.append(tune_phase(data, phase, args.algo_mode, args.device, tuner))
                    cache.flush()  # each problem on disk before the next: an interruption loses only its own
                done += 1
                progress.clear()
                print(f"{prefix}  " + "; ".join(outcome.describe() for outcome in outcomes), flush=True)
            except Exception as error:  # noqa: BLE001 - one failing configuration must not stop the others
                failed += 1
                progress.clear()
                print(f"{prefix}  FAILED: {type(error).__name__}: {error}", flush=True)
            finally:
                data = None  # frees the configuration's arrays before the next one allocates
                cache.flush()  # whatever a failing configuration stored
    except KeyboardInterrupt:
        progress.clear()
        print(f"interrupted in configuration {index}/{len(grid)} after {done} done, {skipped} skipped, "
              f"{failed} failed; what was measured is saved in {cache.path}: run again with --resume to go on",
              flush=True)
        return 130
    print(f"done {done}, skipped {skipped} (already cached), failed {failed}; cache file {cache.path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
