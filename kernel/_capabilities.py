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

import types
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from ._dataclass import dataclass
from ._types import Message, Step, ToolResult

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
    """What a critic handle offers beyond `CriticHandle`: `SupportsToolEnd`, ...

    Each member is called with the handle first (`caps.next_look(handle)`).
    For a handle whose members resolve on its class (no instance `__dict__`,
    plain functions, no custom attribute lookup) they are the class's own
    functions and one `HandleCapabilities` serves every handle of the class:
    no bound method is made per run (at 10,000 concurrent runs each object a
    run keeps is work for the garbage collector's full passes). Any other
    handle's members are read from the handle, once, as before.
    """

    record_tool_end: Callable[[Any, ToolResult], None] | None = None
    record_process: Callable[[Any, int], None] | None = None
    record_process_exit: Callable[[Any, int], None] | None = None
    next_look: Callable[[Any], float | None] | None = None
    attach: Callable[[Any, Callable[[], None]], None] | None = None
    step_ended: Callable[[Any, int, Step, float], bool | None] | None = None
    problem: str | None = None


NO_HANDLE = HandleCapabilities()

_HANDLE_MEMBERS = ("record_tool_end", "record_process", "record_process_exit", "next_look",
                   "attach", "step_ended")
# Handle classes whose members resolve on the class, with their capabilities.
_BY_CLASS: weakref.WeakKeyDictionary[type, HandleCapabilities] = weakref.WeakKeyDictionary()


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
    if not (tools or on_steer or snapshot or simulate or problem):
        return NO_AGENT  # the usual agent: one shared object, not one per run
    return AgentCapabilities(tools, on_steer, snapshot, simulate, problem)


NO_AGENT = AgentCapabilities({}, None, None, None)


def handle_capabilities(handle: object) -> HandleCapabilities:
    """Look up a critic handle's optional capabilities once (per class when they resolve there)."""
    cls = type(handle)
    caps = _BY_CLASS.get(cls)
    if caps is not None:
        return caps
    if (not hasattr(handle, "__dict__") and cls.__getattribute__ is object.__getattribute__
            and getattr(cls, "__getattr__", None) is None):
        members = [getattr(cls, name, None) for name in _HANDLE_MEMBERS]
        if all(m is None or isinstance(m, types.FunctionType) for m in members):
            caps = _BY_CLASS[cls] = HandleCapabilities(*members)
            return caps
    found, problem = _callables(handle, "critic handle", _HANDLE_MEMBERS)
    tool_end, process, process_exit, next_look, attach, step_ended = map(_handle_first, found)
    return HandleCapabilities(tool_end, process, process_exit, next_look, attach, step_ended,
                              problem)


def _handle_first(member: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """`member` (of one handle) called the way class functions are: handle first."""
    if member is None:
        return None

    def call(_handle: Any, *args: Any) -> Any:
        return member(*args)

    return call
