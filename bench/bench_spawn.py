"""What the spawn path costs per process, against a bare trio spawn, measured in the same run.

    python bench/bench_spawn.py [--n N] [--repeat R]

Variants, each starting and reaping `true` N times per round (best round of R):
a bare `trio.lowlevel.open_process` in a new session (baseline); the same
with a SIGTERM/SIGKILL group stop (what the adapters did before); and
`adapters._proc.spawn` + `Child.stop` (the lifeline registration, the start
time read and the environment token on top); and, for comparison, a Python
wrapper process per child (the design not taken). It also reports what starting
the lifeline watcher costs, once per supervising process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import trio

from adapters import _proc


async def bare(n: int) -> None:
    for _ in range(n):
        proc = await trio.lowlevel.open_process(
            ["true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        await proc.wait()


async def bare_group_stop(n: int) -> None:
    for _ in range(n):
        proc = await trio.lowlevel.open_process(
            ["true"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True)
        await proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        assert proc.stdout is not None and proc.stderr is not None
        await proc.stdout.aclose()
        await proc.stderr.aclose()


async def python_wrapper(n: int) -> None:
    # A lower bound for the rejected design: a Python wrapper per child (it
    # would also fork and wait; here it only execs the command).
    code = "import os; os.execvp('true', ['true'])"
    for _ in range(n):
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-I", "-S", "-c", code], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        await proc.wait()


async def lifeline_spawn(n: int) -> None:
    for _ in range(n):
        child = await _proc.spawn(["true"])
        await child.wait()
        await child.stop(0.1)
        assert child.stdout is not None and child.stderr is not None
        await child.stdout.aclose()
        await child.stderr.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    t0 = time.perf_counter()
    _proc.lifeline_token()  # starts the watcher
    watcher_ms = (time.perf_counter() - t0) * 1000

    variants: list[tuple[str, Callable[[int], Awaitable[None]]]] = [
        ("trio open_process, new session (baseline)", bare),
        ("  + group SIGKILL and pipes (before)", bare_group_stop),
        ("adapters._proc.spawn + Child.stop (lifeline)", lifeline_spawn),
        ("per-child Python wrapper (rejected; lower bound)", python_wrapper),
    ]
    best = {name: float("inf") for name, _ in variants}
    for _ in range(args.repeat):
        for name, fn in variants:
            t = time.perf_counter()
            trio.run(fn, args.n)
            best[name] = min(best[name], (time.perf_counter() - t) / args.n * 1000)
    base = best[variants[0][0]]
    print(f"processes per round: {args.n}, best of {args.repeat} rounds")
    print(f"{'variant':50} {'ms/spawn':>9} {'x baseline':>11}")
    for name, _ in variants:
        print(f"{name:50} {best[name]:9.2f} {best[name] / base:11.2f}")
    print(f"lifeline watcher start (once per process): {watcher_ms:.1f} ms")


if __name__ == "__main__":
    main()
