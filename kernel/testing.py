"""Hand-written fakes of every port, for our tests and for hosts testing their wiring.

Each fake implements its port for real, in memory, and records what it was
asked so a test can assert on it::

    audit = MemoryAudit()
    result = await Kernel(Ports(audit=audit)).run(ScriptedAgent([Step(final=True)]))
    assert [e.kind for e in audit.events(result.run_id)] == ["run_start", "step", "run_end"]

These are fakes, not mocks: nothing here patches the kernel.

It also ships the conformance suite of the Audit port (`check_audit`), so a
host can check its own Audit the way the repository checks the memory fake,
the journal audit and the OpenTelemetry audit (see `kernel._audit_conformance`
for what it promises)::

    await check_audit(maker)                  # maker yields (audit, reader)
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from ._context import RunContext
from ._types import (
    Message,
    Result,
    RunInfo,
    RunStats,
    Status,
    Step,
    ToolCall,
    ToolResult,
    Usage,
    UsageLimits,
)
from .errors import ConfigError
from .ports import BudgetRefused, Checkpoint, EventSink

__all__ = [
    "AUDIT_CHECKS",
    "AUDIT_PORT_CHECKS",
    "AUDIT_STORE_CHECKS",
    "AuditEvent",
    "AuditMaker",
    "AuditReader",
    "Check",
    "Hang",
    "MemoryAudit",
    "MemoryReader",
    "MemoryRecorder",
    "RecordingBudget",
    "RecordingCheckpointer",
    "RecordingDelivery",
    "RunRow",
    "ScriptedAgent",
    "ScriptedCritic",
    "ScriptedHandle",
    "StoredEvent",
    "StoredRun",
    "check_audit",
    "stored_text",
]


# ------------------------------------------------------------------ audit


@dataclass(slots=True)
class AuditEvent:
    """One audit event as an analyst would see it in the `events` table."""

    run_id: str
    seq: int
    ts: float
    kind: str
    iteration: int | None = None
    name: str | None = None
    duration_ms: float | None = None
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RunRow:
    """One run as an analyst would see it in the `runs` table."""

    info: RunInfo
    started_at: float
    ended_at: float | None = None
    stats: RunStats | None = None

    @property
    def status(self) -> Status | None:
        """The terminal status, or None while the run is open."""
        return self.stats.status if self.stats else None


def _plain(value: Any) -> Any:
    """Make a payload JSON-plain, as a real store would (round-trip through JSON)."""
    return json.loads(json.dumps(value, default=str))


class MemoryRecorder:
    """The recorder of one run in a `MemoryAudit`."""

    def __init__(self, audit: MemoryAudit, run_id: str) -> None:
        self.audit = audit
        self.run_id = run_id
        self.closed = False

    def _add(self, kind: str, *, name: str | None = None,
             payload: Mapping[str, Any] | None = None, duration_ms: float | None = None,
             iteration: int | None = None) -> None:
        events = self.audit._events.setdefault(self.run_id, [])
        events.append(AuditEvent(self.run_id, len(events), time.time(), kind, iteration, name,
                                 duration_ms, _plain(dict(payload or {}))))

    def on_step(self, iteration: int, step: Step, duration_s: float) -> None:
        """Record a `step` event."""
        payload: dict[str, Any] = {"final": step.final, "tool_calls": len(step.tool_calls)}
        if step.output is not None:
            payload["output"] = step.output
        if step.payload:
            payload.update(step.payload)
        self._add("step", name=step.name, payload=payload, duration_ms=duration_s * 1000,
                  iteration=iteration)

    def on_tool(self, result: ToolResult, iteration: int) -> None:
        """Record a `tool_end` event."""
        self._add("tool_end", name=result.call.name,
                  payload={"output": result.output, "error": result.error},
                  duration_ms=result.duration_s * 1000, iteration=iteration)

    def log_event(self, kind: str, *, name: str | None = None,
                  payload: Mapping[str, Any] | None = None, duration_ms: float | None = None,
                  iteration: int | None = None) -> None:
        """Record any event."""
        self._add(kind, name=name, payload=payload, duration_ms=duration_ms,
                  iteration=iteration)

    def log_error(self, message: str, *, payload: Mapping[str, Any] | None = None) -> None:
        """Record an `error` event."""
        self._add("error", payload={"message": message, **(payload or {})})

    async def close(self, stats: RunStats) -> None:
        """Record `run_end` and the run's roll-up."""
        await trio.lowlevel.checkpoint()
        self._add("run_end", name=str(stats.status),
                  payload={"status": str(stats.status), "reason": stats.reason,
                           "error": stats.error},
                  duration_ms=stats.runtime_seconds * 1000)
        row = self.audit.runs[self.run_id]
        row.stats, row.ended_at = stats, time.time()
        self.closed = True


class MemoryAudit:
    """An Audit that keeps every run and event in memory.

    Attributes:
        runs: run_id -> `RunRow`.
        recorders: Every recorder handed out, in order.
    """

    def __init__(self) -> None:
        self.runs: dict[str, RunRow] = {}
        self._events: dict[str, list[AuditEvent]] = {}
        self.recorders: list[MemoryRecorder] = []

    async def start_run(self, info: RunInfo, *, resumed: bool | None = None) -> MemoryRecorder:
        """Open (or, for a resumed run, reopen) the run and write `run_start`.

        Raises:
            ConfigError: `resumed=False` (a fresh run) under an id that names a run.
        """
        await trio.lowlevel.checkpoint()
        if resumed is False and info.run_id in self.runs:
            raise ConfigError(f"run_id {info.run_id!r} already names a run: a run id names "
                              "one run (give the new run its own RunInfo)")
        resumed = info.run_id in self.runs
        if not resumed:
            self.runs[info.run_id] = RunRow(info, started_at=time.time())
        rec = MemoryRecorder(self, info.run_id)
        self.recorders.append(rec)
        if not resumed:  # a resumed run continues its seq; the kernel logs `resumed`
            rec._add("run_start", name=info.name,
                     payload={"inputs": info.inputs, "caller_id": info.caller_id})
        return rec

    def events(self, run_id: str) -> list[AuditEvent]:
        """The run's events in seq order."""
        return list(self._events.get(run_id, []))

    def kinds(self, run_id: str) -> list[str]:
        """Just the kinds of the run's events, in order."""
        return [e.kind for e in self._events.get(run_id, [])]


# ----------------------------------------------------------------- critic


class ScriptedHandle:
    """The handle a `ScriptedCritic` gives each run; records everything it is told."""

    def __init__(self, critic: ScriptedCritic, info: RunInfo, soft_timeout: float | None,
                 backstop: float | None, max_steps: int | None, events: EventSink) -> None:
        self.critic = critic
        self.info = info
        self.soft_timeout = soft_timeout
        self.backstop = backstop
        self.base_max_steps = max_steps
        self.events = events
        self.started = trio.current_time()
        self.steps: list[int] = []
        self.tool_starts: list[ToolCall] = []
        self.tool_ends: list[ToolResult] = []
        self.activities: list[str] = []
        self.texts: list[str | None] = []
        self.processes: list[tuple[str, int]] = []
        self.stopped = False
        self._deadline = (self.started + critic.deadline_after
                          if critic.deadline_after is not None else None)
        self._extensions = list(critic.extensions)
        self._steers = dict(critic.steer_at_step)
        self._timed_steers = dict(critic.steer_after)
        self._killed: str | None = None

    def record_step(self, iteration: int, step: Step) -> None:
        """Count the step; a kill or steer cued on it becomes due."""
        self.steps.append(iteration)
        if self.critic.kill_at_step is not None and len(self.steps) >= self.critic.kill_at_step:
            self._kill()

    def record_tool_start(self, call: ToolCall) -> None:
        """Remember the call; a kill cued on this tool's name fires."""
        self.tool_starts.append(call)
        if self.critic.kill_at_tool is not None and call.name == self.critic.kill_at_tool:
            self._kill()

    def record_tool_end(self, result: ToolResult) -> None:
        """Remember the outcome."""
        self.tool_ends.append(result)

    def record_process(self, pid: int) -> None:
        """Remember a process the run started."""
        self.processes.append(("start", pid))

    def record_process_exit(self, pid: int) -> None:
        """Remember a process the run saw exit."""
        self.processes.append(("exit", pid))

    def record_activity(self, kind: str, text: str | None = None) -> None:
        """Remember the activity; a kill cued on this kind fires."""
        self.activities.append(kind)
        self.texts.append(text)
        if self.critic.kill_at_activity is not None and kind == self.critic.kill_at_activity:
            self._kill()

    def steer(self) -> list[Message]:
        """Messages cued for steps already taken."""
        due = [k for k in self._steers if k <= len(self.steps)]
        msgs = [Message("user", self._steers.pop(k)) for k in sorted(due)]
        elapsed = trio.current_time() - self.started
        for t in sorted(t for t in self._timed_steers if t <= elapsed):
            msgs.append(Message("user", self._timed_steers.pop(t)))
        for m in msgs:
            self.events("critic", name="steer", payload={"message": m.content})
        return msgs

    def deadline(self) -> float | None:
        """The scripted deadline, extended by any extensions now due."""
        now = trio.current_time()
        while self._extensions and now - self.started >= self._extensions[0][0]:
            _, by = self._extensions.pop(0)
            if self._deadline is not None:
                self._deadline += by
                self.events("critic", name="extend", payload={"by": by})
        return self._deadline

    def max_steps(self) -> int | None:
        """The scripted ceiling (None defers to the run's limit)."""
        return self.critic.max_steps

    def kill_cause(self) -> str | None:
        """The kill reason once a kill cue has fired."""
        if (self._killed is None and self.critic.kill_after is not None
                and trio.current_time() - self.started >= self.critic.kill_after):
            self._kill()
        return self._killed

    def _kill(self) -> None:
        if self._killed is None:
            self._killed = self.critic.reason
            self.events("critic", name="kill", payload={"reason": self.critic.reason})

    def stop(self) -> None:
        """Mark the handle stopped."""
        self.stopped = True


class ScriptedCritic:
    """A Critic that does exactly what it is told, on cue.

    Args:
        deadline_after: Seconds after monitor() when the critic's deadline falls.
        extensions: (at_seconds, extend_by) pairs applied when deadline() is asked.
        kill_after: Kill when this many seconds have passed.
        kill_at_step: Kill once this many steps have been recorded.
        kill_at_tool: Kill when a call of the tool with this name starts.
        kill_at_activity: Kill when an activity of this kind is recorded.
        reason: The kill reason.
        steer_at_step: {n: message} delivered once n steps have been recorded.
        steer_after: {seconds: message} delivered once that much time has passed.
        max_steps: The step ceiling the handle reports (raise the limit with it).
    """

    def __init__(self, *, deadline_after: float | None = None,
                 extensions: Sequence[tuple[float, float]] = (),
                 kill_after: float | None = None, kill_at_step: int | None = None,
                 kill_at_tool: str | None = None, kill_at_activity: str | None = None,
                 reason: str = "scripted kill",
                 steer_at_step: Mapping[int, str] | None = None,
                 steer_after: Mapping[float, str] | None = None,
                 max_steps: int | None = None) -> None:
        self.deadline_after = deadline_after
        self.extensions = sorted(extensions)
        self.kill_after = kill_after
        self.kill_at_step = kill_at_step
        self.kill_at_tool = kill_at_tool
        self.kill_at_activity = kill_at_activity
        self.reason = reason
        self.steer_at_step = dict(steer_at_step or {})
        self.steer_after = dict(steer_after or {})
        self.max_steps = max_steps
        self.handles: list[ScriptedHandle] = []

    def monitor(self, info: RunInfo, soft_timeout: float | None, *, backstop: float | None,
                max_steps: int | None, events: EventSink) -> ScriptedHandle:
        """Hand out a new `ScriptedHandle`."""
        handle = ScriptedHandle(self, info, soft_timeout, backstop, max_steps, events)
        self.handles.append(handle)
        return handle


# ------------------------------------------------------------------ agent


class Hang:
    """A script item that makes the step sleep forever (until cancelled)."""


StepScript = Step | BaseException | Hang | Callable[[RunContext], Awaitable[Step]]


class ScriptedAgent:
    """An agent that plays back a script, one item per step.

    Items: a `Step` (returned), an exception instance (raised), `Hang()`
    (sleeps until cancelled), or an async callable taking the ctx. After the
    script runs out, `then` is repeated (default: a final Step).

    Attributes:
        seen_steer: Steer messages seen at each step, in order.
        seen_tool_results: Tool results seen at each step.
        mid_step_steer: Messages delivered through `on_steer` during a step.
    """

    def __init__(self, script: Iterable[StepScript] = (), *, then: StepScript | None = None,
                 tools: Mapping[str, Callable[..., Awaitable[Any]]] | None = None,
                 step_seconds: float = 0.0, accept_mid_step_steer: bool = False,
                 snapshot_state: Callable[[], Any] | None = None) -> None:
        self.script = list(script)
        self.then: StepScript = then if then is not None else Step(final=True)
        self.tools = dict(tools or {})
        self.step_seconds = step_seconds
        self.seen_steer: list[list[Message]] = []
        self.seen_tool_results: list[list[ToolResult]] = []
        self.mid_step_steer: list[Message] = []
        self.calls = 0
        self._snapshot = snapshot_state
        if accept_mid_step_steer:
            self.on_steer = self._on_steer

    async def step(self, ctx: RunContext) -> Step:
        """Play the next script item."""
        self.seen_steer.append(list(ctx.steer))
        self.seen_tool_results.append(list(ctx.tool_results))
        item = self.script[self.calls] if self.calls < len(self.script) else self.then
        self.calls += 1
        if self.step_seconds:
            await trio.sleep(self.step_seconds)
        if isinstance(item, Hang):
            await trio.sleep_forever()
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, Step):
            return item
        return await item(ctx)

    async def _on_steer(self, messages: list[Message]) -> None:
        self.mid_step_steer.extend(messages)

    def snapshot(self) -> Any:
        """The resumable state: by default, how many steps were played."""
        return self._snapshot() if self._snapshot else {"calls": self.calls}


# --------------------------------------------------------- budget and co.


class RecordingBudget:
    """A Budget that records checks and commits, and refuses on request.

    Args:
        refuse: If set, `check` raises `BudgetRefused(refuse)`.
        max_runs: Refuse a caller's run once they have committed this many.
        caps: Usage caps `check` hands the kernel for each run.
    """

    def __init__(self, *, refuse: str | None = None, max_runs: int | None = None,
                 caps: UsageLimits | None = None) -> None:
        self.refuse = refuse
        self.max_runs = max_runs
        self.caps = caps
        self.checks: list[str] = []
        self.commits: list[tuple[str, float, Usage]] = []

    async def check(self, caller_id: str) -> UsageLimits | None:
        """Refuse if told to, or when the caller has used up `max_runs`; else return `caps`."""
        await trio.lowlevel.checkpoint()
        self.checks.append(caller_id)
        if self.refuse is not None:
            raise BudgetRefused(self.refuse)
        used = sum(1 for c, _, _ in self.commits if c == caller_id)
        if self.max_runs is not None and used >= self.max_runs:
            raise BudgetRefused(f"caller {caller_id!r} used {used} of {self.max_runs} runs")
        return self.caps

    async def commit(self, caller_id: str, runtime_seconds: float, usage: Usage) -> None:
        """Record the spend."""
        await trio.lowlevel.checkpoint()
        self.commits.append((caller_id, runtime_seconds, usage))


class RecordingCheckpointer:
    """A Checkpointer that keeps every save and knows which runs completed or failed."""

    def __init__(self) -> None:
        self.saves: list[Checkpoint] = []
        self.completed: list[str] = []
        self.failed: list[tuple[str, str]] = []

    async def save(self, checkpoint: Checkpoint) -> None:
        """Keep the checkpoint."""
        await trio.lowlevel.checkpoint()
        self.saves.append(checkpoint)

    async def complete(self, run_id: str) -> None:
        """Record completion."""
        await trio.lowlevel.checkpoint()
        self.completed.append(run_id)

    async def fail(self, run_id: str, error: str) -> None:
        """Record failure."""
        await trio.lowlevel.checkpoint()
        self.failed.append((run_id, error))

    def latest(self, run_id: str) -> Checkpoint | None:
        """The last checkpoint saved for the run, if it is still resumable."""
        if run_id in self.completed or any(r == run_id for r, _ in self.failed):
            return None
        saves = [c for c in self.saves if c.run_id == run_id]
        return saves[-1] if saves else None


class RecordingDelivery:
    """A Delivery that keeps every result it was handed."""

    def __init__(self) -> None:
        self.delivered: list[Result] = []

    async def deliver(self, result: Result) -> None:
        """Keep the result."""
        await trio.lowlevel.checkpoint()
        self.delivered.append(result)


# The Audit conformance suite. Imported last: its checks use the fakes above.
from ._audit_conformance import AUDIT_CHECKS as AUDIT_CHECKS  # noqa: E402
from ._audit_conformance import AUDIT_PORT_CHECKS as AUDIT_PORT_CHECKS  # noqa: E402
from ._audit_conformance import AUDIT_STORE_CHECKS as AUDIT_STORE_CHECKS  # noqa: E402
from ._audit_conformance import AuditMaker as AuditMaker  # noqa: E402
from ._audit_conformance import AuditReader as AuditReader  # noqa: E402
from ._audit_conformance import Check as Check  # noqa: E402
from ._audit_conformance import MemoryReader as MemoryReader  # noqa: E402
from ._audit_conformance import StoredEvent as StoredEvent  # noqa: E402
from ._audit_conformance import StoredRun as StoredRun  # noqa: E402
from ._audit_conformance import check_audit as check_audit  # noqa: E402
from ._audit_conformance import stored_text as stored_text  # noqa: E402
