"""``fastpersist tune``: find the fastest settings for a filesystem (the sweep lives in :mod:`fastpersist.tuning.tuner`)."""

from __future__ import annotations

from fastpersist.tuning.tuner import add_arguments, run

__all__ = ["HELP", "add_arguments", "run"]

HELP = "measure which settings save and load fastest here; write them as a configuration file"
