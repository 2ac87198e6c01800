"""Run specs: what to run and how, as plain data a host can store and read back.

A `RunSpec` says everything needed to start a run again in another process:
what to run (`CommandSpec`, `LoopSpec` or `AgentSpec`), the run's `RunInfo`
and `Limits`, how its ports were opened (`PortSpec`), and the working
directory. The checkpointer stores it (as JSON) when the run starts, so an
interrupted run can be rebuilt and resumed under the same run id.

**Versioning.** A stored spec carries `version`. Any change to the stored
shape (a field added, renamed, removed, or read differently) bumps
`SPEC_VERSION` and adds a step to `_UPGRADES` that turns a spec of the
version before into the new shape, so specs stored by older releases still
load. A spec with no `version` field was stored before versions were
written and is version 1. A spec newer than this code reads is refused
with one line saying so, never guessed at.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import field
from typing import Any, ClassVar, TypeAlias, Union

from ._dataclass import dataclass
from ._types import Limits, RunInfo
from .errors import ConfigError

#: The version of the stored shape this code writes (and the newest it reads).
SPEC_VERSION = 2

#: What an agent of kind "agent" may be (`AgentSpec.agent`).
AGENT_KINDS = ("llm", "agentcli", "pane", "claude", "codex", "gemini")


@dataclass(frozen=True, slots=True)
class CommandSpec:
    """A plain command, run as one step (`kernel run -- CMD`).

    Attributes:
        argv: The command and its arguments (not shell-split again); a list
            given here is kept as a tuple, so a spec equals its JSON round
            trip and hashes (`context` takes no part in the hash).
        context: Variables the command sees as `$KERNEL_CTX_KEY`.
    """

    kind: ClassVar[str] = "command"
    argv: tuple[str, ...]
    context: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        argv: Any = self.argv
        if isinstance(argv, list):  # (anything else is for `RunSpec.from_dict` to name)
            object.__setattr__(self, "argv", tuple(argv))


@dataclass(frozen=True, slots=True)
class LoopSpec:
    """A YAML state-machine loop (`kernel run LOOP.yaml`).

    Attributes:
        path: The loop file (absolute, so a resume elsewhere finds it).
        context: `--context` values; they override the file's `context`.
        scenario: Simulated verdicts for a dry run (None: a real run).
        model, base_url, api_key_env: What `llm_structured` evaluations ask
            (None: the file's `llm.model`, `$OPENAI_BASE_URL`, `OPENAI_API_KEY`).
        price: What that model costs: (input, output) US dollars per million
            tokens (None: what the server reports, else 0).
    """

    kind: ClassVar[str] = "loop"
    path: str
    context: Mapping[str, str] = field(default_factory=dict)
    scenario: str | None = None
    model: str | None = None
    base_url: str | None = None
    api_key_env: str | None = None
    price: tuple[float, ...] | None = None


@dataclass(frozen=True, slots=True)
class AgentSpec:
    """An agent adapter (`kernel run --agent KIND`).

    Attributes:
        agent: One of `AGENT_KINDS`: llm, agentcli, pane, claude, codex, gemini.
        model: The model (llm: required; claude/codex/gemini: optional).
        base_url: The API root (llm).
        prompt: The task.
        cmd: The agent's command line (agentcli).
        api_key_env: The variable holding the API key (llm).
        allow_shell: Give an llm agent the shell tool.
        context: Values for `${context.KEY}` in the prompt and command.
        target: The tmux pane (pane).
        max_turns: The agent's own turn limit (claude).
        price: What the model costs (llm): (input, output) US dollars per
            million tokens (None: what the server reports, else 0).
    """

    kind: ClassVar[str] = "agent"
    #: The values `agent` may take.
    KINDS: ClassVar[tuple[str, ...]] = AGENT_KINDS
    agent: str
    model: str | None = None
    base_url: str | None = None
    prompt: str | None = None
    cmd: str | None = None
    api_key_env: str | None = None
    allow_shell: bool = False
    context: Mapping[str, str] = field(default_factory=dict)
    target: str | None = None
    max_turns: int | None = None
    price: tuple[float, ...] | None = None


#: What a run spec may say to run.
WhatToRun: TypeAlias = CommandSpec | LoopSpec | AgentSpec


@dataclass(frozen=True, slots=True)
class PortSpec:
    """How a run's ports were opened (read by `batteries.runner.open_ports`).

    Attributes:
        db: The analysts' DuckDB file (its journal sits beside it); None: the default.
        no_audit: Record nothing (no audit, budget or checkpoints).
        no_critic: No critic: only the hard timeout ends a stuck run.
        soft_timeout, idle_timeout, model_timeout, tool_timeout: The critic's
            thresholds in seconds (None: its default; 0: that rule off).
        deliver_dir: Also write the result under this directory.
        webhooks: Also POST the result to these URLs.
        otlp: OTLP/HTTP endpoint for OpenTelemetry spans (None: the environment's).
    """

    db: str | None = None
    no_audit: bool = False
    no_critic: bool = False
    soft_timeout: float | None = None
    idle_timeout: float | None = None
    model_timeout: float | None = None
    tool_timeout: float | None = None
    deliver_dir: str | None = None
    webhooks: tuple[str, ...] = ()
    otlp: str | None = None


@dataclass(frozen=True, slots=True)
class RunSpec:
    """Everything needed to start a run again: what, who, bounds, ports, where.

    Attributes:
        agent: What to run.
        info: The run's description; a resumed run keeps its `run_id`.
        limits: The bounds it is held to.
        ports: How its ports were opened.
        cwd: The working directory its processes run in (None: the current one).
        redacted: Key paths of values replaced by a redaction marker when the
            spec was stored (secrets are never stored); a resume must be given
            them again. Empty for a spec that was never stored.
        batch: For a run of a stored batch (`kernel batch`): its `batch_id` and
            `task_id`; empty otherwise (and then not written).
        version: The stored shape's version (see the module docstring).

    `RunSpec.from_dict` / `from_json` validate: every problem is a
    `ConfigError` with one line naming the field (`run spec: limits.timeout
    must be ...`).
    """

    #: The version of the stored shape this code writes (and the newest it reads).
    LATEST_VERSION: ClassVar[int] = SPEC_VERSION
    agent: WhatToRun
    info: RunInfo = field(default_factory=RunInfo)
    limits: Limits = field(default_factory=Limits)
    ports: PortSpec = field(default_factory=PortSpec)
    cwd: str | None = None
    redacted: tuple[tuple[str | int, ...], ...] = ()
    batch: Mapping[str, str] = field(default_factory=dict)
    version: int = SPEC_VERSION

    @property
    def run_id(self) -> str:
        """The run's id (`info.run_id`)."""
        return self.info.run_id

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form that is stored (`from_dict` reads it back)."""
        what = _fields(self.agent)
        if isinstance(self.agent, CommandSpec):
            what["argv"] = list(self.agent.argv)
        ports = _fields(self.ports)
        ports["webhooks"] = list(self.ports.webhooks)
        doc = {"version": self.version,
               "agent": {"kind": self.agent.kind, **what},
               "info": _fields(self.info),
               "limits": _fields(self.limits),
               "ports": ports,
               "cwd": self.cwd,
               "redacted": [list(p) for p in self.redacted]}
        if self.batch:
            doc["batch"] = dict(self.batch)
        return doc

    def to_json(self) -> str:
        """`to_dict` as one line of JSON."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: Any) -> RunSpec:
        """Read a stored spec (any version up to `SPEC_VERSION`).

        Raises:
            ConfigError: One line naming the field that is missing, unknown
                or of the wrong type, or saying the version is newer than
                this code reads.
        """
        if not isinstance(data, Mapping):
            raise ConfigError(f"run spec: expected a JSON object, got {type(data).__name__}")
        data = dict(data)
        version = data.get("version", 1)  # specs stored before versions were written
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ConfigError(f"run spec: version must be a whole number >= 1, got {version!r}")
        if version > SPEC_VERSION:
            raise ConfigError(f"run spec: version {version} is newer than this kernel reads "
                              f"(up to {SPEC_VERSION}); upgrade the kernel to use it")
        for older in range(version, SPEC_VERSION):
            data = _UPGRADES[older](data)
        _known(data, ("version", "agent", "info", "limits", "ports", "cwd", "redacted", "batch"),
               "")
        if "agent" not in data:
            raise ConfigError("run spec: agent is missing")
        what = _what(data["agent"])
        info = _build(RunInfo, data.get("info") or {}, "info")
        limits = _build(Limits, data.get("limits") or {}, "limits")
        ports = _build(PortSpec, data.get("ports") or {}, "ports")
        cwd = _check(data.get("cwd"), str | None, "cwd")
        redacted = _check(data.get("redacted") or [], list, "redacted")
        paths: list[tuple[str | int, ...]] = []
        for i, path in enumerate(redacted):
            if not isinstance(path, list) or not all(
                    isinstance(p, (str, int)) and not isinstance(p, bool) for p in path):
                raise ConfigError(f"run spec: redacted[{i}] must be a list of keys and "
                                  f"indexes, got {path!r}")
            paths.append(tuple(path))
        batch = _check(data.get("batch") or {}, Mapping[str, str], "batch")
        return cls(agent=what, info=info, limits=limits, ports=ports, cwd=cwd,
                   redacted=tuple(paths), batch=batch, version=SPEC_VERSION)

    @classmethod
    def from_json(cls, text: str | bytes) -> RunSpec:
        """Read a spec from JSON text (`ConfigError` for malformed JSON or a bad field)."""
        try:
            data = json.loads(text)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"run spec: not valid JSON: {exc}") from None
        return cls.from_dict(data)


#: version -> a function turning a spec of that version into the next version's shape.
#: 1 -> 2: `price` was added to loop and agent specs (absent: None), so a version-1
#: spec already has the version-2 shape.
_UPGRADES: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: lambda data: data}

_KINDS: dict[str, type[CommandSpec] | type[LoopSpec] | type[AgentSpec]] = {
    "command": CommandSpec, "loop": LoopSpec, "agent": AgentSpec}


def _fields(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cls: Any = type(obj)
    for name in _names(cls):
        value = getattr(obj, name)
        out[name] = dict(value) if type(value) is dict or (
            not isinstance(value, (str, int, float, tuple)) and value is not None
            and isinstance(value, Mapping)) else value
    return out


@functools.cache
def _names(cls: Any) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


@functools.cache
def _allowed(cls: Any) -> frozenset[str]:
    return frozenset(_names(cls))


def _what(data: Any) -> WhatToRun:
    if not isinstance(data, Mapping):
        raise ConfigError(f"run spec: agent must be an object, got {type(data).__name__}")
    kind = data.get("kind")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ConfigError(f"run spec: agent.kind must be one of {', '.join(_KINDS)}, "
                          f"got {kind!r}")
    fields = {k: v for k, v in data.items() if k != "kind"}
    what: WhatToRun = _build(cls, fields, "agent")
    if isinstance(what, CommandSpec) and not what.argv:
        raise ConfigError("run spec: agent.argv must name a command")
    if isinstance(what, AgentSpec) and what.agent not in AGENT_KINDS:
        raise ConfigError(f"run spec: agent.agent must be one of {', '.join(AGENT_KINDS)}, "
                          f"got {what.agent!r}")
    return what


def _known(data: Mapping[str, Any], names: typing.Iterable[str], where: str) -> None:
    allowed = set(names)
    for key in data:
        if key not in allowed:
            raise ConfigError(f"run spec: unknown field {where}{key}")


@functools.cache
def _shape(cls: Any) -> tuple[tuple[str, Checker, bool], ...]:
    """`cls`'s fields as (name, the checker of its annotation, required), worked out
    once per class: resolving string annotations is ~0.4 ms a class (a batch of
    1,000 specs paid it 4,000 times), and walking an annotation with `typing` on
    every value was most of what reading a spec cost."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _checker(hints[f.name]),
                  f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                 for f in dataclasses.fields(cls))


def _build(cls: Any, data: Any, where: str) -> Any:
    """`cls(**data)` after checking every field's type against `cls`'s annotations."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"run spec: {where} must be an object, got {type(data).__name__}")
    shape = _shape(cls)
    allowed = _allowed(cls)
    for key in data:
        if key not in allowed:
            raise ConfigError(f"run spec: unknown field {where}.{key}")
    values: dict[str, Any] = {}
    for name, check, required in shape:
        if name not in data:
            if required:
                raise ConfigError(f"run spec: {where}.{name} is missing")
            continue
        values[name] = check(data[name], f"{where}.{name}")
    try:
        return cls(**values)
    except ConfigError as exc:  # Limits' own checks: name the field as the spec does
        raise ConfigError("run spec: " + str(exc).replace("Limits.", f"{where}.")) from None


#: Checks one value against one annotation: `(value, where) -> value`, converted where
#: JSON cannot say it (a float given as 3, a tuple given as a list); `ConfigError` if not.
Checker: TypeAlias = Callable[[Any, str], Any]


def _check(value: Any, tp: Any, where: str) -> Any:
    """`value` if it has type `tp` (as JSON gives it), converted where JSON cannot say it."""
    return _checker(tp)(value, where)


def _wrong(tp: Any) -> Callable[[Any, str], typing.NoReturn]:
    def wrong(value: Any, where: str) -> typing.NoReturn:
        raise ConfigError(f"run spec: {where} must be {_name(tp)}, got {value!r}")
    return wrong


@functools.cache
def _checker(tp: Any) -> Checker:
    """The checker of annotation `tp`, made once per annotation (see `_check`)."""
    wrong = _wrong(tp)
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        nullable = type(None) in typing.get_args(tp)
        options = tuple(_checker(t) for t in typing.get_args(tp) if t is not type(None))

        def union(value: Any, where: str) -> Any:
            if value is None and nullable:
                return None
            for option in options:
                try:
                    return option(value, where)
                except ConfigError:
                    continue
            wrong(value, where)
        return union
    if tp is Any:
        return lambda value, where: value
    if tp is bool:
        return lambda value, where: value if value is True or value is False \
            else wrong(value, where)
    if tp is int:
        return lambda value, where: value if type(value) is int or (
            isinstance(value, int) and not isinstance(value, bool)) else wrong(value, where)
    if tp is float:
        def number(value: Any, where: str) -> float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            wrong(value, where)
        return number
    if tp is str:
        return lambda value, where: value if isinstance(value, str) else wrong(value, where)
    if tp is list:
        return lambda value, where: value if isinstance(value, list) else wrong(value, where)
    if origin is tuple:
        (item_tp, _) = typing.get_args(tp)
        item = _checker(item_tp)

        def sequence(value: Any, where: str) -> tuple[Any, ...]:
            if isinstance(value, (list, tuple)):
                return tuple(item(v, f"{where}[{i}]") for i, v in enumerate(value))
            wrong(value, where)
        return sequence
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        values = _checker((typing.get_args(tp) or (str, Any))[1])

        def mapping(value: Any, where: str) -> dict[str, Any]:
            if not isinstance(value, Mapping):
                wrong(value, where)
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise ConfigError(f"run spec: {where} keys must be strings, got {k!r}")
                out[k] = values(v, f"{where}.{k}")
            return out
        return mapping

    def unknown(value: Any, where: str) -> Any:  # pragma: no cover - a type not taught
        raise TypeError(f"run spec reader cannot check {tp!r}")
    return unknown


def _name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_name(t) for t in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is tuple or tp is list:
        return "a list"
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        return "an object"
    return {bool: "true or false", int: "a whole number", float: "a number",
            str: "a string"}.get(tp, str(tp))
