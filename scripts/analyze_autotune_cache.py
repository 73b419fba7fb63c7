"""Study what the autotuner measured: which algorithms win, where, by how much, and what `auto` should try.

    cupysparse-analyze-autotune-cache
    cupysparse-analyze-autotune-cache --namespace sparse_conv_forward --tolerance 0.05
    cupysparse-analyze-autotune-cache --markdown --output analysis.md --plot win_rates.png

Each namespace (default: sparse_conv_forward and sparse_conv_backward) is analysed on its own:

- win rate: share of configurations whose fastest result is the algorithm; top-3 rate: share whose
  three fastest results include it (any of its parameter settings); measured: configurations that
  timed it at all.
- wins by channel pair (in_channels -> out_channels), by kernel volume and by problem size (the
  log_num_in_coords bucket of the key, i.e. N_in <= 2^k).
- margins: runner-up time / best time, for the runner-up among all results and for the fastest
  result of a different algorithm: median and share of configurations within 5% and 10%.
- recommended candidate set: a candidate is an (algorithm, parameters) pair; it covers a
  configuration when it was measured there within --tolerance (10%) of the best time. Greedy set
  cover: start empty, repeatedly add the candidate covering the most configurations not yet covered
  (ties: most covered overall, then name) until --coverage (95%) of the configurations are covered.
  Greedy is not guaranteed minimal (it is within a ln(n) factor of it) but with a handful of
  candidates it usually is. This is the reduced set `auto` should try.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import statistics
import sys
from collections import Counter

from cupysparse.scripts.inspect_benchmark_cache import report_what_is_in_the_way
from cupysparse.tuning.cache_file import BenchmarkCache, CacheEntry, NotACacheFile, cache_file_path, open_for_reading

DEFAULT_NAMESPACES = ("sparse_conv_forward", "sparse_conv_backward")
TOP_K = 3
MARGIN_THRESHOLDS = (0.05, 0.10)


@dataclasses.dataclass(frozen=True)
class Candidate:
    algorithm: str
    params: tuple[tuple[str, object], ...]

    @classmethod
    def of(cls, algorithm: str, params: dict) -> Candidate:
        return cls(algorithm, tuple(sorted(params.items())))  # the cache stores list values as tuples

    @property
    def label(self) -> str:
        if not self.params:
            return self.algorithm
        return f"{self.algorithm}(" + ", ".join(f"{name}={value}" for name, value in self.params) + ")"


@dataclasses.dataclass
class AlgorithmStats:
    wins: int = 0
    top_k: int = 0
    measured: int = 0


def algorithm_stats(entries: list[CacheEntry]) -> dict[str, AlgorithmStats]:
    """Per algorithm name: configurations won, with it among the TOP_K fastest, and measured at all."""
    stats: dict[str, AlgorithmStats] = {}
    for entry in entries:
        for algorithm in {result[0] for result in entry.results}:
            stats.setdefault(algorithm, AlgorithmStats()).measured += 1
        for algorithm in {result[0] for result in entry.results[:TOP_K]}:
            stats[algorithm].top_k += 1
        stats[entry.results[0][0]].wins += 1
    return dict(sorted(stats.items(), key=lambda item: (-item[1].wins, -item[1].top_k, item[0])))


def _sort_key(value):
    """Numbers in numeric order before anything else in text order."""
    if isinstance(value, tuple):
        return tuple(_sort_key(item) for item in value)
    return (0, value, "") if isinstance(value, (int, float)) else (1, 0, str(value))


def wins_by(entries: list[CacheEntry], group_of) -> dict[object, Counter]:
    """Winning algorithm counts per group, groups in natural order; `group_of(key_dict)` names the group."""
    groups: dict[object, Counter] = {}
    for entry in entries:
        groups.setdefault(group_of(dict(entry.key)), Counter())[entry.results[0][0]] += 1
    return dict(sorted(groups.items(), key=lambda item: _sort_key(item[0])))


def channel_pair(key: dict):
    return (key.get("in_channels", "?"), key.get("out_channels", "?"))


def kernel_volume(key: dict):
    return key.get("kernel_volume", "?")


def size_bucket(key: dict):
    return key.get("log_num_in_coords", "?")


@dataclasses.dataclass
class Margins:
    ratios: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    def share_within(self, tolerance: float) -> float:
        return sum(ratio <= 1 + tolerance for ratio in self.ratios) / len(self.ratios)


def runner_up_margins(entries: list[CacheEntry]) -> tuple[Margins, Margins]:
    """Runner-up / best time: (runner-up among all results, fastest result of another algorithm).

    Configurations without such a runner-up are left out of the respective list."""
    any_runner_up, other_algorithm = [], []
    for entry in entries:
        best_algorithm, _, best_time = entry.results[0]
        if len(entry.results) > 1:
            any_runner_up.append(entry.results[1][2] / best_time)
        other = next((time for algorithm, _, time in entry.results[1:] if algorithm != best_algorithm), None)
        if other is not None:
            other_algorithm.append(other / best_time)
    return Margins(any_runner_up), Margins(other_algorithm)


def recommended_candidates(entries: list[CacheEntry], tolerance: float, coverage: float) -> list[tuple[Candidate, int]]:
    """Greedy set cover (see the module docstring): [(candidate, configurations covered so far)]."""
    covers: dict[Candidate, set[int]] = {}
    for index, entry in enumerate(entries):
        limit = entry.results[0][2] * (1 + tolerance)
        for algorithm, params, time in entry.results:
            if time <= limit:
                covers.setdefault(Candidate.of(algorithm, params), set()).add(index)
    # A small epsilon so that e.g. 0.95 * 20 asks for 19 configurations, not 20, despite rounding.
    target = math.ceil(coverage * len(entries) - 1e-9)
    chosen: list[tuple[Candidate, int]] = []
    covered: set[int] = set()
    remaining = sorted(covers, key=lambda candidate: candidate.label)
    while len(covered) < target:
        best = max(remaining, key=lambda candidate: (len(covers[candidate] - covered), len(covers[candidate])))
        remaining.remove(best)
        covered |= covers[best]
        chosen.append((best, len(covered)))
    return chosen


# ---- the report: a list of blocks rendered as plain text or Markdown ----


@dataclasses.dataclass
class Heading:
    text: str
    level: int


@dataclasses.dataclass
class Paragraph:
    text: str


@dataclasses.dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]
    left_columns: int = 1  # leading columns of names, left-aligned; the rest are numbers, right-aligned


def percent(share: float) -> str:
    return f"{100 * share:.1f}%"


def group_table(title: str, header: str, groups: dict[object, Counter], algorithms: list[str], label) -> Table:
    rows = [
        [label(group), str(sum(counts.values()))] + [str(counts[algorithm]) for algorithm in algorithms]
        for group, counts in groups.items()
    ]
    return Table(title, [header, "configs"] + algorithms, rows)


def namespace_report(namespace: str, entries: list[CacheEntry], tolerance: float, coverage: float) -> list:
    count = len(entries)
    stats = algorithm_stats(entries)
    algorithms = list(stats)
    blocks: list = [Heading(f"{namespace} ({count} configurations)", 2)]
    blocks.append(
        Table(
            "Algorithms",
            ["algorithm", "wins", "win rate", f"top-{TOP_K} rate", "measured"],
            [
                [name, str(s.wins), percent(s.wins / count), percent(s.top_k / count), str(s.measured)]
                for name, s in stats.items()
            ],
        )
    )
    blocks.append(
        group_table(
            "Wins by channel pair",
            "C_in -> C_out",
            wins_by(entries, channel_pair),
            algorithms,
            lambda pair: f"{pair[0]} -> {pair[1]}",
        )
    )
    blocks.append(
        group_table("Wins by kernel volume", "kernel volume", wins_by(entries, kernel_volume), algorithms, str)
    )
    blocks.append(
        group_table(
            "Wins by problem size",
            "N_in",
            wins_by(entries, size_bucket),
            algorithms,
            lambda log: f"<= 2^{log}" if isinstance(log, int) else str(log),
        )
    )
    margin_rows = []
    for label, margins in zip(("any runner-up", "other algorithm"), runner_up_margins(entries)):
        if margins.ratios:
            within = [percent(margins.share_within(threshold)) for threshold in MARGIN_THRESHOLDS]
            margin_rows.append([label, str(len(margins.ratios)), f"{margins.median:.3f}"] + within)
        else:
            margin_rows.append([label, "0", "-"] + ["-"] * len(MARGIN_THRESHOLDS))
    blocks.append(
        Table(
            "Margins (runner-up time / best time)",
            ["runner-up", "configs", "median ratio"] + [f"within {percent(t)}" for t in MARGIN_THRESHOLDS],
            margin_rows,
        )
    )
    chosen = recommended_candidates(entries, tolerance, coverage)
    blocks.append(
        Table(
            f"Recommended candidate set (within {percent(tolerance)} of the best on >= {percent(coverage)})",
            ["#", "candidate", "cumulative coverage"],
            [
                [str(rank), candidate.label, f"{covered}/{count} ({percent(covered / count)})"]
                for rank, (candidate, covered) in enumerate(chosen, start=1)
            ],
            left_columns=2,
        )
    )
    blocks.append(
        Paragraph(
            "Greedy set cover: a candidate covers a configuration where it was measured within the tolerance of "
            "the best; candidates are added, most newly covered configurations first, until the share is reached. "
            "This is the reduced set `auto` should try."
        )
    )
    return blocks


def text_table(table: Table) -> list[str]:
    widths = [max(len(row[column]) for row in [table.headers] + table.rows) for column in range(len(table.headers))]

    def aligned(cells):
        padded = [
            cell.ljust(width) if column < table.left_columns else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(cells, widths))
        ]
        return ("  " + "  ".join(padded)).rstrip()

    return [table.title + ":", aligned(table.headers)] + [aligned(row) for row in table.rows] + [""]


def render_text(blocks: list) -> str:
    lines: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            lines += [block.text, ("=" if block.level == 1 else "-") * len(block.text), ""]
        elif isinstance(block, Paragraph):
            lines += [block.text, ""]
        else:
            lines += text_table(block)
    return "\n".join(lines)


def render_markdown(blocks: list) -> str:
    lines: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            lines += ["#" * block.level + " " + block.text, ""]
        elif isinstance(block, Paragraph):
            lines += [block.text, ""]
        else:
            lines += [f"### {block.title}", ""]
            lines.append("| " + " | ".join(block.headers) + " |")
            alignment = ["---"] * block.left_columns + ["---:"] * (len(block.headers) - block.left_columns)
            lines.append("| " + " | ".join(alignment) + " |")
            lines += ["| " + " | ".join(row) + " |" for row in block.rows]
            lines.append("")
    return "\n".join(lines)


def plot_win_rates(path: pathlib.Path, analysed: dict[str, list[CacheEntry]]) -> bool:
    """Grouped bar chart, one group per algorithm and one bar per namespace; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # render to a file without a display
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    per_namespace = {namespace: algorithm_stats(entries) for namespace, entries in analysed.items()}
    algorithms = sorted({name for stats in per_namespace.values() for name in stats})
    width = 0.8 / len(per_namespace)
    figure, axes = plt.subplots(figsize=(max(6, 1.8 * len(algorithms)), 4))
    for offset, (namespace, stats) in enumerate(per_namespace.items()):
        count = len(analysed[namespace])
        rates = [100 * stats[name].wins / count if name in stats else 0 for name in algorithms]
        positions = [index + offset * width for index in range(len(algorithms))]
        axes.bar(positions, rates, width, label=namespace)
    axes.set_xticks([index + 0.4 - width / 2 for index in range(len(algorithms))], algorithms)
    axes.set_ylabel("win rate (%)")
    axes.set_title("Autotuner win rates")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


def measured_entries(cache: BenchmarkCache, namespace: str) -> list[CacheEntry]:
    """The namespace's entries (results best first, as the cache keeps them) that have a positive best
    time to compare against."""
    return [entry for entry in cache.entries(namespace) if entry.results and entry.results[0][2] > 0]


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--namespace",
        action="append",
        metavar="NAME",
        help=f"namespace to analyse, repeatable (default: {', '.join(DEFAULT_NAMESPACES)})",
    )
    parser.add_argument("--cache-file", type=pathlib.Path, help="analyse this file instead of the user's cache")
    parser.add_argument("--tolerance", type=float, default=0.10, help="slowdown a candidate may have (default 0.10)")
    parser.add_argument("--coverage", type=float, default=0.95, help="share of configurations to cover (default 0.95)")
    parser.add_argument("--markdown", action="store_true", help="write Markdown tables instead of plain text")
    parser.add_argument("--output", type=pathlib.Path, help="write the report to this file instead of stdout")
    parser.add_argument("--plot", type=pathlib.Path, metavar="FILE.png", help="bar chart of win rates (matplotlib)")
    return parser


def parse_args(argv=None, prog: str | None = None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.tolerance < 0:
        parser.error("--tolerance must not be negative")
    if not 0 < args.coverage <= 1:
        parser.error("--coverage must be in (0, 1]")
    return args


def main(argv=None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    path = args.cache_file or cache_file_path()
    if report_what_is_in_the_way(path, users_cache=args.cache_file is None):
        return 1
    if not path.is_file():
        print(f"No benchmark cache at {path} yet: nothing to analyse.")
        print("Tune some convolutions or run cupysparse-populate-benchmark-cache first.")
        return 0
    try:
        cache = open_for_reading(path)
    except NotACacheFile as problem:
        print(f"Cannot read {problem}. The library moves such a file aside the next time it tunes.", file=sys.stderr)
        return 1
    except OSError as error:  # e.g. another user's cache file in a shared directory
        print(f"Cannot read {path}: {error}", file=sys.stderr)
        return 1
    namespaces = args.namespace or list(DEFAULT_NAMESPACES)
    analysed = {namespace: measured_entries(cache, namespace) for namespace in namespaces}
    analysed = {namespace: entries for namespace, entries in analysed.items() if entries}
    if not analysed:
        print(f"The cache at {path} has no measured configurations in {', '.join(namespaces)}.")
        present = cache.namespace_counts()
        if present:
            print("Namespaces it has: " + ", ".join(f"{ns} ({n})" for ns, n in sorted(present.items())))
        return 0
    blocks: list = [
        Heading("Autotune cache analysis", 1),
        Paragraph(f"Cache: {path}"),
    ]
    for namespace in namespaces:
        if namespace not in analysed:
            blocks.append(Paragraph(f"{namespace}: no measured configurations."))
    for namespace, entries in analysed.items():
        blocks += namespace_report(namespace, entries, args.tolerance, args.coverage)
    report = (render_markdown if args.markdown else render_text)(blocks)
    if args.output:
        args.output.write_text(report + "\n")
        print(f"Wrote the analysis to {args.output}")
    else:
        print(report)
    if args.plot:
        if plot_win_rates(args.plot, analysed):
            print(f"Wrote the win-rate chart to {args.plot}")
        else:
            print("--plot needs matplotlib, which is not installed (pip install matplotlib); no chart written.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
