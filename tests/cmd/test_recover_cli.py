"""Crash recovery end to end: SIGKILL real `kernel run` processes, then `kernel recover`."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from counter_loop import COUNTER

pytestmark = pytest.mark.realtime



def ticks(marker: Path) -> int:
    try:
        return len(marker.read_text().splitlines())
    except FileNotFoundError:
        return 0


def _killed_counter(kernel_exe: str, env: dict[str, str], loop: Path, marker: Path,
                    *args: str) -> None:
    """Start `loop` under `kernel run` (with `args`) and SIGKILL it after its 2nd tick."""
    proc = subprocess.Popen(
        [kernel_exe, "run", "--no-critic", *args, str(loop), "-c", f"marker={marker}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=loop.parent)
    deadline = time.monotonic() + 120  # a readiness wait: the bound is only for a hang
    while ticks(marker) < 2:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the loop never reached its kill point"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def query(env: dict[str, str], kernel_exe: str, sql: str) -> list[dict[str, object]]:
    proc = subprocess.run([kernel_exe, "query", sql, "--format", "json"], capture_output=True,
                          text=True, env=env, timeout=60, check=True)
    out = proc.stdout.strip()
    if out.startswith("["):
        return list(json.loads(out))
    return [json.loads(line) for line in out.splitlines() if line.strip()]


class TestRecover:
    def test_sigkill_then_recover(self, kernel_exe: str, cli_env: dict[str, str],
                                  tmp_path: Path) -> None:
        """Runs SIGKILLed at different points all finish under `kernel recover`, seq intact."""
        loop = tmp_path / "count.yaml"
        loop.write_text(COUNTER)
        kill_after_ticks = [1, 3, 5]
        for n, at in enumerate(kill_after_ticks):
            marker = tmp_path / f"ticks-{n}"
            proc = subprocess.Popen(
                [kernel_exe, "run", "--json", "--no-critic", str(loop), "-c", f"marker={marker}"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env, cwd=tmp_path)
            deadline = time.monotonic() + 120  # a readiness wait: the bound is only for a hang
            while ticks(marker) < at:
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the loop never reached its kill point"
                time.sleep(0.02)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
            assert proc.returncode == -signal.SIGKILL

        listed = subprocess.run([kernel_exe, "recover", "--list", "--json"], capture_output=True,
                                text=True, env=cli_env, timeout=60)
        assert listed.returncode == 0, listed.stderr
        assert len(listed.stdout.strip().splitlines()) == 3

        rec = subprocess.run([kernel_exe, "recover", "--json"], capture_output=True, text=True,
                             env=cli_env, timeout=120, cwd=tmp_path)
        assert rec.returncode == 0, rec.stderr
        results = [json.loads(line) for line in rec.stdout.strip().splitlines()]
        assert len(results) == 3
        assert all(r["status"] == "ok" for r in results), results
        assert all(str(r["output"]).strip() == "6" for r in results), results

        rows = query(cli_env, kernel_exe,
                     "SELECT run_id, count(*) AS n, count(DISTINCT seq) AS d, min(seq) AS lo, "
                     "max(seq) AS hi, count(*) FILTER (WHERE kind = 'resumed') AS resumed "
                     "FROM events GROUP BY run_id")
        by_run = {r["run_id"]: r for r in rows}
        for r in results:
            row = by_run[r["run_id"]]
            assert row["n"] == row["d"] == int(row["hi"]) + 1 and row["lo"] == 0, row
            assert row["resumed"] == 1, row
        statuses = query(cli_env, kernel_exe, "SELECT status FROM runs")
        assert [s["status"] for s in statuses] == ["ok"] * 3

        again = subprocess.run([kernel_exe, "recover"], capture_output=True, text=True,
                               env=cli_env, timeout=60)
        assert again.returncode == 0 and "no interrupted runs" in again.stderr

    def test_resume_with_its_output_lost_exits_1(self, kernel_exe: str,
                                                 cli_env: dict[str, str],
                                                 tmp_path: Path) -> None:
        """`kernel resume` whose answer cannot be written (stdout on a full disk) exits 1 and
        says why, as `kernel run` does (it exited 0: the code `_report` decided was dropped)."""
        loop = tmp_path / "count.yaml"
        loop.write_text(COUNTER)
        _killed_counter(kernel_exe, cli_env, loop, tmp_path / "ticks")
        with open("/dev/full", "w") as full:
            done = subprocess.run([kernel_exe, "resume", "last"], stdout=full,
                                  stderr=subprocess.PIPE, text=True, env=cli_env, timeout=120,
                                  cwd=tmp_path)
        assert done.returncode == 1, done.stderr
        assert "ok after" in done.stderr  # the run itself ended ok
        assert "its output could not all be written" in done.stderr

    def test_a_resumed_run_is_not_counted_twice(self, kernel_exe: str,
                                                cli_env: dict[str, str],
                                                tmp_path: Path) -> None:
        """A caller's one run a day, SIGKILLed and recovered: it resumes and counts once."""
        loop = tmp_path / "count.yaml"
        loop.write_text(COUNTER)
        setup = subprocess.run([kernel_exe, "budget", "set", "ivy", "--runs", "1"],
                               capture_output=True, text=True, env=cli_env, timeout=60)
        assert setup.returncode == 0, setup.stderr
        _killed_counter(kernel_exe, cli_env, loop, tmp_path / "ticks", "--caller", "ivy")

        refused = subprocess.run([kernel_exe, "run", "--caller", "ivy", "--", "true"],
                                 capture_output=True, text=True, env=cli_env, timeout=60)
        assert refused.returncode == 3, refused.stderr  # the day's one run is in use
        rec = subprocess.run([kernel_exe, "recover", "--json"], capture_output=True, text=True,
                             env=cli_env, timeout=120, cwd=tmp_path)
        assert rec.returncode == 0, rec.stderr
        [result] = [json.loads(line) for line in rec.stdout.strip().splitlines()]
        assert result["status"] == "ok", result
        shown = subprocess.run([kernel_exe, "budget", "show", "ivy", "--json"],
                               capture_output=True, text=True, env=cli_env, timeout=60)
        assert shown.returncode == 0, shown.stderr
        spent = json.loads(shown.stdout)
        assert spent["runs"] == 1, spent
        assert spent["runtime_seconds"] > 0, spent  # the resumed session is metered

    def test_spec_stored_before_versions_resumes(self, kernel_exe: str,
                                                 cli_env: dict[str, str],
                                                 tmp_path: Path) -> None:
        """A run whose spec has no version field (as main stored it) still resumes, once."""
        import sqlite3

        from batteries.store import journal_path

        loop = tmp_path / "count.yaml"
        loop.write_text(COUNTER)
        _killed_counter(kernel_exe, cli_env, loop, tmp_path / "ticks")
        con = sqlite3.connect(journal_path(cli_env["KERNEL_DB"]))
        with con:
            [(run_id, text)] = con.execute("SELECT run_id, spec FROM checkpoints").fetchall()
            stored = json.loads(text)
            assert stored.pop("version") == 2
            assert stored["agent"].pop("price") is None  # version 2 added it
            # Main's document: these keys, in this order, and nothing else.
            old = {"agent": stored["agent"], "info": stored["info"],
                   "limits": stored["limits"], "ports": stored["ports"],
                   "cwd": stored["cwd"], "redacted": stored["redacted"]}
            assert old == stored
            con.execute("UPDATE checkpoints SET spec = ? WHERE run_id = ?",
                        [json.dumps(old), run_id])
        con.close()
        rec = subprocess.run([kernel_exe, "resume", "last", "--json"], capture_output=True,
                             text=True, env=cli_env, timeout=120)
        assert rec.returncode == 0, rec.stderr
        result = json.loads(rec.stdout)
        assert result["status"] == "ok" and str(result["output"]).strip() == "6"
        [row] = query(cli_env, kernel_exe,
                      "SELECT count(*) AS n, count(DISTINCT seq) AS d, max(seq) AS hi, "
                      "count(*) FILTER (WHERE kind = 'resumed') AS resumed FROM events")
        assert row["n"] == row["d"] == int(row["hi"]) + 1 and row["resumed"] == 1, row

    @pytest.mark.parametrize(("how", "code"), [("recover", 1), ("resume", 6)])
    def test_command_cannot_resume(self, kernel_exe: str, cli_env: dict[str, str], how: str,
                                   code: int) -> None:
        """A SIGKILLed plain command is reported as not resumable, clearly, and given up:
        `kernel resume` exits with `lost`'s code (6), `kernel recover` with 1 (one of the
        runs it took did not end ok)."""
        proc = subprocess.Popen([kernel_exe, "run", "--no-critic", "--", "sleep", "30.789"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env)
        deadline = time.monotonic() + 120  # a readiness wait: the bound is only for a hang
        while subprocess.run(["pgrep", "-f", "^sleep 30.789"], capture_output=True).returncode:
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        subprocess.run(["pkill", "-f", "^sleep 30.789"], check=False)
        rec = subprocess.run([kernel_exe, how, *(["last"] if how == "resume" else [])],
                             capture_output=True, text=True, env=cli_env, timeout=60)
        assert rec.returncode == code, rec.stderr
        assert "cannot resume: a plain command has no resumable state" in rec.stderr
        assert "no interrupted runs" in subprocess.run(
            [kernel_exe, "recover"], capture_output=True, text=True, env=cli_env,
            timeout=60).stderr

    def test_resume_unknown(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """Resuming a run id that has no checkpoint is one line, exit 2."""
        proc = subprocess.run([kernel_exe, "resume", "ffff"], capture_output=True, text=True,
                              env=cli_env, timeout=60)
        assert proc.returncode == 2
        assert proc.stderr.strip().splitlines() == [
            "kernel resume: error: no run 'ffff' with a checkpoint"]



class TestSignals:
    @pytest.mark.parametrize(("sig", "listed"), [
        (signal.SIGTERM, 1), (signal.SIGHUP, 1), (signal.SIGQUIT, 1), (signal.SIGINT, 0)],
        ids=["sigterm-resumable", "sighup-resumable", "sigquit-resumable", "ctrl-c-final"])
    def test_shutdown_vs_ctrl_c(self, sig: int, listed: int, kernel_exe: str,
                                cli_env: dict[str, str], tmp_path: Path) -> None:
        """SIGTERM (shutdown) leaves a loop run to `kernel recover`; Ctrl-C ends it for good."""
        loop = tmp_path / "count.yaml"
        loop.write_text(COUNTER)
        marker = tmp_path / "ticks"
        proc = subprocess.Popen(
            [kernel_exe, "run", "--no-critic", str(loop), "-c", f"marker={marker}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env, cwd=tmp_path)
        deadline = time.monotonic() + 120  # a readiness wait: the bound is only for a hang
        while ticks(marker) < 2:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(sig)
        proc.communicate(timeout=30)
        assert proc.returncode == 130
        out = subprocess.run([kernel_exe, "recover", "--list", "--json"], capture_output=True,
                             text=True, env=cli_env, timeout=60).stdout
        assert len(out.strip().splitlines()) == listed
        if listed:
            rec = subprocess.run([kernel_exe, "recover", "--json"], capture_output=True,
                                 text=True, env=cli_env, timeout=120, cwd=tmp_path)
            assert rec.returncode == 0, rec.stderr
            assert json.loads(rec.stdout)["status"] == "ok"


# One side effect per state: the state's number appended to a file, so a state that
# runs twice shows as a repeated number.
NUMBERED = """\
name: numbered
initial: count
max_iterations: 100
timeout: 300
states:
  count:
    action: >-
      n=$(( ${{captured.n.output:default=0}} + 1 )); echo $n >> ${{context.marker}};
      {pause}echo $n
    capture: n
    evaluate:
      type: output_numeric
      operator: ge
      target: {states}
    route:
      yes: done
      no: count
  done:
    terminal: true
"""


def _numbers(marker: Path) -> list[int]:
    try:
        return [int(x) for x in marker.read_text().split()]
    except FileNotFoundError:
        return []


def _start(kernel_exe: str, env: dict[str, str], loop: Path, marker: Path,
           cwd: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [kernel_exe, "run", "--json", "--no-critic", str(loop), "-c", f"marker={marker}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd)


def _kill_when(proc: subprocess.Popen[bytes], marker: Path, ticks_at_least: int,
               extra: float = 0.0) -> int | None:
    deadline = time.monotonic() + 120  # a readiness wait: the bound is only for a hang
    while len(_numbers(marker)) < ticks_at_least:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the loop never reached its kill point"
        time.sleep(0.005)
    if extra:
        time.sleep(extra)
    os.kill(proc.pid, signal.SIGKILL)
    return proc.wait(timeout=10)


def _audit_by_run(env: dict[str, str], kernel_exe: str) -> dict[str, dict[str, object]]:
    rows = query(env, kernel_exe,
                 "SELECT run_id, count(*) AS n, count(DISTINCT seq) AS d, min(seq) AS lo, "
                 "max(seq) AS hi, count(*) FILTER (WHERE kind = 'resumed') AS resumed, "
                 "max(CASE WHEN kind = 'resumed' THEN name END) AS resumed_state, "
                 "max(CASE WHEN kind = 'resumed' THEN (payload->>'steps')::INT END) AS steps, "
                 "max(CASE WHEN kind = 'run_start' "
                 "THEN payload->'inputs'->'context'->>'marker' END) AS marker "
                 "FROM events GROUP BY run_id")
    return {str(r["run_id"]): r for r in rows}


class TestExactlyOnce:
    @pytest.mark.parametrize("store", ["journal", "postgres"])
    @pytest.mark.parametrize("recoverers", [2, 4])
    def test_concurrent_recoverers_resume_each_run_once(
            self, recoverers: int, store: str, kernel_exe: str, cli_env: dict[str, str],
            tmp_path: Path, request: pytest.FixtureRequest) -> None:
        """Several `kernel recover` started together on interrupted runs: each run is resumed
        by exactly one of them, every remaining state runs once, seq contiguous and unique.
        With the PostgreSQL store the runs write to the server ($KERNEL_STORE) and the
        recoverers are given it with `--store URL`."""
        recover_args = ""
        recover_env = cli_env
        if store == "postgres":
            url = request.getfixturevalue("pg_url")
            cli_env["KERNEL_STORE"] = url
            recover_env = {k: v for k, v in cli_env.items() if k != "KERNEL_STORE"}
            recover_args = f" --store '{url}'"
        loop = tmp_path / "numbered.yaml"
        # Half a second a state: the runs are killed one after another, and the last one
        # (at its 4th state) must still be running when its turn comes on a loaded machine.
        loop.write_text(NUMBERED.format(states=8, pause="sleep 0.5; "))
        markers = [tmp_path / f"marks-{i}" for i in range(4)]
        procs = [_start(kernel_exe, cli_env, loop, m, tmp_path) for m in markers]
        codes = [_kill_when(proc, marker, at)
                 for proc, marker, at in zip(procs, markers, (1, 2, 3, 4), strict=True)]
        assert codes == [-signal.SIGKILL] * 4, codes  # every run was interrupted
        go = tmp_path / "go"
        script = (f'while [ ! -e "{go}" ]; do sleep 0.01; done; '
                  f'exec "{kernel_exe}" recover --json{recover_args}')
        recs = [subprocess.Popen(["sh", "-c", script], env=recover_env, cwd=tmp_path,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(recoverers)]
        go.touch()
        outs = [r.communicate(timeout=240) for r in recs]
        assert all(r.returncode == 0 for r in recs), [err for _, err in outs]
        results = [json.loads(line) for out, _ in outs for line in out.splitlines() if line]
        assert sorted(r["status"] for r in results) == ["ok"] * 4, results  # each once
        audit = _audit_by_run(cli_env, kernel_exe)
        for r in results:
            row = audit[r["run_id"]]
            assert row["n"] == row["d"] == int(str(row["hi"])) + 1 and row["lo"] == 0, row
            assert row["resumed"] == 1, row
        for marker in markers:
            numbers = _numbers(marker)
            assert sorted(set(numbers)) == list(range(1, 9)), numbers
            assert len(numbers) <= 9, numbers  # at most the state in flight ran twice

    def test_sigkill_at_twenty_random_moments(self, kernel_exe: str, cli_env: dict[str, str],
                                              tmp_path: Path) -> None:
        """A 30-state loop SIGKILLed at 20 random moments: `kernel recover` finishes every
        run, at most one state runs again per crash, and that re-run is in the audit (a
        `resumed` event naming the state, at the step that ran twice)."""
        rng = random.Random(15)
        loop = tmp_path / "thirty.yaml"
        loop.write_text(NUMBERED.format(states=30, pause="sleep 0.05; "))
        markers = [tmp_path / f"marks-{i:02}" for i in range(20)]
        for batch in range(0, 20, 5):
            group = markers[batch:batch + 5]
            procs = [_start(kernel_exe, cli_env, loop, m, tmp_path) for m in group]
            moments = [(rng.randint(1, 27), rng.uniform(0, 0.05)) for _ in group]
            with ThreadPoolExecutor(len(group)) as pool:  # each run killed on its own clock
                codes = list(pool.map(lambda a: _kill_when(*a[0], *a[1]),
                                      zip(zip(procs, group, strict=True), moments,
                                          strict=True)))
            assert codes == [-signal.SIGKILL] * len(group), codes
        rec = subprocess.run([kernel_exe, "recover", "--json"], capture_output=True, text=True,
                             env=cli_env, timeout=600, cwd=tmp_path)
        assert rec.returncode == 0, rec.stderr
        results = [json.loads(line) for line in rec.stdout.splitlines() if line]
        assert len(results) == 20 and all(r["status"] == "ok" for r in results), results
        audit = {str(row["marker"]): row for row in _audit_by_run(cli_env, kernel_exe).values()}
        reruns = 0
        for marker in markers:
            numbers = _numbers(marker)
            assert sorted(set(numbers)) == list(range(1, 31)), numbers
            twice = [n for n in set(numbers) if numbers.count(n) > 1]
            assert len(numbers) <= 31 and len(twice) <= 1, numbers
            row = audit[str(marker)]
            assert row["n"] == row["d"] == int(str(row["hi"])) + 1, row
            assert row["resumed"] == 1 and row["resumed_state"] == "count", row
            if twice:  # the state that ran again is the one the audit says was resumed
                reruns += 1
                assert twice == [int(str(row["steps"])) + 1], (numbers, row)
        print(f"20 crashes: {reruns} states ran twice, {20 - reruns} died before their effect")
