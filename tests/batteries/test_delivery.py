"""Delivery batteries: stdout, an atomic directory, and a webhook (mock transport, real server)."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import trio

from batteries.delivery import DirectoryDelivery, FanOutDelivery, StdoutDelivery, WebhookDelivery
from kernel import Kernel, Ports, RunInfo, Status, Step
from kernel.testing import MemoryAudit, ScriptedAgent


class Hook:
    """A real HTTP server on 127.0.0.1 answering POSTs with scripted status codes."""

    def __init__(self, codes: list[int]) -> None:
        self.codes = codes
        self.bodies: list[dict[str, object]] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["content-length"])
                hook.bodies.append(json.loads(self.rfile.read(length)))
                code = hook.codes.pop(0) if hook.codes else 200
                self.send_response(code)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook_factory() -> Iterator[type[Hook]]:
    made: list[Hook] = []

    class Made(Hook):
        def __init__(self, codes: list[int]) -> None:
            super().__init__(codes)
            made.append(self)

    yield Made
    for h in made:
        h.close()


def dead_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (a port just released)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/hook"


class Script:
    """An `httpx.MockTransport` handler answering with scripted statuses, noting when."""

    def __init__(self, *answers: int | str) -> None:
        self.answers = list(answers)
        self.times: list[float] = []
        self.bodies: list[dict[str, object]] = []
        self.headers: list[httpx.Headers] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.times.append(trio.current_time())
        self.bodies.append(json.loads(request.content))
        self.headers.append(request.headers)
        answer = self.answers.pop(0) if self.answers else 200
        if answer == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        if answer == "hang":
            await trio.sleep(10_000)
        return httpx.Response(int(answer))


class TestWebhookVirtualTime:
    """Retries and backoff through `httpx.MockTransport`, waits on the virtual clock."""

    async def test_backoff_doubles_up_to_the_cap(self, autojump_clock: trio.abc.Clock) -> None:
        """500, 503, 429 and a refused connection are retried with capped, jittered backoff."""
        script = Script(500, 503, 429, "refuse", 200)
        delivery = WebhookDelivery("http://hook.test/x", attempts=5, wait_initial=1.0,
                                   wait_max=3.0, timeout=100,
                                   transport=httpx.MockTransport(script))
        result = await Kernel(Ports(delivery=delivery)).run(
            ScriptedAgent([Step(output="hello", final=True)]))
        assert result.port_failures == [] and delivery.tries == 5
        gaps = [b - a for a, b in zip(script.times, script.times[1:], strict=False)]
        # wait n = min(wait_max, wait_initial * 2**(n-1)) + jitter in [0, wait_initial)
        for gap, base in zip(gaps, (1.0, 2.0, 3.0, 3.0), strict=True):
            assert base <= gap < base + 1.0, gaps
        assert [b["output"] for b in script.bodies] == ["hello"] * 5

    async def test_attempts_run_out(self, autojump_clock: trio.abc.Clock) -> None:
        """After `attempts` failures the delivery fails, naming the count and the last answer."""
        script = Script(502, 502, 502, 502)
        delivery = WebhookDelivery("http://hook.test/x", attempts=3,
                                   transport=httpx.MockTransport(script))
        result = await Kernel(Ports(delivery=delivery)).run(ScriptedAgent())
        assert len(script.times) == 3
        assert "failed after 3 attempt(s): HTTP 502" in result.port_failures[0].error

    async def test_client_error_is_not_retried(self, autojump_clock: trio.abc.Clock) -> None:
        """A 4xx (other than 429) fails at once without retrying."""
        script = Script(404)
        delivery = WebhookDelivery("http://hook.test/x", transport=httpx.MockTransport(script))
        result = await Kernel(Ports(delivery=delivery)).run(ScriptedAgent())
        assert delivery.tries == 1 and len(script.times) == 1
        assert "HTTP 404" in result.port_failures[0].error

    async def test_total_timeout_bounds_a_hanging_endpoint(
            self, autojump_clock: trio.abc.Clock) -> None:
        """An endpoint that never answers is given up on at `timeout`, across all tries."""
        script = Script("hang", "hang")
        delivery = WebhookDelivery("http://hook.test/x", timeout=20, attempts=5,
                                   transport=httpx.MockTransport(script))
        t0 = trio.current_time()
        result = await Kernel(Ports(delivery=delivery)).run(ScriptedAgent())
        assert trio.current_time() - t0 == pytest.approx(20, abs=0.5)
        assert len(script.times) == 1
        assert "no answer within 20s" in result.port_failures[0].error

    async def test_the_hosts_client_is_used_and_left_open(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A client the host passes in carries the POST and is not closed by the delivery."""
        script = Script(200)
        async with httpx.AsyncClient(transport=httpx.MockTransport(script),
                                     headers={"x-host": "mine"}) as client:
            delivery = WebhookDelivery("http://hook.test/x", client=client,
                                       headers={"authorization": "Bearer t"})
            result = await Kernel(Ports(delivery=delivery)).run(ScriptedAgent())
            assert result.port_failures == [] and len(script.times) == 1
            assert not client.is_closed
        assert script.headers[0]["x-host"] == "mine"
        assert script.headers[0]["authorization"] == "Bearer t"


@pytest.mark.realtime
class TestWebhook:
    async def test_retry_after_500(self, hook_factory: type[Hook]) -> None:
        """A 500 is retried; the second POST succeeds and carries the result JSON."""
        hook = hook_factory([500, 200])
        delivery = WebhookDelivery(hook.url, wait_initial=0.01, wait_max=0.05)
        result = await Kernel(Ports(delivery=delivery)).run(
            ScriptedAgent([Step(output="hello", final=True)]), RunInfo(name="w"))
        assert result.status is Status.OK and result.port_failures == []
        assert delivery.tries == 2
        assert [b["output"] for b in hook.bodies] == ["hello", "hello"]
        assert hook.bodies[0]["run_id"] == result.run_id

    async def test_dead_endpoint(self) -> None:
        """A dead endpoint is reported on the result and in the audit; the status stands."""
        audit = MemoryAudit()
        delivery = WebhookDelivery(dead_url(), attempts=3, wait_initial=0.01, wait_max=0.02)
        result = await Kernel(Ports(audit=audit, delivery=delivery)).run(
            ScriptedAgent([Step(output="x", final=True)]))
        assert result.status is Status.OK
        [failure] = result.port_failures
        assert failure.port == "delivery"
        assert "failed after 3 attempt(s)" in failure.error
        assert "port_failure" in audit.kinds(result.run_id)

    def test_bad_url(self) -> None:
        """A URL that is not http(s) is refused when the delivery is built."""
        with pytest.raises(ValueError, match="http"):
            WebhookDelivery("ftp://example")


class TestDirectory:
    async def test_writes_the_run_folder(self, tmp_path: Path) -> None:
        """result.json, output.txt and artifacts land in <root>/<run_id>/, no temp left."""
        agent = ScriptedAgent([Step(output="report body", final=True,
                                    artifacts={"notes/a.txt": "A", "b.bin": b"\x00\x01"})])
        result = await Kernel(Ports(delivery=DirectoryDelivery(tmp_path))).run(agent)
        folder = tmp_path / result.run_id
        assert json.loads((folder / "result.json").read_text())["status"] == "ok"
        assert (folder / "output.txt").read_text() == "report body"
        assert (folder / "artifacts" / "notes" / "a.txt").read_text() == "A"
        assert (folder / "artifacts" / "b.bin").read_bytes() == b"\x00\x01"
        assert [p.name for p in tmp_path.iterdir()] == [result.run_id]

    async def test_escaping_artifact_is_refused(self, tmp_path: Path) -> None:
        """An artifact named ../x is refused, nothing is left half-written, status stands."""
        agent = ScriptedAgent([Step(output="x", final=True, artifacts={"../evil": "x"})])
        result = await Kernel(Ports(delivery=DirectoryDelivery(tmp_path / "out"))).run(agent)
        assert result.status is Status.OK
        assert "escapes" in result.port_failures[0].error
        assert list((tmp_path / "out").iterdir()) == []
        assert not (tmp_path / "evil").exists()

    async def test_unwritable_root(self, tmp_path: Path) -> None:
        """A root that cannot be created is a delivery failure, not a crash."""
        blocker = tmp_path / "file"
        blocker.write_text("not a dir")
        result = await Kernel(Ports(delivery=DirectoryDelivery(blocker / "sub"))).run(
            ScriptedAgent())
        assert result.status is Status.OK and result.port_failures[0].port == "delivery"


class TestStdoutAndFanOut:
    async def test_text_and_json(self) -> None:
        """Text mode prints the output; JSON mode prints one result object."""
        text, js = io.StringIO(), io.StringIO()
        fan = FanOutDelivery([StdoutDelivery(stream=text), StdoutDelivery(as_json=True, stream=js)])
        result = await Kernel(Ports(delivery=fan)).run(
            ScriptedAgent([Step(output="out", final=True)]))
        assert text.getvalue() == "out\n"
        assert json.loads(js.getvalue())["run_id"] == result.run_id

    async def test_fan_out_keeps_going(self, tmp_path: Path) -> None:
        """One failing delivery does not stop the others; the failure names it."""
        blocker = tmp_path / "file"
        blocker.write_text("")
        out = io.StringIO()
        fan = FanOutDelivery([DirectoryDelivery(blocker / "x"), StdoutDelivery(stream=out)])
        result = await Kernel(Ports(delivery=fan)).run(
            ScriptedAgent([Step(output="still here", final=True)]))
        assert out.getvalue() == "still here\n"
        assert "DeliveryError: DirectoryDelivery: cannot write" in result.port_failures[0].error


def test_trio_is_used() -> None:
    """The webhook client runs on trio (httpx through anyio), not asyncio."""
    seen: list[str] = []

    async def main() -> None:
        import sniffio

        seen.append(sniffio.current_async_library())

    trio.run(main)
    assert seen == ["trio"]
