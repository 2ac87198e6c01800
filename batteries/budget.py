"""Per-caller budgets kept in the audit's DuckDB file.

A budget row says how much a caller may spend per rolling window (a day by
default): runs, runtime seconds, tokens, dollars. `check` refuses a caller
who has used any of them up (`BudgetRefused`, the run ends
`budget_exceeded` with exit code 3) and otherwise hands the kernel what is
left as `UsageLimits`, so a run that would overspend is stopped mid-run.
`commit` records every run's spend, whatever its status. The caller `*`
holds the default budget for callers without a row of their own.

Tables (created on first use, in the same file analysts query)::

    budgets(caller_id PK, window_seconds, max_runs, max_runtime_seconds,
            max_tokens, max_cost_usd, updated_at)
    budget_spend(caller_id, ts, run_id, runtime_seconds, tokens, cost_usd)

`check` and `commit` are two short transactions: two processes starting a
run for the same caller at the same instant can both pass the check. The
overspend is bounded by the per-run caps handed out, and recorded.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from kernel import BudgetRefused, Usage, UsageLimits

DEFAULT_CALLER = "*"

_DDL = (
    """CREATE TABLE IF NOT EXISTS budgets (
        caller_id VARCHAR PRIMARY KEY,
        window_seconds DOUBLE NOT NULL,
        max_runs BIGINT,
        max_runtime_seconds DOUBLE,
        max_tokens BIGINT,
        max_cost_usd DOUBLE,
        updated_at TIMESTAMP NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS budget_spend (
        caller_id VARCHAR NOT NULL,
        ts TIMESTAMP NOT NULL,
        run_id VARCHAR,
        runtime_seconds DOUBLE NOT NULL,
        tokens BIGINT NOT NULL,
        cost_usd DOUBLE NOT NULL)""",
)


@dataclass(slots=True, frozen=True)
class CallerBudget:
    """One caller's budget and what they spent in the current window."""

    caller_id: str
    window_seconds: float
    max_runs: int | None
    max_runtime_seconds: float | None
    max_tokens: int | None
    max_cost_usd: float | None
    runs: int = 0
    runtime_seconds: float = 0.0
    tokens: int = 0
    cost_usd: float = 0.0

    def refusal(self) -> str | None:
        """Why a new run must be refused, or None."""
        window = _window_text(self.window_seconds)
        checks: list[tuple[str, float | None, float, str]] = [
            ("runs", self.max_runs, self.runs, "{:g}"),
            ("runtime", self.max_runtime_seconds, self.runtime_seconds, "{:.0f}s"),
            ("tokens", self.max_tokens, self.tokens, "{:g}"),
            ("cost", self.max_cost_usd, self.cost_usd, "${:.2f}"),
        ]
        for what, limit, used, fmt in checks:
            if limit is not None and used >= limit:
                return (f"caller {self.caller_id!r} used {fmt.format(used)} of "
                        f"{fmt.format(limit)} {what} {window}")
        return None

    def remaining(self) -> UsageLimits:
        """What is left, as caps for the next run."""
        def left(limit: float | None, used: float) -> float | None:
            return None if limit is None else max(limit - used, 0)

        tokens = left(self.max_tokens, self.tokens)
        return UsageLimits(
            max_total_tokens=None if tokens is None else int(tokens),
            max_cost_usd=left(self.max_cost_usd, self.cost_usd),
            max_runtime_seconds=left(self.max_runtime_seconds, self.runtime_seconds),
        )


def _window_text(seconds: float) -> str:
    if seconds == 86400:
        return "in the last 24h"
    if seconds % 3600 == 0:
        return f"in the last {seconds / 3600:g}h"
    return f"in the last {seconds:g}s"


class DuckDBBudget:
    """The Budget port on a DuckDB file (usually the audit database).

    Args:
        path: The database file.
        lock_timeout: Seconds to wait for a file another process holds.
    """

    def __init__(self, path: str | Path, *, lock_timeout: float | None = None) -> None:
        from batteries.audit import Store

        self.store = Store(path) if lock_timeout is None else Store(
            path, lock_timeout=lock_timeout)

    # --------------------------------------------------------------- the port

    async def check(self, caller_id: str) -> UsageLimits | None:
        """Refuse a caller who has used up a budget; else return what is left."""
        budget = await trio.to_thread.run_sync(self.status, caller_id)
        if budget is None:
            return None
        why = budget.refusal()
        if why is not None:
            raise BudgetRefused(why)
        return budget.remaining()

    async def commit(self, caller_id: str, runtime_seconds: float, usage: Usage) -> None:
        """Record one run's spend (every run that passed `check`)."""
        await trio.to_thread.run_sync(self._commit, caller_id, runtime_seconds, usage)

    def _commit(self, caller_id: str, runtime_seconds: float, usage: Usage) -> None:
        with self.store.session(write=True) as con:
            self._ensure(con)
            con.execute("INSERT INTO budget_spend VALUES (?, ?, NULL, ?, ?, ?)",
                        [caller_id, _now(), runtime_seconds, usage.total_tokens,
                         usage.cost_usd])

    # ------------------------------------------------------------ management

    def set(self, caller_id: str, *, window_seconds: float = 86400,
            max_runs: int | None = None, max_runtime_seconds: float | None = None,
            max_tokens: int | None = None, max_cost_usd: float | None = None) -> None:
        """Create or replace a caller's budget (blocking; for the CLI and hosts)."""
        if window_seconds <= 0:
            raise ValueError("the budget window must be > 0 seconds")
        self.store.ensure_schema()  # the file may be new: make it a full audit database
        with self.store.session(write=True) as con:
            self._ensure(con)
            con.execute("DELETE FROM budgets WHERE caller_id = ?", [caller_id])
            con.execute("INSERT INTO budgets VALUES (?, ?, ?, ?, ?, ?, ?)",
                        [caller_id, window_seconds, max_runs, max_runtime_seconds,
                         max_tokens, max_cost_usd, _now()])

    def remove(self, caller_id: str) -> bool:
        """Delete a caller's budget; True if there was one."""
        with self.store.session(write=True) as con:
            self._ensure(con)
            found = con.execute("SELECT count(*) FROM budgets WHERE caller_id = ?",
                                [caller_id]).fetchone()
            con.execute("DELETE FROM budgets WHERE caller_id = ?", [caller_id])
        return bool(found and found[0])

    def status(self, caller_id: str) -> CallerBudget | None:
        """The caller's budget (own row, else `*`) and spend in its window; None if unbounded."""
        if not self.store.path.exists():
            return None
        with self.store.session(write=False) as con:
            if not _has_tables(con):
                return None
            row = con.execute(
                "SELECT caller_id, window_seconds, max_runs, max_runtime_seconds, max_tokens, "
                "max_cost_usd FROM budgets WHERE caller_id IN (?, ?) "
                "ORDER BY caller_id = ? DESC LIMIT 1",
                [caller_id, DEFAULT_CALLER, caller_id]).fetchone()
            if row is None:
                return None
            return self._with_spend(con, caller_id, row)

    def all(self) -> list[CallerBudget]:
        """Every budget row with its own caller's current spend."""
        if not self.store.path.exists():
            return []
        with self.store.session(write=False) as con:
            if not _has_tables(con):
                return []
            rows = con.execute(
                "SELECT caller_id, window_seconds, max_runs, max_runtime_seconds, max_tokens, "
                "max_cost_usd FROM budgets ORDER BY caller_id").fetchall()
            return [self._with_spend(con, r[0], r) for r in rows]

    @staticmethod
    def _with_spend(con: Any, caller_id: str, row: Any) -> CallerBudget:
        since = _now() - dt.timedelta(seconds=row[1])
        spent = con.execute(
            "SELECT count(*), coalesce(sum(runtime_seconds), 0), coalesce(sum(tokens), 0), "
            "coalesce(sum(cost_usd), 0) FROM budget_spend WHERE caller_id = ? AND ts > ?",
            [caller_id, since]).fetchone()
        runs, runtime, tokens, cost = spent if spent else (0, 0.0, 0, 0.0)
        return CallerBudget(caller_id, row[1], row[2], row[3], row[4], row[5],
                            int(runs), float(runtime), int(tokens), float(cost))

    @staticmethod
    def _ensure(con: Any) -> None:
        for ddl in _DDL:
            con.execute(ddl)


def _has_tables(con: Any) -> bool:
    found = con.execute(
        "SELECT count(*) FROM duckdb_tables() WHERE database_name = current_database() "
        "AND table_name IN ('budgets', 'budget_spend')").fetchone()
    return bool(found and found[0] == 2)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)
