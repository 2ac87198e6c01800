"""Running one action's process: bounded output, a timeout, and nothing left behind.

The process is started by `adapters._proc.spawn`: its own session (process
group), tied to the supervisor's lifeline. On timeout, on cancellation (run
timeout, critic kill, Ctrl-C) and after it exits, the whole group gets
SIGTERM, then SIGKILL after `grace` seconds, so no grandchild outlives the
action; if the supervisor itself is SIGKILLed, the lifeline watcher kills it.

Its echo (`on_output`) is the action's stdout and stderr, as for a plain
command (`adapters.shell`): a reader of it that goes away (`kernel run
loop.yaml | head -1`: the sink raises BrokenPipeError, or its `reader_gone`
returns) has the action's pipe for that stream read to what it holds and
closed, so the action's next write there fails as in a shell pipeline (SIGPIPE,
or EPIPE if it ignores that), and its own exit status is the action's result
(141 for a death by SIGPIPE): the loop's evaluation and routes take it from
there, as they take any other status.
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from .._proc import (
    Progress,
    Tail,
    cannot_start,
    decode_line,
    drain_while_moving,
    pump_lines,
    spawn,
)
from ..shell import WatchedSink
from ..shell import _close_now as close_now
from ..shell import _Pipe as CutPipe

#: Called with ("stdout" | "stderr", line) for each output line.
LineSink = Callable[[str, str], None]
#: Called with ("stdout" | "stderr", line, cut) for each output line; `cut` when
#: the line was longer than the limit and only its head is given.
CutLineSink = Callable[[str, str, bool], None]
#: Called with ("stdout" | "stderr", bytes) for every chunk read, untouched. Raising
#: BrokenPipeError (or returning an awaitable that raises it) says that stream's reader
#: went away; a `adapters.shell.WatchedSink` is also watched for that between chunks.
ChunkSink = Callable[[str, bytes], Awaitable[None] | None]
#: Called with ("stdout" | "stderr", bytes the pipe still held, bytes dropped) when the
#: reader of that stream's echo went away and the action's pipe was cut.
ReaderGone = Callable[[str, int, int], None]


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
        truncated: True when `output` is not all of stdout: earlier lines were
            dropped, or a line longer than the line limit was cut.
        reader_gone: True when the reader of its echo went away and its pipe was
            cut (see the module): a death by SIGPIPE is then the pipeline's end,
            not an interruption.
    """

    output: str
    stderr: str
    exit_code: int
    duration_ms: float
    signal: int | None = None
    timed_out: bool = False
    truncated: bool = False
    reader_gone: bool = False


def capture(result: ActionResult) -> dict[str, Any]:
    """What a state's `capture:` keeps of an action's result (`${captured.NAME.output}`, ...)."""
    # Trailing newlines go, as with the shell's $(...): captured paths and
    # values read back cleanly.
    return {"output": result.output.rstrip("\n"), "stderr": result.stderr.rstrip("\n"),
            "exit_code": result.exit_code, "duration_ms": round(result.duration_ms, 3)}


async def run_process(argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                      cwd: str | None = None, timeout: float | None = None,
                      on_line: CutLineSink | None = None, max_bytes: int = 256 << 10,
                      max_line: int = 64 << 10, grace: float = 2.0,
                      on_output: ChunkSink | None = None,
                      on_start: Callable[[dict[str, Any]], None] | None = None,
                      on_process: Callable[[int, bool], None] | None = None,
                      on_reader_gone: ReaderGone | None = None) -> ActionResult:
    """Run `argv` to completion (or `timeout`) and return what it produced.

    `on_start` gets the started group's record (`Child.record()`) for the
    audit; `on_output` every chunk as read (a byte-exact echo). When the
    reader of that echo goes away, the action's pipe is cut (see the module)
    and `on_reader_gone` is told; that stream is not passed on again.

    Never raises for the command's own failures (not found, non-zero exit,
    timeout): those are exit codes. Cancellation propagates after the
    process group has been stopped. `on_process(pid, started)` hears of the
    process starting (True) and ending (False), for the critic's sampler.
    """
    t0 = trio.current_time()
    try:
        child = await spawn(argv, cwd=cwd, env=env)
    except OSError as exc:
        error, code = cannot_start(argv[0], exc, cwd)
        return ActionResult("", error, code, (trio.current_time() - t0) * 1000)
    if on_start is not None:
        on_start(child.record())
    if on_process is not None:
        on_process(child.pid, True)
    out, err = Tail(max_bytes), Tail(max_bytes)
    newline = {"stdout": False, "stderr": False}
    cut = {"stdout": False, "stderr": False}
    finished = {"stdout": trio.Event(), "stderr": trio.Event()}

    async def drained() -> None:
        for event in finished.values():
            await event.wait()

    def done() -> bool:
        return all(event.is_set() for event in finished.values())

    progress = Progress()
    pipes: dict[str, CutPipe] = {}
    gone: set[str] = set()  # the streams whose echo's reader went away
    watched = on_output if isinstance(on_output, WatchedSink) else None

    def reader_left(name: str) -> None:
        """The reader of `name`'s echo went away: cut the action's pipe (`CutPipe`)."""
        pipe = pipes.get(name)
        if pipe is None or pipe.cut:
            return
        held, dropped = pipe.start_cut()
        gone.add(name)
        if on_reader_gone is not None:
            on_reader_gone(name, held, dropped)

    def echo(name: str, chunk: bytes) -> Awaitable[None] | None:
        pipe = pipes.get(name)
        if on_output is None or (pipe is not None and pipe.cut):
            return None
        try:
            waiting = on_output(name, chunk)
        except BrokenPipeError:
            reader_left(name)
            return None
        return None if waiting is None else await_echo(name, waiting)

    async def await_echo(name: str, waiting: Awaitable[None]) -> None:
        try:
            await waiting
        except BrokenPipeError:
            reader_left(name)

    async def watch(sink: WatchedSink, name: str) -> None:
        try:
            await sink.reader_gone(name)
        except Exception:  # a failing watch is no reason to fail the action:
            return  # the sink's BrokenPipeError still tells of a reader gone, at a chunk
        reader_left(name)

    async def pump(stream: trio.abc.ReceiveStream, name: str, tail: Tail) -> None:
        def line(raw: bytes, was_cut: bool) -> None:
            text = decode_line(raw)
            tail.add(text)
            cut[name] = cut[name] or was_cut
            if on_line is not None:
                on_line(name, text, was_cut)

        pipe = pipes[name] = CutPipe(stream)
        try:
            async with trio.open_nursery() as watching:
                if watched is not None:
                    watching.start_soon(watch, watched, name)
                newline[name] = await pump_lines(
                    pipe, line, max_line=max_line,
                    on_chunk=None if on_output is None else (lambda b: echo(name, b)),
                    progress=progress)
                watching.cancel_scope.cancel()
            close_now(stream)  # at its end: ours now, not when the collector gets to it
        finally:
            if pipe.dropped:  # written after its reader left, in the instant before the cut
                cut[name] = True
            finished[name].set()

    timed_out = False
    try:
        async with trio.open_nursery() as nursery:
            assert child.stdout is not None and child.stderr is not None
            nursery.start_soon(pump, child.stdout, "stdout", out)
            nursery.start_soon(pump, child.stderr, "stderr", err)
            with trio.move_on_after(float("inf") if timeout is None else timeout) as scope:
                await child.wait()
            timed_out = scope.cancelled_caught
            # The command is gone (or timed out); children it left behind may
            # still hold the pipes. Give them a moment, then stop the group.
            if timed_out:
                child.signal_group(signal.SIGTERM)
            await child.settle(drained, grace)
            # What it wrote may still be on its way to an echo read slowly: waited for
            # while it moves (a fixed bound cut the action's output short, silently).
            if not await drain_while_moving(drained, done, progress):
                cut["stdout"] = True  # left in the pipe by a holder nobody could stop
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await child.stop(grace)
        if on_process is not None:
            on_process(child.pid, False)
    rc = child.returncode
    assert rc is not None
    duration = (trio.current_time() - t0) * 1000
    stderr = err.text(newline["stderr"])
    output = out.text(newline["stdout"])
    truncated = out.truncated or cut["stdout"]
    if timed_out:
        note = f"action timed out after {timeout:g}s"
        return ActionResult(output, f"{stderr}\n{note}" if stderr else note, 124, duration,
                            timed_out=True, truncated=truncated, reader_gone=bool(gone))
    if rc < 0:
        return ActionResult(output, stderr, 128 - rc, duration, signal=-rc,
                            truncated=truncated, reader_gone=bool(gone))
    return ActionResult(output, stderr, rc, duration, truncated=truncated,
                        reader_gone=bool(gone))
