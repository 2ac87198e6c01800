"""The optional capabilities of an agent and of a critic handle, looked up one way.

Each capability is a Protocol in `ports.py` (`SupportsTools`, ...). The
kernel does not `isinstance` against them per run (a runtime-checkable
Protocol check costs microseconds); it reads each member once, when a run
starts (agent) or its critic handle is made (handle), here and nowhere
else. A member that is None counts as absent, as it does for the Protocol's
users who check `getattr(obj, name, None)`. A member that is present but
malformed is reported as a `problem` naming the object, and the caller
decides: an agent's ends the run `error`, a handle's drops the critic.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from ._dataclass import dataclass
from ._types import Message, ToolResult

if TYPE_CHECKING:
    from ._context import RunContext
    from .ports import Tool


@dataclass(slots=True, frozen=True)
class AgentCapabilities:
    """What an agent offers beyond `step`: `SupportsTools`, `SupportsSteer`, ..."""

    tools: Mapping[str, Tool]
    on_steer: Callable[[list[Message]], Awaitable[None]] | None
    snapshot: Callable[[], Any] | None
    simulate: Callable[[RunContext], Awaitable[Any]] | None
    problem: str | None = None


@dataclass(slots=True, frozen=True)
class HandleCapabilities:
    """What a critic handle offers beyond `CriticHandle`: `SupportsToolEnd`, ..."""

    record_tool_end: Callable[[ToolResult], None] | None = None
    record_process: Callable[[int], None] | None = None
    record_process_exit: Callable[[int], None] | None = None
    next_look: Callable[[], float | None] | None = None
    attach: Callable[[Callable[[], None]], None] | None = None
    problem: str | None = None


NO_HANDLE = HandleCapabilities()


def _callables(obj: object, who: str, names: tuple[str, ...]) -> tuple[list[Any], str | None]:
    """`obj`'s members `names` (None where absent), and the first that is not callable."""
    found: list[Any] = []
    problem = None
    for name in names:
        member = getattr(obj, name, None)
        if member is not None and not callable(member):
            problem = problem or (f"{who} {type(obj).__name__}.{name} is "
                                  f"{type(member).__name__}, not callable")
            member = None
        found.append(member)
    return found, problem


def agent_capabilities(agent: object) -> AgentCapabilities:
    """Look up `agent`'s optional capabilities once."""
    (on_steer, snapshot, simulate), problem = _callables(
        agent, "agent", ("on_steer", "snapshot", "simulate"))
    tools = getattr(agent, "tools", None)
    if tools is None:
        tools = {}
    elif not isinstance(tools, Mapping):
        problem = problem or (f"agent {type(agent).__name__}.tools is "
                              f"{type(tools).__name__}, not a mapping of name to tool")
        tools = {}
    return AgentCapabilities(tools, on_steer, snapshot, simulate, problem)


def handle_capabilities(handle: object) -> HandleCapabilities:
    """Look up a critic handle's optional capabilities once."""
    (tool_end, process, process_exit, next_look, attach), problem = _callables(
        handle, "critic handle",
        ("record_tool_end", "record_process", "record_process_exit", "next_look", "attach"))
    return HandleCapabilities(tool_end, process, process_exit, next_look, attach, problem)
