"""The kernel's watcher: one task follows every run's critic, whatever the number of runs."""

from __future__ import annotations

from typing import Any

import trio

from batteries.critic import CriticPolicy, WatchCritic
from kernel import Kernel, Limits, Message, Ports, RunContext, RunInfo, Status, Step
from kernel.testing import Hang, ScriptedAgent, ScriptedCritic


class TaskCounter(trio.abc.Instrument):
    """Counts the tasks spawned while it is installed, and how many are still alive."""

    def __init__(self) -> None:
        self.spawned: list[str] = []
        self.alive: set[trio.lowlevel.Task] = set()

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.spawned.append(task.name)
        self.alive.add(task)

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        self.alive.discard(task)


class Steps:
    """Finishes after `n` steps, each `every` seconds long."""

    def __init__(self, n: int, every: float = 1.0) -> None:
        self.n = n
        self.every = every

    async def step(self, ctx: RunContext) -> Step:
        await trio.sleep(self.every)
        self.n -= 1
        return Step(output="done", final=True) if self.n == 0 else Step()


async def run_many(kernel: Kernel, agents: list[Any], limits: Limits,
                   counter: TaskCounter) -> list[Any]:
    """Run every agent at once under `kernel`, counting the tasks spawned meanwhile."""
    results: list[Any] = [None] * len(agents)

    async def one(i: int) -> None:
        results[i] = await kernel.run(agents[i], RunInfo(name=f"r{i}"), limits)

    async with trio.open_nursery() as nursery:
        trio.lowlevel.add_instrument(counter)
        for i in range(len(agents)):
            nursery.start_soon(one, i)
    await trio.testing.wait_all_tasks_blocked()
    trio.lowlevel.remove_instrument(counter)
    return results


class TestOneWatcher:
    async def test_many_runs_share_one_watch_task(self, autojump_clock: trio.abc.Clock) -> None:
        """50 concurrent runs under a critic add one task in all, not one per run."""
        counter = TaskCounter()
        kernel = Kernel(Ports(critic=WatchCritic()))
        results = await run_many(kernel, [Steps(5) for _ in range(50)], Limits(), counter)
        assert [r.status for r in results] == [Status.OK] * 50
        extra = [name for name in counter.spawned if not name.endswith(".one")]
        assert extra == ["kernel watcher"], extra

    async def test_runs_one_after_another_share_the_task(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Runs one after another reuse the watcher's task; runs that end before their critic's
        next look never wake it, and nothing stays registered."""
        counter = TaskCounter()
        trio.lowlevel.add_instrument(counter)
        kernel = Kernel(Ports(critic=WatchCritic()))
        for i in range(5):
            result = await kernel.run(Steps(3), RunInfo(name=f"r{i}"), Limits())
            assert result.status is Status.OK
        trio.lowlevel.remove_instrument(counter)
        assert counter.spawned == ["kernel watcher"]
        watcher = kernel._watcher
        assert watcher is not None and watcher.watching == 0
        assert watcher.looks == 0 and watcher.wakeups == 1

    async def test_each_run_is_killed_at_its_own_time(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Hung runs started 10 s apart are each killed `stalled` idle + grace after their
        own start: the watcher wakes for the earliest run first, then the next."""
        policy = CriticPolicy(soft_timeout=None, idle_timeout=60, grace=30)
        kernel = Kernel(Ports(critic=WatchCritic(policy)))
        ended: dict[int, tuple[float, Any]] = {}
        t0 = trio.current_time()

        async def one(i: int) -> None:
            await trio.sleep(10 * i)
            result = await kernel.run(ScriptedAgent([Hang()]), RunInfo(name=f"r{i}"),
                                      Limits(timeout=3600))
            ended[i] = (trio.current_time() - t0, result)

        async with trio.open_nursery() as nursery:
            for i in reversed(range(6)):
                nursery.start_soon(one, i)
        for i in range(6):
            at, result = ended[i]
            assert result.status is Status.KILLED and result.reason == "stalled"
            assert at == 10 * i + 90, (i, at)

    async def test_a_critic_deadline_ends_each_run_as_timeout(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A polled handle (no `next_look`) is looked at every poll_interval, per run."""
        critic = ScriptedCritic(deadline_after=7)
        kernel = Kernel(Ports(critic=critic))
        counter = TaskCounter()
        results = await run_many(kernel, [ScriptedAgent([Hang()]) for _ in range(20)],
                                 Limits(timeout=100, poll_interval=1), counter)
        assert [r.status for r in results] == [Status.TIMEOUT] * 20
        assert all(7 <= r.runtime_seconds <= 8 for r in results)

    async def test_mid_step_nudges_of_concurrent_runs(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Agents that take nudges mid-step each get theirs, during their one long step."""

        class Long:
            def __init__(self) -> None:
                self.got: list[str] = []

            async def step(self, ctx: RunContext) -> Step:
                await trio.sleep(20)
                return Step(output=self.got, final=True)

            async def on_steer(self, messages: list[Message]) -> None:
                await trio.sleep(1)  # a delivery takes time (typing into a pane)
                self.got.extend(m.content for m in messages)

        critic = ScriptedCritic(steer_after={5.0: "hurry", 10.0: "hurry more"})
        kernel = Kernel(Ports(critic=critic))
        agents = [Long() for _ in range(10)]
        results = await run_many(kernel, agents, Limits(poll_interval=1), TaskCounter())
        assert [r.status for r in results] == [Status.OK] * 10
        assert [a.got for a in agents] == [["hurry", "hurry more"]] * 10
