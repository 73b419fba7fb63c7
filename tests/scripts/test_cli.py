"""`cupysparse COMMAND`: one command line over every script."""

import argparse

import pytest

from cupysparse.scripts import cli


def test_help_lists_every_command_on_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for name, command in cli.COMMANDS.items():
        assert any(line.split()[:1] == [name] and command.summary in line for line in lines), name


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_command_answers_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([name, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: {cli.PROGRAM} {name} ")


def test_no_command_prints_the_listing_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "analyze-benchmarks" in capsys.readouterr().err


def test_an_unknown_command_exits_2():
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["no-such-command"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_flag_of_every_command_has_help(command):
    parser = cli.command_parser(command)
    silent = [action.option_strings or action.dest for action in parser._actions
              if not isinstance(action, argparse._HelpAction) and not action.help]
    assert silent == [], f"flags of {command} without help: {silent}"
