"""Reading a pane: nonce echoes, busy markers, the context percentage. Pure functions.

This is the observer half of the pane adapter: everything here takes
captured pane text and returns a judgement, with no side effects, so the
actions (the actor half) and any scheduler can share it.
"""

from __future__ import annotations

import enum
import re
import secrets

#: Phrases a coding-agent TUI shows near the bottom while it is working.
BUSY_MARKERS: tuple[str, ...] = ("esc to interrupt", "Thinking…", "Working…")
#: How many non-blank lines at the bottom of the pane count as its tail.
TAIL_LINES = 10

_NONCE_ALPHABET = "abcdefghijkmnpqrstuvwxyz23456789"  # no 0/o, 1/l: easy to read back


class ProbeState(enum.StrEnum):
    """What a liveness probe concluded about the agent in a pane."""

    ALIVE = "alive"    # it echoed the nonce: it reads and answers
    BUSY = "busy"      # no echo, but it shows a busy marker: working on something else
    SILENT = "silent"  # no echo and no sign of work


def generate_nonce(length: int = 10) -> str:
    """Return a fresh random token that will not occur in a pane by chance."""
    if length < 6:
        raise ValueError(f"a nonce needs at least 6 characters, got {length}")
    return "".join(secrets.choice(_NONCE_ALPHABET) for _ in range(length))


def has_nonce_echo(text: str, nonce: str) -> bool:
    """True if the pane shows `nonce` other than in a copy of the request "Repeat <nonce>".

    The typed request is one occurrence; a program that merely prints its input
    back (`cat`, a REPL quoting the line under a syntax error) makes another
    copy of the request, which is not an answer. Only the nonce on its own
    counts, so an answer still counts after the request has scrolled away.
    """
    if not nonce:
        return False
    requests = len(re.findall(r"repeat\s+" + re.escape(nonce), text, re.IGNORECASE))
    return text.count(nonce) > requests


def pane_tail(text: str, lines: int = TAIL_LINES) -> str:
    """The last `lines` non-blank lines of the pane."""
    kept = [line for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def _fold(text: str) -> str:
    return text.replace("...", "…").casefold()


#: Claude Code's tool approval dialog: a question, then numbered choices starting at Yes.
_APPROVAL = re.compile(
    r"Do you want to [^\n?]{1,200}\?\s*\n(?:[^\n]*\n){0,3}?\s*(?:\u276f\s*)?1\.\s*Yes",
    re.IGNORECASE)


def is_approval_prompt(text: str, lines: int = 16) -> bool:
    """True if the pane's tail shows a tool approval dialog waiting for a person.

    Recognises Claude Code's dialog as recorded from the real TUI (2.1.330): "Do
    you want to proceed?" followed by numbered choices, "1. Yes" first. While it
    shows, the agent is not done and not stalled: it waits for approval.
    """
    return bool(_APPROVAL.search(pane_tail(text, lines).replace("\xa0", " ")))


def is_busy(text: str, lines: int = TAIL_LINES) -> bool:
    """True if a busy marker shows in the pane's tail (case-insensitive; `...` counts as `…`).

    Only the tail counts: a marker that scrolled up belongs to finished work.
    """
    tail = _fold(pane_tail(text, lines))
    return any(_fold(marker) in tail for marker in BUSY_MARKERS)


def classify_probe(text: str, nonce: str | None) -> ProbeState:
    """Classify a pane after a probe: echoed -> ALIVE, else busy marker -> BUSY, else SILENT."""
    if nonce and has_nonce_echo(text, nonce):
        return ProbeState.ALIVE
    if is_busy(text):
        return ProbeState.BUSY
    return ProbeState.SILENT


_NUM = r"(?P<num>\d{1,3}(?:\.\d+)?)\s*%"
# "context: 80%", "Context window 80%", "ctx 80%", "Context left until auto-compact: 12%"
_WORD_FIRST = re.compile(r"\b(?:context|ctx)\b(?P<mid>[^%\n]{0,40}?)" + _NUM, re.IGNORECASE)
# "80% context", "80% of context used", "12% context left"
_NUM_FIRST = re.compile(_NUM + r"(?P<mid>[^\n%]{0,12}?)\b(?:context|ctx)\b(?P<post>[^\n%]{0,16})",
                        re.IGNORECASE)
_LEFT = re.compile(r"\b(?:left|remaining|free|available)\b", re.IGNORECASE)


def read_context_pct(text: str) -> float | None:
    """Return the context window percentage *used*, from the lowest mention in the pane.

    Understands "context: 80%", "80% context used" and the like; a
    percentage said to be *left* ("Context left until auto-compact: 12%",
    "12% context left") is turned into the share used (88). Returns None
    when the pane shows no such figure.
    """
    best: tuple[int, float] | None = None
    for pattern in (_WORD_FIRST, _NUM_FIRST):
        for m in pattern.finditer(text):
            value = float(m.group("num"))
            if value > 100:
                continue
            around = m.group("mid") + (m.groupdict().get("post") or "")
            if _LEFT.search(around):
                value = 100.0 - value
            if best is None or m.start() > best[0]:
                best = (m.start(), value)
    return None if best is None else best[1]
