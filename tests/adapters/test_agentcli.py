"""The CLI-agent adapter: stream parsing, and whole runs of a scripted stand-in CLI."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from procs import gone

from adapters.agentcli import (
    AgentEvent,
    CLIAgent,
    EventType,
    Lifecycle,
    State,
    Transition,
    parse_line,
)
from kernel import Critic, Kernel, Limits, Ports, RunInfo, Status, Usage
from kernel.testing import AuditEvent, MemoryAudit, ScriptedCritic

FAKE = str(Path(__file__).with_name("fake_agent_cli.py"))
LIMITS = Limits(timeout=20, poll_interval=0.02)




def fake(scenario: str, *extra: str, **kw: Any) -> CLIAgent:
    """An CLIAgent running the stand-in with `scenario`."""
    return CLIAgent([sys.executable, FAKE, scenario, *extra], **kw)


async def run(agent: CLIAgent, critic: Critic | None = None,
              limits: Limits = LIMITS) -> tuple[Any, list[AuditEvent]]:
    audit = MemoryAudit()
    result = await Kernel(Ports(audit=audit, critic=critic)).run(agent, RunInfo(name="cli"),
                                                                  limits)
    return result, audit.events(result.run_id)


def kinds(events: list[AuditEvent], *wanted: str) -> list[AuditEvent]:
    return [e for e in events if e.kind in wanted]


class TestParseLine:
    """Lines of the three dialects become normalised events."""

    def test_claude_code_stream(self) -> None:
        """Claude Code's init, blocks, tool results, deltas and result map to event types."""
        lines = [
            {"type": "system", "subtype": "init", "session_id": "s1", "model": "m"},
            {"type": "assistant", "message": {"content": [
                {"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "Hi"},
                {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}}]}},
            {"type": "user", "message": {"content": [
                {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                 "content": [{"type": "text", "text": "boom"}]}]}},
            {"type": "stream_event", "event": {"type": "content_block_delta", "index": 0,
                                               "delta": {"type": "text_delta", "text": "H"}}},
            {"type": "stream_event", "event": {"type": "message_stop"}},
            {"type": "system", "subtype": "compact_boundary"},
        ]
        events = [e for line in lines for e in parse_line(json.dumps(line))]
        assert [(e.type, e.source) for e in events] == [
            (EventType.SESSION_START, "system/init"),
            (EventType.THINKING, "assistant/thinking"),
            (EventType.TEXT_DELTA, "assistant/text"),
            (EventType.TOOL_USE, "assistant/tool_use"),
            (EventType.TOOL_RESULT, "user/tool_result"),
            (EventType.TEXT_DELTA, "stream_event/text_delta"),
            (EventType.INFO, "stream_event/message_stop"),
            (EventType.INFO, "system/compact_boundary"),
        ]
        assert events[0].session_id == "s1"
        assert (events[3].tool, events[3].tool_id, events[3].input) == (
            "Bash", "t1", {"command": "ls"})
        assert (events[4].text, events[4].is_error) == ("boom", True)
        assert events[2].whole and not events[5].whole

    def test_claude_result_usage_and_errors(self) -> None:
        """A result carries usage (cache tokens count as input) and cost; errors are ERROR."""
        (ok,) = parse_line(json.dumps({
            "type": "result", "subtype": "success", "is_error": False, "result": "done",
            "total_cost_usd": 0.5, "usage": {"input_tokens": 1, "cache_read_input_tokens": 2,
                                              "cache_creation_input_tokens": 3,
                                              "output_tokens": 4}}))
        assert (ok.type, ok.text, ok.usage) == (EventType.DONE, "done", Usage(6, 4, 0, 0.5))
        (bad,) = parse_line(json.dumps({"type": "result", "subtype": "error_max_turns",
                                        "is_error": True}))
        assert (bad.type, bad.text) == (EventType.ERROR, "error_max_turns")

    def test_codex_stream(self) -> None:
        """Codex's thread, turn and item events map to event types."""
        lines = [
            {"type": "thread.started", "thread_id": "th"},
            {"type": "turn.started"},
            {"type": "item.started", "item": {"id": "i1", "type": "command_execution",
                                              "command": "ls"}},
            {"type": "item.completed", "item": {"id": "i1", "type": "command_execution",
                                                "aggregated_output": "x", "exit_code": 2}},
            {"type": "item.started", "item": {"id": "i2", "type": "mcp_tool_call",
                                              "server": "gh", "tool": "search",
                                              "arguments": {"q": "y"}}},
            {"type": "item.updated", "item": {"id": "i3", "type": "agent_message", "text": "O"}},
            {"type": "item.completed", "item": {"id": "i3", "type": "agent_message",
                                                "text": "OK"}},
            {"type": "turn.completed", "usage": {"input_tokens": 9, "output_tokens": 3}},
            {"type": "turn.failed", "error": {"message": "stream disconnected"}},
            {"type": "error", "message": "fatal"},
        ]
        events = [e for line in lines for e in parse_line(json.dumps(line))]
        assert [e.type for e in events] == [
            EventType.SESSION_START, EventType.THINKING, EventType.TOOL_USE,
            EventType.TOOL_RESULT, EventType.TOOL_USE, EventType.TEXT_DELTA,
            EventType.TEXT_DELTA, EventType.DONE, EventType.ERROR, EventType.ERROR]
        assert (events[2].tool, events[2].input) == ("shell", {"command": "ls"})
        assert (events[3].is_error, events[3].text) == (True, "x")
        assert (events[4].tool, events[4].input) == ("gh.search", {"q": "y"})
        assert not events[5].whole and events[6].whole
        assert events[7].usage == Usage(9, 3)
        assert [events[8].text, events[9].text] == ["stream disconnected", "fatal"]

    def test_codex_warnings_and_retries_are_not_the_end(self) -> None:
        """Codex's error item is a warning and `Reconnecting... N/M` a retry; other errors end."""
        lines = [
            {"type": "item.completed", "item": {"id": "item_0", "type": "error",
                                                "message": "Model metadata for `m` not found."}},
            {"type": "error", "message": "Reconnecting... 1/5 (stream disconnected before "
                                         "completion: error decoding response body)"},
            {"type": "item.completed", "item": {"id": "i", "type": "todo_list", "items": [
                {"text": "read", "completed": True}, {"text": "fix", "completed": False}]}},
            {"type": "turn.completed", "usage": {"input_tokens": 300, "cached_input_tokens": 120,
                                                 "output_tokens": 60}},
            {"type": "error", "message": "unexpected status 401 Unauthorized"},
        ]
        events = [e for line in lines for e in parse_line(json.dumps(line))]
        assert [e.type for e in events] == [EventType.WARNING, EventType.RETRY,
                                            EventType.THINKING, EventType.DONE,
                                            EventType.ERROR]
        assert events[0].text == "Model metadata for `m` not found."
        assert events[2].text == "[x] read\n[ ] fix"
        assert (events[3].usage, events[3].cache_read) == (Usage(300, 60), 120)

    def test_claude_retries_approvals_and_bookkeeping(self) -> None:
        """api_retry is a retry, permission_denied and can_use_tool are approvals."""
        lines = [
            {"type": "system", "subtype": "api_retry", "attempt": 1, "max_retries": 10,
             "retry_delay_ms": 500, "error_status": 529, "error": "overloaded_error"},
            {"type": "system", "subtype": "permission_denied", "tool_name": "Bash",
             "tool_use_id": "t1", "message": "needs approval"},
            {"type": "control_request", "request_id": "r1", "request": {
                "subtype": "can_use_tool", "tool_name": "Bash", "input": {"command": "rm x"},
                "description": "Remove x"}},
            {"type": "rate_limit_event", "rate_limit_info": {"status": "allowed_warning"}},
            {"type": "system", "subtype": "status", "status": "requesting"},
            {"type": "stream_event", "event": {"type": "content_block_delta", "index": 0,
                                               "delta": {"type": "input_json_delta",
                                                         "partial_json": "{"}}},
        ]
        events = [e for line in lines for e in parse_line(json.dumps(line))]
        assert [e.type for e in events] == [EventType.RETRY, EventType.APPROVAL,
                                            EventType.APPROVAL, EventType.WARNING,
                                            EventType.INFO, EventType.INFO]
        assert events[0].text == "API request failed (overloaded_error); retry 1/10 in 500 ms"
        assert (events[1].tool, events[1].is_error) == ("Bash", True)
        assert (events[2].tool, events[2].is_error, events[2].input) == (
            "Bash", False, {"command": "rm x"})

    def test_gemini_stream(self) -> None:
        """Gemini CLI's init, messages, tools, warnings and result map to event types."""
        lines = [
            {"type": "init", "session_id": "g1", "model": "gemini-2.5-flash"},
            {"type": "message", "role": "user", "content": "do it"},
            {"type": "tool_use", "tool_name": "read_file", "tool_id": "r1",
             "parameters": {"file_path": "a"}},
            {"type": "tool_result", "tool_id": "r1", "status": "error",
             "error": {"type": "tool_not_registered", "message": "not found"}},
            {"type": "message", "role": "assistant", "content": "Hi ", "delta": True},
            {"type": "error", "severity": "warning", "message": "Loop detected"},
            {"type": "result", "status": "success", "stats": {
                "input_tokens": 200, "output_tokens": 40, "cached": 80}},
            {"type": "result", "status": "error", "error": {"type": "FatalTurnLimitedError",
                                                            "message": "max turns"}},
        ]
        events = [e for line in lines for e in parse_line(json.dumps(line))]
        assert [e.type for e in events] == [
            EventType.SESSION_START, EventType.INFO, EventType.TOOL_USE, EventType.TOOL_RESULT,
            EventType.TEXT_DELTA, EventType.WARNING, EventType.DONE, EventType.ERROR]
        assert events[0].session_id == "g1"
        assert (events[2].tool, events[2].tool_id, events[2].input) == (
            "read_file", "r1", {"file_path": "a"})
        assert (events[3].is_error, events[3].text) == (True, "not found")
        assert not events[4].whole
        assert (events[6].usage, events[6].cache_read) == (Usage(200, 40), 80)
        assert (events[7].is_error, events[7].text) == (True, "max turns")

    def test_plain_dialect(self) -> None:
        """The normalised types themselves parse, with their fields."""
        (use,) = parse_line('{"type": "tool_use", "tool": "grep", "id": "7", "input": {"p": 1}}')
        assert (use.type, use.tool, use.tool_id, use.input) == (
            EventType.TOOL_USE, "grep", "7", {"p": 1})
        (done,) = parse_line('{"type": "done", "text": "bye", "usage": {"input_tokens": 2},'
                             ' "cost_usd": 0.1}')
        assert (done.type, done.text, done.usage) == (EventType.DONE, "bye", Usage(2, 0, 0, 0.1))

    @pytest.mark.parametrize(("line", "source"), [
        ('{"type": "heartbeat"}', "heartbeat"),
        ("not json at all", "text"),
        ("[1, 2]", "json-list"),
        ('{"no_type": 1}', "untyped"),
        ('{"type": "assistant", "message": {"content": []}}', "assistant"),
    ])
    def test_anything_else_is_unknown(self, line: str, source: str) -> None:
        """New types, non-JSON lines and empty messages are UNKNOWN, never an exception."""
        assert parse_line(line) == [AgentEvent(EventType.UNKNOWN, source=source,
                                               text=line if source == "text" else "")]

    def test_blank_lines_are_nothing(self) -> None:
        """A blank line yields no event."""
        assert parse_line("  \r") == []


@pytest.mark.realtime
class TestAgentCLIRun:
    """Whole runs of the stand-in CLI under the kernel."""

    async def test_claude_stream_run(self) -> None:
        """A realistic Claude Code stream ends ok with its result and usage, every event audited."""
        critic = ScriptedCritic()
        result, events = await run(fake("claude"), critic)
        assert result.status is Status.OK, result.error
        assert result.output == "There are two files: a.txt and b.txt."
        assert result.usage == Usage(200, 40, 0, 0.0123)
        assert result.exit_code == 0

        (start,) = kinds(events, "tool_start")
        assert (start.name, start.payload["state"], start.payload["lifecycle"]) == (
            "Bash", "running_tool", "working")
        assert start.payload["args"] == {"command": "ls", "description": "List files"}
        (end,) = kinds(events, "tool_end")
        assert end.name == "Bash" and end.payload["output"] == "a.txt\nb.txt"
        # Paired with its tool_use by id, so it has a duration.
        assert end.payload["state"] == "thinking" and end.duration_ms is not None
        assert end.duration_ms >= 0

        agent_events = kinds(events, "agent_event")
        first = agent_events[0]  # the delta that arrived before the init
        assert (first.name, first.payload["state"], first.payload["lifecycle"],
                first.payload["from"]) == ("text_delta", "responding", "working", "idle")
        info = next(e for e in agent_events if e.payload["source"] == "rate_limit_event")
        assert (info.name, info.payload["state"]) == ("info", "responding")
        done = agent_events[-1]
        assert (done.name, done.payload["state"], done.payload["lifecycle"]) == (
            "done", "idle", "idle")
        assert all({"state", "lifecycle"} <= e.payload.keys()
                   for e in [*agent_events, *kinds(events, "process_start", "process_exit")])
        (exit_event,) = kinds(events, "process_exit")
        assert exit_event.payload["lifecycle"] == "killed"
        (step,) = kinds(events, "step")
        assert step.payload["events"]["tool_use"] == 1
        assert step.payload["session_id"] == "5f1c2a9e-0000-4000-8000-000000000001"
        handle = critic.handles[0]
        # The CLI's tool use reaches the critic as a tool call (loop evidence), not noise.
        assert [(c.name, dict(c.args)) for c in handle.tool_starts] == [
            ("Bash", {"command": "ls", "description": "List files"})]
        assert result.tool_calls == 1
        assert handle.activities.count("agent_event") == len(agent_events)

    async def test_codex_stream_run(self) -> None:
        """A Codex stream ends ok with the last agent message and the turn's usage."""
        result, events = await run(fake("codex"))
        assert result.status is Status.OK, result.error
        assert result.output == "One file: a.txt."
        assert result.usage == Usage(2400, 60)
        assert [e.name for e in kinds(events, "tool_start", "tool_end")] == ["shell", "shell"]
        todo = next(e for e in kinds(events, "agent_event")
                    if e.payload["source"] == "item.completed/todo_list")
        assert todo.name == "thinking"

    async def test_reordered_stream_is_followed_leniently(self) -> None:
        """Out-of-order deltas and tool events, unknown types and non-JSON lines all pass."""
        seen: list[tuple[AgentEvent, Transition]] = []
        agent = fake("reordered", on_event=lambda ev, tr: seen.append((ev, tr)))
        result, _ = await run(agent)
        assert result.status is Status.OK and result.output == "Hello"
        assert [(ev.type.value, tr.state_to.value, tr.lifecycle_to.value)
                for ev, tr in seen] == [
            ("text_delta", "responding", "working"),
            ("session_start", "responding", "working"),
            ("tool_result", "thinking", "working"),
            ("tool_use", "running_tool", "working"),
            ("unknown", "running_tool", "working"),
            ("unknown", "running_tool", "working"),
            ("text_delta", "responding", "working"),
            ("done", "idle", "idle"),
        ]
        assert agent.machine.lifecycle is Lifecycle.KILLED
        assert agent.machine.state is State.IDLE

    async def test_crash_mid_turn_ends_error(self) -> None:
        """A CLI dying mid-turn ends `error`, naming its state and its last stderr line."""
        result, events = await run(fake("crash"))
        assert result.status is Status.ERROR
        assert result.error == ("agent CLI exited with code 3 mid-turn (state running_tool, "
                                "no result event): Error: connection to the API was lost")
        assert result.exit_code == 3
        (stderr,) = [e for e in kinds(events, "output") if e.name == "stderr"]
        assert stderr.payload["line"] == "Error: connection to the API was lost"
        assert stderr.payload["state"] == "running_tool"

    async def test_hang_is_killed_after_the_idle_ttl(self, tmp_path: Path) -> None:
        """A CLI that goes silent is killed with its children after idle_ttl seconds."""
        pidfile = tmp_path / "child.pid"
        agent = fake("hang", str(pidfile), idle_ttl=0.8, grace=0.5)
        t0 = time.monotonic()
        result, events = await run(agent)
        assert 0.8 <= time.monotonic() - t0 < 30  # the upper margin is for a loaded machine
        assert result.status is Status.KILLED and result.reason == "stalled"
        assert result.error is not None and result.error.startswith("agent CLI idle for ")
        assert "(idle TTL 0.8s, state thinking): killed" in result.error
        (kill,) = kinds(events, "idle_kill")
        assert kill.payload["state"] == "thinking" and kill.payload["idle_s"] >= 0.8
        (exit_event,) = kinds(events, "process_exit")
        assert exit_event.payload["signal"] == 15 and exit_event.payload["idle_killed"]
        assert await gone(int(pidfile.read_text()))
        assert agent.machine.lifecycle is Lifecycle.KILLED

    async def test_start_has_its_own_bound(self) -> None:
        """Before its first event a CLI gets start_ttl, not idle_ttl; then it is killed."""
        agent = CLIAgent([sys.executable, "-c", "import time; time.sleep(30)"],
                         idle_ttl=0.3, start_ttl=1.5, grace=0.5)
        t0 = time.monotonic()
        result, events = await run(agent)
        assert time.monotonic() - t0 >= 1.5
        assert result.status is Status.KILLED and result.reason == "stalled"
        assert result.error is not None
        assert result.error.startswith("agent CLI produced no event in ")
        assert result.error.endswith("after its start (start TTL 1.5s): killed")
        (kill,) = kinds(events, "idle_kill")
        assert kill.payload["before_first_event"] is True

    async def test_critic_kill_stops_the_whole_group(self, tmp_path: Path) -> None:
        """A critic kill mid-turn ends `killed` and leaves no process of the CLI behind."""
        pidfile = tmp_path / "child.pid"
        agent = fake("hang", str(pidfile), grace=0.5)
        result, events = await run(agent, ScriptedCritic(kill_after=0.8, reason="stalled"))
        assert result.status is Status.KILLED and result.reason == "stalled"
        assert await gone(int(pidfile.read_text()))
        assert agent.machine.lifecycle is Lifecycle.KILLED
        # The audit says how the CLI ended although its turn never finished.
        (ended,) = kinds(events, "process_exit")
        assert ended.payload["stopped"] is True and ended.payload["signal"] in (9, 15)

    async def test_real_critic_kills_a_silent_cli_as_stalled(self, tmp_path: Path) -> None:
        """With the watch-nursery critic, a CLI gone silent ends `killed` (stalled), group gone."""
        from batteries.critic import CriticPolicy, WatchCritic

        pidfile = tmp_path / "child.pid"
        # model_timeout=None: the request the CLI has in flight is left to the idle rule.
        # An idle clock of seconds, not tenths: a loaded machine can pause the fake CLI's
        # start-up longer than 0.6 s (it once failed so beside the critic corpus).
        critic = WatchCritic(CriticPolicy(idle_timeout=3.0, grace=1.0, model_timeout=None))
        result, events = await run(fake("hang", str(pidfile), grace=0.5), critic)
        assert result.status is Status.KILLED and result.reason == "stalled"
        assert [e.name for e in kinds(events, "critic")][-2:] == ["steer", "kill"]
        assert await gone(int(pidfile.read_text()))

    async def test_model_request_in_flight_is_bounded_by_model_timeout(
            self, tmp_path: Path) -> None:
        """A CLI silent mid-reply (a model request in flight, as its stream shows) is
        judged by the critic's model_timeout, not its idle clock: killed model_timeout."""
        from batteries.critic import CriticPolicy, WatchCritic

        pidfile = tmp_path / "child.pid"
        critic = WatchCritic(CriticPolicy(idle_timeout=5.0, grace=5.0, model_timeout=1.0))
        result, _ = await run(fake("hang", str(pidfile), grace=0.5), critic)
        assert (result.status, result.reason) == (Status.KILLED, "model_timeout"), result.error
        assert await gone(int(pidfile.read_text()))

    async def test_error_result_ends_error(self) -> None:
        """A result event reporting failure ends the run `error` with the CLI's reason."""
        result, _ = await run(fake("error-result"))
        assert result.status is Status.ERROR
        assert result.error == "agent CLI reported an error: error_max_turns"
        assert result.usage == Usage(200, 40, 0, 0.0123)

    async def test_lingering_cli_is_stopped_after_its_result(self) -> None:
        """A CLI still alive after its result is killed (SIGKILL if it ignores SIGTERM); ok."""
        t0 = time.monotonic()
        result, events = await run(fake("linger", exit_grace=0.3, grace=0.3))
        assert time.monotonic() - t0 < 30  # it lingers forever unless stopped
        assert result.status is Status.OK and result.output == "finished early"
        (exit_event,) = kinds(events, "process_exit")
        assert exit_event.payload["stopped_after_done"] and exit_event.payload["signal"] == 9

    async def test_agent_carrying_on_after_an_error_event_is_not_stopped(self) -> None:
        """An error event followed by more work is transient: the last end (done) decides."""
        result, events = await run(fake("transient-error", exit_grace=0.5))
        assert result.status is Status.OK and result.output == "Recovered."
        (exit_event,) = kinds(events, "process_exit")
        assert not exit_event.payload["stopped_after_done"]
        assert exit_event.payload["exit_code"] == 0

    async def test_clean_exit_without_result_is_ok(self) -> None:
        """A CLI that exits 0 without a result event succeeds with the text it streamed."""
        result, _ = await run(fake("no-result"))
        assert result.status is Status.OK and result.output == "partial answer"

    async def test_missing_executable(self) -> None:
        """A command that does not exist ends `error` (exit 127) without a traceback."""
        result, _ = await run(CLIAgent(["no-such-agent-cli-xyz", "-p", "hi"]))
        assert result.status is Status.ERROR and result.exit_code == 127
        assert result.error is not None
        assert result.error.startswith("cannot start 'no-such-agent-cli-xyz'")
        assert result.traceback is None

    async def test_steer_goes_to_stdin_when_enabled(self) -> None:
        """With stdin_steer a critic nudge is written as a stream-json user message."""
        critic = ScriptedCritic(steer_at_step={0: "use pytest -x"})
        result, events = await run(fake("steer", stdin_steer=True), critic)
        assert result.status is Status.OK and result.output == "heard: use pytest -x"
        assert kinds(events, "steer_delivered")[0].payload["via"] == "stdin"

    async def test_steer_is_audited_as_undeliverable_otherwise(self) -> None:
        """Without stdin_steer the nudge is recorded as undeliverable, and the run goes on."""
        critic = ScriptedCritic(steer_at_step={0: "hurry"})
        result, events = await run(fake("claude"), critic)
        assert result.status is Status.OK
        (undeliverable,) = kinds(events, "steer_undeliverable")
        assert undeliverable.payload["messages"] == ["hurry"]

    async def test_audit_volume_is_capped(self) -> None:
        """Past max_audit_events, agent events only count as activity; tool events stay."""
        critic = ScriptedCritic()
        result, events = await run(fake("claude", max_audit_events=3), critic)
        assert result.status is Status.OK
        assert len(kinds(events, "agent_event", "output")) == 3
        assert len(kinds(events, "tool_start", "tool_end")) == 2
        assert critic.handles[0].activities.count("agent_event") >= 8

    async def test_dry_run_executes_nothing(self) -> None:
        """A dry run names the command and starts no process."""
        result, events = await run(fake("claude"), limits=Limits(dry_run=True))
        assert result.status is Status.DRY_RUN
        assert str(result.output).startswith("would run agent CLI: ")
        assert not kinds(events, "process_start")


class TestStdinAndUsage:
    """The task written on stdin, and usage reported as the stream goes (review fixes)."""

    async def test_cli_exiting_before_reading_its_task_keeps_code_and_stderr(self) -> None:
        """A CLI that exits before reading its stdin: its exit code and stderr are the
        error, not a BrokenResourceError (the task is bigger than a pipe holds, so the
        write is still waiting when the CLI exits)."""
        agent = CLIAgent(["sh", "-c", "echo 'error: unknown option --frobnicate' >&2; exit 3"],
                         stdin_prompt="x" * 200_000, stdin_steer=True)
        result, events = await run(agent)
        assert result.status is Status.ERROR and result.exit_code == 3
        assert result.error is not None
        assert "exited with code 3 before reading its input" in result.error
        assert "unknown option --frobnicate" in result.error
        assert "BrokenResourceError:" not in result.error.split("(")[0]
        assert kinds(events, "process_exit")

    async def test_cli_not_reading_its_task_is_still_watched(self) -> None:
        """A big task to a CLI that never reads stdin does not block the step before the
        watchdog runs: the start TTL stops it (`killed`, stalled; blocked in the write, it
        ran to the run's 20 s timeout, `timeout`)."""
        agent = CLIAgent(["sleep", "30"], stdin_prompt="x" * 200_000, stdin_steer=True,
                         idle_ttl=1.0, start_ttl=1.0, grace=0.5)
        result, _ = await run(agent)
        assert (result.status, result.reason) == (Status.KILLED, "stalled"), result.error

    async def test_streamed_usage_is_on_record_when_the_run_is_killed(self) -> None:
        """Claude Code's per-message usage is counted as it streams: a run the critic
        kills mid-step (no Step comes back) still has its tokens in a `usage` event."""
        critic = ScriptedCritic(kill_at_tool="Halt", reason="looping")
        result, events = await run(fake("usage_loop"), critic)
        assert result.status is Status.KILLED
        (usage,) = kinds(events, "usage")
        assert usage.payload["stopped"] is True and usage.payload["final_report"] is False
        assert usage.payload["input_tokens"] >= 2 * 1300  # two messages, cache included
        assert usage.payload["output_tokens"] >= 2 * 70

    async def test_a_token_cap_stops_the_cli_as_its_usage_streams(self) -> None:
        """Usage reaches the kernel as it streams (`ctx.report_usage`): a run capped at
        2,000 tokens ends `budget_exceeded` at the second message, long before the
        session would end (it sleeps 30 s after it; before, the run's 20 s timeout
        ended it, the cap unseen), with the tokens in its result."""
        result, events = await run(fake("usage_loop"),
                                   limits=dataclasses.replace(LIMITS, max_total_tokens=2000))
        assert (result.status, result.reason) == (Status.BUDGET_EXCEEDED, "max_total_tokens")
        assert result.usage.total_tokens > 2000
        (usage,) = kinds(events, "usage")
        assert usage.payload["stopped"] is True

    async def test_usage_from_messages_when_the_cli_crashes(self) -> None:
        """No closing result: the step's usage is what the messages streamed."""
        result, _ = await run(fake("usage_crash"))
        assert result.status is Status.ERROR
        assert (result.usage.input_tokens, result.usage.output_tokens) == (1300, 70)
