"""The conformance suite of the Audit port, shipped for hosts (`kernel.testing`).

Modelled on trio's `check_one_way_stream`: an implementation passes a
*maker*, an async context manager factory yielding `(audit, reader)`, and
`check_audit(maker)` runs every check, each on a fresh audit::

    @asynccontextmanager
    async def maker():
        async with MyAudit.open(tmp) as audit:
            yield audit, MyReader(audit)

    await check_audit(maker)

Two kinds of check:

- **port checks** (`AUDIT_PORT_CHECKS`) need no reader: they hold for any
  `Audit`, whatever it keeps (a store, spans, nothing): the hot-path recorder
  methods are plain calls that never raise on odd payloads, recorders of
  concurrent runs close independently, a resumed run_id is accepted, a
  kernel run through the audit reports no port failure;
- **store checks** (`AUDIT_STORE_CHECKS`) read back what an analyst would
  see through the reader (`runs` rows and `events` rows, normalised to
  `StoredRun` / `StoredEvent`), so the checks know nothing about the
  storage. An audit that keeps no rows (an exporter) yields `None` as its
  reader and runs `check_audit(maker, stored=False)`.

What the port promises (kernel/ports.py, DESIGN.md "Analysts' schema"):
- `start_run` registers an open run (status NULL) and a `run_start` event, seq 0;
- recorder calls become events with contiguous seq, in call order, with
  their kind, name, iteration, typed duration and a JSON payload (values
  JSON cannot hold are stored as `str(value)`);
- hot-path recorder methods are plain calls, never coroutines;
- `close` appends `run_end` and writes the run's roll-up;
- a run_id that already exists is a resumed run: no second `run_start`,
  its seq continues;
- runs recorded at the same time never mix their events.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Protocol

import trio

from ._loop import Kernel
from ._types import Limits, RunInfo, RunStats, Status, Step, ToolCall, ToolResult, Usage
from .ports import Audit, Ports, RunRecorder

if TYPE_CHECKING:
    from .testing import MemoryAudit


@dataclass
class StoredEvent:
    """One `events` row as the checks compare it."""

    seq: int
    kind: str
    name: str | None
    iteration: int | None
    duration_ms: float | None
    payload: dict[str, Any]
    ts: float


@dataclass
class StoredRun:
    """One `runs` row as the checks compare it (output as stored text)."""

    run_id: str
    name: str
    subject_id: str
    caller_id: str
    channel_id: str
    parent_run_id: str | None
    inputs: dict[str, Any]
    status: str | None
    output: str | None = None
    error: str | None = None
    reason: str | None = None
    steps: int | None = None
    tool_calls: int | None = None
    runtime_seconds: float | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    thinking_tokens: int | None = None
    cost_usd: float | None = None
    exit_code: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class AuditReader(Protocol):
    """Reads back what an implementation stored (after making it durable, if it buffers)."""

    async def runs(self) -> dict[str, StoredRun]: ...

    async def events(self, run_id: str) -> list[StoredEvent]: ...


AuditMaker = Callable[[], AbstractAsyncContextManager[tuple[Audit, AuditReader | None]]]
"""Makes a fresh audit and the reader of what it stores (None: it stores nothing to read)."""

def stored_text(value: Any) -> str | None:
    """How a run's output is stored: strings as-is, JSON values as JSON, else str(value)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple, int, float, bool)):
        return json.dumps(value, default=str, separators=(",", ":"), ensure_ascii=False)
    return str(value)


class MemoryReader:
    """Reads a `kernel.testing.MemoryAudit`."""

    def __init__(self, audit: MemoryAudit) -> None:
        self.audit = audit

    async def runs(self) -> dict[str, StoredRun]:
        """Every run, keyed by run_id."""
        await trio.lowlevel.checkpoint()
        out = {}
        for run_id, row in self.audit.runs.items():
            info, st = row.info, row.stats
            view = StoredRun(run_id, info.name, info.subject_id, info.caller_id, info.channel_id,
                           info.parent_run_id, json.loads(json.dumps(info.inputs, default=str)),
                           None if st is None else str(st.status))
            if st is not None:
                view.output = stored_text(st.output)
                view.error, view.reason = st.error, st.reason
                view.steps, view.tool_calls = st.steps, st.tool_calls
                view.runtime_seconds = st.runtime_seconds
                view.input_tokens = st.usage.input_tokens
                view.output_tokens = st.usage.output_tokens
                view.thinking_tokens = st.usage.thinking_tokens
                view.cost_usd, view.exit_code = st.usage.cost_usd, st.exit_code
            out[run_id] = view
        return out

    async def events(self, run_id: str) -> list[StoredEvent]:
        """The run's events in seq order."""
        await trio.lowlevel.checkpoint()
        return [StoredEvent(e.seq, e.kind, e.name, e.iteration, e.duration_ms, e.payload, e.ts)
                for e in self.audit.events(run_id)]


# ------------------------------------------------------------------ checks

Check = Callable[[AuditMaker], Awaitable[None]]
AUDIT_PORT_CHECKS: list[Check] = []
AUDIT_STORE_CHECKS: list[Check] = []


def _port_check(fn: Check) -> Check:
    AUDIT_PORT_CHECKS.append(fn)
    return fn


def _store_check(fn: Check) -> Check:
    AUDIT_STORE_CHECKS.append(fn)
    return fn


class _Made:
    """What a maker made, with the reader a store check needs."""

    def __init__(self, maker: AuditMaker) -> None:
        self.cm = maker()

    async def __aenter__(self) -> tuple[Audit, AuditReader]:
        audit, reader = await self.cm.__aenter__()
        if reader is None:
            await self.cm.__aexit__(None, None, None)
            raise TypeError("a store check needs a reader: the maker yielded None "
                            "(use check_audit(maker, stored=False) for an audit that "
                            "keeps nothing to read)")
        return audit, reader

    async def __aexit__(self, *exc: Any) -> bool | None:
        return await self.cm.__aexit__(*exc)


async def _started(audit: Audit, info: RunInfo) -> RunRecorder:
    rec = await audit.start_run(info)
    assert rec is not None, f"{type(audit).__name__}.start_run returned None"
    return rec


def _info(**kw: Any) -> RunInfo:
    base: dict[str, Any] = {"name": "conformance", "subject_id": "subj", "caller_id": "alice",
                            "channel_id": "ci", "inputs": {"n": 1, "tags": ["a", "b"]}}
    base.update(kw)
    return RunInfo(**base)


def _assert_contiguous(events: list[StoredEvent]) -> None:
    assert [e.seq for e in events] == list(range(len(events))), [e.seq for e in events]


@_store_check
async def check_start_run_opens_a_run(maker: AuditMaker) -> None:
    """start_run registers an open run (no status) and a run_start event at seq 0."""
    async with _Made(maker) as (audit, reader):
        info = _info(parent_run_id="f" * 32)
        rec = await audit.start_run(info)
        assert rec is not None
        run = (await reader.runs())[info.run_id]
        assert run.status is None
        assert (run.name, run.subject_id, run.caller_id, run.channel_id, run.parent_run_id) == (
            "conformance", "subj", "alice", "ci", "f" * 32)
        assert run.inputs == {"n": 1, "tags": ["a", "b"]}
        events = await reader.events(info.run_id)
        assert [(e.seq, e.kind, e.name) for e in events] == [(0, "run_start", "conformance")]
        assert events[0].payload["inputs"] == {"n": 1, "tags": ["a", "b"]}
        await rec.close(RunStats(Status.OK))


@_store_check
async def check_recorder_calls_become_events_in_order(maker: AuditMaker) -> None:
    """Each recorder call is one event, seq contiguous in call order, fields preserved."""
    async with _Made(maker) as (audit, reader):
        info = _info()
        rec = await audit.start_run(info)
        assert rec is not None
        call = ToolCall("grep", {"pattern": "x"}, id="c1")
        rec.log_event("tool_start", name="grep", payload={"args": {"pattern": "x"}},
                      iteration=0)
        rec.on_tool(ToolResult(call, output="3 matches", duration_s=0.25), 0)
        rec.on_tool(ToolResult(call, error="boom", duration_s=0.5), 0)
        rec.on_step(0, Step(output="hello", tool_calls=[call], name="turn",
                            payload={"model": "m1"}), 1.5)
        rec.log_event("state_enter", name="build", payload={"attempt": 2}, duration_ms=12.5,
                      iteration=1)
        rec.log_event("checkpoint")
        rec.log_error("it broke", payload={"where": "step"})
        await rec.close(RunStats(Status.ERROR, error="it broke", steps=1, tool_calls=2,
                                 runtime_seconds=2.0))
        events = await reader.events(info.run_id)
        _assert_contiguous(events)
        assert [e.kind for e in events] == ["run_start", "tool_start", "tool_end", "tool_end",
                                            "step", "state_enter", "checkpoint", "error",
                                            "run_end"]
        ts = [e.ts for e in events]
        assert ts == sorted(ts)
        start, ok, bad, step, state, cp, err = events[1:8]
        assert (start.name, start.iteration, start.payload) == (
            "grep", 0, {"args": {"pattern": "x"}})
        assert (ok.name, ok.iteration, ok.payload) == (
            "grep", 0, {"output": "3 matches", "error": None})
        assert math.isclose(ok.duration_ms or 0, 250.0)
        assert bad.payload == {"output": None, "error": "boom"}
        assert math.isclose(bad.duration_ms or 0, 500.0)
        assert (step.name, step.iteration) == ("turn", 0)
        assert math.isclose(step.duration_ms or 0, 1500.0)
        assert step.payload == {"final": False, "tool_calls": 1, "output": "hello",
                                "model": "m1"}
        assert (state.name, state.iteration, state.duration_ms, state.payload) == (
            "build", 1, 12.5, {"attempt": 2})
        assert (cp.name, cp.iteration, cp.duration_ms, cp.payload) == (
            None, None, None, {})
        assert err.payload == {"message": "it broke", "where": "step"}


@_port_check
async def check_hot_path_methods_are_plain_calls(maker: AuditMaker) -> None:
    """on_step, on_tool, log_event and log_error are synchronous and return None."""
    async with maker() as (audit, _):
        rec = await audit.start_run(_info())
        assert rec is not None
        for method in (rec.on_step, rec.on_tool, rec.log_event, rec.log_error):
            assert not inspect.iscoroutinefunction(method), method
        call = ToolCall("t")
        assert rec.on_step(0, Step(), 0.0) is None  # type: ignore[func-returns-value]
        assert rec.on_tool(ToolResult(call), 0) is None  # type: ignore[func-returns-value]
        assert rec.log_event("log") is None  # type: ignore[func-returns-value]
        assert rec.log_error("x") is None  # type: ignore[func-returns-value]
        assert inspect.iscoroutinefunction(rec.close)
        await rec.close(RunStats(Status.OK))


@_store_check
async def check_close_writes_the_rollup(maker: AuditMaker) -> None:
    """close appends run_end (name = status) and fills the run's row."""
    async with _Made(maker) as (audit, reader):
        info = _info()
        rec = await audit.start_run(info)
        assert rec is not None
        rec.on_step(0, Step(output="x", final=True), 0.1)
        await rec.close(RunStats(
            Status.KILLED, output={"answer": 42}, error="killed by the critic: looping",
            reason="looping", steps=7, tool_calls=3, runtime_seconds=12.5,
            usage=Usage(input_tokens=100, output_tokens=20, thinking_tokens=5, cost_usd=0.25),
            exit_code=137))
        run = (await reader.runs())[info.run_id]
        assert run.status == "killed"
        assert run.output == '{"answer":42}'
        assert (run.error, run.reason) == ("killed by the critic: looping", "looping")
        assert (run.steps, run.tool_calls, run.exit_code) == (7, 3, 137)
        assert math.isclose(run.runtime_seconds or 0, 12.5)
        assert (run.input_tokens, run.output_tokens, run.thinking_tokens) == (100, 20, 5)
        assert math.isclose(run.cost_usd or 0, 0.25)
        end = (await reader.events(info.run_id))[-1]
        assert (end.kind, end.name) == ("run_end", "killed")
        assert end.payload == {"status": "killed", "reason": "looping",
                               "error": "killed by the critic: looping"}
        assert math.isclose(end.duration_ms or 0, 12500.0)


class _Opaque:
    def __str__(self) -> str:
        return "<opaque thing>"


@_store_check
async def check_payloads_that_are_not_json_are_stored_as_text(maker: AuditMaker) -> None:
    """Values JSON cannot hold are stored as str(value); tuples become lists."""
    async with _Made(maker) as (audit, reader):
        info = _info()
        rec = await audit.start_run(info)
        assert rec is not None
        when = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
        rec.log_event("log", payload={"path": PurePosixPath("/tmp/x"), "when": when,
                                      "pair": (1, 2), "nested": {"obj": _Opaque()},
                                      "text": "naïve ☃"})
        await rec.close(RunStats(Status.OK, output=_Opaque()))
        log = (await reader.events(info.run_id))[1]
        assert log.payload == {"path": "/tmp/x", "when": str(when), "pair": [1, 2],
                               "nested": {"obj": "<opaque thing>"}, "text": "naïve ☃"}
        run = (await reader.runs())[info.run_id]
        assert run.output == "<opaque thing>"


@_store_check
async def check_a_resumed_run_continues_its_seq(maker: AuditMaker) -> None:
    """Starting a run_id that exists writes no second run_start; seq continues; close updates."""
    async with _Made(maker) as (audit, reader):
        info = _info()
        first = await audit.start_run(info)
        assert first is not None
        first.on_step(0, Step(), 0.1)
        await first.close(RunStats(Status.CANCELLED, steps=1, reason="shutdown"))
        again = await audit.start_run(info)
        assert again is not None
        again.log_event("resumed", payload={"steps": 1})
        again.on_step(1, Step(output="done", final=True), 0.1)
        await again.close(RunStats(Status.OK, output="done", steps=2))
        events = await reader.events(info.run_id)
        _assert_contiguous(events)
        assert [e.kind for e in events] == ["run_start", "step", "run_end", "resumed", "step",
                                            "run_end"]
        runs = await reader.runs()
        assert len([r for r in runs if r == info.run_id]) == 1
        assert (runs[info.run_id].status, runs[info.run_id].steps) == ("ok", 2)


@_store_check
async def check_concurrent_runs_keep_their_events_apart(maker: AuditMaker) -> None:
    """Interleaved recorders of several runs each get their own contiguous seq."""
    async with _Made(maker) as (audit, reader):
        infos = [_info(name=f"run{i}") for i in range(5)]
        recs = [await audit.start_run(i) for i in infos]
        for round_ in range(20):
            for i, rec in enumerate(recs):
                assert rec is not None
                rec.log_event("tick", payload={"run": i, "round": round_})

        async def close(rec: Any, i: int) -> None:
            await rec.close(RunStats(Status.OK, steps=i))

        async with trio.open_nursery() as nursery:
            for i, rec in enumerate(recs):
                nursery.start_soon(close, rec, i)
        runs = await reader.runs()
        for i, info in enumerate(infos):
            events = await reader.events(info.run_id)
            _assert_contiguous(events)
            ticks = [e.payload for e in events if e.kind == "tick"]
            assert ticks == [{"run": i, "round": r} for r in range(20)]
            assert runs[info.run_id].steps == i


@_store_check
async def check_a_kernel_run_is_recorded_end_to_end(maker: AuditMaker) -> None:
    """A kernel run with a tool call and a critic kill leaves the expected trail."""
    from .testing import ScriptedAgent, ScriptedCritic

    async with _Made(maker) as (audit, reader):
        async def lookup(key: str) -> str:
            await trio.lowlevel.checkpoint()
            return key.upper()

        # Steps take a little time so the watch task (polling every 10 ms)
        # sees the kill before the step ceiling is reached.
        agent = ScriptedAgent([Step(tool_calls=[ToolCall("lookup", {"key": "k"})]),
                               Step(output="more")], then=Step(), tools={"lookup": lookup},
                              step_seconds=0.02)
        critic = ScriptedCritic(kill_at_step=2, reason="looping on lookup")
        info = _info()
        result = await Kernel(Ports(audit=audit, critic=critic)).run(
            agent, info, Limits(max_steps=200, timeout=60, poll_interval=0.01))
        assert result.status is Status.KILLED
        assert result.port_failures == []
        events = await reader.events(info.run_id)
        _assert_contiguous(events)
        kinds = [e.kind for e in events]
        assert kinds[:4] == ["run_start", "step", "tool_start", "tool_end"]
        assert kinds[-1] == "run_end"
        kills = [e for e in events if e.kind == "critic"]
        assert [(k.name, k.payload.get("reason")) for k in kills] == [
            ("kill", "looping on lookup")]
        tool_end = events[3]
        assert (tool_end.name, tool_end.payload["output"]) == ("lookup", "K")
        run = (await reader.runs())[info.run_id]
        assert (run.status, run.steps, run.tool_calls, run.reason) == (
            "killed", result.steps, 1, "looping on lookup")


@_store_check
async def check_an_agent_that_raises_is_recorded(maker: AuditMaker) -> None:
    """An agent exception becomes an error event and an `error` run with the message."""
    from .testing import ScriptedAgent

    async with _Made(maker) as (audit, reader):
        info = _info()
        result = await Kernel(Ports(audit=audit)).run(
            ScriptedAgent([Step(), ValueError("bad input")]), info, Limits(timeout=60))
        assert result.status is Status.ERROR
        events = await reader.events(info.run_id)
        _assert_contiguous(events)
        assert [e.kind for e in events] == ["run_start", "step", "error", "run_end"]
        assert "bad input" in events[2].payload["message"]
        run = (await reader.runs())[info.run_id]
        assert run.status == "error"
        assert run.error == "ValueError: bad input"


@_port_check
async def check_odd_payloads_never_raise(maker: AuditMaker) -> None:
    """Recorder calls take any payload (none, empty, not JSON, huge) without raising."""
    async with maker() as (audit, _):
        rec = await _started(audit, _info())
        huge = "x" * (4 << 20)
        rec.log_event("log")
        rec.log_event("log", payload={})
        rec.log_event("log", payload={"big": huge, "obj": _Opaque(), "set": {1, 2},
                                      "bytes": b"\x00\xff", "nan": math.nan})
        rec.on_step(0, Step(output=huge, payload={"obj": _Opaque()}), -1.0)
        rec.on_tool(ToolResult(ToolCall("t", {"obj": _Opaque()}), output=_Opaque()), 0)
        rec.log_error(huge, payload={"obj": _Opaque()})
        await rec.close(RunStats(Status.OK, output=huge))


@_port_check
async def check_concurrent_recorders_close_independently(maker: AuditMaker) -> None:
    """Recorders of interleaved runs each take their calls and close concurrently."""
    async with maker() as (audit, _):
        recs = [await _started(audit, _info(name=f"run{i}")) for i in range(5)]
        for round_ in range(10):
            for i, rec in enumerate(recs):
                rec.log_event("tick", payload={"run": i, "round": round_})
                rec.on_step(round_, Step(), 0.001)
        async with trio.open_nursery() as nursery:
            for i, rec in enumerate(recs):
                nursery.start_soon(rec.close, RunStats(Status.OK, steps=i))


@_port_check
async def check_a_resumed_run_id_is_accepted(maker: AuditMaker) -> None:
    """start_run with the run_id of a closed run (a resumption) records it again."""
    async with maker() as (audit, _):
        info = _info()
        first = await _started(audit, info)
        first.on_step(0, Step(), 0.1)
        await first.close(RunStats(Status.CANCELLED, steps=1, reason="shutdown"))
        again = await _started(audit, info)
        again.log_event("resumed", payload={"steps": 1})
        await again.close(RunStats(Status.OK, steps=2))


@_port_check
async def check_a_kernel_run_reports_no_port_failure(maker: AuditMaker) -> None:
    """A kernel run with tool calls, a steer and a critic kill ends killed, the audit silent."""
    from .testing import ScriptedAgent, ScriptedCritic

    async with maker() as (audit, _):
        async def lookup(key: str) -> str:
            await trio.lowlevel.checkpoint()
            return key.upper()

        agent = ScriptedAgent([Step(tool_calls=[ToolCall("lookup", {"key": "k"}, "c1")]),
                               Step(tool_calls=[ToolCall("lookup", {"key": "j"}, "c2")])],
                              then=Step(), tools={"lookup": lookup}, step_seconds=0.02)
        critic = ScriptedCritic(steer_at_step={1: "keep going"}, kill_at_step=3,
                                reason="enough")
        result = await Kernel(Ports(audit=audit, critic=critic)).run(
            agent, _info(), Limits(max_steps=200, timeout=60, poll_interval=0.01))
        assert result.status is Status.KILLED, result
        assert result.port_failures == [], result.port_failures


async def check_audit(maker: AuditMaker, *, stored: bool = True) -> None:
    """Run the conformance suite against the implementation `maker` makes.

    Args:
        maker: Makes a fresh audit and its reader, one pair per check.
        stored: Also run the store checks (`AUDIT_STORE_CHECKS`), which read
            back through the reader; False for an audit that keeps nothing to
            read (its maker yields None as the reader).

    Raises:
        AssertionError: A check failed; the message says what was expected.
    """
    for fn in AUDIT_CHECKS if stored else AUDIT_PORT_CHECKS:
        await fn(maker)


#: Every check: the port checks, then the store checks.
AUDIT_CHECKS: list[Check] = [*AUDIT_PORT_CHECKS, *AUDIT_STORE_CHECKS]
