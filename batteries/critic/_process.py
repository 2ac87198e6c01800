"""Process evidence: is a run's process tree working, flat, or waiting for input?

One `ProcessSampler` per critic (not one per run) samples every registered
process tree from one task, off the trio thread (the probe's reads go to a
worker thread), and hands each run's figures to its watch handle:

- **working**: CPU time or bytes read/written advanced by more than the
  policy's thresholds since the last sample. A working tree is progress,
  however silent it is.
- **waiting for input**: the tree is flat and a process in it is blocked
  reading a terminal, or its stdin when no process of the tree holds that
  pipe open for writing (`sleep 10 | cat` waits for `sleep`, not for input),
  or polls with a terminal on fd 0 and no socket open (curl polling its
  socket waits for the network) (`/proc/PID/wchan`, `/proc/PID/syscall`,
  `/proc/PID/fdinfo`).
- **flat**: neither; the idle clock runs.

The probe is a small Protocol so virtual-time tests hand-write one;
`PsutilProbe` reads `/proc` through psutil. The sampler keeps its own cost
under `budget` of one core by spacing samples out when there are many trees.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import trio

from kernel._dataclass import dataclass

from ._judge import Process

_log = logging.getLogger("kernel.critic")

# Kernel wait channels (or parts of them) of a task blocked reading a terminal or a
# pipe, or waiting in select/poll; names vary by kernel version (pipe_read,
# anon_pipe_read, pipe_wait, n_tty_read, wait_woken, do_select, ...).
_READ_WAIT_PARTS = ("tty_read", "pipe_read", "pipe_wait", "wait_woken", "select", "poll")
# read-family syscall numbers: x86_64 read/pread64/readv, aarch64 read/readv/pread64,
# and the select/poll family a prompt may wait in before reading.
_READ_SYSCALLS = {
    "x86_64": frozenset({0, 17, 19}),
    "aarch64": frozenset({63, 65, 67}),
}
_POLL_SYSCALLS = {
    "x86_64": frozenset({7, 23, 270, 271}),
    "aarch64": frozenset({72, 73}),
}


@dataclass(slots=True, frozen=True)
class TreeSample:
    """One probe reading of a process tree.

    Attributes:
        cpu_s: CPU seconds of the live processes, reaped children included.
        io_bytes: Bytes read and written through read/write calls (files,
            pipes, sockets, terminals).
        pids: The processes alive in the tree.
    """

    cpu_s: float
    io_bytes: int
    pids: frozenset[int]


class ProcessProbe(Protocol):
    """Reads process figures. **Protocol:** may block (it runs in a worker thread
    unless `threaded` is False); must not raise for a process that is gone.
    """

    threaded: bool

    def sample(self, root: int) -> TreeSample | None:
        """The tree under `root` now; None once `root` has exited."""

    def input_waits(self, pids: Iterable[int]) -> tuple[str, ...]:
        """`pid:wchan` for each process blocked reading a terminal or its stdin."""


class PsutilProbe:
    """The real probe: psutil for CPU and I/O, /proc for the tree and the wait channel."""

    threaded = True

    def __init__(self) -> None:
        # psutil is imported by the first sample, in the sampler's worker thread: a
        # short run (most `kernel run`s) ends before that and never pays for it.
        self._psutil: Any = None
        self._procs: dict[int, Any] = {}
        machine = os.uname().machine
        self._reads = _READ_SYSCALLS.get(machine, frozenset())
        self._polls = _POLL_SYSCALLS.get(machine, frozenset())

    def sample(self, root: int) -> TreeSample | None:
        """Walk the tree from `root` through /proc/PID/task/TID/children and sum its figures."""
        psutil = self._psutil
        if psutil is None:
            import psutil

            self._psutil = psutil
        pids = _tree(root)
        if not pids:
            self._procs.pop(root, None)
            return None
        cpu = 0.0
        io = 0
        alive: set[int] = set()
        for pid in pids:
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    proc = self._procs[pid] = psutil.Process(pid)
                with proc.oneshot():
                    t = proc.cpu_times()
                    cpu += t.user + t.system + t.children_user + t.children_system
                    try:
                        c = proc.io_counters()
                        io += getattr(c, "read_chars", c.read_bytes) + getattr(
                            c, "write_chars", c.write_bytes)
                    except (psutil.AccessDenied, AttributeError):
                        pass
                alive.add(pid)
            except (psutil.NoSuchProcess, psutil.ZombieProcess, ProcessLookupError):
                self._procs.pop(pid, None)
            except psutil.AccessDenied:
                alive.add(pid)
        if root not in alive:
            return None
        return TreeSample(cpu, io, frozenset(alive))

    def forget(self, pids: Iterable[int]) -> None:
        """Drop cached handles of processes no longer sampled."""
        for pid in pids:
            self._procs.pop(pid, None)

    def input_waits(self, pids: Iterable[int]) -> tuple[str, ...]:
        """Processes sleeping in a read of a terminal, or of stdin fed from outside the tree.

        A read of fd 0 that is a pipe another process of the tree holds open for
        writing (`sleep 10 | cat`) waits for that process, not for input; a
        poll with a terminal on fd 0 and a socket open (curl waiting for a
        server) waits for the network. Both are plain flat trees.
        """
        tree = pids if isinstance(pids, (set, frozenset)) else frozenset(pids)
        out: list[str] = []
        for pid in tree:
            wchan = _read_text(f"/proc/{pid}/wchan")
            if not any(part in wchan for part in _READ_WAIT_PARTS):
                continue
            if self._reading_input(pid, wchan, tree):
                out.append(f"{pid}:{wchan}")
        return tuple(sorted(out))

    def _reading_input(self, pid: int, wchan: str, tree: frozenset[int] | set[int]) -> bool:
        syscall = _read_text(f"/proc/{pid}/syscall").split()
        if len(syscall) >= 2 and syscall[0].isdigit():
            nr = int(syscall[0])
            try:
                fd = int(syscall[1], 16)
            except ValueError:
                fd = -1
            if nr in self._reads:
                if _is_terminal(pid, fd):
                    return True
                return fd == 0 and not _written_in_tree(pid, 0, tree)
            if nr in self._polls:
                # Which fds it polls is in its memory; a socket open says it may well
                # be waiting for the network instead (curl, a client), so only a
                # process with a terminal on stdin and no socket counts.
                return _is_terminal(pid, 0) and not _has_socket(pid)
            return False
        # No syscall view (permissions): a terminal read with a terminal on stdin.
        return ("tty_read" in wchan or wchan == "wait_woken") and _is_terminal(pid, 0)


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _is_terminal(pid: int, fd: int) -> bool:
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return False
    return target.startswith(("/dev/pts/", "/dev/tty", "/dev/console"))


def _fd_targets(pid: int) -> list[tuple[str, str]]:
    """`(fd, what it is open on)` for each open fd of `pid` (empty if unreadable)."""
    base = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(base)
    except OSError:
        return []
    out = []
    for fd in fds:
        try:
            out.append((fd, os.readlink(f"{base}/{fd}")))
        except OSError:
            continue
    return out


def _has_socket(pid: int) -> bool:
    return any(target.startswith("socket:") for _, target in _fd_targets(pid))


def _written_in_tree(pid: int, fd: int, tree: Iterable[int]) -> bool:
    """True if `fd` of `pid` is a pipe that a process of `tree` holds open for writing.

    A pipe's two ends share its inode (`pipe:[N]`); an fd open for writing has
    O_WRONLY or O_RDWR in the `flags` of its `/proc/PID/fdinfo`.
    """
    try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return False
    if not target.startswith("pipe:"):
        return False
    for other in tree:
        for ofd, otarget in _fd_targets(other):
            if otarget != target:
                continue
            for line in _read_text(f"/proc/{other}/fdinfo/{ofd}").splitlines():
                if line.startswith("flags:"):
                    try:
                        flags = int(line.split()[1], 8)
                    except (IndexError, ValueError):
                        break
                    if flags & 3 in (os.O_WRONLY, os.O_RDWR):
                        return True
                    break
    return False


def _tree(root: int) -> list[int]:
    """`root` and its descendants (empty if `root` is gone), via the kernel's children lists."""
    if not os.path.exists(f"/proc/{root}"):
        return []
    out = [root]
    i = 0
    while i < len(out):
        pid = out[i]
        i += 1
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            text = _read_text(f"/proc/{pid}/task/{tid}/children")
            if text:
                out.extend(int(c) for c in text.split())
    return out


Sink = Callable[[Process], None]

#: The sampler never samples more often than this (seconds), whatever `max_interval`.
_MIN_PAUSE = 0.05


class _Tree:
    """What the sampler remembers about one registered root."""

    __slots__ = (
        "cpu",
        "exited",
        "intervals",
        "io",
        "last_working",
        "pids",
        "root",
        "seen",
        "sink",
        "started",
        "t",
    )

    def __init__(self, root: int, sink: Sink, now: float) -> None:
        self.root = root
        self.sink = sink
        self.t: float | None = None
        self.cpu = 0.0
        self.io = 0
        self.pids: frozenset[int] = frozenset()
        self.seen: set[int] = set()
        self.started = 0
        self.exited = 0
        self.last_working = now
        self.intervals = 0  # sampling intervals seen


class ProcessSampler:
    """Samples every registered process tree from one task; shared by all runs of a critic.

    Roots are registered from the trio thread (`register`/`unregister`); the
    first registration starts the sampling task (a trio system task, so it
    needs no nursery and ends with the trio run), which stops by itself
    when nothing is registered. Each sample's figures go to the root's sink
    on the trio thread.

    Args:
        probe: Where figures come from; `PsutilProbe()` if None.
        interval: Seconds between samples (trio time).
        cpu_busy: Fraction of one core above which a tree is working.
        io_busy: Bytes per second read+written above which a tree is working.
        budget: The most of one core the sampler may use; with many trees
            it spaces samples out to stay under it...
        max_interval: ...but never further apart than this, even if it is
            shorter than `interval` (the critic passes a third of its idle
            timeout, so a working tree is always seen working well within it,
            at the cost of the budget); never closer than 0.05 s.
    """

    def __init__(self, probe: ProcessProbe | None = None, *, interval: float = 1.0,
                 cpu_busy: float = 0.02, io_busy: float = 16384.0,
                 budget: float = 0.04, max_interval: float | None = None) -> None:
        self._probe = probe
        self.interval = interval
        self.cpu_busy = cpu_busy
        self.io_busy = io_busy
        self.budget = budget
        self.max_interval = max_interval
        self._trees: dict[int, list[_Tree]] = {}
        self._running_in: object | None = None  # the trio token of the running task
        self._fresh: list[int] = []  # roots registered since the last round
        self._kick: trio.Event | None = None  # set to wake the task for fresh roots
        self.samples = 0  # sampling rounds done (for the bench and tests)
        self.cost_s = 0.0  # thread CPU seconds spent probing

    @property
    def probe(self) -> ProcessProbe:
        if self._probe is None:
            self._probe = PsutilProbe()
        return self._probe

    def register(self, root: int, sink: Sink) -> None:
        """Sample the tree under `root` from now on, handing figures to `sink`."""
        now = trio.current_time()
        self._trees.setdefault(root, []).append(_Tree(root, sink, now))
        token = trio.lowlevel.current_trio_token()
        if self._running_in is not token:
            self._running_in = token
            trio.lowlevel.spawn_system_task(self._run, token, name="critic process sampler")
        else:
            # Its first reading (the baseline) now, not at the next round: a tree that
            # joins mid-round would otherwise be first seen working up to a round later.
            self._fresh.append(root)
            if self._kick is not None:
                self._kick.set()

    def unregister(self, root: int, sink: Sink) -> None:
        """Stop sampling `root` for `sink`."""
        trees = self._trees.get(root)
        if not trees:
            return
        trees[:] = [t for t in trees if t.sink is not sink]
        if not trees:
            del self._trees[root]

    @property
    def roots(self) -> int:
        """How many roots are registered."""
        return len(self._trees)

    async def _run(self, token: object) -> None:
        try:
            while self._trees and self._running_in is token:
                self._fresh.clear()
                cost = await self._round(list(self._trees), fresh=False)
                # Space samples out so probing stays under `budget` of one core, but
                # never past `max_interval`, even when that is shorter than `interval`:
                # a tree's work is credited a sample late (and its first interval not at
                # all), so samples a second apart under a 2 s idle timeout reported a
                # busy shell loop working only after the idle clock had run out (a
                # `stalled` nudge, then "recovered" at the next look, nothing changed).
                pause = max(self.interval, cost / self.budget if self.budget > 0 else 0.0)
                if self.max_interval is not None:
                    pause = min(pause, max(self.max_interval, _MIN_PAUSE))
                until = trio.current_time() + pause
                while trio.current_time() < until and self._running_in is token:
                    kick = self._kick = trio.Event()
                    with trio.move_on_at(until):
                        await kick.wait()
                    self._kick = None
                    fresh = [r for r in dict.fromkeys(self._fresh) if r in self._trees]
                    self._fresh.clear()
                    if fresh:
                        await self._round(fresh, fresh=True)
        except trio.Cancelled:
            raise
        except Exception:
            _log.exception("process sampler failed")
        finally:
            self._kick = None
            if self._running_in is token:
                self._running_in = None

    async def _round(self, roots: list[int], *, fresh: bool) -> float:
        """Read `roots` (off the trio thread if the probe is threaded) and hand out the
        figures; `fresh`: only to trees not read yet. Returns the probe's CPU cost."""
        probe = self.probe
        if probe.threaded:
            readings, cost = await trio.to_thread.run_sync(
                self._read, probe, roots, abandon_on_cancel=True)
        else:
            readings, cost = self._read(probe, roots)
        self.cost_s += cost
        self.samples += 1
        self._deliver(readings, fresh=fresh)
        return cost

    def _read(self, probe: ProcessProbe, roots: Sequence[int]
              ) -> tuple[dict[int, tuple[TreeSample | None, tuple[str, ...]]], float]:
        t0 = time.thread_time()
        out: dict[int, tuple[TreeSample | None, tuple[str, ...]]] = {}
        for root in roots:
            sample = probe.sample(root)
            waits: tuple[str, ...] = ()
            if sample is not None and not self._would_work(root, sample):
                waits = probe.input_waits(sample.pids)
            out[root] = (sample, waits)
        return out, time.thread_time() - t0

    def _would_work(self, root: int, sample: TreeSample) -> bool:
        trees = self._trees.get(root)
        if not trees:
            return True
        tree = trees[0]
        if tree.t is None:
            return False
        return sample.cpu_s - tree.cpu > 0 or sample.io_bytes - tree.io > 0

    def _deliver(self, readings: dict[int, tuple[TreeSample | None, tuple[str, ...]]], *,
                 fresh: bool = False) -> None:
        now = trio.current_time()
        for root, (sample, waits) in readings.items():
            for tree in list(self._trees.get(root, ())):
                if fresh and tree.t is not None:
                    continue  # (read at its round, on the round's rhythm)
                figures = self._update(tree, sample, waits, now)
                if sample is None:
                    self.unregister(root, tree.sink)
                if figures is not None:
                    tree.sink(figures)

    def _update(self, tree: _Tree, sample: TreeSample | None, waits: tuple[str, ...],
                now: float) -> Process | None:
        if sample is None:
            tree.exited += len(tree.pids)
            tree.pids = frozenset()
            return Process(cpu_s=tree.cpu, procs=0, started=tree.started, exited=tree.exited,
                           idle=now - tree.last_working)
        new = sample.pids - tree.pids
        gone = tree.pids - sample.pids
        if tree.t is None:
            tree.seen.update(sample.pids)
        else:
            tree.started += len(new - tree.seen)
            tree.seen.update(new)
        tree.exited += len(gone)
        working = False
        cpu_rate = io_rate = 0.0
        if tree.t is not None:
            dt = max(now - tree.t, 1e-9)
            # A tree only loses CPU seconds when a process leaves it unreaped: never negative.
            cpu_rate = max(0.0, sample.cpu_s - tree.cpu) / dt
            io_rate = max(0, sample.io_bytes - tree.io) / dt
            tree.intervals += 1
            # The first interval holds the process's start-up (exec, dynamic loading,
            # imports): that is not work the run is doing, and counting it would
            # credit a process that went silent at once with a second of progress.
            working = tree.intervals > 1 and (cpu_rate >= self.cpu_busy
                                              or io_rate >= self.io_busy)
            if working:
                # When did the work happen? I/O at this rate is taken as ongoing; a
                # burst of CPU (a start-up, then sleep) is placed at the start of
                # the interval, as long as the CPU time it took: a sleeper is not
                # credited with a second of work it did in 50 ms.
                cpu_used = max(0.0, sample.cpu_s - tree.cpu)
                at = now if io_rate >= self.io_busy else tree.t + min(dt, cpu_used)
                tree.last_working = max(tree.last_working, at)
        tree.t, tree.cpu, tree.io, tree.pids = now, sample.cpu_s, sample.io_bytes, sample.pids
        forget = getattr(self._probe, "forget", None)
        if gone and forget is not None:
            with contextlib.suppress(Exception):
                forget(gone)
        return Process(cpu_s=sample.cpu_s, cpu_rate=cpu_rate, io_rate=io_rate,
                       procs=len(sample.pids), started=tree.started, exited=tree.exited,
                       working=working, waiting_input=bool(waits) and not working,
                       waits=waits, idle=now - tree.last_working)


def merge(figures: Iterable[Process]) -> Process | None:
    """Several trees' figures as one (a run may own more than one process)."""
    items = list(figures)
    if not items:
        return None
    if len(items) == 1:
        return items[0]
    return Process(
        cpu_s=sum(p.cpu_s for p in items), cpu_rate=sum(p.cpu_rate for p in items),
        io_rate=sum(p.io_rate for p in items), procs=sum(p.procs for p in items),
        started=sum(p.started for p in items), exited=sum(p.exited for p in items),
        working=any(p.working for p in items),
        waiting_input=any(p.waiting_input for p in items) and not any(
            p.working for p in items),
        waits=tuple(w for p in items for w in p.waits),
        idle=min((p.idle for p in items), default=math.inf))
