"""Loops judged by a model: llm_structured through the LLM adapter, end to end (real time)."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from adapters.llm import parse_answer

pytestmark = pytest.mark.realtime

LOOP = """\
name: judged
initial: check
states:
  check:
    action: echo "all 12 tests passed"
    evaluate:
      type: llm_structured
      prompt: Did the tests pass?
    route:
      yes: done
      no: failed
  done:
    terminal: true
  failed:
    action: 'echo "FATAL_ERROR: the model judged a failure"'
"""


class ChatServer:
    """A chat-completions endpoint on 127.0.0.1 answering with a scripted message."""

    def __init__(self, content: str, delay: float = 0.0) -> None:
        self.content = content
        self.requests: list[dict[str, object]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                server.requests.append(body)
                if delay:
                    threading.Event().wait(delay)  # a model thinking (slower than idle)
                answer = json.dumps({
                    "id": "c1", "object": "chat.completion", "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": server.content}}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5}}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def chat() -> Iterator[type[ChatServer]]:
    made: list[ChatServer] = []

    class Made(ChatServer):
        def __init__(self, content: str, delay: float = 0.0) -> None:
            super().__init__(content, delay)
            made.append(self)

    yield Made
    for server in made:
        server.httpd.shutdown()
        server.httpd.server_close()


class TestLoopJudge:
    @pytest.mark.parametrize(("verdict", "code"), [("yes", 0), ("no", 1)])
    def test_model_verdict_routes_the_loop(self, verdict: str, code: int,
                                           chat: type[ChatServer], kernel_exe: str,
                                           cli_env: dict[str, str], tmp_path: Path) -> None:
        """The model's verdict (from a real local server) decides the route."""
        server = chat(f'```json\n{{"verdict": "{verdict}", "confidence": 0.9, '
                      f'"reason": "read the summary"}}\n```')
        loop = tmp_path / "judged.yaml"
        loop.write_text(LOOP)
        proc = subprocess.run(
            [kernel_exe, "run", "--json", str(loop), "--model", "judge-1", "--base-url",
             server.url], capture_output=True, text=True, env=cli_env, timeout=60)
        assert proc.returncode == code, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["status"] == ("ok" if code == 0 else "error")
        [request] = server.requests
        assert request["model"] == "judge-1"
        messages = request["messages"]
        assert isinstance(messages, list)
        assert "all 12 tests passed" in messages[1]["content"]
        assert "Did the tests pass?" in messages[1]["content"]

    def test_a_slow_judge_is_a_model_request_not_a_stall(
            self, chat: type[ChatServer], kernel_exe: str, cli_env: dict[str, str],
            tmp_path: Path) -> None:
        """A judge call slower than --idle-timeout is work in flight (the critic's
        model_timeout bounds it), and it is audited as a `model_call`."""
        server = chat('{"verdict": "yes"}', delay=5.0)  # well past idle + grace
        loop = tmp_path / "judged.yaml"
        loop.write_text(LOOP)
        proc = subprocess.run(
            [kernel_exe, "run", "--json", str(loop), "--model", "judge-1", "--base-url",
             server.url, "--idle-timeout", "2"], capture_output=True, text=True,
            env=cli_env, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        run_id = json.loads(proc.stdout)["run_id"]
        shown = json.loads(subprocess.run([kernel_exe, "show", run_id, "--json"],
                                          capture_output=True, text=True, env=cli_env,
                                          timeout=60).stdout)
        calls = [e for e in shown["events"] if e["kind"] == "model_call"]
        assert len(calls) == 1 and calls[0]["payload"].get("judge") is True, calls

    def test_no_model_is_an_error_verdict(self, kernel_exe: str, cli_env: dict[str, str],
                                          tmp_path: Path) -> None:
        """Without a model anywhere, the evaluation says why; the loop routes on `error`."""
        loop = tmp_path / "judged.yaml"
        loop.write_text(LOOP)
        proc = subprocess.run([kernel_exe, "run", "--json", str(loop)], capture_output=True,
                              text=True, env=cli_env, timeout=60)
        assert proc.returncode == 1
        run_id = json.loads(proc.stdout)["run_id"]
        shown = subprocess.run([kernel_exe, "show", run_id, "--json"], capture_output=True,
                               text=True, env=cli_env, timeout=60).stdout
        assert "llm_structured needs a model" in shown


class TestJudgeCost:
    """The judge's calls are the run's spend: priced by --price, bounded by cost budgets."""

    def run(self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, url: str,
            *extra: str) -> subprocess.CompletedProcess[str]:
        loop = tmp_path / "judged.yaml"
        loop.write_text(LOOP)
        return subprocess.run(
            [kernel_exe, "run", "--json", str(loop), "--model", "judge-1", "--base-url", url,
             *extra], capture_output=True, text=True, env=cli_env, timeout=60)

    def test_price_gives_the_judges_calls_a_cost(self, chat: type[ChatServer],
                                                 kernel_exe: str, cli_env: dict[str, str],
                                                 tmp_path: Path) -> None:
        """With --price, the run's usage holds the judge's tokens and what they cost."""
        server = chat('{"verdict": "yes"}')
        proc = self.run(kernel_exe, cli_env, tmp_path, server.url, "--price", "1000,2000")
        assert proc.returncode == 0, proc.stderr
        usage = json.loads(proc.stdout)["usage"]
        assert (usage["input_tokens"], usage["output_tokens"]) == (10, 5)
        assert usage["cost_usd"] == pytest.approx((10 * 1000 + 5 * 2000) / 1e6)

    def test_a_cost_budget_refuses_an_unpriced_judge(self, chat: type[ChatServer],
                                                     kernel_exe: str, cli_env: dict[str, str],
                                                     tmp_path: Path) -> None:
        """A caller with a cost budget cannot run a loop whose judge has no price: its
        calls would cost 0 and the budget would not bound them. Refused before any call
        (budget_exceeded, exit 3, naming --price); with --price it runs and is charged."""
        server = chat('{"verdict": "yes"}')
        subprocess.run([kernel_exe, "budget", "set", "ci", "--cost", "5"], check=True,
                       capture_output=True, env=cli_env, timeout=60)
        proc = self.run(kernel_exe, cli_env, tmp_path, server.url, "--caller", "ci")
        assert proc.returncode == 3, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["status"] == "budget_exceeded"
        assert "cost budget" in doc["error"] and "--price" in doc["error"]
        assert server.requests == []
        proc = self.run(kernel_exe, cli_env, tmp_path, server.url, "--caller", "ci",
                        "--price", "1000,2000")
        assert proc.returncode == 0, proc.stderr
        shown = subprocess.run([kernel_exe, "budget", "show", "--json"], capture_output=True,
                               text=True, env=cli_env, timeout=60)
        assert shown.returncode == 0, shown.stderr
        (row,) = [json.loads(line) for line in shown.stdout.splitlines()]
        assert row["runs"] == 2  # the refused run was admitted first: a run costing 0
        assert row["cost_usd"] == pytest.approx(0.02)


class TestParseAnswer:
    @pytest.mark.parametrize("text", [
        '{"verdict": "yes"}', '```json\n{"verdict": "yes"}\n```',
        'Sure! {"verdict": "yes"} Hope that helps.'])
    def test_finds_the_object(self, text: str) -> None:
        """A bare object, a fenced one, or one wrapped in chatter is found."""
        assert parse_answer(text)["verdict"] == "yes"

    @pytest.mark.parametrize("text", ["yes", "[1, 2]", "{not json}"])
    def test_refuses_non_objects(self, text: str) -> None:
        """Anything but a JSON object is a ValueError (an `error` verdict for the loop)."""
        with pytest.raises(ValueError, match="JSON"):
            parse_answer(text)
