"""The LLM agent's fixes from the review of `kernel run --agent llm` (items #1-#11).

Virtual time (`autojump_clock`) with `httpx.MockTransport` where the kernel and
the critic decide; real servers on 127.0.0.1 where connections matter; real
`kernel` processes where what reaches stdout, stderr and files matters.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from http_fakes import send_json, serving
from test_llm import FAST, ChatScript, Reply, Seen, call, completion

from adapters.llm import ChatClient, LLMAgent, Price, llm_judge, parse_completion
from adapters.specs import build_agent, spec_secrets
from batteries.critic import CriticPolicy, WatchCritic
from batteries.runner import make_critic, tool_timeout_grace
from kernel import (
    AgentSpec,
    ConfigError,
    Kernel,
    Limits,
    LoopSpec,
    Ports,
    PortSpec,
    RunContext,
    RunInfo,
    Status,
    Step,
)
from kernel.testing import MemoryAudit

KEY = "plainsecretvalue42"


def timed_transport(script: ChatScript) -> httpx.MockTransport:
    """`script` behind a transport that keeps httpx's read timeout, on trio's clock.

    `httpx.MockTransport` ignores timeouts; a real connection raises
    `httpx.ReadTimeout` once the request's read timeout passes with no answer.
    """

    async def handler(request: httpx.Request) -> httpx.Response:
        read = request.extensions.get("timeout", {}).get("read")
        pending = script.replies[0] if script.replies else script.then
        if read is not None and pending is not None and pending.delay > read:
            if script.replies:
                script.replies.pop(0)
            script.requests.append(Seen(request.url.path, dict(request.headers),
                                        json.loads(request.content)))
            await trio.sleep(read)
            raise httpx.ReadTimeout("timed out", request=request)
        return await script(request)

    return httpx.MockTransport(handler)


def agent_on(script: ChatScript | httpx.MockTransport, workdir: Path, *,
             api_key: str | None = None, base_url: str = "http://llm.test/v1",
             **kw: Any) -> LLMAgent:
    transport = script if isinstance(script, httpx.MockTransport) else httpx.MockTransport(script)
    client = ChatClient(base_url, transport=transport, api_key=api_key, backoff=0.01)
    return LLMAgent("test-model", "What is the answer?", client=client, cwd=workdir, **kw)


def no_usage(body: dict[str, Any]) -> dict[str, Any]:
    """`body` as a server that reports no usage sends it."""
    return {k: v for k, v in body.items() if k != "usage"}


# ------------------------------------------------------------------ #1


class TestModelTimeoutGovernsARequest:
    """#1: no hidden read timeout; a slow answer within --model-timeout is used, once."""

    async def test_a_slow_answer_within_the_model_timeout_is_used(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """An answer taking 125 s under a critic allowing a request 600 s is the answer:
        not abandoned at a read timeout of the client's own and sent (and billed) again."""
        script = ChatScript(Reply(completion("first"), delay=125), completion("second"))
        audit = MemoryAudit()
        critic = WatchCritic(CriticPolicy(model_timeout=600, soft_timeout=None))
        result = await Kernel(Ports(audit=audit, critic=critic)).run(
            agent_on(timed_transport(script), tmp_path), RunInfo(),
            Limits(timeout=3600, poll_interval=0.5))
        assert result.status is Status.OK and result.output == "first"
        assert "model_retry" not in audit.kinds(result.run_id)
        assert len(script.requests) == 1

    async def test_past_the_model_timeout_the_critic_kills(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """The request outlasting --model-timeout ends the run killed `model_timeout`
        (the critic's bound is the one that applies), after one request."""
        script = ChatScript(Reply(completion("late"), delay=900), then=completion("again"))
        critic = WatchCritic(CriticPolicy(model_timeout=600, soft_timeout=None))
        result = await Kernel(Ports(critic=critic)).run(
            agent_on(timed_transport(script), tmp_path), RunInfo(),
            Limits(timeout=3600, poll_interval=0.5))
        assert result.status is Status.KILLED and result.reason == "model_timeout"
        assert len(script.requests) == 1

    def test_the_cli_client_has_no_read_timeout_of_its_own(self) -> None:
        """`kernel run --agent llm` builds its client without a read timeout."""
        agent, _ = build_agent("llm", model="m", base_url="http://127.0.0.1:9/v1",
                               prompt="hi", cmd=None, api_key_env=None, allow_shell=False,
                               context={})
        assert isinstance(agent, LLMAgent)
        assert agent.client.read_timeout is None
        assert agent.client._timeout().read is None


# ------------------------------------------------------------------ #2


class TestTheKeyNeverLeaves:
    """#2: a server echoing the key (or the base URL's query) never gets it anywhere."""

    async def test_an_echoed_key_is_scrubbed_from_the_error_audit_and_logs(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock,
            caplog: pytest.LogCaptureFixture) -> None:
        """A 429 then a 401 both echoing the key: the retry log line, the model_retry and
        model_call events and the run's error say `[redacted]` instead."""
        echo = {"error": {"message": f"Incorrect API key provided: {KEY}."}}
        script = ChatScript(Reply(echo, status=429), Reply(echo, status=401))
        audit = MemoryAudit()
        with caplog.at_level(logging.WARNING, logger="kernel.llm"):
            result = await Kernel(Ports(audit=audit)).run(
                agent_on(script, tmp_path, api_key=KEY), RunInfo(), FAST)
        assert result.status is Status.ERROR
        assert result.error is not None and "[redacted]" in result.error
        assert KEY not in result.error
        assert "model_retry" in audit.kinds(result.run_id)
        stored = json.dumps([dataclasses.asdict(e) for e in audit.events(result.run_id)],
                            default=str)
        assert KEY not in stored
        assert caplog.records and all(KEY not in r.getMessage() for r in caplog.records)
        assert script.requests[0].headers["authorization"] == f"Bearer {KEY}"

    async def test_a_malformed_200_echoing_the_key_is_scrubbed(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """A 200 whose body is an error echoing the key ends `error` without it."""
        script = ChatScript({"error": {"message": f"bad key {KEY}"}})
        result = await Kernel().run(agent_on(script, tmp_path, api_key=KEY), RunInfo(), FAST)
        assert result.status is Status.ERROR and KEY not in (result.error or "")

    async def test_a_base_url_query_secret_is_scrubbed(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """A 404 echoing the path and query of a base URL carrying `sig=...` does not
        put the signature in the run's error."""
        sig = "qwertyuiopasdf"
        script = ChatScript(Reply(f"no route /v1/chat/completions?api-version=2024&sig={sig}",
                                  status=404))
        result = await Kernel().run(
            agent_on(script, tmp_path, base_url=f"http://llm.test/v1?api-version=2024&sig={sig}"),
            RunInfo(), FAST)
        assert result.status is Status.ERROR and "HTTP 404" in (result.error or "")
        assert sig not in (result.error or "")

    def test_spec_secrets_names_the_key_whatever_its_variable(self) -> None:
        """The key's value is handed to the redactor even when its variable's name does
        not look secret (MYLLM_CRED), for llm agents and loop judges alike."""
        env = {"MYLLM_CRED": KEY, "OPENAI_API_KEY": "sk-default-0000"}
        llm = AgentSpec(agent="llm", model="m", prompt="hi", api_key_env="MYLLM_CRED")
        assert spec_secrets(llm, env) == [KEY]
        assert spec_secrets(AgentSpec(agent="llm", model="m", prompt="hi"), env) == [
            "sk-default-0000"]
        assert spec_secrets(LoopSpec(path="/x.yaml", api_key_env="MYLLM_CRED"), env) == [KEY]
        assert spec_secrets(AgentSpec(agent="agentcli", cmd="true"), env) == []


class _EchoKey(BaseHTTPRequestHandler):
    """A 429 then 401s whose bodies echo the bearer key they were sent."""

    seen = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        key = self.headers.get("Authorization", "").removeprefix("Bearer ")
        type(self).seen += 1
        status = 429 if type(self).seen == 1 else 401
        send_json(self, {"error": {"message": f"Incorrect API key provided: {key}."}}, status)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def echo_server() -> Iterator[str]:
    _EchoKey.seen = 0
    with serving(_EchoKey) as port:
        yield f"http://127.0.0.1:{port}/v1"


@pytest.mark.realtime
class TestTheKeyNeverLeavesTheCLI:
    """#2 at the process boundary: stdout, stderr, --deliver-dir and the audit."""

    def test_a_key_under_a_plain_variable_name_is_nowhere(
            self, kernel_exe: str, cli_env: dict[str, str], echo_server: str,
            tmp_path: Path) -> None:
        """`--api-key-env MYLLM_CRED` with a server echoing the key: not in the --json
        result (error, traceback), not on stderr (the summary, the retry WARNING line),
        not in --deliver-dir's result.json, not in `kernel show` or `runs.error`."""
        env = {**{k: v for k, v in cli_env.items() if not k.startswith("OPENAI_")},
               "MYLLM_CRED": KEY, "KERNEL_LOG_LEVEL": "warning"}
        out = tmp_path / "out"
        proc = subprocess.run(
            [kernel_exe, "run", "--json", "--agent", "llm", "--model", "m", "--base-url",
             echo_server, "--prompt", "hi", "--api-key-env", "MYLLM_CRED",
             "--deliver-dir", str(out)], capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 1, proc.stderr
        doc = json.loads(proc.stdout)
        assert "Incorrect API key provided: [redacted]" in doc["error"]
        assert "retrying" in proc.stderr
        delivered = [p.read_text() for p in out.rglob("*") if p.is_file()]
        assert delivered
        show = subprocess.run([kernel_exe, "show", doc["run_id"], "--json"],
                              capture_output=True, text=True, env=env, timeout=60)
        query = subprocess.run([kernel_exe, "query", "select error from runs"],
                               capture_output=True, text=True, env=env, timeout=60)
        assert show.returncode == 0 and query.returncode == 0
        for text in (proc.stdout, proc.stderr, *delivered, show.stdout, query.stdout):
            assert KEY not in text


class _SaysTheKey(BaseHTTPRequestHandler):
    """A model whose answer repeats the bearer key it was sent (as a confused model, or a
    proxy's debugging echo, could): the answer is stored, so only the redactor stops it."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        key = self.headers.get("Authorization", "").removeprefix("Bearer ")
        send_json(self, {"choices": [{"index": 0, "finish_reason": "stop", "message": {
            "role": "assistant", "content": f"your key is {key}"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4}})

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.realtime
def test_a_key_the_model_repeats_is_redacted_by_value(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """`kernel run`'s redactor knows the key's value whatever its variable is called
    (`spec_secrets`): the answer holding it is stored without it."""
    env = {**{k: v for k, v in cli_env.items() if not k.startswith("OPENAI_")},
           "MYLLM_CRED": KEY}
    with serving(_SaysTheKey) as port:
        argv = [kernel_exe, "run", "--json", "--agent", "llm", "--model", "m", "--base-url",
                f"http://127.0.0.1:{port}/v1", "--prompt", "hi", "--api-key-env", "MYLLM_CRED"]
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    show = subprocess.run([kernel_exe, "show", doc["run_id"], "--json"],
                          capture_output=True, text=True, env=env, timeout=60)
    query = subprocess.run([kernel_exe, "query", "select output from runs"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert show.returncode == 0 and query.returncode == 0
    assert "your key is" in query.stdout
    for text in (show.stdout, query.stdout):
        assert KEY not in text


# ------------------------------------------------------------------ #3


async def _stuck() -> str:
    """Never returns (until cancelled)."""
    await trio.sleep_forever()
    return "never"


async def _deaf() -> str:
    """Ignores cancellation for 100 s, then returns."""
    with trio.CancelScope(shield=True):
        await trio.sleep(100)
    return "late"


class TestToolTimeoutIsAnErrorNotAKill:
    """#3: --tool-timeout gives the model an error result; the critic waits longer."""

    def test_the_critics_bound_is_past_the_tool_timeout(self) -> None:
        """`make_critic` puts the critic's bound on a tool in flight a grace past
        `--tool-timeout` (and the default's past the kernel's default)."""
        for given, kernel_bound in ((2.0, 2.0), (None, Limits().tool_timeout)):
            policy = make_critic(PortSpec(tool_timeout=given)).policy  # type: ignore[attr-defined]
            assert kernel_bound is not None
            assert policy.tool_timeout == kernel_bound + tool_timeout_grace(kernel_bound)
            assert policy.tool_timeout > kernel_bound
        assert make_critic(PortSpec(tool_timeout=0)).policy.tool_timeout is None  # type: ignore[attr-defined]

    async def test_a_slow_tool_returns_an_error_and_the_run_goes_on(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """Under the CLI's critic, a tool past --tool-timeout 2 is an error result the
        model reads, and the run ends ok (not killed `tool_timeout`)."""
        script = ChatScript(completion(None, call("c1", "_stuck", {})), completion("done"))
        critic = make_critic(PortSpec(tool_timeout=2, soft_timeout=0))
        result = await Kernel(Ports(critic=critic)).run(
            agent_on(script, tmp_path, tools=[_stuck]), RunInfo(),
            Limits(timeout=600, tool_timeout=2, poll_interval=0.25))
        assert result.status is Status.OK, (result.status, result.reason, result.error)
        tool_msg = script.requests[1].body["messages"][-1]
        assert tool_msg["content"] == "error: tool '_stuck' timed out after 2s"

    async def test_a_tool_ignoring_cancellation_is_still_killed(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """A tool that outlives the kernel's cancellation (it would return at 100 s, and
        the run go on) is killed `tool_timeout` by the critic once the grace has passed."""
        script = ChatScript(completion(None, call("c1", "_deaf", {})), completion("done"))
        critic = make_critic(PortSpec(tool_timeout=2, soft_timeout=0, idle_timeout=0))
        result = await Kernel(Ports(critic=critic)).run(
            agent_on(script, tmp_path, tools=[_deaf]), RunInfo(),
            Limits(timeout=7200, tool_timeout=2, poll_interval=0.25))
        assert result.status is Status.KILLED and result.reason == "tool_timeout"
        assert len(script.requests) == 1


# ------------------------------------------------------------------ #4


class TestDuplicateToolCallIds:
    """#4: each result reaches the call it belongs to, whatever ids the server sent."""

    def test_duplicate_ids_are_made_unique(self) -> None:
        comp = parse_completion(completion(
            None, call("c1", "read_file", {"path": "a.txt"}),
            call("c1", "read_file", {"path": "b.txt"}), call("c9", "read_file", "{bad"),
            call("c9", "read_file", {"path": "b.txt"})), "u")
        ids = [c.id for c in comp.tool_calls]
        assert ids == ["c1", "c1~2", "c9", "c9~2"]
        assert [c["id"] for c in comp.message["tool_calls"]] == ids

    async def test_each_result_answers_its_own_call(self, tmp_path: Path) -> None:
        """c1: a.txt, c1: b.txt, c9: invalid JSON, c9: b.txt -> the model is told AAAA,
        BBBB, the rejection, BBBB, each under the id its call has in the conversation."""
        (tmp_path / "a.txt").write_text("AAAA")
        (tmp_path / "b.txt").write_text("BBBB")
        script = ChatScript(completion(
            None, call("c1", "read_file", {"path": "a.txt"}),
            call("c1", "read_file", {"path": "b.txt"}), call("c9", "read_file", "{bad"),
            call("c9", "read_file", {"path": "b.txt"})), completion("done"))
        result = await Kernel().run(agent_on(script, tmp_path), RunInfo(), FAST)
        assert result.status is Status.OK
        sent = script.requests[1].body["messages"]
        assistant, tools = sent[-5], sent[-4:]
        assert [t["tool_call_id"] for t in tools] == [c["id"] for c in assistant["tool_calls"]]
        contents = [t["content"] for t in tools]
        assert "AAAA" in contents[0] and "BBBB" in contents[1] and "BBBB" in contents[3]
        assert contents[2].startswith("error: tool 'read_file' not run")


# ------------------------------------------------------------------ #5


class TestUnknownUsageIsNotFree:
    """#5: a server that reports no usage does not make a run free under a budget."""

    async def test_a_cost_cap_binds_without_usage(self, tmp_path: Path) -> None:
        """Priced, with no usage reported: the estimate binds the cost cap well before
        max_steps, and no model_call claims its cost is known."""
        (tmp_path / "a.txt").write_text("x")
        script = ChatScript(then=no_usage(completion(None, call("c1", "read_file",
                                                                {"path": "a.txt"}))))
        audit = MemoryAudit()
        agent = agent_on(script, tmp_path, prices={"test-model": Price(1000, 1000)})
        result = await Kernel(Ports(audit=audit)).run(
            agent, RunInfo(), Limits(max_steps=8, timeout=60, max_cost_usd=0.5))
        assert result.status is Status.BUDGET_EXCEEDED and result.steps < 8
        calls = [e.payload for e in audit.events(result.run_id) if e.kind == "model_call"]
        assert calls and all(p["cost_known"] is False and p["usage_known"] is False
                             for p in calls)
        warnings = [e.payload["message"] for e in audit.events(result.run_id)
                    if e.kind == "warning"]
        assert len(warnings) == 1 and "no token usage" in warnings[0]

    async def test_a_token_cap_binds_without_usage(self, tmp_path: Path) -> None:
        """Unpriced, with no usage reported: a token cap still ends the run."""
        (tmp_path / "a.txt").write_text("x")
        script = ChatScript(then=no_usage(completion(None, call("c1", "read_file",
                                                                {"path": "a.txt"}))))
        result = await Kernel().run(agent_on(script, tmp_path), RunInfo(),
                                    Limits(max_steps=8, timeout=60, max_total_tokens=500))
        assert result.status is Status.BUDGET_EXCEEDED and result.steps < 8
        assert result.usage.total_tokens > 500

    def test_reported_usage_is_taken_as_is(self) -> None:
        comp = parse_completion(completion("x", prompt_tokens=7, completion_tokens=3), "u")
        assert comp.usage_known and (comp.input_tokens, comp.output_tokens) == (7, 3)
        assert not parse_completion(no_usage(completion("x")), "u").usage_known


# ------------------------------------------------------------------ #6


class TestMalformedBaseURL:
    """#6: a base URL that does not parse is one line of bad input, not a traceback."""

    @pytest.mark.parametrize("url", ["http://127.0.0.1:99999/v1", "http://[::1/v1"])
    def test_build_agent_refuses_it(self, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
        kw: dict[str, Any] = {"model": "m", "prompt": "hi", "cmd": None, "api_key_env": None,
                              "allow_shell": False, "context": {}}
        with pytest.raises(ConfigError, match=r"^--base-url: base URL is malformed"):
            build_agent("llm", base_url=url, **kw)
        monkeypatch.setenv("OPENAI_BASE_URL", url)
        with pytest.raises(ConfigError, match=r"^\$OPENAI_BASE_URL: base URL is malformed"):
            build_agent("llm", base_url=None, **kw)

    def test_a_loop_judges_base_url_is_checked_up_front(self) -> None:
        with pytest.raises(ConfigError, match="--base-url"):
            llm_judge(model="m", base_url="http//x", api_key_env=None)

    @pytest.mark.realtime
    @pytest.mark.parametrize("dry", [False, True])
    def test_the_cli_exits_2_with_one_line(self, kernel_exe: str, cli_env: dict[str, str],
                                           dry: bool) -> None:
        env = {**cli_env, "OPENAI_BASE_URL": "http://[::1/v1"}
        proc = subprocess.run(
            [kernel_exe, "run", "--agent", "llm", "--model", "m", "--prompt", "hi",
             *(["--dry-run"] if dry else [])],
            capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
        assert "$OPENAI_BASE_URL: base URL is malformed" in proc.stderr


# ------------------------------------------------------------------ #7


class TestRejectedCallsReachTheCritic:
    """#7: the same unusable call over and over is a loop the critic sees."""

    async def test_repeated_invalid_arguments_are_killed_as_a_loop(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        bad = completion(None, call("c1", "read_file", "{bad"))
        script = ChatScript(then=bad)
        audit = MemoryAudit()
        result = await Kernel(Ports(audit=audit, critic=WatchCritic())).run(
            agent_on(script, tmp_path), RunInfo(), FAST)
        assert result.status is Status.KILLED, (result.status, result.error)
        assert result.steps < 10
        starts = [e.payload for e in audit.events(result.run_id) if e.kind == "tool_start"]
        assert starts and all(p["rejected"] for p in starts)


# ------------------------------------------------------------------ #8


@dataclasses.dataclass(frozen=True)
class _JudgeRequest:
    """A judge request carrying the run's context (what the loop adapter hands over)."""

    prompt: str
    output: str
    schema: dict[str, Any]
    model: str | None = None
    max_tokens: int = 256
    ctx: RunContext | None = None


class _Judged:
    """An agent whose one step asks `judge` for a verdict, as a loop state does."""

    def __init__(self, judge: Any) -> None:
        self.judge = judge

    async def step(self, ctx: RunContext) -> Step:
        answer = await self.judge(_JudgeRequest("ok?", "out", {"type": "object"}, ctx=ctx))
        return Step(output=answer["verdict"], final=True, usage=answer["usage"])


class TestTheJudgeIsAModelCall:
    """#8: a loop's judge call is in flight for the critic, and audited like the agent's."""

    async def test_a_slow_judge_is_not_stalled_and_its_retries_are_audited(
            self, autojump_clock: trio.abc.Clock) -> None:
        """Two 503s, then an answer after 10 s, under --idle-timeout 3: the run is ok,
        with two model_retry events and one model_call."""
        script = ChatScript(Reply({}, status=503), Reply({}, status=503),
                            Reply(completion('{"verdict": "yes"}'), delay=10))
        client = ChatClient("http://llm.test/v1", transport=httpx.MockTransport(script),
                            backoff=0.01)
        judge = llm_judge(model="m", base_url=None, api_key_env=None, client=client)
        audit = MemoryAudit()
        critic = WatchCritic(CriticPolicy(idle_timeout=3, grace=1, model_timeout=300,
                                          soft_timeout=None))
        result = await Kernel(Ports(audit=audit, critic=critic)).run(
            _Judged(judge), RunInfo(), Limits(timeout=600, poll_interval=0.25))
        assert result.status is Status.OK and result.output == "yes"
        kinds = audit.kinds(result.run_id)
        assert kinds.count("model_retry") == 2 and kinds.count("model_call") == 1


# ------------------------------------------------------------------ #9


class _Ports(BaseHTTPRequestHandler):
    """Answers two tool-call turns then "done", keeping each request's client port."""

    protocol_version = "HTTP/1.1"
    peers: list[int] = []
    lock = threading.Lock()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        with self.lock:
            self.peers.append(self.client_address[1])
            n = len(self.peers)
        body = (completion(None, call(f"c{n}", "read_file", {"path": "a.txt"})) if n < 3
                else completion("done"))
        send_json(self, body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class TestOneConnectionPerRun:
    """#9: a run not entered with `async with agent` still reuses one connection."""

    async def test_three_turns_one_connection(self, tmp_path: Path) -> None:
        (tmp_path / "a.txt").write_text("x")
        _Ports.peers = []
        with serving(_Ports) as port:
            agent = LLMAgent("m", "hi", client=ChatClient(f"http://127.0.0.1:{port}/v1"),
                             cwd=tmp_path)
            result = await Kernel().run(agent, RunInfo(), FAST)
        assert result.status is Status.OK and result.output == "done"
        assert len(_Ports.peers) == 3 and len(set(_Ports.peers)) == 1
        assert not agent.client.pooled  # closed by the turn that ended the run


# ------------------------------------------------------------------ #10


class TestCutAtTheLengthLimit:
    """#10: an answer cut at the length limit before any text is a clear `error`."""

    @pytest.mark.parametrize("content", [None, ""])
    async def test_no_text_at_the_length_limit_is_an_error(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock,
            content: str | None) -> None:
        cut = completion(content)
        cut["choices"][0]["finish_reason"] = "length"
        script = ChatScript(then=cut)
        result = await Kernel().run(agent_on(script, tmp_path), RunInfo(), FAST)
        assert result.status is Status.ERROR
        assert "cut at the model's length limit" in (result.error or "")
        assert len(script.requests) == 1

    async def test_empty_answers_without_a_critic_end_error_not_killed(
            self, tmp_path: Path, autojump_clock: trio.abc.Clock) -> None:
        """`killed` is the critic's word: the agent's own bound on empty answers ends
        the run `error`."""
        script = ChatScript(then=completion(""))
        result = await Kernel().run(agent_on(script, tmp_path), RunInfo(), FAST)
        assert result.status is Status.ERROR
        assert "empty message 3 times in a row" in (result.error or "")


# ------------------------------------------------------------------ #11


class TestRedirects:
    """#11: a redirect's error says where it points."""

    @pytest.mark.parametrize(("location", "shown"), [
        ("http://127.0.0.1:1/v1/chat/completions?sig=abcdefgh",
         "http://127.0.0.1:1/v1/chat/completions"),
        ("/api/v1/chat/completions", "http://llm.test/api/v1/chat/completions"),
    ])
    async def test_the_location_is_named(self, tmp_path: Path, autojump_clock: trio.abc.Clock,
                                         location: str, shown: str) -> None:
        script = ChatScript(Reply("", status=307, headers={"Location": location}))
        result = await Kernel().run(agent_on(script, tmp_path), RunInfo(), FAST)
        assert result.status is Status.ERROR
        assert f"HTTP 307 Temporary Redirect to {shown} (" in (result.error or "")
        assert "abcdefgh" not in (result.error or "")
