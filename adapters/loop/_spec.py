"""The loop file format as dataclasses, and the parser that builds them.

The parser never raises on a malformed file: it records a `Problem` (with
the key's path and line) and carries on, so `kernel validate` can report
every problem at once. `_validate.py` then checks what only the whole loop
can tell (route targets, reachability, variables, sub-loops).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kernel import ConfigError, Limits

from ._yaml import Located

Severity = Literal["error", "warning"]

ACTION_TYPES = ("shell", "prompt", "slash_command", "mcp_tool")
EVALUATORS = ("exit_code", "output_contains", "output_numeric", "output_json", "convergence",
              "llm_structured", "mcp_result", "diff_stall")
OPERATORS = ("eq", "ne", "lt", "le", "gt", "ge")
DIRECTIONS = ("minimize", "maximize")
#: The verdicts the `on_*` shorthands name (plus on_success/on_failure aliases).
SHORTHAND_VERDICTS = ("yes", "no", "error", "partial", "blocked")
CURRENT = "$current"

DEFAULT_MAX_ITERATIONS = 50
DEFAULT_ACTION_TIMEOUT = 3600.0
DEFAULT_MCP_TIMEOUT = 30.0

_LOOP_KEYS = ("name", "description", "initial", "states", "context", "max_iterations",
              "max_steps", "timeout", "default_timeout", "backoff", "maintain", "llm", "flow",
              "state_defs", "import", "fragments", "parameters", "input_key", "required_inputs")
_STATE_KEYS = ("action", "action_type", "evaluate", "route", "next", "terminal", "capture",
               "timeout", "max_retries", "on_retry_exhausted", "on_maintain", "loop",
               "context_passthrough", "params", "description", "on_success", "on_failure",
               "failure", "with", "fragment_parameters", "fragment_name")
PARAMETER_TYPES = ("string", "integer", "number", "boolean", "enum", "path")
_PARAMETER_KEYS = ("type", "required", "default", "description", "values")
#: Terminals that are failures unless they say `failure: false` (little-loops' defaults).
FAILURE_NAMES = ("failed", "error", "aborted", "finalize_aborted")
_EVALUATE_KEYS = ("type", "source", "operator", "target", "tolerance", "pattern", "negate",
                  "path", "prompt", "schema", "min_confidence", "uncertain_suffix", "previous",
                  "direction", "error_patterns", "scope", "max_stall")
_LLM_KEYS = ("enabled", "model", "max_tokens", "timeout")

# little-loops keys: tooling metadata we accept without a word, and features we
# deliberately leave out (one warning naming the feature; the loop still runs).
_QUIET_LOOP_KEYS = ("scope", "category", "labels", "visibility", "commands", "singleton")
_LEFT_OUT_LOOP_KEYS = {
    "on_handoff": "little-loops' handoff policy (here CONTEXT_HANDOFF ends the run 'handoff')",
    "on_max_steps": "routing to a state at the step limit (here the run ends max_steps)",
    "on_max_iterations": "routing to a state at the step limit (here the run ends max_steps)",
    "max_edge_revisits": "edge-revisit limits (the critic watches for cycles)",
    "default_idle_timeout": "per-action idle timeouts (the critic watches idleness)",
    "circuit": "the rate-limit circuit breaker",
    "artifact_versioning": "artifact versioning",
    "pruning_profile": "context pruning profiles",
    "tamper_guard": "the tamper guard",
    "prepatch_check": "pre-patch checks",
    "session_mode": "agent session modes",
    "config": "ll-config overrides",
    "targets": "harness targets",
}
_LEFT_OUT_STATE_KEYS = {
    "agent": "choosing the prompt agent per state", "tools": "per-state agent tool scopes",
    "model": "per-state models", "effort": "per-state reasoning effort",
    "pruning_profile": "context pruning profiles", "learning": "learning states",
    "throttle": "throttling", "cost_ceiling": "per-state cost ceilings",
    "session_mode": "agent session modes", "worktree": "git worktrees for sub-loops",
    "tamper_guard": "the tamper guard", "prepatch_check": "pre-patch checks",
    "retryable_exit_codes": "retryable exit codes", "idle_timeout": "per-action idle timeouts",
    "request_path": "orchestration request paths", "append_to_messages": "message appending",
    "max_rate_limit_retries": "rate-limit retries",
    "rate_limit_backoff_base_seconds": "rate-limit backoff",
    "rate_limit_max_wait_seconds": "rate-limit backoff",
    "rate_limit_long_wait_ladder": "rate-limit backoff", "type": "typed (learning) states",
}
#: little-loops evaluators we leave out: validation says so; a run judges them `error`.
LEFT_OUT_EVALUATORS = {
    "score_stall": "score-history stall detection", "open_question_stall": "open-question "
    "stall detection", "action_stall": "repeated-action stall detection",
    "harbor_scorer": "Harbor benchmark scoring", "comparator": "comparator evaluation",
    "contract": "contract evaluation", "classify": "classifier routing",
}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong (or suspicious) in a loop file, with where it is.

    Attributes:
        severity: "error" (the loop cannot run) or "warning" (it runs; look anyway).
        where: The key's path, e.g. `states.fix.route.yes`; "" for the file itself.
        message: What is wrong, one line.
        file: The loop file.
        line: 1-based line of the key, when known.
        column: 1-based column, for YAML syntax errors.
    """

    severity: Severity
    where: str
    message: str
    file: str = ""
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        loc = self.file or "<loop>"
        if self.line is not None:
            loc += f":{self.line}"
            if self.column is not None:
                loc += f":{self.column}"
        return f"{loc}: {self.where}: {self.message}" if self.where else f"{loc}: {self.message}"


@dataclass(slots=True)
class EvaluateSpec:
    """How a state's result becomes a verdict (`evaluate:`)."""

    type: str
    source: str | None = None
    operator: str | None = None
    target: Any = None
    tolerance: Any = None
    pattern: str | None = None
    negate: bool = False
    path: str | None = None
    prompt: str | None = None
    schema: dict[str, Any] | None = None
    min_confidence: float = 0.5
    uncertain_suffix: bool = False
    previous: str | None = None
    direction: str = "minimize"
    error_patterns: tuple[str, ...] = ()
    scope: tuple[str, ...] = ()
    max_stall: int = 1


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """A declared input (`parameters:` of a loop or a fragment), as little-loops types them."""

    type: str = "string"
    required: bool = False
    default: Any = None
    description: str | None = None
    values: tuple[Any, ...] | None = None

    def check(self, name: str, value: Any) -> str | None:
        """Why `value` does not fit (None when it does)."""
        text = str(value).strip()
        if self.type == "integer" and not re.fullmatch(r"[-+]?\d+", text):
            return f"parameter '{name}' must be an integer, got {_show(value)}"
        if self.type == "number":
            try:
                float(text)
            except ValueError:
                return f"parameter '{name}' must be a number, got {_show(value)}"
        if self.type == "boolean" and text.lower() not in ("true", "false"):
            return f"parameter '{name}' must be true or false, got {_show(value)}"
        if self.type == "enum" and self.values is not None and value not in self.values \
                and text not in [str(v) for v in self.values]:
            return f"parameter '{name}' must be one of {list(self.values)}, got {_show(value)}"
        return None


def bind(params: Mapping[str, ParamSpec], given: Mapping[str, Any]) -> dict[str, Any]:
    """`given` plus the defaults of unbound parameters; ValueError naming what is wrong."""
    out = dict(given)
    for name, spec in params.items():
        if name not in out and spec.default is not None:
            out[name] = spec.default
        if name not in out and spec.required:
            raise ValueError(f"parameter '{name}' is required but not bound in 'with'")
        if name in out:
            why = spec.check(name, out[name])
            if why is not None:
                raise ValueError(why)
    return out


def with_context(base: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """`base` (the file's context) with `given` (`--context`) on top; a dotted key sets a field.

    `cfg.depth=9` sets `depth` inside the mapping `cfg` (made if absent, copied if
    the file has one, its other fields kept), so `${context.cfg.depth}` reads it.
    Plain keys are applied first, so `cfg=x` with `cfg.depth=9` is refused
    whatever their order.

    Raises:
        ConfigError: A dotted key reaches into a value that is not a mapping.
    """
    out = dict(base)
    dotted = [k for k in given if "." in k]
    out.update({k: v for k, v in given.items() if "." not in k})
    for key in dotted:
        parts = key.split(".")
        node = out
        for depth, part in enumerate(parts[:-1]):
            inner = node.get(part)
            if inner is None:
                inner = {}
            elif isinstance(inner, Mapping):
                inner = dict(inner)
            else:
                where = ".".join(parts[:depth + 1])
                raise ConfigError(f"--context {key}: context '{where}' is a single value, "
                                  "not a mapping with fields")
            node[part] = inner
            node = inner
        node[parts[-1]] = given[key]
    return out


@dataclass(slots=True)
class RouteSpec:
    """A full routing table: verdict -> state, plus the `_`/default and `_error`/error keys."""

    table: dict[str, str] = field(default_factory=dict)
    default: str | None = None
    error: str | None = None


@dataclass(slots=True)
class StateSpec:
    """One state of the machine.

    `on` holds the shorthand routes by verdict: `on_yes` (alias `on_success`),
    `on_no` (alias `on_failure`), `on_error`, `on_partial`, `on_blocked`, and
    any other `on_<verdict>` key (`on_target`, `on_stall`, ...).
    """

    name: str
    action: str | None = None
    action_type: str | None = None
    evaluate: EvaluateSpec | None = None
    route: RouteSpec | None = None
    on: dict[str, str] = field(default_factory=dict)
    next: str | None = None
    terminal: bool = False
    capture: str | None = None
    timeout: float | None = None
    max_retries: int | None = None
    on_retry_exhausted: str | None = None
    on_maintain: str | None = None
    loop: str | None = None
    context_passthrough: bool = False
    params: dict[str, Any] = field(default_factory=dict)
    description: str | None = None
    failure: bool = False
    with_: dict[str, Any] = field(default_factory=dict)
    fragment: str | None = None
    fragment_params: dict[str, ParamSpec] = field(default_factory=dict)
    child: LoopSpec | None = None

    @property
    def mode(self) -> str:
        """How the state runs: shell | prompt | mcp_tool | loop | none."""
        if self.loop is not None:
            return "loop"
        if self.action is None:
            return "none"
        if self.action_type == "mcp_tool":
            return "mcp_tool"
        if self.action_type in ("prompt", "slash_command"):
            return "prompt"
        if self.action_type is None and self.action.lstrip().startswith("/"):
            return "prompt"
        return "shell"

    def targets(self) -> list[tuple[str, str]]:
        """Every (key path, target) this state can move to."""
        out: list[tuple[str, str]] = []
        if self.next is not None:
            out.append(("next", self.next))
        if self.route is not None:
            out += [(f"route.{v}", t) for v, t in self.route.table.items()]
            if self.route.default is not None:
                out.append(("route._", self.route.default))
            if self.route.error is not None:
                out.append(("route._error", self.route.error))
        out += [(f"on_{v}", t) for v, t in self.on.items()]
        if self.on_retry_exhausted is not None:
            out.append(("on_retry_exhausted", self.on_retry_exhausted))
        if self.on_maintain is not None:
            out.append(("on_maintain", self.on_maintain))
        return out

    def has_error_route(self) -> bool:
        """True when an `error` verdict has somewhere explicit to go."""
        return "error" in self.on or (self.route is not None and (
            "error" in self.route.table or self.route.error is not None))


@dataclass(slots=True)
class LLMSpec:
    """The loop's `llm:` settings, used by `llm_structured` evaluations."""

    enabled: bool = True
    model: str | None = None
    max_tokens: int = 256
    timeout: float = 120.0


@dataclass(slots=True)
class LoopSpec:
    """A parsed loop file.

    Attributes:
        path: The file it came from ("" when built in code).
        lines: key path -> 1-based line, for locating problems.
        max_iterations: States executed before the run ends `max_steps`.
        timeout: The whole loop's deadline in seconds (None: the host's default).
        default_timeout: Per-action timeout when a state gives none.
        backoff: Seconds slept between iterations (interruptible).
        maintain: Restart at `on_maintain`/`initial` instead of ending.
    """

    name: str
    initial: str
    states: dict[str, StateSpec]
    description: str | None = None
    context: dict[str, Any] = field(default_factory=dict)
    max_iterations: int = DEFAULT_MAX_ITERATIONS
    timeout: float | None = None
    default_timeout: float | None = None
    backoff: float = 0.0
    maintain: bool = False
    llm: LLMSpec = field(default_factory=LLMSpec)
    parameters: dict[str, ParamSpec] = field(default_factory=dict)
    input_key: str = "input"
    required_inputs: tuple[str, ...] = ()
    path: str = ""
    lines: dict[str, int] = field(default_factory=dict)

    def limits(self, *, poll_interval: float | None = None) -> Limits:
        """The kernel bounds this loop asks for: max_iterations and its timeout.

        Actions have their own timeouts (`timeout`/`default_timeout`), so the
        kernel's per-tool timeout does not apply.
        """
        extra: dict[str, Any] = {}
        if poll_interval is not None:
            extra["poll_interval"] = poll_interval
        return Limits(max_steps=self.max_iterations, timeout=self.timeout, tool_timeout=None,
                      **extra)

    def line_of(self, where: str) -> int | None:
        """The line of `where`, or of its closest enclosing key that has one."""
        return _line_of(self.lines, where)


def _line_of(lines: Mapping[str, int], where: str) -> int | None:
    while True:
        if where in lines:
            return lines[where]
        if "." not in where:
            return lines.get("")
        where = where.rsplit(".", 1)[0]


# ------------------------------------------------------------------ parsing


class _Parser:
    """Builds a `LoopSpec` from the YAML data, collecting problems."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.problems: list[Problem] = []
        self.lines: dict[str, int] = {}

    # -- problems

    def add(self, severity: Severity, where: str, message: str) -> None:
        self.problems.append(Problem(severity, where, message, self.file,
                                     _line_of(self.lines, where)))

    def error(self, where: str, message: str) -> None:
        self.add("error", where, message)

    def warn(self, where: str, message: str) -> None:
        self.add("warning", where, message)

    def note_lines(self, prefix: str, mapping: Mapping[Any, Any]) -> None:
        if isinstance(mapping, Located):
            if mapping.line is not None and prefix not in self.lines:
                self.lines[prefix] = mapping.line
            for key, line in mapping.key_lines.items():
                self.lines[_join(prefix, str(key))] = line

    # -- typed getters: return None (and record an error) when the type is wrong

    def text(self, data: Mapping[Any, Any], key: str, where: str) -> str | None:
        value = data.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            self.error(where, f"expected text, got {_kind(value)}")
            return None
        return str(value)

    def flag(self, data: Mapping[Any, Any], key: str, where: str) -> bool | None:
        value = data.get(key)
        if value is None:
            return None
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("yes", "on", "no", "off"):
            return value.lower() in ("yes", "on")
        self.error(where, f"expected true or false, got {_show(value)}")
        return None

    def number(self, data: Mapping[Any, Any], key: str, where: str, *, positive: bool = False,
               minimum: float | None = None) -> float | None:
        value = data.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.error(where, f"expected a number, got {_show(value)}")
            return None
        if math.isnan(value) or math.isinf(value):
            self.error(where, f"expected a finite number, got {value}")
            return None
        if positive and value <= 0:
            self.error(where, f"must be greater than 0, got {_show(value)}")
            return None
        if minimum is not None and value < minimum:
            self.error(where, f"must be at least {minimum:g}, got {_show(value)}")
            return None
        return float(value)

    def integer(self, data: Mapping[Any, Any], key: str, where: str,
                minimum: int) -> int | None:
        value = data.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            self.error(where, f"expected a whole number, got {_show(value)}")
            return None
        if value < minimum:
            self.error(where, f"must be at least {minimum}, got {value}")
            return None
        return value

    def state_name(self, value: Any, where: str) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            self.error(where, f"expected a state name, got {_show(value)}")
            return None
        return str(value)

    def unknown_keys(self, data: Mapping[Any, Any], known: tuple[str, ...], where: str,
                     what: str, *, left_out: Mapping[str, str] | None = None,
                     quiet: tuple[str, ...] = ()) -> None:
        for key in data:
            if key in known or key in quiet or (quiet and str(key).endswith("_ok")):
                continue
            if left_out and key in left_out:
                self.warn(_join(where, str(key)), f"'{key}': {left_out[key]} is not supported "
                                                  "here (ignored)")
            else:
                self.warn(_join(where, str(key)), f"unknown {what} key '{key}' (ignored)")

    # -- the format

    def loop(self, data: Any, default_name: str) -> LoopSpec | None:
        if not isinstance(data, Mapping):
            self.problems.append(Problem(
                "error", "", f"a loop file must be a mapping of keys, got {_kind(data)}",
                self.file, 1))
            return None
        self.note_lines("", data)
        for key in data:
            if not isinstance(key, str):
                self.warn(str(key), f"unknown key {key!r} (ignored)")
        self.unknown_keys({k: v for k, v in data.items() if isinstance(k, str)}, _LOOP_KEYS,
                          "", "loop", left_out=_LEFT_OUT_LOOP_KEYS, quiet=_QUIET_LOOP_KEYS)
        name = self.text(data, "name", "name") or default_name
        description = self.text(data, "description", "description")
        initial = self.state_name(data["initial"], "initial") if "initial" in data else None
        if initial is None and "initial" not in data:
            self.error("initial", "missing 'initial' (the state the loop starts in)")
        context = self.context(data.get("context"))
        max_iter = self.integer(data, "max_iterations", "max_iterations", 1)
        max_steps = self.integer(data, "max_steps", "max_steps", 1)
        if max_iter is not None and max_steps is not None and max_iter != max_steps:
            self.warn("max_steps", f"both max_iterations ({max_iter}) and max_steps "
                                   f"({max_steps}) are set; max_iterations wins")
        timeout = self.number(data, "timeout", "timeout", positive=True)
        default_timeout = self.number(data, "default_timeout", "default_timeout", positive=True)
        backoff = self.number(data, "backoff", "backoff", minimum=0)
        maintain = self.flag(data, "maintain", "maintain")
        llm = self.llm(data.get("llm"))
        states_data = data.get("states")
        if "flow" in data:
            if "states" in data:
                self.error("flow", "'flow' and 'states' are mutually exclusive (flow expands "
                                   "into states)")
            else:
                states_data = self.flow(data["flow"], data.get("state_defs"))
        elif "state_defs" in data:
            self.warn("state_defs", "state_defs is only used with 'flow' (ignored)")
        states = self.states(states_data, flow="flow" in data)
        parameters = self.parameters(data.get("parameters"), "parameters")
        input_key = self.text(data, "input_key", "input_key") or "input"
        required = data.get("required_inputs")
        if required is not None and (not isinstance(required, list) or not all(
                isinstance(k, str) for k in required)):
            self.error("required_inputs", f"expected a list of context keys, got "
                                          f"{_kind(required)}")
            required = None
        if "input_key" in data and required is None:
            self.warn("input_key", f"input_key without required_inputs: the run starts even "
                                   f"when '{input_key}' is empty")
        return LoopSpec(
            name=name, initial=initial or "", states=states, description=description,
            context=context,
            max_iterations=max_iter or max_steps or DEFAULT_MAX_ITERATIONS,
            timeout=timeout, default_timeout=default_timeout, backoff=backoff or 0.0,
            maintain=bool(maintain), llm=llm, parameters=parameters, input_key=input_key,
            required_inputs=tuple(required or ()), path=self.file, lines=self.lines)

    def parameters(self, data: Any, where: str) -> dict[str, ParamSpec]:
        """A `parameters:` block: name -> {type, required, default, description, values}."""
        if data is None:
            return {}
        if not isinstance(data, Mapping):
            self.error(where, f"expected a mapping of parameter name -> spec, got {_kind(data)}")
            return {}
        self.note_lines(where, data)
        out: dict[str, ParamSpec] = {}
        for key, body in data.items():
            at = _join(where, str(key))
            if not isinstance(body, Mapping):
                body = {"type": "string", "default": body}
            self.note_lines(at, body)
            self.unknown_keys(body, _PARAMETER_KEYS, at, "parameter")
            kind = self.text(body, "type", _join(at, "type")) or "string"
            if kind not in PARAMETER_TYPES:
                self.error(_join(at, "type"), f"unknown parameter type '{kind}' "
                                              f"(known: {', '.join(PARAMETER_TYPES)})")
                kind = "string"
            values = body.get("values")
            out[str(key)] = ParamSpec(
                type=kind, required=bool(self.flag(body, "required", _join(at, "required"))),
                default=body.get("default"),
                description=self.text(body, "description", _join(at, "description")),
                values=tuple(values) if isinstance(values, list) else None)
        return out

    def context(self, data: Any) -> dict[str, Any]:
        if data is None:
            return {}
        if not isinstance(data, Mapping):
            self.error("context", f"expected a mapping of variables, got {_kind(data)}")
            return {}
        self.note_lines("context", data)
        out: dict[str, Any] = {}
        for key, value in data.items():
            where = _join("context", str(key))
            if not isinstance(key, str) or not _NAME.match(key):
                self.error(where, f"{_show(key)} is not a valid variable name")
                continue
            out[key] = value
        return out

    def llm(self, data: Any) -> LLMSpec:
        spec = LLMSpec()
        if data is None:
            return spec
        if not isinstance(data, Mapping):
            self.error("llm", f"expected a mapping, got {_kind(data)}")
            return spec
        self.note_lines("llm", data)
        self.unknown_keys(data, _LLM_KEYS, "llm", "llm")
        enabled = self.flag(data, "enabled", "llm.enabled")
        spec.enabled = True if enabled is None else enabled
        spec.model = self.text(data, "model", "llm.model")
        spec.max_tokens = self.integer(data, "max_tokens", "llm.max_tokens", 1) or 256
        spec.timeout = self.number(data, "timeout", "llm.timeout", positive=True) or 120.0
        return spec

    def flow(self, flow: Any, defs: Any) -> Located | None:
        """Expand `flow:` (little-loops' linear shorthand) into a states mapping.

        Each entry is a state name (`next:` the following entry) or a branch
        `name?yes_state:no_state` (`on_yes`/`on_no`); the last entry is
        terminal. `state_defs:` bodies are deep-merged into the generated states.
        """
        if not isinstance(flow, list) or not flow:
            self.error("flow", f"expected a non-empty list of state names, got {_kind(flow)}")
            return None
        if defs is not None and not isinstance(defs, Mapping):
            self.error("state_defs", f"expected a mapping of state name -> state, "
                                     f"got {_kind(defs)}")
            defs = None
        if isinstance(defs, Mapping):
            self.note_lines("state_defs", defs)
        line = self.lines.get("flow")
        names = [e.partition("?")[0].strip() if isinstance(e, str) else "" for e in flow]
        out = Located()
        out.line = line
        for i, entry in enumerate(flow):
            where = f"flow.{i}"
            name = names[i]
            if not name:
                self.error(where, f"expected a state name, got {_show(entry)}")
                continue
            if name in out:
                self.error(where, f"state '{name}' appears twice in flow")
                continue
            body = Located()
            body.line = line
            _, branch, targets = str(entry).partition("?")
            if branch:
                yes, colon, no = (t.strip() for t in targets.partition(":"))
                if not colon or not yes or not no:
                    self.error(where, f"{_show(entry)}: a branch is written "
                                      "name?yes_state:no_state")
                    continue
                body.update(on_yes=yes, on_no=no)
            elif i + 1 < len(flow) and names[i + 1]:
                body["next"] = names[i + 1]
            if i == len(flow) - 1:
                body["terminal"] = True
            if defs is not None and name in defs and isinstance(defs[name], Mapping):
                body = deep_merge(body, defs[name])
            out[name] = body
            out.key_lines[name] = (defs.key_lines.get(name) if isinstance(defs, Located)
                                   else None) or line or 1
        unused = [k for k in (defs or {}) if str(k) not in out]
        for key in unused:
            self.warn(f"state_defs.{key}", f"'{key}' is not in flow (ignored)")
        return out

    def states(self, data: Any, *, flow: bool = False) -> dict[str, StateSpec]:
        if data is None:
            if not flow:
                self.error("states", "missing 'states' (a mapping of state name -> state)")
            return {}
        if not isinstance(data, Mapping) or not data:
            got = "an empty mapping" if isinstance(data, Mapping) else _kind(data)
            self.error("states", f"expected a non-empty mapping of state name -> state, got {got}")
            return {}
        self.note_lines("states", data)
        out: dict[str, StateSpec] = {}
        for key, body in data.items():
            name = str(key)
            where = _join("states", name)
            if isinstance(key, bool) or not isinstance(key, (str, int)) or not name.strip():
                self.error(where, f"{_show(key)} is not a valid state name")
                continue
            if name == CURRENT:
                self.error(where, f"'{CURRENT}' is reserved (it means 'this state' in routes)")
                continue
            out[name] = self.state(name, body, where)
        return out

    def state(self, name: str, data: Any, where: str) -> StateSpec:
        spec = StateSpec(name=name)
        if data is None:
            self.error(where, "the state is empty (give it an action, a route or terminal: true)")
            return spec
        if not isinstance(data, Mapping):
            self.error(where, f"a state must be a mapping, got {_kind(data)}")
            return spec
        self.note_lines(where, data)
        for key, value in data.items():
            if not isinstance(key, str):
                self.warn(_join(where, str(key)), f"unknown state key {key!r} (ignored)")
                continue
            if key.startswith("on_") and key not in _STATE_KEYS:
                verdict = key[3:]
                target = self.state_name(value, _join(where, key))
                if not verdict:
                    self.warn(_join(where, key), "'on_' names no verdict (ignored)")
                elif target is not None:
                    spec.on[verdict] = target
            elif key in _LEFT_OUT_STATE_KEYS:
                self.warn(_join(where, key), f"'{key}': {_LEFT_OUT_STATE_KEYS[key]} is not "
                                             "supported here (ignored)")
            elif key not in _STATE_KEYS:
                self.warn(_join(where, key), f"unknown state key '{key}' (ignored)")
        for alias, verdict in (("on_success", "yes"), ("on_failure", "no")):
            if alias in data:
                target = self.state_name(data[alias], _join(where, alias))
                if verdict in spec.on:
                    self.warn(_join(where, alias),
                              f"both {alias} and on_{verdict} are set; on_{verdict} wins")
                elif target is not None:
                    spec.on[verdict] = target
        spec.action = self.text(data, "action", _join(where, "action"))
        spec.action_type = self.text(data, "action_type", _join(where, "action_type"))
        if spec.action_type is not None and spec.action_type not in ACTION_TYPES:
            self.error(_join(where, "action_type"),
                       f"unknown action_type '{spec.action_type}' "
                       f"(known: {', '.join(ACTION_TYPES)})")
            spec.action_type = None
        spec.description = self.text(data, "description", _join(where, "description"))
        if "next" in data:
            spec.next = self.state_name(data["next"], _join(where, "next"))
        spec.terminal = bool(self.flag(data, "terminal", _join(where, "terminal")))
        failure = self.flag(data, "failure", _join(where, "failure"))
        if failure and not spec.terminal:
            self.warn(_join(where, "failure"), "failure only matters on a terminal state")
        spec.failure = spec.terminal and (failure if failure is not None
                                          else name in FAILURE_NAMES)
        capture = self.text(data, "capture", _join(where, "capture"))
        if capture is not None and not _NAME.match(capture):
            self.error(_join(where, "capture"), f"{capture!r} is not a valid capture name")
            capture = None
        spec.capture = capture
        spec.timeout = self.number(data, "timeout", _join(where, "timeout"), positive=True)
        spec.max_retries = self.integer(data, "max_retries", _join(where, "max_retries"), 0)
        for key in ("on_retry_exhausted", "on_maintain"):
            if key in data:
                setattr(spec, key, self.state_name(data[key], _join(where, key)))
        spec.loop = self.text(data, "loop", _join(where, "loop"))
        spec.context_passthrough = bool(
            self.flag(data, "context_passthrough", _join(where, "context_passthrough")))
        with_ = data.get("with")
        if with_ is not None and not isinstance(with_, Mapping):
            self.error(_join(where, "with"), f"expected a mapping of parameter -> value, "
                                             f"got {_kind(with_)}")
        elif with_ is not None:
            self.note_lines(_join(where, "with"), with_)
            spec.with_ = {str(k): v for k, v in with_.items()}
        if "fragment_name" in data:
            spec.fragment = str(data["fragment_name"])
            spec.fragment_params = self.parameters(data.get("fragment_parameters"),
                                                   _join(where, "fragment_parameters"))
        params = data.get("params")
        if params is not None:
            if isinstance(params, Mapping):
                self.note_lines(_join(where, "params"), params)
                spec.params = {str(k): v for k, v in params.items()}
            else:
                self.error(_join(where, "params"), f"expected a mapping, got {_kind(params)}")
        if "route" in data:
            spec.route = self.route(data["route"], _join(where, "route"))
        if "evaluate" in data:
            spec.evaluate = self.evaluate(data["evaluate"], _join(where, "evaluate"),
                                          default=_DEFAULT_EVALUATOR.get(spec.mode))
        return spec

    def route(self, data: Any, where: str) -> RouteSpec | None:
        if not isinstance(data, Mapping):
            self.error(where, f"expected a mapping of verdict -> state, got {_kind(data)}")
            return None
        self.note_lines(where, data)
        spec = RouteSpec()
        for key, value in data.items():
            verdict = _verdict_key(key)
            target = self.state_name(value, _join(where, str(key)))
            if target is None:
                continue
            if verdict in ("_", "default"):
                spec.default = target
            elif verdict == "_error":
                spec.error = target
            else:
                spec.table[verdict] = target
        return spec

    def evaluate(self, data: Any, where: str, *, default: str | None = None,
                 ) -> EvaluateSpec | None:
        if isinstance(data, str):
            data = {"type": data}
        if not isinstance(data, Mapping):
            self.error(where, f"expected a mapping with a 'type', got {_kind(data)}")
            return None
        self.note_lines(where, data)
        if str(data.get("type")) not in LEFT_OUT_EVALUATORS:
            self.unknown_keys(data, _EVALUATE_KEYS, where, "evaluate")
        kind = self.text(data, "type", _join(where, "type"))
        if kind is None and "type" not in data:
            # little-loops: the action type's default evaluator.
            kind = default
            if kind is None:
                self.error(_join(where, "type"), "missing 'type' (a state without a shell, "
                                                 "prompt or mcp_tool action has no default; "
                                                 f"one of: {', '.join(EVALUATORS)})")
                return None
        if kind is None:
            return None
        if kind in LEFT_OUT_EVALUATORS:
            self.warn(_join(where, "type"), f"'{kind}': {LEFT_OUT_EVALUATORS[kind]} is not "
                                            "supported here (a run judges it 'error')")
            return EvaluateSpec(type=kind)
        if kind not in EVALUATORS:
            self.error(_join(where, "type"),
                       f"unknown evaluator '{kind}' (known: {', '.join(EVALUATORS)})")
            return None
        spec = EvaluateSpec(type=kind)
        for key in ("source", "pattern", "path", "prompt", "previous"):
            setattr(spec, key, self.text(data, key, _join(where, key)))
        spec.target = data.get("target")
        spec.tolerance = data.get("tolerance")
        operator = self.text(data, "operator", _join(where, "operator"))
        if operator is not None and operator not in OPERATORS:
            self.error(_join(where, "operator"),
                       f"unknown operator '{operator}' (known: {', '.join(OPERATORS)})")
            operator = None
        spec.operator = operator
        direction = self.text(data, "direction", _join(where, "direction"))
        if direction is not None and direction not in DIRECTIONS:
            self.error(_join(where, "direction"),
                       f"unknown direction '{direction}' (known: minimize, maximize)")
        elif direction is not None:
            spec.direction = direction
        spec.negate = bool(self.flag(data, "negate", _join(where, "negate")))
        scope = data.get("scope")
        if isinstance(scope, str):
            scope = [scope]
        if scope is not None and (not isinstance(scope, list)
                                  or not all(isinstance(p, str) for p in scope)):
            self.error(_join(where, "scope"), f"expected a list of paths, got {_kind(scope)}")
        elif scope is not None:
            spec.scope = tuple(scope)
        max_stall = self.integer(data, "max_stall", _join(where, "max_stall"), 1)
        if max_stall is not None:
            spec.max_stall = max_stall
        patterns = data.get("error_patterns")
        if isinstance(patterns, str):
            patterns = [patterns]
        if patterns is not None and (not isinstance(patterns, list) or not all(
                isinstance(p, (str, int, float)) and not isinstance(p, bool) for p in patterns)):
            self.error(_join(where, "error_patterns"),
                       f"expected a list of text, got {_kind(patterns)}")
        elif patterns is not None:
            spec.error_patterns = tuple(str(p) for p in patterns)
        spec.uncertain_suffix = bool(
            self.flag(data, "uncertain_suffix", _join(where, "uncertain_suffix")))
        confidence = self.number(data, "min_confidence", _join(where, "min_confidence"),
                                 minimum=0)
        if confidence is not None:
            spec.min_confidence = confidence
        schema = data.get("schema")
        if schema is not None and not isinstance(schema, Mapping):
            self.error(_join(where, "schema"), f"expected a JSON schema mapping, "
                                               f"got {_kind(schema)}")
        elif schema is not None:
            spec.schema = dict(schema)
        return spec


#: The evaluator a state gets when `evaluate:` names no type (little-loops' defaults).
_DEFAULT_EVALUATOR = {"shell": "exit_code", "prompt": "llm_structured",
                      "mcp_tool": "mcp_result"}


def deep_merge(base: Mapping[Any, Any], over: Mapping[Any, Any]) -> Located:
    """`over` merged into `base`: mappings merge key by key, anything else is replaced.

    Key lines are kept from whichever side supplied the key (`over` wins).
    """
    out = Located()
    out.line = getattr(over, "line", None) or getattr(base, "line", None)
    for source in (base, over):
        lines = getattr(source, "key_lines", {})
        for key, value in source.items():
            if source is over and isinstance(value, Mapping) and isinstance(out.get(key),
                                                                            Mapping):
                out[key] = deep_merge(out[key], value)
            else:
                out[key] = value
            if key in lines:
                out.key_lines[key] = lines[key]
    return out


def parse_loop(data: Any, *, file: str = "", default_name: str = "loop",
               ) -> tuple[LoopSpec | None, list[Problem]]:
    """Build a `LoopSpec` from already-loaded YAML data; problems are returned, not raised."""
    parser = _Parser(file)
    spec = parser.loop(data, default_name)
    return spec, parser.problems


def _verdict_key(key: Any) -> str:
    # YAML 1.2 booleans only (see _yaml.py), but data built in code may still
    # use True/False for yes/no.
    if key is True:
        return "yes"
    if key is False:
        return "no"
    return str(key)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    return f"text {_show(value)}"


def _show(value: Any, limit: int = 40) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit] + "..."
