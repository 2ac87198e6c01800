"""`PostgresStore`: the `RunStore` on a PostgreSQL server, shared by every machine of a fleet.

Chosen with `kernel ... --store postgresql://USER@HOST:PORT/DB` or
`$KERNEL_STORE` (see `batteries.store.open_store`); needs the `postgres`
extra (psycopg 3), imported only when such a store is asked for.

The tables are the embedded journal's (`_sqlite.py`), in the schema `kernel`
of the database the URL names, with the same columns and units (times in
microseconds since the epoch), so the analysts' DuckDB file is fed from
either by the same code (`batteries.audit.sync`).

Transactions run side by side (there is no fleet-wide write lock: the
server's group commit shares fsyncs between them). What needs order takes
a lock of its own:

- a budget's check-and-reserve takes a transaction-level advisory lock
  keyed by the caller (`pg_advisory_xact_lock`), so it is atomic across the
  fleet; several callers in one transaction are locked in sorted order;
- a lease claim locks the run's checkpoint row (`SELECT ... FOR UPDATE`), so
  of two claimers the second sees the first's lease;
- the analysts' feed needs no order at all: every row carries the id of the
  transaction that last wrote it (`xid`, `rev`: `pg_current_xact_id()`),
  and a sync copies the rows whose id lies between its cursor and the
  oldest transaction still running when it started
  (`pg_snapshot_xmin`): every transaction below that one has finished, so
  a row committed late by a slow transaction is copied by the next sync,
  never skipped. (A transaction left open on the server holds the feed
  back until it ends, never loses a row.)

A lock is waited for at most the lock timeout (`$KERNEL_AUDIT_LOCK_TIMEOUT`,
default 10 s), then the write fails with `StoreBusyError`. Readers take no
lock. Timestamps the fleet compares (budget windows, heartbeats,
updated_at) come from the server's clock, so machines whose clocks
disagree still agree on a window and on a stale lease. Event times are the
writer's.

Leases (recovery): a registered run is held by an `Owner` (host, pid, the
pid's start time) and carries a heartbeat. While this process holds runs a
thread refreshes their heartbeats every quarter of the lease
(`$KERNEL_LEASE_SECONDS`, default 60). A claim takes a run over when its
holder is provably gone: on this host, its pid is gone or was recycled
(`Owner.gone`); on another host, its heartbeat is older than the lease by
the server's clock (a dead or partitioned machine). A partitioned holder
that is still alive goes on running (its writes fail and are reported as
port failures), so after a takeover that run may execute on both sides
until the partition ends: the lease must outlast the partitions a fleet
expects to survive.

An unreachable server is a `StoreError` on every call (never an empty
answer): the budget fails closed and the run is refused (exit 3). A write
(`commit`) first waits for it as it would for a taken lock, up to the lock
timeout, so a server restarting (`pg_ctl restart`, a failover) costs a pause,
not the rows: `StoreUnreachableError` is transient, like `StoreBusyError`.
What a process still cannot write as it exits is kept in a spill file on its
machine (`PostgresStore.spill`) and written, exactly once, by the next
process there that writes to this store.
A URL libpq would not take is refused when it is chosen (`check_url`: a
`ConfigError`, never an unreachable server).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kernel import ConfigError, Status

from ._sqlite import (
    BATCH_COLUMNS,
    BATCH_TASK_COLUMNS,
    BUDGET_COLUMNS,
    CHECKPOINT_COLUMNS,
    DEFAULT_CALLER,
    EVENT_COLUMNS,
    PURGE_BATCHES,
    PURGE_KEPT_RUNS,
    PURGE_TASKS,
    RUN_COLUMNS,
    SPEND_COLUMNS,
    SPILL_KEY,
    SPILL_TMP_STALE,
    SpillTaken,
    StoreStats,
    WouldBlock,
    _utc,
    batch_tasks_sql,
    delivery_marks,
    lock_timeout_from_env,
    read_spill,
    saved_rows,
    set_aside,
    spill_files,
    spill_keys_to_keep,
    spill_summary,
    spills_committed,
    still_there,
    task_rows,
    write_spill,
)
from ._types import (
    Batch,
    BatchRow,
    CallerBudget,
    ClaimBatch,
    ClaimRun,
    CreateBatch,
    FinishBatch,
    FinishRun,
    LoseRun,
    MarkDelivery,
    Op,
    Owner,
    RegisterRun,
    ReleaseRun,
    RemoveBudget,
    Reservation,
    ReserveBudget,
    SaveCheckpoint,
    SavedRun,
    SetBudget,
    SettleBudget,
    Spill,
    SpillError,
    StoreBusyError,
    StoreError,
    TaskRow,
    encode_spill,
)

_log = logging.getLogger("kernel.store")

#: Env var: seconds after which a holder on another host whose heartbeat stopped may be
#: taken over (default 60); heartbeats are sent every quarter of it.
LEASE_ENV = "KERNEL_LEASE_SECONDS"
DEFAULT_LEASE = 60.0

#: The schema (namespace) holding the kernel's tables in the database the URL names.
SCHEMA = "kernel"
#: The schema version this code writes (`kernel.meta` key `version`).
STORE_VERSION = 3
#: The namespace of the advisory locks (first key of the two-key form), "kern".
_LOCKS = 0x6B65726E
#: Second keys: creating/migrating the schema; a budget is locked by its caller's hash.
_MIGRATE_LOCK = 1

#: The server's clock, in microseconds since the epoch.
NOW = "(extract(epoch from clock_timestamp()) * 1000000)::bigint"

_V1 = (
    f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}",
    """CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BIGINT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS runs (
        run_id TEXT PRIMARY KEY, parent_run_id TEXT, subject_id TEXT, name TEXT,
        caller_id TEXT, channel_id TEXT, inputs TEXT, started_at BIGINT NOT NULL,
        ended_at BIGINT, status TEXT, output TEXT, error TEXT, steps BIGINT,
        tool_calls BIGINT, runtime_seconds DOUBLE PRECISION, input_tokens BIGINT,
        output_tokens BIGINT, thinking_tokens BIGINT, cost_usd DOUBLE PRECISION, host TEXT,
        pid BIGINT, reason TEXT, exit_code INTEGER, output_truncated INTEGER,
        last_seq BIGINT NOT NULL DEFAULT 0,
        rev BIGINT NOT NULL DEFAULT pg_current_xact_id()::text::bigint)""",
    "CREATE INDEX IF NOT EXISTS runs_rev ON runs (rev)",
    "CREATE INDEX IF NOT EXISTS runs_ended ON runs (ended_at)",
    """CREATE TABLE IF NOT EXISTS events (
        id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, run_id TEXT NOT NULL,
        seq INTEGER NOT NULL, ts BIGINT NOT NULL, kind TEXT NOT NULL, iteration INTEGER,
        name TEXT, duration_ms DOUBLE PRECISION, payload TEXT,
        xid BIGINT NOT NULL DEFAULT pg_current_xact_id()::text::bigint,
        UNIQUE (run_id, seq))""",
    "CREATE INDEX IF NOT EXISTS events_xid ON events (xid)",
    """CREATE TABLE IF NOT EXISTS checkpoints (
        run_id TEXT PRIMARY KEY, spec TEXT NOT NULL, state TEXT,
        steps BIGINT NOT NULL DEFAULT 0, tool_calls BIGINT NOT NULL DEFAULT 0,
        input_tokens BIGINT NOT NULL DEFAULT 0, output_tokens BIGINT NOT NULL DEFAULT 0,
        thinking_tokens BIGINT NOT NULL DEFAULT 0, cost_usd DOUBLE PRECISION NOT NULL DEFAULT 0,
        status TEXT NOT NULL, error TEXT, host TEXT, pid BIGINT, pid_start BIGINT,
        heartbeat_at BIGINT, created_at BIGINT NOT NULL, updated_at BIGINT NOT NULL,
        rev BIGINT NOT NULL DEFAULT pg_current_xact_id()::text::bigint)""",
    "CREATE INDEX IF NOT EXISTS checkpoints_status ON checkpoints (status)",
    "CREATE INDEX IF NOT EXISTS checkpoints_rev ON checkpoints (rev)",
    "CREATE INDEX IF NOT EXISTS checkpoints_holder ON checkpoints (host, pid)",
    """CREATE TABLE IF NOT EXISTS budgets (
        caller_id TEXT PRIMARY KEY, window_seconds DOUBLE PRECISION NOT NULL,
        max_runs BIGINT, max_runtime_seconds DOUBLE PRECISION, max_tokens BIGINT,
        max_cost_usd DOUBLE PRECISION, updated_at BIGINT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS budget_spend (
        id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY, caller_id TEXT NOT NULL,
        ts BIGINT NOT NULL, run_id TEXT, runtime_seconds DOUBLE PRECISION NOT NULL DEFAULT 0,
        tokens BIGINT NOT NULL DEFAULT 0, cost_usd DOUBLE PRECISION NOT NULL DEFAULT 0,
        settled INTEGER NOT NULL DEFAULT 0,
        rev BIGINT NOT NULL DEFAULT pg_current_xact_id()::text::bigint)""",
    "CREATE INDEX IF NOT EXISTS budget_spend_caller ON budget_spend (caller_id, ts)",
    "CREATE INDEX IF NOT EXISTS budget_spend_rev ON budget_spend (rev)",
)

# Batches (`kernel batch`): the journal's batches and batch_tasks; the batch row is its
# lease, with a heartbeat like a run's.
_V2 = (
    """CREATE TABLE IF NOT EXISTS batches (
        batch_id TEXT PRIMARY KEY, name TEXT, source TEXT, created_at BIGINT NOT NULL,
        ended_at BIGINT, status TEXT NOT NULL, tasks BIGINT NOT NULL,
        concurrency BIGINT NOT NULL, options TEXT, host TEXT, pid BIGINT, pid_start BIGINT,
        heartbeat_at BIGINT,
        rev BIGINT NOT NULL DEFAULT pg_current_xact_id()::text::bigint)""",
    "CREATE INDEX IF NOT EXISTS batches_rev ON batches (rev)",
    """CREATE TABLE IF NOT EXISTS batch_tasks (
        batch_id TEXT NOT NULL, idx INTEGER NOT NULL, task_id TEXT NOT NULL,
        run_id TEXT NOT NULL, spec TEXT NOT NULL,
        rev BIGINT NOT NULL DEFAULT pg_current_xact_id()::text::bigint,
        PRIMARY KEY (batch_id, idx), UNIQUE (batch_id, task_id))""",
    "CREATE INDEX IF NOT EXISTS batch_tasks_run ON batch_tasks (run_id)",
    "CREATE INDEX IF NOT EXISTS batch_tasks_rev ON batch_tasks (rev)",
)

#: Version 3: where each batch task's delivery stands (the journal's version 5).
_V3 = (
    "ALTER TABLE batch_tasks ADD COLUMN IF NOT EXISTS delivery TEXT",
    "ALTER TABLE batch_tasks ADD COLUMN IF NOT EXISTS delivery_error TEXT",
)

#: Every migration, in order (index + 1 = the version it brings). Append only.
MIGRATIONS: tuple[tuple[str, ...], ...] = (_V1, _V2, _V3)


class StoreUnreachableError(StoreBusyError):
    """The server could not be reached, or the connection to it was lost. Transient, like
    a busy journal: a write waits for the server as long as it would for a taken lock
    (see `PostgresStore.commit`), and the `Journal` keeps its buffered rows for the next
    transaction instead of giving up on them.

    `in_doubt` is True when the connection was lost while the transaction's COMMIT was
    in flight: it may have been committed, so the store does not run it again itself.
    """

    in_doubt = False


#: A write that finds the server unreachable tries again after this many seconds, the
#: pause doubling up to `RETRY_MAX`, until the lock timeout is spent: a server that is
#: restarting is waited for as a write lock is (`PostgresStore.commit`).
RETRY_FIRST = 0.05
RETRY_MAX = 1.0

#: SQLSTATEs of a server going away or not taking connections yet (besides class 08,
#: connection exceptions): admin_shutdown, crash_shutdown, cannot_connect_now.
_GONE_STATES = frozenset({"57P01", "57P02", "57P03"})

#: Connection options whose value libpq checks only when it connects (then the error
#: looks like an unreachable server): checked when the URL is chosen instead.
_CHOICES: dict[str, tuple[str, ...]] = {
    "sslmode": ("disable", "allow", "prefer", "require", "verify-ca", "verify-full"),
    "gssencmode": ("disable", "prefer", "require"),
    "channel_binding": ("disable", "prefer", "require"),
    "target_session_attrs": ("any", "read-write", "read-only", "primary", "standby",
                             "prefer-standby"),
    "load_balance_hosts": ("disable", "random"),
}


def is_postgres_url(value: str) -> bool:
    """True for a `postgresql://` (or `postgres://`) URL."""
    return value.startswith(("postgresql://", "postgres://"))


def shown_url(url: str) -> str:
    """`url` as typed, without its password and its query (which may hold one): for
    messages about a URL that may not even parse (`public_url` needs one that does)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "?"
    rest = rest.split("?", 1)[0].split("#", 1)[0]
    user, at, host = rest.rpartition("@")
    if at:
        rest = f"{user.split(':', 1)[0]}@{host}"
    return f"{scheme}://{rest}"


def _passwords(url: str) -> set[str]:
    """Every text of `url` that may be its password (as typed and percent-decoded)."""
    from urllib.parse import unquote

    rest = url.partition("://")[2]
    found: set[str] = set()
    for userinfo in (rest.partition("@")[0], rest.rpartition("@")[0]):
        if ":" in userinfo:
            found.add(userinfo.split(":", 1)[1])
    for part in rest.partition("?")[2].split("&"):
        key, _, value = part.partition("=")
        if key == "password":
            found.add(value)
    return {s for text in found for s in (text, unquote(text)) if s}


def check_url(url: str, what: str = "store URL") -> None:
    """Refuse a `postgresql://` URL libpq would not take, before anything connects.

    libpq parses the URL (`psycopg.conninfo.conninfo_to_dict`); a URL that names
    neither a host nor a database (`postgresql://`) and a value libpq checks only
    when it connects (`sslmode=bogus`, a port that is not a number) are refused
    too. Messages never hold the password. Without psycopg nothing is checked
    (`PostgresStore` says the extra is missing).

    Raises:
        ConfigError: What is wrong with it, in one line.
    """
    try:
        import psycopg
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:
        return
    shown = shown_url(url)
    try:
        params = conninfo_to_dict(url)
    except (psycopg.Error, ValueError) as exc:
        detail = " ".join(str(exc).replace(url, shown).split())
        if any(secret in detail for secret in _passwords(url) if len(secret) >= 3):
            detail = "libpq cannot parse it"
        raise ConfigError(f"{what} is not a valid PostgreSQL URL: {detail}") from None
    if not any(params.get(key) for key in ("host", "hostaddr", "dbname")):
        raise ConfigError(f"{what} names no host and no database: {shown!r} "
                          f"(e.g. postgresql://user@host:5432/db)")
    for key, allowed in _CHOICES.items():
        value = params.get(key)
        if value is not None and value not in allowed:
            raise ConfigError(f"{what}: {key} must be one of {', '.join(allowed)}, "
                              f"got {value!r} (in {shown})")
    for port in str(params.get("port") or "").split(","):
        if port.strip() and not (port.strip().isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"{what}: the port must be a number from 1 to 65535, "
                              f"got {port.strip()!r} (in {shown})")
    timeout = str(params.get("connect_timeout") or "").strip()
    if timeout and not timeout.lstrip("-").isdigit():
        raise ConfigError(f"{what}: connect_timeout must be a whole number of seconds, "
                          f"got {timeout!r} (in {shown})")


def lease_from_env() -> float:
    """`$KERNEL_LEASE_SECONDS` (default 60).

    Raises:
        ConfigError: Not a finite number > 0.
    """
    raw = os.environ.get(LEASE_ENV, "").strip()
    if not raw:
        return DEFAULT_LEASE
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{LEASE_ENV} must be a number of seconds, got {raw!r}") from None
    if not 0 < value < float("inf"):
        raise ConfigError(f"{LEASE_ENV} must be a finite number > 0, got {raw!r}")
    return value


def public_url(url: str) -> str:
    """The URL without its password (for messages and the analysts' file)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "postgresql://?"
    user = f"{parts.username}@" if parts.username else ""
    where = f"[{host}]" if ":" in host else host
    return f"postgresql://{user}{where}{f':{port}' if port else ''}{parts.path}"


def _dumps(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)


def _text(value: str | None) -> str | None:
    """Text PostgreSQL will take: no NUL characters, no lone surrogates."""
    if value is None:
        return None
    if "\x00" in value:
        value = value.replace("\x00", "\ufffd")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "replace").decode("utf-8")
    return value


def _id_filter(column: str, exact: str | None, prefix: str | None) -> tuple[str, list[Any]]:
    """A WHERE clause (or "") matching one id or an id prefix."""
    where: list[str] = []
    params: list[Any] = []
    if exact is not None:
        where.append(f"{column} = %s")
        params.append(exact)
    if prefix is not None:
        where.append(f"{column} LIKE %s ESCAPE '\\'")
        params.append(prefix.replace("\\", "\\\\").replace("%", "\\%")
                      .replace("_", "\\_") + "%")
    return (" WHERE " + " AND ".join(where)) if where else "", params


class PostgresStore:
    """The `RunStore` on PostgreSQL (see the module docstring).

    Args:
        url: A libpq URL, `postgresql://USER[:PASSWORD]@HOST[:PORT]/DB[?...]`.
        lock_timeout: Seconds a write waits for the write lock, and a connection
            attempt for the server (None: `$KERNEL_AUDIT_LOCK_TIMEOUT`, else 10).
        lease: Seconds after which a silent holder on another host may be taken
            over (None: `$KERNEL_LEASE_SECONDS`, else 60).
        spill_dir: Where rows this process cannot write at exit are kept for the next
            process on this machine (`spill`; None: the directory of the default
            analysts' file, `$KERNEL_DB`'s, else `~/.kernel`).

    Raises:
        ConfigError: A URL libpq would not take (`check_url`), a bad
            `$KERNEL_AUDIT_LOCK_TIMEOUT` or `$KERNEL_LEASE_SECONDS`, or the `postgres`
            extra (psycopg) is not installed.
    """

    legacy: Path | None = None

    def __init__(self, url: str, *, lock_timeout: float | None = None,
                 lease: float | None = None,
                 spill_dir: str | os.PathLike[str] | None = None) -> None:
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise ConfigError("a postgresql:// store needs psycopg: "
                              "pip install 'run-kernel[postgres]'") from None
        check_url(url)
        self.url = url
        self.source = public_url(url)
        #: Shown in messages (never holds the password).
        self.path = self.source
        self.lock_timeout = lock_timeout if lock_timeout is not None else lock_timeout_from_env()
        self.lease = lease if lease is not None else lease_from_env()
        self.stats = StoreStats()
        self._con: Any = None
        self._lock = threading.Lock()
        self._migrated = False
        self._holding = False
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._me = Owner.me()
        self._spill_dir = None if spill_dir is None else Path(spill_dir).expanduser()
        #: Spill files of this store are named after it (the URL without its password).
        self.spill_prefix = ("kernel-store-"
                             + hashlib.sha256(self.source.encode()).hexdigest()[:16])
        self._spills_checked = False

    def __repr__(self) -> str:
        return f"PostgresStore({self.source!r})"

    # -------------------------------------------------------------- opening

    def _error(self, what: str, exc: BaseException, *, lost: bool = False) -> StoreError:
        """The `StoreError` for psycopg's `exc`; `lost`: the connection broke meanwhile.

        No answer from a server at all, a connection lost (class 08) or a server
        shutting down or starting up (57P01-57P03) is `StoreUnreachableError`;
        another operational error (a deadlock, a lock timeout) `StoreBusyError`;
        anything else (a value the server refused) a plain `StoreError`.
        """
        import psycopg

        text = " ".join(str(exc).split()) or type(exc).__name__
        if isinstance(exc, psycopg.errors.LockNotAvailable):
            return StoreBusyError(f"store {self.source} stayed locked by other writers "
                                  f"(gave up after {self.lock_timeout:g}s)")
        state = getattr(exc, "sqlstate", None)
        if lost or (isinstance(exc, psycopg.OperationalError)
                    and (state is None or state.startswith("08") or state in _GONE_STATES)):
            return StoreUnreachableError(f"{what} store {self.source}: the server is "
                                         f"unreachable: {text}")
        if isinstance(exc, psycopg.OperationalError):
            return StoreBusyError(f"{what} store {self.source}: {text}")  # deadlock, ...
        return StoreError(f"{what} store {self.source}: {text}")

    def _connect(self) -> Any:
        """This process's connection (made, or remade after a failure, on first use)."""
        import psycopg

        con = self._con
        if con is not None and not con.closed and not con.broken:
            return con
        self._drop()
        timeout = max(1, round(self.lock_timeout)) if self.lock_timeout else 10
        try:
            con = psycopg.connect(self.url, autocommit=True, connect_timeout=timeout,
                                  application_name="kernel")
            con.execute(f"SET search_path TO {SCHEMA}")
            con.execute(f"SET lock_timeout = {int(self.lock_timeout * 1000)}")
        except psycopg.Error as exc:
            raise self._error("cannot open", exc) from exc
        self._con = con
        return con

    def _drop(self) -> None:
        if self._con is not None:
            with contextlib.suppress(Exception):
                self._con.close()
            self._con = None
            self._migrated = False

    def exists(self) -> bool:
        """True if the kernel's tables exist in the database.

        Raises:
            StoreError: The server cannot be reached (never False for that:
                a budget check must not mistake an unreachable store for an empty one).
        """
        import psycopg

        with self._lock:
            con = self._connect()
            try:
                row = con.execute("SELECT to_regclass(%s)", (f"{SCHEMA}.meta",)).fetchone()
            except psycopg.Error as exc:
                self._drop()
                raise self._error("cannot read", exc) from exc
            return row is not None and row[0] is not None

    def _migrate(self, con: Any) -> None:
        """Create or bring the tables up to date (once per connection, under a lock)."""
        if self._migrated:
            return
        found = con.execute("SELECT to_regclass(%s)", (f"{SCHEMA}.meta",)).fetchone()
        version = 0
        if found and found[0] is not None:
            row = con.execute("SELECT value FROM meta WHERE key = 'version'").fetchone()
            version = int(row[0]) if row else 0
        if version < STORE_VERSION:
            with con.transaction():
                con.execute("SELECT pg_advisory_xact_lock(%s, %s)", (_LOCKS, _MIGRATE_LOCK))
                found = con.execute("SELECT to_regclass(%s)", (f"{SCHEMA}.meta",)).fetchone()
                if found and found[0] is not None:
                    row = con.execute("SELECT value FROM meta WHERE key = 'version'").fetchone()
                    version = int(row[0]) if row else 0
                for number, statements in enumerate(MIGRATIONS, start=1):
                    if number <= version:
                        continue
                    for sql in statements:
                        con.execute(sql)
                    con.execute("INSERT INTO meta VALUES ('version', %s) ON CONFLICT (key) "
                                "DO UPDATE SET value = excluded.value", (number,))
        self._migrated = True

    def close(self) -> None:
        """Stop the heartbeat and close this process's connection (a later call reopens it)."""
        self._stop.set()
        beat = self._beat
        if beat is not None and beat is not threading.current_thread():
            beat.join()
        self._beat = None
        with self._lock:
            self._drop()
            self._spills_checked = False
        self._stop = threading.Event()
        self._holding = False

    # ------------------------------------------------------------ transactions

    @contextmanager
    def _write(self, callers: Sequence[str] = ()) -> Iterator[Any]:
        """One write transaction, holding the budget locks of `callers` (sorted: no deadlock
        between two transactions reserving for the same callers)."""
        import psycopg

        with self._lock:
            t0 = time.perf_counter()
            con = self._connect()
            waited = 0.0
            committing = False
            try:
                self._migrate(con)
                with con.transaction():
                    if callers:
                        t1 = time.perf_counter()
                        for caller in sorted(set(callers)):
                            con.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))",
                                        (_LOCKS, caller))
                        waited = time.perf_counter() - t1
                    yield con
                    committing = True  # the COMMIT is next: lost now, it may have landed
            except psycopg.Error as exc:
                lost = bool(con.broken or con.closed)
                if isinstance(exc, psycopg.OperationalError) or lost:
                    self._drop()
                err = self._error("cannot write to", exc, lost=lost)
                if committing and isinstance(err, StoreUnreachableError):
                    err.in_doubt = True
                raise err from exc
            finally:
                self._account(t0, waited)

    @contextmanager
    def _read(self) -> Iterator[Any]:
        import psycopg

        with self._lock:
            t0 = time.perf_counter()
            con = self._connect()
            try:
                if not self._exists(con):
                    yield None
                    return
                with con.transaction():
                    yield con
            except psycopg.Error as exc:
                if isinstance(exc, psycopg.OperationalError) or con.broken:
                    self._drop()
                raise self._error("cannot read", exc) from exc
            finally:
                self._account(t0, 0.0)

    def _exists(self, con: Any) -> bool:
        if self._migrated:
            return True
        row = con.execute("SELECT to_regclass(%s)", (f"{SCHEMA}.meta",)).fetchone()
        return row is not None and row[0] is not None

    def _account(self, t0: float, waited: float) -> None:
        s = self.stats
        s.transactions += 1
        s.wait_s += waited
        s.max_wait_s = max(s.max_wait_s, waited)
        s.max_transaction_s = max(s.max_transaction_s, time.perf_counter() - t0)

    def commit(self, batch: Batch | None, ops: Sequence[Op] = (), *,
               wait: bool = True) -> list[Any]:
        """Write `batch` and then apply `ops`, in one transaction; return each op's result.

        Same contract as `SQLiteStore.commit`. With `wait=False` this store
        always raises `WouldBlock`: a network round trip belongs in a worker
        thread, never on the trio thread. A server that cannot be reached is
        tried again until the lock timeout is spent (see the loop below).

        Raises:
            StoreBusyError: The write lock stayed taken past the lock timeout.
            StoreUnreachableError: The server stayed unreachable past the lock timeout,
                or the connection was lost during the COMMIT (`in_doubt`).
            StoreError: The server refused the write (nothing was written).
            WouldBlock: `wait=False`.
        """
        if not wait:
            raise WouldBlock
        callers = [op.caller_id for op in ops if isinstance(op, ReserveBudget)]
        # An unreachable server (refused connections while it restarts, a connection it
        # closed as it shut down) is waited for as long as a taken lock would be: the
        # transaction is run again, with pauses from RETRY_FIRST doubling to RETRY_MAX,
        # until the lock timeout is spent. Not one whose COMMIT was in flight (it may
        # have landed): that error goes to the caller, whose `Journal` keeps the rows.
        deadline = time.monotonic() + self.lock_timeout
        pause = RETRY_FIRST
        while True:
            try:
                with self._write(callers) as con:
                    # The first write of a connection writes the spill files first.
                    spills = None if self._spills_checked else self._replay_spills(con)
                    bases = self._write_batch(con, batch) if batch is not None else {}
                    results = [self._apply_one(con, op) for op in ops]
                    if spills is not None:  # last: it holds the keys it deletes till COMMIT
                        self._prune_spill_keys(con, spills[1])
                break
            except StoreUnreachableError as exc:
                left = deadline - time.monotonic()
                if exc.in_doubt or left <= 0:
                    raise
                if pause == RETRY_FIRST:
                    _log.warning("%s; trying again for up to %.3gs", exc, left)
                time.sleep(min(pause, left))
                pause = min(pause * 2, RETRY_MAX)
        if spills is not None:
            self._spills_checked = True
            spills_committed(spills[0])
        for rec, base in bases.items():
            rec.base = base
        if not self._holding and any(isinstance(op, RegisterRun | ClaimRun | SaveCheckpoint
                                                     | CreateBatch | ClaimBatch) for op in ops):
            self._start_heartbeat()
        return results

    # ------------------------------------------------------------ spill files

    def spill_home(self) -> Path:
        """The directory holding this machine's spill files of the store (see `spill`)."""
        if self._spill_dir is None:
            from batteries.audit.paths import default_db_path, resolve_db_path

            try:
                self._spill_dir = resolve_db_path(None).parent
            except ConfigError:
                self._spill_dir = default_db_path().parent
        return self._spill_dir

    def spill(self, batch: Batch | None, ops: Sequence[Op]) -> Path:
        """Keep rows and operations this process could not commit (the server unreachable
        past the lock timeout as it exits: `Journal._final_flush`) in a spill file on this
        machine (`spill_home`, named after the store); its path.

        The next transaction of a process on this machine that writes to this store
        commits them exactly once (a `meta` key per spill, set in the same transaction)
        and removes the file. A process on another machine cannot see the file: a run
        whose close it holds may be taken over there once its lease expires, and its
        events are then refused on replay (the file is moved aside `.rejected`).

        Raises:
            OSError: The file cannot be written (nothing was kept).
        """
        spill_id = os.urandom(16).hex()
        text = encode_spill(Batch() if batch is None else batch, ops, spill_id=spill_id,
                            store=self.source)
        return write_spill(self.spill_home(), self.spill_prefix, spill_id, text)

    def spill_tag(self) -> int:
        """What the `meta` keys of the spills written from this machine's spill directory
        hold as their value (a hash of the host name and the directory): only a writer
        that lists that directory may prune them (`_prune_spill_keys`)."""
        home = self.spill_home()
        try:
            st = home.stat()
            where = f"{os.path.realpath(home)}\0{st.st_dev}\0{st.st_ino}"
        except OSError:
            where = str(home)
        digest = hashlib.sha256(f"{self._me.host}\0{where}".encode()).digest()
        return int.from_bytes(digest[:8], "big") >> 1  # a BIGINT, never negative

    def _replay_spills(self, con: Any) -> tuple[list[tuple[Path, str | None, str]], list[str]]:
        """Write this store's spill files in the transaction open on `con`, each in a
        savepoint and only if its `meta` key is not there yet; what `spills_committed`
        does with each once the transaction commits, and the spill keys to keep
        (`_prune_spill_keys`). Leftovers of dead writers are removed (see "Tidying" in
        `batteries.store._sqlite`)."""
        import psycopg

        done: list[tuple[Path, str | None, str]] = []
        listed = spill_files(self.spill_home(), self.spill_prefix, tidy=SPILL_TMP_STALE)
        read: list[str] = []
        tag = self.spill_tag() if listed else 0
        for path in listed:
            try:
                spill = read_spill(path)
            except FileNotFoundError:
                continue
            except SpillError as exc:
                set_aside(path, ".bad", f"cannot be read ({exc})")
                continue
            except OSError as exc:
                _log.warning("store spill %s cannot be read now (%s); left for later", path,
                             exc.strerror or exc)
                continue
            read.append(spill.spill_id)
            if spill.store != self.source:
                continue  # another store's (its name's hash collided): not ours to write
            try:
                with con.transaction():  # a savepoint
                    fresh = self._replay_one(con, spill, path, tag)
            except psycopg.OperationalError:
                raise  # the server or a lock: the whole transaction fails (or is retried)
            except SpillTaken:
                continue  # written by another process meanwhile (its savepoint undone)
            except Exception as exc:
                done.append((path, ".rejected", f"{type(exc).__name__}: "
                                                f"{' '.join(str(exc).split())}"))
            else:
                done.append((path, None, spill_summary(spill) if fresh else ""))
        return done, spill_keys_to_keep(listed, read)

    def _replay_one(self, con: Any, spill: Spill, path: Path, tag: int) -> bool:
        """Write one spill (read from `path`) unless its key says it was written; True if
        written now. The key's value is `tag` (`spill_tag`).

        Raises:
            SpillTaken: Its key was not there but `path` is gone: another process wrote
                it and its key was pruned since (see "Tidying" in `_sqlite`).
        """
        cur = con.execute("INSERT INTO meta (key, value) VALUES (%s, %s) "
                          "ON CONFLICT (key) DO NOTHING", (SPILL_KEY + spill.spill_id, tag))
        if cur.rowcount == 0:
            return False
        if not still_there(path):
            raise SpillTaken(str(path))
        if not spill.batch.empty():
            self._write_batch(con, spill.batch)
        for op in spill.ops:
            res = self._apply_one(con, op)
            if isinstance(res, Exception):
                _log.error("store operation from spill %s refused: %s: %s", spill.spill_id,
                           type(op).__name__, res)
        return True

    def _prune_spill_keys(self, con: Any, keep: list[str]) -> None:
        """Delete the keys of spills replayed from this machine's spill directory (their
        value is `spill_tag`) none of whose files this transaction listed there (`keep`
        holds those it did): nothing can replay them again (see "Tidying" in `_sqlite`).
        Keys another writer holds are skipped, never waited for, and this runs last in
        its transaction, so it never takes part in a deadlock. Keys replayed from
        another machine or directory are that one's to prune; those set before this
        tagging (their value a time) are kept."""
        con.execute("DELETE FROM meta WHERE key IN (SELECT key FROM meta WHERE key LIKE "
                    "'spill:%%' AND value = %s AND NOT (key = ANY(%s::text[])) "
                    "FOR UPDATE SKIP LOCKED)", (self.spill_tag(), keep))

    # Every `rev` (and `events.xid`) defaults to the writing transaction's id: rows are
    # written with `rev = DEFAULT`, no round trip to ask for it.

    # ----------------------------------------------------------------- audit

    def _write_batch(self, con: Any, batch: Batch) -> dict[Any, int]:
        if batch.empty():
            return {}
        bases: dict[Any, int] = {}
        next_in_batch: dict[str, int] = {}
        starts: list[tuple[Any, ...]] = []
        news = dict.fromkeys(batch.new)
        news.update(dict.fromkeys(r for r in batch.recs if r.base is None and r not in news))
        todo = [rec for rec in news if rec.base is None]
        known: dict[str, int] = {}
        if todo:
            ids = list({rec.run_id for rec in todo})
            for rid, last in con.execute(
                    "SELECT r.run_id, greatest(r.last_seq, coalesce((SELECT max(seq) FROM "
                    "events e WHERE e.run_id = r.run_id), -1)) FROM runs r "
                    "WHERE r.run_id = ANY(%s)", (ids,)).fetchall():
                known[rid] = int(last) + 1
        new_runs: list[tuple[Any, ...]] = []
        for rec in todo:
            rid = rec.run_id
            if rid in next_in_batch:
                base = next_in_batch[rid]
            elif rid in known:  # a resumed run: continue after its last event
                base = known[rid]
            else:
                info = rec.info
                new_runs.append((rid, info.parent_run_id, _text(info.subject_id),
                                 _text(info.name), _text(info.caller_id),
                                 _text(info.channel_id), _text(_dumps(info.inputs)),
                                 rec.started_us, rec.host, rec.pid))
                starts.append((rid, 0, rec.started_us, "run_start", None, _text(info.name),
                               None, _text(_dumps({"inputs": info.inputs,
                                                   "caller_id": info.caller_id}))))
                base = 1
            bases[rec] = base
            next_in_batch[rid] = base + rec.count
        with con.cursor() as cur:
            if new_runs:
                cur.executemany(
                    "INSERT INTO runs (run_id, parent_run_id, subject_id, name, caller_id, "
                    "channel_id, inputs, started_at, host, pid, last_seq) "
                    "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, 0)", new_runs)
            if starts or batch.recs:
                with cur.copy("COPY events (run_id, seq, ts, kind, iteration, name, "
                              "duration_ms, payload) FROM STDIN") as copy:
                    for row in starts:
                        copy.write_row(row)
                    for r, s, ts, kind, it, name, dur, payload in zip(
                            batch.recs, batch.seqs, batch.ts, batch.kinds, batch.iters,
                            batch.names, batch.durs, batch.payloads, strict=True):
                        base = r.base if r.base is not None else bases[r]
                        copy.write_row((r.run_id, base + s, ts, kind, it, _text(name), dur,
                                        _text(payload)))
            if batch.closes:
                cur.executemany(
                    "UPDATE runs SET ended_at = %s, status = %s, output = %s, error = %s, "
                    "steps = %s, tool_calls = %s, runtime_seconds = %s, input_tokens = %s, "
                    "output_tokens = %s, thinking_tokens = %s, cost_usd = %s, reason = %s, "
                    "exit_code = %s, output_truncated = %s, rev = DEFAULT WHERE run_id = %s",
                    [(row[1], row[2], _text(row[3]), _text(row[4]), *row[5:12],
                      _text(row[12]), row[13], int(bool(row[14])), row[0])
                     for _, row in batch.closes])
        return bases

    # ------------------------------------------------------------------- ops

    def _apply_one(self, con: Any, op: Op) -> Any:
        """Apply `op`; a refused op's `StoreError` is its result. An op refuses before it
        writes anything, so there is nothing to undo (and no savepoint to pay for)."""
        try:
            return self._apply(con, op)
        except StoreError as exc:
            return exc

    def _apply(self, con: Any, op: Op) -> Any:
        if isinstance(op, SaveCheckpoint):
            return self._save(con, op)
        if isinstance(op, ReserveBudget):
            return self._reserve(con, op)
        if isinstance(op, RegisterRun):
            return self._register(con, op)
        if isinstance(op, FinishRun):
            con.execute(f"UPDATE checkpoints SET status = %s, error = %s, state = NULL, "
                        f"updated_at = {NOW}, rev = DEFAULT WHERE run_id = %s",
                        (op.status, _text(op.error), op.run_id))
            return None
        if isinstance(op, SettleBudget):
            con.execute("UPDATE budget_spend SET runtime_seconds = runtime_seconds + %s, "
                        "tokens = GREATEST(tokens, %s), cost_usd = GREATEST(cost_usd, %s), "
                        "settled = 1, rev = DEFAULT WHERE id = %s",
                        (op.runtime_seconds, op.tokens, op.cost_usd, op.reservation_id))
            return None
        if isinstance(op, LoseRun):
            return self._lose(con, op)
        if isinstance(op, ClaimRun):
            return self._claim(con, op)
        if isinstance(op, ReleaseRun):
            con.execute("UPDATE checkpoints SET pid = 0, pid_start = NULL, rev = DEFAULT "
                        "WHERE run_id = %s AND host = %s AND pid = %s",
                        (op.run_id, op.owner.host, op.owner.pid))
            return None
        if isinstance(op, SetBudget):
            con.execute(
                "INSERT INTO budgets VALUES (%s, %s, %s, %s, %s, %s, " + NOW + ") "
                "ON CONFLICT (caller_id) DO UPDATE SET window_seconds = excluded.window_seconds,"
                " max_runs = excluded.max_runs, max_runtime_seconds = "
                "excluded.max_runtime_seconds, max_tokens = excluded.max_tokens, "
                "max_cost_usd = excluded.max_cost_usd, updated_at = excluded.updated_at",
                (op.caller_id, op.window_seconds, op.max_runs, op.max_runtime_seconds,
                 op.max_tokens, op.max_cost_usd))
            return None
        if isinstance(op, RemoveBudget):
            cur = con.execute("DELETE FROM budgets WHERE caller_id = %s", (op.caller_id,))
            return cur.rowcount > 0
        if isinstance(op, CreateBatch):
            return self._create_batch(con, op)
        if isinstance(op, ClaimBatch):
            return self._claim_batch(con, op)
        if isinstance(op, FinishBatch):
            o = op.owner
            cur = con.execute(f"UPDATE batches SET status = 'finished', ended_at = {NOW}, "
                              f"pid = 0, pid_start = NULL, rev = DEFAULT WHERE batch_id = %s "
                              f"AND host = %s AND pid = %s", (op.batch_id, o.host, o.pid))
            return cur.rowcount > 0
        if isinstance(op, MarkDelivery):
            marks = delivery_marks(op)  # refused (a StoreError) before anything is written
            # A change number: the analysts' copy of the task follows its delivery.
            with con.cursor() as cur:
                cur.executemany("UPDATE batch_tasks SET delivery = %s, delivery_error = %s, "
                                "rev = DEFAULT WHERE batch_id = %s AND idx = %s", marks)
            return None
        raise TypeError(f"unknown store operation {op!r}")

    def _register(self, con: Any, op: RegisterRun) -> None:
        o = op.owner
        con.execute(
            f"INSERT INTO checkpoints (run_id, spec, status, host, pid, pid_start, "
            f"heartbeat_at, created_at, updated_at) "
            f"VALUES (%s, %s, 'running', %s, %s, %s, {NOW}, {NOW}, {NOW}) "
            f"ON CONFLICT (run_id) DO UPDATE SET status = 'running', error = NULL, "
            f"host = excluded.host, pid = excluded.pid, pid_start = excluded.pid_start, "
            f"heartbeat_at = excluded.heartbeat_at, updated_at = excluded.updated_at, "
            f"rev = DEFAULT",
            (op.run_id, _text(_dumps(op.spec)), o.host, o.pid, o.started))

    def _save(self, con: Any, op: SaveCheckpoint) -> bool:
        cp, o, u = op.checkpoint, op.owner, op.checkpoint.usage
        state = _text(_dumps(cp.state) if op.state_json is None else op.state_json)
        # No change number: the analysts' copy of a checkpoint follows its registration,
        # claims and end, not every save (as in the journal).
        cur = con.execute(
            f"UPDATE checkpoints SET state = %s, steps = %s, tool_calls = %s, "
            f"input_tokens = %s, output_tokens = %s, thinking_tokens = %s, cost_usd = %s, "
            f"heartbeat_at = {NOW}, updated_at = {NOW} WHERE run_id = %s",
            (state, cp.steps, cp.tool_calls, u.input_tokens, u.output_tokens,
             u.thinking_tokens, u.cost_usd, cp.run_id))
        if cur.rowcount:
            return True
        if op.spec is None:
            raise StoreError(f"checkpoint of run {cp.run_id} not saved: the run was never "
                             "registered (register it with its spec first)")
        con.execute(
            f"INSERT INTO checkpoints (run_id, spec, state, steps, tool_calls, input_tokens, "
            f"output_tokens, thinking_tokens, cost_usd, status, host, pid, pid_start, "
            f"heartbeat_at, created_at, updated_at) VALUES (%s, %s, %s, %s, %s, %s, %s, "
            f"%s, %s, 'running', %s, %s, %s, {NOW}, {NOW}, {NOW})",
            (cp.run_id, _text(_dumps(op.spec)), state, cp.steps, cp.tool_calls,
             u.input_tokens, u.output_tokens, u.thinking_tokens, u.cost_usd, o.host, o.pid,
             o.started))
        return True

    def _lose(self, con: Any, op: LoseRun) -> bool:
        lost = Status.LOST
        values = (str(lost), lost.exit_code, str(lost), _text(op.why))
        cur = con.execute(f"UPDATE runs SET status = %s, exit_code = %s, reason = %s, "
                          f"error = %s, ended_at = {NOW}, rev = DEFAULT "
                          f"WHERE run_id = %s AND status IS NULL",
                          (*values, op.run_id))
        # As the journal's `_SETTLE_LOST`: the reservation settled at the checkpoint's usage.
        con.execute("UPDATE budget_spend SET tokens = GREATEST(budget_spend.tokens, "
                    "c.input_tokens + c.output_tokens + c.thinking_tokens), "
                    "cost_usd = GREATEST(budget_spend.cost_usd, c.cost_usd), settled = 1, "
                    "rev = DEFAULT FROM checkpoints AS c WHERE budget_spend.run_id = c.run_id "
                    "AND c.run_id = %s AND budget_spend.settled = 0", (op.run_id,))
        if cur.rowcount:
            return True
        info = op.info
        if info is None or con.execute("SELECT 1 FROM runs WHERE run_id = %s",
                                       (op.run_id,)).fetchone():
            return False
        con.execute(
            f"INSERT INTO runs (run_id, parent_run_id, subject_id, name, caller_id, channel_id, "
            f"inputs, started_at, ended_at, status, exit_code, reason, error) "
            f"VALUES (%s, %s, %s, %s, %s, %s, %s, coalesce(%s, {NOW}), {NOW}, %s, %s, %s, %s)",
            (op.run_id, info.get("parent_run_id"), _text(info.get("subject_id")),
             _text(info.get("name")), _text(info.get("caller_id")),
             _text(info.get("channel_id")), _text(_dumps(info.get("inputs") or {})),
             op.started_us, *values))
        return True

    def _claim(self, con: Any, op: ClaimRun) -> bool:
        # The row lock makes claims take turns: the second claimer reads the first's lease.
        row = con.execute(f"SELECT status, host, pid, pid_start, {NOW} - heartbeat_at "
                          f"FROM checkpoints WHERE run_id = %s FOR UPDATE",
                          (op.run_id,)).fetchone()
        if row is None or row[0] != "running":
            return False
        holder = Owner(row[1] or "", int(row[2] or 0), row[3])
        me = op.owner
        held = (holder.host, holder.pid, holder.started)
        mine = held == (me.host, me.pid, me.started)
        # A dispatcher that proved the holder dead (e.g. Ray: its node died) names it.
        proof = op.gone
        proven = proof is not None and held == (proof.host, proof.pid, proof.started)
        if not (mine or proven or self._holder_gone(holder, row[4])):
            return False
        con.execute(f"UPDATE checkpoints SET host = %s, pid = %s, pid_start = %s, "
                    f"heartbeat_at = {NOW}, rev = DEFAULT WHERE run_id = %s",
                    (me.host, me.pid, me.started, op.run_id))
        return True

    # ---------------------------------------------------------------- batches

    def _create_batch(self, con: Any, op: CreateBatch) -> bool:
        # Refused before anything is written (no savepoint to undo). A batch created at
        # the same moment elsewhere with the same id fails the primary key instead.
        if con.execute("SELECT 1 FROM batches WHERE batch_id = %s", (op.batch_id,)).fetchone():
            raise StoreError(f"batch {op.batch_id} already exists")
        o = op.owner
        con.execute(f"INSERT INTO batches (batch_id, name, source, created_at, status, tasks, "
                    f"concurrency, options, host, pid, pid_start, heartbeat_at) "
                    f"VALUES (%s, %s, %s, {NOW}, 'running', %s, %s, %s, %s, %s, %s, {NOW})",
                    (op.batch_id, _text(op.name), _text(op.source), len(op.tasks),
                     op.concurrency, _text(_dumps(dict(op.options))), o.host, o.pid,
                     o.started))
        with con.cursor() as cur:
            cur.executemany("INSERT INTO batch_tasks (batch_id, idx, task_id, run_id, spec) "
                            "VALUES (%s, %s, %s, %s, %s)",
                            [(op.batch_id, i, _text(t.task_id), t.run_id,
                              _text(_dumps(t.spec))) for i, t in enumerate(op.tasks)])
        return True

    def _claim_batch(self, con: Any, op: ClaimBatch) -> bool:
        row = con.execute(f"SELECT status, host, pid, pid_start, {NOW} - heartbeat_at "
                          f"FROM batches WHERE batch_id = %s FOR UPDATE",
                          (op.batch_id,)).fetchone()
        if row is None:
            return False
        holder = Owner(row[1] or "", int(row[2] or 0), row[3])
        me = op.owner
        mine = (holder.host, holder.pid, holder.started) == (me.host, me.pid, me.started)
        if row[0] == "running" and not mine and not self._holder_gone(holder, row[4]):
            return False
        con.execute(f"UPDATE batches SET status = 'running', ended_at = NULL, host = %s, "
                    f"pid = %s, pid_start = %s, heartbeat_at = {NOW}, rev = DEFAULT "
                    f"WHERE batch_id = %s", (me.host, me.pid, me.started, op.batch_id))
        return True

    def batches(self, *, batch_id: str | None = None, prefix: str | None = None,
                limit: int | None = None) -> list[BatchRow]:
        """Batches newest first (one id, an id prefix, or all), their tasks counted by status.

        A batch whose holder is provably gone by this store's rule (on another host:
        silent past the lease) is shown held by nobody (pid 0), so it reads as
        interrupted (`BatchRow.interrupted`).
        """
        where, params = _id_filter("batch_id", batch_id, prefix)
        sql = (f"SELECT batch_id, name, source, created_at, ended_at, status, tasks, "
               f"concurrency, options, host, pid, pid_start, {NOW} - heartbeat_at "
               f"FROM batches{where} ORDER BY created_at DESC, batch_id DESC")
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self._read() as con:
            if con is None:
                return []
            rows = con.execute(sql, params).fetchall()
            counted: dict[str, dict[str, int]] = {}
            delivered: dict[str, dict[str, int]] = {}
            if rows and self._delivers(con):
                for bid, state, n in con.execute(
                        "SELECT t.batch_id, t.delivery, count(*) FROM batch_tasks t "
                        "JOIN runs r ON r.run_id = t.run_id WHERE t.batch_id = ANY(%s) "
                        "AND r.status IS NOT NULL AND t.delivery IS NOT NULL "
                        "GROUP BY t.batch_id, t.delivery", ([r[0] for r in rows],)).fetchall():
                    delivered.setdefault(bid, {})[str(state)] = int(n)
            if rows:
                for bid, state, n in con.execute(
                        "SELECT t.batch_id, CASE WHEN r.run_id IS NULL AND c.run_id IS NULL "
                        "THEN 'pending' WHEN r.status IS NULL THEN 'running' ELSE r.status END "
                        "AS s, count(*) FROM batch_tasks t "
                        "LEFT JOIN runs r ON r.run_id = t.run_id "
                        "LEFT JOIN checkpoints c ON c.run_id = t.run_id "
                        "WHERE t.batch_id = ANY(%s) GROUP BY t.batch_id, s",
                        ([r[0] for r in rows],)).fetchall():
                    counted.setdefault(bid, {})[str(state)] = int(n)
        out = []
        for (bid, name, source, created, ended, status, tasks, conc, options, host, pid,
             start, silent) in rows:
            owner = Owner(host or "", int(pid or 0), start)
            if status == "running" and owner.host != self._me.host \
                    and self._holder_gone(owner, silent):
                owner = Owner(owner.host, 0, None)
            created_at = _utc(created)
            assert created_at is not None
            out.append(BatchRow(bid, name or "", source or "", created_at, _utc(ended), status,
                                int(tasks), int(conc), owner, counted.get(bid, {}),
                                json.loads(options) if options else {},
                                delivered.get(bid, {})))
        return out

    def batch_tasks(self, batch_id: str) -> list[TaskRow]:
        """The tasks of a batch in file order, each with its run's status and checkpoint."""
        with self._read() as con:
            if con is None:
                return []
            rows = con.execute(batch_tasks_sql(self._delivers(con), "%s"),
                               (batch_id,)).fetchall()
            saved: dict[str, SavedRun] = {}
            if any(r[6] for r in rows):
                saved = {s.run_id: s for s in saved_rows(
                    con, " WHERE run_id IN (SELECT run_id FROM batch_tasks WHERE batch_id = %s)",
                    (batch_id,))}
        return task_rows(rows, saved)

    def _delivers(self, con: Any) -> bool:
        """The store's batch_tasks have the delivery columns (version 3 on: a store an
        older kernel made is migrated by this process's first write, not by a read)."""
        if self._migrated:
            return True
        row = con.execute("SELECT value FROM meta WHERE key = 'version'").fetchone()
        return row is not None and int(row[0]) >= 3

    def _holder_gone(self, holder: Owner, silent_us: int | None) -> bool:
        """Provably gone: released (pid 0); on this host, `Owner.gone`; on another host,
        no heartbeat for longer than the lease (by the server's clock)."""
        if holder.pid <= 0:
            return True
        if holder.host == self._me.host:
            return holder.gone()
        return silent_us is None or silent_us > self.lease * 1e6

    # -------------------------------------------------------------- heartbeat

    def _start_heartbeat(self) -> None:
        with self._lock:
            if self._holding:
                return
            self._holding = True
            stop = self._stop
            self._beat = threading.Thread(target=self._heartbeat_loop, args=(stop,),
                                          daemon=True, name="kernel-store-heartbeat")
            self._beat.start()

    def _heartbeat_loop(self, stop: threading.Event) -> None:
        interval = self.lease / 4
        while not stop.wait(interval):
            with contextlib.suppress(StoreError):
                self.heartbeat()

    def heartbeat(self) -> int:
        """Refresh the heartbeat of every running run (and batch) this process holds; how
        many runs.

        Raises:
            StoreError: The server cannot be reached.
        """
        me = self._me
        with self._write() as con:
            cur = con.execute(f"UPDATE checkpoints SET heartbeat_at = {NOW} "
                              f"WHERE host = %s AND pid = %s AND status = 'running'",
                              (me.host, me.pid))
            con.execute(f"UPDATE batches SET heartbeat_at = {NOW} "
                        f"WHERE host = %s AND pid = %s AND status = 'running'",
                        (me.host, me.pid))
            return int(cur.rowcount)

    # ---------------------------------------------------------------- budgets

    @staticmethod
    def _budget_row(con: Any, caller_id: str) -> Any:
        """The budget that applies to the caller and the caller's spend in its window, in one
        round trip: (caller_id, window, max_runs, max_runtime, max_tokens, max_cost, runs,
        runtime, tokens, cost), or None."""
        return con.execute(
            f"SELECT b.caller_id, b.window_seconds, b.max_runs, b.max_runtime_seconds, "
            f"b.max_tokens, b.max_cost_usd, s.runs, s.runtime, s.tokens, s.cost "
            f"FROM (SELECT * FROM budgets WHERE caller_id IN (%s, %s) "
            f"ORDER BY caller_id = %s DESC LIMIT 1) b, LATERAL (SELECT count(*) AS runs, "
            f"coalesce(sum(runtime_seconds), 0) AS runtime, coalesce(sum(tokens), 0) AS tokens, "
            f"coalesce(sum(cost_usd), 0) AS cost FROM budget_spend WHERE caller_id = %s "
            f"AND ts > {NOW} - (b.window_seconds * 1000000)::bigint) s",
            (caller_id, DEFAULT_CALLER, caller_id, caller_id)).fetchone()

    @staticmethod
    def _as_budget(caller_id: str, row: Any) -> CallerBudget:
        return CallerBudget(caller_id, float(row[1]), row[2], row[3], row[4], row[5],
                            int(row[6]), float(row[7]), int(row[8]), float(row[9]))

    def _reserve(self, con: Any, op: ReserveBudget) -> Reservation | None:
        # Atomic across the fleet: the transaction holds this caller's budget lock.
        row = self._budget_row(con, op.caller_id)
        if row is None:
            return None
        budget = self._as_budget(op.caller_id, row)
        if op.resumed and op.run_id:
            # Its row in the current window (one from an earlier window no longer counts).
            own = con.execute(f"SELECT id, tokens, cost_usd FROM budget_spend WHERE run_id = %s "
                              f"AND caller_id = %s AND ts > {NOW} - (%s * 1000000)::bigint "
                              f"ORDER BY id DESC LIMIT 1",
                              (op.run_id, op.caller_id, budget.window_seconds)).fetchone()
            if own is not None:
                return Reservation(budget.without(int(own[1]), float(own[2])), int(own[0]))
        elif budget.refusal() is not None:
            return Reservation(budget, None)
        found = con.execute(f"INSERT INTO budget_spend (caller_id, ts, run_id) "
                            f"VALUES (%s, {NOW}, %s) RETURNING id",
                            (op.caller_id, op.run_id or None)).fetchone()
        return Reservation(budget, int(found[0]))

    def budget(self, caller_id: str) -> CallerBudget | None:
        """The budget that applies to `caller_id` (own row, else `*`), spend included."""
        with self._read() as con:
            if con is None:
                return None
            row = self._budget_row(con, caller_id)
            return None if row is None else self._as_budget(caller_id, row)

    def budgets(self) -> list[CallerBudget]:
        """Every budget row with its own caller's current spend."""
        with self._read() as con:
            if con is None:
                return []
            callers = [r[0] for r in con.execute("SELECT caller_id FROM budgets "
                                                 "ORDER BY caller_id").fetchall()]
            return [self._as_budget(c, self._budget_row(con, c)) for c in callers]

    # ------------------------------------------------------------ checkpoints

    def saved_runs(self, *, run_id: str | None = None, prefix: str | None = None,
                   running: bool = False, damaged: bool = False) -> list[SavedRun]:
        """Registered runs: one id, an id prefix, or every run still marked `running`.

        A row whose spec or state is not JSON raises `ValueError`; with `damaged` it
        comes back flagged instead (`SavedRun.damaged`).
        """
        where, params = _id_filter("run_id", run_id, prefix)
        if running:
            where += (" AND " if where else " WHERE ") + "status = 'running'"
        with self._read() as con:
            if con is None:
                return []
            return saved_rows(con, where + " ORDER BY created_at, run_id", params,
                              damaged=damaged)

    def interrupted(self) -> list[SavedRun]:
        """Runs still marked `running` whose holder is provably gone: released, gone from
        this host (`Owner.gone`), or silent on another host for longer than the lease.
        A row that cannot be read comes back flagged (`SavedRun.damaged`)."""
        silent = dict(self._silences())
        return [r for r in self.saved_runs(running=True, damaged=True)
                if self._holder_gone(r.owner, silent.get(r.run_id))]

    def _silences(self) -> list[tuple[str, int | None]]:
        """(run_id, microseconds since its heartbeat by the server's clock) of running runs."""
        with self._read() as con:
            if con is None:
                return []
            rows: list[tuple[str, int | None]] = con.execute(
                f"SELECT run_id, {NOW} - heartbeat_at FROM checkpoints "
                f"WHERE status = 'running'").fetchall()
        return rows

    def payloads(self, run_id: str, kind: str) -> list[str]:
        """The payloads of run `run_id`'s events of `kind`, in seq order."""
        with self._read() as con:
            if con is None:
                return []
            rows = con.execute("SELECT payload FROM events WHERE run_id = %s AND kind = %s "
                               "ORDER BY seq", (run_id, kind)).fetchall()
        return [r[0] for r in rows]

    # -------------------------------------------------------- analysts' feed

    @contextmanager
    def changes(self, events_after: int, rev_after: int) -> Iterator[PgChanges]:
        """A consistent snapshot of what changed since a sync cursor (writers are not blocked).

        Reads on a connection of their own, in one REPEATABLE READ transaction.
        """
        import psycopg

        try:
            con = psycopg.connect(self.url, connect_timeout=max(1, round(self.lock_timeout)),
                                  application_name="kernel-sync")
        except psycopg.Error as exc:
            raise self._error("cannot read", exc) from exc
        try:
            con.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            con.execute(f"SET LOCAL search_path TO {SCHEMA}")
            if not self._exists(con):
                raise StoreError(f"no kernel tables in store {self.source} yet")
            yield PgChanges(con, events_after, rev_after)
        except psycopg.Error as exc:
            raise self._error("cannot read", exc) from exc
        finally:
            with contextlib.suppress(psycopg.Error):
                con.rollback()
            con.close()

    def purge(self, before_us: int) -> tuple[int, int]:
        """Delete closed runs that ended before `before_us`, their events, finished checkpoints
        and finished batches. The runs of a batch that has not finished stay, whatever their
        age (its resume tells a task that ran from one that never did by its run), and so
        do the runs whose result is owed a delivery, with their tasks and batch (the
        journal's rules: `PURGE_KEPT_RUNS`, `PURGE_TASKS`, `PURGE_BATCHES`).

        Returns:
            (runs deleted, events deleted).
        """
        if not self.exists():
            return 0, 0
        with self._write() as con:
            old = ("SELECT run_id FROM runs WHERE ended_at IS NOT NULL AND ended_at < %s "
                   f"AND run_id NOT IN ({PURGE_KEPT_RUNS})")
            ev = con.execute(f"DELETE FROM events WHERE run_id IN ({old})", (before_us,))
            n_events = ev.rowcount
            con.execute("DELETE FROM checkpoints WHERE status != 'running' AND updated_at < %s "
                        f"AND run_id NOT IN ({PURGE_KEPT_RUNS})", (before_us,))
            rn = con.execute("DELETE FROM runs WHERE ended_at IS NOT NULL AND ended_at < %s "
                             f"AND run_id NOT IN ({PURGE_KEPT_RUNS})", (before_us,))
            con.execute(PURGE_TASKS.format(p="%s"), (before_us,))
            con.execute(PURGE_BATCHES.format(p="%s"), (before_us,))
            return int(rn.rowcount), int(n_events)


class PgChanges:
    """What a sync reads from the store, inside one read snapshot (see `_sqlite.Changes`).

    Both cursors are transaction ids: rows written by transactions from the
    last cursor (included) up to the oldest one still running when the
    snapshot was taken (excluded), all of which have finished.
    """

    def __init__(self, con: Any, events_after: int, rev_after: int) -> None:
        self._con = con
        self.events_after = events_after
        self.rev_after = rev_after
        row = con.execute("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint"
                          ).fetchone()
        horizon = int(row[0])
        #: Where this snapshot is complete: the next cursor, for events and for rows.
        self.rev = self.last_event = max(horizon, rev_after)

    def events(self, chunk: int = 100_000) -> Iterator[list[tuple[Any, ...]]]:
        """New events in id order, in lists of at most `chunk` rows (`EVENT_COLUMNS`)."""
        with self._con.cursor(name="kernel_sync_events") as cur:
            cur.itersize = chunk
            cur.execute(f"SELECT {', '.join(EVENT_COLUMNS)} FROM events WHERE xid >= %s AND "
                        "xid < %s ORDER BY id", (self.events_after, self.last_event))
            while True:
                rows = cur.fetchmany(chunk)
                if not rows:
                    return
                yield rows

    def _changed(self, table: str, columns: Sequence[str]) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = self._con.execute(
            f"SELECT {', '.join(columns)} FROM {table} WHERE rev >= %s AND rev < %s",
            (self.rev_after, self.rev)).fetchall()
        return rows

    def runs(self) -> list[tuple[Any, ...]]:
        """Runs added or changed since the cursor (`RUN_COLUMNS`)."""
        return self._changed("runs", RUN_COLUMNS)

    def checkpoints(self) -> list[tuple[Any, ...]]:
        """Checkpoints added or changed since the cursor (`CHECKPOINT_COLUMNS`)."""
        return self._changed("checkpoints", CHECKPOINT_COLUMNS)

    def spend(self) -> list[tuple[Any, ...]]:
        """Budget spend rows added or settled since the cursor (`SPEND_COLUMNS`)."""
        return self._changed("budget_spend", SPEND_COLUMNS)

    def batches(self) -> list[tuple[Any, ...]]:
        """Batches added or changed since the cursor (`BATCH_COLUMNS`)."""
        return self._changed("batches", BATCH_COLUMNS)

    def batch_tasks(self, after: int | None = None) -> list[tuple[Any, ...]]:
        """Batch tasks added, or whose delivery moved, since the cursor (or since
        transaction `after`: 0 for every task) (`BATCH_TASK_COLUMNS`; a store an older
        kernel made, not migrated yet, has no delivery columns: NULL)."""
        row = self._con.execute("SELECT value FROM meta WHERE key = 'version'").fetchone()
        columns = BATCH_TASK_COLUMNS if row is not None and int(row[0]) >= 3 else (
            *BATCH_TASK_COLUMNS[:4], "NULL", "NULL")
        rows: list[tuple[Any, ...]] = self._con.execute(
            f"SELECT {', '.join(columns)} FROM batch_tasks WHERE rev >= %s AND rev < %s",
            (self.rev_after if after is None else after, self.rev)).fetchall()
        return rows

    def budgets(self) -> list[tuple[Any, ...]]:
        """Every budget row (a small table: copied whole) (`BUDGET_COLUMNS`)."""
        rows: list[tuple[Any, ...]] = self._con.execute(
            f"SELECT {', '.join(BUDGET_COLUMNS)} FROM budgets ORDER BY caller_id").fetchall()
        return rows
