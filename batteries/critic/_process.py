"""Process evidence: is a run's process tree working, flat, or waiting for input?

One `ProcessSampler` per critic (not one per run) samples every registered
process tree from one task, off the trio thread (the probe's reads go to a
worker thread), and hands each run's figures to its watch handle:

- **working**: CPU time or bytes read/written advanced by more than the
  policy's thresholds since the last sample, or bytes moved over the tree's
  TCP connections (a download, a streamed reply: `send`/`recv` calls are not
  in `/proc/PID/io`, so these come from the kernel's socket diagnostics, as
  `ss -ti` reads them). A working tree is progress, however silent it is.
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
import errno
import logging
import math
import os
import socket
import struct
import time
from collections import deque
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
            pipes, sockets, terminals): a running total, each process counted
            from the first sample that saw it (`PsutilProbe.sample` says which
            bytes count).
        pids: The processes alive in the tree.
        net_bytes: Bytes received and sent (acknowledged) over the TCP
            connections the tree holds open, summed since the probe first saw
            the tree: `send`/`recv` calls, which `io_bytes` does not count.
            0 where the probe cannot tell.
    """

    cpu_s: float
    io_bytes: int
    pids: frozenset[int]
    net_bytes: int = 0


class ProcessProbe(Protocol):
    """Reads process figures. **Protocol:** may block (it runs in a worker thread
    unless `threaded` is False); must not raise for a process that is gone.
    """

    threaded: bool

    def sample(self, root: int) -> TreeSample | None:
        """The tree under `root` now; None once `root` has exited."""

    def input_waits(self, pids: Iterable[int]) -> tuple[str, ...]:
        """`pid:wchan` for each process blocked reading a terminal or its stdin."""


class _Seen:
    """What the probe remembers of one root's tree between two samples."""

    __slots__ = ("io", "net", "reads", "socks", "writes")

    def __init__(self) -> None:
        self.reads: dict[int, int] = {}  # tid -> bytes the thread itself has read
        self.writes: dict[int, int] = {}  # pid -> bytes written, reaped children included
        self.socks: dict[int, int] = {}  # socket inode -> bytes it has moved
        self.io = 0  # the running totals handed out in `TreeSample`
        self.net = 0


class PsutilProbe:
    """The real probe: psutil for CPU, /proc for I/O, the tree and the wait channel,
    the kernel's socket diagnostics for TCP traffic."""

    threaded = True

    def __init__(self) -> None:
        # psutil is imported by the first sample, in the sampler's worker thread: a
        # short run (most `kernel run`s) ends before that and never pays for it.
        self._psutil: Any = None
        self._procs: dict[int, Any] = {}
        self._seen: dict[int, _Seen] = {}  # by root
        self._tcp = _TcpCounters()
        machine = os.uname().machine
        self._reads = _READ_SYSCALLS.get(machine, frozenset())
        self._polls = _POLL_SYSCALLS.get(machine, frozenset())

    def sample(self, root: int) -> TreeSample | None:
        """Walk the tree from `root` through /proc/PID/task/TID/children and sum its figures.

        CPU seconds are the live processes' own and their reaped children's (a
        build's compiler runs end between two samples). Bytes are counted from
        a process's (or thread's) first sample on, as what it did since, so a
        process's start-up is not work: writes by each process, reaped children
        included (what a quick `curl -o` or `cp` wrote); reads by each live
        thread itself, not its reaped children's, whose reads are mostly their
        start-up (the dynamic loader reads every library: a shell loop starting
        `sleep 0.1` ten times a second reads ~100 KB/s); a process of more than
        32 threads is read whole. TCP traffic likewise, socket by socket.
        """
        psutil = self._psutil
        if psutil is None:
            import psutil

            self._psutil = psutil
        tasks = _tree_tasks(root)
        if not tasks:
            self._procs.pop(root, None)
            self._seen.pop(root, None)
            return None
        cpu = 0.0
        alive: set[int] = set()
        reads: dict[int, int] = {}
        writes: dict[int, int] = {}
        for pid, tids in tasks:
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    proc = self._procs[pid] = psutil.Process(pid)
                t = proc.cpu_times()
                cpu += t.user + t.system + t.children_user + t.children_system
            except (psutil.NoSuchProcess, psutil.ZombieProcess, ProcessLookupError):
                self._procs.pop(pid, None)
                continue
            except psutil.AccessDenied:
                pass
            alive.add(pid)
            whole = _io_chars(f"/proc/{pid}/io")
            if whole is not None:
                writes[pid] = whole[1]
                if len(tids) > _THREADS_READ_ALONE:
                    # A file a thread would be too many to read: the process's reads
                    # as a whole (its reaped children's too), under a key of its own.
                    reads[-pid] = whole[0]
                    continue
            for tid in tids:
                own = _io_chars(f"/proc/{pid}/task/{tid}/io")
                if own is not None:
                    reads[int(tid)] = own[0]
        if root not in alive:
            self._seen.pop(root, None)
            return None
        seen = self._seen.get(root)
        if seen is None:
            seen = self._seen[root] = _Seen()
        seen.io += _grown(seen.reads, reads) + _grown(seen.writes, writes)
        seen.reads, seen.writes = reads, writes
        self._count_tcp(seen, alive)
        return TreeSample(cpu, seen.io, frozenset(alive), seen.net)

    def _count_tcp(self, seen: _Seen, pids: Iterable[int]) -> None:
        """Add what the TCP sockets the tree holds moved since the last sample.

        A socket's counters start at 0 when it opens and go when it closes: a
        socket new since the last sample counts whole (the first sample of the
        tree is its baseline anyway).
        """
        inodes: set[int] = set()
        for pid in pids:
            inodes.update(_socket_inodes(pid))
        now = self._tcp.read(inodes) if inodes else {}
        if now is None:  # no reading this time: the next one counts from the last
            return
        last = seen.socks
        seen.net += sum(max(0, moved - last.get(inode, 0)) for inode, moved in now.items())
        seen.socks = now

    def forget(self, pids: Iterable[int]) -> None:
        """Drop cached handles (and a root's counts) of processes no longer sampled."""
        for pid in pids:
            self._procs.pop(pid, None)
            self._seen.pop(pid, None)

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


def _socket_inodes(pid: int) -> list[int]:
    """The inodes of the sockets `pid` has open (`socket:[N]`)."""
    out = []
    for _, target in _fd_targets(pid):
        if target.startswith("socket:["):
            with contextlib.suppress(ValueError):
                out.append(int(target[8:-1]))
    return out


#: A process with more threads than this has its reads taken as a whole (one file,
#: reaped children included) rather than thread by thread (one file each).
_THREADS_READ_ALONE = 32

# NETLINK_SOCK_DIAG (linux/sock_diag.h, linux/inet_diag.h): what `ss -ti` reads.
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST_DUMP = 0x1 | 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_INET_DIAG_INFO = 2
# Every TCP state a socket with an inode moves data in: not LISTEN, nor TIME_WAIT
# and SYN_RECV (mini-sockets without one, thousands on a busy server).
_TCP_STATES = sum(1 << s for s in (1, 2, 4, 5, 7, 8, 9, 11))
# inet_diag_msg: family, state, timer, retrans (4 bytes), the socket id (48), then
# expires, rqueue, wqueue, uid, inode (u32 each): the inode is at 68, attributes at 72.
_MSG_INODE, _MSG_ATTRS = 68, 72
# struct tcp_info: tcpi_bytes_acked then tcpi_bytes_received (u64, Linux 4.1+).
_TCPI_BYTES = 120
_TCP_TABLE_TTL = 0.25  # one dump serves every tree sampled in a round
# A dump that failed for these is asked for again next time (the kernel's buffer
# overflowed on a busy host, a signal); any other failure is a refusal.
_TRANSIENT = frozenset({errno.ENOBUFS, errno.EINTR, errno.EAGAIN})


class _TcpCounters:
    """Bytes moved by TCP sockets, by inode: acknowledged sent + received payload.

    One netlink dump per family (IPv4, IPv6) of the sockets of this network
    namespace, kept for a quarter of a second so a sampling round of many
    trees dumps once. A family whose diagnostics are refused (IPv6 off, a
    sandbox that forbids them, not Linux) is not asked again.
    """

    __slots__ = ("_at", "_families", "_table")

    def __init__(self) -> None:
        self._families = ([socket.AF_INET, socket.AF_INET6]
                          if hasattr(socket, "AF_NETLINK") else [])
        self._at = -math.inf
        self._table: dict[int, int] = {}

    def read(self, inodes: Iterable[int]) -> dict[int, int] | None:
        """`{inode: bytes}` for those of `inodes` that are TCP sockets; None when the
        table could not be read whole this time (a dump cut short)."""
        if not self._families:
            return {}
        now = time.monotonic()
        if now - self._at > _TCP_TABLE_TTL:
            table: dict[int, int] = {}
            for family in list(self._families):
                try:
                    _dump_tcp(family, table)
                except OSError as exc:
                    if isinstance(exc, TimeoutError) or exc.errno in _TRANSIENT:
                        return None  # a dump cut short: ask again next time
                    self._families.remove(family)
                except struct.error:
                    self._families.remove(family)
            self._table, self._at = table, now
        table = self._table
        return {i: table[i] for i in inodes if i in table}


def _dump_tcp(family: int, into: dict[int, int]) -> None:
    """Add `{inode: bytes acked + received}` of every TCP socket of `family` to `into`."""
    req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 1 << (_INET_DIAG_INFO - 1), 0,
                      _TCP_STATES) + bytes(48)
    nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
    try:
        nl.settimeout(1.0)
        nl.send(struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY,
                            _NLM_F_REQUEST_DUMP, 1, 0) + req)
        unpack_from = struct.unpack_from
        while True:
            data = nl.recv(1 << 16)
            if not data:
                return
            off = 0
            while off + 16 <= len(data):
                length, kind = unpack_from("=IH", data, off)
                if length < 16:
                    return
                if kind == _NLMSG_DONE:
                    return
                if kind == _NLMSG_ERROR:
                    code = -unpack_from("=i", data, off + 16)[0] if length >= 20 else 0
                    raise OSError(code, "socket diagnostics refused")
                msg = off + 16
                end = off + length
                if end - msg >= _MSG_ATTRS:
                    inode = unpack_from("=I", data, msg + _MSG_INODE)[0]
                    at = msg + _MSG_ATTRS
                    while inode and at + 4 <= end:
                        alen, atype = unpack_from("=HH", data, at)
                        if alen < 4:
                            break
                        if atype == _INET_DIAG_INFO:
                            if alen - 4 >= _TCPI_BYTES + 16:
                                acked, received = unpack_from("=QQ", data,
                                                              at + 4 + _TCPI_BYTES)
                                into[inode] = acked + received
                            break
                        at += (alen + 3) & ~3
                off += (length + 3) & ~3
    finally:
        nl.close()


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
    return [pid for pid, _ in _tree_tasks(root)]


def _tree_tasks(root: int) -> list[tuple[int, list[str]]]:
    """`(pid, its thread ids)` for `root` and its descendants (empty if `root` is gone)."""
    if not os.path.exists(f"/proc/{root}"):
        return []
    out: list[tuple[int, list[str]]] = []
    todo = [root]
    i = 0
    while i < len(todo):
        pid = todo[i]
        i += 1
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            out.append((pid, []))
            continue
        out.append((pid, tids))
        for tid in tids:
            text = _read_text(f"/proc/{pid}/task/{tid}/children")
            if text:
                todo.extend(int(c) for c in text.split())
    return out


def _io_chars(path: str) -> tuple[int, int] | None:
    """`(rchar, wchar)` from a `/proc/.../io` file; None if it cannot be read."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:  # gone, or another user's process
        return None
    lines = head.split(b"\n", 2)
    try:
        return int(lines[0].split()[1]), int(lines[1].split()[1])
    except (IndexError, ValueError):
        return None


def _grown(last: dict[int, int], now: dict[int, int]) -> int:
    """How much the counters in both `last` and `now` grew (new ones are a baseline)."""
    return sum(max(0, value - last[key]) for key, value in now.items() if key in last)


Sink = Callable[[Process], None]

#: The sampler never samples more often than this (seconds), whatever `max_interval`.
_MIN_PAUSE = 0.05
#: CPU, I/O and TCP rates are averaged over this many seconds (or `max_interval`, if
#: shorter): a build or a download works all the time; a wait loop whose children
#: cost 1 % of a core, read on a clock of 10 ms ticks, shows 2 or 3 % in some second
#: of every minute, and a poll or a health check moves its bytes in a burst every
#: half minute: neither is a moment of work, each such second once was one.
_WINDOW = 10.0


class _Tree:
    """What the sampler remembers about one registered root."""

    __slots__ = (
        "cpu",
        "exited",
        "hist",
        "intervals",
        "io",
        "last_working",
        "net",
        "pids",
        "root",
        "seen",
        "sink",
        "started",
        "t",
        "used",
    )

    def __init__(self, root: int, sink: Sink, now: float) -> None:
        self.root = root
        self.sink = sink
        self.t: float | None = None
        self.cpu = 0.0
        self.io = 0
        self.net = 0
        # What the tree has done since its start-up (CPU seconds, bytes of I/O, bytes
        # over TCP): only what each interval added, so a process leaving the tree
        # unreaped takes nothing back; and its values at the samples in the window.
        self.used: tuple[float, int, int] = (0.0, 0, 0)
        self.hist: deque[tuple[float, tuple[float, int, int]]] = deque()
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
        net_busy: Bytes per second moved over the tree's TCP connections above
            which it is working. Each rate is averaged over the last 10 s (or
            `max_interval`, if shorter), and counts only while the last
            interval added to it.
        budget: The most of one core the sampler may use; with many trees
            it spaces samples out to stay under it...
        max_interval: ...but never further apart than this, even if it is
            shorter than `interval` (the critic passes a third of its idle
            timeout, so a working tree is always seen working well within it,
            at the cost of the budget); never closer than 0.05 s.
    """

    def __init__(self, probe: ProcessProbe | None = None, *, interval: float = 1.0,
                 cpu_busy: float = 0.02, io_busy: float = 16384.0, net_busy: float = 1024.0,
                 budget: float = 0.04, max_interval: float | None = None) -> None:
        self._probe = probe
        self.interval = interval
        self.cpu_busy = cpu_busy
        self.io_busy = io_busy
        self.net_busy = net_busy
        self.window = _WINDOW if max_interval is None else min(_WINDOW, max_interval)
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
        gone = [t for t in trees if t.sink is sink]
        trees[:] = [t for t in trees if t.sink is not sink]
        if not trees:
            del self._trees[root]
            # Nothing samples the tree any more: its cached handles go (a host that
            # runs many commands would otherwise keep one per process it ever saw).
            forget = getattr(self._probe, "forget", None)
            if forget is not None:
                with contextlib.suppress(Exception):
                    forget({root}.union(*(t.pids for t in gone)))

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
        return (sample.cpu_s - tree.cpu > 0 or sample.io_bytes - tree.io > 0
                or sample.net_bytes - tree.net > 0)

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
        cpu_rate = io_rate = net_rate = 0.0
        if tree.t is not None:
            dt = max(now - tree.t, 1e-9)
            # A tree only loses CPU seconds when a process leaves it unreaped: never negative.
            cpu_used = max(0.0, sample.cpu_s - tree.cpu)
            io_moved = max(0, sample.io_bytes - tree.io)
            net_moved = max(0, sample.net_bytes - tree.net)
            tree.intervals += 1
            if tree.intervals == 1:
                # The first interval holds the process's start-up (exec, dynamic loading,
                # imports): that is not work the run is doing, and counting it would
                # credit a process that went silent at once with a second of progress.
                # The windows start after it.
                cpu_rate, io_rate, net_rate = cpu_used / dt, io_moved / dt, net_moved / dt
            else:
                cpu, io, net = tree.used
                tree.used = (cpu + cpu_used, io + io_moved, net + net_moved)
                cpu_rate, io_rate, net_rate = self._rates(tree, now)
                # Over the window, and still going in the last interval.
                moving = ((io_rate >= self.io_busy and io_moved > 0)
                          or (net_rate >= self.net_busy and net_moved > 0))
                working = moving or (cpu_rate >= self.cpu_busy and cpu_used > 0)
                if working:
                    # When did the work happen? I/O at this rate is taken as ongoing;
                    # a burst of CPU (a start-up, then sleep) is placed at the start
                    # of the interval, as long as the CPU time it took: a sleeper is
                    # not credited with a second of work it did in 50 ms.
                    at = now if moving else tree.t + min(dt, cpu_used)
                    tree.last_working = max(tree.last_working, at)
        tree.t, tree.cpu, tree.io, tree.pids = now, sample.cpu_s, sample.io_bytes, sample.pids
        tree.net = sample.net_bytes
        if tree.intervals >= 1:
            tree.hist.append((now, tree.used))
        forget = getattr(self._probe, "forget", None)
        if gone and forget is not None:
            with contextlib.suppress(Exception):
                forget(gone)
        return Process(cpu_s=sample.cpu_s, cpu_rate=cpu_rate, io_rate=io_rate,
                       net_rate=net_rate,
                       procs=len(sample.pids), started=tree.started, exited=tree.exited,
                       working=working, waiting_input=bool(waits) and not working,
                       waits=waits, idle=now - tree.last_working)

    def _rates(self, tree: _Tree, now: float) -> tuple[float, float, float]:
        """The tree's CPU (cores), I/O and TCP (bytes/s) rates over the window: from
        the newest earlier sample at least that old, else the oldest kept."""
        hist = tree.hist
        since = now - self.window
        while len(hist) > 1 and hist[1][0] <= since:
            hist.popleft()
        if not hist:
            return 0.0, 0.0, 0.0
        t0, (cpu0, io0, net0) = hist[0]
        cpu, io, net = tree.used
        span = max(now - t0, 1e-9)
        return (cpu - cpu0) / span, (io - io0) / span, (net - net0) / span


def merge(figures: Iterable[Process]) -> Process | None:
    """Several trees' figures as one (a run may own more than one process)."""
    items = list(figures)
    if not items:
        return None
    if len(items) == 1:
        return items[0]
    return Process(
        cpu_s=sum(p.cpu_s for p in items), cpu_rate=sum(p.cpu_rate for p in items),
        io_rate=sum(p.io_rate for p in items), net_rate=sum(p.net_rate for p in items),
        procs=sum(p.procs for p in items),
        started=sum(p.started for p in items), exited=sum(p.exited for p in items),
        working=any(p.working for p in items),
        waiting_input=any(p.waiting_input for p in items) and not any(
            p.working for p in items),
        waits=tuple(w for p in items for w in p.waits),
        idle=min((p.idle for p in items), default=math.inf))
