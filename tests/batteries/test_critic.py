"""The watch-nursery critic driving real `Kernel` runs, in virtual time.

Each test runs a real kernel with `WatchCritic` and a `MemoryAudit`, and
reads the critic's decisions back from the audit as an analyst would.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from batteries.critic import LOOPING, STALLED, CriticPolicy, Decision, RunView, WatchCritic
from kernel import Kernel, Limits, Message, Ports, RunContext, RunInfo, Status, Step, ToolCall
from kernel.testing import AuditEvent, Hang, MemoryAudit, ScriptedAgent

POLL = 0.5


def critic_events(audit: MemoryAudit, run_id: str) -> list[AuditEvent]:
    """The run's `critic` events, in order."""
    return [e for e in audit.events(run_id) if e.kind == "critic"]


def decisions(audit: MemoryAudit, run_id: str) -> list[str | None]:
    """The names of the run's critic events (`watch` first), in order."""
    return [e.name for e in critic_events(audit, run_id)]


def named(audit: MemoryAudit, run_id: str, name: str) -> list[AuditEvent]:
    """The run's critic events with this decision name."""
    return [e for e in critic_events(audit, run_id) if e.name == name]


async def run(agent: Any, limits: Limits, policy: CriticPolicy | None = None,
              **critic_kw: Any) -> tuple[Any, MemoryAudit]:
    """Run `agent` under a fresh WatchCritic and MemoryAudit; return (result, audit)."""
    audit = MemoryAudit()
    critic = WatchCritic(policy, **critic_kw)
    result = await Kernel(Ports(audit=audit, critic=critic)).run(agent, RunInfo(name="t"),
                                                                  limits)
    return result, audit


class Steady:
    """Steps every `every` seconds (the first after `first`), finishing after `count` steps."""

    def __init__(self, every: float, count: int | None = None, first: float | None = None
                 ) -> None:
        self.every = every
        self.count = count
        self.first = every if first is None else first
        self.n = 0

    async def step(self, ctx: RunContext) -> Step:
        await trio.sleep(self.first if self.n == 0 else self.every)
        self.n += 1
        if self.count is not None and self.n >= self.count:
            return Step(output=f"done after {self.n} steps", final=True)
        return Step(output=self.n)


async def nothing(**_: Any) -> str:
    return "no results"


def calls(*names: str) -> list[ToolCall]:
    """Tool calls with fixed arguments per name, as a looping agent would make them."""
    args: dict[str, dict[str, Any]] = {
        "search": {"q": "flaky test", "page": 1}, "read": {"path": "a.py"},
        "write": {"path": "a.py", "text": "x = 1"}, "run_tests": {}}
    return [ToolCall(n, args.get(n, {})) for n in names]


TOOLS = {"search": nothing, "read": nothing, "write": nothing, "run_tests": nothing}


class TestProgress:
    async def test_healthy_two_hour_run_is_extended_to_ok(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A run stepping every 20 s for 2 h (360 steps) ends ok under a 10-min soft timeout.

        A plain step cap of 100 would have ended it `max_steps` at step 100,
        33 minutes in, and a plain 10-minute timeout would have ended it
        `timeout` at step 30; the critic instead extends it 11 times, raising
        the ceiling by 30 steps each time, and the audit shows every extension.
        """
        agent = Steady(20, count=360, first=10)  # steps at 10, 30, ..., 7190 s
        result, audit = await run(agent, Limits(max_steps=100, timeout=3 * 3600,
                                                soft_timeout=600))
        assert result.status is Status.OK
        assert result.steps == 360
        assert result.runtime_seconds == pytest.approx(7190)
        extends = named(audit, result.run_id, "extend")
        assert [e.payload["deadline_s"] for e in extends] == [600.0 * k for k in range(2, 13)]
        assert [e.payload["max_steps"] for e in extends] == [100 + 30 * k for k in range(1, 12)]
        assert all(e.payload["evidence"]["steps"] == 30 for e in extends)
        assert decisions(audit, result.run_id) == ["watch"] + ["extend"] * 11

    async def test_backstop_expiring_during_an_extension_is_timeout(
            self, autojump_clock: trio.abc.Clock) -> None:
        """An extension is capped at the backstop, whose expiry ends `timeout`, never `killed`."""
        result, audit = await run(Steady(10), Limits(timeout=1000, soft_timeout=600,
                                                     max_steps=None))
        assert result.status is Status.TIMEOUT
        assert result.reason == "hard timeout of 1000s expired"
        assert result.runtime_seconds == pytest.approx(1000)
        (extend,) = named(audit, result.run_id, "extend")
        assert extend.payload["capped"] is True and extend.payload["deadline_s"] == 1000
        assert named(audit, result.run_id, "kill") == []

    async def test_a_window_without_progress_lets_the_deadline_lapse(
            self, autojump_clock: trio.abc.Clock) -> None:
        """With stall detection off, a silent run is not extended: it ends `timeout` at the soft
        timeout, with an `expire` decision saying why."""
        policy = CriticPolicy(idle_timeout=None)
        result, audit = await run(ScriptedAgent([Hang()]), Limits(soft_timeout=60), policy)
        assert result.status is Status.TIMEOUT
        assert result.runtime_seconds == pytest.approx(60)
        assert decisions(audit, result.run_id) == ["watch", "expire"]
        (expire,) = named(audit, result.run_id, "expire")
        assert expire.payload["reason"] == "no_progress"

    async def test_a_silent_run_is_judged_stalled_not_timed_out(
            self, autojump_clock: trio.abc.Clock) -> None:
        """With a soft timeout shorter than the silence tolerance, a silent run is kept (`quiet`)
        until the stall rule kills it `stalled`: silence never ends as `timeout`."""
        policy = CriticPolicy(idle_timeout=20, grace=5)
        agent = ScriptedAgent([Step()], then=Hang(), step_seconds=1)  # silent after 1 s
        result, audit = await run(agent, Limits(soft_timeout=10, poll_interval=POLL), policy)
        assert result.status is Status.KILLED and result.reason == STALLED
        assert 26 <= result.runtime_seconds < 26 + POLL
        assert decisions(audit, result.run_id) == ["watch", "extend", "extend", "steer", "kill"]
        first, second = named(audit, result.run_id, "extend")
        assert first.payload["reason"] == "progressing" and second.payload["reason"] == "quiet"
        assert second.payload["step_bonus"] == 0

    async def test_extensions_are_bounded(self, autojump_clock: trio.abc.Clock) -> None:
        """After `max_extensions` extensions the deadline stands, even for a progressing run."""
        policy = CriticPolicy(soft_timeout=60, max_extensions=2)
        result, audit = await run(Steady(7), Limits(max_steps=None), policy)
        assert result.status is Status.TIMEOUT
        assert result.runtime_seconds == pytest.approx(180)
        assert decisions(audit, result.run_id) == ["watch", "extend", "extend", "expire"]
        assert named(audit, result.run_id, "expire")[0].payload["reason"] == "max_extensions"

    async def test_step_ceiling_is_raised_by_the_bonus_and_still_binds(
            self, autojump_clock: trio.abc.Clock) -> None:
        """An extension raises the ceiling by exactly `step_bonus`; the raised ceiling still ends
        a run that outpaces it as `max_steps`."""
        policy = CriticPolicy(soft_timeout=60, step_bonus=5)
        result, audit = await run(Steady(7), Limits(max_steps=10), policy)
        assert result.status is Status.MAX_STEPS
        assert result.reason == "step ceiling of 15 reached"
        assert result.steps == 15
        assert named(audit, result.run_id, "extend")[0].payload["max_steps"] == 15


class TestStalled:
    async def test_silent_run_is_nudged_once_then_killed(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A run silent after 5 steps is steered once, then killed `stalled` at
        idle_timeout + grace after its last step, within one poll interval."""
        policy = CriticPolicy(soft_timeout=None, idle_timeout=60, grace=30)
        agent = ScriptedAgent([Step()] * 5, then=Hang(), step_seconds=7)  # last step at 35 s
        result, audit = await run(agent, Limits(poll_interval=POLL), policy)
        assert result.status is Status.KILLED
        assert result.reason == STALLED
        assert result.error == "killed by the critic: stalled"
        assert result.steps == 5
        assert 35 + 90 <= result.runtime_seconds < 35 + 90 + POLL
        assert decisions(audit, result.run_id) == ["watch", "steer", "kill"]
        steer, kill = critic_events(audit, result.run_id)[1:]
        assert 35 + 60 <= steer.payload["at_s"] < 35 + 60 + POLL
        assert "No progress for 60s" in steer.payload["message"]
        assert kill.payload["reason"] == STALLED
        assert kill.payload["evidence"]["idle_s"] >= 90
        assert audit.runs[result.run_id].status is Status.KILLED

    async def test_run_recovering_after_the_nudge_ends_ok(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A run that resumes once nudged is not killed: the nudge is delivered mid-step exactly
        once, a `continue` decision records the recovery, and the run ends ok."""

        class Sulky:
            """Goes quiet on its third step until it is nudged, then finishes."""

            def __init__(self) -> None:
                self.n = 0
                self.nudged = trio.Event()
                self.nudges: list[Message] = []
                self.seen_steer: list[list[Message]] = []

            async def on_steer(self, messages: list[Message]) -> None:
                self.nudges.extend(messages)
                self.nudged.set()

            async def step(self, ctx: RunContext) -> Step:
                self.seen_steer.append(list(ctx.steer))
                self.n += 1
                await trio.sleep(5)
                if self.n == 3:
                    await self.nudged.wait()
                return Step(final=self.n == 5, output=self.n)

        policy = CriticPolicy(soft_timeout=None, idle_timeout=60, grace=30)
        agent = Sulky()
        result, audit = await run(agent, Limits(poll_interval=POLL), policy)
        assert result.status is Status.OK and result.steps == 5
        assert len(agent.nudges) == 1
        assert all(s == [] for s in agent.seen_steer), "delivered mid-step, not again"
        assert decisions(audit, result.run_id) == ["watch", "steer", "continue"]
        assert named(audit, result.run_id, "continue")[0].payload["reason"] == "recovered"

    async def test_reporting_an_undeliverable_nudge_is_not_a_recovery(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A hung command whose adapter audits the nudge as undeliverable is still killed
        `stalled`: the adapter's echo of the nudge is not activity."""

        class HungCommand:
            """Like a plain command: takes nudges mid-step but can only report them."""

            def __init__(self) -> None:
                self.ctx: RunContext | None = None

            async def on_steer(self, messages: list[Message]) -> None:
                assert self.ctx is not None
                self.ctx.event("steer_undeliverable", payload={"messages": len(messages)})

            async def step(self, ctx: RunContext) -> Step:
                self.ctx = ctx
                ctx.event("output", name="stdout", payload={"line": "start"})
                await trio.sleep_forever()
                raise AssertionError("unreachable")

        policy = CriticPolicy(idle_timeout=2)  # grace: 0.5 s
        result, audit = await run(HungCommand(), Limits(poll_interval=POLL), policy)
        assert result.status is Status.KILLED and result.reason == STALLED
        assert 2.5 <= result.runtime_seconds < 2.5 + POLL
        assert "steer_undeliverable" in audit.kinds(result.run_id)
        assert decisions(audit, result.run_id) == ["watch", "steer", "kill"]

    async def test_activity_inside_a_long_step_keeps_it_alive(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Output inside one 10-minute step (an event every 30 s) counts as activity: no nudge."""

        async def long_step(ctx: RunContext) -> Step:
            for i in range(20):
                await trio.sleep(30)
                ctx.event("output", name="stdout", payload={"line": str(i)})
            return Step(final=True, output="built")

        policy = CriticPolicy(soft_timeout=None, idle_timeout=60)
        result, audit = await run(ScriptedAgent([long_step]), Limits(), policy)
        assert result.status is Status.OK
        assert result.runtime_seconds == pytest.approx(600)
        assert decisions(audit, result.run_id) == ["watch"]


class TestLooping:
    async def test_repeated_call_is_nudged_by_name_then_killed(
            self, autojump_clock: trio.abc.Clock) -> None:
        """The same call three times is steered with a message naming it; carrying on after the
        nudge kills the run `looping`."""
        agent = ScriptedAgent(then=Step(tool_calls=calls("search")), tools=TOOLS,
                              step_seconds=2)
        result, audit = await run(agent, Limits(poll_interval=POLL))
        assert result.status is Status.KILLED
        assert result.reason == LOOPING
        assert decisions(audit, result.run_id) == ["watch", "steer", "kill"]
        steer = named(audit, result.run_id, "steer")[0]
        assert ("search(flaky test, 1) 3 times and got the same result each time"
                in steer.payload["message"])
        # The agent saw the nudge at its 4th step, called search again, and was killed.
        assert agent.seen_steer[3] == [Message("user", steer.payload["message"])]
        kill = named(audit, result.run_id, "kill")[0]
        assert kill.payload["evidence"]["call"] == "search(flaky test, 1)"
        assert kill.payload["evidence"]["result"] == "no results"
        assert kill.payload["detail"] == (
            "search(flaky test, 1) returned the same result 3 times, and again after the "
            "nudge, nudged at 6.0s")
        # The 4th call was killed before it ran: the kernel does not count it.
        assert result.tool_calls == 3

    async def test_ab_cycle_is_nudged_then_killed(self, autojump_clock: trio.abc.Clock) -> None:
        """An A-B-A-B cycle is steered naming both calls; carrying on kills it `looping`."""

        async def alternate(ctx: RunContext) -> Step:
            return Step(tool_calls=calls("read" if ctx.iteration % 2 == 0 else "write"))

        agent = ScriptedAgent(then=alternate, tools=TOOLS, step_seconds=2)
        result, audit = await run(agent, Limits(poll_interval=POLL))
        assert result.status is Status.KILLED and result.reason == LOOPING
        assert decisions(audit, result.run_id) == ["watch", "steer", "kill"]
        steer = named(audit, result.run_id, "steer")[0]
        assert steer.payload["evidence"]["period"] == 2
        assert "read(a.py) -> write(a.py, x = 1)" in steer.payload["message"]
        assert result.tool_calls == 4  # A B A B, nudge, (A killed before it ran)

    async def test_agent_that_changes_course_is_not_killed(
            self, autojump_clock: trio.abc.Clock) -> None:
        """An agent that reads the loop nudge and does something else recovers and ends ok."""

        async def obedient(ctx: RunContext) -> Step:
            if ctx.steer:
                return Step(tool_calls=calls("run_tests"))
            if any(r.call.name == "run_tests" for r in ctx.tool_results):
                return Step(final=True, output="fixed")
            return Step(tool_calls=calls("search"))

        agent = ScriptedAgent(then=obedient, tools=TOOLS, step_seconds=2)
        result, audit = await run(agent, Limits(poll_interval=POLL))
        assert result.status is Status.OK and result.output == "fixed"
        assert decisions(audit, result.run_id) == ["watch", "steer", "continue"]

    async def test_calls_made_before_the_nudge_arrives_do_not_kill(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Five identical calls in one step are nudged, not killed: the agent never saw the
        nudge before making them."""
        agent = ScriptedAgent([Step(tool_calls=calls(*["search"] * 5))], tools=TOOLS,
                              step_seconds=2)
        result, audit = await run(agent, Limits(poll_interval=POLL))
        assert result.status is Status.OK
        assert decisions(audit, result.run_id) == ["watch", "steer"]
        assert len(agent.seen_steer[1]) == 1

    async def test_relapse_after_spent_nudges_kills_at_once(
            self, autojump_clock: trio.abc.Clock) -> None:
        """With one loop nudge allowed, a second loop after a recovery is killed unnudged."""
        script = [Step(tool_calls=calls(n)) for n in
                  ("search", "search", "search", "read", "search", "search", "search")]
        agent = ScriptedAgent(script, then=Step(final=True), tools=TOOLS, step_seconds=2)
        result, audit = await run(agent, Limits(poll_interval=POLL),
                                  CriticPolicy(loop_nudges=1))
        assert result.status is Status.KILLED and result.reason == LOOPING
        assert decisions(audit, result.run_id) == ["watch", "steer", "continue", "kill"]
        assert named(audit, result.run_id, "kill")[0].payload["evidence"]["nudges"] == 1


class TestPluggableJudge:
    async def test_a_custom_judge_decides(self, autojump_clock: trio.abc.Clock) -> None:
        """A host's own Judge replaces the rules: its kill and reason end the run."""

        class Strict:
            def judge(self, view: RunView) -> Decision | None:
                if view.steps >= 2:
                    return Decision.kill("over_budget", detail=f"{view.steps} steps is too many")
                return None

        result, audit = await run(Steady(1), Limits(poll_interval=POLL), judge=Strict())
        assert result.status is Status.KILLED and result.reason == "over_budget"
        assert decisions(audit, result.run_id) == ["watch", "kill"]
        assert critic_events(audit, result.run_id)[0].payload["judge"] == "Strict"

    async def test_a_failing_judge_leaves_the_backstop_in_charge(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A judge that raises is dropped for the run; the run goes on to its real status."""

        class Broken:
            def judge(self, view: RunView) -> Decision | None:
                raise RuntimeError("judge broke")

        result, _ = await run(Steady(1, count=3), Limits(), judge=Broken())
        assert result.status is Status.OK
        assert [f.port for f in result.port_failures] == ["critic"]
        assert "RuntimeError: judge broke" in str(result.port_failures[0])

    async def test_a_malformed_verdict_is_reported_naming_the_judge(
            self, autojump_clock: trio.abc.Clock) -> None:
        """An extension of 0 s is refused with an error naming the judge, not applied."""

        class Stingy:
            def judge(self, view: RunView) -> Decision | None:
                return Decision.extend("progressing", by=0) if view.due else None

        result, _ = await run(Steady(1), Limits(soft_timeout=10, timeout=30), judge=Stingy())
        assert result.status is Status.TIMEOUT
        assert result.runtime_seconds == pytest.approx(30)
        assert "Judge Stingy returned an extension of 0s" in str(result.port_failures[0])
