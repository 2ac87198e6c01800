"""The critic tells stuck from slow in the cases a review found it did not.

Each class is one defect: a progress display redrawn with `\\r` (or dots) and
no newline; a tool bound shorter than the idle clock for CLI agents; the same
preamble with different tool calls; masking that made progress look like a
loop (temp paths, ids, byte counts, ETAs); errors whose numbers changed; work
in flight without a bound of its own; `waiting_input` given to processes not
waiting for input; the loop sentence naming the wrong call; clock times in
output lines; nudges recorded delivered that never were. Virtual time wherever
no real process is the point; real processes wait for readiness, not sleeps.
"""

from __future__ import annotations

import itertools
import os
import pty
import socket
import subprocess
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import trio

from adapters._proc import PartialLine, pump_lines
from adapters.shell import ShellAgent
from batteries.critic import (
    LOOPING,
    REPEATED_ERROR,
    REPEATING,
    STALLED,
    TOOL_TIMEOUT,
    CriticPolicy,
    Novelty,
    Outcome,
    PsutilProbe,
    RulesJudge,
    RunView,
    TreeSample,
    Window,
    line_key,
    mask_volatile,
    masked_call_key,
)
from batteries.critic._evidence import error_key, result_key
from batteries.critic._judge import Intervention
from batteries.critic._process import _tree
from kernel import Limits, RunContext, RunInfo, Status, Step, ToolCall, ToolResult
from kernel.testing import AuditEvent, MemoryAudit, ScriptedAgent
from tests.batteries.test_critic_process import eventually
from tests.batteries.test_critic_v2 import IDLE
from tests.batteries.test_critic_v2 import run as _run


async def run(agent: Any, policy: CriticPolicy = IDLE, limits: Limits | None = None,
              **critic_kw: Any) -> tuple[Any, MemoryAudit]:
    result, audit, _ = await _run(agent, policy, limits, **critic_kw)
    return result, audit


def decisions(audit: MemoryAudit, run_id: str) -> list[AuditEvent]:
    return [e for e in audit.events(run_id) if e.kind == "critic" and e.name != "watch"]


def names(audit: MemoryAudit, run_id: str) -> list[tuple[str | None, str]]:
    return [(e.name, e.payload["reason"]) for e in decisions(audit, run_id)]


def poll_agent(results: Iterable[str], args: Iterable[dict[str, Any]], *, count: int = 8,
               message: str = "") -> tuple[ScriptedAgent, list[dict[str, Any]]]:
    """An LLM-like agent calling `poll` once a second; the tool answers from `results`."""
    answers = iter(results)
    calls = iter(args)
    ran: list[dict[str, Any]] = []

    async def poll(**kw: Any) -> str:
        ran.append(kw)
        return next(answers)

    async def turn(ctx: RunContext) -> Step:
        await trio.sleep(1)
        if len(ran) >= count:
            return Step(final=True, output="done", message="done")
        return Step(tool_calls=[ToolCall("poll", next(calls), f"c{ctx.iteration}")],
                    message=message)

    return ScriptedAgent(then=turn, tools={"poll": poll}), ran


# ------------------------------------------------- 1. \r redraws and dots


class Chunks(trio.abc.ReceiveStream):
    """A byte stream handing out `chunks` one read each, a virtual second apart."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self.chunks = iter(chunks)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.sleep(1)
        return next(self.chunks, b"")

    async def aclose(self) -> None:
        pass


class TestPartialLines:
    def test_a_redraw_shows_its_last_segment_and_dots_grow(self) -> None:
        p = PartialLine()
        assert p.feed(b"\r1/12") == "1/12"
        assert p.feed(b"\r2/12") == "2/12"
        p.end()
        assert [p.feed(b".") for _ in range(3)] == ["1 chars: .", "2 chars: ..", "3 chars: ..."]
        assert p.feed(b"   ") is None  # nothing visible
        p.end()
        # A spinner drawn then returned to the start: each frame replaces the last.
        assert p.feed(b"| Waiting\r") == "| Waiting"
        assert p.feed(b"/ Waiting\r") == "/ Waiting"
        assert p.feed(b"Wait |\x08/") == "Wait /"  # a backspace spinner
        p.end()
        assert p.feed("\r\u2588".encode()[:2]) is None  # half a character: not yet
        assert p.feed("\r\u2588".encode()[2:]) == "\u2588"

    def test_a_line_written_in_two_pieces_shows_the_same_each_time(self) -> None:
        """An unbuffered `print` writes the text, then the newline: the same line again
        is the same text to the critic, not growth."""
        p = PartialLine()
        n = Novelty()
        seen = []
        for _ in range(3):
            seen.append(n.see(p.feed(b"waiting for lock") or ""))
            p.end()
            seen.append(n.see("waiting for lock"))
        assert seen == [True, True, False, False, False, False]

    async def test_pump_lines_hands_on_unended_lines_and_audits_whole_ones(
            self, autojump_clock: trio.abc.Clock) -> None:
        lines: list[bytes] = []
        partials: list[bytes] = []
        stream = Chunks([b"\r1/3", b"\r2/3", b"\r3/3\ndone", b"\n"])
        ended = await pump_lines(stream, lambda raw, cut: lines.append(raw), max_line=1024,
                                 on_partial=partials.append)
        assert ended and lines == [b"\r1/3\r2/3\r3/3", b"done"]
        assert partials == [b"\r1/3", b"\r2/3", b"done"]

    async def test_a_redrawn_counter_is_progress_and_a_spinner_is_not(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Through the shell adapter's path: each read of a line not ended goes to the critic."""

        class Redraws:
            def __init__(self, frames: Iterable[bytes]) -> None:
                self.frames = frames

            async def step(self, ctx: RunContext) -> Step:
                agent = ShellAgent(["true"])
                agent._ctx = ctx
                partial = PartialLine()
                for frame in self.frames:
                    agent._partial(partial, frame)
                    await trio.sleep(1)
                return Step(final=True, output="done")

        counter = (f"\r{i}/12".encode() for i in range(1, 13))
        result, audit = await run(Redraws(counter))
        assert result.status is Status.OK and decisions(audit, result.run_id) == []
        dots = (b"." for _ in range(12))  # (each read shows a longer line)
        result, audit = await run(Redraws(dots))
        assert result.status is Status.OK and decisions(audit, result.run_id) == []
        spinner = (f"\r{c} waiting".encode() for c in itertools.islice(itertools.cycle("|/-\\"),
                                                                        12))
        result, _ = await run(Redraws(spinner))
        assert result.status is Status.KILLED and result.reason == STALLED


@pytest.mark.realtime
class TestRealRedraws:
    """A real command under `ShellAgent` and the real critic (its process sampled)."""

    POLICY = CriticPolicy(idle_timeout=2, grace=0.5, soft_timeout=None)

    async def test_a_counter_redrawn_with_cr_is_not_stalled(self) -> None:
        code = ("import sys, time\n"
                "for i in range(1, 41):\n"
                "    sys.stdout.write(f'\\r{i}/40'); sys.stdout.flush(); time.sleep(0.1)\n"
                "print()")
        result, audit = await run(ShellAgent([sys.executable, "-c", code]), self.POLICY,
                                  Limits(timeout=60))
        assert result.status is Status.OK, names(audit, result.run_id)
        # What is audited is still the whole line, once.
        out = [e for e in audit.events(result.run_id) if e.kind == "output"]
        assert len(out) == 1 and out[0].payload["line"].endswith("40/40")

    async def test_dots_on_stderr_are_not_stalled(self) -> None:
        code = ("import sys, time\n"
                "for i in range(40):\n"
                "    sys.stderr.write('.'); sys.stderr.flush(); time.sleep(0.1)\n"
                "sys.stderr.write('\\n')")
        result, audit = await run(ShellAgent([sys.executable, "-c", code]), self.POLICY,
                                  Limits(timeout=60))
        assert result.status is Status.OK, names(audit, result.run_id)

    async def test_the_same_line_written_unbuffered_is_stalled(self) -> None:
        """`python -u` writes a line's text and its newline apart: no credit for the piece."""
        code = ("import time\n"
                "while True:\n"
                "    print('waiting for the lock'); time.sleep(0.2)")
        result, _ = await run(ShellAgent([sys.executable, "-u", "-c", code]), self.POLICY,
                                  Limits(timeout=60))
        assert (result.status, result.reason) == (Status.KILLED, STALLED), result.error
        assert result.runtime_seconds < 30

    async def test_a_line_where_only_the_clock_moves_is_stalled(self) -> None:
        """Item 9: `still waiting 12:00:07` every 0.2 s from a sleeping (flat) process."""
        code = ("import time\n"
                "while True:\n"
                "    print('still waiting', time.strftime('%H:%M:%S'), flush=True)\n"
                "    time.sleep(0.2)")
        result, audit = await run(ShellAgent([sys.executable, "-c", code]), self.POLICY,
                                  Limits(timeout=60))
        assert (result.status, result.reason) == (Status.KILLED, STALLED), result.error
        assert result.runtime_seconds < 30
        kill = decisions(audit, result.run_id)[-1]
        assert kill.payload["evidence"]["lines"] > kill.payload["evidence"]["novel_lines"]


# --------------------------------------------- 2. a tool bound for CLI agents


class TestToolBound:
    async def test_a_tool_bound_shorter_than_the_idle_clock_fires_on_time(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A CLI agent reports a tool start and hangs: the start wakes the watcher, so the
        tool's bound (3 s) is checked on time, not at the idle clock's look (60 s)."""

        async def turn(ctx: RunContext) -> Step:
            await trio.sleep(1)
            ctx.tool_start(ToolCall("Bash", {"command": "make"}, "t1"))
            await trio.sleep_forever()
            raise AssertionError("unreachable")

        policy = CriticPolicy(idle_timeout=60, grace=1, soft_timeout=None, tool_timeout=3)
        result, audit = await run(ScriptedAgent(then=turn), policy)
        assert (result.status, result.reason) == (Status.KILLED, TOOL_TIMEOUT)
        assert result.runtime_seconds == 4
        assert names(audit, result.run_id) == [("kill", TOOL_TIMEOUT)]


# ----------------------------------------------- 3. the same preamble


class TestPreamble:
    async def test_the_same_words_with_different_tool_calls_are_not_a_repeat(
            self, autojump_clock: trio.abc.Clock) -> None:
        async def read_file(path: str) -> str:
            return f"contents of {path}"

        async def turn(ctx: RunContext) -> Step:
            await trio.sleep(1)
            if ctx.iteration >= 8:
                return Step(final=True, output="done", message="All read.")
            return Step(message="Let me check.", tool_calls=[
                ToolCall("read_file", {"path": f"src/part{ctx.iteration}.py"})])

        result, audit = await run(ScriptedAgent(then=turn, tools={"read_file": read_file}))
        assert result.status is Status.OK and decisions(audit, result.run_id) == []

    async def test_the_same_words_and_no_call_are_still_a_repeat(
            self, autojump_clock: trio.abc.Clock) -> None:
        result, _ = await run(ScriptedAgent(then=Step(message="Let me check.")))
        assert (result.status, result.reason) == (Status.KILLED, REPEATING)


# ------------------------------------------------------- 4. masking


class TestMasking:
    @pytest.mark.parametrize(("a", "b"), [
        ({"job": 101}, {"job": 102}),
        ({"path": "/tmp/a.txt"}, {"path": "/tmp/b.txt"}),
        ({"path": "/var/tmp/work/pkg/c/__init__.py"}, {"path": "/var/tmp/work/pkg/d/__init__.py"}),
        ({"command": "cat job-101.log"}, {"command": "cat job-102.log"}),
        ({"page": 1, "q": "x"}, {"page": 2, "q": "x"}),
    ])
    def test_calls_on_different_things_differ(self, a: dict[str, Any],
                                              b: dict[str, Any]) -> None:
        assert masked_call_key(ToolCall("f", a)) != masked_call_key(ToolCall("f", b))

    @pytest.mark.parametrize(("a", "b"), [
        ({"path": "/tmp/tmpa8f3k2x9/out.txt"}, {"path": "/tmp/tmpzz01kk7q/out.txt"}),
        ({"path": "/tmp/tmp.Xr4Tq81LmP/log"}, {"path": "/tmp/tmp.b0Qz8RtYuI/log"}),
        ({"job": "a", "attempt": 1}, {"job": "a", "attempt": 2}),
        ({"job": "a", "n": 1, "seed": 17}, {"job": "a", "n": 2, "seed": 99}),
        ({"since": 1732345678}, {"since": 1732345999}),
        ({"command": "curl -s http://h/status --retry 2  # attempt 3"},
         {"command": "curl -s http://h/status --retry 3  # attempt 4"}),
    ])
    def test_counters_stamps_and_random_temp_parts_are_masked(
            self, a: dict[str, Any], b: dict[str, Any]) -> None:
        assert masked_call_key(ToolCall("f", a)) == masked_call_key(ToolCall("f", b))

    @pytest.mark.parametrize(("a", "b"), [
        ("downloaded 1050000000 bytes", "downloaded 1100000000 bytes"),
        ("ETA 50 min", "ETA 40 min"),
        ("state: running, 12 of 40 shards", "state: running, 13 of 40 shards"),
    ])
    def test_results_keep_what_changed(self, a: str, b: str) -> None:
        assert mask_volatile(a) != mask_volatile(b)

    @pytest.mark.parametrize(("a", "b"), [
        ("pending (checked 2026-11-23T04:05:13Z)", "pending (checked 2026-11-23T04:05:19Z)"),
        ("ok in 0.53s", "ok in 0.61s"),
        ("wrote /tmp/tmpa8f3k2x9/out.txt", "wrote /tmp/tmpzz01kk7q/out.txt"),
        ('{"state": "queued", "ts": 1732345678}', '{"state": "queued", "ts": 1732345690}'),
    ])
    def test_results_mask_what_changes_without_meaning(self, a: str, b: str) -> None:
        assert mask_volatile(a) == mask_volatile(b)

    async def test_polling_different_jobs_with_the_same_answer_is_not_a_loop(
            self, autojump_clock: trio.abc.Clock) -> None:
        agent, ran = poll_agent(itertools.repeat("state: queued"),
                                ({"job": 101 + i} for i in itertools.count()))
        result, audit = await run(agent)
        assert result.status is Status.OK and len(ran) == 8
        assert decisions(audit, result.run_id) == []

    async def test_a_growing_byte_count_and_a_shrinking_eta_are_progress(
            self, autojump_clock: trio.abc.Clock) -> None:
        answers = (f"downloaded {1_000_000_000 + 50_000_000 * i} bytes, ETA {50 - 5 * i} min"
                   for i in itertools.count())
        agent, ran = poll_agent(answers, itertools.repeat({"file": "/tmp/big.iso"}))
        result, audit = await run(agent)
        assert result.status is Status.OK and len(ran) == 8
        assert decisions(audit, result.run_id) == []

    async def test_reading_different_files_under_tmp_is_not_a_loop(
            self, autojump_clock: trio.abc.Clock) -> None:
        agent, _ = poll_agent(itertools.repeat("x = 1"),
                              ({"path": f"/tmp/work/pkg/{c}/__init__.py"} for c in "abcdefgh"))
        result, audit = await run(agent)
        assert result.status is Status.OK and decisions(audit, result.run_id) == []


# ------------------------------------------------------ 5. repeated errors


class TestErrors:
    def test_numbers_in_errors_are_kept(self) -> None:
        assert error_key("5 failed, 12 passed") != error_key("4 failed, 13 passed")
        assert error_key("src/a.c:12: error: x") != error_key("src/a.c:40: error: x")
        assert error_key("refused (attempt 3) at 12:00:01") == error_key(
            "refused (attempt 4) at 12:00:05")

    async def test_a_falling_failure_count_is_not_the_same_error(
            self, autojump_clock: trio.abc.Clock) -> None:
        failing = itertools.count(8, -1)

        async def run_tests(**_: Any) -> str:
            n = next(failing)
            if n:
                raise AssertionError(f"{n} failed, {20 - n} passed")
            return "20 passed"

        async def turn(ctx: RunContext) -> Step:
            await trio.sleep(1)
            if ctx.iteration > 8:
                return Step(final=True, output="fixed", message="fixed")
            return Step(tool_calls=[ToolCall("run_tests", {"fix": ctx.iteration})], message="")

        result, audit = await run(ScriptedAgent(then=turn, tools={"run_tests": run_tests}))
        assert result.status is Status.OK
        assert REPEATED_ERROR not in [r for _, r in names(audit, result.run_id)]


# ------------------------------------ 6. in-flight work without its own bound


class FlatProbe:
    """Process figures of a tree that never works (or works all the time)."""

    threaded = False

    def __init__(self, cpu_per_s: float = 0.0) -> None:
        self.cpu_per_s = cpu_per_s

    def sample(self, root: int) -> TreeSample | None:
        return TreeSample(trio.current_time() * self.cpu_per_s, 0, frozenset({root}))

    def input_waits(self, pids: Iterable[int]) -> tuple[str, ...]:
        return ()


class TestUnboundedFlight:
    async def test_a_hung_model_call_without_a_bound_falls_under_the_idle_clock(
            self, autojump_clock: trio.abc.Clock) -> None:
        async def turn(ctx: RunContext) -> Step:
            ctx.activity("model_request")
            await trio.sleep_forever()
            raise AssertionError("unreachable")

        policy = CriticPolicy(idle_timeout=3, grace=1, soft_timeout=None, model_timeout=None)
        result, audit = await run(ScriptedAgent(then=turn), policy)
        assert (result.status, result.reason) == (Status.KILLED, STALLED)
        assert result.runtime_seconds == 4
        assert names(audit, result.run_id) == [("steer", STALLED), ("kill", STALLED)]
        assert "model request in flight" in decisions(audit, result.run_id)[0].payload["detail"]

    def tool_agent(self, seconds: float, pid: int | None = None) -> ScriptedAgent:
        async def build(**_: Any) -> str:
            if pid is not None:
                ctx_holder[0].process_started(pid)
            await trio.sleep(seconds)
            return "built"

        ctx_holder: list[RunContext] = []

        async def first(ctx: RunContext) -> Step:
            ctx_holder.append(ctx)
            return Step(tool_calls=[ToolCall("build")], message="")

        return ScriptedAgent([first], then=Step(final=True, output="ok", message="ok"),
                             tools={"build": build})

    async def test_a_flat_tool_without_a_bound_falls_under_the_idle_clock(
            self, autojump_clock: trio.abc.Clock) -> None:
        policy = CriticPolicy(idle_timeout=3, grace=1, soft_timeout=None, tool_timeout=None)
        result, _ = await run(self.tool_agent(30), policy)
        assert (result.status, result.reason) == (Status.KILLED, STALLED)
        assert result.runtime_seconds == 4

    async def test_a_busy_tool_without_a_bound_is_not_stalled(
            self, autojump_clock: trio.abc.Clock) -> None:
        policy = CriticPolicy(idle_timeout=3, grace=1, soft_timeout=None, tool_timeout=None)
        result, audit = await run(self.tool_agent(30, pid=4242), policy,
                                  probe=FlatProbe(cpu_per_s=0.9))
        assert result.status is Status.OK and decisions(audit, result.run_id) == []


# -------------------------------------------- 7. waiting_input made honest


def wchan(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read()
    except OSError:
        return ""


@contextmanager
def started(argv: list[str], **kw: Any) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(argv, start_new_session=True, **kw)
    try:
        yield proc
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
@pytest.mark.realtime
class TestInputWaits:
    def test_a_pipe_read_fed_by_a_sibling_is_not_waiting_for_input(self) -> None:
        """`sleep 60 | cat`: cat waits for sleep, a process of the same tree."""
        probe = PsutilProbe()
        with started(["sh", "-c", "sleep 60 | cat"], stdin=subprocess.DEVNULL) as proc:
            tree = eventually(lambda: (t := _tree(proc.pid)) and any(
                "pipe" in wchan(p) for p in t) and len(t) == 3 and t)
            assert probe.input_waits(tree) == ()

    def test_a_pipe_read_fed_from_outside_is_waiting_for_input(self) -> None:
        probe = PsutilProbe()
        with started(["cat"], stdin=subprocess.PIPE) as proc:
            eventually(lambda: "pipe" in wchan(proc.pid))
            assert probe.input_waits(_tree(proc.pid))

    def test_a_poll_on_a_socket_is_not_waiting_for_input(self) -> None:
        """curl-like: a terminal on fd 0, blocked in poll() on a silent server's socket."""
        probe = PsutilProbe()
        master, slave = pty.openpty()
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]
            code = ("import select, socket\n"
                    f"c = socket.create_connection(('127.0.0.1', {port}))\n"
                    "p = select.poll(); p.register(c, select.POLLIN); p.poll()")
            try:
                with started([sys.executable, "-c", code], stdin=slave) as proc:
                    conn, _ = server.accept()  # ready: it has connected
                    with conn:
                        eventually(lambda: "poll" in wchan(proc.pid))
                        assert probe.input_waits(_tree(proc.pid)) == ()
            finally:
                os.close(master)
                os.close(slave)

    def test_a_poll_on_its_terminal_is_waiting_for_input(self) -> None:
        probe = PsutilProbe()
        master, slave = pty.openpty()
        code = "import select\np = select.poll(); p.register(0, select.POLLIN); p.poll()"
        try:
            with started([sys.executable, "-c", code], stdin=slave) as proc:
                eventually(lambda: "poll" in wchan(proc.pid))
                assert probe.input_waits(_tree(proc.pid))
        finally:
            os.close(master)
            os.close(slave)


# ------------------------------------------------------ 8. the loop sentence


def view(**overrides: Any) -> RunView:
    fields: dict[str, Any] = dict(
        info=RunInfo(name="t"), trigger="tool_start", elapsed=10.0, steps=5, tool_calls=5,
        activity=0, idle=0.0, soft_timeout=None, deadline=None, backstop=None, due=False,
        extensions=0, max_steps=100, window=Window(0.0, 10.0))
    fields.update(overrides)
    return RunView(**fields)


class TestLoopSentence:
    def test_the_kill_names_the_call_made_after_the_nudge(self) -> None:
        """Three near-duplicate calls (only a timestamp differs), nudged, then a fourth:
        the sentence names the fourth, and does not claim one call ran three times."""
        keys = ["poll(<time>)"] * 3
        labels = [f"poll(12:00:0{i})" for i in range(3)]
        outcomes = tuple(Outcome(k, lb, "pending", "pending")
                         for k, lb in zip(keys, labels, strict=True))
        judge = RulesJudge(IDLE)
        steer = judge.judge(view(trigger="tool_end", calls=tuple(keys), call_labels=tuple(labels),
                                 outcomes=outcomes, reports_results=True))
        assert steer is not None and steer.action == "steer"
        assert "(near-duplicates)" in steer.detail
        iv = Intervention(LOOPING, 3.0, delivered=True, calls_after_delivery=1,
                          evidence=dict(steer.evidence))
        kill = judge.judge(view(calls=(*keys, "poll(<time>)"),
                                call_labels=(*labels, "poll(12:00:09)"), outcomes=outcomes,
                                reports_results=True, intervention=iv,
                                nudges={LOOPING: 1}))
        assert kill is not None and kill.action == "kill"
        assert kill.detail == ("poll(12:00:02) returned the same result 3 times "
                               "(near-duplicates), then poll(12:00:09) after the nudge, "
                               "nudged at 3.0s")
        assert kill.evidence["call_after_nudge"] == "poll(12:00:09)"


# ----------------------------------------------- 9. clock times in output


class TestClockLines:
    def test_clock_times_and_ids_are_masked_in_line_keys(self) -> None:
        assert line_key("still waiting 12:00:07") == line_key("still waiting 12:00:08")
        assert line_key("[2026-11-23 04:05:13] retrying") == line_key(
            "[2026-11-23 04:05:19] retrying")
        assert line_key("compiling 3/8") != line_key("compiling 4/8")

    async def test_a_clock_line_from_a_flat_process_is_stalled(
            self, autojump_clock: trio.abc.Clock) -> None:
        class Clock:
            async def step(self, ctx: RunContext) -> Step:
                for i in itertools.count():
                    ctx.activity("output", f"still waiting 12:{i // 60:02d}:{i % 60:02d}")
                    await trio.sleep(1)
                raise AssertionError("unreachable")

        result, _ = await run(Clock())
        assert (result.status, result.reason) == (Status.KILLED, STALLED)
        assert result.runtime_seconds == 4

    def test_novelty_of_a_clock_line(self) -> None:
        n = Novelty()
        assert [n.see(f"waiting {t}") for t in ("12:00:01", "12:00:02", "12:00:03")] == [
            True, False, False]


# -------------------------------------------- 10. undelivered nudges, flat_for_s


class TestNudgeEvidence:
    async def test_a_nudge_the_adapter_could_not_deliver_is_recorded_undelivered(
            self, autojump_clock: trio.abc.Clock) -> None:
        class Deaf:
            """A long step that takes nudges mid-step and cannot pass them on."""

            async def step(self, ctx: RunContext) -> Step:
                self.ctx = ctx
                await trio.sleep_forever()
                raise AssertionError("unreachable")

            async def on_steer(self, messages: list[Any]) -> None:
                self.ctx.activity("steer_undeliverable")

        result, audit = await run(Deaf())
        assert (result.status, result.reason) == (Status.KILLED, STALLED)
        kill = decisions(audit, result.run_id)[-1]
        assert kill.payload["evidence"]["delivered"] is False

    async def test_an_undeliverable_nudge_still_follows_the_loop_up(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A loop nudged through an adapter that cannot pass nudges on (Codex, Gemini, a
        plain command) is still killed when it carries on: undelivered is evidence, not a
        reason to wait for a delivery that never comes (it ran to the timeout)."""
        class DeafLooper:
            """One long step (a CLI agent's session) repeating a call it runs itself."""

            async def step(self, ctx: RunContext) -> Step:
                self.ctx = ctx
                while True:
                    call = ToolCall("poll", {"job": "build"})
                    ctx.tool_start(call)
                    await trio.sleep(1)
                    ctx.tool_end(ToolResult(call, "status: pending"))
                    await trio.sleep(1)

            async def on_steer(self, messages: list[Any]) -> None:
                self.ctx.activity("steer_undeliverable")

        result, audit = await run(DeafLooper(), limits=Limits(timeout=600))
        assert (result.status, result.reason) == (Status.KILLED, "looping")
        assert [e.name for e in decisions(audit, result.run_id)
                if e.name in ("steer", "kill")] == ["steer", "kill"]

    async def test_flat_for_is_measured_at_the_decision(
            self, autojump_clock: trio.abc.Clock) -> None:
        class Silent:
            async def step(self, ctx: RunContext) -> Step:
                ctx.process_started(4242)
                await trio.sleep_forever()
                raise AssertionError("unreachable")

        # Samples a second apart (a third of the idle timeout); the kill falls between two.
        policy = CriticPolicy(idle_timeout=3, grace=1.5, soft_timeout=None)
        result, audit = await run(Silent(), policy, probe=FlatProbe())
        kill = decisions(audit, result.run_id)[-1]
        ev = kill.payload["evidence"]
        assert ev["process"]["flat_for_s"] == pytest.approx(ev["idle_s"], abs=0.01)


def test_result_key_keeps_a_growing_counter() -> None:
    call = ToolCall("poll", {})
    keys = {result_key(ToolResult(call, f"{n} bytes")) for n in (1_050_000_000, 1_100_000_000)}
    assert len(keys) == 2
