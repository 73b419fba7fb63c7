"""How users name algorithms: enums, strings, lists of either, `auto`, `all`, or environment variables.

An algorithm argument is a search-space filter. `None` reads the environment variable of its
slot (`CUPYSPARSE_FWD_ALGO_MODE`, `CUPYSPARSE_BWD_ALGO_MODE`,
`CUPYSPARSE_DEPTHWISE_CONV_FWD_ALGO_MODE`, `CUPYSPARSE_DEPTHWISE_CONV_BWD_ALGO_MODE`), whose value
is `auto`, `all`, a name, or a list `[a,b]`; unset means `auto`. Names are checked against the
registry, so a typo raises and lists the valid choices.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

from .algorithms import CONV, DEPTHWISE, registered

AUTO = "auto"
ALL = "all"


class SPARSE_CONV_FWD_ALGO_MODE(str, enum.Enum):
    EXPLICIT_GEMM = "explicit_gemm"
    IMPLICIT_GEMM = "implicit_gemm"
    WMMA_IMPLICIT_GEMM = "wmma_implicit_gemm"
    MMA_IMPLICIT_GEMM = "mma_implicit_gemm"
    WGMMA_IMPLICIT_GEMM = "wgmma_implicit_gemm"
    AUTO = AUTO


class SPARSE_CONV_BWD_ALGO_MODE(str, enum.Enum):
    EXPLICIT_GEMM = "explicit_gemm"
    IMPLICIT_GEMM = "implicit_gemm"
    WMMA_IMPLICIT_GEMM = "wmma_implicit_gemm"
    MMA_IMPLICIT_GEMM = "mma_implicit_gemm"
    WGMMA_IMPLICIT_GEMM = "wgmma_implicit_gemm"
    AUTO = AUTO


class SPARSE_DEPTHWISE_CONV_FWD_ALGO_MODE(str, enum.Enum):
    EXPLICIT = "explicit"
    IMPLICIT = "implicit"
    AUTO = AUTO


class SPARSE_DEPTHWISE_CONV_BWD_ALGO_MODE(str, enum.Enum):
    EXPLICIT = "explicit"
    IMPLICIT = "implicit"
    AUTO = AUTO


ENVIRONMENT_VARIABLES = {
    (CONV, "forward"): "CUPYSPARSE_FWD_ALGO_MODE",
    (CONV, "backward"): "CUPYSPARSE_BWD_ALGO_MODE",
    (DEPTHWISE, "forward"): "CUPYSPARSE_DEPTHWISE_CONV_FWD_ALGO_MODE",
    (DEPTHWISE, "backward"): "CUPYSPARSE_DEPTHWISE_CONV_BWD_ALGO_MODE",
}


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


def _parse_text(text: str, kind: str, phase: str, source: str) -> AlgorithmFilter:
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
        variable = ENVIRONMENT_VARIABLES[(kind, phase)]
        text = os.environ.get(variable, "").strip()
        return _parse_text(text, kind, phase, f"environment variable {variable}") if text else AlgorithmFilter(
            kind, phase, AUTO
        )
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, str):
        return _parse_text(value, kind, phase, source)
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{source}: empty algorithm list; valid choices: {_valid_choices(kind)}")
        return AlgorithmFilter(kind, phase, "names", tuple(_name_of(item, kind, source) for item in value))
    raise TypeError(f"{source}: expected None, an enum, a string or a list, got {type(value).__name__}")
