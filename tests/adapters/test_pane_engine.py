"""The pane-action engine, the actions and the audited kernel run, on a fake multiplexer.

Virtual time throughout (`autojump_clock`): a 30-second completion timeout
takes microseconds, and elapsed times are exact.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from adapters.pane import (
    ActionAgent,
    ActionContext,
    Compact,
    MultiplexerError,
    NonceProbe,
    Outcome,
    PaneAction,
    cap_snapshot,
    make_action,
    run_action,
    run_attempt,
    snapshot_chars,
)
from adapters.pane.testing import FakeMultiplexer, FakePane
from kernel import ConfigError, Kernel, Ports, Status
from kernel.testing import MemoryAudit, ScriptedCritic

ATTEMPT_KEYS = {"agent", "action", "outcome", "elapsed_s", "started_at", "pane_before",
                "pane_after", "extras"}


def ctx_for(mux: FakeMultiplexer, target: str = "dev") -> ActionContext:
    return ActionContext(target, target, mux)


class Counting(PaneAction):
    """A scripted action that counts its calls; completes when the pane shows `done`."""

    name = "counting"

    def __init__(self, *, allow: bool = True, send_raises: Exception | None = None,
                 precheck_raises: Exception | None = None) -> None:
        self.allow = allow
        self.send_raises = send_raises
        self.precheck_raises = precheck_raises
        self.calls: dict[str, int] = {"snapshot": 0, "precheck": 0, "before_send": 0,
                                      "send": 0, "is_complete": 0}

    async def snapshot(self, ctx: ActionContext) -> dict[str, Any]:
        self.calls["snapshot"] += 1
        return {"text": await ctx.capture()}

    def precheck(self, before: dict[str, Any]) -> bool:
        self.calls["precheck"] += 1
        if self.precheck_raises is not None:
            raise self.precheck_raises
        return self.allow

    async def before_send(self, ctx: ActionContext) -> None:
        self.calls["before_send"] += 1

    async def send(self, ctx: ActionContext) -> None:
        self.calls["send"] += 1
        if self.send_raises is not None:
            raise self.send_raises
        await ctx.type("Repeat done")

    def is_complete(self, before: dict[str, Any], now: dict[str, Any]) -> bool:
        self.calls["is_complete"] += 1
        return bool(now["text"].count("done") >= 2)


class TestOutcomes:
    async def test_success(self, autojump_clock: trio.abc.Clock) -> None:
        """An echo after 3 s with 1 s polls is `success` at 3 s, with send called once."""
        mux = FakeMultiplexer({"dev": FakePane(reply_after=3)})
        action = Counting()
        attempt = await run_attempt(action, ctx_for(mux), timeout=10, poll_interval=1)
        assert attempt.outcome is Outcome.SUCCESS
        assert attempt.elapsed_s == pytest.approx(3.0)
        assert action.calls["send"] == 1 and len(mux.sends) == 1
        assert attempt.pane_after is not None and "done" in attempt.pane_after["text"]
        assert attempt.extras["polls"] == 4  # at 0, 1, 2 and 3 s

    async def test_completion_timeout(self, autojump_clock: trio.abc.Clock) -> None:
        """A pane that never answers is `completion_timeout` exactly at the deadline, sent once."""
        mux = FakeMultiplexer({"dev": FakePane(mode="silent")})
        action = Counting()
        attempt = await run_attempt(action, ctx_for(mux), timeout=7, poll_interval=2)
        assert attempt.outcome is Outcome.COMPLETION_TIMEOUT
        assert attempt.elapsed_s == pytest.approx(7.0)
        assert action.calls["send"] == 1 and len(mux.sends) == 1
        # Polls at 0, 2, 4, 6 and a last one at the deadline itself.
        assert action.calls["is_complete"] == 5
        assert attempt.pane_after is not None

    async def test_precondition_fail_sends_nothing(self, autojump_clock: trio.abc.Clock) -> None:
        """A failing precheck is `precondition_fail`, with no keys sent and no polling."""
        mux = FakeMultiplexer({"dev": FakePane()})
        action = Counting(allow=False)
        attempt = await run_attempt(action, ctx_for(mux), timeout=10, poll_interval=1)
        assert attempt.outcome is Outcome.PRECONDITION_FAIL
        assert mux.sends == [] and action.calls["send"] == 0 and action.calls["before_send"] == 0
        assert mux.captures == 1 and attempt.pane_after is None
        assert attempt.pane_before is not None and attempt.elapsed_s == 0

    async def test_precheck_raising_is_precondition_fail(self,
                                                         autojump_clock: trio.abc.Clock) -> None:
        """A precheck that raises counts as refusing, with the error in the extras."""
        mux = FakeMultiplexer({"dev": FakePane()})
        attempt = await run_attempt(Counting(precheck_raises=KeyError("text")), ctx_for(mux))
        assert attempt.outcome is Outcome.PRECONDITION_FAIL and mux.sends == []
        assert attempt.extras["precheck_error"] == "KeyError: 'text'"

    async def test_skip_wins_over_failing_precheck(self, autojump_clock: trio.abc.Clock) -> None:
        """A skip reason gives `skipped_by_policy` even when the precheck would refuse."""
        mux = FakeMultiplexer({"dev": FakePane()})
        action = Counting(allow=False)
        attempt = await run_attempt(action, ctx_for(mux), skip_reason="quiet hours")
        assert attempt.outcome is Outcome.SKIPPED_BY_POLICY
        assert attempt.extras["skip_reason"] == "quiet hours"
        assert action.calls["precheck"] == 0 and mux.sends == []
        assert attempt.pane_before is not None and attempt.pane_after is None

    async def test_send_raising_is_send_error_without_polling(
            self, autojump_clock: trio.abc.Clock) -> None:
        """`send` raising is `send_error`, its error in the extras, and the pane is not polled."""
        mux = FakeMultiplexer({"dev": FakePane()})
        action = Counting(send_raises=MultiplexerError("tmux send-keys failed: no pane"))
        attempt = await run_attempt(action, ctx_for(mux), timeout=10, poll_interval=1)
        assert attempt.outcome is Outcome.SEND_ERROR
        assert attempt.extras["send_error"] == \
            "MultiplexerError: tmux send-keys failed: no pane"
        assert action.calls["send"] == 1 and action.calls["is_complete"] == 0
        assert mux.captures == 1 and attempt.pane_after is None

    async def test_mux_send_failure_is_send_error(self, autojump_clock: trio.abc.Clock) -> None:
        """A multiplexer refusing the keys surfaces as `send_error` after exactly one send."""
        mux = FakeMultiplexer({"dev": FakePane()}, send_error=MultiplexerError("pane gone"))
        attempt = await run_attempt(NonceProbe(), ctx_for(mux), timeout=10)
        assert attempt.outcome is Outcome.SEND_ERROR and len(mux.sends) == 1
        assert "pane gone" in attempt.extras["send_error"]

    async def test_failing_pre_snapshot_is_send_error(self, autojump_clock: trio.abc.Clock) -> None:
        """When the pane cannot be read first, the outcome is `send_error` and nothing is sent."""
        mux = FakeMultiplexer({"dev": FakePane()},
                              capture_error=MultiplexerError("no server running"))
        action = Counting()
        attempt = await run_attempt(action, ctx_for(mux), skip_reason="even with a skip")
        assert attempt.outcome is Outcome.SEND_ERROR
        assert attempt.pane_before is None and attempt.pane_after is None
        assert "no server running" in attempt.extras["snapshot_error"]
        assert action.calls["precheck"] == 0 and mux.sends == []

    async def test_failing_poll_snapshot_is_tolerated(self, autojump_clock: trio.abc.Clock) -> None:
        """A pane unreadable for one poll is polled again; the failure is counted in the extras."""
        mux = FakeMultiplexer({"dev": FakePane(reply_after=0.5)}, fail_captures={1})
        attempt = await run_attempt(Counting(), ctx_for(mux), timeout=10, poll_interval=1)
        assert attempt.outcome is Outcome.SUCCESS and attempt.elapsed_s == pytest.approx(1.0)
        assert attempt.extras["poll_errors"] == 1

    async def test_zero_timeout_polls_once(self, autojump_clock: trio.abc.Clock) -> None:
        """With timeout 0 the engine still sends once and looks once before timing out."""
        mux = FakeMultiplexer({"dev": FakePane(reply_after=1)})
        action = Counting()
        attempt = await run_attempt(action, ctx_for(mux), timeout=0, poll_interval=1)
        assert attempt.outcome is Outcome.COMPLETION_TIMEOUT and attempt.elapsed_s == 0
        assert action.calls == {"snapshot": 2, "precheck": 1, "before_send": 1, "send": 1,
                                "is_complete": 1}

    async def test_typing_time_counts_against_the_timeout(
            self, autojump_clock: trio.abc.Clock) -> None:
        """The deadline is measured from the attempt's start, so slow typing eats into it."""
        mux = FakeMultiplexer({"dev": FakePane(mode="silent")}, type_seconds=4)
        attempt = await run_attempt(Counting(), ctx_for(mux), timeout=5, poll_interval=2)
        assert attempt.outcome is Outcome.COMPLETION_TIMEOUT
        assert attempt.elapsed_s == pytest.approx(5.0)

    async def test_bad_timing_is_config_error(self) -> None:
        """A negative timeout or a zero poll interval is refused before anything happens."""
        mux = FakeMultiplexer({"dev": FakePane()})
        with pytest.raises(ConfigError, match="timeout"):
            await run_attempt(Counting(), ctx_for(mux), timeout=-1)
        with pytest.raises(ConfigError, match="poll_interval"):
            await run_attempt(Counting(), ctx_for(mux), poll_interval=0)
        assert mux.captures == 0


class TestNonceProbe:
    async def test_echo_is_success(self, autojump_clock: trio.abc.Clock) -> None:
        """The probe types "Repeat <nonce>" once and succeeds when the nonce comes back."""
        mux = FakeMultiplexer({"dev": FakePane(reply_after=2.5)})
        attempt = await run_attempt(NonceProbe(), ctx_for(mux), timeout=30, poll_interval=1)
        nonce = attempt.extras["nonce"]
        assert [s.text for s in mux.sends] == [f"Repeat {nonce}"] and mux.sends[0].submit
        assert attempt.outcome is Outcome.SUCCESS and attempt.extras["probe"] == "alive"
        assert attempt.elapsed_s == pytest.approx(3.0)

    async def test_busy_pane_is_precondition_fail(self, autojump_clock: trio.abc.Clock) -> None:
        """A pane showing "esc to interrupt" is not probed, and is classified busy."""
        mux = FakeMultiplexer({"dev": FakePane(mode="busy")})
        attempt = await run_attempt(NonceProbe(), ctx_for(mux))
        assert attempt.outcome is Outcome.PRECONDITION_FAIL and mux.sends == []
        assert attempt.extras["probe"] == "busy"

    async def test_silent_pane_times_out(self, autojump_clock: trio.abc.Clock) -> None:
        """A pane that takes the request but never echoes is a timeout, classified silent."""
        mux = FakeMultiplexer({"dev": FakePane(mode="silent")})
        attempt = await run_attempt(NonceProbe(), ctx_for(mux), timeout=5, poll_interval=1)
        assert attempt.outcome is Outcome.COMPLETION_TIMEOUT
        assert attempt.extras["probe"] == "silent" and len(mux.sends) == 1
        # The typed request is visible once; that is not an echo.
        assert attempt.pane_after is not None
        assert attempt.pane_after["text"].count(attempt.extras["nonce"]) == 1


class TestCompact:
    async def test_drop_is_success(self, autojump_clock: trio.abc.Clock) -> None:
        """80% -> 10% after /compact is a success with the figures in the extras."""
        mux = FakeMultiplexer({"dev": FakePane(context_pct=80, compact_to=10, compact_after=4)})
        attempt = await run_attempt(Compact(), ctx_for(mux), timeout=30, poll_interval=1)
        assert [s.text for s in mux.sends] == ["/compact"]
        assert attempt.outcome is Outcome.SUCCESS and attempt.elapsed_s == pytest.approx(4.0)
        assert attempt.extras["context_pct_before"] == 80
        assert attempt.extras["context_pct_after"] == 10
        assert attempt.extras["drop_pct"] == 70

    async def test_drop_equal_to_minimum_counts(self, autojump_clock: trio.abc.Clock) -> None:
        """A drop of exactly min_drop_pct is a success (the threshold is inclusive)."""
        mux = FakeMultiplexer({"dev": FakePane(context_pct=80, compact_to=60)})
        attempt = await run_attempt(Compact(min_drop_pct=20), ctx_for(mux), timeout=10)
        assert attempt.outcome is Outcome.SUCCESS

    async def test_drop_below_minimum_times_out(self, autojump_clock: trio.abc.Clock) -> None:
        """A drop one point short of min_drop_pct never completes."""
        mux = FakeMultiplexer({"dev": FakePane(context_pct=80, compact_to=61)})
        attempt = await run_attempt(Compact(min_drop_pct=20), ctx_for(mux), timeout=10)
        assert attempt.outcome is Outcome.COMPLETION_TIMEOUT
        assert attempt.extras["drop_pct"] == 19

    async def test_no_percentage_is_precondition_fail(self,
                                                      autojump_clock: trio.abc.Clock) -> None:
        """A pane that shows no context percentage cannot be judged, so nothing is sent."""
        mux = FakeMultiplexer({"dev": FakePane(context_pct=None)})
        attempt = await run_attempt(Compact(), ctx_for(mux))
        assert attempt.outcome is Outcome.PRECONDITION_FAIL and mux.sends == []
        assert attempt.extras["reason"] == "the pane shows no context percentage"

    async def test_min_drop_is_validated(self) -> None:
        """min_drop_pct must be in (0, 100]."""
        for bad in (0, -5, 100.5, float("nan")):
            with pytest.raises(ConfigError, match="min_drop_pct"):
                Compact(min_drop_pct=bad)
        assert Compact(min_drop_pct=100).min_drop_pct == 100

    async def test_make_action(self) -> None:
        """Actions are built by name; an unknown name lists the known ones."""
        assert isinstance(make_action("nonce-probe"), NonceProbe)
        compact = make_action("compact", min_drop_pct=35)
        assert isinstance(compact, Compact) and compact.min_drop_pct == 35
        with pytest.raises(ConfigError, match="compact, nonce-probe"):
            make_action("reboot")


class TestSnapshots:
    def test_cap_keeps_the_tail(self) -> None:
        """A long snapshot text keeps its last characters and says it was truncated."""
        capped = cap_snapshot({"text": "a" * 10 + "TAIL", "context_pct": 5}, 6)
        assert capped == {"text": "aaTAIL", "context_pct": 5, "truncated": True}
        assert cap_snapshot({"text": "short"}, 6) == {"text": "short"}
        assert cap_snapshot(None, 6) is None

    def test_cap_from_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """KERNEL_PANE_SNAPSHOT_CHARS sets the cap; junk is a one-line ConfigError."""
        monkeypatch.delenv("KERNEL_PANE_SNAPSHOT_CHARS", raising=False)
        assert snapshot_chars() == 4000
        monkeypatch.setenv("KERNEL_PANE_SNAPSHOT_CHARS", "120")
        assert snapshot_chars() == 120
        for bad in ("0", "-3", "lots"):
            monkeypatch.setenv("KERNEL_PANE_SNAPSHOT_CHARS", bad)
            with pytest.raises(ConfigError, match="KERNEL_PANE_SNAPSHOT_CHARS"):
                snapshot_chars()


class TestAuditedRun:
    async def test_one_attempt_event_per_run(self, autojump_clock: trio.abc.Clock) -> None:
        """A successful attempt is an ok run with exactly one `attempt` event holding the record."""
        audit = MemoryAudit()
        mux = FakeMultiplexer({"dev": FakePane(reply_after=2)})
        result, attempt = await run_action(Kernel(Ports(audit=audit)), NonceProbe(), mux, "dev",
                                           agent="claude-1", timeout=30, poll_interval=1)
        assert attempt is not None and result.status is Status.OK
        assert result.output == "success" and result.name == "nonce-probe dev"
        assert audit.runs[result.run_id].info.subject_id == "claude-1"
        [event] = [e for e in audit.events(result.run_id) if e.kind == "attempt"]
        assert event.name == "nonce-probe" and event.duration_ms == pytest.approx(2000)
        assert set(event.payload) == ATTEMPT_KEYS
        assert event.payload["agent"] == "claude-1" and event.payload["outcome"] == "success"
        assert event.payload["elapsed_s"] == pytest.approx(2.0)
        assert event.payload["started_at"].endswith("+00:00")
        assert event.payload["extras"]["target"] == "dev"

    @pytest.mark.parametrize(("pane", "skip", "outcome", "status"), [
        (FakePane(mode="busy"), None, "precondition_fail", Status.ERROR),
        (FakePane(mode="silent"), None, "completion_timeout", Status.ERROR),
        (FakePane(mode="dead"), None, "send_error", Status.ERROR),
        (FakePane(mode="busy"), "maintenance", "skipped_by_policy", Status.OK),
    ])
    async def test_outcome_maps_to_status(self, autojump_clock: trio.abc.Clock, pane: FakePane,
                                          skip: str | None, outcome: str,
                                          status: Status) -> None:
        """Each outcome ends the run ok (success, skipped) or error (the rest), one event each."""
        audit = MemoryAudit()
        mux = FakeMultiplexer({"dev": pane})
        result, attempt = await run_action(Kernel(Ports(audit=audit)), NonceProbe(), mux, "dev",
                                           timeout=5, poll_interval=1, skip_reason=skip)
        assert attempt is not None and attempt.outcome == outcome
        assert result.status is status and result.output == outcome
        if status is Status.ERROR:
            assert result.error is not None and result.error.startswith(outcome)
        events = [e for e in audit.events(result.run_id) if e.kind == "attempt"]
        assert [e.payload["outcome"] for e in events] == [outcome]
        assert len(mux.sends) == (1 if outcome in ("completion_timeout", "send_error") else 0)

    async def test_snapshot_cap_applies_to_the_record(self, autojump_clock: trio.abc.Clock,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
        """The audited snapshots are cut to KERNEL_PANE_SNAPSHOT_CHARS, keeping the tail."""
        monkeypatch.setenv("KERNEL_PANE_SNAPSHOT_CHARS", "50")
        audit = MemoryAudit()
        mux = FakeMultiplexer({"dev": FakePane(banner=["x" * 500])})
        result, attempt = await run_action(Kernel(Ports(audit=audit)), NonceProbe(), mux, "dev",
                                           timeout=5, poll_interval=1)
        [event] = [e for e in audit.events(result.run_id) if e.kind == "attempt"]
        before = event.payload["pane_before"]
        assert before["truncated"] is True and len(before["text"]) == 50
        assert before["text"].endswith("> ")  # the prompt line, at the bottom, is kept
        assert attempt is not None and len(attempt.pane_before["text"]) > 500  # type: ignore[index]

    async def test_steer_is_typed_into_the_pane(self, autojump_clock: trio.abc.Clock) -> None:
        """A critic nudge during an attempt is typed into the pane and noted in the extras."""
        audit = MemoryAudit()
        critic = ScriptedCritic(steer_after={2.0: "please answer the probe"})
        mux = FakeMultiplexer({"dev": FakePane(mode="silent")}, type_seconds=0.5)
        agent = ActionAgent(NonceProbe(), mux, "dev", timeout=6, poll_interval=1)
        result = await Kernel(Ports(audit=audit, critic=critic)).run(
            agent, agent.run_info(), agent.limits())
        assert result.status is Status.ERROR and agent.attempt is not None
        texts = [s.text for s in mux.sends]
        assert texts[1:] == ["please answer the probe"] and texts[0].startswith("Repeat ")
        assert agent.attempt.extras["steered"] == ["please answer the probe"]
        assert "steer" in audit.kinds(result.run_id)

    async def test_steer_waits_for_the_actions_typing(self,
                                                      autojump_clock: trio.abc.Clock) -> None:
        """A nudge that arrives while the action is typing is typed after it, not inside it."""
        critic = ScriptedCritic(steer_after={0.5: "nudge"})
        mux = FakeMultiplexer({"dev": FakePane(mode="silent")}, type_seconds=3)
        agent = ActionAgent(NonceProbe(), mux, "dev", timeout=10, poll_interval=1)
        await Kernel(Ports(critic=critic)).run(agent, agent.run_info(), agent.limits())
        first, second = mux.sends
        assert first.text.startswith("Repeat ") and second.text == "nudge"
        assert second.at >= first.at + 3
