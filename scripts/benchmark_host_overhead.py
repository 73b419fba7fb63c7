"""Host time per convolution call: what Python and the driver spend before the GPU has the work.

On the indoor scene (default 100K voxels, one batch item), submanifold 3³, C → C channels, with the
kernel map built and the tuner's choice made, every call is queued --calls times behind a wait kernel
that keeps the GPU busy meanwhile: the host clock then counts the host alone, and the GPU never
waits for it. Per call, the median of --repeats such batches. Beside it, the GPU time per call of the
same calls back to back (CUDA events): where the host time passes it, the layer is host-bound, and
faster kernels would not make it faster.

Rows: the core's `conv_forward` and `conv_backward` (dgrad and wgrad) on CuPy arrays; with PyTorch,
the adapter's `SubMConv3d` forward and its forward + backward through autograd; and the floor every
call pays per output and per kernel: one allocation from CuPy's pool and one launch of an empty
kernel through a prepared launch (`compile.PreparedLaunch`). `launches` counts the prepared launches
of one call (torch's own kernels, e.g. autograd's, are not counted).

    cupysparse-benchmark-host-overhead --num-voxels 100000 --channels 32 --dtype float16 --csv host.csv
    cupysparse-benchmark-host-overhead --csv results/host.csv --markdown results/host.md
    cupysparse-benchmark-host-overhead --from-csv results/host.csv --markdown results/host.md

--markdown writes a results page from the --csv file and the run's metadata (command, device), which
goes to NAME.json beside NAME.csv; --from-csv measures nothing and writes the page again from such
files.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

import numpy as np

from cupysparse.cuda import backend
from cupysparse.cuda import compile
from cupysparse.cuda.timing import WAIT_KERNELS
from cupysparse.cuda.dtypes import as_feature_dtype
from cupysparse.functional.convolution import conv_backward, conv_forward, select_backward, select_forward
from cupysparse.geometry.kernel_map import submanifold_map
from cupysparse.scripts.analyze_benchmarks import (
    add_results_page_arguments,
    check_results_page_arguments,
    relative,
    write_metadata,
    write_results_page,
)
from cupysparse.scripts.benchmarking import add_layer_arguments, indoor_layer_coordinates, time_samples_ms, write_csv

PROGRAM = "cupysparse-benchmark-host-overhead"
# The wait ahead of each batch: long enough for the slowest call's batch to queue behind it.
WAIT_NS_PER_CALL = 2_000_000


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_layer_arguments(parser, channels=32)
    parser.add_argument("--calls", type=int, default=50, help="calls queued per batch")
    parser.add_argument("--repeats", type=int, default=15, help="batches per row")
    parser.add_argument("--csv", metavar="FILE", help="also write the rows to this CSV file")
    add_results_page_arguments(parser)
    return parser


def parse_args(argv=None, prog: str | None = None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    check_results_page_arguments(parser, args, PROGRAM, argv)
    return args


def host_us_per_call(fn, calls: int, repeats: int) -> list[float]:
    """Host microseconds per call of `fn`, one sample per batch of `calls` calls queued behind a wait
    kernel (so the GPU never holds the host back), after two untimed calls."""
    cupy = backend.cupy_module()
    wait = WAIT_KERNELS.get("wait_nanoseconds")
    fn()
    fn()
    samples = []
    for _ in range(repeats):
        cupy.cuda.get_current_stream().synchronize()
        wait((1,), (1,), (np.uint64(WAIT_NS_PER_CALL * calls),))
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - began) * 1e6 / calls)
    cupy.cuda.get_current_stream().synchronize()
    return samples


def launches_per_call(fn) -> int:
    """The prepared launches one call of `fn` makes."""
    counted = []
    launch = compile.PreparedLaunch.launch

    def counting(self, *arguments, **keywords):
        counted.append(self)
        return launch(self, *arguments, **keywords)

    compile.PreparedLaunch.launch = counting
    try:
        fn()
    finally:
        compile.PreparedLaunch.launch = launch
    return len(counted)


def core_calls(coordinates, channels: int, dtype):
    """The core's forward and backward over a submanifold map of `coordinates`, selected already."""
    cupy = backend.cupy_module()
    kernel_map = submanifold_map(cupy.asarray(coordinates), 3).derive_formats()
    rng = np.random.default_rng(0)
    features = cupy.asarray(rng.standard_normal((kernel_map.num_in, channels)).astype(dtype))
    weight = cupy.asarray((rng.standard_normal((27, channels, channels)) / np.sqrt(27 * channels)).astype(dtype))
    grad_output = cupy.asarray(rng.standard_normal((kernel_map.num_out, channels)).astype(dtype))
    chosen = (select_forward(features, weight, kernel_map).algorithm.name,
              select_backward(grad_output, features, weight, kernel_map).algorithm.name)
    return chosen, {
        "core conv_forward": lambda: conv_forward(features, weight, kernel_map),
        "core conv_backward": lambda: conv_backward(grad_output, features, weight, kernel_map),
    }


def adapter_calls(torch, coordinates, channels: int, dtype_name: str) -> dict:
    from cupysparse.adapters import torch as cst

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    coordinates = torch.from_numpy(coordinates).cuda()
    features = torch.randn(len(coordinates), channels, device="cuda", dtype=dtype, requires_grad=True)
    x = cst.SparseTensor(coordinates, features)
    conv = cst.SubMConv3d(channels, channels, 3, bias=False).cuda().to(dtype)
    grad_output = torch.randn(len(coordinates), channels, device="cuda", dtype=dtype)

    def forward():
        with torch.no_grad():
            return conv(x).features

    def step():
        features.grad = conv.weight.grad = None  # as after `optimizer.zero_grad()`
        conv(x).features.backward(grad_output)

    return {"adapter forward": forward, "adapter forward + backward": step}


def floor_calls(channels: int, num_voxels: int, dtype) -> dict:
    cupy = backend.cupy_module()
    empty_launch = compile.PreparedLaunch(WAIT_KERNELS.get("wait_nanoseconds"), (1,), (1,), (np.uint64(0),))
    stream = cupy.cuda.get_current_stream().ptr
    return {
        "floor: one allocation": lambda: cupy.ndarray((num_voxels, channels), dtype),  # as the planned calls make theirs
        "floor: one launch": lambda: empty_launch.launch(stream),
    }


# The results page: generated whole from the CSV and its metadata, so it is never edited by hand

METHOD = (
    "Each call runs on a submanifold 3³ layer of the indoor scene with its kernel map built and the tuner's "
    "choice made. Host µs: the host clock per call over batches of calls queued behind a wait kernel, so the "
    "GPU never holds the host back (median and quartiles of the batches). GPU µs: CUDA events per call of "
    "the same calls back to back. Where host time passes GPU time, the layer is host-bound. `launches` counts "
    "our prepared launches per call (torch's own kernels are not counted); the floor rows are what every call "
    "pays per output (one allocation from CuPy's pool) and per kernel (one launch of an empty kernel)."
)


def results_page(rows: list[dict], metadata: dict, csv_path: str, page_path: str) -> str:
    """The markdown results page of `rows` (a CSV of this benchmark, as strings)."""
    first = rows[0]
    data_link = relative(csv_path, os.path.dirname(os.path.abspath(page_path)))
    device = metadata.get("device", "an unnamed device")
    lines = [
        "# Host time per convolution call", "",
        f"Measured on **{device}**: {int(first['num_voxels']):,} voxels, {first['channels']} → {first['channels']} "
        f"channels, {first['dtype']}. Data: [{os.path.basename(csv_path)}]({data_link}).", "",
        "| call | launches | host µs | host µs, quartiles | GPU µs | host / GPU |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for row in rows:
        gpu = (row["gpu_us"], row["host_over_gpu"]) if row["gpu_us"] else ("", "")
        lines.append(f"| {row['call']} | {row['launches']} | {row['host_us']} | "
                     f"{row['host_us_q1']}-{row['host_us_q3']} | {gpu[0]} | {gpu[1]} |")
    lines += ["", METHOD, "", "Reproduce (the measurement, then this page from its files):", "", "```bash"]
    if metadata.get("command"):
        lines.append(metadata["command"])
    lines += [shlex.join([PROGRAM, "--from-csv", csv_path, "--markdown", page_path]), "```"]
    return "\n".join(lines)


def main(argv=None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    if args.from_csv:
        write_results_page(args.from_csv, args.markdown, results_page, PROGRAM)
        return 0
    if not backend.gpu_available():
        print("this benchmark needs a CUDA GPU: host time per call is what a call costs before the GPU runs it",
              file=sys.stderr)
        return 2
    torch = None
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: the adapter's rows are left out", file=sys.stderr)
    dtype = as_feature_dtype(args.dtype)
    coordinates = indoor_layer_coordinates(args.num_voxels)
    chosen, calls = core_calls(coordinates, args.channels, dtype)
    if torch is not None and torch.cuda.is_available():
        calls |= adapter_calls(torch, coordinates, args.channels, args.dtype)
    floors = floor_calls(args.channels, len(coordinates), dtype)
    calls |= floors
    print(f"{len(coordinates):,} voxels, {args.channels} -> {args.channels}, {args.dtype}, on "
          f"{backend.describe_device('cuda')}; forward runs {chosen[0]}, backward {chosen[1]}")
    print(f"{'call':<28} {'launches':>8} {'host us':>9} {'quartiles':>15} {'GPU us':>8} {'host / GPU':>10}")
    rows = []
    for name, fn in calls.items():
        host = host_us_per_call(fn, args.calls, args.repeats)
        quartiles = statistics.quantiles(host, n=4)
        host_us = statistics.median(host)
        launches = launches_per_call(fn)
        # The floor's rows do no work worth timing on the GPU.
        floor = name in floors
        gpu_us = None if floor else 1000 * float(np.median(time_samples_ms(fn, "cuda", 2, args.repeats, args.calls)))
        rows.append({"call": name, "num_voxels": len(coordinates), "channels": args.channels, "dtype": args.dtype,
                     "launches": launches, "host_us": round(host_us, 2), "host_us_q1": round(quartiles[0], 2),
                     "host_us_q3": round(quartiles[2], 2), "gpu_us": None if floor else round(gpu_us, 2),
                     "host_over_gpu": None if floor else round(host_us / gpu_us, 3)})
        gpu = ("-", "-") if floor else (f"{gpu_us:.1f}", f"{host_us / gpu_us:.2f}")
        print(f"{name:<28} {launches:>8} {host_us:>9.1f} {f'{quartiles[0]:.1f}-{quartiles[2]:.1f}':>15} "
              f"{gpu[0]:>8} {gpu[1]:>10}", flush=True)
    if args.csv:
        write_csv(rows, args.csv)
    if args.markdown:
        write_metadata(args.csv, {"command": args.command, "device": backend.describe_device("cuda")})
        write_results_page(args.csv, args.markdown, results_page, PROGRAM)
    return 0


if __name__ == "__main__":
    sys.exit(main())
