"""Each status is reachable, and the statuses exclude each other (virtual time)."""

from __future__ import annotations

import pytest
import trio

from kernel import Kernel, Limits, Ports, RunInfo, Status, Step, ToolCall, Usage
from kernel.testing import (
    Hang,
    MemoryAudit,
    RecordingBudget,
    RecordingCheckpointer,
    RecordingDelivery,
    ScriptedAgent,
    ScriptedCritic,
)


def all_ports(**over: object) -> Ports:
    ports = Ports(audit=MemoryAudit(), budget=RecordingBudget(),
                  checkpointer=RecordingCheckpointer(), delivery=RecordingDelivery())
    for k, v in over.items():
        setattr(ports, k, v)
    return ports


class TestStatuses:
    async def test_ok(self, autojump_clock: trio.abc.Clock) -> None:
        """A final step ends the run ok with that step's output."""
        ports = all_ports()
        agent = ScriptedAgent([Step(), Step(output="done", final=True)])
        result = await Kernel(ports).run(agent, RunInfo(name="ok"), Limits(max_steps=10))
        assert result.status is Status.OK
        assert result.output == "done" and result.steps == 2
        assert ports.checkpointer.completed == [result.run_id]  # type: ignore[union-attr]
        assert ports.delivery.delivered == [result]  # type: ignore[union-attr]

    async def test_hung_agent_times_out(self, autojump_clock: trio.abc.Clock) -> None:
        """A hung agent with a 30-minute hard timeout ends `timeout` at 30 virtual minutes."""
        audit = MemoryAudit()
        start = trio.current_time()
        result = await Kernel(Ports(audit=audit)).run(
            ScriptedAgent([Hang()]), RunInfo(), Limits(timeout=1800))
        assert result.status is Status.TIMEOUT
        assert trio.current_time() - start == pytest.approx(1800)
        assert "hard timeout" in (result.reason or "")
        assert audit.runs[result.run_id].status is Status.TIMEOUT

    async def test_critic_kill_is_killed_not_timeout(self, autojump_clock: trio.abc.Clock) -> None:
        """A scripted critic kill ends `killed` with its reason, never `timeout`."""
        critic = ScriptedCritic(kill_after=60, reason="stalled")
        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit, critic=critic)).run(
            ScriptedAgent([Hang()]), RunInfo(), Limits(timeout=3600))
        assert result.status is Status.KILLED
        assert result.reason == "stalled"
        assert critic.handles[0].stopped
        assert ("critic", "kill") in [(e.kind, e.name) for e in audit.events(result.run_id)]

    async def test_kill_at_the_backstop_is_still_killed(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A kill decided before the backstop fires wins: killed, not timeout."""
        critic = ScriptedCritic(kill_after=9.9, reason="looping")
        result = await Kernel(Ports(critic=critic)).run(
            ScriptedAgent([Hang()]), RunInfo(), Limits(timeout=10, poll_interval=0.05))
        assert result.status is Status.KILLED

    async def test_critic_deadline_passing_is_timeout(
            self, autojump_clock: trio.abc.Clock) -> None:
        """The critic's own deadline passing without a kill ends `timeout`."""
        critic = ScriptedCritic(deadline_after=30)
        start = trio.current_time()
        result = await Kernel(Ports(critic=critic)).run(
            ScriptedAgent([Hang()]), RunInfo(), Limits(timeout=3600))
        assert result.status is Status.TIMEOUT
        assert trio.current_time() - start == pytest.approx(30)

    async def test_critic_extension_keeps_the_run_alive(
            self, autojump_clock: trio.abc.Clock) -> None:
        """An extended critic deadline lets a slow run finish ok."""
        critic = ScriptedCritic(deadline_after=30, extensions=[(30, 60)])
        agent = ScriptedAgent([Step()] * 5, step_seconds=10)
        result = await Kernel(Ports(critic=critic)).run(agent, RunInfo(), Limits(timeout=3600))
        assert result.status is Status.OK and result.steps == 6

    async def test_outer_cancel(self, autojump_clock: trio.abc.Clock) -> None:
        """An outer cancel ends `cancelled`, still closes the audit row, and re-raises."""
        audit = MemoryAudit()
        delivery = RecordingDelivery()
        checkpointer = RecordingCheckpointer()
        kernel = Kernel(Ports(audit=audit, delivery=delivery, checkpointer=checkpointer))
        with trio.move_on_after(5) as scope:
            await kernel.run(ScriptedAgent([Hang()]), RunInfo(), Limits(timeout=60))
            pytest.fail("Cancelled did not propagate")  # pragma: no cover
        assert scope.cancelled_caught
        [rec] = audit.recorders
        assert rec.closed
        assert audit.runs[rec.run_id].status is Status.CANCELLED
        assert delivery.delivered[0].status is Status.CANCELLED
        # A run interrupted by its caller keeps its checkpoint for recovery.
        assert checkpointer.failed == [] and checkpointer.completed == []

    async def test_cancelled_propagates_as_cancelled(self) -> None:
        """The exception that escapes Kernel.run on outer cancel is trio's own Cancelled."""
        seen: list[BaseException] = []
        with trio.CancelScope() as scope:
            scope.cancel()
            try:
                await Kernel().run(ScriptedAgent([Hang()]), RunInfo(), Limits())
            except BaseException as exc:
                seen.append(exc)
                raise
        assert seen and scope.cancelled_caught

    async def test_budget_refused(self, autojump_clock: trio.abc.Clock) -> None:
        """A refused budget check ends `budget_exceeded` and no step runs."""
        budget = RecordingBudget(refuse="daily runtime used up")
        audit = MemoryAudit()
        agent = ScriptedAgent([Step(final=True)])
        result = await Kernel(Ports(audit=audit, budget=budget)).run(agent, RunInfo(caller_id="u"))
        assert result.status is Status.BUDGET_EXCEEDED
        assert result.error == "daily runtime used up"
        assert agent.calls == 0 and result.steps == 0
        assert budget.commits == []  # a refused run spent nothing
        assert audit.runs[result.run_id].status is Status.BUDGET_EXCEEDED

    async def test_max_steps(self, autojump_clock: trio.abc.Clock) -> None:
        """The step ceiling ends `max_steps` after exactly that many steps."""
        agent = ScriptedAgent(then=Step())
        result = await Kernel().run(agent, RunInfo(), Limits(max_steps=7))
        assert result.status is Status.MAX_STEPS
        assert result.steps == 7 and agent.calls == 7

    async def test_critic_raises_the_ceiling(self, autojump_clock: trio.abc.Clock) -> None:
        """A critic's higher step ceiling replaces the run's base ceiling."""
        critic = ScriptedCritic(max_steps=12)
        result = await Kernel(Ports(critic=critic)).run(
            ScriptedAgent(then=Step()), RunInfo(), Limits(max_steps=5))
        assert result.status is Status.MAX_STEPS and result.steps == 12

    async def test_agent_exception(self, autojump_clock: trio.abc.Clock) -> None:
        """An agent that raises ends `error` with the traceback on the result."""
        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit)).run(
            ScriptedAgent([Step(), ValueError("bad state")]), RunInfo())
        assert result.status is Status.ERROR
        assert result.error == "ValueError: bad state"
        assert result.traceback is not None and "ValueError: bad state" in result.traceback
        assert "error" in audit.kinds(result.run_id)

    async def test_agent_returning_garbage(self, autojump_clock: trio.abc.Clock) -> None:
        """An agent returning something that is not a Step ends `error` naming the agent."""

        class Sloppy:
            async def step(self, ctx: object) -> object:
                return "done"

        result = await Kernel().run(Sloppy(), RunInfo())  # type: ignore[arg-type]
        assert result.status is Status.ERROR
        assert result.error == "agent Sloppy returned str, not a Step"

    async def test_final_step_with_error(self, autojump_clock: trio.abc.Clock) -> None:
        """A final step carrying an error ends `error` without raising."""
        result = await Kernel().run(
            ScriptedAgent([Step(final=True, error="no valid transition", exit_code=3)]))
        assert result.status is Status.ERROR
        assert result.error == "no valid transition" and result.exit_code == 3

    async def test_handoff(self, autojump_clock: trio.abc.Clock) -> None:
        """A handoff step ends `handoff` with the continuation prompt as output."""
        result = await Kernel().run(
            ScriptedAgent([Step(final=True, handoff="continue from step 3")]))
        assert result.status is Status.HANDOFF
        assert result.output == "continue from step 3"

    async def test_agent_stop(self, autojump_clock: trio.abc.Clock) -> None:
        """A step asking to stop ends `cancelled` with the reason, and nothing propagates."""
        result = await Kernel().run(ScriptedAgent([Step(final=True, stop="LOOP_STOP: done")]))
        assert result.status is Status.CANCELLED and result.reason == "LOOP_STOP: done"

    async def test_dry_run(self, autojump_clock: trio.abc.Clock) -> None:
        """A dry run asks the agent to simulate and executes no step."""

        class Sim(ScriptedAgent):
            async def simulate(self, ctx: object) -> str:
                return "would do things"

        agent = Sim([Step(final=True)])
        result = await Kernel().run(agent, RunInfo(), Limits(dry_run=True))
        assert result.status is Status.DRY_RUN and result.output == "would do things"
        assert agent.calls == 0

    async def test_usage_limit(self, autojump_clock: trio.abc.Clock) -> None:
        """Exceeding a per-run token limit ends `budget_exceeded` naming the limit."""
        agent = ScriptedAgent(then=Step(usage=Usage(input_tokens=400, output_tokens=100)))
        result = await Kernel().run(agent, RunInfo(), Limits(max_total_tokens=1200))
        assert result.status is Status.BUDGET_EXCEEDED
        assert result.reason == "max_total_tokens" and result.steps == 3
        assert result.usage.total_tokens == 1500

    async def test_tool_call_limit(self, autojump_clock: trio.abc.Clock) -> None:
        """A step asking for more tool calls than the limit allows runs none of them."""
        calls: list[str] = []

        async def ping() -> str:
            calls.append("ping")
            return "pong"

        agent = ScriptedAgent(then=Step(tool_calls=[ToolCall("ping"), ToolCall("ping")]),
                              tools={"ping": ping})
        result = await Kernel().run(agent, RunInfo(), Limits(max_tool_calls=3))
        assert result.status is Status.BUDGET_EXCEEDED and result.reason == "max_tool_calls"
        assert calls == ["ping", "ping"] and result.tool_calls == 2


class TestExclusivity:
    @pytest.mark.parametrize("case", ["ok", "timeout", "killed", "max_steps", "error"])
    async def test_exactly_one_status_recorded(
            self, case: str, autojump_clock: trio.abc.Clock) -> None:
        """Whatever ends a run, one status is returned, delivered and audited, and they agree."""
        audit, delivery = MemoryAudit(), RecordingDelivery()
        critic = ScriptedCritic(kill_after=5, reason="stalled") if case == "killed" else None
        script = {"ok": [Step(final=True)], "timeout": [Hang()], "killed": [Hang()],
                  "max_steps": [], "error": [RuntimeError("x")]}[case]
        agent = ScriptedAgent(script, then=Step())
        result = await Kernel(Ports(audit=audit, delivery=delivery, critic=critic)).run(
            agent, RunInfo(), Limits(timeout=10, max_steps=3))
        assert str(result.status) == case
        assert delivery.delivered == [result]
        assert audit.runs[result.run_id].status is result.status
        assert audit.kinds(result.run_id).count("run_end") == 1


class TestUnboundedRuns:
    async def test_kill_without_a_backstop(self, autojump_clock: trio.abc.Clock) -> None:
        """A critic kill of a run with no hard timeout ends killed (no error formatting None)."""
        result = await Kernel(Ports(critic=ScriptedCritic(kill_after=1))).run(
            ScriptedAgent([Hang()]), RunInfo(), Limits(timeout=None))
        assert result.status is Status.KILLED


class TestCancelledEarly:
    async def test_cancel_during_budget_check(self, autojump_clock: trio.abc.Clock) -> None:
        """A cancel while the budget check waits still delivers a `cancelled` result."""

        class SlowBudget(RecordingBudget):
            async def check(self, caller_id: str) -> None:
                await trio.sleep_forever()

        delivery = RecordingDelivery()
        agent = ScriptedAgent([Step(final=True)])
        with trio.move_on_after(3) as scope:
            await Kernel(Ports(budget=SlowBudget(), delivery=delivery)).run(agent)
        assert scope.cancelled_caught and agent.calls == 0
        assert [r.status for r in delivery.delivered] == [Status.CANCELLED]
