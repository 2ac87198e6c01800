"""A host program that uses every package of the kernel, checked with `mypy --strict`.

    python examples/typed_host.py [DB_PATH]          run a command, audited and supervised
    python examples/typed_host.py --cli ARGS...      hand the arguments to the `kernel` CLI

Every package ships `py.typed`, so a host's type checker sees the kernel's
own annotations: `CriticPolicy(idle_timeout="soon")` is an error in the
host's code, not a surprise at run time. tests/test_typed.py type-checks
this file from outside the source tree, against the installed wheel.
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
from kernel import Agent, Kernel, Limits, Ports, Result, RunInfo, Status
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
