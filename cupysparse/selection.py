"""The rule that picks an algorithm when nothing is measured (the tuner falls back to it when
measuring is off or there is a single candidate), and the error when nothing can run.

Among the filter's algorithms that support the problem, a list keeps the user's order (the first
supported one runs), while `auto` and `all` take the highest `auto_priority`: tensor cores (fp16/bf16); then SIMT implicit GEMM for narrow layers
(C_in·C_out ≤ 96², where it measured faster) and explicit GEMM (cuBLAS) for wider ones; each
with its default parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from .algorithm_modes import AlgorithmFilter
from .algorithms import Algorithm, ConvProblem, get_algorithm, registered


@dataclass(frozen=True)
class Selection:
    algorithm: Algorithm
    params: dict


def describe_problem(problem: ConvProblem) -> str:
    where = "CPU" if problem.compute_capability is None else f"GPU sm_{problem.compute_capability}"
    return f"{problem.dtype}, {problem.in_channels}→{problem.out_channels} channels, K={problem.kernel_volume}, {where}"


def rule_based_selection(search_space: AlgorithmFilter, problem: ConvProblem, candidates=None) -> Selection:
    """The algorithm of `search_space` (or of `candidates`, its algorithms already looked up) that
    runs `problem`, with its default parameters for the phase."""
    if candidates is None:
        candidates = [get_algorithm(name, search_space.kind) for name in search_space.candidates()]
    supported = [algorithm for algorithm in candidates if algorithm.supports(problem)]
    if not supported:
        reasons = "; ".join(f"{a.name}: {a.unsupported_reason(problem)}" for a in candidates)
        runnable = [a.name for a in registered(search_space.kind).values() if a.supports(problem)]
        raise ValueError(
            f"no {search_space.phase} algorithm among {[a.name for a in candidates]} can run this problem "
            f"({describe_problem(problem)}): {reasons}. Valid choices here: {runnable}"
        )
    if search_space.mode == "names":
        chosen = supported[0]
    else:
        chosen = max(supported, key=lambda algorithm: algorithm.auto_priority(problem))
    return Selection(chosen, chosen.default_params(search_space.phase))
