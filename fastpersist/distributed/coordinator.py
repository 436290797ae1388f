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

**Which call is which.** Ranks do not count their calls: one call made on
some ranks only (a collective save left inside ``if rank == 0:``) would put
the counts out of step for good. Instead the group's rank 0 *opens* each
call: it takes the next number of a counter in the store (``store.add``) and
posts the call's description there (``"save"`` or ``"load"``, the layout and
the file's base name). Every other rank walks the opened calls it has not yet
seen, in order, and joins the first that describes its own call:

* a call that was abandoned (its rank 0 timed out, failed or was
  interrupted; the call is then marked *aborted* in the store) is skipped;
* a call that describes another operation (rank 0 saving ``a.pt`` while this
  rank saves ``b.pt``, another layout, a load) is a mistake in the program
  (per-rank paths, a call inside ``if rank == 0:``): this rank marks it
  aborted, saying what it is doing instead, and raises at once; rank 0,
  waiting in that call, sees the mark and raises too, naming both calls;
* if rank 0 opens nothing within the timeout, this rank raises.

So mismatched calls fail within a moment on the ranks that made them, not
after the timeout, and the next matched call works. A rank that gives up on
a call (timeout, error, Ctrl-C) marks it aborted, and ranks waiting in it
notice within a second instead of waiting out their own timeout.

Calls of one group follow each other in a process: a collective call first
waits for the asynchronous collective saves still pending in this process
(:func:`fastpersist.io.queue.wait_collective`), whose steps run on the
background save thread through this same store (never through a collective
of the group's backend, which must not be issued from a second thread).

The store carries metadata only (sizes, digests, names, status). It is used
instead of ``all_gather_object`` because a collective of the group's backend
can only time out at the group's own timeout (30 minutes by default; NCCL may
also abort the process), while a store wait takes a timeout per call. Each
rank deletes its keys of the call before last, so the store does not grow
with the number of saves.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
import time
from typing import Any

import torch.distributed as dist

from fastpersist.errors import CallAbandoned, CallNotOpened, DistributedCheckpointError, StoreWaitTimedOut
from fastpersist.io import queue, timeline

__all__ = ["Coordinator", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 600.0
"""Seconds a rank waits for the others at each step (covers the slowest rank's share of the write)."""


class _GroupState:
    """Per process and per group: the last call this rank took part in, and its keys to delete later."""

    def __init__(self) -> None:
        self.last_call = 0
        self.keys: list[list[str]] = []


_states: dict[tuple[int, str], _GroupState] = {}
_lock = threading.Lock()


def _forget_after_fork() -> None:
    # A forked child is not a member of its parent's groups; its lock may have been held.
    global _lock
    _lock = threading.Lock()
    _states.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


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
        description: what this call is (e.g. the layout and the file's base
            name): ranks join a call of rank 0's only when ``what`` and this
            match, so mismatched calls fail instead of pairing up.

    Raises:
        RuntimeError: torch.distributed is not initialized, or this process is
            not a member of ``group``.
        ValueError: ``timeout`` is not positive.
    """

    def __init__(self, group: Any = None, timeout: float = DEFAULT_TIMEOUT, what: str = "save", description: str = ""):
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
        self.description = description
        if self.timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.namespace = "fastpersist/" + hashlib.sha1(repr(self.global_ranks).encode()).hexdigest()[:12]
        self.store = dist.distributed_c10d._get_default_store()
        with _lock:
            self._state = _states.setdefault((id(self.store), self.namespace), _GroupState())
        self.call: int | None = None  # the store's number of this call, once opened or joined
        self._keys: list[str] = []

    def global_rank(self, group_rank: int) -> int:
        return self.global_ranks[group_rank]

    # ------------------------------------------------------------------ which call

    def _call_key(self, call: int) -> str:
        return f"{self.namespace}/call/{call}"

    def _aborted_key(self, call: int) -> str:
        return f"{self.namespace}/call/{call}/aborted"

    def _counter(self) -> str:
        return f"{self.namespace}/calls"

    def _begin(self, deadline: float, step: str) -> None:
        """Opens (rank 0) or joins (the others) this call; sets :attr:`call`."""
        queue.wait_collective()  # calls of a group follow each other (see the module docstring)
        if self.rank == 0:
            call = self.store.add(self._counter(), 1)
            self._keys.append(self._call_key(call))
            self.store.set(self._call_key(call), pickle.dumps((self.what, self.description)))
        else:
            call = self._join(deadline, step)
        self.call = call
        self._state.last_call = call
        with _lock:
            self._state.keys.append(self._keys)
            stale = self._state.keys.pop(0) if len(self._state.keys) > 2 else []
        for key in stale:  # the call before last: every rank has read them (see the module docstring)
            try:
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001 - housekeeping must not fail a save
                pass

    def _join(self, deadline: float, step: str) -> int:
        """The first opened call after the last one this rank took part in that describes this call."""
        call = self._state.last_call + 1
        if self.store.add(self._counter(), 0) < self._state.last_call:
            call = 1  # a new store (the group was made again): its calls count from 1
        while True:
            key = self._call_key(call)
            if not self._present(key):
                if self.store.add(self._counter(), 0) > call:
                    call += 1  # opened, abandoned and already cleaned up
                    continue
                self._wait_for([key], deadline, step, waiting_for_open=True)
                continue
            if self._present(self._aborted_key(call)):
                call += 1
                continue
            what, description = pickle.loads(self.store.get(key))
            if (what, description) == (self.what, self.description):
                return call
            self._refuse(call, f"{what} ({description})")

    def _refuse(self, call: int, theirs: str) -> None:
        """Rank 0 opened another call than this rank's: marks it aborted (rank 0 raises on seeing it), raises."""
        mine = f"{self.what} ({self.description})"
        advice = (
            "Every rank must make the same collective calls in the same order, with the same path, layout and "
            "writers (not per-rank paths, not inside `if rank == 0:`)"
        )
        self.call = call
        self.abort(f"called {mine} while rank 0 called {theirs}. {advice}", {self.rank: f"called {mine}"})
        self.call = None
        raise DistributedCheckpointError(
            f"collective {self.what} failed: rank 0 of the group is in another call, {theirs}, while this rank "
            f"(rank {self.rank}) called {mine}. {advice}; nothing was committed",
            {0: f"called {theirs}", self.rank: f"called {mine}"},
        )

    def abort(self, reason: str, failures: dict[int, str] | None = None, step: str | None = None) -> None:
        """Marks this call abandoned, so the ranks still in it stop waiting (best effort, never raises).

        The process that hosts the store (global rank 0) then waits a moment
        for the ranks that were still in the call to see the mark: if it
        returned and exited at once, they would find the store gone and could
        only say that it is unreachable.
        """
        if self.call is None:
            return
        key = self._aborted_key(self.call)
        try:
            self.store.set(key, pickle.dumps((f"rank {self.rank} {reason}", dict(failures or {}))))
            self._keys.append(key)
        except Exception:  # noqa: BLE001 - the store may be gone; the others then time out
            return
        if dist.get_rank() != 0 or step is None:
            return
        alive = [r for r in range(self.size) if r != self.rank and r not in (failures or {})]
        seen = [f"{key}/seen/{r}" for r in alive]
        try:
            self._wait_for(seen, time.monotonic() + 2 * _poll_cap(self.size) + 1.0, step, waiting_for_open=True)
        except Exception:  # noqa: BLE001 - a rank that never looks again changes nothing here
            pass

    # ------------------------------------------------------------------ waiting

    def _wait_for(self, keys: list[str], deadline: float, step: str, *, waiting_for_open: bool = False) -> None:
        """Waits until every key exists; raises at the deadline or when the call was abandoned.

        Polls with ``store.check`` (a sleep between looks, from 0.1 ms growing
        by a quarter each time to :func:`_poll_cap`) rather than blocking in ``store.wait``: a
        sleeping thread takes Ctrl-C at once, an abandoned call is noticed within
        one interval, and timed-out store waits would log a C++ warning each.
        """
        pause, cap = 0.0001, _poll_cap(self.size)
        while True:
            if self.store.check(keys):
                return
            if self.call is not None and not waiting_for_open:
                mark = self._aborted_by()
                if mark is not None:
                    raise CallAbandoned(mark)
            if time.monotonic() >= deadline:
                if waiting_for_open:
                    raise CallNotOpened()
                raise StoreWaitTimedOut()
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            # Fine at first (ranks usually arrive within milliseconds), then calm. Growing by a quarter, a look
            # comes at most ~25% of the time waited so far after the keys appear (by half: ~50%).
            pause = min(pause * 1.25, cap)

    def _aborted_by(self) -> tuple[str, dict[int, str]] | None:
        """Why another rank abandoned this call and whom it blamed, or None. Tells the store's host it was seen."""
        key = self._aborted_key(self.call)
        if not self._present(key):
            return None
        try:
            self.store.set(f"{key}/seen/{self.rank}", b"1")
            self._keys.append(f"{key}/seen/{self.rank}")
            return pickle.loads(self.store.get(key))
        except Exception:  # noqa: BLE001
            return ("another rank abandoned it", {})

    def exchange(
        self, step: str, payload: Any = None, error: BaseException | None = None, *, last: bool = True
    ) -> list[Any]:
        """Posts this rank's payload (or error), returns every rank's payload in rank order.

        ``last=False`` says another step of this call follows whatever happens
        here unless some rank posts an error: the store's host then need not
        wait until every rank has read the statuses (the next step waits for
        them all anyway), which saves a round trip per step.

        Raises:
            DistributedCheckpointError: some rank posted an error or did not
                post within the timeout, or the store is unreachable. Raised
                on every rank (chained from ``error`` on the rank that had it).
        """
        deadline = time.monotonic() + self.timeout
        timeline.mark("post " + step)
        try:
            if self.call is None:
                self._begin(deadline, step)
            prefix = f"{self.namespace}/{self.call}/"
            keys = [f"{prefix}{step}/{r}" for r in range(self.size)]
            if error is None:
                status = ("ok", payload)
            elif isinstance(error, DistributedCheckpointError):  # a verdict about the group: passed on as it is
                status = ("error", _describe(error), str(error), error.failures)
            else:
                status = ("error", _describe(error))
            self.store.set(keys[self.rank], pickle.dumps(status))
            self._keys.append(keys[self.rank])
            self._wait_for(keys, deadline, step)
            statuses = [pickle.loads(self.store.get(k)) for k in keys]
            if last or any(s[0] == "error" for s in statuses):  # the same verdict on every rank
                self._acknowledge(prefix, step)
        except (KeyboardInterrupt, SystemExit) as e:
            self.abort(f"was interrupted ({type(e).__name__}) at step {step!r}", {self.rank: "interrupted"}, step)
            raise
        except CallNotOpened:
            this = f" ({self.what} {self.description})" if self.description else ""
            raise DistributedCheckpointError(
                f"collective {self.what} failed at step {step!r}: rank 0 of the group did not make this call{this} "
                f"within {self.timeout:g} s. Every rank must call fastpersist.{self.what} with the same "
                "path, in the same order (not inside `if rank == 0:`); nothing was committed",
                {0: "did not make this call"},
            ) from error
        except StoreWaitTimedOut:
            missing = [r for r, k in enumerate(keys) if not self._present(k)]
            failures = {r: f"did not report within {self.timeout:g} s" for r in missing}
            self.abort(
                f"gave up at step {step!r}: rank(s) {missing} did not report within {self.timeout:g} s", failures, step
            )
            raise DistributedCheckpointError(
                f"collective {self.what} failed at step {step!r}: rank(s) {missing} of the group did not "
                f"report within {self.timeout:g} s (killed, hung, or not calling fastpersist.{self.what} "
                f"collectively); nothing was committed. Raise timeout= if a rank is just slow",
                failures,
            ) from error
        except CallAbandoned as e:
            reason, failures = e.args[0]
            raise DistributedCheckpointError(
                f"collective {self.what} failed at step {step!r}: the call was abandoned ({reason}); nothing was "
                "committed and the previous checkpoint is intact",
                failures,
            ) from error
        except DistributedCheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise DistributedCheckpointError(
                f"collective {self.what} failed at step {step!r}: the torch.distributed store is unreachable "
                f"({type(e).__name__}: {e}); rank 0, which hosts it, probably died. Nothing was committed",
                {0: "store unreachable"},
            ) from (error or e)
        timeline.mark("heard " + step)
        failures = {r: s[1] for r, s in enumerate(statuses) if s[0] == "error"}
        verdicts = [s for s in statuses if s[0] == "error" and len(s) == 4]
        if len(failures) == 1 and verdicts:  # one rank judged the group (e.g. rank 0 found divergent tensors)
            raise DistributedCheckpointError(verdicts[0][2], verdicts[0][3]) from error
        if failures:
            detail = "; ".join(f"rank {r}: {text}" for r, text in sorted(failures.items()))
            raise DistributedCheckpointError(
                f"collective {self.what} failed on rank(s) {sorted(failures)} at step {step!r} ({detail}); "
                "nothing was committed and the previous checkpoint is intact",
                failures,
            ) from error
        return [s[1] for s in statuses]

    def _acknowledge(self, prefix: str, step: str) -> None:
        """Tells the store's host this rank has read the step; the host waits for everybody's word.

        The store lives in global rank 0's process: if that rank returned and its
        process ended (the last save before exit) while others were still reading
        the statuses, they would fail on a vanished store.
        """
        key = f"{prefix}{step}/read/{self.rank}"
        self.store.set(key, b"1")
        self._keys.append(key)
        if dist.get_rank() == 0:
            try:
                self._wait_for(
                    [f"{prefix}{step}/read/{r}" for r in range(self.size)], time.monotonic() + self.timeout, step
                )
            except (StoreWaitTimedOut, CallAbandoned):  # a rank that died after reading changes nothing here
                pass

    def _present(self, key: str) -> bool:
        try:
            return bool(self.store.check([key]))
        except Exception:  # noqa: BLE001
            return False

    def run(self, step: str, work, *args, last: bool = True, **kwargs) -> list[Any]:
        """Runs ``work(*args, **kwargs)`` here, then :meth:`exchange` its result or its error (``last``: as there).

        A ``KeyboardInterrupt`` or ``SystemExit`` in ``work`` marks the call
        aborted (the other ranks raise within a second) and propagates.
        """
        try:
            payload = work(*args, **kwargs)
        except BaseException as e:
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                self.abort(
                    f"was interrupted ({type(e).__name__}) before step {step!r}", {self.rank: "interrupted"}, step
                )
                raise
            self.exchange(step, error=e)
            raise AssertionError("unreachable") from e  # exchange always raises when given an error
        return self.exchange(step, payload, last=last)


def _poll_cap(size: int) -> float:
    """Longest pause between two looks at the store: 50 ms, longer in large groups (~1,000 looks/s in all)."""
    return max(0.05, size / 1000.0)
