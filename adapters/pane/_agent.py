"""Pane actions as kernel runs: one attempt = one run, its record one `attempt` audit event."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio

from kernel import Kernel, Limits, Message, Result, RunContext, RunInfo, Step

from ._engine import ActionContext, Attempt, PaneAction, failure_detail, run_attempt
from ._errors import MultiplexerError
from ._lock import PaneInUse, PaneLock
from ._mux import Multiplexer

#: Seconds the kernel's hard deadline allows beyond the attempt's own timeout
#: (typing takes time too; the engine, not the backstop, should decide the outcome).
BACKSTOP_SLACK = 60.0


class ActionAgent:
    """A kernel agent whose single step runs one attempt of a pane action.

    The step writes the attempt as exactly one audit event (kind "attempt",
    name = the action, duration = elapsed, payload = `Attempt.record()`) and
    ends the run: `success` and `skipped_by_policy` end it `ok` with the
    outcome as output, the other outcomes end it `error`. A critic's nudge
    arriving during the attempt is typed into the pane (`on_steer`), never
    in the middle of the action's own typing.

    Args:
        action: A fresh action object (one per attempt).
        mux: The multiplexer holding the pane.
        target: The pane.
        agent: The agent's name for the record (default: the target).
        timeout, poll_interval, skip_reason: As for `run_attempt`.
        snapshot_chars: Cap on stored snapshot text (None: `KERNEL_PANE_SNAPSHOT_CHARS`).

    Attributes:
        attempt: The attempt's record once the step has run.
    """

    def __init__(self, action: PaneAction, mux: Multiplexer, target: str, *,
                 agent: str | None = None, timeout: float = 30.0, poll_interval: float = 2.0,
                 skip_reason: str | None = None, snapshot_chars: int | None = None) -> None:
        self.action = action
        self.mux = mux
        self.target = target
        self.agent = agent or target
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.skip_reason = skip_reason
        self.snapshot_chars = snapshot_chars
        self.attempt: Attempt | None = None
        self._actx: ActionContext | None = None
        self._typing = trio.Lock()

    def run_info(self, **fields: Any) -> RunInfo:
        """The run's `RunInfo`: named "<action> <target>", with the agent as subject."""
        inputs = {"action": self.action.name, "target": self.target, "timeout": self.timeout,
                  "poll_interval": self.poll_interval, "skip_reason": self.skip_reason}
        return RunInfo(name=f"{self.action.name} {self.target}", subject_id=self.agent,
                       inputs=inputs, **fields)

    def limits(self) -> Limits:
        """One step, and a hard deadline well past the attempt's own timeout."""
        return Limits(max_steps=1, timeout=self.timeout + BACKSTOP_SLACK)

    async def step(self, ctx: RunContext) -> Step:
        """Run the attempt, record it, and end the run with its outcome."""
        self._actx = ActionContext(self.agent, self.target, self.mux, typing_lock=self._typing)
        lock: PaneLock | None = None
        pane_key = getattr(self.mux, "pane_key", None)
        if pane_key is not None and self.skip_reason is None:
            # One run at a time types into a pane (across processes): a pane that
            # another run holds is a precondition failure, and nothing is typed.
            try:
                lock = PaneLock(await pane_key(self.target), self.target)
                lock.acquire({"run_id": ctx.run_id,
                              "what": f"kernel actions run {self.action.name}"})
            except PaneInUse as exc:
                lock = None
                self._actx.in_use = str(exc)
            except MultiplexerError:
                lock = None  # the attempt's own snapshot reports the pane's trouble
        try:
            attempt = await run_attempt(self.action, self._actx, timeout=self.timeout,
                                        poll_interval=self.poll_interval,
                                        skip_reason=self.skip_reason)
        finally:
            if lock is not None:
                lock.release()
        self.attempt = attempt
        ctx.event("attempt", name=attempt.action, duration_ms=attempt.elapsed_s * 1000,
                  payload=attempt.record(self.snapshot_chars))
        outcome = attempt.outcome
        if outcome.ok:
            return Step(output=str(outcome), final=True, name=attempt.action)
        why = failure_detail(attempt)
        return Step(output=str(outcome), final=True, name=attempt.action,
                    error=f"{outcome}: {why}" if why else str(outcome))

    async def on_steer(self, messages: Sequence[Message]) -> None:
        """Type each nudge into the pane, as a person at the keyboard would.

        Each typed nudge is listed under `"steered"` in the attempt's extras.
        """
        for message in messages:
            async with self._typing:
                await self.mux.send_text(self.target, message.content)
            if self._actx is not None:
                self._actx.extras.setdefault("steered", []).append(message.content)


async def run_action(kernel: Kernel, action: PaneAction, mux: Multiplexer, target: str, *,
                     agent: str | None = None, timeout: float = 30.0,
                     poll_interval: float = 2.0, skip_reason: str | None = None,
                     info: RunInfo | None = None) -> tuple[Result, Attempt | None]:
    """Run one attempt of `action` on `target` as a kernel run.

    Returns the run's result and the attempt (None only if the run ended
    before the attempt did: cancelled, killed, or past the backstop).
    """
    runner = ActionAgent(action, mux, target, agent=agent, timeout=timeout,
                         poll_interval=poll_interval, skip_reason=skip_reason)
    result = await kernel.run(runner, info or runner.run_info(), runner.limits())
    return result, runner.attempt

