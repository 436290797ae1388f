"""Benchmark timestamps: marks and waits, recorded only inside a recording, from any thread."""

from __future__ import annotations

import threading
import types

import pytest

from fastpersist.io import timeline


def test_nothing_is_recorded_outside_a_recording():
    timeline.mark("alone")
    with timeline.waiting("read"):
        pass
    with timeline.recording() as events:
        pass
    assert events == []


def test_waits_add_up_per_label_and_thread(monkeypatch):
    # a clock the test advances: exact sums, whatever the machine's load does to real sleeps
    now = [0.0]
    monkeypatch.setattr(timeline, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    def sleep(seconds):
        now[0] += seconds

    me = threading.current_thread().name
    with timeline.recording() as events:
        timeline.mark("start")
        for _ in range(3):
            with timeline.waiting("read"):
                sleep(0.01)
        with timeline.waiting("crc"):
            sleep(0.02)

        def other():
            with timeline.waiting("read"):
                sleep(0.05)

        worker = threading.Thread(target=other, name="other-thread")
        worker.start()
        worker.join()
    waits = timeline.waits(events, me)
    assert set(waits) == {"read", "crc"}
    assert waits["read"] == pytest.approx(0.03)  # its own three waits, not the other thread's
    assert waits["crc"] == pytest.approx(0.02)
    assert timeline.waits(events, "other-thread")["read"] == pytest.approx(0.05)
    assert [label for _, _, label in events][0] == "start"


def test_a_wait_that_raises_is_still_counted():
    me = threading.current_thread().name
    with timeline.recording() as events:
        try:
            with timeline.waiting("read"):
                raise OSError("failed read")
        except OSError:
            pass
    assert "read" in timeline.waits(events, me)
