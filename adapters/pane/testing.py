"""A hand-written fake `Multiplexer` whose panes hold scripted agents living in trio time.

For tests of pane actions (ours and hosts'), under a virtual clock::

    mux = FakeMultiplexer({"dev": FakePane(reply_after=3)})
    attempt = await run_attempt(NonceProbe(), ActionContext("dev", "dev", mux), timeout=10)
    assert attempt.outcome is Outcome.SUCCESS and len(mux.sends) == 1

A pane is computed lazily from `trio.current_time()` when it is captured,
so a reply "arrives" `reply_after` seconds after the request without any
background task. This is a fake, not a mock: it implements the port.
"""

from __future__ import annotations

import re
from collections.abc import Container
from dataclasses import dataclass, field

import trio

from ._errors import MultiplexerError
from ._mux import TargetState, TargetStatus

__all__ = ["FakeMultiplexer", "FakePane", "SentText"]

_REPEAT = re.compile(r"^Repeat (\S+)\s*$")


@dataclass
class FakePane:
    """A scripted coding agent in a pane.

    Args:
        mode: "alive" answers; "busy" shows a busy marker and answers nothing;
            "silent" shows nothing and answers nothing; "dead" has exited
            (capture still works, typing fails).
        reply_after: Seconds until "Repeat X" is answered with a line "X".
        context_pct: The context use shown on the status line (None: no status line).
        compact_to: The context use after "/compact".
        compact_after: Seconds "/compact" takes.
        banner: Lines shown above everything else (pad a pane to test caps).
    """

    mode: str = "alive"
    reply_after: float = 1.0
    context_pct: float | None = 80.0
    compact_to: float = 10.0
    compact_after: float = 2.0
    banner: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode not in ("alive", "busy", "silent", "dead"):
            raise ValueError(f"FakePane mode must be alive|busy|silent|dead, got {self.mode!r}")
        self._lines: list[tuple[float, str]] = []
        self._typed = ""
        self._compacted_at: float | None = None

    def receive(self, text: str, submit: bool, now: float) -> None:
        """Take typed text, as the pane's program would see it."""
        self._typed += text
        if not submit:
            return
        line, self._typed = self._typed, ""
        self._lines.append((now, f"> {line}"))
        if self.mode != "alive":
            return
        m = _REPEAT.match(line)
        if m:
            self._lines.append((now + self.reply_after, m.group(1)))
        elif line.strip() == "/compact":
            self._compacted_at = now + self.compact_after
            self._lines.append((now + self.compact_after, "Compacted."))

    def pct(self, now: float) -> float | None:
        """The context use shown at time `now`."""
        if self._compacted_at is not None and now >= self._compacted_at:
            return self.compact_to
        return self.context_pct

    def render(self, now: float) -> str:
        """The pane's text at time `now`."""
        lines = list(self.banner)
        lines += [text for at, text in self._lines if at <= now]
        if self.mode == "dead":
            lines.append("Pane is dead (status 0)")
            return "\n".join(lines)
        if self.mode == "busy":
            lines.append("✻ Working… (esc to interrupt)")
        pct = self.pct(now)
        if pct is not None:
            lines.append(f"context: {pct:g}%")
        lines.append(f"> {self._typed}")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class SentText:
    """One `send_text` call the fake received."""

    target: str
    text: str
    submit: bool
    at: float


class FakeMultiplexer:
    """A `Multiplexer` over in-memory `FakePane`s, with failures on request.

    Args:
        panes: Target name -> pane. A target not in here is UNKNOWN.
        type_seconds: How long each `send_text` takes (trio time).
        capture_error: Raise this from every `capture`.
        fail_captures: Raise a `MultiplexerError` from these `capture` calls
            (0-based call indices, counted over all targets).
        send_error: Raise this from every `send_text` (after recording the call).

    Attributes:
        sends: Every `send_text` call, in order (including ones that raised).
        captures: How many `capture` calls were made.
    """

    name = "fake"

    def __init__(self, panes: dict[str, FakePane] | None = None, *,
                 type_seconds: float = 0.0, capture_error: Exception | None = None,
                 fail_captures: Container[int] = (), send_error: Exception | None = None
                 ) -> None:
        self.panes = dict(panes or {})
        self.type_seconds = type_seconds
        self.capture_error = capture_error
        self.fail_captures = fail_captures
        self.send_error = send_error
        self.sends: list[SentText] = []
        self.captures = 0

    def _pane(self, target: str) -> FakePane:
        pane = self.panes.get(target)
        if pane is None:
            raise MultiplexerError(f"fake capture-pane failed: can't find pane: {target}")
        return pane

    async def capture(self, target: str) -> str:
        """Render the pane as of now."""
        await trio.lowlevel.checkpoint()
        index, self.captures = self.captures, self.captures + 1
        if self.capture_error is not None:
            raise self.capture_error
        if index in self.fail_captures:
            raise MultiplexerError(f"fake capture-pane failed on call {index}")
        return self._pane(target).render(trio.current_time())

    async def send_text(self, target: str, text: str, *, submit: bool = True) -> None:
        """Record the call, take `type_seconds`, and hand the text to the pane."""
        self.sends.append(SentText(target, text, submit, trio.current_time()))
        if self.send_error is not None:
            raise self.send_error
        pane = self._pane(target)
        if pane.mode == "dead":
            raise MultiplexerError(f"fake send-keys failed: pane {target} is dead")
        await trio.sleep(self.type_seconds)
        pane.receive(" ".join(text.splitlines()), submit, trio.current_time())

    async def target_status(self, target: str) -> TargetStatus:
        """UNKNOWN for a target not in `panes`, DEAD for a dead pane, else ALIVE."""
        await trio.lowlevel.checkpoint()
        pane = self.panes.get(target)
        if pane is None:
            return TargetStatus(TargetState.UNKNOWN, f"can't find pane: {target}")
        if pane.mode == "dead":
            return TargetStatus(TargetState.DEAD, "the pane's program exited (status 0)")
        return TargetStatus(TargetState.ALIVE)
