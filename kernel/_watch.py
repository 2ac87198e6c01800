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
never again), and the three attributes below the watcher keeps on it.
The task is a trio system task, started by the first run registered in a
`trio.run` and gone when no run is left; it never raises (a failing look
stops watching that run only).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from typing import Protocol

import trio

_log = logging.getLogger("kernel")


class Watched(Protocol):
    """What the watcher needs from a run (`_Run` implements it)."""

    #: Set by the watcher: True while registered.
    watched: bool
    #: Set by the watcher: the trio time of the one heap entry that counts.
    watch_at: float
    #: Set by the watcher: True while queued by `wake`.
    woken: bool

    def look(self, now: float) -> float | None:
        """Act on the handle; return when to look next (trio time), None to stop."""

    def watch_failed(self, exc: Exception) -> None:
        """`look` raised: stop consulting the critic for this run."""


class Watcher:
    """Follows many runs from one trio system task (see the module docstring)."""

    __slots__ = ("_count", "_event", "_heap", "_ready", "_running_in", "_seq", "_sleep_until",
                 "looks", "wakeups")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Watched]] = []
        self._seq = itertools.count()  # ties in the heap never compare runs
        self._ready: list[Watched] = []  # woken runs, looked at before the heap
        self._event: trio.Event | None = None  # set to wake the task while it sleeps
        self._sleep_until = -math.inf  # when the sleeping task wakes by itself
        self._running_in: object | None = None  # the trio token of the running task
        self._count = 0  # registered runs
        self.looks = 0  # looks done (for the bench and tests)
        self.wakeups = 0  # times the task woke (for the bench and tests)

    @property
    def watching(self) -> int:
        """How many runs are registered."""
        return self._count

    def register(self, run: Watched) -> None:
        """Watch `run` from now on; its first look is at the task's next turn."""
        run.watched = True
        run.woken = False
        self._count += 1
        self.schedule(run, trio.current_time())
        token = trio.lowlevel.current_trio_token()
        if self._running_in is not token:
            self._running_in = token
            trio.lowlevel.spawn_system_task(self._run, token, name="kernel watcher")

    def unregister(self, run: Watched) -> None:
        """Stop watching `run` (its heap entry, if any, is dropped when reached)."""
        if not run.watched:
            return
        run.watched = False
        run.watch_at = math.inf
        self._count -= 1
        if self._count == 0:
            self._kick()  # let the task end

    def schedule(self, run: Watched, at: float) -> None:
        """Look at `run` at trio time `at` (replacing its previous time)."""
        run.watch_at = at
        heapq.heappush(self._heap, (at, next(self._seq), run))
        if at < self._sleep_until:
            self._kick()

    def wake(self, run: Watched) -> None:
        """Look at `run` at the task's next turn (its handle has something to act on)."""
        if run.watched and not run.woken:
            run.woken = True
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
        if not run.watched:
            return  # the look ended the run's watching (a kill, a failed critic)
        if at is None:
            self.unregister(run)
        else:
            self.schedule(run, at)

    async def _run(self, token: object) -> None:
        heap = self._heap
        try:
            while self._running_in is token:
                self.wakeups += 1
                now = trio.current_time()
                ready, self._ready = self._ready, []
                due: list[Watched] = []
                while heap and heap[0][0] <= now:
                    at, _, run = heapq.heappop(heap)
                    if run.watched and run.watch_at == at:
                        run.watch_at = math.inf
                        due.append(run)
                for run in ready:
                    run.woken = False
                    if run.watched:
                        run.watch_at = math.inf  # its heap entry no longer counts
                        self._look(run, now)
                for run in due:
                    if run.watched and run.watch_at == math.inf:
                        self._look(run, now)
                while heap and (not heap[0][2].watched or heap[0][2].watch_at != heap[0][0]):
                    heapq.heappop(heap)  # superseded entries
                if self._ready:
                    await trio.lowlevel.checkpoint()
                    continue
                if not heap and self._count == 0:
                    return
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
