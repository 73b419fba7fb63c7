"""Zero-copy between torch tensors and the core's arrays, and the context every launch runs in.

CUDA tensors become CuPy arrays over the same device memory (built from the pointer: a DLPack
exchange costs tens of microseconds per tensor, too much for a call that should cost a few), and
arrays the core allocated inside `on_torch_stream` come back as views of the torch allocation
they live in (any other array goes through DLPack). CPU tensors become NumPy arrays through
`Tensor.numpy()` and back through `torch.from_numpy`. Nothing is copied either way. bfloat16,
which NumPy does not know, travels as int16 bits and is viewed as `ml_dtypes.bfloat16` on the core
side. Tensors are detached before export: autograd is the adapter's business, not the core's.

`on_torch_stream(device)` makes the core run where torch runs: on the tensor's GPU, on torch's
current stream (so no synchronisation is needed either way, and CUDA-graph capture sees every
launch), with every CuPy allocation taken from torch's caching allocator (one memory pool, and
inside graph capture the graph's private pool). For CPU tensors it holds NumPy's BLAS to one thread
while the core runs (through threadpoolctl, a dependency; without it, nothing changes):
a second thread pool whose workers spin between the GEMMs starves torch's own between its operations.
On 2 cores also running other work, MinkUNet18's forward on 20K voxels took 3 to 6 times as long with
both pools at 2 threads (on idle cores, about as long).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref

import numpy as np
import torch

from cupysparse.cuda.backend import cupy_module
from cupysparse.cuda.dtypes import BFLOAT16


_NUMPY_DTYPES = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
}
_TORCH_DTYPES = {np.dtype(value): key for key, value in _NUMPY_DTYPES.items()}
# Device allocations made for the core by `_torch_allocation`, by address: the torch tensors whose
# memory CuPy arrays use, so `from_core` can hand out views of them.
_allocations: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def _cupy_view(tensor: torch.Tensor):
    cupy = cupy_module()
    dtype = np.dtype(_NUMPY_DTYPES[tensor.dtype])
    memory = cupy.cuda.UnownedMemory(tensor.data_ptr(), tensor.numel() * dtype.itemsize, tensor, tensor.device.index)
    strides = tuple(stride * dtype.itemsize for stride in tensor.stride())
    return cupy.ndarray(tuple(tensor.shape), dtype, cupy.cuda.MemoryPointer(memory, 0), strides)


def core_dtype(dtype: torch.dtype) -> np.dtype | None:
    """The dtype the core sees for torch tensors of `dtype` (bfloat16: ml_dtypes'), None when it has none."""
    if dtype == torch.bfloat16:
        return None if BFLOAT16 is None else np.dtype(BFLOAT16)
    return np.dtype(_NUMPY_DTYPES[dtype]) if dtype in _NUMPY_DTYPES else None


def to_core(tensor: torch.Tensor):
    """The NumPy (CPU) or CuPy (CUDA) view of `tensor`'s memory."""
    tensor = tensor.detach()
    bf16 = tensor.dtype == torch.bfloat16
    if bf16:
        if BFLOAT16 is None:
            raise TypeError("bfloat16 tensors need the ml_dtypes package (pip install ml_dtypes)")
        tensor = tensor.view(torch.int16)
    if tensor.device.type == "cpu":
        array = tensor.numpy()
    elif tensor.dtype in _NUMPY_DTYPES:
        array = _cupy_view(tensor)
    else:
        array = cupy_module().from_dlpack(tensor)
    return array.view(BFLOAT16) if bf16 else array


def _torch_view(array) -> torch.Tensor | None:
    """The view of the torch allocation a contiguous CuPy array lives in, or None."""
    block = _allocations.get(array.data.mem.ptr)
    dtype = _TORCH_DTYPES.get(array.dtype)
    if block is None or dtype is None or not array.flags.c_contiguous:
        return None
    offset = array.data.ptr - array.data.mem.ptr
    return block[offset : offset + array.nbytes].view(dtype).view(array.shape)


def from_core(array) -> torch.Tensor:
    """The torch view of a core array (NumPy → CPU tensor, CuPy → CUDA tensor)."""
    bf16 = BFLOAT16 is not None and array.dtype == BFLOAT16
    if bf16:
        array = array.view(np.int16)
    if isinstance(array, np.ndarray):
        tensor = torch.from_numpy(array)
    else:
        tensor = _torch_view(array)
        if tensor is None:
            tensor = torch.from_dlpack(array)
    return tensor.view(torch.bfloat16) if bf16 else tensor


@functools.lru_cache(maxsize=64)
def _cuda_device(device_id: int) -> torch.device:
    return torch.device("cuda", device_id)


def _torch_allocation(size: int):
    """A CuPy memory pointer into a byte tensor from torch's caching allocator (on its current stream)."""
    cupy = cupy_module()
    device_id = cupy.cuda.runtime.getDevice()
    block = torch.empty(size, dtype=torch.uint8, device=_cuda_device(device_id))
    if size:
        _allocations[block.data_ptr()] = block
    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(block.data_ptr(), size, block, device_id), 0)


@functools.lru_cache(maxsize=64)
def _external_stream(stream_ptr: int, device_id: int):
    with warnings.catch_warnings():  # newer CuPy prefers Stream.from_external; this works on 13.x and 14.x
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy_module().cuda.ExternalStream(stream_ptr, device_id)


def _device_id(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def cupy_stream(device: torch.device):
    """torch's current stream on CUDA `device` as a CuPy stream, for launches."""
    device_id = _device_id(device)
    return _external_stream(torch._C._cuda_getCurrentRawStream(device_id), device_id)


@functools.cache
def _blas_pools():
    """The BLAS libraries loaded in the process (NumPy's) as threadpoolctl controls them; None without it."""
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:
        return None
    return ThreadpoolController().select(user_api="blas")


class _SingleThreadedBlas:
    """Holds the BLAS pools at one thread while any thread runs the core; the last one out restores
    them (the setting is process-wide, so per-entry save and restore would interleave wrongly)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._inside = 0
        self._limiter = None

    def __enter__(self):
        with self._lock:
            if self._inside == 0 and (pools := _blas_pools()) is not None:
                self._limiter = pools.limit(limits=1)
            self._inside += 1

    def __exit__(self, *exc_info):
        with self._lock:
            self._inside -= 1
            if self._inside == 0 and self._limiter is not None:
                self._limiter.restore_original_limits()
                self._limiter = None


single_threaded_blas = _SingleThreadedBlas()


@contextlib.contextmanager
def on_torch_stream(device: torch.device):
    """Run the core on `device`'s torch stream and allocator; for CPU tensors, with NumPy's BLAS on one thread."""
    if device.type != "cuda":
        with single_threaded_blas:
            yield
        return
    cupy = cupy_module()
    with cupy.cuda.Device(_device_id(device)), cupy_stream(device), cupy.cuda.using_allocator(_torch_allocation):
        yield
