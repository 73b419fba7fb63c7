"""Every environment variable cupysparse reads, defined, parsed and validated here and nowhere else.

| variable | values | default |
|---|---|---|
| `CUPYSPARSE_FWD_ALGO_MODE`, `CUPYSPARSE_BWD_ALGO_MODE` | `auto`, `all`, an algorithm name, `[a,b]` | `auto` |
| `CUPYSPARSE_DEPTHWISE_CONV_FWD_ALGO_MODE`, `CUPYSPARSE_DEPTHWISE_CONV_BWD_ALGO_MODE` | likewise | `auto` |
| `CUPYSPARSE_AUTOTUNE` | a switch: measure candidates (on) or take the priority rule (off) | on |
| `CUPYSPARSE_FP32_PRECISION` | `ieee` (exact fp32 products) or `tf32` | `ieee` |
| `CUPYSPARSE_BENCHMARK_CACHE_DIR` | a directory for the tuning cache | `~/.cache/cupysparse` |
| `CUPYSPARSE_SHIPPED_CACHE` | a switch: read the tuning results shipped with the package | on |
| `CUPYSPARSE_PREFETCH` | a switch: load a network's kernels in the background before its first call | on |
| `CUPYSPARSE_NVRTC_LINEINFO` | a switch: compile kernels with line information (for profilers) | off |

A switch takes 1/0, true/false, on/off or yes/no, in any case; an empty value is the default. The
variables of CuPy and CUDA that the library reads are here too (`cupy_cache_dir`,
`cupy_cache_in_memory`, `cuda_roots`). Each reader parses the variable's value at the time of the
call; an invalid value raises ValueError naming the variable and listing the valid values, on every
device. Algorithm names are checked against the registry where the modes are parsed
(`cupysparse.tuning.search_space`), which lists the valid names likewise.

A layer's launch plan, kept for its signature (`cupysparse.functional.execution`), holds for as long
as the settings it was selected under: `selection_state()` is the count of in-process changes reported
through `changed()` (an fp32 precision set in code, a tuner forgetting its choices) and the raw values
of the variables that steer a selection, read straight from the process environment's mapping (a
dictionary lookup of tens of nanoseconds, where `os.environ.get` of an unset name raises and catches
a KeyError inside, 2 µs).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

_ON = ("1", "true", "on", "yes")
_OFF = ("0", "false", "off", "no")
IEEE = "ieee"
TF32 = "tf32"
FP32_PRECISIONS = (IEEE, TF32)


@dataclass(frozen=True)
class Variable:
    name: str
    default: str
    meaning: str


FWD_ALGO_MODE = Variable("CUPYSPARSE_FWD_ALGO_MODE", "auto", "the forward algorithms of a convolution")
BWD_ALGO_MODE = Variable("CUPYSPARSE_BWD_ALGO_MODE", "auto", "the backward algorithms of a convolution")
DEPTHWISE_FWD_ALGO_MODE = Variable("CUPYSPARSE_DEPTHWISE_CONV_FWD_ALGO_MODE", "auto",
                                   "the forward algorithms of a depthwise convolution")
DEPTHWISE_BWD_ALGO_MODE = Variable("CUPYSPARSE_DEPTHWISE_CONV_BWD_ALGO_MODE", "auto",
                                   "the backward algorithms of a depthwise convolution")
AUTOTUNE = Variable("CUPYSPARSE_AUTOTUNE", "1", "measure the candidate algorithms of a new problem")
FP32_PRECISION = Variable("CUPYSPARSE_FP32_PRECISION", IEEE, "how fp32 convolutions multiply")
BENCHMARK_CACHE_DIR = Variable("CUPYSPARSE_BENCHMARK_CACHE_DIR", "~/.cache/cupysparse",
                               "the directory of the tuning cache")
SHIPPED_CACHE = Variable("CUPYSPARSE_SHIPPED_CACHE", "1", "read the tuning results shipped with the package")
PREFETCH = Variable("CUPYSPARSE_PREFETCH", "1", "load a network's kernels before its first call")
NVRTC_LINEINFO = Variable("CUPYSPARSE_NVRTC_LINEINFO", "0", "compile kernels with line information")
VARIABLES = (FWD_ALGO_MODE, BWD_ALGO_MODE, DEPTHWISE_FWD_ALGO_MODE, DEPTHWISE_BWD_ALGO_MODE, AUTOTUNE,
             FP32_PRECISION, BENCHMARK_CACHE_DIR, SHIPPED_CACHE, PREFETCH, NVRTC_LINEINFO)
ALGORITHM_MODES = {
    ("conv", "forward"): FWD_ALGO_MODE,
    ("conv", "backward"): BWD_ALGO_MODE,
    ("depthwise", "forward"): DEPTHWISE_FWD_ALGO_MODE,
    ("depthwise", "backward"): DEPTHWISE_BWD_ALGO_MODE,
}
# What a selection depends on: a change to any of them may change a layer's algorithm.
_SELECTION_VARIABLES = (FWD_ALGO_MODE, BWD_ALGO_MODE, AUTOTUNE, FP32_PRECISION)

# CPython keeps the environment in a dictionary of encoded names; reading it directly skips the
# exception `os.environ.get` raises inside for an unset name.
_environment = getattr(os.environ, "_data", None)
_encode = getattr(os.environ, "encodekey", None)
_decode = getattr(os.environ, "decodevalue", None)
_DIRECT = isinstance(_environment, dict) and _encode is not None and _decode is not None


def _key(name: str):
    return _encode(name) if _DIRECT else name


_SELECTION_KEYS = tuple(_key(variable.name) for variable in _SELECTION_VARIABLES)


def _text(variable: Variable) -> str | None:
    """The variable's value with surrounding blanks removed; None when unset or blank."""
    if _DIRECT:
        raw = _environment.get(_key(variable.name))
        value = None if raw is None else _decode(raw)
    else:
        value = os.environ.get(variable.name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _invalid(variable: Variable, value: str, valid) -> ValueError:
    return ValueError(f"environment variable {variable.name}={value!r} ({variable.meaning}) is not valid; "
                      f"valid values: {', '.join(valid)}")


def _switch(variable: Variable) -> bool:
    value = _text(variable)
    if value is None:
        return variable.default in _ON
    lowered = value.lower()
    if lowered in _ON:
        return True
    if lowered in _OFF:
        return False
    raise _invalid(variable, value, _ON + _OFF)


def autotune() -> bool:
    """Whether a new problem's candidates are measured (`CUPYSPARSE_AUTOTUNE`)."""
    return _switch(AUTOTUNE)


def shipped_cache() -> bool:
    """Whether the tuning results shipped with the package are read (`CUPYSPARSE_SHIPPED_CACHE`)."""
    return _switch(SHIPPED_CACHE)


def prefetch() -> bool:
    """Whether a network loads its kernels ahead of its first call (`CUPYSPARSE_PREFETCH`)."""
    return _switch(PREFETCH)


def nvrtc_lineinfo() -> bool:
    """Whether kernels are compiled with line information (`CUPYSPARSE_NVRTC_LINEINFO`)."""
    return _switch(NVRTC_LINEINFO)


def checked_fp32_precision(value, source: str) -> str:
    """`value` as one of FP32_PRECISIONS; ValueError naming `source` otherwise."""
    normalized = str(value).strip().lower()
    if normalized not in FP32_PRECISIONS:
        raise ValueError(f"{source} must be one of {', '.join(FP32_PRECISIONS)}; got {value!r}")
    return normalized


def fp32_precision() -> str:
    """"ieee" or "tf32" as `CUPYSPARSE_FP32_PRECISION` says (unset: "ieee")."""
    value = _text(FP32_PRECISION)
    if value is None:
        return IEEE
    if value.lower() not in FP32_PRECISIONS:
        raise _invalid(FP32_PRECISION, value, FP32_PRECISIONS)
    return value.lower()


def algorithm_mode(kind: str, phase: str) -> tuple[Variable, str | None]:
    """The variable naming the algorithms of a `kind` ("conv", "depthwise") and `phase` ("forward",
    "backward"), and its value (None when unset)."""
    variable = ALGORITHM_MODES[(kind, phase)]
    return variable, _text(variable)


def benchmark_cache_dir() -> str:
    """The directory of the tuning cache: `CUPYSPARSE_BENCHMARK_CACHE_DIR`, else `~/.cache/cupysparse`."""
    return os.path.expanduser(_text(BENCHMARK_CACHE_DIR) or BENCHMARK_CACHE_DIR.default)


CUPY_CACHE_DIR = "CUPY_CACHE_DIR"
CUPY_CACHE_IN_MEMORY = "CUPY_CACHE_IN_MEMORY"
DEFAULT_CUPY_CACHE_DIR = os.path.expanduser("~/.cupy/kernel_cache")


def cupy_cache_dir() -> str:
    """CuPy's kernel cache directory, as CuPy reads it: `CUPY_CACHE_DIR`, else `~/.cupy/kernel_cache`."""
    return os.environ.get(CUPY_CACHE_DIR, DEFAULT_CUPY_CACHE_DIR)


def cupy_cache_in_memory() -> bool:
    """Whether CuPy keeps compiled kernels in memory only (`CUPY_CACHE_IN_MEMORY=1`, CuPy's rule)."""
    return os.environ.get(CUPY_CACHE_IN_MEMORY) == "1"


def cuda_roots() -> tuple[str, ...]:
    """CUDA toolkit directories named by `CUDA_PATH` and `CUDA_HOME`, in that order."""
    return tuple(root for root in (os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME")) if root)


# In-process changes that may change a selection (an fp32 precision set in code, a tuner forgetting its
# choices), counted by `changed()`.
changes = 0
# The raw values of the selection variables, as an iterator, from C alone: a planned call reads them
# without entering a Python frame (`selection_state` writes out what it takes).
if _DIRECT:
    selection_values = functools.partial(map, _environment.get, _SELECTION_KEYS)
else:
    selection_values = functools.partial(map, os.environ.get, _SELECTION_KEYS)


def changed() -> None:
    """Report an in-process change that may change a selection: `selection_state()` differs after it."""
    global changes
    changes += 1


def selection_state() -> tuple:
    """What a selection depends on beyond its call: the count of in-process changes and the raw values
    of the selection variables. Equal states select alike."""
    return (changes, *selection_values())
