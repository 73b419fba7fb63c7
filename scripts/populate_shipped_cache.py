"""Write a shipped tuning cache: the reference networks' layers tuned on this GPU, on the demo's scenes.

    cupysparse-populate-shipped-cache --output cupysparse/tuning/shipped_caches/benchmark_cache_sm_90.msgpack
    cupysparse-populate-shipped-cache --num-voxels 200K --dtypes float16 --dry-run
    cupysparse-populate-shipped-cache --networks minkunet18 --scenes outdoor --extend --output FILE
    cupysparse-populate-shipped-cache --check          # the release check

For each network, scene, scene size and dtype it builds the demo's scene
(`cupysparse.scripts.demo.scene_tensor`, seed 0: MinkUNet18 on the indoor room and on the outdoor LiDAR
sweep, CenterPoint's backbone on the sweep with our strided convolutions and with spconv's padded ones,
the scene then on spconv's grid) and runs the network forward and backward with the tuner measuring every
convolution in the `--algo-mode` search space (`cupysparse.networks.tuning.tune_network`): the keys a
training or inference run on that scene meets, strided and transposed layers included. A sweep's coarse
levels keep more of its voxels than a room's do, and padded convolutions reach more outputs than ours, so
the same layers meet other sizes there. MinkUNet14 and 34 have MinkUNet18's layer problems. The results
are written to a new file at --output (replaced if it exists; default: this install's shipped file of the
GPU's architecture, `cupysparse/tuning/shipped_caches/benchmark_cache_sm_XY.msgpack`); the user's own
cache is neither read nor written, and shipped results are not consulted, so every entry is measured in
this run. With `--extend` the file's current entries are kept and only the keys it lacks (or holds stale)
are measured: a network or scene added to a file that is otherwise current. Commit the file from a source
checkout to ship it with the wheel. `--device cpu` runs the same pipeline on NumPy (CPU keys, which a
shipped lookup never matches: for testing the script).

`--check` is the release check of the shipped files (this install's, or the files named): for each
architecture's file it counts the entries that match today's kernel sources and the stale ones, by
the kernel file that changed (a file's digest covers the headers it includes), and exits 1 when any
entry is stale or keyed for another architecture. It needs no GPU. A kernel edit does not have to
re-measure the files at once: at run time a stale shipped entry is ignored and its algorithm tuned
on the user's GPU. Before a release, re-populate each file the check reports on a GPU of its
architecture.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from cupysparse.cuda import backend
from cupysparse.networks import descriptions as networks
from cupysparse.tuning.search_space import parse_algorithm_filter
from cupysparse.geometry.padding import spconv_grid
from cupysparse.geometry.sparse_tensor import SparseTensor
from cupysparse.algorithms import CONV
from cupysparse.tuning.cache_file import BenchmarkCache, NotACacheFile, open_for_reading
from cupysparse.scripts.demo import scene_tensor
from cupysparse.networks.tuning import tune_network
from cupysparse.cuda.precision import TF32, fp32_precision, get_fp32_precision
from cupysparse.scripts import arguments
from cupysparse.scripts.progress import Progress
from cupysparse.tuning.shipped import ShippedFileCheck, check_shipped_file, shipped_cache_path, shipped_cache_paths
from cupysparse.tuning.tuner import Tuner, tuning_enabled

# Each reference network: the scenes it is tuned on, and its description for a scene's number of classes.
NETWORKS = {
    "minkunet18": (("indoor", "outdoor"), lambda classes: networks.minkunet(18, 3, classes)),
    "centerpoint": (("outdoor",), lambda classes: networks.centerpoint_backbone()),
    # spconv's padded strided convolutions, as its detectors (and models converted from them) run them.
    "centerpoint-padded": (("outdoor",), lambda classes: networks.centerpoint_backbone(padded=True)),
}
DEFAULT_NETWORKS = ("minkunet18", "centerpoint", "centerpoint-padded")
SCENES = ("indoor", "outdoor")
# The demo's scene (200K voxels on a GPU) and its neighbouring size buckets.
DEFAULT_NUM_VOXELS = (100_000, 200_000, 400_000)
DTYPE_CHOICES = ("float16", "bfloat16", "float32", "tf32")
DEFAULT_DTYPES = ("float16", "bfloat16", "float32")
SCENE_SEED = 0


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or "cupysparse-populate-shipped-cache", description=__doc__.splitlines()[0], epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--output", type=Path, help="the cache file to write (default: this install's shipped file)")
    parser.add_argument("--networks", nargs="+", choices=sorted(NETWORKS), default=list(DEFAULT_NETWORKS),
                        help="the reference networks whose layer shapes are measured")
    parser.add_argument("--scenes", nargs="+", choices=SCENES, default=list(SCENES),
                        help="the scenes a network is tuned on, of those it runs on (default: both)")
    parser.add_argument("--num-voxels", nargs="+", type=arguments.counts, default=[DEFAULT_NUM_VOXELS], metavar="N",
                        help="scene sizes, comma list (200000,200K,1M; default 100K 200K 400K)")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPE_CHOICES, default=list(DEFAULT_DTYPES),
                        help="feature dtypes (tf32: fp32 multiplied in TF32)")
    parser.add_argument("--algo-mode", default="auto", help="the search space of both phases: auto, all, a name, [a,b]")
    parser.add_argument("--extend", action="store_true",
                        help="keep the entries --output already holds and measure only the keys it lacks")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where to measure: cuda (the shipped files are GPU measurements) or cpu")
    parser.add_argument("--dry-run", action="store_true", help="list the runs; measure nothing")
    parser.add_argument("--check", nargs="*", type=Path, metavar="FILE",
                        help="the release check: report the stale entries of the shipped files (default: this "
                             "install's) and exit 1 when there are any; measures nothing")
    return parser


def parse_args(argv=None, prog: str | None = None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.num_voxels = arguments.joined(args.num_voxels)
    if args.check is not None:
        return args
    if not runs(args):
        tuned_on = "; ".join(f"{name} on {' and '.join(NETWORKS[name][0])}" for name in dict.fromkeys(args.networks))
        parser.error(f"no network runs on the scenes named by --scenes ({tuned_on})")
    try:
        for phase in ("forward", "backward"):
            parse_algorithm_filter(args.algo_mode, CONV, phase)
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    if args.dry_run:
        return args
    if args.device == "cuda" and not backend.gpu_available():
        parser.error("no CUDA GPU is usable: tuning results belong to a GPU architecture (see `python -m cupysparse "
                     "info`); --device cpu only tests the script")
    if args.device == "cpu" and args.output is None:
        parser.error("--device cpu needs --output: CPU results are never shipped")
    if not tuning_enabled():
        parser.error("CUPYSPARSE_AUTOTUNE turns measuring off; unset it to populate a cache")
    return args


def runs(args) -> list[tuple[str, str, int, str]]:
    """(network, scene, voxels, dtype) of each run: every network on each of its scenes that --scenes names."""
    return [(name, scene, count, dtype) for name in dict.fromkeys(args.networks) for scene in NETWORKS[name][0]
            if scene in args.scenes for count in args.num_voxels for dtype in dict.fromkeys(args.dtypes)]


def network_input(network_name: str, scene_kind: str, num_voxels: int, device: str):
    """(network, its float32 input on the demo's `scene_kind` scene of `num_voxels`): built once for all
    dtypes, whose tensors share its kernel maps."""
    build = NETWORKS[network_name][1]
    scene, tensor, _ = scene_tensor(scene_kind, num_voxels, SCENE_SEED, device, "float32")
    network = build(len(scene.class_names))
    if networks.has_padding(network):  # padded outputs depend on the grid: spconv's, as its detectors place scenes
        coordinates, spatial_shape = spconv_grid(backend.to_numpy(tensor.coordinates),
                                                 networks.coarsest_stride(network))
        tensor = SparseTensor(backend.to_device(coordinates, device), tensor.features, spatial_shape=spatial_shape)
    return network, with_input_channels(tensor, network.in_channels)


def tune_run(network, scene_kind: str, base, dtype: str, tuner: Tuner, algo_mode: str) -> str:
    """Tune `network` on `base` (the float32 input) cast to `dtype`; a line saying what it did."""
    xp = backend.array_module(base.features)
    tensor = base.replace_features(xp.ascontiguousarray(base.features.astype("float32" if dtype == "tf32" else dtype)))
    progress = Progress(len(networks.convolutions(network)), quiet_steps=True)
    padded = " (spconv's padding)" if networks.has_padding(network) else ""
    label = f"{network.name}{padded} on the {scene_kind} scene, {len(tensor):,} voxels, {dtype}"
    measured_before, begin = tuner.measurements, time.perf_counter()
    with fp32_precision(TF32 if dtype == "tf32" else get_fp32_precision()):
        choices = tune_network(network, tensor, tuner, fwd_algo=algo_mode, bwd_algo=algo_mode,
                               on_layer=lambda path, done: progress.show(done, f"{label}: {path}"))
    progress.clear()
    return (f"{label}: {len(choices) // 2} convolutions, {tuner.measurements - measured_before} problems measured, "
            f"{time.perf_counter() - begin:.1f} s")


def with_input_channels(tensor, channels: int):
    """The scene's xyz features, with constant columns appended up to `channels` (a LiDAR's intensity, say)."""
    missing = channels - tensor.num_channels
    if missing <= 0:
        return tensor
    xp = backend.array_module(tensor.features)
    constant = xp.ones((len(tensor), missing), dtype=tensor.features.dtype)
    return tensor.replace_features(xp.ascontiguousarray(xp.concatenate([tensor.features, constant], axis=1)))


def write_output(cache: BenchmarkCache, output: Path) -> None:
    """Replace `output` by the saved `cache` in one step (no lock file left beside it)."""
    cache.save()
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial")
    shutil.copyfile(cache.path, partial)
    os.replace(partial, output)


def check_report(result: ShippedFileCheck) -> list[str]:
    """What the release check says about one shipped file."""
    lines = [f"{result.path.name} ({result.architecture}): {result.entries} entries, {result.fresh} fresh, "
             f"{result.stale} stale"]
    lines += [f"  {filename}: {count} stale (it or a header it includes changed since measured)"
              for filename, count in result.stale_by_source.items()]
    if result.other_architecture:
        lines.append(f"  {result.other_architecture} keyed for another architecture than {result.architecture} "
                     "(never looked up in this file)")
    if not result.passes:
        lines.append(f"  re-populate it on an {result.architecture} GPU: cupysparse-populate-shipped-cache "
                     f"--output {result.path}")
    return lines


def check(paths: list[Path]) -> int:
    """The release check (`--check`): 0 when every shipped file matches the kernel sources, else 1."""
    paths = paths or shipped_cache_paths()
    if not paths:
        print("no shipped tuning files to check", file=sys.stderr)
        return 1
    failed = 0
    for path in paths:
        try:
            result = check_shipped_file(path)
        except (NotACacheFile, OSError) as error:
            print(f"{path.name}: cannot be read as a tuning cache: {error}")
            failed += 1
            continue
        print("\n".join(check_report(result)))
        failed += not result.passes
    print(f"{len(paths) - failed} of {len(paths)} shipped tuning files match the kernel sources")
    return 1 if failed else 0


def main(argv=None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    if args.check is not None:
        return check(args.check)
    planned = runs(args)
    if args.dry_run:
        for name, scene, count, dtype in planned:
            print(f"{scene:<8} {count:>10,} voxels  {dtype:<9} {name}")
        print(f"{len(planned)} runs")
        return 0
    if args.output is None:
        args.output = shipped_cache_path(f"sm_{int(backend.cupy_module().cuda.Device().compute_capability)}")
    kept = None
    if args.extend:
        kept = kept_entries(args.output)
        if kept is None:
            return 2
    print(f"tuning on {backend.describe_device(args.device)} for {args.output}: {len(planned)} runs, "
          f"algo mode {args.algo_mode}" + (f", keeping its {kept} entries" if args.extend else ""), flush=True)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "shipped.msgpack"
        if args.extend:
            shutil.copyfile(args.output, path)
        cache = BenchmarkCache(path, autosave=False)
        tuner = Tuner(cache, measure_single_candidates=True)
        begin = time.perf_counter()
        built = None  # (network name, scene, voxel count) of `network` and `base`
        for name, scene, count, dtype in planned:
            if built != (name, scene, count):
                network, base = network_input(name, scene, count, args.device)
                built = (name, scene, count)
            print(tune_run(network, scene, base, dtype, tuner, args.algo_mode), flush=True)
        write_output(cache, args.output)
    counts = ", ".join(f"{namespace} {count}" for namespace, count in cache.namespace_counts().items())
    print(f"wrote {args.output} in {time.perf_counter() - begin:.1f} s: {counts}")
    return 0


def kept_entries(path: Path) -> int | None:
    """For --extend: the number of entries in the cache file at `path`; None, with the reason printed, when
    there is none to extend."""
    if not path.is_file():
        print(f"--extend: there is no file {path} to extend; without --extend the run writes a new one",
              file=sys.stderr)
        return None
    try:
        return sum(open_for_reading(path).namespace_counts().values())
    except (NotACacheFile, OSError) as error:
        print(f"--extend: {path} cannot be read as a tuning cache ({error}); without --extend the run writes a "
              "new file", file=sys.stderr)
        return None


if __name__ == "__main__":
    sys.exit(main())
