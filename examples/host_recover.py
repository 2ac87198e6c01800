"""A host that runs a loop, is stopped by SIGTERM, and recovers the run: the library alone.

    python examples/host_recover.py run DB_PATH WORK_DIR   # count to six; SIGTERM stops it
    python examples/host_recover.py recover DB_PATH        # resume what a SIGTERM left

`run` writes a loop that counts to six, one state at a time, appending a line
to WORK_DIR/ticks per state, and runs it through `batteries.runner.run_spec`
under the CLI's signal policy: SIGTERM (a shutdown) cancels the run and
leaves its checkpoint to resume; Ctrl-C would end it for good. `recover`
resumes every interrupted run with `batteries.recovery.Recovery`, building
agents with `adapters.agent_from_spec`. Each prints one JSON line: what
happened, and whether `kernel_cli` (the CLI package) was ever imported.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import trio

from adapters import agent_from_spec, stop_leftover_group
from batteries.recovery import Recovery
from batteries.runner import SignalPolicy, run_spec
from kernel import Agent, Limits, LoopSpec, PortSpec, RunSpec

LOOP = """\
name: count-to-six
initial: count
max_iterations: 40
timeout: 120
states:
  count:
    action: echo tick >> ${context.marker}; sleep 0.3; expr ${captured.n.output:default=0} + 1
    capture: n
    evaluate:
      type: output_numeric
      operator: ge
      target: 6
    route:
      yes: done
      no: count
  done:
    terminal: true
"""


def prepare(db: Path, work: Path) -> tuple[RunSpec, Agent]:
    """The loop's spec (what, who, bounds, ports, where) and its agent."""
    work.mkdir(parents=True, exist_ok=True)
    loop = work / "count.yaml"
    loop.write_text(LOOP)
    what = LoopSpec(str(loop.resolve()), context={"marker": str((work / "ticks").resolve())})
    built = agent_from_spec(what, cwd=str(work))
    spec = RunSpec(what, built.info, built.limits or Limits(),
                   PortSpec(db=str(db), no_critic=True), cwd=str(work.resolve()))
    return spec, built.agent


async def run(spec: RunSpec, agent: Agent) -> dict[str, Any]:
    """Run the loop once; a SIGTERM ends it `cancelled`, resumable."""
    result = await run_spec(spec, agent, signals=SignalPolicy())
    return {"run_id": result.run_id, "status": str(result.status), "steps": result.steps}


def build(spec: RunSpec) -> Agent:
    """How the recovery rebuilds an agent: the adapters' builder, nothing of the CLI's."""
    return agent_from_spec(spec).agent


async def recover(db: Path) -> list[dict[str, Any]]:
    """Resume every interrupted run in the store."""
    recovery = Recovery(db, build=build, stop_group=stop_leftover_group)
    return [{"run_id": done.run_id, "from_step": done.steps,
             "status": str(done.result.status) if done.result else None,
             "output": done.result.output if done.result else None, "why": done.why}
            for done in await recovery.recover(signals=SignalPolicy())]


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "run":
        doc: dict[str, Any] = trio.run(run, *prepare(Path(argv[1]), Path(argv[2])))
    elif len(argv) == 2 and argv[0] == "recover":
        doc = {"recovered": trio.run(recover, Path(argv[1]))}
    else:
        print(__doc__, file=sys.stderr)
        return 2
    doc["kernel_cli_imported"] = any(m.split(".")[0] == "kernel_cli" for m in sys.modules)
    print(json.dumps(doc, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
