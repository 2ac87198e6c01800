"""Real TUI screens, recorded: Claude Code 2.1.330 and Codex 0.169.0 in tmux, offline.

The screens in `screens/` were captured (`tmux capture-pane -p`) from the real
clients running in tmux against the fake model servers of `tests/agentclis`, then
the temporary directory in them was replaced by /home/dev/project. They check that
the pane adapter reads the real screens: Claude's busy footer (`esc to interrupt`),
its tool approval dialog, and the idle input box of both clients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from adapters.pane import PaneAgent, TargetState, TargetStatus, is_approval_prompt, is_busy
from batteries.critic import CriticPolicy, WatchCritic
from kernel import Kernel, Limits, Ports, RunInfo, Status
from kernel.testing import MemoryAudit

SCREENS = Path(__file__).with_name("screens")


def screen(name: str) -> str:
    return (SCREENS / f"{name}.txt").read_text()


@pytest.mark.parametrize(("name", "busy", "approval"), [
    ("claude-idle", False, False),      # the input box, nothing running
    ("claude-busy", True, False),       # "Improvising… (1s · thinking)", "esc to interrupt"
    ("claude-approval", False, True),   # "Do you want to proceed?", then "1. Yes" ... "4. No"
    ("claude-after", False, False),     # the call refused, back at the input box
    ("codex-idle", False, False),       # "Ask Codex to do anything"
])
def test_recorded_screens(name: str, busy: bool, approval: bool) -> None:
    """Each recorded screen reads as what it was: busy, waiting for approval, or idle."""
    text = screen(name)
    assert (is_busy(text), is_approval_prompt(text)) == (busy, approval)


def test_approval_dialog_scrolled_up_is_not_waiting() -> None:
    """Only the tail counts: a dialog long answered and scrolled away is not a wait."""
    text = screen("claude-approval") + "\n".join(f"line {i}" for i in range(30))
    assert not is_approval_prompt(text)


@dataclass
class ReplayMux:
    """A multiplexer replaying recorded screens: `before` until the prompt is sent, then
    each of `after` for `hold` seconds, the last one for good."""

    before: str
    after: list[str]
    hold: float = 3.0
    sent_at: float | None = None
    sends: list[str] = field(default_factory=list)

    async def capture(self, target: str) -> str:
        await trio.lowlevel.checkpoint()
        if self.sent_at is None:
            return self.before
        i = int((trio.current_time() - self.sent_at) // self.hold)
        return self.after[min(i, len(self.after) - 1)]

    async def send_text(self, target: str, text: str, *, submit: bool = True) -> None:
        await trio.lowlevel.checkpoint()
        self.sends.append(text)
        if self.sent_at is None:
            self.sent_at = trio.current_time()

    async def target_status(self, target: str) -> TargetStatus:
        await trio.lowlevel.checkpoint()
        return TargetStatus(TargetState.ALIVE)


async def test_pane_waiting_on_the_real_approval_dialog(autojump_clock: trio.abc.Clock) -> None:
    """Busy, then the approval dialog for good: not done, not stalled, `awaiting_approval`."""
    busy = screen("claude-busy")
    mux = ReplayMux(screen("claude-idle"),
                    [busy, busy.replace("(1s", "(4s"), screen("claude-approval")])
    audit = MemoryAudit()
    critic = WatchCritic(CriticPolicy(idle_timeout=30, grace=5))
    result = await Kernel(Ports(audit=audit, critic=critic)).run(
        PaneAgent("dev", "Make a file please", mux, approval_ttl=120), RunInfo(),
        Limits(timeout=3600))
    assert (result.status, result.reason) == (Status.KILLED, "awaiting_approval")
    assert "waited 120.0s on an approval dialog (approval TTL 120s)" in (result.error or "")
    assert mux.sends == ["Make a file please"]  # no stall nudge was typed into the dialog
    (wait,) = [e for e in audit.events(result.run_id) if e.kind == "pane_approval"]
    assert wait.payload["state"] == "waiting_for_approval"
    assert "Do you want to proceed?" in wait.payload["screen"]


async def test_pane_busy_then_done_on_the_real_screens(autojump_clock: trio.abc.Clock) -> None:
    """Busy (esc to interrupt) is waited out; the settled screen after it is the answer."""
    mux = ReplayMux(screen("claude-idle"), [screen("claude-busy"), screen("claude-after")])
    result = await Kernel().run(PaneAgent("dev", "Make a file please", mux), RunInfo(),
                                Limits(timeout=600))
    assert result.status is Status.OK, result.error
    assert "Interrupted" in str(result.output)
