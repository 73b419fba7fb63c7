"""What the benchmark cache salvages from a file it cannot wholly use: malformed entries skipped one by
one, results of algorithms or parameters this version does not know skipped by the tuner, a newer
format version's file left alone, temporaries of writers killed mid-save removed; and what the
inspector says is at the cache's path when it is no file."""

import os
import signal
import subprocess
import sys
import textwrap
import warnings

import msgpack
import numpy as np
import pytest

from cupysparse.algorithms import CONV, Algorithm, ConvProblem
from cupysparse.algorithms import base as algorithms_base
from cupysparse.scripts import inspect_benchmark_cache as inspect_cache
from cupysparse.tuning import cache_file as benchmark_cache
from cupysparse.tuning import measurement as measuring
from cupysparse.tuning import tuner as tuner_module
from cupysparse.tuning.cache_file import CACHE_FILENAME, FORMAT_NAME, FORMAT_VERSION, BenchmarkCache, cache_file_path
from cupysparse.tuning.search_space import AlgorithmFilter
from cupysparse.tuning.tuner import Tuner, tuning_key

RESULTS = [["implicit_gemm", {"fwd_block_size": 16}, 1.25], ["explicit_gemm", {}, 7.0]]
LOCK_FILENAME = CACHE_FILENAME + ".lock"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    directory.mkdir()
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(directory))
    return directory


def raw_entry(n, **fields):
    return {"key": [["n", n]], "results": RESULTS, "kernel_sources": [], "updated": 1.0, **fields}


def cache_bytes(namespaces, version=FORMAT_VERSION) -> bytes:
    return msgpack.packb({"format": FORMAT_NAME, "version": version, "namespaces": namespaces})


def runtime_warnings(caught) -> list[str]:
    return [str(warning.message) for warning in caught if warning.category is RuntimeWarning]


def listing(directory) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def held_numbers(cache) -> list:
    return sorted(dict(entry.key)["n"] for entry in cache.entries("ns"))


# ---- malformed entries ----

MALFORMED_ENTRIES = [
    "not a map",
    raw_entry(101, results=[["a", {}, "1 ms"]]),  # a time in text
    raw_entry(102, results=[["a", [1, 2], 1.0]]),  # parameters not a map
    {"key": [["n", 103]], "kernel_sources": [], "updated": 1.0},  # no results
    raw_entry(104, key=5),
]


def file_with_malformed_entries() -> bytes:
    good = [raw_entry(n) for n in (1, 2, 3)]
    return cache_bytes({"ns": [good[0], *MALFORMED_ENTRIES, good[1], good[2]], "other": "not an array of entries"})


def test_malformed_entries_are_skipped_with_one_warning_and_the_good_ones_kept(cache_dir):
    path = cache_dir / CACHE_FILENAME
    damaged = file_with_malformed_entries()
    path.write_bytes(damaged)

    cache = BenchmarkCache(autosave=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.get("ns", {"n": 2}).results[0][0] == "implicit_gemm"
        assert held_numbers(cache) == [1, 2, 3]
        assert path.read_bytes() == damaged and listing(cache_dir) == [CACHE_FILENAME]  # loading changes nothing
        cache.put("ns", {"n": 4}, RESULTS)
        cache.save()  # re-reads the damaged file under the lock: no second warning
    (warning,) = runtime_warnings(caught)
    assert str(path) in warning and "6 malformed entries" in warning
    assert "an entry must be a map" in warning and "results must be" in warning  # names the reasons
    assert "the other 3 are used" in warning

    assert held_numbers(BenchmarkCache(autosave=False)) == [1, 2, 3, 4]  # the saved file: good entries and the new
    (aside,) = cache_dir.glob(CACHE_FILENAME + ".corrupt-*")
    assert aside.read_bytes() == damaged  # the bad entries' bytes are kept, as a bad file's are
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the saved file is clean: the next process is not warned again
        assert held_numbers(BenchmarkCache(autosave=False)) == [1, 2, 3, 4]


def test_a_malformed_entry_written_after_loading_is_skipped_when_saving(cache_dir):
    path = cache_dir / CACHE_FILENAME
    cache = BenchmarkCache(autosave=False)
    cache.put("ns", {"n": 1}, RESULTS)
    path.write_bytes(cache_bytes({"ns": [raw_entry(2), raw_entry(3, updated="yesterday")]}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.save()
    (warning,) = runtime_warnings(caught)
    assert "1 malformed entry" in warning and "'updated' must be a unix time, got 'yesterday'" in warning
    assert held_numbers(BenchmarkCache(autosave=False)) == [1, 2]


# ---- a file of a newer format version ----

def newer_format_file() -> bytes:
    return cache_bytes({"ns": [raw_entry(1)], "future": [{"shape": "of a later layout"}]}, version=FORMAT_VERSION + 1)


def test_a_newer_format_file_is_left_as_it_is_with_one_warning_and_the_cache_works_in_memory(cache_dir):
    path = cache_dir / CACHE_FILENAME
    newer = newer_format_file()
    path.write_bytes(newer)
    cache = BenchmarkCache(autosave=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.get("ns", {"n": 1}) is None  # not read: a later layout may mean something else
        cache.put("ns", {"n": 2}, RESULTS)
        cache.save()
        cache.put("ns", {"n": 3}, RESULTS)
        cache.save()
    (warning,) = runtime_warnings(caught)
    assert str(path) in warning and f"format version {FORMAT_VERSION + 1}" in warning
    assert "newer" in warning and "in memory only" in warning
    assert path.read_bytes() == newer and listing(cache_dir) == [CACHE_FILENAME]  # never renamed nor overwritten
    assert held_numbers(cache) == [2, 3]


def test_a_newer_format_file_written_after_loading_is_not_overwritten(cache_dir):
    path = cache_dir / CACHE_FILENAME
    cache = BenchmarkCache(autosave=False)
    cache.put("ns", {"n": 1}, RESULTS)
    newer = newer_format_file()
    path.write_bytes(newer)  # a newer cupysparse saved meanwhile
    with pytest.warns(RuntimeWarning, match="newer"):
        cache.save()
    assert path.read_bytes() == newer and not list(cache_dir.glob("*.corrupt-*"))
    assert held_numbers(cache) == [1]


def test_a_process_exiting_with_unsaved_results_leaves_a_newer_format_file_alone(cache_dir):
    path = cache_dir / CACHE_FILENAME
    newer = newer_format_file()
    path.write_bytes(newer)
    completed = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        from cupysparse.tuning.cache_file import default_cache
        default_cache().put("ns", {"n": 2}, [("a", {}, 1.0)])  # saved by the exit hook, if at all
    """)], capture_output=True, text=True, timeout=60, check=False)
    assert completed.returncode == 0, completed.stderr
    assert completed.stderr.count("RuntimeWarning") == 1 and "newer" in completed.stderr
    assert path.read_bytes() == newer and listing(cache_dir) == [CACHE_FILENAME]


# ---- temporaries of writers that died mid-save ----

HANGING_WRITER = """
    import os, sys
    from cupysparse.tuning.cache_file import BenchmarkCache

    def hang(descriptor):  # inside the atomic write, with the temporary written and the lock held
        print("writing", flush=True)
        sys.stdin.readline()  # until the test lets it finish, or kills it
    os.fsync = hang
    cache = BenchmarkCache(sys.argv[1], autosave=False)
    cache.put("ns", {"n": int(sys.argv[2])}, [("a", {}, 1.0)])
    cache.save()
"""


def start_hanging_writer(path, n) -> subprocess.Popen:
    writer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HANGING_WRITER), str(path), str(n)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert writer.stdout.readline() == "writing\n", writer.stderr.read()
    return writer


def temporaries(directory) -> list[str]:
    return [name for name in listing(directory) if name.endswith(".tmp")]


def test_a_temporary_left_by_a_writer_killed_mid_save_is_removed_by_the_next_save(cache_dir):
    path = cache_dir / CACHE_FILENAME
    writer = start_hanging_writer(path, 1)
    writer.send_signal(signal.SIGKILL)
    writer.communicate(timeout=60)
    (orphan,) = temporaries(cache_dir)
    assert orphan.startswith(f".{CACHE_FILENAME}.")

    cache = BenchmarkCache(autosave=False)
    cache.put("ns", {"n": 2}, RESULTS)
    cache.save()
    assert listing(cache_dir) == [CACHE_FILENAME, LOCK_FILENAME]
    assert held_numbers(BenchmarkCache(autosave=False)) == [2]


def test_a_save_never_removes_the_temporary_of_a_writer_still_saving(cache_dir, monkeypatch):
    path = cache_dir / CACHE_FILENAME
    monkeypatch.setattr(benchmark_cache, "LOCK_TIMEOUT_S", 0.2)
    writer = start_hanging_writer(path, 1)
    try:
        (in_progress,) = temporaries(cache_dir)
        cache = BenchmarkCache(autosave=False)
        cache.put("ns", {"n": 2}, RESULTS)
        with pytest.raises(TimeoutError):
            cache.save()  # the writer holds the lock: its temporary is live
        assert temporaries(cache_dir) == [in_progress]
    finally:
        _, stderr = writer.communicate("go on\n", timeout=60)
    assert writer.returncode == 0, stderr
    cache.save()
    assert listing(cache_dir) == [CACHE_FILENAME, LOCK_FILENAME]
    assert held_numbers(BenchmarkCache(autosave=False)) == [1, 2]


# ---- results of algorithms or parameters this version does not know ----

PROBLEM = ConvProblem(3000, 1500, 16, 32, 27, np.dtype(np.float16), "cpu", None, (2, 2, 2))
REFERENCE_OUTPUT = np.linspace(-1, 1, 12).reshape(3, 4)
TIMES_MS = {("explicit_gemm", 0): 9.0, ("fast", 1): 3.0, ("fast", 2): 1.5, ("slow", 1): 5.0, ("slow", 2): 1.0}


class TimedAlgorithm(Algorithm):
    """An algorithm with one parameter, `size`, that always gives the reference's answer."""

    def __init__(self, name, sizes, reference=False):
        self.name, self.reference = name, reference
        self.forward_params = self.backward_params = {"size": sizes}
        self.tuning_namespaces = {"forward": f"{name}_forward_sweep", "backward": f"{name}_backward_sweep"}
        self.kernel_sources = (f"{name}.cu",)


@pytest.fixture
def known_algorithms(monkeypatch):
    """This version's algorithms: explicit_gemm (the reference), fast and slow; each candidate is timed
    from TIMES_MS."""
    monkeypatch.setitem(algorithms_base._REGISTRY, CONV, {
        "explicit_gemm": TimedAlgorithm("explicit_gemm", (0,), reference=True),
        "fast": TimedAlgorithm("fast", (1, 2)),
        "slow": TimedAlgorithm("slow", (1, 2)),
    })
    monkeypatch.setattr(tuner_module, "source_digest", lambda filename: "digest-1")
    monkeypatch.setattr(measuring, "candidate_times_ms", lambda run, timer, repeats=3: [TIMES_MS[run()]] * repeats)
    monkeypatch.delenv("CUPYSPARSE_AUTOTUNE", raising=False)


class CandidateRunner:
    """The tuner's `run(algorithm, params)`: the reference's answer at a candidate's first run (the
    check), then (name, size), which the injected timing looks up in TIMES_MS."""

    def __init__(self):
        self.calls = []

    def __call__(self, algorithm, params):
        self.calls.append((algorithm.name, params["size"]))
        return REFERENCE_OUTPUT if self.calls.count(self.calls[-1]) == 1 else self.calls[-1]


UNKNOWN = [
    ("future_algo", {"size": 1}, 0.1),  # an algorithm of a later version
    ("future_algo", {}, 0.2),
    ("fast", {"size": 1, "stages": 3}, 0.3),  # a parameter fast does not take
]
UNUSABLE = [*UNKNOWN, ("fast", {"size": {"rows": 2}}, 0.4)]  # and a value that names no configuration


def test_cached_results_this_version_cannot_use_are_skipped_with_one_warning_and_tuning_goes_on(
        known_algorithms, tmp_path):
    cache = BenchmarkCache(tmp_path / "c.msgpack", autosave=False, current_digests=lambda filename: "digest-1")
    key = tuning_key(PROBLEM)
    # What a newer cupysparse sharing the file recorded: its phase ranking holds its own algorithm and
    # parameters, and fast's sweep, but nothing of slow, which this process must measure.
    cache.put("sparse_conv_forward", key, [*UNKNOWN, ("fast", {"size": 2}, 1.5)], [("fast.cu", "digest-1")])
    cache.put("fast_forward_sweep", key, [("fast", {"size": 2}, 1.5), ("fast", {"size": 1}, 3.0)],
              [("fast.cu", "digest-1")])
    tuner, run = Tuner(cache), CandidateRunner()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # the second call reads the cache again, as the next process would
            chosen = tuner.select(AlgorithmFilter(CONV, "forward", "names", ("fast", "slow")), PROBLEM, run)
            assert (chosen.algorithm.name, chosen.params) == ("slow", {"size": 2})
            tuner.forget_choices()
    (warning,) = runtime_warnings(caught)
    assert "3 of the 4 results" in warning and "sparse_conv_forward" in warning
    assert "2 of algorithms this version does not know (future_algo)" in warning
    assert "1 with parameters their algorithm does not take (fast)" in warning
    assert {name for name, _ in run.calls} == {"slow", "explicit_gemm"}  # fast's sweep was cached
    ranking = [(name, params, ms) for name, params, ms in cache.get("sparse_conv_forward", key).results]
    # Recorded anew without them: this version cannot vouch for their kernel sources, and the newer one
    # still has its own algorithm's sweep in that algorithm's namespace.
    assert ranking == [("slow", {"size": 2}, 1.0), ("fast", {"size": 2}, 1.5), ("fast", {"size": 1}, 3.0),
                       ("slow", {"size": 1}, 5.0)]


def test_a_ranking_holding_results_this_version_cannot_use_still_answers(known_algorithms, tmp_path, monkeypatch):
    cache = BenchmarkCache(tmp_path / "c.msgpack", autosave=False, current_digests=lambda filename: "digest-1")
    cache.put("sparse_conv_forward", tuning_key(PROBLEM),
              [*UNUSABLE, ("fast", {"size": 2}, 1.5), ("slow", {"size": 2}, 2.0)],
              [("fast.cu", "digest-1"), ("slow.cu", "digest-1")])
    both = AlgorithmFilter(CONV, "forward", "names", ("fast", "slow"))
    tuner, run = Tuner(cache), CandidateRunner()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recalled = tuner.recall(both, PROBLEM)
        tuner.forget_choices()
        selected = tuner.select(both, PROBLEM, run)
        algorithms_base._REGISTRY[CONV]["fast"].capturable = False
        monkeypatch.setattr(tuner_module, "_is_capturing", lambda problem: True)
        captured = tuner.select(both, PROBLEM, run)  # the next capturable result of the ranking
    assert (recalled.algorithm.name, recalled.params) == (selected.algorithm.name, selected.params) == (
        "fast", {"size": 2})
    assert (captured.algorithm.name, captured.params) == ("slow", {"size": 2})
    assert run.calls == []  # answered from the ranking, nothing measured
    assert len(runtime_warnings(caught)) == 1


# ---- the inspector ----

def inspect(capsys, *argv):
    status = inspect_cache.main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_the_inspector_names_a_directory_at_the_cache_files_path(cache_dir, capsys):
    cache_file_path().mkdir()
    status, out, err = inspect(capsys)
    assert status == 1 and "No benchmark cache" not in out
    assert f"{cache_file_path()} is a directory, not a benchmark cache file." in err
    assert "keeps tuning results in memory only" in err  # what the library does about it


def test_the_inspector_names_a_link_to_nothing_at_the_cache_files_path(cache_dir, tmp_path, capsys):
    cache_file_path().symlink_to(tmp_path / "gone.msgpack")
    status, out, _ = inspect(capsys)
    assert status == 0 and f"No benchmark cache at {cache_file_path()} yet: it is a symbolic link to " \
        f"{tmp_path / 'gone.msgpack'}, which does not exist." in out


def test_the_inspector_names_a_parent_that_is_a_file(cache_dir, capsys, monkeypatch):
    blocker = cache_dir / "not_a_directory"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(blocker))
    status, out, err = inspect(capsys)
    assert status == 1 and "No benchmark cache" not in out
    assert f"{cache_file_path()} cannot be reached ([Errno 20] Not a directory" in err


def test_the_inspector_says_a_newer_cupysparse_wrote_the_file_and_leaves_it(cache_dir, capsys):
    newer = newer_format_file()
    cache_file_path().write_bytes(newer)
    status, _, err = inspect(capsys)
    assert status == 1 and f"format version {FORMAT_VERSION + 1}, newer than" in err
    assert "a later cupysparse wrote it" in err and "leaves it as it is" in err
    assert "moves such a file aside" not in err
    assert cache_file_path().read_bytes() == newer and listing(cache_dir) == [CACHE_FILENAME]


def test_the_inspector_says_malformed_entries_are_skipped_not_the_file_moved(cache_dir, capsys):
    cache_file_path().write_bytes(file_with_malformed_entries())
    status, _, err = inspect(capsys)
    assert status == 1 and "a malformed cache" in err
    assert "moves such a file aside" not in err and "skips" in err
    assert listing(cache_dir) == [CACHE_FILENAME]


def test_the_inspector_still_says_when_there_is_no_cache_yet(cache_dir, capsys):
    status, out, _ = inspect(capsys)
    assert status == 0 and f"No benchmark cache at {cache_file_path()} yet." in out
    assert not os.path.lexists(cache_file_path())
