"""The LLM agent against a real chat-completions server on 127.0.0.1, and its parsers."""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from adapters.llm import (
    APIError,
    ChatClient,
    LLMAgent,
    MalformedResponse,
    Price,
    parse_completion,
    parse_retry_after,
    redact_url,
)
from kernel import ConfigError, Kernel, Limits, Ports, RunInfo, Status
from kernel.testing import MemoryAudit, RecordingCheckpointer, ScriptedCritic

SECRET = "sk-test-SECRET-0123456789"

# ------------------------------------------------------------ the server


@dataclass
class Reply:
    """One scripted answer: an HTTP status, headers and a body, after an optional delay."""

    body: Any = None
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0


@dataclass
class Seen:
    """One request the server received."""

    path: str
    headers: dict[str, str]
    body: Any


class ChatServer:
    """A chat-completions server on 127.0.0.1 that plays back scripted replies."""

    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.then: Reply | None = None
        self.requests: list[Seen] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = raw.decode(errors="replace")
                with server._lock:
                    server.requests.append(Seen(self.path, {k.lower(): v for k, v in
                                                            self.headers.items()}, body))
                    reply = server.replies.pop(0) if server.replies else server.then
                if reply is None:
                    reply = Reply({"error": {"message": "test script exhausted"}}, status=599)
                if reply.delay:
                    time.sleep(reply.delay)
                data = (reply.body if isinstance(reply.body, bytes)
                        else reply.body.encode() if isinstance(reply.body, str)
                        else json.dumps(reply.body).encode())
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in reply.headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a read-timeout test)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def script(self, *replies: Reply | dict[str, Any], then: Reply | dict[str, Any] | None = None
               ) -> None:
        """Queue replies (a dict is a 200 JSON body); `then` answers once they run out."""
        self.replies = [r if isinstance(r, Reply) else Reply(r) for r in replies]
        self.then = then if then is None or isinstance(then, Reply) else Reply(then)

    def messages(self, n: int) -> list[dict[str, Any]]:
        """The `messages` of the n-th request (from 0)."""
        body = self.requests[n].body
        assert isinstance(body, dict)
        msgs = body["messages"]
        assert isinstance(msgs, list)
        return msgs


@pytest.fixture
def chat_server() -> Any:
    """A scripted chat-completions server on an ephemeral 127.0.0.1 port."""
    server = ChatServer()
    thread = threading.Thread(target=server.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    yield server
    server.httpd.shutdown()
    server.httpd.server_close()
    thread.join(5)


def completion(content: str | None = None, *calls: dict[str, Any], prompt_tokens: int = 10,
               completion_tokens: int = 5) -> dict[str, Any]:
    """A chat-completion body, as OpenAI sends it."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000,
        "model": "test-model-0613",
        "choices": [{"index": 0, "message": message,
                     "finish_reason": "tool_calls" if calls else "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def call(call_id: str, name: str, args: Any) -> dict[str, Any]:
    """One tool call in a completion; `args` is JSON-encoded unless it is already text."""
    return {"id": call_id, "type": "function",
            "function": {"name": name,
                         "arguments": args if isinstance(args, str) else json.dumps(args)}}


def make_agent(server: ChatServer, workdir: Path, prompt: str = "What is the answer?",
               **kw: Any) -> LLMAgent:
    client_kw = {k: kw.pop(k) for k in ("max_retries", "backoff", "read_timeout",
                                        "max_retry_after") if k in kw}
    client = ChatClient(server.url, **client_kw)
    return LLMAgent("test-model", prompt, client=client, cwd=workdir, **kw)


FAST = Limits(max_steps=20, timeout=20, poll_interval=0.02, tool_timeout=5)


class ChatScript:
    """An `httpx.MockTransport` handler playing back `Reply`s, on trio's (virtual) clock."""

    def __init__(self, *replies: Reply | dict[str, Any],
                 then: Reply | dict[str, Any] | None = None) -> None:
        self.replies = [r if isinstance(r, Reply) else Reply(r) for r in replies]
        self.then = then if then is None or isinstance(then, Reply) else Reply(then)
        self.requests: list[Seen] = []
        self.times: list[float] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.times.append(trio.current_time())
        self.requests.append(Seen(request.url.path, dict(request.headers),
                                  json.loads(request.content)))
        reply = self.replies.pop(0) if self.replies else self.then
        if reply is None:
            reply = Reply({"error": {"message": "test script exhausted"}}, status=599)
        if reply.delay:
            await trio.sleep(reply.delay)
        data = (reply.body.encode() if isinstance(reply.body, str)
                else json.dumps(reply.body).encode())
        return httpx.Response(reply.status, content=data,
                              headers={"Content-Type": "application/json", **reply.headers})


def mock_agent(script: ChatScript, workdir: Path, **kw: Any) -> LLMAgent:
    """An LLMAgent whose client talks to `script` through `httpx.MockTransport`."""
    client_kw = {k: kw.pop(k) for k in ("max_retries", "backoff", "max_backoff",
                                        "max_retry_after") if k in kw}
    client = ChatClient("http://llm.test/v1", transport=httpx.MockTransport(script),
                        **client_kw)
    return LLMAgent("test-model", "What is the answer?", client=client, cwd=workdir, **kw)


# ------------------------------------------------------------------ runs


class TestRetriesVirtualTime:
    """Retries, backoff and Retry-After through `httpx.MockTransport` under autojump_clock."""

    async def test_rate_limit_honours_retry_after(self, tmp_path: Path,
                                                  autojump_clock: trio.abc.Clock) -> None:
        """A 429 with Retry-After: 7 is retried exactly 7 s later and the run succeeds."""
        script = ChatScript(
            Reply({"error": {"message": "Rate limit reached"}}, status=429,
                  headers={"Retry-After": "7"}),
            completion("done"))
        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit)).run(mock_agent(script, tmp_path),
                                                      RunInfo(), FAST)
        assert result.status is Status.OK and result.output == "done"
        assert len(script.requests) == 2
        assert script.times[1] - script.times[0] == pytest.approx(7.0)
        retry = next(e for e in audit.events(result.run_id) if e.kind == "model_retry")
        assert retry.payload["status"] == 429 and retry.payload["wait_ms"] == 7000.0
        assert "Rate limit reached" in retry.payload["reason"]
        mc = next(e for e in audit.events(result.run_id) if e.kind == "model_call")
        assert mc.payload["retries"] == 1 and mc.payload["waited_ms"] == 7000.0

    async def test_server_errors_back_off_exponentially(self, tmp_path: Path,
                                                        autojump_clock: trio.abc.Clock) -> None:
        """503, 502, 500, 504 are retried; each wait doubles (jittered 50-100 %) up to the cap."""
        script = ChatScript(Reply("upstream down", status=503), Reply("bad gw", status=502),
                            Reply("boom", status=500), Reply("slow", status=504),
                            completion("ok now"))
        agent = mock_agent(script, tmp_path, backoff=2.0, max_backoff=5.0)
        result = await Kernel().run(agent, RunInfo(), Limits(max_steps=5, timeout=120))
        assert result.status is Status.OK and result.output == "ok now"
        gaps = [b - a for a, b in zip(script.times, script.times[1:], strict=False)]
        for gap, full in zip(gaps, (2.0, 4.0, 5.0, 5.0), strict=True):
            assert full * 0.5 <= gap <= full, gaps

    async def test_retries_exhausted_ends_error(self, tmp_path: Path,
                                                autojump_clock: trio.abc.Clock) -> None:
        """When every attempt fails, the run ends `error` saying how many attempts and why."""
        script = ChatScript(then=Reply({"error": {"message": "overloaded"}}, status=503))
        result = await Kernel().run(mock_agent(script, tmp_path, max_retries=2), RunInfo(), FAST)
        assert result.status is Status.ERROR
        assert "failed after 3 attempts: HTTP 503 Service Unavailable: overloaded" in (
            result.error or "")
        assert len(script.requests) == 3

    async def test_client_error_is_not_retried(self, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               autojump_clock: trio.abc.Clock) -> None:
        """A 401 fails at once with the API's message, and the key is not in the error."""
        monkeypatch.setenv("OPENAI_API_KEY", SECRET)
        script = ChatScript(then=Reply({"error": {"message": "Incorrect API key provided"}},
                                       status=401))
        result = await Kernel().run(mock_agent(script, tmp_path), RunInfo(), FAST)
        assert result.status is Status.ERROR
        assert "HTTP 401 Unauthorized: Incorrect API key provided" in (result.error or "")
        assert len(script.requests) == 1
        assert script.requests[0].headers["authorization"] == f"Bearer {SECRET}"
        assert SECRET not in json.dumps(result.to_dict())

    async def test_retry_after_past_the_deadline_fails_fast(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """A Retry-After that would outlast the run's deadline ends it now, saying so."""
        script = ChatScript(then=Reply({}, status=429, headers={"Retry-After": "30"}))
        t0 = trio.current_time()
        result = await Kernel().run(mock_agent(script, tmp_path), RunInfo(), Limits(timeout=5))
        assert result.status is Status.ERROR
        assert "the retry wait of 30.0s would pass the run's deadline" in (result.error or "")
        assert trio.current_time() - t0 == 0  # no wait was taken
        assert len(script.requests) == 1

    async def test_the_hosts_client_is_used_and_left_open(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """A host's AsyncClient carries every request, with the key and headers, and stays open."""
        script = ChatScript(completion("hi"))
        async with httpx.AsyncClient(transport=httpx.MockTransport(script)) as pool:
            client = ChatClient("http://llm.test/v1", api_key="k-1", client=pool,
                                headers={"OpenAI-Organization": "org-1"})
            agent = LLMAgent("test-model", "hello", client=client, cwd=tmp_path)
            result = await Kernel().run(agent, RunInfo(), FAST)
            assert not pool.is_closed
        assert result.status is Status.OK and result.output == "hi"
        seen = script.requests[0]
        assert seen.path == "/v1/chat/completions"
        assert seen.headers["authorization"] == "Bearer k-1"
        assert seen.headers["openai-organization"] == "org-1"


@pytest.mark.realtime
class TestLLMAgentRun:
    """Whole runs of the LLM agent under the kernel, against the scripted server."""

    async def test_multi_turn_tool_task(self, chat_server: ChatServer, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
        """The model reads a file, calls a host tool, then answers: each result reaches it."""
        monkeypatch.setenv("OPENAI_API_KEY", SECRET)
        (tmp_path / "notes.txt").write_text("the base is 40\n")

        async def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        chat_server.script(
            completion(None, call("call_1", "read_file", {"path": "notes.txt"})),
            completion("Adding.", call("call_2", "add", {"a": 40, "b": 2})),
            completion("The answer is 42.", prompt_tokens=30, completion_tokens=7),
        )
        audit = MemoryAudit()
        agent = make_agent(chat_server, tmp_path, tools=[add],
                           prices={"test-model": Price(input_per_mtok=2.0, output_per_mtok=8.0)})
        result = await Kernel(Ports(audit=audit)).run(agent, RunInfo(name="t"), FAST)

        assert result.status is Status.OK, result.error
        assert result.output == "The answer is 42."
        assert (result.steps, result.tool_calls) == (3, 2)
        assert (result.usage.input_tokens, result.usage.output_tokens) == (50, 17)
        assert result.usage.cost_usd == pytest.approx((50 * 2.0 + 17 * 8.0) / 1e6)
        first = chat_server.requests[0]
        assert first.path == "/v1/chat/completions"
        assert first.headers["authorization"] == f"Bearer {SECRET}"
        assert [t["function"]["name"] for t in first.body["tools"]] == ["read_file", "add"]
        assert first.body["messages"] == [{"role": "user", "content": "What is the answer?"}]
        assert chat_server.messages(1)[-1] == {
            "role": "tool", "tool_call_id": "call_1", "content": "the base is 40\n"}
        assert chat_server.messages(2)[-2]["tool_calls"][0]["function"]["name"] == "add"
        assert chat_server.messages(2)[-1] == {
            "role": "tool", "tool_call_id": "call_2", "content": "42"}
        kinds = audit.kinds(result.run_id)
        assert kinds.count("model_call") == 3
        assert kinds.count("tool_start") == kinds.count("tool_end") == 2
        mc = [e for e in audit.events(result.run_id) if e.kind == "model_call"][-1]
        assert mc.payload["input_tokens"] == 30 and mc.payload["retries"] == 0
        assert mc.payload["url"] == chat_server.url + "/chat/completions"

    @pytest.mark.parametrize(("body", "expected"), [
        ({"id": "chatcmpl-1", "object": "chat.completion"},
         "malformed response from http://127.0.0.1:{port}/v1/chat/completions: no choices[0]"),
        ("<html>502 Bad Gateway</html>", "with a body that is not JSON"),
        ({"choices": [{"message": {"role": "assistant",
                                   "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}}]},
         "choices[0].message.tool_calls[0].function.name is missing, not a tool name"),
        ({"choices": [{"message": {"role": "assistant", "content": None}}]},
         "the message has neither content nor tool_calls"),
    ])
    async def test_malformed_response_ends_error(self, chat_server: ChatServer, tmp_path: Path,
                                                 body: Any, expected: str) -> None:
        """A 200 that is not a chat completion ends the run `error` naming what is wrong."""
        chat_server.script(Reply(body))
        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit)).run(make_agent(chat_server, tmp_path),
                                                      RunInfo(), FAST)
        assert result.status is Status.ERROR
        port = chat_server.url.split(":")[2].split("/")[0]
        assert result.error is not None and result.error.startswith("MalformedResponse: ")
        assert expected.format(port=port) in result.error
        assert len(chat_server.requests) == 1  # not retried
        mc = next(e for e in audit.events(result.run_id) if e.kind == "model_call")
        assert expected.format(port=port) in mc.payload["error"]

    async def test_repeated_tool_call_is_killed_as_looping(self, chat_server: ChatServer,
                                                           tmp_path: Path) -> None:
        """A model repeating one tool call forever is ended `killed` by the critic (looping)."""
        (tmp_path / "a.txt").write_text("same as before")
        chat_server.script(then=completion(None, call("call_x", "read_file", {"path": "a.txt"})))
        critic = ScriptedCritic(kill_at_step=4, reason="looping")
        result = await Kernel(Ports(critic=critic)).run(make_agent(chat_server, tmp_path),
                                                        RunInfo(), FAST)
        assert result.status is Status.KILLED and result.reason == "looping"
        starts = critic.handles[0].tool_starts
        assert len(starts) >= 3
        assert {(c.name, json.dumps(dict(c.args))) for c in starts} == {
            ("read_file", '{"path": "a.txt"}')}

    async def test_real_critic_nudges_then_kills_a_loop(self, chat_server: ChatServer,
                                                        tmp_path: Path) -> None:
        """The watch-nursery critic nudges the looping model (a user message), then kills it."""
        from batteries.critic import CriticPolicy, WatchCritic

        (tmp_path / "a.txt").write_text("same as before")
        chat_server.script(then=completion(None, call("call_x", "read_file", {"path": "a.txt"})))
        critic = WatchCritic(CriticPolicy(loop_repeats=3, loop_nudges=1))
        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit, critic=critic)).run(
            make_agent(chat_server, tmp_path), RunInfo(), FAST)
        assert result.status is Status.KILLED and result.reason == "looping"
        last = chat_server.messages(len(chat_server.requests) - 1)
        nudges = [m["content"] for m in last if m["role"] == "user"][1:]
        assert len(nudges) == 1 and "read_file(a.txt) 3 times" in nudges[0]
        decisions = [e.name for e in audit.events(result.run_id) if e.kind == "critic"]
        assert decisions[-2:] == ["steer", "kill"]

    async def test_steer_is_appended_as_user_message(self, chat_server: ChatServer,
                                                     tmp_path: Path) -> None:
        """A critic nudge reaches the model as a user message after the tool results."""
        (tmp_path / "a.txt").write_text("x")
        chat_server.script(completion(None, call("c1", "read_file", {"path": "a.txt"})),
                           completion("fine"))
        critic = ScriptedCritic(steer_at_step={1: "Stop reading files and answer."})
        result = await Kernel(Ports(critic=critic)).run(make_agent(chat_server, tmp_path),
                                                        RunInfo(), FAST)
        assert result.status is Status.OK
        assert [m["role"] for m in chat_server.messages(1)] == [
            "user", "assistant", "tool", "user"]
        assert chat_server.messages(1)[-1]["content"] == "Stop reading files and answer."

    async def test_read_timeout_is_not_sent_again(self, chat_server: ChatServer,
                                                  tmp_path: Path) -> None:
        """An answer slower than a host's read timeout ends the call, and the request is not
        sent again: the server may be working on it (and billing it)."""
        chat_server.script(Reply(completion("late"), delay=1.0), completion("prompt"))
        audit = MemoryAudit()
        agent = make_agent(chat_server, tmp_path, read_timeout=0.3, backoff=0.01)
        result = await Kernel(Ports(audit=audit)).run(agent, RunInfo(), FAST)
        assert result.status is Status.ERROR
        assert result.error is not None and "not sent again" in result.error
        assert "model_retry" not in audit.kinds(result.run_id)
        assert len(chat_server.requests) == 1

    async def test_bad_tool_arguments_are_fed_back(self, chat_server: ChatServer,
                                                   tmp_path: Path) -> None:
        """Arguments that are not JSON are not run; the model is told why and carries on.
        The call still counts (a call with an error result, shown to the critic)."""
        chat_server.script(completion(None, call("c1", "read_file", '{"path": "a.txt"')),
                           completion("sorry"))
        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit)).run(make_agent(chat_server, tmp_path),
                                                      RunInfo(), FAST)
        assert result.status is Status.OK and result.tool_calls == 1
        tool_msg = chat_server.messages(1)[-1]
        assert tool_msg["tool_call_id"] == "c1"
        assert tool_msg["content"].startswith(
            "error: tool 'read_file' not run: arguments are not valid JSON")
        assert "tool_rejected" in audit.kinds(result.run_id)

    async def test_rejected_calls_are_not_an_empty_answer(self, chat_server: ChatServer,
                                                          tmp_path: Path) -> None:
        """A turn whose calls were all rejected (arguments not JSON) called tools: the real
        critic neither nudges it as an empty answer nor kills it `empty_answer`."""
        from batteries.critic import WatchCritic

        bad = completion(None, call("c1", "read_file", '{"path": "a.txt"'))
        chat_server.script(bad, bad, bad, completion("done at last"))
        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit, critic=WatchCritic())).run(
            make_agent(chat_server, tmp_path), RunInfo(), FAST)
        assert result.status is Status.OK and result.output == "done at last"
        critic = [e.payload for e in audit.events(result.run_id) if e.kind == "critic"]
        assert not any(p.get("reason") == "empty_answer" for p in critic), critic
        assert audit.kinds(result.run_id).count("tool_rejected") == 3

    async def test_an_answer_cut_at_the_length_limit_is_flagged(
            self, chat_server: ChatServer, tmp_path: Path) -> None:
        """finish_reason=length: the run is ok with the text it got, and a warning says the
        answer may be incomplete."""
        cut = completion("The three steps are: first, ")
        cut["choices"][0]["finish_reason"] = "length"
        chat_server.script(cut)
        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit)).run(make_agent(chat_server, tmp_path),
                                                      RunInfo(), FAST)
        assert result.status is Status.OK
        [warning] = [e.payload["message"] for e in audit.events(result.run_id)
                     if e.kind == "warning"]
        assert "length limit" in warning

    @pytest.mark.parametrize("content", [None, ""])
    async def test_a_refusal_ends_the_run_error_with_its_text(
            self, chat_server: ChatServer, tmp_path: Path, content: str | None) -> None:
        """A model that declines (`message.refusal`) ends `error` saying so: not a malformed
        response, not an empty answer asked again, and its text is kept."""
        refused = completion(content)
        refused["choices"][0]["message"]["refusal"] = "I cannot help with that."
        refused["choices"][0]["finish_reason"] = "content_filter" if content == "" else "stop"
        chat_server.script(refused)
        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit)).run(make_agent(chat_server, tmp_path),
                                                      RunInfo(), FAST)
        assert result.status is Status.ERROR
        assert result.error == "the model refused: I cannot help with that."
        assert result.output == "I cannot help with that."
        assert len(chat_server.requests) == 1

    async def test_tool_failures_reach_the_model(self, chat_server: ChatServer,
                                                 tmp_path: Path) -> None:
        """An unknown tool and a refused path come back to the model as error tool messages."""
        chat_server.script(completion(None, call("c1", "rm_rf", {}),
                                      call("c2", "read_file", {"path": "../../etc/passwd"})),
                           completion("ok"))
        result = await Kernel().run(make_agent(chat_server, tmp_path), RunInfo(), FAST)
        assert result.status is Status.OK
        tool_msgs = chat_server.messages(1)[-2:]
        assert [m["tool_call_id"] for m in tool_msgs] == ["c1", "c2"]
        assert tool_msgs[0]["content"] == (
            "error: unknown tool 'rm_rf' (available: read_file)")
        assert tool_msgs[1]["content"] == (
            "error: PermissionError: '../../etc/passwd' is outside the working directory; "
            "refused")

    async def test_api_key_never_reaches_audit_or_logs(self, chat_server: ChatServer,
                                                       tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
        """The key is sent as a bearer token but never audited, logged or shown to the model."""
        monkeypatch.setenv("OPENAI_API_KEY", SECRET)
        (tmp_path / ".env").write_text(f"OPENAI_API_KEY={SECRET}\n")
        chat_server.script(
            Reply({}, status=500),
            completion(None, call("c1", "read_file", {"path": ".env"}),
                       call("c2", "shell", {"command": "echo key=$OPENAI_API_KEY"})),
            completion("done"))
        audit = MemoryAudit()
        agent = make_agent(chat_server, tmp_path, allow_shell=True, backoff=0.01)
        with caplog.at_level(logging.DEBUG, logger="kernel"):
            result = await Kernel(Ports(audit=audit)).run(agent, RunInfo(), FAST)
        logs = [r.getMessage() for r in caplog.records]
        assert result.status is Status.OK
        assert all(r.headers["authorization"] == f"Bearer {SECRET}"
                   for r in chat_server.requests)
        events = json.dumps([e.payload for e in audit.events(result.run_id)])
        assert "OPENAI_API_KEY=[redacted]" in events
        assert "key=\\n" in events  # the shell tool does not even see the variable
        for text in (events, json.dumps(logs, default=str), json.dumps(result.to_dict()),
                     json.dumps(chat_server.messages(2)), repr(agent)):
            assert SECRET not in text
        assert any(r.name == "kernel.llm" and "model call retrying" in r.getMessage()
                   for r in caplog.records)

    async def test_the_shell_tools_process_group_is_audited(self, chat_server: ChatServer,
                                                            tmp_path: Path) -> None:
        """The shell tool's command is audited as `process_start` with what identifies its
        group (pid, pgid, start time, boot, host), before the command's own end: what
        `kernel recover` reads to stop a command left running by a supervisor that died
        (before, an LLM run's shell commands were never recorded, so never stopped)."""
        chat_server.script(completion(None, call("c1", "shell", {"command": "echo hi"})),
                           completion("done"))
        audit = MemoryAudit()
        agent = make_agent(chat_server, tmp_path, allow_shell=True)
        result = await Kernel(Ports(audit=audit)).run(agent, RunInfo(), FAST)
        assert result.status is Status.OK
        events = audit.events(result.run_id)
        kinds = [e.kind for e in events]
        assert kinds.index("tool_start") < kinds.index("process_start") < kinds.index(
            "tool_end")
        [started] = [e for e in events if e.kind == "process_start"]
        assert started.payload["tool"] == "shell"
        assert {"pid", "pgid", "start_time", "boot_id", "host"} <= set(started.payload)

    async def test_resume_continues_the_conversation(self, chat_server: ChatServer,
                                                     tmp_path: Path) -> None:
        """A run resumed from its checkpoint sends the saved conversation, tool results included."""
        (tmp_path / "a.txt").write_text("alpha")
        chat_server.script(completion(None, call("c1", "read_file", {"path": "a.txt"})),
                           completion("resumed answer"))
        cp = RecordingCheckpointer()
        info = RunInfo(name="r")
        first = await Kernel(Ports(checkpointer=cp)).run(
            make_agent(chat_server, tmp_path), info, Limits(max_steps=1, timeout=20))
        assert first.status is Status.MAX_STEPS
        saved = cp.saves[-1]
        json.dumps(saved.state)  # the checkpoint state is JSON-serialisable
        assert saved.state["messages"][-1] == {
            "role": "tool", "tool_call_id": "c1", "content": "alpha"}

        fresh = make_agent(chat_server, tmp_path, prompt="ignored on resume")
        second = await Kernel(Ports(checkpointer=cp)).run(fresh, info, FAST, resume=saved)
        assert second.status is Status.OK and second.output == "resumed answer"
        assert chat_server.messages(1) == saved.state["messages"]
        assert second.steps == 2

    async def test_a_run_interrupted_during_its_tools_resumes_told_so(
            self, chat_server: ChatServer, tmp_path: Path) -> None:
        """The turn that asked for a tool is saved before the tool runs: interrupted there,
        the resumed run sends that turn with the call answered as interrupted (it may have
        run), and does not ask the model to make the call anew."""
        ran: list[str] = []
        started = trio.Event()

        async def charge(card: str) -> str:
            """Charge the card."""
            ran.append(card)
            started.set()
            await trio.sleep_forever()
            return "charged"

        chat_server.script(completion(None, call("c1", "charge", {"card": "4242"})),
                           completion("checked: it was charged once"))
        cp = RecordingCheckpointer()
        info = RunInfo(name="charge once")
        async with trio.open_nursery() as nursery:
            async def first() -> None:
                await Kernel(Ports(checkpointer=cp)).run(
                    make_agent(chat_server, tmp_path, tools=[charge]), info, FAST)
            nursery.start_soon(first)
            with trio.fail_after(30):
                await started.wait()
            nursery.cancel_scope.cancel()
        saved = cp.saves[-1]
        assert saved.state["messages"][-1]["tool_calls"][0]["id"] == "c1"
        second = await Kernel(Ports(checkpointer=cp)).run(
            make_agent(chat_server, tmp_path, tools=[charge]), info, FAST, resume=saved)
        assert second.status is Status.OK and ran == ["4242"]
        sent = chat_server.messages(1)
        assert [m["role"] for m in sent][-2:] == ["assistant", "tool"]
        assert sent[-1]["tool_call_id"] == "c1" and "may have run" in sent[-1]["content"]

    async def test_pooled_client_reuses_one_connection_pool(self, chat_server: ChatServer,
                                                            tmp_path: Path) -> None:
        """Opened as a context manager, the agent keeps its client across turns and closes it."""
        (tmp_path / "a.txt").write_text("x")
        chat_server.script(completion(None, call("c1", "read_file", {"path": "a.txt"})),
                           completion("done"))
        agent = make_agent(chat_server, tmp_path)
        async with agent:
            pool = agent.client._pool
            assert pool is not None
            result = await Kernel().run(agent, RunInfo(), FAST)
            assert agent.client._pool is pool
        assert result.status is Status.OK
        assert agent.client._pool is None and pool.is_closed


# -------------------------------------------------------------- no server


class TestLLMAgentUnits:
    """The agent's behaviour that needs no server."""

    async def test_missing_prompt_ends_error(self, tmp_path: Path) -> None:
        """An agent with nothing to say ends `error` before any request is made."""
        agent = LLMAgent("m", client=ChatClient("http://127.0.0.1:9/v1"), cwd=tmp_path)
        result = await Kernel().run(agent, RunInfo(), Limits(timeout=5))
        assert result.status is Status.ERROR
        assert result.error == "AgentError: LLMAgent has no prompt and no opening messages"

    async def test_resume_from_foreign_state_ends_error(self, tmp_path: Path) -> None:
        """A checkpoint that is not a conversation is refused with a clear message."""
        from kernel import Checkpoint

        agent = LLMAgent("m", "p", client=ChatClient("http://127.0.0.1:9/v1"), cwd=tmp_path)
        result = await Kernel().run(agent, RunInfo(run_id="r"), Limits(timeout=5),
                                    resume=Checkpoint("r", 1, {"calls": 3}))
        assert result.status is Status.ERROR
        assert "checkpoint state is not an LLM conversation" in (result.error or "")

    @pytest.mark.realtime
    async def test_connection_refused_ends_error(self, tmp_path: Path) -> None:
        """Nothing listening: the transport error is retried, then reported."""
        with trio.socket.socket() as s:
            await s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        agent = LLMAgent("m", "p", client=ChatClient(f"http://127.0.0.1:{port}/v1",
                                                     max_retries=1, backoff=0.01), cwd=tmp_path)
        result = await Kernel().run(agent, RunInfo(), Limits(timeout=5))
        assert result.status is Status.ERROR
        assert "failed after 2 attempts: ConnectError" in (result.error or "")

    async def test_simulate_names_model_endpoint_and_tools(self, tmp_path: Path) -> None:
        """A dry run reports what would be asked, of whom, with which tools."""
        agent = LLMAgent("m", "do it", client=ChatClient("http://u:p@127.0.0.1:9/v1?k=s"),
                         cwd=tmp_path, allow_shell=True)
        result = await Kernel().run(agent, RunInfo(), Limits(dry_run=True))
        assert result.status is Status.DRY_RUN
        assert result.output == ("would ask m at http://127.0.0.1:9/v1/chat/completions "
                                 "(tools: read_file, shell): do it")

    def test_tools_default_to_read_file_only(self, tmp_path: Path) -> None:
        """read_file is on by default, shell only when allowed, and names must be unique."""
        client = ChatClient("http://127.0.0.1:9/v1")
        assert list(LLMAgent("m", "p", client=client, cwd=tmp_path).tools) == ["read_file"]
        assert list(LLMAgent("m", "p", client=client, cwd=tmp_path, read_file=False).tools) == []
        assert list(LLMAgent("m", "p", client=client, cwd=tmp_path, allow_shell=True).tools) == [
            "read_file", "shell"]

        async def read_file(path: str) -> str:
            return path

        with pytest.raises(ValueError, match="two tools are named 'read_file'"):
            LLMAgent("m", "p", client=client, cwd=tmp_path, tools=[read_file])

    def test_repr_hides_the_key(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Printing a client or agent shows whether a key is set, never the key."""
        monkeypatch.setenv("MY_KEY", SECRET)
        client = ChatClient("http://127.0.0.1:9/v1", api_key_env="MY_KEY")
        assert client.has_key
        assert SECRET not in repr(client) and "api_key=set ($MY_KEY)" in repr(client)
        assert SECRET not in repr(LLMAgent("m", "p", client=client))

    def test_bad_base_url_is_refused(self) -> None:
        """A base URL that is not http(s) is refused when the client is built."""
        with pytest.raises(ValueError, match="base URL must be http"):
            ChatClient("ftp://example/v1")

    def test_price_cost(self) -> None:
        """Cost is tokens times the per-million price, input and output separately."""
        assert Price(3.0, 15.0).cost(1_000_000, 100_000) == pytest.approx(4.5)

    @pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "3", True])
    def test_a_price_is_a_real_amount(self, bad: Any) -> None:
        """A negative, NaN, infinite or non-number price is refused where it is made (it
        would make every cost NaN or negative, and cost budgets meaningless)."""
        with pytest.raises(ConfigError, match=r"Price\.output_per_mtok must be a finite amount"):
            Price(1.0, bad)


class TestParseCompletion:
    """Decoding chat-completion bodies."""

    def test_reasoning_tokens_are_split_out(self) -> None:
        """Reasoning tokens count as thinking, not twice as output."""
        body = completion("hi", completion_tokens=50)
        body["usage"]["completion_tokens_details"] = {"reasoning_tokens": 30}
        comp = parse_completion(body, "u")
        assert (comp.input_tokens, comp.output_tokens, comp.thinking_tokens) == (10, 20, 30)

    def test_lenient_shapes(self) -> None:
        """Content parts, object arguments, empty arguments and missing ids are accepted."""
        body = {"choices": [{"message": {
            "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}},
                           {"id": "k", "function": {"name": "g", "arguments": ""}}]}}]}
        comp = parse_completion(body, "u")
        assert comp.content == "ab"
        assert [(c.id, c.name, c.args) for c in comp.tool_calls] == [
            ("call_0", "f", {"x": 1}), ("k", "g", {})]
        assert comp.message["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'
        assert (comp.input_tokens, comp.output_tokens) == (0, 0)

    def test_non_object_arguments_are_a_model_error(self) -> None:
        """Arguments that decode to a non-object are kept with an error, not raised."""
        body = completion(None, call("c", "f", "[1, 2]"))
        (tc,) = parse_completion(body, "u").tool_calls
        assert tc.args is None and tc.error == "arguments must be a JSON object, got list"

    @pytest.mark.parametrize(("cost", "read"), [
        (0.0125, 0.0125), (0, 0.0), (-1, None), ("0.5", None), (True, None),
        (math.inf, None), (None, None)])
    def test_the_servers_cost(self, cost: Any, read: float | None) -> None:
        """`usage.cost` (OpenRouter, LiteLLM proxies) is read when it is a real amount."""
        body = completion("hi")
        body["usage"]["cost"] = cost
        assert parse_completion(body, "u").cost_usd == read

    def test_api_error_body_with_200(self) -> None:
        """An error object where a completion should be is reported with its message."""
        with pytest.raises(MalformedResponse, match="answered an error instead of a "
                                                    "completion: model overloaded"):
            parse_completion({"error": {"message": "model overloaded"}}, "u")

    def test_api_error_carries_status(self) -> None:
        """APIError records the last status and the number of attempts."""
        err = APIError("x", status_code=503, attempts=3)
        assert (err.status_code, err.attempts) == (503, 3)


class TestRetryAfter:
    """Parsing server-requested waits."""

    def test_seconds_ms_and_dates(self) -> None:
        """Delta-seconds, retry-after-ms and HTTP dates parse; garbage gives None."""
        now = datetime(2025, 1, 1, tzinfo=UTC)
        assert parse_retry_after({"retry-after": "7"}) == 7.0
        assert parse_retry_after({"retry-after-ms": "250", "retry-after": "7"}) == 0.25
        date = format_datetime(now + timedelta(seconds=12), usegmt=True)
        assert parse_retry_after({"retry-after": date}, now=now) == 12.0
        assert parse_retry_after({"retry-after": "soon"}) is None
        assert parse_retry_after({}) is None
        assert parse_retry_after({"retry-after": "-3"}) == 0.0

    def test_redact_url(self) -> None:
        """User info, query and fragment are dropped from URLs we show."""
        assert redact_url("https://user:pw@api.x.com:8443/v1?key=s#f") == (
            "https://api.x.com:8443/v1")
