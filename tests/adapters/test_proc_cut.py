"""Text cut at its front starts at a token boundary: no secret's end without its start."""

from __future__ import annotations

from adapters._proc import Tail, from_boundary, last_chars


def test_a_cut_token_is_dropped_up_to_the_next_boundary() -> None:
    """The end of a token whose start was cut off goes; a short text is kept whole."""
    text = "ghp_TokenWhoseStartIsCut0123456789\nwarning: next"
    assert last_chars(text, 40) == "\nwarning: next"
    assert last_chars(text, 1000) == text
    assert from_boundary('Body==", "next": 1') == '", "next": 1'


def test_a_long_blob_without_boundaries_is_kept() -> None:
    """One long line of data (no boundary in the first 2 KiB) keeps its tail: not a token."""
    blob = "x" * 5000
    assert last_chars(blob, 3000) == "x" * 3000


def test_the_tail_trims_the_oldest_line_to_a_boundary() -> None:
    """A stream's tail whose oldest line is trimmed drops that line's partial token."""
    tail = Tail(40)
    tail.add("token=ghp_AbCdEfGhIjKlMnOpQrSt0123 and more words")
    tail.add("last line")
    assert tail.text() == " and more words\nlast line"
    assert tail.truncated and tail.size == len(tail.text()) + 1
