"""One line and exit 2, never a traceback, when the audit database itself is damaged.

A file that opens but has a corrupt block makes DuckDB (or SQLite) raise its
own error in the middle of a query. The commands that read the store wrap
themselves with `database_errors` (or the `guard_database` decorator) so that
error becomes `kernel <cmd>: error: audit database is damaged or unreadable: ...`
on stderr and exit status 2, like any other bad input.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import typer

F = TypeVar("F", bound=Callable[..., Any])

#: Exit status for a damaged or unreadable database.
EXIT_DAMAGED = 2


def error_prefix() -> str:
    """`kernel <command>: error:`, the one prefix every command's error line starts with."""
    try:
        from typer._click.globals import get_current_context

        return f"{get_current_context().command_path}: error:"
    except Exception:  # no command running (or typer's internals moved): the program name
        return "kernel: error:"


def is_database_error(exc: BaseException) -> bool:
    """True for an error raised by the database engine itself (DuckDB or SQLite)."""
    import sqlite3

    if isinstance(exc, sqlite3.Error):
        return True
    duckdb = sys.modules.get("duckdb")  # not loaded: it cannot have raised
    return duckdb is not None and isinstance(exc, duckdb.Error)


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).strip().splitlines()[:1]).strip()
    return text or type(exc).__name__


@contextmanager
def database_errors() -> Iterator[None]:
    """Turn a database engine's error in the `with` body into one line and exit 2."""
    try:
        yield
    except Exception as exc:
        if not is_database_error(exc):
            raise
        print(f"{error_prefix()} audit database is damaged or unreadable: {_first_line(exc)}",
              file=sys.stderr)
        raise typer.Exit(EXIT_DAMAGED) from None


def guard_database(command: F) -> F:
    """`command` with `database_errors` around it (the signature typer reads is kept)."""
    @functools.wraps(command)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        with database_errors():
            return command(*args, **kwargs)

    return guarded  # type: ignore[return-value]
