"""Plots, tables and a results page from `cupysparse-benchmark-memory-analysis`'s `benchmark_full.csv`.

    cupysparse-analyze-benchmarks --input bench-results/benchmark_full.csv --output-dir plots --baseline spconv
    cupysparse-analyze-benchmarks --input fp16.csv tf32.csv --output-dir results/layers --markdown results/layers.md

Several inputs (runs that measured different configurations, e.g. one per dtype) are analysed as one
grid.

Only measurements with status `ok` enter the plots and ratios. A plot draws one line per backend and
per value of every other configuration field that varies in the data (channels, dtype, kernel size,
stride, …), one panel per phase:

- `scalability_num_voxels`: median time against voxels, log-log, with an O(N) line;
- `time_vs_channels`: median time against C_in·C_out;
- `throughput`: TFLOP/s and input voxels per second against voxels;
- `memory_per_voxel`: peak memory per input voxel;
- `backward_forward_ratio`: backward time / forward time per configuration;
- `dtype_overhead`: time relative to the fastest dtype of the same configuration (geometric mean),
  backend × dtype with the value in each cell;
- `baseline_time_ratio`, `baseline_memory_ratio`: time and peak memory / the baseline's, lines against
  voxels and `baseline_time_heatmap`, `baseline_memory_heatmap`: backend × channel pair (geometric
  mean over the other fields, the value in each cell).

Tables: `summary_stats.csv` (status counts and speed per backend and phase),
`backward_forward_ratios.csv`, `crossover_points.csv` (per pair of backends and configuration
without the voxel count: the voxel count from which the faster one no longer changes, when it
changes at all, the rows of the two merged on the full configuration key) and
`baseline_ratios.csv`. `--markdown PAGE` writes a results page embedding the plots by paths
relative to the page: the device, versions and commands of each run, from its metadata file next to
its input (`NAME.json` for `NAME.csv`, else the harness's `heatmap_data.json`), every measurement
per dtype beside the baseline's, and the command that writes the page again. The page is generated
whole: the same inputs give the same page, so nothing written by hand belongs in it.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import shlex
import statistics
import sys

from cupysparse.scripts.benchmark_memory_analysis import KEY_COLUMNS, MIB, OK, PHASES, STATUSES, significant
from cupysparse.scripts.benchmarking import write_csv

INT_COLUMNS = ("batch_size", "num_voxels", "in_channels", "out_channels", "kernel_size", "stride", "num_in",
               "num_out", "pairs", "samples", "iterations")
FLOAT_COLUMNS = ("kernel_map_ms", "first_call_ms", "median_ms", "q25_ms", "q75_ms", "tflops", "resident_mb",
                 "call_peak_mb", "peak_memory_mb", "estimated_mb")
SUMMARY_COLUMNS = ("backend", "phase", "measurements", *STATUSES, "median_ms", "best_tflops", "geomean_tflops",
                   "median_voxels_per_s", "median_bytes_per_voxel")
RATIO_COLUMNS = (*KEY_COLUMNS, "backend", "forward_ms", "backward_ms", "backward_forward_ratio")
GROUP_COLUMNS = tuple(column for column in KEY_COLUMNS if column != "num_voxels")
CROSSOVER_COLUMNS = (*GROUP_COLUMNS, "phase", "backend_a", "backend_b", "winner_changes", "last_before_num_voxels",
                     "crossover_num_voxels", "winner_before", "winner_after")
BASELINE_COLUMNS = (*KEY_COLUMNS, "phase", "backend", "baseline", "median_ms", "baseline_ms", "time_ratio",
                    "peak_memory_mb", "baseline_peak_memory_mb", "memory_ratio")
BASELINE_PREFERENCE = ("spconv", "torch", "explicit_gemm")
SHORT_NAMES = {"in_channels": "", "kernel_size": "k", "stride": "s", "batch_size": "B", "scene": "", "dtype": "",
               "num_voxels": "N="}
PLOTS = (
    ("scalability_num_voxels", "Scalability in N",
     "Median time against the number of voxels, log-log; the dashed line is O(N) through the smallest measurement."),
    ("time_vs_channels", "Time against C_in·C_out", "Median time against the product of the channel counts."),
    ("throughput", "Throughput", "TFLOP/s on the sparse work (2·pairs·C_in·C_out per GEMM) and input voxels per "
                                 "second."),
    ("memory_per_voxel", "Memory per voxel", "Peak memory (inputs, weight, kernel map and what one call allocates) "
                                             "per input voxel."),
    ("backward_forward_ratio", "Backward / forward", "Time of the backward (dgrad + wgrad) over the forward's."),
    ("dtype_overhead", "dtype overhead", "Time relative to the fastest dtype of the same configuration "
                                         "(geometric mean over configurations), per backend and dtype."),
    ("baseline_time_ratio", "Time ratio to the baseline", "Median time / the baseline's (< 1: faster)."),
    ("baseline_memory_ratio", "Memory ratio to the baseline", "Peak memory / the baseline's (< 1: less)."),
    ("baseline_time_heatmap", "Time ratio to the baseline per channel pair",
     "Geometric mean of time / the baseline's over voxel counts and the other fields."),
    ("baseline_memory_heatmap", "Memory ratio to the baseline per channel pair",
     "Geometric mean of peak memory / the baseline's over voxel counts and the other fields."),
)
PLOT_INSTALL_HINT = "the plots need matplotlib: pip install 'cupysparse[plot]'"


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display), imported on first use."""
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit(f"cupysparse-analyze-benchmarks: {PLOT_INSTALL_HINT}") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_rows(path: str) -> list[dict]:
    """The rows of `benchmark_full.csv`, numbers parsed, empty cells None."""

    def parsed(column: str, text: str):
        if text == "":
            return None
        if column in INT_COLUMNS:
            return int(text)
        return float(text) if column in FLOAT_COLUMNS else text

    with open(path, newline="") as handle:
        return [{column: parsed(column, text) for column, text in row.items()} for row in csv.DictReader(handle)]


def ok_rows(rows: list[dict]) -> list[dict]:
    return [row for row in rows if row["status"] == OK and row["median_ms"] is not None]


def configuration_key(row: dict) -> tuple:
    return tuple(row[column] for column in KEY_COLUMNS)


def geometric_mean(values) -> float | None:
    values = [value for value in values if value is not None and value > 0]
    return math.exp(sum(math.log(value) for value in values) / len(values)) if values else None


def median(values) -> float | None:
    values = [value for value in values if value is not None]
    return statistics.median(values) if values else None


def voxels_per_second(row: dict) -> float:
    return row["num_in"] / (row["median_ms"] / 1e3)


def bytes_per_voxel(row: dict) -> float | None:
    return None if row["peak_memory_mb"] is None else row["peak_memory_mb"] * MIB / row["num_in"]


# Tables

def summary_stats(rows: list[dict]) -> list[dict]:
    """Per backend and phase: status counts, then over the `ok` configurations the median time, best
    and geometric-mean TFLOP/s, median voxels per second and bytes per voxel."""
    table = []
    for backend, phase in dict.fromkeys((row["backend"], row["phase"]) for row in rows):
        mine = [row for row in rows if (row["backend"], row["phase"]) == (backend, phase)]
        done = ok_rows(mine)
        tflops = [row["tflops"] for row in done if row["tflops"] is not None]
        table.append({
            "backend": backend, "phase": phase, "measurements": len(mine),
            **{status: sum(1 for row in mine if row["status"] == status) for status in STATUSES},
            "median_ms": significant(median(row["median_ms"] for row in done), 4),
            "best_tflops": significant(max(tflops, default=None), 4),
            "geomean_tflops": significant(geometric_mean(tflops), 4),
            "median_voxels_per_s": significant(median(voxels_per_second(row) for row in done), 4),
            "median_bytes_per_voxel": significant(median(bytes_per_voxel(row) for row in done), 4),
        })
    return table


def times_by_key(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """`ok` rows by (configuration key, phase), then by backend."""
    table: dict[tuple, dict[str, dict]] = {}
    for row in ok_rows(rows):
        table.setdefault((configuration_key(row), row["phase"]), {})[row["backend"]] = row
    return table


def backward_forward_ratios(rows: list[dict]) -> list[dict]:
    """Per configuration and backend with both phases measured: backward ms / forward ms."""
    measured = times_by_key(rows)
    table = []
    for (key, phase), by_backend in measured.items():
        if phase != "forward":
            continue
        for backend, forward in by_backend.items():
            backward = measured.get((key, "backward"), {}).get(backend)
            if backward is not None:
                table.append({
                    **dict(zip(KEY_COLUMNS, key)), "backend": backend, "forward_ms": forward["median_ms"],
                    "backward_ms": backward["median_ms"],
                    "backward_forward_ratio": significant(backward["median_ms"] / forward["median_ms"], 4),
                })
    return table


def crossover_points(rows: list[dict]) -> list[dict]:
    """For each configuration without its voxel count, phase and pair of backends measured there: the
    two merged on the full configuration key, ordered by voxel count, and where the faster of the two
    changes for the last time (the voxel count from which the winner stays the same), when it changes."""
    groups: dict[tuple, dict[int, dict[str, float]]] = {}
    for (key, phase), by_backend in times_by_key(rows).items():
        values = dict(zip(KEY_COLUMNS, key))
        group = (*(values[column] for column in GROUP_COLUMNS), phase)
        times = {name: row["median_ms"] for name, row in by_backend.items()}
        groups.setdefault(group, {})[values["num_voxels"]] = times
    table = []
    for group, by_count in groups.items():
        backends = sorted({name for times in by_count.values() for name in times})
        for first, second in itertools.combinations(backends, 2):
            merged = [(count, times[first], times[second]) for count, times in sorted(by_count.items())
                      if first in times and second in times]
            winners = [first if first_ms <= second_ms else second for _, first_ms, second_ms in merged]
            changes = [index for index in range(1, len(winners)) if winners[index] != winners[index - 1]]
            if not changes:
                continue
            last = changes[-1]
            table.append({
                **dict(zip((*GROUP_COLUMNS, "phase"), group)), "backend_a": first, "backend_b": second,
                "winner_changes": len(changes), "last_before_num_voxels": merged[last - 1][0],
                "crossover_num_voxels": merged[last][0], "winner_before": winners[last - 1],
                "winner_after": winners[last],
            })
    return table


def baseline_ratios(rows: list[dict], baseline: str) -> list[dict]:
    """Per configuration, phase and backend other than `baseline`, both measured: time and peak
    memory over the baseline's."""
    table = []
    for (key, phase), by_backend in times_by_key(rows).items():
        reference = by_backend.get(baseline)
        if reference is None:
            continue
        for backend, row in by_backend.items():
            if backend == baseline:
                continue
            memory_ratio = None
            if row["peak_memory_mb"] and reference["peak_memory_mb"]:
                memory_ratio = significant(row["peak_memory_mb"] / reference["peak_memory_mb"], 4)
            table.append({
                **dict(zip(KEY_COLUMNS, key)), "phase": phase, "backend": backend, "baseline": baseline,
                "median_ms": row["median_ms"], "baseline_ms": reference["median_ms"],
                "time_ratio": significant(row["median_ms"] / reference["median_ms"], 4),
                "peak_memory_mb": row["peak_memory_mb"], "baseline_peak_memory_mb": reference["peak_memory_mb"],
                "memory_ratio": memory_ratio,
            })
    return table


def choose_baseline(rows: list[dict], requested: str | None) -> str | None:
    """`requested`, else the first of spconv, torch, explicit_gemm with `ok` rows, else the first backend."""
    if requested:
        return requested
    measured = {row["backend"] for row in ok_rows(rows)}
    backends = list(dict.fromkeys(row["backend"] for row in rows))
    return next((name for name in BASELINE_PREFERENCE if name in measured), backends[0] if backends else None)


# Plots

def varying_columns(rows: list[dict], leave_out: tuple[str, ...]) -> list[str]:
    """Configuration fields other than `leave_out` with more than one value in `rows`."""
    return [column for column in KEY_COLUMNS
            if column not in leave_out and len({row[column] for row in rows}) > 1]


def configuration_label(row: dict, columns: list[str]) -> str:
    """`row`'s values of `columns`, short: "32→64 fp16 k3 s2"."""
    parts = []
    if "in_channels" in columns or "out_channels" in columns:
        parts.append(f"{row['in_channels']}→{row['out_channels']}")
    parts += [f"{SHORT_NAMES.get(column, column + '=')}{row[column]}" for column in columns
              if column not in ("in_channels", "out_channels")]
    return " ".join(parts)


def series_label(row: dict, columns: list[str]) -> str:
    return " ".join(filter(None, (row["backend"], configuration_label(row, columns))))


def phases_of(rows: list[dict]) -> list[str]:
    present = {row["phase"] for row in rows}
    return [phase for phase in PHASES if phase in present]


def panels(plt, count: int, columns: int = 3, width: float = 5.0, height: float = 3.8):
    count = max(count, 1)
    across = min(count, columns)
    down = -(-count // across)
    figure, axes = plt.subplots(down, across, figsize=(width * across, height * down), squeeze=False)
    flat = list(axes.flat)
    for unused in flat[count:]:
        unused.set_visible(False)
    return figure, flat[:count]


def empty_note(axis, text: str = "no successful measurements") -> None:
    axis.text(0.5, 0.5, text, ha="center", va="center", transform=axis.transAxes)
    axis.set_xticks([])
    axis.set_yticks([])


class LineStyles:
    """The same color and dash for a series in every panel of a figure: ten colors, then the next dash."""

    DASHES = ("-", "--", ":", "-.")

    def __init__(self, rows: list[dict], y_of, leave_out: tuple[str, ...]):
        self.columns = varying_columns(rows, leave_out)
        labels = sorted({series_label(row, self.columns) for row in rows if y_of(row) is not None})
        self._styles = {label: {"color": f"C{index % 10}", "linestyle": self.DASHES[index // 10 % len(self.DASHES)]}
                        for index, label in enumerate(labels)}

    def draw(self, axis, rows: list[dict], x_of, y_of) -> list:
        """One line per series of `rows`, points sorted by x; returns the points drawn."""
        lines: dict[str, list] = {}
        for row in rows:
            y = y_of(row)
            if y is not None:
                lines.setdefault(series_label(row, self.columns), []).append((x_of(row), y))
        for label, points in sorted(lines.items()):
            points.sort()
            axis.plot(*zip(*points), marker="o", markersize=3, label=label, **self._styles[label])
        if not lines:
            empty_note(axis)
        return [point for points in lines.values() for point in points]


def add_legend(figure) -> None:
    """One legend for the whole figure, right of the panels: the series are the same in each."""
    entries = {}
    for axis in figure.axes:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        figure.legend(list(entries.values()), list(entries), loc="center left", bbox_to_anchor=(1.0, 0.5),
                      fontsize=7, frameon=False)


def per_phase_lines(plt, rows, x_of, y_of, leave_out, xlabel, ylabel, logx=True, logy=True, unity=False):
    styles = LineStyles(rows, y_of, leave_out)
    phases = phases_of(rows)
    figure, axes = panels(plt, len(phases))
    for axis, phase in zip(axes, phases):
        if not styles.draw(axis, [row for row in rows if row["phase"] == phase], x_of, y_of):
            continue
        axis.set_title(phase)
        axis.set_xlabel(xlabel)
        axis.set_ylabel(ylabel)
        if logx:
            axis.set_xscale("log")
        if logy:
            axis.set_yscale("log")
        if unity:
            axis.axhline(1.0, color="gray", linewidth=0.8)
        axis.grid(True, which="both", linewidth=0.3)
    if not phases:
        empty_note(axes[0])
    return figure, axes


def plot_scalability(plt, rows):
    figure, axes = per_phase_lines(plt, rows, lambda row: row["num_voxels"], lambda row: row["median_ms"],
                                   ("num_voxels",), "voxels", "median ms")
    for axis, phase in zip(axes, phases_of(rows)):
        mine = [row for row in rows if row["phase"] == phase]
        smallest = min(mine, key=lambda row: (row["num_voxels"], row["median_ms"]))
        largest = max(row["num_voxels"] for row in mine)
        if largest > smallest["num_voxels"]:
            x0, y0 = smallest["num_voxels"], smallest["median_ms"]
            axis.plot([x0, largest], [y0, y0 * largest / x0], linestyle="--", color="gray", label="O(N)")
    return figure


def plot_time_vs_channels(plt, rows):
    figure, _ = per_phase_lines(plt, rows, lambda row: row["in_channels"] * row["out_channels"],
                                lambda row: row["median_ms"], ("in_channels", "out_channels"), "C_in · C_out",
                                "median ms")
    return figure


def plot_throughput(plt, rows):
    phases = phases_of(rows)
    styles = LineStyles(rows, voxels_per_second, ("num_voxels",))
    figure, axes = plt.subplots(max(len(phases), 1), 2, figsize=(11, 3.8 * max(len(phases), 1)), squeeze=False)
    for (tflops_axis, voxels_axis), phase in zip(axes, phases):
        mine = [row for row in rows if row["phase"] == phase]
        for axis, y_of, ylabel in ((tflops_axis, lambda row: row["tflops"], "TFLOP/s"),
                                   (voxels_axis, voxels_per_second, "input voxels / s")):
            styles.draw(axis, mine, lambda row: row["num_voxels"], y_of)
            axis.set_title(f"{phase}: {ylabel}")
            axis.set_xlabel("voxels")
            axis.set_xscale("log")
            axis.set_yscale("log")
            axis.grid(True, which="both", linewidth=0.3)
    if not phases:
        for axis in axes[0]:
            empty_note(axis)
    return figure


def plot_memory_per_voxel(plt, rows):
    figure, _ = per_phase_lines(plt, rows, lambda row: row["num_voxels"], bytes_per_voxel, ("num_voxels",),
                                "voxels", "peak bytes / input voxel", logy=False)
    return figure


def plot_backward_forward(plt, ratios: list[dict]):
    figure, (axis,) = panels(plt, 1, width=6.0)

    def ratio_of(row):
        return row["backward_forward_ratio"]

    if LineStyles(ratios, ratio_of, ("num_voxels",)).draw(axis, ratios, lambda row: row["num_voxels"], ratio_of):
        axis.set_xscale("log")
        axis.set_xlabel("voxels")
        axis.set_ylabel("backward ms / forward ms")
        axis.axhline(1.0, color="gray", linewidth=0.8)
        axis.grid(True, which="both", linewidth=0.3)
    return figure


def dtype_overheads(rows: list[dict]) -> dict[tuple[str, str], dict[str, float]]:
    """(phase, backend) → dtype → geometric mean over configurations of time / the fastest dtype's."""
    by_config: dict[tuple, dict[str, float]] = {}
    for row in ok_rows(rows):
        values = {column: row[column] for column in KEY_COLUMNS if column != "dtype"}
        by_config.setdefault((row["phase"], row["backend"], *values.values()), {})[row["dtype"]] = row["median_ms"]
    ratios: dict[tuple[str, str], dict[str, list]] = {}
    for key, times in by_config.items():
        fastest = min(times.values())
        for dtype, ms in times.items():
            ratios.setdefault(key[:2], {}).setdefault(dtype, []).append(ms / fastest)
    return {key: {dtype: geometric_mean(values) for dtype, values in by_dtype.items()}
            for key, by_dtype in ratios.items()}


def plot_dtype_overhead(plt, rows):
    """Per phase, backend (rows) × dtype (columns): the geometric mean of time / the fastest dtype's."""
    overheads = dtype_overheads(rows)
    phases = [phase for phase in PHASES if any(key[0] == phase for key in overheads)]
    figure, axes = panels(plt, len(phases), columns=2, width=6.0, height=4.0)
    dtypes = list(dict.fromkeys(row["dtype"] for row in ok_rows(rows)))
    for axis, phase in zip(axes, phases):
        backends = [backend for mine, backend in overheads if mine == phase]
        grid = [[overheads[(phase, backend)].get(dtype) for dtype in dtypes] for backend in backends]
        annotated_heatmap(figure, axis, grid, backends, dtypes, f"{phase}: time / fastest dtype")
    if not phases:
        empty_note(axes[0])
    return figure


def plot_baseline_lines(plt, ratios: list[dict], column: str, baseline: str):
    rows = [row for row in ratios if row[column] is not None]
    figure, _ = per_phase_lines(plt, rows, lambda row: row["num_voxels"], lambda row: row[column],
                                ("num_voxels",), "voxels", f"{column.replace('_', ' ')} to {baseline}", logy=False,
                                unity=True)
    return figure


def annotated_heatmap(figure, axis, grid: list[list], row_labels, column_labels, title: str) -> None:
    """`grid` (None: not measured) as colors centred on 1 (green below, red above), each value in its cell."""
    from matplotlib.colors import TwoSlopeNorm

    known = [value for line in grid for value in line if value is not None]
    centred = TwoSlopeNorm(vcenter=1.0, vmin=min(min(known), 0.99), vmax=max(max(known), 1.01))
    cells = [[math.nan if value is None else value for value in line] for line in grid]
    image = axis.imshow(cells, cmap="RdYlGn_r", norm=centred, aspect="auto")
    for i, line in enumerate(grid):
        for j, value in enumerate(line):
            if value is not None:
                axis.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7)
    axis.set_xticks(range(len(column_labels)))
    axis.set_xticklabels(column_labels, rotation=30, fontsize=7)
    axis.set_yticks(range(len(row_labels)))
    axis.set_yticklabels(row_labels, fontsize=7)
    axis.set_title(title)
    figure.colorbar(image, ax=axis)


def plot_baseline_heatmap(plt, ratios: list[dict], column: str, baseline: str):
    """Per phase, backend (rows) × channel pair (columns): the geometric mean of `column`."""
    rows = [row for row in ratios if row[column] is not None]
    phases = phases_of(rows)
    figure, axes = panels(plt, len(phases), columns=2, width=6.0, height=4.0)
    for axis, phase in zip(axes, phases):
        mine = [row for row in rows if row["phase"] == phase]
        backends = list(dict.fromkeys(row["backend"] for row in mine))
        channels = sorted({(row["in_channels"], row["out_channels"]) for row in mine})
        grid = [[geometric_mean(row[column] for row in mine
                                if row["backend"] == backend and (row["in_channels"], row["out_channels"]) == pair)
                 for pair in channels] for backend in backends]
        annotated_heatmap(figure, axis, grid, backends, [f"{c_in}→{c_out}" for c_in, c_out in channels],
                          f"{phase}: {column.replace('_', ' ')} to {baseline}")
    if not phases:
        empty_note(axes[0], f"no measurement next to the baseline {baseline}")
    return figure


def make_plots(plt, rows, ratios, baseline_table, baseline) -> dict:
    measured = ok_rows(rows)
    return {
        "scalability_num_voxels": plot_scalability(plt, measured),
        "time_vs_channels": plot_time_vs_channels(plt, measured),
        "throughput": plot_throughput(plt, measured),
        "memory_per_voxel": plot_memory_per_voxel(plt, measured),
        "backward_forward_ratio": plot_backward_forward(plt, ratios),
        "dtype_overhead": plot_dtype_overhead(plt, measured),
        "baseline_time_ratio": plot_baseline_lines(plt, baseline_table, "time_ratio", baseline),
        "baseline_memory_ratio": plot_baseline_lines(plt, baseline_table, "memory_ratio", baseline),
        "baseline_time_heatmap": plot_baseline_heatmap(plt, baseline_table, "time_ratio", baseline),
        "baseline_memory_heatmap": plot_baseline_heatmap(plt, baseline_table, "memory_ratio", baseline),
    }


# The results page

def markdown_table(rows: list[dict], columns) -> list[str]:
    def cell(value) -> str:
        if value is None:
            return ""
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(column)) for column in columns) + " |" for row in rows]
    return lines


def relative(path: str, start_directory: str) -> str:
    return os.path.relpath(os.path.abspath(path), start_directory).replace(os.sep, "/")


def metadata_path(csv_path: str) -> str:
    """Where the metadata of `NAME.csv` lives: `NAME.json` beside it."""
    return f"{os.path.splitext(csv_path)[0]}.json"


def write_metadata(csv_path: str, metadata: dict) -> None:
    """`metadata` (the run's command, device, …) into `NAME.json` beside `csv_path`, as the results pages
    read it."""
    with open(metadata_path(csv_path), "w") as handle:
        json.dump({"metadata": metadata}, handle, indent=1)
        handle.write("\n")


def add_results_page_arguments(parser) -> None:
    """--markdown and --from-csv of a benchmark that writes its results page from its --csv file."""
    parser.add_argument("--markdown", metavar="PAGE", help="also write a results page of the --csv file")
    parser.add_argument("--from-csv", metavar="FILE",
                        help="measure nothing: write the --markdown page from FILE, a CSV of this benchmark")


def check_results_page_arguments(parser, args, program: str, argv) -> None:
    """Refuse a page without data or data without a page; keep the run's command line in `args.command`."""
    args.command = shlex.join([program, *(sys.argv[1:] if argv is None else argv)])
    if args.from_csv and not args.markdown:
        parser.error("--from-csv writes the --markdown page: name it")
    if args.markdown and not (args.csv or args.from_csv):
        parser.error("--markdown needs --csv (the page shows that file's data)")


def write_results_page(csv_path: str, page_path: str, results_page, program: str) -> None:
    """`results_page(rows, metadata, csv_path, page_path)` of the rows of `csv_path` (as strings) and its
    metadata, written whole to `page_path`."""
    with open(csv_path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        raise SystemExit(f"{program}: {csv_path} holds no measurement")
    page = results_page(rows, read_metadata(csv_path), csv_path, page_path)
    os.makedirs(os.path.dirname(os.path.abspath(page_path)), exist_ok=True)
    with open(page_path, "w") as handle:
        handle.write(page + "\n")
    print(f"wrote {page_path}")


def read_metadata(input_path: str) -> dict:
    """The run's metadata: from `NAME.json` next to `NAME.csv`, else from the harness's
    `heatmap_data.json` in the same folder, or {} without either."""
    path = os.path.abspath(input_path)
    for candidate in (metadata_path(path), os.path.join(os.path.dirname(path), "heatmap_data.json")):
        if os.path.isfile(candidate):
            with open(candidate) as handle:
                return json.load(handle).get("metadata", {})
    return {}


def joined(values) -> str:
    values = list(values)
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " and " + values[-1]


def run_lines(label: str, runs: list[dict], describe) -> list[str]:
    """One line `label: …` when every run that has the field agrees, else one bullet per run."""
    described = {name: describe(metadata) for name, metadata in runs if describe(metadata)}
    if not described:
        return []
    if len(set(described.values())) == 1:
        return [f"{label}: {next(iter(described.values()))}.", ""]
    return [f"{label}:", "", *(f"- `{name}`: {text}" for name, text in described.items()), ""]


def versions_text(metadata: dict) -> str:
    return ", ".join(f"{name} {version}" for name, version in metadata.get("versions", {}).items())


def settings_text(metadata: dict) -> str:
    settings = metadata.get("settings", {})
    if not settings:
        return ""
    return (", ".join(f"{name} {value}" for name, value in settings.items())
            + (f"; memory measured by {metadata['memory_source']}" if metadata.get("memory_source") else ""))


def cell_text(row: dict | None, column: str) -> str:
    if row is None:
        return ""
    if row["status"] != OK:
        return row["status"]
    value = row[column]
    return "" if value is None else f"{value:#.4g}"


def measurement_tables(rows: list[dict], baseline: str) -> list[str]:
    """Per dtype, one line per configuration and phase: each backend's median time (or its status),
    the TFLOP/s and time / the baseline's of the others."""
    columns = varying_columns(rows, ("dtype", "in_channels", "out_channels"))
    lines = []
    for dtype in dict.fromkeys(row["dtype"] for row in rows):
        mine = [row for row in rows if row["dtype"] == dtype]
        backends = list(dict.fromkeys(row["backend"] for row in mine))
        others = [backend for backend in backends if backend != baseline]
        by_key: dict[tuple, dict[str, dict]] = {}
        for row in mine:
            by_key.setdefault((configuration_key(row), row["phase"]), {})[row["backend"]] = row
        header = [*columns, "channels", "phase"]
        for backend in others:
            header += [f"{backend} ms", f"{backend} TFLOP/s"]
        if baseline in backends:
            header.append(f"{baseline} ms")
            header += [f"{backend} / {baseline}" for backend in others]
        table = []
        for (key, phase), by_backend in by_key.items():
            values = dict(zip(KEY_COLUMNS, key))
            line = [*(str(values[column]) for column in columns),
                    f"{values['in_channels']}→{values['out_channels']}", phase]
            for backend in others:
                line += [cell_text(by_backend.get(backend), "median_ms"), cell_text(by_backend.get(backend), "tflops")]
            if baseline in backends:
                reference = by_backend.get(baseline)
                line.append(cell_text(reference, "median_ms"))
                for backend in others:
                    row = by_backend.get(backend)
                    timed = all(item is not None and item["status"] == OK and item["median_ms"]
                                for item in (row, reference))
                    line.append(f"{row['median_ms'] / reference['median_ms']:.3f}" if timed else "")
            table.append(line)
        lines += [f"### {dtype}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(line) + " |" for line in table]
        lines.append("")
    return lines


def results_page(page_path: str, rows, tables: dict, plot_paths: dict, table_paths: dict, runs: list[dict],
                 baseline: str, analysis_command: str) -> str:
    """The markdown results page: setup of every run, summary, every measurement, every plot,
    crossovers and ratios. `runs` holds (input file name, its metadata) per input."""
    directory = os.path.dirname(os.path.abspath(page_path))
    devices = (list(dict.fromkeys(row["device"] for row in rows))
               or list(dict.fromkeys(metadata.get("device", "unknown") for _, metadata in runs)))
    dates = list(dict.fromkeys(metadata["date"] for _, metadata in runs if metadata.get("date")))
    when = f" on {joined(dates)}" if dates else ""
    lines = ["# Benchmark results", "", f"Measured on **{', '.join(devices)}**{when}.", ""]
    lines += run_lines("Versions", runs, versions_text)
    lines += run_lines("Settings", runs, settings_text)
    commands = list(dict.fromkeys(metadata["command"] for _, metadata in runs if metadata.get("command")))
    lines += ["Reproduce (the measurements, then this page from their files):", "", "```bash", *commands,
              analysis_command, "```", "",
              "Times are medians of timed samples (quartiles in the CSV), TFLOP/s count the sparse work "
              "(2 · pairs · C_in · C_out per GEMM: one for forward, dgrad and wgrad, two for backward, three for "
              "both), and peak memory is what one call holds at its peak: its inputs, weight and kernel map plus "
              "what it allocates.", "",
              "## Summary", "", *markdown_table(tables["summary_stats"], SUMMARY_COLUMNS), ""]
    lines += ["Full tables: " + ", ".join(f"[{name}]({relative(path, directory)})"
                                           for name, path in table_paths.items()) + ".", ""]
    lines += ["## Measurements", "",
              "Median milliseconds per call; `both` is forward + backward. A status (`oom`, `not_supported`, "
              "`error`, `not_tested`) stands where nothing was measured.", "",
              *measurement_tables(rows, baseline)]
    lines += ["## Plots", ""]
    for stem, title, description in PLOTS:
        if "baseline" in stem:
            description += f" Baseline: `{baseline}`."
        lines += [f"### {title}", "", description, "", f"![{title}]({relative(plot_paths[stem], directory)})", ""]
    crossovers = [row for row in tables["crossover_points"] if baseline in (row["backend_a"], row["backend_b"])]
    lines += ["## Crossover points", "",
              f"Against the baseline `{baseline}` (every pair: `crossover_points.csv`): where the faster of the "
              "two changes for the last time along the voxel count.", ""]
    if crossovers:
        lines += [*markdown_table(crossovers, CROSSOVER_COLUMNS), ""]
    else:
        lines += ["No backend changes places with the baseline along the voxel count in this grid.", ""]
    lines += ["## Ratios to the baseline", "", f"Geometric means over the configurations, baseline `{baseline}`.",
              ""]
    summary = []
    for backend, phase in dict.fromkeys((row["backend"], row["phase"]) for row in tables["baseline_ratios"]):
        mine = [row for row in tables["baseline_ratios"] if (row["backend"], row["phase"]) == (backend, phase)]
        summary.append({"backend": backend, "phase": phase, "configurations": len(mine),
                        "time_ratio": significant(geometric_mean(row["time_ratio"] for row in mine), 4),
                        "memory_ratio": significant(geometric_mean(row["memory_ratio"] for row in mine), 4)})
    if summary:
        lines += [*markdown_table(summary, ("backend", "phase", "configurations", "time_ratio", "memory_ratio")), ""]
    else:
        lines += [f"No configuration was measured with both `{baseline}` and another backend.", ""]
    return "\n".join(lines).rstrip("\n")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:]),
    )
    parser.add_argument("--input", nargs="+", default=["bench-results/benchmark_full.csv"], metavar="CSV",
                        help="benchmark_full.csv of one or more runs")
    parser.add_argument("--output-dir", default="plots", help="where plots and tables go")
    parser.add_argument("--format", default="png", choices=("png", "pdf"), help="file format of the plots")
    parser.add_argument("--baseline", default=None, help="backend the ratios divide by (default: the first "
                                                         f"measured of {', '.join(BASELINE_PREFERENCE)})")
    parser.add_argument("--markdown", default=None, metavar="PAGE", help="also write a markdown results page")
    return parser


def parse_args(argv=None, prog: str | None = None):
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.command = shlex.join(["cupysparse-analyze-benchmarks", *(sys.argv[1:] if argv is None else argv)])
    return args


def main(argv=None, prog: str | None = None) -> int:
    args = parse_args(argv, prog)
    missing = [path for path in args.input if not os.path.isfile(path)]
    if missing:
        print(f"cupysparse-analyze-benchmarks: no such file {', '.join(missing)}", file=sys.stderr)
        return 2
    rows = [row for path in args.input for row in read_rows(path)]
    plt = pyplot()
    baseline = choose_baseline(rows, args.baseline)
    os.makedirs(args.output_dir, exist_ok=True)
    tables = {
        "summary_stats": (summary_stats(rows), SUMMARY_COLUMNS),
        "backward_forward_ratios": (backward_forward_ratios(rows), RATIO_COLUMNS),
        "crossover_points": (crossover_points(rows), CROSSOVER_COLUMNS),
        "baseline_ratios": (baseline_ratios(rows, baseline), BASELINE_COLUMNS),
    }
    table_paths = {}
    for name, (table, columns) in tables.items():
        table_paths[name] = os.path.join(args.output_dir, f"{name}.csv")
        write_csv(table, table_paths[name], columns)
    figures = make_plots(plt, rows, tables["backward_forward_ratios"][0], tables["baseline_ratios"][0], baseline)
    plot_paths = {}
    for stem, figure in figures.items():
        plot_paths[stem] = os.path.join(args.output_dir, f"{stem}.{args.format}")
        figure.tight_layout()
        add_legend(figure)
        figure.savefig(plot_paths[stem], dpi=120, bbox_inches="tight")
        plt.close(figure)
        print(f"wrote {plot_paths[stem]}")
    if args.markdown:
        page = results_page(args.markdown, rows, {name: table for name, (table, _) in tables.items()}, plot_paths,
                            table_paths, [(os.path.basename(path), read_metadata(path)) for path in args.input],
                            baseline, args.command)
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as handle:
            handle.write(page + "\n")
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
