"""The watcher past a run's deadlines: asleep while a run that ignores its hard timeout takes
its grace to stop, and a critic's deadline ends the run with a reason that says what happened."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from batteries.critic import WatchCritic
from kernel import Kernel, Limits, Ports, RunContext, RunInfo, Status, Step
from kernel.testing import Hang, MemoryAudit, ScriptedAgent, ScriptedCritic

#: Virtual seconds a stubborn agent goes on after its scope is cancelled.
GRACE = 30.0


class Stubborn:
    """Hangs in its step; once cancelled, takes `GRACE` seconds (shielded) to stop, like a
    command that ignores SIGTERM until its SIGKILL."""

    async def step(self, ctx: RunContext) -> Step:
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(GRACE)
        raise AssertionError("unreachable")  # pragma: no cover


class WatcherSteps(trio.abc.Instrument):
    """Counts the watcher task's steps; one that spins without letting virtual time move is
    stopped by jumping the clock past the grace (the test then fails on the count, instead
    of hanging: under `autojump_clock` a busy task keeps time from advancing)."""

    def __init__(self, clock: trio.testing.MockClock, limit: int = 10_000) -> None:
        self.clock = clock
        self.limit = limit
        self.steps = 0
        self._since_jump = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name != "kernel watcher":
            return
        self.steps += 1
        self._since_jump += 1
        if self._since_jump > self.limit:
            self._since_jump = 0
            self.clock.jump(GRACE)


def stubborn_critics() -> list[Any]:
    return [
        pytest.param(lambda: WatchCritic(), id="watch-critic"),  # soft 600 s: capped at 5 s
        pytest.param(lambda: ScriptedCritic(deadline_after=5), id="polled-handle"),
    ]


class TestGraceAfterTheBackstop:
    @pytest.mark.parametrize("make_critic", stubborn_critics())
    async def test_the_watcher_sleeps_while_a_run_ignores_its_hard_timeout(
            self, make_critic: Any, autojump_clock: trio.testing.MockClock) -> None:
        """A critic deadline that is the backstop passes; the run takes 30 s to stop: the
        watcher looks a handful of times in all, not again and again at the passed deadline."""
        steps = WatcherSteps(autojump_clock)
        kernel = Kernel(Ports(critic=make_critic()))
        trio.lowlevel.add_instrument(steps)
        try:
            result = await kernel.run(Stubborn(), RunInfo(name="stubborn"),
                                      Limits(timeout=5, poll_interval=1))
        finally:
            trio.lowlevel.remove_instrument(steps)
        assert result.status is Status.TIMEOUT
        assert result.reason == "hard timeout of 5s expired"
        assert result.runtime_seconds == 5 + GRACE
        watcher = kernel._watcher
        assert watcher.looks < 20 and watcher.wakeups < 20, (watcher.looks, watcher.wakeups)
        assert steps.steps < 40, steps.steps
        assert watcher.watching == 0


class TestCriticDeadlineReason:
    async def test_a_deadline_never_extended_says_so(
            self, autojump_clock: trio.abc.Clock) -> None:
        """The critic's first deadline passing: `timeout`, "the critic did not extend it"."""
        kernel = Kernel(Ports(critic=ScriptedCritic(deadline_after=7)))
        result = await kernel.run(ScriptedAgent([Hang()]), RunInfo(), Limits(timeout=100))
        assert result.status is Status.TIMEOUT and result.runtime_seconds == 7
        assert result.reason == ("the critic's deadline passed at 7.0s "
                                 "(the critic did not extend it)")

    async def test_an_extended_deadline_is_not_called_unextended(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A deadline the critic extended twice, then let pass: the reason says it was extended
        (from when), not that it was not."""
        critic = ScriptedCritic(deadline_after=1, extensions=[(1, 1), (2, 1)])
        audit = MemoryAudit()
        kernel = Kernel(Ports(audit=audit, critic=critic))
        result = await kernel.run(ScriptedAgent([Hang()]), RunInfo(), Limits(timeout=100))
        assert result.status is Status.TIMEOUT and result.runtime_seconds == 3
        assert [e.name for e in audit.events(result.run_id) if e.kind == "critic"] == [
            "extend", "extend"]
        assert result.reason == ("the critic's deadline passed at 3.0s (the critic had "
                                 "extended it from 1.0s, then let it stand)")


@pytest.mark.realtime
def test_kernel_run_past_its_timeout_uses_no_cpu_while_the_command_ignores_sigterm(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """`kernel run --timeout 1` on a command that ignores SIGTERM waits out the 2 s grace
    asleep: the kernel process (with its reaped children) uses well under a second and a
    half of user CPU (a busy watcher used ~2.1 s; a quiet run ~0.2 s: Python's start-up)."""
    env = {**cli_env, "HOME": str(tmp_path)}
    proc = subprocess.Popen(
        [kernel_exe, "run", "--timeout", "1", "--", "sh", "-c", 'trap "" TERM; sleep 10'],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True)
    try:
        # wait4: this child's own rusage (with its reaped descendants), not the test's.
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.stderr is not None
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.returncode == 124, stderr
    assert "hard timeout of 1s expired" in stderr
    assert usage.ru_utime < 1.5, (usage.ru_utime, usage.ru_stime)
