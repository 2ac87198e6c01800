"""Nothing outlives a SIGKILLed `kernel run`, and `kernel recover` finishes what it left.

Every run here carries a unique marker in its environment; "a process of the
run" is any live process whose environment holds it (the kernel, its lifeline
watcher, the command and everything the command started). The kill moments
are random (seeded, printed on failure); the bound on how long the processes
may outlive the kernel is generous (30 s): what is asserted is that they go.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.realtime

#: How long processes of a dead run may linger before the test fails (it reports the real time).
GONE_WITHIN = 30.0

LOOP = """\
name: guarded
description: Every action holds a lock while it runs; a second holder means an orphan.
initial: work
max_iterations: 40
timeout: 120
states:
  work:
    action: >-
      flock -n ${context.lock} -c 'sleep 0.2; (sleep 0.1 &) ; sleep 0.1'
      || echo CONFLICT >> ${context.log};
      echo tick >> ${context.log};
      expr ${captured.n.output:default=0} + 1
    capture: n
    evaluate:
      type: output_numeric
      operator: ge
      target: 8
    route:
      yes: done
      no: work
  done:
    terminal: true
"""


def carriers(mark: str) -> list[int]:
    """Live (non-zombie) pids whose environment holds `mark`."""
    needle = mark.encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            if stat[stat.rfind(b")") + 2:].split()[0] == b"Z":
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read():
                    found.append(int(name))
        except OSError:
            continue
    return found


def wait_gone(mark: str) -> float:
    """Seconds until no process carries `mark` (fails after GONE_WITHIN)."""
    start = time.monotonic()
    while carriers(mark):
        elapsed = time.monotonic() - start
        if elapsed > GONE_WITHIN:
            pytest.fail(f"processes of the run still alive {elapsed:.1f}s after the kill: "
                        f"{carriers(mark)}")
        time.sleep(0.01)
    return time.monotonic() - start


def kill_at(exe: str, env: dict[str, str], args: list[str], at: float, cwd: Path,
            ready: Path | None) -> float:
    """Start `kernel run ARGS`, SIGKILL it `at` s after start (or after `ready` appears).

    Returns the seconds its processes outlived it.
    """
    mark = env["KERNEL_TEST_MARK"]
    proc = subprocess.Popen([exe, "run", "--no-critic", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=env, cwd=cwd)
    deadline = time.monotonic() + 120
    while ready is not None and not ready.exists():
        assert proc.poll() is None, "the run ended before it was ready"
        assert time.monotonic() < deadline, "the run never got ready"
        time.sleep(0.01)
    try:
        proc.wait(timeout=at)
    except subprocess.TimeoutExpired:
        proc.kill()
    proc.wait(timeout=30)
    return wait_gone(mark)


def moments(seed: int, early: float, late: float) -> list[tuple[float, bool]]:
    """20 kill moments: every 4th in the first `early` s of the process (startup, spawn),
    the rest up to `late` s after the run is ready (its command or loop running)."""
    rng = random.Random(seed)
    return [(rng.uniform(0.0, early), False) if i % 4 == 0 else (rng.uniform(0.0, late), True)
            for i in range(20)]


def env_for(cli_env: dict[str, str], db: Path) -> dict[str, str]:
    return {**cli_env, "KERNEL_DB": str(db), "KERNEL_TEST_MARK": f"m{uuid.uuid4().hex}"}


class TestSupervisorDeath:
    def test_plain_command_dies_with_kernel(self, kernel_exe: str, cli_env: dict[str, str],
                                            tmp_path: Path) -> None:
        """SIGKILL at 20 random moments: command and children gone, recover closes the run."""
        when = moments(1301, 1.5, 0.5)

        def one(i: int) -> tuple[float, float, str]:
            env = env_for(cli_env, tmp_path / f"plain-{i}.duckdb")
            ready = tmp_path / f"ready-{i}"
            script = f"sleep 300 & (sleep 300 &) ; echo > {ready}; sleep 300"
            at, anchored = when[i]
            lingered = kill_at(kernel_exe, env, ["--", "sh", "-c", script], at, tmp_path,
                               ready if anchored else None)
            rec = subprocess.run([kernel_exe, "recover"], capture_output=True, text=True,
                                 env=env, timeout=120, stdin=subprocess.DEVNULL)
            assert rec.returncode in (0, 1), rec.stderr
            assert "Traceback" not in rec.stderr
            runs = subprocess.run([kernel_exe, "runs", "--json"], capture_output=True,
                                  text=True, env=env, timeout=60)
            statuses = [json.loads(line)["status"] for line in runs.stdout.splitlines()] \
                if runs.returncode == 0 else []
            assert "running" not in statuses, (when[i], statuses, rec.stderr)
            if anchored:
                assert statuses == ["lost"], (when[i], statuses, rec.stderr)
            return at, lingered, ",".join(statuses) or "(not started)"

        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(one, range(20)))
        print("\nplain: kill moment -> seconds until no process of the run was alive")
        for (at, lingered, statuses), (_, anchored) in zip(results, when, strict=True):
            print(f"  {at:5.2f}s {'after ready' if anchored else 'after start'} -> "
                  f"{lingered:.3f}s  [{statuses}]")

    def test_loop_dies_with_kernel_and_recovers(self, kernel_exe: str, cli_env: dict[str, str],
                                                tmp_path: Path) -> None:
        """SIGKILL at 20 random moments of a loop: nothing left, recover finishes, no overlap."""
        loop = tmp_path / "guarded.yaml"
        loop.write_text(LOOP)
        when = moments(1302, 1.5, 1.5)

        def one(i: int) -> tuple[float, float, str]:
            env = env_for(cli_env, tmp_path / f"loop-{i}.duckdb")
            log, lock = tmp_path / f"log-{i}", tmp_path / f"lock-{i}"
            args = ["--checkpoint-interval", "0", str(loop), "-c", f"log={log}",
                    "-c", f"lock={lock}"]
            at, anchored = when[i]
            lingered = kill_at(kernel_exe, env, args, at, tmp_path, log if anchored else None)
            rec = subprocess.run([kernel_exe, "recover", "--json"], capture_output=True,
                                 text=True, env=env, timeout=180, cwd=tmp_path,
                                 stdin=subprocess.DEVNULL)
            assert rec.returncode == 0, (when[i], rec.stderr)
            results = [json.loads(line) for line in rec.stdout.splitlines() if line.strip()]
            assert all(r["status"] == "ok" for r in results), results
            if anchored:  # killed mid-loop: recover resumed it
                assert len(results) == 1, (when[i], rec.stderr)
            text = log.read_text() if log.exists() else ""
            assert "CONFLICT" not in text, (when[i], text)
            wait_gone(env["KERNEL_TEST_MARK"])
            runs = subprocess.run([kernel_exe, "runs", "--json"], capture_output=True,
                                  text=True, env=env, timeout=60)
            statuses = [json.loads(line)["status"] for line in runs.stdout.splitlines()] \
                if runs.returncode == 0 else []
            assert set(statuses) <= {"ok"}, (when[i], statuses)
            return at, lingered, ",".join(statuses) or "(not started)"

        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(one, range(20)))
        print("\nloop: kill moment -> seconds until no process of the run was alive")
        for (at, lingered, statuses), (_, anchored) in zip(results, when, strict=True):
            print(f"  {at:5.2f}s {'after first tick' if anchored else 'after start'} -> "
                  f"{lingered:.3f}s  [{statuses}]")

    def test_recover_stops_a_group_whose_watcher_died(self, kernel_exe: str,
                                                      cli_env: dict[str, str],
                                                      tmp_path: Path) -> None:
        """With the lifeline watcher killed too, `kernel recover` stops the recorded group."""
        env = env_for(cli_env, tmp_path / "k.duckdb")
        ready = tmp_path / "ready"
        proc = subprocess.Popen(
            [kernel_exe, "run", "--no-critic", "--", "sh", "-c",
             f"sleep 300 & echo x > {ready}; wait"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        # Let the audit flush the process_start event (it is what recover reads).
        rows: list[object] = []
        while not rows:
            assert time.monotonic() < deadline, "process_start never reached the audit"
            q = subprocess.run([kernel_exe, "query", "--format", "json",
                                "SELECT payload FROM events WHERE kind = 'process_start'"],
                               capture_output=True, text=True, env=env, timeout=60)
            out = q.stdout.strip() if q.returncode == 0 else ""
            rows = [json.loads(line) for line in out.splitlines() if line.strip()]
            time.sleep(0.1)
        watcher = [p for p in carriers(env["KERNEL_TEST_MARK"])
                   if b"_lifeline.py" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(watcher) == 1
        os.kill(watcher[0], signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=30)
        # Nobody is left to kill the group: it is still there for recover to find.
        assert carriers(env["KERNEL_TEST_MARK"]), "the group should have survived"
        rec = subprocess.run([kernel_exe, "recover"], capture_output=True, text=True, env=env,
                             timeout=120)
        assert rec.returncode == 1, rec.stderr
        assert "stopped 2 process(es)" in rec.stderr, rec.stderr
        assert "marked lost" in rec.stderr
        assert carriers(env["KERNEL_TEST_MARK"]) == []


class TestRecordedGroups:
    def test_a_reused_pid_is_never_killed(self) -> None:
        """A record whose start time does not match the live process is left alone."""
        from adapters._proc import live_group, start_time, stop_recorded

        victim = subprocess.Popen(["sleep", "300"], start_new_session=True)
        try:
            started = start_time(victim.pid)
            assert started is not None
            wrong = {"pid": victim.pid, "pgid": victim.pid, "start_time": started - 1}
            assert live_group(wrong) == []
            assert stop_recorded(wrong) == 0
            assert victim.poll() is None
            right = {**wrong, "start_time": started}
            assert live_group(right) == [victim.pid]
            assert stop_recorded(right) == 1
            assert victim.wait(timeout=30) == -signal.SIGKILL
        finally:
            victim.kill()
            victim.wait()

    def test_other_host_or_boot_is_ignored(self) -> None:
        """Records from another host, an earlier boot or without a start time are never acted on."""
        from adapters._proc import live_group, start_time

        victim = subprocess.Popen(["sleep", "300"], start_new_session=True)
        try:
            rec = {"pgid": victim.pid, "start_time": start_time(victim.pid)}
            assert live_group(rec) == [victim.pid]
            assert live_group({**rec, "host": "elsewhere.invalid"}) == []
            assert live_group({**rec, "boot_id": "not-this-boot"}) == []
            assert live_group({**rec, "start_time": None}) == []  # unverifiable: never
        finally:
            victim.kill()
            victim.wait()
