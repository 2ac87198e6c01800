"""Pane actions as kernel runs: one attempt = one run, its record one `attempt` audit event."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio

from kernel import Kernel, Limits, Message, Result, RunContext, RunInfo, Step

from ._engine import (
    ActionContext,
    Attempt,
    PaneAction,
    cancelled_record,
    failure_detail,
    run_attempt,
)
from ._errors import MultiplexerError, PaneLockError
from ._lock import PaneInUse, PaneLock
from ._mux import Multiplexer


def _cancelled(exc: BaseException) -> bool:
    """`exc` is a cancellation: trio's Cancelled, or a group of nothing else."""
    if isinstance(exc, trio.Cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(trio.Cancelled)[1] is None
    return False


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
        self._pane = target  # the pane's id once resolved (see `_hold_pane`)
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
        """Run the attempt, record it, and end the run with its outcome.

        A cancelled attempt (Ctrl-C, the backstop, a critic kill) has no outcome,
        but it may have typed already: it is recorded as an `attempt_cancelled`
        event (how far it got, its first snapshot, the extras) before the
        cancellation goes on.
        """
        pane, lock, why_not = await self._hold_pane(ctx.run_id)
        self._pane = pane
        self._actx = ActionContext(self.agent, pane, self.mux, typing_lock=self._typing)
        self._actx.extras["target"] = self.target
        if pane != self.target:
            self._actx.extras["pane_id"] = pane
        self._actx.in_use = why_not
        try:
            attempt = await run_attempt(self.action, self._actx, timeout=self.timeout,
                                        poll_interval=self.poll_interval,
                                        skip_reason=self.skip_reason)
        except BaseException as exc:
            # A cancel can arrive as a group of Cancelled (from a nursery inside the
            # attempt): it is still the attempt being cancelled, and is recorded so.
            if _cancelled(exc):
                ctx.event("attempt_cancelled", name=self.action.name, activity=False,
                          payload=cancelled_record(self.action, self._actx,
                                                   self.snapshot_chars))
            raise
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

    async def _hold_pane(self, run_id: str) -> tuple[str, PaneLock | None, str | None]:
        """The pane to act on, its lock, and why it may not be acted on (or None).

        The target is resolved once to the pane's id (`%7`) where the
        multiplexer can: `dev` is whichever pane is active in `dev` at each
        command, and the keys of one attempt must all land in one pane. One run
        at a time types into a pane (across processes): a pane another run
        holds, or whose lock cannot be taken safely, is a precondition failure,
        and nothing is typed. A skipped attempt types nothing and takes no lock.
        """
        if self.skip_reason is not None:
            return self.target, None, None
        resolve = getattr(self.mux, "resolve", None)
        pane_key = getattr(self.mux, "pane_key", None)
        try:
            pane = self.target if resolve is None else await resolve(self.target)
        except MultiplexerError as exc:
            # A pane that is gone fails the attempt's first snapshot (send_error); one
            # that is there but cannot be pinned down is not typed into.
            return self.target, None, f"cannot resolve pane {self.target}: {exc}"
        if pane_key is None:
            return pane, None, None
        try:
            lock = PaneLock(await pane_key(pane), self.target)
            lock.acquire({"run_id": run_id, "what": f"kernel actions run {self.action.name}"})
        except (PaneInUse, PaneLockError) as exc:
            return pane, None, str(exc)
        except MultiplexerError as exc:
            return pane, None, f"cannot take the lock of pane {self.target}: {exc}"
        return pane, lock, None

    async def on_steer(self, messages: Sequence[Message]) -> None:
        """Type each nudge into the pane, as a person at the keyboard would.

        Each typed nudge is listed under `"steered"` in the attempt's extras.
        """
        for message in messages:
            async with self._typing:
                await self.mux.send_text(self._pane, message.content)
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

