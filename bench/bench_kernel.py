"""Kernel step overhead against a bare trio loop, measured in the same run.

    python bench/bench_kernel.py [--steps N] [--repeat R]

Prints per-step times and the ratio kernel / bare for: no ports, memory
audit + scripted critic, and (for comparison) a bare loop that opens a
cancel scope per step, the design the kernel avoids.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import trio

from kernel import Kernel, Limits, Ports, RunInfo, Step
from kernel.testing import MemoryAudit, ScriptedCritic

_CONTINUE = Step()
_FINAL = Step(output="done", final=True)


class Counter:
    """The cheapest possible agent: yields to trio once per step, then finishes."""

    def __init__(self, n: int) -> None:
        self.n = n

    async def step(self, ctx: Any) -> Step:
        await trio.lowlevel.checkpoint()
        self.n -= 1
        return _FINAL if self.n == 0 else _CONTINUE


async def bare(n: int) -> None:
    agent = Counter(n)
    while True:
        step = await agent.step(None)
        if step.final:
            return


async def bare_scope_per_step(n: int) -> None:
    agent = Counter(n)
    while True:
        with trio.CancelScope(deadline=trio.current_time() + 3600):
            step = await agent.step(None)
        if step.final:
            return


def kernel_run(ports_factory: Any) -> Any:
    async def go(n: int) -> None:
        result = await Kernel(ports_factory()).run(
            Counter(n), RunInfo(), Limits(max_steps=None, timeout=3600))
        assert result.steps == n, result
    return go


def measure(fn: Any, n: int, repeat: int) -> float:
    """Best-of-`repeat` seconds per step."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        trio.run(fn, n)
        times.append((time.perf_counter() - t0) / n)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    n, r = args.steps, args.repeat
    base = measure(bare, n, r)
    rows = [
        ("bare trio loop (baseline)", base),
        ("bare loop + cancel scope per step", measure(bare_scope_per_step, n, r)),
        ("kernel, Ports() (nothing wired)", measure(kernel_run(Ports), n, r)),
        ("kernel, memory audit + scripted critic", measure(kernel_run(
            lambda: Ports(audit=MemoryAudit(), critic=ScriptedCritic())), n, r)),
    ]
    print(f"steps per run: {n}, best of {r} runs")
    print(f"{'variant':42} {'us/step':>9} {'x baseline':>11}")
    for name, t in rows:
        print(f"{name:42} {t * 1e6:9.2f} {t / base:11.2f}")
    overhead = statistics.fmean([rows[2][1] - base])
    print(f"kernel overhead per step (nothing wired): {overhead * 1e6:.2f} us")


if __name__ == "__main__":
    main()
