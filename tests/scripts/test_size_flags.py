"""One spelling of a count for every command: 200000, 200K, 2M (scripts/arguments.py), on every size flag."""

import argparse
import re

import pytest
from cupysparse.scripts import arguments, cli
from cupysparse.scripts import populate_benchmark_cache as populate

# Flags whose value is a number of voxels, points, batch items or grid cells.
SIZE_FLAG = re.compile(r"--(num-[a-z-]+|batch-size|[a-z-]+-cells)")
COUNT_TYPES = (arguments.count, arguments.counts)
# scripts/demo.py belongs to another change; its --num-voxels still takes a plain int.
@pytest.mark.parametrize("text, value", [
    ("200000", 200_000), ("200K", 200_000), ("200k", 200_000), ("2M", 2_000_000), ("2m", 2_000_000),
    ("1.5M", 1_500_000), ("2.5K", 2_500), (" 65K ", 65_000), ("1", 1), ("3.0", 3), ("0.001M", 1_000),
])
def test_a_count_is_written_out_or_with_a_k_or_m_suffix(text, value):
    assert arguments.count(text) == value
    assert type(arguments.count(text)) is int


@pytest.mark.parametrize("text, problem", [
    ("abc", "expected a count such as 200000, 200K or 2M, got 'abc'"),
    ("", "expected a count such as 200000, 200K or 2M, got ''"),
    ("2G", "expected a count such as 200000, 200K or 2M, got '2G'"),
    ("1e5", "expected a count such as 200000, 200K or 2M, got '1e5'"),
    ("2KM", "expected a count such as 200000, 200K or 2M, got '2KM'"),
    ("K", "expected a count such as 200000, 200K or 2M, got 'K'"),
    ("nan", "expected a count such as 200000, 200K or 2M, got 'nan'"),
    ("1.5", "expected a whole count such as 200000, 200K or 2M, got '1.5'"),
    ("1.0005K", "expected a whole count such as 200000, 200K or 2M, got '1.0005K'"),
    ("0", "expected a count of at least 1, got '0'"),
    ("0K", "expected a count of at least 1, got '0K'"),
    ("-5", "expected a count of at least 1, got '-5'"),
])
def test_anything_else_is_refused_naming_the_text(text, problem):
    with pytest.raises(argparse.ArgumentTypeError) as error:
        arguments.count(text)
    assert str(error.value) == problem


def test_zero_is_a_count_only_where_zero_is_allowed():
    assert arguments.count_or_zero("0") == 0
    assert arguments.count_or_zero("3K") == 3_000
    with pytest.raises(argparse.ArgumentTypeError, match="expected a count of at least 0, got '-1'"):
        arguments.count_or_zero("-1")


def test_comma_lists_of_counts():
    assert arguments.counts("30000,65K,1M") == (30_000, 65_000, 1_000_000)
    assert arguments.counts("1M,") == (1_000_000,)
    with pytest.raises(argparse.ArgumentTypeError, match="got 'abc'"):
        arguments.counts("1M,abc")
    with pytest.raises(argparse.ArgumentTypeError, match="separated by commas, got ','"):
        arguments.counts(",")
    assert arguments.joined([(30_000, 65_000), (1_000_000, 30_000)]) == (30_000, 65_000, 1_000_000)


def test_a_bad_count_is_a_usage_error_that_names_the_flag_and_the_text(capsys):
    with pytest.raises(SystemExit) as exit_info:
        populate.parse_args(["--num-voxels", "30K", "lots", "--dry-run"])
    assert exit_info.value.code == 2
    assert "argument --num-voxels: expected a count such as 200000, 200K or 2M, got 'lots'" in capsys.readouterr().err


def test_a_command_reads_every_spelling_of_its_counts():
    args = populate.parse_args(["--num-voxels", "30000,65K", "1.5M", "--batch-size", "2", "--dry-run"])
    assert args.num_voxels == (30_000, 65_000, 1_500_000) and args.batch_size == 2


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_size_flag_of_every_command_takes_a_count(command):
    parser = cli.command_parser(command)
    plain = [flag for action in parser._actions for flag in action.option_strings
             if SIZE_FLAG.fullmatch(flag) and action.type not in COUNT_TYPES]
    assert plain == [], f"size flags of {command} that do not take 200K or 2M: {plain}"


def test_the_size_flags_are_found():
    """The walk above recognises the flags it must check: each command that sizes a scene has one."""
    sizing = {"populate", "populate-shipped", "conv", "kernel-map", "network", "host-overhead", "memory-analysis",
              "first-call", "torch-adapter", "cold-start", "demo"}
    for command in sizing:
        flags = {flag for action in cli.command_parser(command)._actions for flag in action.option_strings}
        assert "--num-voxels" in flags and SIZE_FLAG.fullmatch("--num-voxels"), command
    assert SIZE_FLAG.fullmatch("--dense-max-cells") and SIZE_FLAG.fullmatch("--batch-size")
    assert not SIZE_FLAG.fullmatch("--voxel-size") and not SIZE_FLAG.fullmatch("--repeats")
