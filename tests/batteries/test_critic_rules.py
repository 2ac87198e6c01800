"""The critic's parts on their own: call keys, loop finding, the rules as a pure function,
the policy's validation, the handle's bookkeeping, and the public surface."""

from __future__ import annotations

from typing import Any

import pytest
import trio

import batteries.critic
from batteries.critic import (
    LOOPING,
    STALLED,
    CriticPolicy,
    Decision,
    Intervention,
    RulesJudge,
    RunView,
    WatchCritic,
    Window,
    call_key,
    find_loop,
)
from kernel import ConfigError, Message, RunInfo, Step, ToolCall


def view(**overrides: Any) -> RunView:
    """A RunView of a quiet moment, with `overrides` applied."""
    fields: dict[str, Any] = dict(
        info=RunInfo(name="t"), trigger="poll", elapsed=0.0, steps=0, tool_calls=0,
        activity=0, idle=0.0, soft_timeout=600.0, deadline=600.0, backstop=None, due=False,
        extensions=0, max_steps=100, window=Window(0.0, 0.0))
    fields.update(overrides)
    return RunView(**fields)


class Sink:
    """An EventSink that keeps (kind, name, payload) triples."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str | None, dict[str, Any]]] = []

    def __call__(self, kind: str, *, name: str | None = None,
                 payload: Any = None) -> None:
        self.events.append((kind, name, dict(payload or {})))

    @property
    def names(self) -> list[str | None]:
        return [n for _, n, _ in self.events]


class TestCallKey:
    def test_argument_order_does_not_matter(self) -> None:
        """Calls with equal arguments given in a different order have the same key."""
        a = ToolCall("search", {"q": "x", "page": 1})
        b = ToolCall("search", {"page": 1, "q": "x"}, id="other-id")
        assert call_key(a) == call_key(b) == 'search({"page":1,"q":"x"})'

    def test_different_arguments_differ(self) -> None:
        """A different argument value or tool name gives a different key."""
        keys = {call_key(ToolCall("search", {"q": "x"})), call_key(ToolCall("search", {"q": "y"})),
                call_key(ToolCall("find", {"q": "x"}))}
        assert len(keys) == 3

    def test_unserialisable_arguments_still_have_a_key(self) -> None:
        """Arguments JSON cannot sort (mixed key types) still give a stable key, not an error."""
        call = ToolCall("odd", {1: "a", "b": object})  # type: ignore[dict-item]
        assert call_key(call) == call_key(call) and call_key(call).startswith("odd(")


class TestFindLoop:
    @pytest.mark.parametrize(("calls", "expected"), [
        ("AAA", (1, 3)),
        ("BAAAA", (1, 4)),
        ("ABAB", (2, 2)),
        ("CABABAB", (2, 3)),
        ("ABCABC", (3, 2)),
        ("AAB", None),
        ("ABA", None),
        ("ABCAB", None),
        ("", None),
    ])
    def test_loops_ending_at_the_newest_call(self, calls: str,
                                             expected: tuple[int, int] | None) -> None:
        """Repeats and short cycles are found only when they end at the newest call."""
        assert find_loop(list(calls), repeats=3, max_cycle=3, cycle_repeats=2) == expected

    def test_a_repeated_call_is_never_mistaken_for_a_cycle(self) -> None:
        """A-A-A-A below `repeats` is not reported as the 2-cycle (A-A)(A-A)."""
        assert find_loop(list("AAAA"), repeats=5, max_cycle=3, cycle_repeats=2) is None

    def test_max_cycle_one_checks_only_repeats(self) -> None:
        """With max_cycle=1, A-B-A-B is not a loop."""
        assert find_loop(list("ABABAB"), repeats=3, max_cycle=1, cycle_repeats=2) is None


class TestRulesJudge:
    def test_nothing_to_say_on_a_quiet_healthy_moment(self) -> None:
        """Before any threshold, the rules answer None (no judgment, no event)."""
        assert RulesJudge().judge(view(idle=10, elapsed=10)) is None

    def test_due_with_progress_extends_by_the_soft_timeout(self) -> None:
        """A due deadline with steps in the window extends by the soft timeout, bonus = steps."""
        v = view(due=True, elapsed=600, window=Window(0, 600, steps=30))
        verdict = RulesJudge().judge(v)
        assert verdict is not None and verdict.action == "extend"
        assert (verdict.extend_by, verdict.step_bonus) == (600.0, 30)

    def test_extend_by_and_step_bonus_are_parameters(self) -> None:
        """`extend_by` and `step_bonus` override the defaults."""
        judge = RulesJudge(CriticPolicy(extend_by=120, step_bonus=7))
        verdict = judge.judge(view(due=True, window=Window(0, 600, activity=1)))
        assert verdict is not None
        assert (verdict.extend_by, verdict.step_bonus) == (120, 7)

    def test_due_without_progress_expires_without_stall_detection(self) -> None:
        """With stall detection off, a due deadline after an empty window lets the run time out."""
        judge = RulesJudge(CriticPolicy(idle_timeout=None))
        verdict = judge.judge(view(due=True, window=Window(0, 600)))
        assert verdict is not None and (verdict.action, verdict.reason) == ("expire",
                                                                              "no_progress")

    def test_due_without_progress_is_left_to_the_stall_rule(self) -> None:
        """With stall detection on, an empty window is extended as `quiet`, with no step bonus."""
        judge = RulesJudge(CriticPolicy(soft_timeout=10, idle_timeout=60))
        verdict = judge.judge(view(due=True, idle=10, window=Window(0, 10), soft_timeout=10))
        assert verdict is not None
        assert (verdict.action, verdict.reason, verdict.step_bonus) == ("extend", "quiet", 0)

    def test_stall_is_nudged_then_killed_only_after_the_grace(self) -> None:
        """idle_timeout of silence nudges; the kill waits until idle_timeout + grace."""
        judge = RulesJudge(CriticPolicy(idle_timeout=100, grace=20))
        nudge = judge.judge(view(idle=100))
        assert nudge is not None and (nudge.action, nudge.reason) == ("steer", STALLED)
        open_ = Intervention(STALLED, at=100)
        assert judge.judge(view(idle=119.9, intervention=open_)) is None
        kill = judge.judge(view(idle=120, intervention=open_))
        assert kill is not None and (kill.action, kill.reason) == ("kill", STALLED)

    def test_activity_after_a_stall_nudge_is_a_recovery(self) -> None:
        """Any activity after the stall nudge closes it with `continue`."""
        open_ = Intervention(STALLED, at=100, activity_since=1)
        verdict = RulesJudge().judge(view(idle=0, intervention=open_))
        assert verdict is not None and verdict.action == "continue"

    def test_loops_are_checked_only_at_a_tool_start(self) -> None:
        """A loop in the history is judged when a call starts, not at every poll."""
        looping = ("A", "A", "A")
        assert RulesJudge().judge(view(calls=looping)) is None
        verdict = RulesJudge().judge(view(calls=looping, trigger="tool_start"))
        assert verdict is not None and (verdict.action, verdict.reason) == ("steer", LOOPING)

    def test_the_default_grace_is_a_capped_fraction_of_idle_timeout(self) -> None:
        """grace=None gives idle_timeout / 4, at most 60 s."""
        assert CriticPolicy(idle_timeout=2).effective_grace == 0.5
        assert CriticPolicy(idle_timeout=3600).effective_grace == 60


class TestPolicy:
    @pytest.mark.parametrize(("kwargs", "message"), [
        ({"idle_timeout": -1}, "CriticPolicy.idle_timeout must be > 0 or None, got -1"),
        ({"soft_timeout": 0}, "CriticPolicy.soft_timeout must be > 0 or None, got 0"),
        ({"grace": float("nan")}, "CriticPolicy.grace must be >= 0 or None, got nan"),
        ({"loop_repeats": 1}, "CriticPolicy.loop_repeats must be an integer >= 2, got 1"),
        ({"step_bonus": -2}, "CriticPolicy.step_bonus must be an integer >= 0 or None, got -2"),
    ])
    def test_bad_thresholds_are_one_line_config_errors(self, kwargs: dict[str, Any],
                                                       message: str) -> None:
        """A bad threshold raises ConfigError naming the field and the value."""
        with pytest.raises(ConfigError) as info:
            CriticPolicy(**kwargs)
        assert str(info.value) == message

    def test_as_dict_resolves_the_grace(self) -> None:
        """The audited thresholds show the grace actually used."""
        assert CriticPolicy(idle_timeout=8).as_dict()["grace"] == 2


class TestHandle:
    async def test_deadline_is_never_past_the_backstop(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A soft timeout beyond the backstop starts at the backstop, and nothing is judged
        there (the backstop is in charge)."""
        sink = Sink()
        start = trio.current_time()
        handle = WatchCritic().monitor(RunInfo(), 600, backstop=start + 100, max_steps=10,
                                       events=sink)
        assert handle.deadline() == start + 100
        await trio.sleep(100)
        handle.record_step(0, Step())
        assert handle.deadline() == start + 100
        assert sink.names == ["watch"]

    async def test_step_ended_says_when_there_is_nothing_for_the_kernel(
            self, autojump_clock: trio.abc.Clock) -> None:
        """`step_ended` is True for plain steps; False while a nudge waits to be drained or a
        raised step ceiling has not been asked for; True again once both are."""
        sink = Sink()
        policy = CriticPolicy(soft_timeout=60, idle_timeout=20, grace=30, step_bonus=5)
        handle = WatchCritic(policy).monitor(RunInfo(), 60, backstop=None, max_steps=10,
                                             events=sink)
        assert handle.max_steps() == 10
        assert handle.step_ended(0, Step(), trio.current_time()) is True
        await trio.sleep(20)
        handle.deadline()  # the watcher's look: silent for idle_timeout, nudged
        assert sink.names[-1] == "steer"
        assert handle.step_ended(1, Step(), trio.current_time()) is False
        assert [m.content for m in handle.steer()] != []
        assert handle.step_ended(2, Step(), trio.current_time()) is True
        for i in range(3, 6):  # a step every 10 s up to the deadline at 60 s
            await trio.sleep(10)
            assert handle.step_ended(i, Step(), trio.current_time()) is True
        await trio.sleep(10)
        handle.deadline()  # the deadline, with steps in the window: extended, ceiling + 5
        assert sink.names[-1] == "extend"
        assert handle.step_ended(6, Step(), trio.current_time()) is False
        assert handle.max_steps() == 15
        assert handle.step_ended(7, Step(), trio.current_time()) is True
        handle.stop()
        assert handle.step_ended(8, Step(), trio.current_time()) is False

    async def test_max_steps_defers_without_a_base_ceiling(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A run without a step ceiling gets none from the critic, even after an extension."""
        sink = Sink()
        handle = WatchCritic().monitor(RunInfo(), 10, backstop=None, max_steps=None,
                                       events=sink)
        handle.record_step(0, Step())
        await trio.sleep(10)
        assert handle.deadline() == pytest.approx(trio.current_time() + 10)
        assert handle.max_steps() is None
        assert sink.names == ["watch", "extend"]

    async def test_draining_a_nudge_marks_it_delivered_once(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A nudge is handed out by exactly one steer() call, whichever task asks first."""
        sink = Sink()
        handle = WatchCritic(CriticPolicy(idle_timeout=5)).monitor(
            RunInfo(), None, backstop=None, max_steps=None, events=sink)
        await trio.sleep(5)
        first, second = handle.steer(), handle.steer()
        assert len(first) == 1 and isinstance(first[0], Message) and second == []
        assert sink.names == ["watch", "steer"]

    async def test_stop_ends_all_judging(self, autojump_clock: trio.abc.Clock) -> None:
        """After stop(), nothing is judged, queued or audited, however long it has been."""
        sink = Sink()
        handle = WatchCritic(CriticPolicy(soft_timeout=10, idle_timeout=5)).monitor(
            RunInfo(), None, backstop=None, max_steps=None, events=sink)
        handle.stop()
        await trio.sleep(100)
        handle.record_tool_start(ToolCall("x"))
        assert handle.kill_cause() is None and handle.steer() == []
        assert sink.names == ["watch"]

    async def test_a_judge_calling_back_into_the_handle_does_not_recurse(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A judge that reads the handle while judging gets an answer, not a recursion."""
        holder: list[Any] = []

        class Nosy:
            def judge(self, view: RunView) -> Decision | None:
                holder[0].kill_cause()
                return None

        handle = WatchCritic(judge=Nosy()).monitor(RunInfo(), None, backstop=None,
                                                   max_steps=None, events=Sink())
        holder.append(handle)
        assert handle.kill_cause() is None


class TestSurface:
    def test_all_is_sorted_and_exported_once(self) -> None:
        """`batteries.critic.__all__` is sorted (constants, classes, functions), unique, and
        every name in it exists."""
        names = batteries.critic.__all__
        isort_style = sorted(names, key=lambda n: (not n.isupper(), not n[0].isupper(), n))
        assert names == isort_style and len(set(names)) == len(names)
        assert all(hasattr(batteries.critic, n) for n in names)


class CountingJudge(RulesJudge):
    """The default rules, counting how often they are asked."""

    calls = 0

    def judge(self, view: RunView) -> Decision | None:
        self.calls += 1
        return super().judge(view)


class TestQuietLooks:
    def test_quiet_until(self) -> None:
        """The rules name when the clock alone can next change their mind."""
        judge = RulesJudge(CriticPolicy(soft_timeout=600, idle_timeout=100, grace=20))
        # Last activity 30 s ago at 50 s: the stall nudge is due at 120 s.
        assert judge.quiet_until(view(elapsed=50, idle=30, deadline=600)) == 120
        # After a stall nudge, the kill is due at idle_timeout + grace.
        nudged = Intervention(STALLED, 110.0, True, 0, 0, {})
        assert judge.quiet_until(view(elapsed=115, idle=95, deadline=600,
                                      intervention=nudged)) == 140
        # The deadline comes first when it is nearer.
        assert judge.quiet_until(view(elapsed=580, idle=5, deadline=600)) == 600

    async def test_unchanged_evidence_is_not_judged_again(
            self, autojump_clock: trio.abc.Clock) -> None:
        """After a step, the kernel's steer/max_steps/kill_cause calls cost no judgment."""
        judge = CountingJudge(CriticPolicy(soft_timeout=600, idle_timeout=100))
        handle = WatchCritic(judge=judge).monitor(RunInfo(), 600, backstop=None,
                                                   max_steps=10, events=Sink())
        handle.record_step(0, Step())
        before = judge.calls
        for _ in range(5):
            handle.steer()
            handle.max_steps()
            handle.kill_cause()
        assert judge.calls == before
        handle.record_activity("output", "compiling 3/8")  # plain progress: no judgment
        handle.deadline()
        assert judge.calls == before
        handle.record_tool_start(ToolCall("search", {"q": "x"}))  # loop evidence: judged
        assert judge.calls == before + 1

    async def test_clock_rules_still_fire_on_time(self, autojump_clock: trio.abc.Clock) -> None:
        """Skipped looks never delay a time rule: the nudge comes at exactly idle_timeout."""
        sink = Sink()
        judge = CountingJudge(CriticPolicy(soft_timeout=600, idle_timeout=100))
        handle = WatchCritic(judge=judge).monitor(RunInfo(), 600, backstop=None,
                                                   max_steps=10, events=sink)
        handle.record_step(0, Step())
        await trio.sleep(99.99)
        handle.deadline()  # the watch task's look
        assert handle.steer() == []
        assert handle.next_look() == pytest.approx(trio.current_time() + 0.01)
        await trio.sleep(0.01)
        handle.deadline()
        [nudge] = handle.steer()
        assert "No progress for 100s" in nudge.content
        assert sink.names == ["watch", "steer"]
