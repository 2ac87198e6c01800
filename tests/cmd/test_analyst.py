"""The analysts' commands: `kernel runs / show / stats / query / purge / export`."""

from __future__ import annotations

import csv
import io
import json
import re
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import trio
from typer.testing import CliRunner

from batteries.audit import DuckDBAudit, Store
from batteries.store import journal_path
from kernel import RunInfo, RunStats, Status, Step, ToolCall, ToolResult, Usage
from kernel_cli.app import app

PROCS = Path(__file__).resolve().parent.parent / "batteries" / "audit_procs.py"

# Hand-picked run ids so prefixes are predictable: abc1/abc2 share "abc"; their random
# ends (the short ids: digits 21-28) a1b2c3d4/a1b2ffff share "a1b2".
A, B, C, D, E = ("abc1" + "0" * 16 + "a1b2c3d40001", "abc2" + "0" * 16 + "a1b2ffff0002",
                 "def0" + "0" * 16 + "c0ffee000003", "0dd0" + "0" * 16 + "d00d00000004",
                 "e0e0" + "0" * 16 + "e1e1e1000005")


async def _populate(db: Path) -> None:
    async with DuckDBAudit.open(db) as audit:
        rec = await audit.start_run(RunInfo(name="lint ok", run_id=A, subject_id="lint",
                                            caller_id="ci", inputs={"repo": "x"}))
        rec.log_event("tool_start", name="grep", payload={"args": {"pattern": "TODO"}},
                      iteration=0)
        for ms in (10.0, 20.0, 30.0, 40.0, 100.0):
            rec.on_tool(ToolResult(ToolCall("grep"), output="3 matches", duration_s=ms / 1000),
                        0)
        rec.on_step(0, Step(output="all clean", final=True), 0.5)
        await rec.close(RunStats(Status.OK, output="all clean", steps=1, tool_calls=5,
                                 runtime_seconds=2.0,
                                 usage=Usage(input_tokens=10, cost_usd=0.5)))
        rec = await audit.start_run(RunInfo(name="lint failed", run_id=B, subject_id="lint"))
        rec.log_error("exploded")
        await rec.close(RunStats(Status.ERROR, error="RuntimeError: exploded", steps=1,
                                 runtime_seconds=4.0))
        rec = await audit.start_run(RunInfo(name="deploy", run_id=C, subject_id="deploy"))
        rec.on_tool(ToolResult(ToolCall("kubectl"), error="denied", duration_s=1.0), 0)
        rec.log_event("critic", name="kill", payload={"reason": "looping"}, iteration=3)
        await rec.close(RunStats(Status.KILLED, reason="looping", steps=4, runtime_seconds=8.0))
        rec = await audit.start_run(RunInfo(name="ancient", run_id=D, subject_id="lint"))
        await rec.close(RunStats(Status.OK, steps=1, runtime_seconds=1.0))
        rec = await audit.start_run(RunInfo(name="in flight", run_id=E, subject_id="deploy"))
        rec.log_event("state_enter", name="build")
        await audit.flush()  # E stays open: no close
    # Age run D in the journal, where runs live (the analysts' file copies it).
    old = int((datetime.now(UTC) - timedelta(days=40)).timestamp() * 1e6)
    with closing(sqlite3.connect(journal_path(db))) as con, con:
        con.execute("UPDATE runs SET started_at = ?, ended_at = ? WHERE run_id = ?",
                    (old, old + 1_000_000, D))
        con.execute("UPDATE events SET ts = ? WHERE run_id = ?", (old, D))


@pytest.fixture
def db(_isolated_db: Path) -> Path:
    """The test's $KERNEL_DB, holding five runs: ok, error, killed, 40 days old, in flight."""
    trio.run(_populate, _isolated_db)
    return _isolated_db


runner = CliRunner()


def kernel(*args: str) -> tuple[int, str, str]:
    """Invoke the real app in-process; return (exit code, stdout, stderr)."""
    result = runner.invoke(app, list(args), catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def one_line_error(code: int, out: str, err: str, want_code: int, *fragments: str) -> None:
    assert code == want_code, (code, out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert re.match(r"kernel [a-z]+: error: ", lines[0]), lines[0]  # `kernel <cmd>: error:`
    for f in fragments:
        assert f in lines[0], lines[0]


def runs_json(*args: str) -> list[dict[str, object]]:
    code, out, err = kernel("runs", "--json", *args)
    assert code == 0, err
    result: list[dict[str, object]] = [json.loads(line) for line in out.splitlines()]
    return result


class TestRuns:
    def test_lists_runs_newest_first(self, db: Path) -> None:
        """The table shows every run, newest first, with status, steps and runtime."""
        code, out, _ = kernel("runs")
        assert code == 0
        lines = out.splitlines()
        assert lines[0].split() == ["RUN", "STARTED", "(UTC)", "STATUS", "STEPS", "TOOLS",
                                    "RUNTIME", "NAME"]
        assert [ln.split()[0] for ln in lines[1:]] == [r[20:28] for r in (E, C, B, A, D)]
        assert "running" in lines[1] and "killed" in lines[2]

    def test_filters_by_status_since_and_limit(self, db: Path) -> None:
        """--status, --since and --limit narrow the list ("running" means still open)."""
        assert [r["run_id"] for r in runs_json("--status", "error")] == [B]
        assert [r["run_id"] for r in runs_json("--status", "running")] == [E]
        assert D not in [r["run_id"] for r in runs_json("--since", "7d")]
        assert D in [r["run_id"] for r in runs_json("--since", "60d")]
        assert len(runs_json("--limit", "2")) == 2

    def test_json_has_full_ids_and_iso_times(self, db: Path) -> None:
        """--json prints full run ids and ISO-8601 timestamps."""
        first = runs_json("--status", "ok", "--since", "1d")[0]
        assert first["run_id"] == A
        assert (first["status"], first["steps"], first["tool_calls"]) == ("ok", 1, 5)
        assert datetime.fromisoformat(str(first["started_at"])).tzinfo is not None

    @pytest.mark.parametrize(("args", "fragment"), [
        (["--status", "great"], "--status must be one of"),
    ])
    def test_bad_input_is_one_line_and_exit_2(self, db: Path, args: list[str],
                                              fragment: str) -> None:
        """Malformed options give one error line and exit code 2."""
        one_line_error(*kernel("runs", *args), 2, fragment)

    def test_a_missing_database_is_no_runs_yet(self, tmp_path: Path) -> None:
        """No database at the path: no runs yet, naming the path, exit code 0."""
        missing = tmp_path / "nowhere.duckdb"
        code, out, _ = kernel("runs", "--db", str(missing))
        assert code == 0 and out.strip() == f"no runs yet (no audit database at {missing})"


class TestShow:
    def test_a_unique_prefix_shows_the_timeline(self, db: Path) -> None:
        """A unique prefix finds the run; the timeline lists seq, +ms, kind, name, summary."""
        code, out, _ = kernel("show", "abc1")
        assert code == 0
        assert f"run      a1b2c3d4  {A}  lint ok" in out
        assert "status   ok" in out
        header = next(ln for ln in out.splitlines() if ln.startswith("SEQ"))
        assert header.split() == ["SEQ", "+MS", "KIND", "NAME", "DURATION", "SUMMARY"]
        rows = out.split(header)[1].strip().splitlines()
        assert [r.split()[0] for r in rows] == [str(i) for i in range(9)]
        assert [r.split()[2] for r in rows] == ["run_start", "tool_start"] + ["tool_end"] * 5 \
            + ["step", "run_end"]
        assert "-> 3 matches" in rows[2] and "100.0ms" in rows[6]
        assert "final, output all clean" in rows[7]

    def test_json_has_the_run_and_its_events(self, db: Path) -> None:
        """--json prints the run row and its events with parsed payloads and offsets."""
        code, out, _ = kernel("show", C, "--json")
        assert code == 0
        shown = json.loads(out)
        assert (shown["run"]["run_id"], shown["run"]["status"]) == (C, "killed")
        assert [e["kind"] for e in shown["events"]] == ["run_start", "tool_end", "critic",
                                                        "run_end"]
        critic = shown["events"][2]
        assert (critic["name"], critic["payload"], critic["summary"]) == (
            "kill", {"reason": "looping"}, "looping")
        assert all(e["offset_ms"] >= 0 for e in shown["events"])

    def test_a_uuid_with_dashes_is_accepted(self, db: Path) -> None:
        """Ids pasted in UUID form (with dashes, any case) resolve too."""
        code, out, _ = kernel("show", "DEF00000-0000", "--json")
        assert code == 0 and json.loads(out)["run"]["run_id"] == C

    @pytest.mark.parametrize(("prefix", "fragment"), [
        ("abc", f"is ambiguous: it matches a1b2c3d4 ({A}), a1b2ffff ({B})"),
        ("a1b2", "is ambiguous: it matches a1b2c3d4"),
        ("fff", "no run matches 'fff'"),
        ("not-hex!", "no run matches 'not-hex!'"),
        ("a/b", "a run id is a short id (8 hex digits), a full id or 'last'"),
    ])
    def test_bad_ids_are_one_line_and_exit_2(self, db: Path, prefix: str,
                                             fragment: str) -> None:
        """Ambiguous, unknown and malformed ids: one error line, exit code 2."""
        one_line_error(*kernel("show", prefix), 2, fragment)


class TestShowReadable:
    """`kernel show` an analyst can read (issue 17): filters, limits, the exit code."""

    def test_kind_filters_the_timeline(self, db: Path) -> None:
        """--kind keeps only those kinds (repeatable or comma-separated), in JSON too."""
        code, out, _ = kernel("show", "abc1", "--kind", "tool_end")
        rows = out.split("SUMMARY", 1)[1].strip().splitlines()
        assert code == 0 and [r.split()[2] for r in rows] == ["tool_end"] * 5
        code, out, _ = kernel("show", "abc1", "--kind", "step,run_end", "--kind", "tool_start",
                              "--json")
        assert [e["kind"] for e in json.loads(out)["events"]] == ["tool_start", "step",
                                                                  "run_end"]

    def test_limit_shows_the_first_events_and_says_how_many_are_left(self, db: Path) -> None:
        """--limit 3 prints three events and a note naming the six left out."""
        code, out, _ = kernel("show", "abc1", "--limit", "3")
        body = out.split("SUMMARY", 1)[1].strip().splitlines()
        assert code == 0 and len(body) == 4
        assert body[-1].startswith("(6 more row(s) not shown: --limit 0 shows all")
        assert "more event" not in kernel("show", "abc1", "--limit", "0")[1]

    def test_a_killed_commands_exit_code_is_in_the_header(self, tmp_path: Path) -> None:
        """A run killed mid-command shows the command's exit code from its process_exit."""
        path = tmp_path / "killed.duckdb"
        rid = "f" * 20 + "b0b0b0b0b0b0"

        async def populate() -> None:
            async with DuckDBAudit.open(path) as audit:
                rec = await audit.start_run(RunInfo(name="sleep 30", run_id=rid))
                rec.log_event("process_start", name="sleep", payload={"pid": 1})
                rec.log_event("process_exit", name="sleep", payload={"exit_code": 143})
                await rec.close(RunStats(Status.KILLED, reason="stalled", runtime_seconds=1.0))

        trio.run(populate)
        code, out, err = kernel("show", "b0b0b0b0", "--db", str(path))
        assert code == 0, err
        assert "status   killed (exit 143)" in out

    def test_lines_fit_the_terminal(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """On a terminal 60 columns wide, no line of `kernel show` is longer than 60."""
        import os
        import pty

        subprocess.run([kernel_exe, "run", "--", "sh", "-c", "echo " + "x" * 200],
                       env=cli_env, capture_output=True, stdin=subprocess.DEVNULL, timeout=60)
        master, slave = pty.openpty()
        proc = subprocess.Popen([kernel_exe, "show", "last"], stdout=slave, stderr=slave,
                                stdin=subprocess.DEVNULL, env={**cli_env, "COLUMNS": "60"})
        os.close(slave)
        seen = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        os.close(master)
        assert proc.wait(timeout=60) == 0
        lines = seen.decode().replace("\r", "").splitlines()
        assert any("xxxxxxxx" in ln for ln in lines)
        assert max(len(ln) for ln in lines) <= 60


class TestShortIds:
    """Ids a person can type: the random end of the id, resolved the same everywhere."""

    def test_a_short_id_in_any_case_shows_the_run(self, db: Path) -> None:
        """`kernel show C0FFEE00` (the short id, upper case) finds run C."""
        code, out, err = kernel("show", "C0FFEE00", "--json")
        assert code == 0, err
        shown = json.loads(out)["run"]
        assert (shown["run_id"], shown["short_id"]) == (C, "c0ffee00")

    def test_a_short_prefix_of_four_digits_is_enough(self, db: Path) -> None:
        """Four digits of the random end find the run when no other run shares them."""
        code, out, _ = kernel("show", "d00d", "--json")
        assert code == 0 and json.loads(out)["run"]["run_id"] == D

    def test_last_and_dash_l_show_the_newest_run(self, db: Path) -> None:
        """`kernel show last` and `kernel show -l` show the most recently started run."""
        for args in (["last"], ["-l"], ["--last"], ["LAST"]):
            code, out, err = kernel("show", *args, "--json")
            assert code == 0, err
            assert json.loads(out)["run"]["run_id"] == E

    def test_last_is_not_a_child_run(self, db: Path) -> None:
        """A sub-loop's child starts after its parent: `last` is still the parent, the run
        the user started (it was the child)."""
        parent, child = "f0f0" + "0" * 16 + "f1f1f1000006", "f0f1" + "0" * 16 + "f2f2f2000007"

        async def nested() -> None:
            async with DuckDBAudit.open(db) as audit:
                top = await audit.start_run(RunInfo(name="loop", run_id=parent))
                top.log_event("child_start", name="sub", payload={"child_run_id": child})
                sub = await audit.start_run(RunInfo(name="sub", run_id=child,
                                                    parent_run_id=parent))
                await sub.close(RunStats(Status.ERROR, steps=1, runtime_seconds=1.0,
                                         error="exit 3"))
                top.log_event("child_end", name="sub", payload={
                    "child_run_id": child, "status": "error", "error": "exit 3"})
                await top.close(RunStats(Status.OK, steps=1, runtime_seconds=2.0))

        trio.run(nested)
        code, out, err = kernel("show", "last", "--json")
        assert code == 0, err
        assert json.loads(out)["run"]["run_id"] == parent
        code, out, _ = kernel("show", child[20:28], "--json")  # the child by its id
        assert code == 0 and json.loads(out)["run"]["run_id"] == child
        # The parent's timeline names the child by the short id `kernel show` takes, and
        # says how it ended (its payload's JSON and 32-digit id before).
        code, out, _ = kernel("show", "last")
        assert code == 0
        assert "child f2f2f200 started" in out and "child f2f2f200 error: exit 3" in out

    def test_show_needs_an_id_or_last(self, db: Path) -> None:
        """Neither an id nor --last (or both) is one line and exit 2."""
        one_line_error(*kernel("show"), 2, "give a RUN_ID or --last")
        one_line_error(*kernel("show", "-l", "abc1"), 2, "give a RUN_ID or --last")

    def test_runs_quiet_prints_short_ids_only(self, db: Path) -> None:
        """`kernel runs -q` prints one short id a line, newest first; each one resolves."""
        code, out, _ = kernel("runs", "-q")
        assert code == 0
        assert out.split() == [r[20:28] for r in (E, C, B, A, D)]
        for short in out.split():
            assert kernel("show", short, "--json")[0] == 0

    def test_last_with_no_runs(self, tmp_path: Path) -> None:
        """'last' where no run was ever recorded says so: one line, exit 2."""
        empty = tmp_path / "empty.duckdb"
        one_line_error(*kernel("show", "last", "--db", str(empty)), 2, "no runs yet")
        one_line_error(*kernel("show", "-l", "--db", str(empty)), 2, "no runs yet")


class TestEmptyState:
    """A fresh install has no runs: the listing commands say so and exit 0 (issue 17)."""

    @pytest.mark.parametrize("args", [["runs"], ["stats"], ["stats", "--by", "tool"]])
    def test_listing_with_no_runs_exits_0(self, tmp_path: Path, args: list[str]) -> None:
        """`kernel runs` / `stats` on a fresh $HOME: "no runs yet" on stdout, exit 0."""
        code, out, err = kernel(*args, "--db", str(tmp_path / "fresh.duckdb"))
        assert (code, err) == (0, "")
        assert out.startswith("no runs yet (no audit database at ")

    def test_query_with_no_runs_exits_0(self, tmp_path: Path) -> None:
        """`kernel query` on a fresh $HOME runs against the (empty) schema and exits 0,
        creating no file."""
        fresh = tmp_path / "fresh.duckdb"
        code, out, _ = kernel("query", "SELECT 1 AS one, (SELECT count(*) FROM runs) AS n",
                              "--db", str(fresh), "--format", "csv")
        assert (code, out.split()) == (0, ["one,n", "1,0"])
        assert not fresh.exists()

    def test_json_and_ids_with_no_runs_are_empty(self, tmp_path: Path) -> None:
        """Scripts get an empty result, not a sentence: `runs -q`, `runs --json`, `stats --json`."""
        fresh = str(tmp_path / "fresh.duckdb")
        assert kernel("runs", "-q", "--db", fresh)[:2] == (0, "")
        assert kernel("runs", "--json", "--db", fresh)[:2] == (0, "")
        assert kernel("stats", "--json", "--db", fresh)[:2] == (0, "")

    def test_a_fresh_home_end_to_end(self, kernel_exe: str, tmp_path: Path) -> None:
        """The installed `kernel runs` with a fresh $HOME and no $KERNEL_DB exits 0."""
        import os

        env = {k: v for k, v in os.environ.items() if k not in ("KERNEL_DB", "XDG_DATA_HOME")}
        env["HOME"] = str(tmp_path)
        proc = subprocess.run([kernel_exe, "runs"], env=env, capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"no runs yet (no audit database at {tmp_path}")


class TestStats:
    def test_by_subject_and_status(self, db: Path) -> None:
        """--by subject groups runs by subject and status, with count, mean and p95."""
        code, out, _ = kernel("stats", "--json")
        assert code == 0
        rows = {(r["subject"], r["status"]): r for r in map(json.loads, out.splitlines())}
        assert rows[("lint", "ok")]["runs"] == 2  # A and the old D
        assert rows[("lint", "ok")]["mean_s"] == pytest.approx(1.5)
        assert rows[("deploy", "killed")]["p95_s"] == pytest.approx(8.0)
        assert rows[("deploy", "running")]["runs"] == 1

    def test_since_excludes_old_runs(self, db: Path) -> None:
        """--since drops runs started before the window."""
        code, out, _ = kernel("stats", "--by", "status", "--since", "7d", "--json")
        assert code == 0
        rows = {r["status"]: r["runs"] for r in map(json.loads, out.splitlines())}
        assert rows == {"ok": 1, "error": 1, "killed": 1, "running": 1}

    def test_by_tool_gives_latency_percentiles(self, db: Path) -> None:
        """--by tool reports calls, errors and p95 latency per tool, as a table too."""
        code, out, _ = kernel("stats", "--by", "tool", "--json")
        assert code == 0
        rows = {r["tool"]: r for r in map(json.loads, out.splitlines())}
        assert rows["grep"]["calls"] == 5 and rows["grep"]["errors"] == 0
        assert rows["grep"]["p95_ms"] == pytest.approx(88.0)  # 40 + 0.8 * (100 - 40)
        assert rows["kubectl"]["errors"] == 1
        code, out, _ = kernel("stats", "--by", "tool")
        assert out.splitlines()[0].split()[:3] == ["TOOL", "CALLS", "ERRORS"]

    def test_a_bad_grouping_is_one_line_and_exit_2(self, db: Path) -> None:
        """--by accepts only subject, status or tool."""
        one_line_error(*kernel("stats", "--by", "colour"), 2, "--by must be one of")


class TestQuery:
    def test_formats(self, db: Path) -> None:
        """A SELECT prints as an aligned table, JSON records, or CSV with a header."""
        sql = "SELECT name, steps FROM runs WHERE status = 'ok' ORDER BY name"
        code, out, _ = kernel("query", sql)
        assert code == 0
        assert [ln.split() for ln in out.splitlines()] == [["name", "steps"],
                                                           ["ancient", "1"],
                                                           ["lint", "ok", "1"]]
        code, out, _ = kernel("query", sql, "--format", "json")
        assert [json.loads(line) for line in out.splitlines()] == [{"name": "ancient", "steps": 1},
                                   {"name": "lint ok", "steps": 1}]
        code, out, _ = kernel("query", sql, "--format", "csv")
        assert list(csv.reader(io.StringIO(out))) == [["name", "steps"], ["ancient", "1"],
                                                      ["lint ok", "1"]]

    def test_the_views_are_queryable(self, db: Path) -> None:
        """The ready-made views answer through `kernel query`."""
        code, out, _ = kernel("query", "SELECT decision, reason FROM critic_decisions",
                              "--format", "json")
        assert code == 0 and [json.loads(line) for line in out.splitlines()] == [
            {"decision": "kill", "reason": "looping"}]

    @pytest.mark.parametrize("sql", [
        "DELETE FROM runs",
        "UPDATE runs SET status = 'ok'",
        "DROP TABLE events",
        "CREATE TABLE x AS SELECT 1",
        "COPY runs TO 'stolen.csv'",
        "ATTACH 'other.duckdb' AS o",
        "SET threads = 1",
    ])
    def test_writes_are_refused_and_change_nothing(self, db: Path, sql: str) -> None:
        """Anything but a query is refused with one line, exit 2, and the data is untouched."""
        code, out, err = kernel("query", sql)
        kind = sql.split()[0].upper()
        one_line_error(code, out, err, 2, "query is read-only", kind)
        with Store(db).reader() as cur:
            assert cur.execute("SELECT count(*) FROM runs").fetchall() == [(5,)]
            assert cur.execute("SELECT count(*) FROM runs WHERE status = 'ok'"
                               ).fetchall() == [(2,)]

    @pytest.mark.parametrize(("args", "fragment"), [
        (["SELECT 1; SELECT 2"], "exactly one statement"),
        (["SELEKT nonsense"], "invalid SQL"),
        (["SELECT * FROM no_such_table"], "query failed"),
        (["SELECT 1", "--format", "xml"], "--format must be table, json or csv"),
    ])
    def test_bad_queries_are_one_line_and_exit_2(self, db: Path, args: list[str],
                                                 fragment: str) -> None:
        """Several statements, bad SQL, unknown tables and formats: one line, exit 2."""
        one_line_error(*kernel("query", *args), 2, fragment)


class TestPurgeAndExport:
    def test_purge_deletes_runs_older_than_the_retention(self, db: Path) -> None:
        """The default retention (30 days) removes the 40-day-old run and its events only."""
        code, out, _ = kernel("purge")
        assert code == 0
        assert out.strip() == "purged 1 runs (2 events) older than 30 days"
        assert D not in [r["run_id"] for r in runs_json("--limit", "100")]
        assert len(runs_json("--limit", "100")) == 4

    def test_purge_days_come_from_the_environment(self, db: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
        """$KERNEL_RETENTION_DAYS sets the default; --days overrides it."""
        monkeypatch.setenv("KERNEL_RETENTION_DAYS", "100")
        _, out, _ = kernel("purge")
        assert out.startswith("purged 0 runs")
        _, out, _ = kernel("purge", "--days", "0")
        assert out.startswith("purged 4 runs")  # not E, still running
        monkeypatch.setenv("KERNEL_RETENTION_DAYS", "a month")
        one_line_error(*kernel("purge"), 2, "KERNEL_RETENTION_DAYS")

    def test_export_writes_one_parquet_file_per_table(self, db: Path, tmp_path: Path) -> None:
        """export DIR writes runs, events and schema_version, then the journal's mirrored
        tables, as Parquet with every row."""
        import duckdb

        out_dir = tmp_path / "export"
        code, out, _ = kernel("export", str(out_dir))
        assert code == 0
        written = [Path(p) for p in out.split()]
        assert [p.name for p in written] == [
            "runs.parquet", "events.parquet", "schema_version.parquet", "batch_tasks.parquet",
            "batches.parquet", "budget_spend.parquet", "budgets.parquet", "checkpoints.parquet",
            "sync_state.parquet"]
        con = duckdb.connect()
        counts = [con.execute(f"SELECT count(*) FROM read_parquet('{p}')").fetchall()[0][0]
                  for p in written[:3]]
        con.close()
        from batteries.audit import SCHEMA_VERSION

        assert counts == [5, 20, SCHEMA_VERSION]

    def test_export_to_a_file_is_refused(self, db: Path, tmp_path: Path) -> None:
        """An export target that is a file gives one line and exit 2."""
        target = tmp_path / "file.txt"
        target.write_text("x")
        one_line_error(*kernel("export", str(target)), 2, "is not a directory")


@pytest.mark.realtime
class TestInstalledExecutable:
    def test_a_delete_through_the_real_cli_is_refused(self, db: Path, kernel_exe: str,
                                                      cli_env: dict[str, str]) -> None:
        """`kernel query "DELETE FROM runs"` exits 2 with one stderr line; nothing is deleted."""
        env = {**cli_env, "KERNEL_DB": str(db)}
        proc = subprocess.run([kernel_exe, "query", "DELETE FROM runs"], env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2
        assert proc.stdout == ""
        assert proc.stderr.splitlines() == [
            "kernel query: error: query is read-only: DELETE statements are refused"]
        with Store(db).reader() as cur:
            assert cur.execute("SELECT count(*) FROM runs").fetchall() == [(5,)]

    def test_kernel_run_is_recorded_and_shown(self, kernel_exe: str,
                                              cli_env: dict[str, str]) -> None:
        """`kernel run -- CMD` writes the database that `kernel runs` and `show` read."""
        ran = subprocess.run([kernel_exe, "run", "--json", "--", "echo", "hello"], env=cli_env,
                             capture_output=True, text=True, timeout=60)
        assert ran.returncode == 0, ran.stderr
        run_id = json.loads(ran.stdout)["run_id"]
        listed = subprocess.run([kernel_exe, "runs", "--json"], env=cli_env,
                                capture_output=True, text=True, timeout=60)
        assert [json.loads(line)["run_id"] for line in listed.stdout.splitlines()] == [run_id]
        shown = subprocess.run([kernel_exe, "show", run_id[:16]], env=cli_env,
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert "process_exit" in shown.stdout and "output hello" in shown.stdout

    def test_a_reader_waits_for_a_writer_then_answers(self, db: Path, kernel_exe: str,
                                                      cli_env: dict[str, str]) -> None:
        """While another process holds the file, `kernel runs` waits (bounded) then answers;
        past its lock timeout it fails with one line and exit 1."""
        env = {**cli_env, "KERNEL_DB": str(db)}
        holder = subprocess.Popen([sys.executable, str(PROCS), "hold", str(db)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and "held" in holder.stdout.readline()
        gave_up = subprocess.run([kernel_exe, "runs"], capture_output=True, text=True,
                                 env={**env, "KERNEL_AUDIT_LOCK_TIMEOUT": "0.2"}, timeout=60)
        waiting = subprocess.Popen([kernel_exe, "runs", "--json"], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=env)
        time.sleep(1.5)
        assert waiting.poll() is None  # still waiting (its lock timeout is 10 s)
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
        out, err = waiting.communicate(timeout=60)
        assert gave_up.returncode == 1
        assert gave_up.stderr.splitlines() == [
            f"kernel runs: error: audit database {db} is locked by another process "
            "(gave up after 0.2s)"]
        assert waiting.returncode == 0, err
        assert len(out.splitlines()) == 5

    def test_help_does_not_import_duckdb(self) -> None:
        """Loading the CLI (with the analysts' commands) imports neither duckdb nor pyarrow."""
        probe = ("import sys, kernel_cli.app as a; "
                 "names = {c.name for c in a.app.registered_commands}; "
                 "assert {'runs', 'show', 'stats', 'query', 'purge', 'export'} <= names, names; "
                 "print(sorted(m for m in ('duckdb', 'pyarrow', 'batteries.audit') "
                 "if m in sys.modules))")
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "[]"


class TestSummaries:
    def test_adapter_events_read_well(self) -> None:
        """kernel show summarises pane attempts and CLI-agent events by what matters."""
        from batteries.audit.queries import summarize

        assert summarize("attempt", {"outcome": "success", "elapsed_s": 1.234,
                                     "agent": "claude-1", "pane_before": "x" * 500}) == (
            "success after 1.23s on claude-1")
        assert summarize("agent_event", {"event": "text_delta", "state": "responding",
                                         "lifecycle": "working", "text": "Hello"}) == (
            "[working/responding] Hello")


class TestMachineOutput:
    """One vocabulary (issue 17): --json is one document or JSON lines; tables take --format."""

    @staticmethod
    def lines(out: str) -> list[dict[str, object]]:
        return [json.loads(line) for line in out.splitlines()]

    def test_lists_are_json_lines_and_format_json_is_the_same(self, db: Path) -> None:
        """runs, stats, query: one object a line; `--format json` prints exactly `--json`."""
        for args in (["runs"], ["stats"], ["stats", "--by", "tool"],
                     ["query", "SELECT name FROM runs ORDER BY name"]):
            code, out, err = kernel(*args, "--json")
            assert code == 0, err
            rows = self.lines(out)
            assert rows and all(isinstance(r, dict) for r in rows), (args, out)
            assert kernel(*args, "--format", "json")[:2] == (0, out), args

    def test_format_csv_has_a_header_then_one_row_a_line(self, db: Path) -> None:
        code, out, _ = kernel("runs", "--format", "csv")
        table = list(csv.reader(io.StringIO(out)))
        assert code == 0 and table[0][:2] == ["run_id", "parent_run_id"]
        assert {row[0] for row in table[1:]} == {A, B, C, D, E}
        code, out, _ = kernel("stats", "--by", "status", "--format", "csv")
        table = list(csv.reader(io.StringIO(out)))
        assert code == 0 and table[0][0] == "status" and len(table) > 2
        code, out, _ = kernel("runs", "--format", "table")
        assert code == 0 and out.startswith("RUN ")

    def test_single_results_are_one_document_on_one_line(self, db: Path) -> None:
        """show, purge, sync: exactly one line of stdout, one JSON object."""
        for args in (["show", "a1b2c3d4"], ["sync"], ["purge", "--days", "365"]):
            code, out, err = kernel(*args, "--json")
            assert code == 0, err
            assert out.count("\n") == 1 and isinstance(json.loads(out), dict), (args, out)
        assert json.loads(kernel("show", "a1b2c3d4", "--json")[1])["run"]["run_id"] == A
        assert set(json.loads(kernel("sync", "--json")[1])) >= {"events", "runs", "seconds"}

    def test_export_lists_its_files_as_json_lines(self, db: Path, tmp_path: Path) -> None:
        code, out, err = kernel("export", str(tmp_path / "out"), "--json")
        assert code == 0, err
        paths = [Path(str(r["path"])) for r in self.lines(out)]
        assert paths and all(p.suffix == ".parquet" and p.exists() for p in paths)

    def test_an_empty_list_is_no_lines(self, db: Path) -> None:
        for args in (["runs", "--status", "timeout"], ["query", "SELECT 1 WHERE false"]):
            assert kernel(*args, "--json")[:2] == (0, ""), args

    def test_json_and_another_format_is_bad_input(self, db: Path) -> None:
        one_line_error(*kernel("runs", "--json", "--format", "csv"), 2, "two formats")
        one_line_error(*kernel("stats", "--format", "yaml"), 2, "--format must be")


LOOP = """\
name: fixer
initial: test
max_iterations: 6
states:
  test:
    action: test -f ${context.flag}
    evaluate:
      type: exit_code
    on_yes: done
    on_no: fix
  fix:
    action: echo fixing; touch ${context.flag}
    next: test
  done:
    terminal: true
"""


class TestShowReads:
    """`kernel show` an analyst can read (issue 17)."""

    def test_a_loop_state_is_one_line(self, kernel_exe: str, cli_env: dict[str, str],
                                      tmp_path: Path) -> None:
        """test: exit 1 → no → fix, one row per state; --raw gives every event back."""
        loop = tmp_path / "fixer.yaml"
        loop.write_text(LOOP)
        ran = subprocess.run([kernel_exe, "run", "-q", str(loop), "-c",
                              f"flag={tmp_path / 'flag'}"], capture_output=True, text=True,
                             env=cli_env, timeout=120)
        assert ran.returncode == 0, ran.stderr
        shown = subprocess.run([kernel_exe, "show", "last"], capture_output=True, text=True,
                               env=cli_env, timeout=60)
        rows = [line.split(None, 5) for line in shown.stdout.splitlines()
                if re.match(r"\s*\d+\s+\d+\s+state\s", line)]
        assert [(r[3], r[5].split("  ")[0]) for r in rows] == [
            ("test", "exit 1 → no → fix"), ("fix", "exit 0 → test"),
            ("test", "exit 0 → yes → done")], shown.stdout
        assert "(1 output line)" in rows[1][5]
        assert "steps 3" in shown.stdout and " evaluate " not in shown.stdout
        raw = subprocess.run([kernel_exe, "show", "last", "--raw"], capture_output=True,
                             text=True, env=cli_env, timeout=60).stdout
        assert raw.count(" evaluate ") == 2 and " state " not in raw  # fix has none

    def test_a_stopped_command_shows_its_exit_code_and_its_step(
            self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """A timed-out command: `0 steps (the command was stopped)` on the summary and in
        the header, as the `runs` row and --json count it; `(exit 124)` in the header."""
        ran = subprocess.run([kernel_exe, "run", "--timeout", "1", "--", "sleep", "60"],
                             capture_output=True, text=True, env=cli_env, timeout=120)
        assert ran.returncode == 124
        assert ", 0 steps (the command was stopped): hard timeout" in ran.stderr, ran.stderr
        shown = subprocess.run([kernel_exe, "show", "last"], capture_output=True, text=True,
                               env=cli_env, timeout=60).stdout
        assert "status   timeout (exit 124)" in shown
        assert "steps 0 (the command was stopped) " in shown, shown

    def test_a_resumed_runs_totals_cover_its_whole_timeline(self, _isolated_db: Path) -> None:
        """The row holds the last session (0.5 s, 2 steps); the header says 13.5 s, 2 sessions."""
        run_id = "f00d" + "0" * 16 + "5e55105e0001"

        async def record() -> None:
            async with DuckDBAudit.open(_isolated_db) as audit:
                rec = await audit.start_run(RunInfo(name="long", run_id=run_id))
                rec.on_step(0, Step(output="one"), 1.0)
                rec.log_event("resumed", name="count", payload={"steps": 1})
                rec.on_step(1, Step(output="two", final=True), 0.5)
                await rec.close(RunStats(Status.OK, steps=2, runtime_seconds=0.5))

        trio.run(record)
        with closing(sqlite3.connect(journal_path(_isolated_db))) as con, con:
            seq = con.execute("SELECT seq FROM events WHERE run_id = ? AND kind = 'resumed'",
                              (run_id,)).fetchone()[0]
            con.execute("UPDATE events SET ts = ts + 13500000 WHERE run_id = ? AND seq >= ?",
                        (run_id, seq))
        code, out, err = kernel("show", "5e55105e")
        assert code == 0, err
        assert re.search(r"runtime 13\.\d\ds over 2 sessions \(0\.50s in the last\)  steps 2 ",
                         out), out
        doc = json.loads(kernel("show", "5e55105e", "--json")[1])["run"]
        assert doc["sessions"] == 2 and doc["total_steps"] == 2
        assert 13.4 < doc["timeline_seconds"] < 14.0
