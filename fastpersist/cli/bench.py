"""``fastpersist bench <benchmark> ...``: the benchmarks of ``python -m fastpersist.bench``, from the main command."""

from __future__ import annotations

import argparse

__all__ = ["HELP", "add_arguments", "run"]

HELP = "run a benchmark: io, checkpoint, report (see 'fastpersist bench --help')"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fastpersist.bench import SUBCOMMANDS

    parser.add_argument("benchmark", choices=sorted(SUBCOMMANDS), help="which benchmark")
    parser.add_argument("arguments", nargs=argparse.REMAINDER, help="its options ('--help' lists them)")


def run(args: argparse.Namespace) -> int:
    from fastpersist.bench.__main__ import main

    return main([args.benchmark, *args.arguments])
