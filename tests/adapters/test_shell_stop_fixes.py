"""A stop (Ctrl-C, a host cancel) that finds the command already exited.

Before: `ShellAgent`, after the command's own exit, settles what it left behind
(`Child.settle`: children holding its pipes get a moment, then SIGTERM, then
SIGKILL) and reads its pipes to their end (`drain_while_moving`), unshielded; a
stop landing there ended the run `cancelled` (exit 130) although the command had
finished (its `process_exit` said exit 0, `"stopped": true`), and `kernel batch
--resume` ran the command again (1-2 per stop at -j 32 with short commands).
Now the command's own status ends the run (ok for 0, error for its code), its
output audited, with a `stop_after_exit` event; the stop only hurries the rest
(SIGTERM at once, SIGKILL within the settle's own grace, the echo not waited
for). A stop while the command still runs is `cancelled`, as before.

Real processes throughout; every wait on another process polls a condition (a
file, a journal row) with a generous bound; the window a stop must land in is
held open by the test itself (a leftover that waits for a file, or a writer
outside the group that keeps the run's echo full), never by a sleep.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import trio

from adapters.shell import ShellAgent
from kernel import Kernel, Limits, Ports, RunInfo, Status
from kernel.testing import MemoryAudit, RecordingDelivery

pytestmark = pytest.mark.realtime

#: How long a test waits for another process to get somewhere (never a measure of speed).
BOUND = 120.0

#: What must never reach the CLI's stderr.
NOISE = ("Traceback", "Exception ignored")


async def until(cond: Callable[[], bool], what: str) -> None:
    deadline = trio.current_time() + BOUND
    while not cond():
        if trio.current_time() > deadline:
            pytest.fail(f"{what}: not within {BOUND:.0f}s")
        await trio.sleep(0.01)


def events(audit: MemoryAudit, run_id: str, kind: str) -> list[dict[str, Any]]:
    return [e.payload for e in audit.events(run_id) if e.kind == kind]


async def run_and_stop(agent: ShellAgent, when: Callable[[], bool],
                       then: Callable[[], None] = lambda: None
                       ) -> tuple[Any, MemoryAudit, RunInfo, bool, float]:
    """Run `agent`, cancelling the host's scope once `when()` holds (then `then()`).

    Returns (the delivered result, the audit, the run's info, whether the Cancelled
    reached the host, seconds from the stop to the run's end)."""
    audit, delivery, info = MemoryAudit(), RecordingDelivery(), RunInfo(name="stop")
    stopped_at: list[float] = []
    with trio.CancelScope() as host:
        async with trio.open_nursery() as nursery:
            async def stop() -> None:
                await until(when, "the stop's moment")
                stopped_at.append(trio.current_time())
                host.cancel()
                then()

            nursery.start_soon(stop)
            await Kernel(Ports(audit=audit, delivery=delivery)).run(
                agent, info, Limits(timeout=600))
            nursery.cancel_scope.cancel()
    assert stopped_at, "the run ended before the stop"
    [result] = delivery.delivered
    return result, audit, info, host.cancelled_caught, trio.current_time() - stopped_at[0]


class TestStopWhileItSettles:
    @pytest.mark.parametrize(("code", "status"), [(0, Status.OK), (3, Status.ERROR)])
    async def test_leftovers_hold_its_pipes(self, tmp_path: Path, code: int,
                                            status: Status) -> None:
        """`sh -c '(...) & echo hi; exit N'`: sh has exited (reaped) and its background
        child, which ignores SIGTERM, holds the pipes when the host cancels. The run
        ends with the command's own status and code (before: cancelled), `hi` and what
        the leftover printed audited, `process_exit` not marked stopped."""
        ready, release = tmp_path / "ready", tmp_path / "release"
        # The leftover: waits until sh is gone (reaped: the settle is under way), says
        # so, then holds the pipes until the test lets it go (after the stop).
        leftover = (f'trap "" TERM; while kill -0 $$ 2>/dev/null; do sleep 0.01; done; '
                    f'echo late; touch {shlex.quote(str(ready))}; '
                    f'while [ ! -e {shlex.quote(str(release))} ]; do sleep 0.01; done')
        agent = ShellAgent(["sh", "-c", f"({leftover}) & echo hi; exit {code}"], grace=60)
        result, audit, info, cancelled, took = await run_and_stop(
            agent, ready.exists, release.touch)
        assert (result.status, result.exit_code) == (status, code), result
        assert result.output == "hi\nlate"
        [exit_event] = events(audit, info.run_id, "process_exit")
        assert exit_event == {"exit_code": code, "signal": None}
        assert events(audit, info.run_id, "stop_after_exit") == [{"exit_code": code}]
        lines = [e.payload["line"] for e in audit.events(info.run_id) if e.kind == "output"]
        assert lines == ["hi", "late"]
        assert not cancelled  # Kernel.run returned its result; the host's cancel stands
        assert took < BOUND

    async def test_the_stop_is_bounded_by_the_grace(self, tmp_path: Path) -> None:
        """A leftover that ignores SIGTERM and never lets the pipes go: the stop sends
        SIGTERM at once and SIGKILL once the grace runs out, and the run still ends with
        the command's status; nothing of the command is left alive."""
        ready, pidfile = tmp_path / "ready", tmp_path / "leftover.pid"
        # (In a subshell `$$` is still sh's pid: the leftover's own is its child's $PPID.)
        leftover = (f'trap "" TERM; sh -c \'echo $PPID\' > {shlex.quote(str(pidfile))}; '
                    f'while kill -0 $$ 2>/dev/null; do sleep 0.01; done; '
                    f'touch {shlex.quote(str(ready))}; while :; do sleep 0.01; done')
        agent = ShellAgent(["sh", "-c", f"({leftover}) & exit 0"], grace=1.0)
        result, audit, info, _, took = await run_and_stop(agent, ready.exists)
        assert (result.status, result.exit_code) == (Status.OK, 0)
        assert events(audit, info.run_id, "stop_after_exit") == [{"exit_code": 0}]
        assert took < BOUND
        assert gone(pidfile)  # SIGKILLed once the grace ran out

    async def test_a_stop_as_it_exits(self, tmp_path: Path) -> None:
        """The command exits as the stop comes, before the kernel has seen its exit
        (the stop is handled first): its status still ends the run (before:
        cancelled, the command's exit status lost)."""
        pidfile, go = tmp_path / "pid", tmp_path / "go"
        script = (f"echo $$ > {shlex.quote(str(pidfile))}.tmp && "
                  f"mv {shlex.quote(str(pidfile))}.tmp {shlex.quote(str(pidfile))}; "
                  f"while [ ! -e {shlex.quote(str(go))} ]; do sleep 0.01; done; echo bye; "
                  "exit 4")

        def exited_now() -> bool:
            if not pidfile.exists():
                return False
            go.touch()
            # Blocks this thread (the kernel's too) until the command has exited, without
            # reaping it: the kernel sees the exit only after the stop.
            os.waitid(os.P_PID, int(pidfile.read_text()), os.WEXITED | os.WNOWAIT)
            return True

        result, audit, info, _, _ = await run_and_stop(ShellAgent(["sh", "-c", script]),
                                                       exited_now)
        assert (result.status, result.exit_code) == (Status.ERROR, 4), result
        assert result.error == "command exited with code 4"
        assert result.output == "bye"
        assert events(audit, info.run_id, "stop_after_exit") == [{"exit_code": 4}]

    async def test_a_stop_while_it_runs_is_still_cancelled(self, tmp_path: Path) -> None:
        """DESIGN.md: Ctrl-C / a host cancel of a command still running ends the run
        `cancelled`, the command stopped (`process_exit` marked so)."""
        ready = tmp_path / "ready"
        agent = ShellAgent(["sh", "-c", f"touch {shlex.quote(str(ready))}; exec sleep 600"])
        result, audit, info, cancelled, took = await run_and_stop(agent, ready.exists)
        assert result.status is Status.CANCELLED
        assert cancelled
        assert "stop_after_exit" not in audit.kinds(info.run_id)
        [exit_event] = events(audit, info.run_id, "process_exit")
        assert exit_event["stopped"] is True
        assert took < BOUND


# ------------------------------------------------------------------ the real CLI


def journal_has(env: dict[str, str], kind: str) -> bool:
    """Whether the journal has an event of `kind` (read-only, while the run goes on)."""
    journal = Path(env["KERNEL_DB"] + ".journal")
    if not journal.exists():
        return False
    with closing(sqlite3.connect(f"file:{journal}?mode=ro", uri=True)) as con:
        try:
            return con.execute("SELECT 1 FROM events WHERE kind = ?", (kind,)
                               ).fetchone() is not None
        except sqlite3.OperationalError:
            return False


def wait_for(cond: Callable[[], bool], what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + BOUND
    while not cond():
        assert proc.poll() is None, f"the kernel ended before {what}"
        assert time.monotonic() < deadline, f"{what}: not within {BOUND:.0f}s"
        time.sleep(0.02)


def query(exe: str, env: dict[str, str], sql: str) -> list[dict[str, Any]]:
    proc = subprocess.run([exe, "query", "--format", "json", sql], capture_output=True,
                          text=True, env=env, timeout=BOUND, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def writer_outside(tmp_path: Path) -> str:
    """A shell snippet starting a writer that left the command's group and cleared its
    environment (nothing can stop it: `setsid env -i`), writing on the command's stdout
    until that pipe closes (SIGPIPE). It keeps the run reading after the command
    exited, for as long as the test needs (the window the stop lands in)."""
    setsid = shutil.which("setsid")
    if setsid is None:  # pragma: no cover - util-linux is everywhere the tests run
        pytest.skip("setsid(1) is not installed")
    pidfile = shlex.quote(str(tmp_path / "writer.pid"))
    inner = f"echo $$ > {pidfile}; while :; do echo tick; done"
    return f"{setsid} env -i /bin/sh -c {shlex.quote(inner)} &"


def gone(pidfile: Path) -> bool:
    if not pidfile.exists():
        return True
    try:
        state = Path(f"/proc/{int(pidfile.read_text())}/stat").read_text()
    except (FileNotFoundError, ValueError):
        return True
    return state.rsplit(") ", 1)[1].startswith("Z")


def end_writer(pidfile: Path) -> None:
    """The writer dies of SIGPIPE once its pipe's reader is gone; make sure of it."""
    deadline = time.monotonic() + BOUND
    while not gone(pidfile) and time.monotonic() < deadline:
        time.sleep(0.02)
    if not gone(pidfile):  # pragma: no cover - it only outlives a failed test
        os.kill(int(pidfile.read_text()), signal.SIGKILL)


class TestCli:
    def test_ctrl_c_after_the_command_exited(self, kernel_exe: str, cli_env: dict[str, str],
                                             tmp_path: Path) -> None:
        """`kernel run -- sh -c 'echo hi; WRITER & exit 0'`, Ctrl-C once the command's
        exit is in the journal, while its echo is still being read: exit 0, status ok,
        `hi` shown (before: cancelled, exit 130)."""
        script = f"echo hi; {writer_outside(tmp_path)} exit 0"
        err = tmp_path / "stderr"
        try:
            with err.open("wb") as sink:
                p = subprocess.Popen([kernel_exe, "run", "--", "sh", "-c", script],
                                     stdout=subprocess.PIPE, stderr=sink,
                                     stdin=subprocess.DEVNULL, env=cli_env)
                try:
                    # Our stdout is not read meanwhile: the echo waits for room, which
                    # holds the run reading the writer's output (as long as we like).
                    wait_for(lambda: journal_has(cli_env, "process_exit"),
                             "the command's exit", p)
                    p.send_signal(signal.SIGINT)
                    out, _ = p.communicate(timeout=BOUND)
                finally:
                    p.kill()
                    p.wait()
        finally:
            end_writer(tmp_path / "writer.pid")
        text = err.read_text()
        assert p.returncode == 0, text
        assert out.startswith(b"hi\n")
        assert not any(n in text for n in NOISE), text
        assert text.endswith("(exit 0)\n"), text
        [row] = query(kernel_exe, cli_env, "SELECT status, error FROM runs")
        assert row == {"status": "ok", "error": None}
        kinds = [r["kind"] for r in query(kernel_exe, cli_env,
                                          "SELECT kind FROM events ORDER BY seq")]
        assert "stop_after_exit" in kinds

    def test_batch_resume_does_not_run_it_again(self, kernel_exe: str,
                                                cli_env: dict[str, str],
                                                tmp_path: Path) -> None:
        """`kernel batch` stopped by Ctrl-C while a task's command has exited but its
        output is still being read: the task is `ok`, and `--resume` skips it (before:
        cancelled, and the resume ran the command a second time)."""
        count = tmp_path / "count"
        q = shlex.quote(str(count))
        # The writer only on the first run (a second run, the bug, ends at once).
        script = (f"echo run >> {q}; if [ $(wc -l < {q}) -eq 1 ]; then "
                  f"{writer_outside(tmp_path)} fi; exit 0")
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text(json.dumps({"id": "t1", "command": ["sh", "-c", script]}) + "\n")
        try:
            p = subprocess.Popen([kernel_exe, "batch", str(tasks)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                 env=cli_env)
            try:
                wait_for(lambda: journal_has(cli_env, "process_exit"), "the command's exit",
                         p)
                p.send_signal(signal.SIGINT)
                _, err = p.communicate(timeout=BOUND)
            finally:
                p.kill()
                p.wait()
        finally:
            end_writer(tmp_path / "writer.pid")
        text = err.decode()
        assert p.returncode == 130, text  # the batch itself was interrupted
        assert "(1 ok)" in text, text
        batch = text.split("kernel batch --resume ")[-1].split()[0]
        resumed = subprocess.run([kernel_exe, "batch", "--resume", batch],
                                 capture_output=True, text=True, env=cli_env, timeout=BOUND,
                                 stdin=subprocess.DEVNULL)
        assert resumed.returncode == 0, resumed.stderr
        assert count.read_text() == "run\n"  # not run again
        [row] = query(kernel_exe, cli_env, "SELECT status FROM runs")
        assert row == {"status": "ok"}
