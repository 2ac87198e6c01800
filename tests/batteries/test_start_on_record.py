"""A run is on record before its agent's first step: its row and `run_start` ride in the
budget's reservation (the run's first transaction), so a supervisor killed in the run's
first second does not leave a run only `kernel recover` knows of."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import trio

from batteries.runner import open_ports
from batteries.store import journal_path
from kernel import Kernel, Limits, RunContext, RunInfo, Status, Step
from kernel import PortSpec as PortOptions


class LooksAtTheJournal:
    """One step that reads the journal file from outside (another connection), as a
    `kernel runs` in another process would."""

    def __init__(self, db: Path) -> None:
        self.db = db
        self.seen: list[tuple[str, str]] = []

    async def step(self, ctx: RunContext) -> Step:
        con = sqlite3.connect(journal_path(self.db))
        try:
            self.seen = con.execute(
                "SELECT r.run_id, e.kind FROM runs r JOIN events e USING (run_id) "
                "ORDER BY e.seq").fetchall()
        finally:
            con.close()
        return Step(final=True, output="ok")


async def test_the_run_start_is_durable_before_the_first_step(tmp_path: Path) -> None:
    db = tmp_path / "k.duckdb"
    agent = LooksAtTheJournal(db)
    info = RunInfo(name="on record")
    async with open_ports(PortOptions(db=str(db), no_critic=True)) as ports:
        with trio.fail_after(60):
            result = await Kernel(ports).run(agent, info, Limits(max_steps=3))
    assert result.status is Status.OK
    assert agent.seen == [(info.run_id, "run_start")]
