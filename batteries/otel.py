"""OpenTelemetry export of runs, with the GenAI semantic conventions (the `otel` extra).

A run becomes one trace: an `invoke_agent {name}` span, a `chat {model}`
child span per model call, an `execute_tool {tool}` child span per tool call,
and the critic's decisions as span events on the run's span. A child run (a
sub-loop, `ctx.run_child`) is a child span of its parent's run span, in its
root run's trace: the ids are derived from the run ids (`run_span_ids`), so a
child exported before its parent, or by another process, still lands under
it, and the same run exported twice has the same ids. A resumed session is
its own span under the run's first one. Attributes:
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

import hashlib
import json
import logging
import math
import re
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
    from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Tracer

    from batteries.redact import Redactor

#: The event kinds spans are built from; everything else stays in the audit store only.
SPAN_KINDS = frozenset({"model_call", "tool_start", "tool_end", "critic"})
#: Statuses that are not errors on the run's span.
_FINE = frozenset({"ok", "dry_run", "handoff"})
_MAX_ATTR = 4096
#: Span names and the short attributes (names, models, ids), in characters.
_MAX_NAME = 256
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL for `endpoint` (a base URL gets `/v1/traces`, as the SDK does).

    Everything the HTTP client would refuse only when the first span is sent
    (a malformed IPv6 host, a port that is not a number in 1..65535,
    whitespace or control characters) is refused here, as bad input: with
    `--otlp` that is exit 2 before anything runs, not a failed export later.

    Raises:
        ConfigError: `endpoint` is not an http(s) URL with a host.
    """
    bad = ConfigError(
        f"OTLP endpoint must be http(s)://HOST[:PORT][/PATH], got {shown_endpoint(endpoint)!r}")
    if any(ch.isspace() or not ch.isprintable() for ch in endpoint):
        raise bad
    try:
        parts = urlsplit(endpoint)
        port = parts.port  # raises ValueError for a port out of range or not a number
    except ValueError:
        raise bad from None
    if parts.scheme not in ("http", "https") or not parts.hostname or port == 0:
        raise bad
    return endpoint if parts.path.rstrip("/").endswith("/v1/traces") else (
        endpoint.rstrip("/") + "/v1/traces")


def shown_endpoint(endpoint: str) -> str:
    """`endpoint` as it may be printed (`kernel export --otlp`, warnings): a password in
    it (`user:secret@host`) masked."""
    try:
        parts = urlsplit(endpoint)
        password = parts.password
    except ValueError:  # unparseable (`http://u:pw@[::1`): mask what looks like one
        return re.sub(r"(://[^/@]*?:)[^/@]*@", r"\1***@", endpoint)
    if not password:
        return endpoint
    netloc = parts.netloc.replace(f":{password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


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
#: The loggers of the SDK's parts an export goes through (the protobuf encoder logs an
#: attribute it cannot encode with a traceback); quieted inside our exports like `_SDK_LOGGER`.
_SDK_LOGGERS = (_SDK_LOGGER, "opentelemetry.exporter.otlp.proto.common._internal",
                "opentelemetry.exporter.otlp.common.http")
#: Spans sent in one request by `kernel export` (the SDK's batch size).
EXPORT_BATCH = 512
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
    if _aborted(exc):
        return "connection closed without a response"
    return type(exc).__name__


def _aborted(exc: BaseException) -> bool:
    """The collector took the connection, then closed it without an answer.

    That is also what a pooled keep-alive connection the collector closed
    while idle looks like, so it is retried once before the collector is
    given up on.
    """
    text = str(exc)
    return "Connection aborted" in text or "RemoteDisconnected" in text


def _session(owner: OTLPTraces, connect_timeout: float) -> Any:
    """A requests session that gives up on a collector after its first failed connection.

    The SDK retries a refused connection with backoff until its timeout (and
    every batch again); here the first one marks the collector unreachable
    and every later request fails at once, with no retry (the SDK does not
    retry an error it does not know as a connection error).
    """
    import requests

    aborted = [0]  # connections closed without an answer, in a row

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
                response = super().request(method, url, *args, **kwargs)
            except requests.exceptions.ReadTimeout as exc:
                # Connected, but no answer within the request's whole budget: the SDK
                # would retry it, and every later batch would wait as long again (an
                # export of N runs, N times). One such request gives the collector up.
                owner.unreachable = "collector did not answer in time"
                raise CollectorUnreachable(owner.unreachable) from exc
            except requests.ConnectionError as exc:
                if _aborted(exc) and not aborted[0]:
                    aborted[0] += 1
                    raise  # maybe a stale pooled connection: the SDK retries it at once
                owner.unreachable = f"collector unreachable ({_reason(exc)})"
                raise CollectorUnreachable(owner.unreachable) from exc
            aborted[0] = 0
            return response

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
            exports from the calling thread, `EXPORT_BATCH` spans a request
            (`kernel export`: no queue to overflow, one request per batch, not
            one per span).
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
        from opentelemetry.sdk.trace import SpanLimits, TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
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
        for name in _SDK_LOGGERS:
            sdk_logger = logging.getLogger(name)
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
                except Exception as exc:  # an exporter's bug must not end the export thread
                    owner.last_error = owner.last_error or " ".join(
                        f"{type(exc).__name__}: {exc}".split())
                    result = SpanExportResult.FAILURE
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
        # Every attribute value cut to `_MAX_ATTR` characters: one huge value (a tool's
        # error, a critic's evidence) must not make a request the collector refuses,
        # which would lose the other spans of its batch with it.
        self.provider: TracerProvider = TracerProvider(
            resource=Resource.create({"service.name": "run-kernel"}),
            span_limits=SpanLimits(max_attribute_length=_MAX_ATTR), id_generator=_run_ids())
        self.provider.add_span_processor(
            BatchSpanProcessor(counting) if batch else _in_batches(counting, EXPORT_BATCH))
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
        where = shown_endpoint(self.endpoint) if self.endpoint else "the exporter"
        return (f"{self.failed_exports} export request(s) to {where} "
                f"failed" + (f": {why}" if why else ""))


def _in_batches(exporter: SpanExporter, size: int) -> SpanProcessor:
    """A span processor exporting `size` spans a request from the calling thread."""
    from opentelemetry.sdk.trace import SpanProcessor

    class InBatches(SpanProcessor):
        """Exports ended spans `size` at a time, from the thread that ends them.

        For `kernel export`: the SDK's simple processor makes one request per
        span (a slow collector then costs each span its timeout), and its
        batch processor drops spans once its queue is full (an export of
        thousands of runs outpaces any collector). Here nothing is dropped
        and a request carries a whole batch.
        """

        def __init__(self, exporter: SpanExporter, size: int) -> None:
            self.exporter = exporter
            self.size = size
            self.spans: list[ReadableSpan] = []

        def on_end(self, span: ReadableSpan) -> None:
            self.spans.append(span)
            if len(self.spans) >= self.size:
                self.force_flush()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            batch, self.spans = self.spans, []
            if batch:
                self.exporter.export(batch)
            return True

        def shutdown(self) -> None:
            self.force_flush()
            self.exporter.shutdown()

    return InBatches(exporter, size)


def _ns(value: Any) -> int | None:
    """Nanoseconds since the epoch from a datetime or seconds as a number (None: neither)."""
    try:
        if isinstance(value, datetime):
            return int(value.timestamp() * 1e9)
        ns = float(value) * 1e9
    except (TypeError, ValueError, OverflowError, OSError):
        return None
    return int(ns) if math.isfinite(ns) and 0 <= ns < 2**63 else None


def _int(value: Any) -> int | None:
    """`value` as an OTLP integer (int64), or None for what is not one.

    Payloads come from adapters and hosts: a count may be text, NaN, or past
    int64, which the protobuf encoder refuses with a traceback (and drops).
    """
    if isinstance(value, bool):
        return None
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if _INT64_MIN <= number <= _INT64_MAX else None


def _ms_ns(value: Any) -> int:
    """A duration in milliseconds as nanoseconds; 0 for what is not a finite duration >= 0."""
    try:
        ns = float(value or 0) * 1e6
    except (TypeError, ValueError, OverflowError):
        return 0
    return int(ns) if math.isfinite(ns) and 0 <= ns < 2**62 else 0


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
    return head[:_MAX_NAME] if head.isidentifier() else "error"


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:_MAX_ATTR]


def _name(value: Any) -> str:
    """A name for a span or an attribute: text, one line, at most `_MAX_NAME` characters."""
    return " ".join(str(value).split())[:_MAX_NAME]


def run_span_ids(run_id: str, root_run_id: str | None = None) -> tuple[int, int]:
    """The (trace id, span id) of a run's `invoke_agent` span.

    The trace is its root run's (`root_run_id`, None: the run is a root), the
    span id its own: both from a hash of the run ids, so a child run's span
    can name its parent's before that one is exported (a parent ends after
    its children), from another process or in a later `kernel export`.
    """
    def digest(kind: bytes, text: str, size: int) -> int:
        value = int.from_bytes(hashlib.sha256(kind + text.encode()).digest()[:size], "big")
        return value or 1  # an all-zero id is invalid

    return digest(b"kernel-trace:", root_run_id or run_id, 16), digest(b"kernel-span:", run_id, 8)


class _Forced(threading.local):
    """The ids the next span of this thread is to get (`export_run` sets them)."""

    trace_id: int | None = None
    span_id: int | None = None


def _run_ids() -> Any:
    """An SDK id generator that hands out `_FORCED` ids once, else random ones."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class RunIds(RandomIdGenerator):
        forced = _Forced()

        def generate_trace_id(self) -> int:
            forced, self.forced.trace_id = self.forced.trace_id, None
            return forced if forced is not None else super().generate_trace_id()

        def generate_span_id(self) -> int:
            forced, self.forced.span_id = self.forced.span_id, None
            return forced if forced is not None else super().generate_span_id()

    return RunIds()


def _start_run_span(tracer: Tracer, run: Mapping[str, Any], name: str, start: int,
                    attrs: dict[str, Any]) -> Any:
    """The run's `invoke_agent` span with the ids `run_span_ids` gives it, under its
    parent run's span (a resumed session: under the run's first span, ids of its own).

    With a tracer whose provider does not take forced ids (a host's own), the span
    gets the SDK's ids and no parent: the `kernel.*` attributes still link the runs.
    """
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.trace import (
        NonRecordingSpan,
        SpanContext,
        SpanKind,
        TraceFlags,
    )

    forced = getattr(getattr(tracer, "id_generator", None), "forced", None)
    run_id = str(run.get("run_id") or "")
    parent = str(run.get("parent_run_id") or "")
    if not isinstance(forced, _Forced) or not run_id:
        return tracer.start_span(f"invoke_agent {name}", kind=SpanKind.INTERNAL,
                                 start_time=start, attributes=attrs)
    root = str(run.get("root_run_id") or parent or run_id)
    trace_id, span_id = run_span_ids(run_id, root)
    context: Any = None
    if run.get("resumed"):
        under = span_id  # the run's first session; this one gets ids of its own
    elif parent:
        under = run_span_ids(parent, root)[1]
        forced.span_id = span_id
    else:
        under = None
        # An empty context, not the caller's: under a host's current span the SDK
        # would take that span's trace, and the run's children (whose parent ids
        # name this run's trace) would land in another.
        context = Context()
        forced.trace_id, forced.span_id = trace_id, span_id
    if under is not None:
        context = trace.set_span_in_context(NonRecordingSpan(SpanContext(
            trace_id, under, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))))
    try:
        return tracer.start_span(f"invoke_agent {name}", context=context,
                                 kind=SpanKind.INTERNAL, start_time=start, attributes=attrs)
    finally:
        forced.trace_id = forced.span_id = None


def export_run(tracer: Tracer, run: Mapping[str, Any],
               events: Sequence[Mapping[str, Any]]) -> None:
    """Emit one run as spans: `invoke_agent`, with `chat` and `execute_tool` children.

    Never loses the run's span to a value it cannot use: an event whose
    payload is malformed (a count that is not a number, a timestamp that is
    not one) keeps what can be read, or is left out (logged under
    `kernel.otel` at debug), and the run's span always ends.

    Args:
        tracer: Where the spans go.
        run: The run's row: run_id, name, status, started_at, ended_at, and
            optionally subject_id, parent_run_id, root_run_id (the top of its
            chain of parents; default its parent), error, reason, input_tokens,
            output_tokens, resumed (datetimes or epoch seconds).
        events: The run's events in order: mappings with ts, kind, name,
            duration_ms and payload (a mapping or its JSON text). Kinds other
            than `SPAN_KINDS` are ignored.
    """
    from opentelemetry import trace
    from opentelemetry.trace import StatusCode

    start = _ns(run.get("started_at"))
    if start is None:
        start = time.time_ns()
    end = max(_ns(run.get("ended_at")) or start, start)
    name = _name(run.get("name") or "run")
    status = _name(run.get("status") or "")
    models = [_name(_payload(e).get("model") or e.get("name") or "")
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
    if run.get("resumed"):
        attrs["kernel.resumed"] = True
    if models and models[0]:
        attrs["gen_ai.request.model"] = models[0]
    for key in ("input_tokens", "output_tokens"):
        count = _int(run.get(key))
        if count is not None:
            attrs[f"gen_ai.usage.{key}"] = count
    root = _start_run_span(tracer, run, name, start, attrs)
    try:
        if status and status not in _FINE:
            root.set_attribute("error.type", status)
            detail = run.get("reason") or run.get("error") or status
            root.set_status(StatusCode.ERROR, _text(detail))
        parent = trace.set_span_in_context(root)
        open_tools: dict[str, deque[Mapping[str, Any]]] = {}
        for event in events:
            try:
                _event(tracer, root, parent, open_tools, event, end)
            except Exception as exc:  # one odd event must not cost the run its trace
                _log.debug("otel: event %r left out: %s: %s", event.get("kind"),
                           type(exc).__name__, exc)
        for waiting in open_tools.values():  # started, never ended (the run was killed)
            for started in waiting:
                try:
                    _tool_span(tracer, parent, started, None, end_ns=end)
                except Exception as exc:
                    _log.debug("otel: tool start left out: %s: %s", type(exc).__name__, exc)
    finally:
        root.end(end_time=end)


def _event(tracer: Tracer, root: Any, parent: Any,
           open_tools: dict[str, deque[Mapping[str, Any]]], event: Mapping[str, Any],
           end: int) -> None:
    """One event of the run: a `chat` span, a tool's start or end, or a critic span event."""
    kind = event.get("kind")
    if kind == "model_call":
        _chat_span(tracer, parent, event, end)
    elif kind == "tool_start":
        open_tools.setdefault(str(event.get("name")), deque()).append(event)
    elif kind == "tool_end":
        waiting = open_tools.get(str(event.get("name")))
        started = waiting.popleft() if waiting else None
        _tool_span(tracer, parent, started, event, end_ns=end)
    elif kind == "critic" and event.get("name") != "watch":
        payload = _payload(event)
        event_attrs: dict[str, Any] = {"kernel.critic.decision": _name(event.get("name"))}
        if payload.get("reason"):
            event_attrs["kernel.critic.reason"] = _text(str(payload["reason"]))
        if payload:
            event_attrs["kernel.critic.payload"] = _text(payload)
        root.add_event(f"critic {_name(event.get('name'))}", event_attrs,
                       timestamp=_ns(event.get("ts")) or end)


def _chat_span(tracer: Tracer, parent: Any, event: Mapping[str, Any], run_end: int) -> None:
    from opentelemetry.trace import SpanKind, StatusCode

    payload = _payload(event)
    end = _ns(event.get("ts")) or run_end
    start = max(end - _ms_ns(event.get("duration_ms")), 0)
    model = _name(payload.get("model") or event.get("name") or "")
    attrs: dict[str, Any] = {"gen_ai.operation.name": "chat", "gen_ai.request.model": model}
    if payload.get("served_by"):
        attrs["gen_ai.response.model"] = _name(payload["served_by"])
    for key in ("input_tokens", "output_tokens"):
        count = _int(payload.get(key))
        if count is not None:
            attrs[f"gen_ai.usage.{key}"] = count
    if payload.get("finish_reason"):
        attrs["gen_ai.response.finish_reasons"] = [_name(payload["finish_reason"])]
    url = payload.get("url")
    try:
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is not None and parts.hostname:
            attrs["server.address"] = parts.hostname
            if parts.port:
                attrs["server.port"] = parts.port
    except ValueError:  # a malformed URL: no server attributes
        pass
    code = _int(payload.get("status"))
    if code is not None:
        attrs["http.response.status_code"] = code
    span = tracer.start_span(f"chat {model}", context=parent, kind=SpanKind.CLIENT,
                             start_time=start, attributes=attrs)
    if payload.get("error"):
        status = payload.get("status")
        span.set_attribute("error.type", _name(status) if status else "model_error")
        span.set_status(StatusCode.ERROR, _text(payload["error"]))
    span.end(end_time=end)


def _tool_span(tracer: Tracer, parent: Any, started: Mapping[str, Any] | None,
               ended: Mapping[str, Any] | None, *, end_ns: int) -> None:
    from opentelemetry.trace import SpanKind, StatusCode

    first = started or ended
    assert first is not None
    name = _name(first.get("name"))
    begin = _payload(started) if started is not None else {}
    result = _payload(ended) if ended is not None else {}
    if ended is not None:
        end = _ns(ended.get("ts")) or end_ns
        began = _ns(started.get("ts")) if started is not None else None
        start = began if began is not None else max(end - _ms_ns(ended.get("duration_ms")), 0)
    else:
        start = _ns(first.get("ts")) or end_ns
        end = max(start, end_ns)
    attrs: dict[str, Any] = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name,
                             "gen_ai.tool.type": "function"}
    call_id = begin.get("id") or result.get("id")
    if call_id:
        attrs["gen_ai.tool.call.id"] = _name(call_id)
    span = tracer.start_span(f"execute_tool {name}", context=parent, kind=SpanKind.INTERNAL,
                             start_time=start, attributes=attrs)
    if ended is None:
        span.set_attribute("error.type", "cancelled")
        span.set_status(StatusCode.ERROR, "the tool call did not finish")
    elif result.get("error"):
        span.set_attribute("error.type", _error_type(result["error"]))
        span.set_status(StatusCode.ERROR, _text(result["error"]))
    span.end(end_time=max(end, start))


class OTelRecorder:
    """Keeps the events spans are made of, secrets redacted; emits the run's spans when it closes.

    Redacted like the DuckDB audit (`batteries.redact`): the collector is
    another store, often a hosted one, and what reaches it (a tool's error, a
    model's error, the critic's evidence, the run's name, error and reason)
    is what the kernel saw, secrets included. Only what spans use is kept.
    """

    def __init__(self, traces: OTLPTraces, info: RunInfo, *,
                 redactor: Redactor | None = None, resumed: bool = False,
                 root_run_id: str | None = None,
                 roots: dict[str, str] | None = None) -> None:
        from batteries.redact import Redactor

        self.traces = traces
        self.redactor = Redactor.from_env() if redactor is None else redactor
        self.info = self.redactor.run_info(info)
        self.resumed = resumed
        self.root_run_id = root_run_id
        self._roots = roots  # the audit's open runs' roots: this run leaves it at close
        self.started_at = time.time()
        self.events: list[dict[str, Any]] = []

    def on_step(self, iteration: int, step: Step, duration_s: float) -> None:
        """Steps are not spans: nothing to keep."""

    def on_tool(self, result: ToolResult, iteration: int) -> None:
        """Keep the tool's end (its error and call id) for its `execute_tool` span."""
        error = result.error
        self.events.append({"ts": time.time(), "kind": "tool_end", "name": result.call.name,
                            "duration_ms": result.duration_s * 1000,
                            "payload": {"error": None if error is None else self._redact(error),
                                        "id": result.call.id}})

    def log_event(self, kind: str, *, name: str | None = None,
                  payload: Mapping[str, Any] | None = None, duration_ms: float | None = None,
                  iteration: int | None = None) -> None:
        """Keep model calls, tool starts and critic decisions (redacted); drop everything else.

        A tool start keeps only its call id: its arguments are no part of a span.
        """
        if kind not in SPAN_KINDS:
            return
        kept = dict(payload or {})
        if kind == "tool_start":
            kept = {"id": kept["id"]} if "id" in kept else {}
        self.events.append({"ts": time.time(), "kind": kind,
                            "name": None if name is None else self._redact(name),
                            "duration_ms": duration_ms, "payload": self.redactor.value(kept)})

    def log_error(self, message: str, *, payload: Mapping[str, Any] | None = None) -> None:
        """Errors reach the span through the run's status and error at close."""

    def _redact(self, text: Any) -> str:
        return self.redactor.text(str(text))

    async def close(self, stats: RunStats) -> None:
        """Emit the run's spans; the exporter sends them from its own thread."""
        info = self.info
        run = {"run_id": info.run_id, "name": info.name,
               "subject_id": info.subject_id, "parent_run_id": info.parent_run_id,
               "status": str(stats.status),
               "error": None if stats.error is None else self._redact(stats.error),
               "reason": None if stats.reason is None else self._redact(stats.reason),
               "started_at": self.started_at, "ended_at": time.time(),
               "input_tokens": stats.usage.input_tokens,
               "output_tokens": stats.usage.output_tokens, "resumed": self.resumed,
               "root_run_id": self.root_run_id}
        try:
            export_run(self.traces.tracer, run, self.events)
        finally:
            self.events = []
            if self._roots is not None:
                self._roots.pop(info.run_id, None)


class OTelAudit:
    """An `Audit` that sends each run to an OpenTelemetry collector as a trace.

    Observer: spans are made when a run closes and exported from the SDK's
    background thread; an unreachable collector never changes a run (failed
    exports are counted on `traces.failed_exports`). Compose it with the
    DuckDB audit with `TeeAudit(duckdb_audit, otel_audit)`.

    Use `OTelAudit.open(endpoint)` to flush and stop the exporter at the end.
    """

    def __init__(self, traces: OTLPTraces, *, redactor: Redactor | None = None) -> None:
        from batteries.redact import Redactor

        self.traces = traces
        self.redactor = Redactor.from_env() if redactor is None else redactor
        # Each open run's root run (the top of its chain of parents), so a grandchild's
        # span lands in its root's trace; a run leaves it when it closes.
        self._roots: dict[str, str] = {}

    @classmethod
    @asynccontextmanager
    async def open(cls, endpoint: str, *, warnings: list[PortFailure] | None = None,
                   redactor: Redactor | None = None) -> AsyncIterator[OTelAudit]:
        """An audit exporting to `endpoint`; queued spans are sent when the block exits.

        `redactor` (None: `Redactor.from_env()`) replaces secrets in what is
        sent; a host passes the one its other audit uses, so both hold the same.

        Exports that failed are reported once, when the block exits: as one
        `PortFailure("otlp", "export", ...)` appended to `warnings` (what the
        CLI prints as one warning line), else as one warning logged under
        `kernel.otel`. An unreachable collector costs at most a few seconds
        (`OTLPTraces`).
        """
        traces = OTLPTraces(endpoint)
        try:
            yield cls(traces, redactor=redactor)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(traces.shutdown)
            failure = traces.failure()
            if failure is not None:
                if warnings is not None:
                    warnings.append(PortFailure("otlp", "export", failure))
                else:
                    _log.warning("otlp export: %s", failure)

    async def start_run(self, info: RunInfo, *, resumed: bool = False) -> RunRecorder | None:
        """A recorder for `info`'s run (no I/O); a `resumed` run's span says so
        (`kernel.resumed`: its span covers only the session that resumed it).

        A child run's span goes under its parent's, in the trace of the root of its
        chain of parents (known for parents open in this audit; else the parent is
        taken for the root)."""
        parent = info.parent_run_id
        root = self._roots.get(parent, parent) if parent else None
        self._roots[info.run_id] = root or info.run_id
        return OTelRecorder(self.traces, info, redactor=self.redactor, resumed=resumed,
                            root_run_id=root, roots=self._roots)
