"""`RunStore`: the storage interface the audit, budget and checkpoint batteries share.

Two implementations: `SQLiteStore` (embedded, one machine) and
`PostgresStore` (a server shared by a fleet); `open_store` picks one.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

from ._types import Batch, BatchRow, CallerBudget, Op, SavedRun, TaskRow


class RunStore(Protocol):
    """Runs, events, checkpoints, budgets and recovery leases, in small transactions.

    **Protocol:** every method blocks (callers use worker threads) and must
    be safe to call from several threads of one process and from several
    processes at once. A reader never blocks a writer. Errors are
    `StoreError` (`StoreBusyError` when a write lock stayed taken past the
    lock timeout); a failed `commit` wrote nothing.

    Attributes:
        legacy: An old analysts' file whose budgets and checkpoints were carried over.
    """

    legacy: Path | None

    @property
    def path(self) -> Path | str:
        """Where the store lives, for messages (a URL without its password for a server)."""

    def commit(self, batch: Batch | None, ops: Sequence[Op] = (), *,
               wait: bool = True) -> list[Any]:
        """One transaction: the audit `batch` (events, new runs, closes), then each op in
        order; the ops' results, in order (a refused op's `StoreError` is its result and
        undoes that op alone). Sets each new recorder's `base` after commit. With
        `wait=False`, `WouldBlock` (nothing written) unless it can run at once without
        waiting for a lock or the network.

        Batch operations (`kernel batch`): `CreateBatch` (the batch and every task with
        the run id it becomes; `StoreError` if the id is taken), `ClaimBatch` (True if
        the batch's lease is now the owner's: refused while its holder may be alive,
        like `ClaimRun`), `FinishBatch` (status `finished`, by its holder only)."""

    def budget(self, caller_id: str) -> CallerBudget | None:
        """The budget that applies to the caller, with its spend in the window; None if none."""

    def budgets(self) -> list[CallerBudget]:
        """Every budget with its own caller's spend."""

    def saved_runs(self, *, run_id: str | None = None, prefix: str | None = None,
                   running: bool = False, damaged: bool = False) -> list[SavedRun]:
        """Registered runs (by id, by id prefix, or all still marked running). A row whose
        spec or state is not JSON raises `ValueError`, or with `damaged` comes back
        flagged (`SavedRun.damaged`)."""

    def interrupted(self) -> list[SavedRun]:
        """Runs still marked `running` whose holder is provably gone by this store's rule
        (what `kernel recover` resumes; a claim re-checks it in its transaction). A row
        that cannot be read comes back flagged (`SavedRun.damaged`), never raising for
        the others."""

    def payloads(self, run_id: str, kind: str) -> list[str]:
        """The payloads of one run's events of one kind, in seq order (what recover reads)."""

    def changes(self, events_after: int, rev_after: int) -> AbstractContextManager[Any]:
        """A consistent read of what changed since a sync cursor, for the analysts' file."""

    def purge(self, before_us: int) -> tuple[int, int]:
        """Delete closed runs that ended before the time; (runs, events) deleted."""

    def exists(self) -> bool:
        """True if the store has been created."""

    def close(self) -> None:
        """Release this process's connection."""


class SpillStore(RunStore, Protocol):
    """A `RunStore` that keeps what a process could not commit at exit (`Journal` uses it
    when the store has `spill`; both stores here do).

    **Protocol:** `spill` writes the rows and operations to durable local storage and
    returns where; the store's next writer (in any process that can see it) commits
    them exactly once before its own rows.
    """

    def spill(self, batch: Batch | None, ops: Sequence[Op]) -> Path:
        """Keep `batch` and `ops` for the next writer; the spill file's path.

        Raises:
            OSError: They cannot be kept (nothing was).
        """


class BatchStore(RunStore, Protocol):
    """A `RunStore` that also keeps batches (`kernel batch`, `batteries.batch`).

    **Protocol:** as `RunStore`. Its `commit` takes the batch operations
    (`CreateBatch`, `ClaimBatch`, `FinishBatch`); these reads list what they
    wrote. A store that is not a `BatchStore` runs no batches (the runner
    says so in one line); every store is expected to become one.
    """

    def batches(self, *, batch_id: str | None = None, prefix: str | None = None,
                limit: int | None = None) -> list[BatchRow]:
        """Batches, newest first (by id, by id prefix, or all), tasks counted by run status
        (`pending`: not started; `running`: started, not ended)."""

    def batch_tasks(self, batch_id: str) -> list[TaskRow]:
        """A batch's tasks in file order, each with its run's status and checkpoint."""
