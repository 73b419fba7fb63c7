"""What the tuning-cache tests share: a run the tuner must not call, and an empty user cache and
shipped folder of each test's own (the environment variables that steer the tuner cleared)."""

import pytest

from cupysparse import settings
from cupysparse.tuning import shipped as shipped_cache

STEERING_VARIABLES = ("CUPYSPARSE_SHIPPED_CACHE", "CUPYSPARSE_AUTOTUNE", "CUPYSPARSE_FWD_ALGO_MODE",
                      "CUPYSPARSE_BWD_ALGO_MODE", settings.PREFETCH.name)


class NotMeasured(Exception):
    """Raised by a run the tuner must not call: calling it means the tuner set out to measure."""


def must_not_run(algorithm, params):
    raise NotMeasured(f"the tuner measured {algorithm.name} {params}")


@pytest.fixture(autouse=True)
def caches(tmp_path, monkeypatch):
    """An empty user cache and an empty shipped folder of this test's own."""
    monkeypatch.setenv("CUPYSPARSE_BENCHMARK_CACHE_DIR", str(tmp_path / "user"))
    for name in STEERING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(shipped_cache, "SHIPPED_CACHE_DIR", tmp_path / "shipped")
    shipped_cache.forget_shipped_caches()
    yield
    shipped_cache.forget_shipped_caches()
