"""When the audit database cannot be used: the run goes on and the failure is reported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from batteries.audit import AuditBusyError, DuckDBAudit, Store
from batteries.audit.queries import dicts
from kernel import (
    AuditError,
    AuditWriteError,
    ConfigError,
    Kernel,
    PortFailure,
    Ports,
    RunInfo,
    RunStats,
    Status,
    Step,
)
from kernel.testing import ScriptedAgent
from kernel_cli.wiring import PortOptions, _open_audit, open_ports

PROCS = Path(__file__).with_name("audit_procs.py")


@contextmanager
def held(db: Path) -> Iterator[None]:
    """Another process holds `db` open read-write (as an analyst's duckdb shell would)."""
    proc = subprocess.Popen([sys.executable, str(PROCS), "hold", str(db)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "held" in line, f"the lock holder did not start: {line!r}"
        yield
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)


def _count(db: Path, sql: str) -> int:
    with Store(db).reader() as cur:
        return int(cur.execute(sql).fetchall()[0][0])


class TestOpenFailures:
    @pytest.mark.realtime
    async def test_a_file_locked_too_long_gives_up_within_the_timeout(
            self, tmp_path: Path) -> None:
        """open() retries a locked file for lock_timeout, then raises a one-line AuditBusyError."""
        db = tmp_path / "locked.duckdb"
        Store(db).ensure_schema()
        with held(db):
            t0 = time.monotonic()
            with pytest.raises(AuditBusyError) as err:
                async with DuckDBAudit.open(db, lock_timeout=0.3):
                    pass
            waited = time.monotonic() - t0
        assert 0.3 <= waited < 5
        assert "locked by another process" in str(err.value)
        assert "\n" not in str(err.value)

    async def test_a_file_that_is_not_duckdb_is_an_audit_error(self, tmp_path: Path) -> None:
        """A corrupt or foreign file fails open() with AuditError naming the file."""
        db = tmp_path / "junk.duckdb"
        db.write_bytes(b"not a database " * 1000)
        with pytest.raises(AuditError, match="not a valid DuckDB database"):
            async with DuckDBAudit.open(db):
                pass

    async def test_a_directory_that_cannot_be_created_is_an_audit_error(
            self, tmp_path: Path) -> None:
        """A path whose parent is a regular file fails open() with AuditError."""
        blocker = tmp_path / "a-file"
        blocker.write_text("x")
        with pytest.raises(AuditError, match="cannot create"):
            async with DuckDBAudit.open(blocker / "kernel.duckdb"):
                pass

    async def test_a_read_only_file_is_an_audit_error(self, read_only: Any,
                                                      tmp_path: Path) -> None:
        """A database file that cannot be written fails open() with AuditError."""
        db = tmp_path / "ro.duckdb"
        Store(db).ensure_schema()
        read_only(db)
        with pytest.raises(AuditError):
            async with DuckDBAudit.open(db):
                pass

    def test_kernel_run_on_a_read_only_file(self, read_only: Any, tmp_path: Path) -> None:
        """`kernel run` on a read-only database: one warning line, the command's own status."""
        db = tmp_path / "ro.duckdb"
        Store(db).ensure_schema()
        read_only(db)
        exe = str(Path(sys.executable).parent / "kernel")
        proc = subprocess.run([exe, "run", "--json", "--db", str(db), "--", "sh", "-c",
                               "exit 3"], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 3
        doc = json.loads(proc.stdout)
        assert doc["status"] == "error" and doc["port_failures"][0].startswith("audit.open: ")
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kernel: warning: audit.open: ")
        assert "Traceback" not in proc.stderr

    def test_a_bad_lock_timeout_setting_is_a_config_error(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """KERNEL_AUDIT_LOCK_TIMEOUT must be a number of seconds."""
        monkeypatch.setenv("KERNEL_AUDIT_LOCK_TIMEOUT", "soon")
        with pytest.raises(ConfigError, match="KERNEL_AUDIT_LOCK_TIMEOUT"):
            DuckDBAudit(tmp_path / "x.duckdb")


class TestWiring:
    async def test_the_cli_opens_the_database_at_kernel_db(self, _isolated_db: Path) -> None:
        """Without --db, `kernel run` audits to $KERNEL_DB, and the run is recorded."""
        warnings: list[PortFailure] = []
        async with AsyncExitStack() as stack:
            audit = await _open_audit(PortOptions(), stack, warnings)
            assert isinstance(audit, DuckDBAudit) and audit.path == _isolated_db
            result = await Kernel(Ports(audit=audit)).run(ScriptedAgent([Step(final=True)]))
        assert warnings == []
        assert _count(_isolated_db, "SELECT count(*) FROM runs WHERE status = 'ok'") == 1
        assert result.port_failures == []

    @pytest.mark.realtime
    async def test_a_locked_database_is_a_warning_and_the_run_still_happens(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """A locked file: open_ports leaves the audit out with one audit.open warning."""
        db = tmp_path / "busy.duckdb"
        Store(db).ensure_schema()
        monkeypatch.setenv("KERNEL_AUDIT_LOCK_TIMEOUT", "0.2")
        warnings: list[PortFailure] = []
        with held(db):
            async with open_ports(PortOptions(db=str(db), no_critic=True),
                                  warnings=warnings) as ports:
                assert ports.audit is None
                result = await Kernel(ports).run(ScriptedAgent([Step(output="hi", final=True)]))
        assert result.status is Status.OK and result.output == "hi"
        assert [(w.port, w.method) for w in warnings] == [("audit", "open")]
        assert "locked by another process" in warnings[0].error
        assert "\n" not in warnings[0].error

    async def test_a_corrupt_database_is_a_warning_too(self, tmp_path: Path) -> None:
        """Any failure to open (here: not a DuckDB file) becomes the audit.open warning."""
        db = tmp_path / "junk.duckdb"
        db.write_bytes(b"junk" * 4096)
        warnings: list[PortFailure] = []
        async with AsyncExitStack() as stack:
            assert await _open_audit(PortOptions(db=str(db)), stack, warnings) is None
        assert len(warnings) == 1 and "not a valid DuckDB database" in warnings[0].error


@pytest.mark.realtime
class TestLockedMidRun:
    async def test_a_run_that_cannot_be_written_ends_with_its_real_status(
            self, tmp_path: Path) -> None:
        """File locked after open: recording stays fast, close fails, the run ends ok.

        The rows kept by the failed flushes are written once the lock is released.
        """
        db = tmp_path / "mid.duckdb"
        async with DuckDBAudit.open(db, lock_timeout=1.0, flush_interval=3600) as audit:
            with held(db):
                rec = await audit.start_run(RunInfo(name="side events"))
                t0 = time.monotonic()
                for i in range(20_000):
                    rec.log_event("tick", payload={"i": i})
                # Had any of these calls touched the locked file, they would have
                # waited out the 1 s lock timeout (at least once).
                assert time.monotonic() - t0 < 1.0
                with pytest.raises(AuditWriteError, match="locked by another process"):
                    await rec.close(RunStats(Status.OK))
                result = await Kernel(Ports(audit=audit)).run(
                    ScriptedAgent([Step(), Step(output="done", final=True)]),
                    RunInfo(name="main run"))
            assert result.status is Status.OK and result.output == "done"
            assert [(f.port, f.method) for f in result.port_failures] == [("audit", "close")]
            assert "locked by another process" in result.port_failures[0].error
        # The lock is gone: the exit flush wrote everything that was kept.
        assert audit.unwritten == 0
        with Store(db).reader() as cur:
            runs = dicts(cur, "SELECT name, status FROM runs ORDER BY name")
            events = cur.execute("SELECT count(*) FROM events").fetchall()[0][0]
        assert runs == [{"name": "main run", "status": "ok"},
                        {"name": "side events", "status": "ok"}]
        assert events == (1 + 20_000 + 1) + (1 + 2 + 1)


@pytest.mark.realtime
class TestKernelRunCommand:
    def test_kernel_run_on_a_locked_database(self, tmp_path: Path, kernel_exe: str,
                                             cli_env: dict[str, str]) -> None:
        """`kernel run` on a locked file: one warning line, the command's own exit code,
        and the audit failure in the JSON result."""
        db = tmp_path / "kernel.duckdb"
        Store(db).ensure_schema()
        env = {**cli_env, "KERNEL_DB": str(db), "KERNEL_AUDIT_LOCK_TIMEOUT": "0.3"}
        with held(db):
            proc = subprocess.run([kernel_exe, "run", "--json", "--", "sh", "-c", "exit 3"],
                                  env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 3, proc.stderr
        warnings = [ln for ln in proc.stderr.splitlines() if "audit" in ln]
        assert len(warnings) == 1, proc.stderr
        assert warnings[0].startswith("kernel: warning: audit.open: ")
        assert "Traceback" not in proc.stderr
        result = json.loads(proc.stdout)
        assert result["status"] == "error"
        assert any(f.startswith("audit.open: ") and "locked" in f
                   for f in result["port_failures"])


@pytest.fixture
def read_only() -> Iterator[Any]:
    """Make a file unwritable even for root (chattr +i), undone after the test."""
    made: list[Path] = []

    def apply(path: Path) -> None:
        if os.geteuid() != 0:
            path.chmod(0o444)
            return
        if shutil.which("chattr") is None:
            pytest.skip("chattr is not installed: cannot make a file read-only for root")
        proc = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot make a file read-only for root here: {proc.stderr.strip()}")
        made.append(path)

    yield apply
    for path in made:
        subprocess.run(["chattr", "-i", str(path)], check=False)
