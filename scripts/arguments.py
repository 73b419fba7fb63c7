"""Argument types every command shares, so that a count is spelled the same way whatever command takes it.

A count is a whole number, written out (`200000`) or with a case-insensitive suffix, K for thousands and
M for millions (`200K`, `2m`, `1.5M`); a decimal point is allowed where the result is whole.
"""

from __future__ import annotations

import argparse
import decimal
import re

SUFFIX_FACTORS = {"": 1, "k": 1_000, "m": 1_000_000}
COUNT_PATTERN = re.compile(r"(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))(?P<suffix>[km]?)")
EXAMPLES = "200000, 200K or 2M"


def parse_count(text: str, minimum: int) -> int:
    """The count `text` spells, at least `minimum`; anything else raises `argparse.ArgumentTypeError`
    naming the text, which argparse reports as a usage error of the flag."""
    match = COUNT_PATTERN.fullmatch(text.strip().lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a count such as {EXAMPLES}, got {text!r}")
    value = decimal.Decimal(match["number"]) * SUFFIX_FACTORS[match["suffix"]]
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"expected a whole count such as {EXAMPLES}, got {text!r}")
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected a count of at least {minimum}, got {text!r}")
    return int(value)


def count(text: str) -> int:
    """A positive count: `type=count` for flags such as --num-voxels."""
    return parse_count(text, minimum=1)


def count_or_zero(text: str) -> int:
    """A count that may be 0 (untimed warm-up runs, say)."""
    return parse_count(text, minimum=0)


def counts(text: str) -> tuple[int, ...]:
    """Positive counts separated by commas (`30000,65K,1M`); empty items are skipped."""
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected counts such as {EXAMPLES}, separated by commas, got {text!r}")
    return tuple(count(item) for item in items)


def joined(groups) -> tuple[int, ...]:
    """The counts of a `nargs="+", type=counts` flag (`--num-voxels 30K,65K 1M`) as one tuple, in the order
    given, each once."""
    return tuple(dict.fromkeys(value for group in groups for value in group))
