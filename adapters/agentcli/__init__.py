"""CLI coding agents (Claude Code, Codex, ...) as supervised subprocesses.

The agent's JSON-lines stream is parsed into events (`parse_line`) that drive
a runtime `StateMachine` (state idle/thinking/running_tool/responding;
lifecycle spawning/working/idle/killed), feed the critic, and are audited::

    from adapters.agentcli import CLIAgent

    agent = CLIAgent(["claude", "-p", "Fix the failing test",
                      "--output-format", "stream-json", "--verbose"], idle_ttl=300)
    result = await Kernel(ports).run(agent, RunInfo(name="fix-test"))

    # or a known client's non-interactive mode, resumable by its session id:
    agent = preset("claude", "Fix the failing test", model="claude-sonnet-4-5")
"""

from typing import TYPE_CHECKING

from kernel._renamed import renamed

from ._agent import CLIAgent as CLIAgent
from ._agent import EventHook as EventHook
from ._agent import SessionCLIAgent as SessionCLIAgent
from ._events import AgentEvent as AgentEvent
from ._events import EventType as EventType
from ._events import parse_event as parse_event
from ._events import parse_line as parse_line
from ._presets import CLIENTS as CLIENTS
from ._presets import preset as preset
from ._state import Lifecycle as Lifecycle
from ._state import State as State
from ._state import StateMachine as StateMachine
from ._state import Transition as Transition

__all__ = [
    "CLIENTS",
    "AgentEvent",
    "CLIAgent",
    "EventHook",
    "EventType",
    "Lifecycle",
    "SessionCLIAgent",
    "State",
    "StateMachine",
    "Transition",
    "parse_event",
    "parse_line",
    "preset",
]


# Names renamed in 0.2 (see README, "Renamed names"): still importable for one
# release, with a DeprecationWarning; type checkers see them as plain aliases.
if TYPE_CHECKING:
    AgentCLI = CLIAgent
    SessionAgentCLI = SessionCLIAgent


__getattr__ = renamed(__name__, {"AgentCLI": "CLIAgent", "SessionAgentCLI": "SessionCLIAgent"},
                      globals())
