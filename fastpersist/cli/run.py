"""``fastpersist run``: runs a Python program with torch.save, torch.load and safetensors going through fastpersist.

Nothing in the program changes: ``fastpersist.patch()`` is applied before the
program imports anything, so even modules that import the functions by name
(``from safetensors.torch import save_file``) get fastpersist's. Forms::

    python -m fastpersist.run [options] train.py ARGS       # fastpersist/run.py
    python -m fastpersist.run [options] -m package.module ARGS
    fastpersist run [options] [--] [python] train.py ARGS
    torchrun --nproc-per-node 2 -m fastpersist.run [options] train.py ARGS
    torchrun --nproc-per-node 2 --no-python fastpersist run [options] -- python train.py ARGS
    accelerate launch -m fastpersist.run [options] train.py ARGS

Options: ``--mode sync|snapshot`` (``fastpersist.patch(mode=...)``), ``--alignment N``
(safetensors files; 8, the library's bytes, by default), ``--no-safetensors``;
settings through the ``FASTPERSIST_*`` environment variables. The program runs
in this process as ``python`` would run it (``runpy``: ``__main__``,
``sys.argv``, ``sys.path[0]``); its exit status is the process's. A named
interpreter other than this one (``fastpersist run -- /opt/py/bin/python x.py``)
is started in place of this process (``exec``) with ``-m fastpersist.run``.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import shutil
import sys

HELP = "run a Python program with torch.save/torch.load/safetensors going through fastpersist"

__all__ = ["HELP", "add_arguments", "main", "run"]

_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mode",
        choices=("sync", "snapshot"),
        default="sync",
        help="sync: every save is durable when it returns; snapshot: saves return once the state is copied "
        "and are written in the background (docs/patch.md)",
    )
    parser.add_argument(
        "--alignment",
        type=int,
        default=8,
        help="where safetensors files' data starts: 8 = the safetensors library's exact bytes (default), "
        "4096 = O_DIRECT-aligned",
    )
    parser.add_argument("--no-safetensors", action="store_true", help="leave safetensors' functions alone")
    parser.add_argument("-m", dest="module", nargs=argparse.REMAINDER, help="run a module as `python -m` does")
    parser.add_argument("program", nargs=argparse.REMAINDER, help="[python] script.py ARGS")


def _is_python(word: str) -> bool:
    return bool(_PYTHON.match(os.path.basename(word)))


def _same_interpreter(word: str) -> bool:
    found = shutil.which(word)
    return found is not None and os.path.realpath(found) == os.path.realpath(sys.executable)


def _options(args: argparse.Namespace) -> list[str]:
    """The launcher's own options, to hand on to another interpreter."""
    options = ["--mode", args.mode, "--alignment", str(args.alignment)]
    return options + (["--no-safetensors"] if args.no_safetensors else [])


def _program(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """``("module", [name, *args])`` or ``("script", [path, *args])``; execs another interpreter when one is named.

    Raises:
        SystemExit: nothing to run (usage error, status 2).
    """
    if args.module:
        return "module", list(args.module)
    program = list(args.program)
    if program[:1] == ["--"]:
        program = program[1:]
    if program and _is_python(program[0]):
        interpreter, program = program[0], program[1:]
        if not _same_interpreter(interpreter) and interpreter != sys.executable:
            os.execvp(interpreter, [interpreter, "-m", "fastpersist.run", *_options(args), *program])
        if program[:1] == ["-m"] and len(program) > 1:
            return "module", program[1:]
    if not program or program[0].startswith("-"):
        print(
            "fastpersist run: name a Python script or -m MODULE (other interpreter options are not supported)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return "script", program


def run(args: argparse.Namespace) -> int:
    """Patches, then runs the program here; returns 0 when it returns (its ``sys.exit`` status otherwise)."""
    from fastpersist.api.patching import patch

    kind, program = _program(args)
    patch(mode=args.mode, alignment=args.alignment, safetensors=not args.no_safetensors)
    # Left in place until the process ends: the program's exit handlers may save too, and pending
    # snapshot saves complete at exit (fastpersist.io.queue).
    if kind == "module":
        sys.argv = [program[0], *program[1:]]
        sys.path[0] = os.getcwd()  # as `python -m` sets it
        runpy.run_module(program[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(program)
        sys.path[0] = os.path.dirname(os.path.abspath(program[0]))  # as `python script.py` sets it
        runpy.run_path(program[0], run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m fastpersist.run ...``: the same as ``fastpersist run ...``."""
    parser = argparse.ArgumentParser(prog="python -m fastpersist.run", description=HELP)
    add_arguments(parser)
    return run(parser.parse_args(argv))
