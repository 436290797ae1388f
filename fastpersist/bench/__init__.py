"""Benchmarks: ``python -m fastpersist.bench <subcommand> [options]``.

Subcommands live in modules of this package, each with ``main(argv) -> int``:

* ``io`` -- raw engine throughput against fio (:mod:`fastpersist.bench.io`);
* ``checkpoint`` -- whole checkpoints against torch.save & co.
  (:mod:`fastpersist.bench.checkpoint`).

Add one with :func:`register` (or by adding it to :data:`SUBCOMMANDS`); the
module is imported only when its subcommand runs.
"""

from __future__ import annotations

__all__ = ["SUBCOMMANDS", "register"]

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "io": ("fastpersist.bench.io", "sequential write/read throughput of the I/O engine, optionally against fio"),
    "checkpoint": ("fastpersist.bench.checkpoint", "save/load a real-shaped checkpoint with every method"),
    "report": ("fastpersist.bench.report", "Markdown of results; --update-docs regenerates the docs' tables"),
    "shapes": ("fastpersist.bench.shapes", "many-small / many-medium / huge / mixed states vs torch, fio and a sink"),
}
"""Subcommand name -> (module defining ``main(argv)``, one-line description)."""


def register(name: str, module: str, description: str = "") -> None:
    """Adds subcommand ``name`` run by ``module.main(argv)``."""
    SUBCOMMANDS[name] = (module, description)
