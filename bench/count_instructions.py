"""Instructions per run, counted by callgrind: a figure the machine's load does not move.

    python bench/count_instructions.py --ports audit,critic --steps 10 --runs 100,200
    python bench/count_instructions.py --ports critic --steps 100 --runs 50,100 --concurrent
    python bench/count_instructions.py --ports bare --steps 100 --runs 50,100 --concurrent

Runs the measured section (N runs of an agent that yields to trio once per
step, one after another or all at once) under `valgrind --tool=callgrind`
for each of the two run counts, and prints the difference in instructions
divided by the difference in runs: the cost of one run (and of one run-step),
start-up and imports cancelled out. All threads are counted (the journal's
writes included). `--ports` is `bare` (plain trio tasks, no kernel), `none`
(`Kernel(Ports())`), or a comma-separated choice of `audit` (the journal
audit in a temporary directory), `critic` (`WatchCritic()`) and `checkpoint`
(a durable checkpoint after every step, `JournalCheckpointer` on the audit's
journal, each run registered first: `bench/bench_langgraph.py`'s shape).

Instruction counts leave out what a busy machine adds (cache misses, thread
switches), so they compare two builds of the same code path, not absolute
speed: run it on each build (e.g. `git stash`) and compare.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio
from bench_kernel import Counter as _Counter

from kernel import Kernel, Limits, Ports, RunInfo


class Counter(_Counter):
    """bench_kernel's agent (one trio checkpoint per step), with resumable state."""

    def snapshot(self) -> dict[str, Any]:
        """Its resumable state (what `--ports checkpoint` saves after every step)."""
        return {"state": "count", "left": self.n}


async def section(ports: set[str], runs: int, steps: int, concurrent: bool, db: Path) -> None:
    """The measured section: one warm-up run, then `runs` runs."""
    from batteries.audit import JournalAudit
    from batteries.checkpoint import JournalCheckpointer
    from batteries.critic import WatchCritic

    limits = Limits(max_steps=None, timeout=3600)
    spec = {"agent": {"kind": "bench"}, "info": {}, "limits": {}}
    async with JournalAudit.open(db) as audit:
        cp = JournalCheckpointer(audit.journal) if "checkpoint" in ports else None
        kernel = Kernel(Ports(audit=audit if "audit" in ports else None,
                              critic=WatchCritic() if "critic" in ports else None,
                              checkpointer=cp))

        async def one(i: int) -> None:
            if "bare" in ports:
                agent = Counter(steps)
                while not (await agent.step(None)).final:
                    pass
            else:
                info = RunInfo(name=f"r{i}")
                if cp is not None:
                    await cp.register(info.run_id, spec)
                await kernel.run(Counter(steps), info, limits)

        await one(-1)
        if concurrent:
            async with trio.open_nursery() as nursery:
                for i in range(runs):
                    nursery.start_soon(one, i)
        else:
            for i in range(runs):
                await one(i)


def count(args: argparse.Namespace, runs: int) -> int:
    """Instructions of this script's section for `runs` runs, under callgrind."""
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
           __file__, "--section", "--ports", args.ports, "--steps", str(args.steps),
           "--runs", str(runs)] + (["--concurrent"] if args.concurrent else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    found = re.search(r"Collected : (\d+)", out)
    if found is None:
        raise SystemExit(f"no instruction count in callgrind's output:\n{out[-2000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ports", default="audit,critic",
                        help="bare, none, or a comma-separated choice of audit, critic, "
                        "checkpoint")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--runs", default="100,200", help="two run counts, comma-separated")
    parser.add_argument("--concurrent", action="store_true",
                        help="start the runs all at once (default: one after another)")
    parser.add_argument("--section", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    ports = set(args.ports.split(","))
    if args.section:
        with tempfile.TemporaryDirectory() as tmp:
            trio.run(section, ports, int(args.runs), args.steps, args.concurrent,
                     Path(tmp) / "count.duckdb")
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    lo, hi = (int(x) for x in args.runs.split(","))
    per_run = (count(args, hi) - count(args, lo)) / (hi - lo)
    shape = "concurrent" if args.concurrent else "one after another"
    print(f"ports={args.ports} steps={args.steps} runs={lo},{hi} ({shape}): "
          f"{per_run:,.0f} instructions per run, {per_run / args.steps:,.0f} per run-step")


if __name__ == "__main__":
    main()
