"""The LLM verdict source for loops: `llm_structured` evaluations answered by a model.

A loop's `llm_structured` evaluation asks a model whether a state's output
met its goal. The loop adapter only knows the `VerdictSource` protocol;
`llm_judge` answers it with a chat-completions call through `ChatClient`, so
the same model, base URL and key variable that drive an LLM agent also
judge loop states. A host passes it to `LoopAgent(judge=...)`;
`adapters.agent_from_spec` does so for a `LoopSpec`.

A judge call is a model call like the agent's: when the request carries the
run's context (`request.ctx`, a `kernel.RunContext`), it is marked in flight
(`ctx.activity("model_request")`: the critic's `model_timeout` judges it, not
its idle timeout), its retries are audited as `model_retry` events and its
outcome as a `model_call` event, and no retry wait may pass the run's
deadline. Without one (an older loop adapter, a host calling it directly) it
is the same call, unaudited.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kernel import ConfigError

if TYPE_CHECKING:
    from adapters.loop import JudgeRequest, VerdictSource
    from kernel import RunContext

    from ._agent import Price
    from ._client import ChatClient

_SYSTEM = (
    "You judge the output of one step of an automated loop. Answer with exactly one JSON "
    "object that follows this JSON schema, and nothing else:\n{schema}"
)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def llm_judge(*, model: str | None, base_url: str | None,
              api_key_env: str | None, price: Price | None = None,
              client: ChatClient | None = None) -> VerdictSource:
    """A verdict source asking an OpenAI-compatible model (built lazily, used per call).

    Each answer carries what the call consumed under `"usage"` (a `kernel.Usage`),
    which the loop counts in the step's usage: the run's budgets bound the judge's
    calls like any other model call.

    Args:
        model: The model to ask; the loop file's `llm.model` wins when it sets one.
        base_url: The API root (default `$OPENAI_BASE_URL`, then OpenAI's).
        api_key_env: The environment variable holding the key (default OPENAI_API_KEY).
        price: What the model costs; None: what the server reports (`usage.cost`), else 0.
        client: The client to call the model with (its base URL and key win over
            `base_url` and `api_key_env`); None: one is made at the first call.

    Raises:
        ConfigError: `base_url` is given and is not an http(s) URL (checked now, so
            `kernel run LOOP --base-url ...` refuses it before anything runs; one
            from `$OPENAI_BASE_URL` is checked at the first call).
    """
    from ._client import check_base_url

    if base_url:
        try:
            check_base_url(base_url)
        except ValueError as exc:
            raise ConfigError(f"--base-url: {exc}") from None
    url = base_url or os.environ.get("OPENAI_BASE_URL") or None
    key_env = api_key_env or "OPENAI_API_KEY"
    made: Any = client

    async def judge(request: JudgeRequest) -> Mapping[str, Any]:
        nonlocal made
        from ._agent import audited_call, completion_usage
        from ._client import DEFAULT_BASE_URL, ChatClient

        chosen = request.model or model
        if not chosen:
            raise ConfigError("llm_structured needs a model: set llm.model in the loop file "
                              "or pass --model")
        if made is None:
            try:
                made = ChatClient(base_url=url or DEFAULT_BASE_URL, api_key_env=key_env)
            except ValueError as exc:
                raise ConfigError(f"$OPENAI_BASE_URL: {exc}") from None
            if (url or DEFAULT_BASE_URL) == DEFAULT_BASE_URL and not made.has_key:
                raise ConfigError(f"llm_structured: no API key in ${key_env} for "
                                  f"{DEFAULT_BASE_URL} (or pass --base-url)")
        chat: ChatClient = made
        ctx: RunContext | None = getattr(request, "ctx", None)
        body = {
            "model": chosen,
            "max_tokens": request.max_tokens,
            "temperature": 0,
            "messages": [
                {"role": "system",
                 "content": _SYSTEM.format(schema=json.dumps(request.schema))},
                {"role": "user",
                 "content": f"{request.prompt}\n\nThe step's output:\n{request.output}"},
            ],
        }
        known = ((lambda c: c.usage_known) if price is not None
                 else (lambda c: c.cost_usd is not None))
        completion, usage = await audited_call(
            chat, body, ctx, model=chosen, usage_of=lambda c: completion_usage(c, price, body),
            cost_known=known, extra={"judge": True})
        try:
            answer = parse_answer(completion.content or "")
        except ValueError as exc:
            raise JudgeError(str(exc), usage) from None
        return {**answer, "usage": usage, "cost_known": known(completion)}

    judge.unpriced = None if price is not None else (  # type: ignore[attr-defined]
        "the model of its llm_structured evaluations has no price (give one: kernel run "
        "--price IN,OUT, or llm_judge(price=...))")
    return judge


class JudgeError(ValueError):
    """The model answered, but not with a verdict; `usage` is what the call consumed."""

    def __init__(self, message: str, usage: Any) -> None:
        super().__init__(message)
        self.usage = usage


def parse_answer(text: str) -> Mapping[str, Any]:
    """The JSON object in a model's answer (a ```json fence is allowed); ValueError if none."""
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    if fenced:
        stripped = fenced.group(1)
    if not stripped.startswith("{"):
        start, end = stripped.find("{"), stripped.rfind("}")
        if start < 0 or end < start:
            raise ValueError(f"the model did not answer with a JSON object: {text[:200]!r}")
        stripped = stripped[start:end + 1]
    try:
        answer = json.loads(stripped)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the model's answer is not valid JSON ({exc.msg}): "
                         f"{text[:200]!r}") from exc
    if not isinstance(answer, dict):
        raise ValueError(f"the model's answer is not a JSON object: {text[:200]!r}")
    return answer
