"""A host program that uses every package of the kernel, checked with `mypy --strict`.

    python examples/typed_host.py [DB_PATH]          run a command, audited and supervised
    python examples/typed_host.py --cli ARGS...      hand the arguments to the `kernel` CLI

Every package ships `py.typed`, so a host's type checker sees the kernel's
own annotations: `CriticPolicy(idle_timeout="soon")` is an error in the
host's code, not a surprise at run time, and so is an agent's optional
capability (`snapshot`, `on_steer`, ...) written with the wrong signature.
tests/test_typed.py type-checks this file from outside the source tree,
against the installed wheel.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import trio

from adapters.agentcli import CLIAgent
from adapters.llm import ChatClient, LLMAgent
from adapters.loop import LoopAgent, load_loop
from adapters.pane import PaneAgent, TmuxMultiplexer
from adapters.shell import ShellAgent
from batteries.audit import DuckDBAudit
from batteries.critic import CriticPolicy, WatchCritic
from batteries.delivery import DirectoryDelivery
from kernel import (
    Agent,
    Kernel,
    Limits,
    Message,
    Ports,
    Result,
    RunContext,
    RunInfo,
    Status,
    Step,
    SupportsSnapshot,
    SupportsSteer,
)
from kernel_cli.app import main as kernel_main


def pick_agent(kind: str, workdir: Path) -> Agent:
    """The agent for `kind`: the program's way of showing every adapter's constructor."""
    if kind == "llm":
        return LLMAgent("gpt-4o-mini", "say hi", client=ChatClient("http://127.0.0.1:8000/v1"))
    if kind == "loop":
        return LoopAgent(load_loop(workdir / "loop.yaml"))
    if kind == "agentcli":
        return CLIAgent(["my-agent", "--json"])
    if kind == "pane":
        return PaneAgent("main:0.0", "say hi", TmuxMultiplexer())
    return ShellAgent(["echo", "hello from the host"])


class Tally(SupportsSnapshot, SupportsSteer):
    """The host's own agent: counts to three, resumable, and takes nudges mid-step.

    Inheriting the capability Protocols has mypy check each method against
    the kernel's contract (an `on_steer` that is not async is reported).
    """

    def __init__(self) -> None:
        self.count = 0
        self.nudges: list[str] = []

    async def step(self, ctx: RunContext) -> Step:
        if ctx.iteration == 0 and isinstance(ctx.resumed_from, dict):
            self.count = int(ctx.resumed_from.get("count", 0))
        self.count += 1
        return Step(output=self.count, final=self.count >= 3)

    def snapshot(self) -> dict[str, int]:
        return {"count": self.count}

    async def on_steer(self, messages: list[Message]) -> None:
        self.nudges.extend(m.content for m in messages)


def nudgeable(workdir: Path) -> list[SupportsSteer]:
    """The agents that take critic nudges during a step (checked structurally)."""
    return [Tally(), ShellAgent(["sleep", "1"]), CLIAgent(["my-agent", "--json"]),
            PaneAgent("main:0.0", "say hi", TmuxMultiplexer())]


def resumable(workdir: Path) -> list[SupportsSnapshot]:
    """The agents a checkpoint can resume."""
    return [Tally(), LoopAgent(load_loop(workdir / "loop.yaml"))]


async def run(db: Path) -> Result:
    """Run one supervised, audited command and deliver its result to a folder."""
    critic = WatchCritic(CriticPolicy(idle_timeout=30.0))
    delivery = DirectoryDelivery(db.parent / "results")
    async with DuckDBAudit.open(db) as audit:
        ports = Ports(audit=audit, critic=critic, delivery=delivery)
        return await Kernel(ports).run(pick_agent("shell", db.parent), RunInfo(name="host"),
                                       Limits(max_steps=5, timeout=30))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--cli"]:
        kernel_main(sys.argv[2:])
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "k.duckdb"
    result = trio.run(run, target)
    print(f"status={result.status} output={result.output!r}")
    sys.exit(0 if result.status is Status.OK else 1)
