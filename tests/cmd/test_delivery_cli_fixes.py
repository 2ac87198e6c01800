"""`kernel run` / `kernel resume` delivery options after the delivery review.

Each test drives the installed `kernel` executable in a subprocess against a
real journal.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path

import pytest


def kernel(exe: str, env: dict[str, str], *args: str,
           cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("command", [["run"], ["resume", "abc"]], ids=["run", "resume"])
@pytest.mark.parametrize("url", ["http://u:s3cret@127.0.0.1:99999/x", "ftp://host/x",
                                 "http:///no-host", "http://exa mple.com/"])
def test_a_bad_webhook_is_refused_by_its_flag(kernel_exe: str, cli_env: dict[str, str],
                                              tmp_path: Path, command: list[str],
                                              url: str) -> None:
    """A webhook URL that can never be posted to is bad input naming `--webhook`, before
    anything runs (before: only the scheme was checked, then every delivery failed
    after the run); a password in it is not printed."""
    marker = tmp_path / "ran"
    tail = ["--", "touch", str(marker)] if command == ["run"] else []
    got = kernel(kernel_exe, cli_env, *command, "--webhook", url, *tail)
    assert got.returncode == 2, got.stderr
    assert got.stderr.count("\n") == 1 and "--webhook" in got.stderr, got.stderr
    assert "s3cret" not in got.stderr and not marker.exists()


def test_an_empty_deliver_dir_is_refused(kernel_exe: str, cli_env: dict[str, str]) -> None:
    """`--deliver-dir ''` was silently no delivery at all."""
    got = kernel(kernel_exe, cli_env, "run", "--deliver-dir", "", "--", "true")
    assert got.returncode == 2 and "--deliver-dir" in got.stderr, got.stderr


def test_the_deliver_dir_is_stored_absolute(kernel_exe: str, cli_env: dict[str, str],
                                            tmp_path: Path) -> None:
    """A relative `--deliver-dir` is kept as the directory it named when the run started:
    a run resumed from another directory delivers there, not under the new one."""
    work = tmp_path / "a"
    work.mkdir()
    got = kernel(kernel_exe, cli_env, "run", "--json", "--deliver-dir", "out", "--", "true",
                 cwd=work)
    assert got.returncode == 0, got.stderr
    run_id = json.loads(got.stdout)["run_id"]
    assert (work / "out" / run_id / "result.json").exists()
    journal = Path(cli_env["KERNEL_DB"] + ".journal")
    with closing(sqlite3.connect(journal)) as con:
        [(spec,)] = con.execute("SELECT spec FROM checkpoints WHERE run_id = ?",
                                (run_id,)).fetchall()
    assert json.loads(spec)["ports"]["deliver_dir"] == str(work / "out")
