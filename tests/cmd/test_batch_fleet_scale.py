"""`kernel batch` at fleet scale, as a demanding operator uses it: defects fixed, end to end.

The installed executable, real commands, real journals, real pipes, ptys, signals and
open-file limits. Every wait is on readiness (a marker file a command writes, a row in
the journal, a process's children); the commands that must stay in flight wait at a
gate file the test creates.
"""

from __future__ import annotations

import json
import os
import pty
import resource
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cmd.test_batch_cli import (
    PATIENCE,
    batch,
    journal_count,
    lines,
    wait_for,
    write_tasks,
)
from tests.cmd.test_batch_workers import alive

pytestmark = pytest.mark.realtime

ENDED = "SELECT count(*) FROM runs WHERE status IS NOT NULL"


def waiting(started: Path, gate: Path, task_id: str = "slow") -> dict[str, object]:
    """A task that writes its shell's pid to `started` and waits for `gate` to exist."""
    return {"id": task_id, "command": ["sh", "-c", f"echo $$ >> {started}; "
                                       f"while [ ! -e {gate} ]; do sleep 0.05; done"]}


# ------------------------------------------------------- a reader that does not read


@pytest.mark.parametrize("stalled", ["stdout", "stderr"])
def test_a_reader_that_does_not_read_holds_up_neither_the_runs_nor_a_signal(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, stalled: str) -> None:
    """`kernel batch --json | less` left on its first page (stdout), or the failures'
    lines to a stderr pipe nobody reads: the batch used to block inside `write` on its
    only thread once the pipe was full (64 KiB): no run ended, no deadline fired, and
    SIGINT waited for the reader (14 s for one that slept 20 s, for ever for one that
    never reads). Now every run ends meanwhile, SIGINT stops it at once (exit 130,
    resumable), its command is stopped, and `--resume` finishes it."""
    started, gate = tmp_path / "started", tmp_path / "go"
    # 300 lines of ~290-450 bytes: well past a pipe's 64 KiB.
    quick = [{"id": f"{'t' * 150}{i}", "command": ["true" if stalled == "stdout" else "false"]}
             for i in range(300)]
    tasks = write_tasks(tmp_path / "t.jsonl", [*quick, waiting(started, gate)])
    read_end, write_end = os.pipe()
    other = open(tmp_path / "other", "wb")  # noqa: SIM115
    args = [kernel_exe, "batch", str(tasks), "-j", "8", "--workers", "1"]
    if stalled == "stdout":
        args.append("--json")
    proc = subprocess.Popen(args, env=cli_env, stdin=subprocess.DEVNULL,
                            stdout=write_end if stalled == "stdout" else other,
                            stderr=write_end if stalled == "stderr" else other)
    os.close(write_end)
    try:
        # Readiness: the journal has every quick run ended, and the gated one runs.
        wait_for("every quick run to end while nobody reads",
                 lambda: journal_count(cli_env, ENDED) >= 300 and bool(lines(started)))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        other.close()
        os.close(read_end)
    assert proc.returncode == 130
    assert took < 60
    [pid] = map(int, lines(started))
    wait_for("the gated command to be stopped", lambda: not alive(pid))
    text = (tmp_path / "other").read_text()
    assert "Traceback" not in text
    if stalled == "stdout":
        assert "interrupted after" in text and "line(s) of --json output not written" in text
    gate.touch()
    resumed = batch(kernel_exe, cli_env, "--resume", "last")
    assert resumed.returncode == (0 if stalled == "stdout" else 1), resumed.stderr
    last = resumed.stderr.splitlines()[-1]
    assert (": 301 ok in " if stalled == "stdout" else ": 300 error, 1 ok in ") in last, last


def test_a_full_disk_for_the_json_lines_stops_the_batch_in_one_line(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """`kernel batch --json > /dev/full`: was a traceback (OSError: No space left on
    device, exit 1); now one line saying why, the batch stopped resumable (exit 130)."""
    tasks = write_tasks(tmp_path / "t.jsonl", [{"command": ["true"]} for _ in range(20)])
    with open("/dev/full", "w") as full:
        proc = subprocess.run([kernel_exe, "batch", str(tasks), "--json"], env=cli_env,
                              stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=PATIENCE, check=False)
    assert proc.returncode == 130, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "kernel: cannot write the results on stdout (No space left on device): " \
           "cancelling batch" in proc.stderr
    again = batch(kernel_exe, cli_env, "--resume", "last")
    assert again.returncode == 0, again.stderr


# ------------------------------------------------------------ two resumers at once


def test_a_resume_that_loses_the_batch_to_another_is_one_line_with_workers(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """Two `kernel batch --resume` at once with `--workers`: the one that found the batch
    taken when it claimed it printed "resumed", then an ExceptionGroup traceback (the
    busy error came out of the workers' nursery), exit 1. Now one line, exit 2, and its
    workers are let go.

    Made deterministic: the test holds the journal's write lock while the resumer
    starts; once its workers exist (it is past its checks, before its claim), the test
    makes the batch held by itself, a live process, and lets go of the lock."""
    tasks = write_tasks(tmp_path / "t.jsonl", [{"command": ["true"]} for _ in range(4)])
    first = batch(kernel_exe, cli_env, str(tasks))
    assert first.returncode == 0, first.stderr
    bid = first.stderr.split("kernel: batch ", 1)[1].split()[0]

    from batteries.store import Owner

    me = Owner.me()
    con = sqlite3.connect(cli_env["KERNEL_DB"] + ".journal", timeout=30, isolation_level=None)
    env = {**cli_env, "KERNEL_AUDIT_LOCK_TIMEOUT": "120"}
    proc = None
    try:
        con.execute("BEGIN IMMEDIATE")
        proc = subprocess.Popen([kernel_exe, "batch", "--resume", bid, "--workers", "2"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        import psutil

        wait_for("the resumer's two workers", lambda: proc is not None and len(
            psutil.Process(proc.pid).children()) >= 2)
        con.execute("UPDATE batches SET status = 'running', host = ?, pid = ?, pid_start = ? "
                    "WHERE batch_id = ?", (me.host, me.pid, me.started, bid))
        con.execute("COMMIT")
        out, err = proc.communicate(timeout=PATIENCE)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        con.close()
    assert proc.returncode == 2, err
    assert err == f"kernel batch: error: batch {bid} is being run by pid {me.pid} on " \
                  f"{me.host}\n"
    assert out == ""


# ---------------------------------------------------------------- the task file


def _one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


@pytest.mark.parametrize(("content", "expect"), [
    # A 5 MiB line: was stored and run (a command's argument past ARG_MAX: an error at
    # its start; a 100 MB one took 1.1 GB and 20 s to get there).
    (b'{"command": ["echo", "' + b"x" * (5 << 20) + b'"]}\n',
     ":1: the line is longer than 4 MiB (4,194,304 bytes), the most a task line may hold"),
    # Bytes that are not UTF-8: the line is named (was a byte offset in the file).
    (b'{"command": ["true"]}\n{"command": ["echo", "\xff"]}\n',
     ":2: not UTF-8 (byte 0xff at byte 23 of the line)"),
    # A JSON array of tasks, on one line or pretty-printed: said so (was "expects a
    # JSON object" / "not JSON (Expecting value)").
    (b'[{"command": ["true"]}, {"command": ["true"]}]\n',
     ":1: expects one JSON object per line (JSON lines), not a JSON array"),
    (b'[\n  {"command": ["true"]}\n]\n',
     ":1: expects one JSON object per line (JSON lines), not a JSON array"),
])
def test_a_bad_task_file_is_one_line_and_nothing_runs(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, content: bytes,
        expect: str) -> None:
    tasks = tmp_path / "t.jsonl"
    tasks.write_bytes(content)
    err = _one_line_error(batch(kernel_exe, cli_env, str(tasks)))
    assert err.startswith(f"kernel batch: error: {tasks}{expect}"), err
    assert journal_count(cli_env, "SELECT count(*) FROM runs") == 0


@pytest.mark.parametrize("content", [
    # A byte order mark (Notepad's UTF-8): was refused ("Unexpected UTF-8 BOM (decode
    # using utf-8-sig)").
    b'\xef\xbb\xbf{"id": "a", "command": ["echo", "a"]}\n{"id": "b", "command": ["true"]}\n',
    # CRLF line ends.
    b'{"id": "a", "command": ["echo", "a"]}\r\n{"id": "b", "command": ["true"]}\r\n',
    # U+2028 and U+0085 raw in a JSON string (what `json.dumps(ensure_ascii=False)`
    # writes): `str.splitlines` cut the line there ("not JSON (Unterminated string)").
    '{"id": "a", "command": ["echo", "a\u2028b\x85c"]}\n{"id": "b", "command": ["true"]}\n'
    .encode(),
])
def test_task_files_as_editors_and_tools_write_them_run(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, content: bytes) -> None:
    tasks = tmp_path / "t.jsonl"
    tasks.write_bytes(content)
    proc = batch(kernel_exe, cli_env, str(tasks), "--json")
    assert proc.returncode == 0, proc.stderr
    docs = [json.loads(x) for x in proc.stdout.splitlines()]
    assert sorted(d["task_id"] for d in docs) == ["a", "b"]
    [a] = [d for d in docs if d["task_id"] == "a"]
    assert a["output"].startswith("a")


def test_stdin_on_a_terminal_is_refused_not_waited_on(
        kernel_exe: str, cli_env: dict[str, str]) -> None:
    """`kernel batch -` typed at a terminal waited for ever for tasks to be typed; now
    one line saying to pipe them in, exit 2."""
    controller, terminal = pty.openpty()
    try:
        proc = subprocess.run([kernel_exe, "batch", "-"], env=cli_env, stdin=terminal,
                              capture_output=True, text=True, timeout=60, check=False)
    finally:
        os.close(terminal)
        os.close(controller)
    err = _one_line_error(proc)
    assert err.startswith("kernel batch: error: '-' reads the tasks from stdin, which is a "
                          "terminal"), err


def test_a_loop_file_s_warning_is_said_once(kernel_exe: str, cli_env: dict[str, str],
                                            tmp_path: Path) -> None:
    """A loop file with a warning, run by 20 tasks: said 40 times (once when each line was
    checked, once when each run was built); 5,000 tasks said it 10,000 times."""
    loop = tmp_path / "loop.yaml"
    loop.write_text("name: l\ninitial: a\nstates:\n  a:\n    action: echo hi\n    next: b\n"
                    "  b:\n    action: echo again\n    next: a\n")
    tasks = write_tasks(tmp_path / "t.jsonl", [{"id": f"l{i}", "loop": str(loop),
                                                "max_steps": 2} for i in range(20)])
    proc = batch(kernel_exe, cli_env, str(tasks), "--json")
    assert proc.returncode == 1, proc.stderr  # each ends max_steps
    assert len(proc.stdout.splitlines()) == 20
    warned = [x for x in proc.stderr.splitlines() if "no state is terminal" in x]
    assert len(warned) == 1, proc.stderr


# ------------------------------------------------------------------ open files


def _nofile(soft: int, hard: int) -> Callable[[], None]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return limit


def _limits_allow(hard: int) -> bool:
    _, now = resource.getrlimit(resource.RLIMIT_NOFILE)
    return now == resource.RLIM_INFINITY or now >= hard


@pytest.mark.skipif(not _limits_allow(4096), reason="needs a hard open-file limit >= 4096")
def test_more_runs_at_once_than_the_soft_open_file_limit_allows_all_run(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """`-j 200` under `ulimit -Sn 256` (the usual soft limit is 1,024): ~80 commands
    started and the rest ended `error` at once ("Too many open files"), in a batch that
    finished and never ran them again. Now the soft limit is raised as far as the runs
    need (the hard one allows it) and every run starts."""
    started, gate = tmp_path / "started", tmp_path / "go"
    tasks = write_tasks(tmp_path / "t.jsonl", [waiting(started, gate, f"t{i}")
                                               for i in range(200)])
    proc = subprocess.Popen([kernel_exe, "batch", str(tasks), "-j", "200", "--workers", "1"],
                            env=cli_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_nofile(256, 4096))
    try:
        # All 200 started, or some run failed to (it ends at once, before the gate).
        wait_for("every command to start, or one to fail", lambda: len(lines(started)) == 200
                 or journal_count(cli_env, "SELECT count(*) FROM runs WHERE status = 'error'")
                 > 0 or proc.poll() is not None)
        gate.touch()
        _, err = proc.communicate(timeout=PATIENCE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    assert "200 ok" in err.splitlines()[-1]
    assert "Too many open files" not in err


def test_runs_go_fewer_at_a_time_when_the_hard_limit_is_too_low(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """`-j 100` under `ulimit -n 256` (soft and hard): the runs go as many at a time as
    256 open files hold, said in one line, and every one runs."""
    tasks = write_tasks(tmp_path / "t.jsonl", [{"command": ["true"]} for _ in range(40)])
    proc = subprocess.run([kernel_exe, "batch", str(tasks), "-j", "100", "--workers", "1"],
                          env=cli_env, capture_output=True, text=True, timeout=PATIENCE,
                          check=False, preexec_fn=_nofile(256, 256))
    assert proc.returncode == 0, proc.stderr
    first, started = proc.stderr.splitlines()[:2]
    assert first == ("kernel: note: 100 runs at once need ~864 open files per process and "
                     "the limit is 256 (ulimit -n; hard limit 256): running 24 at a time")
    assert started.endswith("40 task(s), concurrency 24")
    assert "40 ok" in proc.stderr.splitlines()[-1]
