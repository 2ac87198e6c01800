"""Critic v2 in virtual time: stuck told from slow by evidence, not by a silence clock alone.

Each behaviour of the corpus that needs no real process is here as a real
kernel run under `WatchCritic` (a hand-written `ProcessProbe` stands in for
/proc where process figures matter), read back from the audit.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import trio

from batteries.audit.queries import critic_sentence
from batteries.critic import (
    EMPTY_ANSWER,
    LOOPING,
    MODEL_TIMEOUT,
    REPEATED_ERROR,
    REPEATING,
    STALLED,
    WAITING_INPUT,
    CriticPolicy,
    Decision,
    Novelty,
    RulesJudge,
    RunView,
    TreeSample,
    WatchCritic,
    line_key,
    mask_volatile,
    masked_call_key,
)
from kernel import Kernel, Limits, Ports, RunContext, RunInfo, Status, Step, ToolCall
from kernel.testing import AuditEvent, MemoryAudit, ScriptedAgent

IDLE = CriticPolicy(idle_timeout=3, grace=1, soft_timeout=None)


async def run(agent: Any, policy: CriticPolicy = IDLE, limits: Limits | None = None,
              **critic_kw: Any) -> tuple[Any, MemoryAudit, WatchCritic]:
    audit = MemoryAudit()
    critic = WatchCritic(policy, **critic_kw)
    result = await Kernel(Ports(audit=audit, critic=critic)).run(
        agent, RunInfo(name="t"), limits or Limits(timeout=3600))
    return result, audit, critic


def decisions(audit: MemoryAudit, run_id: str) -> list[AuditEvent]:
    return [e for e in audit.events(run_id) if e.kind == "critic" and e.name != "watch"]


def names(audit: MemoryAudit, run_id: str) -> list[tuple[str | None, str]]:
    return [(e.name, e.payload["reason"]) for e in decisions(audit, run_id)]


# ------------------------------------------------------------------ evidence


class TestEvidence:
    def test_volatile_values_are_masked_in_calls(self) -> None:
        a = ToolCall("poll", {"job": "build", "at": "2026-11-23T04:05:13Z", "n": 3})
        b = ToolCall("poll", {"job": "build", "at": "2026-11-23T04:05:19Z", "n": 4})
        c = ToolCall("poll", {"job": "test", "at": "2026-11-23T04:05:19Z", "n": 4})
        assert masked_call_key(a) == masked_call_key(b) != masked_call_key(c)
        for v1, v2 in (("3f2b9a1c-0d4e-4c8a-9b1e-2f0a5c6d7e8f",
                        "a1b2c3d4-0d4e-4c8a-9b1e-2f0a5c6d7e8f"),
                       ("/tmp/tmpa8x9_q2/out.txt", "/tmp/tmpzz01kk7/out.txt"),
                       ("deadbeef1234", "cafebabe9876"),
                       ("nonce-Zk29Xq81LmPq0aB7cD3e", "nonce-Qw83Rt56YuIo9pAs2dFg")):
            assert (masked_call_key(ToolCall("f", {"x": v1}))
                    == masked_call_key(ToolCall("f", {"x": v2}))), (v1, v2)

    def test_results_keep_small_numbers_and_mask_clocks(self) -> None:
        assert mask_volatile("done 1/8") != mask_volatile("done 2/8")
        assert mask_volatile("pending (checked 12:00:01)") == mask_volatile(
            "pending (checked 12:00:07)")
        assert mask_volatile("ok in 0.53s") == mask_volatile("ok in 0.61s")

    def test_line_key_strips_escapes_redraws_and_spinners(self) -> None:
        assert line_key("\x1b[32m⠋\x1b[0m Building...") == "Building"
        assert line_key("| working\r/ working\r- working") == "working"
        assert line_key("\x1b[2K\r◐ waiting for lock") == "waiting for lock"
        assert line_key("compiling 3/8") != line_key("compiling 4/8")

    def test_novelty_counts_only_new_lines(self) -> None:
        n = Novelty(memory=4)
        seen = [n.see(x) for x in ("⠋ Loading", "⠙ Loading", "⠹ Loading", "1/8", "2/8",
                                   "1/8", "", "\x1b[0m")]
        assert seen == [True, False, False, True, True, False, False, False]
        assert (n.lines, n.novel) == (8, 3)


# --------------------------------------------------------------- tool loops


def poll_agent(results: Iterable[str], args: Iterable[dict[str, Any]], *,
               every: float = 1.0, count: int = 40) -> tuple[ScriptedAgent, list[str]]:
    """An LLM-like agent calling `poll` each turn; the tool answers from `results`."""
    answers = iter(results)
    calls = iter(args)
    ran: list[str] = []

    async def poll(**_: Any) -> str:
        ran.append("poll")
        return next(answers)

    async def turn(ctx: RunContext) -> Step:
        await trio.sleep(every)
        if len(ran) >= count:
            return Step(final=True, output="job finished", message="job finished")
        return Step(tool_calls=[ToolCall("poll", next(calls), f"c{ctx.iteration}")],
                    message="")

    return ScriptedAgent(then=turn, tools={"poll": poll}), ran


class TestOutcomes:
    async def test_a_poll_whose_answer_changes_is_progress(
            self, autojump_clock: trio.abc.Clock) -> None:
        """The same call 8 times with the answers 1/8, 2/8, ... is a healthy poll."""
        agent, ran = poll_agent((f"{i}/8 done" for i in itertools.count(1)),
                                itertools.repeat({"job": "build"}), count=8)
        result, audit, _ = await run(agent)
        assert result.status is Status.OK and len(ran) == 8
        assert decisions(audit, result.run_id) == []

    async def test_near_duplicate_calls_with_the_same_result_are_a_loop(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Arguments differing only by a timestamp and a counter: nudged, then killed."""
        args = ({"job": "build", "at": f"2026-11-23T04:{i // 60:02d}:{i % 60:02d}Z",
                 "attempt": i} for i in itertools.count())
        agent, ran = poll_agent(itertools.repeat("pending"), args)
        result, audit, _ = await run(agent)
        assert result.status is Status.KILLED and result.reason == LOOPING
        assert names(audit, result.run_id) == [("steer", LOOPING), ("kill", LOOPING)]
        # Nudged at the 3rd identical outcome; the 4th call is killed before it runs
        # (and so not counted).
        assert len(ran) == 3 and result.tool_calls == 3
        kill = decisions(audit, result.run_id)[-1]
        assert kill.payload["evidence"]["result"] == "pending"
        events = [{"kind": e.kind, "name": e.name, "payload": e.payload}
                  for e in audit.events(result.run_id)]
        assert critic_sentence(events) == (
            "killed: looping — poll(build, 2026-11-23T04:00:02Z, 2) returned the same result "
            "3 times (near-duplicates), then poll(build, 2026-11-23T04:00:03Z, 3) after the "
            "nudge, nudged at 3.0s")

    async def test_an_ab_cycle_with_changing_results_is_not_a_loop(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Edit, test, edit, test... with the test output changing each time is work."""
        n = itertools.count()

        async def tool(**_: Any) -> str:
            return f"{next(n)} tests failing"

        async def turn(ctx: RunContext) -> Step:
            await trio.sleep(1)
            if ctx.iteration >= 10:
                return Step(final=True, output="fixed", message="fixed")
            name = "edit" if ctx.iteration % 2 == 0 else "test"
            return Step(tool_calls=[ToolCall(name, {"path": "a.py"})], message="")

        result, audit, _ = await run(ScriptedAgent(then=turn, tools={"edit": tool, "test": tool}))
        assert result.status is Status.OK
        assert decisions(audit, result.run_id) == []

    async def test_the_same_error_again_and_again(self, autojump_clock: trio.abc.Clock) -> None:
        """Different calls failing with the same error (numbers masked): nudged, then killed."""
        n = itertools.count()

        async def fetch(url: str) -> str:
            raise ConnectionError(f"connection refused (attempt {next(n)})")

        async def turn(ctx: RunContext) -> Step:
            await trio.sleep(1)
            return Step(tool_calls=[ToolCall("fetch", {"url": f"http://h/{ctx.iteration}"})],
                        message="")

        result, audit, _ = await run(ScriptedAgent(then=turn, tools={"fetch": fetch}))
        assert result.status is Status.KILLED and result.reason == REPEATED_ERROR
        assert names(audit, result.run_id) == [("steer", REPEATED_ERROR),
                                               ("kill", REPEATED_ERROR)]
        assert "connection refused" in decisions(audit, result.run_id)[-1].payload["detail"]

    async def test_the_same_failure_reported_as_output(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A shell tool returns `exit code 1` and the same compiler error for different
        build commands: the same error, nudged then killed."""

        async def shell(command: str) -> str:
            return "exit code 1\nsrc/net.c:3:10: fatal error: openssl/ssl.h: No such file"

        variants = itertools.cycle(["", " --verbose", " -j2", " --clean"])

        async def turn(ctx: RunContext) -> Step:
            await trio.sleep(1)
            return Step(tool_calls=[ToolCall("shell", {"command": "sh build.sh" + next(
                variants)})], message="")

        result, _, _ = await run(ScriptedAgent(then=turn, tools={"shell": shell}))
        assert result.status is Status.KILLED and result.reason == REPEATED_ERROR

    async def test_the_same_successful_answer_to_different_calls_is_fine(
            self, autojump_clock: trio.abc.Clock) -> None:
        async def write(path: str) -> str:
            return "ok"

        async def turn(ctx: RunContext) -> Step:
            await trio.sleep(1)
            if ctx.iteration >= 10:
                return Step(final=True, output="written", message="written")
            return Step(tool_calls=[ToolCall("write", {"path": f"file_{ctx.iteration}.py"})],
                        message="")

        result, audit, _ = await run(ScriptedAgent(then=turn, tools={"write": write}))
        assert result.status is Status.OK and decisions(audit, result.run_id) == []

    async def test_the_same_message_again_and_again(self, autojump_clock: trio.abc.Clock) -> None:
        async def turn(ctx: RunContext) -> Step:
            await trio.sleep(1)
            return Step(message="I will now check the file.  ", output="...")

        result, audit, _ = await run(ScriptedAgent(then=turn))
        assert result.status is Status.KILLED and result.reason == REPEATING
        assert names(audit, result.run_id) == [("steer", REPEATING), ("kill", REPEATING)]

    async def test_an_empty_answer_is_nudged_once_then_killed(
            self, autojump_clock: trio.abc.Clock) -> None:
        agent = ScriptedAgent(then=Step(message=""))
        result, audit, _ = await run(agent)
        assert result.status is Status.KILLED and result.reason == EMPTY_ANSWER
        assert names(audit, result.run_id) == [("steer", EMPTY_ANSWER), ("kill", EMPTY_ANSWER)]
        assert agent.calls == 2 and "empty" in agent.seen_steer[1][0].content

    async def test_an_empty_answer_followed_by_a_real_one_recovers(
            self, autojump_clock: trio.abc.Clock) -> None:
        agent = ScriptedAgent([Step(message="")],
                              then=Step(message="42", output="42", final=True))
        result, audit, _ = await run(agent)
        assert result.status is Status.OK and result.output == "42"
        assert names(audit, result.run_id) == [("steer", EMPTY_ANSWER),
                                               ("continue", "recovered")]


# ---------------------------------------------------------- output novelty


class Printer:
    """A one-step agent printing `lines` (one per `every` seconds), then finishing."""

    def __init__(self, lines: Iterable[str], every: float, total: float) -> None:
        self.lines = lines
        self.every = every
        self.total = total

    async def step(self, ctx: RunContext) -> Step:
        t0 = trio.current_time()
        for line in self.lines:
            if trio.current_time() - t0 >= self.total:
                break
            ctx.activity("output", line)
            await trio.sleep(self.every)
        return Step(final=True, output="done")


class TestNovelty:
    async def test_a_spinner_is_not_progress(self, autojump_clock: trio.abc.Clock) -> None:
        frames = itertools.cycle("⠋⠙⠹⠸⠼⠴⠦⠧")
        spinner = (f"\r\x1b[2K{f} Working..." for f in frames)
        result, audit, _ = await run(Printer(spinner, every=0.5, total=600))
        assert result.status is Status.KILLED and result.reason == STALLED
        assert result.runtime_seconds == 4.0  # idle 3 + grace 1 after the first frame
        kill = decisions(audit, result.run_id)[-1]
        assert kill.payload["evidence"]["lines"] >= 8
        assert kill.payload["evidence"]["novel_lines"] == 1

    async def test_a_counter_is_progress(self, autojump_clock: trio.abc.Clock) -> None:
        counter = (f"\r[{'#' * (i // 10)}] {i}/60" for i in itertools.count())
        result, audit, _ = await run(Printer(counter, every=1, total=60))
        assert result.status is Status.OK
        assert decisions(audit, result.run_id) == []

    async def test_bursty_output_with_gaps_under_the_bound(
            self, autojump_clock: trio.abc.Clock) -> None:
        lines = (f"batch {i // 5} item {i}" for i in itertools.count())

        class Bursty:
            async def step(self, ctx: RunContext) -> Step:
                for _ in range(6):
                    for _ in range(5):
                        ctx.activity("output", next(lines))
                    await trio.sleep(2.5)
                return Step(final=True)

        result, audit, _ = await run(Bursty())
        assert result.status is Status.OK and decisions(audit, result.run_id) == []


# --------------------------------------------------------- work in flight


class TestInFlight:
    async def test_slow_model_turns_are_not_silence(self, autojump_clock: trio.abc.Clock) -> None:
        async def turn(ctx: RunContext) -> Step:
            ctx.activity("model_request")
            await trio.sleep(4)  # a 4 s model turn against a 3 s idle timeout
            if ctx.iteration >= 5:
                return Step(final=True, output="answer", message="answer")
            return Step(message=f"thinking about part {ctx.iteration}")

        result, audit, _ = await run(ScriptedAgent(then=turn))
        assert result.status is Status.OK and decisions(audit, result.run_id) == []

    async def test_a_hung_model_call_is_caught_by_its_own_bound(
            self, autojump_clock: trio.abc.Clock) -> None:
        async def turn(ctx: RunContext) -> Step:
            ctx.activity("model_request")
            await trio.sleep_forever()
            raise AssertionError("unreachable")

        policy = CriticPolicy(idle_timeout=3, grace=1, soft_timeout=None, model_timeout=30)
        result, audit, _ = await run(ScriptedAgent(then=turn), policy)
        assert result.status is Status.KILLED and result.reason == MODEL_TIMEOUT
        assert result.runtime_seconds == 30
        assert names(audit, result.run_id) == [("kill", MODEL_TIMEOUT)]

    async def test_a_model_bound_shorter_than_the_idle_clock_fires_on_time(
            self, autojump_clock: trio.abc.Clock) -> None:
        """The request's start wakes the watcher: its bound (3 s) is sooner than the look it
        had planned (the idle clock, 60 s), and a hung call is caught at 3 s, not at 60."""
        async def turn(ctx: RunContext) -> Step:
            await trio.sleep(1)
            ctx.activity("model_request")
            await trio.sleep_forever()
            raise AssertionError("unreachable")

        policy = CriticPolicy(idle_timeout=60, grace=1, soft_timeout=None, model_timeout=3)
        result, _, _ = await run(ScriptedAgent(then=turn), policy)
        assert result.status is Status.KILLED and result.reason == MODEL_TIMEOUT
        assert result.runtime_seconds == 4

    async def test_streamed_tokens_keep_a_model_call_alive(
            self, autojump_clock: trio.abc.Clock) -> None:
        async def turn(ctx: RunContext) -> Step:
            ctx.activity("model_request")
            for i in range(20):
                await trio.sleep(20)
                ctx.activity("model_token", f"tok{i}")
            return Step(final=True, output="long answer", message="long answer")

        policy = CriticPolicy(idle_timeout=3, grace=1, soft_timeout=None, model_timeout=30)
        result, _, _ = await run(ScriptedAgent(then=turn), policy)
        assert result.status is Status.OK and result.runtime_seconds == 400

    async def test_a_long_silent_tool_call_is_not_silence(
            self, autojump_clock: trio.abc.Clock) -> None:
        async def build(**_: Any) -> str:
            await trio.sleep(60)
            return "built"

        agent = ScriptedAgent([Step(tool_calls=[ToolCall("build")], message="")],
                              then=Step(final=True, output="ok", message="ok"),
                              tools={"build": build})
        result, audit, _ = await run(agent)
        assert result.status is Status.OK and decisions(audit, result.run_id) == []


# ------------------------------------------------------- process evidence


class FakeProbe:
    """Process figures from a script: (cpu_s, io_bytes) per second of run time."""

    threaded = False

    def __init__(self, cpu_per_s: float, io_per_s: int = 0, *, stops_at: float = 1e9,
                 reading_stdin: bool = False) -> None:
        self.cpu_per_s = cpu_per_s
        self.io_per_s = io_per_s
        self.stops_at = stops_at
        self.reading_stdin = reading_stdin
        self.t0: float | None = None
        self.asked: list[int] = []

    def sample(self, root: int) -> TreeSample | None:
        now = trio.current_time()
        if self.t0 is None:
            self.t0 = now
        busy = min(now - self.t0, self.stops_at)
        return TreeSample(busy * self.cpu_per_s, int(busy * self.io_per_s),
                          frozenset({root, root + 1}))

    def input_waits(self, pids: Iterable[int]) -> tuple[str, ...]:
        self.asked.append(len(list(pids)))
        return (f"{min(pids)}:n_tty_read",) if self.reading_stdin else ()


class SilentCommand:
    """A one-step agent standing for a command: registers pid 4242, prints nothing."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def step(self, ctx: RunContext) -> Step:
        ctx.process_started(4242)
        try:
            await trio.sleep(self.seconds)
        finally:
            ctx.process_exited(4242)
        return Step(final=True, exit_code=0)


class TestProcessEvidence:
    async def test_a_busy_silent_process_is_working(self, autojump_clock: trio.abc.Clock) -> None:
        result, audit, _ = await run(SilentCommand(60), probe=FakeProbe(cpu_per_s=0.9))
        assert result.status is Status.OK and decisions(audit, result.run_id) == []

    async def test_a_silent_writer_is_working(self, autojump_clock: trio.abc.Clock) -> None:
        probe = FakeProbe(cpu_per_s=0.001, io_per_s=10 << 20)
        result, audit, _ = await run(SilentCommand(60), probe=probe)
        assert result.status is Status.OK and decisions(audit, result.run_id) == []

    async def test_a_flat_tree_runs_the_idle_clock(self, autojump_clock: trio.abc.Clock) -> None:
        probe = FakeProbe(cpu_per_s=0.9, stops_at=10)
        result, audit, _ = await run(SilentCommand(600), probe=probe)
        assert result.status is Status.KILLED and result.reason == STALLED
        # Working until 10 s (the 9-10 s sample used 0.9 s of CPU: placed at 9.9 s);
        # then 3 s idle + 1 s grace.
        assert result.runtime_seconds == 13.9
        kill = decisions(audit, result.run_id)[-1]
        proc = kill.payload["evidence"]["process"]
        assert proc["working"] is False and proc["procs"] == 2 and proc["cpu_s"] == 9.0

    async def test_a_tree_blocked_on_stdin_is_waiting_for_input(
            self, autojump_clock: trio.abc.Clock) -> None:
        probe = FakeProbe(cpu_per_s=0.0, reading_stdin=True)
        result, audit, _ = await run(SilentCommand(600), probe=probe)
        assert result.status is Status.KILLED and result.reason == WAITING_INPUT
        assert names(audit, result.run_id) == [("steer", WAITING_INPUT),
                                               ("kill", WAITING_INPUT)]
        assert "4242:n_tty_read" in decisions(audit, result.run_id)[0].payload["detail"]

    async def test_defaults_let_a_quiet_six_minute_build_finish(
            self, autojump_clock: trio.abc.Clock) -> None:
        """`kernel run --timeout 3600 -- make` on a silent but busy 6-minute build: ok."""
        result, audit, _ = await run(SilentCommand(360), CriticPolicy(),
                                     probe=FakeProbe(cpu_per_s=0.8, io_per_s=50_000))
        assert result.status is Status.OK and result.runtime_seconds == 360
        assert decisions(audit, result.run_id) == []

    async def test_defaults_kill_a_dead_silent_flat_process(
            self, autojump_clock: trio.abc.Clock) -> None:
        result, audit, _ = await run(SilentCommand(3000), CriticPolicy(),
                                     probe=FakeProbe(cpu_per_s=0.0))
        assert result.status is Status.KILLED and result.reason == STALLED
        assert result.runtime_seconds == 360  # 300 s idle + 60 s grace
        assert names(audit, result.run_id) == [("steer", STALLED), ("kill", STALLED)]

    async def test_one_sampler_serves_every_run(self, autojump_clock: trio.abc.Clock) -> None:
        probe = FakeProbe(cpu_per_s=0.5)
        critic = WatchCritic(IDLE, probe=probe)
        kernel = Kernel(Ports(critic=critic))
        results: list[Any] = []

        async def one() -> None:
            results.append(await kernel.run(SilentCommand(20), RunInfo(), Limits()))

        async with trio.open_nursery() as nursery:
            for _ in range(50):
                nursery.start_soon(one)
            await trio.sleep(5)
            assert critic.sampler.roots == 1  # 50 runs, one pid: one tree sampled once
        assert all(r.status is Status.OK for r in results)
        assert critic.sampler.roots == 0 and 19 <= critic.sampler.samples <= 22


# --------------------------------------------------------- event-driven


class CountingJudge(RulesJudge):
    calls = 0

    def judge(self, view: RunView) -> Decision | None:
        self.calls += 1
        return super().judge(view)


class LoopingCLIStandIn:
    """A CLI agent in one long step: reports the same tool call again and again (no
    results), takes nudges mid-step, then exits on its own without a checkpoint."""

    def __init__(self) -> None:
        self.started = 0
        self.nudges: list[str] = []

    async def on_steer(self, messages: list[Any]) -> None:
        self.nudges.extend(m.content for m in messages)

    async def step(self, ctx: RunContext) -> Step:
        for _ in range(8):
            self.started += 1
            ctx.tool_start(ToolCall("Bash", {"command": "cat status.txt"}))
            await trio.sleep(1)
        return Step(final=True, output="done")


class TestKillAtOnce:
    async def test_a_cli_loop_is_killed_at_the_tool_start_after_the_nudge(
            self, autojump_clock: trio.abc.Clock) -> None:
        agent = LoopingCLIStandIn()
        result, _, _ = await run(agent)
        assert result.status is Status.KILLED and result.reason == LOOPING
        # Nudged at the 3rd start (delivered mid-step); the 4th start is the kill,
        # and the step is cancelled at its next checkpoint: no 5th start.
        assert len(agent.nudges) == 1 and agent.started == 4
        assert result.runtime_seconds == 3


class TestEventDriven:
    async def test_a_quiet_long_step_costs_a_handful_of_looks(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A 250 s step with output every second: the watch task wakes at the clock rule's
        time, not every poll interval."""
        judge = CountingJudge(CriticPolicy(idle_timeout=300, soft_timeout=None))
        lines = (f"line {i}" for i in itertools.count())
        result, _, _ = await run(Printer(lines, every=1, total=250), judge=judge,
                                 limits=Limits(poll_interval=0.01))
        assert result.status is Status.OK
        assert judge.calls <= 3

    async def test_the_clock_rule_still_fires_on_time(
            self, autojump_clock: trio.abc.Clock) -> None:
        result, _, _ = await run(SilentCommand(600), limits=Limits(poll_interval=3600))
        assert result.status is Status.KILLED and result.runtime_seconds == 4.0


async def test_each_runs_watch_event_carries_the_current_policy() -> None:
    """The `watch` event's policy is the critic's policy as it is when the run starts."""
    audit = MemoryAudit()
    critic = WatchCritic(CriticPolicy(idle_timeout=30))
    kernel = Kernel(Ports(audit=audit, critic=critic))

    async def watched() -> dict[str, Any]:
        result = await kernel.run(ScriptedAgent([Step(final=True)]), RunInfo(name="p"),
                                  Limits(timeout=3600))
        return next(e.payload for e in audit.events(result.run_id)
                    if e.kind == "critic" and e.name == "watch")["policy"]

    first, second = await watched(), await watched()
    assert first == second == CriticPolicy(idle_timeout=30).as_dict()
    critic.policy = CriticPolicy(idle_timeout=90)
    third = await watched()
    assert third == CriticPolicy(idle_timeout=90).as_dict() and third["idle_timeout"] == 90
