"""The DuckDB audit battery: runs and events in one file analysts query with SQL.

    async with DuckDBAudit.open("runs.duckdb") as audit:
        result = await Kernel(Ports(audit=audit)).run(agent, info)

duckdb and pyarrow are imported only when a database is actually touched.
"""

from ._audit import DuckDBAudit as DuckDBAudit
from ._recorder import DuckDBRecorder as DuckDBRecorder
from ._schema import SCHEMA_VERSION as SCHEMA_VERSION
from ._store import AuditBusyError as AuditBusyError
from ._store import Store as Store
from ._store import lock_timeout_from_env as lock_timeout_from_env
from .paths import default_db_path as default_db_path
from .paths import resolve_db_path as resolve_db_path

__all__ = [
    "SCHEMA_VERSION",
    "AuditBusyError",
    "DuckDBAudit",
    "DuckDBRecorder",
    "Store",
    "default_db_path",
    "lock_timeout_from_env",
    "resolve_db_path",
]
