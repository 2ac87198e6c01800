"""The analysts' commands: `kernel runs`, `show`, `stats`, `query`, `purge`, `export`, `sync`.

Runs write the journal (or the PostgreSQL store given with `--store` /
`$KERNEL_STORE`); analysts read the DuckDB file beside it. Each
command first brings that file up to date from the store (`sync`, in one
short session), then reads it in another short session and closes it
before printing (both retry while another process holds the file, up to
`$KERNEL_AUDIT_LOCK_TIMEOUT` seconds). duckdb and the audit battery are
imported inside the commands, so `kernel --help` stays light.

Exit codes: 0 on success; 2 for bad input (a malformed `--since`, an unknown
or ambiguous run id, a write statement given to `query`, a database that
opens but is damaged inside, a `--db` that is not an audit database: a
directory, a file that is not a DuckDB database, a DuckDB database of
something else, ...); 1 when the database is locked too long. No database
at all is a fresh install,
an empty store and a normal state: `runs` and `stats` say "no runs yet",
`query` runs on the empty tables, `purge`, `sync` and `export` do nothing
(export writes empty tables), `report` writes an empty page, all exit 0;
`show` has nothing to show (exit 2, as for an unknown run id).
Either way the error is one line on stderr. Human-readable output shows
recorded control characters escaped (`output.visible`).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from . import numbers, output
from .dbopt import DB_HELP, STORE_OPTION
from .ids import short_id

if TYPE_CHECKING:
    from batteries.audit import Store

RETENTION_ENV = "KERNEL_RETENTION_DAYS"
DEFAULT_RETENTION_DAYS = 30


def register(app: typer.Typer) -> None:
    """Add the analysts' commands to `app`."""
    app.command("runs")(runs)
    app.command("show")(show)
    app.command("report")(report)
    app.command("stats")(stats)
    app.command("query")(query)
    app.command("purge")(purge)
    app.command("export")(export)
    app.command("sync")(sync)


# ---------------------------------------------------------------- commands


def runs(
    status: str | None = typer.Option(
        None, "--status", metavar="STATUS",
        help="Only runs with this status (ok, error, timeout, killed, ..., or running)."),
    since: timedelta | None = typer.Option(
        None, "--since", metavar="AGE", parser=numbers.age(),
        help="Only runs started within AGE: 90, 30s, 30m, 24h, 7d, 2w."),
    limit: int = typer.Option(20, "--limit", metavar="N", parser=numbers.count(minimum=1),
                              help="At most N runs."),
    ids_only: bool = typer.Option(
        False, "--quiet", "-q", help="Print only the runs' short ids, one a line (not with "
                                     "--json or --format)."),
    json_out: bool = output.json_option(),
    fmt: str | None = output.format_option(),
    db: str | None = typer.Option(None, "--db", metavar="PATH", help=DB_HELP),
    shared_store: str | None = STORE_OPTION,
) -> None:
    """List recent runs, newest first (RUN is the short id `kernel show` takes)."""
    from batteries.audit import queries

    if ids_only and (json_out or fmt is not None):
        _fail(f"-q/--quiet prints short ids only: give it or "
              f"{'--json' if json_out else '--format ' + str(fmt)}, not both", 2)
    fmt = output.pick(fmt, json_out)
    if status is not None and status not in queries.STATUS_CHOICES:
        _fail(f"--status must be one of {', '.join(queries.STATUS_CHOICES)}, got {status!r}", 2)
    # A CSV of no runs is its header row alone, as `query --format csv` prints it.
    headers = (*queries.RUN_LIST_COLUMNS, "short_id")
    if _nothing_yet(db, quiet=ids_only or fmt != "table"):
        output.print_records(fmt, [], headers)
        return
    with _errors(), _reader(db) as cur:
        found = queries.list_runs(cur, status=status, since=since, limit=limit)
    for r in found:
        r["short_id"] = short_id(r["run_id"])
    if ids_only:
        for r in found:
            print(r["short_id"])
        return
    if output.print_records(fmt, found, headers):
        return
    if not found:
        print("no runs")
        return
    print(_table(
        ("RUN", "STARTED (UTC)", "STATUS", "STEPS", "TOOLS", "RUNTIME", "NAME"),
        [(r["short_id"], _when(r["started_at"]), r["status"], r["steps"], r["tool_calls"],
          _secs(r["runtime_seconds"]), _cell(r["name"])) for r in found],
        right=(3, 4, 5)))


def show(
    run_id: str | None = typer.Argument(
        None, metavar="RUN_ID", show_default=False,
        help="The run's short id (as `kernel runs` prints it), a full id or any unique "
             "prefix of one, or 'last'."),
    last: bool = typer.Option(False, "--last", "-l", help="Show the newest run that is not a "
                              "sub-loop's child."),
    kind: list[str] | None = typer.Option(
        None, "--kind", metavar="KIND",
        help="Only events of this kind (repeatable, or comma-separated: "
             "--kind tool_end,critic). Adapters log kinds of their own, so any name is "
             "taken; a note on stderr names the run's kinds when one matched nothing."),
    limit: int | None = typer.Option(
        None, "--limit", metavar="N", parser=numbers.count(), show_default=False,
        help="At most N rows, the first ones (0 = all); a note says how many were left "
             "out. Default: 200 rows in the table, every event with --json (whose "
             "document then says how many it left out: events_left_out)."),
    raw: bool = typer.Option(
        False, "--raw", help="Every event on a row of its own (a loop state's events are "
                             "otherwise one line: `test  exit 1 → no → fix`)."),
    json_out: bool = output.json_option(
        'Print {"run": ..., "events": [...]} as one JSON document (one line) instead.'),
    html: str | None = typer.Option(
        None, "--html", metavar="FILE",
        help="Also write the run's timeline picture to FILE: one self-contained HTML page "
             "(states, steps, tool calls, output rate, critic nudges and kill, usage)."),
    db: str | None = typer.Option(None, "--db", metavar="PATH", help=DB_HELP),
    shared_store: str | None = STORE_OPTION,
) -> None:
    """Show one run and its timeline: seq, +ms, kind, name, duration, summary.

    A loop state is one row (its action's exit code, the verdict, where it
    went: `test  exit 1 → no → fix`) unless --raw or --kind. The header's
    totals cover the whole timeline: a resumed run's runtime runs from its
    first start to its end, over every session. On a terminal, lines are
    cut to its width.
    """
    from batteries.audit import queries

    from . import ids

    if last == (run_id is not None):
        _fail("give a RUN_ID or --last (not both)", 2)
    if _nothing_yet(db, quiet=True):
        _fail(f"no runs yet (no audit database at {_db_path(db)})", 2)
    with _errors(), _reader(db) as cur:
        full = ids.resolve(cur, ids.LAST if last else str(run_id))
        run, events = queries.timeline(cur, full)
    if html is not None:
        _write_html(html, run, events)
    if run.get("exit_code") is None:  # killed or timed out: the command's own end, if seen
        # (not the end the run gave it: a process it stopped is marked `stopped`)
        ends = [e for e in events if e["kind"] == "process_exit"
                and isinstance(e.get("payload"), dict)
                and e["payload"].get("exit_code") is not None
                and not e["payload"].get("stopped")]
        if ends:
            run["exit_code"] = ends[-1]["payload"]["exit_code"]
    run.update(_totals(run, events))
    kinds = {k.strip() for spec in kind or [] for k in spec.split(",") if k.strip()}
    if kinds:
        # Kinds are an open set (adapters log their own), so an unknown one is not an
        # error; one that matched nothing gets a note naming the kinds the run has.
        present = {e["kind"] for e in events}
        unmatched = sorted(kinds - present)
        if unmatched:
            print(f"kernel show: note: no {', '.join(map(repr, unmatched))} event in run "
                  f"{short_id(run['run_id'])} (its kinds: {', '.join(sorted(present))})",
                  file=sys.stderr)
        events = [e for e in events if e["kind"] in kinds]
    if json_out:
        doc: dict[str, Any] = {"run": run, "events": events[:limit] if limit else events}
        if limit and len(events) > limit:
            doc["events_left_out"] = len(events) - limit
            print(f"kernel show: note: {len(events) - limit} more event(s) not in the "
                  f"document (--limit {limit}; 0 gives all)", file=sys.stderr)
        run["short_id"] = short_id(run["run_id"])
        output.print_doc(doc)
        return
    rows = events if raw or kinds else _one_row_per_state(events)
    total = len(rows)
    limit = 200 if limit is None else limit
    if limit:
        rows = rows[:limit]
    status = run["status"] + _exit_note(run)
    lines = [f"run      {short_id(run['run_id'])}  {run['run_id']}  "
             f"{_cell(run.get('name'))}".rstrip(),
             f"status   {status}"]
    who = [f"{k} {run[k]}" for k in ("subject_id", "caller_id", "channel_id", "parent_run_id")
           if run.get(k)]
    if who:
        lines.append("         " + "  ".join(who))
    runtime = _secs(run["timeline_seconds"])
    if run["sessions"] > 1:
        runtime += (f" over {run['sessions']} sessions "
                    f"({_secs(run['runtime_seconds'])} in the last)")
    lines.append(f"started  {_when(run['started_at'])} UTC  runtime {runtime}"
                 f"  steps {_num(run['total_steps'])}"
                 + (" (the command was stopped)" if run["stopped_step"] else "")
                 + f"  tool calls {_num(run['total_tool_calls'])}")
    usage = _usage_line(run)
    if usage:
        lines.append(usage)
    for key in ("reason", "error"):
        if run.get(key):
            lines.append(f"{key:<8} {_one_line(run[key])}")
    sentence = queries.critic_sentence(events)
    if sentence:
        lines.append(f"critic   {sentence}")
    table = _table(
        ("SEQ", "+MS", "KIND", "NAME", "DURATION", "SUMMARY"),
        [(e["seq"], f"{e['offset_ms']:.0f}", e["kind"], _cell(e["name"]),
          _ms(e["duration_ms"]), e["summary"]) for e in rows],
        right=(0, 1, 4))
    # Recorded data may hold terminal control sequences: shown escaped, never acted on.
    text = "\n".join(output.visible(line, layout=False) for line in lines) + "\n\n" + table
    if total > len(rows):
        text += (f"\n({total - len(rows)} more row(s) not shown: --limit 0 shows all, "
                 f"--kind picks some)")
    print(_fit(text) if sys.stdout.isatty() else text)


#: The events a loop state is made of, shown as one `state` row by `kernel show`.
_STATE_PARTS = frozenset({"state_enter", "action_start", "process_start", "process_exit",
                          "output", "output_not_audited", "action_end", "evaluate", "route",
                          "step"})


def _one_row_per_state(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A loop state's events (state_enter .. its step) as one row: `exit 1 → no → fix`.

    Other events (critic, steer, checkpoint, resumed, tool calls, ...) keep a
    row of their own; a run without states is returned as it is.
    """
    rows: list[dict[str, Any]] = []
    state: dict[str, Any] | None = None
    for e in events:
        kind = e["kind"]
        if kind == "state_enter":
            state = {**e, "kind": "state", "duration_ms": None, "parts": {}, "lines": 0}
            rows.append(state)
            continue
        if state is None or kind not in _STATE_PARTS:
            rows.append(e)
            continue
        if kind == "output":
            state["lines"] += 1
        else:
            state["parts"][kind] = e.get("payload")
        if kind == "step":
            state["duration_ms"] = e["duration_ms"]
            state = None
    for row in rows:
        if row["kind"] == "state":
            row["summary"] = _state_line(row.pop("parts"), row.pop("lines"))
        elif row["kind"] in ("child_start", "child_end"):
            row["summary"] = _child_line(row["kind"], row.get("payload"), row["summary"])
    return rows


def _child_line(kind: str, payload: Any, summary: str) -> str:
    """`child 3f9a0c2e started` / `child 3f9a0c2e error: why`: a child run by its short id
    (what `kernel show` takes) and how it ended, instead of its payload's JSON."""
    child = payload.get("child_run_id") if isinstance(payload, dict) else None
    if not isinstance(child, str) or not child:
        return summary
    if kind == "child_start":
        return f"child {short_id(child)} started"
    assert isinstance(payload, dict)
    text = f"child {short_id(child)} {payload.get('status') or 'ended'}"
    why = payload.get("error") or payload.get("reason")
    return f"{text}: {_one_line(why)}" if why else text


def _state_line(parts: dict[str, Any], lines: int) -> str:
    """`exit 1 → no → fix`: the action's end, the verdict, where the loop went."""
    def field(kind: str, key: str) -> Any:
        payload = parts.get(kind)
        return payload.get(key) if isinstance(payload, dict) else None

    said = []
    if field("action_end", "timed_out"):
        said.append("timed out")
    elif field("action_end", "signal"):
        said.append(f"signal {field('action_end', 'signal')}")
    elif field("action_end", "exit_code") is not None:
        said.append(f"exit {field('action_end', 'exit_code')}")
    verdict = field("evaluate", "verdict") or field("route", "verdict")
    if verdict:
        said.append(str(verdict))
    to = field("route", "to")
    if to:
        said.append(str(to))
    elif "step" not in parts:
        said.append("(interrupted)")
    text = " → ".join(said)
    if lines:
        text += f"  ({lines} output line{'s' if lines != 1 else ''})"
    error = field("step", "error")
    if error:
        text += f"  error: {_one_line(error)}"
    return text


def _totals(run: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over the whole timeline, whatever session wrote the run's row.

    A resumed run's row holds its last session's runtime; its timeline runs
    from the first start to the last event. Steps and tool calls are the
    larger of the row's count and the events' (completed steps, as `runs.steps`
    counts them). A command that was stopped (timeout, kill, Ctrl-C) after it
    started completed none: `stopped_step` says its one step was cut short.
    """
    sessions = 1 + sum(1 for e in events if e["kind"] == "resumed")
    span = max((float(e["offset_ms"]) for e in events), default=0.0) / 1000
    runtime = float(run.get("runtime_seconds") or 0.0)
    steps = max(int(run.get("steps") or 0), sum(1 for e in events if e["kind"] == "step"))
    inputs = run.get("inputs")
    stopped = (steps == 0 and isinstance(inputs, dict) and "argv" in inputs
               and any(e["kind"] == "process_start" for e in events))
    tools = max(int(run.get("tool_calls") or 0), sum(1 for e in events
                                                     if e["kind"] == "tool_end"))
    return {"sessions": sessions, "timeline_seconds": max(span, runtime) if sessions > 1
            else runtime, "total_steps": steps, "total_tool_calls": tools,
            "stopped_step": stopped}


def _exit_note(run: dict[str, Any]) -> str:
    """` (exit N)`: the command's own code, else the code `kernel run` exited with."""
    if run.get("exit_code") is not None:
        return f" (exit {run['exit_code']})"
    from kernel import Status

    try:
        code = Status(run["status"]).exit_code
    except ValueError:  # running, lost, ...: no exit yet
        return ""
    return f" (exit {code})" if code else ""


def stats(
    since: timedelta | None = typer.Option(
        None, "--since", metavar="AGE", parser=numbers.age(),
        help="Only runs (or tool calls) within AGE: 90, 30m, 24h, 7d, 2w."),
    by: str = typer.Option("subject", "--by", metavar="subject|status|tool",
                           help="Group runs by subject and status, by status, or tool calls "
                                "by tool."),
    json_out: bool = output.json_option(),
    fmt: str | None = output.format_option(),
    db: str | None = typer.Option(None, "--db", metavar="PATH", help=DB_HELP),
    shared_store: str | None = STORE_OPTION,
) -> None:
    """Counts, mean and p95 runtime (or tool latency) for the usual groupings."""
    from batteries.audit import queries

    fmt = output.pick(fmt, json_out)
    with _errors():
        if by not in queries.STATS_BY:
            raise _config_error(f"--by must be one of {', '.join(queries.STATS_BY)}, "
                                f"got {by!r}")
        if _nothing_yet(db, quiet=fmt != "table"):
            output.print_records(fmt, [], queries.STATS_COLUMNS[by])
            return
        with _reader(db) as cur:
            found = queries.stats(cur, by=by, since=since)
    # A CSV of no rows is its header row alone, as `query --format csv` prints it.
    if output.print_records(fmt, found, queries.STATS_COLUMNS[by]):
        return
    if not found:
        print("no runs" if by != "tool" else "no tool calls")
        return
    headers = tuple(found[0])
    print(_table([h.upper() for h in headers],
                 [tuple(_cell(r[h]) for h in headers) for r in found],
                 right=tuple(i for i, h in enumerate(headers)
                             if h not in ("subject", "status", "tool"))))


def query(
    sql: str = typer.Argument(..., metavar="SQL", help="One SELECT statement."),
    fmt: str | None = output.format_option(),
    json_out: bool = output.json_option(),
    db: str | None = typer.Option(None, "--db", metavar="PATH", help=DB_HELP),
    shared_store: str | None = STORE_OPTION,
    timeout: float | None = typer.Option(
        None, "--timeout", metavar="DURATION", parser=numbers.duration(zero=False),
        help="Stop the query after DURATION (one line, exit 2); default: no limit. "
             "Ctrl-C stops it at any time (exit 130)."),
) -> None:
    """Run one read-only SQL query against the audit database.

    Only SELECT (or EXPLAIN [ANALYZE] of one) is accepted, and it runs in a
    DuckDB session that can neither write nor read any file but the audit:
    COPY, EXPORT, ATTACH, INSTALL/LOAD, SET, read_csv('/etc/...') all fail
    with one line and exit 2, and so does a write inside a SELECT (a CTE's
    DELETE ... RETURNING). With nothing recorded yet it runs on the empty
    tables. JSON output is strict: NaN and Infinity are null, integers keep
    every digit (HUGEINT too), and a JSON column (inputs, payload) is nested
    JSON; CSV keeps them as they are. The SQL runs in UTC, whatever $TZ is
    (date_trunc('day', ts) is a UTC day).

    JSON lines and CSV are written as DuckDB produces the rows, so a result
    of any size starts at once and takes little memory, and a reader that
    stops early (`| head`) stops the query; a failure or --timeout partway
    comes after the rows already written. The table waits for every row.
    """
    from batteries.audit import queries

    fmt = output.pick(fmt, json_out)
    with _errors():
        # Refuse a write before touching the database at all.
        queries.check_read_only(sql)
        # A sealed session: the audit attached read-only in an instance that
        # can open no file, so no statement can write (or read) anything else.
        # Nothing recorded yet: the same tables, empty, in memory.
        session = (queries.empty_reader(sealed=True) if _nothing_yet(db, quiet=True)
                   else _store(db).reader(sealed=True))
        with session as cur:
            try:
                if fmt == "table":  # column widths need every row
                    names, data = queries.read_only_query(cur, sql, timeout=timeout)
                else:  # JSON lines and CSV are written as DuckDB produces the rows
                    with queries.stream_query(cur, sql, timeout=timeout) as stream:
                        _stream_out(stream, fmt)
                    return
            except queries.QueryInterrupted:
                _fail("interrupted (Ctrl-C): the query was stopped", 130)
    print(_table(names, [tuple(_cell(v) for v in r) for r in data],
                 right=_numeric_columns(data)))


def _stream_out(stream: Any, fmt: str) -> None:
    """Write a streamed query's rows as JSON lines or CSV, a chunk at a time; a reader
    gone (`| head`) stops the query, and the command ends as if it had finished."""
    names = stream.names
    try:
        if fmt == "json":
            keys = _unique(names)
            decode = stream.decode_json  # DuckDB JSON values as JSON, not as strings
            for chunk in stream:
                output.print_lines(dict(zip(keys, decode(r), strict=True)) for r in chunk)
        else:
            write = output.csv_lines(names)
            for chunk in stream:
                write(chunk)
        sys.stdout.flush()
    except BrokenPipeError:
        stream.close()
        output.stdout_to_devnull()


def purge(
    days: int | None = typer.Option(
        None, "--days", metavar="N", parser=numbers.days(),
        help=f"Delete runs that ended more than N days ago (default: ${RETENTION_ENV}, else "
             f"{DEFAULT_RETENTION_DAYS}); runs still running, and the runs of a batch "
             "that has not finished, are kept, whatever their age, and so are the runs "
             "whose result a batch still owes a delivery (with their batch)."),
    json_out: bool = output.json_option(
        'Print {"runs": N, "events": N, "days": N} as one JSON document (one line).'),
    db: str | None = typer.Option(None, "--db", metavar="PATH", help=DB_HELP),
    shared_store: str | None = STORE_OPTION,
) -> None:
    """Delete runs (and their events) that ended more than N days ago, from both files.

    Only ended runs are deleted, in the journal and in the analysts' file
    alike: a run still running keeps every event, however long ago it
    started (`--days 0` deletes every ended run), and so do the runs of a
    batch that has not finished (its `--resume` needs them) and the runs
    whose result a batch still owes a delivery, with their batch (`kernel
    batch --resume` delivers them). Nothing recorded yet is nothing to purge
    (exit 0).
    """
    from batteries.audit import queries, resolve_db_path
    from batteries.store import open_store

    with _errors():
        keep = _retention_days() if days is None else days
        store = _store(db)
        journal = open_store(resolve_db_path(db))
        n_runs = n_events = 0
        if store.path.exists() or journal.exists():
            _sync(db)
            # One instant for both files, so both delete the same runs.
            now = datetime.now(UTC)
            journal.purge(int(now.timestamp() * 1_000_000) - int(keep * 86400 * 1_000_000))
            with store.session(write=True) as cur:
                n_runs, n_events = queries.purge(cur, keep, now=now)
    if json_out:
        output.print_doc({"runs": n_runs, "events": n_events, "days": keep})
        return
    print(f"purged {n_runs} runs ({n_events} events) older than {keep} days")


def export(
    directory: str | None = typer.Argument(
        None, metavar="DIR", help="Where to write the Parquet files."),
    otlp: str | None = typer.Option(
        None, "--otlp", metavar="URL",
        help="Instead, send stored runs as OpenTelemetry traces (GenAI conventions) to the "
             "OTLP/HTTP collector at URL (needs the otel extra)."),
    run: list[str] | None = typer.Option(
        None, "--run", metavar="RUN_ID", help="With --otlp: only this run (repeatable; "
                                               "short ids work). Default: every finished run."),
    since: timedelta | None = typer.Option(
        None, "--since", metavar="AGE", parser=numbers.age(),
        help="With --otlp: only runs started within this age (e.g. 2h, 7d)."),
    json_out: bool = output.json_option(
        'JSON lines: {"path": FILE} for each file written; with --otlp, one document '
        '{"runs": N, "spans": N, "endpoint": URL}.'),
    db: str | None = typer.Option(None, "--db", metavar="PATH", help=DB_HELP),
    shared_store: str | None = STORE_OPTION,
) -> None:
    """Export every table to DIR/<table>.parquet, or runs as traces with --otlp URL."""
    from batteries.audit import queries

    if otlp is not None:
        if directory is not None:
            _fail("give DIR or --otlp URL, not both", 2)
        _export_otlp(otlp, run or [], since, db, json_out=json_out)
        return
    if run or since is not None:
        _fail("--run and --since go with --otlp", 2)
    if directory is None:
        _fail("missing DIR (or --otlp URL)", 2)
    if not directory.strip():
        _fail("DIR must not be empty (give . for the current directory)", 2)
    with _errors():
        session = queries.empty_reader() if _nothing_yet(db, quiet=True) else _reader(db)
        with session as cur:
            written = queries.export(cur, directory)
    for path in written:
        print(output.dumps({"path": str(path)}) if json_out else path)


def sync(
    json_out: bool = output.json_option(
        'Print what was copied as one JSON document (one line): {"events": N, "runs": N, '
        '"checkpoints": N, "spend": N, "seconds": S}.'),
    db: str | None = typer.Option(None, "--db", metavar="PATH", help=DB_HELP),
    shared_store: str | None = STORE_OPTION,
) -> None:
    """Bring the analysts' DuckDB file up to date from the journal (every analyst command
    does this first; run it before opening the file in another tool)."""
    from batteries.audit import SyncReport

    with _errors():
        # Nothing recorded yet is nothing to copy: an empty report, no file created.
        report = SyncReport() if _nothing_yet(db, quiet=True) else _sync(db)
    if json_out:
        output.print_doc(report)
        return
    print(report)


def report(
    file: str = typer.Argument(..., metavar="FILE", help="The HTML file to write."),
    since: timedelta | None = typer.Option(
        None, "--since", metavar="AGE", parser=numbers.age(), show_default=False,
        help="Runs started within AGE: 90, 30s, 30m, 24h, 7d, 2w. [default: 24h]"),
    until: timedelta | None = typer.Option(
        None, "--until", metavar="AGE", parser=numbers.age(),
        help="Only runs started at least AGE ago (default: up to now)."),
    batch: str | None = typer.Option(
        None, "--batch", metavar="BATCH_ID",
        help="The runs of this batch (an id or a unique prefix, as `kernel batch --list` "
             "prints it) instead of a time range."),
    limit: int = typer.Option(50, "--limit", metavar="N", parser=numbers.count(minimum=1),
                              help="At most N runs, the oldest in the range first."),
    json_out: bool = output.json_option(
        'Print {"file": F, "since": T, "until": T, "runs": [RUN_ID, ...], "total": N} '
        '(with --batch, "batch": ID) on stdout instead of the line on stderr.'),
    db: str | None = typer.Option(None, "--db", metavar="PATH", help=DB_HELP),
    shared_store: str | None = STORE_OPTION,
) -> None:
    """Write the runs of a time range, or of a batch, as one self-contained HTML page.

    An overview with one bar per run (coloured by status, critic kills
    marked) and each run's timeline as `kernel show --html` draws it.
    Nothing is fetched when the page is opened: no server, no CDN.
    """
    from datetime import UTC, datetime

    from batteries.audit import queries

    if batch is not None and (since is not None or until is not None):
        _fail("--batch takes no --since/--until (the batch's runs are its range)", 2)
    now = datetime.now(UTC)
    start, end = now - (since or timedelta(hours=24)), now - (until or timedelta(0))
    if end <= start:
        _fail("--until must be more recent than --since (a smaller AGE)", 2)
    batch_id = None
    # Nothing recorded yet: an empty range (or no such batch), as in an empty store.
    with _errors(), (queries.empty_reader() if _nothing_yet(db, quiet=True)
                     else _reader(db)) as cur:
        if batch is None:
            found, total = queries.runs_between(cur, start, end, limit=limit)
        else:
            batch_id, found, total = queries.runs_of_batch(cur, batch, limit=limit)
        runs = [queries.timeline(cur, r["run_id"]) for r in found]
    if batch_id is not None:  # the batch's own range: first start to last end
        stamps = [t for r in found for t in (r["started_at"], r["ended_at"]) if t is not None]
        if stamps:
            start, end = min(stamps), max(stamps)
            end = max(end, start + timedelta(milliseconds=1))
    from .timeline_html import render_report

    _write_page(file, render_report(runs, start, end, left_out=total - len(runs),
                                    title=f"batch {batch_id}" if batch_id else None))
    if json_out:
        doc = {"file": file, "since": start.isoformat(), "until": end.isoformat(),
               "runs": [r["run_id"] for r in found], "total": total}
        if batch_id is not None:
            doc["batch"] = batch_id
        output.print_doc(doc)
        return
    print(f"wrote {file} ({len(runs)} of {total} run(s))", file=sys.stderr)


def _write_html(path: str, run: dict[str, Any], events: list[dict[str, Any]]) -> None:
    """Write `kernel show --html FILE` (the page is built by timeline_html.render)."""

    from .timeline_html import render

    _write_page(path, render(run, events), what="--html: ")
    print(f"wrote {path}", file=sys.stderr)


def _write_page(path: str, page: str, *, what: str = "") -> None:
    """Write an HTML page to a private file (0600); a failure is one line and exit 1.

    An existing file of ours is made private too (the page holds what the audit
    holds): a page written over an old 0644 one was left readable by others.
    """
    import stat

    from batteries.audit.paths import PRIVATE_FILE_MODE, open_private_file

    try:
        fd = open_private_file(path, os.O_WRONLY | os.O_TRUNC)
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
            os.fchmod(fd, PRIVATE_FILE_MODE)
        with os.fdopen(fd, "wb") as fh:
            fh.write(page.encode())
    except OSError as exc:
        _fail(f"{what}cannot write {path}: {exc.strerror or exc}", 1)


def _export_otlp(endpoint: str, run_ids: list[str], since: timedelta | None,
                 db: str | None, *, json_out: bool) -> None:
    from .otel_cmd import send_runs, stored_runs

    with _errors():
        from batteries.otel import shown_endpoint, traces_url

        traces_url(endpoint)  # a bad URL is bad input, before the database is read
        with _reader(db) as cur:
            runs = stored_runs(cur, run_ids, since)
        spans, failed = send_runs(endpoint, runs)
    if failed:
        _fail(f"{failed} ({spans} spans sent)", 1)
    shown = shown_endpoint(endpoint)  # a password in it is not printed
    if json_out:
        output.print_doc({"runs": len(runs), "spans": spans, "endpoint": shown})
        return
    print(f"exported {len(runs)} runs ({spans} spans) to {shown}")


# ------------------------------------------------------------------ helpers


def _sync(db: str | None) -> Any:
    """Copy what the journal holds and the DuckDB file does not yet."""
    from batteries.audit import resolve_db_path, sync

    return sync(resolve_db_path(db))


def _fit(text: str) -> str:
    """Each line cut to the terminal's width (with an ellipsis), for reading, not piping."""
    import shutil

    width = max(shutil.get_terminal_size().columns, 40)
    return "\n".join(line if len(line) <= width else line[:width - 1] + "…"
                     for line in text.splitlines())


def _db_path(db: str | None) -> Any:
    from batteries.audit import resolve_db_path

    return resolve_db_path(db)


def _nothing_yet(db: str | None, *, quiet: bool, stream: Any = None) -> bool:
    """True (after saying so, unless `quiet`) when no run was ever recorded at `db`.

    A fresh install has no audit database and no journal: that is an empty
    history, not an error, so the listing commands exit 0.
    """
    from batteries.store import journal_path, open_store, store_url

    path = _db_path(db)
    if path.exists():
        return False
    with _errors():
        url = store_url()
        if url is None and journal_path(path).exists():
            return False
        if url is not None and open_store(path).exists():
            return False
    where = f"no audit database at {path}" if url is None else f"nothing in {open_store().path}"
    if not quiet:
        print(f"no runs yet ({where})", file=stream or sys.stdout)
    return True


def _store(db: str | None) -> Store:
    from batteries.audit import Store, resolve_db_path

    return Store(resolve_db_path(db))


@contextmanager
def _reader(db: str | None) -> Iterator[Any]:
    with _store(db).reader() as cur:  # synced from the journal first
        yield cur


@contextmanager
def _errors() -> Iterator[None]:
    """Turn the library's errors into one line on stderr and an exit code.

    A damaged database (DuckDB's own error in the middle of a read) is one
    line and exit 2 too (`dberrors.database_errors`).
    """
    from kernel import ConfigError, KernelError

    from .dberrors import database_errors

    try:
        with database_errors():
            yield
    except ConfigError as exc:
        _fail(str(exc), 2)
    except KernelError as exc:
        _fail(str(exc), 1)


def _fail(message: str, code: int) -> NoReturn:
    from .dberrors import error_prefix

    print(f"{error_prefix()} {output.visible(_one_line(message))}", file=sys.stderr)
    raise typer.Exit(code)


def _config_error(message: str) -> Exception:
    from kernel import ConfigError

    return ConfigError(message)


def _audit_error(message: str) -> Exception:
    from kernel import AuditError

    return AuditError(message)


def _retention_days() -> int:
    return numbers.from_env(RETENTION_ENV, numbers.parse_days, DEFAULT_RETENTION_DAYS)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _when(value: Any) -> str:
    """A timestamp in UTC, whatever $TZ says: every time column is labelled (UTC)."""
    if isinstance(value, datetime):
        if value.tzinfo is None:  # the store keeps UTC; a naive value is UTC already
            value = value.replace(tzinfo=UTC)
        return str(value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S"))
    return "" if value is None else str(value)


def _secs(value: Any) -> str:
    if value is None:
        return "-"
    s = float(value)
    if s < 60:
        return f"{s:.2f}s"
    m, s = divmod(int(s), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _ms(value: Any) -> str:
    if value is None:
        return ""
    ms = float(value)
    return f"{ms:.1f}ms" if ms < 1000 else _secs(ms / 1000)


def _num(value: Any) -> str:
    return "-" if value is None else str(value)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return _real(value)
    if isinstance(value, datetime):
        return _when(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value, default=str, ensure_ascii=False)
    return _one_line(str(value))


def _real(value: float) -> str:
    """A float for a table: 3 decimals, or (below 0.1) 3 significant digits, so a cost of
    $0.00028 shows as 0.00028, not 0.000."""
    if not math.isfinite(value):
        return str(value)
    if value == 0 or abs(value) >= 0.1:
        return f"{value:.3f}"
    return f"{value:.3g}"


def _usage_line(run: dict[str, Any]) -> str | None:
    """`usage    tokens 1200 in, 340 out  cost $0.00028`, or None when the run used none."""
    parts = []
    tokens = [(run.get(k), word) for k, word in (("input_tokens", "in"),
                                                  ("output_tokens", "out"),
                                                  ("thinking_tokens", "thinking"))]
    if any(n for n, _ in tokens):
        parts.append("tokens " + ", ".join(f"{n or 0} {word}" for n, word in tokens
                                           if n or word != "thinking"))
    cost = run.get("cost_usd")
    if isinstance(cost, (int, float)) and cost:
        parts.append(f"cost ${_real(float(cost))}")
    return f"{'usage':<8} {'  '.join(parts)}" if parts else None


def _numeric_columns(data: Sequence[Sequence[Any]]) -> tuple[int, ...]:
    if not data:
        return ()
    return tuple(i for i, v in enumerate(data[0])
                 if isinstance(v, (int, float, Decimal)) and not isinstance(v, bool))


def _unique(names: Sequence[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}_{seen[n]}")
    return out


_table = output.table
