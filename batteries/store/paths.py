"""Where the journal lives: beside the analysts' DuckDB file."""

from __future__ import annotations

import os
from pathlib import Path


def journal_path(db: str | os.PathLike[str]) -> Path:
    """The journal that feeds the analysts' file `db`.

    `kernel.duckdb` -> `kernel.duckdb.journal` (plus SQLite's `-wal` and
    `-shm` files beside it while in use).
    """
    p = Path(db).expanduser()
    return p.with_name(p.name + ".journal")
