"""One command as a run: `kernel run -- CMD [ARGS...]`.

The whole command is one kernel step. Inside it, every stdout/stderr line is
activity for the critic and (up to a cap) an audit `output` event; the exit
status decides ok/error. Memory stays bounded whatever the command prints:
only the tail of stdout/stderr is kept, lines are cut at a maximum length,
and bytes that are not UTF-8 are replaced, never fatal.

Process hygiene: the command runs in its own session (process group). When
the step is cancelled (caller cancel, timeout, critic kill) or the command
exits leaving children behind, the whole group gets SIGTERM, then SIGKILL
after `grace` seconds, and so, afterwards, does every process that left the
group but carries the command's mark in its environment (a `setsid` daemon:
`Child.sweep`), so nothing outlives the run. Its pipes are read until all of
that is done, so what the command prints on SIGTERM is echoed and audited
too. A stop that comes once the command has exited (Ctrl-C while children it
left behind still hold its pipes) does not undo its finish: its own status
ends the run, and the stop only hurries what is left (`ShellAgent._settle`).
If this process dies
without a chance to clean up (SIGKILL), the lifeline watcher of
`adapters._proc` kills the group; `process_start` records the group for
`kernel recover` too.

Where its echo goes (`on_output`) is the command's stdout and stderr, as if it
wrote there itself. A reader of that echo that goes away (`| head -1`: the
sink raises BrokenPipeError, or its `reader_gone` returns) has the command's
pipe for that stream read to what it holds and closed, so the command's next
write there fails as it would have in a shell pipeline (SIGPIPE, or EPIPE if
it ignores that), and its own exit status ends the run. A run stopped mid-step
(timeout, kill, cancel) no longer waits on a slow echo: what the pipes still
hold is read at once for the audit, and the echo takes only what fits.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import signal
import struct
import termios
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import trio

from kernel import Message, RunContext, Step
from kernel._dataclass import dataclass

from ._proc import (
    Child,
    LineCounter,
    PartialLine,
    Progress,
    Tail,
    cannot_start,
    decode_line,
    drain_while_moving,
    last_chars,
    pump_lines,
    spawn,
)

#: Called with ("stdout" | "stderr", line) for each line, e.g. to echo it.
LineSink = Callable[[str, str], None]
#: How much of a line an `output` event keeps (longer ones are marked `truncated`).
_EVENT_LINE = 4096
#: How long, once the command and all it started are stopped, the rest of its output
#: already in the pipes may take to be read.
_DRAIN = 1.0
#: How long, once the command exited, children it left behind may hold its pipes before
#: they are signalled (`Child.settle`).
_LINGER = 0.2
#: Called with ("stdout" | "stderr", bytes) for every chunk read, untouched. Raising
#: BrokenPipeError says that stream's reader went away (`ShellAgent.on_output`).
ChunkSink = Callable[[str, bytes], Awaitable[None] | None]


@runtime_checkable
class WatchedSink(Protocol):
    """A `ChunkSink` that can also tell, before the next chunk, that a stream's reader left.

    `reader_gone(stream)` returns once the reader of `stream` (the far end of
    the pipe the echo goes to) has gone away; it never returns if that cannot
    happen or cannot be seen (a file, a terminal). The command's pipe is then
    cut at once, so its very next write fails, as it would have without the
    echo in between (`ShellAgent`).
    """

    def __call__(self, stream: str, chunk: bytes) -> Awaitable[None] | None: ...

    async def reader_gone(self, stream: str) -> None: ...


@dataclass
class ShellAgent:
    """Runs `argv` once, supervised.

    Args:
        argv: The command and its arguments (no shell unless you run one).
        cwd: Working directory (default: the current one).
        env: Extra environment variables, added to the inherited environment.
        on_line: Called for every output line (cut at `max_line_bytes`).
        max_output_bytes: How much of the stdout/stderr tails is kept (each).
        max_line_bytes: Longer lines are cut (and the rest of the line dropped).
        max_line_events: Output lines written to the audit as `output` events;
            after that, lines only count, and one `output_not_audited` event at
            the end says how many were left out.
        on_output: Called with every chunk of output exactly as read (the CLI
            echoes these, so the echo is byte-exact however long a line is).
            It may return an awaitable (awaited before the next read:
            backpressure), and raise BrokenPipeError when the reader of that
            stream has gone: the command's pipe is then read to what it holds
            and closed (its next write there fails, as in a shell pipeline),
            and that stream is not passed on again. A `WatchedSink` is also
            watched for a reader that goes away between chunks.
        grace: Seconds between SIGTERM and SIGKILL when stopping the command.
        inherit_stdin: Give the command our own stdin (a pipe, a file, a
            terminal), as timeout(1) does; nudges are then undeliverable.
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
    inherit_stdin: bool = False
    on_output: ChunkSink | None = None

    def __post_init__(self) -> None:
        if not self.argv:
            raise ValueError("ShellAgent needs a command to run")
        self._proc: Child | None = None
        self._counter = LineCounter(self.max_line_events)
        self._ctx: RunContext | None = None
        self._events = 0
        self._lines = 0
        self._pipes: dict[str, _Pipe] = {}
        self._echo_waits: set[trio.CancelScope] = set()
        self._hurry = False

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
        self._counter = LineCounter(self.max_line_events)
        self._pipes = {}
        self._hurry = False
        out, err = Tail(self.max_output_bytes), Tail(self.max_output_bytes)
        env = {**os.environ, **self.env} if self.env else None
        t0 = trio.current_time()
        try:
            child = await spawn(self.argv, cwd=self.cwd, env=env, stdin_pipe=self.steer_stdin,
                                inherit_stdin=self.inherit_stdin, marked=True)
        except OSError as exc:
            error, code = cannot_start(self.argv[0], exc, self.cwd)
            return Step(final=True, error=error, exit_code=code, name="command")
        self._proc = child
        ctx.event("process_start", name=self.argv[0],
                  payload={"argv": list(self.argv), **child.record()})
        ctx.process_started(child.pid)  # the critic samples its tree: busy is not stalled
        finished = False
        drained = trio.Event()
        open_pipes = [2]
        progress = Progress()
        exit_code = -1
        # The readers are ended by us, not by the run's cancel: a command stopped
        # mid-step (timeout, kill, Ctrl-C) says its last words on SIGTERM, and they
        # are echoed and audited like the rest of its output.
        readers = trio.CancelScope(shield=True)

        watched = self.on_output if isinstance(self.on_output, WatchedSink) else None

        async def read(stream: trio.abc.ReceiveStream, name: str, tail: Tail) -> None:
            pipe = self._pipes[name] = _Pipe(stream)
            try:
                async with trio.open_nursery() as watching:
                    if watched is not None:
                        watching.start_soon(self._watch_reader, watched, name)
                    await self._pump(pipe, name, tail, progress)
                    watching.cancel_scope.cancel()
            finally:
                # Our end closed now, not when the collector gets to the stream: a batch
                # of many short commands ran out of descriptors (2 a command, ~1,800 open
                # at -j 120 before a collection).
                _close_now(stream)
            if pipe.dropped:  # written after its reader left, in the instant before the cut
                tail.truncated = True
            open_pipes[0] -= 1
            if not open_pipes[0]:
                drained.set()

        async def pump() -> None:
            with readers:
                async with trio.open_nursery() as pipes:
                    assert child.stdout is not None and child.stderr is not None
                    pipes.start_soon(read, child.stdout, "stdout", out)
                    pipes.start_soon(read, child.stderr, "stderr", err)

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump)
                try:
                    late = False  # stopped once the command had exited (`_settle`)
                    try:
                        await child.wait()
                    except trio.Cancelled:
                        if not _has_exited(child.pid):
                            raise  # stopped mid-step
                        late = True  # it had exited as the stop came (not yet seen here)
                        with trio.CancelScope(shield=True):
                            await child.wait()  # (reaps it at once)
                    # The command is gone; its pipes may still be held open by
                    # children it left behind. Give them a moment, then stop them.
                    late = await self._settle(child, drained, late=late)
                    finished = True
                    exit_code = self._exited(ctx, child, t0)
                    if not late:
                        # The group is gone too; what it wrote may still be on its way to
                        # a reader slower than it (an echo into a pipe read slowly): waited
                        # for while it moves, as the command itself would have waited.
                        try:
                            await drain_while_moving(drained.wait, drained.is_set, progress,
                                                     _DRAIN)
                        except trio.Cancelled:
                            late = True
                    if late:
                        # The command had finished: its own status ends the run. The stop
                        # only hurried what followed its exit (the echo is not waited for).
                        ctx.event("stop_after_exit", name=self.argv[0], activity=False,
                                  payload={"exit_code": exit_code})
                finally:
                    try:
                        with trio.CancelScope(shield=True):
                            if not drained.is_set():
                                # Stopped mid-step, or its output still on its way: the
                                # echo is no longer waited for (a slow reader would hold
                                # the run past its deadline); the audit still reads it all.
                                self._hurry_echo()
                            if not finished:  # stopped mid-step: the group first
                                await child.stop(self.grace)
                            # Then what left the group (a daemon in a session of its own).
                            await child.sweep(self.grace)
                            # Nothing of the command is left to write: read what is still
                            # in the pipes (bounded: a process that also cleared its
                            # environment may hold them forever).
                            with trio.move_on_after(_DRAIN):
                                await drained.wait()
                    finally:
                        readers.cancel()
                        if not drained.is_set():
                            # Output was left in the pipes (its reader stopped reading, or
                            # a process that cleared its environment holds them): said so.
                            out.truncated = err.truncated = True
                            ctx.event("output_not_read", activity=False, payload={
                                "bytes_read": progress.bytes})
        finally:
            if not child.stop_reaped():
                with trio.CancelScope(shield=True):
                    await child.stop(self.grace)
            ctx.process_exited(child.pid)
            self._proc = None
            if self._counter.dropped:
                ctx.event("output_not_audited", activity=False, payload={
                    "lines": self._counter.dropped, "cap": self.max_line_events})
            if not finished:  # the run stopped it mid-step (timeout, kill, shutdown)
                self._exited(ctx, child, t0, stopped=True)
        rc = child.returncode
        assert rc is not None
        payload = {
            "exit_code": exit_code, "lines": self._lines,
            "stdout_truncated": out.truncated, "stderr_truncated": err.truncated,
            "stderr_tail": last_chars(err.text(), 4096),
        }
        if rc == 0:
            return Step(output=out.text(), final=True, exit_code=0, name="command",
                        payload=payload)
        how = f"was killed by signal {_signal_name(-rc)}" if rc < 0 else \
            f"exited with code {rc}"
        last = err.lines[-1] if err.lines else ""
        if last and _inside_private_key(err.text()):
            # The error is stored and shown by itself, where no redactor can tell
            # that its line belongs to a key whose BEGIN line came before it.
            last = "(a line of a private key, not shown)"
        return Step(output=out.text(), final=True, exit_code=exit_code, name="command",
                    error=f"command {how}" + (f": {last}" if last else ""), payload=payload)

    async def _settle(self, child: Child, drained: trio.Event, *, late: bool) -> bool:
        """After the command exited: `Child.settle` (its leftovers that hold the pipes
        get `_LINGER` seconds, then SIGTERM, then SIGKILL after `grace`); True if the run
        was stopped (`late`: before it began).

        A stop now (Ctrl-C, a host cancel, the deadline) finds the command finished,
        its exit status known: it does not make it a stopped command (the step still
        returns that status), it hurries the settle instead: the echo is no longer
        waited for, SIGTERM goes out at once rather than after the linger (not twice),
        to the group and to what left it (`Child.sweep`: a `setsid` daemon holding the
        pipes), and SIGKILL no later than the settle's own bound. Before, the stop ended
        the run `cancelled` (130) and `kernel batch --resume` ran the command again.
        """
        since = trio.current_time()
        if not late:
            try:
                await child.settle(drained.wait, self.grace, linger=_LINGER,
                                   done=drained.is_set)
                return False
            except trio.Cancelled:
                pass
        with trio.CancelScope(shield=True):
            self._hurry_echo()
            now = trio.current_time()
            left = min(self.grace, max(0.0, since + _LINGER + self.grace - now))
            async with trio.open_nursery() as both:
                # What left the group (a `setsid` daemon) may be what holds the pipes, out
                # of reach of the group's signals: swept now, within the same bound, not
                # after the grace was waited out for pipes only it could close (before: a
                # stop took up to twice the grace, and SIGTERM came a grace late).
                both.start_soon(child.sweep, left)
                if late or now < since + _LINGER:
                    # No SIGTERM yet: now, with what is left of the settle's grace.
                    await child.settle(drained.wait, left, linger=0.0, done=drained.is_set)
                else:
                    # Past the linger: the settle has sent SIGTERM; its grace runs out as
                    # set.
                    with trio.move_on_after(left):
                        await drained.wait()
                    await child.stop(self.grace)  # (reaped: SIGKILL to the group, until gone)
        return True

    def _exited(self, ctx: RunContext, child: Child, t0: float, *, stopped: bool = False) -> int:
        """Audit the command's end (`process_exit`); its exit code, as a shell reports it."""
        rc = child.returncode
        if rc is None:  # not reaped (stop gave up): nothing true to report
            return -1
        exit_code = rc if rc >= 0 else 128 - rc
        payload: dict[str, Any] = {"exit_code": exit_code, "signal": -rc if rc < 0 else None}
        if stopped:
            payload["stopped"] = True
        ctx.event("process_exit", name=self.argv[0], payload=payload,
                  duration_ms=(trio.current_time() - t0) * 1000)
        return exit_code

    async def _pump(self, stream: trio.abc.ReceiveStream, name: str, tail: Tail,
                    progress: Progress) -> None:
        partial = PartialLine()
        await pump_lines(
            stream, lambda raw, cut: self._line(name, raw, cut, tail, partial),
            max_line=self.max_line_bytes,
            on_chunk=None if self.on_output is None else (lambda chunk: self._echo(name, chunk)),
            on_partial=lambda data: self._partial(partial, data), progress=progress)

    def _echo(self, name: str, chunk: bytes) -> Awaitable[None] | None:
        """Pass `chunk` to the sink, unless its reader went away (then cut the pipe)."""
        sink = self.on_output
        pipe = self._pipes.get(name)
        if sink is None or (pipe is not None and pipe.cut):
            return None
        try:
            waiting = sink(name, chunk)
        except BrokenPipeError:
            self._reader_left(name)
            return None
        return None if waiting is None else self._await_echo(name, waiting)

    async def _await_echo(self, name: str, waiting: Awaitable[None]) -> None:
        """Wait for the sink; once the run is stopping, it takes only what fits at once."""
        with trio.CancelScope() as scope:
            if self._hurry:
                scope.cancel()  # (the sink's first wait for room raises Cancelled: dropped)
            self._echo_waits.add(scope)
            try:
                await waiting
            except BrokenPipeError:
                self._reader_left(name)
            finally:
                self._echo_waits.discard(scope)

    def _hurry_echo(self) -> None:
        """From now on the echo takes only what fits at once (the run is stopping)."""
        self._hurry = True
        for scope in self._echo_waits:
            scope.cancel()

    async def _watch_reader(self, sink: WatchedSink, name: str) -> None:
        try:
            await sink.reader_gone(name)
        except Exception:  # a failing watch is no reason to fail the run:
            return  # the sink's BrokenPipeError still tells of a reader gone, at a chunk
        self._reader_left(name)

    def _reader_left(self, name: str) -> None:
        """The reader of `name`'s echo went away: cut the command's pipe (`_Pipe`)."""
        pipe = self._pipes.get(name)
        if pipe is None or pipe.cut:
            return
        held, dropped = pipe.start_cut()
        ctx = self._ctx
        if ctx is not None:
            payload: dict[str, Any] = {"stream": name, "bytes_held": held}
            if dropped:
                payload["bytes_dropped"] = dropped
            ctx.event("output_reader_gone", name=name, activity=False, payload=payload)

    def _partial(self, partial: PartialLine, data: bytes) -> None:
        """A line not ended yet changed: shown to the critic (audited once it ends).

        The critic judges what the line shows now like a line: a counter
        redrawn with `\r` is new each time, a spinner's frames are not, and
        dots added one by one are (`PartialLine`).
        """
        text = partial.feed(data)
        ctx = self._ctx
        if text is not None and ctx is not None:
            ctx.activity("output", text)

    def _line(self, stream: str, raw: bytes, cut: bool, tail: Tail,
              partial: PartialLine | None = None) -> None:
        if partial is not None:
            partial.end()
        line = decode_line(raw)
        tail.add(line)
        if cut:  # a line longer than the cap: its head was kept
            tail.truncated = True
        self._lines += 1
        ctx = self._ctx
        if ctx is not None:
            if self._counter.take():
                payload: dict[str, object] = {"line": line[:_EVENT_LINE]}
                if cut or len(line) > _EVENT_LINE:
                    payload["truncated"] = True
                ctx.event("output", name=stream, payload=payload, text=line)
            else:
                ctx.activity("output", line)
        if self.on_line is not None:
            self.on_line(stream, line)

    async def on_steer(self, messages: list[Message]) -> None:
        """Write nudges to stdin when enabled; otherwise audit them as undeliverable."""
        ctx, proc = self._ctx, self._proc
        steerable = self.steer_stdin and not self.inherit_stdin
        if steerable and proc is not None and proc.stdin is not None:
            for m in messages:
                try:
                    await proc.stdin.send_all(m.content.encode() + b"\n")
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
            else:
                return
        if ctx is not None:
            ctx.event("steer_undeliverable", payload={  # the critic: not delivered
                "messages": [m.content for m in messages],
                "why": "a plain command has no channel for nudges (stdin is not a pipe)"})


class _Pipe(trio.abc.ReceiveStream):
    """One of the command's output pipes, which the departure of its echo's reader cuts.

    `cut` ends it as a shell pipeline would have, at once: what the pipe holds
    at that moment (written before, or as, the reader left) is read into memory
    (a pipe's worth), and our end is closed, so the command's next write fails
    (SIGPIPE, or EPIPE where that is ignored); the reads then return what was
    held, then the end. Bytes that arrive between that read and the close (a
    write made after the reader had left, in that instant) are lost, and counted
    as `dropped`.
    """

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._waiting: trio.CancelScope | None = None
        self._held = bytearray()  # read at the cut, still to be returned
        self.cut = False
        self.dropped = 0

    def start_cut(self) -> tuple[int, int]:
        """Cut the pipe now; (bytes it still held, bytes dropped)."""
        self.cut = True
        wanted = _unread(self._stream)
        while wanted > 0 and (data := _read_now(self._stream, wanted)):
            self._held += data
            wanted -= len(data)
        self.dropped = _unread(self._stream)
        _close_now(self._stream)  # (a read waiting on it ends: ClosedResourceError)
        if self._waiting is not None:
            self._waiting.cancel()
        return len(self._held), self.dropped

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if not self.cut:
            with trio.CancelScope() as scope:
                self._waiting = scope
                try:
                    return await self._stream.receive_some(max_bytes)
                except trio.ClosedResourceError:
                    if not self.cut:
                        raise
                finally:
                    self._waiting = None
        n = max_bytes or 65536
        data = bytes(self._held[:n])
        del self._held[:n]
        await trio.lowlevel.checkpoint()
        return data

    async def aclose(self) -> None:
        await self._stream.aclose()


def _has_exited(pid: int) -> bool:
    """Whether the child `pid` has exited (a zombie not reaped yet), without reaping it."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already (by a wait that was cancelled as it returned)
        return True


def _fileno(stream: trio.abc.ReceiveStream) -> int | None:
    fileno = getattr(stream, "fileno", None)
    try:
        return None if fileno is None else int(fileno())
    except (OSError, ValueError):
        return None


def _unread(stream: trio.abc.ReceiveStream) -> int:
    """Bytes waiting in the pipe `stream` reads (0 if that cannot be told)."""
    fd = _fileno(stream)
    if fd is None:
        return 0
    try:
        return int(struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0])
    except OSError:
        return 0


def _read_now(stream: trio.abc.ReceiveStream, n: int) -> bytes:
    """Up to `n` bytes the pipe holds now, without waiting (b"" if none, or at its end)."""
    fd = _fileno(stream)
    if fd is None:
        return b""
    try:
        return os.read(fd, n)  # (trio's pipe streams are non-blocking: EAGAIN when empty)
    except OSError:
        return b""


def _close_now(stream: trio.abc.ReceiveStream) -> None:
    """Close our end of the pipe at once (no checkpoint between the count and the close)."""
    close = getattr(stream, "close", None)
    if close is not None:
        close()


def _signal_name(number: int) -> str:
    """`13 (SIGPIPE)`: a signal's number, with its name when it has one."""
    try:
        return f"{number} ({signal.Signals(number).name})"
    except ValueError:
        return str(number)


def _inside_private_key(text: str) -> bool:
    """True if `text` ends inside a private key block (its BEGIN line without an END after it)."""
    begin = text.rfind("-----BEGIN")
    return begin >= 0 and text.rfind("-----END") < begin and "PRIVATE KEY" in text[begin:begin + 80]
