"""The pane-action base class and the engine that runs one attempt of an action.

An action says *what* to do in four small methods; the engine owns the
shared loop every action has — look, decide, type once, watch for the
result, classify — so timeouts, error handling and the attempt record are
the same for all of them::

    before = await action.snapshot(ctx)         raises      -> send_error
    skip_reason given                                       -> skipped_by_policy
    another run holds the pane (ctx.in_use)                 -> precondition_fail
    action.precheck(before) is false (or raises)            -> precondition_fail
    await action.before_send(ctx); await action.send(ctx)
                                                raises      -> send_error (no polling)
    every poll_interval until the deadline (timeout after the start):
        now = await action.snapshot(ctx)
        action.is_complete(before, now)                     -> success
        the pane is gone or its program exited              -> completion_timeout
                                                               (extras: pane_gone)
    deadline passed                                         -> completion_timeout

`send` is called at most once per attempt: there are no retries inside an
attempt, so a scheduler above can count attempts honestly. Time is
`trio.current_time()`, so tests drive the polling with a virtual clock.
"""

from __future__ import annotations

import enum
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar

import trio

from kernel import ConfigError

from ._mux import Multiplexer

#: Characters of each snapshot text kept in the attempt record (the tail), by default.
DEFAULT_SNAPSHOT_CHARS = 4000
SNAPSHOT_CHARS_ENV = "KERNEL_PANE_SNAPSHOT_CHARS"


class Outcome(enum.StrEnum):
    """How one attempt ended. Exactly one per attempt."""

    SUCCESS = "success"
    PRECONDITION_FAIL = "precondition_fail"
    SEND_ERROR = "send_error"
    COMPLETION_TIMEOUT = "completion_timeout"
    SKIPPED_BY_POLICY = "skipped_by_policy"

    @property
    def ok(self) -> bool:
        """True for the outcomes that are not failures (success, skipped_by_policy)."""
        return self in (Outcome.SUCCESS, Outcome.SKIPPED_BY_POLICY)


class ActionContext:
    """What an action may touch during one attempt: its pane, and a place for extras.

    Attributes:
        agent: The agent's name (what the attempt log groups by).
        target: The pane, in the multiplexer's syntax.
        mux: The multiplexer holding the pane.
        extras: Action-specific facts for the attempt record (a nonce, the
            figures compared); the engine adds errors and the skip reason here.
    """

    def __init__(self, agent: str, target: str, mux: Multiplexer, *,
                 typing_lock: trio.Lock | None = None) -> None:
        self.agent = agent
        self.target = target
        self.mux = mux
        self.extras: dict[str, Any] = {}
        #: Why the pane may not be acted on (another run holds it), or None.
        self.in_use: str | None = None
        #: How far the engine got (snapshot, precheck, send, poll, done), the first
        #: snapshot and the start: what a cancelled attempt's record is made of.
        self.stage = "start"
        self.before: dict[str, Any] | None = None
        self.started_at: str | None = None
        self.t0: float | None = None
        self._typing = typing_lock if typing_lock is not None else trio.Lock()

    async def capture(self) -> str:
        """The pane's current text."""
        return await self.mux.capture(self.target)

    async def type(self, text: str, *, submit: bool = True) -> None:
        """Type `text` into the pane (then Enter), never interleaved with a critic's nudge."""
        async with self._typing:
            await self.mux.send_text(self.target, text, submit=submit)


class PaneAction(ABC):
    """One thing to do to a pane, described by four methods the engine calls.

    A subclass sets `name` and implements `snapshot`, `precheck`, `send` and
    `is_complete`; `before_send` and `describe` are optional hooks. An
    action object serves one attempt (it may keep per-attempt state, such as
    a nonce, on `self`). Side effects go through `ctx` only.
    """

    name: ClassVar[str] = "unnamed"

    @abstractmethod
    async def snapshot(self, ctx: ActionContext) -> dict[str, Any]:
        """Observe the pane: a JSON-ready dict, stored in the attempt record.

        Called once before acting and once per poll afterwards. Conventionally
        the pane text is under `"text"` (the record caps long strings).
        """

    @abstractmethod
    def precheck(self, before: dict[str, Any]) -> bool:
        """Return True if the pane, as observed, is safe to act on (not busy, not in a dialog)."""

    @abstractmethod
    async def send(self, ctx: ActionContext) -> None:
        """Act: type into the pane through `ctx.type`. Raising ends the attempt `send_error`."""

    @abstractmethod
    def is_complete(self, before: dict[str, Any], now: dict[str, Any]) -> bool:
        """Compare the snapshot before sending with a later one: True once the action is done."""

    async def before_send(self, ctx: ActionContext) -> None:
        """Prepare just before `send` (mint a nonce...). Raising counts as a send error."""
        await trio.lowlevel.checkpoint()

    def describe(self, before: dict[str, Any] | None,
                 after: dict[str, Any] | None) -> dict[str, Any]:
        """Action-specific extras for the record, given the first and last snapshots."""
        return {}


@dataclass(frozen=True, slots=True)
class Attempt:
    """The record of one attempt, as written to the audit (`attempts` view).

    Attributes:
        agent, action: Who was acted on, and the action's name.
        outcome: One `Outcome`.
        elapsed_s: Seconds from the start of the attempt to its outcome.
        started_at: Wall-clock start, ISO-8601 in UTC.
        pane_before: The first snapshot (None if it could not be taken).
        pane_after: The last snapshot taken while polling (None if no polling happened).
        extras: Action facts, errors, the skip reason, the target.
    """

    agent: str
    action: str
    outcome: Outcome
    elapsed_s: float
    started_at: str
    pane_before: dict[str, Any] | None
    pane_after: dict[str, Any] | None
    extras: dict[str, Any] = field(default_factory=dict)

    def record(self, max_chars: int | None = None) -> dict[str, Any]:
        """The audit payload: every field, with snapshot texts cut to their last `max_chars`.

        `max_chars=None` reads `KERNEL_PANE_SNAPSHOT_CHARS` (default 4000). A
        snapshot that was cut carries `"truncated": true`.
        """
        cap = snapshot_chars() if max_chars is None else max_chars
        return {
            "agent": self.agent,
            "action": self.action,
            "outcome": str(self.outcome),
            "elapsed_s": round(self.elapsed_s, 6),
            "started_at": self.started_at,
            "pane_before": cap_snapshot(self.pane_before, cap),
            "pane_after": cap_snapshot(self.pane_after, cap),
            "extras": dict(self.extras),
        }

    def summary(self) -> str:
        """One line for people: outcome, action, agent, time, and why if it failed."""
        line = f"{self.outcome}: {self.action} on {self.agent} after {self.elapsed_s:.2f}s"
        why = failure_detail(self)
        return f"{line} ({why})" if why else line


def failure_detail(attempt: Attempt) -> str:
    """Why an attempt failed or was skipped, in a few words ("" when there is nothing to say).

    An error or the skip reason when there is one; otherwise the action's own
    facts (`probe=busy`, `context_pct_before=12.0`...).
    """
    for key in ("send_error", "snapshot_error", "precheck_error", "skip_reason"):
        value = attempt.extras.get(key)
        if value:
            return str(value)
    if attempt.extras.get("pane_gone"):
        return f"the pane went away: {attempt.extras['pane_gone']}"
    if attempt.outcome is Outcome.SUCCESS:
        return ""
    facts = {k: v for k, v in attempt.extras.items()
             if k not in ("target", "polls", "nonce") and v is not None}
    return ", ".join(f"{k}={v}" for k, v in facts.items())


def snapshot_chars(env: Mapping[str, str] | None = None) -> int:
    """The snapshot cap from `KERNEL_PANE_SNAPSHOT_CHARS` (default 4000).

    Raises:
        ConfigError: The variable is not a positive integer.
    """
    raw = (os.environ if env is None else env).get(SNAPSHOT_CHARS_ENV, "").strip()
    if not raw:
        return DEFAULT_SNAPSHOT_CHARS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"{SNAPSHOT_CHARS_ENV} must be a positive whole number of "
                          f"characters, got {raw!r}")
    return value


def cap_snapshot(snapshot: Mapping[str, Any] | None, max_chars: int) -> dict[str, Any] | None:
    """Copy `snapshot`, keeping only the last `max_chars` of each string; mark it if cut."""
    if snapshot is None:
        return None
    out: dict[str, Any] = {}
    cut = False
    for key, value in snapshot.items():
        if isinstance(value, str) and len(value) > max_chars:
            value = value[-max_chars:]
            cut = True
        out[key] = value
    if cut:
        out["truncated"] = True
    return out


def _describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def cancelled_record(action: PaneAction, ctx: ActionContext,
                     max_chars: int | None = None) -> dict[str, Any]:
    """What a cancelled attempt leaves: how far it got, its first snapshot and extras.

    A cancelled attempt has no outcome (none of the five fits), but keys may
    already be in the pane: this record (the `attempt_cancelled` event) keeps
    what was typed (the nonce...) so the audit does not lose it.
    """
    cap = snapshot_chars() if max_chars is None else max_chars
    elapsed = None if ctx.t0 is None else round(trio.current_time() - ctx.t0, 6)
    extras = dict(ctx.extras)
    extras.setdefault("target", ctx.target)
    return {"agent": ctx.agent, "action": action.name, "stage": ctx.stage,
            "elapsed_s": elapsed, "started_at": ctx.started_at,
            "pane_before": cap_snapshot(ctx.before, cap), "extras": extras}


async def _pane_gone(ctx: ActionContext) -> str | None:
    """Why the pane can no longer complete anything (gone, or its program exited), or None.

    Asked after each poll that did not see completion: without it, a closed
    pane was polled until the timeout (an hour, for a long compaction).
    """
    status_of = getattr(ctx.mux, "target_status", None)
    if status_of is None:
        return None
    try:
        status = await status_of(ctx.target)
    except Exception:  # the multiplexer is busy or gone: judge at the next poll
        return None
    return None if status.alive else f"{status.state}: {status.detail}"


async def run_attempt(action: PaneAction, ctx: ActionContext, *, timeout: float = 30.0,
                      poll_interval: float = 2.0, skip_reason: str | None = None) -> Attempt:
    """Run one attempt of `action` on `ctx`'s pane and classify it (see the module docstring).

    Never raises for a failure of the pane or the action: every such failure
    is an outcome. Cancellation propagates (no record is returned then).

    Args:
        action: A fresh action object.
        ctx: The pane and the extras of this attempt.
        timeout: Seconds from the start of the attempt until `completion_timeout`.
        poll_interval: Seconds between snapshots while waiting for completion.
        skip_reason: If given, record `skipped_by_policy` with it and do nothing else.

    Raises:
        ConfigError: `timeout` is negative or `poll_interval` is not positive.
    """
    if not (timeout >= 0 and math.isfinite(timeout)):
        raise ConfigError(f"timeout must be a number of seconds >= 0, got {timeout}")
    if not (poll_interval > 0 and math.isfinite(poll_interval)):
        raise ConfigError(f"poll_interval must be a number of seconds > 0, got {poll_interval}")
    started_at = ctx.started_at = datetime.now(UTC).isoformat()
    t0 = ctx.t0 = trio.current_time()

    def finish(outcome: Outcome, before: dict[str, Any] | None,
               after: dict[str, Any] | None) -> Attempt:
        try:
            ctx.extras.update(action.describe(before, after))
        except Exception as exc:
            ctx.extras["describe_error"] = _describe_error(exc)
        ctx.extras.setdefault("target", ctx.target)
        ctx.stage = "done"
        return Attempt(ctx.agent, action.name, outcome, trio.current_time() - t0, started_at,
                       before, after, dict(ctx.extras))

    ctx.stage = "snapshot"
    try:
        before = ctx.before = await action.snapshot(ctx)
    except Exception as exc:
        # Without the state before, acting would be blind: treat it as a failed send.
        ctx.extras["snapshot_error"] = _describe_error(exc)
        return finish(Outcome.SEND_ERROR, None, None)

    if skip_reason is not None:
        ctx.extras["skip_reason"] = skip_reason
        return finish(Outcome.SKIPPED_BY_POLICY, before, None)

    if ctx.in_use is not None:
        ctx.extras["precheck_error"] = ctx.in_use
        return finish(Outcome.PRECONDITION_FAIL, before, None)

    ctx.stage = "precheck"
    try:
        allowed = action.precheck(before)
    except Exception as exc:
        ctx.extras["precheck_error"] = _describe_error(exc)
        allowed = False
    if not allowed:
        return finish(Outcome.PRECONDITION_FAIL, before, None)

    ctx.stage = "send"
    try:
        await action.before_send(ctx)
        await action.send(ctx)
    except Exception as exc:
        ctx.extras["send_error"] = _describe_error(exc)
        return finish(Outcome.SEND_ERROR, before, None)

    ctx.stage = "poll"
    deadline = t0 + timeout
    after: dict[str, Any] | None = None
    polls = 0
    while True:
        polls += 1
        try:
            now_snap = await action.snapshot(ctx)
        except Exception as exc:
            # A pane can be briefly unreadable (a resize, a busy server): poll on.
            ctx.extras["poll_errors"] = ctx.extras.get("poll_errors", 0) + 1
            ctx.extras["last_poll_error"] = _describe_error(exc)
        else:
            after = now_snap
            try:
                done = action.is_complete(before, now_snap)
            except Exception as exc:
                ctx.extras["is_complete_error"] = _describe_error(exc)
                done = False
            if done:
                ctx.extras["polls"] = polls
                return finish(Outcome.SUCCESS, before, after)
        gone = await _pane_gone(ctx)
        if gone is not None:
            # Nothing will complete in a pane that is gone: stop waiting for it.
            ctx.extras["polls"] = polls
            ctx.extras["pane_gone"] = gone
            return finish(Outcome.COMPLETION_TIMEOUT, before, after)
        now = trio.current_time()
        if now >= deadline:
            ctx.extras["polls"] = polls
            return finish(Outcome.COMPLETION_TIMEOUT, before, after)
        await trio.sleep(min(poll_interval, deadline - now))
