"""The one table formatter and the one progress display of the CLI and the benchmarks."""

from __future__ import annotations

import io

import pytest

from fastpersist import display


def test_columns_align_as_asked():
    text = display.format_table(("name", "GB/s"), [("torch.save", "1.50"), ("fp", "12.25")], "<>")
    assert text.splitlines() == [
        "name         GB/s",
        "----------  -----",
        "torch.save   1.50",
        "fp          12.25",
    ]


def test_without_rule_and_trailing_spaces_are_stripped():
    text = display.format_table(("a", "b"), [("x", "")], rule=False)
    assert text.splitlines() == ["a  b", "x"]


def test_rows_must_match_the_header():
    with pytest.raises(ValueError, match="2 cells"):
        display.format_table(("a",), [("x", "y")])


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_redraws_one_line_and_clears_it():
    out = _Terminal()
    with display.Progress(4, stream=out) as progress:
        progress("round 1/2: save a")
        progress("round 1/2: save b")
    text = out.getvalue()
    assert "\n" not in text
    assert "[######" in text and "2/4" in text and "save b" in text
    assert text.endswith("\r" + " " * display.Progress.WIDTH + "\r")


def test_progress_in_a_log_writes_a_line_per_phase():
    out = io.StringIO()
    progress = display.Progress(4, stream=out)
    for text in ("round 1/2: save a", "round 1/2: load a", "round 2/2: save a"):
        progress(text)
    progress.close()
    lines = out.getvalue().splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == ["round 1/2", "round 2/2"]


def test_disabled_progress_writes_nothing():
    out = _Terminal()
    progress = display.Progress(2, enabled=False, stream=out)
    progress("x")
    progress.close()
    assert out.getvalue() == ""
