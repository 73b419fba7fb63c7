"""Choosing algorithms: search spaces, the autotuner and its measurements, the benchmark cache file
and the caches shipped with the package, and the launch plans a layer keeps."""

from cupysparse.tuning.cache_file import BenchmarkCache, cache_file_path, default_cache
from cupysparse.tuning.tuner import Tuner, default_tuner, select_algorithm

__all__ = ["BenchmarkCache", "Tuner", "cache_file_path", "default_cache", "default_tuner", "select_algorithm"]
