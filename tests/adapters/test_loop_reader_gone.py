"""A loop's actions and the reader of their echo going away (`kernel run loop.yaml | head -1`).

Before: the echo's sink raising BrokenPipeError (the reader gone) broke the action
out of its run with that exception (the step raised: the run ended `error` with a
traceback's worth of ExceptionGroup), and the `kernel` CLI, which never let its
loop sink raise, cancelled the run instead (130) whatever the actions did. Now a
loop action meets its reader's departure as a plain command does (`adapters.shell`):
its pipe is read to what it holds and closed, its next write gets SIGPIPE, its own
exit status (141, or its own code) is the action's result, and the loop's own
evaluation and routes decide what comes next; an `output_reader_gone` event says so.

Real processes and real pipes: the echo goes into a real `head -1`.
"""

from __future__ import annotations

import os
import select
import subprocess
from collections.abc import Awaitable
from pathlib import Path

import pytest
import trio
from loop_support import events, path_taken, run, spec_of

from adapters.shell import WatchedSink
from kernel import Limits, Status

pytestmark = pytest.mark.realtime

#: Far more than any of these runs takes (never a measure of speed).
BOUND = 120.0


class HeadEcho:
    """The loop's stdout echoed into a real `head -1` (stderr not echoed), written
    without blocking the trio thread; a `WatchedSink` when `watched`."""

    def __init__(self) -> None:
        self.head = subprocess.Popen(["head", "-1"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        assert self.head.stdin is not None
        self.fd = self.head.stdin.fileno()
        os.set_blocking(self.fd, False)

    def __call__(self, stream: str, chunk: bytes) -> Awaitable[None] | None:
        return self.write(chunk) if stream == "stdout" else None

    async def write(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        while view:
            try:
                view = view[os.write(self.fd, view):]  # BrokenPipeError: head is gone
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.fd)

    def output(self) -> bytes:
        """What `head -1` printed (it has exited: it had its line)."""
        assert self.head.stdout is not None and self.head.stdin is not None
        out = self.head.stdout.read()
        self.head.wait(timeout=BOUND)
        self.head.stdin.close()
        self.head.stdout.close()
        return out


class WatchedHeadEcho(HeadEcho):
    async def reader_gone(self, stream: str) -> None:
        if stream != "stdout":
            await trio.sleep_forever()
        poller = select.poll()
        poller.register(self.fd, 0)  # (errors are always reported)
        while not any(ev & select.POLLERR for _, ev in poller.poll(0)):
            # A pipe's write end is never readable: this wait ends with EPOLLERR, when
            # its reader has closed it (as `kernel run`'s own watch does).
            await trio.lowlevel.wait_readable(self.fd)


LOOP = """
    name: reader-gone
    initial: flood
    max_iterations: 10
    states:
      flood:
        action: "{flood}"
        capture: flood
        on_yes: done
        on_no: after
        on_error: after
      after:
        action: "echo more >&2"
        capture: after
        next: done
      done:
        terminal: true
"""


@pytest.mark.parametrize("sink", [HeadEcho, WatchedHeadEcho])
async def test_the_action_meets_sigpipe_and_the_loop_routes_on_it(
        tmp_path: Path, sink: type[HeadEcho]) -> None:
    """`yes` (which never ends by itself) echoed into `head -1`: it dies of SIGPIPE
    (exit 141), its state routes `on_error` to the next state, which runs, and the
    loop ends ok at its terminal. No exception, no cancel."""
    echo = sink()
    assert isinstance(echo, WatchedSink) == (sink is WatchedHeadEcho)
    spec = spec_of(tmp_path, LOOP.format(flood="yes"))
    with trio.fail_after(BOUND):
        result, audit, agent = await run(spec, on_output=echo,
                                         limits=Limits(timeout=BOUND, max_steps=10))
    assert echo.output() == b"y\n"
    assert result.status is Status.OK, result.reason
    run_id = result.run_id
    assert path_taken(audit, run_id) == ["flood", "after"]  # (then the terminal `done`)
    flood, after = (e.payload for e in events(audit, run_id, "action_end"))
    assert (flood["exit_code"], flood["signal"]) == (141, 13)
    assert (after["exit_code"], after["signal"]) == (0, None)
    gone = [(e.payload["state"], e.payload["stream"])
            for e in events(audit, run_id, "output_reader_gone")]
    # (The next action's stdout is cut as it starts, when the watch can tell the reader
    # is gone already; else at its first write there, which this action never makes.)
    assert gone == ([("flood", "stdout"), ("after", "stdout")] if sink is WatchedHeadEcho
                    else [("flood", "stdout")])  # stderr: never echoed
    assert agent.captured["after"]["stderr"] == "more"
    assert agent.captured["flood"]["output"].startswith("y\ny\n")


async def test_its_own_status_when_it_goes_on_after_sigpipe(tmp_path: Path) -> None:
    """`seq 1 200000; exit 0` into `head -1`: seq dies of SIGPIPE, bash goes on and exits 0,
    as in a shell pipeline: the state's `on_yes` is taken."""
    echo = WatchedHeadEcho()
    spec = spec_of(tmp_path, LOOP.format(flood="seq 1 200000; exit 0"))
    with trio.fail_after(BOUND):
        result, audit, _ = await run(spec, on_output=echo,
                                     limits=Limits(timeout=BOUND, max_steps=10))
    assert echo.output() == b"1\n"
    assert result.status is Status.OK, result.error
    assert path_taken(audit, result.run_id) == ["flood"]  # (then the terminal `done`)
    [flood] = (e.payload for e in events(audit, result.run_id, "action_end"))
    assert flood["exit_code"] == 0
    assert [e.payload["state"] for e in events(audit, result.run_id, "output_reader_gone")
            ] == ["flood"]


async def test_a_state_without_an_error_route(tmp_path: Path) -> None:
    """A death by SIGPIPE after the echo's reader left is not an interruption: a `next`
    state goes on to its next state (another death by a signal, with no `on_error`,
    stops the loop `cancelled`: before, so did this one)."""
    echo = WatchedHeadEcho()
    spec = spec_of(tmp_path, """
        name: next-after-sigpipe
        initial: flood
        states:
          flood:
            action: "yes"
            next: done
          done:
            terminal: true
        """)
    with trio.fail_after(BOUND):
        result, audit, _ = await run(spec, on_output=echo,
                                     limits=Limits(timeout=BOUND, max_steps=10))
    assert echo.output() == b"y\n"
    assert result.status is Status.OK, result.reason
    [flood] = (e.payload for e in events(audit, result.run_id, "action_end"))
    assert (flood["exit_code"], flood["signal"]) == (141, 13)
    [route] = (e.payload for e in events(audit, result.run_id, "route"))
    assert (route["to"], route["reason"]) == ("done", "next")


def test_kernel_run_loop_into_head(kernel_exe: str, cli_env: dict[str, str],
                                   tmp_path: Path) -> None:
    """`kernel run loop.yaml | head -1` with an action that prints 200,000 lines: the
    action dies of SIGPIPE, the loop routes on it and ends at its terminal: exit 0,
    status ok (before: cancelled, "output pipe closed (stdout)", exit 130)."""
    loop = tmp_path / "loop.yaml"
    loop.write_text(LOOP.format(flood="seq 1 200000").replace("\n    ", "\n").lstrip())
    err = tmp_path / "stderr"
    with err.open("wb") as sink:
        p = subprocess.Popen([kernel_exe, "run", str(loop)], stdout=subprocess.PIPE,
                             stderr=sink, stdin=subprocess.DEVNULL, env=cli_env)
        try:
            assert p.stdout is not None
            assert p.stdout.readline() == b"1\n"
            p.stdout.close()  # head -1 has its line
            code = p.wait(timeout=BOUND)
        finally:
            p.kill()
            p.wait()
    text = err.read_text()
    assert "Traceback" not in text and "BrokenPipeError" not in text, text
    assert code == 0, text
    assert text.endswith("(exit 0)\n"), text
    q = subprocess.run([kernel_exe, "query", "--format", "csv",
                        "SELECT status FROM runs"], capture_output=True, text=True,
                       env=cli_env, timeout=BOUND)
    assert q.stdout.split() == ["status", "ok"], q.stderr
