"""A bad setting in the environment is bad input: one line, exit 2, nothing run unaudited.

Real `kernel` processes. The settings are read deep inside a command (the journal's
lock timeout and durability, the audit's caps), some of them inside a trio nursery,
whose exception groups once turned the one-line error into a traceback (exit 1), and
a bad audit cap once ran the command with no audit at all (exit 0).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.realtime

SETTINGS = [
    ("KERNEL_AUDIT_LOCK_TIMEOUT", "abc", "must be a number of seconds"),
    ("KERNEL_JOURNAL_SYNC", "bogus", "must be normal or full"),
    ("KERNEL_AUDIT_MAX_OUTPUT_BYTES", "abc", "must be a whole number of bytes"),
]


@pytest.mark.parametrize(("name", "value", "says"), SETTINGS, ids=[s[0] for s in SETTINGS])
@pytest.mark.parametrize("command", ["run", "batch", "budget"])
def test_a_bad_setting_is_one_line_and_exit_2(kernel_exe: str, cli_env: dict[str, str],
                                              tmp_path: Path, name: str, value: str,
                                              says: str, command: str) -> None:
    marker = tmp_path / "ran"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(f'{{"command": ["touch", "{marker}"]}}\n')
    args = {"run": ["run", "--", "touch", str(marker)], "batch": ["batch", str(tasks)],
            "budget": ["budget", "show"]}[command]
    proc = subprocess.run([kernel_exe, *args], capture_output=True, text=True, timeout=60,
                          env={**cli_env, name: value})
    if command == "budget" and name == "KERNEL_AUDIT_MAX_OUTPUT_BYTES":
        assert proc.returncode == 0, proc.stderr  # reading budgets opens no audit
        return
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"kernel {command}: error: {name} ") and says in line
    assert not marker.exists()  # nothing ran
