"""Zero-copy between torch tensors and the core's arrays, the context every launch runs in, and
`TorchArrays`: torch's side of the core's execution path (`cupysparse.functional.execution.Arrays`).

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
inside graph capture the graph's private pool).

A planned launch allocates its outputs with torch and hands the core device addresses and torch's raw
stream handle (`TorchArrays`): no core arrays are made per call.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import warnings
import weakref

import numpy as np
import torch
from torch.utils.weak import WeakIdKeyDictionary

from cupysparse.cuda.backend import cupy_module
from cupysparse.cuda.dtypes import BFLOAT16
from cupysparse.functional.execution import Arrays


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


@contextlib.contextmanager
def on_torch_stream(device: torch.device):
    """Run the core on `device`'s torch stream and allocator; a no-op for CPU tensors."""
    if device.type != "cuda":
        yield
        return
    cupy = cupy_module()
    with cupy.cuda.Device(_device_id(device)), cupy_stream(device), cupy.cuda.using_allocator(_torch_allocation):
        yield


class TorchArrays(Arrays):
    """torch tensors for the core's execution path: CUDA tensors take plans; CPU tensors take the full
    path on their NumPy views."""

    def __init__(self):
        # Inference's padded weights, by weight: ((its version, address, padded shape), the padded copy).
        self._padded_weights = WeakIdKeyDictionary()

    def launch_device(self, features, weight, grad_output=None) -> int | None:
        if not (features.is_cuda and features.is_contiguous() and features.dtype == weight.dtype
                and features.device == weight.device):
            return None
        device_index = features.device.index
        if device_index != torch.cuda.current_device():
            return None
        if grad_output is not None and not (grad_output.is_contiguous() and grad_output.dtype == features.dtype
                                            and grad_output.device == features.device):
            return None
        return device_index

    def core_dtype(self, dtype: torch.dtype) -> np.dtype | None:
        return core_dtype(dtype)

    def empty(self, like: torch.Tensor, shape: tuple) -> torch.Tensor:
        return like.new_empty(shape)

    def empty_float32(self, like: torch.Tensor, shape: tuple) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32, device=like.device)

    # A C-level call, not a method: it costs no Python frame on the hot path.
    address = operator.methodcaller("data_ptr")

    def stream(self, like: torch.Tensor) -> int:
        return torch._C._cuda_getCurrentRawStream(like.device.index)  # a CUDA tensor's index is never None

    def padded_weight(self, weight: torch.Tensor, shape: tuple, transposed: bool, reuse: bool) -> torch.Tensor:
        """See `Arrays.padded_weight`; with `reuse`, the padded copy is kept from call to call while `weight`
        is unchanged: an in-place update (an optimiser's step, `load_state_dict`, anything under
        `torch.no_grad()`) bumps its `_version`, a reassigned `.data` changes its address, so either pads
        again. Writes through `weight.data` are not seen (they bump no version): such a weight must be
        updated in place on the tensor itself. While a CUDA graph is captured it pads anew, so that every
        replay reads the weight as it is then."""
        if weight.shape == shape and not transposed:
            return weight.contiguous()
        if not reuse or weight.is_inference() or (weight.is_cuda and torch.cuda.is_current_stream_capturing()):
            return _padded(weight, shape, transposed)  # an inference tensor has no version to key on
        key = (weight._version, weight.data_ptr(), shape, transposed)
        kept = self._padded_weights.get(weight)
        if kept is None or kept[0] != key:
            kept = self._padded_weights[weight] = (key, _padded(weight, shape, transposed))
        return kept[1]

    def device_context(self, like: torch.Tensor):
        return on_torch_stream(like.device)

    def gpu(self, array: torch.Tensor) -> int | None:
        return array.device.index if array.is_cuda else None

    def current_gpu(self) -> int:
        return torch.cuda.current_device()

    def is_contiguous(self, array: torch.Tensor) -> bool:
        return array.is_contiguous()

    def contiguous(self, array: torch.Tensor) -> torch.Tensor:
        return array.contiguous()

    def to_core(self, array: torch.Tensor):
        return to_core(array)

    def from_core(self, array) -> torch.Tensor:
        return from_core(array)


def _padded(weight: torch.Tensor, shape, transposed: bool = False) -> torch.Tensor:
    """`weight` `[K, A, B]` (`[K, B, A]` when `transposed`) zero-padded at the end of its last two
    dimensions to `shape`, contiguous."""
    if transposed:
        weight = weight.transpose(1, 2)
    if weight.shape == shape:
        return weight.contiguous()
    padding = (0, shape[2] - weight.shape[2], 0, shape[1] - weight.shape[1])
    return torch.nn.functional.pad(weight.detach(), padding).contiguous()


TORCH_ARRAYS = TorchArrays()
