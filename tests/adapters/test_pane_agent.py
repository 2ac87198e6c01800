"""PaneAgent: a task typed into a pane, the answer read back (virtual time, fake panes)."""

from __future__ import annotations

import trio

from adapters.pane import PaneAgent
from adapters.pane.testing import FakeMultiplexer, FakePane
from kernel import Kernel, Limits, Ports, RunInfo, Status
from kernel.testing import MemoryAudit, ScriptedCritic


class TestPaneAgent:
    async def test_answer_is_the_output(self, autojump_clock: trio.abc.Clock) -> None:
        """The prompt is typed once; the text after it, once the pane settles, is the output."""
        mux = FakeMultiplexer({"dev": FakePane(reply_after=3)})
        audit = MemoryAudit()
        start = trio.current_time()
        result = await Kernel(Ports(audit=audit)).run(
            PaneAgent("dev", "Repeat banana", mux, settle=2), RunInfo(), Limits())
        assert result.status is Status.OK
        assert result.output.splitlines()[0] == "banana"
        assert [s.text for s in mux.sends] == ["Repeat banana"]
        assert 5 <= trio.current_time() - start <= 6  # reply at 3 s + settle 2 s (+ a poll)
        kinds = audit.kinds(result.run_id)
        assert "pane_send" in kinds and "pane_done" in kinds

    async def test_an_answer_already_there_after_enter_is_the_answer(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A program that answers before the first look after Enter (a REPL, a quick
        tool): its answer is in that very screen, the baseline of the wait. It was
        never taken for an answer, and the run was killed `waiting_input`."""
        from batteries.critic import CriticPolicy, WatchCritic

        mux = FakeMultiplexer({"dev": FakePane(reply_after=0)})
        result = await Kernel(Ports(critic=WatchCritic(CriticPolicy(idle_timeout=60)))).run(
            PaneAgent("dev", "Repeat banana", mux, settle=2), RunInfo(), Limits(timeout=600))
        assert result.status is Status.OK, result.reason
        assert result.output.splitlines()[0] == "banana"

    async def test_silent_pane_is_nudged_then_killed(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A pane that never answers goes quiet: the critic's nudge is typed in, then a kill."""
        from batteries.critic import CriticPolicy, WatchCritic

        mux = FakeMultiplexer({"dev": FakePane(mode="silent")})
        critic = WatchCritic(CriticPolicy(idle_timeout=60))
        result = await Kernel(Ports(critic=critic)).run(
            PaneAgent("dev", "fix the bug", mux), RunInfo(), Limits(timeout=3600))
        assert result.status is Status.KILLED and result.reason == "stalled"
        typed = [s.text for s in mux.sends]
        assert typed[0] == "fix the bug" and len(typed) == 2  # the prompt, then the nudge

    async def test_busy_pane_waits_its_turn(self, autojump_clock: trio.abc.Clock) -> None:
        """A busy pane is not typed into; the run waits (and the critic sees it waiting)."""
        mux = FakeMultiplexer({"dev": FakePane(mode="busy")})
        critic = ScriptedCritic()
        with trio.move_on_after(30):
            await Kernel(Ports(critic=critic)).run(PaneAgent("dev", "hi", mux), RunInfo(),
                                                   Limits())
        assert mux.sends == []
        assert "pane_busy" in critic.handles[0].activities

    async def test_dead_or_unknown_pane_is_an_error(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A pane whose program exited, or no such pane, ends `error` naming it."""
        mux = FakeMultiplexer({"dev": FakePane(mode="dead")})
        dead = await Kernel().run(PaneAgent("dev", "hi", mux))
        assert dead.status is Status.ERROR and "pane dev is dead" in (dead.error or "")
        missing = await Kernel().run(PaneAgent("nope", "hi", mux))
        assert missing.status is Status.ERROR and "pane nope is unknown" in (missing.error or "")

    async def test_dry_run_types_nothing(self, autojump_clock: trio.abc.Clock) -> None:
        """A dry run says what would be typed, and types nothing."""
        mux = FakeMultiplexer({"dev": FakePane()})
        result = await Kernel().run(PaneAgent("dev", "hi", mux), RunInfo(),
                                    Limits(dry_run=True))
        assert result.status is Status.DRY_RUN and result.output == "would type into pane dev: hi"
        assert mux.sends == []
