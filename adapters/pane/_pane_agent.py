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

One kernel run at a time types into a pane (`PaneLock`, across processes): a
run that finds the pane taken by another ends `error` at once, naming it.

A pane that never answers is the critic's business: with no change on the
screen there is no activity, so the idle timeout nudges it (the nudge is
typed into the pane) and then kills the run `stalled`. A pane whose program
exits mid-turn ends the run `error`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import trio

from kernel import Message, RunContext, Step

from ._errors import MultiplexerError, PaneLockError
from ._liveness import is_approval_prompt, is_busy, pane_tail
from ._lock import PaneInUse, PaneLock
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
    _nudging: bool = field(default=False, init=False, repr=False)
    _pane_lock: PaneLock | None = field(default=None, init=False, repr=False)
    _typed: list[str] = field(default_factory=list, init=False, repr=False)
    _pane: str = field(default="", init=False, repr=False)

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
        self._pane = self.target
        self._typed = [" ".join(self.prompt.split())]
        try:
            return await self._turn(ctx)
        except MultiplexerError as exc:
            return Step(final=True, name="pane", error=f"pane {self.target}: {exc}")
        except PaneInUse as exc:
            return Step(final=True, name="pane", error=str(exc))
        except PaneLockError as exc:
            return Step(final=True, name="pane", error=f"pane {self.target}: {exc}")
        finally:
            if self._pane_lock is not None:
                self._pane_lock.release()
                self._pane_lock = None
            if self._pid is not None:
                ctx.process_exited(self._pid)

    async def _turn(self, ctx: RunContext) -> Step:
        status = await self.mux.target_status(self.target)
        if not status.alive:
            return Step(final=True, name="pane",
                        error=f"pane {self.target} is {status.state}: {status.detail}")
        await self._take_pane(ctx.run_id)
        if status.pid is not None:
            # The processes under the pane are the agent's: a pane program that is
            # working (CPU, I/O) is not stalled however still its screen is.
            self._pid = status.pid
            ctx.process_started(status.pid)
        screen = await self.mux.capture(self._pane)
        shown = ""
        while is_busy(screen):  # someone else's turn is still running: wait for it
            # The busy screen's new lines go to the critic: a timer or a token count
            # that moves is progress, a busy marker that stays as it is is not (a
            # pane stuck busy is then judged stalled like a silent one).
            seen = set(shown.splitlines())
            for line in pane_tail(screen).splitlines():
                if line not in seen:
                    ctx.activity("pane_busy", line)
            shown = screen
            await trio.sleep(self.poll_interval)
            screen = await self.mux.capture(self._pane)
        untyped = screen  # the screen before the prompt was typed
        async with self._lock:
            await self.mux.send_text(self._pane, self.prompt)
        ctx.event("pane_send", name=self.target, payload={"prompt": self.prompt[:2000]})
        sent = await self.mux.capture(self._pane)
        # A program that answers at once (a REPL, a quick tool) has its answer on the
        # very screen the wait starts from: it counts (it was never seen as one, and
        # the run was killed `waiting_input` though the answer was there).
        answered = self._answer_in(sent, untyped)
        last, changed_at = sent, trio.current_time()
        waiting_since: float | None = None
        nudges = self._nudges
        while True:
            await trio.sleep(self.poll_interval)
            if not (await self.mux.target_status(self._pane)).alive:
                return Step(final=True, name="pane", output=_after(last, self.prompt, untyped)[0],
                            error=f"the program in pane {self.target} exited mid-turn")
            screen = await self.mux.capture(self._pane)
            now = trio.current_time()
            if self._nudging or self._nudges != nudges:
                # A nudge is being typed, or was since the last look: what it changes
                # on the screen is ours, not an answer (the baseline moves).
                nudges, sent, last = self._nudges, screen, screen
                continue
            if screen != last:
                # Each line the screen did not show before goes to the critic, which
                # counts only what it has not seen recently: a spinner or a clock
                # redrawn in place is not progress, new text is. Our own typing
                # echoed back (the prompt, a nudge, a bare input prompt) is neither
                # progress nor an answer.
                before = set(last.splitlines())
                for line in screen.splitlines():
                    if line.strip() and line not in before and not self._ours(line):
                        ctx.activity("pane_output", line)
                answered = answered or self._answer_in(screen, sent)
                last, changed_at, waiting_since = screen, now, None
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
                                output=_after(screen, self.prompt,
                                              untyped)[0][-self.max_output_chars:],
                                error=f"pane {self.target} waited {waited:.1f}s on an approval "
                                      f"dialog (approval TTL {self.approval_ttl:g}s): killed")
                ctx.activity("waiting_for_approval")
        output, delimited = _after(last, self.prompt, untyped)
        output = output[-self.max_output_chars:]
        done: dict[str, object] = {"chars": len(output), "delimited": delimited}
        if not delimited:
            done["note"] = ("the typed prompt was not found on the screen: the output is "
                            "every line that was not there before it was typed")
        ctx.event("pane_done", name=self.target, payload=done)
        return Step(output=output, final=True, name="pane",
                    payload={"target": self.target, "delimited": delimited})

    async def _take_pane(self, run_id: str) -> None:
        """Pin the pane down to its id and take its lock, for the whole turn.

        `dev` is whichever pane is active in `dev` at each tmux command: looked
        up for every key, a person switching panes mid-typing got the rest of
        the prompt in the other pane. One run at a time types into a pane
        (across processes): a taken pane fails the run at once (`PaneInUse`).
        """
        resolve = getattr(self.mux, "resolve", None)
        self._pane = self.target if resolve is None else await resolve(self.target)
        pane_key = getattr(self.mux, "pane_key", None)
        if pane_key is not None:
            lock = PaneLock(await pane_key(self._pane), self.target)
            lock.acquire({"run_id": run_id, "what": "kernel run --agent pane"})
            self._pane_lock = lock

    def _ours(self, line: str) -> bool:
        """True if `line` shows only what we typed (the prompt or a nudge, whole or in
        part, with the program's prompt glyphs around it) or no text at all."""
        core = _strip_glyphs(line)
        if not core:
            return True
        for typed in self._typed:
            if typed.startswith(core):
                return True
            if typed in core and not _strip_glyphs(core.replace(typed, " ")):
                return True
        return False

    def _answer_in(self, screen: str, baseline: str) -> bool:
        """True if `screen` has a line of text the baseline did not, and not ours."""
        before = set(baseline.splitlines())
        return any(line not in before and not self._ours(line)
                   for line in screen.splitlines())

    async def on_steer(self, messages: list[Message]) -> None:
        """Type critic nudges into the pane (never in the middle of the prompt's typing).

        Only while this run holds the pane (`PaneLock`): a nudge arriving before
        the run took the pane, or after it let go, is audited as undeliverable.
        """
        if self._pane_lock is None and getattr(self.mux, "pane_key", None) is not None:
            if self._ctx is not None:
                self._ctx.event("steer_undeliverable", name=self.target,  # critic: undelivered
                                payload={"messages": [m.content for m in messages],
                                         "why": "this run does not hold the pane"})
            return
        async with self._lock:
            # Marked before the first key: the screen changes as each key lands, and
            # none of it is the agent's answer.
            self._nudging = True
            self._nudges += 1
            try:
                for m in messages:
                    self._typed.append(" ".join(m.content.split()))
                    await self.mux.send_text(self._pane, m.content)
            finally:
                self._nudges += 1
                self._nudging = False
        if self._ctx is not None:
            self._ctx.event("pane_steer", name=self.target, activity=False,
                            payload={"messages": [m.content for m in messages]})


def _after(screen: str, prompt: str, before: str) -> tuple[str, bool]:
    """The pane's text after the last line echoing the prompt (the answer), trimmed,
    and whether that line was found.

    The echo is a line holding the whole prompt with nothing but prompt marks or
    box borders around it; failing that (a TUI that wraps or decorates it), the
    last line ending the way the prompt ends. Without either, the answer cannot
    be told from the screen's history: the lines the screen did not show before
    the prompt was typed are returned, and False says so.
    """
    lines = screen.rstrip().splitlines()
    typed = " ".join(prompt.split())
    for i in range(len(lines) - 1, -1, -1):
        core = _strip_glyphs(lines[i])
        if core and typed in core and not _strip_glyphs(core.replace(typed, " ")):
            return "\n".join(lines[i + 1:]).strip(), True
    tail = _strip_glyphs(typed[-60:])
    for i in range(len(lines) - 1, -1, -1):
        core = _strip_glyphs(lines[i])
        if core and len(core) >= min(len(tail), 12) and (core.endswith(tail)
                                                          or tail.endswith(core)):
            return "\n".join(lines[i + 1:]).strip(), True
    seen = set(before.splitlines())
    return "\n".join(line for line in lines if line not in seen).strip(), False


_GLYPHS = re.compile(r"^[\W_]+|[\W_]+$")


def _strip_glyphs(line: str) -> str:
    """`line` without the non-word characters around it (prompt marks, box borders)."""
    return _GLYPHS.sub("", " ".join(line.split()))
