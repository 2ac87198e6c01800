"""A query that runs too long stops on Ctrl-C or at `--timeout`, and leaves its
connection usable: DuckDB executes in a worker thread while the caller's thread waits."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import duckdb
import pytest

from batteries.audit import queries
from kernel import ConfigError

LONG = "SELECT * FROM range(1e12::BIGINT) ORDER BY 1 DESC LIMIT 1"


def _when_running(action: Callable[[], object]) -> threading.Thread:
    """Call `action` once the query's worker thread exists (readiness, not a sleep)."""
    def wait() -> None:
        while not any(t.name == "kernel query" for t in threading.enumerate()):
            threading.Event().wait(0.01)
        action()
    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def test_ctrl_c_interrupts_the_query_and_the_connection_still_works() -> None:
    con = duckdb.connect()
    cur = con.cursor()
    _when_running(lambda: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(queries.QueryInterrupted):
        queries.read_only_query(cur, LONG)
    assert not any(t.name == "kernel query" for t in threading.enumerate())
    assert queries.read_only_query(cur, "SELECT 41 + 1 AS x") == (["x"], [(42,)])


def test_a_timeout_stops_the_query() -> None:
    cur = duckdb.connect().cursor()
    with pytest.raises(ConfigError, match=r"query stopped after 0.5s \(--timeout\)"):
        queries.read_only_query(cur, LONG, timeout=0.5)
    assert queries.read_only_query(cur, "SELECT 1 AS one") == (["one"], [(1,)])


def test_kernel_query_timeout_is_one_line_exit_2(kernel_exe: str, cli_env: dict[str, str],
                                                 tmp_path: Path) -> None:
    proc = subprocess.run([kernel_exe, "query", "--timeout", "1", LONG], env=cli_env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "kernel query: error: query stopped after 1s (--timeout)"), proc.stderr
