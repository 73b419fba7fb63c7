"""The one place CUDA sources are loaded, compiled and launched from.

Every kernel lives in a `.cu` file of the installed `raw_kernels` folder. A module that launches
kernels declares its `KernelSource`s (the file plus template instantiations, as NVRTC name
expressions): each is one NVRTC program, so one CUDA module. A big kernel family is declared as
several small sources (`KernelFamily`), so that a process compiles only the instantiations it
launches and the pieces compile side by side. `get_kernel` compiles a source once per device
architecture with NVRTC (CUBIN for the GPU's own architecture), keeps the result in the kernel cache
directory, and loads it as a CuPy module once per device; `prepare` does that for many sources at
once, compiling them concurrently on up to `compile_workers()` threads (NVRTC releases the
interpreter lock while it compiles). A process whose kernels are all in the cache runs no NVRTC at
all (CuPy's own `RawModule` cache would still preprocess a test program with NVRTC once per option
set). Declared sources register themselves so the CPU test can compile every one of them through
NVRTC for several architectures without a GPU.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import itertools
import os
import re
import struct
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np

from cupysparse import settings
from cupysparse.cuda.backend import cupy_module, is_cupy_array, kernel_cache_dir

_PACKAGE_DIR = Path(__file__).resolve().parent.parent
KERNEL_DIR = _PACKAGE_DIR / "raw_kernels"
if not KERNEL_DIR.is_dir():  # editable install: the folder stays at the repository root
    KERNEL_DIR = _PACKAGE_DIR.parent / "raw_kernels"

MMA_PACKAGE_HINT = (
    'install the CUDA headers that provide crt/mma.h: pip install "cuda-toolkit[crt]==13.*" '
    "(package nvidia-cuda-crt), or point CUDA_PATH at a CUDA toolkit"
)

_PROJECT_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
_MMA_INCLUDE = re.compile(r"^\s*#\s*include\s+<mma\.h>", re.MULTILINE)

_REGISTRY: list[KernelSource] = []
# Threads of a block of a one-thread-per-item kernel (`launch_config`, `KernelSource.launch_per_row`).
ROW_BLOCK = 256
# Jobs one launch of a batched kernel takes (`KernelSource.launch_jobs`; raw_kernels/launch_jobs.cuh).
MAX_JOBS = 16


@dataclass(frozen=True)
class KernelSource:
    """One `.cu` file and the template instantiations launched from it."""

    filename: str
    name_expressions: tuple[str, ...]
    # The one architecture the source is compiled for, e.g. "sm_90a" for architecture-specific
    # instructions (wgmma), on GPUs of exactly that compute capability; None: the GPU's own.
    architecture: str | None = None

    def __post_init__(self):
        if not (KERNEL_DIR / self.filename).is_file():
            raise FileNotFoundError(f"kernel source {self.filename} not found in {KERNEL_DIR}")
        _REGISTRY.append(self)

    def get(self, name_expression: str):
        """The compiled kernel `name_expression` on the current CUDA device."""
        return get_kernel(self, name_expression)

    def prepared(self, name_expression: str, block: int, num_arguments: int, fixed: tuple = ()) -> PreparedLaunch:
        """A `PreparedLaunch` of `name_expression` on the current device with its `num_arguments` arguments
        given per call, but for the `fixed` ones, (position, bytes) pairs (a struct's bytes, e.g. a query's
        geometry): for small kernels launched many times a call, where a CuPy `Function` call's conversions
        cost more than the kernel."""
        return _prepared_launch(self, name_expression, cupy_module().cuda.Device().id, block, num_arguments, fixed)

    def launch_per_row(self, name_expression: str, num_rows: int, *values: int, fixed: tuple = ()) -> None:
        """`name_expression` with one thread per row (blocks of `ROW_BLOCK`, at least one) on the current
        stream, prepared (`prepared`): `values` in argument order, past the `fixed` (position, bytes) ones."""
        self.prepared(name_expression, ROW_BLOCK, len(values) + len(fixed), fixed).launch(
            cupy_module().cuda.get_current_stream().ptr, *values, grid=(max(1, -(-num_rows // ROW_BLOCK)), 1, 1))

    def launch_batches(self, name_expression: str, dtype: np.dtype, rows: list[int], per_job: dict[str, list],
                       shared: dict | None = None, block_aligned: bool = False) -> None:
        """`launch_jobs` over jobs of `rows[j]` rows each, up to `MAX_JOBS` a launch: each launch's record of
        `dtype` holds its jobs' row starts and count, their entries of `per_job` (field name → a value per job;
        one slice assignment a field) and the `shared` fields (name → value). `block_aligned` starts each job at a
        block boundary, for a kernel that finds its job per block (`job_of_block` in raw_kernels/launch_jobs.cuh)
        and bounds it by a row count of its own among `per_job`."""
        for first in range(0, len(rows), MAX_JOBS):
            count = min(MAX_JOBS, len(rows) - first)
            record = np.zeros((), dtype=dtype)
            record["count"] = count
            spans = rows[first : first + count]
            if block_aligned:
                spans = [-(-num_rows // ROW_BLOCK) * ROW_BLOCK for num_rows in spans]
            record["row_starts"][: count + 1] = list(itertools.accumulate(spans, initial=0))
            for name, values in per_job.items():
                record[name][:count] = values[first : first + count]
            for name, value in (shared or {}).items():
                record[name] = value
            self.launch_jobs(name_expression, record[()])

    def launch_jobs(self, name_expression: str, description: np.void) -> None:
        """`name_expression` over the jobs `description` describes: a record of the kernel's one argument, a
        struct whose `row_starts` and `count` say how the launch's rows fall to its jobs (at most `MAX_JOBS`:
        raw_kernels/launch_jobs.cuh), one thread per row, on the current stream. The record is made for this
        call, so it is passed as it is where `prepared` would keep its bytes for every call to come."""
        cupy = cupy_module()
        num_rows = int(description["row_starts"][description["count"]])
        data = np.frombuffer(description.tobytes(), dtype=np.uint8)
        pointers = np.array([data.ctypes.data], dtype=np.uint64)  # cuLaunchKernel copies the argument from there
        cupy.cuda.driver.launchKernel(self.get(name_expression).ptr, max(1, -(-num_rows // ROW_BLOCK)), 1, 1, ROW_BLOCK,
                                      1, 1, 0, cupy.cuda.get_current_stream().ptr, pointers.ctypes.data, 0)


def registered_sources() -> tuple[KernelSource, ...]:
    return tuple(_REGISTRY)


class KernelFamily:
    """The instantiations of one `.cu` file declared as several sources, one NVRTC program (one
    module) per group of name expressions: a process compiles the groups it launches from, and
    `prepare` compiles several side by side. NVRTC parses the file's headers once per program, which
    costs some tens of milliseconds a group."""

    def __init__(self, filename: str, groups, architecture: str | None = None):
        self.sources = tuple(KernelSource(filename, tuple(group), architecture) for group in groups)
        self._source_of = {expression: source for source in self.sources for expression in source.name_expressions}

    @property
    def name_expressions(self) -> tuple[str, ...]:
        return tuple(self._source_of)

    def source_of(self, name_expression: str) -> KernelSource:
        """The source (module) that declares `name_expression`."""
        try:
            return self._source_of[name_expression]
        except KeyError:
            raise KeyError(f"{name_expression} is not declared by this family of {self.sources[0].filename}") from None

    def get(self, name_expression: str):
        """The compiled kernel `name_expression` on the current CUDA device."""
        return get_kernel(self.source_of(name_expression), name_expression)


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

    The kernel cache is keyed on this text, so folding the headers' digest into it makes an edited
    header recompile every file that includes it.
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


@functools.cache
def needs_mma_header(filename: str) -> bool:
    """Whether `filename` or a project header it includes uses `<mma.h>` (asked once per module
    compiled or loaded: remembered, as `load_source` is)."""
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
    for root in (*settings.cuda_roots(), "/usr/local/cuda"):
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


# Set to 1 to compile kernels with line information (NVRTC's -lineinfo), so that compute-sanitizer
# and Nsight reports name source lines; the option is part of the kernel cache key.


def compile_options(filename: str) -> tuple[str, ...]:
    """NVRTC options for `filename`: C++17, the kernel folder, and one CUDA header directory (for
    cuda_fp16.h / cuda_bf16.h): the one with crt/mma.h when the file needs it, so all headers of a
    compilation come from the same toolkit; -lineinfo when `settings.nvrtc_lineinfo()`."""
    options = ["-std=c++17", f"-I{KERNEL_DIR}"]
    if settings.nvrtc_lineinfo():
        options.append("-lineinfo")
    if needs_mma_header(filename):
        mma_dir = find_mma_header()
        if mma_dir is None:
            raise RuntimeError(f"{filename} includes <mma.h> but crt/mma.h was not found: {MMA_PACKAGE_HINT}")
        options.append(f"-I{mma_dir}")
    elif cuda_include_dirs():
        options.append(f"-I{cuda_include_dirs()[0]}")
    return tuple(options)


_modules: dict[tuple[KernelSource, int], LoadedModule] = {}
_modules_lock = threading.Lock()
_module_loads: list[ModuleLoad] = []
_cache_write_warned = False  # one warning per process for an unwritable kernel cache

# Bumped when the layout of a cached kernel file changes, so old files are never misread.
KERNEL_CACHE_FORMAT = 1


@dataclass(frozen=True)
class CompiledSource:
    """NVRTC's output for one source and architecture: the image (CUBIN for a real architecture,
    PTX for a virtual one), the lowered (mangled) name of each name expression, and the compiler's log
    (empty when read from the kernel cache)."""

    image: bytes
    lowered_names: dict[str, str]
    log: str = ""


@dataclass
class LoadedModule:
    module: object  # cupy.cuda.function.Module
    lowered_names: dict[str, str]
    functions: dict[str, object]


@dataclass(frozen=True)
class ModuleLoad:
    """One module made ready in this process, read from the kernel cache or compiled by NVRTC."""

    filename: str
    device_id: int
    seconds: float
    compiled: bool


def module_loads() -> tuple[ModuleLoad, ...]:
    """Every module loaded so far in this process, in order (what a cold start spent on kernels)."""
    return tuple(_module_loads)


def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc

    return nvrtc


def nvrtc_compile(source: KernelSource, architecture_option: str,
                  extra_options: tuple[str, ...] = ()) -> CompiledSource:
    """Compile `source` with NVRTC for `-arch=sm_XY` (CUBIN) or `-arch=compute_XY` (PTX), with `extra_options`
    after the usual ones (e.g. ptxas's report, `cupysparse.cuda.resources`); needs no GPU."""
    nvrtc = _nvrtc()
    program = nvrtc.createProgram(load_source(source.filename), source.filename, [], [])
    try:
        for expression in source.name_expressions:
            nvrtc.addNameExpression(program, expression)
        try:
            nvrtc.compileProgram(program, [architecture_option, *compile_options(source.filename), *extra_options])
        except nvrtc.NVRTCError as error:
            raise RuntimeError(
                f"NVRTC failed on {source.filename} ({architecture_option}):\n{nvrtc.getProgramLog(program)}"
            ) from error
        lowered = {expression: nvrtc.getLoweredName(program, expression) for expression in source.name_expressions}
        real = architecture_option.startswith("-arch=sm_")
        return CompiledSource(nvrtc.getCUBIN(program) if real else nvrtc.getPTX(program), lowered,
                              nvrtc.getProgramLog(program))
    finally:
        nvrtc.destroyProgram(program)


def compile_for_architecture(source: KernelSource, arch: str) -> bytes:
    """PTX of `source` for `arch` (e.g. 'sm_90'); needs no GPU."""
    return nvrtc_compile(source, f"-arch=compute_{arch.removeprefix('sm_')}").image


def architecture_option(compute_capability: int) -> str:
    """CUBIN for the GPU's own architecture when this NVRTC knows it; otherwise PTX of the newest
    architecture it knows below it, which the driver compiles on load."""
    supported = _nvrtc().getSupportedArchs()
    if compute_capability in supported:
        return f"-arch=sm_{compute_capability}"
    older = [arch for arch in supported if arch <= compute_capability]
    if not older:
        raise RuntimeError(f"this NVRTC ({_nvrtc().getVersion()}) cannot compile for sm_{compute_capability}")
    return f"-arch=compute_{max(older)}"


def pinned_capability(architecture: str) -> int:
    """The compute capability an architecture-specific target runs on: 90 for "sm_90a"."""
    return int(architecture.removeprefix("sm_").rstrip("af"))


@functools.cache
def nvrtc_knows(architecture: str) -> bool:
    """Whether this NVRTC compiles for `architecture` ("sm_90a": NVRTC 12.0 or newer, which knows sm_90)."""
    try:
        nvrtc = _nvrtc()
        return nvrtc.getVersion() >= (12, 0) and pinned_capability(architecture) in nvrtc.getSupportedArchs()
    except Exception:  # noqa: BLE001 - no NVRTC at all
        return False


def source_option(source: KernelSource, compute_capability: int) -> str:
    """The NVRTC architecture option `source` compiles with for a GPU of `compute_capability`:
    `architecture_option`, or the source's own architecture, refused (RuntimeError) on any other GPU:
    an architecture-specific kernel launched elsewhere would poison the CUDA context."""
    if source.architecture is None:
        return architecture_option(compute_capability)
    if compute_capability != pinned_capability(source.architecture):
        raise RuntimeError(f"{source.filename} is compiled for {source.architecture} only, not for "
                           f"sm_{compute_capability}")
    if not nvrtc_knows(source.architecture):
        raise RuntimeError(f"this NVRTC ({_nvrtc().getVersion()}) cannot compile for {source.architecture}")
    return f"-arch={source.architecture}"


def kernel_cache_file(source: KernelSource, option: str) -> Path | None:
    """Where the compiled `source` is kept: the kernel cache directory (`CUPY_CACHE_DIR`), one file
    per source text, options, architecture and NVRTC version; None when kernels stay in memory."""
    if settings.cupy_cache_in_memory():
        return None
    key = hashlib.sha256(
        repr((KERNEL_CACHE_FORMAT, source.name_expressions, compile_options(source.filename), option,
              _nvrtc().getVersion())).encode()
        + load_source(source.filename).encode()
    ).hexdigest()[:32]
    return Path(kernel_cache_dir()) / f"cupysparse_{Path(source.filename).stem}_{key}.msgpack"


def _read_cached(path: Path | None, source: KernelSource) -> CompiledSource | None:
    if path is None:
        return None
    try:
        document = msgpack.unpackb(path.read_bytes(), raw=False)
        compiled = CompiledSource(bytes(document["image"]), dict(document["lowered_names"]))
    except (OSError, ValueError, TypeError, KeyError):  # absent, unreadable or damaged: compile again
        return None
    return compiled if set(compiled.lowered_names) == set(source.name_expressions) else None


def _warn_once_about_writing(directory: Path, error: OSError) -> None:
    global _cache_write_warned
    if not _cache_write_warned:
        _cache_write_warned = True
        warnings.warn(
            f"cannot write the kernel cache in {directory} ({error}); kernels will be compiled again in the "
            "next process (set CUPY_CACHE_DIR to a writable directory)",
            RuntimeWarning,
            stacklevel=5,
        )


def _write_cached(path: Path | None, compiled: CompiledSource) -> None:
    """Store `compiled` at `path` by atomic replace, readable by every user of a shared cache."""
    if path is None:
        return
    data = msgpack.packb({"image": compiled.image, "lowered_names": compiled.lowered_names}, use_bin_type=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    except OSError as error:
        _warn_once_about_writing(path.parent, error)
        return
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        _warn_once_about_writing(path.parent, error)


def cached_or_compiled(source: KernelSource, option: str) -> tuple[CompiledSource, bool]:
    """`source` compiled for the NVRTC architecture `option` (see `architecture_option`): read from
    the kernel cache, or compiled by NVRTC and stored there; the flag says whether NVRTC ran. Needs
    no GPU, so the kernel cache of an architecture can be filled ahead of time (`python -m
    cupysparse warmup --arch sm_90`)."""
    path = kernel_cache_file(source, option)
    compiled = _read_cached(path, source)
    if compiled is not None:
        return compiled, False
    compiled = nvrtc_compile(source, option)
    _write_cached(path, compiled)
    return compiled, True


def compile_workers() -> int:
    """Compilations at a time: the CPUs this process may run on (NVRTC keeps one busy per program)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class Compilation:
    """One source made ready for one NVRTC architecture option: its image and lowered names, whether
    NVRTC compiled it (else the kernel cache held it), and the seconds that took."""

    compiled: CompiledSource
    compiled_now: bool
    seconds: float


def _timed_compilation(source: KernelSource, option: str) -> Compilation:
    begin = time.perf_counter()
    compiled, compiled_now = cached_or_compiled(source, option)
    return Compilation(compiled, compiled_now, time.perf_counter() - begin)


@functools.cache
def _compile_pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="cupysparse-nvrtc")


# Compilations under way, by source and NVRTC option: a second request joins the first.
_compilations: dict[tuple[KernelSource, str], concurrent.futures.Future] = {}
_compilations_lock = threading.Lock()


def compile_async(source: KernelSource, option: str, workers: int | None = None) -> concurrent.futures.Future:
    """A future of `source`'s `Compilation` for the NVRTC architecture `option` (`cached_or_compiled`
    on a pool of `workers` threads, default `compile_workers()`); while one for the same source and
    option is under way, that one. Needs no GPU."""
    key = (source, option)
    with _compilations_lock:
        future = _compilations.get(key)
        if future is not None:
            return future
        future = _compilations[key] = _compile_pool(workers or compile_workers()).submit(
            _timed_compilation, source, option)
    future.add_done_callback(lambda done: _forget_compilation(key, done))
    return future


def _forget_compilation(key, future) -> None:
    with _compilations_lock:
        if _compilations.get(key) is future:
            del _compilations[key]


def _reset_after_fork() -> None:
    """A forked child has none of its parent's threads: it starts with no pools and nothing under way."""
    global _compilations_lock, _modules_lock
    _compile_pool.cache_clear()
    _compilations.clear()
    _loading.clear()
    _compilations_lock, _modules_lock = threading.Lock(), threading.Lock()


# Modules being compiled for a device and not loaded yet, or whose compilation failed (the error is
# raised again at each launch of the process instead of compiling again).
_loading: dict[tuple[KernelSource, int], concurrent.futures.Future] = {}
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


@functools.cache
def _device_capability(device_id: int) -> int:
    return int(cupy_module().cuda.Device(device_id).compute_capability)


def _compilation_for(source: KernelSource, device_id: int) -> concurrent.futures.Future:
    """The compilation of `source` for `device_id`, or a failed future saying why it cannot have one."""
    try:
        option = source_option(source, _device_capability(device_id))
    except RuntimeError as error:
        refused = concurrent.futures.Future()
        refused.set_exception(error)
        return refused
    return compile_async(source, option)


def _start_loading(sources, device_id: int) -> dict[KernelSource, concurrent.futures.Future]:
    """The compilation of each of `sources` not loaded on `device_id` yet, started where it is not."""
    started = {}
    with _modules_lock:
        for source in dict.fromkeys(sources):
            key = (source, device_id)
            if key in _modules:
                continue
            future = _loading.get(key)
            if future is None:
                future = _loading[key] = _compilation_for(source, device_id)
            started[source] = future
    return started


def _finish_loading(source: KernelSource, device_id: int, future: concurrent.futures.Future) -> LoadedModule:
    """`source`'s module on `device_id` once `future` (its compilation) is done; raises its error."""
    compilation = future.result()
    key = (source, device_id)
    with _modules_lock:
        loaded = _modules.get(key)
        if loaded is None:
            cupy = cupy_module()
            begin = time.perf_counter()
            with cupy.cuda.Device(device_id):
                module = cupy.cuda.function.Module()
                module.load(compilation.compiled.image)
            loaded = _modules[key] = LoadedModule(module, compilation.compiled.lowered_names, {})
            _loading.pop(key, None)
            _module_loads.append(ModuleLoad(source.filename, device_id,
                                            compilation.seconds + time.perf_counter() - begin,
                                            compilation.compiled_now))
    return loaded


def start_loading(sources) -> dict[KernelSource, concurrent.futures.Future]:
    """Start compiling (or reading from the kernel cache), in the order given, each of `sources` not
    loaded on the current device yet, without waiting: a later `prepare` or launch of it joins its
    compilation. Returns those under way, by source. Without CuPy or a usable GPU, nothing."""
    cupy = cupy_module()
    if cupy is None:
        return {}
    try:
        return _start_loading(list(dict.fromkeys(sources)), cupy.cuda.Device().id)
    except Exception:  # noqa: BLE001 - no usable GPU, or NVRTC cannot compile for it: each launch raises why
        return {}


def prepare(sources) -> None:
    """Load every one of `sources` on the current device, the ones not loaded yet compiled (or read
    from the kernel cache) concurrently, on up to `compile_workers()` threads: what the tuner calls
    before measuring candidates that launch from several modules. Safe to call from several threads:
    each module is compiled once. A module that fails is not raised here but by the launch that needs
    it (the tuner skips that candidate). Without CuPy, nothing."""
    started = start_loading(sources)
    if not started:
        return
    device_id = cupy_module().cuda.Device().id
    for source, future in started.items():
        with contextlib.suppress(Exception):  # raised again by the launch that needs the module
            _finish_loading(source, device_id, future)


def get_kernel(source: KernelSource, name_expression: str):
    """The kernel `name_expression` of `source`, loaded on the current device (memoised): from the
    kernel cache when it holds this source, else compiled by NVRTC and stored there."""
    if name_expression not in source.name_expressions:
        raise KeyError(f"{name_expression} is not declared by {source.filename}: {source.name_expressions}")
    cupy = cupy_module()
    if cupy is None:
        raise RuntimeError("CUDA kernels need CuPy: pip install 'cupysparse[cuda]'")
    device_id = cupy.cuda.Device().id
    loaded = _modules.get((source, device_id))
    if loaded is None:
        started = _start_loading((source,), device_id)
        loaded = _modules[(source, device_id)] if source not in started else _finish_loading(
            source, device_id, started[source])
    function = loaded.functions.get(name_expression)
    if function is None:
        function = loaded.functions[name_expression] = loaded.module.get_function(
            loaded.lowered_names[name_expression]
        )
    return function


@functools.cache
def _prepared_launch(source: KernelSource, name_expression: str, device: int, block: int,
                     num_arguments: int, fixed: tuple) -> PreparedLaunch:
    arguments = [None] * num_arguments
    for position, data in fixed:
        arguments[position] = data
    return PreparedLaunch(source.get(name_expression), (1,), (block,), arguments)


def launch_config(num_threads: int, block_size: int = ROW_BLOCK) -> tuple[tuple[int], tuple[int]]:
    """Grid and block for a one-thread-per-item kernel (at least one block)."""
    return (max(1, -(-num_threads // block_size)),), (block_size,)


# Shared memory a block may use without opting in (larger dynamic sizes are set per kernel).
STATIC_SHARED_LIMIT = 48 * 1024


_SHARED_OPT_INS: set[tuple[int, int]] = set()


def _fixed_bytes(argument) -> bytes:
    """A fixed kernel argument as the bytes its slot holds, a multiple of 8 long: a device address, a
    scalar's little-endian bytes, or `bytes` as they are (a struct's, e.g. `np.void.tobytes()`)."""
    if is_cupy_array(argument):
        data = argument.data.ptr.to_bytes(8, "little")
    elif isinstance(argument, bytes):
        data = argument
    else:
        data = (argument if isinstance(argument, np.generic) else np.asarray(argument)).tobytes()
    return data + bytes(-len(data) % 8)


class PreparedLaunch:
    """One kernel's launch with its block, dynamic shared memory and arguments fixed, except the
    arguments given as None (device addresses or non-negative integers, filled in per call):
    `launch(stream, *values, grid=None)`, `stream` a raw CUDA stream handle (0: the legacy default
    stream), `grid` an (x, y, z) in place of the prepared one. A CuPy `Function` call converts every
    argument again on every launch, about a microsecond each; this costs one driver call.

    Every per-call value sits in an 8-byte slot of one buffer (a 4-byte integer in its first bytes,
    which is all the kernel reads of it), so that one `struct` call writes them all; the fixed ones
    follow in slots of their own size (`bytes` among `arguments` are a struct's, passed as they are).
    A second buffer holds the slots' addresses in argument order, which is what cuLaunchKernel takes;
    it copies the values before it returns, so the buffers are refilled under a lock and reused.
    Arrays among `arguments` (e.g. a pair table) are kept alive with the launch."""

    def __init__(self, kernel, grid, block, arguments, shared_bytes: int = 0):
        driver = cupy_module().cuda.driver
        self._launch_kernel = driver.launchKernel
        self._function = kernel.ptr
        self._shared_bytes = shared_bytes
        # Dynamic shared memory past the default needs an opt-in, set once per kernel and size (a driver call).
        if shared_bytes > STATIC_SHARED_LIMIT and (self._function, shared_bytes) not in _SHARED_OPT_INS:
            driver.funcSetAttribute(self._function, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                    shared_bytes)
            _SHARED_OPT_INS.add((self._function, shared_bytes))
        self._grid = (*(tuple(grid) + (1, 1))[:3],)
        self._block_x, self._block_y, self._block_z = (tuple(block) + (1, 1))[:3]
        self.block_threads = self._block_x * self._block_y * self._block_z
        free = [i for i, argument in enumerate(arguments) if argument is None]
        fixed = [(i, _fixed_bytes(argument)) for i, argument in enumerate(arguments) if argument is not None]
        self._num_free = len(free)
        self._arrays = [argument for argument in arguments if is_cupy_array(argument)]
        self._values = np.frombuffer(bytes(8 * len(free)) + b"".join(data for _, data in fixed),
                                     dtype=np.uint64).copy()
        addresses = [0] * len(arguments)
        for slot, i in enumerate(free):
            addresses[i] = self._values.ctypes.data + 8 * slot
        start = self._values.ctypes.data + 8 * len(free)
        for i, data in fixed:
            addresses[i], start = start, start + len(data)
        self._slots = np.array(addresses, dtype=np.uint64)
        self._slots_address = self._slots.ctypes.data
        self._write_free = struct.Struct(f"<{len(free)}Q").pack_into
        self._lock = threading.Lock()

    def resident_blocks(self) -> int:
        """Blocks of this launch that one multiprocessor holds at once, as its registers and shared memory allow:
        a grid of this many per multiprocessor runs in one wave."""
        return int(cupy_module().cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
            self._function, self.block_threads, self._shared_bytes))

    def launch(self, stream: int, *values: int, grid: tuple[int, int, int] | None = None) -> None:
        # Every step costs on the hot path: the checks run only once packing the values has failed.
        grid_x, grid_y, grid_z = grid or self._grid
        with self._lock:
            try:
                self._write_free(self._values, 0, *values)
            except struct.error:
                if len(values) != self._num_free:
                    raise TypeError(f"this launch takes {self._num_free} values, got {len(values)}") from None
                raise
            self._launch_kernel(self._function, grid_x, grid_y, grid_z, self._block_x, self._block_y, self._block_z,
                                self._shared_bytes, stream, self._slots_address, 0)
