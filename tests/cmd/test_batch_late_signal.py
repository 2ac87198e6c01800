"""Ctrl-C after every run of a batch has ended, while its deliveries are under way.

The signal cancelled the batch as if runs were left: the deliveries finished
(they get 30 s after a signal) but the batch was reported interrupted, exit
130, and left unfinished for a `--resume` with nothing to run. Now a signal
that finds every run ended only bounds the deliveries: the batch finishes,
its exit code is its own (0 when every result was delivered), and a second
signal still stops the deliveries.

Real parts: the installed `kernel`, real commands, the real journal, a real HTTP
server on 127.0.0.1 holding its answers. Waits are for readiness (requests
received, a line on stderr), never fixed sleeps.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.cmd.test_batch_cli import PATIENCE, wait_for, write_tasks
from tests.cmd.test_batch_delivery import Hook, hook
from tests.cmd.test_batch_delivery_resume import effect_tasks, listed

__all__ = ["hook"]  # the fixture, used here

pytestmark = pytest.mark.realtime


@pytest.mark.parametrize("workers", ["1", "2"], ids=["in-process", "workers"])
def test_a_signal_after_every_run_ended_lets_the_deliveries_finish_the_batch(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, hook: Hook,
        workers: str) -> None:
    effects = tmp_path / "effects"
    n = 3
    tasks = write_tasks(tmp_path / "t.jsonl", effect_tasks(n, effects))
    hook.hold.set()
    err_file = tmp_path / "stderr"
    with err_file.open("w") as err:
        proc = subprocess.Popen([kernel_exe, "batch", str(tasks), "-j", "3", "--workers",
                                 workers, "--webhook", hook.url()], env=cli_env,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_for("every result to be posted (and held)", lambda: len(hook.run_ids()) == n)
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + PATIENCE  # readiness: the batch saw the signal
        while "has ended" not in err_file.read_text():
            assert proc.poll() is None, err_file.read_text()
            assert time.monotonic() < deadline, err_file.read_text()
            time.sleep(0.02)
        hook.hold.clear()
        hook.release.set()  # the held requests are answered: every result delivered
        code = proc.wait(timeout=PATIENCE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = err_file.read_text()
    assert code == 0, err  # was 130
    assert "interrupted" not in err and "Traceback" not in err, err
    row = listed(kernel_exe, cli_env)
    assert row["state"] == "finished", row
    assert row["undelivered"] == 0, row
