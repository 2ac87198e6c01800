"""The Python examples in examples/ run as documented (real DuckDB file, real time)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.realtime
def test_library_host(tmp_path: Path) -> None:
    """library_host.py: a looping agent is nudged, then killed `looping`, all audited."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / "library_host.py"),
                           str(tmp_path / "k.duckdb")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "status=killed reason=looping" in proc.stdout
    assert "('steer', 'looping'), ('kill', 'looping')" in proc.stdout
