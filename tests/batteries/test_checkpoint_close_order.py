"""A run's checkpoint says "completed" only in the transaction that closes its audit row.

The kernel completes the checkpoint, commits the budget and delivers the
result, then closes the recorder. The checkpoint's end used to ride the next
transaction whatever it was: a delivery that took a while (a webhook, seconds)
let a timed flush commit "completed" while the run's row was still open, and a
process dying there left a run that `kernel recover` never closed (nothing to
resume) and analysts saw running forever. The journal now holds a run's
`FinishRun` until its recorder's close is buffered, and writes both together.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import trio

from batteries.audit import JournalAudit
from batteries.checkpoint import JournalCheckpointer
from batteries.store import journal_path
from kernel import Kernel, Limits, Ports, Result, RunInfo, Status, Step
from kernel.testing import ScriptedAgent

SPEC = {"agent": {"kind": "test"}, "info": {}, "limits": {}}


class SlowDelivery:
    """A Delivery that waits until the test lets it go (a slow webhook)."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.go = trio.Event()

    async def deliver(self, result: Result) -> None:
        self.started.set()
        await self.go.wait()


def rows(db: Path, run_id: str) -> tuple[str | None, str | None]:
    """(the checkpoint's status, the runs row's status: "open" while it has none) as
    committed in the journal; None for a row not there."""
    with sqlite3.connect(journal_path(db)) as con:
        cp = con.execute("SELECT status FROM checkpoints WHERE run_id = ?", (run_id,)).fetchone()
        run = con.execute("SELECT status FROM runs WHERE run_id = ?", (run_id,)).fetchone()
    return (cp[0] if cp else None, (run[0] or "open") if run else None)


async def finished_run_while_delivering(tmp_path: Path, status_step: Step | Exception
                                        ) -> tuple[tuple[str | None, str | None],
                                                   tuple[str | None, str | None], Result]:
    """Commit everything buffered while the delivery waits, read the journal, then let
    it go: (during, after, the result)."""
    db = tmp_path / "k.duckdb"
    delivery = SlowDelivery()
    info = RunInfo(name="close-order")
    async with JournalAudit.open(db) as audit:
        cp = JournalCheckpointer(audit.journal)
        await cp.register(info.run_id, SPEC)
        kernel = Kernel(Ports(audit=audit, checkpointer=cp, delivery=delivery))
        out: list[Result] = []

        async def run() -> None:
            out.append(await kernel.run(ScriptedAgent([Step(), status_step]), info, Limits()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await delivery.started.wait()
            await audit.journal.transact()  # what a timed flush would do now
            during = await trio.to_thread.run_sync(rows, db, info.run_id)
            delivery.go.set()
        after = await trio.to_thread.run_sync(rows, db, info.run_id)
    return during, after, out[0]


async def test_a_completed_checkpoint_waits_for_the_runs_close(tmp_path: Path) -> None:
    during, after, result = await finished_run_while_delivering(tmp_path, Step(final=True))
    assert result.status is Status.OK
    assert during == ("running", "open")  # was ("completed", "open")
    assert after == ("completed", "ok")


async def test_a_failed_checkpoint_waits_for_the_runs_close(tmp_path: Path) -> None:
    during, after, result = await finished_run_while_delivering(tmp_path, ValueError("boom"))
    assert result.status is Status.ERROR
    assert during == ("running", "open")  # was ("failed", "open")
    assert after == ("failed", "error")


async def test_a_run_recorded_elsewhere_completes_with_the_next_transaction(
        tmp_path: Path) -> None:
    """No recorder on the checkpointer's journal: nothing to wait for (as before)."""
    db = tmp_path / "k.duckdb"
    delivery = SlowDelivery()
    info = RunInfo(name="no-audit")
    async with JournalAudit.open(db) as audit:
        cp = JournalCheckpointer(audit.journal)
        await cp.register(info.run_id, SPEC)
        kernel = Kernel(Ports(checkpointer=cp, delivery=delivery))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(kernel.run, ScriptedAgent([Step(final=True)]), info, Limits())
            await delivery.started.wait()
            await audit.journal.transact()
            during = await trio.to_thread.run_sync(rows, db, info.run_id)
            delivery.go.set()
    assert during == ("completed", None)
