"""Batch defects fixed: recovery leaves a batch's runs to it, a finished batch never runs a
task again, a task whose dispatch failed leaves the batch unfinished (real journals)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import trio

from batteries.audit import JournalAudit
from batteries.batch import BatchRunner, KernelDispatch
from batteries.checkpoint import JournalCheckpointer
from batteries.recovery import Recovery, Resumed
from batteries.store import BatchTask, CreateBatch, Journal, Owner, SQLiteStore, journal_path
from kernel import (
    Checkpoint,
    CommandSpec,
    Limits,
    Ports,
    PortSpec,
    Result,
    RunInfo,
    RunSpec,
    Status,
    Step,
    new_run_id,
)

GONE = Owner(os.uname().nodename, 0, None)  # pid 0 on this host: provably gone


class Echo:
    def __init__(self, n: int) -> None:
        self.n = n

    async def step(self, ctx: Any) -> Step:
        return Step(output=self.n, final=True)


def build(spec: Any) -> tuple[Any, RunInfo, Limits]:
    return Echo(spec["n"]), RunInfo(name=f"t{spec['n']}"), Limits(timeout=60)


def store_at(tmp_path: Path) -> SQLiteStore:
    return SQLiteStore(journal_path(tmp_path / "k.duckdb"))


# ------------------------------------------------------------------ recovery


def _command_of_batch(db: Path, batch_id: str) -> RunSpec:
    """A plain command run of batch `batch_id`, registered by a process that has died."""
    spec = RunSpec(CommandSpec(("sleep", "60")), RunInfo(name="task"), Limits(timeout=60),
                   PortSpec(db=str(db), no_critic=True), cwd=str(db.parent),
                   batch={"batch_id": batch_id, "task_id": "t0"})
    cp = JournalCheckpointer(db)
    cp.owner = Owner(socket.gethostname(), os.getpid(), 1)  # our pid, another start: gone

    async def go() -> None:
        await cp.register(spec.run_id, spec)
        await cp.save(Checkpoint(spec.run_id, 0, None))

    trio.run(go)
    return spec


def _recovery(db: Path) -> Recovery:
    def no_groups(group: Any) -> int:
        raise AssertionError(f"no process group was recorded, got {group}")

    return Recovery(db, build=lambda spec: Echo(0), stop_group=no_groups)


def test_recovery_leaves_a_batch_run_to_its_batch(tmp_path: Path) -> None:
    """A stored batch's interrupted command is neither resumed nor closed `lost` by
    recovery, claimed or not: refused naming the batch, and still interrupted."""
    db = tmp_path / "k.duckdb"
    spec = _command_of_batch(db, "bkeep234")
    store_at(tmp_path).commit(None, [CreateBatch(
        "bkeep234", (BatchTask("t0", spec.run_id, spec.to_dict()),), GONE)])
    rec = _recovery(db)
    [listed] = rec.interrupted()
    assert rec.batch_of(listed) == "bkeep234"
    seen: list[Resumed] = []
    [done] = trio.run(lambda: rec.recover(on_done=seen.append))
    assert seen == [done] and done.lost is None and done.result is None
    assert done.refused == ("belongs to batch bkeep234, which resumes it: "
                            "kernel batch --resume bkeep234")
    # Claimed first (kernel resume, another order): prepare refuses and gives it back.
    saved = rec.claim(spec.run_id)
    assert saved is not None
    got = rec.prepare(saved)
    assert isinstance(got, Resumed) and got.refused == done.refused and got.lost is None
    [still] = rec.interrupted()
    assert still.run_id == spec.run_id and still.status == "running"
    assert store_at(tmp_path).batch_tasks("bkeep234")[0].run_status is None


def test_a_run_whose_batch_is_gone_is_recovered_as_before(tmp_path: Path) -> None:
    """A run naming a batch the store no longer keeps (purged) is recovery's: a plain
    command is closed `lost`, as any other."""
    db = tmp_path / "k.duckdb"
    spec = _command_of_batch(db, "bgone234")
    rec = _recovery(db)
    [done] = trio.run(rec.recover)
    assert done.run_id == spec.run_id
    assert done.lost == "a plain command has no resumable state"
    assert rec.interrupted() == []


# ------------------------------------------------------------------ the runner


class Counting:
    """KernelDispatch that counts the tasks it was given (each start once)."""

    def __init__(self, inner: KernelDispatch) -> None:
        self.inner = inner
        self.calls: list[str] = []

    async def __call__(self, task: BatchTask, resume: Checkpoint | None) -> Result:
        self.calls.append(task.task_id)
        return await self.inner(task, resume)


async def test_a_finished_batch_whose_runs_were_purged_runs_nothing_again(
        tmp_path: Path) -> None:
    """A resume of a finished batch whose ended runs were purged (kernel purge) reports
    them `purged`, skipped, and runs none of them again."""
    async with Journal.open(tmp_path / "k.duckdb") as journal:
        ports = Ports(audit=JournalAudit(journal), checkpointer=JournalCheckpointer(journal))
        counting = Counting(KernelDispatch(ports, build))
        runner = BatchRunner(journal, counting, concurrency=3)
        ts = [BatchTask(f"t{i}", new_run_id(), {"n": i}) for i in range(6)]
        bid = await runner.create(ts)
        first = await runner.run(bid)
        assert [o.status for o in first] == [Status.OK] * 6 and runner.finished
        await journal.commit_buffered()
        # `kernel purge --days 0`: the ended runs go; the batch is finished just now, so
        # a purge with a cut-off before its end keeps it (as one of --days N does).
        [row] = store_at(tmp_path).batches(batch_id=bid)
        assert row.ended_at is not None
        cut = int(row.ended_at.timestamp() * 1e6)
        purged_runs, _ = store_at(tmp_path).purge(cut)
        assert purged_runs == 6, "the runs ended before the batch did"
        assert store_at(tmp_path).batches(batch_id=bid), "the batch itself is kept"
        again = BatchRunner(journal, counting, concurrency=3)
        outs = await again.run(bid)
    assert counting.calls == [t.task_id for t in ts]  # each task started once, ever
    assert {(o.status, o.skipped) for o in outs} == {("purged", True)}
    assert again.finished


class Dies:
    """A dispatch that breaks its contract for one task (as a dead worker does), after
    its run registered (started) or before (never started)."""

    def __init__(self, inner: KernelDispatch, registered: str, unregistered: str) -> None:
        self.inner = inner
        self.registered = registered
        self.unregistered = unregistered

    async def __call__(self, task: BatchTask, resume: Checkpoint | None) -> Result:
        if task.task_id == self.unregistered:
            raise RuntimeError("no worker is left")
        if task.task_id == self.registered:
            cp = self.inner.ports.checkpointer
            await cp.register(task.run_id, task.spec)  # type: ignore[union-attr]
            raise RuntimeError("the worker died")
        return await self.inner(task, resume)


async def test_a_failed_dispatch_leaves_the_batch_unfinished_as_the_journal_has_it(
        tmp_path: Path) -> None:
    """A dispatch that raises is reported as its run stands (`running`: started;
    `pending`: never started), the batch stays unfinished, and a resume runs them."""
    # The first runner: this pid with another start time, so once it is done its
    # leases are provably gone (as after the process died).
    dead = Owner(socket.gethostname(), os.getpid(), 1)
    async with Journal.open(tmp_path / "k.duckdb") as journal:
        checkpointer = JournalCheckpointer(journal)
        checkpointer.owner = dead
        ports = Ports(audit=JournalAudit(journal), checkpointer=checkpointer)
        runner = BatchRunner(journal, Dies(KernelDispatch(ports, build), "t1", "t2"),
                             concurrency=2, owner=dead)
        ts = [BatchTask(f"t{i}", new_run_id(), {"n": i}) for i in range(4)]
        bid = await runner.create(ts)
        outs = await runner.run(bid)
        assert [o.status for o in outs] == ["ok", "running", "pending", "ok"]
        assert "the worker died" in (outs[1].error or "")
        assert not runner.finished
    [row] = store_at(tmp_path).batches(batch_id=bid)
    assert row.status == "running" and row.interrupted  # resumable
    async with Journal.open(tmp_path / "k.duckdb") as journal:
        ports = Ports(audit=JournalAudit(journal), checkpointer=JournalCheckpointer(journal))
        resumer = BatchRunner(journal, KernelDispatch(ports, build))
        again = await resumer.run(bid)
    assert [o.status for o in again] == ["ok"] * 4
    assert [(o.skipped, o.resumed) for o in again] == [(True, False), (False, True),
                                                       (False, False), (True, False)]
    assert resumer.finished
