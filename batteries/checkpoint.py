"""Checkpoints for crash recovery, kept in the audit's DuckDB file.

A host registers each run with a *run spec* before it starts: a JSON
document saying how to rebuild the agent (which kind, its config and
inputs, the limits). The kernel then saves the agent's resumable state as
the run goes (throttled), and marks the row `completed` or `failed` at the
end. A run whose process died (SIGKILL, a crash, a reboot) or that was
interrupted by shutdown keeps `status = 'running'`: `interrupted()` finds it,
`load()` gives back its spec and last checkpoint, and the host resumes it
with `Kernel.run(..., resume=checkpoint)` under the same run_id.

Table::

    checkpoints(run_id PK, spec JSON, state JSON, steps, tool_calls,
                input_tokens, output_tokens, thinking_tokens, cost_usd,
                status, error, host, pid, created_at, updated_at)

Each `save` is one short write transaction, durable when it returns.

Secrets never reach the table: the spec, every saved state and a failure's
error are redacted (`batteries.redact`) before they are written, so a
resumed run sees markers where it had secrets, and a host that must give
them back (the CLI's secret `--context` values) does so when it resumes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from batteries.redact import Redactor
from kernel import Checkpoint, Usage

_DDL = """CREATE TABLE IF NOT EXISTS checkpoints (
    run_id VARCHAR PRIMARY KEY,
    spec JSON NOT NULL,
    state JSON,
    steps BIGINT NOT NULL DEFAULT 0,
    tool_calls BIGINT NOT NULL DEFAULT 0,
    input_tokens BIGINT NOT NULL DEFAULT 0,
    output_tokens BIGINT NOT NULL DEFAULT 0,
    thinking_tokens BIGINT NOT NULL DEFAULT 0,
    cost_usd DOUBLE NOT NULL DEFAULT 0,
    status VARCHAR NOT NULL,
    error VARCHAR,
    host VARCHAR,
    pid BIGINT,
    created_at TIMESTAMP NOT NULL,
    updated_at TIMESTAMP NOT NULL)"""


@dataclass(slots=True, frozen=True)
class SavedRun:
    """A registered run: its spec, its last checkpoint, and who ran it."""

    run_id: str
    spec: dict[str, Any]
    checkpoint: Checkpoint
    status: str
    host: str
    pid: int
    updated_at: dt.datetime

    @property
    def process_alive(self) -> bool:
        """True if the process that ran it is still alive on this host."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class DuckDBCheckpointer:
    """The Checkpointer port on a DuckDB file (usually the audit database).

    Args:
        path: The database file.
        redactor: What replaces secrets in specs, states and errors (None:
            `Redactor.from_env()`).
    """

    def __init__(self, path: str | Path, *, redactor: Redactor | None = None) -> None:
        from batteries.audit import Store

        self.store = Store(path)
        self.redactor = Redactor.from_env() if redactor is None else redactor

    # --------------------------------------------------------------- the port

    async def register(self, run_id: str, spec: dict[str, Any]) -> None:
        """Record a run's spec, redacted, before it starts (status `running`, this host and pid)."""
        await trio.to_thread.run_sync(self._register, run_id, self.redactor.value(spec))

    async def save(self, checkpoint: Checkpoint) -> None:
        """Persist the run's resumable state, redacted; durable when this returns."""
        state = self.redactor.value(checkpoint.state)
        await trio.to_thread.run_sync(self._save, dataclasses.replace(checkpoint, state=state))

    async def complete(self, run_id: str) -> None:
        """The run finished: mark it completed and drop its state."""
        await trio.to_thread.run_sync(self._finish, run_id, "completed", None)

    async def fail(self, run_id: str, error: str) -> None:
        """The run failed for good: mark it failed, so it is not resumed."""
        await trio.to_thread.run_sync(self._finish, run_id, "failed",
                                      self.redactor.text(error))

    # ---------------------------------------------------------------- blocking

    def _register(self, run_id: str, spec: dict[str, Any]) -> None:
        now = _now()
        with self.store.session(write=True) as con:
            con.execute(_DDL)
            exists = con.execute("SELECT count(*) FROM checkpoints WHERE run_id = ?",
                                 [run_id]).fetchone()
            if exists and exists[0]:
                # A resumption: the row (and its state) stays; it is ours now.
                con.execute("UPDATE checkpoints SET status = 'running', host = ?, pid = ?, "
                            "updated_at = ? WHERE run_id = ?",
                            [socket.gethostname(), os.getpid(), now, run_id])
            else:
                con.execute(
                    "INSERT INTO checkpoints (run_id, spec, status, host, pid, created_at, "
                    "updated_at) VALUES (?, ?, 'running', ?, ?, ?, ?)",
                    [run_id, json.dumps(spec, default=str), socket.gethostname(), os.getpid(),
                     now, now])

    def _save(self, cp: Checkpoint) -> None:
        u = cp.usage
        with self.store.session(write=True) as con:
            con.execute(_DDL)
            con.execute(
                "UPDATE checkpoints SET state = ?, steps = ?, tool_calls = ?, input_tokens = ?, "
                "output_tokens = ?, thinking_tokens = ?, cost_usd = ?, updated_at = ? "
                "WHERE run_id = ?",
                [json.dumps(cp.state, default=str), cp.steps, cp.tool_calls, u.input_tokens,
                 u.output_tokens, u.thinking_tokens, u.cost_usd, _now(), cp.run_id])

    def _finish(self, run_id: str, status: str, error: str | None) -> None:
        with self.store.session(write=True) as con:
            con.execute(_DDL)
            con.execute("UPDATE checkpoints SET status = ?, error = ?, state = NULL, "
                        "updated_at = ? WHERE run_id = ?", [status, error, _now(), run_id])

    def load(self, run_id: str) -> SavedRun | None:
        """The registered run `run_id` (any status), or None."""
        rows = self._select("WHERE run_id = ?", [run_id])
        return rows[0] if rows else None

    def find(self, prefix: str) -> list[SavedRun]:
        """Registered runs whose id starts with `prefix` (any status)."""
        return self._select("WHERE starts_with(run_id, ?)", [prefix])

    def interrupted(self) -> list[SavedRun]:
        """Runs still marked running whose process is gone: the ones to resume."""
        return [r for r in self._select("WHERE status = 'running'", []) if not r.process_alive]

    def mark_failed(self, run_id: str, error: str) -> None:
        """Give up on a run (e.g. its agent cannot resume)."""
        self._finish(run_id, "failed", self.redactor.text(error))

    def _select(self, where: str, params: list[Any]) -> list[SavedRun]:
        if not self.store.path.exists():
            return []
        with self.store.session(write=False) as con:
            found = con.execute(
                "SELECT count(*) FROM duckdb_tables() WHERE database_name = current_database() "
                "AND table_name = 'checkpoints'").fetchone()
            if not found or not found[0]:
                return []
            rows = con.execute(
                "SELECT run_id, spec, state, steps, tool_calls, input_tokens, output_tokens, "
                "thinking_tokens, cost_usd, status, host, pid, updated_at FROM checkpoints "
                f"{where} ORDER BY created_at", params).fetchall()
        out = []
        for (run_id, spec, state, steps, tools, tin, tout, tthink, cost, status, host, pid,
             updated) in rows:
            cp = Checkpoint(run_id, int(steps), None if state is None else json.loads(state),
                            Usage(int(tin), int(tout), int(tthink), float(cost)), int(tools))
            out.append(SavedRun(run_id, json.loads(spec), cp, status, host or "", int(pid or 0),
                                updated))
        return out


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)
