"""Shipped tuning results: used where the user's cache has no entry, never over the user's own, never
when stale, never for another architecture, and a damaged file only warns (once). Whether the shipped
files match today's kernel sources is the release check's question (`check_shipped_file`), not CI's."""

import shutil
import warnings

import msgpack
import numpy as np
import pytest

from cupysparse.algorithms import CONV, ConvProblem
from cupysparse.cuda import compile as kernel_compile
from cupysparse.tuning import shipped as shipped_cache
from cupysparse.tuning import tuner as tuner_module
from cupysparse.tuning.cache_file import BenchmarkCache, default_cache, open_for_reading
from cupysparse.tuning.search_space import AlgorithmFilter, candidates
from cupysparse.tuning.tuner import NAMESPACES, Tuner, tuning_key
from tuning_caches import NotMeasured, caches, must_not_run  # noqa: F401 (caches: an autouse fixture)

# The folder the wheel ships (the tests below point shipped_cache at folders of their own).
PACKAGED_SHIPPED_CACHES = shipped_cache.SHIPPED_CACHE_DIR

PROBLEM = ConvProblem(200_000, 200_000, 32, 64, 27, np.dtype(np.float16), "cuda", 90, (1, 1, 1))
SEARCH_SPACE = AlgorithmFilter(CONV, "forward", "auto")
EVERY_ALGORITHM = AlgorithmFilter(CONV, "forward", "all")


@pytest.fixture
def no_capture_check(monkeypatch):
    """Before measuring a GPU problem the tuner asks CUDA whether a graph is being captured; there is
    no GPU here, and nothing is."""
    monkeypatch.setattr(tuner_module, "_is_capturing", lambda problem: False)


@pytest.fixture
def kernel_sources(tmp_path, monkeypatch):
    """A copy of the kernel sources to edit, which the digests read from here on."""
    directory = tmp_path / "raw_kernels"
    shutil.copytree(kernel_compile.KERNEL_DIR, directory)
    monkeypatch.setattr(kernel_compile, "KERNEL_DIR", directory)
    forget_digests()
    yield directory
    forget_digests()


def forget_digests():
    """What a process started after an edit would not remember: the sources and their digests."""
    kernel_compile.load_source.cache_clear()
    kernel_compile.source_digest.cache_clear()


def edit_a_comment(directory, filename: str) -> None:
    with open(directory / filename, "a") as source:
        source.write("\n// an edited comment: the code is the same, the measurements may not be\n")
    forget_digests()


def sweep_results(offset_ms: float, search_space=SEARCH_SPACE):
    """Per algorithm namespace: a time for every candidate of `search_space`, the last candidate fastest."""
    pool = candidates(search_space, PROBLEM)
    results = {}
    for rank, (algorithm, params) in enumerate(pool):
        results.setdefault(algorithm, []).append((algorithm.name, params, offset_ms + len(pool) - rank))
    return results, pool[-1]


def digests(algorithm):
    return {(name, kernel_compile.source_digest(name)) for name in algorithm.kernel_sources}


def write_cache(path, results, stale: bool = False, ranking: bool = False):
    """Each algorithm's sweep in its namespace, as the tuner records them; `ranking`: every result in
    the phase namespace too, with the kernel files of every algorithm ranked."""
    cache = BenchmarkCache(path, autosave=False)
    for algorithm, rows in results.items():
        sources = {(name, "0" * 16) for name, _ in digests(algorithm)} if stale else digests(algorithm)
        cache.put(algorithm.tuning_namespace("forward"), tuning_key(PROBLEM), rows, sources)
    if ranking:
        every_result = [row for rows in results.values() for row in rows]
        cache.put(NAMESPACES[(CONV, "forward")], tuning_key(PROBLEM), every_result,
                  set().union(*(digests(algorithm) for algorithm in results)))
    cache.save()


def ship(results, stale: bool = False, ranking: bool = False):
    path = shipped_cache.shipped_cache_path("sm_90")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_cache(path, results, stale, ranking)
    return path


def test_a_shipped_choice_is_used_when_the_user_cache_has_no_entry():
    results, (fastest, params) = sweep_results(0.0)
    ship(results)
    tuner = Tuner()
    chosen = tuner.select(SEARCH_SPACE, PROBLEM, must_not_run)
    assert (chosen.algorithm, chosen.params) == (fastest, params)
    assert tuner.measurements == 0
    namespace = fastest.tuning_namespace("forward")
    assert default_cache().get(namespace, tuning_key(PROBLEM)) is None  # the shipped sweep is not copied


def test_the_users_own_measurement_wins_over_the_shipped_one():
    shipped, _ = sweep_results(0.0)
    ship(shipped)
    pool = candidates(SEARCH_SPACE, PROBLEM)
    first_algorithm, first_params = pool[0]
    mine = {algorithm: [(name, params, 100.0) for name, params, _ in rows] for algorithm, rows in shipped.items()}
    mine[first_algorithm] = [(name, params, 0.5 if params == first_params else 100.0)
                             for name, params, _ in shipped[first_algorithm]]
    write_cache(default_cache().path, mine)
    chosen = Tuner().select(SEARCH_SPACE, PROBLEM, must_not_run)
    assert (chosen.algorithm, chosen.params) == (first_algorithm, first_params)


def test_a_shipped_entry_of_changed_kernel_sources_is_ignored(no_capture_check):
    results, (fastest, _) = sweep_results(0.0)
    ship(results, stale=True)
    assert shipped_cache.shipped_entry(fastest.tuning_namespace("forward"), tuning_key(PROBLEM)) is None
    with pytest.raises(NotMeasured):
        Tuner().select(SEARCH_SPACE, PROBLEM, must_not_run)


def test_keys_of_the_cpu_or_another_architecture_never_match_a_shipped_entry():
    results, (fastest, _) = sweep_results(0.0)
    ship(results)
    namespace = fastest.tuning_namespace("forward")
    key = tuning_key(PROBLEM)
    assert shipped_cache.shipped_entry(namespace, key) is not None
    for architecture in ("cpu", "sm_80"):
        other = tuple((name, architecture if name == "compute_capability" else value) for name, value in key)
        assert shipped_cache.shipped_entry(namespace, other) is None
    # Even a file named after the CPU is never read: only sm_* keys consult shipped files.
    cpu_key = tuple((name, "cpu" if name == "compute_capability" else value) for name, value in key)
    cpu_file = BenchmarkCache(shipped_cache.shipped_cache_path("cpu"), autosave=False)
    cpu_file.put(namespace, cpu_key, results[fastest], digests(fastest))
    cpu_file.save()
    assert shipped_cache.shipped_entry(namespace, cpu_key) is None


def test_a_missing_shipped_file_means_no_shipped_entries():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert shipped_cache.shipped_entry(NAMESPACES[(CONV, "forward")], tuning_key(PROBLEM)) is None


def test_a_corrupt_shipped_file_warns_once_and_is_ignored_untouched():
    path = shipped_cache.shipped_cache_path("sm_90")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x93not a cache at all")
    namespace = NAMESPACES[(CONV, "forward")]
    with pytest.warns(RuntimeWarning, match="ignoring the shipped tuning cache") as caught:
        assert shipped_cache.shipped_entry(namespace, tuning_key(PROBLEM)) is None
        assert shipped_cache.shipped_entry(namespace, tuning_key(PROBLEM)) is None
    assert len([w for w in caught if "shipped" in str(w.message)]) == 1
    assert path.read_bytes() == b"\x93not a cache at all"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # nothing moved aside or added


def test_a_malformed_shipped_entry_warns_once_and_the_file_is_ignored_from_then_on(no_capture_check):
    results, (fastest, params) = sweep_results(0.0)
    path = ship(results)
    document = msgpack.unpackb(path.read_bytes(), raw=False)
    namespace = fastest.tuning_namespace("forward")
    good = document["namespaces"][namespace][0]
    malformed_key = (("compute_capability", "sm_90"), ("in_channels", 3))
    document["namespaces"][namespace].append({**good, "key": malformed_key, "results": "not results"})
    path.write_bytes(msgpack.packb(document))
    assert shipped_cache.shipped_entry(namespace, tuning_key(PROBLEM)).results[0][:2] == (fastest.name, params)
    with pytest.warns(RuntimeWarning, match="ignoring the shipped tuning cache .* malformed") as caught:
        assert shipped_cache.shipped_entry(namespace, malformed_key) is None
        assert shipped_cache.shipped_entry(namespace, tuning_key(PROBLEM)) is None
    assert len([w for w in caught if "shipped" in str(w.message)]) == 1


def test_the_environment_variable_turns_shipped_results_off(monkeypatch, no_capture_check):
    results, (fastest, _) = sweep_results(0.0)
    ship(results)
    monkeypatch.setenv("CUPYSPARSE_SHIPPED_CACHE", "0")
    assert shipped_cache.shipped_entry(fastest.tuning_namespace("forward"), tuning_key(PROBLEM)) is None
    with pytest.raises(NotMeasured):
        Tuner().select(SEARCH_SPACE, PROBLEM, must_not_run)


def test_the_tuning_cache_records_what_the_tuner_asked_for():
    results, _ = sweep_results(0.0)
    ship(results)
    Tuner().select(SEARCH_SPACE, PROBLEM, must_not_run)
    asked = shipped_cache.tuning_cache().asked()
    key = tuning_key(PROBLEM)
    assert {(algorithm.tuning_namespace("forward"), key) for algorithm in results} <= set(asked)
    assert (NAMESPACES[(CONV, "forward")], key) in asked


def test_the_release_check_counts_fresh_and_stale_entries_by_the_changed_file(kernel_sources):
    results, _ = sweep_results(0.0, EVERY_ALGORITHM)
    path = ship(results, ranking=True)
    entries = len(results) + 1
    check = shipped_cache.check_shipped_file(path)
    assert (check.architecture, check.entries, check.fresh, check.stale) == ("sm_90", entries, entries, 0)
    assert check.passes

    edit_a_comment(kernel_sources, "wgmma_implicit_gemm.cu")
    check = shipped_cache.check_shipped_file(path)
    launching = [algorithm for algorithm in results if "wgmma_implicit_gemm.cu" in algorithm.kernel_sources]
    assert launching  # the edit reaches an algorithm of the pool, and the ranking
    assert (check.stale, check.fresh, check.passes) == (len(launching) + 1, entries - len(launching) - 1, False)
    assert check.stale_by_source == {"wgmma_implicit_gemm.cu": len(launching) + 1}


def test_the_release_check_counts_entries_keyed_for_another_architecture():
    results, (fastest, _) = sweep_results(0.0)
    path = ship(results)
    cache = BenchmarkCache(path, autosave=False)
    other = tuple((name, "sm_80" if name == "compute_capability" else value) for name, value in tuning_key(PROBLEM))
    cache.put(fastest.tuning_namespace("forward"), other, results[fastest], digests(fastest))
    cache.save()
    check = shipped_cache.check_shipped_file(path)
    assert (check.stale, check.other_architecture, check.passes) == (0, 1, False)


def test_the_packaged_shipped_files_are_caches_of_their_architecture():
    """What CI asks of the files the wheel ships: readable, keyed for their architecture alone, with both
    phases' choices. Whether they match today's kernel sources is the release check's question
    (`cupysparse-populate-shipped-cache --check`): a kernel edit makes entries stale, which the runtime
    ignores."""
    paths = sorted(PACKAGED_SHIPPED_CACHES.glob("benchmark_cache_sm_*.msgpack"))
    assert paths
    for path in paths:
        check = shipped_cache.check_shipped_file(path)
        assert check.entries > 0 and check.other_architecture == 0, path.name
        namespaces = open_for_reading(path).namespace_counts()
        assert {NAMESPACES[(CONV, "forward")], NAMESPACES[(CONV, "backward")]} <= set(namespaces), path.name
