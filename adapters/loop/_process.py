"""Running one action's process: bounded output, a timeout, and nothing left behind.

The process gets its own session (process group). On timeout, on
cancellation (run timeout, critic kill, Ctrl-C) and after it exits, the
whole group gets SIGTERM, then SIGKILL after `grace` seconds, so no
grandchild outlives the action.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import trio

#: Called with ("stdout" | "stderr", line) for each output line.
LineSink = Callable[[str, str], None]


@dataclass(slots=True)
class ActionResult:
    """What an action produced.

    Attributes:
        output: Its stdout (the tail, when it printed more than the limit).
        stderr: Its stderr (likewise).
        exit_code: Its exit status; 124 when it timed out, 127 when it could not
            be started, 128+N when killed by signal N.
        duration_ms: Wall time (trio clock).
        signal: The signal that killed it, if one did (not counting our own
            timeout kill).
        timed_out: True when the action's timeout expired.
    """

    output: str
    stderr: str
    exit_code: int
    duration_ms: float
    signal: int | None = None
    timed_out: bool = False


class _Tail:
    """The last `limit` characters of a stream, kept as lines."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lines: deque[str] = deque()
        self.size = 0

    def add(self, line: str) -> None:
        self.lines.append(line)
        self.size += len(line) + 1
        while self.size > self.limit and len(self.lines) > 1:
            self.size -= len(self.lines.popleft()) + 1

    def text(self, ended_with_newline: bool) -> str:
        body = "\n".join(self.lines)
        return body + "\n" if body and ended_with_newline else body


async def run_process(argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                      cwd: str | None = None, timeout: float | None = None,
                      on_line: LineSink | None = None, max_bytes: int = 256 << 10,
                      max_line: int = 64 << 10, grace: float = 2.0,
                      on_process: Callable[[int, bool], None] | None = None) -> ActionResult:
    """Run `argv` to completion (or `timeout`) and return what it produced.

    Never raises for the command's own failures (not found, non-zero exit,
    timeout): those are exit codes. Cancellation propagates after the
    process group has been stopped. `on_process(pid, started)` hears of the
    process starting (True) and ending (False), for the critic's sampler.
    """
    t0 = trio.current_time()
    try:
        proc = await trio.lowlevel.open_process(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, cwd=cwd, env=dict(env) if env is not None else None,
            start_new_session=True)
    except OSError as exc:
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        return ActionResult("", f"cannot start {argv[0]!r}: {exc.strerror or exc}", code,
                            (trio.current_time() - t0) * 1000)
    if on_process is not None:
        on_process(proc.pid, True)
    out, err = _Tail(max_bytes), _Tail(max_bytes)
    newline = {"stdout": False, "stderr": False}

    finished = {"stdout": trio.Event(), "stderr": trio.Event()}

    async def drained() -> None:
        for event in finished.values():
            await event.wait()

    async def pump(stream: trio.abc.ReceiveStream, name: str, tail: _Tail) -> None:
        try:
            await read(stream, name, tail)
        finally:
            finished[name].set()

    async def read(stream: trio.abc.ReceiveStream, name: str, tail: _Tail) -> None:
        pending = bytearray()
        while True:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            pending += chunk
            start = 0
            while (nl := pending.find(b"\n", start)) >= 0:
                emit(name, bytes(pending[start:nl]), tail)
                start = nl + 1
            del pending[:start]
            if len(pending) > max_line:
                emit(name, bytes(pending[:max_line]), tail)
                del pending[:]
        newline[name] = not pending
        if pending:
            emit(name, bytes(pending), tail)

    def emit(name: str, raw: bytes, tail: _Tail) -> None:
        line = raw[:max_line].decode("utf-8", errors="replace").rstrip("\r")
        tail.add(line)
        if on_line is not None:
            on_line(name, line)

    timed_out = False
    try:
        async with trio.open_nursery() as nursery:
            assert proc.stdout is not None and proc.stderr is not None
            nursery.start_soon(pump, proc.stdout, "stdout", out)
            nursery.start_soon(pump, proc.stderr, "stderr", err)
            with trio.move_on_after(float("inf") if timeout is None else timeout) as scope:
                await proc.wait()
            timed_out = scope.cancelled_caught
            # The command is gone (or timed out); children it left behind may
            # still hold the pipes. Give them a moment, then stop the group.
            if timed_out:
                _signal_group(proc, signal.SIGTERM)
            with trio.move_on_after(0.2):
                await drained()
            _signal_group(proc, signal.SIGTERM)
            with trio.move_on_after(grace):
                await drained()
            _signal_group(proc, signal.SIGKILL)
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await _stop(proc, grace)
        if on_process is not None:
            on_process(proc.pid, False)
    rc = proc.returncode
    assert rc is not None
    duration = (trio.current_time() - t0) * 1000
    stderr = err.text(newline["stderr"])
    if timed_out:
        note = f"action timed out after {timeout:g}s"
        return ActionResult(out.text(newline["stdout"]),
                            f"{stderr}\n{note}" if stderr else note, 124, duration,
                            timed_out=True)
    if rc < 0:
        return ActionResult(out.text(newline["stdout"]), stderr, 128 - rc, duration,
                            signal=-rc)
    return ActionResult(out.text(newline["stdout"]), stderr, rc, duration)


def _signal_group(proc: trio.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


async def _stop(proc: trio.Process, grace: float) -> None:
    """SIGTERM the group, SIGKILL after the grace period, and reap."""
    if proc.returncode is None:
        _signal_group(proc, signal.SIGTERM)
        with trio.move_on_after(grace):
            await proc.wait()
    _signal_group(proc, signal.SIGKILL)
    if proc.returncode is None:
        await proc.wait()
