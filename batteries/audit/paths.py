"""Where the audit database lives: `--db`, else `$KERNEL_DB`, else the user data dir."""

from __future__ import annotations

import os
from pathlib import Path

#: The environment variable naming the audit database file.
DB_ENV = "KERNEL_DB"


def default_db_path() -> Path:
    """The per-user default, e.g. `~/.local/share/kernel/kernel.duckdb` on Linux."""
    from platformdirs import user_data_dir

    return Path(user_data_dir("kernel")) / "kernel.duckdb"


def resolve_db_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The database file to use: `explicit` if given, else `$KERNEL_DB`, else the default.

    `~` is expanded; the path is not required to exist.
    """
    if explicit is not None and str(explicit):
        return Path(explicit).expanduser()
    env = os.environ.get(DB_ENV, "")
    if env:
        return Path(env).expanduser()
    return default_db_path()
