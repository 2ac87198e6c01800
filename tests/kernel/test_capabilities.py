"""Optional capabilities: public Protocols, looked up once per run, malformed ones named."""

from __future__ import annotations

from typing import Any

import trio

import kernel
from kernel import (
    Kernel,
    Limits,
    Message,
    Ports,
    RunContext,
    RunInfo,
    Status,
    Step,
    SupportsAttach,
    SupportsNextLook,
    SupportsProcesses,
    SupportsSimulate,
    SupportsSnapshot,
    SupportsSteer,
    SupportsStepEnd,
    SupportsToolEnd,
    SupportsTools,
    ToolCall,
)
from kernel.testing import MemoryAudit, RecordingCheckpointer, ScriptedCritic, ScriptedHandle


class Everything:
    """An agent with every optional capability, each recording its use."""

    def __init__(self) -> None:
        self.used: list[str] = []
        self.tools = {"echo": self.echo}

    async def echo(self, text: str) -> str:
        self.used.append("tools")
        return text

    async def step(self, ctx: RunContext) -> Step:
        if ctx.iteration == 0:
            return Step(tool_calls=[ToolCall("echo", {"text": "hi"})])
        if ctx.iteration == 1:
            await trio.sleep(5)  # the critic's nudge arrives mid-step
        return Step(output="done", final=ctx.iteration >= 1)

    async def on_steer(self, messages: list[Message]) -> None:
        self.used.append("on_steer")

    def snapshot(self) -> Any:
        self.used.append("snapshot")
        return {"state": "s"}

    async def simulate(self, ctx: RunContext) -> Any:
        self.used.append("simulate")
        return "would echo"


class TestProtocols:
    def test_each_capability_is_a_runtime_checkable_protocol(self) -> None:
        """A host can isinstance-check an agent against each capability the kernel uses."""
        agent = Everything()
        for proto in (SupportsTools, SupportsSteer, SupportsSnapshot, SupportsSimulate):
            assert isinstance(agent, proto), proto
            assert proto.__name__ in kernel.__all__
        assert not isinstance(object(), SupportsSteer)

    async def test_the_shipped_handles_have_the_handle_capabilities(self) -> None:
        """The critic handles shipped implement the handle Protocols the kernel looks for."""
        from batteries.critic import RulesJudge, SupportsQuietUntil, WatchCritic

        def monitor(critic: Any) -> Any:
            return critic.monitor(RunInfo(), None, backstop=None, max_steps=None,
                                  events=lambda kind, **kw: None)

        scripted, watch = monitor(ScriptedCritic()), monitor(WatchCritic())
        for proto in (SupportsToolEnd, SupportsProcesses):
            assert isinstance(scripted, proto), proto
        for proto in (SupportsToolEnd, SupportsProcesses, SupportsNextLook, SupportsAttach,
                      SupportsStepEnd):
            assert isinstance(watch, proto), proto
            assert proto.__name__ in kernel.__all__
        watch.stop()
        assert isinstance(RulesJudge(), SupportsQuietUntil)

    async def test_the_kernel_uses_each_capability(self, autojump_clock: trio.abc.Clock) -> None:
        """Tools run, nudges arrive mid-step, snapshots are saved, a dry run simulates."""
        agent = Everything()
        checkpoints = RecordingCheckpointer()
        critic = ScriptedCritic(steer_after={1.0: "try again"})
        result = await Kernel(Ports(critic=critic, checkpointer=checkpoints)).run(
            agent, RunInfo(name="all"), Limits(poll_interval=0.5))
        assert result.status is Status.OK
        assert {"tools", "on_steer", "snapshot"} <= set(agent.used)
        dry = await Kernel().run(Everything(), RunInfo(), Limits(dry_run=True))
        assert dry.status is Status.DRY_RUN and dry.output == "would echo"


class TestLookedUpOneWay:
    async def test_a_member_set_to_none_is_absent(self, autojump_clock: trio.abc.Clock) -> None:
        """`snapshot = None` means no snapshots, not a failure, as getattr-checking hosts expect."""
        agent = Everything()
        agent.snapshot = None  # type: ignore[method-assign,assignment]
        checkpoints = RecordingCheckpointer()
        result = await Kernel(Ports(checkpointer=checkpoints)).run(agent, RunInfo())
        assert result.status is Status.OK and result.port_failures == []
        assert checkpoints.saves == []

    async def test_a_malformed_agent_capability_ends_the_run_error(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Tools that are not a mapping end the run `error` before a step, naming the agent."""
        agent = Everything()
        agent.tools = ["echo"]  # type: ignore[assignment]
        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit)).run(agent, RunInfo())
        assert result.status is Status.ERROR and result.steps == 0
        assert result.error == "agent Everything.tools is list, not a mapping of name to tool"
        assert "error" in audit.kinds(result.run_id)

    async def test_a_capability_that_is_not_callable_is_named(
            self, autojump_clock: trio.abc.Clock) -> None:
        """`on_steer = "yes"` is reported as such, not as a crash mid-run."""
        agent = Everything()
        agent.on_steer = "yes"  # type: ignore[method-assign,assignment]
        result = await Kernel().run(agent, RunInfo())
        assert result.status is Status.ERROR
        assert result.error == "agent Everything.on_steer is str, not callable"

    async def test_a_malformed_handle_capability_drops_the_critic(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A handle whose `next_look` is not callable: the critic is dropped, the run goes on."""

        class Odd(ScriptedCritic):
            def monitor(self, *args: Any, **kw: Any) -> ScriptedHandle:
                handle = super().monitor(*args, **kw)
                handle.next_look = 3.0  # type: ignore[attr-defined]
                return handle

        result = await Kernel(Ports(critic=Odd())).run(Everything(), RunInfo())
        assert result.status is Status.OK
        [failure] = result.port_failures
        assert (failure.port, failure.method) == ("critic", "monitor")
        assert "critic handle ScriptedHandle.next_look is float, not callable" in failure.error

    async def test_a_slotted_handle_class_shares_one_lookup(self) -> None:
        """A handle whose members resolve on its class (WatchHandle: slots, plain methods) gets
        the class's functions, one lookup shared by every handle of the class; a handle with
        members of its own (an instance attribute) still has those called."""
        from batteries.critic import WatchCritic
        from kernel._capabilities import handle_capabilities

        def monitor(critic: Any) -> Any:
            return critic.monitor(RunInfo(), None, backstop=None, max_steps=None,
                                  events=lambda kind, **kw: None)

        critic = WatchCritic()
        one, two = monitor(critic), monitor(critic)
        caps = handle_capabilities(one)
        assert handle_capabilities(two) is caps
        assert caps.next_look is type(one).next_look
        woken: list[str] = []
        assert caps.attach is not None
        caps.attach(one, lambda: woken.append("one"))
        assert one._wake is not None and two._wake is None

        scripted = monitor(ScriptedCritic())
        scripted.next_look = lambda: 42.0
        own = handle_capabilities(scripted)
        assert own.next_look is not None and own.next_look(scripted) == 42.0
        assert handle_capabilities(monitor(ScriptedCritic())).next_look is None
        one.stop()
        two.stop()
