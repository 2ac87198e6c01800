"""Defects found by an adversarial review of `kernel run -- CMD`, each pinned by a real process.

- What a command says while it is being stopped (its SIGTERM handler's last
  words: "interrupted, cleaning up") was lost: the readers of its pipes were
  cancelled with the step, before the group was signalled, so a timed-out,
  killed or Ctrl-C'd command's final output reached neither the terminal nor
  the audit.
- A daemon that left the command's group (`setsid`, a double fork) outlived
  the run: only the group was stopped, and only the lifeline watcher, at the
  supervising process's exit, swept the rest (a library host or a batch
  worker runs many commands before it exits).
- Under a parent that ignores SIGCHLD (inherited through exec), a command that
  ran and exited 7 was reported `cannot start 'sh': No such process` (exit
  126), its output unread: the exited child was reaped by the system before
  its pidfd was opened.

Every process started here is killed in a `finally` (pid files), and every
wait for another process polls a condition with a generous bound.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio
from procs import alive

from adapters.shell import ShellAgent
from kernel import Kernel, Limits, Ports, RunInfo, Status
from kernel.testing import MemoryAudit, ScriptedCritic

pytestmark = pytest.mark.realtime

#: How long a test waits for another process to get somewhere (never a measure of speed).
BOUND = 90.0


async def until(cond: Callable[[], bool], what: str, within: float = BOUND) -> None:
    """Poll `cond` until it holds (fails with `what` after `within` seconds)."""
    deadline = trio.current_time() + within
    while not cond():
        if trio.current_time() > deadline:
            pytest.fail(f"{what}: not within {within:.0f}s")
        await trio.sleep(0.02)


def wait_until(cond: Callable[[], bool], what: str, within: float = BOUND) -> None:
    """`until` for a test that is not async (a CLI subprocess)."""
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within:.0f}s")
        time.sleep(0.02)


def pid_in(path: Path) -> int | None:
    """The pid a command wrote to `path`, once it is whole."""
    with contextlib.suppress(OSError, ValueError):
        text = path.read_text()
        if text.endswith("\n"):
            return int(text)
    return None


@contextlib.contextmanager
def killed_after(*pidfiles: Path) -> Iterator[None]:
    """Whatever the test's outcome, SIGKILL every process whose pid a file holds."""
    try:
        yield
    finally:
        for path in pidfiles:
            pid = pid_in(path)
            if pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


def output_lines(audit: MemoryAudit, run_id: str) -> list[tuple[str | None, object]]:
    return [(e.name, e.payload["line"]) for e in audit.events(run_id) if e.kind == "output"]


class TestLastWordsWhileStopped:
    """A command stopped mid-step (kill, timeout, Ctrl-C) keeps what it prints on SIGTERM."""

    SCRIPT = ('trap "echo got TERM, cleaning up; echo bye from stderr >&2; exit 1" TERM; '
              'echo started; sleep 300 & echo $! > {pids}; wait')

    async def test_killed_command_output_is_echoed_and_audited(self, tmp_path: Path) -> None:
        """The critic kills the run at its first line; the trap's lines still arrive."""
        pids = tmp_path / "sleep.pid"
        chunks: list[tuple[str, bytes]] = []
        audit = MemoryAudit()
        agent = ShellAgent(["sh", "-c", self.SCRIPT.format(pids=pids)],
                           on_output=lambda stream, chunk: chunks.append((stream, chunk)))
        critic = ScriptedCritic(kill_at_activity="output", reason="test kill")
        with killed_after(pids):
            result = await Kernel(Ports(audit=audit, critic=critic)).run(
                agent, RunInfo(), Limits(timeout=BOUND))
        assert result.status is Status.KILLED
        lines = output_lines(audit, result.run_id)
        assert ("stdout", "got TERM, cleaning up") in lines
        assert ("stderr", "bye from stderr") in lines
        echoed = {s: b"".join(c for n, c in chunks if n == s) for s in ("stdout", "stderr")}
        assert echoed["stdout"] == b"started\ngot TERM, cleaning up\n"
        assert echoed["stderr"] == b"bye from stderr\n"
        # The run's record of the process still says it was stopped.
        [exit_event] = [e for e in audit.events(result.run_id) if e.kind == "process_exit"]
        assert exit_event.payload["stopped"] is True

    def test_ctrl_c_of_kernel_run_echoes_the_last_words(self, kernel_exe: str,
                                                        cli_env: dict[str, str],
                                                        tmp_path: Path) -> None:
        """SIGINT to `kernel run` (Ctrl-C): exit 130, and the command's goodbye is shown."""
        pids = tmp_path / "sleep.pid"
        proc = subprocess.Popen(
            [kernel_exe, "run", "--no-critic", "--", "sh", "-c", self.SCRIPT.format(pids=pids)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            env=cli_env, cwd=tmp_path)
        with killed_after(pids):
            try:
                wait_until(lambda: pid_in(pids) is not None or proc.poll() is not None,
                           "the command started")
                proc.send_signal(signal.SIGINT)
                out, err = proc.communicate(timeout=BOUND)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        assert proc.returncode == 130, err
        assert out == b"started\ngot TERM, cleaning up\n"
        assert b"bye from stderr\n" in err
        assert b"Traceback" not in err


class TestEscapedDescendants:
    """A process that left the command's group does not outlive the step."""

    @staticmethod
    def daemon(pidfile: Path, *, hold_pipes: bool = False) -> str:
        """Shell code starting a `setsid` daemon (its own session, so not in the command's
        group) and waiting until it has written its pid."""
        redirect = "" if hold_pipes else " </dev/null >/dev/null 2>&1"
        return (f"setsid sh -c 'echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; "
                f"exec sleep 300'{redirect} & "
                f"n=0; while [ ! -s {pidfile} ] && [ $n -lt 9000 ]; "
                f"do sleep 0.01; n=$((n+1)); done")

    async def test_setsid_daemon_is_stopped_when_the_command_exits(self,
                                                                   tmp_path: Path) -> None:
        """The command exits 0 leaving a daemon in a session of its own: the run still
        ends ok, and the daemon is gone once it has."""
        pidfile = tmp_path / "daemon.pid"
        with killed_after(pidfile):
            result = await Kernel().run(ShellAgent(["sh", "-c", self.daemon(pidfile)]),
                                        RunInfo(), Limits(timeout=BOUND))
            assert result.status is Status.OK, result.error
            pid = pid_in(pidfile)
            assert pid is not None
            await until(lambda: not alive(pid), "the daemon was stopped with the run")

    async def test_daemon_holding_the_pipes_is_stopped_and_its_output_kept(
            self, tmp_path: Path) -> None:
        """A daemon that keeps the command's stdout open: stopped, and what it printed
        before is in the output."""
        pidfile = tmp_path / "daemon.pid"
        script = f"echo from-parent; {self.daemon(pidfile, hold_pipes=True)}; echo done"
        with killed_after(pidfile):
            result = await Kernel().run(ShellAgent(["sh", "-c", script], grace=0.5),
                                        RunInfo(), Limits(timeout=BOUND))
            assert result.status is Status.OK, result.error
            assert result.output == "from-parent\ndone"
            pid = pid_in(pidfile)
            assert pid is not None
            await until(lambda: not alive(pid), "the daemon was stopped with the run")

    async def test_daemon_of_a_cancelled_command_is_stopped(self, tmp_path: Path) -> None:
        """The run is killed mid-step: the daemon the command had started goes with it."""
        pidfile = tmp_path / "daemon.pid"
        script = f"{self.daemon(pidfile)}; echo ready; sleep 300"
        critic = ScriptedCritic(kill_at_activity="output")
        with killed_after(pidfile):
            result = await Kernel(Ports(critic=critic)).run(
                ShellAgent(["sh", "-c", script]), RunInfo(), Limits(timeout=BOUND))
            assert result.status is Status.KILLED
            pid = pid_in(pidfile)
            assert pid is not None
            await until(lambda: not alive(pid), "the daemon was stopped with the run")


IGNORE_SIGCHLD = ("import os, signal, sys; signal.signal(signal.SIGCHLD, signal.SIG_IGN); "
                  "os.execv(sys.argv[1], sys.argv[1:])")


class TestIgnoredSigchld:
    """A `kernel run` whose parent ignores SIGCHLD (inherited through exec) still sees
    its command's exit code and output."""

    def test_exit_code_and_output_survive_an_ignored_sigchld(
            self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
        proc = subprocess.run(
            [sys.executable, "-c", IGNORE_SIGCHLD, kernel_exe, "run", "--no-critic", "--",
             "sh", "-c", "echo hi; exit 7"],
            capture_output=True, env=cli_env, cwd=tmp_path, timeout=BOUND,
            stdin=subprocess.DEVNULL)
        assert proc.returncode == 7, proc.stderr
        assert proc.stdout == b"hi\n"
        assert b"cannot start" not in proc.stderr

    async def test_in_process(self) -> None:
        """A host process that ignores SIGCHLD itself: the library does not change the
        host's disposition (the host relies on its children being reaped), and a
        command's exit status would be lost (a worker thread read 0: `ok` for a failed
        command). It refuses to start the command, saying why; nothing runs."""
        before = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        try:
            result = await Kernel().run(ShellAgent(["sh", "-c", "echo hi; exit 7"]))
            thread = await trio.to_thread.run_sync(
                lambda: trio.run(Kernel().run, ShellAgent(["sh", "-c", "exit 7"])))
            assert signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN  # left as it was
        finally:
            signal.signal(signal.SIGCHLD, before)
        for got in (result, thread):
            assert got.status is Status.ERROR and got.exit_code == 126, got.error
            assert "SIGCHLD is ignored" in (got.error or "")
        assert result.output is None or "hi" not in result.output
