"""Helper processes for the multi-process audit tests (run as scripts, not collected).

    python audit_procs.py writer DB RUNS EVENTS TAG   kernel runs into DB via DuckDBAudit
    python audit_procs.py reader DB STOPFILE          query DB every 100 ms until STOPFILE exists
    python audit_procs.py hold DB                     hold DB open read-write until stdin closes
    python audit_procs.py hold-journal FILE           hold FILE's write lock until stdin closes

Each prints one JSON line on stdout describing what it did.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import trio

from batteries.audit import DuckDBAudit, Store
from kernel import Kernel, Limits, Ports, RunInfo, Status, Step
from kernel.testing import ScriptedAgent


async def writer(db: str, runs: int, events: int, tag: str) -> dict[str, object]:
    """Run `runs` kernel runs of `events` audit events each (run_start + steps + run_end)."""
    steps = events - 2
    failures: list[str] = []
    t0 = time.monotonic()
    async with DuckDBAudit.open(db) as audit:
        kernel = Kernel(Ports(audit=audit))
        for i in range(runs):
            agent = ScriptedAgent([Step(output=i)] * (steps - 1)
                                  + [Step(output=f"{tag}-{i}", final=True)])
            result = await kernel.run(agent, RunInfo(name=f"{tag}-{i}", subject_id=tag),
                                      Limits(max_steps=steps + 1, timeout=600))
            if result.status is not Status.OK or result.port_failures:
                failures.append(f"{result.status}: {[str(f) for f in result.port_failures]}")
    return {"tag": tag, "runs": runs, "failures": failures,
            "seconds": round(time.monotonic() - t0, 2), "unwritten": audit.unwritten}


def reader(db: str, stopfile: str) -> dict[str, object]:
    """Count runs and events every 100 ms (each read syncs the analysts' file from the
    journal first); report reads, errors and the longest wait."""
    store = Store(db)
    reads, errors, longest, last = 0, [], 0.0, (0, 0)
    monotonic = True
    while not Path(stopfile).exists() or reads < 5:  # writers may finish before 5 reads
        t0 = time.monotonic()
        try:
            with store.reader() as cur:
                n_runs, n_events = cur.execute(
                    "SELECT (SELECT count(*) FROM runs), (SELECT count(*) FROM events)"
                ).fetchall()[0]
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        else:
            reads += 1
            monotonic = monotonic and (n_runs, n_events) >= last
            last = (n_runs, n_events)
        longest = max(longest, time.monotonic() - t0)
        time.sleep(0.1)
    return {"reads": reads, "errors": errors, "longest_wait": round(longest, 3),
            "monotonic": monotonic, "last": last}


def hold(db: str) -> None:
    """Hold the file open read-write (locking everyone else out) until stdin closes."""
    import duckdb

    con = duckdb.connect(db)
    print(json.dumps({"held": db}), flush=True)
    sys.stdin.read()
    con.close()


def hold_journal(path: str) -> None:
    """Hold the journal's write lock (an open BEGIN IMMEDIATE) until stdin closes."""
    import sqlite3

    con = sqlite3.connect(path, isolation_level=None)
    con.execute("BEGIN IMMEDIATE")
    print(json.dumps({"held": path}), flush=True)
    sys.stdin.read()
    con.execute("ROLLBACK")
    con.close()


def main(argv: list[str]) -> None:
    mode, db, *rest = argv
    if mode == "writer":
        out = trio.run(writer, db, int(rest[0]), int(rest[1]), rest[2])
    elif mode == "reader":
        out = reader(db, rest[0])
    elif mode == "hold":
        hold(db)
        return
    elif mode == "hold-journal":
        hold_journal(db)
        return
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
