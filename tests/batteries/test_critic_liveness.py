"""The critic's liveness evidence for real processes: what a review with real
commands found it could not see, or misread.

- **TCP traffic.** A download reads its bytes with `recv`, which `/proc/PID/io`
  does not count: a silent client receiving 4 KiB/s was killed `stalled`. The
  probe now reads each tree's TCP sockets' byte counters (the kernel's socket
  diagnostics, as `ss -ti`), averaged over a window so a poll or a health check
  every half minute is not taken for a download.
- **Start-up reads of short-lived children.** A process's I/O counters gather
  its reaped children's, and a child's dynamic loader reads every library it
  links: `while [ ! -e f ]; do sleep 0.1; done` read ~100 KB/s and was
  *working* forever. Reads now count per live thread from its first sample on;
  writes still count with the reaped children's (a quick `head > file`).
- **Redraws to column 1.** A spinner redrawn with `ESC[1G` (node's
  `readline.cursorTo(stream, 0)`) instead of `\\r` looked new at every frame.
- **A line in two pieces.** A status line whose newline reached the reader a
  read after its text was shown as a partial line (`22 chars: still waiting
  12:00:05`) and counted as new output once: a stuck `still waiting HH:MM:SS`
  loop was killed a second or two late, past the corpus's latency target.
- **CPU read in 10 ms ticks.** A shell wait loop costs ~1.3 % of a core; read a
  second at a time on the kernel's 10 ms clock, some seconds show 2 or 3 %, at
  or over the 2 % threshold: under the default 300 s idle timeout such a
  second came every minute and the loop was never stalled. Every rate is now
  averaged over 10 s (a third of the idle timeout, if shorter).
- **Forgetting.** The sampler kept the probe's handles of every tree it had
  stopped sampling (a host running many commands grew without bound).

Virtual time (`autojump_clock`) for the rules, a hand-written probe for the
figures; the real-process tests wait for readiness (a line, a connection) and
poll with a generous bound.
"""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import trio

from adapters._proc import PartialLine
from batteries.critic import (
    STALLED,
    CriticPolicy,
    Novelty,
    ProcessSampler,
    PsutilProbe,
    TreeSample,
    WatchCritic,
    line_key,
)
from kernel import Kernel, Limits, Ports, RunContext, RunInfo, Status, Step
from kernel.testing import AuditEvent, MemoryAudit

IDLE = CriticPolicy(idle_timeout=3, grace=1, soft_timeout=None)
BOUND = 60.0  # seconds a real process may take to show something on a loaded machine


class NetProbe:
    """A flat tree (no CPU, no I/O) whose TCP byte count is `net(seconds since start)`."""

    threaded = False

    def __init__(self, net: Callable[[float], int]) -> None:
        self.net = net
        self.t0: float | None = None
        self.forgotten: set[int] = set()

    def elapsed(self) -> float:
        now = trio.current_time()
        if self.t0 is None:
            self.t0 = now
        return now - self.t0

    def sample(self, root: int) -> TreeSample | None:
        return TreeSample(0.0, 0, frozenset({root}), net_bytes=self.net(self.elapsed()))

    def input_waits(self, pids: Iterable[int]) -> tuple[str, ...]:
        return ()

    def forget(self, pids: Iterable[int]) -> None:
        self.forgotten.update(pids)


class SilentCommand:
    """A one-step agent standing for a command: registers pid 4242, prints nothing."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    async def step(self, ctx: RunContext) -> Step:
        ctx.process_started(4242)
        try:
            await trio.sleep(self.seconds)
        finally:
            ctx.process_exited(4242)
        return Step(final=True, exit_code=0)


async def run(seconds: float, probe: NetProbe, policy: CriticPolicy = IDLE
              ) -> tuple[Any, list[AuditEvent]]:
    audit = MemoryAudit()
    critic = WatchCritic(policy, probe=probe)
    result = await Kernel(Ports(audit=audit, critic=critic)).run(
        SilentCommand(seconds), RunInfo(name="t"), Limits(timeout=3600))
    decisions = [e for e in audit.events(result.run_id)
                 if e.kind == "critic" and e.name != "watch"]
    return result, decisions


def trickle(rate: int, *, until: float = 1e9) -> Callable[[float], int]:
    """`rate` bytes a second, continuously, until `until` s."""
    return lambda t: int(min(t, until) * rate)


class TestNetworkTraffic:
    async def test_a_silent_slow_download_is_working(
            self, autojump_clock: trio.abc.Clock) -> None:
        """2 KiB/s over TCP, no CPU, no read/write calls: 60 s under `--idle-timeout 3`."""
        result, decisions = await run(60, NetProbe(trickle(2048)))
        assert result.status is Status.OK and decisions == []

    async def test_a_download_that_stops_dead_is_stalled(
            self, autojump_clock: trio.abc.Clock) -> None:
        result, decisions = await run(600, NetProbe(trickle(2048, until=10)))
        assert result.status is Status.KILLED and result.reason == STALLED
        # Moving until 10 s; then 3 s idle + 1 s grace (the last interval's traffic
        # is credited at its end: at most a sample later).
        assert 14 <= result.runtime_seconds <= 15.5
        proc = decisions[-1].payload["evidence"]["process"]
        assert proc["net_bytes_per_s"] == 0 and proc["working"] is False

    async def test_a_heartbeat_is_not_traffic(self, autojump_clock: trio.abc.Clock) -> None:
        """A few bytes a second (a keep-alive, a heartbeat) stay under `net_busy`."""
        result, _ = await run(600, NetProbe(trickle(64)))
        assert result.status is Status.KILLED and result.reason == STALLED
        assert result.runtime_seconds == 4

    async def test_a_poll_every_half_minute_is_not_a_download(
            self, autojump_clock: trio.abc.Clock) -> None:
        """4 KiB in one burst every 30 s: each burst is 4 KiB/s over its one-second
        sample, but 410 B/s over the 10 s window: flat, and killed at 60 + 15 s."""
        policy = CriticPolicy(idle_timeout=60, grace=15, soft_timeout=None)
        result, decisions = await run(
            3000, NetProbe(lambda t: 4096 * int(t // 30)), policy)
        assert result.status is Status.KILLED and result.reason == STALLED
        assert result.runtime_seconds == 75
        assert [d.name for d in decisions] == ["steer", "kill"]

    async def test_a_steady_stream_runs_under_the_defaults(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A streamed reply at 1.5 KiB/s for 15 minutes, silent: never stalled (the
        progress review at 600 s extends it)."""
        result, decisions = await run(900, NetProbe(trickle(1536)), CriticPolicy())
        assert result.status is Status.OK
        assert [(d.name, d.payload["reason"]) for d in decisions] == [
            ("extend", "progressing")]

    def test_net_busy_is_a_policy_threshold(self) -> None:
        assert CriticPolicy().net_busy == 1024.0
        assert CriticPolicy().as_dict()["net_busy"] == 1024.0
        for bad in (0, -1.0, float("nan"), True):
            try:
                CriticPolicy(net_busy=bad)
            except Exception as exc:  # ConfigError
                assert "net_busy" in str(exc)
            else:
                raise AssertionError(f"net_busy={bad!r} accepted")


class CpuProbe(NetProbe):
    """A silent tree whose CPU seconds are `cpu(seconds since start)`."""

    def __init__(self, cpu: Callable[[float], float]) -> None:
        super().__init__(lambda t: 0)
        self.cpu = cpu

    def sample(self, root: int) -> TreeSample | None:
        return TreeSample(self.cpu(self.elapsed()), 0, frozenset({root}))


def ticks(share: float) -> Callable[[float], float]:
    """CPU seconds of a tree using `share` of a core, as the kernel counts it: whole
    10 ms ticks (so some seconds of a 1.3 % loop show 2 ticks, others 1)."""
    return lambda t: 0.01 * math.floor(t * share * 100)


class TestCpuTicks:
    async def test_a_wait_loop_at_one_percent_is_stalled_under_the_defaults(
            self, autojump_clock: trio.abc.Clock) -> None:
        """1.3 % of a core: a third of its seconds show 2 ticks (2 %), none is work."""
        result, decisions = await run(3000, CpuProbe(ticks(0.013)),
                                      CriticPolicy())
        assert result.status is Status.KILLED and result.reason == STALLED
        assert result.runtime_seconds == 360  # 300 s idle + 60 s grace
        assert decisions[-1].payload["evidence"]["process"]["cpu_rate"] < 0.02

    async def test_a_light_steady_worker_runs_under_the_defaults(
            self, autojump_clock: trio.abc.Clock) -> None:
        """3 % of a core, all the time (a light build): working."""
        result, decisions = await run(900, CpuProbe(ticks(0.03)),
                                      CriticPolicy())
        assert result.status is Status.OK
        assert [d.name for d in decisions] == ["extend"]

    async def test_work_after_a_busy_process_left_the_tree_counts(
            self, autojump_clock: trio.abc.Clock) -> None:
        """A process with 50 CPU seconds leaves the tree unreaped at 20 s (the sum
        drops); the rest works on at half a core: never flat."""
        def cpu(t: float) -> float:
            return 0.5 * t - (50.0 if t >= 20 else 0.0)

        policy = CriticPolicy(idle_timeout=30, grace=5, soft_timeout=None)
        result, decisions = await run(120, CpuProbe(cpu), policy)
        assert result.status is Status.OK and decisions == []


class TestForgetting:
    async def test_a_tree_no_longer_sampled_is_forgotten(
            self, autojump_clock: trio.abc.Clock) -> None:
        """The probe's handles of a tree go when its last run stops sampling it."""
        probe = NetProbe(trickle(4096))
        result, _ = await run(5, probe)
        assert result.status is Status.OK
        assert 4242 in probe.forgotten

    async def test_a_tree_two_runs_sample_is_kept_for_the_other(
            self, autojump_clock: trio.abc.Clock) -> None:
        probe = NetProbe(trickle(4096))
        sampler = ProcessSampler(probe)

        def one(_: Any) -> None: ...

        def two(_: Any) -> None: ...

        sampler.register(7, one)
        sampler.register(7, two)
        await trio.sleep(3)
        sampler.unregister(7, one)
        assert probe.forgotten == set()
        sampler.unregister(7, two)
        assert probe.forgotten == {7}


class TestRedrawToColumnOne:
    def test_line_key_reads_esc_1g_as_a_redraw(self) -> None:
        assert line_key("\x1b[1G\x1b[2K| Waiting for the lock") == "Waiting for the lock"
        assert line_key("old text\x1b[1G\x1b[2K/ Waiting for the lock") == (
            "Waiting for the lock")
        for move in ("\x1b[G", "\x1b[0G", "\x1b[1G"):
            assert line_key(f"3/12{move}4/12") == "4/12"
        assert line_key("a\x1b[5Gb") == "ab"  # another column: not a redraw
        assert line_key("frame 3\r\x1b[2K") == "frame 3"  # an erase after it shows nothing

    def test_a_spinner_redrawn_with_esc_1g_is_not_new_output(self) -> None:
        """Frames as the shell adapter hands them on before the line ends."""
        novelty, partial = Novelty(), PartialLine()
        new = []
        for i in range(12):
            text = partial.feed(f"\x1b[1G\x1b[2K{'|/-'[i % 3]} Waiting for the lock".encode())
            assert text is not None
            new.append(novelty.see(text))
        assert new[0] and not any(new[1:])

    def test_a_counter_redrawn_with_esc_1g_is_new_output(self) -> None:
        novelty, partial = Novelty(), PartialLine()
        for i in range(1, 13):
            text = partial.feed(f"\x1b[1G\x1b[2Kcompiled {i}/12 modules".encode())
            assert text is not None and novelty.see(text)


class TestLineInTwoPieces:
    def test_a_seen_line_arriving_before_its_newline_is_not_new(self) -> None:
        """As the shell adapter shows it: the full line, then the same status with
        the next clock time whose newline comes a read later."""
        novelty = Novelty()
        assert novelty.see("still waiting 12:00:04")
        partial = PartialLine()
        text = partial.feed(b"still waiting 12:00:05")
        assert text is not None and text.startswith("22 chars: ")
        assert not novelty.see(text)
        partial.end()
        assert not novelty.see("still waiting 12:00:05")

    def test_dots_after_a_seen_line_are_still_progress(self) -> None:
        novelty, partial = Novelty(), PartialLine()
        assert novelty.see("Downloading")
        for dots in range(1, 6):
            text = partial.feed(b"Downloading" if dots == 1 else b".")
            assert text is not None
            if dots > 1:
                assert novelty.see(text), text

    def test_a_new_line_in_two_pieces_is_new(self) -> None:
        novelty, partial = Novelty(), PartialLine()
        assert novelty.see("processed item 1/8")
        text = partial.feed(b"processed item 2/8")
        assert text is not None and novelty.see(text)


# ------------------------------------------------------------- real processes


@contextmanager
def client(code: str) -> Iterator[tuple[subprocess.Popen[str], socket.socket]]:
    """A Python process connected to a server socket of ours; yields it and our end."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, "-c", f"import socket\ns = socket.create_connection("
                                   f"('127.0.0.1', {port}))\nprint('ready', flush=True)\n"
                                   + code],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        try:
            server.settimeout(BOUND)
            conn, _ = server.accept()
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            with conn:
                yield proc, conn
        finally:
            proc.kill()
            proc.wait()


def test_the_probe_counts_bytes_a_client_receives_with_recv() -> None:
    """`recv` moves no `rchar`; the socket's own counters show the download."""
    probe = PsutilProbe()
    with client("while s.recv(65536): pass") as (proc, conn):
        first = probe.sample(proc.pid)
        assert first is not None
        stop = threading.Event()

        def send() -> None:
            while not stop.is_set():
                try:
                    conn.sendall(b"x" * 4096)
                except OSError:
                    return
                time.sleep(0.01)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        try:
            end = time.monotonic() + BOUND
            while True:
                now = probe.sample(proc.pid)
                assert now is not None
                if now.net_bytes >= first.net_bytes + (256 << 10):
                    break
                assert time.monotonic() < end, "the probe never saw the bytes"
                time.sleep(0.05)
        finally:
            stop.set()
            sender.join(BOUND)


def test_a_silent_connection_moves_no_bytes() -> None:
    """Connected, nothing sent either way: the count stays where it was."""
    probe = PsutilProbe()
    with client("s.recv(1)") as (proc, _):
        seen = set()
        for _ in range(5):
            sample = probe.sample(proc.pid)
            assert sample is not None
            seen.add(sample.net_bytes)
            time.sleep(0.05)
        assert len(seen) == 1


@contextmanager
def shell(script: str, cwd: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sh", "-c", script], cwd=cwd, stdin=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def count(path: Any) -> int:
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def wait_for_count(path: Any, at_least: int) -> None:
    end = time.monotonic() + BOUND
    while count(path) < at_least:
        assert time.monotonic() < end, f"the loop never reached {at_least}"
        time.sleep(0.05)


def test_a_wait_loop_starting_sleeps_reads_nothing(tmp_path: Any) -> None:
    """Twenty `sleep`s started and reaped between two samples: their loaders' reads
    (several KB each) are not the loop's I/O; the loop's own counter writes are."""
    probe = PsutilProbe()
    with shell("i=0; while :; do i=$((i+1)); echo $i > n; sleep 0.05; done",
               str(tmp_path)) as proc:
        wait_for_count(tmp_path / "n", 2)
        first = probe.sample(proc.pid)
        assert first is not None
        wait_for_count(tmp_path / "n", count(tmp_path / "n") + 20)
        later = probe.sample(proc.pid)
        assert later is not None
        assert later.io_bytes - first.io_bytes < 2048  # ~3 bytes a turn, not ~10 KB


def test_what_a_quick_child_writes_still_counts(tmp_path: Any) -> None:
    """A child that writes 100 KB and exits between two samples: its writes count."""
    probe = PsutilProbe()
    with shell("i=0; while :; do i=$((i+1)); head -c 100000 /dev/zero > out; echo $i > n; "
               "sleep 0.05; done", str(tmp_path)) as proc:
        wait_for_count(tmp_path / "n", 2)
        first = probe.sample(proc.pid)
        assert first is not None
        wait_for_count(tmp_path / "n", count(tmp_path / "n") + 20)
        later = probe.sample(proc.pid)
        assert later is not None
        assert later.io_bytes - first.io_bytes >= 19 * 100_000


def test_a_live_reader_counts_from_its_first_sample() -> None:
    """Reads by a live process (not a reaped child) still count."""
    probe = PsutilProbe()
    code = ("import os, tempfile\nf = tempfile.TemporaryFile()\nf.write(b'x' * 65536)\n"
            "print('ready', flush=True)\nwhile True:\n    f.seek(0); f.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        first = probe.sample(proc.pid)
        assert first is not None
        end = time.monotonic() + BOUND
        while True:
            now = probe.sample(proc.pid)
            assert now is not None
            if now.io_bytes >= first.io_bytes + (4 << 20):
                break
            assert time.monotonic() < end, "the probe never saw the reads"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()


def test_a_process_of_many_threads_is_read_whole() -> None:
    """Past 32 threads a process's reads come from its one I/O file, not a file a thread."""
    probe = PsutilProbe()
    code = ("import os, tempfile, threading\nev = threading.Event()\n"
            "for _ in range(40):\n    threading.Thread(target=ev.wait, daemon=True).start()\n"
            "f = tempfile.TemporaryFile()\nf.write(b'x' * 65536)\n"
            "print('ready', flush=True)\nwhile True:\n    f.seek(0); f.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        first = probe.sample(proc.pid)
        assert first is not None
        end = time.monotonic() + BOUND
        while True:
            now = probe.sample(proc.pid)
            assert now is not None
            if now.io_bytes >= first.io_bytes + (4 << 20):
                break
            assert time.monotonic() < end, "the probe never saw the reads"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
