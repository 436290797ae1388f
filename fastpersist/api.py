"""The public entry points, re-exported: ``save``, ``load``, ``async_save``, ``verify``.

Each lives in a module of its own: :mod:`fastpersist.saving`,
:mod:`fastpersist.loading`, :mod:`fastpersist.futures`,
:mod:`fastpersist.verification`; the atomic commit in :mod:`fastpersist.commit`.
"""

from fastpersist.futures import SaveFuture, async_save
from fastpersist.loading import load
from fastpersist.saving import save
from fastpersist.verification import VerifyReport, verify

__all__ = ["save", "load", "async_save", "SaveFuture", "verify", "VerifyReport"]
