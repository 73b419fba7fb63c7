"""What the benchmark scripts share: timing (the tuner's own: CUDA events on the GPU, the host clock
on the CPU), peak-memory meters, spconv 2.x's layer as the external baseline, and CSV output."""

from __future__ import annotations

import contextlib
import csv
import importlib
import sys
import tracemalloc

import numpy as np

from cupysparse.cuda import backend
from cupysparse.data.scenes import make_scene
from cupysparse.cuda.timing import median_time_ms
from cupysparse.scripts import arguments
from cupysparse.networks.weight_layouts import to_spconv_weight


def add_layer_arguments(parser, channels: int) -> None:
    """The options of a one-layer benchmark: --num-voxels of the indoor scene, --channels (in = out,
    default `channels`) and --dtype."""
    parser.add_argument("--num-voxels", type=arguments.count, default=100_000, help="voxels of the scene")
    parser.add_argument("--channels", type=int, default=channels, help="input = output channels")
    parser.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"),
                        help="dtype of the features and weights")


def indoor_layer_coordinates(num_voxels: int) -> np.ndarray:
    """int32 `[N, 4]`, N ≤ num_voxels: one indoor scene (seed 0), batch index first."""
    voxels = make_scene("indoor", num_voxels, seed=0).voxel_coordinates()[:num_voxels]
    return np.concatenate([np.zeros((len(voxels), 1), np.int32), voxels], axis=1)


def make_timer(device: str):
    """`measure(fn, warmup, repeats) -> median milliseconds` for `device` ("cpu" or "cuda")."""
    return lambda fn, warmup, repeats: median_time_ms(fn, device == "cuda", warmup, repeats)


def time_samples_ms(fn, device: str, warmup: int, repeats: int, iterations: int) -> list[float]:
    """`repeats` samples of the mean time of one call, each timed over `iterations` back-to-back
    calls queued behind one untimed call (`batch_behind_a_call_ms`; CUDA events around the whole
    batch on the GPU, so short kernels are not dominated by the event resolution), after `warmup`
    untimed calls."""
    (samples,) = interleaved_samples_ms([(fn, contextlib.nullcontext)], device, warmup, repeats, iterations)
    if isinstance(samples, Exception):
        raise samples
    return samples


def interleaved_samples_ms(calls, device: str, warmup: int, repeats: int, iterations: int) -> list:
    """`time_samples_ms` of several calls taking turns sample by sample, so that what drifts during a
    run (clocks under the power cap, the host's load) reaches all of them alike and their ratios hold.
    Each call is a pair `(fn, setting)`: `setting()` is a context manager entered around each of its
    batches (an fp32 precision, say). Returns per call its samples, or the exception it raised: that
    call then leaves the rotation and the others go on."""
    results: list = [[] for _ in calls]

    def batch(index: int, count: int, timed: bool) -> None:
        fn, setting = calls[index]
        try:
            with setting():
                if timed:
                    results[index].append(batch_behind_a_call_ms(fn, count, device))
                else:
                    for _ in range(count):
                        fn()
        except Exception as error:  # noqa: BLE001 - one failing call (out of memory, say) must not stop the rest
            results[index] = error

    for index in range(len(calls)):
        batch(index, warmup, timed=False)
    for _ in range(repeats):
        for index in range(len(calls)):
            if isinstance(results[index], list):
                batch(index, iterations, timed=True)
    return results


def batch_behind_a_call_ms(fn, count: int, device: str) -> float:
    """The mean time of `count` back-to-back calls of `fn` queued behind one untimed call of their own.
    That call leaves the caches as `fn` itself leaves them, whatever ran before: after a batch of
    spconv's, a 0.05 ms layer's batch took 10-20% longer without it on an H100. On the GPU the host
    queues the first timed call while that one runs, so the events hold the calls' GPU work back to
    back, plus whatever host time the GPU waits for beyond it; starting from an idle GPU instead added
    the first launch's host time, which moved by tens of microseconds with what ran before."""
    fn()
    if device != "cuda":

        def run():
            for _ in range(count):
                fn()

        return median_time_ms(run, on_gpu=False, warmup=0, repeats=1) / count
    cupy = backend.cupy_module()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(count):
        fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / count


def write_csv(rows: list[dict], path: str, fieldnames=None) -> None:
    """Write `rows` (dicts with the same keys; `fieldnames` when there may be none) to `path` and say so."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(fieldnames or rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


def torch_module():
    """The torch module, or None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def torch_cuda():
    """The torch module when it is importable and sees a GPU, else None."""
    torch = torch_module()
    return torch if torch is not None and torch.cuda.is_available() else None


def route_cupy_through_torch(torch) -> None:
    """One memory pool: CuPy allocates from torch's caching allocator, so its statistics see both.
    Each block is for CuPy's current stream, named outright: torch's own lookup of its current stream
    was about half the cost of an allocation (cProfile), which a 100K-voxel layer pays several times a call."""
    import cupy

    current_stream = cupy.cuda.get_current_stream
    allocator = cupy.cuda.PythonFunctionAllocator(
        lambda size, device: torch.cuda.caching_allocator_alloc(size, device, current_stream().ptr),
        lambda pointer, device: torch.cuda.caching_allocator_delete(pointer),
    )
    cupy.cuda.set_allocator(allocator.malloc)


def peak_extra_bytes(torch, fn) -> int | None:
    """Peak bytes allocated by one call of `fn` beyond what was allocated before (torch's allocator
    statistics); None without torch."""
    if torch is None:
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak


class TorchAllocatorMeter:
    """GPU peak through torch's caching allocator, with CuPy routed through it: one pool, both libraries."""

    source = "torch allocator (CuPy routed through it)"

    def __init__(self, torch):
        self._torch = torch
        route_cupy_through_torch(torch)

    def peak_extra_bytes(self, fn) -> int | None:
        return peak_extra_bytes(self._torch, fn)

    def limit(self, max_bytes: int) -> None:
        total = self._torch.cuda.get_device_properties(self._torch.cuda.current_device()).total_memory
        self._torch.cuda.set_per_process_memory_fraction(min(1.0, max_bytes / total))

    def release(self) -> None:
        self._torch.cuda.empty_cache()


class CupyPoolMeter:
    """GPU peak without torch: an allocator hook in front of CuPy's pool samples the bytes in use at
    every allocation (the peak can only rise at an allocation, so this sees it exactly)."""

    source = "CuPy allocator hook"

    def __init__(self, cupy):
        self._cupy = cupy
        self._pool = cupy.get_default_memory_pool()
        self._peak = 0
        cupy.cuda.set_allocator(self._malloc)

    def _malloc(self, size: int):
        memory = self._pool.malloc(size)
        self._peak = max(self._peak, self._pool.used_bytes())
        return memory

    def peak_extra_bytes(self, fn) -> int:
        stream = self._cupy.cuda.get_current_stream()
        stream.synchronize()
        base = self._peak = self._pool.used_bytes()
        result = fn()
        stream.synchronize()
        del result
        return self._peak - base

    def limit(self, max_bytes: int) -> None:
        self._pool.set_limit(size=max_bytes)

    def release(self) -> None:
        self._pool.free_all_blocks()


class TracemallocMeter:
    """CPU peak of the NumPy allocations one call makes (NumPy reports them to tracemalloc; torch's
    CPU allocator does not, so torch's own memory is not seen)."""

    source = "tracemalloc (NumPy allocations)"

    def peak_extra_bytes(self, fn) -> int:
        was_tracing = tracemalloc.is_tracing()
        if not was_tracing:
            tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            result = fn()
            peak = tracemalloc.get_traced_memory()[1] - base
            del result
        finally:
            if not was_tracing:
                tracemalloc.stop()
        return peak

    def limit(self, max_bytes: int) -> None:
        """Nothing to enforce on the host: the estimated footprint is checked before each run instead."""

    def release(self) -> None:
        """NumPy returns its memory on its own."""


def memory_meter(device: str):
    """The peak-memory meter of `device`: torch's allocator when torch sees the GPU, else a CuPy
    allocator hook; tracemalloc on the CPU."""
    if device == "cpu":
        return TracemallocMeter()
    torch = torch_cuda()
    return TorchAllocatorMeter(torch) if torch is not None else CupyPoolMeter(backend.cupy_module())


class SpconvLayer:
    """spconv 2.x's convolution of one layer, on the same voxels and weights as ours: `SubMConv3d` at
    stride 1, else `SparseConv3d` with padding 0, whose output voxels and pairs are ours only for a
    2³ kernel at stride 2 (`spconv_matches_geometry`). Its kernel map is built by the first forward
    (in `__init__`) and cached on the input tensor, as both libraries do within a network pass.
    `allow_tf32`: fp32 layers may run spconv's TF32 kernels (its SPCONV_ALLOW_TF32, a module
    constant read on every call, so each call sets it)."""

    def __init__(self, spconv, torch, coords_numpy, features, weight, grad, kernel_size: int, stride: int = 1,
                 batch_size: int = 1, allow_tf32: bool = False):
        self._constants = importlib.import_module("spconv.constants")
        self.allow_tf32 = allow_tf32
        shift = coords_numpy[:, 1:].min(axis=0) // stride * stride  # keeps floor(coordinate / stride) ours
        shifted = coords_numpy.copy()
        shifted[:, 1:] -= shift
        spatial_shape = ((shifted[:, 1:].max(axis=0) // stride + 2) * stride).tolist()
        c_in, c_out = weight.shape[1], weight.shape[2]
        x = torch.as_tensor(features, device="cuda").requires_grad_(True)
        if stride == 1:
            layer = spconv.SubMConv3d(c_in, c_out, kernel_size, bias=False, indice_key="subm")
        else:
            layer = spconv.SparseConv3d(c_in, c_out, kernel_size, stride=stride, padding=0, bias=False)
        self.layer = layer.cuda().to(x.dtype)
        with torch.no_grad():
            self.layer.weight.copy_(torch.as_tensor(to_spconv_weight(backend.to_numpy(weight), kernel_size)))
        self.grad = torch.as_tensor(grad, device="cuda")
        self.tensor = spconv.SparseConvTensor(x, torch.from_numpy(shifted).cuda(), spatial_shape, batch_size)
        self.output = self.forward().detach()
        self._graph_output = None

    def forward(self):
        self._constants.SPCONV_ALLOW_TF32 = self.allow_tf32
        return self.layer(self.tensor).features

    def backward(self):
        """Both gradients of one forward graph, kept for repeated calls."""
        if self._graph_output is None:
            self._graph_output = self.forward()
        self._constants.SPCONV_ALLOW_TF32 = self.allow_tf32
        self._graph_output.backward(self.grad, retain_graph=True)

    def forward_backward(self):
        self.forward().backward(self.grad)


def spconv_matches_geometry(kernel_size: int, stride: int) -> bool:
    """Whether spconv's layer of this size and stride has our output voxels and pairs: submanifold,
    or kernel size = stride with offsets 0..k-1 on both sides (ours start at -((k - 1) // 2))."""
    return stride == 1 or (kernel_size == stride and (kernel_size - 1) // 2 == 0)


def spconv_layer(torch, coords_numpy, features, weight, grad, kernel_size: int, stride: int = 1,
                 batch_size: int = 1, allow_tf32: bool = False) -> SpconvLayer | None:
    """spconv's layer (see `SpconvLayer`), or None with a message when spconv is not importable."""
    try:
        import spconv.pytorch as spconv
    except Exception as error:  # spconv absent or broken: the benchmark still runs without it
        print(f"spconv not importable ({type(error).__name__}: {error}); cupysparse only", file=sys.stderr)
        return None
    return SpconvLayer(spconv, torch, np.asarray(coords_numpy), features, weight, grad, kernel_size, stride,
                       batch_size, allow_tf32)
