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

    `~` is expanded; the path is not required to exist.
    """
    if explicit is not None and str(explicit):
        return Path(explicit).expanduser()
    env = os.environ.get(DB_ENV, "")
    if env:
        return Path(env).expanduser()
    return default_db_path()


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
