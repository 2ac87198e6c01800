"""The values a run is made of: what goes in, what each step says, what comes out."""

from __future__ import annotations

import enum
import math
import operator
import os
import time
from collections.abc import Mapping
from dataclasses import field
from typing import Any

from ._dataclass import dataclass
from .errors import ConfigError


class Status(enum.StrEnum):
    """How a run ended. Exactly one per run (DESIGN.md "The run")."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    KILLED = "killed"
    CANCELLED = "cancelled"
    BUDGET_EXCEEDED = "budget_exceeded"
    MAX_STEPS = "max_steps"
    HANDOFF = "handoff"
    DRY_RUN = "dry_run"
    #: Never ended by a kernel: the supervising process died and the run
    #: cannot be resumed; `kernel recover` closes such runs with it.
    LOST = "lost"

    @property
    def exit_code(self) -> int:
        """The `kernel run` exit code for this status (a command's own code wins for ok/error)."""
        return _EXIT_CODES[self]


_EXIT_CODES: dict[Status, int] = {
    Status.OK: 0,
    Status.ERROR: 1,
    Status.TIMEOUT: 124,
    Status.KILLED: 137,
    Status.CANCELLED: 130,
    Status.BUDGET_EXCEEDED: 3,
    Status.MAX_STEPS: 4,
    Status.HANDOFF: 5,
    Status.DRY_RUN: 0,
    Status.LOST: 6,
}


def new_run_id() -> str:
    """A new run id: 32 hex digits, time-ordered (UUIDv7 layout) so ids sort by start."""
    # UUIDv7: 48 bits of unix milliseconds, then random bits. Time order makes
    # `kernel runs` and prefix abbreviation friendlier than uuid4.
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80 | (0x7 << 76) | (rand & ((1 << 76) - 1))
    value = (value & ~(0xC << 60)) | (0x8 << 60)  # RFC 4122 variant bits
    return f"{value:032x}"  # `uuid.UUID(int=value).hex`, without the object (~1 us)


@dataclass(slots=True)
class RunInfo:
    """Who and what a run is, known before it starts.

    Attributes:
        name: A human label ("nightly-lint", the command line, the loop name).
        run_id: Unique id; generated when not given. A resumed run keeps its id.
        subject_id: The agent, loop or skill being run (what analysts group by).
        caller_id: Who asked for the run; budgets are kept per caller.
        channel_id: Where the request came from (a chat channel, a CI job, ...).
        parent_run_id: The run that started this one, for sub-runs.
        inputs: The run's inputs (JSON-serialisable), recorded in the audit.

    Raises:
        ConfigError: A `run_id` that is not one safe file name (ids name folders,
            e.g. `DirectoryDelivery`'s): empty, `.` or `..`, containing `/`, a
            backslash or an unprintable character (a control character, a line
            break), or longer than `MAX_RUN_ID` characters.
    """

    name: str = ""
    run_id: str = field(default_factory=new_run_id)
    subject_id: str = ""
    caller_id: str = ""
    channel_id: str = ""
    parent_run_id: str | None = None
    inputs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rid = self.run_id
        # One test for the usual id (a generated one: 32 hex digits); the rest is
        # `run_id_problem`'s, only for an id that fails it.
        if not (type(rid) is str and 2 < len(rid) <= MAX_RUN_ID and rid.isprintable()
                and "/" not in rid and "\\" not in rid):
            problem = run_id_problem(rid)
            if problem is not None:
                raise ConfigError(f"RunInfo.run_id {problem}")


#: The longest run id `RunInfo` takes (a run id names files and folders).
MAX_RUN_ID = 200


def run_id_problem(run_id: object) -> str | None:
    """What makes `run_id` unusable as a run id, as the end of a sentence; None if nothing.

    A run id must be one safe path component: a non-empty string of at most
    `MAX_RUN_ID` printable characters, not `.` or `..`, without `/` or a backslash.
    """
    if not isinstance(run_id, str):
        return f"must be a string, got {type(run_id).__name__}"
    if not run_id:
        return "must not be empty"
    if run_id in (".", ".."):
        return f"must not be {run_id!r}"
    if len(run_id) > MAX_RUN_ID:
        return f"must be at most {MAX_RUN_ID} characters, got {len(run_id)}"
    if "/" in run_id or "\\" in run_id:
        return f"must not contain '/' or a backslash, got {run_id!r}"
    if not run_id.isprintable():
        return ("must not contain unprintable characters (control characters, line "
                f"breaks), got {run_id!r}")
    return None


@dataclass(slots=True, frozen=True)
class Limits:
    """The bounds a run is held to. Every bound is optional (None = no bound).

    Attributes:
        max_steps: The step ceiling; the critic may raise it. Reaching it ends `max_steps`.
        timeout: The hard deadline in seconds (the backstop); expiry ends `timeout`.
        soft_timeout: When the critic first judges the run (None: the critic's default).
        tool_timeout: Per tool call; a slow tool returns an error result, the run goes on.
        max_tool_calls, max_input_tokens, max_output_tokens, max_total_tokens, max_cost_usd:
            Per-run usage limits, checked after each step (the final one too: an
            answer over a cap ends `budget_exceeded`, its output kept) and when an
            agent reports usage mid-step; exceeding one ends `budget_exceeded`
            naming the limit.
        checkpoint_every_steps, checkpoint_every_seconds: Checkpoint throttle; a save
            happens once both that many steps and that many seconds have passed since
            the last one (the default: after every step).
        poll_interval: How often the kernel's watcher consults a critic handle that has no
            `next_look()`.
        finalize_timeout: Bound on the shielded end-of-run work (audit close, delivery, ...).
        dry_run: Simulate: the agent's `simulate(ctx)` is asked instead of `step(ctx)`.

    Raises:
        ConfigError: A count that is not a whole number >= 0 (a float, even 2.0, is
            refused; `checkpoint_every_steps` >= 1), a bound that is not > 0, or any
            NaN or infinite number (None, not infinity, means "no bound").
    """

    max_steps: int | None = 100
    timeout: float | None = 3600.0
    soft_timeout: float | None = None
    tool_timeout: float | None = 300.0
    max_tool_calls: int | None = None
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    max_total_tokens: int | None = None
    max_cost_usd: float | None = None
    checkpoint_every_steps: int = 1
    checkpoint_every_seconds: float = 0.0
    poll_interval: float = 0.5
    finalize_timeout: float = 30.0
    dry_run: bool = False

    def __post_init__(self) -> None:
        for name in ("max_steps", "max_tool_calls", "max_input_tokens", "max_output_tokens",
                     "max_total_tokens"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                _check_count("Limits", name, value, 0)
        if type(self.checkpoint_every_steps) is not int or self.checkpoint_every_steps < 1:
            _check_count("Limits", "checkpoint_every_steps", self.checkpoint_every_steps, 1)
        for name in ("timeout", "soft_timeout", "tool_timeout", "max_cost_usd"):
            value = getattr(self, name)
            if value is not None and not _positive(value):
                _check_number("Limits", name, value)
                raise ConfigError(f"Limits.{name} must be > 0 or None, got {value}")
        value = self.checkpoint_every_seconds
        if not (_finite(value) and value >= 0):
            _check_number("Limits", "checkpoint_every_seconds", value)
            raise ConfigError(f"Limits.checkpoint_every_seconds must be >= 0, got {value}")
        for name in ("poll_interval", "finalize_timeout"):
            value = getattr(self, name)
            if not _positive(value):
                _check_number("Limits", name, value)
                raise ConfigError(f"Limits.{name} must be > 0, got {value}")


@dataclass(slots=True, frozen=True)
class UsageLimits:
    """Per-run usage caps a `Budget` hands the kernel for one run (None = no cap).

    Exceeding any of them, checked after each step (the final one too), ends
    the run `budget_exceeded` naming the limit; `max_runtime_seconds` cuts
    the run when it runs out, in the middle of a step if need be. They
    combine with the same-named `Limits` fields: the tighter one wins.
    Unlike `Limits.max_steps` (the step ceiling, status `max_steps`) and
    `Limits.timeout` (the backstop, status `timeout`), `max_steps` and
    `max_runtime_seconds` here are budget caps: running out of them is
    `budget_exceeded`.

    Raises:
        ConfigError: A count that is not a whole number >= 0, or an amount that is
            negative, NaN or infinite (0 is a cap: nothing left; None is no cap).
    """

    max_steps: int | None = None
    max_tool_calls: int | None = None
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    max_total_tokens: int | None = None
    max_cost_usd: float | None = None
    max_runtime_seconds: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_steps", "max_tool_calls", "max_input_tokens", "max_output_tokens",
                     "max_total_tokens"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 0):
                _check_count("UsageLimits", name, value, 0)
        for name in ("max_cost_usd", "max_runtime_seconds"):
            value = getattr(self, name)
            # 0 is a cap (a budget used up), not "no cap": only None is.
            if value is not None and not (_finite(value) and value >= 0):
                _check_number("UsageLimits", name, value)
                raise ConfigError(f"UsageLimits.{name} must be >= 0 or None, got {value}")


def _check_count(owner: str, name: str, value: object, least: int) -> None:
    """Raise `ConfigError` unless `value` is a whole number >= `least` (an `int`, or
    anything with `__index__` but a bool: never a float, even 2.0, as the spec reader)."""
    if not isinstance(value, bool) and not isinstance(value, float):
        try:
            number = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            if number >= least:
                return
    raise ConfigError(f"{owner}.{name} must be a whole number >= {least}"
                      f"{'' if least else ' or None'}, got {value!r}")


def _check_number(owner: str, name: str, value: object) -> None:
    """Raise `ConfigError` unless `value` is a finite real number."""
    if not _finite(value):
        shown = value if isinstance(value, (int, float)) else repr(value)
        raise ConfigError(f"{owner}.{name} must be a finite number, got {shown}")


def _finite(value: object) -> bool:
    """True for a real number (not a bool) that is neither NaN nor infinite."""
    if type(value) is float:
        return value - value == 0.0  # False for NaN and for either infinity
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _positive(value: object) -> bool:
    """True for a finite real number > 0."""
    return _finite(value) and value > 0  # type: ignore[operator]


@dataclass(slots=True, frozen=True)
class Usage:
    """Resources a step (or a whole run) consumed. Adding two Usages sums them."""

    input_tokens: int = 0
    output_tokens: int = 0
    thinking_tokens: int = 0
    cost_usd: float = 0.0

    @property
    def total_tokens(self) -> int:
        """Input + output + thinking tokens."""
        return self.input_tokens + self.output_tokens + self.thinking_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.thinking_tokens + other.thinking_tokens,
            self.cost_usd + other.cost_usd,
        )

    def __bool__(self) -> bool:
        return bool(self.input_tokens or self.output_tokens or self.thinking_tokens
                    or self.cost_usd)


@dataclass(slots=True, frozen=True)
class Message:
    """One conversational message (a steer nudge arrives as role "user")."""

    role: str
    content: str


@dataclass(slots=True, frozen=True)
class ToolCall:
    """A request from the agent to run the tool `name` with keyword `args`."""

    name: str
    args: Mapping[str, Any] = field(default_factory=dict)
    id: str = ""


@dataclass(slots=True, frozen=True)
class ToolResult:
    """What a tool call produced. `error` is set (and `output` empty) when it failed."""

    call: ToolCall
    output: Any = None
    error: str | None = None
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True when the tool returned without raising or timing out."""
        return self.error is None


@dataclass(slots=True, frozen=True)
class Step:
    """What one agent step reports back to the kernel.

    Attributes:
        output: The step's output; the final step's output is the run's output.
        final: True ends the run (status ok, or error/handoff as below).
        tool_calls: Tools the kernel should run before the next step.
        usage: Tokens/cost this step consumed (for budgets and the audit).
        error: With `final=True`, ends the run `error` with this message
            (a failed command, no valid transition) without raising.
        handoff: With `final=True`, ends the run `handoff`; the continuation prompt.
        stop: With `final=True`, ends the run `cancelled` with this reason (the
            agent itself asked to stop, e.g. a loop's `LOOP_STOP:` signal).
        kill: With `final=True`, ends the run `killed` with this reason: the
            agent's own watchdog stopped what it supervises (an idle CLI).
            `error` may add the detail.
        exit_code: The agent's own exit code, when it has one (commands).
        name: A label for the step in the audit (an FSM state, "turn").
        payload: Extra JSON-serialisable detail for the audit `step` event.
        message: What the agent said this step, as text (an LLM's reply; ""
            for a reply with no text), for the critic: the same message over
            and over, or an empty answer, is a sign of a stuck agent. None
            when the agent has no messages (a command, a state machine).
        artifacts: Named files the step produced (name -> text or bytes); the
            run's artifacts are all its steps' artifacts, later names winning.
    """

    output: Any = None
    final: bool = False
    tool_calls: tuple[ToolCall, ...] | list[ToolCall] = ()
    usage: Usage | None = None
    error: str | None = None
    handoff: str | None = None
    stop: str | None = None
    kill: str | None = None
    exit_code: int | None = None
    name: str | None = None
    payload: Mapping[str, Any] | None = None
    artifacts: Mapping[str, str | bytes] | None = None
    message: str | None = None


@dataclass(slots=True)
class RunStats:
    """The terminal roll-up of a run, handed to `RunRecorder.close`."""

    status: Status
    output: Any = None
    error: str | None = None
    reason: str | None = None
    steps: int = 0
    tool_calls: int = 0
    runtime_seconds: float = 0.0
    usage: Usage = field(default_factory=Usage)
    exit_code: int | None = None


@dataclass(slots=True, frozen=True)
class PortFailure:
    """A port method that raised during a run. The run went on (or failed closed)."""

    port: str
    method: str
    error: str

    def __str__(self) -> str:
        return f"{self.port}.{self.method}: {self.error}"


@dataclass(slots=True)
class Result:
    """How a run ended and what it produced.

    Attributes:
        status: Exactly one `Status`.
        output: The final step's output (None if the run did not finish).
        error: What went wrong, for error/budget_exceeded/... statuses.
        reason: Why a killed/timeout/max_steps/budget_exceeded run was ended.
        traceback: The agent's traceback when it raised.
        run_id, name: From the RunInfo.
        steps, tool_calls: How many were executed.
        usage: Summed usage of all steps.
        runtime_seconds: Wall time (trio clock) from start to end.
        exit_code: The agent's own exit code (commands), else None.
        port_failures: Ports that raised; observers never change the status.
        artifacts: Named files the run produced (from its steps), for delivery.
    """

    status: Status
    run_id: str
    name: str = ""
    output: Any = None
    error: str | None = None
    reason: str | None = None
    traceback: str | None = None
    steps: int = 0
    tool_calls: int = 0
    usage: Usage = field(default_factory=Usage)
    runtime_seconds: float = 0.0
    exit_code: int | None = None
    port_failures: list[PortFailure] = field(default_factory=list)
    artifacts: dict[str, str | bytes] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when the run ended `ok`."""
        return self.status is Status.OK

    def stats(self) -> RunStats:
        """The roll-up a recorder stores."""
        return RunStats(
            status=self.status, output=self.output, error=self.error, reason=self.reason,
            steps=self.steps, tool_calls=self.tool_calls,
            runtime_seconds=self.runtime_seconds, usage=self.usage, exit_code=self.exit_code,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what `kernel run --json` prints)."""
        return {
            "run_id": self.run_id,
            "name": self.name,
            "status": str(self.status),
            "exit_code": self.exit_code,
            "output": _jsonable(self.output),
            "error": self.error,
            "reason": self.reason,
            "traceback": self.traceback,
            "steps": self.steps,
            "tool_calls": self.tool_calls,
            "runtime_seconds": round(self.runtime_seconds, 6),
            "usage": {
                "input_tokens": self.usage.input_tokens,
                "output_tokens": self.usage.output_tokens,
                "thinking_tokens": self.usage.thinking_tokens,
                "cost_usd": self.usage.cost_usd,
            },
            "port_failures": [str(f) for f in self.port_failures],
            "artifacts": sorted(self.artifacts),
        }


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool, list, dict)):
        return value
    return str(value)
