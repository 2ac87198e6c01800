"""Agents the kernel can step (shell, loop, pane, llm, agentcli). Import kernel only.

`agent_from_spec` builds any of them from a `kernel.RunSpec` (see `adapters.specs`).
"""

from .specs import BuiltAgent as BuiltAgent
from .specs import agent_from_spec as agent_from_spec
from .specs import stop_leftover_group as stop_leftover_group

__all__ = ["BuiltAgent", "agent_from_spec", "stop_leftover_group"]
