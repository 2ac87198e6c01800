"""The judging policy: what a judge sees (`RunView`), what it answers (`Verdict`), the rules.

The watch handle (`_watch.py`) is mechanism: it keeps the evidence, moves
the deadline, queues nudges, remembers a kill and writes the audit. A
`Judge` is policy: a function from the evidence to a decision. Keeping the
two apart is what lets a host swap the rules for its own (an LLM judge),
and lets the rules be tested as a pure function of a `RunView`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kernel import RunInfo, ToolCall

from ._policy import CriticPolicy

#: The kill reason (and intervention reason) for a run with no activity.
STALLED = "stalled"
#: The kill reason (and intervention reason) for a run repeating tool calls.
LOOPING = "looping"

Action = Literal["continue", "extend", "steer", "kill", "expire"]
Trigger = Literal["step", "tool_start", "poll"]

_KEY_LIMIT = 200  # longest call key quoted in a nudge


def call_key(call: ToolCall) -> str:
    """The canonical identity of a tool call: `name(args as sorted, compact JSON)`.

    Two calls with the same name and equal arguments, in whatever order the
    arguments were given, have the same key: `search({"page":1,"q":"x"})`.
    """
    try:
        args = json.dumps(dict(call.args), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False, default=repr)
    except (TypeError, ValueError):  # unsortable keys, circular values
        args = repr(dict(call.args))
    return f"{call.name}({args})"


@dataclass(slots=True, frozen=True)
class Window:
    """What happened since the last progress judgment (or since the start).

    Attributes:
        since: Seconds after the run started when the window opened.
        seconds: How long the window has been open.
        steps, tool_calls, activity: Counts within the window (`activity`
            is everything else: output lines, adapter events).
    """

    since: float
    seconds: float
    steps: int = 0
    tool_calls: int = 0
    activity: int = 0

    @property
    def progressed(self) -> bool:
        """True if anything at all happened in the window."""
        return bool(self.steps or self.tool_calls or self.activity)


@dataclass(slots=True, frozen=True)
class Intervention:
    """The critic's open nudge: opened by a `steer` verdict, closed by `continue` or `kill`.

    Attributes:
        reason: The steer verdict's reason (`stalled`, `looping`, or a custom judge's).
        at: Seconds after the run started when the nudge was queued.
        delivered: True once the kernel drained the nudge for the agent.
        activity_since: Steps, tool calls and activity since the nudge was queued.
        calls_after_delivery: Tool calls the agent made after it got the nudge.
        evidence: The steer verdict's evidence, for the judge's follow-up.
    """

    reason: str
    at: float
    delivered: bool = False
    activity_since: int = 0
    calls_after_delivery: int = 0
    evidence: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class RunView:
    """Everything a judge may look at, as of one moment. Times are seconds since the run started.

    Attributes:
        info: The run being watched.
        trigger: What prompted this look: a finished `step`, a `tool_start`,
            or a `poll` (the kernel asking for the deadline, kill cause,
            step ceiling or nudges).
        elapsed: Seconds since the run started.
        steps, tool_calls, activity: Totals so far.
        idle: Seconds since the last step, tool call or activity.
        soft_timeout: The run's soft timeout (None: no progress judgments).
        deadline: When the current deadline falls (None: only the backstop).
        backstop: When the hard deadline falls (None: unbounded).
        due: True when the deadline has come and a progress judgment is
            owed: anything but `extend` (or `kill`) lets the run time out.
        extensions: How many times the deadline has been extended.
        max_steps: The current step ceiling (None: no ceiling).
        window: Activity since the last progress judgment.
        calls: Keys (`call_key`) of the most recent tool calls, oldest first.
        intervention: The open nudge, if any.
        nudges: How many nudges this run has had, by reason.
    """

    info: RunInfo
    trigger: Trigger
    elapsed: float
    steps: int
    tool_calls: int
    activity: int
    idle: float
    soft_timeout: float | None
    deadline: float | None
    backstop: float | None
    due: bool
    extensions: int
    max_steps: int | None
    window: Window
    calls: tuple[str, ...] = ()
    intervention: Intervention | None = None
    nudges: Mapping[str, int] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class Verdict:
    """One decision of a judge; the watch handle applies it and audits it.

    Build them with the class methods. `reason` is a short token analysts
    group by (`progressing`, `stalled`, `looping`, ...); a `kill` verdict's
    reason is the run's kill reason. `detail` says the same for a human.
    """

    action: Action
    reason: str
    detail: str = ""
    message: str | None = None
    extend_by: float = 0.0
    step_bonus: int = 0
    evidence: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def extend(cls, reason: str, *, by: float, step_bonus: int = 0, detail: str = "",
               evidence: Mapping[str, Any] | None = None) -> Verdict:
        """Move the deadline `by` seconds (never past the backstop); raise the ceiling."""
        return cls("extend", reason, detail, None, by, step_bonus, dict(evidence or {}))

    @classmethod
    def expire(cls, reason: str, *, detail: str = "",
               evidence: Mapping[str, Any] | None = None) -> Verdict:
        """Let the deadline stand: when it comes, the run ends `timeout`."""
        return cls("expire", reason, detail, evidence=dict(evidence or {}))

    @classmethod
    def steer(cls, reason: str, message: str, *, detail: str = "",
              evidence: Mapping[str, Any] | None = None) -> Verdict:
        """Queue `message` for the agent and open an intervention for `reason`."""
        return cls("steer", reason, detail, message, evidence=dict(evidence or {}))

    @classmethod
    def resume(cls, reason: str, *, detail: str = "",
               evidence: Mapping[str, Any] | None = None) -> Verdict:
        """Close the open intervention: the run recovered (audited as `continue`)."""
        return cls("continue", reason, detail, evidence=dict(evidence or {}))

    @classmethod
    def kill(cls, reason: str, *, detail: str = "",
             evidence: Mapping[str, Any] | None = None) -> Verdict:
        """End the run `killed` with `reason`."""
        return cls("kill", reason, detail, evidence=dict(evidence or {}))


class Judge(Protocol):
    """Decides what the critic does about a run, from the evidence in a `RunView`.

    **Protocol:** `judge` is called after each step and tool start and each
    time the kernel consults the handle (every `Limits.poll_interval` and
    at the deadline). It must not block: no I/O. (An LLM judge would ask its
    model from a task of its own and answer None until it hears back.)

    Return None when there is nothing new to decide. Every `Verdict`
    returned is applied and audited as a `critic` event named by its action,
    then the judge is asked again at once (a few times at most), so it can
    follow a `continue` with an `extend` in the same moment. Verdicts:

    - `extend`: move the deadline (owed when `view.due`) and raise the step ceiling.
    - `expire`: the deadline stands; when due, the run ends `timeout`.
    - `steer`: nudge the agent; opens `view.intervention`.
    - `continue`: close the intervention; the run recovered.
    - `kill`: end the run `killed` with the verdict's reason.

    The judge is shared by all runs of one `WatchCritic`: keep per-run
    memory in the verdicts' evidence (it comes back on `view.intervention`),
    not on the judge. Raising, or returning something malformed, makes the
    kernel stop consulting the critic for that run: the backstop stays in
    charge and the failure is reported on the result.
    """

    def judge(self, view: RunView) -> Verdict | None:
        """Decide, or return None."""

    # Optional: `quiet_until(view) -> float | None`. Right after `judge` returned
    # None for `view`, the time (seconds since the run started) before which the
    # judge promises to return None again as long as no new evidence arrives (no
    # step, tool call, activity or drained nudge). The handle then skips those
    # looks. None, or no such method: every look asks the judge.


class RulesJudge:
    """The default judge: progress extends, silence is nudged then killed, loops likewise.

    In order, at each look:

    1. An open nudge is followed up. Stalled: any activity since closes it
       (`continue`); `idle_timeout + grace` of silence kills (`stalled`).
       Looping: the first tool call after the agent got the nudge either
       carries the loop on (kill, `looping`) or breaks it (`continue`).
    2. At a tool start, the call history is checked for a loop: the same
       call `loop_repeats` times in a row, or a cycle of up to `max_cycle`
       calls turned `cycle_repeats` times. Found: a nudge naming the calls,
       or a kill once `loop_nudges` nudges have been spent.
    3. `idle_timeout` of silence: a nudge (`stalled`).
    4. A due deadline: progress in the window (any step, tool call or
       activity) extends it (`progressing`) and raises the step ceiling, up
       to `max_extensions` times; then it stands (`expire`) and the run ends
       `timeout`. A window without progress is extended without a step bonus
       (`quiet`) while stall detection is on: silence is the stall rule's to
       judge, by the tolerance the host chose, so a silent run ends `killed`
       `stalled`, never `timeout` by the accident of when the review fell.
       With stall detection off, a silent window lets the deadline lapse
       (`expire`, `no_progress`: the run ends `timeout`).

    Args:
        policy: The thresholds; `CriticPolicy()` defaults if None.
    """

    def __init__(self, policy: CriticPolicy | None = None) -> None:
        self.policy = policy if policy is not None else CriticPolicy()

    def judge(self, view: RunView) -> Verdict | None:
        """Apply the rules above to `view`."""
        iv = view.intervention
        if iv is not None:
            verdict = self._follow_up(view, iv)
            if verdict is not None:
                return verdict
        if view.trigger == "tool_start" and (iv is None or iv.reason != LOOPING):
            verdict = self._loop(view)
            if verdict is not None:
                return verdict
        verdict = self._stall(view, iv)
        if verdict is not None:
            return verdict
        if view.due:
            return self._progress(view)
        return None

    def quiet_until(self, view: RunView) -> float | None:
        """When the next time-based rule can fire, if no new evidence arrives.

        Silence reaching `idle_timeout` (or `idle_timeout + grace` after a
        stall nudge) and the deadline falling due are the only rules that
        fire on the clock alone; everything else needs new evidence.
        """
        p = self.policy
        times: list[float] = []
        last_activity = view.elapsed - view.idle
        if p.idle_timeout is not None:
            iv = view.intervention
            stalled = iv is not None and iv.reason == STALLED
            times.append(last_activity + p.idle_timeout
                         + (p.effective_grace if stalled else 0.0))
        if view.deadline is not None and not view.due:
            times.append(view.deadline)
        return min(times) if times else math.inf

    # ---------------------------------------------------------------- rules

    def _follow_up(self, view: RunView, iv: Intervention) -> Verdict | None:
        p = self.policy
        if iv.reason == STALLED:
            if iv.activity_since:
                return Verdict.resume(
                    "recovered", detail=f"activity resumed {view.elapsed - iv.at:.1f}s "
                                        "after the stall nudge",
                    evidence={"after": STALLED, "activity_since": iv.activity_since})
            if p.idle_timeout is not None and view.idle >= p.idle_timeout + p.effective_grace:
                return Verdict.kill(
                    STALLED, detail=f"no activity for {view.idle:.1f}s, "
                                    f"{view.elapsed - iv.at:.1f}s after a nudge",
                    evidence={"idle_s": round(view.idle, 3), "nudged_at_s": round(iv.at, 3),
                              "delivered": iv.delivered})
            return None
        if iv.reason == LOOPING and iv.calls_after_delivery:
            calls = view.calls
            first = len(calls) - iv.calls_after_delivery
            period = int(iv.evidence.get("period", 1))
            if first - period >= 0 and calls[first] == calls[first - period]:
                nudges = view.nudges.get(LOOPING, 0)
                return Verdict.kill(
                    LOOPING, detail=f"carried on with {_short(calls[first])} after a nudge",
                    evidence={"call": calls[first], "period": period, "nudges": nudges})
            return Verdict.resume(
                "recovered", detail="the agent changed course after the loop nudge",
                evidence={"after": LOOPING, "call": calls[first] if first >= 0 else None})
        return None

    def _loop(self, view: RunView) -> Verdict | None:
        p = self.policy
        found = find_loop(view.calls, repeats=p.loop_repeats, max_cycle=p.max_cycle,
                          cycle_repeats=p.cycle_repeats)
        if found is None:
            return None
        period, turns = found
        block = list(view.calls[-period:])
        if period == 1:
            what = f"{_short(block[0])} {turns} times in a row with the same arguments"
        else:
            what = (f"the cycle {' -> '.join(_short(k) for k in block)} "
                    f"{turns} times over with the same arguments")
        evidence = {"call": block[-1], "calls": block, "period": period, "repeats": turns}
        nudged = view.nudges.get(LOOPING, 0)
        if nudged >= p.loop_nudges:
            return Verdict.kill(LOOPING, detail=f"repeated {what} after {nudged} nudge(s)",
                                evidence={**evidence, "nudges": nudged})
        message = (f"You have called {what}, and it is not moving the task forward. "
                   "Do not repeat these calls: try a different approach, or finish with "
                   "what you have.")
        return Verdict.steer(LOOPING, message, detail=f"repeated {what}", evidence=evidence)

    def _stall(self, view: RunView, iv: Intervention | None) -> Verdict | None:
        p = self.policy
        if p.idle_timeout is None or view.idle < p.idle_timeout:
            return None
        if iv is not None and iv.reason == STALLED:
            return None
        message = (f"No progress for {view.idle:.0f}s: no step, tool call or output. "
                   "If you are stuck, say what is blocking you and try another way; "
                   "if you are done, finish now.")
        return Verdict.steer(
            STALLED, message, detail=f"no activity for {view.idle:.1f}s",
            evidence={"idle_s": round(view.idle, 3), "idle_timeout": p.idle_timeout,
                      "grace": p.effective_grace})

    def _progress(self, view: RunView) -> Verdict:
        p, w = self.policy, view.window
        evidence = {"window_s": round(w.seconds, 3), "steps": w.steps,
                    "tool_calls": w.tool_calls, "activity": w.activity,
                    "extensions": view.extensions}
        counts = (f"{w.steps} step(s), {w.tool_calls} tool call(s), {w.activity} other "
                  f"event(s) in the last {w.seconds:.1f}s")
        if not w.progressed and p.idle_timeout is None:
            return Verdict.expire("no_progress", detail=f"nothing happened in the last "
                                                        f"{w.seconds:.1f}s", evidence=evidence)
        if view.extensions >= p.max_extensions:
            return Verdict.expire("max_extensions", detail=f"{counts}, but all "
                                  f"{p.max_extensions} extensions are used", evidence=evidence)
        by = p.extend_by or view.soft_timeout or w.seconds
        if not w.progressed:
            # Silent, but for less than idle_timeout + grace (else the stall
            # rule would have killed it by now): the silence tolerance the
            # host chose decides, not an accident of when the review fell.
            return Verdict.extend("quiet", by=by, step_bonus=0, evidence=evidence, detail=(
                f"nothing happened in the last {w.seconds:.1f}s; silence is judged by "
                f"the stall rule ({p.idle_timeout:g}s + {p.effective_grace:g}s grace)"))
        bonus = p.step_bonus if p.step_bonus is not None else max(1, w.steps)
        return Verdict.extend("progressing", by=by, step_bonus=bonus, detail=counts,
                              evidence=evidence)


def find_loop(calls: Sequence[str], *, repeats: int, max_cycle: int,
              cycle_repeats: int) -> tuple[int, int] | None:
    """Find a loop ending at the newest call: `(period, turns)`, or None.

    Period 1 is the same call `repeats` or more times in a row. A longer
    period is a cycle of distinct-looking calls (a block that is not itself
    a repetition, so A-A-A-A is never a 2-cycle) seen `cycle_repeats` or
    more times in a row.
    """
    if not calls:
        return None
    last = calls[-1]
    run = 0
    for key in reversed(calls):
        if key != last:
            break
        run += 1
    if run >= repeats:
        return 1, run
    for period in range(2, max_cycle + 1):
        if len(calls) < period * cycle_repeats:
            break
        block = tuple(calls[-period:])
        if not _primitive(block):
            continue
        turns = 0
        end = len(calls)
        while end - period >= 0 and tuple(calls[end - period:end]) == block:
            turns += 1
            end -= period
        if turns >= cycle_repeats:
            return period, turns
    return None


def _primitive(block: tuple[str, ...]) -> bool:
    """True if `block` is not a shorter block repeated (A-B is; A-A and A-B-A-B are not)."""
    n = len(block)
    return all(block != block[d:] + block[:d] for d in range(1, n) if n % d == 0)


def _short(key: str) -> str:
    return key if len(key) <= _KEY_LIMIT else key[: _KEY_LIMIT - 3] + "..."
