"""The tuner's timer on a GPU: a call's device time without the host's time between its launches.

The waits here are known lengths of GPU work (`wait_nanoseconds`), the host pauses known lengths of
host time; what is checked is which of the two the timer counts, with margins of milliseconds."""

import time

import numpy as np
import pytest

from cupysparse.cuda import timing as device_timing
from cupysparse.cuda.backend import cupy_module
from cupysparse.cuda.timing import WAIT_KERNELS, QueuedTimer

# Another process's kernels on the GPU would lengthen the measured waits.
pytestmark = [pytest.mark.gpu, pytest.mark.alone]

MS = 1_000_000  # nanoseconds


def _gpu_wait(nanoseconds: int) -> None:
    WAIT_KERNELS.get("wait_nanoseconds")((1,), (1,), (np.uint64(nanoseconds),))


def _events_around(run) -> float:
    cupy = cupy_module()
    cupy.cuda.get_current_stream().synchronize()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    # Reached before the call starts: another process's turn on the GPU cannot delay it into the call.
    start.synchronize()
    run()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop)


def test_the_wait_kernel_holds_the_gpu_for_the_time_asked():
    _gpu_wait(1000)  # loaded before anything is timed
    for milliseconds in (1, 4):
        measured = _events_around(lambda: _gpu_wait(milliseconds * MS))
        assert milliseconds <= measured < milliseconds + 1


def _gpu_work_with_a_host_pause(gpu_ms: int, host_pause_s: float):
    """A call whose GPU works `gpu_ms` and whose host pauses between its two launches."""
    def run():
        _gpu_wait(gpu_ms * MS)
        time.sleep(host_pause_s)
        cupy_module().zeros(1)
    return run


def test_events_around_a_lone_call_count_the_hosts_pause_and_the_timer_does_not():
    run = _gpu_work_with_a_host_pause(gpu_ms=1, host_pause_s=0.006)
    run()
    # The GPU idled while the host paused: the events span the 6 ms pause, not the 1 ms of work.
    assert _events_around(run) >= 5
    timer = QueuedTimer()
    samples = [timer.time_ms(run) for _ in range(3)]
    assert all(1 <= sample < 3 for sample in samples), samples
    # The first wait (0.2 ms) was shorter than the host's 6 ms: that sample was taken again, once.
    assert timer.retaken == 1


def test_a_call_that_waits_for_the_gpu_is_timed_as_it_ran(monkeypatch):
    """No wait can hide host time that itself waits for the GPU: once the longest wait did not, the
    sample stands as measured."""
    monkeypatch.setattr(device_timing, "LONGEST_WAIT_NS", 2 * MS)

    def synchronising():
        _gpu_wait(MS // 2)
        cupy_module().cuda.get_current_stream().synchronize()

    timer = QueuedTimer()
    sample = timer.time_ms(synchronising)
    assert sample >= 0.5
    assert timer.retaken >= 1 and timer.wait_ns == 2 * MS
