"""``fastpersist tune``: find the fastest settings for a filesystem (the sweep lives in :mod:`fastpersist.bench.tune`)."""

from __future__ import annotations

import argparse

__all__ = ["HELP", "add_arguments", "run"]

HELP = "measure which settings save and load fastest here; write them as a configuration file"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fastpersist.bench import tune

    tune.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from fastpersist.bench import tune

    return tune.run(args)
