"""Kernel step overhead against a bare trio loop, measured in the same run.

    python bench/bench_kernel.py [--steps N] [--repeat R]

Prints per-step times and the ratio to a bare trio loop for: the kernel with
no ports, with the in-memory test fakes, and with the real batteries (the
DuckDB audit and the watch critic), plus a bare loop that opens a cancel
scope per step (the design the kernel avoids). Variants are measured in
turns, R rounds each, and the best round is kept, so drift on a shared
machine hits them all alike.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
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


PortsFactory = Callable[[], AbstractAsyncContextManager[Ports]]


@asynccontextmanager
async def no_ports() -> AsyncIterator[Ports]:
    yield Ports()


@asynccontextmanager
async def fakes() -> AsyncIterator[Ports]:
    yield Ports(audit=MemoryAudit(), critic=ScriptedCritic())


@asynccontextmanager
async def batteries() -> AsyncIterator[Ports]:
    from batteries.audit import DuckDBAudit
    from batteries.critic import WatchCritic

    with tempfile.TemporaryDirectory() as tmp:
        async with DuckDBAudit.open(Path(tmp) / "bench.duckdb") as audit:
            yield Ports(audit=audit, critic=WatchCritic())


def kernel_run(factory: PortsFactory) -> Callable[[int], Any]:
    async def go(n: int) -> float:
        async with factory() as ports:
            t0 = time.perf_counter()  # the run itself: recording included, opening not
            result = await Kernel(ports).run(
                Counter(n), RunInfo(), Limits(max_steps=None, timeout=3600))
            elapsed = time.perf_counter() - t0
        assert result.steps == n, result
        return elapsed
    return go


def once(fn: Any, n: int) -> float:
    """Seconds per step for one run of `fn`."""
    t0 = time.perf_counter()
    inner = trio.run(fn, n)
    total = inner if isinstance(inner, float) else time.perf_counter() - t0
    return total / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    n, r = args.steps, args.repeat
    variants: list[tuple[str, Any]] = [
        ("bare trio loop (baseline)", bare),
        ("bare loop + cancel scope per step", bare_scope_per_step),
        ("kernel, Ports() (nothing wired)", kernel_run(no_ports)),
        ("kernel, MemoryAudit + ScriptedCritic (fakes)", kernel_run(fakes)),
        ("kernel, DuckDBAudit + WatchCritic (batteries)", kernel_run(batteries)),
    ]
    best = {name: float("inf") for name, _ in variants}
    for _ in range(r):
        for name, fn in variants:
            best[name] = min(best[name], once(fn, n))
    base = best[variants[0][0]]
    print(f"steps per run: {n}, best of {r} rounds")
    print(f"{'variant':46} {'us/step':>9} {'x baseline':>11}")
    for name, _ in variants:
        print(f"{name:46} {best[name] * 1e6:9.2f} {best[name] / base:11.2f}")
    kernel = best[variants[2][0]]
    print(f"kernel overhead per step (nothing wired): {(kernel - base) * 1e6:.2f} us")


if __name__ == "__main__":
    main()
