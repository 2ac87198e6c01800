"""One damaged checkpoint row does not block the recovery of every other run.

A checkpoint row whose spec or state is not JSON (a damaged disk, a hand edit)
made `kernel recover` (and `Recovery.recover`) stop with one line and exit 2
before resuming any interrupted run. Now every other interrupted run is
resumed; the damaged one is named with the reason in one line (and a `--json`
document), never claimed, its row left exactly as it is, and `kernel recover`
exits 1. `kernel resume` of the damaged run itself stays one line and exit 2.

The runs are real `kernel run` processes killed with SIGKILL after their
second tick; the damage is a plain sqlite3 UPDATE of one row.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
import trio
from counter_loop import COUNTER

pytestmark = pytest.mark.realtime

PATIENCE = 120.0  # a bound for a hang only: every wait is for a file or a process


def killed_runs(kernel_exe: str, env: dict[str, str], tmp_path: Path, n: int) -> list[str]:
    """`n` loop runs SIGKILLed after their second tick (real processes): their run ids,
    oldest first."""
    loop = tmp_path / "count.yaml"
    loop.write_text(COUNTER)
    for i in range(n):
        marker = tmp_path / f"ticks-{i}"
        proc = subprocess.Popen([kernel_exe, "run", "--no-critic", str(loop), "-c",
                                 f"marker={marker}"], env=env, cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + PATIENCE
        while not marker.exists() or len(marker.read_text().splitlines()) < 2:
            assert proc.poll() is None, "the loop ended before its kill point"
            assert time.monotonic() < deadline, "the loop never reached its kill point"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=PATIENCE)
    with sqlite3.connect(journal(env)) as con:
        ids = [r for (r,) in con.execute("SELECT run_id FROM checkpoints WHERE status = "
                                         "'running' ORDER BY created_at, run_id")]
    assert len(ids) == n
    return ids


def journal(env: dict[str, str]) -> str:
    return env["KERNEL_DB"] + ".journal"


def damage(env: dict[str, str], run_id: str, column: str) -> tuple[object, ...]:
    """Cut one run's checkpoint `column` in half (a torn write); the row as it is now."""
    with sqlite3.connect(journal(env)) as con:
        con.execute(f"UPDATE checkpoints SET {column} = substr({column}, 1, "
                    f"length({column}) / 2) WHERE run_id = ?", (run_id,))
    return row_of(env, run_id)


def row_of(env: dict[str, str], run_id: str) -> tuple[object, ...]:
    with sqlite3.connect(journal(env)) as con:
        row = con.execute("SELECT * FROM checkpoints WHERE run_id = ?", (run_id,)).fetchone()
    assert row is not None
    return tuple(row)


def kernel(kernel_exe: str, env: dict[str, str], cwd: Path, *args: str
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([kernel_exe, *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=PATIENCE)


@pytest.mark.parametrize("column", ["spec", "state"])
def test_recover_resumes_the_others_and_names_the_damaged_run(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, column: str) -> None:
    first, bad, last = killed_runs(kernel_exe, cli_env, tmp_path, 3)
    damaged_row = damage(cli_env, bad, column)

    got = kernel(kernel_exe, cli_env, tmp_path, "recover", "--json")
    assert got.returncode == 1, got.stderr
    docs = {d["run_id"]: d for d in map(json.loads, got.stdout.splitlines())}
    assert set(docs) == {first, bad, last}
    for rid in (first, last):  # resumed to the end
        assert docs[rid]["status"] == "ok" and str(docs[rid]["output"]).strip() == "6"
    assert docs[bad]["resumed"] is False and docs[bad]["damaged"] is True
    assert f"its {column} is not JSON" in docs[bad]["reason"]
    # One line on stderr names it (the others' "resuming" lines aside), no traceback.
    [line] = [ln for ln in got.stderr.splitlines() if "damaged" in ln]
    assert docs[bad]["short_id"] in line and "left as it is" in line
    assert "Traceback" not in got.stderr
    # Never claimed, never marked: the row is exactly as the damage left it.
    assert row_of(cli_env, bad) == damaged_row
    with sqlite3.connect(journal(cli_env)) as con:
        statuses = dict(con.execute("SELECT run_id, status FROM checkpoints").fetchall())
    assert statuses == {first: "completed", bad: "running", last: "completed"}

    # Again: nothing left to resume but the damaged run, named again, exit 1.
    again = kernel(kernel_exe, cli_env, tmp_path, "recover")
    assert again.returncode == 1 and again.stdout == ""
    assert again.stderr.count("\n") == 1 and "damaged" in again.stderr, again.stderr
    listed = kernel(kernel_exe, cli_env, tmp_path, "recover", "--list", "--json")
    assert listed.returncode == 1, listed.stderr
    [row] = [json.loads(x) for x in listed.stdout.splitlines()]
    assert row["run_id"] == bad and f"its {column} is not JSON" in row["damaged"]

    # `kernel resume` of the damaged run itself: one line, exit 2.
    resume = kernel(kernel_exe, cli_env, tmp_path, "resume", docs[bad]["short_id"])
    assert resume.returncode == 2 and resume.stdout == ""
    assert resume.stderr.count("\n") == 1 and "damaged" in resume.stderr, resume.stderr
    assert row_of(cli_env, bad) == damaged_row


def test_resume_of_another_run_is_not_blocked_by_a_damaged_row(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    good, bad = killed_runs(kernel_exe, cli_env, tmp_path, 2)
    damage(cli_env, bad, "spec")
    got = kernel(kernel_exe, cli_env, tmp_path, "resume", good, "--json")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["status"] == "ok"


def test_the_library_recovery_reports_the_damaged_run_and_resumes_the_others(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`Recovery.recover`: a `Resumed` refused and `damaged` for the damaged run, the
    other runs resumed (before: a `StoreError` before any run was resumed)."""
    from adapters import agent_from_spec, stop_leftover_group
    from batteries.recovery import Recovery

    first, bad, last = killed_runs(kernel_exe, cli_env, tmp_path, 3)
    damaged_row = damage(cli_env, bad, "state")
    monkeypatch.chdir(tmp_path)
    recovery = Recovery(cli_env["KERNEL_DB"], build=lambda spec: agent_from_spec(spec).agent,
                        stop_group=stop_leftover_group)
    done = {r.run_id: r for r in trio.run(recovery.recover)}
    assert set(done) == {first, bad, last}
    assert done[bad].damaged and done[bad].result is None
    assert done[bad].refused is not None and "its state is not JSON" in done[bad].refused
    for rid in (first, last):
        result = done[rid].result
        assert result is not None and result.status == "ok", done[rid]
    assert row_of(cli_env, bad) == damaged_row
