"""``fastpersist bench <benchmark> ...``: the benchmarks of ``python -m fastpersist.bench``, from the main command."""

from __future__ import annotations

import argparse

__all__ = ["HELP", "add_arguments", "run"]

HELP = "run a benchmark ('fastpersist bench --help' lists them)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fastpersist.bench import SUBCOMMANDS, listing

    # The list comes from the one registry (fastpersist.bench.SUBCOMMANDS), laid out as written.
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = "run a benchmark (the same as 'python -m fastpersist.bench <benchmark> ...')"
    parser.epilog = f"benchmarks:\n{listing()}\n\n'fastpersist bench <benchmark> --help' lists a benchmark's options"
    parser.add_argument("benchmark", choices=sorted(SUBCOMMANDS), metavar="benchmark", help="which one (see below)")
    parser.add_argument("arguments", nargs=argparse.REMAINDER, help="its options")


def run(args: argparse.Namespace) -> int:
    from fastpersist.bench.__main__ import main

    return main([args.benchmark, *args.arguments])
