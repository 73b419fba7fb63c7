"""The autotuner's persistent benchmark cache: measured results per namespace and problem key.

One msgpack file (never pickle), `settings.benchmark_cache_dir() / CACHE_FILENAME`:

    {"format": "cupysparse-benchmark-cache", "version": 1,
     "namespaces": {namespace: [{"key": [[name, value], ...],
                                 "results": [[algo_name, params, time_ms], ...],   # best first
                                 "kernel_sources": [[filename, digest], ...],
                                 "updated": unix_time}, ...]}}

- Saving locks `<file>.lock`, re-reads the file, merges (for one namespace and key the newer
  measurement wins; entries only on disk are kept) and atomically replaces the file, so several
  processes tuning at once lose nothing. Puts are saved by a debounced background thread and at exit.
- A file that is not a cache of this format (corrupt, truncated, pickle, foreign, an older version)
  is renamed to `<file>.corrupt-<timestamp>` with a warning and the cache starts empty.
- Malformed entries of a file that is otherwise a cache of this format are skipped one by one, with one
  warning per load that counts them and says why; the other entries are used. The next save leaves
  them out and first keeps a copy of the file as it was at `<file>.corrupt-<timestamp>`.
- A file of a newer format version (a later cupysparse's) is neither read nor written, renamed or
  replaced: one warning, and the cache works in memory only.
- A save removes the temporary files of writers that died before renaming theirs into place
  (`_remove_orphaned_temporaries` says why that is safe).
- A directory that cannot be read or written, a full disk, or a shared directory whose files
  another user owns give one warning; the cache then works in memory only, with what it read, and
  the file on disk stays as it was (atomic replace). Where the directory lets several users
  replace the file, they share it: another user's lock file is locked read-only.
- Opened `read_only` (the inspection scripts), nothing is ever written or moved: a bad file raises
  `NotACacheFile` instead (a `NewerCacheFormat` or, once decoded, a `MalformedEntry` where that is the
  problem), an unreadable one its OSError.
- Entries record the digests of the kernel sources they measured (`Algorithm.kernel_sources`, each
  digest covering the project headers the file includes); an entry whose sources changed is stale:
  invisible to `get`, so the tuner measures it again, but listed by `entries` (with
  `changed_sources` saying why) until a new measurement overwrites it.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import fcntl
import functools
import os
import pathlib
import shutil
import tempfile
import threading
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from operator import attrgetter, itemgetter

import msgpack

from cupysparse import settings

CACHE_FILENAME = "benchmark_cache_generic.msgpack"
FORMAT_NAME = "cupysparse-benchmark-cache"
FORMAT_VERSION = 1
ENTRY_FIELDS = ("key", "results", "kernel_sources", "updated")
TEMPORARY_SUFFIX = ".tmp"  # of `_write_atomically`'s files, named `.<cache file name>.<random>.tmp`
SAVE_DELAY_S = 0.5  # a tuning burst of many puts becomes one background save
LOCK_TIMEOUT_S = 30.0
LOCK_POLL_S = 0.005


def cache_file_path() -> pathlib.Path:
    """The cache file, following `CUPYSPARSE_BENCHMARK_CACHE_DIR` as it is now."""
    return pathlib.Path(settings.benchmark_cache_dir()) / CACHE_FILENAME


@dataclass(frozen=True)
class CacheEntry:
    """One measured configuration. `results` are (algo_name, params, time_ms), best first; treat the
    params dicts as read-only, they are shared with the cache."""

    namespace: str
    key: tuple[tuple[str, object], ...]
    results: tuple[tuple[str, dict, float], ...]
    kernel_sources: tuple[tuple[str, str], ...]
    updated: float


class NotACacheFile(ValueError):
    """The file's bytes are not a benchmark cache this version can read."""


class NewerCacheFormat(NotACacheFile):
    """The file is a benchmark cache of a later format version than this cupysparse reads."""


class MalformedEntry(NotACacheFile):
    """An entry of a file that is otherwise a cache of this format is malformed."""


def _frozen(value):
    """msgpack arrays back to tuples (recursively), so keys hash and tile shapes equal the tuples the tuner passed."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(item) for item in value)
    if isinstance(value, dict):
        return {name: _frozen(item) for name, item in value.items()}
    return value


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise TypeError(message)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _normalise_key(key) -> tuple[tuple[str, object], ...]:
    pairs = tuple((name, _frozen(value)) for name, value in (key.items() if isinstance(key, Mapping) else key))
    names = [name for name, _ in pairs]
    _require(all(isinstance(name, str) for name in names), f"cache key names must be strings, got {names}")
    if len(set(names)) != len(names):
        raise ValueError(f"cache key names must be distinct, got {names}")
    hash(pairs)  # a value that cannot identify a configuration (a dict, say) fails here
    return pairs


def _match_key(key: tuple[tuple[str, object], ...]) -> tuple[tuple[str, object], ...]:
    """Keys match whatever order their parameters were given in; the entry keeps the order of its put."""
    return tuple(sorted(key, key=lambda pair: pair[0]))


@functools.lru_cache(maxsize=4096)
def _match_of_hashable(key: tuple) -> tuple[tuple[str, object], ...]:
    return _match_key(_normalise_key(key))


def _match_of(key) -> tuple[tuple[str, object], ...]:
    """`_match_key(_normalise_key(key))`, remembered for hashable keys: a process looks the same few
    hundred keys up again and again (the tuner reads several namespaces per layer)."""
    if isinstance(key, tuple):
        try:
            return _match_of_hashable(key)
        except TypeError:  # an unhashable value (a list, say): normalised, or refused, below
            pass
    return _match_key(_normalise_key(key))


def _normalise_results(results) -> tuple[tuple[str, dict, float], ...]:
    normalised = []
    for name, params, time_ms in results:
        _require(isinstance(name, str), f"an algorithm name must be a string, got {name!r}")
        _require(isinstance(params, Mapping), f"params of {name} must be a mapping, got {params!r}")
        _require(all(isinstance(param, str) for param in params), f"param names of {name} must be strings")
        _require(_is_number(time_ms), f"the time of {name} must be a number, got {time_ms!r}")
        normalised.append((name, _frozen(dict(params)), float(time_ms)))
    return tuple(sorted(normalised, key=lambda result: result[2]))


def _results_from_file(results) -> tuple[tuple[str, dict, float], ...]:
    """`_normalise_results` for decoded results (arrays already tuples), checked in bulk: a cache
    holds thousands of results and is read in the first convolution call of a process."""
    decoded = tuple(sorted(((name, params, float(time_ms)) for name, params, time_ms in results), key=itemgetter(2)))
    _require(
        all(type(name) is str and type(params) is dict and all(type(p) is str for p in params)
            for name, params, _ in decoded),
        "results must be [algorithm name, {param name: value}, time] triples",
    )
    return decoded


def _normalise_sources(kernel_sources) -> tuple[tuple[str, str], ...]:
    pairs = kernel_sources.items() if isinstance(kernel_sources, Mapping) else kernel_sources
    normalised = sorted({(filename, digest) for filename, digest in pairs})  # the tuner passes a set
    _require(
        all(isinstance(filename, str) and isinstance(digest, str) for filename, digest in normalised),
        f"kernel sources must be (filename, digest) strings, got {normalised}",
    )
    return tuple(normalised)


def _make_entry(namespace, key, results, kernel_sources, updated, from_file: bool = False) -> CacheEntry:
    _require(isinstance(namespace, str), f"a namespace must be a string, got {namespace!r}")
    _require(_is_number(updated), f"'updated' must be a unix time, got {updated!r}")
    return CacheEntry(
        namespace,
        _normalise_key(key),
        _results_from_file(results) if from_file else _normalise_results(results),
        _normalise_sources(kernel_sources),
        float(updated),
    )


def _encode_entry(entry: CacheEntry) -> dict:
    return {
        "key": entry.key,
        "results": entry.results,
        "kernel_sources": entry.kernel_sources,
        "updated": entry.updated,
    }


def _refuse_pickle(data: bytes) -> None:
    if data[:1] == b"\x80":  # pickle's PROTO opcode; msgpack would read it as an empty map and then fail
        raise NotACacheFile("a pickle file")


def _check_format(document) -> None:
    """`document` (the file's top-level map) is a cache of this version."""
    if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
        raise NotACacheFile("not a cupysparse benchmark cache")
    version = document.get("version")
    if type(version) is int and version > FORMAT_VERSION:
        raise NewerCacheFormat(f"format version {version}, newer than the {FORMAT_VERSION} this cupysparse reads")
    if version != FORMAT_VERSION:
        raise NotACacheFile(f"format version {version!r}, this cupysparse reads {FORMAT_VERSION}")


def _not_msgpack(error: Exception) -> NotACacheFile:
    return NotACacheFile(f"not valid msgpack ({type(error).__name__}: {error})")


def _reason(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


def _malformed(error: Exception, problem: type[NotACacheFile] = NotACacheFile) -> NotACacheFile:
    return problem(f"a malformed cache ({_reason(error)})")


def _checked_entry(namespace, item) -> CacheEntry:
    """The entry `item` of a decoded file; TypeError or ValueError saying what is wrong with it."""
    _require(isinstance(item, dict), f"an entry must be a map, got {type(item).__name__}")
    _require(all(field in item for field in ENTRY_FIELDS), f"an entry needs the fields {ENTRY_FIELDS}")
    return _make_entry(namespace, item["key"], item["results"], item["kernel_sources"], item["updated"],
                       from_file=True)


def _entry_from_file(namespace, item) -> CacheEntry:
    try:
        return _checked_entry(namespace, item)
    except (TypeError, ValueError) as error:
        raise _malformed(error, MalformedEntry) from error


def _read_document(data: bytes) -> dict:
    """The file's top-level map, when the file is a cache of this format; NotACacheFile otherwise."""
    _refuse_pickle(data)
    try:
        document = msgpack.unpackb(data, raw=False, use_list=False)  # arrays as tuples: hashable, as put
    except (ValueError, TypeError) as error:  # corrupt or truncated bytes
        raise _not_msgpack(error) from error
    _check_format(document)
    return document


def _decode_file(data: bytes) -> tuple[list[CacheEntry], Counter]:
    """The file's entries, and how many malformed ones were skipped by reason: one bad entry costs
    itself only. NotACacheFile when the file as a whole is no cache of this format."""
    namespaces = _read_document(data).get("namespaces")
    if not isinstance(namespaces, dict):
        raise _malformed(TypeError("'namespaces' must be a map"))
    entries, skipped = [], Counter()
    for namespace, items in namespaces.items():
        if not isinstance(items, tuple):
            skipped[f"the value of namespace {namespace!r} is not an array of entries"] += 1
            continue
        for item in items:
            try:
                entries.append(_checked_entry(namespace, item))
            except (TypeError, ValueError) as error:
                skipped[_reason(error)] += 1
    return entries, skipped


def _describe_skipped(skipped: Counter) -> str:
    """'3 malformed entries (2 × reason; 1 × reason)', the three commonest reasons named."""
    total = sum(skipped.values())
    named = "; ".join(f"{count} × {reason}" for reason, count in skipped.most_common(3))
    others = f"; {len(skipped) - 3} other reasons" if len(skipped) > 3 else ""
    return f"{total} malformed entr{'y' if total == 1 else 'ies'} ({named}{others})"


class _FileIndex:
    """A cache file's entries found by key without decoding them. Opening a large file that is only
    read (the shipped tuning results: about 2,000 entries, 1.5 MB) costs one pass that skips over each
    namespace's entries, not the ~100 ms of decoding and checking every entry in a process's first
    convolution; a namespace's keys are indexed when one of its entries is first asked for (a warm
    first forward reads one namespace), and an entry is decoded and checked then, so a malformed one
    raises `NotACacheFile` at that point."""

    def __init__(self, data: bytes):
        _refuse_pickle(data)
        self._data = data
        self._spans: dict[str, tuple[int, int]] = {}  # namespace -> byte range of its entry array
        # namespace -> match key -> byte ranges of the entries with that key (newest wins, as in a merge)
        self._ranges: dict[str, dict[tuple, list[tuple[int, int]]]] = {}
        self._decoded: dict[tuple[str, tuple], CacheEntry] = {}
        unpacker = self._unpacker(data)
        header = {}
        try:
            for _ in range(unpacker.read_map_header()):
                name = unpacker.unpack()
                if name == "namespaces":
                    self._find_namespaces(unpacker)
                else:
                    header[name] = unpacker.unpack()
            if unpacker.tell() != len(data):
                raise ValueError(f"{len(data) - unpacker.tell()} bytes after the cache")
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as error:
            _read_document(data)  # a file that is no cache: raises what reading it whole says about it
            raise _malformed(error) from error
        _check_format(header)

    @staticmethod
    def _unpacker(data: bytes) -> msgpack.Unpacker:
        unpacker = msgpack.Unpacker(raw=False, use_list=False, max_buffer_size=max(len(data), 1))
        unpacker.feed(data)
        return unpacker

    def _find_namespaces(self, unpacker: msgpack.Unpacker) -> None:
        for _ in range(unpacker.read_map_header()):
            namespace = unpacker.unpack()
            _require(isinstance(namespace, str), f"a namespace must be a string, got {namespace!r}")
            begin = unpacker.tell()
            unpacker.skip()
            self._spans[namespace] = (begin, unpacker.tell())  # a repeated name: the last, as a whole read

    def _indexed(self, namespace: str) -> dict[tuple, list[tuple[int, int]]]:
        slot = self._ranges.get(namespace)
        if slot is not None or namespace not in self._spans:
            return slot or {}
        begin, end = self._spans[namespace]
        unpacker, slot = self._unpacker(self._data[begin:end]), {}
        try:
            for _ in range(unpacker.read_array_header()):
                start, key = unpacker.tell(), None
                for _ in range(unpacker.read_map_header()):
                    if unpacker.unpack() == "key":
                        key = unpacker.unpack()
                    else:
                        unpacker.skip()
                _require(key is not None, "an entry has no key")
                # What `_match_key(_normalise_key(key))` gives for a key read with arrays as tuples.
                slot.setdefault(tuple(sorted(key, key=itemgetter(0))), []).append(
                    (begin + start, begin + unpacker.tell()))
        except (ValueError, TypeError, IndexError, msgpack.UnpackException) as error:
            raise _malformed(error, MalformedEntry) from error
        self._ranges[namespace] = slot
        return slot

    def get(self, namespace: str, match: tuple) -> CacheEntry | None:
        ranges = self._indexed(namespace).get(match)
        if ranges is None:
            return None
        entry = self._decoded.get((namespace, match))
        if entry is None:
            entries = [self._decode(namespace, begin, end) for begin, end in ranges]
            entry = self._decoded[(namespace, match)] = max(entries, key=attrgetter("updated"))
        return entry

    def keys(self, namespace: str) -> list[tuple]:
        return list(self._indexed(namespace))

    def _decode(self, namespace: str, begin: int, end: int) -> CacheEntry:
        return _entry_from_file(namespace, msgpack.unpackb(self._data[begin:end], raw=False, use_list=False))

    def all_entries(self) -> dict[str, dict[tuple, CacheEntry]]:
        return {namespace: {match: self.get(namespace, match) for match in self._indexed(namespace)}
                for namespace in self._spans}


def _merge_newer(into: dict[str, dict[tuple, CacheEntry]], entries: Iterable[CacheEntry]) -> None:
    for entry in entries:
        slot = into.setdefault(entry.namespace, {})
        match = _match_key(entry.key)
        if match not in slot or entry.updated > slot[match].updated:
            slot[match] = entry


def _open_lock_file(lock_path: pathlib.Path) -> int:
    try:
        return os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except PermissionError:
        # Another user's lock file in a shared directory: flock needs no write access to the file,
        # so users who may replace the cache file still take turns through it.
        return os.open(lock_path, os.O_RDONLY)


@contextlib.contextmanager
def _exclusive_lock(lock_path: pathlib.Path):
    descriptor = _open_lock_file(lock_path)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"could not lock {lock_path} within {LOCK_TIMEOUT_S:g} s: another process has been saving "
                        "the benchmark cache for that long; if it hangs, stop it (the lock goes with the process)"
                    ) from None
                time.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(descriptor)  # releases the lock


def _temporary_prefix(path: pathlib.Path) -> str:
    return f".{path.name}."


def _is_temporary_of(path: pathlib.Path, name: str) -> bool:
    """Whether `name` is one of `_write_atomically`'s temporaries for `path`. mkstemp's random part has
    no dot, which tells them from the temporaries of a file named `path`'s name plus a dotted suffix."""
    prefix = _temporary_prefix(path)
    if not (name.startswith(prefix) and name.endswith(TEMPORARY_SUFFIX)):
        return False
    return "." not in name[len(prefix):-len(TEMPORARY_SUFFIX)]


def _write_atomically(path: pathlib.Path, data: bytes) -> None:
    """Readers see the old file or the new one, never a part of it, even if this process dies midway.
    Call it holding the file's lock: `_remove_orphaned_temporaries` relies on that."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=_temporary_prefix(path),
                                             suffix=TEMPORARY_SUFFIX)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), 0o644)  # mkstemp's 0600 would hide a shared cache from other users
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def _remove_orphaned_temporaries(path: pathlib.Path) -> None:
    """Remove the temporaries `_write_atomically` left next to `path` when their writer died between
    creating and renaming them (SIGKILL, a power cut). Call it holding the file's lock: every writer
    creates its temporary only while holding that lock, and the lock dies with its holder, so a
    temporary found then belongs to no live writer, however recent it is."""
    try:
        names = os.listdir(path.parent)
    except OSError:  # a directory this user may write but not list: it cannot tell its orphans
        return
    for name in names:
        if _is_temporary_of(path, name):
            with contextlib.suppress(OSError):  # e.g. another user's, in a sticky shared directory: harmless
                os.unlink(path.parent / name)


def _current_source_digest(filename: str) -> str:
    from cupysparse.cuda.compile import source_digest  # imported on use: reading the cache must not pull in the CUDA backend

    return source_digest(filename)


class BenchmarkCache:
    """Tuning results of one cache file, loaded on first use; see the module docstring.

    `read_only`: never write, lock or move the file; `put` and `save` raise PermissionError, a file
    that is no cache raises `NotACacheFile` and one that cannot be read its OSError.
    `current_digests(filename)` gives a kernel source's digest now (default `compile.source_digest`);
    raising FileNotFoundError or KeyError means the source is gone, which makes its entries stale.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        autosave: bool = True,
        *,
        read_only: bool = False,
        current_digests: Callable[[str], str] | None = None,
    ):
        self._path = pathlib.Path(path) if path is not None else cache_file_path()
        self._read_only = read_only
        self._autosave = autosave and not read_only
        self._current_digests = current_digests or _current_source_digest
        self._state_lock = threading.Lock()  # entries, counters, timer, memory-only flag
        self._load_lock = threading.Lock()
        self._save_lock = threading.Lock()  # one save at a time in this process; the lock file orders processes
        self._entries: dict[str, dict[tuple, CacheEntry]] = {}
        self._index: _FileIndex | None = None  # read-only: the file's entries, decoded as asked for
        self._loaded = False
        self._memory_only = False
        self._warned_skipped = False
        self._put_count = 0
        self._saved_put_count = 0
        self._save_timer: threading.Timer | None = None
        if self._autosave:
            _autosaving_caches.add(self)

    @property
    def path(self) -> pathlib.Path:
        return self._path

    def get(self, namespace: str, key) -> CacheEntry | None:
        """The entry of `key` (a dict or a sequence of (name, value) pairs), None when absent or stale."""
        match = _match_of(key)
        self._ensure_loaded()
        with self._state_lock:
            if self._index is not None:
                try:
                    entry = self._index.get(namespace, match)
                except NotACacheFile as problem:
                    raise self._located(problem) from None
            else:
                entry = self._entries.get(namespace, {}).get(match)
        return None if entry is None or self._is_stale(entry) else entry

    def put(self, namespace: str, key, results, kernel_sources=()) -> CacheEntry:
        """Record a measurement (results sorted best-first here), replacing the key's previous entry."""
        self._refuse_if_read_only()
        entry = _make_entry(namespace, key, results, kernel_sources, time.time())
        msgpack.packb(_encode_entry(entry))  # an unstorable value fails here, in the caller, not in a later save
        self._ensure_loaded()
        with self._state_lock:
            self._entries.setdefault(namespace, {})[_match_key(entry.key)] = entry
            self._put_count += 1
        if self._autosave:
            self._schedule_save()
        return entry

    def keys(self, namespace: str) -> list[tuple]:
        """The keys of `namespace`'s entries, each as (name, value) pairs in name order, stale ones
        included; a read-only cache decodes none of its entries for it."""
        self._ensure_loaded()
        with self._state_lock:
            if self._index is None:
                return list(self._entries.get(namespace, {}))
            try:
                return self._index.keys(namespace)
            except NotACacheFile as problem:
                raise self._located(problem) from None

    def entries(self, namespace: str | None = None) -> list[CacheEntry]:
        """All entries, stale ones included, namespaces in name order."""
        self._ensure_decoded()
        with self._state_lock:
            names = sorted(self._entries) if namespace is None else [namespace]
            return [entry for name in names for entry in self._entries.get(name, {}).values()]

    def namespace_counts(self) -> dict[str, int]:
        self._ensure_decoded()
        with self._state_lock:
            return {name: len(slot) for name, slot in sorted(self._entries.items()) if slot}

    def save(self) -> None:
        """Lock the file, re-read it, merge, atomically replace it. Does nothing when nothing was put
        since the last save or when the cache works in memory only; a lock timeout raises TimeoutError."""
        self._refuse_if_read_only()
        self._ensure_loaded()
        with self._save_lock:
            with self._state_lock:
                if self._memory_only or self._put_count == self._saved_put_count:
                    return
                put_count = self._put_count
            try:
                self._path.parent.mkdir(parents=True, exist_ok=True)
                with _exclusive_lock(self._lock_path()):
                    on_disk, skipped = self._read_file(holding_lock=True)
                    with self._state_lock:
                        if self._memory_only:  # a bad file could not be moved aside, or a newer cupysparse's
                            return
                        _merge_newer(self._entries, on_disk)
                        document = self._document()
                    _remove_orphaned_temporaries(self._path)
                    if skipped:  # the file about to be replaced holds entries the new one leaves out
                        self._warn_skipped(skipped, len(on_disk))
                        shutil.copyfile(self._path, self._corrupt_path())
                    _write_atomically(self._path, msgpack.packb(document, use_bin_type=True))
            except TimeoutError:
                raise
            except OSError as error:
                self._fall_back_to_memory(f"cannot write the benchmark cache {self._path} ({error})")
                return
            with self._state_lock:
                self._saved_put_count = put_count

    def flush(self) -> None:
        """Save now what a pending background save would have saved, after one in progress finishes.
        Without autosave nothing is ever pending: call `save`."""
        if not self._autosave:
            return
        with self._state_lock:
            timer, self._save_timer = self._save_timer, None
        if timer is not None:
            timer.cancel()
        self.save()

    def _located(self, problem: NotACacheFile) -> NotACacheFile:
        """`problem`, of the same kind, saying which file it is about."""
        return type(problem)(f"{self._path} is {problem}")

    def _refuse_if_read_only(self) -> None:
        if self._read_only:
            raise PermissionError(f"the benchmark cache {self._path} was opened read-only")

    def _lock_path(self) -> pathlib.Path:
        return self._path.with_name(self._path.name + ".lock")

    def changed_sources(self, entry: CacheEntry) -> list[str]:
        """The kernel files `entry` measured that changed since, or are gone: none when it is fresh.
        A file's digest covers the project headers it includes, so an edited header names its includers."""
        return [filename for filename, digest in entry.kernel_sources if self._digest_now(filename) != digest]

    def _is_stale(self, entry: CacheEntry) -> bool:
        return any(self._digest_now(filename) != digest for filename, digest in entry.kernel_sources)

    def _digest_now(self, filename: str) -> str | None:
        try:
            return self._current_digests(filename)
        except (FileNotFoundError, KeyError):
            return None  # the source is gone

    def _ensure_loaded(self) -> None:
        if self._loaded:
            return
        with self._load_lock:
            if self._loaded:
                return
            if self._read_only:
                self._index = self._read_index()
                self._loaded = True
                return
            try:
                on_disk, skipped = self._read_file(holding_lock=False)
            except OSError as error:
                if self._read_only:  # an inspection of a file it cannot read must say so, not show it empty
                    raise
                self._fall_back_to_memory(f"cannot read the benchmark cache {self._path} ({error})")
                on_disk, skipped = [], Counter()
            if skipped:
                self._warn_skipped(skipped, len(on_disk))
            with self._state_lock:
                _merge_newer(self._entries, on_disk)
            self._loaded = True

    def _ensure_decoded(self) -> None:
        """Every entry decoded (a read-only cache decodes them as asked for)."""
        self._ensure_loaded()
        with self._state_lock:
            if self._index is not None:
                try:
                    self._entries = self._index.all_entries()
                except NotACacheFile as problem:
                    raise self._located(problem) from None
                self._index = None

    def _read_index(self) -> _FileIndex | None:
        try:
            data = self._path.read_bytes()
        except FileNotFoundError:
            return None  # no file, no entries
        try:
            return _FileIndex(data)
        except NotACacheFile as problem:
            raise self._located(problem) from None

    def _read_file(self, holding_lock: bool) -> tuple[list[CacheEntry], Counter]:
        """The file's entries and its malformed ones skipped by reason, none when there is no file; a file
        that is no cache of ours is moved aside, one of a newer format left alone."""
        try:
            data = self._path.read_bytes()
        except FileNotFoundError:
            return [], Counter()
        try:
            return _decode_file(data)
        except NewerCacheFormat as problem:
            # What a later cupysparse saved there may mean something else in this version: neither read
            # nor moved, and never replaced by this version's save (which would lose it).
            self._fall_back_to_memory(f"the benchmark cache {self._path} is {problem}: a newer cupysparse wrote it "
                                      "and this one leaves it as it is")
            return [], Counter()
        except NotACacheFile as problem:
            if self._read_only:
                raise self._located(problem) from None
            reason = str(problem)
        if not holding_lock:  # decide again under the lock: another process may have just replaced the bad file
            with _exclusive_lock(self._lock_path()):
                return self._read_file(holding_lock=True)
        self._set_aside(reason)
        return [], Counter()

    def _corrupt_path(self) -> pathlib.Path:
        return self._path.with_name(f"{self._path.name}.corrupt-{datetime.datetime.now():%Y%m%d-%H%M%S-%f}")

    def _warn_skipped(self, skipped: Counter, kept: int) -> None:
        """One warning per load about the malformed entries of the file, also when a save meets them again."""
        with self._state_lock:
            first = not self._warned_skipped
            self._warned_skipped = True
        if first:
            warnings.warn(
                f"the benchmark cache {self._path} holds {_describe_skipped(skipped)}: skipped them, the other {kept} "
                "are used; saving leaves them out, after keeping the file as it was at "
                f"{self._path.name}.corrupt-<time>",
                RuntimeWarning,
                stacklevel=3,
            )

    def _set_aside(self, reason: str) -> None:
        aside = self._corrupt_path()
        try:
            os.replace(self._path, aside)
        except OSError as error:
            self._fall_back_to_memory(
                f"the benchmark cache {self._path} is {reason} and could not be moved aside ({error})"
            )
            return
        warnings.warn(
            f"the benchmark cache {self._path} is {reason}; moved it to {aside} and starting with an empty cache",
            RuntimeWarning,
            stacklevel=2,
        )

    def _fall_back_to_memory(self, message: str) -> None:
        with self._state_lock:
            first = not self._memory_only
            self._memory_only = True
        if first:
            warnings.warn(f"{message}; tuning results are kept in memory only", RuntimeWarning, stacklevel=2)

    def _document(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "namespaces": {
                name: [_encode_entry(entry) for entry in slot.values()] for name, slot in sorted(self._entries.items())
            },
        }

    def _schedule_save(self) -> None:
        with self._state_lock:
            if self._save_timer is not None or self._memory_only:
                return
            self._save_timer = threading.Timer(SAVE_DELAY_S, self._save_in_background)
            self._save_timer.daemon = True  # a pending save at exit is done by the exit hook instead
            self._save_timer.start()

    def _save_in_background(self) -> None:
        with self._state_lock:
            self._save_timer = None  # puts from here on schedule the next save
        try:
            self.save()
        except TimeoutError as error:  # the puts stay unsaved; the next save or the exit hook retries
            warnings.warn(str(error), RuntimeWarning, stacklevel=1)


def open_for_reading(path: pathlib.Path, decode: bool = True) -> BenchmarkCache:
    """The cache file at `path`, read now and never written; NotACacheFile when it is no cache.
    `decode=False` reads its keys only: each entry is decoded and checked when first asked for (where
    a malformed one raises NotACacheFile), for a large file of which a process needs a few entries."""
    cache = BenchmarkCache(path=path, read_only=True)
    if decode:
        cache.entries()
    else:
        cache._ensure_loaded()
    return cache


_autosaving_caches: weakref.WeakSet[BenchmarkCache] = weakref.WeakSet()
_default_cache: BenchmarkCache | None = None
_default_cache_lock = threading.Lock()


def default_cache() -> BenchmarkCache:
    """The process-wide cache; a new one when the cache path changed (e.g. the environment variable)."""
    global _default_cache
    path = cache_file_path()
    with _default_cache_lock:
        if _default_cache is None or _default_cache.path != path:
            _default_cache = BenchmarkCache(path)
        return _default_cache


@atexit.register
def _flush_at_exit() -> None:
    for cache in list(_autosaving_caches):
        try:
            cache.flush()
        except TimeoutError as error:
            warnings.warn(f"benchmark cache not saved at exit: {error}", RuntimeWarning, stacklevel=1)
