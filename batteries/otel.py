"""OpenTelemetry export of runs, with the GenAI semantic conventions (the `otel` extra).

A run becomes one trace: an `invoke_agent {name}` span, a `chat {model}`
child span per model call, an `execute_tool {tool}` child span per tool call,
and the critic's decisions as span events on the run's span. Attributes:
`gen_ai.operation.name`, `gen_ai.agent.name`, `gen_ai.request.model`,
`gen_ai.response.model`, `gen_ai.usage.input_tokens` / `output_tokens`,
`gen_ai.tool.name`, `gen_ai.tool.call.id`, `error.type`, and the kernel's own
under `kernel.*` (run id, status, reason).

One converter, `export_run(tracer, run, events)`, turns a run's row and events
(plain mappings, as the audit store keeps them) into spans with their
recorded timestamps. It serves both paths:

- live: `OTelAudit` is an `Audit` (compose it with the DuckDB one through
  `TeeAudit`); its recorder keeps the few event kinds spans are made of and
  hands them to the converter when the run closes;
- after the fact: `kernel export --otlp URL` reads stored runs and events and
  calls the same converter.

opentelemetry is imported only when an exporter is built (`pip install
'run-kernel[otel]'`); importing this module costs nothing.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import trio

from kernel import ConfigError, PortFailure, RunInfo, RunRecorder, RunStats, Step, ToolResult

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

#: The event kinds spans are built from; everything else stays in the audit store only.
SPAN_KINDS = frozenset({"model_call", "tool_start", "tool_end", "critic"})
#: Statuses that are not errors on the run's span.
_FINE = frozenset({"ok", "dry_run", "handoff"})
_MAX_ATTR = 4096


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL for `endpoint` (a base URL gets `/v1/traces`, as the SDK does)."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"OTLP endpoint must be http(s)://HOST[:PORT][/PATH], got {endpoint!r}")
    return endpoint if parts.path.rstrip("/").endswith("/v1/traces") else (
        endpoint.rstrip("/") + "/v1/traces")


def _require_sdk() -> None:
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "OpenTelemetry export needs the otel extra: pip install 'run-kernel[otel]'"
        ) from exc


#: Seconds one export request may take, retries included (the SDK's default is 10).
EXPORT_TIMEOUT = 5.0
#: Seconds to wait for the collector to accept a connection.
CONNECT_TIMEOUT = 2.0

_log = logging.getLogger("kernel.otel")
#: The logger the SDK's OTLP/HTTP span exporter (and its HTTP client) logs to.
_SDK_LOGGER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
_quiet = threading.local()


class CollectorUnreachable(Exception):
    """The collector could not be connected to; no more requests are made to it."""


class _SDKQuiet(logging.Filter):
    """Drops the SDK exporter's log records made inside an `OTLPTraces` export.

    The SDK logs each failed request (and each retry) as a warning or error of
    its own, several lines each, whatever level the host or the CLI set for
    the kernel: those are re-logged as one line under `kernel.otel` at DEBUG,
    and the export's outcome is reported once (`OTLPTraces.failure`). Records
    made by other exporters in the process pass untouched.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        owner = getattr(_quiet, "owner", None)
        if owner is None:
            return True
        text = " ".join(record.getMessage().split())
        owner.last_error = owner.last_error or text
        _log.debug("otlp exporter: %s", text)
        return False


_FILTER = _SDKQuiet()


def _reason(exc: BaseException) -> str:
    """`connection refused` from requests' nested message about a failed connection."""
    import re

    text = str(exc)
    found = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", text)
    if found:
        return found.group(1).strip().rstrip(".").lower()
    if "timed out" in text.lower():
        return "connection timed out"
    return type(exc).__name__


def _session(owner: OTLPTraces, connect_timeout: float) -> Any:
    """A requests session that gives up on a collector after its first failed connection.

    The SDK retries a refused connection with backoff until its timeout (and
    every batch again); here the first one marks the collector unreachable
    and every later request fails at once, with no retry (the SDK does not
    retry an error it does not know as a connection error).
    """
    import requests

    class GiveUp(requests.Session):
        def request(self, method: Any, url: Any, *args: Any,
                    **kwargs: Any) -> requests.Response:
            if owner.unreachable is not None:
                raise CollectorUnreachable(owner.unreachable)
            timeout = kwargs.get("timeout")
            if isinstance(timeout, (int, float)):
                kwargs["timeout"] = (min(connect_timeout, max(float(timeout), 0.001)),
                                     max(float(timeout), 0.001))
            try:
                return super().request(method, url, *args, **kwargs)
            except requests.ConnectionError as exc:
                if isinstance(exc, requests.exceptions.ReadTimeout):
                    raise  # it answered the connection: the SDK's retries decide
                owner.unreachable = f"collector unreachable ({_reason(exc)})"
                raise CollectorUnreachable(owner.unreachable) from exc

    return GiveUp()


class OTLPTraces:
    """A tracer provider exporting to an OTLP/HTTP endpoint, counting failed exports.

    An unreachable collector costs little: each request has `timeout` seconds
    (retries included; `CONNECT_TIMEOUT` to connect), and the first connection
    that fails (refused, no route, timed out) marks the collector unreachable:
    nothing more is sent to it, each later export fails at once. The SDK's own
    log lines about our exports go to `kernel.otel` at DEBUG; `failure` says
    what went wrong in one line.

    Args:
        endpoint: The collector's base URL (`http://127.0.0.1:4318`) or its full
            traces URL (`.../v1/traces`).
        exporter: A span exporter to use instead (tests, other protocols).
        batch: Export from a background thread in batches (live runs); False
            exports each span when it ends (`kernel export`).
        timeout: Seconds one export request may take, retries included.

    Attributes:
        failed_exports: Export requests that failed (or were not made: the
            collector was unreachable).
        exported_spans: Spans the collector took.
        unreachable: Why the collector is given up on, once it is.
        last_error: The first error the exporter reported, as one line.
    """

    def __init__(self, endpoint: str | None = None, *, exporter: SpanExporter | None = None,
                 batch: bool = True, timeout: float = EXPORT_TIMEOUT) -> None:
        _require_sdk()
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SimpleSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )

        self.endpoint = endpoint
        self.failed_exports = 0
        self.exported_spans = 0
        self.unreachable: str | None = None
        self.last_error: str | None = None
        if exporter is None:
            if endpoint is None:
                raise ConfigError("an OTLP endpoint or an exporter is needed")
            exporter = OTLPSpanExporter(endpoint=traces_url(endpoint), timeout=timeout,
                                        session=_session(self, min(CONNECT_TIMEOUT, timeout)))
        sdk_logger = logging.getLogger(_SDK_LOGGER)
        if _FILTER not in sdk_logger.filters:
            sdk_logger.addFilter(_FILTER)
        inner, owner = exporter, self

        class Counting(SpanExporter):
            """Delegates to the exporter and counts what it failed to export."""

            def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
                if owner.unreachable is not None:  # given up on: no request, no log line
                    owner.failed_exports += 1
                    return SpanExportResult.FAILURE
                _quiet.owner = owner
                try:
                    result = inner.export(spans)
                finally:
                    _quiet.owner = None
                if result is SpanExportResult.SUCCESS:
                    owner.exported_spans += len(spans)
                else:
                    owner.failed_exports += 1
                return result

            def shutdown(self) -> None:
                inner.shutdown()

            def force_flush(self, timeout_millis: int = 30000) -> bool:
                return inner.force_flush(timeout_millis)

        counting = Counting()
        self.provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": "run-kernel"}))
        self.provider.add_span_processor(
            BatchSpanProcessor(counting) if batch else SimpleSpanProcessor(counting))
        self.tracer: Tracer = self.provider.get_tracer("run-kernel")

    def shutdown(self) -> None:
        """Export what is still queued and stop (blocking: call it from a worker thread)."""
        self.provider.shutdown()

    def failure(self) -> str | None:
        """What went wrong, in one line (None if every export went through).

        `3 export request(s) to URL failed: collector unreachable (connection refused)`.
        """
        if not self.failed_exports:
            return None
        why = self.unreachable or self.last_error
        return (f"{self.failed_exports} export request(s) to {self.endpoint or 'the exporter'} "
                f"failed" + (f": {why}" if why else ""))


def _ns(value: Any) -> int:
    """Nanoseconds since the epoch from a datetime or seconds as a number."""
    if isinstance(value, datetime):
        return int(value.timestamp() * 1e9)
    return int(float(value) * 1e9)


def _payload(event: Mapping[str, Any]) -> dict[str, Any]:
    raw = event.get("payload")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return {}
    return dict(raw) if isinstance(raw, Mapping) else {}


def _error_type(error: Any) -> str:
    """A low-cardinality error type: the exception class name an error message starts with."""
    text = str(error)
    head = text.split(":", 1)[0].strip()
    return head if head.isidentifier() else "error"


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:_MAX_ATTR]


def export_run(tracer: Tracer, run: Mapping[str, Any],
               events: Sequence[Mapping[str, Any]]) -> None:
    """Emit one run as spans: `invoke_agent`, with `chat` and `execute_tool` children.

    Args:
        tracer: Where the spans go.
        run: The run's row: run_id, name, status, started_at, ended_at, and
            optionally subject_id, parent_run_id, error, reason, input_tokens,
            output_tokens (datetimes or epoch seconds).
        events: The run's events in order: mappings with ts, kind, name,
            duration_ms and payload (a mapping or its JSON text). Kinds other
            than `SPAN_KINDS` are ignored.
    """
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind, StatusCode

    start = _ns(run["started_at"])
    end = _ns(run.get("ended_at") or run["started_at"])
    name = str(run.get("name") or "run")
    status = str(run.get("status") or "")
    models = [str(_payload(e).get("model") or e.get("name") or "")
              for e in events if e.get("kind") == "model_call"]
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.agent.name": name,
        "kernel.run_id": str(run["run_id"]),
        "kernel.status": status,
    }
    for key, attr in (("subject_id", "kernel.subject_id"),
                      ("parent_run_id", "kernel.parent_run_id"), ("reason", "kernel.reason")):
        if run.get(key):
            attrs[attr] = str(run[key])
    if models and models[0]:
        attrs["gen_ai.request.model"] = models[0]
    for key in ("input_tokens", "output_tokens"):
        if run.get(key) is not None:
            attrs[f"gen_ai.usage.{key}"] = int(run[key])
    root = tracer.start_span(f"invoke_agent {name}", kind=SpanKind.INTERNAL, start_time=start,
                             attributes=attrs)
    if status and status not in _FINE:
        root.set_attribute("error.type", status)
        detail = run.get("reason") or run.get("error") or status
        root.set_status(StatusCode.ERROR, _text(detail))
    parent = trace.set_span_in_context(root)
    open_tools: dict[str, deque[Mapping[str, Any]]] = {}
    for event in events:
        kind = event.get("kind")
        if kind == "model_call":
            _chat_span(tracer, parent, event)
        elif kind == "tool_start":
            open_tools.setdefault(str(event.get("name")), deque()).append(event)
        elif kind == "tool_end":
            waiting = open_tools.get(str(event.get("name")))
            started = waiting.popleft() if waiting else None
            _tool_span(tracer, parent, started, event)
        elif kind == "critic" and event.get("name") != "watch":
            payload = _payload(event)
            event_attrs: dict[str, Any] = {"kernel.critic.decision": str(event.get("name"))}
            if payload.get("reason"):
                event_attrs["kernel.critic.reason"] = str(payload["reason"])
            if payload:
                event_attrs["kernel.critic.payload"] = _text(payload)
            root.add_event(f"critic {event.get('name')}", event_attrs,
                           timestamp=_ns(event["ts"]))
    for waiting in open_tools.values():  # started, never ended (the run was killed)
        for started in waiting:
            _tool_span(tracer, parent, started, None, end_ns=end)
    root.end(end_time=max(end, start))


def _chat_span(tracer: Tracer, parent: Any, event: Mapping[str, Any]) -> None:
    from opentelemetry.trace import SpanKind, StatusCode

    payload = _payload(event)
    end = _ns(event["ts"])
    start = end - int(float(event.get("duration_ms") or 0) * 1e6)
    model = str(payload.get("model") or event.get("name") or "")
    attrs: dict[str, Any] = {"gen_ai.operation.name": "chat", "gen_ai.request.model": model}
    if payload.get("served_by"):
        attrs["gen_ai.response.model"] = str(payload["served_by"])
    for key in ("input_tokens", "output_tokens"):
        if payload.get(key) is not None:
            attrs[f"gen_ai.usage.{key}"] = int(payload[key])
    if payload.get("finish_reason"):
        attrs["gen_ai.response.finish_reasons"] = [str(payload["finish_reason"])]
    url = payload.get("url")
    if isinstance(url, str) and urlsplit(url).hostname:
        parts = urlsplit(url)
        attrs["server.address"] = parts.hostname
        if parts.port:
            attrs["server.port"] = parts.port
    if payload.get("status") is not None:
        attrs["http.response.status_code"] = int(payload["status"])
    span = tracer.start_span(f"chat {model}", context=parent, kind=SpanKind.CLIENT,
                             start_time=start, attributes=attrs)
    if payload.get("error"):
        status = payload.get("status")
        span.set_attribute("error.type", str(status) if status else "model_error")
        span.set_status(StatusCode.ERROR, _text(payload["error"]))
    span.end(end_time=end)


def _tool_span(tracer: Tracer, parent: Any, started: Mapping[str, Any] | None,
               ended: Mapping[str, Any] | None, *, end_ns: int | None = None) -> None:
    from opentelemetry.trace import SpanKind, StatusCode

    first = started or ended
    assert first is not None
    name = str(first.get("name"))
    begin = _payload(started) if started is not None else {}
    result = _payload(ended) if ended is not None else {}
    if ended is not None:
        end = _ns(ended["ts"])
        start = _ns(started["ts"]) if started is not None else (
            end - int(float(ended.get("duration_ms") or 0) * 1e6))
    else:
        start = _ns(first["ts"])
        end = max(start, end_ns or start)
    attrs: dict[str, Any] = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name,
                             "gen_ai.tool.type": "function"}
    call_id = begin.get("id") or result.get("id")
    if call_id:
        attrs["gen_ai.tool.call.id"] = str(call_id)
    span = tracer.start_span(f"execute_tool {name}", context=parent, kind=SpanKind.INTERNAL,
                             start_time=start, attributes=attrs)
    if ended is None:
        span.set_attribute("error.type", "cancelled")
        span.set_status(StatusCode.ERROR, "the tool call did not finish")
    elif result.get("error"):
        span.set_attribute("error.type", _error_type(result["error"]))
        span.set_status(StatusCode.ERROR, _text(result["error"]))
    span.end(end_time=end)


class OTelRecorder:
    """Keeps the events spans are made of; emits the run's spans when it closes."""

    def __init__(self, traces: OTLPTraces, info: RunInfo) -> None:
        self.traces = traces
        self.info = info
        self.started_at = time.time()
        self.events: list[dict[str, Any]] = []

    def on_step(self, iteration: int, step: Step, duration_s: float) -> None:
        """Steps are not spans: nothing to keep."""

    def on_tool(self, result: ToolResult, iteration: int) -> None:
        """Keep the tool's end (its error and call id) for its `execute_tool` span."""
        self.events.append({"ts": time.time(), "kind": "tool_end", "name": result.call.name,
                            "duration_ms": result.duration_s * 1000,
                            "payload": {"error": result.error, "id": result.call.id}})

    def log_event(self, kind: str, *, name: str | None = None,
                  payload: Mapping[str, Any] | None = None, duration_ms: float | None = None,
                  iteration: int | None = None) -> None:
        """Keep model calls, tool starts and critic decisions; drop everything else."""
        if kind in SPAN_KINDS:
            self.events.append({"ts": time.time(), "kind": kind, "name": name,
                                "duration_ms": duration_ms, "payload": dict(payload or {})})

    def log_error(self, message: str, *, payload: Mapping[str, Any] | None = None) -> None:
        """Errors reach the span through the run's status and error at close."""

    async def close(self, stats: RunStats) -> None:
        """Emit the run's spans; the exporter sends them from its own thread."""
        run = {"run_id": self.info.run_id, "name": self.info.name,
               "subject_id": self.info.subject_id, "parent_run_id": self.info.parent_run_id,
               "status": str(stats.status), "error": stats.error, "reason": stats.reason,
               "started_at": self.started_at, "ended_at": time.time(),
               "input_tokens": stats.usage.input_tokens,
               "output_tokens": stats.usage.output_tokens}
        export_run(self.traces.tracer, run, self.events)
        self.events = []


class OTelAudit:
    """An `Audit` that sends each run to an OpenTelemetry collector as a trace.

    Observer: spans are made when a run closes and exported from the SDK's
    background thread; an unreachable collector never changes a run (failed
    exports are counted on `traces.failed_exports`). Compose it with the
    DuckDB audit with `TeeAudit(duckdb_audit, otel_audit)`.

    Use `OTelAudit.open(endpoint)` to flush and stop the exporter at the end.
    """

    def __init__(self, traces: OTLPTraces) -> None:
        self.traces = traces

    @classmethod
    @asynccontextmanager
    async def open(cls, endpoint: str, *,
                   warnings: list[PortFailure] | None = None) -> AsyncIterator[OTelAudit]:
        """An audit exporting to `endpoint`; queued spans are sent when the block exits.

        Exports that failed are reported once, when the block exits: as one
        `PortFailure("otlp", "export", ...)` appended to `warnings` (what the
        CLI prints as one warning line), else as one warning logged under
        `kernel.otel`. An unreachable collector costs at most a few seconds
        (`OTLPTraces`).
        """
        traces = OTLPTraces(endpoint)
        try:
            yield cls(traces)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(traces.shutdown)
            failure = traces.failure()
            if failure is not None:
                if warnings is not None:
                    warnings.append(PortFailure("otlp", "export", failure))
                else:
                    _log.warning("otlp export: %s", failure)

    async def start_run(self, info: RunInfo) -> RunRecorder | None:
        """A recorder for `info`'s run (no I/O)."""
        return OTelRecorder(self.traces, info)
