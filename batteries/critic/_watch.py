"""`WatchCritic` and its per-run `WatchHandle`: the mechanism around a `Judge`.

There is no background task. The kernel's watch task already wakes every
`Limits.poll_interval` and exactly at the current deadline, and the run
task calls in after every step and before every tool call; the handle
judges lazily inside those calls, with `trio.current_time()` as its clock.
That keeps the critic deterministic under `autojump_clock` and means a
stopped run leaves nothing behind.

Concurrency: the run task and the kernel's watch task interleave calls on
the trio thread, never in parallel, and no method awaits, so each call sees
and leaves a consistent state without a lock. A guard keeps a judge (or an
event sink) that calls back into the handle from judging recursively.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import trio

from kernel import ConfigError, EventSink, Message, RunInfo, Step, ToolCall

from ._judge import Intervention, Judge, RulesJudge, RunView, Trigger, Verdict, Window, call_key
from ._policy import CriticPolicy

# How many verdicts one look may apply (a `continue` then an `extend` is
# two); a judge that keeps answering is cut off here rather than flooding
# the audit.
_MAX_VERDICTS_PER_LOOK = 4

# Adapter events about delivering a nudge (`steer_undeliverable`, ...) reach
# `record_activity` like any event; counting them would let a hung command
# "recover" by reporting that it could not be nudged.
_ECHO_PREFIX = "steer"


class WatchCritic:
    """The default Critic: watches each run, extends healthy ones, nudges and kills stuck ones.

    Hand it to the kernel as `Ports(critic=WatchCritic())`. Every decision
    is an audit event of kind `critic`, named by the decision (`extend`,
    `expire`, `steer`, `continue`, `kill`), with its reason and evidence in
    the payload; a `watch` event at the start records the thresholds.

    Args:
        policy: The thresholds (`CriticPolicy()` defaults if None). Its
            `soft_timeout` applies to runs whose `Limits.soft_timeout` is None.
        judge: Who decides; `RulesJudge(policy)` if None.
        history: How many recent tool calls are kept for loop detection.
    """

    def __init__(self, policy: CriticPolicy | None = None, *, judge: Judge | None = None,
                 history: int = 64) -> None:
        self.policy = policy if policy is not None else CriticPolicy()
        self.judge: Judge = judge if judge is not None else RulesJudge(self.policy)
        if history < 2:
            raise ConfigError(f"WatchCritic history must be >= 2, got {history}")
        self.history = history

    def monitor(self, info: RunInfo, soft_timeout: float | None, *, backstop: float | None,
                max_steps: int | None, events: EventSink) -> WatchHandle:
        """Start watching one run; `soft_timeout` None means the policy's."""
        soft = soft_timeout if soft_timeout is not None else self.policy.soft_timeout
        handle = WatchHandle(self.judge, info, soft_timeout=soft, backstop=backstop,
                             max_steps=max_steps, events=events, history=self.history)
        events("critic", name="watch", payload={
            "judge": type(self.judge).__name__,
            "policy": self.policy.as_dict(),
            "soft_timeout": soft,
            "deadline_s": handle._rel(handle._deadline),
            "backstop_s": handle._rel(backstop),
            "max_steps": max_steps,
        })
        return handle


class _Open:
    """The mutable twin of `Intervention`, kept by the handle."""

    __slots__ = ("activity_since", "at", "calls_after_delivery", "delivered", "evidence",
                 "reason")

    def __init__(self, reason: str, at: float, evidence: dict[str, Any]) -> None:
        self.reason = reason
        self.at = at
        self.evidence = evidence
        self.delivered = False
        self.activity_since = 0
        self.calls_after_delivery = 0


class WatchHandle:
    """The critic's link to one run (a `kernel.CriticHandle`).

    Feeds the evidence to the judge and applies its verdicts: moves the
    deadline (never past the backstop), raises the step ceiling, queues
    nudges, remembers a kill. Built by `WatchCritic.monitor`.
    """

    def __init__(self, judge: Judge, info: RunInfo, *, soft_timeout: float | None,
                 backstop: float | None, max_steps: int | None, events: EventSink,
                 history: int = 64) -> None:
        now = trio.current_time()
        self._judge = judge
        self._info = info
        self._events = events
        self._start = now
        self._soft = soft_timeout
        self._backstop = backstop
        self._base_max_steps = max_steps
        deadline = None if soft_timeout is None else now + soft_timeout
        if deadline is not None and backstop is not None:
            deadline = min(deadline, backstop)
        self._deadline = deadline
        self._expired = False
        self._extensions = 0
        self._bonus = 0
        self._steps = self._tool_calls = self._activity = 0
        self._last_activity = now
        self._window_start = now
        self._window = [0, 0, 0]  # steps, tool calls, other activity
        self._calls: deque[str] = deque(maxlen=history)
        self._queue: list[Message] = []
        self._open: _Open | None = None
        self._nudges: dict[str, int] = {}
        self._kill: str | None = None
        self._stopped = False
        self._judging = False
        # Skipping looks that cannot decide anything: the evidence's version, and
        # until when (trio time) the judge said it stays quiet without new evidence.
        self._version = 0
        self._quiet_version = -1
        self._quiet_until = -math.inf

    # ------------------------------------------------------- the run task

    def record_step(self, iteration: int, step: Step) -> None:
        """A step finished: fresh activity; the judge looks."""
        if self._stopped:
            return
        self._steps += 1
        self._window[0] += 1
        self._touch()
        self._look("step")

    def record_tool_start(self, call: ToolCall) -> None:
        """A tool call is starting: fresh activity and loop evidence; the judge looks."""
        if self._stopped:
            return
        self._tool_calls += 1
        self._window[1] += 1
        self._calls.append(call_key(call))
        if self._open is not None and self._open.delivered:
            self._open.calls_after_delivery += 1
        self._touch()
        self._look("tool_start")

    def record_activity(self, kind: str, text: str | None = None) -> None:
        """Something happened inside a long step: the activity clock restarts.

        Except for kinds starting with "steer" (an adapter reporting what it
        did with a nudge, such as `steer_undeliverable`): the critic's own
        echo is not a sign of life. No judgment here: this is the hot path
        (every output line); the next poll sees it.
        """
        if self._stopped or kind.startswith(_ECHO_PREFIX):
            return
        self._activity += 1
        self._window[2] += 1
        self._touch()

    # ------------------------------------------------------ either task

    def steer(self) -> list[Message]:
        """Drain the queued nudges; draining marks the open intervention delivered."""
        self._look("poll")
        if not self._queue:
            return []
        msgs, self._queue = self._queue, []
        self._version += 1
        if self._open is not None:
            self._open.delivered = True
        return msgs

    def deadline(self) -> float | None:
        """The current deadline (trio time), after judging whatever is due."""
        self._look("poll")
        return self._deadline

    def max_steps(self) -> int | None:
        """The base step ceiling plus every extension's bonus; None if there is no ceiling."""
        self._look("poll")
        if self._base_max_steps is None:
            return None
        return self._base_max_steps + self._bonus

    def kill_cause(self) -> str | None:
        """The kill reason once the judge has killed the run.

        No judging here: the kernel asks after every record (the hot path);
        the judge looks in the `record_*` calls and when the watch task asks
        for the deadline.
        """
        return self._kill

    def stop(self) -> None:
        """The run is over: no more judgments or events."""
        self._stopped = True
        self._queue = []
        self._open = None

    # ---------------------------------------------------------- internals

    def _touch(self) -> None:
        self._version += 1
        self._last_activity = trio.current_time()
        if self._open is not None:
            self._open.activity_since += 1

    def _rel(self, t: float | None) -> float | None:
        """A trio time as seconds since the run started (None stays None)."""
        return None if t is None else round(t - self._start, 3)

    def _look(self, trigger: Trigger) -> None:
        if self._stopped or self._kill is not None or self._judging:
            return
        now = trio.current_time()
        if (trigger == "poll" and self._version == self._quiet_version
                and now < self._quiet_until):
            return  # nothing new, and the judge said nothing is due before then
        self._judging = True
        try:
            for _ in range(_MAX_VERDICTS_PER_LOOK):
                view = self._view(trigger, now)
                verdict = self._judge.judge(view)
                if verdict is None:
                    self._note_quiet(view)
                    break
                self._apply(verdict, now)
                self._version += 1
                if self._kill is not None:
                    break
        finally:
            self._judging = False

    def _note_quiet(self, view: RunView) -> None:
        """Remember until when a look with no new evidence would find nothing to do."""
        quiet_until = getattr(self._judge, "quiet_until", None)
        if quiet_until is None:
            return
        rel = quiet_until(view)
        if rel is None:
            return
        # A hair early rather than late: a skipped look must never miss a deadline.
        self._quiet_version = self._version
        self._quiet_until = self._start + rel - 1e-6

    def _view(self, trigger: Trigger, now: float) -> RunView:
        dl, bs = self._deadline, self._backstop
        due = (dl is not None and not self._expired and now >= dl
               and (bs is None or dl < bs))
        op = self._open
        return RunView(
            info=self._info, trigger=trigger, elapsed=now - self._start,
            steps=self._steps, tool_calls=self._tool_calls, activity=self._activity,
            idle=now - self._last_activity, soft_timeout=self._soft,
            deadline=None if dl is None else dl - self._start,
            backstop=None if bs is None else bs - self._start, due=due,
            extensions=self._extensions,
            max_steps=(None if self._base_max_steps is None
                       else self._base_max_steps + self._bonus),
            window=Window(self._window_start - self._start, now - self._window_start,
                          *self._window),
            calls=tuple(self._calls),
            intervention=None if op is None else Intervention(
                op.reason, op.at - self._start, op.delivered, op.activity_since,
                op.calls_after_delivery, dict(op.evidence)),
            nudges=dict(self._nudges),
        )

    def _apply(self, verdict: Verdict, now: float) -> None:
        who = type(self._judge).__name__
        if not isinstance(verdict, Verdict):
            raise TypeError(f"Judge {who} returned {type(verdict).__name__}, not a Verdict")
        payload: dict[str, Any] = {"reason": verdict.reason, "detail": verdict.detail,
                                   "at_s": self._rel(now)}
        action = verdict.action
        if action == "extend":
            by, bonus = verdict.extend_by, verdict.step_bonus
            if not (isinstance(by, (int, float)) and math.isfinite(by) and by > 0):
                raise ValueError(f"Judge {who} returned an extension of {by!r}s (must be > 0)")
            if not (isinstance(bonus, int) and bonus >= 0):
                raise ValueError(f"Judge {who} returned a step bonus of {bonus!r} "
                                 "(must be an integer >= 0)")
            new = (self._deadline if self._deadline is not None else now) + by
            capped = self._backstop is not None and new >= self._backstop
            if capped:
                assert self._backstop is not None
                new = self._backstop
            self._deadline = new
            self._extensions += 1
            self._bonus += bonus
            self._reset_window(now)
            payload.update(extended_by=by, deadline_s=self._rel(new), capped=capped,
                           extensions=self._extensions, step_bonus=bonus,
                           max_steps=(None if self._base_max_steps is None
                                      else self._base_max_steps + self._bonus))
        elif action == "expire":
            self._expired = True
            self._reset_window(now)
            payload.update(deadline_s=self._rel(self._deadline), extensions=self._extensions)
        elif action == "steer":
            if not verdict.message or not isinstance(verdict.message, str):
                raise ValueError(f"Judge {who} returned a steer verdict without a message")
            self._queue.append(Message("user", verdict.message))
            self._nudges[verdict.reason] = self._nudges.get(verdict.reason, 0) + 1
            self._open = _Open(verdict.reason, now, dict(verdict.evidence))
            payload["message"] = verdict.message
        elif action == "continue":
            self._open = None
        elif action == "kill":
            self._kill = verdict.reason or "killed by the critic"
            self._open = None
        else:
            raise ValueError(f"Judge {who} returned an unknown action {action!r}")
        payload["evidence"] = dict(verdict.evidence)
        self._events("critic", name=action, payload=payload)

    def _reset_window(self, now: float) -> None:
        self._window_start = now
        self._window = [0, 0, 0]
