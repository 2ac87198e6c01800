"""Per-caller budgets in a real DuckDB file."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.lowlevel

from batteries.budget import DuckDBBudget
from kernel import BudgetRefused, Kernel, Limits, Ports, RunInfo, Status, Step, Usage


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
