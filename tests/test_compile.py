"""The compile layer: every kernel compiles under NVRTC without a GPU; header edits change the key."""

import importlib
import pkgutil
import warnings

import pytest

import cupysparse
from cupysparse import compile as kernel_compile
from cupysparse.backend import cupy_module, gpu_available

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


needs_nvrtc = pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC not installed (pip install '.[cuda]')")


def test_every_kernel_file_is_declared():
    _import_all_modules()
    declared = {source.filename for source in kernel_compile.registered_sources()}
    on_disk = {path.name for path in kernel_compile.KERNEL_DIR.glob("*.cu")}
    assert on_disk, "no kernel sources found"
    assert on_disk == declared


def _registered_sources():
    _import_all_modules()
    return sorted(set(kernel_compile.registered_sources()), key=lambda s: s.filename)


@needs_nvrtc
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("source", _registered_sources(), ids=lambda s: s.filename)
def test_kernel_compiles_with_nvrtc(source, arch):
    ptx = kernel_compile.compile_for_architecture(source, arch)
    assert f".target {arch}".encode() in ptx
    assert b".entry" in ptx


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


@needs_nvrtc
def test_mma_header_is_found_with_the_cuda_extra():
    assert kernel_compile.find_mma_header() is not None


@needs_nvrtc
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


@needs_nvrtc
def test_a_real_architecture_compiles_to_a_cubin_with_every_lowered_name(probe_source):
    compiled = kernel_compile.nvrtc_compile(probe_source, "-arch=sm_90")
    assert compiled.image[:4] == b"\x7fELF"
    assert set(compiled.lowered_names) == {"probe<1>", "probe<2>"}
    assert all(name.startswith("_Z") for name in compiled.lowered_names.values())  # mangled
    assert b".target sm_80" in kernel_compile.nvrtc_compile(probe_source, "-arch=compute_80").image


@needs_nvrtc
def test_an_architecture_newer_than_nvrtc_gets_ptx_of_the_newest_it_knows(monkeypatch):
    monkeypatch.setattr(kernel_compile._nvrtc(), "getSupportedArchs", lambda: (80, 86, 90))
    assert kernel_compile.architecture_option(90) == "-arch=sm_90"
    assert kernel_compile.architecture_option(89) == "-arch=compute_86"
    with pytest.raises(RuntimeError, match="sm_75"):
        kernel_compile.architecture_option(75)


@needs_nvrtc
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


@needs_nvrtc
def test_the_lineinfo_variable_adds_line_information_and_changes_the_cache_key(probe_source, kernel_dir, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(kernel_dir / "cache"))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    monkeypatch.delenv(kernel_compile.LINEINFO_VARIABLE, raising=False)
    plain_path = kernel_compile.kernel_cache_file(probe_source, "-arch=sm_90")
    assert b".loc" not in kernel_compile.compile_for_architecture(probe_source, "sm_90")
    monkeypatch.setenv(kernel_compile.LINEINFO_VARIABLE, "1")
    assert "-lineinfo" in kernel_compile.compile_options("probe.cu")
    assert kernel_compile.kernel_cache_file(probe_source, "-arch=sm_90") != plain_path
    assert b".loc" in kernel_compile.compile_for_architecture(probe_source, "sm_90")


@needs_nvrtc
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


@needs_nvrtc
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
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU")
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
