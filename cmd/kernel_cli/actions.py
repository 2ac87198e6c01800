"""`kernel actions`: act on agents in tmux panes (`run`); read the attempt log (`query`, `stats`).

Each `kernel actions run` is one audited kernel run whose single step is one
attempt; the attempt is the `attempt` event analysts read through the
`attempts` view. `query` and `stats` open the audit database read-only.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NoReturn

import typer

from . import numbers, output
from .dbopt import DB_HELP, STORE_OPTION
from .ids import short_id

if TYPE_CHECKING:
    from adapters.pane import Attempt, Multiplexer, PaneAction
    from kernel import PortSpec, Result

ACTIONS_HELP = """Probe and act on agents living in tmux panes, and read the attempt log.

\b
  kernel actions run nonce-probe dev        is the agent in pane "dev" answering?
  kernel actions run compact dev:0.1 --min-drop-pct 30 --timeout 60
  kernel actions query --pane dev --since 2h
  kernel actions stats --since 7d

Every attempt ends in one outcome: success, precondition_fail, send_error,
completion_timeout or skipped_by_policy, and is recorded in the audit
database (the `attempts` view).
"""

RUN_HELP = """Run one attempt of ACTION (nonce-probe | compact) on the tmux pane TARGET.

\b
  nonce-probe  types "Repeat <nonce>"; success once the agent echoes the nonce
  compact      types "/compact"; success once the context percentage shown in
               the pane drops by --min-drop-pct points or more

\b
TARGET is a tmux target (session, session:window.pane, %id) on the default
server, or on --tmux-socket. Typing pauses between keys and before Enter:
$KERNEL_PANE_KEY_DELAY (default 0.01 s) and $KERNEL_PANE_SUBMIT_DELAY (0.3 s).
Snapshots kept in the record are capped at $KERNEL_PANE_SNAPSHOT_CHARS (4000).

\b
Exit codes: 0 success or skipped_by_policy, 1 any other outcome,
2 bad input or an unknown or dead TARGET (nothing is recorded then),
130 cancelled (Ctrl-C, SIGTERM).
"""

#: The outcomes, for validating --outcome without importing the adapter.
OUTCOMES = ("success", "precondition_fail", "send_error", "completion_timeout",
            "skipped_by_policy")
_ATTEMPT_FIELDS = ("run_id", "agent", "action", "outcome", "elapsed_s", "started_at",
                   "pane_before", "pane_after", "extras")
_ATTEMPT_COLUMNS = ", ".join(_ATTEMPT_FIELDS)


def register(app: typer.Typer) -> None:
    """Add the `kernel actions` group (run, query, stats) to the app."""
    group = typer.Typer(name="actions", help=ACTIONS_HELP, no_args_is_help=True,
                        add_completion=False, rich_markup_mode=None,
                        context_settings={"help_option_names": ["-h", "--help"]})
    group.command("run", help=RUN_HELP)(run)
    group.command("query")(query)
    group.command("stats")(stats)
    app.add_typer(group, name="actions")


def _fail(command: str, message: str) -> NoReturn:
    print(f"kernel actions {command}: error: {message}", file=sys.stderr)
    raise typer.Exit(2)


# -------------------------------------------------------------------- run


def run(
    action: str = typer.Argument(..., metavar="ACTION", help="nonce-probe | compact"),
    target: str = typer.Argument(..., metavar="TARGET", help="The tmux pane."),
    timeout: float = typer.Option(
        30.0, "--timeout", metavar="DURATION", parser=numbers.duration(zero=False),
        help="Time from the start until completion_timeout (90, 90s, 5m, ...)."),
    poll_interval: float = typer.Option(
        2.0, "--poll-interval", metavar="DURATION", parser=numbers.duration(zero=False),
        help="Time between looks at the pane."),
    skip_reason: str | None = typer.Option(
        None, "--skip-reason", metavar="REASON",
        help="Do not act: record skipped_by_policy with this reason."),
    min_drop_pct: float | None = typer.Option(
        None, "--min-drop-pct", metavar="PCT", parser=numbers.percent(), show_default=False,
        help="compact: the context percentage must drop by at least this many points "
             "[default: 20]."),
    agent: str | None = typer.Option(
        None, "--pane", metavar="NAME", help="The pane's agent's name in the record "
                                              "[default: TARGET]."),
    tmux_socket: str | None = typer.Option(
        None, "--tmux-socket", metavar="NAME|PATH", envvar="KERNEL_TMUX_SOCKET",
        help="The tmux server: a socket name (tmux -L) or path (tmux -S)."),
    json_out: bool = output.json_option(
        "Print the attempt as one JSON document (one line) on stdout."),
    db: str | None = typer.Option(
        None, "--db", metavar="PATH", help=DB_HELP),
    shared_store: str | None = STORE_OPTION,
    no_audit: bool = typer.Option(False, "--no-audit", help="Record nothing."),
) -> None:
    """Run one attempt of a pane action and exit with its outcome's code."""
    from adapters.pane import TmuxMultiplexer, make_action, snapshot_chars
    from kernel import ConfigError, KernelError

    try:
        if min_drop_pct is not None and action != "compact":
            raise ConfigError("--min-drop-pct applies to the compact action only")
        if not target.strip():
            raise ConfigError("TARGET must not be empty")
        pane_action = make_action(action, min_drop_pct=min_drop_pct)
        mux = TmuxMultiplexer(socket=tmux_socket)
        cap = snapshot_chars()
    except ConfigError as exc:
        _fail("run", str(exc).replace("min_drop_pct", "--min-drop-pct"))
    import trio

    from kernel import PortSpec

    opts = PortSpec(db=db, no_audit=no_audit, no_critic=True)
    try:
        result, attempt = trio.run(_execute, pane_action, mux, target, agent, timeout,
                                   poll_interval, skip_reason, opts)
    except KernelError as exc:
        # An unknown or dead target, tmux missing, or a battery that refused its options.
        _fail("run", str(exc))
    code = _report(result, attempt, json_out=json_out, cap=cap)
    raise typer.Exit(code)


class _Capture:
    """A Delivery that keeps the result, so a cancelled run still reports one."""

    result: Result | None = None

    async def deliver(self, result: Result) -> None:
        self.result = result


async def _execute(action: PaneAction, mux: Multiplexer, target: str, agent: str | None,
                   timeout: float, poll_interval: float, skip_reason: str | None,
                   opts: PortSpec) -> tuple[Result, Attempt | None]:
    import trio

    from adapters.pane import ActionAgent
    from kernel import ConfigError, Kernel, PortFailure

    status = await mux.target_status(target)
    if not status.alive:
        what = "unknown" if status.state == "unknown" else "dead"
        raise ConfigError(f"{what} target {target!r}: {status.detail}")
    runner = ActionAgent(action, mux, target, agent=agent, timeout=timeout,
                         poll_interval=poll_interval, skip_reason=skip_reason)
    capture = _Capture()
    warnings: list[PortFailure] = []
    run_scope = trio.CancelScope()

    async def on_signal(signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            print(f"kernel: {signal.Signals(signum).name}: cancelling the attempt",
                  file=sys.stderr)
            run_scope.cancel()

    from batteries.runner import open_ports

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with (open_ports(opts, delivery=capture, warnings=warnings) as ports,
                    trio.open_nursery() as nursery):
            nursery.start_soon(on_signal, signals)
            with run_scope:
                info = runner.run_info(caller_id=os.environ.get("KERNEL_CALLER")
                                       or os.environ.get("USER", ""))
                await Kernel(ports).run(runner, info, runner.limits())
            nursery.cancel_scope.cancel()
    result = capture.result
    assert result is not None, "the kernel delivers every result"
    result.port_failures[:0] = warnings
    return result, runner.attempt


def _report(result: Result, attempt: Attempt | None, *, json_out: bool, cap: int) -> int:
    """Print the attempt (or why there is none) and return the exit code."""
    for failure in result.port_failures:
        print(f"kernel: warning: {failure}", file=sys.stderr)
    # As in `kernel run --json`: a script must be able to tell that the attempt
    # (or the run) could not be recorded, not only a person reading stderr.
    failures = [str(failure) for failure in result.port_failures]
    if attempt is None:
        code = result.status.exit_code or 1
        why = result.reason or result.error or str(result.status)
        if json_out:
            output.print_doc({
                "run_id": result.run_id, "status": str(result.status), "outcome": None,
                "error": why, "exit_code": code, "port_failures": failures})
        # A cancelled attempt has no outcome, but what it did is kept (`attempt_cancelled`).
        what = ("attempt cancelled (kept as an attempt_cancelled event)"
                if str(result.status) == "cancelled" else "no attempt recorded")
        print(f"kernel actions run: {what}: run {short_id(result.run_id)} "
              f"{result.status}: {why}", file=sys.stderr)
        return code
    code = 0 if attempt.outcome.ok else 1
    if json_out:
        doc = {"run_id": result.run_id, "status": str(result.status), **attempt.record(cap),
               "exit_code": code, "port_failures": failures}
        output.print_doc(doc)
    else:
        summary = output.visible(attempt.summary(), layout=False)
        sys.stdout.write(f"{summary} [run {short_id(result.run_id)}]\n")
    return code


# ------------------------------------------------------------ query/stats


def _open_reader(db: str | None) -> Any:
    """A read-only session on the audit database (retried while another process writes)."""
    from batteries.audit import Store, resolve_db_path

    return Store(resolve_db_path(db)).reader()


def _select(command: str, db: str | None, sql: str, params: list[Any]) -> list[dict[str, Any]]:
    """Run one query on the `attempts` view; a missing database reads as no attempts."""
    import duckdb

    from batteries.audit import resolve_db_path
    from batteries.audit.queries import dicts
    from batteries.store import journal_path, open_store, store_url
    from kernel import ConfigError, KernelError

    path = resolve_db_path(db)
    try:  # nothing recorded yet: no analysts' file, and no journal or empty shared store
        shared = store_url()
        empty = not path.exists() and (not journal_path(path).exists() if shared is None
                                       else not open_store(path).exists())
    except KernelError as exc:  # a bad $KERNEL_STORE, an unreachable server
        print(f"kernel actions {command}: error: {exc}", file=sys.stderr)
        raise typer.Exit(2 if isinstance(exc, ConfigError) else 1) from None
    if empty:
        where = path if shared is None else open_store(path).path
        print(f"kernel actions {command}: no audit database at {where} yet", file=sys.stderr)
        return []
    try:
        with _open_reader(db) as cur:
            return dicts(cur, sql, params)
    except duckdb.CatalogException as exc:
        print(f"kernel actions {command}: error: {path} has no attempts view "
              f"({str(exc).splitlines()[0]})", file=sys.stderr)
        raise typer.Exit(1) from None
    except (duckdb.Error, KernelError) as exc:
        print(f"kernel actions {command}: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        raise typer.Exit(1) from None


def _filters(command: str, *, agent: str | None, action: str | None = None,
             outcome: str | None = None, since: timedelta | None = None
             ) -> tuple[list[str], list[Any]]:
    """WHERE clauses and parameters for the common options (bad input exits 2)."""

    from batteries.audit.queries import cutoff

    where: list[str] = []
    params: list[Any] = []
    for column, value in (("agent", agent), ("action", action), ("outcome", outcome)):
        if value is not None:
            where.append(f"{column} = ?")
            params.append(value)
    if outcome is not None and outcome not in OUTCOMES:
        _fail(command, f"--outcome must be one of {', '.join(OUTCOMES)}, got {outcome!r}")
    if since is not None:
        at = cutoff(since)
        # started_at is ISO-8601 text in the payload; the cast also accepts a timestamp.
        where.append("TRY_CAST(started_at AS TIMESTAMPTZ) >= ?")
        params.append(at)
    return where, params


def _jsonish(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value


def query(
    agent: str | None = typer.Option(None, "--pane", metavar="NAME",
                                     help="Only attempts on the pane agent of this name."),
    action: str | None = typer.Option(None, "--action", metavar="NAME",
                                      help="Only this action."),
    outcome: str | None = typer.Option(None, "--outcome", metavar="OUTCOME",
                                       help="Only this outcome."),
    since: timedelta | None = typer.Option(
        None, "--since", metavar="AGE", parser=numbers.age(),
        help="Only attempts started within 90, 30s, 30m, 2h, 7d, 2w."),
    limit: int = typer.Option(20, "--limit", metavar="N", parser=numbers.count(minimum=1),
                              help="At most N attempts."),
    json_out: bool = output.json_option(
        "Print JSON lines (one attempt a line, with the pane snapshots and extras) instead "
        "of a table: --format json."),
    fmt: str | None = output.format_option(),
    db: str | None = typer.Option(None, "--db", metavar="PATH", help=DB_HELP),
    shared_store: str | None = STORE_OPTION,
) -> None:
    """List recent attempts, most recent first."""
    fmt = output.pick(fmt, json_out)
    where, params = _filters("query", agent=agent, action=action, outcome=outcome, since=since)
    sql = (f"SELECT {_ATTEMPT_COLUMNS} FROM attempts"
           + (" WHERE " + " AND ".join(where) if where else "")
           + " ORDER BY TRY_CAST(started_at AS TIMESTAMPTZ) DESC NULLS LAST, run_id DESC"
             " LIMIT ?")
    found = _select("query", db, sql, [*params, limit])
    rows = [{k: _jsonish(v) for k, v in r.items()} for r in found]
    for r in rows:
        if r["elapsed_s"] is not None:
            r["elapsed_s"] = float(r["elapsed_s"])
    if output.print_records(fmt, rows, _ATTEMPT_FIELDS):
        return
    table = [["STARTED (UTC)", "AGENT", "ACTION", "OUTCOME", "ELAPSED", "RUN", "DETAIL"]]
    for r in rows:
        table.append([_short_time(r["started_at"]), str(r["agent"]), str(r["action"]),
                      str(r["outcome"]), _seconds(r["elapsed_s"]), short_id(str(r["run_id"])),
                      _detail(r)])
    _print_table(table)


def stats(
    agent: str | None = typer.Option(None, "--pane", metavar="NAME",
                                     help="Only attempts on the pane agent of this name."),
    since: timedelta | None = typer.Option(
        None, "--since", metavar="AGE", parser=numbers.age(),
        help="Only attempts started within 90, 30s, 30m, 2h, 7d, 2w."),
    json_out: bool = output.json_option(),
    fmt: str | None = output.format_option(),
    db: str | None = typer.Option(None, "--db", metavar="PATH", help=DB_HELP),
    shared_store: str | None = STORE_OPTION,
) -> None:
    """Count, mean and p95 elapsed seconds of attempts, by action and outcome."""
    fmt = output.pick(fmt, json_out)
    where, params = _filters("stats", agent=agent, since=since)
    sql = ("SELECT action, outcome, count(*) AS count,"
           " avg(CAST(elapsed_s AS DOUBLE)) AS mean_s,"
           " quantile_cont(CAST(elapsed_s AS DOUBLE), 0.95) AS p95_s"
           " FROM attempts" + (" WHERE " + " AND ".join(where) if where else "")
           + " GROUP BY action, outcome ORDER BY action, outcome")
    rows = _select("stats", db, sql, params)
    for r in rows:
        r["count"] = int(r["count"])
        for key in ("mean_s", "p95_s"):
            r[key] = None if r[key] is None else round(float(r[key]), 6)
    if output.print_records(fmt, rows, ("action", "outcome", "count", "mean_s", "p95_s")):
        return
    table = [["ACTION", "OUTCOME", "COUNT", "MEAN", "P95"]]
    for r in rows:
        table.append([str(r["action"]), str(r["outcome"]), str(r["count"]),
                      _seconds(r["mean_s"]), _seconds(r["p95_s"])])
    _print_table(table)


def _seconds(value: Any) -> str:
    return "-" if value is None else f"{float(value):.2f}s"


def _short_time(value: Any) -> str:
    """An attempt's ISO-8601 start time in UTC (the column says so), to the second."""
    from datetime import UTC, datetime

    text = str(value or "")
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return text[:19].replace("T", " ")
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")


def _detail(row: dict[str, Any]) -> str:
    extras = row.get("extras")
    if not isinstance(extras, dict):
        return ""
    for key in ("send_error", "snapshot_error", "precheck_error", "skip_reason", "pane_gone",
                "probe", "reason"):
        if extras.get(key):
            text = " ".join(str(extras[key]).split())
            return text if len(text) <= 60 else text[:59] + "…"
    return ""


def _print_table(table: list[list[str]]) -> None:
    table = [[output.visible(cell, layout=False) for cell in row] for row in table]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        sys.stdout.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                         .rstrip() + "\n")
    if len(table) == 1:
        print("(no attempts)", file=sys.stderr)
