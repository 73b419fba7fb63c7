"""A convolution that does not fit: the allocator's own error, its message naming the sizes, and a
library that works for the next call. On the CPU with a real NumPy allocation failure (an address
space limit, in a child process) and with injected CuPy and torch errors; on the GPU with CuPy's
pool limit and torch's memory fraction."""

import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from cupysparse.functional import convolution as functional
from cupysparse.algorithms import explicit_gemm
from cupysparse.cuda.backend import cupy_module
from cupysparse.tuning.cache_file import cache_file_path
from cupysparse.cuda.out_of_memory import is_out_of_memory
from cupysparse.geometry.sparse_tensor import SparseTensor
from cupysparse.tuning.tuner import default_tuner
from references import Grid, conv_gather
from tolerances import assert_close

KERNEL = (3, 3, 3)


@pytest.fixture(autouse=True)
def temporary_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CUPYSPARSE_FWD_ALGO_MODE", raising=False)
    monkeypatch.delenv("CUPYSPARSE_BWD_ALGO_MODE", raising=False)
    monkeypatch.delenv("CUPYSPARSE_AUTOTUNE", raising=False)  # these tests watch the tuner skip candidates
    yield
    default_tuner().forget_choices()


def scene(num_voxels=300, side=10, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    cells = rng.choice(side**3, size=num_voxels, replace=False)
    spatial = np.stack(np.unravel_index(cells, (side,) * 3), axis=1)
    return np.concatenate([np.zeros((num_voxels, 1), np.int64), spatial], axis=1).astype(np.int32)


def fp32_layer(seed):
    """`scene()`'s coordinates, 4 fp32 features per row and a 3^3 weight to 8 channels."""
    coordinates = scene()
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((len(coordinates), 4)).astype(np.float32)
    weight = rng.standard_normal((27, 4, 8)).astype(np.float32)
    return coordinates, features, weight


def dense_submanifold(coordinates, features, weight) -> np.ndarray:
    grid = Grid.covering(1, coordinates, margin=1)
    dense = conv_gather(grid.scatter(coordinates, features.astype(np.float64)), grid, grid,
                        weight.astype(np.float64), KERNEL, (1, 1, 1), (1, 1, 1))
    return grid.read(dense, coordinates)


def fail_once(monkeypatch, module, name, error):
    """Make `module.name` raise `error` on its next call, then behave again."""
    real = getattr(module, name)
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, failing)
    return calls


def test_out_of_memory_errors_are_recognised_whoever_raised_them():
    torch = pytest.importorskip("torch")
    cupy_error = pytest.importorskip("cupy.cuda.memory").OutOfMemoryError
    for error in (MemoryError(), cupy_error(2**30, 2**33), torch.OutOfMemoryError("CUDA out of memory."),
                  RuntimeError("cudaErrorMemoryAllocation: out of memory"),
                  RuntimeError("CUBLAS_STATUS_ALLOC_FAILED")):
        assert is_out_of_memory(error), error
    for error in (RuntimeError("NVRTC failed on wmma_implicit_gemm.cu"), ValueError("features must have shape")):
        assert not is_out_of_memory(error), error


def expected_sizes(phase, num_rows, in_channels, out_channels, dtype) -> list[str]:
    """The parts of the message, worked out here from the arguments."""
    itemsize = np.dtype(dtype).itemsize
    rows_in, rows_out = ("input", "output") if phase == "forward" else ("input (and its gradient)",
                                                                         "output gradient")
    return [
        f"in the {phase} of a convolution",
        f"{rows_in} {num_rows:,} rows x {in_channels} channels ({num_rows * in_channels * itemsize / 1024:.3g} KiB)",
        f"{rows_out} {num_rows:,} rows x {out_channels} channels "
        f"({num_rows * out_channels * itemsize / 1024:.3g} KiB)",
        f"weight 27 x {in_channels} x {out_channels}",
        np.dtype(dtype).name,
    ]


def test_a_cupy_out_of_memory_error_keeps_its_type_gains_the_sizes_and_the_next_call_works(monkeypatch):
    cupy_error = pytest.importorskip("cupy.cuda.memory").OutOfMemoryError
    coordinates, features, weight = fp32_layer(seed=1)
    tensor = SparseTensor(coordinates, features)
    fail_once(monkeypatch, explicit_gemm, "gather_gemm_scatter", cupy_error(2**30, 3 * 2**30))

    with pytest.raises(cupy_error) as raised:
        functional.spatially_sparse_conv(tensor, weight, 3)
    message = str(raised.value)
    assert message.startswith("Out of memory allocating 1,073,741,824 bytes (allocated so far: 3,221,225,472 bytes)")
    for part in expected_sizes("forward", len(coordinates), 4, 8, np.float32) + ["running explicit_gemm"]:
        assert part in message

    out = functional.spatially_sparse_conv(tensor, weight, 3)  # same tensor, same cached map
    assert_close(out.features, dense_submanifold(coordinates, features, weight), np.float32, 27 * 4, features, weight)
    assert not cache_file_path().exists()  # nothing was half-written into the benchmark cache


def test_the_torch_adapter_raises_torch_out_of_memory_naming_the_sizes_in_both_phases(monkeypatch):
    torch = pytest.importorskip("torch")
    from cupysparse.adapters import torch as cst

    coordinates = scene()
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(len(coordinates), 4, dtype=torch.float64, generator=generator, requires_grad=True)
    layer = cst.SubMConv3d(4, 6, 3, bias=False).double()
    x = cst.SparseTensor(torch.from_numpy(coordinates), features)
    allocator_says = "CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of 79.19 GiB"
    fail_once(monkeypatch, explicit_gemm, "gather_gemm_scatter", torch.OutOfMemoryError(allocator_says))
    with pytest.raises(torch.OutOfMemoryError) as raised:
        layer(x)
    assert str(raised.value).startswith(allocator_says)
    for part in expected_sizes("forward", len(coordinates), 4, 6, np.float64):
        assert part in str(raised.value)

    out = layer(x)  # works again, and is right
    weight = layer.weight.detach().numpy()
    expected = dense_submanifold(coordinates, features.detach().numpy(), weight)
    np.testing.assert_allclose(out.features.detach().numpy(), expected, rtol=1e-12, atol=1e-12)

    fail_once(monkeypatch, explicit_gemm.ExplicitGemm, "wgrad", torch.OutOfMemoryError(allocator_says))
    with pytest.raises(torch.OutOfMemoryError) as raised:
        out.features.sum().backward()
    for part in expected_sizes("backward", len(coordinates), 4, 6, np.float64):
        assert part in str(raised.value)
    layer.zero_grad()
    features.grad = None
    layer(x).features.sum().backward()  # the backward works again: d(sum)/dx[j] = Σ_k Σ_o W_k[c, o] over pairs
    ones = np.ones((len(coordinates), 6))
    grid = Grid.covering(1, coordinates, margin=1)
    flipped = weight[::-1].transpose(0, 2, 1)  # the adjoint of a submanifold conv: flipped offsets, W_k^T
    dense = conv_gather(grid.scatter(coordinates, ones), grid, grid, flipped, KERNEL, (1, 1, 1), (1, 1, 1))
    np.testing.assert_allclose(features.grad.numpy(), grid.read(dense, coordinates), rtol=1e-12, atol=1e-12)


def expected_map_sizes(kind, num_coordinates, stride, padding=None) -> str:
    """The message of a map build over `num_coordinates` with a 3^3 kernel, worked out here."""
    padded = "" if padding is None else f", padding {padding}"
    return (f"cupysparse ran out of memory building the kernel map of a {kind} convolution: {num_coordinates:,} "
            f"coordinates at tensor stride (1, 1, 1), kernel (3, 3, 3) (27 offsets), stride {stride}, "
            f"dilation (1, 1, 1){padded}; its pair table takes 4 bytes per output row and offset "
            f"({4 * 27 * num_coordinates / 1024:.3g} KiB for {num_coordinates:,} output rows)")


def test_a_kernel_map_that_runs_out_of_memory_names_its_sizes_and_is_built_on_the_next_call(monkeypatch):
    from cupysparse.geometry import kernel_map

    coordinates, features, weight = fp32_layer(seed=3)
    tensor = SparseTensor(coordinates, features)
    allocator_says = "Unable to allocate 8.00 GiB for an array with shape (300, 27)"
    calls = fail_once(monkeypatch, kernel_map, "pair_tables", MemoryError(allocator_says))  # the map's query

    with pytest.raises(MemoryError) as raised:
        functional.spatially_sparse_conv(tensor, weight, 3)
    assert str(raised.value) == f"{allocator_says} ({expected_map_sizes('submanifold', 300, '(1, 1, 1)')})"

    out = functional.spatially_sparse_conv(tensor, weight, 3)  # the failed build left nothing in the map cache
    assert len(calls) == 2
    assert_close(out.features, dense_submanifold(coordinates, features, weight), np.float32, 27 * 4, features, weight)


def test_a_strided_map_out_of_cupy_memory_keeps_the_error_type_and_names_the_map(monkeypatch):
    cupy_error = pytest.importorskip("cupy.cuda.memory").OutOfMemoryError
    from cupysparse.geometry import kernel_map

    coordinates, features, weight = fp32_layer(seed=4)
    fail_once(monkeypatch, kernel_map, "pair_tables", cupy_error(2**33, 2**30))  # the map's query
    tensor = SparseTensor(coordinates, features)

    with pytest.raises(cupy_error) as raised:
        functional.spatially_sparse_conv(tensor, weight, 3, stride=2)
    message = str(raised.value)
    assert message.startswith("Out of memory allocating 8,589,934,592 bytes")
    assert expected_map_sizes("strided", 300, "(2, 2, 2)") in message

    retried = functional.spatially_sparse_conv(tensor, weight, 3, stride=2)
    fresh = functional.spatially_sparse_conv(SparseTensor(coordinates, features), weight, 3, stride=2)
    np.testing.assert_array_equal(retried.coordinates, fresh.coordinates)
    np.testing.assert_array_equal(retried.features, fresh.features)


REAL_NUMPY_OUT_OF_MEMORY = """
    import resource
    import numpy as np
    from cupysparse import functional
    from cupysparse.geometry.sparse_tensor import SparseTensor

    rng = np.random.default_rng(0)
    cells = rng.choice(40**3, size=20000, replace=False)
    spatial = np.stack(np.unravel_index(cells, (40, 40, 40)), axis=1)
    coordinates = np.concatenate([np.zeros((20000, 1), np.int64), spatial], axis=1).astype(np.int32)
    tensor = SparseTensor(coordinates, rng.standard_normal((20000, 4)).astype(np.float32))
    small = rng.standard_normal((27, 4, 8)).astype(np.float32)
    expected = functional.spatially_sparse_conv(tensor, small, 3).features  # warms everything up
    huge = rng.standard_normal((27, 4, 8192)).astype(np.float32)  # an output of 20000 x 8192 fp32: 625 MiB

    with open("/proc/self/status") as status:
        in_use = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (in_use + 256 * 2**20, resource.RLIM_INFINITY))
    try:
        functional.spatially_sparse_conv(tensor, huge, 3)
    except MemoryError as error:
        print(type(error).__name__)
        print(str(error))
        print(*getattr(error, "__notes__", []), sep="\\n")
    again = functional.spatially_sparse_conv(tensor, small, 3).features
    print("same after:", bool(np.array_equal(again, expected)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and limits the address space")
def test_a_real_numpy_allocation_failure_names_the_sizes_and_leaves_the_library_usable(tmp_path):
    completed = subprocess.run([sys.executable, "-c", textwrap.dedent(REAL_NUMPY_OUT_OF_MEMORY)],
                               capture_output=True, text=True, timeout=300, check=False)
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    assert lines[0] == "MemoryError"  # NumPy's own (a subclass that displays as its base)
    assert lines[1].startswith("Unable to allocate 625. MiB for an array with shape (20000, 8192)")
    assert lines[2] == ("cupysparse ran out of memory in the forward of a convolution running explicit_gemm: "
                        "input 20,000 rows x 4 channels (312 KiB), output 20,000 rows x 8192 channels (625 MiB), "
                        "weight 27 x 4 x 8192 (3.38 MiB), float32")
    assert lines[-1] == "same after: True"


@pytest.mark.gpu
@pytest.mark.pooled_memory  # CuPy's pool limit binds only while the pool is on
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_on_the_gpu_cupy_runs_out_of_its_pool_limit_with_the_sizes_named_then_works(dtype):
    cupy = cupy_module()
    coordinates = scene(num_voxels=20000, side=40)
    rng = np.random.default_rng(2)
    features = rng.standard_normal((len(coordinates), 32)).astype(dtype)
    small = (rng.standard_normal((27, 32, 16)) / np.sqrt(27 * 32)).astype(dtype)
    huge = np.zeros((27, 32, 16384), dtype)  # an output of 20000 x 16384: 1.2 GiB in fp32
    tensor = SparseTensor(cupy.asarray(coordinates), cupy.asarray(features))
    small_gpu, huge_gpu = cupy.asarray(small), cupy.asarray(huge)
    expected = dense_submanifold(coordinates, features, small)
    functional.spatially_sparse_conv(tensor, small_gpu, 3, fwd_algo="all")  # maps, tuning, kernels: done
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    pool.set_limit(size=pool.used_bytes() + 256 * 2**20)
    try:
        with warnings.catch_warnings(record=True) as caught, pytest.raises(cupy.cuda.memory.OutOfMemoryError) as raised:
            warnings.simplefilter("always")
            functional.spatially_sparse_conv(tensor, huge_gpu, 3, fwd_algo="all")
    finally:
        pool.set_limit(size=0)
    # The tuner skipped what ran out (the reference's output alone needs 1.2 GiB) and said so.
    assert any("out of memory" in str(warning.message) for warning in caught)
    message = str(raised.value)
    assert message.startswith("Out of memory allocating")
    assert "output 20,000 rows x 16384 channels" in message and np.dtype(dtype).name in message
    out = functional.spatially_sparse_conv(tensor, small_gpu, 3, fwd_algo="all")
    assert_close(cupy.asnumpy(out.features), expected, dtype, 27 * 32, features, small)


@pytest.mark.gpu
@pytest.mark.pooled_memory  # torch's memory fraction binds only in its caching allocator
@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float32", "float16"])  # fp16 takes the launch-plan path
def test_on_the_gpu_torch_runs_out_of_its_memory_fraction_with_the_sizes_named_then_works(dtype_name):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from cupysparse.adapters import torch as cst

    dtype = getattr(torch, dtype_name)
    coordinates = torch.from_numpy(scene(num_voxels=20000, side=40)).cuda()
    features = torch.randn(len(coordinates), 32, device="cuda").to(dtype)
    x = cst.SparseTensor(coordinates, features)
    small = cst.SubMConv3d(32, 16, 3, bias=False).cuda().to(dtype)
    huge = cst.SubMConv3d(32, 16384, 3, bias=False).cuda().to(dtype)
    with torch.no_grad():
        expected = small(x).features.float().cpu()
        torch.cuda.synchronize()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 256 * 2**20) / total)
        try:
            with pytest.raises(torch.OutOfMemoryError) as raised:
                huge(x)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        message = str(raised.value)
        assert "CUDA out of memory" in message and "output 20,000 rows x 16384 channels" in message
        assert dtype_name in message
        again = small(x).features.float().cpu()
    torch.testing.assert_close(again, expected, rtol=0, atol=0)


def test_a_padded_map_that_runs_out_of_memory_names_its_padding(monkeypatch):
    """spconv's geometry: the message says padded, with the padding, not strided."""
    from cupysparse.geometry import kernel_map

    coordinates, features, weight = fp32_layer(seed=5)
    allocator_says = "Unable to allocate 8.00 GiB for an array with shape (300, 27)"
    fail_once(monkeypatch, kernel_map, "padded_map", MemoryError(allocator_says))
    with pytest.raises(MemoryError) as raised:
        functional.spatially_sparse_conv(SparseTensor(coordinates, features), weight, 3, stride=2, padding=1)
    assert str(raised.value) == f"{allocator_says} ({expected_map_sizes('padded', 300, '(2, 2, 2)', '(1, 1, 1)')})"
