"""What the benchmark scripts share: timing (CUDA events on the GPU, the host clock on the CPU) and CSV output."""

from __future__ import annotations

import csv
import statistics
import time


def make_timer(device: str):
    """`measure(fn, warmup, repeats) -> median milliseconds` for `device` ("cpu" or "cuda")."""
    if device == "cpu":

        def time_cpu(fn, warmup, repeats):
            for _ in range(warmup):
                fn()
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - start) * 1e3)
            return statistics.median(samples)

        return time_cpu
    import cupy

    def time_gpu(fn, warmup, repeats):
        for _ in range(warmup):
            fn()
        cupy.cuda.Device().synchronize()
        samples = []
        for _ in range(repeats):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, stop))
        return statistics.median(samples)

    return time_gpu


def write_csv(rows: list[dict], path: str) -> None:
    """Write `rows` (dicts with the same keys) to `path` and say so."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
