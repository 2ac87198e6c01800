"""Evaluators: turn what a state produced into a verdict the routes key on.

Every evaluator returns an `Evaluation` and never raises on bad input: text
that does not parse gives the verdict `error` with the reason in `details`.
Verdicts are `yes`/`no`/`error` (and `partial`/`blocked` from a model);
`convergence` answers `target`/`progress`/`stall`.
"""

from __future__ import annotations

import json
import math
import operator as op
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from kernel import RunContext, Usage

from ._spec import EvaluateSpec, LLMSpec


@dataclass(frozen=True, slots=True)
class Evaluation:
    """An evaluator's answer: the routing key, what it was based on, and what it used
    (a model's tokens and cost: counted in the step's usage, so budgets bound it)."""

    verdict: str
    details: dict[str, Any] = field(default_factory=dict)
    usage: Usage | None = None


_COMPARE: dict[str, Callable[[Any, Any], bool]] = {
    "eq": op.eq, "ne": op.ne, "lt": op.lt, "le": op.le, "gt": op.gt, "ge": op.ge,
}


def exit_code(code: int) -> Evaluation:
    """0 -> yes, 1 -> no, anything else (2+, killed, timed out) -> error."""
    verdict = "yes" if code == 0 else "no" if code == 1 else "error"
    return Evaluation(verdict, {"exit_code": code})


def output_contains(text: str, pattern: str, *, negate: bool = False,
                    error_patterns: tuple[str, ...] = ()) -> Evaluation:
    """yes when `pattern` (a regex, or plain text if it is not one) occurs; `negate` flips it.

    `error_patterns` (plain text): when the pattern is not found (and not
    negated), output containing one of them is `error` rather than `no`.
    """
    try:
        matched = re.search(pattern, text, re.MULTILINE) is not None
        how = "regex"
    except re.error:
        matched = pattern in text
        how = "text"
    details = {"matched": matched, "pattern": pattern, "negate": negate, "as": how}
    if not matched and not negate:
        hit = next((p for p in error_patterns if p in text), None)
        if hit is not None:
            return Evaluation("error", {**details, "error_pattern": hit})
    return Evaluation("yes" if matched != negate else "no", details)


def parse_number(text: str) -> float | None:
    """The number `text` holds: the whole (stripped) text, else its last non-empty line."""
    stripped = text.strip()
    candidates = [stripped]
    if "\n" in stripped:
        candidates.append(stripped.rsplit("\n", 1)[1].strip())
    for candidate in candidates:
        try:
            value = float(candidate)
        except ValueError:
            continue
        if not math.isnan(value):
            return value
    return None


def output_numeric(text: str, operator: str, target: Any) -> Evaluation:
    """yes when the output, read as a number, compares true against `target`."""
    value = parse_number(text)
    if value is None:
        return Evaluation("error", {"error": f"output is not a number: {_clip(text)!r}"})
    goal = _as_float(target)
    if goal is None:
        return Evaluation("error", {"error": f"target is not a number: {target!r}"})
    met = _COMPARE[operator](value, goal)
    return Evaluation("yes" if met else "no",
                   {"value": value, "operator": operator, "target": goal})


def json_path(data: Any, path: str) -> Any:
    """The value at a jq-like `path` (`.a.b.0`, `a.b[0]`, `.` for the whole); KeyError if absent."""
    parts = [p for p in re.split(r"\.|\[(\d+)\]", path.strip()) if p]
    current = data
    for part in parts:
        if isinstance(current, Mapping) and part in current:
            current = current[part]
        elif isinstance(current, list) and part.lstrip("-").isdigit() and \
                -len(current) <= int(part) < len(current):
            current = current[int(part)]
        else:
            raise KeyError(path)
    return current


def output_json(text: str, path: str, operator: str, target: Any) -> Evaluation:
    """yes when the JSON value at `path` compares true against `target`.

    Numbers compare numerically (a numeric string on either side counts);
    other values support only eq/ne.
    """
    try:
        data = json.loads(text)
    except ValueError as exc:
        return Evaluation("error", {"error": f"output is not JSON: {exc}"})
    try:
        value = json_path(data, path)
    except KeyError:
        return Evaluation("error", {"error": f"no value at path {path!r}", "path": path})
    details = {"value": value, "path": path, "operator": operator, "target": target}
    left, right = _as_float(value), _as_float(target)
    if left is not None and right is not None and not isinstance(value, bool) \
            and not isinstance(target, bool):
        return Evaluation("yes" if _COMPARE[operator](left, right) else "no", details)
    if operator not in ("eq", "ne"):
        return Evaluation("error", {**details, "error": f"{operator} needs numbers"})
    return Evaluation("yes" if (value == target) == (operator == "eq") else "no", details)


def convergence(current: float, previous: float | None, target: float, *,
                tolerance: float = 0.0, direction: str = "minimize") -> Evaluation:
    """Progress of a metric toward `target`.

    `target` when within `tolerance` of the target; otherwise `progress` when
    it moved toward the target (`direction`) by more than `tolerance` since
    the previous value (or there is no previous value yet); else `stall`.
    The tolerance is a noise band: changes inside it are not progress.
    """
    details: dict[str, Any] = {"current": current, "previous": previous, "target": target,
                               "tolerance": tolerance, "direction": direction}
    if abs(current - target) <= tolerance:
        return Evaluation("target", details)
    if previous is None:
        return Evaluation("progress", {**details, "delta": None})
    delta = current - previous
    gained = -delta if direction == "minimize" else delta
    return Evaluation("progress" if gained > tolerance else "stall", {**details, "delta": delta})


def mcp_result(text: str, code: int) -> Evaluation:
    """An MCP tool call's result envelope: yes unless `isError`, error if the call failed.

    `details["as"]` names the verdict as little-loops spells it (success,
    tool_error, not_found, timeout); a state that routes those names gets it.

    The caller (`mcp-call` by default) exits 0 with the result envelope as
    JSON, 1 when the tool reported an error, 124 on timeout, 127 when the
    server or tool was not found.
    """
    if code == 124:
        return Evaluation("error", {"exit_code": code, "error": "the MCP call timed out",
                                 "as": "timeout"})
    if code == 127:
        return Evaluation("error", {"exit_code": code, "error": "MCP server or tool not found",
                                 "as": "not_found"})
    if code not in (0, 1):
        return Evaluation("error", {"exit_code": code, "error": f"the MCP call failed ({code})"})
    try:
        envelope = json.loads(text) if text.strip() else {}
    except ValueError:
        return Evaluation("error", {"exit_code": code, "error": "output is not an MCP result"})
    if not isinstance(envelope, Mapping):
        return Evaluation("error", {"exit_code": code, "error": "output is not an MCP result"})
    is_error = bool(envelope.get("isError", code == 1))
    return Evaluation("no" if is_error else "yes", {"exit_code": code, "is_error": is_error,
                                                 "as": "tool_error" if is_error else "success"})


# ---------------------------------------------------------------- the model


DEFAULT_PROMPT = "Did the action achieve its goal? Judge from its output."
DEFAULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "verdict": {"type": "string", "enum": ["yes", "no", "partial", "blocked"],
                    "description": "yes: goal met; no: not met, try again; partial: progress "
                                   "but not done; blocked: needs outside help"},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "reason": {"type": "string"},
    },
    "required": ["verdict", "confidence", "reason"],
}
_ALIASES = {"success": "yes", "failure": "no", "fail": "no", "pass": "yes"}
MAX_JUDGED_CHARS = 4000


@dataclass(frozen=True, slots=True)
class JudgeRequest:
    """What an `llm_structured` evaluation asks a model.

    Attributes:
        prompt: The instruction (the state's `evaluate.prompt`, or a default).
        output: The text to judge (the last `MAX_JUDGED_CHARS` characters).
        schema: The JSON schema the answer must follow (verdict, confidence, reason).
        model: The loop's `llm.model`, if set.
        max_tokens: The loop's `llm.max_tokens`.
        ctx: The loop run's context, if the evaluation has one: a judge marks its
            request in flight there (the critic's `model_timeout` bounds it, not
            the idle timeout) and audits its retries and its call.
    """

    prompt: str
    output: str
    schema: Mapping[str, Any]
    model: str | None = None
    max_tokens: int = 256
    ctx: RunContext | None = field(default=None, compare=False, repr=False)


class VerdictSource(Protocol):
    """Where `llm_structured` verdicts come from (the CLI wires the LLM adapter).

    **Protocol:** awaited once per evaluation on the trio thread; returns a
    mapping with `verdict` (str) and optionally `confidence` (0..1),
    `reason`, and `usage` (a `kernel.Usage`: what the call consumed, counted
    in the step's usage so the run's budgets bound it; `cost_known` False
    says its cost could not be priced). It may take as long as it needs: the
    evaluation bounds it by the loop's `llm.timeout` and cancels it after.
    Raising gives the state the verdict `error` with the exception's text
    (an exception with a `usage` attribute still has it counted); it never
    ends the run.
    """

    def __call__(self, request: JudgeRequest) -> Awaitable[Mapping[str, Any]]: ...


async def llm_structured(text: str, spec: EvaluateSpec, llm: LLMSpec,
                         judge: VerdictSource | None, ctx: RunContext | None = None
                         ) -> Evaluation:
    """Ask the configured model for a verdict; without one, `error` saying why."""
    if not llm.enabled:
        return Evaluation("error", {"error": "LLM evaluation is disabled (llm.enabled: false)"})
    if judge is None:
        return Evaluation("error", {"error": "llm_structured needs a model and none is configured "
                                          "(wire a VerdictSource into LoopAgent(judge=...))"})
    request = JudgeRequest(prompt=spec.prompt or DEFAULT_PROMPT, output=text[-MAX_JUDGED_CHARS:],
                           schema=spec.schema or DEFAULT_SCHEMA, model=llm.model,
                           max_tokens=llm.max_tokens, ctx=ctx)
    answer: Mapping[str, Any] | None = None
    with trio.move_on_after(llm.timeout):
        try:
            answer = await judge(request)
        except Exception as exc:
            usage = getattr(exc, "usage", None)
            return _used(Evaluation("error", {
                "error": f"the model failed: {type(exc).__name__}: {exc}"}),
                usage if isinstance(usage, Usage) else None, None)
    if answer is None:
        return Evaluation("error", {"error": f"the model did not answer within {llm.timeout:g}s"})
    usage = answer.get("usage") if isinstance(answer, Mapping) else None
    usage = usage if isinstance(usage, Usage) else None
    known = answer.get("cost_known") if isinstance(answer, Mapping) else None
    if not isinstance(answer, Mapping) or not isinstance(answer.get("verdict"), str):
        shown = ({k: v for k, v in answer.items() if k not in ("usage", "cost_known")}
                 if isinstance(answer, Mapping) else answer)
        why = f"the model's answer has no verdict: {shown!r}"[:300]
        return _used(Evaluation("error", {"error": why}), usage, known)
    said = answer["verdict"].strip().lower()
    verdict = _ALIASES.get(said, said)
    enum = verdict_enum(request.schema)
    if enum is not None and verdict not in enum and said not in enum:
        # A malformed answer like any other: routable as `error`, never a verdict
        # no route can take.
        why = (f"the model's verdict {answer['verdict']!r} is not one of "
               f"{', '.join(enum)}")[:300]
        return _used(Evaluation("error", {"error": why, "answer": answer["verdict"][:100]}),
                     usage, known)
    confidence = _as_float(answer.get("confidence", 1.0))
    confidence = 1.0 if confidence is None else confidence
    confident = confidence >= spec.min_confidence
    if spec.uncertain_suffix and not confident:
        verdict += "_uncertain"
    return _used(Evaluation(verdict, {"confidence": confidence, "confident": confident,
                                      "reason": str(answer.get("reason", ""))[:1000]}),
                 usage, known)


def verdict_enum(schema: Mapping[str, Any]) -> list[str] | None:
    """The verdicts a judge's answer schema allows (`properties.verdict.enum`, lower-cased),
    or None when it names no list (any verdict is taken as it comes)."""
    props = schema.get("properties")
    field_ = props.get("verdict") if isinstance(props, Mapping) else None
    enum = field_.get("enum") if isinstance(field_, Mapping) else None
    if not isinstance(enum, list) or not enum:
        return None
    return [str(v).strip().lower() for v in enum]


def _used(evaluation: Evaluation, usage: Usage | None, cost_known: Any) -> Evaluation:
    """`evaluation` carrying what the model call used (also in its audited details)."""
    if usage is None:
        return evaluation
    return Evaluation(evaluation.verdict, {**evaluation.details, "usage": {
        "input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens,
        "thinking_tokens": usage.thinking_tokens, "cost_usd": usage.cost_usd,
        **({"cost_known": cost_known} if isinstance(cost_known, bool) else {})}}, usage)


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _clip(text: str, limit: int = 100) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."
