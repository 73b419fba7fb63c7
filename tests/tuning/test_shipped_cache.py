"""Shipped tuning results: used where the user's cache has no entry, never over the user's own, never
when stale, never for another architecture, and a damaged file only warns (once). A kernel edit makes
stale exactly the entries of the algorithms that launch the edited file (or include the edited
header): those are measured again, the others still come from the shipped file. Whether the shipped
files match today's sources is the release check's question (`check_shipped_file`), not CI's."""

import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import warnings

import msgpack
import numpy as np
import pytest

from cupysparse.algorithms import CONV, DEPTHWISE, ConvProblem, registered
from cupysparse.cuda import compile as kernel_compile
from cupysparse.cuda.dtypes import BFLOAT16, FLOAT16, FLOAT32, FLOAT64
from cupysparse.tuning import shipped as shipped_cache
from cupysparse.tuning import measurement as measuring
from cupysparse.tuning import tuner as tuner_module
from cupysparse.tuning.cache_file import BenchmarkCache, default_cache, open_for_reading
from cupysparse.tuning.search_space import AlgorithmFilter, candidates
from cupysparse.tuning.tuner import NAMESPACES, Tuner, tuning_key
from tuning_caches import NotMeasured, caches, must_not_run  # noqa: F401 (caches: an autouse fixture)

# The folder the wheel ships (the tests below point shipped_cache at folders of their own).
PACKAGED_SHIPPED_CACHES = shipped_cache.SHIPPED_CACHE_DIR
KERNEL_FILES = sorted(path.name for path in kernel_compile.KERNEL_DIR.iterdir() if path.suffix in (".cu", ".cuh"))
TEST_HELPERS = pathlib.Path(__file__).resolve().parents[1]  # gpu_cases
PROJECT_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)

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


def included(directory, filename: str) -> set[str]:
    """`filename` and the project headers it includes, transitively (read here, not by the library)."""
    found, pending = set(), [filename]
    while pending:
        name = pending.pop()
        if name not in found:
            found.add(name)
            pending += PROJECT_INCLUDE.findall((directory / name).read_text())
    return found


@pytest.fixture
def measurable(monkeypatch):
    """A run for the tuner to measure with, without a GPU: every candidate agrees with the reference,
    each timing a millisecond longer than the last; the names of the algorithms it timed."""
    timed, last_run = [], []

    def run(algorithm, params):
        last_run[:] = [algorithm.name]
        return np.ones((8, PROBLEM.out_channels), np.float16)

    def samples(run_candidate, timer, repeats=3):
        run_candidate()
        timed.append(last_run[0])
        return [float(len(timed))] * repeats

    monkeypatch.setattr(measuring, "candidate_times_ms", samples)
    monkeypatch.setattr(measuring, "QueuedTimer", lambda: None)
    monkeypatch.setattr(tuner_module, "prepare_kernels", lambda pool, phase, problem: None)
    monkeypatch.setattr(tuner_module, "_is_capturing", lambda problem: False)
    return run, timed


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


def test_a_stale_entry_of_the_users_gives_way_to_a_fresh_shipped_one():
    shipped, (fastest, params) = sweep_results(0.0)
    ship(shipped)
    mine = {algorithm: [(name, p, 0.01) for name, p, _ in rows] for algorithm, rows in shipped.items()}
    write_cache(default_cache().path, mine, stale=True)  # measured with kernels since edited
    chosen = Tuner().select(SEARCH_SPACE, PROBLEM, must_not_run)
    assert (chosen.algorithm, chosen.params) == (fastest, params)


@pytest.mark.parametrize("edited", KERNEL_FILES)
def test_a_kernel_edit_retunes_only_the_algorithms_that_launch_the_edited_file(edited, kernel_sources, measurable):
    """A comment edited in one kernel file (or a header): the shipped entries of the algorithms that
    launch it, and the phase ranking that holds them, are ignored and measured again, with today's
    digests; the other algorithms' shipped sweeps still serve, unmeasured."""
    run, timed = measurable
    results, _ = sweep_results(0.0, EVERY_ALGORITHM)
    ship(results, ranking=True)
    edit_a_comment(kernel_sources, edited)
    launching = {algorithm for algorithm in results
                 if any(edited in included(kernel_sources, name) for name in algorithm.kernel_sources)}
    key = tuning_key(PROBLEM)

    for algorithm in results:
        shipped = shipped_cache.shipped_entry(algorithm.tuning_namespace("forward"), key)
        assert (shipped is None) == (algorithm in launching), algorithm.name
    assert (shipped_cache.shipped_entry(NAMESPACES[(CONV, "forward")], key) is None) == bool(launching)

    Tuner().select(EVERY_ALGORITHM, PROBLEM, run)
    assert set(timed) == {algorithm.name for algorithm in launching}
    for algorithm in launching:
        remeasured = default_cache().get(algorithm.tuning_namespace("forward"), key)
        assert set(remeasured.kernel_sources) == digests(algorithm)
    if launching:  # the new ranking holds every algorithm, and so records all their files
        ranking = default_cache().get(NAMESPACES[(CONV, "forward")], key)
        assert set(ranking.kernel_sources) == set().union(*(digests(algorithm) for algorithm in results))

    timed.clear()
    Tuner().select(EVERY_ALGORITHM, PROBLEM, run)  # a later process: nothing left to measure
    assert timed == []


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


# An entry records the kernel files of its algorithms (`Algorithm.kernel_sources`): every file the
# algorithm launches from must be among them, or an edit of it would leave the entry looking fresh.

def problems_of_every_kind():
    dtypes = [dtype for dtype in (FLOAT64, FLOAT32, FLOAT16, BFLOAT16) if dtype is not None]
    for capability in (80, 90):
        for dtype in dtypes:
            for tf32 in (False, True) if dtype == FLOAT32 else (False,):
                for in_channels, out_channels in ((3, 16), (32, 64), (128, 256), (96, 40)):
                    for transposed in (False, True):
                        yield ConvProblem(100_000, 50_000, in_channels, out_channels, 27, dtype, "cuda", capability,
                                          (2, 2, 2), transposed, tf32=tf32)


@pytest.mark.parametrize("kind", [CONV, DEPTHWISE])
def test_every_module_a_candidate_compiles_is_of_its_algorithms_kernel_sources(kind):
    modules = {}  # algorithm name -> files of the modules its candidates compile
    for problem in problems_of_every_kind():
        if kind == DEPTHWISE:
            problem = dataclasses.replace(problem, out_channels=problem.in_channels)
        for phase in ("forward", "backward"):
            for algorithm, params in candidates(AlgorithmFilter(kind, phase, "all"), problem):
                files = {source.filename for source in algorithm.kernel_modules(phase, problem, params)}
                assert files <= set(algorithm.kernel_sources), (algorithm.name, phase, problem, params)
                modules.setdefault(algorithm.name, set()).update(files)
    for name, algorithm in registered(kind).items():  # the check above saw each algorithm's kernels
        assert modules.get(name, set()) == set(algorithm.kernel_sources), name


# Run in a process of its own, so that no module is loaded yet: the files of the modules an algorithm
# loads on the GPU, those of the kernel map (the geometry package's kernels) left out.
MODULES_LOADED_BY = """
import importlib, json, pkgutil, sys
import cupy
import numpy as np
from cupysparse import geometry
from cupysparse.algorithms import DEPTHWISE, ConvProblem, get_algorithm
from cupysparse.cuda import compile as kernel_compile
from gpu_cases import DTYPES, gpu_map

algorithm = get_algorithm(sys.argv[1], sys.argv[2])
kernel_map = gpu_map("submanifold")
map_files = {value.filename for module in pkgutil.iter_modules(geometry.__path__)
             for value in vars(importlib.import_module(f"{geometry.__name__}.{module.name}")).values()
             if isinstance(value, kernel_compile.KernelSource)}
rng = np.random.default_rng(0)
in_channels, out_channels = 32, 32 if algorithm.kind == DEPTHWISE else 64
for dtype in DTYPES:
    x = cupy.asarray(rng.standard_normal((kernel_map.num_in, in_channels)).astype(dtype))
    dy = cupy.asarray(rng.standard_normal((kernel_map.num_out, out_channels)).astype(dtype))
    weight_shape = (kernel_map.kernel_volume, in_channels) + (() if algorithm.kind == DEPTHWISE else (out_channels,))
    weight = algorithm.prepare_weight(cupy.asarray(rng.standard_normal(weight_shape).astype(dtype)))
    if algorithm.supports(ConvProblem.of(x, kernel_map, out_channels)):
        algorithm.forward(x, weight, kernel_map, **algorithm.default_params("forward"))
        algorithm.dgrad(dy, weight, kernel_map, **algorithm.default_params("backward"))
        algorithm.wgrad(x, dy, kernel_map, **algorithm.default_params("backward"))
cupy.cuda.Device().synchronize()
print(json.dumps(sorted({source.filename for source, _ in kernel_compile._modules} - map_files)))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("kind, name", [(kind, name) for kind in (CONV, DEPTHWISE) for name in registered(kind)])
def test_an_algorithm_launches_from_its_kernel_sources_alone(kind, name):
    loaded = subprocess.run([sys.executable, "-c", MODULES_LOADED_BY, name, kind], capture_output=True, text=True,
                            check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                [str(TEST_HELPERS), *filter(None, [os.environ.get("PYTHONPATH")])])}).stdout
    files = set(json.loads(loaded.splitlines()[-1]))
    kernel_sources = set(registered(kind)[name].kernel_sources)
    assert files <= kernel_sources, f"{name} launches from {sorted(files - kernel_sources)} too"
    assert bool(files) == bool(kernel_sources)  # it did run its kernels
