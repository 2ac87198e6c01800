"""adapters._proc: the lifeline under a supervisor that is SIGKILLed (real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.realtime

ROOT = Path(__file__).resolve().parents[2]

#: A supervisor: starts a group, has its watcher killed, starts another, then waits.
SUPERVISOR = """
import os, signal, sys, trio
sys.path.insert(0, sys.argv[1])
from adapters import _proc

async def main():
    first = await _proc.spawn(["sleep", "300"])
    watcher = _proc._LIFELINE.watcher
    os.kill(watcher.pid, signal.SIGKILL)
    watcher.wait()
    second = await _proc.spawn(["sh", "-c", "sleep 300 & wait"])
    print(first.pid, second.pid, _proc._LIFELINE.watcher.pid, flush=True)
    await trio.sleep(300)

trio.run(main)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2:].split()[0] != b"Z"


def test_a_dead_watcher_is_replaced() -> None:
    """Kill the watcher, spawn again: a new one takes over; SIGKILL of the supervisor ends both."""
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(ROOT)],
                           stdout=subprocess.PIPE, text=True)
    assert sup.stdout is not None
    first, second, watcher = map(int, sup.stdout.readline().split())
    assert alive(first) and alive(second) and alive(watcher)
    os.kill(sup.pid, signal.SIGKILL)
    sup.wait(timeout=30)
    deadline = time.monotonic() + 30  # generous: the watcher acts within milliseconds
    while any(alive(p) for p in (first, second, watcher)):
        assert time.monotonic() < deadline, "a group outlived its supervisor"
        time.sleep(0.01)
