"""Runs on a real local Ray cluster (a head and two worker nodes, separate processes).

The store is the embedded journal on this machine's disk, which every node
of a one-machine cluster shares; the fleet test with PostgreSQL is in
tests/cmd/test_batch_ray.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from ray_cluster import RayCluster, build_command, ray_env

from batteries.ray_dispatch import RayDispatch, RayOptions, WorkerCall, store_unreachable
from batteries.store import Journal
from kernel import Status, new_run_id

pytestmark = pytest.mark.realtime

#: Wide: the cluster shares 2 cores with other suites.
WAIT = 300.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    """A head and two worker nodes of two run slots each, connected to from this process."""
    import ray

    with RayCluster(tmp_path_factory.mktemp("ray"), workers=2, cpus=2) as c:
        os.environ.update({k: v for k, v in ray_env().items() if k.startswith("RAY_")})
        yield c
        ray.shutdown()


class Task:
    """What the dispatcher reads of a batch task."""

    def __init__(self, i: int, argv: list[str], caller: str = "") -> None:
        self.task_id = f"t{i}"
        self.run_id = new_run_id()
        self.spec: dict[str, Any] = {"agent": {"argv": argv},
                                     "info": {"name": f"t{i}", "caller_id": caller}}


def _gated(i: int, d: Path) -> list[str]:
    """A command that says it started, waits for the gate file, then appends its index."""
    return ["sh", "-c", f"echo {i} $$ >> {d}/started; "
            f"while [ ! -e {d}/gate ]; do sleep 0.05; done; echo {i} >> {d}/side"]


def pid_under(root: int, pid: int, psutil: Any) -> bool:
    """True if `pid` is `root` or a process under it."""
    try:
        return pid == root or any(c.pid == pid for c in
                                  psutil.Process(root).children(recursive=True))
    except psutil.NoSuchProcess:
        return False


async def _wait_for(check: Any) -> None:
    """Poll `check` (a file another process writes) until true, within `WAIT`."""
    with trio.fail_after(WAIT):
        while True:
            if check():
                return
            await trio.sleep(0.1)


class TestRayDispatch:
    async def test_a_task_runs_where_its_resources_are(self, cluster: RayCluster,
                                                       tmp_path: Path) -> None:
        """A task asking for a node's custom resource runs on that node (per-task options)."""
        import psutil

        db = tmp_path / "k.duckdb"
        tasks = [Task(i, _gated(i, tmp_path)) for i in range(4)]
        on = {t.run_id: i % 2 for i, t in enumerate(tasks)}
        results: dict[str, Any] = {}
        async with Journal.open(db) as journal:
            dispatch = RayDispatch(
                journal, WorkerCall(str(db), build_command), address=cluster.address,
                options_for=lambda t: RayOptions(num_cpus=0, resources={f"node{on[t.run_id]}": 1}))

            async def one(t: Task) -> None:
                results[t.task_id] = await dispatch(t, None)

            async with trio.open_nursery() as n:
                for t in tasks:
                    n.start_soon(one, t)
                started = tmp_path / "started"
                await _wait_for(lambda: started.exists()
                                and len(started.read_text().splitlines()) == 4)
                where = {}
                for line in started.read_text().splitlines():
                    i, pid = line.split()
                    where[int(i)] = [k for k in range(2)
                                     if pid_under(cluster.procs[1 + k].pid, int(pid), psutil)]
                (tmp_path / "gate").touch()
        assert where == {0: [0], 1: [1], 2: [0], 3: [1]}
        assert all(r.status is Status.OK for r in results.values())

    async def test_one_budget_holds_across_workers(self, cluster: RayCluster,
                                                   tmp_path: Path) -> None:
        """A caller's budget of 10 runs, 30 runs spread over both nodes: exactly 10 run."""
        from batteries.budget import JournalBudget

        db = tmp_path / "k.duckdb"
        tasks = [Task(i, ["sh", "-c", f"echo {i} >> {tmp_path}/side"], caller="capped")
                 for i in range(30)]
        results: dict[str, Any] = {}
        async with Journal.open(db) as journal:
            JournalBudget(journal).set("capped", max_runs=10)
            dispatch = RayDispatch(journal, WorkerCall(str(db), build_command),
                                   address=cluster.address,
                                   options_for=lambda t: RayOptions(num_cpus=0.5))

            async def one(t: Task) -> None:
                results[t.task_id] = await dispatch(t, None)

            async with trio.open_nursery() as n:
                for t in tasks:
                    n.start_soon(one, t)
        statuses = sorted(str(r.status) for r in results.values())
        assert statuses == ["budget_exceeded"] * 20 + ["ok"] * 10
        assert len((tmp_path / "side").read_text().split()) == 10

    async def test_a_run_that_ended_comes_back_while_more_runs_are_out_than_threads(
            self, cluster: RayCluster, tmp_path: Path) -> None:
        """More runs out than worker threads: one that ended is collected at once, not when
        one of the others ends. Each run held a thread blocked in `ray.get` (trio's default
        limiter: 40 threads; 2 here), so a batch with `-j` above 40 left ended runs
        uncollected, their slots held, behind 40 long ones."""
        trio.to_thread.current_default_thread_limiter().total_tokens = 2  # this trio.run's
        db = tmp_path / "k.duckdb"
        gated = [Task(i, _gated(i, tmp_path)) for i in range(2)]
        quick = Task(9, ["sh", "-c", "echo quick"])
        results: dict[str, Any] = {}
        async with Journal.open(db) as journal:
            dispatch = RayDispatch(journal, WorkerCall(str(db), build_command),
                                   address=cluster.address,
                                   options_for=lambda t: RayOptions(num_cpus=0))

            async def one(t: Task) -> None:
                results[t.task_id] = await dispatch(t, None)

            started = tmp_path / "started"
            async with trio.open_nursery() as n:
                for t in gated:
                    n.start_soon(one, t)
                await _wait_for(lambda: started.exists()
                                and len(started.read_text().splitlines()) == 2)
                n.start_soon(one, quick)
                await _wait_for(lambda: quick.task_id in results)  # the gate still closed
                assert not any(t.task_id in results for t in gated)
                (tmp_path / "gate").touch()
        assert results[quick.task_id].status is Status.OK
        assert all(results[t.task_id].status is Status.OK for t in gated)

    async def test_a_lease_is_taken_only_from_a_holder_proved_gone(
            self, cluster: RayCluster, tmp_path: Path) -> None:
        """The driver claims a run whose holder is provably gone (a dead pid on a Ray host,
        asked on that host by a probe task), never a live holder's, nor one on a host Ray
        does not know."""
        import subprocess
        import sys

        from batteries.checkpoint import JournalCheckpointer
        from batteries.store import Owner, RegisterRun

        db = tmp_path / "k.duckdb"
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
        me = Owner.me()
        holders = {"dead": Owner(me.host, int(dead.stdout), None),
                   "alive": Owner(me.host, os.getppid(), None),
                   "unknown": Owner("not-in-this-cluster", 1, 1)}
        async with Journal.open(db) as journal:
            await journal.transact([RegisterRun(k * 8, {"agent": {}}, o)
                                    for k, o in holders.items()])
            # The driver is another process than the holders (this test's own pid would
            # be "mine"): a driver identity of its own.
            dispatch = RayDispatch(journal, WorkerCall(str(db), build_command),
                                   address=cluster.address, owner=Owner(me.host, 0, None))
            got = {k: await dispatch.claim(k * 8) for k in holders}
        assert got == {"dead": True, "alive": False, "unknown": False}
        assert JournalCheckpointer(db).store.saved_runs(run_id="dead" * 8)[0].owner.pid == 0

    async def test_runs_finish_once_when_a_node_dies_mid_batch(
            self, cluster: RayCluster, tmp_path: Path) -> None:
        """Runs in flight on a node that is SIGKILLed are taken back through their leases and
        resumed on the other node: every run ends ok, each side effect happens once."""
        db = tmp_path / "k.duckdb"
        tasks = [Task(i, _gated(i, tmp_path)) for i in range(12)]
        # Two nodes of 4 slots (half a CPU each): the first 8 runs fill both nodes.
        half = RayOptions(num_cpus=0.5)
        results: dict[str, Any] = {}
        async with Journal.open(db) as journal:
            dispatch = RayDispatch(journal, WorkerCall(str(db), build_command),
                                   address=cluster.address, options_for=lambda t: half)

            async def one(t: Task) -> None:
                results[t.task_id] = await dispatch(t, None)

            def started() -> list[str]:
                p = tmp_path / "started"
                return p.read_text().splitlines() if p.exists() else []

            async with trio.open_nursery() as n:
                for t in tasks:
                    n.start_soon(one, t)
                # Every run in flight is held at the gate: none can be between its side
                # effect and its close when the node dies.
                await _wait_for(lambda: len(started()) >= 8)
                assert cluster.kill_worker(0)
                (tmp_path / "gate").touch()
        assert {k: r.status for k, r in results.items()} == {t.task_id: Status.OK
                                                              for t in tasks}
        side = (tmp_path / "side").read_text().split()
        assert sorted(side, key=int) == [str(i) for i in range(12)]  # each exactly once
        assert dispatch.retries, "no run was on the killed node"
        store = journal.store
        for t in tasks:
            [saved] = store.saved_runs(run_id=t.run_id)
            assert saved.status == "completed"


class TestRayOptions:
    def test_reads_a_task_lines_ray_object(self) -> None:
        """CPUs (fractional), custom resources and memory become Ray's task options."""
        o = RayOptions.parse({"num_cpus": 0.5, "resources": {"gpu_box": 1}, "memory": 1e9})
        assert o.ray_kwargs() == {"num_cpus": 0.5, "resources": {"gpu_box": 1.0},
                                  "memory": 1_000_000_000}
        assert RayOptions.parse(o.to_dict()) == o
        assert RayOptions.parse(None).ray_kwargs() == {"num_cpus": 1.0}

    @pytest.mark.parametrize(("raw", "says"), [
        ([1], "must be an object"),
        ({"cpus": 1}, "unknown key 'cpus'"),
        ({"num_cpus": -1}, "finite number >= 0"),
        ({"num_cpus": float("nan")}, "finite number >= 0"),
        ({"num_cpus": "2"}, "must be a number"),
        ({"num_cpus": True}, "must be a number"),
        ({"resources": ["a"]}, "name: amount"),
        ({"resources": {"a": float("inf")}}, "ray.resources.a"),
    ])
    def test_refuses_bad_options_in_one_line(self, raw: Any, says: str) -> None:
        """Anything but finite amounts >= 0 under the three known keys is refused clearly."""
        with pytest.raises(ValueError, match=says.replace("(", r"\(")):
            RayOptions.parse(raw)

    def test_importing_the_dispatcher_does_not_import_ray(self) -> None:
        """Ray loads when a dispatcher connects, not when the module is imported."""
        import subprocess
        import sys

        code = ("import sys, batteries.ray_dispatch; "
                "print('ray' in sys.modules)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True)
        assert out.stdout.strip() == "False"


class TestSharedStore:
    NODES = [{"NodeManagerHostname": "here", "Alive": True},
             {"NodeManagerHostname": "box2", "Alive": True},
             {"NodeManagerHostname": "box3", "Alive": False}]

    def test_a_file_store_with_a_node_elsewhere_is_refused(self) -> None:
        """A journal path is a file on this machine: live nodes elsewhere cannot write it."""
        why = store_unreachable("/data/k.duckdb", self.NODES, "here")
        assert why is not None and "box2" in why and "box3" not in why
        assert "--store postgresql://" in why

    def test_a_server_or_one_machine_is_fine(self) -> None:
        """A PostgreSQL URL is shared by every node; a path is, when every node is here."""
        assert store_unreachable("postgresql://db/k", self.NODES, "here") is None
        assert store_unreachable("/data/k.duckdb", self.NODES[:1], "here") is None
