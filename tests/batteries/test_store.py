"""The journal itself: old files carried over, the storage interface, permissions."""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import stat
import subprocess
import sys
import threading
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from batteries.audit import JournalAudit, Store, sync
from batteries.audit import _schema as schema
from batteries.store import (
    JOURNAL_VERSION,
    Batch,
    Owner,
    RemoveBudget,
    RunStore,
    SetBudget,
    SQLiteStore,
    journal_path,
)
from batteries.store._journal import INLINE_EVENTS, Journal
from batteries.store._sqlite import WouldBlock
from kernel import Kernel, Ports, RunInfo, Status, Step
from kernel.testing import ScriptedAgent

OLD_BUDGETS = """CREATE TABLE budgets (caller_id VARCHAR PRIMARY KEY,
    window_seconds DOUBLE NOT NULL,
    max_runs BIGINT, max_runtime_seconds DOUBLE, max_tokens BIGINT, max_cost_usd DOUBLE,
    updated_at TIMESTAMP NOT NULL)"""
OLD_SPEND = """CREATE TABLE budget_spend (caller_id VARCHAR NOT NULL, ts TIMESTAMP NOT NULL,
    run_id VARCHAR, runtime_seconds DOUBLE NOT NULL, tokens BIGINT NOT NULL,
    cost_usd DOUBLE NOT NULL)"""
OLD_CHECKPOINTS = """CREATE TABLE checkpoints (run_id VARCHAR PRIMARY KEY, spec JSON NOT NULL,
    state JSON, steps BIGINT NOT NULL DEFAULT 0, tool_calls BIGINT NOT NULL DEFAULT 0,
    input_tokens BIGINT NOT NULL DEFAULT 0, output_tokens BIGINT NOT NULL DEFAULT 0,
    thinking_tokens BIGINT NOT NULL DEFAULT 0, cost_usd DOUBLE NOT NULL DEFAULT 0,
    status VARCHAR NOT NULL, error VARCHAR, host VARCHAR, pid BIGINT,
    created_at TIMESTAMP NOT NULL, updated_at TIMESTAMP NOT NULL)"""
OLD_RUN = "0ld0" + "0" * 28


def _old_file(db: Path) -> None:
    """A DuckDB-only audit file as the kernel wrote it before the journal (schema v2)."""
    import duckdb

    now = datetime.now(UTC).replace(tzinfo=None)
    con = duckdb.connect(str(db))
    for m in schema.MIGRATIONS[:2]:
        con.execute(schema._VERSION_TABLE)
        for sql in m.statements:
            assert isinstance(sql, str)
            con.execute(sql)
        con.execute("INSERT INTO schema_version (version, description) VALUES (?, ?)",
                    [m.version, m.description])
    con.execute("INSERT INTO runs (run_id, name, caller_id, started_at, host, pid) "
                "VALUES (?, 'old loop', 'ann', now(), 'old-host', 1)", [OLD_RUN])
    con.execute("INSERT INTO events VALUES (?, 0, now(), 'run_start', NULL, 'old loop', NULL, "
                "'{}'), (?, 1, now(), 'step', 0, 'a', 1.0, '{}')", [OLD_RUN, OLD_RUN])
    for ddl in (OLD_BUDGETS, OLD_SPEND, OLD_CHECKPOINTS):
        con.execute(ddl)
    con.execute("INSERT INTO budgets VALUES ('ann', 86400, 2, NULL, NULL, NULL, ?)", [now])
    con.execute("INSERT INTO budget_spend VALUES ('ann', ?, NULL, 1, 0, 0), "
                "('ann', ?, NULL, 1, 0, 0)", [now - timedelta(hours=1), now])
    spec = {"agent": {"kind": "loop", "path": "/nowhere.yaml"}, "info": {}, "limits": {}}
    dead = subprocess.Popen(["true"])
    dead.wait()
    con.execute("INSERT INTO checkpoints (run_id, spec, state, steps, status, host, pid, "
                "created_at, updated_at) VALUES (?, ?, '{\"state\": \"a\"}', 1, 'running', "
                "?, ?, ?, ?)", [OLD_RUN, json.dumps(spec), socket.gethostname(), dead.pid,
                                now, now])
    con.close()


def _kernel(*args: str, db: Path) -> subprocess.CompletedProcess[str]:
    exe = str(Path(sys.executable).parent / "kernel")
    return subprocess.run([exe, args[0], "--db", str(db), *args[1:]], capture_output=True,
                          text=True, timeout=60)


class TestOldFiles:
    def test_an_old_duckdb_only_file_is_carried_over(self, tmp_path: Path) -> None:
        """Its runs stay readable, its budget still refuses, its interrupted run is still
        recoverable and continues its seq."""
        db = tmp_path / "old.duckdb"
        _old_file(db)
        runs = _kernel("runs", "--json", db=db)
        assert runs.returncode == 0, runs.stderr
        assert [json.loads(line)["run_id"] for line in runs.stdout.splitlines()] == [OLD_RUN]
        refused = _kernel("run", "--caller", "ann", "--", "true", db=db)
        assert refused.returncode == 3 and "used 2 of 2 runs" in refused.stderr
        listed = _kernel("recover", "--list", "--json", db=db)
        assert listed.returncode == 0, listed.stderr
        assert [json.loads(line)["run_id"] for line in listed.stdout.splitlines()] == [OLD_RUN]
        with closing(sqlite3.connect(journal_path(db))) as con:
            assert con.execute("SELECT last_seq FROM runs WHERE run_id = ?",
                               (OLD_RUN,)).fetchone() == (1,)
        with Store(db).reader() as cur:
            tables = {r[0] for r in cur.execute("SELECT table_name FROM duckdb_tables()"
                                                ).fetchall()}
            assert {"legacy_budgets", "legacy_budget_spend", "legacy_checkpoints"} <= tables
            assert cur.execute("SELECT count(*) FROM events WHERE run_id = ?",
                               [OLD_RUN]).fetchall() == [(2,)]


class TestJournal:
    def test_sqlite_store_is_a_run_store(self, tmp_path: Path) -> None:
        """The embedded store implements the interface the batteries share."""
        store: RunStore = SQLiteStore(tmp_path / "j")
        assert store.budget("nobody") is None and not store.exists()

    async def test_files_are_private(self, tmp_path: Path) -> None:
        """A new directory is 0700; the journal and the analysts' file are 0600."""
        db = tmp_path / "new" / "k.duckdb"
        async with JournalAudit.open(db) as audit:
            await Kernel(Ports(audit=audit)).run(ScriptedAgent([Step(final=True)]))
        sync(db)
        assert stat.S_IMODE(os.stat(db.parent).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(journal_path(db)).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(db).st_mode) == 0o600

    async def test_sync_is_incremental_and_idempotent(self, tmp_path: Path) -> None:
        """A second sync copies only what is new; a closed run's row replaces its open one."""
        db = tmp_path / "k.duckdb"
        async with JournalAudit.open(db) as audit:
            rec = await audit.start_run(RunInfo(name="long"))
            rec.log_event("tick")
            await audit.flush()
            first = await trio.to_thread.run_sync(sync, db)
            again = await trio.to_thread.run_sync(sync, db)
            result = await Kernel(Ports(audit=audit)).run(ScriptedAgent([Step(final=True)]))
            assert result.status is Status.OK
        third = sync(db)
        assert (first.events, first.runs) == (2, 1)
        assert (again.events, again.runs) == (0, 0)
        assert (third.events, third.runs) == (3, 1)
        with Store(db).reader() as cur:
            assert cur.execute("SELECT count(*), count(status) FROM runs").fetchall() == [(2, 1)]

    async def test_runs_closing_together_share_transactions(self, tmp_path: Path) -> None:
        """Closes that arrive while a transaction is written are committed by the next
        one, not one transaction each; every run's rows are durable when its run returns."""
        durable, transactions = await _close_together(tmp_path, runs=50, steps=2)
        assert durable == [4] * 50  # run_start, two steps, run_end
        assert transactions <= 5, transactions

    async def test_runs_closing_during_a_threaded_write_wait_for_it(self, tmp_path: Path) -> None:
        """More rows than a transaction on the trio thread takes: the write goes to a worker
        thread holding the journal's lock, and the runs closing meanwhile wait for it to end
        (woken together), then return with their rows durable; few transactions in all."""
        runs, steps = 120, 4
        assert runs * (steps + 2) > INLINE_EVENTS
        durable, transactions = await _close_together(tmp_path, runs=runs, steps=steps)
        assert durable == [steps + 2] * runs  # run_start, the steps, run_end
        assert transactions <= 8, transactions

    async def test_a_cancelled_wait_for_a_write_leaves_the_others_waiting(
            self, tmp_path: Path) -> None:
        """Callers waiting for a write in flight: one cancelled goes at once; the others
        are woken when the write ends (the cancelled one is not woken again) and the
        next of them writes what was buffered meanwhile."""
        store = _GatedStore(SQLiteStore(journal_path(tmp_path / "k.duckdb")))
        outcomes: dict[str, str] = {}
        scopes: dict[str, trio.CancelScope] = {}

        async def commit(name: str, journal: Journal) -> None:
            with trio.CancelScope() as scopes[name]:
                await journal.commit_buffered()
                outcomes[name] = "returned"
                return
            outcomes[name] = "cancelled"

        async with Journal.open(store=store, flush_interval=3600) as journal:
            audit = JournalAudit(journal)
            rec = await audit.start_run(RunInfo(name="gated"))
            async with trio.open_nursery() as nursery:
                try:
                    nursery.start_soon(commit, "writer", journal)
                    with trio.fail_after(60):  # the write holds the lock, in its thread
                        await trio.to_thread.run_sync(store.blocked.wait)
                    rec.log_event("meanwhile")
                    nursery.start_soon(commit, "second", journal)
                    nursery.start_soon(commit, "third", journal)
                    await wait_all_tasks_blocked()
                    assert journal._writing and outcomes == {}
                    scopes["third"].cancel()
                    await wait_all_tasks_blocked()
                    assert outcomes == {"third": "cancelled"}
                finally:
                    store.gate.set()  # the write ends (at once if an assertion failed)
        assert outcomes == {"third": "cancelled", "writer": "returned", "second": "returned"}
        assert store.commits == 2  # the run's start; then "meanwhile", by the second caller
        with closing(sqlite3.connect(store.path)) as con:
            assert con.execute("SELECT kind FROM events ORDER BY seq").fetchall() == [
                ("run_start",), ("meanwhile",)]


    async def test_full_batches_are_written_back_to_back(self, tmp_path: Path) -> None:
        """The event that fills a batch starts its write, from the recorder's call; the
        batch filled while that write is in flight starts as it ends. No task awaits
        either (the flush timer is an hour away), so no trip through trio's scheduler
        stands between one write and the next. Past the noted fill, a plain step's one
        check is the buffer's limit, which still drops what does not fit."""
        store = _GatedStore(SQLiteStore(journal_path(tmp_path / "k.duckdb")))
        async with Journal.open(store=store, batch_size=50, max_pending_events=80,
                                flush_interval=3600) as journal:
            audit = JournalAudit(journal)
            rec = await audit.start_run(RunInfo(name="full"))
            for _ in range(49):
                rec.log_event("first")
            assert (journal._begun, journal._writing) == (0, False)
            try:
                rec.log_event("first")  # the 50th: its write starts here, in a thread
                assert (journal._begun, journal._writing, journal.fast_until) == (1, True, 49)
                for i in range(100):
                    rec.on_step(i, Step(), 0.0)
                # One write at a time; the second batch's fill is noted, and the steps
                # past it were buffered up to the limit of 80 events, the rest dropped.
                assert (journal._begun, journal.fast_until, rec.dropped) == (1, 80, 20)
            finally:
                store.gate.set()
            with trio.fail_after(60):  # readiness: both writes committed, in their thread
                for _ in range(2):
                    await trio.to_thread.run_sync(store.committed.acquire,
                                                  abandon_on_cancel=True)
            assert (journal._begun, journal.timed_flushes, store.commits) == (2, 0, 2)
        with closing(sqlite3.connect(store.path)) as con:
            assert con.execute("SELECT kind, count(*) FROM events GROUP BY kind ORDER BY "
                               "min(seq)").fetchall() == [
                ("run_start", 1), ("first", 50), ("step", 80)]

    async def test_callers_queued_during_a_write_share_the_next(self, tmp_path: Path) -> None:
        """Operations queued while a write is in flight in its thread go out together
        in the next write, started when that one ends; each caller gets its results."""
        store = _GatedStore(SQLiteStore(journal_path(tmp_path / "k.duckdb")))
        results: dict[str, list[Any]] = {}

        async def budget(journal: Journal, caller: str) -> None:
            results[caller] = await journal.transact([
                SetBudget(caller, 60, len(caller), None, None, None), RemoveBudget("none")])

        async with Journal.open(store=store, flush_interval=3600) as journal:
            audit = JournalAudit(journal)
            rec = await audit.start_run(RunInfo(name="gated"))
            rec.log_event("first")
            # The whole wait is bounded: not forever if the queued callers are never woken.
            with trio.fail_after(60):
                async with trio.open_nursery() as nursery:
                    try:
                        nursery.start_soon(journal.commit_buffered)
                        # The write is in its thread, at the gate.
                        await trio.to_thread.run_sync(store.blocked.wait,
                                                      abandon_on_cancel=True)
                        for caller in ("a", "bb", "ccc"):
                            nursery.start_soon(budget, journal, caller)
                        await wait_all_tasks_blocked()
                        assert results == {} and len(journal._queue) == 3
                    finally:
                        store.gate.set()
        assert results == {"a": [None, False], "bb": [None, False], "ccc": [None, False]}
        assert store.commits == 2
        with closing(sqlite3.connect(store.path)) as con:
            assert con.execute("SELECT caller_id, max_runs FROM budgets ORDER BY 1"
                               ).fetchall() == [("a", 1), ("bb", 2), ("ccc", 3)]

    async def test_a_caller_cancelled_while_its_write_is_in_flight_waits_for_it(
            self, tmp_path: Path) -> None:
        """A write took the caller's op and is in flight in its thread: cancelling the
        caller does not let it leave before the write ends (as `trio.to_thread.run_sync`);
        it gets its results, and its next checkpoint raises Cancelled."""
        store = _GatedStore(SQLiteStore(journal_path(tmp_path / "k.duckdb")))
        outcome: list[str] = []

        async def budget(journal: Journal, scope: trio.CancelScope) -> None:
            with scope:
                await journal.transact([SetBudget("c", 60, 5, None, None, None)])
                outcome.append("written")
                await trio.lowlevel.checkpoint()
                outcome.append("returned")
                return
            outcome.append("cancelled")

        async with Journal.open(store=store, flush_interval=3600) as journal:
            scope = trio.CancelScope()
            async with trio.open_nursery() as nursery:
                try:
                    nursery.start_soon(budget, journal, scope)
                    with trio.fail_after(60):  # the write is in its thread, at the gate
                        await trio.to_thread.run_sync(store.blocked.wait,
                                                      abandon_on_cancel=True)
                    scope.cancel()
                    await wait_all_tasks_blocked()
                    assert outcome == [] and journal._writing
                finally:
                    store.gate.set()
        assert outcome == ["written", "cancelled"]
        with closing(sqlite3.connect(store.path)) as con:
            assert con.execute("SELECT caller_id, max_runs FROM budgets").fetchall() == [
                ("c", 5)]


class _GatedStore:
    """A `SQLiteStore` whose commits go to a worker thread and wait there for `gate`."""

    def __init__(self, inner: SQLiteStore) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.blocked = threading.Event()
        self.commits = 0
        self.committed = threading.Semaphore(0)  # released after each commit

    def commit(self, batch: Batch | None, ops: Any = (), *, wait: bool = True) -> list[Any]:
        if not wait:
            raise WouldBlock  # never on the trio thread
        self.blocked.set()
        if not self.gate.wait(60):
            raise RuntimeError("the test never opened the gate")
        self.commits += 1
        try:
            return self.inner.commit(batch, ops)
        finally:
            self.committed.release()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def _close_together(tmp_path: Path, *, runs: int, steps: int) -> tuple[list[int], int]:
    """Start `runs` audited runs of `steps` steps at once; return each run's event count
    read from the journal right after its `run` returned, and the transactions written.
    No timed flush (`flush_interval`): a machine stalled by load adds no transaction."""
    durable: list[int] = []
    async with JournalAudit.open(tmp_path / "k.duckdb", flush_interval=3600) as audit:
        kernel = Kernel(Ports(audit=audit))
        store = audit.journal.store

        async def one(i: int) -> None:
            info = RunInfo(name=f"r{i}")
            agent = ScriptedAgent([Step() for _ in range(steps - 1)] + [Step(final=True)])
            await kernel.run(agent, info)
            with closing(sqlite3.connect(store.path)) as con:
                row = con.execute("SELECT count(*) FROM events e JOIN runs r USING "
                                  "(run_id) WHERE run_id = ? AND r.status = 'ok'",
                                  (info.run_id,)).fetchone()
            durable.append(row[0])

        async with trio.open_nursery() as nursery:
            for i in range(runs):
                nursery.start_soon(one, i)
        return durable, store.stats.transactions


def _v1_journal(path: Path, running: str, finished: str) -> None:
    """A journal as version 1 wrote it: `UNIQUE (run_id, seq)` on events (kept until
    version 3) and `runs.last_seq` left at 0; one run interrupted after 4 events."""
    from batteries.store._sqlite import MIGRATIONS

    path.parent.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(path, isolation_level=None)) as con:
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("BEGIN")
        for sql in MIGRATIONS[0]:
            con.execute(sql)
        con.execute("PRAGMA user_version = 1")
        for rid, ended in ((running, None), (finished, 2)):
            con.execute("INSERT INTO runs (run_id, name, inputs, started_at, ended_at, status, "
                        "last_seq, rev) VALUES (?, 'old', '{}', 1, ?, ?, 0, 1)",
                        (rid, ended, None if ended is None else "ok"))
        for seq, kind in enumerate(("run_start", "step", "step", "step")):
            con.execute("INSERT INTO events (run_id, seq, ts, kind, payload) "
                        "VALUES (?, ?, ?, ?, '{}')", (running, seq, 10 + seq, kind))
            con.execute("INSERT INTO events (run_id, seq, ts, kind, payload) "
                        "VALUES (?, ?, ?, ?, '{}')", (finished, seq, 10 + seq, kind))
        con.execute("UPDATE meta SET value = 1 WHERE key = 'rev'")
        con.execute("COMMIT")


class TestJournalSchema:
    async def test_a_version_1_journal_is_migrated_and_its_runs_resume(
            self, tmp_path: Path) -> None:
        """Version 3 drops the (run_id, seq) index but keeps every event and id; a run
        interrupted under version 1 continues its seq from the runs row, and its events
        are still found from its first one."""
        db = tmp_path / "k.duckdb"
        running, finished = "1" * 32, "2" * 32
        _v1_journal(journal_path(db), running, finished)
        with closing(sqlite3.connect(journal_path(db))) as con:
            before = con.execute("SELECT id, run_id, seq FROM events ORDER BY id").fetchall()
        async with JournalAudit.open(db) as audit:
            rec = await audit.start_run(RunInfo(name="old", run_id=running))
            rec.log_event("resumed")
            rec.log_event("tick")
            await audit.flush()
        with closing(sqlite3.connect(journal_path(db))) as con:
            assert con.execute("PRAGMA user_version").fetchone() == (JOURNAL_VERSION,)
            assert con.execute("PRAGMA index_list(events)").fetchall() == []
            after = con.execute("SELECT id, run_id, seq FROM events ORDER BY id").fetchall()
            assert after[:len(before)] == before  # ids are the analysts' sync cursor
            seqs = [s for _, rid, s in after if rid == running]
            assert seqs == [0, 1, 2, 3, 4, 5]
            assert con.execute("SELECT run_id, last_seq, first_event FROM runs "
                               "ORDER BY run_id").fetchall() == [(running, 5, 1), (finished, 3, 2)]
        store = SQLiteStore(journal_path(db))
        assert store.payloads(running, "tick") == ["{}"]
        assert len(store.payloads(finished, "step")) == 3
        store.close()
        assert sync(db).events == len(after)

    async def test_a_version_3_journal_keeps_the_highest_id_it_handed_out(
            self, tmp_path: Path) -> None:
        """Version 4 drops AUTOINCREMENT (a WAL page per save): a journal whose newest
        events a version 3 purge deleted keeps their ids handed out (an id mark), so the
        next events get new ids and reach the analysts' file; the mark never does."""
        from batteries.store._sqlite import ID_MARK, MIGRATIONS

        db = tmp_path / "k.duckdb"
        path = journal_path(db)
        path.parent.mkdir(parents=True, exist_ok=True)
        with closing(sqlite3.connect(path, isolation_level=None)) as con:
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("BEGIN")
            for statements in MIGRATIONS[:3]:
                for sql in statements:
                    con.execute(sql)
            con.execute("PRAGMA user_version = 3")
            con.execute("INSERT INTO runs (run_id, name, inputs, started_at, ended_at, status, "
                        "last_seq, first_event, rev) VALUES (?, 'old', '{}', 1, 2, 'ok', 4, 1, 1)",
                        ("3" * 32,))
            for seq in range(5):
                con.execute("INSERT INTO events (run_id, seq, ts, kind, payload) "
                            "VALUES (?, ?, ?, 'step', '{}')", ("3" * 32, seq, 10 + seq))
            con.execute("DELETE FROM events WHERE id > 3")  # a purge took the newest two
            assert con.execute("SELECT seq FROM sqlite_sequence").fetchall() == [(5,)]
            con.execute("COMMIT")
        sync(db)  # the analysts' file holds ids 1-3; its cursor is at 3
        info = RunInfo(name="after the migration")
        async with JournalAudit.open(db) as audit:
            await Kernel(Ports(audit=audit)).run(ScriptedAgent([Step(final=True)]), info)
        with closing(sqlite3.connect(path)) as con:
            assert con.execute("PRAGMA user_version").fetchone() == (JOURNAL_VERSION,)
            [(table,)] = con.execute("SELECT sql FROM sqlite_master WHERE name = 'events'"
                                     ).fetchall()
            assert "AUTOINCREMENT" not in table
            rows = con.execute("SELECT id, run_id, kind FROM events WHERE id > 3 ORDER BY id"
                               ).fetchall()
        assert rows[0] == (5, "", ID_MARK)
        assert [r[1] for r in rows[1:]] == [info.run_id] * 3  # run_start, step, run_end
        assert [r[0] for r in rows[1:]] == [6, 7, 8]
        assert sync(db).events == 3
        with Store(db).reader() as cur:
            assert cur.execute("SELECT count(*) FROM events WHERE kind = ?",
                               [ID_MARK]).fetchall() == [(0,)]

    async def test_two_writers_of_one_run_cannot_duplicate_a_seq(self, tmp_path: Path) -> None:
        """Without the index, `runs.last_seq` still refuses a batch whose seqs another
        writer already recorded: nothing of that batch is written."""
        from kernel import AuditWriteError

        db = tmp_path / "k.duckdb"
        info = RunInfo(name="twice")
        async with JournalAudit.open(db) as first, JournalAudit.open(db) as second:
            a = await first.start_run(info)
            a.log_event("a1")
            await first.flush()
            b = await second.start_run(info)  # a second writer of the same run (a resume)
            b.log_event("b1")
            await second.flush()
            a.log_event("a2")  # `a` still thinks seq 2 is its own
            with pytest.raises(AuditWriteError, match="another writer"):
                await first.flush()
            first.journal.pending = Batch()  # give up on it
        with closing(sqlite3.connect(journal_path(db))) as con:
            rows = con.execute("SELECT seq, kind FROM events WHERE run_id = ? ORDER BY seq",
                               (info.run_id,)).fetchall()
        assert rows == [(0, "run_start"), (1, "a1"), (2, "b1")]

    async def test_a_checkpointed_step_is_one_transaction_of_five_statements(
            self, tmp_path: Path) -> None:
        """A save writes the run's buffered events, raises its last seq and stores the
        state: BEGIN, the events insert, two UPDATEs, COMMIT (no PRAGMAs, no savepoints)."""
        from batteries.checkpoint import JournalCheckpointer
        from kernel import Limits

        statements: list[str] = []
        async with JournalAudit.open(tmp_path / "k.duckdb", flush_interval=3600) as audit:
            cp = JournalCheckpointer(audit.journal)
            info = RunInfo(name="c")
            await cp.register(info.run_id, {"agent": {"kind": "test"}})
            await audit.journal.transact()  # the journal exists; connections are open
            audit.journal.store.trace(statements.append)
            agent = ScriptedAgent([Step(), Step(), Step()], snapshot_state=lambda: {"s": 1})
            result = await Kernel(Ports(audit=audit, checkpointer=cp)).run(agent, info,
                                                                             Limits())
            audit.journal.store.trace(None)
        assert result.status is Status.OK
        transactions: list[list[str]] = []
        for sql in statements:
            if sql.startswith("BEGIN"):
                transactions.append([])
            transactions[-1].append(" ".join(sql.split()[:4]))
        saves = [t for t in transactions if "UPDATE checkpoints SET state" in t]
        assert len(saves) == 3, transactions
        for t in saves[1:]:  # the first also opens the run (its row and run_start)
            inserts = t.count("INSERT INTO events (run_id,")
            assert inserts >= 1  # one statement per 2**k rows (see _sqlite._SIZES)
            assert t == (["BEGIN IMMEDIATE", "UPDATE runs SET last_seq"]
                         + ["INSERT INTO events (run_id,"] * inserts
                         + ["UPDATE checkpoints SET state", "COMMIT"]), t

    async def test_a_large_batch_is_written_whole_in_statements_of_many_rows(
            self, tmp_path: Path) -> None:
        """6,300 events of 300 runs go out in a few multi-row statements (SQLite steps
        each without the GIL), every seq once, in order; a lone surrogate in one event
        rewrites only its own chunk, which was not written before (no duplicate rows)."""
        runs, events = 300, 20
        statements: list[str] = []
        db = tmp_path / "k.duckdb"
        async with JournalAudit.open(db, flush_interval=3600) as audit:
            await audit.journal.transact()  # the journal exists; connections are open
            recs = [await audit.start_run(RunInfo(name=f"r{i}")) for i in range(runs)]
            for n in range(events):
                for i, rec in enumerate(recs):
                    bad = n == events - 1 and i == runs // 2
                    rec.log_event("tick", payload={"n": n, "text": "\ud800" if bad else "ok"})
            audit.journal.store.trace(statements.append)
            await audit.flush()
            audit.journal.store.trace(None)
        inserts = [s for s in statements if s.startswith("INSERT INTO events (run_id,")]
        assert 1 <= len(inserts) <= runs * events // 4096 + 12, len(inserts)
        with closing(sqlite3.connect(journal_path(db))) as con:
            rows = con.execute("SELECT run_id, seq, payload FROM events ORDER BY id").fetchall()
            last = dict(con.execute("SELECT run_id, last_seq FROM runs").fetchall())
        assert len(rows) == runs * (events + 1)
        for rec in recs:
            seqs = [seq for rid, seq, _ in rows if rid == rec.run_id]
            assert seqs == list(range(events + 1))
            assert last[rec.run_id] == events
        bad_rows = [p for rid, _, p in rows if rid == recs[runs // 2].run_id and "ok" not in p]
        assert bad_rows[1] == '{"n":19,"text":"?"}'  # after its run_start: replaced

    async def test_rows_sharing_kind_name_and_payload_bind_them_once(
            self, tmp_path: Path) -> None:
        """A statement whose rows share kind, name and payload binds those once (plain
        steps; equal texts of other events too); every field is stored as given (None
        as NULL), and a lone surrogate in a shared payload is still replaced."""
        runs, steps = 64, 32
        db = tmp_path / "k.duckdb"
        shared: list[int] = []
        async with JournalAudit.open(db, flush_interval=3600) as audit:
            await audit.journal.transact()  # the journal exists; connections are open
            recs = [await audit.start_run(RunInfo(name=f"r{i}")) for i in range(runs)]
            await audit.flush()  # the runs' rows and run_starts: events only from here
            stats = audit.journal.store.stats

            async def flush() -> None:
                before = stats.shared_rows
                await audit.flush()
                shared.append(stats.shared_rows - before)

            for n in range(steps):
                for rec in recs:
                    rec.on_step(n, Step(), n / 1000)
            await flush()
            for rec in recs:
                rec.log_event("note", name="same", payload={"k": 1}, duration_ms=2.5)
            await flush()
            for rec in recs:
                rec.log_event("tick", payload={"t": "\ud800"})
            await flush()
            for i, rec in enumerate(recs):  # kinds, names or payloads that differ
                rec.log_event("mixed", name=f"n{i % 2}", payload={"k": 1}, iteration=i)
            await flush()
        assert shared == [runs * steps, runs, 0, 0]
        with closing(sqlite3.connect(journal_path(db))) as con:
            rows = con.execute("SELECT run_id, seq, kind, iteration, name, duration_ms, "
                               "payload FROM events WHERE kind != 'run_start' "
                               "ORDER BY run_id, seq").fetchall()
            in_order = con.execute("SELECT run_id, seq FROM events ORDER BY id").fetchall()
        assert len(rows) == runs * (steps + 3)
        for rec in recs:  # ids follow the buffer's order: each run's seqs rise with them
            seqs = [seq for rid, seq in in_order if rid == rec.run_id]
            assert seqs == sorted(seqs), seqs
        plain = '{"final":false,"tool_calls":0}'
        for i, rec in enumerate(recs):
            mine = [row[1:] for row in rows if row[0] == rec.run_id]
            assert mine == (
                [(1 + n, "step", n, None, pytest.approx(float(n)), plain) for n in range(steps)]
                + [(steps + 1, "note", None, "same", 2.5, '{"k":1}'),
                   (steps + 2, "tick", None, None, None, '{"t":"?"}'),
                   (steps + 3, "mixed", i, f"n{i % 2}", None, '{"k":1}')]), mine

    async def test_runs_starting_and_closing_together_keep_every_field(
            self, tmp_path: Path) -> None:
        """Runs opened in one transaction and closed in one (their rows written a column
        at a time) store each field as given: None as NULL, numbers, inputs, a lone
        surrogate replaced in a name and an output."""
        from kernel import RunStats, Usage

        runs = 6
        statements: list[str] = []
        db = tmp_path / "k.duckdb"
        async with JournalAudit.open(db, flush_interval=3600) as audit:
            await audit.journal.transact()  # the journal exists: the next batch is general
            infos = [RunInfo(name=f"r{i}" if i != 2 else "odd\udcff",
                             subject_id=f"s{i}" if i % 2 else "", caller_id="ci" if i == 3 else "",
                             parent_run_id="p" if i == 5 else None,
                             inputs={"i": i} if i % 3 else {}) for i in range(runs)]
            audit.journal.store.trace(statements.append)
            recs = [await audit.start_run(info) for info in infos]
            await audit.flush()  # the runs' rows: one transaction
            stats = [RunStats(Status.OK if i % 2 else Status.ERROR,
                              output=None if i == 0 else f"out{i}" + ("\udcff" if i == 1 else ""),
                              error=None if i % 2 else f"err{i}", reason=f"why{i}" if i else None,
                              steps=i, tool_calls=i * 2, runtime_seconds=0.5 * i,
                              usage=Usage(input_tokens=i, cost_usd=0.25 * i),
                              exit_code=None if i == 4 else i)
                     for i in range(runs)]
            for rec, st in zip(recs, stats, strict=True):  # closing together: buffered,
                rec.closed = True                          # as `close` does, then one write
                audit.journal.pending.closes.append((rec, rec._end(st)))
            await audit.flush()
            audit.journal.store.trace(None)
        assert sum(s.startswith("INSERT INTO runs") for s in statements) == 1
        closing_rows = [s for s in statements if s.startswith("UPDATE runs SET ended_at")]
        assert len(closing_rows) == 1 and "FROM (VALUES" in closing_rows[0], closing_rows
        with closing(sqlite3.connect(journal_path(db))) as con:
            con.row_factory = sqlite3.Row
            rows = {r["run_id"]: dict(r) for r in con.execute("SELECT * FROM runs")}
            starts = {r["run_id"]: dict(r) for r in con.execute(
                "SELECT * FROM events WHERE kind = 'run_start'")}
        for i, info in enumerate(infos):
            row, start, st = rows[info.run_id], starts[info.run_id], stats[i]
            assert row["name"] == start["name"] == ("odd?" if i == 2 else f"r{i}")
            assert (row["subject_id"], row["caller_id"], row["parent_run_id"]) == (
                info.subject_id, info.caller_id, info.parent_run_id)
            assert json.loads(row["inputs"]) == info.inputs
            assert json.loads(start["payload"]) == {"inputs": info.inputs,
                                                     "caller_id": info.caller_id}
            assert (start["seq"], start["iteration"], start["duration_ms"]) == (0, None, None)
            assert row["first_event"] == start["id"]
            assert row["status"] == str(st.status)
            assert row["output"] == (None if i == 0 else "out1?" if i == 1 else f"out{i}")
            assert (row["error"], row["reason"], row["exit_code"]) == (
                st.error, st.reason, st.exit_code)
            assert (row["steps"], row["tool_calls"], row["runtime_seconds"]) == (
                i, i * 2, 0.5 * i)
            assert (row["input_tokens"], row["cost_usd"]) == (i, 0.25 * i)
            assert row["output_truncated"] == 0

    async def test_saves_of_concurrent_runs_share_transactions(self, tmp_path: Path) -> None:
        """Runs that finish a step together save in one transaction (group commit), and
        each save is durable before its run's next step starts."""
        from batteries.checkpoint import JournalCheckpointer
        from kernel import Limits, RunContext

        runs, steps = 40, 5
        db = tmp_path / "k.duckdb"
        lagging: list[tuple[int, int]] = []
        async with JournalAudit.open(db, flush_interval=3600) as audit:
            cp = JournalCheckpointer(audit.journal)
            kernel = Kernel(Ports(audit=audit, checkpointer=cp))
            store = audit.journal.store
            con = sqlite3.connect(journal_path(db), isolation_level=None)

            async def one(i: int) -> None:
                info = RunInfo(name=f"r{i}")
                await cp.register(info.run_id, {"agent": {"kind": "test"}})

                async def step(ctx: RunContext) -> Step:
                    row = con.execute("SELECT steps FROM checkpoints WHERE run_id = ?",
                                      (info.run_id,)).fetchone()
                    saved = row[0] if row else 0
                    if saved != ctx.iteration:
                        lagging.append((ctx.iteration, saved))
                    return Step(final=ctx.iteration == steps - 1)

                agent = ScriptedAgent(then=step, snapshot_state=lambda: {"s": 1})
                result = await kernel.run(agent, info, Limits())
                assert result.status is Status.OK

            await audit.journal.transact()
            before = store.stats.transactions
            async with trio.open_nursery() as nursery:
                for i in range(runs):
                    nursery.start_soon(one, i)
            used = store.stats.transactions - before
            con.close()
        assert lagging == []
        # One transaction per run and step would be 40 x 4 saves + 40 closes = 200.
        assert used <= 4 * (steps + 2), used

    def test_a_busy_process_checkpoints_the_wal_in_a_thread_of_its_own(
            self, tmp_path: Path) -> None:
        """Every CHECKPOINT_EVERY commits, a worker thread of the store runs a PASSIVE
        checkpoint (not the committing thread, whose commit never waits for one);
        closing the store stops the thread."""
        import threading

        from batteries.store import _sqlite
        from batteries.store._types import RegisterRun

        store = SQLiteStore(tmp_path / "j.sqlite")
        owner = Owner.me()
        for i in range(_sqlite.CHECKPOINT_EVERY * 20):
            store.commit(None, [RegisterRun(f"r{i}", {"big": "x" * 3000}, owner)])
        # Wait for the thread (never a sleep as the bound): it has work due.
        deadline = 600
        while store.wal_checkpoints < 1 and deadline > 0:
            threading.Event().wait(0.05)
            deadline -= 1
        assert store.wal_checkpoints >= 1  # (how far it got under load is not asserted)
        threads = [t for t in threading.enumerate() if t.name.startswith("journal-checkpoint")]
        assert threads
        store.close()
        assert not any(t.is_alive() for t in threads)
        assert len(store.saved_runs()) == _sqlite.CHECKPOINT_EVERY * 20  # reopens

    async def test_big_transactions_checkpoint_the_wal_before_many_commits(
            self, tmp_path: Path) -> None:
        """A process whose few commits write many events still checkpoints in its thread
        (after CHECKPOINT_EVENTS events), before SQLite's backstop would in a commit."""
        import threading

        from batteries.store import _sqlite

        async with JournalAudit.open(tmp_path / "k.duckdb") as audit:
            rec = await audit.start_run(RunInfo(name="chatty"))
            for i in range(_sqlite.CHECKPOINT_EVENTS):
                rec.log_event("line", payload={"i": i})
            await audit.flush()
            store = audit.journal.store
            assert isinstance(store, SQLiteStore)
            assert store.stats.transactions < _sqlite.CHECKPOINT_EVERY
            deadline = 600  # wait for the thread (never a sleep as the bound)
            while store.wal_checkpoints < 1 and deadline > 0:
                threading.Event().wait(0.05)
                deadline -= 1
            assert store.wal_checkpoints >= 1

    def test_a_fleet_of_short_processes_still_checkpoints_the_wal(
            self, tmp_path: Path) -> None:
        """Processes that each commit a couple of times never start a checkpointer
        thread; SQLite's automatic checkpoint (at AUTOCHECKPOINT_PAGES) still bounds the
        WAL, even while another connection keeps the file open (so no close is the
        last one, which would checkpoint too)."""
        from batteries.store import _sqlite
        from batteries.store._types import RegisterRun

        path = tmp_path / "j.sqlite"
        first = SQLiteStore(path)
        first.commit(None, [RegisterRun("r", {}, Owner.me())])
        with closing(sqlite3.connect(path)) as held:
            held.execute("SELECT count(*) FROM runs").fetchone()
            for i in range(1500):  # ~3 pages each: several AUTOCHECKPOINT_PAGES
                store = SQLiteStore(path)
                store.commit(None, [RegisterRun(f"r{i}", {"big": "x" * 3000}, Owner.me())])
                store.commit(None, [RegisterRun(f"s{i}", {"big": "y" * 3000}, Owner.me())])
                store.close()
                assert store.wal_checkpoints == 0
            wal = os.path.getsize(f"{path}-wal")
        page = 4096 + 24
        assert wal <= (_sqlite.AUTOCHECKPOINT_PAGES + 64) * page, wal
        first.close()

    async def test_a_purge_of_every_run_never_hands_out_a_synced_id_again(
            self, tmp_path: Path) -> None:
        """After a purge of every run, the next run's events get new ids (events are
        AUTOINCREMENT) and reach the analysts' file: reused ids were skipped as synced."""
        import time

        db = tmp_path / "k.duckdb"
        async with JournalAudit.open(db) as audit:
            await Kernel(Ports(audit=audit)).run(ScriptedAgent([Step(final=True)]))
        sync(db)
        SQLiteStore(journal_path(db)).purge(time.time_ns() // 1000 + 10**6)
        info = RunInfo(name="after the purge")
        async with JournalAudit.open(db) as audit:
            await Kernel(Ports(audit=audit)).run(ScriptedAgent([Step(), Step(final=True)]),
                                                 info)
        assert sync(db).events == 4
        with Store(db).reader() as cur:
            assert cur.execute("SELECT count(*) FROM events WHERE run_id = ?",
                               [info.run_id]).fetchall() == [(4,)]
        # Purged again: one id mark is left (the first one is superseded), never synced.
        from batteries.store._sqlite import ID_MARK

        SQLiteStore(journal_path(db)).purge(time.time_ns() // 1000 + 10**6)
        with closing(sqlite3.connect(journal_path(db))) as con:
            marks = con.execute("SELECT id, run_id FROM events").fetchall()
            assert marks == [(con.execute("SELECT max(id) FROM events").fetchone()[0], "")]
            assert con.execute("SELECT kind FROM events").fetchall() == [(ID_MARK,)]
        assert sync(db).events == 0
