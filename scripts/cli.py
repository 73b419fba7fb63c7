"""`python -m cupysparse COMMAND`: the commands a user runs without a script of their own (info, warmup, segment)."""

from __future__ import annotations

import argparse
import sys

from cupysparse.scripts import info
from cupysparse.scripts import segment
from cupysparse.scripts import warmup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupysparse", description="cupysparse command line tools.")
    commands = parser.add_subparsers(metavar="COMMAND")
    info_parser = commands.add_parser("info", help="print the environment a bug report needs")
    info_parser.set_defaults(run=lambda args: info.main())
    warmup_parser = commands.add_parser(
        "warmup", help="compile the kernels the reference networks need into the kernel cache",
        description=warmup.__doc__.split("\n\n")[0], epilog=warmup.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    warmup.add_arguments(warmup_parser)
    warmup_parser.set_defaults(run=warmup.run)
    segment_parser = commands.add_parser(
        "segment", help="one class label per point of point-cloud files (.bin, .npy, .ply, …), written as .npy",
        description=segment.__doc__.split("\n\n")[0], epilog=segment.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    segment.add_arguments(segment_parser)
    segment_parser.set_defaults(run=segment.run)
    args = parser.parse_args(argv)  # an unknown command exits 2 with argparse's usage message
    if not hasattr(args, "run"):
        parser.print_help(sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
