"""adapters._proc: the lifeline under a supervisor that is SIGKILLed (real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import alive

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


async def test_exit_status_reaped_once_for_concurrent_waiters() -> None:
    """Two tasks waiting on one child both get its status; stop() after exit is harmless."""
    import trio

    from adapters import _proc

    child = await _proc.spawn(["sh", "-c", "read x; exit 7"], stdin_pipe=True)
    got: list[int] = []
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(lambda: _wait_into(child, got))
        await trio.testing.wait_all_tasks_blocked()
        assert child.stdin is not None
        await child.stdin.send_all(b"go\n")
    assert got == [7, 7] and child.returncode == 7
    await child.stop(1.0)
    assert child.returncode == 7 and not alive(child.pid)


async def _wait_into(child: object, got: list[int]) -> None:
    from adapters._proc import Child

    assert isinstance(child, Child)
    got.append(await child.wait())


async def test_signal_status_and_pipes() -> None:
    """A death by signal is -N; stdout and stderr arrive on their own streams (or merged)."""
    from adapters import _proc

    child = await _proc.spawn(["sh", "-c", "echo out; echo err >&2; kill -TERM $$"])
    assert child.stdout is not None and child.stderr is not None and child.stdin is None
    assert await child.stdout.receive_some() == b"out\n"
    assert await child.stderr.receive_some() == b"err\n"
    assert await child.wait() == -signal.SIGTERM
    await child.stop(1.0)
    merged = await _proc.spawn(["sh", "-c", "echo out; echo err >&2"], merge_stderr=True)
    assert merged.stderr is None and merged.stdout is not None
    data = b""
    while chunk := await merged.stdout.receive_some():
        data += chunk
    assert data == b"out\nerr\n" and await merged.wait() == 0
    await merged.stop(1.0)


async def test_wait_without_pidfd() -> None:
    """Where there is no pidfd the exit is awaited in a thread (`waitid`, left unreaped)."""
    import trio

    from adapters import _proc

    child = await _proc.spawn(["sh", "-c", "exit 3"])
    await trio.to_thread.run_sync(_proc._waitid, child.pid)
    assert child.returncode is None  # not reaped by the wait: Popen reaps it
    assert await child.wait() == 3
    await child.stop(1.0)


async def test_a_command_that_cannot_start_leaks_no_pipe(tmp_path: Path) -> None:
    """Not found / not executable raise OSError and leave no descriptor open."""
    from adapters import _proc

    plain = tmp_path / "plain.txt"
    plain.write_text("not a program\n")
    plain.chmod(0o644)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(FileNotFoundError):
        await _proc.spawn(["/nonexistent/command"], stdin_pipe=True)
    with pytest.raises(PermissionError):
        await _proc.spawn([str(plain)])
    assert set(os.listdir("/proc/self/fd")) <= before


async def test_environment_inherited_or_given_with_the_lifeline(monkeypatch: pytest.MonkeyPatch,
                                                                ) -> None:
    """No env: this process's environment as it is now; an env: exactly it. Both carry
    the lifeline tokens (an inherited one kept in front of ours)."""
    from adapters import _proc

    async def env_of(**kw: object) -> dict[str, str]:
        child = await _proc.spawn(["env"], **kw)  # type: ignore[arg-type]
        assert child.stdout is not None
        data = b""
        while chunk := await child.stdout.receive_some():
            data += chunk
        await child.stop(1.0)
        return dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)

    monkeypatch.setenv("KERNEL_TEST_SPAWN_ENV", "café")
    token = _proc.lifeline_token()
    inherited = await env_of()
    assert inherited["KERNEL_TEST_SPAWN_ENV"] == "café"
    assert inherited[_proc.LIFELINE_ENV].split(":")[-1] == token
    given = await env_of(env={"ONLY": "this", _proc.LIFELINE_ENV: "klouter"})
    assert given == {"ONLY": "this", _proc.LIFELINE_ENV: f"klouter:{token}"}


@pytest.mark.parametrize("how", ["posix_spawn", "popen", "many_fds", "own_fds",
                                 "own_fds_many"])
async def test_a_child_gets_fds_0_to_2_only_and_default_sigpipe(tmp_path: Path,
                                                                 how: str) -> None:
    """Every way of starting (posix_spawn here, listing the inheritable fds, or making
    every fd close-on-exec in a process that owns its fds (`own_fds`: `kernel batch`);
    Popen for another working directory, or with hundreds of fds open) closes every
    other fd in the child, an inheritable one too, and gives back SIGPIPE."""
    from adapters import _proc

    elsewhere = how == "popen"
    r, w = os.pipe()
    high = os.dup2(w, 200, inheritable=True)  # as a parent shell might leave one open
    many = [os.open(os.devnull, os.O_RDONLY)
            for _ in range(300 if how in ("many_fds", "own_fds_many") else 0)]
    if how.startswith("own_fds") and not _proc.own_fds():
        for fd in (r, w, high, *many):
            os.close(fd)
        pytest.skip("close_range(CLOSE_RANGE_CLOEXEC) needs Linux >= 5.11")
    try:
        child = await _proc.spawn(
            ["sh", "-c", "ls /proc/self/fd; echo --; grep SigIgn /proc/self/status; pwd"],
            cwd=str(tmp_path) if elsewhere else None)
        assert child.stdout is not None
        data = b""
        while chunk := await child.stdout.receive_some():
            data += chunk
        assert await child.wait() == 0
        await child.stop(1.0)
    finally:
        _proc.own_fds(False)
        for fd in (r, w, high, *many):
            os.close(fd)
    listing, rest = data.decode().split("--")
    fds = {int(x) for x in listing.split()}
    assert fds <= {0, 1, 2, 3}, fds  # 3: the listing's own
    lines = rest.split()
    ignored = int(lines[lines.index("SigIgn:") + 1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1))
    assert lines[-1] == (str(tmp_path) if elsewhere else os.getcwd())
