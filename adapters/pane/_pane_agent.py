"""`PaneAgent`: an agent living in a terminal pane, given one task as one kernel step.

`kernel run --agent pane --target dev:0 --prompt "..."` types the prompt into
the pane, then watches the screen: every change is activity for the critic,
and the turn is over once the pane has stopped changing for `settle`
seconds with no busy marker ("esc to interrupt", "Thinking…", "Working…")
in its tail. The text that appeared after the prompt is the run's output.

A screen that settles on a tool approval dialog (Claude Code's "Do you want to
proceed? 1. Yes ...") is not an answer: the agent waits for a person. The
wait is audited (`pane_approval`), the critic is told the agent is alive,
and after `approval_ttl` seconds the run ends `killed` (`awaiting_approval`).

A pane that never answers is the critic's business: with no change on the
screen there is no activity, so the idle timeout nudges it (the nudge is
typed into the pane) and then kills the run `stalled`. A pane whose program
exits mid-turn ends the run `error`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from kernel import Message, RunContext, Step

from ._errors import MultiplexerError
from ._liveness import is_approval_prompt, is_busy
from ._mux import Multiplexer


@dataclass
class PaneAgent:
    """Type `prompt` into the pane `target` and wait for the agent there to finish.

    Args:
        target: The tmux target (session, session:window, session:window.pane).
        prompt: The task to type.
        mux: The multiplexer that reaches the pane.
        settle: Seconds the pane must stay unchanged, and not busy, to count as done.
        poll_interval: How often the pane is read.
        max_output_chars: The output keeps at most this many characters (the tail).
        approval_ttl: Seconds the pane may wait on an approval dialog before the
            run is ended `killed` with reason `awaiting_approval`.
    """

    target: str
    prompt: str
    mux: Multiplexer
    settle: float = 2.0
    poll_interval: float = 0.25
    max_output_chars: int = 20_000
    approval_ttl: float = 600.0
    _lock: trio.Lock = field(default_factory=trio.Lock, init=False, repr=False)
    _ctx: RunContext | None = field(default=None, init=False, repr=False)
    _nudges: int = field(default=0, init=False, repr=False)
    _pid: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt.strip():
            raise ValueError("PaneAgent needs a prompt to type")
        if self.settle <= 0 or self.poll_interval <= 0:
            raise ValueError("settle and poll_interval must be > 0")

    async def simulate(self, ctx: RunContext) -> str:
        """A dry run reports what would be typed where."""
        return f"would type into pane {self.target}: {self.prompt}"

    async def step(self, ctx: RunContext) -> Step:
        """One turn: wait for a free pane, type the prompt, wait until the pane settles."""
        self._ctx = ctx
        self._pid = None
        try:
            return await self._turn(ctx)
        except MultiplexerError as exc:
            return Step(final=True, name="pane", error=f"pane {self.target}: {exc}")
        finally:
            if self._pid is not None:
                ctx.process_exited(self._pid)

    async def _turn(self, ctx: RunContext) -> Step:
        status = await self.mux.target_status(self.target)
        if not status.alive:
            return Step(final=True, name="pane",
                        error=f"pane {self.target} is {status.state}: {status.detail}")
        if status.pid is not None:
            # The processes under the pane are the agent's: a pane program that is
            # working (CPU, I/O) is not stalled however still its screen is.
            self._pid = status.pid
            ctx.process_started(status.pid)
        screen = await self.mux.capture(self.target)
        while is_busy(screen):  # someone else's turn is still running: wait for it
            ctx.activity("pane_busy")
            await trio.sleep(self.poll_interval)
            screen = await self.mux.capture(self.target)
        async with self._lock:
            await self.mux.send_text(self.target, self.prompt)
        ctx.event("pane_send", name=self.target, payload={"prompt": self.prompt[:2000]})
        sent = await self.mux.capture(self.target)
        last, changed_at, answered = sent, trio.current_time(), False
        waiting_since: float | None = None
        nudges = self._nudges
        while True:
            await trio.sleep(self.poll_interval)
            if not (await self.mux.target_status(self.target)).alive:
                return Step(final=True, name="pane", output=_after(last, self.prompt),
                            error=f"the program in pane {self.target} exited mid-turn")
            screen = await self.mux.capture(self.target)
            now = trio.current_time()
            if self._nudges != nudges:
                # We typed a nudge: what it changed on the screen is ours, not an answer.
                nudges, sent, last = self._nudges, screen, screen
                continue
            if screen != last:
                # Each line the screen did not show before goes to the critic, which
                # counts only what it has not seen recently: a spinner or a clock
                # redrawn in place is not progress, new text is.
                before = set(last.splitlines())
                for line in screen.splitlines():
                    if line.strip() and line not in before:
                        ctx.activity("pane_output", line)
                last, changed_at, waiting_since = screen, now, None
                answered = answered or screen != sent
                continue
            if answered and not is_busy(screen) and now - changed_at >= self.settle:
                if not is_approval_prompt(screen):
                    break
                if waiting_since is None:
                    waiting_since = changed_at
                    ctx.event("pane_approval", name=self.target, payload={
                        "state": "waiting_for_approval",
                        "screen": "\n".join(screen.rstrip().splitlines()[-16:])})
                waited = now - waiting_since
                if waited >= self.approval_ttl:
                    return Step(final=True, name="pane", kill="awaiting_approval",
                                output=_after(screen, self.prompt)[-self.max_output_chars:],
                                error=f"pane {self.target} waited {waited:.1f}s on an approval "
                                      f"dialog (approval TTL {self.approval_ttl:g}s): killed")
                ctx.activity("waiting_for_approval")
        output = _after(last, self.prompt)[-self.max_output_chars:]
        ctx.event("pane_done", name=self.target, payload={"chars": len(output)})
        return Step(output=output, final=True, name="pane",
                    payload={"target": self.target})

    async def on_steer(self, messages: list[Message]) -> None:
        """Type critic nudges into the pane (never in the middle of the prompt's typing)."""
        async with self._lock:
            for m in messages:
                await self.mux.send_text(self.target, m.content)
            self._nudges += 1
        if self._ctx is not None:
            self._ctx.event("pane_steer", name=self.target, activity=False,
                            payload={"messages": [m.content for m in messages]})


def _after(screen: str, prompt: str) -> str:
    """The pane's text after the last line showing the prompt (the answer), trimmed."""
    lines = screen.rstrip().splitlines()
    key = prompt.strip().splitlines()[-1][:60] if prompt.strip() else ""
    for i in range(len(lines) - 1, -1, -1):
        if key and key in lines[i]:
            return "\n".join(lines[i + 1:]).strip()
    return "\n".join(lines).strip()
