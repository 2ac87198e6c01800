"""`--store postgresql://...`: real `kernel` processes sharing one PostgreSQL server.

The server is the session's (tests/pg_server.py); each test gets a database of its own.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.realtime


def kernel(kernel_exe: str, env: dict[str, str], *args: str,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([kernel_exe, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_a_budget_holds_across_processes_and_every_command_sees_them(
        kernel_exe: str, cli_env: dict[str, str], pg_url: str, tmp_path: Path) -> None:
    """8 processes start runs of one caller at once against a budget of 5 runs: exactly 5
    run, 3 are refused (exit 3). `kernel runs` / `show` / `stats` / `query` through the
    store then answer for all 8 runs, made by 8 processes."""
    store = ["--store", pg_url]
    made = kernel(kernel_exe, cli_env, "budget", "set", "fleet", "--runs", "5", *store)
    assert made.returncode == 0, made.stderr
    go = tmp_path / "go"
    script = (f'while [ ! -e "{go}" ]; do sleep 0.01; done; exec "{kernel_exe}" run '
              f"--store '{pg_url}' --caller fleet --json -- sh -c 'echo $$'")
    procs = [subprocess.Popen(["sh", "-c", script], env=cli_env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(8)]
    go.touch()
    outs = [p.communicate(timeout=240) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0] * 5 + [3] * 3, [err for _, err in outs]
    refused = [json.loads(out)["error"] for p, (out, _) in zip(procs, outs, strict=True)
               if p.returncode == 3]
    assert refused == ["caller 'fleet' used 5 of 5 runs in the last 24h"] * 3, refused

    listed = kernel(kernel_exe, cli_env, "runs", "--json", "--limit", "50", *store)
    assert listed.returncode == 0, listed.stderr
    runs = [json.loads(line) for line in listed.stdout.splitlines()]  # JSON lines
    assert sorted(r["status"] for r in runs) == ["budget_exceeded"] * 3 + ["ok"] * 5

    stats = kernel(kernel_exe, cli_env, "stats", "--by", "status", "--json", *store)
    assert stats.returncode == 0, stats.stderr
    assert {r["status"]: r["runs"] for r in json.loads(stats.stdout)} == \
        {"ok": 5, "budget_exceeded": 3}

    sql = "SELECT count(*) AS runs, count(DISTINCT pid) AS pids FROM runs"
    # $KERNEL_STORE works as well as --store.
    answered = kernel(kernel_exe, {**cli_env, "KERNEL_STORE": pg_url}, "query", sql,
                      "--format", "json")
    assert answered.returncode == 0, answered.stderr
    assert json.loads(answered.stdout) == [{"runs": 8, "pids": 8}]

    ok = next(r for r in runs if r["status"] == "ok")
    shown = kernel(kernel_exe, cli_env, "show", ok["short_id"], "--json", *store)
    assert shown.returncode == 0, shown.stderr
    timeline = json.loads(shown.stdout)
    assert timeline["run"]["caller_id"] == "fleet"
    assert [e["seq"] for e in timeline["events"]] == list(range(len(timeline["events"])))

    budget = kernel(kernel_exe, cli_env, "budget", "show", "fleet", "--json", *store)
    assert budget.returncode == 0, budget.stderr
    assert json.loads(budget.stdout)["runs"] == 5

    # The embedded journal knows nothing of them, and the analysts' file fed from the
    # server refuses to be fed from anything else.
    alone = kernel(kernel_exe, cli_env, "runs")
    assert alone.returncode == 1 and "give each store its own --db" in alone.stderr
    other = kernel(kernel_exe, {**cli_env, "KERNEL_DB": str(tmp_path / "other.duckdb")},
                   "runs", "--json")
    assert other.returncode == 0 and json.loads(other.stdout or "[]") == []


def test_an_unreachable_server_refuses_the_run(kernel_exe: str, cli_env: dict[str, str],
                                               tmp_path: Path) -> None:
    """Fail closed: the run does not start (exit 3, nothing executed); the analysts'
    commands say the server is unreachable in one line (exit 1); a bad URL is exit 2."""
    marker = tmp_path / "ran"
    dead = "postgresql://postgres@127.0.0.1:1/nothing"
    run = kernel(kernel_exe, {**cli_env, "KERNEL_AUDIT_LOCK_TIMEOUT": "2"}, "run",
                 "--store", dead, "--", "touch", str(marker))
    assert run.returncode == 3, run.stderr
    assert "unreachable" in run.stderr and not marker.exists()
    runs = kernel(kernel_exe, {**cli_env, "KERNEL_STORE": dead}, "runs")
    assert runs.returncode == 1
    assert runs.stderr.count("\n") == 1 and "unreachable" in runs.stderr
    bad = kernel(kernel_exe, cli_env, "runs", "--store", "mysql://x")
    assert bad.returncode == 2 and "postgresql://" in bad.stderr
