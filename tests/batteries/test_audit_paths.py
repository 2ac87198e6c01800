"""Where the audit lives: a path that cannot be the analysts' DuckDB file is refused early.

Real files only: a garbage file, an empty one, a directory, a path ending in
a slash, a real DuckDB file, with and without a journal beside them.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
import trio

from batteries.audit import JournalAudit, resolve_db_path, sync
from batteries.store import journal_path
from kernel import ConfigError, RunInfo, RunStats, Status


async def _record(db: Path, name: str) -> None:
    async with JournalAudit.open(db) as audit:
        rec = await audit.start_run(RunInfo(name=name))
        await rec.close(RunStats(Status.OK, steps=1))


class TestResolveDbPath:
    def test_a_missing_path_and_a_duckdb_file_are_accepted(self, tmp_path: Path) -> None:
        """A path that does not exist yet, or a DuckDB database, is the analysts' file."""
        from batteries.audit.paths import not_duckdb

        assert resolve_db_path(tmp_path / "new.duckdb") == tmp_path / "new.duckdb"
        real = tmp_path / "real.duckdb"
        duckdb.connect(str(real)).close()
        assert not_duckdb(real) is None
        assert resolve_db_path(real) == real

    @pytest.mark.parametrize(("what", "fragment"), [
        ("garbage", "not a DuckDB database file"),
        ("empty", "empty (0 bytes)"),
        ("directory", "is a directory"),
        ("slash", "ends with a slash"),
    ])
    def test_what_cannot_be_the_file_is_refused(self, tmp_path: Path, what: str,
                                                fragment: str) -> None:
        """A garbage or empty file (no journal beside it), a directory, a trailing slash:
        ConfigError naming the path and the problem."""
        target = tmp_path / "target.duckdb"
        raw = str(target)
        if what == "garbage":
            target.write_bytes(b"not duckdb" * 20)
        elif what == "empty":
            target.touch()
        elif what == "directory":
            target.mkdir()
        else:
            raw += "/"
        with pytest.raises(ConfigError, match=r"target\.duckdb") as caught:
            resolve_db_path(raw)
        assert fragment in str(caught.value)

    def test_the_environment_variable_is_named(self, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
        """A bad $KERNEL_DB is refused saying it came from $KERNEL_DB."""
        monkeypatch.setenv("KERNEL_DB", str(tmp_path) + "/")
        with pytest.raises(ConfigError, match=r"\$KERNEL_DB"):
            resolve_db_path()


class TestLibraryUsers:
    def test_journal_audit_open_refuses_before_recording(self, tmp_path: Path) -> None:
        """`JournalAudit.open` on a garbage file with no journal: ConfigError at open, and no
        journal (nor anything else) is created beside it."""
        db = tmp_path / "k.duckdb"
        db.write_bytes(b"garbage" * 50)

        async def main() -> None:
            async with JournalAudit.open(db):
                pytest.fail("opened an audit on a file that is not a DuckDB database")

        with pytest.raises(ConfigError, match="not a DuckDB database file"):
            trio.run(main)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["k.duckdb"]

    def test_sync_says_how_the_file_is_rebuilt(self, tmp_path: Path) -> None:
        """With a journal beside it, a garbage analysts' file does not stop runs (they go
        on recording into the journal); `sync` refuses it, naming the journal it is rebuilt
        from; moved away, the next sync rebuilds it with every run."""
        db = tmp_path / "k.duckdb"
        trio.run(_record, db, "one")
        sync(db)
        db.write_bytes(b"garbage" * 50)
        assert resolve_db_path(db) == db
        trio.run(_record, db, "two")
        with pytest.raises(ConfigError, match="rebuilt from the journal") as caught:
            sync(db)
        assert str(journal_path(db)) in str(caught.value)
        db.rename(tmp_path / "moved")
        assert sync(db).runs == 2
        with duckdb.connect(str(db), read_only=True) as con:
            assert con.execute("SELECT name FROM runs ORDER BY started_at").fetchall() == [
                ("one",), ("two",)]


class TestDamagedJournal:
    def test_a_journal_that_is_not_sqlite_is_refused_before_any_run(self, tmp_path: Path) -> None:
        """Garbage where the journal should be: one error naming it, not a run refused
        `budget_exceeded` by a budget check that cannot read it."""
        db = tmp_path / "k.duckdb"
        journal_path(db).write_bytes(b"\x00garbage, not a journal" * 4)
        with pytest.raises(ConfigError, match="is not a SQLite file"):
            resolve_db_path(db)

    def test_an_empty_or_real_journal_is_accepted(self, tmp_path: Path) -> None:
        """An empty file (SQLite has not written it yet) and a real journal pass."""
        db = tmp_path / "k.duckdb"
        journal_path(db).write_bytes(b"")
        assert resolve_db_path(db) == db
        journal_path(db).unlink()
        trio.run(_record, db, "real")
        assert resolve_db_path(db) == db


async def test_a_journal_this_process_has_open_is_not_read_again(tmp_path: Path) -> None:
    """Reading a header opens and closes a descriptor, which drops every POSIX lock this
    process holds on the file (SQLite's, DuckDB's): never while the file is open here. A
    batch resuming corrupted its journal so ("database disk image is malformed")."""
    from batteries.audit.paths import _may_read

    db = tmp_path / "k.duckdb"
    assert _may_read(journal_path(db), db)
    async with JournalAudit.open(db) as audit:
        rec = await audit.start_run(RunInfo(name="open"))
        await rec.close(RunStats(Status.OK, steps=1))
        assert not _may_read(journal_path(db), db)
        assert resolve_db_path(db) == db  # (and resolving still works)
    assert _may_read(journal_path(db), db)
