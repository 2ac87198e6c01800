"""Live progress for `kernel batch` on a terminal: counts by status, rate, ETA, oldest running,
results being delivered.

Drawn on stderr and only when stderr is a TTY (like `kernel run`'s), so
`--json` lines on stdout never mix with it. It reads the runner's own state
(`BatchRunner.outcomes`, `BatchRunner.running`) at each redraw: nothing is
added to the path of a run.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import trio

from .output import visible
from .progress import wanted as wanted


class BatchProgress:
    """What the batch's live line shows."""

    def __init__(self, runner: Any, total: int, delivery: Any = None) -> None:
        self.runner = runner
        self.total = total
        #: The batch's `BatchDelivery` (--deliver-dir, --webhook), if it delivers.
        self.delivery = delivery
        self.started = trio.current_time()
        self.first_start: float | None = None

    def on_start(self, _task: Any) -> None:
        """`BatchRunner.run`'s `on_start`: the rate counts from the first run's start."""
        if self.first_start is None:
            self.first_start = trio.current_time()

    def render(self) -> str:
        now = trio.current_time()
        outcomes = self.runner.outcomes
        counts = Counter(o.status for o in outcomes)
        ran = [o for o in outcomes if not o.skipped]
        done = len(outcomes)
        parts = [f"{done}/{self.total} done"]
        parts += [f"{n} {s}" for s, n in counts.most_common()]
        parts.append(f"{len(self.runner.running)} running")
        if self.delivery is not None and self.delivery.pending:
            parts.append(f"{self.delivery.pending} delivering")
        if self.delivery is not None and self.delivery.failed:
            parts.append(f"{self.delivery.failed} undelivered")
        since = self.first_start if self.first_start is not None else self.started
        elapsed = max(now - since, 1e-9)
        if ran:
            rate = len(ran) / elapsed
            left = self.total - done
            parts.append(f"{rate:.1f}/s")
            parts.append(f"ETA {left / rate:.0f}s" if rate > 0 else "ETA ?")
        if self.runner.running:
            task, t = min(self.runner.running.values(), key=lambda v: v[1])
            info = task.spec.get("info") if isinstance(task.spec, dict) else None
            name = (info.get("name") if isinstance(info, dict) else None) or task.task_id
            parts.append(f"oldest {_shown(task.task_id, 40)} {now - t:.0f}s {_shown(name, 40)}")
        return " | ".join(parts)


def _shown(value: Any, width: int) -> str:
    """A task's id or name as the line may show it: one line, no terminal controls.

    Both come from the tasks file: an escape sequence in them would reach the
    terminal as a command (rich keeps ESC), and a newline would break the
    one-line display into debris. Each control character is shown escaped
    (`\\x1b`), Unicode line and paragraph separators and bidirectional
    overrides too, then the text is cut to `width` characters.
    """
    text = visible(str(value), layout=False)
    return text if len(text) <= width else text[:width - 1] + "…"


async def show(progress: BatchProgress, *, interval: float = 0.25) -> None:
    """Redraw the progress line on stderr until cancelled; erase it at the end."""
    import sys

    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    console = Console(file=sys.stderr)

    def line() -> Text:
        return Text(progress.render(), style="dim", no_wrap=True, overflow="ellipsis")

    with Live(line(), console=console, transient=True, redirect_stdout=False,
              redirect_stderr=True, auto_refresh=False) as live:
        while True:
            live.update(line(), refresh=True)
            await trio.sleep(interval)
