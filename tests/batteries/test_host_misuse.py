"""Batteries driven by a host with values no kernel run produces: nothing else is lost.

A recorder's roll-up or a budget's settlement with a number the journal cannot
keep (an integer past 64 bits, NaN, an infinity) used to fail the transaction
that also carried other runs' rows; a run id that is not a folder name made
`DirectoryDelivery` remove folders outside its root.
"""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio

from batteries.audit import JournalAudit
from batteries.budget import MAX_SETTLED_AMOUNT, MAX_SETTLED_TOKENS, JournalBudget
from batteries.delivery import DirectoryDelivery
from batteries.store import journal_path
from kernel import DeliveryError, Result, RunInfo, RunStats, Status, Usage

#: Roll-ups a host may hand `RunRecorder.close`, and the column each one spoils.
BAD_ROLL_UPS: dict[str, tuple[dict[str, Any], str]] = {
    "tokens past int64": ({"usage": Usage(input_tokens=10**30)}, "input_tokens"),
    "exit code past int64": ({"exit_code": 2**70}, "exit_code"),
    "steps past int64": ({"steps": 2**64}, "steps"),
    "tool calls below int64": ({"tool_calls": -(2**64)}, "tool_calls"),
    "cost an int too large for a float": ({"usage": Usage(cost_usd=10**400)}, "cost_usd"),
    "cost infinite": ({"usage": Usage(cost_usd=math.inf)}, "cost_usd"),
    "runtime infinite": ({"runtime_seconds": -math.inf}, "runtime_seconds"),
}


def _runs(db: Path) -> dict[str, dict[str, Any]]:
    con = sqlite3.connect(journal_path(db))
    try:
        con.row_factory = sqlite3.Row
        return {row["name"]: dict(row) for row in con.execute("SELECT * FROM runs")}
    finally:
        con.close()


class TestRollUpNumbers:
    @pytest.mark.parametrize("case", list(BAD_ROLL_UPS))
    async def test_one_runs_bad_number_loses_no_other_run(self, tmp_path: Path,
                                                          case: str) -> None:
        """Runs closing together with one impossible number: every run is recorded, that
        number as NULL, and no close fails."""
        stats, column = BAD_ROLL_UPS[case]
        db = tmp_path / "k.duckdb"
        errors: list[BaseException] = []
        async with JournalAudit.open(db) as audit:
            recorders = [await audit.start_run(RunInfo(name=f"r{i}")) for i in range(5)]

            async def close(i: int) -> None:
                rec = recorders[i]
                assert rec is not None
                values: dict[str, Any] = {
                    "steps": 1, "tool_calls": 1, "runtime_seconds": 0.5, "exit_code": 0,
                    "usage": Usage(input_tokens=3, cost_usd=0.25)}
                if i == 0:
                    values.update(stats)
                elif i == 1:  # the extremes a store can keep are stored as given
                    values.update(steps=2**63 - 1, exit_code=-(2**63), runtime_seconds=1e300)
                try:
                    await rec.close(RunStats(status=Status.OK, **values))
                except Exception as exc:
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                for i in range(5):
                    nursery.start_soon(close, i)
        assert errors == []
        runs = _runs(db)
        assert sorted(runs) == [f"r{i}" for i in range(5)]
        assert all(r["status"] == "ok" for r in runs.values())
        assert runs["r0"][column] is None
        assert (runs["r1"]["steps"], runs["r1"]["exit_code"], runs["r1"]["runtime_seconds"]) == (
            2**63 - 1, -(2**63), 1e300)
        for i in range(1, 5):
            assert runs[f"r{i}"]["input_tokens"] == 3
            assert runs[f"r{i}"]["cost_usd"] == 0.25


class TestBudgetSettlement:
    @pytest.mark.parametrize(("usage", "runtime", "tokens", "cost"), [
        (Usage(cost_usd=math.nan), 1.0, 0, 0.0),
        (Usage(cost_usd=math.nan, input_tokens=-7), 1.0, 0, 0.0),
        (Usage(cost_usd=math.inf), 1.0, 0, MAX_SETTLED_AMOUNT),
        (Usage(input_tokens=10**30), math.nan, MAX_SETTLED_TOKENS, 0.0),
        (Usage(output_tokens=2**63), math.inf, MAX_SETTLED_TOKENS, 0.0),
    ])
    async def test_settled_amounts_are_clamped(self, tmp_path: Path, usage: Usage,
                                               runtime: float, tokens: int,
                                               cost: float) -> None:
        """A settlement the journal could not keep is clamped (NaN and negative to 0,
        infinite and huge to the maximum) and the next check still works."""
        budget = JournalBudget(tmp_path / "k.duckdb")
        budget.set("bob", max_runs=10)
        assert await budget.check("bob") is not None
        await budget.commit("bob", runtime, usage)
        status = budget.status("bob")
        assert status is not None
        assert (status.runs, status.tokens, status.cost_usd) == (1, tokens, cost)
        assert math.isfinite(status.runtime_seconds)
        assert await budget.check("bob") is not None  # not "journal damaged"

    async def test_a_bad_settlement_does_not_sink_the_next_check(self, tmp_path: Path) -> None:
        """With the journal open, a settlement rides with the next transaction: a NaN
        cost used to fail it, and the next run's budget check with it."""
        db = tmp_path / "k.duckdb"
        async with JournalAudit.open(db) as audit:
            budget = JournalBudget(audit.journal)
            budget.set("bob", max_cost_usd=1.0)
            await budget.check("bob")
            await budget.commit("bob", 0.1, Usage(cost_usd=math.nan))
            caps = await budget.check("bob")
            assert caps is not None and caps.max_cost_usd == 1.0

    @pytest.mark.parametrize("options", [
        {"window_seconds": math.nan}, {"window_seconds": math.inf},
        {"max_cost_usd": math.nan}, {"max_runtime_seconds": math.inf},
        {"max_tokens": -1}, {"max_runs": math.inf},
    ])
    def test_set_refuses_numbers_it_cannot_keep(self, tmp_path: Path,
                                                options: dict[str, float]) -> None:
        """`set` refuses NaN, infinite and negative limits with one line."""
        budget = JournalBudget(tmp_path / "k.duckdb")
        with pytest.raises(ValueError, match=r"^the budget window|^budget max_") as err:
            budget.set("bob", **options)  # type: ignore[arg-type]
        assert "\n" not in str(err.value)


class TestDeliveryRunIds:
    @pytest.mark.parametrize("run_id", ["..", ".", "", "a\\b", "x\x00y", "line\nbreak"])
    async def test_a_run_id_that_is_not_a_folder_name_removes_nothing(
            self, tmp_path: Path, run_id: str) -> None:
        """A run id that is not one plain folder name is refused with one line, and nothing
        outside (or inside) the root is removed."""
        root = tmp_path / "sandbox" / "out"
        (root / "earlier-run").mkdir(parents=True)
        (root / "earlier-run" / "result.json").write_text("{}")
        victim = tmp_path / "sandbox" / "victim"
        victim.mkdir()
        (victim / "important.txt").write_text("keep me")
        result = Result(status=Status.OK, run_id=run_id, output="q")
        with pytest.raises(DeliveryError) as err:
            await DirectoryDelivery(root).deliver(result)
        assert "\n" not in str(err.value)
        assert (victim / "important.txt").read_text() == "keep me"
        assert (root / "earlier-run" / "result.json").read_text() == "{}"
        assert sorted(p.name for p in root.iterdir()) == ["earlier-run"]

    async def test_a_link_out_of_the_root_is_not_replaced(self, tmp_path: Path) -> None:
        """A run's folder that is a link to elsewhere is refused, not emptied."""
        root = tmp_path / "out"
        root.mkdir()
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "important.txt").write_text("keep me")
        (root / "r1").symlink_to(elsewhere)
        delivery = DirectoryDelivery(root)
        with pytest.raises(DeliveryError, match="not a folder inside"):
            await delivery.deliver(Result(status=Status.OK, run_id="r1"))
        assert (elsewhere / "important.txt").read_text() == "keep me"
        # A run delivered again (a resumed run) still replaces its own folder.
        await delivery.deliver(Result(status=Status.ERROR, run_id="r2", output="first"))
        await delivery.deliver(Result(status=Status.OK, run_id="r2", output="second"))
        assert (root / "r2" / "output.txt").read_text() == "second"
        assert sorted(p.name for p in root.iterdir()) == ["r1", "r2"]  # no temporary folder


async def test_an_events_impossible_numbers_lose_no_other_run(tmp_path: Path) -> None:
    """A host's `ctx.event` with an iteration or duration no store can keep: NULL for that
    value, and every run of the shared transaction still recorded."""
    from batteries.audit import JournalAudit, sync
    from kernel import RunInfo, RunStats, Status

    db = tmp_path / "k.duckdb"
    async with JournalAudit.open(db) as audit:
        recs = [await audit.start_run(RunInfo(name=f"r{i}")) for i in range(3)]
        recs[0].log_event("odd", iteration=2**70, duration_ms=10**400)
        for rec in recs:
            await rec.close(RunStats(Status.OK, steps=1))
    sync(db)
    import duckdb

    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runs WHERE status = 'ok'").fetchone() == (3,)
        assert con.execute("SELECT iteration, duration_ms FROM events WHERE kind = 'odd'"
                           ).fetchall() == [(None, None)]
