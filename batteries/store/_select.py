"""Which `RunStore` a process writes: the embedded journal, or a PostgreSQL server.

The rule, first match wins:

1. a store chosen in this process (`choose(url)`: what the CLI's `--store URL` does);
2. `$KERNEL_STORE`, a `postgresql://` URL;
3. the embedded journal beside the analysts' file (`SQLiteStore`).

psycopg is imported only when a PostgreSQL store is chosen (its URL is parsed
then, so a bad one is a `ConfigError` before anything runs) or opened, so the
embedded default costs nothing at start-up.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from kernel import ConfigError

from .paths import journal_path

if TYPE_CHECKING:
    from ._protocol import RunStore

#: Env var: the shared store's URL (`postgresql://...`); empty or unset: the embedded journal.
STORE_ENV = "KERNEL_STORE"

_chosen: str | None = None


def check_url(url: str, *, what: str = "--store") -> str:
    """`url` if it names a store this kernel can open.

    Raises:
        ConfigError: Anything but a `postgresql://` (or `postgres://`) URL, or one libpq
            would not take (`_postgres.check_url`: it does not parse, names no host and
            no database, a bad `sslmode`, ...); the message never holds the password.
    """
    from ._postgres import check_url as check_postgres_url
    from ._postgres import is_postgres_url

    url = url.strip()
    if not is_postgres_url(url):
        shown = url if "@" not in url else url.split("@", 1)[-1]
        raise ConfigError(f"{what} must be a postgresql:// URL (e.g. "
                          f"postgresql://user@host:5432/db), got {shown!r}")
    check_postgres_url(url, what)
    return url


def choose(url: str | None) -> None:
    """Make `url` this process's store (None: back to `$KERNEL_STORE` / the journal).

    Raises:
        ConfigError: Not a `postgresql://` URL.
    """
    global _chosen
    _chosen = None if url is None else check_url(url)


def store_url() -> str | None:
    """The shared store's URL in effect (chosen, else `$KERNEL_STORE`), or None (embedded).

    Raises:
        ConfigError: `$KERNEL_STORE` is set to something that is not a `postgresql://` URL.
    """
    if _chosen is not None:
        return _chosen
    raw = os.environ.get(STORE_ENV, "").strip()
    return check_url(raw, what=f"${STORE_ENV}") if raw else None


def open_store(db: str | os.PathLike[str] | None = None, *, url: str | None = None,
               lock_timeout: float | None = None) -> RunStore:
    """The store to write: PostgreSQL at `url` (or the one in effect), else the journal
    beside the analysts' file `db` (None: `$KERNEL_DB`, else the user data dir).

    Opening does no I/O.

    Raises:
        ConfigError: A bad URL, a bad `$KERNEL_AUDIT_LOCK_TIMEOUT` or lease setting, or
            psycopg missing for a PostgreSQL store.
    """
    url = check_url(url) if url is not None else store_url()
    if url is not None:
        from ._postgres import PostgresStore

        return PostgresStore(url, lock_timeout=lock_timeout)
    from batteries.audit.paths import resolve_db_path

    from ._sqlite import SQLiteStore

    analyst = resolve_db_path(db)
    return SQLiteStore(journal_path(analyst), legacy=analyst, lock_timeout=lock_timeout)
