"""Save and load methods compared in one run: the pieces the s3, safetensors and shapes benchmarks share."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fastpersist.bench import measure
from fastpersist.bench.harness import Rounds
from fastpersist.tuning import workloads


def run_rounds(
    rounds: Rounds, saves: Iterable[str], loads: Iterable[str], save: Callable[[str, int], Any], load: Callable
) -> Rounds:
    """Runs ``rounds`` over ``("save", name)`` of ``saves`` (``save(name, round)`` gives a sample), then
    ``("load", name)`` of ``loads``; returns it."""
    phases = [[("save", name) for name in saves], [("load", name) for name in loads]]
    return rounds.run(phases, lambda method, index: (save if method[0] == "save" else load)(method[1], index))


def check(
    expected: tuple[dict[str, Any], dict[str, Any]], loaded: Any, problems: list[str], what: str, device: Any = None
) -> bool | str:
    """True when ``loaded`` is the flattened ``expected`` byte for byte, else what differs (also appended to
    ``problems`` as ``what: difference``)."""
    problem = measure.verify_state(expected, workloads.flatten_state(loaded), device)
    if problem is not None:
        problems.append(f"{what}: {problem}")
    return True if problem is None else problem


def ratios(pairs: Iterable[tuple[str, str, str]], value: Callable[[str, str], float | None]) -> dict[str, float]:
    """``"op: ours / baseline"`` -> the ratio of their ``value(op, name)`` (3 decimals) where both are known."""
    out = {}
    for op, ours, baseline in pairs:
        mine, theirs = value(op, ours), value(op, baseline)
        if mine is not None and theirs is not None:
            out[f"{op}: {ours} / {baseline}"] = round(mine / theirs, 3)
    return out
