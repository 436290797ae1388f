"""``workers.detached``: work on a thread of its own that ends with it, or inline once threads cannot start."""

from __future__ import annotations

import threading

import pytest

from fastpersist.io import workers


def test_detached_work_runs_on_its_own_thread_and_delivers_its_result_and_errors():
    ran = []
    future = workers.detached("fastpersist-test", lambda x: ran.append(threading.current_thread().name) or x * 2, 21)
    assert future.result(10) == 42
    assert ran and ran[0].startswith("fastpersist-test") and ran[0] != threading.current_thread().name

    def fails():
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        workers.detached("fastpersist-test", fails).result(10)


def test_detached_work_runs_inline_during_interpreter_shutdown(monkeypatch):
    monkeypatch.setattr(workers, "threads_allowed", lambda: False)
    ran = []
    future = workers.detached("fastpersist-test", lambda: ran.append(threading.current_thread().name))
    assert future.done() and ran == [threading.current_thread().name]
