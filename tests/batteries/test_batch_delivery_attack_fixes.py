"""`BatchDelivery` keeping where each delivery stands, attacked: a mark the journal will
not take when its delivery ends (it was left `pending` for ever: a resume sent the
result twice), and a result a resume owes (the journal's copy, its output as stored and
no artifacts, replaced the run folder the run had delivered whole).

Real parts: the SQLite journal (locked by a second real connection), the real batch
runner and kernel, real folders; the deliveries are hand-written `Delivery` fakes.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import trio

from batteries.audit import JournalAudit
from batteries.batch import BatchDelivery, BatchRunner, KernelDispatch, TaskOutcome
from batteries.checkpoint import JournalCheckpointer
from batteries.delivery import DirectoryDelivery, FanOutDelivery
from batteries.store import Journal, MarkDelivery, journal_path
from kernel import DeliveryError, Ports, Result, Status
from tests.batteries.test_batch import build, tasks


class Failing:
    """A delivery that fails every result (a webhook that is down)."""

    def __init__(self) -> None:
        self.tried = 0

    async def deliver(self, result: Result) -> None:
        self.tried += 1
        raise DeliveryError("webhook down")


class Kept:
    """A delivery that keeps what it is given."""

    def __init__(self) -> None:
        self.results: list[Result] = []

    async def deliver(self, result: Result) -> None:
        self.results.append(result)


def states(db: Path, batch_id: str) -> dict[str, str | None]:
    """Task id -> its delivery, as the journal's file has it (read by another connection)."""
    with closing(sqlite3.connect(journal_path(db), timeout=60)) as con:
        rows = con.execute("SELECT task_id, delivery FROM batch_tasks WHERE batch_id = ?",
                           (batch_id,)).fetchall()
    return {task: state for task, state in rows}


@contextmanager
def locked(db: Path) -> Iterator[None]:
    """The journal's write lock held by another connection for the block."""
    con = sqlite3.connect(journal_path(db), isolation_level=None, timeout=60)
    try:
        con.execute("BEGIN EXCLUSIVE")
        yield
        con.execute("ROLLBACK")
    finally:
        con.close()


def outcome_of(i: int, task: Any, *, skipped: bool = False) -> TaskOutcome:
    result = Result(status=Status.OK, run_id=task.run_id, output=f"done {i}")
    return TaskOutcome(i, task.task_id, task.run_id, "ok", result, skipped=skipped)


async def test_a_mark_the_journal_will_not_take_rides_with_its_next_write(
        tmp_path: Path) -> None:
    """The journal is locked (past its lock timeout) as two deliveries end: each is
    reported `delivered`, and the journal, which has them owed (`pending`) meanwhile,
    has them `delivered` once its next write went in, instead of owed for ever (a
    resume would have delivered them twice)."""
    ts = tasks(2)
    db = tmp_path / "k.duckdb"
    # No timed flush: what is written when is this test's (the next write, below).
    async with Journal.open(db, lock_timeout=0.2, flush_interval=3600) as journal:
        runner = BatchRunner(journal, KernelDispatch(Ports(), build))
        batch_id = await runner.create(ts)

        await journal.transact([MarkDelivery(batch_id, ((0, "pending", None),
                                                        (1, "pending", None)))])
        kept = Kept()
        seen: list[TaskOutcome] = []
        delivery = BatchDelivery(kept, on_delivered=seen.append)
        delivery.bind(journal, batch_id)
        with locked(db):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(delivery.serve)
                for i, t in enumerate(ts):
                    delivery.submit(outcome_of(i, t))
                delivery.close()
            assert [o.delivery for o in seen] == ["delivered", "delivered"]
            assert delivery.unrecorded == 2
        assert set(states(db, batch_id).values()) == {"pending"}  # not written yet
        await journal.transact()  # the journal's next write (any command's)
        assert states(db, batch_id) == {"t0": "delivered", "t1": "delivered"}


def _runner(journal: Journal) -> BatchRunner:
    ports = Ports(audit=JournalAudit(journal), checkpointer=JournalCheckpointer(journal))
    return BatchRunner(journal, KernelDispatch(ports, build), concurrency=2)


async def _deliver(runner: BatchRunner, batch_id: str, delivery: BatchDelivery
                   ) -> list[TaskOutcome]:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(delivery.serve)
        outs = await runner.run(batch_id, delivery=delivery)
    return outs


async def test_a_result_owed_again_leaves_the_folder_its_run_delivered_as_it_is(
        tmp_path: Path) -> None:
    """A run delivered to its folder while the webhook beside it failed: the resume
    delivers its result again (the journal's copy) to the webhook, and leaves the run's
    folder (its artifacts, its output as the run had it) as it is; a result the folder
    never got is written there."""
    out = tmp_path / "out"
    ts = tasks(2)
    async with Journal.open(tmp_path / "k.duckdb") as journal:
        runner = _runner(journal)
        batch_id = await runner.create(ts)
        folder = DirectoryDelivery(out)

        class WithArtifact:
            """The folder gets the first run with an artifact (as a library agent's)."""

            async def deliver(self, result: Result) -> None:
                if result.run_id == ts[0].run_id:
                    result.artifacts["report.txt"] = "the run's own report"
                    await folder.deliver(result)

        down = Failing()
        first = await _deliver(runner, batch_id, BatchDelivery(
            FanOutDelivery([WithArtifact(), down])))
        assert [o.delivery for o in first] == ["failed", "failed"]
        run_folder = out / ts[0].run_id
        before = {p.name: p.read_bytes() for p in run_folder.rglob("*") if p.is_file()}
        assert before["report.txt"] == b"the run's own report"
        inode = run_folder.stat().st_ino

        hook = Kept()
        again = FanOutDelivery([DirectoryDelivery(out, replace=False), hook])
        outs = await _deliver(_runner(journal), batch_id, BatchDelivery(
            FanOutDelivery([DirectoryDelivery(out), hook]), redeliver=again))
        assert [o.delivery for o in outs] == ["delivered", "delivered"]
        assert all(o.skipped for o in outs)
        assert sorted(r.run_id for r in hook.results) == sorted(t.run_id for t in ts)
        assert run_folder.stat().st_ino == inode
        assert {p.name: p.read_bytes() for p in run_folder.rglob("*") if p.is_file()} \
            == before
        assert (out / ts[1].run_id / "result.json").exists()  # never delivered there


async def test_a_folder_delivery_that_must_not_replace_still_writes_a_new_folder(
        tmp_path: Path) -> None:
    """`DirectoryDelivery(replace=False)` writes a run that has no folder and leaves one
    that has; the default replaces it (a resumed run's new result)."""
    result = Result(status=Status.OK, run_id="r1", output="first")
    await DirectoryDelivery(tmp_path, replace=False).deliver(result)
    assert (tmp_path / "r1" / "output.txt").read_text() == "first"
    result.output = "second"
    await DirectoryDelivery(tmp_path, replace=False).deliver(result)
    assert (tmp_path / "r1" / "output.txt").read_text() == "first"
    await DirectoryDelivery(tmp_path).deliver(result)
    assert (tmp_path / "r1" / "output.txt").read_text() == "second"
