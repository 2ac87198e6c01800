"""A host wiring the batteries itself: a tool-using agent, audited and supervised.

    python examples/library_host.py [DB_PATH]

The agent "researches" by calling a `lookup` tool; on its third step it
starts repeating the same call, as stuck agents do. The watch critic nudges
it, sees it carry on, and kills the run `looping`. Everything lands in the
journal beside DB_PATH; the script then reads the DuckDB file fed from it,
as an analyst would.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import trio

from batteries.audit import JournalAudit, Store
from batteries.critic import CriticPolicy, WatchCritic
from kernel import Kernel, Limits, Ports, RunContext, RunInfo, Status, Step, ToolCall


class Researcher:
    """Looks up a few topics, then gets stuck looking up the same one."""

    def __init__(self) -> None:
        self.topics = ["trio", "duckdb"]
        self.tools = {"lookup": self.lookup}
        self.nudges: list[str] = []

    async def lookup(self, topic: str) -> str:
        await trio.sleep(0.01)  # a real tool would do I/O here
        return f"notes on {topic}"

    async def step(self, ctx: RunContext) -> Step:
        self.nudges += [m.content for m in ctx.steer]  # the critic's nudges arrive here
        topic = self.topics.pop(0) if self.topics else "trio"  # ...and now it loops
        return Step(tool_calls=[ToolCall("lookup", {"topic": topic})])


async def main(db: Path) -> int:
    critic = WatchCritic(CriticPolicy(loop_repeats=3))
    async with JournalAudit.open(db) as audit:
        agent = Researcher()
        result = await Kernel(Ports(audit=audit, critic=critic)).run(
            agent, RunInfo(name="research", subject_id="researcher"),
            Limits(max_steps=50, timeout=60))
    print(f"status={result.status} reason={result.reason} steps={result.steps}")
    print(f"nudged with: {agent.nudges[:1]}")
    with Store(db).reader() as con:
        rows = con.execute("SELECT decision, reason FROM critic_decisions WHERE run_id = ? "
                           "ORDER BY seq", [result.run_id]).fetchall()
    print("critic decisions:", rows)
    return 0 if result.status is Status.KILLED and result.reason == "looping" else 1


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "k.duckdb"
    sys.exit(trio.run(main, target))
