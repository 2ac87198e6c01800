"""Many runs under one set of ports: a batch of run specs, a concurrency limit, resumable.

    async with Journal.open(db) as journal:
        ports = Ports(audit=JournalAudit(journal), budget=JournalBudget(journal),
                      checkpointer=JournalCheckpointer(journal), critic=WatchCritic())
        runner = BatchRunner(journal, KernelDispatch(ports, build), concurrency=32)
        batch_id = await runner.create([BatchTask("t1", new_run_id(), spec), ...])
        outcomes = await runner.run(batch_id)

A batch is stored in the journal when it is created: the batch row (its
lease: the holder's host, pid and the pid's start time) and one row per
task holding the task's run spec and **the run id it becomes**, fixed
before anything runs. A task's state is therefore its run's: no task row
changes while the batch runs (but where its delivery stands, for a batch
that delivers its results), and a run costs the batch nothing beyond the
transactions the run makes anyway.

`run(batch_id)` takes the batch's lease (`ClaimBatch`: refused while its
holder may be alive, so two resumers never run one batch) and looks at
every task's run:

- ended, with no checkpoint left `running`: finished; skipped (reported);
- a checkpoint still `running` (its holder died, or it was cancelled by a
  shutdown): interrupted; its run lease is claimed (`ClaimRun`, so `kernel
  recover` and the batch never both resume it; a dispatcher with a `claim`
  method, such as `RayDispatch`, claims it with its own proof) and it is
  resumed from its last checkpoint under the same run id, without a second
  budget reservation (the kernel tells the budget the run resumed). A lease
  whose holder is still alive (the interrupted batch's own workers can
  outlive it by a moment: a Ray worker, a process not yet reaped) is tried
  again for up to `holder_wait` seconds before the task is reported
  `running` (held by another process; the batch stays unfinished). A plain
  command keeps no state: its one step (the command) runs again from the
  start, which is what a resumed loop does with the state it was in;
- started but neither ended nor checkpointed: lost (`LoseRun`); so is a run
  whose checkpoint says it ended (`completed`/`failed`) while its row was
  never closed (the process died between the two commits): it is not run
  again, and its reason says it ended but its status was not recorded;
- not started: run; but in a batch that had been `finished` every task had
  run to its end, so a task whose run is gone from the journal (`kernel
  purge` deletes ended runs) is reported `purged` and never run again.

The batch is marked `finished` only once every task's run has ended. A
task whose dispatch failed (a batch worker process died while it ran the
task, the journal could not be written) is reported as its run stands in
the journal (`running`: started and unfinished, or `pending`: never
started) and leaves the batch unfinished: held by this process, so it is
interrupted once this process is gone and `run` (a resume) finishes it.

`BatchDelivery` delivers each run's result as it ends (a directory, webhooks:
any `Delivery`), off the run's slot and a bounded number at once, so a slow
or failing webhook never holds up the batch's runs. Given to `run`, it keeps
where each task's delivery stands in the journal (`TaskRow.delivery`): marked
`pending` before the run starts, `delivered` or `failed` as its delivery
ends; a later `run` (a resume) delivers again every result still owed (its
delivery failed, or never ended because the batch process died or was
stopped), as the journal has it, without running the task again.

Dispatching one task is `Dispatch.__call__(task, resume) -> Result`: one
task in, one result out, with no other state shared with the batch.
`KernelDispatch` is the default (the batch's ports, an agent built from the
spec by a host-given builder, since batteries never import adapters); a
host can put the same call on another worker (Ray) as long as that worker
writes to the same store.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from kernel import (
    AgentError,
    Checkpoint,
    Delivery,
    DeliveryError,
    Kernel,
    Limits,
    PortFailure,
    Ports,
    Result,
    RunContext,
    RunInfo,
    Status,
    Step,
    Usage,
)

from .store import (
    BatchRow,
    BatchStore,
    BatchTask,
    ClaimBatch,
    ClaimRun,
    CreateBatch,
    FinishBatch,
    Journal,
    LoseRun,
    MarkDelivery,
    Op,
    Owner,
    SavedRun,
    StoreError,
    TaskRow,
)
from .store._types import DELIVERY_DONE, DELIVERY_FAILED, DELIVERY_PENDING

__all__ = [
    "DELIVERY_LIMIT",
    "PURGED",
    "UNDELIVERED",
    "UNFINISHED",
    "BatchBusyError",
    "BatchDelivery",
    "BatchRunner",
    "BatchTask",
    "Dispatch",
    "KernelDispatch",
    "TaskOutcome",
    "new_batch_id",
    "run_spec_of",
]

#: Letters of a batch id: lower case, no 0/o, 1/l/i (typeable, unambiguous).
ALPHABET = "23456789abcdefghjkmnpqrstuvwxyz"
#: Characters after the leading "b" of a batch id (31**7: about 2.7e10 ids).
ID_LEN = 7


def new_batch_id() -> str:
    """A new batch id: `b` and 7 characters a person can read aloud and type."""
    return "b" + "".join(secrets.choice(ALPHABET) for _ in range(ID_LEN))


class BatchBusyError(StoreError):
    """The batch is held by another process that may still be running it."""


@dataclass(slots=True)
class TaskOutcome:
    """How one task of a batch ended (in this process, or before it for a skipped task).

    Attributes:
        status: The run's status (a `Status` value, or `lost`); for a task this `run`
            did not finish, `running` or `pending` (`UNFINISHED`); for a task of a
            finished batch whose run was purged since, `purged`.
        result: The run's result; None for a task skipped because it had finished.
        skipped: It had finished before this `run` (a resumed batch).
        resumed: It was interrupted and continued from its checkpoint.
        error: Why, for anything but ok.
        delivery: Where the delivery of its result stands (`TaskRow.delivery`):
            `delivered`, `failed` or `pending` (owed: not delivered yet, or stopped
            before its delivery ended); None when there was nothing to deliver. A task
            skipped with its result owed (`UNDELIVERED`) carries the result as the journal
            has it when `run` was given a delivery, which delivers it.
    """

    index: int
    task_id: str
    run_id: str
    status: str
    result: Result | None = None
    skipped: bool = False
    resumed: bool = False
    error: str | None = None
    delivery: str | None = None

    @property
    def ended(self) -> bool:
        """True when the task's run has ended (or is gone after it did): nothing left to run."""
        return self.status not in UNFINISHED

    @property
    def ok(self) -> bool:
        """True when the run ended `ok`."""
        return self.status == Status.OK

    @property
    def undelivered(self) -> bool:
        """True when its run ended and its result is owed a delivery (`UNDELIVERED`)."""
        return self.delivery in UNDELIVERED and self.ended

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the task, and its result's fields when it ran (or was delivered)
        here."""
        doc: dict[str, Any] = self.result.to_dict() if self.result is not None else {}
        doc.update(index=self.index, task_id=self.task_id, run_id=self.run_id,
                   status=self.status, skipped=self.skipped, resumed=self.resumed,
                   delivery=self.delivery)
        if self.error is not None or "error" not in doc:
            doc["error"] = self.error
        return doc


#: `TaskOutcome.status` of a task this `run` did not finish: its run started and has
#: not ended (`running`), or it never started (`pending`); the batch stays unfinished.
UNFINISHED = frozenset({"running", "pending"})
#: `TaskOutcome.status` of a task of a finished batch whose run was purged meanwhile.
PURGED = "purged"
#: `TaskOutcome.delivery` of a task whose result did not reach its destinations: its
#: delivery failed, or never ended (the batch process died or was stopped first). The
#: journal keeps it so (`TaskRow.delivery`), and a `run` given a delivery (a resume)
#: delivers it again without running the task.
UNDELIVERED = frozenset({DELIVERY_PENDING, DELIVERY_FAILED})


class Dispatch(Protocol):
    """Runs one task of a batch to its end: one task in, one result out.

    **Protocol:** `resume` is None for a task that never started, else the
    checkpoint of an interrupted run whose lease the caller already holds.
    Must run the task under `task.run_id` and return its `Result` (never
    raise for the run's own failures). May be called concurrently; an outer
    cancellation propagates like `Kernel.run`'s.
    """

    async def __call__(self, task: BatchTask, resume: Checkpoint | None) -> Result: ...


#: Keys of a task's spec that say where to run it, not what: read by a dispatcher
#: (`"ray"`: `batteries.ray_dispatch.RayOptions`), never part of the run's own spec.
PLACEMENT_KEYS = frozenset({"ray"})


def run_spec_of(task_spec: Mapping[str, Any]) -> dict[str, Any]:
    """The run spec in a task's spec: everything but its placement keys.

    This is what is registered for the run (what `kernel recover` rebuilds it
    from) and what `kernel.RunSpec.from_dict` reads.
    """
    return {k: v for k, v in task_spec.items() if k not in PLACEMENT_KEYS}


#: Builds what a spec describes: (agent, info, limits). Raises for a spec it cannot build.
AgentBuilder = Callable[[Mapping[str, Any]], tuple[Any, RunInfo, Limits]]


class _Unbuildable:
    """An agent whose only step fails: a spec that cannot be built still becomes an
    audited run that ends `error` with the reason (never a silent gap)."""

    def __init__(self, why: str) -> None:
        self.why = why

    async def step(self, ctx: RunContext) -> Step:
        raise AgentError(self.why)


class KernelDispatch:
    """The default `Dispatch`: build the agent from the task's spec, run it with `ports`.

    Args:
        ports: Shared by every task (one journal behind audit, budget and
            checkpointer; the checkpointer registers each new run's spec).
        build: Turns a task's run spec into (agent, info, limits).
        critic_for: Picks the critic for a spec (per-task thresholds); None
            uses `ports.critic` for every task.
        redacted: The specs were redacted by the checkpointer's redactor when
            the batch was stored (`JournalCheckpointer.register(redacted=True)`).
    """

    def __init__(self, ports: Ports, build: AgentBuilder, *,
                 critic_for: Callable[[Mapping[str, Any]], Any] | None = None,
                 redacted: bool = False) -> None:
        self.ports = ports
        self.build = build
        self.critic_for = critic_for
        self.redacted = redacted
        self._kernels: dict[int, Kernel] = {}

    async def __call__(self, task: BatchTask, resume: Checkpoint | None) -> Result:
        spec = task.spec
        try:
            agent, info, limits = self.build(spec)
        except Exception as exc:  # validated before the batch started: the world changed
            agent, limits = _Unbuildable(f"cannot build the run: {exc}"), Limits()
            found = spec.get("info")
            raw: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
            info = RunInfo(name=str(raw.get("name") or task.task_id),
                           caller_id=str(raw.get("caller_id") or ""))
        info.run_id = task.run_id
        critic = self.critic_for(spec) if self.critic_for is not None else self.ports.critic
        # One kernel per critic, reused: a kernel's watcher follows all its runs.
        kernel = self._kernels.get(id(critic))
        if kernel is None:
            kernel = self._kernels[id(critic)] = Kernel(
                dataclasses.replace(self.ports, critic=critic))
        ports = kernel.ports
        register = getattr(ports.checkpointer, "register", None)
        if register is not None:
            # A resumed run is registered again: it is held by this process now.
            stored = run_spec_of(spec)  # what recover rebuilds the run from
            if self.redacted:
                await register(task.run_id, stored, redacted=True)
            else:
                await register(task.run_id, stored)
        return await kernel.run(agent, info, limits, resume=resume)


@dataclass(slots=True)
class _Todo:
    row: TaskRow
    resume: bool = False


@dataclass
class BatchRunner:
    """Creates batches in the journal and runs (or resumes) them, `concurrency` at a time.

    Args:
        journal: The journal the batch and its runs are written to.
        dispatch: Runs one task (`KernelDispatch` with the batch's ports).
        concurrency: At most this many runs at once (>= 1).
        before_resume: Awaited with a run id before an interrupted run is resumed
            (the CLI stops any process the dead run left behind).
        holder_wait: Seconds an interrupted run whose lease is held by a live
            process is tried again (every 0.05-1 s) before its task is reported
            `running`: the interrupted batch's own workers may still be exiting.

    Attributes:
        running: Tasks in flight: run id -> (task, trio time it started).
        outcomes: Every outcome of the current `run`, in the order they ended.
        finished: The last `run` marked the batch `finished` (every task's run ended);
            False when some task was left unfinished (see the module docstring).
    """

    journal: Journal
    dispatch: Dispatch
    concurrency: int = 8
    before_resume: Callable[[str], Awaitable[None]] | None = None
    holder_wait: float = 10.0
    owner: Owner = field(default_factory=Owner.me)
    running: dict[str, tuple[BatchTask, float]] = field(default_factory=dict)
    outcomes: list[TaskOutcome] = field(default_factory=list)
    finished: bool = field(default=False, init=False)
    _created: tuple[str, tuple[BatchTask, ...]] | None = field(default=None, init=False,
                                                               repr=False)
    _batch_id: str = field(default="", init=False, repr=False)
    #: Set by `claim`: (the batch id, whether it had been `finished`, created here).
    _claimed: tuple[str, bool, tuple[BatchTask, ...] | None] | None = field(
        default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not self.holder_wait >= 0:
            raise ValueError(f"holder_wait must be >= 0 seconds, got {self.holder_wait}")

    @property
    def store(self) -> BatchStore:
        """The journal's store, which must keep batches.

        Raises:
            StoreError: It is a `RunStore` that keeps no batches.
        """
        store = self.journal.store
        if not (callable(getattr(store, "batches", None))
                and callable(getattr(store, "batch_tasks", None))):
            raise StoreError(f"the store at {store.path} keeps no batches")
        return store  # type: ignore[return-value]

    async def create(self, tasks: Sequence[BatchTask], *, batch_id: str | None = None,
                     name: str = "", source: str = "",
                     options: Mapping[str, Any] | None = None) -> str:
        """Store a new batch held by this process; its id (one transaction).

        Raises:
            ValueError: Two tasks share a task id or a run id.
            StoreError: The journal cannot be written, or the id is taken.
        """
        seen: set[str] = set()
        runs: set[str] = set()
        for t in tasks:
            if t.task_id in seen or t.run_id in runs:
                raise ValueError(f"task {t.task_id!r}: its id or run id is used twice")
            seen.add(t.task_id)
            runs.add(t.run_id)
        bid = batch_id or new_batch_id()
        self.store  # noqa: B018  (refuse a store without batches before writing anything)
        await self.journal.transact([CreateBatch(bid, tuple(tasks), self.owner, name=name,
                                                 source=source, concurrency=self.concurrency,
                                                 options=dict(options or {}))])
        # `run` right after: every task is as stored, none started (no need to read
        # the thousand specs back).
        self._created = (bid, tuple(tasks))
        return bid

    async def batch(self, batch_id: str) -> BatchRow | None:
        """The stored batch, with its counts; None if there is none."""
        store = self.store
        rows = await self.journal.read(lambda: store.batches(batch_id=batch_id))
        return rows[0] if rows else None

    async def claim(self, batch_id: str) -> None:
        """Take the batch's lease for this process (`run` does it when it was not done).

        A host claims first to learn that another process runs the batch before it
        starts anything else (worker processes, deliveries, its progress line).

        Raises:
            BatchBusyError: Another process that may be alive holds the batch.
            StoreError: No such batch, or the journal cannot be read or written.
        """
        created, self._created = self._created, None
        fresh = created is not None and created[0] == batch_id
        # A batch that had finished ran every task to its end: a task of it without a
        # run in the journal had one, purged since (claiming makes it `running` again).
        before = None if fresh else await self.batch(batch_id)
        was_finished = before is not None and before.status == "finished"
        [claimed] = await self.journal.transact([ClaimBatch(batch_id, self.owner)])
        if not claimed:
            held = await self.batch(batch_id)
            if held is None:
                raise StoreError(f"no batch {batch_id}")
            raise BatchBusyError(f"batch {batch_id} is being run by pid {held.owner.pid} on "
                                 f"{held.owner.host}")
        self._claimed = (batch_id, was_finished,
                         created[1] if fresh and created is not None else None)

    async def run(self, batch_id: str,
                  on_outcome: Callable[[TaskOutcome], None] | None = None,
                  on_start: Callable[[BatchTask], None] | None = None, *,
                  delivery: BatchDelivery | None = None) -> list[TaskOutcome]:
        """Run every task of the batch that has not finished; every task's outcome, in order.

        Finished tasks are reported as skipped, interrupted ones resumed (see
        the module docstring). `on_outcome` is called as each task ends (skipped
        ones first), `on_start` as each starts. The batch is marked `finished`
        once every task's run has ended (`finished`); if this is cancelled, or
        a task was left unfinished (`TaskOutcome.ended` False), it stays held by
        this process and is resumable once the process is gone.

        With `delivery` (being served: `BatchDelivery.serve`), every outcome is also
        submitted to it (its `on_delivered` hears of each once its delivery ended),
        it is closed once every task ended, and `run` returns once every delivery
        ended (the batch is held until then); the journal keeps where each
        task's delivery stands: every task about to run is marked `pending` before
        it starts (a process that dies before its result was delivered leaves it
        owed), then `delivered` or `failed` as its delivery ends. A skipped task
        whose result is owed (`UNDELIVERED`: its delivery failed, or had not ended
        when the batch process died or was stopped) is delivered again, its result
        as the journal has it, without running it again.

        Raises:
            BatchBusyError: Another process that may be alive holds the batch.
            StoreError: No such batch, or the journal cannot be read or written.
        """
        store = self.store
        self.finished = False
        if self._claimed is None or self._claimed[0] != batch_id:
            await self.claim(batch_id)
        assert self._claimed is not None
        _, was_finished, created = self._claimed
        self._claimed = None
        if created is not None:
            # Created by this runner and claimed again by it: no run of it can exist.
            rows: list[TaskRow] = [TaskRow(i, t.task_id, t.run_id, dict(t.spec), None, False)
                    for i, t in enumerate(created)]
        else:
            rows = await self.journal.read(store.batch_tasks, batch_id)
        self._batch_id = batch_id
        self.outcomes = []
        done: dict[int, TaskOutcome] = {}
        if delivery is not None:
            delivery.bind(self.journal, batch_id)

        def report(out: TaskOutcome) -> None:
            done[out.index] = out
            self.outcomes.append(out)
            if on_outcome is not None:
                on_outcome(out)
            if delivery is not None:
                delivery.submit(out)

        todo: list[_Todo] = []
        lose: list[TaskRow] = []
        for row in rows:
            saved = row.saved
            if saved is not None and saved.status == "running":
                todo.append(_Todo(row, resume=True))
            elif row.run_status is not None:
                out = TaskOutcome(row.index, row.task_id, row.run_id, row.run_status,
                                  skipped=True, delivery=row.delivery)
                if delivery is not None and row.ended is not None:
                    out.result = _owed_result(row)  # delivered again (`UNDELIVERED`)
                report(out)
            elif row.started:
                lose.append(row)
            elif was_finished:
                report(TaskOutcome(row.index, row.task_id, row.run_id, PURGED, skipped=True,
                                   error="its run ended in this batch and was purged from "
                                         "the journal since (kernel purge); not run again"))
            else:
                todo.append(_Todo(row))
        # Owed before it starts: a result is never lost between its run's end and the mark.
        marks: list[tuple[int, str | None, str | None]] = [
            (t.row.index, DELIVERY_PENDING, None) for t in todo
            if t.row.delivery != DELIVERY_PENDING] if delivery is not None else []
        # A lost run is never delivered (its kernel never ended it): nothing is owed.
        marks += [(r.index, None, None) for r in lose if r.delivery is not None]
        ops: list[Op] = [MarkDelivery(batch_id, tuple(marks))] if marks else []
        if lose:
            whys = [_lost_why(r.saved) for r in lose]
            await self.journal.transact([*ops, *(LoseRun(r.run_id, why)
                                                 for r, why in zip(lose, whys, strict=True))])
            for r, why in zip(lose, whys, strict=True):
                report(TaskOutcome(r.index, r.task_id, r.run_id, str(Status.LOST), error=why))
        elif ops:
            await self.journal.transact(ops)

        queue = iter(todo)

        async def worker() -> None:
            for item in queue:
                report(await self._one(item, on_start))

        async with trio.open_nursery() as nursery:
            for _ in range(min(self.concurrency, len(todo))):
                nursery.start_soon(worker)
        await trio.lowlevel.checkpoint()  # a `serve` started beside this one has begun
        if delivery is not None and delivery.serving:
            # The batch stays held until its deliveries ended: a resume started meanwhile
            # is refused instead of delivering again what is under way here.
            delivery.close()
            await delivery.served.wait()
        if all(out.ended for out in done.values()):
            finish = FinishBatch(batch_id, self.owner)
            try:
                await self.journal.transact([finish])
            except StoreError as exc:
                # Every run's own rows are in; only the batch's mark is not (the journal
                # locked past its timeout, a server away). It rides with the next
                # transaction, or the exit flush (a spill file when even that cannot
                # write): a traceback here lost it and told the user nothing.
                _log.warning("batch %s: cannot mark it finished now (%s); it is marked with "
                             "the journal's next write", batch_id, exc)
                await self.journal.later(finish)
            self.finished = True
        return [done[r.index] for r in rows]

    async def _one(self, item: _Todo, on_start: Callable[[BatchTask], None] | None
                   ) -> TaskOutcome:
        row = item.row
        task = BatchTask(row.task_id, row.run_id, row.spec)
        checkpoint = None
        if item.resume:
            saved = await self._claim(row.run_id)
            if not saved or saved[0].status != "running":
                return TaskOutcome(row.index, row.task_id, row.run_id, "running",
                                   error="held by another process that is still alive")
            checkpoint = saved[0].checkpoint
            task = BatchTask(row.task_id, row.run_id, saved[0].spec)
            if self.before_resume is not None:
                await self.before_resume(row.run_id)
        self.running[row.run_id] = (task, trio.current_time())
        if on_start is not None:
            on_start(task)
        try:
            result = await self.dispatch(task, checkpoint)
        except Exception as exc:  # a dispatch that broke its contract (a worker died)
            # Said as the journal has it; the batch stays unfinished, so a resume finishes it.
            return TaskOutcome(row.index, row.task_id, row.run_id, await self._standing(row),
                               resumed=item.resume, error=f"{type(exc).__name__}: {exc}")
        finally:
            self.running.pop(row.run_id, None)
        return TaskOutcome(row.index, row.task_id, row.run_id, str(result.status), result,
                           resumed=item.resume, error=result.error or result.reason
                           if result.status is not Status.OK else None)

    async def _standing(self, row: TaskRow) -> str:
        """Where a task whose dispatch failed stands in the journal: `running` (its run
        started and has not ended), `pending` (it never started: no checkpoint, which a
        run registers before it starts), or its run's status (it ended after all).
        `running` when the journal cannot tell."""
        store = self.store
        try:
            saved = await self.journal.read(lambda: store.saved_runs(run_id=row.run_id))
            if not saved or saved[0].status == "running":
                # One read per task: a batch whose every worker is gone fails its
                # remaining tasks at once, without a checkpoint each.
                return "running" if saved else "pending"
            rows: list[TaskRow] = await self.journal.read(store.batch_tasks, self._batch_id)
        except StoreError:
            return "running"
        now = next((r for r in rows if r.run_id == row.run_id), None)
        if now is None or now.run_status is None:
            return "running" if now is None or now.started else "pending"
        return now.run_status

    async def _claim(self, run_id: str) -> list[SavedRun]:
        """Take an interrupted run's lease; its saved state, or [] if another process holds
        it still after `holder_wait` seconds (or it is no longer `running`)."""
        # A dispatcher that can prove more than this host can (Ray: a holder on a
        # dead node) claims the lease itself; otherwise the store's rule decides.
        claim = getattr(self.dispatch, "claim", None)
        give_up = trio.current_time() + self.holder_wait
        pause = 0.05
        while True:
            if callable(claim):
                ok = bool(await claim(run_id))
            else:
                [ok] = await self.journal.transact([ClaimRun(run_id, self.owner)])
            saved: list[SavedRun] = await self.journal.read(
                lambda: self.journal.store.saved_runs(run_id=run_id))
            if ok:
                return saved
            left = give_up - trio.current_time()
            if left <= 0 or not saved or saved[0].status != "running":
                return []  # held past the wait, or finished meanwhile: nothing to wait for
            await trio.sleep(min(pause, left))
            pause = min(pause * 2, 1.0)


def _lost_why(saved: SavedRun | None) -> str:
    """Why a task whose run started and never closed cannot go on: it kept no checkpoint,
    or it ended (its checkpoint says so) and its process died before its row was closed
    (the run is not run again: its work is done, its status was not recorded)."""
    if saved is None:
        return "the batch was interrupted and the run kept no checkpoint"
    return (f"the run ended (its checkpoint is {saved.status}), but the batch process "
            "died before the run's status was recorded; not run again")


def _owed_result(row: TaskRow) -> Result | None:
    """The result of an ended run whose delivery is owed, as the journal's runs row has it
    (`TaskRow.ended`: what `kernel show --json` prints: its secrets redacted, its output
    as stored, no traceback or artifacts); None when the row names no status."""
    e = row.ended
    if e is None or row.run_status is None:
        return None
    try:
        status = Status(row.run_status)
    except ValueError:
        return None

    def count(key: str) -> int:
        v = e.get(key)
        return int(v) if isinstance(v, (int, float)) else 0

    cost, runtime = e.get("cost_usd"), e.get("runtime_seconds")
    exit_code = e.get("exit_code")
    return Result(status=status, run_id=row.run_id, name=str(e.get("name") or ""),
                  output=e.get("output"), error=e.get("error"), reason=e.get("reason"),
                  steps=count("steps"), tool_calls=count("tool_calls"),
                  usage=Usage(count("input_tokens"), count("output_tokens"),
                              count("thinking_tokens"),
                              float(cost) if isinstance(cost, (int, float)) else 0.0),
                  runtime_seconds=float(runtime) if isinstance(runtime, (int, float)) else 0.0,
                  exit_code=int(exit_code) if isinstance(exit_code, int) else None)


_log = logging.getLogger("kernel.batch")

#: Results a `BatchDelivery` delivers at once (their webhook requests and folder writes).
DELIVERY_LIMIT = 32


class BatchDelivery:
    """Delivers the result of each run of a batch as it ends, off the run's slot.

        delivery = BatchDelivery(FanOutDelivery([...]), on_delivered=report)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(delivery.serve)
            await runner.run(batch_id, delivery=delivery)   # returns once all delivered

    `submit` (the runner submits each outcome) queues an outcome that carries a
    result (its run ended in this process, or a resumed batch owed it a
    delivery) and passes any other (skipped, lost, unfinished: nothing to
    deliver) straight to `on_delivered`. `serve` delivers the queue, at most
    `limit` results at once, each bounded by its delivery's own limits (a
    webhook's attempts and total time): a run's slot is free as soon as the
    run ends, and a slow or failing webhook delays only the deliveries behind
    it, never the runs.

    As in a run (`Delivery`), a delivery is an observer: a failure is put on
    the result's `port_failures` (`delivery.deliver: DeliveryError: ...`, as
    the kernel puts it) and logged, and never changes the status. Each
    outcome reaches `on_delivered` once, after its delivery, with
    `TaskOutcome.delivery` saying how it went (`delivered`, `failed`, or
    `pending` when it was stopped). Cancelling `scope` (or giving it a
    deadline) stops the deliveries left: each outcome not delivered reaches
    `on_delivered` with a failure saying so.

    Given to `BatchRunner.run(delivery=...)`, it is bound to the batch's journal
    (`bind`): as each delivery ends, where it stands is written there
    (`MarkDelivery`; a failure's error passed through `redact` first; one the
    journal will not take then goes with its next write) before `on_delivered`
    hears of it, so a resume delivers again what failed or never ended. A
    delivery stopped before it ended is left `pending` (owed). A result a resume
    owes (a skipped task's, as the journal has it: its output as stored, no
    artifacts) goes to `redeliver` (default: `delivery`): a host gives one that
    leaves a destination holding the result already as it is
    (`DirectoryDelivery(replace=False)`), so the journal's copy never replaces
    the one the run delivered.

    Unlike a run's own delivery, a failure is not in the run's audit: the
    run's row is closed when its result comes back.
    """

    def __init__(self, delivery: Delivery, *, limit: int = DELIVERY_LIMIT,
                 on_delivered: Callable[[TaskOutcome], None] | None = None,
                 redact: Callable[[str], str] | None = None,
                 redeliver: Delivery | None = None) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.delivery = delivery
        #: Delivers a result a resume owes (a skipped task's, rebuilt from the journal).
        self.redeliver = delivery if redeliver is None else redeliver
        self.limit = limit
        self.on_delivered = on_delivered
        self.redact = redact
        #: Results queued or being delivered.
        self.pending = 0
        #: Results whose delivery failed (or never happened), so far.
        self.failed = 0
        #: Deliveries whose end the journal (`bind`) would not take when it ended, so far:
        #: it rides with the journal's next write (its exit flush, a spill file); until
        #: then the journal has it `pending`.
        self.unrecorded = 0
        #: Cancel it (or set its deadline) to stop delivering.
        self.scope = trio.CancelScope()
        #: Set when `serve` has returned (everything delivered, or given up).
        self.served = trio.Event()
        #: `serve` has started.
        self.serving = False
        self._send, self._receive = trio.open_memory_channel[TaskOutcome](math.inf)
        self._stopped = False
        #: `close` was called: no more outcomes come (in a batch, every run has ended).
        self.closed = False
        self._journal: Journal | None = None
        self._batch_id = ""

    def bind(self, journal: Journal, batch_id: str) -> None:
        """Write where each delivery stands to `journal`, as batch `batch_id`'s tasks'
        (`BatchRunner.run(delivery=...)` binds it to the batch it runs)."""
        self._journal, self._batch_id = journal, batch_id

    def submit(self, out: TaskOutcome) -> None:
        """Queue `out`'s result for delivery (or pass on an outcome without a result)."""
        if out.result is None:
            self._done(out)
            return
        self.pending += 1
        if self._stopped:
            self._failed(out, DeliveryError(_NOT_DELIVERED), DELIVERY_PENDING)
        else:
            self._send.send_nowait(out)

    def close(self) -> None:
        """No more outcomes will come: `serve` returns once the queue is delivered."""
        self.closed = True
        self._send.close()

    async def serve(self) -> None:
        """Deliver what is submitted, `limit` at once, until `close` and an empty queue
        (or `scope` is cancelled: what is left is passed on, undelivered)."""
        self.serving = True
        try:
            with self.scope:
                async with trio.open_nursery() as nursery:
                    for _ in range(self.limit):
                        nursery.start_soon(self._deliver_queued)
        finally:
            self._stopped = True
            while True:  # stopped first: what is still queued is not delivered
                try:
                    out = self._receive.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
                self._failed(out, DeliveryError(_NOT_DELIVERED), DELIVERY_PENDING)
            self.served.set()

    async def _deliver_queued(self) -> None:
        async for out in self._receive:
            assert out.result is not None
            ended = False
            error: Exception | None = None
            try:
                # A skipped task's result is one a resume owes: its own delivery
                # (`redeliver`) leaves a destination that has it already as it is.
                await (self.redeliver if out.skipped else self.delivery).deliver(out.result)
                ended = True
            except Exception as exc:
                ended = True
                error = exc
            finally:
                # Cancelled (`scope`), maybe as a group of `Cancelled` (a fan-out's nursery):
                # left `pending` in the journal, delivered again by a resume.
                if not ended:
                    self._failed(out, DeliveryError(_NOT_DELIVERED), DELIVERY_PENDING)
            await self._record(out, error)
            if error is None:
                out.delivery = DELIVERY_DONE
                self._done(out)
            else:
                self._failed(out, error, DELIVERY_FAILED)

    async def _record(self, out: TaskOutcome, error: Exception | None) -> None:
        """Write where `out`'s delivery stands to the bound journal (shielded: a delivery
        that ended is recorded also when the batch is being stopped, so a resume does
        not send it twice).

        At once, not gathered with the next ones: a process killed between a delivery's
        end and its mark sends it again on resume (the journal's group commit still
        puts the marks of the same moment in one transaction). A mark the journal will
        not take now (locked past its timeout, a server away) rides with its next
        write, or its exit flush (a spill file when even that cannot write): it was
        dropped, leaving the task `pending` for ever after an exit 0 (`--list` counted
        it owed, a resume sent it twice).
        """
        journal = self._journal
        if journal is None:
            return
        why = None
        if error is not None:
            why = _why(error)
            if self.redact is not None:
                why = self.redact(why)
        mark = MarkDelivery(self._batch_id, (
            (out.index, DELIVERY_DONE if error is None else DELIVERY_FAILED, why),))
        failure = "no answer from the journal in time"
        with trio.CancelScope(shield=True) as shielded:
            shielded.deadline = trio.current_time() + RECORD_LIMIT
            try:
                await journal.transact([mark])
                return
            except StoreError as exc:
                failure = str(exc)
        self.unrecorded += 1
        _log.warning("cannot record the delivery of run %s in the journal now (it is "
                     "written with the journal's next write): %s", out.run_id, failure,
                     extra={"run_id": out.run_id, "error": failure})
        try:
            await journal.later(mark)
        except StoreError as exc:  # the journal is closed: a resume delivers it again
            _log.warning("the delivery of run %s stays owed in the journal: %s",
                         out.run_id, exc, extra={"run_id": out.run_id, "error": str(exc)})

    def _failed(self, out: TaskOutcome, exc: BaseException, state: str) -> None:
        assert out.result is not None
        self.failed += 1
        out.delivery = state
        msg = _why(exc)
        out.result.port_failures.append(PortFailure("delivery", "deliver", msg))
        _log.warning("port failed: delivery.deliver: %s (run %s)", msg, out.run_id,
                     extra={"port": "delivery", "method": "deliver", "error": msg,
                            "run_id": out.run_id})
        self._done(out)

    def _done(self, out: TaskOutcome) -> None:
        if out.result is not None:
            self.pending -= 1
        if self.on_delivered is not None:
            self.on_delivered(out)


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


#: Seconds a delivery's end may take to be written to the journal (a backstop: the
#: journal's own lock timeout ends a write that waits for a lock first).
RECORD_LIMIT = 60.0
_NOT_DELIVERED = "not delivered: the batch was stopped before its delivery ended"


def default_concurrency() -> int:
    """A concurrency for hosts that give none: the CPUs this process may use, at least 4."""
    return max(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
               else (os.cpu_count() or 1))
