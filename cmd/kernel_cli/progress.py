"""Live progress for `kernel run` on a terminal: step, elapsed, deadline, critic decisions.

Progress is drawn on stderr, and only when stderr is a TTY, so machine output
(`--json` on stdout) never mixes with it. It learns what happens by wrapping
the Audit port: every event the run records passes through `ProgressAudit`
on its way to the real audit (if any), which keeps the kernel unaware of it.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Mapping
from typing import Any

import trio

from kernel import Audit, RunInfo, RunRecorder, RunStats, Step, ToolResult, takes_resumed


class Progress:
    """What the live display shows, updated by `ProgressRecorder`."""

    def __init__(self, name: str, timeout: float | None) -> None:
        self.name = name
        self.timeout = timeout
        self.started = trio.current_time()
        self.steps = 0
        self.lines = 0
        self.state = "starting"
        self.decisions: deque[str] = deque(maxlen=3)

    def render(self) -> str:
        elapsed = trio.current_time() - self.started
        # Most useful first: the line is cut to the terminal's width.
        parts = [f"step {self.steps}", f"{elapsed:.1f}s"]
        if self.timeout is not None:
            parts.append(f"deadline in {max(0.0, self.timeout - elapsed):.0f}s")
        if self.decisions:
            parts.append("critic: " + ", ".join(self.decisions))
        parts.append(self.state)
        if self.lines:
            parts.append(f"{self.lines} lines")
        parts.append(self.name[:60])
        return " | ".join(parts)


class ProgressRecorder:
    """A recorder that updates `Progress` and forwards everything to the real one."""

    def __init__(self, progress: Progress, inner: RunRecorder | None) -> None:
        self.p = progress
        self.inner = inner

    def on_step(self, iteration: int, step: Step, duration_s: float) -> None:
        self.p.steps = iteration + 1
        if step.name:
            self.p.state = step.name
        if self.inner is not None:
            self.inner.on_step(iteration, step, duration_s)

    def on_tool(self, result: ToolResult, iteration: int) -> None:
        if self.inner is not None:
            self.inner.on_tool(result, iteration)

    def log_event(self, kind: str, *, name: str | None = None,
                  payload: Mapping[str, Any] | None = None, duration_ms: float | None = None,
                  iteration: int | None = None) -> None:
        if kind == "output":
            self.p.lines += 1
        elif kind == "critic" and name != "watch":  # "watch" only records the thresholds
            self.p.decisions.append(name or "?")
        elif kind in ("state_enter", "tool_start", "process_start"):
            self.p.state = f"{kind.replace('_', ' ')} {name or ''}".strip()
        if payload is not None and "lifecycle" in payload:  # a CLI agent's state machine
            self.p.state = f"{payload.get('lifecycle')}/{payload.get('state')}"
        if self.inner is not None:
            self.inner.log_event(kind, name=name, payload=payload, duration_ms=duration_ms,
                                 iteration=iteration)

    def log_error(self, message: str, *, payload: Mapping[str, Any] | None = None) -> None:
        if self.inner is not None:
            self.inner.log_error(message, payload=payload)

    async def close(self, stats: RunStats) -> None:
        self.p.state = str(stats.status)
        if self.inner is not None:
            await self.inner.close(stats)


class ProgressAudit:
    """Wraps an Audit (or none) so the live display sees every event."""

    def __init__(self, inner: Audit | None, progress: Progress) -> None:
        self.inner = inner
        self.progress = progress

    async def start_run(self, info: RunInfo, *,
                        resumed: bool | None = None) -> RunRecorder | None:
        inner: Any = self.inner
        if inner is None:
            rec = None
        elif resumed is not None and takes_resumed(inner):  # kernel.SupportsResumedStart
            rec = await inner.start_run(info, resumed=resumed)
        else:
            rec = await inner.start_run(info)
        return ProgressRecorder(self.progress, rec)


def wanted() -> bool:
    """Progress is shown only when stderr is a terminal (not when it is closed)."""
    return _isatty(sys.stderr)


def _isatty(stream: Any) -> bool:
    try:
        return stream is not None and bool(stream.isatty())
    except (OSError, ValueError):  # closed
        return False


async def show(progress: Progress, *, interval: float = 0.25) -> None:
    """Redraw the progress line on stderr until cancelled; erase it at the end."""
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    console = Console(file=sys.stderr)
    def line() -> Text:
        # One line, cut to the terminal's width: a wrapped line would leave debris.
        return Text(progress.render(), style="dim", no_wrap=True, overflow="ellipsis")

    with Live(line(), console=console, transient=True,
              redirect_stdout=_isatty(sys.stdout), redirect_stderr=True,
              auto_refresh=False) as live:
        while True:
            live.update(line(), refresh=True)
            await trio.sleep(interval)
