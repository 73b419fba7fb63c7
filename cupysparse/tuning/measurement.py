"""Measuring candidates: each one's first run checked against the reference algorithm's answer, then
timed (on the GPU each call's device time alone, behind a wait that lets the host queue it:
`cuda.timing.QueuedTimer`; on the CPU the host clock, the checked run being the warm-up), and the close
contenders timed again in interleaved rounds, so that noise and drift do not rank them.

A candidate that raises (a compile error, out of memory) or disagrees with the reference is skipped
with its reason. A reference result holding inf (the exact sum is out of the dtype's range: an
overflow) or NaN checks nothing, and nothing else runs; the tuner warns about it, so the algorithms do
not report what they compute while measured (`precision.results_checked_by_caller`), nor the call's
own run of the reference after it (`precision.count_as_reported`).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

import numpy as np

from cupysparse.algorithms import Algorithm, ConvProblem
from cupysparse.cuda.backend import all_true, array_module
from cupysparse.cuda.dtypes import accumulation_dtype, short_name
from cupysparse.cuda.out_of_memory import is_out_of_memory
from cupysparse.cuda.precision import (TF32, NonFinite, count_as_reported, find_non_finite, result_position,
                                       results_checked_by_caller)
from cupysparse.cuda.timing import TIMED_RUNS, QueuedTimer, sample_times_ms

log = logging.getLogger("cupysparse.tuning")

# Candidates within this fraction of the fastest first-pass time are too close for TIMED_RUNS samples to
# rank (H100: 10-15% apart, misranked from run to run): the fastest MAX_CONTENDERS of them are timed
# again, CONTENDER_ROUNDS samples each, taken round-robin so that a clock or thermal drift hits all alike.
CONTENDER_MARGIN = 0.15
MAX_CONTENDERS = 4
CONTENDER_ROUNDS = 5
# Largest |candidate - reference| accepted, relative to max |reference|: far above rounding
# (fp32 accumulation, one rounding to the output dtype), far below a wrong pair or layout.
AGREEMENT = {"float64": 1e-9, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2, "tf32": 1e-2}
# Values in a dtype's subnormal range carry an absolute rounding error of a few of these steps however
# exact the algorithm (fp16 gradients of a mean over 10⁴ voxels live there); the check allows 16 of them.
SUBNORMAL_STEP = {"float64": 2.0**-1074, "float32": 2.0**-149, "float16": 2.0**-24, "bfloat16": 2.0**-133}
SUBNORMAL_STEPS_ALLOWED = 16


def params_key(params: dict) -> tuple:
    return tuple(sorted(params.items()))


def candidate_times_ms(run, timer: QueuedTimer | None, repeats: int = TIMED_RUNS) -> list[float]:
    """The tuner's samples of one candidate, already warmed up: with `timer` (on the GPU) each call's
    device time alone, else the host clock."""
    if timer is None:
        return sample_times_ms(run, on_gpu=False, warmup=0, repeats=repeats)
    return [timer.time_ms(run) for _ in range(repeats)]


def _as_tuple(result) -> tuple:
    return result if isinstance(result, tuple) else (result,)


def _labelled(result) -> list[tuple[str, object]]:
    """The arrays of a run's result with what they are: a forward's output, or a backward's
    (input gradient, weight gradient)."""
    parts = _as_tuple(result)
    labels = ("input gradient", "weight gradient") if len(parts) == 2 else ("output",) * len(parts)
    return list(zip(labels, parts))


def _non_finite_in_reference(reference, dtype) -> NonFinite | None:
    """The first of the reference's arrays that holds inf or NaN, and where."""
    for label, expected in _labelled(reference):
        finding = None if expected is None else find_non_finite(expected, dtype, label)
        if finding is not None:
            return finding
    return None


def _why_unchecked(finding: NonFinite) -> str:
    name = short_name(finding.dtype)
    if finding.is_nan:
        return f"{finding.describe('the reference')}: the inputs hold NaN or inf, so no candidate can be checked"
    return (f"{finding.describe()}: the reference, accumulated in {short_name(accumulation_dtype(finding.dtype))}, "
            f"is out of {name}'s range there, so no candidate can be checked; scale the inputs or weights down, "
            "or compute in a wider dtype")


def non_finite_reference(reference, dtype) -> str | None:
    """Why the reference result cannot check the candidates, or None: it holds inf (the exact
    result, accumulated in fp32 or wider, lies beyond `dtype`'s range: an overflow) or NaN (NaN or
    inf in the inputs). Then every candidate would "agree" on those values, or differ for no fault
    of its own."""
    finding = _non_finite_in_reference(reference, dtype)
    return None if finding is None else _why_unchecked(finding)


def disagreement(result, reference, dtype, tf32: bool = False) -> str | None:
    """Why `result` is not `reference` within `AGREEMENT` for `dtype` (for TF32 products when
    `tf32`), or None. Computed where the arrays live, so only a few scalars cross to the host. A
    reference with inf or NaN checks nothing (`non_finite_reference` says why); inf or NaN in
    `result` where the reference is finite is reported as what it is (an overflow, or NaN), with its
    position."""
    unusable = non_finite_reference(reference, dtype)
    if unusable is not None:
        return unusable
    tolerance = AGREEMENT[TF32 if tf32 else np.dtype(dtype).name]
    floor = SUBNORMAL_STEPS_ALLOWED * SUBNORMAL_STEP[np.dtype(dtype).name]
    for (label, got), expected in zip(_labelled(result), _as_tuple(reference)):
        if got is None and expected is None:
            continue
        if got.shape != expected.shape:
            return f"shape {tuple(got.shape)} instead of {tuple(expected.shape)}"
        if expected.size == 0:
            continue
        xp = array_module(expected)
        wide = accumulation_dtype(dtype)
        got, expected = got.astype(wide), expected.astype(wide)
        finite = xp.isfinite(got).ravel()
        if not all_true(finite):
            first = int(xp.argmin(finite))
            value, exact = float(got.ravel()[first]), float(expected.ravel()[first])
            named = f"the {short_name(dtype)} {label}"
            what = f"{named} is NaN" if np.isnan(value) else f"overflow: {named} is {value:g}"
            return f"{what} at {result_position(first, got.shape, label)}, where the reference is {exact:.6g}"
        scale = float(xp.abs(expected).max())
        error = float(xp.abs(got - expected).max())
        if error > tolerance * scale + floor:
            return f"differs from the reference answer by {error:.3g} (max |reference| {scale:.3g})"
    return None


@dataclass
class Measurement:
    """What `measure` found. `results` best-first as (name, params, ms) for the candidates that ran
    and agreed with the reference; `skipped` maps each other candidate to its reason, and `raised`
    those whose run raised to the error. `short_of_memory`: some run ran out of memory, a failure
    another moment may not repeat. `unchecked`: why no candidate could be checked (the reference ran
    out of memory, or its result holds inf or NaN); then nothing else ran."""

    results: list = field(default_factory=list)
    skipped: dict = field(default_factory=dict)
    raised: dict = field(default_factory=dict)
    short_of_memory: bool = False
    unchecked: str | None = None

    def every_candidate_raised(self, reference: str) -> bool:
        """Whether candidates other than `reference` were measured and each of them raised."""
        measured = {key for key in self.skipped if key[0] != reference}
        measured.update((name, params_key(params)) for name, params, _ in self.results if name != reference)
        return bool(measured) and all(key in self.raised for key in measured)

    def algorithms_that_always_raised(self) -> dict[str, list[str]]:
        """The algorithms whose every measured candidate raised, each with its distinct errors."""
        ran = {name for name, _, _ in self.results}
        ran.update(name for (name, params), _ in self.skipped.items() if (name, params) not in self.raised)
        errors: dict[str, list[str]] = {}
        for (name, _), error in self.raised.items():
            if name not in ran and error not in errors.setdefault(name, []):
                errors[name].append(error)
        return errors


def _error_summary(error: Exception) -> str:
    """`Type: first line of the message`, at most 300 characters (an NVRTC log runs to pages)."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= 300 else text[:297] + "..."


def measure(pool, run, problem: ConvProblem, reference_algorithm: Algorithm) -> Measurement:
    """Time every (algorithm, params) of `pool` through `run` after checking its first run against
    the reference algorithm, then the close contenders again (`retime_contenders`); a failing or
    disagreeing candidate is logged and skipped. If the reference itself runs out of memory or gives
    inf or NaN, nothing is checked or timed. The algorithms report nothing of what they compute
    meanwhile: the check is this one's."""
    with results_checked_by_caller():
        return _measure(pool, run, problem, reference_algorithm)


def _measure(pool, run, problem: ConvProblem, reference_algorithm: Algorithm) -> Measurement:
    measurement = Measurement()
    try:
        reference = run(reference_algorithm, reference_algorithm.default_params("forward"))
    except Exception as error:
        if not is_out_of_memory(error):
            raise  # the reference is the library's own answer: its failure is the call's
        measurement.short_of_memory = True
        measurement.unchecked = f"the reference {reference_algorithm.name} ran out of memory ({_error_summary(error)})"
        return measurement
    non_finite = _non_finite_in_reference(reference, problem.dtype)
    if non_finite is not None:
        measurement.unchecked = _why_unchecked(non_finite)
        count_as_reported(non_finite)  # the tuner warns about it, naming the problem
        return measurement
    timer = QueuedTimer() if problem.device == "cuda" else None
    timed: dict[tuple, tuple[Algorithm, dict, list[float]]] = {}  # by candidate: its samples
    for algorithm, params in pool:
        candidate = (algorithm.name, params_key(params))
        try:
            first = run(algorithm, params)
            reason = (None if algorithm is reference_algorithm
                      else disagreement(first, reference, problem.dtype, problem.tf32))
            if reason is None:
                # The checked first run warmed this candidate up; time it straight away.
                samples = candidate_times_ms(lambda: run(algorithm, params), timer)
                timed[candidate] = (algorithm, params, samples)
            else:
                log.warning("tuner: skipping %s %s: %s", algorithm.name, params, reason)
                measurement.skipped[candidate] = reason
        except Exception as error:  # a failing candidate (compile error, out of memory) must not fail the call
            _skip_raised(measurement, candidate, params, error)
    retime_contenders(timed, run, timer, measurement)
    measurement.results = sorted(((algorithm.name, params, statistics.median(samples))
                                  for algorithm, params, samples in timed.values()), key=lambda result: result[2])
    return measurement


def retime_contenders(timed: dict, run, timer: QueuedTimer | None, measurement: Measurement) -> None:
    """Add samples to the candidates of `timed` within `CONTENDER_MARGIN` of the fastest (the fastest
    `MAX_CONTENDERS` of them): `CONTENDER_ROUNDS` rounds of one sample each, round-robin. A contender that
    raises is skipped as in the first pass and leaves `timed`. One contender alone is not run again."""
    first_pass = {candidate: statistics.median(samples) for candidate, (_, _, samples) in timed.items()}
    fastest = min(first_pass.values(), default=0.0)
    contenders = sorted((c for c in first_pass if first_pass[c] <= fastest * (1 + CONTENDER_MARGIN)),
                        key=first_pass.get)[:MAX_CONTENDERS]
    if len(contenders) < 2:
        return
    for _ in range(CONTENDER_ROUNDS):
        for candidate in list(contenders):
            algorithm, params, samples = timed[candidate]
            try:
                samples.extend(candidate_times_ms(lambda: run(algorithm, params), timer, repeats=1))
            except Exception as error:  # as in the first pass: a failing candidate must not fail the call
                contenders.remove(candidate)
                del timed[candidate]
                _skip_raised(measurement, candidate, params, error)


def _skip_raised(measurement: Measurement, candidate: tuple, params: dict, error: Exception) -> None:
    """Record and log a candidate whose run raised (a compile error, out of memory) as skipped."""
    measurement.raised[candidate] = _error_summary(error)
    measurement.skipped[candidate] = f"{type(error).__name__}: {error}"
    measurement.short_of_memory |= is_out_of_memory(error)
    log.info("tuner: skipping %s %s: %s", candidate[0], params, measurement.skipped[candidate])
