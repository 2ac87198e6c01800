"""A real local Ray cluster for tests: a head and worker nodes, each its own process tree.

    with RayCluster(tmp_path, workers=2, cpus=2) as cluster:
        ray.init(address=cluster.address)
        ...
        cluster.kill_worker(0)          # SIGKILL the node's raylet and every process under it

Every node is `ray start --block` in its own session (so the node is one
process tree this test owns), started one after another: two nodes joining
at the same instant race for the same log-file names and one of them dies.
Readiness is the GCS's word, never a sleep: `wait_nodes` polls
`ray.nodes()` in a separate Python process until the expected nodes are
alive, with a wide timeout (a 2-core machine with other suites beside it
takes tens of seconds to start three raylets).

Each worker node carries a custom resource `node<i>` (100 units) so a test
can pin work to it, and `num_cpus` run slots. The head has no CPUs: work
goes to the worker nodes. Small object stores, no dashboard, no usage
stats: on this machine the three nodes hold about 1.3 GB resident between
them (measured with `ps`, RSS summed) and are idle between tasks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

#: Seconds to wait for a node to join (generous: load alone must not fail a test).
READY_TIMEOUT = 180.0
#: Bytes of object store per node (Ray's minimum is 75 MB).
OBJECT_STORE = 80 * 1024 * 1024


def ray_env() -> dict[str, str]:
    """The environment for `ray` processes and drivers: quiet, small, no telemetry."""
    env = dict(os.environ)
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0",
               RAY_BACKEND_LOG_LEVEL="warning", RAY_DISABLE_DOCKER_CPU_WARNING="1")
    # Workers import this module (`build_command`) by name.
    here = str(Path(__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


def _ray_exe() -> str:
    return str(Path(sys.executable).parent / "ray")


class RayCluster:
    """A head node and `workers` worker nodes on this machine (see the module docstring).

    Args:
        root: A directory for the cluster's temp files and logs.
        workers: Worker nodes to start.
        cpus: Run slots (Ray CPUs) per worker node.
    """

    def __init__(self, root: Path, *, workers: int = 2, cpus: int = 2) -> None:
        # Ray puts unix sockets under the temp dir: keep its path short (108 bytes max).
        self.temp = Path(f"/tmp/rk-{os.getpid()}-{id(self) % 10000}")
        self.root = root
        self.workers = workers
        self.cpus = cpus
        self.address = ""
        self.procs: list[subprocess.Popen[bytes]] = []
        self.node_ids: list[str] = []

    # ------------------------------------------------------------ start/stop

    def __enter__(self) -> RayCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([_ray_exe(), "start", "--block", "--disable-usage-stats",
                                 "--node-ip-address=127.0.0.1",
                                 f"--object-store-memory={OBJECT_STORE}", *args],
                                stdout=log, stderr=subprocess.STDOUT, env=ray_env(),
                                start_new_session=True, cwd=self.root)
        log.close()
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        """Start the head, then each worker node, waiting for each to be alive."""
        self.temp.mkdir(parents=True, exist_ok=True)
        self.root.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        self._spawn("head", ["--head", f"--port={port}", "--num-cpus=0",
                             "--include-dashboard=false", f"--temp-dir={self.temp}"])
        self.address = f"127.0.0.1:{port}"
        self.wait_nodes(1)
        for i in range(self.workers):
            self._spawn(f"worker{i}", [f"--address={self.address}", f"--num-cpus={self.cpus}",
                                       f"--resources={json.dumps({f'node{i}': 100})}"])
            self.wait_nodes(i + 2)
        self.node_ids = [self._node_of(i) for i in range(self.workers)]

    def stop(self) -> None:
        """SIGKILL every process of every node (and anything left under them)."""
        for proc in self.procs:
            _kill_tree(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        # The head's GCS and raylet leave their session files behind.
        subprocess.run(["rm", "-rf", str(self.temp)], check=False)

    # ---------------------------------------------------------------- nodes

    def nodes(self) -> list[dict[str, object]]:
        """`ray.nodes()` as the GCS reports it, read from a separate driver process."""
        code = (f"import json, ray; ray.init(address={self.address!r}, "
                "logging_level='ERROR', log_to_driver=False); print(json.dumps([{'id': "
                "n['NodeID'], 'alive': n['Alive'], 'resources': n['Resources']} "
                "for n in ray.nodes()]))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, env=ray_env(),
                             timeout=READY_TIMEOUT, check=False)
        if out.returncode != 0:
            return []
        lines = out.stdout.decode().strip().splitlines()
        return json.loads(lines[-1]) if lines else []

    def wait_nodes(self, alive: int) -> None:
        """Wait until the GCS reports `alive` live nodes (or fail after `READY_TIMEOUT`)."""
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a ray node exited with {proc.returncode} while "
                                       f"starting; see {self.root}/*.log")
            nodes = self.nodes()
            if sum(1 for n in nodes if n["alive"]) >= alive:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{alive} ray nodes not alive after {READY_TIMEOUT:.0f}s: "
                                   f"{nodes}")
            time.sleep(0.5)

    def _node_of(self, i: int) -> str:
        for n in self.nodes():
            resources = n["resources"]
            if n["alive"] and isinstance(resources, dict) and f"node{i}" in resources:
                return str(n["id"])
        raise RuntimeError(f"worker node {i} is not in the cluster")

    def kill_worker(self, i: int) -> list[int]:
        """SIGKILL worker node `i`: its `ray start`, raylet, workers and their children.

        Returns the pids killed.
        """
        return _kill_tree(self.procs[1 + i].pid)


def _kill_tree(pid: int) -> list[int]:
    """SIGKILL `pid` and every process under it (found first, then killed all at once)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    killed = []
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGKILL)
            killed.append(p.pid)
        except ProcessLookupError:
            pass
    return killed


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build_command(spec: Any) -> tuple[Any, Any, Any]:
    """A test agent builder the workers can import: `{"agent": {"argv": [...]}, "info":
    {...}, "limits": {...}}` becomes a supervised command (the fixture puts this folder
    on the nodes' PYTHONPATH)."""
    from adapters.shell import ShellAgent
    from kernel import Limits, RunInfo

    argv = list(spec["agent"]["argv"])
    info = spec.get("info") or {}
    return (ShellAgent(argv), RunInfo(name=info.get("name", argv[0]),
                                      caller_id=info.get("caller_id", "")),
            Limits(**(spec.get("limits") or {})))
