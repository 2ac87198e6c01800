"""`kernel batch --workers N`: runs spread over forked worker processes (real processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.cmd.test_batch_cli import (
    PATIENCE,
    batch,
    journal_count,
    lines,
    query,
    wait_for,
    write_tasks,
)

pytestmark = pytest.mark.realtime


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2:].split()[0] != b"Z"


def gated_tasks(n: int, started: Path, gate: Path, effects: Path) -> list[dict[str, object]]:
    """`n` tasks that say `tI:WORKER_PID:PID` in `started`, wait for `gate` to exist, then
    write their index to `effects` (each side effect once, if nothing runs twice)."""
    return [{"id": f"t{i}", "command": ["sh", "-c", f"echo t{i}:$PPID:$$ >> {started}; while "
                                        f"[ ! -e {gate} ]; do sleep 0.05; done; "
                                        f"echo {i} >> {effects}"]}
            for i in range(n)]


def parents(path: Path) -> dict[str, int]:
    """task -> the pid of the process that ran its command (written by the command)."""
    return {line.split(":")[0]: int(line.split(":")[1]) for line in lines(path)}


def shells(path: Path) -> dict[str, int]:
    """task -> the pid of its command's shell (written as `task:ppid:pid`)."""
    return {line.split(":")[0]: int(line.split(":")[2]) for line in lines(path)}


def test_runs_spread_over_workers_each_audited_once(kernel_exe: str, cli_env: dict[str, str],
                                                    tmp_path: Path) -> None:
    """Two workers run the tasks (their commands' parent is a worker, not the batch
    process); results, exit code and audit are as without workers."""
    ran = tmp_path / "ran"
    n = 40
    tasks: list[dict[str, object]] = [
        {"id": f"t{i}", "command": ["sh", "-c", f"echo t{i}:$PPID >> {ran}; echo {i}"]}
        for i in range(n)]
    tasks.append({"id": "bad", "command": ["sh", "-c", "exit 4"]})
    proc = batch(kernel_exe, cli_env, str(write_tasks(tmp_path / "t.jsonl", tasks)), "--json",
                 "-j", "8", "--workers", "2")
    assert proc.returncode == 1, proc.stderr
    assert "concurrency 8, 2 workers" in proc.stderr
    docs = {d["task_id"]: d for d in map(json.loads, proc.stdout.splitlines())}
    assert len(docs) == n + 1
    assert docs["bad"]["status"] == "error" and docs["bad"]["exit_code"] == 4
    assert all(docs[f"t{i}"]["status"] == "ok" and docs[f"t{i}"]["output"].strip() == str(i)
               for i in range(n))
    pids = parents(ran)
    assert sorted(pids) == sorted(f"t{i}" for i in range(n))  # each command ran once
    assert len(set(pids.values())) == 2  # two workers ran them
    batch_id = docs["t0"]["batch_id"]
    rows = query(kernel_exe, cli_env,
                 "SELECT r.status, (SELECT count(*) FROM events e WHERE e.run_id = r.run_id "
                 "AND e.kind = 'run_start') AS starts, (SELECT count(*) FROM events e WHERE "
                 "e.run_id = r.run_id AND e.kind = 'run_end') AS ends "
                 f"FROM batch_runs r WHERE r.batch_id = '{batch_id}'")
    assert len(rows) == n + 1
    assert {(r["starts"], r["ends"]) for r in rows} == {(1, 1)}
    assert [r["status"] for r in rows].count("ok") == n
    assert all(not alive(p) for p in set(pids.values()))  # the workers are gone


def test_one_budget_exact_across_workers(kernel_exe: str, cli_env: dict[str, str],
                                         tmp_path: Path) -> None:
    """A caller's budget of 7 runs holds across two workers: exactly 7 run."""
    ran = tmp_path / "ran"
    assert subprocess.run([kernel_exe, "budget", "set", "crowd", "--runs", "7"], env=cli_env,
                          capture_output=True, check=False).returncode == 0
    tasks: list[dict[str, object]] = [
        {"id": f"t{i}", "caller": "crowd", "command": ["sh", "-c", f"echo {i} >> {ran}"]}
        for i in range(30)]
    proc = batch(kernel_exe, cli_env, str(write_tasks(tmp_path / "t.jsonl", tasks)), "--json",
                 "-j", "10", "--workers", "2")
    assert proc.returncode == 1, proc.stderr
    statuses = [json.loads(x)["status"] for x in proc.stdout.splitlines()]
    assert statuses.count("ok") == 7 and statuses.count("budget_exceeded") == 23
    assert len(lines(ran)) == 7


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_killed_halfway_then_resumed(kernel_exe: str, cli_env: dict[str, str],
                                     tmp_path: Path, how: str) -> None:
    """The batch process killed (SIGKILL: its workers die with it; SIGTERM: they cancel
    their runs) with runs in flight on both workers; --resume runs each command once."""
    effects, gate, started = tmp_path / "effects", tmp_path / "go", tmp_path / "started"
    n, half = 16, 8
    tasks: list[dict[str, object]] = []
    for i in range(n):
        wait = (f"echo t{i}:$PPID >> {started}; while [ ! -e {gate} ]; do sleep 0.05; done; "
                if i >= half else "")
        tasks.append({"id": f"t{i}", "command": ["sh", "-c", f"{wait}echo {i} >> {effects}"]})
    tasks_file = write_tasks(tmp_path / "t.jsonl", tasks)
    proc = subprocess.Popen([kernel_exe, "batch", str(tasks_file), "-j", "4", "--json",
                             "--workers", "2"], env=cli_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for("the first half to finish", lambda: journal_count(
            cli_env, "SELECT count(*) FROM runs WHERE status = 'ok'") == half)
        wait_for("four runs in flight", lambda: len(lines(started)) == 4)
        workers = set(parents(started).values())
        assert len(workers) == 2 and proc.pid not in workers
        proc.send_signal(getattr(signal, how))
        _, err = proc.communicate(timeout=PATIENCE)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == (-signal.SIGKILL if how == "SIGKILL" else 130)
    wait_for("the workers to be gone", lambda: not any(alive(p) for p in workers))
    assert sorted(map(int, lines(effects))) == list(range(half))
    batch_id = err.split("kernel: batch ", 1)[1].split()[0]

    gate.touch()
    resumed = batch(kernel_exe, cli_env, "--resume", batch_id, "--json", "--workers", "2")
    assert resumed.returncode == 0, resumed.stderr
    docs = [json.loads(x) for x in resumed.stdout.splitlines()]
    assert len(docs) == n and {d["status"] for d in docs} == {"ok"}
    assert sum(d["skipped"] for d in docs) == half
    assert sum(d["resumed"] for d in docs) == 4
    assert sorted(map(int, lines(effects))) == list(range(n))  # each exactly once
    rows = query(kernel_exe, cli_env,
                 "SELECT (SELECT count(*) FROM events e WHERE e.run_id = r.run_id "
                 " AND e.kind = 'run_start') AS starts, r.status "
                 f"FROM batch_runs r WHERE r.batch_id = '{batch_id}'")
    assert len(rows) == n and {(r["starts"], r["status"]) for r in rows} == {(1, "ok")}


def test_a_worker_that_dies_ends_its_runs_and_resume_finishes_them(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """One worker SIGKILLed mid-batch: the runs it held end with an error naming it, the
    other worker runs the rest, exit 1; --resume finishes the dead worker's runs once."""
    effects, gate, started = tmp_path / "effects", tmp_path / "go", tmp_path / "started"
    n = 12
    tasks = gated_tasks(n, started, gate, effects)
    proc = subprocess.Popen([kernel_exe, "batch", str(write_tasks(tmp_path / "t.jsonl", tasks)),
                             "-j", "4", "--json", "--workers", "2"], env=cli_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for("four runs in flight", lambda: len(lines(started)) == 4)
        held = parents(started)
        victim = held["t0"]
        lost = {t for t, p in held.items() if p == victim}
        os.kill(victim, signal.SIGKILL)
        # Its lifeline watcher kills its commands (before the gate opens for the rest).
        orphans = [shells(started)[t] for t in lost]
        wait_for("the dead worker's commands to be stopped",
                 lambda: not alive(victim) and not any(alive(p) for p in orphans))
        gate.touch()
        out, err = proc.communicate(timeout=PATIENCE)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    docs = {d["task_id"]: d for d in map(json.loads, out.splitlines())}
    assert len(docs) == n
    failed = {t for t, d in docs.items() if d["status"] != "ok"}
    assert failed == lost
    assert all(f"batch worker pid {victim} ended" in docs[t]["error"] for t in lost)
    batch_id = docs["t0"]["batch_id"]
    resumed = batch(kernel_exe, cli_env, "--resume", batch_id, "--json")
    assert resumed.returncode == 0, resumed.stderr
    again = {d["task_id"]: d for d in map(json.loads, resumed.stdout.splitlines())}
    assert {t for t, d in again.items() if d["resumed"]} == lost
    assert sorted(map(int, lines(effects))) == list(range(n))  # each exactly once


def test_workers_default_and_bad_values(kernel_exe: str, cli_env: dict[str, str],
                                        tmp_path: Path) -> None:
    """A small batch runs in one process by default; --workers 0 and --workers with
    --ray are refused (exit 2)."""
    tasks = str(write_tasks(tmp_path / "t.jsonl", [{"command": ["true"]}] * 3))
    small = batch(kernel_exe, cli_env, tasks)
    assert small.returncode == 0 and "workers" not in small.stderr
    zero = batch(kernel_exe, cli_env, tasks, "--workers", "0")
    assert zero.returncode == 2 and "--workers" in zero.stderr
    both = batch(kernel_exe, cli_env, tasks, "--workers", "2", "--ray", "auto")
    assert both.returncode == 2


def test_default_workers() -> None:
    """One per CPU, at most one per 100 runs, at least one."""
    from kernel_cli.batch_workers import default_workers

    cpus = len(os.sched_getaffinity(0))
    assert default_workers(1) == 1 and default_workers(199) == 1
    assert default_workers(100_000) == cpus
    assert default_workers(200) == min(cpus, 2)
