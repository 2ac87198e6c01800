"""Kernel fixes from the library review: caps after the last step, a runtime cap that
cuts a step, tool events of one step sharing its iteration, and misuse of `Kernel.run`
refused with a clear error (a checkpoint of another run, arguments of the wrong type)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from kernel import (
    Checkpoint,
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
    takes_resumed,
)
from kernel.testing import (
    Hang,
    MemoryAudit,
    RecordingBudget,
    RecordingCheckpointer,
    ScriptedAgent,
    ScriptedCritic,
)

PRICEY = Usage(input_tokens=10, output_tokens=10, cost_usd=0.40)


async def noop() -> str:
    return "done"


class TestCapsAfterTheLastStep:
    async def test_a_final_answer_over_the_cost_cap_is_budget_exceeded(
            self, autojump_clock: trio.abc.Clock) -> None:
        """$0.40 a step, capped at $1: the third step (the answer) takes it to $1.20."""
        agent = ScriptedAgent([Step(usage=PRICEY), Step(usage=PRICEY)],
                              then=Step(usage=PRICEY, output="answer", final=True))
        result = await Kernel().run(agent, RunInfo(), Limits(max_cost_usd=1.0))
        assert (result.status, result.reason, result.steps) == (
            Status.BUDGET_EXCEEDED, "max_cost_usd", 3)
        assert result.output == "answer"  # what was bought is kept
        assert result.error == "usage limit max_cost_usd exceeded (limit 1, used 1.2)"

    async def test_a_callers_cap_holds_for_a_one_step_run(
            self, autojump_clock: trio.abc.Clock) -> None:
        budget = RecordingBudget(caps=UsageLimits(max_total_tokens=15))
        result = await Kernel(Ports(budget=budget)).run(
            ScriptedAgent(then=Step(usage=PRICEY, final=True)), RunInfo(caller_id="c"))
        assert (result.status, result.reason) == (Status.BUDGET_EXCEEDED, "max_total_tokens")

    async def test_using_the_step_budget_exactly_is_ok(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Three steps allowed, the third one final: within the budget."""
        budget = RecordingBudget(caps=UsageLimits(max_steps=3, max_cost_usd=1.2))
        agent = ScriptedAgent([Step(), Step()], then=Step(output="x", final=True))
        result = await Kernel(Ports(budget=budget)).run(agent, RunInfo(caller_id="c"))
        assert (result.status, result.steps) == (Status.OK, 3)


class TestRuntimeCapMidStep:
    async def test_a_hung_step_is_cut_at_the_callers_runtime_cap(
            self, autojump_clock: trio.abc.Clock) -> None:
        budget = RecordingBudget(caps=UsageLimits(max_runtime_seconds=5))
        result = await Kernel(Ports(budget=budget)).run(
            ScriptedAgent([Hang()]), RunInfo(caller_id="c"), Limits(timeout=100))
        assert (result.status, result.reason, result.steps) == (
            Status.BUDGET_EXCEEDED, "max_runtime_seconds", 0)
        assert result.error == "usage limit max_runtime_seconds exceeded (limit 5, used 5.0)"
        assert result.runtime_seconds == pytest.approx(5)
        assert budget.commits[0][1] == pytest.approx(5)

    async def test_the_backstop_first_is_a_timeout(self, autojump_clock: trio.abc.Clock) -> None:
        budget = RecordingBudget(caps=UsageLimits(max_runtime_seconds=50))
        result = await Kernel(Ports(budget=budget)).run(
            ScriptedAgent([Hang()]), RunInfo(caller_id="c"), Limits(timeout=10))
        assert (result.status, result.reason) == (Status.TIMEOUT, "hard timeout of 10s expired")


class TestToolEventsShareTheirStepsIteration:
    async def test_kernel_run_tools(self, autojump_clock: trio.abc.Clock) -> None:
        audit = MemoryAudit()
        agent = ScriptedAgent([Step(), Step(tool_calls=[ToolCall("noop"), ToolCall("noop")])],
                              tools={"noop": noop})
        result = await Kernel(Ports(audit=audit)).run(agent)
        assert result.status is Status.OK
        seen = [(e.kind, e.iteration) for e in audit.events(result.run_id)
                if e.kind in ("step", "tool_start", "tool_end")]
        assert seen == [("step", 0), ("step", 1), ("tool_start", 1), ("tool_end", 1),
                        ("tool_start", 1), ("tool_end", 1), ("step", 2)]

    async def test_tools_an_agent_runs_itself(self, autojump_clock: trio.abc.Clock) -> None:
        async def uses_a_tool(ctx: RunContext) -> Step:
            ctx.tool_start(ToolCall("grep"))
            return Step(final=True)

        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit)).run(ScriptedAgent([Step(), uses_a_tool]))
        seen = [(e.kind, e.iteration) for e in audit.events(result.run_id)
                if e.kind in ("step", "tool_start")]
        assert seen == [("step", 0), ("tool_start", 1), ("step", 1)]


class TestMisuseOfRun:
    async def test_a_checkpoint_of_another_run_is_refused(self) -> None:
        cp = Checkpoint("other-run", steps=7, state={}, usage=Usage(input_tokens=100))
        with pytest.raises(ValueError, match="the checkpoint is of run 'other-run', not of "
                                             "'mine': a run resumes from its own checkpoint"):
            await Kernel().run(ScriptedAgent(), RunInfo(run_id="mine"), resume=cp)

    async def test_resume_without_info_is_the_checkpoints_run(self) -> None:
        cp = Checkpoint("job-42", steps=2, state={})
        result = await Kernel().run(ScriptedAgent(), resume=cp)
        assert (result.run_id, result.steps) == ("job-42", 3)

    @pytest.mark.parametrize(("kwargs", "message"), [
        ({"info": "job-1"}, "info must be a RunInfo, not str"),
        ({"limits": {"timeout": 5}}, "limits must be a Limits, not dict"),
        ({"resume": {"steps": 2}}, "resume must be a Checkpoint, not dict"),
    ])
    async def test_arguments_of_the_wrong_type(self, kwargs: dict[str, Any],
                                               message: str) -> None:
        with pytest.raises(TypeError, match=message):
            await Kernel().run(ScriptedAgent(), **kwargs)


class _Bounded(ScriptedAgent):
    """`SupportsFixedCeiling`: a loop file's max_iterations."""

    fixed_max_steps = True


class TestFixedCeiling:
    async def test_a_critic_cannot_raise_an_agents_fixed_ceiling(
            self, autojump_clock: trio.abc.Clock) -> None:
        critic = ScriptedCritic(max_steps=50)  # a progressing run: the critic raises it
        result = await Kernel(Ports(critic=critic)).run(
            _Bounded(then=Step()), RunInfo(), Limits(max_steps=5))
        assert (result.status, result.steps) == (Status.MAX_STEPS, 5)
        assert result.reason == "step ceiling of 5 reached"

    async def test_any_other_agents_ceiling_is_raised(self,
                                                      autojump_clock: trio.abc.Clock) -> None:
        critic = ScriptedCritic(max_steps=8)
        result = await Kernel(Ports(critic=critic)).run(
            ScriptedAgent(then=Step()), RunInfo(), Limits(max_steps=5))
        assert (result.status, result.steps) == (Status.MAX_STEPS, 8)


class TestAFreshRunUnderAnIdInUse:
    """`SupportsResumedStart`: the kernel tells the audit whether a run resumes, and a
    fresh run under an id that names a run is refused before it runs."""

    async def test_refused_before_its_budget_and_first_step(
            self, autojump_clock: trio.abc.Clock) -> None:
        audit, budget = MemoryAudit(), RecordingBudget()
        kernel = Kernel(Ports(audit=audit, budget=budget))
        info = RunInfo(name="reused", caller_id="c")
        assert (await kernel.run(ScriptedAgent(), info)).status is Status.OK
        agent = ScriptedAgent()
        again = await kernel.run(agent, info)
        assert (again.status, again.steps, agent.calls) == (Status.ERROR, 0, 0)
        assert "already names a run" in (again.error or "")
        assert budget.checks == ["c"]  # the refused run never reached the budget
        assert audit.kinds(info.run_id) == ["run_start", "step", "run_end"]

    async def test_the_earlier_runs_checkpoint_and_budget_are_untouched(
            self, autojump_clock: trio.abc.Clock) -> None:
        """The earlier run was interrupted (resumable): a fresh run refused under its id
        neither fails its checkpoint nor settles anything, and the resume still goes."""
        audit, budget, cp = MemoryAudit(), RecordingBudget(), RecordingCheckpointer()
        kernel = Kernel(Ports(audit=audit, budget=budget, checkpointer=cp))
        info = RunInfo(caller_id="c")
        with trio.move_on_after(5):
            await kernel.run(ScriptedAgent([Step()], then=Hang()), info)  # cancelled
        saved = cp.latest(info.run_id)
        assert saved is not None
        refused = await kernel.run(ScriptedAgent(), info)
        assert refused.status is Status.ERROR
        assert (cp.latest(info.run_id), cp.failed, len(budget.commits)) == (saved, [], 1)
        resumed = await kernel.run(ScriptedAgent(), info, resume=saved)
        assert resumed.status is Status.OK

    async def test_an_audit_that_does_not_take_it_is_called_as_before(
            self, autojump_clock: trio.abc.Clock) -> None:
        class Plain(MemoryAudit):
            async def start_run(self, info: RunInfo) -> Any:  # type: ignore[override]
                return await super().start_run(info)

        assert not takes_resumed(Plain()) and takes_resumed(MemoryAudit())
        kernel = Kernel(Ports(audit=Plain()))
        info = RunInfo()
        assert (await kernel.run(ScriptedAgent(), info)).status is Status.OK
        assert (await kernel.run(ScriptedAgent(), info)).status is Status.OK  # not told

    async def test_a_tee_passes_it_on(self, autojump_clock: trio.abc.Clock) -> None:
        from batteries.tee import TeeAudit

        first = MemoryAudit()
        kernel = Kernel(Ports(audit=TeeAudit(first, MemoryAudit())))
        info = RunInfo()
        assert (await kernel.run(ScriptedAgent(), info)).status is Status.OK
        again = await kernel.run(ScriptedAgent(), info)
        assert again.status is Status.ERROR and not again.port_failures
