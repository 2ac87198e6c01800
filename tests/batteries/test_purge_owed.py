"""`purge` keeps what a batch still owes a delivery, and a delivery mark reaches the
analysts' copy.

A finished batch whose results were not all delivered (a failed webhook, a batch process
killed while delivering) is delivered again by `kernel batch --resume`, from the runs
row: `purge` keeps those runs (with their events and checkpoints) and the batch with its
tasks, in the journal, in the PostgreSQL store and in the analysts' DuckDB file alike,
however old they are; once delivered, they go as any other. A delivery mark moves the
task's change number, so the sync copies it (with the delivery columns) to the file.

Real parts: the SQLite journal, PostgreSQL (tests/pg_server.py), DuckDB, the kernel and
the batch runner; the deliveries are hand-written `Delivery` fakes (the port).
"""

from __future__ import annotations

import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from batteries.audit import queries, sync
from batteries.audit._store import Store
from batteries.batch import BatchDelivery
from batteries.store import CreateBatch, Journal, MarkDelivery, Owner, SQLiteStore, journal_path
from kernel import Status
from tests.batteries.test_batch import batch_store, tasks
from tests.batteries.test_batch_delivery_durable import (
    Recorded,
    deliver_batch,
    rows_of,
    runner_for,
)

__all__ = ["batch_store"]  # the fixture (both stores), used here

DAY_US = 86_400 * 1_000_000


def _future() -> int:
    """A cut-off a day from now: `purge` may take every ended run (as `--days 0` does)."""
    return time.time_ns() // 1000 + DAY_US


def count(store: Any, sql: str, *args: Any) -> int:
    """One count read straight from the store's tables (`?` placeholders)."""
    if isinstance(store, SQLiteStore):
        with closing(sqlite3.connect(store.path)) as con:
            return int(con.execute(sql, args).fetchone()[0])
    import psycopg

    with psycopg.connect(store.url, autocommit=True) as con:
        con.execute("SET search_path TO kernel")
        row = con.execute(sql.replace("?", "%s"), args).fetchone()
        assert row is not None
        return int(row[0])


async def _owing_batch(journal: Journal, n: int = 4) -> tuple[str, list[Any], frozenset[str]]:
    """A finished batch of `n` tasks whose odd tasks' deliveries failed: (batch id, its
    tasks, the run ids whose result is owed)."""
    ts = tasks(n)
    failing = frozenset(t.run_id for i, t in enumerate(ts) if i % 2)
    bid: list[str] = []
    runner, _ = runner_for(journal, bid)
    bid.append(await runner.create(ts))
    outs = await deliver_batch(runner, bid[0], BatchDelivery(Recorded(failing=failing)))
    assert runner.finished and {o.status for o in outs} == {Status.OK}
    assert {o.run_id for o in outs if o.undelivered} == failing
    await journal.commit_buffered()
    return bid[0], ts, failing


async def test_purge_keeps_the_runs_and_the_batch_a_delivery_is_owed_for(
        batch_store: Any) -> None:
    """A purge that takes every ended run keeps those whose result is owed (their runs row,
    events and checkpoint), their tasks and their batch; the other tasks and their runs
    go. The resume then delivers the owed results as the journal has them and runs
    nothing; once nothing is owed, the next purge takes the rest and the batch."""
    store = batch_store
    async with Journal.open(store=store) as journal:
        bid, ts, failing = await _owing_batch(journal)
        kept = sorted(failing)
        gone = sorted(t.run_id for t in ts if t.run_id not in failing)
        events_before = {r: count(store, "SELECT count(*) FROM events WHERE run_id = ?", r)
                         for r in kept}
        assert all(events_before.values())

        runs, events = store.purge(_future())
        assert runs == 2, "only the delivered runs go"
        assert events > 0
        for r in kept:  # the owed run whole: its row, its events, its checkpoint
            assert count(store, "SELECT count(*) FROM runs WHERE run_id = ?", r) == 1
            assert count(store, "SELECT count(*) FROM events WHERE run_id = ?",
                         r) == events_before[r]
            assert count(store, "SELECT count(*) FROM checkpoints WHERE run_id = ?", r) == 1
        for r in gone:
            assert count(store, "SELECT count(*) FROM runs WHERE run_id = ?", r) == 0
            assert count(store, "SELECT count(*) FROM events WHERE run_id = ?", r) == 0
        [listed] = store.batches(batch_id=bid)
        assert listed.status == "finished" and listed.deliveries == {"failed": 2}
        rows = rows_of(store, bid)
        assert sorted(rows) == ["t1", "t3"], "the owed tasks stay, the others go"
        for t in ts:
            if t.run_id in failing:
                row = rows[t.task_id]
                assert row.delivery == "failed" and row.ended is not None
                assert row.ended["output"] == f"done {t.spec['n']}"

        got = Recorded()
        runner, dispatch = runner_for(journal, [bid])
        outs = await deliver_batch(runner, bid, BatchDelivery(got))
        assert dispatch.ran == [] and runner.finished
        assert sorted(r.run_id for r in got.results) == kept
        for result in got.results:
            task = next(t for t in ts if t.run_id == result.run_id)
            assert (result.status, result.output) == (Status.OK, f"done {task.spec['n']}")
        assert {o.run_id: (o.status, o.skipped, o.delivery) for o in outs} == {
            r: ("ok", True, "delivered") for r in kept}
        assert {r.delivery for r in rows_of(store, bid).values()} == {"delivered"}
        await journal.commit_buffered()

        runs, _ = store.purge(_future())
        assert runs == 2
        assert store.batches() == [] and store.batch_tasks(bid) == []
        assert count(store, "SELECT count(*) FROM batch_tasks") == 0
        assert count(store, "SELECT count(*) FROM runs") == 0
        assert count(store, "SELECT count(*) FROM checkpoints") == 0


async def test_a_pending_delivery_keeps_its_run_and_a_mark_without_a_run_keeps_nothing(
        batch_store: Any) -> None:
    """Rows as a batch process killed mid-delivery leaves them: a finished batch with one
    task `pending` (its run ended: owed, kept with the batch) and one `delivered` (it
    goes with its run); and a finished batch whose `failed` task has no run (nothing to
    deliver it from: neither stays for it)."""
    from batteries.store import FinishBatch

    store = batch_store
    me = Owner.me()
    async with Journal.open(store=store) as journal:
        ts = tasks(2)
        named: list[str] = []
        runner, _ = runner_for(journal, named)
        bid = await runner.create(ts)
        named.append(bid)
        await runner.run(bid)  # no delivery: nothing marked
        assert runner.finished
        await journal.commit_buffered()
    store.commit(None, [MarkDelivery(bid, ((0, "pending", None), (1, "delivered", None))),
                        CreateBatch("borphan", tuple(tasks(1)), me),
                        MarkDelivery("borphan", ((0, "failed", "boom"),)),
                        FinishBatch("borphan", me)])

    runs, _ = store.purge(_future())
    assert runs == 1, "the delivered run goes, the pending one stays"
    assert count(store, "SELECT count(*) FROM runs WHERE run_id = ?", ts[0].run_id) == 1
    assert [b.batch_id for b in store.batches()] == [bid]
    assert [r.task_id for r in store.batch_tasks(bid)] == ["t0"]
    assert count(store, "SELECT count(*) FROM batch_tasks WHERE batch_id = 'borphan'") == 0


def test_a_delivery_mark_is_a_change_the_sync_copies(batch_store: Any) -> None:
    """A mark moves its tasks' change number: the store's changes since the previous
    cursor hold exactly the marked tasks, with where their delivery stands."""
    store = batch_store
    store.commit(None, [CreateBatch("bmarks", tuple(tasks(3)), Owner.me())])
    with store.changes(0, 0) as ch:
        assert [r[4:] for r in ch.batch_tasks()] == [(None, None)] * 3
        cursor = (ch.last_event, ch.rev)
    store.commit(None, [MarkDelivery("bmarks", ((0, "delivered", None), (2, "failed", "x")))])
    with store.changes(*cursor) as ch:
        got = sorted(ch.batch_tasks())
    assert [(r[0], r[1], r[4], r[5]) for r in got] == [
        ("bmarks", 0, "delivered", None), ("bmarks", 2, "failed", "x")]


@pytest.mark.parametrize("kind", ["journal", "postgres"])
async def test_the_analysts_file_purges_as_the_store_does(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        request: pytest.FixtureRequest) -> None:
    """The same cut in the store and in the analysts' file (as `kernel purge` does):
    both hold the same runs, events, checkpoints, batches and tasks afterwards, the
    owed runs and their batch included; the delivery columns are copied."""
    from datetime import UTC, datetime

    from batteries.store import open_store

    db = tmp_path / "k.duckdb"
    if kind == "postgres":
        monkeypatch.setenv("KERNEL_STORE", request.getfixturevalue("pg_url"))
    store: Any = open_store(db)
    try:
        async with Journal.open(store=store) as journal:
            bid, _, failing = await _owing_batch(journal)
        sync(db)
        files = Store(db)
        with files.session(write=False) as cur:
            assert cur.execute("SELECT delivery, count(*) FROM batch_tasks GROUP BY 1 "
                               "ORDER BY 1").fetchall() == [("delivered", 2), ("failed", 2)]
        now = datetime.now(UTC)
        cut = int(now.timestamp() * 1_000_000) + DAY_US
        store.purge(cut)
        with files.session(write=True) as cur:
            runs, _ = queries.purge(cur, 0, now=datetime.fromtimestamp(cut / 1e6, UTC))
        assert runs == 2
        tables = {"runs": "run_id", "events": "run_id, seq", "checkpoints": "run_id",
                  "batches": "batch_id", "batch_tasks": "batch_id, idx, delivery"}
        with files.session(write=False) as cur:
            for table, cols in tables.items():
                copied = sorted(cur.execute(f"SELECT {cols} FROM {table}").fetchall())
                kept = sorted(_rows(store, f"SELECT {cols} FROM {table} "
                                           "WHERE run_id != ''" if table == "events" else
                                    f"SELECT {cols} FROM {table}"))
                assert copied == kept, table
            assert sorted(r[0] for r in cur.execute("SELECT run_id FROM runs").fetchall()) \
                == sorted(failing)
            assert cur.execute("SELECT batch_id FROM batches").fetchall() == [(bid,)]
    finally:
        store.close()


def _rows(store: Any, sql: str) -> list[tuple[Any, ...]]:
    if isinstance(store, SQLiteStore):
        with closing(sqlite3.connect(store.path)) as con:
            return [tuple(r) for r in con.execute(sql).fetchall()]
    import psycopg

    with psycopg.connect(store.url, autocommit=True) as con:
        con.execute("SET search_path TO kernel")
        return [tuple(r) for r in con.execute(sql).fetchall()]


def test_an_unmigrated_journal_is_copied_without_delivery(tmp_path: Path) -> None:
    """A version 4 journal (an older kernel's: no delivery columns, not written since)
    feeds the analysts' file: its tasks are copied, their delivery NULL."""
    import json

    from batteries.store._sqlite import MIGRATIONS

    db = tmp_path / "k.duckdb"
    path = journal_path(db)
    path.parent.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(path, isolation_level=None)) as con:
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("BEGIN")
        for statements in MIGRATIONS[:4]:
            for sql in statements:
                con.execute(sql)
        con.execute("PRAGMA user_version = 4")
        con.execute("UPDATE meta SET value = 1 WHERE key = 'rev'")
        con.execute("INSERT INTO batches (batch_id, created_at, status, tasks, concurrency, "
                    "rev) VALUES ('bold', 1, 'finished', 2, 1, 1)")
        for i, t in enumerate(tasks(2)):
            con.execute("INSERT INTO batch_tasks (batch_id, idx, task_id, run_id, spec, rev) "
                        "VALUES ('bold', ?, ?, ?, ?, 1)",
                        (i, t.task_id, t.run_id, json.dumps(t.spec)))
        con.execute("COMMIT")
    sync(db)
    with Store(db).session(write=False) as cur:
        assert cur.execute("SELECT task_id, delivery, delivery_error FROM batch_tasks "
                           "ORDER BY idx").fetchall() == [("t0", None, None),
                                                          ("t1", None, None)]
    with closing(sqlite3.connect(path)) as con:
        assert con.execute("PRAGMA user_version").fetchone() == (4,), "a read migrates nothing"
