"""The analysts' schema (DESIGN.md "Analysts' schema") and its forward migrations.

The schema is a contract: analysts open the file in DuckDB, pandas or polars
and query `runs`, `events` and the views directly. `runs.status` is the
status a run *ended* with: NULL while it is open (running, or its
supervisor died and `kernel recover` has not closed it yet); `kernel runs`,
`stats`, `run_stats` and `critic_decisions.run_status` show it as
`running`. Columns analysts aggregate (durations, counts, tokens, cost) are
typed columns, not JSON fields: a p95
over a typed DOUBLE is several times faster than over a value extracted from
JSON. `payload` and `inputs` are DuckDB `JSON` for everything else.

Migrations only go forward. Each is a numbered list of statements applied in
one transaction together with its `schema_version` row, so a process that
dies half-way leaves the previous version intact. Never edit a released
migration: append a new one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from kernel import ConfigError

if TYPE_CHECKING:
    import duckdb

#: The schema version this code writes and expects.
SCHEMA_VERSION = 7

#: Columns of `runs`, in insert order.
RUN_COLUMNS: tuple[str, ...] = (
    "run_id", "parent_run_id", "subject_id", "name", "caller_id", "channel_id", "inputs",
    "started_at", "ended_at", "status", "output", "error", "steps", "tool_calls",
    "runtime_seconds", "input_tokens", "output_tokens", "thinking_tokens", "cost_usd",
    "host", "pid", "reason", "exit_code", "output_truncated",
)

#: Columns of `events`, in insert order.
EVENT_COLUMNS: tuple[str, ...] = (
    "run_id", "seq", "ts", "kind", "iteration", "name", "duration_ms", "payload",
)

#: The columns `RunRecorder.close` sets on a run's row.
CLOSE_COLUMNS: tuple[str, ...] = (
    "run_id", "ended_at", "status", "output", "error", "steps", "tool_calls",
    "runtime_seconds", "input_tokens", "output_tokens", "thinking_tokens", "cost_usd",
    "reason", "exit_code", "output_truncated",
)

TABLES: tuple[str, ...] = ("runs", "events", "schema_version")
#: Tables copied from the journal besides runs and events.
MIRRORS: tuple[str, ...] = ("checkpoints", "budgets", "budget_spend")
VIEWS: tuple[str, ...] = ("run_stats", "tool_stats", "critic_decisions", "attempts")


class Migration(NamedTuple):
    """One forward step of the schema."""

    version: int
    description: str
    statements: tuple[str | Callable[[Any], None], ...]


_V1 = Migration(1, "runs, events, views", (
    """
    CREATE TABLE IF NOT EXISTS runs (
        run_id           VARCHAR NOT NULL,
        parent_run_id    VARCHAR,
        subject_id       VARCHAR,
        name             VARCHAR,
        caller_id        VARCHAR,
        channel_id       VARCHAR,
        inputs           JSON,
        started_at       TIMESTAMPTZ NOT NULL,
        ended_at         TIMESTAMPTZ,
        status           VARCHAR,
        output           VARCHAR,
        error            VARCHAR,
        steps            INTEGER,
        tool_calls       INTEGER,
        runtime_seconds  DOUBLE,
        input_tokens     BIGINT,
        output_tokens    BIGINT,
        thinking_tokens  BIGINT,
        cost_usd         DOUBLE,
        host             VARCHAR,
        pid              INTEGER,
        reason           VARCHAR,
        exit_code        INTEGER,
        output_truncated BOOLEAN
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS events (
        run_id      VARCHAR NOT NULL,
        seq         INTEGER NOT NULL,
        ts          TIMESTAMPTZ NOT NULL,
        kind        VARCHAR NOT NULL,
        iteration   INTEGER,
        name        VARCHAR,
        duration_ms DOUBLE,
        payload     JSON
    )
    """,
    # Count / mean / p95 runtime by subject and status (open runs show as "running").
    """
    CREATE OR REPLACE VIEW run_stats AS
    SELECT subject_id,
           coalesce(status, 'running')          AS status,
           count(*)                             AS runs,
           avg(runtime_seconds)                 AS mean_runtime_s,
           quantile_cont(runtime_seconds, 0.5)  AS p50_runtime_s,
           quantile_cont(runtime_seconds, 0.95) AS p95_runtime_s,
           sum(steps)::BIGINT                   AS steps,
           sum(tool_calls)::BIGINT              AS tool_calls,
           sum(cost_usd)                        AS cost_usd,
           max(started_at)                      AS last_started_at
    FROM runs
    GROUP BY subject_id, coalesce(status, 'running')
    """,
    # Latency by tool, from the typed duration of each `tool_end` event.
    """
    CREATE OR REPLACE VIEW tool_stats AS
    SELECT name                             AS tool,
           count(*)                         AS calls,
           avg(duration_ms)                 AS mean_ms,
           quantile_cont(duration_ms, 0.5)  AS p50_ms,
           quantile_cont(duration_ms, 0.95) AS p95_ms,
           max(duration_ms)                 AS max_ms
    FROM events
    WHERE kind = 'tool_end'
    GROUP BY name
    """,
    # Every critic intervention with its reason (`name` is the decision).
    """
    CREATE OR REPLACE VIEW critic_decisions AS
    SELECT e.run_id,
           e.seq,
           e.ts,
           e.iteration,
           e.name                                                   AS decision,
           coalesce(e.payload ->> 'reason', e.payload ->> 'message') AS reason,
           e.payload -> 'evidence'                                  AS evidence,
           e.payload,
           r.subject_id,
           r.name                                                   AS run_name,
           r.status                                                 AS run_status
    FROM events e
    LEFT JOIN runs r USING (run_id)
    -- `watch` only records the critic's thresholds: it is not a decision.
    WHERE e.kind = 'critic' AND e.name IS DISTINCT FROM 'watch'
    """,
))

_V2 = Migration(2, "attempts view (pane actions)", (
    # One row per pane-action attempt (adapters/pane writes one `attempt` event each).
    """
    CREATE OR REPLACE VIEW attempts AS
    SELECT run_id,
           payload ->> 'agent'                                 AS agent,
           payload ->> 'action'                                AS action,
           payload ->> 'outcome'                               AS outcome,
           TRY_CAST(payload ->> 'elapsed_s' AS DOUBLE)         AS elapsed_s,
           TRY_CAST(payload ->> 'started_at' AS TIMESTAMPTZ)   AS started_at,
           payload -> 'pane_before'                            AS pane_before,
           payload -> 'pane_after'                             AS pane_after,
           payload -> 'extras'                                 AS extras,
           ts
    FROM events
    WHERE kind = 'attempt'
    """,
))


def _keep_legacy_tables(cur: Any) -> None:
    """Before the journal, budgets and checkpoints lived here; keep them under `legacy_*`.

    The journal copied them when it was created (batteries.store._legacy);
    from now on these tables mirror the journal's.
    """
    found = {r[0] for r in cur.execute(
        "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database()"
    ).fetchall()}
    for table in MIRRORS:
        if table in found:
            cur.execute(f"ALTER TABLE {table} RENAME TO legacy_{table}")


_V3 = Migration(3, "fed from the journal: sync_state, mirrors of checkpoints and budgets", (
    _keep_legacy_tables,
    """
    CREATE TABLE IF NOT EXISTS sync_state (
        events_id  BIGINT NOT NULL,
        rev        BIGINT NOT NULL,
        synced_at  TIMESTAMPTZ NOT NULL
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS checkpoints (
        run_id          VARCHAR NOT NULL,
        spec            JSON,
        state           JSON,
        steps           BIGINT,
        tool_calls      BIGINT,
        input_tokens    BIGINT,
        output_tokens   BIGINT,
        thinking_tokens BIGINT,
        cost_usd        DOUBLE,
        status          VARCHAR,
        error           VARCHAR,
        host            VARCHAR,
        pid             BIGINT,
        pid_start       BIGINT,
        heartbeat_at    TIMESTAMPTZ,
        created_at      TIMESTAMPTZ,
        updated_at      TIMESTAMPTZ
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS budgets (
        caller_id           VARCHAR NOT NULL,
        window_seconds      DOUBLE,
        max_runs            BIGINT,
        max_runtime_seconds DOUBLE,
        max_tokens          BIGINT,
        max_cost_usd        DOUBLE,
        updated_at          TIMESTAMPTZ
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS budget_spend (
        id              BIGINT NOT NULL,
        caller_id       VARCHAR NOT NULL,
        ts              TIMESTAMPTZ,
        run_id          VARCHAR,
        runtime_seconds DOUBLE,
        tokens          BIGINT,
        cost_usd        DOUBLE,
        settled         BOOLEAN
    )
    """,
))

_V4 = Migration(4, "sync_state.source: the store feeding the file (NULL: its journal)", (
    "ALTER TABLE sync_state ADD COLUMN IF NOT EXISTS source VARCHAR",
))

_V5 = Migration(5, "batches: batches, batch_tasks (which run each task became), batch_runs", (
    """
    CREATE TABLE IF NOT EXISTS batches (
        batch_id    VARCHAR NOT NULL,
        name        VARCHAR,
        source      VARCHAR,
        created_at  TIMESTAMPTZ,
        ended_at    TIMESTAMPTZ,
        status      VARCHAR,
        tasks       BIGINT,
        concurrency BIGINT,
        options     JSON,
        host        VARCHAR,
        pid         BIGINT
    )
    """,
    """
    CREATE TABLE IF NOT EXISTS batch_tasks (
        batch_id VARCHAR NOT NULL,
        idx      BIGINT NOT NULL,
        task_id  VARCHAR NOT NULL,
        run_id   VARCHAR NOT NULL
    )
    """,
    # One row per task: its batch, and its run's row (NULLs while it has not started).
    """
    CREATE OR REPLACE VIEW batch_runs AS
    SELECT t.batch_id, t.idx, t.task_id, r.*
    FROM batch_tasks t LEFT JOIN runs r ON r.run_id = t.run_id
    """,
))

_V6 = Migration(6, "critic_decisions.run_status is 'running' for an open run, as in run_stats", (
    # `runs.status` stays NULL while a run is open (it has no terminal status yet; the
    # column is the run's end). The views say `running` for it, this one too now.
    """
    CREATE OR REPLACE VIEW critic_decisions AS
    SELECT e.run_id,
           e.seq,
           e.ts,
           e.iteration,
           e.name                                                   AS decision,
           coalesce(e.payload ->> 'reason', e.payload ->> 'message') AS reason,
           e.payload -> 'evidence'                                  AS evidence,
           e.payload,
           r.subject_id,
           r.name                                                   AS run_name,
           CASE WHEN r.run_id IS NOT NULL
                THEN coalesce(r.status, 'running') END              AS run_status
    FROM events e
    LEFT JOIN runs r USING (run_id)
    -- `watch` only records the critic's thresholds: it is not a decision.
    WHERE e.kind = 'critic' AND e.name IS DISTINCT FROM 'watch'
    """,
))

_V7 = Migration(7, "batch_tasks.delivery, delivery_error: where each task's delivery stands", (
    # The journal's (version 5 on): `pending` (owed: its run has not ended, or its delivery
    # has not ended), `delivered`, `failed` (with `delivery_error`, redacted), NULL
    # (nothing to deliver). A mark moves the task's change number, so the sync copies it.
    "ALTER TABLE batch_tasks ADD COLUMN IF NOT EXISTS delivery VARCHAR",
    "ALTER TABLE batch_tasks ADD COLUMN IF NOT EXISTS delivery_error VARCHAR",
    # The tasks a file already holds were copied without them: the next sync copies every
    # task again (`sync_state.tasks_rev`: the cursor batch_tasks are copied after when it
    # is not NULL; 0: every task), then clears it.
    "ALTER TABLE sync_state ADD COLUMN IF NOT EXISTS tasks_rev BIGINT",
    "UPDATE sync_state SET tasks_rev = 0",
    """
    CREATE OR REPLACE VIEW batch_runs AS
    SELECT t.batch_id, t.idx, t.task_id, r.*, t.delivery, t.delivery_error
    FROM batch_tasks t LEFT JOIN runs r ON r.run_id = t.run_id
    """,
))

#: Every migration, in order. Append; never edit one that has shipped.
MIGRATIONS: tuple[Migration, ...] = (_V1, _V2, _V3, _V4, _V5, _V6, _V7)

_VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS schema_version (
    version     INTEGER NOT NULL,
    applied_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    description VARCHAR
)
"""


def current_version(cur: duckdb.DuckDBPyConnection) -> int | None:
    """The schema version of the database `cur` uses, or None if it has no `schema_version`."""
    import duckdb

    # The table is read straight away: a first look at duckdb_tables() costs a process
    # ~50 M instructions (a tenth of `kernel runs`). fetchall, not fetchone: DuckDB
    # refuses new work on a cursor with an unfinished result.
    try:
        row = cur.execute("SELECT max(version) FROM schema_version").fetchall()
    except duckdb.CatalogException:  # no such table (in the database `cur` uses)
        return None
    return int(row[0][0]) if row[0][0] is not None else 0


def refuse_foreign(cur: duckdb.DuckDBPyConnection) -> None:
    """Refuse a database without `schema_version` that holds tables or views of its own.

    Ours are only ever created empty, so such a database is somebody else's
    (a mistyped `--db`): our tables are never added to it.

    Raises:
        ConfigError: Naming the database's file and some of its tables.
    """
    rows = cur.execute(
        "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
        "UNION ALL SELECT view_name FROM duckdb_views() "
        "WHERE database_name = current_database() AND NOT internal ORDER BY 1").fetchall()
    if not rows:
        return
    names = [r[0] for r in rows]
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    path = cur.execute("SELECT path FROM duckdb_databases() "
                       "WHERE database_name = current_database()").fetchall()
    where = f" {path[0][0]}" if path and path[0][0] else ""
    raise ConfigError(f"database{where} is not a kernel audit database: it has tables of its "
                      f"own ({shown}) and no schema_version; nothing was changed: give the "
                      "audit's file")


def migrate(cur: duckdb.DuckDBPyConnection) -> int:
    """Bring the database `cur` uses up to `SCHEMA_VERSION`; return the version found.

    Each pending migration runs in its own transaction with its version row.
    A database newer than this code is left alone (columns are only added,
    and every insert names its columns).

    Raises:
        ConfigError: The database is somebody else's (`refuse_foreign`): left as it is.
    """
    found = current_version(cur)
    if found is None:
        refuse_foreign(cur)
    version = found or 0
    for m in MIGRATIONS:
        if m.version <= version:
            continue
        cur.execute("BEGIN TRANSACTION")
        try:
            cur.execute(_VERSION_TABLE)
            for sql in m.statements:
                if callable(sql):
                    sql(cur)
                else:
                    cur.execute(sql)
            cur.execute("INSERT INTO schema_version (version, description) VALUES (?, ?)",
                        [m.version, m.description])
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise
    return version


def arrow_schemas() -> dict[str, Any]:
    """The Arrow schemas the writer builds its batches with (pyarrow imported lazily)."""
    import pyarrow as pa  # type: ignore[import-untyped, unused-ignore]

    ts = pa.timestamp("us", tz="UTC")
    return {
        "events": pa.schema([
            ("run_id", pa.string()), ("seq", pa.int32()), ("ts", ts), ("kind", pa.string()),
            ("iteration", pa.int32()), ("name", pa.string()), ("duration_ms", pa.float64()),
            ("payload", pa.string()),
        ]),
        "runs": pa.schema([
            ("run_id", pa.string()), ("parent_run_id", pa.string()),
            ("subject_id", pa.string()), ("name", pa.string()), ("caller_id", pa.string()),
            ("channel_id", pa.string()), ("inputs", pa.string()), ("started_at", ts),
            ("ended_at", ts), ("status", pa.string()), ("output", pa.string()),
            ("error", pa.string()), ("steps", pa.int32()), ("tool_calls", pa.int32()),
            ("runtime_seconds", pa.float64()), ("input_tokens", pa.int64()),
            ("output_tokens", pa.int64()), ("thinking_tokens", pa.int64()),
            ("cost_usd", pa.float64()), ("host", pa.string()), ("pid", pa.int32()),
            ("reason", pa.string()), ("exit_code", pa.int32()),
            ("output_truncated", pa.bool_()),
        ]),
    }
