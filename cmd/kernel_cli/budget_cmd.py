"""`kernel budget set|show|rm`: per-caller budgets in the audit database."""

from __future__ import annotations

import sys
from typing import Any, NoReturn

import typer

from . import numbers, output
from .dberrors import error_prefix
from .dbopt import DB_HELP, STORE_OPTION

budget_app = typer.Typer(
    name="budget", no_args_is_help=True, rich_markup_mode=None,
    help="Per-caller budgets (runs, runtime, tokens, cost per rolling window). A caller who "
         "has used one up is refused: the run ends budget_exceeded, exit 3. The caller '*' "
         "is the default for callers without a budget of their own.")


#: The most characters of a caller id the `budget show` table prints.
ID_WIDTH = 32


def register(app: typer.Typer) -> None:
    """Add `kernel budget` to the app."""
    app.add_typer(budget_app)


def _store(db: str | None) -> Any:
    from batteries.audit import resolve_db_path
    from batteries.budget import JournalBudget

    return JournalBudget(resolve_db_path(db))


def _fail(message: str, code: int = 2) -> NoReturn:
    print(f"{error_prefix()} {output.visible(message, layout=False)}", file=sys.stderr)
    raise typer.Exit(code)


def _store_failed(exc: Exception) -> NoReturn:
    """One line for a store that failed: exit 1 if it was busy, else 2.

    A journal locked past `$KERNEL_AUDIT_LOCK_TIMEOUT` (or a PostgreSQL store
    that cannot be reached) is no fault in what the user typed: it exits 1,
    as every other command does for a locked store, so a script can tell
    "try again" from "fix the command". A damaged or unusable store is bad
    input (exit 2), as README's audit section says.
    """
    from batteries.store import StoreBusyError

    _fail(str(exc), 1 if isinstance(exc, StoreBusyError) else 2)


@budget_app.command("set")
def set_budget(
    caller: str = typer.Argument(..., metavar="CALLER",
                                 help="The caller id ('*' for the default budget)."),
    runs: int | None = typer.Option(None, "--runs", metavar="N", parser=numbers.count(),
                                    help="Runs per window."),
    runtime: float | None = typer.Option(
        None, "--runtime", metavar="DURATION", parser=numbers.duration(),
        help="Runtime per window: seconds, or 90m, 2h, 7d."),
    tokens: int | None = typer.Option(None, "--tokens", metavar="N", parser=numbers.count(),
                                      help="Tokens per window."),
    cost: float | None = typer.Option(
        None, "--cost", metavar="USD", parser=numbers.amount(),
        help="US dollars per window. An --agent llm run, or a loop whose llm_structured "
             "judge asks a model, needs its --price to be charged: without one it is refused."),
    window: float = typer.Option(
        "24h", "--window", metavar="DURATION", parser=numbers.duration(zero=False),
        help="The rolling window: 30m, 24h, 7d, 2w (or seconds)."),
    as_json: bool = output.json_option(
        "Print the budget as set as one JSON document (one line) on stdout."),
    db: str | None = typer.Option(None, "--db", metavar="PATH", help=DB_HELP),
    shared_store: str | None = STORE_OPTION,
) -> None:
    """Create or replace CALLER's budget."""
    from kernel import AuditError

    if not caller.strip() or not caller.isprintable():
        _fail(f"the caller id {caller!r} is empty or holds a control character: give the id "
              "runs use (--caller, $KERNEL_CALLER, else $USER), or '*' for the default")
    if runs is None and runtime is None and tokens is None and cost is None:
        _fail("give at least one of --runs, --runtime, --tokens, --cost")
    try:
        _store(db).set(caller, window_seconds=window, max_runs=runs,
                       max_runtime_seconds=runtime, max_tokens=tokens, max_cost_usd=cost)
    except AuditError as exc:
        _store_failed(exc)
    except ValueError as exc:  # the battery's own checks (the options are checked above)
        _fail(str(exc))
    if as_json:
        output.print_doc({"caller_id": caller, "window_seconds": window, "max_runs": runs,
                          "max_runtime_seconds": runtime, "max_tokens": tokens,
                          "max_cost_usd": cost})
        return
    print(f"budget for {caller!r} set")


@budget_app.command("show")
def show_budget(
    caller: str | None = typer.Argument(
        None, metavar="CALLER",
        help="Show one caller (with what applies to them); default: every budget."),
    as_json: bool = output.json_option(),
    fmt: str | None = output.format_option(),
    db: str | None = typer.Option(None, "--db", metavar="PATH", help=DB_HELP),
    shared_store: str | None = STORE_OPTION,
) -> None:
    """Budgets and what each caller spent in the current window."""
    from dataclasses import asdict, fields

    from batteries.store import CallerBudget, window_label
    from kernel import AuditError

    fmt = output.pick(fmt, as_json)
    try:
        store = _store(db)
        if caller is None:
            rows = store.all()
        else:
            one = store.status(caller)
            rows = [] if one is None else [one]
    except AuditError as exc:
        _store_failed(exc)
    records = [{"for": caller or row.caller_id, **asdict(row)} for row in rows]
    if output.print_records(fmt, records, ["for", *(f.name for f in fields(CallerBudget))]):
        return
    if not rows:
        print("no budget applies" if caller else "no budgets set")
        return

    from batteries.store._types import dollars

    def cell(used: float, limit: float | None, fmt: Any) -> str:
        show = fmt if callable(fmt) else fmt.format
        return "-" if limit is None else f"{show(used)}/{show(limit)}"

    def who(caller_id: str) -> str:
        # Cut to ID_WIDTH so one very long id cannot push every row off the screen; the
        # whole id is in --json and --format csv.
        return caller_id if len(caller_id) <= ID_WIDTH else caller_id[:ID_WIDTH - 1] + "…"

    # `output.table`: columns as wide as their widest cell (an id longer than the header
    # moves them rather than breaking them), control characters in an id shown escaped.
    print(output.table(
        ("caller", "window", "runs", "runtime", "tokens", "cost"),
        [(who(r.caller_id), window_label(r.window_seconds), cell(r.runs, r.max_runs, "{:g}"),
          cell(r.runtime_seconds, r.max_runtime_seconds, "{:.0f}s"),
          cell(r.tokens, r.max_tokens, "{:g}"), cell(r.cost_usd, r.max_cost_usd, dollars))
         for r in rows], right=(1, 2, 3, 4, 5)))


@budget_app.command("rm")
def remove_budget(
    caller: str = typer.Argument(..., metavar="CALLER", help="The caller id."),
    as_json: bool = output.json_option(
        'Print {"caller_id": CALLER, "removed": true} as one JSON document (one line).'),
    db: str | None = typer.Option(None, "--db", metavar="PATH", help=DB_HELP),
    shared_store: str | None = STORE_OPTION,
) -> None:
    """Remove CALLER's budget (their spend history stays)."""
    from kernel import AuditError

    try:
        found = _store(db).remove(caller)
    except AuditError as exc:
        _store_failed(exc)
    if not found:
        _fail(f"no budget for {caller!r}")
    if as_json:
        output.print_doc({"caller_id": caller, "removed": True})
        return
    print(f"budget for {caller!r} removed")
