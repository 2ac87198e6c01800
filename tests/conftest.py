"""Shared fixtures: an isolated audit database and the installed `kernel` executable."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _isolated_db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own $KERNEL_DB, so nothing touches the user's database."""
    db = tmp_path / "kernel.duckdb"
    monkeypatch.setenv("KERNEL_DB", str(db))
    return db


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
