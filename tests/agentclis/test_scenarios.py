"""The scenario matrix: each installed real agent CLI against a scripted fake model server.

Every scenario runs the real client process (pinned, offline, HOME in a temp dir) under
the kernel with the real critic, and checks what the kernel reports: final status and
reason, exit code, the tool calls with their names and durations, tokens (cache
included), cost where the client reports it, and that every event was understood.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_models import ListDir, ReadFile, Reply, Say, Shell, Think
from harness import run_client

from batteries.audit.queries import summarize
from batteries.critic import CriticPolicy, WatchCritic
from kernel import Status
from kernel.testing import ScriptedCritic
from kernel_cli.progress import Progress, ProgressAudit

pytestmark = pytest.mark.realtime

ALL = ["claude", "codex", "gemini"]
TOOL_NAMES = {"claude": ["Bash", "Bash"], "codex": ["shell", "shell"],
              "gemini": ["list_directory", "read_file"]}

TWO_TOOLS = [
    Reply([Think("List the files first."), ListDir(".")], usage=(100, 20, 40, 10)),
    Reply([ReadFile("notes.txt")], usage=(150, 20, 60, 0)),
    Reply([Say("notes.txt says: remember the milk.")], usage=(200, 30, 80, 0)),
]


@pytest.mark.parametrize("client", ALL)
async def test_two_tool_calls_and_an_answer(client: str, tmp_path: Path) -> None:
    """Two tool calls and a final answer end ok, with tools, tokens, cost and no unknowns."""
    out = await run_client(client, TWO_TOOLS, tmp_path)
    r = out.result
    assert r.status is Status.OK, (r.error, out.agent_events())
    assert r.exit_code == 0
    assert "remember the milk" in str(r.output)
    assert out.unknown() == []
    tools = out.tools()
    assert [name for name, _ in tools] == TOOL_NAMES[client]
    assert all(d is not None and d >= 0 for _, d in tools)
    # The tools really ran: the file's content went back to the model.
    assert "remember the milk" in json.dumps(out.server.model_bodies()[-1])
    if client != "gemini":  # Gemini CLI does not put a tool's output on its stream
        assert "remember the milk" in str(out.kinds("tool_end")[1].payload["output"])
    assert r.tool_calls == 2
    (step,) = out.kinds("step")
    assert step.payload["session_id"]
    assert step.payload["cache_read_tokens"] == 180
    if client == "claude":
        # Claude Code reports input without the cache; the kernel counts it in.
        assert r.usage.input_tokens == 450 + 180 + 10
        assert r.usage.output_tokens == 70
        assert r.usage.cost_usd > 0
        assert step.payload["cache_write_tokens"] == 10
    else:
        assert r.usage.input_tokens == 450
        assert r.usage.output_tokens == 70
    if client != "gemini":  # Gemini CLI keeps the model's thoughts off its stream
        assert "thinking" in out.agent_events()
    if client == "codex":  # its non-fatal warning item: audited with its message, not fatal
        (warning,) = [e for e in out.kinds("agent_event") if e.name == "warning"]
        assert warning.payload["text"].startswith("Model metadata for `fake-model` not found")


@pytest.mark.parametrize("client", ALL)
async def test_model_hanging_mid_stream_is_killed_stalled(client: str, tmp_path: Path) -> None:
    """A model that stops mid-answer leaves the client silent: killed, reason stalled."""
    replies = [Reply([ListDir(".")]),
               Reply([Say("Let me think about what these files mean")], hang_after=3)]
    out = await run_client(client, replies, tmp_path, idle_ttl=6.0, grace=2.0)
    r = out.result
    assert (r.status, r.reason) == (Status.KILLED, "stalled"), (r.error, out.agent_events())
    assert out.server.model_requests == 2  # it hung in the second request, mid-stream
    # SIGTERM: Gemini CLI catches it and exits 0; the others die of it (128 + 15).
    assert r.exit_code == (0 if client == "gemini" else 143)
    assert r.error is not None and "idle for" in r.error
    assert [name for name, _ in out.tools()] == TOOL_NAMES[client][:1]
    assert out.unknown() == []
    (kill,) = out.kinds("idle_kill")
    assert kill.payload["idle_s"] >= 6.0


@pytest.mark.parametrize("client", ALL)
async def test_model_repeating_one_tool_call_is_killed_looping(client: str,
                                                               tmp_path: Path) -> None:
    """The same call forever: the critic nudges, then kills `looping`, and nothing starts after."""
    loop = Reply([ListDir(".")], frame_delay=0.05)
    out = await run_client(client, [loop], tmp_path, repeat_last=True)
    r = out.result
    assert (r.status, r.reason) == (Status.KILLED, "looping"), (r.error, out.agent_events())
    assert out.unknown() == []
    kinds = [(e.kind, e.name) for e in out.events]
    verdict = kinds.index(("critic", "kill"))
    assert ("critic", "steer") in kinds[:verdict]
    # The call the verdict judged is audited right after it; none starts after that.
    assert kinds[verdict + 1] == ("tool_start", TOOL_NAMES[client][0])
    assert "tool_start" not in [k for k, _ in kinds[verdict + 2:]]
    starts = out.kinds("tool_start")
    assert len(starts) >= 4 and {e.name for e in starts} == {TOOL_NAMES[client][0]}
    delivered = "steer_delivered" if client == "claude" else "steer_undeliverable"
    assert out.kinds(delivered)


@pytest.mark.parametrize("client", ALL)
async def test_dropped_requests_are_retried_by_the_client(client: str, tmp_path: Path) -> None:
    """Connections reset before any answer: the client retries by itself and the run is ok."""
    replies = [Reply(drop=True), Reply(drop=True),
               Reply([Say("Recovered after the dropped requests.")])]
    out = await run_client(client, replies, tmp_path, idle_ttl=60.0)
    r = out.result
    assert r.status is Status.OK, (r.error, out.agent_events())
    assert r.exit_code == 0 and r.output == "Recovered after the dropped requests."
    assert out.server.model_requests == 3
    assert out.unknown() == []
    assert r.usage.output_tokens == 20
    if client == "claude":  # the only one that reports its retries on the stream
        assert out.agent_events().count("retry") == 2


SLOW = Reply([Think("Step one."), Think("Step two."), Think("Step three."),
              Think("Step four."), Say("Done slowly.")], frame_delay=0.6)


@pytest.mark.parametrize("client", ALL)
async def test_slow_model_longer_than_the_idle_window_ends_ok(client: str,
                                                              tmp_path: Path) -> None:
    """An answer streaming for longer than the idle window is alive the whole time: ok."""
    # The stream lasts ~8-9 s whatever the load (the server paces it); the idle window
    # is 5 s, so the run outlives it only by staying alive on the stream's events.
    out = await run_client(client, [SLOW], tmp_path, idle_ttl=5.0)
    r = out.result
    assert r.status is Status.OK, (r.error, out.agent_events())
    assert r.output == "Done slowly."
    (step,) = out.kinds("step")
    assert step.duration_ms is not None and step.duration_ms > 5000
    assert not out.kinds("idle_kill") and out.unknown() == []


@pytest.mark.parametrize("client", ALL)
async def test_transient_error_then_success_ends_ok(client: str, tmp_path: Path) -> None:
    """A stream cut mid-answer, then a good one: the retry is not the end of the turn."""
    replies = [Reply([Say("This answer will be cut off.")], cut_after=3),
               Reply([Say("Recovered after a transient error.")])]
    out = await run_client(client, replies, tmp_path, idle_ttl=60.0, exit_grace=1.0)
    r = out.result
    assert r.status is Status.OK, (r.error, out.agent_events())
    assert r.exit_code == 0
    # Gemini CLI streams the cut-off text before retrying, and keeps it in its answer.
    assert str(r.output).endswith("Recovered after a transient error.")
    assert out.unknown() == []
    (exit_event,) = out.kinds("process_exit")
    assert not exit_event.payload["stopped_after_done"]  # it exited by itself
    if client in ("claude", "codex"):
        retries = [e for e in out.kinds("agent_event") if e.name == "retry"]
        assert retries, out.agent_events()
    if client == "codex":
        assert "Reconnecting... 1/" in retries[0].payload["text"]


NEEDS_APPROVAL = [Reply([Shell("touch made-by-agent.txt")]),
                  Reply([Say("I could not create the file.")])]


class StateSpy(Progress):
    """The live progress line's state, every value it took."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        super().__init__("spy", None)

    @property  # type: ignore[override]
    def state(self) -> str:
        return self.seen[-1]

    @state.setter
    def state(self, value: str) -> None:
        if not self.seen or self.seen[-1] != value:
            self.seen.append(value)


async def test_claude_waiting_for_approval_is_its_own_state_and_reason(
        tmp_path: Path) -> None:
    """Claude asking for approval (stdio prompt) is `waiting_for_approval`, not a stall.

    The critic's idle timeout is far shorter than the wait: it is told the agent is alive
    and waiting, and the approval bound ends the run with its own reason. The live
    progress and `kernel show` say what the agent was doing at each moment.
    """
    critic = WatchCritic(CriticPolicy(idle_timeout=3.0, grace=1.0, soft_timeout=None))
    spy = StateSpy()
    replies = [Reply([Think("The user wants a file."), Say("I will create it."),
                      Shell("touch made-by-agent.txt")]), *NEEDS_APPROVAL[1:]]
    out = await run_client("claude", replies, tmp_path, critic=critic,
                           permission_prompt=True, approval_ttl=8.0,
                           wrap_audit=lambda audit: ProgressAudit(audit, spy))
    states = [s.split("/")[1] for s in spy.seen if s.startswith("working/")]
    assert [s for s in dict.fromkeys(states)] == [
        "idle", "thinking", "responding", "running_tool", "waiting_for_approval"], spy.seen
    shown = [summarize(e.kind, e.payload) for e in out.kinds("approval")]
    assert shown == ["[working/waiting_for_approval] Run a command"]
    r = out.result
    assert (r.status, r.reason) == (Status.KILLED, "awaiting_approval"), r.error
    assert r.error is not None and "for approval of Bash (approval TTL 8s)" in r.error
    (ask,) = out.kinds("approval")
    assert (ask.name, ask.payload["state"], ask.payload["denied"]) == (
        "Bash", "waiting_for_approval", False)
    assert ask.payload["args"]["command"] == "touch made-by-agent.txt"
    (timeout,) = out.kinds("approval_timeout")
    assert timeout.payload["waited_s"] >= 8.0
    assert not [e for e in out.kinds("critic") if e.name in ("steer", "kill")]
    assert not (tmp_path / "work" / "made-by-agent.txt").exists()
    assert out.unknown() == []


@pytest.mark.parametrize("client", ALL)
async def test_tool_needing_approval_unattended(client: str, tmp_path: Path) -> None:
    """Left to itself, each client refuses a tool needing approval; the run goes on, ok.

    Claude Code denies it (a `permission_denied` event: an approval, denied); Gemini CLI
    does not offer its shell tool without approval (the call fails); Codex runs it in
    its read-only sandbox, which refuses the write, and puts no item for it on its
    stream at all (0.169.0): only the model hears of it.
    """
    out = await run_client(client, NEEDS_APPROVAL, tmp_path)
    r = out.result
    assert r.status is Status.OK, (r.error, out.agent_events())
    assert r.output == "I could not create the file."
    assert not (tmp_path / "work" / "made-by-agent.txt").exists()
    assert out.unknown() == []
    if client == "claude":
        (denied,) = out.kinds("approval")
        assert (denied.name, denied.payload["denied"]) == ("Bash", True)
        assert "approval" in denied.payload["text"]
    if client in ("claude", "gemini"):
        (end,) = out.kinds("tool_end")
        assert end.payload["error"]
    if client == "codex":
        assert "Read-only file system" in json.dumps(out.server.model_bodies()[-1])


NUDGE = "Also run the linter before you finish."


@pytest.mark.parametrize("client", ALL)
async def test_nudge_mid_run(client: str, tmp_path: Path) -> None:
    """A nudge mid-run reaches Claude Code (stream-json on stdin) and the model sees it;
    the other clients take no input mid-run, so it is audited as undeliverable."""
    critic = ScriptedCritic(steer_after={1.0: NUDGE})
    replies = [Reply([Think("Working through the files one by one."),
                      Say("First pass done.")], frame_delay=0.4),
               Reply([Say("Linter noted, finishing.")])]
    out = await run_client(client, replies, tmp_path, critic=critic, repeat_last=True)
    r = out.result
    assert r.status is Status.OK, (r.error, out.agent_events())
    assert out.unknown() == []
    if client == "claude":
        (sent,) = out.kinds("steer_delivered")
        assert sent.payload == {"messages": [NUDGE], "via": "stdin"}
        assert any(NUDGE in json.dumps(b) for b in out.server.model_bodies())
        assert r.output == "Linter noted, finishing."
    else:
        (lost,) = out.kinds("steer_undeliverable")
        assert lost.payload["messages"] == [NUDGE]
        assert "not a stream-json input" in lost.payload["why"]
        assert not any(NUDGE in json.dumps(b) for b in out.server.model_bodies())


@pytest.mark.parametrize("client", ALL)
async def test_turn_failure_ends_error(client: str, tmp_path: Path) -> None:
    """A turn the client gives up on ends `error` with the client's reason.

    Claude Code retries every API error by itself, so its failure here is its turn limit
    (`--max-turns 1` and a model that wants a tool: `error_max_turns`); Codex and Gemini
    CLI fail the turn on a 400 from the model API.
    """
    if client == "claude":
        out = await run_client(client, [Reply([ListDir(".")])], tmp_path, max_turns=1,
                               repeat_last=True)
        expected = "Reached maximum number of turns (1)"
    else:
        out = await run_client(client, [Reply(status=400)], tmp_path)
        expected = "fake 400"
    r = out.result
    assert r.status is Status.ERROR, (r.error, out.agent_events())
    assert r.error is not None and r.error.startswith("agent CLI reported an error: ")
    assert expected in r.error
    assert out.agent_events()[-1] == "error"
    assert out.unknown() == []
    if client == "claude":
        assert r.usage.cost_usd > 0  # a failed turn still reports what it cost
