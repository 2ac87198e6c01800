"""A parent run's budget commit does not count the time its child runs ran: each child
commits its own runtime, and a caller's runtime budget is charged once (virtual time).
Before, a 3 s child inside a 4 s parent charged the caller 7 s."""

from __future__ import annotations

import trio

from kernel import Kernel, Limits, Ports, RunContext, RunInfo, Status, Step
from kernel.testing import RecordingBudget, ScriptedAgent


def _sleeper(seconds: float) -> ScriptedAgent:
    async def work(ctx: RunContext) -> Step:
        await trio.sleep(seconds)
        return Step(final=True)
    return ScriptedAgent([work])


async def test_a_child_runs_time_is_charged_once(autojump_clock: trio.abc.Clock) -> None:
    budget = RecordingBudget()

    async def parent_step(ctx: RunContext) -> Step:
        await trio.sleep(1.0)
        child = await ctx.run_child(_sleeper(3.0), RunInfo(name="child"), None)
        assert child.status is Status.OK
        return Step(final=True)

    result = await Kernel(Ports(budget=budget)).run(
        ScriptedAgent([parent_step]), RunInfo(name="parent", caller_id="alice"),
        Limits(max_steps=5, timeout=60))
    assert result.status is Status.OK
    assert abs(result.runtime_seconds - 4.0) < 0.01  # the run itself took 4 s
    charged = sorted(round(seconds, 3) for _, seconds, _ in budget.commits)
    assert charged == [1.0, 3.0]  # the parent's own 1 s, the child's 3 s: 4 s in all


async def test_concurrent_children_are_charged_once(autojump_clock: trio.abc.Clock) -> None:
    """Two children running side by side for 2 s and 3 s: the parent is charged its own
    time outside them (1 s), not less than nothing."""
    budget = RecordingBudget()

    async def parent_step(ctx: RunContext) -> Step:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ctx.run_child, _sleeper(2.0), RunInfo(name="a"), None)
            nursery.start_soon(ctx.run_child, _sleeper(3.0), RunInfo(name="b"), None)
        await trio.sleep(1.0)
        return Step(final=True)

    await Kernel(Ports(budget=budget)).run(
        ScriptedAgent([parent_step]), RunInfo(name="parent", caller_id="alice"),
        Limits(max_steps=5, timeout=60))
    charged = sorted(round(seconds, 3) for _, seconds, _ in budget.commits)
    assert charged == [1.0, 2.0, 3.0]


async def test_child_end_says_how_the_child_ended(autojump_clock: trio.abc.Clock) -> None:
    """The parent's `child_end` carries the child's reason and error beside its status."""
    from kernel.testing import MemoryAudit

    audit = MemoryAudit()

    async def parent_step(ctx: RunContext) -> Step:
        child = await ctx.run_child(ScriptedAgent([RuntimeError("disk full")]),
                                    RunInfo(name="child"), None)
        assert child.status is Status.ERROR
        return Step(final=True)

    result = await Kernel(Ports(audit=audit)).run(
        ScriptedAgent([parent_step]), RunInfo(name="parent"), Limits(max_steps=5, timeout=60))
    [end] = [e for e in audit.events(result.run_id) if e.kind == "child_end"]
    assert end.payload["status"] == "error"
    assert end.payload["error"] == "RuntimeError: disk full"
