"""Checkpoints for crash recovery, in the journal: one small transaction per save.

A host registers each run with a *run spec* before it starts: a JSON
document saying how to rebuild the agent (which kind, its config and
inputs, the limits). The kernel then saves the agent's resumable state
after every step (one `BEGIN IMMEDIATE` transaction of well under a
millisecond, which also carries the run's audit events buffered so far;
saves of runs that finish a step together share one transaction, see
`Journal.transact`), and the row is marked `completed` or `failed` at the end.

The row is also the run's **lease**: the process holding it (host, pid and
the pid's start time, so a recycled pid is not mistaken for the owner) and
a heartbeat refreshed by every save. A run whose holder is provably gone
(SIGKILL, a crash, a reboot, or a shutdown that left it `running`) is
*interrupted*: `interrupted()` lists it, `claim()` takes its lease in one
transaction that refuses while the holder may be alive, so two recoverers
never resume the same run; the host then resumes it with
`Kernel.run(..., resume=checkpoint)` under the same run_id.

Table (in the journal; mirrored into the analysts' file by `sync`)::

    checkpoints(run_id PK, spec, state, steps, tool_calls, input_tokens,
                output_tokens, thinking_tokens, cost_usd, status, error,
                host, pid, pid_start, heartbeat_at, created_at, updated_at)

Secrets never reach the table: the spec, every saved state and a failure's
error are redacted (`batteries.redact`) before they are written, so a
resumed run sees markers where it had secrets, and a host that must give
them back (the CLI's secret `--context` values) does so when it resumes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from batteries.redact import Redactor
from kernel import Checkpoint, RunSpec

from .store import (
    ClaimRun,
    FinishRun,
    Journal,
    LoseRun,
    Owner,
    RegisterRun,
    ReleaseRun,
    SaveCheckpoint,
    SavedRun,
    StoreError,
)

__all__ = ["DuckDBCheckpointer", "JournalCheckpointer", "SavedRun", "stored_spec"]


class JournalCheckpointer:
    """The Checkpointer port on the journal (an observer: failures are reported, not fatal).

    Args:
        journal: A `Journal` shared with the other batteries (registration
            and completion then ride along with the run's other
            transactions), or the path of the analysts' file, whose journal
            this checkpointer opens itself (every call is then its own
            transaction).
        redactor: What replaces secrets in specs, states and errors (None:
            `Redactor.from_env()`).
    """

    def __init__(self, journal: Journal | str | os.PathLike[str], *,
                 redactor: Redactor | None = None) -> None:
        self.journal = journal if isinstance(journal, Journal) else Journal(journal)
        self.store = self.journal.store
        self.owner = Owner.me()
        self.redactor = Redactor.from_env() if redactor is None else redactor
        self._specs: dict[str, dict[str, Any]] = {}
        self._unsaveable: set[str] = set()  # runs marked failed for a state that is not JSON

    def __repr__(self) -> str:
        return f"JournalCheckpointer({str(self.store.path)!r})"

    # --------------------------------------------------------------- the port

    async def register(self, run_id: str, spec: RunSpec | Mapping[str, Any], *,
                       redacted: bool = False) -> None:
        """Record a run's spec, redacted, before it starts (status `running`, held by us).

        A `RunSpec` is stored as `stored_spec` makes it (versioned, secrets
        out and listed); a plain mapping is stored redacted as it is, or as
        given when `redacted` says the host already redacted it with this
        checkpointer's redactor (a batch does, once per task, when it stores
        the batch). With a shared, open journal the row is written by the
        run's first transaction (its budget reservation, or its first save).
        """
        if isinstance(spec, RunSpec):
            stored = stored_spec(spec, self.redactor)
        else:
            stored = dict(spec) if redacted else self.redactor.value(dict(spec))
        self._specs[run_id] = stored
        await self.journal.later(RegisterRun(run_id, stored, self.owner))

    async def save(self, checkpoint: Checkpoint) -> None:
        """Persist the run's resumable state, redacted; durable when this returns.

        Raises:
            StoreError: The run was never registered (with this checkpointer or
                before), so there is no spec to resume it from; or the journal
                cannot be written; or the state is not JSON data (the run is then
                marked failed: it will not be resumed from an older save).
        """
        cp = checkpoint
        try:
            encoded = _dumps(cp.state)
        except (TypeError, ValueError) as exc:  # a set, bytes, a cycle: not JSON
            # Stored as text (as it once was), a set would come back a string and the
            # resumed agent would go on with the wrong type; an older save would run
            # its steps again. So the run is marked not resumable, and the error says why.
            why = f"its resumable state cannot be saved as JSON: {exc}"
            if cp.run_id not in self._unsaveable:  # once a run (each step saves)
                self._unsaveable.add(cp.run_id)
                await self.journal.transact([FinishRun(cp.run_id, "failed",
                                                       self.redactor.text(why))])
            raise StoreError(f"run {cp.run_id}: {why}; it will not be resumed") from None
        # Encoded once, then redacted as JSON text (one pass over one string, as the
        # audit does with payloads); the store writes the text as given.
        state = self.redactor.json_text(encoded)
        await self.journal.transact([SaveCheckpoint(
            Checkpoint(cp.run_id, cp.steps, None, cp.usage, cp.tool_calls), self.owner,
            self._specs.get(cp.run_id), state)])

    async def complete(self, run_id: str) -> None:
        """The run finished: mark it completed and drop its state (with the next transaction)."""
        self._specs.pop(run_id, None)
        self._unsaveable.discard(run_id)
        await self.journal.later(FinishRun(run_id, "completed"))

    async def fail(self, run_id: str, error: str) -> None:
        """The run failed for good: mark it failed, so it is not resumed."""
        self._specs.pop(run_id, None)
        self._unsaveable.discard(run_id)
        await self.journal.later(FinishRun(run_id, "failed", self.redactor.text(error)))

    # ---------------------------------------------------------------- blocking

    def load(self, run_id: str) -> SavedRun | None:
        """The registered run `run_id` (any status), or None.

        Raises:
            StoreError: Its checkpoint row is damaged (see `_readable`).
        """
        what = f"the checkpoint of run {run_id!r}"
        with _readable(what):
            rows = self.store.saved_runs(run_id=run_id, damaged=True)
        if rows and rows[0].damaged is not None:
            raise StoreError(damaged_text(what, rows[0].damaged))
        return rows[0] if rows else None

    def find(self, prefix: str) -> list[SavedRun]:
        """Registered runs whose id starts with `prefix` (any status); a row that cannot be
        read comes back flagged (`SavedRun.damaged`), so one damaged row does not hide
        the others.

        Raises:
            StoreError: The checkpoints cannot be read at all.
        """
        with _readable("a checkpoint" + (f" of a run {prefix!r}..." if prefix else "")):
            return self.store.saved_runs(prefix=prefix, damaged=True)

    def interrupted(self) -> list[SavedRun]:
        """Runs still marked running whose holder is provably gone: the ones to resume
        (the store's rule: see `RunStore.interrupted`). A run whose row cannot be read
        comes back flagged (`SavedRun.damaged`): never resumable as it is, and never
        hiding the others.

        Raises:
            StoreError: The checkpoints cannot be read at all.
        """
        with _readable("an interrupted run's checkpoint"):
            return self.store.interrupted()

    def claim(self, run_id: str) -> bool:
        """Take the lease of an interrupted run for this process; False if someone holds it."""
        [ok] = self.store.commit(None, [ClaimRun(run_id, self.owner)])
        return bool(ok)

    def release(self, run_id: str) -> None:
        """Give back a claimed run without finishing it (the next recoverer may take it)."""
        self.store.commit(None, [ReleaseRun(run_id, self.owner)])

    def mark_failed(self, run_id: str, error: str) -> None:
        """Give up on a run (e.g. its agent cannot resume)."""
        self.store.commit(None, [FinishRun(run_id, "failed", self.redactor.text(error))])

    def mark_lost(self, saved: SavedRun, why: str) -> None:
        """Give up on a run whose supervisor is gone: checkpoint failed, run row `lost`.

        One transaction. A run killed before its first audit write gets a
        row made from its spec's RunInfo, so `kernel runs` shows it.
        """
        why = self.redactor.text(why)
        info = saved.spec.get("info") if isinstance(saved.spec, dict) else None
        started = saved.updated_at
        self.store.commit(None, [
            FinishRun(saved.run_id, "failed", f"not resumable: {why}"),
            LoseRun(saved.run_id, f"supervisor gone, not resumable: {why}",
                    info if isinstance(info, dict) else None,
                    None if started is None else int(started.timestamp() * 1e6))])


def damaged_text(what: str, why: str) -> str:
    """One line saying a checkpoint row cannot be read (`SavedRun.damaged` says why)."""
    return f"{what} is damaged and cannot be read ({why})"


@contextmanager
def _readable(what: str) -> Iterator[None]:
    """A checkpoint row whose spec or state is not JSON (a damaged disk, a hand edit, a
    write cut short) as one `StoreError` naming it, instead of a decoder's traceback,
    where a store raises for it: `kernel resume` prints it as one line and exits 2."""
    try:
        yield
    except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
        raise StoreError(damaged_text(what, f"{type(exc).__name__}: "
                                            f"{' '.join(str(exc).split())}")) from exc


def _default(value: Any) -> Any:
    """What JSON cannot encode directly: a mapping as an object; anything else is refused
    (`snapshot()` returns JSON data: dicts, lists, strings, numbers, booleans, None)."""
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"a {type(value).__name__} is not JSON data (snapshot() must return "
                    "dicts, lists, strings, numbers, booleans and None)")


#: A saved state as the journal stores it (the stores' own encoding: `ensure_ascii=False`).
_dumps = json.JSONEncoder(default=_default, ensure_ascii=False).encode


def stored_spec(spec: RunSpec, redactor: Redactor) -> dict[str, Any]:
    """A run spec as the checkpoint stores it: secrets replaced, and listed under `redacted`.

    Secret-named context keys lose their values whole (whatever their
    length); everything else is redacted like the audit. `redacted` holds the
    key path of every value that changed outside `info` (a recorded
    description, never used to rebuild the agent): what a resume must be
    given again (`batteries.runner.Secrets`).
    """
    plain = spec.to_dict()
    plain["redacted"] = []
    out: dict[str, Any] = redactor.value(plain)
    agent_ctx = plain["agent"].get("context")
    if isinstance(agent_ctx, dict):
        out["agent"]["context"] = redactor.context(agent_ctx)
    out["info"]["inputs"] = redactor.inputs(plain["info"].get("inputs") or {})
    out["redacted"] = [p for p in _changed(plain, out, []) if p[0] != "info"]
    return out


def _changed(before: Any, after: Any, path: list[Any]) -> list[list[Any]]:
    """Key paths where `after` differs from `before` (same shape, strings replaced)."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [p for k, v in before.items() for p in _changed(v, after.get(k), [*path, k])]
    if isinstance(before, (list, tuple)) and isinstance(after, (list, tuple)):
        return [p for i, (a, b) in enumerate(zip(before, after, strict=False))
                for p in _changed(a, b, [*path, i])]
    return [] if before == after else [path]


#: The checkpointer's former name (it lived in the DuckDB file); kept for hosts.
DuckDBCheckpointer = JournalCheckpointer
