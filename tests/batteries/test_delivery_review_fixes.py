"""Review fixes for result delivery (`--deliver-dir`, `--webhook`), each with real parts.

Every test here failed before its fix: webhook credentials printed on stderr
and in `--json`, a redirect taken for a delivery, a huge answer read into
memory, a hanging webhook starving the next one, bad URLs accepted until the
run had finished, `Retry-After` ignored, attempts counted across deliveries,
a non-UTF-8 locale or a lone surrogate losing the whole folder, and an output
that is not plain JSON delivered nowhere.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from batteries.delivery import DirectoryDelivery, FanOutDelivery, WebhookDelivery
from kernel import DeliveryError, Kernel, Limits, Ports, Result, Status, Step
from kernel.testing import ScriptedAgent

Behaviour = Callable[[BaseHTTPRequestHandler, "Server"], None]


class Server:
    """A real threaded HTTP server on 127.0.0.1 whose POST handler is `behaviour`.

    It keeps the bodies it received and how many answer bytes it got out, and
    `release` frees handlers that wait (a hanging endpoint) so closing is prompt.
    """

    def __init__(self, behaviour: Behaviour) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.sent = 0
        self.handled = threading.Event()
        self.release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                server.bodies.append(json.loads(self.rfile.read(length)))
                try:
                    behaviour(self, server)
                finally:
                    server.handled.set()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[[Behaviour], Server]]:
    """Start servers with a behaviour each; all are closed after the test."""
    made: list[Server] = []

    def start(behaviour: Behaviour) -> Server:
        made.append(Server(behaviour))
        return made[-1]

    yield start
    for s in made:
        s.close()


def answer(code: int, **headers: str) -> Behaviour:
    """A behaviour answering `code` with `headers` and an empty body."""
    def behave(h: BaseHTTPRequestHandler, _: Server) -> None:
        h.send_response(code)
        for k, v in headers.items():
            h.send_header(k.replace("_", "-"), v)
        h.send_header("content-length", "0")
        h.end_headers()
    return behave


def hang(h: BaseHTTPRequestHandler, server: Server) -> None:
    """Never answer (until the test is over)."""
    server.release.wait(300)


def dead_port() -> int:
    """A port on 127.0.0.1 where nothing listens (one just released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


async def run_with(delivery: Any, output: Any = "done", artifacts: dict[str, Any] | None = None,
                   limits: Limits | None = None) -> Result:
    """One scripted run whose result goes to `delivery`."""
    agent = ScriptedAgent([Step(output=output, final=True, artifacts=artifacts or {})])
    return await Kernel(Ports(delivery=delivery)).run(agent, limits=limits)


def wait_for(condition: Callable[[], bool], what: str, bound: float = 60.0) -> None:
    """Poll `condition` until true; fail naming `what` after `bound` seconds."""
    end = time.monotonic() + bound
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


# --------------------------------------------------------------------- secrets


@pytest.mark.realtime
def test_cli_never_prints_webhook_credentials(kernel_exe: str, cli_env: dict[str, str]) -> None:
    """A webhook URL's password and query values stay off stderr and `--json`.

    They are secrets (README: a webhook that held a password is not stored);
    the audit redacted them, but the warning and `port_failures` printed the
    raw URL. The warning still says which webhook failed (host and path).
    """
    port = dead_port()
    url = f"http://alice:hunter2pw@127.0.0.1:{port}/hook?token=qs3cretvalue&x=1#frag"
    proc = subprocess.run([kernel_exe, "run", "--json", "--webhook", url, "--", "echo", "hi"],
                          capture_output=True, text=True, env=cli_env, timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["status"] == "ok" and doc["output"] == "hi"
    for secret in ("hunter2pw", "qs3cretvalue"):
        assert secret not in proc.stdout and secret not in proc.stderr
    assert f"127.0.0.1:{port}/hook" in proc.stderr
    [failure] = doc["port_failures"]
    assert failure.startswith("delivery.deliver") and f"127.0.0.1:{port}/hook" in failure


async def test_slack_webhook_path_is_not_in_the_error(autojump_clock: trio.abc.Clock) -> None:
    """The path of a Slack webhook URL is its credential: errors show its host only."""
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"cannot reach {request.url}", request=request)

    url = "https://hooks.slack.com/services/T0AAAAAAA/B0BBBBBBB/zzSecretPathPart9"
    result = await run_with(WebhookDelivery(url, attempts=2, transport=httpx.MockTransport(refuse)))
    [failure] = result.port_failures
    assert "zzSecretPathPart9" not in failure.error
    assert "hooks.slack.com" in failure.error


# ----------------------------------------------------------- webhook answers


@pytest.mark.realtime
async def test_a_redirect_is_not_a_delivery(serve: Callable[[Behaviour], Server]) -> None:
    """A 301/307 means the result did not arrive: a failure naming where it points.

    It was taken for success (`< 400`), so a moved endpoint silently lost every
    result. The redirect is not followed (it could send the result elsewhere).
    """
    for code in (301, 307):
        hook = serve(answer(code, location="http://elsewhere.test/new?k=s3cretloc"))
        result = await run_with(WebhookDelivery(hook.url, attempts=3))
        assert result.status is Status.OK
        [failure] = result.port_failures
        assert f"HTTP {code}" in failure.error and "elsewhere.test/new" in failure.error
        assert "s3cretloc" not in failure.error
        assert len(hook.bodies) == 1  # not retried: it will redirect again


@pytest.mark.realtime
async def test_a_huge_answer_is_not_read(serve: Callable[[Behaviour], Server]) -> None:
    """Only the status of the answer matters: its body is never read into memory.

    An endpoint answering 2xx with a 256 MiB body made the kernel hold all of it.
    """
    total = 256 * 1024 * 1024

    def huge(h: BaseHTTPRequestHandler, server: Server) -> None:
        h.send_response(200)
        h.send_header("content-length", str(total))
        h.end_headers()
        chunk = b"x" * 65536
        try:
            while server.sent < total:
                h.wfile.write(chunk)
                server.sent += len(chunk)
        except OSError:
            pass

    hook = serve(huge)
    result = await run_with(WebhookDelivery(hook.url))
    assert result.port_failures == []
    await trio.to_thread.run_sync(wait_for, hook.handled.is_set, "the server's handler")
    assert hook.sent < total // 4


@pytest.mark.realtime
async def test_a_hanging_webhook_does_not_starve_the_next(
        serve: Callable[[Behaviour], Server]) -> None:
    """Each webhook gets its chance and reports its own failure within the bound.

    A webhook that never answered used the whole finalize share, so the one
    after it was never tried and the warning was an anonymous `kernel.finalize`.
    """
    stuck, ok = serve(hang), serve(answer(204))
    fan = FanOutDelivery([WebhookDelivery(stuck.url), WebhookDelivery(ok.url)])
    result = await run_with(fan, output="for both", limits=Limits(finalize_timeout=8))
    assert result.status is Status.OK
    assert [b["output"] for b in ok.bodies] == ["for both"]
    [failure] = result.port_failures
    assert failure.port == "delivery", failure
    assert stuck.url in failure.error and "no answer" in failure.error


async def test_a_retry_after_that_is_not_ascii_digits_is_ignored(
        autojump_clock: trio.abc.Clock) -> None:
    """`Retry-After: ²` ('²'.isdigit() is True, float('²') is not) escaped as a raw
    ValueError and the delivery was never retried; it is now no wait at all."""
    answers = [httpx.Response(503, headers=[(b"retry-after", "\u00b2".encode())]),
               httpx.Response(200)]

    def script(request: httpx.Request) -> httpx.Response:
        return answers.pop(0)

    result = await run_with(WebhookDelivery("http://hook.test/x",
                                            transport=httpx.MockTransport(script)))
    assert result.port_failures == [] and answers == []


async def test_retry_after_is_honoured(autojump_clock: trio.abc.Clock) -> None:
    """A 429/503 `Retry-After` is waited for; one beyond the time bound ends it at once.

    It was ignored: an endpoint that asked for an hour's pause got four more
    POSTs within seconds.
    """
    times: list[float] = []
    answers = [httpx.Response(503, headers={"retry-after": "7"}), httpx.Response(200)]

    def script(request: httpx.Request) -> httpx.Response:
        times.append(trio.current_time())
        return answers.pop(0)

    result = await run_with(WebhookDelivery("http://hook.test/x",
                                            transport=httpx.MockTransport(script)))
    assert result.port_failures == [] and len(times) == 2
    assert times[1] - times[0] >= 7

    calls: list[float] = []

    def busy(request: httpx.Request) -> httpx.Response:
        calls.append(trio.current_time())
        return httpx.Response(429, headers={"retry-after": "3600"})

    result = await run_with(WebhookDelivery("http://hook.test/x", timeout=20,
                                            transport=httpx.MockTransport(busy)))
    assert len(calls) == 1
    assert "HTTP 429" in result.port_failures[0].error
    assert "3600" in result.port_failures[0].error


async def test_attempts_are_counted_per_delivery(autojump_clock: trio.abc.Clock) -> None:
    """A host that shares one WebhookDelivery across runs sees each run's own count."""
    def down(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502)

    delivery = WebhookDelivery("http://hook.test/x", attempts=2,
                               transport=httpx.MockTransport(down))
    first = await run_with(delivery)
    second = await run_with(delivery)
    assert "after 2 attempt(s)" in first.port_failures[0].error
    assert "after 2 attempt(s)" in second.port_failures[0].error


@pytest.mark.parametrize("url", [
    "http://", "https://", "http://user:pw@", "http://127.0.0.1:99999/x", "http://[::1/x",
    "http://exa mple.test/x", "https://127.0.0.1:9/a b", "http://127.0.0.1:9/a\nb",
    "http://h.test/\x00", "ftp://h.test/x", "h.test/x",
])
def test_bad_webhook_urls_are_refused_when_built(url: str) -> None:
    """A URL that can never be posted to is a one-line ValueError before any run.

    Only the scheme was checked, so `--webhook http://` or a port out of range
    ran the command and failed after it (5 attempts), or raised httpx's own
    error naming no webhook. The message never holds the password.
    """
    with pytest.raises(ValueError, match="webhook URL") as err:
        WebhookDelivery(url)
    assert "\n" not in str(err.value) and "pw@" not in str(err.value)


@pytest.mark.realtime
def test_cli_refuses_a_bad_webhook_before_running(kernel_exe: str, cli_env: dict[str, str],
                                                  tmp_path: Path) -> None:
    """`kernel run --webhook` with a URL that cannot work: one line, exit 2, nothing runs.

    It ran the command (exit 0) and only then failed to deliver, five times.
    """
    marker = tmp_path / "ran"
    for url in ("http://127.0.0.1:99999/x", "http://alice:pw1234567@/x"):
        proc = subprocess.run([kernel_exe, "run", "--webhook", url, "--", "touch", str(marker)],
                              capture_output=True, text=True, env=cli_env, timeout=120,
                              stdin=subprocess.DEVNULL)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith("kernel run: error: --webhook: webhook URL")
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
        assert "pw1234567" not in proc.stderr
        assert not marker.exists()


def test_good_webhook_urls_are_accepted() -> None:
    """Ordinary endpoints are still fine, credentials and queries included."""
    for url in ("http://127.0.0.1:8080/hook", "https://user:pw@hooks.example.com/x?a=1",
                "http://[::1]:9/x"):
        WebhookDelivery(url)


# ------------------------------------------------------------------ directory


@pytest.mark.realtime
def test_deliver_dir_under_an_ascii_locale(kernel_exe: str, cli_env: dict[str, str],
                                           tmp_path: Path) -> None:
    """Files are UTF-8 whatever the locale: a non-ASCII output is delivered, not lost.

    Under `LC_ALL=C PYTHONUTF8=0` output.txt was written in ASCII, so `café`
    failed the whole folder.
    """
    env = {**cli_env, "LC_ALL": "C", "PYTHONUTF8": "0"}
    env.pop("LANG", None)
    out = tmp_path / "out"
    proc = subprocess.run([kernel_exe, "run", "--json", "--deliver-dir", str(out), "--",
                           "printf", "caf\\303\\251"], capture_output=True, env=env,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["port_failures"] == []
    folder = out / doc["run_id"]
    assert (folder / "output.txt").read_bytes() == "café".encode()
    assert json.loads((folder / "result.json").read_text("utf-8"))["output"] == "café"


async def test_lone_surrogates_are_delivered(tmp_path: Path) -> None:
    """Text with lone surrogates (file names decoded with surrogateescape) still lands.

    It raised UnicodeEncodeError and nothing was written.
    """
    result = await run_with(DirectoryDelivery(tmp_path), output="name-\udcff",
                            artifacts={"a.txt": "x\ud800y"})
    assert result.port_failures == []
    folder = tmp_path / result.run_id
    assert (folder / "output.txt").read_bytes() == b"name-\xff"
    assert (folder / "artifacts" / "a.txt").read_bytes() == b"x?y"


async def test_an_output_that_is_not_plain_json_is_delivered(
        tmp_path: Path, serve: Callable[[Behaviour], Server]) -> None:
    """Non-string keys, NaN and a cycle become plain JSON, not a lost delivery.

    `json.dumps(default=str)` raised on tuple keys and cycles (nothing
    delivered anywhere) and wrote `NaN`, which strict JSON readers refuse.
    """
    cyclic: list[Any] = ["x"]
    cyclic.append(cyclic)
    output = {("a", 1): float("nan"), "inf": float("inf"), "cycle": cyclic, "ok": [1, "two"]}
    hook = serve(answer(200))
    fan = FanOutDelivery([DirectoryDelivery(tmp_path), WebhookDelivery(hook.url)])
    result = await run_with(fan, output=output)
    assert result.port_failures == []

    def strict(text: str) -> Any:
        def refuse(name: str) -> Any:
            raise ValueError(f"not JSON: {name}")
        return json.loads(text, parse_constant=refuse)

    doc = strict((tmp_path / result.run_id / "result.json").read_text("utf-8"))
    assert doc["output"]["ok"] == [1, "two"] and doc["output"]["inf"] is None
    assert "('a', 1)" in doc["output"]
    strict((tmp_path / result.run_id / "output.txt").read_text("utf-8"))
    assert hook.bodies[0]["output"]["ok"] == [1, "two"]


@pytest.mark.parametrize("name", ["a\x00b", "/etc/passwd", "", ".", "x/../../y"])
async def test_bad_artifact_names_are_a_delivery_error(tmp_path: Path, name: str) -> None:
    """A bad artifact name is a DeliveryError naming it; nothing is left behind."""
    result = await run_with(DirectoryDelivery(tmp_path / "out"), artifacts={name: "x"})
    assert result.status is Status.OK
    [failure] = result.port_failures
    assert failure.error.startswith("DeliveryError") and "artifact" in failure.error
    assert list((tmp_path / "out").iterdir()) == []


async def test_an_artifact_that_is_not_text_or_bytes(tmp_path: Path) -> None:
    """Artifact content other than str/bytes is a DeliveryError naming the artifact."""
    with pytest.raises(DeliveryError, match="notes"):
        DirectoryDelivery(tmp_path)._write(
            await run_with(None, artifacts={"notes": 42}))
    assert list(tmp_path.iterdir()) == []


async def test_delivering_again_replaces_the_folder(tmp_path: Path) -> None:
    """A resumed run delivering again replaces its folder whole, leaving nothing aside."""
    delivery = DirectoryDelivery(tmp_path)
    result = await run_with(delivery, output="first", artifacts={"old.txt": "o"})
    folder = tmp_path / result.run_id
    result.output, result.artifacts = "second", {"new.txt": "n"}
    await delivery.deliver(result)
    assert (folder / "output.txt").read_text("utf-8") == "second"
    assert sorted(p.name for p in (folder / "artifacts").iterdir()) == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == [result.run_id]
    assert os.stat(folder).st_mode & 0o077 == 0
