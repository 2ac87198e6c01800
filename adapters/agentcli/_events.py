"""Reading a CLI agent's JSON-lines stream into a handful of event types.

Three dialects are understood, line by line, and may even be mixed:

- **Claude Code** (`claude -p --output-format stream-json --verbose`, with or
  without `--include-partial-messages`): `system/init`, `assistant` messages
  holding thinking / text / tool_use blocks, `user` messages holding
  tool_result blocks, `stream_event` deltas, and the closing `result`.
- **Codex** (`codex exec --json`): `thread.started`, `turn.started`,
  `item.started|updated|completed` (reasoning, agent_message,
  command_execution, mcp_tool_call, file_change, web_search),
  `turn.completed`, `turn.failed`, `error`.
- **Plain**: the normalised types themselves (`{"type": "text_delta", "text": "..."}`,
  `{"type": "tool_use", "tool": "ls", "id": "1", "input": {...}}`, `done`, ...)
  for home-grown agents and wrappers.

Anything else — a new event type, a line that is not JSON — becomes an
`UNKNOWN` event: it proves the agent is alive, and changes nothing else.
"""

from __future__ import annotations

import enum
import json
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
        usage: Tokens and cost the CLI reported (done/error).
        session_id: The CLI's session or thread id (session_start, done).
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
    if sub == "init":
        return [AgentEvent(EventType.SESSION_START, source="system/init",
                           session_id=_str(obj.get("session_id")), text=_str(obj.get("model")))]
    return [AgentEvent(EventType.UNKNOWN, source=f"system/{sub}")]


def _claude_assistant(obj: Mapping[str, Any]) -> list[AgentEvent]:
    content = _dict(obj.get("message")).get("content")
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
        elif kind in ("tool_use", "server_tool_use"):
            out.append(AgentEvent(EventType.TOOL_USE, source=f"assistant/{kind}",
                                  tool=_str(b.get("name")), tool_id=_str(b.get("id")),
                                  input=_dict(b.get("input"))))
        else:
            out.append(AgentEvent(EventType.UNKNOWN, source=f"assistant/{kind}"))
    return out


def _claude_user(obj: Mapping[str, Any]) -> list[AgentEvent]:
    content = _dict(obj.get("message")).get("content")
    out: list[AgentEvent] = []
    for block in content if isinstance(content, list) else []:
        b = _dict(block)
        if b.get("type") == "tool_result":
            out.append(AgentEvent(EventType.TOOL_RESULT, source="user/tool_result",
                                  tool_id=_str(b.get("tool_use_id")),
                                  text=_text_of(b.get("content")),
                                  is_error=b.get("is_error") is True))
    return out


def _claude_result(obj: Mapping[str, Any]) -> list[AgentEvent]:
    sub = _str(obj.get("subtype")) or "success"
    u = _dict(obj.get("usage"))
    cost = obj.get("total_cost_usd")
    usage = Usage(
        input_tokens=_int(u.get("input_tokens")) + _int(u.get("cache_creation_input_tokens"))
        + _int(u.get("cache_read_input_tokens")),
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
                       session_id=_str(obj.get("session_id")))]


def _claude_stream(obj: Mapping[str, Any]) -> list[AgentEvent]:
    ev = _dict(obj.get("event"))
    kind = _str(ev.get("type"))
    if kind == "content_block_delta":
        delta = _dict(ev.get("delta"))
        dkind = delta.get("type")
        if dkind == "text_delta":
            return [AgentEvent(EventType.TEXT_DELTA, source="stream_event/text_delta",
                               text=_str(delta.get("text")))]
        if dkind == "thinking_delta":
            return [AgentEvent(EventType.THINKING, source="stream_event/thinking_delta",
                               text=_str(delta.get("thinking")))]
        return [AgentEvent(EventType.UNKNOWN, source=f"stream_event/{dkind}")]
    return [AgentEvent(EventType.UNKNOWN, source=f"stream_event/{kind}")]


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
    tool, args = _codex_tool(kind, item)
    if tool:
        if phase == "item.started":
            return [AgentEvent(EventType.TOOL_USE, source=source, tool=tool, tool_id=iid,
                               input=args)]
        if done:
            exit_code = item.get("exit_code")
            failed = item.get("status") == "failed" or (
                isinstance(exit_code, int) and exit_code != 0)
            output = item.get("aggregated_output", item.get("result", item.get("error")))
            return [AgentEvent(EventType.TOOL_RESULT, source=source, tool=tool, tool_id=iid,
                               text=_text_of(output), is_error=failed)]
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
    usage = Usage(input_tokens=_int(u.get("input_tokens")),
                  output_tokens=_int(u.get("output_tokens")))
    return [AgentEvent(EventType.DONE, source="turn.completed", usage=usage)]


def _codex_failed(obj: Mapping[str, Any]) -> list[AgentEvent]:
    err = obj.get("error")
    text = (_str(_dict(err).get("message")) or _str(err) or _str(obj.get("message"))
            or _str(obj.get("text")))
    return [AgentEvent(EventType.ERROR, source=_str(obj.get("type")),
                       text=text or "the agent reported an error", is_error=True)]


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
    text = obj.get("text", obj.get("output", obj.get("result", obj.get("message"))))
    return [AgentEvent(kind, source=kind.value, text=_text_of(text),
                       whole=obj.get("whole") is True or kind is EventType.DONE,
                       tool=_str(obj.get("tool", obj.get("name"))),
                       tool_id=_str(obj.get("id", obj.get("tool_id"))),
                       input=_dict(obj.get("input")) if kind is EventType.TOOL_USE else None,
                       is_error=obj.get("is_error") is True or kind is EventType.ERROR,
                       usage=usage, session_id=_str(obj.get("session_id")))]


_HANDLERS: dict[str, Callable[[Mapping[str, Any]], list[AgentEvent]]] = {
    "system": _claude_system,
    "assistant": _claude_assistant,
    "user": _claude_user,
    "result": _claude_result,
    "stream_event": _claude_stream,
    "thread.started": _codex_thread,
    "turn.started": _codex_turn_started,
    "item.started": _codex_item,
    "item.updated": _codex_item,
    "item.completed": _codex_item,
    "turn.completed": _codex_turn_completed,
    "turn.failed": _codex_failed,
    "error": _codex_failed,
    **{t.value: _plain for t in EventType if t not in (EventType.ERROR, EventType.UNKNOWN)},
}
