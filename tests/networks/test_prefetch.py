"""Loading a network's kernels before its first call (`cupysparse.networks.prefetch`): the cache keys it reads,
the tuner's `recall` and `rehearsal`, the choices it derives for a network, on a GPU the network's
rehearsal, and a fresh process whose first forward loads no module and measures nothing."""

import os
import subprocess
import sys
import textwrap
import threading
from dataclasses import replace

import numpy as np
import pytest

from cupysparse import settings
from cupysparse.networks import descriptions as networks
from cupysparse.networks import prefetch
from cupysparse.tuning import shipped as shipped_cache
from cupysparse.tuning import tuner as tuner_module
from cupysparse.tuning.search_space import AlgorithmFilter, parse_algorithm_filter
from cupysparse.algorithms import CONV, ConvProblem, get_algorithm
from cupysparse.tuning.cache_file import BenchmarkCache, default_cache, open_for_reading
from cupysparse.cuda.compile import source_digest
from cupysparse.tuning.search_space import Selection, rule_based_selection
from cupysparse.tuning.shipped import TuningCache
from cupysparse.tuning.search_space import candidates
from cupysparse.tuning.tuner import NAMESPACES, RehearsalStopped, Tuner, rehearsal, rehearsal_key, tuning_key
from tuning_caches import NotMeasured, caches, must_not_run  # noqa: F401 (caches: an autouse fixture)

FORWARD = NAMESPACES[(CONV, "forward")]
BACKWARD = NAMESPACES[(CONV, "backward")]
NETWORK = networks.minkunet(18, 3, 13)


def layer_problem(in_channels, out_channels, kernel_volume, num_in, num_out, stride=(1, 1, 1), transposed=False):
    return ConvProblem(num_in, num_out, in_channels, out_channels, kernel_volume, np.dtype(np.float16), "cuda", 90,
                       stride, transposed)


def record_ranking(cache: BenchmarkCache, problem: ConvProblem, phase: str = "forward", fastest: int = -1):
    """A phase ranking of every `auto` candidate of `problem`, as a process that measured it records one,
    with the candidate at `fastest` first; returns that candidate."""
    pool = candidates(AlgorithmFilter(CONV, phase, "auto"), problem)
    winner = pool[fastest]
    results = [(algorithm.name, params, 1.0 if (algorithm, params) == winner else 2.0 + rank)
               for rank, (algorithm, params) in enumerate(pool)]
    sources = {(name, source_digest(name)) for algorithm, _ in pool for name in algorithm.kernel_sources}
    cache.put(NAMESPACES[(CONV, phase)], tuning_key(problem), results, sources)
    return winner


def ship(problems, phase: str = "forward"):
    """A shipped sm_90 file ranking the candidates of each of `problems`."""
    path = shipped_cache.shipped_cache_path("sm_90")
    path.parent.mkdir(parents=True, exist_ok=True)
    cache = BenchmarkCache(path, autosave=False)
    winners = [record_ranking(cache, problem, phase) for problem in problems]
    cache.save()
    return winners


def match(problem: ConvProblem) -> tuple:
    return tuple(sorted(tuning_key(problem)))


def test_a_cache_lists_its_keys_read_only_without_decoding_and_loaded_alike(tmp_path):
    path = tmp_path / "cache.msgpack"
    cache = BenchmarkCache(path, autosave=False)
    problems = [layer_problem(32, 32, 27, 2**15, 2**15), layer_problem(64, 64, 27, 2**13, 2**13)]
    for problem in problems:
        record_ranking(cache, problem)
    cache.save()
    assert sorted(cache.keys(FORWARD)) == sorted(map(match, problems))
    assert cache.keys(BACKWARD) == []
    read_only = open_for_reading(path, decode=False)
    assert sorted(read_only.keys(FORWARD)) == sorted(map(match, problems))
    assert read_only._index._decoded == {}  # listing keys decoded no entry


def test_the_tuning_cache_lists_the_users_and_the_shipped_keys_once_each(monkeypatch):
    shared, shipped_only, users_only = (layer_problem(32, 32, 27, 2**b, 2**b) for b in (15, 16, 17))
    ship([shared, shipped_only])
    for problem in (shared, users_only):
        record_ranking(default_cache(), problem)
    keys = TuningCache().keys(FORWARD)
    assert sorted(keys) == sorted(map(match, (shared, shipped_only, users_only)))
    monkeypatch.setenv("CUPYSPARSE_SHIPPED_CACHE", "0")
    assert sorted(TuningCache().keys(FORWARD)) == sorted(map(match, (shared, users_only)))


def test_recall_answers_the_recorded_ranking_and_select_then_measures_nothing():
    problem = layer_problem(32, 64, 27, 200_000, 200_000)
    (winner, params), = ship([problem])
    tuner = Tuner()
    recalled = tuner.recall(AlgorithmFilter(CONV, "forward", "auto"), problem)
    assert (recalled.algorithm, recalled.params) == (winner, params)
    chosen = tuner.select(AlgorithmFilter(CONV, "forward", "auto"), problem, must_not_run)
    assert chosen is recalled  # remembered, not looked up again
    assert tuner.measurements == 0


def test_a_layers_first_call_at_new_sizes_of_a_recalled_bucket_is_one_look_up(monkeypatch):
    problem = layer_problem(32, 64, 27, 200_000, 200_000)
    ship([problem])
    tuner = Tuner()
    recalled = tuner.recall(AlgorithmFilter(CONV, "forward", "auto"), problem)
    monkeypatch.setattr(tuner_module, "candidates", lambda *arguments: pytest.fail("searched the candidates"))
    new_scene = replace(problem, num_in=199_999, num_out=150_000)  # the same size buckets
    assert tuner_module.size_bucket(150_000) == tuner_module.size_bucket(200_000)
    assert tuner.select(AlgorithmFilter(CONV, "forward", "auto"), new_scene, must_not_run) is recalled


def test_recall_is_none_without_a_ranking_and_measures_and_writes_nothing(monkeypatch):
    # Before measuring a GPU problem the tuner asks CUDA whether a graph is being captured; none is here.
    monkeypatch.setattr(tuner_module, "_is_capturing", lambda problem: False)
    problem = layer_problem(32, 64, 27, 200_000, 200_000)
    tuner = Tuner()
    assert tuner.recall(AlgorithmFilter(CONV, "forward", "auto"), problem) is None
    assert tuner.measurements == 0
    assert default_cache().keys(FORWARD) == []
    with pytest.raises(NotMeasured):  # nothing was remembered in its place either
        tuner.select(AlgorithmFilter(CONV, "forward", "auto"), problem, must_not_run)


def test_recall_of_a_single_candidate_is_the_priority_rule():
    problem = layer_problem(32, 64, 27, 200_000, 200_000)
    search_space = parse_algorithm_filter("explicit_gemm", CONV, "forward")
    assert len(candidates(search_space, problem)) == 1
    recalled = Tuner().recall(search_space, problem)
    assert recalled.algorithm is get_algorithm("explicit_gemm")


def test_a_rehearsal_answers_its_choices_else_the_priority_rule_and_keeps_nothing(monkeypatch):
    monkeypatch.setattr(tuner_module, "_is_capturing", lambda problem: False)
    auto = AlgorithmFilter(CONV, "forward", "auto")
    layer, few_voxels = layer_problem(32, 64, 27, 2**18, 2**18), layer_problem(32, 64, 27, 512, 512)
    other_layer = layer_problem(64, 64, 27, 512, 512)
    old_gpu = ConvProblem(512, 512, 32, 64, 27, np.dtype(np.float16), "cuda", 70)  # mma.sync needs sm_80
    last = Selection(*candidates(auto, layer)[-1])
    assert last != rule_based_selection(auto, few_voxels)  # a choice the priority rule would not make
    mma = get_algorithm("mma_implicit_gemm")
    choices = {rehearsal_key(CONV, "forward", layer): [(layer, last)],
               rehearsal_key(CONV, "forward", old_gpu): [(old_gpu, Selection(mma, mma.default_params("forward")))]}
    tuner = Tuner()
    with rehearsal(choices):
        assert tuner.select(auto, few_voxels, must_not_run) is last  # the layer's choice, at other sizes
        assert tuner.select(auto, other_layer, must_not_run) == rule_based_selection(auto, other_layer)
        assert tuner.select(auto, old_gpu, must_not_run) == rule_based_selection(auto, old_gpu)
        assert tuner_module.rehearsing()
        elsewhere = []
        thread = threading.Thread(target=lambda: elsewhere.append(tuner_module.rehearsing()))
        thread.start()
        thread.join()
        assert elsewhere == [False]  # a rehearsal is its thread's alone
    assert not tuner_module.rehearsing()
    assert tuner.measurements == 0 and default_cache().keys(FORWARD) == []
    with pytest.raises(NotMeasured):  # nothing was remembered for the few voxels
        tuner.select(auto, few_voxels, must_not_run)


def test_a_stopped_rehearsal_raises_at_its_next_selection():
    stop = threading.Event()
    problem = layer_problem(32, 64, 27, 512, 512)
    with rehearsal({}, stop):
        Tuner().select(AlgorithmFilter(CONV, "forward", "auto"), problem, must_not_run)
        stop.set()
        with pytest.raises(RehearsalStopped):
            Tuner().select(AlgorithmFilter(CONV, "forward", "auto"), problem, must_not_run)


def test_the_choices_are_the_networks_layers_at_every_size_the_caches_rank():
    stem = layer_problem(3, 32, 27, 2**18, 2**18)
    down = layer_problem(32, 32, 8, 2**18, 2**16, stride=(2, 2, 2))
    shortcut = layer_problem(32, 64, 1, 2**14, 2**14)
    elsewhere = layer_problem(48, 48, 27, 2**18, 2**18)  # no layer of the network has these channels
    winners = ship([stem, layer_problem(3, 32, 27, 2**17, 2**17), down, shortcut, elsewhere])
    choices = prefetch.cached_choices(NETWORK, np.float16, 90)
    found = {(c.problem.in_channels, c.problem.out_channels, c.problem.kernel_volume, c.problem.num_in,
              c.problem.num_out): (c.selection.algorithm, c.selection.params) for c in choices}
    assert found == {
        (3, 32, 27, 2**18, 2**18): winners[0],
        (3, 32, 27, 2**17, 2**17): winners[1],
        (32, 32, 8, 2**18, 2**16): winners[2],
        (32, 64, 1, 2**14, 2**14): winners[3],
    }
    assert {c.phase for c in choices} == {"forward"}
    assert prefetch.cached_choices(NETWORK, np.float16, 80) == []  # another architecture's keys
    assert prefetch.cached_choices(NETWORK, np.float32, 90) == []


def test_the_choices_follow_the_phases_and_search_spaces_asked_for():
    stem = layer_problem(3, 32, 27, 2**18, 2**18)
    ship([stem], phase="backward")
    assert prefetch.cached_choices(NETWORK, np.float16, 90) == []
    (choice,) = prefetch.cached_choices(NETWORK, np.float16, 90, phases=("forward", "backward"))
    assert choice.phase == "backward"
    (single,) = prefetch.cached_choices(NETWORK, np.float16, 90, phases=("backward",),
                                        algorithms={"backward": "explicit_gemm"})
    assert single.selection.algorithm is get_algorithm("explicit_gemm")


def candidate_modules(problems, phase: str) -> set:
    return {source for problem in problems for algorithm, params in candidates(AlgorithmFilter(CONV, phase, "auto"),
                                                                                 problem)
            for source in algorithm.kernel_modules(phase, problem, params)}


def network_problems() -> list[ConvProblem]:
    """Each distinct convolution of NETWORK as a GPU problem, in the network's order."""
    problems = [layer_problem(conv.in_channels, conv.out_channels, conv.kernel_volume(), 2**12, 2**12,
                              (conv.stride,) * 3 if isinstance(conv.stride, int) else tuple(conv.stride),
                              conv.transposed) for _, conv in networks.convolutions(NETWORK)]
    return list(dict.fromkeys(problems))


def test_the_modules_started_for_the_tuner_are_every_candidates_of_the_layers_the_caches_do_not_know(monkeypatch):
    stem, *others = network_problems()
    assert (stem.in_channels, stem.kernel_volume) == (3, 27)
    ship([replace(stem, num_in=2**18, num_out=2**18)])
    choices = prefetch.cached_choices(NETWORK, np.float16, 90)
    started = prefetch.tuning_modules(NETWORK, np.float16, 90, choices)
    assert len(started) == len(set(started))
    assert set(started) == candidate_modules(others, "forward")
    assert set(started[:len(candidate_modules(others[:1], "forward"))]) == candidate_modules(others[:1], "forward")
    assert candidate_modules([stem], "forward") - set(started)  # the stem's own tiles, known: not started

    both = prefetch.tuning_modules(NETWORK, np.float16, 90, choices, phases=("forward", "backward"))
    assert both[:len(started)] == started
    assert set(both) == set(started) | candidate_modules([stem, *others], "backward")

    ship([replace(problem, num_in=2**18, num_out=2**18) for problem in [stem, *others]])
    shipped_cache.forget_shipped_caches()
    every_layer = prefetch.cached_choices(NETWORK, np.float16, 90)
    assert prefetch.tuning_modules(NETWORK, np.float16, 90, every_layer) == []
    assert prefetch.tuning_modules(NETWORK, np.float16, 90, [], algorithms={"forward": "explicit_gemm"}) == []
    monkeypatch.setenv("CUPYSPARSE_AUTOTUNE", "0")
    assert prefetch.tuning_modules(NETWORK, np.float16, 90, []) == []


def test_prefetching_refuses_unknown_phases_and_can_be_turned_off(monkeypatch):
    with pytest.raises(ValueError, match="phases"):
        prefetch.prefetch_kernels(NETWORK, np.float16, phases=("sideways",))
    monkeypatch.setenv(settings.PREFETCH.name, "0")
    assert prefetch.prefetch_kernels(NETWORK, np.float16) is None


@pytest.mark.gpu
@pytest.mark.gpu
def test_a_prefetch_stopped_before_it_starts_recalls_nothing_and_says_so():
    ship([layer_problem(3, 32, 27, 2**18, 2**18)])
    release = threading.Event()
    prefetch._worker().submit(release.wait)  # holds the one prefetch thread
    started = prefetch.prefetch_kernels(NETWORK, np.float16)
    started.stop()
    release.set()
    done = started.result(timeout=300)
    assert done.stopped and done.choices == 0
    unstopped = prefetch.prefetch_kernels(NETWORK, np.float16).result(timeout=300)
    assert not unstopped.stopped and unstopped.choices == 1


@pytest.mark.gpu
@pytest.mark.gpu
def test_a_network_rehearses_every_convolution_and_keeps_no_choice_for_the_few_voxels(monkeypatch):
    from cupysparse.networks.inference import InferenceNetwork

    stem = layer_problem(3, 32, 27, 2**18, 2**18)
    ship([stem])
    tuner = tuner_module.default_tuner()
    tuner.forget_choices()
    measured = tuner.measurements
    rehearsed = []
    selection = tuner_module._rehearsed_selection
    monkeypatch.setattr(tuner_module, "_rehearsed_selection",
                        lambda search_space, problem, *rest: rehearsed.append(problem)
                        or selection(search_space, problem, *rest))
    network = InferenceNetwork(NETWORK, networks.random_weights(NETWORK), "cuda", "float16")
    done = network.prefetched.result(timeout=300)
    assert done.rehearsed and not done.stopped and done.choices == 1
    layers = {(conv.in_channels, conv.out_channels, conv.kernel_volume()) for _, conv in networks.convolutions(NETWORK)}
    assert {(p.in_channels, p.out_channels, p.kernel_volume) for p in rehearsed} == layers
    assert all(p.num_in <= prefetch.REHEARSAL_EDGE**3 for p in rehearsed)
    assert tuner.measurements == measured
    few_voxels = next(p for p in rehearsed if (p.in_channels, p.kernel_volume) == (3, 27))
    with pytest.raises(NotMeasured):  # the rehearsal's choices were not remembered
        tuner.select(AlgorithmFilter(CONV, "forward", "auto"), few_voxels, must_not_run)


FRESH_PROCESS = textwrap.dedent("""
    import json
    from cupysparse.cuda import compile
    from cupysparse.networks import descriptions as networks
    from cupysparse.scripts.demo import scene_tensor
    from cupysparse.networks.inference import InferenceNetwork
    from cupysparse.data.scenes import INDOOR_CLASSES
    from cupysparse.geometry.sparse_tensor import SparseTensor
    from cupysparse.tuning.tuner import default_tuner

    description = networks.minkunet(18, 3, len(INDOOR_CLASSES))
    network = InferenceNetwork(description, networks.random_weights(description), "cuda", "float16")
    _, tensor, _ = scene_tensor("indoor", 200_000, 0, "cuda", "float16")
    done = network.prefetched.result()
    loads = len(compile.module_loads())
    from cupysparse.functional import execution
    selected, select = [], execution._selected_plan
    execution._selected_plan = lambda *arguments: selected.append(1) or select(*arguments)
    network(tensor)
    print(json.dumps({"choices": done.choices, "modules": done.modules, "rehearsed": done.rehearsed,
                      "loaded_by_forward": len(compile.module_loads()) - loads, "planned_by_forward": len(selected),
                      "measured": default_tuner().measurements}))
""")


@pytest.mark.gpu
@pytest.mark.gpu
def test_after_the_prefetch_the_first_forward_of_the_demo_scene_loads_and_measures_nothing(tmp_path):
    """The shipped file ranks the demo scene's sizes (the populate script measures them): the rehearsal kept
    every layer's plan at those sizes, so the first forward loads, measures, selects and plans nothing."""
    shipped_cache.forget_shipped_caches()
    environment = {key: value for key, value in os.environ.items() if not key.startswith("CUPYSPARSE_")}
    environment["CUPYSPARSE_BENCHMARK_CACHE_DIR"] = str(tmp_path / "user")
    result = subprocess.run([sys.executable, "-c", FRESH_PROCESS], env=environment, capture_output=True, text=True,
                            check=True, timeout=600)
    import json

    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["choices"] > 0 and report["modules"] > 0 and report["rehearsed"]
    assert report["loaded_by_forward"] == 0
    assert report["planned_by_forward"] == 0
    assert report["measured"] == 0


EMPTY_CACHES_PROCESS = textwrap.dedent("""
    import json
    from cupysparse.cuda import compile
    from cupysparse.networks import descriptions as networks
    from cupysparse.scripts.demo import scene_tensor
    from cupysparse.networks.inference import InferenceNetwork
    from cupysparse.data.scenes import INDOOR_CLASSES
    from cupysparse.tuning.tuner import default_tuner

    description = networks.minkunet(18, 3, len(INDOOR_CLASSES))
    network = InferenceNetwork(description, networks.random_weights(description), "cuda", "float16")
    done = network.prefetched.result()
    _, tensor, _ = scene_tensor("indoor", 20_000, 0, "cuda", "float16")
    compiled_by_forward = []
    compile_for_forward = compile.nvrtc_compile
    compile.nvrtc_compile = lambda source, option: compiled_by_forward.append(source.filename) or compile_for_forward(
        source, option)
    network(tensor)
    print(json.dumps({"tuning_modules": done.tuning_modules, "compiled_by_forward": compiled_by_forward,
                      "measured": default_tuner().measurements}))
""")


@pytest.mark.gpu
@pytest.mark.gpu
def test_with_empty_caches_the_first_forward_tunes_with_modules_the_prefetch_started(tmp_path):
    environment = {key: value for key, value in os.environ.items() if not key.startswith("CUPYSPARSE_")}
    environment.update(CUPYSPARSE_BENCHMARK_CACHE_DIR=str(tmp_path / "user"), CUPYSPARSE_SHIPPED_CACHE="0",
                       CUPY_CACHE_DIR=str(tmp_path / "kernels"))
    result = subprocess.run([sys.executable, "-c", EMPTY_CACHES_PROCESS], env=environment, capture_output=True,
                            text=True, check=True, timeout=600)
    import json

    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["tuning_modules"] > 0 and report["measured"] > 0
    assert report["compiled_by_forward"] == []
