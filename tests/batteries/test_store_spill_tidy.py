"""Spill files made visible and tidy: the audit says what it spilled and where, the
temporary files of writers killed mid-write are removed, and the `meta` keys that make a
replay exactly-once are pruned once no file of theirs is left.

Real parts throughout: SQLite files, a second connection holding the journal's write
lock, real processes (dead ones, live ones), a real PostgreSQL server for its store.
Nothing waits on the clock: a process boundary is crossed by waiting for what it does
(a process's exit, a backend waiting on a lock).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from batteries.audit import JournalAudit
from batteries.store import Batch, Journal, SQLiteStore, journal_path
from batteries.store import _sqlite as sqlite_store
from kernel import AuditError, RunInfo, RunStats, Status

pytestmark = pytest.mark.realtime

PATIENCE = 120.0  # bounds on waits for another process: only ever reached by a hang
PREFIX = "k.duckdb.journal"


#: Older than the bound past which a dead writer's temporary spill is removed (checked
#: against `SPILL_TMP_STALE` by the tests that use it).
STALE_AGE = 2 * 86400.0


class Rec:
    """A recorder as the store sees one (`RecorderRef`): hand-written, no audit."""

    def __init__(self, info: RunInfo, *, base: int | None, count: int) -> None:
        self.run_id = info.run_id
        self.info = info
        self.started_us = 1_700_000_000_000_000
        self.count = count
        self.base = base
        self.host = "spill-host"
        self.pid = 4242


def opening_and_events(run_id: str, n: int) -> Batch:
    """A batch that opens run `run_id` and records `n` events of it."""
    rec = Rec(RunInfo(name="spilled", run_id=run_id), base=None, count=n)
    batch = Batch(new=[rec])
    for i in range(n):
        batch.recs.append(rec)
        batch.seqs.append(i)
        batch.ts.append(1_700_000_000_000_000 + i)
        batch.kinds.append("tick")
        batch.iters.append(None)
        batch.names.append(None)
        batch.durs.append(None)
        batch.payloads.append(json.dumps({"i": i}))
    return batch


def spill_keys(path: Path) -> list[str]:
    with sqlite3.connect(path) as con:
        return sorted(k for (k,) in con.execute(
            "SELECT key FROM meta WHERE key LIKE 'spill:%'"))


def events(path: Path) -> int:
    with sqlite3.connect(path) as con:
        return int(con.execute("SELECT count(*) FROM events").fetchone()[0])


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=PATIENCE)
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, 0)
        pytest.skip("the dead process's pid was taken again at once")
    return proc.pid


def leftover(directory: Path, prefix: str, pid: int, *, age: float = 0.0,
             n: int = 0) -> Path:
    """A spill's temporary file as a writer killed before its rename leaves it, last
    written `age` seconds ago."""
    path = directory / f".{prefix}.spill-{pid}-{n:032x}.tmp"
    path.write_text('{"format": "kernel-journal-spill", "version": 1, "id": "')  # cut short
    if age:
        when = time.time() - age
        os.utime(path, (when, when))
    return path


def commit_once(path: Path) -> None:
    """What the next `kernel` command that writes the journal does first."""
    store = SQLiteStore(path)
    try:
        store.commit(None, [])
    finally:
        store.close()


# ----------------------------------------------------------- the audit says so


def test_the_audit_says_what_it_kept_in_a_spill_file_and_where(tmp_path: Path) -> None:
    """`JournalAudit.spilled` / `spill_path`, next to `unwritten`: a host can tell its user
    where the rows went when the journal stayed locked past the timeout at exit (before:
    only the journal had them)."""
    db = tmp_path / "kernel.duckdb"
    path = journal_path(db)
    SQLiteStore(path).commit(None, [])
    holder = sqlite3.connect(path, isolation_level=None, timeout=0)

    async def main() -> tuple[JournalAudit, Journal]:
        async with Journal.open(db, lock_timeout=0.3, flush_interval=3600) as journal:
            audit = JournalAudit(journal)
            assert (audit.spilled, audit.spill_path, audit.unwritten) == (0, None, 0)
            rec = await audit.start_run(RunInfo(name="closes locked"))
            await audit.flush()  # its row is in the journal
            holder.execute("BEGIN EXCLUSIVE")
            for i in range(4):
                rec.log_event("tick", payload={"i": i})
            with contextlib.suppress(AuditError):  # locked: kept for the exit flush
                await rec.close(RunStats(Status.OK))
        return audit, journal

    try:
        audit, journal = trio.run(main)
    finally:
        if holder.in_transaction:
            holder.execute("ROLLBACK")
        holder.close()
    assert audit.unwritten == 0 and audit.spilled == journal.spilled >= 5
    assert audit.spill_path == journal.spill_path
    assert audit.spill_path is not None and audit.spill_path.exists()
    assert audit.spill_path.parent == path.parent


# ------------------------------------------------------ leftovers of dead writers


def test_a_dead_writer_s_temporary_spill_is_removed_by_the_next_writer(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A process killed while it wrote its spill (before the rename) leaves a hidden
    `.tmp`: the next writer removes it once it is old and its pid is gone (before: kept
    for ever). A fresh one (a writer on another machine sharing the directory may still
    be writing it), this process's own and another store's are left alone."""
    path = tmp_path / PREFIX
    commit_once(path)
    dead = dead_pid()
    stale = leftover(tmp_path, PREFIX, dead, age=STALE_AGE)
    fresh = leftover(tmp_path, PREFIX, dead, n=1)
    mine = leftover(tmp_path, PREFIX, os.getpid(), age=STALE_AGE, n=2)
    other = leftover(tmp_path, "other.journal", dead, age=STALE_AGE, n=3)
    with caplog.at_level(logging.WARNING, logger="kernel.journal"):
        commit_once(path)
    assert not stale.exists()
    assert fresh.exists() and mine.exists() and other.exists()
    [line] = [r.getMessage() for r in caplog.records if "leftover" in r.getMessage()]
    assert stale.name in line and str(dead) in line and "\n" not in line
    assert sqlite_store.SPILL_TMP_STALE < STALE_AGE


LIVE = "import sys; sys.stdin.read()"  # a process alive until its stdin closes


def test_a_live_writer_s_temporary_spill_is_kept_and_a_recycled_pid_does_not_keep_one(
        tmp_path: Path) -> None:
    """A temporary spill whose writer is alive is never removed, however old the bound
    allows; one named after a pid that a process started after the file was written
    holds (a recycled pid) is the leftover of a dead writer; once the writer is gone,
    its file goes."""
    proc = subprocess.Popen([sys.executable, "-c", LIVE], stdin=subprocess.PIPE)
    try:
        writing = leftover(tmp_path, PREFIX, proc.pid)  # written after it started
        recycled = leftover(tmp_path, PREFIX, proc.pid, age=STALE_AGE, n=1)
        assert sqlite_store.spill_files(tmp_path, PREFIX, tidy=0) == []
        assert writing.exists() and not recycled.exists()
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=PATIENCE)
    sqlite_store.spill_files(tmp_path, PREFIX, tidy=0)
    assert not writing.exists()


# ---------------------------------------------------------------- keys pruned


def test_spill_keys_are_pruned_once_no_file_of_theirs_is_left(tmp_path: Path) -> None:
    """The `meta` key `spill:<id>` used to stay for ever (one per spill). It is kept while
    its file can still be found (here: a process died between the COMMIT that wrote the
    spill and the file's removal, so the file is back), which is what keeps the file
    from being written twice, and deleted by the first writer that no longer finds it."""
    path = tmp_path / PREFIX
    commit_once(path)
    store = SQLiteStore(path)
    spill = store.spill(opening_and_events("run-s", 5), [])
    text = spill.read_text()
    commit_once(path)  # written, its key set, the file removed
    assert events(path) == 1 + 5 and not spill.exists()
    [key] = spill_keys(path)
    assert key.endswith(spill.name[-32:])
    spill.write_text(text)  # as a process that died before removing it leaves it
    commit_once(path)  # found: its key says written, so it is only removed
    assert events(path) == 1 + 5 and not spill.exists()
    assert spill_keys(path) == [key]  # it was in that transaction's listing: kept
    commit_once(path)  # nothing left of it: its key goes
    assert spill_keys(path) == [] and events(path) == 1 + 5


def test_a_spill_whose_file_stays_keeps_its_key(tmp_path: Path) -> None:
    """A key is pruned by whether its file is still found, not by its age: a spill the
    next writer cannot read now (its file unreadable) keeps every key, its own included."""
    path = tmp_path / PREFIX
    commit_once(path)
    store = SQLiteStore(path)
    first = store.spill(opening_and_events("run-a", 2), [])
    commit_once(path)
    [key] = spill_keys(path)
    first.mkdir()  # a directory under a spill's name: listed, never readable as a file
    commit_once(path)
    commit_once(path)
    assert spill_keys(path) == [key] and events(path) == 1 + 2


# --------------------------------------------------------------- PostgreSQL


def _pg(url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as con:
        cur = con.execute(sql, args or None)
        return list(cur.fetchall()) if cur.description else []


def test_postgres_leftovers_are_removed_and_its_own_keys_pruned(
        pg_url: str, tmp_path: Path) -> None:
    """The PostgreSQL store's spills live on each machine: a writer removes a dead
    writer's `.tmp` in its spill directory and prunes the keys of the spills replayed
    from that directory (tagged so in `meta`) once their files are gone; keys replayed
    from another machine's directory, or set before the tagging, are not its to prune."""
    from batteries.store import PostgresStore

    def commit() -> None:
        store = PostgresStore(pg_url, spill_dir=tmp_path, lock_timeout=PATIENCE)
        try:
            store.commit(None, [])
        finally:
            store.close()

    first = PostgresStore(pg_url, spill_dir=tmp_path, lock_timeout=PATIENCE)
    first.commit(None, [])
    first.close()
    spill = first.spill(opening_and_events("run-pg", 3), [])
    stale = leftover(tmp_path, first.spill_prefix, dead_pid(), age=STALE_AGE)
    elsewhere, legacy = "spill:" + "a" * 32, "spill:" + "b" * 32
    _pg(pg_url, "INSERT INTO kernel.meta VALUES (%s, 12345), (%s, %s)", elsewhere, legacy,
        1_700_000_000_000_000)
    commit()
    assert not spill.exists() and not stale.exists()
    mine = "spill:" + spill.name[-32:]
    assert sorted(k for (k,) in _pg(pg_url, "SELECT key FROM kernel.meta WHERE key LIKE "
                                             "'spill:%%'")) == sorted([mine, elsewhere, legacy])
    assert _pg(pg_url, "SELECT count(*) FROM kernel.events WHERE run_id = 'run-pg'") == [(4,)]
    commit()  # its file is gone: its key goes; the others stay
    assert sorted(k for (k,) in _pg(pg_url, "SELECT key FROM kernel.meta WHERE key LIKE "
                                             "'spill:%%'")) == sorted([elsewhere, legacy])
    assert _pg(pg_url, "SELECT count(*) FROM kernel.events WHERE run_id = 'run-pg'") == [(4,)]
    assert sqlite_store.SPILL_TMP_STALE < STALE_AGE


def test_postgres_a_replay_that_finds_its_file_gone_writes_nothing(
        pg_url: str, tmp_path: Path) -> None:
    """PostgreSQL writers run together: a process that read a spill file, then found its
    key missing because another wrote the spill, removed the file and a third pruned the
    key meanwhile, must not write it again. Here for real: a second connection holds the
    key (uncommitted), so the replaying process waits on it after reading the file; the
    file is removed and the key deleted before that connection commits (to the waiting
    process: written, removed, pruned). Before, it wrote the spill a second time."""
    import psycopg

    from batteries.store import PostgresStore

    first = PostgresStore(pg_url, spill_dir=tmp_path, lock_timeout=PATIENCE)
    first.commit(None, [])
    first.close()
    spill = first.spill(opening_and_events("run-race", 3), [])
    key = "spill:" + spill.name[-32:]
    holder = psycopg.connect(pg_url)
    failed: list[BaseException] = []
    replayer = PostgresStore(pg_url, spill_dir=tmp_path, lock_timeout=PATIENCE)

    def replay() -> None:
        try:
            replayer.commit(None, [])
        except BaseException as exc:  # reported by the test's thread
            failed.append(exc)

    try:
        holder.execute("INSERT INTO kernel.meta VALUES (%s, 1)", (key,))
        thread = threading.Thread(target=replay)
        thread.start()
        deadline = time.monotonic() + PATIENCE
        while not _pg(pg_url, "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                              "AND query LIKE 'INSERT INTO meta%%'"):
            assert thread.is_alive(), failed
            assert time.monotonic() < deadline, "the replay never waited on the key"
            time.sleep(0.02)
        spill.unlink()  # as the process that wrote it does after its COMMIT
        holder.execute("DELETE FROM kernel.meta WHERE key = %s", (key,))  # pruned since
        holder.commit()
        thread.join(PATIENCE)
        assert not thread.is_alive() and not failed, failed
    finally:
        holder.close()
        replayer.close()
    assert _pg(pg_url, "SELECT count(*) FROM kernel.runs WHERE run_id = 'run-race'") == [(0,)]
    assert _pg(pg_url, "SELECT count(*) FROM kernel.meta WHERE key = %s", key) == [(0,)]
