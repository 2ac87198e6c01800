"""One watcher per kernel: the task that follows every run's critic handle.

A run with a critic handle is *watched*: at the moments its handle names
(`next_look()`, the critic's deadline, a wake through `attach`) someone must
ask the handle for a kill cause or a passed deadline and act on it. One task
per run did that, sleeping most of the time; at 10,000 concurrent runs the
second task and nursery per run cost more than the critic's judgment. Here
one task per kernel (per `trio.run`) keeps every watched run in a heap by
its next look and sleeps until the earliest, or until a run is woken.

The watcher knows nothing of critics: a watched object has a `look(now)`
that does the work and returns when it wants to be looked at next (None:
never again), and a `watch_entry` slot the watcher keeps. The task is a trio
system task, started by the first run registered in a `trio.run` and left
asleep (on an event, at no cost) when no run is due, so runs that end before
their critic's next look never wake it. It never raises: a failing look
stops watching that run only.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from typing import Any, Protocol

import trio

_log = logging.getLogger("kernel")

#: Superseded heap entries are dropped in one pass once they are this many and
#: more than half the heap (a run that ends leaves its entry until then).
_COMPACT_AT = 1024

#: A run's `watch_entry` while the task holds it for a look (popped from the heap).
_TAKEN: list[Any] = [math.inf, -1, None]


class Watched(Protocol):
    """What the watcher needs from a run (`_Run` implements it)."""

    #: Kept by the watcher: the run's live heap entry `[at, seq, run]`; None: not watched.
    watch_entry: list[Any] | None

    def look(self, now: float) -> float | None:
        """Act on the handle; return when to look next (trio time), None to stop."""

    def watch_failed(self, exc: Exception) -> None:
        """`look` raised: stop consulting the critic for this run."""


class Watcher:
    """Follows many runs from one trio system task (see the module docstring)."""

    __slots__ = ("_count", "_event", "_heap", "_ready", "_running_in", "_seq", "_sleep_until",
                 "_stale", "looks", "wakeups")

    def __init__(self) -> None:
        # Entries are [at, seq, run]; a superseded entry has run None. seq breaks ties.
        self._heap: list[list[Any]] = []
        self._seq = itertools.count()
        self._stale = 0  # superseded entries still in the heap
        self._ready: list[Watched] = []  # woken runs, looked at before the heap
        self._event: trio.Event | None = None  # set to wake the task while it sleeps
        self._sleep_until = -math.inf  # when the sleeping task wakes by itself
        self._running_in: object | None = None  # the trio token of the running task
        self._count = 0  # registered runs
        self.looks = 0  # looks done by the task (for the bench and tests)
        self.wakeups = 0  # times the task woke (for the bench and tests)

    @property
    def watching(self) -> int:
        """How many runs are registered."""
        return self._count

    def register(self, run: Watched, at: float) -> None:
        """Watch `run` from now on; its first look by the task is at trio time `at`."""
        self._count += 1
        self.schedule(run, at)
        token = trio.lowlevel.current_trio_token()
        if self._running_in is not token:
            self._running_in = token
            trio.lowlevel.spawn_system_task(self._run, token, name="kernel watcher")

    def unregister(self, run: Watched) -> None:
        """Stop watching `run`."""
        entry = run.watch_entry
        if entry is None:
            return
        run.watch_entry = None
        if entry is not _TAKEN:
            entry[2] = None
            self._stale += 1
        self._count -= 1

    def schedule(self, run: Watched, at: float) -> None:
        """Look at `run` at trio time `at` (replacing its previous time)."""
        old = run.watch_entry
        if old is not None and old is not _TAKEN:
            old[2] = None
            self._stale += 1
        entry = run.watch_entry = [at, next(self._seq), run]
        heapq.heappush(self._heap, entry)
        if at < self._sleep_until:
            self._kick()

    def wake(self, run: Watched) -> None:
        """Look at `run` at the task's next turn (its handle has something to act on)."""
        if run.watch_entry is not None and run not in self._ready:
            self._ready.append(run)
            self._kick()

    def _kick(self) -> None:
        event = self._event
        if event is not None:
            event.set()

    def _look(self, run: Watched, now: float) -> None:
        self.looks += 1
        try:
            at = run.look(now)
        except Exception as exc:
            run.watch_failed(exc)
            at = None
        if run.watch_entry is None:
            return  # unregistered while looking (a kill, a failed critic)
        if at is None:
            self.unregister(run)
        else:
            self.schedule(run, at)

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if e[2] is not None]
        heapq.heapify(self._heap)
        self._stale = 0

    async def _run(self, token: object) -> None:
        try:
            while self._running_in is token:
                self.wakeups += 1
                now = trio.current_time()
                ready, self._ready = self._ready, []
                due: list[Watched] = []
                heap = self._heap
                while heap and heap[0][0] <= now:
                    entry = heapq.heappop(heap)
                    run = entry[2]
                    if run is None:
                        self._stale -= 1
                    else:
                        run.watch_entry = _TAKEN  # its look schedules it again
                        due.append(run)
                for run in ready:
                    if run.watch_entry is not None:
                        self._look(run, now)
                for run in due:
                    if run.watch_entry is _TAKEN:
                        self._look(run, now)  # not looked at (and rescheduled) just above
                if self._stale > _COMPACT_AT and self._stale * 2 > len(self._heap):
                    self._compact()
                heap = self._heap
                while heap and heap[0][2] is None:
                    heapq.heappop(heap)
                    self._stale -= 1
                if self._ready:
                    await trio.lowlevel.checkpoint()
                    continue
                until = heap[0][0] if heap else math.inf
                event = self._event = trio.Event()
                self._sleep_until = until
                with trio.move_on_at(until):
                    await event.wait()
                self._event = None
                self._sleep_until = -math.inf
        except trio.Cancelled:
            raise
        except Exception:
            # A bug of ours: the runs lose their critic's clock, the backstop stays.
            _log.exception("kernel watcher failed")
        finally:
            self._event = None
            self._sleep_until = -math.inf
            if self._running_in is token:
                self._running_in = None
