"""Audit ingest end to end (journal, then the analysts' DuckDB file), against a raw Arrow
batch insert into DuckDB measured in the same run.

    python bench/bench_audit.py [--events N] [--runs R] [--batch B] [--best-of K]

Both ingest paths are run K times, alternating, each into a fresh file, and
the best of each is reported: the machine is shared, and the best run is the
one least disturbed by whatever else was running.

1. raw: a prebuilt Arrow table of N events inserted into a fresh file in
   batches of B, each committed, on one open connection (the ceiling).
2. audit: the same number of events through `JournalAudit` recorder calls
   (on_tool / log_event / on_step over R interleaved runs, yielding to trio
   every 1,000 calls as a kernel loop would), timed from the first call until
   every run's `close` has returned, i.e. until the rows are committed to
   the journal (SQLite).
3. sync: the last audit's journal copied into its analysts' DuckDB file
   (`batteries.audit.sync`: sqlite3 reads, Arrow batches of 100k events).
4. query: p95 latency by tool over the audit's file (N events), warm,
   straight from the typed column and through the `tool_stats` view, and the
   same p95 computed from a duration inside the JSON payload, for contrast.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import trio

from batteries.audit import DuckDBAudit
from batteries.audit._schema import EVENT_COLUMNS, migrate
from kernel import RunInfo, RunStats, Status, Step, ToolCall, ToolResult

TOOLS = ("grep", "ls", "read_file", "write_file", "http_get", "python", "search")


def raw_insert(path: Path, n: int, batch: int) -> float:
    """Insert n prebuilt events in committed batches; return events/s."""
    import duckdb
    import pyarrow as pa  # type: ignore[import-untyped, unused-ignore]

    ts0 = time.time_ns() // 1000
    table = pa.Table.from_arrays([
        pa.array([f"{i // 1000:032x}" for i in range(n)], pa.string()),
        pa.array([i % 1000 for i in range(n)], pa.int32()),
        pa.array([ts0 + i for i in range(n)], pa.timestamp("us", tz="UTC")),
        pa.array(["tool_end"] * n, pa.string()),
        pa.array([i % 1000 // 3 for i in range(n)], pa.int32()),
        pa.array([TOOLS[i % len(TOOLS)] for i in range(n)], pa.string()),
        pa.array([float(i % 997) for i in range(n)], pa.float64()),
        pa.array([json.dumps({"output": f"result {i}", "error": None}, separators=(",", ":"))
                  for i in range(n)], pa.string()),
    ], names=list(EVENT_COLUMNS))
    con = duckdb.connect(str(path))
    migrate(con)
    cols = ", ".join(EVENT_COLUMNS)
    t0 = time.perf_counter()
    for start in range(0, n, batch):
        con.register("chunk", table.slice(start, batch))
        con.execute("BEGIN TRANSACTION")
        con.execute(f"INSERT INTO events ({cols}) SELECT {cols} FROM chunk")
        con.execute("COMMIT")
        con.unregister("chunk")
    elapsed = time.perf_counter() - t0
    con.close()
    return n / elapsed


async def audit_ingest(path: Path, n: int, runs: int, batch: int) -> float:
    """Push n events through JournalAudit recorders until committed; return events/s."""
    per_run = n // runs
    # The kernel builds these objects for its own needs before it calls the
    # recorder; building them here would time the benchmark, not the audit.
    calls = [ToolCall(t, {"path": f"/tmp/{t}"}) for t in TOOLS]
    results = [ToolResult(calls[i % len(calls)], output=f"result {i}",
                          duration_s=(i % 997) / 1000) for i in range(1000)]
    step = Step(output="thinking...")
    async with DuckDBAudit.open(path, batch_size=batch) as audit:
        t0 = time.perf_counter()
        recs = [await audit.start_run(RunInfo(name=f"bench-{r}", subject_id="bench"))
                for r in range(runs)]
        sent = runs  # each run_start is an event
        i = 0
        while sent < n - runs:  # leave room for each run_end
            rec = recs[i % runs]
            kind = i % 4
            if kind == 0:
                call = calls[i % len(calls)]
                rec.log_event("tool_start", name=call.name, payload={"args": call.args},
                              iteration=i)
            elif kind in (1, 2):
                rec.on_tool(results[i % 1000], i)
            else:
                rec.on_step(i, step, 0.01)
            sent += 1
            i += 1
            if i % 1000 == 0:
                await trio.lowlevel.checkpoint()
        # The runs end together (as concurrent runs in one host do), so their
        # closes share the final flush.
        async with trio.open_nursery() as nursery:
            for rec in recs:
                nursery.start_soon(rec.close, RunStats(Status.OK, steps=per_run // 4))
        elapsed = time.perf_counter() - t0
    return n / elapsed


def query_p95(path: Path, repeat: int) -> dict[str, float]:
    """Warm p95-by-tool timings (ms, median of `repeat`) on an open connection."""
    import duckdb

    con = duckdb.connect(str(path), read_only=True)
    queries = {
        "typed column": "SELECT name, quantile_cont(duration_ms, 0.95) FROM events "
                        "WHERE kind = 'tool_end' GROUP BY name",
        "tool_stats view": "SELECT tool, p95_ms FROM tool_stats",
        "from JSON payload": "SELECT name, quantile_cont((payload ->> 'ms')::DOUBLE, 0.95) "
                             "FROM events WHERE kind = 'tool_end' GROUP BY name",
    }
    out = {}
    for label, sql in queries.items():
        con.execute(sql).fetchall()  # warm
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            con.execute(sql).fetchall()
            times.append((time.perf_counter() - t0) * 1000)
        out[label] = statistics.median(times)
    con.close()
    return out


def add_json_durations(path: Path) -> None:
    """Copy each tool_end duration into its payload (for the JSON contrast query only)."""
    import duckdb

    con = duckdb.connect(str(path))
    con.execute("UPDATE events SET payload = json_merge_patch(payload, "
                "json_object('ms', duration_ms)) WHERE kind = 'tool_end'")
    con.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--best-of", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10, help="query repetitions")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        raws, ingests = [], []
        for k in range(args.best_of):
            raw_path, audit_path = Path(tmp) / f"raw{k}.duckdb", Path(tmp) / f"audit{k}.duckdb"
            raws.append(raw_insert(raw_path, args.events, args.batch))
            ingests.append(trio.run(audit_ingest, audit_path, args.events, args.runs,
                                    args.batch))
            raw_path.unlink()
        raw, ingest = max(raws), max(ingests)
        print(f"events: {args.events:,}, batch: {args.batch:,}, runs: {args.runs}, "
              f"best of {args.best_of}")
        print(f"{'path':<46}{'events/s':>12}{'x raw':>8}")
        print(f"{'raw Arrow batch insert (ceiling)':<46}{raw:>12,.0f}{1:>8.2f}")
        print(f"{'JournalAudit, recorder call -> committed':<46}{ingest:>12,.0f}"
              f"{ingest / raw:>8.2f}")
        print(f"  all runs, raw: {', '.join(f'{x:,.0f}' for x in raws)}; "
              f"audit: {', '.join(f'{x:,.0f}' for x in ingests)}")
        from batteries.audit import sync

        synced = sync(audit_path)
        rate = synced.events / synced.seconds
        print(f"{'sync: journal -> analysts file (Arrow)':<46}{rate:>12,.0f}{rate / raw:>8.2f}")
        add_json_durations(audit_path)
        p95 = query_p95(audit_path, args.repeat)
        print(f"p95 by tool over {args.events:,} events, warm, median of {args.repeat}:")
        for label, ms in p95.items():
            print(f"  {label:<44}{ms:>8.1f} ms")


if __name__ == "__main__":
    main()
