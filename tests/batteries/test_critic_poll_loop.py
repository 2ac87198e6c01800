"""A silent poll loop under a short idle timeout: a shell that starts a child every 0.2 s
(`while :; do echo tick; sleep 0.2; done`) is a working tree, so the critic neither nudges it
as stalled nor has it "recover", and a deadline it stops extending ends the run with a reason
that says it was extended."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import trio

from batteries.critic import STALLED, CriticPolicy, ProcessSampler, TreeSample, WatchCritic
from kernel import Kernel, Limits, Ports, RunContext, RunInfo, Status, Step
from kernel.testing import AuditEvent, MemoryAudit

ROOT = 4242


class ShellLoopProbe:
    """Process figures of the shell loop: no CPU worth a tick, but every reaped `sleep`
    child's exec reads (~7 KB) are added to the shell's I/O, 5 a second; a new child each
    sample. `flat=True`: the same tree with nothing advancing."""

    threaded = False

    def __init__(self, *, io_per_s: int = 35_000, flat: bool = False) -> None:
        self.io_per_s = 0 if flat else io_per_s
        self.t0: float | None = None
        self.times: list[float] = []
        self.reads: list[tuple[int, float]] = []

    def sample(self, root: int) -> TreeSample | None:
        now = trio.current_time()
        self.times.append(now)
        self.reads.append((root, now))
        if self.t0 is None:
            self.t0 = now
        child = root + 1 + len(self.times)
        return TreeSample(0.0, int((now - self.t0) * self.io_per_s), frozenset({root, child}))

    def input_waits(self, pids: Iterable[int]) -> tuple[str, ...]:
        return ()


class ShellLoop:
    """`kernel run -- sh -c 'while :; do echo tick; sleep 0.2; done'` as one step: the
    command starts `start_after` into the run and prints the same line every 0.2 s for
    `seconds`. Its tree is registered `lead` after its first line: a real sampler's first
    reading comes that much after the command's first output (a worker thread, psutil's
    import), which is what put the old first working sample just past the idle clock."""

    def __init__(self, seconds: float, start_after: float = 0.3, lead: float = 0.05) -> None:
        self.seconds = seconds
        self.start_after = start_after
        self.lead = lead

    async def step(self, ctx: RunContext) -> Step:
        await trio.sleep(self.start_after)
        end = trio.current_time() + self.seconds
        ctx.event("output", name="stdout", text="tick")
        await trio.sleep(self.lead)
        ctx.process_started(ROOT)
        try:
            await trio.sleep(0.2 - self.lead)
            while trio.current_time() < end:
                ctx.event("output", name="stdout", text="tick")
                await trio.sleep(0.2)
        finally:
            ctx.process_exited(ROOT)
        return Step(final=True, exit_code=0)


async def run(agent: Any, policy: CriticPolicy, probe: ShellLoopProbe,
              limits: Limits | None = None) -> tuple[Any, list[AuditEvent]]:
    audit = MemoryAudit()
    kernel = Kernel(Ports(audit=audit, critic=WatchCritic(policy, probe=probe)))
    result = await kernel.run(agent, RunInfo(name="loop"), limits or Limits(timeout=3600))
    return result, [e for e in audit.events(result.run_id)
                    if e.kind == "critic" and e.name != "watch"]


class TestShellPollLoop:
    async def test_a_child_every_fifth_of_a_second_is_never_stalled(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Under `--idle-timeout 2` the loop's tree is seen working before the idle clock
        runs out, from its start on: no `stalled` nudge, so no "recovered" either."""
        probe = ShellLoopProbe()
        result, decisions = await run(ShellLoop(20), CriticPolicy(idle_timeout=2,
                                                                  soft_timeout=None), probe)
        assert result.status is Status.OK
        assert [(e.name, e.payload["reason"]) for e in decisions] == []

    async def test_a_loop_that_joins_a_busy_sampler_is_not_stalled(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Runs of one critic share its sampler: a loop started between two of its rounds
        gets its first reading at once, not at the next round, and is seen working within
        its idle timeout too."""
        critic = WatchCritic(CriticPolicy(idle_timeout=2, soft_timeout=None),
                             probe=ShellLoopProbe())
        audit = MemoryAudit()
        kernel = Kernel(Ports(audit=audit, critic=critic))
        results: list[Any] = []

        async def one(start_after: float) -> None:
            results.append(await kernel.run(ShellLoop(20, start_after), RunInfo(),
                                            Limits(timeout=3600)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0.0)
            nursery.start_soon(one, 0.1)  # (its tree joins the rounds of the first's)
        assert [r.status for r in results] == [Status.OK, Status.OK]
        assert [(e.name, e.payload.get("reason")) for r in results
                for e in audit.events(r.run_id) if e.kind == "critic" and e.name != "watch"
                ] == []

    async def test_with_a_soft_timeout_it_is_only_ever_extended(
            self, autojump_clock: trio.abc.Clock) -> None:
        """`--idle-timeout 2 --soft-timeout 1`: every judgment extends (no steer, continue
        or kill); once the extensions are spent the deadline stands, and the run's reason
        says it had been extended."""
        policy = CriticPolicy(idle_timeout=2, soft_timeout=1, max_extensions=6)
        result, decisions = await run(ShellLoop(60), policy, ShellLoopProbe())
        assert [e.name for e in decisions] == ["extend"] * 6 + ["expire"]
        assert decisions[-1].payload["reason"] == "max_extensions"
        assert result.status is Status.TIMEOUT and result.runtime_seconds == 7
        assert result.reason == ("the critic's deadline passed at 7.0s (the critic had "
                                 "extended it from 1.0s, then let it stand)")

    async def test_a_flat_tree_is_still_nudged_then_killed(
            self, autojump_clock: trio.abc.Clock) -> None:
        """The same loop with nothing advancing (the line repeats, the tree is flat) is
        stalled: nudged at the idle timeout, killed after the grace, never "recovered"."""
        result, decisions = await run(ShellLoop(60), CriticPolicy(idle_timeout=2,
                                                                  soft_timeout=None),
                                      ShellLoopProbe(flat=True))
        assert [(e.name, e.payload["reason"]) for e in decisions] == [
            ("steer", STALLED), ("kill", STALLED)]
        assert result.status is Status.KILLED and result.reason == STALLED


class TestSamplerSpacing:
    @pytest.mark.parametrize(("interval", "max_interval", "apart"), [
        (1.0, 2 / 3, 2 / 3),   # a third of a 2 s idle timeout, shorter than the interval
        (1.0, 0.001, 0.05),    # never closer than 0.05 s
    ])
    async def test_samples_are_never_further_apart_than_max_interval(
            self, interval: float, max_interval: float, apart: float,
            autojump_clock: trio.abc.Clock) -> None:
        """`max_interval` bounds the spacing even below `interval`."""
        probe = ShellLoopProbe()
        sampler = ProcessSampler(probe, interval=interval, max_interval=max_interval)
        seen: list[Any] = []
        sampler.register(ROOT, seen.append)
        await trio.sleep(4)
        sampler.unregister(ROOT, seen.append)
        gaps = {round(b - a, 6) for a, b in zip(probe.times, probe.times[1:], strict=False)}
        assert gaps == {round(apart, 6)}

    async def test_a_root_registered_between_rounds_is_read_at_once(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A tree joining a running sampler gets its first reading (the baseline its first
        interval is measured from) when it registers, then follows the rounds' rhythm."""
        probe = ShellLoopProbe()
        sampler = ProcessSampler(probe, interval=1.0)
        t0 = trio.current_time()
        seen: list[Any] = []
        sampler.register(1, seen.append)
        await trio.sleep(0.3)
        sampler.register(2, seen.append)
        await trio.sleep(2)
        sampler.unregister(1, seen.append)
        sampler.unregister(2, seen.append)
        reads = [(root, round(t - t0, 6)) for root, t in probe.reads]
        assert reads == [(1, 0.0), (2, 0.3), (1, 1.0), (2, 1.0), (1, 2.0), (2, 2.0)]
