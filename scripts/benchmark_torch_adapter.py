"""What the PyTorch adapter costs over calling the CuPy core directly, side by side in one run.

On the indoor scene (default 100K voxels, one batch item), submanifold 3³ at 64 → 64 channels in
fp16, with the kernel map built and the tuner warm, it times the core's `conv_forward` (and
`conv_backward`) on CuPy arrays against the adapter's `SubMConv3d` on torch tensors over the
same map, forward and forward + backward (autograd), by CUDA events, median of --repeats samples
after --warmup runs. ratio = adapter / core (target ≤ 1.05). Two ways, both reported:
- steady: --calls calls back to back between two events, per call, as a network issues its layers
  (the host queues work while the GPU runs it; host time shows only where it exceeds GPU time);
- isolated: one call between two events, synchronised after each (the latency of a lone call:
  every microsecond of host work before the first launch shows).

    cupysparse-benchmark-torch-adapter --num-voxels 100000 --channels 64 --csv adapter.csv

`--profile FILE` also writes a cProfile of --repeats adapter forward + backward steps, with autograd's
backward run in the calling thread (cProfile sees one thread only), and prints its top entries.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

import numpy as np

from cupysparse.cuda import backend
from cupysparse.cuda.dtypes import as_feature_dtype
from cupysparse.functional.convolution import conv_backward, conv_forward
from cupysparse.scripts.benchmarking import (
    add_layer_arguments,
    indoor_layer_coordinates,
    make_timer,
    time_samples_ms,
    write_csv,
)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_layer_arguments(parser, channels=64)
    parser.add_argument("--warmup", type=int, default=5, help="untimed runs before the timed ones")
    parser.add_argument("--repeats", type=int, default=50, help="timed runs (the median is reported)")
    parser.add_argument("--calls", type=int, default=20, help="calls per steady sample")
    parser.add_argument("--csv", metavar="FILE", help="also write the rows to this CSV file")
    parser.add_argument("--profile", metavar="FILE", help="write a cProfile of the adapter's steps to FILE")
    return parser


def parse_args(argv=None, prog: str | None = None):
    parser = build_parser(prog)
    return parser.parse_args(argv)


def profile_steps(torch, step, repeats: int, path: str) -> None:
    profiler = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        profiler.runcall(lambda: [step() for _ in range(repeats)])
    profiler.dump_stats(path)
    print(f"\nprofile of {repeats} adapter steps written to {path}; top entries by own time:")
    pstats.Stats(path).sort_stats("tottime").print_stats(25)


def main(argv=None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    try:
        import torch
    except ImportError:
        print("this benchmark needs PyTorch: pip install 'cupysparse[torch]'", file=sys.stderr)
        return 2
    if not (backend.gpu_available() and torch.cuda.is_available()):
        print("this benchmark needs a CUDA GPU visible to both CuPy and PyTorch", file=sys.stderr)
        return 2
    from cupysparse.adapters import torch as cst

    cupy = backend.cupy_module()
    coords = torch.from_numpy(indoor_layer_coordinates(args.num_voxels)).cuda()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    features = torch.randn(len(coords), args.channels, device="cuda", dtype=dtype, requires_grad=True)
    x = cst.SparseTensor(coords, features)
    conv = cst.SubMConv3d(args.channels, args.channels, 3, bias=False).cuda().to(dtype)
    kernel_map = x.kernel_map(3).kernel_map.derive_formats()
    dy = torch.randn(len(coords), args.channels, device="cuda", dtype=dtype)

    core_x = cupy.asarray(features.detach().float().cpu().numpy()).astype(as_feature_dtype(args.dtype))
    core_w = cupy.asarray(conv.weight.detach().float().cpu().numpy()).astype(as_feature_dtype(args.dtype))
    core_dy = cupy.asarray(dy.float().cpu().numpy()).astype(as_feature_dtype(args.dtype))

    def core_forward():
        return conv_forward(core_x, core_w, kernel_map)

    def core_step():
        conv_forward(core_x, core_w, kernel_map)
        return conv_backward(core_dy, core_x, core_w, kernel_map)

    def adapter_forward():
        with torch.no_grad():
            return conv(x).features

    def adapter_step():
        # Gradients start from None each step, as after `optimizer.zero_grad()`: the core step
        # accumulates nothing either.
        features.grad = conv.weight.grad = None
        out = conv(x).features
        out.backward(dy)
        return out

    isolated = make_timer("cuda")
    timers = {
        "steady": lambda fn: float(np.median(time_samples_ms(fn, "cuda", args.warmup, args.repeats, args.calls))),
        "isolated": lambda fn: isolated(fn, args.warmup, args.repeats),
    }
    rows = []
    for mode, measure in timers.items():
        for phase, core_fn, adapter_fn in (("forward", core_forward, adapter_forward),
                                           ("forward+backward", core_step, adapter_step)):
            core_ms, adapter_ms = measure(core_fn), measure(adapter_fn)
            rows.append({"num_voxels": len(coords), "channels": args.channels, "dtype": args.dtype, "mode": mode,
                         "phase": phase, "core_ms": round(core_ms, 4), "adapter_ms": round(adapter_ms, 4),
                         "ratio": round(adapter_ms / core_ms, 3)})
            print(f"{mode:<9} {phase:<17} core {core_ms:8.4f} ms   adapter {adapter_ms:8.4f} ms   "
                  f"ratio {adapter_ms / core_ms:.3f}", flush=True)
    print(f"on {backend.describe_device('cuda')}, {len(coords):,} voxels, {args.channels} -> {args.channels}, "
          f"{args.dtype}")
    if args.csv:
        write_csv(rows, args.csv)
    if args.profile:
        profile_steps(torch, adapter_step, args.repeats, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
