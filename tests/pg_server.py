"""A real PostgreSQL server for the tests, from the system packages (apt `postgresql`).

    with PgServer.start() as server:          # initdb + postgres in a temporary directory
        url = server.create_database()        # postgresql://postgres@127.0.0.1:PORT/t1

The server listens on 127.0.0.1 at a free port (so other processes, e.g. Ray
workers, reach it by URL) with `trust` authentication, and is ready when it
logs that it accepts connections (no sleeping). PostgreSQL refuses to run
as root: as root, initdb and postgres run as the `postgres` system user
that the apt package creates, in a directory handed to that user.

The server shuts down when the thread that started it ends (Linux's
parent-death signal), so a killed test session leaves none behind: start
it from the main thread (a session fixture does).

`server_or_skip()` is the pytest side: it skips when PostgreSQL is not
installed, and under `CI=true` fails instead (CI must test the real thing;
`.ci/run` installs it).
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

#: The line postgres logs when it accepts connections.
READY = "database system is ready to accept connections"


def find_bindir() -> Path | None:
    """The directory holding `initdb` and `postgres` (newest Debian version first), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parent.parent.name) if Path(
                       p).parent.parent.name.isdigit() else 0)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def _die_with_parent() -> Callable[[], None]:
    """For `preexec_fn`: the server gets a fast shutdown (SIGINT) when the process that
    started it dies, so a test session that is killed leaves no server behind (Linux).

    ctypes is loaded here, in the parent: the child may already run as the
    `postgres` user, who cannot read this interpreter's files to import anything.
    """
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda: None
    pr_set_pdeathsig, sigint = 1, int(signal.SIGINT)
    return lambda: prctl(pr_set_pdeathsig, sigint)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class PgServer:
    """One running server (see the module docstring)."""

    root: Path
    port: int
    proc: subprocess.Popen[str]
    user: str | None
    log: list[str] = field(default_factory=list)
    _names: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def host(self) -> str:
        return "127.0.0.1"

    def url(self, dbname: str = "postgres") -> str:
        """The URL of database `dbname` on this server."""
        return f"postgresql://postgres@{self.host}:{self.port}/{dbname}"

    def create_database(self, name: str | None = None) -> str:
        """Create an empty database and return its URL."""
        import psycopg

        name = name or f"t{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as con:
            con.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        """Fast shutdown (SIGINT), then remove the directory."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)

    @classmethod
    @contextlib.contextmanager
    def start(cls, *, fsync: bool = False, timeout: float = 120.0) -> Iterator[PgServer]:
        """Start a server in a new temporary directory; stop it and remove the directory after.

        `fsync=False` (tests) trades durability after a power loss for speed;
        benchmarks pass True to measure what a real server costs.

        Raises:
            RuntimeError: PostgreSQL is not installed, or did not start (its log attached).
        """
        server = cls._launch(fsync=fsync, timeout=timeout)
        try:
            yield server
        finally:
            server.stop()

    @classmethod
    def _launch(cls, *, fsync: bool, timeout: float) -> PgServer:
        bindir = find_bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
        user = None
        kwargs: dict[str, object] = {}
        root = Path(tempfile.mkdtemp(prefix="kernel-pg-"))
        if os.geteuid() == 0:  # postgres will not run as root: use the package's system user
            user = "postgres"
            try:
                pw = pwd.getpwnam(user)
            except KeyError:
                shutil.rmtree(root, ignore_errors=True)
                raise RuntimeError("running as root and there is no `postgres` user to run "
                                   "PostgreSQL as (apt-get install postgresql creates it)"
                                   ) from None
            os.chown(root, pw.pw_uid, pw.pw_gid)
            kwargs = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        data = root / "data"
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        init = subprocess.run([str(bindir / "initdb"), "-D", str(data), "-U", "postgres",
                               "-A", "trust", "-E", "UTF8", "--no-sync"],
                              capture_output=True, text=True, env=env, cwd=root, timeout=timeout,
                              **kwargs)  # type: ignore[call-overload]
        if init.returncode != 0:
            shutil.rmtree(root, ignore_errors=True)
            raise RuntimeError(f"initdb failed: {init.stderr.strip() or init.stdout.strip()}")
        for attempt in range(5):  # a free port may be taken before postgres binds it
            port = _free_port()
            proc = subprocess.Popen(
                [str(bindir / "postgres"), "-D", str(data), "-p", str(port),
                 "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={root}",
                 "-c", f"fsync={'on' if fsync else 'off'}", "-c", "max_connections=200",
                 "-c", "logging_collector=off"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                cwd=root, preexec_fn=_die_with_parent(), **kwargs)  # type: ignore[call-overload]
            server = cls(root, port, proc, user)
            if server._wait_ready(timeout):
                return server
            proc.wait()
            if attempt == 4 or "could not bind" not in "".join(server.log):
                shutil.rmtree(root, ignore_errors=True)
                raise RuntimeError("postgres did not start:\n" + "".join(server.log[-20:]))
        raise AssertionError("unreachable")

    def _wait_ready(self, timeout: float) -> bool:
        """Read the log until postgres is ready (True) or exits (False); keep draining it."""
        ready = threading.Event()
        assert self.proc.stderr is not None
        stream = self.proc.stderr

        def drain() -> None:
            for line in stream:
                self.log.append(line)
                if READY in line:
                    ready.set()
            ready.set()  # exited

        threading.Thread(target=drain, daemon=True, name="pg-log").start()
        if not ready.wait(timeout):
            self.proc.kill()
            return False
        return self.proc.poll() is None and any(READY in line for line in self.log)


def postgres_installed() -> bool:
    """True when initdb and postgres are on this machine."""
    return find_bindir() is not None


def server_or_skip() -> Iterator[PgServer]:
    """For a session fixture: a started server; skip without PostgreSQL (fail under CI)."""
    import pytest

    if not postgres_installed():
        why = "PostgreSQL is not installed (apt-get install postgresql)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI needs a real PostgreSQL: {why}")
        pytest.skip(why)
    with PgServer.start() as server:
        yield server
