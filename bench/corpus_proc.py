"""The process behaviours of the critic corpus (bench/critic_corpus.py), one per case.

    python bench/corpus_proc.py CASE PROGRESS_FILE [SCALE]

Each behaviour writes the moment of its last real progress (a Unix time)
to PROGRESS_FILE, overwriting it, so the harness can measure how long after
that moment the run was stopped. SCALE (default 1) multiplies every duration;
the fast test runs cases at a fraction of their length.

Healthy behaviours end by themselves with exit 0; stuck ones never end.
The network cases talk to the harness's HTTP server, `CORPUS_HTTP`
(`critic_corpus.ModelServer`): outside the run's process tree, as a real
server is.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path


class Case:
    """What every behaviour gets: where to write progress, and the time scale."""

    def __init__(self, progress: str, scale: float) -> None:
        self.progress_path = progress
        self.scale = scale

    def progress(self) -> None:
        """Record that real progress happened now."""
        tmp = self.progress_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(repr(time.time()))
        os.replace(tmp, self.progress_path)

    def s(self, seconds: float) -> float:
        """A duration, scaled."""
        return seconds * self.scale


def say(text: str) -> None:
    print(text, flush=True)


def burn(seconds: float) -> int:
    """Busy CPU work for `seconds` of wall time; returns a checksum of it."""
    end = time.monotonic() + seconds
    h = hashlib.sha256()
    n = 0
    while time.monotonic() < end:
        for _ in range(2000):
            h.update(n.to_bytes(8, "little"))
            n += 1
    return int.from_bytes(h.digest()[:4], "little")


def forever() -> None:
    while True:
        time.sleep(3600)


# ------------------------------------------------------------------ healthy


def cpu_silent(c: Case) -> None:
    """A CPU-bound computation that prints nothing for 8 s, then its answer."""
    c.progress()
    digest = burn(c.s(8))
    c.progress()
    say(f"result: {digest:08x}")


def io_writer(c: Case) -> None:
    """Writes 1 MiB to a file every 0.1 s for 8 s without printing."""
    block = os.urandom(1 << 20)
    end = time.monotonic() + c.s(8)
    written = 0
    with open("data.bin", "wb") as f:
        while time.monotonic() < end:
            if f.tell() >= 16 << 20:  # keep the file small: rewrite from the start
                f.seek(0)
                f.truncate()
            f.write(block)
            f.flush()
            os.fsync(f.fileno())
            written += 1
            c.progress()
            time.sleep(0.1)
    os.unlink("data.bin")
    say(f"wrote {written} MiB")


def child_worker(c: Case) -> None:
    """A silent parent whose child process does the work and logs to a file."""
    rc = subprocess.call([sys.executable, __file__, "_worker", c.progress_path, str(c.scale)])
    c.progress()
    say(f"worker finished: {rc}")
    sys.exit(rc)


def _worker(c: Case) -> None:
    end = time.monotonic() + c.s(8)
    with open("worker.log", "a") as log:
        i = 0
        while time.monotonic() < end:
            burn(0.5 * c.scale)
            i += 1
            log.write(f"chunk {i} done\n")
            log.flush()
            c.progress()


def steady_output(c: Case) -> None:
    """A line every 0.5 s, each with a new counter, for 8 s."""
    n = max(1, round(c.s(8) / 0.5))
    for i in range(1, n + 1):
        say(f"processed item {i}/{n}")
        c.progress()
        time.sleep(0.5)


def bursty_output(c: Case) -> None:
    """Bursts of output separated by 6 s of silent CPU work."""
    for burst in range(1, 4):
        for i in range(1, 21):
            say(f"batch {burst}: record {i}/20 ok")
        c.progress()
        if burst < 3:
            burn(c.s(6))
            c.progress()


def quiet_build(c: Case) -> None:
    """A build: many short compiler-like child processes for 10 s, nothing printed."""
    os.makedirs("obj", exist_ok=True)
    end = time.monotonic() + c.s(10)
    units = 0
    while time.monotonic() < end:
        units += 1
        unit = f"obj/unit{units % 8}.o"
        subprocess.run(["sh", "-c", f"head -c 1048576 /dev/urandom | gzip -6 > {unit}"],
                       check=True)
        c.progress()
    say(f"built {units} units")


def cr_progress(c: Case) -> None:
    """A counter redrawn in place with carriage returns, one a second, no newline until
    the end (a download's `3/12`): each redraw is progress, though no line ends."""
    n = max(1, round(c.s(12)))
    for i in range(1, n + 1):
        sys.stdout.write(f"\rdownloaded {i}/{n} parts")
        sys.stdout.flush()
        c.progress()
        time.sleep(1)
    say("")


def slow_download(c: Case) -> None:
    """A download at 4 KiB/s for 10 s, kept in memory and reported at the end.

    Silent, next to no CPU, and its bytes come through `recv`, which the
    process's I/O counters (`/proc/PID/io`) do not count.
    """
    import urllib.request

    count = max(1, round(c.s(10) / 0.25))
    got = bytearray()
    c.progress()
    with urllib.request.urlopen(f"{_http()}/trickle?chunk=1024&every=0.25&count={count}",
                                timeout=60) as response:
        while chunk := response.read1(65536):
            got += chunk
            c.progress()
    say(f"downloaded {len(got)} bytes, sha256 {hashlib.sha256(got).hexdigest()[:12]}")


def cha_progress(c: Case) -> None:
    """A counter redrawn in place by moving to column 1 (`ESC[1G`, what node's
    `readline.cursorTo(stream, 0)` writes) instead of a carriage return."""
    n = max(1, round(c.s(12)))
    for i in range(1, n + 1):
        sys.stdout.write(f"\x1b[1G\x1b[2Kcompiled {i}/{n} modules")
        sys.stdout.flush()
        c.progress()
        time.sleep(1)
    say("")


def long_quiet_build(c: Case) -> None:
    """A quiet build longer than the default idle timeout: 400 s, never a line.

    Light on purpose (about a tenth of a core): bursts of compile-like work,
    an object file written after each.
    """
    os.makedirs("obj", exist_ok=True)
    end = time.monotonic() + c.s(400)
    units = 0
    while time.monotonic() < end:
        units += 1
        digest = burn(0.05)
        Path(f"obj/unit{units % 8}.o").write_bytes(digest.to_bytes(4, "little") * 16384)
        c.progress()
        time.sleep(0.45)
    say(f"built {units} units")


# -------------------------------------------------------------------- stuck


def sleep_forever(c: Case) -> None:
    """Starts, then sleeps: silent, every counter flat."""
    say("connecting to the license server...")
    c.progress()
    os.execvp("sleep", ["sleep", "1000000"])


def fifo_read(c: Case) -> None:
    """Blocked reading a named pipe nobody writes."""
    path = Path("input.fifo")
    if not path.exists():
        os.mkfifo(path)
    say("waiting for records on input.fifo")
    c.progress()
    # Read-write open so the open itself returns: the read then blocks for good.
    fd = os.open(path, os.O_RDWR)
    os.read(fd, 1)


def deadlock(c: Case) -> None:
    """Two threads, each holding the lock the other waits for."""
    a, b = threading.Lock(), threading.Lock()
    both = threading.Barrier(2)

    def one(first: threading.Lock, second: threading.Lock) -> None:
        with first:
            both.wait()
            with second:
                pass

    say("starting transfer workers")
    c.progress()
    threads = [threading.Thread(target=one, args=(a, b)), threading.Thread(target=one, args=(b, a))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def spinner(c: Case) -> None:
    """A status line redrawn with carriage returns every 0.5 s, forever."""
    say("installing dependencies")
    c.progress()
    frames = "|/-\\"
    i = 0
    while True:
        sys.stdout.write(f"\r{frames[i % 4]} Waiting for the package lock...")
        sys.stdout.flush()
        i += 1
        time.sleep(0.5)


def repeated_line(c: Case) -> None:
    """The same status line printed again every 0.5 s, forever."""
    say("deploying release 2.4.1")
    c.progress()
    while True:
        say("waiting for lock on /var/lib/deploy/lock (held by pid 4242)")
        time.sleep(0.5)


def clock_line(c: Case) -> None:
    """The same status line every second, stamped with the time: only the clock moves."""
    say("waiting for the database to come up")
    c.progress()
    while True:
        say(f"still waiting {time.strftime('%H:%M:%S')}")
        time.sleep(1)


def silent_socket(c: Case) -> None:
    """Sends an HTTP request and waits for an answer that never comes."""
    import urllib.request

    say("fetching the release manifest")
    c.progress()
    urllib.request.urlopen(f"{_http()}/hang", timeout=3600).read()


def wait_loop(c: Case) -> None:
    """A shell loop waiting for a file that never appears, `sleep 0.1` between looks.

    Ten short-lived `sleep`s a second: next to no CPU, but each one's dynamic
    loader reads ~7-11 KB of libraries, which the shell's I/O counters gather
    as it reaps them (~100 KB/s of reads that are no work).
    """
    say("waiting for ready.flag")
    c.progress()
    os.execvp("sh", ["sh", "-c", "while [ ! -e ready.flag ]; do sleep 0.1; done"])


def quiet_poll(c: Case) -> None:
    """Polls a job's status every 2 s over one keep-alive connection, printing
    nothing; the answer is always `pending`. Bytes move, a few hundred a poll:
    the network evidence must not take this for a download."""
    import http.client
    from urllib.parse import urlsplit

    url = urlsplit(_http())
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=60)
    c.progress()
    while True:
        conn.request("GET", "/status")
        conn.getresponse().read()
        time.sleep(2)


def cha_spinner(c: Case) -> None:
    """A spinner redrawn by moving to column 1 (`ESC[1G`) every 0.5 s, forever."""
    say("installing dependencies")
    c.progress()
    frames = "|/-\\"
    i = 0
    while True:
        sys.stdout.write(f"\x1b[1G\x1b[2K{frames[i % 4]} Waiting for the package lock...")
        sys.stdout.flush()
        i += 1
        time.sleep(0.5)


def waiting_input(c: Case) -> None:
    """Asks a question and reads the answer from a terminal nobody types into.

    `kernel run` gives a command /dev/null as stdin (a prompt there reads EOF
    at once), so the behaviour makes its own pseudo-terminal its stdin: the
    read then blocks the way it does for a user who walked away.
    """
    master, slave = os.openpty()
    os.dup2(slave, 0)
    os.close(slave)
    say("config.yaml already exists.")
    c.progress()
    try:
        answer = input("Overwrite it? [y/N] ")
    finally:
        os.close(master)
    say(f"answer: {answer!r}")


CASES: dict[str, Callable[[Case], None]] = {f.__name__: f for f in (
    cpu_silent, io_writer, child_worker, _worker, steady_output, bursty_output, quiet_build,
    cr_progress, slow_download, cha_progress, long_quiet_build,
    sleep_forever, fifo_read, deadlock, spinner, repeated_line, clock_line, waiting_input,
    silent_socket, wait_loop, quiet_poll, cha_spinner)}


def _http() -> str:
    url = os.environ.get("CORPUS_HTTP")
    if not url:
        sys.exit("corpus_proc: this case needs CORPUS_HTTP, the harness's HTTP server")
    return url


def main(argv: list[str]) -> None:
    if len(argv) not in (2, 3) or argv[0] not in CASES:
        sys.exit(f"usage: corpus_proc.py CASE PROGRESS_FILE [SCALE]; cases: {', '.join(CASES)}")
    CASES[argv[0]](Case(argv[1], float(argv[2]) if len(argv) == 3 else 1.0))


if __name__ == "__main__":
    main(sys.argv[1:])
