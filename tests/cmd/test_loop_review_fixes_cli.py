"""Loop defects a review reproduced on the command line: each test failed before its fix.

`kernel run -- X.yaml` is a command and `kernel run X.YAML` a loop; `--context`
keys no template reads are named on stderr; a sub-loop's child run orphaned by
a SIGKILL of its parent is closed `lost` when the parent is recovered.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.realtime


def kernel(exe: str, env: dict[str, str], *args: str, cwd: Path | None = None,
           timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    return path


LOOP = """
    initial: a
    states:
      a: {action: "echo loop-ran", next: done}
      done: {terminal: true}
"""


class TestLoopOrCommand:
    def test_after_dashes_a_yaml_name_is_a_command(self, kernel_exe: str,
                                                   cli_env: dict[str, str],
                                                   tmp_path: Path) -> None:
        """`kernel run -- ./job.yaml` runs the executable file, not a loop."""
        script = tmp_path / "job.yaml"
        script.write_text("#!/bin/sh\necho command-ran\n")
        script.chmod(0o755)
        proc = kernel(kernel_exe, cli_env, "run", "--no-audit", "--", "./job.yaml",
                      cwd=tmp_path)
        assert (proc.returncode, proc.stdout) == (0, "command-ran\n"), proc.stderr

    def test_after_dashes_a_loop_file_is_not_run_as_a_loop(self, kernel_exe: str,
                                                           cli_env: dict[str, str],
                                                           tmp_path: Path) -> None:
        """`kernel run -- loop.yaml` (not executable, not on PATH) fails to start, as
        any such command would: the loop never runs."""
        write(tmp_path / "loop.yaml", LOOP)
        proc = kernel(kernel_exe, cli_env, "run", "--no-audit", "--", "loop.yaml",
                      cwd=tmp_path)
        assert proc.returncode == 127, proc.stderr
        assert "loop-ran" not in proc.stdout
        assert "cannot start 'loop.yaml'" in proc.stderr

    @pytest.mark.parametrize("name", ["LOOP.YAML", "Loop.Yml"])
    def test_the_loop_extension_in_any_case(self, kernel_exe: str, cli_env: dict[str, str],
                                            tmp_path: Path, name: str) -> None:
        write(tmp_path / name, LOOP)
        proc = kernel(kernel_exe, cli_env, "run", "--no-audit", name, cwd=tmp_path)
        assert (proc.returncode, proc.stdout) == (0, "loop-ran\n"), proc.stderr


class TestContextKeys:
    LOOP = """
        initial: a
        context: {mode: fast}
        states:
          a: {action: 'echo "${context.target} ${context.mode} ${context.cfg.depth:default=3}"',
              next: done}
          done: {terminal: true}
    """

    def test_run_names_a_key_no_template_reads(self, kernel_exe: str,
                                               cli_env: dict[str, str],
                                               tmp_path: Path) -> None:
        """One stderr line naming the key and the close match; the run goes on."""
        loop = write(tmp_path / "req.yaml", self.LOOP)
        proc = kernel(kernel_exe, cli_env, "run", "--no-audit", str(loop), "-c", "target=x",
                      "-c", "mdoe=slow")
        assert (proc.returncode, proc.stdout) == (0, "x fast 3\n"), proc.stderr
        lines = [line for line in proc.stderr.splitlines() if "mdoe" in line]
        assert lines == [f"warning: {loop}: --context mdoe: the loop never reads "
                         "${context.mdoe} (did you mean 'mode'?)"], proc.stderr

    def test_validate_names_it_too(self, kernel_exe: str, cli_env: dict[str, str],
                                   tmp_path: Path) -> None:
        loop = write(tmp_path / "req.yaml", self.LOOP)
        proc = kernel(kernel_exe, cli_env, "validate", str(loop), "-c", "target=x",
                      "-c", "mdoe=slow")
        assert proc.returncode == 0, proc.stdout
        assert "--context mdoe: the loop never reads ${context.mdoe} (did you mean " \
               "'mode'?)" in proc.stdout

    def test_a_dotted_key_reaches_its_field(self, kernel_exe: str, cli_env: dict[str, str],
                                            tmp_path: Path) -> None:
        loop = write(tmp_path / "req.yaml", self.LOOP)
        proc = kernel(kernel_exe, cli_env, "run", "--no-audit", str(loop), "-c", "target=x",
                      "-c", "cfg.depth=9")
        assert (proc.returncode, proc.stdout) == (0, "x fast 9\n"), proc.stderr
        assert "warning" not in proc.stderr

    def test_a_dotted_key_into_a_value_is_bad_input(self, kernel_exe: str,
                                                    cli_env: dict[str, str],
                                                    tmp_path: Path) -> None:
        """One line, exit 2, no traceback."""
        loop = write(tmp_path / "req.yaml", self.LOOP)
        proc = kernel(kernel_exe, cli_env, "run", "--no-audit", str(loop), "-c", "target=x",
                      "-c", "mode.x=1")
        assert proc.returncode == 2
        assert proc.stderr.splitlines() == [
            f"kernel run: error: {loop}: --context mode.x: context 'mode' is a single value, "
            "not a mapping with fields"]


CHILD = """
    name: child
    max_iterations: 100000
    initial: wait
    states:
      wait: {action: "sleep 0.05; test -e ${context.release}", on_yes: done, on_no: wait}
      done: {terminal: true}
"""
PARENT = """
    name: parent
    initial: p
    states:
      p: {loop: child, context_passthrough: true, on_yes: done, on_no: failed}
      done: {terminal: true}
      failed: {terminal: true}
"""


class TestOrphanedChild:
    def test_recover_closes_the_child_run_its_parent_left(self, kernel_exe: str,
                                                          cli_env: dict[str, str],
                                                          tmp_path: Path) -> None:
        """SIGKILL `kernel run parent.yaml` while its sub-loop runs, then `kernel recover`:
        the parent resumes with a new child, and the first child's row is closed `lost`
        (it stayed `running`, with no status, for ever)."""
        from batteries.store import journal_path

        write(tmp_path / "child.yaml", CHILD)
        parent = write(tmp_path / "parent.yaml", PARENT)
        release = tmp_path / "release"  # the child waits for it
        proc = subprocess.Popen([kernel_exe, "run", "--no-critic", str(parent), "-c",
                                 f"release={release}"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env=cli_env, cwd=tmp_path)
        journal = journal_path(cli_env["KERNEL_DB"])
        first_child = None
        deadline = time.monotonic() + 120  # a readiness wait: the bound is only for a hang
        while first_child is None:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the child run never showed in the journal"
            first_child = _open_child(journal)
            if first_child is None:
                time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert _status(journal, first_child) is None  # left `running` by the crash

        release.touch()
        rec = kernel(kernel_exe, cli_env, "recover", cwd=tmp_path, timeout=120)
        assert rec.returncode == 0, rec.stderr  # the parent resumed, with a new child
        status, error = _status(journal, first_child) or (None, None)
        assert status == "lost", (status, error)
        assert "was interrupted" in (error or "")
        children = _children(journal)
        assert sorted(children.values(), key=str) == ["lost", "ok"], children
        again = kernel(kernel_exe, cli_env, "recover", "--list")
        assert "no interrupted runs" in (again.stdout + again.stderr)


def _open_child(journal: Path) -> str | None:
    """A child run whose row and whose parent's `child_start` event are in the journal."""
    if not journal.exists():
        return None
    try:
        con = sqlite3.connect(f"file:{journal}?mode=ro", uri=True, timeout=5)
        try:
            rows = con.execute("SELECT payload FROM events WHERE kind = 'child_start'")
            started = {json.loads(r[0])["child_run_id"] for r in rows}
            found = con.execute("SELECT run_id FROM runs WHERE parent_run_id IS NOT NULL "
                                "AND status IS NULL").fetchall()
        finally:
            con.close()
    except sqlite3.OperationalError:  # not created yet
        return None
    return next((r[0] for r in found if r[0] in started), None)


def _status(journal: Path, run_id: str) -> tuple[str | None, str | None] | None:
    con = sqlite3.connect(journal, timeout=5)
    try:
        row = con.execute("SELECT status, error FROM runs WHERE run_id = ?",
                          (run_id,)).fetchone()
    finally:
        con.close()
    return None if row is None or row[0] is None else (row[0], row[1])


def _children(journal: Path) -> dict[str, str | None]:
    con = sqlite3.connect(journal, timeout=5)
    try:
        rows = con.execute("SELECT run_id, status FROM runs WHERE parent_run_id IS NOT NULL")
        return {r[0]: r[1] for r in rows}
    finally:
        con.close()


def test_max_iterations_holds_however_well_the_loop_progresses(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """The critic extends a progressing run (`--soft-timeout 1`) and used to raise its step
    ceiling with it: a loop of `max_iterations: 5` ran until the hard timeout. The file's
    bound is the loop's own (`SupportsFixedCeiling`): 5 states, then `max_steps`, exit 4."""
    loop = write(tmp_path / "mi.yaml", """
        name: mi
        initial: a
        max_iterations: 5
        states:
          a:
            action: echo "iter ${state.iteration}"; sleep 0.5
            next: a
    """)
    proc = kernel(kernel_exe, cli_env, "run", "--json", "--soft-timeout", "1", "--timeout",
                  "120", str(loop), timeout=180)
    doc = json.loads(proc.stdout)
    assert (proc.returncode, doc["status"], doc["steps"]) == (4, "max_steps", 5), proc.stderr
