"""The fleet: `kernel batch --ray` on a real local Ray cluster (a head and two worker nodes,
separate processes) sharing a real PostgreSQL store; 200 runs, one worker node SIGKILLed
mid-batch. (A killed driver's batch is resumed on the embedded journal, which a cluster
on one machine shares.)

Exactly once is checked on a side effect: each run's command appends its index to a
file. Each run waits at its own gate before its side effect; the test opens the gates
of the first 40 runs to start, waits until all 40 have ended (their result lines), then
until both nodes' slots hold runs waiting at their gates, and only then kills a node and
opens every gate. So no run is between its side effect and its close when the node
dies: a run that appended twice would be a run that ran twice.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from journal_texts import stored_texts
from ray_cluster import RayCluster, ray_env

pytestmark = pytest.mark.realtime

#: Wide bounds: the machine has 2 cores and other suites beside this one.
WAIT = 600.0
RUNS = 200
#: Runs let through before the kill (the first to start).
FIRST = 40
BUDGET = 50
#: Ray slots: two nodes of two CPUs, half a CPU a run.
SLOTS = 8


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RayCluster]:
    """Its own cluster (this test kills a node): a head and two nodes of two CPUs."""
    with RayCluster(tmp_path / "ray", workers=2, cpus=2) as c:
        yield c


def kernel(kernel_exe: str, env: dict[str, str], *args: str) -> list[Any]:
    """A `kernel` command's JSON lines (lists are one object a line)."""
    out = subprocess.run([kernel_exe, *args], capture_output=True, text=True, env=env,
                         timeout=WAIT)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def caller(i: int) -> str:
    return "capped" if i % 5 in (0, 1) else "free"  # 80 capped, 120 free


def until(ready: Callable[[], bool], what: str, proc: subprocess.Popen[str]) -> None:
    """Poll `ready` (files other processes write) until true; fail if the batch exits."""
    deadline = time.monotonic() + WAIT
    while not ready():
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            pytest.fail(f"kernel batch exited with {proc.returncode} before {what}: {err}")
        assert time.monotonic() < deadline, f"no {what} after {WAIT:.0f}s"
        time.sleep(0.1)


@pytest.mark.timeout(4 * WAIT)
def test_200_runs_on_two_nodes_one_killed_each_runs_once(
        cluster: RayCluster, pg_url: str, tmp_path: Path, kernel_exe: str,
        cli_env: dict[str, str]) -> None:
    """`kernel batch --ray` runs 200 tasks over two Ray nodes sharing one PostgreSQL
    store; one node is SIGKILLed with runs in flight: they are resumed on the other node, every run
    ends once (each side effect once), one caller's budget of 50 holds across the
    workers, and `kernel runs` / `kernel query` through the store see all 200."""
    d = tmp_path
    lines = []
    for i in range(RUNS):
        script = (f"echo {i} >> {d}/started; while [ ! -e {d}/gate.{i} ] && "
                  f"[ ! -e {d}/gate ]; do sleep 0.05; done; echo {i} >> {d}/side")
        lines.append(json.dumps({"id": f"t{i}", "command": ["sh", "-c", script],
                                 "caller": caller(i), "ray": {"num_cpus": 0.5}}))
    (d / "tasks.jsonl").write_text("\n".join(lines) + "\n")
    env = {**cli_env, **ray_env()}
    store = ["--store", pg_url]
    kernel(kernel_exe, env, "budget", "set", "capped", "--runs", str(BUDGET), "--json", *store)

    proc = subprocess.Popen([kernel_exe, "batch", str(d / "tasks.jsonl"), "--ray",
                             cluster.address, "--concurrency", "16", "--json", *store],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    printed: list[str] = []  # stdout lines, appended as they come (a list append is atomic)
    reader = threading.Thread(target=lambda: printed.extend(proc.stdout or ()), daemon=True)
    reader.start()

    def ended_ok() -> set[str]:
        return {o["task_id"] for o in map(json.loads, [p for p in printed if p[:1] == "{"])
                if o["status"] == "ok"}

    def started() -> list[int]:
        p = d / "started"
        return [int(i) for i in p.read_text().split()] if p.exists() else []

    try:
        opened: list[int] = []

        def let_first_through() -> bool:
            for i in started():
                if len(opened) < FIRST and i not in opened:
                    (d / f"gate.{i}").touch()
                    opened.append(i)
            return len(opened) == FIRST

        until(let_first_through, f"{FIRST} runs started", proc)
        until(lambda: len(ended_ok()) >= FIRST, f"{FIRST} runs ended", proc)
        # Every slot of both nodes holds a run waiting at its gate.
        until(lambda: len(set(started()) - set(opened)) >= SLOTS, "full slots", proc)
        assert cluster.kill_worker(0)
        (d / "gate").touch()
        proc.wait(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=WAIT)
    assert not reader.is_alive()
    stderr = proc.stderr.read() if proc.stderr else ""
    noise = [line for line in printed if not line.startswith("{")]
    assert not noise, noise  # --json: nothing but JSON lines on stdout
    outcomes = [json.loads(line) for line in printed]
    assert proc.returncode == 1, stderr  # not every run ended ok: 30 over budget

    by_task = Counter(o["task_id"] for o in outcomes)
    assert by_task == {f"t{i}": 1 for i in range(RUNS)}, stderr
    status = Counter((caller(int(o["task_id"][1:])), o["status"]) for o in outcomes)
    assert status == {("capped", "ok"): BUDGET, ("capped", "budget_exceeded"): 30,
                      ("free", "ok"): 120}, status
    ok = sorted(int(o["task_id"][1:]) for o in outcomes if o["status"] == "ok")
    assert sorted(int(i) for i in (d / "side").read_text().split()) == ok  # each once

    runs = kernel(kernel_exe, cli_env, "runs", "--json", "--limit", "1000", *store)
    assert sorted(r["run_id"] for r in runs) == sorted(o["run_id"] for o in outcomes)
    assert Counter(r["status"] for r in runs) == {"ok": 170, "budget_exceeded": 30}
    sql = ("SELECT count(*) AS runs, count(DISTINCT run_id) AS ids, "
           "count(*) FILTER (WHERE status = 'ok') AS ok, "
           "(SELECT count(*) FROM events WHERE kind = 'resumed') AS resumed FROM runs")
    [answer] = kernel(kernel_exe, cli_env, "query", sql, "--format", "json", *store)
    # The killed node held half the slots, each a run waiting at its gate.
    assert answer == {"runs": RUNS, "ids": RUNS, "ok": 170, "resumed": SLOTS // 2}, answer
    [budget] = kernel(kernel_exe, cli_env, "budget", "show", "capped", "--json", *store)
    assert budget["runs"] == BUDGET


@pytest.mark.parametrize(("ray", "says"), [
    ({"num_cpus": -1}, '"ray.num_cpus" must be a finite number >= 0'),
    ({"gpus": 1}, "unknown key 'gpus'"),
    ("fast", '"ray" must be an object'),
])
def test_a_bad_ray_field_is_one_line_and_nothing_runs(
        kernel_exe: str, cli_env: dict[str, str], tmp_path: Path, ray: Any,
        says: str) -> None:
    """A task line's bad "ray" options are refused before anything runs: exit 2, one line
    naming the line and the field."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"command": ["true"]}) + "\n"
                     + json.dumps({"command": ["true"], "ray": ray}) + "\n")
    out = subprocess.run([kernel_exe, "batch", str(tasks), "--ray", "auto"],
                         capture_output=True, text=True, env=cli_env, timeout=WAIT)
    assert out.returncode == 2
    [line] = out.stderr.splitlines()
    assert ":2" in line and says in line, line
    assert out.stdout == ""


@pytest.mark.timeout(4 * WAIT)
def test_a_killed_driver_s_batch_is_resumed_on_the_cluster(
        cluster: RayCluster, tmp_path: Path, kernel_exe: str,
        cli_env: dict[str, str]) -> None:
    """`kernel batch --ray` SIGKILLed with 8 runs in flight: Ray stops their workers (and
    the workers' lifelines their commands); `--resume last --ray` claims each run through
    Ray and finishes the batch, every side effect once."""
    import psutil

    d = tmp_path
    lines = []
    for i in range(12):
        script = (f"echo {i} $$ >> {d}/started; while [ ! -e {d}/gate ]; do sleep 0.05; "
                  f"done; echo {i} >> {d}/side")
        lines.append(json.dumps({"id": f"t{i}", "command": ["sh", "-c", script],
                                 "ray": {"num_cpus": 0.5}}))
    (d / "tasks.jsonl").write_text("\n".join(lines) + "\n")
    env = {**cli_env, **ray_env()}
    batch = [kernel_exe, "batch", "--ray", cluster.address, "--json"]
    proc = subprocess.Popen([*batch, str(d / "tasks.jsonl"), "--concurrency", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)

    def started() -> list[tuple[int, int]]:
        p = d / "started"
        return [(int(a), int(b)) for a, b in
                (line.split() for line in p.read_text().splitlines())] if p.exists() else []

    try:
        until(lambda: len(started()) >= SLOTS, "8 runs at the gate", proc)
    finally:
        proc.kill()
        proc.communicate(timeout=WAIT)
    pids = [pid for _, pid in started()]

    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def holders() -> list[int]:
        """The processes holding the interrupted runs' leases (Ray workers of the dead
        driver): Ray stops them after the driver dies, and under load a worker can
        outlive the commands it stopped; a resume before then finds the run held."""
        with closing(sqlite3.connect(cli_env["KERNEL_DB"] + ".journal")) as con:
            rows = con.execute("SELECT pid FROM checkpoints WHERE status = 'running'")
            return [int(pid) for (pid,) in rows if pid is not None]

    deadline = time.monotonic() + WAIT
    while any(running(p) for p in pids):
        assert time.monotonic() < deadline, "the dead driver's commands are still running"
        time.sleep(0.1)
    while any(running(p) for p in holders()):
        assert time.monotonic() < deadline, "the dead driver's Ray workers are still running"
        time.sleep(0.1)
    (d / "gate").touch()

    resumed = subprocess.run([*batch, "--resume", "last"], capture_output=True, text=True,
                             env=env, timeout=WAIT)
    assert resumed.returncode == 0, resumed.stderr
    outcomes = [json.loads(line) for line in resumed.stdout.splitlines()]
    assert sorted(o["task_id"] for o in outcomes) == sorted(f"t{i}" for i in range(12))
    assert {o["status"] for o in outcomes} == {"ok"}
    assert sum(o["resumed"] for o in outcomes) == SLOTS
    assert sorted(int(i) for i in (d / "side").read_text().split()) == list(range(12))


@pytest.mark.timeout(4 * WAIT)
def test_secrets_reach_the_command_on_a_ray_worker_and_are_stored_redacted(
        tmp_path: Path, kernel_exe: str, cli_env: dict[str, str]) -> None:
    """A secret in a task's command line or a secret-named context value reaches its
    command on a Ray worker as written (the builder travels with the task); the journal
    holds it nowhere."""
    token, key = "abcdefgh12345678", "zzzsecretvalue99"
    d = tmp_path
    tasks = [
        {"id": "argv", "command": ["sh", "-c", f"echo token={token} > {d}/a"]},
        {"id": "ctx", "command": ["sh", "-c", f"echo $KERNEL_CTX_API_TOKEN > {d}/b"],
         "context": {"api_token": key}},
        {"id": "plain", "command": ["sh", "-c", f"echo plain > {d}/c"]},
    ]
    (d / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    with RayCluster(d / "ray", workers=1, cpus=2) as c:
        out = subprocess.run([kernel_exe, "batch", str(d / "tasks.jsonl"), "--ray", c.address,
                              "--json"], capture_output=True, text=True,
                             env={**cli_env, **ray_env()}, timeout=WAIT)
    assert out.returncode == 0, out.stderr
    assert {json.loads(line)["status"] for line in out.stdout.splitlines()} == {"ok"}
    assert (d / "a").read_text().split() == [f"token={token}"]
    assert (d / "b").read_text().split() == [key]
    assert (d / "c").read_text().split() == ["plain"]
    stored = stored_texts(cli_env["KERNEL_DB"] + ".journal")
    assert stored and not [v for v in stored if token in v or key in v]
    assert any("[REDACTED" in v for v in stored)
