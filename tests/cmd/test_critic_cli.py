"""The critic on the command line: `_make_critic`'s wiring, and `kernel run` end to end.

The end-to-end tests run the installed `kernel` executable in a subprocess
(real time, a few seconds each) against a DuckDB file in tmp_path.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batteries.critic import CriticPolicy, WatchCritic
from batteries.runner import make_critic as _make_critic
from kernel import ConfigError
from kernel import PortSpec as PortOptions


def kernel(exe: str, env: dict[str, str], *args: str, timeout: float = 30
           ) -> subprocess.CompletedProcess[str]:
    """Run the installed `kernel` with `args`; capture its output."""
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, stdin=subprocess.DEVNULL)


class TestMakeCritic:
    def test_defaults_are_the_policy_defaults(self) -> None:
        """With no flags, `kernel run` gets a WatchCritic with CriticPolicy's defaults, but
        for its bound on a tool in flight: a grace past the kernel's default tool timeout,
        so that timeout's error result answers first."""
        import dataclasses

        from batteries.runner import tool_timeout_grace
        from kernel import Limits

        critic = _make_critic(PortOptions())
        assert isinstance(critic, WatchCritic)
        tool = Limits().tool_timeout
        assert tool is not None
        assert critic.policy == dataclasses.replace(
            CriticPolicy(), tool_timeout=tool + tool_timeout_grace(tool))
        assert (critic.policy.soft_timeout, critic.policy.idle_timeout) == (600, 300)

    def test_flags_set_the_thresholds(self) -> None:
        """--soft-timeout and --idle-timeout reach the policy; the grace follows idle_timeout."""
        critic = _make_critic(PortOptions(soft_timeout=1, idle_timeout=2))
        assert isinstance(critic, WatchCritic)
        assert (critic.policy.soft_timeout, critic.policy.idle_timeout) == (1, 2)
        assert critic.policy.effective_grace == 0.5

    def test_zero_turns_a_tier_off(self) -> None:
        """0 disables that tier: no progress judgments, or no stall detection."""
        critic = _make_critic(PortOptions(soft_timeout=0, idle_timeout=0))
        assert isinstance(critic, WatchCritic)
        assert (critic.policy.soft_timeout, critic.policy.idle_timeout) == (None, None)

    def test_a_negative_value_names_the_flag(self) -> None:
        """A negative threshold is a one-line ConfigError naming the flag."""
        with pytest.raises(ConfigError, match=r"^--idle-timeout must be a number of seconds "
                                              r">= 0, got -3$"):
            _make_critic(PortOptions(idle_timeout=-3))


@pytest.fixture(scope="class")
def stalled_run(kernel_exe: str, tmp_path_factory: pytest.TempPathFactory
                ) -> tuple[subprocess.CompletedProcess[str], float, dict[str, str]]:
    """`kernel run --json --idle-timeout 2 -- sh -c 'echo start; sleep 60'`, run once."""
    import os

    env = dict(os.environ)
    env["KERNEL_DB"] = str(tmp_path_factory.mktemp("stall") / "kernel.duckdb")
    env["NO_COLOR"] = "1"
    start = time.monotonic()
    proc = kernel(kernel_exe, env, "run", "--json", "--idle-timeout", "2", "--",
                  "sh", "-c", "echo start; sleep 60")
    return proc, time.monotonic() - start, env


@pytest.mark.realtime
class TestStalledCommand:
    def test_killed_137_in_under_5s_with_reason_stalled(
            self, stalled_run: tuple[subprocess.CompletedProcess[str], float, dict[str, str]]
    ) -> None:
        """A command silent after one line exits 137 soon after 2 s idle; --json names `stalled`."""
        proc, _, _ = stalled_run
        assert proc.returncode == 137, proc.stderr
        doc = json.loads(proc.stdout)
        assert (doc["status"], doc["reason"]) == ("killed", "stalled")
        # What the kernel measured: 2 s idle plus a 0.5 s grace, not the 60 s sleep
        # (the upper margin is for a loaded machine, not a promise of slowness).
        assert 2.0 <= doc["runtime_seconds"] < 30, doc["runtime_seconds"]

    def test_kernel_show_names_the_reason(
            self, kernel_exe: str,
            stalled_run: tuple[subprocess.CompletedProcess[str], float, dict[str, str]]
    ) -> None:
        """`kernel show RUN_ID` of the killed run names the reason `stalled`."""
        proc, _, env = stalled_run
        run_id = json.loads(proc.stdout)["run_id"]
        show = kernel(kernel_exe, env, "show", run_id)
        assert show.returncode == 0, show.stderr
        assert "stalled" in show.stdout
        # The decision as a sentence, with its evidence.
        assert "critic   killed: stalled — no progress for" in show.stdout


@pytest.mark.realtime
class TestBusyQuietCommand:
    def test_a_silent_cpu_bound_command_is_not_stalled(self, kernel_exe: str,
                                                        cli_env: dict[str, str]) -> None:
        """Six seconds of computation printing nothing, at --idle-timeout 2: the critic sees
        the process working (CPU time advancing) and lets it finish."""
        code = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 6: pass"
        proc = kernel(kernel_exe, cli_env, "run", "--json", "--idle-timeout", "2",
                      "--timeout", "120", "--", sys.executable, "-c", code)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert json.loads(proc.stdout)["status"] == "ok"


@pytest.mark.realtime
class TestProgressingCommand:
    def test_extended_past_its_soft_timeout_exits_0(self, kernel_exe: str,
                                                    cli_env: dict[str, str],
                                                    tmp_path: Path) -> None:
        """A 5-second command printing every 0.1 s, soft timeout 1 s, exits 0 with at least one
        `extend` decision in the audit database."""
        db = tmp_path / "progress.duckdb"
        proc = kernel(kernel_exe, cli_env, "run", "--json", "--db", str(db),
                      "--soft-timeout", "1", "--timeout", "20", "--",
                      "sh", "-c", "for i in $(seq 50); do echo $i; sleep 0.1; done")
        assert proc.returncode == 0, proc.stderr
        run_id = json.loads(proc.stdout)["run_id"]
        import duckdb

        from batteries.audit import sync

        sync(db)  # runs write the journal; the analysts' file is fed from it
        with duckdb.connect(str(db), read_only=True) as con:
            row = con.execute(
                "SELECT count(*) FROM events WHERE run_id = ? AND kind = 'critic' "
                "AND name = 'extend'", [run_id]).fetchone()
        assert row is not None and row[0] >= 1


@pytest.mark.realtime
def test_critic_decisions_view_lists_interventions_only(tmp_path: Path) -> None:
    """critic_decisions shows the steer and the kill of a stalled run, not the thresholds."""
    db = tmp_path / "k.duckdb"
    exe = str(Path(sys.executable).parent / "kernel")
    subprocess.run([exe, "run", "--db", str(db), "--idle-timeout", "1", "--", "sleep", "10"],
                   capture_output=True, timeout=60)
    out = subprocess.run([exe, "query", "--db", str(db), "--format", "json",
                          "SELECT decision, reason FROM critic_decisions ORDER BY seq"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["decision"], r["reason"]) for r in rows] == [("steer", "stalled"),
                                                           ("kill", "stalled")]
