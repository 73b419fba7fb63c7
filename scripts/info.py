"""`python -m cupysparse info`: the environment a bug report needs, as aligned "key: value" lines.

Every probe is isolated: a missing or broken piece prints "not found (reason)" instead of ending
the report, since the report matters most on the machines where something is missing.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import platform
import sys

import numpy as np

import cupysparse
from cupysparse.cuda import backend
from cupysparse import settings


class _NotFound(Exception):
    """A probe's expected absence; its message is the reason, shown without an exception type."""


def _cupy_missing_reason() -> str:
    try:
        installed = importlib.util.find_spec("cupy") is not None
    except ImportError:  # an import hook that blocks CuPy, as the tests do
        installed = False
    return "CuPy failed to import" if installed else "CuPy not installed"


def _cupy():
    cupy = backend.cupy_module()
    if cupy is None:
        raise _NotFound(_cupy_missing_reason())
    return cupy


def _cuda_version(encoded: int) -> str:
    # The CUDA APIs encode versions as 1000 * major + 10 * minor.
    return f"{encoded // 1000}.{encoded % 1000 // 10}"


def _cupysparse() -> str:
    return f"{cupysparse.__version__} ({os.path.dirname(cupysparse.__file__)})"


def _python() -> str:
    return f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"


def _backend() -> str:
    if backend.gpu_available():
        return "cuda"
    if backend.cupy_module() is None:
        return f"numpy ({_cupy_missing_reason()})"
    return "numpy (no GPU)"


def _gpus() -> list[str]:
    runtime = _cupy().cuda.runtime
    count = runtime.getDeviceCount()  # raises when there is no driver or no device
    if count == 0:
        raise _NotFound("no CUDA device")
    gpus = []
    for index in range(count):
        props = runtime.getDeviceProperties(index)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        gpus.append(f"{index}: {name} (compute capability {props['major']}.{props['minor']})")
    return gpus


def _driver() -> str:
    version = _cupy().cuda.runtime.driverGetVersion()
    if version == 0:
        raise _NotFound("no CUDA driver")
    return _cuda_version(version)


def _include_dirs() -> list[str]:
    from cupysparse.cuda.compile import cuda_include_dirs

    dirs = list(cuda_include_dirs())
    if not dirs:
        raise _NotFound("no CUDA headers: pip install 'cuda-toolkit[cudart]' or set CUDA_PATH")
    return dirs


def _mma_header() -> str:
    from cupysparse.cuda.compile import MMA_PACKAGE_HINT, find_mma_header

    directory = find_mma_header()
    if directory is None:
        raise _NotFound(f"WMMA kernels cannot compile: {MMA_PACKAGE_HINT}")
    return os.path.join(directory, "crt", "mma.h")


def _kernel_cache_dir() -> str:
    backend.cupy_module()  # importing CuPy redirects an unwritable cache directory: report the one in use
    if settings.cupy_cache_in_memory():
        return f"{backend.kernel_cache_dir()} (unused: CUPY_CACHE_IN_MEMORY=1)"
    return backend.kernel_cache_dir()


def _torch() -> str:
    torch = importlib.import_module("torch")
    return f"{torch.__version__} ({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU only'})"


def _environment() -> list[str] | str:
    names = sorted(name for name in os.environ if name.startswith(("CUPYSPARSE_", "CUPY_", "CUDA_")))
    return [f"{name}={os.environ[name]}" for name in names] or "none set"


_PROBES = [
    ("cupysparse", _cupysparse),
    ("python", _python),
    ("platform", platform.platform),
    ("numpy", lambda: np.__version__),
    ("backend", _backend),
    ("gpu", _gpus),
    ("cupy", lambda: _cupy().__version__),
    ("cuda runtime", lambda: _cuda_version(_cupy().cuda.runtime.runtimeGetVersion())),
    ("cuda driver", _driver),
    ("nvrtc", lambda: ".".join(map(str, _cupy().cuda.nvrtc.getVersion()))),
    ("cuda include dirs", _include_dirs),
    ("crt/mma.h", _mma_header),
    ("kernel cache dir", _kernel_cache_dir),
    ("benchmark cache dir", settings.benchmark_cache_dir),
    ("torch", _torch),
    ("jax", lambda: importlib.import_module("jax").__version__),
    ("environment", _environment),
]


def _probe(probe) -> list[str] | str:
    try:
        return probe()
    except _NotFound as reason:
        return f"not found ({reason})"
    except Exception as error:  # a broken install must not end the report; one line keeps it aligned
        return f"not found ({type(error).__name__}: {' '.join(str(error).split())})"


def collect() -> list[tuple[str, list[str] | str]]:
    """(key, value) pairs in report order; a list value is shown one item per line."""
    return [(key, _probe(probe)) for key, probe in _PROBES]


def format_report(rows: list[tuple[str, list[str] | str]]) -> str:
    width = max(len(key) for key, _ in rows) + 1
    lines = []
    for key, value in rows:
        for index, item in enumerate(value if isinstance(value, list) else [value]):
            lines.append(f"{key + ':' if index == 0 else '':<{width}} {item}")
    return "\n".join(lines)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    # no flags, but `info --help` should answer like every other command instead of printing the report
    return argparse.ArgumentParser(prog=prog or "python -m cupysparse info", description=__doc__.split("\n\n")[0],
                                   epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    build_parser(prog).parse_args(argv)
    print(format_report(collect()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
