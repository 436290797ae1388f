"""Helper threads that also work while the interpreter shuts down.

``concurrent.futures`` refuses new work once the interpreter has started to
shut down (``atexit`` handlers, non-daemon threads that outlive the main
thread): ``submit`` raises "cannot schedule new futures after interpreter
shutdown". A save or load there must still work, so :func:`executor` hands
out a real thread pool when one may be used and otherwise an executor that
runs each task on the calling thread at submission (slower, same results).
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["executor", "detached", "in_background", "InlineExecutor", "threads_allowed"]

_lock = threading.Lock()
_background: concurrent.futures.Executor | None = None  # in_background's thread (started on first use, per process)


def threads_allowed() -> bool:
    """False once new pool threads cannot be started (interpreter shutdown has begun)."""
    if sys.is_finalizing():
        return False
    from concurrent.futures import thread as _thread

    if getattr(_thread, "_shutdown", False):
        return False
    return not getattr(threading, "_SHUTTING_DOWN", False)


class InlineExecutor(concurrent.futures.Executor):
    """Runs every task at once on the submitting thread; its future is already done."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - delivered through the future, like a pool's
            future.set_exception(e)
        else:
            future.set_result(result)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass


class _FallbackPool(concurrent.futures.ThreadPoolExecutor):
    """A thread pool whose ``submit`` runs the task inline when shutdown forbids new work."""

    def submit(self, fn, /, *args, **kwargs):
        try:
            return super().submit(fn, *args, **kwargs)
        except RuntimeError:
            if threads_allowed():
                raise
            return InlineExecutor().submit(fn, *args, **kwargs)


def executor(max_workers: int, thread_name_prefix: str = "fastpersist") -> concurrent.futures.Executor:
    """A pool of ``max_workers`` threads, or an inline executor during interpreter shutdown."""
    if not threads_allowed():
        return InlineExecutor()
    return _FallbackPool(max_workers, thread_name_prefix=thread_name_prefix)


def detached(name: str, fn: Callable[..., Any], /, *args: Any) -> concurrent.futures.Future:
    """Runs ``fn(*args)`` on a thread of its own that ends with it (at once, here, during interpreter shutdown).

    For work that must not hold up the caller's next step and must not wait behind other work either (a save's
    digests, a tmpfs mapping's unmap); cleanup that may queue goes to :func:`in_background`. The thread is joined
    at interpreter exit, as every pool thread is.
    """
    pool = executor(1, name)
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)


def in_background(fn: Callable[..., Any], /, *args: Any) -> None:
    """Runs ``fn(*args)`` off the caller's path on the process's one background thread, tasks in submission order;
    on the calling thread during interpreter shutdown or when no thread can start. The caller does not wait and
    ``fn`` handles its own errors (an exception is not delivered).

    For cleanup that takes time but must not hold up the caller's next step, such as freeing a replaced file's
    blocks on a filesystem that discards them. The thread is joined at interpreter exit, as every pool thread is,
    so work queued here is done before the process ends.
    """
    global _background
    if threads_allowed():
        with _lock:
            if _background is None:
                _background = executor(1, "fastpersist-background")
            pool = _background
        try:
            pool.submit(fn, *args)
            return
        except RuntimeError:  # no thread can be started: run it here
            pass
    fn(*args)


def _forget_after_fork() -> None:
    global _lock, _background
    _lock, _background = threading.Lock(), None  # the parent's thread does not exist in the child


os.register_at_fork(after_in_child=_forget_after_fork)
