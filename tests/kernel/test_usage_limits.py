"""Per-run usage limits: one test per kind, from Limits and from a budget's caps."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from kernel import (
    Kernel,
    Limits,
    Ports,
    RunContext,
    RunInfo,
    Status,
    Step,
    ToolCall,
    Usage,
    UsageLimits,
)
from kernel.testing import RecordingBudget, ScriptedAgent

STEP_USAGE = Usage(input_tokens=100, output_tokens=40, thinking_tokens=10, cost_usd=0.25)


async def noop() -> str:
    return "ok"


def busy_agent() -> ScriptedAgent:
    """Every step uses STEP_USAGE, makes one tool call and takes 10 s; it never finishes."""
    return ScriptedAgent(then=Step(usage=STEP_USAGE, tool_calls=[ToolCall("noop")]),
                         tools={"noop": noop}, step_seconds=10)


# (limit name, cap value, steps taken when it trips)
KINDS: list[tuple[str, Any, int]] = [
    ("max_steps", 4, 4),
    ("max_tool_calls", 3, 4),
    ("max_input_tokens", 350, 4),
    ("max_output_tokens", 100, 3),
    ("max_total_tokens", 500, 4),
    ("max_cost_usd", 0.6, 3),
    # Cut mid-step at 45 s: the fifth step (40-50 s) never completes.
    ("max_runtime_seconds", 45, 4),
]


class TestUsageLimits:
    @pytest.mark.parametrize(("name", "cap", "steps"), KINDS, ids=[k[0] for k in KINDS])
    async def test_budget_cap(self, name: str, cap: Any, steps: int,
                              autojump_clock: trio.abc.Clock) -> None:
        """A cap handed out by the budget ends the run budget_exceeded, naming the limit."""
        budget = RecordingBudget(caps=UsageLimits(**{name: cap}))
        result = await Kernel(Ports(budget=budget)).run(busy_agent(), RunInfo(caller_id="c"),
                                                         Limits(max_steps=100, timeout=None))
        assert result.status is Status.BUDGET_EXCEEDED
        assert result.reason == name
        assert name in (result.error or "")
        assert result.steps == steps
        assert budget.commits and budget.commits[0][2] == result.usage  # spend is committed

    @pytest.mark.parametrize("name", ["max_tool_calls", "max_input_tokens", "max_output_tokens",
                                      "max_total_tokens", "max_cost_usd"])
    async def test_limits_field(self, name: str, autojump_clock: trio.abc.Clock) -> None:
        """The same caps set on Limits work without any budget."""
        cap = dict((k, c) for k, c, _ in KINDS)[name]
        result = await Kernel().run(busy_agent(), RunInfo(), Limits(**{name: cap}))
        assert result.status is Status.BUDGET_EXCEEDED and result.reason == name

    async def test_tighter_cap_wins(self, autojump_clock: trio.abc.Clock) -> None:
        """When both Limits and the budget cap a resource, the tighter one applies."""
        budget = RecordingBudget(caps=UsageLimits(max_cost_usd=10.0))
        result = await Kernel(Ports(budget=budget)).run(
            busy_agent(), RunInfo(), Limits(max_cost_usd=0.3))
        assert result.status is Status.BUDGET_EXCEEDED and result.steps == 2

    async def test_budget_returning_garbage_fails_closed(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A budget whose check returns something odd refuses the run, naming the budget."""

        class Odd(RecordingBudget):
            async def check(self, caller_id: str) -> Any:
                return 42

        agent = busy_agent()
        result = await Kernel(Ports(budget=Odd())).run(agent)
        assert result.status is Status.BUDGET_EXCEEDED and agent.calls == 0
        assert "Odd.check returned int" in (result.error or "")

    async def test_max_steps_ceiling_is_not_a_budget(self, autojump_clock: trio.abc.Clock) -> None:
        """Limits.max_steps is the step ceiling (max_steps), not a budget cap."""
        result = await Kernel().run(busy_agent(), RunInfo(), Limits(max_steps=4))
        assert result.status is Status.MAX_STEPS


class _Unpriced(ScriptedAgent):
    """`SupportsPricing`: an agent whose model calls it cannot price."""

    unpriced: str | None = "model 'm' has no price"


class TestUnpricedAgents:
    """A cost cap cannot bound an agent that cannot price its calls: such a run is refused
    before its first step, saying why (it would run with every call costing 0)."""

    async def test_a_cost_cap_on_limits_refuses_it(self,
                                                    autojump_clock: trio.abc.Clock) -> None:
        agent = _Unpriced(then=Step(usage=STEP_USAGE, final=True))
        result = await Kernel().run(agent, RunInfo(), Limits(max_cost_usd=1.0))
        assert (result.status, result.steps, agent.calls) == (Status.BUDGET_EXCEEDED, 0, 0)
        assert result.reason == "cost cannot be known"
        assert result.error == ("this run cannot be bounded by cost: it has a cost cap "
                                "(Limits.max_cost_usd $1), and model 'm' has no price")

    async def test_a_budgets_cost_cap_refuses_it(self,
                                                 autojump_clock: trio.abc.Clock) -> None:
        budget = RecordingBudget(caps=UsageLimits(max_cost_usd=2.5))
        agent = _Unpriced(then=Step(final=True))
        result = await Kernel(Ports(budget=budget)).run(agent, RunInfo(caller_id="ann"),
                                                         Limits())
        assert result.status is Status.BUDGET_EXCEEDED and agent.calls == 0
        assert "its caller 'ann' has a cost budget ($2.5 left)" in (result.error or "")
        assert budget.commits == [("ann", 0.0, Usage())]  # admitted, so settled at 0

    @pytest.mark.parametrize("caps", [None, UsageLimits(max_total_tokens=10**6)])
    async def test_without_a_cost_cap_it_runs(self, caps: UsageLimits | None,
                                              autojump_clock: trio.abc.Clock) -> None:
        """Tokens caps and no caps need no price."""
        agent = _Unpriced(then=Step(output="done", final=True))
        result = await Kernel(Ports(budget=RecordingBudget(caps=caps))).run(
            agent, RunInfo(), Limits())
        assert (result.status, result.output) == (Status.OK, "done")

    async def test_a_priced_agent_runs_under_a_cost_cap(
            self, autojump_clock: trio.abc.Clock) -> None:
        agent = _Unpriced(then=Step(output="done", final=True))
        agent.unpriced = None
        result = await Kernel().run(agent, RunInfo(), Limits(max_cost_usd=1.0))
        assert result.status is Status.OK


class TestReportedUsage:
    """`ctx.report_usage`: a long step (a CLI agent's whole session) reports what it uses
    as it goes, and the caps stop it then, not when (if ever) the step returns."""

    @staticmethod
    def streaming(per_report: Usage, reports: int, then: Usage | None = None) -> Any:
        async def step(ctx: RunContext) -> Step:
            for _ in range(reports):
                await trio.sleep(10)
                ctx.report_usage(per_report)
            return Step(output="done", final=True, usage=then)
        return ScriptedAgent([step])

    async def test_a_cap_stops_the_step_as_the_usage_comes(
            self, autojump_clock: trio.abc.Clock) -> None:
        budget = RecordingBudget(caps=UsageLimits(max_total_tokens=1000))
        start = trio.current_time()
        result = await Kernel(Ports(budget=budget)).run(
            self.streaming(Usage(300, 100), reports=100), RunInfo(caller_id="c"),
            Limits(timeout=None))
        assert (result.status, result.reason) == (Status.BUDGET_EXCEEDED, "max_total_tokens")
        assert trio.current_time() - start == pytest.approx(30)  # at the third report
        assert result.usage == Usage(900, 300)
        assert budget.commits[0][2] == Usage(900, 300)  # settled although no step returned

    async def test_reported_and_returned_usage_add_up(
            self, autojump_clock: trio.abc.Clock) -> None:
        """What the step returns is what it did not report: the two are summed."""
        result = await Kernel().run(self.streaming(Usage(10, 5), reports=3, then=Usage(1, 1)),
                                    RunInfo(), Limits())
        assert result.status is Status.OK and result.usage == Usage(31, 16)

    @pytest.mark.parametrize(("bad", "error"), [
        ({"tokens": 5}, TypeError), (Usage(-1, 0), ValueError),
        (Usage(0, 0, 0, float("nan")), ValueError)])
    async def test_a_bad_report_is_refused_where_it_is_made(
            self, bad: Any, error: type[Exception], autojump_clock: trio.abc.Clock) -> None:
        seen: list[BaseException] = []

        async def step(ctx: RunContext) -> Step:
            try:
                ctx.report_usage(bad)
            except Exception as exc:
                seen.append(exc)
            return Step(final=True)

        result = await Kernel().run(ScriptedAgent([step]), RunInfo(),
                                    Limits(max_total_tokens=10))
        assert result.status is Status.OK and result.usage == Usage()
        assert len(seen) == 1 and isinstance(seen[0], error)
