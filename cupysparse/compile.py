"""The one place CUDA sources are loaded, compiled and launched from.

Every kernel lives in a `.cu` file of the installed `raw_kernels` folder. A module that launches
kernels declares a `KernelSource` (the file plus the template instantiations it needs, as NVRTC
name expressions); `get_kernel` compiles it once per device through `cupy.RawModule` and memoises
the module. Declared sources register themselves so the CPU test can compile every one of them
through NVRTC for several architectures without a GPU.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from .backend import cupy_module

KERNEL_DIR = Path(__file__).resolve().parent / "raw_kernels"
if not KERNEL_DIR.is_dir():  # editable install: the folder stays at the repository root
    KERNEL_DIR = Path(__file__).resolve().parent.parent / "raw_kernels"

MMA_PACKAGE_HINT = (
    'install the CUDA headers that provide crt/mma.h: pip install "cuda-toolkit[crt]==13.*" '
    "(package nvidia-cuda-crt), or point CUDA_PATH at a CUDA toolkit"
)

_PROJECT_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
_MMA_INCLUDE = re.compile(r"^\s*#\s*include\s+<mma\.h>", re.MULTILINE)

_REGISTRY: list[KernelSource] = []


@dataclass(frozen=True)
class KernelSource:
    """One `.cu` file and the template instantiations launched from it."""

    filename: str
    name_expressions: tuple[str, ...]

    def __post_init__(self):
        if not (KERNEL_DIR / self.filename).is_file():
            raise FileNotFoundError(f"kernel source {self.filename} not found in {KERNEL_DIR}")
        _REGISTRY.append(self)

    def get(self, name_expression: str):
        """The compiled kernel `name_expression` on the current CUDA device."""
        return get_kernel(self, name_expression)


def registered_sources() -> tuple[KernelSource, ...]:
    return tuple(_REGISTRY)


def _included_headers(text: str, seen: set[str]) -> list[str]:
    """Project headers included by `text`, transitively, in include order."""
    found = []
    for name in _PROJECT_INCLUDE.findall(text):
        if name in seen:
            continue
        seen.add(name)
        header = (KERNEL_DIR / name).read_text()
        found.append(name)
        found.extend(_included_headers(header, seen))
    return found


@functools.cache
def load_source(filename: str) -> str:
    """The source of `filename` with a digest of its project headers appended.

    CuPy keys its disk cache on the source text only, so folding the headers' digest into the
    text makes an edited header recompile every file that includes it.
    """
    text = (KERNEL_DIR / filename).read_text()
    digest = hashlib.sha256()
    for name in _included_headers(text, set()):
        digest.update(name.encode() + b"\0" + (KERNEL_DIR / name).read_bytes())
    return f"{text}\n// cupysparse project headers digest: {digest.hexdigest()}\n"


@functools.cache
def source_digest(filename: str) -> str:
    """A digest of `filename` and the project headers it includes: what a benchmark measured."""
    return hashlib.sha256(load_source(filename).encode()).hexdigest()[:16]


def needs_mma_header(filename: str) -> bool:
    text = load_source(filename)
    return bool(_MMA_INCLUDE.search(text)) or any(
        _MMA_INCLUDE.search((KERNEL_DIR / name).read_text()) for name in _included_headers(text, set())
    )


@functools.cache
def cuda_include_dirs() -> tuple[str, ...]:
    """CUDA header directories in the order searched: pip headers, CUDA_PATH, a system toolkit."""
    candidates = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        pip_dir = find_nvidia_header_directory("cudart")
        if pip_dir:
            candidates.append(pip_dir)
    except Exception:  # cuda-pathfinder absent or no pip headers: fall through to toolkits
        pass
    for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            candidates.append(os.path.join(root, "include"))
    unique = []
    for directory in candidates:
        if os.path.isdir(directory) and directory not in unique:
            unique.append(directory)
    return tuple(unique)


@functools.cache
def find_mma_header() -> str | None:
    """The include directory whose `crt/mma.h` (needed by `<mma.h>`) was found, or None."""
    for directory in cuda_include_dirs():
        if os.path.isfile(os.path.join(directory, "mma.h")) and os.path.isfile(
            os.path.join(directory, "crt", "mma.h")
        ):
            return directory
    return None


def compile_options(filename: str) -> tuple[str, ...]:
    """NVRTC options for `filename`: C++17, the kernel folder, and one CUDA header directory (for
    cuda_fp16.h / cuda_bf16.h): the one with crt/mma.h when the file needs it, so all headers of a
    compilation come from the same toolkit."""
    options = ["-std=c++17", f"-I{KERNEL_DIR}"]
    if needs_mma_header(filename):
        mma_dir = find_mma_header()
        if mma_dir is None:
            raise RuntimeError(f"{filename} includes <mma.h> but crt/mma.h was not found: {MMA_PACKAGE_HINT}")
        options.append(f"-I{mma_dir}")
    elif cuda_include_dirs():
        options.append(f"-I{cuda_include_dirs()[0]}")
    return tuple(options)


_modules: dict[tuple[KernelSource, int], object] = {}
_modules_lock = threading.Lock()


def _module(source: KernelSource, device_id: int):
    key = (source, device_id)
    module = _modules.get(key)
    if module is None:
        with _modules_lock:
            module = _modules.get(key)
            if module is None:
                cupy = cupy_module()
                module = cupy.RawModule(
                    code=load_source(source.filename),
                    options=compile_options(source.filename),
                    name_expressions=list(source.name_expressions),
                )
                module.compile()
                _modules[key] = module
    return module


def get_kernel(source: KernelSource, name_expression: str):
    """The kernel `name_expression` of `source`, compiled for the current device (memoised)."""
    if name_expression not in source.name_expressions:
        raise KeyError(f"{name_expression} is not declared by {source.filename}: {source.name_expressions}")
    cupy = cupy_module()
    if cupy is None:
        raise RuntimeError("CUDA kernels need CuPy: pip install 'cupysparse[cuda]'")
    return _module(source, cupy.cuda.Device().id).get_function(name_expression)


def compile_for_architecture(source: KernelSource, arch: str) -> bytes:
    """Compile `source` to PTX for `arch` (e.g. 'sm_90') with NVRTC directly; needs no GPU."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(load_source(source.filename), source.filename, [], [])
    try:
        for expression in source.name_expressions:
            nvrtc.addNameExpression(program, expression)
        options = [f"-arch=compute_{arch.removeprefix('sm_')}", *compile_options(source.filename)]
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            raise RuntimeError(
                f"NVRTC failed on {source.filename} for {arch}:\n{nvrtc.getProgramLog(program)}"
            ) from error
        for expression in source.name_expressions:
            nvrtc.getLoweredName(program, expression)
        return nvrtc.getPTX(program)
    finally:
        nvrtc.destroyProgram(program)


def launch_config(num_threads: int, block_size: int = 256) -> tuple[tuple[int], tuple[int]]:
    """Grid and block for a one-thread-per-item kernel (at least one block)."""
    return (max(1, -(-num_threads // block_size)),), (block_size,)
