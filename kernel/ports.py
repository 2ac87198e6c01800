"""The ports: what the kernel needs from the world, as `typing.Protocol` classes.

Hosts wire only the ports they need into `Ports(...)`; a field left `None`
means the port is absent and the kernel uses a do-nothing stand-in, chosen
once when each run starts. Each protocol's docstring says whether it
may block, how it must behave under concurrency, and what happens when it
raises:

- **Observers fail safe** (Audit, RunRecorder, CriticHandle, Checkpointer,
  Delivery, Budget.commit): an exception is logged, reported on
  `Result.port_failures`, and the run goes on with its real status.
- **Deciders fail closed** (Budget.check): an exception refuses the run
  (`budget_exceeded`, the error on the result).

All methods run on the trio thread. "Must not block" means no file, socket
or database I/O inside the call: buffer and flush from a worker thread.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ._dataclass import dataclass
from ._types import (
    Message,
    Result,
    RunInfo,
    RunStats,
    Step,
    ToolCall,
    ToolResult,
    Usage,
    UsageLimits,
)

if TYPE_CHECKING:
    from ._context import RunContext


@runtime_checkable
class Agent(Protocol):
    """Anything the kernel can step: `async def step(self, ctx) -> Step`.

    **Protocol:** `step` performs one unit of work (a model turn, an FSM
    state, a whole command) and returns a `Step`. Raising ends the run
    `error` with the traceback on the result. It must let `trio.Cancelled`
    propagate; the kernel cancels it on timeout, kill or caller cancel.

    Optional capabilities, each a Protocol of its own so a host's type
    checker can check an implementation (`agent: SupportsSnapshot = MyAgent()`,
    or inherit the protocol): `SupportsTools`, `SupportsSteer`,
    `SupportsSnapshot`, `SupportsSimulate`. The kernel looks each one up once,
    when the run starts; a member that is None counts as absent, and one
    that is present but malformed (not callable; `tools` not a mapping)
    ends the run `error` before its first step, naming the agent.
    """

    async def step(self, ctx: RunContext) -> Step: ...


Tool = Callable[..., Awaitable[Any]]
"""A tool: awaited with a `ToolCall`'s args as keyword arguments; its return is the output."""


@runtime_checkable
class SupportsTools(Protocol):
    """An agent whose steps may ask the kernel to run tools (`Step.tool_calls`).

    **Protocol:** `tools` maps a tool name to an async callable. The kernel
    reads the mapping once per run; each call is awaited with the call's
    args as keywords, bounded by `Limits.tool_timeout`. A tool that raises
    gives an error `ToolResult` (the run goes on); a name not in the mapping
    gives one too.
    """

    @property
    def tools(self) -> Mapping[str, Tool]:
        """The tools a step's `tool_calls` may name."""


@runtime_checkable
class SupportsSteer(Protocol):
    """An agent that takes critic nudges *during* a long step.

    **Protocol:** `on_steer` is awaited while a step is in flight (type into
    a pane, write to a process's stdin), from a task in the run's nursery,
    one delivery at a time. It should be quick. Raising is reported on the
    result and the messages wait in `ctx.steer` for the next step, as they
    do for agents without it.
    """

    async def on_steer(self, messages: list[Message]) -> None:
        """Deliver `messages` to the agent now."""


@runtime_checkable
class SupportsSnapshot(Protocol):
    """An agent whose progress can be checkpointed and resumed (`Kernel.run(resume=...)`).

    **Protocol:** `snapshot` returns JSON-serialisable resumable state; it
    is asked for only when a checkpoint save is due, on the trio thread, and
    must not block. If it is a mapping with a string `"state"` (a loop's
    next state), a resumed run's `resumed` audit event is named after it:
    the step that runs again. Raising skips that save (reported on the
    result). A resumed run finds the state in `ctx.resumed_from`.
    """

    def snapshot(self) -> Any:
        """The agent's resumable state now."""


@runtime_checkable
class SupportsSimulate(Protocol):
    """An agent that can say what it would do (`Limits(dry_run=True)`).

    **Protocol:** in a dry run `simulate(ctx)` is awaited instead of any
    step; what it returns is the output of the `dry_run` result. It must
    execute nothing. Raising ends the run `error`.
    """

    async def simulate(self, ctx: RunContext) -> Any:
        """What a run would do, as the dry run's output."""


@runtime_checkable
class SupportsFixedCeiling(Protocol):
    """An agent whose step ceiling is a bound of its own, not the critic's to raise.

    **Protocol:** `fixed_max_steps` True: the run's `Limits.max_steps` holds
    as given; a critic's raised ceiling (`CriticHandle.max_steps()`, for a
    run that is progressing) is not applied. Read once, when the run starts.
    A loop file's `max_iterations` is such a bound (`LoopAgent`).
    """

    @property
    def fixed_max_steps(self) -> bool:
        """True when the step ceiling may not be raised."""


@runtime_checkable
class SupportsPricing(Protocol):
    """An agent that knows whether it can price what its steps use (`Usage.cost_usd`).

    **Protocol:** `unpriced` is None when every model call the agent makes is
    priced, else a short text naming what is not ("model 'm' has no price").
    The kernel reads it once, when a run opens, and only if the run has a
    cost cap (`Limits.max_cost_usd`, or one its budget returns): an unpriced
    agent's calls would cost 0 and the cap would not bound them, so the run
    ends `budget_exceeded` before its first step, saying so. An agent
    without it is taken at its word: its steps' `cost_usd` is what it costs.
    """

    @property
    def unpriced(self) -> str | None:
        """What this agent calls that it cannot price; None when it prices everything."""


class RunRecorder(Protocol):
    """Records the events of one in-flight run, then its terminal roll-up.

    **Protocol:** every method except `close` is on the hot path and *must not
    block*: buffer in memory, write from a worker thread. `close` is awaited
    once, shielded from cancellation and bounded in time, and must make the
    run's rows durable before it returns. Observer: an exception is reported
    on the result and never changes the run's status.
    """

    def on_step(self, iteration: int, step: Step, duration_s: float) -> None:
        """A step finished (`iteration` counts from 0)."""

    def on_tool(self, result: ToolResult, iteration: int) -> None:
        """A tool call finished (`result.call` is the call)."""

    def log_event(
        self,
        kind: str,
        *,
        name: str | None = None,
        payload: Mapping[str, Any] | None = None,
        duration_ms: float | None = None,
        iteration: int | None = None,
    ) -> None:
        """Append a structured event (tool_start, steer, critic, log, adapter kinds)."""

    def log_error(self, message: str, *, payload: Mapping[str, Any] | None = None) -> None:
        """Append an `error` event."""

    async def close(self, stats: RunStats) -> None:
        """Write the run's terminal roll-up and flush everything still buffered."""


class Audit(Protocol):
    """Begins recording runs. If `Ports.audit` is None, audit events are discarded.

    **Protocol:** `start_run` may do I/O (it is awaited before the first step)
    but should be quick. Returning None skips recording this run. Observer:
    raising is reported on the result and the run goes on unrecorded.
    """

    async def start_run(self, info: RunInfo) -> RunRecorder | None:
        """Register the run and return its recorder."""


class SupportsResumedStart(Protocol):
    """An audit told whether a run it starts is a resume (optional, beside `Audit`).

    **Protocol:** when its `start_run` takes a keyword `resumed` (looked up
    once per class, `takes_resumed`), the kernel calls `start_run(info,
    resumed=...)`: True for a run resumed from a checkpoint (its record
    continues), False for a fresh run. A fresh run whose id already names a
    run should be refused with `ConfigError`: the kernel then ends it `error`
    with that message before its first step (and before its budget check),
    and the earlier run's record stays as it was. Any other exception is an
    observer's failure, as for `start_run`. A wrapper of other audits takes
    it and passes it on to those that take it.
    """

    async def start_run(self, info: RunInfo, *,
                        resumed: bool | None = None) -> RunRecorder | None:
        """Register the run (a resume, a fresh run, or None: not said) and return its recorder."""


_TAKES_RESUMED: dict[type, bool] = {}


def takes_resumed(audit: object) -> bool:
    """Whether `audit.start_run` takes `resumed=` (`SupportsResumedStart`), once per class."""
    cls = type(audit)
    found = _TAKES_RESUMED.get(cls)
    if found is None:
        import inspect

        try:
            params = inspect.signature(cls.start_run).parameters  # type: ignore[attr-defined]
        except (AttributeError, TypeError, ValueError):
            params = {}  # type: ignore[assignment]
        param = params.get("resumed")
        found = _TAKES_RESUMED[cls] = param is not None and param.kind in (
            inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return found


class BudgetRefused(Exception):
    """Raised by `Budget.check` to refuse a run; the message says which budget.

    An agent's step may raise it too, when a budget refused what the step needed
    (a child run it started, e.g. a loop's sub-loop): the run ends
    `budget_exceeded` with reason "budget refused" and this message as its error,
    not `error`.
    """


class Budget(Protocol):
    """Gates and meters per-caller resource use. If None, callers are unbounded.

    **Protocol:** `check` is a *decider* and fails closed: raising
    `BudgetRefused` (or anything else) ends the run `budget_exceeded` before a
    step runs. It may return `UsageLimits` (e.g. what is left of the caller's
    daily budget) that cap this run; exceeding one mid-run also ends it
    `budget_exceeded`. `commit` is an observer, awaited (shielded, bounded)
    after every run that passed `check`, whatever its status.
    """

    async def check(self, caller_id: str) -> UsageLimits | None:
        """Allow the run (optionally capped); raise `BudgetRefused` to refuse it."""

    async def commit(self, caller_id: str, runtime_seconds: float, usage: Usage) -> None:
        """Record what the caller spent on one run."""


@runtime_checkable
class SupportsRunBudget(Protocol):
    """A budget that is told which run it gates (optional, beside `Budget`).

    When a budget has these two methods the kernel calls them instead of
    `check` and `commit`, with the run's `RunInfo`, and says whether the run
    is *resumed* from a checkpoint. A resumed run was admitted when it first
    opened: a budget should not count it (or refuse it) as a new run, and
    should settle its spend into what the run first reserved. `commit_run`
    gets the run's usage so far (carried over a resume) and the runtime of
    this session only.
    """

    async def check_run(self, info: RunInfo, *, resumed: bool) -> UsageLimits | None:
        """Allow the run (optionally capped); raise `BudgetRefused` to refuse it."""

    async def commit_run(self, info: RunInfo, runtime_seconds: float, usage: Usage) -> None:
        """Record what this session of the run spent (usage is the run's total so far)."""


class EventSink(Protocol):
    """Where a critic writes its decisions: each call becomes an audit event."""

    def __call__(
        self, kind: str, *, name: str | None = None, payload: Mapping[str, Any] | None = None
    ) -> None: ...


class CriticHandle(Protocol):
    """The kernel's live link to the critic watching one run.

    **Protocol:** the run task calls `record_*`, `steer` and `max_steps`,
    while the kernel's watcher (one task for all the kernel's runs) asks
    `deadline`, `kill_cause` and, during a step, `steer` at the handle's
    `next_look()` (every `Limits.poll_interval` without it); implementations
    must be safe for this interleaved use (on the trio thread; add a lock if
    they share state with threads).
    None of the methods may block. Times are `trio.current_time()` values.
    Observer: if any method raises, the kernel stops consulting the critic
    and the hard backstop stays in charge.

    **Kill at once:** the kernel asks `kill_cause()` right after every
    `record_*` call, from the task that made it. A cause ends the run
    `killed` and cancels its scope there and then: the step in flight is
    cancelled at its next checkpoint, no further tool call starts, and a
    step that finishes without a checkpoint cannot turn the run `ok` (the
    kernel asks again before deciding a final step's status). So
    `kill_cause` must be cheap; judge in `record_*`, not in it.

    **Optional capabilities** (the kernel uses them when present, looked up
    once per run; handles without them keep working), each a Protocol:
    `SupportsToolEnd`, `SupportsProcesses`, `SupportsNextLook`,
    `SupportsAttach`, `SupportsStepEnd`. A member that is present but not callable is a
    critic failure: the kernel stops consulting the critic for that run.
    """

    def record_step(self, iteration: int, step: Step) -> None:
        """A step finished: fresh activity."""

    def record_tool_start(self, call: ToolCall) -> None:
        """A tool call is starting: fresh activity, and evidence for loop detection."""

    def record_activity(self, kind: str, text: str | None = None) -> None:
        """Something happened inside a long step (an output line, an agent event).

        `text` is what it said, when there is something to say (the line, the
        agent's message); the kernel passes it only when the adapter gave one,
        so `record_activity(kind)` stays a valid call.
        """

    def steer(self) -> list[Message]:
        """Drain the messages the critic wants delivered to the agent now."""

    def deadline(self) -> float | None:
        """The current deadline (the critic may extend it); None = only the backstop."""

    def max_steps(self) -> int | None:
        """The current step ceiling; None defers to `Limits.max_steps`."""

    def kill_cause(self) -> str | None:
        """Non-None (the reason) once the critic has decided to kill the run."""

    def stop(self) -> None:
        """The run is over; release anything held."""


@runtime_checkable
class SupportsToolEnd(Protocol):
    """A critic handle that sees tool results, not only tool starts.

    **Protocol:** `record_tool_end` is called when a tool call finished
    (kernel-run, or reported by an agent through `ctx.tool_end`), with its
    output or error: a call repeated with an unchanged result is a loop, a
    changing one is progress. Like `record_*`: must not block.
    """

    def record_tool_end(self, result: ToolResult) -> None:
        """A tool call finished with `result`."""


@runtime_checkable
class SupportsProcesses(Protocol):
    """A critic handle that samples the processes a run starts.

    **Protocol:** called when an adapter reports a process it started or
    that ended (`ctx.process_started` / `ctx.process_exited`); the critic
    may sample its tree (from a thread of its own: these must not block).
    """

    def record_process(self, pid: int) -> None:
        """The run started process `pid`."""

    def record_process_exit(self, pid: int) -> None:
        """Process `pid` of the run has exited."""


@runtime_checkable
class SupportsNextLook(Protocol):
    """A critic handle that says when the kernel's watcher should next look at it.

    **Protocol:** `next_look` returns the trio time of the next moment a rule
    could fire, or None for "not until woken" (see `SupportsAttach`). Without
    it the watcher polls the handle every `Limits.poll_interval`.
    """

    def next_look(self) -> float | None:
        """When (trio time) to consult the handle next; None: not until woken."""


@runtime_checkable
class SupportsAttach(Protocol):
    """A critic handle that can have the watcher look at its run at once.

    **Protocol:** `attach` is called once, when the run is handed to the
    watcher, with a function that has the watcher look at the run at once:
    call it after queuing a nudge for mid-step delivery or deciding a kill
    outside a `record_*` call. It never blocks; call it on the trio thread.
    """

    def attach(self, wake: Callable[[], None]) -> None:
        """Keep `wake` and call it when the watcher should look at the run now."""


@runtime_checkable
class SupportsStepEnd(Protocol):
    """A critic handle that takes a step's end in one call, and says when it has nothing new.

    **Protocol:** when present, the kernel calls `step_ended` instead of
    `record_step`, with `now`, the trio time the step ended (the kernel has
    read the clock already). It returns True when the handle has nothing for
    the kernel: no kill cause, no message waiting to be delivered, and the
    step ceiling `max_steps()` last answered unchanged. The kernel then does
    not ask `kill_cause`, `steer` or `max_steps` again until something else
    reaches the handle: a `record_*` call, a process report, `deadline()` or
    a look by the watcher. False or None: it asks them as it does after
    `record_step`. A handle that decides anything outside these calls (from
    a thread of its own, say) must not return True while it may, or must
    wake its run through `SupportsAttach`. Like `record_*`: must not block.
    """

    def step_ended(self, iteration: int, step: Step, now: float) -> bool | None:
        """A step finished at trio time `now`; True: nothing for the kernel (see above)."""


class Critic(Protocol):
    """Supervises long runs. If `Ports.critic` is None, only the hard backstop applies.

    **Protocol:** `monitor` is called once per run before the first step and
    must not block. `backstop` is the run's hard deadline (absolute trio time,
    None if unbounded): a critic may extend its own deadline up to it, never
    past it. `max_steps` is the run's base step ceiling. Decisions worth an
    audit record go to `events` (kind "critic"). Returning None leaves the
    run unmonitored. Observer: raising is reported and the run goes on.
    """

    def monitor(
        self,
        info: RunInfo,
        soft_timeout: float | None,
        *,
        backstop: float | None,
        max_steps: int | None,
        events: EventSink,
    ) -> CriticHandle | None:
        """Start watching the run described by `info`."""


@dataclass(slots=True, frozen=True)
class Checkpoint:
    """A run's resumable progress as of `steps` completed steps."""

    run_id: str
    steps: int
    state: Any
    usage: Usage = field(default_factory=Usage)
    tool_calls: int = 0


class Checkpointer(Protocol):
    """Persists resumable progress for crash recovery. If None, an interrupted run is lost.

    **Protocol:** `save` is awaited when a save is due (the kernel throttles
    by `Limits.checkpoint_every_*`) and must be durable when it returns.
    `complete` is called when the run ends `ok`/`handoff`/`dry_run`, `fail` on
    any other terminal status except `cancelled`: a run interrupted by
    shutdown keeps its checkpoint so it can be resumed. Observer: raising is
    reported on the result and never changes the status.
    """

    async def save(self, checkpoint: Checkpoint) -> None:
        """Persist `checkpoint` durably."""

    async def complete(self, run_id: str) -> None:
        """The run finished: its checkpoint is no longer needed."""

    async def fail(self, run_id: str, error: str) -> None:
        """The run failed for good: mark its checkpoint as not resumable."""


class Delivery(Protocol):
    """Where a finished run's result goes. If None, the caller reads the `Result`.

    **Protocol:** awaited once per run, shielded and bounded by
    `Limits.finalize_timeout`, after the checkpoint is completed (or failed)
    and the budget committed, and *before* the run's recorder is closed, so
    a delivery failure is in the audit (a `port_failure` event) as well as
    on the result. Observer: it never changes the run's status.
    """

    async def deliver(self, result: Result) -> None:
        """Send the result (and any artifacts) on."""


@dataclass(slots=True)
class Ports:
    """The ports a host wires. Every field is optional.

    A `Kernel` reads them when each run starts (see `Kernel`): changing a
    field affects the runs started afterwards.

    Attributes:
        audit: If None, audit events are discarded.
        budget: If None, callers are unbounded.
        critic: If None, only the hard backstop (`Limits.timeout`) ends a stuck run.
        checkpointer: If None, nothing is saved and an interrupted run is lost.
        delivery: If None, the caller reads the returned `Result`.
    """

    audit: Audit | None = None
    budget: Budget | None = None
    critic: Critic | None = None
    checkpointer: Checkpointer | None = None
    delivery: Delivery | None = None
