"""Review fixes, checked against the real clients: usage seen as it streams, a hung
stream bounded by the critic's model_timeout, and tasks that look like options.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_models import ListDir, Reply, Say
from harness import run_client

from batteries.critic import CriticPolicy, WatchCritic
from kernel import Status

pytestmark = pytest.mark.realtime

ALL = ["claude", "codex", "gemini"]
BIG = (200_000, 20_000, 0, 0)


@pytest.mark.parametrize("client", ALL)
async def test_hung_stream_is_killed_model_timeout_with_usage_on_record(
        client: str, tmp_path: Path) -> None:
    """Two tool turns, then the model hangs mid-answer: the stream shows a request in
    flight, so the critic's model_timeout (not its idle clock, not the adapter's) ends
    the run; the run is cancelled mid-step, and the tokens streamed so far are still
    on record in its `usage` event (Claude Code streams them per message)."""
    replies = [Reply([ListDir(".")], usage=BIG), Reply([ListDir(".")], usage=BIG),
               Reply([Say("Let me think about what these files mean")], hang_after=2,
                     usage=BIG)]
    critic = WatchCritic(CriticPolicy(idle_timeout=None, soft_timeout=None, model_timeout=3))
    out = await run_client(client, replies, tmp_path, critic=critic, idle_ttl=60.0)
    r = out.result
    assert (r.status, r.reason) == (Status.KILLED, "model_timeout"), (r.error,
                                                                       out.agent_events())
    assert out.server.model_requests == 3
    (usage,) = out.kinds("usage")
    assert usage.payload["stopped"] is True
    if client == "claude":
        # Three messages started (the third hung after its first frames), two finished.
        assert usage.payload["input_tokens"] == 600_000
        assert usage.payload["output_tokens"] >= 40_000
        assert usage.payload["final_report"] is False
        assert any("message_usage" in (e.payload or {}) for e in out.events)


async def test_claude_final_report_supersedes_the_streamed_usage(tmp_path: Path) -> None:
    """A run that ends by itself counts the closing result's usage (with cost), not the
    streamed figures on top of it."""
    replies = [Reply([ListDir(".")], usage=(1000, 200, 0, 0)),
               Reply([Say("All done here.")], usage=(3000, 50, 0, 0))]
    out = await run_client("claude", replies, tmp_path)
    r = out.result
    assert r.status is Status.OK, (r.error, out.agent_events())
    assert (r.usage.input_tokens, r.usage.output_tokens) == (4000, 250)
    assert r.usage.cost_usd > 0
    (usage,) = out.kinds("usage")
    assert usage.payload["final_report"] is True and usage.payload["stopped"] is False
    streamed = [e.payload["usage_so_far"] for e in out.events
                if e.payload and "usage_so_far" in e.payload]
    assert streamed and streamed[-1]["input_tokens"] == 4000  # seen before the result


@pytest.mark.parametrize("client", ALL)
async def test_task_starting_with_a_dash_is_the_task(client: str, tmp_path: Path) -> None:
    """A task that looks like an option ("--version") reaches the model as the task."""
    out = await run_client(client, [Reply([Say("Noted.")])], tmp_path, prompt="--version")
    r = out.result
    assert r.status is Status.OK, (r.error, out.agent_events())
    assert out.server.model_requests >= 1
    assert "--version" in json.dumps(out.server.model_bodies()[0])
    assert r.output == "Noted."
