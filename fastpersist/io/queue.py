"""The background save queue: one thread per process runs saves in call order; their futures.

Saves (and other work that must follow them, :func:`run_in_order`) are
queued as :class:`SaveFuture` objects and run one after another on the
``fastpersist-save`` thread, so a later save of a path always lands after an
earlier one and host memory stays one pinned ring. Errors are never lost:
``result()``/``wait()`` re-raise them; a failed save whose error nobody
checked is reported by a ``RuntimeWarning`` at the next submission
(:func:`report_unchecked_as_warnings`), and at interpreter exit (after
pending saves have finished) on stderr, with exit status 1. Saves still
pending at exit are completed before the interpreter shuts down. After
``fork()`` the child gets a fresh worker (the parent's pending saves finish
in the parent).

What runs is up to the caller (:mod:`fastpersist.api.futures` queues
``async_save``'s writes; :mod:`fastpersist.api.safetensors` its file saves).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any

from fastpersist.io import timeline

__all__ = [
    "SaveFuture",
    "submit",
    "run_in_order",
    "wait_all",
    "pending_saves",
    "queue_idle",
    "wait_for_slot",
    "has_slot",
    "wait_collective",
    "report_unchecked_as_warnings",
]

_PENDING, _RUNNING, _FINISHED = "pending", "running", "finished"


class SaveFuture:
    """The pending result of a queued save (``fastpersist.async_save``, ``async_save_file``, :func:`run_in_order`).

    Attributes:
        path: the file being written (the URL for an object store).
        mode: ``"pipelined"`` or ``"snapshot"``; ``"upload"`` for the upload of
            a two-tier save (its state is already on local disk); ``"call"``
            for :func:`run_in_order`.
        local_copy: the local file of a two-tier save (None otherwise).
        collective: whether it is a collective save's background part (its
            ranks exchange through the group's store: see :func:`wait_collective`).
        stats: what a finished collective save did (a ``SaveStats``), else None.
    """

    def __init__(self, path: str, mode: str):
        self.path = path
        self.mode = mode
        self.local_copy: str | None = None
        self.collective = False
        self.stats: Any = None
        self._state = _PENDING
        self._error: BaseException | None = None
        self._finished = threading.Event()
        self._checked = False
        self._warned = False
        self._callbacks: list[Callable[[SaveFuture], Any]] = []
        self._work: Callable[[], None] | None = None
        self._release: Any = None  # when the tensors may change again (fastpersist.api.futures), if it applies

    def result(self, timeout: float | None = None) -> None:
        """Blocks until the checkpoint is durable at ``path``; raises the save's error.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds (the save goes on).
            TensorModifiedError: (pipelined mode) a tensor changed during the save.
            OSError, UnsupportedObjectError, ...: whatever the save raised.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the async save to {self.path!r} did not finish within {timeout} seconds")
        self._mark_checked()
        if self._error is not None:
            raise self._error
        return None

    wait = result

    def done(self) -> bool:
        """True once the save finished (successfully or not); never blocks."""
        return self._finished.is_set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error (None if it succeeded), after waiting like :meth:`result`; counts as checked."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the async save to {self.path!r} did not finish within {timeout} seconds")
        self._mark_checked()
        return self._error

    def settle(self, timeout: float | None = None) -> bool:
        """Waits until the save finished, without raising its error or counting it as checked; True if it did."""
        return self._finished.wait(timeout)

    def set_work(self, work: Callable[[], None], release: Any = None) -> SaveFuture:
        """Gives the future what the save thread runs (once, before :func:`submit`); returns the future.

        Args:
            work: the background part of the save; its exception becomes the future's.
            release: for saves that read the caller's tensors in the background, the object whose
                ``release()`` says they may change again (:meth:`release_reads`).

        Raises:
            RuntimeError: the work was already set.
        """
        if self._work is not None:
            raise RuntimeError(f"the save to {self.path!r} already has its work")
        self._work, self._release = work, release
        return self

    def release_reads(self) -> None:
        """Tells a pending save that reads the caller's tensors in the background that they may change from now
        (a Checkpointer's optimizer-step hook calls it; what a change means then: ``fastpersist.api.futures``)."""
        if self._release is not None and not self.done():
            self._release.release()

    def _mark_checked(self) -> None:
        if not self._checked:
            with _lock:
                self._checked = True
                if self in _unchecked:
                    _unchecked.remove(self)

    def add_done_callback(self, callback: Callable[[SaveFuture], Any]) -> None:
        """Calls ``callback(future)`` once the save finished (at once if it already has), on the worker thread."""
        with _lock:
            if not self._finished.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def _run(self) -> None:
        self._state = _RUNNING
        timeline.mark("start")
        try:
            assert self._work is not None
            self._work()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            # The finished frames' locals hold the state (a model's GPU tensors), and this frame holds
            # the future, which holds the error: a cycle that kept the state alive until a garbage
            # collection. Their file and line stay in the traceback; only their locals go.
            traceback.clear_frames(e.__traceback__)
            self._error = e
        timeline.mark("done")
        self._finish()

    def _finish(self) -> None:
        self._work = None  # drop references to the state as soon as possible
        with _lock:
            self._state = _FINISHED
            if self._error is not None and not self._checked:
                _unchecked.append(self)
            try:
                _in_flight.remove(self)
            except ValueError:
                pass
            callbacks, self._callbacks = self._callbacks, []
            self._finished.set()
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # noqa: BLE001 - a callback's bug must not kill the worker
                traceback.print_exc()

    def __repr__(self) -> str:
        state = self._state if self._error is None else "failed"
        return f"<SaveFuture {self.path!r} {self.mode} {state}>"


class _Worker:
    """The background thread: runs queued saves in order."""

    def __init__(self) -> None:
        self.queue: deque[SaveFuture] = deque()
        self.wakeup = threading.Condition(_lock)
        self.thread: threading.Thread | None = None

    def submit(self, future: SaveFuture) -> bool:
        """Queues ``future``; False when no thread can be started (the caller runs it then)."""
        with _lock:
            if self.thread is None or not self.thread.is_alive():
                thread = threading.Thread(target=self._loop, name="fastpersist-save", daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # "can't create new thread at interpreter shutdown"
                    return False
                self.thread = thread
            self.queue.append(future)
            self.wakeup.notify()
        return True

    def _loop(self) -> None:
        while True:
            with _lock:
                while not self.queue:
                    self.wakeup.wait()
                future = self.queue[0]
            future._run()
            with _lock:
                if self.queue and self.queue[0] is future:
                    self.queue.popleft()
            del future  # holds the state (and an error's frames) until the next save otherwise


# One lock guards the worker's queue, the in-flight list and the unchecked errors.
_lock = threading.Lock()
_worker = _Worker()
_in_flight: deque[SaveFuture] = deque()  # submitted, not yet finished, oldest first
_unchecked: list[SaveFuture] = []  # failed, and nobody has called result()/exception()
_exiting = False
_exit_failed = False


def _reset_after_fork() -> None:
    global _lock, _worker, _in_flight, _unchecked, _exiting, _exit_failed
    # The worker thread does not exist in the child; the parent's pending saves finish in the parent.
    orphans = list(_in_flight)
    _lock = threading.Lock()
    _worker = _Worker()
    _in_flight = deque()
    _unchecked = []
    _exiting = False
    _exit_failed = False
    for future in orphans:
        if not future._finished.is_set():
            future._error = RuntimeError(
                f"the async save to {future.path!r} was started before fork(); it completes in the parent process"
            )
            future._checked = True  # not this process's error to report
            future._work = None
            future._state = _FINISHED
            future._finished.set()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def report_unchecked_as_warnings() -> None:
    """Warns once about each failed save whose error nobody checked."""
    with _lock:
        failed = [f for f in _unchecked if not f._checked and not f._warned]
        for future in failed:
            future._warned = True
    for future in failed:
        warnings.warn(
            f"an earlier fastpersist.async_save to {future.path!r} failed and its error was never checked "
            f"(call result() on the future): {type(future._error).__name__}: {future._error}",
            RuntimeWarning,
            stacklevel=3,
        )


def wait_for_slot(max_pending: int) -> None:
    """Bounds the saves in flight: waits for the oldest while there are ``max_pending``."""
    while True:
        with _lock:
            while _in_flight and _in_flight[0]._finished.is_set():
                _in_flight.popleft()
            if len(_in_flight) < max_pending:
                return
            oldest = _in_flight[0]
        oldest._finished.wait()


def has_slot(max_pending: int) -> bool:
    """Whether :func:`wait_for_slot` would return at once: fewer than ``max_pending`` saves in flight."""
    with _lock:
        return sum(not f._finished.is_set() for f in _in_flight) < max_pending


def wait_collective() -> None:
    """Waits until no collective save of this process is pending (their errors stay with their futures).

    A collective call (save or load, ``group=``) opens or joins a numbered call
    in the group's store, and every rank must take its calls in the same
    order; an asynchronous collective save takes part in its call from the
    background thread. So a collective call made on the caller's thread first
    lets the pending ones finish. On the save thread itself it returns at once.
    """
    if threading.current_thread() is _worker.thread:
        return
    while True:
        with _lock:
            pending = [f for f in _in_flight if f.collective and not f._finished.is_set()]
        if not pending:
            return
        pending[0]._finished.wait()


def queue_idle() -> bool:
    """Whether no save is queued or running: work submitted now starts at once."""
    with _lock:
        return not any(not f._finished.is_set() for f in _in_flight)


def pending_saves() -> list[SaveFuture]:
    """The saves submitted and not finished yet, oldest first."""
    with _lock:
        return [f for f in _in_flight if not f._finished.is_set()]


def wait_all(timeout: float | None = None) -> None:
    """Waits for every pending ``async_save``; raises the first error of those (marking all checked).

    Raises:
        TimeoutError: some save did not finish within ``timeout`` seconds.
        Exception: the error of the first failed save among those waited for.
    """
    futures = pending_saves()
    first: BaseException | None = None
    for future in futures:
        error = future.exception(timeout)
        if first is None and error is not None:
            first = error
    if first is not None:
        raise first


def submit(future: SaveFuture) -> SaveFuture:
    """Queues ``future`` (its work set) on the save thread; at interpreter exit runs it here, now."""
    with _lock:
        run_here = _exiting
        if not run_here:
            _in_flight.append(future)
    if run_here or not _worker.submit(future):
        # At interpreter exit nothing may be left behind: run it now, in the caller.
        with _lock:
            if future in _in_flight:
                _in_flight.remove(future)
        future._run()
    return future


def run_in_order(function: Callable[[], None], path: str) -> SaveFuture:
    """Runs ``function()`` on the save thread after every save queued so far; returns its future.

    For work that must follow pending writes, like removing a checkpoint file
    (Lightning's top-k cleanup) while a save of it may still be queued. Its
    errors are reported like a save's.
    """
    future = SaveFuture(os.fspath(path), "call")
    future._work = function
    return submit(future)


def _complete_at_exit() -> None:
    """Finishes pending saves, then reports errors nobody checked (stderr, exit status 1)."""
    global _exiting, _exit_failed
    with _lock:
        _exiting = True
        pending = [f for f in _in_flight if not f._finished.is_set()]
    for future in pending:
        future._finished.wait()
    with _lock:
        failed = [f for f in _unchecked if not f._checked]
        for future in failed:
            future._checked = True
    for future in failed:
        error = future._error
        kept = f" (its local copy {future.local_copy!r} was written)" if future.local_copy else ""
        print(
            f"fastpersist: the async_save to {future.path!r} failed and its error was never checked; "
            f"that checkpoint was NOT written{kept}:",
            file=sys.stderr,
        )
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
        _exit_failed = True


def _exit_with_failure() -> None:
    _complete_at_exit()  # saves started by atexit handlers registered after ours
    if _exit_failed:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(1)


# threading's exit hooks run before the interpreter joins threads and before atexit
# handlers, while threads can still run: pending saves complete there.
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_complete_at_exit)
# atexit runs handlers last-registered first: this one (registered at import) runs late,
# after the handlers of code imported later, which may still call async_save.
atexit.register(_exit_with_failure)
