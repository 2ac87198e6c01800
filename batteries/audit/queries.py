"""The analysts' questions, as functions on a session cursor (what `kernel runs/show/...` call).

Each function takes a cursor from `Store.reader()` (or `Store.session(write=True)`
for `purge`), blocks, and returns plain Python values; the CLI only formats
them. Bad input (an unknown run id, an unknown status, a write statement
given to `read_only_query`) raises `kernel.ConfigError` with a one-line message.

Results are fetched through Arrow, which turns TIMESTAMPTZ into timezone-aware
datetimes with the standard library (DuckDB's row fetch would need pytz).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernel import ConfigError, Status

from ._schema import TABLES, migrate
from .paths import make_private_dir, make_private_file

if TYPE_CHECKING:
    import duckdb

#: Statement types `read_only_query` accepts (and EXPLAIN of one of them).
READ_ONLY_TYPES = frozenset({"SELECT"})
#: The `--status` values `list_runs` accepts: every Status, and "running" for open runs.
STATUS_CHOICES = (*(str(s) for s in Status), "running")
STATS_BY = ("subject", "status", "tool")


def cutoff(since: timedelta | None) -> datetime | None:
    """The instant `since` ago (None for no bound)."""
    return None if since is None else datetime.now(UTC) - since


def rows(cur: duckdb.DuckDBPyConnection, sql: str,
         params: list[Any] | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run `sql` and return (column names, rows), duplicate column names kept."""
    rel = cur.sql(sql, params=params) if params else cur.sql(sql)
    if rel is None:
        return [], []
    tbl = rel.to_arrow_table()
    cols = [_utc(c).to_pylist() for c in tbl.columns]
    return list(tbl.column_names), list(zip(*cols, strict=True)) if cols else []


def _utc(column: Any) -> Any:
    """A TIMESTAMPTZ column in UTC: Arrow carries DuckDB's session zone (the local `$TZ`),
    so one instant would print one way per analyst."""
    import pyarrow as pa  # type: ignore[import-untyped, unused-ignore]

    kind = column.type
    if pa.types.is_timestamp(kind) and kind.tz is not None and kind.tz != "UTC":
        return column.cast(pa.timestamp(kind.unit, tz="UTC"))
    return column


def dicts(cur: duckdb.DuckDBPyConnection, sql: str,
          params: list[Any] | None = None) -> list[dict[str, Any]]:
    """Run `sql` and return one dict per row."""
    names, data = rows(cur, sql, params)
    return [dict(zip(names, r, strict=True)) for r in data]


@contextmanager
def empty_reader(*, sealed: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
    """A read-only session on an empty analysts' database: every table and view, no rows.

    What the analysts' commands read when nothing was ever recorded (no
    analysts' file, no journal): a query runs (`select count(*) from runs` is
    0), an export writes empty tables. The database is made in a private
    temporary directory, attached READ_ONLY like the real file (so a write
    is refused the same way) and removed afterwards: reading creates no file
    where the audit lives. `sealed`: as `Store.session`.
    """
    from ._store import _seal, _sealed_cursor, pin_utc

    with tempfile.TemporaryDirectory(prefix=".kernel-empty-") as tmp:
        path = "'" + str(Path(tmp) / "empty.duckdb").replace("'", "''") + "'"
        cur = _sealed_cursor()  # an instance of its own: nothing attached, nothing shared
        try:
            pin_utc(cur)
            cur.execute(f"ATTACH {path} AS {_EMPTY}")
            cur.execute(f"USE {_EMPTY}")
            migrate(cur)
            cur.execute("USE memory")
            cur.execute(f"DETACH {_EMPTY}")
            cur.execute(f"ATTACH {path} AS {_EMPTY} (READ_ONLY)")
            cur.execute(f"USE {_EMPTY}")
            if sealed:
                _seal(cur)
            yield cur
        finally:
            cur.close()


#: The alias `empty_reader` attaches its empty database as.
_EMPTY = "kaudit_empty"


# ------------------------------------------------------------------- runs

_RUN_FIELDS = ("run_id, parent_run_id, subject_id, name, caller_id, channel_id, started_at, "
               "ended_at, coalesce(status, 'running') AS status, steps, tool_calls, "
               "runtime_seconds, input_tokens, output_tokens, thinking_tokens, cost_usd, "
               "exit_code, reason, error")


#: The keys of each run `list_runs` returns, in order (what a CSV header names).
RUN_LIST_COLUMNS: tuple[str, ...] = (
    "run_id", "parent_run_id", "subject_id", "name", "caller_id", "channel_id", "started_at",
    "ended_at", "status", "steps", "tool_calls", "runtime_seconds", "input_tokens",
    "output_tokens", "thinking_tokens", "cost_usd", "exit_code", "reason", "error")


def list_runs(cur: duckdb.DuckDBPyConnection, *, status: str | None = None,
              since: timedelta | None = None, limit: int = 20) -> list[dict[str, Any]]:
    """The most recent runs first, optionally only one status and only since a time ago.

    Raises:
        ConfigError: An unknown status or a limit below 1.
    """
    if status is not None and status not in STATUS_CHOICES:
        raise ConfigError(f"--status must be one of {', '.join(STATUS_CHOICES)}, "
                          f"got {status!r}")
    if limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {limit}")
    where, params = _where(since, "started_at")
    if status == "running":
        where.append("status IS NULL")
    elif status is not None:
        where.append("status = ?")
        params.append(status)
    sql = f"SELECT {_RUN_FIELDS} FROM runs"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY started_at DESC, run_id DESC LIMIT ?"
    return dicts(cur, sql, [*params, limit])


def runs_between(cur: duckdb.DuckDBPyConnection, start: datetime, end: datetime, *,
                 limit: int = 50) -> tuple[list[dict[str, Any]], int]:
    """The runs started in [start, end), oldest first, at most `limit`; and how many there were.

    Raises:
        ConfigError: `end` is not after `start`, or a limit below 1.
    """
    if end <= start:
        raise ConfigError(f"the range is empty: {end:%Y-%m-%d %H:%M:%S} is not after "
                          f"{start:%Y-%m-%d %H:%M:%S}")
    if limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {limit}")
    where = "started_at >= ? AND started_at < ?"
    found = dicts(cur, f"SELECT {_RUN_FIELDS} FROM runs WHERE {where} "
                       "ORDER BY started_at, run_id LIMIT ?", [start, end, limit])
    total = rows(cur, f"SELECT count(*) FROM runs WHERE {where}", [start, end])[1][0][0]
    return found, int(total)


def runs_of_batch(cur: duckdb.DuckDBPyConnection, batch: str, *,
                  limit: int = 50) -> tuple[str, list[dict[str, Any]], int]:
    """The runs a batch started, oldest first, at most `limit`; and how many it started.

    `batch` is a batch id or a unique prefix of one (as `kernel batch --list` prints
    them). Returns the full batch id, the runs and their count.

    Raises:
        ConfigError: No batch matches, several do, or a limit below 1.
    """
    if limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {limit}")
    found = rows(cur, "SELECT batch_id FROM batches WHERE starts_with(batch_id, ?) "
                      "ORDER BY created_at DESC LIMIT 6", [batch])[1]
    ids = [str(r[0]) for r in found]
    if batch in ids:
        ids = [batch]
    if not ids:
        raise ConfigError(f"no batch {batch!r} (kernel batch --list shows them)")
    if len(ids) > 1:
        raise ConfigError(f"batch {batch!r} is ambiguous: " + ", ".join(ids[:5]))
    where = "batch_id = ? AND started_at IS NOT NULL"
    picked = dicts(cur, f"SELECT {_RUN_FIELDS} FROM batch_runs WHERE {where} "
                        "ORDER BY started_at, run_id LIMIT ?", [ids[0], limit])
    total = rows(cur, f"SELECT count(*) FROM batch_runs WHERE {where}", [ids[0]])[1][0][0]
    return ids[0], picked, int(total)


# -------------------------------------------------------------- recovery


def process_groups(cur: Any, run_id: str) -> list[dict[str, Any]]:
    """The process groups run `run_id` recorded starting, oldest first.

    Each is the `process_start` payload of an adapter spawn (`pid`, `pgid`,
    `start_time`, `boot_id`, `host`, ...): what `kernel recover` needs to stop
    a group that outlived its supervisor, and to know a reused pid is not it.
    This is the one lookup recover makes in the events. `cur` is any DB-API
    cursor over an `events` table: the DuckDB file's, or the SQLite journal's
    (what `kernel recover` reads: it is current and never blocks a writer).
    """
    return process_groups_from(payload for (payload,) in cur.execute(
        "SELECT payload FROM events WHERE run_id = ? AND kind = 'process_start' "
        "ORDER BY seq", [run_id]).fetchall())


def process_groups_from(payloads: Iterable[Any]) -> list[dict[str, Any]]:
    """`process_groups` from the `process_start` payloads a store returned (JSON text)."""
    found: list[dict[str, Any]] = []
    for payload in payloads:
        doc = _json(payload)
        if isinstance(doc, dict) and doc.get("pgid") is not None:
            found.append(doc)
    return found


def _where(since: timedelta | None, column: str) -> tuple[list[str], list[Any]]:
    at = cutoff(since)
    return ([f"{column} >= ?"], [at]) if at is not None else ([], [])


def timeline(cur: duckdb.DuckDBPyConnection, run_id: str) -> tuple[dict[str, Any],
                                                                     list[dict[str, Any]]]:
    """The run's row and its events in seq order, each with `offset_ms` since the run started.

    Raises:
        ConfigError: No run with exactly this id.
    """
    found = dicts(cur, "SELECT *, coalesce(status, 'running') AS status FROM runs "
                       "WHERE run_id = ?", [run_id])
    if not found:
        raise ConfigError(f"no run {run_id!r}")
    run = found[0]
    run["inputs"] = _json(run.get("inputs"))
    events = dicts(cur, """
        SELECT seq, ts,
               (epoch_us(ts) - epoch_us(min(ts) OVER ())) / 1000.0 AS offset_ms,
               kind, iteration, name, duration_ms, payload
        FROM events WHERE run_id = ? ORDER BY seq""", [run_id])
    for e in events:
        e["payload"] = _json(e["payload"])
        e["summary"] = summarize(e["kind"], e["payload"])
    return run, events


def _json(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _short(value: Any, width: int = 100) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str,
                                                          ensure_ascii=False)
    text = " ".join(text.split())  # one line
    return text if len(text) <= width else text[: width - 1] + "…"


def summarize(kind: str, payload: Any) -> str:
    """One line saying what an event was about, for `kernel show`."""
    if not isinstance(payload, dict):
        return _short(payload) if payload else ""
    p = dict(payload)
    truncated = " (truncated)" if p.pop("truncated", False) else ""
    if kind == "run_start":
        text = f"inputs {_short(p.get('inputs') or {}, 60)}"
        if p.get("caller_id"):
            text += f" caller {p['caller_id']}"
    elif kind == "run_end":
        text = str(p.get("status", ""))
        why = p.get("error") or p.get("reason")
        if why:
            text += f": {why}"
    elif kind == "step":
        parts = ["final" if p.get("final") else ""]
        if p.get("tool_calls"):
            parts.append(f"{p['tool_calls']} tool call(s)")
        if p.get("exit_code") is not None:
            parts.append(f"exit {p['exit_code']}")
        if p.get("output") not in (None, ""):
            parts.append(f"output {_short(p['output'], 70)}")
        text = ", ".join(x for x in parts if x)
    elif kind == "tool_start":
        text = _short(p.get("args") or {})
    elif kind == "tool_end":
        text = (f"error: {_short(p['error'])}" if p.get("error")
                else f"-> {_short(p.get('output'))}")
    elif kind == "error":
        text = _short(p.get("message", p))
    elif kind == "critic":
        why = p.get("reason") or p.get("message")
        text = _short(why) if why else _short(p)
        if why and p.get("detail"):
            text = _short(f"{why} — {p['detail']}", 160)
    elif kind == "steer":
        text = _short(" | ".join(str(m) for m in p.get("messages") or []))
    elif kind == "output":
        text = _short(p.get("line", p))
    elif kind == "attempt":  # a pane action
        text = f"{p.get('outcome')} after {_seconds(p.get('elapsed_s'))}"
        if p.get("agent"):
            text += f" on {p['agent']}"
    elif kind in ("state_enter", "evaluate", "route") and p:
        text = _short({k: v for k, v in p.items() if k not in ("iteration", "simulated")})
    elif "lifecycle" in p:  # a CLI agent's event: its state machine first
        rest = p.get("text") or p.get("source") or ""
        text = f"[{p['lifecycle']}/{p.get('state')}] {_short(rest, 70)}".rstrip()
    else:
        text = _short(p) if p else ""
    return text + truncated


def critic_sentence(events: list[dict[str, Any]]) -> str | None:
    """The critic's kill as a sentence, from a run's timeline; None if it did not kill.

    `killed: looping — read_file(note.txt) returned the same result 4 times,
    nudged at 12.3s`: the decision, its reason and its detail (what the
    evidence showed), as the critic wrote them in the `critic` event.
    """
    for e in reversed(events):
        p = e.get("payload")
        if e.get("kind") == "critic" and e.get("name") == "kill" and isinstance(p, dict):
            reason = p.get("reason") or "killed by the critic"
            detail = " ".join(str(p.get("detail") or "").split())
            return f"killed: {reason} — {detail}" if detail else f"killed: {reason}"
    return None


def _seconds(value: Any) -> str:
    try:
        return f"{float(value):.2f}s"
    except (TypeError, ValueError):
        return "?"


# ------------------------------------------------------------------ stats


#: The keys of each row `stats` returns for each `by`, in order (what a CSV header names).
STATS_COLUMNS: dict[str, tuple[str, ...]] = {
    "subject": ("subject", "status", "runs", "mean_s", "p95_s", "steps", "tool_calls",
                "cost_usd"),
    "status": ("status", "runs", "mean_s", "p95_s", "steps", "tool_calls", "cost_usd"),
    "tool": ("tool", "calls", "errors", "mean_ms", "p50_ms", "p95_ms", "max_ms"),
}


def stats(cur: duckdb.DuckDBPyConnection, *, by: str = "subject",
          since: timedelta | None = None) -> list[dict[str, Any]]:
    """Counts and runtimes by subject and status, by status, or tool latencies by tool.

    Raises:
        ConfigError: `by` is not subject, status or tool.
    """
    if by not in STATS_BY:
        raise ConfigError(f"--by must be one of {', '.join(STATS_BY)}, got {by!r}")
    if by == "tool":
        where, params = _where(since, "ts")
        cond = " AND ".join(["kind = 'tool_end'", *where])
        return dicts(cur, f"""
            SELECT name AS tool, count(*) AS calls,
                   count(*) FILTER (WHERE payload ->> 'error' IS NOT NULL) AS errors,
                   avg(duration_ms) AS mean_ms,
                   quantile_cont(duration_ms, 0.5) AS p50_ms,
                   quantile_cont(duration_ms, 0.95) AS p95_ms,
                   max(duration_ms) AS max_ms
            FROM events WHERE {cond}
            GROUP BY name ORDER BY calls DESC, tool""", params)
    where, params = _where(since, "started_at")
    keys = "subject_id AS subject, coalesce(status, 'running') AS status" if by == "subject" \
        else "coalesce(status, 'running') AS status"
    group = "1, 2" if by == "subject" else "1"
    return dicts(cur, f"""
        SELECT {keys}, count(*) AS runs,
               avg(runtime_seconds) AS mean_s,
               quantile_cont(runtime_seconds, 0.95) AS p95_s,
               sum(steps)::BIGINT AS steps, sum(tool_calls)::BIGINT AS tool_calls,
               sum(cost_usd) AS cost_usd
        FROM runs {'WHERE ' + ' AND '.join(where) if where else ''}
        GROUP BY {group} ORDER BY {group}""", params)


# ------------------------------------------------------------------ query


def check_read_only(sql: str) -> None:
    """Accept exactly one SELECT, or EXPLAIN [ANALYZE] of one; refuse anything else.

    This is the friendly message; the guard is the session: `kernel query`
    runs in `Store.reader(sealed=True)`, which can neither write nor open any
    file whatever the statement (an EXPLAIN ANALYZE of a COPY, a table
    function, ...).

    Raises:
        ConfigError: Not exactly one statement, a statement that is not a
            query (DELETE, INSERT, COPY, ATTACH, SET, PREPARE, ...), an EXPLAIN
            of one, or SQL that does not parse.
    """
    statements = _statements(sql)
    if len(statements) != 1:
        raise ConfigError(f"query takes exactly one statement, got {len(statements)}")
    kind = statements[0].type.name
    if kind == "EXPLAIN":
        m = _EXPLAIN.match(statements[0].query.strip())
        try:
            inner = _statements(m.group("inner")) if m else []
        except ConfigError:
            inner = []
        if len(inner) != 1 or inner[0].type.name != "SELECT":
            raise ConfigError("query is read-only: EXPLAIN is accepted only for one SELECT")
    elif kind not in READ_ONLY_TYPES:
        raise ConfigError(f"query is read-only: {kind} statements are refused")


#: `EXPLAIN [ANALYZE] [(options)] <statement>`; anything fancier (a comment inside
#: the prefix) does not match and is refused.
_EXPLAIN = re.compile(r"EXPLAIN\s+(?:ANALY[SZ]E\s+)?(?:\([^()]*\)\s*)?(?P<inner>.*)\Z",
                      re.IGNORECASE | re.DOTALL)


def _statements(sql: str) -> list[Any]:
    import duckdb

    try:
        return list(duckdb.extract_statements(sql))
    except (duckdb.Error, ValueError) as exc:  # ValueError: a type Python does not know
        raise ConfigError(f"invalid SQL: {_first_line(exc)}") from exc


class QueryInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a query (DuckDB's own execution, interrupted)."""


@contextmanager
def _sigint_held() -> Iterator[list[int]]:
    """In the main thread with Python's own SIGINT handler: a SIGINT meanwhile is noted in
    the list yielded, not raised; the handler is put back on leaving. Elsewhere (another
    thread, a host's own handler) nothing changes and the list stays empty."""
    import signal

    got: list[int] = []
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield got
        return
    signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    try:
        yield got
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


#: Rows a streamed query (`stream_query`) converts and hands over at a time.
STREAM_ROWS = 10_000


class QueryStream:
    """A read-only query's result, fetched while it is read (`stream_query`).

    `names` are the result's column names (duplicates kept); iterating gives
    chunks of at most `STREAM_ROWS` rows, as tuples, in order. A DuckDB `JSON`
    value (`inputs`, `payload`, `payload -> 'x'`) arrives as its text; `decode_json`
    turns a row's into JSON values. DuckDB
    produces the chunks in a worker thread, at most two ahead of the reader,
    so a result of any size takes the memory of a few chunks. A timeout,
    Ctrl-C or a failure in DuckDB while reading raises as `read_only_query`
    does, after the rows already handed out.
    """

    def __init__(self, cur: duckdb.DuckDBPyConnection, sql: str, timeout: float | None,
                 rows_at_once: int) -> None:
        import queue

        self._cur, self._sql, self._timeout = cur, sql, timeout
        self._rows_at_once = rows_at_once
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=2)
        self._stop = threading.Event()
        # An Event, not Thread.join (see `read_only_query`).
        self._finished = threading.Event()
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._thread: threading.Thread | None = None
        self.names: list[str] = []
        #: Per column, what turns its values' JSON text into JSON values (None: the
        #: column holds no DuckDB JSON; see `decode_json`). Set before `names`.
        self.json_decoders: list[Callable[[Any], Any] | None] = []

    def _hand(self, item: tuple[str, Any]) -> bool:
        """Put `item` for the reader; False once the reader has stopped the stream."""
        import queue

        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        try:
            rel = self._cur.sql(self._sql)
            if rel is None:
                self._hand(("names", []))
                self._hand(("end", None))
                return
            self.json_decoders = [_json_decoder(t) for t in rel.types]
            # `to_arrow_reader` from DuckDB 1.4 (the older name warns there).
            open_reader = getattr(rel, "to_arrow_reader", None) or rel.fetch_arrow_reader
            reader = open_reader(self._rows_at_once)
            if not self._hand(("names", list(reader.schema.names))):
                return
            for chunk in reader:
                cols = [_utc(c).to_pylist() for c in chunk.columns]
                if not self._hand(("rows", list(zip(*cols, strict=True)) if cols else [])):
                    return
            self._hand(("end", None))
        except BaseException as exc:  # handed to the reader
            self._hand(("error", exc))
        finally:
            self._finished.set()

    def _next(self) -> tuple[str, Any]:
        """The worker's next item, waiting with the deadline and Ctrl-C in view."""
        import queue

        try:
            while True:
                left = None if self._deadline is None else self._deadline - time.monotonic()
                if left is not None and left <= 0:
                    self.close()
                    raise ConfigError(f"query stopped after {self._timeout:g}s (--timeout)")
                try:
                    return self._queue.get(timeout=0.1 if left is None else min(0.1, left))
                except queue.Empty:
                    continue
        except KeyboardInterrupt:
            self.close()
            raise QueryInterrupted from None

    def decode_json(self, row: tuple[Any, ...]) -> tuple[Any, ...]:
        """`row` with the text of every DuckDB `JSON` value in it (a column, or inside a
        struct, list or array column) parsed: what JSON output prints as nested JSON.
        Text that does not parse stays text; NaN and Infinity parse (as floats)."""
        decoders = self.json_decoders
        if not any(decoders):
            return row
        return tuple(v if d is None else d(v) for d, v in zip(decoders, row, strict=True))

    def start(self) -> None:
        """Run the statement; return once the column names are known."""
        self._thread = threading.Thread(target=self._work, name="kernel query", daemon=True)
        started = False
        try:
            # Ctrl-C while the worker starts is held until it has started: raised inside
            # `Thread.start`, it escaped as a bare KeyboardInterrupt (a traceback in the
            # CLI, a test session stopped), and before the thread existed `close` would
            # have waited for a worker that never comes.
            with _sigint_held() as held:
                self._thread.start()
                started = True
            if held:
                raise KeyboardInterrupt
            kind, value = self._next()
        except KeyboardInterrupt:
            if started:
                self.close()
            raise QueryInterrupted from None
        if kind == "error":
            self.close()
            _raise_query_error(value, self._sql)
        self.names = value

    def __iter__(self) -> Iterator[list[tuple[Any, ...]]]:
        while True:
            kind, value = self._next()
            if kind == "end":
                return
            if kind == "error":
                self.close()
                _raise_query_error(value, self._sql)
            yield value

    def close(self) -> None:
        """Stop the worker (DuckDB interrupted if still executing) and wait for it, so the
        connection can be closed or used again. Idempotent."""
        if not self._finished.is_set():
            self._stop.set()
            # Again until the worker is out: an interrupt that arrives between two of
            # DuckDB's executions (building the relation, then running it) is not kept.
            while True:
                self._cur.interrupt()
                if self._finished.wait(0.1):
                    break
        if self._thread is not None:
            self._thread.join()  # it has finished its work: only its exit is left


def _json_decoder(kind: Any) -> Callable[[Any], Any] | None:
    """What parses the JSON text in values of DuckDB type `kind`; None if it holds none."""
    name = str(kind)
    if "JSON" not in name:
        return None
    if name == "JSON":
        return _json
    try:
        children = list(kind.children)
    except Exception:  # not nested (a type whose name merely mentions JSON)
        return None
    if kind.id == "struct":
        fields = [(str(key), _json_decoder(child)) for key, child in children]
        if not any(d for _, d in fields):
            return None

        def struct(value: Any) -> Any:
            if not isinstance(value, dict):
                return value
            out = dict(value)
            for key, dec in fields:
                if dec is not None and key in out:
                    out[key] = dec(out[key])
            return out
        return struct
    if kind.id in ("list", "array"):
        item = _json_decoder(children[0][1])
        if item is None:
            return None
        return lambda value: [item(v) for v in value] if isinstance(value, list) else value
    return None  # a MAP keeps its values' text


@contextmanager
def stream_query(cur: duckdb.DuckDBPyConnection, sql: str, *, timeout: float | None = None,
                 rows_at_once: int = STREAM_ROWS) -> Iterator[QueryStream]:
    """`read_only_query`, its rows read as they are produced (`QueryStream`).

    The statement is checked and started on entry (its failures raise there,
    as `read_only_query`'s); leaving the block stops a result not read to
    its end, so the cursor's connection is safe to close.
    """
    check_read_only(sql)
    stream = QueryStream(cur, sql, timeout, rows_at_once)
    try:
        stream.start()
        yield stream
    finally:
        stream.close()


def _raise_query_error(exc: BaseException, sql: str) -> None:
    """Raise a failure of the query's worker as the analyst should see it."""
    import duckdb
    import pyarrow as pa  # type: ignore[import-untyped, unused-ignore]

    try:
        raise exc
    # DuckDB's failure while the Arrow reader pulls a chunk reaches us as Arrow's
    # (an OSError, or ArrowException, carrying DuckDB's message).
    except (duckdb.Error, pa.ArrowException, OSError) as err:
        text = _first_line(err)
        if "read-only mode" in text:  # a write inside a SELECT (a CTE's DELETE ... RETURNING)
            found = _WRITES.search(sql)
            verb = found.group(1).upper() if found else "writing"
            raise ConfigError(f"query is read-only: {verb} statements are refused") from err
        # The session's own name for the audit file means nothing to the analyst.
        raise ConfigError(f"query failed: {_ALIAS.sub('the audit database', text)}") from err


def read_only_query(cur: duckdb.DuckDBPyConnection, sql: str, *,
                    timeout: float | None = None) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run one SELECT (or EXPLAIN of one) statement after `check_read_only`.

    Give it a cursor from `Store.reader(sealed=True)`: the check is the
    friendly message, the sealed session the guard. The statement runs in a
    worker thread while this one waits, so Ctrl-C (and `timeout`, in seconds)
    interrupts DuckDB's execution: a signal is only seen by the main thread
    between bytecodes, never inside a long `execute`.

    Raises:
        ConfigError: The statement is refused, or DuckDB rejects it (writing
            or reading a file in a sealed session, an unknown table, ...), or
            it ran past `timeout`.
        QueryInterrupted: Ctrl-C stopped it.
    """
    with stream_query(cur, sql, timeout=timeout) as stream:
        return stream.names, [row for chunk in stream for row in chunk]


#: The first writing keyword of a statement DuckDB refused for writing the read-only audit.
_WRITES = re.compile(r"\b(INSERT|UPDATE|DELETE|MERGE|CREATE|DROP|ALTER|TRUNCATE|COPY)\b",
                     re.IGNORECASE)
#: The alias a session attaches the audit file as (`Store`: `kaudit_` and 16 hex digits;
#: `empty_reader`: `kaudit_empty`).
_ALIAS = re.compile(r'"?kaudit_(?:[0-9a-f]{16}|empty)"?')


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ------------------------------------------------------- purge and export


def purge(cur: duckdb.DuckDBPyConnection, days: float, *,
          now: datetime | None = None) -> tuple[int, int]:
    """Delete runs that ended more than `days` ago (before `now`), with their events,
    their checkpoints (the run's spec: argv, context, inputs) and finished batches.

    The predicates are the journal's (`RunStore.purge`), table by table, so
    both files hold the same rows afterwards (the sync copies changed rows
    only and never deletes one): only ended runs go, and not those of a
    batch that has not finished nor those whose result is owed a delivery
    (`batch_tasks.delivery` pending or failed: `kernel batch --resume`
    delivers it from the runs row); a checkpoint goes once it is not
    `running` and was last written before the cut (not one of those runs'); a
    finished batch and its tasks once it ended before the cut, but the tasks
    owed a delivery of a run still there, and their batch. A
    run still running (no `ended_at`) is kept whatever its age: the sync
    copies each event once, so an event deleted here while its run is live
    would never come back, and the run's timeline would start in the middle.
    Budget spend stays, as in the journal (budgets count it in their window).

    Returns:
        (runs deleted, events deleted).

    Raises:
        ConfigError: `days` is negative.
    """
    if not days >= 0:
        raise ConfigError(f"--days must be >= 0, got {days:g}")
    at = (now or datetime.now(UTC)) - timedelta(days=days)
    # The journal's rules (`batteries.store._sqlite.PURGE_KEPT_RUNS`, `PURGE_TASKS`,
    # `PURGE_BATCHES`): the runs of a batch that has not finished stay, and so do those
    # whose result is owed a delivery, with their tasks and batch.
    kept = ("run_id NOT IN (SELECT t.run_id FROM batch_tasks t JOIN batches b "
            "ON b.batch_id = t.batch_id WHERE (b.status != 'finished' "
            "OR t.delivery IN ('pending', 'failed')) AND t.run_id IS NOT NULL)")
    ended = f"ended_at IS NOT NULL AND ended_at < ? AND {kept}"
    cur.execute("BEGIN TRANSACTION")
    try:
        ev = cur.execute(f"DELETE FROM events WHERE run_id IN (SELECT run_id FROM runs "
                         f"WHERE {ended})", [at]).fetchall()
        # Null-safe, like SQLite's `!=` on the journal's NOT NULL columns: a mirrored
        # row with a NULL status or time is not one the journal could keep.
        cur.execute("DELETE FROM checkpoints WHERE status IS DISTINCT FROM 'running' "
                    f"AND (updated_at IS NULL OR updated_at < ?) AND {kept}", [at])
        rn = cur.execute(f"DELETE FROM runs WHERE {ended}", [at]).fetchall()
        cur.execute("DELETE FROM batch_tasks WHERE batch_id IN (SELECT batch_id FROM batches "
                    "WHERE status = 'finished' AND ended_at < ?) AND NOT (coalesce(delivery, "
                    "'') IN ('pending', 'failed') AND EXISTS (SELECT 1 FROM runs r "
                    "WHERE r.run_id = batch_tasks.run_id))", [at])
        cur.execute("DELETE FROM batches WHERE status = 'finished' AND ended_at < ? "
                    "AND NOT EXISTS (SELECT 1 FROM batch_tasks t "
                    "WHERE t.batch_id = batches.batch_id)", [at])
        cur.execute("COMMIT")
    except BaseException:
        cur.execute("ROLLBACK")
        raise
    return (int(rn[0][0]) if rn else 0), (int(ev[0][0]) if ev else 0)


def export(cur: duckdb.DuckDBPyConnection, directory: str | Path) -> list[Path]:
    """Write every table to `directory/<table>.parquet`; return the files written.

    The files are 0600 and a directory created for them 0700 (they hold
    what the audit holds). The files are written into a private staging
    directory and renamed into place once all are written, so none is ever
    readable by others and a table DuckDB cannot read (a damaged block:
    `duckdb.Error`) leaves the directory as it was.

    Raises:
        ConfigError: `directory` exists and is not a directory, or cannot be
            created or written.
    """
    out = Path(directory).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export target {out} exists and is not a directory")
    try:
        make_private_dir(out)
        stage = Path(tempfile.mkdtemp(prefix=".kernel-export-", dir=out))
    except OSError as exc:
        raise ConfigError(f"cannot create {out}: {exc.strerror or exc}") from exc
    written = []
    try:
        # The audit's own tables first, then any others in the file (budgets,
        # budget_spend, checkpoints: batteries that share it).
        others = [r[0] for r in cur.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
            "ORDER BY table_name").fetchall() if r[0] not in TABLES]
        for table in (*TABLES, *others):
            target = (out / f"{table}.parquet").absolute()
            staged = stage / target.name
            quoted = "'" + str(staged).replace("'", "''") + "'"
            order = " ORDER BY run_id, seq" if table == "events" else (
                " ORDER BY started_at" if table == "runs" else "")
            cur.execute(f"COPY (SELECT * FROM {table}{order}) TO {quoted} (FORMAT parquet)")
            written.append(target)
        # Only once every table is out: a damaged table leaves no partial export.
        for target in written:
            staged = stage / target.name
            try:
                make_private_file(staged)
                os.replace(staged, target)
            except OSError as exc:
                raise ConfigError(f"cannot write {target}: {exc.strerror or exc}") from exc
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return written
