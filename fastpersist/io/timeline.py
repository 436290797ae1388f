"""Timestamps of a save's phases, recorded only while a benchmark asks for them.

    with timeline.recording() as events:
        fastpersist.save(state, path)
    # events: [(perf_counter seconds, thread name, label), ...] in the order they happened

The save path calls :func:`mark` at its phase boundaries (pickled, queued,
first window filled, last read queued, written, fsynced, renamed, done).
Outside :func:`recording` a mark is one global read; inside, one list append
(atomic under the GIL), so several threads may mark at once. Benchmarks use
it to say where the time of a save goes (``python -m fastpersist.bench
training``); nothing in the library reads it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

__all__ = ["mark", "recording"]

_events: list[tuple[float, str, str]] | None = None


def mark(label: str) -> None:
    """Records ``label`` with the time and the thread, when a :func:`recording` is active."""
    events = _events
    if events is not None:
        events.append((time.perf_counter(), threading.current_thread().name, label))


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[float, str, str]]]:
    """Records every mark made (by any thread) until the block ends; yields the list they go into.

    Recordings do not nest: an inner one takes the marks until it ends, then the outer one resumes.
    """
    global _events
    events: list[tuple[float, str, str]] = []
    previous, _events = _events, events
    try:
        yield events
    finally:
        _events = previous
