"""Delivery batteries: stdout, an atomic directory, and a webhook on a real local server."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import trio

from batteries.delivery import DirectoryDelivery, FanOut, StdoutDelivery, WebhookDelivery
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

    async def test_client_error_is_not_retried(self, hook_factory: type[Hook]) -> None:
        """A 4xx (other than 429) fails at once without retrying."""
        hook = hook_factory([404])
        delivery = WebhookDelivery(hook.url, wait_initial=0.01)
        result = await Kernel(Ports(delivery=delivery)).run(ScriptedAgent())
        assert delivery.tries == 1
        assert "HTTP 404" in result.port_failures[0].error

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
        fan = FanOut([StdoutDelivery(stream=text), StdoutDelivery(as_json=True, stream=js)])
        result = await Kernel(Ports(delivery=fan)).run(
            ScriptedAgent([Step(output="out", final=True)]))
        assert text.getvalue() == "out\n"
        assert json.loads(js.getvalue())["run_id"] == result.run_id

    async def test_fan_out_keeps_going(self, tmp_path: Path) -> None:
        """One failing delivery does not stop the others; the failure names it."""
        blocker = tmp_path / "file"
        blocker.write_text("")
        out = io.StringIO()
        fan = FanOut([DirectoryDelivery(blocker / "x"), StdoutDelivery(stream=out)])
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
