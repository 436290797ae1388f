"""Metadata exchange between the ranks of a collective save or load, with timeouts.

Every step of a collective operation ends in :meth:`Coordinator.exchange`:
each rank posts a small, pickled status (its payload, or the error it hit) to
the process group's key-value store (the ``torch.distributed`` store that
``init_process_group`` created: TCPStore or FileStore), then waits until every
rank of the group has posted, at most ``timeout`` seconds. Every rank thus
learns every rank's status, and:

* an exception on any rank is raised on every rank as a
  :class:`~fastpersist.errors.DistributedCheckpointError` naming the rank(s)
  and their errors;
* a rank that never reports (killed, hung, or not calling the collective) is
  detected by the timeout, and the error names the ranks that did not report;
* if the store itself goes away (rank 0, which hosts a TCPStore, was killed)
  the store's connection error is raised the same way.

The store carries metadata only (sizes, CRC-32s, names, status). It is used
instead of ``all_gather_object`` because a collective of the group's backend
can only time out at the group's own timeout (30 minutes by default; NCCL may
also abort the process), while a store wait takes a timeout per call. Keys are
namespaced by the group's ranks and a per-group call counter (every rank
makes the same collective calls in the same order); each rank deletes its
keys of the call before last, so the store does not grow with the number of
saves.
"""

from __future__ import annotations

import datetime
import hashlib
import pickle
import threading
from typing import Any

import torch.distributed as dist

from fastpersist.errors import DistributedCheckpointError

__all__ = ["Coordinator", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 600.0
"""Seconds a rank waits for the others at each step (covers the slowest rank's share of the write)."""

_counters: dict[str, int] = {}
_own_keys: dict[str, list[list[str]]] = {}
_lock = threading.Lock()


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    filename = getattr(error, "filename", None)
    if filename and str(filename) not in text:
        text += f" [{filename}]"
    return text


class Coordinator:
    """One collective call's view of its group: rank, size, and the status exchange.

    Args:
        group: a ``torch.distributed`` process group (``None``: the default group).
        timeout: seconds to wait for the other ranks at each exchange.
        what: a word for messages ("save", "load").

    Raises:
        RuntimeError: torch.distributed is not initialized.
    """

    def __init__(self, group: Any = None, timeout: float = DEFAULT_TIMEOUT, what: str = "save"):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "a collective fastpersist call needs torch.distributed initialized "
                "(torch.distributed.init_process_group); call it on every rank"
            )
        if group is None:
            group = dist.group.WORLD
        self.group = group
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise RuntimeError("this process is not a member of the process group passed as group=")
        self.size = dist.get_world_size(group)
        self.global_ranks = dist.get_process_group_ranks(group)
        self.timeout = float(timeout)
        self.what = what
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        namespace = hashlib.sha1(repr(self.global_ranks).encode()).hexdigest()[:12]
        with _lock:
            call = _counters.get(namespace, 0)
            _counters[namespace] = call + 1
            history = _own_keys.setdefault(namespace, [])
            stale = history.pop(0) if len(history) >= 2 else []
            history.append([])
            self._keys = history[-1]
        self.prefix = f"fastpersist/{namespace}/{call}/"
        self.store = dist.distributed_c10d._get_default_store()
        for key in stale:  # the call before last: every rank has read them (see the module docstring)
            try:
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001 - housekeeping must not fail a save
                pass

    def global_rank(self, group_rank: int) -> int:
        return self.global_ranks[group_rank]

    def exchange(self, step: str, payload: Any = None, error: BaseException | None = None) -> list[Any]:
        """Posts this rank's payload (or error), returns every rank's payload in rank order.

        Raises:
            DistributedCheckpointError: some rank posted an error or did not
                post within the timeout, or the store is unreachable. Raised
                on every rank (chained from ``error`` on the rank that had it).
        """
        status = ("error", _describe(error)) if error is not None else ("ok", payload)
        key = f"{self.prefix}{step}/{self.rank}"
        keys = [f"{self.prefix}{step}/{r}" for r in range(self.size)]
        try:
            self.store.set(key, pickle.dumps(status))
            self._keys.append(key)
            try:
                self.store.wait(keys, datetime.timedelta(seconds=self.timeout))
            except Exception as e:  # noqa: BLE001 - the store reports a timeout as RuntimeError/DistStoreError
                missing = [r for r, k in enumerate(keys) if not self._present(k)]
                if not missing:
                    raise
                failures = {r: f"did not report within {self.timeout:g} s" for r in missing}
                raise DistributedCheckpointError(
                    f"collective {self.what} failed at step {step!r}: rank(s) {missing} of the group did not "
                    f"report within {self.timeout:g} s (killed, hung, or not calling fastpersist.{self.what} "
                    f"collectively); nothing was committed. Raise timeout= if a rank is just slow",
                    failures,
                ) from e
            statuses = [pickle.loads(self.store.get(k)) for k in keys]
            self._acknowledge(step)
        except DistributedCheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise DistributedCheckpointError(
                f"collective {self.what} failed at step {step!r}: the torch.distributed store is unreachable "
                f"({type(e).__name__}: {e}); rank 0, which hosts it, probably died. Nothing was committed",
                {0: "store unreachable"},
            ) from (error or e)
        failures = {r: s[1] for r, s in enumerate(statuses) if s[0] == "error"}
        if failures:
            detail = "; ".join(f"rank {r}: {text}" for r, text in sorted(failures.items()))
            raise DistributedCheckpointError(
                f"collective {self.what} failed on rank(s) {sorted(failures)} at step {step!r} ({detail}); "
                "nothing was committed and the previous checkpoint is intact",
                failures,
            ) from error
        return [s[1] for s in statuses]

    def _acknowledge(self, step: str) -> None:
        """Tells the store's host this rank has read the step; the host waits for everybody's word.

        The store lives in global rank 0's process: if that rank returned and its
        process ended (the last save before exit) while others were still reading
        the statuses, they would fail on a vanished store.
        """
        key = f"{self.prefix}{step}/read/{self.rank}"
        self.store.set(key, b"1")
        self._keys.append(key)
        if dist.get_rank() == 0:
            try:
                self.store.wait([f"{self.prefix}{step}/read/{r}" for r in range(self.size)],
                                datetime.timedelta(seconds=self.timeout))  # fmt: skip
            except Exception:  # noqa: S110 - a rank that died after reading changes nothing here
                pass

    def _present(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:  # noqa: BLE001
            return False

    def run(self, step: str, work, *args, **kwargs) -> list[Any]:
        """Runs ``work(*args, **kwargs)`` here, then :meth:`exchange` its result or its error."""
        try:
            payload = work(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to every rank, then raised here too
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            self.exchange(step, error=e)
            raise AssertionError("unreachable") from e  # exchange always raises when given an error
        return self.exchange(step, payload)

