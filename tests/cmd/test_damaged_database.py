"""A database that opens but is damaged inside: one line and exit 2, never a traceback (13.10).

The damage is real: a block of a real audit file, found with DuckDB's own
`pragma_storage_info`, is overwritten, so the file still opens and the
catalog reads, but reading that table fails its checksum.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import duckdb
import pytest
import trio
from typer.testing import CliRunner

from batteries.audit import DuckDBAudit, sync
from batteries.checkpoint import DuckDBCheckpointer
from batteries.store import journal_path
from kernel import RunInfo, RunStats, Status
from kernel_cli.app import app

runner = CliRunner()
_HEADER = 3 * 4096  # DuckDB's file header, then blocks of block_size bytes


async def _populate(db: Path) -> None:
    async with DuckDBAudit.open(db) as audit:
        for r in range(4):
            rec = await audit.start_run(RunInfo(name=f"run {r}", run_id=f"{r:02d}" * 16))
            for i in range(3000):
                rec.log_event("output", payload={"line": f"{r}-{i} " + "x" * 200})
            await rec.close(RunStats(Status.OK, steps=1, runtime_seconds=1.5 + r * 3.25))
    cp = DuckDBCheckpointer(db)
    for r in range(40):
        spec = {"agent": {"kind": "loop", "path": "x.yaml"}, "info": {"name": f"cp {r}"},
                "limits": {}, "pad": "y" * 2000}
        await cp.register(f"{r:02d}" * 16, spec)
    cp.store.close()  # the journal's WAL is folded into its file
    sync(db)  # the analysts' file, which the readers below read


def _damage_journal(db: Path, table: str) -> None:
    """Overwrite the root page of `table` in the journal (SQLite) with garbage."""
    path = journal_path(db)
    with closing(sqlite3.connect(path)) as con:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every page in the file itself
        size = con.execute("PRAGMA page_size").fetchone()[0]
        root = con.execute("SELECT rootpage FROM sqlite_master WHERE name = ?",
                           (table,)).fetchone()[0]
    with open(path, "r+b") as f:
        f.seek((root - 1) * size)
        f.write(b"\xde\xad\xbe\xef" * (size // 4))


def _damage(db: Path, table: str, column: str) -> None:
    """Overwrite bytes inside the stored data of `table.column` (its last segment)."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        size = con.execute("SELECT block_size FROM pragma_database_size()").fetchall()[0][0]
        segments = con.execute(
            f"SELECT block_id, block_offset FROM pragma_storage_info('{table}') "
            "WHERE column_name = ? AND block_id >= 0 ORDER BY block_id, block_offset",
            [column]).fetchall()
    finally:
        con.close()
    assert segments, f"{table}.{column} has no data blocks"
    block, offset = segments[-1]
    with open(db, "r+b") as f:
        # Each block starts with its 8-byte checksum; the segment follows at its offset.
        f.seek(_HEADER + block * size + 8 + offset + 16)
        f.write(b"\xde\xad\xbe\xef" * 1024)


@pytest.fixture
def damaged(_isolated_db: Path) -> Path:
    trio.run(_populate, _isolated_db)
    return _isolated_db


def _one_line_exit_2(args: list[str]) -> str:
    result = runner.invoke(app, args, catch_exceptions=False)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, (args, result.exit_code, result.stderr[-2000:])
    assert len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith(f"kernel {args[0]}: error: "), lines[0]
    return lines[0]


def test_export_of_a_damaged_table_is_one_line_and_leaves_no_partial_export(
        damaged: Path, tmp_path: Path) -> None:
    """`kernel export` exits 2 with one line; no Parquet file or staging directory is left."""
    _damage(damaged, "events", "payload")
    out = tmp_path / "export"
    line = _one_line_exit_2(["export", str(out)])
    assert "damaged" in line and "Corrupt database file" in line
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("args", [["recover"], ["recover", "--list"], ["recover", "--json"],
                                  ["resume", "0101"]])
def test_recover_on_a_damaged_checkpoint_table_is_one_line(damaged: Path,
                                                           args: list[str]) -> None:
    """`kernel recover` / `resume` exit 2 with one line when the checkpoints (in the
    journal) cannot be read."""
    _damage_journal(damaged, "checkpoints")
    line = _one_line_exit_2(args)
    assert "damaged" in line


@pytest.mark.parametrize(("args", "table", "column"), [
    (["runs", "--limit", "100000"], "runs", "run_id"),
    (["stats"], "runs", "runtime_seconds"),
    (["show", "0303"], "runs", "name"),
])
def test_the_other_readers_say_the_same(damaged: Path, args: list[str], table: str,
                                        column: str) -> None:
    """runs, stats and show on a damaged table: the same one line and exit 2."""
    _damage(damaged, table, column)
    _one_line_exit_2(args)
