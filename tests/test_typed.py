"""Hosts type-check against the installed packages: every package ships `py.typed`."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernel", "batteries", "adapters", "kernel_cli")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built by the build backend pyproject.toml names."""
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = out.glob("*.whl")
    return built


def test_wheel_ships_py_typed_in_every_package(wheel: Path) -> None:
    """The wheel holds a `py.typed` marker at the top of each of the four packages."""
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in PACKAGES:
        assert f"{package}/py.typed" in names, package


@pytest.mark.realtime
def test_host_program_type_checks_outside_the_tree(wheel: Path, tmp_path: Path) -> None:
    """mypy --strict passes on a host outside the tree and reports its wrong calls and capabilities.

    A wrong argument type is reported, and so is an optional agent capability
    (`on_steer`, a `kernel.SupportsSteer`) implemented with the wrong signature.

    The hosts are examples/typed_host.py (it imports every package) and
    examples/host_recover.py (runs and recovers through the library), copied into
    a temporary directory. The packages come from the wheel installed into a
    fresh virtual environment, not from the source tree, so only what the
    wheel ships (code and `py.typed` markers) is seen; the third-party
    dependencies come from the test's own environment.
    """
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60).stdout.strip())
    zipfile.ZipFile(wheel).extractall(site)
    # Dependencies (trio, httpx, duckdb, ...) from this environment. A directory named
    # in a .pth file is not a site directory, so the editable install's own .pth file
    # in there (which points at the source tree) is not followed.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = subprocess.run(
        [str(python), "-c", "import kernel, batteries, adapters, kernel_cli as k;"
         "print(*(m.__file__ for m in (kernel, batteries, adapters, k)))"],
        cwd=tmp_path, check=True, capture_output=True, text=True, timeout=60).stdout.split()
    assert all(path.startswith(str(site)) for path in where), where

    host = tmp_path / "host"
    host.mkdir()
    good = (ROOT / "examples" / "typed_host.py").read_text()
    (host / "typed_host.py").write_text(good)
    (host / "host_recover.py").write_text((ROOT / "examples" / "host_recover.py").read_text())
    wrong = good.replace("CriticPolicy(idle_timeout=30.0)", 'CriticPolicy(idle_timeout="soon")')
    assert wrong != good
    (host / "wrong_host.py").write_text(wrong)
    # An optional agent capability implemented wrongly: a plain `def on_steer`.
    sync_steer = good.replace("    async def on_steer(self, messages: list[Message]) -> None:",
                              "    def on_steer(self, messages: list[Message]) -> None:")
    assert sync_steer != good
    (host / "wrong_capability.py").write_text(sync_steer)

    env = {k: v for k, v in os.environ.items() if k not in ("MYPYPATH", "PYTHONPATH")}
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--python-executable", str(python),
         "--cache-dir", str(tmp_path / "mypy-cache"), "--no-error-summary",
         "typed_host.py", "host_recover.py", "wrong_host.py", "wrong_capability.py"],
        cwd=host, env=env, capture_output=True, text=True, timeout=600)
    lines = proc.stdout.splitlines()
    assert not [line for line in lines if line.startswith(("typed_host.py", "host_recover.py"))
                ], proc.stdout
    assert any(line.startswith("wrong_host.py") and '"idle_timeout"' in line
               and '"CriticPolicy"' in line and "[arg-type]" in line
               for line in lines), proc.stdout + proc.stderr
    assert any(line.startswith("wrong_capability.py") and '"on_steer"' in line
               and '"kernel.ports.SupportsSteer"' in line and "[override]" in line
               for line in lines), proc.stdout + proc.stderr
    assert len(lines) == 2, proc.stdout  # nothing else: no "missing library stubs"
