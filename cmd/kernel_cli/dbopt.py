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


def _choose_store(ctx: typer.Context, value: str | None) -> str | None:
    """`--store URL`: make it this process's store (a usage error, exit 2, if not a URL).

    Then check the command's `--db` (or `$KERNEL_DB`) before the command runs
    (`check_db`): every command that touches storage has this option, and
    declares `--db` before it, so `--db` has been read by now unless `--store`
    came first on the command line (then the store is a server and `--db`
    is checked when used).
    """
    if value is not None:
        if not value.strip().startswith(("postgresql://", "postgres://")):
            raise typer.BadParameter("must be a postgresql:// URL (e.g. "
                                     "postgresql://user@host:5432/db)")
        from batteries.store import choose

        choose(value)
    if "db" in ctx.params and not ctx.params.get("no_audit"):
        check_db(ctx.params["db"])
    return value


def check_db(db: str | None) -> None:
    """Refuse, with one line and exit 2, a `--db` / `$KERNEL_DB` that cannot be the audit
    database (`batteries.audit.resolve_db_path`: a directory, a path ending in a slash, a
    file that is not a DuckDB database with no journal beside it), before anything runs."""
    import sys

    from batteries.audit.paths import check_db_path, resolve_db_path
    from batteries.store import store_url
    from kernel import ConfigError

    try:
        if store_url() is None:
            resolve_db_path(db)
        else:  # a shared server: no journal is made from the file, so its shape only
            check_db_path(db or default_path(), content=False)
    except ConfigError as exc:
        from .dberrors import error_prefix

        print(f"{error_prefix()} {exc}", file=sys.stderr)
        raise typer.Exit(2) from None


STORE_HELP = ("Share runs, checkpoints, leases and budgets with a fleet through this "
              "PostgreSQL server instead of the journal; the --db file is fed from it. "
              "[default: $KERNEL_STORE, else the journal]")

def store_option(panel: str | None = None) -> Any:
    """`--store URL` for a command that touches storage (in help panel `panel`, if given)."""
    return typer.Option(None, "--store", metavar="URL", help=STORE_HELP, callback=_choose_store,
                        show_default=False, rich_help_panel=panel)


#: For `store: str | None = STORE_OPTION` on every command that touches storage.
STORE_OPTION: Any = store_option()
