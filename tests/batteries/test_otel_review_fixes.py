"""Review fixes for the OpenTelemetry export (`batteries.otel`, `kernel export --otlp`).

Every test talks to a real collector on 127.0.0.1: `tests/otlp_receiver.py`,
or a socket server that misbehaves (never answers, closes the connection).

1. A live export sent secrets to the collector as the kernel saw them (a
   tool's error, the run's error, the critic's evidence, the run's name),
   where the audit store keeps them redacted.
2. A payload value the converter could not use (a status code that is not a
   number, a count past int64, an infinite duration) lost the run's whole
   trace, or printed the protobuf encoder's traceback.
3. Names and values of any size went to the collector as they were.
4. An endpoint the HTTP client cannot parse (`http://[::1`, port 99999)
   was a traceback, or accepted and failed at every export.
5. `kernel export` sent one request per span, and a collector that took the
   connection but never answered cost each of them the whole request
   timeout; a collector that closed the connection was "ConnectionError".
6. A password in the endpoint was printed in the warning line.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from otlp_receiver import Receiver, Span, otlp  # noqa: F401 - the fixture

from batteries.otel import OTelAudit, traces_url
from batteries.redact import Redactor
from batteries.tee import TeeAudit
from kernel import ConfigError, Kernel, Limits, Ports, RunInfo, RunStats, Status, Step, ToolCall

# ruff: noqa: F811 - the `otlp` fixture is imported, and tests name it

TOKEN = "sk-proj-" + "Q7xLm2Vb" * 6          # an OpenAI key's shape
LITERAL = "hunter2-correct-horse-battery"     # the value of a secret-named env var
PATIENCE = 120.0


def everything(spans: list[Span]) -> str:
    """All a collector got, as one text (names, attributes, events, status messages)."""
    return repr([(s.name, s.attributes, s.events, s.status_message) for s in spans])


def stats(status: Status = Status.OK, **kw: Any) -> RunStats:
    return RunStats(status=status, **kw)


class LeakyAgent:
    """A tool call whose error carries secrets, then a step that fails with them."""

    def __init__(self) -> None:
        self.n = 0

        async def deploy(**_: Any) -> str:
            raise RuntimeError(f"auth failed: api_key={TOKEN} password {LITERAL}")

        self.tools = {"deploy": deploy}

    async def step(self, ctx: Any) -> Step:
        self.n += 1
        if self.n == 1:
            return Step(tool_calls=[ToolCall("deploy", {"token": TOKEN}, id="c1")])
        raise RuntimeError(f"gave up: Authorization: Bearer {TOKEN} ({LITERAL})")


class TestSecretsNeverReachTheCollector:
    async def test_a_live_run_is_redacted_like_the_audit(
            self, otlp: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
        """Token shapes and secret env values are replaced in every span of a live run."""
        monkeypatch.setenv("DEPLOY_PASSWORD", LITERAL)
        async with OTelAudit.open(otlp.url) as otel:
            result = await Kernel(Ports(audit=TeeAudit(otel))).run(
                LeakyAgent(), RunInfo(name=f"deploy {LITERAL}"), Limits(max_steps=5, timeout=30))
        assert result.status is Status.ERROR
        spans = otlp.wait_for(2, PATIENCE)
        sent = everything(spans)
        assert TOKEN not in sent and LITERAL not in sent, sent
        [tool] = [s for s in spans if s.name == "execute_tool deploy"]
        assert "[REDACTED:" in tool.status_message
        assert tool.attributes["gen_ai.tool.call.id"] == "c1"
        [root] = [s for s in spans if s.name.startswith("invoke_agent")]
        assert "[REDACTED:" in root.status_message and root.attributes["error.type"] == "error"

    async def test_critic_evidence_and_model_errors_are_redacted(self, otlp: Receiver) -> None:
        """What a host records through the recorder is redacted with the audit's redactor."""
        redactor = Redactor.from_env(environ={}, patterns=["ticket-[0-9]+"])
        async with OTelAudit.open(otlp.url, redactor=redactor) as otel:
            rec = await otel.start_run(RunInfo(name="r"))
            assert rec is not None
            rec.log_event("model_call", name="m", duration_ms=3, payload={
                "model": "m", "error": f"401: invalid key {TOKEN}", "status": 401})
            rec.log_event("critic", name="kill", payload={
                "reason": "looping", "evidence": f"export OPENAI_API_KEY={TOKEN} ticket-4711"})
            await rec.close(stats(Status.KILLED, reason="looping"))
        spans = otlp.wait_for(2, PATIENCE)
        sent = everything(spans)
        assert TOKEN not in sent and "ticket-4711" not in sent, sent
        [root] = [s for s in spans if s.name.startswith("invoke_agent")]
        [(name, attrs)] = root.events
        assert name == "critic kill" and attrs["kernel.critic.reason"] == "looping"
        assert "[REDACTED:pattern]" in attrs["kernel.critic.payload"]


class TestOddValuesKeepTheTrace:
    @pytest.mark.parametrize("payload", [
        {"model": "m", "status": "teapot", "error": "boom"},
        {"model": "m", "input_tokens": 2**70, "output_tokens": "many"},
        {"model": "m", "input_tokens": float("nan"), "url": "http://[::1/v1"},
    ], ids=["status-text", "past-int64", "nan-and-bad-url"])
    async def test_the_run_and_its_neighbours_arrive(
            self, otlp: Receiver, payload: dict[str, Any],
            capfd: pytest.CaptureFixture[str]) -> None:
        """An odd value is left out; the run's spans and the next run's all arrive."""
        async with OTelAudit.open(otlp.url) as otel:
            odd = await otel.start_run(RunInfo(name="odd"))
            assert odd is not None
            odd.log_event("model_call", name="m", payload=payload, duration_ms=float("inf"))
            await odd.close(stats())
            fine = await otel.start_run(RunInfo(name="fine"))
            assert fine is not None
            fine.log_event("model_call", name="m", payload={"model": "m", "input_tokens": 3})
            await fine.close(stats())
        spans = otlp.wait_for(4, PATIENCE)
        names = sorted(s.name for s in spans)
        assert names == ["chat m", "chat m", "invoke_agent fine", "invoke_agent odd"]
        for span in spans:
            for key in ("gen_ai.usage.input_tokens", "http.response.status_code"):
                assert isinstance(span.attributes.get(key, 0), int)
        assert "Traceback" not in capfd.readouterr().err

    async def test_huge_names_and_values_are_cut(self, otlp: Receiver) -> None:
        """A megabyte name or error reaches the collector cut, not whole."""
        big = "x" * 1_000_000
        async with OTelAudit.open(otlp.url) as otel:
            rec = await otel.start_run(RunInfo(name=big, subject_id=big))
            assert rec is not None
            rec.log_event("tool_start", name=big, payload={"id": "c1", "args": big})
            rec.log_event("critic", name="nudge", payload={"reason": big})
            await rec.close(stats(Status.ERROR, error=big))
        spans = otlp.wait_for(2, PATIENCE)
        for span in spans:
            assert len(span.name) <= 300
            assert len(span.status_message) <= 4096
            for value in span.attributes.values():
                assert len(str(value)) <= 4096
            for _, attrs in span.events:
                for value in attrs.values():
                    assert len(str(value)) <= 4096


class TestResumed:
    async def test_a_resumed_session_says_so(self, otlp: Receiver) -> None:
        """`start_run(resumed=True)` (through the tee) marks the span `kernel.resumed`."""
        async with OTelAudit.open(otlp.url) as otel:
            rec = await TeeAudit(otel).start_run(RunInfo(name="again"), resumed=True)
            assert rec is not None
            await rec.close(stats())
        [root] = otlp.wait_for(1, PATIENCE)
        assert root.attributes["kernel.resumed"] is True


class TestEndpoints:
    @pytest.mark.parametrize("endpoint", [
        "http://[::1", "http://127.0.0.1:99999", "http://127.0.0.1:abc", "http://127.0.0.1:0",
        " http://127.0.0.1:4318", "http://127.0.0.1:4318\n", "localhost:4318"])
    def test_unusable_endpoints_are_bad_input(self, endpoint: str) -> None:
        with pytest.raises(ConfigError, match="OTLP endpoint must be"):
            traces_url(endpoint)

    def test_good_endpoints(self) -> None:
        assert traces_url("http://[::1]:4318") == "http://[::1]:4318/v1/traces"
        assert traces_url("https://otel.example/v1/traces") == "https://otel.example/v1/traces"

    @pytest.mark.realtime
    def test_cli_says_so_in_one_line(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """`--otlp 'http://[::1'`: exit 2, one line; in the env var: a warning, exit 0."""
        for args in (("run", "--otlp", "http://[::1", "--", "true"),
                     ("export", "--otlp", "http://[::1")):
            got = subprocess.run([kernel_exe, *args], env=cli_env, capture_output=True,
                                 text=True, timeout=PATIENCE)
            assert got.returncode == 2, got.stderr
            assert got.stderr.count("\n") == 1 and "OTLP endpoint must be" in got.stderr
        env = {**cli_env, "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:99999"}
        got = subprocess.run([kernel_exe, "run", "--", "true"], env=env, capture_output=True,
                             text=True, timeout=PATIENCE)
        assert got.returncode == 0, got.stderr
        warnings = [x for x in got.stderr.splitlines() if "warning" in x]
        assert len(warnings) == 1 and "otlp.open" in warnings[0], got.stderr
        assert "Traceback" not in got.stderr


class BadCollector:
    """A socket server on 127.0.0.1 that reads each request, then never answers or closes.

    `requests` counts the requests it read (not connections): what an
    exporter cost the collector.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.requests = 0
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            try:
                chunk = conn.recv(65536)
            except OSError:
                return
            if not chunk:
                return
            data += chunk
        with self.lock:
            self.requests += 1
        if self.mode == "close":
            conn.close()
        else:
            self.held.append(conn)  # taken, never answered

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def stored_runs(kernel_exe: str, cli_env: dict[str, str]) -> int:
    """Three finished runs in the test's database (real `kernel run` processes)."""
    for i in range(3):
        subprocess.run([kernel_exe, "run", "--no-critic", "--", "echo", str(i)], env=cli_env,
                       capture_output=True, timeout=PATIENCE, check=True)
    return 3


@pytest.fixture(params=["silent", "close"])
def bad_collector(request: pytest.FixtureRequest) -> Iterator[BadCollector]:
    server = BadCollector(request.param)
    yield server
    server.close()


@pytest.mark.realtime
class TestExportToABadCollector:
    def test_one_request_per_batch(self, otlp: Receiver, kernel_exe: str,
                                   cli_env: dict[str, str], stored_runs: int) -> None:
        """`kernel export` of three runs is one request, not one per span."""
        got = subprocess.run([kernel_exe, "export", "--otlp", otlp.url], env=cli_env,
                             capture_output=True, text=True, timeout=PATIENCE)
        assert got.returncode == 0, got.stderr
        assert got.stdout.startswith(f"exported {stored_runs} runs ({stored_runs} spans)")
        assert len(otlp.wait_for(stored_runs, PATIENCE)) == stored_runs
        assert otlp.requests == 1

    def test_given_up_after_one_request(self, bad_collector: BadCollector, kernel_exe: str,
                                        cli_env: dict[str, str], stored_runs: int) -> None:
        """A collector that never answers, or closes the connection: exit 1, one line naming
        it, and the export stops asking (a retry of a closed connection at most)."""
        got = subprocess.run([kernel_exe, "export", "--otlp", bad_collector.url], env=cli_env,
                             capture_output=True, text=True, timeout=PATIENCE)
        assert got.returncode == 1, got.stderr
        assert got.stderr.count("\n") == 1, got.stderr
        why = {"silent": "did not answer", "close": "closed"}[bad_collector.mode]
        assert why in got.stderr, got.stderr
        assert bad_collector.requests <= (1 if bad_collector.mode == "silent" else 2)

    def test_live_run_keeps_its_status(self, bad_collector: BadCollector, kernel_exe: str,
                                       cli_env: dict[str, str]) -> None:
        """`kernel run --otlp BAD -- sh -c 'exit 3'`: exit 3 and one warning line."""
        got = subprocess.run([kernel_exe, "run", "--no-critic", "--otlp", bad_collector.url,
                              "--", "sh", "-c", "exit 3"], env=cli_env, capture_output=True,
                             text=True, timeout=PATIENCE)
        assert got.returncode == 3, got.stderr
        warnings = [x for x in got.stderr.splitlines() if x.startswith("kernel: warning")]
        assert len(warnings) == 1 and "otlp.export" in warnings[0], got.stderr


@pytest.mark.realtime
def test_a_password_in_the_endpoint_is_not_printed(kernel_exe: str,
                                                     cli_env: dict[str, str]) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got = subprocess.run([kernel_exe, "run", "--otlp", f"http://me:{LITERAL}@127.0.0.1:{port}",
                          "--", "true"], env=cli_env, capture_output=True, text=True,
                         timeout=PATIENCE)
    assert got.returncode == 0, got.stderr
    assert "otlp.export" in got.stderr and LITERAL not in got.stderr, got.stderr


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_kernel_run_redacts_the_export_with_the_runs_own_redactor(
        otlp: Receiver, kernel_exe: str, cli_env: dict[str, str]) -> None:
    """`kernel run --otlp` redacts what it sends with the run's redactor (its `--redact`
    patterns, its secret-named `--context` values), as the audit store does: before,
    the export redacted only what the environment named, and a `--redact`ed word in
    the run's name reached the collector."""
    word = "zebra-" + "q7" * 8
    got = subprocess.run(
        [kernel_exe, "run", "--otlp", otlp.url, "--redact", "zebra-[a-z0-9]+",
         "--name", f"deploy {word}", "--", sys.executable, "-c", "print('done')"],
        env=cli_env, capture_output=True, text=True, timeout=PATIENCE)
    assert got.returncode == 0, got.stderr
    spans = otlp.wait_for(1, timeout=PATIENCE)
    assert spans and word not in everything(spans)
    assert "[REDACTED" in everything(spans)


def test_export_masks_the_password_and_refuses_a_run_still_running(
        otlp: Receiver, kernel_exe: str, cli_env: dict[str, str], tmp_path: Any) -> None:
    """`kernel export --otlp` prints the endpoint with its password masked (`--json` too),
    and a run named with `--run` that has not ended is refused in one line (exit 2)
    rather than sent as an error span of type `running` that its real end contradicts."""
    import json
    import time

    def kernel(*args: str, timeout: float = PATIENCE) -> subprocess.CompletedProcess[str]:
        return subprocess.run([kernel_exe, *args], env=cli_env, capture_output=True,
                              text=True, timeout=timeout)

    assert kernel("run", "--name", "done", "--", "true").returncode == 0
    url = otlp.url.replace("http://", "http://user:s3cret-pw@")
    got = kernel("export", "--otlp", url, "--json")
    assert got.returncode == 0, got.stderr
    assert "s3cret-pw" not in got.stdout + got.stderr
    assert json.loads(got.stdout)["endpoint"] == otlp.url.replace("http://", "http://user:***@")

    gate = tmp_path / "gate"
    slow = subprocess.Popen(
        [kernel_exe, "run", "--json", "--name", "slow", "--", sys.executable, "-c",
         "import pathlib, sys, time\n"
         "deadline = time.monotonic() + 300\n"
         f"while not pathlib.Path({str(gate)!r}).exists() and time.monotonic() < deadline:\n"
         "    time.sleep(0.02)\n"],
        env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + PATIENCE
        while True:  # the run's row is in the journal once `runs` lists it
            listed = kernel("runs", "--json")
            rows = [json.loads(line) for line in listed.stdout.splitlines() if line.strip()]
            running = [r for r in rows if r.get("name") == "slow"]
            if running:
                break
            assert time.monotonic() < deadline, listed.stderr
            time.sleep(0.05)
        run_id = running[0]["run_id"]
        got = kernel("export", "--otlp", otlp.url, "--run", run_id)
        assert got.returncode == 2, got.stderr
        assert got.stderr.count("\n") == 1 and "has not ended yet" in got.stderr
        from kernel_cli.ids import short_id

        assert f"run {short_id(run_id)} " in got.stderr  # the id `kernel runs` shows
    finally:
        gate.touch()
        out, _ = slow.communicate(timeout=PATIENCE)
    assert json.loads(out)["status"] == "ok"
    got = kernel("export", "--otlp", otlp.url, "--run", run_id)
    assert got.returncode == 0, got.stderr


class Nest:
    """Runs `depth` more generations of child runs below itself, then answers."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    async def step(self, ctx: Any) -> Step:
        if self.depth:
            await ctx.run_child(Nest(self.depth - 1), RunInfo(name=f"gen{self.depth - 1}"))
        return Step(final=True, output="ok")


def _family(spans: list[Span]) -> dict[str, Span]:
    return {s.name.removeprefix("invoke_agent "): s for s in spans
            if s.name.startswith("invoke_agent")}


class TestChildRunsInTheirRootsTrace:
    async def test_a_live_run_and_its_descendants_are_one_trace(self, otlp: Receiver) -> None:
        """A child run's span is a child of its parent run's span, in the root run's
        trace, with the ids `run_span_ids` derives (before: one trace per run, linked
        only by a `kernel.parent_run_id` attribute)."""
        from batteries.otel import run_span_ids

        root_info = RunInfo(name="gen2")
        async with OTelAudit.open(otlp.url) as otel:
            result = await Kernel(Ports(audit=otel)).run(Nest(2), root_info,
                                                        Limits(max_steps=5, timeout=60))
        assert result.status is Status.OK
        runs = _family(otlp.wait_for(3, PATIENCE))
        top, mid, low = runs["gen2"], runs["gen1"], runs["gen0"]
        assert top.trace_id == mid.trace_id == low.trace_id
        assert (top.parent_id, mid.parent_id, low.parent_id) == ("", top.span_id, mid.span_id)
        trace_id, span_id = run_span_ids(root_info.run_id)
        assert (int(top.trace_id, 16), int(top.span_id, 16)) == (trace_id, span_id)
        assert mid.attributes["kernel.parent_run_id"] == root_info.run_id

    async def test_kernel_export_links_them_the_same_way(
            self, otlp: Receiver, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """`kernel export --otlp` of stored runs gives the same trace and parents (and
        the same ids: a run exported live and again later is one span, not two)."""
        from batteries.audit import JournalAudit

        async with JournalAudit.open(cli_env["KERNEL_DB"]) as audit:
            result = await Kernel(Ports(audit=audit)).run(Nest(2), RunInfo(name="gen2"),
                                                         Limits(max_steps=5, timeout=60))
        assert result.status is Status.OK
        got = subprocess.run([kernel_exe, "export", "--otlp", otlp.url], env=cli_env,
                             capture_output=True, text=True, timeout=PATIENCE)
        assert got.returncode == 0, got.stderr
        runs = _family(otlp.wait_for(3, PATIENCE))
        top, mid, low = runs["gen2"], runs["gen1"], runs["gen0"]
        assert top.trace_id == mid.trace_id == low.trace_id
        assert (top.parent_id, mid.parent_id, low.parent_id) == ("", top.span_id, mid.span_id)

    async def test_a_resumed_session_is_a_span_under_the_runs_first(
            self, otlp: Receiver) -> None:
        """A resumed session's span has ids of its own, under its run's first span."""
        from batteries.otel import run_span_ids

        info = RunInfo(name="again")
        async with OTelAudit.open(otlp.url) as otel:
            rec = await otel.start_run(info, resumed=True)
            assert rec is not None
            await rec.close(stats())
        [span] = otlp.wait_for(1, PATIENCE)
        trace_id, first = run_span_ids(info.run_id)
        assert int(span.trace_id, 16) == trace_id and int(span.parent_id, 16) == first
        assert int(span.span_id, 16) != first


async def test_under_a_hosts_current_span_the_runs_keep_their_own_trace() -> None:
    """A host tracing its own work (a span current around its runs): the root run's span
    was made in the host's trace, where its children (whose parent ids name the run's
    own trace) did not follow. The run tree is one trace of its own either way."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from batteries.otel import OTLPTraces

    memory = InMemorySpanExporter()
    traces = OTLPTraces(exporter=memory, batch=False)
    audit = OTelAudit(traces)
    host = TracerProvider().get_tracer("host")
    with host.start_as_current_span("host request"):
        top = await audit.start_run(RunInfo(name="top", run_id="run-top"))
        low = await audit.start_run(RunInfo(name="low", run_id="run-low",
                                            parent_run_id="run-top"))
        assert top is not None and low is not None
        await low.close(stats())
        await top.close(stats())
    traces.shutdown()
    spans = {s.name: s for s in memory.get_finished_spans()}
    root, child = spans["invoke_agent top"], spans["invoke_agent low"]
    assert root.context is not None and child.context is not None
    assert child.context.trace_id == root.context.trace_id
    assert child.parent is not None and child.parent.span_id == root.context.span_id
    assert root.parent is None



def test_an_unparseable_endpoint_does_not_print_its_password(
        kernel_exe: str, cli_env: dict[str, str]) -> None:
    """`http://u:pw@[::1` (no closing bracket) cannot be parsed, and was printed whole,
    password included, in the one-line error; it is masked as a parseable one is."""
    for args in (["export", "--otlp"], ["run", "--otlp"]):
        tail = ["--", "true"] if args[0] == "run" else []
        got = subprocess.run([kernel_exe, *args, "http://u:s3cretpw@[::1", *tail],
                             env=cli_env, capture_output=True, text=True, timeout=PATIENCE)
        assert got.returncode == 2, got.stderr
        assert "s3cretpw" not in got.stderr and "u:***@" in got.stderr, got.stderr
