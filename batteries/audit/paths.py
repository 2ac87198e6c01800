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

    `~` is expanded; the path is not required to exist, but it must be able to
    become the analysts' file (`check_db_path`). Every store beside a file
    resolves it here (`batteries.store.open_store`, so `Journal`,
    `JournalAudit.open` and `batteries.runner.open_ports` too): a bad path is
    refused before any run starts, never found out when its audit is dropped.

    Raises:
        ConfigError: The path ends with a slash, is a directory or another
            non-file, or is a file that is not a DuckDB database while no
            journal exists beside it (the journal would be created by importing it).
    """
    if explicit is not None and str(explicit):
        return check_db_path(explicit)
    env = os.environ.get(DB_ENV, "")
    if env:
        return check_db_path(env, source=f"${DB_ENV}")
    return check_db_path(default_db_path())


#: Bytes 8-11 of every DuckDB database file (after the header block's checksum).
DUCKDB_MAGIC = b"DUCK"


def not_duckdb(path: str | os.PathLike[str]) -> str | None:
    """Why the existing file `path` is not a DuckDB database (None: it is one, or is absent).

    Reads the first 12 bytes only. An empty file is not a database: DuckDB
    refuses to open one, and the kernel never replaces a file it did not make.
    """
    if not os.path.lexists(path):
        return None  # nothing there (or no way there: that is the directory's problem)
    head = _header(path, 12)
    if head is None or isinstance(head, str):
        return head
    if not head:
        return "it is empty (0 bytes)"
    if head[8:12] != DUCKDB_MAGIC:
        return "it is not a DuckDB database file"
    return None


#: The first 16 bytes of every SQLite database file.
SQLITE_MAGIC = b"SQLite format 3\x00"


def not_a_journal(path: Path) -> str | None:
    """Why the existing file `path` cannot be a journal (None: it may be one, or is absent).

    Reads its header only: damage past the header is found when it is opened.
    An empty file is a journal SQLite has not written yet.
    """
    head = _header(path, 16)
    if head is None or isinstance(head, str):
        return head
    if head and head != SQLITE_MAGIC[:len(head)]:
        return "it is not a SQLite file (damaged, or not a journal)"
    return None


def _header(path: str | os.PathLike[str], size: int) -> bytes | str | None:
    """The first `size` bytes of the file `path`; None if there is none; a str saying why
    it cannot be read (a directory, no permission)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(size)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except IsADirectoryError:
        return "it is a directory"
    except OSError as exc:
        return f"it cannot be read: {exc.strerror or exc}"


#: The files whose headers this process has read (`_may_read`, where there is no /proc).
_read_once: set[str] = set()


def _may_read(*paths: Path) -> bool:
    """True if the headers of `paths` may be read here: not while this process has one of
    them open (where /proc cannot tell, only once per process, before any is opened).

    SQLite and DuckDB lock their files with POSIX record locks, and closing *any*
    descriptor of a file drops every such lock the process holds on it: opening a
    journal to read its header while this process writes it (a batch resuming)
    let another process write at the same time and corrupt it.
    """
    keys = {os.path.abspath(p) for p in paths}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:  # no /proc: the first time only
        fresh = not keys <= _read_once
        _read_once.update(keys)
        return fresh
    for fd in fds:
        try:
            if os.readlink(f"/proc/self/fd/{fd}") in keys:
                return False
        except OSError:
            continue
    return True


def check_db_path(raw: str | os.PathLike[str], *, source: str | None = None,
                  content: bool = True) -> Path:
    """`raw` as the analysts' file's path, if it can be one (see `resolve_db_path`).

    `source` names where `raw` came from (`$KERNEL_DB`) in the error. Without
    `content` only the path's shape is checked, not what an existing file
    holds (with a shared server as the store, no journal is made from it).

    Raises:
        ConfigError: As `resolve_db_path` says.
    """
    from kernel import ConfigError

    text = os.fspath(raw)
    where = f" ({source})" if source else ""
    path = Path(text).expanduser()
    if text.endswith(("/", os.sep)):
        raise ConfigError(f"audit database {text!r}{where} ends with a slash: give a file, "
                          f"e.g. {path / 'kernel.duckdb'}")
    if path.is_dir():
        raise ConfigError(f"audit database {path}{where} is a directory: give a file, "
                          f"e.g. {path / 'kernel.duckdb'}")
    if path.exists() and not path.is_file():
        raise ConfigError(f"audit database {path}{where} is not a regular file")
    from batteries.store.paths import journal_path

    journal = journal_path(path)
    if content and not _may_read(journal, path):
        return path  # (this process has one open: it was checked before it was opened)
    if content and (damaged := not_a_journal(journal)) is not None:
        raise ConfigError(f"journal {journal}{where} is not usable: {damaged}; move it away "
                          "(a new one is started with the budgets and resumable runs the "
                          "analysts' file held at its last `kernel sync`)")
    problem = not_duckdb(path) if content else None
    if content and problem is not None and not journal.exists():
        raise ConfigError(f"audit database {path}{where} is not usable: {problem} (and no "
                          "journal exists beside it to record into); give another path, or "
                          "move the file away")
    if content and problem is None and not journal.exists() and path.exists():
        _refuse_foreign_file(path)
    return path


def _refuse_foreign_file(path: Path) -> None:
    """Refuse the DuckDB file `path` if it is somebody else's (a mistyped `--db`).

    Only before its first journal is made (once per database): a run would
    otherwise be recorded beside a file no analysts' command reads. A file
    another process holds locked is left to the journal's creation, which
    checks it again.

    Raises:
        ConfigError: `path` has tables of its own and no `schema_version`.
    """
    import duckdb

    from ._schema import current_version, refuse_foreign

    try:
        con = duckdb.connect(str(path), read_only=True)
    except duckdb.Error:
        return  # locked, or damaged: what opens it next says so
    try:
        cur = con.cursor()
        if current_version(cur) is None:
            refuse_foreign(cur)
    finally:
        con.close()


# ------------------------------------------------------------ private files
#
# The audit holds run inputs, outputs and tool arguments: only its owner may
# read it, whatever the umask. Everything the kernel stores on disk (the
# DuckDB file, its lock file, Parquet exports, a journal beside them) is made
# with these helpers: directories 0700, files 0600.

#: Mode of every directory the kernel creates for its data.
PRIVATE_DIR_MODE = 0o700
#: Mode of every data file the kernel creates.
PRIVATE_FILE_MODE = 0o600


def make_private_dir(directory: str | os.PathLike[str]) -> Path:
    """Create `directory` and any missing parents with mode 0700 (umask ignored).

    Directories that already exist are left as they are. Returns the path.

    Raises:
        OSError: A directory cannot be created (or a file is in the way).
    """
    path = Path(directory)
    missing = []
    for d in (path, *path.parents):
        if d.is_dir():
            break
        missing.append(d)
    for d in reversed(missing):
        try:
            os.mkdir(d, PRIVATE_DIR_MODE)
        except FileExistsError:
            if not d.is_dir():
                raise
            continue  # made by another process meanwhile: not ours to change
        os.chmod(d, PRIVATE_DIR_MODE)  # the umask may have taken bits away
    return path


def open_private_file(path: str | os.PathLike[str], flags: int) -> int:
    """`os.open(path, flags | O_CREAT)` with mode 0600 for a file it creates; returns the fd.

    The mode is set when the file is created, so it is never readable by
    others, not even for a moment. An existing file keeps its mode.
    """
    return os.open(path, flags | os.O_CREAT, PRIVATE_FILE_MODE)


def make_private_file(path: str | os.PathLike[str]) -> None:
    """Set an existing file we just wrote (e.g. one DuckDB created) to mode 0600."""
    os.chmod(path, PRIVATE_FILE_MODE)
