"""`RunContext`: what an agent sees of its run at each step."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import trio

from ._types import Limits, Message, Result, RunInfo, ToolCall, ToolResult, Usage


class RunHooks(Protocol):
    """What a `RunContext` calls on the run behind it (the kernel's `_loop._Run`)."""

    def log_event(self, kind: str, *, name: str | None = None,
                  payload: Mapping[str, Any] | None = None, duration_ms: float | None = None,
                  iteration: int | None = None) -> None: ...

    def activity(self, kind: str, text: str | None = None) -> None: ...

    def effective_deadline(self) -> float: ...

    async def run_child(self, agent: Any, info: RunInfo, limits: Limits | None) -> Result: ...

    def tool_started(self, call: ToolCall, payload: Mapping[str, Any] | None = None,
                     iteration: int | None = None) -> bool: ...

    def report_usage(self, usage: Usage) -> None: ...

    def agent_tool_ended(self, result: ToolResult) -> None: ...

    def process_started(self, pid: int) -> None: ...

    def process_exited(self, pid: int) -> None: ...

    async def checkpoint_now(self) -> None: ...


class RunContext:
    """The run as seen from inside `agent.step(ctx)`.

    One object per run, updated in place before each step (no allocation per
    step). Agents read it; they write to the audit and poke the critic only
    through `event` and `activity`.

    Attributes:
        info: The run's `RunInfo`.
        limits: The run's `Limits`.
        iteration: The index of the step being taken, from 0.
        tool_results: Results of the previous step's tool calls, in call order.
        steer: Critic nudges delivered at this step (empty most of the time).
        usage: Usage summed over the steps so far.
        started_at: `trio.current_time()` when the run started.
        resumed_from: Resumable state from a checkpoint when this run is a resumption.
    """

    __slots__ = ("_run", "info", "iteration", "limits", "resumed_from", "started_at", "steer",
                 "tool_results", "usage")

    def __init__(self, run: RunHooks, info: RunInfo, limits: Limits, *, started_at: float,
                 resumed_from: Any = None) -> None:
        self.info = info
        self.limits = limits
        self.started_at = started_at
        self.iteration = 0
        self.tool_results: list[ToolResult] = []
        self.steer: list[Message] = []
        self.usage = Usage()
        self.resumed_from = resumed_from
        # The run behind this context: one reference, not a bound method per
        # callback (at 10,000 concurrent runs each object a run keeps is work for
        # the garbage collector).
        self._run = run

    @property
    def run_id(self) -> str:
        """The run's id."""
        return self.info.run_id

    @property
    def elapsed(self) -> float:
        """Seconds since the run started (trio clock: virtual under a MockClock)."""
        return trio.current_time() - self.started_at

    @property
    def deadline(self) -> float:
        """The run's current effective deadline (trio time; inf when unbounded)."""
        return self._run.effective_deadline()

    def event(
        self,
        kind: str,
        *,
        name: str | None = None,
        payload: Mapping[str, Any] | None = None,
        duration_ms: float | None = None,
        activity: bool = True,
        text: str | None = None,
    ) -> None:
        """Record an adapter event (state_enter, route, output, ...) and count it as activity.

        Never blocks and never raises: the audit buffers it. Pass
        `activity=False` for events that are not signs of life (a nudge that
        could not be delivered, bookkeeping). `text` is what the event said
        (an output line, an agent's message), shown to the critic so it can
        tell new output from the same line again. If the critic decides to
        kill the run on it, the run's scope is cancelled at once: the step's
        next checkpoint raises `trio.Cancelled`.
        """
        run = self._run
        run.log_event(kind, name=name, payload=payload, duration_ms=duration_ms,
                      iteration=self.iteration)
        if activity:
            run.activity(kind, text)

    async def run_child(self, agent: Any, info: RunInfo, limits: Limits | None = None) -> Result:
        """Run `agent` as a child run: same kernel and ports, `parent_run_id` set to this run.

        The child gets its own `runs` row and status; this run records
        `child_start`/`child_end` events. `info` is not changed (the child runs
        with a copy carrying `parent_run_id`). With `limits=None` the child
        inherits this run's limits, bounded by what is left of this run's
        deadline. Either way it is held to what is left of this run's usage
        caps, and what it uses counts against them once it ends.
        """
        return await self._run.run_child(agent, info, limits)

    def report_usage(self, usage: Usage) -> None:
        """Report usage the step has consumed and not yet returned (a CLI agent's model
        turns as they stream), so the run's usage caps and budget bound it at once.

        Added to the run's usage now (`ctx.usage`, the result, the budget's
        settlement, even if the step never returns). If a usage cap is then
        exceeded, the run ends `budget_exceeded` naming it and its scope is
        cancelled, as for a critic kill: the step's next checkpoint raises
        `trio.Cancelled`. A step's `Step.usage` is what it did *not* report:
        usage reported here must not be returned again.

        Raises:
            TypeError: `usage` is not a `Usage`.
            ValueError: A count that is not a whole number >= 0, or a cost that is
                negative, NaN or infinite.
        """
        self._run.report_usage(usage)

    def tool_start(self, call: ToolCall, *, payload: Mapping[str, Any] | None = None) -> None:
        """Report a tool call the agent runs itself (a CLI agent's tool use).

        Audited as `tool_start` (with `payload` merged in), counted in the
        run's tool calls, and shown to the critic, which watches for loops.
        Tools the kernel runs from `Step.tool_calls` are reported already.
        """
        self._run.tool_started(call, payload)

    def tool_end(self, result: ToolResult) -> None:
        """Report the outcome of a tool call the agent ran itself (after `tool_start`).

        Shown to the critic (a call repeated with an unchanged result is a
        loop; a changing one is progress); not audited here (the adapter's
        own events carry it). Tools the kernel runs are reported already.
        """
        self._run.agent_tool_ended(result)

    def process_started(self, pid: int) -> None:
        """Report a process this run started (a command, a tool, a CLI agent).

        The critic samples its whole tree (CPU, I/O, children, a blocked
        terminal read): a working process is not stalled however silent.
        Call `process_exited` when it ends. Never blocks, never raises.
        """
        self._run.process_started(pid)

    def process_exited(self, pid: int) -> None:
        """Report that a process given to `process_started` has exited."""
        self._run.process_exited(pid)

    def activity(self, kind: str = "activity", text: str | None = None) -> None:
        """Tell the critic the agent is alive without writing an audit event.

        `text` (an output line, a streamed chunk, a message) lets the critic
        judge whether it is new; None counts as plain activity.
        """
        self._run.activity(kind, text)

    async def checkpoint(self) -> None:
        """Save the agent's resumable state now, in the middle of a step.

        For agents whose one step is long and learns its resumable state as it
        goes (a CLI agent reports its session id at the start of its one step).
        The kernel asks `agent.snapshot()` and saves it with the step count so
        far, through the same checkpointer as the saves between steps; a run
        without a checkpointer, or an agent without `snapshot()`, saves nothing.
        A failed save is reported like any checkpoint fault and never raises.
        """
        await self._run.checkpoint_now()
