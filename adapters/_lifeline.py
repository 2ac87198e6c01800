"""The lifeline watcher: kills what a supervisor started once the supervisor is gone.

Run as a script (`python -I -S _lifeline.py TOKEN`, standard library only) by
`adapters._proc`. Its stdin is a pipe whose only writer is the supervisor.
The supervisor writes one line per process group it starts (`+ PGID START`)
and one when the group is gone (`- PGID`, sent along with the next `+`
line). End of file means the supervisor died (a SIGKILL, a crash, the OOM
killer): the watcher then SIGKILLs every registered group whose leader is
still the process that was registered (or,
the leader gone, whatever is still in its group), and on Linux every process
whose environment carries TOKEN, which covers a child started in the
moment before its registration reached the pipe and descendants that left
the group without clearing their environment. Then it waits (up to
`GONE_WITHIN` seconds) until what it killed is gone, not merely signalled (a
killed process holds its files, a lock among them, until it is through its
exit, and its environment reads empty meanwhile): while the watcher lives,
something of the dead supervisor may still be on its way out. Then it exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

#: How long the watcher waits for what it killed to be gone (only a process stuck in
#: the kernel, in uninterruptible I/O or held at exit by a tracer, takes longer).
GONE_WITHIN = 10.0


def start_time(pid: int) -> int | None:
    """The start time of `pid` (clock ticks since boot), or None if it is gone or unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    return int(fields[19])


def _live() -> list[tuple[int, list[bytes]]]:
    """(pid, the fields of /proc/PID/stat after its name) of every process not yet a
    zombie (a zombie is dead already; one dying still holds its files)."""
    found: list[tuple[int, list[bytes]]] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2:].split()
        if len(fields) >= 20 and fields[0] != b"Z":
            found.append((int(name), fields))
    return found


def group_members(pgid: int) -> list[int]:
    """Pids whose process group is `pgid` (Linux; empty elsewhere)."""
    return [pid for pid, fields in _live() if int(fields[2]) == pgid]


def stop_group(pgid: int, started: int | None) -> bool:
    """SIGKILL group `pgid` if it is still the one registered (a reused pid is left
    alone); whether it was signalled."""
    now = start_time(pgid)
    if now is not None and started is not None and now != started:
        return False  # the leader's pid now belongs to another process; its group is not ours
    if now is None and started is not None and not group_members(pgid):
        return False
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        return False
    return True


def alive(groups: set[int], pids: dict[int, int | None]) -> bool:
    """Whether a process of `groups`, or one of `pids` (with the start time it had),
    is still alive: not yet a zombie (one dying still holds its files)."""
    return any(int(fields[2]) in groups
               or (pid in pids and pids[pid] in (None, int(fields[19])))
               for pid, fields in _live())


def wait_gone(groups: set[int], pids: dict[int, int | None]) -> None:
    """Wait until nothing of `groups` and `pids` is alive, up to `GONE_WITHIN` seconds."""
    deadline = time.monotonic() + GONE_WITHIN
    pause = 0.002
    while (groups or pids) and alive(groups, pids) and time.monotonic() < deadline:
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def carriers(token: bytes) -> list[int]:
    """Pids (other than this one) whose environment holds `token`."""
    me = os.getpid()
    found: list[int] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if token in env:
            found.append(int(name))
    return found


def main() -> None:
    token = sys.argv[1].encode()
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    groups: dict[int, int | None] = {}
    stream = sys.stdin.buffer
    for raw in stream:
        parts = raw.split()
        if len(parts) >= 2 and parts[0] == b"+":
            groups[int(parts[1])] = int(parts[2]) if len(parts) > 2 and parts[2] != b"-" \
                else None
        elif len(parts) == 2 and parts[0] == b"-":
            groups.pop(int(parts[1]), None)
    # End of file: the supervisor is gone.
    killed_groups = {pgid for pgid, started in groups.items() if stop_group(pgid, started)}
    killed: dict[int, int | None] = {}
    for _ in range(50):  # until nothing carrying the token is left (they may be forking)
        pids = carriers(token)
        if not pids:
            break
        for pid in pids:
            started = start_time(pid)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                killed.setdefault(pid, started)
    wait_gone(killed_groups, killed)


if __name__ == "__main__":
    main()
