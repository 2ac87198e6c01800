"""Per-caller budgets in a real DuckDB file."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.lowlevel

from batteries.budget import DuckDBBudget
from kernel import (
    BudgetRefused,
    Checkpoint,
    Kernel,
    Limits,
    Ports,
    RunInfo,
    Status,
    Step,
    Usage,
)


def spend_agent(cost: float = 0.0, tokens: int = 0) -> object:
    from kernel.testing import ScriptedAgent

    return ScriptedAgent([Step(usage=Usage(input_tokens=tokens, cost_usd=cost)),
                          Step(output="done", final=True)])


class TestDuckDBBudget:
    async def test_third_run_of_the_day_refused(self, tmp_path: Path) -> None:
        """With 2 runs a day, the third run is refused budget_exceeded and runs no step."""
        budget = DuckDBBudget(tmp_path / "k.duckdb")
        budget.set("alice", max_runs=2)
        kernel = Kernel(Ports(budget=budget))
        statuses = []
        for _ in range(3):
            r = await kernel.run(spend_agent(), RunInfo(caller_id="alice"), Limits())
            statuses.append(r.status)
        assert statuses == [Status.OK, Status.OK, Status.BUDGET_EXCEEDED]
        assert r.steps == 0
        assert r.error == "caller 'alice' used 2 of 2 runs in the last 24h"
        # Another caller is not affected.
        other = await kernel.run(spend_agent(), RunInfo(caller_id="bob"), Limits())
        assert other.status is Status.OK

    async def test_remaining_cost_caps_the_run(self, tmp_path: Path) -> None:
        """A run that would overspend what is left of the budget is stopped mid-run."""
        budget = DuckDBBudget(tmp_path / "k.duckdb")
        budget.set("carol", max_cost_usd=1.0)
        kernel = Kernel(Ports(budget=budget))
        first = await kernel.run(spend_agent(cost=0.7), RunInfo(caller_id="carol"))
        assert first.status is Status.OK
        second = await kernel.run(spend_agent(cost=0.7), RunInfo(caller_id="carol"))
        assert second.status is Status.BUDGET_EXCEEDED and second.reason == "max_cost_usd"
        with pytest.raises(BudgetRefused, match=r"used \$1.40 of \$1.00 cost"):
            await budget.check("carol")

    async def test_default_budget_and_failed_runs_count(self, tmp_path: Path) -> None:
        """The `*` budget applies to callers without their own; failed runs are committed."""
        from kernel.testing import ScriptedAgent

        budget = DuckDBBudget(tmp_path / "k.duckdb")
        budget.set("*", max_runs=1)
        kernel = Kernel(Ports(budget=budget))
        failed = await kernel.run(ScriptedAgent([RuntimeError("x")]), RunInfo(caller_id="dan"))
        assert failed.status is Status.ERROR
        refused = await kernel.run(spend_agent(), RunInfo(caller_id="dan"))
        assert refused.status is Status.BUDGET_EXCEEDED
        [row] = budget.all()
        assert row.caller_id == "*"
        status = budget.status("dan")
        assert status is not None and status.runs == 1

    async def test_no_budget_no_file(self, tmp_path: Path) -> None:
        """Without a database or a budget row, callers are unbounded and nothing is created."""
        budget = DuckDBBudget(tmp_path / "none.duckdb")
        assert await budget.check("anyone") is None
        assert not (tmp_path / "none.duckdb").exists()

    def test_window_must_be_positive(self, tmp_path: Path) -> None:
        """A zero window is refused."""
        with pytest.raises(ValueError, match="window"):
            DuckDBBudget(tmp_path / "k.duckdb").set("x", window_seconds=0)


class TestResumedRuns:
    """A resumed run was admitted once: it is not counted or refused again, and still metered."""

    async def test_a_resumed_run_is_not_a_second_run(self, tmp_path: Path) -> None:
        """With 1 run a day used by the interrupted run, its resume still runs; spend settles."""
        budget = DuckDBBudget(tmp_path / "k.duckdb")
        budget.set("erin", max_runs=1, max_cost_usd=1.0)
        info = RunInfo(caller_id="erin")
        # The first session reserved and died (SIGKILL: never settled).
        assert await budget.check_run(info, resumed=False) is not None
        refused = await Kernel(Ports(budget=budget)).run(spend_agent(), RunInfo(caller_id="erin"))
        assert refused.status is Status.BUDGET_EXCEEDED  # the run count is used up
        resume = Checkpoint(info.run_id, steps=1, state=None, usage=Usage(cost_usd=0.6))
        result = await Kernel(Ports(budget=budget)).run(spend_agent(cost=0.3), info,
                                                        resume=resume)
        assert result.status is Status.OK
        spent = budget.status("erin")
        assert spent is not None
        # One run, its whole cost (0.6 before the crash + 0.3 after), the resumed session's time.
        assert (spent.runs, round(spent.cost_usd, 6)) == (1, 0.9)

    async def test_caps_do_not_count_the_run_twice(self, tmp_path: Path) -> None:
        """A run interrupted after settling resumes with its own spend back in what is left."""
        from kernel.testing import ScriptedAgent

        budget = DuckDBBudget(tmp_path / "k.duckdb")
        budget.set("finn", max_cost_usd=1.0, max_tokens=100)
        info = RunInfo(caller_id="finn")
        with trio.CancelScope() as scope:
            async def shut_down(ctx: object) -> Step:  # a SIGTERM-like shutdown mid-run
                scope.cancel()
                await trio.lowlevel.checkpoint()
                return Step()

            first_session = ScriptedAgent([Step(usage=Usage(input_tokens=40, cost_usd=0.7)),
                                           shut_down])
            await Kernel(Ports(budget=budget)).run(first_session, info)
        assert scope.cancelled_caught  # the caller's cancel went through; the run settled
        settled = budget.status("finn")
        assert settled is not None and (settled.runs, settled.tokens) == (1, 40)
        # Resumed with its usage so far: 0.7 + 0.2 stays inside 1.0 (not 0.7 + 0.7 + 0.2).
        resume = Checkpoint(info.run_id, steps=1, state=None,
                            usage=Usage(input_tokens=40, cost_usd=0.7))
        result = await Kernel(Ports(budget=budget)).run(spend_agent(cost=0.2, tokens=10), info,
                                                        resume=resume)
        assert result.status is Status.OK, result.error
        spent = budget.status("finn")
        assert spent is not None
        assert (spent.runs, spent.tokens, round(spent.cost_usd, 6)) == (1, 50, 0.9)
        assert spent.runtime_seconds > settled.runtime_seconds  # both sessions' time

    async def test_a_plain_budget_is_called_as_before(self) -> None:
        """A budget with only check/commit gets the caller id, resumed or not."""
        from kernel.testing import RecordingBudget

        budget = RecordingBudget()
        info = RunInfo(caller_id="gus")
        await Kernel(Ports(budget=budget)).run(spend_agent(), info,
                                               resume=Checkpoint(info.run_id, 1, None))
        assert budget.checks == ["gus"] and len(budget.commits) == 1


def test_check_never_blocks_the_trio_thread(tmp_path: Path) -> None:
    """check() waits for a journal locked by another process in a worker thread: the
    trio thread keeps running meanwhile (a free lock is taken at once, inline)."""
    import sqlite3

    from batteries.store import journal_path

    budget = DuckDBBudget(tmp_path / "k.duckdb")
    budget.set("eve", max_runs=5)
    ticks = 0
    other = sqlite3.connect(journal_path(tmp_path / "k.duckdb"), isolation_level=None)

    async def main() -> None:
        nonlocal ticks
        checked = trio.Event()

        async def check() -> None:
            await budget.check("eve")
            checked.set()

        async with trio.open_nursery() as n:
            await budget.check("eve")  # this process's connections are open
            other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
            n.start_soon(check)
            while ticks < 100:  # the trio thread runs on while check() waits
                ticks += 1
                await trio.lowlevel.checkpoint()
            assert not checked.is_set()
            other.execute("COMMIT")
            await checked.wait()

    trio.run(main)
    other.close()
    assert ticks == 100
