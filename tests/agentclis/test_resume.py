"""A CLI agent run SIGKILLed mid-task is resumed by `kernel recover`, in the same client session.

The supervisor (`kernel run`) and the client are both SIGKILLed while the model is
mid-answer, as in a machine crash. The run's checkpoint is the client's session id,
saved when the client reported it; `kernel recover` starts the client's own resume
command, and the fake model server sees the same conversation carried on.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from clients import CLIENTS, client_env, require
from fake_models import FakeModelServer, ListDir, Reply, Say

pytestmark = pytest.mark.realtime

PROMPT = "Look at the files, then report. Marker: kiwi-7."


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def crash(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the supervisor and every process it started, groups included."""
    below = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    for pid in below:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def transcript(body: dict[str, object]) -> str:
    return json.dumps(body)


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_sigkilled_run_is_recovered_in_the_same_session(client: str, kernel_exe: str,
                                                        tmp_path: Path) -> None:
    """Killed mid-task, recovered: the client resumes its session and finishes the task."""
    require(client)
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("kiwi\n")
    replies = [
        # Slow enough that the session id checkpoint is long saved before the crash.
        Reply([ListDir(".")], frame_delay=1.0),
        Reply([Say("Still thinking about it all")], hang_after=2),   # the crash comes here
        Reply([Say("Resumed and finished: one file, notes.txt.")]),
    ]
    with FakeModelServer(CLIENTS[client][2], replies) as srv:
        env = client_env(client, srv.url, tmp_path / "home")
        env["KERNEL_DB"] = str(tmp_path / "kernel.duckdb")
        proc = subprocess.Popen([kernel_exe, "run", "--json", "--agent", client,
                                 "--prompt", PROMPT], cwd=work, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            srv.wait_requests(2, timeout=120)
        finally:
            crash(proc)
        first = srv.model_bodies()
        before = srv.requests[-1]

        listed = subprocess.run([kernel_exe, "recover", "--list", "--json"], env=env,
                                capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0, listed.stderr
        (row,) = [json.loads(line) for line in listed.stdout.splitlines()]
        rec = subprocess.run([kernel_exe, "recover", "--json"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=180)
        assert rec.returncode == 0, rec.stderr + rec.stdout
        (result,) = [json.loads(line) for line in rec.stdout.splitlines()]
        assert result["status"] == "ok", result
        assert result["run_id"] == row["run_id"]
        assert result["output"] == "Resumed and finished: one file, notes.txt."

        bodies = srv.model_bodies()
        assert len(bodies) == len(first) + 1
        resumed = transcript(bodies[-1])
        # The same conversation goes on: the original task and the tool call before the
        # crash are in the resumed request, followed by the continue prompt.
        assert "kiwi-7" in resumed and "notes.txt" in resumed
        assert "Continue the task" in resumed
        after = srv.requests[-1]
        if client == "claude":
            sid = before.headers["x-claude-code-session-id"]
            assert after.headers["x-claude-code-session-id"] == sid

        shown = subprocess.run([kernel_exe, "show", result["run_id"], "--json"], env=env,
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        events = json.loads(shown.stdout)["events"]
        (seam,) = [e for e in events if e["kind"] == "resume_session"]
        payload = seam["payload"] if isinstance(seam["payload"], dict) else json.loads(
            seam["payload"])
        assert payload["session_id"]  # the client's own session, continued
        assert "resume" in " ".join(payload["argv"])
        starts = [e for e in events if e["kind"] == "process_start"]
        assert len(starts) == 2  # the crashed client, and the resumed one
