"""The benchmarks' tests time nothing, so they skip the benchmarks' full garbage collections."""

from __future__ import annotations

import functools

import pytest

from fastpersist import system


@pytest.fixture(autouse=True)
def _no_full_collections(monkeypatch):
    # A benchmark collects before each timed step so that one method's garbage cannot slow the next; in the
    # test process (torch, lightning, hypothesis loaded) one full collection takes 0.1-0.2 s, and a tiny run
    # makes dozens. The heap is still trimmed, and what a test checks does not depend on either.
    monkeypatch.setattr(system, "release_memory", functools.partial(system.release_memory, collect=False))
