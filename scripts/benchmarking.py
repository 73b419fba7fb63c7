"""What the benchmark scripts share: timing (the tuner's own: CUDA events on the GPU, the host clock
on the CPU) and CSV output."""

from __future__ import annotations

import csv

from cupysparse.tuner import median_time_ms


def make_timer(device: str):
    """`measure(fn, warmup, repeats) -> median milliseconds` for `device` ("cpu" or "cuda")."""
    return lambda fn, warmup, repeats: median_time_ms(fn, device == "cuda", warmup, repeats)


def write_csv(rows: list[dict], path: str) -> None:
    """Write `rows` (dicts with the same keys) to `path` and say so."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
