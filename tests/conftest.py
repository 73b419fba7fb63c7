"""What every test shares: the markers' skips and the test helpers' folder on the path.

- `gpu`: needs a CUDA GPU; skipped without one. `pytest -m gpu` on the GPU machine runs them all.
- `alone`: measures GPU time, so runs with the GPU to itself: skipped in a pytest-xdist worker (`-n`);
  `scripts/gpu_check.sh` runs these after the others, which share the GPU among several processes.
- `huge`: tens of millions of voxels; runs only when selected with `-m huge`.
- `nvrtc`: compiles CUDA through NVRTC (no GPU needed); skipped when NVRTC is not installed.

The helpers (`references`, `tolerances`, `gpu_cases`, `tuning_caches`, `distributed_runs`, ...) are
plain modules in this folder, importable from every test folder through the `pythonpath` setting.
"""

import functools

import pytest

from cupysparse.cuda.backend import gpu_available

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the fuzz suites skip themselves
    pass
else:
    # The fuzz suites' example counts: "ci", the default, is quick and the same on every run;
    # `--hypothesis-profile deep --hypothesis-seed N` draws ten times as many from seed N.
    _FUZZ = {"database": None, "deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
    settings.register_profile("ci", max_examples=250, derandomize=True, **_FUZZ)
    settings.register_profile("deep", max_examples=2500, **_FUZZ)
    settings.load_profile("ci")


@functools.cache
def nvrtc_available() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except Exception:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    selected = config.getoption("markexpr") or ""
    for item in items:
        if "gpu" in item.keywords and not gpu_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "huge" in item.keywords and "huge" not in selected:
            item.add_marker(pytest.mark.skip(reason="runs only when selected with -m huge (minutes, tens of GB of "
                                                    "GPU memory)"))
        if "alone" in item.keywords and hasattr(config, "workerinput"):  # a pytest-xdist worker: not alone
            item.add_marker(pytest.mark.skip(reason="measures GPU time, which other processes' kernels would "
                                                    "lengthen: runs only in a pytest without -n (as "
                                                    "scripts/gpu_check.sh runs it)"))
        if "nvrtc" in item.keywords and not nvrtc_available():
            item.add_marker(pytest.mark.skip(reason="NVRTC not installed (pip install '.[cuda]')"))
