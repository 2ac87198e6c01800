"""The project's static checks, run as tests so the one test command covers them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:  # pragma: no cover - installed with the test extra
        pytest.fail(f"{name} is not installed (pip install -e '.[test]')")
    return found


def check(*cmd: str) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"


class TestQuality:
    def test_ruff(self) -> None:
        """The whole tree is ruff clean."""
        check(tool("ruff"), "check", "--quiet", ".")

    def test_mypy_strict_kernel(self) -> None:
        """kernel/ type-checks under mypy --strict (the bar DESIGN.md sets)."""
        check(tool("mypy"), "--strict", "kernel")

    def test_mypy_strict_everything(self) -> None:
        """The batteries, adapters and the CLI type-check under mypy --strict too."""
        check(tool("mypy"), "--strict", "kernel", "batteries", "adapters", "cmd/kernel_cli")

    def test_layering(self) -> None:
        """kernel/ imports nothing from adapters/, batteries/ or the CLI (import-linter)."""
        check(tool("lint-imports"), "--no-cache")
