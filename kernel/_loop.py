"""The run loop: one agent, one nursery, one cancel scope, exactly one status.

The flow of `Kernel.run` (DESIGN.md "The kernel loop")::

    budget.check(caller)               refused -> budget_exceeded, no step runs
        (or check_run(info, resumed=...) when the budget has it: SupportsRunBudget)
    recorder = audit.start_run(info)
    handle   = critic.monitor(info, soft_timeout, backstop=..., ...)
    with CancelScope(deadline=backstop):          # one scope per run, not per step
        the kernel's watcher (one task for all runs, only with a critic) looks at
            the handle when it asks; a kill cause cancels the scope as `killed`,
            a passed critic deadline as `timeout`
        step loop: ceiling, steer, agent.step, tools, record, usage, checkpoint
    finally, shielded and bounded: handle.stop, checkpoint complete/fail,
        budget.commit, delivery.deliver, port failures as audit events, recorder.close

Why the status is decided the way it is: trio tells us *that* our scope was
cancelled (`cancelled_caught`), not *why*. So whoever cancels the scope
first writes the why (`_end`), and the backstop is the only cancel source
that writes nothing; its expiry therefore reads as `timeout`. A `Cancelled`
that escapes our scope belongs to an outer scope: the caller cancelled, the
run ends `cancelled`, finalization still runs (shielded), and the exception
is re-raised unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import traceback
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import trio

from ._capabilities import NO_HANDLE, agent_capabilities, handle_capabilities
from ._context import RunContext
from ._types import (
    Limits,
    Message,
    PortFailure,
    Result,
    RunInfo,
    Status,
    Step,
    ToolCall,
    ToolResult,
    Usage,
    UsageLimits,
)
from ._watch import Watcher
from .errors import ConfigError
from .ports import (
    Agent,
    Audit,
    Budget,
    BudgetRefused,
    Checkpoint,
    Checkpointer,
    Critic,
    CriticHandle,
    Delivery,
    Ports,
    RunRecorder,
    takes_resumed,
)

# Library code logs through the standard `logging` module under `kernel.*`; the
# package puts a NullHandler on "kernel", so nothing is printed unless the host
# configures logging (the CLI sends these to stderr).
_log = logging.getLogger("kernel")

try:  # trio's real-time clock: a step under it is timed with `time.perf_counter`
    from trio._core._run import SystemClock as _SystemClock

    _SYSTEM_CLOCK: type | None = _SystemClock
except ImportError:  # pragma: no cover - a trio that moved it: its clock times steps
    _SYSTEM_CLOCK = None

# Statuses after which a checkpoint is kept for `kernel recover` rather than failed.
_RESUMABLE = frozenset({Status.CANCELLED})
_COMPLETE = frozenset({Status.OK, Status.HANDOFF, Status.DRY_RUN})


class _NullRecorder:
    """The recorder used when there is no audit: every call is a no-op."""

    def on_step(self, iteration: int, step: Step, duration_s: float) -> None:
        pass

    def on_tool(self, result: ToolResult, iteration: int) -> None:
        pass

    def log_event(self, kind: str, **_: Any) -> None:
        pass

    def log_error(self, message: str, **_: Any) -> None:
        pass

    async def close(self, stats: Any) -> None:
        pass


_NULL_RECORDER = _NullRecorder()
# Shared by every run until it needs its own (never appended to: see `_Run.fault`).
_NO_FAILURES: list[PortFailure] = []
_NO_USAGE = Usage()


class Kernel:
    """Runs agents against a set of ports.

    Build one per host and reuse it. Each run resolves the ports once, when
    it starts, and keeps them to its end: assigning `kernel.ports` (or one of
    its fields) takes effect for the runs started afterwards, never for a
    run in flight. A Kernel serves one `trio.run` at a time (its watcher is a
    task of that run; one after another is fine): a host running trio in
    several threads at once makes one Kernel per thread.

    Args:
        ports: The host's wiring. None (or `Ports()`) gives a bounded,
            in-memory run: no audit, no budget, no critic, no checkpoints.
    """

    def __init__(self, ports: Ports | None = None) -> None:
        self.ports = ports if ports is not None else Ports()
        # One task follows every watched run of this kernel (see `_watch.py`).
        self._watcher = Watcher()
        self._last_caps: tuple[Limits, UsageLimits, bool] | None = None
        self._active: set[str] = set()  # the run ids running now (a second is refused)
        self._clock: tuple[trio.abc.Clock, Callable[[], float], Callable[[], float],
                           float] | None = None

    def _clock_now(self) -> tuple[Callable[[], float], Callable[[], float], float]:
        """The current trio clock's `current_time`, one bound method per clock (not per run),
        what times a step, and what to add to a tick for trio time: `time.perf_counter`
        and the clock's offset under trio's own clock (its `current_time` is that fixed
        offset plus `perf_counter`, so differences are equal, for a C call instead of a
        Python method: two a step), else `current_time` itself and 0 (a virtual clock
        in tests)."""
        clock = trio.lowlevel.current_clock()
        last = self._clock
        if last is None or last[0] is not clock:
            now = clock.current_time
            offset = getattr(clock, "offset", None)
            if type(clock) is _SYSTEM_CLOCK and isinstance(offset, float):
                last = (clock, now, time.perf_counter, offset)
            else:
                last = (clock, now, now, 0.0)
            self._clock = last
        return last[1], last[2], last[3]

    @property
    def ports(self) -> Ports:
        """The ports the next run starts with (see the class docstring)."""
        return self._ports

    @ports.setter
    def ports(self, ports: Ports) -> None:
        if not isinstance(ports, Ports):
            raise TypeError(f"Kernel.ports must be a Ports, got {type(ports).__name__}")
        self._ports = ports

    def _caps(self, limits: Limits) -> tuple[UsageLimits, bool]:
        """A run's usage caps from its (frozen) `Limits`, and whether any is set.

        Remembered for the last `Limits` seen: runs of a host mostly share one.
        """
        last = self._last_caps
        if last is not None and last[0] is limits:
            return last[1], last[2]
        caps = _merge_caps(limits, None)
        capped = caps != _NO_CAPS
        self._last_caps = (limits, caps, capped)
        return caps, capped

    def run(
        self,
        agent: Agent,
        info: RunInfo | None = None,
        limits: Limits | None = None,
        *,
        resume: Checkpoint | None = None,
    ) -> Coroutine[Any, Any, Result]:
        """Run `agent` to exactly one terminal status and return the `Result`.

        Use it as a coroutine function: `result = await kernel.run(agent)`, or
        `nursery.start_soon(kernel.run, agent)`. Nothing runs until it is awaited.

        Unlike most failures, which end up on the result, an outer
        cancellation propagates: the run is recorded `cancelled`, its audit
        row closed, and then the `trio.Cancelled` is re-raised.

        Args:
            agent: Anything with `async def step(self, ctx) -> Step`.
            info: Who and what the run is; a fresh `RunInfo()` if None.
            limits: The run's bounds; `Limits()` defaults if None.
            resume: Continue an interrupted run from this checkpoint (same run_id,
                step count and usage carried on; `ctx.resumed_from` holds its state).
        """
        # Not `async def`: the run's own coroutine is returned, so each resume of a
        # run (one per step) passes through one coroutine fewer, and a run keeps one
        # object fewer for the garbage collector (measured at 10,000 concurrent runs).
        try:
            if resume is not None and not isinstance(resume, Checkpoint):
                raise TypeError(f"resume must be a Checkpoint, not {type(resume).__name__}")
            if info is None:
                # A resumed run is the checkpoint's run: its id, not a fresh one.
                info = RunInfo() if resume is None else RunInfo(run_id=resume.run_id)
            elif not isinstance(info, RunInfo):
                raise TypeError(f"info must be a RunInfo, not {type(info).__name__}")
            if limits is None:
                limits = Limits()
            elif not isinstance(limits, Limits):
                raise TypeError(f"limits must be a Limits, not {type(limits).__name__}")
            if resume is not None and resume.run_id != info.run_id:
                raise ValueError(f"resume: the checkpoint is of run {resume.run_id!r}, not of "
                                 f"{info.run_id!r}: a run resumes from its own checkpoint")
            run = _Run(self, agent, info, limits, resume)
        except Exception as exc:
            return _raising(exc)  # raised when awaited, as from an `async def`
        return run.execute()


class _Run:
    """The state of one run while `Kernel.run` executes it."""

    __slots__ = ("agent", "agent_stopped", "artifacts", "audit", "backstop", "budget", "can",
                 "capped", "caps", "checkpointer", "child_seconds", "child_since",
                 "child_tool_calls", "child_usage", "children", "critic",
                 "ctx", "cut", "delivery", "error", "exit_code", "failures", "finalizing",
                 "first_deadline", "handle", "hooks", "immediate", "in_step", "info", "k",
                 "last_save_steps", "last_save_time", "limits", "next_look", "now", "nursery",
                 "on_steer", "output", "pending_steer", "reason", "recorder", "resume", "scope",
                 "settled", "started", "status", "steering", "steps", "tb", "tick", "tick_offset",
                 "tool_calls", "tools", "usage", "watch_entry")

    def __init__(self, kernel: Kernel, agent: Agent, info: RunInfo, limits: Limits,
                 resume: Checkpoint | None) -> None:
        self.k = kernel
        # The ports, resolved once for the whole run: the loop checks each for None here.
        ports = kernel.ports
        self.audit: Audit | None = ports.audit
        self.budget: Budget | None = ports.budget
        self.critic: Critic | None = ports.critic
        self.checkpointer: Checkpointer | None = ports.checkpointer
        self.delivery: Delivery | None = ports.delivery
        self.agent = agent
        self.info = info
        self.limits = limits
        self.resume = resume
        self.recorder: RunRecorder = _NULL_RECORDER
        self.handle: CriticHandle | None = None
        self.failures: list[PortFailure] = _NO_FAILURES  # a list of its own at the first
        self.status: Status | None = None
        self.finalizing = False  # the end-of-run work has begun
        self.output: Any = None
        self.error: str | None = None
        self.reason: str | None = None
        self.tb: str | None = None
        self.exit_code: int | None = None
        self.steps = resume.steps if resume else 0
        self.tool_calls = resume.tool_calls if resume else 0
        self.usage = resume.usage if resume else _NO_USAGE  # (frozen: shared)
        self.child_usage = _NO_USAGE  # what child runs used: counts against this run's caps
        self.child_tool_calls = 0
        # Seconds during which at least one child run ran (`run_child`): the children's
        # own budget commits count them, so this run's commit does not count them again.
        self.child_seconds = 0.0
        self.children = 0  # child runs running now
        self.child_since = 0.0  # when the running ones started (the first of them)
        self.in_step = False
        self.pending_steer: list[Message] = []
        self.artifacts: dict[str, str | bytes] = {}
        self.can = agent_capabilities(agent)  # tools, on_steer, snapshot, simulate
        self.tools = self.can.tools
        self.hooks = NO_HANDLE  # the critic handle's optional methods, once it has one
        self.started = 0.0
        self.now: Callable[[], float] = trio.current_time  # the run's clock (see `execute`)
        self.tick: Callable[[], float] = trio.current_time  # what times a step (`execute`)
        self.tick_offset = 0.0  # tick + tick_offset: trio time
        # The handle's `step_ended` said it has nothing for the kernel, and nothing has
        # reached the handle since: the step loop skips `kill_cause`, `steer`, `max_steps`.
        self.settled = False
        self.backstop = math.inf
        # When the run's scope is cut: the backstop, or sooner a runtime cap
        # (`max_runtime_seconds`, from the limits or the caller's budget).
        self.cut = math.inf
        self.last_save_steps = self.steps
        self.last_save_time = 0.0
        self.caps, self.capped = kernel._caps(limits)  # capped: False skips the per-step check
        self.ctx: RunContext
        self.scope: trio.CancelScope | None = None  # the run's one cancel scope, once open
        # Kept by the kernel's watcher (`_watch.Watched`).
        self.watch_entry: list[Any] | None = None
        self.immediate = 0  # looks in a row the handle asked for at once
        self.first_deadline: float | None = None  # the critic's deadline at its first look
        self.agent_stopped = False  # the agent ended the run `cancelled` itself (Step.stop)
        self.next_look: Any = None  # the handle's `next_look`, if it has one
        self.on_steer: Any = None  # the agent's `on_steer`, when a critic may nudge mid-step
        self.steering = False  # a mid-step nudge is being delivered
        self.nursery: trio.Nursery | None = None  # for mid-step deliveries (agents with on_steer)

    # ---------------------------------------------------------------- faults

    def fault(self, port: str, method: str, exc: BaseException) -> None:
        """Report a port failure once per (port, method): logged and put on the result."""
        failures = self.failures
        for failure in failures:  # a short list: no set kept per run for this
            if failure.method == method and failure.port == port:
                return
        if failures is _NO_FAILURES:
            failures = self.failures = []
        msg = f"{type(exc).__name__}: {exc}"
        failures.append(PortFailure(port, method, msg))
        _log.warning("port failed: %s.%s: %s (run %s)", port, method, msg, self.info.run_id,
                     extra={"port": port, "method": method, "error": msg,
                            "run_id": self.info.run_id})

    def _end(self, status: Status, *, error: str | None = None, reason: str | None = None,
             output: Any = None) -> None:
        """Set the terminal status; the first caller wins."""
        if self.status is not None:
            return
        self.status = status
        self.error = error
        self.reason = reason
        if output is not None:
            self.output = output

    # ------------------------------------------------------------- recording

    def log_event(self, kind: str, *, name: str | None = None,
                  payload: Mapping[str, Any] | None = None, duration_ms: float | None = None,
                  iteration: int | None = None) -> None:
        """Append an audit event (observer: a failure is reported, never raised)."""
        try:
            self.recorder.log_event(kind, name=name, payload=payload, duration_ms=duration_ms,
                                    iteration=iteration)
        except Exception as exc:
            self.fault("audit", "log_event", exc)

    def activity(self, kind: str, text: str | None = None) -> None:
        """Something happened inside a step: show it to the critic; a kill takes effect now."""
        handle = self.handle
        if handle is not None:
            self.settled = False
            try:
                if text is None:
                    handle.record_activity(kind)
                else:
                    handle.record_activity(kind, text)
            except Exception as exc:
                self.critic_failed("record_activity", exc)
                return
            self.kill_if_decided()

    def kill_if_decided(self) -> bool:
        """If the critic has decided to kill, end the run `killed` and cancel its scope now.

        Called right after every `record_*` call, from whatever task made it,
        so a verdict reached while recording takes effect at once: the
        agent's step is cancelled at its next checkpoint, and nothing
        recorded later (a final step, a tool result) can turn it into `ok`.
        """
        if not self.killed_now():
            return False
        scope = self.scope
        if scope is not None:
            scope.cancel()
        return True

    def tool_started(self, call: ToolCall, payload: Mapping[str, Any] | None = None,
                     iteration: int | None = None, *, ours: bool = False) -> bool:
        """A tool call is starting: show it to the critic, count it, audit `tool_start`.

        Called for the tools the kernel runs (`ours`) and, through
        `ctx.tool_start`, for tools an agent runs itself (already started:
        always counted and audited). A call of ours that the critic kills the
        run on never starts: it is neither counted nor audited as started (the
        critic's `kill` event carries it as evidence); False then.
        """
        handle = self.handle
        if handle is not None:
            self.settled = False
            try:
                handle.record_tool_start(call)
            except Exception as exc:
                self.critic_failed("record_tool_start", exc)
            if ours and self.handle is not None and self.kill_if_decided():
                return False
        self.tool_calls += 1
        # The step that asked for the call (during a step, `steps` is that step's index;
        # the kernel's own tools run after it was counted, and pass it).
        self.log_event("tool_start", name=call.name,
                       payload={"args": dict(call.args), "id": call.id, **(payload or {})},
                       iteration=self.steps if iteration is None else iteration)
        if not ours and handle is not None and self.handle is not None:
            self.kill_if_decided()
        return True

    def report_usage(self, usage: Usage) -> None:
        """`ctx.report_usage`: usage a step consumed before returning, counted now; a cap
        it exceeds ends the run `budget_exceeded` and cancels its scope at once."""
        if not isinstance(usage, Usage):
            raise TypeError(f"report_usage takes a Usage, not {type(usage).__name__}")
        problem = _malformed(Step(usage=usage))
        if problem is not None:
            raise ValueError(f"report_usage: {problem}")
        self.usage = self.ctx.usage = self.usage + usage
        if not self.capped or self.status is not None:
            return
        exceeded = self.usage_exceeded()
        if exceeded is not None:
            name, detail = exceeded
            self._end(Status.BUDGET_EXCEEDED,
                      error=f"usage limit {name} exceeded ({detail})", reason=name)
            scope = self.scope
            if scope is not None:
                scope.cancel()

    def agent_tool_ended(self, result: ToolResult) -> None:
        """An agent reports the outcome of a tool call it ran itself (`ctx.tool_end`)."""
        record, handle = self.hooks.record_tool_end, self.handle
        if handle is None or record is None:
            return
        self.settled = False
        try:
            record(handle, result)
        except Exception as exc:
            self.critic_failed("record_tool_end", exc)
            return
        self.kill_if_decided()

    def tool_ended(self, result: ToolResult, iteration: int) -> None:
        """A tool call finished: show its outcome to the critic, then audit it."""
        handle = self.handle
        if handle is not None:
            record = self.hooks.record_tool_end
            if record is not None:
                self.settled = False
                try:
                    record(handle, result)
                except Exception as exc:
                    self.critic_failed("record_tool_end", exc)
        try:
            self.recorder.on_tool(result, iteration)
        except Exception as exc:
            self.fault("audit", "on_tool", exc)
        if handle is not None and self.handle is not None:
            self.kill_if_decided()

    def critic_failed(self, method: str, exc: BaseException) -> None:
        """A failing critic is dropped; the hard backstop stays in charge."""
        self.fault("critic", method, exc)
        self.handle = None

    def effective_deadline(self) -> float:
        handle = self.handle
        if handle is None:
            return self.backstop
        self.settled = False  # (`deadline()` may judge)
        try:
            dl = handle.deadline()
        except Exception as exc:
            self.critic_failed("deadline", exc)
            return self.backstop
        return self.backstop if dl is None else min(dl, self.backstop)

    # ------------------------------------------------------------------- run

    async def execute(self) -> Result:
        info, limits = self.info, self.limits
        # The run's clock, read directly: what `trio.current_time()` returns, without
        # its lookups (the step loop reads it twice a step).
        now, self.tick, self.tick_offset = self.k._clock_now()
        self.now = now
        self.started = now()
        if limits.timeout is not None:
            self.backstop = self.started + limits.timeout
        self.last_save_time = self.started
        self.ctx = RunContext(self, info, limits, started_at=self.started,
                              resumed_from=self.resume.state if self.resume else None)
        self.ctx.usage = self.usage
        active = self.k._active
        if info.run_id in active:
            # Two runs writing one id would each corrupt the other's record.
            self._end(Status.ERROR, error=f"run_id {info.run_id!r} is already running in this "
                                          "kernel: a run id names one run")
            return self.result()
        active.add(info.run_id)
        try:
            refused = await self.open_run()
        except BaseException as exc:
            if not _only_cancelled(exc):
                active.discard(info.run_id)
                raise
            # Cancelled before the first step (in the budget check or audit start):
            # still close whatever was opened, then let the Cancelled go on.
            self._end(Status.CANCELLED, reason="cancelled by the caller")
            await self.finalize(commit_budget=False)
            raise

        if refused == "taken":
            active.discard(info.run_id)
            return self.result()
        if refused:
            # A run the budget admitted is settled (at what it used: nothing).
            return await self.finalize(commit_budget=refused == "admitted")

        if self.critic is not None:
            try:
                self.handle = self.critic.monitor(
                    info, limits.soft_timeout,
                    backstop=None if math.isinf(self.backstop) else self.backstop,
                    max_steps=limits.max_steps, events=self)
            except Exception as exc:
                self.fault("critic", "monitor", exc)
            if self.handle is not None:
                self.hooks = handle_capabilities(self.handle)
                if self.hooks.problem is not None:
                    self.critic_failed("monitor", TypeError(self.hooks.problem))

        self.cut = self.backstop
        runtime_cap = self.caps.max_runtime_seconds
        if runtime_cap is not None and self.started + runtime_cap < self.cut:
            # A runtime cap holds mid-step too (a step that runs for an hour), not only
            # when the step returns: the scope is cut when it runs out.
            self.cut = self.started + runtime_cap
        pending: BaseException | None = None
        result: Result | None = None
        try:
            with trio.CancelScope(deadline=self.cut) as scope:
                self.scope = scope
                if self.handle is not None:
                    self.start_watch()
                try:
                    if self.on_steer is not None:
                        async with trio.open_nursery() as nursery:
                            self.nursery = nursery
                            await self.loop()
                            nursery.cancel_scope.cancel()
                    else:
                        await self.loop()
                finally:
                    self.nursery = None
                    if self.watch_entry is not None:
                        assert self.k._watcher is not None
                        self.k._watcher.unregister(self)
                if not scope.cancel_called:
                    # The run ended by itself: its scope, shielded and given the
                    # finalization's bound, serves as the finalization's (a second
                    # scope per run costs about as much as ten bare steps).
                    scope.shield = True
                    scope.deadline = self.now() + limits.finalize_timeout
                    result = self.result()
                    await self.close_books(result, commit_budget=True)
            if result is not None:
                if scope.cancelled_caught:
                    self.finalize_timed_out()
                return result
            if scope.cancelled_caught and self.status is None:
                # Nobody recorded why: only the scope's deadline cancels without a word.
                if self.cut < self.backstop:
                    cap = self.caps.max_runtime_seconds
                    self._end(Status.BUDGET_EXCEEDED, reason="max_runtime_seconds",
                              error=f"usage limit max_runtime_seconds exceeded (limit {cap:g}, "
                                    f"used {self.now() - self.started:.1f})")
                else:
                    self._end(Status.TIMEOUT,
                              reason=f"hard timeout of {limits.timeout:g}s expired")
        except BaseException as exc:
            if not _only_cancelled(exc):
                # Ctrl-C in the host (`cancelled`, as the CLI's), or a bug of ours (`error`):
                # still close the books.
                if _interrupted(exc):
                    self._end(Status.CANCELLED, reason="interrupted (KeyboardInterrupt)")
                else:
                    self._end(Status.ERROR, error=f"{type(exc).__name__}: {exc}")
                if not self.finalizing:
                    await self.finalize(commit_budget=True)
                raise
            pending = exc
            self._end(Status.CANCELLED, reason="cancelled by the caller")
        result = await self.finalize(commit_budget=True)
        if pending is not None:
            raise pending
        return result

    async def run_child(self, agent: Agent, info: RunInfo, limits: Limits | None) -> Result:
        """Run a sub-agent as a child run of this one (same kernel, parent_run_id set).

        The caller's `info` is not changed: the child runs with a copy that
        carries `parent_run_id` (and this run's `caller_id` if it has none).
        The child is held to what is left of this run's usage caps, and what
        it uses counts against them once it ends (its own `runs` row keeps
        its own usage).
        """
        info = dataclasses.replace(
            info, parent_run_id=self.info.run_id, caller_id=info.caller_id or self.info.caller_id,
            # (the parent's own info passed on: the child is another run, with an id of its own)
            run_id=info.run_id if info.run_id != self.info.run_id else RunInfo().run_id)
        if limits is None:
            remaining = self.effective_deadline() - trio.current_time()
            limits = self.limits if math.isinf(remaining) else dataclasses.replace(
                self.limits, timeout=max(remaining, 1e-3))
        if self.capped:
            limits = self.child_caps(limits)
        self.log_event("child_start", name=info.name, payload={"child_run_id": info.run_id},
                       iteration=self.steps)
        if not self.children:
            self.child_since = self.now()
        self.children += 1
        try:
            result = await self.k.run(agent, info, limits)
        finally:
            self.children -= 1
            if not self.children:
                self.child_seconds += self.now() - self.child_since
        self.child_usage += result.usage
        self.child_tool_calls += result.tool_calls
        ended: dict[str, Any] = {"child_run_id": info.run_id, "status": str(result.status)}
        if result.reason:
            ended["reason"] = result.reason
        if result.error:
            ended["error"] = result.error
        self.log_event("child_end", name=info.name, payload=ended,
                       duration_ms=result.runtime_seconds * 1000, iteration=self.steps)
        return result

    def child_caps(self, limits: Limits) -> Limits:
        """`limits` tightened to what is left of this run's usage caps.

        A cap already used up leaves the child none (0 tokens or tool calls,
        a vanishing cost), so its first step that uses any ends it
        `budget_exceeded`. Budget caps on steps and runtime are the child's
        own budget check's business (it checks its caller like any run).
        """
        caps, used = self.caps, self.usage + self.child_usage
        tool_calls = self.tool_calls + self.child_tool_calls

        def left(cap: float | None, spent: float) -> float | None:
            return None if cap is None else max(cap - spent, 0)

        cost = left(caps.max_cost_usd, used.cost_usd)
        return dataclasses.replace(
            limits,
            max_tool_calls=_tighter(limits.max_tool_calls, left(caps.max_tool_calls, tool_calls)),
            max_input_tokens=_tighter(limits.max_input_tokens,
                                      left(caps.max_input_tokens, used.input_tokens)),
            max_output_tokens=_tighter(limits.max_output_tokens,
                                       left(caps.max_output_tokens, used.output_tokens)),
            max_total_tokens=_tighter(limits.max_total_tokens,
                                      left(caps.max_total_tokens, used.total_tokens)),
            max_cost_usd=_tighter(limits.max_cost_usd,
                                  None if cost is None else max(cost, 1e-12)))

    async def open_run(self) -> str | None:
        """The audit's start, then the budget check; None when the run may go, else
        "refused" (by the budget, or a check that failed), "admitted" (the budget let
        it in, but it cannot be held to its cost cap: its agent cannot price its calls)
        or "taken" (the audit refused it: its id already names a run).

        The start first: with stores that share a journal, the run's row and
        `run_start` then ride in the budget's reservation, durable before the
        agent's first step (a supervisor killed in the run's first second
        leaves the run on record), at no extra write.
        """
        info, limits = self.info, self.limits
        refused: str | None = None
        budget_cost: float | None = None  # the cost left in the caller's budget, if capped
        audit = self.audit
        if audit is not None:
            try:
                if takes_resumed(audit):  # SupportsResumedStart
                    told: Any = audit
                    rec = await told.start_run(info, resumed=self.resume is not None)
                else:
                    rec = await audit.start_run(info)
                if rec is not None:
                    self.recorder = rec
            except ConfigError as exc:
                # The audit refused the run (its id already names a run): nothing of it
                # is recorded, nothing runs, and no port hears of it (`taken`): the
                # checkpointer's and budget's rows under that id are the other run's.
                self._end(Status.ERROR, error=str(exc))
                return "taken"
            except Exception as exc:
                self.fault("audit", "start_run", exc)
        if self.budget is not None:
            try:
                check_run = getattr(self.budget, "check_run", None)
                if check_run is not None:  # SupportsRunBudget
                    caps = await check_run(info, resumed=self.resume is not None)
                else:
                    caps = await self.budget.check(info.caller_id)
                if caps is not None and not isinstance(caps, UsageLimits):
                    method = "check_run" if check_run is not None else "check"
                    raise TypeError(f"Budget {type(self.budget).__name__}.{method} returned "
                                    f"{type(caps).__name__}, not UsageLimits or None")
                self.caps = _merge_caps(limits, caps)
                self.capped = self.caps != _NO_CAPS
                budget_cost = None if caps is None else caps.max_cost_usd
            except BudgetRefused as exc:
                refused = "refused"
                self._end(Status.BUDGET_EXCEEDED, error=str(exc) or "budget refused",
                          reason="budget refused")
            except Exception as exc:
                # Deciders fail closed.
                refused = "refused"
                self.fault("budget", "check", exc)
                self._end(Status.BUDGET_EXCEEDED,
                          error=f"budget check failed: {type(exc).__name__}: {exc}",
                          reason="budget check failed")
        if refused is None and self.caps.max_cost_usd is not None:
            unpriced = getattr(self.agent, "unpriced", None)  # SupportsPricing
            if isinstance(unpriced, str) and unpriced:
                refused = "admitted"
                cap = (f"its caller {info.caller_id!r} has a cost budget "
                       f"(${budget_cost:.4g} left)" if budget_cost is not None else
                       f"it has a cost cap (Limits.max_cost_usd ${self.caps.max_cost_usd:.4g})")
                self._end(Status.BUDGET_EXCEEDED, reason="cost cannot be known", error=(
                    f"this run cannot be bounded by cost: {cap}, and {unpriced}"))
        if self.resume is not None:
            # Saves happen after every step by default, so what runs next is
            # the step that was in flight when the process died: it runs again.
            state = self.resume.state
            where = state.get("state") if isinstance(state, Mapping) else None
            self.log_event("resumed", name=where if isinstance(where, str) else None,
                           payload={"steps": self.steps, "rerun_step": self.steps,
                                    "state": where if isinstance(where, str) else None})
        return refused

    def __call__(self, kind: str, *, name: str | None = None,
                 payload: Mapping[str, Any] | None = None) -> None:
        """The critic's `EventSink`: the run itself (a bound method would be one more
        object per run for the collector)."""
        self.log_event(kind, name=name, payload=payload, iteration=self.steps)

    async def loop(self) -> None:
        agent, ctx, limits, now = self.agent, self.ctx, self.limits, self.tick
        if self.can.problem is not None:
            self.recorder_error(self.can.problem)
            self._end(Status.ERROR, error=self.can.problem)
            return
        if limits.dry_run:
            await self.dry_run()
            return
        base_ceiling = ceiling = limits.max_steps
        # `SupportsFixedCeiling`: the agent's ceiling is not the critic's to raise.
        raisable = getattr(agent, "fixed_max_steps", False) is not True
        step_ended = self.hooks.step_ended  # None: `record_step`, and ask after each step
        offset = self.tick_offset
        while True:
            if self.status is not None:
                return  # killed while the last step was being recorded
            handle = self.handle
            if handle is not None and not self.settled:
                # (Settled: the handle said after the last step that nothing changed, and
                # nothing reached it since: the same ceiling, no message, no kill cause.)
                ceiling = base_ceiling
                try:
                    raised = handle.max_steps()
                    if raised is not None and type(raised) is not int:
                        raise TypeError(f"max_steps() returned {raised!r}, not an int or None")
                except Exception as exc:
                    self.critic_failed("max_steps", exc)
                else:
                    if raised is not None and raised > 0 and raisable:
                        ceiling = raised
            elif handle is None:
                ceiling = base_ceiling
            if ceiling is not None and self.steps >= ceiling:
                self._end(Status.MAX_STEPS, reason=f"step ceiling of {ceiling} reached")
                return
            # Messages for this step: queued ones, then the critic's.
            steer = self.pending_steer
            if steer:
                self.pending_steer = []
            if handle is not None and not self.settled:
                try:
                    more = handle.steer()
                    if more and not (isinstance(more, list)
                                     and all(isinstance(m, Message) for m in more)):
                        raise TypeError(f"steer() returned {type(more).__name__}, "
                                        "not a list of Message")
                except Exception as exc:
                    self.critic_failed("steer", exc)
                else:
                    if more:
                        steer = [*steer, *more]
            ctx.steer = steer
            if steer:
                self.log_event("steer", payload={"messages": [m.content for m in steer],
                                                 "delivered": "next_step"},
                               iteration=self.steps)
            iteration = ctx.iteration = self.steps
            t0 = now()
            self.in_step = True
            try:
                step = await agent.step(ctx)
            except BudgetRefused as exc:
                # A budget refused what the step needed (a child run it started): the
                # run's own refusal, as if `Budget.check` had refused the run.
                self.in_step = False
                self.steps += 1
                why = str(exc) or "budget refused"
                self.recorder_error(f"budget refused: {why}")
                self._end(Status.BUDGET_EXCEEDED, error=why, reason="budget refused")
                return
            except Exception as exc:
                self.in_step = False
                self.tb = traceback.format_exc()
                self.steps += 1
                self.recorder_error(f"agent raised {type(exc).__name__}: {exc}")
                self._end(Status.ERROR, error=f"{type(exc).__name__}: {exc}")
                return
            self.in_step = False
            if not isinstance(step, Step):
                self.steps += 1
                msg = (f"agent {type(agent).__name__} returned "
                       f"{type(step).__name__}, not a Step")
                self.recorder_error(msg)
                self._end(Status.ERROR, error=msg)
                return
            self.steps += 1
            if (step.usage is not None or step.exit_code is not None or step.artifacts
                    or step.tool_calls):
                problem = _malformed(step)
                if problem is not None:
                    msg = f"agent {type(agent).__name__} returned a malformed Step: {problem}"
                    self.recorder_error(msg)
                    self._end(Status.ERROR, error=msg)
                    return
                if step.usage is not None:
                    self.usage = ctx.usage = self.usage + step.usage
                if step.exit_code is not None:
                    self.exit_code = step.exit_code
                if step.artifacts:
                    self.artifacts.update(step.artifacts)
            t1 = now()
            if t1 + offset >= self.cut and not step.final:
                # Past the hard deadline: a step that never awaits (or blocks the
                # thread) gave trio no checkpoint to cancel it at. This one does. Not
                # after a final step: the run ends here anyway, and its result stands
                # (a command that had exited when the deadline came, its leftovers
                # holding its pipes, returns its own status: ShellAgent's stop_after_exit;
                # cancelled here, its step went unrecorded and the run ended timeout).
                await trio.lowlevel.checkpoint()
            if handle is not None and self.handle is not None:
                try:
                    if step_ended is not None:
                        self.settled = step_ended(handle, iteration, step, t1 + offset) is True
                    else:
                        handle.record_step(iteration, step)
                except Exception as exc:
                    self.critic_failed("step_ended" if step_ended else "record_step", exc)
            try:
                self.recorder.on_step(iteration, step, t1 - t0)
            except Exception as exc:
                self.fault("audit", "on_step", exc)

            if step.final:
                if self.handle is not None and not self.settled and self.killed_now():
                    # A kill verdict reached during the step (or on it) wins over
                    # whatever the step says: it is never lost to a quick finish.
                    self.output = step.output
                    return
                if step.kill is not None:
                    self._end(Status.KILLED, reason=step.kill, output=step.output,
                              error=step.error or f"killed by the agent: {step.kill}")
                elif step.error is not None:
                    self._end(Status.ERROR, error=step.error, output=step.output)
                elif step.handoff is not None:
                    self._end(Status.HANDOFF, reason="handoff", output=step.handoff)
                elif step.stop is not None:
                    # The agent's own stop: over, not interrupted (nothing to resume).
                    self.agent_stopped = True
                    self._end(Status.CANCELLED, reason=step.stop, output=step.output)
                elif self.capped and (exceeded := self.usage_exceeded(final=True)) is not None:
                    # Caps are checked after every step, the last one too: an answer that
                    # cost more than the run was allowed is over budget (its output kept).
                    name, detail = exceeded
                    self._end(Status.BUDGET_EXCEEDED, output=step.output,
                              error=f"usage limit {name} exceeded ({detail})", reason=name)
                else:
                    self._end(Status.OK, output=step.output)
                self.output = step.output if step.handoff is None else step.handoff
                return
            self.output = step.output
            if self.handle is not None and not self.settled and self.killed_now():
                return
            if step.tool_calls:
                cap = self.caps.max_tool_calls
                used = self.tool_calls + self.child_tool_calls
                if cap is not None and used + len(step.tool_calls) > cap:
                    self._end(Status.BUDGET_EXCEEDED,
                              error=f"usage limit max_tool_calls={cap} "
                                    f"exceeded ({used} used, "
                                    f"{len(step.tool_calls)} more asked)",
                              reason="max_tool_calls")
                    return
                if self.checkpointer is not None:
                    # The turn that asked for the tools is saved before they run: a
                    # run interrupted while they run resumes knowing it asked (its
                    # agent can say they were interrupted), instead of asking again
                    # for tools that may already have had their effect.
                    await self.maybe_checkpoint(force=True, counts=False)
                ctx.tool_results = await self.run_tools(step.tool_calls, iteration)
                if self.status is not None:
                    return
            elif ctx.tool_results:
                ctx.tool_results = []
            exceeded = self.usage_exceeded() if self.capped else None
            if exceeded is not None:
                name, detail = exceeded
                self._end(Status.BUDGET_EXCEEDED,
                          error=f"usage limit {name} exceeded ({detail})", reason=name)
                return
            if self.checkpointer is not None:
                await self.maybe_checkpoint()

    def killed_now(self) -> bool:
        """Ask the critic between steps/tools, so a kill takes effect at once."""
        handle = self.handle
        if handle is None:
            return False
        try:
            cause = handle.kill_cause()
        except Exception as exc:
            self.critic_failed("kill_cause", exc)
            return False
        if not cause:
            return False
        self._end(Status.KILLED, reason=str(cause), error=f"killed by the critic: {cause}")
        return True

    def recorder_error(self, message: str) -> None:
        try:
            self.recorder.log_error(message)
        except Exception as exc:
            self.fault("audit", "log_error", exc)

    def usage_exceeded(self, *, final: bool = False) -> tuple[str, str] | None:
        """The first cap the run's usage is over, as (name, detail); None if none.

        `final`: after the last step, where the step budget (`max_steps`, the
        steps a run may take) used up exactly is not exceeded.
        """
        caps, u = self.caps, self.usage + self.child_usage if self.child_usage else self.usage
        checks: tuple[tuple[str, float | None, float], ...] = (
            ("max_input_tokens", caps.max_input_tokens, u.input_tokens),
            ("max_output_tokens", caps.max_output_tokens, u.output_tokens),
            ("max_total_tokens", caps.max_total_tokens, u.total_tokens),
            ("max_cost_usd", caps.max_cost_usd, u.cost_usd),
            ("max_runtime_seconds", caps.max_runtime_seconds,
             trio.current_time() - self.started),
        )
        for name, limit, used in checks:
            if limit is not None and used > limit:
                return name, f"limit {limit:g}, used {used:g}"
        if caps.max_steps is not None and (
                self.steps > caps.max_steps if final else self.steps >= caps.max_steps):
            return "max_steps", f"budget of {caps.max_steps} steps used up"
        return None

    async def run_tools(self, calls: Any, iteration: int) -> list[ToolResult]:
        results: list[ToolResult] = []
        timeout = self.limits.tool_timeout
        for call in calls:
            if not isinstance(call, ToolCall):
                call = ToolCall(name=str(call))
            if self.status is not None:
                return results  # killed while recording the previous call: start nothing
            if not self.tool_started(call, iteration=iteration, ours=True):
                return results  # killed on seeing it (a looping call): it never starts
            if self.status is not None:
                return results
            fn = self.tools.get(call.name)
            t0 = self.now()
            if fn is None:
                known = ", ".join(sorted(self.tools)) or "none"
                result = ToolResult(call, error=f"unknown tool {call.name!r} (available: {known})")
            else:
                output: Any = None
                error: str | None = None
                with trio.move_on_after(math.inf if timeout is None else timeout) as cs:
                    try:
                        output = await fn(**call.args)
                    except Exception as exc:
                        error = f"{type(exc).__name__}: {exc}"
                if cs.cancelled_caught:
                    error = f"tool {call.name!r} timed out after {timeout:g}s"
                result = ToolResult(call, output=output, error=error,
                                    duration_s=self.now() - t0)
            results.append(result)
            self.tool_ended(result, iteration)
        return results

    async def checkpoint_now(self) -> None:
        """`ctx.checkpoint()`: save now, mid-step, whatever the throttle says."""
        if self.checkpointer is not None and not self.limits.dry_run:
            await self.maybe_checkpoint(force=True)

    async def maybe_checkpoint(self, *, force: bool = False, counts: bool = True) -> None:
        """Save if one is due (or `force`); `counts`: the save resets the interval
        (not for the save before a step's tools, which the step's own save follows)."""
        lim = self.limits
        now = self.now()
        due = self.steps - self.last_save_steps >= lim.checkpoint_every_steps and (
            now - self.last_save_time >= lim.checkpoint_every_seconds)
        if not (due or force):
            return
        snapshot = self.can.snapshot
        if snapshot is None:
            return
        try:
            state = snapshot()
        except Exception as exc:
            self.fault("agent", "snapshot", exc)
            return
        cp = Checkpoint(self.info.run_id, self.steps, state, self.usage, self.tool_calls)
        assert self.checkpointer is not None
        try:
            await self.checkpointer.save(cp)
        except Exception as exc:
            self.fault("checkpointer", "save", exc)
            return
        if counts:
            self.last_save_steps, self.last_save_time = self.steps, now
        self.log_event("checkpoint", payload={"steps": self.steps}, iteration=self.steps - 1)

    async def dry_run(self) -> None:
        simulate = self.can.simulate
        try:
            if simulate is not None:
                output = await simulate(self.ctx)
            else:
                output = f"dry run: would step {type(self.agent).__name__}"
        except Exception as exc:
            self.tb = traceback.format_exc()
            self._end(Status.ERROR, error=f"{type(exc).__name__}: {exc}")
            return
        self._end(Status.DRY_RUN, output=output)
        self.output = output

    # ----------------------------------------------------------------- watch

    def start_watch(self) -> None:
        """Hand the run to the kernel's watcher (the run's scope is open).

        The watcher looks at the handle at the handle's `next_look()` (the
        next moment a rule could fire; every `Limits.poll_interval` for a
        handle without it) or the critic's deadline, whichever is first, and
        at once when the handle wakes it through `attach`. An agent with
        `on_steer` gets a nursery for mid-step deliveries.
        """
        handle = self.handle
        assert handle is not None and self.k._watcher is not None
        self.next_look = self.hooks.next_look
        attach = self.hooks.attach
        if attach is not None:
            try:
                attach(handle, self.wake_watch)
            except Exception as exc:
                self.critic_failed("attach", exc)
                return
        self.on_steer = self.can.on_steer
        # The first look is made here, so the watcher's task wakes only when a
        # rule can next fire (most runs end before that, and never wake it).
        at = self.look(trio.current_time())
        if at is not None:
            self.k._watcher.register(self, at)

    def look(self, now: float) -> float | None:
        """One look at the handle, by the watcher: act, then say when to look next.

        Order: `deadline()` first (a critic may judge and extend there), then
        `kill_cause()`, then, during a step, `steer()` for agents that take
        nudges mid-step. A kill cause or a passed deadline cancels the scope
        and ends the watching (None); so does a passed backstop (trio has
        cancelled the scope: the run is on its way out).
        """
        handle = self.handle
        if handle is None:
            return None  # the critic failed; the backstop is in charge
        self.settled = False  # (`deadline()` may judge)
        try:
            dl = handle.deadline()
            cause = handle.kill_cause()
            if dl is not None and (not isinstance(dl, (int, float)) or dl != dl):
                raise TypeError(f"deadline() returned {dl!r}, not a time or None")
        except Exception as exc:
            self.critic_failed("deadline/kill_cause", exc)
            return None
        scope = self.scope
        assert scope is not None
        if cause:
            self._end(Status.KILLED, reason=str(cause), error=f"killed by the critic: {cause}")
            scope.cancel()
            return None
        if self.first_deadline is None:
            self.first_deadline = dl
        if dl is not None and now >= dl and dl < self.backstop:
            self._end(Status.TIMEOUT, reason=self.deadline_reason(dl))
            scope.cancel()
            return None
        if now >= self.cut:
            # The hard deadline (or the runtime cap) has passed: trio has cancelled the
            # run's scope, and the run is unwinding (a command that ignores SIGTERM gets
            # its grace before SIGKILL). No look can change that, and a deadline already
            # passed must not be looked at again "at once" (that was a busy loop for the
            # whole grace).
            return None
        if self.on_steer is not None and self.in_step and not self.steering:
            self.steer_mid_step(handle)
            if self.handle is None:
                return None
        next_look = self.next_look
        if next_look is None:
            wake = now + self.limits.poll_interval
        else:
            try:
                nl = next_look(handle)
            except Exception as exc:
                self.critic_failed("next_look", exc)
                return None
            wake = math.inf if nl is None else nl
        if dl is not None and dl < wake:
            wake = dl  # (after the checks above, a deadline still here is in the future)
        if wake <= now:
            # Asked to look again at once: allowed a few times in a row (a rounding
            # hair before a clock rule), then it waits a poll.
            self.immediate += 1
            wake = now + (1e-6 if self.immediate <= 3 else self.limits.poll_interval)
        else:
            self.immediate = 0
        return wake

    def deadline_reason(self, dl: float) -> str:
        """Why the run ends `timeout` at the critic's deadline `dl` (before the backstop).

        Only what the kernel saw: when the deadline fell, and whether it was
        the one the critic first gave (a critic says why it stopped extending
        in its own audit events).
        """
        first = self.first_deadline
        at = f"the critic's deadline passed at {dl - self.started:.1f}s"
        if first is None or dl <= first:
            return f"{at} (the critic did not extend it)"
        return (f"{at} (the critic had extended it from {first - self.started:.1f}s, "
                "then let it stand)")

    def watch_failed(self, exc: Exception) -> None:
        """A look raised (a bug of ours or the critic's): drop the critic for this run."""
        self.critic_failed("watch", exc)

    def wake_watch(self) -> None:
        """Have the watcher look at this run now (the critic has something to act on)."""
        watcher = self.k._watcher
        if watcher is not None and self.watch_entry is not None:
            watcher.wake(self)

    def process_started(self, pid: int) -> None:
        """An adapter started a process for this run: the critic may sample it."""
        self._process_hook(self.hooks.record_process, "record_process", pid)

    def process_exited(self, pid: int) -> None:
        """A process an adapter started for this run has exited."""
        self._process_hook(self.hooks.record_process_exit, "record_process_exit", pid)

    def _process_hook(self, fn: Callable[[Any, int], None] | None, method: str, pid: int) -> None:
        handle = self.handle
        if handle is None or fn is None:
            return
        self.settled = False
        try:
            fn(handle, pid)
        except Exception as exc:
            self.critic_failed(method, exc)

    def steer_mid_step(self, handle: CriticHandle) -> None:
        """Drain the critic's nudges and deliver them now, from a task of the run's nursery.

        One delivery at a time; the watcher looks again when it is done.
        """
        try:
            msgs = handle.steer()
        except Exception as exc:
            self.critic_failed("steer", exc)
            return
        if not msgs:
            return
        self.log_event("steer", payload={"messages": [m.content for m in msgs],
                                         "delivered": "mid_step"}, iteration=self.steps)
        nursery = self.nursery
        assert nursery is not None
        self.steering = True
        nursery.start_soon(self.deliver_steer, msgs)

    async def deliver_steer(self, msgs: list[Message]) -> None:
        try:
            await self.on_steer(msgs)
        except Exception as exc:
            self.fault("agent", "on_steer", exc)
            self.pending_steer.extend(msgs)
        finally:
            self.steering = False
        self.wake_watch()

    # -------------------------------------------------------------- finalize

    def result(self) -> Result:
        """The run's `Result` as it stands (finalization adds the runtime)."""
        status = self.status if self.status is not None else Status.ERROR
        if self.failures is _NO_FAILURES:
            # The result's list is the run's from now on: later failures land on both.
            self.failures = []
        return Result(
            status=status, run_id=self.info.run_id, name=self.info.name, output=self.output,
            error=self.error, reason=self.reason, traceback=self.tb, steps=self.steps,
            tool_calls=self.tool_calls, usage=self.usage, exit_code=self.exit_code,
            port_failures=self.failures, artifacts=self.artifacts,
        )

    async def finalize(self, *, commit_budget: bool) -> Result:
        """The shielded, time-bounded end of a run that did not end by itself."""
        result = self.result()
        with trio.CancelScope(shield=True,
                              deadline=self.now() + self.limits.finalize_timeout) as cs:
            await self.close_books(result, commit_budget=commit_budget)
        if cs.cancelled_caught:
            self.finalize_timed_out()
        return result

    def finalize_timed_out(self) -> None:
        self.fault("kernel", "finalize", TimeoutError(
            f"end-of-run work exceeded finalize_timeout={self.limits.finalize_timeout:g}s"))

    async def close_books(self, result: Result, *, commit_budget: bool) -> None:
        """The end of every run, under a shielded, bounded scope: the ports, in order."""
        self.finalizing = True
        self.k._active.discard(self.info.run_id)
        status = result.status
        handle, self.handle = self.handle, None
        if handle is not None:
            try:
                handle.stop()
            except Exception as exc:
                self.fault("critic", "stop", exc)
            # Not kept while the ports below wait (at 10,000 runs closing at once, the
            # collector would carry every stopped handle through its passes).
            del handle
        result.runtime_seconds = self.now() - self.started
        if (self.checkpointer is not None or self.delivery is not None
                or (commit_budget and self.budget is not None)):
            # Bounded to leave the recorder time to close: a port that hangs (a webhook,
            # a budget store) must not leave the run's audit row open.
            left = trio.current_effective_deadline() - trio.current_time()
            with trio.move_on_after(left - min(left / 2, 5.0)) as ports:
                await self.close_ports(result, status, commit_budget=commit_budget)
            if ports.cancelled_caught:
                self.fault("kernel", "finalize", TimeoutError(
                    "the checkpointer, budget and delivery ports did not finish in their "
                    "share of finalize_timeout"))
        # Port failures go in the audit too, before the recorder closes.
        for failure in self.failures:
            if failure.port != "audit":
                self.log_event("port_failure", name=f"{failure.port}.{failure.method}",
                               payload={"port": failure.port, "method": failure.method,
                                        "error": failure.error})
        try:
            await self.recorder.close(result.stats())
        except Exception as exc:
            self.fault("audit", "close", exc)

    async def close_ports(self, result: Result, status: Status, *, commit_budget: bool) -> None:
        """The checkpointer, the budget's commit and the delivery, in that order."""
        cp = self.checkpointer
        if cp is not None:
            try:
                if status in _COMPLETE or self.agent_stopped:
                    await cp.complete(self.info.run_id)
                elif status not in _RESUMABLE:
                    await cp.fail(self.info.run_id, self.error or self.reason or str(status))
            except Exception as exc:
                self.fault("checkpointer", "complete" if status in _COMPLETE else "fail", exc)
        if commit_budget and self.budget is not None:
            # The time its child runs ran is theirs: each commits its own (and its own
            # usage: `self.usage` never holds a child's), so it is not counted twice.
            runtime = result.runtime_seconds
            if self.child_seconds:
                runtime = max(runtime - self.child_seconds, 0.0)
            try:
                commit_run = getattr(self.budget, "commit_run", None)
                if commit_run is not None:  # SupportsRunBudget
                    await commit_run(self.info, runtime, self.usage)
                else:
                    await self.budget.commit(self.info.caller_id, runtime, self.usage)
            except Exception as exc:
                self.fault("budget", "commit", exc)
        if self.delivery is not None:
            try:
                await self.delivery.deliver(result)
            except Exception as exc:
                self.fault("delivery", "deliver", exc)


_NO_CAPS = UsageLimits()


def _tighter(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def _merge_caps(limits: Limits, caps: UsageLimits | None) -> UsageLimits:
    """The run's usage caps: `Limits`' own, tightened by what the budget allows."""
    c = caps if caps is not None else UsageLimits()
    return UsageLimits(
        max_steps=c.max_steps,
        max_tool_calls=_tighter(limits.max_tool_calls, c.max_tool_calls),
        max_input_tokens=_tighter(limits.max_input_tokens, c.max_input_tokens),
        max_output_tokens=_tighter(limits.max_output_tokens, c.max_output_tokens),
        max_total_tokens=_tighter(limits.max_total_tokens, c.max_total_tokens),
        max_cost_usd=_tighter(limits.max_cost_usd, c.max_cost_usd),
        max_runtime_seconds=c.max_runtime_seconds,
    )


async def _raising(exc: Exception) -> Result:
    """A coroutine that raises `exc` (what `Kernel.run` returns if it cannot start a run)."""
    raise exc


def _only_cancelled(exc: BaseException) -> bool:
    """True if `exc` is a `trio.Cancelled` or a group made only of them."""
    if isinstance(exc, trio.Cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        return rest is None
    return False


def _interrupted(exc: BaseException) -> bool:
    """True if `exc` is a KeyboardInterrupt, or a group holding one (Ctrl-C in the host)."""
    if isinstance(exc, KeyboardInterrupt):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return exc.subgroup(KeyboardInterrupt) is not None
    return False


#: Largest token count or exit code a step may report (what a store's integer holds).
_INT_MAX = 2**63 - 1


def _malformed(step: Step) -> str | None:
    """What is wrong with a step's usage, exit code, artifacts or tool calls (None: nothing).

    Checked only for steps that carry any of them: a usage that is not a `Usage` of
    whole, non-negative token counts and a finite, non-negative cost would disable
    the usage caps (NaN is never over a limit) or fail the audit's write.
    """
    usage = step.usage
    if usage is not None:
        if not isinstance(usage, Usage):
            return f"usage is {type(usage).__name__}, not Usage"
        for name in ("input_tokens", "output_tokens", "thinking_tokens"):
            n = getattr(usage, name)
            if type(n) is not int or not 0 <= n <= _INT_MAX:
                return f"usage.{name}={n!r} (a whole number of tokens >= 0)"
        cost = usage.cost_usd
        if type(cost) not in (int, float) or not math.isfinite(cost) or cost < 0:
            return f"usage.cost_usd={cost!r} (a finite amount >= 0)"
    code = step.exit_code
    if code is not None and (type(code) is not int or not -_INT_MAX <= code <= _INT_MAX):
        return f"exit_code={code!r} (an int)"
    if step.artifacts and not isinstance(step.artifacts, Mapping):
        return f"artifacts is {type(step.artifacts).__name__}, not a mapping"
    calls = step.tool_calls
    if calls:
        if not isinstance(calls, (list, tuple)):
            return f"tool_calls is {type(calls).__name__}, not a list of ToolCall"
        for call in calls:
            if not (isinstance(call, ToolCall) and isinstance(call.name, str)
                    and isinstance(call.args, Mapping)):
                return f"tool call {call!r} (a ToolCall with a str name and a mapping of args)"
    return None
