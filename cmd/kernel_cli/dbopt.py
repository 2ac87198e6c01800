"""The one `--db` and `--store` option wording, showing what is in effect.

Every command that reads or writes the audit takes `--db PATH`; its help says
the same thing everywhere and names the file it would use right now
(`$KERNEL_DB`, else `kernel.duckdb` in the user data directory, the same
rule as `batteries.audit.resolve_db_path`, which costs too much to import
for `--help`; tests/cmd/test_cli_vocabulary.py checks they agree).

Every command that touches storage also takes `--store URL`
(`STORE_OPTION`): a PostgreSQL server shared by a fleet instead of the
journal beside `--db`. The option's callback makes it this process's store
(`batteries.store.choose`) before the command runs, so the command's code
is the same for both stores.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer


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


def _choose_store(value: str | None) -> str | None:
    """`--store URL`: make it this process's store (a usage error, exit 2, if not a URL)."""
    if value is None:
        return None
    if not value.strip().startswith(("postgresql://", "postgres://")):
        raise typer.BadParameter("must be a postgresql:// URL (e.g. "
                                 "postgresql://user@host:5432/db)")
    from batteries.store import choose

    choose(value)
    return value


STORE_HELP = ("Share runs, checkpoints, leases and budgets with a fleet through this "
              "PostgreSQL server instead of the journal; the --db file is fed from it. "
              "[default: $KERNEL_STORE, else the journal]")

def store_option(panel: str | None = None) -> Any:
    """`--store URL` for a command that touches storage (in help panel `panel`, if given)."""
    return typer.Option(None, "--store", metavar="URL", help=STORE_HELP, callback=_choose_store,
                        show_default=False, rich_help_panel=panel)


#: For `store: str | None = STORE_OPTION` on every command that touches storage.
STORE_OPTION: Any = store_option()
