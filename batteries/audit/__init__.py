"""The audit battery: runs and events in the journal, read by analysts from a DuckDB file.

    async with JournalAudit.open("runs.duckdb") as audit:   # writes runs.duckdb.journal
        result = await Kernel(Ports(audit=audit)).run(agent, info)
    sync("runs.duckdb")                                      # analysts' file up to date

duckdb and pyarrow are imported only when the analysts' file is touched;
the recorders (`JournalAudit`, `DuckDBAudit`, `DuckDBRecorder`, `RecorderHost`:
trio and the redaction rules) only when asked for, so reading the audit does
not load them.
"""

from typing import TYPE_CHECKING, Any

from ._schema import SCHEMA_VERSION as SCHEMA_VERSION
from ._store import AuditBusyError as AuditBusyError
from ._store import Store as Store
from ._store import lock_timeout_from_env as lock_timeout_from_env
from ._sync import SyncReport as SyncReport
from ._sync import sync as sync
from .paths import default_db_path as default_db_path
from .paths import resolve_db_path as resolve_db_path

if TYPE_CHECKING:
    from ._audit import DuckDBAudit as DuckDBAudit
    from ._audit import JournalAudit as JournalAudit
    from ._recorder import DuckDBRecorder as DuckDBRecorder
    from ._recorder import RecorderHost as RecorderHost


def __getattr__(name: str) -> Any:
    if name in ("DuckDBAudit", "JournalAudit"):
        from . import _audit

        return getattr(_audit, name)
    if name in ("DuckDBRecorder", "RecorderHost"):
        from . import _recorder

        return getattr(_recorder, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SCHEMA_VERSION",
    "AuditBusyError",
    "DuckDBAudit",
    "DuckDBRecorder",
    "JournalAudit",
    "RecorderHost",
    "Store",
    "SyncReport",
    "default_db_path",
    "lock_timeout_from_env",
    "resolve_db_path",
    "sync",
]
