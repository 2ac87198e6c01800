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


def rows(stdout: str) -> list[dict[str, object]]:
    """A --json listing: one JSON array, or one object a line."""
    text = stdout.strip()
    if text.startswith("["):
        return list(json.loads(text))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_budget_holds_across_processes_and_every_command_sees_them(
        kernel_exe: str, cli_env: dict[str, str], pg_url: str, tmp_path: Path) -> None:
    """8 processes start runs of one caller at once against a budget of 5 runs: exactly 5
    run, 3 are refused (exit 3). `kernel runs` / `show` / `stats` / `query` / `budget show`
    / `sync` / `export` through the store then answer for all 8 runs, made by 8 processes."""
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
    runs = rows(listed.stdout)
    assert sorted(r["status"] for r in runs) == ["budget_exceeded"] * 3 + ["ok"] * 5

    stats = kernel(kernel_exe, cli_env, "stats", "--by", "status", "--json", *store)
    assert stats.returncode == 0, stats.stderr
    assert {r["status"]: r["runs"] for r in rows(stats.stdout)} == \
        {"ok": 5, "budget_exceeded": 3}

    sql = "SELECT count(*) AS runs, count(DISTINCT pid) AS pids FROM runs"
    # $KERNEL_STORE works as well as --store.
    answered = kernel(kernel_exe, {**cli_env, "KERNEL_STORE": pg_url}, "query", sql,
                      "--format", "json")
    assert answered.returncode == 0, answered.stderr
    assert rows(answered.stdout) == [{"runs": 8, "pids": 8}]

    ok = next(r for r in runs if r["status"] == "ok")
    shown = kernel(kernel_exe, cli_env, "show", ok["short_id"], "--json", *store)
    assert shown.returncode == 0, shown.stderr
    timeline = json.loads(shown.stdout)
    assert timeline["run"]["caller_id"] == "fleet"
    assert [e["seq"] for e in timeline["events"]] == list(range(len(timeline["events"])))

    budget = kernel(kernel_exe, cli_env, "budget", "show", "fleet", "--json", *store)
    assert budget.returncode == 0, budget.stderr
    [fleet] = rows(budget.stdout)
    assert fleet["runs"] == 5

    synced = kernel(kernel_exe, cli_env, "sync", *store)
    assert synced.returncode == 0 and synced.stdout.startswith("synced 0 events"), synced.stdout
    exported = kernel(kernel_exe, cli_env, "export", str(tmp_path / "out"), *store)
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "out" / "runs.parquet").exists()

    # The embedded journal knows nothing of them, and the analysts' file fed from the
    # server refuses to be fed from anything else.
    alone = kernel(kernel_exe, cli_env, "runs")
    assert alone.returncode == 1 and "give each store its own --db" in alone.stderr
    other = kernel(kernel_exe, {**cli_env, "KERNEL_DB": str(tmp_path / "other.duckdb")},
                   "runs", "--json")
    assert other.returncode == 0 and rows(other.stdout) == []


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


def test_a_run_from_a_dead_machine_is_taken_over_only_after_the_lease(
        kernel_exe: str, cli_env: dict[str, str], pg_url: str, tmp_path: Path) -> None:
    """A loop run whose holder is on another machine: `kernel recover --store` leaves it
    alone while its heartbeat is fresh, and resumes it (every state once, seq contiguous)
    once the heartbeat is older than the lease by the server's clock."""
    import psycopg
    from test_recover_cli import NUMBERED, _kill_when, _numbers, _start, query

    env = {**cli_env, "KERNEL_STORE": pg_url}
    loop = tmp_path / "numbered.yaml"
    # Half a second a state: still running when it is killed, on a loaded machine too.
    loop.write_text(NUMBERED.format(states=6, pause="sleep 0.5; "))
    marker = tmp_path / "marks"
    assert _kill_when(_start(kernel_exe, env, loop, marker, tmp_path), marker, 2) == -9

    def holder(sql: str) -> None:
        with psycopg.connect(pg_url, autocommit=True) as con:
            con.execute("UPDATE kernel.checkpoints SET host = 'a-dead-machine.example' "
                        "WHERE status = 'running'")
            con.execute(sql)

    # Its machine stopped sending heartbeats 10 s ago: within the lease (60 s).
    holder("UPDATE kernel.checkpoints SET heartbeat_at = heartbeat_at - 10000000")
    early = kernel(kernel_exe, cli_env, "recover", "--store", pg_url)
    assert early.returncode == 0 and "no interrupted runs" in early.stderr, early.stderr
    # Two minutes ago: provably gone.
    holder("UPDATE kernel.checkpoints SET heartbeat_at = heartbeat_at - 120000000")
    late = subprocess.run([kernel_exe, "recover", "--json", "--store", pg_url],
                          capture_output=True, text=True, env=cli_env, cwd=tmp_path,
                          timeout=240)
    assert late.returncode == 0, late.stderr
    [result] = [json.loads(line) for line in late.stdout.splitlines() if line]
    assert result["status"] == "ok"
    numbers = _numbers(marker)
    assert sorted(set(numbers)) == [1, 2, 3, 4, 5, 6] and len(numbers) <= 7, numbers
    [row] = query(env, kernel_exe, "SELECT count(*) AS n, count(DISTINCT seq) AS d, "
                  "max(seq) AS hi FROM events")
    assert row["n"] == row["d"] == row["hi"] + 1, row


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_batch_through_the_store(kernel_exe: str, cli_env: dict[str, str], pg_url: str,
                                   tmp_path: Path, workers: str) -> None:
    """`kernel batch --store` (in one process, or in two workers that each open the
    store): the batch, its tasks and their runs are on the server; `--list` and the
    analysts' `batch_runs` view read them back."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{i}", "command": ["sh", "-c", f"echo {i}"]})
                             + "\n" for i in range(6)))
    done = kernel(kernel_exe, cli_env, "batch", str(tasks), "-j", "3", "--json",
                  "--store", pg_url, "--workers", workers)
    assert done.returncode == 0, done.stderr
    assert ("2 workers" in done.stderr) == (workers == "2")
    assert sorted(str(r["status"]) for r in rows(done.stdout)) == ["ok"] * 6
    [listed] = rows(kernel(kernel_exe, cli_env, "batch", "--list", "--json", "--store",
                           pg_url).stdout)
    assert listed["counts"] == {"ok": 6}
    from test_recover_cli import query

    answer = query({**cli_env, "KERNEL_STORE": pg_url}, kernel_exe,
                   "SELECT count(*) AS n, count(DISTINCT run_id) AS runs FROM batch_runs "
                   "WHERE status = 'ok'")
    assert answer == [{"n": 6, "runs": 6}]


def test_pane_action_listings_read_the_store(kernel_exe: str, cli_env: dict[str, str],
                                             pg_url: str) -> None:
    """`kernel actions query/stats --store`: an empty store is an empty history (exit 0),
    an unreachable one is one line (exit 1)."""
    empty = kernel(kernel_exe, cli_env, "actions", "query", "--json", "--store", pg_url)
    assert empty.returncode == 0 and "no audit database at postgresql://" in empty.stderr
    ran = kernel(kernel_exe, cli_env, "run", "--store", pg_url, "--", "true")
    assert ran.returncode == 0, ran.stderr
    stats = kernel(kernel_exe, cli_env, "actions", "stats", "--store", pg_url)
    assert stats.returncode == 0 and "(no attempts)" in stats.stderr, stats.stderr
    dead = kernel(kernel_exe, cli_env, "actions", "query", "--store",
                  "postgresql://postgres@127.0.0.1:1/nothing")
    assert dead.returncode == 1 and dead.stderr.count("\n") == 1
    assert "unreachable" in dead.stderr
