"""Reading a CLI agent's JSON-lines stream into a handful of event types.

Four dialects are understood, line by line, and may even be mixed:

- **Claude Code** (`claude -p --output-format stream-json --verbose`, with or
  without `--include-partial-messages` and `--input-format stream-json`):
  `system` (init, api_retry, permission_denied, thinking_tokens, status,
  compact_boundary, hooks), `assistant` messages holding thinking / text /
  tool_use blocks, `user` messages holding tool_result blocks (or a prompt
  echoed back), `stream_event` (the Messages API stream), `rate_limit_event`,
  `control_request` (can_use_tool: an approval asked for), and the closing
  `result` with usage (cache tokens included) and `total_cost_usd`.
- **Codex** (`codex exec --json`): `thread.started`, `turn.started`,
  `item.started|updated|completed` (reasoning, agent_message, todo_list,
  command_execution, mcp_tool_call, file_change, web_search, and `error`
  items: non-fatal warnings), `turn.completed` with usage, `turn.failed`,
  and `error` (`Reconnecting... N/M` is a retry, anything else fatal).
- **Gemini CLI** (`gemini -p ... --output-format stream-json`): `init`,
  `message` (the prompt echoed, then assistant deltas), `tool_use`,
  `tool_result`, `error` (a warning: the closing `result` decides) and
  `result` with its stats.
- **Plain**: the normalised types themselves (`{"type": "text_delta", "text": "..."}`,
  `{"type": "tool_use", "tool": "ls", "id": "1", "input": {...}}`, `done`, ...)
  for home-grown agents and wrappers.

Anything else — a new event type, a line that is not JSON — becomes an
`UNKNOWN` event: it proves the agent is alive, and changes nothing else.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kernel import Usage


class EventType(enum.StrEnum):
    """What an agent event means to the runtime state machine."""

    SESSION_START = "session_start"
    THINKING = "thinking"
    TEXT_DELTA = "text_delta"
    TOOL_USE = "tool_use"
    TOOL_RESULT = "tool_result"
    DONE = "done"
    ERROR = "error"
    APPROVAL = "approval"
    WARNING = "warning"
    RETRY = "retry"
    INFO = "info"
    UNKNOWN = "unknown"


@dataclass(slots=True, frozen=True)
class AgentEvent:
    """One normalised event from a CLI agent.

    Attributes:
        type: What it means (see `EventType`).
        source: The CLI's own tag, e.g. "system/init", "item.completed/reasoning".
        text: Thinking, response text, a tool's output, an error message or the result.
        whole: True when `text` is a whole message rather than a streamed fragment.
        tool: The tool's name (tool_use; tool_result when the CLI says).
        tool_id: Pairs a tool_result with its tool_use.
        input: The tool's arguments (tool_use).
        is_error: A failed tool result, or a done that reports failure.
        usage: Tokens and cost the CLI reported (done/error). Input tokens include
            cache reads and writes.
        session_id: The CLI's session or thread id (session_start, done).
        cache_read: Input tokens read from the prompt cache (part of `usage`).
        cache_write: Input tokens written to the prompt cache (part of `usage`).
        message_id: The model message `message_usage` belongs to ("" on a Claude
            `message_delta`: the message last started).
        message_usage: Tokens one model message has used so far, as the stream
            reports them while the turn goes on (Claude's `message_start`,
            `message_delta` and `assistant` messages): each report of a message
            supersedes its earlier ones, field by field. Input includes cache
            reads and writes (`cache_read`/`cache_write` give them for the
            message). The closing `usage` covers these messages and supersedes them.

    The types beyond the runtime's core: `approval` (the CLI asks a person to
    approve a tool; `is_error` when it was denied instead), `warning` (a
    non-fatal problem the CLI reported), `retry` (a transient error the CLI
    is retrying by itself: never the end of a turn) and `info` (known
    bookkeeping: rate-limit status, stream framing, the prompt echoed back).
    """

    type: EventType
    source: str = ""
    text: str = ""
    whole: bool = False
    tool: str = ""
    tool_id: str = ""
    input: Mapping[str, Any] | None = None
    is_error: bool = False
    usage: Usage | None = None
    session_id: str = ""
    cache_read: int = 0
    cache_write: int = 0
    message_id: str = ""
    message_usage: Usage | None = None


def parse_line(line: str) -> list[AgentEvent]:
    """The events one output line holds: none for a blank line, UNKNOWN for non-JSON."""
    text = line.strip()
    if not text:
        return []
    try:
        obj = json.loads(text)
    except ValueError:
        return [AgentEvent(EventType.UNKNOWN, source="text", text=text)]
    if not isinstance(obj, dict):
        return [AgentEvent(EventType.UNKNOWN, source=f"json-{type(obj).__name__}")]
    return parse_event(obj)


def parse_event(obj: Mapping[str, Any]) -> list[AgentEvent]:
    """The events one decoded JSON object holds (several for a Claude `assistant` message)."""
    kind = obj.get("type")
    if not isinstance(kind, str):
        return [AgentEvent(EventType.UNKNOWN, source="untyped")]
    handler = _HANDLERS.get(kind)
    if handler is None:
        return [AgentEvent(EventType.UNKNOWN, source=kind)]
    events = handler(obj)
    return events or [AgentEvent(EventType.UNKNOWN, source=kind)]


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _text_of(content: Any) -> str:
    """Tool output as text: a string, or the text blocks of a content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(_str(_dict(b).get("text")) for b in content if _dict(b).get("text"))
    return "" if content is None else json.dumps(content, default=str)


# ------------------------------------------------------------ Claude Code


def _claude_system(obj: Mapping[str, Any]) -> list[AgentEvent]:
    sub = _str(obj.get("subtype"))
    source = f"system/{sub}"
    if sub == "init":
        return [AgentEvent(EventType.SESSION_START, source=source,
                           session_id=_str(obj.get("session_id")), text=_str(obj.get("model")))]
    if sub == "api_retry":
        status = obj.get("error_status")
        return [AgentEvent(EventType.RETRY, source=source, text=(
            f"API request failed ({_str(obj.get('error')) or status}); retry "
            f"{_int(obj.get('attempt'))}/{_int(obj.get('max_retries'))} in "
            f"{_int(obj.get('retry_delay_ms'))} ms"))]
    if sub == "permission_denied":
        return [AgentEvent(EventType.APPROVAL, source=source, tool=_str(obj.get("tool_name")),
                           tool_id=_str(obj.get("tool_use_id")),
                           text=_str(obj.get("message")), is_error=True)]
    if sub == "thinking_tokens":
        return [AgentEvent(EventType.THINKING, source=source)]
    if sub in _CLAUDE_INFO:
        return [AgentEvent(EventType.INFO, source=source,
                           text=_str(obj.get("status") or obj.get("message")))]
    return [AgentEvent(EventType.UNKNOWN, source=source)]


_CLAUDE_INFO = frozenset({"status", "compact_boundary", "hook_started", "hook_response",
                          "hook_progress", "task_started", "task_notification",
                          "task_progress", "files_persisted", "local_command_output"})


def _message_usage(u: Mapping[str, Any]) -> tuple[Usage | None, int, int]:
    """A Messages API `usage` object: (usage with cache counted in the input, read, write)."""
    if not u:
        return None, 0, 0
    read, write = _int(u.get("cache_read_input_tokens")), _int(
        u.get("cache_creation_input_tokens"))
    return Usage(input_tokens=_int(u.get("input_tokens")) + read + write,
                 output_tokens=_int(u.get("output_tokens"))), read, write


def _claude_assistant(obj: Mapping[str, Any]) -> list[AgentEvent]:
    message = _dict(obj.get("message"))
    content = message.get("content")
    out: list[AgentEvent] = []
    for block in content if isinstance(content, list) else []:
        b = _dict(block)
        kind = b.get("type")
        if kind == "thinking":
            out.append(AgentEvent(EventType.THINKING, source="assistant/thinking",
                                  text=_str(b.get("thinking")), whole=True))
        elif kind == "redacted_thinking":
            out.append(AgentEvent(EventType.THINKING, source="assistant/redacted_thinking"))
        elif kind == "text":
            out.append(AgentEvent(EventType.TEXT_DELTA, source="assistant/text",
                                  text=_str(b.get("text")), whole=True))
        elif kind in ("tool_use", "server_tool_use", "mcp_tool_use"):
            out.append(AgentEvent(EventType.TOOL_USE, source=f"assistant/{kind}",
                                  tool=_str(b.get("name")), tool_id=_str(b.get("id")),
                                  input=_dict(b.get("input"))))
        else:
            out.append(AgentEvent(EventType.UNKNOWN, source=f"assistant/{kind}"))
    usage, read, write = _message_usage(_dict(message.get("usage")))
    mid = _str(message.get("id"))
    if out and usage is not None and mid:
        # The message's usage so far rides on its first event.
        first = out[0]
        out[0] = AgentEvent(first.type, source=first.source, text=first.text, whole=first.whole,
                            tool=first.tool, tool_id=first.tool_id, input=first.input,
                            message_id=mid, message_usage=usage, cache_read=read,
                            cache_write=write)
    return out


def _claude_user(obj: Mapping[str, Any]) -> list[AgentEvent]:
    content = _dict(obj.get("message")).get("content")
    if isinstance(content, str):
        return [AgentEvent(EventType.INFO, source="user/prompt", text=content)]
    out: list[AgentEvent] = []
    for block in content if isinstance(content, list) else []:
        b = _dict(block)
        if b.get("type") == "tool_result":
            out.append(AgentEvent(EventType.TOOL_RESULT, source="user/tool_result",
                                  tool_id=_str(b.get("tool_use_id")),
                                  text=_text_of(b.get("content")),
                                  is_error=b.get("is_error") is True))
        elif b.get("type") == "text":
            out.append(AgentEvent(EventType.INFO, source="user/prompt",
                                  text=_str(b.get("text"))))
    return out


def _claude_result(obj: Mapping[str, Any]) -> list[AgentEvent]:
    if "subtype" not in obj and ("stats" in obj or "status" in obj):
        return _gemini_result(obj)
    sub = _str(obj.get("subtype")) or "success"
    u = _dict(obj.get("usage"))
    cost = obj.get("total_cost_usd")
    read, write = _int(u.get("cache_read_input_tokens")), _int(
        u.get("cache_creation_input_tokens"))
    usage = Usage(
        input_tokens=_int(u.get("input_tokens")) + read + write,
        output_tokens=_int(u.get("output_tokens")),
        cost_usd=float(cost) if isinstance(cost, (int, float)) and cost > 0 else 0.0)
    failed = obj.get("is_error") is True or sub != "success"
    text = _str(obj.get("result"))
    if failed:
        errors = obj.get("errors")
        detail = "; ".join(map(str, errors)) if isinstance(errors, list) and errors else ""
        text = text or detail or sub
    return [AgentEvent(EventType.ERROR if failed else EventType.DONE, source=f"result/{sub}",
                       text=text, whole=True, usage=usage, is_error=failed,
                       session_id=_str(obj.get("session_id")), cache_read=read,
                       cache_write=write)]


_STREAM_INFO = frozenset({"message_start", "content_block_start", "content_block_stop",
                          "message_delta", "message_stop", "ping"})


def _claude_stream(obj: Mapping[str, Any]) -> list[AgentEvent]:
    ev = _dict(obj.get("event"))
    kind = _str(ev.get("type"))
    if kind == "content_block_delta":
        delta = _dict(ev.get("delta"))
        dkind = _str(delta.get("type"))
        if dkind == "text_delta":
            return [AgentEvent(EventType.TEXT_DELTA, source="stream_event/text_delta",
                               text=_str(delta.get("text")))]
        if dkind in ("thinking_delta", "signature_delta"):
            return [AgentEvent(EventType.THINKING, source=f"stream_event/{dkind}",
                               text=_str(delta.get("thinking")))]
        if dkind in ("input_json_delta", "citations_delta"):
            return [AgentEvent(EventType.INFO, source=f"stream_event/{dkind}")]
        return [AgentEvent(EventType.UNKNOWN, source=f"stream_event/{dkind}")]
    if kind == "message_start":
        message = _dict(ev.get("message"))
        usage, read, write = _message_usage(_dict(message.get("usage")))
        return [AgentEvent(EventType.INFO, source="stream_event/message_start",
                           message_id=_str(message.get("id")) or "?", message_usage=usage,
                           cache_read=read, cache_write=write)]
    if kind == "message_delta":
        usage, read, write = _message_usage(_dict(ev.get("usage")))
        return [AgentEvent(EventType.INFO, source="stream_event/message_delta",
                           message_usage=usage, cache_read=read, cache_write=write)]
    if kind in _STREAM_INFO:
        return [AgentEvent(EventType.INFO, source=f"stream_event/{kind}")]
    if kind == "error":
        err = _dict(ev.get("error"))
        return [AgentEvent(EventType.WARNING, source="stream_event/error",
                           text=_str(err.get("message")), is_error=True)]
    return [AgentEvent(EventType.UNKNOWN, source=f"stream_event/{kind}")]


def _claude_rate_limit(obj: Mapping[str, Any]) -> list[AgentEvent]:
    info = _dict(obj.get("rate_limit_info"))
    status = _str(info.get("status"))
    kind = EventType.INFO if status in ("", "allowed") else EventType.WARNING
    return [AgentEvent(kind, source="rate_limit_event", text=f"rate limit: {status or '?'}")]


def _claude_control_request(obj: Mapping[str, Any]) -> list[AgentEvent]:
    req = _dict(obj.get("request"))
    sub = _str(req.get("subtype"))
    if sub == "can_use_tool":
        return [AgentEvent(EventType.APPROVAL, source="control_request/can_use_tool",
                           tool=_str(req.get("tool_name")),
                           tool_id=_str(req.get("tool_use_id") or obj.get("request_id")),
                           input=_dict(req.get("input")),
                           text=_str(req.get("decision_reason") or req.get("description")))]
    return [AgentEvent(EventType.INFO, source=f"control_request/{sub}")]


def _claude_control_response(obj: Mapping[str, Any]) -> list[AgentEvent]:
    return [AgentEvent(EventType.INFO, source="control_response")]


# ------------------------------------------------------------------ Codex


def _codex_item(obj: Mapping[str, Any]) -> list[AgentEvent]:
    phase = _str(obj.get("type"))  # item.started | item.updated | item.completed
    item = _dict(obj.get("item"))
    kind = _str(item.get("type") or item.get("item_type"))
    source = f"{phase}/{kind}"
    iid = _str(item.get("id"))
    done = phase == "item.completed"
    if kind == "reasoning":
        return [AgentEvent(EventType.THINKING, source=source, text=_str(item.get("text")),
                           whole=done)]
    if kind == "agent_message":
        return [AgentEvent(EventType.TEXT_DELTA, source=source, text=_str(item.get("text")),
                           whole=done)]
    if kind == "todo_list":
        todos = item.get("items")
        plan = "\n".join(
            f"[{'x' if _dict(t).get('completed') else ' '}] {_str(_dict(t).get('text'))}"
            for t in todos) if isinstance(todos, list) else ""
        return [AgentEvent(EventType.THINKING, source=source, text=plan)]
    if kind == "error":
        # A non-fatal warning as an item (e.g. missing model metadata): the turn goes on.
        return [AgentEvent(EventType.WARNING, source=source, text=_str(item.get("message")))]
    tool, args = _codex_tool(kind, item)
    if tool:
        if phase == "item.started":
            return [AgentEvent(EventType.TOOL_USE, source=source, tool=tool, tool_id=iid,
                               input=args)]
        if done:
            exit_code = item.get("exit_code")
            failed = item.get("status") in ("failed", "declined") or (
                isinstance(exit_code, int) and exit_code != 0)
            output = item.get("aggregated_output", item.get("result", item.get("error")))
            return [AgentEvent(EventType.TOOL_RESULT, source=source, tool=tool, tool_id=iid,
                               text=_text_of(output), is_error=failed)]
        return [AgentEvent(EventType.INFO, source=source)]
    return [AgentEvent(EventType.UNKNOWN, source=source)]


def _codex_tool(kind: str, item: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    if kind == "command_execution":
        return "shell", {"command": item.get("command")}
    if kind == "mcp_tool_call":
        name = ".".join(p for p in (_str(item.get("server")), _str(item.get("tool"))) if p)
        return name or "mcp_tool_call", _dict(item.get("arguments"))
    if kind == "file_change":
        return "file_change", {"changes": item.get("changes")}
    if kind == "web_search":
        return "web_search", {"query": item.get("query")}
    return "", {}


def _codex_thread(obj: Mapping[str, Any]) -> list[AgentEvent]:
    return [AgentEvent(EventType.SESSION_START, source="thread.started",
                       session_id=_str(obj.get("thread_id")))]


def _codex_turn_started(obj: Mapping[str, Any]) -> list[AgentEvent]:
    return [AgentEvent(EventType.THINKING, source="turn.started")]


def _codex_turn_completed(obj: Mapping[str, Any]) -> list[AgentEvent]:
    u = _dict(obj.get("usage"))
    # input_tokens already counts the cached ones; reasoning is part of output_tokens.
    usage = Usage(input_tokens=_int(u.get("input_tokens")),
                  output_tokens=_int(u.get("output_tokens")))
    return [AgentEvent(EventType.DONE, source="turn.completed", usage=usage,
                       cache_read=_int(u.get("cached_input_tokens")),
                       cache_write=_int(u.get("cache_write_input_tokens")))]


def _codex_failed(obj: Mapping[str, Any]) -> list[AgentEvent]:
    err = obj.get("error")
    text = (_str(_dict(err).get("message")) or _str(err) or _str(obj.get("message"))
            or _str(obj.get("text")))
    return [AgentEvent(EventType.ERROR, source=_str(obj.get("type")),
                       text=text or "the agent reported an error", is_error=True)]


_RECONNECTING = re.compile(r"^\s*(Re-?connecting|Retrying)\b.*?\d+\s*/\s*\d+", re.IGNORECASE)


def _error(obj: Mapping[str, Any]) -> list[AgentEvent]:
    """`error`: Gemini's (it has a severity) is a warning; Codex's retry notices are retries."""
    message = _str(obj.get("message"))
    if "severity" in obj:
        return [AgentEvent(EventType.WARNING, source=f"error/{_str(obj.get('severity'))}",
                           text=message, is_error=obj.get("severity") == "error")]
    if _RECONNECTING.match(message):
        return [AgentEvent(EventType.RETRY, source="error/reconnecting", text=message)]
    return _codex_failed(obj)


# ----------------------------------------------------------------- Gemini


def _gemini_init(obj: Mapping[str, Any]) -> list[AgentEvent]:
    return [AgentEvent(EventType.SESSION_START, source="init",
                       session_id=_str(obj.get("session_id")), text=_str(obj.get("model")))]


def _gemini_message(obj: Mapping[str, Any]) -> list[AgentEvent]:
    role = _str(obj.get("role"))
    text = _text_of(obj.get("content"))
    if role == "assistant":
        return [AgentEvent(EventType.TEXT_DELTA, source="message/assistant", text=text,
                           whole=obj.get("delta") is not True)]
    return [AgentEvent(EventType.INFO, source=f"message/{role or 'user'}", text=text)]


def _gemini_result(obj: Mapping[str, Any]) -> list[AgentEvent]:
    stats = _dict(obj.get("stats"))
    usage = Usage(input_tokens=_int(stats.get("input_tokens")),
                  output_tokens=_int(stats.get("output_tokens")))
    failed = _str(obj.get("status")) not in ("", "success")
    err = _dict(obj.get("error"))
    text = _str(err.get("message")) or _str(err.get("type")) or (
        _str(obj.get("status")) if failed else "")
    return [AgentEvent(EventType.ERROR if failed else EventType.DONE,
                       source=f"result/{_str(obj.get('status')) or 'success'}", text=text,
                       whole=bool(text), usage=usage, is_error=failed,
                       cache_read=_int(stats.get("cached")))]


# ------------------------------------------------------------------ plain


def _plain(obj: Mapping[str, Any]) -> list[AgentEvent]:
    kind = EventType(_str(obj.get("type")))
    usage = None
    if kind in (EventType.DONE, EventType.ERROR):
        u = _dict(obj.get("usage"))
        cost = obj.get("cost_usd", u.get("cost_usd"))
        usage = Usage(input_tokens=_int(u.get("input_tokens")),
                      output_tokens=_int(u.get("output_tokens")),
                      thinking_tokens=_int(u.get("thinking_tokens")),
                      cost_usd=float(cost) if isinstance(cost, (int, float)) and cost > 0
                      else 0.0)
    err = obj.get("error")
    text = obj.get("text", obj.get("output", obj.get("result", obj.get("message"))))
    if text is None and err is not None:
        text = _dict(err).get("message", err)
    failed = (obj.get("is_error") is True or kind is EventType.ERROR
              or (kind is EventType.TOOL_RESULT and obj.get("status") == "error"))
    tool_input = obj.get("input", obj.get("parameters"))
    return [AgentEvent(kind, source=kind.value, text=_text_of(text),
                       whole=obj.get("whole") is True or kind is EventType.DONE,
                       tool=_str(obj.get("tool", obj.get("name", obj.get("tool_name")))),
                       tool_id=_str(obj.get("id", obj.get("tool_id"))),
                       input=_dict(tool_input) if kind is EventType.TOOL_USE else None,
                       is_error=failed, usage=usage, session_id=_str(obj.get("session_id")))]


_HANDLERS: dict[str, Callable[[Mapping[str, Any]], list[AgentEvent]]] = {
    **{t.value: _plain for t in EventType if t not in (EventType.ERROR, EventType.UNKNOWN)},
    "system": _claude_system,
    "assistant": _claude_assistant,
    "user": _claude_user,
    "result": _claude_result,
    "stream_event": _claude_stream,
    "rate_limit_event": _claude_rate_limit,
    "control_request": _claude_control_request,
    "control_response": _claude_control_response,
    "thread.started": _codex_thread,
    "turn.started": _codex_turn_started,
    "item.started": _codex_item,
    "item.updated": _codex_item,
    "item.completed": _codex_item,
    "turn.completed": _codex_turn_completed,
    "turn.failed": _codex_failed,
    "error": _error,
    "init": _gemini_init,
    "message": _gemini_message,
}
