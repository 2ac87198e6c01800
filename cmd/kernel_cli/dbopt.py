"""The one `--db` option wording, showing the path in effect.

Every command that reads or writes the audit takes `--db PATH`; its help says
the same thing everywhere and names the file it would use right now
(`$KERNEL_DB`, else `kernel.duckdb` in the user data directory, the same
rule as `batteries.audit.resolve_db_path`, which costs too much to import
for `--help`; tests/cmd/test_cli_vocabulary.py checks they agree).
"""

from __future__ import annotations

import os
from pathlib import Path


def default_path() -> str:
    """The audit database used when no --db is given (not required to exist)."""
    env = os.environ.get("KERNEL_DB", "")
    if env:
        return str(Path(env).expanduser())
    from platformdirs import user_data_dir

    return str(Path(user_data_dir("kernel")) / "kernel.duckdb")


def db_help() -> str:
    """The --db help text."""
    source = "$KERNEL_DB" if os.environ.get("KERNEL_DB") else "the user data dir"
    return (f"The audit database (its journal is the .journal file beside it). "
            f"[default: {default_path()}, from {source}]")


#: For `typer.Option(None, "--db", metavar="PATH", help=DB_HELP)`.
DB_HELP = db_help()
