"""The fleet through the library: `RayDispatch` on a real local Ray cluster (a head and two
worker nodes) and a real PostgreSQL store; 200 runs across the workers, one worker node
SIGKILLed mid-batch. (`kernel batch --ray` itself: tests/cmd/test_batch_ray.py.)

Exactly once is checked on a side effect: each run's command appends its index to a
file. Runs still in flight when the node dies are held at a gate (a file the test
creates after the kill), so none is between its side effect and its close at that
moment: a run that appended twice would be a run that ran twice.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from ray_cluster import RayCluster, build_command, ray_env

from batteries.ray_dispatch import RayDispatch, RayOptions, WorkerCall
from batteries.store import Journal, open_store
from kernel import Status, new_run_id

pytestmark = pytest.mark.realtime

#: Wide bounds: the machine has 2 cores and other suites beside this one.
WAIT = 600.0
RUNS = 200
#: Runs before this index are not gated; every one of them ends before the kill.
FREE = 40
BUDGET = 50


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RayCluster]:
    """Its own cluster (this test kills a node): a head and two nodes of two CPUs."""
    import ray

    with RayCluster(tmp_path / "ray", workers=2, cpus=2) as c:
        os.environ.update({k: v for k, v in ray_env().items() if k.startswith("RAY_")})
        yield c
        ray.shutdown()


class Task:
    def __init__(self, i: int, d: Path) -> None:
        self.i = i
        self.task_id = f"t{i}"
        self.run_id = new_run_id()
        self.caller = "capped" if i % 5 in (0, 1) else "free"  # 80 capped, 120 free
        gate = "" if i < FREE else f"while [ ! -e {d}/gate ]; do sleep 0.05; done; "
        argv = ["sh", "-c", f"echo {i} >> {d}/started; {gate}echo {i} >> {d}/side"]
        self.spec: dict[str, Any] = {"agent": {"argv": argv},
                                     "info": {"name": f"t{i}", "caller_id": self.caller}}


def kernel(kernel_exe: str, env: dict[str, str], *args: str) -> list[Any]:
    """A `kernel` command's JSON lines (lists are one object a line)."""
    out = subprocess.run([kernel_exe, *args], capture_output=True, text=True, env=env,
                         timeout=WAIT)
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def _lines(p: Path) -> list[str]:
    return p.read_text().split() if p.exists() else []


@pytest.mark.timeout(3 * WAIT)
async def test_200_runs_on_two_nodes_one_killed_each_runs_once(
        cluster: RayCluster, pg_url: str, tmp_path: Path, kernel_exe: str,
        cli_env: dict[str, str]) -> None:
    """200 runs over two Ray nodes sharing one PostgreSQL store; one node is SIGKILLed
    with runs in flight: they are resumed on the other node, every run ends once (each
    side effect once), one caller's budget of 50 holds across the workers, and
    `kernel runs` / `kernel query` through the store see all 200."""
    from batteries.budget import JournalBudget

    tasks = [Task(i, tmp_path) for i in range(RUNS)]
    results: dict[int, Any] = {}
    slots = trio.CapacityLimiter(16)  # runs waiting in Ray's queue at once
    async with Journal.open(store=open_store(url=pg_url)) as journal:
        JournalBudget(journal).set("capped", max_runs=BUDGET)
        dispatch = RayDispatch(journal, WorkerCall(pg_url, build_command),
                               address=cluster.address,
                               options_for=lambda t: RayOptions(num_cpus=0.5))

        async def one(t: Task) -> None:
            async with slots:
                results[t.i] = await dispatch(t, None)

        async def until(ready: Any) -> None:
            with trio.fail_after(WAIT):
                while True:
                    if ready():
                        return
                    await trio.sleep(0.1)

        def gated() -> int:
            return len([i for i in _lines(tmp_path / "started") if int(i) >= FREE])

        async with trio.open_nursery() as n:
            # The free runs first, to their end (Ray keeps no order among queued tasks, so
            # a free run queued behind gated ones would wait for the gate forever).
            for t in tasks[:FREE]:
                n.start_soon(one, t)
            await until(lambda: len(results) == FREE)
            for t in tasks[FREE:]:
                n.start_soon(one, t)
            # Both nodes' 8 slots full of runs held at the gate: nothing in flight can be
            # past its side effect when the node dies.
            await until(lambda: gated() >= 8)
            assert cluster.kill_worker(0)
            (tmp_path / "gate").touch()

    status = Counter((t.caller, str(results[t.i].status)) for t in tasks)
    assert status == {("capped", "ok"): BUDGET, ("capped", "budget_exceeded"): 30,
                      ("free", "ok"): 120}, status
    ok = sorted(t.i for t in tasks if results[t.i].status is Status.OK)
    assert sorted(int(i) for i in _lines(tmp_path / "side")) == ok  # each exactly once
    assert dispatch.retries, "no run was in flight on the killed node"
    assert all(n == 1 for n in dispatch.retries.values())

    store = ["--store", pg_url]
    runs = kernel(kernel_exe, cli_env, "runs", "--json", "--limit", "1000", *store)
    assert sorted(r["run_id"] for r in runs) == sorted(t.run_id for t in tasks)
    assert Counter(r["status"] for r in runs) == {"ok": 170, "budget_exceeded": 30}
    sql = ("SELECT count(*) AS runs, count(DISTINCT run_id) AS ids, "
           "count(*) FILTER (WHERE status = 'ok') AS ok, "
           "(SELECT count(*) FROM events WHERE kind = 'resumed') AS resumed FROM runs")
    answered = kernel(kernel_exe, cli_env, "query", sql, "--format", "json", *store)
    assert answered == [{"runs": RUNS, "ids": RUNS, "ok": 170,
                         "resumed": len(dispatch.retries)}]
    [budget] = kernel(kernel_exe, cli_env, "budget", "show", "capped", "--json", *store)
    assert budget["runs"] == BUDGET
