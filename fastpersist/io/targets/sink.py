"""A discarding sink as a target: the save pipeline without storage (benchmarks).

Every byte of the plan goes through the ring writer into ``/dev/null``
(buffered: the kernel throws it away), and nothing is committed. A
collective save to a sink (``fastpersist.distributed.save.save(obj, Sink(),
group=...)``) runs every phase the same way: each writer writes its share
into ``/dev/null``, rank 0 creates no temporary file and commits nothing.
"""

from __future__ import annotations

import os

from fastpersist.config import Settings
from fastpersist.io import engine
from fastpersist.io.targets.base import Target
from fastpersist.io.writer import write_plan

__all__ = ["Sink"]


class Sink(Target):
    """Discards what is written to it (see the module docstring)."""

    scheme = "sink"
    discards = True
    layouts = ("file", "parts")

    @property
    def path(self) -> str:
        return os.devnull

    def commit_plan(self, plan, settings: Settings, streams=None, *, before_commit=None, after_reads=None) -> list[int]:
        """Writes the plan into ``/dev/null``; returns the records' CRC-32s (as the writer computed them)."""
        file = engine.File(os.devnull, "w", direct=False, create=False)
        try:
            crcs = write_plan(plan, file, settings, streams=streams, after_reads=after_reads)
        finally:
            file.close()
        if before_commit is not None:
            before_commit()
        return crcs
