"""`CriticPolicy`: every threshold the default judge uses, with its default and meaning."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from kernel import ConfigError
from kernel._dataclass import dataclass

#: The grace after a stall nudge, when `CriticPolicy.grace` is None, is this
#: fraction of `idle_timeout`, capped at `GRACE_CAP` seconds.
GRACE_FRACTION = 0.25
GRACE_CAP = 60.0


@dataclass(slots=True, frozen=True)
class CriticPolicy:
    """The thresholds of the watch-nursery critic's default rules (`RulesJudge`).

    Times are seconds of trio time (virtual under a `MockClock`).

    Attributes:
        soft_timeout: When the first progress judgment falls, after the run
            starts, for runs whose `Limits.soft_timeout` is None. None: no
            progress judgments; the critic only watches for stalls and loops,
            and the hard backstop (`Limits.timeout`) ends a long run.
        extend_by: How far each extension moves the deadline. None: by the
            soft timeout in effect, so judgments keep a regular rhythm.
        max_extensions: How many times one run's deadline may be extended.
            After that the deadline stands and the run ends `timeout` there.
        step_bonus: How much each extension raises the step ceiling. None: by
            as many steps as the run took in the window just judged (at least
            1), so a run keeps the headroom it started with at the pace it
            has shown.
        idle_timeout: Seconds without progress before the run is nudged as
            stalled. Progress is a step, a tool call whose outcome is new, an
            output line not seen recently, an adapter event, or a process tree
            that is working (`cpu_busy`, `io_busy`); a model request or tool
            call in flight is judged by `model_timeout`/`tool_timeout`
            instead. None disables stall detection; a progress judgment that
            finds nothing done in its window then lets the deadline lapse
            (`timeout`) instead of leaving silence to this rule.
        grace: Seconds after `idle_timeout` (so `idle_timeout + grace` of
            silence in all) before a nudged, still-silent run is killed
            `stalled`. None: a quarter of `idle_timeout`, at most 60 s.
        loop_repeats: The same tool call (name and arguments, volatile values
            masked) returning the same result this many times in a row is a
            loop. Calls whose results are never reported (a CLI agent's) are
            compared by the call alone.
        max_cycle: The longest cycle of calls checked for (2: A-B-A-B; 3 also
            A-B-C-A-B-C). 1 checks only single repeated calls.
        cycle_repeats: How many full turns of a cycle (results unchanged) make
            a loop (2: A-B-A-B).
        loop_nudges: How many times one run is nudged for looping (and for
            each of the other repetition rules). Once they are spent, the
            next repetition found kills the run without a nudge.
        error_repeats: The same error (volatile values masked) from this many
            tool calls in a row is a loop of its own (`repeated_error`).
        message_repeats: The same assistant message this many steps in a row
            is a loop of its own (`repeating`).
        model_timeout: How long a model request in flight (no reply, no
            streamed token) keeps a run alive, instead of `idle_timeout`.
            Past it the run is killed `model_timeout`. None: no bound of its
            own (`idle_timeout` applies). The default, 300 s, matches the
            stream idle timeouts of the common coding CLIs.
        tool_timeout: The same for a tool call in flight (`tool_timeout`).
        cpu_busy: A process tree using at least this fraction of one core is
            working, however silent: averaged over the last 10 s (a third of
            `idle_timeout`, if shorter), and only while it still uses some
            (CPU time is counted in 10 ms ticks: a loop at 1 % of a core shows
            2 % in some of its seconds). The I/O and TCP rates below likewise.
        io_busy: The same for bytes read and written per second (files,
            pipes, sockets through read/write calls).
        net_busy: The same for bytes per second moved over the tree's TCP
            connections (received, or sent and acknowledged): a download or a
            streamed reply, which `io_busy` does not see (`send`/`recv` calls
            are not in a process's I/O counters). Lower than `io_busy`: nothing
            the run prints passes there; a heartbeat or a poll every few
            seconds stays under it.
        sample_interval: Seconds between process samples (the sampler may
            space them further to stay within its CPU budget, but never
            further than a third of `idle_timeout`, which may be shorter).
    """

    soft_timeout: float | None = 600.0
    extend_by: float | None = None
    max_extensions: int = 24
    step_bonus: int | None = None
    idle_timeout: float | None = 300.0
    grace: float | None = None
    loop_repeats: int = 3
    max_cycle: int = 3
    cycle_repeats: int = 2
    loop_nudges: int = 2
    error_repeats: int = 3
    message_repeats: int = 3
    model_timeout: float | None = 300.0
    tool_timeout: float | None = 300.0
    cpu_busy: float = 0.02
    io_busy: float = 16384.0
    net_busy: float = 1024.0
    sample_interval: float = 1.0

    def __post_init__(self) -> None:
        for name in ("soft_timeout", "extend_by", "idle_timeout", "model_timeout",
                     "tool_timeout"):
            _positive_or_none(name, getattr(self, name))
        if self.grace is not None and not (math.isfinite(self.grace) and self.grace >= 0):
            raise ConfigError(f"CriticPolicy.grace must be >= 0 or None, got {self.grace!r}")
        minimums = {"max_extensions": 0, "loop_repeats": 2, "max_cycle": 1,
                    "cycle_repeats": 2, "loop_nudges": 0, "error_repeats": 2,
                    "message_repeats": 2}
        for name, least in minimums.items():
            value = getattr(self, name)
            if not isinstance(value, int) or value < least:
                raise ConfigError(f"CriticPolicy.{name} must be an integer >= {least}, "
                                  f"got {value!r}")
        for name in ("cpu_busy", "io_busy", "net_busy", "sample_interval"):
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not math.isfinite(value) or value <= 0):
                raise ConfigError(f"CriticPolicy.{name} must be > 0, got {value!r}")
        if self.step_bonus is not None and (not isinstance(self.step_bonus, int)
                                            or self.step_bonus < 0):
            raise ConfigError(f"CriticPolicy.step_bonus must be an integer >= 0 or None, "
                              f"got {self.step_bonus!r}")

    @property
    def effective_grace(self) -> float:
        """The grace in seconds after a stall nudge (the default resolved)."""
        if self.grace is not None:
            return self.grace
        if self.idle_timeout is None:
            return 0.0
        return min(self.idle_timeout * GRACE_FRACTION, GRACE_CAP)

    def as_dict(self) -> dict[str, Any]:
        """The thresholds as a JSON-ready dict, defaults resolved (for the audit)."""
        out = asdict(self)
        out["grace"] = self.effective_grace if self.idle_timeout is not None else None
        return out


def _positive_or_none(name: str, value: float | None) -> None:
    if value is None:
        return
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or value <= 0):
        raise ConfigError(f"CriticPolicy.{name} must be > 0 or None, got {value!r}")
