"""Fake model servers on 127.0.0.1 for the real coding-agent CLIs, scripted per scenario.

One `FakeModelServer` speaks one protocol, over real HTTP with real SSE:

- ``anthropic``: the Messages API (``POST /v1/messages``, streamed), for Claude Code
  (``ANTHROPIC_BASE_URL``).
- ``responses``: the OpenAI Responses API (``POST /v1/responses``, streamed), for Codex
  (a model provider whose ``base_url`` is this server).
- ``gemini``: the Gemini API (``POST /v1beta/models/M:streamGenerateContent?alt=sse``),
  for Gemini CLI (``GOOGLE_GEMINI_BASE_URL``).

A scenario is a list of `Reply` objects written in neutral terms (think, say, run a shell
command); each model request the client makes takes the next one (the last one repeats
when ``repeat_last``). The encoder of the protocol turns it into that API's stream, and
names the shell tool the way the client declared it in the request. Every request is
recorded (`requests`), so a test can check what the client sent, e.g. that a resumed
run carried the earlier conversation.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Think:
    """The model reasons (a thinking / reasoning block)."""

    text: str


@dataclass(frozen=True)
class Say:
    """The model answers in text."""

    text: str


@dataclass(frozen=True)
class Shell:
    """The model calls the client's shell tool with this command."""

    command: str


@dataclass(frozen=True)
class ListDir:
    """The model lists a directory with the client's read-only tool (`ls` where there is none)."""

    path: str = "."


@dataclass(frozen=True)
class ReadFile:
    """The model reads a file with the client's read-only tool (`cat` where there is none)."""

    path: str


Part = Think | Say | Shell | ListDir | ReadFile
Tool = Shell | ListDir | ReadFile


def tool_call(protocol: str, part: Tool, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The client's own tool name and arguments for a neutral tool part."""
    if protocol == "gemini":
        if isinstance(part, ListDir):
            return "list_directory", {"dir_path": part.path}
        if isinstance(part, ReadFile):
            return "read_file", {"file_path": part.path}
        return "run_shell_command", {"command": part.command}
    command = (part.command if isinstance(part, Shell)
               else f"ls {part.path}" if isinstance(part, ListDir) else f"cat {part.path}")
    if protocol == "anthropic":
        return "Bash", {"command": command, "description": "Run a command"}
    name, shape = _codex_shell(body)
    return name, shape(command)


@dataclass(frozen=True)
class Reply:
    """How the server answers one model request.

    Attributes:
        parts: What the model says, in order.
        status: Answer with this HTTP error status (and an API error body) instead.
        drop: Close the connection without any answer (the client sees a reset).
        hang_after: Stream this many SSE frames, then go silent (until the server stops).
        cut_after: Stream this many SSE frames, then reset the connection (a stream
            disconnected mid-answer).
        frame_delay: Seconds to wait before each frame (a slow model).
        usage: Input, output, cache-read and cache-write tokens reported.
    """

    parts: Sequence[Part] = ()
    status: int | None = None
    drop: bool = False
    hang_after: int | None = None
    cut_after: int | None = None
    frame_delay: float = 0.0
    usage: tuple[int, int, int, int] = (100, 20, 40, 10)


@dataclass
class Request:
    """One request the client made."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    at: float


Frames = list[tuple[str | None, dict[str, Any]]]


class FakeModelServer:
    """A real HTTP server on 127.0.0.1 answering one model API from a script.

    Args:
        protocol: "anthropic", "responses" or "gemini".
        replies: The scenario, one reply per model request.
        repeat_last: Answer every request past the script with its last reply.
    """

    def __init__(self, protocol: str, replies: Sequence[Reply], *,
                 repeat_last: bool = False) -> None:
        if protocol not in _ENCODERS:
            raise ValueError(f"unknown protocol {protocol!r}")
        self.protocol = protocol
        self.replies = list(replies)
        self.repeat_last = repeat_last
        self.requests: list[Request] = []
        self.model_requests = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stop = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                server._handle(self)

            def do_GET(self) -> None:
                server._handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        """The server's root URL, e.g. http://127.0.0.1:PORT."""
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> FakeModelServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving; hung streams are released and closed."""
        self._stop.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def wait_requests(self, n: int, timeout: float = 60.0) -> list[Request]:
        """Block until at least `n` model requests arrived; return all requests so far."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self.model_requests < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"only {self.model_requests} of {n} model requests "
                                       f"arrived in {timeout:g}s")
                self._changed.wait(left)
            return list(self.requests)

    def model_bodies(self) -> list[dict[str, Any]]:
        """The bodies of the model requests, in arrival order."""
        with self._lock:
            return [r.body for r in self.requests if _is_model_path(self.protocol, r.path)]

    # ------------------------------------------------------------ serving

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        req = Request(h.path, {k.lower(): v for k, v in h.headers.items()}, body,
                      time.monotonic())
        model = _is_model_path(self.protocol, h.path)
        with self._changed:
            self.requests.append(req)
            reply: Reply | None = None
            if model:
                i = self.model_requests
                self.model_requests += 1
                if i < len(self.replies):
                    reply = self.replies[i]
                elif self.repeat_last and self.replies:
                    reply = self.replies[-1]
            self._changed.notify_all()
        if not model:
            if self.protocol == "gemini" and ":generateContent" in h.path:
                # Gemini CLI's side questions (routing, checks) are not the scenario's turns.
                _send_json(h, 200, {"candidates": [{"content": {"role": "model", "parts": [
                    {"text": "{}"}]}, "finishReason": "STOP", "index": 0}]})
                return
            _send_json(h, 404, {"error": {"message": f"no such endpoint {h.path}"}})
            return
        if reply is None:
            reply = Reply([Say("The scenario has no more replies.")])
        if reply.drop:
            _drop(h)
            return
        if reply.status is not None:
            _send_json(h, reply.status, _ERROR_BODIES[self.protocol](reply.status))
            return
        frames = _ENCODERS[self.protocol](reply, body)
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Cache-Control", "no-cache")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True
        try:
            for n, (event, data) in enumerate(frames):
                if reply.hang_after is not None and n >= reply.hang_after:
                    self._stop.wait()
                    return
                if reply.cut_after is not None and n >= reply.cut_after:
                    _drop(h)
                    return
                if reply.frame_delay and self._stop.wait(reply.frame_delay):
                    return
                head = f"event: {event}\n" if event else ""
                h.wfile.write(f"{head}data: {json.dumps(data)}\n\n".encode())
                h.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            return


def _is_model_path(protocol: str, path: str) -> bool:
    p = path.split("?", 1)[0]
    if protocol == "anthropic":
        return p.endswith("/messages")
    if protocol == "responses":
        return p.endswith("/responses")
    return ":streamGenerateContent" in p


def _send_json(h: BaseHTTPRequestHandler, status: int, obj: object) -> None:
    data = json.dumps(obj).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


def _drop(h: BaseHTTPRequestHandler) -> None:
    """Reset the connection with nothing written."""
    sock = h.connection
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    h.close_connection = True
    sock.close()


_ERROR_BODIES: dict[str, Callable[[int], object]] = {
    "anthropic": lambda s: {"type": "error", "error": {
        "type": "overloaded_error" if s == 529 else "api_error", "message": f"fake {s}"}},
    "responses": lambda s: {"error": {"type": "server_error", "code": "server_error",
                                      "message": f"fake {s}"}},
    "gemini": lambda s: {"error": {"code": s, "status": "UNAVAILABLE" if s == 503
                                   else "INTERNAL", "message": f"fake {s}"}},
}


# ---------------------------------------------------------------- Anthropic


def _anthropic(reply: Reply, body: dict[str, Any]) -> Frames:
    inp, out, cache_read, cache_write = reply.usage
    msg_id = f"msg_fake{int(time.monotonic() * 1e6)}"
    frames: Frames = [("message_start", {"type": "message_start", "message": {
        "id": msg_id, "type": "message", "role": "assistant",
        "model": body.get("model", "claude-fake"), "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {
            "input_tokens": inp, "output_tokens": 1, "cache_read_input_tokens": cache_read,
            "cache_creation_input_tokens": cache_write}}})]
    stop = "end_turn"
    for i, part in enumerate(reply.parts):
        if isinstance(part, Think):
            frames += [
                ("content_block_start", {"type": "content_block_start", "index": i,
                                         "content_block": {"type": "thinking", "thinking": ""}}),
                ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                    "type": "thinking_delta", "thinking": part.text}}),
                ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                    "type": "signature_delta", "signature": "ZmFrZQ=="}}),
            ]
        elif isinstance(part, Say):
            frames.append(("content_block_start", {
                "type": "content_block_start", "index": i,
                "content_block": {"type": "text", "text": ""}}))
            frames += [("content_block_delta", {"type": "content_block_delta", "index": i,
                                                 "delta": {"type": "text_delta", "text": w}})
                       for w in _chunks(part.text)]
        else:
            stop = "tool_use"
            name, tool_args = tool_call("anthropic", part, body)
            args = json.dumps(tool_args)
            frames += [
                ("content_block_start", {"type": "content_block_start", "index": i,
                                         "content_block": {
                                             "type": "tool_use", "name": name, "input": {},
                                             "id": f"toolu_fake{i}{int(time.monotonic()*1e6)}"}}),
                ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                    "type": "input_json_delta", "partial_json": args}}),
            ]
        frames.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    frames += [
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": stop, "stop_sequence": None},
                           "usage": {"output_tokens": out}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return frames


# ---------------------------------------------------------------- Responses


def _responses(reply: Reply, body: dict[str, Any]) -> Frames:
    inp, out, cache_read, _ = reply.usage
    rid = f"resp_fake{int(time.monotonic() * 1e6)}"
    frames: Frames = [("response.created", {"type": "response.created", "response": {
        "id": rid, "object": "response", "status": "in_progress", "output": []}})]
    for i, part in enumerate(reply.parts):
        if isinstance(part, Think):
            item = {"type": "reasoning", "id": f"rs_{rid}_{i}", "summary": [
                {"type": "summary_text", "text": part.text}]}
            frames += [
                ("response.output_item.added", {"type": "response.output_item.added",
                                                "output_index": i, "item": {
                                                    **item, "summary": []}}),
                ("response.reasoning_summary_text.delta", {
                    "type": "response.reasoning_summary_text.delta", "item_id": f"rs_{rid}_{i}",
                    "output_index": i, "summary_index": 0, "delta": part.text}),
                ("response.output_item.done", {"type": "response.output_item.done",
                                               "output_index": i, "item": item}),
            ]
        elif isinstance(part, Say):
            item = {"type": "message", "id": f"msg_{rid}_{i}", "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": part.text, "annotations": []}]}
            frames.append(("response.output_item.added", {
                "type": "response.output_item.added", "output_index": i,
                "item": {**item, "status": "in_progress", "content": []}}))
            frames += [("response.output_text.delta", {
                "type": "response.output_text.delta", "item_id": f"msg_{rid}_{i}",
                "output_index": i, "content_index": 0, "delta": w})
                for w in _chunks(part.text)]
            frames.append(("response.output_item.done", {
                "type": "response.output_item.done", "output_index": i, "item": item}))
        else:
            call_id = f"call_fake{i}{int(time.monotonic() * 1e6)}"
            name, tool_args = tool_call("responses", part, body)
            item = {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id,
                    "name": name, "arguments": json.dumps(tool_args),
                    "status": "completed"}
            frames += [
                ("response.output_item.added", {"type": "response.output_item.added",
                                                "output_index": i, "item": item}),
                ("response.output_item.done", {"type": "response.output_item.done",
                                               "output_index": i, "item": item}),
            ]
    frames.append(("response.completed", {"type": "response.completed", "response": {
        "id": rid, "object": "response", "status": "completed", "output": [],
        "usage": {"input_tokens": inp, "input_tokens_details": {"cached_tokens": cache_read},
                  "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": inp + out}}}))
    return frames


def _codex_shell(body: dict[str, Any]) -> tuple[str, Callable[[str], dict[str, Any]]]:
    """The shell tool Codex declared in this request, and how its arguments look."""
    names = {t.get("name") for t in body.get("tools") or [] if isinstance(t, dict)}
    if "exec_command" in names:
        return "exec_command", lambda c: {"cmd": c}
    if "shell_command" in names:
        return "shell_command", lambda c: {"command": c}
    return "shell", lambda c: {"command": ["bash", "-lc", c]}


# ------------------------------------------------------------------- Gemini


def _gemini(reply: Reply, body: dict[str, Any]) -> Frames:
    inp, out, cache_read, _ = reply.usage
    frames: Frames = []
    parts = list(reply.parts)
    for i, part in enumerate(parts):
        if isinstance(part, Think):
            chunks = [{"text": part.text, "thought": True}]
        elif isinstance(part, Say):
            chunks = [{"text": w} for w in _chunks(part.text)]
        else:
            name, tool_args = tool_call("gemini", part, body)
            chunks = [{"functionCall": {"name": name, "args": tool_args}}]
        for j, chunk in enumerate(chunks):
            last = i == len(parts) - 1 and j == len(chunks) - 1
            cand: dict[str, Any] = {"content": {"role": "model", "parts": [chunk]}, "index": 0}
            frame: dict[str, Any] = {"candidates": [cand], "modelVersion": "gemini-fake"}
            if last:
                cand["finishReason"] = "STOP"
                frame["usageMetadata"] = {
                    "promptTokenCount": inp, "candidatesTokenCount": out,
                    "cachedContentTokenCount": cache_read, "totalTokenCount": inp + out}
            frames.append((None, frame))
    if not frames:
        frames.append((None, {"candidates": [{"content": {"role": "model", "parts": [
            {"text": ""}]}, "finishReason": "STOP", "index": 0}]}))
    return frames


_ENCODERS: dict[str, Callable[[Reply, dict[str, Any]], Frames]] = {
    "anthropic": _anthropic, "responses": _responses, "gemini": _gemini}


def _chunks(text: str) -> Iterator[str]:
    words = text.split(" ")
    for i, w in enumerate(words):
        yield w if i == len(words) - 1 else w + " "
