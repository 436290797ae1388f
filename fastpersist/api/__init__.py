"""The public entry points, re-exported: ``save``, ``load``, ``async_save``, ``verify``.

Each lives in a module of its own: :mod:`fastpersist.api.saving`,
:mod:`fastpersist.api.loading`, :mod:`fastpersist.api.futures`,
:mod:`fastpersist.api.verification`; the atomic commit in :mod:`fastpersist.io.commit`.
"""

from fastpersist.api.futures import SaveFuture, async_save
from fastpersist.api.loading import load
from fastpersist.api.saving import save
from fastpersist.api.verification import VerifyReport, verify

__all__ = ["save", "load", "async_save", "SaveFuture", "verify", "VerifyReport"]
