"""Pane actions against a real tmux server on a private socket (real time, kept short).

A scripted agent (`pane_agent.py`) runs in each pane. Every outcome is
reproduced end to end through the installed `kernel actions run`, then read
back with `kernel actions query` and `stats`. The tmux server is killed when
the module's tests are done, whatever happened.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from typer.testing import CliRunner, Result

from adapters.pane import (
    ActionContext,
    MultiplexerError,
    NonceProbe,
    Outcome,
    TargetState,
    TmuxMultiplexer,
    run_attempt,
)
from kernel import ConfigError

pytestmark = [
    pytest.mark.realtime,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

AGENT = Path(__file__).with_name("pane_agent.py")
# Fast typing for the tests; the defaults are tuned for real TUIs.
FAST = {"KERNEL_PANE_KEY_DELAY": "0.002", "KERNEL_PANE_SUBMIT_DELAY": "0.05"}


class Tmux:
    """A private tmux server (`tmux -L <socket>`) for one test module."""

    def __init__(self, socket: str) -> None:
        self.socket = socket

    def cmd(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True,
                              text=True, check=check, timeout=10)

    def capture(self, target: str) -> str:
        return self.cmd("capture-pane", "-p", "-J", "-t", target).stdout

    def start(self, command: str, *, ready: str, remain: bool = False,
              prompt: bool = False) -> str:
        """Start `command` in a new session; return its name once `ready` shows in the pane.

        With `prompt`, also wait until the pane's last line is the "> " prompt.
        """
        name = "s" + secrets.token_hex(3)
        self.cmd("new-session", "-d", "-s", name, "-x", "120", "-y", "30")
        if remain:
            self.cmd("set-option", "-p", "-t", name, "remain-on-exit", "on")
        self.cmd("respawn-pane", "-k", "-t", name, command)
        deadline = time.monotonic() + 10
        while True:
            text = self.capture(name)
            if ready in text and (not prompt or text.rstrip().endswith(">")):
                return name
            if time.monotonic() > deadline:
                raise AssertionError(f"{command!r} never got ready:\n{text}")
            time.sleep(0.02)

    def agent(self, mode: str = "alive", *extra: str) -> str:
        """A session running the scripted agent; returns once it waits for input."""
        argv = [sys.executable, str(AGENT), "--mode", mode, *extra]
        return self.start(shlex.join(argv), ready="agent ready", prompt=mode != "fragile")


@pytest.fixture(scope="module")
def tmux() -> Iterator[Tmux]:
    """A tmux server on a private socket, killed at the end of the module even on failure."""
    server = Tmux(f"kernel-test-{os.getpid()}-{secrets.token_hex(4)}")
    socket_path: str | None = None
    try:
        # A session that outlives the others: tmux exits when its last session closes.
        server.cmd("new-session", "-d", "-s", "keeper")
        socket_path = server.cmd("display-message", "-p", "#{socket_path}").stdout.strip()
        yield server
    finally:
        server.cmd("kill-server", check=False)
        if socket_path:
            Path(socket_path).unlink(missing_ok=True)  # tmux leaves the socket file behind


def mux_for(tmux: Tmux, **kw: Any) -> TmuxMultiplexer:
    return TmuxMultiplexer(socket=tmux.socket, key_delay=kw.pop("key_delay", 0.002),
                           submit_delay=kw.pop("submit_delay", 0.05), **kw)


class TestTmuxMultiplexer:
    async def test_typing_round_trip(self, tmux: Tmux) -> None:
        """Typed text reaches the program intact, semicolons and non-ASCII included."""
        name = tmux.start("cat", ready="")
        text = "a;b; é… ;"
        await mux_for(tmux).send_text(name, text)
        deadline = trio.current_time() + 5
        while (await mux_for(tmux).capture(name)).count(text) < 2:  # tty echo + cat's copy
            assert trio.current_time() < deadline, await mux_for(tmux).capture(name)
            await trio.sleep(0.02)

    async def test_key_delay_paces_typing(self, tmux: Tmux) -> None:
        """With a key delay, ten keys take at least nine delays; without one, it is one call."""
        name = tmux.start("cat", ready="")
        t0 = trio.current_time()
        await mux_for(tmux, key_delay=0.05, submit_delay=0).send_text(name, "0123456789")
        assert trio.current_time() - t0 >= 0.45
        t0 = trio.current_time()
        await mux_for(tmux, key_delay=0, submit_delay=0).send_text(name, "0123456789")
        assert trio.current_time() - t0 < 0.45

    async def test_target_status(self, tmux: Tmux) -> None:
        """Live, dead (kept after exit) and unknown panes, and a server that is not running."""
        mux = mux_for(tmux)
        live = tmux.start("cat", ready="")
        assert (await mux.target_status(live)).alive
        dead = tmux.start("cat", ready="", remain=True)
        tmux.cmd("send-keys", "-t", dead, "C-d")
        deadline = trio.current_time() + 5
        while (status := await mux.target_status(dead)).state is not TargetState.DEAD:
            assert trio.current_time() < deadline
            await trio.sleep(0.02)
        assert "exited" in status.detail
        gone = await mux.target_status(f"{live}:0.7")
        assert gone.state is TargetState.UNKNOWN and "can't find pane" in gone.detail
        nobody = await TmuxMultiplexer(socket=f"kernel-nobody-{secrets.token_hex(4)}"
                                       ).target_status("x")
        assert nobody.state is TargetState.UNKNOWN and nobody.detail

    async def test_failures_are_multiplexer_errors(self, tmux: Tmux) -> None:
        """A missing pane or a missing tmux binary is a MultiplexerError naming the cause."""
        with pytest.raises(MultiplexerError, match="can't find"):
            await mux_for(tmux).capture("no-such-session")
        with pytest.raises(MultiplexerError, match="not installed"):
            await TmuxMultiplexer(tmux="/nonexistent/tmux").capture("x")

    def test_delays_from_the_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The two delays come from KERNEL_PANE_*_DELAY, with defaults; junk is a ConfigError."""
        monkeypatch.delenv("KERNEL_PANE_KEY_DELAY", raising=False)
        monkeypatch.delenv("KERNEL_PANE_SUBMIT_DELAY", raising=False)
        mux = TmuxMultiplexer()
        assert (mux.key_delay, mux.submit_delay) == (0.01, 0.3)
        monkeypatch.setenv("KERNEL_PANE_KEY_DELAY", "0")
        monkeypatch.setenv("KERNEL_PANE_SUBMIT_DELAY", "1.5")
        mux = TmuxMultiplexer()
        assert (mux.key_delay, mux.submit_delay) == (0, 1.5)
        for bad in ("-1", "soon", "inf"):
            monkeypatch.setenv("KERNEL_PANE_SUBMIT_DELAY", bad)
            with pytest.raises(ConfigError, match="KERNEL_PANE_SUBMIT_DELAY"):
                TmuxMultiplexer()

    async def test_probe_in_a_real_pane(self, tmux: Tmux) -> None:
        """The engine's nonce probe succeeds against the scripted agent in a real pane."""
        name = tmux.agent("alive", "--delay", "0.05")
        ctx = ActionContext(name, name, mux_for(tmux))
        attempt = await run_attempt(NonceProbe(), ctx, timeout=5, poll_interval=0.05)
        assert attempt.outcome is Outcome.SUCCESS, attempt
        assert attempt.extras["probe"] == "alive"


# --------------------------------------------------------------- the CLI
#
# `kernel actions run` goes through the installed executable (the end-to-end
# path); `query` and `stats` run the real app in-process on the same database,
# which keeps the module to a few seconds.


def kernel(exe: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, timeout=30,
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def env(cli_env: dict[str, str], tmux: Tmux) -> dict[str, str]:
    """CLI environment: the test's audit database, our tmux server, fast typing."""
    return {**cli_env, **FAST, "KERNEL_TMUX_SOCKET": tmux.socket}


def act(exe: str, env: dict[str, str], *args: str) -> tuple[int, dict[str, Any]]:
    """`kernel actions run ... --json`: the exit code and the attempt document."""
    proc = kernel(exe, env, "actions", "run", *args, "--json")
    assert proc.stdout.count("\n") == 1, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def cli(*args: str) -> Result:
    """Run the real `kernel` app in-process (its database is the test's $KERNEL_DB)."""
    from kernel_cli.app import app

    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def attempts(*args: str) -> list[dict[str, Any]]:
    """`kernel actions query --json ARGS` as a list of rows."""
    res = cli("actions", "query", "--json", *args)
    assert res.exit_code == 0, res.output
    rows: list[dict[str, Any]] = [json.loads(line) for line in res.stdout.splitlines()]
    return rows


class TestActionsCli:
    def test_nonce_probe_success(self, kernel_exe: str, env: dict[str, str],
                                 tmux: Tmux) -> None:
        """A probe of a live agent exits 0, and the attempt is in `kernel actions query`."""
        name = tmux.agent("alive")
        code, doc = act(kernel_exe, env, "nonce-probe", name, "--poll-interval", "0.1",
                        "--pane", "claude-1")
        assert code == 0 and doc["outcome"] == "success" and doc["status"] == "ok"
        assert doc["extras"]["probe"] == "alive"
        assert doc["pane_after"]["text"].count(doc["extras"]["nonce"]) >= 2
        [row] = attempts()
        assert row["run_id"] == doc["run_id"] and row["agent"] == "claude-1"
        assert (row["action"], row["outcome"]) == ("nonce-probe", "success")
        assert row["extras"]["nonce"] == doc["extras"]["nonce"]
        assert row["pane_before"]["text"].endswith("> ")

    def test_compact_success(self, kernel_exe: str, env: dict[str, str], tmux: Tmux) -> None:
        """/compact on an agent at 80% that drops to 10% exits 0 with the drop recorded."""
        name = tmux.agent("alive", "--context", "80", "--compact-to", "10")
        code, doc = act(kernel_exe, env, "compact", name, "--poll-interval", "0.1",
                        "--min-drop-pct", "70")
        assert code == 0 and doc["outcome"] == "success"
        assert doc["extras"]["drop_pct"] == 70 and doc["extras"]["min_drop_pct"] == 70
        [row] = attempts("--action", "compact")
        assert row["outcome"] == "success" and row["agent"] == name

    def test_busy_is_precondition_fail(self, kernel_exe: str, env: dict[str, str],
                                       tmux: Tmux) -> None:
        """A busy agent is not typed into: exit 1, precondition_fail, the pane unchanged."""
        name = tmux.agent("busy")
        before = tmux.capture(name)
        code, doc = act(kernel_exe, env, "nonce-probe", name)
        assert code == 1 and doc["outcome"] == "precondition_fail" and doc["status"] == "error"
        assert doc["extras"]["probe"] == "busy" and doc["pane_after"] is None
        assert tmux.capture(name) == before
        assert [r["outcome"] for r in attempts()] == ["precondition_fail"]

    def test_silent_is_completion_timeout(self, kernel_exe: str, env: dict[str, str],
                                          tmux: Tmux) -> None:
        """A silent agent takes the request but never echoes: exit 1 after --timeout."""
        name = tmux.agent("silent")
        code, doc = act(kernel_exe, env, "nonce-probe", name, "--timeout", "1",
                        "--poll-interval", "0.2")
        assert code == 1 and doc["outcome"] == "completion_timeout"
        assert 1.0 <= doc["elapsed_s"] < 2.0 and doc["extras"]["probe"] == "silent"
        assert f"Repeat {doc['extras']['nonce']}" in tmux.capture(name)
        assert [r["outcome"] for r in attempts()] == ["completion_timeout"]

    def test_skip_reason_is_skipped(self, kernel_exe: str, env: dict[str, str],
                                    tmux: Tmux) -> None:
        """--skip-reason records skipped_by_policy (exit 0) and types nothing."""
        name = tmux.agent("alive")
        before = tmux.capture(name)
        code, doc = act(kernel_exe, env, "compact", name, "--skip-reason", "quiet hours")
        assert code == 0 and doc["outcome"] == "skipped_by_policy"
        assert doc["extras"]["skip_reason"] == "quiet hours"
        assert tmux.capture(name) == before
        [row] = attempts("--outcome", "skipped_by_policy")
        assert row["extras"]["skip_reason"] == "quiet hours"

    def test_pane_vanishing_mid_send_is_send_error(self, kernel_exe: str, env: dict[str, str],
                                                   tmux: Tmux) -> None:
        """An agent that exits on the first key closes its pane: the next key fails, send_error."""
        name = tmux.agent("fragile")
        slow = {**env, "KERNEL_PANE_KEY_DELAY": "0.1"}
        code, doc = act(kernel_exe, slow, "nonce-probe", name)
        assert code == 1 and doc["outcome"] == "send_error"
        assert "can't find" in doc["extras"]["send_error"]
        assert doc["pane_after"] is None
        assert [r["outcome"] for r in attempts()] == ["send_error"]

    def test_unknown_and_dead_targets_exit_2(self, kernel_exe: str, env: dict[str, str],
                                             tmux: Tmux) -> None:
        """An unknown or dead target is one line on stderr, exit 2, and nothing recorded."""
        proc = kernel(kernel_exe, env, "actions", "run", "nonce-probe", "no-such-agent")
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and "unknown target 'no-such-agent'" in proc.stderr
        dead = tmux.start("cat", ready="", remain=True)
        tmux.cmd("send-keys", "-t", dead, "C-d")
        deadline = time.monotonic() + 5
        while tmux.cmd("display-message", "-p", "-t", dead,
                       "#{pane_dead}").stdout.strip() != "1":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        res = cli("actions", "run", "compact", dead, "--tmux-socket", tmux.socket)
        assert res.exit_code == 2 and res.stdout == ""
        assert f"dead target '{dead}'" in res.output and "Traceback" not in res.output
        assert attempts() == []

    def test_query_and_stats_over_several_outcomes(self, kernel_exe: str, env: dict[str, str],
                                                   tmux: Tmux) -> None:
        """query filters and lists newest first; stats counts action x outcome, with mean and p95.

        The four runs are separate processes writing the one database at once.
        """
        a1, a2, busy = tmux.agent("alive"), tmux.agent("alive"), tmux.agent("busy")
        runs = [("nonce-probe", a1, "--pane", "fleet"), ("nonce-probe", a2, "--pane", "fleet"),
                ("nonce-probe", busy), ("compact", busy, "--skip-reason", "later")]
        procs = [subprocess.Popen([kernel_exe, "actions", "run", *r, "--poll-interval", "0.1"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL, text=True) for r in runs]
        codes = [p.wait(timeout=30) for p in procs]
        assert codes == [0, 0, 1, 0], [p.communicate() for p in procs]
        rows = attempts()
        assert len(rows) == 4
        started = [r["started_at"] for r in rows]
        assert started == sorted(started, reverse=True)
        assert sorted(r["outcome"] for r in attempts("--pane", busy)) == \
            ["precondition_fail", "skipped_by_policy"]
        assert [r["agent"] for r in attempts("--outcome", "success")] == ["fleet", "fleet"]
        assert len(attempts("--limit", "1", "--since", "1h")) == 1
        res = cli("actions", "stats", "--json")
        assert res.exit_code == 0, res.output
        stats = {(s["action"], s["outcome"]): s for s in map(json.loads, res.stdout.splitlines())}
        assert {k: s["count"] for k, s in stats.items()} == {
            ("compact", "skipped_by_policy"): 1, ("nonce-probe", "precondition_fail"): 1,
            ("nonce-probe", "success"): 2}
        probe = stats[("nonce-probe", "success")]
        assert 0 < probe["mean_s"] <= probe["p95_s"]
        table = cli("actions", "stats", "--pane", "fleet").stdout.splitlines()
        assert table[0].split() == ["ACTION", "OUTCOME", "COUNT", "MEAN", "P95"]
        assert table[1].split()[:3] == ["nonce-probe", "success", "2"] and len(table) == 2
        listing = cli("actions", "query", "--pane", busy).stdout
        assert "skipped_by_policy" in listing and "later" in listing

    def test_sigterm_cancels_the_attempt(self, kernel_exe: str, env: dict[str, str],
                                         tmux: Tmux) -> None:
        """SIGTERM mid-attempt ends the run cancelled (exit 130) and records no outcome."""
        name = tmux.agent("silent")
        proc = subprocess.Popen([kernel_exe, "actions", "run", "nonce-probe", name, "--json",
                                 "--timeout", "20", "--poll-interval", "0.1"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while "Repeat " not in tmux.capture(name):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
        assert proc.returncode == 130, err
        doc = json.loads(out)
        assert doc["status"] == "cancelled" and doc["outcome"] is None
        assert "attempt cancelled (kept as an attempt_cancelled event)" in err
        assert attempts() == []

    def test_plain_output_is_one_line(self, tmux: Tmux) -> None:
        """Without --json, `actions run` prints one line: outcome, action, agent, time, why."""
        name = tmux.agent("busy")
        res = cli("actions", "run", "nonce-probe", name, "--tmux-socket", tmux.socket)
        assert res.exit_code == 1
        [line] = res.stdout.splitlines()
        assert line.startswith(f"precondition_fail: nonce-probe on {name} after ")
        assert "probe=busy" in line and "[run " in line


class TestPaneAgentCli:
    def test_kernel_run_agent_pane(self, kernel_exe: str, env: dict[str, str],
                                   tmux: Tmux) -> None:
        """`kernel run --agent pane` types the task into a real pane and returns the answer."""
        name = tmux.agent("alive")
        proc = kernel(kernel_exe, env, "run", "--json", "--agent", "pane", "--target", name,
                      "--prompt", "Repeat kiwi")
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["status"] == "ok" and doc["output"].splitlines()[0] == "kiwi"
        assert "Repeat kiwi" in tmux.capture(name)

    def test_unknown_target(self, kernel_exe: str, env: dict[str, str]) -> None:
        """A pane that does not exist ends the run error (1) naming it."""
        proc = kernel(kernel_exe, env, "run", "--agent", "pane", "--target", "no-such-pane",
                      "--prompt", "hi")
        assert proc.returncode == 1
        assert "pane no-such-pane is unknown" in proc.stderr
