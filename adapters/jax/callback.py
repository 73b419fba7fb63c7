"""Running the core inside a compiled JAX computation, through `jax.experimental.buffer_callback`.

XLA calls the callback when the computation reaches it, with its input and output buffers and, on
the GPU, its stream. The buffers are viewed as CuPy arrays in place (no copy); XLA's stream becomes
CuPy's current stream, so every kernel the core launches (and the tuner's timing, the first time
a problem is seen) is ordered with the XLA work around it and nothing synchronises the host; each
result is then copied into its output buffer on that stream. On the CPU the same callback runs
the core's NumPy algorithms on the host buffers.

The views use the buffers' `__cuda_array_interface__` pointer with the buffer's own dtype rather
than `cupy.asarray(buffer)`: the interface's type string cannot say bfloat16. XLA buffers are
dense and row-major, so pointer, shape and dtype describe them completely.
"""

from __future__ import annotations

import math

import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from cupysparse.cuda.backend import cupy_module

_DLPACK_CPU = 1


class _StreamHandle:
    """XLA's stream pointer under the CUDA stream protocol, which `cupy.cuda.Stream.from_external` takes."""

    def __init__(self, pointer: int):
        self._pointer = pointer

    def __cuda_stream__(self):
        return (0, self._pointer)


def _device_view(cupy, device_id: int, buffer):
    shape, dtype = tuple(buffer.shape), np.dtype(buffer.dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:  # an empty buffer may have no address at all
        return cupy.empty(shape, dtype)
    pointer = buffer.__cuda_array_interface__["data"][0]
    memory = cupy.cuda.UnownedMemory(pointer, nbytes, buffer, device_id)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))


def _on_host(compute, outputs, inputs) -> None:
    results = compute(*(np.asarray(buffer) for buffer in inputs))
    for output, result in zip(outputs, results):
        np.asarray(output)[...] = result


def _on_device(compute, outputs, inputs, stream_pointer: int, device_id: int) -> None:
    cupy = cupy_module()
    if cupy is None:
        raise RuntimeError("cupysparse needs CuPy to run on a JAX GPU: pip install 'cupysparse[cuda]'")
    with cupy.cuda.Device(device_id), cupy.cuda.Stream.from_external(_StreamHandle(stream_pointer)):
        results = compute(*(_device_view(cupy, device_id, buffer) for buffer in inputs))
        for output, result in zip(outputs, results):
            if math.prod(output.shape):
                _device_view(cupy, device_id, output)[...] = result


def call(compute, result_types, *operands, map_on_gpu: bool):
    """`compute(*arrays) -> tuple of arrays`, run as part of the computation on views of the
    operands' buffers (NumPy on the CPU, CuPy on the GPU); its results, one per entry of
    `result_types` (`jax.ShapeDtypeStruct`s), are copied into XLA's output buffers.
    `map_on_gpu` says where the kernel map `compute` uses lives, which must be where the buffers are."""

    def callback(context, outputs, *inputs):
        device_type, device_id = inputs[0].__dlpack_device__()
        on_host = device_type == _DLPACK_CPU
        if on_host == map_on_gpu:
            where = "a GPU (CuPy)" if map_on_gpu else "the CPU (NumPy)"
            raise TypeError(
                f"the kernel map lives on {where} but the features on {'the CPU' if on_host else 'a GPU'}: "
                "build the SparseTensor from features on the device the convolution runs on"
            )
        if on_host:
            _on_host(compute, outputs, inputs)
        else:
            _on_device(compute, outputs, inputs, context.stream, device_id)

    return buffer_callback(callback, tuple(result_types))(*operands)
