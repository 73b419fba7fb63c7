"""The persistent benchmark cache: round trips, staleness, background and exit saves, several
processes writing one file, and bad files or directories that must never crash the program."""

import fcntl
import os
import pickle
import subprocess
import sys
import textwrap
import time
import warnings

import msgpack
import pytest

from cupysparse.tuning import cache_file as benchmark_cache
from cupysparse.tuning.cache_file import (
    CACHE_FILENAME,
    FORMAT_VERSION,
    BenchmarkCache,
    NotACacheFile,
    cache_file_path,
    default_cache,
    open_for_reading,
)

KEY = (("log_num_in_coords", 17), ("in_channels", 32), ("in_dtype", "float16"), ("stride", (2, 2, 2)))
RESULTS = [
    ("wmma_implicit_gemm", {"tile": (64, 128), "split_k": 1}, 2.5),
    ("implicit_gemm", {"fwd_block_size": 16}, 1.25),
    ("explicit_gemm", {}, 7.0),
]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Every test, and every process it starts, uses its own cache directory, never the user's."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(directory))
    return directory


def read_raw(path):
    return msgpack.unpackb(path.read_bytes(), raw=False)


def run_python(source: str) -> str:
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(source)], check=False, capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def test_path_follows_the_environment_variable(cache_dir, monkeypatch):
    assert cache_file_path() == cache_dir / CACHE_FILENAME
    assert BenchmarkCache().path == cache_dir / CACHE_FILENAME
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(cache_dir / "elsewhere"))
    assert cache_file_path() == cache_dir / "elsewhere" / CACHE_FILENAME


def test_round_trip_keeps_tuples_key_order_and_sources(cache_dir):
    writer = BenchmarkCache(autosave=False)
    written = writer.put("sparse_conv_forward", KEY, RESULTS, {"implicit_gemm.cu": "abc", "wmma.cu": "def"})
    writer.save()

    entry = BenchmarkCache(autosave=False, current_digests={"implicit_gemm.cu": "abc", "wmma.cu": "def"}.get).get(
        "sparse_conv_forward", dict(KEY)
    )
    assert entry == written
    assert entry.key == KEY  # the order of the put, for display
    assert [name for name, _, _ in entry.results] == ["implicit_gemm", "wmma_implicit_gemm", "explicit_gemm"]
    tile = entry.results[1][1]["tile"]
    assert tile == (64, 128) and isinstance(tile, tuple)  # so algorithm.forward(**params) gets a tuple
    assert entry.kernel_sources == (("implicit_gemm.cu", "abc"), ("wmma.cu", "def"))
    assert abs(entry.updated - time.time()) < 60

    document = read_raw(cache_dir / CACHE_FILENAME)
    assert document["format"] == "cupysparse-benchmark-cache" and document["version"] == FORMAT_VERSION
    (raw_entry,) = document["namespaces"]["sparse_conv_forward"]
    assert raw_entry["key"][3] == ["stride", [2, 2, 2]]
    assert raw_entry["results"][0] == ["implicit_gemm", {"fwd_block_size": 16}, 1.25]
    assert raw_entry["kernel_sources"] == [["implicit_gemm.cu", "abc"], ["wmma.cu", "def"]]
    assert raw_entry["updated"] == written.updated


def test_keys_match_in_any_parameter_order_and_only_on_equal_values():
    cache = BenchmarkCache(autosave=False)
    cache.put("ns", KEY, RESULTS)
    assert cache.get("ns", list(reversed(KEY))).key == KEY
    assert cache.get("ns", {**dict(KEY), "stride": [2, 2, 2]}) is not None  # a list equals its tuple
    assert cache.get("ns", {**dict(KEY), "stride": (1, 1, 1)}) is None
    assert cache.get("ns", dict(KEY[:3])) is None


def test_results_are_stored_best_first():
    cache = BenchmarkCache(autosave=False)
    entry = cache.put("ns", {"n": 1}, [("c", {}, 3.0), ("a", {}, 1.0), ("tie_first", {}, 2.0), ("tie_second", {}, 2)])
    assert [(name, time_ms) for name, _, time_ms in entry.results] == [
        ("a", 1.0),
        ("tie_first", 2.0),
        ("tie_second", 2.0),
        ("c", 3.0),
    ]


def test_missing_keys_and_namespaces_give_none_without_touching_the_disk(cache_dir):
    cache = BenchmarkCache()
    assert cache.get("sparse_conv_forward", KEY) is None
    cache.put("sparse_conv_forward", KEY, RESULTS)
    assert cache.get("sparse_conv_forward", {"in_channels": 64}) is None
    assert cache.get("sparse_conv_backward", KEY) is None
    assert BenchmarkCache(cache_dir / "never_written" / CACHE_FILENAME).get("ns", KEY) is None
    assert not (cache_dir / "never_written").exists()  # reading creates no directory


def test_unstorable_values_fail_at_put():
    cache = BenchmarkCache(autosave=False)
    with pytest.raises(TypeError):
        cache.put("ns", {"shape": {"x": 1}}, RESULTS)
    with pytest.raises(TypeError):
        cache.put("ns", KEY, [("a", {"tile": {1, 2}}, 1.0)])
    with pytest.raises(ValueError, match="distinct"):
        cache.put("ns", [("n", 1), ("n", 2)], RESULTS)
    assert cache.entries() == []


def test_changing_one_kernel_source_hides_only_the_entries_that_measured_it():
    digests = {"a.cu": "1", "b.cu": "1"}
    cache = BenchmarkCache(autosave=False, current_digests=digests.__getitem__)
    cache.put("ns", {"k": "a"}, RESULTS, [("a.cu", "1")])
    cache.put("ns", {"k": "b"}, RESULTS, [("b.cu", "1")])
    cache.put("ns", {"k": "ab"}, RESULTS, [("a.cu", "1"), ("b.cu", "1")])
    cache.put("ns", {"k": "cpu"}, RESULTS)

    digests["a.cu"] = "2"
    visible = {key for key in ("a", "b", "ab", "cpu") if cache.get("ns", {"k": key}) is not None}
    assert visible == {"b", "cpu"}
    assert len(cache.entries("ns")) == 4  # stale entries stay listed for inspection
    changed = {dict(entry.key)["k"]: cache.changed_sources(entry) for entry in cache.entries("ns")}
    assert changed == {"a": ["a.cu"], "b": [], "ab": ["a.cu"], "cpu": []}

    del digests["b.cu"]  # a kernel file that no longer exists
    assert cache.get("ns", {"k": "b"}) is None
    (both,) = [entry for entry in cache.entries("ns") if dict(entry.key)["k"] == "ab"]
    assert cache.changed_sources(both) == ["a.cu", "b.cu"]
    cache.put("ns", {"k": "a"}, RESULTS, [("a.cu", "2")])  # re-measured: visible again
    assert cache.get("ns", {"k": "a"}).kernel_sources == (("a.cu", "2"),)


def test_a_missing_source_file_makes_entries_stale():
    def digest_of_deleted_file(filename):
        raise FileNotFoundError(filename)

    cache = BenchmarkCache(autosave=False, current_digests=digest_of_deleted_file)
    cache.put("ns", KEY, RESULTS, [("gone.cu", "1")])
    assert cache.get("ns", KEY) is None


def test_entries_and_namespace_counts():
    cache = BenchmarkCache(autosave=False)
    for n in range(3):
        cache.put("sparse_conv_forward", {"n": n}, RESULTS)
    cache.put("implicit_gemm_AD_gather_scatter", {"n": 0}, RESULTS)
    cache.put("sparse_conv_forward", {"n": 0}, RESULTS[:1])  # replaces, does not add
    assert cache.namespace_counts() == {"implicit_gemm_AD_gather_scatter": 1, "sparse_conv_forward": 3}
    assert [dict(entry.key)["n"] for entry in cache.entries("sparse_conv_forward")] == [0, 1, 2]
    assert [entry.namespace for entry in cache.entries()] == ["implicit_gemm_AD_gather_scatter"] + [
        "sparse_conv_forward"
    ] * 3
    assert cache.entries("nothing") == []


def test_many_puts_become_one_background_save(cache_dir, monkeypatch):
    monkeypatch.setattr(benchmark_cache, "SAVE_DELAY_S", 0.3)
    writes = []
    write = benchmark_cache._write_atomically
    monkeypatch.setattr(benchmark_cache, "_write_atomically", lambda *args: (writes.append(1), write(*args)))
    cache = BenchmarkCache()
    for n in range(50):
        cache.put("ns", {"n": n}, RESULTS)
    path = cache_dir / CACHE_FILENAME
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:  # no flush: the background thread must save
        time.sleep(0.02)
    cache.flush()
    assert len(writes) == 1
    assert len(read_raw(path)["namespaces"]["ns"]) == 50

    cache.put("ns", {"n": 50}, RESULTS)
    cache.flush()  # saves the pending put now, without waiting for the delay
    assert len(writes) == 2
    assert len(read_raw(path)["namespaces"]["ns"]) == 51


def test_a_process_that_exits_without_flushing_still_saves(cache_dir):
    run_python(
        """
        from cupysparse.tuning import cache_file as benchmark_cache
        benchmark_cache.SAVE_DELAY_S = 3600  # only the exit hook can save it
        benchmark_cache.default_cache().put("ns", {"n": 1}, [("a", {"tile": (64, 128)}, 1.5)])
        """
    )
    reader = """
        from cupysparse.tuning.cache_file import default_cache
        print(default_cache().get("ns", {"n": 1}).results)
    """
    assert run_python(reader).strip() == "(('a', {'tile': (64, 128)}, 1.5),)"


def test_default_cache_is_shared_and_follows_the_environment_variable(cache_dir, monkeypatch):
    first = default_cache()
    assert default_cache() is first and first.path == cache_dir / CACHE_FILENAME
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(cache_dir / "other"))
    second = default_cache()
    assert second is not first and second.path == cache_dir / "other" / CACHE_FILENAME


def test_removing_the_cache_directory_resets_everything(cache_dir):
    cache = BenchmarkCache(cache_dir / "deep" / "nested" / CACHE_FILENAME, autosave=False)
    cache.put("ns", KEY, RESULTS)
    cache.save()  # creates the directories
    assert BenchmarkCache(cache.path).get("ns", KEY) is not None
    for file in cache.path.parent.iterdir():
        file.unlink()
    assert BenchmarkCache(cache.path).namespace_counts() == {}


TUNING_WORKER = """
    import sys
    import time
    from cupysparse.tuning import cache_file as benchmark_cache

    path, worker, start_at = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    benchmark_cache.SAVE_DELAY_S = 0.01  # background saves race with the explicit ones
    cache = benchmark_cache.BenchmarkCache(path)
    cache.get("ns", {"warm": "up"})  # load before the start, so all processes write at once
    time.sleep(max(0.0, start_at - time.time()))
    for n in range(20):
        cache.put("sparse_conv_forward", {"worker": worker, "n": n}, [("algo", {"tile": (worker, n)}, 1.0)])
        shared = cache.put("shared", {"n": 0}, [(f"worker{worker}", {}, float(n))])
        if n % 3 == 2:
            cache.save()
    print(repr(shared.updated))
"""


def test_eight_processes_tuning_at_once_lose_no_entry_and_keep_the_newest(cache_dir):
    path = cache_dir / CACHE_FILENAME
    start_at = time.time() + 1.0
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(TUNING_WORKER), str(path), str(worker), str(start_at)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for worker in range(8)
    ]
    last_puts = {}
    for worker, process in enumerate(workers):
        stdout, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr
        assert "Warning" not in stderr, stderr
        last_puts[float(stdout)] = f"worker{worker}"

    on_disk = read_raw(path)["namespaces"]
    assert sorted(
        (dict(entry["key"])["worker"], dict(entry["key"])["n"]) for entry in on_disk["sparse_conv_forward"]
    ) == [(worker, n) for worker in range(8) for n in range(20)]
    cache = BenchmarkCache(path, autosave=False)
    assert cache.get("sparse_conv_forward", {"worker": 7, "n": 19}).results[0][1] == {"tile": (7, 19)}
    (shared,) = cache.entries("shared")
    newest = max(last_puts)
    assert shared.updated == newest and shared.results[0][0] == last_puts[newest]
    assert sorted(file.name for file in cache_dir.iterdir()) == [CACHE_FILENAME, CACHE_FILENAME + ".lock"]


def test_saving_keeps_the_newer_measurement_of_a_key_and_entries_only_on_disk(cache_dir):
    older, newer = BenchmarkCache(autosave=False), BenchmarkCache(autosave=False)
    older.put("ns", KEY, [("old", {}, 1.0)])
    older.put("ns", {"only": "older"}, RESULTS)
    time.sleep(0.01)
    newer.put("ns", KEY, [("new", {}, 1.0)])
    newer.put("ns", {"only": "newer"}, RESULTS)
    newer.save()
    older.save()  # saved last, measured first: loses the shared key

    assert older.get("ns", KEY).results[0][0] == "new"  # the merge also updates memory
    reloaded = BenchmarkCache(autosave=False)
    assert reloaded.get("ns", KEY).results[0][0] == "new"
    assert reloaded.get("ns", {"only": "older"}) is not None
    assert reloaded.get("ns", {"only": "newer"}) is not None


def valid_cache_bytes(tmp_path) -> bytes:
    cache = BenchmarkCache(tmp_path / "valid" / CACHE_FILENAME, autosave=False)
    for n in range(20):
        cache.put("ns", {"n": n}, RESULTS)
    cache.save()
    return cache.path.read_bytes()


def one_entry_file(**fields) -> bytes:
    entry = {"key": [["n", 1]], "results": [], "kernel_sources": [], "updated": 1.0, **fields}
    document = {"format": "cupysparse-benchmark-cache", "version": FORMAT_VERSION, "namespaces": {"ns": [entry]}}
    return msgpack.packb(document)


BAD_FILES = {
    "corrupt bytes": lambda tmp_path: b"\xc1\xc1 definitely not msgpack",
    "truncated": lambda tmp_path: valid_cache_bytes(tmp_path)[:-100],
    "pickle": lambda tmp_path: pickle.dumps({"format": "cupysparse-benchmark-cache", "version": FORMAT_VERSION}),
    "foreign msgpack": lambda tmp_path: msgpack.packb({"format": "someone-elses-cache", "data": [1, 2]}),
    "msgpack list": lambda tmp_path: msgpack.packb([1, 2, 3]),
    "older version": lambda tmp_path: msgpack.packb(
        {"format": "cupysparse-benchmark-cache", "version": FORMAT_VERSION - 1, "namespaces": {}}
    ),
    "newer version": lambda tmp_path: msgpack.packb(
        {"format": "cupysparse-benchmark-cache", "version": FORMAT_VERSION + 1, "namespaces": {}}
    ),
    "malformed entry": lambda tmp_path: msgpack.packb(
        {"format": "cupysparse-benchmark-cache", "version": FORMAT_VERSION, "namespaces": {"ns": [{"key": []}]}}
    ),
    "text time": lambda tmp_path: one_entry_file(results=[["a", {}, "1 ms"]]),
    "params not a map": lambda tmp_path: one_entry_file(results=[["a", [1, 2], 1.0]]),
    "empty": lambda tmp_path: b"",
}
# Bad files a writable cache does not move aside: it skips their malformed entries, or leaves a newer
# format's file as it is (test_cache_salvage.py tests both in detail).
SALVAGED = {"newer version", "malformed entry", "text time", "params not a map"}


@pytest.mark.parametrize("kind", sorted(set(BAD_FILES) - SALVAGED))
def test_a_bad_file_is_moved_aside_with_a_warning_and_the_cache_works(cache_dir, tmp_path, kind):
    cache_dir.mkdir()
    path = cache_dir / CACHE_FILENAME
    bad = BAD_FILES[kind](tmp_path)
    path.write_bytes(bad)

    cache = BenchmarkCache(autosave=False)
    with pytest.warns(RuntimeWarning, match=CACHE_FILENAME):
        assert cache.get("ns", KEY) is None
    (aside,) = cache_dir.glob(CACHE_FILENAME + ".corrupt-*")
    assert aside.read_bytes() == bad
    assert not path.exists()

    cache.put("ns", KEY, RESULTS)
    cache.save()
    assert BenchmarkCache(autosave=False).get("ns", KEY) is not None


@pytest.mark.parametrize("kind", sorted(SALVAGED))
def test_a_file_with_bad_entries_or_of_a_newer_format_stays_in_place_and_the_cache_works(cache_dir, tmp_path, kind):
    cache_dir.mkdir()
    path = cache_dir / CACHE_FILENAME
    bad = BAD_FILES[kind](tmp_path)
    path.write_bytes(bad)

    cache = BenchmarkCache(autosave=False)
    with pytest.warns(RuntimeWarning, match=CACHE_FILENAME):
        assert cache.get("ns", KEY) is None
    assert path.read_bytes() == bad and not list(cache_dir.glob(CACHE_FILENAME + ".corrupt-*"))
    cache.put("ns", KEY, RESULTS)
    cache.save()
    assert cache.get("ns", KEY) is not None


@pytest.mark.parametrize("kind", ["truncated", "pickle", "older version", "newer version"])
def test_a_read_only_cache_reports_a_bad_file_and_leaves_it_alone(cache_dir, tmp_path, kind):
    cache_dir.mkdir()
    path = cache_dir / CACHE_FILENAME
    bad = BAD_FILES[kind](tmp_path)
    path.write_bytes(bad)
    with pytest.raises(NotACacheFile, match=CACHE_FILENAME):
        BenchmarkCache(read_only=True).entries()
    assert path.read_bytes() == bad and sorted(p.name for p in cache_dir.iterdir()) == [CACHE_FILENAME]


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_a_file_read_by_key_reports_every_bad_file_by_the_time_it_is_decoded(cache_dir, tmp_path, kind):
    cache_dir.mkdir()
    path = cache_dir / CACHE_FILENAME
    path.write_bytes(BAD_FILES[kind](tmp_path))
    with pytest.raises(NotACacheFile, match=CACHE_FILENAME):
        open_for_reading(path, decode=False).entries()


def test_a_file_read_by_key_gives_what_decoding_it_whole_gives(cache_dir):
    writer = BenchmarkCache(autosave=False)
    for channels in (16, 32, 64):
        writer.put("forward", {**dict(KEY), "in_channels": channels}, RESULTS)
        writer.put("backward", dict(reversed(KEY)) | {"in_channels": channels}, RESULTS[1:])
    writer.save()
    document = read_raw(writer.path)
    newer = {**document["namespaces"]["forward"][0], "results": [["explicit_gemm", {}, 0.5]]}
    newer["updated"] += 10
    document["namespaces"]["forward"].append(newer)  # one key twice: the newer wins, as in a merge
    writer.path.write_bytes(msgpack.packb(document))
    whole, by_key = open_for_reading(writer.path), open_for_reading(writer.path, decode=False)
    asked = [(namespace, entry.key) for namespace in ("forward", "backward") for entry in whole.entries(namespace)]
    assert len(asked) == 6
    for namespace, key in asked:
        assert by_key.get(namespace, key) == whole.get(namespace, key)
        assert by_key.get(namespace, tuple(reversed(key))) == whole.get(namespace, key)  # any parameter order
    assert by_key.get("forward", {**dict(KEY), "in_channels": 16}).results == (("explicit_gemm", {}, 0.5),)
    assert by_key.get("forward", {**dict(KEY), "in_channels": 8}) is None
    assert by_key.get("sideways", KEY) is None
    assert by_key.entries() == whole.entries() and by_key.namespace_counts() == {"backward": 3, "forward": 3}


def test_a_file_read_by_key_decodes_only_the_entries_asked_for(cache_dir):
    good = {"key": [list(pair) for pair in KEY], "results": [["explicit_gemm", {}, 1.0]], "kernel_sources": [],
            "updated": 1.0}
    bad = {**good, "key": [["n", 1]], "results": "not a list of results"}
    cache_dir.mkdir()
    path = cache_dir / CACHE_FILENAME
    path.write_bytes(msgpack.packb({"format": "cupysparse-benchmark-cache", "version": FORMAT_VERSION,
                                    "namespaces": {"ns": [good, bad]}}))
    cache = open_for_reading(path, decode=False)
    assert cache.get("ns", KEY).results == (("explicit_gemm", {}, 1.0),)
    with pytest.raises(NotACacheFile, match=f"{CACHE_FILENAME} is a malformed cache"):
        cache.get("ns", {"n": 1})
    with pytest.raises(NotACacheFile, match=CACHE_FILENAME):
        open_for_reading(path)


def test_a_read_only_cache_reads_but_refuses_to_write(cache_dir):
    writer = BenchmarkCache(autosave=False)
    writer.put("ns", KEY, RESULTS)
    writer.save()
    before = writer.path.read_bytes()
    reader = BenchmarkCache(read_only=True, current_digests=lambda filename: "x")
    assert [r[0] for r in reader.get("ns", KEY).results] == [r[0] for r in sorted(RESULTS, key=lambda r: r[2])]
    with pytest.raises(PermissionError, match="read-only"):
        reader.put("ns", {"other": 1}, RESULTS)
    with pytest.raises(PermissionError, match="read-only"):
        reader.save()
    assert writer.path.read_bytes() == before


def test_a_file_that_goes_bad_after_loading_is_moved_aside_when_saving(cache_dir):
    cache = BenchmarkCache(autosave=False)
    cache.put("ns", KEY, RESULTS)
    cache_dir.mkdir()
    (cache_dir / CACHE_FILENAME).write_bytes(b"\xc1 garbage")
    with pytest.warns(RuntimeWarning, match="moved it to"):
        cache.save()
    assert len(list(cache_dir.glob(CACHE_FILENAME + ".corrupt-*"))) == 1
    assert BenchmarkCache(autosave=False).get("ns", KEY) is not None


def make_file_in_the_way(cache_dir):
    cache_dir.write_text("a file where the cache directory should be")


def make_read_only_directory(cache_dir):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    cache_dir.mkdir(mode=0o500)


@pytest.mark.parametrize("make_unwritable", [make_file_in_the_way, make_read_only_directory])
def test_an_unwritable_directory_warns_once_and_works_in_memory(cache_dir, make_unwritable):
    make_unwritable(cache_dir)
    cache = BenchmarkCache(autosave=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.put("ns", KEY, RESULTS)
        cache.save()
        cache.put("ns", {"n": 2}, RESULTS)
        cache.save()
    (warning,) = [str(warning.message) for warning in caught if warning.category is RuntimeWarning]
    assert "in memory only" in warning and str(cache_dir) in warning
    assert cache.get("ns", KEY).results[0][0] == "implicit_gemm"
    assert cache.namespace_counts() == {"ns": 2}


def test_a_held_lock_times_out_with_a_clear_error(cache_dir, monkeypatch):
    monkeypatch.setattr(benchmark_cache, "LOCK_TIMEOUT_S", 0.2)
    cache_dir.mkdir()
    cache = BenchmarkCache(autosave=False)
    cache.put("ns", KEY, RESULTS)
    with open(cache_dir / (CACHE_FILENAME + ".lock"), "w") as other_process_lock:
        fcntl.flock(other_process_lock, fcntl.LOCK_EX)
        with pytest.raises(TimeoutError, match=r"could not lock .*\.lock within 0\.2 s"):
            cache.save()
    cache.save()  # the lock is free again: the unsaved put was kept
    assert BenchmarkCache(autosave=False).get("ns", KEY) is not None
