"""The per-agent runtime state machine: what a CLI agent is doing, and is it alive.

Two orthogonal views. `State` answers "what is the agent doing right now"
(substate within a live process); `Lifecycle` answers "is the process alive,
and in what shape"::

    State (driven by events)                 Lifecycle
    ------------------------                 ---------
    thinking     -> THINKING                 (new)      -> SPAWNING  mark_spawning()
    text_delta   -> RESPONDING               SPAWNING   -> WORKING   the first event of any type
    tool_use     -> RUNNING_TOOL             WORKING    -> IDLE      done / error
    tool_result  -> THINKING                 IDLE       -> WORKING   the next turn's event
    approval     -> WAITING_APPROVAL         any        -> KILLED    mark_killed() (exit, TTL, stop)
      (denied: unchanged)                    KILLED     -> SPAWNING  mark_spawning() only
    done, error  -> IDLE
    session_start, warning, retry, info, unknown -> unchanged

Warnings and retries are turn events (a CLI retrying after an error is
working again); info and unknown only prove the process is alive.

Transitions are lenient on purpose: real CLIs reorder events (a text delta
before the session start, a tool result before its tool use), so no event is
ever rejected. An event the machine does not know keeps the state (and the
lifecycle, except that it ends SPAWNING: the process is evidently up) but
still bumps `last_active`, because output means the agent is not idle. Once
KILLED, late events (buffered output read after the exit) only bump
`last_active`: a dead process does not come back until `mark_spawning`.

Time comes from an injected clock (`now`), so tests are deterministic and
the adapter can use trio's clock. The machine is not thread-safe: use it
from one thread (the trio thread).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

from ._events import AgentEvent, EventType


class State(enum.StrEnum):
    """What the agent is doing inside a live process."""

    IDLE = "idle"
    THINKING = "thinking"
    RUNNING_TOOL = "running_tool"
    RESPONDING = "responding"
    WAITING_APPROVAL = "waiting_for_approval"


class Lifecycle(enum.StrEnum):
    """Whether the agent's process is alive, and in what shape."""

    SPAWNING = "spawning"
    WORKING = "working"
    IDLE = "idle"
    KILLED = "killed"


_STATE_ON: dict[EventType, State] = {
    EventType.THINKING: State.THINKING,
    EventType.TEXT_DELTA: State.RESPONDING,
    EventType.TOOL_USE: State.RUNNING_TOOL,
    EventType.TOOL_RESULT: State.THINKING,
    EventType.DONE: State.IDLE,
    EventType.ERROR: State.IDLE,
}

_TURN_EVENTS = frozenset({EventType.SESSION_START, EventType.THINKING, EventType.TEXT_DELTA,
                          EventType.TOOL_USE, EventType.TOOL_RESULT, EventType.APPROVAL,
                          EventType.WARNING, EventType.RETRY})
_END_EVENTS = frozenset({EventType.DONE, EventType.ERROR})


@dataclass(slots=True, frozen=True)
class Transition:
    """What one `apply` did: the event type and the views before and after."""

    event: EventType
    state_from: State
    state_to: State
    lifecycle_from: Lifecycle
    lifecycle_to: Lifecycle

    @property
    def changed(self) -> bool:
        """True when the state or the lifecycle changed."""
        return self.state_from is not self.state_to or self.lifecycle_from is not self.lifecycle_to


class StateMachine:
    """Follows one CLI agent's events; asked by the idle timer, the audit and the UI.

    A new machine is IDLE with lifecycle SPAWNING and no `last_active` yet.

    Args:
        now: The clock (seconds, monotonic). Default `time.monotonic`; the
            adapter passes `trio.current_time`, tests a fake.
    """

    def __init__(self, now: Callable[[], float] | None = None) -> None:
        self._now = now if now is not None else time.monotonic
        self._state = State.IDLE
        self._lifecycle = Lifecycle.SPAWNING
        self._last_active: float | None = None

    def __repr__(self) -> str:
        return f"StateMachine(state={self._state}, lifecycle={self._lifecycle})"

    @property
    def state(self) -> State:
        """The current state."""
        return self._state

    @property
    def lifecycle(self) -> Lifecycle:
        """The current lifecycle."""
        return self._lifecycle

    @property
    def last_active(self) -> float | None:
        """When the last event was applied (or the process spawned); None before either."""
        return self._last_active

    def idle_for(self) -> float:
        """Seconds since `last_active` (0 when nothing happened yet)."""
        return 0.0 if self._last_active is None else max(0.0, self._now() - self._last_active)

    def apply(self, event: AgentEvent | EventType) -> Transition:
        """Move on one event and return what changed. Never rejects an event."""
        kind = event.type if isinstance(event, AgentEvent) else EventType(event)
        s0, l0 = self._state, self._lifecycle
        self._last_active = self._now()
        if l0 is not Lifecycle.KILLED:
            if kind is EventType.APPROVAL:
                denied = isinstance(event, AgentEvent) and event.is_error
                self._state = s0 if denied else State.WAITING_APPROVAL
            else:
                self._state = _STATE_ON.get(kind, s0)
            if kind in _END_EVENTS:
                self._lifecycle = Lifecycle.IDLE
            elif kind in _TURN_EVENTS or l0 is Lifecycle.SPAWNING:
                self._lifecycle = Lifecycle.WORKING
        return Transition(kind, s0, self._state, l0, self._lifecycle)

    def mark_idle(self) -> None:
        """Force the state back to IDLE without touching `last_active` (after a kill)."""
        self._state = State.IDLE

    def mark_killed(self) -> None:
        """The process is gone (exit, crash, idle TTL, stop), whatever the reason."""
        self._lifecycle = Lifecycle.KILLED

    def mark_spawning(self) -> None:
        """A (new) process is starting: SPAWNING, IDLE, and the idle clock restarts. Idempotent."""
        self._lifecycle = Lifecycle.SPAWNING
        self._state = State.IDLE
        self._last_active = self._now()
