"""The autotuner: measures the candidate algorithms of a convolution on the user's device, keeps
the results in the persistent benchmark cache, and runs the winner.

A search space (`AlgorithmFilter`) gives the candidates: one algorithm → its parameter grid; a
list → every listed algorithm's grid; `all` → every algorithm that supports the problem; `auto` →
a reduced set, the supported algorithms of the highest `auto_priority` with their
`auto_param_grid` (channel-dependent). Both come from measurements (see
`notes/conv_performance.md` and the algorithms' docstrings): tensor cores won every fp16 layer
from 32 to 256 channels (5-40x ahead of the next algorithm, H200); in fp32, SIMT implicit GEMM wins narrow
layers and cuBLAS explicit GEMM wide ones. The reference still runs once, for the check.

Each candidate's first run is compared with `explicit_gemm`; a candidate that fails to compile,
runs out of memory or gives a different answer is skipped with a logged reason, and if all fail
`explicit_gemm` runs. The rest are timed (CUDA events on the GPU, the host clock on the CPU: the
checked run is the warm-up, then the median of several runs) and stored best-first under a key of
the problem's shape, dtype (and TF32 use) and device architecture, so caches of different GPUs never
match: each algorithm's parameter sweep in its own namespace (`Algorithm.tuning_namespace`), every
candidate of the key in the phase namespace (`NAMESPACES`). Tuning never runs inside CUDA-graph capture.
`CUPYSPARSE_AUTOTUNE=0` turns measuring off (the priority rule decides).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from .algorithm_modes import ALL, AUTO, AlgorithmFilter
from .algorithms import CONV, DEPTHWISE, Algorithm, ConvProblem, get_algorithm, registered
from .backend import array_module, cupy_module, is_cupy_array
from .compile import source_digest
from .dtypes import accumulation_dtype
from .precision import TF32, get_fp32_precision
from .selection import Selection, describe_problem, rule_based_selection
from .shipped_cache import tuning_cache

log = logging.getLogger("cupysparse.tuner")

NAMESPACES = {
    (CONV, "forward"): "sparse_conv_forward",
    (CONV, "backward"): "sparse_conv_backward",
    (DEPTHWISE, "forward"): "sparse_conv_depthwise_forward",
    (DEPTHWISE, "backward"): "sparse_conv_depthwise_backward",
}
REFERENCE = {CONV: "explicit_gemm", DEPTHWISE: "explicit"}
WARMUP_RUNS = 1
TIMED_RUNS = 3
# Largest |candidate - reference| accepted, relative to max |reference|: far above rounding
# (fp32 accumulation, one rounding to the output dtype), far below a wrong pair or layout.
AGREEMENT = {"float64": 1e-9, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2, "tf32": 1e-2}
# Values in a dtype's subnormal range carry an absolute rounding error of a few of these steps however
# exact the algorithm (fp16 gradients of a mean over 10⁴ voxels live there); the check allows 16 of them.
SUBNORMAL_STEP = {"float64": 2.0**-1074, "float32": 2.0**-149, "float16": 2.0**-24, "bfloat16": 2.0**-133}
SUBNORMAL_STEPS_ALLOWED = 16


def tuning_enabled() -> bool:
    return os.environ.get("CUPYSPARSE_AUTOTUNE", "1").strip().lower() not in ("0", "false", "off", "no")


def size_bucket(count: int) -> int:
    """ceil(log2(count)), 0 for 0 and 1: the sizes the tuner tells apart."""
    return max(count - 1, 0).bit_length()


def tuning_key(problem: ConvProblem) -> tuple[tuple[str, object], ...]:
    """What identifies a tuning result: sizes as ceil(log2), channels, kernel volume, dtype, the
    device architecture, and what else changes the work."""
    device = "cpu" if problem.compute_capability is None else f"sm_{problem.compute_capability}"
    return (
        ("log_num_in_coords", size_bucket(problem.num_in)),
        ("log_num_out_coords", size_bucket(problem.num_out)),
        ("in_channels", problem.in_channels),
        ("out_channels", problem.out_channels),
        ("kernel_volume", problem.kernel_volume),
        ("in_dtype", np.dtype(problem.dtype).name),
        ("compute_capability", device),
        ("stride", tuple(problem.stride)),
        ("transposed", problem.transposed),
        ("generative", problem.generative),
    ) + ((("fp32_precision", TF32),) if problem.tf32 else ())


def candidates(search_space: AlgorithmFilter, problem: ConvProblem) -> list[tuple[Algorithm, dict]]:
    """(algorithm, params) pairs to measure, in a stable order."""
    supported = [get_algorithm(name, search_space.kind) for name in search_space.candidates()]
    supported = [algorithm for algorithm in supported if algorithm.supports(problem)]
    phase = search_space.phase
    if search_space.mode == AUTO and supported:
        top = max(algorithm.auto_priority(problem) for algorithm in supported)
        return [
            (algorithm, params)
            for algorithm in supported
            if algorithm.auto_priority(problem) == top
            for params in algorithm.auto_param_grid(phase, problem)
        ]
    return [(algorithm, params) for algorithm in supported for params in algorithm.param_grid(phase)]


def _synchronize(result) -> None:
    if is_cupy_array(result) or (isinstance(result, tuple) and any(is_cupy_array(r) for r in result)):
        cupy_module().cuda.get_current_stream().synchronize()


def median_time_ms(run, on_gpu: bool, warmup: int = WARMUP_RUNS, repeats: int = TIMED_RUNS) -> float:
    """Median of `repeats` timed calls of `run` after `warmup` untimed ones."""
    for _ in range(warmup):
        run()
    samples = []
    if on_gpu:
        cupy = cupy_module()
        cupy.cuda.get_current_stream().synchronize()
        for _ in range(repeats):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            run()
            stop.record()
            stop.synchronize()
            samples.append(cupy.cuda.get_elapsed_time(start, stop))
    else:
        for _ in range(repeats):
            begin = time.perf_counter()
            _synchronize(run())
            samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples)


def _as_tuple(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def disagreement(result, reference, dtype, tf32: bool = False) -> str | None:
    """Why `result` is not `reference` within `AGREEMENT` for `dtype` (for TF32 products when
    `tf32`), or None. Computed where the arrays live, so only a few scalars cross to the host."""
    tolerance = AGREEMENT[TF32 if tf32 else np.dtype(dtype).name]
    floor = SUBNORMAL_STEPS_ALLOWED * SUBNORMAL_STEP[np.dtype(dtype).name]
    for got, expected in zip(_as_tuple(result), _as_tuple(reference)):
        if got is None and expected is None:
            continue
        if got.shape != expected.shape:
            return f"shape {tuple(got.shape)} instead of {tuple(expected.shape)}"
        if expected.size == 0:
            continue
        xp = array_module(expected)
        wide = accumulation_dtype(dtype)
        got, expected = got.astype(wide), expected.astype(wide)
        finite = xp.isfinite(expected)
        if not bool(xp.array_equal(xp.isfinite(got), finite)):
            return "non-finite values where the reference has finite ones (overflow?)"
        scale = float(xp.where(finite, xp.abs(expected), 0).max())
        error = float(xp.where(finite, xp.abs(got - expected), 0).max())
        if error > tolerance * scale + floor:
            return f"differs from the reference answer by {error:.3g} (max |reference| {scale:.3g})"
    return None


def _is_capturing(problem: ConvProblem) -> bool:
    return problem.device == "cuda" and cupy_module().cuda.get_current_stream().is_capturing()


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
        self._chosen: dict[tuple, Selection] = {}  # by tuning key and candidate pool
        self._by_call: dict[tuple, Selection] = {}  # by filter and exact problem: a repeated call's one look-up
        self.measurements = 0  # times candidates were benchmarked: what a populated cache saves
        self.generation = 0  # bumped whenever remembered choices are dropped

    @property
    def cache(self):
        return self._cache if self._cache is not None else tuning_cache()

    def forget_choices(self) -> None:
        """Drop the choices remembered in this process; the next call of each problem looks in the
        cache again (and measures what it lacks)."""
        self._chosen.clear()
        self._by_call.clear()
        self.generation += 1

    def select(self, search_space: AlgorithmFilter, problem: ConvProblem, run=None) -> Selection:
        """The algorithm and parameters for `problem`; `run(algorithm, params)` executes one
        candidate on the call's real data (None: decide by the priority rule, measuring nothing)."""
        call_key = (search_space, problem, run is None, tuning_enabled())
        chosen = self._by_call.get(call_key)
        if chosen is None:
            chosen = self._by_call[call_key] = self._select(search_space, problem, run)
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
        allowed = {(a.name, _params_key(p)) for a, p in pool}
        for name, params, _ in entry.results if entry is not None else ():
            if (name, _params_key(params)) in allowed:
                return Selection(get_algorithm(name, search_space.kind), dict(params))
        return rule_based_selection(search_space, problem, list(dict.fromkeys(a for a, _ in pool)))

    def _select(self, search_space: AlgorithmFilter, problem: ConvProblem, run) -> Selection:
        pool = candidates(search_space, problem)
        if not pool:
            return rule_based_selection(search_space, problem)  # raises, listing the valid choices
        if run is None or (len(pool) == 1 and not self._measure_single) or not tuning_enabled():
            return rule_based_selection(search_space, problem, list(dict.fromkeys(a for a, _ in pool)))
        key = tuning_key(problem)
        memo_key = (search_space.kind, search_space.phase, key, tuple((a.name, _params_key(p)) for a, p in pool))
        if memo_key not in self._chosen:
            self._chosen[memo_key] = self._tuned(search_space, problem, key, pool, run)
        return self._chosen[memo_key]

    def _tuned(self, search_space: AlgorithmFilter, problem: ConvProblem, key, pool, run) -> Selection:
        phase, kind = search_space.phase, search_space.kind
        sweeps: dict[Algorithm, list[dict]] = {}
        for algorithm, params in pool:
            sweeps.setdefault(algorithm, []).append(params)
        known = {algorithm: self._cached_sweep(algorithm, phase, key, wanted) for algorithm, wanted in sweeps.items()}
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
            measurement = measure([(a, p) for a in unknown for p in sweeps[a]], run, problem, kind)
            for algorithm in unknown:
                known[algorithm] = [result for result in measurement.results if result[0] == algorithm.name]
                if algorithm.name not in measurement.retry_later:
                    self.cache.put(algorithm.tuning_namespace(phase), key, known[algorithm], _sources([algorithm]))
            log.info(
                "tuned %s %s in %.0f ms: %s",
                NAMESPACES[(kind, phase)],
                dict(key),
                (time.perf_counter() - begin) * 1e3,
                measurement.results[:3],
            )
        ranking = sorted((result for results in known.values() for result in results), key=lambda r: r[2])
        self._record_ranking(NAMESPACES[(kind, phase)], key, ranking, kind)
        if not ranking:
            reference = get_algorithm(REFERENCE[kind], kind)
            return Selection(reference, reference.default_params(phase))
        name, params, _ = ranking[0]
        return Selection(get_algorithm(name, kind), params)

    def _cached_sweep(self, algorithm: Algorithm, phase: str, key, wanted: list[dict]) -> list | None:
        """The cached results of `wanted` parameters of `algorithm`, [] when its whole sweep failed,
        None when it must be measured."""
        entry = self.cache.get(algorithm.tuning_namespace(phase), key)
        if entry is None:
            return None
        if not entry.results:
            return []
        wanted_keys = {_params_key(params) for params in wanted}
        found = [result for result in entry.results if _params_key(result[1]) in wanted_keys]
        return found or None  # swept other parameters than these: sweep again

    def _record_ranking(self, namespace: str, key, ranking: list, kind: str) -> None:
        """Add `ranking` to the phase namespace's entry of `key`, unless it holds all of it already."""
        entry = self.cache.get(namespace, key)
        previous = list(entry.results) if entry is not None else []
        recorded = {(name, _params_key(params)): time_ms for name, params, time_ms in previous}
        if entry is not None and all(recorded.get((n, _params_key(p))) == t for n, p, t in ranking):
            return
        ranked = {(name, _params_key(params)) for name, params, _ in ranking}
        merged = ranking + [r for r in previous if (r[0], _params_key(r[1])) not in ranked]
        algorithms = [get_algorithm(name, kind) for name in dict.fromkeys(r[0] for r in merged)]
        self.cache.put(namespace, key, merged, _sources(algorithms))


def _params_key(params: dict) -> tuple:
    return tuple(sorted(params.items()))


def _sources(algorithms) -> set[tuple[str, str]]:
    return {(filename, source_digest(filename)) for algorithm in algorithms for filename in algorithm.kernel_sources}


def _is_out_of_memory(error: Exception) -> bool:
    return isinstance(error, MemoryError) or "out of memory" in str(error).lower()


@dataclass
class Measurement:
    """What `measure` found: `results` best-first as (name, params, ms) for the candidates that ran
    and agreed with the reference; `skipped` maps each other candidate to its reason;
    `retry_later` names the algorithms with a candidate that ran out of memory, a failure that
    another moment may not repeat, so their sweeps are not cached."""

    results: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)
    retry_later: set = field(default_factory=set)


def measure(pool, run, problem: ConvProblem, kind: str) -> Measurement:
    """Time every (algorithm, params) of `pool` through `run` after checking its first run against
    the reference algorithm; a failing or disagreeing candidate is logged and skipped."""
    reference_algorithm = get_algorithm(REFERENCE[kind], kind)
    reference = run(reference_algorithm, reference_algorithm.default_params("forward"))
    on_gpu = problem.device == "cuda"
    measurement = Measurement()
    for algorithm, params in pool:
        try:
            first = run(algorithm, params)
            reason = (None if algorithm is reference_algorithm
                      else disagreement(first, reference, problem.dtype, problem.tf32))
            if reason is None:
                # The checked first run warmed this candidate up; time it straight away.
                time_ms = median_time_ms(lambda: run(algorithm, params), on_gpu, warmup=0)
                measurement.results.append((algorithm.name, params, time_ms))
        except Exception as error:  # a failing candidate (compile error, out of memory) must not fail the call
            reason = f"{type(error).__name__}: {error}"
            if _is_out_of_memory(error):
                measurement.retry_later.add(algorithm.name)
        if reason is not None:
            measurement.skipped[(algorithm.name, _params_key(params))] = reason
            log.warning("tuner: skipping %s %s: %s", algorithm.name, params, reason)
    measurement.results.sort(key=lambda result: result[2])
    return measurement


_default_tuner = Tuner()


def default_tuner() -> Tuner:
    return _default_tuner


def choices_version() -> tuple[int, bool, str]:
    """Changes whenever `select_algorithm` may answer a repeated call differently: what callers that
    keep a selection (with its launch plans) check before reusing it."""
    return _default_tuner.generation, tuning_enabled(), get_fp32_precision()


def select_algorithm(search_space: AlgorithmFilter, problem: ConvProblem, run=None) -> Selection:
    """The one decision point of the library: see `Tuner.select`."""
    return _default_tuner.select(search_space, problem, run)
