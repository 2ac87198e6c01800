"""A store that goes away for a while: no audit row is lost.

A PostgreSQL server stopped (fast shutdown, as `pg_ctl stop -m fast`) and started
again while runs write to it: the writes wait for it (up to the lock timeout,
as for a taken lock) and every row lands. The `Journal`'s exit flush retries a
transient failure for at most the store's lock timeout, then reports what it
could not write. The embedded journal's failures are classified the same way:
a locked journal is transient, a disk I/O error is not.

The server here is this module's own (it is stopped and started), not the
session's `pg_server`. Nothing waits on the clock: each step waits for what it
needs (the store's "trying again" warning, the server's "ready" log line).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
from pg_server import PgServer, _die_with_parent, find_bindir, server_or_skip

from batteries.audit import JournalAudit
from batteries.store import Batch, Journal, Op, SQLiteStore, StoreBusyError, StoreError
from batteries.store import journal_path as journal_path_of
from batteries.store._journal import transient
from batteries.store._sqlite import WouldBlock
from kernel import RunInfo, RunStats, Status

pytestmark = pytest.mark.realtime

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def module_server() -> Iterator[PgServer]:
    """A PostgreSQL server of this module's own: the tests stop and start it."""
    yield from server_or_skip()


@pytest.fixture
def server(module_server: PgServer) -> Iterator[PgServer]:
    """The module's server, running again after each test, whatever the test did (a test
    that failed while it was stopped must not fail the next ones)."""
    yield module_server
    if module_server.proc.poll() is not None:
        resume(module_server)


def halt(server: PgServer) -> None:
    """Fast shutdown (SIGINT, what `pg_ctl stop -m fast` sends); wait until it is down."""
    server.proc.send_signal(signal.SIGINT)
    server.proc.wait(timeout=120)


def resume(server: PgServer) -> None:
    """Start postgres again on the same data directory and port; wait until it is ready."""
    bindir = find_bindir()
    assert bindir is not None
    kwargs: dict[str, Any] = {}
    if server.user is not None:
        pw = pwd.getpwnam(server.user)
        kwargs = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
    proc = subprocess.Popen(
        [str(bindir / "postgres"), "-D", str(server.root / "data"), "-p", str(server.port),
         "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={server.root}",
         "-c", "fsync=off", "-c", "max_connections=200", "-c", "logging_collector=off"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "LC_ALL": "C", "LANG": "C"}, cwd=server.root,
        preexec_fn=_die_with_parent(), **kwargs)
    server.proc = proc
    server.log = []  # `_wait_ready` looks for the ready line in this server's log only
    assert server._wait_ready(120), "".join(server.log[-20:])


class _Seen(logging.Handler):
    """Sets `event` when a record whose message holds `text` is logged."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


@pytest.fixture
def retrying() -> Iterator[threading.Event]:
    """Set when the PostgreSQL store says it found the server unreachable and waits."""
    seen = _Seen("trying again")
    logger = logging.getLogger("kernel.store")
    # Whatever an earlier test did to logging (the CLI's own set-up, run in process,
    # raises the kernel's loggers to ERROR or disables loggers made before it), this
    # logger must emit its warning here.
    was = (logger.disabled, logger.level)
    logger.disabled = False
    logger.setLevel(logging.WARNING)
    logger.addHandler(seen)
    try:
        yield seen.event
    finally:
        logger.removeHandler(seen)
        logger.disabled, logger.level = was


def _query(url: str, sql: str) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(url) as con:
        return list(con.execute(sql).fetchall())


# ------------------------------------------------------------ PostgreSQL: rows land


async def test_rows_written_while_the_server_restarts_all_land(
        server: PgServer, retrying: threading.Event) -> None:
    """The server stops after a run opened (its connection is open) and before the run
    closes: the close waits for the server instead of failing, and once it is back every
    event, the run's roll-up and the checkpoint-free run row are written (none dropped)."""
    from batteries.store import PostgresStore

    url = server.create_database()
    store = PostgresStore(url, lock_timeout=120)  # generous: the restart ends the wait
    async with Journal.open(store=store, flush_interval=3600) as journal:
        audit = JournalAudit(journal)
        rec = await audit.start_run(RunInfo(name="outage"))
        for i in range(50):
            rec.log_event("tick", payload={"i": i})
        await audit.flush()  # the server is up: the run's row and 50 events, a connection
        await trio.to_thread.run_sync(halt, server)
        for i in range(50, 100):
            rec.log_event("tick", payload={"i": i})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rec.close, RunStats(Status.OK))
            # The close's write found the server gone and waits for it.
            assert await trio.to_thread.run_sync(retrying.wait, 120)
            await trio.to_thread.run_sync(resume, server)
    assert journal.unwritten == 0 and journal.last_error is None
    [(rid, status)] = _query(url, "SELECT run_id, status FROM kernel.runs")
    assert (rid, status) == (rec.run_id, "ok")
    rows = _query(url, "SELECT seq, kind, payload FROM kernel.events ORDER BY seq")
    assert [seq for seq, _, _ in rows] == list(range(len(rows)))
    ticks = [json.loads(p)["i"] for _, kind, p in rows if kind == "tick"]
    assert ticks == list(range(100))


async def test_rows_the_server_cannot_take_at_exit_are_spilled_and_written_once(
        server: PgServer, tmp_path: Path) -> None:
    """The server stays down past the lock timeout while a run closes and its process
    exits: the close and the last events are kept in a spill file on this machine
    (before: dropped, the run `running` for ever); the next process that writes to
    the store once it is back writes them, once."""
    from batteries.store import PostgresStore
    from kernel import AuditError

    url = server.create_database()
    # Spills go beside the default analysts' file: $KERNEL_DB is tmp_path/kernel.duckdb.
    store = PostgresStore(url, lock_timeout=0.5)
    async with Journal.open(store=store, flush_interval=3600) as journal:
        audit = JournalAudit(journal)
        rec = await audit.start_run(RunInfo(name="outage at exit"))
        for i in range(10):
            rec.log_event("tick", payload={"i": i})
        await audit.flush()  # the run's row and its first 10 events are on the server
        await trio.to_thread.run_sync(halt, server)
        for i in range(10, 20):
            rec.log_event("tick", payload={"i": i})
        with contextlib.suppress(AuditError):  # the server is gone: kept for the exit flush
            await rec.close(RunStats(Status.OK))
    assert journal.unwritten == 0 and journal.spilled > 0
    [spill] = [p for p in tmp_path.iterdir() if ".spill-" in p.name]
    assert spill == journal.spill_path and spill.name.startswith(store.spill_prefix)
    await trio.to_thread.run_sync(resume, server)
    assert _query(url, "SELECT status FROM kernel.runs") == [(None,)]
    for _ in range(2):  # a second writer finds nothing to write
        again = PostgresStore(url)
        again.commit(None, [])
        again.close()
        assert not spill.exists()
        assert _query(url, "SELECT status FROM kernel.runs") == [("ok",)]
        rows = _query(url, "SELECT seq, kind, payload FROM kernel.events ORDER BY seq")
        assert [seq for seq, _, _ in rows] == list(range(len(rows)))
        assert [json.loads(p)["i"] for _, kind, p in rows if kind == "tick"] == list(range(20))


def test_a_command_run_finished_during_an_outage_is_recorded(
        server: PgServer, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """The reviewer's case: `kernel run --json --store URL` whose command ends while the
    server is stopped. The run's close waits for the server (a warning says so), the run
    ends ok with no port failure, and the store has it ok with its checkpoint completed
    (before: its rows were dropped and the run stayed `running` for ever)."""
    url = server.create_database()
    started, go = tmp_path / "started", tmp_path / "go"
    os.mkfifo(started)
    os.mkfifo(go)
    script = f"echo up > {started}; read x < {go}; echo done"
    env = {**cli_env, "KERNEL_AUDIT_LOCK_TIMEOUT": "120", "KERNEL_LOG_LEVEL": "warning"}
    proc = subprocess.Popen([kernel_exe, "run", "--json", "--store", url, "--",
                             "sh", "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        assert started.read_text() == "up\n"  # the run is open and its command running
        halt(server)
        go.write_text("go\n")  # the command ends: the run closes while the server is down
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "trying again" in line:
                break
        assert "trying again" in "".join(lines), "".join(lines)
        resume(server)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    doc = json.loads(out)
    assert doc["status"] == "ok" and doc["output"] == "done"
    assert doc["port_failures"] == []
    assert "could not be written" not in err and "dropped" not in err
    assert _query(url, "SELECT status FROM kernel.runs") == [("ok",)]
    assert _query(url, "SELECT status FROM kernel.checkpoints") == [("completed",)]


# ------------------------------------------------------- the Journal's exit flush


class FlakyStore:
    """A hand-written `RunStore` over a real `SQLiteStore` whose first `fail` commits
    raise `error` (each one counted in `attempts`); everything else is the real store's."""

    def __init__(self, inner: SQLiteStore, error: StoreError, *, fail: int,
                 lock_timeout: float) -> None:
        self.inner = inner
        self.error = error
        self.fail = fail
        self.lock_timeout = lock_timeout
        self.attempts = 0
        self.legacy = inner.legacy

    @property
    def path(self) -> Path:
        return self.inner.path

    def commit(self, batch: Batch | None, ops: Sequence[Op] = (), *,
               wait: bool = True) -> list[Any]:
        if not wait:
            raise WouldBlock  # every write in a worker thread
        self.attempts += 1
        if self.fail > 0:
            self.fail -= 1
            raise self.error
        return self.inner.commit(batch, ops)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _flaky(tmp_path: Path, error: StoreError, *, fail: int, lock_timeout: float) -> FlakyStore:
    db = tmp_path / "kernel.duckdb"
    return FlakyStore(SQLiteStore(journal_path_of(db), legacy=db), error, fail=fail,
                      lock_timeout=lock_timeout)


def _events(store: FlakyStore) -> int:
    with sqlite3.connect(store.inner.path) as con:
        return int(con.execute("SELECT count(*) FROM events").fetchone()[0])


async def _write_at_exit(store: FlakyStore, events: int) -> Journal:
    """Buffer a run's start and `events` events; exit the journal (its exit flush writes)."""
    async with Journal.open(store=store, flush_interval=3600) as journal:
        rec = await JournalAudit(journal).start_run(RunInfo(name="at exit"))
        for i in range(events):
            rec.log_event("tick", payload={"i": i})
    return journal


async def test_the_exit_flush_retries_a_transient_failure(tmp_path: Path) -> None:
    """The store is unreachable (busy) for the exit flush's first three tries: the rows are
    kept and written by the fourth, none dropped (before: one try, then dropped)."""
    store = _flaky(tmp_path, StoreBusyError("the server is unreachable"), fail=3,
                   lock_timeout=120)
    journal = await _write_at_exit(store, 20)
    assert store.attempts == 4
    assert journal.unwritten == 0 and journal.last_error is None
    assert _events(store) == 1 + 20


async def test_the_exit_flush_spills_after_the_lock_timeout(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A store that never comes back: the exit flush retries, gives up once the lock
    timeout is spent and keeps the rows in a spill file, saying where (before: counted
    as unwritten and dropped); the next writer writes them."""
    store = _flaky(tmp_path, StoreBusyError("the server is unreachable"), fail=10**9,
                   lock_timeout=0.3)
    with caplog.at_level(logging.WARNING, logger="kernel.journal"):
        journal = await _write_at_exit(store, 20)
    assert store.attempts >= 2  # it was retried
    assert journal.unwritten == 0 and journal.spilled == 20
    [record] = [r for r in caplog.records if "could not be written" in r.getMessage()]
    assert "20 events" in record.getMessage() and "unreachable" in record.getMessage()
    assert journal.spill_path is not None and str(journal.spill_path) in record.getMessage()
    store.inner.commit(None, [])  # the next write (another process's, as well)
    assert _events(store) == 1 + 20 and not journal.spill_path.exists()


async def test_a_write_the_store_refuses_is_not_retried(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A failure that is not transient (a value the store will never take) is not waited
    on: one try at exit, then the rows are kept in a spill file for the next writer."""
    store = _flaky(tmp_path, StoreError("a value the store refuses"), fail=10**9,
                   lock_timeout=120)
    with caplog.at_level(logging.WARNING, logger="kernel.journal"):
        journal = await _write_at_exit(store, 5)
    assert store.attempts == 1
    assert journal.unwritten == 0 and journal.spilled == 5
    assert any("could not be written" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------- the embedded journal


def test_a_locked_journal_is_transient(tmp_path: Path) -> None:
    """Another connection holds the journal's write lock: `StoreBusyError` (kept, retried)."""
    db = tmp_path / "kernel.duckdb"
    store = SQLiteStore(journal_path_of(db), legacy=db, lock_timeout=0.1)
    store.commit(None, [])  # the journal exists
    holder = sqlite3.connect(store.path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(StoreError) as info:
            store.commit(None, [])
        assert isinstance(info.value, StoreBusyError) and transient(info.value)
    finally:
        holder.close()
        store.close()


DISK_IO = textwrap.dedent("""
    import json, os, resource, signal, sys
    from pathlib import Path
    from batteries.store import SQLiteStore, StoreError, SetBudget
    from batteries.store._journal import transient
    store = SQLiteStore(Path(sys.argv[1]), lock_timeout=1)
    store.commit(None, [])
    # Files may grow no more: the next write of the journal fails in the kernel (EFBIG).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    size = max(p.stat().st_size for p in Path(sys.argv[1]).parent.iterdir())
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
    try:
        for i in range(1000):
            store.commit(None, [SetBudget("c%d" % i * 100, 60.0, 1, None, None, None)])
    except StoreError as exc:
        print(json.dumps({"type": type(exc).__name__, "transient": transient(exc),
                          "message": str(exc)}))
""")


def test_a_disk_io_error_is_not_transient(tmp_path: Path) -> None:
    """A real disk I/O error (the file size limit hit, in a process of its own): a plain
    `StoreError`, not a busy journal (a batch that meets it twice is dropped)."""
    path = tmp_path / "io" / "kernel.duckdb.journal"
    path.parent.mkdir()
    proc = subprocess.run([sys.executable, "-c", DISK_IO, str(path)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert found["type"] == "StoreError" and found["transient"] is False, found
    assert "disk I/O error" in found["message"], found
