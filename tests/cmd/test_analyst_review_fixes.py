"""The analysts' commands after the library/analysts' review: each class is one finding.

Every test drives the installed `kernel` executable in a subprocess against a
real journal and DuckDB file made by the real audit.
"""

from __future__ import annotations

import csv
import io
import json
import os
import socket
import sqlite3
import subprocess
from contextlib import closing
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
import pytest
import trio

from batteries.audit import JournalAudit
from batteries.checkpoint import JournalCheckpointer
from batteries.store import Owner, journal_path
from kernel import (
    Checkpoint,
    ConfigError,
    Kernel,
    Limits,
    LoopSpec,
    Ports,
    PortSpec,
    RunInfo,
    RunSpec,
    RunStats,
    Status,
    Step,
    ToolCall,
    ToolResult,
    Usage,
)
from kernel_cli import ids

HOST_IDS = ("job-42", "build 2024", "with'quote", "ünïcode-run")


def run(kernel_exe: str, env: dict[str, str], *args: str,
        extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`kernel ARGS` in a subprocess; its exit code, stdout and stderr."""
    return subprocess.run([kernel_exe, *args], env={**env, **(extra or {})},
                          capture_output=True, text=True, timeout=120)


class Echo:
    """One final step with `text` as output (and optional usage)."""

    def __init__(self, text: str, usage: Usage | None = None) -> None:
        self.text, self.usage = text, usage or Usage()

    async def step(self, ctx: object) -> Step:
        await trio.lowlevel.checkpoint()
        return Step(output=self.text, final=True, usage=self.usage)


def record(db: Path, *infos: RunInfo, usage: Usage | None = None) -> None:
    """Run an `Echo` under each RunInfo, audited to `db`'s journal."""
    async def go() -> None:
        async with JournalAudit.open(db) as audit:
            k = Kernel(Ports(audit=audit))
            for info in infos:
                result = await k.run(Echo(info.name or "done", usage), info)
                assert result.status is Status.OK, result

    trio.run(go)


def db_of(env: dict[str, str]) -> Path:
    return Path(env["KERNEL_DB"])


class TestHostRunIds:
    """#1: a run id a host chose (any id RunInfo accepts) opens by its full and short id."""

    def test_short_id_of_a_host_id_is_the_id(self) -> None:
        """A host's id has no random end: its short id is the id; ours keep 8 hex digits."""
        assert ids.short_id("job-42") == "job-42"
        ours = "01a2007438aa7bcd" + "8123456789abcdef"
        assert ids.short_id(ours) == ours[20:28] == "456789ab"
        assert ids.pick("job-42", ["job-42", "job-420"]) == "job-42"

    def test_show_export_and_runs_accept_host_ids(self, kernel_exe: str,
                                                  cli_env: dict[str, str]) -> None:
        """`runs -q` prints ids that `show` opens, by the full id too; `export --run` too."""
        db = db_of(cli_env)
        record(db, *(RunInfo(name=f"n{i}", run_id=rid) for i, rid in enumerate(HOST_IDS)))
        listed = run(kernel_exe, cli_env, "runs", "-q")
        assert listed.returncode == 0, listed.stderr
        shorts = listed.stdout.splitlines()
        assert sorted(shorts) == sorted(HOST_IDS)
        for rid in HOST_IDS:
            shown = run(kernel_exe, cli_env, "show", rid, "--json")
            assert shown.returncode == 0, shown.stderr
            assert json.loads(shown.stdout)["run"]["run_id"] == rid
        # Case and dashes do not matter, as for the kernel's own ids.
        shown = run(kernel_exe, cli_env, "show", "JOB42", "--json")
        assert shown.returncode == 0 and json.loads(shown.stdout)["run"]["run_id"] == "job-42"
        table = run(kernel_exe, cli_env, "runs")
        assert "job-42" in table.stdout

    def test_an_exact_host_id_wins_over_ids_it_prefixes(self, kernel_exe: str,
                                                       cli_env: dict[str, str]) -> None:
        """`show job-4` opens job-4 even though job-42 starts with it; `job` is ambiguous."""
        record(db_of(cli_env), RunInfo(name="four", run_id="job-4"),
               RunInfo(name="forty-two", run_id="job-42"))
        shown = run(kernel_exe, cli_env, "show", "job-4", "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["run"]["run_id"] == "job-4"
        vague = run(kernel_exe, cli_env, "show", "job")
        assert vague.returncode == 2 and "ambiguous" in vague.stderr
        assert len(vague.stderr.strip().splitlines()) == 1

    def test_resume_of_an_exact_host_id_is_that_run(self, kernel_exe: str,
                                                   cli_env: dict[str, str],
                                                   tmp_path: Path) -> None:
        """`resume job-1` is about job-1 (ended ok: nothing to resume), never the interrupted
        job-10 its id prefixes; job-10 resumes by its own id."""
        db = db_of(cli_env)
        (tmp_path / "loop.yaml").write_text(
            "name: once\ninitial: a\nstates:\n  a:\n    action: echo resumed\n"
            "    next: done\n  done:\n    terminal: true\n")
        cp = JournalCheckpointer(db)
        cp.owner = Owner(socket.gethostname(), os.getpid(), 1)  # our pid, another start: gone

        def spec(run_id: str) -> RunSpec:
            return RunSpec(LoopSpec(str(tmp_path / "loop.yaml")), RunInfo(run_id=run_id),
                           Limits(timeout=60), PortSpec(db=str(db), no_critic=True),
                           cwd=str(tmp_path))

        async def go() -> None:
            for rid in ("job-1", "job-10"):
                await cp.register(rid, spec(rid))
                await cp.save(Checkpoint(rid, 1, {"loop": "once", "state": "a"}))
            await cp.complete("job-1")

        trio.run(go)
        record(db, RunInfo(name="one", run_id="job-1"))  # its audit: ended ok
        done = run(kernel_exe, cli_env, "resume", "job-1")
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip() == "kernel resume: error: run job-1 ended ok; nothing to resume"
        assert cp.load("job-10").status == "running"  # type: ignore[union-attr]
        resumed = run(kernel_exe, cli_env, "resume", "job-10", "--json")
        assert resumed.returncode == 0, resumed.stdout

    def test_export_run_takes_a_host_id(self, kernel_exe: str, cli_env: dict[str, str],
                                        tmp_path: Path) -> None:
        """`export --otlp URL --run job-42` resolves the id (and then meets no collector)."""
        record(db_of(cli_env), RunInfo(name="n", run_id="job-42"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
            sent = run(kernel_exe, cli_env, "export", "--otlp", dead, "--run", "job-42")
        assert "a run id is" not in sent.stderr and "no run matches" not in sent.stderr
        assert sent.returncode == 1, sent.stderr  # the collector is not there


class TestPurgeBothFiles:
    """#3: purge deletes the purged runs' checkpoints from the analysts' file too."""

    def test_checkpoints_go_from_the_duckdb_file_and_the_export(
            self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
        """A completed run's checkpoint is gone from `query` and `export` after purge."""
        from batteries.checkpoint import JournalCheckpointer
        from batteries.store import Journal
        from kernel import CommandSpec, Limits, PortSpec, RunSpec

        db = db_of(cli_env)
        info = RunInfo(name="spec holder")

        async def go() -> None:
            async with Journal.open(db) as journal:
                audit, cp = JournalAudit(journal), JournalCheckpointer(journal)
                spec = RunSpec(CommandSpec(("echo", "secret-arg")), info, Limits(), PortSpec())
                await cp.register(info.run_id, spec)
                result = await Kernel(Ports(audit=audit, checkpointer=cp)).run(Echo("x"), info)
                assert result.status is Status.OK

        trio.run(go)
        before = run(kernel_exe, cli_env, "query", "select run_id from checkpoints",
                     "--format", "csv")
        assert info.run_id in before.stdout, before
        purged = run(kernel_exe, cli_env, "purge", "--days", "0", "--json")
        assert purged.returncode == 0 and json.loads(purged.stdout)["runs"] == 1, purged
        after = run(kernel_exe, cli_env, "query", "select count(*) n from checkpoints", "--json")
        assert json.loads(after.stdout) == {"n": 0}
        out = tmp_path / "out"
        assert run(kernel_exe, cli_env, "export", str(out)).returncode == 0
        with duckdb.connect() as con:
            left = con.execute(f"select count(*) from '{out / 'checkpoints.parquet'}'")
            assert left.fetchall() == [(0,)]


class TestQueryInUTC:
    """#4: `kernel query` runs its SQL in UTC, whatever $TZ is."""

    def test_day_and_hour_buckets_do_not_depend_on_tz(self, kernel_exe: str,
                                                      cli_env: dict[str, str]) -> None:
        """date_trunc, ::date, hour() and nested timestamps agree under two far-apart zones."""
        db = db_of(cli_env)
        record(db, RunInfo(name="r", run_id="tz-run"))
        at = int(datetime(2026, 11, 24, 20, 12, tzinfo=UTC).timestamp() * 1e6)
        with closing(sqlite3.connect(journal_path(db))) as con, con:
            con.execute("UPDATE runs SET started_at = ? WHERE run_id = 'tz-run'", (at,))
        sql = ("select date_trunc('day', started_at) d, started_at::date dd, "
               "hour(started_at) h, {'ts': started_at} s, current_setting('TimeZone') z "
               "from runs")
        got = [json.loads(run(kernel_exe, cli_env, "query", sql, "--json",
                              extra={"TZ": tz}).stdout) for tz in ("Asia/Kolkata",
                                                                   "Pacific/Kiritimati")]
        assert got[0] == got[1], got
        assert got[0]["h"] == 20 and got[0]["dd"] == "2026-11-24" and got[0]["z"] == "UTC"
        assert got[0]["s"]["ts"].endswith("+00:00")


class TestNotAnAuditDatabase:
    """#9: a --db that is not an audit database is bad input: one line, exit 2, as README says."""

    def test_garbage_and_foreign_duckdb_exit_2(self, kernel_exe: str, cli_env: dict[str, str],
                                               tmp_path: Path) -> None:
        """A non-DuckDB file and a DuckDB file of something else: exit 2, no traceback."""
        garbage = tmp_path / "g.duckdb"
        garbage.write_text("garbage\n")
        foreign = tmp_path / "f.duckdb"
        with duckdb.connect(str(foreign)) as con:
            con.execute("create table runs (x integer)")
        for path in (garbage, foreign):
            for cmd in (["runs"], ["stats"], ["query", "select 1"]):
                got = run(kernel_exe, cli_env, *cmd, "--db", str(path))
                assert got.returncode == 2, (cmd, got.stderr)
                assert len(got.stderr.strip().splitlines()) == 1 and "Traceback" not in got.stderr

    def test_somebody_elses_duckdb_is_left_as_it_is(self, kernel_exe: str,
                                                    cli_env: dict[str, str],
                                                    tmp_path: Path) -> None:
        """A DuckDB file of tables of its own (a mistyped --db) gains none of ours, and no
        journal is made beside it: every analysts' command says so in one line, exit 2."""
        foreign = tmp_path / "sales.duckdb"
        with duckdb.connect(str(foreign)) as con:
            con.execute("create table sales (id integer, amount double)")
            con.execute("insert into sales values (1, 2.5)")
        for cmd in (["runs"], ["stats"], ["sync"], ["show", "abc"], ["query", "select 1"],
                    ["export", str(tmp_path / "out")]):
            got = run(kernel_exe, cli_env, *cmd, "--db", str(foreign))
            assert got.returncode == 2, (cmd, got.stderr)
            assert got.stderr.count("\n") == 1, got.stderr
            assert "is not a kernel audit database" in got.stderr and "sales" in got.stderr
        with duckdb.connect(str(foreign), read_only=True) as con:
            tables = con.execute("select table_name from duckdb_tables()").fetchall()
            assert tables == [("sales",)]
            assert con.execute("select * from sales").fetchall() == [(1, 2.5)]
        assert not journal_path(foreign).exists()

    def test_a_run_is_not_recorded_beside_somebody_elses_duckdb(
            self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
        """`kernel run --db sales.duckdb` is refused before the command runs (one line,
        exit 2): before, it ran and was recorded in a journal beside the file that no
        analysts' command would then read. No journal, no lock file is made; the
        library's `JournalAudit.open` refuses the same way."""
        foreign = tmp_path / "sales.duckdb"
        marker = tmp_path / "ran"
        with duckdb.connect(str(foreign)) as con:
            con.execute("create view totals as select 42 as n")
        got = run(kernel_exe, cli_env, "run", "--db", str(foreign), "--",
                  "touch", str(marker))
        assert got.returncode == 2, got.stderr
        assert got.stderr.count("\n") == 1, got.stderr
        assert "is not a kernel audit database" in got.stderr and "totals" in got.stderr
        assert not marker.exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["sales.duckdb"]

        async def open_it() -> None:
            async with JournalAudit.open(foreign):
                pass

        with pytest.raises(ConfigError, match="not a kernel audit database"):
            trio.run(open_it)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["sales.duckdb"]

    def test_our_file_without_its_journal_still_records(
            self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
        """The check is of somebody else's file only: the analysts' file whose journal
        was moved away (or a DuckDB file with no tables at all) records as before."""
        db = tmp_path / "k.duckdb"
        assert run(kernel_exe, cli_env, "run", "--db", str(db), "--", "true").returncode == 0
        assert run(kernel_exe, cli_env, "sync", "--db", str(db)).returncode == 0
        journal_path(db).unlink()
        got = run(kernel_exe, cli_env, "run", "--db", str(db), "--", "true")
        assert got.returncode == 0, got.stderr
        empty = tmp_path / "empty.duckdb"
        duckdb.connect(str(empty)).close()
        got = run(kernel_exe, cli_env, "run", "--db", str(empty), "--", "true")
        assert got.returncode == 0, got.stderr
        assert run(kernel_exe, cli_env, "sync", "--db", str(db)).returncode == 0
        with duckdb.connect(str(db), read_only=True) as con:
            assert con.execute("select count(*) from runs").fetchall() == [(2,)]

    def test_readme_says_exit_2(self) -> None:
        """README no longer promises exit 1 for a file that is not an audit database."""
        readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
        text = " ".join(readme.split())
        assert "(not an audit database, locked) makes the commands above exit 1" not in text
        assert "not an audit database (a directory, a file that is not a DuckDB" in text


class TestCSVHeader:
    """#10: `runs` and `stats` print the CSV header row when no row matches."""

    def test_empty_csv_has_its_header(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """No killed run, no run in the last day: the header alone, the same as with rows."""
        db = db_of(cli_env)
        info = RunInfo(name="r")
        record(db, info)
        old = int((datetime.now(UTC) - timedelta(days=40)).timestamp() * 1e6)
        with closing(sqlite3.connect(journal_path(db))) as con, con:  # before the first sync
            con.execute("UPDATE runs SET started_at = ? WHERE run_id = ?", (old, info.run_id))
        full = run(kernel_exe, cli_env, "runs", "--format", "csv").stdout.splitlines()[0]
        empty = run(kernel_exe, cli_env, "runs", "--status", "killed", "--format", "csv")
        assert empty.returncode == 0 and empty.stdout.splitlines() == [full]
        headers = {by: run(kernel_exe, cli_env, "stats", "--by", by, "--format",
                           "csv").stdout.splitlines()[0] for by in ("subject", "status")}
        for by, header in headers.items():
            got = run(kernel_exe, cli_env, "stats", "--by", by, "--since", "1d", "--format",
                      "csv")
            assert got.returncode == 0 and got.stdout.splitlines() == [header], got

    def test_tool_stats_header_matches_the_rows(self, kernel_exe: str,
                                                cli_env: dict[str, str]) -> None:
        """The header of an empty `stats --by tool` is the one printed above tool rows."""
        db = db_of(cli_env)
        empty = run(kernel_exe, cli_env, "stats", "--by", "tool", "--format", "csv")
        assert empty.stdout.strip() == "tool,calls,errors,mean_ms,p50_ms,p95_ms,max_ms"

        async def go() -> None:
            async with JournalAudit.open(db) as audit:
                rec = await audit.start_run(RunInfo(name="t"))
                rec.on_tool(ToolResult(ToolCall("grep"), output="x", duration_s=0.01), 0)
                await rec.close(RunStats(Status.OK, steps=1, tool_calls=1))

        trio.run(go)
        rows = run(kernel_exe, cli_env, "stats", "--by", "tool", "--format", "csv")
        assert rows.stdout.splitlines()[0] == empty.stdout.strip()


class TestSmallNumbers:
    """#11: tables show small floats with significant digits; `show` has tokens and cost."""

    def test_cost_is_not_rounded_to_zero(self, kernel_exe: str,
                                         cli_env: dict[str, str]) -> None:
        """A $0.00028 run shows 0.00028 in stats and query tables, and in show's header."""
        record(db_of(cli_env), RunInfo(name="cheap", run_id="cheap-run"),
               usage=Usage(input_tokens=120, output_tokens=40, cost_usd=0.00028))
        stats = run(kernel_exe, cli_env, "stats")
        assert "0.00028" in stats.stdout, stats.stdout
        query = run(kernel_exe, cli_env, "query", "select cost_usd, 1.5::DOUBLE big from runs")
        assert "0.00028" in query.stdout and "1.500" in query.stdout, query.stdout
        shown = run(kernel_exe, cli_env, "show", "cheap-run")
        usage = [ln for ln in shown.stdout.splitlines() if ln.startswith("usage")]
        assert usage == ["usage    tokens 120 in, 40 out  cost $0.00028"], shown.stdout


class TestQueryJSONColumns:
    """#14: `query --json` prints DuckDB JSON columns as JSON values; CSV keeps their text."""

    def test_payload_and_inputs_are_nested_json(self, kernel_exe: str,
                                                cli_env: dict[str, str]) -> None:
        """payload is an object (NaN/Infinity as null, strict JSON), nested JSON too."""
        db = db_of(cli_env)

        async def go() -> None:
            async with JournalAudit.open(db) as audit:
                rec = await audit.start_run(RunInfo(name="j", run_id="json-run",
                                                    inputs={"repo": "x", "n": 2}))
                rec.log_event("note", payload={"nan": float("nan"), "inf": float("inf"),
                                               "big": 2**62, "list": [1, "a"]})
                await rec.close(RunStats(Status.OK, steps=1))

        trio.run(go)
        sql = ("select r.inputs, e.payload, {'p': e.payload} s, [e.payload] l, "
               "e.payload::VARCHAR t from events e join runs r using (run_id) "
               "where e.kind = 'note'")
        got = run(kernel_exe, cli_env, "query", sql, "--json")
        assert got.returncode == 0, got.stderr
        assert "NaN" not in got.stdout and "Infinity" not in got.stdout
        row = json.loads(got.stdout)
        assert row["inputs"] == {"repo": "x", "n": 2}
        assert row["payload"] == {"nan": None, "inf": None, "big": 2**62, "list": [1, "a"]}
        assert row["s"] == {"p": row["payload"]} and row["l"] == [row["payload"]]
        assert isinstance(row["t"], str)  # a VARCHAR stays a string
        text = run(kernel_exe, cli_env, "query", sql, "--format", "csv").stdout
        cells = list(csv.reader(io.StringIO(text)))[1]
        assert json.loads(cells[0]) == {"repo": "x", "n": 2}  # CSV: the JSON text


class TestUnreachableCollector:
    """#8: an unreachable OTLP collector costs a run one warning line, an export one error."""

    @staticmethod
    def dead_url() -> str:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return f"http://127.0.0.1:{s.getsockname()[1]}"

    def test_run_warns_in_one_line(self, kernel_exe: str, cli_env: dict[str, str]) -> None:
        """`kernel run --otlp DEAD -- echo hi`: exit 0, one otlp warning, no SDK lines."""
        pytest.importorskip("opentelemetry.sdk.trace")
        got = run(kernel_exe, cli_env, "run", "--otlp", self.dead_url(), "--", "echo", "hi")
        assert got.returncode == 0 and got.stdout == "hi\n", got
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 2, got.stderr  # the warning, then the summary line
        assert lines[0].startswith("kernel: warning: otlp.export: ")
        assert "collector unreachable (connection refused)" in lines[0]
        assert lines[1].startswith("kernel: run ")

    def test_export_gives_up_at_the_first_refusal(self, kernel_exe: str,
                                                  cli_env: dict[str, str]) -> None:
        """Many stored runs to a dead collector: one request, one error line, exit 1."""
        pytest.importorskip("opentelemetry.sdk.trace")
        record(db_of(cli_env), *(RunInfo(name=f"r{i}") for i in range(8)))
        got = run(kernel_exe, cli_env, "export", "--otlp", self.dead_url())
        assert got.returncode == 1, got
        lines = got.stderr.strip().splitlines()
        assert len(lines) == 1, got.stderr
        assert lines[0].startswith("kernel export: error: 1 export request(s) to ")
        assert "collector unreachable" in lines[0]

    def test_sdk_lines_follow_the_log_level(self, kernel_exe: str,
                                            cli_env: dict[str, str]) -> None:
        """With KERNEL_LOG_LEVEL=debug the exporter's own message is one kernel.otel line."""
        pytest.importorskip("opentelemetry.sdk.trace")
        got = run(kernel_exe, cli_env, "run", "--otlp", self.dead_url(), "--", "true",
                  extra={"KERNEL_LOG_LEVEL": "debug"})
        sdk = [ln for ln in got.stderr.splitlines() if "Failed to export" in ln]
        assert len(sdk) == 1 and sdk[0].startswith("kernel.otel: DEBUG: "), got.stderr
        assert "Transient error" not in got.stderr

