"""Runs on a Ray cluster: each run goes to a Ray worker, and comes back when one dies.

    async with Journal.open(db) as journal:
        dispatch = RayDispatch(journal, WorkerCall(store=str(db), build=build),
                               address="auto")
        result = await dispatch(task, resume=None)   # task: run_id, task_id, spec

`RayDispatch` has the shape of the batch runner's `Dispatch` (one task in,
one `Result` out), so a batch runs on a cluster by swapping the dispatcher
and nothing else. Every worker writes to the same store the driver reads
(`WorkerCall.store`: a path on a machine the whole cluster shares, or a
PostgreSQL URL), and opens its own journal there: runs, events,
checkpoints, leases and budgets live in the store, never in Ray. Ray only
carries the task in (the run spec, a checkpoint to resume from) and the
`Result` out.

**Where a run's lease goes.** The worker registers the run under its own
process (`Owner.me()` on the worker) in the run's opening transaction, with
the budget reservation and the first audit rows: a worker that dies before
that transaction left nothing, and the run is simply sent again. Ray runs
each task at most once (`max_retries=0`): only this dispatcher retries,
through the store.

**When a worker or its node dies** Ray fails the task with a system error
(`WorkerCrashedError`, `NodeDiedError`, ...; never `RayTaskError`, which is
the task's own exception). The dispatcher then reads the run's checkpoint:

- not registered: it never started; sent again from the start;
- ended (`completed`/`failed`): it finished before the worker died; its
  result is rebuilt from the store rather than run twice;
- `running`, held by a process the dispatcher can prove gone: the lease is
  claimed (`ClaimRun`, compare-and-swap on the exact holder) and the run
  resumed from its last checkpoint on whichever node Ray picks.

"Provably gone" is the store's rule, and Ray supplies the proof the driver
cannot get from its own machine: if a live Ray node runs on the holder's
host, a probe task pinned to that node asks the host itself (no such pid,
or the pid started at another time); if every Ray node on that host is dead
by the GCS's verdict, the holder (a Ray worker there) died with its raylet
and the claim vouches for it (`ClaimRun(gone=holder)`). A holder on a host
Ray does not know is never taken over (it is not one of ours). The one thing
this cannot tell apart is a network partition that the GCS mistook for a
dead node while the worker still reaches the store; Ray then fences the
node (a node marked dead never rejoins and its raylet exits when told), and
the run may have run twice in that window. Nothing else moves a lease.

**Waiting for results.** The runs out on the cluster are watched together:
one thread at a time calls `ray.wait` over all of them (`_Waits`: the
caller whose turn it is leads a round of up to half a second; a run sent
during a round is watched from the next), and each result is fetched once
it is ready. A thread per run blocked in `ray.get` held one of trio's 40
default worker threads each: with more runs out than that, a run that had
ended was not collected (its slot held) until one of the 40 watched ones
ended, and the journal's reads waited for a thread too.

**Budgets.** A run is counted against its caller's budget once, when it
first opens. A resumed run is not reserved again (its caller's budget may be
used up by then; it was admitted): it gets the caps that remain and no new
reservation.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from kernel import Checkpoint, ConfigError, Ports, Result, Status

from .batch import AgentBuilder, BatchTask, KernelDispatch
from .store import ClaimRun, Journal, Owner, StoreError, open_store

__all__ = [
    "RayDispatch",
    "RayOptions",
    "RunHeldElsewhereError",
    "WorkerCall",
    "run_on_worker",
    "store_unreachable",
]


class RunHeldElsewhereError(StoreError):
    """A dead worker's run is held by a process this dispatcher cannot prove gone."""


# ----------------------------------------------------------------- options


@dataclass(frozen=True, slots=True)
class RayOptions:
    """What one run asks of the cluster (a task line's `"ray"` object).

    Attributes:
        num_cpus: Ray CPUs the run holds while it runs (may be fractional; 0 is allowed).
        resources: Custom resources, e.g. `{"gpu_box": 1}` (nodes started with them).
        memory: Bytes of Ray's `memory` resource to reserve (None: none).
    """

    num_cpus: float = 1.0
    resources: Mapping[str, float] = field(default_factory=dict)
    memory: int | None = None

    @classmethod
    def parse(cls, raw: Any) -> RayOptions:
        """Read a task line's `"ray"` value (None: the defaults).

        Raises:
            ValueError: An unknown key or a value that is not a finite number >= 0.
        """
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ValueError(f'"ray" must be an object, got {type(raw).__name__}')
        unknown = set(raw) - {"num_cpus", "resources", "memory"}
        if unknown:
            raise ValueError(f'"ray": unknown key {sorted(unknown)[0]!r} '
                             "(known: num_cpus, resources, memory)")
        cpus = _amount("ray.num_cpus", raw.get("num_cpus", 1.0))
        resources = raw.get("resources") or {}
        if not isinstance(resources, Mapping):
            raise ValueError('"ray.resources" must be an object of name: amount')
        res = {str(k): _amount(f"ray.resources.{k}", v) for k, v in resources.items()}
        memory = raw.get("memory")
        mem = None if memory is None else int(_amount("ray.memory", memory))
        return cls(num_cpus=cpus, resources=res, memory=mem)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, the shape `parse` reads."""
        doc: dict[str, Any] = {"num_cpus": self.num_cpus, "resources": dict(self.resources)}
        if self.memory is not None:
            doc["memory"] = self.memory
        return doc

    def ray_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Ray's `.options(...)`."""
        kw: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.resources:
            kw["resources"] = dict(self.resources)
        if self.memory is not None:
            kw["memory"] = self.memory
        return kw


def _amount(what: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f'"{what}" must be a number, got {value!r}')
    if not math.isfinite(value) or value < 0:
        raise ValueError(f'"{what}" must be a finite number >= 0, got {value!r}')
    return float(value)


# ------------------------------------------------------------- worker side


def default_ports(journal: Journal) -> Ports:
    """A worker's ports: audit, budget and checkpointer on the journal, the watch critic."""
    from .audit import JournalAudit
    from .budget import JournalBudget
    from .checkpoint import JournalCheckpointer
    from .critic import WatchCritic

    return Ports(audit=JournalAudit(journal), budget=JournalBudget(journal),
                 checkpointer=JournalCheckpointer(journal), critic=WatchCritic())


@asynccontextmanager
async def open_default_ports(store: str) -> AsyncIterator[Ports]:
    """`default_ports` on a journal opened on the shared store (closed afterwards)."""
    async with Journal.open(store=_open(store)) as journal:
        yield default_ports(journal)


def _open(store: str) -> Any:
    """The shared store named by `store`: a PostgreSQL URL, or the analysts' file path."""
    if store.startswith(("postgresql://", "postgres://")):
        return open_store(url=store)
    return open_store(store)


@dataclass(frozen=True, slots=True)
class WorkerCall:
    """What every worker needs to run a task: the shared store, how to build and wire it.

    Sent to the workers with each task (Ray pickles it), so its functions
    must be importable on the workers (module-level functions of an
    installed package, or partials of them, which Ray sends by reference).

    Attributes:
        store: The shared store: a PostgreSQL URL, or (a cluster on one
            machine) the analysts' file path.
        build: Turns a run spec into (agent, info, limits).
        ports: Opens the worker's ports on the store, an async context manager
            (None: `open_default_ports`).
        critic_for: Picks a critic per spec (`KernelDispatch`'s).
        redacted: The specs were redacted when the batch was stored.
    """

    store: str
    build: AgentBuilder
    ports: Callable[[str], AbstractAsyncContextManager[Ports]] | None = None
    critic_for: Callable[[Mapping[str, Any]], Any] | None = None
    redacted: bool = False


async def _run_task(call: WorkerCall, task: BatchTask, resume: Checkpoint | None) -> Result:
    async with (call.ports or open_default_ports)(call.store) as ports:
        # The batch's own dispatcher, in this process: it registers the run under this
        # worker (in the run's opening transaction, with the budget reservation and the
        # first audit rows) and gives a resumed run the budget it was admitted with.
        dispatch = KernelDispatch(ports, call.build, critic_for=call.critic_for,
                                  redacted=call.redacted)
        return await dispatch(task, resume)


def run_on_worker(call: WorkerCall, task: BatchTask, resume: Checkpoint | None) -> Result:
    """Run one task to its end in this process (the body of the Ray task)."""
    return trio.run(_run_task, call, task, resume)


def _holder_gone(owner: Owner) -> bool:
    """Asked on the holder's host (a probe task pinned to a node there)."""
    return owner.gone()


# ------------------------------------------------------------- driver side


class _Waits:
    """Remote runs awaited together, with one thread (module docstring, "Waiting for results").

    Each caller of `ready` registers its object ref; whoever finds no round under
    way leads one: `ray.wait` over every ref out, in a worker thread, for up to
    `ROUND` seconds or until one is ready, then marks each ready ref's event. The
    others wait for the round's end and look again (their ref ready, or a turn to
    lead: the leader leaves once its own ref is ready).
    """

    #: Seconds a round waits at most (a ref registered meanwhile joins the next round).
    ROUND = 0.5

    def __init__(self) -> None:
        self.out: dict[Any, trio.Event] = {}
        self.leading = False
        self.round_over = trio.Event()

    async def ready(self, ref: Any) -> None:
        """Return once the remote task behind `ref` has ended (its result is ready, or its
        failure: `ray.get` then raises it)."""
        done = self.out[ref] = trio.Event()
        try:
            while not done.is_set():
                if self.leading:
                    await self.round_over.wait()
                    continue
                self.leading, self.round_over = True, trio.Event()
                try:
                    ready = await trio.to_thread.run_sync(
                        _ready, list(self.out), self.ROUND, abandon_on_cancel=True)
                    for r in ready:
                        event = self.out.get(r)
                        if event is not None:
                            event.set()
                finally:
                    self.leading = False
                    self.round_over.set()
        finally:
            del self.out[ref]


def _ready(refs: list[Any], timeout: float) -> list[Any]:
    """The refs among `refs` whose tasks have ended, waiting up to `timeout` for one."""
    import ray

    ready, rest = ray.wait(refs, num_returns=1, timeout=timeout, fetch_local=False)
    if ready and rest:  # every other one ended as well, without waiting
        more, _ = ray.wait(rest, num_returns=len(rest), timeout=0, fetch_local=False)
        ready += more
    return list(ready)


class RayDispatch:
    """Sends each task to a Ray worker; takes a dead worker's run back (module docstring).

    Args:
        journal: The driver's journal on the shared store (reads checkpoints, claims leases).
        call: What workers need (the store and the agent builder).
        address: The cluster: "auto" (a local or `$RAY_ADDRESS` cluster), or
            "host:port" of its head.
        options_for: Ray options for a task (None: one CPU each).
        max_attempts: Sends of one task before it is given up (ends `error`).
        owner: The lease holder this driver claims as (default: this process).
        holder_grace: After Ray reports a worker dead, how long (seconds) its process
            may still be seen alive before the run is given up as held elsewhere: a
            raylet's workers die after it, not with it, and on a loaded machine that
            can take seconds.
        call_for: The `WorkerCall` for one task, where it differs from `call`
            (the CLI sends a task whose stored spec had secrets taken out with a
            builder holding its line as read: it travels with the task, in Ray's
            memory, and is never written to the store).

    Connecting (`connect`) is done on first use, in a worker thread.
    """

    def __init__(self, journal: Journal, call: WorkerCall, *, address: str = "auto",
                 options_for: Callable[[Any], RayOptions] | None = None,
                 max_attempts: int = 3, owner: Owner | None = None,
                 holder_grace: float = 120.0,
                 call_for: Callable[[Any], WorkerCall] | None = None) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        if not holder_grace >= 0 or holder_grace == float("inf"):
            raise ValueError(f"holder_grace must be finite and >= 0, got {holder_grace}")
        self.holder_grace = holder_grace
        self.journal = journal
        self.call = call
        self.call_for = call_for
        self.address = address
        self.options_for = options_for
        self.max_attempts = max_attempts
        self.owner = owner if owner is not None else Owner.me()
        #: Tasks sent again after their worker died: run id -> how many times.
        self.retries: dict[str, int] = {}
        self._remote: Any = None
        self._probe: Any = None
        self._connect_lock = trio.Lock()
        self._waits = _Waits()

    def __repr__(self) -> str:
        return f"RayDispatch({self.address!r}, store={self.call.store!r})"

    def _connect(self) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=None if self.address == "auto" else self.address,
                     logging_level=logging.ERROR, log_to_driver=False,
                     configure_logging=False)
        self._remote = ray.remote(max_retries=0)(run_on_worker)
        self._probe = ray.remote(max_retries=0, num_cpus=0)(_holder_gone)

    async def connect(self) -> None:
        """Connect to the cluster (once; later calls return at once).

        Raises:
            ConnectionError: The cluster cannot be reached.
        """
        async with self._connect_lock:
            if self._remote is not None:
                return
            try:
                await trio.to_thread.run_sync(self._connect)
            except Exception as exc:
                raise ConnectionError(f"cannot reach the Ray cluster at {self.address}: "
                                      f"{exc}") from exc

    async def check_store(self) -> None:
        """Refuse a store the cluster's nodes cannot all reach (call after `connect`).

        Raises:
            ConfigError: The store is a file on this machine and a live node runs
                on another one (its runs would go to a journal nobody reads).
        """
        import ray

        nodes = await trio.to_thread.run_sync(ray.nodes)
        why = store_unreachable(self.call.store, nodes, socket.gethostname())
        if why is not None:
            raise ConfigError(why)

    async def __call__(self, task: Any, resume: Checkpoint | None) -> Result:
        """Run `task` (run_id, task_id, spec) on the cluster to its end; its result.

        Raises:
            RunHeldElsewhereError: Its worker died and the run's lease is held by a
                process not provably gone.
            StoreError: The store cannot be read or written.
            RuntimeError: The worker's own code raised (not the run: a bug or a
                broken install on the worker).
        """
        import ray.exceptions as rex

        await self.connect()
        opts = (self.options_for(task) if self.options_for else RayOptions()).ray_kwargs()
        opts.setdefault("scheduling_strategy", "SPREAD")
        one = BatchTask(task.task_id, task.run_id, dict(task.spec))
        call = self.call_for(task) if self.call_for is not None else self.call
        attempt = 0
        while True:
            attempt += 1
            ref = self._remote.options(**opts).remote(call, one, resume)
            try:
                return await self._get(ref)
            except rex.RayTaskError as exc:
                raise RuntimeError(f"the Ray worker failed running {task.run_id}: "
                                   f"{exc.cause!r}") from None
            except rex.RayError as exc:
                # The worker or its node died (or the result was lost with it).
                if attempt >= self.max_attempts:
                    return Result(status=Status.ERROR, run_id=task.run_id,
                                  error=f"its Ray worker died {attempt} times; last: "
                                        f"{type(exc).__name__}",
                                  reason="ray worker lost")
                back = await self.take_back(task.run_id)
                if isinstance(back, Result):
                    return back
                resume = back
                self.retries[task.run_id] = self.retries.get(task.run_id, 0) + 1

    async def _get(self, ref: Any) -> Result:
        import ray

        try:
            await self._waits.ready(ref)
            result = await trio.to_thread.run_sync(ray.get, ref, abandon_on_cancel=True)
        except trio.Cancelled:
            # The batch is being cancelled: the remote run is cancelled too (it stays
            # resumable, like any run stopped by a shutdown).
            ray.cancel(ref)
            raise
        if not isinstance(result, Result):
            raise TypeError(f"the Ray worker returned {type(result).__name__}, not Result")
        return result

    async def take_back(self, run_id: str) -> Checkpoint | Result | None:
        """After a worker running `run_id` died: where the run stands, and its lease.

        Returns None if it never started (send it again), its `Result` if it
        ended, else its checkpoint, with the lease now this driver's.

        Ray's verdict comes before the worker's process is gone (a raylet's
        workers exit after it), so a holder still alive is asked again until
        `holder_grace` has passed.

        Raises:
            RunHeldElsewhereError: The holder cannot be proved gone within `holder_grace`.
        """
        store = self.journal.store
        give_up_at: float | None = None
        while True:
            saved = await self.journal.read(lambda: store.saved_runs(run_id=run_id))
            if not saved:
                return None
            run = saved[0]
            if run.status != "running":
                return _ended(run_id, run.status)
            if await self.claim(run_id):
                break
            now = trio.current_time()
            if give_up_at is None:
                give_up_at = now + self.holder_grace
            elif now >= give_up_at:
                raise RunHeldElsewhereError(
                    f"run {run_id}: its worker died, but its lease is held by pid "
                    f"{run.owner.pid} on {run.owner.host}, which could not be proved gone "
                    f"in {self.holder_grace:g} s")
            await trio.sleep(0.25)
        saved = await self.journal.read(lambda: store.saved_runs(run_id=run_id))
        checkpoint: Checkpoint = saved[0].checkpoint
        return checkpoint

    async def claim(self, run_id: str) -> bool:
        """Take an interrupted run's lease for this driver: True if it is now ours.

        Like the store's own claim (a holder on this host is checked by pid),
        plus Ray's proof for a holder on another host (module docstring). The
        batch runner calls this, when a dispatcher has it, before resuming a run
        of an interrupted batch.
        """
        store = self.journal.store
        await self.connect()
        saved = await self.journal.read(lambda: store.saved_runs(run_id=run_id))
        if not saved or saved[0].status != "running":
            return False
        holder = saved[0].owner
        vouch = None
        if holder != self.owner:
            if not await self._provably_gone(holder):
                return False
            vouch = holder
        [ok] = await self.journal.transact([ClaimRun(run_id, self.owner, gone=vouch)])
        return bool(ok)

    async def _provably_gone(self, holder: Owner) -> bool:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if holder.host == socket.gethostname() and holder.gone():
            return True
        nodes = await trio.to_thread.run_sync(ray.nodes)
        here = [n for n in nodes if n.get("NodeManagerHostname") == holder.host]
        live = [n for n in here if n.get("Alive")]
        if live:
            strategy = NodeAffinitySchedulingStrategy(live[0]["NodeID"], soft=False)
            ref = self._probe.options(scheduling_strategy=strategy).remote(holder)
            try:
                return bool(await trio.to_thread.run_sync(ray.get, ref,
                                                          abandon_on_cancel=True))
            except ray.exceptions.RayError:
                return False  # the probe's node died too: ask again on the next death
        # Every Ray node on that host is dead by the GCS's verdict: its workers died
        # with their raylet. A host Ray never knew is not one of ours.
        return bool(here)


def store_unreachable(store: str, nodes: list[dict[str, Any]], here: str) -> str | None:
    """Why the cluster's `nodes` (as `ray.nodes()` lists them) cannot share `store`, or None.

    A PostgreSQL URL is shared by whoever can reach the server; a file path only
    by nodes on this machine (`here`, its host name).
    """
    if store.startswith(("postgresql://", "postgres://")):
        return None
    away = sorted({str(n.get("NodeManagerHostname")) for n in nodes
                   if n.get("Alive") and n.get("NodeManagerHostname") != here})
    if not away:
        return None
    return (f"the Ray cluster has nodes on other machines ({', '.join(away[:3])}), which "
            f"cannot write the store on this one ({store}): give them a shared store "
            "(--store postgresql://...)")


def _ended(run_id: str, checkpoint_status: str) -> Result:
    """The result of a run that ended on a worker that died before answering."""
    if checkpoint_status == "completed":
        return Result(status=Status.OK, run_id=run_id,
                      reason="ended on a Ray worker that died before reporting")
    return Result(status=Status.ERROR, run_id=run_id,
                  error="the run failed on a Ray worker that died before reporting it "
                        "(see `kernel show`)")
