"""A query that runs too long stops on Ctrl-C or at `--timeout`, and leaves its
connection usable: DuckDB executes in a worker thread while the caller's thread waits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


@pytest.mark.timeout(60)  # (before the fix: the runaway worker held the connection)
def test_ctrl_c_as_the_worker_starts_is_the_query_interrupted() -> None:
    """SIGINT landing inside `Thread.start` (here made certain: sent as the main thread
    enters it, through a profile hook) escaped as a bare KeyboardInterrupt, the worker
    unaccounted for (a fresh-clone CI's session stopped in the test above, which sends
    it when the worker appears). Now it is the query's interrupt, and the connection
    still works."""
    cur = duckdb.connect().cursor()
    start = threading.Thread.start.__code__

    def on_call(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is start:
            sys.setprofile(None)
            os.kill(os.getpid(), signal.SIGINT)

    caught: BaseException | None = None
    sys.setprofile(on_call)
    try:
        queries.read_only_query(cur, LONG)
    except KeyboardInterrupt as exc:
        caught = exc
    finally:
        sys.setprofile(None)
    assert isinstance(caught, queries.QueryInterrupted), repr(caught)
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


ENDLESS = "SELECT range AS n FROM range(1e12::BIGINT)"


def test_a_streamed_result_comes_in_chunks_and_equals_the_whole() -> None:
    cur = duckdb.connect().cursor()
    sql = "SELECT range AS n, range % 7 AS n FROM range(25000)"
    with queries.stream_query(cur, sql, rows_at_once=10_000) as stream:
        assert stream.names == ["n", "n"]
        chunks = list(stream)
    assert [len(c) for c in chunks] == [10_000, 10_000, 5_000]
    assert [r for c in chunks for r in c] == queries.read_only_query(cur, sql)[1]


def test_leaving_a_stream_early_stops_the_query_and_the_connection_still_works() -> None:
    cur = duckdb.connect().cursor()
    with queries.stream_query(cur, ENDLESS, rows_at_once=1000) as stream:
        first = next(iter(stream))
    assert first[:2] == [(0,), (1,)]
    assert not any(t.name == "kernel query" for t in threading.enumerate())
    assert queries.read_only_query(cur, "SELECT 2 AS two") == (["two"], [(2,)])


def test_a_stream_refused_or_failing_raises_one_line() -> None:
    cur = duckdb.connect().cursor()
    with (pytest.raises(ConfigError, match="query is read-only: DELETE"),
          queries.stream_query(cur, "DELETE FROM x")):
        pass
    with (pytest.raises(ConfigError, match=r"query failed: .*nope"),
          queries.stream_query(cur, "SELECT * FROM nope")):
        pass
    bad = "SELECT CASE WHEN range < 20000 THEN range ELSE error('row ' || range) END AS n " \
          "FROM range(30000)"
    seen: list[tuple[int]] = []
    with (pytest.raises(ConfigError, match=r"query failed: .*row 2"),
          queries.stream_query(cur, bad, rows_at_once=1000) as stream):
        for chunk in stream:
            seen.extend(chunk)
    assert seen == [(i,) for i in range(len(seen))]  # what came before the failure, in order


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_kernel_query_streams_to_a_reader_that_stops_early(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, fmt: str) -> None:
    """`kernel query --format csv ENDLESS | head -2`: the first rows arrive while DuckDB
    is still producing, and a reader gone stops the query (exit 0, nothing on stderr)."""
    proc = subprocess.Popen([kernel_exe, "query", "--format", fmt, ENDLESS], env=cli_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    assert proc.stdout is not None and proc.stderr is not None
    lines = [proc.stdout.readline(), proc.stdout.readline()]
    proc.stdout.close()
    assert proc.wait(timeout=120) == 0
    assert proc.stderr.read() == b""
    assert lines == ([b"n\n", b"0\n"] if fmt == "csv" else [b'{"n": 0}\n', b'{"n": 1}\n'])


def test_kernel_query_timeout_while_streaming_is_one_line_exit_2(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    proc = subprocess.run([kernel_exe, "query", "--timeout", "1", "--format", "csv",
                           "SELECT count(*) AS n FROM range(1e12::BIGINT)"], env=cli_env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "kernel query: error: query stopped after 1s (--timeout)"
