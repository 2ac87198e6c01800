"""`kernel budget` and budget enforcement by `kernel run` (real processes)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path

import pytest

pytestmark = pytest.mark.realtime


def kernel(exe: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=60,
                          stdin=subprocess.DEVNULL)


class TestBudgetCli:
    def test_third_run_of_the_day_exits_3(self, kernel_exe: str,
                                          cli_env: dict[str, str]) -> None:
        """A caller allowed 2 runs a day: the third `kernel run` is budget_exceeded, exit 3."""
        assert kernel(kernel_exe, cli_env, "budget", "set", "ci-bot", "--runs", "2").returncode == 0
        codes = [kernel(kernel_exe, cli_env, "run", "--caller", "ci-bot", "--", "true")
                 for _ in range(3)]
        assert [p.returncode for p in codes] == [0, 0, 3], codes[-1].stderr
        assert "used 2 of 2 runs in the last 24h" in codes[-1].stderr
        other = kernel(kernel_exe, cli_env, "run", "--caller", "someone-else", "--", "true")
        assert other.returncode == 0
        shown = kernel(kernel_exe, cli_env, "budget", "show", "ci-bot", "--json")
        doc = json.loads(shown.stdout)
        assert doc["runs"] == 2 and doc["max_runs"] == 2

    def test_bad_input(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """A budget with no limit, a bad window or an unknown caller to rm: one line, exit 2."""
        for args in (["budget", "set", "x"], ["budget", "set", "x", "--runs", "1", "--window",
                                               "soon"], ["budget", "rm", "nobody"]):
            proc = kernel(kernel_exe, cli_env, *args)
            assert proc.returncode == 2, args
            assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


class TestAtomicBudgets:
    def test_eight_simultaneous_runs_against_five(self, kernel_exe: str,
                                                  cli_env: dict[str, str], tmp_path: Path) -> None:
        """8 processes start runs of one caller at once against a budget of 5: exactly 5 run,
        the other 3 are refused (exit 3) without running their command."""
        assert kernel(kernel_exe, cli_env, "budget", "set", "crowd", "--runs", "5").returncode == 0
        marker = tmp_path / "ran"
        go = tmp_path / "go"
        # Each process waits for the same file before exec'ing `kernel run`, so all 8
        # reach the budget check together (the readiness is a file, not a sleep).
        script = (f'while [ ! -e "{go}" ]; do sleep 0.01; done; exec "{kernel_exe}" run '
                  f'--caller crowd -- sh -c "echo x >> {marker}"')
        procs = [subprocess.Popen(["sh", "-c", script], env=cli_env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(8)]
        go.touch()
        outs = [(p.wait(timeout=120), p.communicate()) for p in procs]
        codes = sorted(code for code, _ in outs)
        assert codes == [0] * 5 + [3] * 3, outs
        assert len(marker.read_text().splitlines()) == 5
        refused = [err for code, (_, err) in outs if code == 3]
        assert all("used 5 of 5 runs" in err for err in refused), refused
        shown = json.loads(kernel(kernel_exe, cli_env, "budget", "show", "crowd",
                                  "--json").stdout)
        assert shown["runs"] == 5

    def test_no_budget_no_spend_and_three_transactions(self, kernel_exe: str,
                                                       cli_env: dict[str, str],
                                                       tmp_path: Path) -> None:
        """Without a budget nothing is reserved or settled; with or without one, `kernel run`
        touches the journal three times: when its run opens, when its command's process
        group starts (written at once, for `kernel recover`), and when it closes."""
        free = json.loads(kernel(kernel_exe, cli_env, "run", "--json", "--caller", "free",
                                 "--", "true").stdout)
        assert free["storage"]["transactions"] - free["storage"]["timed_flushes"] == 3, free
        assert kernel(kernel_exe, cli_env, "budget", "set", "capped", "--runs", "9"
                      ).returncode == 0
        capped = json.loads(kernel(kernel_exe, cli_env, "run", "--json", "--caller", "capped",
                                   "--", "true").stdout)
        assert capped["storage"]["transactions"] - capped["storage"]["timed_flushes"] == 3, \
            capped
        journal = Path(cli_env["KERNEL_DB"] + ".journal")
        with closing(sqlite3.connect(journal)) as con:
            spend = con.execute("SELECT caller_id, settled FROM budget_spend").fetchall()
        assert spend == [("capped", 1)]

    def test_a_long_run_adds_only_timed_flushes(self, kernel_exe: str,
                                                cli_env: dict[str, str]) -> None:
        """A run outliving the journal's flush interval (1 s) gets its buffered events
        written by the timer; those are the only transactions beyond its three."""
        doc = json.loads(kernel(kernel_exe, cli_env, "run", "--json", "--", "sh", "-c",
                                "echo buffered; sleep 1.5; echo done").stdout)
        assert doc["status"] == "ok"
        storage = doc["storage"]
        assert storage["timed_flushes"] >= 1, storage
        assert storage["transactions"] - storage["timed_flushes"] == 3, storage

    def test_an_unreachable_budget_store_refuses_the_run(self, kernel_exe: str,
                                                         cli_env: dict[str, str],
                                                         tmp_path: Path) -> None:
        """A journal damaged past its header: the run is refused, exit 3, the reason on
        stderr. (One that is not SQLite at all is refused before, exit 2.)"""
        journal = Path(cli_env["KERNEL_DB"] + ".journal")
        journal.write_bytes(b"SQLite format 3\x00" + b"garbage" * 1000)
        marker = tmp_path / "ran"
        proc = kernel(kernel_exe, cli_env, "run", "--", "touch", str(marker))
        assert proc.returncode == 3
        assert not marker.exists()
        assert "budget check failed" in proc.stderr and "Traceback" not in proc.stderr
        journal.write_bytes(b"garbage" * 1000)
        proc = kernel(kernel_exe, cli_env, "run", "--", "touch", str(marker))
        assert proc.returncode == 2 and not marker.exists()
        assert proc.stderr.strip().endswith("is not usable: it is not a SQLite file (damaged, "
                                            "or not a journal); move it away (a new one is "
                                            "started with the budgets and resumable runs the "
                                            "analysts' file held at its last `kernel sync`)"
                                            ), proc.stderr

    def test_a_journal_moved_away_starts_again_with_the_synced_budgets(
            self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """What the damaged-journal message promises: after `kernel sync`, a journal moved
        away is started again with the budgets (and their spend) the analysts' file holds,
        so following the message does not lift every caller's budget."""
        assert kernel(kernel_exe, cli_env, "budget", "set", "ann", "--runs", "2").returncode == 0
        assert kernel(kernel_exe, cli_env, "run", "--caller", "ann", "--", "true").returncode == 0
        assert kernel(kernel_exe, cli_env, "sync").returncode == 0
        journal = Path(cli_env["KERNEL_DB"] + ".journal")
        journal.rename(journal.with_name("moved.journal"))
        assert kernel(kernel_exe, cli_env, "run", "--caller", "ann", "--", "true").returncode == 0
        proc = kernel(kernel_exe, cli_env, "run", "--caller", "ann", "--", "true")
        assert proc.returncode == 3, proc.stderr
        assert "used 2 of 2 runs" in proc.stderr
