"""Carry an audit file from before the journal over: budgets, spend, resumable runs.

Until the journal existed, budgets and checkpoints lived in the analysts'
DuckDB file. When a journal is created beside such a file, this copies them
in (inside the journal's creating transaction), so no budget is forgotten and
an interrupted run stays resumable. Runs and events stay in the DuckDB file,
where analysts keep reading them; a resumed old run continues its seq after
its last event there.
"""

from __future__ import annotations

import random
import sqlite3
import time
from pathlib import Path
from typing import Any

from ._types import StoreBusyError, StoreError


def _us(value: Any) -> int | None:
    if value is None:
        return None
    if value.tzinfo is None:  # the old tables kept naive UTC timestamps
        import datetime as dt

        value = value.replace(tzinfo=dt.UTC)
    return int(value.timestamp() * 1_000_000)


def _connect(path: Path, lock_timeout: float) -> Any:
    import duckdb

    deadline = time.monotonic() + lock_timeout
    delay = 0.004
    while True:
        try:
            return duckdb.connect(str(path), read_only=True)
        except duckdb.Error as exc:
            text = str(exc)
            if "lock" not in text.lower():
                raise StoreError(f"cannot read the old audit file {path}: "
                                 f"{text.splitlines()[0] if text else exc}") from exc
            if time.monotonic() >= deadline:
                raise StoreBusyError(f"the old audit file {path} stayed locked (gave up after "
                                     f"{lock_timeout:g}s); its budgets and checkpoints must be "
                                     "copied into the journal first") from exc
            time.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, 0.05)


def import_legacy(con: sqlite3.Connection, path: Path, lock_timeout: float) -> None:
    """Copy `path`'s budgets, budget_spend and checkpoints (and their runs' seq) into `con`.

    Raises:
        ConfigError: `path` is not the kernel's (no `schema_version`, tables of its own).
    """
    duck = _connect(path, lock_timeout)
    try:
        tables = {r[0] for r in duck.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database()"
        ).fetchall()}
        if "schema_version" not in tables:
            # Somebody else's database (a mistyped --db): no journal is made beside it,
            # so runs are not recorded where no analysts' command will ever read them.
            from batteries.audit._schema import refuse_foreign

            refuse_foreign(duck)
        rev = 1
        if "budgets" in tables:
            for row in duck.execute(
                    "SELECT caller_id, window_seconds, max_runs, max_runtime_seconds, max_tokens, "
                    "max_cost_usd, updated_at FROM budgets").fetchall():
                con.execute("INSERT OR REPLACE INTO budgets VALUES (?, ?, ?, ?, ?, ?, ?)",
                            (*row[:6], _us(row[6])))
        if "budget_spend" in tables:
            con.executemany(
                "INSERT INTO budget_spend (caller_id, ts, run_id, runtime_seconds, tokens, "
                "cost_usd, settled, rev) VALUES (?, ?, ?, ?, ?, ?, 1, ?)",
                [(r[0], _us(r[1]), r[2], r[3], r[4], r[5], rev) for r in duck.execute(
                    "SELECT caller_id, ts, run_id, runtime_seconds, tokens, cost_usd "
                    "FROM budget_spend").fetchall()])
        if "checkpoints" in tables:
            rows = duck.execute(
                "SELECT run_id, spec, state, steps, tool_calls, input_tokens, output_tokens, "
                "thinking_tokens, cost_usd, status, error, host, pid, created_at, updated_at "
                "FROM checkpoints").fetchall()
            con.executemany(
                "INSERT OR REPLACE INTO checkpoints (run_id, spec, state, steps, tool_calls, "
                "input_tokens, output_tokens, thinking_tokens, cost_usd, status, error, host, "
                "pid, created_at, updated_at, rev) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(*r[:13], _us(r[13]), _us(r[14]), rev) for r in rows])
            running = [r[0] for r in rows if r[9] == "running"]
            if running and "runs" in tables and "events" in tables:
                _carry_runs(duck, con, running, rev)
        con.execute("UPDATE meta SET value = ? WHERE key = 'rev'", (rev,))
    finally:
        duck.close()


def _carry_runs(duck: Any, con: sqlite3.Connection, run_ids: list[str], rev: int) -> None:
    """Copy the rows of resumable runs, with their last seq, so a resume continues it."""
    found = duck.execute(
        "SELECT r.run_id, r.parent_run_id, r.subject_id, r.name, r.caller_id, r.channel_id, "
        "CAST(r.inputs AS VARCHAR), epoch_us(r.started_at), r.host, r.pid, "
        "(SELECT max(seq) FROM events e WHERE e.run_id = r.run_id) "
        "FROM runs r WHERE r.run_id IN (SELECT unnest(?::VARCHAR[]))", [run_ids]).fetchall()
    con.executemany(
        "INSERT OR IGNORE INTO runs (run_id, parent_run_id, subject_id, name, caller_id, "
        "channel_id, inputs, started_at, host, pid, last_seq, rev) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [(*r[:10], int(r[10] or 0), rev) for r in found])


