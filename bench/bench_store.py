"""What one store transaction costs: the embedded journal (SQLite) against PostgreSQL,
measured in the same run.

    python bench/bench_store.py [--commits N] [--procs P] [--url postgresql://...]

Without --url a PostgreSQL server is started for the run (tests/pg_server.py,
fsync on: what a real server pays) and stopped after. PostgreSQL is measured
twice: as configured (`synchronous_commit=on`: every commit waits for its
fsync) and with `synchronous_commit=off` for the connection ("PG async": a
commit survives the death of the writing process, as the journal's default
`synchronous=NORMAL` does, but not a crash of the server's machine). Two
transactions, the ones a run makes:

- open: a run registering (RegisterRun), its budget check-and-reserve
  (ReserveBudget against a budget) and its `run_start` row;
- save: a checkpoint after a step (SaveCheckpoint) carrying the step's 4 events.

Each is committed N times from one process (`RunStore.commit` called
directly, no trio): the median wall time a commit takes, and this process's
CPU seconds per commit (all threads; a shared machine's load does not
inflate it the way it inflates wall time). For PostgreSQL also the CPU of
the server process serving the connection, per commit (psutil). Then P
processes commit saves at once: commits per second in total (SQLite's
writers take turns on one lock; PostgreSQL's commit side by side and share
fsyncs).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from batteries.store import (
    Batch,
    Owner,
    RegisterRun,
    ReserveBudget,
    RunStore,
    SaveCheckpoint,
    SetBudget,
    SQLiteStore,
)
from kernel import Checkpoint, RunInfo

ROOT = Path(__file__).resolve().parent.parent


class _Rec:
    """A recorder as the store sees it (`batteries.store._types.RecorderRef`)."""

    def __init__(self, run_id: str, count: int) -> None:
        self.run_id = run_id
        self.info = RunInfo(run_id=run_id, name="bench", caller_id="bench")
        self.started_us = time.time_ns() // 1000
        self.count = count
        self.base: int | None = None
        self.host = "bench"
        self.pid = os.getpid()


def _open_batch(rec: _Rec) -> Batch:
    b = Batch()
    b.new.append(rec)
    return b


def _step_batch(rec: _Rec, first: int) -> Batch:
    b = Batch()
    for i in range(4):
        b.recs.append(rec)
        b.seqs.append(first + i)
        b.ts.append(time.time_ns() // 1000)
        b.kinds.append(("step", "tool_start", "tool_end", "checkpoint")[i])
        b.iters.append(first // 4)
        b.names.append("grep")
        b.durs.append(1.5)
        b.payloads.append('{"args":{"pattern":"x"},"result":"some output line"}')
    return b


def _make(kind: str, where: str) -> RunStore:
    if kind == "sqlite":
        return SQLiteStore(Path(where) / "bench.duckdb.journal")
    from batteries.store import PostgresStore

    return PostgresStore(where)


def _backend_cpu(store: Any) -> float:
    """CPU seconds of the server process serving this store's connection (nan: SQLite)."""
    con = getattr(store, "_con", None)
    if con is None or not hasattr(con, "info"):
        return float("nan")
    t = psutil.Process(con.info.backend_pid).cpu_times()
    return float(t.user + t.system)


def one_process(kind: str, where: str, n: int, tag: str) -> dict[str, float]:
    """N opens then N saves from this process: median wall and CPU per commit."""
    store = _make(kind, where)
    me = Owner.me()
    store.commit(None, [SetBudget("bench", 86400, 10**9, None, None, None)])
    opens, saves = [], []
    server0 = _backend_cpu(store)
    cpu0 = time.process_time()
    for i in range(n):
        rec = _Rec(f"{tag}-{i:06}", 0)
        spec = {"agent": {"kind": "loop"}, "info": {}, "limits": {}}
        t = time.perf_counter()
        store.commit(_open_batch(rec), [RegisterRun(rec.run_id, spec, me),
                                        ReserveBudget("bench", rec.run_id)])
        opens.append(time.perf_counter() - t)
    cpu1 = time.process_time()
    rec = _Rec(f"{tag}-saver", 0)
    store.commit(_open_batch(rec), [RegisterRun(rec.run_id, {"s": 1}, me)])
    rec.count = 0
    for i in range(n):
        t = time.perf_counter()
        store.commit(_step_batch(rec, 4 * i),
                     [SaveCheckpoint(Checkpoint(rec.run_id, i + 1, {"state": i}), me)])
        saves.append(time.perf_counter() - t)
    cpu2 = time.process_time()
    server = _backend_cpu(store) - server0
    store.close()
    return {"open_ms": statistics.median(opens) * 1000,
            "open_cpu_ms": (cpu1 - cpu0) / n * 1000,
            "save_ms": statistics.median(saves) * 1000,
            "save_cpu_ms": (cpu2 - cpu1) / n * 1000,
            "server_cpu_ms": server / (2 * n) * 1000}


def _saver(kind: str, where: str, n: int, tag: str, ready: Any) -> None:
    store = _make(kind, where)
    me = Owner.me()
    rec = _Rec(f"{tag}-p{os.getpid()}", 0)
    store.commit(_open_batch(rec), [RegisterRun(rec.run_id, {"s": 1}, me)])
    ready.wait()  # every process connected and registered: go together
    for i in range(n):
        store.commit(_step_batch(rec, 4 * i),
                     [SaveCheckpoint(Checkpoint(rec.run_id, i + 1, {"state": i}), me)])
    store.close()


def many_processes(kind: str, where: str, procs: int, n: int) -> float:
    """P processes committing N saves each at once: total commits per second."""
    ctx = mp.get_context("spawn")
    ready = ctx.Barrier(procs + 1)
    ps = [ctx.Process(target=_saver, args=(kind, where, n, f"m{i}", ready))
          for i in range(procs)]
    for p in ps:
        p.start()
    ready.wait()
    t = time.perf_counter()
    for p in ps:
        p.join()
    return procs * n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commits", type=int, default=2000)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--url", default=None, help="an existing server (default: start one)")
    args = ap.parse_args()
    n = args.commits
    with tempfile.TemporaryDirectory() as tmp:
        lite = one_process("sqlite", tmp, n, "s")
        lite_many = many_processes("sqlite", tmp, args.procs, n // 2)
    sys.path.insert(0, str(ROOT / "tests"))
    from pg_server import PgServer

    ctx: Any = None
    if args.url:
        pg_url = args.url
    else:
        ctx = PgServer.start(fsync=True)
        pg_url = ctx.__enter__().create_database("bench")
    # synchronous_commit=off: a commit survives the death of the writing process (like
    # the journal's default), not a crash of the server's machine.
    sep = "&" if "?" in pg_url else "?"
    async_url = f"{pg_url}{sep}options=-csynchronous_commit%3Doff"
    try:
        pg = one_process("postgres", pg_url, n, "p")
        pga = one_process("postgres", async_url, n, "a")
        pg_many = many_processes("postgres", pg_url, args.procs, n // 2)
        pga_many = many_processes("postgres", async_url, args.procs, n // 2)
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    print(f"{n} commits of each kind, one process; then {args.procs} processes x {n // 2} "
          f"saves at once")
    print(f"{'':34}{'SQLite journal':>15}{'PostgreSQL':>12}{'PG async':>10}")
    for key, label in (("open_ms", "run open: median wall ms"),
                       ("open_cpu_ms", "run open: client CPU ms"),
                       ("save_ms", "checkpoint save: median wall ms"),
                       ("save_cpu_ms", "checkpoint save: client CPU ms"),
                       ("server_cpu_ms", "server backend CPU ms/commit")):
        print(f"{label:<34}{lite[key]:>15.3f}{pg[key]:>12.3f}{pga[key]:>10.3f}")
    print(f"{f'{args.procs} processes: commits/s':<34}{lite_many:>15,.0f}{pg_many:>12,.0f}"
          f"{pga_many:>10,.0f}")


if __name__ == "__main__":
    main()
