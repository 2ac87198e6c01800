"""A real OTLP/HTTP traces receiver on 127.0.0.1, decoding the protobuf export requests."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


@dataclass
class Span:
    """One received span, flattened: ids as hex, attributes as plain values."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    status_code: int = 0
    status_message: str = ""


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class Receiver:
    """Accepts POST /v1/traces (application/x-protobuf, optionally gzip) like a collector."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: list[Span] = []
        self.requests = 0
        self.got = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    raw = gzip.decompress(raw)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(raw)
                spans = [Span(name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                              parent_id=s.parent_span_id.hex(), kind=s.kind,
                              start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                              attributes=_attrs(s.attributes),
                              events=[(e.name, _attrs(e.attributes)) for e in s.events],
                              status_code=s.status.code, status_message=s.status.message)
                         for rs in request.resource_spans for ss in rs.scope_spans
                         for s in ss.spans]
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                with receiver.got:
                    receiver.requests += 1
                    receiver.spans.extend(spans)
                    receiver.got.notify_all()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def named(self, prefix: str) -> list[Span]:
        """The spans whose name starts with `prefix`, in start order."""
        return sorted((s for s in self.spans if s.name.startswith(prefix)),
                      key=lambda s: s.start_ns)

    def wait_for(self, count: int, timeout: float = 60.0) -> list[Span]:
        """Wait until at least `count` spans arrived (a readiness wait, not a sleep)."""
        with self.got:
            self.got.wait_for(lambda: len(self.spans) >= count, timeout)
            return list(self.spans)


@pytest.fixture
def otlp() -> Iterator[Receiver]:
    """A running OTLP/HTTP receiver on an ephemeral 127.0.0.1 port."""
    receiver = Receiver()
    thread = threading.Thread(target=receiver.httpd.serve_forever,
                              kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield receiver
    receiver.httpd.shutdown()
    receiver.httpd.server_close()
    thread.join(5)
