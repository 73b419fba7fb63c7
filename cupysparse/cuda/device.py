"""Attributes of a CUDA device that size launches: its multiprocessors, the threads they hold at once
and its L2 cache. Each is a driver query or two per device and process, then remembered."""

from __future__ import annotations

import functools

from cupysparse.cuda.backend import cupy_module

WARP_SIZE = 32  # threads of a warp, on every CUDA device


def _attribute(name: str, device_id: int) -> int:
    # One attribute query: `Device.attributes` reads every attribute (a millisecond on first use).
    runtime = cupy_module().cuda.runtime
    return int(runtime.deviceGetAttribute(getattr(runtime, name), device_id))


@functools.cache
def multiprocessors(device_id: int) -> int:
    """The device's streaming multiprocessors (SMs)."""
    return _attribute("cudaDevAttrMultiProcessorCount", device_id)


@functools.cache
def resident_threads(device_id: int) -> int:
    """Threads the device holds at once: its SMs times the threads each one holds."""
    return multiprocessors(device_id) * _attribute("cudaDevAttrMaxThreadsPerMultiProcessor", device_id)


@functools.cache
def l2_bytes(device_id: int) -> int:
    """The size of the device's L2 cache."""
    return _attribute("cudaDevAttrL2CacheSize", device_id)
