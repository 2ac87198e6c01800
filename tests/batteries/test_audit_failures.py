"""When the journal cannot be used: runs go on and say so; budgets fail closed.

And what no longer matters: an analyst holding the DuckDB file open.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from batteries.audit import AuditBusyError, DuckDBAudit, Store, sync
from batteries.audit.queries import dicts
from batteries.budget import JournalBudget
from batteries.runner import open_ports
from batteries.store import Journal, journal_path
from kernel import (
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
from kernel import PortSpec as PortOptions
from kernel.testing import ScriptedAgent

PROCS = Path(__file__).with_name("audit_procs.py")


@contextmanager
def held(path: Path, mode: str = "hold") -> Iterator[None]:
    """Another process holds `path`: the DuckDB file open read-write (`hold`, as an
    analyst's duckdb shell would) or the journal's write lock (`hold-journal`)."""
    proc = subprocess.Popen([sys.executable, str(PROCS), mode, str(path)],
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


def _kernel() -> str:
    return str(Path(sys.executable).parent / "kernel")


class TestAnalystsCannotBlockRuns:
    @pytest.mark.realtime
    async def test_a_held_analyst_file_does_not_touch_a_run(self, tmp_path: Path) -> None:
        """The DuckDB file held read-write by an analyst: the run is audited, no warning."""
        db = tmp_path / "held.duckdb"
        async with DuckDBAudit.open(db) as audit:
            await Kernel(Ports(audit=audit)).run(ScriptedAgent([Step(final=True)]))
        sync(db)  # the journal and the analysts' file both exist, as in any real setup
        with held(db):
            async with DuckDBAudit.open(db, lock_timeout=0.3) as audit:
                result = await Kernel(Ports(audit=audit)).run(
                    ScriptedAgent([Step(output="hi", final=True)]))
            assert result.status is Status.OK and result.port_failures == []
            with pytest.raises(AuditBusyError, match="locked by another process"):
                sync(db, lock_timeout=0.3)  # the analysts' file lags while it is held
        assert _count(db, "SELECT count(*) FROM runs WHERE status = 'ok'") == 2

    def test_a_bad_lock_timeout_setting_is_a_config_error(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """KERNEL_AUDIT_LOCK_TIMEOUT must be a number of seconds."""
        monkeypatch.setenv("KERNEL_AUDIT_LOCK_TIMEOUT", "soon")
        with pytest.raises(ConfigError, match="KERNEL_AUDIT_LOCK_TIMEOUT"):
            Journal(tmp_path / "x.duckdb")


class TestJournalUnusable:
    async def test_a_directory_that_cannot_be_created(self, tmp_path: Path) -> None:
        """No journal can exist there, so no budget either: the run goes on, the audit
        close fails with a line naming the directory."""
        blocker = tmp_path / "a-file"
        blocker.write_text("x")
        async with open_ports(PortOptions(db=str(blocker / "k.duckdb"), no_critic=True)) as p:
            result = await Kernel(p).run(ScriptedAgent([Step(output="hi", final=True)]),
                                         RunInfo(caller_id="ann"))
        assert result.status is Status.OK
        assert [(f.port, f.method) for f in result.port_failures] == [("audit", "close")]
        assert "cannot create" in result.port_failures[0].error

    async def test_a_corrupt_journal_refuses_the_run(self, tmp_path: Path) -> None:
        """A journal damaged past its header: the budget cannot be checked, so nothing runs.
        (One that is not SQLite at all is refused before, `test_audit_paths.py`.)"""
        db = tmp_path / "k.duckdb"
        journal_path(db).write_bytes(b"SQLite format 3\x00" + b"junk" * 4096)
        agent = ScriptedAgent([Step(output="hi", final=True)])
        async with open_ports(PortOptions(db=str(db), no_critic=True)) as p:
            result = await Kernel(p).run(agent, RunInfo(caller_id="ann"))
        assert result.status is Status.BUDGET_EXCEEDED and agent.calls == 0
        assert "budget check failed" in (result.error or "")
        assert "not a database" in (result.error or "")

    def test_kernel_run_on_a_read_only_journal_with_a_budget(
            self, read_only: Any, tmp_path: Path) -> None:
        """A journal that cannot be written, with a budget for the caller: exit 3, the
        reason on stderr, the command never runs."""
        db = tmp_path / "ro.duckdb"
        JournalBudget(db).set("ann", max_runs=10)
        read_only(journal_path(db))
        marker = tmp_path / "ran"
        proc = subprocess.run([_kernel(), "run", "--db", str(db), "--caller", "ann", "--",
                               "touch", str(marker)], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 3, proc.stderr
        assert not marker.exists()
        assert "budget_exceeded" in proc.stderr and "budget check failed" in proc.stderr
        assert "Traceback" not in proc.stderr

    def test_kernel_run_on_a_read_only_journal_without_a_budget(
            self, read_only: Any, tmp_path: Path) -> None:
        """Without a budget for the caller the run goes on: its own status, one warning."""
        db = tmp_path / "ro.duckdb"
        JournalBudget(db).set("someone-else", max_runs=10)
        read_only(journal_path(db))
        proc = subprocess.run([_kernel(), "run", "--json", "--db", str(db), "--caller", "ann",
                               "--", "sh", "-c", "exit 3"], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 3, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["status"] == "error"
        assert [f.split(":")[0] for f in doc["port_failures"]] == ["audit.close"]
        assert "Traceback" not in proc.stderr


@pytest.mark.realtime
class TestLockedJournal:
    async def test_a_run_that_cannot_be_written_ends_with_its_real_status(
            self, tmp_path: Path) -> None:
        """Journal write-locked after open: recording stays fast, close fails, the run
        ends ok; the rows kept by the failed writes land once the lock is released."""
        db = tmp_path / "mid.duckdb"
        async with DuckDBAudit.open(db, lock_timeout=1.0, flush_interval=3600) as audit:
            await audit.flush()  # the journal exists
            with held(journal_path(db), "hold-journal"):
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

    async def test_a_locked_journal_without_a_budget_lets_the_run_go_on(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """The write lock held past the timeout: a caller without a budget still runs (the
        journal, read without the lock, proves none applies); one with a budget is refused."""
        db = tmp_path / "busy.duckdb"
        JournalBudget(db).set("capped", max_runs=100)
        monkeypatch.setenv("KERNEL_AUDIT_LOCK_TIMEOUT", "0.2")
        warnings: list[PortFailure] = []
        with held(journal_path(db), "hold-journal"):
            async with open_ports(PortOptions(db=str(db), no_critic=True),
                                  warnings=warnings) as ports:
                free = await Kernel(ports).run(ScriptedAgent([Step(output="hi", final=True)]),
                                               RunInfo(caller_id="free"))
                capped = await Kernel(ports).run(ScriptedAgent([Step(final=True)]),
                                                 RunInfo(caller_id="capped"))
        assert warnings == []
        assert free.status is Status.OK and free.output == "hi"
        assert capped.status is Status.BUDGET_EXCEEDED
        assert "locked by another process" in (capped.error or "")


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
