"""Where cupysparse keeps its files on the user's machine."""

from __future__ import annotations

import os


def benchmark_cache_dir() -> str:
    """Directory of the autotuner's benchmark cache: `CUPYSPARSE_BENCHMARK_CACHE_DIR`, else `~/.cache/cupysparse`."""
    return os.environ.get("CUPYSPARSE_BENCHMARK_CACHE_DIR") or os.path.expanduser("~/.cache/cupysparse")
