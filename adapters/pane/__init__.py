"""Pane actions: probe and act on agents living in terminal panes (tmux), with a record.

Coding agents in tmux panes (Claude Code, Codex, aider) are driven by typing.
An action — `nonce-probe` ("are you answering?") or `compact` ("shrink your
context") — is four small methods on a `PaneAction`; the engine runs one
attempt of it and classifies it with one of five outcomes (`Outcome`).
Run as a kernel run, each attempt is one `attempt` audit event::

    from adapters.pane import ActionAgent, NonceProbe, TmuxMultiplexer

    agent = ActionAgent(NonceProbe(), TmuxMultiplexer(), "dev:0.0", timeout=30)
    result = await Kernel(ports).run(agent, agent.run_info(), agent.limits())
    print(agent.attempt.outcome)        # success | completion_timeout | ...

`adapters.pane.testing` has a fake multiplexer for tests in virtual time.
"""

from ._actions import ACTIONS as ACTIONS
from ._actions import Compact as Compact
from ._actions import NonceProbe as NonceProbe
from ._actions import make_action as make_action
from ._agent import ActionAgent as ActionAgent
from ._agent import run_action as run_action
from ._engine import ActionContext as ActionContext
from ._engine import Attempt as Attempt
from ._engine import Outcome as Outcome
from ._engine import PaneAction as PaneAction
from ._engine import cap_snapshot as cap_snapshot
from ._engine import run_attempt as run_attempt
from ._engine import snapshot_chars as snapshot_chars
from ._errors import MultiplexerError as MultiplexerError
from ._errors import PaneError as PaneError
from ._errors import PaneLockError as PaneLockError
from ._liveness import BUSY_MARKERS as BUSY_MARKERS
from ._liveness import ProbeState as ProbeState
from ._liveness import classify_probe as classify_probe
from ._liveness import generate_nonce as generate_nonce
from ._liveness import has_nonce_echo as has_nonce_echo
from ._liveness import is_approval_prompt as is_approval_prompt
from ._liveness import is_busy as is_busy
from ._liveness import pane_tail as pane_tail
from ._liveness import read_context_pct as read_context_pct
from ._mux import Multiplexer as Multiplexer
from ._mux import TargetState as TargetState
from ._mux import TargetStatus as TargetStatus
from ._mux import TmuxMultiplexer as TmuxMultiplexer
from ._pane_agent import PaneAgent as PaneAgent

__all__ = [
    "ACTIONS",
    "BUSY_MARKERS",
    "ActionAgent",
    "ActionContext",
    "Attempt",
    "Compact",
    "Multiplexer",
    "MultiplexerError",
    "NonceProbe",
    "Outcome",
    "PaneAction",
    "PaneAgent",
    "PaneError",
    "PaneLockError",
    "ProbeState",
    "TargetState",
    "TargetStatus",
    "TmuxMultiplexer",
    "cap_snapshot",
    "classify_probe",
    "generate_nonce",
    "has_nonce_echo",
    "is_approval_prompt",
    "is_busy",
    "make_action",
    "pane_tail",
    "read_context_pct",
    "run_action",
    "run_attempt",
    "snapshot_chars",
]
