"""Cases shared by the GPU tests of the algorithms: maps of each kind on random coordinates, inputs,
one phase of an algorithm on the GPU and its fp64 reference on the CPU."""

import numpy as np
import pytest

from cupysparse.algorithms import CONV, ConvProblem, reference_algorithm, registered
from cupysparse.cuda.backend import cupy_module, gpu_available
from cupysparse.cuda.dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64
from cupysparse.geometry.kernel_map import KernelMap
from cupysparse.geometry.sparse_tensor import SparseTensor

DTYPES = tuple(d for d in (FLOAT64, FLOAT32, FLOAT16, BFLOAT16) if d is not None)
MAP_KINDS = ("submanifold", "strided", "transposed")
CHANNELS = ((3, 17), (17, 33), (33, 3), (32, 64))


def coordinates(seed: int = 0, side: int = 16, density: float = 0.25) -> np.ndarray:
    rng = np.random.default_rng(seed)
    batches = []
    for batch in range(2):
        cells = np.argwhere(rng.random((side,) * 3) < density) - side // 2
        batches.append(np.concatenate([np.full((len(cells), 1), batch), cells], axis=1))
    return np.concatenate(batches).astype(np.int32)


def build_gpu_map(kind: str, coords: np.ndarray) -> KernelMap:
    tensor = SparseTensor(cupy_module().asarray(coords), cupy_module().zeros((len(coords), 1), np.float32))
    if kind == "submanifold":
        return tensor.kernel_map(3).kernel_map
    strided = tensor.kernel_map(3, 2).kernel_map
    return strided if kind == "strided" else tensor.map_cache.kernel_map((2, 2, 2), 3, 2, transposed=True).kernel_map


_MAPS = {}


def gpu_map(kind: str) -> KernelMap:
    if kind not in _MAPS:
        _MAPS[kind] = build_gpu_map(kind, coordinates(seed=len(kind)))
    return _MAPS[kind]


def cpu_copy(kernel_map: KernelMap) -> KernelMap:
    return KernelMap(
        kernel_map.pair_table.get(), kernel_map.num_in, kernel_map.kernel_size, kernel_map.stride,
        kernel_map.dilation, kernel_map.transposed, kernel_map.generative,
    )


def supported(algorithm_kind=CONV, skip=()):
    """(algorithm, dtype) pairs the current GPU runs, for parametrisation; `skip` names to leave out."""
    cases = []
    for name, algorithm in registered(algorithm_kind).items():
        if name in skip:
            continue
        for dt in DTYPES:
            problem = ConvProblem(100, 100, 16, 16, 27, dt, "cuda", capability())
            if algorithm.supports(problem):
                cases.append(pytest.param(name, dt, id=f"{name}-{dt}"))
    return cases


def capability() -> int:
    return int(cupy_module().cuda.Device().compute_capability) if gpu_available() else 0


def inputs(kernel_map, c_in, c_out, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((kernel_map.num_in, c_in)).astype(dtype)
    w = (rng.standard_normal((kernel_map.kernel_volume, c_in, c_out)) / np.sqrt(c_in)).astype(dtype)
    dy = rng.standard_normal((kernel_map.num_out, c_out)).astype(dtype)
    return x, w, dy


def run_phase(algorithm, phase, kernel_map, x, w, dy, params):
    cupy = cupy_module()
    x_gpu, w_gpu, dy_gpu = cupy.asarray(x), cupy.asarray(w), cupy.asarray(dy)
    if phase == "forward":
        result = algorithm.forward(x_gpu, algorithm.prepare_weight(w_gpu), kernel_map, **params)
    elif phase == "dgrad":
        result = algorithm.dgrad(dy_gpu, algorithm.prepare_weight(w_gpu), kernel_map, **params)
    else:
        result = algorithm.wgrad(x_gpu, dy_gpu, kernel_map, **params)
    assert result.dtype == x.dtype
    return result.get()


def reference_phase(phase, kernel_map, x, w, dy, kind=CONV):
    reference = reference_algorithm(kind)
    cpu_map = cpu_copy(kernel_map)
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    if phase == "forward":
        return reference.forward(x64, w64, cpu_map), (kernel_map.kernel_volume * x.shape[1], x, w)
    if phase == "dgrad":
        return reference.dgrad(dy64, w64, cpu_map), (kernel_map.kernel_volume * dy.shape[1], dy, w)
    return reference.wgrad(x64, dy64, cpu_map), (kernel_map.num_out, x, dy)


PHASES = ("forward", "dgrad", "wgrad")


def filled_with_nan(shape, dtype):
    """A GPU array of `shape` whose every element is NaN: a value a launch left unwritten shows."""
    out = cupy_module().empty(shape, dtype=dtype)
    out.view(np.uint16 if out.itemsize == 2 else np.uint32).fill(0x7FFF if out.itemsize == 2 else 0x7FC00000)
    return out


def planned_phases(forward, backward, kernel_map, x, w, dy, misaligned: bool):
    """forward, dgrad and wgrad through launch plans over `kernel_map` on hand-allocated buffers, the
    gradients both in one backward (wgrad's sum in dgrad's launch), checked bitwise against each gradient
    alone (the sum in a launch of its own). `misaligned` shifts the feature and gradient buffers by one
    element."""
    cupy = cupy_module()

    def buffer(array):
        shift = 1 if misaligned else 0
        storage = cupy.zeros(array.size + shift, dtype=array.dtype)
        view = storage[shift:].reshape(array.shape)
        view[...] = cupy.asarray(array)
        return view

    def padded(weight, shape, transposed=False):
        weight = weight.transpose(0, 2, 1) if transposed else weight
        out = cupy.zeros(shape, dtype=weight.dtype)
        out[:, : weight.shape[1], : weight.shape[2]] = cupy.asarray(weight)
        return out

    stream = cupy.cuda.get_current_stream().ptr
    # Buffers live in variables until the results are read: a launch may derive the map's formats
    # first, allocating from the pool a freed buffer would return to.
    x_gpu, dy_gpu = buffer(x), buffer(dy)
    forward_weight = padded(w, forward.weight_shape, forward.weight_transposed)
    backward_weight = padded(w, backward.weight_shape)
    out = filled_with_nan((kernel_map.num_out, w.shape[2]), x.dtype)

    def staging(plan) -> dict:  # where a plan copies operands, NaN until it writes them
        if plan.staging_shape is None:
            return {}
        buffers.append(filled_with_nan(plan.staging_shape(kernel_map), np.float32))
        return {"staging": buffers[-1].data.ptr}

    buffers = []
    forward.launch(kernel_map, x_gpu.data.ptr, forward_weight.data.ptr, out.data.ptr, stream, **staging(forward))
    gradients = {}
    for wanted in (("dgrad", "wgrad"), ("dgrad",), ("wgrad",)):
        grad_input = filled_with_nan(x.shape, x.dtype)
        workspace = filled_with_nan(backward.workspace_shape(kernel_map), np.float32)
        grad_weight = filled_with_nan(w.shape, x.dtype)
        backward.launch(kernel_map, dy_gpu.data.ptr, x_gpu.data.ptr, backward_weight.data.ptr,
                        grad_input.data.ptr if "dgrad" in wanted else 0, workspace.data.ptr,
                        grad_weight.data.ptr if "wgrad" in wanted else 0, stream, **staging(backward))
        for phase, array in (("dgrad", grad_input), ("wgrad", grad_weight)):
            if phase in wanted:
                gradients.setdefault(phase, []).append(array.get())
    for phase, (both, alone) in gradients.items():
        assert np.array_equal(both.view(np.uint8), alone.view(np.uint8)), f"{phase} alone differs from both at once"
    return {"forward": out.get(), "dgrad": gradients["dgrad"][0], "wgrad": gradients["wgrad"][0]}


# Channel pairs of the wide wgrad tiles (rows, channels): multiples of the tile, and pairs that are not.
WGRAD_CHANNELS = {(128, 128): ((128, 128), (72, 100), (250, 80)), (128, 256): ((128, 256), (264, 520), (65, 129))}
