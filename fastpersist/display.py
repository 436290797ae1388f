"""Terminal output shared by every command and benchmark: one table formatter, one progress display.

:func:`format_table` lays out rows of strings in aligned columns (what the
benchmarks, the tuner and ``--list-models`` print); :class:`Progress` is the
one progress line on stderr (a redrawn bar on a terminal, a line per phase
otherwise).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO

__all__ = ["Progress", "format_table"]


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "", rule: bool = True) -> str:
    """Aligned columns separated by two spaces, the header first and (with ``rule``) dashes under it.

    Args:
        header: the column titles.
        rows: one sequence of strings per row, as many as ``header``.
        align: one character per column, ``<`` (left) or ``>`` (right); left
            where missing.
        rule: whether a line of dashes separates the header from the rows.

    Returns:
        The table without a trailing newline; trailing spaces are stripped.

    Raises:
        ValueError: a row has another number of cells than the header.
    """
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells, the header {len(header)}")
    widths = [max([len(header[i])] + [len(row[i]) for row in rows]) for i in range(len(header))]
    aligns = [align[i] if i < len(align) else "<" for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(f"{cell:{a}{w}}" for cell, a, w in zip(cells, aligns, widths)).rstrip()

    lines = [line(header)]
    if rule:
        lines.append("  ".join("-" * w for w in widths))
    lines.extend(line(row) for row in rows)
    return "\n".join(lines)


class Progress:
    """A dependency-free progress display on stderr; call it once per step with what the step does.

    On a terminal a bar is redrawn in place (``[####....] 3/8  12 s  text``);
    otherwise a line is written whenever the phase (the text before the first
    ``:``) changes, so logs stay short. ``close()`` clears the bar. Disabled,
    it does nothing.

    Args:
        total: steps expected (an estimate is fine: shown as ``~N`` when
            ``approximate``).
        enabled: False for a silent display.
        approximate: whether ``total`` is only an estimate.
        stream: where to write (stderr by default).
    """

    WIDTH = 120

    def __init__(self, total: int, enabled: bool = True, approximate: bool = False, stream: TextIO | None = None):
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.approximate = approximate
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()
        self._phase = ""

    def __call__(self, text: str) -> None:
        if not self.enabled:
            return
        self.done += 1
        elapsed = time.perf_counter() - self.start
        if self.tty:
            width = 24
            filled = int(width * min(self.done, self.total) / self.total)
            bar = "#" * filled + "." * (width - filled)
            total = f"~{self.total}" if self.approximate else str(self.total)
            line = f"\r[{bar}] {self.done}/{total} {elapsed:5.0f} s  {text}"
            self.stream.write(line[: self.WIDTH].ljust(self.WIDTH))
            self.stream.flush()
        else:
            phase = text.split(":", 1)[0]
            if phase != self._phase:
                self._phase = phase
                self.stream.write(f"[{elapsed:5.0f} s] {phase}\n")
                self.stream.flush()

    def close(self) -> None:
        """Clears the bar (on a terminal); safe to call more than once."""
        if self.enabled and self.tty:
            self.stream.write("\r" + " " * self.WIDTH + "\r")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
