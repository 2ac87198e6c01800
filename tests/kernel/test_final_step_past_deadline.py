"""A final step that returns past the hard deadline: its result stands, and it is recorded.

The kernel adds a checkpoint after a step that returns past the deadline, for a
step that never awaits (trio had no checkpoint to cancel it at). After a final
step it cancelled what had already finished: a command that had exited when the
deadline came (`ShellAgent` returns its status: `stop_after_exit`) lost its step
event and ended `timeout`, its exit code 0 beside it. A non-final step past the
deadline is still stopped there (tests/kernel/test_host_misuse_loop.py).
"""

from __future__ import annotations

import contextlib

import trio

from kernel import Kernel, Limits, Ports, RunContext, RunInfo, Status, Step
from kernel.testing import MemoryAudit


class FinishedWhenStopped:
    """Its work is done when the stop comes; it returns its own result (as ShellAgent does
    once the command exited and only its leftovers held the pipes)."""

    async def step(self, ctx: RunContext) -> Step:
        with contextlib.suppress(trio.Cancelled):
            await trio.sleep_forever()
        return Step(output="done", final=True, exit_code=0)


async def test_a_final_step_past_the_deadline_keeps_its_result(
        autojump_clock: trio.abc.Clock) -> None:
    audit = MemoryAudit()
    info = RunInfo()
    result = await Kernel(Ports(audit=audit)).run(FinishedWhenStopped(), info,
                                                  Limits(timeout=5))
    assert result.status is Status.OK, result  # was timeout
    assert (result.output, result.exit_code, result.steps) == ("done", 0, 1)
    assert "step" in audit.kinds(info.run_id)
