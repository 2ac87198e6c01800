"""The pinned real agent CLIs are installed and run offline."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from clients import CLIENTS, PINS, client_env, require


@pytest.mark.realtime
@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_pinned_version_runs(name: str, tmp_path: Path) -> None:
    """Each client starts in the offline environment and reports the pinned version."""
    exe = require(name)
    env = client_env(name, "http://127.0.0.1:9", tmp_path / "home")
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, env=env,
                         timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert PINS[CLIENTS[name][1]] in out.stdout
