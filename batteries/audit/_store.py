"""Short, retrying sessions on the analysts' DuckDB file.

Runs never touch this file: they write the journal (`batteries.store`).
Only the analysts' commands do, to bring it up to date from the journal
(`sync`) and to read it. Why sessions are short: DuckDB lets one process
at a time open a file read-write, and while it is open read-write no other
process can open it at all (not even read-only). Several `kernel` commands
and an analyst share the file, so no command keeps it open: every access
attaches the file, does its work in one transaction and detaches it.

How waiting works: kernel processes queue on a sidecar lock, `<file>.lock`
(flock: shared for readers, exclusive for writers), polled every 0.5-4 ms,
so the file changes hands within milliseconds of its release. DuckDB's own
lock still guards against programs that do not know the sidecar (an
analyst's `duckdb` shell): ATTACH is retried with capped exponential backoff
and jitter. Both waits share one deadline (`lock_timeout`), after which the
session fails with one clear line (`AuditBusyError`).

Why ATTACH instead of `duckdb.connect(path)`: creating a DuckDB instance
costs ~25 ms of CPU (it builds the catalog of built-in functions), which would
be paid on every batch and on every failed attempt while another process holds
the lock. Each process instead keeps one in-memory DuckDB instance for its
whole life and ATTACHes / DETACHes the file (~1 ms); DETACH checkpoints and
releases the file lock, so another process can take it at once.

All functions here block: they run in worker threads (`trio.to_thread`), or
in the CLI, never on the trio thread.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

# The journal and the analysts' file read $KERNEL_AUDIT_LOCK_TIMEOUT the same way.
from batteries.store._sqlite import DEFAULT_LOCK_TIMEOUT as DEFAULT_LOCK_TIMEOUT
from batteries.store._sqlite import LOCK_TIMEOUT_ENV as LOCK_TIMEOUT_ENV
from batteries.store._sqlite import lock_timeout_from_env as lock_timeout_from_env
from kernel import AuditError

from ._schema import SCHEMA_VERSION, current_version, migrate
from .paths import make_private_dir, make_private_file, open_private_file

if TYPE_CHECKING:
    import duckdb


_BACKOFF_FIRST = 0.004
_BACKOFF_CAP = 0.05
_SIDECAR_FIRST = 0.0005
_SIDECAR_CAP = 0.004

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: rely on DuckDB's own lock
    fcntl = None  # type: ignore[assignment]


class AuditBusyError(AuditError):
    """The database stayed locked by another process for longer than the lock timeout."""


# ----------------------------------------------------------------- engine

_engine: duckdb.DuckDBPyConnection | None = None
_engine_guard = threading.Lock()
_path_locks: dict[str, threading.Lock] = {}


def _cursor() -> duckdb.DuckDBPyConnection:
    """A new connection to this process's one in-memory DuckDB instance."""
    global _engine
    import duckdb

    with _engine_guard:
        if _engine is None:
            _engine = duckdb.connect(":memory:")
        return _engine.cursor()


#: What a sealed instance is created with: no extension is installed or loaded behind
#: the analyst's back.
_SEALED_CONFIG = {"autoinstall_known_extensions": False, "autoload_known_extensions": False,
                  "allow_community_extensions": False, "allow_unsigned_extensions": False,
                  "allow_persistent_secrets": False}
#: Run once the audit file is attached READ_ONLY, in this order (DuckDB refuses the
#: first once the local file system is gone). `enable_external_access = false`
#: alone still lets COPY write the attached file and its WAL (DuckDB allows the
#: paths of attached databases); removing the local file system stops that, and
#: every read of another file. `lock_configuration` keeps all of it from being
#: SET back. The attached file stays readable through the handle ATTACH opened.
_SEAL = ("SET enable_external_access = false",
         "SET disabled_filesystems = 'LocalFileSystem'",
         "SET lock_configuration = true")


def _sealed_cursor() -> duckdb.DuckDBPyConnection:
    """A connection to a new in-memory DuckDB instance of its own (settings are per instance)."""
    import duckdb

    return duckdb.connect(":memory:", config=dict(_SEALED_CONFIG))


def pin_utc(cur: duckdb.DuckDBPyConnection) -> None:
    """Run `cur`'s SQL in UTC, whatever `$TZ` is (DuckDB takes each connection's time zone
    from it): `date_trunc('day', ts)`, `ts::date`, `hour(ts)` and a timestamp inside a
    struct or list then mean the same on every machine. Before `_seal` (which locks it)."""
    cur.execute("SET TimeZone = 'UTC'")


def _seal(cur: duckdb.DuckDBPyConnection) -> None:
    """Make `cur`'s instance unable to open, write or read any file from now on."""
    for statement in _SEAL:
        cur.execute(statement)


def _path_lock(key: str) -> threading.Lock:
    """The in-process lock for one database file (one session per file at a time)."""
    with _engine_guard:
        lock = _path_locks.get(key)
        if lock is None:
            lock = _path_locks[key] = threading.Lock()
        return lock


def _is_lock_error(exc: BaseException) -> bool:
    import duckdb

    return isinstance(exc, duckdb.IOException) and "lock" in str(exc).lower()


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (DuckDB's can run to several lines)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


# ------------------------------------------------------------------ store


class Store:
    """One audit database file, accessed in short sessions from any thread.

    Args:
        path: The DuckDB file (created with its parent directories on first write).
        lock_timeout: Seconds to keep retrying while another process holds the
            file; None means `$KERNEL_AUDIT_LOCK_TIMEOUT`, else 10.

    Raises:
        ConfigError: `lock_timeout` is None and the variable holds a bad value.
    """

    def __init__(self, path: str | Path, *, lock_timeout: float | None = None) -> None:
        self.path = Path(path).expanduser().absolute()
        self.lock_timeout = lock_timeout if lock_timeout is not None else lock_timeout_from_env()
        # resolve() follows symlinks in the part that exists, so two spellings
        # of one file share one in-process lock (DuckDB refuses to attach a
        # file twice in one process).
        key = str(self.path.resolve())
        self._key = key
        self._alias = "kaudit_" + hashlib.sha1(key.encode()).hexdigest()[:16]
        self._sidecar = self.path.with_name(self.path.name + ".lock")

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r})"

    @contextmanager
    def session(self, *, write: bool,
                sealed: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        """Attach the file (waiting while it is locked), yield a cursor using it, detach.

        Unqualified table names in the cursor refer to the audit database.
        `sealed` (read-only sessions only) runs the session in a DuckDB
        instance of its own that can touch no file at all once the audit is
        attached (`_sealed_cursor`): what `kernel query` runs an analyst's SQL in.

        Raises:
            AuditBusyError: Still locked by another process after `lock_timeout`.
            AuditError: The file cannot be opened (missing for a reader, not a
                DuckDB file, a directory that cannot be created, ...).
        """
        if sealed and write:
            raise ValueError("a sealed session is read-only")
        cur = _sealed_cursor() if sealed else _cursor()
        try:
            pin_utc(cur)
            with self._attached(cur, write=write) as alias:
                cur.execute(f"USE {alias}")
                if sealed:
                    _seal(cur)
                try:
                    yield cur
                finally:
                    cur.execute("USE memory")
        finally:
            cur.close()

    @contextmanager
    def _attached(self, cur: duckdb.DuckDBPyConnection, *, write: bool) -> Iterator[str]:
        """Hold the file attached to `cur` (as the yielded alias) for the `with` body.

        Three locks, outermost first: this process's lock for the file (one
        session per file per process: the alias is shared), the sidecar
        `<file>.lock` (flock; shared for readers, exclusive for writers), and
        DuckDB's own file lock, taken by ATTACH. The sidecar is what kernel
        processes queue on: polling it costs a syscall, so a waiter takes
        the file within a millisecond or two of its release, where polling
        ATTACH would cost ~1 ms of CPU per try and leave the file idle
        between tries. DuckDB's lock still guards against processes that do
        not know the sidecar (an analyst's `duckdb` shell): ATTACH is retried
        with backoff until the same deadline.
        """
        deadline = time.monotonic() + self.lock_timeout
        lock = _path_lock(self._key)
        if not lock.acquire(timeout=max(self.lock_timeout, 0.001)):
            raise self._busy("is busy in this process")
        try:
            if write:
                try:
                    make_private_dir(self.path.parent)
                except OSError as exc:
                    raise AuditError(f"cannot create {self.path.parent}: "
                                     f"{exc.strerror or exc}") from exc
            elif not self.path.exists():
                raise AuditError(f"no audit database at {self.path}")
            fd = self._lock_sidecar(write, deadline)
            try:
                if write and not self.path.exists():
                    self._create_file(cur)
                self._attach(cur, write, deadline)
                try:
                    yield self._alias
                finally:
                    self._detach(cur)
            finally:
                if fd is not None:
                    os.close(fd)  # releases the flock
        finally:
            lock.release()

    def _create_file(self, cur: duckdb.DuckDBPyConnection) -> None:
        """Create the database file with mode 0600, never readable by others even for a moment.

        DuckDB creates files with the umask's mode and refuses an empty
        file made in advance, so it creates the file in a private (0700)
        directory beside the target; it is set to 0600 there and linked into
        place (an existing file, made meanwhile by another process, wins).
        """
        import duckdb

        try:
            stage = Path(tempfile.mkdtemp(prefix=".kernel-new-", dir=self.path.parent))
        except OSError as exc:
            raise AuditError(f"cannot create audit database {self.path}: "
                             f"{exc.strerror or exc}") from exc
        try:
            staged = stage / self.path.name
            alias = self._alias + "_new"
            try:
                cur.execute(f"ATTACH {_sql_string(str(staged))} AS {alias}")
                cur.execute(f"DETACH {alias}")
            except duckdb.Error as exc:
                raise AuditError(f"cannot create audit database {self.path}: "
                                 f"{first_line(exc)}") from exc
            make_private_file(staged)
            try:
                os.link(staged, self.path)
            except FileExistsError:
                pass
            except OSError:  # no hard links here: we hold the writers' lock, rename
                os.rename(staged, self.path)
        except OSError as exc:
            raise AuditError(f"cannot create audit database {self.path}: "
                             f"{exc.strerror or exc}") from exc
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    def _busy(self, what: str) -> AuditBusyError:
        return AuditBusyError(f"audit database {self.path} {what} "
                              f"(gave up after {self.lock_timeout:g}s)")

    def _lock_sidecar(self, write: bool, deadline: float) -> int | None:
        """flock the sidecar file; None if there can be none (no fcntl, read-only directory)."""
        if fcntl is None:
            return None
        try:
            fd = open_private_file(self._sidecar, os.O_RDWR)
        except OSError:
            try:
                fd = os.open(self._sidecar, os.O_RDONLY)
            except OSError:
                return None  # DuckDB's own lock still protects the file
        mode = (fcntl.LOCK_EX if write else fcntl.LOCK_SH) | fcntl.LOCK_NB
        delay = _SIDECAR_FIRST
        while True:
            try:
                fcntl.flock(fd, mode)
                return fd
            except BlockingIOError:
                now = time.monotonic()
                if now >= deadline:
                    os.close(fd)
                    raise self._busy("is locked by another process") from None
                time.sleep(min(delay, deadline - now) * random.uniform(0.5, 1.0))
                delay = min(delay * 2, _SIDECAR_CAP)
            except OSError:
                os.close(fd)
                return None  # a filesystem without flock: rely on DuckDB's lock

    def _attach(self, cur: duckdb.DuckDBPyConnection, write: bool, deadline: float) -> None:
        import duckdb

        sql = f"ATTACH {_sql_string(str(self.path))} AS {self._alias}"
        if not write:
            sql += " (READ_ONLY)"
        delay = _BACKOFF_FIRST
        stale = True
        while True:
            try:
                cur.execute(sql)
                return
            except duckdb.Error as exc:
                if stale and ("already attached" in str(exc) or "already exists" in str(exc)):
                    stale = False
                    self._detach(cur)  # a previous session died before detaching
                    continue
                if not _is_lock_error(exc):
                    raise AuditError(f"cannot open audit database {self.path}: "
                                     f"{first_line(exc)}") from exc
                now = time.monotonic()
                if now >= deadline:
                    raise self._busy("is locked by another process") from exc
                # Equal jitter: never 0 (no hot spinning), never in lockstep.
                pause = min(delay, deadline - now)
                time.sleep(pause / 2 + random.uniform(0, pause / 2))
                delay = min(delay * 2, _BACKOFF_CAP)

    def _detach(self, cur: duckdb.DuckDBPyConnection) -> None:
        import duckdb

        try:
            cur.execute(f"DETACH DATABASE IF EXISTS {self._alias}")
        except duckdb.Error as exc:
            raise AuditError(f"cannot close audit database {self.path}: "
                             f"{first_line(exc)}") from exc

    # -------------------------------------------------------------- schema

    def ensure_schema(self) -> int:
        """Create or migrate the schema; return the version found before (0 = new file)."""
        import duckdb

        with self.session(write=True) as cur:
            try:
                return migrate(cur)
            except duckdb.Error as exc:
                raise AuditError(f"cannot set up audit database {self.path}: "
                                 f"{first_line(exc)}") from exc

    @contextmanager
    def reader(self, *, sealed: bool = False,
               fresh: bool = True) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read-only session on the analysts' file, brought up to date from the journal first.

        With `fresh` (the default) the file is synced from the journal beside
        it (created if only the journal exists) and migrated if it is older.
        `sealed`: see `session`.

        Raises:
            AuditError: No database there, or the file is not a kernel audit database.
        """
        if fresh:
            from ._sync import sync

            sync(self.path, lock_timeout=self.lock_timeout)
        with self.session(write=False, sealed=sealed) as cur:
            version = current_version(cur)
            if version is None:
                raise AuditError(f"{self.path} is not a kernel audit database "
                                 "(it has no schema_version table)")
            if version >= SCHEMA_VERSION:
                yield cur
                return
        self.ensure_schema()
        with self.session(write=False, sealed=sealed) as cur:
            yield cur
