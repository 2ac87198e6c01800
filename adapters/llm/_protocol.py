"""Reading a chat-completions answer: strict about its shape, lenient about the model.

A body that is not a chat completion (no `choices`, no `message`, a tool
call without a function name) raises `MalformedResponse`: the server or a
proxy in between is broken and the run must end `error` with a message
that says what was missing. A *model* mistake — tool-call arguments that are
not a JSON object — is not malformed: the call is kept with an `error`, and
the agent answers it with an error tool message so the model can retry.
A message with no content at all is not malformed either when the model
stopped at its length limit (`finish_reason: "length"`, a reasoning model
that spent `max_tokens` thinking): the agent ends the run saying so.

Tool-call ids are made unique within a turn: a server that repeats one
(or sends none) gets `id`, `id~2`, ... (or `call_{i}`), in the assistant
message kept in the conversation and in the tool messages answering it,
so each result reaches the call it belongs to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ._errors import MalformedResponse


@dataclass(slots=True, frozen=True)
class ModelToolCall:
    """A tool call as the model asked for it.

    Attributes:
        id: The call id the tool message must answer (synthesised if the server sent none).
        name: The tool's name.
        arguments: The raw arguments text, as the model wrote it.
        args: The arguments decoded as a JSON object, or None if they are not one.
        error: Why `args` is None.
    """

    id: str
    name: str
    arguments: str
    args: dict[str, Any] | None
    error: str | None = None


@dataclass(slots=True, frozen=True)
class Completion:
    """One decoded model turn.

    Attributes:
        message: The assistant message to append to the conversation (normalised).
        content: The text the model wrote (None when it only called tools).
        tool_calls: The tool calls, in order.
        finish_reason: Why the model stopped ("stop", "tool_calls", "length", ...).
        input_tokens, output_tokens, thinking_tokens: From `usage`; reasoning
            tokens are split out of `completion_tokens` so totals are not doubled.
        model: The model that answered, as the server names it.
        refusal: The model's refusal, when it declined to answer (`message.refusal`).
        cost_usd: What the server says the call cost (`usage.cost`, as OpenRouter and
            LiteLLM proxies report it); None when it says nothing.
        usage_known: False when the server did not report `usage.prompt_tokens` and
            `usage.completion_tokens` (the token counts above are then 0, or what
            little it said): the agent estimates them instead.
    """

    message: dict[str, Any]
    content: str | None
    tool_calls: list[ModelToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    thinking_tokens: int = 0
    model: str | None = None
    refusal: str | None = None
    cost_usd: float | None = None
    usage_known: bool = True


def parse_completion(data: dict[str, Any], source: str) -> Completion:
    """Decode a chat-completions answer `data` from `source` (a URL, for messages).

    Raises:
        MalformedResponse: `data` is not a chat completion; the message names
            what is missing or of the wrong type.
    """
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            raise MalformedResponse(f"{source} answered an error instead of a completion: "
                                    f"{err['message'][:300]}")
        keys = ", ".join(sorted(map(str, data))) or "none"
        raise MalformedResponse(
            f"malformed response from {source}: no choices[0] (top-level keys: {keys})")
    choice = choices[0]
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise MalformedResponse(f"malformed response from {source}: choices[0].message is "
                                f"{_kind(message)}, not an object")
    content = _content(message.get("content"), source)
    calls = _tool_calls(message.get("tool_calls"), source)
    finish = choice.get("finish_reason")
    refusal = message.get("refusal")
    refusal = refusal if isinstance(refusal, str) and refusal.strip() else None
    stored: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        stored["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
    elif content is None and refusal is None and finish != "length":
        raise MalformedResponse(f"malformed response from {source}: the message has neither "
                                f"content nor tool_calls (finish_reason={finish!r})")
    usage = data.get("usage")
    inp, out, think = _usage(usage)
    model = data.get("model")
    return Completion(stored, content, calls, finish if isinstance(finish, str) else None,
                      inp, out, think, model if isinstance(model, str) else None, refusal,
                      _cost(usage), _usage_known(usage))


def _kind(value: Any) -> str:
    return "missing" if value is None else type(value).__name__


def _content(value: Any, source: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        # Some servers send content parts: [{"type": "text", "text": "..."}].
        texts = [p.get("text") for p in value if isinstance(p, dict)]
        if all(isinstance(t, str) for t in texts) and len(texts) == len(value):
            return "".join(t for t in texts if isinstance(t, str))
    raise MalformedResponse(f"malformed response from {source}: choices[0].message.content "
                            f"is {_kind(value)}, not text")


def _tool_calls(value: Any, source: str) -> list[ModelToolCall]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise MalformedResponse(f"malformed response from {source}: "
                                f"choices[0].message.tool_calls is {_kind(value)}, not a list")
    calls: list[ModelToolCall] = []
    taken: set[str] = set()
    for i, raw in enumerate(value):
        where = f"choices[0].message.tool_calls[{i}]"
        fn = raw.get("function") if isinstance(raw, dict) else None
        if not isinstance(fn, dict):
            raise MalformedResponse(f"malformed response from {source}: {where}.function is "
                                    f"{_kind(fn)}, not an object")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise MalformedResponse(f"malformed response from {source}: {where}.function.name "
                                    f"is {_kind(name)}, not a tool name")
        call_id = raw.get("id")
        if not isinstance(call_id, str) or not call_id:
            call_id = f"call_{i}"
        call_id = _unique(call_id, taken)
        arguments = fn.get("arguments")
        args: dict[str, Any] | None = None
        error: str | None = None
        if isinstance(arguments, dict):  # Ollama and friends send an object
            args, arguments = arguments, json.dumps(arguments)
        elif arguments is None or (isinstance(arguments, str) and not arguments.strip()):
            args, arguments = {}, "{}"
        elif isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except ValueError as exc:
                error = f"arguments are not valid JSON ({exc})"
            else:
                if isinstance(decoded, dict):
                    args = decoded
                else:
                    error = f"arguments must be a JSON object, got {type(decoded).__name__}"
        else:
            raise MalformedResponse(f"malformed response from {source}: {where}.function."
                                    f"arguments is {_kind(arguments)}, not a JSON string")
        calls.append(ModelToolCall(call_id, name, arguments, args, error))
    return calls


def _unique(call_id: str, taken: set[str]) -> str:
    """`call_id`, or `call_id~N` for the first N >= 2 not taken yet; recorded as taken."""
    chosen, n = call_id, 1
    while chosen in taken:
        n += 1
        chosen = f"{call_id}~{n}"
    taken.add(chosen)
    return chosen


def _usage_known(usage: Any) -> bool:
    """True when `usage` has both token counts (whole numbers, 0 allowed)."""
    if not isinstance(usage, dict):
        return False
    return all(isinstance(usage.get(k), int) and not isinstance(usage.get(k), bool)
               for k in ("prompt_tokens", "completion_tokens"))


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _cost(usage: Any) -> float | None:
    """`usage.cost` when it is a real amount in US dollars (finite, >= 0), else None."""
    cost = usage.get("cost") if isinstance(usage, dict) else None
    if isinstance(cost, (int, float)) and not isinstance(cost, bool) and 0 <= cost < 1e9:
        return float(cost)
    return None


def _usage(value: Any) -> tuple[int, int, int]:
    if not isinstance(value, dict):
        return 0, 0, 0
    inp = _int(value.get("prompt_tokens"))
    out = _int(value.get("completion_tokens"))
    details = value.get("completion_tokens_details")
    think = _int(details.get("reasoning_tokens")) if isinstance(details, dict) else 0
    think = min(think, out)
    return inp, out - think, think
