"""Edges of the analysts' commands, end to end through the installed `kernel` executable.

Each test runs real `kernel` processes on a real journal and DuckDB file: a
purge while a run is in flight, control characters in recorded data, an
empty store, strict JSON, conflicting output options.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

#: Generous bound on any wait for another process (a loaded CI machine is slow).
WAIT = 120.0


def kernel(exe: str, env: dict[str, str], *args: str,
           timeout: float = WAIT) -> subprocess.CompletedProcess[str]:
    """Run `kernel ARGS` to completion; stdout and stderr captured as text."""
    return subprocess.run([exe, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def until(what: str, probe: Callable[[], Any], bound: float = WAIT) -> Any:
    """Poll `probe` until it returns something truthy (a readiness wait, not a delay)."""
    deadline = time.monotonic() + bound
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what} after {bound:g}s")
        time.sleep(0.05)


def one_line(proc: subprocess.CompletedProcess[str], code: int, *fragments: str) -> str:
    """Assert `proc` failed with exactly one `kernel <cmd>: error:` line; return it."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kernel ") and ": error: " in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def json_lines(text: str) -> list[Any]:
    return [json.loads(line) for line in text.splitlines()]


class TestPurgeKeepsLiveRuns:
    def test_purge_days_0_keeps_a_run_in_flight_whole(self, kernel_exe: str,
                                                      cli_env: dict[str, str],
                                                      tmp_path: Path) -> None:
        """`purge --days 0` deletes ended runs from both files but no event of a live run:
        after it ends, the analysts' file holds its every event, seq 0, 1, 2, ... ."""
        env = cli_env
        done = kernel(kernel_exe, env, "run", "-q", "--name", "finished", "--", "true")
        assert done.returncode == 0, done.stderr
        ready, go = tmp_path / "ready", tmp_path / "go"
        script = ("import pathlib, time\n"
                  f"pathlib.Path({str(ready)!r}).touch()\n"
                  "print('waiting', flush=True)\n"
                  f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.02)\n"
                  "print('released', flush=True)\n")
        live = subprocess.Popen([kernel_exe, "run", "-q", "--name", "live", "--",
                                 sys.executable, "-c", script], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            until("the command to start", ready.exists)

            def synced_output() -> Any:
                # The run is running and its first output line reached the analysts' file
                # (the journal's timed flush, then the sync every analyst command runs).
                got = kernel(kernel_exe, env, "runs", "--status", "running", "--json")
                found = json_lines(got.stdout)
                if not found:
                    return None
                shown = kernel(kernel_exe, env, "show", str(found[0]["run_id"]), "--json")
                doc = json.loads(shown.stdout)
                if any(e["kind"] == "output" for e in doc["events"]):
                    return doc
                return None

            before = until("the live run's first events in the analysts' file", synced_output)
            run_id = before["run"]["run_id"]
            purged = kernel(kernel_exe, env, "purge", "--days", "0", "--json")
            assert purged.returncode == 0, purged.stderr
            assert json.loads(purged.stdout)["runs"] == 1  # the finished run only
            listed = json_lines(kernel(kernel_exe, env, "runs", "--json").stdout)
            assert [r["run_id"] for r in listed] == [run_id]
            go.touch()
            assert live.wait(timeout=WAIT) == 0, live.stderr.read() if live.stderr else ""
        finally:
            go.touch()
            if live.poll() is None:
                live.kill()
                live.wait(timeout=WAIT)
            if live.stderr is not None:
                live.stderr.close()
        shown = kernel(kernel_exe, env, "show", run_id, "--json", "--limit", "0")
        assert shown.returncode == 0, shown.stderr
        doc = json.loads(shown.stdout)
        seqs = [e["seq"] for e in doc["events"]]
        assert seqs == list(range(len(seqs))), seqs
        kinds = [e["kind"] for e in doc["events"]]
        assert kinds[0] == "run_start" and kinds[-1] == "run_end", kinds
        lines = [e["payload"].get("line") for e in doc["events"] if e["kind"] == "output"]
        assert lines == ["waiting", "released"], lines
        assert doc["run"]["status"] == "ok"

    def test_purge_help_says_running_runs_are_kept(self, kernel_exe: str,
                                                   cli_env: dict[str, str]) -> None:
        """`kernel purge --help` says only ended runs go."""
        text = " ".join(kernel(kernel_exe, cli_env, "purge", "--help").stdout.split())
        assert "runs still running, and the runs of a batch that has not finished, are kept" in text


def _no_controls(text: str) -> None:
    """No C0 (but tab and newline), DEL or C1 control character in `text`."""
    bad = [hex(ord(c)) for c in text
           if (ord(c) < 0x20 and c not in "\t\n") or 0x7f <= ord(c) <= 0x9f]
    assert bad == [], (bad, text)


class TestControlCharacters:
    def test_recorded_escapes_never_reach_the_terminal(self, kernel_exe: str,
                                                       cli_env: dict[str, str]) -> None:
        """A run's name and output holding ESC/BEL/C1 sequences are shown escaped by show,
        runs and query tables; CSV and JSON keep the data exact."""
        env = cli_env
        name = "nm\x1b]0;PWNED\x07"
        made = kernel(kernel_exe, env, "run", "-q", "--name", name, "--", "sh", "-c",
                      r'printf "\033[2J\033]52;c;ZXZpbA==\007hidden\n"')
        assert made.returncode == 0, made.stderr
        for args in (("show", "last"), ("show", "last", "--raw"), ("runs",),
                     ("query", "SELECT name, chr(155) AS c1, chr(127) AS del FROM runs"),
                     ("query", "SELECT 1 AS \"\x1b[2J\"")):
            got = kernel(kernel_exe, env, *args)
            assert got.returncode == 0, (args, got.stderr)
            _no_controls(got.stdout)
        shown = kernel(kernel_exe, env, "show", "last").stdout
        assert "nm\\x1b]0;PWNED\\x07" in shown
        assert "\\x1b[2J\\x1b]52;c;ZXZpbA==\\x07hidden" in shown
        assert "\\x9b" in kernel(kernel_exe, env, "query", "SELECT chr(155) AS c").stdout
        csv_out = kernel(kernel_exe, env, "query", "SELECT name FROM runs", "--format", "csv")
        assert csv_out.stdout.splitlines()[1] == name
        doc = json.loads(kernel(kernel_exe, env, "show", "last", "--json").stdout)
        assert doc["run"]["name"] == name
        assert any(e["payload"].get("line") == "\x1b[2J\x1b]52;c;ZXZpbA==\x07hidden"
                   for e in doc["events"] if e["kind"] == "output")


class TestNotADatabase:
    @pytest.mark.parametrize("what", ["garbage", "empty", "directory", "slash", "env-slash"])
    def test_run_refuses_a_db_that_is_not_a_duckdb_file(self, kernel_exe: str,
                                                        cli_env: dict[str, str],
                                                        tmp_path: Path, what: str) -> None:
        """--db / $KERNEL_DB naming a garbage or empty file, a directory or a path ending in
        a slash: `kernel run` runs nothing, records nothing beside it, says why, exit 2."""
        env = dict(cli_env)
        target = tmp_path / "target.duckdb"
        args: list[str] = ["--db", str(target)]
        if what == "garbage":
            target.write_bytes(b"this is not a database at all\n" * 10)
        elif what == "empty":
            target.touch()
        elif what == "directory":
            target.mkdir()
        elif what == "slash":
            args = ["--db", str(target) + "/"]
        else:
            env["KERNEL_DB"] = str(target) + "/"
            args = []
        before = sorted(p.name for p in tmp_path.iterdir())
        marker = tmp_path / "ran"
        proc = kernel(kernel_exe, env, "run", *args, "--", sys.executable, "-c",
                      f"open({str(marker)!r}, 'w')")
        line = one_line(proc, 2, str(target))
        assert {"garbage": "not a DuckDB database file", "empty": "empty (0 bytes)",
                "directory": "is a directory", "slash": "ends with a slash",
                "env-slash": "$KERNEL_DB"}[what] in line
        assert not marker.exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == before  # no .journal, no .lock

    def test_analysts_are_told_the_file_is_rebuilt_from_the_journal(
            self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """With a journal beside it, a garbage analysts' file does not stop runs; the
        analyst commands say it is not a DuckDB file and how to rebuild it, and moving it
        away then `kernel sync` brings every run back."""
        env = cli_env
        db = Path(env["KERNEL_DB"])
        assert kernel(kernel_exe, env, "run", "-q", "--", "true").returncode == 0
        db.write_bytes(b"garbage" * 100)
        assert kernel(kernel_exe, env, "run", "-q", "--", "true").returncode == 0
        for args in (("runs",), ("sync",), ("query", "SELECT 1"), ("show", "last")):
            line = one_line(kernel(kernel_exe, env, *args), 2, str(db))
            assert "not a DuckDB database file" in line
            assert "rebuilt from the journal" in line and "kernel sync" in line
        db.rename(db.with_name("moved"))
        assert kernel(kernel_exe, env, "sync").returncode == 0
        assert len(json_lines(kernel(kernel_exe, env, "runs", "--json").stdout)) == 2


class TestEmptyStore:
    def test_every_command_treats_an_empty_store_as_normal(self, kernel_exe: str,
                                                           cli_env: dict[str, str],
                                                           tmp_path: Path) -> None:
        """Nothing ever recorded: queries run on the empty tables, purge, sync and export
        exit 0 with nothing done, `show last` is one line and exit 2; no file is made."""
        env = cli_env
        db = Path(env["KERNEL_DB"])
        got = kernel(kernel_exe, env, "query", "SELECT 42 AS x")
        assert (got.returncode, got.stdout.split()) == (0, ["x", "42"]), got.stderr
        got = kernel(kernel_exe, env, "query", "SELECT count(*) AS n FROM runs", "--json")
        assert json_lines(got.stdout) == [{"n": 0}]
        got = kernel(kernel_exe, env, "purge", "--json")
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout) == {"runs": 0, "events": 0, "days": 30}
        got = kernel(kernel_exe, env, "sync", "--json")
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["events"] == 0
        got = kernel(kernel_exe, env, "export", str(tmp_path / "out"))
        assert got.returncode == 0, got.stderr
        assert (tmp_path / "out" / "runs.parquet").exists()
        got = kernel(kernel_exe, env, "query", "WITH x AS (DELETE FROM runs RETURNING *) "
                                               "SELECT * FROM x")
        one_line(got, 2, "query is read-only: DELETE statements are refused")
        one_line(kernel(kernel_exe, env, "show", "last"), 2, "no runs yet")
        assert not db.exists() and not db.with_name(db.name + ".journal").exists()


class TestStrictJson:
    def test_query_json_is_strict_and_keeps_big_integers(self, kernel_exe: str,
                                                         cli_env: dict[str, str]) -> None:
        """NaN and +-Infinity are null in --json (strict JSON), a HUGEINT keeps every digit;
        CSV keeps them as they are."""
        sql = ("SELECT 1/0 AS x, 'nan'::DOUBLE AS n, -(1/0) AS m, [1/0] AS l, "
               "12345678901234567890::HUGEINT AS h")

        def strict(text: str) -> Any:
            return json.loads(text, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))

        got = kernel(kernel_exe, cli_env, "query", sql, "--json")
        assert got.returncode == 0, got.stderr
        assert strict(got.stdout) == {"x": None, "n": None, "m": None, "l": [None],
                                      "h": 12345678901234567890}
        got = kernel(kernel_exe, cli_env, "query", sql, "--format", "csv")
        assert got.stdout.splitlines()[1].endswith(",12345678901234567890")

    def test_a_write_inside_a_select_is_refused_in_the_usual_words(
            self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """A DELETE ... RETURNING in a CTE is refused like any other write, naming no
        internal alias."""
        assert kernel(kernel_exe, cli_env, "run", "-q", "--", "true").returncode == 0
        got = kernel(kernel_exe, cli_env, "query",
                     "WITH x AS (DELETE FROM events RETURNING *) SELECT * FROM x")
        line = one_line(got, 2, "query is read-only: DELETE statements are refused")
        assert "kaudit" not in line


class TestEveryoneSeesUTC:
    def test_json_and_csv_times_are_utc_whatever_tz_is(self, kernel_exe: str,
                                                       cli_env: dict[str, str]) -> None:
        """One instant prints one way for every analyst: UTC in query's CSV and JSON,
        runs --json and show --json, with $TZ far from UTC (it followed $TZ before)."""
        env = {**cli_env, "TZ": "Asia/Kolkata"}
        assert kernel(kernel_exe, env, "run", "-q", "--", "true").returncode == 0
        got = kernel(kernel_exe, env, "query", "select started_at from runs", "--json")
        assert json.loads(got.stdout)["started_at"].endswith("+00:00"), got.stdout
        got = kernel(kernel_exe, env, "query", "select started_at from runs",
                     "--format", "csv")
        assert got.stdout.splitlines()[1].endswith("+00:00"), got.stdout
        (row,) = json_lines(kernel(kernel_exe, env, "runs", "--json").stdout)
        assert row["started_at"].endswith("+00:00") and row["ended_at"].endswith("+00:00")
        doc = json.loads(kernel(kernel_exe, env, "show", "last", "--json").stdout)
        assert doc["run"]["started_at"].endswith("+00:00")


class TestShowJsonIsWhole:
    def test_show_json_has_every_event_unless_limited_and_then_says_so(
            self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """`show --json` once cut a run at 200 events with no sign (no run_end)."""
        assert kernel(kernel_exe, cli_env, "run", "-q", "--", "sh", "-c",
                      "for i in $(seq 1 300); do echo line $i; done").returncode == 0
        got = kernel(kernel_exe, cli_env, "show", "last", "--json")
        doc = json.loads(got.stdout)
        assert len(doc["events"]) > 300 and doc["events"][-1]["kind"] == "run_end"
        assert "events_left_out" not in doc and got.stderr == ""
        got = kernel(kernel_exe, cli_env, "show", "last", "--json", "--limit", "10")
        doc = json.loads(got.stdout)
        assert len(doc["events"]) == 10 and doc["events_left_out"] > 290
        assert "more event(s) not in the document" in got.stderr


class TestRecoverAndResume:
    def test_a_cancelled_command_is_left_alone_and_a_lost_one_is_reported_in_json(
            self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
        """A plain command SIGTERM'd to `cancelled` is not interrupted (not listed, not
        marked lost); one whose supervisor was SIGKILLed is marked lost and `recover
        --json` prints its document; `resume` of a prefix matching both is refused
        naming them, and of one run speaks in run statuses."""
        env = cli_env
        started = tmp_path / "started"

        def supervised(signum: int) -> None:
            started.unlink(missing_ok=True)
            proc = subprocess.Popen(
                [kernel_exe, "run", "-q", "--", sys.executable, "-c",
                 f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); "
                 "time.sleep(600)"], env=env, stderr=subprocess.DEVNULL)
            try:
                until("the command to start", started.exists)
                proc.send_signal(signum)
                proc.wait(timeout=WAIT)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=WAIT)

        import signal

        supervised(signal.SIGTERM)
        [row] = json_lines(kernel(kernel_exe, env, "runs", "--json").stdout)
        cancelled = str(row["run_id"])
        assert row["status"] == "cancelled"
        assert kernel(kernel_exe, env, "recover", "--list", "--json").stdout == ""
        supervised(signal.SIGKILL)
        # Only the run whose supervisor died is interrupted (recover stops what is left
        # of its command before marking it lost).
        listed = json_lines(kernel(kernel_exe, env, "recover", "--list", "--json").stdout)
        assert len(listed) == 1 and listed[0]["run_id"] != cancelled, listed
        killed = str(listed[0]["run_id"])
        got = kernel(kernel_exe, env, "recover", "--json")
        assert got.returncode == 1, got.stderr
        [doc] = json_lines(got.stdout)
        assert (doc["run_id"], doc["status"], doc["resumed"]) == (killed, "lost", False)
        statuses = {r["run_id"]: r["status"]
                    for r in json_lines(kernel(kernel_exe, env, "runs", "--json").stdout)}
        assert statuses == {cancelled: "cancelled", killed: "lost"}
        prefix = cancelled[:4]  # the start time's first digits: shared by runs a second apart
        assert killed.startswith(prefix)
        line = one_line(kernel(kernel_exe, env, "resume", prefix), 2, "ambiguous")
        assert cancelled[20:28] in line and killed[20:28] in line
        one_line(kernel(kernel_exe, env, "resume", cancelled[20:28]), 2,
                 "ended cancelled; nothing to resume")
        one_line(kernel(kernel_exe, env, "resume", killed[20:28]), 2,
                 "ended lost; nothing to resume")


class TestOptions:
    def test_conflicting_and_empty_options_are_refused(self, kernel_exe: str,
                                                       cli_env: dict[str, str],
                                                       tmp_path: Path) -> None:
        """`runs -q` with --json or --format and `export ''` are one line and exit 2;
        `show --kind` of a kind the run lacks says so on stderr (kinds are an open set)."""
        env = cli_env
        assert kernel(kernel_exe, env, "run", "-q", "--", "true").returncode == 0
        one_line(kernel(kernel_exe, env, "runs", "-q", "--json"), 2, "-q/--quiet")
        one_line(kernel(kernel_exe, env, "runs", "-q", "--format", "csv"), 2, "-q/--quiet")
        one_line(kernel(kernel_exe, env, "export", ""), 2, "DIR must not be empty")
        got = kernel(kernel_exe, env, "show", "last", "--kind", "bogus", "--json")
        assert got.returncode == 0, got.stderr
        assert json.loads(got.stdout)["events"] == []
        assert "no 'bogus' event" in got.stderr and "run_start" in got.stderr
        got = kernel(kernel_exe, env, "show", "last", "--kind", "run_start")
        assert got.returncode == 0 and got.stderr == ""
