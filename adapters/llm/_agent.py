"""`LLMAgent`: a chat-completions tool-calling loop, one model turn per kernel step.

How a turn maps onto the kernel::

    step(ctx)
      answer the previous turn's tool calls     ctx.tool_results -> role "tool" messages
      deliver critic nudges                     ctx.steer        -> role "user" messages
      POST /chat/completions                    retries, audit event "model_call"
      the model called tools  -> Step(tool_calls=[ToolCall(name, args, id)], usage=...)
      the model answered      -> Step(output=text, final=True, usage=..., message=text)
      the reply was empty     -> Step(message="") (not final: the critic nudges, the
                                 model is asked again; without a critic the 3rd in a
                                 row ends the run `error`)
      cut at the length limit -> with text: the answer, and a `warning` event; with
      (finish_reason=length)     none: the run ends `error` saying so (never re-sent)

Each step tells the critic what it needs: `ctx.activity("model_request")` before
the request (a request in flight is judged by the critic's `model_timeout`,
not its idle timeout) and the reply's text as `Step.message` (the same message
over and over is a loop). Tool results reach the critic from the kernel,
which runs the tools; a call the agent refused to run (arguments that are not
a JSON object) is shown to it as a call with an error result
(`ctx.tool_start`/`ctx.tool_end`).

The kernel runs the tool calls (with `Limits.tool_timeout`, audited as
tool_start/tool_end) between two steps; the conversation (`messages`) is the
whole state, so `snapshot()` returns it and a resumed run continues it.

Connections: a run reuses one connection pool. A host that enters `async with
agent` owns it; otherwise the first turn opens it and the turn that ends the
run (or raises) closes it. A run ended between turns by the kernel (killed
during a tool, `max_steps`) leaves its idle connections to the garbage
collector; a host that wants them closed at once uses `async with agent`.

Usage: a server that reports no token counts does not make a call free: the
tokens are over-estimated from the bytes sent and received
(`estimate_tokens`), its `model_call` event says `usage_known: false` and
`cost_known: false`, and one `warning` event says so, so token and cost caps
still bind.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kernel import AgentError, ConfigError, RunContext, Step, ToolCall, ToolResult, Usage

from ._client import ChatClient, Retry
from ._errors import LLMError
from ._protocol import Completion, ModelToolCall, parse_completion
from ._tools import Tool, as_tool, read_file_tool, shell_tool

_STATE_VERSION = 1
#: Empty replies in a row (no text, no tool call) after which the run ends `error` even
#: without a critic (a critic nudges at the first and kills `empty_answer` before this).
_EMPTY_LIMIT = 3
#: The run's error when the model stopped at its length limit before writing anything.
LENGTH_NO_TEXT = ("the answer was cut at the model's length limit (finish_reason=length) "
                  "before it wrote any text: give the model more room (max_tokens) or a "
                  "smaller task")
#: The warning (once per run) when the server reports no token usage.
USAGE_ESTIMATED = ("the server reported no token usage: tokens (and a cost by price) are "
                   "estimated from the size of each request and reply, an over-estimate, "
                   "so budgets still bind (cost_known: false)")
_INTERRUPTED = ("error: the run was interrupted while this tool call was running, before its "
                "result was saved: it may have run, in part or in whole; check its effects "
                "before calling it again")


@dataclass(slots=True, frozen=True)
class Price:
    """What a model costs, in US dollars per million tokens.

    Reasoning ("thinking") tokens are billed as output tokens.
    """

    input_per_mtok: float
    output_per_mtok: float

    def __post_init__(self) -> None:
        for name in ("input_per_mtok", "output_per_mtok"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not 0 <= value < 1e9):
                raise ConfigError(f"Price.{name} must be a finite amount >= 0 (USD per "
                                  f"million tokens), got {value!r}")

    def cost(self, input_tokens: int, output_tokens: int) -> float:
        """The cost in USD of one call with these token counts."""
        return (input_tokens * self.input_per_mtok
                + output_tokens * self.output_per_mtok) / 1_000_000


def completion_usage(comp: Completion, price: Price | None,
                     request: Mapping[str, Any] | None = None) -> Usage:
    """What one model call consumed: its tokens, and its cost by `price`, else by what
    the server reported (`usage.cost`), else 0.

    A server that reported no token counts (`comp.usage_known` False) does not make
    the call free: the tokens are estimated from `request` and the reply
    (`estimate_tokens`), so token and cost caps still bind.
    """
    inp, out, think = comp.input_tokens, comp.output_tokens, comp.thinking_tokens
    if not comp.usage_known:
        est_in, est_out = estimate_tokens(request or {}, comp)
        inp, out = max(inp, est_in), max(out + think, est_out) - think
    cost = price.cost(inp, out + think) if price is not None else comp.cost_usd or 0.0
    return Usage(inp, out, think, cost)


async def audited_call(client: ChatClient, request: Mapping[str, Any], ctx: RunContext | None,
                       *, model: str, usage_of: Callable[[Completion], Usage],
                       cost_known: Callable[[Completion], bool],
                       extra: Mapping[str, Any] | None = None,
                       outcome: Callable[[Completion], Mapping[str, Any]] | None = None,
                       ) -> tuple[Completion, Usage]:
    """One model call as the run sees it: in flight (`model_request`), each retry a
    `model_retry` event, its outcome a `model_call` event (with `extra` in every
    event and `outcome(completion)` in a successful call's), and no
    retry wait past the run's deadline; the error of a failed call scrubbed of the
    key. Without `ctx` (a judge called outside a run) the same call, unaudited.

    Raises:
        LLMError: The call failed (after its retries), or its answer is malformed.
    """
    more = dict(extra or {})

    def on_retry(r: Retry) -> None:
        if ctx is not None:
            ctx.event("model_retry", name=model, payload={
                "attempt": r.attempt, "reason": r.reason, "status": r.status_code,
                "wait_ms": round(r.wait_s * 1000, 1), **more})

    if ctx is not None:
        ctx.activity("model_request")  # in flight: judged by the critic's model_timeout
    try:
        data, call = await client.complete(
            request, deadline=ctx.deadline if ctx is not None else math.inf,
            on_retry=on_retry)
        comp = parse_completion(data, client.display_url)
    except LLMError as exc:
        exc.args = (client.scrub(str(exc)),)  # a server may echo the key
        if ctx is not None:
            ctx.event("model_call", name=model, payload={
                "model": model, "url": client.display_url, "error": str(exc),
                "status": getattr(exc, "status_code", None),
                "attempts": getattr(exc, "attempts", None), **more})
        raise
    usage = usage_of(comp)
    if ctx is not None:
        ctx.event("model_call", name=model, duration_ms=call.latency_s * 1000, payload={
            "model": model, "served_by": comp.model, "url": client.display_url,
            "status": call.status_code, "attempts": call.attempts, "retries": call.attempts - 1,
            "latency_ms": round(call.latency_s * 1000, 1),
            "waited_ms": round(call.waited_s * 1000, 1),
            "input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens,
            "thinking_tokens": usage.thinking_tokens, "cost_usd": usage.cost_usd,
            "cost_known": cost_known(comp), "usage_known": comp.usage_known,
            "finish_reason": comp.finish_reason, **more,
            **(outcome(comp) if outcome is not None else {})})
    return comp, usage


def estimate_tokens(request: Mapping[str, Any], comp: Completion) -> tuple[int, int]:
    """(input, output) tokens of a call whose server reported none: an over-estimate.

    Each is the UTF-8 size in bytes of what was sent (the request's messages and
    tools, as JSON) and of what came back (the assistant message, as JSON). A
    token of a byte-level tokenizer covers at least one byte, so these bound the
    visible text from above (typically 3-4 times over). Reasoning tokens the
    server kept hidden cannot be seen and are not in the estimate.
    """
    sent = {k: request[k] for k in ("messages", "tools") if k in request}
    got = json.dumps(comp.message, ensure_ascii=False, default=str).encode()
    return len(json.dumps(sent, ensure_ascii=False, default=str).encode()), len(got)


class LLMAgent:
    """A tool-calling agent over an OpenAI-compatible chat-completions API.

    Args:
        model: The model name sent with each request.
        prompt: The task, sent as the first user message (unless resuming).
        client: The HTTP client (base URL, key, timeouts, retries); default
            `ChatClient()`: api.openai.com with `$OPENAI_API_KEY`.
        system: An optional system message.
        messages: Extra opening messages (role/content dicts) after the system
            message and before the prompt, e.g. few-shot examples.
        tools: Host tools: `Tool`s, or plain/async functions described from
            their signature and docstring.
        read_file: Offer the `read_file` tool (confined to `cwd`). On by default.
        allow_shell: Offer the `shell` tool (runs `/bin/sh -c` in `cwd`). Off by
            default: only turn it on for a model you would give your shell to.
        cwd: The working directory the built-in tools are confined to
            (default: the current directory when the agent is built).
        prices: model name -> `Price`, for `Usage.cost_usd`. A model not in the
            table costs what the server reports (`usage.cost`, as OpenRouter and
            LiteLLM proxies send it), else 0: a cost cap cannot bound what it
            cannot price (each `model_call` event says `cost_known`).
        temperature, max_tokens: Sent when given.
        extra_body: More request fields (e.g. `{"seed": 1}`), merged last.
        max_tool_output: Tool results longer than this many characters are cut
            before the model sees them.
    """

    def __init__(
        self,
        model: str,
        prompt: str | None = None,
        *,
        client: ChatClient | None = None,
        system: str | None = None,
        messages: Sequence[Mapping[str, Any]] = (),
        tools: Iterable[Tool | Callable[..., Any]] = (),
        read_file: bool = True,
        allow_shell: bool = False,
        cwd: str | os.PathLike[str] | None = None,
        prices: Mapping[str, Price] | None = None,
        temperature: float | None = None,
        max_tokens: int | None = None,
        extra_body: Mapping[str, Any] | None = None,
        max_tool_output: int = 32_000,
    ) -> None:
        if not model:
            raise ValueError("LLMAgent needs a model name")
        self.model = model
        self.prompt = prompt
        self.client = client if client is not None else ChatClient()
        self.system = system
        self.opening = [dict(m) for m in messages]
        self.cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
        self.prices = dict(prices or {})
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.extra_body = dict(extra_body or {})
        self.max_tool_output = max_tool_output
        specs: list[Tool] = []
        if read_file:
            specs.append(read_file_tool(self.cwd))
        if allow_shell:
            specs.append(shell_tool(self.cwd, hide_env=[self.client.api_key_env],
                                    on_process=self._on_process, on_group=self._on_group))
        specs.extend(as_tool(t) for t in tools)
        self.specs: dict[str, Tool] = {}
        for spec in specs:
            if spec.name in self.specs:
                raise ValueError(f"two tools are named {spec.name!r}")
            self.specs[spec.name] = spec
        #: What the kernel runs: tool name -> async callable (outputs redacted).
        self.tools: dict[str, Callable[..., Awaitable[Any]]] = {
            name: self._redacting(spec.fn) for name, spec in self.specs.items()}
        #: The conversation so far, as chat-completions messages.
        self.messages: list[dict[str, Any]] = []
        self._rejected: dict[str, str] = {}  # call id -> error, for calls we refused to run
        self._started = False
        self._empty = 0  # replies in a row with no text and no tool call
        self._ctx: RunContext | None = None
        self._own_pool = False  # the client's pool was opened by `step`, not by a host
        self._usage_warned = False

    def __repr__(self) -> str:
        return f"LLMAgent(model={self.model!r}, client={self.client!r})"

    async def __aenter__(self) -> LLMAgent:
        await self.client.__aenter__()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.client.__aexit__(*exc_info)

    def _on_group(self, record: dict[str, Any]) -> None:
        """The shell tool's command started: audit its group (`process_start`), which
        `kernel recover` stops if this process dies while the command runs."""
        ctx = self._ctx
        if ctx is not None:
            ctx.event("process_start", name="sh", payload={"tool": "shell", **record})

    def _on_process(self, pid: int, started: bool) -> None:
        """The shell tool started (ended) a process: tell the run's critic."""
        ctx = self._ctx
        if ctx is None:
            return
        if started:
            ctx.process_started(pid)
        else:
            ctx.process_exited(pid)

    # ------------------------------------------------------------------ step

    async def step(self, ctx: RunContext) -> Step:
        """Take one model turn: answer tool results, deliver nudges, call the model."""
        if not self.client.pooled:
            # One connection pool for the whole run, though no host entered `async with
            # agent`: opened at the first turn, closed when a turn ends the run or raises.
            await self.client.__aenter__()
            self._own_pool = True
        try:
            step = await self._turn(ctx)
        except BaseException:
            await self._close_own_pool()
            raise
        if step.final:
            await self._close_own_pool()
        return step

    async def _close_own_pool(self) -> None:
        if self._own_pool:
            self._own_pool = False
            await self.client.__aexit__(None, None, None)

    async def _turn(self, ctx: RunContext) -> Step:
        self._ctx = ctx
        if not self._started:
            self._open(ctx.resumed_from)
            self._started = True
        else:
            self._answer_open_calls(ctx.tool_results)
        for m in ctx.steer:
            self.messages.append({"role": "user", "content": m.content})

        request = self._request()
        comp, usage = await audited_call(
            self.client, request, ctx, model=self.model,
            usage_of=lambda c: self._usage(c, request), cost_known=self._priced,
            outcome=lambda c: {"tool_calls": len(c.tool_calls)})
        self.messages.append(comp.message)
        if not comp.usage_known and not self._usage_warned:
            self._usage_warned = True
            ctx.event("warning", payload={"message": USAGE_ESTIMATED})
        payload = {"model": self.model, "finish_reason": comp.finish_reason,
                   "calls": [c.name for c in comp.tool_calls]}
        text = comp.content or ""
        if not comp.tool_calls and comp.refusal is not None and not text.strip():
            # Declined: an answer of its own kind, not an empty one to ask again for.
            return Step(output=comp.refusal, final=True, usage=usage, name="turn",
                        payload={**payload, "refusal": comp.refusal[:4000]},
                        error=f"the model refused: {comp.refusal[:500]}")
        if not comp.tool_calls:
            if text.strip():
                self._empty = 0
                if comp.finish_reason == "length":
                    # A final answer cut short: still the answer, but said so in the
                    # run's timeline (`kernel show`).
                    ctx.event("warning", payload={
                        "message": "the answer was cut at the model's length limit "
                                   "(finish_reason=length): it may be incomplete"})
                return Step(output=text, final=True, usage=usage, name="turn",
                            payload=payload, message=text)
            if comp.finish_reason == "length":
                # Cut before it wrote anything (a reasoning model that spent its
                # max_tokens thinking): asking again would only be cut again.
                return Step(output="", final=True, usage=usage, name="turn", payload=payload,
                            message="", error=LENGTH_NO_TEXT)
            # An empty reply is not an answer: show it to the critic (which nudges,
            # then kills `empty_answer`) and ask again; bounded here without a critic
            # (an `error`: `killed` is the critic's word).
            self._empty += 1
            if self._empty >= _EMPTY_LIMIT:
                return Step(output="", final=True, usage=usage, name="turn", payload=payload,
                            message="",
                            error=f"the model answered with an empty message {self._empty} "
                                  "times in a row")
            return Step(output="", usage=usage, name="turn", payload=payload, message="")
        self._empty = 0
        calls: list[ToolCall] = []
        for c in comp.tool_calls:
            if c.args is None:
                self._reject(ctx, c)
            else:
                calls.append(ToolCall(c.name, c.args, c.id))
        # A turn whose every call was rejected (arguments not JSON) still called tools:
        # it is not an empty answer, and the model is told why each was not run.
        return Step(output=comp.content, tool_calls=calls, usage=usage, name="turn",
                    payload=payload, message=text if calls or text.strip() else None)

    async def simulate(self, ctx: RunContext) -> str:
        """What a dry run reports: the model, the endpoint, the tools and the prompt."""
        tools = ", ".join(self.specs) or "none"
        return (f"would ask {self.model} at {self.client.display_url} (tools: {tools}): "
                f"{(self.prompt or '')[:200]}")

    def snapshot(self) -> dict[str, Any]:
        """The checkpoint state: the conversation, with the latest tool results answered."""
        messages = _plain(self.messages)
        open_calls = _open_calls(messages) if self._ctx is not None else []
        if self._ctx is not None and open_calls:
            # The kernel saves after running a step's tools, before the next
            # step appends their results: put them in now, or a resumed run
            # would lose them. It also saves before running them (the results
            # then are the last step's): the calls stay open, and a run resumed
            # from there is told they were interrupted (`_INTERRUPTED`).
            results = self._ctx.tool_results
            ids = {c.get("id") for c in open_calls}
            if any(r.call.id in ids for r in results) or not any(
                    isinstance(c.get("id"), str) and c.get("id") for c in open_calls):
                messages.extend(self._tool_messages(messages[-1], results))
        return {"version": _STATE_VERSION, "model": self.model, "messages": messages}

    # ------------------------------------------------------------- internals

    def _open(self, state: Any) -> None:
        if state is not None:
            messages = state.get("messages") if isinstance(state, dict) else None
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise AgentError("cannot resume: the checkpoint state is not an LLM "
                                 "conversation (no 'messages' list)")
            self.messages = _plain(messages)
            open_calls = _open_calls(self.messages)
            for call in open_calls:
                self.messages.append(
                    {"role": "tool", "tool_call_id": call.get("id", ""), "content": _INTERRUPTED})
            return
        if self.prompt is None and not self.opening:
            raise AgentError("LLMAgent has no prompt and no opening messages")
        if self.system:
            self.messages.append({"role": "system", "content": self.system})
        self.messages.extend(_plain(self.opening))
        if self.prompt is not None:
            self.messages.append({"role": "user", "content": self.prompt})

    def _request(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": self.messages}
        if self.specs:
            body["tools"] = [spec.schema() for spec in self.specs.values()]
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        body.update(self.extra_body)
        return body

    def _usage(self, comp: Completion, request: Mapping[str, Any]) -> Usage:
        return completion_usage(comp, self.prices.get(self.model) or (
            self.prices.get(comp.model) if comp.model is not None else None), request)

    @property
    def unpriced(self) -> str | None:
        """`SupportsPricing`: None when `prices` has this agent's model, else why its
        cost cannot be known (a cost cap then refuses the run before its first call)."""
        if self.model in self.prices:
            return None
        return (f"model {self.model!r} has no price (give one: kernel run --price IN,OUT, "
                f"or LLMAgent(prices=...))")

    def _priced(self, comp: Completion) -> bool:
        """True when the call's cost is known: priced from reported tokens (not an
        estimate), or reported by the server (`usage.cost`) for a model with no price."""
        if self.model in self.prices or comp.model in self.prices:
            return comp.usage_known
        return comp.cost_usd is not None

    def _reject(self, ctx: RunContext, call: ModelToolCall) -> None:
        """Answer a call whose arguments are unusable ourselves; the model sees why.

        The critic is shown it as a call with an error result (`ctx.tool_start`,
        `ctx.tool_end`), so the same unusable call over and over is a loop it
        nudges and kills like any other, not billed turns up to `max_steps`.
        """
        error = f"error: tool {call.name!r} not run: {call.error}"
        self._rejected[call.id] = error
        ctx.event("tool_rejected", name=call.name, payload={
            "id": call.id, "error": call.error, "arguments": call.arguments[:1000]})
        shown = ToolCall(call.name, {"_unparsed_arguments": call.arguments[:4000]}, call.id)
        ctx.tool_start(shown, payload={"rejected": call.error})
        ctx.tool_end(ToolResult(shown, error=f"not run: {call.error}"))

    def _answer_open_calls(self, results: Sequence[ToolResult]) -> None:
        if _open_calls(self.messages):
            self.messages.extend(self._tool_messages(self.messages[-1], results))
        self._rejected.clear()

    def _tool_messages(self, assistant: Mapping[str, Any],
                       results: Sequence[ToolResult]) -> list[dict[str, Any]]:
        """One tool message per call of `assistant`, in call order, whatever happened to it."""
        by_id = {r.call.id: r for r in results if r.call.id}
        out: list[dict[str, Any]] = []
        for call in assistant.get("tool_calls") or []:
            cid = call.get("id", "")
            result = by_id.get(cid)
            if result is not None:
                content = self._render(result)
            else:
                content = self._rejected.get(
                    cid, "error: no result (the run did not execute this call)")
            out.append({"role": "tool", "tool_call_id": cid, "content": content})
        return out

    def _render(self, result: ToolResult) -> str:
        if result.error is not None:
            text = f"error: {result.error}"
        elif isinstance(result.output, str):
            text = result.output
        elif result.output is None:
            text = ""
        else:
            text = json.dumps(result.output, default=str)
        if len(text) > self.max_tool_output:
            text = (text[: self.max_tool_output]
                    + f"\n[truncated: {len(text)} characters, showed {self.max_tool_output}]")
        return text

    def _redacting(self, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """Wrap a tool so the API key never leaves it (its result is audited)."""
        client = self.client

        async def call(**kwargs: Any) -> Any:
            try:
                out = await fn(**kwargs)
            except Exception as exc:
                secret = client._api_key
                if secret and secret in str(exc):
                    raise RuntimeError(str(exc).replace(secret, "[redacted]")) from None
                raise
            secret = client._api_key
            if not secret:
                return out
            if isinstance(out, str):
                return out.replace(secret, "[redacted]")
            if out is not None:
                text = json.dumps(out, default=str)
                if secret in text:
                    return text.replace(secret, "[redacted]")
            return out

        return call


def _open_calls(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The tool calls of the last message, if it is an assistant message awaiting results."""
    if not messages:
        return []
    last = messages[-1]
    if last.get("role") != "assistant":
        return []
    calls = last.get("tool_calls")
    return [c for c in calls if isinstance(c, Mapping)] if isinstance(calls, list) else []


def _plain(value: Any) -> Any:
    """A JSON-plain deep copy (what a checkpoint store would give back)."""
    return json.loads(json.dumps(value, default=str))
