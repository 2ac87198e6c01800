"""Review fixes for checkpoints (`batteries.checkpoint`) as `kernel resume`/`recover` read them.

A checkpoint row whose state or spec is not JSON (a write cut short, a
damaged disk, a hand edit) made `kernel resume` and `kernel recover` end in
a JSONDecodeError traceback (exit 1). `kernel resume` of it is now one line
naming the damage, exit 2 (`StoreError`); `kernel recover` names it in one
line, resumes the other runs (tests/cmd/test_recover_damaged_cli.py) and
exits 1.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
import trio
from counter_loop import COUNTER

from batteries.checkpoint import JournalCheckpointer
from batteries.store import StoreError
from kernel import Step

pytestmark = pytest.mark.realtime

PATIENCE = 120.0



def interrupted_run(kernel_exe: str, env: dict[str, str], tmp_path: Path) -> str:
    """A loop run SIGKILLed after its second tick (a real process): its run id."""
    loop, marker = tmp_path / "count.yaml", tmp_path / "ticks"
    loop.write_text(COUNTER)
    proc = subprocess.Popen([kernel_exe, "run", "--no-critic", str(loop), "-c",
                             f"marker={marker}"], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + PATIENCE  # a readiness wait: the bound is only for a hang
    while not marker.exists() or len(marker.read_text().splitlines()) < 2:
        assert proc.poll() is None, "the loop ended before its kill point"
        assert time.monotonic() < deadline, "the loop never reached its kill point"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=PATIENCE)
    journal = Path(env["KERNEL_DB"] + ".journal")
    with sqlite3.connect(journal) as con:
        [(run_id,)] = con.execute("SELECT run_id FROM checkpoints WHERE status = 'running'")
    return str(run_id)


def damage(env: dict[str, str], column: str) -> None:
    """Cut the checkpoint's `column` (state or spec) in half, as a torn write would."""
    with sqlite3.connect(env["KERNEL_DB"] + ".journal") as con:
        con.execute(f"UPDATE checkpoints SET {column} = substr({column}, 1, "
                    f"length({column}) / 2)")


@pytest.mark.parametrize("column", ["state", "spec"])
def test_a_damaged_checkpoint_is_one_line(kernel_exe: str, cli_env: dict[str, str],
                                          tmp_path: Path, column: str) -> None:
    """`resume` of it: one line, exit 2. `recover`: one line naming it, exit 1 (the other
    runs, if any, resumed). `recover --list`: listed, marked damaged, exit 1."""
    run_id = interrupted_run(kernel_exe, cli_env, tmp_path)
    damage(cli_env, column)
    for args, code in ((["resume", run_id[:8]], 2), (["recover"], 1)):
        got = subprocess.run([kernel_exe, *args], env=cli_env, capture_output=True, text=True,
                             timeout=PATIENCE)
        assert got.returncode == code, (args, got.stderr)
        assert got.stderr.count("\n") == 1 and "Traceback" not in got.stderr, got.stderr
        assert "checkpoint" in got.stderr and "damaged" in got.stderr, got.stderr
    got = subprocess.run([kernel_exe, "recover", "--list"], env=cli_env, capture_output=True,
                         text=True, timeout=PATIENCE)
    assert got.returncode == 1 and got.stderr == "", got.stderr
    [line] = got.stdout.splitlines()
    assert "checkpoint damaged" in line and f"its {column} is not JSON" in line


def test_load_names_the_run(kernel_exe: str, cli_env: dict[str, str], tmp_path: Path) -> None:
    """The library call raises `StoreError` naming the run, not the decoder's error."""
    run_id = interrupted_run(kernel_exe, cli_env, tmp_path)
    damage(cli_env, "state")
    checkpointer = JournalCheckpointer(cli_env["KERNEL_DB"])
    with pytest.raises(StoreError, match=f"checkpoint of run '{run_id}' is damaged"):
        checkpointer.load(run_id)
    # Listing flags it instead, so it never hides the other runs.
    [listed] = checkpointer.interrupted()
    assert listed.run_id == run_id and listed.damaged is not None
    assert listed.damaged.startswith("its state is not JSON: JSONDecodeError")
    assert [r.damaged for r in checkpointer.find(run_id[:8])] == [listed.damaged]


class Counting:
    """Three steps, with a resumable state that is not JSON data (a set)."""

    def __init__(self) -> None:
        self.n = 0

    async def step(self, ctx: object) -> Step:
        await trio.lowlevel.checkpoint()
        self.n += 1
        return Step(final=self.n == 3)

    def snapshot(self) -> dict[str, object]:
        return {"n": self.n, "seen": {1, 2}}


async def test_a_state_that_is_not_json_is_refused_and_not_resumable(tmp_path: Path) -> None:
    """A `snapshot()` holding a set was saved as the set's text ("{1, 2}"): a resumed
    agent got a string back. The save is refused (one port failure saying why), and
    the run is marked failed, so an interrupted run is not resumed from it."""
    from batteries.store import Journal
    from kernel import Kernel, Limits, Ports, RunInfo, Status

    async with Journal.open(tmp_path / "k.duckdb") as journal:
        cp = JournalCheckpointer(journal)
        info = RunInfo(name="sets")
        await cp.register(info.run_id, {"agent": {"kind": "test"}})
        result = await Kernel(Ports(checkpointer=cp)).run(
            Counting(), info, Limits(max_steps=2, timeout=30))  # max_steps: resumable
        assert result.status is Status.MAX_STEPS
        [failure] = [f for f in result.port_failures if f.port == "checkpointer"]
        assert failure.method == "save" and "a set is not JSON data" in failure.error
        saved = cp.load(info.run_id)
        assert saved is not None and saved.status == "failed"
        assert info.run_id not in [r.run_id for r in cp.interrupted()]
