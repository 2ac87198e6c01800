"""What a batch left in its journal as text, for tests that look for secrets there."""

from __future__ import annotations

import sqlite3
from pathlib import Path

#: Where a run's spec, name or audit payloads are stored.
PLACES = (("batch_tasks", "spec"), ("checkpoints", "spec"), ("events", "payload"),
          ("runs", "name"))


def stored_texts(journal: Path | str) -> list[str]:
    """Every stored spec, event payload and run name in `journal`, as text."""
    con = sqlite3.connect(journal)
    try:
        return [str(v) for table, col in PLACES
                for (v,) in con.execute(f"SELECT {col} FROM {table}")]
    finally:
        con.close()
