"""`kernel query` cannot write anything, however the statement is wrapped (issue 13, item 1).

Every statement below is given to the real CLI app against a real audit
database. Each must be refused with exit 2 and one line on stderr, no file
may appear in the test's directory, and the audit file's bytes (and its
neighbours') must be unchanged afterwards.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest
import trio
from typer.testing import CliRunner

from batteries.audit import DuckDBAudit, Store, sync
from kernel import RunInfo, RunStats, Status
from kernel_cli.app import app

runner = CliRunner()


def _bases(db: Path, out: Path) -> list[str]:
    """One statement per way DuckDB can write a file or change a database."""
    d, o = str(db), str(out)
    return [
        # files written by COPY / EXPORT, in every format, the audit file itself included
        f"COPY runs TO '{o}/runs.csv'",
        f"COPY (SELECT 'gone' AS x) TO '{d}' (FORMAT csv)",
        f"COPY (SELECT 'gone' AS x) TO '{d}' (FORMAT csv, USE_TMP_FILE false)",
        f"COPY (SELECT 'gone' AS x) TO '{d}.wal' (FORMAT csv)",
        f"COPY (SELECT 1 AS x) TO '{o}/x.parquet' (FORMAT parquet)",
        f"COPY (SELECT 1 AS x) TO '{o}/x.json' (FORMAT json)",
        f"COPY (SELECT 1 AS x) TO '{o}/part' (FORMAT parquet, PARTITION_BY (x))",
        f"COPY (SELECT '#!/bin/sh' AS x) TO '{o}/evil.sh' (HEADER false)",
        "COPY (SELECT 1 AS x) TO '.tmp/x.csv'",
        f"COPY runs FROM '{o}/in.csv'",
        f"EXPORT DATABASE '{o}/exported'",
        f"IMPORT DATABASE '{o}/exported'",
        # other databases, extensions, configuration
        f"ATTACH '{o}/new.duckdb' AS n",
        f"ATTACH '{d}' AS rw",
        f"ATTACH '{o}/x.sqlite' AS s (TYPE sqlite)",
        "DETACH memory",
        "USE memory",
        "INSTALL httpfs",
        "LOAD httpfs",
        f"LOAD '{o}/evil.duckdb_extension'",
        "SET enable_external_access = true",
        "SET lock_configuration = false",
        "SET disabled_filesystems = ''",
        f"SET temp_directory = '{o}/tmp'",
        f"PRAGMA profiling_output = '{o}/profile.json'",
        "PRAGMA enable_profiling = 'json'",
        f"CALL enable_logging(storage = 'file', storage_path = '{o}/logs')",
        "CREATE PERSISTENT SECRET s (TYPE s3, KEY_ID 'k', SECRET 'v')",
        # the audit's own tables
        "CREATE TABLE stolen AS SELECT * FROM runs",
        "INSERT INTO runs (run_id) VALUES ('x')",
        "INSERT OR REPLACE INTO schema_version SELECT * FROM schema_version",
        "UPDATE runs SET status = 'ok'",
        "DELETE FROM events",
        "TRUNCATE events",
        "DROP TABLE events",
        "DROP VIEW critic_decisions",
        "ALTER TABLE runs ADD COLUMN x INTEGER",
        "CREATE VIEW v AS SELECT 1",
        "CREATE INDEX i ON runs (status)",
        "CREATE SEQUENCE q",
        "CREATE MACRO m() AS 1",
        "CREATE TYPE mood AS ENUM ('a')",
        "COMMENT ON TABLE runs IS 'x'",
        "MERGE INTO runs USING (SELECT 1 AS x) AS s ON true WHEN MATCHED THEN DELETE",
        "CHECKPOINT",
        "FORCE CHECKPOINT",
        "VACUUM",
        "ANALYZE",
        "BEGIN TRANSACTION",
    ]


def _corpus(db: Path, out: Path) -> list[str]:
    """Each base statement alone and wrapped every way a query can hide one."""
    found = []
    for base in _bases(db, out):
        found += [
            base,
            f"EXPLAIN {base}",
            f"EXPLAIN ANALYZE {base}",
            f"explain analyse {base}",
            f"EXPLAIN (FORMAT json) {base}",
            f"PREPARE p AS {base}",
            f"PREPARE p AS {base}; EXECUTE p",
            f"SELECT 1; {base}",
            f"{base}; SELECT 1",
            f"WITH c AS (SELECT 1) SELECT * FROM c; {base}",
        ]
    d, o = str(db), str(out)
    found += [
        # CTEs and subqueries inside the writing statement
        f"COPY (WITH c AS (SELECT * FROM runs) SELECT * FROM c) TO '{o}/cte.csv'",
        f"EXPLAIN ANALYZE COPY (WITH c AS (SELECT 'gone' AS x) SELECT * FROM c) TO '{d}' "
        "(FORMAT csv, USE_TMP_FILE false)",
        f"EXPLAIN ANALYZE COPY (SELECT * FROM (SELECT 'gone' AS x)) TO '{o}/sub.csv'",
        "WITH c AS (SELECT run_id FROM runs) DELETE FROM events "
        "WHERE run_id IN (SELECT run_id FROM c)",
        "WITH c AS (SELECT 1) INSERT INTO runs (run_id) SELECT 'x' FROM c",
        "EXPLAIN ANALYZE WITH c AS (SELECT 1) INSERT INTO runs (run_id) SELECT 'x' FROM c",
        # comments and case inside the EXPLAIN prefix
        f"EXPLAIN /* x */ ANALYZE COPY (SELECT 1) TO '{o}/c.csv'",
        f"/* lead */ EXPLAIN ANALYZE COPY (SELECT 1) TO '{o}/c.csv'",
        f"eXpLaIn AnAlYzE\n\tCOPY (SELECT 1) TO '{o}/c.csv'",
        # table functions that write or change configuration, in a SELECT
        f"SELECT * FROM enable_logging(storage = 'file', storage_path = '{o}/logs')",
        f"EXPLAIN ANALYZE SELECT * FROM enable_logging(storage = 'file', "
        f"storage_path = '{o}/logs')",
        f"SELECT * FROM (SELECT 1) AS a, enable_logging(storage = 'file', "
        f"storage_path = '{o}/logs')",
        "SELECT * FROM force_checkpoint()",
        "EXECUTE p",
        "DEALLOCATE p",
        # reading other files is refused too (documented in README/ARCHITECTURE)
        "SELECT * FROM read_text('/etc/passwd')",
        "SELECT * FROM read_csv('/etc/passwd')",
        f"SELECT * FROM read_blob('{d}')",
        "SELECT * FROM glob('/etc/*')",
        "EXPLAIN ANALYZE SELECT * FROM read_text('/etc/hostname')",
        f"WITH c AS (SELECT * FROM read_text('{d}')) SELECT count(*) FROM c",
        "SELECT (SELECT content FROM read_text('/etc/passwd'))",
    ]
    return found


def _snapshot(directory: Path) -> dict[str, str]:
    """Every file under `directory` (the audit and its neighbours) with its sha256."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


async def _populate(db: Path) -> None:
    async with DuckDBAudit.open(db) as audit:
        rec = await audit.start_run(RunInfo(name="one", run_id="ab" * 16, subject_id="s"))
        rec.log_event("critic", name="kill", payload={"reason": "looping"})
        await rec.close(RunStats(Status.KILLED, reason="looping", steps=1,
                                 runtime_seconds=1.0))
    # The analysts' file as a reader leaves it: later syncs have nothing to copy.
    await trio.to_thread.run_sync(sync, db)


@pytest.fixture
def audit_db(_isolated_db: Path) -> Path:
    trio.run(_populate, _isolated_db)
    return _isolated_db


def test_the_corpus_is_large_and_varied(tmp_path: Path) -> None:
    """At least 40 write attempts, every base statement wrapped five ways."""
    corpus = _corpus(tmp_path / "kernel.duckdb", tmp_path / "out")
    assert len(set(corpus)) == len(corpus) >= 40 * 5


def test_every_write_attempt_is_refused_and_nothing_changes(
        audit_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 2 and one stderr line for every statement; no file appears; the audit's bytes stay."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "in.csv").write_text("run_id\nx\n")
    monkeypatch.chdir(tmp_path)  # so a relative path (.tmp/x.csv) lands where we look
    before = _snapshot(tmp_path)
    wrong = []
    for sql in _corpus(audit_db, out):
        result = runner.invoke(app, ["query", sql], catch_exceptions=False)
        lines = result.stderr.strip().splitlines()
        if (result.exit_code != 2 or result.stdout != "" or len(lines) != 1
                or not lines[0].startswith("kernel query: error: ")):
            wrong.append((sql, result.exit_code, result.stdout[:200], result.stderr[:300]))
    assert wrong == []
    assert _snapshot(tmp_path) == before
    # The audit still answers.
    with Store(audit_db).reader() as cur:
        assert cur.execute("SELECT count(*) FROM events").fetchall() == [(3,)]


def test_reading_the_audit_keeps_working(audit_db: Path) -> None:
    """SELECTs, views, JSON, EXPLAIN and EXPLAIN ANALYZE of a SELECT still answer."""
    for sql in ("SELECT name FROM runs", "SELECT decision, reason FROM critic_decisions",
                "SELECT payload->>'reason' FROM events WHERE kind = 'critic'",
                "EXPLAIN SELECT * FROM runs", "EXPLAIN ANALYZE SELECT count(*) FROM events",
                "WITH c AS (SELECT * FROM runs) SELECT count(*) FROM c",
                "FROM runs SELECT status", "DESCRIBE runs", "SUMMARIZE events"):
        result = runner.invoke(app, ["query", sql], catch_exceptions=False)
        assert result.exit_code == 0, (sql, result.stderr)
        assert result.stdout.strip(), sql


@pytest.mark.realtime
def test_the_issue_reproduction_through_the_installed_cli(
        audit_db: Path, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """The issue's command no longer overwrites the audit database; no script gets written."""
    env = {**cli_env, "KERNEL_DB": str(audit_db)}
    before = _snapshot(audit_db.parent)
    for sql in (f"EXPLAIN ANALYZE COPY (SELECT 'gone' AS x) TO '{audit_db}' (FORMAT csv)",
                f"EXPLAIN ANALYZE COPY (SELECT 'echo pwned' AS x) TO '{tmp_path}/run.sh' "
                "(HEADER false)",
                "SELECT * FROM read_text('/etc/shadow')"):
        proc = subprocess.run([kernel_exe, "query", sql], env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stdout == ""
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith("kernel query: error: ")
    assert _snapshot(audit_db.parent) == before
    assert not (tmp_path / "run.sh").exists()
