"""``workers.detached`` and ``workers.in_background``: work off the caller's thread, or inline once threads cannot
start."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
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


def _drained() -> None:
    done = threading.Event()
    workers.in_background(done.set)
    assert done.wait(10)


def test_background_work_runs_off_the_callers_thread_in_submission_order():
    ran, gate = [], threading.Event()
    workers.in_background(gate.wait, 10)  # holds the thread: the caller must not wait for it
    for k in range(5):
        workers.in_background(lambda k=k: ran.append((k, threading.current_thread().name)))
    assert ran == []
    gate.set()
    _drained()
    assert [k for k, _ in ran] == [0, 1, 2, 3, 4]
    assert {name for _, name in ran} == {ran[0][1]} and ran[0][1].startswith("fastpersist-background")


def test_background_work_runs_inline_during_shutdown_or_when_no_thread_starts(monkeypatch):
    ran = []
    monkeypatch.setattr(workers, "threads_allowed", lambda: False)
    workers.in_background(lambda: ran.append(threading.current_thread().name))
    assert ran == [threading.current_thread().name]

    class NoThreads:
        def submit(self, *args):
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(workers, "threads_allowed", lambda: True)
    monkeypatch.setattr(workers, "_background", NoThreads())
    workers.in_background(lambda: ran.append(threading.current_thread().name))
    assert ran == [threading.current_thread().name] * 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_a_background_thread_of_its_own():
    _drained()  # the parent's thread exists
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its work must run, although the parent's thread is not here
        try:
            done = threading.Event()
            workers.in_background(done.set)
            os.write(write, b"1" if done.wait(10) else b"0")
        finally:
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 1) == b"1"
    finally:
        os.close(read)
        os.waitpid(pid, 0)


def test_background_work_from_several_threads_at_once_all_runs_on_the_one_thread():
    ran, names = [], set()
    lock = threading.Lock()

    def task(k):
        with lock:
            ran.append(k)
            names.add(threading.current_thread().name)

    def submitter(base):
        for k in range(50):
            workers.in_background(task, base + k)

    threads = [threading.Thread(target=submitter, args=(100 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _drained()
    assert sorted(ran) == sorted(100 * t + k for t in range(4) for k in range(50))
    assert len(names) == 1 and next(iter(names)).startswith("fastpersist-background")


def test_background_work_queued_at_interpreter_exit_is_done_before_the_process_ends(tmp_path):
    marker = tmp_path / "done"
    script = textwrap.dedent(
        f"""
        import atexit, time
        from fastpersist.io import workers
        def slow():
            time.sleep(0.5)
            open({str(marker)!r}, "w").close()
        workers.in_background(slow)  # still running when the main thread ends
        atexit.register(lambda: workers.in_background(lambda: None))  # inside atexit: inline, no error
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    assert marker.exists()
