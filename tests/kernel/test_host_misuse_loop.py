"""What a host's agent or critic can get wrong, and what the run does about it: one
documented status and a clear error, never an exception out of `Kernel.run`, never a
bypassed deadline or cap, never two runs under one id."""

from __future__ import annotations

import time
from typing import Any

import pytest
import trio
import trio.lowlevel

from kernel import Checkpoint, Kernel, Limits, Ports, RunContext, RunInfo, Status, Step, ToolCall
from kernel import Usage as U
from kernel.testing import MemoryAudit, RecordingCheckpointer, ScriptedCritic


class Never:
    """A step that never awaits: trio gets no checkpoint to cancel it at."""

    def __init__(self, block: float = 0.0) -> None:
        self.block = block
        self.steps = 0
        self.t0 = time.monotonic()

    async def step(self, ctx: RunContext) -> Step:
        self.steps += 1
        if self.block:
            time.sleep(self.block)  # blocks the thread, as a careless agent would
        # Ends by itself long after the deadline: a kernel that cannot stop it ends
        # `ok` (the test fails) instead of hanging the suite.
        return Step(output="thinking", final=time.monotonic() - self.t0 > 30)


class TestTheHardDeadline:
    async def test_a_step_that_never_awaits_is_stopped_at_the_backstop(self) -> None:
        """Limits.timeout holds even for an agent that never yields (real time: virtual
        time does not pass while nothing awaits)."""
        agent = Never(block=0.01)
        with trio.fail_after(60):
            result = await Kernel().run(agent, RunInfo(), Limits(timeout=0.2, max_steps=None))
        assert result.status is Status.TIMEOUT
        assert result.steps == agent.steps >= 1  # (it ran until the backstop, then no further)


class Shaped:
    def __init__(self, step: Step) -> None:
        self.step_ = step

    async def step(self, ctx: RunContext) -> Step:
        await trio.lowlevel.checkpoint()
        return self.step_


class TestMalformedSteps:
    @pytest.mark.parametrize(("step", "says"), [
        (Step(usage={"input_tokens": 5}), "usage is dict, not Usage"),  # type: ignore[arg-type]
        (Step(usage=U(input_tokens=-100)), "usage.input_tokens=-100"),
        (Step(usage=U(input_tokens=10**30)), "usage.input_tokens="),
        (Step(usage=U(cost_usd=float("nan"))), "usage.cost_usd=nan"),
        (Step(usage=U(cost_usd=-1.0)), "usage.cost_usd=-1.0"),
        (Step(usage=U(output_tokens="12")), "usage.output_tokens='12'"),  # type: ignore[arg-type]
        (Step(exit_code=2**70), "exit_code="),
        (Step(artifacts=[1, 2]), "artifacts is list"),  # type: ignore[arg-type]
        (Step(tool_calls=5), "tool_calls is int"),  # type: ignore[arg-type]
        (Step(tool_calls=[ToolCall("x", args=[1, 2])]), "tool call"),  # type: ignore[arg-type]
        (Step(tool_calls=[ToolCall(["x"])]), "tool call"),  # type: ignore[arg-type]
    ])
    async def test_a_malformed_step_ends_the_run_error(self, autojump_clock: trio.abc.Clock,
                                                       step: Step, says: str) -> None:
        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit)).run(
            Shaped(step), RunInfo(), Limits(max_cost_usd=0.5, max_steps=3))
        assert result.status is Status.ERROR
        assert result.error is not None and "returned a malformed Step" in result.error
        assert says in result.error
        assert audit.kinds(result.run_id)[-1] == "run_end"

    async def test_nan_cost_cannot_slip_past_a_cost_cap(
            self, autojump_clock: trio.abc.Clock) -> None:
        """NaN is never over a limit: it is refused as soon as it is reported."""
        result = await Kernel().run(Shaped(Step(usage=U(cost_usd=float("nan")))), RunInfo(),
                                    Limits(max_cost_usd=0.5, max_steps=20))
        assert result.status is Status.ERROR and result.steps == 1


class Garbage:
    """A critic whose handle answers with the wrong types."""

    def __init__(self, **answers: Any) -> None:
        self.answers = answers

    def monitor(self, info: RunInfo, soft_timeout: float | None, **_: Any) -> Any:
        base = ScriptedCritic().monitor(info, soft_timeout, **_)
        answers = self.answers

        class Handle:
            def __getattr__(self, name: str) -> Any:
                if name in answers:
                    return lambda *a, **k: answers[name]
                return getattr(base, name)

        return Handle()


class TestGarbageFromTheCritic:
    @pytest.mark.parametrize("answers", [{"max_steps": "10"}, {"steer": "hello"},
                                         {"steer": [1, 2]}, {"deadline": "x"},
                                         {"deadline": float("nan")}])
    async def test_the_critic_is_dropped_and_the_run_goes_on(
            self, autojump_clock: trio.abc.Clock, answers: dict[str, Any]) -> None:
        result = await Kernel(Ports(critic=Garbage(**answers))).run(
            Shaped(Step(final=True, output="done")), RunInfo(), Limits())
        assert result.status is Status.OK
        assert [f.port for f in result.port_failures] == ["critic"]


class TestOneRunOneId:
    async def test_a_second_run_with_a_running_id_is_refused(
            self, autojump_clock: trio.abc.Clock) -> None:
        audit = MemoryAudit()
        kernel = Kernel(Ports(audit=audit))
        info = RunInfo(name="twice")
        results = []

        class Slow:
            async def step(self, ctx: RunContext) -> Step:
                await trio.sleep(5)
                return Step(final=True)

        async def one() -> None:
            results.append(await kernel.run(Slow(), info))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            await trio.sleep(1)
            nursery.start_soon(one)
        statuses = sorted(str(r.status) for r in results)
        assert statuses == ["error", "ok"]
        refused = next(r for r in results if r.status is Status.ERROR)
        assert "is already running in this kernel" in (refused.error or "")
        assert audit.kinds(info.run_id).count("run_start") == 1
        # Once it ended, the id names that run: a fresh run under it is refused (nothing
        # recorded), and a resume from its checkpoint continues it.
        again = await kernel.run(Shaped(Step(final=True)), info)
        assert again.status is Status.ERROR and "already names a run" in (again.error or "")
        assert audit.kinds(info.run_id).count("run_start") == 1
        resumed = await kernel.run(Shaped(Step(final=True)), info,
                                   resume=Checkpoint(info.run_id, 1, {}))
        assert resumed.status is Status.OK

    async def test_a_child_given_its_parents_info_gets_an_id_of_its_own(
            self, autojump_clock: trio.abc.Clock) -> None:
        audit = MemoryAudit()
        seen: list[str] = []

        class Parent:
            async def step(self, ctx: RunContext) -> Step:
                child = await ctx.run_child(Shaped(Step(final=True)), ctx.info)
                seen.append(child.run_id)
                return Step(final=True)

        info = RunInfo(name="parent")
        result = await Kernel(Ports(audit=audit)).run(Parent(), info)
        assert result.status is Status.OK
        assert seen and seen[0] != info.run_id
        assert audit.kinds(seen[0])[0] == "run_start"


class TestStops:
    async def test_an_agents_own_stop_is_not_resumable(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Step(stop=...) ends `cancelled` but is over: its checkpoint is completed, so
        `kernel recover` does not run it again."""
        cp = RecordingCheckpointer()
        result = await Kernel(Ports(checkpointer=cp)).run(
            Shaped(Step(final=True, stop="enough")), RunInfo(), Limits())
        assert result.status is Status.CANCELLED
        assert cp.completed == [result.run_id]

    async def test_keyboard_interrupt_in_the_host_is_cancelled(self) -> None:
        """Ctrl-C reaching a run (a KeyboardInterrupt through trio) is `cancelled`, as the
        CLI's Ctrl-C is: the run stays resumable."""
        audit = MemoryAudit()
        cp = RecordingCheckpointer()

        class Interrupted:
            async def step(self, ctx: RunContext) -> Step:
                await trio.lowlevel.checkpoint()
                raise KeyboardInterrupt

        info = RunInfo()
        with pytest.raises(KeyboardInterrupt):
            await Kernel(Ports(audit=audit, checkpointer=cp)).run(Interrupted(), info)
        end = [e for e in audit.events(info.run_id) if e.kind == "run_end"]
        assert [e.name for e in end] == ["cancelled"]
        assert cp.completed == [] and getattr(cp, "failed", []) == []

