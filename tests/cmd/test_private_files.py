"""The audit is its owner's alone: directories 0700, files 0600, under umask 022 (issue 13.3)."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from batteries.audit import Store
from batteries.audit.paths import make_private_dir, open_private_file
from kernel_cli.app import app


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _kernel(kernel_exe: str, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the installed CLI under umask 022 with a fresh $HOME and the default database."""
    env = {k: v for k, v in os.environ.items() if k not in ("KERNEL_DB", "XDG_DATA_HOME")}
    env["HOME"] = str(home)
    return subprocess.run(["sh", "-c", 'umask 022 && exec "$@"', "sh", kernel_exe, *args],
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.realtime
def test_a_fresh_home_gets_a_private_database_and_export(kernel_exe: str,
                                                          tmp_path: Path) -> None:
    """`kernel run` then `kernel export` in a fresh $HOME under umask 022: 0700 dirs, 0600 files."""
    home = tmp_path / "home"
    home.mkdir()
    proc = _kernel(kernel_exe, home, "run", "--", "true")
    assert proc.returncode == 0, proc.stderr
    data = home / ".local" / "share" / "kernel"
    for d in (home / ".local", home / ".local" / "share", data):
        assert _mode(d) == 0o700, d
    # A run writes the journal only; the analysts' file is made by the first reader.
    assert sorted(p.name for p in data.iterdir()) == ["kernel.duckdb.journal"]
    assert _mode(data / "kernel.duckdb.journal") == 0o600

    out = tmp_path / "new" / "export"
    proc = _kernel(kernel_exe, home, "export", str(out))
    assert proc.returncode == 0, proc.stderr
    files = sorted(p.name for p in data.iterdir())
    assert files == ["kernel.duckdb", "kernel.duckdb.journal", "kernel.duckdb.lock"]
    for name in files:
        assert _mode(data / name) == 0o600, name
    assert _mode(out) == _mode(out.parent) == 0o700
    parquet = sorted(out.iterdir())
    assert parquet and all(p.suffix == ".parquet" for p in parquet)
    assert {_mode(p) for p in parquet} == {0o600}


def test_an_export_into_an_existing_directory_keeps_it_and_makes_private_files(
        tmp_path: Path, umask_022: None, _isolated_db: Path) -> None:
    """Files written into a shared 0755 directory are 0600, replace older ones, and no staging
    directory is left behind."""
    Store(_isolated_db).ensure_schema()
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    (shared / "runs.parquet").write_text("old")
    os.chmod(shared / "runs.parquet", 0o644)
    result = CliRunner().invoke(app, ["export", str(shared)], catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    assert _mode(shared) == 0o755
    names = sorted(p.name for p in shared.iterdir())
    assert all(n.endswith(".parquet") for n in names), names
    assert {_mode(shared / n) for n in names} == {0o600}
    assert (shared / "runs.parquet").read_bytes()[:4] == b"PAR1"


def test_the_store_creates_its_file_private_in_a_shared_directory(tmp_path: Path,
                                                                  umask_022: None) -> None:
    """A database put in an existing world-readable directory is still 0600, and its lock."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    db = shared / "deep" / "er" / "audit.duckdb"
    Store(db).ensure_schema()
    assert _mode(db) == 0o600
    assert _mode(db.with_name("audit.duckdb.lock")) == 0o600
    assert _mode(db.parent) == _mode(db.parent.parent) == 0o700
    assert _mode(shared) == 0o755
    assert sorted(p.name for p in db.parent.iterdir()) == ["audit.duckdb", "audit.duckdb.lock"]
    with Store(db).reader() as cur:  # and it is a working database
        assert cur.execute("SELECT count(*) FROM runs").fetchall() == [(0,)]


def test_the_helpers_ignore_the_umask_and_leave_existing_things_alone(
        tmp_path: Path, umask_022: None) -> None:
    """make_private_dir makes every missing level 0700; open_private_file creates 0600."""
    os.umask(0o000)
    existing = tmp_path / "existing"
    existing.mkdir(mode=0o755)
    os.chmod(existing, 0o755)
    made = make_private_dir(existing / "a" / "b")
    assert _mode(existing) == 0o755
    assert _mode(existing / "a") == _mode(made) == 0o700
    fd = open_private_file(made / "journal.sqlite", os.O_RDWR)
    os.close(fd)
    assert _mode(made / "journal.sqlite") == 0o600
    os.chmod(made / "journal.sqlite", 0o640)
    os.close(open_private_file(made / "journal.sqlite", os.O_RDWR))
    assert _mode(made / "journal.sqlite") == 0o640  # an existing file keeps its mode
    with pytest.raises(FileExistsError):
        make_private_dir(made / "journal.sqlite")
