"""The step loop's plumbing: tools, steer, checkpoints, child runs, resumption."""

from __future__ import annotations

import math

import pytest
import trio

import kernel
from kernel import (
    ConfigError,
    DeliveryError,
    Kernel,
    Limits,
    Message,
    Ports,
    Result,
    RunContext,
    RunInfo,
    RunStats,
    Status,
    Step,
    ToolCall,
    Usage,
    UsageLimits,
)
from kernel.testing import (
    MemoryAudit,
    MemoryRecorder,
    RecordingBudget,
    RecordingCheckpointer,
    RecordingDelivery,
    ScriptedAgent,
    ScriptedCritic,
)


class TestTools:
    async def test_results_reach_the_next_step(self, autojump_clock: trio.abc.Clock) -> None:
        """Tool results are on ctx.tool_results at the next step, in call order."""

        async def add(a: int, b: int) -> int:
            return a + b

        agent = ScriptedAgent([Step(tool_calls=[ToolCall("add", {"a": 1, "b": 2}, "c1"),
                                                ToolCall("add", {"a": 3, "b": 4}, "c2")])],
                              tools={"add": add})
        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit)).run(agent)
        assert result.status is Status.OK and result.tool_calls == 2
        assert [r.output for r in agent.seen_tool_results[1]] == [3, 7]
        kinds = audit.kinds(result.run_id)
        assert kinds == ["run_start", "step", "tool_start", "tool_end", "tool_start", "tool_end",
                         "step", "run_end"]

    async def test_tool_errors_do_not_end_the_run(self, autojump_clock: trio.abc.Clock) -> None:
        """A raising tool, an unknown tool and a slow tool give error results; the run goes on."""

        async def boom() -> None:
            raise OSError("disk on fire")

        async def slow() -> str:
            await trio.sleep(100)
            return "late"

        agent = ScriptedAgent([Step(tool_calls=[ToolCall("boom"), ToolCall("nope"),
                                                ToolCall("slow")])],
                              tools={"boom": boom, "slow": slow})
        start = trio.current_time()
        result = await Kernel().run(agent, RunInfo(), Limits(tool_timeout=5))
        assert result.status is Status.OK
        errors = [r.error for r in agent.seen_tool_results[1]]
        assert errors[0] == "OSError: disk on fire"
        assert errors[1] == "unknown tool 'nope' (available: boom, slow)"
        assert errors[2] == "tool 'slow' timed out after 5s"
        assert trio.current_time() - start == pytest.approx(5)


class TestSteer:
    async def test_steer_reaches_the_next_step(self, autojump_clock: trio.abc.Clock) -> None:
        """A critic's nudge is on ctx.steer at the next step, and audited."""
        critic = ScriptedCritic(steer_at_step={2: "you are repeating yourself"})
        audit = MemoryAudit()
        agent = ScriptedAgent([Step(), Step(), Step(), Step(final=True)])
        result = await Kernel(Ports(audit=audit, critic=critic)).run(agent)
        assert agent.seen_steer[2] == [Message("user", "you are repeating yourself")]
        assert [s for s in agent.seen_steer if s] == [agent.seen_steer[2]]
        assert "steer" in audit.kinds(result.run_id)

    async def test_steer_mid_step(self, autojump_clock: trio.abc.Clock) -> None:
        """An agent with on_steer gets nudges during a long step."""
        critic = ScriptedCritic(steer_after={5.0: "hurry up"})
        agent = ScriptedAgent([Step(final=True)], step_seconds=10, accept_mid_step_steer=True)
        await Kernel(Ports(critic=critic)).run(agent)
        assert agent.mid_step_steer == [Message("user", "hurry up")]


class TestCheckpoints:
    async def test_throttled_by_steps(self, autojump_clock: trio.abc.Clock) -> None:
        """With checkpoint_every_steps=3, a 10-step run saves after steps 3, 6 and 9."""
        cp = RecordingCheckpointer()
        agent = ScriptedAgent([Step()] * 9, then=Step(final=True))
        result = await Kernel(Ports(checkpointer=cp)).run(
            agent, RunInfo(), Limits(checkpoint_every_steps=3))
        assert [c.steps for c in cp.saves] == [3, 6, 9]
        assert cp.completed == [result.run_id]

    async def test_throttled_by_time(self, autojump_clock: trio.abc.Clock) -> None:
        """A time throttle saves at most once per interval (4 s steps, 10 s interval)."""
        cp = RecordingCheckpointer()
        agent = ScriptedAgent([Step()] * 9, then=Step(final=True), step_seconds=4)
        await Kernel(Ports(checkpointer=cp)).run(
            agent, RunInfo(), Limits(checkpoint_every_seconds=10))
        assert [c.steps for c in cp.saves] == [3, 6, 9]

    async def test_failed_run_fails_its_checkpoint(self, autojump_clock: trio.abc.Clock) -> None:
        """A run ending in error marks its checkpoint failed, with the error."""
        cp = RecordingCheckpointer()
        result = await Kernel(Ports(checkpointer=cp)).run(
            ScriptedAgent([Step(), KeyError("k")]))
        assert cp.failed == [(result.run_id, "KeyError: 'k'")]

    async def test_checkpoint_mid_step(self, autojump_clock: trio.abc.Clock) -> None:
        """ctx.checkpoint() saves the snapshot at once, mid-step, throttle or not."""

        class Learner:
            def __init__(self) -> None:
                self.session = ""

            def snapshot(self) -> dict[str, str]:
                return {"session": self.session}

            async def step(self, ctx: RunContext) -> Step:
                self.session = "s-1"
                await ctx.checkpoint()
                await trio.sleep(1)
                return Step(final=True, output="ok")

        cp, audit = RecordingCheckpointer(), MemoryAudit()
        result = await Kernel(Ports(checkpointer=cp, audit=audit)).run(
            Learner(), RunInfo(), Limits(checkpoint_every_seconds=3600))
        assert result.status is Status.OK
        assert [(c.steps, c.state) for c in cp.saves] == [(0, {"session": "s-1"})]
        assert "checkpoint" in audit.kinds(result.run_id)

    async def test_checkpoint_without_a_checkpointer_is_a_no_op(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Without a checkpointer (or snapshot), ctx.checkpoint() does nothing and never raises."""

        class Plain:
            async def step(self, ctx: RunContext) -> Step:
                await ctx.checkpoint()
                return Step(final=True)

        result = await Kernel(Ports()).run(Plain())
        assert result.status is Status.OK

    async def test_resume_continues_the_count(self, autojump_clock: trio.abc.Clock) -> None:
        """A resumed run keeps its id, step count and state; the audit marks the seam."""
        cp, audit = RecordingCheckpointer(), MemoryAudit()
        k = Kernel(Ports(checkpointer=cp, audit=audit))
        info = RunInfo(name="r")
        with trio.move_on_after(35):
            await k.run(ScriptedAgent([Step()] * 3 + [Step(final=True)], step_seconds=10),
                        info, Limits())
        saved = cp.latest(info.run_id)
        assert saved is not None and saved.steps == 3
        seen: list[object] = []

        async def finish(ctx: RunContext) -> Step:
            seen.append(ctx.resumed_from)
            return Step(output="resumed ok", final=True)

        result = await k.run(ScriptedAgent([finish]), info, Limits(), resume=saved)
        assert result.status is Status.OK and result.steps == 4
        assert seen == [saved.state]
        kinds = audit.kinds(info.run_id)
        assert kinds.count("run_start") == 1 and "resumed" in kinds
        assert [e.seq for e in audit.events(info.run_id)] == list(range(len(kinds)))


class TestChildRuns:
    async def test_child_run_has_its_own_row(self, autojump_clock: trio.abc.Clock) -> None:
        """ctx.run_child records a separate run with parent_run_id set."""
        audit = MemoryAudit()

        async def spawn(ctx: RunContext) -> Step:
            child = await ctx.run_child(ScriptedAgent([Step(output="c", final=True)]),
                                        RunInfo(name="child"))
            return Step(output=f"child said {child.output}", final=True)

        result = await Kernel(Ports(audit=audit)).run(ScriptedAgent([spawn]), RunInfo(name="p"))
        assert result.output == "child said c"
        [child_row] = [r for r in audit.runs.values() if r.info.name == "child"]
        assert child_row.info.parent_run_id == result.run_id
        assert child_row.status is Status.OK
        assert {"child_start", "child_end"} <= set(audit.kinds(result.run_id))


    async def test_the_callers_info_is_left_alone(self, autojump_clock: trio.abc.Clock) -> None:
        """run_child records the child with parent_run_id and caller_id set, on a copy."""
        audit = MemoryAudit()
        given = RunInfo(name="child")

        async def spawn(ctx: RunContext) -> Step:
            await ctx.run_child(ScriptedAgent(), given)
            return Step(final=True)

        result = await Kernel(Ports(audit=audit)).run(ScriptedAgent([spawn]),
                                                      RunInfo(name="p", caller_id="alice"))
        assert given.parent_run_id is None and given.caller_id == ""
        row = audit.runs[given.run_id]
        assert row.info.parent_run_id == result.run_id and row.info.caller_id == "alice"

    async def test_inherited_limits_keep_the_usage_caps(
            self, autojump_clock: trio.abc.Clock) -> None:
        """With limits=None the child keeps the parent's caps, less what the parent used."""
        seen: list[Limits] = []

        async def child_step(ctx: RunContext) -> Step:
            seen.append(ctx.limits)
            return Step(final=True)

        async def spawn(ctx: RunContext) -> Step:
            await ctx.run_child(ScriptedAgent([child_step]), RunInfo(name="child"))
            return Step(final=True)

        limits = Limits(max_cost_usd=1.0, max_total_tokens=100, max_tool_calls=5, timeout=60)
        parent = ScriptedAgent([Step(usage=Usage(input_tokens=30, cost_usd=0.25)), spawn])
        result = await Kernel().run(parent, RunInfo(name="p"), limits)
        assert result.status is Status.OK
        [child] = seen
        assert child.max_cost_usd == pytest.approx(0.75)
        assert (child.max_total_tokens, child.max_tool_calls) == (70, 5)
        assert child.timeout is not None and child.timeout <= 60

    async def test_given_limits_are_tightened_by_the_parents_caps(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A child with limits of its own still cannot spend past the parent's caps."""
        audit = MemoryAudit()
        spender = ScriptedAgent(then=Step(usage=Usage(cost_usd=0.4)))
        info = RunInfo(name="child")

        async def spawn(ctx: RunContext) -> Step:
            await ctx.run_child(spender, info, Limits(max_steps=50, max_cost_usd=10.0))
            return Step()

        parent = ScriptedAgent([spawn])
        result = await Kernel(Ports(audit=audit)).run(parent, RunInfo(name="p"),
                                                      Limits(max_cost_usd=1.0))
        child = audit.runs[info.run_id]
        assert child.status is Status.BUDGET_EXCEEDED and spender.calls == 3
        # The child's spend counts against the parent's cap after the step.
        assert result.status is Status.BUDGET_EXCEEDED and result.reason == "max_cost_usd"
        assert parent.calls == 1 and result.usage == Usage()  # each row keeps its own usage

    async def test_budget_caps_reach_the_child(self, autojump_clock: trio.abc.Clock) -> None:
        """Caps a Budget handed the parent bound the child too (the tighter one wins)."""
        budget = RecordingBudget(caps=UsageLimits(max_output_tokens=10))
        seen: list[Limits] = []

        async def child_step(ctx: RunContext) -> Step:
            seen.append(ctx.limits)
            return Step(final=True)

        async def spawn(ctx: RunContext) -> Step:
            await ctx.run_child(ScriptedAgent([child_step]), RunInfo(name="child"),
                                Limits(max_output_tokens=50))
            return Step(final=True)

        await Kernel(Ports(budget=budget)).run(ScriptedAgent([spawn]), RunInfo(name="p"))
        assert seen[0].max_output_tokens == 10


class TestPortsAttribute:
    async def test_changes_take_effect_for_later_runs(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Assigning Kernel.ports, or a field of it, is used by the next run."""
        k = Kernel()
        first, second = MemoryAudit(), MemoryAudit()
        k.ports.audit = first
        a = await k.run(ScriptedAgent(), RunInfo(name="a"))
        k.ports = Ports(audit=second)
        b = await k.run(ScriptedAgent(), RunInfo(name="b"))
        assert set(first.runs) == {a.run_id} and set(second.runs) == {b.run_id}

    async def test_a_run_in_flight_keeps_its_ports(self, autojump_clock: trio.abc.Clock) -> None:
        """Ports changed while a run is in flight do not reach that run."""
        before, after = MemoryAudit(), MemoryAudit()
        delivery = RecordingDelivery()
        k = Kernel(Ports(audit=before))

        async def swap(ctx: RunContext) -> Step:
            k.ports = Ports(audit=after, delivery=delivery)
            return Step()

        result = await k.run(ScriptedAgent([swap, Step(output="x", final=True)]),
                             RunInfo(name="r"))
        assert result.status is Status.OK
        assert before.runs[result.run_id].status is Status.OK
        assert after.runs == {} and delivery.delivered == []

    def test_only_ports_are_accepted(self) -> None:
        """Assigning something that is not a Ports is a TypeError at once, not at the next run."""
        with pytest.raises(TypeError, match=r"Kernel\.ports must be a Ports, got dict"):
            Kernel().ports = {"audit": None}  # type: ignore[assignment]


class TestFinalizeOrder:
    async def test_delivery_comes_after_budget_and_before_the_audit_closes(
            self, autojump_clock: trio.abc.Clock) -> None:
        """The end of a run: checkpoint, budget commit, delivery, then the recorder closes.

        So a delivery failure is an audit event as well as a port failure on
        the result (the order kernel/ports.py documents for Delivery).
        """
        order: list[str] = []

        class Log(MemoryAudit):
            async def start_run(self, info: RunInfo) -> MemoryRecorder:
                rec = await super().start_run(info)
                inner = rec.close

                async def close(stats: RunStats) -> None:
                    order.append("audit.close")
                    await inner(stats)

                rec.close = close  # type: ignore[method-assign]
                return rec

        class Checkpoints(RecordingCheckpointer):
            async def complete(self, run_id: str) -> None:
                order.append("checkpointer.complete")

        class Spend(RecordingBudget):
            async def commit(self, caller_id: str, runtime_seconds: float, usage: Usage) -> None:
                order.append("budget.commit")

        class Failing(RecordingDelivery):
            async def deliver(self, result: Result) -> None:
                order.append("delivery.deliver")
                raise DeliveryError("nobody home")

        audit = Log()
        result = await Kernel(Ports(audit=audit, budget=Spend(), checkpointer=Checkpoints(),
                                    delivery=Failing())).run(ScriptedAgent(), RunInfo(name="r"))
        assert order == ["checkpointer.complete", "budget.commit", "delivery.deliver",
                         "audit.close"]
        assert result.status is Status.OK
        assert [f.port for f in result.port_failures] == ["delivery"]
        assert "port_failure" in audit.kinds(result.run_id)

class TestLibrarySurface:
    def test_design_example(self) -> None:
        """The example from DESIGN.md / README runs as written."""

        class Countdown:
            def __init__(self, n: int) -> None:
                self.n = n

            async def step(self, ctx: RunContext) -> Step:
                self.n -= 1
                return Step(output="liftoff", final=True) if self.n == 0 else Step()

        result = trio.run(Kernel(Ports()).run, Countdown(3), RunInfo(name="demo"),
                          Limits(max_steps=10, timeout=60))
        assert result.status is Status.OK and result.output == "liftoff"

    def test_all_is_sorted_and_unique(self) -> None:
        """kernel.__all__ is sorted, and each public name is exported exactly once."""
        assert kernel.__all__ == sorted(kernel.__all__)
        assert len(set(kernel.__all__)) == len(kernel.__all__)
        public = {n for n in dir(kernel) if not n.startswith("_")}
        modules = {"errors", "ports", "testing"}
        assert public - modules == set(kernel.__all__)
        for name in kernel.__all__:
            assert getattr(kernel, name).__module__.startswith("kernel")

    def test_status_values(self) -> None:
        """Status is a str enum of the DESIGN.md statuses with their exit codes."""
        assert Status.MAX_STEPS == "max_steps"
        assert {s.value: s.exit_code for s in Status} == {
            "ok": 0, "error": 1, "timeout": 124, "killed": 137, "cancelled": 130,
            "budget_exceeded": 3, "max_steps": 4, "handoff": 5, "dry_run": 0, "lost": 6}

    def test_limits_reject_nonsense(self) -> None:
        """Negative, zero or non-finite bounds are a ConfigError naming the field."""
        with pytest.raises(ConfigError, match=r"Limits\.timeout"):
            Limits(timeout=0)
        with pytest.raises(ConfigError, match=r"Limits\.max_steps"):
            Limits(max_steps=-1)
        for name in ("timeout", "soft_timeout", "tool_timeout", "max_cost_usd",
                     "checkpoint_every_seconds", "poll_interval", "finalize_timeout"):
            for bad in (math.nan, math.inf, -math.inf):
                with pytest.raises(ConfigError, match=rf"Limits\.{name} must be a finite"):
                    Limits(**{name: bad})


class TestImmediateKill:
    async def test_kill_at_tool_start_skips_the_tool(self, autojump_clock: trio.abc.Clock) -> None:
        """A kill decided when a tool starts ends the run before that tool runs."""
        ran: list[str] = []

        async def rm() -> None:
            ran.append("rm")

        critic = ScriptedCritic(kill_at_tool="rm", reason="looping")
        agent = ScriptedAgent(then=Step(tool_calls=[ToolCall("rm")]), tools={"rm": rm})
        start = trio.current_time()
        result = await Kernel(Ports(critic=critic)).run(agent, RunInfo(), Limits())
        assert result.status is Status.KILLED and result.reason == "looping"
        assert ran == [] and result.steps == 1
        assert trio.current_time() == start  # no poll interval waited

    async def test_kill_at_step_takes_effect_before_the_next(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A kill decided at record_step stops the run before another step starts."""
        critic = ScriptedCritic(kill_at_step=3)
        agent = ScriptedAgent(then=Step())
        result = await Kernel(Ports(critic=critic)).run(agent, RunInfo(), Limits())
        assert result.status is Status.KILLED and agent.calls == 3

    async def test_kill_at_an_agent_run_tool_start_cancels_the_step(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A CLI agent reporting a tool call the critic kills on never gets to run it."""
        ran: list[str] = []
        critic = ScriptedCritic(kill_at_tool="Bash", reason="looping")

        async def uses_tool(ctx: RunContext) -> Step:
            ctx.tool_start(ToolCall("Bash", {"command": "ls"}))
            await trio.lowlevel.checkpoint()  # cancelled here
            ran.append("Bash")
            return Step(final=True, output="done")

        start = trio.current_time()
        result = await Kernel(Ports(critic=critic)).run(ScriptedAgent([uses_tool]), RunInfo(),
                                                        Limits())
        assert result.status is Status.KILLED and result.reason == "looping"
        assert ran == [] and trio.current_time() == start

    async def test_no_tool_starts_after_a_kill_verdict(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Of three calls in one step, a kill at the second leaves the third unstarted."""
        ran: list[str] = []

        async def tool(name: str) -> str:
            ran.append(name)
            return name

        critic = ScriptedCritic(kill_at_tool="b", reason="looping")
        agent = ScriptedAgent([Step(tool_calls=[ToolCall("a", {"name": "a"}),
                                                ToolCall("b", {"name": "b"}),
                                                ToolCall("c", {"name": "c"})])],
                              tools={"a": tool, "b": tool, "c": tool})
        audit = MemoryAudit()
        result = await Kernel(Ports(critic=critic, audit=audit)).run(agent, RunInfo(),
                                                                     Limits())
        assert result.status is Status.KILLED and ran == ["a"]
        assert [c.name for c in critic.handles[0].tool_starts] == ["a", "b"]
        # The call killed on never started: not audited as started, not counted.
        assert [e.name for e in audit.events(result.run_id) if e.kind == "tool_start"] == ["a"]
        assert result.tool_calls == 1
        stats = audit.runs[result.run_id].stats
        assert stats is not None and stats.tool_calls == 1

    async def test_a_step_finishing_right_after_a_kill_verdict_still_ends_killed(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A verdict reached via an activity inside the step is not lost to a final step."""
        critic = ScriptedCritic(kill_at_activity="assistant", reason="looping")

        async def finishes_at_once(ctx: RunContext) -> Step:
            ctx.event("assistant", payload={"text": "same again"}, text="same again")
            return Step(final=True, output="all done")  # no checkpoint in between

        result = await Kernel(Ports(critic=critic)).run(ScriptedAgent([finishes_at_once]),
                                                        RunInfo(), Limits())
        assert result.status is Status.KILLED and result.reason == "looping"
        assert critic.handles[0].texts == ["same again"]

    async def test_a_kill_via_activity_cancels_a_long_step_at_once(
            self, autojump_clock: trio.abc.Clock) -> None:
        """The step is cancelled at its next checkpoint, not a poll interval later."""
        critic = ScriptedCritic(kill_at_activity="output", reason="spinner")

        async def long_step(ctx: RunContext) -> Step:
            ctx.activity("output", "|")
            await trio.sleep(3600)
            return Step(final=True)

        start = trio.current_time()
        result = await Kernel(Ports(critic=critic)).run(ScriptedAgent([long_step]), RunInfo(),
                                                        Limits(poll_interval=60))
        assert result.status is Status.KILLED and result.reason == "spinner"
        assert trio.current_time() == start


class TestProcessHooks:
    async def test_processes_reach_the_critic_handle(
            self, autojump_clock: trio.abc.Clock) -> None:
        """ctx.process_started/process_exited are forwarded to the handle's optional hooks."""
        critic = ScriptedCritic()

        async def spawns(ctx: RunContext) -> Step:
            ctx.process_started(101)
            ctx.process_exited(101)
            return Step(final=True)

        result = await Kernel(Ports(critic=critic)).run(ScriptedAgent([spawns]))
        assert result.status is Status.OK
        assert critic.handles[0].processes == [("start", 101), ("exit", 101)]

    async def test_without_a_critic_the_hooks_do_nothing(
            self, autojump_clock: trio.abc.Clock) -> None:
        async def spawns(ctx: RunContext) -> Step:
            ctx.process_started(101)
            ctx.process_exited(101)
            return Step(final=True)

        assert (await Kernel().run(ScriptedAgent([spawns]))).status is Status.OK


class TestAgentReports:
    async def test_agent_kill(self, autojump_clock: trio.abc.Clock) -> None:
        """A final step with kill= ends `killed` with that reason (an agent's own watchdog)."""
        result = await Kernel().run(ScriptedAgent([Step(final=True, kill="stalled",
                                                        error="idle for 600s")]))
        assert result.status is Status.KILLED
        assert result.reason == "stalled" and result.error == "idle for 600s"

    async def test_agent_run_tool_reaches_critic_and_audit(
            self, autojump_clock: trio.abc.Clock) -> None:
        """ctx.tool_start counts the call, audits it and shows it to the critic."""
        critic, audit = ScriptedCritic(), MemoryAudit()

        async def uses_tool(ctx: RunContext) -> Step:
            ctx.tool_start(ToolCall("Bash", {"command": "ls"}, "t1"), payload={"state": "x"})
            return Step(final=True)

        result = await Kernel(Ports(critic=critic, audit=audit)).run(ScriptedAgent([uses_tool]))
        assert result.tool_calls == 1
        assert [c.name for c in critic.handles[0].tool_starts] == ["Bash"]
        [ev] = [e for e in audit.events(result.run_id) if e.kind == "tool_start"]
        assert ev.payload == {"args": {"command": "ls"}, "id": "t1", "state": "x"}
