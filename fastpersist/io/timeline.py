"""Timestamps of a save's phases, recorded only while a benchmark asks for them.

    with timeline.recording() as events:
        fastpersist.save(state, path)
    # events: [(perf_counter seconds, thread name, label), ...] in the order they happened

The save path calls :func:`mark` at its phase boundaries (pickled, queued,
first window filled, last read queued, written, fsynced, renamed, done).
The load path times what its calling thread waits for with :class:`waiting`
(reads, CRC-32s, device copies), which :func:`waits` adds up.
Outside :func:`recording` a mark is one global read; inside, one list append
(atomic under the GIL), so several threads may mark at once. Benchmarks use
it to say where the time of a save or a load goes (``python -m fastpersist.bench
training``, ``shapes``); nothing in the library reads it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

__all__ = ["mark", "recording", "waiting", "waits"]

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


class waiting:  # lower case: used like a function, ``with timeline.waiting("read"):``
    """Times the block as a wait for ``label`` when a :func:`recording` is active.

    Adds two events when the block ends: ``("wait <label>")`` at its start and
    ``("waited <label>")`` at its end, on the calling thread.
    """

    __slots__ = ("label", "start")

    def __init__(self, label: str) -> None:
        self.label = label
        self.start = None

    def __enter__(self) -> None:
        if _events is not None:
            self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        events = _events
        if events is not None and self.start is not None:
            thread = threading.current_thread().name
            events.append((self.start, thread, "wait " + self.label))
            events.append((time.perf_counter(), thread, "waited " + self.label))


def waits(events: list[tuple[float, str, str]], thread: str) -> dict[str, float]:
    """Seconds ``thread`` spent in each :class:`waiting` label, summed over the recording."""
    totals: dict[str, float] = {}
    started: dict[str, float] = {}
    for when, name, label in events:
        if name != thread:
            continue
        if label.startswith("wait "):
            started[label[5:]] = when
        elif label.startswith("waited ") and label[7:] in started:
            key = label[7:]
            totals[key] = totals.get(key, 0.0) + when - started.pop(key)
    return totals
