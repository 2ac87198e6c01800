"""Process helpers shared by the adapter tests: is a pid (or a process group) gone?

Read from /proc, ignoring zombies: a SIGKILLed process is dead even while it
waits for its parent (or init) to reap it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import trio


def _stat(pid: int | str) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """True while `pid` is a running (not zombie) process."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def live_members(pgid: int) -> list[int]:
    """Pids of the non-zombie processes in process group `pgid`."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(entry)
            if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(entry))
    return members


async def gone(pid: int, within: float = 2.0) -> bool:
    """True once `pid` has died (a SIGKILLed process takes a moment to be torn down)."""
    for _ in range(int(within / 0.02)):
        if not alive(pid):
            return True
        await trio.sleep(0.02)
    return not alive(pid)


def group_gone(pgid: int, within: float = 2.0) -> bool:
    """True once no live process of the group is left (blocking; for sync callers)."""
    deadline = time.monotonic() + within
    while live_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
