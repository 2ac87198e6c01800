"""`kernel run` / `kernel resume` whose journal stays locked as they exit: they say where
their rows went.

When the exit flush cannot write (the journal locked past `$KERNEL_AUDIT_LOCK_TIMEOUT`)
the rows go to a spill file, which the next command that writes the journal commits.
The journal's warning goes to the `kernel.journal` logger, which the CLI hides: the user
saw "ok" and nothing else. Now one line on stderr names the file and says who commits
it, `--json` carries it in `storage`, and the exit code is the run's own (the rows are
safe). Rows that cannot even be spilled (here a real file-size limit on the process,
`prlimit`, so the spill's write fails with EFBIG) are lost: an exit 0 becomes exit 1.

Real parts: the installed `kernel`, real commands, a second SQLite connection holding
the journal's write lock. Each step waits for what it needs (a journal row, a file).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.realtime

PATIENCE = 120.0  # bounds on waits for another process: only ever reached by a hang


def wait_for(what: str, cond: Callable[[], bool], proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + PATIENCE
    while not cond():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def journal_count(path: Path, sql: str) -> int:
    if not path.exists():
        return 0
    with sqlite3.connect(path, timeout=PATIENCE) as con:
        try:
            return int(con.execute(sql).fetchone()[0])
        except sqlite3.OperationalError:  # not created yet
            return 0


def spills(path: Path) -> list[Path]:
    return sorted(p for p in path.parent.iterdir()
                  if p.name.startswith(path.name + ".spill-") and "." not in p.name[-32:])


def closing_locked(argv: list[str], env: dict[str, str], cwd: Path, journal: Path,
                   ready: Callable[[], bool], go: Path, *,
                   limit_files: bool = False) -> subprocess.CompletedProcess[str]:
    """Run `argv`; once `ready()`, hold the journal's write lock (`BEGIN EXCLUSIVE`) and
    touch `go`, so the run ends and the process exits while the journal is locked (with
    `limit_files`, unable to write any file either); its outcome, the lock then let go."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd)
    holder = None
    try:
        wait_for("the run to be under way", ready, proc)
        holder = sqlite3.connect(journal, isolation_level=None, timeout=PATIENCE)
        holder.execute("BEGIN EXCLUSIVE")
        if limit_files:  # no regular file can grow past 1 byte: the spill cannot be written
            resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (1, 1))
        go.touch()
        out, err = proc.communicate(timeout=PATIENCE)
    finally:
        if holder is not None:
            holder.execute("ROLLBACK")
            holder.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in err, err
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def waiting_command(go: Path, code: int = 0) -> list[str]:
    return ["sh", "-c", f"echo up; while [ ! -e {go} ]; do sleep 0.02; done; exit {code}"]


def started(journal: Path) -> Callable[[], bool]:
    return lambda: journal_count(
        journal, "SELECT count(*) FROM events WHERE kind = 'process_start'") > 0


@pytest.mark.parametrize("json_out", [False, True])
def test_a_run_whose_rows_are_spilled_says_where_and_keeps_its_exit_code(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, json_out: bool) -> None:
    env = {**cli_env, "KERNEL_AUDIT_LOCK_TIMEOUT": "0.5"}
    journal = Path(env["KERNEL_DB"] + ".journal")
    go = tmp_path / "go"
    argv = [kernel_exe, "run", "--no-critic", *(["--json"] if json_out else []), "--",
            *waiting_command(go, 3)]
    done = closing_locked(argv, env, tmp_path, journal, started(journal), go)
    assert done.returncode == 3, done.stderr  # the command's own code: the rows are safe
    [spill] = spills(journal)
    [line] = [x for x in done.stderr.splitlines() if str(spill) in x]
    assert line.startswith("kernel: warning: ") and "kept in" in line
    assert "the next kernel command that writes to the journal commits them" in line
    if json_out:
        doc = json.loads(done.stdout)
        assert doc["exit_code"] == 3 and doc["status"] == "error"
        storage = doc["storage"]
        assert storage["spill_path"] == str(spill) and storage["unwritten"] == 0
        assert storage["spilled"] >= 2  # at least its process_exit and run_end
    else:
        assert done.stderr.splitlines()[-1].endswith("(exit 3)")
    # What the line says: the next command that writes the journal commits them.
    runs = subprocess.run([kernel_exe, "recover"], capture_output=True, text=True, env=env,
                          timeout=PATIENCE, cwd=tmp_path)
    assert runs.returncode == 0, runs.stderr
    assert spills(journal) == []
    assert journal_count(journal, "SELECT count(*) FROM runs WHERE status = 'error'") == 1


@pytest.mark.parametrize("json_out", [False, True])
def test_a_run_whose_rows_are_lost_exits_1(kernel_exe: str, cli_env: dict[str, str],
                                           tmp_path: Path, json_out: bool) -> None:
    """Neither written nor kept in a spill file: the rows are lost, and a run that would
    exit 0 exits 1, saying why (before: exit 0, as if all were well)."""
    env = {**cli_env, "KERNEL_AUDIT_LOCK_TIMEOUT": "0.5"}
    journal = Path(env["KERNEL_DB"] + ".journal")
    go = tmp_path / "go"
    argv = [kernel_exe, "run", "--no-critic", *(["--json"] if json_out else []), "--",
            *waiting_command(go)]
    done = closing_locked(argv, env, tmp_path, journal, started(journal), go,
                          limit_files=True)
    assert done.returncode == 1, done.stderr
    assert spills(journal) == []
    assert "kernel: warning: audit rows not yet written" not in done.stderr
    if json_out:
        doc = json.loads(done.stdout)
        assert doc["status"] == "ok" and doc["exit_code"] == 1
        assert doc["command_exit_code"] == 0
        assert doc["storage"]["unwritten"] >= 2 and doc["storage"]["spill_path"] is None
    else:
        last = done.stderr.splitlines()[-1]
        assert " ok after " in last and "(exit 1: " in last and "were lost)" in last


WAIT_LOOP = """\
name: wait-for-go
initial: wait
max_iterations: 5
timeout: 120
states:
  wait:
    action: >-
      echo tick >> ${context.marker};
      while [ ! -e ${context.go} ]; do sleep 0.02; done; echo went
    next: done
  done:
    terminal: true
"""


def test_a_resumed_run_whose_rows_are_spilled_says_where(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """`kernel resume` opens the journal as `kernel run` does: the same line, the same
    `storage` in its --json document."""
    loop = tmp_path / "wait.yaml"
    loop.write_text(WAIT_LOOP)
    marker, go = tmp_path / "ticks", tmp_path / "go"
    journal = Path(cli_env["KERNEL_DB"] + ".journal")

    def ticks() -> int:
        return len(marker.read_text().splitlines()) if marker.exists() else 0

    first = subprocess.Popen([kernel_exe, "run", "--no-critic", str(loop), "-c",
                              f"marker={marker}", "-c", f"go={go}"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=cli_env, cwd=tmp_path)
    wait_for("the first tick", lambda: ticks() >= 1, first)
    os.kill(first.pid, signal.SIGKILL)  # interrupted: `kernel resume` continues it
    first.wait(timeout=PATIENCE)

    env = {**cli_env, "KERNEL_AUDIT_LOCK_TIMEOUT": "0.5"}
    argv = [kernel_exe, "resume", "last", "--json"]
    done = closing_locked(argv, env, tmp_path, journal, lambda: ticks() >= 2, go)
    assert done.returncode == 0, done.stderr
    [spill] = spills(journal)
    [line] = [x for x in done.stderr.splitlines() if str(spill) in x]
    assert line.startswith("kernel: warning: ")
    assert "the next kernel command that writes to the journal commits them" in line
    doc = json.loads(done.stdout)
    assert doc["status"] == "ok" and doc["storage"]["spill_path"] == str(spill)
    assert doc["storage"]["spilled"] >= 1 and doc["storage"]["unwritten"] == 0
