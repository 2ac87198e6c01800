"""A batch whose runs all ended but whose journal is locked when it is marked finished.

`BatchRunner.run` wrote the batch's finish in a transaction of its own and let
its error out: with the journal locked past its timeout at that moment (another
process writing a large batch, a backup), `kernel batch` ended in an
ExceptionGroup traceback, exit 1, after every run had finished and been
recorded. The mark now rides with the journal's next write (or its exit flush).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import trio

from batteries.audit import JournalAudit
from batteries.batch import BatchRunner, KernelDispatch, TaskOutcome
from batteries.checkpoint import JournalCheckpointer
from batteries.store import Journal, SQLiteStore, journal_path
from kernel import Ports
from tests.batteries.test_batch import build, tasks


async def test_a_locked_journal_at_the_end_still_finishes_the_batch(tmp_path: Path) -> None:
    db = tmp_path / "k.duckdb"
    locker: sqlite3.Connection | None = None
    n = 3
    seen: list[TaskOutcome] = []

    def lock_after_the_last(out: TaskOutcome) -> None:
        nonlocal locker
        seen.append(out)
        if len(seen) == n:  # every run ended and is recorded: now take the write lock
            locker = sqlite3.connect(journal_path(db), timeout=30, isolation_level=None)
            locker.execute("BEGIN IMMEDIATE")

    async with Journal.open(db, lock_timeout=0.3) as journal:
        ports = Ports(audit=JournalAudit(journal), checkpointer=JournalCheckpointer(journal))
        runner = BatchRunner(journal, KernelDispatch(ports, build), concurrency=n)
        bid = await runner.create(tasks(n), name="locked at the end")
        outcomes = await runner.run(bid, on_outcome=lock_after_the_last)
        assert locker is not None
        assert [o.status for o in outcomes] == ["ok"] * n
        assert runner.finished
        locker.rollback()  # the lock goes; the journal's exit writes the mark
        locker.close()
    store = SQLiteStore(journal_path(db))
    try:
        [row] = await trio.to_thread.run_sync(lambda: store.batches(batch_id=bid))
    finally:
        store.close()
    assert row.status == "finished"
