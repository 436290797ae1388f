"""A local file as a target: the atomic, durable commit (temporary file, fsync, rename, directory fsync).

The commit itself is :mod:`fastpersist.io.commit` (special files written in
place, ``atomic=False``, metadata carried over, stale temporaries removed,
the directory anchor of saves that commit later); loads of a local file keep
the engine's own reader (:mod:`fastpersist.io.reader`), which opens the path.
"""

from __future__ import annotations

import os

from fastpersist.config import Settings
from fastpersist.io import commit
from fastpersist.io.targets.base import Target

__all__ = ["LocalFile"]


class LocalFile(Target):
    """The file at a local path; :meth:`checked` resolves it as the kernel does and checks its directory."""

    scheme = "file"
    local = True
    layouts = ("file", "parts")

    def __init__(self, given: str | os.PathLike[str], destination: commit.Target | None = None):
        self._given = os.fspath(given)
        self.destination = destination  # once checked: the resolved path and its directory

    @property
    def path(self) -> str:
        return self._given if self.destination is None else self.destination.path

    @property
    def given(self) -> str:
        return self._given

    @property
    def directory(self) -> str:
        """The directory of the checked target (:meth:`checked` first)."""
        return self.checked().destination.directory

    def checked(self) -> LocalFile:
        """This file resolved as the kernel resolves it, its directory checked (:func:`fastpersist.io.commit.target`).

        Raises:
            as :func:`fastpersist.io.commit.check_target` (a directory, a missing directory, no permission).
        """
        if self.destination is not None:
            return self
        return LocalFile(self._given, commit.target(self._given))

    def anchored(self) -> LocalFile:
        """Checked, with its directory held open until :meth:`release` (:class:`~fastpersist.io.commit.DirectoryAnchor`).

        Raises:
            as :meth:`checked`; FileNotFoundError, NotADirectoryError: the directory is gone already.
        """
        checked = self.checked()
        return LocalFile(self._given, commit.anchored(checked.destination))

    def release(self) -> None:
        if self.destination is not None:
            self.destination.release()

    def commit_plan(self, plan, settings: Settings, streams=None, *, before_commit=None, after_reads=None) -> None:
        """:func:`fastpersist.io.commit.commit_plan` (its semantics and errors)."""
        commit.commit_plan(
            plan, self.checked().destination, settings, streams, before_commit=before_commit, after_reads=after_reads
        )
