"""The judging policy: what a judge sees (`RunView`), what it answers (`Decision`), the rules.

The watch handle (`_watch.py`) is mechanism: it keeps the evidence, moves
the deadline, queues nudges, remembers a kill and writes the audit. A
`Judge` is policy: a function from the evidence to a decision. Keeping the
two apart is what lets a host swap the rules for its own (an LLM judge),
and lets the rules be tested as a pure function of a `RunView`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any, Literal, Protocol, runtime_checkable

from kernel import RunInfo
from kernel._dataclass import dataclass

from ._policy import CriticPolicy

#: The kill reason (and intervention reason) for a run with no progress.
STALLED = "stalled"
#: The kill reason (and intervention reason) for a run repeating tool calls with unchanged results.
LOOPING = "looping"
#: The same error from tool call after tool call.
REPEATED_ERROR = "repeated_error"
#: The same assistant message step after step.
REPEATING = "repeating"
#: An assistant reply with no text and no tool call.
EMPTY_ANSWER = "empty_answer"
#: A silent process tree blocked reading its terminal or stdin.
WAITING_INPUT = "waiting_input"
#: A model request in flight past `CriticPolicy.model_timeout`.
MODEL_TIMEOUT = "model_timeout"
#: A tool call in flight past `CriticPolicy.tool_timeout`.
TOOL_TIMEOUT = "tool_timeout"

Action = Literal["continue", "extend", "steer", "kill", "expire"]
Trigger = Literal["step", "tool_start", "tool_end", "activity", "poll"]

_KEY_LIMIT = 200  # longest call key quoted in a nudge


@dataclass(slots=True, frozen=True)
class Outcome:
    """One tool call as the judge compares it.

    Attributes:
        call: The call's key with volatile argument values masked (`masked_call_key`).
        label: The call in short human form: `read_file(note.txt)`.
        result: The result's key with meaningless changes masked (`result_key`);
            None while the result is not (or never) reported.
        preview: The start of the result, for the audit.
        error: The masked error when the call failed, else None.
    """

    call: str
    label: str
    result: str | None = None
    preview: str = ""
    error: str | None = None

    @property
    def key(self) -> str:
        """Call and result together: what a loop must repeat."""
        return self.call if self.result is None else f"{self.call} -> {self.result}"


@dataclass(slots=True, frozen=True)
class Process:
    """The latest sample of the run's process trees (all of them, summed).

    Attributes:
        cpu_s: CPU seconds used so far (reaped children included).
        cpu_rate: Fraction of one core used, averaged over the sampler's window
            (10 s, or a third of the idle timeout if shorter).
        io_rate: Bytes per second read and written, over the same window.
        net_rate: Bytes per second moved over the trees' TCP connections
            (received, and sent and acknowledged), over the same window.
        procs: Processes alive in the trees.
        started, exited: Processes seen to start and to end since registration.
        working: True if the last sample showed CPU, I/O or network traffic over
            the policy's thresholds.
        waiting_input: True if a process sat blocked reading a terminal or
            stdin while the trees were otherwise flat.
        waits: What the blocked processes waited in (`pid:wchan`), as evidence.
        idle: Seconds since a sample last showed the trees working.
    """

    cpu_s: float = 0.0
    cpu_rate: float = 0.0
    io_rate: float = 0.0
    procs: int = 0
    started: int = 0
    exited: int = 0
    working: bool = False
    waiting_input: bool = False
    waits: tuple[str, ...] = ()
    idle: float = 0.0
    net_rate: float = 0.0

    def as_evidence(self) -> dict[str, Any]:
        """The figures as a JSON-ready dict."""
        return {"cpu_s": round(self.cpu_s, 3), "cpu_rate": round(self.cpu_rate, 4),
                "io_bytes_per_s": round(self.io_rate),
                "net_bytes_per_s": round(self.net_rate), "procs": self.procs,
                "started": self.started, "exited": self.exited, "working": self.working,
                "waiting_input": self.waiting_input, "waits": list(self.waits),
                "flat_for_s": round(self.idle, 3)}


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
        delivered: True once the kernel drained the nudge for the agent (False
            again if the agent then reported it `steer_undeliverable`).
        activity_since: Progress events (steps, tool calls, new output,
            working samples) since the nudge was queued.
        calls_after_delivery: Tool calls the agent started after it got the nudge.
        evidence: The steer verdict's evidence, for the judge's follow-up.
        steps_after_delivery: Steps the agent finished after it got the nudge.
        ends_after_delivery: Tool results recorded after the agent got the nudge.
    """

    reason: str
    at: float
    delivered: bool = False
    activity_since: int = 0
    calls_after_delivery: int = 0
    evidence: Mapping[str, Any] = field(default_factory=dict)
    steps_after_delivery: int = 0
    ends_after_delivery: int = 0


@dataclass(slots=True, frozen=True)
class RunView:
    """Everything a judge may look at, as of one moment. Times are seconds since the run started.

    Attributes:
        info: The run being watched.
        trigger: What prompted this look: a finished `step`, a `tool_start`,
            a `tool_end`, an `activity` carrying text, or a `poll` (the
            kernel asking for the deadline, step ceiling or nudges).
        elapsed: Seconds since the run started.
        steps, tool_calls, activity: Totals so far (`activity` counts progress
            events inside steps: new output lines, adapter events).
        idle: Seconds since the last progress (a step, a tool call, a new
            output line, an adapter event, a working process sample).
        soft_timeout: The run's soft timeout (None: no progress judgments).
        deadline: When the current deadline falls (None: only the backstop).
        backstop: When the hard deadline falls (None: unbounded).
        due: True when the deadline has come and a progress judgment is
            owed: anything but `extend` (or `kill`) lets the run time out.
        extensions: How many times the deadline has been extended.
        max_steps: The current step ceiling (None: no ceiling).
        window: Progress since the last progress judgment.
        calls: Masked keys (`masked_call_key`) of the most recent tool calls, oldest first.
        intervention: The open nudge, if any.
        nudges: How many nudges this run has had, by reason.
        outcomes: The most recent tool calls with their results, oldest first.
        reports_results: True once any tool result was recorded for this run
            (False for agents that report only tool starts, such as CLI agents).
        in_flight: "model" while a model request is in flight, "tool" while a
            tool call is, else None.
        in_flight_s: Seconds since that work started or last showed life
            (a streamed token).
        error_streak: How many tool calls in a row ended in the same (masked) error.
        last_error: That error.
        message_streak: How many steps in a row said the same non-empty message.
        last_message: That message.
        empty_answers: Steps in a row that said nothing and called no tool.
        lines: Output lines seen; novel_lines: how many of them were new.
        process: The latest sample of the run's process trees, if it has any.
        call_labels: The short human forms (`read_file(note.txt)`) of `calls`,
            in the same order.
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
    outcomes: tuple[Outcome, ...] = ()
    reports_results: bool = False
    in_flight: str | None = None
    in_flight_s: float = 0.0
    error_streak: int = 0
    last_error: str | None = None
    message_streak: int = 0
    last_message: str | None = None
    empty_answers: int = 0
    lines: int = 0
    novel_lines: int = 0
    process: Process | None = None
    call_labels: tuple[str, ...] = ()

    def counters(self) -> dict[str, Any]:
        """The run's counters as a JSON-ready dict, for verdict evidence."""
        out: dict[str, Any] = {
            "elapsed_s": round(self.elapsed, 3), "idle_s": round(self.idle, 3),
            "steps": self.steps, "tool_calls": self.tool_calls, "activity": self.activity,
            "lines": self.lines, "novel_lines": self.novel_lines}
        if self.in_flight is not None:
            out["in_flight"] = self.in_flight
            out["in_flight_s"] = round(self.in_flight_s, 3)
        if self.process is not None:
            out["process"] = self.process.as_evidence()
        return out


@dataclass(slots=True, frozen=True)
class Decision:
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
               evidence: Mapping[str, Any] | None = None) -> Decision:
        """Move the deadline `by` seconds (never past the backstop); raise the ceiling."""
        return cls("extend", reason, detail, None, by, step_bonus, dict(evidence or {}))

    @classmethod
    def expire(cls, reason: str, *, detail: str = "",
               evidence: Mapping[str, Any] | None = None) -> Decision:
        """Let the deadline stand: when it comes, the run ends `timeout`."""
        return cls("expire", reason, detail, evidence=dict(evidence or {}))

    @classmethod
    def steer(cls, reason: str, message: str, *, detail: str = "",
              evidence: Mapping[str, Any] | None = None) -> Decision:
        """Queue `message` for the agent and open an intervention for `reason`."""
        return cls("steer", reason, detail, message, evidence=dict(evidence or {}))

    @classmethod
    def resume(cls, reason: str, *, detail: str = "",
               evidence: Mapping[str, Any] | None = None) -> Decision:
        """Close the open intervention: the run recovered (audited as `continue`)."""
        return cls("continue", reason, detail, evidence=dict(evidence or {}))

    @classmethod
    def kill(cls, reason: str, *, detail: str = "",
             evidence: Mapping[str, Any] | None = None) -> Decision:
        """End the run `killed` with `reason`."""
        return cls("kill", reason, detail, evidence=dict(evidence or {}))


class Judge(Protocol):
    """Decides what the critic does about a run, from the evidence in a `RunView`.

    **Protocol:** `judge` is called after each tool start and tool result,
    after a step or output that could change a decision (a message, a
    repeated line), and whenever the kernel consults the handle once a
    clock rule may be due (see `quiet_until`). It must not block: no I/O.
    (An LLM judge would ask its model from a task of its own and answer None
    until it hears back.)

    Return None when there is nothing new to decide. Every `Decision`
    returned is applied and audited as a `critic` event named by its action,
    then the judge is asked again at once (a few times at most), so it can
    follow a `continue` with an `extend` in the same moment. Verdicts:

    - `extend`: move the deadline (owed when `view.due`) and raise the step ceiling.
    - `expire`: the deadline stands; when due, the run ends `timeout`.
    - `steer`: nudge the agent; opens `view.intervention`.
    - `continue`: close the intervention; the run recovered.
    - `kill`: end the run `killed` with the verdict's reason, at once.

    The judge is shared by all runs of one `WatchCritic`: keep per-run
    memory in the verdicts' evidence (it comes back on `view.intervention`),
    not on the judge. Raising, or returning something malformed, makes the
    kernel stop consulting the critic for that run: the backstop stays in
    charge and the failure is reported on the result.
    """

    def judge(self, view: RunView) -> Decision | None:
        """Decide, or return None."""


@runtime_checkable
class SupportsQuietUntil(Protocol):
    """A judge that can say how long the clock alone changes nothing (optional).

    **Protocol:** right after `judge` returned None for `view`, `quiet_until`
    returns the time (seconds since the run started) before which the judge
    promises to return None again as long as only plain progress arrives
    (steps without a message, new output, working samples: evidence that
    only pushes clock rules later). The handle skips looks until then, and
    the kernel's watcher looks at the run then. None, or a judge without it:
    the handle asks the judge at every look and the watcher polls. Looked
    up once per run, like the kernel's `Supports*` capabilities; must not block.
    """

    def quiet_until(self, view: RunView) -> float | None:
        """Seconds since the run started until which `judge` would answer None."""


_STEER_TAIL = ("Do not repeat it: try a different approach, or finish with what you have.")


class RulesJudge:
    """The default judge: progress extends; silence, repetition and hung work are nudged or killed.

    In order, at each look:

    1. An open nudge is followed up. Stalled / waiting for input: any
       progress since closes it (`continue`); `idle_timeout + grace` without
       progress kills. Looping: the first tool call after the agent got the
       nudge either carries the loop on (kill before it runs) or breaks it
       (`continue`). Repeated error / message / empty answer: the next tool
       result or step either repeats it again (kill) or not (`continue`).
    2. Work in flight past its own bound: a model request past
       `model_timeout` is killed `model_timeout`, a tool call past
       `tool_timeout` `tool_timeout` (no nudge: nothing can read it).
    3. Repetition, each nudged first (killed once `loop_nudges` are spent):
       the same call returning the same result `loop_repeats` times, or an
       A-B-A-B cycle of calls with unchanged results (`looping`; compared by
       the call alone for agents that never report results); the same error
       `error_repeats` times in a row (`repeated_error`); the same message
       `message_repeats` steps in a row (`repeating`); a reply with no text
       and no tool call (`empty_answer`).
    4. `idle_timeout` without progress and no work in flight with a bound of
       its own (a model request under `model_timeout=None`, a tool call under
       `tool_timeout=None` fall under this clock): a nudge, `waiting_input`
       when the process trees sit blocked reading a terminal or stdin fed
       from outside them, else `stalled`.
    5. A due deadline: progress in the window extends it (`progressing`) and
       raises the step ceiling, up to `max_extensions` times; then it stands
       (`expire`) and the run ends `timeout`. A window without progress is
       extended without a step bonus (`quiet`) while stall detection is on;
       with it off, the deadline lapses (`expire`, `no_progress`).

    Args:
        policy: The thresholds; `CriticPolicy()` defaults if None.
    """

    def __init__(self, policy: CriticPolicy | None = None) -> None:
        self.policy = policy if policy is not None else CriticPolicy()

    def judge(self, view: RunView) -> Decision | None:
        """Apply the rules above to `view`."""
        iv = view.intervention
        if iv is not None:
            verdict = self._follow_up(view, iv)
            if verdict is not None:
                return verdict
        verdict = self._hung(view)
        if verdict is not None:
            return verdict
        if iv is None or iv.reason in (STALLED, WAITING_INPUT):
            verdict = self._repetition(view)
            if verdict is not None:
                return verdict
        verdict = self._stall(view, iv)
        if verdict is not None:
            return verdict
        if view.due:
            return self._progress(view)
        return None

    def quiet_until(self, view: RunView) -> float | None:
        """When the next time-based rule can fire, if only plain progress arrives.

        Silence reaching its bound (`idle_timeout`, plus `grace` after a
        stall nudge; `model_timeout` / `tool_timeout` while work is in
        flight) and the deadline falling due are the only rules that fire on
        the clock alone; everything else needs new evidence.
        """
        p = self.policy
        times: list[float] = []
        bound = self._flight_bound(view)
        if view.in_flight is not None and bound is not None:
            times.append(view.elapsed - view.in_flight_s + bound)
        elif p.idle_timeout is not None:  # (work in flight without a bound of its own too)
            iv = view.intervention
            stalled = iv is not None and iv.reason in (STALLED, WAITING_INPUT)
            times.append(view.elapsed - view.idle + p.idle_timeout
                         + (p.effective_grace if stalled else 0.0))
        if view.deadline is not None and not view.due:
            times.append(view.deadline)
        return min(times) if times else math.inf

    # ---------------------------------------------------------------- rules

    def _flight_bound(self, view: RunView) -> float | None:
        if view.in_flight == "model":
            return self.policy.model_timeout
        if view.in_flight == "tool":
            return self.policy.tool_timeout
        return None

    def _follow_up(self, view: RunView, iv: Intervention) -> Decision | None:
        p = self.policy
        reason = iv.reason
        if reason in (STALLED, WAITING_INPUT):
            if iv.activity_since:
                return Decision.resume(
                    "recovered", detail=f"progress resumed {view.elapsed - iv.at:.1f}s "
                                        "after the nudge",
                    evidence={"after": reason, "activity_since": iv.activity_since,
                              **view.counters()})
            if (self._flight_bound(view) is None and p.idle_timeout is not None
                    and view.idle >= p.idle_timeout + p.effective_grace):
                what = ("blocked reading its terminal or stdin" if reason == WAITING_INPUT
                        else "no progress")
                return Decision.kill(
                    reason, detail=f"{what} for {view.idle:.1f}s, nudged at {iv.at:.1f}s",
                    evidence={"nudged_at_s": round(iv.at, 3), "delivered": iv.delivered,
                              **view.counters()})
            return None
        if reason == LOOPING and iv.calls_after_delivery:
            calls = view.calls
            first = len(calls) - iv.calls_after_delivery
            block = list(iv.evidence.get("calls") or [])
            if 0 <= first < len(calls) and calls[first] in block:
                labels = view.call_labels
                after = labels[first] if len(labels) == len(calls) else None
                evidence = {**iv.evidence, "nudged_at_s": round(iv.at, 3),
                            "nudges": view.nudges.get(LOOPING, 0), **view.counters()}
                if after is not None:
                    evidence["call_after_nudge"] = after
                return Decision.kill(
                    LOOPING, detail=_loop_sentence(evidence, iv.at, carried_on=True),
                    evidence=evidence)
            return Decision.resume(
                "recovered", detail="the agent changed course after the loop nudge",
                evidence={"after": LOOPING,
                          "call": calls[first] if 0 <= first < len(calls) else None})
        if reason == REPEATED_ERROR and iv.ends_after_delivery:
            repeats = int(iv.evidence.get("repeats", 0))
            if view.error_streak > repeats:
                return Decision.kill(REPEATED_ERROR, detail=(
                    f"the same error {view.error_streak} times in a row: "
                    f"{_short(view.last_error or '')}, nudged at {iv.at:.1f}s"),
                    evidence={**iv.evidence, "repeats": view.error_streak,
                              "nudged_at_s": round(iv.at, 3), **view.counters()})
            return Decision.resume("recovered", detail="the error changed after the nudge",
                                  evidence={"after": REPEATED_ERROR})
        if reason == REPEATING and iv.steps_after_delivery:
            repeats = int(iv.evidence.get("repeats", 0))
            if view.message_streak > repeats:
                return Decision.kill(REPEATING, detail=(
                    f"said the same thing {view.message_streak} times in a row: "
                    f"\"{_short(view.last_message or '', 60)}\", nudged at {iv.at:.1f}s"),
                    evidence={**iv.evidence, "repeats": view.message_streak,
                              "nudged_at_s": round(iv.at, 3), **view.counters()})
            return Decision.resume("recovered", detail="the agent said something new",
                                  evidence={"after": REPEATING})
        if reason == EMPTY_ANSWER and iv.steps_after_delivery:
            if view.empty_answers > int(iv.evidence.get("repeats", 1)):
                return Decision.kill(EMPTY_ANSWER, detail=(
                    f"answered with an empty message {view.empty_answers} times, "
                    f"nudged at {iv.at:.1f}s"),
                    evidence={"repeats": view.empty_answers, "nudged_at_s": round(iv.at, 3),
                              **view.counters()})
            return Decision.resume("recovered", detail="the agent answered after the nudge",
                                  evidence={"after": EMPTY_ANSWER})
        return None

    def _hung(self, view: RunView) -> Decision | None:
        bound = self._flight_bound(view)
        if bound is None or view.in_flight_s < bound:
            return None
        reason = MODEL_TIMEOUT if view.in_flight == "model" else TOOL_TIMEOUT
        what = "a model request" if view.in_flight == "model" else "a tool call"
        return Decision.kill(reason, detail=f"{what} in flight for {view.in_flight_s:.1f}s "
                                           f"without a reply (bound {bound:g}s)",
                            evidence={"bound_s": bound, **view.counters()})

    def _repetition(self, view: RunView) -> Decision | None:
        trigger = view.trigger
        if trigger == "tool_end" or (trigger == "tool_start" and not view.reports_results):
            verdict = self._loop(view)
            if verdict is not None:
                return verdict
        if trigger == "tool_end" and view.error_streak >= self.policy.error_repeats:
            return self._nudge_or_kill(
                view, REPEATED_ERROR,
                f"the same error {view.error_streak} times in a row: "
                f"{_short(view.last_error or '')}",
                f"Your last {view.error_streak} tool calls failed with the same error: "
                f"{_short(view.last_error or '')}. {_STEER_TAIL}",
                {"error": view.last_error, "repeats": view.error_streak})
        if trigger == "step":
            if view.empty_answers >= 1:
                return self._nudge_or_kill(
                    view, EMPTY_ANSWER, "answered with an empty message",
                    "Your last reply was empty: no text and no tool call. Answer the task, "
                    "or call a tool.", {"repeats": view.empty_answers})
            if view.message_streak >= self.policy.message_repeats:
                text = _short(view.last_message or "", 60)
                return self._nudge_or_kill(
                    view, REPEATING, f"said the same thing {view.message_streak} times in a "
                                     f"row: \"{text}\"",
                    f"You have said the same thing {view.message_streak} times: \"{text}\". "
                    f"{_STEER_TAIL}",
                    {"message": view.last_message, "repeats": view.message_streak})
        return None

    def _nudge_or_kill(self, view: RunView, reason: str, what: str, message: str,
                       evidence: dict[str, Any]) -> Decision:
        nudged = view.nudges.get(reason, 0)
        if nudged >= self.policy.loop_nudges:
            return Decision.kill(reason, detail=f"{what}, after {nudged} nudge(s)",
                                evidence={**evidence, "nudges": nudged, **view.counters()})
        return Decision.steer(reason, message, detail=what,
                             evidence={**evidence, **view.counters()})

    def _loop(self, view: RunView) -> Decision | None:
        p = self.policy
        with_results = view.reports_results
        if with_results:
            outcomes = view.outcomes
            keys = [o.key for o in outcomes]
        else:
            outcomes = ()
            keys = list(view.calls)
        found = find_loop(keys, repeats=p.loop_repeats, max_cycle=p.max_cycle,
                          cycle_repeats=p.cycle_repeats)
        if found is None:
            return None
        period, turns = found
        if with_results:
            block_o = outcomes[-period:]
            calls = [o.call for o in block_o]
            labels = [o.label for o in block_o]
            results = [o.preview for o in block_o]
        else:
            calls = list(view.calls[-period:])
            labels = [_short(k, 80) for k in calls]
            results = []
        evidence: dict[str, Any] = {
            "call": labels[-1], "calls": calls, "labels": labels, "period": period,
            "repeats": turns, "with_results": with_results}
        if with_results:
            evidence["result"] = results[-1]
            evidence["results"] = results
        if period == 1:
            recent = (view.call_labels if not with_results
                      else tuple(o.label for o in outcomes))[-turns:]
            if len(set(recent)) > 1:
                # Masked-equal, not equal: the sentence must not claim one call ran N times.
                evidence["distinct_calls"] = len(set(recent))
        nudged = view.nudges.get(LOOPING, 0)
        if nudged >= p.loop_nudges:
            return Decision.kill(LOOPING, detail=_loop_sentence(evidence, None) + (
                f", after {nudged} nudge(s)"), evidence={**evidence, "nudges": nudged,
                                                         **view.counters()})
        if period == 1:
            what = f"{labels[0]} {turns} times"
            same = " and got the same result each time" if with_results else ""
        else:
            what = f"the cycle {' -> '.join(labels)} {turns} times over"
            same = " with the same results" if with_results else ""
        message = (f"You have called {what}{same}; it is not moving the task forward. "
                   f"{_STEER_TAIL}")
        return Decision.steer(LOOPING, message, detail=_loop_sentence(evidence, None),
                             evidence={**evidence, **view.counters()})

    def _stall(self, view: RunView, iv: Intervention | None) -> Decision | None:
        p = self.policy
        # Work in flight with a bound of its own is judged by it (`_hung`); without
        # one (`model_timeout`/`tool_timeout` None) it is under the idle clock, where
        # a working process tree or streamed tokens still count as progress.
        if (p.idle_timeout is None or view.idle < p.idle_timeout
                or self._flight_bound(view) is not None):
            return None
        if iv is not None and iv.reason in (STALLED, WAITING_INPUT):
            return None
        proc = view.process
        if proc is not None and proc.waiting_input:
            message = (f"No progress for {view.idle:.0f}s: the process is waiting for input "
                       "on its terminal or stdin. Answer it, or stop it and do without.")
            return Decision.steer(WAITING_INPUT, message, detail=(
                f"blocked reading its terminal or stdin for {view.idle:.1f}s "
                f"({', '.join(proc.waits) or 'read'})"),
                evidence={"idle_timeout": p.idle_timeout, "grace": p.effective_grace,
                          **view.counters()})
        message = (f"No progress for {view.idle:.0f}s: no step, tool call, new output or "
                   "working process. If you are stuck, say what is blocking you and try "
                   "another way; if you are done, finish now.")
        during = {"model": " (a model request in flight)",
                  "tool": " (a tool call in flight)"}.get(view.in_flight or "", "")
        return Decision.steer(
            STALLED, message, detail=f"no progress for {view.idle:.1f}s{during}",
            evidence={"idle_timeout": p.idle_timeout, "grace": p.effective_grace,
                      **view.counters()})

    def _progress(self, view: RunView) -> Decision:
        p, w = self.policy, view.window
        evidence = {"window_s": round(w.seconds, 3), "steps": w.steps,
                    "tool_calls": w.tool_calls, "activity": w.activity,
                    "extensions": view.extensions}
        counts = (f"{w.steps} step(s), {w.tool_calls} tool call(s), {w.activity} other "
                  f"event(s) in the last {w.seconds:.1f}s")
        if not w.progressed and p.idle_timeout is None:
            return Decision.expire("no_progress", detail=f"nothing happened in the last "
                                                        f"{w.seconds:.1f}s", evidence=evidence)
        if view.extensions >= p.max_extensions:
            return Decision.expire("max_extensions", detail=f"{counts}, but all "
                                  f"{p.max_extensions} extensions are used", evidence=evidence)
        by = p.extend_by or view.soft_timeout or w.seconds
        if not w.progressed:
            return Decision.extend("quiet", by=by, step_bonus=0, evidence=evidence, detail=(
                f"nothing happened in the last {w.seconds:.1f}s; silence is judged by "
                f"the stall rule ({p.idle_timeout:g}s + {p.effective_grace:g}s grace)"))
        bonus = p.step_bonus if p.step_bonus is not None else max(1, w.steps)
        return Decision.extend("progressing", by=by, step_bonus=bonus, detail=counts,
                              evidence=evidence)


def _loop_sentence(evidence: Mapping[str, Any], nudged_at: float | None, *,
                   carried_on: bool = False) -> str:
    """`read_file(note.txt) returned the same result 4 times, nudged at 12.3 s`."""
    labels = list(evidence.get("labels") or [evidence.get("call", "?")])
    turns = int(evidence.get("repeats", 0))
    with_results = bool(evidence.get("with_results"))
    if len(labels) == 1:
        what = (f"{labels[0]} returned the same result {turns} times" if with_results
                else f"{labels[0]} called {turns} times in a row")
        distinct = int(evidence.get("distinct_calls") or 0)
        if distinct > 1:
            what += " (near-duplicates)"  # masked-equal calls, not one call N times
    else:
        what = (f"the cycle {' -> '.join(labels)} turned {turns} times"
                + (" with unchanged results" if with_results else ""))
    if carried_on:
        after = evidence.get("call_after_nudge")
        if after is None or after in labels:
            what += ", and again after the nudge"
        else:  # a near-duplicate (only masked values differ): say which call it was
            what += f", then {after} after the nudge"
    if nudged_at is not None:
        what += f", nudged at {nudged_at:.1f}s"
    return what


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


def _short(key: str, limit: int = _KEY_LIMIT) -> str:
    return key if len(key) <= limit else key[: limit - 3] + "..."
