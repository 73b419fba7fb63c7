"""The autotuner: measures the candidate algorithms of a convolution on the user's device, keeps
the results in the persistent benchmark cache, and runs the winner.

A search space (`search_space.AlgorithmFilter`) gives the candidates: one algorithm → its parameter
grid; a list → every listed algorithm's grid; `all` → every algorithm that supports the problem; `auto`
→ a reduced set, the supported algorithms of the highest `auto_priority` with their `auto_param_grid`
(channel-dependent). Both come from measurements (the algorithms' docstrings give them): tensor cores
won every fp16 layer from 32 to 256 channels (5-40x ahead of the next algorithm, H200); in fp32, SIMT
implicit GEMM wins narrow layers and cuBLAS explicit GEMM wide ones. The reference still runs once, for
the check.

On a GPU, the kernel modules of every candidate to measure (`Algorithm.kernel_modules`) are first
compiled side by side (`compile.prepare`), not one after the other at each candidate's first launch.
Each candidate's first run is compared with the reference algorithm (`explicit_gemm`) and timed
(`measurement`); a candidate that fails to compile, runs out of memory or gives a different answer is
skipped with a logged reason, and if all fail the reference runs. The results are stored best-first
under a key of
the problem's shape, dtype (and TF32 use) and device architecture, so caches of different GPUs never
match: each algorithm's parameter sweep in its own namespace (`Algorithm.tuning_namespace`), every
candidate of the key in the phase namespace (`NAMESPACES`). Tuning never runs inside CUDA-graph capture.
`CUPYSPARSE_AUTOTUNE=0` turns measuring off (the priority rule decides).

What a moment or a machine may not repeat is not stored: a measurement during which memory ran
short, one in which every candidate but the reference raised (a compile error, say), and an
algorithm whose every candidate raised; each is warned about once per process. A wrong answer is
a result, and stored. A reference result holding inf (the exact sum is out of the dtype's range:
an overflow) or NaN checks nothing: the candidates are skipped, the reference's result is the
call's, and the next call tunes again.

Cached results this version cannot use, written by a newer or older cupysparse sharing the file
(an algorithm it does not know, a parameter that algorithm does not take), are skipped one by one
with one warning per process; the other results of their entry serve as usual.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections import Counter
from typing import Mapping, Sequence

import numpy as np

from cupysparse.tuning.search_space import ALL, AUTO, AlgorithmFilter
from cupysparse.algorithms import CONV, DEPTHWISE, Algorithm, ConvProblem, get_algorithm, reference_algorithm, registered
from cupysparse.cuda.backend import cupy_module
from cupysparse.cuda.compile import prepare, source_digest
from cupysparse.cuda.timing import WAIT_KERNELS
from cupysparse import settings
from cupysparse.cuda.precision import TF32
from cupysparse.tuning.measurement import Measurement, measure, params_key
from cupysparse.tuning.search_space import Selection, candidates, describe_problem, rule_based_selection
from cupysparse.tuning.shipped import tuning_cache

log = logging.getLogger("cupysparse.tuning")

NAMESPACES = {
    (CONV, "forward"): "sparse_conv_forward",
    (CONV, "backward"): "sparse_conv_backward",
    (DEPTHWISE, "forward"): "sparse_conv_depthwise_forward",
    (DEPTHWISE, "backward"): "sparse_conv_depthwise_backward",
}
def tuning_enabled() -> bool:
    return settings.autotune()


def size_bucket(count: int) -> int:
    """ceil(log2(count)), 0 for 0 and 1: the sizes the tuner tells apart."""
    return max(count - 1, 0).bit_length()


# The entries of a tuning key that hold the problem's sizes, as `size_bucket`s.
SIZE_KEY_NAMES = ("log_num_in_coords", "log_num_out_coords")


def sizeless_key(key) -> tuple:
    """A tuning key without its sizes, in a stable order: what the keys of one layer at every size share."""
    return tuple(sorted(pair for pair in key if pair[0] not in SIZE_KEY_NAMES))


def tuning_key(problem: ConvProblem) -> tuple[tuple[str, object], ...]:
    """What identifies a tuning result: sizes as ceil(log2), channels, kernel volume, dtype, the
    device architecture, and what else changes the work."""
    device = "cpu" if problem.compute_capability is None else f"sm_{problem.compute_capability}"
    return (
        (SIZE_KEY_NAMES[0], size_bucket(problem.num_in)),
        (SIZE_KEY_NAMES[1], size_bucket(problem.num_out)),
        ("in_channels", problem.in_channels),
        ("out_channels", problem.out_channels),
        ("kernel_volume", problem.kernel_volume),
        ("in_dtype", np.dtype(problem.dtype).name),
        ("compute_capability", device),
        ("stride", tuple(problem.stride)),
        ("transposed", problem.transposed),
        ("generative", problem.generative),
    ) + ((("fp32_precision", TF32),) if problem.tf32 else ())


def prepare_kernels(pool, phase: str, problem: ConvProblem) -> None:
    """Load the kernel modules the candidates of `pool` launch from, those not loaded yet compiled
    side by side (`compile.prepare`): measured one after the other, each candidate's first launch
    would compile its module alone."""
    sources = [source for algorithm, params in pool for source in algorithm.kernel_modules(phase, problem, params)]
    prepare([*sources, WAIT_KERNELS])


def _is_capturing(problem: ConvProblem) -> bool:
    return problem.device == "cuda" and cupy_module().cuda.get_current_stream().is_capturing()


class RehearsalStopped(Exception):
    """What `select` raises inside a `rehearsal` once the rehearsal's stop event is set."""


# This thread's rehearsal, (choices by size, stop event), while one runs (`rehearsal`).
_rehearsal = threading.local()


def rehearsing() -> bool:
    """Whether this thread is inside a `rehearsal`: a network run ahead of its first call on a
    few voxels, whose results nobody reads. Layers with state (batch norms) change none there."""
    return getattr(_rehearsal, "state", None) is not None


def rehearsal_key(kind: str, phase: str, problem: ConvProblem) -> tuple:
    """What a `rehearsal` looks a problem's choice up by: its kind, phase and sizeless tuning key."""
    return kind, phase, sizeless_key(tuning_key(problem))


def rehearsing_sizes() -> bool:
    """Whether this thread is inside a `rehearsal` given any choice (`rehearsed_sizes`)."""
    state = getattr(_rehearsal, "state", None)
    return state is not None and bool(state[0])


def rehearsed_sizes(kind: str, phase: str, problem: ConvProblem) -> tuple:
    """Inside a `rehearsal`: the (problem at a size, choice) pairs it holds for `problem`'s layer, the sizes the
    caches rank it at (a real call's); empty elsewhere."""
    state = getattr(_rehearsal, "state", None)
    return () if state is None else tuple(state[0].get(rehearsal_key(kind, phase, problem), ()))


def _rehearsed_selection(search_space: AlgorithmFilter, problem: ConvProblem, choices: Mapping,
                         stop: threading.Event | None) -> Selection:
    if stop is not None and stop.is_set():
        raise RehearsalStopped
    sized = choices.get(rehearsal_key(search_space.kind, search_space.phase, problem))
    chosen = sized[-1][1] if sized else None  # the largest size's
    if chosen is not None and chosen.algorithm.supports(problem):
        return chosen
    algorithms = list(dict.fromkeys(algorithm for algorithm, _ in candidates(search_space, problem)))
    return rule_based_selection(search_space, problem, algorithms or None)  # None: raises, naming the choices


@contextlib.contextmanager
def rehearsal(choices: Mapping[tuple, Sequence[tuple[ConvProblem, Selection]]], stop: threading.Event | None = None):
    """On this thread, while inside: every tuner's `select` answers a problem with the choice `choices` holds
    for its layer (keyed by `rehearsal_key`: the layer's (problem at a size, choice) pairs, smallest size
    first; the largest size's) where that algorithm supports it, else by the priority rule. It measures,
    writes and remembers nothing, and raises `RehearsalStopped` once `stop` is set. A network's rehearsal
    (`cupysparse.networks.prefetch`) runs inside, on a tensor of its own (whose maps alone remember the
    plans selected there): its layers' recalled choices, made for their real sizes, run on a few voxels, and
    its layers keep their plans for those sizes (`rehearsed_sizes`)."""
    previous = getattr(_rehearsal, "state", None)
    _rehearsal.state = (choices, stop)
    try:
        yield
    finally:
        _rehearsal.state = previous


class Tuner:
    """Chooses, measuring once per problem key and remembering the answer in `cache`.

    Each algorithm's parameter sweep is kept in its own namespace (`Algorithm.tuning_namespace`),
    so a later search space that adds algorithms measures only those; the phase namespace
    (`NAMESPACES`) keeps every measured candidate of the key best-first, across algorithms.
    """

    def __init__(self, cache=None, measure_single_candidates: bool = False):
        """`measure_single_candidates`: also time (and cache) a problem with one candidate, which
        normal calls skip; the populate script uses it so every configuration gets an entry."""
        self._cache = cache
        self._measure_single = measure_single_candidates
        # By filter, tuning key and whether candidates are measured: the candidates depend on the key alone,
        # not on the exact sizes, so a layer's call at new sizes of a known bucket (a new scene's) looks its
        # choice up here, and `recall` answers it ahead. Everything else a choice depends on is in the key:
        # the algorithm filter (an environment variable's, for None), TF32 use, measuring or not.
        self._choices: dict[tuple, Selection] = {}
        self.measurements = 0  # times candidates were benchmarked: what a populated cache saves
        self._reported: set = set()  # topics `_warn_once` has warned about in this process

    @property
    def cache(self):
        return self._cache if self._cache is not None else tuning_cache()

    def forget_choices(self) -> None:
        """Drop the choices remembered in this process; the next call of each problem looks in the
        cache again (and measures what it lacks), and so do the plans layers keep (`settings.changed`)."""
        self._choices.clear()
        settings.changed()

    def select(self, search_space: AlgorithmFilter, problem: ConvProblem, run=None) -> Selection:
        """The algorithm and parameters for `problem`; `run(algorithm, params)` executes one
        candidate on the call's real data (None: decide by the priority rule, measuring nothing)."""
        rehearsal = getattr(_rehearsal, "state", None)
        if rehearsal is not None:
            return _rehearsed_selection(search_space, problem, *rehearsal)
        measured = run is not None and tuning_enabled()
        key = tuning_key(problem)
        remembered = self._choices
        chosen = remembered.get((search_space, key, measured))
        if chosen is None:
            chosen, remember = self._keyed_selection(search_space, problem, key, run if measured else None)
            if remember:
                remembered[(search_space, key, measured)] = chosen
        if not chosen.algorithm.capturable and _is_capturing(problem):
            return self._capturable_selection(search_space, problem)
        return chosen

    def _capturable_selection(self, search_space: AlgorithmFilter, problem: ConvProblem) -> Selection:
        """During CUDA-graph capture, in place of a choice capture cannot record: the fastest
        capturable candidate measured for the problem, else the priority rule among them (for
        `auto`, among every algorithm when none of the first priority is capturable)."""
        pool = [(a, p) for a, p in candidates(search_space, problem) if a.capturable]
        if not pool and search_space.mode == AUTO:
            everything = AlgorithmFilter(search_space.kind, search_space.phase, ALL)
            pool = [(a, p) for a, p in candidates(everything, problem) if a.capturable]
        if not pool:
            algorithms = registered(search_space.kind).values()
            recordable = [a.name for a in algorithms if a.capturable and a.supports(problem)]
            raise RuntimeError(
                f"CUDA-graph capture cannot record the {search_space.phase} algorithms {search_space.candidates()} "
                f"({describe_problem(problem)}): explicit GEMMs are cuBLAS calls through CuPy, which CuPy refuses "
                f"during capture. Capture with one of {recordable}, or `auto`."
            )
        entry = self.cache.get(NAMESPACES[(search_space.kind, search_space.phase)], tuning_key(problem))
        allowed = {(a.name, params_key(p)) for a, p in pool}
        for name, params, _ in self._usable_results(entry, search_space.kind, search_space.phase):
            if (name, params_key(params)) in allowed:
                return Selection(get_algorithm(name, search_space.kind), dict(params))
        return rule_based_selection(search_space, problem, list(dict.fromkeys(a for a, _ in pool)))

    def recall(self, search_space: AlgorithmFilter, problem: ConvProblem) -> Selection | None:
        """What `select` answers for `problem` with a run to measure, without measuring or writing
        anything: the priority rule where it applies, else the fastest candidate of the caches' phase
        ranking (what a process that measured the problem, or the shipped file, recorded), remembered
        as `select` remembers it. None where the caches do not rank every candidate. What loads a
        network's kernels ahead of its first call (`cupysparse.networks.prefetch`) asks."""
        key = tuning_key(problem)
        remembered = self._choices
        measured = tuning_enabled()  # as `select` with a run remembers it
        chosen = remembered.get((search_space, key, measured))
        if chosen is not None:
            return chosen
        pool = candidates(search_space, problem)
        if not pool:
            return None
        chosen = (self._unmeasured_selection(search_space, problem, pool, run_given=True)
                  or self._recorded_selection(search_space, key, _sweeps(pool)))
        if chosen is not None:
            remembered[(search_space, key, measured)] = chosen
        return chosen

    def candidates_to_measure(self, search_space: AlgorithmFilter, problem: ConvProblem
                              ) -> list[tuple[Algorithm, dict]]:
        """The candidates `select` with a run measures for `problem` where no cache ranks them; none
        where it decides without measuring (a single candidate, tuning turned off)."""
        pool = candidates(search_space, problem)
        if not pool or self._unmeasured_selection(search_space, problem, pool, run_given=True) is not None:
            return []
        return pool

    def _unmeasured_selection(self, search_space: AlgorithmFilter, problem: ConvProblem, pool,
                              run_given: bool) -> Selection | None:
        """The priority rule's selection where nothing is to be measured: no run, a single candidate
        (unless measuring those), or tuning turned off. None: the caches or a measurement decide."""
        if not run_given or (len(pool) == 1 and not self._measure_single) or not tuning_enabled():
            return rule_based_selection(search_space, problem, list(dict.fromkeys(a for a, _ in pool)))
        return None

    def _keyed_selection(self, search_space: AlgorithmFilter, problem: ConvProblem, key, run
                         ) -> tuple[Selection, bool]:
        """The selection for a filter and tuning key met for the first time (measuring through `run`,
        None: the priority rule), and whether this process may remember it for the key (not when the data
        of this call could check nothing: the next call's may)."""
        pool = candidates(search_space, problem)
        if not pool:
            return rule_based_selection(search_space, problem), True  # raises, listing the valid choices
        unmeasured = self._unmeasured_selection(search_space, problem, pool, run is not None)
        if unmeasured is not None:
            return unmeasured, True
        return self._tuned(search_space, problem, key, pool, run)

    def _recorded_selection(self, search_space: AlgorithmFilter, key, sweeps: dict[Algorithm, list[dict]]
                            ) -> Selection | None:
        """The fastest candidate of the phase namespace's ranking of these sweeps (`_recorded_ranking`)."""
        recorded = self._recorded_ranking(search_space, key, sweeps)
        if not recorded:
            return None
        name, params, _ = recorded[0]
        return Selection(get_algorithm(name, search_space.kind), params)

    def _tuned(self, search_space: AlgorithmFilter, problem: ConvProblem, key, pool, run) -> tuple[Selection, bool]:
        """Measure what the cache lacks and choose. A measurement is cached unless memory ran
        short, every candidate but the reference raised, or nothing could be checked; an algorithm
        whose every candidate raised is never cached as failed (a broken install, say, may be
        repaired). Those failures are warned about once per process."""
        phase, kind = search_space.phase, search_space.kind
        keep = True
        sweeps = _sweeps(pool)
        recorded = self._recorded_selection(search_space, key, sweeps)
        if recorded is not None:
            return recorded, True
        known = {algorithm: self._cached_sweep(algorithm, kind, phase, key, wanted)
                 for algorithm, wanted in sweeps.items()}
        unknown = [algorithm for algorithm, results in known.items() if results is None]
        if unknown:
            if _is_capturing(problem):
                raise RuntimeError(
                    f"cupysparse would have to benchmark {[a.name for a in unknown]} ({phase}) for {dict(key)} "
                    "during CUDA-graph capture; run the step once before capturing (or populate the benchmark "
                    "cache) so the choice is cached"
                )
            begin = time.perf_counter()
            self.measurements += 1
            measured = [(a, p) for a in unknown for p in sweeps[a]]
            if problem.device == "cuda":
                prepare_kernels(measured, phase, problem)
            measurement = measure(measured, run, problem, reference_algorithm(kind))
            log.info(
                "tuned %s %s in %.0f ms: %s",
                NAMESPACES[(kind, phase)],
                dict(key),
                (time.perf_counter() - begin) * 1e3,
                measurement.results[:3],
            )
            if measurement.unchecked is not None:
                return self._unchecked_selection(search_space, problem, pool, measurement)
            keep = not measurement.short_of_memory and not measurement.every_candidate_raised(reference_algorithm(kind).name)
            always_raised = measurement.algorithms_that_always_raised()
            for algorithm in unknown:
                known[algorithm] = [result for result in measurement.results if result[0] == algorithm.name]
                if keep and algorithm.name not in always_raised:
                    self.cache.put(algorithm.tuning_namespace(phase), key, known[algorithm], _sources([algorithm]))
            self._report_failures(search_space, problem, measurement)
        ranking = sorted((result for results in known.values() for result in results), key=lambda r: r[2])
        if keep:
            self._record_ranking(search_space, key, ranking)
        if not ranking:
            reference = reference_algorithm(kind)
            return Selection(reference, reference.default_params(phase)), True
        name, params, _ = ranking[0]
        return Selection(get_algorithm(name, kind), params), True

    def _unchecked_selection(self, search_space: AlgorithmFilter, problem: ConvProblem, pool,
                             measurement: Measurement) -> tuple[Selection, bool]:
        """When the reference could check nothing. Out of memory: the priority rule among the
        other candidates, kept for the process (the reference would run out again). inf or NaN
        in its result: the reference itself, for this call only (the next call's data may tune)."""
        kind, phase = search_space.kind, search_space.phase
        reference = reference_algorithm(kind)
        namespace = NAMESPACES[(kind, phase)]
        if measurement.short_of_memory:
            others = [algorithm for algorithm in dict.fromkeys(a for a, _ in pool) if algorithm is not reference]
            chosen = (rule_based_selection(search_space, problem, others) if others
                      else Selection(reference, reference.default_params(phase)))
            self._warn_once(
                ("reference out of memory", namespace, tuning_key(problem)),
                f"cupysparse: tuning {namespace} for {_describe(problem)}: {measurement.unchecked}; "
                f"{chosen.algorithm.name} runs unmeasured and nothing is cached (the next process measures again)",
            )
            return chosen, True
        self._warn_once(
            ("reference not finite", namespace, tuning_key(problem)),
            f"cupysparse: tuning {namespace} for {_describe(problem)}: {measurement.unchecked}. "
            f"{reference.name} runs; nothing is measured or cached, and the next call tunes again",
        )
        return Selection(reference, reference.default_params(phase)), False

    def _report_failures(self, search_space: AlgorithmFilter, problem: ConvProblem, measurement: Measurement):
        """One warning per process for each set of errors: algorithms that could not run (every
        candidate raised), and candidates that ran out of memory."""
        namespace = NAMESPACES[(search_space.kind, search_space.phase)]
        reference = reference_algorithm(search_space.kind).name
        failed = measurement.algorithms_that_always_raised()
        errors = "; ".join(f"{name}: {' | '.join(texts)}" for name, texts in failed.items())
        if measurement.every_candidate_raised(reference):
            self._warn_once(
                ("every candidate raised", errors),
                f"cupysparse: no {namespace} candidate could run for {_describe(problem)}, so {reference} runs. "
                f"{errors}. Nothing is cached: the next process tries them again",
            )
            return
        if failed:
            self._warn_once(
                ("could not run", errors),
                f"cupysparse: {', '.join(failed)} could not run for {_describe(problem)} and "
                f"{'is' if len(failed) == 1 else 'are'} left out of the choice. {errors}. Not cached as failed: "
                "the next process tries again",
            )
        if measurement.short_of_memory:
            self._warn_once(
                ("out of memory",),
                f"cupysparse: while tuning {namespace} for {_describe(problem)} some candidates ran out of memory "
                "and were skipped; the choice holds for this process and is not cached (the next process "
                "measures again). Later problems short of memory are only logged",
            )

    def _warn_once(self, topic: tuple, message: str) -> None:
        """A RuntimeWarning the first time `topic` comes up in this process; later, a log line."""
        if topic in self._reported:
            log.info("%s", message)
            return
        self._reported.add(topic)
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    def _cached_sweep(self, algorithm: Algorithm, kind: str, phase: str, key, wanted: list[dict]) -> list | None:
        """The cached results of `wanted` parameters of `algorithm`, [] when its whole sweep failed,
        None when it must be measured."""
        entry = self.cache.get(algorithm.tuning_namespace(phase), key)
        if entry is None:
            return None
        if not entry.results:
            return []
        wanted_keys = {params_key(params) for params in wanted}
        found = [result for result in self._usable_results(entry, kind, phase) if params_key(result[1]) in wanted_keys]
        return found or None  # swept other parameters than these: sweep again

    def _recorded_ranking(self, search_space: AlgorithmFilter, key, sweeps: dict[Algorithm, list[dict]]
                          ) -> list | None:
        """The phase namespace's ranking of these candidates, when it holds results of every algorithm
        of the pool (a process that measured them recorded it): one cache read where the algorithms'
        own entries take one each, which is most of a first call's look-up with warm caches. None
        sends the look-up through the algorithms' entries."""
        entry = self.cache.get(NAMESPACES[(search_space.kind, search_space.phase)], key)
        if entry is None:
            return None
        wanted = {(algorithm.name, params_key(params)) for algorithm, sweep in sweeps.items() for params in sweep}
        usable = self._usable_results(entry, search_space.kind, search_space.phase)
        ranking = [result for result in usable if (result[0], params_key(result[1])) in wanted]
        if {name for name, _, _ in ranking} != {algorithm.name for algorithm in sweeps}:
            return None
        return ranking

    def _record_ranking(self, search_space: AlgorithmFilter, key, ranking: list) -> None:
        """Add `ranking` to the phase namespace's entry of `key`, unless it holds all of it already. Results
        of the entry this version cannot use are left out: it cannot name their kernel sources, and the
        version that measured them keeps them in its algorithms' own namespaces."""
        kind = search_space.kind
        namespace = NAMESPACES[(kind, search_space.phase)]
        entry = self.cache.get(namespace, key)
        previous = self._usable_results(entry, kind, search_space.phase)
        recorded = {(name, params_key(params)): time_ms for name, params, time_ms in previous}
        if entry is not None and all(recorded.get((n, params_key(p))) == t for n, p, t in ranking):
            return
        ranked = {(name, params_key(params)) for name, params, _ in ranking}
        merged = ranking + [r for r in previous if (r[0], params_key(r[1])) not in ranked]
        algorithms = [get_algorithm(name, kind) for name in dict.fromkeys(r[0] for r in merged)]
        self.cache.put(namespace, key, merged, _sources(algorithms))

    def _usable_results(self, entry, kind: str, phase: str) -> list:
        """The results of `entry` (none for None) this version can use in `phase`: of an algorithm of `kind`
        it knows, with parameters that algorithm takes, each value one that can name a configuration. The
        others (a newer or older cupysparse's) are skipped, with one warning per process."""
        if entry is None:
            return []
        known = registered(kind)
        usable, unknown_algorithms, unknown_parameters = [], Counter(), Counter()
        for result in entry.results:
            name, params, _ = result
            if name not in known:
                unknown_algorithms[name] += 1
            elif not _takes(known[name], phase, params):
                unknown_parameters[name] += 1
            else:
                usable.append(result)
        if unknown_algorithms or unknown_parameters:
            self._warn_once(("unusable cached results",), _describe_unusable(entry, unknown_algorithms,
                                                                          unknown_parameters))
        return usable


def _describe(problem: ConvProblem) -> str:
    return f"{describe_problem(problem)}, {problem.num_in:,} -> {problem.num_out:,} rows"


def _takes(algorithm: Algorithm, phase: str, params: dict) -> bool:
    """Whether `params` are parameters of `algorithm` in `phase`, with values that can name a configuration
    (`params_key` hashes them)."""
    space = algorithm.forward_params if phase == "forward" else algorithm.backward_params
    if not set(params) <= set(space):
        return False
    try:
        hash(params_key(params))
    except TypeError:  # a map as a value, say
        return False
    return True


def _describe_unusable(entry, unknown_algorithms: Counter, unknown_parameters: Counter) -> str:
    reasons = []
    if unknown_algorithms:
        reasons.append(f"{sum(unknown_algorithms.values())} of algorithms this version does not know "
                       f"({', '.join(sorted(unknown_algorithms))})")
    if unknown_parameters:
        reasons.append(f"{sum(unknown_parameters.values())} with parameters their algorithm does not take "
                       f"({', '.join(sorted(unknown_parameters))})")
    skipped = sum(unknown_algorithms.values()) + sum(unknown_parameters.values())
    return (f"cupysparse: skipped {skipped} of the {len(entry.results)} results cached in {entry.namespace} for "
            f"{dict(entry.key)}: {'; '.join(reasons)}. A newer or older cupysparse sharing the benchmark cache may "
            "have written them; the other results serve, and later such results are only logged")


def _sweeps(pool) -> dict[Algorithm, list[dict]]:
    """The candidates of `pool` by algorithm: each algorithm's parameter sweep."""
    sweeps: dict[Algorithm, list[dict]] = {}
    for algorithm, params in pool:
        sweeps.setdefault(algorithm, []).append(params)
    return sweeps


def _sources(algorithms) -> set[tuple[str, str]]:
    return {(filename, source_digest(filename)) for algorithm in algorithms for filename in algorithm.kernel_sources}


_default_tuner = Tuner()


def default_tuner() -> Tuner:
    return _default_tuner


def select_algorithm(search_space: AlgorithmFilter, problem: ConvProblem, run=None) -> Selection:
    """The one decision point of the library: see `Tuner.select`."""
    return _default_tuner.select(search_space, problem, run)
