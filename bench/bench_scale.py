"""Many concurrent runs in one process: the kernel with the DuckDB audit and the critic
against bare trio tasks of the same shape, measured in the same run.

    python bench/bench_scale.py                     # 1,000 and 10,000 runs x 100 steps
    python bench/bench_scale.py --runs 1000 --steps 100 --repeat 1

For each N in --runs: N concurrent bare trio tasks, each yielding to trio
--steps times (the baseline), then N concurrent `Kernel.run`s of an agent
doing the same, with the audit (`JournalAudit`) and `WatchCritic` wired. The time is from
starting the first task until the last `Kernel.run` returned (each run's
recorder is closed, so its rows are durable, before its `run` returns).
Afterwards the database is read back: every run and every event must be
there, or the bench fails. Prints seconds (wall and this process's CPU, all
threads: the CPU figure moves less with other work on the machine), the
ratios to the baseline, and the ratio of the largest N's time to the smallest's,
for the kernel and for the bare tasks (plain trio is not linear either on every
machine: cache misses grow with the live tasks).

With `--repeat` above 1, each round's kernel time is also divided by the
bare tasks' time of the same round (run just before it) and the median of
those ratios printed: a figure the machine's drift between rounds moves
less than the ratio of two bests taken minutes apart.

After the table, the kernel's fastest round is split into the trio thread's
CPU, its idle time (waiting for I/O or timers: every task blocked; at the end
the runs wait for their last rows) and the rest (the trio thread ready but not
running: waiting for the GIL, or for a CPU).

`--gc-threshold A,B,C` runs both sides with those collector thresholds
(`gc.set_threshold`; the interpreter's are 700,10,10), the knob a host
running thousands of runs in one process has: the `gc s` columns show the
seconds each side spent in the collector (all threads, `gc.callbacks`).

A second part measures the process sampler: `--procs` real `sleep` processes
registered with one critic's `ProcessSampler` for `--sample-seconds`, and the
CPU the sampler's thread spent probing them, as a share of one core.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from bench_kernel import Counter  # the cheapest agent: one trio checkpoint per step

from kernel import Kernel, Limits, Ports, RunInfo


async def bare(runs: int, steps: int) -> tuple[float, float]:
    async def one() -> None:
        agent = Counter(steps)
        while not (await agent.step(None)).final:
            pass

    t0, c0 = time.perf_counter(), time.process_time()
    async with trio.open_nursery() as nursery:
        for _ in range(runs):
            nursery.start_soon(one)
    return time.perf_counter() - t0, time.process_time() - c0


class IOWait(trio.abc.Instrument):
    """Seconds the trio thread spent waiting for I/O or timers: every task was blocked
    (at the end, runs waiting for their last rows to be durable)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0 = 0.0

    def before_io_wait(self, timeout: float) -> None:
        self._t0 = time.perf_counter()

    def after_io_wait(self, timeout: float) -> None:
        self.seconds += time.perf_counter() - self._t0


@dataclass
class KernelSide:
    elapsed: float
    cpu: float  # the process, all threads
    trio_cpu: float  # the trio thread alone
    io_wait: float  # the trio thread idle (`IOWait`)
    done: int


async def kernel_runs(runs: int, steps: int, db: Path) -> KernelSide:
    from batteries.audit import JournalAudit
    from batteries.critic import WatchCritic

    limits = Limits(max_steps=None, timeout=3600)
    done = 0
    idle = IOWait()
    async with JournalAudit.open(db) as audit:
        kernel = Kernel(Ports(audit=audit, critic=WatchCritic()))

        async def one(i: int) -> None:
            nonlocal done
            result = await kernel.run(Counter(steps), RunInfo(name=f"r{i}"), limits)
            assert result.steps == steps, result
            done += 1

        trio.lowlevel.add_instrument(idle)
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        async with trio.open_nursery() as nursery:
            for i in range(runs):
                nursery.start_soon(one, i)
        side = KernelSide(time.perf_counter() - t0, time.process_time() - c0,
                          time.thread_time() - m0, idle.seconds, done)
        trio.lowlevel.remove_instrument(idle)
    return side


def committed(db: Path) -> tuple[int, int, int]:
    """(runs, events, runs whose event count differs from the first run's).

    The audit writes a journal beside `db`; `sync` copies it into the
    analysts' DuckDB file, which is then read back.
    """
    import duckdb

    from batteries.audit import sync

    sync(db)
    with duckdb.connect(str(db), read_only=True) as con:
        row = con.execute("SELECT count(*) FROM runs WHERE status = 'ok'").fetchone()
        runs = int(row[0]) if row else 0
        counts = con.execute(
            "SELECT run_id, count(*) FROM events GROUP BY run_id").fetchall()
    per = [int(c) for _, c in counts]
    events = sum(per)
    odd = sum(1 for c in per if c != per[0]) if per else 0
    return runs, events, odd


class CollectorTime:
    """Seconds spent in the garbage collector (any thread) while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0

    def __enter__(self) -> CollectorTime:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def scale(sizes: list[int], steps: int, repeat: int) -> None:
    print(f"{steps} steps per run, best of {repeat}; cpu: this process's CPU seconds "
          f"(all its threads), steadier than wall time on a shared machine; gc s: in the "
          f"collector (thresholds {','.join(map(str, gc.get_threshold()))})")
    print(f"{'runs':>7} {'bare s':>8} {'kernel s':>9} {'x bare':>7} {'us/run-step':>12} "
          f"{'bare cpu':>9} {'kernel cpu':>11} {'x cpu':>6} {'bare gc s':>10} "
          f"{'kernel gc s':>12} {'runs ok':>8} {'events':>9}")
    best_kernel: dict[int, float] = {}
    best_cpu: dict[int, float] = {}
    best_bare: dict[int, float] = {}
    breakdown: dict[int, tuple[float, float, float]] = {}
    paired: dict[int, list[float]] = {}  # each round's kernel / its own bare tasks
    for n in sizes:
        b = k = bc = kc = bg = kg = float("inf")
        ratios = paired[n] = []
        parts = (0.0, 0.0, 0.0)
        runs = events = odd = 0
        for _ in range(repeat):
            gc.collect()
            with CollectorTime() as collector:
                wall, cpu = trio.run(bare, n, steps)
            b, bc, bg = min(b, wall), min(bc, cpu), min(bg, collector.seconds)
            with tempfile.TemporaryDirectory() as tmp:
                db = Path(tmp) / "scale.duckdb"
                gc.collect()
                with CollectorTime() as collector:
                    side = trio.run(kernel_runs, n, steps, db)
                assert side.done == n, (side.done, n)
                runs, events, odd = committed(db)
                if runs != n or odd:
                    raise SystemExit(f"lost audit data: {runs}/{n} runs, {odd} runs with a "
                                     f"different event count")
            if side.elapsed < k:  # the fastest round's breakdown
                parts = (side.trio_cpu, side.io_wait,  # (clocks' granularity: >= 0)
                         max(0.0, side.elapsed - side.trio_cpu - side.io_wait))
            k, kc, kg = min(k, side.elapsed), min(kc, side.cpu), min(kg, collector.seconds)
            ratios.append(side.elapsed / wall)
        best_kernel[n], best_cpu[n], best_bare[n] = k, kc, b
        print(f"{n:>7} {b:>8.2f} {k:>9.2f} {k / b:>7.2f} {k / (n * steps) * 1e6:>12.2f} "
              f"{bc:>9.2f} {kc:>11.2f} {kc / bc:>6.2f} {bg:>10.2f} {kg:>12.2f} "
              f"{runs:>8} {events:>9}")
        breakdown[n] = parts
    print("the kernel's fastest round: wall = trio thread's CPU + trio idle (waiting for I/O: "
          "at the end, for the last rows) + the rest (the trio thread ready but not running: "
          "waiting for the GIL, or for a CPU)")
    for n in sizes:
        trio_cpu, io_wait, rest = breakdown[n]
        print(f"{n:>7} runs: {best_kernel[n]:.2f} s = {trio_cpu:.2f} trio cpu + {io_wait:.2f} "
              f"idle + {rest:.2f} rest")
    if repeat > 1:
        print("each round's kernel time over the bare tasks run just before it (drift on a "
              "shared machine moves both): median, and the rounds")
        for n in sizes:
            print(f"{n:>7} runs: {statistics.median(paired[n]):.2f}x  "
                  f"({', '.join(f'{r:.2f}' for r in paired[n])})")
    if len(sizes) > 1:
        lo, hi = min(sizes), max(sizes)
        print(f"time for {hi} runs / time for {lo} runs: {best_kernel[hi] / best_kernel[lo]:.2f} "
              f"(cpu: {best_cpu[hi] / best_cpu[lo]:.2f}; x{hi / lo:g} the runs); bare trio "
              f"tasks on the same machine: {best_bare[hi] / best_bare[lo]:.2f}")


async def sample_cost(pids: list[int], seconds: float) -> tuple[float, int, float]:
    from batteries.critic import ProcessSampler

    sampler = ProcessSampler()
    seen = 0

    def sink(_: Any) -> None:
        nonlocal seen
        seen += 1

    t0 = time.perf_counter()
    for pid in pids:
        sampler.register(pid, sink)
    await trio.sleep(seconds)
    wall = time.perf_counter() - t0
    for pid in pids:
        sampler.unregister(pid, sink)
    return sampler.cost_s / wall, sampler.samples, seen / max(1, len(pids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="1000,10000", help="comma-separated run counts")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--procs", type=int, default=1000,
                        help="processes for the sampler part (0 skips it)")
    parser.add_argument("--sample-seconds", type=float, default=20.0)
    parser.add_argument("--gc-threshold", default=None, metavar="A,B,C",
                        help="collector thresholds for both sides (default: the interpreter's)")
    args = parser.parse_args()
    if args.gc_threshold:
        try:
            young, middle, old = (int(x) for x in args.gc_threshold.split(","))
        except ValueError:
            parser.error(f"--gc-threshold wants three integers A,B,C, got {args.gc_threshold!r}")
        gc.set_threshold(young, middle, old)
    scale([int(x) for x in args.runs.split(",") if x], args.steps, args.repeat)
    if args.procs:
        children = [subprocess.Popen(["sleep", "3600"]) for _ in range(args.procs)]
        try:
            share, rounds, per_proc = trio.run(sample_cost, [c.pid for c in children],
                                               args.sample_seconds)
        finally:
            for c in children:
                c.kill()
            for c in children:
                c.wait()
        print(f"process sampler: {args.procs} processes for {args.sample_seconds:g}s: "
              f"{rounds} sampling rounds, {per_proc:.1f} samples per process, "
              f"{share * 100:.2f}% of one core")


if __name__ == "__main__":
    main()
