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
the group without clearing their environment. Then it exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys


def start_time(pid: int) -> int | None:
    """The start time of `pid` (clock ticks since boot), or None if it is gone or unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    return int(fields[19])


def group_members(pgid: int) -> list[int]:
    """Pids whose process group is `pgid` (Linux; empty elsewhere)."""
    found: list[int] = []
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
        if int(fields[2]) == pgid and fields[0] != b"Z":  # a zombie is dead already
            found.append(int(name))
    return found


def stop_group(pgid: int, started: int | None) -> None:
    """SIGKILL group `pgid` if it is still the one registered (a reused pid is left alone)."""
    now = start_time(pgid)
    if now is not None and started is not None and now != started:
        return  # the leader's pid now belongs to another process; its group is not ours
    if now is None and started is not None and not group_members(pgid):
        return
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


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
    for pgid, started in groups.items():
        stop_group(pgid, started)
    for _ in range(50):  # until nothing carrying the token is left (they may be forking)
        pids = carriers(token)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
