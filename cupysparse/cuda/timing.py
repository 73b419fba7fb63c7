"""The GPU time of one call alone, as the tuner ranks candidates by it.

Events around a call on an idle GPU also count the host's time between the call's launches: the
GPU starts the first kernel only once Python has queued it, and waits again whenever the host lags
behind. On layers of 0.1-1 ms that host time (tens of microseconds, different per algorithm) ranked
tiles differently from back-to-back calls, where the host runs ahead of the GPU. `QueuedTimer`
queues a wait kernel ahead of each timed call, long enough for the host to queue the whole call
behind it, so that the events bracket the GPU's work alone.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from cupysparse.cuda.backend import cupy_module, is_cupy_array
from cupysparse.cuda.compile import KernelSource

WAIT_KERNELS = KernelSource("device_wait.cu", ("wait_nanoseconds",))

# The first wait; each sample then waits twice the host time the previous one took to queue its call,
# at least SHORTEST_WAIT_NS.
FIRST_WAIT_NS = 200_000
SHORTEST_WAIT_NS = 50_000
# A call whose host time outlasts even this wait (one that synchronises with the GPU, say) is timed
# as it ran: no wait can hide its host time.
LONGEST_WAIT_NS = 20_000_000


class QueuedTimer:
    """Times calls on the current stream, each behind a wait kernel (see the module docstring).

    A sample whose call took the host longer to queue than the wait lasted may hold host time: it is
    dropped and taken again behind a wait twice that long, up to `LONGEST_WAIT_NS`."""

    def __init__(self):
        self.wait_ns = FIRST_WAIT_NS
        self.retaken = 0  # samples taken again behind a longer wait

    def time_ms(self, run) -> float:
        """The GPU time of one call of `run`, in milliseconds."""
        cupy = cupy_module()
        wait = WAIT_KERNELS.get("wait_nanoseconds")
        while True:
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            began = time.perf_counter()
            wait((1,), (1,), (np.uint64(int(self.wait_ns)),))
            start.record()
            run()
            stop.record()
            host_ns = (time.perf_counter() - began) * 1e9
            stop.synchronize()
            if host_ns < self.wait_ns or self.wait_ns >= LONGEST_WAIT_NS:
                self.wait_ns = min(max(2 * host_ns, SHORTEST_WAIT_NS), LONGEST_WAIT_NS)
                return cupy.cuda.get_elapsed_time(start, stop)
            self.wait_ns = min(2 * host_ns, LONGEST_WAIT_NS)
            self.retaken += 1


# A timed sample: warm-up calls first, then the median of several (the benchmarks' and the tuner's CPU timing).
WARMUP_RUNS = 1
TIMED_RUNS = 3


def median_time_ms(run, on_gpu: bool, warmup: int = WARMUP_RUNS, repeats: int = TIMED_RUNS) -> float:
    """Median of `repeats` timed calls of `run` after `warmup` untimed ones."""
    return statistics.median(sample_times_ms(run, on_gpu, warmup, repeats))


def sample_times_ms(run, on_gpu: bool, warmup: int = WARMUP_RUNS, repeats: int = TIMED_RUNS) -> list[float]:
    """The times of `repeats` timed calls of `run` after `warmup` untimed ones, in milliseconds."""
    for _ in range(warmup):
        run()
    samples = []
    if on_gpu:
        cupy = cupy_module()
        cupy.cuda.get_current_stream().synchronize()
        for _ in range(repeats):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            run()
            stop.record()
            stop.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, stop))
    else:
        for _ in range(repeats):
            begin = time.perf_counter()
            _synchronize(run())
            samples.append((time.perf_counter() - begin) * 1e3)
    return samples


def _synchronize(result) -> None:
    if is_cupy_array(result) or (isinstance(result, tuple) and any(is_cupy_array(r) for r in result)):
        cupy_module().cuda.get_current_stream().synchronize()
