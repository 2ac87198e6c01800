"""Several processes sharing one journal and analysts' file: writers and a reader at once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from batteries.audit import DuckDBAudit, Store
from batteries.store import journal_path
from kernel import Kernel, Ports, RunInfo, Status, Step
from kernel.testing import ScriptedAgent

PROCS = Path(__file__).with_name("audit_procs.py")


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(PROCS), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str], timeout: float) -> dict[str, object]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} did not finish in {timeout}s: {err[-2000:]}")
    assert proc.returncode == 0, f"{proc.args} crashed ({proc.returncode}): {err[-2000:]}"
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


@pytest.mark.realtime
class TestMultiProcess:
    def test_three_writers_and_a_reader(self, tmp_path: Path) -> None:
        """3 writer processes x 200 runs x 50 events and a reader every 100 ms: all rows land."""
        db = tmp_path / "shared.duckdb"
        Store(db).ensure_schema()
        stop = tmp_path / "stop"
        reader = _spawn("reader", str(db), str(stop))
        t0 = time.monotonic()
        writers = [_spawn("writer", str(db), "200", "50", f"w{i}") for i in range(3)]
        try:
            outs = [_finish(w, timeout=240) for w in writers]
        finally:
            stop.touch()
        seconds = time.monotonic() - t0
        seen = _finish(reader, timeout=30)

        for out in outs:
            assert out["failures"] == [], out
            assert out["unwritten"] == 0, out
        assert seen["errors"] == [], seen
        assert seen["monotonic"] is True
        assert isinstance(seen["reads"], int) and seen["reads"] >= 5, seen

        with Store(db).reader() as cur:
            totals = cur.execute(
                "SELECT (SELECT count(*) FROM runs), (SELECT count(*) FROM events), "
                "(SELECT count(*) FROM runs WHERE status = 'ok'), "
                "(SELECT count(DISTINCT pid) FROM runs)").fetchall()[0]
            broken = cur.execute("""
                SELECT count(*) FROM (
                    SELECT run_id, count(*) AS n, min(seq) AS lo, max(seq) AS hi,
                           count(DISTINCT seq) AS d
                    FROM events GROUP BY run_id)
                WHERE n != 50 OR lo != 0 OR hi != 49 OR d != 50""").fetchall()[0][0]
            by_writer = dict(cur.execute(
                "SELECT subject_id, count(*) FROM runs GROUP BY 1").fetchall())
        assert totals == (600, 30_000, 600, 3)
        assert broken == 0
        assert by_writer == {"w0": 200, "w1": 200, "w2": 200}
        print(f"3 writers x 200 runs x 50 events: {seconds:.1f}s; reader: {seen}")

    async def test_rows_are_durable_for_other_processes_when_close_returns(
            self, tmp_path: Path) -> None:
        """As soon as Kernel.run returns (close done), another process sees all the run's rows
        in the journal."""
        db = tmp_path / "durable.duckdb"
        # No timed flushes: only the run's close can have written its rows.
        async with DuckDBAudit.open(db, flush_interval=3600) as audit:
            result = await Kernel(Ports(audit=audit)).run(
                ScriptedAgent([Step(), Step(), Step(output="done", final=True)]),
                RunInfo(name="durable"))
            assert result.status is Status.OK and result.port_failures == []
            proc = await trio.run_process(
                [sys.executable, "-c",
                 "import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
                 "print(c.execute('SELECT (SELECT status FROM runs), count(*), max(seq) "
                 "FROM events').fetchall()[0])", str(journal_path(db))],
                capture_stdout=True, capture_stderr=True)
        assert proc.stdout.decode().strip() == "('ok', 5, 4)"
