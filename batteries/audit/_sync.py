"""Bring the analysts' DuckDB file up to date from the journal, in Arrow batches.

The journal (SQLite) is where every process writes; the DuckDB file is where
analysts read. `sync` copies what changed since the file's cursor
(`sync_state`: the last journal event id and change number it holds):

- events: appended in id order, 100k rows per Arrow batch;
- runs, checkpoints, budget spend: rows whose change number moved are
  replaced (a run's row changes when it closes);
- batches and their tasks (which run each task became, where its delivery
  stands): rows whose change number moved are replaced (a task's moves when
  its delivery is marked); a file migrated to schema 7 gets every task again
  once (`sync_state.tasks_rev`), with the delivery columns it had no room for;
- budgets: copied whole (a handful of rows; deletions show too).

Everything, cursor included, is one DuckDB transaction, so a sync that dies
half-way leaves the file as it was and the next one starts from the same
cursor. The journal is read inside one read snapshot, which in WAL mode
never blocks a writer: a run never waits for a sync, and a sync only waits
for other users of the DuckDB file.

With a PostgreSQL store (`--store` / `$KERNEL_STORE`) the same copy reads
the server instead of the journal (same tables, same cursor). A file
remembers which store feeds it (`sync_state.source`: NULL for the journal
beside it, else the server's URL without its password) and refuses to be
fed by another one, whose ids would not continue its cursor.

DuckDB's `sqlite_scanner` and `postgres_scanner` extensions would read the
stores directly, but they are downloaded on first use (and this kind of
machine often has no way to fetch them); reading with sqlite3 / psycopg and
inserting Arrow tables needs nothing beyond what is installed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kernel import AuditError
from kernel._dataclass import dataclass

from ._schema import current_version, migrate, refuse_foreign
from ._store import Store, first_line


@dataclass(slots=True)
class SyncReport:
    """What one sync copied."""

    events: int = 0
    runs: int = 0
    checkpoints: int = 0
    spend: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        return (f"synced {self.events} events, {self.runs} runs, {self.checkpoints} checkpoints, "
                f"{self.spend} budget rows in {self.seconds * 1000:.0f} ms")


# Column kinds: s string, j JSON text, i32/i64 integers, f double, t microseconds -> TIMESTAMPTZ,
# b 0/1 -> BOOLEAN.
_EVENTS = (("id", "i64"), ("run_id", "s"), ("seq", "i32"), ("ts", "t"), ("kind", "s"),
           ("iteration", "i32"), ("name", "s"), ("duration_ms", "f"), ("payload", "j"))
_RUNS = (("run_id", "s"), ("parent_run_id", "s"), ("subject_id", "s"), ("name", "s"),
         ("caller_id", "s"), ("channel_id", "s"), ("inputs", "j"), ("started_at", "t"),
         ("ended_at", "t"), ("status", "s"), ("output", "s"), ("error", "s"), ("steps", "i32"),
         ("tool_calls", "i32"), ("runtime_seconds", "f"), ("input_tokens", "i64"),
         ("output_tokens", "i64"), ("thinking_tokens", "i64"), ("cost_usd", "f"),
         ("host", "s"), ("pid", "i32"), ("reason", "s"), ("exit_code", "i32"),
         ("output_truncated", "b"))
_CHECKPOINTS = (("run_id", "s"), ("spec", "j"), ("state", "j"), ("steps", "i64"),
                ("tool_calls", "i64"), ("input_tokens", "i64"), ("output_tokens", "i64"),
                ("thinking_tokens", "i64"), ("cost_usd", "f"), ("status", "s"),
                ("error", "s"), ("host", "s"), ("pid", "i64"), ("pid_start", "i64"),
                ("heartbeat_at", "t"), ("created_at", "t"), ("updated_at", "t"))
_BUDGETS = (("caller_id", "s"), ("window_seconds", "f"), ("max_runs", "i64"),
            ("max_runtime_seconds", "f"), ("max_tokens", "i64"), ("max_cost_usd", "f"),
            ("updated_at", "t"))
_BATCHES = (("batch_id", "s"), ("name", "s"), ("source", "s"), ("created_at", "t"),
            ("ended_at", "t"), ("status", "s"), ("tasks", "i64"), ("concurrency", "i64"),
            ("options", "j"), ("host", "s"), ("pid", "i64"))
_BATCH_TASKS = (("batch_id", "s"), ("idx", "i64"), ("task_id", "s"), ("run_id", "s"),
                ("delivery", "s"), ("delivery_error", "s"))
_SPEND = (("id", "i64"), ("caller_id", "s"), ("ts", "t"), ("run_id", "s"),
          ("runtime_seconds", "f"), ("tokens", "i64"), ("cost_usd", "f"), ("settled", "b"))


def _table(rows: Sequence[tuple[Any, ...]], columns: Sequence[tuple[str, str]]) -> Any:
    import pyarrow as pa  # type: ignore[import-untyped, unused-ignore]

    types = {"s": pa.string(), "j": pa.string(), "i32": pa.int32(), "i64": pa.int64(),
             "f": pa.float64(), "t": pa.timestamp("us", tz="UTC"), "b": pa.bool_()}
    cols = list(zip(*rows, strict=True)) if rows else [() for _ in columns]
    arrays = []
    for (_, kind), values in zip(columns, cols, strict=True):
        if kind == "b":
            values = tuple(None if v is None else bool(v) for v in values)
        arrays.append(pa.array(values, types[kind]))
    return pa.Table.from_arrays(arrays, names=[c for c, _ in columns])


def _insert(cur: Any, table: str, view: str, columns: Sequence[tuple[str, str]]) -> None:
    """INSERT the registered `view` into `table`; JSON text DuckDB cannot parse stays a string."""
    names = ", ".join(c for c, _ in columns)
    sel = ", ".join(f"CASE WHEN json_valid({c}) THEN {c} ELSE to_json({c}) END" if k == "j"
                    else c for c, k in columns)
    cur.execute(f"INSERT INTO {table} ({names}) SELECT {sel} FROM {view}")


def _replace(cur: Any, table: str, key: str, rows: Sequence[tuple[Any, ...]],
             columns: Sequence[tuple[str, str]]) -> None:
    if not rows:
        return
    view = f"_ksync_{table}"
    cur.register(view, _table(rows, columns))
    try:
        cur.execute(f"DELETE FROM {table} WHERE {key} IN (SELECT {key} FROM {view})")
        _insert(cur, table, view, columns)
    finally:
        cur.unregister(view)


def sync(db: str | Path, *, lock_timeout: float | None = None) -> SyncReport:
    """Copy what the store holds and `db` does not yet (blocking).

    The store is the one in effect (`batteries.store.open_store`): a
    PostgreSQL server chosen with `--store` / `$KERNEL_STORE`, else the
    journal beside `db`. Creates the analysts' file if only the store
    exists, and the journal (carrying an old file's budgets and checkpoints
    over) if only the file exists.

    Raises:
        AuditError: Neither exists, one of them cannot be read or written
            (`AuditBusyError` if the DuckDB file stayed locked past the lock
            timeout), or the file is fed from another store.
        ConfigError: `db` is a directory or a file that is not a DuckDB
            database (empty, or anything else): the message says how the
            analysts' file is rebuilt from the store.
    """
    from batteries.store import StoreError, open_store

    t0 = time.perf_counter()
    report = SyncReport()
    store = Store(db) if lock_timeout is None else Store(db, lock_timeout=lock_timeout)
    journal = open_store(store.path, lock_timeout=lock_timeout)
    source: str | None = getattr(journal, "source", None)
    _check_file(store, journal, source)
    if not journal.exists():
        if not store.path.exists():
            raise AuditError(f"no audit database at {store.path}" if source is None
                             else f"no runs yet in store {source}")
        _check_source(store, _fed_from(store), source)
        try:  # create the journal now, carrying the old file's budgets and checkpoints over
            journal.commit(None, [])
        except StoreError:
            if not journal.exists():
                return report  # no journal, none can be made here: nothing was written to one
            raise
    try:
        with store.session(write=True) as cur:
            migrate(cur)
            found = cur.execute("SELECT events_id, rev, source, tasks_rev "
                                "FROM sync_state").fetchall()
            if found:
                _check_source(store, found[0][2], source)
            events_after, rev_after = (int(found[0][0]), int(found[0][1])) if found else (0, 0)
            # Set (by schema 7's migration): every task is copied again, from this cursor.
            tasks_after = int(found[0][3]) if found and found[0][3] is not None else None
            with journal.changes(events_after, rev_after) as ch:
                if ch.last_event == events_after and ch.rev == rev_after \
                        and tasks_after is None:
                    report.seconds = time.perf_counter() - t0
                    return report
                _copy(cur, ch, report, first=not found, source=source,
                      tasks_after=tasks_after)
    finally:
        journal.close()
    report.seconds = time.perf_counter() - t0
    return report


def _check_file(store: Store, journal: Any, source: str | None) -> None:
    """Refuse an analysts' file that is not a DuckDB database, saying how to get one back.

    Everything in the file comes from the store (a file from before the
    journal aside, whose runs exist nowhere else; such a file is a DuckDB
    database), so a file that is not one is rebuilt whole by moving it away
    and syncing again. It is never removed here: it may be something else
    the path was pointed at by mistake.
    """
    from kernel import ConfigError

    from .paths import not_duckdb

    if store.path.is_dir():
        raise ConfigError(f"audit database {store.path} is a directory: give a file, "
                          f"e.g. {store.path / 'kernel.duckdb'}")
    problem = not_duckdb(store.path)
    if problem is None:
        return
    feed = f"the journal {journal.path}" if source is None else f"store {source}"
    if not journal.exists():
        raise ConfigError(f"audit database {store.path} is not usable: {problem} (and there "
                          f"is no {feed} to rebuild it from); give another path, or move the "
                          "file away")
    raise ConfigError(f"audit database {store.path} is not usable: {problem}; the analysts' "
                      f"file is rebuilt from {feed}: move it away, then run `kernel sync`")


def _fed_from(store: Store) -> str | None:
    """The store an existing analysts' file says feeds it (None: the journal, or not yet fed)."""
    import duckdb

    with store.session(write=False) as cur:
        if current_version(cur) is None:
            refuse_foreign(cur)  # before a journal is made beside somebody else's database
        try:
            found = cur.execute("SELECT source FROM sync_state").fetchall()
        except duckdb.Error:  # an older file: no sync_state, or no source column
            return None
    return str(found[0][0]) if found and found[0][0] is not None else None


def _check_source(store: Store, fed_from: str | None, source: str | None) -> None:
    """Refuse to feed the file from a store other than the one that fed it so far."""
    if fed_from != source:
        raise AuditError(f"the analysts' file {store.path} is fed from "
                         f"{fed_from or 'the journal beside it'}, not "
                         f"{source or 'the journal beside it'}: give each store its own --db")


def _copy(cur: Any, ch: Any, report: SyncReport, *, first: bool,
          source: str | None = None, tasks_after: int | None = None) -> None:
    import duckdb

    cur.execute("BEGIN TRANSACTION")
    try:
        for rows in ch.events():
            cur.register("_ksync_events", _table(rows, _EVENTS))
            try:
                _insert(cur, "events", "_ksync_events", _EVENTS[1:])
            finally:
                cur.unregister("_ksync_events")
            report.events += len(rows)
        runs = ch.runs()
        _replace(cur, "runs", "run_id", runs, _RUNS)
        checkpoints = ch.checkpoints()
        _replace(cur, "checkpoints", "run_id", checkpoints, _CHECKPOINTS)
        spend = ch.spend()
        _replace(cur, "budget_spend", "id", spend, _SPEND)
        # A store that keeps no batches (one written before they existed) has none to copy.
        batches = ch.batches() if hasattr(ch, "batches") else []
        _replace(cur, "batches", "batch_id", batches, _BATCHES)
        # Keyed by batch and index: a task's row changes when its delivery is marked.
        tasks = ch.batch_tasks(tasks_after) if hasattr(ch, "batch_tasks") else []
        if tasks:
            cur.register("_ksync_batch_tasks", _table(tasks, _BATCH_TASKS))
            try:
                cur.execute("DELETE FROM batch_tasks WHERE (batch_id, idx) IN "
                            "(SELECT batch_id, idx FROM _ksync_batch_tasks)")
                _insert(cur, "batch_tasks", "_ksync_batch_tasks", _BATCH_TASKS)
            finally:
                cur.unregister("_ksync_batch_tasks")
        budgets = ch.budgets()
        cur.execute("DELETE FROM budgets")
        if budgets:
            cur.register("_ksync_budgets", _table(budgets, _BUDGETS))
            try:
                _insert(cur, "budgets", "_ksync_budgets", _BUDGETS)
            finally:
                cur.unregister("_ksync_budgets")
        report.runs, report.checkpoints, report.spend = len(runs), len(checkpoints), len(spend)
        if first:
            cur.execute("INSERT INTO sync_state (events_id, rev, synced_at, source) "
                        "VALUES (?, ?, now(), ?)", [ch.last_event, ch.rev, source])
        else:
            cur.execute("UPDATE sync_state SET events_id = ?, rev = ?, tasks_rev = NULL, "
                        "synced_at = now()", [ch.last_event, ch.rev])
        cur.execute("COMMIT")
    except BaseException as exc:
        with contextlib.suppress(duckdb.Error):
            cur.execute("ROLLBACK")
        if isinstance(exc, duckdb.Error):
            raise AuditError(f"cannot sync the analysts' file: {first_line(exc)}") from exc
        raise
