"""One kernel run at a time in a pane, across processes: an advisory lock file per pane.

Two runs typing into one pane at once garble each other's input, and each
would read the other's answer as its own. A run takes the pane's lock before
it types anything and keeps it until its turn is over; a run that finds the
lock taken does not wait (its critic would nudge a run that is only queued,
and a nudge typed into the pane would land in the other run's turn): it fails
at once, naming the run holding the pane.

The lock is `flock(2)` on a file under `$XDG_RUNTIME_DIR/kernel-panes` (else
`<tmp>/kernel-panes-<uid>`), named after the multiplexer's key for the pane
(tmux: the server's socket path and the pane id, so `dev`, `dev:0.0` and `%3`
are one pane). The kernel drops an flock when its holder exits, however it
exits, so a crashed run never leaves a pane locked.

The fallback directory is in a shared, world-writable place whose name anyone
can guess: another user could create it first and plant a pane's lock file as
a symlink to one of our files, which taking the lock would truncate. So the
directory must be ours, a real directory, and closed to others, and the lock
file is opened without following links and must be a plain file of ours;
otherwise `PaneLockError`, and nothing is typed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

from ._errors import PaneLockError


class PaneInUse(Exception):
    """Another process holds the pane's lock; the message names it."""


def lock_dir() -> Path:
    """The directory of the pane locks (created private to the user).

    Raises:
        PaneLockError: It exists but is a link, not ours, or open to others.
    """
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    base = (Path(runtime) / "kernel-panes" if runtime and os.path.isdir(runtime)
            else Path(tempfile.gettempdir()) / f"kernel-panes-{os.getuid()}")
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private_dir(base)
    return base


def _check_private_dir(path: Path) -> None:
    """Refuse a lock directory another user could put files into (see the module doc)."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise PaneLockError(f"unsafe pane lock directory {path}: it is not a directory "
                            "(a link?); remove it")
    if info.st_uid != os.getuid():
        raise PaneLockError(f"unsafe pane lock directory {path}: owned by uid {info.st_uid}, "
                            f"not by this user ({os.getuid()}); remove it")
    if info.st_mode & 0o022:
        raise PaneLockError(f"unsafe pane lock directory {path}: others may write into it "
                            f"(mode {stat.S_IMODE(info.st_mode):o}); remove it or chmod 700")


def _open_lock_file(path: Path) -> int:
    """Open (or create) the lock file itself: never through a link, never a file not ours."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise PaneLockError(f"cannot open the pane lock {path}: {exc.strerror or exc} "
                            "(a link is refused); remove it") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_nlink != 1:
        os.close(fd)
        raise PaneLockError(f"unsafe pane lock {path}: not a plain file of this user's "
                            "with one name; remove it")
    return fd


class PaneLock:
    """The lock of one pane, held from `acquire` until `release` (or the process's exit).

    Args:
        key: What names the pane on its machine (see `TmuxMultiplexer.pane_key`).
        target: The pane as the user named it, for messages.
    """

    def __init__(self, key: str, target: str) -> None:
        self.key = key
        self.target = target
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        self.path = lock_dir() / f"{digest}.lock"
        self._fd: int | None = None

    def acquire(self, holder: dict[str, Any]) -> None:
        """Take the lock at once, writing `holder` (run id, ...) into the file.

        Raises:
            PaneInUse: Another process holds it (the message says which run).
            PaneLockError: The lock file is not safe to use (see the module doc).
        """
        fd = _open_lock_file(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = _read_holder(fd)
            os.close(fd)
            raise PaneInUse(_describe(self.target, other)) from None
        except BaseException:
            os.close(fd)
            raise
        record = json.dumps({**holder, "pid": os.getpid(), "since": time.time(),
                             "key": self.key}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        self._fd = fd

    def release(self) -> None:
        """Let the pane go (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)  # closing the only descriptor drops the flock


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        raw = os.pread(fd, 4096, 0)
        value = json.loads(raw) if raw else {}
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _describe(target: str, holder: dict[str, Any]) -> str:
    parts = []
    run = holder.get("run_id")
    if isinstance(run, str) and run:
        parts.append(f"run {run}")
    if isinstance(holder.get("what"), str):
        parts.append(holder["what"])
    if isinstance(holder.get("pid"), int):
        parts.append(f"pid {holder['pid']}")
    since = holder.get("since")
    if isinstance(since, (int, float)):
        parts.append(f"for {max(0.0, time.time() - since):.0f}s")
    who = f" ({', '.join(parts)})" if parts else ""
    return (f"pane {target} is in use by another kernel run{who}: one run at a time "
            "types into a pane; try again when it is done")
