"""`WatchCritic` and its per-run `WatchHandle`: the mechanism around a `Judge`.

There is no background task per run. The kernel's watcher (one task for all
its runs) looks at a run at `next_look()` (the moment the judge said a clock
rule could next fire) or when the handle wakes it (a nudge to deliver
mid-step); the run task calls in after every step, tool start, tool result
and activity. The handle judges inside those calls, with
`trio.current_time()` as its clock, which keeps the critic deterministic
under `autojump_clock` and means a stopped run leaves nothing behind. The
critic's one task is its `ProcessSampler`, which samples the process trees
adapters register (`record_process`).

Concurrency: the run task, the kernel's watcher and the sampler's
deliveries interleave calls on the trio thread, never in parallel, and no
method awaits, so each call sees and leaves a consistent state without a
lock. A guard keeps a judge (or an event sink) that calls back into the
handle from judging recursively.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import trio

from kernel import ConfigError, EventSink, Message, RunInfo, Step, ToolCall, ToolResult

from ._evidence import (
    Novelty,
    call_key,
    call_label,
    error_key,
    failure_text,
    masked_call_key,
    message_key,
    preview,
    render_result,
    result_key,
)
from ._judge import (
    Decision,
    Intervention,
    Judge,
    Outcome,
    Process,
    RulesJudge,
    RunView,
    Trigger,
    Window,
)
from ._policy import CriticPolicy
from ._process import ProcessProbe, ProcessSampler, merge

# How many verdicts one look may apply (a `continue` then an `extend` is
# two); a judge that keeps answering is cut off here rather than flooding
# the audit.
_MAX_VERDICTS_PER_LOOK = 4

# Adapter events about delivering a nudge (`steer_undeliverable`, ...) reach
# `record_activity` like any event; counting them would let a hung command
# "recover" by reporting that it could not be nudged.
_ECHO_PREFIX = "steer"

#: Activity kinds with a meaning to the critic (adapters send them through
#: `ctx.activity` / `ctx.event`): a model request went out and is in flight
#: until the step ends or a `model_call` event reports the reply; a streamed
#: token shows the request is alive.
MODEL_REQUEST = "model_request"
MODEL_TOKEN = "model_token"
MODEL_REPLY = "model_call"
#: An adapter could not pass a drained nudge on (the shell adapter without a stdin pipe).
STEER_UNDELIVERABLE = "steer_undeliverable"

_RESULT_KEY_LIMIT = 2048  # longer result keys are compared by digest

# `WatchHandle(quiet_until=)` left out: the handle looks it up on its judge.
_FROM_JUDGE: Any = object()
#: What `steer()` returns when nothing is queued: shared, so never changed by a caller.
_NO_MESSAGES: list[Message] = []


# The last trio clock seen and its `current_time` (read and replaced whole: trio
# runs in other threads may have clocks of their own).
_clock: tuple[Any, Callable[[], float]] = (None, time.perf_counter)


def _clock_now() -> Callable[[], float]:
    """The current trio clock's `current_time`: one bound method per clock, not per run."""
    global _clock
    clock = trio.lowlevel.current_clock()
    last = _clock
    if last[0] is not clock:
        last = _clock = (clock, clock.current_time)
    return last[1]


class WatchCritic:
    """The default Critic: watches each run, extends healthy ones, nudges and kills stuck ones.

    Hand it to the kernel as `Ports(critic=WatchCritic())`. Every decision
    is an audit event of kind `critic`, named by the decision (`extend`,
    `expire`, `steer`, `continue`, `kill`), with its reason, a one-line
    `detail` and its evidence in the payload; a `watch` event at the start
    records the thresholds.

    Args:
        policy: The thresholds (`CriticPolicy()` defaults if None). Its
            `soft_timeout` applies to runs whose `Limits.soft_timeout` is None.
        judge: Who decides; `RulesJudge(policy)` if None.
        history: How many recent tool calls are kept for loop detection.
        probe: Where process figures come from (`PsutilProbe()` if None); tests
            pass a hand-written one.
    """

    def __init__(self, policy: CriticPolicy | None = None, *, judge: Judge | None = None,
                 history: int = 64, probe: ProcessProbe | None = None) -> None:
        self.policy = policy if policy is not None else CriticPolicy()
        self.judge: Judge = judge if judge is not None else RulesJudge(self.policy)
        if history < 2:
            raise ConfigError(f"WatchCritic history must be >= 2, got {history}")
        self.history = history
        self._policy_cache: tuple[CriticPolicy, dict[str, Any]] | None = None
        self._quiet_cache: tuple[Judge, Any] | None = None
        p = self.policy
        self.sampler = ProcessSampler(
            probe, interval=p.sample_interval, cpu_busy=p.cpu_busy, io_busy=p.io_busy,
            net_busy=p.net_busy,
            max_interval=None if p.idle_timeout is None else p.idle_timeout / 3)

    def _policy_dict(self) -> dict[str, Any]:
        """`policy.as_dict()`, built once per policy (it is frozen): a copy per run."""
        cached = self._policy_cache
        if cached is None or cached[0] is not self.policy:
            cached = self._policy_cache = (self.policy, self.policy.as_dict())
        return dict(cached[1])

    def _quiet_until(self) -> Callable[[RunView], float | None] | None:
        """The judge's `quiet_until` (SupportsQuietUntil), one bound method per judge."""
        cached = self._quiet_cache
        if cached is None or cached[0] is not self.judge:
            cached = self._quiet_cache = (self.judge, getattr(self.judge, "quiet_until", None))
        quiet_until: Callable[[RunView], float | None] | None = cached[1]
        return quiet_until

    def monitor(self, info: RunInfo, soft_timeout: float | None, *, backstop: float | None,
                max_steps: int | None, events: EventSink) -> WatchHandle:
        """Start watching one run; `soft_timeout` None means the policy's."""
        soft = soft_timeout if soft_timeout is not None else self.policy.soft_timeout
        handle = WatchHandle(self.judge, info, soft_timeout=soft, backstop=backstop,
                             max_steps=max_steps, events=events, history=self.history,
                             sampler=self.sampler, quiet_until=self._quiet_until())
        events("critic", name="watch", payload={
            "judge": type(self.judge).__name__,
            "policy": self._policy_dict(),
            "soft_timeout": soft,
            "deadline_s": handle._rel(handle._deadline),
            "backstop_s": handle._rel(backstop),
            "max_steps": max_steps,
        })
        return handle


class _Open:
    """The mutable twin of `Intervention`, kept by the handle."""

    __slots__ = ("activity_since", "at", "calls_after_delivery", "delivered",
                 "ends_after_delivery", "evidence", "reason", "steps_after_delivery",
                 "undeliverable")

    def __init__(self, reason: str, at: float, evidence: dict[str, Any]) -> None:
        self.reason = reason
        self.at = at
        self.evidence = evidence
        self.delivered = False
        # The agent could not be given it (`steer_undeliverable`): said in the evidence;
        # what it does next still follows the nudge up (it was drained, and tried).
        self.undeliverable = False
        self.activity_since = 0
        self.calls_after_delivery = 0
        self.steps_after_delivery = 0
        self.ends_after_delivery = 0


class WatchHandle:
    """The critic's link to one run (a `kernel.CriticHandle`).

    Keeps the evidence (progress times, in-flight work, recent calls and
    outcomes, streaks, output novelty, process figures), feeds it to the
    judge and applies its verdicts: moves the deadline (never past the
    backstop), raises the step ceiling, queues nudges, remembers a kill.
    Built by `WatchCritic.monitor`.
    """

    __slots__ = ("_activity", "_backstop", "_base_max_steps", "_bonus", "_bonus_told",
                 "_call_labels", "_calls", "_deadline", "_dirty", "_empty", "_error_key",
                 "_error_streak", "_error_text", "_events",
                 "_expired", "_extensions", "_figures", "_history", "_info", "_judge",
                 "_judge_quiet_until", "_judging", "_kill", "_last_progress", "_model_since",
                 "_msg_key", "_msg_streak", "_msg_text", "_novelty", "_now", "_nudges", "_open",
                 "_outcomes", "_pending", "_queue", "_quiet_until", "_reports_results", "_roots",
                 "_sampled_at", "_sampler", "_soft", "_start", "_steps", "_stopped", "_tool_calls",
                 "_tool_since", "_wake", "_win_other", "_win_steps", "_win_tools",
                 "_window_start")

    def __init__(self, judge: Judge, info: RunInfo, *, soft_timeout: float | None,
                 backstop: float | None, max_steps: int | None, events: EventSink,
                 history: int = 64, sampler: ProcessSampler | None = None,
                 quiet_until: Any = _FROM_JUDGE) -> None:
        # The run's clock, read directly: what `trio.current_time()` returns, without
        # its lookups (`record_step` reads it once a step).
        self._now: Callable[[], float] = _clock_now()
        now = self._now()
        self._judge = judge
        # SupportsQuietUntil, looked up once (a member set to None counts as absent).
        # (`quiet_until`: the critic passes the one it looked up for all its handles.)
        self._judge_quiet_until: Callable[[RunView], float | None] | None = (
            getattr(judge, "quiet_until", None) if quiet_until is _FROM_JUDGE else quiet_until)
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
        self._bonus_told = 0  # the bonus `max_steps()` last answered with
        self._steps = self._tool_calls = self._activity = 0
        self._last_progress = now
        self._window_start = now
        # The review window's counts: tool calls, other progress; its steps are the
        # run's since `_win_steps` (one count a step fewer on the per-step path).
        self._win_steps = self._win_tools = self._win_other = 0
        # Made at the first tool call, result and line of text: many runs have none.
        self._history = history
        self._calls: deque[str] | None = None
        self._call_labels: deque[str] | None = None  # `_calls`' labels, for sentences
        self._outcomes: deque[Outcome] | None = None
        # Started, no result yet (made at the first tool call).
        self._pending: list[tuple[ToolCall, str, str]] | None = None
        self._reports_results = False
        self._model_since: float | None = None
        self._tool_since: float | None = None
        self._error_streak = 0
        self._error_key: str | None = None
        self._error_text: str | None = None
        self._msg_streak = 0
        self._msg_key: str | None = None
        self._msg_text: str | None = None
        self._empty = 0
        self._novelty: Novelty | None = None
        self._sampler = sampler
        self._roots: dict[int, Callable[[Process], None]] = {}
        self._figures: dict[int, Process] = {}
        self._sampled_at = now  # when the latest figures were taken (trio time)
        self._queue: list[Message] | None = None  # nudges to deliver (made at the first)
        self._open: _Open | None = None
        self._nudges: dict[str, int] = {}
        self._kill: str | None = None
        self._stopped = False
        self._judging = False
        self._wake: Callable[[], None] | None = None
        # Looks that cannot decide anything are skipped: `_dirty` is set by
        # evidence a rule other than the clock could act on; until
        # `_quiet_until` (trio time) the judge said the clock alone changes nothing.
        self._dirty = True
        self._quiet_until = -math.inf

    # ------------------------------------------------------- the run task

    def record_step(self, iteration: int, step: Step) -> None:
        """A step finished: progress; a message (or an empty answer) is evidence for the judge."""
        self.step_ended(iteration, step, self._now())

    def step_ended(self, iteration: int, step: Step, now: float) -> bool:
        """`record_step` with the time the step ended (`kernel.SupportsStepEnd`).

        True when there is nothing for the kernel: no kill cause, no nudge
        queued, and the step ceiling `max_steps()` last gave unchanged (the
        kernel then skips asking until the handle hears something else).
        """
        if self._stopped:
            return False
        self._steps += 1
        self._model_since = None
        if self._tool_since is not None and not self._reports_results:
            if self._pending:
                self._pending.clear()
            self._tool_since = None
        # Progress, inlined: this is the per-step hot path.
        if now > self._last_progress:
            self._last_progress = now
        op = self._open
        if op is not None:
            op.activity_since += 1
        message = step.message
        if message is not None:
            if message.strip():
                key = message_key(message)
                if step.tool_calls:
                    # The same words with different tool calls is a preamble ("Let me
                    # check."), not a repeat: the calls are part of what was said.
                    key += "\x00" + "\x00".join(call_key(c) for c in step.tool_calls)
                if key == self._msg_key:
                    self._msg_streak += 1
                else:
                    self._msg_key, self._msg_streak = key, 1
                self._msg_text = message
                self._empty = 0
            elif not step.tool_calls:
                self._empty += 1
            else:
                self._empty = 0
            self._dirty = True
        if op is not None and op.delivered:
            op.steps_after_delivery += 1
            self._dirty = True
        if self._dirty:
            self._look("step")
        return self._kill is None and self._queue is None and self._bonus == self._bonus_told

    def record_tool_start(self, call: ToolCall) -> None:
        """A tool call is starting: progress, work in flight, loop evidence; the judge looks."""
        if self._stopped:
            return
        self._tool_calls += 1
        self._win_tools += 1
        masked = masked_call_key(call)
        label = call_label(call)
        calls = self._calls
        if calls is None:
            calls = self._calls = deque(maxlen=self._history)
            self._call_labels = deque(maxlen=self._history)
        calls.append(masked)
        assert self._call_labels is not None
        self._call_labels.append(label)
        pending = self._pending
        if pending is None:
            pending = self._pending = []
        elif not self._reports_results:
            pending.clear()
        pending.append((call, masked, label))
        fresh = self._tool_since is None
        now = self._progress()
        self._tool_since = now
        op = self._open
        if op is not None and op.delivered:
            op.calls_after_delivery += 1
        self._dirty = True
        self._look("tool_start")
        if fresh and self._wake is not None and self._kill is None:
            # A call's bound (`tool_timeout`) may fall before the look the watcher
            # planned (the idle clock): have it plan again, as for a model request.
            self._wake()

    def record_tool_end(self, result: ToolResult) -> None:
        """A tool call finished: its outcome is evidence for loops and repeated errors."""
        if self._stopped:
            return
        self._reports_results = True
        call = result.call
        pending = self._pending
        if pending is None:
            pending = self._pending = []
        entry = None
        for i, (c, _, _) in enumerate(pending):
            if c is call or (call.id and c.id == call.id):
                entry = pending.pop(i)
                break
        if entry is None:
            entry = (call, masked_call_key(call), call_label(call))
            if pending:
                pending.pop(0)
        _, masked, label = entry
        text = render_result(result)
        rkey = result_key(result)
        if len(rkey) > _RESULT_KEY_LIMIT:
            rkey = hashlib.blake2b(rkey.encode("utf-8", "replace"), digest_size=16).hexdigest()
        err = None
        failed = failure_text(result)
        if failed is not None:
            err = error_key(failed[:_RESULT_KEY_LIMIT])
            if err == self._error_key:
                self._error_streak += 1
            else:
                self._error_key, self._error_streak = err, 1
            self._error_text = preview(failed, 200)
        else:
            self._error_key, self._error_streak = None, 0
        outcomes = self._outcomes
        if outcomes is None:
            outcomes = self._outcomes = deque(maxlen=self._history)
        outcomes.append(Outcome(masked, label, rkey, preview(text), err))
        now = self._progress()
        self._tool_since = now if self._pending else None
        op = self._open
        if op is not None and op.delivered:
            op.ends_after_delivery += 1
        self._dirty = True
        self._look("tool_end")

    def record_activity(self, kind: str, text: str | None = None) -> None:
        """Something happened inside a long step.

        Kinds starting with "steer" (an adapter reporting what it did with a
        nudge, such as `steer_undeliverable`) are the critic's own echo, not
        a sign of life. `model_request` marks a model request in flight (a
        `model_token` keeps it alive; the step's end or `model_call` ends
        it). Any other activity is progress, unless it carries `text` that
        shows nothing new (the same line again, a spinner frame, a redraw).
        No judging here: this is the hot path (every output line), and new
        progress only pushes the clock rules later.
        """
        if self._stopped:
            return
        if kind.startswith(_ECHO_PREFIX):
            if kind == STEER_UNDELIVERABLE and self._open is not None:
                self._open.undeliverable = True  # drained, but the agent never got it
            return
        if kind in (MODEL_REQUEST, MODEL_TOKEN):
            fresh = self._model_since is None
            self._model_since = self._progress()
            if fresh and self._wake is not None:
                # A request's bound (`model_timeout`) may fall before the look the
                # watcher planned (the idle clock): have it look, and plan again.
                self._dirty = True
                self._wake()
            return
        if kind == MODEL_REPLY:
            self._model_since = None
        if text is not None:
            novelty = self._novelty
            if novelty is None:
                novelty = self._novelty = Novelty()
            if not novelty.see(text):
                return
        self._activity += 1
        self._win_other += 1
        self._progress()

    def record_process(self, pid: int) -> None:
        """The run started a process: sample its tree (CPU, I/O, children, input waits)."""
        if self._stopped or self._sampler is None or pid in self._roots:
            return

        def sink(figures: Process, root: int = pid) -> None:
            self._on_sample(root, figures)

        self._roots[pid] = sink
        self._sampler.register(pid, sink)

    def record_process_exit(self, pid: int) -> None:
        """A process the run started has exited: stop sampling its tree."""
        sink = self._roots.pop(pid, None)
        self._figures.pop(pid, None)
        if sink is not None and self._sampler is not None:
            self._sampler.unregister(pid, sink)

    def attach(self, wake: Callable[[], None]) -> None:
        """How the kernel has its watcher look at the run now (a nudge to deliver mid-step)."""
        self._wake = wake

    def next_look(self) -> float | None:
        """When (trio time) the kernel's watcher should look next; None: only when woken."""
        if self._stopped or self._kill is not None:
            return None
        if self._dirty or self._quiet_until == -math.inf:
            return trio.current_time()
        return None if self._quiet_until == math.inf else self._quiet_until

    def steer(self) -> list[Message]:
        """Drain the queued nudges; draining marks the open intervention delivered.

        Judges only evidence waiting to be judged: clock rules are the watch
        task's (it looks through `deadline()` at `next_look()`), so the step
        loop's call per step costs no clock read.
        """
        if self._dirty:
            self._look("poll")
        msgs = self._queue
        if not msgs:
            return _NO_MESSAGES  # (asked every step: no list made for nothing)
        self._queue = None
        self._dirty = True
        if self._open is not None:
            self._open.delivered = True
        return msgs

    def deadline(self) -> float | None:
        """The current deadline (trio time), after judging whatever is due."""
        self._look("poll")
        return self._deadline

    def max_steps(self) -> int | None:
        """The base step ceiling plus every extension's bonus; None if there is no ceiling."""
        if self._dirty:
            self._look("poll")
        self._bonus_told = self._bonus
        if self._base_max_steps is None:
            return None
        return self._base_max_steps + self._bonus

    def kill_cause(self) -> str | None:
        """The kill reason once the judge has killed the run.

        No judging here: the kernel asks after every record (the hot path);
        the judge looks in the `record_*` calls and when the watcher asks
        for the deadline.
        """
        return self._kill

    def stop(self) -> None:
        """The run is over: no more judgments or events; its processes are no longer sampled."""
        self._stopped = True
        self._queue = None
        self._open = None
        for pid in list(self._roots):
            self.record_process_exit(pid)

    # ---------------------------------------------------------- internals

    def _progress(self, at: float | None = None) -> float:
        """Fresh progress (now, or at `at`): the idle clock restarts. Returns the time."""
        now = self._now() if at is None else at
        if now > self._last_progress:
            self._last_progress = now
        op = self._open
        if op is not None:
            op.activity_since += 1
        return now

    def _on_sample(self, root: int, figures: Process) -> None:
        """The sampler's figures for one of the run's trees (on the trio thread)."""
        if self._stopped or root not in self._roots:
            return
        self._figures[root] = figures
        self._sampled_at = trio.current_time()
        if figures.working:
            self._win_other += 1
            self._progress(trio.current_time() - figures.idle)

    def _rel(self, t: float | None) -> float | None:
        """A trio time as seconds since the run started (None stays None)."""
        return None if t is None else round(t - self._start, 3)

    def _look(self, trigger: Trigger) -> None:
        if self._stopped or self._kill is not None or self._judging:
            return
        now = trio.current_time()
        if trigger == "poll" and not self._dirty and now < self._quiet_until:
            return  # nothing new, and the judge said nothing is due before then
        self._judging = True
        acted = False
        try:
            self._dirty = False
            for _ in range(_MAX_VERDICTS_PER_LOOK):
                view = self._view(trigger, now)
                verdict = self._judge.judge(view)
                if verdict is None:
                    self._note_quiet(view)
                    break
                self._apply(verdict, now)
                acted = acted or verdict.action in ("steer", "kill")
                if self._kill is not None:
                    break
            else:
                self._quiet_until = -math.inf
        finally:
            self._judging = False
        if acted and self._wake is not None:
            self._wake()

    def _note_quiet(self, view: RunView) -> None:
        """Remember until when a look with no new evidence would find nothing to do."""
        quiet_until = self._judge_quiet_until
        rel = None if quiet_until is None else quiet_until(view)
        self._quiet_until = -math.inf if rel is None else self._start + rel

    def _view(self, trigger: Trigger, now: float) -> RunView:
        novelty = self._novelty
        dl, bs = self._deadline, self._backstop
        due = (dl is not None and not self._expired and now >= dl
               and (bs is None or dl < bs))
        op = self._open
        if self._model_since is not None:
            in_flight: str | None = "model"
            since = self._model_since
        elif self._tool_since is not None:
            in_flight, since = "tool", self._tool_since
        else:
            in_flight, since = None, now
        return RunView(
            info=self._info, trigger=trigger, elapsed=now - self._start,
            steps=self._steps, tool_calls=self._tool_calls, activity=self._activity,
            idle=now - self._last_progress, soft_timeout=self._soft,
            deadline=None if dl is None else dl - self._start,
            backstop=None if bs is None else bs - self._start, due=due,
            extensions=self._extensions,
            max_steps=(None if self._base_max_steps is None
                       else self._base_max_steps + self._bonus),
            window=Window(self._window_start - self._start, now - self._window_start,
                          self._steps - self._win_steps, self._win_tools, self._win_other),
            calls=() if self._calls is None else tuple(self._calls),
            call_labels=() if self._call_labels is None else tuple(self._call_labels),
            intervention=None if op is None else Intervention(
                op.reason, op.at - self._start, op.delivered and not op.undeliverable,
                op.activity_since,
                op.calls_after_delivery, dict(op.evidence), op.steps_after_delivery,
                op.ends_after_delivery),
            nudges=dict(self._nudges),
            outcomes=() if self._outcomes is None else tuple(self._outcomes),
            reports_results=self._reports_results,
            in_flight=in_flight, in_flight_s=now - since,
            error_streak=self._error_streak, last_error=self._error_text,
            message_streak=self._msg_streak, last_message=self._msg_text,
            empty_answers=self._empty,
            lines=0 if novelty is None else novelty.lines,
            novel_lines=0 if novelty is None else novelty.novel,
            process=_aged(merge(self._figures.values()), now - self._sampled_at),
        )

    def _apply(self, verdict: Decision, now: float) -> None:
        who = type(self._judge).__name__
        if not isinstance(verdict, Decision):
            raise TypeError(f"Judge {who} returned {type(verdict).__name__}, not a Decision")
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
            if self._queue is None:
                self._queue = []
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
        self._win_steps = self._steps
        self._win_tools = self._win_other = 0


def _aged(figures: Process | None, age: float) -> Process | None:
    """`figures` as of `age` seconds after they were sampled: flat that much longer
    (a decision quotes how long the trees had been flat when it was made)."""
    if figures is None or age <= 0:
        return figures
    return dataclasses.replace(figures, idle=figures.idle + age)
