"""`kernel budget` and budget enforcement by `kernel run` (real processes)."""

from __future__ import annotations

import json
import subprocess

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
