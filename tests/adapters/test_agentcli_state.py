"""The CLI agent's runtime state machine, driven with an injected clock."""

from __future__ import annotations

import pytest

from adapters.agentcli import AgentEvent, EventType, Lifecycle, State, StateMachine


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def machine_in(state: State, clock: FakeClock | None = None) -> StateMachine:
    """A working machine whose state is `state`."""
    m = StateMachine(clock or FakeClock())
    m.mark_spawning()
    lead = {State.IDLE: EventType.SESSION_START, State.THINKING: EventType.THINKING,
            State.RUNNING_TOOL: EventType.TOOL_USE, State.RESPONDING: EventType.TEXT_DELTA,
            State.WAITING_APPROVAL: EventType.APPROVAL}
    m.apply(lead[state])
    assert (m.state, m.lifecycle) == (state, Lifecycle.WORKING)
    return m


def state_of(m: StateMachine) -> State:
    """The machine's state, read afresh (keeps type checkers from over-narrowing)."""
    return m.state


# What each event does to the state, whatever the state was (None = unchanged).
STATE_AFTER: dict[EventType, State | None] = {
    EventType.SESSION_START: None,
    EventType.THINKING: State.THINKING,
    EventType.TEXT_DELTA: State.RESPONDING,
    EventType.TOOL_USE: State.RUNNING_TOOL,
    EventType.TOOL_RESULT: State.THINKING,
    EventType.DONE: State.IDLE,
    EventType.ERROR: State.IDLE,
    EventType.APPROVAL: State.WAITING_APPROVAL,
    EventType.WARNING: None,
    EventType.RETRY: None,
    EventType.INFO: None,
    EventType.UNKNOWN: None,
}


class TestStateTransitions:
    """Every event from every state."""

    def test_a_new_machine_is_idle_and_spawning(self) -> None:
        """A fresh machine is IDLE, SPAWNING, and has never been active."""
        m = StateMachine(FakeClock())
        assert (m.state, m.lifecycle, m.last_active) == (State.IDLE, Lifecycle.SPAWNING, None)
        assert m.idle_for() == 0.0

    @pytest.mark.parametrize("start", list(State))
    @pytest.mark.parametrize("event", list(EventType))
    def test_every_event_from_every_state(self, start: State, event: EventType) -> None:
        """The event's target state is reached from any state; neutral events keep it."""
        m = machine_in(start)
        tr = m.apply(AgentEvent(event))
        expected = STATE_AFTER[event] or start
        assert m.state is expected
        assert (tr.event, tr.state_from, tr.state_to) == (event, start, expected)

    def test_a_denied_approval_keeps_the_state(self) -> None:
        """An approval the CLI denied by itself is not a wait for a person."""
        m = machine_in(State.RUNNING_TOOL)
        m.apply(AgentEvent(EventType.APPROVAL, is_error=True))
        assert m.state is State.RUNNING_TOOL

    def test_a_retry_after_an_error_is_working_again(self) -> None:
        """A CLI retrying by itself after an error event is back to WORKING, not idle."""
        m = machine_in(State.THINKING)
        m.apply(EventType.ERROR)
        assert m.lifecycle is Lifecycle.IDLE
        m.apply(EventType.RETRY)
        assert (state_of(m), m.lifecycle) == (State.IDLE, Lifecycle.WORKING)

    def test_apply_takes_event_types_and_their_names(self) -> None:
        """apply accepts an AgentEvent, an EventType, or the type's string value."""
        m = machine_in(State.IDLE)
        m.apply(EventType.TOOL_USE)
        assert m.state is State.RUNNING_TOOL
        m.apply("text_delta")  # type: ignore[arg-type]
        assert state_of(m) is State.RESPONDING

    def test_transition_reports_change(self) -> None:
        """A Transition is `changed` only when the state or lifecycle moved."""
        m = machine_in(State.THINKING)
        assert not m.apply(EventType.THINKING).changed
        assert m.apply(EventType.TOOL_USE).changed
        assert m.apply(EventType.DONE).changed  # state and lifecycle both move


class TestLifecycle:
    """Spawning, working, idle and killed."""

    @pytest.mark.parametrize("event", [e for e in EventType
                                       if e not in (EventType.DONE, EventType.ERROR)])
    def test_first_event_of_any_kind_ends_spawning(self, event: EventType) -> None:
        """Spawning -> working on the first event, even one the machine does not know."""
        m = StateMachine(FakeClock())
        m.mark_spawning()
        tr = m.apply(event)
        assert (tr.lifecycle_from, tr.lifecycle_to) == (Lifecycle.SPAWNING, Lifecycle.WORKING)

    @pytest.mark.parametrize("end", [EventType.DONE, EventType.ERROR])
    def test_done_and_error_end_the_turn(self, end: EventType) -> None:
        """Working -> idle (state idle too) on done or error, even straight from spawning."""
        m = machine_in(State.RUNNING_TOOL)
        m.apply(end)
        assert (m.state, m.lifecycle) == (State.IDLE, Lifecycle.IDLE)
        fresh = StateMachine(FakeClock())
        fresh.mark_spawning()
        fresh.apply(end)
        assert fresh.lifecycle is Lifecycle.IDLE

    def test_next_turn_wakes_an_idle_agent(self) -> None:
        """Idle -> working on the next turn's event; an unknown event leaves it idle."""
        m = machine_in(State.RESPONDING)
        m.apply(EventType.DONE)
        m.apply(EventType.UNKNOWN)
        assert (m.state, m.lifecycle) == (State.IDLE, Lifecycle.IDLE)
        m.apply(EventType.THINKING)
        assert (m.state, m.lifecycle) == (State.THINKING, Lifecycle.WORKING)

    @pytest.mark.parametrize("lifecycle", list(Lifecycle))
    def test_mark_killed_from_anywhere(self, lifecycle: Lifecycle) -> None:
        """Any lifecycle -> killed on mark_killed; the state is left for mark_idle."""
        m = StateMachine(FakeClock())
        m.mark_spawning()
        if lifecycle is Lifecycle.WORKING:
            m.apply(EventType.TOOL_USE)
        elif lifecycle is Lifecycle.IDLE:
            m.apply(EventType.DONE)
        elif lifecycle is Lifecycle.KILLED:
            m.mark_killed()
        assert m.lifecycle is lifecycle
        before = m.state
        m.mark_killed()
        assert (m.lifecycle, m.state) == (Lifecycle.KILLED, before)

    def test_killed_is_sticky_until_respawn(self) -> None:
        """Late events after a kill change neither state nor lifecycle; mark_spawning revives."""
        m = machine_in(State.RESPONDING)
        m.mark_killed()
        for event in (EventType.TOOL_USE, EventType.DONE, EventType.UNKNOWN):
            tr = m.apply(event)
            assert not tr.changed
        assert (m.state, m.lifecycle) == (State.RESPONDING, Lifecycle.KILLED)
        m.mark_idle()
        assert (m.state, m.lifecycle) == (State.IDLE, Lifecycle.KILLED)
        m.mark_spawning()
        assert (m.state, m.lifecycle) == (State.IDLE, Lifecycle.SPAWNING)

    def test_mark_spawning_resets_and_is_idempotent(self) -> None:
        """mark_spawning gives SPAWNING/IDLE however often it is called, from any state."""
        m = machine_in(State.RUNNING_TOOL)
        m.mark_spawning()
        m.mark_spawning()
        assert (m.state, m.lifecycle) == (State.IDLE, Lifecycle.SPAWNING)


class TestLenientTransitions:
    """Reordered or surprising streams never break the machine."""

    def test_delta_before_session_start(self) -> None:
        """A text delta before the session start responds; the late start keeps that state."""
        m = StateMachine(FakeClock())
        m.mark_spawning()
        m.apply(EventType.TEXT_DELTA)
        m.apply(EventType.SESSION_START)
        assert (m.state, m.lifecycle) == (State.RESPONDING, Lifecycle.WORKING)

    def test_tool_result_before_tool_use(self) -> None:
        """A tool result with no tool running goes to thinking; the late tool use runs it."""
        m = machine_in(State.IDLE)
        m.apply(EventType.TOOL_RESULT)
        assert m.state is State.THINKING
        m.apply(EventType.TOOL_USE)
        assert state_of(m) is State.RUNNING_TOOL

    def test_repeated_and_unexpected_ends(self) -> None:
        """Done twice, or error after done, leaves the machine idle without complaint."""
        m = machine_in(State.THINKING)
        m.apply(EventType.DONE)
        m.apply(EventType.DONE)
        m.apply(EventType.ERROR)
        assert (m.state, m.lifecycle) == (State.IDLE, Lifecycle.IDLE)

    def test_unknown_keeps_state_but_bumps_last_active(self) -> None:
        """An unknown event changes no view but proves the agent is alive."""
        clock = FakeClock()
        m = machine_in(State.RUNNING_TOOL, clock)
        clock.advance(30)
        tr = m.apply(AgentEvent(EventType.UNKNOWN, source="rate_limit_event"))
        assert not tr.changed
        assert m.state is State.RUNNING_TOOL and m.last_active == clock.t


class TestLastActive:
    """last_active and idle_for, with the injected clock."""

    def test_each_event_bumps_last_active(self) -> None:
        """Every applied event, of any type, sets last_active to the clock's time."""
        clock = FakeClock(10.0)
        m = StateMachine(clock)
        for event in EventType:
            clock.advance(1.5)
            m.apply(event)
            assert m.last_active == clock.t

    def test_idle_for_counts_from_the_last_event(self) -> None:
        """idle_for grows with the clock and resets on the next event."""
        clock = FakeClock()
        m = machine_in(State.THINKING, clock)
        clock.advance(42)
        assert m.idle_for() == 42
        m.apply(EventType.THINKING)
        assert m.idle_for() == 0

    def test_marks_do_not_fake_activity(self) -> None:
        """mark_idle and mark_killed leave last_active alone; mark_spawning restarts it."""
        clock = FakeClock()
        m = machine_in(State.RESPONDING, clock)
        active = m.last_active
        clock.advance(5)
        m.mark_idle()
        m.mark_killed()
        assert m.last_active == active and m.idle_for() == 5
        clock.advance(5)
        m.mark_spawning()
        assert m.last_active == clock.t and m.idle_for() == 0

    def test_events_after_kill_still_count_as_output(self) -> None:
        """Buffered lines read after the exit bump last_active without reviving the process."""
        clock = FakeClock()
        m = machine_in(State.THINKING, clock)
        m.mark_killed()
        clock.advance(3)
        m.apply(EventType.TEXT_DELTA)
        assert m.last_active == clock.t and m.lifecycle is Lifecycle.KILLED

    def test_default_clock_is_monotonic(self) -> None:
        """Without an injected clock the machine uses a real, monotonic one."""
        m = StateMachine()
        m.mark_spawning()
        assert m.last_active is not None and m.idle_for() >= 0
