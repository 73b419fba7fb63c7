"""The compile layer: every kernel compiles under NVRTC without a GPU; header edits change the key."""

import collections
import concurrent.futures
import ctypes
import importlib
import pkgutil
import struct
import time
import types
import warnings

import numpy as np
import pytest

import cupysparse
from cupysparse import settings
from cupysparse.cuda import compile as kernel_compile
from cupysparse.cuda.backend import cupy_module

ARCHITECTURES = ("sm_80", "sm_86", "sm_89", "sm_90")


def _import_all_modules():
    for module in pkgutil.walk_packages(cupysparse.__path__, "cupysparse."):
        if not module.name.startswith(("cupysparse.adapters", "cupysparse.scripts")):
            importlib.import_module(module.name)


def _nvrtc_available() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception:
        return False
    return True




def test_every_kernel_file_is_declared():
    _import_all_modules()
    declared = {source.filename for source in kernel_compile.registered_sources()}
    on_disk = {path.name for path in kernel_compile.KERNEL_DIR.glob("*.cu")}
    assert on_disk, "no kernel sources found"
    assert on_disk == declared


def _declared_per_file() -> dict[str, tuple[str, ...]]:
    """Every instantiation declared from each kernel file, over all the sources (modules) it is split into."""
    _import_all_modules()
    declared: dict[str, dict[str, None]] = {}
    for source in kernel_compile.registered_sources():
        declared.setdefault(source.filename, {}).update(dict.fromkeys(source.name_expressions))
    return {filename: tuple(expressions) for filename, expressions in sorted(declared.items())}


def _architectures_per_file() -> dict[str, tuple[str, ...]]:
    """The architectures each kernel file is compiled for: its sources' own (e.g. sm_90a for wgmma),
    else ARCHITECTURES."""
    _import_all_modules()
    pinned: dict[str, set[str]] = {}
    for source in kernel_compile.registered_sources():
        pinned.setdefault(source.filename, set()).add(source.architecture)
    assert all(len(architectures) == 1 for architectures in pinned.values()), "one architecture rule per file"
    return {filename: ARCHITECTURES if architectures == {None} else tuple(sorted(architectures))
            for filename, architectures in pinned.items()}


_FILE_ARCHITECTURES = [(filename, arch) for filename, architectures in sorted(_architectures_per_file().items())
                       for arch in architectures]


@pytest.fixture(scope="module")
def ptx_per_file():
    """Futures of each file's PTX per architecture, each file's instantiations in one NVRTC program
    (what the modules it is split into compile, its headers parsed once), all compiled at once on a
    thread per CPU: NVRTC releases the interpreter lock."""
    registered = list(kernel_compile.registered_sources())
    sources = {filename: kernel_compile.KernelSource(filename, expressions)
               for filename, expressions in _declared_per_file().items()}
    kernel_compile._REGISTRY[:] = registered  # checked here, not modules a process loads
    with concurrent.futures.ThreadPoolExecutor(kernel_compile.compile_workers()) as pool:
        yield {(filename, arch): pool.submit(kernel_compile.compile_for_architecture, sources[filename], arch)
               for filename, arch in _FILE_ARCHITECTURES}


@pytest.mark.nvrtc
@pytest.mark.parametrize(("filename", "arch"), _FILE_ARCHITECTURES)
def test_kernel_compiles_with_nvrtc(filename, arch, ptx_per_file):
    ptx = ptx_per_file[(filename, arch)].result()
    assert f".target {arch}".encode() in ptx
    assert ptx.count(b".entry") >= len(_declared_per_file()[filename])


@pytest.mark.nvrtc
def test_the_wgmma_kernels_compile_for_sm_90a_and_only_there(ptx_per_file):
    """Its sources are pinned to sm_90a, and the sm_90a PTX holds the warpgroup instructions and the
    proxy fence the body is guarded for (elsewhere an empty stub)."""
    assert _architectures_per_file()["wgmma_implicit_gemm.cu"] == ("sm_90a",)
    ptx = ptx_per_file[("wgmma_implicit_gemm.cu", "sm_90a")].result()
    for instruction in (b"wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16", b"wgmma.fence.sync.aligned",
                        b"wgmma.commit_group.sync.aligned", b"wgmma.wait_group.sync.aligned",
                        b"wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32", b"fence.proxy.async.shared::cta",
                        b"cp.async.cg.shared.global"):
        assert instruction in ptx, instruction


def test_a_pinned_source_compiles_for_its_own_capability_only(kernel_dir, monkeypatch):
    (kernel_dir / "probe.cu").write_text("__global__ void probe() {}\n")
    monkeypatch.setattr(kernel_compile, "_REGISTRY", [])
    monkeypatch.setattr(kernel_compile, "nvrtc_knows", lambda architecture: True)
    pinned = kernel_compile.KernelSource("probe.cu", ("probe",), "sm_90a")
    assert kernel_compile.source_option(pinned, 90) == "-arch=sm_90a"
    for capability in (80, 89, 100, 120):
        with pytest.raises(RuntimeError, match="sm_90a only"):
            kernel_compile.source_option(pinned, capability)
    monkeypatch.setattr(kernel_compile, "nvrtc_knows", lambda architecture: False)
    with pytest.raises(RuntimeError, match="cannot compile for sm_90a"):
        kernel_compile.source_option(pinned, 90)
    assert kernel_compile.pinned_capability("sm_90a") == 90


@pytest.mark.nvrtc
def test_this_nvrtc_knows_sm_90a():
    assert kernel_compile.nvrtc_knows("sm_90a")


@pytest.fixture
def kernel_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_compile, "KERNEL_DIR", tmp_path)
    kernel_compile.load_source.cache_clear()
    yield tmp_path
    kernel_compile.load_source.cache_clear()


def test_header_edit_changes_source_key(kernel_dir):
    (kernel_dir / "outer.cuh").write_text('#include "inner.cuh"\n')
    (kernel_dir / "inner.cuh").write_text("#define VALUE 1\n")
    (kernel_dir / "probe.cu").write_text('#include "outer.cuh"\n__global__ void probe() {}\n')
    before = kernel_compile.load_source("probe.cu")
    (kernel_dir / "inner.cuh").write_text("#define VALUE 2\n")
    kernel_compile.load_source.cache_clear()
    after = kernel_compile.load_source("probe.cu")
    assert before != after
    assert before.startswith('#include "outer.cuh"')


def test_missing_mma_header_names_the_package(kernel_dir, monkeypatch):
    (kernel_dir / "tensor_core.cu").write_text("#include <mma.h>\n__global__ void probe() {}\n")
    monkeypatch.setattr(kernel_compile, "find_mma_header", lambda: None)
    with pytest.raises(RuntimeError, match=r"cuda-toolkit\[crt\]"):
        kernel_compile.compile_options("tensor_core.cu")


@pytest.mark.nvrtc
def test_mma_header_is_found_with_the_cuda_extra():
    assert kernel_compile.find_mma_header() is not None


@pytest.mark.nvrtc
def test_compile_error_shows_the_nvrtc_log(kernel_dir, monkeypatch):
    (kernel_dir / "broken.cu").write_text("__global__ void broken() { undeclared_name = 1; }\n")
    monkeypatch.setattr(kernel_compile, "_REGISTRY", [])
    source = kernel_compile.KernelSource("broken.cu", ("broken",))
    with pytest.raises(RuntimeError, match="undeclared_name"):
        kernel_compile.compile_for_architecture(source, "sm_80")


def test_undeclared_instantiation_is_rejected(kernel_dir, monkeypatch):
    (kernel_dir / "probe.cu").write_text("__global__ void probe() {}\n")
    monkeypatch.setattr(kernel_compile, "_REGISTRY", [])
    source = kernel_compile.KernelSource("probe.cu", ("probe",))
    with pytest.raises(KeyError, match="not declared"):
        kernel_compile.get_kernel(source, "other")


@pytest.fixture
def probe_source(kernel_dir, monkeypatch):
    (kernel_dir / "probe.cu").write_text("template <int N> __global__ void probe(int* out) { out[0] = N; }\n")
    monkeypatch.setattr(kernel_compile, "_REGISTRY", [])
    return kernel_compile.KernelSource("probe.cu", ("probe<1>", "probe<2>"))


@pytest.mark.nvrtc
def test_a_real_architecture_compiles_to_a_cubin_with_every_lowered_name(probe_source):
    compiled = kernel_compile.nvrtc_compile(probe_source, "-arch=sm_90")
    assert compiled.image[:4] == b"\x7fELF"
    assert set(compiled.lowered_names) == {"probe<1>", "probe<2>"}
    assert all(name.startswith("_Z") for name in compiled.lowered_names.values())  # mangled
    assert b".target sm_80" in kernel_compile.nvrtc_compile(probe_source, "-arch=compute_80").image


@pytest.mark.nvrtc
def test_an_architecture_newer_than_nvrtc_gets_ptx_of_the_newest_it_knows(monkeypatch):
    monkeypatch.setattr(kernel_compile._nvrtc(), "getSupportedArchs", lambda: (80, 86, 90))
    assert kernel_compile.architecture_option(90) == "-arch=sm_90"
    assert kernel_compile.architecture_option(89) == "-arch=compute_86"
    with pytest.raises(RuntimeError, match="sm_75"):
        kernel_compile.architecture_option(75)


@pytest.mark.nvrtc
def test_the_kernel_cache_file_changes_with_the_source_and_the_architecture(probe_source, kernel_dir, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(kernel_dir / "cache"))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    path = kernel_compile.kernel_cache_file(probe_source, "-arch=sm_90")
    assert path.parent == kernel_dir / "cache" and path.name.startswith("cupysparse_probe_")
    assert kernel_compile.kernel_cache_file(probe_source, "-arch=sm_90") == path
    assert kernel_compile.kernel_cache_file(probe_source, "-arch=sm_80") != path
    (kernel_dir / "probe.cu").write_text("template <int N> __global__ void probe(int* out) { out[0] = 2 * N; }\n")
    kernel_compile.load_source.cache_clear()
    assert kernel_compile.kernel_cache_file(probe_source, "-arch=sm_90") != path
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")
    assert kernel_compile.kernel_cache_file(probe_source, "-arch=sm_90") is None


@pytest.mark.nvrtc
def test_the_lineinfo_variable_adds_line_information_and_changes_the_cache_key(probe_source, kernel_dir, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(kernel_dir / "cache"))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    monkeypatch.delenv(settings.NVRTC_LINEINFO.name, raising=False)
    plain_path = kernel_compile.kernel_cache_file(probe_source, "-arch=sm_90")
    assert b".loc" not in kernel_compile.compile_for_architecture(probe_source, "sm_90")
    monkeypatch.setenv(settings.NVRTC_LINEINFO.name, "1")
    assert "-lineinfo" in kernel_compile.compile_options("probe.cu")
    assert kernel_compile.kernel_cache_file(probe_source, "-arch=sm_90") != plain_path
    assert b".loc" in kernel_compile.compile_for_architecture(probe_source, "sm_90")


@pytest.mark.nvrtc
def test_cached_kernels_round_trip_and_damaged_files_are_compiled_again(probe_source, tmp_path):
    compiled = kernel_compile.nvrtc_compile(probe_source, "-arch=sm_90")
    path = tmp_path / "cache" / "probe.msgpack"
    kernel_compile._write_cached(path, compiled)
    assert kernel_compile._read_cached(path, probe_source) == compiled
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left behind
    path.write_bytes(path.read_bytes()[:-20])
    assert kernel_compile._read_cached(path, probe_source) is None
    other = kernel_compile.KernelSource("probe.cu", ("probe<1>",))  # declares other instantiations
    kernel_compile._write_cached(path, compiled)
    assert kernel_compile._read_cached(path, other) is None


@pytest.mark.nvrtc
def test_an_unwritable_kernel_cache_warns_once(probe_source, tmp_path, monkeypatch):
    compiled = kernel_compile.nvrtc_compile(probe_source, "-arch=sm_90")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setattr(kernel_compile, "_cache_write_warned", False)
    with pytest.warns(RuntimeWarning, match="cannot write the kernel cache"):
        kernel_compile._write_cached(blocker / "cache" / "probe.msgpack", compiled)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernel_compile._write_cached(blocker / "cache" / "again.msgpack", compiled)


@pytest.mark.gpu
@pytest.mark.gpu
def test_a_kernel_compiled_once_loads_from_the_cache_without_nvrtc(probe_source, kernel_dir, monkeypatch):
    cupy = cupy_module()
    monkeypatch.setenv("CUPY_CACHE_DIR", str(kernel_dir / "cache"))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    monkeypatch.setattr(kernel_compile, "_modules", {})
    out = cupy.zeros(1, dtype=cupy.int32)
    kernel_compile.get_kernel(probe_source, "probe<2>")((1,), (1,), (out,))
    assert int(out[0]) == 2 and kernel_compile.module_loads()[-1].compiled

    monkeypatch.setattr(kernel_compile, "_modules", {})  # as in a new process
    monkeypatch.setattr(kernel_compile, "nvrtc_compile", lambda *args: pytest.fail("compiled again"))
    kernel_compile.get_kernel(probe_source, "probe<1>")((1,), (1,), (out,))
    assert int(out[0]) == 1 and not kernel_compile.module_loads()[-1].compiled


class _FakeDevice:
    """What `compile` asks of `cupy.cuda.Device`: an id, a compute capability, a context."""

    def __init__(self, device_id=None):
        self.id = 0 if device_id is None else device_id
        self.compute_capability = "90"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _FakeModule:
    loaded: list = []

    def load(self, image):
        _FakeModule.loaded.append(image)

    def get_function(self, lowered_name):
        return lowered_name


@pytest.fixture
def counted_compiles(kernel_dir, monkeypatch):
    """A family of one-kernel probe sources, a kernel cache of the test's own, a stand-in for CuPy's
    device and module (no GPU needed), and the NVRTC compilations counted per source."""
    (kernel_dir / "probe.cu").write_text("template <int N> __global__ void probe(int* out) { out[0] = N; }\n")
    monkeypatch.setattr(kernel_compile, "_REGISTRY", [])
    monkeypatch.setenv("CUPY_CACHE_DIR", str(kernel_dir / "cache"))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    for name in ("_modules", "_loading", "_compilations"):
        monkeypatch.setattr(kernel_compile, name, {})
    monkeypatch.setattr(kernel_compile, "_module_loads", [])
    kernel_compile._device_capability.cache_clear()
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=_FakeDevice, function=types.SimpleNamespace(Module=_FakeModule)))
    monkeypatch.setattr(kernel_compile, "cupy_module", lambda: fake_cupy)
    monkeypatch.setattr(_FakeModule, "loaded", [])
    counts = collections.Counter()
    real_compile = kernel_compile.nvrtc_compile

    def counting_compile(source, option):
        counts[source] += 1
        time.sleep(0.2)  # every thread asks while the first compilation is still under way
        return real_compile(source, option)

    monkeypatch.setattr(kernel_compile, "nvrtc_compile", counting_compile)
    family = kernel_compile.KernelFamily("probe.cu", [(f"probe<{n}>",) for n in range(1, 5)])
    yield family, counts
    kernel_compile._device_capability.cache_clear()


def test_a_family_declares_one_module_per_group(kernel_dir, monkeypatch):
    (kernel_dir / "probe.cu").write_text("template <int N> __global__ void probe(int* out) { out[0] = N; }\n")
    monkeypatch.setattr(kernel_compile, "_REGISTRY", [])
    family = kernel_compile.KernelFamily("probe.cu", [("probe<1>", "probe<2>"), ("probe<3>",)])
    assert kernel_compile.registered_sources() == family.sources
    assert family.name_expressions == ("probe<1>", "probe<2>", "probe<3>")
    assert family.source_of("probe<2>") is family.sources[0] and family.source_of("probe<3>") is family.sources[1]
    with pytest.raises(KeyError, match="not declared"):
        family.source_of("probe<4>")


@pytest.mark.nvrtc
def test_prepare_from_several_threads_compiles_each_module_once_into_the_cache(counted_compiles, kernel_dir):
    family, counts = counted_compiles
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in pool.map(lambda _: kernel_compile.prepare(family.sources), range(4)):
            pass
    assert counts == {source: 1 for source in family.sources}
    assert len(_FakeModule.loaded) == len(family.sources)  # each module loaded once on the device
    loads = kernel_compile.module_loads()
    assert sorted(load.compiled for load in loads) == [True] * len(family.sources)
    option = kernel_compile.architecture_option(90)
    assert {path.name for path in (kernel_dir / "cache").iterdir()} == {
        kernel_compile.kernel_cache_file(source, option).name for source in family.sources}
    assert family.get("probe<3>") == kernel_compile.cached_or_compiled(family.sources[2], option)[0].lowered_names[
        "probe<3>"]
    assert sum(counts.values()) == len(family.sources)  # the launch found its module loaded


@pytest.mark.nvrtc
def test_nvrtc_releases_the_interpreter_lock_while_it_compiles(kernel_dir, monkeypatch):
    """Why modules compile in threads: while one compiles, this thread runs on (held, the lock would
    stop it for the whole compilation)."""
    (kernel_dir / "slow.cu").write_text(
        "template <int N> __global__ void slow(float* out) {\n"
        "    float x = out[threadIdx.x];\n"
        "#pragma unroll\n"
        "    for (int i = 0; i < N; ++i) x = x * 1.0001f + sinf(x + i);\n"
        "    out[threadIdx.x] = x;\n"
        "}\n")
    monkeypatch.setattr(kernel_compile, "_REGISTRY", [])
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")
    source = kernel_compile.KernelSource("slow.cu", ("slow<64>",))  # about half a second of NVRTC
    future = kernel_compile.compile_async(source, "-arch=sm_90", workers=1)
    assert kernel_compile.compile_async(source, "-arch=sm_90", workers=1) is future  # joined, not started again
    longest_pause, last = 0.0, time.perf_counter()
    while not future.done():
        now = time.perf_counter()
        longest_pause, last = max(longest_pause, now - last), now
    compilation = future.result()
    assert compilation.compiled_now and list(compilation.compiled.lowered_names) == ["slow<64>"]
    assert compilation.seconds > 0.2 and longest_pause < compilation.seconds / 4


@pytest.mark.nvrtc
def test_a_module_that_fails_is_raised_by_its_launch_not_by_prepare_and_compiled_once(counted_compiles, kernel_dir):
    family, counts = counted_compiles
    (kernel_dir / "broken.cu").write_text("__global__ void broken() { undeclared_name = 1; }\n")
    broken = kernel_compile.KernelSource("broken.cu", ("broken",))
    kernel_compile.prepare([broken, family.sources[0]])
    assert counts[family.sources[0]] == 1 and len(_FakeModule.loaded) == 1
    for _ in range(2):
        with pytest.raises(RuntimeError, match="undeclared_name"):
            kernel_compile.get_kernel(broken, "broken")
    assert counts[broken] == 1


@pytest.mark.nvrtc
def test_a_pinned_source_on_another_gpu_is_refused_at_its_launch_never_compiled(counted_compiles, kernel_dir,
                                                                                monkeypatch):
    family, counts = counted_compiles
    monkeypatch.setattr(_FakeDevice, "__init__", _fake_device_of(80))
    pinned = kernel_compile.KernelSource("probe.cu", ("probe<1>",), "sm_90a")
    kernel_compile.prepare([pinned, family.sources[0]])
    assert counts == {family.sources[0]: 1}
    with pytest.raises(RuntimeError, match="sm_90a only"):
        kernel_compile.get_kernel(pinned, "probe<1>")
    assert pinned not in counts and len(_FakeModule.loaded) == 1


@pytest.mark.nvrtc
def test_a_pinned_source_on_its_gpu_compiles_with_its_architecture(counted_compiles, kernel_dir):
    family, counts = counted_compiles
    pinned = kernel_compile.KernelSource("probe.cu", ("probe<1>",), "sm_90a")
    kernel_compile.get_kernel(pinned, "probe<1>")
    own = kernel_compile.kernel_cache_file(pinned, "-arch=sm_90a")
    assert counts == {pinned: 1} and {path.name for path in (kernel_dir / "cache").iterdir()} == {own.name}
    twin = kernel_compile.KernelSource("probe.cu", ("probe<1>",))  # the same kernel for the GPU's own architecture
    assert kernel_compile.kernel_cache_file(twin, kernel_compile.architecture_option(90)) != own


def _fake_device_of(capability: int):
    def init(self, device_id=None):
        self.id = 0 if device_id is None else device_id
        self.compute_capability = str(capability)

    return init


def test_prepare_without_a_usable_gpu_compiles_nothing_and_raises_nothing(counted_compiles, monkeypatch):
    family, counts = counted_compiles

    def no_device(device_id=None):
        raise RuntimeError("cudaErrorInsufficientDriver")

    monkeypatch.setattr(kernel_compile, "cupy_module", lambda: types.SimpleNamespace(
        cuda=types.SimpleNamespace(Device=no_device)))
    kernel_compile.prepare(family.sources)  # the launch that needs a kernel raises, not the tuner's preparation
    assert not counts and not kernel_compile.module_loads()


def test_a_prepared_launch_hands_the_driver_every_argument_in_order(monkeypatch):
    """The slots cuLaunchKernel reads, through the address array it is given: fixed arguments as
    prepared (a scalar in its slot's first bytes, an integer as it is), per-call values where the
    arguments were None, in the kernel's argument order."""
    launched = []

    def launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        addresses = (ctypes.c_uint64 * 5).from_address(params)
        launched.append(((gx, gy, gz, bx, by, bz), stream,
                         [ctypes.c_uint64.from_address(address).value for address in addresses]))

    driver = types.SimpleNamespace(launchKernel=launch_kernel)
    monkeypatch.setattr(kernel_compile, "cupy_module", lambda: types.SimpleNamespace(cuda=types.SimpleNamespace(
        driver=driver)))
    kernel = types.SimpleNamespace(ptr=1234)
    launch = kernel_compile.PreparedLaunch(kernel, (3,), (128,), (None, np.int32(7), None, 2**40, None))
    launch.launch(99, 11, 2**48 + 5, 13)
    launch.launch(98, 21, 22, 23, grid=(4, 5, 6))
    assert launched == [
        ((3, 1, 1, 128, 1, 1), 99, [11, 7, 2**48 + 5, 2**40, 13]),
        ((4, 5, 6, 128, 1, 1), 98, [21, 7, 22, 2**40, 23]),
    ]
    with pytest.raises(TypeError, match="takes 3 values, got 2"):
        launch.launch(99, 1, 2)
    with pytest.raises(struct.error):  # no slot holds a negative value
        launch.launch(99, -1, 2, 3)
    assert len(launched) == 2


def test_a_prepared_launch_hands_a_struct_over_as_its_bytes(monkeypatch):
    """A fixed argument given as bytes (a struct's, e.g. a query's geometry) sits whole at its slot's address,
    between per-call slots that stay 8 bytes apart from each other."""
    launched = []

    def launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        addresses = (ctypes.c_uint64 * 4).from_address(params)
        launched.append([ctypes.c_uint64.from_address(addresses[0]).value,
                         ctypes.string_at(addresses[1], 12),
                         ctypes.c_uint64.from_address(addresses[2]).value,
                         ctypes.c_int32.from_address(addresses[3]).value])

    monkeypatch.setattr(kernel_compile, "cupy_module", lambda: types.SimpleNamespace(cuda=types.SimpleNamespace(
        driver=types.SimpleNamespace(launchKernel=launch_kernel))))
    geometry = np.array([(3, 5, -7)], dtype=[("a", "<i4"), ("b", "<i4"), ("c", "<i4")])[0].tobytes()
    launch = kernel_compile.PreparedLaunch(types.SimpleNamespace(ptr=1), (1,), (32,),
                                           (None, geometry, None, np.int32(-2)))
    launch.launch(0, 2**40, 9)
    assert launched == [[2**40, geometry, 9, -2]]


def test_a_launch_per_row_covers_every_row_with_blocks_of_its_size(monkeypatch):
    """One thread per row, in blocks of `ROW_BLOCK`, at least one block, on the current stream; the values
    fill the per-call slots around a fixed struct."""
    from cupysparse.geometry.map_formats import _FORMAT_KERNELS

    launched = []

    def launch_kernel(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        addresses = (ctypes.c_uint64 * 3).from_address(params)
        launched.append(((gx, gy, gz, bx, by, bz), stream, ctypes.c_uint64.from_address(addresses[0]).value,
                         ctypes.string_at(addresses[1], 8), ctypes.c_uint64.from_address(addresses[2]).value))

    cuda = types.SimpleNamespace(driver=types.SimpleNamespace(launchKernel=launch_kernel),
                                 Device=lambda: types.SimpleNamespace(id=0),
                                 get_current_stream=lambda: types.SimpleNamespace(ptr=77))
    monkeypatch.setattr(kernel_compile, "cupy_module", lambda: types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(kernel_compile, "get_kernel", lambda source, name: types.SimpleNamespace(ptr=5))
    kernel_compile._prepared_launch.cache_clear()
    try:
        for num_rows in (0, 1, kernel_compile.ROW_BLOCK, kernel_compile.ROW_BLOCK + 1):
            _FORMAT_KERNELS.launch_per_row("offset_mask", num_rows, 11, 12, fixed=((1, b"geometry"),))
    finally:
        kernel_compile._prepared_launch.cache_clear()
    block = kernel_compile.ROW_BLOCK
    assert launched == [((blocks, 1, 1, block, 1, 1), 77, 11, b"geometry", 12) for blocks in (1, 1, 1, 2)]
