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
from fake_models import ListDir, ReadFile, Reply, Say, Think
from harness import run_client

from kernel import Status

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
