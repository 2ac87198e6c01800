"""The storage the batteries share: runs, events, checkpoints, budgets and recovery leases.

    async with Journal.open("runs.duckdb") as journal:   # writes runs.duckdb.journal
        ports = Ports(audit=JournalAudit(journal), budget=JournalBudget(journal),
                      checkpointer=JournalCheckpointer(journal))

`RunStore` is the interface (blocking, thread-safe; `SQLiteStore` is the
embedded implementation, `PostgresStore` the one a fleet shares, chosen with
`--store postgresql://...` / `$KERNEL_STORE`: see `open_store`), `Journal` its
trio side that buffers audit rows and deferred operations and writes them
with the next transaction. The analysts' DuckDB file is fed from the store
(`batteries.audit.sync`).

`PostgresStore` and `Journal` are imported lazily (`from batteries.store
import PostgresStore` works; `import batteries.store` imports neither psycopg
nor trio).
"""

from typing import TYPE_CHECKING, Any

from ._protocol import BatchStore as BatchStore
from ._protocol import RunStore as RunStore
from ._select import STORE_ENV as STORE_ENV
from ._select import choose as choose
from ._select import open_store as open_store
from ._select import store_url as store_url
from ._sqlite import JOURNAL_VERSION as JOURNAL_VERSION
from ._sqlite import SQLiteStore as SQLiteStore
from ._sqlite import StoreStats as StoreStats
from ._sqlite import lock_timeout_from_env as lock_timeout_from_env
from ._types import Batch as Batch
from ._types import BatchRow as BatchRow
from ._types import BatchTask as BatchTask
from ._types import CallerBudget as CallerBudget
from ._types import ClaimBatch as ClaimBatch
from ._types import ClaimRun as ClaimRun
from ._types import CreateBatch as CreateBatch
from ._types import FinishBatch as FinishBatch
from ._types import FinishRun as FinishRun
from ._types import LoseRun as LoseRun
from ._types import MarkDelivery as MarkDelivery
from ._types import Op as Op
from ._types import Owner as Owner
from ._types import RegisterRun as RegisterRun
from ._types import ReleaseRun as ReleaseRun
from ._types import RemoveBudget as RemoveBudget
from ._types import Reservation as Reservation
from ._types import ReserveBudget as ReserveBudget
from ._types import SaveCheckpoint as SaveCheckpoint
from ._types import SavedRun as SavedRun
from ._types import SetBudget as SetBudget
from ._types import SettleBudget as SettleBudget
from ._types import StoreBusyError as StoreBusyError
from ._types import StoreError as StoreError
from ._types import TaskRow as TaskRow
from ._types import window_label as window_label
from .paths import journal_path as journal_path

if TYPE_CHECKING:
    from ._journal import Journal as Journal
    from ._postgres import PostgresStore as PostgresStore


def __getattr__(name: str) -> Any:
    if name == "Journal":  # trio only when asked for (not by the analysts' commands)
        from ._journal import Journal

        return Journal
    if name == "PostgresStore":  # psycopg only when asked for
        from ._postgres import PostgresStore

        return PostgresStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "JOURNAL_VERSION",
    "STORE_ENV",
    "Batch",
    "BatchRow",
    "BatchStore",
    "BatchTask",
    "CallerBudget",
    "ClaimBatch",
    "ClaimRun",
    "CreateBatch",
    "FinishBatch",
    "FinishRun",
    "Journal",
    "LoseRun",
    "MarkDelivery",
    "Op",
    "Owner",
    "PostgresStore",
    "RegisterRun",
    "ReleaseRun",
    "RemoveBudget",
    "Reservation",
    "ReserveBudget",
    "RunStore",
    "SQLiteStore",
    "SaveCheckpoint",
    "SavedRun",
    "SetBudget",
    "SettleBudget",
    "StoreBusyError",
    "StoreError",
    "StoreStats",
    "TaskRow",
    "choose",
    "journal_path",
    "lock_timeout_from_env",
    "open_store",
    "store_url",
    "window_label",
]
