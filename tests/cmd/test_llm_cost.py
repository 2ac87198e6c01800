"""What an `--agent llm` run costs: --price, the server's own `usage.cost`, cost budgets.

Real `kernel` processes against a chat-completions server on 127.0.0.1.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import pytest
from http_fakes import send_json, serving

pytestmark = pytest.mark.realtime


class _Priced(BaseHTTPRequestHandler):
    """Answers "done", using 3 input and 2 output tokens; reports `usage.cost` when the
    model is named "reported"."""

    calls = 0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).calls += 1
        usage: dict[str, Any] = {"prompt_tokens": 3, "completion_tokens": 2}
        if body["model"] == "reported":
            usage["cost"] = 0.0125
        send_json(self, {"model": body["model"], "usage": usage, "choices": [
            {"message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}]})

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Priced.calls = 0
    with serving(_Priced) as port:
        yield f"http://127.0.0.1:{port}/v1"


@pytest.fixture
def kernel(kernel_exe: str, cli_env: dict[str, str]) -> Any:
    env = {k: v for k, v in cli_env.items() if not k.startswith("OPENAI_")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([kernel_exe, *args], capture_output=True, text=True,
                              timeout=60, env=env)

    return run


def llm(kernel: Any, url: str, *extra: str, model: str = "m") -> dict[str, Any]:
    proc = kernel("run", "--json", "--agent", "llm", "--model", model, "--base-url", url,
                  "--prompt", "hi", *extra)
    assert proc.returncode in (0, 3), proc.stderr
    doc: dict[str, Any] = json.loads(proc.stdout)
    assert doc["exit_code"] == proc.returncode
    return doc


class TestCost:
    def test_price_makes_the_cost(self, kernel: Any, server: str) -> None:
        """--price IN,OUT (dollars per million tokens) prices each call."""
        doc = llm(kernel, server, "--price", "1000,2000")
        assert doc["status"] == "ok"
        assert doc["usage"]["cost_usd"] == pytest.approx((3 * 1000 + 2 * 2000) / 1e6)

    def test_the_servers_reported_cost_is_used(self, kernel: Any, server: str) -> None:
        """Without --price, a server that reports `usage.cost` (OpenRouter, LiteLLM) is
        believed; the audit's model_call says the cost was known."""
        doc = llm(kernel, server, model="reported")
        assert doc["usage"]["cost_usd"] == pytest.approx(0.0125)
        shown = kernel("show", doc["run_id"], "--json")
        calls = [e for e in json.loads(shown.stdout)["events"] if e["kind"] == "model_call"]
        assert [c["payload"]["cost_known"] for c in calls] == [True]

    def test_a_cost_budget_refuses_an_unpriced_model(self, kernel: Any, server: str) -> None:
        """A caller whose budget caps cost cannot run a model the kernel cannot price:
        refused before the first call (budget_exceeded, exit 3, saying --price; it was
        admitted by the budget first, so it counts as one of their runs, costing 0).
        Priced, the run goes and is charged: its one answer costs $0.007, over the
        $0.005 left, so it ends budget_exceeded with its output (caps are checked after
        the last step too); the cost spent, the next run is refused by the budget itself."""
        assert kernel("budget", "set", "ann", "--cost", "0.005").returncode == 0
        doc = llm(kernel, server, "--caller", "ann")
        assert doc["status"] == "budget_exceeded"
        assert "cost budget" in doc["error"] and "--price" in doc["error"]
        assert _Priced.calls == 0
        doc = llm(kernel, server, "--caller", "ann", "--price", "1000,2000")
        assert (doc["status"], doc["reason"], doc["output"], _Priced.calls) == (
            "budget_exceeded", "max_cost_usd", "done", 1)
        doc = llm(kernel, server, "--caller", "ann", "--price", "1000,2000")
        assert doc["status"] == "budget_exceeded"
        assert "used $0.007 of $0.005 cost in the last 24h" in doc["error"]
        (row,) = [json.loads(line) for line in
                  kernel("budget", "show", "--json").stdout.splitlines()]
        assert (row["runs"], row["cost_usd"]) == (2, pytest.approx(0.007))

    def test_a_budget_without_a_cost_cap_needs_no_price(self, kernel: Any,
                                                        server: str) -> None:
        """Only a cost cap needs a price: a token budget bounds an unpriced model."""
        assert kernel("budget", "set", "bob", "--tokens", "100").returncode == 0
        assert llm(kernel, server, "--caller", "bob")["status"] == "ok"

    @pytest.mark.parametrize(("args", "message"), [
        (("--price", "1", "--agent", "llm"), "expects IN,OUT"),
        (("--price", "1,-2", "--agent", "llm"), "two amounts >= 0"),
        (("--price", "nan,1", "--agent", "llm"), "two amounts >= 0"),
        (("--price", "1,2", "--", "echo"), "--price is for --agent llm and loop files"),
        (("--price", "1,2", "--agent", "agentcli", "--cmd", "true"),
         "--price is for --agent llm"),
    ])
    def test_bad_prices_exit_2(self, kernel: Any, args: tuple[str, ...],
                               message: str) -> None:
        proc = kernel("run", *args)
        assert proc.returncode == 2
        (line,) = proc.stderr.strip().splitlines()
        assert message in line


def test_a_batch_prices_its_tasks(kernel: Any, server: str, tmp_path: Any) -> None:
    """`kernel batch` tasks take "price" too: under a cost budget the priced task runs
    and is charged, the unpriced one is refused before its first call."""
    assert kernel("budget", "set", "fleet", "--cost", "10").returncode == 0
    tasks = tmp_path / "tasks.jsonl"
    base = {"agent": "llm", "model": "m", "prompt": "hi", "base_url": server,
            "caller": "fleet"}
    tasks.write_text("\n".join(json.dumps(t) for t in (
        {**base, "id": "priced", "price": [1000, 2000]}, {**base, "id": "unpriced"})) + "\n")
    proc = kernel("batch", str(tasks), "--json", "--concurrency", "1")
    assert proc.returncode == 1, proc.stderr
    ended = {d["task_id"]: d for d in map(json.loads, proc.stdout.splitlines())}
    assert ended["priced"]["status"] == "ok"
    assert ended["unpriced"]["status"] == "budget_exceeded"
    assert "has no price" in ended["unpriced"]["error"]
    assert _Priced.calls == 1
