"""Pane adapter review fixes: our own typing is never the answer, targets match
exactly, one run at a time in a pane, a stuck busy screen is no progress, and an
answer that cannot be delimited says so.

The tmux tests use a private server (the `tmux` fixture of test_pane_tmux.py) and
the real `kernel` CLI; the rest run in virtual time against the fake multiplexer.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from typing import Any

import pytest
import trio
from test_pane_tmux import FAST, Tmux, kernel, tmux  # noqa: F401  (tmux: the fixture)

from adapters.pane import PaneAgent
from adapters.pane._pane_agent import _after
from adapters.pane.testing import FakeMultiplexer, FakePane
from batteries.critic import CriticPolicy, WatchCritic
from kernel import Kernel, Limits, Ports, RunInfo, Status

needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


@pytest.fixture
def env(cli_env: dict[str, str], tmux: Tmux) -> dict[str, str]:  # noqa: F811
    """CLI environment: the test's audit database, our tmux server, fast typing."""
    return {**cli_env, **FAST, "KERNEL_TMUX_SOCKET": tmux.socket}


def run_json(exe: str, env: dict[str, str], *args: str) -> tuple[int, dict[str, Any], str]:
    proc = kernel(exe, env, "run", "--json", *args)
    return proc.returncode, json.loads(proc.stdout), proc.stderr


@needs_tmux
@pytest.mark.realtime
class TestRealPane:
    def test_silent_pane_is_not_answered_by_the_nudge(
            self, kernel_exe: str, env: dict[str, str], tmux: Tmux) -> None:  # noqa: F811
        """The critic's nudge, typed key by key into a pane that never answers, is not
        the answer: the run is killed, not `ok` with the nudge as its output."""
        name = tmux.agent("silent")
        code, doc, err = run_json(kernel_exe, env, "--agent", "pane", "--target", name,
                                  "--prompt", "do a long thing", "--idle-timeout", "2",
                                  "--timeout", "25")
        assert doc["status"] == "killed", (doc, err)
        # The critic sees the program blocked reading its terminal: waiting_input.
        assert doc["reason"] in ("stalled", "waiting_input")
        assert code == 137
        assert "No progress" in tmux.capture(name)  # the nudge was typed in

    def test_target_is_matched_exactly(self, kernel_exe: str, env: dict[str, str],
                                       tmux: Tmux) -> None:  # noqa: F811
        """A vanished session `X` next to a live `Xprod`: nothing is typed into Xprod,
        by `kernel run --agent pane` or by `kernel actions run`."""
        live = tmux.agent("alive")
        gone = live[:-2]  # a prefix of the live session's name, no session of its own
        code, doc, err = run_json(kernel_exe, env, "--agent", "pane", "--target", gone,
                                  "--prompt", "Repeat mango")
        assert code == 1 and doc["status"] == "error", (doc, err)
        assert f"pane {gone} is unknown" in doc["error"]
        probe = kernel(kernel_exe, env, "actions", "run", "nonce-probe", gone)
        assert probe.returncode == 2, probe.stderr
        screen = tmux.capture(live)
        assert "mango" not in screen and "Repeat" not in screen

    def test_one_run_at_a_time_in_a_pane(self, kernel_exe: str, env: dict[str, str],
                                         tmux: Tmux) -> None:  # noqa: F811
        """While one run's turn is on in a pane, a second run fails at once naming it (and
        types nothing), a pane action is a precondition failure; the first run ends ok."""
        name = tmux.agent("alive", "--delay", "4")
        first = subprocess.Popen([kernel_exe, "run", "--json", "--agent", "pane",
                                  "--target", name, "--prompt", "Repeat apple"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=env, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while "> Repeat apple" not in tmux.capture(name):  # its turn has begun
                assert time.monotonic() < deadline, tmux.capture(name)
                time.sleep(0.02)
            code, doc, err = run_json(kernel_exe, env, "--agent", "pane", "--target",
                                      f"{name}:0.0", "--prompt", "Repeat pear")
            assert code == 1 and doc["status"] == "error", (doc, err)
            assert "is in use by another kernel run" in doc["error"]
            probe = kernel(kernel_exe, env, "actions", "run", "nonce-probe", name, "--json")
            assert probe.returncode == 1, probe.stderr
            attempt = json.loads(probe.stdout)
            assert attempt["outcome"] == "precondition_fail"
            assert "in use by another kernel run" in attempt["extras"]["precheck_error"]
            out, err = first.communicate(timeout=60)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
        assert first.returncode == 0, err
        assert json.loads(out)["output"].splitlines()[0] == "apple"
        screen = tmux.capture(name)
        assert "pear" not in screen
        assert screen.count("Repeat") == 1


class _TimerPane(FakePane):
    """A pane busy with someone else's work until `free_at`; `timer` shows it moving."""

    def __init__(self, free_at: float, timer: bool) -> None:
        super().__init__(mode="alive", reply_after=1)
        self.free_at, self.timer = free_at, timer

    def render(self, now: float) -> str:
        text = super().render(now)
        if now < self.free_at:
            clock = f" · {int(now)}s" if self.timer else ""
            text += f"\n✻ Working… (esc to interrupt{clock})"
        return text


class TestBusyPane:
    async def test_stuck_busy_screen_is_killed_stalled(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A busy marker that never changes is no progress: the idle rule ends it."""
        mux = FakeMultiplexer({"dev": _TimerPane(free_at=1e9, timer=False)})
        critic = WatchCritic(CriticPolicy(idle_timeout=60))
        result = await Kernel(Ports(critic=critic)).run(
            PaneAgent("dev", "Repeat fig", mux), RunInfo(), Limits(timeout=3600))
        assert (result.status, result.reason) == (Status.KILLED, "stalled")
        assert "Repeat fig" not in [s.text for s in mux.sends]

    async def test_busy_screen_that_moves_is_waited_for(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A busy screen whose timer moves is someone working: the run waits its turn."""
        mux = FakeMultiplexer({"dev": _TimerPane(free_at=400, timer=True)})
        critic = WatchCritic(CriticPolicy(idle_timeout=60))
        result = await Kernel(Ports(critic=critic)).run(
            PaneAgent("dev", "Repeat fig", mux), RunInfo(), Limits(timeout=3600))
        assert result.status is Status.OK, (result.reason, result.error)
        assert result.output.splitlines()[0] == "fig"
        assert mux.sends[0].at >= 400


class TestAnswerDelimiting:
    def test_after_the_echoed_prompt(self) -> None:
        """The answer is what follows the line echoing the prompt, even when the answer
        repeats the prompt's words."""
        screen = "old: fix the bug\n> fix the bug\nok: fix the bug\n> "
        assert _after(screen, "fix the bug", "old: fix the bug\n> ") == (
            "ok: fix the bug\n>", True)

    def test_prompt_not_found_is_said_and_history_is_left_out(self) -> None:
        """No echo of the prompt on screen: only the lines that were not there before
        it was typed, and False says the answer could not be delimited."""
        before = "secret-history: previous session output\n> "
        screen = "secret-history: previous session output\nANSWER here\nback"
        assert _after(screen, "do a thing", before) == ("ANSWER here\nback", False)

    async def test_pane_done_says_when_not_delimited(
            self, autojump_clock: trio.abc.Clock) -> None:
        """The run's event and step say when the answer could not be delimited."""
        from kernel.testing import MemoryAudit

        class NoEcho(FakePane):
            def render(self, now: float) -> str:
                return "\n".join(line for line in super().render(now).splitlines()
                                 if not line.startswith("> Repeat"))

        mux = FakeMultiplexer({"dev": NoEcho(reply_after=2, banner=["old history"])})
        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit)).run(PaneAgent("dev", "Repeat kiwi", mux))
        assert result.status is Status.OK
        assert "old history" not in result.output and "kiwi" in result.output
        (done,) = [e for e in audit.events(result.run_id) if e.kind == "pane_done"]
        assert done.payload["delimited"] is False and "not found" in done.payload["note"]
