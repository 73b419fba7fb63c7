"""The compile layer: every kernel compiles under NVRTC without a GPU; header edits change the key."""

import importlib
import pkgutil

import pytest

import cupysparse
from cupysparse import compile as kernel_compile

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
