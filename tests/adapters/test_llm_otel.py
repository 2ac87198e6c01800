"""OpenTelemetry export of an LLM run, received by a real OTLP/HTTP receiver on 127.0.0.1.

The run: the model asks for `read_file(a.txt)` twice, gets the same answer
twice, and the watch critic kills it `looping`. Live (`OTelAudit` teed with the
DuckDB audit, and `kernel run --otlp`) and after the fact (`kernel export
--otlp` of the stored run) must produce the same trace shape.
"""

# The fixtures `otlp` and `chat_server` are imported, and test arguments name them.
# ruff: noqa: F811
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from otlp_receiver import Receiver, Span, otlp  # noqa: F401 - the fixture
from test_llm import ChatServer, Reply, call, chat_server, completion, make_agent  # noqa: F401

from batteries.audit import DuckDBAudit
from batteries.critic import CriticPolicy, WatchCritic
from batteries.otel import OTelAudit
from batteries.tee import TeeAudit
from kernel import Kernel, Limits, Ports, RunInfo, Status

LIMITS = Limits(max_steps=20, timeout=60, poll_interval=0.02, tool_timeout=10)


def script_two_calls_then_hang(server: ChatServer, workdir: Path) -> None:
    """Two identical tool calls with usage, then a reply slow enough to be killed in."""
    (workdir / "a.txt").write_text("same as before")
    server.script(
        completion(None, call("call_1", "read_file", {"path": "a.txt"}),
                   prompt_tokens=11, completion_tokens=3),
        completion(None, call("call_2", "read_file", {"path": "a.txt"}),
                   prompt_tokens=13, completion_tokens=4),
        then=Reply(completion("too late"), delay=30))


def check_trace(spans: list[Span], run_id: str) -> None:
    """The trace of the killed run: names, parent/child links and GenAI attributes."""
    [root] = [s for s in spans if s.name.startswith("invoke_agent")]
    assert root.name == "invoke_agent researcher"
    assert root.parent_id == ""
    assert root.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert root.attributes["gen_ai.agent.name"] == "researcher"
    assert root.attributes["gen_ai.request.model"] == "test-model"
    assert root.attributes["kernel.run_id"] == run_id
    assert root.attributes["kernel.status"] == "killed"
    assert root.attributes["error.type"] == "killed"
    assert root.attributes["gen_ai.usage.input_tokens"] == 24
    assert root.attributes["gen_ai.usage.output_tokens"] == 7
    assert root.status_code == 2  # STATUS_CODE_ERROR
    children = [s for s in spans if s is not root]
    assert {s.trace_id for s in spans} == {root.trace_id}
    assert all(s.parent_id == root.span_id for s in children)

    chats = sorted((s for s in children if s.name.startswith("chat ")), key=lambda s: s.start_ns)
    assert [s.name for s in chats] == ["chat test-model", "chat test-model"]
    for span, (inp, out) in zip(chats, ((11, 3), (13, 4)), strict=True):
        assert span.attributes["gen_ai.operation.name"] == "chat"
        assert span.attributes["gen_ai.request.model"] == "test-model"
        assert span.attributes["gen_ai.response.model"] == "test-model-0613"
        assert span.attributes["gen_ai.usage.input_tokens"] == inp
        assert span.attributes["gen_ai.usage.output_tokens"] == out
        assert span.attributes["server.address"] == "127.0.0.1"
        assert span.kind == 3  # SPAN_KIND_CLIENT

    tools = sorted((s for s in children if s.name.startswith("execute_tool ")),
                   key=lambda s: s.start_ns)
    assert [s.name for s in tools] == ["execute_tool read_file"] * 2
    assert [s.attributes["gen_ai.tool.call.id"] for s in tools] == ["call_1", "call_2"]
    for tool in tools:
        assert tool.attributes["gen_ai.operation.name"] == "execute_tool"
        assert tool.attributes["gen_ai.tool.name"] == "read_file"
        assert "error.type" not in tool.attributes
        assert root.start_ns <= tool.start_ns <= tool.end_ns <= root.end_ns
    # model call, its tool call, model call, its tool call: in that order in time
    order = sorted(chats + tools, key=lambda s: s.start_ns)
    assert [s.name.split()[0] for s in order] == ["chat", "execute_tool"] * 2
    assert len(children) == 4

    decisions = [(name, attrs) for name, attrs in root.events if name.startswith("critic ")]
    assert decisions[-1][0] == "critic kill"
    assert decisions[-1][1]["kernel.critic.decision"] == "kill"
    assert decisions[-1][1]["kernel.critic.reason"] == "looping"


@pytest.mark.realtime
class TestOTLPExport:
    async def test_live_run_is_a_trace(self, chat_server: ChatServer, otlp: Receiver,
                                       tmp_path: Path) -> None:
        """OTelAudit teed with DuckDBAudit: the killed run arrives as one GenAI trace."""
        script_two_calls_then_hang(chat_server, tmp_path)
        critic = WatchCritic(CriticPolicy(loop_repeats=2, loop_nudges=0))
        db = tmp_path / "k.duckdb"
        async with DuckDBAudit.open(db) as duck, OTelAudit.open(otlp.url) as otel:
            result = await Kernel(Ports(audit=TeeAudit(duck, otel), critic=critic)).run(
                make_agent(chat_server, tmp_path), RunInfo(name="researcher"), LIMITS)
        assert result.status is Status.KILLED and result.reason == "looping", result
        assert result.tool_calls == 2 and result.port_failures == []
        check_trace(otlp.wait_for(5), result.run_id)
        assert otel.traces.failed_exports == 0
        # the DuckDB side of the tee has the whole run too
        from batteries.audit import Store

        with Store(db).reader() as con:
            row = con.execute("SELECT status, tool_calls FROM runs WHERE run_id = ?",
                              [result.run_id]).fetchone()
        assert row == ("killed", 2)

    def test_cli_run_and_export(self, chat_server: ChatServer, otlp: Receiver,
                                tmp_path: Path, kernel_exe: str,
                                cli_env: dict[str, str]) -> None:
        """`kernel run --otlp` sends the trace live; `kernel export --otlp` sends it again."""
        (tmp_path / "a.txt").write_text("same as before")
        chat_server.script(then=completion(None, call("call_x", "read_file", {"path": "a.txt"})))
        env = {**cli_env, "OPENAI_API_KEY": "k"}
        proc = subprocess.run(
            [kernel_exe, "run", "--json", "--name", "researcher", "--agent", "llm",
             "--model", "test-model", "--base-url", chat_server.url, "--prompt", "go",
             "--otlp", otlp.url, "--timeout", "60"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        result = json.loads(proc.stdout)
        assert result["status"] == "killed" and result["reason"] == "looping", proc.stderr
        live = otlp.wait_for(1)
        [root] = [s for s in live if s.name.startswith("invoke_agent")]
        assert root.attributes["kernel.run_id"] == result["run_id"]
        assert root.attributes["error.type"] == "killed"
        n_tools = len([s for s in live if s.name == "execute_tool read_file"])
        assert n_tools == result["tool_calls"] >= 3
        assert len([s for s in live if s.name == "chat test-model"]) >= n_tools

        before = len(live)
        proc = subprocess.run(
            [kernel_exe, "export", "--otlp", otlp.url + "/v1/traces", "--run",
             result["run_id"][:8]], env=cli_env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("exported 1 runs (")
        again = otlp.wait_for(2 * before)[before:]
        shape = sorted((s.name, s.attributes.get("gen_ai.tool.call.id", "")) for s in live)
        assert sorted((s.name, s.attributes.get("gen_ai.tool.call.id", "")) for s in again) == (
            shape)
        [root2] = [s for s in again if s.name.startswith("invoke_agent")]
        assert root2.attributes == root.attributes
        assert [n for n, _ in root2.events] == [n for n, _ in root.events]

    def test_export_of_stored_run_matches_the_library_trace(
            self, chat_server: ChatServer, otlp: Receiver, tmp_path: Path,
            kernel_exe: str, cli_env: dict[str, str]) -> None:
        """A run recorded only in DuckDB, exported later, passes the same trace checks."""
        import trio

        script_two_calls_then_hang(chat_server, tmp_path)
        db = tmp_path / "k.duckdb"

        async def main() -> str:
            critic = WatchCritic(CriticPolicy(loop_repeats=2, loop_nudges=0))
            async with DuckDBAudit.open(db) as duck:
                result = await Kernel(Ports(audit=duck, critic=critic)).run(
                    make_agent(chat_server, tmp_path), RunInfo(name="researcher"), LIMITS)
            assert result.status is Status.KILLED, result
            return result.run_id

        run_id = trio.run(main)
        proc = subprocess.run([kernel_exe, "export", "--db", str(db), "--otlp", otlp.url],
                              env=cli_env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        check_trace(otlp.wait_for(5), run_id)

    def test_bad_endpoint_and_dead_collector(self, otlp: Receiver, kernel_exe: str,
                                             cli_env: dict[str, str]) -> None:
        """Bad --otlp: one line, exit 2; the env var works; a dead collector: export exits 1."""
        proc = subprocess.run([kernel_exe, "run", "--otlp", "nope", "--", "true"],
                              env=cli_env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert "OTLP endpoint must be http(s)://" in proc.stderr
        # $OTEL_EXPORTER_OTLP_ENDPOINT stands in for --otlp
        subprocess.run([kernel_exe, "run", "--name", "from-env", "--", "true"],
                       env={**cli_env, "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.url}, check=True,
                       capture_output=True, timeout=120)
        assert [s.name for s in otlp.wait_for(1)] == ["invoke_agent from-env"]
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        proc = subprocess.run([kernel_exe, "export", "--otlp", dead], env=cli_env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stderr
        assert "export request(s) to" in proc.stderr and "Traceback" not in proc.stderr
