"""`SQLiteStore`: the journal every kernel process writes, one SQLite file in WAL mode.

Why SQLite in WAL mode: the journal takes many small transactions from many
processes (a run opening, a checkpoint after every step, a run closing,
budget reservations, recovery leases). In WAL mode readers never block the
writer and the writer never blocks readers; writers take turns on one
lock that each holds for tens of microseconds. A commit with
`synchronous=NORMAL` costs ~15 us here, against ~3 ms with `FULL`, which
fsyncs the WAL on every commit.

Durability (`$KERNEL_JOURNAL_SYNC`, default `normal`): with `normal` a
committed transaction survives the death of the process that wrote it
(SIGKILL, OOM, a crash): the WAL is in the operating system's page cache.
A power loss or kernel panic may lose the last transactions before the
next WAL checkpoint, never corrupt the file. `full` fsyncs every commit and
survives power loss, at ~3 ms a commit on this machine's disk.

Every write goes through `commit(batch, ops)`: one `BEGIN IMMEDIATE`
transaction that writes the audit rows buffered so far, then each
operation in order. So whatever a process has buffered rides along with
the next transaction it needs anyway (a budget reservation, a checkpoint),
and a `kernel run` opens one transaction when its run opens and one when
it closes.

Methods block and are safe to call from any thread (one connection per
store, guarded by a lock); the trio side calls them through
`trio.to_thread`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from itertools import chain
from operator import add, attrgetter
from pathlib import Path
from typing import Any

from kernel import Checkpoint, ConfigError, Status, Usage
from kernel._dataclass import dataclass

from ._files import private_dir, private_file
from ._types import (
    DELIVERY_FAILED,
    DELIVERY_PENDING,
    DELIVERY_STATES,
    RESULT_COLUMNS,
    Batch,
    BatchRow,
    CallerBudget,
    ClaimBatch,
    ClaimRun,
    CreateBatch,
    FinishBatch,
    FinishRun,
    LoseRun,
    MarkDelivery,
    Op,
    Owner,
    RegisterRun,
    ReleaseRun,
    RemoveBudget,
    Reservation,
    ReserveBudget,
    SaveCheckpoint,
    SavedRun,
    SetBudget,
    SettleBudget,
    Spill,
    SpillError,
    StoreBusyError,
    StoreError,
    TaskRow,
    decode_spill,
    encode_spill,
)

_log = logging.getLogger("kernel.journal")

#: Env var: `normal` (default) or `full` (fsync every commit).
SYNC_ENV = "KERNEL_JOURNAL_SYNC"
#: Env var: seconds to wait for the journal's write lock before giving up (default 10).
LOCK_TIMEOUT_ENV = "KERNEL_AUDIT_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 10.0
DEFAULT_CALLER = "*"

#: WAL checkpoints (copying committed pages from the WAL into the file). A process
#: checkpoints in a worker thread of its own after every `CHECKPOINT_EVERY` of its
#: commits (a PASSIVE checkpoint: it never blocks a writer or a reader), so its
#: transactions never wait for one: a checkpoint fsyncs the WAL and the file, ~1-40 ms
#: of I/O, and made every ~200th commit that long when SQLite ran it inside a commit.
#: SQLite's own automatic checkpoint stays on as the backstop, at
#: `AUTOCHECKPOINT_PAGES` WAL pages, for processes that never commit that often (a fleet
#: of short `kernel run`s: one of them checkpoints, in its commit, as before but less
#: often); after a checkpoint the WAL file is cut back to `WAL_SIZE_LIMIT` bytes.
#: A process also checkpoints after `CHECKPOINT_EVENTS` events written since the last
#: one, whatever its commits, so big transactions still checkpoint before the backstop.
#:
#: Why every 300 commits (it was 100): a page that every save rewrites (a run's row,
#: its checkpoint row, the events leaf) is copied into the file once per checkpoint,
#: so fewer checkpoints copy fewer pages; and after a checkpoint that copied the
#: whole WAL, the next commit starts the WAL over and syncs its header first, in the
#: committing thread (SQLite does that at any `synchronous` but OFF; ~0.3-3 ms on
#: this machine's disk), which now happens a third as often. Measured with a
#: checkpoint after every step: -9 % CPU per run (BENCHMARKS.md). The WAL holds
#: ~1,000-2,000 pages between checkpoints (4-8 MiB; a 10-step checkpointed run
#: writes ~38), under the backstop, and its file is kept up to `WAL_SIZE_LIMIT`.
CHECKPOINT_EVERY = 300
CHECKPOINT_EVENTS = 20_000
AUTOCHECKPOINT_PAGES = 4000
WAL_SIZE_LIMIT = 16 << 20

#: The journal schema version this code writes (SQLite's `PRAGMA user_version`).
JOURNAL_VERSION = 5

_V1 = (
    """CREATE TABLE IF NOT EXISTS runs (
        run_id TEXT PRIMARY KEY, parent_run_id TEXT, subject_id TEXT, name TEXT,
        caller_id TEXT, channel_id TEXT, inputs TEXT, started_at INTEGER NOT NULL,
        ended_at INTEGER, status TEXT, output TEXT, error TEXT, steps INTEGER,
        tool_calls INTEGER, runtime_seconds REAL, input_tokens INTEGER,
        output_tokens INTEGER, thinking_tokens INTEGER, cost_usd REAL, host TEXT,
        pid INTEGER, reason TEXT, exit_code INTEGER, output_truncated INTEGER,
        last_seq INTEGER NOT NULL DEFAULT 0, rev INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS runs_rev ON runs (rev)",
    """CREATE TABLE IF NOT EXISTS events (
        id INTEGER PRIMARY KEY, run_id TEXT NOT NULL, seq INTEGER NOT NULL,
        ts INTEGER NOT NULL, kind TEXT NOT NULL, iteration INTEGER, name TEXT,
        duration_ms REAL, payload TEXT, UNIQUE (run_id, seq))""",
    """CREATE TABLE IF NOT EXISTS checkpoints (
        run_id TEXT PRIMARY KEY, spec TEXT NOT NULL, state TEXT,
        steps INTEGER NOT NULL DEFAULT 0, tool_calls INTEGER NOT NULL DEFAULT 0,
        input_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0,
        thinking_tokens INTEGER NOT NULL DEFAULT 0, cost_usd REAL NOT NULL DEFAULT 0,
        status TEXT NOT NULL, error TEXT, host TEXT, pid INTEGER, pid_start INTEGER,
        heartbeat_at INTEGER, created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL,
        rev INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS checkpoints_status ON checkpoints (status)",
    "CREATE INDEX IF NOT EXISTS checkpoints_rev ON checkpoints (rev)",
    """CREATE TABLE IF NOT EXISTS budgets (
        caller_id TEXT PRIMARY KEY, window_seconds REAL NOT NULL, max_runs INTEGER,
        max_runtime_seconds REAL, max_tokens INTEGER, max_cost_usd REAL,
        updated_at INTEGER NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS budget_spend (
        id INTEGER PRIMARY KEY, caller_id TEXT NOT NULL, ts INTEGER NOT NULL, run_id TEXT,
        runtime_seconds REAL NOT NULL DEFAULT 0, tokens INTEGER NOT NULL DEFAULT 0,
        cost_usd REAL NOT NULL DEFAULT 0, settled INTEGER NOT NULL DEFAULT 0,
        rev INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS budget_spend_caller ON budget_spend (caller_id, ts)",
    "CREATE INDEX IF NOT EXISTS budget_spend_rev ON budget_spend (rev)",
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO meta VALUES ('rev', 0)",
)

# Batches (`kernel batch`): a batch and its tasks, each task bound to the run id
# it becomes when the batch is created. A task's state is its run's (no row per
# task changes while the batch runs); the batch row is its lease, like a checkpoint.
_V2 = (
    """CREATE TABLE IF NOT EXISTS batches (
        batch_id TEXT PRIMARY KEY, name TEXT, source TEXT, created_at INTEGER NOT NULL,
        ended_at INTEGER, status TEXT NOT NULL, tasks INTEGER NOT NULL,
        concurrency INTEGER NOT NULL, options TEXT, host TEXT, pid INTEGER,
        pid_start INTEGER, rev INTEGER NOT NULL)""",
    "CREATE INDEX IF NOT EXISTS batches_rev ON batches (rev)",
    """CREATE TABLE IF NOT EXISTS batch_tasks (
        batch_id TEXT NOT NULL, idx INTEGER NOT NULL, task_id TEXT NOT NULL,
        run_id TEXT NOT NULL, spec TEXT NOT NULL, rev INTEGER NOT NULL,
        PRIMARY KEY (batch_id, idx), UNIQUE (batch_id, task_id))""",
    "CREATE INDEX IF NOT EXISTS batch_tasks_run ON batch_tasks (run_id)",
    "CREATE INDEX IF NOT EXISTS batch_tasks_rev ON batch_tasks (rev)",
)

#: Version 3: no `UNIQUE (run_id, seq)` index on events. Each insert into that
#: index touched one leaf page per run, so at 10,000 concurrent runs it was most of
#: the write path (1M events: ~10 s of CPU with it, ~1 s without). What it
#: guaranteed is now kept by the runs row: `runs.last_seq` is the run's last
#: committed seq, written in every transaction that writes the run's events, and
#: only if each new seq is above it (see `SQLiteStore._write_batch`): seqs are
#: unique per run, and a resumed run reads its next seq from one row. What read
#: one run's events through the index (`payloads`) starts at `runs.first_event`,
#: the id of the run's first event in the journal. The table is rebuilt (ids kept:
#: they are the analysts' sync cursor), with AUTOINCREMENT (until version 4): an id
#: is never handed out twice, even after a purge deleted the newest events (without
#: it SQLite numbers a new row after the highest id left, and the sync, which copies
#: ids above its cursor, would skip the new events for good).
_V3 = (
    "UPDATE runs SET last_seq = max(last_seq, coalesce((SELECT max(seq) FROM events e "
    "WHERE e.run_id = runs.run_id), 0))",
    "ALTER TABLE runs ADD COLUMN first_event INTEGER",
    "UPDATE runs SET first_event = (SELECT min(id) FROM events e WHERE e.run_id = runs.run_id)",
    """CREATE TABLE events_v3 (
        id INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, seq INTEGER NOT NULL,
        ts INTEGER NOT NULL, kind TEXT NOT NULL, iteration INTEGER, name TEXT,
        duration_ms REAL, payload TEXT)""",
    "INSERT INTO events_v3 (id, run_id, seq, ts, kind, iteration, name, duration_ms, payload) "
    "SELECT id, run_id, seq, ts, kind, iteration, name, duration_ms, payload FROM events",
    "DROP TABLE events",
    "ALTER TABLE events_v3 RENAME TO events",
)

#: The `kind` of an id mark: a row of no run (`run_id` '') that holds the highest event
#: id ever handed out once a purge deleted the event that had it (see version 4).
ID_MARK = "id_mark"

#: Version 4: events without AUTOINCREMENT. AUTOINCREMENT kept the highest id ever
#: handed out in `sqlite_sequence`, a row every insert into events rewrote: one WAL
#: page more per transaction (a checkpoint save wrote 4 pages: the runs row, the
#: events leaf, the checkpoint row and that one), ~5 us of each save. What it
#: guaranteed (an id is never handed out twice, so the sync, which copies ids above
#: its cursor, never skips an event) is kept by the table itself: SQLite numbers a
#: new row after the highest id in the table, and a purge that deletes the event
#: with the highest id leaves an *id mark* in its place (`ID_MARK`; run_id '', never
#: copied to the analysts' file, superseded marks deleted by the next purge). The
#: table is rebuilt once (ids kept), with a mark where `sqlite_sequence` was above
#: the highest id left (a purge under version 3 deleted the newest events).
_V4 = (
    """CREATE TABLE events_v4 (
        id INTEGER PRIMARY KEY, run_id TEXT NOT NULL, seq INTEGER NOT NULL,
        ts INTEGER NOT NULL, kind TEXT NOT NULL, iteration INTEGER, name TEXT,
        duration_ms REAL, payload TEXT)""",
    "INSERT INTO events_v4 (id, run_id, seq, ts, kind, iteration, name, duration_ms, payload) "
    "SELECT id, run_id, seq, ts, kind, iteration, name, duration_ms, payload FROM events",
    "INSERT INTO events_v4 (id, run_id, seq, ts, kind) "
    f"SELECT seq, '', 0, 0, '{ID_MARK}' FROM sqlite_sequence WHERE name = 'events' "
    "AND seq > (SELECT coalesce(max(id), 0) FROM events)",
    "DROP TABLE events",
    "ALTER TABLE events_v4 RENAME TO events",
)

#: Version 5: where each batch task's delivery stands (`TaskRow.delivery`): `pending`
#: (owed: marked before its run starts, so a batch process that dies before the result
#: was delivered leaves it owed and `kernel batch --resume` delivers it), `delivered`,
#: `failed` (with `delivery_error`), NULL (nothing to deliver). A mark moves its rows'
#: rev, so the analysts' copy of batch_tasks (which has both columns) follows it.
_V5 = (
    "ALTER TABLE batch_tasks ADD COLUMN delivery TEXT",
    "ALTER TABLE batch_tasks ADD COLUMN delivery_error TEXT",
)

#: Every journal migration, in order (index + 1 = the version it brings). Append only.
MIGRATIONS: tuple[tuple[str, ...], ...] = (_V1, _V2, _V3, _V4, _V5)

#: Columns `changes()` yields for each table, in order.
EVENT_COLUMNS = ("id", "run_id", "seq", "ts", "kind", "iteration", "name", "duration_ms",
                 "payload")
RUN_COLUMNS = ("run_id", "parent_run_id", "subject_id", "name", "caller_id", "channel_id",
               "inputs", "started_at", "ended_at", "status", "output", "error", "steps",
               "tool_calls", "runtime_seconds", "input_tokens", "output_tokens",
               "thinking_tokens", "cost_usd", "host", "pid", "reason", "exit_code",
               "output_truncated")
CHECKPOINT_COLUMNS = ("run_id", "spec", "state", "steps", "tool_calls", "input_tokens",
                      "output_tokens", "thinking_tokens", "cost_usd", "status", "error", "host",
                      "pid", "pid_start", "heartbeat_at", "created_at", "updated_at")
BUDGET_COLUMNS = ("caller_id", "window_seconds", "max_runs", "max_runtime_seconds",
                  "max_tokens", "max_cost_usd", "updated_at")
SPEND_COLUMNS = ("id", "caller_id", "ts", "run_id", "runtime_seconds", "tokens", "cost_usd",
                 "settled")
BATCH_COLUMNS = ("batch_id", "name", "source", "created_at", "ended_at", "status", "tasks",
                 "concurrency", "options", "host", "pid")
BATCH_TASK_COLUMNS = ("batch_id", "idx", "task_id", "run_id", "delivery", "delivery_error")

#: A batch's tasks with their runs' status, whether they started, and (journal version 5
#: on: `batch_tasks_sql(True, ...)`) where their delivery stands, with the result of
#: those whose run ended and whose result is owed a delivery (`TaskRow.ended`); the
#: other tasks' result columns are not read (NULL), so a resume reads no outputs but
#: the owed ones.
_TASKS_SQL = ("SELECT t.idx, t.task_id, t.run_id, t.spec, r.status, r.run_id IS NOT NULL, "
              "c.run_id IS NOT NULL{delivery} FROM batch_tasks t "
              "LEFT JOIN runs r ON r.run_id = t.run_id "
              "LEFT JOIN checkpoints c ON c.run_id = t.run_id "
              "WHERE t.batch_id = {p} ORDER BY t.idx")
#: A task whose result is owed a delivery (`UNDELIVERED`: pending or failed).
OWED_DELIVERY = f"t.delivery IN ('{DELIVERY_PENDING}', '{DELIVERY_FAILED}')"
_OWED = f"{OWED_DELIVERY} AND r.status IS NOT NULL"
#: A batch's tasks whose run ended, counted by their delivery (`BatchRow.deliveries`).
DELIVERY_COUNTS = ("SELECT t.delivery, count(*) FROM batch_tasks t JOIN runs r "
                   "ON r.run_id = t.run_id WHERE t.batch_id = ? AND r.status IS NOT NULL "
                   "AND t.delivery IS NOT NULL GROUP BY t.delivery")


#: The runs `purge` keeps whatever their age (both stores; the analysts' file has its
#: own copy of these rules, `batteries.audit.queries.purge`): those of a batch that has
#: not finished (its resume tells a task that ran from one that never did by its run),
#: and those whose result is owed a delivery (`kernel batch --resume` delivers it from
#: the runs row). Their events and checkpoints stay with them.
PURGE_KEPT_RUNS = ("SELECT t.run_id FROM batch_tasks t JOIN batches b "
                   "ON b.batch_id = t.batch_id WHERE (b.status != 'finished' "
                   f"OR {OWED_DELIVERY}) AND t.run_id IS NOT NULL")
#: `purge`'s deletion of the tasks of the batches that finished before the cut (`{p}`:
#: the store's placeholder), run after its runs': but those whose result is owed a
#: delivery of a run the store still has (what `--resume` delivers).
PURGE_TASKS = ("DELETE FROM batch_tasks WHERE batch_id IN (SELECT batch_id FROM batches "
               "WHERE status = 'finished' AND ended_at < {p}) AND NOT (coalesce(delivery, "
               f"'') IN ('{DELIVERY_PENDING}', '{DELIVERY_FAILED}') AND EXISTS (SELECT 1 "
               "FROM runs r WHERE r.run_id = batch_tasks.run_id))")
#: Then of those batches, but one left with a task (owed: `--resume` finds the batch).
PURGE_BATCHES = ("DELETE FROM batches WHERE status = 'finished' AND ended_at < {p} "
                 "AND NOT EXISTS (SELECT 1 FROM batch_tasks t "
                 "WHERE t.batch_id = batches.batch_id)")


def batch_tasks_sql(delivery: bool, placeholder: str) -> str:
    """The query `batch_tasks` reads a batch's tasks with (`task_rows` reads its rows);
    `delivery` for a store whose batch_tasks have the delivery columns."""
    extra = ""
    if delivery:
        extra = ", t.delivery, t.delivery_error" + "".join(
            f", CASE WHEN {_OWED} THEN r.{c} END" for c in RESULT_COLUMNS)
    return _TASKS_SQL.format(delivery=extra, p=placeholder)


def task_rows(rows: Iterable[Sequence[Any]], saved: dict[str, SavedRun]) -> list[TaskRow]:
    """`TaskRow`s of the rows of `batch_tasks_sql`."""
    out = []
    for row in rows:
        idx, tid, rid, spec, status, has_run, has_cp = row[:7]
        delivery = error = ended = None
        if len(row) > 7:
            delivery, error = row[7], row[8]
            if status is not None and delivery in (DELIVERY_PENDING, DELIVERY_FAILED):
                ended = dict(zip(RESULT_COLUMNS, row[9:], strict=True))
        out.append(TaskRow(int(idx), tid, rid, json.loads(spec), status,
                           bool(has_run or has_cp), saved.get(rid), delivery, error, ended))
    return out


def delivery_marks(op: MarkDelivery) -> list[tuple[str | None, str | None, str, int]]:
    """The (delivery, delivery_error, batch_id, idx) rows of a `MarkDelivery`.

    Raises:
        StoreError: A mark's state is not one of `DELIVERY_STATES` (or None).
    """
    rows = []
    for idx, state, error in op.marks:
        if state is not None and state not in DELIVERY_STATES:
            raise StoreError(f"unknown delivery state {state!r}")
        rows.append((state, _text(error) if state == DELIVERY_FAILED else None, op.batch_id,
                     int(idx)))
    return rows


def _delivers(con: sqlite3.Connection) -> bool:
    """The journal's batch_tasks have the delivery columns (version 5 on: a journal an
    older kernel wrote is migrated by its first write, not by a read)."""
    return int(con.execute("PRAGMA user_version").fetchone()[0]) >= 5


def lock_timeout_from_env() -> float:
    """`$KERNEL_AUDIT_LOCK_TIMEOUT` in seconds (default 10).

    Raises:
        ConfigError: The variable is not a finite number >= 0.
    """
    raw = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_LOCK_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{LOCK_TIMEOUT_ENV} must be a number of seconds, "
                          f"got {raw!r}") from None
    if not 0 <= value < float("inf"):
        raise ConfigError(f"{LOCK_TIMEOUT_ENV} must be a finite number >= 0, got {raw!r}")
    return value


def sync_from_env() -> str:
    """`$KERNEL_JOURNAL_SYNC`: `NORMAL` (default) or `FULL`.

    Raises:
        ConfigError: Any other value.
    """
    raw = os.environ.get(SYNC_ENV, "").strip().lower() or "normal"
    if raw not in ("normal", "full"):
        raise ConfigError(f"{SYNC_ENV} must be normal or full, got {raw!r}")
    return raw.upper()


def now_us() -> int:
    """Now, in microseconds since the epoch (how the journal keeps time)."""
    return time.time_ns() // 1000


def _utc(us: int | None) -> dt.datetime | None:
    return None if us is None else dt.datetime.fromtimestamp(us / 1e6, dt.UTC)


#: `json.dumps(value, default=str, ensure_ascii=False)`, without building an encoder per call.
_dumps = json.JSONEncoder(default=str, ensure_ascii=False).encode


#: Events are inserted (and runs' rows written) by statements of many rows
#: each: powers of two rows, largest first (up to `_MOST_ROWS`, and as many
#: as SQLite's limit on a statement's parameters allows), so n rows take at
#: most n // 4096 + 12 statements, of at most 13 texts per kind. A
#: statement's parameters are bound holding the GIL, but SQLite writes all of
#: its rows in one `sqlite3_step`, which Python runs without the GIL. With one
#: statement per row (`executemany`) the writer thread gave the GIL back and
#: waited for it again for every row, and with the trio thread busy each wait
#: could last a switch interval (5 ms): the writer could not work beside the
#: trio thread.
_MOST_ROWS = 4096
#: What the writer binds for a NULL in the columns that are mostly NULL (an event's
#: name and iteration, a run's roll-up). The sqlite3 module binds a parameter of a
#: base type (exact int, float, str) directly; anything else, None included, goes
#: through its adaptation lookup, which fails twice with a formatted AttributeError
#: (~1,200 instructions per None, with the GIL held: at 10,000 runs the trio thread
#: waits for them). A float NaN is bound directly and SQLite stores it as NULL.
_NULL = float("nan")
#: `_nulls(v, v)`: `v`, or `_NULL` for None (`map(_nulls, column, column)`: C speed).
_nulls: Callable[[Any, Any], Any] = {None: _NULL}.get
#: Parameters every SQLite build takes in one statement (its lowest default limit).
_SMALL_PARAMS = 999
#: Up to this many rows are written by one statement of exactly that many (a save's
#: events, a run's close: one statement, not one per power of two); more rows by
#: powers of two, so a kind has at most 16 + 13 statement texts (the connection
#: caches 128 prepared statements).
_EXACT_ROWS = 16


class _Rows:
    """A statement over `n` rows of parameters: `head`, n times `row`, `tail`.

    Its text for each `n` is made once (`sql`): up to `_EXACT_ROWS`, then powers of two.
    """

    __slots__ = ("_sql", "head", "row", "tail", "width")

    def __init__(self, head: str, row: str, tail: str = "") -> None:
        self.head, self.row, self.tail = head, row, tail
        self.width = row.count("?")
        self._sql: dict[int, str] = {}

    def sql(self, n: int) -> str:
        text = self._sql.get(n)
        if text is None:
            text = self._sql[n] = self.head + ", ".join([self.row] * n) + self.tail
        return text


_INSERT_EVENTS = _Rows("INSERT INTO events (run_id, seq, ts, kind, iteration, name, "
                       "duration_ms, payload) VALUES ", "(?, ?, ?, ?, ?, ?, ?, ?)")


class _UniformEvents:
    """`_INSERT_EVENTS` for rows that share one kind, name and payload (a one-row CTE,
    bound once a statement); each row binds its run id, seq, ts, iteration and duration.

    With many runs stepping, most statements are of these: plain steps, whose payload
    is one of a few texts the audit keeps (`JournalAudit.step_text`). A text
    parameter costs the writer ~100-170 ns to bind, holding the GIL: three of them
    bound once instead of per row take ~300 ns an event off the time the trio
    thread waits for the writer (BENCHMARKS.md, "The runs' close and the collector,
    shared parameters").
    """

    __slots__ = ("_sql",)

    def __init__(self) -> None:
        self._sql: dict[int, str] = {}

    def sql(self, n: int) -> str:
        # Plain `?` parameters: with numbered ones (`?NNN`, the shared values named in
        # every row) SQLite took ~130 ms to prepare a statement of 2,048 rows, against
        # ~4 ms for this. CROSS JOIN keeps the rows' own order as the scan's (their ids).
        text = self._sql.get(n)
        if text is None:
            text = self._sql[n] = (
                "WITH shared (kind, name, payload) AS (VALUES (?, ?, ?)) INSERT INTO events "
                "(run_id, seq, ts, kind, iteration, name, duration_ms, payload) SELECT "
                "v.column1, v.column2, v.column3, shared.kind, v.column4, shared.name, "
                "v.column5, shared.payload FROM (VALUES " + ", ".join(["(?, ?, ?, ?, ?)"] * n)
                + ") AS v CROSS JOIN shared")
        return text


_INSERT_UNIFORM = _UniformEvents()
# Raise a run's last_seq to `column1` where it is below `column3` (see `_write_batch`).
_RAISE_LAST_SEQ = _Rows("UPDATE runs SET last_seq = v.column1 FROM (VALUES ", "(?, ?, ?)",
                        ") AS v WHERE runs.run_id = v.column2 AND runs.last_seq < v.column3")
_INSERT_RUNS = _Rows("INSERT INTO runs (run_id, parent_run_id, subject_id, name, caller_id, "
                     "channel_id, inputs, started_at, host, pid, last_seq, first_event, rev) "
                     "VALUES ", "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
_INSERT_STARTS = _Rows("INSERT INTO events (id, run_id, seq, ts, kind, iteration, name, "
                       "duration_ms, payload) VALUES ", "(?, ?, ?, ?, ?, ?, ?, ?, ?)")
# A run's roll-up: `column16` is the run id.
_CLOSE_RUNS = _Rows(
    "UPDATE runs SET ended_at = v.column1, status = v.column2, output = v.column3, "
    "error = v.column4, steps = v.column5, tool_calls = v.column6, "
    "runtime_seconds = v.column7, input_tokens = v.column8, output_tokens = v.column9, "
    "thinking_tokens = v.column10, cost_usd = v.column11, reason = v.column12, "
    "exit_code = v.column13, output_truncated = v.column14, rev = v.column15 FROM (VALUES ",
    "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", ") AS v WHERE runs.run_id = v.column16")
_CLOSE_RUN = (  # `_CLOSE_RUNS` of one run
    "UPDATE runs SET ended_at = ?, status = ?, output = ?, error = ?, steps = ?, tool_calls = ?, "
    "runtime_seconds = ?, input_tokens = ?, output_tokens = ?, thinking_tokens = ?, "
    "cost_usd = ?, reason = ?, exit_code = ?, output_truncated = ?, rev = ? WHERE run_id = ?")
_LAST_SEQS = _Rows("SELECT run_id, last_seq FROM runs WHERE run_id IN (", "?", ")")


#: A lost run's budget reservation, settled at what its checkpoint last saw it use
#: (tokens and cost as of its last save; its supervisor died before it could settle,
#: and the reservation alone charged it a run and nothing else). Its runtime stays
#: uncounted: when the supervisor died is not known. Placeholders: rev, run id.
_SETTLE_LOST = (
    "UPDATE budget_spend SET tokens = max(budget_spend.tokens, c.input_tokens "
    "+ c.output_tokens + c.thinking_tokens), cost_usd = max(budget_spend.cost_usd, "
    "c.cost_usd), settled = 1, rev = ? FROM checkpoints AS c "
    "WHERE budget_spend.run_id = c.run_id AND c.run_id = ? AND budget_spend.settled = 0")


def _chunks(con: sqlite3.Connection, kind: _Rows, rows: Sequence[Any]
            ) -> Iterator[tuple[str, Sequence[Any]]]:
    """`rows` cut into chunks of powers of two rows (largest first, at most `_MOST_ROWS`
    and what SQLite's limit on parameters allows), each with its statement."""
    for sql, at, size in _spans(con, kind, len(rows)):
        yield sql, rows[at:at + size]


def _spans(con: sqlite3.Connection, kind: _Rows, total: int
           ) -> Iterator[tuple[str, int, int]]:
    """`_chunks` of `total` rows as (statement, first row, rows)."""
    most = min(con.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // kind.width, _MOST_ROWS)
    at = 0
    while at < total:
        size = 1 << (min(total - at, most).bit_length() - 1)
        yield kind.sql(size), at, size
        at += size


def _statements(con: sqlite3.Connection, kind: _Rows, total: int
                ) -> Iterable[tuple[str, int, int]]:
    """How `total` rows of `kind` are written, as (statement, first row, rows): one
    statement of exactly that many up to `_EXACT_ROWS` rows or for a small power of two
    (a save's events, a run's close: no chunking), else `_spans`."""
    if 0 < total <= _EXACT_ROWS or (total & (total - 1) == 0
                                    and total * kind.width <= _SMALL_PARAMS):
        return ((kind.sql(total), 0, total),)
    return _spans(con, kind, total)


def _execute_rows(con: sqlite3.Connection, kind: _Rows, rows: list[tuple[Any, ...]],
                  clean: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None) -> int:
    """Write `rows` with statements of `kind`, many rows each; return the rows changed.

    `clean` rewrites a chunk's rows when binding them raised `UnicodeEncodeError`
    (a lone surrogate); binding fails before anything of the chunk is written.
    """
    changed = 0
    for sql, at, size in _statements(con, kind, len(rows)):
        chunk = rows if size == len(rows) else rows[at:at + size]
        try:
            cur = con.execute(sql, tuple(chain.from_iterable(chunk)))
        except UnicodeEncodeError:
            if clean is None:
                raise
            cur = con.execute(sql, tuple(chain.from_iterable(map(clean, chunk))))
        changed += cur.rowcount
    return changed


def _execute_columns(con: sqlite3.Connection, kind: _Rows, columns: Sequence[Sequence[Any]],
                     clean: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None) -> int:
    """`_execute_rows` over rows given as columns (`columns[j][i]`: row i's j-th value).

    Each statement's parameters are laid out by slice assignment, one column
    at a time: no tuple per row. A row tuple is a container the garbage
    collector tracks, and a batch of 10,000 events made 10,000 of them in
    this thread while the trio thread ran: each 700 set off a young
    collection, and those alive at the next older one were moved to the
    oldest generation, whose growth sets off the full passes over every
    live run (BENCHMARKS.md, "Critic at scale"). The parameters are bound as
    a tuple (as are the writer's other per-event temporaries): a tuple of
    atoms is no longer tracked after the first young collection that sees
    it, where a list is walked by every one while the statement runs.
    """
    width = kind.width
    assert len(columns) == width, (len(columns), width)
    changed = 0
    for sql, at, size in _statements(con, kind, len(columns[0])):
        params: list[Any] = [None] * (size * width)
        end = at + size
        for j, column in enumerate(columns):
            params[j::width] = column[at:end]
        try:
            cur = con.execute(sql, tuple(params))
        except UnicodeEncodeError:
            if clean is None:
                raise
            rows = map(clean, zip(*(column[at:end] for column in columns), strict=True))
            cur = con.execute(sql, tuple(chain.from_iterable(rows)))
        changed += cur.rowcount
    return changed


def _insert_events(con: sqlite3.Connection, ids: Sequence[str], seqs: Sequence[int],
                   batch: Batch) -> int:
    """Insert the events of `batch` (`ids`, `seqs`: each event's run id and absolute seq).

    Statements of many rows, as `_execute_columns`; one whose rows share kind,
    name and payload binds those once (`_INSERT_UNIFORM`). Returns the rows
    written that way.
    """
    kinds, iters, names, payloads = batch.kinds, batch.iters, batch.names, batch.payloads
    ts, durs = batch.ts, batch.durs
    shared = 0
    for _, at, size in _statements(con, _INSERT_EVENTS, len(ids)):
        end = at + size
        kind, name, payload = kinds[at], names[at], payloads[at]
        its = iters[at:end]
        if None in its:
            its = list(map(_nulls, its, its))
        if (size > 1 and kinds[at:end].count(kind) == size
                and names[at:end].count(name) == size
                and payloads[at:end].count(payload) == size):
            params: list[Any] = [None] * (3 + size * 5)
            params[0], params[1], params[2] = kind, _NULL if name is None else name, payload
            params[3::5] = ids[at:end]
            params[4::5] = seqs[at:end]
            params[5::5] = ts[at:end]
            params[6::5] = its
            params[7::5] = durs[at:end]
            try:
                con.execute(_INSERT_UNIFORM.sql(size), tuple(params))
                shared += size
                continue
            except UnicodeEncodeError:
                pass  # a lone surrogate: the general statement cleans the rows
        names_at = names[at:end]
        if None in names_at:
            names_at = list(map(_nulls, names_at, names_at))
        _execute_columns(con, _INSERT_EVENTS, (
            ids[at:end], seqs[at:end], ts[at:end], kinds[at:end], its, names_at, durs[at:end],
            payloads[at:end]), _clean_event)
    return shared


def _last_seqs(con: sqlite3.Connection, run_ids: list[str]) -> dict[str, int]:
    """The `last_seq` of each of `run_ids` that has a runs row."""
    found: dict[str, int] = {}
    for sql, chunk in _chunks(con, _LAST_SEQS, run_ids):
        found.update((rid, int(seq)) for rid, seq in con.execute(sql, chunk).fetchall())
    return found


def _clean_event(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """An event row with lone surrogates replaced in its name and payload (a name
    may be `_NULL`)."""
    name = row[5]
    return (*row[:5], _text(name) if isinstance(name, str) else name, row[6], _text(row[7]))


def _clean_start(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """`_clean_event` for an event row that starts with its id."""
    return (row[0], *_clean_event(row[1:]))


_RUN_ID = attrgetter("run_id")


def saved_rows(con: Any, where: str, params: Sequence[Any], *,
               damaged: bool = False) -> list[SavedRun]:
    """Checkpoint rows as `SavedRun`s (`where`: a WHERE/ORDER BY tail in the connection's
    own placeholders); the journal's and the PostgreSQL store's tables have the same columns.

    A row whose spec or state is not JSON (a damaged disk, a hand edit) raises the
    decoder's `ValueError`; with `damaged`, it comes back flagged instead
    (`SavedRun.damaged`: why), so one bad row does not hide every other.
    """
    rows = con.execute(
        "SELECT run_id, spec, state, steps, tool_calls, input_tokens, output_tokens, "
        "thinking_tokens, cost_usd, status, host, pid, pid_start, updated_at, "
        "heartbeat_at FROM checkpoints" + where, params).fetchall()
    out = []
    for (rid, spec, state, steps, tools, tin, tout, tthink, cost, status, host, pid, start,
         updated, beat) in rows:
        why = None
        try:
            loaded = None if state is None else json.loads(state)
        except (ValueError, TypeError) as exc:
            if not damaged:
                raise
            loaded, why = None, _damage("state", exc)
        try:
            found = json.loads(spec)
        except (ValueError, TypeError) as exc:
            if not damaged:
                raise
            found, why = {}, _damage("spec", exc)
        if not isinstance(found, dict):
            if not damaged:
                raise ValueError(f"its spec is a JSON {type(found).__name__}, not an object")
            found, why = {}, f"its spec is a JSON {type(found).__name__}, not an object"
        cp = Checkpoint(rid, int(steps), loaded,
                        Usage(int(tin), int(tout), int(tthink), float(cost)), int(tools))
        updated_at = _utc(updated)
        assert updated_at is not None
        out.append(SavedRun(rid, found, cp, status,
                            Owner(host or "", int(pid or 0), start), updated_at, _utc(beat),
                            why))
    return out


def _damage(column: str, exc: Exception) -> str:
    """Why a checkpoint row's `column` cannot be read, in one line."""
    return f"its {column} is not JSON: {type(exc).__name__}: {' '.join(str(exc).split())}"


def _text(value: str | None) -> str | None:
    """Text SQLite will take: lone surrogates (not valid UTF-8) are replaced."""
    if value is None:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "replace").decode("utf-8")
    return value


class WouldBlock(Exception):
    """A transaction asked not to wait could not start at once (nothing was written)."""


# ------------------------------------------------------------------ spill files
# Rows a process could not commit at exit (`Journal._final_flush`) go to a spill file
# beside the store's own file, `<prefix>.spill-<pid>-<32 hex: the spill id>`: written
# to a hidden temporary name (0600), fsynced, renamed into place, the directory
# fsynced. The next transaction that opens the store for writing commits every spill
# it finds, each inside a savepoint with a `meta` row `spill:<id>` (the exactly-once
# key: a spill whose key is there is only removed), then removes the files after its
# COMMIT. A spill that cannot be read is renamed `.bad`, one the store refuses
# `.rejected`: kept for a person, never replayed again, never failing an open.
#
# Tidying. The same listing finds the temporary files of writers killed before their
# rename (`.<prefix>.spill-<pid>-<id>.tmp`): one is removed once its writer is gone
# (`_tmp_writer_gone`: its pid is gone, a zombie, or a process started after the file
# was last written: a recycled pid) and it is `SPILL_TMP_STALE` old (a directory shared
# between machines, where the pid says nothing: no writer takes that long). The `meta`
# keys are pruned too (`spill_keys_to_keep`): a key is only needed while its file may
# still be found, so a transaction deletes the keys of spills none of whose files were
# in its own listing. Sound because a spill file never comes back once its name is gone
# (ids are random; only its writer's rename creates it) and because a replay that finds
# its key missing re-checks, after setting it, that the file it read is still there
# (`still_there`; else `SpillTaken`: its savepoint is undone). A process that read the
# file before another's COMMIT and unlink, and sets the key after a third pruned it,
# thus finds the file gone and writes nothing (with SQLite the listing, the read and
# the key are under the write lock, so only PostgreSQL, whose writers run together,
# needs the re-check; both do it). A file the replayer cannot remove keeps its key.

#: The `meta` key that marks a spill as committed (followed by its id).
SPILL_KEY = "spill:"
#: What a spill file's name holds after its store's prefix.
SPILL_INFIX = ".spill-"
#: Seconds after its last write before a spill's temporary file whose writer is gone is
#: removed (see "Tidying" above).
SPILL_TMP_STALE = 3600.0


class SpillTaken(Exception):
    """A spill file was gone once its `meta` key was set: another process wrote it
    (and its key was pruned since); the replay's savepoint is undone."""


def spill_files(directory: Path, prefix: str, *, tidy: float | None = None) -> list[Path]:
    """The spill files of the store named `prefix` in `directory`, oldest first; with
    `tidy`, the temporary files found in the same listing whose writer is gone and that
    were last written at least `tidy` seconds ago are removed (the stores pass
    `SPILL_TMP_STALE`; see "Tidying" above)."""
    pattern = re.compile(re.escape(prefix + SPILL_INFIX) + r"\d+-[0-9a-f]{32}")
    try:
        listed = os.listdir(directory)
    except OSError:
        return []
    names = [n for n in listed if pattern.fullmatch(n)]
    if tidy is not None:
        _remove_stale_tmps(directory, prefix, listed, tidy)
    found = []
    for name in names:
        path = directory / name
        with contextlib.suppress(OSError):  # gone meanwhile: another process wrote it
            found.append((path.stat().st_mtime_ns, name, path))
    return [path for _, _, path in sorted(found)]


def spill_id_of(path: Path) -> str:
    """The spill id a spill file's name holds (its last 32 characters)."""
    return path.name[-32:]


def spill_keys_to_keep(listed: Iterable[Path], read: Iterable[str]) -> list[str]:
    """The `meta` keys of the spills a transaction listed (by their names) or read (by
    their contents): every other spill key may be deleted in that transaction."""
    return sorted({SPILL_KEY + spill_id_of(p) for p in listed}
                  | {SPILL_KEY + spill_id for spill_id in read})


def still_there(path: Path) -> bool:
    """Whether a spill file read earlier still exists (opened, not only looked up: on a
    network file system an open revalidates what a lookup may answer from a cache)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # there, but not ours to open now: as if it were (never a loss)
    os.close(fd)
    return True


def _remove_stale_tmps(directory: Path, prefix: str, listed: Iterable[str],
                       stale: float) -> None:
    """Remove the temporary spill files in `listed` whose writer is gone and that were
    last written `stale` seconds ago or more (never raises)."""
    pattern = re.compile(re.escape("." + prefix + SPILL_INFIX) + r"(\d+)-[0-9a-f]{32}\.tmp")
    now = time.time()
    for name in listed:
        m = pattern.fullmatch(name)
        if m is None:
            continue
        path = directory / name
        try:
            written = path.stat().st_mtime
        except OSError:
            continue  # renamed or removed meanwhile
        if now - written < stale or not _tmp_writer_gone(int(m[1]), written):
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            _log.warning("journal spill leftover %s cannot be removed (%s)", path,
                         exc.strerror or exc)
            continue
        _log.warning("journal spill leftover %s removed: its writer (pid %s) died before "
                     "finishing it; it held nothing it had committed", path, m[1])


def _tmp_writer_gone(pid: int, written: float) -> bool:
    """Whether the process that wrote a spill's temporary file (last at `written`, epoch
    seconds) is provably gone: no process has its pid, the one that has it is a zombie,
    or it started after the file was last written (a recycled pid; a minute's margin for
    the clock). Unknown (not Linux, no /proc) is "not gone"."""
    from ._types import _proc_stat

    if pid <= 0:
        return True  # no writer has that pid
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # someone else's process: alive
    except (OSError, OverflowError):
        return True  # beyond the pid range: no process has it
    stat = _proc_stat(pid)
    if stat is None:
        return False
    if stat[0] in ("Z", "X"):
        return True
    booted = _boot_time()
    if booted is None:
        return False
    started = booted + stat[1] / os.sysconf("SC_CLK_TCK")
    return started > written + 60.0


def _boot_time() -> float | None:
    """When this machine booted, in epoch seconds (Linux's /proc/stat `btime`), or None."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def write_spill(directory: Path, prefix: str, spill_id: str, text: str) -> Path:
    """Write a spill file atomically (0600, fsynced, then renamed into place); its path.

    Raises:
        OSError: The directory cannot be created or written.
    """
    from batteries.audit.paths import open_private_file

    private_dir(directory)
    final = directory / f"{prefix}{SPILL_INFIX}{os.getpid()}-{spill_id}"
    tmp = directory / f".{final.name}.tmp"
    fd = open_private_file(tmp, os.O_WRONLY | os.O_EXCL)
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself made durable
        dfd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    return final


def read_spill(path: Path) -> Spill:
    """A spill file read back.

    Raises:
        SpillError: It cannot be decoded (`decode_spill`).
        OSError: It cannot be read (FileNotFoundError: another process took it).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise SpillError(f"not UTF-8 text ({exc.reason})") from None
    return decode_spill(text)


def set_aside(path: Path, suffix: str, why: str) -> None:
    """Rename a spill that will never be replayed to `<name><suffix>`, saying so in one
    line (a file another process moved first is left to it)."""
    target = path.with_name(path.name + suffix)
    try:
        os.replace(path, target)
    except FileNotFoundError:
        return
    except OSError as exc:
        _log.error("journal spill %s %s; it cannot be moved aside either (%s)", path, why,
                   exc.strerror or exc)
        return
    _log.warning("journal spill %s %s; moved aside to %s", path, why, target.name)


def spills_committed(done: Sequence[tuple[Path, str | None, str]]) -> int:
    """After the COMMIT of a transaction that wrote spills (path, None, what it held; or
    path, the suffix to move it aside with, why): remove the files written (their keys
    are committed: never written twice), move the others aside; how many were written
    now (not found written before). Never raises."""
    written = 0
    for path, aside, why in done:
        if aside is not None:
            set_aside(path, aside, f"was refused by the store ({why})")
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            _log.warning("journal spill %s was written but cannot be removed (%s)", path,
                         exc.strerror or exc)
        if why:
            written += 1
            _log.info("journal rows another process kept at exit written from %s: %s",
                      path.name, why)
    return written


def spill_summary(spill: Spill) -> str:
    """What a spill holds, for messages."""
    batch = spill.batch
    return (f"{len(batch)} events, {len(batch.new)} runs started, {len(batch.closes)} "
            f"closed, {len(spill.ops)} operations")


@dataclass(slots=True)
class StoreStats:
    """What this process's transactions cost, for reports and benchmarks.

    Attributes:
        transactions: Transactions run (writes and reads).
        wait_s: Total time spent waiting for the write lock.
        max_wait_s: The longest wait for the write lock.
        max_transaction_s: The longest transaction, wait included.
        shared_rows: Events written by statements that bound their kind, name and
            payload once for all rows (the rest bind each row's own).
    """

    transactions: int = 0
    wait_s: float = 0.0
    max_wait_s: float = 0.0
    max_transaction_s: float = 0.0
    shared_rows: int = 0

    def as_dict(self) -> dict[str, float]:
        """JSON-ready, in milliseconds."""
        return {"transactions": self.transactions,
                "wait_ms": round(self.wait_s * 1000, 3),
                "max_wait_ms": round(self.max_wait_s * 1000, 3),
                "max_transaction_ms": round(self.max_transaction_s * 1000, 3)}


class SQLiteStore:
    """The `RunStore` on one SQLite file (see the module docstring).

    Args:
        path: The journal file (created 0600, with 0700 parent directories, on first write).
        legacy: An analysts' DuckDB file from before the journal existed: when
            the journal is created, its budgets, spend and resumable runs are
            copied over (its runs and events stay where analysts read them).
        lock_timeout: Seconds to wait for the write lock (None: `$KERNEL_AUDIT_LOCK_TIMEOUT`).

    Raises:
        ConfigError: A bad `$KERNEL_AUDIT_LOCK_TIMEOUT` or `$KERNEL_JOURNAL_SYNC`.
    """

    def __init__(self, path: str | os.PathLike[str], *, legacy: Path | None = None,
                 lock_timeout: float | None = None) -> None:
        self.path = Path(path).expanduser().absolute()
        self.legacy = legacy
        self.lock_timeout = lock_timeout if lock_timeout is not None else lock_timeout_from_env()
        self.synchronous = sync_from_env()
        self.stats = StoreStats()
        self._con: sqlite3.Connection | None = None
        # A second connection whose busy timeout is 0, for transactions that must not
        # wait (`wait=False`): switching one connection's timeout costs two PRAGMAs.
        self._con_now: sqlite3.Connection | None = None
        self._lock = threading.Lock()
        self._migrated = False
        self._trace: Callable[[str], None] | None = None
        # The WAL checkpointer thread (see CHECKPOINT_EVERY), started by the commit that
        # first makes one due; `_ckpt` guards its state.
        self._ckpt = threading.Condition(threading.Lock())
        self._ckpt_thread: threading.Thread | None = None
        self._ckpt_due = False
        self._ckpt_stop = False
        self._commits = 0
        self._events = 0
        #: WAL checkpoints this process's checkpointer thread ran.
        self.wal_checkpoints = 0
        # Spill files (see `spill`): looked for by the first write of each connection;
        # `_spill_txn` lists what the transaction in progress did with each found.
        self._spills_checked = False
        self._spill_txn: list[tuple[Path, str | None, str]] | None = None

    def __repr__(self) -> str:
        return f"SQLiteStore({str(self.path)!r})"

    def trace(self, callback: Callable[[str], None] | None) -> None:
        """Call `callback` with every SQL statement this store's connections run (tests
        and benchmarks count statements with it); None stops it."""
        with self._lock:
            self._trace = callback
            for con in (self._con, self._con_now):
                if con is not None:
                    con.set_trace_callback(callback)

    # -------------------------------------------------------------- opening

    def exists(self) -> bool:
        """True if the journal file exists."""
        return self.path.exists()

    def _connect(self, *, create: bool) -> sqlite3.Connection:
        if self._con is not None:
            return self._con
        if not self.path.exists():
            if not create:
                raise StoreError(f"no journal at {self.path}")
            self._create()
        self._con = self._open(self.path)
        return self._con

    def _open(self, path: Path, timeout: float | None = None) -> sqlite3.Connection:
        try:
            con = sqlite3.connect(path, timeout=self.lock_timeout if timeout is None else timeout,
                                  isolation_level=None, check_same_thread=False)
            mode = con.execute("PRAGMA journal_mode").fetchone()
            if not mode or str(mode[0]).lower() != "wal":
                con.execute("PRAGMA journal_mode=WAL")
            con.execute(f"PRAGMA synchronous={self.synchronous}")
            con.execute("PRAGMA foreign_keys=OFF")
            con.execute(f"PRAGMA wal_autocheckpoint={AUTOCHECKPOINT_PAGES}")
            con.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
        except sqlite3.Error as exc:
            raise self._error("cannot open", exc) from exc
        if self._trace is not None:
            con.set_trace_callback(self._trace)
        return con

    def _create(self) -> None:
        """Create the journal at a private temporary name, fill it, then link it into place.

        Linking (not renaming) fails if another process created the journal
        meanwhile: theirs wins and ours is discarded, so no process ever
        writes to a journal that is then replaced.
        """
        try:
            private_dir(self.path.parent)
        except OSError as exc:
            raise StoreError(f"cannot create {self.path.parent}: "
                             f"{exc.strerror or exc}") from exc
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(str(tmp) + suffix)
            private_file(tmp)
            con = self._open(tmp)
            try:
                con.execute("BEGIN IMMEDIATE")
                self._migrate(con, 0)
                if self.legacy is not None and self.legacy.exists():
                    from ._legacy import import_legacy

                    import_legacy(con, self.legacy, self.lock_timeout)
                con.execute("COMMIT")
                con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                con.close()
            with contextlib.suppress(FileExistsError):  # another process was first: use theirs
                os.link(tmp, self.path)
        except OSError as exc:
            raise StoreError(f"cannot create journal {self.path}: "
                             f"{exc.strerror or exc}") from exc
        except sqlite3.Error as exc:
            raise self._error("cannot create", exc) from exc
        finally:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(OSError):
                    os.unlink(str(tmp) + suffix)

    @staticmethod
    def _migrate(con: sqlite3.Connection, found: int) -> None:
        """Apply the migrations after `found`, inside the caller's transaction."""
        for version, statements in enumerate(MIGRATIONS, start=1):
            if version <= found:
                continue
            for sql in statements:
                con.execute(sql)
            con.execute(f"PRAGMA user_version = {version}")

    def _error(self, what: str, exc: BaseException) -> StoreError:
        """The `StoreError` for SQLite's `exc`: `StoreBusyError` (transient: the `Journal`
        keeps its rows) only for a journal locked by another writer (SQLITE_BUSY,
        SQLITE_LOCKED and their extended codes); a disk I/O error, a full disk, a
        read-only or damaged file is a plain `StoreError`."""
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        code = getattr(exc, "sqlite_errorcode", None)
        if isinstance(code, int):
            locked = (code & 0xFF) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
        else:  # no code (an error raised by the sqlite3 module itself): its text
            locked = "locked" in text
        if isinstance(exc, sqlite3.OperationalError) and locked:
            return StoreBusyError(f"journal {self.path} is locked by another process "
                                  f"(gave up after {self.lock_timeout:g}s)")
        if isinstance(exc, sqlite3.DatabaseError) and not isinstance(
                exc, sqlite3.OperationalError):
            return StoreError(f"journal {self.path} is damaged or unreadable: {text}")
        return StoreError(f"{what} journal {self.path}: {text}")

    def close(self) -> None:
        """Close this process's connection (a later call reopens it); stop the WAL
        checkpointer thread (after the checkpoint it may be running)."""
        with self._ckpt:
            thread, self._ckpt_thread = self._ckpt_thread, None
            self._ckpt_stop = thread is not None
            self._ckpt.notify()
        if thread is not None:
            thread.join()
            with self._ckpt:
                self._ckpt_stop = self._ckpt_due = False
        with self._lock:
            for con in (self._con, self._con_now):
                if con is not None:
                    con.close()
            self._con = self._con_now = None
            self._migrated = False
            self._spills_checked = False


    # ------------------------------------------------------------ transactions

    @contextmanager
    def _write(self, *, wait: bool = True) -> Iterator[sqlite3.Connection]:
        """One write transaction; with `wait=False`, `WouldBlock` instead of any waiting.

        The time waited for the write lock (`BEGIN IMMEDIATE`) is accounted in
        `stats`; opening the connection (and creating the journal) is not.
        """
        con, t0, waited = self._start(wait)
        try:
            yield con
            con.execute("COMMIT")
            if self._spill_txn is not None:
                self._spills_committed()
        except BaseException as exc:
            err = self._undo(con, exc)
            if err is None:
                raise
            raise err from exc
        finally:
            self._account(t0, waited)
            self._lock.release()

    def _start(self, wait: bool, rev: list[int] | None = None, *,
               now: bool = False) -> tuple[sqlite3.Connection, float, float]:
        """Take this store's lock and begin a write transaction (see `_write`, which ends
        it): the connection, when this started, and how long it waited for the write lock.
        On failure nothing is held.

        The first transaction of a connection also writes the spill files it finds
        (`_replay_spills`; `rev` is the transaction's change number); with `wait=False`
        that transaction is left to a worker thread (`WouldBlock`) unless `now`
        (`replay_spills`, which opens an existing journal here).
        """
        if not self._lock.acquire(blocking=wait):
            raise WouldBlock
        try:
            t0 = time.perf_counter()
            if wait:
                con = self._connect(create=True)
            elif not now and (self._con is None or not self._spills_checked):
                raise WouldBlock  # opening (maybe creating) the file is for a worker thread
            else:
                if self._con is None:
                    self._connect(create=False)
                if self._con_now is None:
                    try:
                        self._con_now = self._open(self.path, timeout=0)
                    except StoreError:
                        raise WouldBlock from None  # a worker thread will say why
                con = self._con_now
            t1 = time.perf_counter()
            try:
                self._begin(con, wait)
            except sqlite3.Error as exc:
                self._account(t0, time.perf_counter() - t1)
                raise self._error("cannot write to", exc) from exc
            waited = time.perf_counter() - t1
            if not self._migrated:
                try:
                    found = con.execute("PRAGMA user_version").fetchone()[0]
                    if found < JOURNAL_VERSION:
                        self._migrate(con, found)
                except BaseException as exc:
                    self._account(t0, waited)
                    err = self._undo(con, exc)
                    if err is None:
                        raise
                    raise err from exc
                self._migrated = True
            if not self._spills_checked:
                try:
                    self._replay_spills(con, [] if rev is None else rev)
                except BaseException as exc:
                    self._account(t0, waited)
                    err = self._undo(con, exc)
                    if err is None:
                        raise
                    raise err from exc
        except BaseException:
            self._lock.release()
            raise
        return con, t0, waited

    # ------------------------------------------------------------ spill files

    def spill(self, batch: Batch | None, ops: Sequence[Op]) -> Path:
        """Keep rows and operations this process could not commit in a spill file beside
        the journal (`Journal._final_flush`, when the journal stayed locked past the lock
        timeout as the process exits); its path.

        The next transaction that opens this journal for writing (in any process)
        commits them exactly once, before its own rows, and removes the file; a reader
        that finds the write lock free (`interrupted`, `changes`) does the same.

        Raises:
            OSError: The file cannot be written (nothing was kept).
        """
        spill_id = os.urandom(16).hex()
        text = encode_spill(Batch() if batch is None else batch, ops, spill_id=spill_id,
                            store=self.path.name)
        return write_spill(self.path.parent, self.path.name, spill_id, text)

    def replay_spills(self) -> int:
        """Commit the spill files beside the journal now if its write lock is free at once;
        how many were written.

        For readers (`interrupted`, `changes`): it never waits for the lock and never
        raises; a spill it cannot write now stays for the next writer, whose first
        transaction writes it (a writer needs no call).
        """
        if (self._spills_checked or not spill_files(self.path.parent, self.path.name)
                or not self.exists()):
            return 0
        try:
            con, t0, waited = self._start(False, [], now=True)
        except (WouldBlock, StoreError) as exc:
            _log.debug("journal spills left for the next writer: %s", exc)
            return 0
        try:
            con.execute("COMMIT")
        except sqlite3.Error as exc:
            self._undo(con, exc)
            _log.debug("journal spills left for the next writer: %s", exc)
            return 0
        finally:
            self._account(t0, waited)
            self._lock.release()
        return self._spills_committed()

    def _replay_spills(self, con: sqlite3.Connection, rev: list[int]) -> None:
        """Write the spill files beside the journal in the transaction begun on `con`,
        each in a savepoint and only if its `meta` key is not there yet (then set);
        the files are removed or moved aside once the transaction commits
        (`_spills_committed`). Leftovers of dead writers are removed, and the keys of
        spills none of whose files were listed are deleted (see "Tidying" above)."""
        done: list[tuple[Path, str | None, str]] = []
        self._spill_txn = done
        listed = spill_files(self.path.parent, self.path.name, tidy=SPILL_TMP_STALE)
        read: list[str] = []
        for path in listed:
            try:
                spill = read_spill(path)
            except FileNotFoundError:
                continue  # another process took it
            except SpillError as exc:
                set_aside(path, ".bad", f"cannot be read ({exc})")
                continue
            except OSError as exc:
                _log.warning("journal spill %s cannot be read now (%s); left for later",
                             path, exc.strerror or exc)
                continue
            read.append(spill.spill_id)
            con.execute("SAVEPOINT kernel_spill")
            try:
                fresh = self._replay_one(con, spill, rev, path)
            except sqlite3.OperationalError:
                raise  # the journal itself failed (I/O, full disk): the transaction does
            except SpillTaken:
                con.execute("ROLLBACK TO kernel_spill")
                con.execute("RELEASE kernel_spill")
            except Exception as exc:
                con.execute("ROLLBACK TO kernel_spill")
                con.execute("RELEASE kernel_spill")
                done.append((path, ".rejected", f"{type(exc).__name__}: "
                                                f"{' '.join(str(exc).split())}"))
            else:
                con.execute("RELEASE kernel_spill")
                done.append((path, None, spill_summary(spill) if fresh else ""))
        keep = spill_keys_to_keep(listed, read)
        if len(keep) <= 500:  # (else pruned by a later listing: SQLite's bound variables)
            con.execute("DELETE FROM meta WHERE key >= ? AND key < ? AND key NOT IN "
                        f"({', '.join('?' * len(keep))})", (SPILL_KEY, "spill;", *keep))

    def _replay_one(self, con: sqlite3.Connection, spill: Spill, rev: list[int],
                    path: Path) -> bool:
        """Write one spill (read from `path`) unless its key says it was written; True if
        written now.

        Raises:
            SpillTaken: Its key was not there but `path` is gone (see "Tidying" above).
        """
        cur = con.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, ?)",
                          (SPILL_KEY + spill.spill_id, now_us()))
        if cur.rowcount == 0:
            return False
        if not still_there(path):
            raise SpillTaken(str(path))
        if not spill.batch.empty():
            self._write_batch(con, spill.batch, rev)
        for op in spill.ops:
            res = self._apply_one(con, op, rev)
            if isinstance(res, Exception):
                _log.error("journal operation from spill %s refused: %s: %s", spill.spill_id,
                           type(op).__name__, res)
        return True

    def _spills_committed(self) -> int:
        """After the COMMIT of a transaction that wrote spills: remove them (or move aside
        those the store refused); how many were written by it. Never raises."""
        done, self._spill_txn = self._spill_txn or [], None
        self._spills_checked = True
        return spills_committed(done)

    def _undo(self, con: sqlite3.Connection, exc: BaseException) -> StoreError | None:
        """Roll the transaction back after `exc`; the `StoreError` to raise instead of a
        SQLite error (None: raise `exc` itself). Spills it wrote are written again by
        the next transaction."""
        self._spill_txn = None
        with contextlib.suppress(sqlite3.Error):
            con.execute("ROLLBACK")
        return self._error("cannot write to", exc) if isinstance(exc, sqlite3.Error) else None

    @staticmethod
    def _begin(con: sqlite3.Connection, wait: bool) -> None:
        """BEGIN IMMEDIATE, waiting up to `lock_timeout` for the write lock (SQLite's busy
        handler); with `wait` False (the connection whose busy timeout is 0) a taken lock
        raises `WouldBlock`."""
        try:
            con.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if not wait and ("locked" in str(exc) or "busy" in str(exc)):
                raise WouldBlock from None
            raise

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            t0 = time.perf_counter()
            con = self._connect(create=False)
            try:
                con.execute("BEGIN")
                yield con
            except sqlite3.Error as exc:
                raise self._error("cannot read", exc) from exc
            finally:
                with contextlib.suppress(sqlite3.Error):
                    con.execute("COMMIT")
                self._account(t0, 0.0)

    def _account(self, t0: float, waited: float) -> None:
        s = self.stats
        s.transactions += 1
        s.wait_s += waited
        s.max_wait_s = max(s.max_wait_s, waited)
        s.max_transaction_s = max(s.max_transaction_s, time.perf_counter() - t0)

    def commit(self, batch: Batch | None, ops: Sequence[Op] = (), *,
               wait: bool = True) -> list[Any]:
        """Write `batch` and then apply `ops`, in one transaction; return each op's result.

        An op the store refuses is undone alone and its `StoreError` is
        returned as its result (not raised): the rest is still committed.

        Recorders of new runs in `batch` learn their seq base only after the
        commit, so a failed transaction leaves them untouched for a retry.

        With `wait=False` nothing waits: if this process's connection is not
        open yet or the write lock is taken, `WouldBlock` is raised and
        nothing is written (the caller retries from a worker thread).

        Raises:
            StoreBusyError: The write lock stayed taken past the lock timeout.
            StoreError: The journal cannot be created or written (nothing was written).
            WouldBlock: `wait=False` and the transaction could not start at once.
        """
        rev: list[int] = []
        # `_write` written out: this is the hot path (a checkpoint save), and a
        # generator-based context manager costs a few microseconds per transaction.
        con, t0, waited = self._start(wait, rev)
        try:
            bases = self._write_batch(con, batch, rev) if batch is not None else None
            results: list[Any] = []
            for op in ops:  # `_apply_one`, written out (the hot path)
                try:
                    results.append(self._apply(con, op, rev))
                except StoreError as exc:
                    results.append(exc)
            con.execute("COMMIT")
            if self._spill_txn is not None:
                self._spills_committed()
        except BaseException as exc:
            err = self._undo(con, exc)
            if err is None:
                raise
            raise err from exc
        finally:
            self._account(t0, waited)
            self._lock.release()
        if bases:
            for rec, base in bases.items():
                rec.base = base
        self._commits += 1
        if batch is not None:
            self._events += len(batch)
        if self._commits >= CHECKPOINT_EVERY or self._events >= CHECKPOINT_EVENTS:
            self._commits = self._events = 0
            self._checkpoint_soon()
        return results

    # ------------------------------------------------------- WAL checkpoints

    def _checkpoint_soon(self) -> None:
        """Have the checkpointer thread run a PASSIVE checkpoint (start it if needed)."""
        with self._ckpt:
            self._ckpt_due = True
            if self._ckpt_thread is None or not self._ckpt_thread.is_alive():
                self._ckpt_thread = threading.Thread(target=self._checkpointer, daemon=True,
                                                     name=f"journal-checkpoint {self.path.name}")
                self._ckpt_thread.start()
            else:
                self._ckpt.notify()

    def _checkpointer(self) -> None:
        """The checkpointer thread: one connection of its own, a PASSIVE checkpoint each
        time one is due. A failure is left to the next one (and to SQLite's backstop)."""
        con: sqlite3.Connection | None = None
        try:
            while True:
                with self._ckpt:
                    while not (self._ckpt_due or self._ckpt_stop):
                        self._ckpt.wait()
                    if self._ckpt_stop:
                        return
                    self._ckpt_due = False
                try:
                    if con is None:
                        con = sqlite3.connect(self.path, timeout=0, isolation_level=None,
                                              check_same_thread=False)
                        # The checkpoint syncs as the writers do (`synchronous` decides it).
                        con.execute(f"PRAGMA synchronous={self.synchronous}")
                        con.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
                    con.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                    self.wal_checkpoints += 1
                except sqlite3.Error as exc:
                    _log.debug("journal WAL checkpoint skipped: %s: %s", self.path, exc)
        finally:
            if con is not None:
                con.close()

    @staticmethod
    def _rev(con: sqlite3.Connection, rev: list[int]) -> int:
        """This transaction's change number (one per transaction, taken when first needed)."""
        if not rev:
            row = con.execute("UPDATE meta SET value = value + 1 WHERE key = 'rev' "
                              "RETURNING value").fetchone()
            rev.append(int(row[0]))
        return rev[0]

    # ----------------------------------------------------------------- audit

    def _write_batch(self, con: sqlite3.Connection, batch: Batch,
                     rev: list[int]) -> dict[Any, int]:
        """Write the audit rows; return the seq base of each recorder that learned one.

        Seqs are unique per run by construction, checked in the data: the runs
        row's `last_seq` is the run's last committed seq, and this transaction
        raises it to the highest seq it writes for the run only where every
        seq it writes is above it (`UPDATE ... WHERE last_seq < first`); if
        another writer got there first, nothing is written (StoreError). A
        resumed run starts after its `last_seq` (one row read).
        """
        if batch.empty():
            return {}
        recs = batch.recs
        new = batch.new
        if recs and not new:
            only = recs[0]
            if only.base is not None and recs.count(only) == len(recs):
                self._write_known_run(con, only, batch, rev)
                return {}
        elif len(new) == 1 and new[0].base is None and recs.count(new[0]) == len(recs):
            bases = self._write_new_run(con, new[0], batch, rev)
            if bases is not None:
                return bases
        bases = {}
        next_in_batch: dict[str, int] = {}
        # The new runs' rows and run_starts, a list per column: no tuple per run (at
        # 10,000 runs starting, 20,000 tuples made here set off the collector's full
        # passes over every live run while the trio thread waited for the GIL).
        new_runs: list[list[Any]] = [[] for _ in range(10)]
        (new_ids, parents, subjects, run_names, callers, channels, inputs, started, hosts,
         pids) = new_runs
        start_payloads: list[str | None] = []
        # New recorders, and any whose start was in a batch that was given up on (looked
        # for among the batch's distinct recorders: a Python loop per run, not per event).
        distinct = dict.fromkeys(recs)
        news = dict.fromkeys(batch.new)
        news.update(dict.fromkeys(r for r in distinct if r.base is None and r not in news))
        known = _last_seqs(con, list(dict.fromkeys(r.run_id for r in news if r.base is None)))
        for rec in news:
            rid = rec.run_id
            if rec.base is not None:
                continue
            if rid in next_in_batch:
                base = next_in_batch[rid]
            else:
                seen = known.get(rid)
                if seen is not None:  # a resumed run: continue after its last event
                    base = seen + 1
                else:
                    info = rec.info
                    new_ids.append(rid)
                    parents.append(info.parent_run_id)
                    subjects.append(_text(info.subject_id))
                    run_names.append(_text(info.name))
                    callers.append(_text(info.caller_id))
                    channels.append(_text(info.channel_id))
                    inputs.append(_text(_dumps(info.inputs)))
                    started.append(rec.started_us)
                    hosts.append(rec.host)
                    pids.append(rec.pid)
                    start_payloads.append(_text(_dumps({"inputs": info.inputs,
                                                        "caller_id": info.caller_id})))
                    base = 1
            bases[rec] = base
            next_in_batch[rid] = base + rec.count
        # The event columns, built at C speed (no Python code per event): the run id
        # and absolute seq of each event from its recorder's base.
        base_of = {r: r.base if r.base is not None else bases[r] for r in distinct}
        ids = tuple(map(_RUN_ID, recs))
        seqs = tuple(map(add, map(base_of.__getitem__, recs), batch.seqs))
        # A run's seqs rise in batch order (a recorder appends in order) when each run
        # has one recorder here: its first and last seqs are its first and last events'.
        last = dict(zip(ids, seqs, strict=True))
        if len(last) == len(base_of):
            first = dict(zip(reversed(ids), reversed(seqs), strict=True))
        else:  # two recorders of one run in the batch (a resume): the exact bounds
            first, last = {}, {}
            for rid, seq in zip(ids, seqs, strict=True):
                if seq > last.get(rid, -1):
                    last[rid] = seq
                if seq < first.get(rid, seq + 1):
                    first[rid] = seq
        if new_ids:
            k = len(new_ids)
            change = self._rev(con, rev)
            # Each run_start gets the next id, given here: the run's `first_event`.
            # (An id mark keeps the highest id ever handed out in the table: see `_V4`.)
            top = int(con.execute("SELECT coalesce(max(id), 0) FROM events").fetchone()[0])
            first_ids = list(range(top + 1, top + 1 + k))
            for column in (parents, subjects, callers, channels):  # mostly None
                column[:] = map(_nulls, column, column)
            _execute_columns(con, _INSERT_RUNS, (
                *new_runs, [last.pop(rid, 0) for rid in new_ids], first_ids, [change] * k))
            _execute_columns(con, _INSERT_STARTS, (
                first_ids, new_ids, [0] * k, started, ["run_start"] * k, [_NULL] * k,
                list(map(_nulls, run_names, run_names)), [_NULL] * k, start_payloads),
                _clean_start)
        if last:  # runs already in the journal: raise last_seq, only from below
            raised = _execute_columns(con, _RAISE_LAST_SEQ, (
                list(last.values()), list(last), list(map(first.__getitem__, last))))
            if raised != len(last):
                self._seq_conflict(con, {rid: first[rid] for rid in last})
        if ids:
            self.stats.shared_rows += _insert_events(con, ids, seqs, batch)
        self._write_closes(con, batch, rev)
        return bases

    def _write_known_run(self, con: sqlite3.Connection, rec: Any, batch: Batch,
                         rev: list[int]) -> None:
        """`_write_batch` when every event is of one recorder whose seq base is known
        (a run's checkpoint after a step): the same rows and checks, less bookkeeping."""
        base, rid = rec.base, rec.run_id
        seqs = batch.seqs
        lo, hi = base + min(seqs), base + max(seqs)
        cur = con.execute("UPDATE runs SET last_seq = ? WHERE run_id = ? AND last_seq < ?",
                          (hi, rid, lo))
        if cur.rowcount != 1:
            self._seq_conflict(con, {rid: lo})
        rows = [(rid, base + s, ts, kind, _nulls(it, it), _nulls(name, name), dur, payload)
                for s, ts, kind, it, name, dur, payload in zip(
                    seqs, batch.ts, batch.kinds, batch.iters, batch.names, batch.durs,
                    batch.payloads, strict=True)]
        _execute_rows(con, _INSERT_EVENTS, rows, _clean_event)
        if batch.closes:
            self._write_closes(con, batch, rev)

    def _write_new_run(self, con: sqlite3.Connection, rec: Any, batch: Batch,
                       rev: list[int]) -> dict[Any, int] | None:
        """`_write_batch` when every event is of one recorder that opens its run (a run's
        first transaction): the same rows, its run_start and events in one statement.
        None, with nothing written, if the run is in the journal already (a resumed run:
        `_write_batch` continues its seq)."""
        rid = rec.run_id
        seen, top = con.execute("SELECT (SELECT last_seq FROM runs WHERE run_id = ?), "
                                "(SELECT coalesce(max(id), 0) FROM events)", (rid,)).fetchone()
        if seen is not None:
            return None
        info, seqs = rec.info, batch.seqs
        # Each run_start gets the next id, given here: the run's `first_event`; its events
        # follow it (what SQLite would number them).
        con.execute(_INSERT_RUNS.sql(1), (
            rid, info.parent_run_id, _text(info.subject_id), _text(info.name),
            _text(info.caller_id), _text(info.channel_id), _text(_dumps(info.inputs)),
            rec.started_us, rec.host, rec.pid, 1 + max(seqs) if seqs else 0, top + 1,
            self._rev(con, rev)))
        rows = [(top + 1, rid, 0, rec.started_us, "run_start", None, _text(info.name), None,
                 _text(_dumps({"inputs": info.inputs, "caller_id": info.caller_id})))]
        rows += [(top + i, rid, 1 + s, ts, kind, _nulls(it, it), _nulls(name, name), dur, payload)
                 for i, (s, ts, kind, it, name, dur, payload) in enumerate(zip(
                     seqs, batch.ts, batch.kinds, batch.iters, batch.names, batch.durs,
                     batch.payloads, strict=True), start=2)]
        _execute_rows(con, _INSERT_STARTS, rows, _clean_start)
        if batch.closes:
            self._write_closes(con, batch, rev)
        return {rec: 1}

    def _write_closes(self, con: sqlite3.Connection, batch: Batch, rev: list[int]) -> None:
        """The closed runs' roll-ups (`Batch.closes`)."""
        closes = batch.closes
        if not closes:
            return
        r = self._rev(con, rev)
        if len(closes) == 1:  # one run closing (a run at a time): no join with VALUES
            row = closes[0][1]
            values = (row[1], row[2], _text(row[3]), _text(row[4]), *row[5:12],
                      _text(row[12]), row[13], int(bool(row[14])), r, row[0])
            con.execute(_CLOSE_RUN, tuple(map(_nulls, values, values)))
            return
        # Many (runs closing together): a list per column, no tuple per run (see the
        # new runs' rows in `_write_batch`).
        (run_ids, ended, status, output, error, steps, tool_calls, runtime, input_tokens,
         output_tokens, thinking_tokens, cost, reason, exit_code, truncated) = (
            list(column) for column in zip(*(row for _, row in closes), strict=True))
        for column in (output, error, reason):
            column[:] = map(_text, column)
        columns = [ended, status, output, error, steps, tool_calls, runtime, input_tokens,
                   output_tokens, thinking_tokens, cost, reason, exit_code,
                   [int(bool(t)) for t in truncated], [r] * len(closes), run_ids]
        for column in columns:
            column[:] = map(_nulls, column, column)
        _execute_columns(con, _CLOSE_RUNS, columns)

    @staticmethod
    def _seq_conflict(con: sqlite3.Connection, first: dict[str, int]) -> None:
        """Raise for the runs whose seqs this batch would duplicate (the transaction is undone)."""
        bad = []
        for rid, lo in first.items():
            row = con.execute("SELECT last_seq FROM runs WHERE run_id = ?", (rid,)).fetchone()
            if row is None or int(row[0]) >= lo:
                bad.append(f"{rid} (from seq {lo}; journal has "
                           f"{'no row' if row is None else f'up to {row[0]}'})")
        raise StoreError("audit rows not written: another writer recorded the same seqs of "
                         f"run {', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}")

    # ------------------------------------------------------------------- ops

    def _apply_one(self, con: sqlite3.Connection, op: Op, rev: list[int]) -> Any:
        """Apply `op`; an op the store refuses (a `StoreError`, e.g. a save for a run never
        registered) returns the error as its result, so it never takes the audit rows or
        other operations of the transaction down with it.

        No savepoint: every refusal is decided before the op writes anything (a rule
        for `_apply`), which saves two statements per operation on the hot path.
        """
        try:
            return self._apply(con, op, rev)
        except StoreError as exc:
            return exc

    def _apply(self, con: sqlite3.Connection, op: Op, rev: list[int]) -> Any:
        # Rule: an op that refuses (raises StoreError) does so before it writes.
        if isinstance(op, SaveCheckpoint):
            return self._save(con, op, rev)
        if isinstance(op, ReserveBudget):
            return self._reserve(con, op, rev)
        if isinstance(op, RegisterRun):
            return self._register(con, op, rev)
        if isinstance(op, FinishRun):
            con.execute("UPDATE checkpoints SET status = ?, error = ?, state = NULL, "
                        "updated_at = ?, rev = ? WHERE run_id = ?",
                        (op.status, _text(op.error), now_us(), self._rev(con, rev), op.run_id))
            return None
        if isinstance(op, SettleBudget):
            con.execute("UPDATE budget_spend SET runtime_seconds = runtime_seconds + ?, "
                        "tokens = max(tokens, ?), cost_usd = max(cost_usd, ?), "
                        "settled = 1, rev = ? WHERE id = ?",
                        (op.runtime_seconds, op.tokens, op.cost_usd, self._rev(con, rev),
                         op.reservation_id))
            return None
        if isinstance(op, LoseRun):
            return self._lose(con, op, rev)
        if isinstance(op, ClaimRun):
            return self._claim(con, op, rev)
        if isinstance(op, ReleaseRun):
            con.execute("UPDATE checkpoints SET pid = 0, pid_start = NULL, rev = ? "
                        "WHERE run_id = ? AND host = ? AND pid = ?",
                        (self._rev(con, rev), op.run_id, op.owner.host, op.owner.pid))
            return None
        if isinstance(op, SetBudget):
            con.execute("INSERT OR REPLACE INTO budgets VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (op.caller_id, op.window_seconds, op.max_runs, op.max_runtime_seconds,
                         op.max_tokens, op.max_cost_usd, now_us()))
            return None
        if isinstance(op, RemoveBudget):
            cur = con.execute("DELETE FROM budgets WHERE caller_id = ?", (op.caller_id,))
            return cur.rowcount > 0
        if isinstance(op, CreateBatch):
            return self._create_batch(con, op, rev)
        if isinstance(op, ClaimBatch):
            return self._claim_batch(con, op, rev)
        if isinstance(op, FinishBatch):
            o = op.owner
            cur = con.execute("UPDATE batches SET status = 'finished', ended_at = ?, pid = 0, "
                              "pid_start = NULL, rev = ? WHERE batch_id = ? AND host = ? "
                              "AND pid = ?", (now_us(), self._rev(con, rev), op.batch_id,
                                              o.host, o.pid))
            return cur.rowcount > 0
        if isinstance(op, MarkDelivery):
            marks = delivery_marks(op)  # refused (a StoreError) before anything is written
            if marks:
                # A change number: the analysts' copy of the task follows its delivery.
                r = self._rev(con, rev)
                con.executemany("UPDATE batch_tasks SET delivery = ?, delivery_error = ?, "
                                "rev = ? WHERE batch_id = ? AND idx = ?",
                                [(state, error, r, bid, idx)
                                 for state, error, bid, idx in marks])
            return None
        raise TypeError(f"unknown journal operation {op!r}")

    def _register(self, con: sqlite3.Connection, op: RegisterRun, rev: list[int]) -> None:
        now = now_us()
        o = op.owner
        # One statement: a new run's row, or a registered run's taken back (its spec kept).
        con.execute(
            "INSERT INTO checkpoints (run_id, spec, status, host, pid, pid_start, "
            "heartbeat_at, created_at, updated_at, rev) "
            "VALUES (?, ?, 'running', ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (run_id) DO UPDATE SET "
            "status = 'running', error = NULL, host = excluded.host, pid = excluded.pid, "
            "pid_start = excluded.pid_start, heartbeat_at = excluded.heartbeat_at, "
            "updated_at = excluded.updated_at, rev = excluded.rev",
            (op.run_id, _text(_dumps(op.spec)), o.host, o.pid, o.started, now, now, now,
             self._rev(con, rev)))

    def _save(self, con: sqlite3.Connection, op: SaveCheckpoint, rev: list[int]) -> bool:
        cp, o, u = op.checkpoint, op.owner, op.checkpoint.usage
        now = now_us()
        state = _text(_dumps(cp.state) if op.state_json is None else op.state_json)
        # No change number here: the analysts' copy of a checkpoint follows its
        # registration, claims and end, not every save (one statement less per save).
        cur = con.execute(
            "UPDATE checkpoints SET state = ?, steps = ?, tool_calls = ?, input_tokens = ?, "
            "output_tokens = ?, thinking_tokens = ?, cost_usd = ?, heartbeat_at = ?, "
            "updated_at = ? WHERE run_id = ?",
            (state, cp.steps, cp.tool_calls, u.input_tokens, u.output_tokens,
             u.thinking_tokens, u.cost_usd, now, now, cp.run_id))
        if cur.rowcount:
            return True
        if op.spec is None:
            raise StoreError(f"checkpoint of run {cp.run_id} not saved: the run was never "
                             "registered (register it with its spec first)")
        con.execute(
            "INSERT INTO checkpoints (run_id, spec, state, steps, tool_calls, input_tokens, "
            "output_tokens, thinking_tokens, cost_usd, status, host, pid, pid_start, "
            "heartbeat_at, created_at, updated_at, rev) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 'running', ?, ?, ?, ?, ?, ?, ?)",
            (cp.run_id, _text(_dumps(op.spec)), state, cp.steps, cp.tool_calls,
             u.input_tokens, u.output_tokens, u.thinking_tokens, u.cost_usd, o.host, o.pid,
             o.started, now, now, now, self._rev(con, rev)))
        return True

    def _lose(self, con: sqlite3.Connection, op: LoseRun, rev: list[int]) -> bool:
        lost = Status.LOST
        values = (str(lost), lost.exit_code, str(lost), _text(op.why))
        now = now_us()
        cur = con.execute("UPDATE runs SET status = ?, exit_code = ?, reason = ?, error = ?, "
                          "ended_at = ?, rev = ? WHERE run_id = ? AND status IS NULL",
                          (*values, now, self._rev(con, rev), op.run_id))
        con.execute(_SETTLE_LOST, (self._rev(con, rev), op.run_id))
        if cur.rowcount:
            return True
        info = op.info
        if info is None or con.execute("SELECT 1 FROM runs WHERE run_id = ?",
                                       (op.run_id,)).fetchone():
            return False
        con.execute(
            "INSERT INTO runs (run_id, parent_run_id, subject_id, name, caller_id, channel_id, "
            "inputs, started_at, ended_at, status, exit_code, reason, error, rev) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (op.run_id, info.get("parent_run_id"), info.get("subject_id"), info.get("name"),
             info.get("caller_id"), info.get("channel_id"),
             _text(_dumps(info.get("inputs") or {})), op.started_us or now, now, *values,
             self._rev(con, rev)))
        return True

    def _claim(self, con: sqlite3.Connection, op: ClaimRun, rev: list[int]) -> bool:
        row = con.execute("SELECT status, host, pid, pid_start FROM checkpoints "
                          "WHERE run_id = ?", (op.run_id,)).fetchone()
        if row is None or row[0] != "running":
            return False
        holder = Owner(row[1] or "", int(row[2] or 0), row[3])
        me = op.owner
        mine = (holder.host, holder.pid, holder.started) == (me.host, me.pid, me.started)
        vouched = op.gone is not None and holder == op.gone
        if not mine and not vouched and not holder.gone():
            return False
        now = now_us()
        con.execute("UPDATE checkpoints SET host = ?, pid = ?, pid_start = ?, heartbeat_at = ?, "
                    "rev = ? WHERE run_id = ?",
                    (me.host, me.pid, me.started, now, self._rev(con, rev), op.run_id))
        return True

    # ---------------------------------------------------------------- batches

    def _create_batch(self, con: sqlite3.Connection, op: CreateBatch, rev: list[int]) -> bool:
        if con.execute("SELECT 1 FROM batches WHERE batch_id = ?", (op.batch_id,)).fetchone():
            raise StoreError(f"batch {op.batch_id} already exists")
        r = self._rev(con, rev)
        o = op.owner
        con.execute("INSERT INTO batches (batch_id, name, source, created_at, status, tasks, "
                    "concurrency, options, host, pid, pid_start, rev) "
                    "VALUES (?, ?, ?, ?, 'running', ?, ?, ?, ?, ?, ?, ?)",
                    (op.batch_id, _text(op.name), _text(op.source), now_us(), len(op.tasks),
                     op.concurrency, _text(_dumps(dict(op.options))), o.host, o.pid,
                     o.started, r))
        con.executemany("INSERT INTO batch_tasks (batch_id, idx, task_id, run_id, spec, rev) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        [(op.batch_id, i, _text(t.task_id), t.run_id, _text(_dumps(t.spec)), r)
                         for i, t in enumerate(op.tasks)])
        return True

    def _claim_batch(self, con: sqlite3.Connection, op: ClaimBatch, rev: list[int]) -> bool:
        row = con.execute("SELECT status, host, pid, pid_start FROM batches WHERE batch_id = ?",
                          (op.batch_id,)).fetchone()
        if row is None:
            return False
        holder = Owner(row[1] or "", int(row[2] or 0), row[3])
        me = op.owner
        mine = (holder.host, holder.pid, holder.started) == (me.host, me.pid, me.started)
        if row[0] == "running" and not mine and not holder.gone():
            return False
        con.execute("UPDATE batches SET status = 'running', ended_at = NULL, host = ?, pid = ?, "
                    "pid_start = ?, rev = ? WHERE batch_id = ?",
                    (me.host, me.pid, me.started, self._rev(con, rev), op.batch_id))
        return True

    def batches(self, *, batch_id: str | None = None, prefix: str | None = None,
                limit: int | None = None) -> list[BatchRow]:
        """Batches newest first (one id, an id prefix, or all), their tasks counted by status."""
        if not self.exists():
            return []
        where, params = self._id_filter("batch_id", batch_id, prefix)
        sql = ("SELECT batch_id, name, source, created_at, ended_at, status, tasks, concurrency, "
               "options, host, pid, pid_start FROM batches" + where
               + " ORDER BY created_at DESC, batch_id DESC")
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self._read() as con:
            rows = con.execute(sql, params).fetchall()
            delivers = bool(rows) and _delivers(con)
            out = []
            for (bid, name, source, created, ended, status, tasks, conc, options, host, pid,
                 start) in rows:
                counts = dict(con.execute(
                    "SELECT CASE WHEN r.run_id IS NULL AND c.run_id IS NULL THEN 'pending' "
                    "WHEN r.status IS NULL THEN 'running' ELSE r.status END AS s, count(*) "
                    "FROM batch_tasks t LEFT JOIN runs r ON r.run_id = t.run_id "
                    "LEFT JOIN checkpoints c ON c.run_id = t.run_id "
                    "WHERE t.batch_id = ? GROUP BY s", (bid,)).fetchall())
                deliveries = dict(con.execute(DELIVERY_COUNTS, (bid,)).fetchall()) \
                    if delivers else {}
                created_at = _utc(created)
                assert created_at is not None
                out.append(BatchRow(bid, name or "", source or "", created_at, _utc(ended),
                                    status, int(tasks), int(conc),
                                    Owner(host or "", int(pid or 0), start),
                                    {str(k): int(v) for k, v in counts.items()},
                                    json.loads(options) if options else {},
                                    {str(k): int(v) for k, v in deliveries.items()}))
        return out

    def batch_tasks(self, batch_id: str) -> list[TaskRow]:
        """The tasks of a batch in file order, each with its run's status and checkpoint,
        and where its result's delivery stands (with the result, when one is owed)."""
        if not self.exists():
            return []
        with self._read() as con:
            rows = con.execute(batch_tasks_sql(_delivers(con), "?"), (batch_id,)).fetchall()
            saved: dict[str, SavedRun] = {}
            if any(r[6] for r in rows):
                saved = {s.run_id: s for s in saved_rows(
                    con, " WHERE run_id IN (SELECT run_id FROM batch_tasks WHERE batch_id = ?)",
                    (batch_id,))}
        return task_rows(rows, saved)

    # ---------------------------------------------------------------- budgets

    @staticmethod
    def _budget_row(con: sqlite3.Connection, caller_id: str) -> Any:
        return con.execute(
            "SELECT caller_id, window_seconds, max_runs, max_runtime_seconds, max_tokens, "
            "max_cost_usd FROM budgets WHERE caller_id IN (?, ?) "
            "ORDER BY caller_id = ? DESC LIMIT 1",
            (caller_id, DEFAULT_CALLER, caller_id)).fetchone()

    @staticmethod
    def _with_spend(con: sqlite3.Connection, caller_id: str, row: Any) -> CallerBudget:
        since = now_us() - int(row[1] * 1e6)
        spent = con.execute(
            "SELECT count(*), coalesce(sum(runtime_seconds), 0), coalesce(sum(tokens), 0), "
            "coalesce(sum(cost_usd), 0) FROM budget_spend WHERE caller_id = ? AND ts > ?",
            (caller_id, since)).fetchone()
        runs, runtime, tokens, cost = spent if spent else (0, 0.0, 0, 0.0)
        return CallerBudget(caller_id, float(row[1]), row[2], row[3], row[4], row[5],
                            int(runs), float(runtime), int(tokens), float(cost))

    def _reserve(self, con: sqlite3.Connection, op: ReserveBudget,
                 rev: list[int]) -> Reservation | None:
        row = self._budget_row(con, op.caller_id)
        if row is None:
            return None
        budget = self._with_spend(con, op.caller_id, row)
        if op.resumed and op.run_id:
            # Its row in the current window (one from an earlier window no longer counts).
            own = con.execute("SELECT id, tokens, cost_usd FROM budget_spend WHERE run_id = ? "
                              "AND caller_id = ? AND ts > ? ORDER BY id DESC LIMIT 1",
                              (op.run_id, op.caller_id,
                               now_us() - int(budget.window_seconds * 1e6))).fetchone()
            if own is not None:
                return Reservation(budget.without(int(own[1]), float(own[2])), int(own[0]))
        elif budget.refusal() is not None:
            return Reservation(budget, None)
        cur = con.execute("INSERT INTO budget_spend (caller_id, ts, run_id, rev) "
                          "VALUES (?, ?, ?, ?)",
                          (op.caller_id, now_us(), op.run_id or None, self._rev(con, rev)))
        return Reservation(budget, cur.lastrowid)

    def budget(self, caller_id: str) -> CallerBudget | None:
        """The budget that applies to `caller_id` (own row, else `*`) with its spend; None if none.

        A journal that does not exist yet holds no budget.
        """
        if not self.exists():
            return None
        with self._read() as con:
            row = self._budget_row(con, caller_id)
            return None if row is None else self._with_spend(con, caller_id, row)

    def budgets(self) -> list[CallerBudget]:
        """Every budget row with its own caller's current spend."""
        if not self.exists():
            return []
        with self._read() as con:
            rows = con.execute("SELECT caller_id, window_seconds, max_runs, max_runtime_seconds, "
                               "max_tokens, max_cost_usd FROM budgets ORDER BY caller_id"
                               ).fetchall()
            return [self._with_spend(con, r[0], r) for r in rows]

    # ------------------------------------------------------------ checkpoints

    def saved_runs(self, *, run_id: str | None = None, prefix: str | None = None,
                   running: bool = False, damaged: bool = False) -> list[SavedRun]:
        """Registered runs: one id, an id prefix, or every run still marked `running`.

        A row whose spec or state is not JSON raises `ValueError`; with `damaged` it
        comes back flagged instead (`SavedRun.damaged`).
        """
        if not self.exists():
            return []
        where, params = self._id_filter("run_id", run_id, prefix)
        if running:
            where += (" AND " if where else " WHERE ") + "status = 'running'"
        with self._read() as con:
            return saved_rows(con, where + " ORDER BY created_at, run_id", params,
                              damaged=damaged)

    @staticmethod
    def _id_filter(column: str, exact: str | None, prefix: str | None
                   ) -> tuple[str, list[Any]]:
        """A WHERE clause (or "") matching one id or an id prefix."""
        where: list[str] = []
        params: list[Any] = []
        if exact is not None:
            where.append(f"{column} = ?")
            params.append(exact)
        if prefix is not None:
            where.append(f"{column} LIKE ? ESCAPE '\\'")
            params.append(prefix.replace("\\", "\\\\").replace("%", "\\%")
                          .replace("_", "\\_") + "%")
        return (" WHERE " + " AND ".join(where)) if where else "", params

    def interrupted(self) -> list[SavedRun]:
        """Runs still marked `running` whose holder is provably gone (`Owner.gone`: on
        this machine, its pid is gone or recycled; on another, never provable here).

        A row that cannot be read comes back flagged (`SavedRun.damaged`), never
        hiding the others. Spill files left beside the journal are written first if
        the write lock is free at once (`replay_spills`): a run whose close one holds
        is not interrupted.
        """
        self.replay_spills()
        return [r for r in self.saved_runs(running=True, damaged=True) if r.owner.gone()]

    def payloads(self, run_id: str, kind: str) -> list[str]:
        """The payloads of run `run_id`'s events of `kind`, in seq order."""
        if not self.exists():
            return []
        with self._read() as con:
            # No index by run: scan from the run's first event (`runs.first_event`) on.
            rows = con.execute("SELECT payload FROM events WHERE id >= coalesce((SELECT "
                               "first_event FROM runs WHERE run_id = ?), 0) AND "
                               "run_id = ? AND kind = ? "
                               "ORDER BY seq", (run_id, run_id, kind)).fetchall()
        return [r[0] for r in rows]

    # -------------------------------------------------------- analysts' feed

    @contextmanager
    def changes(self, events_after: int, rev_after: int) -> Iterator[Changes]:
        """A consistent snapshot of what changed since a sync cursor (writers are not blocked).

        Reads use a connection of their own, so a long sync never holds this
        process's writers.
        """
        if not self.exists():
            raise StoreError(f"no journal at {self.path}")
        self.replay_spills()  # rows another process kept at exit, if the lock is free now
        try:
            con = sqlite3.connect(self.path, timeout=self.lock_timeout, isolation_level=None,
                                  check_same_thread=False)
        except sqlite3.Error as exc:
            raise self._error("cannot read", exc) from exc
        try:
            con.execute("BEGIN")
            yield Changes(con, events_after, rev_after)
        except sqlite3.Error as exc:
            raise self._error("cannot read", exc) from exc
        finally:
            with contextlib.suppress(sqlite3.Error):
                con.execute("COMMIT")
            con.close()

    def purge(self, before_us: int) -> tuple[int, int]:
        """Delete closed runs that ended before `before_us`, their events, finished checkpoints
        and finished batches. The runs of a batch that has not finished stay, whatever their
        age (its resume tells a task that ran from one that never did by its run), and so
        do the runs whose result is owed a delivery, with their tasks and batch (the
        batch's other tasks go: `PURGE_KEPT_RUNS`, `PURGE_TASKS`, `PURGE_BATCHES`), so
        `kernel batch --resume` still delivers them, from the runs row.

        Returns:
            (runs deleted, events deleted).
        """
        if not self.exists():
            return 0, 0
        with self._write() as con:
            top = int(con.execute("SELECT coalesce(max(id), 0) FROM events").fetchone()[0])
            old = (f"SELECT run_id FROM runs WHERE ended_at IS NOT NULL AND ended_at < ? "
                   f"AND run_id NOT IN ({PURGE_KEPT_RUNS})")
            ev = con.execute(f"DELETE FROM events WHERE run_id IN ({old})", (before_us,))
            n_events = ev.rowcount
            # The highest id stays handed out (SQLite numbers new rows after the highest
            # id left): an id mark takes the place of a deleted newest event (see `_V4`);
            # older marks are superseded.
            con.execute("DELETE FROM events WHERE run_id = '' AND kind = ? AND id < ?",
                        (ID_MARK, top))
            if top and con.execute("SELECT 1 FROM events WHERE id = ?", (top,)).fetchone() is None:
                con.execute("INSERT INTO events (id, run_id, seq, ts, kind) "
                            "VALUES (?, '', 0, ?, ?)", (top, now_us(), ID_MARK))
            con.execute("DELETE FROM checkpoints WHERE status != 'running' AND updated_at < ? "
                        f"AND run_id NOT IN ({PURGE_KEPT_RUNS})", (before_us,))
            rn = con.execute("DELETE FROM runs WHERE ended_at IS NOT NULL AND ended_at < ? "
                             f"AND run_id NOT IN ({PURGE_KEPT_RUNS})", (before_us,))
            con.execute(PURGE_TASKS.format(p="?"), (before_us,))
            con.execute(PURGE_BATCHES.format(p="?"), (before_us,))
            return rn.rowcount, n_events


class Changes:
    """What a sync reads from the journal, inside one read snapshot."""

    def __init__(self, con: sqlite3.Connection, events_after: int, rev_after: int) -> None:
        self._con = con
        self.events_after = events_after
        self.rev_after = rev_after
        row = con.execute("SELECT value FROM meta WHERE key = 'rev'").fetchone()
        #: The change number this snapshot is complete up to (the next cursor).
        self.rev = int(row[0]) if row else 0
        last = con.execute("SELECT coalesce(max(id), 0) FROM events").fetchone()
        #: The last event id in this snapshot (the next cursor).
        self.last_event = int(last[0]) if last else 0

    def events(self, chunk: int = 100_000) -> Iterator[list[tuple[Any, ...]]]:
        """New events in id order, in lists of at most `chunk` rows (`EVENT_COLUMNS`)."""
        cur = self._con.execute(
            f"SELECT {', '.join(EVENT_COLUMNS)} FROM events WHERE id > ? AND id <= ? "
            f"AND NOT (run_id = '' AND kind = '{ID_MARK}') ORDER BY id",  # no id marks
            (self.events_after, self.last_event))
        while True:
            rows = cur.fetchmany(chunk)
            if not rows:
                return
            yield rows

    def _changed(self, table: str, columns: Sequence[str]) -> list[tuple[Any, ...]]:
        return self._con.execute(
            f"SELECT {', '.join(columns)} FROM {table} WHERE rev > ? AND rev <= ?",
            (self.rev_after, self.rev)).fetchall()

    def runs(self) -> list[tuple[Any, ...]]:
        """Runs added or changed since the cursor (`RUN_COLUMNS`)."""
        return self._changed("runs", RUN_COLUMNS)

    def checkpoints(self) -> list[tuple[Any, ...]]:
        """Checkpoints added or changed since the cursor (`CHECKPOINT_COLUMNS`)."""
        return self._changed("checkpoints", CHECKPOINT_COLUMNS)

    def spend(self) -> list[tuple[Any, ...]]:
        """Budget spend rows added or settled since the cursor (`SPEND_COLUMNS`)."""
        return self._changed("budget_spend", SPEND_COLUMNS)

    def batches(self) -> list[tuple[Any, ...]]:
        """Batches added or changed since the cursor (`BATCH_COLUMNS`)."""
        return self._changed("batches", BATCH_COLUMNS)

    def batch_tasks(self, after: int | None = None) -> list[tuple[Any, ...]]:
        """Batch tasks added, or whose delivery moved, since the cursor (or since change
        number `after`: 0 for every task) (`BATCH_TASK_COLUMNS`; a journal an older
        kernel wrote, not migrated yet, has no delivery columns: NULL)."""
        columns = BATCH_TASK_COLUMNS if _delivers(self._con) else (
            *BATCH_TASK_COLUMNS[:4], "NULL", "NULL")
        return self._con.execute(
            f"SELECT {', '.join(columns)} FROM batch_tasks WHERE rev > ? AND rev <= ?",
            (self.rev_after if after is None else after, self.rev)).fetchall()

    def budgets(self) -> list[tuple[Any, ...]]:
        """Every budget row (a small table: copied whole) (`BUDGET_COLUMNS`)."""
        return self._con.execute(
            f"SELECT {', '.join(BUDGET_COLUMNS)} FROM budgets ORDER BY caller_id").fetchall()
