"""Where each batch task's delivery stands, kept in the store: a delivery that failed, or
never ended (the batch process died, or was stopped), is owed, and the next `run` of the
batch (a resume) delivers it again, as the journal has the result, without running it.

Real stores (the SQLite journal, and PostgreSQL: tests/pg_server.py), the real kernel and
runner; the deliveries are hand-written `Delivery` fakes (the port), and one real
`DirectoryDelivery`.
"""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from functools import partial
from pathlib import Path
from typing import Any

import trio

from batteries.audit import JournalAudit
from batteries.batch import UNDELIVERED, BatchDelivery, BatchRunner, KernelDispatch, TaskOutcome
from batteries.checkpoint import JournalCheckpointer
from batteries.delivery import DirectoryDelivery
from batteries.redact import Redactor
from batteries.store import (
    BatchTask,
    CreateBatch,
    Journal,
    MarkDelivery,
    Owner,
    SQLiteStore,
    StoreError,
    journal_path,
)
from batteries.store._types import decode_spill, encode_spill
from kernel import Checkpoint, DeliveryError, Ports, Result, RunInfo, Status
from tests.batteries.test_batch import batch_store, build, tasks

__all__ = ["batch_store"]  # the fixture (both stores), used here

#: A secret a failing delivery's error names: stored redacted, like everything stored.
TOKEN = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"


class Recorded:
    """A delivery that keeps every result it is given; fails (naming `TOKEN`) the run ids
    in `failing`, and waits for ever on those in `hanging`."""

    def __init__(self, failing: frozenset[str] = frozenset(),
                 hanging: frozenset[str] = frozenset()) -> None:
        self.failing = failing
        self.hanging = hanging
        self.results: list[Result] = []
        self.entered = 0
        #: Set once `expect` deliveries have started.
        self.expect = 0
        self.all_in = trio.Event()

    async def deliver(self, result: Result) -> None:
        self.entered += 1
        if self.entered >= self.expect:
            self.all_in.set()
        if result.run_id in self.hanging:
            await trio.sleep_forever()
        if result.run_id in self.failing:
            raise DeliveryError(f"refused with token {TOKEN}")
        self.results.append(result)


class Counting:
    """The kernel's dispatch, counting the tasks it runs and noting where each task's
    delivery stood in the store when its run started."""

    def __init__(self, inner: KernelDispatch, journal: Journal, batch_id: list[str]) -> None:
        self.inner = inner
        self.journal = journal
        self.batch_id = batch_id
        self.ran: list[str] = []
        self.at_start: dict[str, str | None] = {}

    async def __call__(self, task: BatchTask, resume: Checkpoint | None) -> Result:
        store: Any = self.journal.store
        rows = await self.journal.read(store.batch_tasks, self.batch_id[0])
        self.at_start[task.run_id] = next(r.delivery for r in rows if r.run_id == task.run_id)
        self.ran.append(task.run_id)
        return await self.inner(task, resume)


async def deliver_batch(runner: BatchRunner, batch_id: str, delivery: BatchDelivery
                        ) -> list[TaskOutcome]:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(delivery.serve)
        outs = await runner.run(batch_id, delivery=delivery)
        delivery.close()
    return outs


def runner_for(journal: Journal, batch_id: list[str]) -> tuple[BatchRunner, Counting]:
    ports = Ports(audit=JournalAudit(journal), checkpointer=JournalCheckpointer(journal))
    dispatch = Counting(KernelDispatch(ports, build), journal, batch_id)
    return BatchRunner(journal, dispatch, concurrency=2), dispatch


def rows_of(store: Any, batch_id: str) -> dict[str, Any]:
    return {r.task_id: r for r in store.batch_tasks(batch_id)}


async def test_a_failed_delivery_is_kept_and_the_next_run_delivers_it_without_running_it(
        batch_store: Any) -> None:
    """Two of four deliveries fail: the store has them `failed` with their error (redacted),
    the other two `delivered`, counted per batch; each outcome and its --json doc says so.
    Running the batch again runs nothing and delivers exactly the two failed ones, with
    their results as the journal has them; a third run delivers nothing."""
    ts = tasks(4)
    failing = frozenset({ts[1].run_id, ts[3].run_id})
    bid: list[str] = []
    async with Journal.open(store=batch_store) as journal:
        runner, dispatch = runner_for(journal, bid)
        bid.append(await runner.create(ts))
        seen: list[TaskOutcome] = []
        first = Recorded(failing=failing)
        outs = await deliver_batch(runner, bid[0], BatchDelivery(
            first, on_delivered=seen.append, redact=Redactor().text))
        assert runner.finished and {o.status for o in outs} == {Status.OK}
        assert len(dispatch.ran) == 4
        # Marked owed before each run started.
        assert set(dispatch.at_start.values()) == {"pending"}
        by_task = {o.task_id: o for o in seen}
        assert {t: o.delivery for t, o in by_task.items()} == {
            "t0": "delivered", "t1": "failed", "t2": "delivered", "t3": "failed"}
        assert [t for t, o in sorted(by_task.items()) if o.undelivered] == ["t1", "t3"]
        assert {o.delivery for o in seen if o.undelivered} <= UNDELIVERED
        assert by_task["t1"].to_dict()["delivery"] == "failed"

        rows = rows_of(batch_store, bid[0])
        assert {t: r.delivery for t, r in rows.items()} == {
            "t0": "delivered", "t1": "failed", "t2": "delivered", "t3": "failed"}
        error = rows["t1"].delivery_error
        assert error is not None and error.startswith("DeliveryError: refused with token ")
        assert TOKEN not in error and "[REDACTED:github_token]" in error
        assert rows["t0"].ended is None and rows["t0"].delivery_error is None
        assert rows["t1"].ended is not None and rows["t1"].ended["output"] == "done 1"
        [listed] = batch_store.batches(batch_id=bid[0])
        assert listed.deliveries == {"delivered": 2, "failed": 2}

        seen.clear()
        again = Recorded()
        runner, dispatch = runner_for(journal, bid)
        outs = await deliver_batch(runner, bid[0], BatchDelivery(
            again, on_delivered=seen.append))
        assert dispatch.ran == [] and all(o.skipped for o in outs)
        assert sorted(r.run_id for r in again.results) == sorted(failing)
        for result in again.results:
            task = next(t for t in ts if t.run_id == result.run_id)
            assert (result.status, result.output, result.name, result.steps) == (
                Status.OK, f"done {task.spec['n']}", f"task {task.spec['n']}", 2)
        assert {o.task_id: o.delivery for o in seen} == {t.task_id: "delivered" for t in ts}
        assert not any(o.undelivered for o in seen)
        assert {r.delivery for r in rows_of(batch_store, bid[0]).values()} == {"delivered"}
        [listed] = batch_store.batches(batch_id=bid[0])
        assert listed.deliveries == {"delivered": 4}

        third = Recorded()
        runner, dispatch = runner_for(journal, bid)
        await deliver_batch(runner, bid[0], BatchDelivery(third))
        assert third.results == [] and dispatch.ran == []


async def test_a_delivery_that_never_ended_is_delivered_by_the_next_run(
        tmp_path: Path) -> None:
    """Deliveries that hang while the process that runs the batch goes away (its nursery
    cancelled; a SIGKILL writes nothing either): each run's result stays `pending` (marked
    before its run started), and the next run delivers them, to a real folder, without
    running them again."""
    ts = tasks(3)
    bid: list[str] = []
    async with Journal.open(tmp_path / "k.duckdb") as journal:
        runner, dispatch = runner_for(journal, bid)
        bid.append(await runner.create(ts))
        hung = Recorded(hanging=frozenset(t.run_id for t in ts))
        hung.expect = 3
        seen: list[TaskOutcome] = []
        delivery = BatchDelivery(hung, on_delivered=seen.append)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(delivery.serve)
            nursery.start_soon(partial(runner.run, bid[0], delivery=delivery))
            await hung.all_in.wait()  # every run ended and its delivery hangs
            rows = rows_of(journal.store, bid[0])
            assert {r.delivery for r in rows.values()} == {"pending"}
            assert all(r.run_status == "ok" and r.ended is not None for r in rows.values())
            [listed] = journal.store.batches()  # type: ignore[attr-defined]
            assert listed.deliveries == {"pending": 3}
            # Held while its deliveries are under way: another process may not resume it.
            assert listed.status == "running" and listed.owner.pid == Owner.me().pid
            nursery.cancel_scope.cancel()  # gone: nothing more is written for them
        assert {o.delivery for o in seen} == {"pending"} and all(o.undelivered for o in seen)
        assert {r.delivery for r in rows_of(journal.store, bid[0]).values()} == {"pending"}

        out = tmp_path / "out"
        runner, dispatch = runner_for(journal, bid)
        outs = await deliver_batch(runner, bid[0], BatchDelivery(
            DirectoryDelivery(out, limiter=trio.CapacityLimiter(2))))
        assert dispatch.ran == [] and {o.delivery for o in outs} == {"delivered"}
        for t in ts:
            doc = json.loads((out / t.run_id / "result.json").read_text())
            assert (doc["status"], doc["output"]) == ("ok", f"done {t.spec['n']}")
        assert {r.delivery for r in rows_of(journal.store, bid[0]).values()} == {"delivered"}


async def test_without_a_delivery_nothing_is_marked_and_what_is_owed_stays_owed(
        tmp_path: Path) -> None:
    """A batch run without a delivery marks nothing; an owed task run again without one is
    reported owed (nothing to deliver it with) and stays so."""
    ts = tasks(2)
    bid: list[str] = []
    async with Journal.open(tmp_path / "k.duckdb") as journal:
        runner, _ = runner_for(journal, bid)
        bid.append(await runner.create(ts))
        outs = await runner.run(bid[0])
        assert [o.delivery for o in outs] == [None, None] and not any(o.undelivered
                                                                       for o in outs)
        assert {r.delivery for r in rows_of(journal.store, bid[0]).values()} == {None}
        [listed] = journal.store.batches()  # type: ignore[attr-defined]
        assert listed.deliveries == {}

        await journal.transact([MarkDelivery(bid[0], ((0, "failed", "boom"),))])
        runner, dispatch = runner_for(journal, bid)
        outs = await runner.run(bid[0])
        assert dispatch.ran == [] and outs[0].result is None
        assert (outs[0].delivery, outs[0].undelivered) == ("failed", True)
        assert (outs[1].delivery, outs[1].undelivered) == (None, False)
        row = rows_of(journal.store, bid[0])["t0"]
        assert (row.delivery, row.delivery_error) == ("failed", "boom")


async def test_a_lost_run_owes_no_delivery(tmp_path: Path) -> None:
    """A task marked owed whose run started and never ended, with no checkpoint to resume
    (its process died): the next run closes it `lost`, and nothing is owed for it."""
    ts = tasks(2)
    bid: list[str] = []
    async with Journal.open(tmp_path / "k.duckdb") as journal:
        runner, _ = runner_for(journal, bid)
        bid.append(await runner.create(ts))
        await journal.transact([MarkDelivery(bid[0], ((0, "pending", None),))])
        audit = JournalAudit(journal)
        await audit.start_run(RunInfo(name="died", run_id=ts[0].run_id))  # never closed
        await audit.flush()
        runner, dispatch = runner_for(journal, bid)
        got = Recorded()
        outs = await deliver_batch(runner, bid[0], BatchDelivery(got))
        assert [o.status for o in outs] == ["lost", "ok"] and dispatch.ran == [ts[1].run_id]
        assert [o.delivery for o in outs] == [None, "delivered"]
        assert [r.run_id for r in got.results] == [ts[1].run_id]
        rows = rows_of(journal.store, bid[0])
        assert (rows["t0"].delivery, rows["t1"].delivery) == (None, "delivered")


def test_the_store_refuses_an_unknown_state(batch_store: Any) -> None:
    """A mark is one of pending, delivered, failed or none; anything else is refused alone."""
    ts = tasks(2)
    batch_store.commit(None, [CreateBatch("bmark", tuple(ts), Owner.me())])
    [bad, ok] = batch_store.commit(None, [MarkDelivery("bmark", ((0, "lost", None),)),
                                          MarkDelivery("bmark", ((1, "failed", "why"),
                                                                 (0, "pending", "x")))])
    assert isinstance(bad, StoreError) and "unknown delivery state 'lost'" in str(bad)
    assert ok is None
    rows = rows_of(batch_store, "bmark")
    assert (rows["t0"].delivery, rows["t0"].delivery_error) == ("pending", None)
    assert (rows["t1"].delivery, rows["t1"].delivery_error) == ("failed", "why")
    assert rows["t1"].ended is None  # its run has not ended: nothing to deliver yet


def test_a_mark_survives_a_spill() -> None:
    """A mark left for the next writer (a spill file) is read back whole."""
    op = MarkDelivery("b1", ((0, "failed", "boom"), (3, None, None)))
    [back] = decode_spill(encode_spill(_empty(), [op], spill_id="s", store="x")).ops
    assert isinstance(back, MarkDelivery) and back.batch_id == "b1"
    assert [tuple(m) for m in back.marks] == [tuple(m) for m in op.marks]


def _empty() -> Any:
    from batteries.store import Batch

    return Batch()


def test_a_journal_an_older_kernel_wrote_is_read_then_migrated(tmp_path: Path) -> None:
    """A version 4 journal (no delivery columns) is read as it is (nothing owed), and its
    first write brings it to version 5."""
    from batteries.store._sqlite import MIGRATIONS

    path = journal_path(tmp_path / "k.duckdb")
    path.parent.mkdir(parents=True, exist_ok=True)
    ts = tasks(2)
    with closing(sqlite3.connect(path, isolation_level=None)) as con:
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("BEGIN")
        for statements in MIGRATIONS[:4]:
            for sql in statements:
                con.execute(sql)
        con.execute("PRAGMA user_version = 4")
        con.execute("INSERT INTO batches (batch_id, created_at, status, tasks, concurrency, "
                    "rev) VALUES ('bold', 1, 'finished', 2, 1, 1)")
        for i, t in enumerate(ts):
            con.execute("INSERT INTO batch_tasks (batch_id, idx, task_id, run_id, spec, rev) "
                        "VALUES ('bold', ?, ?, ?, ?, 1)", (i, t.task_id, t.run_id,
                                                          json.dumps(t.spec)))
        con.execute("COMMIT")
    store = SQLiteStore(path)
    try:
        assert [(r.task_id, r.delivery, r.ended) for r in store.batch_tasks("bold")] == [
            ("t0", None, None), ("t1", None, None)]
        [row] = store.batches()
        assert row.deliveries == {} and row.counts == {"pending": 2}
        assert store.commit(None, [MarkDelivery("bold", ((1, "failed", "x"),))]) == [None]
        assert [r.delivery for r in store.batch_tasks("bold")] == [None, "failed"]
    finally:
        store.close()
    with closing(sqlite3.connect(path)) as con:
        assert con.execute("PRAGMA user_version").fetchone() == (5,)
