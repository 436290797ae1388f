"""The ``fastpersist`` command line: ``fastpersist <command> [options]``.

One package, one module per command. :data:`COMMANDS` maps a name to a
:class:`Command` (``add_arguments(parser)``, ``run(args) -> exit code``, help),
a plain ``(add_arguments, run)`` tuple, or the dotted name of a module defining
``add_arguments``, ``run`` and optionally ``HELP`` -- imported only when the
parser is built, and left out if it cannot be imported (an optional
dependency missing). The commands: ``info`` (:mod:`fastpersist.cli.info`),
``verify`` (:mod:`fastpersist.cli.verify`), ``tune`` (:mod:`fastpersist.cli.tune`),
``bench`` (:mod:`fastpersist.cli.bench`), ``run`` (:mod:`fastpersist.cli.run`: a program with
``fastpersist.patch()`` in place); add one with :func:`register_command`.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["COMMANDS", "Command", "build_parser", "main", "register_command"]


class Command(NamedTuple):
    """One subcommand: argument declarations, implementation and help line."""

    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    help: str = ""


COMMANDS: dict[str, Command | tuple | str] = {}


def register_command(
    name: str,
    add_arguments: Callable[[argparse.ArgumentParser], None] | str,
    run: Callable[[argparse.Namespace], int] | None = None,
    help: str = "",  # noqa: A002 - argparse's word
) -> None:
    """Adds (or replaces) subcommand ``name``.

    ``register_command("x", add_arguments, run, help="...")``, or
    ``register_command("x", "package.module")`` for a module defining
    ``add_arguments``, ``run`` and ``HELP`` (imported lazily).
    """
    if isinstance(add_arguments, str):
        COMMANDS[name] = add_arguments
    else:
        if run is None:
            raise TypeError("register_command needs run() when add_arguments is a function")
        COMMANDS[name] = Command(add_arguments, run, help)


def _resolve(entry: Command | tuple | str) -> Command | None:
    if isinstance(entry, str):
        try:
            module = importlib.import_module(entry)
        except ImportError:
            return None
        doc = (module.__doc__ or "").strip().splitlines()
        summary = re.sub(r"^``[^`]*``:\s*", "", doc[0]) if doc else ""
        return Command(module.add_arguments, module.run, getattr(module, "HELP", summary))
    if isinstance(entry, Command):
        return entry
    add_arguments, run = entry[0], entry[1]
    return Command(add_arguments, run, entry[2] if len(entry) > 2 else "")


for _name in ("info", "verify", "tune", "bench"):
    register_command(_name, f"fastpersist.cli.{_name}")
register_command("convert", "fastpersist.cli.convert")
register_command("merge", "fastpersist.cli.merge")
register_command("run", "fastpersist.cli.run")


# ----------------------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastpersist", description="fastpersist: fast PyTorch checkpoints")
    sub = parser.add_subparsers(dest="command", metavar="command")
    for name, entry in COMMANDS.items():
        command = _resolve(entry)
        if command is None:
            continue
        p = sub.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(_run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
