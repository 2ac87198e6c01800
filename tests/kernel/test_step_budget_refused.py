"""A step that raises `BudgetRefused` (a budget refused what it needed: a child run it
started) ends its run `budget_exceeded`, as a refusal at the run's start does, not
`error` (virtual time)."""

from __future__ import annotations

import trio

from kernel import BudgetRefused, Kernel, Limits, Ports, RunInfo, Status, Step
from kernel.testing import MemoryAudit, RecordingBudget, ScriptedAgent


async def test_a_refused_step_ends_the_run_budget_exceeded(
        autojump_clock: trio.abc.Clock) -> None:
    audit, budget = MemoryAudit(), RecordingBudget()
    agent = ScriptedAgent([Step(), BudgetRefused("caller 'alice' used 1 of 1 runs")])
    result = await Kernel(Ports(audit=audit, budget=budget)).run(
        agent, RunInfo(name="parent", caller_id="alice"), Limits(max_steps=10))
    assert result.status is Status.BUDGET_EXCEEDED
    assert result.reason == "budget refused"
    assert result.error == "caller 'alice' used 1 of 1 runs"
    assert result.steps == 2
    # The refusal is on record, and the run's own admission is settled as for any run.
    kinds = audit.kinds(result.run_id)
    assert "error" in kinds and kinds[-1] == "run_end"
    assert len(budget.commits) == 1


async def test_an_empty_refusal_still_says_why(autojump_clock: trio.abc.Clock) -> None:
    result = await Kernel(Ports()).run(ScriptedAgent([BudgetRefused()]), RunInfo(name="r"),
                                       Limits(max_steps=10))
    assert result.status is Status.BUDGET_EXCEEDED
    assert result.error == "budget refused" and result.reason == "budget refused"
