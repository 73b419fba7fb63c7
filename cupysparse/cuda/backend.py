"""Which array backend is available: CuPy on a CUDA GPU, or NumPy on the CPU.

`import cupysparse` must work without a GPU and without CuPy, so CuPy is imported lazily here
and nowhere else in the core.
"""

from __future__ import annotations

import functools
import os
import tempfile
import warnings

import numpy as np

from cupysparse import settings


def kernel_cache_dir() -> str:
    """Directory of compiled kernels, cupysparse's and CuPy's own: `CUPY_CACHE_DIR`, else CuPy's default."""
    return settings.cupy_cache_dir()


def _is_writable_dir(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def _prepare_kernel_cache_dir() -> None:
    """CuPy creates its cache directory at import and fails if it cannot; redirect it instead."""
    wanted = kernel_cache_dir()
    if _is_writable_dir(wanted):
        return
    fallback = os.path.join(tempfile.gettempdir(), f"cupysparse-kernel-cache-{os.getuid()}")
    if _is_writable_dir(fallback):
        os.environ[settings.CUPY_CACHE_DIR] = fallback
        where = f"compiled kernels are cached in {fallback} instead"
    else:
        os.environ[settings.CUPY_CACHE_IN_MEMORY] = "1"
        where = "kernels are compiled in memory for this process only"
    warnings.warn(
        f"cupysparse: the kernel cache directory {wanted} is not writable; {where}. "
        "Set CUPY_CACHE_DIR to a writable directory to keep compiled kernels between runs.",
        RuntimeWarning,
        stacklevel=3,
    )


@functools.cache
def cupy_module():
    """The `cupy` module, or None when CuPy is not installed or cannot be imported."""
    _prepare_kernel_cache_dir()
    try:
        import cupy
    except ImportError:
        return None
    except Exception as error:  # CuPy installed but broken: keep the NumPy path usable.
        warnings.warn(f"cupysparse: CuPy failed to import ({error}); using NumPy only.", RuntimeWarning)
        return None
    return cupy


@functools.cache
def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    cupy = cupy_module()
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def is_cupy_array(array) -> bool:
    cupy = cupy_module() if "cupy" in type(array).__module__ else None
    return cupy is not None and isinstance(array, cupy.ndarray)


def current_device() -> int:
    """The id of CuPy's current CUDA device."""
    return cupy_module().cuda.runtime.getDevice()


def array_module(array):
    """`cupy` for CuPy arrays, `numpy` for anything else."""
    return cupy_module() if is_cupy_array(array) else np


def all_true(mask) -> bool:
    """Whether every element of the boolean array `mask` is True (True when it is empty)."""
    if mask.size == 0:
        return True
    # CuPy reduces booleans with a CUB kernel that NVRTC compiles at each reduction's first use in a
    # fresh kernel cache (about 5 s on an H100's host); its uint8 minimum and maximum come precompiled.
    return bool(mask.view(np.uint8).min()) if is_cupy_array(mask) else bool(mask.all())


def any_true(mask) -> bool:
    """Whether some element of the boolean array `mask` is True (False when it is empty)."""
    if mask.size == 0:
        return False
    return bool(mask.view(np.uint8).max()) if is_cupy_array(mask) else bool(mask.any())


def default_device() -> str:
    """'cuda' when a GPU is usable, else 'cpu'."""
    return "cuda" if gpu_available() else "cpu"


def to_device(array, device: str):
    """Move `array` to 'cpu' (NumPy) or 'cuda' (CuPy)."""
    if device == "cpu":
        return array.get() if is_cupy_array(array) else np.asarray(array)
    if device == "cuda":
        if not gpu_available():
            raise RuntimeError("device='cuda' was requested but no CUDA GPU is usable (see `python -m cupysparse info`)")
        return cupy_module().asarray(array)
    raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")


def describe_device(device: str) -> str:
    """A human-readable name of 'cpu' or the current CUDA device, for reports."""
    if device == "cpu":
        return "CPU (NumPy)"
    cupy = cupy_module()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return f"{props['name'].decode()} (sm_{props['major']}{props['minor']}, CuPy)"


def to_numpy(array) -> np.ndarray:
    return to_device(array, "cpu")
