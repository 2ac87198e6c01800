"""Shared fixtures: an isolated audit database, the installed `kernel` executable, and a
real PostgreSQL server (`pg_server`, `pg_url`)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pg_server import PgServer


@pytest.fixture(autouse=True)
def _isolated_db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every test gets its own $KERNEL_DB and no $KERNEL_STORE, so nothing touches the
    user's database or server."""
    db = tmp_path / "kernel.duckdb"
    monkeypatch.setenv("KERNEL_DB", str(db))
    monkeypatch.delenv("KERNEL_STORE", raising=False)
    yield db
    chosen = sys.modules.get("batteries.store._select")
    if chosen is not None:  # an in-process `--store URL` chose a store: forget it
        chosen.choose(None)


@pytest.fixture(scope="session")
def kernel_exe() -> str:
    """The `kernel` console script installed next to this Python."""
    candidate = Path(sys.executable).parent / "kernel"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("kernel")
    if found is None:  # pragma: no cover - the package is installed for the tests
        pytest.fail("the `kernel` console script is not installed (pip install -e '.[test]')")
    return found


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    """Environment for CLI subprocesses: isolated database, no colour, no TTY tricks."""
    env = dict(os.environ)
    env["KERNEL_DB"] = str(tmp_path / "kernel.duckdb")
    env["NO_COLOR"] = "1"
    return env


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """A real PostgreSQL server for the whole session (tests/pg_server.py), stopped at the end.

    Skipped where PostgreSQL is not installed; under CI=true that fails instead.
    """
    from pg_server import server_or_skip

    yield from server_or_skip()


@pytest.fixture
def pg_url(pg_server: PgServer) -> str:
    """The URL of a new, empty database on the session's PostgreSQL server."""
    return pg_server.create_database()
