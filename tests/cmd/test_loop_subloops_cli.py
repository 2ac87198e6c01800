"""Sub-loops on the command line, with a real journal and a real budget: each test here
failed before its fix (see tests/adapters/test_loop_subloops.py).

A caller with room for one run starts a loop whose `loop:` state starts a second: the
child is refused, and the parent ends `budget_exceeded` (exit 3) naming the budget, not
`error` (exit 1); a state that routes `budget_exceeded` goes on. A `loop:` name that
cannot name a file is a one-line error (exit 2), not a traceback.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.realtime




def kernel(exe: str, env: dict[str, str], *args: str, cwd: Path | None = None,
           ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exe, *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=120, stdin=subprocess.DEVNULL)


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text).lstrip())
    return path


CHILD = """
    name: child
    initial: a
    states:
      a: {action: "echo child-ran", next: done}
      done: {terminal: true}
"""


def runs(exe: str, env: dict[str, str]) -> dict[str, dict[str, object]]:
    """Every run recorded, by name (`kernel runs --json`: one JSON document a line)."""
    proc = kernel(exe, env, "runs", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    return {str(r["name"]): r for r in rows}


class TestACallerWithRoomForOneRun:
    def test_the_parent_ends_budget_exceeded_exit_3(self, kernel_exe: str,
                                                    cli_env: dict[str, str],
                                                    tmp_path: Path) -> None:
        write(tmp_path / "child.yaml", CHILD)
        write(tmp_path / "parent.yaml", """
            name: parent
            initial: sub
            states:
              sub: {loop: child.yaml, on_yes: done, on_no: failed, on_error: failed}
              done: {terminal: true}
              failed: {terminal: true}
        """)
        setup = kernel(kernel_exe, cli_env, "budget", "set", "ci", "--runs", "1")
        assert setup.returncode == 0, setup.stderr
        proc = kernel(kernel_exe, cli_env, "run", "--caller", "ci", "parent.yaml",
                      cwd=tmp_path)
        assert proc.returncode == 3, (proc.returncode, proc.stderr)
        assert "child-ran" not in proc.stdout
        assert "the budget refused sub-loop 'child'" in proc.stderr
        assert "caller 'ci' used 1 of 1 runs" in proc.stderr
        assert "Traceback" not in proc.stderr
        rows = runs(kernel_exe, cli_env)
        assert rows["parent"]["status"] == "budget_exceeded"
        assert rows["child"]["status"] == "budget_exceeded"
        shown = kernel(kernel_exe, cli_env, "show", str(rows["parent"]["run_id"]), "--json")
        doc = json.loads(shown.stdout)["run"]
        assert (doc["status"], doc["reason"]) == ("budget_exceeded", "budget refused")
        assert "caller 'ci' used 1 of 1 runs" in doc["error"]

    def test_a_state_that_routes_the_refusal_goes_on(self, kernel_exe: str,
                                                      cli_env: dict[str, str],
                                                      tmp_path: Path) -> None:
        write(tmp_path / "child.yaml", CHILD)
        write(tmp_path / "parent.yaml", """
            name: parent
            initial: sub
            states:
              sub: {loop: child.yaml, on_yes: done, on_no: failed, on_budget_exceeded: alone}
              alone: {action: 'echo "without the child: ${captured.sub.terminated_by}"',
                      next: done}
              done: {terminal: true}
              failed: {terminal: true}
        """)
        assert kernel(kernel_exe, cli_env, "validate", "parent.yaml",
                      cwd=tmp_path).returncode == 0
        kernel(kernel_exe, cli_env, "budget", "set", "ci", "--runs", "1")
        proc = kernel(kernel_exe, cli_env, "run", "--caller", "ci", "parent.yaml",
                      cwd=tmp_path)
        assert (proc.returncode, proc.stdout) == (0, "without the child: budget_exceeded\n"), \
            proc.stderr
        assert runs(kernel_exe, cli_env)["child"]["status"] == "budget_exceeded"


class TestASubLoopNameThatCannotBeAFile:
    @pytest.mark.parametrize("name", ['"/"', '"~nosuchuser-kernel/x"'])
    def test_is_a_one_line_error(self, kernel_exe: str, cli_env: dict[str, str],
                                 tmp_path: Path, name: str) -> None:
        write(tmp_path / "parent.yaml", f"""
            initial: sub
            states:
              sub: {{loop: {name}, on_yes: done, on_no: done}}
              done: {{terminal: true}}
        """)
        for args in (("validate", "parent.yaml"), ("run", "--no-audit", "parent.yaml")):
            proc = kernel(kernel_exe, cli_env, *args, cwd=tmp_path)
            assert proc.returncode == 2, (args, proc.stderr)
            assert "Traceback" not in proc.stderr
            assert "sub-loop file" in proc.stderr + proc.stdout
            assert "not found" in proc.stderr + proc.stdout
