"""The Python examples in examples/ run as documented (real DuckDB file, real time)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.realtime
def test_library_host(tmp_path: Path) -> None:
    """library_host.py: a looping agent is nudged, then killed `looping`, all audited."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / "library_host.py"),
                           str(tmp_path / "k.duckdb")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "status=killed reason=looping" in proc.stdout
    assert "('steer', 'looping'), ('kill', 'looping')" in proc.stdout


def _ticks(marker: Path) -> int:
    try:
        return len(marker.read_text().splitlines())
    except FileNotFoundError:
        return 0


@pytest.mark.realtime
def test_host_recover(tmp_path: Path) -> None:
    """host_recover.py: SIGTERMed mid-loop, a second host process resumes it, exactly once.

    Neither process imports kernel_cli; the recovered run ends ok with the
    loop's answer; its audit has one `resumed` event and contiguous seq.
    """
    db = tmp_path / "k.duckdb"
    work = tmp_path / "work"
    work.mkdir()
    host = str(EXAMPLES / "host_recover.py")
    proc = subprocess.Popen([sys.executable, host, "run", str(db), str(work)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120  # only a bound for a broken run; readiness is the file
    while _ticks(work / "ticks") < 2:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the loop never reached its second state"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    first = json.loads(out)
    assert first["status"] == "cancelled" and first["kernel_cli_imported"] is False, first

    rec = subprocess.run([sys.executable, host, "recover", str(db)], capture_output=True,
                         text=True, timeout=300)
    assert rec.returncode == 0, rec.stderr
    second = json.loads(rec.stdout)
    assert second["kernel_cli_imported"] is False, second
    [done] = second["recovered"]
    assert done["run_id"] == first["run_id"] and done["status"] == "ok", done
    assert str(done["output"]).strip() == "6"
    assert done["from_step"] >= 1

    from batteries.audit import Store

    with Store(db).reader() as con:
        n, distinct, lo, hi, resumed = con.execute(
            "SELECT count(*), count(DISTINCT seq), min(seq), max(seq), "
            "count(*) FILTER (WHERE kind = 'resumed') FROM events WHERE run_id = ?",
            [first["run_id"]]).fetchone()
        [status] = con.execute("SELECT status FROM runs WHERE run_id = ?",
                               [first["run_id"]]).fetchone()
    assert resumed == 1
    assert lo == 0 and n == distinct == hi + 1
    assert status == "ok"

    again = subprocess.run([sys.executable, host, "recover", str(db)], capture_output=True,
                           text=True, timeout=120)
    assert json.loads(again.stdout)["recovered"] == []  # nothing left to resume
