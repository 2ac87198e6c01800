"""`SupportsStepEnd`: a handle that takes a step's end in one call and says when it has
nothing new, so the kernel stops asking it three questions a step, and still loses nothing."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import trio

from kernel import (
    Checkpoint,
    Kernel,
    Limits,
    Message,
    Ports,
    RunContext,
    RunInfo,
    Status,
    Step,
    SupportsStepEnd,
    ToolCall,
)
from kernel.testing import RecordingCheckpointer


class SettlingHandle:
    """A critic handle with `step_ended`: settled unless told otherwise; counts each question.

    `at_step[i]` runs when step `i` ends (before the answer), `at_look` when the
    watcher looks (`deadline()`), at `look_at` (trio time). The watcher's looks ask
    `deadline()` then `kill_cause()`; `asked["kill_cause"]` counts only the others
    (the run's own questions), `asked["look"]` the looks.
    """

    def __init__(self) -> None:
        self.asked: Counter[str] = Counter()
        self.ended: list[tuple[int, float, float]] = []  # (iteration, now given, clock after)
        self.kill: str | None = None
        self.queue: list[Message] = []
        self.ceiling: int | None = None
        self.answer: bool | None = True
        self.at_step: dict[int, Callable[[SettlingHandle], None]] = {}
        self.look_at: float | None = None
        self.at_look: Callable[[SettlingHandle], None] | None = None
        self._looking = False

    def step_ended(self, iteration: int, step: Step, now: float) -> bool | None:
        self.ended.append((iteration, now, trio.current_time()))
        if iteration in self.at_step:
            self.at_step.pop(iteration)(self)
        if self.answer is not True:
            return self.answer
        return self.kill is None and not self.queue

    def record_step(self, iteration: int, step: Step) -> None:
        raise AssertionError("the kernel calls step_ended instead")

    def record_tool_start(self, call: ToolCall) -> None:
        self.asked["record_tool_start"] += 1

    def record_activity(self, kind: str, text: str | None = None) -> None:
        self.asked["record_activity"] += 1

    def steer(self) -> list[Message]:
        self.asked["steer"] += 1
        msgs, self.queue = self.queue, []
        return msgs

    def deadline(self) -> float | None:
        self.asked["deadline"] += 1
        self._looking = True
        if self.at_look is not None and self.look_at is not None \
                and trio.current_time() >= self.look_at:
            self.look_at = None
            self.at_look(self)
        return None

    def next_look(self) -> float | None:
        return self.look_at

    def max_steps(self) -> int | None:
        self.asked["max_steps"] += 1
        return self.ceiling

    def kill_cause(self) -> str | None:
        self.asked["look" if self._looking else "kill_cause"] += 1
        self._looking = False
        return self.kill

    def stop(self) -> None:
        pass


class OneHandle:
    """A Critic that hands out the one handle it was given."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def monitor(self, info: RunInfo, soft_timeout: float | None, *, backstop: float | None,
                max_steps: int | None, events: Any) -> Any:
        return self.handle


class Steps:
    """`n` steps of `every` seconds; remembers what each step was told; the last is final."""

    def __init__(self, n: int, every: float = 1.0, *, tool_at: int | None = None) -> None:
        self.n = n
        self.every = every
        self.tool_at = tool_at
        self.steered: list[list[str]] = []
        self.tools = {"echo": self.echo}

    async def echo(self, text: str) -> str:
        return text

    async def step(self, ctx: RunContext) -> Step:
        self.steered.append([m.content for m in ctx.steer])
        await trio.sleep(self.every)
        if ctx.iteration == self.tool_at:
            return Step(tool_calls=[ToolCall("echo", {"text": "hi"})])
        return Step(output="done", final=True) if ctx.iteration + 1 == self.n else Step()


async def run(handle: Any, agent: Steps, limits: Limits | None = None) -> Any:
    kernel = Kernel(Ports(critic=OneHandle(handle)))
    return await kernel.run(agent, RunInfo(name="settling"), limits or Limits(timeout=600))


class TestSettled:
    async def test_the_shipped_critic_handle_supports_it(self) -> None:
        from batteries.critic import WatchCritic

        handle = WatchCritic().monitor(RunInfo(), None, backstop=None, max_steps=None,
                                       events=lambda kind, **kw: None)
        assert isinstance(handle, SupportsStepEnd) and isinstance(SettlingHandle(),
                                                                  SupportsStepEnd)
        handle.stop()

    async def test_settled_steps_ask_nothing_more(self, autojump_clock: trio.abc.Clock) -> None:
        """Ten settled steps: `step_ended` each time, and `steer`/`max_steps` only before the
        first step; `kill_cause` never (the handle said there was none)."""
        handle = SettlingHandle()
        result = await run(handle, Steps(10))
        assert result.status is Status.OK and result.steps == 10
        assert [i for i, _, _ in handle.ended] == list(range(10))
        assert handle.asked["steer"] == handle.asked["max_steps"] == 1
        assert handle.asked["kill_cause"] == 0

    async def test_now_is_the_trio_time_the_step_ended(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Under a virtual clock `now` is exactly the clock at the step's end."""
        handle = SettlingHandle()
        start = trio.current_time()
        await run(handle, Steps(3, every=2.0))
        assert [(now - start, after - start) for _, now, after in handle.ended] == [
            (2.0, 2.0), (4.0, 4.0), (6.0, 6.0)]

    async def test_now_is_trio_time_under_the_real_clock(self) -> None:
        """Under trio's own clock (the kernel times steps with `perf_counter` there) `now` is
        still trio time: read before the handle's own reading, and close to it. (trio's clock
        is `perf_counter` plus an offset of 10,000 s or more: a `now` without it is that far
        off, so the bound below leaves any load its margin.)"""
        handle = SettlingHandle()
        await run(handle, Steps(3, every=0.0))
        for _, now, after in handle.ended:
            assert now <= after < now + 1000.0

    async def test_returning_none_keeps_the_questions(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A handle that does not say it is settled is asked after every step, as before."""
        handle = SettlingHandle()
        handle.answer = None
        result = await run(handle, Steps(5))
        assert result.status is Status.OK
        assert handle.asked["kill_cause"] == 5
        assert handle.asked["steer"] == handle.asked["max_steps"] == 5

    async def test_a_kill_decided_at_a_step_end_ends_the_run_there(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A kill cause set in `step_ended` (answer False) ends the run `killed` at that step,
        the final step included: a verdict is never lost to a quick finish."""
        for last in (False, True):
            handle = SettlingHandle()
            handle.at_step[2] = lambda h: setattr(h, "kill", "looping")
            result = await run(handle, Steps(3 if last else 10))
            assert result.status is Status.KILLED and result.reason == "looping"
            assert result.steps == 3

    async def test_a_nudge_queued_by_a_look_reaches_the_next_step(
            self, autojump_clock: trio.abc.Clock) -> None:
        """While settled, a look by the watcher that queues a nudge (at 2.5 s, during the
        third step) unsettles the run: the fourth step is told."""
        handle = SettlingHandle()
        handle.look_at = trio.current_time() + 2.5
        handle.at_look = lambda h: h.queue.append(Message("user", "try another way"))
        agent = Steps(6)
        result = await run(handle, agent)
        assert result.status is Status.OK
        assert agent.steered == [[], [], [], ["try another way"], [], []]
        assert handle.asked["kill_cause"] == 1  # after the step following the look

    async def test_a_nudge_queued_between_steps_reaches_the_next_step(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A look while the run saves its checkpoint, after the handle said it was settled:
        the kernel asks again before the next step, which is told (not the one after)."""

        class SlowSaves(RecordingCheckpointer):
            async def save(self, checkpoint: Checkpoint) -> None:
                await trio.sleep(1.0)
                await super().save(checkpoint)

        class Saved(Steps):
            def snapshot(self) -> dict[str, Any]:
                return {"state": "steps"}

        handle = SettlingHandle()
        handle.look_at = trio.current_time() + 1.5  # step 0: 0-1 s, its save: 1-2 s
        handle.at_look = lambda h: h.queue.append(Message("user", "try another way"))
        agent = Saved(4)
        kernel = Kernel(Ports(critic=OneHandle(handle), checkpointer=SlowSaves()))
        result = await kernel.run(agent, RunInfo(name="saves"), Limits(timeout=600))
        assert result.status is Status.OK
        assert agent.steered == [[], ["try another way"], [], []]

    async def test_a_raised_ceiling_holds_while_settled(
            self, autojump_clock: trio.abc.Clock) -> None:
        """`max_steps()` raised the ceiling from 3 to 5 once; settled steps keep it."""
        handle = SettlingHandle()
        handle.ceiling = 5
        result = await run(handle, Steps(100), Limits(max_steps=3, timeout=600))
        assert result.status is Status.MAX_STEPS and result.steps == 5
        assert result.reason == "step ceiling of 5 reached"
        assert handle.asked["max_steps"] == 1

    async def test_a_tool_call_unsettles(self, autojump_clock: trio.abc.Clock) -> None:
        """A step with a tool call: the handle hears the call, so the kernel asks again
        before the next step (a kill at the tool start would end the run there)."""
        handle = SettlingHandle()
        result = await run(handle, Steps(5, tool_at=1))
        assert result.status is Status.OK and result.tool_calls == 1
        assert handle.asked["record_tool_start"] == 1
        assert handle.asked["steer"] == handle.asked["max_steps"] == 2
        assert handle.asked["kill_cause"] == 2  # right after the tool's start and its end

    async def test_activity_unsettles(self, autojump_clock: trio.abc.Clock) -> None:
        """An agent event shown to the critic unsettles the run too."""

        class Talks(Steps):
            async def step(self, ctx: RunContext) -> Step:
                if ctx.iteration == 2:
                    ctx.event("output", text="compiling")
                return await super().step(ctx)

        handle = SettlingHandle()
        result = await run(handle, Talks(5))
        assert result.status is Status.OK
        assert handle.asked["record_activity"] == 1
        assert handle.asked["kill_cause"] == 1  # at the activity (answered None)
        assert handle.asked["steer"] == 1  # settled again by the step's own end

