"""`PsutilProbe` on real processes: CPU, I/O, the process tree, a blocked stdin read.

Each test starts a real process, waits for it to say it is ready (a line on
stdout), and then polls the probe until it sees what it should, within a
generous bound: a loaded machine makes it slower, never wrong.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import pytest

from batteries.critic import PsutilProbe, TreeSample

T = TypeVar("T")
BOUND = 30.0  # seconds a condition may take to show on a loaded machine


@contextmanager
def started(code: str, *, stdin: int | None = subprocess.DEVNULL
            ) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=stdin, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def eventually(fn: Callable[[], T | None]) -> T:
    end = time.monotonic() + BOUND
    while time.monotonic() < end:
        value = fn()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("the probe never saw it")


def sample(probe: PsutilProbe, pid: int) -> TreeSample:
    s = probe.sample(pid)
    assert s is not None
    return s


def test_cpu_time_advances_for_a_busy_process() -> None:
    probe = PsutilProbe()
    with started("print('ready', flush=True)\nwhile True: pass") as proc:
        first = sample(probe, proc.pid)
        eventually(lambda: sample(probe, proc.pid).cpu_s > first.cpu_s + 0.05)


def test_bytes_written_advance_for_a_silent_writer() -> None:
    probe = PsutilProbe()
    code = ("import os, time, tempfile\nprint('ready', flush=True)\n"
            "f = tempfile.TemporaryFile()\n"
            "while True:\n    f.write(b'x' * 65536); f.flush(); f.seek(0); time.sleep(0.01)")
    with started(code) as proc:
        first = sample(probe, proc.pid)
        eventually(lambda: sample(probe, proc.pid).io_bytes > first.io_bytes + (1 << 20))


def test_the_tree_includes_children_and_a_sleeper_is_flat() -> None:
    probe = PsutilProbe()
    code = ("import subprocess, sys, time\n"
            "c = subprocess.Popen(['sleep', '60'])\nprint('ready', flush=True)\ntime.sleep(60)")
    with started(code) as proc:
        tree = eventually(lambda: (s := sample(probe, proc.pid)) and len(s.pids) == 2 and s)
        assert proc.pid in tree.pids
        assert probe.input_waits(tree.pids) == ()
        later = eventually(lambda: sample(probe, proc.pid))
        assert later.pids == tree.pids


def test_a_blocked_stdin_read_is_seen() -> None:
    probe = PsutilProbe()
    code = "import sys\nprint('ready', flush=True)\nsys.stdin.readline()"
    with started(code, stdin=subprocess.PIPE) as proc:
        waits = eventually(lambda: probe.input_waits([proc.pid]))
        assert waits[0].startswith(f"{proc.pid}:")


def test_a_gone_process_samples_as_none() -> None:
    probe = PsutilProbe()
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert probe.sample(proc.pid) is None


@pytest.mark.parametrize("pid", [0, 2 ** 22 + 7])
def test_nonsense_pids_are_gone(pid: int) -> None:
    assert PsutilProbe().sample(pid) is None
