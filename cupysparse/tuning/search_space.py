"""How users name algorithms, and what a name lets the tuner choose from.

An algorithm argument is a search-space filter: an enum member, a string, a list of either, `auto`,
`all`, or `None`, which reads the environment variable of its slot (`settings.algorithm_mode`:
`CUPYSPARSE_FWD_ALGO_MODE`, `CUPYSPARSE_BWD_ALGO_MODE`, `CUPYSPARSE_DEPTHWISE_CONV_FWD_ALGO_MODE`,
`CUPYSPARSE_DEPTHWISE_CONV_BWD_ALGO_MODE`: `auto`, `all`, a name, or a list `[a,b]`; unset means
`auto`). Names are checked against the registry, so a typo raises and lists the valid choices. The
enums are made from the registry too: a new algorithm appears in them by registering.

`candidates` turns a filter into the (algorithm, params) pairs the tuner measures; where nothing is
measured, `rule_based_selection` picks: among the filter's algorithms that support the problem, a
list keeps the user's order (the first supported one runs), while `auto` and `all` take the highest
`auto_priority` (tensor cores for fp16/bf16; then SIMT implicit GEMM for narrow layers, C_in·C_out ≤
96², where it measured faster, and explicit GEMM, cuBLAS, for wider ones), each with its default
parameters.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

from cupysparse import settings
from cupysparse.algorithms import CONV, DEPTHWISE, Algorithm, ConvProblem, get_algorithm, registered

AUTO = "auto"
ALL = "all"
PHASES = ("forward", "backward")


def _mode_enum(name: str, kind: str) -> type[enum.Enum]:
    members = {algorithm.upper(): algorithm for algorithm in registered(kind)}
    return enum.Enum(name, {**members, "AUTO": AUTO}, type=str, module=__name__)


SPARSE_CONV_FWD_ALGO_MODE = _mode_enum("SPARSE_CONV_FWD_ALGO_MODE", CONV)
SPARSE_CONV_BWD_ALGO_MODE = _mode_enum("SPARSE_CONV_BWD_ALGO_MODE", CONV)
SPARSE_DEPTHWISE_CONV_FWD_ALGO_MODE = _mode_enum("SPARSE_DEPTHWISE_CONV_FWD_ALGO_MODE", DEPTHWISE)
SPARSE_DEPTHWISE_CONV_BWD_ALGO_MODE = _mode_enum("SPARSE_DEPTHWISE_CONV_BWD_ALGO_MODE", DEPTHWISE)


@dataclass(frozen=True)
class AlgorithmFilter:
    """The algorithms a call may choose from: `mode` is `auto`, `all` or `names` (in user order)."""

    kind: str
    phase: str
    mode: str
    names: tuple[str, ...] = ()

    def candidates(self) -> tuple[str, ...]:
        return self.names if self.mode == "names" else tuple(registered(self.kind))


def _valid_choices(kind: str) -> str:
    return ", ".join([AUTO, ALL, *registered(kind)])


def _name_of(item, kind: str, source: str) -> str:
    value = item.value if isinstance(item, enum.Enum) else item
    if not isinstance(value, str):
        raise TypeError(f"{source}: an algorithm is an enum member or a string, got {item!r}")
    name = value.strip().lower()
    if name not in registered(kind):
        raise ValueError(f"{source}: unknown {kind} algorithm {value!r}; valid choices: {_valid_choices(kind)}")
    return name


def parse_mode_text(text: str, kind: str, phase: str, source: str) -> AlgorithmFilter:
    """The filter a text names: `auto`, `all`, a name or `[a,b]` (`source` names the text in errors)."""
    stripped = text.strip()
    if stripped.lower() in (AUTO, ALL):
        return AlgorithmFilter(kind, phase, stripped.lower())
    if stripped.startswith("[") and stripped.endswith("]"):
        items = [item for item in stripped[1:-1].split(",") if item.strip()]
        if not items:
            raise ValueError(f"{source}: empty algorithm list; valid choices: {_valid_choices(kind)}")
        return AlgorithmFilter(kind, phase, "names", tuple(_name_of(item, kind, source) for item in items))
    return AlgorithmFilter(kind, phase, "names", (_name_of(stripped, kind, source),))


def parse_algorithm_filter(value, kind: str = CONV, phase: str = "forward") -> AlgorithmFilter:
    """The `AlgorithmFilter` of an algorithm argument: None, an enum, a string, or a list of either."""
    source = f"{phase} algorithm of a {'depthwise ' if kind == DEPTHWISE else ''}convolution"
    if value is None:
        variable, text = settings.algorithm_mode(kind, phase)
        if text is None:
            return AlgorithmFilter(kind, phase, AUTO)
        return parse_mode_text(text, kind, phase, f"environment variable {variable.name}")
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str):
        return parse_mode_text(value, kind, phase, source)
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{source}: empty algorithm list; valid choices: {_valid_choices(kind)}")
        return AlgorithmFilter(kind, phase, "names", tuple(_name_of(item, kind, source) for item in value))
    raise TypeError(f"{source}: expected None, an enum, a string or a list, got {type(value).__name__}")


def algorithm_argument(algo, kind: str, phase: str) -> str:
    """The canonical string of an algorithm argument, checked: "" for None (the environment variable
    decides at each call), else `auto`, `all` or `[a,b]`. A typo raises here, naming the caller's value.
    Layers keep it, and calls pass it, so that a call parses nothing."""
    if algo is None:
        return ""
    return _algorithm_argument(tuple(algo) if isinstance(algo, list) else algo, kind, phase)


@functools.lru_cache(maxsize=256)
def _algorithm_argument(algo, kind: str, phase: str) -> str:
    search_space = parse_algorithm_filter(algo, kind, phase)
    if search_space.mode == "names":
        return "[" + ",".join(search_space.names) + "]"
    return search_space.mode


def algorithm_filter(argument: str, kind: str, phase: str) -> AlgorithmFilter:
    """The `AlgorithmFilter` of an `algorithm_argument` string."""
    return parse_algorithm_filter(argument or None, kind, phase)


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
