"""Command line: `python -m cupysparse COMMAND`."""

from __future__ import annotations

import argparse
import sys

from . import info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupysparse", description="cupysparse command line tools.")
    commands = parser.add_subparsers(metavar="COMMAND")
    commands.add_parser("info", help="print the environment a bug report needs").set_defaults(run=info.main)
    args = parser.parse_args(argv)  # an unknown command exits 2 with argparse's usage message
    if not hasattr(args, "run"):
        parser.print_help(sys.stderr)
        return 2
    return args.run()


if __name__ == "__main__":
    sys.exit(main())
