"""Tuning results shipped with the package, and the cache the default tuner reads: the user's
benchmark cache first, the shipped results where it has no entry.

Shipped files live in the package folder `shipped_caches/`, one per GPU architecture,
`benchmark_cache_sm_90.msgpack`, in the benchmark cache's own format;
`cupysparse-populate-shipped-cache` writes them from the reference networks' layers on the demo
scenes. A key is looked up in the file of its `compute_capability` only, so CPU keys and other
architectures never match. Shipped entries follow the user's rules: an entry whose kernel sources
changed since it was measured is stale and ignored (the tuner measures that algorithm on the user's
GPU; the other algorithms' shipped entries still serve), so a kernel edit needs no re-measured file
to be correct. A release checks that the files match the sources (`check_shipped_file`, run by
`cupysparse-populate-shipped-cache --check`). A missing file means no shipped entries; a file that
is no cache is ignored with one warning. The file is read by key (`open_for_reading(decode=False)`):
a process decodes only the entries it asks for, and a malformed entry, found when asked for, makes
the file ignored from then on, with the same one warning. The user's own measurements always win,
and nothing is ever written to a shipped file. `CUPYSPARSE_SHIPPED_CACHE=0` turns the shipped
results off (to measure a cold start, or to tune everything on this machine).

`TuningCache` also records which (namespace, key) pairs the tuner asked for, so that ranks of a
distributed job can compare what they chose (`cupysparse.tuning.agreement`).
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from cupysparse import settings
from cupysparse.tuning.cache_file import BenchmarkCache, CacheEntry, NotACacheFile, default_cache, open_for_reading

SHIPPED_CACHE_DIR = Path(__file__).resolve().parent / "shipped_caches"

_shipped: dict[str, BenchmarkCache | None] = {}  # by architecture; None: no usable file
_shipped_lock = threading.Lock()


def shipped_cache_path(architecture: str) -> Path:
    """The shipped file of `architecture` ('sm_90'), whether it exists or not."""
    return SHIPPED_CACHE_DIR / f"benchmark_cache_{architecture}.msgpack"


def shipped_cache_paths() -> list[Path]:
    """The shipped files of this install, in architecture order."""
    return sorted(SHIPPED_CACHE_DIR.glob("benchmark_cache_sm_*.msgpack"))


def shipped_architecture(path: Path) -> str:
    """The architecture a shipped file serves, from its name ('sm_90')."""
    return path.stem.removeprefix("benchmark_cache_")


def shipped_caches_enabled() -> bool:
    return settings.shipped_cache()


def _shipped_cache(architecture: str) -> BenchmarkCache | None:
    with _shipped_lock:
        if architecture not in _shipped:
            _shipped[architecture] = _open_shipped(shipped_cache_path(architecture))
        return _shipped[architecture]


def _open_shipped(path: Path) -> BenchmarkCache | None:
    if not path.is_file():
        return None
    try:
        return open_for_reading(path, decode=False)  # a process asks for a few dozen of its entries
    except (NotACacheFile, OSError) as error:  # read once per process, so this warns once
        _warn_ignoring(path, error)
        return None


def _warn_ignoring(path: Path, error: Exception) -> None:
    warnings.warn(f"ignoring the shipped tuning cache {path}: {error}", RuntimeWarning, stacklevel=5)


def _read_shipped(architecture: str, read, nothing):
    """`read(cache)` of the shipped file of `architecture`, or `nothing` when there is none or shipped
    results are turned off. A malformed entry makes the file ignored from now on, with one warning."""
    if not shipped_caches_enabled():
        return nothing
    cache = _shipped_cache(architecture)
    if cache is None:
        return nothing
    try:
        return read(cache)
    except NotACacheFile as error:
        with _shipped_lock:
            _shipped[architecture] = None
        _warn_ignoring(cache.path, error)
        return nothing


def shipped_entry(namespace: str, key) -> CacheEntry | None:
    """The shipped entry of `key` (a sequence of (name, value) pairs), None when there is none, it is
    stale, or shipped results are turned off."""
    architecture = dict(key).get("compute_capability")
    if not isinstance(architecture, str) or not architecture.startswith("sm_"):
        return None
    return _read_shipped(architecture, lambda cache: cache.get(namespace, key), None)


def shipped_keys(namespace: str) -> list[tuple]:
    """The keys of every shipped file's entries in `namespace`, as `BenchmarkCache.keys`; none when
    shipped results are turned off."""
    architectures = [shipped_architecture(path) for path in shipped_cache_paths()]
    return [key for architecture in architectures
            for key in _read_shipped(architecture, lambda cache: cache.keys(namespace), [])]


def forget_shipped_caches() -> None:
    """Read the shipped files again at their next use (after one was replaced)."""
    with _shipped_lock:
        _shipped.clear()


@dataclass(frozen=True)
class ShippedFileCheck:
    """How a shipped file stands against the kernel sources of this tree (`check_shipped_file`)."""

    path: Path
    architecture: str
    entries: int
    stale: int
    # Kernel file -> the stale entries that measured another version of it (or a file now gone).
    stale_by_source: dict[str, int]
    # Entries keyed for another architecture: never looked up in this file.
    other_architecture: int

    @property
    def fresh(self) -> int:
        return self.entries - self.stale

    @property
    def passes(self) -> bool:
        return self.stale == 0 and self.other_architecture == 0


def check_shipped_file(path: Path) -> ShippedFileCheck:
    """Count the entries of the shipped file at `path` that the runtime would ignore: stale ones (by the
    kernel files that changed) and those of another architecture. Raises NotACacheFile or OSError when
    the file cannot be read as a cache."""
    cache = open_for_reading(path)
    architecture = shipped_architecture(path)
    entries = cache.entries()
    changed = [cache.changed_sources(entry) for entry in entries]
    return ShippedFileCheck(
        path=path,
        architecture=architecture,
        entries=len(entries),
        stale=sum(1 for files in changed if files),
        stale_by_source=dict(sorted(Counter(name for files in changed for name in files).items())),
        other_architecture=sum(1 for entry in entries if dict(entry.key).get("compute_capability") != architecture),
    )


class TuningCache:
    """What the default tuner reads and writes: `get` answers from the user's cache
    (`benchmark_cache.default_cache()`, following `CUPYSPARSE_BENCHMARK_CACHE_DIR`), else from the
    shipped file of the key's architecture; everything else is the user's cache's."""

    def __init__(self):
        self._asked: dict[tuple[str, tuple], None] = {}  # insertion-ordered set
        self._asked_lock = threading.Lock()

    @property
    def user(self) -> BenchmarkCache:
        return default_cache()

    @property
    def path(self) -> Path:
        return self.user.path

    def get(self, namespace: str, key) -> CacheEntry | None:
        pairs = tuple(key.items()) if isinstance(key, dict) else tuple(key)
        with self._asked_lock:
            self._asked[(namespace, pairs)] = None
        entry = self.user.get(namespace, pairs)
        return entry if entry is not None else shipped_entry(namespace, pairs)

    def keys(self, namespace: str) -> list[tuple]:
        """The keys `get` may answer in `namespace`: the user's cache's and the shipped files', each once."""
        return list(dict.fromkeys([*self.user.keys(namespace), *shipped_keys(namespace)]))

    def put(self, namespace: str, key, results, kernel_sources=()) -> CacheEntry:
        return self.user.put(namespace, key, results, kernel_sources)

    def flush(self) -> None:
        self.user.flush()

    def asked(self) -> list[tuple[str, tuple]]:
        """Every (namespace, key) looked up in this process, in first-asked order."""
        with self._asked_lock:
            return list(self._asked)


_tuning_cache = TuningCache()


def tuning_cache() -> TuningCache:
    """The process-wide `TuningCache` of the default tuner."""
    return _tuning_cache
