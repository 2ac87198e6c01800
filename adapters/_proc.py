"""Starting, reading and stopping the processes adapters run: one place for all of them.

Every process an adapter starts (a plain command, a loop action, an agent
CLI, the LLM's shell tool) goes through `spawn`:

- It gets its own session, so it and everything it starts form one process
  group that `Child.stop` ends: SIGTERM, SIGKILL after a grace period, reap,
  and wait until none of its processes is alive (a killed process holds its
  files, a lock among them, until it is through its exit).
- It is started in the calling (trio) thread: `os.posix_spawnp` (or
  `subprocess.Popen` where it cannot say the same) forks with vfork, so
  this thread only waits for the exec, and a worker-thread round
  trip per spawn (what `trio.lowlevel.open_process` does) costs more than
  the start itself. Its pipes are trio streams on our own pipe ends, and its
  exit is awaited on a pidfd (a thread blocked in `waitid` where there is
  none).
- It dies with its supervisor. The first `spawn` in a process starts the
  *lifeline watcher* (`adapters/_lifeline.py`), a small Python process in its
  own session whose stdin is a pipe only this process writes to. Each child's
  group is registered on that pipe when it starts and unregistered when it is
  gone. When this process dies, even by SIGKILL, the pipe reaches end of
  file and the watcher SIGKILLs every registered group, then every process
  whose environment carries this process's lifeline token (`KERNEL_LIFELINE`,
  set in every child's environment), which covers a child started in the
  instant before its registration was written; it exits once they are gone.
  ARCHITECTURE.md says why this and not PR_SET_PDEATHSIG.
- `Child.record()` is what the audit keeps (`process_start` payload: pid,
  pgid, start time, boot id, host) so `kernel recover` can stop a group that
  survived anyway, and never a process that merely reuses its pid.

`pump_lines` splits a byte stream into lines for auditing (bounded, long
lines cut and flagged) while handing the raw bytes on untouched, and `Tail`
keeps the end of a stream.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import functools
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from kernel._dataclass import dataclass

#: The environment variable carrying the lifeline tokens of a child's supervisors.
LIFELINE_ENV = "KERNEL_LIFELINE"

_WATCHER = Path(__file__).with_name("_lifeline.py")


# ------------------------------------------------------------------ identity


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot, from /proc), or None (gone, not Linux).

    Read with `os.open`/`os.read` (one call reads the whole line, well under
    4 KiB): a buffered file object costs twice as much, once per command started.
    """
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    fields = data[data.rfind(b")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


@functools.cache
def boot_id() -> str | None:
    """This boot's id (Linux), so a record from before a reboot is never acted on.

    Read once per process: a process never outlives the boot it started in.
    """
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def group_members(pgid: int, newer_than: int | None = None) -> list[int]:
    """Live pids in process group `pgid` (Linux; empty elsewhere); with `newer_than`,
    only those above that pid (see `Child._newer_than`).

    A process counts until it is a zombie: one killed but still on its way out
    (tearing down its memory, held at exit by a tracer) still holds its files.
    """
    found: list[int] = []
    low = -1 if newer_than is None else newer_than
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) <= low:
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    data = f.read()
            except OSError:
                continue
            fields = data[data.rfind(b")") + 2:].split()
            with contextlib.suppress(IndexError, ValueError):
                if int(fields[2]) == pgid and fields[0] != b"Z":  # a zombie is dead already
                    found.append(int(name))
    return found


def live_group(record: Mapping[str, Any]) -> list[int]:
    """The pids still alive of a recorded process group (`Child.record()`), or [].

    A group counts as the recorded one only on this host and boot, with a
    recorded start time, and only if its leader still has that start time,
    or the leader is gone but members remain (Linux never hands out a pid
    that is still some group's id, so those members are the recorded
    group's; the one case this cannot tell apart is a reused pid whose new
    owner led a group, died, and left members behind).
    """
    try:
        pgid = int(record["pgid"])
    except (KeyError, TypeError, ValueError):
        return []
    if pgid <= 1 or record.get("host") not in (None, socket.gethostname()):
        return []
    if record.get("boot_id") is not None and record.get("boot_id") != boot_id():
        return []
    started = record.get("start_time")
    if started is None:
        return []  # nothing to tell the recorded process from a stranger: never touch it
    now = start_time(pgid)
    if now is not None and now != started:
        return []  # the pid was reused: not ours
    return group_members(pgid)


def stop_recorded(record: Mapping[str, Any]) -> int:
    """SIGKILL what is left of a recorded process group; returns how many pids it had."""
    members = live_group(record)
    if members:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(record["pgid"]), signal.SIGKILL)
    return len(members)


# ------------------------------------------------------------------ lifeline


class _Lifeline:
    """This process's watcher and the pipe to it (started on first use)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.fd: int | None = None
        self.watcher: subprocess.Popen[bytes] | None = None
        self.token = ""
        self.groups: dict[int, int | None] = {}
        self.gone: list[int] = []

    def forget(self) -> None:
        """In a forked child: the pipe, the watcher and the groups are the parent's."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
        self.lock = threading.Lock()
        self.fd = None
        self.watcher = None
        self.token = ""
        self.groups = {}
        self.gone = []

    def env_value(self, inherited: str | None) -> str:
        self.ensure()
        return f"{inherited}:{self.token}" if inherited else self.token

    def ensure(self) -> None:
        with self.lock:
            if self.fd is not None and self.watcher is not None and self.watcher.poll() is None:
                return
            # A watcher that cannot start (no Python to run it?) must not stop
            # the command: it runs unprotected, as it would have without one.
            with contextlib.suppress(OSError):
                self._start()

    def _start(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
        if not self.token:
            self.token = f"kl{os.getpid()}x{secrets.token_hex(8)}"
        read_end, write_end = os.pipe()  # both non-inheritable: no child keeps the pipe open
        try:
            self.watcher = subprocess.Popen(
                [sys.executable, "-I", "-S", str(_WATCHER), self.token], stdin=read_end,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                close_fds=True)
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        self.fd = write_end
        self.gone = []  # a new watcher hears of the live groups only
        for pgid, started in self.groups.items():
            self._write(f"+ {pgid} {'-' if started is None else started}\n")

    def _write(self, line: str) -> None:
        assert self.fd is not None
        with contextlib.suppress(BrokenPipeError):
            os.write(self.fd, line.encode())

    def add(self, pgid: int, started: int | None) -> None:
        with self.lock:
            self.groups[pgid] = started
            if self.fd is not None:
                # Removals wait for the next registration and share its write (one
                # wake-up of the watcher per spawn, not two): a stale entry is harmless,
                # the watcher kills a group only if its leader is still the process
                # registered (same start time).
                gone, self.gone = "".join(f"- {g}\n" for g in self.gone), []
                try:
                    os.write(self.fd, f"{gone}+ {pgid} {'-' if started is None else started}\n"
                             .encode())
                except BrokenPipeError:
                    # The watcher died: start another, told every live group.
                    with contextlib.suppress(OSError):
                        self._start()

    def remove(self, pgid: int) -> None:
        with self.lock:
            self.groups.pop(pgid, None)
            if self.fd is not None:
                self.gone.append(pgid)  # told to the watcher with the next `add`

    def flush(self) -> None:
        with self.lock:
            if self.fd is not None and self.gone:
                gone, self.gone = "".join(f"- {g}\n" for g in self.gone), []
                self._write(gone)


_LIFELINE = _Lifeline()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_LIFELINE.forget)


def lifeline_token() -> str:
    """This process's lifeline token (starting the watcher if needed)."""
    _LIFELINE.ensure()
    return _LIFELINE.token


def lifeline_env() -> str:
    """The `KERNEL_LIFELINE` value a child of this process carries (this process's
    supervisors' tokens and its own)."""
    return _LIFELINE.env_value(os.environ.get(LIFELINE_ENV))


def lifeline_add(pgid: int, started: int | None) -> None:
    """Register a process group this process started by other means than `spawn`
    (a forked worker in its own session): the watcher kills it if this process dies."""
    _LIFELINE.ensure()
    _LIFELINE.add(pgid, started)


def lifeline_release(pgid: int) -> None:
    """The group registered with `lifeline_add` is gone (reaped)."""
    _LIFELINE.remove(pgid)


def lifeline_flush() -> None:
    """Tell the watcher now of the groups that are gone (each is otherwise told with the
    next start). For a process about to exit: at the pipe's end the watcher checks
    every group still registered, a scan of /proc for each whose leader is gone."""
    _LIFELINE.flush()


# --------------------------------------------------------------------- child


class Child:
    """A started process and its group; `stop()` ends both.

    Its exit is waited for on a pidfd (Linux >= 5.3: readable once the
    process has exited, so waiting costs no thread), or else by a thread
    blocked in `waitid`.
    """

    def __init__(self, popen: _Started, started: int | None, *,
                 stdin: trio.abc.SendStream | None, stdout: trio.abc.ReceiveStream | None,
                 stderr: trio.abc.ReceiveStream | None) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.pgid = popen.pid  # a new session: the child leads its own group
        self.start_time = started
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self._pidfd = _pidfd_open(popen.pid)
        self._wait_lock = trio.Lock()
        self._released = False
        #: The child's own mark in its environment (`spawn(marked=True)`), else None.
        self.mark: str | None = None
        self._spawned_at = time.monotonic()

    @property
    def returncode(self) -> int | None:
        """The exit status once reaped: the code, or -N for a death by signal N."""
        return self._popen.returncode

    def record(self) -> dict[str, Any]:
        """What identifies this group later (the `process_start` event's payload keeps it)."""
        return {"pid": self.pid, "pgid": self.pgid, "start_time": self.start_time,
                "boot_id": boot_id(), "host": socket.gethostname()}

    def signal_group(self, sig: signal.Signals) -> bool:
        """Send `sig` to the whole group (quietly, if it is gone); whether it reached a
        process (a zombie counts: it is in the group until it is reaped)."""
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    async def wait(self) -> int:
        """Wait until the child exits, reap it, and return its `returncode`."""
        async with self._wait_lock:
            if self._popen.poll() is None:
                if self._pidfd is not None:
                    await trio.lowlevel.wait_readable(self._pidfd)
                else:
                    await trio.to_thread.run_sync(_waitid, self.pid, abandon_on_cancel=True)
                self._popen.wait()  # exited: reaps without blocking
            self._close_pidfd()
        rc = self._popen.returncode
        assert rc is not None
        return rc

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            fd, self._pidfd = self._pidfd, None
            trio.lowlevel.notify_closing(fd)
            os.close(fd)

    async def stop(self, grace: float) -> None:
        """SIGTERM the group, SIGKILL it after `grace` seconds, reap the child, and wait
        until no process of the group is alive (`_kill_group`).

        Safe to call more than once and from a cancelled scope (the caller
        shields it).
        """
        if self.returncode is None:
            self.signal_group(signal.SIGTERM)
            with trio.move_on_after(grace):
                await self.wait()
        self.signal_group(signal.SIGKILL)
        await self.wait()  # reaps it (and closes the pidfd) if nothing did yet
        await self._kill_group()
        self._release()

    def stop_reaped(self) -> bool:
        """`stop()` for a child already reaped, without awaiting (no scope, no lock);
        False if it is not reaped yet, or its group still has a process (then `await
        stop()`, which waits for it to be gone)."""
        if self._popen.returncode is None or self._pidfd is not None:
            return False
        if self.signal_group(signal.SIGKILL):
            return False
        self._release()
        return True

    async def _kill_group(self) -> None:
        """SIGKILL the group and wait until none of its processes is alive.

        A signal is only sent: a process it kills is gone only once it has left
        the kernel's exit path, and until then it holds what it held (a lock, a
        port, a file). Without this wait the next loop action could start while the
        last one's background child still held its lock: coreutils' `sleep`, like
        many programs, closes its stdout and stderr before it exits, so the pipes
        reach end of file (what `settle` waits for) while it still holds its other
        files, for ~0.2 ms, or as long as it is kept off the CPU on a loaded machine.
        No cost when the group is empty (the SIGKILL finds no process): a command
        that left nothing behind. A zombie is dead (its files are closed): not
        waited for. A process stuck in the kernel (uninterruptible I/O, a tracer
        holding it at exit) is waited for up to `_KILLED_WITHIN` seconds.
        """
        pause = 0.001
        deadline = trio.current_time() + _KILLED_WITHIN
        # Sent again each time: it also says whether the group has any process left.
        while self.signal_group(signal.SIGKILL):
            newer_than = self._newer_than()
            if newer_than is not None:  # the group's processes are the child's descendants
                members = group_members(self.pgid, newer_than)
            else:
                members = await trio.to_thread.run_sync(group_members, self.pgid)
            if not members or trio.current_time() >= deadline:
                return
            await trio.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _release(self) -> None:
        if not self._released:
            self._released = True
            _LIFELINE.remove(self.pgid)

    async def settle(self, drained: Callable[[], Awaitable[None]], grace: float, *,
                     linger: float = 0.2, done: Callable[[], bool] | None = None) -> None:
        """After the child exited: let its pipes drain, stopping leftovers that hold them.

        Waits `linger` seconds for `drained()` (the readers reaching end of
        file), then SIGTERMs the group and waits up to `grace` more, then
        SIGKILLs it and waits until none of its processes is alive (`_kill_group`:
        the pipes reaching end of file does not mean their writers are gone). `done()`
        says whether they are drained already (asked again after each of up to two
        passes of the scheduler; once it says so the group is signalled at once, with
        no timed wait set up).
        """
        if done is not None:
            # A child's pipes close before its pidfd is readable, so the readers
            # are usually woken with the exit or by the scheduler's next look at
            # the fds: two passes of it (a checkpoint each) let them reach end of
            # file before a timed wait is set up (1,000 short commands: without
            # them ~85 % of the commands took the timed waits, with them none).
            for _ in range(2):
                if done():
                    break
                await trio.lowlevel.checkpoint()
            if done():
                self.signal_group(signal.SIGTERM)
                await self._kill_group()
                return
        with trio.move_on_after(linger):
            await drained()
        self.signal_group(signal.SIGTERM)
        with trio.move_on_after(grace):
            await drained()
        await self._kill_group()


    async def sweep(self, grace: float) -> int:
        """Stop what the child started that left its group; how many processes that was.

        A daemon (`setsid`, a double fork into a session of its own) is out of
        reach of the group signals of `stop` and `settle`, and would otherwise
        live until the lifeline watcher's sweep at this process's exit: in a
        library host or a batch worker, long after the run. Every process whose
        environment holds the child's mark (`spawn(marked=True)`) is its
        descendant: they get SIGTERM, then SIGKILL after `grace` (those that
        fork meanwhile are found by a new look). One look when none escaped:
        only the pids newer than the child's, here (`_newer_than`), or all of
        /proc in a worker thread; a child without a mark has nothing to sweep.
        A descendant that cleared its environment escapes, as it escapes the
        watcher.
        """
        mark = self.mark
        if mark is None:
            return 0
        needle = mark.encode()
        newer_than = self._newer_than()
        if newer_than is not None:
            # Tens of environments: read here (~0.1 ms), without a trip to a worker
            # thread and back, which cost more than the look itself at every command.
            pids = marked_pids(needle, newer_than)
        else:
            pids = await trio.to_thread.run_sync(marked_pids, needle)
        if not pids:
            return 0
        seen = set(pids)
        await _terminate(pids, grace)
        for _ in range(50):  # until none is left (they may be forking)
            pids = await trio.to_thread.run_sync(marked_pids, needle)
            if not pids:
                break
            seen.update(pids)
            _signal_pids(pids, signal.SIGKILL)
            await trio.sleep(0.005)
        return len(seen)


    def _newer_than(self) -> int | None:
        """The pid every descendant's pid is above, if that can be known; else None.

        Pids are handed out in increasing order until they wrap at `pid_max`: a
        process the child started has a higher pid, unless the numbering wrapped
        since (the last pid handed out is then below the child's) or could have
        (the child ran for a minute: the first look reads every process). Most
        processes on a busy machine are older than a short command, so the look
        for its descendants reads tens of environments, not thousands (a batch of
        quick commands paid ~1 ms of CPU each for reading them all).
        """
        if time.monotonic() - self._spawned_at > 60:
            return None
        last = _last_pid()
        return self.pid if last is not None and last >= self.pid else None


#: How long a SIGKILLed group is waited for (`Child._kill_group`): only a process stuck
#: in the kernel (uninterruptible I/O, a tracer holding it at exit) takes more than
#: milliseconds; past this the caller goes on without it.
_KILLED_WITHIN = 10.0


def _last_pid() -> int | None:
    """The pid the kernel handed out last (`/proc/loadavg`'s last field), if readable."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def marked_pids(needle: bytes, newer_than: int | None = None) -> list[int]:
    """Live pids (not this one) whose environment holds `needle` (Linux; [] elsewhere);
    with `newer_than`, only those above that pid (see `Child._newer_than`).

    A zombie's environment reads empty: a dead process is never listed.
    """
    me = os.getpid()
    low = -1 if newer_than is None else newer_than
    found: list[int] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        if pid <= low or pid == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env:
            found.append(pid)
    return found


async def _terminate(pids: Sequence[int], grace: float) -> None:
    """SIGTERM `pids` and wait up to `grace` seconds for them to exit.

    Through pidfds where there are some (the signal cannot reach a process that
    took over a pid freed meanwhile, and the wait is for the exit itself);
    else by pid, looking at /proc every 20 ms.
    """
    fds: list[int] = []
    if _PIDFD:
        for pid in pids:
            with contextlib.suppress(OSError):  # gone already
                fds.append(os.pidfd_open(pid))
    try:
        if not fds:
            _signal_pids(pids, signal.SIGTERM)
        for fd in fds:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(fd, signal.SIGTERM)
        with trio.move_on_after(grace):
            for fd in fds:
                await trio.lowlevel.wait_readable(fd)
            while not fds and any(_alive(pid) for pid in pids):  # noqa: ASYNC110 (no event)
                await trio.sleep(0.02)
    finally:
        for fd in fds:
            trio.lowlevel.notify_closing(fd)
            os.close(fd)


def _signal_pids(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie is dead: it waits only for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2:][:1] != b"Z"


def _pidfd_open(pid: int) -> int | None:
    """A pidfd for `pid` (non-blocking, close-on-exec), or None where there are none."""
    global _PIDFD
    if _PIDFD:
        try:
            return os.pidfd_open(pid)
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                # Exited and already reaped by someone else (a SIGCHLD ignored in a
                # thread that could not set it back, a host's own `wait`): the process
                # did start, so this is no reason to say it could not; `wait` finds it
                # gone.
                return None
            if exc.errno not in (errno.ENOSYS, errno.EPERM, errno.EINVAL):
                raise
            _PIDFD = False  # an old kernel (or a sandbox refusing the call): wait in a thread
    return None


_PIDFD = hasattr(os, "pidfd_open")


def _waitid(pid: int) -> None:
    """Block until `pid` has exited, leaving it to be reaped (no pidfd to wait on)."""
    with contextlib.suppress(ChildProcessError):
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


def _pipe(*, read_end: bool) -> tuple[int, int]:
    """A pipe: (our end, the child's end). Both are close-on-exec: the child gets
    its end as fd 0, 1 or 2 (which `Popen` makes inheritable), nothing else does."""
    r, w = os.pipe()
    return (r, w) if read_end else (w, r)


def cannot_start(argv0: str, exc: OSError, cwd: str | None = None) -> tuple[str, int]:
    """Why `argv0` could not be started, as one line, and the shell's exit code for it.

    127 when nothing by that name was found, 126 when it was found but cannot
    be run; the line says which of the usual slips it was: a directory, a
    file that is not executable, a file in the working directory that is not
    on PATH, a loop file given as a command.
    """
    code = 127 if isinstance(exc, FileNotFoundError) else 126
    why = exc.strerror or str(exc)
    here = os.path.join(cwd or ".", argv0)
    loop_file = argv0.lower().endswith((".yaml", ".yml")) and os.path.isfile(here)
    if os.path.isdir(here) and (os.sep in argv0 or argv0 in (".", "..")):
        why = "it is a directory"
    elif loop_file:
        why += (f" ({argv0} is a file, not a command: a loop file runs as "
                f"`kernel run {argv0}`, without `--`)")
    elif code == 127 and os.sep not in argv0 and os.path.isfile(here):
        why = f"not found on PATH (a file of that name is here: ./{argv0} runs it)"
    elif code == 126 and os.path.isfile(here) and not os.access(here, os.X_OK):
        why += " (the file is not executable)"
    return f"cannot start {argv0!r}: {why}", code


async def spawn(argv: Sequence[str], *, cwd: str | None = None,
                env: Mapping[str, str] | None = None, stdin_pipe: bool = False,
                merge_stderr: bool = False, inherit_stdin: bool = False,
                marked: bool = False) -> Child:
    """Start `argv` in its own session, tied to this process's lifeline.

    The process is started in this thread (`os.posix_spawnp`, or `Popen`
    where that cannot say the same; both fork with vfork on Linux: the parent
    only waits for the exec), not in a worker
    thread; its pipes are trio streams and its exit is waited for on a pidfd.

    Args:
        argv: The command and its arguments.
        cwd: Working directory (default: the current one).
        env: The child's whole environment (default: this process's).
        stdin_pipe: Give the child a stdin pipe (else /dev/null).
        inherit_stdin: Give the child this process's own stdin (a pipe, a file,
            a terminal), as timeout(1) does; wins over `stdin_pipe`.
        merge_stderr: Send stderr into the stdout pipe (else a pipe of its own).
        marked: Give the child a mark of its own in its environment (`Child.mark`,
            inherited by everything it starts), so that `Child.sweep` finds its
            descendants that left its group.

    Raises:
        OSError: The command cannot be started (not found, not executable).
    """
    _keep_exit_statuses()  # (before the lifeline watcher may be started, too)
    mark = f"kc{secrets.token_hex(8)}" if marked else None
    base = _child_env(env, mark)
    await trio.lowlevel.checkpoint()
    popen, ours = _start(argv, cwd, base, stdin_pipe=stdin_pipe and not inherit_stdin,
                         merge_stderr=merge_stderr, inherit_stdin=inherit_stdin)
    started = start_time(popen.pid)
    _LIFELINE.add(popen.pid, started)
    streams = [trio.lowlevel.FdStream(fd) for fd in ours]
    child = Child(popen, started,
                  stdin=streams.pop(0) if stdin_pipe and not inherit_stdin else None,
                  stdout=streams.pop(0), stderr=None if merge_stderr else streams.pop(0))
    child.mark = mark
    return child


def _keep_exit_statuses() -> None:
    """Refuse to start a child while SIGCHLD is ignored in this process.

    SIG_IGN for SIGCHLD makes the system reap every child the moment it exits:
    its exit status is gone (a command that exited 7 read as one that could not
    start, or as a success). A library must not change the host's disposition
    (a host that ignores SIGCHLD relies on its own children being reaped), so
    it says so instead; the `kernel` CLI, which owns its process, sets the
    default back at start-up (`kernel_cli.app.main`), since the disposition is
    inherited through exec from whatever started it. Checked at each start (a
    lookup), since a host may change it between starts.

    Raises:
        ChildProcessError: SIGCHLD is ignored.
    """
    sig = getattr(signal, "SIGCHLD", None)
    if sig is not None and signal.getsignal(sig) == signal.SIG_IGN:
        raise ChildProcessError(
            "SIGCHLD is ignored in this process, so a command's exit status cannot be "
            "read: set it back to the default (signal.signal(signal.SIGCHLD, "
            "signal.SIG_DFL)) before starting commands")


_LIFELINE_KEY = LIFELINE_ENV.encode()


def _child_env(env: Mapping[str, str] | None, mark: str | None = None) -> dict[bytes, bytes]:
    """The child's environment as bytes (what exec takes), with the lifeline tokens
    (and the child's own `mark` after them, if it has one).

    Without `env`, a copy of this process's own: CPython keeps it as bytes
    behind `os.environ` (`_data`, which `os.environb` shares), copied whole
    rather than decoded and encoded again a variable at a time (~40 of them,
    for every process a batch starts).
    """
    if env is None:
        data = getattr(os.environ, "_data", None)
        base: dict[bytes, bytes] = dict(data) if isinstance(data, dict) \
            else dict(os.environb)
    else:
        base = {os.fsencode(k): os.fsencode(v) for k, v in env.items()}
    inherited = base.get(_LIFELINE_KEY)
    value = _LIFELINE.env_value(None if inherited is None else os.fsdecode(inherited))
    base[_LIFELINE_KEY] = os.fsencode(value if mark is None else f"{value}:{mark}")
    return base


def _start(argv: Sequence[str], cwd: str | None, env: Mapping[bytes, bytes], *,
           stdin_pipe: bool, merge_stderr: bool, inherit_stdin: bool,
           ) -> tuple[_Started, list[int]]:
    """Fork and exec `argv` in a new session; (the process, our ends of its pipes).

    Our ends are in the order stdin (if piped), stdout, stderr (unless merged).
    """
    ours: list[int] = []  # closed again if the start fails
    theirs: list[int] = []  # the child's ends, closed here once it has them
    try:
        stdin: int | None = None if inherit_stdin else subprocess.DEVNULL
        if stdin_pipe:
            w, stdin = _pipe(read_end=False)
            ours.append(w)
            theirs.append(stdin)
        out_r, out_w = _pipe(read_end=True)
        ours.append(out_r)
        theirs.append(out_w)
        err_w: int = subprocess.STDOUT
        if not merge_stderr:
            err_r, err_w = _pipe(read_end=True)
            ours.append(err_r)
            theirs.append(err_w)
        proc: _Started | None = None
        if _SPAWN and min(theirs) > 2 and (_CLOEXEC_ALL is not None
                                           or max(theirs) < _SPAWN_MAX_FD):
            proc = _posix_spawn(argv, cwd, env, stdin, out_w, err_w)
        if proc is None:
            proc = subprocess.Popen(list(argv), stdin=stdin, stdout=out_w, stderr=err_w,
                                    cwd=cwd, env=env, start_new_session=True)
    except BaseException:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    return proc, ours


class _Spawned:
    """A process `os.posix_spawn` started: what `Child` uses of a `Popen`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else (SIGCHLD ignored)
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        while self.returncode is None:
            try:
                _, status = os.waitpid(self.pid, 0)
            except ChildProcessError:
                self.returncode = 0
            except InterruptedError:  # pragma: no cover - PEP 475 retries it already
                continue
            else:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


_Started = subprocess.Popen[bytes] | _Spawned

#: `os.posix_spawn` with what a start needs (Linux; glibc's vfork-like clone): a
#: third of `Popen`'s CPU per start, which does its bookkeeping in Python.
_SPAWN = sys.platform == "linux" and hasattr(os, "posix_spawnp") \
    and hasattr(os, "POSIX_SPAWN_DUP2")
#: Above this many open fds, listing them for each start costs more than `Popen`
#: (which closes them in the child with one `close_range`): a process running
#: thousands of commands at once starts them with `Popen`. The lowest free fd
#: (a new pipe's) is a lower bound of how many are open.
_SPAWN_MAX_FD = 256


def _posix_spawn(argv: Sequence[str], cwd: str | None, env: Mapping[bytes, bytes],
                 stdin: int | None, out_w: int, err_w: int) -> _Spawned | None:
    """Start `argv` as `Popen` would (new session, fds 0-2 set, every other fd closed,
    SIGPIPE and SIGXFSZ back to their defaults), or None where this cannot say
    the same thing: another working directory (posix_spawn has no chdir here) or
    a PATH of the child's own (Popen looks the command up there). Popen closes
    every other fd in the child; here those a child would inherit (Python opens
    its own close-on-exec; a parent shell or a C library may leave some
    inheritable) are listed and closed by the spawn."""
    if cwd is not None:
        try:
            if not os.path.samestat(os.stat(cwd), os.stat(".")):
                return None
        except OSError:
            return None  # Popen says what is wrong with it
    if "/" not in argv[0] and env.get(b"PATH") != _environ_bytes().get(b"PATH"):
        return None
    actions: list[tuple[Any, ...]]
    if _CLOEXEC_ALL is not None and _CLOEXEC_ALL() == 0:
        actions = []  # nothing above fd 2 survives the exec
    else:
        inheritable = _inheritable_fds()
        if inheritable is None:
            return None
        actions = [(os.POSIX_SPAWN_CLOSE, fd) for fd in inheritable]
    if stdin == subprocess.DEVNULL:
        actions.append((os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDWR, 0))
    elif stdin is not None:
        actions.append((os.POSIX_SPAWN_DUP2, stdin, 0))
    actions.append((os.POSIX_SPAWN_DUP2, out_w, 1))
    actions.append((os.POSIX_SPAWN_DUP2, out_w if err_w == subprocess.STDOUT else err_w, 2))
    pid = os.posix_spawnp(argv[0], list(argv), env, file_actions=actions, setsid=True,
                          setsigdef=_DEFAULTED)
    return _Spawned(pid)


#: Signals Python ignores that a started command gets back as default (Popen's
#: restore_signals).
_DEFAULTED = tuple(getattr(signal, n) for n in ("SIGPIPE", "SIGXFSZ") if hasattr(signal, n))


def _environ_bytes() -> Mapping[bytes, bytes]:
    data = getattr(os.environ, "_data", None)
    return data if isinstance(data, dict) else os.environb


#: Set by `own_fds`: makes every fd above 2 close-on-exec, 0 when it did.
_CLOEXEC_ALL: Callable[[], int] | None = None


def own_fds(on: bool = True) -> bool:
    """Say this process owns its file descriptors (a `kernel` command's own process, not
    a library host's): before each start, every fd above 2 is then made close-on-exec
    with one `close_range(3, ~0, CLOSE_RANGE_CLOEXEC)` call instead of being listed in
    /proc/self/fd and the inheritable ones closed by the spawn, a listing that costs
    ~0.05 ms a start with the ~50 fds a batch worker holds. No fd of the process stays
    inheritable afterwards, which a host that passes fds to its own children would
    not want: hosts never call this. Forked processes keep the setting.

    Returns whether it is on (False where the kernel has no `close_range`, Linux < 5.11,
    or with `on=False`: every start lists the fds again).
    """
    global _CLOEXEC_ALL
    _CLOEXEC_ALL = None
    if not on or sys.platform != "linux":
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    call = getattr(libc, "close_range", None)
    if call is not None:
        call.argtypes = (ctypes.c_uint, ctypes.c_uint, ctypes.c_int)
        call.restype = ctypes.c_int
        cloexec = functools.partial(call, 3, 0xFFFFFFFF, _CLOSE_RANGE_CLOEXEC)
    else:  # a C library older than the call (glibc < 2.34): the system call itself
        cloexec = functools.partial(libc.syscall, _SYS_CLOSE_RANGE, 3, ctypes.c_uint(0xFFFFFFFF),
                          _CLOSE_RANGE_CLOEXEC)
    if cloexec() != 0:
        return False
    _CLOEXEC_ALL = cloexec
    return True


#: linux/close_range.h, and the call's number (the same on every architecture).
_CLOSE_RANGE_CLOEXEC = 1 << 2
_SYS_CLOSE_RANGE = 436


def _inheritable_fds() -> list[int] | None:
    """This process's fds above 2 open without close-on-exec (None: /proc cannot say,
    or too many are open to list them for every start)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    if len(names) > _SPAWN_MAX_FD:
        return None
    found: list[int] = []
    for name in names:
        fd = int(name)
        if fd > 2:
            try:
                if os.get_inheritable(fd):
                    found.append(fd)
            except OSError:  # the listing's own fd, closed again
                continue
    return found


# --------------------------------------------------------------------- lines

#: Called with (raw line bytes without the newline, whether it was cut).
LineHandler = Callable[[bytes, bool], None]
#: Called with each raw chunk exactly as read.
#: Gets each chunk read; may return an awaitable, awaited before the next read: a sink
#: that applies backpressure (an echo into a pipe nobody reads) slows the reading,
#: instead of blocking the whole trio thread (deadlines, signals, the critic).
ChunkHandler = Callable[[bytes], Awaitable[None] | None]
#: Called with the bytes of a line not ended yet that one read brought.
PartialHandler = Callable[[bytes], None]


class Progress:
    """How reading a command's pipes goes (`pump_lines(progress=)`), for
    `drain_while_moving`: bytes read so far, and how many readers wait on their sink
    (an echo into a full pipe) rather than on the pipe."""

    __slots__ = ("bytes", "in_sink")

    def __init__(self) -> None:
        self.bytes = 0
        self.in_sink = 0


async def drain_while_moving(drained: Callable[[], Awaitable[object]],
                             done: Callable[[], bool], progress: Progress,
                             quiet: float = 1.0) -> bool:
    """Wait until the pipes are read to their end (`done`) while that can still happen:
    False once `quiet` seconds pass with nothing read and no reader waiting on its
    sink (the pipes are held open by a process nobody can stop).

    A reader waiting on its sink is output read more slowly than the command wrote
    it (an echo into a pipe its reader reads slowly, or not yet: backpressure).
    That is waited for, as the command itself would have waited to write it; a
    fixed bound cut such output short, silently, echo and audit alike. Not
    shielded: the run's deadline and Ctrl-C still end the wait.
    """
    while not done():
        seen = progress.bytes
        with trio.move_on_after(quiet):
            await drained()
        if not done() and progress.bytes == seen and not progress.in_sink:
            return False
    return True


async def pump_lines(stream: trio.abc.ReceiveStream, on_line: LineHandler, *,
                     max_line: int, on_chunk: ChunkHandler | None = None,
                     on_partial: PartialHandler | None = None,
                     progress: Progress | None = None) -> bool:
    """Read `stream` to its end, calling `on_line` per line; True if it ended with a newline.

    `on_chunk` gets every byte untouched (for a byte-exact echo). A line
    longer than `max_line` bytes is handed on once, cut to `max_line` and
    flagged, and the rest of it is skipped up to its newline, so memory stays
    bounded whatever the stream holds and one long line stays one line.
    `on_partial` gets, after each read that leaves a line unended, the bytes
    of that line the read brought (a progress display redrawn with `\r`, dots
    printed one by one: output that is not a line yet); lines are still
    handed to `on_line` whole.
    """
    pending = bytearray()
    cutting = False  # inside a long line whose head was already handed on
    while chunk := await stream.receive_some(65536):
        if on_chunk is not None:
            waiting = on_chunk(bytes(chunk))
            if waiting is not None:
                if progress is None:
                    await waiting
                else:
                    progress.in_sink += 1
                    try:
                        await waiting
                    finally:
                        progress.in_sink -= 1
        if progress is not None:
            progress.bytes += len(chunk)
        pending += chunk
        start = 0
        while (nl := pending.find(b"\n", start)) >= 0:
            if not cutting:
                line = bytes(pending[start:nl])
                on_line(line[:max_line], len(line) > max_line)
            cutting = False
            start = nl + 1
        del pending[:start]
        if len(pending) > max_line:
            if not cutting:
                on_line(bytes(pending[:max_line]), True)
                cutting = True
            del pending[:]
        if on_partial is not None and pending and not cutting:
            on_partial(bytes(pending[-len(chunk):]))  # (all of it when the read had no newline)
    if pending and not cutting:
        on_line(bytes(pending), False)
    return not pending and not cutting


class PartialLine:
    """What a line being written shows before its newline, for the critic.

    A progress display redraws one line with carriage returns (`\r3/12`,
    tqdm) or backspaces, or adds to it (dots, one by one) and ends it much
    later, if ever. `feed` takes the bytes of the line one read brought and
    returns the text the critic should judge as new or not, like a line: after
    a redraw, what the line shows now (a spinner's frames are the same text, a
    counter's are not); after characters were added, what it shows with its
    length (`12 chars: .........`: dots are progress, while a line written in
    two pieces shows the same text each time it is written again). None when
    nothing visible changed. `end` at its newline. Bounded: only the last
    `limit` characters shown are kept.
    """

    __slots__ = ("_at_start", "_decoder", "_length", "_shown", "limit")

    def __init__(self, limit: int = 512) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._shown = ""
        self._length = 0  # characters the line shows (`_shown` keeps the last `limit`)
        self._at_start = False  # the last byte was a `\r`: what comes next is drawn over
        self.limit = limit

    def end(self) -> None:
        """The line ended: the next bytes start a new one."""
        self._decoder.reset()
        self._shown = ""
        self._length = 0
        self._at_start = False

    def feed(self, data: bytes) -> str | None:
        """The bytes `data` of the line: what it shows now, or None if nothing visible changed."""
        text = self._decoder.decode(data)
        if not text:
            return None
        if not self._at_start and "\r" not in text and "\b" not in text:
            self._shown = (self._shown + text)[-self.limit:]
            self._length += len(text)
            return f"{self._length} chars: {self._shown}" if text.strip() else None
        shown, length = self._shown, self._length
        for i, segment in enumerate(text.split("\r")):
            if not segment:
                continue
            # After a `\r` the line is drawn over from its start: what it shows is
            # taken to be the new text (as `line_key` takes a line's last segment).
            if i > 0 or self._at_start:
                shown, length = segment, len(segment)
            else:
                shown, length = shown + segment, length + len(segment)
            self._at_start = False
        self._at_start = text.endswith("\r")
        if "\b" in shown:  # a backspace takes back the character before it
            pieces = shown.split("\b")
            shown = pieces[0]
            for piece in pieces[1:]:
                shown = shown[:-1] + piece
            length = len(shown)
        self._shown, self._length = shown[-self.limit:], length
        return self._shown if self._shown.strip() else None


def decode_line(raw: bytes) -> str:
    """A line's text: invalid UTF-8 replaced, a trailing CR dropped."""
    return raw.decode("utf-8", errors="replace").rstrip("\r")


# Where a text cut at its front may start: not inside a token.
_TOKEN_END = re.compile(r"[\s\"',;<>()\[\]{}|`]")


#: A cut text starting with a longer token than this keeps it: a blob of data
#: (one long line of output), not a secret (a JSON web token is shorter).
_LONGEST_TOKEN = 2048


def from_boundary(text: str) -> str:
    """`text`, which was cut at its front, from its first token boundary on.

    The partial token before it is dropped: it may be the end of a secret
    whose start, the part the redactor knows (`ghp_`, `-----BEGIN`), was cut off.
    """
    m = _TOKEN_END.search(text, 0, _LONGEST_TOKEN)
    return text if m is None else text[m.start():]


def last_chars(text: str, limit: int) -> str:
    """The last `limit` characters of `text`, starting at a token boundary if cut."""
    return text if len(text) <= limit else from_boundary(text[-limit:])


class Tail:
    """The last `limit` characters of a stream, kept as lines.

    Whole lines go from the front first; when dropping the oldest line would
    take more than needed, its head is trimmed instead (up to a token
    boundary: `from_boundary`), so a long line before a short one is not lost
    whole. The newest line is always kept.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lines: deque[str] = deque()
        self.size = 0
        self.truncated = False

    def add(self, line: str) -> None:
        self.lines.append(line)
        self.size += len(line) + 1
        while self.size > self.limit and len(self.lines) > 1:
            self.truncated = True
            excess = self.size - self.limit
            front = self.lines[0]
            if len(front) + 1 <= excess:
                self.size -= len(self.lines.popleft()) + 1
            else:
                kept = from_boundary(front[excess:])
                self.lines[0] = kept
                self.size -= len(front) - len(kept)

    def text(self, trailing_newline: bool = False) -> str:
        body = "\n".join(self.lines)
        return body + "\n" if body and trailing_newline else body


@dataclass
class LineCounter:
    """Per-run audit of output lines: the first `cap` become events, the rest are counted."""

    cap: int
    audited: int = 0
    dropped: int = 0

    def take(self) -> bool:
        """True if this line should become an event; else it is counted as not audited."""
        if self.audited < self.cap:
            self.audited += 1
            return True
        self.dropped += 1
        return False
