"""Crash recovery end to end: SIGKILL real `kernel run` processes, then `kernel recover`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.realtime

COUNTER = """\
name: count-to-six
description: Count to six, one state execution at a time, leaving a tick per step.
initial: count
max_iterations: 40
timeout: 60
states:
  count:
    action: echo tick >> ${context.marker}; sleep 0.2; expr ${captured.n.output:default=0} + 1
    capture: n
    evaluate:
      type: output_numeric
      operator: ge
      target: 6
    route:
      yes: done
      no: count
  done:
    terminal: true
"""


def ticks(marker: Path) -> int:
    try:
        return len(marker.read_text().splitlines())
    except FileNotFoundError:
        return 0


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
            deadline = time.monotonic() + 30
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

    def test_command_cannot_resume(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """A SIGKILLed plain command is reported as not resumable, clearly, and given up."""
        proc = subprocess.Popen([kernel_exe, "run", "--no-critic", "--", "sleep", "30.789"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env)
        deadline = time.monotonic() + 30
        while subprocess.run(["pgrep", "-f", "^sleep 30.789"], capture_output=True).returncode:
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        subprocess.run(["pkill", "-f", "^sleep 30.789"], check=False)
        rec = subprocess.run([kernel_exe, "recover"], capture_output=True, text=True,
                             env=cli_env, timeout=60)
        assert rec.returncode == 1
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
            "kernel: error: no run 'ffff' with a checkpoint"]



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
        deadline = time.monotonic() + 30
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
