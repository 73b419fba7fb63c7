"""The tuner on the CPU with injected timings: candidate sets, choices, cache use, failures,
running out of memory, and results out of the dtype's range."""

import dataclasses
import warnings

import numpy as np
import pytest

from cupysparse import settings
from cupysparse.tuning import tuner as tuner_module
from cupysparse.tuning import measurement as measuring
from cupysparse.tuning.search_space import AlgorithmFilter
from cupysparse.algorithms import CONV, DEPTHWISE, Algorithm, ConvProblem, registered
from cupysparse.algorithms import base as algorithms_base
from cupysparse.tuning.cache_file import BenchmarkCache
from cupysparse.cuda.compile import nvrtc_knows
from cupysparse.cuda.timing import WAIT_KERNELS
from cupysparse.tuning.search_space import candidates
from cupysparse.tuning.tuner import NAMESPACES, Tuner, tuning_key

PROBLEM = ConvProblem(3000, 1500, 16, 32, 27, np.dtype(np.float16), "cpu", None, (2, 2, 2))
REFERENCE_OUTPUT = np.linspace(-1, 1, 12).reshape(3, 4)


class FakeAlgorithm(Algorithm):
    """An algorithm whose answer, priority and parameter grid the test sets."""

    def __init__(self, name, priority=0, sizes=(1,), answer=REFERENCE_OUTPUT, error=None, supported=True,
                 reference=False):
        self.name, self.priority, self.answer, self.error, self.supported = name, priority, answer, error, supported
        self.reference = reference
        self.forward_params = {"size": sizes}
        self.backward_params = {"size": sizes}
        self.tuning_namespaces = {"forward": f"{name}_forward_sweep", "backward": f"{name}_backward_sweep"}
        self.kernel_sources = (f"{name}.cu",)

    def unsupported_reason(self, problem):
        return None if self.supported else "not here"

    def auto_priority(self, problem):
        return self.priority


@pytest.fixture
def algorithms(monkeypatch):
    fakes = {
        "explicit_gemm": FakeAlgorithm("explicit_gemm", sizes=(0,), reference=True),
        "fast": FakeAlgorithm("fast", priority=2, sizes=(1, 2, 3)),
        "slow": FakeAlgorithm("slow", priority=1, sizes=(1, 2)),
        "broken": FakeAlgorithm("broken", priority=2, error=RuntimeError("compile failed")),
        "wrong": FakeAlgorithm("wrong", priority=2, answer=REFERENCE_OUTPUT + 0.5),
        "elsewhere": FakeAlgorithm("elsewhere", priority=3, supported=False),
    }
    monkeypatch.setitem(algorithms_base._REGISTRY, CONV, fakes)
    monkeypatch.setattr(tuner_module, "source_digest", lambda filename: "digest-1")
    return fakes


@pytest.fixture
def timings(monkeypatch):
    """Injected times: (name, size) -> ms; also records which candidates were timed."""
    table = {("explicit_gemm", 0): 9.0, ("fast", 1): 3.0, ("fast", 2): 1.5, ("fast", 3): 2.0,
             ("slow", 1): 5.0, ("slow", 2): 1.0, ("broken", 1): 0.1, ("wrong", 1): 0.2}
    timed = []

    def fake_samples(run, timer, repeats=3):
        name, size = run()
        timed.append((name, size))
        return [table[(name, size)]] * repeats

    monkeypatch.setattr(measuring, "candidate_times_ms", fake_samples)
    monkeypatch.delenv("CUPYSPARSE_AUTOTUNE", raising=False)
    return table, timed


def cache_file(path):
    """A cache that sees every fake kernel source at its digest "digest-1"."""
    return BenchmarkCache(path, autosave=False, current_digests=lambda filename: "digest-1")


def runner(algorithms):
    """run(algorithm, params): the algorithm's answer on first use, (name, size) under timing."""
    calls = []

    def run(algorithm, params):
        calls.append((algorithm.name, params["size"]))
        if algorithm.error is not None:
            raise algorithm.error
        return algorithm.answer if len([c for c in calls if c == calls[-1]]) == 1 else (algorithm.name, params["size"])

    return run, calls


def space(mode, *names):
    return AlgorithmFilter(CONV, "forward", mode, names)


@pytest.fixture
def scripted(monkeypatch):
    """Injected samples: each timing of (name, size) takes the next `repeats` values of its script (an
    exception among them is raised, as by a run that fails); `order` records the timings as (name, size,
    repeats)."""
    scripts, order = {}, []

    def fake_samples(run, timer, repeats=3):
        name, size = run()
        order.append((name, size, repeats))
        taken = [scripts[(name, size)].pop(0) for _ in range(repeats)]
        for value in taken:
            if isinstance(value, Exception):
                raise value
        return taken

    monkeypatch.setattr(measuring, "candidate_times_ms", fake_samples)
    monkeypatch.delenv("CUPYSPARSE_AUTOTUNE", raising=False)
    return scripts, order


def test_key_holds_the_problem_shape_dtype_and_device():
    key = dict(tuning_key(PROBLEM))
    assert key["log_num_in_coords"] == 12 and key["log_num_out_coords"] == 11  # ceil(log2 3000), ceil(log2 1500)
    assert (key["in_channels"], key["out_channels"], key["kernel_volume"]) == (16, 32, 27)
    assert key["in_dtype"] == "float16" and key["compute_capability"] == "cpu"
    assert key["stride"] == (2, 2, 2) and key["transposed"] is False
    on_gpu = ConvProblem(3000, 1500, 16, 32, 27, np.dtype(np.float16), "cuda", 90)
    assert dict(tuning_key(on_gpu))["compute_capability"] == "sm_90"


def test_candidate_sets(algorithms):
    names = lambda pool: [(a.name, p["size"]) for a, p in pool]  # noqa: E731
    assert names(candidates(space("names", "slow"), PROBLEM)) == [("slow", 1), ("slow", 2)]
    assert names(candidates(space("names", "slow", "fast"), PROBLEM)) == [("slow", 1), ("slow", 2), ("fast", 1),
                                                                          ("fast", 2), ("fast", 3)]
    every = names(candidates(space("all"), PROBLEM))
    assert ("elsewhere", 1) not in every and len(every) == 1 + 3 + 2 + 1 + 1
    # auto: the supported algorithms of the highest priority, each with its reduced grid.
    algorithms["fast"].auto_param_grid = lambda phase, problem: [{"size": 2}, {"size": 3}]
    assert names(candidates(space("auto"), PROBLEM)) == [("fast", 2), ("fast", 3), ("broken", 1), ("wrong", 1)]


def test_the_fastest_correct_candidate_wins_and_is_cached(algorithms, timings, tmp_path):
    cache = cache_file(tmp_path / "cache.msgpack")
    run, _ = runner(algorithms)
    chosen = Tuner(cache).select(space("all"), PROBLEM, run)
    assert (chosen.algorithm.name, chosen.params) == ("slow", {"size": 2})
    entry = cache.get("sparse_conv_forward", tuning_key(PROBLEM))
    ranked = [(name, params["size"], ms) for name, params, ms in entry.results]
    # broken (raised) and wrong (different answer) are not recorded; the rest best first.
    assert ranked == [("slow", 2, 1.0), ("fast", 2, 1.5), ("fast", 3, 2.0), ("fast", 1, 3.0), ("slow", 1, 5.0),
                      ("explicit_gemm", 0, 9.0)]


def test_on_a_gpu_the_modules_of_every_measured_candidate_are_prepared_before_the_first_runs(
        algorithms, timings, tmp_path, monkeypatch):
    gpu_problem = dataclasses.replace(PROBLEM, device="cuda", compute_capability=90)
    for fake in algorithms.values():
        fake.kernel_modules = lambda phase, problem, params, name=fake.name: (f"{name}.cu {phase} {params['size']}",)
    run, calls = runner(algorithms)
    prepared = []
    monkeypatch.setattr(tuner_module, "_is_capturing", lambda problem: False)
    monkeypatch.setattr(tuner_module, "prepare", lambda sources: prepared.append((list(sources), list(calls))))
    tuner = Tuner(cache_file(tmp_path / "cache.msgpack"))
    assert tuner.select(space("names", "slow", "fast"), gpu_problem, run).algorithm.name == "slow"
    assert prepared == [(["slow.cu forward 1", "slow.cu forward 2", "fast.cu forward 1", "fast.cu forward 2",
                          "fast.cu forward 3", WAIT_KERNELS], [])]  # once, before anything ran: the timer's too
    tuner.forget_choices()
    tuner.select(space("names", "slow", "fast"), gpu_problem, run)
    assert len(prepared) == 1  # answered from the cache: nothing to compile


FIRST_PASS_RUNS = measuring.TIMED_RUNS
ROUNDS = measuring.CONTENDER_ROUNDS


def measure_fast(algorithms):
    """`measure` of fast's three sizes, in the order 1, 2, 3."""
    pool = candidates(space("names", "fast"), PROBLEM)
    return measuring.measure(pool, runner(algorithms)[0], PROBLEM, algorithms["explicit_gemm"])


def test_close_contenders_are_timed_again_and_the_faster_over_all_samples_wins(algorithms, scripted, tmp_path):
    scripts, _ = scripted
    # size 1 is ahead in the first pass, size 2 over the re-timing rounds; size 3 is out of the running.
    scripts.update({("fast", 1): [1.0] * FIRST_PASS_RUNS + [1.3] * ROUNDS,
                    ("fast", 2): [1.1] * FIRST_PASS_RUNS + [1.0] * ROUNDS,
                    ("fast", 3): [3.0] * FIRST_PASS_RUNS})
    cache = cache_file(tmp_path / "c.msgpack")
    chosen = Tuner(cache).select(space("names", "fast"), PROBLEM, runner(algorithms)[0])
    assert (chosen.algorithm.name, chosen.params) == ("fast", {"size": 2})
    ranked = [(params["size"], ms) for _, params, ms in cache.get("sparse_conv_forward", tuning_key(PROBLEM)).results]
    assert ranked == [(2, 1.0), (1, 1.3), (3, 3.0)]  # medians of all 3 + 5 samples; size 3 keeps its first pass


def test_only_the_fastest_candidates_within_the_margin_are_timed_again(algorithms, scripted, monkeypatch):
    scripts, order = scripted
    monkeypatch.setattr(measuring, "MAX_CONTENDERS", 3)
    margin = 1 + measuring.CONTENDER_MARGIN
    # fast 1-3 and slow 2 within the margin, slow 1 just outside; the cap leaves out fast 3, the slowest of them.
    first_pass = {("fast", 1): 1.0, ("fast", 2): 1.02, ("fast", 3): 1.04, ("slow", 2): 1.01,
                  ("slow", 1): margin + 0.01}
    for candidate, time_ms in first_pass.items():
        scripts[candidate] = [time_ms] * (FIRST_PASS_RUNS + ROUNDS)
    pool = candidates(space("names", "slow", "fast"), PROBLEM)
    measurement = measuring.measure(pool, runner(algorithms)[0], PROBLEM, algorithms["explicit_gemm"])
    runs = {candidate: sum(1 for name, size, _ in order if (name, size) == candidate) for candidate in first_pass}
    assert runs == {("fast", 1): 1 + ROUNDS, ("slow", 2): 1 + ROUNDS, ("fast", 2): 1 + ROUNDS,
                    ("fast", 3): 1, ("slow", 1): 1}
    assert [(name, params["size"]) for name, params, _ in measurement.results] == [
        ("fast", 1), ("slow", 2), ("fast", 2), ("fast", 3), ("slow", 1)]


def test_contenders_are_timed_again_round_robin_fastest_first(algorithms, scripted):
    scripts, order = scripted
    scripts.update({("fast", 1): [1.1] * FIRST_PASS_RUNS + [1.1] * ROUNDS,
                    ("fast", 2): [1.0] * FIRST_PASS_RUNS + [1.0] * ROUNDS,
                    ("fast", 3): [1.05] * FIRST_PASS_RUNS + [1.05] * ROUNDS})
    measure_fast(algorithms)
    first_pass = [("fast", size, FIRST_PASS_RUNS) for size in (1, 2, 3)]
    one_round = [("fast", size, 1) for size in (2, 3, 1)]
    assert order == first_pass + one_round * ROUNDS


def test_a_single_contender_is_not_timed_again(algorithms, scripted):
    scripts, order = scripted
    scripts.update({("fast", 1): [2.0] * FIRST_PASS_RUNS, ("fast", 2): [1.0] * FIRST_PASS_RUNS,
                    ("fast", 3): [3.0] * FIRST_PASS_RUNS})
    measurement = measure_fast(algorithms)
    assert order == [("fast", size, FIRST_PASS_RUNS) for size in (1, 2, 3)]
    assert [(params["size"], ms) for _, params, ms in measurement.results] == [(2, 1.0), (1, 2.0), (3, 3.0)]


def test_a_contender_that_raises_while_timed_again_is_skipped_and_a_choice_is_made(algorithms, scripted,
                                                                                    tmp_path, caplog):
    scripts, order = scripted
    scripts.update({("fast", 1): [1.1] * FIRST_PASS_RUNS + [1.1] * ROUNDS,
                    ("fast", 2): [1.0] * FIRST_PASS_RUNS + [1.0, RuntimeError("launch failed")],
                    ("fast", 3): [1.05] * FIRST_PASS_RUNS + [1.05] * ROUNDS})
    cache = cache_file(tmp_path / "c.msgpack")
    with caplog.at_level("INFO", logger="cupysparse.tuning"):
        chosen = Tuner(cache).select(space("names", "fast"), PROBLEM, runner(algorithms)[0])
    assert (chosen.algorithm.name, chosen.params) == ("fast", {"size": 3})
    assert "skipping fast {'size': 2}: RuntimeError: launch failed" in caplog.text
    assert [(size, repeats) for _, size, repeats in order if size == 2] == [(2, FIRST_PASS_RUNS), (2, 1), (2, 1)]
    assert sum(1 for _, size, _ in order if size != 2) == 2 * (1 + ROUNDS)  # the others go on
    ranked = [(params["size"], ms) for _, params, ms in cache.get("sparse_conv_forward", tuning_key(PROBLEM)).results]
    assert ranked == [(3, 1.05), (1, 1.1)]  # its result dropped, as for a candidate that raised at first


def test_a_cached_choice_is_reused_without_measuring(algorithms, timings, tmp_path):
    _, timed = timings
    cache = cache_file(tmp_path / "cache.msgpack")
    run, _ = runner(algorithms)
    Tuner(cache).select(space("all"), PROBLEM, run)
    cache.save()
    timed.clear()
    fresh_run, calls = runner(algorithms)
    reloaded = cache_file(tmp_path / "cache.msgpack")
    tuner = Tuner(reloaded)
    chosen = tuner.select(space("names", "fast"), PROBLEM, fresh_run)
    assert (chosen.algorithm.name, chosen.params) == ("fast", {"size": 2})  # best of the filter among cached results
    assert timed == [] and calls == [] and tuner.measurements == 0


class CountingCache:
    """A cache that records the namespaces read from it."""

    def __init__(self, cache):
        self.cache, self.read = cache, []

    def get(self, namespace, key):
        self.read.append(namespace)
        return self.cache.get(namespace, key)

    def put(self, *args, **kwargs):
        return self.cache.put(*args, **kwargs)


def test_a_cached_choice_is_read_from_the_phase_ranking_alone_when_it_ranks_every_algorithm(
        algorithms, timings, tmp_path):
    cache = cache_file(tmp_path / "cache.msgpack")
    measured = Tuner(cache).select(space("names", "slow", "fast"), PROBLEM, runner(algorithms)[0])
    counting = CountingCache(cache)
    tuner = Tuner(counting)
    chosen = tuner.select(space("names", "slow", "fast"), PROBLEM, runner(algorithms)[0])
    assert (chosen.algorithm.name, chosen.params) == (measured.algorithm.name, measured.params) == ("slow", {"size": 2})
    assert counting.read == ["sparse_conv_forward"] and tuner.measurements == 0
    # A ranking that lacks one of the algorithms (written by a narrower filter) sends the look-up through
    # the algorithms' own entries, which decide: slow's 1.0 ms beats the ranking's fast.
    cache.put("sparse_conv_forward", tuning_key(PROBLEM), [("fast", {"size": 2}, 1.5)], [("fast.cu", "digest-1")])
    counting.read.clear()
    chosen = Tuner(counting).select(space("names", "slow", "fast"), PROBLEM, runner(algorithms)[0])
    assert (chosen.algorithm.name, chosen.params) == ("slow", {"size": 2})
    assert set(counting.read) == {"sparse_conv_forward", "slow_forward_sweep", "fast_forward_sweep"}


def test_a_filter_with_unmeasured_candidates_measures_them_and_keeps_the_old_results(algorithms, timings, tmp_path):
    cache = cache_file(tmp_path / "cache.msgpack")
    Tuner(cache).select(space("names", "fast"), PROBLEM, runner(algorithms)[0])
    chosen = Tuner(cache).select(space("names", "slow"), PROBLEM, runner(algorithms)[0])
    assert (chosen.algorithm.name, chosen.params) == ("slow", {"size": 2})
    names = {name for name, _, _ in cache.get("sparse_conv_forward", tuning_key(PROBLEM)).results}
    assert names == {"fast", "slow"}  # the reference runs for checking, but is timed only when a candidate


def test_when_every_candidate_fails_the_reference_runs(algorithms, timings, tmp_path, caplog):
    cache = cache_file(tmp_path / "cache.msgpack")
    run, _ = runner(algorithms)
    with caplog.at_level("WARNING", logger="cupysparse.tuning"), pytest.warns(RuntimeWarning) as warned:
        chosen = Tuner(cache).select(space("names", "broken", "wrong"), PROBLEM, run)
    assert chosen.algorithm.name == "explicit_gemm"
    (warning,) = [str(w.message) for w in warned]
    assert "broken could not run" in warning and "RuntimeError: compile failed" in warning
    assert "differs" in caplog.text  # a wrong answer is logged per candidate


def test_tuning_refuses_to_run_during_graph_capture(algorithms, timings, tmp_path, monkeypatch):
    monkeypatch.setattr(tuner_module, "_is_capturing", lambda problem: True)
    run, _ = runner(algorithms)
    with pytest.raises(RuntimeError, match="capture"):
        Tuner(cache_file(tmp_path / "c.msgpack")).select(space("all"), PROBLEM, run)


def test_during_capture_a_choice_capture_cannot_record_gives_way_to_the_next_best(algorithms, timings, tmp_path,
                                                                                   monkeypatch):
    tuner = Tuner(cache_file(tmp_path / "c.msgpack"))
    run, _ = runner(algorithms)
    assert tuner.select(space("all"), PROBLEM, run).algorithm.name == "slow"
    algorithms["slow"].capturable = False
    monkeypatch.setattr(tuner_module, "_is_capturing", lambda problem: True)
    chosen = tuner.select(space("all"), PROBLEM, run)
    assert (chosen.algorithm.name, chosen.params) == ("fast", {"size": 2})  # next in the recorded ranking
    monkeypatch.setattr(tuner_module, "_is_capturing", lambda problem: False)
    assert tuner.select(space("all"), PROBLEM, run).algorithm.name == "slow"  # outside capture: the choice


def test_during_capture_an_unmeasured_problem_falls_back_to_the_rule_among_capturable(algorithms, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setenv("CUPYSPARSE_AUTOTUNE", "0")
    algorithms["fast"].capturable = algorithms["broken"].capturable = algorithms["wrong"].capturable = False
    monkeypatch.setattr(tuner_module, "_is_capturing", lambda problem: True)
    chosen = Tuner(cache_file(tmp_path / "c.msgpack")).select(space("auto"), PROBLEM)
    assert chosen.algorithm.name == "slow"
    for algorithm in algorithms.values():
        algorithm.capturable = False
    with pytest.raises(RuntimeError, match="capture cannot record"):
        Tuner(cache_file(tmp_path / "d.msgpack")).select(space("auto"), PROBLEM)


def test_autotune_off_uses_the_priority_rule(algorithms, timings, tmp_path, monkeypatch):
    _, timed = timings
    monkeypatch.setenv("CUPYSPARSE_AUTOTUNE", "0")
    run, calls = runner(algorithms)
    chosen = Tuner(cache_file(tmp_path / "c.msgpack")).select(space("names", "slow"), PROBLEM, run)
    assert (chosen.algorithm.name, chosen.params) == ("slow", {"size": 1})
    assert timed == [] and calls == []


def test_a_single_candidate_is_measured_only_when_asked(algorithms, timings, tmp_path):
    _, timed = timings
    cache = cache_file(tmp_path / "c.msgpack")
    only = AlgorithmFilter(CONV, "forward", "names", ("explicit_gemm",))
    assert Tuner(cache).select(only, PROBLEM, runner(algorithms)[0]).algorithm.name == "explicit_gemm"
    assert timed == [] and cache.get("sparse_conv_forward", tuning_key(PROBLEM)) is None
    Tuner(cache, measure_single_candidates=True).select(only, PROBLEM, runner(algorithms)[0])
    assert [r[0] for r in cache.get("sparse_conv_forward", tuning_key(PROBLEM)).results] == ["explicit_gemm"]


def test_each_algorithm_keeps_its_parameter_sweep_in_its_own_namespace(algorithms, timings, tmp_path):
    cache = cache_file(tmp_path / "c.msgpack")
    Tuner(cache).select(space("all"), PROBLEM, runner(algorithms)[0])
    sweep = lambda name: [(r[1]["size"], r[2]) for r in cache.get(f"{name}_forward_sweep", tuning_key(PROBLEM)).results]  # noqa: E731
    assert sweep("fast") == [(2, 1.5), (3, 2.0), (1, 3.0)]
    assert sweep("slow") == [(2, 1.0), (1, 5.0)]
    assert sweep("wrong") == []  # a wrong answer is a result: remembered, not measured again
    # An algorithm that raised on every candidate is not remembered as failed: the next process tries it.
    assert cache.get("broken_forward_sweep", tuning_key(PROBLEM)) is None
    assert cache.get("elsewhere_forward_sweep", tuning_key(PROBLEM)) is None  # unsupported: never run
    assert cache.get("fast_forward_sweep", tuning_key(PROBLEM)).kernel_sources == (("fast.cu", "digest-1"),)


def test_a_wider_search_space_measures_only_the_algorithms_not_yet_swept(algorithms, timings, tmp_path):
    _, timed = timings
    cache = cache_file(tmp_path / "c.msgpack")
    tuner = Tuner(cache)
    tuner.select(space("auto"), PROBLEM, runner(algorithms)[0])
    tuner.select(space("auto"), PROBLEM, runner(algorithms)[0])
    assert {name for name, _ in timed} == {"fast"} and tuner.measurements == 1
    timed.clear()
    chosen = Tuner(cache).select(space("all"), PROBLEM, runner(algorithms)[0])
    assert sorted(timed) == [("explicit_gemm", 0), ("slow", 1), ("slow", 2)]
    assert (chosen.algorithm.name, chosen.params) == ("slow", {"size": 2})
    assert len(cache.get("sparse_conv_forward", tuning_key(PROBLEM)).results) == 6


def test_a_changed_kernel_source_invalidates_only_its_own_algorithm(algorithms, timings, tmp_path, monkeypatch):
    _, timed = timings
    digests = {"fast.cu": "digest-1"}
    monkeypatch.setattr(tuner_module, "source_digest", lambda filename: digests.get(filename, "digest-1"))
    current = lambda filename: digests.get(filename, "digest-1")  # noqa: E731
    cache = BenchmarkCache(tmp_path / "c.msgpack", autosave=False, current_digests=current)
    Tuner(cache).select(space("all"), PROBLEM, runner(algorithms)[0])
    digests["fast.cu"] = "digest-2"
    timed.clear()
    Tuner(cache).select(space("all"), PROBLEM, runner(algorithms)[0])
    assert sorted(timed) == [("fast", 1), ("fast", 2), ("fast", 3)]
    assert cache.get("slow_forward_sweep", tuning_key(PROBLEM)).kernel_sources == (("slow.cu", "digest-1"),)
    assert cache.get("fast_forward_sweep", tuning_key(PROBLEM)).kernel_sources == (("fast.cu", "digest-2"),)


def test_running_out_of_memory_is_skipped_but_not_remembered(algorithms, timings, tmp_path, caplog):
    algorithms["broken"].error = MemoryError("out of memory allocating 12 GiB")
    cache = cache_file(tmp_path / "c.msgpack")
    with caplog.at_level("INFO", logger="cupysparse.tuning"), pytest.warns(RuntimeWarning, match="out of memory"):
        chosen = Tuner(cache).select(space("names", "broken", "fast"), PROBLEM, runner(algorithms)[0])
    assert (chosen.algorithm.name, chosen.params) == ("fast", {"size": 2}) and "12 GiB" in caplog.text
    # A ranking measured while memory was short is not stored at all: the next process measures again.
    for namespace in ("broken_forward_sweep", "fast_forward_sweep", "sparse_conv_forward"):
        assert cache.get(namespace, tuning_key(PROBLEM)) is None


def test_every_registered_algorithm_has_its_own_namespaces_apart_from_the_phase_ones():
    names = [
        algorithm.tuning_namespace(phase)
        for kind in (CONV, DEPTHWISE)
        for algorithm in registered(kind).values()
        for phase in ("forward", "backward")
    ]
    assert len(set(names)) == len(names) and not set(names) & set(NAMESPACES.values())
    assert registered(CONV)["wmma_implicit_gemm"].tuning_namespace("forward") == "wmma_implicit_gemm_sm80"
    assert registered(CONV)["implicit_gemm"].tuning_namespace("backward") == "implicit_gemm_trAB_gather"


def test_auto_tries_the_tensor_core_kernels_with_channel_dependent_reduced_grids():
    wmma, mma = registered(CONV)["wmma_implicit_gemm"], registered(CONV)["mma_implicit_gemm"]

    def problem(in_channels, out_channels):
        return ConvProblem(10**6, 10**6, in_channels, out_channels, 27, np.dtype(np.float16), "cuda", 90)

    # wgmma's narrowest tile is 64 channels wide: below that auto leaves it out (test_wgmma_implicit_gemm.py).
    all_pairs, wide_pairs = ((3, 32), (32, 32), (64, 64), (128, 256)), ((64, 64), (128, 256))
    wgmma = registered(CONV)["wgmma_implicit_gemm"]
    for algorithm, pairs in ((wmma, all_pairs), (mma, all_pairs), (wgmma, wide_pairs)):
        for phase in ("forward", "backward"):
            full = algorithm.param_grid(phase)
            for pair in pairs:
                grid = algorithm.auto_param_grid(phase, problem(*pair))
                assert grid and all(params in full for params in grid) and len(grid) < len(full)
    # mma: tiles no wider than the narrowest covering the padded channels of the phase's output.
    assert {p["tile"][1] for p in mma.auto_param_grid("forward", problem(64, 32))} == {32}
    assert {p["tile"][1] for p in mma.auto_param_grid("backward", problem(64, 32))} == {32, 64}
    # Between two widths, up to the one that covers the channels.
    assert {p["tile"][1] for p in mma.auto_param_grid("forward", problem(64, 96))} == {32, 64, 128}
    assert {p["tile"][1] for p in mma.auto_param_grid("forward", problem(64, 48))} == {32, 64}
    forward = wmma.auto_param_grid("forward", problem(64, 32))
    assert {p["tile"] for p in forward} == {(128, 32)} and all(p["sort_rows"] for p in forward)
    assert {p["tile"] for p in wmma.auto_param_grid("backward", problem(64, 32))} == {(128, 64), (128, 32)}
    assert {p["tile"] for p in wmma.auto_param_grid("forward", problem(64, 256))} == {(64, 128), (128, 64)}
    pool = candidates(AlgorithmFilter(CONV, "forward", "auto", ()), problem(64, 64))
    # On sm_90 wgmma's kernels join them wherever NVRTC compiles sm_90a.
    joined = {wgmma.name} if nvrtc_knows("sm_90a") else set()
    assert {algorithm.name for algorithm, _ in pool} == {"wmma_implicit_gemm", "mma_implicit_gemm", *joined}


def test_the_selection_state_moves_when_choices_are_forgotten_or_tuning_is_switched(monkeypatch):
    """What the plans kept on kernel maps are checked against."""
    monkeypatch.setenv("CUPYSPARSE_AUTOTUNE", "1")
    before = settings.selection_state()
    assert settings.selection_state() == before
    tuner_module.default_tuner().forget_choices()
    after_forgetting = settings.selection_state()
    assert after_forgetting != before
    monkeypatch.setenv("CUPYSPARSE_AUTOTUNE", "0")
    assert settings.selection_state() not in (before, after_forgetting)


def test_the_agreement_check_allows_rounding_in_the_subnormal_range_and_nothing_more():
    reference = np.linspace(-1.5e-5, 1.5e-5, 64).astype(np.float16)  # fp16 subnormals: steps of 2**-24
    step = np.float16(2.0**-24)
    assert measuring.disagreement(reference + 4 * step, reference, np.float16) is None
    assert "differs" in measuring.disagreement(reference + 64 * step, reference, np.float16)
    normal = np.linspace(-1, 1, 64).astype(np.float16)
    assert measuring.disagreement(normal + np.float16(0.005), normal, np.float16) is None
    assert "differs" in measuring.disagreement(normal + np.float16(0.02), normal, np.float16)


def test_a_sweep_where_every_candidate_raised_is_not_cached_and_is_reported_once(algorithms, timings, tmp_path):
    for name in ("fast", "slow", "wrong"):
        algorithms[name].error = RuntimeError(f"NVRTC failed on {name}.cu (-arch=sm_90):\nerror: identifier undefined")
    cache = cache_file(tmp_path / "c.msgpack")
    tuner = Tuner(cache)
    with pytest.warns(RuntimeWarning) as warned:
        chosen = tuner.select(space("all"), PROBLEM, runner(algorithms)[0])
    assert (chosen.algorithm.name, chosen.params) == ("explicit_gemm", {"size": 0})
    (warning,) = [str(w.message) for w in warned]
    assert "no sparse_conv_forward candidate could run" in warning and "so explicit_gemm runs" in warning
    for name in ("fast", "slow", "wrong"):
        assert f"{name}: RuntimeError: NVRTC failed on {name}.cu (-arch=sm_90):" in warning
    assert "broken: RuntimeError: compile failed" in warning
    assert "identifier undefined" not in warning  # first lines only: an NVRTC log runs to pages
    assert cache.entries() == []  # neither the failed sweeps nor a ranking of explicit_gemm alone

    other = dataclasses.replace(PROBLEM, in_channels=64)  # the same failures for another layer: no new warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuner.select(space("all"), other, runner(algorithms)[0]).algorithm.name == "explicit_gemm"
    assert cache.entries() == []

    for name in ("fast", "slow", "wrong"):  # repaired: the next process measures and caches the winner
        algorithms[name].error = None
    chosen = Tuner(cache).select(space("all"), PROBLEM, runner(algorithms)[0])
    assert (chosen.algorithm.name, chosen.params) == ("slow", {"size": 2})
    assert cache.get("sparse_conv_forward", tuning_key(PROBLEM)).results[0][0] == "slow"


def test_a_candidate_out_of_cupy_memory_is_skipped_and_the_ranking_waits_for_memory(algorithms, timings, tmp_path):
    out_of_memory = pytest.importorskip("cupy.cuda.memory").OutOfMemoryError
    _, timed = timings
    algorithms["fast"].error = out_of_memory(12 * 2**30, 70 * 2**30)
    cache = cache_file(tmp_path / "c.msgpack")
    tuner = Tuner(cache)
    with pytest.warns(RuntimeWarning, match="ran out of memory and were skipped"):
        chosen = tuner.select(space("names", "fast", "slow"), PROBLEM, runner(algorithms)[0])
    assert (chosen.algorithm.name, chosen.params) == ("slow", {"size": 2})
    assert cache.entries() == []
    timed.clear()
    assert tuner.select(space("names", "fast", "slow"), PROBLEM, runner(algorithms)[0]).params == {"size": 2}
    assert timed == [] and tuner.measurements == 1  # the process keeps its choice

    algorithms["fast"].error = None  # the next process has the memory
    chosen = Tuner(cache).select(space("names", "fast", "slow"), PROBLEM, runner(algorithms)[0])
    assert (chosen.algorithm.name, chosen.params) == ("slow", {"size": 2})
    entry = cache.get("sparse_conv_forward", tuning_key(PROBLEM))
    assert [(name, params["size"]) for name, params, _ in entry.results] == [
        ("slow", 2), ("fast", 2), ("fast", 3), ("fast", 1), ("slow", 1)]


def test_a_reference_out_of_memory_leaves_the_choice_to_the_priority_rule(algorithms, timings, tmp_path):
    _, timed = timings
    algorithms["explicit_gemm"].error = MemoryError("Unable to allocate 9.00 GiB for an array")
    cache = cache_file(tmp_path / "c.msgpack")
    with pytest.warns(RuntimeWarning, match="the reference explicit_gemm ran out of memory .*9.00 GiB"):
        chosen = Tuner(cache).select(space("all"), PROBLEM, runner(algorithms)[0])
    # The highest priority among the others (fast, broken and wrong share 2; fast comes first), unmeasured.
    assert (chosen.algorithm.name, chosen.params) == ("fast", {"size": 1})
    assert timed == [] and cache.entries() == []


FP16_LARGEST = (2 - 2**-10) * 2**15  # 65504
BF16_LARGEST = (2 - 2**-7) * 2**127


def test_an_overflowing_reference_checks_nothing_and_its_result_stands(algorithms, timings, tmp_path):
    _, timed = timings
    exact = np.array([[1.0, 2.0], [70000.0, -3.0], [5.0, -80000.0]], np.float32)  # fp32 sums beyond fp16
    for algorithm in algorithms.values():
        algorithm.answer = exact.astype(np.float16)  # every candidate "agrees": inf where the reference is
    cache = cache_file(tmp_path / "c.msgpack")
    tuner = Tuner(cache)
    run, calls = runner(algorithms)
    with pytest.warns(RuntimeWarning) as warned:
        chosen = tuner.select(space("names", "fast", "slow"), PROBLEM, run)
    assert chosen.algorithm.name == "explicit_gemm"
    (warning,) = [str(w.message) for w in warned]
    assert f"overflow: the fp16 output exceeds {FP16_LARGEST:g} at row 1, channel 0 (and 1 more)" in warning
    assert calls == [("explicit_gemm", 0)] and timed == []  # no candidate ran: nothing could check it
    assert cache.entries() == []

    with warnings.catch_warnings():  # the next call, still overflowing: tuned again, warned only once
        warnings.simplefilter("error")
        assert tuner.select(space("names", "fast", "slow"), PROBLEM, runner(algorithms)[0]).algorithm.name \
            == "explicit_gemm"
    for algorithm in algorithms.values():  # a call with data in range tunes as usual
        algorithm.answer = REFERENCE_OUTPUT
    chosen = tuner.select(space("names", "fast", "slow"), PROBLEM, runner(algorithms)[0])
    assert (chosen.algorithm.name, chosen.params) == ("slow", {"size": 2})
    assert cache.get("sparse_conv_forward", tuning_key(PROBLEM)) is not None


def test_a_candidate_that_overflows_where_the_reference_is_finite_is_skipped_as_an_overflow(
        algorithms, timings, tmp_path, caplog):
    reference = np.array([[1.0, 2.0], [60000.0, -3.0]], np.float16)
    algorithms["explicit_gemm"].answer = reference
    algorithms["slow"].answer = reference.copy()
    overflowed = reference.copy()
    overflowed[1, 0] = np.inf  # as if it summed in fp16 and passed 65504 on the way
    algorithms["fast"].answer = overflowed
    with caplog.at_level("WARNING", logger="cupysparse.tuning"):
        chosen = Tuner(cache_file(tmp_path / "c.msgpack")).select(
            space("names", "fast", "slow"), PROBLEM, runner(algorithms)[0])
    assert (chosen.algorithm.name, chosen.params) == ("slow", {"size": 2})
    assert caplog.text.count("overflow: the fp16 output is inf at row 1, channel 0, where the reference is 60000") == 3


def test_the_check_names_inf_and_nan_in_either_result_with_their_position():
    with_inf = np.array([[1, np.inf], [2, 3]], np.float16)
    assert measuring.disagreement(with_inf, with_inf, np.float16).startswith(
        f"overflow: the fp16 output exceeds {FP16_LARGEST:g} at row 0, channel 1:")
    with_nan = np.array([[1, 2], [np.nan, 3]], np.float32)
    assert "reference fp32 output is NaN at row 1, channel 0" in measuring.disagreement(
        with_nan, with_nan, np.float32)
    finite = np.array([[1, 2], [4, 3]], np.float32)
    assert measuring.disagreement(with_nan, finite, np.float32) == (
        "the fp32 output is NaN at row 1, channel 0, where the reference is 4")
    # A backward's weight gradient [K, C_in, C_out], in bf16, whose range is fp32's.
    bfloat16 = pytest.importorskip("ml_dtypes").bfloat16
    grad_input = np.ones((3, 2), bfloat16)
    grad_weight = np.ones((2, 2, 3), np.float32)
    grad_weight[1, 0, 2] = -np.inf
    reason = measuring.disagreement((grad_input, grad_weight.astype(bfloat16)),
                                       (grad_input, grad_weight.astype(bfloat16)), bfloat16)
    assert reason.startswith(f"overflow: the bf16 weight gradient exceeds {BF16_LARGEST:g} at offset 1, "
                             "input channel 0, output channel 2")
    depthwise_grad_weight = np.ones((3, 4), np.float32)  # [K, C]
    depthwise_grad_weight[2, 3] = np.inf
    reason = measuring.disagreement((grad_input, depthwise_grad_weight), (grad_input, np.ones((3, 4))), np.float32)
    assert reason == "overflow: the fp32 weight gradient is inf at offset 2, channel 3, where the reference is 1"
