"""Crash-consistency review: `kernel run` SIGKILLed, then `kernel recover` / `kernel resume`.

Each test reproduces a defect found by killing real `kernel` processes and
resuming what they left; it failed before the fix beside it. Side effects are
counted in a file every loop state appends to (`start N` when the state's
action begins, `N` when it ends), so a state that runs again, or a run that
was resumed when it should not have been, shows in the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.realtime

#: A readiness bound: only a hang reaches it (the tests never time anything).
READY_WITHIN = 120.0

#: Six states, each leaving `start N` then `N` in the marker file, half a second apart.
#: With `stop_at`, the state that reaches it prints LOOP_STOP instead: the loop ends
#: `cancelled` by its own doing.
LOOP = """\
name: six
initial: count
max_iterations: 40
timeout: 300
states:
  count:
    action: >-
      n=$(( ${{captured.n.output:default=0}} + 1 )); echo start $n >> ${{context.marker}};
      sleep 0.5; echo $n >> ${{context.marker}};
      if [ $n -ge {stop_at} ]; then echo "LOOP_STOP: enough at $n"; else echo $n; fi
    capture: n
    evaluate:
      type: output_numeric
      operator: ge
      target: 6
    route:
      yes: done
      no: count
  done:
    terminal: true
"""


def lines(marker: Path) -> list[str]:
    """The marker file's lines (none before the first state wrote one)."""
    try:
        return marker.read_text().splitlines()
    except FileNotFoundError:
        return []


def wait_for(what: str, ready: Callable[[], bool], proc: subprocess.Popen[str]) -> None:
    """Poll until `ready()`; fail if `proc` ends first or the bound passes (a hang)."""
    deadline = time.monotonic() + READY_WITHIN
    while not ready():
        assert proc.poll() is None, f"the process ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"never saw {what}"
        time.sleep(0.01)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes a test starts: every one still alive at the end is killed (by its pid)."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def interrupted_loop(kernel_exe: str, env: dict[str, str], loop: Path, marker: Path,
                     procs: list[subprocess.Popen[str]]) -> None:
    """`kernel run LOOP`, SIGKILLed while its second state runs: an interrupted run."""
    proc = subprocess.Popen([kernel_exe, "run", "--no-critic", str(loop), "-c",
                             f"marker={marker}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
                            cwd=loop.parent, text=True)
    procs.append(proc)
    wait_for("the second state", lambda: "start 2" in lines(marker), proc)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def kernel(kernel_exe: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([kernel_exe, *args], capture_output=True, text=True, env=env,
                          timeout=READY_WITHIN, stdin=subprocess.DEVNULL)


def listed(kernel_exe: str, env: dict[str, str]) -> list[str]:
    """The run ids `kernel recover --list` names (the interrupted runs)."""
    out = kernel(kernel_exe, env, "recover", "--list", "--json")
    assert out.returncode == 0, out.stderr
    return [json.loads(line)["run_id"] for line in out.stdout.splitlines() if line.strip()]


def statuses(kernel_exe: str, env: dict[str, str]) -> dict[str, str]:
    """Every run's status, by the marker file its context names."""
    out = kernel(kernel_exe, env, "query", "--format", "json",
                 "SELECT inputs->'context'->>'marker' AS marker, "
                 "coalesce(status, 'running') AS status FROM runs")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return {str(r["marker"]): str(r["status"]) for r in rows}


class TestSignalStopsRecover:
    """Ctrl-C (or a shutdown's SIGTERM) sent to `kernel recover` stops the run it is
    resuming; before the fix `recover` went on to resume the next interrupted run, starting
    work the person (or the shutdown) had just stopped."""

    @pytest.mark.parametrize(("sig", "waiting"), [(signal.SIGINT, 1), (signal.SIGTERM, 2)],
                             ids=["ctrl-c-final", "sigterm-resumable"])
    def test_no_run_starts_after_the_signal(self, sig: signal.Signals, waiting: int,
                                            kernel_exe: str, cli_env: dict[str, str],
                                            tmp_path: Path,
                                            procs: list[subprocess.Popen[str]]) -> None:
        loop = tmp_path / "six.yaml"
        loop.write_text(LOOP.format(stop_at=99))
        one, two = tmp_path / "one", tmp_path / "two"
        interrupted_loop(kernel_exe, cli_env, loop, one, procs)
        interrupted_loop(kernel_exe, cli_env, loop, two, procs)
        before = {"one": len(lines(one)), "two": lines(two)}
        rec = subprocess.Popen([kernel_exe, "recover"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=cli_env,
                               cwd=tmp_path, text=True)
        procs.append(rec)
        # The oldest run is resumed first: its state running again is the moment.
        wait_for("the first run resumed", lambda: len(lines(one)) > before["one"], rec)
        rec.send_signal(sig)
        _, err = rec.communicate(timeout=READY_WITHIN)
        assert "Traceback" not in err, err
        assert lines(two) == before["two"], f"the second run was resumed after the signal: {err}"
        assert rec.returncode == 1, err  # a run it took did not end ok
        # As many as `recover --list` shows next: the stopped run too, after SIGTERM.
        assert "recover stopped" in err, err
        assert f"{waiting} interrupted run(s) left to resume" in err, err
        # The run it stopped ends `cancelled` (after SIGTERM it stays resumable too); the
        # other is still interrupted, untouched.
        assert len(listed(kernel_exe, cli_env)) == waiting
        assert statuses(kernel_exe, cli_env) == {str(one): "cancelled", str(two): "running"}

    def test_a_run_that_stops_itself_does_not_stop_recover(
            self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path,
            procs: list[subprocess.Popen[str]]) -> None:
        """A loop's own LOOP_STOP also ends `cancelled`, but nobody stopped `recover`: it
        goes on to the next run (a regression guard for the check above)."""
        loop = tmp_path / "six.yaml"
        loop.write_text(LOOP.format(stop_at=3))
        one, two = tmp_path / "one", tmp_path / "two"
        interrupted_loop(kernel_exe, cli_env, loop, one, procs)
        interrupted_loop(kernel_exe, cli_env, loop, two, procs)
        rec = kernel(kernel_exe, cli_env, "recover")
        assert rec.returncode == 1, rec.stderr  # cancelled is not ok
        assert "recover stopped" not in rec.stderr, rec.stderr
        assert statuses(kernel_exe, cli_env) == {str(one): "cancelled", str(two): "cancelled"}
        assert listed(kernel_exe, cli_env) == []

    def test_the_library_goes_on_past_a_run_that_stopped_itself(
            self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path,
            procs: list[subprocess.Popen[str]]) -> None:
        """`Recovery.recover` in a host process: a run ending with its own LOOP_STOP is
        over, not stopped from outside; before the fix the host's recovery stopped there
        and left the other interrupted runs waiting."""
        loop = tmp_path / "six.yaml"
        loop.write_text(LOOP.format(stop_at=3))
        one, two = tmp_path / "one", tmp_path / "two"
        interrupted_loop(kernel_exe, cli_env, loop, one, procs)
        interrupted_loop(kernel_exe, cli_env, loop, two, procs)
        host = ("import json, sys, trio\n"
                "from adapters import agent_from_spec, stop_leftover_group\n"
                "from batteries.recovery import Recovery\n"
                "rec = Recovery(sys.argv[1], build=lambda s: agent_from_spec(s).agent,\n"
                "               stop_group=stop_leftover_group)\n"
                "for o in trio.run(rec.recover):\n"
                "    print(json.dumps([o.run_id, o.result.status if o.result else o.why]))\n")
        out = subprocess.run([sys.executable, "-c", host, cli_env["KERNEL_DB"]],
                             capture_output=True, text=True, env=cli_env, cwd=tmp_path,
                             timeout=READY_WITHIN, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr
        done = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("[")]
        assert [status for _, status in done] == ["cancelled", "cancelled"], out.stdout
        assert listed(kernel_exe, cli_env) == []


ORPHAN = """\
name: one-slow-state
initial: work
max_iterations: 5
timeout: 300
states:
  work:
    action: echo start >> ${context.marker}; sleep 4; echo end >> ${context.marker}
    next: done
  done:
    terminal: true
"""


def _carriers(mark: str) -> list[int]:
    """Live pids whose environment holds `mark` (the processes of one test's run)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if mark.encode() in Path(f"/proc/{name}/environ").read_bytes():
                    found.append(int(name))
            except OSError:
                continue
    return found


def _journal_has(env: dict[str, str], kind: str) -> bool:
    """Whether the journal (read-only, from outside) holds an event of `kind`."""
    import sqlite3

    journal = Path(env["KERNEL_DB"] + ".journal")
    if not journal.exists():
        return False
    with contextlib.closing(sqlite3.connect(f"file:{journal}?mode=ro", uri=True)) as con:
        try:
            return con.execute("SELECT 1 FROM events WHERE kind = ? LIMIT 1",
                               (kind,)).fetchone() is not None
        except sqlite3.OperationalError:  # being created
            return False


def _children(pid: int) -> list[int]:
    """The pids whose parent is `pid`."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_bytes()
            except OSError:
                continue
            if int(stat[stat.rfind(b")") + 2:].split()[1]) == pid:
                found.append(int(name))
    return found


class TestOrphanOfAWatcherlessCrash:
    def test_recover_stops_an_orphan_whose_group_was_not_flushed(
            self, kernel_exe: str, cli_env: dict[str, str], tmp_path: Path,
            procs: list[subprocess.Popen[str]]) -> None:
        """`kernel run` and its lifeline watcher SIGKILLed just after an action started:
        the action must not run on beside the resumed state (its side effect twice).

        Its `process_start` event is written at once (`Journal.soon`; it waited up to
        a second for the flush timer, and `recover` found no group to stop): the
        kill comes once it is in the journal, which is what `recover` reads. (That
        it is written without the timer is `test_audit_review_fixes`'s.)"""
        mark = f"crash-review-{os.getpid()}-{time.monotonic_ns()}"
        env = {**cli_env, "CRASH_REVIEW_MARK": mark}
        loop = tmp_path / "slow.yaml"
        loop.write_text(ORPHAN)
        marker = tmp_path / "marks"
        try:
            proc = subprocess.Popen([kernel_exe, "run", "--no-critic", str(loop), "-c",
                                     f"marker={marker}"], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                    env=env, cwd=tmp_path, text=True)
            procs.append(proc)
            wait_for("the action", lambda: "start" in lines(marker), proc)
            wait_for("its process_start in the journal",
                     lambda: _journal_has(cli_env, "process_start"), proc)
            watchers = [p for p in _children(proc.pid)
                        if b"_lifeline.py" in Path(f"/proc/{p}/cmdline").read_bytes()]
            assert len(watchers) == 1, watchers
            os.kill(watchers[0], signal.SIGKILL)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            rec = kernel(kernel_exe, env, "recover")
            assert rec.returncode == 0, rec.stderr
            deadline = time.monotonic() + READY_WITHIN
            while _carriers(mark) and time.monotonic() < deadline:
                time.sleep(0.05)  # an orphan still running: let it show its effect
            assert lines(marker).count("end") == 1, (lines(marker), rec.stderr)
        finally:
            for pid in _carriers(mark):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
