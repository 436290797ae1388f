"""``async_save`` and the future it returns: saves that run in the background."""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import threading
from typing import Any

from fastpersist import config
from fastpersist.commit import check_target, commit_plan, resolve_target
from fastpersist.format.serializer import DEFAULT_PROTOCOL, archive_name_for, plan_save
from fastpersist.io.writer import side_streams

__all__ = ["async_save", "SaveFuture"]


class SaveFuture:
    """The pending result of :func:`async_save`."""

    def __init__(self, future: concurrent.futures.Future, path: str):
        self._future = future
        self.path = path

    def result(self, timeout: float | None = None) -> None:
        """Blocks until the checkpoint is durable at ``path``; raises the save's error.

        Raises:
            TimeoutError: not finished within ``timeout`` seconds.
            OSError, UnsupportedObjectError, ...: whatever the save raised.
        """
        return self._future.result(timeout)

    wait = result

    def done(self) -> bool:
        """True once the save finished (successfully or not)."""
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<SaveFuture {self.path!r} {state}>"


_executor_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def _reset_after_fork() -> None:
    # The parent's worker thread does not exist in a forked child: start a new one there.
    global _executor, _executor_lock
    _executor = None
    _executor_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def _background() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    with _executor_lock:
        if _executor is None:
            # One worker: background saves run one after another, so host memory stays
            # one ring, and a later save of the same path lands after an earlier one.
            _executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fastpersist-save")
        return _executor


def async_save(
    obj: object,
    f: str | os.PathLike[str],
    pickle_module: Any = pickle,
    pickle_protocol: int = DEFAULT_PROTOCOL,
    **settings: Any,
) -> SaveFuture:
    """Starts saving ``obj`` to the path ``f`` in the background and returns at once.

    The object is pickled before this returns (so pickling errors raise
    here); the tensor bytes are written by a background thread, through the
    same pinned ring as :func:`save`, with no extra copy of the checkpoint in
    host memory. Background saves run one at a time, in call order.

    The tensors in ``obj`` must not be modified until the returned future is
    done: for training, call ``future.result()`` before the next optimizer
    step (the forward and backward passes may run meanwhile).

    Raises:
        UnsupportedObjectError, IsADirectoryError, FileNotFoundError,
        PermissionError, TypeError, ConfigError: at once, as :func:`save`.
    """
    overrides, _ = config.split_overrides("async_save", settings, allow_other=False)
    resolved = config.resolve(overrides)
    if not isinstance(f, (str, os.PathLike)):
        raise TypeError(f"async_save needs a file path, got {type(f).__name__}; use save() for file objects")
    path = os.fspath(f)
    directory = check_target(resolve_target(path))
    plan = plan_save(obj, archive_name_for(path), pickle_module, pickle_protocol)
    path = resolve_target(path)
    # The copies must come after the work queued so far on the caller's streams,
    # which the background thread cannot see: order them here.
    streams = side_streams(plan)
    future = _background().submit(commit_plan, plan, path, directory, resolved, streams)
    return SaveFuture(future, path)

