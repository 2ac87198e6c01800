"""Review fixes for `kernel batch`'s live line (`kernel_cli.batch_progress`).

A task's id and name come from the tasks file and were drawn as they were:
rich keeps ESC, so an escape sequence in them reached the terminal as a
command (a window title, a cleared screen), and a newline broke the
one-line display into debris on every redraw.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from kernel_cli.batch_progress import BatchProgress

PATIENCE = 120.0
TITLE = "\x1b]0;pwned\x07"  # OSC 0: sets the terminal's window title


@dataclass
class Task:
    task_id: str
    spec: Any


@dataclass
class Runner:
    """What `BatchProgress` reads of a `BatchRunner`: its outcomes and its running tasks."""

    outcomes: list[Any] = field(default_factory=list)
    running: dict[str, tuple[Task, float]] = field(default_factory=dict)


class TestRender:
    async def test_controls_in_ids_and_names_are_shown_escaped(
            self, autojump_clock: trio.testing.MockClock) -> None:
        runner = Runner()
        progress = BatchProgress(runner, total=3)
        runner.running["r1"] = (Task(f"t{TITLE}\x1b[2J", {"info": {
            "name": "deploy\nrm -rf\r\u202eevil\u2028next"}}), trio.current_time())
        await trio.sleep(2)
        line = progress.render()
        assert not any(ord(ch) < 0x20 or 0x7f <= ord(ch) <= 0x9f for ch in line), repr(line)
        assert "\u202e" not in line and "\u2028" not in line
        assert "oldest t\\x1b]0;pwned\\x07" in line and "2s" in line

    async def test_an_odd_spec_is_not_a_crash(self,
                                              autojump_clock: trio.testing.MockClock) -> None:
        """A spec whose `info` is not a mapping shows the task id."""
        runner = Runner()
        progress = BatchProgress(runner, total=1)
        runner.running["r1"] = (Task("job-1", {"info": "not a mapping"}), trio.current_time())
        assert progress.render().endswith("oldest job-1 0s job-1")

    async def test_long_names_are_cut(self, autojump_clock: trio.testing.MockClock) -> None:
        runner = Runner()
        progress = BatchProgress(runner, total=1)
        runner.running["r1"] = (Task("x" * 500, {"info": {"name": "中" * 500}}),
                                trio.current_time())
        line = progress.render()
        assert len(line) < 150 and line.count("…") == 2


def test_a_terminal_never_gets_a_tasks_escape_sequence(kernel_exe: str,
                                                       cli_env: dict[str, str],
                                                       tmp_path: Path) -> None:
    """A real `kernel batch` on a pty: the task name's OSC sequence is drawn as text (ids
    are refused unless printable; names are not checked)."""
    gate = tmp_path / "go"
    tasks = tmp_path / "t.jsonl"
    tasks.write_text(json.dumps({"id": "w", "name": f"n{TITLE}\nx", "command": [
        "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.05; done"]}) + "\n")
    master, slave = pty.openpty()
    proc = subprocess.Popen([kernel_exe, "batch", str(tasks), "--json"], env=cli_env,
                            stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    seen = b""
    deadline = time.monotonic() + PATIENCE
    try:
        while b"oldest w" not in seen:  # a readiness wait: the line is drawn
            assert proc.poll() is None, (proc.returncode, seen)
            assert time.monotonic() < deadline, seen
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                seen += os.read(master, 65536)
        gate.touch()
        while proc.poll() is None:  # keep draining: a full terminal would block it
            assert time.monotonic() < deadline
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    seen += os.read(master, 65536)
                except OSError:
                    break
        out, _ = proc.communicate(timeout=PATIENCE)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    assert proc.returncode == 0, seen
    assert b"\x1b]0;" not in seen, seen
    assert b"n\\x1b]0;pwned\\x07\\x0ax" in seen, seen
    assert [json.loads(x)["status"] for x in out.splitlines()] == ["ok"]
