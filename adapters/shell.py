"""One command as a run: `kernel run -- CMD [ARGS...]`.

The whole command is one kernel step. Inside it, every stdout/stderr line is
activity for the critic and (up to a cap) an audit `output` event; the exit
status decides ok/error. Memory stays bounded whatever the command prints:
only the tail of stdout/stderr is kept, lines are cut at a maximum length,
and bytes that are not UTF-8 are replaced, never fatal.

Process hygiene: the command runs in its own session (process group). When
the step is cancelled (caller cancel, timeout, critic kill) or the command
exits leaving children behind, the whole group gets SIGTERM, then SIGKILL
after `grace` seconds, so nothing outlives the run.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import trio

from kernel import Message, RunContext, Step

#: Called with ("stdout" | "stderr", line) for each line, e.g. to echo it.
LineSink = Callable[[str, str], None]


class _Tail:
    """The last `limit` bytes of a stream, as lines, plus whether anything was dropped."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lines: deque[str] = deque()
        self.size = 0
        self.truncated = False

    def add(self, line: str) -> None:
        self.lines.append(line)
        self.size += len(line) + 1
        while self.size > self.limit and self.lines:
            self.size -= len(self.lines.popleft()) + 1
            self.truncated = True

    def text(self) -> str:
        return "\n".join(self.lines)


@dataclass
class ShellAgent:
    """Runs `argv` once, supervised.

    Args:
        argv: The command and its arguments (no shell unless you run one).
        cwd: Working directory (default: the current one).
        env: Extra environment variables, added to the inherited environment.
        on_line: Called for every output line (the CLI uses it to echo).
        max_output_bytes: How much of the stdout/stderr tails is kept (each).
        max_line_bytes: Longer lines are cut (and the rest of the line dropped).
        max_line_events: Output lines written to the audit as `output` events;
            after that, lines only count (the `step` event gives the totals).
        grace: Seconds between SIGTERM and SIGKILL when stopping the command.
        steer_stdin: Write critic nudges to the command's stdin (else stdin is
            /dev/null and nudges are audited as undeliverable).
    """

    argv: Sequence[str]
    cwd: str | None = None
    env: Mapping[str, str] | None = None
    on_line: LineSink | None = None
    max_output_bytes: int = 1 << 20
    max_line_bytes: int = 64 << 10
    max_line_events: int = 10_000
    grace: float = 2.0
    steer_stdin: bool = False

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError("ShellAgent needs a command to run")
        self._proc: trio.Process | None = None
        self._ctx: RunContext | None = None
        self._events = 0
        self._lines = 0

    @property
    def command(self) -> str:
        """The command line, shell-quoted, for display."""
        return shlex.join(self.argv)

    async def simulate(self, ctx: RunContext) -> str:
        """A dry run reports what would be executed."""
        return f"would run: {self.command}"

    async def step(self, ctx: RunContext) -> Step:
        """Run the command to completion and report its exit status."""
        self._ctx = ctx
        out, err = _Tail(self.max_output_bytes), _Tail(self.max_output_bytes)
        env = {**os.environ, **self.env} if self.env else None
        t0 = trio.current_time()
        try:
            proc = await trio.lowlevel.open_process(
                list(self.argv), stdin=subprocess.PIPE if self.steer_stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=self.cwd, env=env,
                start_new_session=True)
        except OSError as exc:
            return Step(final=True, error=f"cannot start {self.argv[0]!r}: {exc.strerror or exc}",
                        exit_code=127 if isinstance(exc, FileNotFoundError) else 126,
                        name="command")
        self._proc = proc
        ctx.event("process_start", name=self.argv[0],
                  payload={"argv": list(self.argv), "pid": proc.pid})
        ctx.process_started(proc.pid)  # the critic samples its tree: busy is not stalled
        try:
            drained = trio.Event()

            async def read_both() -> None:
                assert proc.stdout is not None and proc.stderr is not None
                async with trio.open_nursery() as readers:
                    readers.start_soon(self._pump, proc.stdout, "stdout", out)
                    readers.start_soon(self._pump, proc.stderr, "stderr", err)
                drained.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_both)
                await proc.wait()
                # The command is gone; its pipes may still be held open by
                # children it left behind. Give them a moment, then stop them.
                with trio.move_on_after(0.2):
                    await drained.wait()
                self._stop_group(proc, signal.SIGTERM)
                with trio.move_on_after(self.grace):
                    await drained.wait()
                self._stop_group(proc, signal.SIGKILL)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._terminate(proc)
            ctx.process_exited(proc.pid)
            self._proc = None
        rc = proc.returncode
        assert rc is not None
        exit_code = rc if rc >= 0 else 128 - rc
        duration_ms = (trio.current_time() - t0) * 1000
        ctx.event("process_exit", name=self.argv[0],
                  payload={"exit_code": exit_code, "signal": -rc if rc < 0 else None},
                  duration_ms=duration_ms)
        payload = {
            "exit_code": exit_code, "lines": self._lines,
            "stdout_truncated": out.truncated, "stderr_truncated": err.truncated,
            "stderr_tail": err.text()[-4096:],
        }
        if rc == 0:
            return Step(output=out.text(), final=True, exit_code=0, name="command",
                        payload=payload)
        how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        last = err.lines[-1] if err.lines else ""
        return Step(output=out.text(), final=True, exit_code=exit_code, name="command",
                    error=f"command {how}" + (f": {last}" if last else ""), payload=payload)

    async def _pump(self, stream: trio.abc.ReceiveStream, name: str, tail: _Tail) -> None:
        pending = bytearray()
        limit = self.max_line_bytes
        while True:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            pending += chunk
            start = 0
            while True:
                nl = pending.find(b"\n", start)
                if nl < 0:
                    break
                self._line(name, bytes(pending[start:nl]), tail)
                start = nl + 1
            del pending[:start]
            if len(pending) > limit:
                # A "line" with no newline in sight: emit what we have, bounded.
                self._line(name, bytes(pending[:limit]), tail)
                del pending[:]
        if pending:
            self._line(name, bytes(pending), tail)

    def _line(self, stream: str, raw: bytes, tail: _Tail) -> None:
        if len(raw) > self.max_line_bytes:
            raw = raw[: self.max_line_bytes]
        line = raw.decode("utf-8", errors="replace").rstrip("\r")
        tail.add(line)
        self._lines += 1
        ctx = self._ctx
        if ctx is not None:
            if self._events < self.max_line_events:
                self._events += 1
                ctx.event("output", name=stream, payload={"line": line[:4096]}, text=line)
            else:
                ctx.activity("output", line)
        if self.on_line is not None:
            self.on_line(stream, line)

    async def on_steer(self, messages: list[Message]) -> None:
        """Write nudges to stdin when enabled; otherwise audit them as undeliverable."""
        ctx, proc = self._ctx, self._proc
        if self.steer_stdin and proc is not None and proc.stdin is not None:
            for m in messages:
                try:
                    await proc.stdin.send_all(m.content.encode() + b"\n")
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
            else:
                return
        if ctx is not None:
            ctx.event("steer_undeliverable", activity=False, payload={
                "messages": [m.content for m in messages],
                "why": "a plain command has no channel for nudges (stdin is not a pipe)"})

    def _stop_group(self, proc: trio.Process, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    async def _terminate(self, proc: trio.Process) -> None:
        """SIGTERM the group, SIGKILL after the grace period, and reap."""
        if proc.returncode is None:
            self._stop_group(proc, signal.SIGTERM)
            with trio.move_on_after(self.grace):
                await proc.wait()
        self._stop_group(proc, signal.SIGKILL)
        if proc.returncode is None:
            await proc.wait()
