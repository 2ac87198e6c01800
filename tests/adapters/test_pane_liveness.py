"""Reading panes: nonces, echo detection, busy markers, probe classification, context use."""

from __future__ import annotations

import pytest

from adapters.pane import (
    BUSY_MARKERS,
    ProbeState,
    classify_probe,
    generate_nonce,
    has_nonce_echo,
    is_busy,
    pane_tail,
    read_context_pct,
)


class TestNonce:
    def test_fresh_and_plain(self) -> None:
        """Nonces are 10 lowercase letters/digits by default and do not repeat."""
        nonces = {generate_nonce() for _ in range(500)}
        assert len(nonces) == 500
        assert all(len(n) == 10 and n.isalnum() and n == n.lower() for n in nonces)

    def test_length(self) -> None:
        """A nonce can be longer, but not too short to be unique in a pane."""
        assert len(generate_nonce(16)) == 16
        with pytest.raises(ValueError, match="at least 6"):
            generate_nonce(4)


class TestEcho:
    def test_the_request_alone_is_not_an_echo(self) -> None:
        """One occurrence (the typed "Repeat <nonce>") is not an echo."""
        assert not has_nonce_echo("> Repeat k7q2mzx9ab\n", "k7q2mzx9ab")

    def test_a_second_occurrence_is(self) -> None:
        """The agent printing the nonce back makes two occurrences: an echo."""
        assert has_nonce_echo("> Repeat k7q2mzx9ab\n● k7q2mzx9ab\n", "k7q2mzx9ab")

    def test_other_nonces_do_not_count(self) -> None:
        """Echoes of an older probe's nonce say nothing about this one."""
        text = "> Repeat aaaaaaaaaa\naaaaaaaaaa\n> Repeat bbbbbbbbbb\n"
        assert has_nonce_echo(text, "aaaaaaaaaa") and not has_nonce_echo(text, "bbbbbbbbbb")
        assert not has_nonce_echo(text + text, "")


class TestBusy:
    @pytest.mark.parametrize("marker", [*BUSY_MARKERS, "THINKING...", "✻ Working... (42s)"])
    def test_markers_in_the_tail(self, marker: str) -> None:
        """Each busy marker (any case, `...` for `…`) near the bottom means busy."""
        assert is_busy(f"> do the thing\n{marker}\n\n> \n")

    def test_marker_above_the_tail_is_old(self) -> None:
        """A marker that scrolled above the tail belongs to finished work."""
        text = "Working… (esc to interrupt)\n" + "\n".join(f"line {i}" for i in range(12))
        assert not is_busy(text)
        assert is_busy(text, lines=13)

    def test_tail_skips_blank_lines(self) -> None:
        """The tail is counted in non-blank lines (a TUI pads the bottom of the pane)."""
        assert pane_tail("a\n\nb\n   \nc\n\n\n", 2) == "b\nc"

    def test_idle_pane(self) -> None:
        """A prompt and ordinary output are not busy."""
        assert not is_busy("I thought about it.\nDone working.\n> ")


class TestClassify:
    def test_alive(self) -> None:
        """An echoed nonce is alive, even with a busy marker showing."""
        assert classify_probe("> Repeat abcdefgh\nabcdefgh\nWorking…", "abcdefgh") \
            is ProbeState.ALIVE

    def test_busy(self) -> None:
        """No echo but a busy marker: busy."""
        assert classify_probe("> Repeat abcdefgh\nThinking…", "abcdefgh") is ProbeState.BUSY

    def test_silent(self) -> None:
        """No echo and no busy marker: silent; without a nonce only busy/silent are possible."""
        assert classify_probe("> Repeat abcdefgh\n> ", "abcdefgh") is ProbeState.SILENT
        assert classify_probe("abcdefgh abcdefgh", None) is ProbeState.SILENT


class TestContextPct:
    @pytest.mark.parametrize(("text", "pct"), [
        ("context: 80%", 80),
        ("Context window 42.5% used", 42.5),
        ("ctx 7%", 7),
        ("[model] 63% context", 63),
        ("63% of context used", 63),
        ("Context left until auto-compact: 12%", 88),
        ("12% context left", 88),
        ("25% context remaining", 75),
    ])
    def test_phrasings(self, text: str, pct: float) -> None:
        """Used and left phrasings are read as the share of the context used."""
        assert read_context_pct(f"some output\n{text}\n> ") == pct

    def test_lowest_mention_wins(self) -> None:
        """The status line at the bottom is the current figure; older ones above are history."""
        assert read_context_pct("context: 80%\n> /compact\nCompacted.\ncontext: 12%\n") == 12

    def test_absent(self) -> None:
        """No context figure (or an impossible one) reads as None."""
        assert read_context_pct("100% done\nprogress 45%\n> ") is None
        assert read_context_pct("context: 250%") is None
