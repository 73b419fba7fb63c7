"""`cupysparse COMMAND` (also `python -m cupysparse COMMAND`): every command line tool behind one name.

Each command is a script of this package with its own parser; `cupysparse COMMAND --help` is that
script's help, and its `cupysparse-*` console script runs the same `main`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from types import ModuleType
from typing import NamedTuple

# the usage lines name the command as it was typed: the console script, or the module run by `python -m`
PROGRAM = "python -m cupysparse" if os.path.basename(sys.argv[0]) == "__main__.py" else "cupysparse"


class Command(NamedTuple):
    module: str
    summary: str

    def load(self) -> ModuleType:
        return importlib.import_module(f"cupysparse.scripts.{self.module}")


# Modules are imported only when their command runs: the benchmarks pull in torch, spconv and the like,
# which `cupysparse info` or `--help` must not wait for (or fail on).
COMMANDS = {
    "info": Command("info", "print the environment a bug report needs"),
    "warmup": Command("warmup", "compile the reference networks' kernels beforehand"),
    "demo": Command("demo", "MinkUNet on a synthetic scene, timed (and trained)"),
    "segment": Command("segment", "one class label per point of point-cloud files"),
    "populate": Command("populate_benchmark_cache", "measure a grid of layers into the tuning cache"),
    "inspect": Command("inspect_benchmark_cache", "show the tuning cache: location, namespaces, results"),
    "analyze": Command("analyze_autotune_cache", "which algorithms win in the tuning cache"),
    "populate-shipped": Command("populate_shipped_cache", "write or check the tuning file shipped for a GPU"),
    "conv": Command("benchmark_conv", "benchmark: convolution layers against spconv"),
    "kernel-map": Command("benchmark_kernel_map", "benchmark: building kernel maps against spconv"),
    "network": Command("benchmark_network", "benchmark: MinkUNet end to end against peers"),
    "host-overhead": Command("benchmark_host_overhead", "benchmark: host time per convolution call"),
    "memory-analysis": Command("benchmark_memory_analysis", "benchmark: time and memory over a grid of layers"),
    "first-call": Command("benchmark_first_call", "benchmark: first call against the steady state"),
    "torch-adapter": Command("benchmark_torch_adapter", "benchmark: what the PyTorch adapter adds"),
    "cold-start": Command("benchmark_cold_start", "benchmark: a fresh process's first forward"),
    "analyze-benchmarks": Command("analyze_benchmarks", "plots and tables of memory-analysis results"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: it picks the command; the command's script parses the rest."""
    # the commands are listed by hand: argparse's subcommand listing wraps the longest names onto two lines
    listing = "\n".join(f"  {name:<20}{command.summary}" for name, command in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog=PROGRAM, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"commands:\n{listing}\n\n`{PROGRAM} COMMAND --help` shows the flags of COMMAND.",
    )
    parser.add_argument("command", nargs="?", choices=COMMANDS, metavar="COMMAND", help="one of the commands below")
    parser.add_argument("arguments", nargs=argparse.REMAINDER, help="the command's own flags and arguments")
    return parser


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser `cupysparse NAME` runs, as its script builds it."""
    return COMMANDS[name].load().build_parser(f"{PROGRAM} {name}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return COMMANDS[args.command].load().main(args.arguments, prog=f"{PROGRAM} {args.command}")


if __name__ == "__main__":
    sys.exit(main())
