"""Batches in the journal, the journal's shared transactions, and the library batch runner."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import trio

from batteries.audit import JournalAudit
from batteries.batch import BatchBusyError, BatchRunner, KernelDispatch, new_batch_id
from batteries.budget import JournalBudget
from batteries.checkpoint import JournalCheckpointer
from batteries.store import (
    BatchTask,
    ClaimBatch,
    CreateBatch,
    FinishBatch,
    Journal,
    Owner,
    RegisterRun,
    ReserveBudget,
    SaveCheckpoint,
    SetBudget,
    SQLiteStore,
    StoreError,
    journal_path,
)
from batteries.store._types import _proc_start
from kernel import Checkpoint, Limits, Ports, RunInfo, Status, Step, new_run_id
from kernel.testing import ScriptedAgent

DEAD = Owner("elsewhere-not-this-host", 1, None)  # on another host: never presumed gone
GONE = Owner(os.uname().nodename, 0, None)  # pid 0 on this host: provably gone


def _owner_of(pid: int) -> Owner:
    """Another process on this host as a lease holder (its pid and start time)."""
    return Owner(socket.gethostname(), pid, _proc_start(pid))


@pytest.fixture
def holder() -> Iterator[subprocess.Popen[bytes]]:
    """A live process on this host to hold a run's lease (killed and reaped afterwards)."""
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    proc.kill()
    proc.wait()


def tasks(n: int, **spec: Any) -> list[BatchTask]:
    return [BatchTask(f"t{i}", new_run_id(), {"n": i, **spec}) for i in range(n)]


def store_at(tmp_path: Path) -> SQLiteStore:
    return SQLiteStore(journal_path(tmp_path / "k.duckdb"))


@pytest.fixture(params=["sqlite", "postgres"])
def batch_store(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """Both stores keep batches: the journal, and PostgreSQL (tests/pg_server.py)."""
    if request.param == "sqlite":
        yield store_at(tmp_path)
        return
    from batteries.store import PostgresStore

    store = PostgresStore(request.getfixturevalue("pg_url"))
    yield store
    store.close()


class TestStoredBatches:
    def test_create_list_claim_finish(self, batch_store: Any) -> None:
        """A batch is stored with every task's run id; its lease works like a run's."""
        store = batch_store
        me = Owner.me()
        ts = tasks(3)
        [ok] = store.commit(None, [CreateBatch("b1", tuple(ts), me, name="one", concurrency=2)])
        assert ok is True
        [dup] = store.commit(None, [CreateBatch("b1", tuple(ts), me)])
        assert isinstance(dup, StoreError) and "already exists" in str(dup)
        [row] = store.batches()
        assert (row.batch_id, row.name, row.tasks, row.concurrency, row.status) == (
            "b1", "one", 3, 2, "running")
        assert row.counts == {"pending": 3} and not row.interrupted
        got = store.batch_tasks("b1")
        assert [(t.index, t.task_id, t.run_id) for t in got] == [
            (i, t.task_id, t.run_id) for i, t in enumerate(ts)]
        assert [t.spec["n"] for t in got] == [0, 1, 2] and not any(t.started for t in got)
        other = Owner(me.host, os.getppid(), None)  # alive: may not take it
        assert store.commit(None, [ClaimBatch("b1", other)]) == [False]
        assert store.commit(None, [ClaimBatch("b1", me)]) == [True]
        assert store.commit(None, [FinishBatch("b1", other)]) == [False]
        assert store.commit(None, [FinishBatch("b1", me)]) == [True]
        [row] = store.batches(prefix="b")
        assert row.status == "finished" and row.ended_at is not None
        assert store.commit(None, [ClaimBatch("nope", me)]) == [False]

    def test_gone_holder_is_interrupted(self, batch_store: Any) -> None:
        """A running batch whose holder is provably gone is interrupted and can be claimed."""
        store = batch_store
        store.commit(None, [CreateBatch("b2", tuple(tasks(1)), GONE),
                            CreateBatch("b3", tuple(tasks(1)), DEAD)])
        rows = {r.batch_id: r for r in store.batches()}
        assert rows["b2"].interrupted and not rows["b3"].interrupted
        assert store.commit(None, [ClaimBatch("b2", Owner.me()),
                                   ClaimBatch("b3", Owner.me())]) == [True, False]

    def test_a_remote_holder_silent_past_the_lease(self, pg_url: str) -> None:
        """On the shared store a batch held on another machine is interrupted, and can be
        claimed, once its heartbeat is older than the lease by the server's clock."""
        import psycopg

        from batteries.store import PostgresStore

        store = PostgresStore(pg_url)
        store.commit(None, [CreateBatch("b4", tuple(tasks(2)), DEAD)])
        [row] = store.batches()
        assert not row.interrupted
        assert store.commit(None, [ClaimBatch("b4", Owner.me())]) == [False]
        with psycopg.connect(pg_url, autocommit=True) as con:
            con.execute("UPDATE kernel.batches SET heartbeat_at = heartbeat_at - 120000000")
        [row] = store.batches()
        assert row.interrupted
        assert store.commit(None, [ClaimBatch("b4", Owner.me())]) == [True]
        store.close()

    def test_ids_are_typeable(self) -> None:
        """Batch ids are short, lower case and free of look-alike characters."""
        ids = {new_batch_id() for _ in range(200)}
        assert len(ids) == 200
        assert all(len(i) == 8 and i[0] == "b" and not set(i) & set("01ilo") for i in ids)


class TestSharedTransactions:
    async def test_callers_at_once_share_transactions(self, tmp_path: Path) -> None:
        """Callers ready at once share a transaction; a budget of 5 runs still admits 5."""
        async with Journal.open(tmp_path / "k.duckdb") as journal:
            await journal.transact([SetBudget("c", 3600, 5, None, None, None)])
            before = journal.store.stats.transactions
            got: list[Any] = []

            async def reserve() -> None:
                [r] = await journal.transact([ReserveBudget("c", "")])
                got.append(r)

            async with trio.open_nursery() as nursery:
                for _ in range(20):
                    nursery.start_soon(reserve)
            used = journal.store.stats.transactions - before
        assert sum(r.reservation_id is not None for r in got) == 5
        assert len(got) == 20 and used < 20

    async def test_a_refused_op_fails_its_caller_only(self, tmp_path: Path) -> None:
        """An op the store refuses raises in its own caller; the others' ops commit."""
        async with Journal.open(tmp_path / "k.duckdb") as journal:
            outcomes: dict[str, Any] = {}

            async def bad() -> None:
                try:
                    await journal.transact([SaveCheckpoint(Checkpoint("f" * 32, 1, None),
                                                           Owner.me())])
                except StoreError as exc:
                    outcomes["bad"] = exc

            async def good() -> None:
                outcomes["good"] = await journal.transact(
                    [SetBudget("d", 60, 1, None, None, None)])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(bad)
                nursery.start_soon(good)
            assert isinstance(outcomes["bad"], StoreError)
            assert outcomes["good"] == [None]
            assert journal.store.budget("d") is not None


def build(spec: Mapping[str, Any]) -> tuple[Any, RunInfo, Limits]:
    if spec.get("broken"):
        raise ValueError("no such agent")
    agent = ScriptedAgent([Step(), Step(output=f"done {spec['n']}", final=True)],
                          step_seconds=0.01)
    return agent, RunInfo(name=f"task {spec['n']}", caller_id="lib"), Limits(timeout=60)


class TestBatchRunner:
    async def test_runs_every_task_within_the_limit(self, tmp_path: Path) -> None:
        """Every task runs once under its run id, never more than `concurrency` at a time;
        running the batch again skips them all."""
        async with Journal.open(tmp_path / "k.duckdb") as journal:
            ports = Ports(audit=JournalAudit(journal), budget=JournalBudget(journal),
                          checkpointer=JournalCheckpointer(journal))
            runner = BatchRunner(journal, KernelDispatch(ports, build), concurrency=3)
            ts = tasks(10)
            bid = await runner.create(ts, name="lib")
            peak = 0

            def started(_task: BatchTask) -> None:
                nonlocal peak
                peak = max(peak, len(runner.running))

            outs = await runner.run(bid, on_start=started)
            assert [o.task_id for o in outs] == [t.task_id for t in ts]
            assert [o.run_id for o in outs] == [t.run_id for t in ts]
            assert {o.status for o in outs} == {Status.OK}
            assert outs[4].result is not None and outs[4].result.output == "done 4"
            assert 1 <= peak <= 3
            again = await runner.run(bid)
            assert all(o.skipped and o.ok and o.result is None for o in again)
            [row] = journal.store.batches(batch_id=bid)
            assert row.status == "finished" and row.counts == {"ok": 10}

    async def test_unbuildable_spec_is_an_audited_error(self, tmp_path: Path) -> None:
        """A spec that cannot be built still becomes a run, ended `error` with the reason."""
        async with Journal.open(tmp_path / "k.duckdb") as journal:
            ports = Ports(audit=JournalAudit(journal), checkpointer=JournalCheckpointer(journal))
            runner = BatchRunner(journal, KernelDispatch(ports, build), concurrency=2)
            ts = [BatchTask("ok", new_run_id(), {"n": 0}),
                  BatchTask("bad", new_run_id(), {"n": 1, "broken": True})]
            outs = await runner.run(await runner.create(ts))
            assert [o.status for o in outs] == [Status.OK, Status.ERROR]
            assert "cannot build the run: no such agent" in (outs[1].error or "")
        [row] = store_at(tmp_path).batches()
        assert row.counts == {"ok": 1, "error": 1}

    async def test_busy_batch_is_refused(self, tmp_path: Path) -> None:
        """A batch held by another live process is not run here."""
        async with Journal.open(tmp_path / "k.duckdb") as journal:
            journal.store.commit(None, [CreateBatch("bz", tuple(tasks(1)), DEAD)])
            runner = BatchRunner(journal, KernelDispatch(Ports(), build))
            with pytest.raises(BatchBusyError, match="being run by pid 1"):
                await runner.run("bz")
            with pytest.raises(StoreError, match="no batch"):
                await runner.run("bmissing")

    async def test_a_resumed_run_waits_for_its_exiting_holder(
            self, tmp_path: Path, holder: subprocess.Popen[bytes]) -> None:
        """An interrupted run whose lease a live process still holds (the dead batch's
        worker, exiting) is taken over once that process is gone, within `holder_wait`:
        never while it lives."""
        async with Journal.open(tmp_path / "k.duckdb") as journal:
            ports = Ports(audit=JournalAudit(journal), checkpointer=JournalCheckpointer(journal))
            runner = BatchRunner(journal, KernelDispatch(ports, build), holder_wait=60)
            [task] = tasks(1)
            journal.store.commit(None, [
                CreateBatch("bw", (task,), GONE),
                RegisterRun(task.run_id, dict(task.spec), _owner_of(holder.pid))])
            outs: list[Any] = []

            async def resume() -> None:
                outs.extend(await runner.run("bw"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(resume)
                await trio.sleep(0.5)  # the runner tries meanwhile; nothing may start
                assert not outs and not runner.running
                os.kill(holder.pid, signal.SIGKILL)  # a zombie now: provably gone
            [out] = outs
            assert out.status == Status.OK and out.resumed, out

    async def test_a_holder_alive_past_the_wait_leaves_the_run_held(
            self, tmp_path: Path, holder: subprocess.Popen[bytes]) -> None:
        """Past `holder_wait` a run held by a live process is reported `running` (held by
        another process) and is not run."""
        async with Journal.open(tmp_path / "k.duckdb") as journal:
            runner = BatchRunner(journal, KernelDispatch(Ports(), build), holder_wait=0.2)
            [task] = tasks(1)
            journal.store.commit(None, [
                CreateBatch("bh", (task,), GONE),
                RegisterRun(task.run_id, dict(task.spec), _owner_of(holder.pid))])
            [out] = await runner.run("bh")
            assert out.status == "running" and not out.resumed
            assert "held by another process" in (out.error or "")
            [saved] = journal.store.saved_runs(run_id=task.run_id)
            assert saved.status == "running" and saved.owner.pid == holder.pid

    def test_holder_wait_must_not_be_negative(self, tmp_path: Path) -> None:
        """A negative `holder_wait` is refused when the runner is made."""
        with pytest.raises(ValueError, match="holder_wait"):
            BatchRunner(Journal(tmp_path / "k.duckdb"), KernelDispatch(Ports(), build),
                        holder_wait=-1)

    def test_concurrency_must_be_positive(self, tmp_path: Path) -> None:
        """A concurrency below 1 is refused when the runner is made."""
        with pytest.raises(ValueError, match="concurrency"):
            BatchRunner(Journal(tmp_path / "k.duckdb"), KernelDispatch(Ports(), build),
                        concurrency=0)
