"""The benchmark cache and the kernel cache when the disk or the directory works against them: a
full disk, a directory shared by several users (some tests switch to another user in a forked
child, which takes root), and kernel sources edited under a populated cache."""

import errno
import json
import os
import pathlib
import shutil
import stat
import tempfile
import warnings

import pytest

from cupysparse.cuda import compile as kernel_compile
from cupysparse.tuning.cache_file import CACHE_FILENAME, BenchmarkCache

RESULTS = [("implicit_gemm", {"fwd_block_size": 16}, 1.25), ("explicit_gemm", {}, 7.0)]
OTHER_USER = 65534  # "nobody" on most systems
LOCK_FILENAME = CACHE_FILENAME + ".lock"


def any_digest(filename):
    return "digest"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(directory))
    return directory


def saved_cache(path, *numbers) -> BenchmarkCache:
    cache = BenchmarkCache(path, autosave=False, current_digests=any_digest)
    for n in numbers:
        cache.put("ns", {"n": n}, RESULTS)
    cache.save()
    return cache


class FullDisk:
    """A file opened for writing on a disk that fills up halfway through the first write."""

    def __init__(self, handle):
        self._handle = handle

    def __enter__(self):
        return self

    def __exit__(self, *exception):
        self._handle.close()

    def write(self, data):
        self._handle.write(data[: len(data) // 2])
        self._handle.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._handle, name)


def fill_the_disk(monkeypatch):
    """From now on, every file opened for writing fills the disk halfway through its first write."""
    real_fdopen = os.fdopen

    def fdopen(descriptor, mode="r", *args, **kwargs):
        handle = real_fdopen(descriptor, mode, *args, **kwargs)
        return FullDisk(handle) if "w" in mode else handle

    monkeypatch.setattr(os, "fdopen", fdopen)


def runtime_warnings(caught) -> list[str]:
    return [str(warning.message) for warning in caught if warning.category is RuntimeWarning]


def test_a_full_disk_keeps_the_results_in_memory_and_the_file_as_it_was(cache_dir, monkeypatch):
    path = cache_dir / CACHE_FILENAME
    saved_cache(path, 1)
    before = path.read_bytes()
    cache = BenchmarkCache(path, autosave=False, current_digests=any_digest)
    cache.put("ns", {"n": 2}, RESULTS)
    fill_the_disk(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.save()
        cache.put("ns", {"n": 3}, RESULTS)
        cache.save()
    (warning,) = runtime_warnings(caught)
    assert str(path) in warning and "No space left on device" in warning and "in memory only" in warning
    assert path.read_bytes() == before  # the half-written temporary never replaced it
    assert sorted(p.name for p in cache_dir.iterdir()) == [CACHE_FILENAME, LOCK_FILENAME]  # and is gone
    assert sorted(dict(entry.key)["n"] for entry in cache.entries("ns")) == [1, 2, 3]
    assert cache.get("ns", {"n": 3}).results[0][0] == "implicit_gemm"


def test_a_full_disk_under_the_kernel_cache_keeps_the_compiled_file_it_had(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_compile, "KERNEL_DIR", tmp_path)
    monkeypatch.setattr(kernel_compile, "_REGISTRY", [])
    monkeypatch.setattr(kernel_compile, "_cache_write_warned", False)
    (tmp_path / "probe.cu").write_text("template <int N> __global__ void probe(int* out) { out[0] = N; }\n")
    source = kernel_compile.KernelSource("probe.cu", ("probe<1>",))
    lowered = {"probe<1>": "_Z5probeILi1EEvPi"}
    path = tmp_path / "kernel_cache" / "cupysparse_probe_key.msgpack"
    kernel_compile._write_cached(path, kernel_compile.CompiledSource(b"\x7fELF first image", lowered))
    fill_the_disk(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for image in (b"\x7fELF second image", b"\x7fELF third image"):
            kernel_compile._write_cached(path, kernel_compile.CompiledSource(image, lowered))
    (warning,) = runtime_warnings(caught)
    assert "cannot write the kernel cache" in warning and "No space left on device" in warning
    assert kernel_compile._read_cached(path, source).image == b"\x7fELF first image"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # nothing half-written left behind


def traversable_by_others(path: pathlib.Path) -> bool:
    return all(parent.stat().st_mode & stat.S_IXOTH for parent in path.parents)


@pytest.fixture
def shared_dir():
    """A directory another user can reach (the system's temporary directory, not the test's own)."""
    directory = pathlib.Path(tempfile.mkdtemp(prefix="cupysparse-shared-cache-"))
    if not traversable_by_others(directory):
        shutil.rmtree(directory)
        pytest.skip("the temporary directory is not reachable by other users")
    yield directory
    directory.chmod(0o700)
    shutil.rmtree(directory)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user takes root")


def as_other_user(function):
    """`function()` run in a forked child as user and group `OTHER_USER`; its JSON result."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(OTHER_USER)
            os.setuid(OTHER_USER)
            outcome = {"value": function()}
        except BaseException as error:  # reported to the parent, which fails the test
            outcome = {"error": f"{type(error).__name__}: {error}"}
        with os.fdopen(write_end, "w") as pipe:
            json.dump(outcome, pipe)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        outcome = json.load(pipe)
    os.waitpid(pid, 0)
    assert "error" not in outcome, outcome.get("error")
    return outcome["value"]


def use_the_cache(path):
    """What the other user does: read an entry, tune two problems, save twice."""
    cache = BenchmarkCache(path, autosave=False, current_digests=any_digest)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = cache.get("ns", {"n": 1})
        for n in (2, 3):
            cache.put("ns", {"n": n}, RESULTS)
            cache.save()
        held = sorted(dict(entry.key)["n"] for entry in cache.entries("ns"))
    return {"found": found is not None, "held": held, "warnings": runtime_warnings(caught)}


@needs_root
@pytest.mark.parametrize("mode, refusal", [(0o755, "Permission denied"), (0o1777, "Operation not permitted")],
                         ids=["owner-only directory", "sticky world-writable directory"])
def test_another_users_cache_is_used_read_only_with_one_warning(shared_dir, mode, refusal):
    path = shared_dir / CACHE_FILENAME
    saved_cache(path, 1)
    shared_dir.chmod(mode)
    before, listing = path.read_bytes(), sorted(p.name for p in shared_dir.iterdir())

    used = as_other_user(lambda: use_the_cache(path))
    assert used["found"] and used["held"] == [1, 2, 3]  # read the owner's entry, kept its own in memory
    (warning,) = used["warnings"]
    assert f"cannot write the benchmark cache {path}" in warning and refusal in warning
    assert "in memory only" in warning
    assert path.read_bytes() == before and sorted(p.name for p in shared_dir.iterdir()) == listing


@needs_root
def test_users_of_a_group_writable_directory_share_the_cache_through_the_owners_lock_file(shared_dir):
    path = shared_dir / CACHE_FILENAME
    saved_cache(path, 1)  # the lock file is the owner's, writable by the owner only
    shared_dir.chmod(0o777)
    assert stat.S_IMODE((shared_dir / LOCK_FILENAME).stat().st_mode) == 0o644

    used = as_other_user(lambda: use_the_cache(path))
    assert used == {"found": True, "held": [1, 2, 3], "warnings": []}
    assert path.stat().st_uid == OTHER_USER and stat.S_IMODE(path.stat().st_mode) == 0o644  # readable by all
    owner_view = BenchmarkCache(path, autosave=False, current_digests=any_digest)
    assert sorted(dict(entry.key)["n"] for entry in owner_view.entries("ns")) == [1, 2, 3]


@needs_root
def test_a_cache_file_another_user_cannot_read_leaves_them_an_empty_cache_with_one_warning(shared_dir):
    path = shared_dir / CACHE_FILENAME
    saved_cache(path, 1)
    path.chmod(0o600)
    shared_dir.chmod(0o755)
    before = path.read_bytes()
    used = as_other_user(lambda: use_the_cache(path))
    assert used["found"] is False and used["held"] == [2, 3]
    (warning,) = used["warnings"]
    assert f"cannot read the benchmark cache {path}" in warning and "Permission denied" in warning
    assert path.read_bytes() == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only files and directories")
def test_a_read_only_directory_with_a_read_only_lock_file_is_used_read_only_with_one_warning(shared_dir):
    path = shared_dir / CACHE_FILENAME
    saved_cache(path, 1)
    path.chmod(0o444)
    (shared_dir / LOCK_FILENAME).chmod(0o444)
    shared_dir.chmod(0o555)
    before = path.read_bytes()
    used = use_the_cache(path)
    assert used["found"] and used["held"] == [1, 2, 3]
    (warning,) = used["warnings"]
    assert "cannot write the benchmark cache" in warning and "Permission denied" in warning
    assert path.read_bytes() == before


@pytest.fixture
def kernel_dir(tmp_path, monkeypatch):
    """Kernel sources in a temporary folder, with the digests and sources of this process forgotten."""
    directory = tmp_path / "kernels"
    directory.mkdir()
    monkeypatch.setattr(kernel_compile, "KERNEL_DIR", directory)
    monkeypatch.setattr(kernel_compile, "_REGISTRY", [])
    forget_sources()
    yield directory
    forget_sources()


def forget_sources():
    """What a new process starts without: the memoised source texts and digests."""
    kernel_compile.load_source.cache_clear()
    kernel_compile.source_digest.cache_clear()


def write_kernels(directory, tile: int):
    (directory / "tile.cuh").write_text(f"#define TILE {tile}\n")
    (directory / "uses_tile.cu").write_text('#include "tile.cuh"\n__global__ void tiled(int* out) { out[0] = TILE; }\n')
    (directory / "plain.cu").write_text("__global__ void plain(int* out) { out[0] = 1; }\n")


def test_editing_a_header_invalidates_the_benchmark_entries_of_its_includers_only(kernel_dir, cache_dir):
    write_kernels(kernel_dir, tile=16)
    cache = BenchmarkCache(autosave=False)  # the real digests of the files (compile.source_digest)
    for filename in ("uses_tile.cu", "plain.cu"):
        cache.put("ns", {"kernel": filename}, RESULTS, [(filename, kernel_compile.source_digest(filename))])
    cache.save()

    write_kernels(kernel_dir, tile=32)  # the header changes; both .cu files stay as they were
    forget_sources()
    reloaded = BenchmarkCache(autosave=False)
    assert reloaded.get("ns", {"kernel": "uses_tile.cu"}) is None
    assert reloaded.get("ns", {"kernel": "plain.cu"}).results[0][0] == "implicit_gemm"
    assert len(reloaded.entries("ns")) == 2  # listed, stale, until measured again

    write_kernels(kernel_dir, tile=16)  # reverted: the old measurement is valid again
    forget_sources()
    assert BenchmarkCache(autosave=False).get("ns", {"kernel": "uses_tile.cu"}) is not None


def _nvrtc_available() -> bool:
    try:
        kernel_compile._nvrtc().getVersion()
    except Exception:
        return False
    return True


@pytest.mark.nvrtc
def test_editing_a_header_gives_its_includers_new_compiled_module_files_and_no_other(kernel_dir, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "kernel_cache"))
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    write_kernels(kernel_dir, tile=16)
    sources = {"uses_tile.cu": kernel_compile.KernelSource("uses_tile.cu", ("tiled",)),
               "plain.cu": kernel_compile.KernelSource("plain.cu", ("plain",))}
    before = {name: kernel_compile.kernel_cache_file(source, "-arch=sm_90") for name, source in sources.items()}
    write_kernels(kernel_dir, tile=32)
    forget_sources()
    after = {name: kernel_compile.kernel_cache_file(source, "-arch=sm_90") for name, source in sources.items()}
    assert after["uses_tile.cu"] != before["uses_tile.cu"] and after["plain.cu"] == before["plain.cu"]
