"""Port-fault matrix: every method of every port raising still gives the right status.

Observers (audit, recorder, critic, checkpointer, delivery, budget.commit)
fail safe: the run keeps its real status and the failure is on the result.
The one decider, budget.check, fails closed: `budget_exceeded`.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import trio

from kernel import Kernel, Limits, Ports, RunContext, RunInfo, Status, Step, ToolCall
from kernel.testing import (
    MemoryAudit,
    MemoryRecorder,
    RecordingBudget,
    RecordingCheckpointer,
    RecordingDelivery,
    ScriptedAgent,
    ScriptedCritic,
    ScriptedHandle,
)


def breaking(cls: type, method: str) -> type:
    """A subclass of `cls` whose `method` raises RuntimeError (async if the original is)."""
    original = getattr(cls, method)
    if inspect.iscoroutinefunction(original):
        async def broken(self: Any, *a: Any, **kw: Any) -> Any:
            raise RuntimeError(f"{method} broke")
    else:
        def broken(self: Any, *a: Any, **kw: Any) -> Any:  # type: ignore[misc]
            raise RuntimeError(f"{method} broke")
    return type(f"Broken{cls.__name__}", (cls,), {method: broken})


class BreakingAudit(MemoryAudit):
    def __init__(self, recorder_cls: type) -> None:
        super().__init__()
        self.recorder_cls = recorder_cls

    async def start_run(self, info: RunInfo) -> MemoryRecorder:
        rec = await super().start_run(info)
        rec.__class__ = self.recorder_cls
        return rec


class BreakingCritic(ScriptedCritic):
    def __init__(self, handle_cls: type) -> None:
        super().__init__(deadline_after=1000)
        self.handle_cls = handle_cls

    def monitor(self, *a: Any, **kw: Any) -> ScriptedHandle:
        handle = super().monitor(*a, **kw)
        handle.__class__ = self.handle_cls
        return handle


async def echo(text: str) -> str:
    return text


async def emit(ctx: RunContext) -> Step:
    ctx.event("output", name="stdout", payload={"line": "x"})
    return Step(tool_calls=[ToolCall("echo", {"text": "hi"})])


def agent(fail: bool) -> ScriptedAgent:
    """Steps that touch every port method: events, a tool call, then end or raise."""
    last: Any = RuntimeError("agent failed") if fail else Step(output="done", final=True)
    return ScriptedAgent([emit, Step(), last], tools={"echo": echo}, step_seconds=1)


CASES: list[tuple[str, str, bool, Status]] = [
    # (port, method, agent fails?, expected status)
    ("audit", "start_run", False, Status.OK),
    ("recorder", "on_step", False, Status.OK),
    ("recorder", "on_tool", False, Status.OK),
    ("recorder", "log_event", False, Status.OK),
    ("recorder", "log_error", True, Status.ERROR),
    ("recorder", "close", False, Status.OK),
    ("budget", "check", False, Status.BUDGET_EXCEEDED),
    ("budget", "commit", False, Status.OK),
    ("critic", "monitor", False, Status.OK),
    ("handle", "record_step", False, Status.OK),
    ("handle", "record_tool_start", False, Status.OK),
    ("handle", "record_activity", False, Status.OK),
    ("handle", "steer", False, Status.OK),
    ("handle", "deadline", False, Status.OK),
    ("handle", "max_steps", False, Status.OK),
    ("handle", "kill_cause", False, Status.OK),
    ("handle", "stop", False, Status.OK),
    ("checkpointer", "save", False, Status.OK),
    ("checkpointer", "complete", False, Status.OK),
    ("checkpointer", "fail", True, Status.ERROR),
    ("delivery", "deliver", False, Status.OK),
]


def ports_breaking(port: str, method: str) -> Ports:
    audit: MemoryAudit = MemoryAudit()
    critic: ScriptedCritic = ScriptedCritic(deadline_after=1000)
    budget: RecordingBudget = RecordingBudget()
    checkpointer: RecordingCheckpointer = RecordingCheckpointer()
    delivery: RecordingDelivery = RecordingDelivery()
    if port == "audit":
        audit = breaking(MemoryAudit, method)()
    elif port == "recorder":
        audit = BreakingAudit(breaking(MemoryRecorder, method))
    elif port == "critic":
        critic = breaking(ScriptedCritic, method)(deadline_after=1000)
    elif port == "handle":
        critic = BreakingCritic(breaking(ScriptedHandle, method))
    elif port == "budget":
        budget = breaking(RecordingBudget, method)()
    elif port == "checkpointer":
        checkpointer = breaking(RecordingCheckpointer, method)()
    elif port == "delivery":
        delivery = breaking(RecordingDelivery, method)()
    return Ports(audit=audit, budget=budget, critic=critic, checkpointer=checkpointer,
                 delivery=delivery)


class TestPortFaultMatrix:
    @pytest.mark.parametrize(("port", "method", "fail", "expected"), CASES,
                             ids=[f"{p}.{m}" for p, m, _, _ in CASES])
    async def test_port_method_raising(self, port: str, method: str, fail: bool,
                                       expected: Status,
                                       autojump_clock: trio.abc.Clock) -> None:
        """The run ends with its real status (budget.check: closed) and the fault is reported."""
        ports = ports_breaking(port, method)
        result = await Kernel(ports).run(agent(fail), RunInfo(caller_id="c"),
                                         Limits(timeout=100, checkpoint_every_steps=1))
        assert result.status is expected
        reported = {(f.port, f.method) for f in result.port_failures}
        want_port = {"recorder": "audit", "handle": "critic"}.get(port, port)
        assert any(p == want_port and method in m for p, m in reported), result.port_failures
        assert all(f"{method} broke" in f.error for f in result.port_failures)

    async def test_critic_failure_leaves_the_backstop(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A critic whose deadline() raises is dropped; the hard timeout still ends a hang."""
        from kernel.testing import Hang

        ports = ports_breaking("handle", "deadline")
        result = await Kernel(ports).run(ScriptedAgent([Hang()]), RunInfo(), Limits(timeout=50))
        assert result.status is Status.TIMEOUT
        assert [f.port for f in result.port_failures] == ["critic"]

    async def test_each_failure_reported_once(self, autojump_clock: trio.abc.Clock) -> None:
        """A method failing on every call is reported once, not once per call."""
        ports = ports_breaking("recorder", "on_step")
        result = await Kernel(ports).run(ScriptedAgent([Step()] * 20), RunInfo(), Limits())
        assert [str(f) for f in result.port_failures] == ["audit.on_step: RuntimeError: "
                                                          "on_step broke"]

    async def test_slow_finalization_is_bounded(self, autojump_clock: trio.abc.Clock) -> None:
        """A delivery that hangs is cut off at its share of finalize_timeout (half, at most
        5 s before the end) and reported; the audit still closes the run's record."""

        class Stuck(RecordingDelivery):
            async def deliver(self, result: Any) -> None:
                await trio.sleep_forever()

        audit = MemoryAudit()
        start = trio.current_time()
        result = await Kernel(Ports(delivery=Stuck(), audit=audit)).run(
            ScriptedAgent(), RunInfo(), Limits(finalize_timeout=7))
        assert result.status is Status.OK
        assert trio.current_time() - start == pytest.approx(3.5)
        assert [(f.port, f.method) for f in result.port_failures] == [("kernel", "finalize")]
        assert audit.kinds(result.run_id)[-2:] == ["port_failure", "run_end"]

    @pytest.mark.parametrize("port", ["budget", "checkpointer"])
    async def test_a_hanging_port_leaves_the_recorder_its_time(
            self, autojump_clock: trio.abc.Clock, port: str) -> None:
        """A budget commit or a checkpoint that never returns cannot keep the run's
        audit record open: the recorder closes it within finalize_timeout."""

        class Hang:
            async def check(self, caller_id: str) -> None:
                return None

            async def commit(self, *args: Any) -> None:
                await trio.sleep_forever()

            async def complete(self, run_id: str) -> None:
                await trio.sleep_forever()

            async def save(self, checkpoint: Any) -> None:
                return None

            async def fail(self, run_id: str, error: str) -> None:
                await trio.sleep_forever()

        audit = MemoryAudit()
        ports = Ports(audit=audit, **{port: Hang()})  # type: ignore[arg-type]
        start = trio.current_time()
        result = await Kernel(ports).run(ScriptedAgent(), RunInfo(),
                                         Limits(finalize_timeout=20))
        assert trio.current_time() - start == pytest.approx(15)  # 20 less 5 s for the audit
        assert audit.kinds(result.run_id)[-1] == "run_end"

    async def test_slow_finalization_of_a_killed_run_is_bounded(
            self, autojump_clock: trio.abc.Clock) -> None:
        """The same bound when the run's own scope was cancelled (a kill) before the end."""

        class Stuck(RecordingDelivery):
            async def deliver(self, result: Any) -> None:
                await trio.sleep_forever()

        ports = Ports(delivery=Stuck(), critic=ScriptedCritic(kill_at_step=1))
        start = trio.current_time()
        result = await Kernel(ports).run(ScriptedAgent([Step()] * 3), RunInfo(),
                                         Limits(finalize_timeout=7))
        assert result.status is Status.KILLED
        assert trio.current_time() - start == pytest.approx(3.5)
        assert [(f.port, f.method) for f in result.port_failures] == [("kernel", "finalize")]

    async def test_finalization_is_shielded_from_an_outer_cancel(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A caller's cancel arriving while a finished run closes its books does not cut
        them short: the delivery completes and the run's result stands."""

        class Slow(RecordingDelivery):
            async def deliver(self, result: Any) -> None:
                await trio.sleep(5)
                await super().deliver(result)

        delivery = Slow()
        result = None
        with trio.move_on_after(1):
            result = await Kernel(Ports(delivery=delivery)).run(ScriptedAgent(), RunInfo(),
                                                                Limits(finalize_timeout=60))
        assert result is not None and result.status is Status.OK and not result.port_failures
        assert delivery.delivered == [result]


class TestFailuresAreAudited:
    async def test_delivery_failure_in_the_audit(self, autojump_clock: trio.abc.Clock) -> None:
        """A delivery failure is a port_failure event in the run's audit, before run_end."""
        audit = MemoryAudit()
        ports = Ports(audit=audit, delivery=breaking(RecordingDelivery, "deliver")())
        result = await Kernel(ports).run(ScriptedAgent(), RunInfo(), Limits())
        assert result.status is Status.OK
        kinds = audit.kinds(result.run_id)
        assert kinds[-2:] == ["port_failure", "run_end"]
        [ev] = [e for e in audit.events(result.run_id) if e.kind == "port_failure"]
        assert ev.name == "delivery.deliver" and "deliver broke" in ev.payload["error"]
