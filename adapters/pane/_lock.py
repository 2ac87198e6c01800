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
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any


class PaneInUse(Exception):
    """Another process holds the pane's lock; the message names it."""


def lock_dir() -> Path:
    """The directory of the pane locks (created private to the user)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    base = (Path(runtime) / "kernel-panes" if runtime and os.path.isdir(runtime)
            else Path(tempfile.gettempdir()) / f"kernel-panes-{os.getuid()}")
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    return base


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
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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
