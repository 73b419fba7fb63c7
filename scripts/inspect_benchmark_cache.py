"""Look inside the autotuner's benchmark cache.

    cupysparse-inspect-benchmark-cache                          # location, size, age, namespace tree
    cupysparse-inspect-benchmark-cache namespace=sparse_conv_forward
    cupysparse-inspect-benchmark-cache namespace=sparse_conv_forward --best-only
    cupysparse-inspect-benchmark-cache namespace=sparse_conv_forward --top-k 3
    cupysparse-inspect-benchmark-cache wmma                     # search every namespace
    cupysparse-inspect-benchmark-cache namespace=sparse_conv_forward wmma float16
    cupysparse-inspect-benchmark-cache --cache-file other_machine.msgpack
    cupysparse-inspect-benchmark-cache --shipped sm_90          # the tuning file this install ships

Search words match case-insensitively as substrings of the namespace name, the configuration
parameters (names and values) and the measured results (algorithm names and parameters); a
configuration is shown when it matches every word. The cache is only read, never written.

A configuration is stale when a kernel file it measured (or a header that file includes) changed
since: the library ignores it, and measures again when it meets the problem. The summary counts the
stale ones, also in the shipped files; a stale configuration is marked where it is shown.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import stat
import sys
from collections import Counter

from cupysparse.tuning.cache_file import (
    BenchmarkCache,
    CacheEntry,
    MalformedEntry,
    NewerCacheFormat,
    NotACacheFile,
    cache_file_path,
    open_for_reading,
)
from cupysparse.tuning.shipped import (
    check_shipped_file,
    shipped_architecture,
    shipped_cache_path,
    shipped_cache_paths,
    shipped_caches_enabled,
)

RULE = "-" * 40
BANNER = "=" * 60


def format_result(algorithm: str, params: dict, time_ms: float) -> list[str]:
    """One result of a configuration: on one line without parameters (`["explicit_gemm", {}, 2.107]`),
    else spelled out over several lines, one parameter a line, so the parameters are easy to read."""
    if not params:
        return [f"    [{json.dumps(algorithm)}, {{}}, {time_ms:.3f}]"]
    return ["    [", f"      {json.dumps(algorithm)}", "      {",
            *(f"        {name}: {value}" for name, value in params.items()),
            "      }", f"      {time_ms:.3f}", "    ]"]


def format_configuration(number: int, entry: CacheEntry, top_k: int | None, changed_sources: list[str]) -> str:
    stale = f" (stale: {', '.join(changed_sources)} changed since measured; ignored)" if changed_sources else ""
    lines = [RULE, f"Configuration {number}{stale}:", RULE, "Config Parameters:"]
    lines.extend(f"  {name}: {value}" for name, value in entry.key)
    lines += ["", "Results:"]
    results = entry.results[:top_k]  # the cache keeps them best first
    if not results:
        lines.append("  []")
        return "\n".join(lines)
    lines.append("  [")
    for result in results:
        lines.extend(format_result(*result))
    lines.append("  ]")
    return "\n".join(lines)


def search_text(namespace: str, entry: CacheEntry) -> str:
    parts = [namespace]
    for name, value in entry.key:
        parts += [name, str(value)]
    for algorithm, params, _ in entry.results:
        parts.append(algorithm)
        for name, value in params.items():
            parts += [name, str(value)]
    return "\n".join(parts).lower()


def matches(namespace: str, entry: CacheEntry, words: list[str]) -> bool:
    text = search_text(namespace, entry)
    return all(word in text for word in words)


def human_size(num_bytes: int) -> str:
    if num_bytes < 1024:
        return f"{num_bytes} B"
    if num_bytes < 1024**2:
        return f"{num_bytes / 1024:.1f} KiB"
    return f"{num_bytes / 1024**2:.1f} MiB"


def stale_counts(cache: BenchmarkCache) -> tuple[Counter, Counter]:
    """Stale configurations by namespace, and by the kernel file that changed."""
    by_namespace, by_source = Counter(), Counter()
    for entry in cache.entries():
        changed = cache.changed_sources(entry)
        if changed:
            by_namespace[entry.namespace] += 1
            by_source.update(changed)
    return by_namespace, by_source


def print_summary(path: pathlib.Path, cache: BenchmarkCache) -> None:
    stat = path.stat()
    modified = datetime.datetime.fromtimestamp(stat.st_mtime).strftime("%Y-%m-%d %H:%M:%S")
    counts = cache.namespace_counts()
    stale, stale_sources = stale_counts(cache)
    print(f"Cache file:    {path}")
    print(f"Size:          {stat.st_size:,} bytes ({human_size(stat.st_size)})")
    print(f"Last modified: {modified}")
    print()
    print_namespace_tree(counts, stale)
    print(f"Stale: {sum(stale.values())} of {sum(counts.values())} configurations (a kernel file they measured "
          "changed since; the library ignores them)")
    if stale_sources:
        print("  changed: " + ", ".join(f"{name} ({count})" for name, count in sorted(stale_sources.items())))
    # A cache holds timings of one GPU architecture; several here means it was merged from different machines.
    architectures: dict[str, int] = {}
    for entry in cache.entries():
        architecture = dict(entry.key).get("compute_capability")
        if architecture is not None:
            architectures[str(architecture)] = architectures.get(str(architecture), 0) + 1
    if architectures:
        listed = ", ".join(f"{name} ({count})" for name, count in sorted(architectures.items()))
        print(f"Compute capabilities: {listed}")
    print("\nShow one namespace with: namespace=NAME   (search with extra words, e.g. wmma)")


def print_namespace_tree(counts: dict[str, int], stale: Counter) -> None:
    """Every namespace with its number of configurations (the cache's entries), under a banner."""
    print(BANNER, "NAMESPACE TREE", BANNER, f"Total namespaces: {len(counts)}", "", sep="\n")
    for namespace in sorted(counts):
        marked = f" ({stale[namespace]} stale)" if stale[namespace] else ""
        print(f"- {namespace}: {counts[namespace]} entry(ies){marked}")
    print()


def print_shipped_summary() -> None:
    """The shipped files the library reads where the user's cache has no entry, with their stale counts."""
    paths = shipped_cache_paths()
    if not paths:
        return
    off = "" if shipped_caches_enabled() else "; turned off by CUPYSPARSE_SHIPPED_CACHE=0"
    print(f"\nShipped tuning files (used where this cache has no entry{off}):")
    for path in paths:
        try:
            result = check_shipped_file(path)
        except (NotACacheFile, OSError) as error:
            print(f"  {shipped_architecture(path)}  cannot be read: {error}")
            continue
        print(f"  {result.architecture}  {result.entries} configurations, {result.stale} stale  {path}")
    print("Show one with: --shipped ARCH")


def print_namespace(cache: BenchmarkCache, namespace: str, entries: list[CacheEntry], total: int, words: list[str],
                    top_k: int | None):
    described = (
        f'{len(entries)} of {total} configurations match "{" ".join(words)}"' if words else f"{total} configurations"
    )
    print(f"Namespace: {namespace} ({described})")
    for number, entry in enumerate(entries, start=1):
        print(format_configuration(number, entry, top_k, cache.changed_sources(entry)))
        print()


def search_all(cache: BenchmarkCache, words: list[str], top_k: int | None) -> None:
    counts = cache.namespace_counts()
    named = [ns for ns in sorted(counts) if all(word in ns.lower() for word in words)]
    if named:
        print("Namespaces matching: " + ", ".join(f"{ns} ({counts[ns]})" for ns in named))
    found = False
    for namespace in sorted(counts):
        hits = [entry for entry in cache.entries(namespace) if matches(namespace, entry, words)]
        if hits:
            found = True
            print()
            print_namespace(cache, namespace, hits, counts[namespace], words, top_k)
    if not found:
        print(f'Nothing in the cache matches "{" ".join(words)}".')


def what_is_in_the_way(path: pathlib.Path) -> str | None:
    """What keeps a cache file from being at `path` ("is a directory, not a cache file"), or None for a
    file or nothing there (where `path.is_file()` alone would call a directory, say, "no cache yet")."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:  # nothing there, or a link to nothing: the first save writes the file
        return None
    except OSError as error:  # a parent that is a file, or one this user may not search
        return f"cannot be reached ({error})"
    if stat.S_ISREG(mode):
        return None
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a named pipe", stat.S_ISSOCK: "a socket",
             stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    kind = next((kind for is_kind, kind in kinds.items() if is_kind(mode)), "something other than a file")
    return f"is {kind}, not a benchmark cache file"


def report_what_is_in_the_way(path: pathlib.Path, users_cache: bool) -> bool:
    """Say on stderr what sits at `path` where a cache file should be; False when nothing is in the way."""
    in_the_way = what_is_in_the_way(path)
    if in_the_way is None:
        return False
    print(f"{path} {in_the_way}.", file=sys.stderr)
    if users_cache:
        print("The library can neither read nor write its cache there, and keeps tuning results in memory "
              "only: move that away, or point CUPYSPARSE_BENCHMARK_CACHE_DIR at another directory.",
              file=sys.stderr)
    return True


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("words", nargs="*", help="namespace=NAME to show one namespace; other words search")
    limit = parser.add_mutually_exclusive_group()
    limit.add_argument("--best-only", action="store_true", help="show only the fastest result of each configuration")
    limit.add_argument("--top-k", type=int, metavar="K", help="show the K fastest results of each configuration")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--cache-file", type=pathlib.Path, help="inspect this file instead of the user's cache")
    source.add_argument("--shipped", metavar="ARCH", help="inspect this install's shipped tuning file of ARCH (sm_90)")
    return parser


def parse_args(argv=None, prog: str | None = None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.top_k is not None and args.top_k < 1:
        parser.error("--top-k must be at least 1")
    namespaces = [word.split("=", 1)[1] for word in args.words if word.startswith("namespace=")]
    if len(namespaces) > 1:
        parser.error("give namespace=NAME at most once")
    args.namespace = namespaces[0] if namespaces else None
    args.search = [word.lower() for word in args.words if not word.startswith("namespace=")]
    return args


def main(argv=None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    if args.shipped is not None:
        path = shipped_cache_path(args.shipped)
        if not path.is_file():
            shipped = ", ".join(shipped_architecture(p) for p in shipped_cache_paths()) or "none"
            print(f"This install ships no tuning file for {args.shipped} (it ships: {shipped}).", file=sys.stderr)
            return 1
    else:
        path = args.cache_file or cache_file_path()
    users_cache = args.cache_file is None and args.shipped is None
    if report_what_is_in_the_way(path, users_cache):
        return 1
    if not path.exists():
        link = f": it is a symbolic link to {os.readlink(path)}, which does not exist" if path.is_symlink() else ""
        print(f"No benchmark cache at {path} yet{link}.")
        print("It is written the first time a convolution is tuned, or by cupysparse-populate-benchmark-cache.")
        if users_cache:
            print_shipped_summary()
        return 0
    try:
        cache = open_for_reading(path)
    except NewerCacheFormat as problem:
        print(f"{problem}: a later cupysparse wrote it. This one leaves it as it is, never reading or overwriting "
              "it, and keeps its tuning results in memory only.", file=sys.stderr)
        return 1
    except MalformedEntry as problem:
        print(f"Cannot read {problem}. The library skips the malformed entries and uses the others; its next save "
              "leaves them out, keeping the file as it was at ….corrupt-<time>.", file=sys.stderr)
        return 1
    except NotACacheFile as problem:
        print(f"Cannot read {problem}. The library moves such a file aside the next time it tunes.", file=sys.stderr)
        return 1
    except OSError as error:  # e.g. another user's cache file in a shared directory
        print(f"Cannot read {path}: {error}", file=sys.stderr)
        return 1
    top_k = 1 if args.best_only else args.top_k
    if args.namespace is None:
        if args.search:
            search_all(cache, args.search, top_k)
        else:
            print_summary(path, cache)
            if users_cache:
                print_shipped_summary()
        return 0
    counts = cache.namespace_counts()
    if args.namespace not in counts:
        print(f"Unknown namespace {args.namespace!r}. Namespaces in {path}:", file=sys.stderr)
        for namespace in sorted(counts):
            print(f"  {namespace} ({counts[namespace]})", file=sys.stderr)
        return 1
    entries = [entry for entry in cache.entries(args.namespace) if matches(args.namespace, entry, args.search)]
    print_namespace(cache, args.namespace, entries, counts[args.namespace], args.search, top_k)
    return 0


if __name__ == "__main__":
    sys.exit(main())
