"""10-step runs with every battery and a durable checkpoint per step, beside LangGraph.

    pip install -e '.[bench]'
    python bench/bench_langgraph.py [--runs N] [--repeat R]

Measured in one process, in turns, best of R rounds (drift on a shared
machine hits every variant alike):

- kernel + batteries: `Kernel.run` of a 10-step agent with the journal audit,
  the watch critic and a durable checkpoint after every step (the
  journal checkpointer; `synchronous=NORMAL`), all sharing one `Journal`
  as `kernel run` wires them; each run registered with a spec first.
- LangGraph + InMemorySaver / + SqliteSaver: a graph of one node looping
  10 times (a conditional edge back to itself), `invoke`d with a new
  thread_id per run, its saver checkpointing every super-step.
- bare trio: the same 10-step agent in a plain loop (the per-step baseline).

The rows above run one run at a time. Two more rows run `--concurrent` runs
at once (time per run = total / runs): the kernel (trio tasks; saves of runs
that finish a step together share one transaction: group commit) and
LangGraph + InMemorySaver (asyncio tasks, `ainvoke`). Group commit only helps
the concurrent row; the ratios are printed for both, each against LangGraph
run the same way.

Also printed: the durable checkpoint save on its own (p50/p99 of `save`
awaited from trio) and the per-step cost of the kernel with the audit and
critic but no checkpoint against a bare step, two ways: in 10-step runs
(each run's fixed costs, opening and closing it, spread over 10 steps) and
marginal, a step more in a long run ((100-step run - 10-step run) / 90, from
two more rows run with a fifth of the runs).
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypedDict

import trio

from kernel import Checkpoint, Kernel, Limits, Ports, RunInfo, Step

STEPS = 10
LONG = 100  # the long-run rows: per-step cost without the per-run fixed costs
_CONTINUE = Step()


class Counter:
    """A 10-step agent with resumable state (what a loop state or LLM turn looks like)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.done = 0

    async def step(self, ctx: Any) -> Step:
        await trio.lowlevel.checkpoint()
        self.done += 1
        if self.done == self.n:
            return Step(output=self.done, final=True)
        return _CONTINUE

    def snapshot(self) -> dict[str, Any]:
        return {"state": "count", "done": self.done}


SPEC = {"agent": {"kind": "bench"}, "info": {}, "limits": {}}


# ------------------------------------------------------------------ kernel


async def kernel_runs(tmp: Path, runs: int, *, checkpoint: bool = True,
                      steps: int = STEPS) -> float:
    """Seconds per run for `runs` kernel runs with every battery on one journal."""
    from batteries.audit import JournalAudit
    from batteries.checkpoint import JournalCheckpointer
    from batteries.critic import WatchCritic
    from batteries.store import Journal

    limits = Limits(max_steps=None, timeout=3600)
    async with Journal.open(tmp / f"k-{time.monotonic_ns()}.duckdb") as journal:
        cp = JournalCheckpointer(journal)
        ports = Ports(audit=JournalAudit(journal), critic=WatchCritic(),
                      checkpointer=cp if checkpoint else None)
        kernel = Kernel(ports)
        warm = RunInfo()
        await cp.register(warm.run_id, SPEC)
        await kernel.run(Counter(STEPS), warm, limits)  # warm: the journal exists
        t0 = time.perf_counter()
        for _ in range(runs):
            info = RunInfo(name="bench")
            if checkpoint:
                await cp.register(info.run_id, SPEC)
            result = await kernel.run(Counter(steps), info, limits)
            assert result.steps == steps and not result.port_failures, result
        return (time.perf_counter() - t0) / runs


async def kernel_concurrent(tmp: Path, runs: int, width: int) -> float:
    """Seconds per run for `runs` kernel runs, `width` at a time, every battery wired."""
    from batteries.audit import JournalAudit
    from batteries.checkpoint import JournalCheckpointer
    from batteries.critic import WatchCritic
    from batteries.store import Journal

    limits = Limits(max_steps=None, timeout=3600)
    async with Journal.open(tmp / f"c-{time.monotonic_ns()}.duckdb") as journal:
        cp = JournalCheckpointer(journal)
        kernel = Kernel(Ports(audit=JournalAudit(journal), critic=WatchCritic(),
                              checkpointer=cp))

        async def one() -> None:
            info = RunInfo(name="bench")
            await cp.register(info.run_id, SPEC)
            result = await kernel.run(Counter(STEPS), info, limits)
            assert result.steps == STEPS and not result.port_failures, result

        await one()  # warm: the journal exists
        t0 = time.perf_counter()
        for _ in range(runs // width):
            async with trio.open_nursery() as nursery:
                for _ in range(width):
                    nursery.start_soon(one)
        return (time.perf_counter() - t0) / (runs // width * width)


async def bare_runs(runs: int, steps: int = STEPS) -> float:
    t0 = time.perf_counter()
    for _ in range(runs):
        agent = Counter(steps)
        while not (await agent.step(None)).final:
            pass
    return (time.perf_counter() - t0) / runs


async def save_latencies(tmp: Path, n: int) -> list[float]:
    """Durations of `n` durable checkpoint saves (awaited from trio) on an open journal."""
    from batteries.checkpoint import JournalCheckpointer
    from batteries.store import Journal

    out = []
    async with Journal.open(tmp / "saves.duckdb") as journal:
        cp = JournalCheckpointer(journal)
        info = RunInfo()
        await cp.register(info.run_id, SPEC)
        await journal.transact()
        for i in range(n):
            checkpoint = Checkpoint(info.run_id, i, {"state": "count", "done": i})
            t0 = time.perf_counter()
            await cp.save(checkpoint)
            out.append(time.perf_counter() - t0)
    return out


# --------------------------------------------------------------- langgraph


class _State(TypedDict):
    n: int


def langgraph_runs(saver: Any, runs: int) -> float:
    """Seconds per run for `runs` invocations of a 10-super-step graph."""
    from langgraph.graph import END, START, StateGraph

    def count(state: _State) -> _State:
        return {"n": state["n"] + 1}

    def route(state: _State) -> str:
        return END if state["n"] >= STEPS else "count"

    graph = StateGraph(_State)
    graph.add_node("count", count)
    graph.add_edge(START, "count")
    graph.add_conditional_edges("count", route)
    app = graph.compile(checkpointer=saver)
    app.invoke({"n": 0}, {"configurable": {"thread_id": "warm"}})
    t0 = time.perf_counter()
    for i in range(runs):
        out = app.invoke({"n": 0}, {"configurable": {"thread_id": f"t{i}"}})
        assert out["n"] == STEPS
    return (time.perf_counter() - t0) / runs


def langgraph_concurrent(runs: int, width: int) -> float:
    """Seconds per run for `runs` invocations, `width` at a time (asyncio, `ainvoke`)."""
    import asyncio

    from langgraph.graph import END, START, StateGraph

    def count(state: _State) -> _State:
        return {"n": state["n"] + 1}

    def route(state: _State) -> str:
        return END if state["n"] >= STEPS else "count"

    graph = StateGraph(_State)
    graph.add_node("count", count)
    graph.add_edge(START, "count")
    graph.add_conditional_edges("count", route)
    app = graph.compile(checkpointer=in_memory())

    async def main() -> float:
        await app.ainvoke({"n": 0}, {"configurable": {"thread_id": "warm"}})
        t0 = time.perf_counter()
        for r in range(runs // width):
            outs = await asyncio.gather(*(
                app.ainvoke({"n": 0}, {"configurable": {"thread_id": f"t{r}-{i}"}})
                for i in range(width)))
            assert all(o["n"] == STEPS for o in outs)
        return (time.perf_counter() - t0) / (runs // width * width)

    return asyncio.run(main())


def in_memory() -> Any:
    from langgraph.checkpoint.memory import InMemorySaver

    return InMemorySaver()


def sqlite_saver(tmp: Path) -> Callable[[], Any]:
    def make() -> Any:
        from langgraph.checkpoint.sqlite import SqliteSaver

        con = sqlite3.connect(tmp / f"lg-{time.monotonic_ns()}.sqlite",
                              check_same_thread=False)
        return SqliteSaver(con)
    return make


# -------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--concurrent", type=int, default=100,
                        help="runs at once in the concurrent rows (0 skips them)")
    args = parser.parse_args()
    n, r, width = args.runs, args.repeat, args.concurrent
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        variants: list[tuple[str, Callable[[], float]]] = [
            ("kernel + audit + critic + checkpoint/step", lambda: trio.run(kernel_runs, tmp, n)),
            ("LangGraph + InMemorySaver", lambda: langgraph_runs(in_memory(), n)),
            ("LangGraph + SqliteSaver", lambda: langgraph_runs(sqlite_saver(tmp)(), n)),
            ("kernel + audit + critic (no checkpoint)",
             lambda: trio.run(lambda: kernel_runs(tmp, n, checkpoint=False))),
            ("bare trio loop", lambda: trio.run(bare_runs, n)),
            (f"kernel + audit + critic, {LONG} steps (no checkpoint)",
             lambda: trio.run(lambda: kernel_runs(tmp, n // 5 or 1, checkpoint=False,
                                                  steps=LONG))),
            (f"bare trio loop, {LONG} steps", lambda: trio.run(bare_runs, n // 5 or 1, LONG)),
        ]
        if width:
            variants += [
                (f"kernel, same, {width} runs at once",
                 lambda: trio.run(kernel_concurrent, tmp, max(n, width), width)),
                (f"LangGraph + InMemorySaver, {width} at once",
                 lambda: langgraph_concurrent(max(n, width), width)),
            ]
        best = {name: float("inf") for name, _ in variants}
        cpu: dict[str, float] = dict(best)
        for _ in range(r):
            for name, fn in variants:
                c0 = time.process_time()
                best[name] = min(best[name], fn())
                cpu[name] = min(cpu[name], time.process_time() - c0)
        saves = sorted(trio.run(save_latencies, tmp, 2000))
    ours = best[variants[0][0]]
    print(f"{STEPS}-step runs, {n} runs per round, best of {r} rounds")
    runs_of: dict[str, int] = {name: max(n, width) if "at once" in name else
                               (n // 5 or 1) if f"{LONG} steps" in name else n
                               for name, _ in variants}
    print("us/run: wall time per run; cpu us/run: this process's CPU per run (all threads,")
    print("set-up included), steadier than wall time on a loaded machine")
    print(f"{'variant':52} {'us/run':>10} {'us/step':>9} {'x kernel':>9} {'cpu us/run':>11}")
    for name, _ in variants:
        print(f"{name:52} {best[name] * 1e6:10.1f} {best[name] * 1e6 / STEPS:9.2f} "
              f"{best[name] / ours:9.2f} {cpu[name] / runs_of[name] * 1e6:11.1f}")
    p50, p99 = saves[len(saves) // 2], saves[int(len(saves) * 0.99)]
    print(f"durable checkpoint save (JournalCheckpointer.save, awaited): p50 {p50 * 1e6:.0f} us, "
          f"p99 {p99 * 1e6:.0f} us, mean {statistics.fmean(saves) * 1e6:.0f} us")
    bare = best["bare trio loop"]
    plain = best["kernel + audit + critic (no checkpoint)"]
    print(f"per step, audit + critic, no checkpoint, {STEPS}-step runs: {plain / bare:.2f}x a "
          f"bare trio step ({(plain - bare) * 1e6 / STEPS:.1f} us more; per-run fixed costs "
          f"included)")
    long_k = best[f"kernel + audit + critic, {LONG} steps (no checkpoint)"]
    long_b = best[f"bare trio loop, {LONG} steps"]
    marginal_k, marginal_b = (long_k - plain) / (LONG - STEPS), (long_b - bare) / (LONG - STEPS)
    print(f"per step, audit + critic, marginal (a step more in a long run: ({LONG}-step run - "
          f"{STEPS}-step run) / {LONG - STEPS}): {marginal_k * 1e6:.1f} us vs a bare step "
          f"{marginal_b * 1e6:.1f} us: {marginal_k / marginal_b:.2f}x")
    ck = best[variants[0][0]]
    print(f"per step with every battery and a checkpoint, {STEPS}-step runs: "
          f"{(ck - bare) * 1e6 / STEPS:.1f} us more than a bare step ({ck / bare:.1f}x); "
          f"a checkpoint (save + its event) {(ck - plain) * 1e6 / (STEPS - 1):.1f} us")
    lg = best["LangGraph + InMemorySaver"]
    first = variants[0][0]

    def cpu_x(name: str) -> float:
        return (cpu[name] / runs_of[name]) / (cpu[first] / runs_of[first])

    print(f"vs LangGraph + InMemorySaver, one run at a time: {lg / ours:.2f}x faster "
          f"(cpu {cpu_x('LangGraph + InMemorySaver'):.2f}x); vs LangGraph + SqliteSaver: "
          f"{best['LangGraph + SqliteSaver'] / ours:.2f}x faster")
    if width:
        kc = best[f"kernel, same, {width} runs at once"]
        lgc = best[f"LangGraph + InMemorySaver, {width} at once"]
        cpu_c = ((cpu[f"LangGraph + InMemorySaver, {width} at once"] / runs_of[
            f"LangGraph + InMemorySaver, {width} at once"]) / (cpu[f"kernel, same, {width} runs "
                                                              f"at once"] / max(n, width)))
        print(f"vs LangGraph + InMemorySaver, {width} runs at once each: {lgc / kc:.2f}x faster "
              f"(cpu {cpu_c:.2f}x; group commit: saves of runs finishing a step together "
              f"share a transaction)")


if __name__ == "__main__":
    main()
